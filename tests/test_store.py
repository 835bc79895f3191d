"""The results store: tables and values with their provenance, which GPU's recording is shown, and the
staleness check of recorded notebook cells."""

import json

import pandas as pd
import pytest

import cgutils as cg
from cgutils import env
from cgutils.store import ResultsStore, check_recordings, live_store, source_hash

PROV = {"gpu": "NVIDIA H200", "driver": "580.0", "cuda": "13.0", "torch": "2.11.0", "transformers": "5.17.0",
        "date": "2026-11-29T12:00:00+00:00", "git_commit": "abcdef1234"}


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """Recorded mode, as in CI: on a GPU machine ResultsStore() would pick the live GPU's recording instead."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)


def test_gpu_slug():
    assert env.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert env.gpu_slug("NVIDIA GeForce RTX 4090 (laptop)") == "nvidia-geforce-rtx-4090-laptop"


def test_provenance_has_every_field():
    prov = cg.provenance()
    for key in ("gpu", "driver", "cuda", "torch", "torchvision", "transformers", "date", "git_commit"):
        assert key in prov
    assert prov["torch"].split("+")[0].count(".") == 2


# --- tables, values, provenance -------------------------------------------------------------------------


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


def test_table_keeps_its_own_provenance(tmp_results):
    """A later recording rewrote meta.json and the README credited the table to it."""
    store = ResultsStore("nvidia-h200")
    store.write_meta({**PROV, "git_commit": "first"})
    store.save_value("speedup", pd.DataFrame({"a": [1]}), {**PROV, "git_commit": "first"})
    store.write_meta({**PROV, "git_commit": "second"})  # another notebook recorded later
    assert store.meta_for("speedup")["git_commit"] == "first"
    assert store.meta_for("never-saved")["git_commit"] == "second"  # falls back to the store's


def test_saving_another_format_replaces_the_old_file(tmp_results):
    """A JSON value saved under the name of an older CSV was shadowed by the CSV on load."""
    store = ResultsStore("nvidia-h200")
    store.save_value("f", pd.DataFrame({"a": [1]}))
    store.save_value("f", {"now": "json"})
    assert store.load_value("f") == {"now": "json"}
    store.save_value("f", pd.DataFrame({"b": [2]}))
    assert store.load_value("f").columns.tolist() == ["b"]


def test_notebook_meta_is_the_notebooks_own_recording(tmp_results):
    """meta.json names the last notebook recorded; notebook 04's banner showed notebook 03's commit."""
    store = ResultsStore("nvidia-h200")
    store.write_meta({**PROV, "git_commit": "newer", "date": "2026-11-29T17:18:00+00:00"})
    for key, date in (("a", "2026-11-29T17:10:00+00:00"), ("b", "2026-11-29T17:13:00+00:00")):
        store.save_cell({"notebook": "04_demo", "key": key, "source_hash": "x", "source": "",
                         "provenance": {**PROV, "git_commit": f"own-{key}", "date": date}, "outputs": []})
    assert store.notebook_meta("04_demo")["git_commit"] == "own-b"
    assert store.notebook_meta("05_other")["git_commit"] == "newer"


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
    with pytest.raises(cg.InputError, match="must look like 'nvidia-h200'"):
        ResultsStore("NVIDIA H200")


def test_corrupt_json_is_a_clear_error(tmp_results):
    store = ResultsStore("nvidia-h200")
    store.path.mkdir(parents=True)
    (store.path / "meta.json").write_text("{not json")
    with pytest.raises(cg.RecordingError, match="not valid JSON"):
        store.meta()


# --- which store ----------------------------------------------------------------------------------------


def test_store_picks_newest_recording_or_env(tmp_results, monkeypatch):
    ResultsStore("old-gpu").write_meta({**PROV, "date": "2025-01-01"})
    ResultsStore("new-gpu").write_meta({**PROV, "date": "2026-01-01"})
    assert ResultsStore().slug == "new-gpu"
    monkeypatch.setenv("CGUTILS_RECORDED_GPU", "old-gpu")
    assert ResultsStore().slug == "old-gpu"


def test_unknown_recorded_gpu_lists_what_exists(tmp_results, monkeypatch):
    ResultsStore("nvidia-h200").write_meta(PROV)
    monkeypatch.setenv("CGUTILS_RECORDED_GPU", "nope")
    with pytest.raises(cg.RecordingError, match=r"'nope' has no recording; available: \['nvidia-h200'\]"):
        ResultsStore()


def test_live_store_needs_cuda_and_writes_results_only_when_recording(tmp_results, monkeypatch):
    with pytest.raises(cg.NoCudaError, match=r"live_store\(\) needs a CUDA device.*ResultsStore\(\)"):
        live_store()
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a: "NVIDIA H200")
    assert live_store().path == env.REPO_ROOT / "build" / "live" / "nvidia-h200"  # a user's own GPU run
    monkeypatch.setenv("CGUTILS_RECORD", "1")
    assert live_store().path == tmp_results / "nvidia-h200"  # `make record`


def test_recorded_keeps_exporting_what_moved_to_the_store():
    """Notebooks import current_store from cgutils.recorded, and their cells are hashed: the store's move
    to cgutils.store must not change where those names come from."""
    from cgutils import recorded, store

    for name in ("ResultsStore", "current_store", "live_store", "check_recordings", "source_hash",
                 "recording_enabled", "results_root", "recorded_cells", "CellStatus", "MAGIC"):
        assert getattr(recorded, name) is getattr(store, name), name
    assert cg.ResultsStore is store.ResultsStore and cg.check_recordings is store.check_recordings


# --- staleness ------------------------------------------------------------------------------------------


def test_source_hash_ignores_trailing_whitespace_only():
    assert source_hash(" k", "x = 1\n") == source_hash(" k ", "x = 1   \n\n")
    assert source_hash(" k", "x = 1") != source_hash(" k", "x = 2")
    assert source_hash(" k", "x = 1") != source_hash(" k --save x", "x = 1")


def _notebook(tmp_path, body, line=" demo --save v"):
    nb = {"cells": [{"cell_type": "code", "source": f"%%recorded{line}\n{body}", "metadata": {},
                     "outputs": [], "execution_count": None},
                    {"cell_type": "code", "source": "print('not recorded')", "metadata": {}, "outputs": [],
                     "execution_count": None}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    d = tmp_path / "notebooks"
    d.mkdir(exist_ok=True)
    (d / "01_demo.ipynb").write_text(json.dumps(nb))
    return d


def test_check_recordings_reports_ok_stale_and_missing(tmp_results, tmp_path):
    store = ResultsStore("nvidia-h200")
    store.write_meta(PROV)
    body = "v = 1"
    assert [s.status for s in check_recordings(_notebook(tmp_path, body), store)] == ["missing"]
    store.save_cell({"notebook": "01_demo", "key": "demo", "source_hash": source_hash(" demo --save v", body),
                     "source": body, "provenance": PROV, "outputs": [], "library": {}})
    assert [(s.notebook, s.key, s.status) for s in check_recordings(_notebook(tmp_path, body), store)] == [
        ("01_demo", "demo", "ok")]
    stale = check_recordings(_notebook(tmp_path, "v = 2"), store)
    assert [s.status for s in stale] == ["stale"] and "changed since it was recorded" in stale[0].detail
    with pytest.raises(cg.StaleRecordingError, match="re-record with `make record`"):
        store.load_cell("01_demo", "demo", expected_hash=source_hash(" demo --save v", "v = 2"))


def test_check_recordings_needs_a_notebook_folder(tmp_results, tmp_path):
    with pytest.raises(cg.RecordingError, match="not a folder of notebooks"):
        check_recordings(tmp_path / "missing")
