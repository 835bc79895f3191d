"""Diagnosis of failed captures, without a GPU: the error explainer, the exception tree, and the sync-point
finder (PyTorch's sync debug-mode warning is simulated by warning the same text)."""

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

import cgutils as cg
from cgutils.diagnose import SyncRecorder, find_sync_points, user_code

SYNC_TEXT = "called a synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") warns


def _warn_sync(v=None):
    warnings.warn(SYNC_TEXT, stacklevel=1)
    return v


# --- explain: error text -> cause and fix ---------------------------------------------------------------

# error texts as PyTorch 2.11 / CUDA 13 print them
@pytest.mark.parametrize("text, key", [
    ("CUDA error: operation not permitted when stream is capturing", "sync"),
    ("CUDA error: operation failed due to a previous error during capture\n"
     "cudaErrorStreamCaptureInvalidated", "invalidated"),
    ("CUDA error: operation would make the legacy stream depend on a capturing blocking stream", "default_stream"),
    ("CUDA graphs must be captured on a non-default stream. (However, after capture, it's ok to replay "
     "them on the default stream.)", "default_stream"),
    ("Attempting to capture with a CPU generator", "rng"),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", "allocation"),
])
def test_explain_known_capture_errors(text, key):
    why = cg.explain(RuntimeError(text))
    assert why is not None and why.key == key
    assert why.cause and why.fix


def test_explain_follows_the_exception_chain():
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        except RuntimeError as inner:
            raise RuntimeError("wrapper text with nothing useful") from inner
    except RuntimeError as outer:
        assert cg.explain(outer).key == "sync"


def test_explain_unknown_returns_none():
    assert cg.explain("something else entirely") is None


@pytest.mark.parametrize("text", ["expected argument seed to be an int, got str",
                                  "'Generator' object has no attribute 'x'"])
def test_explain_does_not_blame_the_rng_for_any_mention_of_seed(text):
    """Any error text that mentioned a seed or a generator was explained as an RNG capture problem."""
    why = cg.explain(text)
    assert why is None or why.key != "rng"


def test_explain_recognises_manual_seed_during_capture():
    """torch.manual_seed inside capture raises a set_current_seed error that no rule matched."""
    text = "CUDAGeneratorImpl::set_current_seed can be called during stream capture only if the generator is"
    assert cg.explain(text).key == "rng"


def test_explain_rejects_what_is_not_an_error():
    """explain(None) returned None, as for an unknown error, hiding the caller's mistake."""
    with pytest.raises(cg.InputError, match="exception or its message"):
        cg.explain(None)


def test_exception_tree():
    for exc in (cg.CaptureError, cg.InputError, cg.StaleRecordingError, cg.NoCudaError, cg.RecordingError):
        assert issubclass(exc, cg.CgutilsError)
    assert issubclass(cg.StaleRecordingError, cg.RecordingError)


# --- sync points ----------------------------------------------------------------------------------------


def test_sync_recorder_reports_the_users_line_and_the_op():
    def model(x):
        return x.apply_(_warn_sync)  # the sync happens inside one torch call, Tensor.apply_

    with SyncRecorder() as rec:
        model(torch.ones(1))
    df = rec.to_frame()
    assert list(df.columns) == ["op", "file", "line", "code", "function", "caller"]
    assert len(df) == 1 and df.op[0] == "Tensor.apply_"
    # the innermost user frame: _warn_sync here, which the torch call ran
    assert df.file[0] == __file__ and df.function[0] == "_warn_sync"
    assert df.line[0] == _warn_sync.__code__.co_firstlineno + 1


def test_sync_recorder_passes_other_warnings_through():
    with pytest.warns(UserWarning, match="unrelated"), SyncRecorder() as rec:
        warnings.warn("unrelated", stacklevel=1)
    assert rec.points == []


