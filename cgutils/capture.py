"""GraphRunner: capture a module or function into CUDA graphs once, replay it on every call.

How it works (CUDA Programming Guide, "CUDA Graphs"; PyTorch docs, "CUDA Graphs" in
torch.cuda semantics):

1. *Static input buffers.* A graph replays kernels with the device addresses they were captured
   with, so each tensor argument gets a buffer allocated once; every call copies (``copy_``) the
   caller's data into it. Rebinding a Python name to a new tensor would never reach the graph.
2. *Warm-up on a side stream.* A few eager calls before capture trigger one-time work that must not
   be recorded: cuBLAS/cuDNN handle and workspace creation, autotuning, lazy module initialisation.
   A side stream keeps that work off the caller's stream, as the PyTorch docs advise.
3. *Capture* with ``torch.cuda.graph`` into one memory pool shared by all graphs of this runner, so
   graphs for different input shapes reuse each other's freed blocks instead of each reserving its own.
4. *Validation.* The first replay is compared with the last eager warm-up output; a relative error
   above tolerance raises :class:`~cgutils.errors.CaptureError`.
5. *Replay* on every later call with the same input signature (shapes and dtypes): copy in, one
   ``cudaGraphLaunch``, and clone the static outputs (unless ``clone_outputs=False``).

Inference only: warm-up, capture and replay run under ``torch.no_grad()``.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .diagnose import explain
from .errors import CaptureError, InputError, NoCudaError

# --- nested outputs --------------------------------------------------------------------------------


def tree_map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a nest of tuples, lists, dicts and dataclasses.

    Handles namedtuples and ``transformers.ModelOutput`` (a dict subclass and a dataclass). Other
    leaves are returned unchanged.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        mapped = {k: tree_map(fn, v) for k, v in obj.items()}
        try:
            return type(obj)(**mapped) if _is_model_output(obj) else type(obj)(mapped)
        except TypeError:
            return mapped
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(tree_map(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map(fn, v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: tree_map(fn, getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def tree_leaves(obj: Any, path: str = "output") -> list[tuple[str, Any]]:
    """Flatten a nest (as in :func:`tree_map`) into ``(path, leaf)`` pairs, paths like ``output[0]``."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in tree_leaves(v, f"{path}[{k!r}]")]
    if isinstance(obj, (tuple, list)):
        return [p for i, v in enumerate(obj) for p in tree_leaves(v, f"{path}[{i}]")]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [p for f in dataclasses.fields(obj) for p in tree_leaves(getattr(obj, f.name),
                                                                        f"{path}.{f.name}")]
    return [(path, obj)]


def _is_model_output(obj: Any) -> bool:
    return any(c.__name__ == "ModelOutput" for c in type(obj).__mro__)


# --- input signatures ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArgSpec:
    """What GraphRunner remembers about one argument leaf.

    Attributes:
        name: the argument's name, e.g. ``input_ids`` or ``args[1]``.
        is_tensor: whether the leaf is a tensor.
        dtype, ndim, device: for tensors; ``None`` otherwise.
        value: for non-tensors, the value (baked into the graph at capture).
    """

    name: str
    is_tensor: bool
    dtype: torch.dtype | None = None
    ndim: int | None = None
    device: torch.device | None = None
    value: Any = None

    @classmethod
    def of(cls, name: str, leaf: Any) -> ArgSpec:
        if isinstance(leaf, torch.Tensor):
            return cls(name, True, leaf.dtype, leaf.dim(), leaf.device)
        return cls(name, False, value=leaf)


