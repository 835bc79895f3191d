"""Low-level capture: warm-up on a side stream, capture into a memory pool, autocast and RNG hygiene,
pool accounting, and :class:`CudaBackend`, the few CUDA calls GraphRunner makes (which the CPU
simulation in the tests replaces as a whole)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..checks import check_int, first_line, require_cuda
from ..diagnose import explain, failure_site, find_sync_points
from ..errors import CaptureError, first_cgutils_error
from .breakplan import BreakPlan
from .ending import end_abandoned_capture
from .piecewise import capture_pieces
from .poolscope import capture_pool, fresh_cublas_workspaces
from .state import rng_restore, rng_snapshot


def pool_reserved_bytes(pool: Any) -> int:
    """Bytes the caching allocator has reserved (cudaMalloc'd segments) for one graph memory pool.

    Read from ``torch.cuda.memory_snapshot()``: the segments whose ``segment_pool_id`` is ``pool``.
    This counts the pool alone, unlike ``torch.cuda.memory_reserved()``, which also moves when the
    default pool grows or when segments of released graph pools are returned.
    """
    key = tuple(pool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id") or ()) == key)


def reset_rng_after_failed_capture() -> None:
    """Return PyTorch's default CUDA generators to eager use after a capture that raised.

    When capture fails, PyTorch raises before its default CUDA generators leave capture mode, and every
    later random op then fails with "Offset increment outside graph capture". Installing a clone of
    each generator's state (seed and offset kept, capture flag cleared; CUDAGeneratorState::clone in
    ATen/cuda/CUDAGeneratorImpl.cpp) restores normal eager use; :func:`capture_graph` does this itself,
    then puts back the seed and offset from before capture. (Graphs captured earlier keep the replaced
    state object: their replays no longer follow ``torch.cuda.manual_seed``.)
    """
    for i in range(torch.cuda.device_count()):
        gen = torch.cuda.default_generators[i]
        if hasattr(gen, "graphsafe_set_state") and hasattr(gen, "clone_state"):
            try:
                gen.graphsafe_set_state(gen.clone_state())
            except RuntimeError:
                pass


def autocast_state() -> tuple:
    """CUDA autocast as it is now: ``(False,)``, or ``(True, dtype)``. Kernels captured under autocast
    keep the dtypes it chose, so a call under another autocast state needs a graph of its own (else
    an fp32 call would silently get fp16 results, or the other way round)."""
    if torch.is_autocast_enabled("cuda"):
        return True, torch.get_autocast_dtype("cuda")
    return (False,)


def autocast_without_cache() -> contextlib.AbstractContextManager:
    """CUDA autocast as the caller set it, with its cast cache off (a no-op outside autocast).

    Autocast caches the low-precision copy of each parameter until the outermost autocast context
    exits. A graph captured while that cache is on reads the cached copy, not a cast of its own, and
    replays after the context exits read freed memory. ``torch.cuda.make_graphed_callables`` refuses
    ``cache_enabled=True`` for the same reason (torch/cuda/graphs.py)."""
    if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    return contextlib.nullcontext()


_WARMUP_STREAMS: dict[int, torch.cuda.Stream] = {}


def _warmup_stream() -> torch.cuda.Stream:
    # One side stream per device for every warm-up: the caching allocator keeps freed blocks per
    # stream, so a new stream per capture left each warm-up's activations reserved for a stream that
    # was never used again (bench.memory_table at commit 6b4da10 on the H200: reserved memory grew by
    # about 33 MiB per BERT-base capture while the shared graph pool stayed at 27 MiB).
    dev = torch.cuda.current_device()
    if dev not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[dev] = torch.cuda.Stream()
    return _WARMUP_STREAMS[dev]


class _Ending:
    """``torch.cuda.graph`` that remembers whether its exit's ``capture_end`` succeeded (it runs even when the
    captured code raised; after a failure the pool's reference is then the caller's to drop)."""

    def __init__(self, graph_ctx: Any):
        self.graph, self.ended = graph_ctx, False

    def __enter__(self) -> Any:
        return self.graph.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        out = self.graph.__exit__(*exc)
        self.ended = True
        return out


# CUDA error codes that name their own cause: evidence from the eager rerun adds lines to them, never a cause
# codes that name their own cause: the eager rerun adds lines to them, never another cause
_SPECIFIC = {"unjoined", "unforked_stream", "default_stream", "allocation", "rng", "capture_merge", "captured_event",
             "wrong_thread", "unmatched"}


def capture_failure(exc: Exception, fn: Callable[[], Any], what: str) -> CaptureError:
    """Build the CaptureError for a failed capture: the original error, its explanation, and the syncs
    found by running ``fn`` once more eagerly (which is safe now that capture has ended).

    The cause: a specific CUDA error (``unjoined``, ``unforked_stream``, ``default_stream``, ``allocation``,
    ``rng``) names it, and the rerun adds the line behind it; a generic one (a refused call, an invalidated
    capture, a text no rule knows) is refined by the rerun: a sync in this thread, another thread's sync, an
    unforked side stream, or none of these (a sync outside PyTorch)."""
    why = explain(exc)
    syncs, note = None, ""
    try:
        syncs = find_sync_points(fn)
    except Exception as rerun:  # the eager rerun can fail for its own reasons; never hide the original
        note = f"\n(Could not rerun it eagerly to look for syncs: {type(rerun).__name__}: {rerun})"
    key = why.key if why else ""
    if syncs is None:
        cause = key
    elif key in _SPECIFIC:
        cause, note = key, _stream_evidence(key, syncs) + (_sync_note(syncs, failure_site(exc)) if len(syncs) else "")
    else:
        cause, note = _refined(key, syncs, failure_site(exc))
    return CaptureError(
        f"CUDA graph capture of {what} failed: {type(exc).__name__}: {first_line(exc)}\n"
        + (str(why) if why and cause not in ("external_sync", "other_thread") else "" if why else
           "No known pattern matched the error text.")
        + note, original=exc, explanation=str(why or ""), sync_points=syncs, cause=cause)


def _stream_evidence(key: str, syncs: Any) -> str:
    """The line behind a stream error, from the eager rerun's forks and joins."""
    if key == "unjoined" and syncs.attrs.get("unjoined_forks"):
        p = syncs.attrs["unjoined_forks"][0]
        return (f"\nThe side stream forked at {p.file}:{p.line}: {p.code} was never joined back: after its last "
                f"launch add torch.cuda.current_stream().wait_stream(side).")
    if key == "unforked_stream" and syncs.attrs.get("unforked_joins"):
        p = syncs.attrs["unforked_joins"][0]
        return (f"\nThe join at {p.file}:{p.line}: {p.code} waits on a side stream that never waited on the capture "
                f"stream first: fork it with side.wait_stream(torch.cuda.current_stream()) before launching on it.")
    return ""


