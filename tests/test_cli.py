"""The CLI (``python -m cgutils``) on a machine without CUDA: it says so in one line and shows the
recorded tables (exit 0); bad arguments and missing recordings are one-line errors, never tracebacks.
The suites themselves come from the registry (tests/test_bench.py)."""

import os
import subprocess
import sys

import pandas as pd
import pytest

from cgutils.__main__ import main
from cgutils.bench import SUITES
from cgutils.recorded import ResultsStore

ROWS = [
    ("bert-base-seq128", "fp16", "eager", 5.0, "ok"), ("bert-base-seq128", "fp16", "graph_runner", 1.0, "ok"),
    ("bert-base-seq128", "fp16", "raw_graph", 0.9, "ok"), ("bert-base-seq128", "fp16", "compile_ro", 0.5, "ok"),
]


def run_cli(*args, env=None):
    e = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.run([sys.executable, "-m", "cgutils", *args], capture_output=True, text=True, env=e,
                          timeout=300)


@pytest.fixture
def recorded_table(tmp_results):
    store = ResultsStore("test-gpu")
    store.write_meta({"gpu": "Test GPU", "driver": "1.0", "cuda": "13.0", "torch": "2.11.0",
                      "transformers": "5.17.0", "date": "2026-11-29T00:00:00+00:00", "git_commit": "0123456789ab"})
    df = pd.DataFrame(ROWS, columns=["workload", "dtype", "variant", "median_ms", "status"])
    df["gpu_ops"], df["forwards"], df["article_eager_ms"], df["article_graph_ms"] = 180, 1, 3.2, 2.4
    store.save_frame("speedup", df)
    return tmp_results


def test_bench_without_cuda_prints_recorded_table(recorded_table):
    """CI and laptops have no GPU: `bench` must show the recording and its provenance, exit 0."""
    r = run_cli("bench", env={"CGUTILS_RESULTS": str(recorded_table)})
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("No CUDA device visible") and "Test GPU" in first
    assert "bert-base-seq128" in r.stdout and "5.0" in r.stdout  # eager / graph runner = 5.0x
    assert "recorded on Test GPU (driver 1.0, CUDA 13.0), torch 2.11.0" in r.stdout


def test_bench_markdown(recorded_table):
    """`bench --markdown` prints the README's results table, provenance line included (pasted as is)."""
    r = run_cli("bench", "--markdown", env={"CGUTILS_RESULTS": str(recorded_table)})
    assert r.returncode == 0, r.stderr
    assert "| bert-base-seq128 | fp16" in r.stdout and "5.00×" in r.stdout and "Measured on Test GPU" in r.stdout


def test_bench_without_recording_is_a_clear_error(tmp_results):
    """No GPU and nothing recorded: one line naming the fix (`make record`), not a traceback."""
    r = run_cli("bench", env={"CGUTILS_RESULTS": str(tmp_results)})
    assert r.returncode == 1
    assert "no recordings" in r.stderr and "make record" in r.stderr and "Traceback" not in r.stderr


def test_env_reports_mode(recorded_table):
    """`env` says which mode the notebooks will run in and which recordings exist."""
    r = run_cli("env", env={"CGUTILS_RESULTS": str(recorded_table)})
    assert r.returncode == 0 and "mode: recorded" in r.stdout and "recordings: test-gpu" in r.stdout


def test_record_without_cuda_explains(recorded_table):
    """`record` cannot record without a GPU: it says so and exits 2 (not 0, so scripts notice)."""
    r = run_cli("record", env={"CGUTILS_RESULTS": str(recorded_table)})
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stdout


def test_bad_arguments_exit_2():
    """argparse's usage error, not a KeyError, for a workload that does not exist."""
    r = run_cli("bench", "--workloads", "nope")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_measuring_flags_are_named_as_ignored_without_cuda(recorded_table):
    """--workloads and --out only steer measuring; without CUDA the CLI says it ignored them rather than
    silently showing a recording that looks like the answer to them."""
    r = run_cli("bench", "--workloads", "resnet50", "--out", "somewhere", env={"CGUTILS_RESULTS": str(recorded_table)})
    assert r.returncode == 0, r.stderr
    assert "(--workloads and --out apply only to measuring and are ignored here.)" in r.stdout.splitlines()[0]
    r = run_cli("bench", "--out", "somewhere", env={"CGUTILS_RESULTS": str(recorded_table)})
    assert "(--out applies only to measuring and is ignored here.)" in r.stdout.splitlines()[0]


@pytest.mark.parametrize("suite, needle", [("pitfalls", "`Tensor.item` at reproducers.py line"), ("memory", "own_pool"),
                                           ("methods", "runner_compiled_static_vs_compile_ro")])
def test_suites_show_their_tables_and_extras(suite, needle):
    """Each suite prints more than its tables where it has more to say: the pitfalls' markdown names
    the op and line, methods adds the issue's targets computed from the recorded table."""
    r = run_cli("bench", suite, *(["--markdown"] if suite == "pitfalls" else []))
    assert r.returncode == 0, r.stderr
    assert needle in r.stdout


@pytest.mark.parametrize("name", list(SUITES))
@pytest.mark.parametrize("flags", [[], ["--show"], ["--markdown"]])
def test_every_suite_shows_the_committed_recording(name, flags, capsys, monkeypatch):
    """`make run` calls `bench --show` without a GPU: every registered suite, plain, --show and
    --markdown, prints its committed recording and exits 0 (in-process: one interpreter, fast)."""
    from cgutils.__main__ import main

    monkeypatch.setattr("cgutils.env.cuda_available", lambda: False)  # never measure, even on a GPU host
    monkeypatch.delenv("CGUTILS_RESULTS", raising=False)
    monkeypatch.delenv("CGUTILS_RECORDED_GPU", raising=False)
    assert main(["bench", name, *flags]) == 0
    out = capsys.readouterr().out
    if "--markdown" in flags:
        assert "|" in out  # a markdown table, without the one-line banner
    else:
        assert out.startswith(f"No CUDA device visible: nothing measured here. Showing the {name} tables recorded on")
        assert "Source: recorded on" in out


