"""How the real-use pitfalls are run and observed: the diagnose steps and fix checks of
:mod:`cgutils.pitfalls_real_use`, and the harnesses they share.

- threads: :func:`threads_check` calls a graphed callable from 8 threads x 50 calls, each thread on its own
  stream, with the GIL handed over often (``sys.setswitchinterval``), and counts wrong results;
- state: GraphRunner of a module against an eager twin (a deep copy) and against a manual graph;
- failed captures: :func:`raw_capture` records what a failed ``torch.cuda.graph`` leaves behind (current
  stream, RNG), then puts it right so that the next entry starts clean;
- other threads: a background thread (the entry's ``bad``) runs through a whole capture;
- syncs outside PyTorch: :func:`cuda_runtime` finds the CUDA runtime to call ``cudaDeviceSynchronize``
  through, as an extension would (cuda-python, else ``ctypes`` on the loaded ``libcudart.so``).

Sources: the CUDA Programming Guide, "Stream capture" (capture modes, cross-stream dependencies), and the
CUDA Runtime API, ``cudaStreamBeginCapture`` and ``cudaThreadExchangeStreamCaptureMode``.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .capture import GraphRunner, capture_graph, max_rel_error
from .checks import first_line
from .errors import CgutilsError
from .pitfall_cases import Pitfall, example, observed_row, raw_failure, through_runner

THREADS, CALLS = 8, 50  # threads_check: 8 threads x 50 calls each
STEPS = 5  # stateful_check: calls compared with as many eager calls
LENGTHS = tuple(range(16, 16 * 13, 16))  # many_shapes_check: 12 sequence lengths


# --- threads --------------------------------------------------------------------------------------------



def run_in_threads(worker: Callable[[int], Any], n: int = 8) -> None:
    """Run ``worker(t)`` for t in 0..n-1 on n threads at once and wait for all of them, handing the GIL
    over as often as the interpreter allows (as a busy server does), so that calls interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)

def _hammer(graphed: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, int]:
    """Call ``graphed`` from THREADS threads, CALLS times each, each thread on its own stream.

    Returns:
        ``(wrong, errors)``: results that differ from 2 * input, and calls that raised.
    """
    counts = {"wrong": 0, "errors": 0}
    lock = threading.Lock()

    def worker(tid: int) -> None:
        stream = torch.cuda.Stream()
        wrong = errors = 0
        with torch.cuda.stream(stream):
            for i in range(CALLS):
                try:
                    x = torch.full((4, 8), float(tid * 1000 + i), device="cuda")
                    y = graphed(x)
                    stream.synchronize()  # the result as the caller reads it
                    wrong += not torch.equal(y, x * 2)
                except Exception:  # counted: a thread's failure must not pass for a right answer
                    errors += 1
        with lock:
            counts["wrong"] += wrong
            counts["errors"] += errors

    run_in_threads(worker, THREADS)
    torch.cuda.synchronize()
    return counts["wrong"], counts["errors"]


def threads_check(p: Pitfall, x: torch.Tensor) -> dict:
    """The graphed callable ``bad(x)`` (a manual graph) and ``good(x)`` (a shared GraphRunner), each called from
    8 threads x 50 calls: wrong results (``wrong``, ``runner_wrong``) and calls that raised."""
    wrong, errors = _hammer(p.bad(x))
    runner_wrong, runner_errors = _hammer(p.good(x))
    n = THREADS * CALLS
    return observed_row(None, message="no error", wrong=wrong, runner_wrong=runner_wrong, calls=n,
                        thread_errors=errors, runner_thread_errors=runner_errors,
                        happens=f"no error; {wrong} of {n} results wrong ({THREADS} threads, one manual graph, no "
                                f"lock); GraphRunner shared by the threads: {runner_wrong} wrong")


def threads_fix_ok(p: Pitfall, x: torch.Tensor) -> bool:
    """``good(x)`` (a shared GraphRunner) called from 8 threads x 50 calls: no wrong result, no error."""
    return _hammer(p.good(x)) == (0, 0)


# --- state ------------------------------------------------------------------------------------------


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


# --- failed captures, other threads, syncs outside PyTorch ------------------------------------------


def _rng_works() -> bool:
    try:
        torch.rand(4, device="cuda")
        torch.cuda.synchronize()
    except RuntimeError:
        return False
    return True


