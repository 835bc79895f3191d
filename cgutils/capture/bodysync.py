"""What the body of a conditional node may not do: make the host wait for the GPU.

A body is captured into a graph that runs on the GPU, so it cannot wait for a value there; under capture on
torch 2.11 such a wait failed on the body's stream and the process crashed at the end of the capture (H200).
:class:`RefuseSyncs` is the TorchDispatchMode that :mod:`.control` runs bodies under, eagerly and while
capturing, to refuse those calls with an explanation first; :func:`waits_for_gpu` is its rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..diagnose import in_eager_only_sync
from ..errors import InputError


def _ops(names: list[tuple[str, str]]) -> set:
    aten = torch.ops.aten
    return {getattr(getattr(aten, op), overload) for op, overload in names
            if hasattr(aten, op) and hasattr(getattr(aten, op), overload)}


_READS = [("_local_scalar_dense", "default"), ("equal", "default"), ("is_nonzero", "default")]
_SHAPES = [("nonzero", "default"), ("masked_select", "default"), ("_unique", "default"), ("_unique2", "default"),
           ("unique_dim", "default"), ("unique_consecutive", "default"), ("bincount", "default")]
_INDEXING = [("index", "Tensor"), ("index_put", "default"), ("index_put_", "default"),
             ("_index_put_impl_", "default")]
_op_sets: dict[str, set] = {}


def waits_for_gpu(func: Any, args: tuple, kwargs: dict, *, on_gpu: Callable[[torch.Tensor], bool] | None = None
                  ) -> str | None:
    """Why the ATen call ``func(*args, **kwargs)`` makes the host wait for the GPU, or ``None``.

    Sees: reading a GPU value (``.item()``, ``bool``, ``torch.equal``), data-dependent output shapes
    (``nonzero``, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``,
    indexing with a boolean mask), copies from the GPU to pageable host memory and from pageable host memory
    to the GPU (a pinned buffer with ``non_blocking=True`` is asynchronous and allowed). Does not see syncs
    outside ATen calls (``torch.cuda.synchronize()``, ``Event.synchronize()``).

    Args:
        on_gpu: which tensors count as on the GPU (default: ``tensor.is_cuda``; tests pass another).
    """
    if not _op_sets:
        _op_sets.update(reads=_ops(_READS), shapes=_ops(_SHAPES), indexing=_ops(_INDEXING),
                        repeat=_ops([("repeat_interleave", "Tensor")]))
    gpu = on_gpu or (lambda t: t.is_cuda)

    def tensors(values: Any) -> list[torch.Tensor]:
        out = []
        for v in values:
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out += [t for t in v if isinstance(t, torch.Tensor)]
        return out

    on = [t for t in tensors((*args, *kwargs.values())) if gpu(t)]
    if not on:
        return None if func not in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) else _copy(
            func, args, kwargs, gpu)
    if func in _op_sets["reads"]:
        return "reads a GPU value on the host (.item(), bool(tensor), torch.equal)"
    if func in _op_sets["shapes"]:
        return f"{func} has an output shape that depends on the data"
    if func in _op_sets["repeat"] and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size has a data-dependent shape"
    if func in _op_sets["indexing"] and len(args) > 1 and any(
            t.dtype == torch.bool for t in tensors((args[1],)) if gpu(t)):
        return "indexing with a boolean mask has a data-dependent shape (a nonzero inside)"
    return _copy(func, args, kwargs, gpu)


def _copy(func: Any, args: tuple, kwargs: dict, gpu: Callable[[torch.Tensor], bool]) -> str | None:
    """A copy between host and GPU that waits: to or from pageable memory, or without non_blocking."""
    aten = torch.ops.aten
    if func is aten._to_copy.default and args and isinstance(args[0], torch.Tensor):
        device = kwargs.get("device")
        to_host = gpu(args[0]) and device is not None and torch.device(device).type == "cpu"
        to_gpu = not gpu(args[0]) and device is not None and torch.device(device).type == "cuda"
        if to_host:
            return "a copy from the GPU to host memory"
        if to_gpu and not (kwargs.get("non_blocking") and args[0].is_pinned()):
            return "a copy from pageable host memory to the GPU (pin it and pass non_blocking=True)"
    if func is aten.copy_.default and len(args) > 1 and all(isinstance(a, torch.Tensor) for a in args[:2]):
        dst, src = args[0], args[1]
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if gpu(src) and not gpu(dst) and not (non_blocking and dst.is_pinned()):
            return "a copy from the GPU to pageable host memory (copy into a pinned buffer with non_blocking=True)"
        if gpu(dst) and not gpu(src) and not (non_blocking and src.is_pinned()):
            return "a copy from pageable host memory to the GPU (pin it and pass non_blocking=True)"
    return None


def draws_random(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the ATen call draws random numbers on a CUDA device (ops tagged ``nondeterministic_seeded``:
    ``rand``, ``normal_``, ``dropout`` in training mode, ``multinomial``, ...; attention, RNN and dropout ops
    only with a non-zero dropout probability and in training). A captured kernel draws at a
    Philox offset fixed at capture plus a base that PyTorch advances once per replay (``CUDAGraph::replay``
    in aten/src/ATen/cuda/CUDAGraph.cpp, by the whole graph's increment), so a body repeated inside one replay
    repeats its draws."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    # the tag is on the op, not the call: attention, RNNs and dropout draw only when dropout is on
    schema = getattr(func, "_schema", None)
    arguments = schema.arguments if schema is not None else []
    named = {a.name: a.default_value for a in arguments if a.has_default_value()}  # dispatch omits defaults
    named.update({a.name: v for a, v in zip(arguments, args, strict=False)})
    named.update(kwargs)
    if named.get("train", named.get("training", True)) is False:
        return False
    p = named.get("dropout_p", named.get("dropout", named.get("p") if "dropout" in str(func) else None))
    if isinstance(p, (int, float)) and p == 0:
        return False
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device).type == "cuda"
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors:
        return any(t.is_cuda for t in tensors)
    return torch.get_default_device().type == "cuda"


class RefuseSyncs(TorchDispatchMode):
    """Refuse the tensor operations that make the host wait for a CUDA tensor (:func:`waits_for_gpu`). A
    dispatch mode applies to its own thread only, unlike ``torch.cuda.set_sync_debug_mode``."""

    def __init__(self, loop: bool = False):
        """Args: loop: the body repeats inside one replay (a WHILE node's, or nested in one): random draws are
        refused too (:func:`draws_random`)."""
        super().__init__()
        self.loop = loop

    # torch.cond, flex_attention and other higher-order operators pass through (unchecked) instead of raising
    # "no rule registered for HigherOrderOperator"
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # torch.compile inside a body still compiles (its inner ops are not checked)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        why = None if in_eager_only_sync() else waits_for_gpu(func, args, kwargs)
        if why is not None:
            raise InputError(
                f"a conditional node's body made the host wait for the GPU: {why}. The body runs on the GPU and "
                f"cannot wait for the host: keep .item(), bool(tensor), data-dependent shapes, printing and "
                f"host copies out of it (cgutils.find_sync_points(body) lists them)")
        if self.loop and draws_random(func, args, kwargs):
            raise InputError(
                f"a WHILE node's body draws random numbers ({func}): under capture the body is one captured "
                f"kernel sequence with one random offset, so every iteration of a replay would draw the same "
                f"numbers (eagerly they differ). Draw them before the loop, e.g. one (max_iters, ...) tensor "
                f"indexed by a GPU step counter, or pass a precomputed noise buffer")
        return func(*args, **kwargs)
