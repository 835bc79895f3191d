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

import contextlib
import dataclasses
import inspect
import itertools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .diagnose import explain, find_sync_points
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
        if not missing and not extra:
            raise InputError(
                f"the arguments came in another order ({names}) than at the first call ({ref_names}); the "
                f"static buffers are matched by position, so pass them in the first call's order")
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


def _is_plain(x: Any) -> bool:
    """A value with a meaningful ``==``: numbers, strings, None, torch dtypes/devices/sizes, numpy data."""
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)):
        return True
    return type(x).__module__ == "numpy"


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # the same NaN passed twice is the same value
    try:
        return bool(a is b or a == b)
    except Exception:  # == is elementwise (arrays) or ambiguous
        pass
    try:
        import numpy as np

        return bool(np.array_equal(a, b))
    except Exception:
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
        fallbacks: calls run eagerly because an input was larger than the largest bucket.
    """

    captures: int
    replays: int
    graphs: list[GraphInfo] = field(default_factory=list)
    fallbacks: int = 0

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
    # Per bucketed input dim: for each output tensor (in tree_map order), the output dims that follow
    # that input dim's padded length. Learned from the first call that pads that dim (see _output).
    cuts: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)


def _default_rtol(dtypes: set[torch.dtype]) -> float:
    # Replay runs the same kernels on the same data, so results are usually bitwise equal; the slack
    # covers library heuristics that pick a different algorithm on the capture stream.
    low = {torch.float16, torch.bfloat16}
    return 1e-2 if dtypes & low else 1e-3


def max_rel_error(actual: Any, expected: Any) -> float:
    """Largest relative error between two nests of tensors: ``max|a-e| / max|e|`` per leaf.

    Integer and bool leaves count 0.0 when equal and ``inf`` otherwise; so do plain non-tensor leaves
    (numbers, strings, bytes, None, dtypes, devices, sizes, numpy arrays). Other objects (a model's
    cache object, say) are not compared. NaN or infinity where the other side has none (or another value)
    counts ``inf``: a replay that produces NaN never passes.

    Raises:
        InputError: if the two nests differ in structure or shapes, or a tensor is paired with a non-tensor.
    """
    a_leaves, e_leaves = tree_leaves(actual), tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        raise InputError(f"outputs differ in structure: {len(a_leaves)} vs {len(e_leaves)} leaves")
    worst = 0.0
    for (path, a), (_, e) in zip(a_leaves, e_leaves, strict=True):
        if not isinstance(a, torch.Tensor) and not isinstance(e, torch.Tensor):
            # Plain values must match; other objects (a transformers cache, a module) compare by
            # identity, so two correct calls would never agree: they are skipped, as before.
            if _is_plain(a) and _is_plain(e) and not _same_value(a, e):
                return float("inf")
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


def validate_replay(replay: Callable[..., Any], eager: Callable[..., Any], inputs: list[tuple],
                    *, rtol: float | None = None):
    """Check a graphed function against eager on several inputs, the way a caller uses it.

    Calls ``replay(*args)`` for every ``args`` in ``inputs`` **keeping every output** (as a caller that
    stores results would), then ``eager(*args)`` for each, and compares. Holding the outputs first is
    what exposes the two silent static-buffer bugs: outputs that a later replay overwrote, and a
    replay that kept reading the captured input because the input was rebound instead of copied.

    Args:
        replay: the graphed callable under test (e.g. a function that copies into static inputs,
            replays and returns the static output).
        eager: the reference, same signature.
        inputs: at least two argument tuples with different values (identical inputs hide both bugs).
        rtol: tolerated relative error (default 1e-3, 1e-2 with fp16/bf16 outputs).

    Returns:
        ``pandas.DataFrame``, one row per input: ``input`` (index) and ``max_rel_error``.

    Raises:
        InputError: fewer than two inputs.
        CaptureError: a replay output differs from eager; ``.cause`` is ``"overwritten_output"`` (every
            held output equals the last one, which was right when returned), ``"stale_input"`` (every
            output equals the first: replay ignores new inputs), ``"nonfinite"`` (NaN/inf only in the
            replay) or ``"baked_value"``; the message
            names the first wrong input and the fix.
    """
    import pandas as pd

    inputs = list(inputs)
    if not all(isinstance(args, tuple) for args in inputs):
        raise InputError("validate_replay takes inputs as a list of argument tuples, e.g. [(x1,), (x2,)], got "
                         + ", ".join(type(a).__name__ for a in inputs[:3]))
    if len(inputs) < 2:
        raise InputError("validate_replay needs at least two inputs with different values; with one, "
                         "stale inputs and overwritten outputs cannot show")
    if all(_identical(args, inputs[0]) for args in inputs[1:]):
        raise InputError("validate_replay got identical inputs; stale inputs and overwritten outputs only show "
                         "with different values (e.g. torch.randn_like for each)")
    held = [replay(*args) for args in inputs]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with torch.no_grad():
        expected = [eager(*args) for args in inputs]
    dtypes = {t.dtype for out in expected for _, t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    tol = rtol if rtol is not None else _default_rtol(dtypes)
    errors = [max_rel_error(h, e) for h, e in zip(held, expected, strict=True)]
    table = pd.DataFrame({"input": range(len(inputs)), "max_rel_error": errors})
    bad = [i for i, r in enumerate(errors) if not r <= tol]
    if not bad:
        return table
    same_as_last = all(max_rel_error(h, held[-1]) == 0 for h in held)
    same_as_first = all(max_rel_error(h, held[0]) == 0 for h in held)
    if not all(_finite(h) for h in held) and all(_finite(e) for e in expected):
        cause, why = "nonfinite", (
            "the replay produced NaN or inf where eager did not: it read memory that holds no valid "
            "input (a freed or never-written static buffer) or computed something else than eager")
    elif same_as_last and errors[-1] <= tol:
        cause, why = "overwritten_output", (
            "every output you kept equals the last one: the outputs are the graph's static output "
            "tensors, which each replay overwrites in place. Clone them before the next replay "
            "(out.clone()), or use GraphRunner with clone_outputs=True")
    elif same_as_first:
        cause, why = "stale_input", (
            "every output equals the first one: replay ignores the new inputs. A graph reads its "
            "inputs from the addresses captured; rebinding a Python name (static_x = new_x) never "
            "reaches it. Copy into the static input instead: static_x.copy_(new_x)")
    else:
        cause, why = "baked_value", (
            "the replay follows the inputs but computes something else than eager: a value was baked in "
            "at capture (a Python number or module attribute, a 0-dim CPU tensor, a branch on CPU-side "
            "state). Pass such values as CUDA tensors")
    i = bad[0]
    raise CaptureError(f"replay differs from eager on input {i} of {len(inputs)} (max relative error "
                       f"{errors[i]:.3g} > rtol {tol:.3g}); {len(bad)} of {len(inputs)} inputs wrong. "
                       f"Likely cause: {why}.", max_rel_error=errors[i], cause=cause)


def _finite(out: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for _, t in tree_leaves(out)
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))


def _identical(a: tuple, b: tuple) -> bool:
    try:
        return max_rel_error(a, b) == 0
    except InputError:  # other shapes or structure: certainly not identical
        return False


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


def reset_rng_after_failed_capture() -> None:
    """Return PyTorch's default CUDA generators to eager use after a capture that raised."""
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