def _sync_note(syncs: Any, site: Any) -> str:
    """The syncs the rerun found, one line per distinct (op, file, line), the failing one marked."""
    def failed_here(r: Any) -> bool:
        return site is not None and (r.file, r.line) == (site.file, site.line)

    # a loop's test syncs once per iteration, and each of those lines was marked as the failing one
    counts: dict[tuple, int] = {}
    rows: dict[tuple, Any] = {}
    for r in syncs.itertuples():
        key = (r.op, r.file, r.line)
        counts[key] = counts.get(key, 0) + 1
        rows.setdefault(key, r)
    distinct = list(rows.values())
    where = "\n".join(f"  {r.op} at {r.file}:{r.line}: {r.code}"
                      + (f" (x{counts[(r.op, r.file, r.line)]})" if counts[(r.op, r.file, r.line)] > 1 else "")
                      + (f", from {r.caller}" if getattr(r, "caller", "") else "")
                      + ("   <- capture failed here" if failed_here(r) else "") for r in distinct[:5])
    more = f"\n  ... and {len(distinct) - 5} more (see .sync_points)" if len(distinct) > 5 else ""
    hit = any(failed_here(r) for r in distinct)
    others = ("\nThe unmarked syncs ran in the eager rerun; code may sync only when not capturing (transformers "
              "skips its attention-mask check while capturing), so fix the marked line first."
              if hit and len(distinct) > 1 else "")
    return f"\nCPU-GPU syncs in your code (each one breaks capture):\n{where}{more}{others}"


