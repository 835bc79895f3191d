"""One captured graph and how it is made: static input buffers, warm-up that leaves the caller's state
as one eager call would, capture, and the first replay checked against eager."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..checks import warn_caller
from ..errors import CaptureError, InputError
from .buckets import Buckets, Cuts, apply_cuts, copy_padded, learn_cuts
from .compare import check_first_replay, check_padding, max_rel_error, rtol_for
from .graph import CudaBackend
from .inspect import NodeAttribution
from .nest import nbytes, opaque_types, tree_map
from .signature import Call
from .state import Changes, Snapshot, StateWatch, rng_restore, rng_snapshot
from .stats import GraphInfo


@dataclass
class GraphEntry:
    """A captured graph with its static buffers.

    Attributes:
        graph: the ``torch.cuda.CUDAGraph`` (or the backend's stand-in); ``graph.replay()`` runs it.
        static_inputs: one buffer per tensor argument, at the (padded) captured shape.
        static_output: the outputs as captured; each replay rewrites their tensors in place.
        info: what :attr:`GraphRunner.stats` reports about this graph.
        changes: what the first warm-up call changed (in-place updates, rebound attributes, randomness).
        cuts: per padded input dim, the output dims that follow it (learned on the first padded call).
        mutated_inputs: indexes of ``static_inputs`` that ``fn`` updates in place: copied back to the
            caller's tensors after each replay, as an eager call would have changed them.
        attributes: ``(module, name, value)`` of tensor attributes that forward rebinds: set to the
            replayed value after each replay (the graph rewrites ``value`` in place).
        first_output: for a function with state, the first call's result, from the first warm-up call;
            that call is the caller's one eager call, so no replay follows it.
        attribution: with ``inspect``, the :class:`~cgutils.capture.inspect.NodeAttribution` that watched
            the capture (which module added each node); ``None`` otherwise.
    """

    graph: Any
    static_inputs: list[torch.Tensor]
    static_output: Any
    info: GraphInfo
    changes: Changes = field(default_factory=Changes)
    cuts: Cuts = field(default_factory=dict)
    mutated_inputs: list[int] = field(default_factory=list)
    attributes: list[tuple[nn.Module, str, Any]] = field(default_factory=list)
    first_output: Any = None
    attribution: Any = None

    def load(self, named: list[tuple[str, torch.Tensor]], buckets: Buckets) -> None:
        """Copy a call's tensors into the static inputs, padded up to the bucket."""
        load(self.static_inputs, named, buckets)

    def undo(self, named: list[tuple[str, torch.Tensor]]) -> Snapshot:
        """A snapshot of the state a call of this function changes, as the caller holds it (the caller's
        tensors in place of the static inputs): restore it to undo an extra eager call."""
        static = {id(b) for b in self.static_inputs}
        state = [(n, t) for n, t in self.changes.tensors if id(t) not in static]
        return Snapshot(state + [named[i] for i in self.mutated_inputs], self.changes.random)

    @torch.no_grad()
    def after_replay(self, named: list[tuple[str, torch.Tensor]], clone: bool, replayed: bool = True) -> None:
        """Make the caller's view match an eager call: inputs updated in place get the static buffers'
        values; after a replay (``replayed``), rebound attributes get the replayed tensors. (The first call
        of a function with state ran eagerly: its attributes are already that call's.)"""
        for i in self.mutated_inputs:
            t, buf = named[i][1], self.static_inputs[i]
            t.copy_(buf[tuple(slice(0, n) for n in t.shape)])
        for module, name, value in self.attributes if replayed else ():
            setattr(module, name, tree_map(torch.clone, value) if clone else value)

    def output(self, static: Any, padded: dict, clone: bool, eager: Callable[[], Any],
               rtol: Callable[[], float] | None) -> Any:
        """The static outputs, cut back along the padded input dims (``padded``, from
        :meth:`~cgutils.capture.buckets.Buckets.padded`) and cloned with ``clone``.

        The dims to cut are learned per graph by :func:`~cgutils.capture.buckets.learn_cuts` from the first call
        that pads each input dim, with one ``eager()`` call at the caller's shapes; with ``rtol`` (validation on: it
        returns the tolerance, computed only when needed) the same eager result checks that padding left the real positions alone.

        Raises:
            CaptureError: ``cause="padding"``: padding changed the result beyond ``rtol``.
        """
        if not padded:
            return tree_map(torch.clone, static) if clone else static
        if padded.keys() <= self.cuts.keys():
            return apply_cuts(static, self.cuts, padded, clone)
        expected = eager()
        learned, ambiguous = learn_cuts(static, expected, padded)
        out = apply_cuts(static, {**self.cuts, **learned}, padded, clone)
        if rtol is not None:
            check_padding(out, expected, rtol())
        # Stored only once checked (a call after a failed check must fail the same way), and only for
        # dims this call told apart: two padded dims with the same (bucket, length) are cut correctly
        # now, but which one an output dim follows is learned at a later call.
        self.cuts = {**{k: v for k, v in learned.items() if k not in ambiguous}, **self.cuts}
        return out



def load(static_inputs: list[torch.Tensor], named: list[tuple[str, torch.Tensor]], buckets: Buckets) -> None:
    for buf, (name, t) in zip(static_inputs, named, strict=True):
        copy_padded(buf, t.detach(), buckets.pad_of(name))


def capture_entry(run: Callable[..., Any], fn: Callable[..., Any], call: Call, targets: list[tuple[int, ...]],
                  *, buckets: Buckets, backend: CudaBackend, pool: Any, warmup: int, validate: bool,
                  rtol: float | None, what: str, signature: str, inspect: bool = False,
                  breaks: Any = None) -> GraphEntry:
    """Warm up, capture and (with ``validate``) check one graph for ``call`` at the (padded) ``targets``.

    The first warm-up call is watched (:class:`~cgutils.capture.state.StateWatch`). If it updated
    tensors in place or drew random numbers, the state it left is the caller's one eager call: every
    later warm-up, the validation and the capture are undone back to it, and its output becomes the
    first call's result. Validation of such a function compares a replay with an eager call from the
    same state and generator offsets, outputs and updated state both.

    Args:
        run: what to call (``fn``, or its ``torch.compile`` wrapper).
        fn: the caller's function or module, whose state is watched.
        call: the caller's call (:class:`~cgutils.capture.signature.Call`).
        targets: per tensor argument, the shape to capture at (padded to its bucket).
        signature: the graph's description for :class:`GraphInfo`.
        inspect: keep the graph and note which module added each node (``entry.attribution``).
        breaks: a :class:`~cgutils.capture.piecewise.BreakPlan` for piecewise capture, or ``None``.

    Raises:
        CaptureError: capture failed, or replay disagreed with eager (``cause`` ``"baked_value"``, or
            ``"state"`` when the updated state differs). The default CUDA generators are as before the
            call on this path.
    """
    t_start = time.perf_counter()
    named = call.named
    with torch.inference_mode(False):  # normal tensors: later calls outside inference_mode copy into them
        static_inputs = [torch.empty(tg, dtype=t.dtype, device=t.device) for (_, t), tg in zip(named, targets, strict=True)]
    load(static_inputs, named, buckets)
    s_args, s_kwargs = call.substitute(static_inputs)
    watch = StateWatch(fn, [(n, b) for (n, _), b in zip(named, static_inputs, strict=True)])
    rng_before = rng_snapshot()
    seen: dict[str, Any] = {}

    def on_warmup(i: int, out: Any) -> None:
        if i == 0:
            seen["changes"] = changes = watch.changes()
            seen["attrs"] = {(id(m), a): getattr(m, a) for _, m, a in changes.rebound}
            if changes.rebound_buffers:
                raise InputError(
                    f"{what}: forward rebinds {', '.join(changes.rebound_buffers)} to a new tensor (e.g. self.pos = "
                    f"self.pos + 1). A graph reads and writes the addresses it captured, so replays would never see "
                    f"the new value. Update it in place instead (self.pos.add_(1), self.pos.copy_(...)).")
            if buckets and changes.tensors:
                raise InputError(
                    f"{what}: the function updates {', '.join(n for n, _ in changes.tensors)} in place, and "
                    f"buckets pad its inputs: padded positions would be written into that state, which an eager "
                    f"call never writes. Drop buckets= for this function (one graph per shape), or keep the "
                    f"in-place update outside the graphed function. (Its first warm-up call has run once.)")
            if changes.stateful:
                seen["one_call"], seen["first"] = Snapshot(changes.tensors, changes.random), tree_map(torch.clone, out)
        elif "one_call" in seen:
            seen["one_call"].restore()
        if validate and i == warmup - 1 and "one_call" not in seen:
            seen["expected"] = tree_map(torch.clone, out)
        if i == warmup - 1:  # the capture syncs first anyway: the warm-up's end, timed where the GPU is done
            backend.synchronize()
            seen["t_warm"] = time.perf_counter()

    pool_before = backend.pool_bytes(pool)
    options: dict[str, Any] = {}  # only when asked: a backend without these features keeps working
    if inspect:
        options["inspect"] = NodeAttribution(fn)
    if breaks is not None:
        options["breaks"] = breaks
    try:
        graph, static_out = backend.capture(lambda: run(*s_args, **s_kwargs), warmup=warmup, pool=pool,
                                            on_warmup=on_warmup, what=what, **options)
        t_recorded = time.perf_counter()
        pool_bytes = max(0, backend.pool_bytes(pool) - pool_before)
        changes, one_call = seen["changes"], seen.get("one_call")
        # the tensors forward stored on self during capture: each replay rewrites them in place (read them
        # before validation, whose eager call stores tensors of its own)
        captured = {(id(m), a): getattr(m, a) for n, m, a in changes.rebound if n not in changes.values}
        if one_call is not None:
            one_call.restore()  # capture runs no kernels, but a backend that executes at capture would move it
            check_aliasing(call.named, [i for i, b in enumerate(static_inputs)
                                         if id(b) in {id(t) for _, t in changes.tensors}], what)
        rel = None
        if validate:
            rtol = rtol_for(static_out, rtol, {t.dtype for _, t in named})
            t_validate = time.perf_counter()
            rel = _validate(graph, static_out, run, s_args, s_kwargs, one_call, seen.get("expected"), rtol, backend)
            seen["validate_ms"] = (time.perf_counter() - t_validate) * 1e3
    except BaseException:
        # Leave what the caller sees as one eager call left it: the first warm-up's state and attributes
        # (the state before the call is not kept); generators as before the call.
        if "one_call" in seen:
            seen["one_call"].restore()
        for (_, module, name), value in zip(seen["changes"].rebound if "changes" in seen else [],
                                            seen.get("attrs", {}).values(), strict=False):
            setattr(module, name, value)
        rng_restore(rng_before)
        raise
    entry = GraphEntry(graph, static_inputs, static_out, GraphInfo(
        signature=signature, capture_ms=(time.perf_counter() - t_start) * 1e3, pool_bytes=pool_bytes,
        static_input_bytes=nbytes(static_inputs), static_output_bytes=nbytes(static_out), max_rel_error=rel,
        warmup_ms=(seen["t_warm"] - t_start) * 1e3 if "t_warm" in seen else None,
        record_ms=(t_recorded - seen.get("t_warm", t_start)) * 1e3, validate_ms=seen.get("validate_ms")),
        changes=changes, attribution=options.get("inspect"))
    mutated = {id(t) for _, t in changes.tensors}
    entry.mutated_inputs = [i for i, b in enumerate(static_inputs) if id(b) in mutated]
    entry.attributes = [(m, a, captured[(id(m), a)]) for n, m, a in changes.rebound if n not in changes.values]
    if one_call is not None:
        one_call.restore()
        entry.first_output = seen["first"]
    for _, module, name in changes.rebound:  # as the one call left them (the first call's own values)
        setattr(module, name, seen["attrs"][(id(module), name)])
    _warn_about(changes, static_out, what)
    return entry


def check_aliasing(named: list[tuple[str, torch.Tensor]], mutated: list[int], what: str) -> None:
    """Raise if an argument that the function updates in place shares memory with another argument.

    Raises:
        InputError: naming both arguments; each argument gets a static buffer of its own, so the update
            would not reach the other one as it does eagerly.
    """
    for i in mutated:
        name, t = named[i]
        ptr = t.untyped_storage().data_ptr()
        for j, (other, u) in enumerate(named):
            if j != i and u.untyped_storage().data_ptr() == ptr:
                raise InputError(
                    f"{what}: the function updates {name} in place, and {other} shares its memory (the same "
                    f"tensor or a view of it). A graph gives each argument a buffer of its own, so the update "
                    f"would not reach {other} as it does eagerly. Pass separate tensors (e.g. {other}.clone()).")


def _validate(graph: Any, static_out: Any, run: Callable[..., Any], s_args: tuple, s_kwargs: dict,
              one_call: Snapshot | None, expected: Any, rtol: float, backend: CudaBackend) -> float:
    """Replay once and compare with eager; for a function with state, from the same state both."""
    if one_call is None:
        graph.replay()
        backend.synchronize()
        return check_first_replay(static_out, expected, rtol)
    with torch.no_grad():
        expected = tree_map(torch.clone, run(*s_args, **s_kwargs))
    state_expected = [t.clone() for t in one_call.current()]
    one_call.restore()
    graph.replay()
    backend.synchronize()
    rel = check_first_replay(static_out, expected, rtol)
    state_rel = max_rel_error(one_call.current(), state_expected)
    if not state_rel <= rtol:
        raise CaptureError(
            f"the replay updates the function's state differently from eager (max relative error {state_rel:.3g} "
            f"> rtol {rtol:.3g}): an in-place update depends on a value frozen at capture (a Python number, a "
            f"CPU tensor). Keep that value in a CUDA tensor.", max_rel_error=state_rel, cause="state")
    return rel


def _warn_about(changes: Changes, static_out: Any, what: str) -> None:
    updated = [n for n, _ in changes.tensors]
    if updated:
        warn_caller(f"{what}: the function updates {', '.join(updated)} in place. GraphRunner keeps this as "
                      f"an eager call would: warm-up and validation are undone, inputs updated in place are "
                      f"copied back after each replay (a copy per call).")
    if changes.values:
        warn_caller(f"{what}: forward changes {', '.join(changes.values)}, which holds no tensor. A replay runs "
                      f"no Python, so it keeps the value it has after the first call; keep such state in a CUDA "
                      f"tensor (register_buffer) if replays must change it.")
    tensors = [n for n, _, _ in changes.rebound if n not in changes.values]
    if tensors:
        warn_caller(f"{what}: forward rebinds {', '.join(tensors)} to new tensors. After each replay GraphRunner "
                      f"sets them to the replayed tensors (cloned with clone_outputs), as an eager call would; "
                      f"with buckets they keep the padded shape.")
    opaque = opaque_types(static_out)
    if opaque:
        warn_caller(
            f"{what}: the outputs hold {', '.join(opaque)}, which GraphRunner cannot look inside: tensors in "
            f"them are static buffers that each replay overwrites, never cloned, cut back or validated (a "
            f"transformers cache, say: pass use_cache=False). Return plain tensors, tuples, lists, dicts or "
            f"dataclasses instead.")
