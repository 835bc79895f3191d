"""Piecewise capture: graph what can be graphed, run the modules that cannot be captured eagerly between.

A single ``.item()``, data-dependent shape or syncing library call anywhere in a forward makes the whole capture fail.
vLLM and SGLang split their models at such points by hand (attention outside the graph, "piecewise" graphs);
``torch.compile`` splits at graph breaks. Here the split is at module calls, so it works on any ``nn.Module`` without
a compiler:

- **Which modules break** (:class:`BreakPlan`): the modules the caller names, or (``"auto"``) the innermost module
  running when capture failed on a call a graph cannot hold (a sync): that module becomes a break and capture starts
  again, until it succeeds. Found while capturing, not eagerly: code that syncs only when not capturing (transformers
  skips its attention-mask check while ``torch.cuda.is_current_stream_capturing()``) breaks nothing.
- **Capture** (:class:`PieceCapture`): capture runs from the start of the function up to the first call of a break
  module; that capture ends, the module runs eagerly, its outputs are copied into static buffers that the next piece
  reads, and capture starts again; and so on to the end. All pieces capture into one memory pool, in order, so later
  pieces reuse blocks freed by earlier ones (safe because the pieces always replay in the same order: PyTorch docs,
  "Graph memory management").
- **Replay** (:class:`PiecewiseGraph.replay`): piece, break, piece, ... A break calls its module on the same argument
  tensors it was captured with (the previous piece rewrites them in place) and copies the result into its static
  buffers. A break whose output no longer fits its static buffers raises ``CaptureError(cause="break_shape")`` at that
  point of the replay: the pieces before it have run, so a function with state (a KV cache, a counter) has moved part
  of a step and should be reset by the caller.

During capture, each piece is replayed as soon as it is captured, so that the break after it runs eagerly on real
values (nothing executes while a stream captures; a break that looks at its inputs, as a sync does, would otherwise
see garbage).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from ..checks import check_int
from ..diagnose import explain, failure_site
from ..errors import CaptureError, InputError
from .breakplan import BreakPlan, MethodHook, require_method, submodule_method
from .control import inside_body
from .ending import end_abandoned_capture, end_failed_begin
from .inspect import NODE_COLUMNS, node_table
from .marks import MarkedRuns, StepMarks, marking
from .nest import same_value, tree_leaves, tree_map
from .poolscope import capture_pool, fresh_cublas_workspaces


@dataclass
class Break:
    """One eager call between two graph pieces.

    Attributes:
        name: the module's qualified name (or class name), with ``.method`` for a method break.
        why: why it runs eagerly: ``"named"`` or the sync found there (``"sync: Tensor.item at f.py:12"``).
        module: the module called.
        args, kwargs: its arguments as captured; tensors among them are rewritten by the previous piece.
        static_output: its outputs at capture; each replay copies the new outputs into these tensors.
        method: ``""`` (the module is called: its forward) or the name of the module's method called.

    Raises:
        InputError: ``module`` has no callable ``method`` (the message lists close names).
    """

    name: str
    why: str
    module: nn.Module
    args: tuple
    kwargs: dict
    static_output: Any
    method: str = ""

    def __post_init__(self) -> None:
        if self.method:  # now, not as an AttributeError in the middle of a replay
            require_method(self.module, self.method, f"Break {self.name!r}")

    @torch.no_grad()
    def run(self) -> None:
        """Call the module eagerly and copy its outputs into the static buffers the next piece reads.

        Raises:
            CaptureError: an output changed shape, dtype or structure since capture (``cause="break_shape"``):
                the next piece reads buffers of the captured shape.
        """
        call = getattr(self.module, self.method) if self.method else self.module
        out = call(*self.args, **self.kwargs)
        new, old = tree_leaves(out, objects=True), tree_leaves(self.static_output, objects=True)
        if len(new) != len(old):
            raise CaptureError(f"eager module {self.name} returned {len(new)} values, at capture {len(old)}; the "
                               f"next graph piece reads the captured ones", cause="break_shape")
        for (path, a), (_, b) in zip(new, old, strict=True):
            if isinstance(b, torch.Tensor):
                if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                    got = f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else type(a).__name__
                    raise CaptureError(
                        f"eager module {self.name} returned {path} as {got}, but it was captured as "
                        f"{tuple(b.shape)} {b.dtype}; the next graph piece reads a buffer of the captured shape. "
                        f"A break's outputs must keep their shape (pad a data-dependent length to a fixed "
                        f"size), or the break must move to where the shape no longer matters.",
                        cause="break_shape")
                b.copy_(a)
            elif not same_value(a, b):
                # a Python value (a flag, a count) that code after the break reads: the next piece was
                # captured for the old one and replays that branch whatever the new value says
                raise CaptureError(
                    f"eager module {self.name} returned {path} = {a!r}, but {b!r} at capture; the next graph piece "
                    f"was captured for {b!r} and would ignore the change. Return such values as CUDA tensors, or "
                    f"move the break to where the value is no longer used.", cause="break_shape")


@dataclass
class PiecewiseGraph:
    """A function captured as graph pieces with eager breaks between them; ``replay()`` runs them in order.

    Attributes:
        pieces: ``len(breaks) + 1`` graphs (``torch.cuda.CUDAGraph``); ``None`` for a piece that captured
            no work (a break at the very start or end, or two breaks in a row).
        breaks: the eager calls, :class:`Break`, in call order.
    """

    pieces: list[Any]
    breaks: list[Break] = field(default_factory=list)
    held: list[Any] = field(default_factory=list, repr=False)  # empty pieces' graphs: their pool references
    _runs: list[Any] | None = field(default=None, repr=False, compare=False)

    def _segments(self) -> list[Any]:
        """What a replay runs, in order: piece, break, piece, ... (an empty piece runs nothing)."""
        runs: list[Any] = []
        for i, graph in enumerate(self.pieces):
            runs.append(graph.replay if graph is not None else (lambda: None))
            if i < len(self.breaks):
                runs.append(self.breaks[i].run)
        return runs

    def replay(self) -> None:
        if self._runs is None:  # built once, after capture has filled pieces and breaks: replay is the hot path
            self._runs = self._segments()
        for run in self._runs:
            run()

    @contextlib.contextmanager
    def marked(self):
        """While in the block, each :meth:`replay` records a CUDA event and the host clock before each step
        (piece or break) and once after its last; yields the :class:`StepMarks` that collects them. Outside
        the block, replay runs as before (the marks cost an event record per step, a few µs of host time).

        Raises:
            InputError: on entry, when already marked.
        """
        if isinstance(self._runs, MarkedRuns):
            raise InputError("this graph's replays are already being marked; leave the other block first")
        steps = self.table()
        marks = StepMarks(list(steps.name), list(steps.kind))
        saved = self._runs
        runs = self._segments()
        self._runs = MarkedRuns([marking(marks, k, run) for k, run in enumerate(runs)]
                                 + [lambda: marks.mark(len(runs))])
        try:
            yield marks
        finally:
            self._runs = saved

    def table(self) -> pd.DataFrame:
        """The pieces and breaks in replay order: ``step``, ``kind`` (``graph`` / ``eager``), ``name``
        (``piece i`` or the module), ``why`` (for breaks)."""
        rows = []
        for i, graph in enumerate(self.pieces):
            rows.append({"kind": "graph", "name": f"piece {i}" + ("" if graph is not None else " (empty)"), "why": ""})
            if i < len(self.breaks):
                b = self.breaks[i]
                rows.append({"kind": "eager", "name": b.name, "why": b.why})
        return pd.DataFrame(rows).rename_axis("step").reset_index()

    def node_table(self, attribution: Any = None) -> pd.DataFrame:
        """The pieces' nodes one after another (:func:`~cgutils.capture.inspect.node_table` of each kept graph),
        numbered on from one piece to the next so that ``to_dot`` and filters see distinct nodes, with a
        ``piece`` column (the piece number; join with a trace one piece at a time)."""
        parts, offset = [], 0
        for i, g in enumerate(self.pieces):
            if g is not None:
                part = node_table(g, attribution)
                parts.append(part.assign(index=part["index"] + offset, piece=i,
                                         depends_on=part.depends_on.map(lambda d, o=offset: [x + o for x in d])))
                offset += len(part)
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[*NODE_COLUMNS, "piece"])

    def segment_times(self, iters: int = 20) -> pd.DataFrame:
        """Wall time of each piece replay and each eager break, µs (median over ``iters`` replays, with a
        device sync after each segment, so segments do not overlap as they do in a normal replay and sum
        to more than one).

        Each replay runs on the static inputs as they are: a function that updates state in place (a
        cache, a counter) moves it ``iters`` times, and outputs held without cloning are overwritten.

        Raises:
            InputError: ``iters`` is not an int >= 1.
            CaptureError: a break's output changed shape (as in :meth:`replay`).

        Returns:
            :meth:`table` with ``us`` (median) and ``p90_us``.
        """
        iters = check_int("iters", iters, minimum=1, why="replays to time")
        runs = self._segments()
        samples: list[list[float]] = [[] for _ in runs]
        torch.cuda.synchronize()
        for _ in range(iters):
            for k, run in enumerate(runs):
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                samples[k].append((time.perf_counter() - t0) * 1e6)
        out = self.table()
        out["us"] = [float(pd.Series(s).median()) for s in samples]
        out["p90_us"] = [float(pd.Series(s).quantile(0.9)) for s in samples]
        return out


_EMPTY = "The CUDA Graph is empty"  # PyTorch's warning at capture_end for a graph without nodes


class PieceCapture:
    """Capture one call of a function as :class:`PiecewiseGraph` (see the module docstring).

    Args:
        plan: the break modules.
        pool: the memory pool every piece captures into.
        stream: the side stream to capture on (not the default stream; the warm-up's side stream serves).
        keep_graph: make each piece with ``torch.cuda.CUDAGraph(keep_graph=True)`` (for node tables).

    Attributes:
        stack: with ``plan.auto``, the modules running (outermost first); after a failed capture, the
            modules that were running when it failed.
    """

    def __init__(self, plan: BreakPlan, pool: Any, stream: torch.cuda.Stream, keep_graph: bool = False):
        self.plan, self.pool, self.stream, self.keep_graph = plan, pool, stream, keep_graph
        self.result = PiecewiseGraph(pieces=[])
        self.current: torch.cuda.CUDAGraph | None = None
        self.depth = 0  # break-module calls open inside the current break
        self.pending: tuple[nn.Module, tuple, dict] | None = None
        self.stack: list[nn.Module] = []

    def run(self, fn: Any) -> Any:
        """Capture ``fn()``: returns its static outputs (rewritten by each replay). On error the caller
        ends the capture in progress with :meth:`abandon`."""
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()  # as torch.cuda.graph does: segments freed before capture go back first
        handles: list[Any] = []
        try:
            # inside the try, each handle kept as soon as made: a hook that fails (a method gone since the plan
            # was made) must not leave the ones before it on the modules
            for module in self.plan.modules():  # hooks on the break modules only: the rest runs at full speed
                handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
                handles.append(module.register_forward_hook(self._post, with_kwargs=True))
            for module, method in self.plan.methods():
                handles.append(MethodHook(module, method, functools.partial(self._wrap, module, method)))
            if self.plan.auto:
                # no always_call: after an error the stack still holds the modules that were running
                hooks = nn.modules.module
                handles.append(hooks.register_module_forward_pre_hook(self._push))
                handles.append(hooks.register_module_forward_hook(self._pop))
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream), torch.no_grad(), capture_pool(self.pool):
                self._begin()
                out = fn()
                self._end()
        finally:
            for h in handles:
                h.remove()
            # the caller's stream must not run ahead of work queued on the capture stream (the eager breaks and the
            # pieces replayed during capture). While a capture is still open (an error inside a piece) that wait
            # would itself be captured, and from the legacy stream it is an error that hid the model's own ("would
            # make the legacy stream depend on a capturing blocking stream", H200): abandon() waits after the end.
            if self.current is None:
                torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def abandon(self) -> None:
        """End a capture that an error interrupted, so the stream stops capturing and the allocator stops
        routing allocations to the pool (:func:`~cgutils.capture.ending.end_abandoned_capture`)."""
        if self.current is not None:
            end_abandoned_capture(self.current, self.stream, self.pool)
            self.current = None
            torch.cuda.current_stream().wait_stream(self.stream)

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.keep_graph else torch.cuda.CUDAGraph()
        try:
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        except BaseException:
            end_failed_begin(self.stream.device.index, self.pool)  # not abandon(): no capture to end, no release
            raise
        self.current = graph

    def _end(self) -> None:
        graph = self.current
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graph.capture_end()
        self.current = None
        empty = any(_EMPTY in str(w.message) for w in caught)
        for w in caught:
            if _EMPTY not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if empty:
            # kept, not dropped: the graph holds a reference to the shared pool, and the pieces still to be
            # captured join that pool; with no graph left in it, the next capture_begin asserts (use_count > 0,
            # CUDACachingAllocator.cpp) and the allocator's count is wrong for the rest of the process
            self.result.held.append(graph)
            self.result.pieces.append(None)
            return
        if self.keep_graph:
            graph.instantiate()
        self.result.pieces.append(graph)
        graph.replay()  # real values for the eager break that follows (nothing ran while capturing)

    def _push(self, module: nn.Module, *_: Any) -> None:
        self.stack.append(module)

    def _pop(self, module: nn.Module, *_: Any) -> None:
        # returns None: a forward hook's return value replaces the module's output
        if self.stack:
            self.stack.pop()

    def _wrap(self, module: nn.Module, method: str, call: Any) -> Any:
        """``call`` (a break method) made to end the piece before it and begin the next after it, like
        :meth:`_pre` and :meth:`_post` around a break module's forward."""

        @functools.wraps(call)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._pre(module, args, kwargs, method)
            out = call(*args, **kwargs)
            static = self._post(module, args, kwargs, out)
            return out if static is None else static

        return wrapper

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict, method: str = "") -> None:
        if self.depth:
            self.depth += 1
        elif self.current is not None:
            if inside_body():
                raise CaptureError(
                    f"{self.plan.name(module)} is a break but runs inside the body of a while_node/if_node, which "
                    f"is captured as one graph on the GPU: a break cannot split it. Move the break out of the "
                    f"body, or the conditional node out of the piecewise function", cause="sync")
            self._end()
            self.depth, self.pending = 1, (module, method, args, kwargs)

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if not self.depth:
            return None
        self.depth -= 1
        if self.depth:
            return None
        module0, method0, args0, kwargs0 = self.pending
        self.pending = None
        # static buffers for the next piece: made outside any capture, kept alive by the Break
        static = tree_map(lambda t: t.detach().clone(), out, objects=True)
        self.result.breaks.append(Break(self.plan.name(module0, method0), self.plan.why(module0, method0) or "",
                                        module0, args0, kwargs0, static, method0))
        self._begin()
        return static