def _refined(key: str, syncs: Any, site: Any) -> tuple[str, str]:
    """Cause and note for a generic capture error, from what the eager rerun saw."""
    if len(syncs):
        return "sync", _sync_note(syncs, site)
    others = syncs.attrs.get("other_threads", [])
    if others:
        name, p = others[0]
        return "other_thread", (
            f"\nYour function made no sync, but thread {name!r} synchronised the device meanwhile ({p.op} at "
            f"{p.file}:{p.line}: {p.code}; {len(others)} syncs from other threads during an eager rerun). A "
            f"device-wide sync from any thread breaks a capture in progress, whatever the capture mode: pause "
            f"that thread while capturing, or have it wait on its own stream (stream.synchronize()).")
    if syncs.attrs.get("unforked_joins"):
        p = syncs.attrs["unforked_joins"][0]
        return "unforked_stream", (
            f"\nAn eager rerun found no sync, but a join of a side stream that never waited on the capture "
            f"stream first, at {p.file}:{p.line}: {p.code}. Inside capture that side stream's work is not part "
            f"of the graph, so CUDA refuses the join and invalidates the capture. Fork before using the side "
            f"stream: side.wait_stream(torch.cuda.current_stream()), then launch on it, then join back.")
    if key in ("sync", "invalidated"):
        # CUDA refused a call during capture, yet nothing in PyTorch synchronised: the call came from
        # code that PyTorch does not see (an extension or library calling the CUDA runtime itself).
        return "external_sync", (
            "\nAn eager rerun found no sync made through PyTorch in this thread (and no unforked side "
            "stream), so the refused call most likely comes from outside PyTorch: a C++/CUDA extension or "
            "library calling cudaStreamSynchronize, cudaDeviceSynchronize, a blocking cudaMemcpy or "
            "cudaMalloc; or another thread synchronising the whole device through such a library. Find it "
            "with `nsys profile -t cuda` around one eager call, then move that call out of the graphed "
            "function or make it asynchronous.")
    return key, "\nAn eager rerun found no CPU-GPU sync, so the cause is not a sync."


