"""The benchmark registry: every suite registered once, the CLI and the plots read it, the names the
notebooks import stay where they are; and the suites' CPU-side table arithmetic."""

import importlib
import json
import pkgutil
from pathlib import Path
from types import SimpleNamespace

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
        "setup": ["buckets"], "shapes": [1], "graphs": [1], "reserved_bytes": [2**20], "pool_bytes": [2**20]}))),
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


# --- the speedup table: interleaved trials, ranges in the summary, the README table and the figure ----


def _speedup_rows(with_trials: bool) -> pd.DataFrame:
    """A two-row speedup table by hand: eager 5.20 ms (p10 4.99, p90 5.38) and GraphRunner 0.60 ms.
    The paired GraphRunner speedup (8.77×, 8.61–8.90) differs from 5.20 / 0.60 = 8.67× on purpose."""
    common = {"workload": "w", "dtype": "fp16", "gpu_ops": 180, "forwards": 1, "article_eager_ms": 3.2,
              "article_graph_ms": 2.4, "status": "ok", "gpu": "Fake GPU", "n": 70, "setup_s": 0.1}
    rows = [
        {**common, "variant": "eager", "median_ms": 5.20, "p10_ms": 4.99, "p90_ms": 5.38,
         "speedup": 1.0, "speedup_p10": 1.0, "speedup_p90": 1.0, "trials": 7},
        {**common, "variant": "graph_runner", "median_ms": 0.60, "p10_ms": 0.59, "p90_ms": 0.61,
         "speedup": 8.77, "speedup_p10": 8.61, "speedup_p90": 8.90, "trials": 7},
        {**common, "variant": "compile_ro", "status": "skipped: not measured here (shapes change every step)"},
    ]
    df = pd.DataFrame(rows)
    if not with_trials:  # as recorded before interleaved trials
        df = df.drop(columns=["trials", "speedup_p10", "speedup_p90"])
        df["speedup"] = [1.0, 5.20 / 0.60, float("nan")]
    return df


def _markdown_cells(md: str, workload: str) -> dict:
    """``{column header: cell text}`` of ``workload``'s row in a markdown table."""
    lines = md.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    row = next(line for line in lines if line.startswith(f"| {workload} "))
    return dict(zip(header, (c.strip() for c in row.strip("|").split("|")), strict=True))


def test_summary_and_markdown_show_the_range_across_trials():
    from cgutils.bench import markdown_table, summary_table

    s = summary_table(_speedup_rows(True)).iloc[0]
    assert s.graph_runner_speedup == pytest.approx(8.77)  # the paired speedup, not 5.20 / 0.60
    assert (s.graph_runner_speedup_p10, s.graph_runner_speedup_p90) == (8.61, 8.90)
    assert (s.eager_p10, s.eager_p90, s.trials) == (4.99, 5.38, 7)
    md = markdown_table(_speedup_rows(True), {"gpu": "Fake GPU"})
    cells = _markdown_cells(md, "w")
    assert cells["eager ms"] == "5.20 (4.99–5.38)" and cells["speedup"] == "8.77× (8.61–8.90)"
    assert float(cells["GraphRunner ms"]) == 0.6  # stable: no range shown
    assert md.rstrip().endswith("median of 7 interleaved trials; range p10–p90 across trials.")


def test_summary_and_markdown_of_a_table_without_trials_show_no_range():
    """Tables recorded before interleaved trials (results/nvidia-h200/speedup.csv until 2026-12-01) keep their
    table; the committed recording has ranges now."""
    from cgutils.bench import markdown_table, summary_table

    s = summary_table(_speedup_rows(False))
    assert not [c for c in s.columns if c.endswith(("_p10", "_p90")) or c == "trials"]
    assert s.graph_runner_speedup.iloc[0] == pytest.approx(5.20 / 0.60)
    md = markdown_table(_speedup_rows(False), {"gpu": "Fake GPU"})
    cells = _markdown_cells(md, "w")
    assert float(cells["eager ms"]) == 5.2 and cells["speedup"] == "8.67×"
    assert md.rstrip().endswith("batch 1, median of CUDA-event timings.") and "interleaved" not in md
    recorded = ResultsStore("nvidia-h200", Path(__file__).resolve().parents[1] / "results")
    md = markdown_table(recorded.load_frame("speedup"), recorded.meta_for("speedup"))
    assert "interleaved" in md and "–" in md  # measured in trials: ranges shown


