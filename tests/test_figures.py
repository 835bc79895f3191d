"""Committed figures are drawn from the committed data: each names the store entries it was drawn from,
with their content hashes (plots.save_figure), and a figure older than its data fails here."""


import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cgutils import env, plots  # noqa: E402
from cgutils.errors import RecordingError  # noqa: E402
from cgutils.libcode import file_hash  # noqa: E402
from cgutils.store import ResultsStore  # noqa: E402

FIGURES = sorted(env.REPO_ROOT.glob("figures/*.png")) + sorted(env.REPO_ROOT.glob("figures/*.svg"))
FIX = "redraw them from the committed data with `python -m cgutils figures` (or `make record` on a GPU)"


@pytest.mark.parametrize("path", FIGURES, ids=lambda p: p.name)
def test_committed_figure_is_drawn_from_the_committed_data(path):
    """figures/launch_chain.png said 7.44 µs while notebook 01 said 8.75 µs: the fit had changed after the
    figure was committed."""
    meta = plots.figure_sources(path)
    assert meta.get("data"), f"{path.name} does not name the data it was drawn from; {FIX}"
    store = ResultsStore(meta["store"], env.REPO_ROOT / "results")
    for name, digest in meta["data"].items():
        assert file_hash(store.value_file(name)) == digest, (
            f"{path.name} was drawn from an older {name} than the one committed; {FIX}")


def test_every_figure_has_png_and_svg():
    stems = {p.stem for p in FIGURES}
    assert stems and all((env.REPO_ROOT / "figures" / f"{s}.{ext}").exists() for s in stems for ext in ("png", "svg"))


def test_save_figure_records_its_sources(tmp_results, tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    store = ResultsStore("nvidia-h200")
    store.write_meta({"gpu": "NVIDIA H200", "date": "2026-11-30"})
    import pandas as pd

    store.save_frame("table", pd.DataFrame({"a": [1, 2]}))
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    paths = plots.save_figure(fig, "demo", data=["table"], folder=tmp_path)
    plt.close(fig)
    for p in paths:
        meta = plots.figure_sources(p)
        assert meta == {"data": {"table": file_hash(store.path / "table.csv")}, "store": "nvidia-h200"}
    store.save_frame("table", pd.DataFrame({"a": [1, 3]}))  # the data moves on: the figure is older now
    assert plots.figure_sources(paths[0])["data"]["table"] != file_hash(store.path / "table.csv")
    with pytest.raises(RecordingError, match="no recorded table, value or file 'nothing'"):
        plots.save_figure(fig, "demo", data=["nothing"], folder=tmp_path)