@pytest.fixture
def simulated_gpu(monkeypatch):
    """find_sync_points on the CPU: CUDA 'present', its debug mode and synchronize no-ops."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr("torch.cuda.set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr("torch.cuda.synchronize", lambda device=None: None)


def test_one_user_call_that_syncs_many_times_is_one_sync_point(simulated_gpu):
    """Printing a CUDA tensor syncs once per formatted piece; it was reported 8 times for one print."""
    def model(x):
        x.apply_(_warn_sync)  # three elements: three syncs inside one outermost torch call
        x.apply_(_warn_sync)  # another call: its own point
        torch.cuda.synchronize()  # outside any torch call: always its own point
        torch.cuda.synchronize()

    with SyncRecorder() as rec:
        model(torch.ones(3))
    assert [p.op for p in rec.points] == ["Tensor.apply_", "Tensor.apply_", "torch.cuda.synchronize",
                                          "torch.cuda.synchronize"]


def test_find_sync_points_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(cg.NoCudaError, match="find_sync_points needs a CUDA device"):
        find_sync_points(lambda: None)


@pytest.fixture
def library(tmp_path):
    """A module in another file whose ``postprocess`` syncs: someone else's code that the user calls."""
    path = tmp_path / "their_library.py"
    path.write_text("import warnings\n\n\ndef postprocess(x):\n"
                    f"    warnings.warn({SYNC_TEXT!r}, stacklevel=1)  # line 5\n    return x\n")
    spec = importlib.util.spec_from_file_location("their_library", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_find_sync_points_honours_user_files(simulated_gpu, library):
    """find_sync_points decided which frames were the user's by a hard-coded file name (pitfalls.py)."""
    def my_model(x):
        return library.postprocess(x * 2)  # the user's line that calls the syncing library

    line = my_model.__code__.co_firstlineno + 1
    default = find_sync_points(my_model, torch.ones(2))  # every file outside torch/stdlib/cgutils is user code
    assert (Path(default.file[0]).name, default.line[0]) == ("their_library.py", 5)
    mine = find_sync_points(my_model, torch.ones(2), user_files=[__file__])
    assert (mine.file[0], mine.line[0], mine.function[0]) == (__file__, line, "my_model")
    one_path = find_sync_points(my_model, torch.ones(2), user_files=Path(library.__file__))  # one path, not a list
    assert one_path.line.tolist() == [5]
    # none of them on the stack: still reported, at the default frame (it was dropped, and a failed capture then
    # read as a sync from outside PyTorch)
    elsewhere = find_sync_points(my_model, torch.ones(2), user_files=["/elsewhere.py"])
    assert (Path(elsewhere.file[0]).name, elsewhere.line.tolist()) == ("their_library.py", [5])
    with pytest.raises(cg.InputError, match="user_files must be file paths"):
        find_sync_points(my_model, torch.ones(2), user_files=[3])


def test_user_code_sets_the_default_for_calls_made_on_the_users_behalf(simulated_gpu, library):
    """GraphRunner's own diagnosis calls find_sync_points without user_files; a caller can still name them."""
    def my_model(x):
        return library.postprocess(x)

    with user_code([__file__]):
        inside = find_sync_points(my_model, torch.ones(2))
        explicit = find_sync_points(my_model, torch.ones(2), user_files=[library.__file__])  # the argument wins
    after = find_sync_points(my_model, torch.ones(2))
    assert inside.function.tolist() == ["my_model"]
    assert explicit.function.tolist() == after.function.tolist() == ["postprocess"]


def test_cgutils_frames_are_not_the_users_code_by_default():
    """The user-frame test compared a frame's folder with cgutils/ itself, so cgutils' subpackages
    (cgutils/capture/) would have counted as the user's code."""
    inside_cgutils = Path(cg.__file__).parent / "capture" / "imaginary.py"
    code = compile(f"import warnings\nwarnings.warn({SYNC_TEXT!r}, stacklevel=1)\n", str(inside_cgutils), "exec")

    def my_model():
        exec(code, {})  # noqa: S102 - stands in for cgutils machinery that syncs

    with SyncRecorder() as rec:
        my_model()
    assert [p.function for p in rec.points] == ["my_model"]


def test_a_sync_with_only_cgutils_frames_above_torch_is_reported_not_dropped():
    """Regression (notebook 04 on the H200): a sync made by a function in cgutils, diagnosed under user_code naming
    a file not on the stack, was dropped, and GraphRunner's error called it a sync from outside PyTorch."""
    inside_cgutils = Path(cg.__file__).parent / "pitfalls" / "imaginary.py"
    code = compile(f"import warnings\nwarnings.warn({SYNC_TEXT!r}, stacklevel=1)\n", str(inside_cgutils), "exec")
    with user_code(["/not/on/the/stack.py"]), SyncRecorder() as rec:
        exec(code, {})  # noqa: S102 - a cgutils reproducer that syncs, called from here
    assert len(rec.points) == 1
    assert rec.points[0].file == __file__  # the default user frame: this test's line that ran it


def _failure_with(monkeypatch, text, **attrs):
    """capture_failure for an error ``text`` whose eager rerun found no sync in this thread, but ``attrs``."""
    import pandas as pd

    import cgutils.capture.graph as graph
    from cgutils.diagnose import SYNC_COLUMNS

    def no_syncs(fn, *a, **k):
        df = pd.DataFrame(columns=SYNC_COLUMNS)
        df.attrs.update({"other_threads": [], "unforked_joins": [], **attrs})
        return df

    monkeypatch.setattr(graph, "find_sync_points", no_syncs)
    return graph.capture_failure(RuntimeError(text), lambda: None, "f"), None


def test_a_refused_call_with_no_pytorch_sync_is_an_external_sync(monkeypatch):
    """A sync made by an extension was reported with cause `sync` and, in the same message, "an eager rerun
    found no sync, so the cause is not a sync"."""
    err, _ = _failure_with(monkeypatch, "CUDA error: operation not permitted when stream is capturing")
    assert err.cause == "external_sync"
    assert "not a sync" not in str(err) and "outside PyTorch" in str(err)


def test_a_sync_from_another_thread_is_named(monkeypatch):
    """Another thread's device sync broke the capture, and its syncs were listed as the user's own."""
    from cgutils.diagnose import SyncPoint

    point = SyncPoint("torch.cuda.synchronize", "loader.py", 12, "torch.cuda.synchronize()", "prefetch")
    err, _ = _failure_with(monkeypatch, "operation failed due to a previous error during capture",
                           other_threads=[("prefetch-0", point)])
    assert err.cause == "other_thread" and "'prefetch-0'" in str(err) and "loader.py:12" in str(err)


def test_an_unforked_side_stream_is_named_at_its_join(monkeypatch):
    """A side stream joined back without a fork got the generic "invalidated" text."""
    from cgutils.diagnose import SyncPoint

    join = SyncPoint("Stream.wait_stream", "model.py", 40, "torch.cuda.current_stream().wait_stream(side)", "forward")
    err, _ = _failure_with(monkeypatch, "operation failed due to a previous error during capture",
                           unforked_joins=[join])
    assert err.cause == "unforked_stream" and "model.py:40" in str(err) and "side.wait_stream" in str(err)


def test_exception_chain_is_the_one_walk_newest_first_cut_at_cycles():
    """The walk along __cause__/__context__ existed three times (explain, failure_site, first_cgutils_error),
    with two limits and two ways to stop at a cycle (issue 22); one function now, used by all three."""
    try:
        try:
            raise ValueError("first")
        except ValueError as first:
            raise RuntimeError("second") from first
    except RuntimeError as second:
        chain = cg.exception_chain(second)
    assert [str(e) for e in chain] == ["second", "first"]
    a, b = KeyError("a"), KeyError("b")
    a.__context__, b.__context__ = b, a  # a cycle: must end
    assert cg.exception_chain(a) == [a, b]
    assert len(cg.exception_chain(_deep(30))) == 16 and len(cg.exception_chain(_deep(30), limit=3)) == 3
    assert cg.exception_chain(None) == []
    # explain reads the whole chain: the cause of a consequence names the rule
    wrapped = RuntimeError("operation failed due to a previous error during capture")
    wrapped.__context__ = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    assert cg.explain(wrapped) is not None


def _deep(n):
    exc = ValueError(0)
    for i in range(1, n):
        new = ValueError(i)
        new.__context__ = exc
        exc = new
    return exc


def test_a_fork_never_joined_is_unjoined_not_unforked(monkeypatch):
    """A correct fork (side.wait_stream(current)) that was never joined back failed capture with CUDA's "capturing
    stream has unjoined work", and the CaptureError said cause="unforked_stream" and told the user to fork: the
    rerun's join check read the fork as a join, and its evidence overrode CUDA's own error code."""
    from cgutils.diagnose import SyncPoint

    fork = SyncPoint("Stream.wait_stream", "model.py", 30, "side.wait_stream(torch.cuda.current_stream())", "forward")
    err, _ = _failure_with(monkeypatch, "CUDA error: capturing stream has unjoined work",
                           unforked_joins=[fork], unjoined_forks=[fork])
    assert err.cause == "unjoined"
    assert "model.py:30" in str(err) and "never joined back" in str(err) and "fork it" not in str(err)


@pytest.mark.parametrize("text, key", [
    ("CUDA error: operation would make the legacy stream depend on a capturing blocking stream "
     "(cudaErrorStreamCaptureImplicit)", "default_stream"),
    ("CUDA error: cudaErrorStreamCaptureIsolation", "unforked_stream"),
    ("CUDA error: capturing stream has unjoined work", "unjoined"),
    ("CUDA error: out of memory", "allocation"),
])
def test_a_specific_cuda_error_names_its_cause_whatever_the_rerun_found(monkeypatch, text, key):
    from cgutils.diagnose import SyncPoint

    p = SyncPoint("Stream.wait_stream", "m.py", 3, "s.wait_stream(t)", "f")
    err, _ = _failure_with(monkeypatch, text, unforked_joins=[p], other_threads=[("loader", p)])
    assert err.cause == key


def test_the_recorder_tells_forks_joins_and_unforked_joins_apart():
    from cgutils.diagnose import SyncRecorder

    rec = SyncRecorder()
    rec._captured = {1}  # stream 1 is the one a capture would run on
    rec._wait(2, 1)  # fork side stream 2
    rec._wait(3, 1)  # fork 3
    rec._wait(1, 2)  # join 2 back
    rec._wait(1, 4)  # join 4, which never forked: refused inside capture
    rec._wait(5, 6)  # two streams outside the capture: nothing to say
    rec.unjoined_forks = list(rec._forks.values())
    assert [p.line for p in rec.unforked_joins] == [_line_of("rec._wait(1, 4)")]
    assert [p.line for p in rec.unjoined_forks] == [_line_of("rec._wait(3, 1)")]


def test_a_side_stream_joined_and_forked_again_must_be_joined_again():
    """A second fork after a join (side.wait_stream(main) again) was taken for a join of the main stream, so the
    side stream's later work, never joined back, went unreported."""
    from cgutils.diagnose import SyncRecorder

    rec = SyncRecorder()
    rec._start, rec._captured = {1}, {1}
    rec._wait(2, 1)  # fork
    rec._wait(1, 2)  # join
    rec._wait(2, 1)  # fork again
    rec.unjoined_forks = list(rec._forks.values())
    assert [p.line for p in rec.unjoined_forks] == [_line_of_in(
        test_a_side_stream_joined_and_forked_again_must_be_joined_again, "rec._wait(2, 1)  # fork again")]


def test_event_forks_and_joins_count_like_wait_stream(monkeypatch):
    """`ev.record(main); side.wait_event(ev)` forks as `side.wait_stream(main)` does (it was not seen: only
    wait_stream was watched), and wait_stream's own event is not counted a second time."""
    import types

    import torch

    from cgutils.diagnose import SyncRecorder

    class FakeEvent:
        pass

    def fake_wait_stream(waiter, other):  # torch's: record an event on `other`, wait on it
        e = FakeEvent()
        torch.cuda.Event.record(e, other)
        torch.cuda.Event.wait(e, waiter)

    monkeypatch.setattr(torch.cuda.Event, "record", lambda self, stream=None: None)
    monkeypatch.setattr(torch.cuda.Event, "wait", lambda self, stream=None: None)
    monkeypatch.setattr(torch.cuda.Stream, "wait_stream", fake_wait_stream)
    main, side, other, third = (types.SimpleNamespace(cuda_stream=i) for i in (1, 2, 3, 4))
    e1, e2, e3 = FakeEvent(), FakeEvent(), FakeEvent()
    with SyncRecorder() as rec:
        rec._start, rec._captured = {1}, {1}
        torch.cuda.Event.record(e1, main)
        torch.cuda.Event.wait(e1, side)  # fork by event
        torch.cuda.Event.record(e2, side)
        torch.cuda.Event.wait(e2, main)  # join by event
        torch.cuda.Event.record(e3, main)
        torch.cuda.Event.wait(e3, other)  # fork by event, never joined
        torch.cuda.Stream.wait_stream(third, main)  # fork by wait_stream
        torch.cuda.Stream.wait_stream(main, third)  # join by wait_stream
    here = test_event_forks_and_joins_count_like_wait_stream
    assert [(p.op, p.line) for p in rec.unjoined_forks] == [
        ("Event.wait", _line_of_in(here, "torch.cuda.Event.wait(e3, other)"))]
    assert rec.unforked_joins == []


def _line_of_in(fn, code):
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if code in line)