def raw_capture(fn: Callable[[], Any], **graph_kwargs: Any) -> dict:
    """Capture ``fn`` with ``torch.cuda.graph(g, **graph_kwargs)`` (no warm-up of its own) and record what a
    failure leaves, then put it right (the capture ended, the caller's stream and RNG back).

    Returns:
        ``raw_exception`` (class name, "" if none), ``raw_message``, ``raw_cause`` (:func:`cgutils.explain`'s
        key), ``raw_stream_restored`` (the current stream is the caller's again after ``torch.cuda.graph``
        exits) and, after a failure, ``raw_rng_ok`` (a random op works before the RNG is reset).
    """
    before = torch.cuda.current_stream()
    g = torch.cuda.CUDAGraph()
    ctx = torch.cuda.graph(g, **graph_kwargs)
    try:
        with ctx:
            fn()
    except Exception as exc:
        restored = torch.cuda.current_stream() == before
        with torch.cuda.stream(ctx.capture_stream):  # end it if the error came before capture_end
            if torch.cuda.is_current_stream_capturing():
                try:
                    g.capture_end()
                except RuntimeError:
                    pass
        torch.cuda.set_stream(before)
        rng_ok = _rng_works()
        row = raw_failure(exc)  # resets the RNG
        return {"raw_exception": row["exception"], "raw_message": row["message"], "raw_cause": row["cause"],
                "raw_stream_restored": restored, "raw_rng_ok": rng_ok}
    return {"raw_exception": "", "raw_message": "no error", "raw_cause": "",
            "raw_stream_restored": torch.cuda.current_stream() == before}


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
    rng_ok = _rng_works()
    stream = "is the caller's again" if raw["raw_stream_restored"] else "is still torch.cuda.graph's capture stream"
    rng = "" if "raw_rng_ok" not in raw else "; random ops work" if raw["raw_rng_ok"] else "; random ops fail"
    return observed_row(exc, **raw, runner_stream_restored=restored, rng_ok=rng_ok,
                        happens=f"torch.cuda.graph raises {raw['raw_exception'] or 'nothing'}; afterwards the current "
                                f"stream {stream}{rng}; after GraphRunner's CaptureError the stream "
                                f"{'is' if restored else 'is not'} the caller's and random ops "
                                f"{'work' if rng_ok else 'fail'}")


def _many_kernels(x):
    for _ in range(200):  # ~200 small kernels: a capture long enough to overlap the other thread
        x = x * 1.001
    return x


def _with_background(p: Pitfall, run: Callable[[], Any], numel: int) -> tuple[Any, dict]:
    """Run ``run()`` while the thread ``bad(stop, counts, numel)`` works: started first, running through the
    whole call. Each call gets its own ``numel`` so that cached pinned blocks of an earlier call are not reused."""
    stop, counts = threading.Event(), {"errors": 0, "iterations": 0}
    t = threading.Thread(target=p.bad, args=(stop, counts, numel), daemon=True)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    t.start()
    try:
        while counts["iterations"] == 0 and t.is_alive():
            pass  # spin until the thread has done one iteration
        return run(), counts
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)


def other_thread_check(p: Pitfall, x: torch.Tensor) -> dict:
    """A function of ~200 kernels captured while ``bad`` runs in another thread: raw in the global capture
    mode, then through GraphRunner (thread-local mode)."""
    _many_kernels(x)  # load the kernel once, eagerly, so the raw capture fails only for the other thread
    torch.cuda.synchronize()
    raw, raw_counts = _with_background(p, lambda: raw_capture(lambda: _many_kernels(x), capture_error_mode="global"),
                                       numel=4096)

    def through_runner():
        try:
            GraphRunner(_many_kernels)(x)
        except CgutilsError as exc:
            return exc
        return None

    exc, counts = _with_background(p, through_runner, numel=8192)
    row = observed_row(exc, **raw, background_iterations=counts["iterations"], background_errors=counts["errors"],
                       raw_background_iterations=raw_counts["iterations"], raw_background_errors=raw_counts["errors"],
                       raw_background_error=raw_counts.get("error", ""), background_error=counts.get("error", ""))
    if exc is None:
        row["message"] = "no error"
    row["happens"] = (f"global capture mode: {raw['raw_exception'] or 'no error'} ({raw['raw_message'][:120]}); "
                      f"the other thread: {raw_counts['errors']} failed calls in {raw_counts['iterations']} "
                      f"iterations; GraphRunner (thread-local mode): {type(exc).__name__ if exc else 'no error'}, the "
                      f"other thread: {counts['errors']} failed calls in {counts['iterations']} iterations")
    return row