def _capture_failure(exc: Exception, fn: Callable[[], Any], what: str) -> CaptureError:
    """Build the CaptureError for a failed capture: the original error, its explanation, and the syncs
    found by running ``fn`` once more eagerly (which is safe now that capture has ended)."""
    why = explain(exc)
    syncs, note = None, ""
    try:
        syncs = find_sync_points(fn)
    except Exception as rerun:  # the eager rerun can fail for its own reasons; never hide the original
        note = f"\n(Could not rerun it eagerly to look for syncs: {type(rerun).__name__}: {rerun})"
    if syncs is not None and len(syncs):
        where = "\n".join(f"  {r.op} at {r.file}:{r.line}: {r.code}" for r in syncs.head(5).itertuples())
        more = f"\n  ... and {len(syncs) - 5} more (see .sync_points)" if len(syncs) > 5 else ""
        note = f"\nCPU-GPU syncs in your code (each one breaks capture):\n{where}{more}"
    elif syncs is not None:
        note = "\nAn eager rerun found no CPU-GPU sync, so the cause is not a sync."
    return CaptureError(
        f"CUDA graph capture of {what} failed: {type(exc).__name__}: {_first_line(exc)}\n"
        + (str(why) if why else "No known pattern matched the error text.") + note,
        original=exc, explanation=str(why or ""), sync_points=syncs,
        # syncs found by running the code are firmer evidence than a match on the error text
        cause="sync" if syncs is not None and len(syncs) else (why.key if why else ""))


