"""Results store, provenance, the %%recorded magic in both modes, and stale detection."""

import json

import pandas as pd
import pytest

import cgutils as cg
from cgutils import env, recorded
from cgutils.recorded import ResultsStore, check_recordings, source_hash

PROV = {"gpu": "NVIDIA H200", "driver": "580.0", "cuda": "13.0", "torch": "2.11.0", "transformers": "5.17.0",
        "date": "2026-11-29T12:00:00+00:00", "git_commit": "abcdef1234"}


def test_gpu_slug():
    assert env.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert env.gpu_slug("NVIDIA GeForce RTX 4090 (laptop)") == "nvidia-geforce-rtx-4090-laptop"


def test_provenance_has_every_field():
    prov = cg.provenance()
    for key in ("gpu", "driver", "cuda", "torch", "torchvision", "transformers", "date", "git_commit"):
        assert key in prov
    assert prov["torch"].split("+")[0].count(".") == 2


def test_store_round_trip(tmp_results):
    store = ResultsStore("nvidia-h200")
    store.write_meta(PROV)
    df = pd.DataFrame({"workload": ["a", "b"], "median_ms": [1.5, 2.25]})
    store.save_frame("speedup", df)
    store.save_value("info", {"n": 3, "name": "x"})
    again = ResultsStore()  # default: the only recording
    assert again.slug == "nvidia-h200"
    pd.testing.assert_frame_equal(again.load_frame("speedup"), df)
    assert again.load_value("info") == {"n": 3, "name": "x"}
    assert again.meta()["gpu"] == "NVIDIA H200"


def test_store_picks_newest_recording_or_env(tmp_results, monkeypatch):
    ResultsStore("old-gpu").write_meta({**PROV, "date": "2025-01-01"})
    ResultsStore("new-gpu").write_meta({**PROV, "date": "2026-01-01"})
    assert ResultsStore().slug == "new-gpu"
    monkeypatch.setenv("CGUTILS_RECORDED_GPU", "old-gpu")
    assert ResultsStore().slug == "old-gpu"


def test_missing_things_are_clear_errors(tmp_results):
    with pytest.raises(cg.RecordingError, match="make record"):
        ResultsStore()
    store = ResultsStore("nvidia-h200")
    with pytest.raises(cg.RecordingError, match="no recorded table 'speedup'"):
        store.load_frame("speedup")
    with pytest.raises(cg.RecordingError, match="has no recording"):
        store.load_cell("05_x", "measure")
    with pytest.raises(cg.InputError, match="relative path"):
        store.save_value("../escape", 1)


def test_corrupt_json_is_a_clear_error(tmp_results):
    store = ResultsStore("nvidia-h200")
    store.path.mkdir(parents=True)
    (store.path / "meta.json").write_text("{not json")
    with pytest.raises(cg.RecordingError, match="not valid JSON"):
        store.meta()


def test_source_hash_ignores_trailing_whitespace_only():
    assert source_hash(" k", "x = 1\n") == source_hash(" k ", "x = 1   \n\n")
    assert source_hash(" k", "x = 1") != source_hash(" k", "x = 2")
    assert source_hash(" k", "x = 1") != source_hash(" k --save x", "x = 1")