def test_live_run_passes_the_flags_and_writes_every_table(tmp_results, tmp_path, capsys, monkeypatch):
    """On a GPU the CLI measures: the suite gets --workloads/--dtypes/--variants/--budget/--trials as Options,
    and every table it registers is written (here to --out) before the report. CUDA is faked and the
    suite is a stand-in, so this runs anywhere."""
    from cgutils.__main__ import main
    from cgutils.bench import Suite

    got = {}

    def measure(opts):
        got["opts"] = opts
        return pd.DataFrame({"x": [1]}), pd.DataFrame({"y": [2]})

    suite = Suite("fake", "a stand-in", ("first", "second"), measure=measure,
                  report=lambda frames, source, prov, markdown: print(f"REPORT {list(frames)} {source}"))
    monkeypatch.setattr("cgutils.__main__.SUITES", {"fake": suite})
    monkeypatch.setattr("cgutils.env.cuda_available", lambda: True)
    monkeypatch.setattr("cgutils.env.provenance", lambda: {"gpu": "Fake GPU", "torch": "2.11.0"})
    monkeypatch.setattr("cgutils.store.live_store", lambda: ResultsStore("fake-gpu"))

    out = tmp_path / "out"
    assert main(["bench", "fake", "--workloads", "resnet50", "--dtypes", "fp16", "--variants", "eager",
                 "--budget", "0.5", "--trials", "3", "--out", str(out)]) == 0
    opts = got["opts"]
    assert (opts.workloads, opts.dtypes, opts.variants, opts.budget_s) == (("resnet50",), ("fp16",), ("eager",), 0.5)
    assert opts.trials == 3
    assert sorted(p.name for p in out.iterdir()) == ["first.csv", "second.csv"]
    printed = capsys.readouterr().out
    assert f"wrote {out / 'first.csv'}" in printed
    assert "REPORT ['first', 'second'] measured now on Fake GPU" in printed


@pytest.mark.parametrize("flags, message", [(["--trials", "0"], "--trials: must be >= 1"),
                                            (["--budget", "0"], "--budget: must be > 0"),
                                            (["--trials", "x"], "--trials: expected an integer")])
def test_bench_rejects_bad_numbers_before_anything_runs(flags, message, capsys):
    """`bench --trials 0` and `--budget 0` were accepted silently on a CPU machine."""
    with pytest.raises(SystemExit):
        main(["bench", *flags])
    assert message in capsys.readouterr().err


def test_record_check_honours_notebooks(capsys):
    """`record --check --notebooks X` checked every notebook and accepted names that do not exist."""
    # 04: a notebook whose recordings are all current (01's may be waived library drift, which --check reports)
    assert main(["record", "--check", "--notebooks", "04_sync_and_control_flow.ipynb"]) == 0
    out = capsys.readouterr().out
    assert "04_sync_and_control_flow" in out and "02_capture" not in out
    assert main(["record", "--check", "--notebooks", "nope"]) == 1
    assert "no recorded cells in notebook(s) nope" in capsys.readouterr().err


def test_output_cut_short_by_the_reader_ends_quietly():
    """`bench generation --markdown | head -1` ended in a BrokenPipeError traceback."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "-m", "cgutils", "bench", "generation", "--markdown"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away, as `head -1` does
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err



def test_trace_islands_needs_coverage_and_zero_lists_none(capsys):
    """Regression (new-user pass): --islands without --coverage was ignored silently; --islands 0 printed pandas'
    empty-frame text."""
    from cgutils import env

    trace = str(env.REPO_ROOT / "results" / "nvidia-h200" / "traces" / "bert_replay.json.gz")
    assert main(["trace", trace, "--islands", "2"]) == 1
    assert "add --coverage" in capsys.readouterr().err
    assert main(["trace", trace, "--coverage", "--islands", "0"]) == 0
    out = capsys.readouterr().out
    assert "3 eager islands" in out and "Empty DataFrame" not in out and "eager islands (first" not in out


@pytest.mark.parametrize("argv", [["bench", "--budget", "nan"], ["bench", "--budget", "inf"],
                                  ["record", "--timeout", "0"], ["figures", "--timeout", "-5"]])
def test_non_finite_budgets_and_non_positive_timeouts_are_refused_when_parsing(argv, capsys):
    """`--budget nan` passed the bound check (nan compares False) and `--timeout -5` was taken as given."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and ("finite" in err or ">= 1" in err), err


@pytest.mark.parametrize("argv, says", [(["trace", ""], "file path is empty"),
                                        (["trace", "t.json", "--range", ""], "annotation name is empty")])
def test_empty_trace_path_and_range_are_named(argv, says, capsys):
    """`trace ''` said ".: is a directory" and `--range ''` was silently ignored."""
    assert main(argv) != 0
    assert says in capsys.readouterr().err


def test_trace_of_cpu_work_only_says_n_a_instead_of_nan(tmp_path, capsys):
    """A trace without GPU work printed NaN for every ratio and median."""
    import json

    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1,
                                                 "ts": 0, "dur": 5}]}))
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out and "n/a (none in this trace)" in out