@pytest.mark.parametrize("with_trials", [True, False])
def test_speedup_figure_shows_the_range_as_error_bars(with_trials):
    from cgutils.bench import summary_table

    fig = plots.speedup_bars(summary_table(_speedup_rows(with_trials)))
    bars = [c for c in fig.axes[0].containers if isinstance(c, matplotlib.container.BarContainer)]
    matplotlib.pyplot.close(fig)
    assert bars
    errorbars = [b.errorbar for b in bars if b.errorbar is not None]
    if not with_trials:
        assert not errorbars
        return
    (eb,) = errorbars
    (segments,) = [c for c in eb.lines[2]]  # the vertical line of the one bar: from p10 to p90
    (x0, y0), (x1, y1) = segments.get_segments()[0]
    assert (y0, y1) == pytest.approx((8.61, 8.90))


def test_compile_is_measured_where_shapes_change(monkeypatch):
    """GPT-2's compile row was skipped as "one recompilation per length", which nothing measured; now it is
    measured like every other row (notebook 02 shows what reduce-overhead does with a new shape)."""
    from types import SimpleNamespace

    from cgutils.bench import make_step

    compiled = []
    monkeypatch.setattr("torch.compile", lambda fn, mode=None: compiled.append((fn, mode)) or "compiled")
    step = object()
    assert make_step("compile_ro", SimpleNamespace(shapes_change=True, step=step)) == "compiled"
    assert compiled == [(step, "reduce-overhead")]


def test_speedup_table_sets_up_every_variant_then_times_them_interleaved(monkeypatch):
    """CUDA faked away, stand-in steps on the CPU: every variant's first call (capture or compilation)
    runs before any timed call and the dynamo reset only then; a variant failing in set-up and one
    failing in a trial get error rows while the others are measured in all trials."""
    from types import SimpleNamespace

    from cgutils.bench import speedup
    from cgutils.timing import Timing
    from cgutils.workloads import Built

    log = []
    counts = {}

    def step_for(kind):
        def step(x):
            counts[kind] = counts.get(kind, 0) + 1
            log.append(kind)
            if kind == "compile_ro":
                raise RuntimeError("compile broke")
            if kind == "raw_graph" and counts[kind] > 20:  # set-up 1 + warm-up 5 + 5 per trial: in trial 2
                raise RuntimeError("replay broke")
            return x
        return step

    built = Built(model=torch.nn.Identity(), step=lambda x: x, inputs=lambda seed: (torch.zeros(1),),
                  iterate=lambda impl, inputs: impl(*inputs))
    workload = SimpleNamespace(name="w", article_ms=(2.0, 1.0), build=lambda dtype, device: built)
    monkeypatch.setattr(speedup, "require_cuda", lambda *a: None)
    monkeypatch.setattr(speedup, "get_workload", lambda name: workload)
    monkeypatch.setattr(speedup, "gpu_activity", lambda run: (7, 0.0))
    monkeypatch.setattr(speedup, "measure", lambda *a, **k: Timing(5.0, 5.0, 5.0, 3, "cuda_event"))  # eager estimate
    monkeypatch.setattr(speedup, "make_step", lambda kind, b: step_for(kind))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch._dynamo, "reset", lambda: log.append("reset"))

    df = speedup.speedup_table(["w"], ["fp16"], progress=False, trials=3, budget_s=0.01)
    assert log[:3] == ["eager", "graph_runner", "raw_graph"]  # set-up, in order
    # the compiled variants in a second phase, after the hand-captured graphs were timed (and freed): the
    # dynamo reset once, eager set up again as their baseline, then both compiled variants; nothing of the
    # first phase runs after the reset
    assert log.count("reset") == 1
    reset = log.index("reset")
    assert log[reset:reset + 4] == ["reset", "eager", "compile_ro", "graph_runner_compiled"]
    assert not {"graph_runner", "raw_graph"} & set(log[reset:])
    assert list(df.columns) == speedup.COLUMNS
    r = df.set_index("variant")
    assert r.loc["raw_graph", "status"] == "error: RuntimeError: replay broke"
    assert r.loc["compile_ro", "status"] == "error: RuntimeError: compile broke"
    assert list(r.loc[["eager", "graph_runner", "graph_runner_compiled"], "status"]) == ["ok", "ok", "ok"]
    assert list(r.loc[["eager", "graph_runner"], "trials"]) == [3, 3]
    e, g = r.loc["eager"], r.loc["graph_runner"]
    assert (e.speedup, e.speedup_p10, e.speedup_p90) == (1.0, 1.0, 1.0)
    assert g.speedup_p10 <= g.speedup <= g.speedup_p90 and g.setup_s >= 0
    # eager estimated at 5 ms, budget 0.01 s: 10 timed iterations (the floor) over 3 trials -> 4 per trial
    assert e.n == g.n == 12
    assert counts["graph_runner"] == 1 + 5 + 3 * (1 + 4)  # set-up, warm-up, trials
    # phase 2 sets eager up and times it again, as the baseline of graph_runner_compiled (compile_ro failed)
    assert counts["eager"] == 2 * counts["graph_runner"] == 2 * counts["graph_runner_compiled"]
    assert counts["raw_graph"] == 21  # failed in the last trial: no partial trials in its row
    assert pd.isna(r.loc["raw_graph", "median_ms"])