def _notebook(tmp_path, body, line=" demo --save v"):
    nb = {"cells": [{"cell_type": "code", "source": f"%%recorded{line}\n{body}", "metadata": {},
                     "outputs": [], "execution_count": None}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    d = tmp_path / "notebooks"
    d.mkdir(exist_ok=True)
    (d / "01_demo.ipynb").write_text(json.dumps(nb))
    return d


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    yield sh
    InteractiveShell.clear_instance()


def _run_magic(shell, line, body, capsys):
    shell.user_ns.pop("v", None)
    recorded.recorded_cell(line, body)
    return capsys.readouterr().out


@pytest.fixture
def gpu_store(tmp_results, monkeypatch, capsys):
    """Simulate a GPU that records: live mode, CGUTILS_RECORD=1, notebook 01_demo; yields the store."""
    store = ResultsStore("nvidia-h200", root=tmp_results)
    monkeypatch.setattr(recorded, "live_store", lambda: store)
    monkeypatch.setattr(env, "provenance", lambda: PROV)
    monkeypatch.setenv("CGUTILS_RECORD", "1")
    monkeypatch.setenv("CGUTILS_MODE", "live")
    monkeypatch.setattr(env, "cuda_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a: "NVIDIA H200")
    recorded.setup_notebook("01_demo")
    capsys.readouterr()
    return store


def test_magic_records_live_and_replays_recorded(gpu_store, tmp_path, shell, monkeypatch, capsys):
    """Simulate a GPU: record a cell live, then replay it in recorded mode; then change it (stale)."""
    store = gpu_store

    body = "import pandas as pd\nv = pd.DataFrame({'a': [1, 2]})\nprint('measured', len(v))\nint(v.a.sum())"
    out = _run_magic(shell, " demo --save v", body, capsys)
    assert "measured 2" in out
    rec = store.load_cell("01_demo", "demo", expected_hash=source_hash(" demo --save v", body))
    assert rec["provenance"]["gpu"] == "NVIDIA H200"
    assert rec["outputs"][0] == {"type": "stream", "name": "stdout", "text": "measured 2\n"}
    assert rec["outputs"][1]["type"] == "display" and rec["outputs"][1]["data"]["text/plain"] == "3"

    # recorded mode: nothing runs, outputs and the saved variable come back, under a banner
    monkeypatch.setenv("CGUTILS_MODE", "recorded")
    monkeypatch.setattr(env, "cuda_available", lambda: False)
    shown = []
    monkeypatch.setattr("IPython.display.publish_display_data", lambda data, metadata=None: shown.append(data))
    out = _run_magic(shell, " demo --save v", body, capsys)
    assert "measured 2" in out
    assert "Recorded output" in shown[0]["text/plain"] and "NVIDIA H200" in shown[0]["text/plain"]
    assert shown[1]["text/plain"] == "3"
    assert shell.user_ns["v"].a.tolist() == [1, 2]

    # the check agrees; an edited cell is stale, both in the check and when run
    nb_dir = _notebook(tmp_path, body)
    assert [s.status for s in check_recordings(nb_dir, store)] == ["ok"]
    edited = body.replace("[1, 2]", "[1, 2, 3]")
    nb_dir = _notebook(tmp_path, edited)
    assert [s.status for s in check_recordings(nb_dir, store)] == ["stale"]
    with pytest.raises(cg.StaleRecordingError, match="changed since it was recorded"):
        recorded.recorded_cell(" demo --save v", edited)


def test_magic_needs_setup_and_valid_arguments(shell, monkeypatch):
    monkeypatch.setitem(recorded._state, "notebook", None)
    with pytest.raises(cg.RecordingError, match="setup_notebook"):
        recorded.recorded_cell(" k", "x = 1")
    monkeypatch.setitem(recorded._state, "notebook", "01_demo")
    with pytest.raises(cg.InputError, match="bad %%recorded arguments"):
        recorded.recorded_cell("", "x = 1")


def test_missing_recording_fails_in_recorded_mode(tmp_results, shell, monkeypatch):
    ResultsStore("nvidia-h200").write_meta(PROV)
    monkeypatch.setenv("CGUTILS_MODE", "recorded")
    monkeypatch.setitem(recorded._state, "notebook", "01_demo")
    with pytest.raises(cg.RecordingError, match="has no recording"):
        recorded.recorded_cell(" never-recorded", "x = 1")


def test_check_reports_missing(tmp_results, tmp_path):
    store = ResultsStore("nvidia-h200")
    store.write_meta(PROV)
    assert [s.status for s in check_recordings(_notebook(tmp_path, "v = 1"), store)] == ["missing"]


def test_table_keeps_its_own_provenance(tmp_results):
    """Regression: a later recording rewrote meta.json and the README credited the table to it."""
    store = ResultsStore("nvidia-h200")
    store.write_meta({**PROV, "git_commit": "first"})
    store.save_value("speedup", pd.DataFrame({"a": [1]}), {**PROV, "git_commit": "first"})
    store.write_meta({**PROV, "git_commit": "second"})  # another notebook recorded later
    assert store.meta_for("speedup")["git_commit"] == "first"
    assert store.meta_for("never-saved")["git_commit"] == "second"  # falls back to the store's


def test_saving_another_format_replaces_the_old_file(tmp_results):
    """Regression: a JSON value saved under the name of an older CSV was shadowed by the CSV on load."""
    store = ResultsStore("nvidia-h200")
    store.save_value("f", pd.DataFrame({"a": [1]}))
    store.save_value("f", {"now": "json"})
    assert store.load_value("f") == {"now": "json"}
    store.save_value("f", pd.DataFrame({"b": [2]}))
    assert store.load_value("f").columns.tolist() == ["b"]


def test_unknown_recorded_gpu_lists_what_exists(tmp_results, monkeypatch):
    ResultsStore("nvidia-h200").write_meta(PROV)
    monkeypatch.setenv("CGUTILS_RECORDED_GPU", "nope")
    with pytest.raises(cg.RecordingError, match=r"'nope' has no recording; available: \['nvidia-h200'\]"):
        ResultsStore()


def test_check_recordings_needs_a_notebook_folder(tmp_results, tmp_path):
    with pytest.raises(cg.RecordingError, match="not a folder of notebooks"):
        check_recordings(tmp_path / "missing")


def test_raising_cell_is_recorded_and_raises_in_both_modes(gpu_store, shell, monkeypatch, capsys):
    """A --raises cell: live, the error is recorded and re-raised; recorded, the same error text comes back."""
    store = gpu_store
    body = "print('before')\nraise RuntimeError('CUDA error: operation not permitted when stream is capturing')"
    with pytest.raises(RuntimeError, match="not permitted"):
        recorded.recorded_cell(" boom --raises", body)
    assert "before" in capsys.readouterr().out
    rec = store.load_cell("01_demo", "boom")
    assert rec["error"]["ename"] == "RuntimeError" and "not permitted" in rec["error"]["evalue"]
    # a failing --raises cell that never defined its --save variable still shows its own error
    with pytest.raises(ValueError, match="the real one"):
        recorded.recorded_cell(" boom2 --raises --save never", "raise ValueError('the real one')")

    monkeypatch.setenv("CGUTILS_MODE", "recorded")
    monkeypatch.setattr(env, "cuda_available", lambda: False)
    monkeypatch.setattr("IPython.display.publish_display_data", lambda data, metadata=None: None)
    with pytest.raises(cg.errors.RecordedCellError, match="RuntimeError: CUDA error: operation not permitted"):
        recorded.recorded_cell(" boom --raises", body)
    with pytest.raises(cg.errors.RecordedCellError, match="the real one"):  # its --save was never written
        recorded.recorded_cell(" boom2 --raises --save never", "raise ValueError('the real one')")
    assert "before" in capsys.readouterr().out
    # without --raises an exception propagates and nothing is recorded
    monkeypatch.setenv("CGUTILS_MODE", "live")
    monkeypatch.setattr(env, "cuda_available", lambda: True)
    with pytest.raises(ZeroDivisionError):
        recorded.recorded_cell(" plain", "1 / 0")
    with pytest.raises(cg.RecordingError):
        store.load_cell("01_demo", "plain")


def test_repeated_save_flags_accumulate():
    """`--save a:x --save b:y` kept only the last flag, so notebook 03 lost its memory table."""
    args = recorded._parse_line("k --save a:x --save b:y c")
    assert args.save == ["a:x", "b:y", "c"]


def test_banner_names_the_notebooks_own_recording(tmp_results):
    """meta.json names the last notebook recorded; notebook 04's banner showed notebook 03's commit."""
    store = ResultsStore("nvidia-h200")
    store.write_meta({**PROV, "git_commit": "newer", "date": "2026-11-29T17:18:00+00:00"})
    for key, date in (("a", "2026-11-29T17:10:00+00:00"), ("b", "2026-11-29T17:13:00+00:00")):
        store.save_cell({"notebook": "04_demo", "key": key, "source_hash": "x", "source": "",
                         "provenance": {**PROV, "git_commit": f"own-{key}", "date": date}, "outputs": []})
    assert store.notebook_meta("04_demo")["git_commit"] == "own-b"
    assert store.notebook_meta("05_other")["git_commit"] == "newer"