def _bind_names(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Name each argument leaf after the parameter it binds to, for error messages."""
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        bound = inspect.signature(target).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
    return [leaf for name, value in bound.items() for leaf in tree_leaves(value, name)]


def check_inputs(specs: list[ArgSpec], reference: list[ArgSpec] | None, *, strict: bool = True) -> None:
    """Check the argument specs of a call against those of the first call.

    Args:
        specs: one :class:`ArgSpec` per argument leaf of the current call (``ArgSpec.of``).
        reference: specs from the first call, or ``None`` on the first call.
        strict: when true, a change of dtype or rank of a tensor argument is an error; when false it
            only leads to a new graph.

    Raises:
        InputError: a tensor on the CPU; a changed set of arguments; a tensor that became a
            non-tensor or vice versa; a changed dtype, rank or device (strict); a changed non-tensor
            value. The message names the argument and the fix.
    """
    for s in specs:
        if s.is_tensor and s.device.type != "cuda":
            where = ("" if torch.cuda.is_available() else
                     " (no CUDA device is visible on this machine, so GraphRunner cannot run here at all)")
            raise InputError(
                f"argument {s.name!r} is a tensor on {s.device}; CUDA graphs replay on the GPU and read "
                f"inputs from GPU memory. Move it first: {s.name}.to('cuda'){where}")
    if reference is None:
        return
    ref_names = [r.name for r in reference]
    names = [s.name for s in specs]
    if names != ref_names:
        missing = [n for n in ref_names if n not in names]
        extra = [n for n in names if n not in ref_names]
        raise InputError(
            f"the arguments changed since the first call (missing: {missing or 'none'}, new: "
            f"{extra or 'none'}); a graph captures a fixed argument structure. Pass the same "
            f"arguments every call, or use a separate GraphRunner for the other call pattern")
    for s, r in zip(specs, reference, strict=False):
        if s.is_tensor != r.is_tensor:
            kind = "a tensor" if r.is_tensor else f"the value {r.value!r}"
            raise InputError(f"argument {s.name!r} was {kind} at capture and is now "
                             f"{'a tensor' if s.is_tensor else repr(s.value)}; keep its kind fixed")
        if not s.is_tensor:
            if not _same_value(s.value, r.value):
                raise InputError(
                    f"argument {s.name!r} was {r.value!r} at capture and is now {s.value!r}. Non-tensor "
                    f"arguments are baked into the graph when it is captured, so replay would silently "
                    f"use {r.value!r}. Pass it as a tensor, or use one GraphRunner per value")
            continue
        if s.device != r.device:
            raise InputError(f"argument {s.name!r} is on {s.device} but was captured on {r.device}; "
                             f"move it with .to({str(r.device)!r})")
        if strict and s.dtype != r.dtype:
            raise InputError(
                f"argument {s.name!r} has dtype {s.dtype} but was {r.dtype} at the first call; convert "
                f"it with .to({r.dtype}), or pass strict=False to capture another graph for {s.dtype}")
        if strict and s.ndim != r.ndim:
            raise InputError(
                f"argument {s.name!r} has {s.ndim} dimensions but had {r.ndim} at the first call; "
                f"reshape it, or pass strict=False to capture another graph for this rank")


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # objects whose == is ambiguous or raises: identity is the only safe test
        return a is b


# --- statistics ------------------------------------------------------------------------------------


@dataclass
class GraphInfo:
    """One captured graph.

    Attributes:
        signature: input shapes and dtypes, e.g. ``input_ids:(1, 128) int64``.
        capture_ms: wall time of warm-up plus capture plus validation, ms.
        pool_bytes: bytes newly reserved by the shared memory pool during this capture (later graphs
            reuse blocks freed by earlier ones, so this can be 0 for them).
        static_input_bytes: bytes of the static input buffers (allocated outside the pool).
        static_output_bytes: bytes of the static outputs (live in the pool).
        max_rel_error: largest relative error of replay against eager at capture (0.0 if identical;
            ``None`` when validation was off).
        replays: replays of this graph so far.
    """

    signature: str
    capture_ms: float
    pool_bytes: int
    static_input_bytes: int
    static_output_bytes: int
    max_rel_error: float | None
    replays: int = 0

    @property
    def memory_bytes(self) -> int:
        """Memory this graph added: pool growth plus its static input buffers, bytes."""
        return self.pool_bytes + self.static_input_bytes


@dataclass
class RunnerStats:
    """Snapshot of a GraphRunner's work.

    Attributes:
        captures: graphs captured.
        replays: replays over all graphs.
        graphs: one :class:`GraphInfo` per captured graph, in capture order.
    """

    captures: int
    replays: int
    graphs: list[GraphInfo] = field(default_factory=list)

    @property
    def memory_bytes(self) -> int:
        """Total memory added by all graphs, bytes."""
        return sum(g.memory_bytes for g in self.graphs)

    def to_frame(self):
        """One row per graph as a ``pandas.DataFrame`` (memory in bytes, time in ms)."""
        import pandas as pd

        return pd.DataFrame([{**dataclasses.asdict(g), "memory_bytes": g.memory_bytes}
                             for g in self.graphs])


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_inputs: list[torch.Tensor]
    static_output: Any
    info: GraphInfo


def _default_rtol(dtypes: set[torch.dtype]) -> float:
    # Replay runs the same kernels on the same data, so results are usually bitwise equal; the slack
    # covers library heuristics that pick a different algorithm on the capture stream.
    low = {torch.float16, torch.bfloat16}
    return 1e-2 if dtypes & low else 1e-3


def max_rel_error(actual: Any, expected: Any) -> float:
    """Largest relative error between two nests of tensors: ``max|a-e| / max|e|`` per leaf.

    Integer and bool leaves count 0.0 when equal and ``inf`` otherwise. NaN or infinity where the
    other side has none (or another value) counts ``inf``: a replay that produces NaN never passes.

    Raises:
        InputError: if the two nests differ in structure or shapes, or a leaf pair is not two tensors.
    """
    a_leaves, e_leaves = tree_leaves(actual), tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        raise InputError(f"outputs differ in structure: {len(a_leaves)} vs {len(e_leaves)} leaves")
    worst = 0.0
    for (path, a), (_, e) in zip(a_leaves, e_leaves, strict=True):
        if not isinstance(a, torch.Tensor) and not isinstance(e, torch.Tensor):
            continue
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
            raise InputError(f"{path}: cannot compare {type(a).__name__} with {type(e).__name__}; "
                             f"max_rel_error takes tensors or nests of tensors")
        if a.shape != e.shape:
            raise InputError(f"{path}: shape {tuple(a.shape)} vs {tuple(e.shape)}")
        worst = max(worst, _leaf_rel_error(a, e))
    return worst


def _leaf_rel_error(a: torch.Tensor, e: torch.Tensor) -> float:
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a, e) else float("inf")
    if e.numel() == 0:
        return 0.0
    a64, e64 = a.detach().double(), e.detach().double()
    fin_e = torch.isfinite(e64)
    if not torch.equal(torch.isfinite(a64), fin_e):
        return float("inf")  # NaN or inf on one side only: never "close"
    special = ~fin_e
    if special.any() and not torch.equal(torch.nan_to_num(a64[special], nan=0.0),
                                         torch.nan_to_num(e64[special], nan=0.0)):
        return float("inf")  # +inf against -inf, or inf against NaN
    a64, e64 = a64[fin_e], e64[fin_e]
    if e64.numel() == 0:
        return 0.0
    scale = e64.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float((a64 - e64).abs().max() / scale)


def pool_reserved_bytes(pool: Any) -> int:
    """Bytes the caching allocator has reserved (cudaMalloc'd segments) for one graph memory pool.

    Read from ``torch.cuda.memory_snapshot()``: the segments whose ``segment_pool_id`` is ``pool``.
    This counts the pool alone, unlike ``torch.cuda.memory_reserved()``, which also moves when the
    default pool grows or when segments of released graph pools are returned.
    """
    key = tuple(pool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id") or ()) == key)


def graph_node_types(dot: str) -> dict[str, int]:
    """Count the nodes of a captured graph by type from its DOT dump (``graph.debug_dump(path)`` after
    capturing with ``debug=True``; the format is CUDA's ``cudaGraphDebugDotPrint``, whose node labels
    start with the node type, e.g. ``KERNEL`` or ``MEMSET``).

    Returns:
        ``{node type: count}``; empty if the text holds no recognisable node.
    """
    import collections
    import re

    return dict(collections.Counter(re.findall(r'label="\{\s*([A-Z_]+)', dot)))


def _reset_rng_after_failed_capture() -> None:
    # When capture fails, PyTorch raises before its default CUDA generators leave capture mode, and
    # every later random op then fails with "Offset increment outside graph capture". A clone of a
    # generator state keeps seed and offset but not the capture flag (CUDAGeneratorState::clone in
    # ATen/cuda/CUDAGeneratorImpl.cpp), so installing one restores normal eager use.
    for i in range(torch.cuda.device_count()):
        gen = torch.cuda.default_generators[i]
        if hasattr(gen, "graphsafe_set_state") and hasattr(gen, "clone_state"):
            try:
                gen.graphsafe_set_state(gen.clone_state())
            except RuntimeError:
                pass


def capture_graph(fn: Callable[[], Any], *, warmup: int = 3, pool: Any = None,
                  on_last_warmup: Callable[[Any], None] | None = None,
                  what: str = "function", debug: bool = False) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``fn`` up on a side stream, then capture one call of it into a CUDA graph.

    Args:
        fn: a callable with no arguments that only touches tensors at fixed addresses.
        warmup: eager calls before capture (>= 1), on a side stream.
        pool: memory-pool handle to capture into (``torch.cuda.graph_pool_handle()``); ``None`` for a
            private one.
        on_last_warmup: called with the output of the last warm-up call (e.g. to keep a reference).
        what: name used in error messages.
        debug: keep the graph's description so that ``graph.debug_dump(path)`` can write it as a
            Graphviz DOT file (see :func:`graph_node_types`).

    Returns:
        ``(graph, static_output)``: the output tensors live in the pool and are rewritten by each
        ``graph.replay()``.

    Raises:
        CaptureError: capture failed; ``.original`` holds the error, ``.explanation`` cause and fix.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            out = fn()
        if on_last_warmup is not None:
            on_last_warmup(out)
        del out
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    if debug:
        graph.enable_debug_mode()
    try:
        with torch.cuda.graph(graph, pool=pool), torch.no_grad():
            static_out = fn()
    except Exception as exc:
        _reset_rng_after_failed_capture()
        why = explain(exc)
        raise CaptureError(
            f"CUDA graph capture of {what} failed: {type(exc).__name__}: {exc}\n"
            + (str(why) if why else "No known pattern matched; run the function eagerly under "
               "torch.cuda.set_sync_debug_mode('error') to find syncs."),
            original=exc, explanation=str(why or "")) from exc
    torch.cuda.synchronize()
    return graph, static_out


# --- the runner ------------------------------------------------------------------------------------


class GraphRunner:
    """Capture ``fn`` into a CUDA graph per input signature and replay it on later calls.

    Example::

        runner = cgutils.GraphRunner(model.eval().cuda())
        out = runner(input_ids, attention_mask=mask)   # first call: warm-up, capture, validate
        out = runner(other_ids, attention_mask=mask)   # same shapes: copy in, replay

    Args:
        fn: an ``nn.Module`` or a function of tensors (and fixed non-tensor values). Its tensor
            arguments may be nested in tuples, lists and dicts.
        warmup: eager calls on a side stream before each capture (>= 1).
        validate: compare the first replay with eager and raise on mismatch.
        rtol: tolerated relative error ``max|replay-eager| / max|eager|``; default 1e-3 for fp32,
            1e-2 when an fp16/bf16 tensor is involved.
        clone_outputs: return clones of the static outputs (safe). With ``False`` the runner returns
            the static output tensors themselves: no copy, but the **next replay overwrites them** in
            place, so read or clone them before calling the runner again.
        strict: a changed dtype or rank of a tensor argument raises (default) instead of capturing
            another graph.
        pool: a memory-pool handle (``torch.cuda.graph_pool_handle()``) to share with other runners;
            default: one new pool shared by this runner's graphs.

    Shapes and dtypes: each distinct combination of input shapes (and, with ``strict=False``,
    dtypes) gets its own graph, captured on first sight.

    Raises (from ``__call__``):
        InputError: CPU tensors, a changed argument structure, dtype, rank, device or non-tensor value.
        NoCudaError: no CUDA device is visible.
        CaptureError: capture failed (with ``.original`` and ``.explanation``) or the replay did not
            match eager above ``rtol`` (with ``.max_rel_error``).
    """

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 3, validate: bool = True,
                 rtol: float | None = None, clone_outputs: bool = True, strict: bool = True,
                 pool: Any = None):
        if not callable(fn):
            raise InputError(f"GraphRunner needs a callable (module or function), got {type(fn).__name__}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise InputError(f"warmup must be an int >= 1 (lazy initialisation must not be captured), got {warmup!r}")
        if rtol is not None and not (isinstance(rtol, (int, float)) and rtol >= 0):
            raise InputError(f"rtol must be a number >= 0 (a relative error), got {rtol!r}")
        self.fn = fn
        self.warmup = warmup
        self.validate = validate
        self.rtol = rtol
        self.clone_outputs = clone_outputs
        self.strict = strict
        self._pool = pool
        self._spec: list[ArgSpec] | None = None
        self._graphs: dict[tuple, _Graph] = {}
        self._replays = 0
        if isinstance(fn, nn.Module) and fn.training and any(
                isinstance(m, (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm))
                for m in fn.modules()):
            warnings.warn("GraphRunner got a module in training mode with dropout or batch norm: their "
                          "random masks and batch statistics would be frozen into the graph and validation "
                          "would fail. Call model.eval() first.", stacklevel=2)

    @property
    def stats(self) -> RunnerStats:
        """Captures, replays and per-graph memory (a snapshot, see :class:`RunnerStats`)."""
        infos = [dataclasses.replace(g.info) for g in self._graphs.values()]
        return RunnerStats(captures=len(infos), replays=self._replays, graphs=infos)

    def __repr__(self) -> str:
        name = type(self.fn).__name__ if isinstance(self.fn, nn.Module) else getattr(self.fn, "__name__", "fn")
        return f"GraphRunner({name}, graphs={len(self._graphs)}, replays={self._replays})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = _bind_names(self.fn, args, kwargs)
        specs = [ArgSpec.of(n, leaf) for n, leaf in leaves]
        check_inputs(specs, self._spec, strict=self.strict)
        if not torch.cuda.is_available():
            raise NoCudaError("GraphRunner needs a CUDA device and none is visible "
                              "(torch.cuda.is_available() is False); call the model eagerly instead")
        if self._spec is None:
            self._spec = specs
        tensors = [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(args, kwargs, leaves, tensors)
            self._graphs[key] = entry
        else:
            for buf, t in zip(entry.static_inputs, tensors, strict=False):
                buf.copy_(t)
        entry.graph.replay()
        entry.info.replays += 1
        self._replays += 1
        if self.clone_outputs:
            return tree_map(torch.clone, entry.static_output)
        return entry.static_output

    def _capture(self, args: tuple, kwargs: dict, leaves: list[tuple[str, Any]],
                 tensors: list[torch.Tensor]) -> _Graph:
        t_start = time.perf_counter()
        static_inputs = [t.detach().clone() for t in tensors]
        swap = {id(t): s for t, s in zip(tensors, static_inputs, strict=False)}
        s_args = tree_map(lambda t: swap.get(id(t), t), args)
        s_kwargs = tree_map(lambda t: swap.get(id(t), t), kwargs)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()

        kept: dict[str, Any] = {}

        def keep_reference(out: Any) -> None:
            if self.validate:
                kept["expected"] = tree_map(torch.clone, out)

        pool_before = pool_reserved_bytes(self._pool)
        graph, static_out = capture_graph(lambda: self.fn(*s_args, **s_kwargs), warmup=self.warmup,
                                          pool=self._pool, on_last_warmup=keep_reference, what=repr(self))
        expected = kept.get("expected")
        pool_bytes = max(0, pool_reserved_bytes(self._pool) - pool_before)

        rel = None
        if self.validate:
            graph.replay()
            torch.cuda.synchronize()
            rel = max_rel_error(static_out, expected)
            dtypes = {t.dtype for _, t in tree_leaves(static_out) if isinstance(t, torch.Tensor)}
            rtol = self.rtol if self.rtol is not None else _default_rtol(dtypes | {t.dtype for t in tensors})
            if not rel <= rtol:
                raise CaptureError(
                    f"replay of the captured graph differs from eager: max relative error {rel:.3g} > "
                    f"rtol {rtol:.3g}. Likely cause: a value was baked in at capture (a Python `if` on "
                    f"a tensor value, .item(), randomness such as dropout in training mode). Call "
                    f"model.eval(), keep control flow on the GPU (torch.where), or raise rtol if the "
                    f"difference is numerical noise.", max_rel_error=rel)

        out_bytes = sum(t.numel() * t.element_size() for _, t in tree_leaves(static_out)
                        if isinstance(t, torch.Tensor))
        signature = ", ".join(f"{n}:{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                              for n, t in leaves if isinstance(t, torch.Tensor))
        info = GraphInfo(signature=signature, capture_ms=(time.perf_counter() - t_start) * 1e3,
                         pool_bytes=pool_bytes,
                         static_input_bytes=sum(t.numel() * t.element_size() for t in static_inputs),
                         static_output_bytes=out_bytes, max_rel_error=rel)
        # The validation replay consumed the static inputs already holding this call's data, so
        # __call__'s replay below just recomputes the same answer: cheap, and keeps one code path.
        return _Graph(graph, static_inputs, static_out, info)