def _line_of(code):
    return _line_of_in(test_the_recorder_tells_forks_joins_and_unforked_joins_apart, code)


def test_a_sync_in_a_library_names_the_library_line_and_the_users_line_that_led_there():
    """For torchvision's Faster R-CNN the 199 syncs all named the caller's line (`out = runner(...)`): the
    torch directory was matched as a bare prefix, so torchvision/ counted as torch/ and was skipped."""
    import traceback

    from cgutils import diagnose as d

    vision = d._TORCH_DIR[:-1] + "vision/ops/boxes.py"
    assert not d._skipped(vision) and d._skipped(d._TORCH_DIR + "functional.py")
    site = "/opt/env/lib/python3.12/site-packages/transformers/modeling_utils.py"
    stack = [traceback.FrameSummary("/home/me/serve.py", 12, "main", line="out = runner(images)"),
             traceback.FrameSummary(vision, 99, "nms", line="keep = torch.where(mask)"),
             traceback.FrameSummary(d._TORCH_DIR + "functional.py", 5, "where", line="")]
    p = d._sync_point("torch.where", stack, None)
    assert (p.file, p.line, p.caller) == (vision, 99, "/home/me/serve.py:12")
    own = d._sync_point("Tensor.item", stack[:1], None)
    assert (own.file, own.caller) == ("/home/me/serve.py", "")
    assert d._sync_point("x", [traceback.FrameSummary(site, 3, "f", line="")], None).caller == ""
    # a conda or system Python keeps site-packages inside the standard library's directory: still a library
    assert not d._skipped(d._STDLIB_DIR + "site-packages/torchvision/x.py") and d._skipped(d._STDLIB_DIR + "os.py")


