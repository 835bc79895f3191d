"""The pitfall catalogue: CPU checks of its structure; GPU tests (``-m gpu``) run every entry on the H200
and assert cgutils' diagnosis: exception class, cause, and for syncs the op and the user's line."""

import dataclasses
import inspect
import re

import pandas as pd
import pytest
import torch

import cgutils as cg
from cgutils import pitfalls
from cgutils.pitfalls import PITFALLS, REAL_USE, Pitfall, entry, outside, reproducers, run_entry, steps

REAL_USE_KEYS = ["shared_threads", "inplace_input", "stateful_buffer", "rebound_attribute", "failed_capture_stream",
                 "other_thread_work", "external_sync", "unforked_stream", "sampling", "many_shapes"]


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
    assert pitfalls.MARK in open(inspect.getsourcefile(p.bad)).read().splitlines()[line - 1]


def test_every_entry_marks_its_offending_line_in_the_reproducers_file():
    """The reproducers lived in two files, now in one (pitfalls/reproducers.py, issue 22); each marked line must
    be found there, where sync points are reported."""
    for key, p in PITFALLS.items():
        line = p.marked_line
        assert line is not None, key
        assert inspect.getsourcefile(p.bad) == reproducers.__file__, key
        assert pitfalls.MARK in open(inspect.getsourcefile(p.bad)).read().splitlines()[line - 1], key


def test_real_use_entries_follow_the_others_one_per_kind():
    """Issue 11: every kind of real-use failure gets an entry, after the first catalogue's entries, each with
    an expectation the GPU test asserts."""
    assert list(REAL_USE) == REAL_USE_KEYS
    assert list(PITFALLS)[-len(REAL_USE_KEYS):] == REAL_USE_KEYS
    assert len(PITFALLS) == len(set(PITFALLS))
    for key in REAL_USE_KEYS:
        p = PITFALLS[key]
        assert p.kind in pitfalls.KINDS and p.expect and "exception" in p.expect, key


def test_recorded_outcomes_are_not_claimed_in_fix_texts():
    """default_stream's fix said "this torch accepted capture_begin() on its default stream" (false on torch
    2.11: the recording had run on a stream that an earlier failed entry left current); dropout_train expected
    baked_value, which validation from the same generator state no longer has to report."""
    assert "accepted" not in PITFALLS["default_stream"].fix
    assert PITFALLS["default_stream"].kind == "documented"
    assert PITFALLS["dropout_train"].expect == {"warned": True, "differs_across_replays": True}
    assert "baked_value" not in PITFALLS["dropout_train"].fix


def test_entries_that_do_not_break_a_graph_are_not_called_silent():
    """dropout_train and sampling were kind 'silent' (a wrong replay without an error), though their own rows
    show replays drawing new values as eager does; they are 'safe', and the dropout row now measures it."""
    assert PITFALLS["dropout_train"].kind == PITFALLS["sampling"].kind == "safe"
    assert PITFALLS["sampling"].expect["differs_across_replays"] is True


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
    assert "`Tensor.item` at reproducers.py line 7" in md and "a / b" in md and "x / y" in md


def test_markdown_shows_the_silent_outcome_and_current_fix_text():
    df = pd.DataFrame([{"key": "python_value", "title": "old title", "kind": "silent", "exception": "CaptureError",
                        "cause": "baked_value", "op": None, "line": None, "original": None, "fix": "old fix",
                        "message": "replay 2 of X differs from eager: max relative error 0.333 > rtol 0.001"}])
    md = pitfalls.markdown_table(df)
    assert "no error from PyTorch; the replay is wrong by a relative error of 0.333" in md
    assert PITFALLS["python_value"].fix in md and "old fix" not in md


def test_markdown_prefers_what_the_run_says_happened_and_names_the_reproducers_file():
    """Every sync is reported at a line of pitfalls/reproducers.py; the table names the file."""
    df = pd.DataFrame([
        {"key": "item", "title": "t", "kind": "loud", "exception": "CaptureError", "cause": "sync", "op": "Tensor.item",
         "line": 111, "message": "m", "original": "CUDA error", "fix": "f", "happens": None},
        {"key": "failed_capture_stream", "title": "t", "kind": "loud", "exception": "CaptureError", "cause": "sync",
         "op": "Tensor.item", "line": 125, "message": "m", "original": "CUDA error", "fix": "f",
         "happens": "torch.cuda.graph raises AcceleratorError; the stream is left"},
        {"key": "sampling", "title": "t", "kind": "silent", "exception": "CaptureError", "cause": "baked_value",
         "op": None, "line": None, "original": None, "fix": "f", "happens": "replays draw new samples",
         "message": "replay differs from eager: max relative error 0.5 > rtol 0.001"}])
    md = pitfalls.markdown_table(df).splitlines()
    assert "`Tensor.item` at reproducers.py line 111" in md[2] and "| CUDA error |" in md[2]  # a CSV round trip: NaN happens
    assert "`Tensor.item` at reproducers.py line 125" in md[3] and "the stream is left" in md[3]
    assert "replays draw new samples" in md[4] and "relative error of 0.5" not in md[4]


