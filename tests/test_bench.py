"""The benchmark registry: every suite registered once, the CLI and the plots read it, the names the
notebooks import stay where they are; and the suites' CPU-side table arithmetic."""

import importlib
import json
import pkgutil
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
import torch

import cgutils.bench
from cgutils import plots
from cgutils.__main__ import main
from cgutils.bench import SUITES, Suite, method_targets
from cgutils.errors import NoCudaError
from cgutils.recorded import ResultsStore

matplotlib.use("Agg")
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_every_suite_module_is_registered_once():
    """Regression: the suites used to be listed three times in the CLI (a dict, and two if-chains),
    and a fourth place held the plot labels; a suite added in one place was missing from the others.
    Now a module of cgutils.bench that defines a suite (``measure_suite``) has exactly one registry entry."""
    suite_modules = set()
    for info in pkgutil.iter_modules(cgutils.bench.__path__):
        module = importlib.import_module(f"cgutils.bench.{info.name}")
        if hasattr(module, "measure_suite"):
            suite_modules.add(module.__name__)
    registered = [s.measure.__module__ for s in SUITES.values()]
    assert sorted(registered) == sorted(suite_modules)
    for s in SUITES.values():
        assert s.report.__module__ == s.measure.__module__, s.name  # measure and report of one suite
        assert s.description and s.tables, s.name


def test_no_results_table_is_written_by_two_suites():
    """Two suites writing one results/<gpu>/<table>.csv would overwrite each other's recordings."""
    tables = [t for s in SUITES.values() for t in s.tables]
    assert len(tables) == len(set(tables)), tables


def test_every_registered_table_is_recorded():
    """`python -m cgutils bench <suite>` without CUDA shows the committed recording of each table the
    suite registers; a table registered but never recorded would fail there."""
    store = ResultsStore()
    for s in SUITES.values():
        for t in s.tables:
            assert (store.path / f"{t}.csv").exists(), (s.name, t)


def test_cli_lists_and_runs_the_registered_suites(tmp_results, capsys, monkeypatch):
    """Adding a suite is one registry entry: the CLI takes its choices, its --help line and the printing
    from the registry (a suite missing from a hand-written list would be an `invalid choice`)."""
    printed = []
    fake = Suite("fake", "a suite only this test knows", ("fake_table",), measure=lambda opts: (None,),
                 report=lambda frames, source, prov, markdown: printed.append((dict(frames), source)))
    monkeypatch.setattr("cgutils.__main__.SUITES", {**SUITES, "fake": fake})
    monkeypatch.setattr("cgutils.env.cuda_available", lambda: False)  # show the recording, even on a GPU host
    store = ResultsStore("test-gpu")
    store.write_meta({"gpu": "Test GPU", "driver": "1.0", "torch": "2.11.0", "date": "2026-11-29T00:00:00+00:00"})
    store.save_frame("fake_table", pd.DataFrame({"x": [1]}))

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for s in (*SUITES.values(), fake):
        assert f"{s.name}:" in help_text or f"{s.name} (default):" in help_text, s.name
        assert s.description in help_text, s.name

    assert main(["bench", "fake"]) == 0
    (frames, source), = printed
    assert list(frames) == ["fake_table"] and frames["fake_table"].x.tolist() == [1]
    assert "Test GPU" in source
    assert "Showing the fake tables recorded on Test GPU" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(SUITES))
def test_suite_without_cuda_says_so_before_measuring(name, monkeypatch):
    """Every suite's measure needs CUDA and says so at once. Regression: the pitfalls suite used to
    run every entry anyway and return a table of 'no CUDA' error rows."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoCudaError, match="needs a CUDA device"):
        SUITES[name].run()


def test_run_refuses_a_measure_that_returns_the_wrong_number_of_tables():
    """The table names live in the registry only; measure returns frames in that order, so a count
    mismatch is a bug in the suite and must not save frames under the wrong names."""
    s = Suite("two", "two tables", ("a", "b"), measure=lambda opts: (pd.DataFrame(),), report=print)
    with pytest.raises(RuntimeError, match="measured 1 tables but registers 2"):
        s.run()


@pytest.mark.parametrize("suite, key, draw", [
    ("speedup", "graph_runner", lambda: plots.speedup_bars(pd.DataFrame({
        "workload": ["w"], "dtype": ["fp16"], "graph_runner_speedup": [2.0], "article_speedup": [1.5]}))),
    ("methods", "graph_runner", lambda: plots.methods_bars(pd.DataFrame({
        "workload": ["w"], "method": ["graph_runner"], "median_ms": [0.1], "status": ["ok"]}))),
    ("generation", "cgutils_graph", lambda: plots.decoder_bars(pd.DataFrame({
        "decoder": ["cgutils_graph"], "median_ms": [50.0], "tokens_per_s": [2000.0], "status": ["ok"]}))),
    ("memory", "buckets", lambda: plots.memory_plot(pd.DataFrame({
        "setup": ["buckets"], "shapes": [1], "graphs": [1], "reserved_bytes": [2**20]}))),
])
def test_plots_take_labels_from_the_registry(suite, key, draw, monkeypatch):
    """Regression: plots.py imported bench's label dicts inside functions and kept the memory setups'
    labels to itself. A label changed in the registry must show in the figure."""
    monkeypatch.setitem(SUITES[suite].labels, key, "LABEL FROM THE REGISTRY")
    fig = draw()
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    matplotlib.pyplot.close(fig)
    assert any("LABEL FROM THE REGISTRY" in t for t in texts), texts


def test_names_the_notebooks_import_are_exported():
    """Notebook cells are hashed for their recordings, so they cannot follow a rename: every name a
    notebook imports from cgutils.bench must stay in its ``__all__``."""
    wanted = set()
    for nb in NOTEBOOKS.glob("*.ipynb"):
        for cell in json.loads(nb.read_text())["cells"]:
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("from cgutils.bench import "):
                    wanted |= {n.strip() for n in line.split(" import ", 1)[1].split(",")}
    assert wanted, "no notebook imports from cgutils.bench: the scan is broken"
    assert wanted <= set(cgutils.bench.__all__), wanted - set(cgutils.bench.__all__)
    for name in cgutils.bench.__all__:
        assert getattr(cgutils.bench, name) is not None, name


def test_method_targets_tolerate_a_missing_method():
    """Regression: a method that failed or was not run (here the compiled GraphRunners) had no median,
    and method_targets divided None by a float (TypeError), losing the whole targets table; its ratios
    are NaN now and the others are still computed."""
    df = pd.DataFrame({"workload": ["w"] * 3, "method": ["manual_graph", "graph_runner", "compile_ro"],
                       "median_ms": [1.0, 1.001, 0.5], "status": ["ok"] * 3})
    t = method_targets(df).iloc[0]
    assert abs(t.runner_us_over_raw - 1.0) < 1e-6 and t.runner_vs_compile_ro == pytest.approx(2.002)
    assert pd.isna(t.runner_compiled_vs_compile_ro)
