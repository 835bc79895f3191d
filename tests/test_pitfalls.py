"""The pitfall catalogue: CPU checks of its structure; GPU tests (``-m gpu``) run every entry on the H200
and assert cgutils' diagnosis: exception class, cause, and for syncs the op and the user's line."""

import dataclasses
import re

import pandas as pd
import pytest
import torch

import cgutils as cg
from cgutils import pitfalls
from cgutils.pitfalls import PITFALLS, Pitfall, run_entry


def test_catalogue_has_at_least_twelve_entries_of_known_kinds():
    assert len(PITFALLS) >= 12
    assert {p.kind for p in PITFALLS.values()} <= set(pitfalls.KINDS)
    for key, p in PITFALLS.items():
        assert p.key == key and p.title and p.fix and callable(p.bad) and callable(p.diagnose)


@pytest.mark.parametrize("key", [k for k, p in PITFALLS.items() if p.expect.get("cause") == "sync"])
def test_sync_reproducers_mark_their_offending_line(key):
    p = PITFALLS[key]
    line = p.marked_line
    assert line is not None and pitfalls.MARK in p.source
    assert pitfalls.MARK in open(pitfalls.__file__).read().splitlines()[line - 1]


def test_entries_are_built_with_keyword_arguments():
    """Entries passed eight positional arguments, so a swapped pair (fix text and fix function) went unseen."""
    p = PITFALLS["item"]
    with pytest.raises(TypeError):
        Pitfall(p.key, p.title, p.kind, p.bad, p.diagnose, p.fix)


def test_docstring_documents_exactly_the_fields():
    """Pitfall's docstring documented a ``reference`` field that did not exist."""
    documented = set(re.findall(r"^        (\w+): ", Pitfall.__doc__, flags=re.M))
    assert documented == {f.name for f in dataclasses.fields(Pitfall)}


def test_each_entry_carries_its_own_fix_check():
    """The fix check was chosen elsewhere by key and by the type of ``good``, so an entry could not say how
    its own fix is checked, and a new entry silently got whichever check its shape matched."""
    for p in PITFALLS.values():  # an entry with fix code has a check for it, and only then
        assert (p.good is None) == (p.check_fix is None), p.key
    ran = []

    def failing_check(entry, x):
        ran.append(entry.key)
        return False

    observed = {"exception": "", "message": "no error"}
    mine = dataclasses.replace(PITFALLS["item"], key="mine", diagnose=lambda entry, x: observed, check_fix=failing_check)
    row = run_entry(mine, torch.ones(4, 8))
    assert ran == ["mine"] and row["fix_ok"] is False
    assert list(row) == ["key", "title", "kind", "exception", "message", "expected_line", "fix", "fix_ok"]
    assert row["expected_line"] == PITFALLS["item"].marked_line
    no_fix = dataclasses.replace(mine, good=None, check_fix=None)
    assert run_entry(no_fix, torch.ones(4, 8))["fix_ok"] is None


def test_run_rejects_unknown_keys():
    with pytest.raises(cg.InputError, match="unknown pitfall"):
        pitfalls.run("nope")


def test_run_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(cg.NoCudaError, match=r"pitfalls.run\(\) needs a CUDA device.*docs/pitfalls.md"):
        pitfalls.run("item")


def test_markdown_table_escapes_pipes_and_names_the_op():
    df = pd.DataFrame([{"title": "t", "kind": "loud", "exception": "CaptureError", "cause": "sync",
                        "op": "Tensor.item", "line": 7, "message": "a | b", "original": "", "fix": "x | y"}])
    md = pitfalls.markdown_table(df)
    assert "`Tensor.item` at line 7" in md and "a / b" in md and "x / y" in md


def test_markdown_shows_the_silent_outcome_and_current_fix_text():
    df = pd.DataFrame([{"key": "python_value", "title": "old title", "kind": "silent", "exception": "CaptureError",
                        "cause": "baked_value", "op": None, "line": None, "original": None, "fix": "old fix",
                        "message": "replay 2 of X differs from eager: max relative error 0.333 > rtol 0.001"}])
    md = pitfalls.markdown_table(df)
    assert "no error from PyTorch; the replay is wrong by a relative error of 0.333" in md
    assert PITFALLS["python_value"].fix in md and "old fix" not in md


@pytest.mark.gpu
@pytest.mark.parametrize("key", list(PITFALLS))
def test_pitfall_is_diagnosed(key):
    p = PITFALLS[key]
    row = pitfalls.run(key)
    for field, want in p.expect.items():
        if field == "op":
            assert row["op"] == want, row
            assert row["line"] == p.marked_line, row  # the user's line, not a torch frame
        else:
            assert row.get(field) == want, (field, row)
    if p.expect == {}:  # outcome depends on torch/driver: the report must be consistent either way
        if row["exception"]:
            assert row["cause"] or row["message"], row
        else:
            assert row["max_rel_error"] <= 1e-5, row
    assert row["fix_ok"] in (True, None), row
    torch.cuda.synchronize()  # the context is still usable after the failure