@pytest.mark.parametrize("text, key", [
    ("CUDA error: operation would have resulted in a merge of two independent capture sequences", "capture_merge"),
    ("CUDA error: operation not permitted on an event last recorded in a capturing stream", "captured_event"),
    ("CUDA error: attempt to terminate a thread-local capture sequence from another thread", "wrong_thread"),
    ("CUDA error: the capture was not initiated in this stream", "unmatched"),
])
def test_capture_codes_without_a_rule_are_not_called_a_sync_when_the_rerun_saw_one(monkeypatch, text, key):
    """Regression (new-user pass): these four CUDA errors matched no rule, so a sync the eager rerun happened
    to see became the cause ("sync") and the fix told the user to remove it."""
    import pandas as pd

    import cgutils.capture.graph as graph
    from cgutils.diagnose import SYNC_COLUMNS

    def one_sync(fn, *a, **k):
        row = dict.fromkeys(SYNC_COLUMNS, "")
        row.update(op="Tensor.item", file="m.py", line=7, code="x.item()")
        df = pd.DataFrame([row], columns=SYNC_COLUMNS)
        df.attrs.update({"other_threads": [], "unforked_joins": []})
        return df

    monkeypatch.setattr(graph, "find_sync_points", one_sync)
    err = graph.capture_failure(RuntimeError(text), lambda: None, "f")
    assert err.cause == key
    assert "m.py:7" in str(err)  # the rerun's line still reported, as evidence
