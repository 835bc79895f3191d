"""The diagnose steps of entries whose trouble comes from outside the capturing call: several threads calling
one graph, another thread's CUDA work during capture, and a sync made through the CUDA runtime behind
PyTorch's back (as a C++/CUDA extension makes it).

- threads: :func:`threads_check` calls a graphed callable from 8 threads x 50 calls, each thread on its own
  stream, with the GIL handed over often (``sys.setswitchinterval``), and counts wrong results;
- other threads: a background thread (the entry's ``bad``) runs through a whole capture;
- syncs outside PyTorch: :func:`cuda_runtime` finds the CUDA runtime to call ``cudaDeviceSynchronize``
  through (cuda-python, else ``ctypes`` on the loaded ``libcudart.so``).

Where threads race, counts differ from run to run: an entry's ``expect`` holds only what must hold on every
run. Sources: the CUDA Programming Guide, "Stream capture" (capture modes, cross-stream dependencies).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..capture import GraphRunner
from ..errors import CgutilsError
from .entry import Pitfall, observed_row, raw_capture
from .steps import through_runner

THREADS, CALLS = 8, 50  # threads_check: 8 threads x 50 calls each


# --- threads: one graph, several callers ---------------------------------------------------------------


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


# --- another thread's CUDA work during capture ----------------------------------------------------------


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


# --- syncs outside PyTorch -------------------------------------------------------------------------------


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
