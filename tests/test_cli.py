"""The CLI on a machine without CUDA: it says so in one line and shows the recorded table (exit 0)."""

import os
import subprocess
import sys

import pandas as pd
import pytest

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
    r = run_cli("bench", env={"CGUTILS_RESULTS": str(recorded_table)})
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("No CUDA device visible") and "Test GPU" in first
    assert "bert-base-seq128" in r.stdout and "5.0" in r.stdout  # eager / graph runner = 5.0x
    assert "recorded on Test GPU (driver 1.0, CUDA 13.0), torch 2.11.0" in r.stdout


def test_bench_markdown(recorded_table):
    r = run_cli("bench", "--markdown", env={"CGUTILS_RESULTS": str(recorded_table)})
    assert r.returncode == 0, r.stderr
    assert "| bert-base-seq128 | fp16" in r.stdout and "5.00×" in r.stdout and "Measured on Test GPU" in r.stdout


def test_bench_without_recording_is_a_clear_error(tmp_results):
    r = run_cli("bench", env={"CGUTILS_RESULTS": str(tmp_results)})
    assert r.returncode == 1
    assert "no recordings" in r.stderr and "make record" in r.stderr and "Traceback" not in r.stderr


def test_env_reports_mode(recorded_table):
    r = run_cli("env", env={"CGUTILS_RESULTS": str(recorded_table)})
    assert r.returncode == 0 and "mode: recorded" in r.stdout and "recordings: test-gpu" in r.stdout


def test_record_without_cuda_explains(recorded_table):
    r = run_cli("record", env={"CGUTILS_RESULTS": str(recorded_table)})
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stdout


def test_bad_arguments_exit_2():
    r = run_cli("bench", "--workloads", "nope")
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.parametrize("suite, needle", [("pitfalls", "`Tensor.item` at line"), ("memory", "own_pool"),
                                           ("methods", "runner_compiled_static_vs_compile_ro")])
def test_new_suites_show_the_committed_recordings(suite, needle):
    r = run_cli("bench", suite, *(["--markdown"] if suite == "pitfalls" else []))
    assert r.returncode == 0, r.stderr
    assert needle in r.stdout