def test_speedup_table_profiles_only_after_every_timed_trial(monkeypatch):
    """torch.profiler leaves launches slower in its process (pytorch/pytorch#144455): with two workloads,
    no set-up or timed call of either may come after the first profiler session (before the fix, each
    workload was profiled before its own trials, so the second workload was timed after a profile)."""
    from cgutils.bench import speedup
    from cgutils.timing import Timing
    from cgutils.workloads import Built

    log = []

    def build(name):
        def step(x):
            log.append(("step", name))
            return x
        built = Built(model=torch.nn.Identity(), step=step, inputs=lambda seed: (torch.zeros(1),),
                      iterate=lambda impl, inputs: impl(*inputs))
        return SimpleNamespace(name=name, article_ms=None, build=lambda dtype, device: built)

    workloads = {n: build(n) for n in ("w1", "w2")}

    def profile(run):
        log.append(("profile",))
        run()
        return 7, 3000.0

    monkeypatch.setattr(speedup, "require_cuda", lambda *a: None)
    monkeypatch.setattr(speedup, "get_workload", workloads.__getitem__)
    monkeypatch.setattr(speedup, "gpu_activity", profile)
    monkeypatch.setattr(speedup, "measure", lambda *a, **k: Timing(5.0, 5.0, 5.0, 3, "cuda_event"))
    monkeypatch.setattr(speedup, "make_step", lambda kind, b: b.step)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    df = speedup.speedup_table(["w1", "w2"], ["fp16"], variants=["eager", "graph_runner"], progress=False,
                               trials=2, budget_s=0.01)
    first_profile = log.index(("profile",))
    assert log.count(("profile",)) == 2  # one eager iteration per workload and dtype
    assert {("step", "w1"), ("step", "w2")} <= set(log[:first_profile])
    assert all(e == ("profile",) or e[0] == "step" for e in log)
    timed_after = [e for e in log[first_profile:] if e != ("profile",)]
    assert len(timed_after) == 2  # only the profiled iterations themselves
    assert list(df.gpu_ops) == [7] * 4 and list(df.gpu_time_ms) == [3.0] * 4


def test_launch_bound_table_times_every_case_before_profiling_any(monkeypatch):
    """Every wall time of launch_bound_table is measured before its first profiler session (before the
    fix, BERT's profile preceded the replay's and ResNet-50's timing)."""
    import cgutils.generation
    import cgutils.workloads
    from cgutils import overhead
    from cgutils.timing import Timing

    log = []
    built = SimpleNamespace(step=lambda *a: None, inputs=lambda seed: (None,), model=None)
    fake = SimpleNamespace(build=lambda dtype, device: built)
    monkeypatch.setattr(cgutils.workloads, "WORKLOADS", dict.fromkeys(
        ("bert-base-seq128", "resnet50", "gpt2-generate100"), fake))

    class State:
        def __init__(self, model, batch, max_len):
            pass

        def prefill(self, ids):
            pass

        def decode_step(self):
            pass

    monkeypatch.setattr(cgutils.generation, "StaticKVState", State)
    monkeypatch.setattr(overhead, "require_cuda", lambda *a: None)
    monkeypatch.setattr(overhead, "capture_graph", lambda step, warmup: (SimpleNamespace(replay=step), None))
    monkeypatch.setattr(overhead, "measure", lambda run, **k: log.append("time") or Timing(0.1, 0.1, 0.1, 50, "cuda_event"))
    monkeypatch.setattr(overhead, "gpu_activity", lambda run: log.append("profile") or (10, 40.0))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    table = overhead.launch_bound_table(progress=False)
    assert log == ["time"] * 6 + ["profile"] * 6
    assert list(table.kernels) == [10] * 6 and list(table.wall_us.round(6)) == [100.0] * 6
    assert table.idle_fraction.round(6).tolist() == [0.6] * 6


def test_speedup_table_checks_trials_first():
    from cgutils.bench import speedup_table
    from cgutils.errors import InputError

    with pytest.raises(InputError, match="trials must be an int >= 1"):
        speedup_table(trials=0)


