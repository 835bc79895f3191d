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
