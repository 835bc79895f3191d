"""The ``%%recorded`` cell magic in both modes, run through an IPython shell as a notebook runs it: live (a
simulated GPU runs the cell and records it) and recorded (the recording is replayed under a banner)."""

import importlib

import pytest

import cgutils as cg
from cgutils import env, recorded
from cgutils.store import ResultsStore, source_hash

PROV = {"gpu": "NVIDIA H200", "driver": "580.0", "cuda": "13.0", "torch": "2.11.0", "transformers": "5.17.0",
        "date": "2026-11-29T12:00:00+00:00", "git_commit": "abcdef1234"}


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    yield sh
    InteractiveShell.clear_instance()


@pytest.fixture
def gpu(tmp_results, shell, monkeypatch, capsys):
    """A simulated H200 that records (as under ``make record``), notebook 01_demo set up; returns its store."""
    live_mode(monkeypatch)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(env, "provenance", lambda: PROV)
    monkeypatch.setenv("CGUTILS_RECORD", "1")
    recorded.setup_notebook("01_demo")  # registers %%recorded with the shell
    assert "Mode: live, on NVIDIA H200" in capsys.readouterr().out
    return ResultsStore("nvidia-h200", root=tmp_results)


def live_mode(monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setenv("CGUTILS_MODE", "live")


def recorded_mode(monkeypatch) -> list:
    """No CUDA from here on; returns the list that collects published display data (the banner first)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("CGUTILS_MODE", "recorded")
    shown = []
    monkeypatch.setattr("IPython.display.publish_display_data", lambda data, metadata=None: shown.append(data))
    return shown


def run_cell(shell, line, body):
    """Run a ``%%recorded`` cell the way the notebook does (the magic registered by setup_notebook)."""
    return shell.run_cell_magic("recorded", line, body)


BODY = "import pandas as pd\nv = pd.DataFrame({'a': [1, 2]})\nprint('measured', len(v))\nint(v.a.sum())"


def test_live_cell_runs_and_is_recorded(gpu, shell, capsys):
    run_cell(shell, " demo --save v", BODY)
    assert "measured 2" in capsys.readouterr().out  # live output stays live
    rec = gpu.load_cell("01_demo", "demo", expected_hash=source_hash(" demo --save v", BODY))
    assert rec["provenance"]["gpu"] == "NVIDIA H200" and rec["saved"] == ["cells/01_demo/demo.v.csv"]
    assert rec["outputs"][0] == {"type": "stream", "name": "stdout", "text": "measured 2\n"}
    assert rec["outputs"][1]["type"] == "display" and rec["outputs"][1]["data"]["text/plain"] == "3"
    assert gpu.load_value("cells/01_demo/demo.v").a.tolist() == [1, 2]
    assert 0 <= rec["seconds"] < 60  # the cell's run time, to plan a recording's GPU time


def test_recorded_cell_replays_under_a_banner(gpu, shell, monkeypatch, capsys):
    run_cell(shell, " demo --save v", BODY)
    capsys.readouterr()
    shown = recorded_mode(monkeypatch)
    shell.user_ns.pop("v")
    shell.user_ns["pd"] = None  # nothing runs: the cell's import would have replaced this
    run_cell(shell, " demo --save v", BODY)
    assert "measured 2" in capsys.readouterr().out and shell.user_ns["pd"] is None
    banner = shown[0]["text/plain"]
    assert "Recorded output" in banner and "NVIDIA H200" in banner and source_hash(" demo --save v", BODY) in banner
    assert "Recorded on NVIDIA H200" in shown[0]["text/html"]
    assert shown[1]["text/plain"] == "3"
    assert shell.user_ns["v"].a.tolist() == [1, 2]


def test_edited_cell_is_stale_in_recorded_mode(gpu, shell, monkeypatch):
    run_cell(shell, " demo --save v", BODY)
    recorded_mode(monkeypatch)
    with pytest.raises(cg.StaleRecordingError, match="changed since it was recorded"):
        run_cell(shell, " demo --save v", BODY.replace("[1, 2]", "[1, 2, 3]"))


def test_missing_recording_fails_in_recorded_mode(tmp_results, shell, monkeypatch):
    ResultsStore("nvidia-h200").write_meta(PROV)
    recorded_mode(monkeypatch)
    recorded.setup_notebook("01_demo")
    with pytest.raises(cg.RecordingError, match="has no recording"):
        run_cell(shell, " never-recorded", "x = 1")


def test_repeated_save_flags_accumulate(gpu, shell):
    """`--save a:x --save b:y` kept only the last flag, so notebook 03 lost its memory table."""
    run_cell(shell, " k --save a:x --save b:y c", "a, b, c = [1], [2], [3]")
    assert [gpu.load_value(n) for n in ("x", "y", "cells/01_demo/k.c")] == [[1], [2], [3]]


def test_save_of_an_undefined_variable_is_named(gpu, shell):
    with pytest.raises(cg.InputError, match=r"--save names \['nope'\], which the cell did not define"):
        run_cell(shell, " k --save nope", "x = 1")


def test_raising_cell_is_recorded_and_raises_in_both_modes(gpu, shell, monkeypatch, capsys):
    """A --raises cell: live, the error is recorded and re-raised; recorded, the same error text comes back."""
    body = "print('before')\nraise RuntimeError('CUDA error: operation not permitted when stream is capturing')"
    with pytest.raises(RuntimeError, match="not permitted"):
        run_cell(shell, " boom --raises", body)
    assert "before" in capsys.readouterr().out
    rec = gpu.load_cell("01_demo", "boom")
    assert rec["error"]["ename"] == "RuntimeError" and "not permitted" in rec["error"]["evalue"]
    # a failing --raises cell that never defined its --save variable still shows its own error
    with pytest.raises(ValueError, match="the real one"):
        run_cell(shell, " boom2 --raises --save never", "raise ValueError('the real one')")

    recorded_mode(monkeypatch)
    with pytest.raises(cg.RecordedCellError, match="RuntimeError: CUDA error: operation not permitted"):
        run_cell(shell, " boom --raises", body)
    with pytest.raises(cg.RecordedCellError, match="the real one"):  # its --save was never written
        run_cell(shell, " boom2 --raises --save never", "raise ValueError('the real one')")
    assert "before" in capsys.readouterr().out


def test_plain_exception_propagates_and_is_not_recorded(gpu, shell):
    with pytest.raises(ZeroDivisionError):
        run_cell(shell, " plain", "1 / 0")
    with pytest.raises(cg.RecordingError):
        gpu.load_cell("01_demo", "plain")


def test_magic_needs_setup_and_valid_arguments(shell, tmp_results):
    fresh = importlib.reload(recorded)  # a fresh kernel: no setup_notebook yet
    with pytest.raises(cg.RecordingError, match="setup_notebook"):
        fresh.recorded_cell(" k", "x = 1")
    fresh.setup_notebook("01_demo")
    with pytest.raises(cg.InputError, match="bad %%recorded arguments"):
        run_cell(shell, "", "x = 1")


LIB_BODY = "import cgutils\nv = cgutils.checks.first_line(ValueError('a\\nb'))"


def test_live_cell_records_the_library_files_it_ran(gpu, shell):
    """A recording names the cgutils files the cell ran and their hashes (library staleness, issue 12)."""
    from cgutils import libcode

    run_cell(shell, " lib", LIB_BODY)
    rec = gpu.load_cell("01_demo", "lib")
    assert rec["library"]["cgutils/checks.py"] == libcode.file_hash(libcode.PACKAGE_DIR / "checks.py")
    assert libcode.changed_files(rec["library"]) == []
    assert "cgutils/recorded.py" not in rec["library"]  # the magic's own hooks are not the cell's code


def test_library_change_is_reported_by_check_and_banner(gpu, shell, monkeypatch, tmp_path):
    """`record --check` called 27/27 cells current while the library they ran had changed over 7 commits."""
    import json

    run_cell(shell, " lib", LIB_BODY)
    path = gpu.cell_path("01_demo", "lib")
    rec = json.loads(path.read_text())
    rec["library"]["cgutils/checks.py"] = "0" * 16  # as if checks.py changed after recording
    path.write_text(json.dumps(rec))
    nb = {"cells": [{"cell_type": "code", "source": f"%%recorded lib\n{LIB_BODY}", "metadata": {}, "outputs": [],
                     "execution_count": None}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "nbs").mkdir()
    (tmp_path / "nbs" / "01_demo.ipynb").write_text(json.dumps(nb))
    [status] = cg.check_recordings(tmp_path / "nbs", gpu)
    assert status.status == "library" and "cgutils/checks.py" in status.detail
    shown = recorded_mode(monkeypatch)
    run_cell(shell, " lib", LIB_BODY)
    assert "library code changed since: cgutils/checks.py" in shown[0]["text/plain"]
    assert "⚠" in shown[0]["text/html"] and "commit abcdef1234" in shown[0]["text/html"]
    del rec["library"]  # a recording made before library files were tracked is not called current
    path.write_text(json.dumps(rec))
    [status] = cg.check_recordings(tmp_path / "nbs", gpu)
    assert status.status == "library" and "without the list of library files" in status.detail


def test_an_intended_error_shows_the_cells_error_not_the_recording_machinery(gpu, shell, monkeypatch):
    """Issue 24: an intended error showed the traceback of the %%recorded magic (recorded.py frames) in both modes."""
    body = "def f():\n    raise ValueError('the lesson')\nf()"
    with pytest.raises(ValueError) as live:
        run_cell(shell, " lesson --raises", body)
    shown = "\n".join(live.value._render_traceback_())
    assert "the lesson" in shown and "in f" in shown and "recorded.py" not in shown
    recorded_mode(monkeypatch)
    with pytest.raises(cg.RecordedCellError) as replayed:
        run_cell(shell, " lesson --raises", body)
    lines = replayed.value._render_traceback_()
    assert lines[0] == "ValueError: the lesson" and "recorded on NVIDIA H200, 2026-11-29 12:00 UTC" in lines[1]


def test_banners_give_the_time_and_say_the_library_is_unchanged(gpu, shell, monkeypatch):
    """Issue 24: banners had no time of day, and the HTML one dropped "library files unchanged"."""
    run_cell(shell, " demo --save v", BODY)
    shown = recorded_mode(monkeypatch)
    run_cell(shell, " demo --save v", BODY)
    text, html = shown[0]["text/plain"], shown[0]["text/html"]
    assert "2026-11-29 12:00 UTC" in text and "2026-11-29 12:00 UTC" in html
    assert "library files it ran are unchanged" in html and "⚠" not in html


def test_setup_says_which_versions_the_live_cells_run_on(tmp_results, monkeypatch, capsys):
    import torch

    ResultsStore("nvidia-h200").write_meta(PROV)
    recorded_mode(monkeypatch)
    info = recorded.setup_notebook("01_launch_overhead")  # a real notebook: its %%recorded cells are counted
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "torch 2.11.0" in out and "(2026-11-29 12:00 UTC)" in out
    assert info["recorded_cells"] > 0 and f"The {info['recorded_cells']} GPU cells" in out


def test_a_banner_counts_one_library_file_in_the_singular():
    """Regression (learner's spot-check): 'the 1 library files it ran are unchanged'."""
    from cgutils import env
    from cgutils.libcode import file_hash
    from cgutils.recorded import banner

    one = {"cgutils/checks.py": file_hash(env.REPO_ROOT / "cgutils" / "checks.py")}
    prov = {"gpu": "NVIDIA H200", "date": "2026-11-29T12:00:00+00:00"}
    assert "the library file it ran is unchanged" in banner(prov, "abc", one)["text/plain"]


def test_record_changed_replays_a_current_cell_and_runs_only_the_planned_ones(gpu, shell, monkeypatch, capsys):
    """`record --changed`: a cell whose recording is current is replayed (its imports run, its --save restored);
    a planned cell runs for real. Before the plan existed every recorded cell ran again on the GPU."""
    run_cell(shell, " demo --save v", BODY)
    run_cell(shell, " other", "print('first run')")
    capsys.readouterr()
    for name in ("v", "pd"):
        shell.user_ns.pop(name)
    shown = []
    monkeypatch.setattr("IPython.display.publish_display_data", lambda data, metadata=None: shown.append(data))
    monkeypatch.setenv("CGUTILS_RECORD_LIVE", "01_demo/other")
    ran = []
    real_execute = recorded._execute
    monkeypatch.setattr(recorded, "_execute", lambda sh, body: (ran.append(body), real_execute(sh, body)))
    run_cell(shell, " demo --save v", BODY)  # not in the plan: replayed, its body not run
    assert ran == [] and "measured 2" in capsys.readouterr().out
    assert "NVIDIA H200" in str(shown[0]) and "pd" in shell.user_ns and list(shell.user_ns["v"].a) == [1, 2]
    run_cell(shell, " other", "print('second run')")  # in the plan: runs, and is recorded again
    assert len(ran) == 1 and "second run" in capsys.readouterr().out
    assert "second run" in str(gpu.load_cell("01_demo", "other")["outputs"])