def test_compile_phase_starts_after_the_other_graphs_are_freed(monkeypatch):
    """With GraphRunner's and the raw graphs alive while torch.compile's graph trees were set up, freeing them
    ended in 'CUDA error: unspecified launch failure' on the H200 (a GraphRunner of another model freed
    before). compile_ro is now set up only once the first phase's steps are gone."""
    import weakref

    from cgutils.bench import speedup
    from cgutils.timing import Timing
    from cgutils.workloads import Built

    alive_at_compile = []
    refs = {}

    class Step:
        def __init__(self, kind):
            self.kind = kind

        def __call__(self, x):
            return x

    def make_step(kind, built):
        if kind == "compile_ro":
            alive_at_compile.extend(k for k, r in refs.items() if k != "eager" and r() is not None)
        step = Step(kind)
        refs[kind] = weakref.ref(step)
        return step

    built = Built(model=torch.nn.Identity(), step=lambda x: x, inputs=lambda seed: (torch.zeros(1),),
                  iterate=lambda impl, inputs: impl(*inputs))
    workload = SimpleNamespace(name="w", article_ms=None, build=lambda dtype, device: built)
    monkeypatch.setattr(speedup, "require_cuda", lambda *a: None)
    monkeypatch.setattr(speedup, "get_workload", lambda name: workload)
    monkeypatch.setattr(speedup, "gpu_activity", lambda run: (7, 0.0))
    monkeypatch.setattr(speedup, "measure", lambda *a, **k: Timing(5.0, 5.0, 5.0, 3, "cuda_event"))
    monkeypatch.setattr(speedup, "make_step", make_step)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch._dynamo, "reset", lambda: None)
    log = []
    df = speedup.speedup_table(["w"], ["fp16"], progress=False, trials=2, budget_s=0.01, trial_log=log)
    assert alive_at_compile == []
    assert set(df.status) == {"ok"}
    assert sorted(pd.concat(log).groupby("phase").variant.unique().map(sorted).map(tuple)) == [
        ("compile_ro", "eager", "graph_runner_compiled"), ("eager", "graph_runner", "raw_graph")]


def test_graph_runner_compiled_is_timed_beside_reduce_overhead_and_gets_a_column():
    """The speedup table had no GraphRunner(compile=True) variant, so its README table made reduce-overhead look
    ahead of GraphRunner (Inductor's kernels against eager's); it is set up and timed in the compiled phase."""
    from cgutils.bench import markdown_table
    from cgutils.bench.speedup import VARIANTS, phases

    assert "graph_runner_compiled" in VARIANTS
    assert phases(list(VARIANTS)) == (["eager", "graph_runner", "raw_graph"],
                                      ["eager", "compile_ro", "graph_runner_compiled"])
    rows = _speedup_rows(True)
    assert "GraphRunner(compile=True) ms" not in markdown_table(rows, {"gpu": "Fake GPU"})  # older recordings
    extra = rows.iloc[[1]].assign(variant="graph_runner_compiled", median_ms=0.41)
    cells = _markdown_cells(markdown_table(pd.concat([rows, extra]), {"gpu": "Fake GPU"}), "w")
    assert float(cells["GraphRunner(compile=True) ms"]) == 0.41


def test_the_summary_carries_the_gpu_time_of_one_eager_iteration():
    """The replay's floor (the GPU's own work) was measured by gpu_activity and dropped; tables without it load."""
    from cgutils.bench import summary_table

    assert "gpu_time_ms" not in summary_table(_speedup_rows(True))
    assert summary_table(_speedup_rows(True).assign(gpu_time_ms=0.35)).gpu_time_ms.iloc[0] == 0.35


def test_profiler_aftereffect_refuses_bad_arguments_before_running(tmp_path):
    """--repeats 0 wrote an empty result with rc 0; an --out that is a file failed only after every child had run;
    with no GPU each child printed a raw traceback and the script exited 0."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "profiler_aftereffect.py"
    afile = tmp_path / "afile"
    afile.write_text("")
    for extra, rc, message in ((["--out", str(tmp_path / "d"), "--repeats", "0"], 2, "--repeats must be >= 1"),
                               (["--out", str(afile)], 2, "must be a directory")):
        run = subprocess.run([sys.executable, str(script), *extra], capture_output=True, text=True, timeout=120)
        assert run.returncode == rc and message in run.stderr, (run.returncode, run.stderr[-1000:])
    if not __import__("torch").cuda.is_available():
        run = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "d")], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr and not (tmp_path / "d").exists()