# explain() keys of failures that mean "this call cannot be in a graph": a break can take it out
# Not "allocation" (out of memory): no module is to blame, and breaking would only hide it.
_BREAKABLE = {"sync", "invalidated", "host_copy"}
MAX_AUTO_BREAKS = 64


def capture_pieces(fn: Any, plan: BreakPlan, pool: Any, stream: torch.cuda.Stream, keep_graph: bool = False,
                   reset: Any = None, watch: Any = None) -> tuple[PiecewiseGraph, Any]:
    """Capture ``fn()`` in pieces around ``plan``'s modules into ``pool``; ``(graph, static_output)``.

    With ``plan.auto``, the breaks are found first, by captures into throw-away pools: a capture that fails
    on a call a graph cannot hold (:func:`cgutils.explain` says sync, invalidated capture, host copy or
    allocation) makes the innermost module running at the failure a break, and capture starts again
    (``reset()`` is called after each failed attempt to put the random generators back), up to
    :data:`MAX_AUTO_BREAKS` times. Then the pieces are captured once more, into ``pool``. (A failed capture
    leaves its pool unusable for later captures: :func:`~cgutils.capture.ending.end_abandoned_capture`.)
    ``watch`` (a :class:`~cgutils.capture.inspect.NodeAttribution`) watches that final capture only: the
    throw-away captures' node handles may be reused by the final graph's nodes.

    Raises:
        CaptureError: with ``auto``, the failure happened outside every submodule (in the top-level
            function), or in a module that already breaks (``cause="sync"``).
        Exception: whatever ``fn`` or the capture raised otherwise (the caller diagnoses it); the capture
            in progress is ended first.
    """
    if not torch.cuda.is_available():
        raise InputError("piecewise capture needs a CUDA device")
    if plan.auto:
        _find_breaks(fn, plan, stream, reset)
        # the throw-away captures made cuBLAS's workspace in their own pools, freed with them: kept cached, it
        # would be baked into the final pieces, which then replay into memory the allocator has returned (an
        # illegal memory access once another capture empties the cache: BERT-base, H200, notebook 09's
        # break-cost cell; the same fault as docs/pytorch-cublas-workspace-fault.md)
        fresh_cublas_workspaces()
    cap = PieceCapture(plan, pool, stream, keep_graph)
    try:
        with watch if watch is not None else contextlib.nullcontext():
            out = cap.run(fn)
        return cap.result, out
    except BaseException:
        cap.abandon()
        raise