class _FakeGraphContext:
    """torch.cuda.graph as it fails: its capture stream becomes current, and capture_end raises in __exit__
    before the stream context is left (torch/cuda/graphs.py)."""

    def __init__(self, state):
        self.state = state

    def __call__(self, graph, **kwargs):
        return self

    def __enter__(self):
        self.state["stream"] = "capture stream"

    def __exit__(self, *exc):
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


@pytest.mark.parametrize("how", ["manual_capture", "through_validate_replay"])
def test_a_failed_raw_capture_puts_the_callers_stream_and_rng_back(how, monkeypatch):
    """The default_stream entry recorded "no error" because an earlier entry's failed torch.cuda.graph had left
    its capture stream current. A CPU stand-in for torch.cuda shows the diagnose steps put the caller's stream
    back and reset the RNG after such a failure."""
    state = {"stream": "caller's stream", "rng_resets": 0}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["stream"])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: state.update(stream=stream))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", _FakeGraphContext(state))
    monkeypatch.setattr(entry, "reset_rng_after_failed_capture",
                        lambda: state.update(rng_resets=state["rng_resets"] + 1))
    if how == "manual_capture":
        row = entry.manual_capture(lambda: None)
    else:
        def bad(x):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass
        row = steps.through_validate_replay(dataclasses.replace(PITFALLS["cpu_input"], bad=bad), torch.ones(4, 8))
    assert state == {"stream": "caller's stream", "rng_resets": 1}
    assert row["exception"] == "RuntimeError" and row["cause"] == "invalidated", row


def test_external_sync_without_a_cuda_runtime_says_so(monkeypatch):
    monkeypatch.setattr(outside, "cuda_runtime", lambda: None)
    row = outside.external_sync_check(PITFALLS["external_sync"], torch.ones(4, 8))
    assert row["available"] is False and row["exception"] == "" and "cudaDeviceSynchronize" in row["message"]


def test_cuda_runtime_lookup_never_raises():
    """Without a GPU (or without cuda-python and a loaded libcudart) the lookup returns None; with one, a
    name and a callable that returns None when the sync succeeded."""
    found = outside.cuda_runtime.__wrapped__()  # uncached: the cached value is for the GPU run
    assert found is None or (isinstance(found[0], str) and callable(found[1]))
    if not torch.cuda.is_available():
        assert found is None


@pytest.mark.gpu
@pytest.mark.parametrize("key", list(PITFALLS))
def test_pitfall_is_diagnosed(key):
    p = PITFALLS[key]
    stream = torch.cuda.current_stream()
    row = pitfalls.run(key)
    # no entry leaves state for the next one: the caller's stream, and random ops that work
    assert torch.cuda.current_stream() == stream, row
    torch.rand(4, device="cuda")
    if row.get("available") is False:
        pytest.skip(row["message"])
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


@pytest.mark.gpu
def test_manual_capture_restores_the_stream_after_a_real_failure():
    x = entry.example()
    stream = torch.cuda.current_stream()
    row = entry.manual_capture(lambda: x * x.sum().item())
    assert row["exception"], row
    assert torch.cuda.current_stream() == stream
    torch.rand(4, device="cuda")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_raw_capture_records_what_a_failure_leaves_and_repairs_it():
    x = entry.example()
    stream = torch.cuda.current_stream()
    raw = entry.raw_capture(lambda: x * x.sum().item())
    assert raw["raw_exception"] and isinstance(raw["raw_stream_restored"], bool) and "raw_rng_ok" in raw, raw
    assert torch.cuda.current_stream() == stream and not torch.cuda.is_current_stream_capturing()
    torch.rand(4, device="cuda")
    torch.cuda.synchronize()


def test_graphed_fix_check_calls_the_runner_on_an_input_other_than_the_capture_one(monkeypatch):
    """A fix whose replay repeats what the capture saw must fail the check (before the fix, the check's
    first runner call was both the capture and the compared call, so a stale replay passed)."""
    from types import SimpleNamespace

    from cgutils.pitfalls import steps

    class StaleRunner:  # replays the capture's output, whatever the input: a baked-in value
        def __init__(self, fn):
            self.fn, self.out = fn, None

        def __call__(self, x):
            if self.out is None:
                self.out = self.fn(x)
            return self.out

    monkeypatch.setattr(steps, "example", lambda seed=0: torch.full((4, 8), float(seed + 1)))
    monkeypatch.setattr(steps, "GraphRunner", StaleRunner)
    p = SimpleNamespace(good=lambda x: x * 2)
    assert steps.graphed_fix_matches_eager(p, steps.example(0)) is False
    monkeypatch.setattr(steps, "GraphRunner", lambda fn: fn)  # a replay that follows its input
    assert steps.graphed_fix_matches_eager(p, steps.example(0)) is True