def capture_graph(fn: Callable[[], Any], *, warmup: int = 3, pool: Any = None,
                  on_last_warmup: Callable[[Any], None] | None = None,
                  on_warmup: Callable[[int, Any], None] | None = None,
                  what: str = "function", debug: bool = False, inspect: Any = None,
                  breaks: BreakPlan | None = None) -> tuple[Any, Any]:
    """Warm ``fn`` up on a side stream, then capture one call of it into a CUDA graph.

    Args:
        fn: a callable with no arguments that only touches tensors at fixed addresses.
        warmup: eager calls before capture (>= 1), on a side stream.
        pool: memory-pool handle to capture into (``torch.cuda.graph_pool_handle()``); ``None`` for a
            private one.
        on_last_warmup: called with the output of the last warm-up call (e.g. to keep a reference).
        on_warmup: called as ``on_warmup(i, output)`` after warm-up call ``i`` (0-based), on the side
            stream (e.g. to snapshot or restore state the call changed).
        what: name used in error messages.
        debug: make the graph with ``keep_graph=True`` and CUDA's debug mode on, so that
            ``graph.debug_dump(path)`` can write it as a Graphviz DOT file (see
            :func:`cgutils.capture.graph_node_types`); a default graph writes no dump on torch 2.11
            (notebook 07 shows the kept one's).
        inspect: a :class:`~cgutils.capture.inspect.NodeAttribution` to watch the capture with; the graph
            is then made with ``keep_graph=True`` so that :func:`~cgutils.capture.inspect.node_table` can
            read its nodes (host memory for the kept graph; no effect on replay).
        breaks: a :class:`~cgutils.capture.piecewise.BreakPlan`: capture in pieces around its modules,
            which run eagerly between them (:mod:`~cgutils.capture.piecewise`); ``"auto"`` finds them
            while capturing, the first warm-up call finds the instances of named classes.

    Returns:
        ``(graph, static_output)``: the output tensors live in the pool and are rewritten by each
        ``graph.replay()``. With ``breaks``, ``graph`` is a :class:`~cgutils.capture.piecewise.PiecewiseGraph`.

    Capture runs in CUDA's thread-local capture mode (``cudaStreamCaptureModeThreadLocal``): CUDA calls
    that other threads make meanwhile (a data loader copying pinned batches, a library allocating) do
    not invalidate it, while an illegal call in this thread still fails it. Under
    ``torch.autocast("cuda")``, warm-up and capture run with autocast's cast cache off, so the graph
    casts the weights itself instead of reading cached copies that die with the context.

    If capture fails, the caller's current stream and the default CUDA generators' states are put back
    as they were before capture, and the abandoned capture is ended, so eager work goes on as before.

    Raises:
        InputError: ``warmup`` is not an int >= 1.
        NoCudaError: no CUDA device is visible.
        CaptureError: capture failed; ``.original`` holds the error, ``.explanation`` cause and fix.
    """
    check_int("warmup", warmup, minimum=1, why="lazy initialisation must not be captured")
    require_cuda("capture_graph", "call the function eagerly instead")
    side = _warmup_stream()
    side.wait_stream(torch.cuda.current_stream())
    with autocast_without_cache():
        with torch.cuda.stream(side), torch.no_grad():
            for i in range(warmup):
                with breaks.watching() if breaks is not None and i == 0 else contextlib.nullcontext():
                    out = fn()
                if on_warmup is not None:
                    on_warmup(i, out)
            if on_last_warmup is not None:
                on_last_warmup(out)
            del out
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        stream, rng = torch.cuda.current_stream(), rng_snapshot()
        # a pool handle of our own when none is given (what torch does itself), so that a failed capture's
        # recording into it can be ended (end_abandoned_capture)
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        watch = inspect if inspect is not None else contextlib.nullcontext()
        fresh_cublas_workspaces()
        try:
            if breaks is not None:
                graph, static_out = capture_pieces(
                    fn, breaks, pool, side, keep_graph=inspect is not None, watch=inspect,
                    reset=lambda: (reset_rng_after_failed_capture(), rng_restore(rng)))
            else:
                keep = inspect is not None or debug
                graph = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
                if debug:
                    graph.enable_debug_mode()
                ctx = _Ending(torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"))
                try:
                    # capture_pool: while_node/if_node called by fn route their bodies' allocations to pool
                    with watch, ctx, torch.no_grad(), capture_pool(pool):
                        static_out = fn()
                except Exception:
                    # torch.cuda.graph's __exit__ calls capture_end before leaving its stream context, so an
                    # error there left the caller on the capture stream (torch 2.11 and 2.14 alike).
                    end_abandoned_capture(graph, ctx.graph.capture_stream, pool, capture_ended=ctx.ended)
                    raise
                if keep:
                    graph.instantiate()  # kept graphs instantiate lazily: not on the first replay's clock
        except Exception as exc:
            torch.cuda.set_stream(stream)
            reset_rng_after_failed_capture()
            rng_restore(rng)
            ours = first_cgutils_error(exc)
            if ours is not None:
                raise ours from None
            raise capture_failure(exc, fn, what) from exc
        finally:
            fresh_cublas_workspaces()  # what this capture made stays in its pool, reused by no later capture
    torch.cuda.synchronize()
    return graph, static_out


class CudaBackend:
    """The CUDA calls that GraphRunner and GreedyDecoder make: capture (warm-up included), a new memory
    pool, pool accounting, and a device sync. Replay is ``graph.replay()`` on what :meth:`capture`
    returned.

    The tests swap this object as a whole for a CPU simulation with static-buffer semantics, so that
    everything around these calls (binding, checks, buckets, validation) runs without a GPU.

    Attributes:
        device_type: the device type that input tensors must be on.
    """

    device_type = "cuda"

    def available(self) -> bool:
        return torch.cuda.is_available()

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def pool_bytes(self, pool: Any) -> int:
        return pool_reserved_bytes(pool)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def follow(self, last: Any) -> Any:
        """Order the current stream after ``last`` (the stream of the previous call) when the two differ,
        and return the current stream. A call's copy-in must not overtake the previous call's replay and
        copy-out, which another thread may have queued on another stream."""
        current = torch.cuda.current_stream()
        if last is not None and current != last:
            current.wait_stream(last)
        return current

    def capture(self, fn: Callable[[], Any], **kwargs: Any) -> tuple[Any, Any]:
        """:func:`capture_graph` with the same keyword arguments."""
        return capture_graph(fn, **kwargs)


CUDA = CudaBackend()