def _find_breaks(fn: Any, plan: BreakPlan, stream: torch.cuda.Stream, reset: Any) -> None:
    for _attempt in range(MAX_AUTO_BREAKS + 1):
        fresh_cublas_workspaces()  # each attempt makes its own: an earlier attempt's pool is abandoned
        cap = PieceCapture(plan, torch.cuda.graph_pool_handle(), stream)
        try:
            cap.run(fn)
            return  # the pieces (and their throw-away pool) go with cap
        except BaseException as exc:
            why = explain(exc) if isinstance(exc, Exception) else None
            breakable = why is not None and why.key in _BREAKABLE
            cap.abandon()
            if not breakable:
                raise
            if reset is not None:
                reset()
            module = next((m for m in reversed(cap.stack) if m is not plan.root), None)
            site = failure_site(exc)
            where = f" at {site.file.rsplit('/', 1)[-1]}:{site.line}" if site is not None else ""
            method = submodule_method(exc, plan) if module is None else None
            if method is not None and plan.why(*method) is None:
                plan.add_method(*method, f"{why.key}{where}")  # the top-level forward called a submodule's method
                continue
            if module is None or plan.why(module) is not None:
                what = (f"{plan.name(*method)}, already a break" if method else "the top-level function's own code"
                        if module is None else f"{plan.name(module)}, already a break")
                raise CaptureError(
                    f"capture failed on a call a graph cannot hold{where}, in {what}; piecewise capture splits "
                    f"only at calls of submodules and of their methods. Move that step into a submodule (its own "
                    f"nn.Module), or name the calls to run eagerly with breaks=[...]. The error: "
                    f"{str(exc).splitlines()[0]}", original=exc, explanation=str(why), cause="sync") from exc
            plan._add(module, f"{why.key}{where}")
    raise CaptureError(f"breaks='auto' found more than {MAX_AUTO_BREAKS} modules to run eagerly; name them with "
                       f"breaks=[...] or call the model eagerly", cause="sync")
