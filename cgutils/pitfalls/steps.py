"""The diagnose steps and fix checks of the catalogue's entries that run in the calling thread: a sync or a
host copy in capture, static buffers, values baked in at capture, warm-up and autotuning, streams, state
updated in place, a failed capture, sampling, many shapes.

A diagnose step runs an entry's reproducer through cgutils (and, where there is one, the raw failure: a manual
graph, ``torch.cuda.graph``) and returns the observed row (:func:`.entry.observed_row`); a fix check runs the
entry's ``good`` and says whether it matches eager. Entries of real use compare GraphRunner of a module with an
eager twin (a deep copy) and with a manual graph. Sources: the CUDA Programming Guide, "Stream capture"; the
PyTorch docs, "CUDA Graphs" in torch.cuda semantics.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..capture import GraphRunner, capture_graph, max_rel_error, validate_replay
from ..checks import first_line
from ..errors import CaptureError, CgutilsError, InputError
from .entry import Pitfall, example, kept_stream, manual_capture, observed_row, raw_capture, raw_failure, rng_works

STEPS = 5  # stateful_check: calls compared with as many eager calls


LENGTHS = tuple(range(16, 16 * 13, 16))  # many_shapes_check: 12 sequence lengths


# --- one call through cgutils ---------------------------------------------------------------------------


def through_runner(p: Pitfall, x: torch.Tensor) -> dict:
    """``GraphRunner(bad)(x)``: what it raises (syncs: the op and the user's line), else "no error"."""
    try:
        GraphRunner(p.bad)(x)
    except CgutilsError as exc:
        return observed_row(exc)
    return observed_row(None, message="no error")


def through_validate_replay(p: Pitfall, x: torch.Tensor) -> dict:
    """A manual graph (``bad(x)`` returns the graphed callable) through validate_replay on three inputs.
    A capture that raises is recorded raw; the caller's stream and RNG are put back after it."""
    try:
        with kept_stream():
            validate_replay(p.bad(x), lambda t: t * 2, [(example(s),) for s in (1, 2, 3)])
    except CgutilsError as exc:
        return observed_row(exc)
    except Exception as exc:  # capture itself refused it: record the raw error and its explanation
        return raw_failure(exc)
    return observed_row(None, message="no error")


def cpu_input_check(p: Pitfall, x: torch.Tensor) -> dict:
    """:func:`through_validate_replay`, plus what GraphRunner says when handed the CPU tensor itself."""
    row = through_validate_replay(p, x)
    try:
        GraphRunner(lambda t: t * 2)(x.cpu())
    except InputError as exc:
        row["runner_error"] = first_line(exc)[:300]
        row["runner_exception"] = type(exc).__name__
    return row


def baked_value_check(p: Pitfall, x: torch.Tensor) -> dict:
    """Capture the module ``bad()`` with checked replays, change its ``scale`` to 3, call it again."""
    model = p.bad()
    runner = GraphRunner(model, validate_replays=2)
    runner(x)
    if isinstance(model.scale, torch.Tensor):
        model.scale.fill_(3.0)
    else:
        model.scale = 3.0
    try:
        runner(example(1))
    except CgutilsError as exc:
        return observed_row(exc)
    return observed_row(None, message="no error")


def training_mode_check(p: Pitfall, x: torch.Tensor) -> dict:
    """GraphRunner of the module ``bad()`` left in training mode: the warning (``warned``) and whether two replays
    on one input differ (``differs_across_replays``: a new dropout mask each replay, not one frozen at capture)."""
    model = p.bad()  # nn.Module starts in training mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = GraphRunner(model)
    warned = any("training mode" in str(w.message) for w in caught)
    try:
        first, second = runner(x), runner(x)  # two replays on the same input: one mask, or a new one each
    except CgutilsError as exc:
        return observed_row(exc, warned=warned)
    differs = not torch.equal(first, second)
    return observed_row(None, message="no error; " + ("two replays on the same input drew different masks" if differs
                                                      else "two replays on the same input gave the same output"),
                        warned=warned, differs_across_replays=differs)


def new_shapes_check(p: Pitfall, x: torch.Tensor) -> dict:
    """GraphRunner of ``bad`` on four sequence lengths: graphs captured and their memory in bytes."""
    runner = GraphRunner(p.bad)
    for n in (64, 128, 192, 256):
        runner(torch.randn(1, n, 256, device="cuda"))
    st = runner.stats
    return observed_row(None, message=f"{st.captures} graphs for 4 shapes, {st.memory_bytes / 2**20:.1f} MiB in all",
                        captures=st.captures, memory_bytes=st.memory_bytes)


def cold_thread_check(p: Pitfall, x: torch.Tensor) -> dict:
    """:func:`manual_capture` of ``bad(x)`` in a new thread, as a fresh process would first run it."""
    fn = p.bad(x)
    result: dict = {}
    # A new thread gets its own cuBLAS handle in PyTorch's per-thread pool, so its first matmul is
    # the cold start a fresh process would see.
    t = threading.Thread(target=lambda: result.update(manual_capture(fn)))
    t.start()
    t.join()
    return result


def cudnn_benchmark_check(p: Pitfall, x: torch.Tensor) -> dict:
    """:func:`manual_capture` of ``bad(x)`` with ``torch.backends.cudnn.benchmark`` on (restored after)."""
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        return manual_capture(p.bad(x))
    finally:
        torch.backends.cudnn.benchmark = old


def default_stream_check(p: Pitfall, x: torch.Tensor) -> dict:
    """:func:`manual_capture` of ``bad(x)`` with ``capture_begin()`` on the current (default) stream."""
    return manual_capture(p.bad(x), on_default_stream=True)


# --- fix checks ------------------------------------------------------------------------------------------


def graphed_fix_matches_eager(p: Pitfall, x: torch.Tensor) -> bool:
    """``good`` through GraphRunner, captured on ``x`` and then called on another input, matches ``good`` run
    eagerly on that input (a replay of what the capture saw would match on ``x`` itself)."""
    try:
        runner = GraphRunner(p.good)
        runner(x)  # the capture
        return max_rel_error(runner(example(1)), p.good(example(1))) <= 1e-5
    except CaptureError:
        return False


def replay_fix_validates(p: Pitfall, x: torch.Tensor) -> bool:
    """The graphed callable ``good(x)`` passes validate_replay against y = 2x on three inputs."""
    try:
        validate_replay(p.good(x), lambda t: t * 2, [(example(s),) for s in (1, 2, 3)])
    except CaptureError:
        return False
    return True


def module_fix_follows_changes(p: Pitfall, x: torch.Tensor) -> bool:
    """The module ``good()`` through GraphRunner with checked replays: its ``scale`` changed after capture
    to 3, the replays still match eager."""
    try:
        model = p.good().cuda()
        runner = GraphRunner(model, validate_replays=2)
        runner(x)
        model.scale.fill_(3.0)
        runner(example(1))
    except CaptureError:
        return False
    return True


# --- state: in-place updates, counters, attributes -----------------------------------------------------


def _module_pair(p: Pitfall) -> tuple[nn.Module, nn.Module]:
    model = p.bad().cuda().eval()
    return model, copy.deepcopy(model)  # the twin runs eagerly from the same weights and state


def _same(a: Any, b: Any) -> bool:
    return max_rel_error(a, b) <= 1e-5


def _manual_graph(model: nn.Module, x: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    """``model`` captured by hand (capture_graph: 3 warm-up calls, then capture), called with copy_."""
    static_x = x.clone()
    g, static_out = capture_graph(lambda: model(static_x), warmup=3)

    def graphed(new_x):
        static_x.copy_(new_x)
        g.replay()
        return static_out.clone()

    graphed.static_input = static_x
    return graphed


def inplace_input_check(p: Pitfall, x: torch.Tensor) -> dict:
    """GraphRunner of the module ``bad()`` against an eager twin over three calls: outputs, and the caller's
    tensor after each call; and the same with a manual graph."""
    model, twin = _module_pair(p)
    raw_model = copy.deepcopy(twin)
    graphed = _manual_graph(raw_model, example(9))
    matches = caller = raw_caller = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = GraphRunner(model)
        try:
            for s in (1, 2, 3):
                a, b, c = example(s), example(s), example(s)
                out = runner(a)
                with torch.no_grad():
                    expected = twin(b)
                graphed(c)
                matches &= _same(out, expected)
                caller &= _same(a, b)
                raw_caller &= _same(c, b)
        except CgutilsError as exc:
            return observed_row(exc)
    warned = any("in place" in str(w.message) and "img" in str(w.message) for w in caught)
    return observed_row(None, message="no error", matches_eager=matches, caller_tensor_matches=caller,
                        raw_caller_tensor_matches=raw_caller, warned=warned,
                        happens=f"a manual graph normalises its static input only: the caller's tensor "
                                f"{'matches' if raw_caller else 'differs from'} eager's; GraphRunner: outputs "
                                f"{'match' if matches else 'differ from'} eager, the caller's tensor "
                                f"{'matches' if caller else 'differs from'} eager's")


def stateful_check(p: Pitfall, x: torch.Tensor) -> dict:
    """GraphRunner of the module ``bad()``, called STEPS times, against STEPS eager calls of a twin: the
    position and the cache; and the position a manual graph (3 warm-up calls) leaves after STEPS replays."""
    model, twin = _module_pair(p)
    raw_model = copy.deepcopy(twin)
    graphed = _manual_graph(raw_model, x)
    for _ in range(STEPS):
        graphed(x)
    runner = GraphRunner(model)
    try:
        outs = [runner(x) for _ in range(STEPS)]
    except CgutilsError as exc:
        return observed_row(exc, raw_pos=int(raw_model.pos))
    with torch.no_grad():
        expected = [twin(x) for _ in range(STEPS)]
    state = torch.equal(model.pos, twin.pos) and _same(model.cache, twin.cache)
    pos, raw_pos = int(model.pos), int(raw_model.pos)
    return observed_row(None, message="no error", state_matches=state, matches_eager=_same(outs, expected),
                        pos=pos, raw_pos=raw_pos,
                        happens=f"a manual graph (3 warm-up calls, then {STEPS} replays) leaves pos at {raw_pos} "
                                f"where {STEPS} eager calls leave {int(twin.pos)}; GraphRunner: pos {pos}, cache and "
                                f"pos {'equal' if state else 'differ from'} eager's")


def rebound_check(p: Pitfall, x: torch.Tensor) -> dict:
    """GraphRunner of the module ``bad()``, three calls with different inputs: the warning, and whether
    ``model.hidden`` equals an eager twin's after each call."""
    model, twin = _module_pair(p)
    follows = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = GraphRunner(model)
        try:
            for s in (1, 2, 3):
                runner(example(s))
                with torch.no_grad():
                    twin(example(s))
                follows &= isinstance(model.hidden, torch.Tensor) and _same(model.hidden, twin.hidden)
        except CgutilsError as exc:
            return observed_row(exc)
    warned = any(".hidden" in str(w.message) for w in caught)
    return observed_row(None, message="no error", warned=warned, attribute_follows=follows,
                        happens=f"GraphRunner {'warns' if warned else 'does not warn'} that forward rebinds "
                                f".hidden; after each call model.hidden {'equals' if follows else 'differs from'} "
                                f"an eager call's")


def module_fix_matches_eager(p: Pitfall, x: torch.Tensor) -> bool:
    """The module ``good()`` through GraphRunner, on an input it was not captured with, matches it eagerly."""
    model = p.good().cuda().eval()
    try:
        runner = GraphRunner(model)
        runner(x)
        out = runner(example(1))
    except CgutilsError:
        return False
    with torch.no_grad():
        return _same(out, model(example(1)))


# --- a failed capture, sampling, many shapes -----------------------------------------------------------


def failed_capture_check(p: Pitfall, x: torch.Tensor) -> dict:
    """``bad`` captured raw with torch.cuda.graph, then through GraphRunner: the current stream and RNG after
    each failure."""
    before = torch.cuda.current_stream()
    raw = raw_capture(lambda: p.bad(x))
    exc = None
    try:
        GraphRunner(p.bad)(x)
    except CgutilsError as e:
        exc = e
    restored = torch.cuda.current_stream() == before
    torch.cuda.set_stream(before)  # whatever happened, the next entry starts from the caller's stream
    rng_ok = rng_works()
    stream = "is the caller's again" if raw["raw_stream_restored"] else "is still torch.cuda.graph's capture stream"
    rng = "" if "raw_rng_ok" not in raw else "; random ops work" if raw["raw_rng_ok"] else "; random ops fail"
    return observed_row(exc, **raw, runner_stream_restored=restored, rng_ok=rng_ok,
                        happens=f"torch.cuda.graph raises {raw['raw_exception'] or 'nothing'}; afterwards the current "
                                f"stream {stream}{rng}; after GraphRunner's CaptureError the stream "
                                f"{'is' if restored else 'is not'} the caller's and random ops "
                                f"{'work' if rng_ok else 'fail'}")


def sampling_check(p: Pitfall, x: torch.Tensor) -> dict:
    """GraphRunner of the eval-mode module ``bad()``: whether it validates, whether replays draw new samples,
    and whether a replay after ``torch.cuda.manual_seed(s)`` equals an eager call after the same seed."""
    model = p.bad().cuda().eval()
    runner = GraphRunner(model)
    try:
        runner(x)
        differs = any(not torch.equal(runner(x), runner(x)) for _ in range(10))
        torch.cuda.manual_seed(1234)
        replayed = runner(x)
        torch.cuda.manual_seed(1234)
        with torch.no_grad():
            same_seed = torch.equal(replayed, model(x))
    except CgutilsError as exc:
        return observed_row(exc)
    return observed_row(None, message="no error", differs_across_replays=differs, matches_eager_same_seed=same_seed,
                        happens=f"no error; replays {'draw new samples' if differs else 'repeat the same samples'}; a "
                                f"replay after manual_seed {'equals' if same_seed else 'differs from'} eager after the "
                                f"same seed")


def many_shapes_check(p: Pitfall, x: torch.Tensor) -> dict:
    """GraphRunner of ``bad`` over 12 sequence lengths: the graph-count warning, graphs and their memory."""
    runner = GraphRunner(p.bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in LENGTHS:
            runner(torch.randn(1, n, 64, device="cuda"))
    warned = [first_line(w.message) for w in caught if "graphs captured" in str(w.message)]
    st = runner.stats
    return observed_row(None, message=f"{st.captures} graphs for {len(LENGTHS)} lengths, {st.memory_bytes / 2**20:.1f} "
                                      f"MiB in all; {'warned: ' + warned[0] if warned else 'no warning'}",
                        warned=bool(warned), captures=st.captures, memory_bytes=st.memory_bytes)
