"""The committed recordings are current and the README shows exactly the recorded table."""

import json
import re

from cgutils import env
from cgutils.bench import markdown_table
from cgutils.libcode import changed_files
from cgutils.recorded import ResultsStore, check_recordings

README = env.REPO_ROOT / "README.md"


def test_every_recorded_cell_is_current():
    """Every recording current, except the cells named in ``library_drift_waived.json`` (its ``why``): those may be
    ``library``-stale through the one file named there and nothing else, and each waiver must still be needed."""
    waived_file = env.REPO_ROOT / "results" / "nvidia-h200" / "library_drift_waived.json"
    waived = {(w["notebook"], w["key"]): w["file"] for w in json.loads(waived_file.read_text())["cells"]} \
        if waived_file.exists() else {}
    store = ResultsStore("nvidia-h200", env.REPO_ROOT / "results")
    bad, used = [], set()
    for s in check_recordings(env.REPO_ROOT / "notebooks", store):
        if s.status == "ok":
            continue
        file = waived.get((s.notebook, s.key))
        if s.status == "library" and file:
            library = json.loads(store.cell_path(s.notebook, s.key).read_text()).get("library")
            if library is not None and changed_files(library) == [file]:
                used.add((s.notebook, s.key))
                continue
        bad.append(s)
    assert not bad, "\n".join(f"{s.notebook}/{s.key}: {s.status}: {s.detail}" for s in bad)
    assert used == set(waived), f"waivers no longer needed, delete them from {waived_file}: {set(waived) - used}"


def test_every_recorded_table_has_provenance():
    store = ResultsStore("nvidia-h200", env.REPO_ROOT / "results")
    tables = sorted(p.stem for p in store.path.glob("*.csv"))
    assert "speedup" in tables
    for name in tables:
        meta = store.meta_for(name)
        for key in ("gpu", "driver", "cuda", "torch", "transformers", "date", "git_commit"):
            assert meta.get(key), f"{name}: provenance lacks {key}"
        assert meta["gpu"] == "NVIDIA H200"
        assert (store.path / f"{name}.meta.json").exists(), f"{name} has no provenance of its own"


def test_readme_table_matches_the_recording():
    store = ResultsStore("nvidia-h200", env.REPO_ROOT / "results")
    expected = markdown_table(store.load_frame("speedup"), store.meta_for("speedup"))
    m = re.search(r"<!-- speedup-table:begin -->\n(.*?)\n<!-- speedup-table:end -->", README.read_text(), re.S)
    assert m, "README.md lacks the speedup-table markers"
    assert m.group(1).strip() == expected.strip(), (
        "README table differs from results/: paste the output of `python -m cgutils bench --markdown`")


def _recorded_pitfalls():
    return ResultsStore("nvidia-h200", env.REPO_ROOT / "results").load_frame("pitfalls")


def test_docs_pitfall_table_matches_the_recording():
    from cgutils.pitfalls import markdown_table as pitfall_table

    doc = (env.REPO_ROOT / "docs" / "pitfalls.md").read_text()
    m = re.search(r"<!-- pitfalls-table:begin -->\n(.*?)\n<!-- pitfalls-table:end -->", doc, re.S)
    assert m, "docs/pitfalls.md lacks the pitfalls-table markers"
    assert m.group(1).strip() == pitfall_table(_recorded_pitfalls()).strip(), (
        "docs/pitfalls.md differs from results/: paste `python -m cgutils bench pitfalls --markdown`")


def test_recorded_catalogue_is_complete_and_explained():
    """Every entry ran on the GPU, and explain() maps each recorded error text, here on the CPU, to the
    cause recorded there."""
    from cgutils import explain
    from cgutils.pitfalls import PITFALLS

    df = _recorded_pitfalls()
    assert sorted(df.key) == sorted(PITFALLS) and set(df.status) == {"ok"}
    raw = df[(df.exception.fillna("") != "") & (df.exception != "CaptureError")]
    assert len(raw) >= 2
    for r in raw.itertuples():
        assert explain(r.message).key == r.cause, (r.key, r.message)
    wrapped = df[df.original.fillna("") != ""]
    for r in wrapped.itertuples():  # the CUDA text under each CaptureError is recognised too
        assert explain(r.original) is not None, (r.key, r.original)


def test_recorded_sync_lines_still_point_at_the_reproducers():
    """docs/pitfalls.md quotes line numbers of cgutils/pitfalls.py from the recording: they must still hold."""
    from cgutils.pitfalls import PITFALLS

    df = _recorded_pitfalls()
    for r in df[df.cause == "sync"].itertuples():
        assert int(r.line) == PITFALLS[r.key].marked_line, r.key


def test_the_numbers_to_remember_agree_with_the_recordings():
    """notebooks/README.md's table is computed from results/ (scripts/numbers_to_remember.py), never typed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("numbers", env.REPO_ROOT / "scripts" / "numbers_to_remember.py")
    numbers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(numbers)
    m = re.search(r"<!-- numbers:begin -->\n(.*?)\n<!-- numbers:end -->", numbers.README.read_text(), re.S)
    assert m, "notebooks/README.md lacks the numbers markers"
    assert m.group(1) == numbers.table(env.REPO_ROOT / "results" / "nvidia-h200"), (
        "regenerate with: python scripts/numbers_to_remember.py --write")
