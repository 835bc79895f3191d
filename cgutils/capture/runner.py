"""GraphRunner: capture a module or function into CUDA graphs once, replay it on every call.

How it works (CUDA Programming Guide, "CUDA Graphs"; PyTorch docs, "CUDA Graphs" in
torch.cuda semantics):

1. *Static input buffers.* A graph replays kernels with the device addresses they were captured
   with, so each tensor argument gets a buffer allocated once; every call copies (``copy_``) the
   caller's data into it. Rebinding a Python name to a new tensor would never reach the graph.
2. *Warm-up on a side stream* (:func:`~cgutils.capture.graph.capture_graph`): a few eager calls
   before capture trigger one-time work that must not be recorded (cuBLAS/cuDNN handles, autotuning,
   lazy module initialisation).
3. *Capture* into one memory pool shared by all graphs of this runner, so graphs for different input
   shapes reuse each other's freed blocks instead of each reserving its own. After a capture fails, later
   captures go to a new pool: torch 2.11 leaves the failed one refusing captures (:mod:`~cgutils.capture.ending`).
4. *Validation* (:mod:`~cgutils.capture.compare`): the first replay is compared with the last eager
   warm-up output; a relative error above tolerance raises :class:`~cgutils.errors.CaptureError`.
5. *Replay* on every later call with the same input signature (shapes and dtypes): copy in, one
   ``cudaGraphLaunch``, and clone the static outputs (unless ``clone_outputs=False``).

*Buckets* (``buckets={dim: sizes}``): every tensor argument with more than ``dim`` dimensions is padded
along ``dim`` up to the smallest size in ``sizes`` that holds it, so a few graphs serve every length. Outputs
are cut back to the caller's length along the dims that follow it: the first call that pads a dim of a graph's
inputs also runs ``fn`` eagerly once, at the caller's shapes, to see which output dims those are, and with
``validate`` to check that padding left that call's result alone (one sample: ``validate_replays`` checks
more calls; ``fn`` must also run at unpadded lengths; the call repeats after a failed check, or while two
padded dims share a length and bucket). A size above the largest bucket runs eagerly (counted in
``stats.fallbacks``, with one warning). Padding must not change the real positions' results: for attention
pass an attention mask, padded with 0 (the default). ``capture_buckets()`` captures every bucket at once,
largest first, so that the shared pool grows once, to the largest graph's needs, and the smaller graphs reuse
its blocks; the example is padded (or cut) to each size, so its values only serve warm-up and validation, and
when it is below a bucket it is replayed once, padded, to learn that graph's cuts (the others learn theirs on
their first padded call).

*Shapes and dtypes*: each distinct combination of (padded) input shapes and, with ``strict=False``, dtypes
gets its own graph, captured on first sight; so does each CUDA autocast state (``torch.autocast("cuda",
dtype=...)`` on or off), since captured kernels keep the dtypes autocast chose at capture. All graphs share one
memory pool.

*Breaks* (``breaks=``, :mod:`~cgutils.capture.piecewise`): modules that cannot be captured run eagerly between
graph pieces. ``"auto"`` finds them while capturing: the innermost module running where a capture failed on a
sync becomes a break, and capture starts again. A break module's outputs must keep their shape from call to
call. ``pieces()`` lists pieces and breaks, ``segment_times()`` what each costs, ``node_table()`` the nodes.

*Ranks* (``distributed=``): before each capture every rank compares its graph signature with the others'
(:class:`~cgutils.capture.ranks.CaptureRanks`: a rank with other shapes is named in a ``CaptureError`` on
every rank, instead of all of them hanging in the graph's collectives), and before the first one a small
all-reduce sets the communicator up. Every rank must call the runner. Ranks compare only when they capture:
a rank that replays an existing graph while another captures a new one is not checked (the capturing rank
then waits), so give all ranks the same shapes.

This module only coordinates: binding and input checks live in ``signature``, padding and output cuts
in ``buckets``, comparisons in ``compare``, the CUDA calls in ``graph``. Inference only: warm-up,
capture and replay run under ``torch.no_grad()``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..checks import check_int, is_number, require_cuda, warn_caller
from ..errors import CaptureError, InputError
from .breakplan import BreakPlan
from .buckets import Buckets, resize
from .compare import check_later_replay, rtol_for
from .cudadriver import cuda_driver
from .entry import GraphEntry, capture_entry, check_aliasing
from .graph import CUDA, CudaBackend, autocast_state
from .nest import same_value
from .ranks import CaptureRanks
from .signature import ArgSpec, Binder, Call, check_inputs
from .stats import RunnerStats
from .views import GraphViews
from .weights import WeightWatch, load_in_place, module_of

_MAX_PATTERNS = 64  # accepted call patterns remembered for the fast path (a bounded memo, not a record)
# CUDAGraph Trees warns past this many graphs for one function (torch._inductor.config.triton.
# cudagraph_dynamic_shape_warn_limit, 8 in torch 2.4-2.14)
GRAPH_COUNT_WARNING = 8


class GraphRunner(GraphViews):
    """Capture ``fn`` into a CUDA graph per input signature and replay it on later calls.

    Example::

        runner = cgutils.GraphRunner(model.eval().cuda(), buckets={1: (128, 256, 512)})
        out = runner(input_ids, attention_mask=mask)   # first call: warm-up, capture, validate
        out = runner(other_ids, attention_mask=mask)   # same bucket: copy in (padded), replay

    Args:
        fn: an ``nn.Module`` or a function of tensors (and fixed non-tensor values). Its tensor
            arguments may be nested in tuples, lists and dicts.
        warmup: eager calls on a side stream before each capture (>= 1).
        validate: compare the first replay with eager and raise on mismatch (cost: one replay and one output
            clone per capture, ``python -m cgutils bench memory``); with ``buckets``, also check the padding.
        validate_replays: also compare the first ``K`` replays of each graph (after capture, on the
            caller's fresh inputs) with an eager call; catches Python values baked in at capture that
            change later (module attributes, CPU scalars, Python branches). Each costs one eager call.
        rtol: tolerated relative error ``max|replay-eager| / max|eager|``; default 1e-3 for fp32,
            1e-2 when an fp16/bf16 tensor is involved.
        clone_outputs: return clones of the static outputs (safe). ``False`` returns the static output tensors
            themselves: no copy, but the **next replay overwrites them**, so read or clone them before the next call.
        strict: a changed dtype or rank of a tensor argument raises (default) instead of capturing
            another graph.
        pool: a memory-pool handle (``torch.cuda.graph_pool_handle()``) to share with other runners;
            default: one new pool shared by this runner's graphs (step 3 in this module's docstring).
        buckets: ``{dim: sizes}``: pad tensor arguments along ``dim`` up to the smallest size that holds
            them, and cut outputs back ("Buckets" in this module's docstring).
        pad_value: value written into padding: one number, or ``{argument name: number}`` (names as
            in error messages, e.g. ``input_ids``, ``attention_mask``); default 0.
        compile: capture ``torch.compile(fn)`` (Inductor, ``mode="default"``: fused kernels, no graphs of its own);
            ``True`` or a dict of ``torch.compile`` keyword arguments. Compilation happens in the first warm-up.
        inspect: keep each captured graph (``torch.cuda.CUDAGraph(keep_graph=True)``) and note which module
            and :class:`cgutils.nvtx_range` added each node, for :meth:`node_table` (needs cuda-python:
            ``pip install cuda-bindings``). Costs host memory for the kept graph, nothing at replay.
        breaks: modules run eagerly between graph pieces: ``"auto"``, or a list of qualified module names,
            module objects or module classes ("Breaks" in this module's docstring).
        distributed: this runner is one rank of a torch.distributed group whose ranks capture together
            (collectives inside the graph): ``True`` for the default group, or a process group ("Ranks" in
            this module's docstring).
        backend: the CUDA calls (capture, pool, sync): :class:`~cgutils.capture.CudaBackend`; the tests
            pass a CPU simulation.

    Raises (from the constructor): InputError for a bad option; DependencyError for ``inspect=True`` without cuda-python.

    Raises (from ``__call__``):
        InputError: CPU tensors, a changed argument structure, dtype, rank, device or non-tensor value.
        NoCudaError: no CUDA device is visible.
        CaptureError: capture failed (``.original``, ``.explanation``, and ``.sync_points``: the syncs
            an eager rerun found, with file and line), or a replay did not match eager above ``rtol``
            (``.max_rel_error``, ``.cause``).
    """

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 3, validate: bool = True,
                 validate_replays: int = 0, rtol: float | None = None, clone_outputs: bool = True,
                 strict: bool = True, pool: Any = None, buckets: dict[int, Any] | None = None,
                 pad_value: float | dict[str, float] = 0, compile: bool | dict = False,
                 inspect: bool = False, breaks: Any = None, distributed: Any = False,
                 backend: CudaBackend = CUDA):
        if not callable(fn):
            raise InputError(f"GraphRunner needs a callable (module or function), got {type(fn).__name__}")
        self.warmup = check_int("warmup", warmup, minimum=1, why="lazy initialisation must not be captured")
        self.validate_replays = check_int("validate_replays", validate_replays, why="replays to check against eager")
        if rtol is not None and not (is_number(rtol) and rtol >= 0):
            raise InputError(f"rtol must be a number >= 0 (a relative error), got {rtol!r}")
        self._buckets = Buckets(buckets, pad_value)
        self.buckets, self.pad_value = self._buckets.sizes, pad_value
        self._call = _compiled(fn, compile, breaks)
        self._breaks = BreakPlan(fn, breaks) if breaks is not None else None
        self._ranks = CaptureRanks(distributed)
        if inspect:
            cuda_driver()  # DependencyError now, naming the package, rather than inside the first capture
        self.fn, self.inspect = fn, bool(inspect)
        self.validate, self.rtol, self.clone_outputs, self.strict = validate, rtol, clone_outputs, strict
        self._pool, self._own_pool, self._backend, self._binder = pool, pool is None, backend, Binder(fn)
        self._weights = WeightWatch(module) if (module := module_of(fn)) is not None else None
        self._spec: list[ArgSpec] | None = None
        self._accepted: list[tuple] = []
        self._graphs: dict[tuple, GraphEntry] = {}
        self._replays = self._fallbacks = 0
        # One call at a time: copy-in, replay and copy-out share the static buffers, so a runner shared
        # by threads must not interleave them; calls from different streams are ordered by _stream.
        self._lock, self._stream = threading.RLock(), None
        _warn_if_training(fn)

    @property
    def stats(self) -> RunnerStats:
        """Captures, replays, eager fallbacks and per-graph memory (a snapshot, see :class:`RunnerStats`)."""
        infos = [dataclasses.replace(g.info) for g in self._graphs.values()]
        return RunnerStats(captures=len(infos), replays=self._replays, graphs=infos, fallbacks=self._fallbacks)

    def __repr__(self) -> str:
        name = type(self.fn).__name__ if isinstance(self.fn, nn.Module) else getattr(self.fn, "__name__", "fn")
        return f"GraphRunner({name}, graphs={len(self._graphs)}, replays={self._replays})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._checked(*args, **kwargs)

    def _checked(self, *args: Any, **kwargs: Any) -> Any:
        call = self._binder.bind(args, kwargs)
        # Replay is the hot path: a call whose argument kinds, dtypes, ranks, devices and values equal
        # an already accepted call skips the full check (it would pass) and its error formatting.
        pattern = call.pattern()
        specs = None
        if not any(same_value(pattern, seen) for seen in self._accepted):
            if not self._backend.available():  # first: "move it to cuda" cannot help on a machine without one
                require_cuda("GraphRunner", "call the model eagerly instead")
            specs = call.specs()
            check_inputs(specs, self._spec, strict=self.strict, device_type=self._backend.device_type)
            self._buckets.check_pad_names(call.named)
        self._stream = self._backend.follow(self._stream)
        out = self._run(call)
        if specs is not None:
            # Only now: a first call that failed (a wrong argument, an error in fn) must not become
            # the argument structure that every later call is checked against.
            self._spec = self._spec or specs
            self._accepted = [*self._accepted[-(_MAX_PATTERNS - 1):], pattern]
        return out

    def _run(self, call: Call) -> Any:
        """One checked call: pick (or capture) the graph, load, replay, cut back, validate, clone."""
        named = call.named
        self._buckets.check_lengths(named)
        targets = [self._buckets.target_shape(t) for _, t in named]
        if any(tg is None for tg in targets):
            return self._fallback(call)
        if self._graphs and self._weights is not None and (replaced := self._weights.replaced()):
            return self._recapture(call, replaced)
        key = _graph_key(named, targets)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(call, targets, key[-1])
        else:
            if entry.mutated_inputs:
                check_aliasing(named, entry.mutated_inputs, repr(self))
            entry.load(named, self._buckets)
        if entry.first_output is not None:  # a function with state: its first call was the first warm-up
            out, entry.first_output = self._output(entry, call, targets, entry.first_output), None
            entry.after_replay(named, self.clone_outputs, replayed=False)
            return out
        check = _ReplayCheck(entry, named, self.validate_replays)
        entry.graph.replay()
        entry.info.replays += 1
        self._replays += 1
        out = self._output(entry, call, targets, entry.static_output)
        entry.after_replay(named, self.clone_outputs)
        try:
            check(out, lambda: self._eager(call), rtol_for(out, self.rtol), f"replay {self._replays} of {self!r}")
        except CaptureError:
            del self._graphs[key]  # else a retry would replay the same stale graph unchecked
            raise
        return out

    def _recapture(self, call: Call, replaced: list[str]) -> Any:
        """Weights were replaced since capture: capture again for the new tensors, and say which and at what cost.
        The old graphs are held until then: a capture joining their pool needs a live graph in it."""
        old, self._graphs = self._graphs, {}
        start = time.perf_counter()
        out = self._run(call)
        _warn_replaced(self, replaced, len(old), time.perf_counter() - start)
        return out

    def load_state_dict(self, state_dict: Any, *, strict: bool = True) -> int:
        """Copy new weights into the tensors the graphs read (:func:`~cgutils.capture.weights.load_in_place`):
        the fast way to update a captured model, no capture again. Returns the tensors copied.
        InputError: ``fn`` is not a module (or its bound method), or the weights do not match."""
        if self._weights is None:
            raise InputError(f"{self!r} wraps a function, not a module, so it cannot tell which tensors to load into; "
                             f"call your_module.load_state_dict(sd) (without assign=True) instead")
        with self._lock:
            return load_in_place(self._weights.module, state_dict, strict=strict)

    def _eager(self, call: Call, entry: GraphEntry | None = None) -> Any:
        """``fn`` on the caller's arguments; for a function with state, undone afterwards (a check, not a call)."""
        undo = entry.undo(call.named) if entry is not None and entry.changes.stateful else None
        try:
            with torch.no_grad():
                return call.run(self._call)
        finally:
            if undo is not None:
                undo.restore()

    def _output(self, entry: GraphEntry, call: Call, targets: list, static: Any) -> Any:
        """The static outputs, cut back along the padded dims (:meth:`GraphEntry.output`) and cloned."""
        rtol = (lambda: rtol_for(static, self.rtol, {t.dtype for _, t in call.named})) if self.validate else None
        return entry.output(static, self._buckets.padded(call.named, targets), self.clone_outputs,
                            lambda: self._eager(call, entry), rtol)

    def _fallback(self, call: Call) -> Any:
        self._fallbacks += 1
        if self._fallbacks == 1:
            sizes = {n: tuple(t.shape) for n, t in call.named}
            warn_caller(f"{self!r}: input shapes {sizes} exceed the largest bucket {self.buckets}; running eagerly (no "
                        f"graph). Add a larger bucket if this size is common; stats.fallbacks counts these calls.")
        return self._eager(call)

    def capture_buckets(self, *args: Any, **kwargs: Any) -> RunnerStats:
        """Capture a graph for every bucket now, largest first, from one example call ("Buckets" in this
        module's docstring).

        Returns:
            :attr:`stats` after the captures.

        Raises:
            InputError: no ``buckets`` were given, or no tensor in the example; as for ``__call__``.
            CaptureError: as for ``__call__``; ``cause="padding"`` when padding changes the result.
        """
        call = self._binder.bind(args, kwargs)
        self._buckets.check_example(call.named)
        for sizes in self._buckets.combos():
            example = call.map_tensors(lambda t, sizes=sizes: resize(t, sizes))
            self(*example.args, **example.kwargs)
        # The captures above were at exact bucket sizes, where nothing is padded: replay the example
        # itself, padded, once through _output (learn the cuts, check the padding).
        targets = [self._buckets.target_shape(t) for _, t in call.named]
        if all(tg is not None for tg in targets) and self._buckets.padded(call.named, targets):
            entry = self._graphs[_graph_key(call.named, targets)]
            entry.load(call.named, self._buckets)
            entry.graph.replay()
            self._output(entry, call, targets, entry.static_output)
        return self.stats

    def _capture(self, call: Call, targets: list[tuple[int, ...]], autocast: tuple) -> GraphEntry:
        signature = _signature(call.named, targets, autocast)
        self._ranks.before_capture(signature, f"the {self!r} capture", next((t.device for _, t in call.named), None))
        if self._pool is None or (not self._graphs and self._own_pool):
            # no graph of ours left in the old pool (replaced weights, a failed check): a capture joining a pool
            # whose graphs are all gone asserts in the caching allocator, so start a new one
            self._pool = self._backend.new_pool()
        try:
            entry = capture_entry(self._call, self.fn, call, targets, buckets=self._buckets, backend=self._backend,
                                  pool=self._pool, warmup=self.warmup, validate=self.validate, rtol=self.rtol,
                                  what=repr(self), signature=signature, inspect=self.inspect, breaks=self._breaks)
        except CaptureError as exc:
            if exc.original is not None:
                # a failed capture leaves its pool refusing later captures (capture.ending): start a new one
                self._pool = None
            raise
        if self._weights is not None:
            self._weights.arm()
        if len(self._graphs) == GRAPH_COUNT_WARNING:  # this capture makes one more: warn once
            _warn_graph_count(self, (self.stats.memory_bytes + entry.info.memory_bytes) / 2**20)
        return entry


class _ReplayCheck:
    """``validate_replays``: whether this replay of ``entry`` is one of the first K checked against eager (for a
    function with state, counted from its second call), and the check itself, from the state the replay
    started from (an undo snapshot taken before it), with the replay's state put back afterwards."""

    def __init__(self, entry: GraphEntry, named: list, validate_replays: int):
        stateful, n = entry.changes.stateful, entry.info.replays
        self.entry, self.named = entry, named
        self.checking = n < validate_replays if stateful else 0 < n <= validate_replays
        self.before = entry.undo(named) if self.checking and stateful else None

    def __call__(self, out: Any, eager: Callable[[], Any], rtol: float, what: str) -> None:
        if not self.checking:
            return
        if self.before is None:
            check_later_replay(out, eager(), rtol, what)
            return
        after = self.entry.undo(self.named)
        self.before.restore()
        try:
            expected = eager()
        finally:
            after.restore()
        check_later_replay(out, expected, rtol, what)


def _warn_replaced(runner: GraphRunner, names: list[str], dropped: int, seconds: float) -> None:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    warn_caller(f"{runner!r}: {len(names)} parameters/buffers were replaced after capture ({shown}): new tensors, "
                f"storage or dtype, which the {dropped} captured graph(s) never read. Captured again for the new "
                f"tensors ({seconds * 1e3:.1f} ms, this call). To update weights without that, copy them into the "
                f"captured tensors: runner.load_state_dict(sd), or model.load_state_dict(sd) without assign=True.")


def _warn_graph_count(runner: GraphRunner, mib: float) -> None:
    warn_caller(f"{runner!r}: {GRAPH_COUNT_WARNING + 1} graphs captured, one per input shape, holding {mib:.1f} MiB "
                f"(pool growth and static inputs) so far; each new shape costs a capture and more memory. Pad to a "
                f"few sizes with GraphRunner(..., buckets={{dim: sizes}}) (notebook 03b).")


def _graph_key(named: list, targets: list) -> tuple:
    """Which graph serves a call: the (padded) shape and dtype of every tensor argument, then the
    autocast state (last)."""
    return (*((tg, t.dtype) for tg, (_, t) in zip(targets, named, strict=True)), autocast_state())


def _signature(named: list, targets: list, autocast: tuple) -> str:
    text = ", ".join(f"{n}:{tg} {str(t.dtype).replace('torch.', '')}" for (n, t), tg in zip(named, targets, strict=True))
    return text + (f" (autocast {str(autocast[1]).replace('torch.', '')})" if autocast[0] else "")


def _compiled(fn: Callable[..., Any], compile: bool | dict, breaks: Any = None) -> Callable[..., Any]:
    """``fn`` itself, or ``torch.compile(fn, **options)`` for ``compile=True`` / a dict of options.

    Raises:
        InputError: ``compile`` is neither a bool nor a dict; options that make torch.compile capture
            CUDA graphs of its own (inside ours); options torch.compile rejects; ``compile`` with ``breaks``.
    """
    if compile is False:
        return fn
    if breaks is not None:
        raise InputError("breaks= and compile= cannot be combined: piecewise capture splits at module calls, "
                         "which torch.compile traces through; compile the pieces' modules yourself instead")
    if not isinstance(compile, (bool, dict)):
        raise InputError(f"compile must be True, False or a dict of torch.compile arguments, got {compile!r}")
    options = compile if isinstance(compile, dict) else {}
    inductor = options.get("options") or {}
    if options.get("mode") not in (None, "default", "max-autotune-no-cudagraphs") or (
            isinstance(inductor, dict) and inductor.get("triton.cudagraphs")):
        raise InputError(f"compile={compile!r} makes torch.compile capture CUDA graphs of its own, inside "
                         f"ours; use mode 'default' or 'max-autotune-no-cudagraphs' without triton.cudagraphs")
    try:
        return torch.compile(fn, **options)
    except (TypeError, RuntimeError) as exc:
        raise InputError(f"compile={compile!r}: torch.compile rejected it: {exc}") from exc


def _warn_if_training(fn: Callable[..., Any]) -> None:
    if isinstance(fn, nn.Module) and fn.training and any(
            isinstance(m, (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)) for m in fn.modules()):
        warn_caller("GraphRunner got a module in training mode with dropout or batch norm: replays then draw a "
                    "new dropout mask each time and batch norm updates its running statistics in place, as in "
                    "training; for inference call model.eval() first.")
