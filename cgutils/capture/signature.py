"""A call's arguments: named after the parameters they bind to, checked against the first call, and
substituted by static buffers for capture."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from .nest import same_value, tree_leaves, tree_map


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


def check_inputs(specs: list[ArgSpec], reference: list[ArgSpec] | None, *, strict: bool = True,
                 device_type: str = "cuda") -> None:
    """Check the argument specs of a call against those of the first call.

    Args:
        specs: one :class:`ArgSpec` per argument leaf of the current call (``ArgSpec.of``).
        reference: specs from the first call, or ``None`` on the first call.
        strict: when true, a change of dtype or rank of a tensor argument is an error; when false it
            only leads to a new graph.
        device_type: the device type graphs replay on (``"cuda"``; the CPU simulation in the tests uses
            ``"cpu"``).

    Raises:
        InputError: a tensor on another device type; a changed set of arguments; a tensor that became a
            non-tensor or vice versa; a changed dtype, rank or device (strict); a changed non-tensor
            value. The message names the argument and the fix.
    """
    for s in specs:
        if s.is_tensor and s.device.type != device_type:
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
            if not same_value(s.value, r.value):
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


@dataclass
class Call:
    """One call's values, bound to names once and passed around together.

    Attributes:
        args, kwargs: the call as the caller made it.
        sources: per parameter, ``(name, ("a", index) | ("k", keyword))``: where its value comes from.
        leaves: every argument leaf as ``(name, leaf)``, e.g. ``("input_ids", tensor)``, ``("args[1]", 3)``.
    """

    args: tuple
    kwargs: dict
    sources: list[tuple[str, tuple]]
    leaves: list[tuple[str, Any]]

    @property
    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The tensor leaves as ``(name, tensor)``, in the order the static buffers are made."""
        return [(n, leaf) for n, leaf in self.leaves if isinstance(leaf, torch.Tensor)]

    def pattern(self) -> tuple:
        """What makes two calls equivalent for the input check: each argument's name and kind, and for
        tensors dtype, rank and device (shapes pick the graph; they are not part of the check)."""
        return tuple((n, type(leaf), leaf.dtype, leaf.dim(), leaf.device) if isinstance(leaf, torch.Tensor)
                     else (n, type(leaf), _pattern_value(leaf)) for n, leaf in self.leaves)

    def specs(self) -> list[ArgSpec]:
        return [ArgSpec.of(n, leaf) for n, leaf in self.leaves]

    def run(self, fn: Callable[..., Any]) -> Any:
        return fn(*self.args, **self.kwargs)

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> Call:
        """The same call with every tensor replaced by ``fn(tensor)`` (e.g. resized to a bucket)."""
        args, kwargs = tree_map(fn, self.args), tree_map(fn, self.kwargs)
        return Call(args, kwargs, self.sources, _named_leaves(self.sources, args, kwargs))

    def substitute(self, buffers: list[torch.Tensor]) -> tuple[tuple, dict]:
        """The call's arguments with every tensor replaced by its static buffer, in the order of
        :attr:`named`. By position, not by tensor identity: ``runner(x, x)`` must give the graph two
        buffers, or a later ``runner(p, q)`` would compute ``f(q, q)``."""
        it = iter(buffers)
        s_args, s_kwargs = list(self.args), dict(self.kwargs)
        for _, (kind, k) in self.sources:
            target = s_args if kind == "a" else s_kwargs
            target[k] = tree_map(lambda _t: next(it), target[k])
        return tuple(s_args), s_kwargs


class Binder:
    """Binds calls of ``fn`` to parameter names, once per call pattern.

    Binding with ``inspect`` costs tens of µs; the names depend only on the call pattern (how many
    positional arguments, which keywords), so each pattern is bound once and remembered.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._sources: dict[tuple, list[tuple[str, tuple]]] = {}

    def bind(self, args: tuple, kwargs: dict) -> Call:
        pattern = (len(args), tuple(kwargs))
        sources = self._sources.get(pattern)
        if sources is None:
            sources = self._sources[pattern] = _param_sources(self.fn, len(args), tuple(kwargs))
        return Call(args, kwargs, sources, _named_leaves(sources, args, kwargs))


def bind_names(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Name each argument leaf of ``fn(*args, **kwargs)`` after the parameter it binds to.

    Returns:
        ``[(name, leaf), ...]``, e.g. ``[("input_ids", tensor), ("attention_mask", tensor)]``; leaves
        nested in tuples, lists and dicts get paths like ``inputs[0]``. An argument that does not bind
        (an unknown keyword) keeps a positional name ``args[i]`` or its keyword.
    """
    return Binder(fn).bind(args, kwargs).leaves


def _pattern_value(v: Any) -> Any:
    # NaN never equals itself and arrays compare elementwise: give both a form that == handles, so a
    # repeated call with such a value is recognised instead of piling up new patterns.
    if isinstance(v, float) and math.isnan(v):
        return ("nan",)
    if type(v).__module__ == "numpy" and hasattr(v, "tobytes"):
        return ("numpy", str(getattr(v, "dtype", "")), getattr(v, "shape", ()), v.tobytes())
    return v


class _Marker(tuple):
    """("a", index) or ("k", name): where an argument leaf comes from; a tuple subclass so that
    *args binding (a tuple of markers) can be told apart from one marker."""


def _param_sources(fn: Callable[..., Any], n_args: int, kw_names: tuple) -> list[tuple[str, tuple]]:
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


def _named_leaves(sources: list[tuple[str, tuple]], args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    return [leaf for name, (kind, k) in sources
            for leaf in tree_leaves(args[k] if kind == "a" else kwargs[k], name)]