@functools.cache
def cuda_runtime() -> tuple[str, Callable[[], tuple[str, str] | None]] | None:
    """The CUDA runtime's ``cudaDeviceSynchronize``, callable without PyTorch, as an extension would call it.

    Tried in order: cuda-python (``cuda.bindings.runtime``, cuda-bindings >= 12.8; ``cuda.cudart`` before),
    then ``ctypes`` on the ``libcudart.so`` that this process has loaded (found in ``/proc/self/maps``, so
    it is the runtime PyTorch uses). A candidate must succeed once outside capture to be taken.

    Returns:
        ``(where, sync)``: ``sync()`` returns ``None`` on success, else ``(error name, error text)``;
        ``None`` when no runtime could be called.
    """
    for load in (_cuda_python, _loaded_libcudart):
        try:
            found = load()
            if found is not None and found[1]() is None:
                return found
        except Exception:  # a binding that does not import or call on this machine: try the next
            continue
    return None


def _cuda_python():
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        from cuda import cudart as rt

    def sync():
        (err,) = rt.cudaDeviceSynchronize()
        if err == rt.cudaError_t.cudaSuccess:
            return None
        rt.cudaGetLastError()  # clear it, as C10_CUDA_CHECK does, or PyTorch's next launch check reports it
        return rt.cudaGetErrorName(err)[1].decode(), rt.cudaGetErrorString(err)[1].decode()

    return rt.__name__, sync


def _loaded_libcudart():
    with open("/proc/self/maps") as maps:
        paths = {parts[5].strip() for parts in (line.split(maxsplit=5) for line in maps) if len(parts) == 6}
    path = next((p for p in sorted(paths) if "libcudart.so" in p.rsplit("/", 1)[-1]), None)
    if path is None:
        return None
    lib = ctypes.CDLL(path)  # the loaded library: dlopen returns the same handle
    lib.cudaDeviceSynchronize.restype = lib.cudaGetLastError.restype = ctypes.c_int
    for name in ("cudaGetErrorName", "cudaGetErrorString"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_char_p, [ctypes.c_int]

    def sync():
        err = lib.cudaDeviceSynchronize()
        if err == 0:
            return None
        lib.cudaGetLastError()  # clear it, as C10_CUDA_CHECK does, or PyTorch's next launch check reports it
        return lib.cudaGetErrorName(err).decode(), lib.cudaGetErrorString(err).decode()

    return path, sync


_runtime_errors: list[str] = []  # error names the extension's sync got, newest last


def extension_sync() -> None:
    """What a C++/CUDA extension does: cudaDeviceSynchronize through the runtime, checked like C10_CUDA_CHECK."""
    runtime = cuda_runtime()
    if runtime is None:
        raise RuntimeError("no CUDA runtime found to call cudaDeviceSynchronize through")
    err = runtime[1]()
    if err is not None:
        _runtime_errors.append(err[0])
        raise RuntimeError(f"CUDA error: {err[1]} ({err[0]})")


def external_sync_check(p: Pitfall, x: torch.Tensor) -> dict:
    """``bad`` through GraphRunner, where the sync comes from a CUDA runtime call made outside PyTorch."""
    runtime = cuda_runtime()
    if runtime is None:
        return observed_row(None, available=False, message="not run: neither cuda-python nor a loaded libcudart.so "
                                                            "was found to call cudaDeviceSynchronize through")
    _runtime_errors.clear()
    row = through_runner(p, x)
    err = _runtime_errors[-1] if _runtime_errors else ""
    return {**row, "available": True, "runtime": runtime[0], "runtime_error": err,
            "happens": f"cudaDeviceSynchronize (through {runtime[0].rsplit('/', 1)[-1]}) returns {err or 'success'} "
                       f"during capture; PyTorch never sees the call"}


# --- sampling, many shapes ---------------------------------------------------------------------------


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