def _first_line(exc: BaseException) -> str:
    # CUDA errors from PyTorch carry several lines of generic advice (CUDA_LAUNCH_BLOCKING...) that
    # bury the point; the full text stays on .original.
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


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

    Under ``torch.autocast("cuda")``, warm-up and capture run with autocast's cast cache off, so
    the graph casts the weights itself instead of reading cached copies that die with the context.

    Raises:
        CaptureError: capture failed; ``.original`` holds the error, ``.explanation`` cause and fix.
    """
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise InputError(f"warmup must be an int >= 1 (lazy initialisation must not be captured), got {warmup!r}")
    side = _warmup_stream()
    side.wait_stream(torch.cuda.current_stream())
    with _autocast_without_cache():
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
            reset_rng_after_failed_capture()
            raise _capture_failure(exc, fn, what) from exc
    torch.cuda.synchronize()
    return graph, static_out


def _autocast_without_cache() -> contextlib.AbstractContextManager:
    """CUDA autocast as the caller set it, with its cast cache off (a no-op outside autocast).

    Autocast caches the low-precision copy of each parameter until the outermost autocast context
    exits. A graph captured while that cache is on reads the cached copy, not a cast of its own, and
    replays after the context exits read freed memory. ``torch.cuda.make_graphed_callables`` refuses
    ``cache_enabled=True`` for the same reason (torch/cuda/graphs.py)."""
    if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    return contextlib.nullcontext()


# --- the runner ------------------------------------------------------------------------------------


class GraphRunner:
    """Capture ``fn`` into a CUDA graph per input signature and replay it on later calls.

    Example::

        runner = cgutils.GraphRunner(model.eval().cuda(), buckets={1: (128, 256, 512)})
        out = runner(input_ids, attention_mask=mask)   # first call: warm-up, capture, validate
        out = runner(other_ids, attention_mask=mask)   # same bucket: copy in (padded), replay

    Args:
        fn: an ``nn.Module`` or a function of tensors (and fixed non-tensor values). Its tensor
            arguments may be nested in tuples, lists and dicts.
        warmup: eager calls on a side stream before each capture (>= 1).
        validate: compare the first replay with eager and raise on mismatch (cost: one replay and one
            output clone per capture; see ``python -m cgutils bench memory``); with ``buckets``, also
            check the padding on the eager call described there.
        validate_replays: also compare the first ``K`` replays of each graph (after capture, on the
            caller's fresh inputs) with an eager call; catches Python values baked in at capture that
            change later (module attributes, CPU scalars, Python branches). Each costs one eager call.
        rtol: tolerated relative error ``max|replay-eager| / max|eager|``; default 1e-3 for fp32,
            1e-2 when an fp16/bf16 tensor is involved.
        clone_outputs: return clones of the static outputs (safe). With ``False`` the runner returns
            the static output tensors themselves: no copy, but the **next replay overwrites them** in
            place, so read or clone them before calling the runner again.
        strict: a changed dtype or rank of a tensor argument raises (default) instead of capturing
            another graph.
        pool: a memory-pool handle (``torch.cuda.graph_pool_handle()``) to share with other runners;
            default: one new pool shared by this runner's graphs.
        buckets: ``{dim: sizes}``: pad every tensor argument with more than ``dim`` dimensions along
            ``dim`` up to the smallest size in ``sizes`` that holds it, so a few graphs serve every
            length. Outputs are cut back to the caller's length along the dims that follow it: the
            first call that pads a dim of a graph's inputs also runs ``fn`` eagerly once, at the
            caller's shapes, to see which output dims those are, and with ``validate`` to check that
            padding left that call's result alone (one sample: ``validate_replays`` checks more calls;
            ``fn`` must also run at unpadded lengths; the call
            repeats after a failed check, or while two padded dims share a length and bucket).
            A size above the largest bucket runs eagerly (counted in
            ``stats.fallbacks``, with one warning). Padding must not change the real positions'
            results: for attention pass an attention mask, padded with 0 (the default ``pad_value``).
        pad_value: value written into padding: one number, or ``{argument name: number}`` (names as
            in error messages, e.g. ``input_ids``, ``attention_mask``); default 0.
        compile: run ``fn`` through ``torch.compile`` (Inductor, ``mode="default"``: fused kernels, no
            graphs of its own) and capture that; ``True`` or a dict of ``torch.compile`` keyword
            arguments. Compilation happens during the first warm-up.

    Shapes and dtypes: each distinct combination of (padded) input shapes and, with ``strict=False``,
    dtypes gets its own graph, captured on first sight; so does each CUDA autocast state
    (``torch.autocast("cuda", dtype=...)`` on or off), since captured kernels keep the dtypes autocast
    chose at capture. All graphs share one memory pool.

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
                 pad_value: float | dict[str, float] = 0, compile: bool | dict = False):
        if not callable(fn):
            raise InputError(f"GraphRunner needs a callable (module or function), got {type(fn).__name__}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise InputError(f"warmup must be an int >= 1 (lazy initialisation must not be captured), got {warmup!r}")
        if not isinstance(validate_replays, int) or isinstance(validate_replays, bool) or validate_replays < 0:
            raise InputError(f"validate_replays must be an int >= 0 (replays to check against eager), "
                             f"got {validate_replays!r}")
        if rtol is not None and not (isinstance(rtol, (int, float)) and rtol >= 0):
            raise InputError(f"rtol must be a number >= 0 (a relative error), got {rtol!r}")
        self.buckets = _check_bucket_spec(buckets)
        if not isinstance(pad_value, (int, float, dict)) or isinstance(pad_value, bool):
            raise InputError(f"pad_value must be a number or a dict of argument name -> number, got {pad_value!r}")
        if compile is not False and not isinstance(compile, (bool, dict)):
            raise InputError(f"compile must be True, False or a dict of torch.compile arguments, got {compile!r}")
        options = compile if isinstance(compile, dict) else {}
        inductor = options.get("options") or {}
        if options.get("mode") not in (None, "default", "max-autotune-no-cudagraphs") or (
                isinstance(inductor, dict) and inductor.get("triton.cudagraphs")):
            raise InputError(f"compile={compile!r} makes torch.compile capture CUDA graphs of its own, inside "
                             f"ours; use mode 'default' or 'max-autotune-no-cudagraphs' without triton.cudagraphs")
        if isinstance(pad_value, dict) and not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in pad_value.values()):
            raise InputError(f"pad_value values must be numbers, got {pad_value!r}")
        self.fn = fn
        if compile is not False:
            try:
                self._call = torch.compile(fn, **options)
            except (TypeError, RuntimeError) as exc:
                raise InputError(f"compile={compile!r}: torch.compile rejected it: {exc}") from exc
        else:
            self._call = fn
        self.warmup = warmup
        self.validate = validate
        self.validate_replays = validate_replays
        self.rtol = rtol
        self.clone_outputs = clone_outputs
        self.strict = strict
        self.pad_value = pad_value
        self._pool = pool
        self._spec: list[ArgSpec] | None = None
        self._accepted: list[tuple] = []
        self._names: dict[tuple, list[tuple[str, tuple[str, Any]]]] = {}
        self._graphs: dict[tuple, _Graph] = {}
        self._replays = 0
        self._fallbacks = 0
        if isinstance(fn, nn.Module) and fn.training and any(
                isinstance(m, (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm))
                for m in fn.modules()):
            warnings.warn("GraphRunner got a module in training mode with dropout or batch norm: their "
                          "random masks and batch statistics would be frozen into the graph and validation "
                          "would fail. Call model.eval() first.", stacklevel=2)

    @property
    def stats(self) -> RunnerStats:
        """Captures, replays, eager fallbacks and per-graph memory (a snapshot, see :class:`RunnerStats`)."""
        infos = [dataclasses.replace(g.info) for g in self._graphs.values()]
        return RunnerStats(captures=len(infos), replays=self._replays, graphs=infos, fallbacks=self._fallbacks)

    def __repr__(self) -> str:
        name = type(self.fn).__name__ if isinstance(self.fn, nn.Module) else getattr(self.fn, "__name__", "fn")
        return f"GraphRunner({name}, graphs={len(self._graphs)}, replays={self._replays})"

    def _leaves(self, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
        # Binding argument names with inspect costs tens of µs; the names depend only on the call
        # pattern (how many positional arguments, which keywords), so they are bound once per pattern.
        pattern = (len(args), tuple(kwargs))
        names = self._names.get(pattern)
        if names is None:
            names = self._names[pattern] = _param_names(self.fn, len(args), tuple(kwargs))
        return _named_leaves(names, args, kwargs)

    def _target_shape(self, t: torch.Tensor) -> tuple[int, ...] | None:
        """The bucketed shape of ``t``, or None when a dimension is above its largest bucket."""
        shape = list(t.shape)
        for dim, sizes in self.buckets.items():
            if t.dim() > dim:
                size = next((b for b in sizes if shape[dim] <= b), None)
                if size is None:
                    return None
                shape[dim] = size
        return tuple(shape)

    def _pad_of(self, name: str) -> float:
        if isinstance(self.pad_value, dict):  # the leaf's own name first, then its argument's
            return self.pad_value.get(name, self.pad_value.get(name.split("[")[0], 0))
        return self.pad_value

    def _check_pad_names(self, names: list[str]) -> None:
        if not isinstance(self.pad_value, dict):
            return
        known = set(names) | {n.split("[")[0] for n in names}
        unknown = sorted(set(self.pad_value) - known)
        if unknown:
            raise InputError(f"pad_value names {unknown}, which are not arguments of this call; the tensor "
                             f"arguments are {names}")

    def _check_bucketed_lengths(self, named: list) -> None:
        for dim in self.buckets:
            sizes = {n: t.shape[dim] for n, t in named if t.dim() > dim}
            if len(set(sizes.values())) > 1:
                raise InputError(
                    f"buckets={{{dim}: ...}} pads every tensor argument with more than {dim} dimensions along "
                    f"dim {dim}, and these differ there: {sizes}. Padding and cutting the outputs back need "
                    f"one length per dim; bucket a dim that all arguments share (e.g. the sequence length)")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = self._leaves(args, kwargs)
        named = [(n, leaf) for n, leaf in leaves if isinstance(leaf, torch.Tensor)]
        # Replay is the hot path: a call whose argument kinds, dtypes, ranks, devices and values equal
        # an already accepted call skips the full check (it would pass) and its error formatting.
        quick = _call_pattern(leaves)
        specs = None
        if not any(_same_value(quick, seen) for seen in self._accepted):
            specs = [ArgSpec.of(n, leaf) for n, leaf in leaves]
            check_inputs(specs, self._spec, strict=self.strict)
            if not torch.cuda.is_available():
                raise NoCudaError("GraphRunner needs a CUDA device and none is visible "
                                  "(torch.cuda.is_available() is False); call the model eagerly instead")
            self._check_pad_names([n for n, _ in named])
        out = self._run(args, kwargs, leaves, named)
        if specs is not None:
            # Only now: a first call that failed (a wrong argument, an error in fn) must not become
            # the argument structure that every later call is checked against.
            if self._spec is None:
                self._spec = specs
            if len(self._accepted) >= 64:  # a bounded memo, not a record: forget the oldest pattern
                self._accepted.pop(0)
            self._accepted.append(quick)
        return out

    def _run(self, args: tuple, kwargs: dict, leaves: list, named: list) -> Any:
        """One checked call: pick (or capture) the graph, load, replay, cut back, validate, clone."""
        if self.buckets:
            self._check_bucketed_lengths(named)
        targets = [self._target_shape(t) for _, t in named] if self.buckets else [tuple(t.shape) for _, t in named]
        if any(tg is None for tg in targets):
            return self._fallback(args, kwargs, named)
        key = _graph_key(named, targets)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(args, kwargs, leaves, named, targets, key[-1])
            self._graphs[key] = entry
        else:
            self._load(entry, named)
        entry.graph.replay()
        entry.info.replays += 1
        self._replays += 1
        out = self._output(entry, args, kwargs, named, targets)
        if entry.info.replays <= self.validate_replays + 1 and entry.info.replays > 1:
            try:
                self._check_replay(out, args, kwargs)
            except CaptureError:
                del self._graphs[key]  # else a retry would replay the same stale graph unchecked
                raise
        return out

    def _load(self, entry: _Graph, named: list) -> None:
        """Copy this call's tensors into the graph's static inputs, padded up to the bucket."""
        for buf, (name, t) in zip(entry.static_inputs, named, strict=True):
            _copy_padded(buf, t, self._pad_of(name))

    def _output(self, entry: _Graph, args: tuple, kwargs: dict, named: list, targets: list) -> Any:
        """The graph's static outputs, cut back to the caller's lengths along the padded dims, and
        cloned with ``clone_outputs`` (in the same pass: rebuilding a ModelOutput costs µs).

        Which output dims follow a padded input dim is learned per graph, from the first call that pads
        that dim, by one eager call at the caller's shapes: the dims whose size is the bucket in the
        replay and the caller's length in eager are cut. A size test alone ("equals the bucket") would
        also cut a pooled output of hidden size 512 under a 512 bucket. With ``validate`` the same eager
        call checks that padding left the real positions alone.
        """
        padded = {dim: (tg[dim], t.shape[dim]) for (_, t), tg in zip(named, targets, strict=True)
                  for dim in self.buckets if t.dim() > dim and tg[dim] != t.shape[dim]}
        clone = self.clone_outputs
        if not padded:
            return tree_map(torch.clone, entry.static_output) if clone else entry.static_output
        if not padded.keys() <= entry.cuts.keys():
            with torch.no_grad():
                expected = self._call(*args, **kwargs)
            learned, ambiguous = _learn_cuts(entry.static_output, expected, padded)
            out = _apply_cuts(entry.static_output, {**entry.cuts, **learned}, padded, clone)  # learned: this call's
            if self.validate:
                self._check_padding(out, expected, self._rtol_for(entry.static_output, {t.dtype for _, t in named}))
            # Stored only once checked (a call after a failed check must fail the same way), and only
            # for dims this call told apart: two padded dims with the same (bucket, length) are cut
            # correctly now, but which one an output dim follows is learned at a later call.
            entry.cuts = {**{k: v for k, v in learned.items() if k not in ambiguous}, **entry.cuts}
            return out
        return _apply_cuts(entry.static_output, entry.cuts, padded, clone)

    def _fallback(self, args: tuple, kwargs: dict, named: list) -> Any:
        self._fallbacks += 1
        if self._fallbacks == 1:
            sizes = {n: tuple(t.shape) for n, t in named}
            warnings.warn(f"{self!r}: input shapes {sizes} exceed the largest bucket {self.buckets}; running "
                          f"eagerly (no graph). Add a larger bucket if this size is common; "
                          f"stats.fallbacks counts these calls.", stacklevel=3)
        with torch.no_grad():
            return self._call(*args, **kwargs)

    def _check_replay(self, out: Any, args: tuple, kwargs: dict) -> None:
        with torch.no_grad():
            expected = self._call(*args, **kwargs)
        rtol = self._rtol_for(out)
        try:
            rel = max_rel_error(out, expected)
        except InputError as exc:  # eager now returns another structure or shape than the graph
            rel, why = float("inf"), f"eager now gives other outputs ({exc})"
        else:
            why = f"max relative error {rel:.3g} > rtol {rtol:.3g}"
        if not rel <= rtol:
            raise CaptureError(
                f"replay {self._replays} of {self!r} differs from eager on the same inputs: {why}, "
                f"although replay matched eager at capture. Likely cause: a Python value was baked into "
                f"the graph at capture and has changed since (a module attribute or Python number read "
                f"in forward, a 0-dim CPU tensor used as a scalar, a Python branch on CPU-side state). "
                f"Pass such values as CUDA tensors. The graph is dropped: the next call captures a new "
                f"one with the values as they are then.", max_rel_error=rel, cause="baked_value")

    def _rtol_for(self, out: Any, extra: set | None = None) -> float:
        if self.rtol is not None:
            return self.rtol
        dtypes = {t.dtype for _, t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        return _default_rtol(dtypes | (extra or set()))

    def capture_buckets(self, *args: Any, **kwargs: Any) -> RunnerStats:
        """Capture a graph for every bucket now, largest first, from one example call.

        Largest first, so that the shared memory pool grows once, to the largest graph's needs, and
        the smaller graphs reuse its blocks. The example is padded (or cut) to each bucket size, so its
        values only serve warm-up and validation.

        When the example's own size is below a bucket, it is then replayed once, padded, next to an
        eager call at its own shape: for the graph of that bucket, that learns which output dims to
        cut back (see ``buckets``) and, with ``validate``, checks the padding. The other graphs do
        this on their first padded call.

        Returns:
            :attr:`stats` after the captures.

        Raises:
            InputError: no ``buckets`` were given; as for ``__call__``.
            CaptureError: as for ``__call__``; ``cause="padding"`` when padding changes the result.
        """
        if not self.buckets:
            raise InputError("capture_buckets needs GraphRunner(..., buckets={dim: sizes})")
        if not any(isinstance(t, torch.Tensor) for _, t in self._leaves(args, kwargs)):
            raise InputError("capture_buckets needs an example call, e.g. runner.capture_buckets(input_ids=ids, "
                             "attention_mask=mask): it is padded to each bucket to capture its graph")
        self._check_bucketed_lengths([(n, t) for n, t in self._leaves(args, kwargs) if isinstance(t, torch.Tensor)])

        dims = sorted(self.buckets)
        combos = sorted(itertools.product(*(self.buckets[d] for d in dims)), reverse=True)
        for combo in combos:
            sizes = dict(zip(dims, combo, strict=True))

            def resize(t: torch.Tensor, sizes=sizes) -> torch.Tensor:
                for d, n in sizes.items():
                    if t.dim() > d and t.shape[d] != n:
                        if t.shape[d] > n:
                            t = t.narrow(d, 0, n)
                        else:
                            shape = list(t.shape)
                            shape[d] = n - t.shape[d]
                            t = torch.cat([t, t.new_zeros(shape)], dim=d)
                return t

            self(*tree_map(resize, args), **tree_map(resize, kwargs))
        self._check_example_padding(args, kwargs)
        return self.stats

    def _check_example_padding(self, args: tuple, kwargs: dict) -> None:
        """capture_buckets captures at exact bucket sizes, where nothing is padded; so replay the
        caller's example, padded, once through :meth:`_output` (learn the cuts, check the padding)."""
        named = [(n, leaf) for n, leaf in self._leaves(args, kwargs) if isinstance(leaf, torch.Tensor)]
        targets = [self._target_shape(t) for _, t in named]
        if any(tg is None for tg in targets) or all(tuple(t.shape) == tg for (_, t), tg in zip(named, targets, strict=True)):
            return
        entry = self._graphs[_graph_key(named, targets)]
        self._load(entry, named)
        entry.graph.replay()
        self._output(entry, args, kwargs, named, targets)

    def _capture(self, args: tuple, kwargs: dict, leaves: list[tuple[str, Any]],
                 named: list[tuple[str, torch.Tensor]], targets: list[tuple[int, ...]], autocast: tuple) -> _Graph:
        t_start = time.perf_counter()
        static_inputs = []
        for (name, t), tg in zip(named, targets, strict=True):
            buf = torch.empty(tg, dtype=t.dtype, device=t.device)
            _copy_padded(buf, t.detach(), self._pad_of(name))
            static_inputs.append(buf)
        s_args, s_kwargs = _substitute(self._names[(len(args), tuple(kwargs))], args, kwargs, static_inputs)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()

        kept: dict[str, Any] = {}

        def keep_reference(out: Any) -> None:
            if self.validate:
                kept["expected"] = tree_map(torch.clone, out)

        pool_before = pool_reserved_bytes(self._pool)
        graph, static_out = capture_graph(lambda: self._call(*s_args, **s_kwargs), warmup=self.warmup,
                                          pool=self._pool, on_last_warmup=keep_reference, what=repr(self))
        expected = kept.get("expected")
        pool_bytes = max(0, pool_reserved_bytes(self._pool) - pool_before)

        rel = None
        if self.validate:
            graph.replay()
            torch.cuda.synchronize()
            rel = max_rel_error(static_out, expected)
            rtol = self._rtol_for(static_out, {t.dtype for _, t in named})
            if not rel <= rtol:
                raise CaptureError(
                    f"replay of the captured graph differs from eager: max relative error {rel:.3g} > "
                    f"rtol {rtol:.3g}. Likely cause: data-dependent work that the graph froze at capture "
                    f"(randomness such as dropout in training mode, a value read on the CPU during "
                    f"capture). Call model.eval(), keep control flow on the GPU (torch.where), or raise "
                    f"rtol if the difference is numerical noise.", max_rel_error=rel, cause="baked_value")

        opaque = sorted({type(v).__name__ for _, v in tree_leaves(static_out)
                         if not isinstance(v, torch.Tensor) and not _is_plain(v)})
        if opaque:
            warnings.warn(
                f"{self!r}: the outputs hold {', '.join(opaque)}, which GraphRunner cannot look inside: tensors "
                f"in them are static buffers that each replay overwrites, never cloned, cut back or validated "
                f"(a transformers cache, say: pass use_cache=False). Return plain tensors, tuples, lists, "
                f"dicts or dataclasses instead.", stacklevel=4)
        out_bytes = sum(t.numel() * t.element_size() for _, t in tree_leaves(static_out)
                        if isinstance(t, torch.Tensor))
        signature = ", ".join(f"{n}:{tg} {str(t.dtype).replace('torch.', '')}"
                              for (n, t), tg in zip(named, targets, strict=True))
        if autocast[0]:
            signature += f" (autocast {str(autocast[1]).replace('torch.', '')})"
        info = GraphInfo(signature=signature, capture_ms=(time.perf_counter() - t_start) * 1e3,
                         pool_bytes=pool_bytes,
                         static_input_bytes=sum(t.numel() * t.element_size() for t in static_inputs),
                         static_output_bytes=out_bytes, max_rel_error=rel)
        # The validation replay consumed the static inputs already holding this call's data, so
        # __call__'s replay below just recomputes the same answer: cheap, and keeps one code path.
        # A padded call is checked against eager at its own shapes there too (_output).
        return _Graph(graph, static_inputs, static_out, info)

    def _check_padding(self, replayed: Any, expected: Any, rtol: float) -> None:
        """Compare a padded replay, already cut back (``_output``), with eager at the caller's shapes."""
        try:
            rel = max_rel_error(replayed, expected)
        except InputError as exc:  # e.g. a non-tensor output that depends on the length
            raise CaptureError(f"padding to the bucket changed the outputs: {exc}; use buckets only for "
                               f"dims that the outputs keep (cut back) or drop as a whole",
                               cause="padding") from exc
        if not rel <= rtol:
            raise CaptureError(
                f"padding to the bucket changed the result on the real positions: max relative error "
                f"{rel:.3g} > rtol {rtol:.3g} against an eager call at the caller's shapes. The model "
                f"reads the padded positions (for attention: pass an attention mask, padded with 0, "
                f"e.g. pad_value={{'attention_mask': 0}}); use buckets only for dims that padding "
                f"leaves alone.", max_rel_error=rel, cause="padding")


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a nest, in the order :func:`tree_map` visits them."""
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) or t, out)  # keep the tensors in place: a rebuilt dataclass may read them
    return found


def _learn_cuts(replayed: Any, expected: Any,
                padded: dict[int, tuple[int, int]]) -> tuple[dict[int, list[tuple[int, ...]]], set[int]]:
    """For each padded input dim ``k`` (``padded[k] = (bucket, caller's length)``): per output tensor,
    the dims whose size is the bucket in the padded replay and the caller's length in eager.

    Returns:
        ``(cuts, ambiguous)``: ``cuts[k][i]`` the dims of output tensor ``i`` to cut with input dim
        ``k``; ``ambiguous`` the input dims that share their (bucket, length) pair with another padded
        dim that an output dim follows, so that this call cannot tell which of them it follows.

    Raises:
        CaptureError: ``cause="padding"``: an output differs from eager in structure, rank, a plain
            value (a length returned as a number), or a size that cutting the padding off cannot
            restore (e.g. a length that is not the input's).
    """
    got, want = _tensors(replayed), _tensors(expected)
    paths = [p for p, leaf in tree_leaves(replayed) if isinstance(leaf, torch.Tensor)]
    if len(paths) != len(got):
        paths = [f"output tensor {i}" for i in range(len(got))]

    def fail(why: str) -> CaptureError:
        return CaptureError(f"padding to the bucket changed the outputs beyond what cutting the padding "
                            f"off restores: {why}; use buckets only for dims that the outputs keep (cut "
                            f"back) or drop as a whole", cause="padding")

    if len(got) != len(want):
        raise fail(f"{len(got)} output tensors padded vs {len(want)} at the caller's shapes")
    values = [(p, v) for p, v in tree_leaves(replayed) if not isinstance(v, torch.Tensor)]
    wanted = [v for _, v in tree_leaves(expected) if not isinstance(v, torch.Tensor)]
    for (path, v), w in zip(values, wanted, strict=False):  # e.g. a length returned as a number
        if _is_plain(v) and _is_plain(w) and not _same_value(v, w):
            raise fail(f"{path} is {v!r} padded vs {w!r} at the caller's shapes")
    cuts: dict[int, list[tuple[int, ...]]] = {k: [] for k in padded}
    ambiguous: set[int] = set()
    for path, a, e in zip(paths, got, want, strict=True):
        if a.dim() != e.dim():
            raise fail(f"{path} has {a.dim()} dims padded vs {e.dim()} at the caller's shapes")
        follows: dict[int, list[int]] = {k: [] for k in padded}
        for d, (size_padded, size_eager) in enumerate(zip(a.shape, e.shape, strict=True)):
            if size_padded == size_eager:
                continue
            ks = [k for k, pair in padded.items() if pair == (size_padded, size_eager)]
            if not ks:
                raise fail(f"{path} dim {d} is {size_padded} padded vs {size_eager} at the caller's shapes")
            if len(ks) > 1:
                ambiguous.update(ks)
            follows[ks[0]].append(d)
        for k in padded:
            cuts[k].append(tuple(follows[k]))
    return cuts, ambiguous


def _apply_cuts(out: Any, cuts: dict[int, list[tuple[int, ...]]], padded: dict[int, tuple[int, int]],
                clone: bool = False) -> Any:
    """Narrow each output tensor along the dims learned by :func:`_learn_cuts` to the caller's lengths
    (and clone the result, with ``clone``)."""
    index = itertools.count()

    def cut(x: torch.Tensor) -> torch.Tensor:
        i = next(index)
        for k, (_, real) in padded.items():
            for d in cuts[k][i]:
                x = x.narrow(d, 0, real)
        return x.clone() if clone else x

    return tree_map(cut, out)


def _autocast_state() -> tuple:
    """CUDA autocast as it is now: ``(False,)``, or ``(True, dtype)``. Kernels captured under autocast
    keep the dtypes it chose, so a call under another autocast state needs a graph of its own (else
    an fp32 call would silently get fp16 results, or the other way round)."""
    if torch.is_autocast_enabled("cuda"):
        return True, torch.get_autocast_dtype("cuda")
    return (False,)


def _graph_key(named: list, targets: list) -> tuple:
    """Which graph serves a call: the (padded) shape and dtype of every tensor argument, then the
    autocast state (last)."""
    return (*((tg, t.dtype) for tg, (_, t) in zip(targets, named, strict=True)), _autocast_state())


def _substitute(names: list, args: tuple, kwargs: dict, static_inputs: list) -> tuple[tuple, dict]:
    """The call's arguments with every tensor replaced by its static buffer, in the order the buffers
    were made (parameter by parameter, as ``_leaves`` lists them). By position, not by tensor
    identity: ``runner(x, x)`` must give the graph two buffers, or a later ``runner(p, q)`` would
    compute ``f(q, q)``."""
    buffers = iter(static_inputs)
    s_args, s_kwargs = list(args), dict(kwargs)
    for _, (kind, k) in names:
        target = s_args if kind == "a" else s_kwargs
        target[k] = tree_map(lambda _t: next(buffers), target[k])
    return tuple(s_args), s_kwargs


def _call_pattern(leaves: list[tuple[str, Any]]) -> tuple:
    """What makes two calls equivalent for the input check: each argument's name and kind, and for
    tensors dtype, rank and device (shapes pick the graph; they are not part of the check)."""
    return tuple((n, type(leaf), leaf.dtype, leaf.dim(), leaf.device) if isinstance(leaf, torch.Tensor)
                 else (n, type(leaf), _pattern_value(leaf)) for n, leaf in leaves)


def _pattern_value(v: Any) -> Any:
    # NaN never equals itself and arrays compare elementwise: give both a form that == handles, so a
    # repeated call with such a value is recognised instead of piling up new patterns.
    if isinstance(v, float) and math.isnan(v):
        return ("nan",)
    if type(v).__module__ == "numpy" and hasattr(v, "tobytes"):
        return ("numpy", str(getattr(v, "dtype", "")), getattr(v, "shape", ()), v.tobytes())
    return v


def _copy_padded(buf: torch.Tensor, t: torch.Tensor, pad: float) -> None:
    """Copy ``t`` into the leading corner of ``buf`` and fill the rest with ``pad``."""
    if buf.shape == t.shape:
        buf.copy_(t)
        return
    buf.fill_(pad)
    buf[tuple(slice(0, n) for n in t.shape)].copy_(t)


def _check_bucket_spec(buckets: Any) -> dict[int, tuple[int, ...]]:
    if buckets is None:
        return {}
    if not isinstance(buckets, dict):
        raise InputError(f"buckets must be a dict {{dim: sizes}}, e.g. {{1: (128, 256, 512)}}, got {buckets!r}")
    out = {}
    for dim, sizes in buckets.items():
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise InputError(f"buckets keys are tensor dims (ints >= 0), got {dim!r}")
        try:
            vals = tuple(sizes)
        except TypeError:
            vals = ()
        if not vals or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in vals):
            raise InputError(f"buckets[{dim}] must be a non-empty sequence of positive ints, got {sizes!r}")
        out[dim] = tuple(sorted(set(vals)))
    return out


class _Marker(tuple):
    """("a", index) or ("k", name): where an argument leaf comes from; a tuple subclass so that
    *args binding (a tuple of markers) can be told apart from one marker."""


def _param_names(fn: Callable[..., Any], n_args: int, kw_names: tuple) -> list[tuple[str, tuple]]:
    """Parameter name and source of every argument for one call pattern, for error messages."""
    target = fn.forward if isinstance(fn, nn.Module) else fn
    fallback = [(f"args[{i}]", ("a", i)) for i in range(n_args)] + [(k, ("k", k)) for k in kw_names]
    positional = [_Marker(("a", i)) for i in range(n_args)]
    keywords = {k: _Marker(("k", k)) for k in kw_names}
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return fallback
    # bind_partial, not bind: a call that leaves out an argument still gets its real names, so that an
    # error about the missing one names it (and not every argument as args[i]).
    try:
        bound = sig.bind_partial(*positional, **keywords).arguments
    except TypeError:  # an unknown keyword: name the positionals, keep the keywords' own names
        try:
            bound = sig.bind_partial(*positional).arguments
        except TypeError:
            return fallback
        if set(bound) & set(keywords):
            return fallback
        bound = {**bound, **keywords}
    out: list[tuple[str, tuple]] = []
    for name, v in bound.items():
        if isinstance(v, _Marker):
            out.append((name, tuple(v)))
        elif isinstance(v, tuple):  # *args
            out += [(f"{name}[{j}]", tuple(m)) for j, m in enumerate(v)]
        elif isinstance(v, dict):  # **kwargs
            out += [(k, tuple(m)) for k, m in v.items()]
    return out


def _named_leaves(names: list[tuple[str, tuple]], args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Every argument leaf as ``(name, leaf)``, named after its parameter (``names`` from :func:`_param_names`)."""
    return [leaf for name, (kind, k) in names
            for leaf in tree_leaves(args[k] if kind == "a" else kwargs[k], name)]


def _bind_names(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Name each argument leaf after the parameter it binds to, for error messages."""
    return _named_leaves(_param_names(fn, len(args), tuple(kwargs)), args, kwargs)
