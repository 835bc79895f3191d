"""The plot helpers on hand-made frames."""


def test_time_per_item_divides_each_variant_by_the_setting():
    """08's batch sweep was drawn as a speedup over eager, the noisy quantity; the per-item view draws the times."""
    import pandas as pd

    from cgutils.plots import sweeps

    rows = pd.DataFrame({"batch": [1, 4, 1, 4], "variant": ["eager", "eager", "graph_runner", "graph_runner"],
                         "median_ms": [6.0, 8.0, 1.0, 2.0], "p10_ms": [5.0, 7.0, 1.0, 2.0],
                         "p90_ms": [7.0, 9.0, 1.0, 2.0]})
    fig = sweeps.time_per_item(rows, "batch")
    lines = [line for line in fig.axes[0].get_lines() if line.get_marker() == "o"]
    assert [list(line.get_ydata()) for line in lines] == [[6.0, 2.0], [1.0, 0.5]]


def test_a_share_never_rounds_to_all_or_nothing():
    """notebook 07's coverage figure labelled a replay with three eager islands "100% graphed" (0.995)."""
    from cgutils.plots import share

    assert share(0.995) == "99.5%" and share(1.0) == "100%" and share(0.0) == "0%"
    assert share(0.42) == "42%" and share(0.003) == "0.3%" and share(0.9999) == "99.99%"


def test_the_static_buffers_diagram_keeps_every_label_off_the_pool_box():
    """The "read out" arrow label ran into the shared pool's box (a learner review of notebook 03)."""
    from matplotlib.patches import Rectangle

    from cgutils.plots import diagrams

    fig = diagrams.static_buffers_diagram(graphs=3)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    pool = next(p for p in ax.patches if isinstance(p, Rectangle) and p.get_facecolor()[:3] != (1, 1, 1))
    box = pool.get_window_extent(renderer).padded(0.03 * fig.dpi)  # a label needs some air, not just no overlap
    outside = [t for t in ax.texts if t.get_text() and "pool" not in t.get_text()]  # arrows are empty texts
    overlapping = [t.get_text() for t in outside if t.get_window_extent(renderer).overlaps(box)]
    assert len(outside) == 3 * 8 and not overlapping, f"labels over the pool box: {overlapping}"
    fig.clear()


def test_the_capture_replay_diagram_names_both_rows_and_no_label_overprints_another():
    """Notebook 02's schematic of capture and replay (a learner review asked for a picture of the mechanism)."""
    from cgutils.plots import diagrams

    fig = diagrams.capture_replay_diagram()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.axes[0].texts if t.get_text()]
    names = " ".join(t.get_text() for t in texts)
    assert "graph.replay()" in names and "static input" in names and "once" in names and "every call" in names
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    clashes = [(a, b) for i, (a, ea) in enumerate(boxes) for b, eb in boxes[i + 1:] if ea.overlaps(eb)]
    assert not clashes, f"labels printed over each other: {clashes}"
    fig.clear()
