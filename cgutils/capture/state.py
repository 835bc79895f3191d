"""Caller-visible state around capture: which tensors a call updates in place, which module attributes
forward rebinds, whether it draws random numbers; snapshots to put each back as one eager call left it.

Warm-up and validation call the function several times; a function with state (a cache written in
place, a position counter held in a CUDA tensor, an input normalised in place, sampling) would see its
state advance once per extra call. GraphRunner watches the first warm-up call and, when it changed
anything, restores that state after every later call it makes, so the caller sees exactly one call.

Detection uses tensor version counters (``Tensor._version``, bumped by every in-place op, also under
``torch.no_grad()``; PyTorch docs, "Autograd mechanics: in-place correctness checks"), attribute
identity, and the default CUDA generators' offsets.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .nest import tree_leaves


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors (made under torch.inference_mode) keep no version counter
        return None


def _reachable(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """Objects a call of ``fn`` can reach without arguments, with a display name: ``fn`` itself, a bound
    method's object, the arguments of a ``functools.partial``, default values, closure cells, and the
    globals its code names."""
    out: list[tuple[str, Any]] = []
    if isinstance(fn, functools.partial):
        out += [(f"partial.args[{i}]", a) for i, a in enumerate(fn.args)]
        out += list(fn.keywords.items())
        fn = fn.func
    if isinstance(fn, nn.Module):
        return [*out, (type(fn).__name__, fn)]
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type):
        out.append((type(owner).__name__, owner))
    code = getattr(fn, "__code__", None)
    out += [(f"default[{i}]", v) for i, v in enumerate(getattr(fn, "__defaults__", None) or ())]
    out += list((getattr(fn, "__kwdefaults__", None) or {}).items())
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or (), strict=False):
        try:
            out.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    globs = getattr(fn, "__globals__", {})
    out += [(name, globs[name]) for name in getattr(code, "co_names", ()) if name in globs]
    return out


def _plain_object(value: Any) -> bool:
    return (hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module, types.ModuleType))
            and not callable(value))


def owned_modules(fn: Callable[..., Any]) -> list[tuple[str, nn.Module]]:
    """The modules whose state a call of ``fn`` can change, each with a display name (``model``,
    ``model.encoder``): ``fn`` itself and the modules it reaches (:func:`_reachable`), also as attributes of a
    plain object (a bound method's ``self``, say)."""
    roots = []
    for name, value in _reachable(fn):
        if isinstance(value, nn.Module):
            roots.append((name, value))
        elif _plain_object(value):
            roots += [(f"{name}.{k}", v) for k, v in vars(value).items() if isinstance(v, nn.Module)]
    seen: set[int] = set()
    out = []
    for root_name, root in roots:
        for name, m in root.named_modules():
            if id(m) not in seen:
                seen.add(id(m))
                out.append((f"{root_name}.{name}" if name else root_name, m))
    return out


def _loose_tensors(fn: Callable[..., Any]) -> list[tuple[str, torch.Tensor]]:
    """Tensors ``fn`` reaches outside modules: directly, or in a list, tuple, dict or plain object it reaches."""
    out = []
    for name, value in _reachable(fn):
        if isinstance(value, torch.Tensor):
            out.append((name, value))
            continue
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        elif _plain_object(value):
            items = vars(value).items()
        else:
            continue
        out += [(f"{name}[{k!r}]", v) for k, v in items if isinstance(v, torch.Tensor)]
    return out


def _attributes(modules: list[tuple[str, nn.Module]]) -> dict[tuple[int, str], tuple[str, nn.Module, Any]]:
    # Public instance attributes only: parameters, buffers and submodules live in nn.Module's own dicts
    # (_parameters, _buffers, _modules) and are watched as tensors; `training` is toggled by eval().
    return {(id(m), k): (f"{name}.{k}", m, v) for name, m in modules for k, v in vars(m).items()
            if not k.startswith("_") and k != "training"}


def _rng_generators() -> list[torch.Generator]:
    return [torch.cuda.default_generators[i] for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def rng_snapshot() -> list[tuple[torch.Generator, torch.Tensor]]:
    """The seed and offset of every default CUDA generator, restorable with :func:`rng_restore`.

    ``get_state``/``set_state`` copy seed and offset in and out of the generator's own state object.
    Installing another state object instead (``graphsafe_set_state``) would detach the generator from
    the graphs that registered it: their replays would stop following ``torch.cuda.manual_seed``."""
    return [(gen, gen.get_state()) for gen in _rng_generators()]


def rng_restore(snapshot: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for gen, state in snapshot:
        gen.set_state(state)


def _rng_offsets() -> list[int | None]:
    out = []
    for gen in _rng_generators():
        try:
            out.append(gen.get_offset())
        except (RuntimeError, AttributeError):
            out.append(None)
    return out


@dataclass
class Changes:
    """What one call changed.

    Attributes:
        tensors: ``(name, tensor)`` updated in place: inputs (by argument name), module parameters and
            buffers (``model.pos``), closure tensors.
        rebound: display names of module attributes that forward assigned (``model.hidden``).
        values: of those, the ones that hold no tensor (a Python counter, say): a replay runs no Python.
        random: whether the call drew from a default CUDA generator.
        rebound_buffers: registered buffers that forward replaced by new tensors (``self.pos = self.pos + 1``).
    """

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    rebound: list[tuple[str, nn.Module, str]] = field(default_factory=list)
    values: list[str] = field(default_factory=list)
    random: bool = False
    rebound_buffers: list[str] = field(default_factory=list)

    @property
    def stateful(self) -> bool:
        """Whether later calls must be undone to leave the state as one call left it."""
        return bool(self.tensors or self.random)


class StateWatch:
    """Remembers versions, attribute identities and generator offsets; :meth:`changes` says what moved.

    Args:
        fn: the function or module (see :func:`owned_modules`).
        inputs: the tensors the call receives, ``(argument name, tensor)``.
    """

    def __init__(self, fn: Callable[..., Any], inputs: list[tuple[str, torch.Tensor]]):
        modules = owned_modules(fn)
        seen: set[int] = set()
        self._tensors: list[tuple[str, torch.Tensor, int | None]] = []
        self._copies: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        params = {id(p) for _, m in modules for p in m.parameters(recurse=False)}
        candidates = list(inputs) + _loose_tensors(fn) + [
            (f"{name}.{k}", t) for name, m in modules
            for k, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]]
        for name, t in candidates:
            if id(t) in seen:
                continue
            seen.add(id(t))
            version = _version(t)
            if version is not None:
                self._tensors.append((name, t, version))
            elif id(t) not in params:
                # an inference tensor (made under torch.inference_mode) keeps no version counter: compare
                # values instead (inputs and buffers are small next to the weights, which are not copied)
                self._copies.append((name, t, t.clone()))
        self._modules = modules
        self._buffers = _buffer_ids(modules)
        self._attrs = _attributes(modules)
        self._offsets = _rng_offsets()

    def changes(self) -> Changes:
        tensors = [(n, t) for n, t, v in self._tensors if _version(t) != v]
        tensors += [(n, t) for n, t, copy in self._copies if not torch.equal(t, copy)]
        now = _attributes(self._modules)
        rebound, values = [], []
        for key, (name, module, value) in now.items():
            before = self._attrs.get(key)
            if before is None or before[2] is not value:
                rebound.append((name, module, key[1]))
                if not any(isinstance(leaf, torch.Tensor) for _, leaf in tree_leaves(value)):
                    values.append(name)
        buffers = _buffer_ids(self._modules)
        rebound_buffers = [name for key, (name, ident) in self._buffers.items() if buffers.get(key, (0, ident))[1] != ident]
        random = any(a is not None and a != b for a, b in zip(self._offsets, _rng_offsets(), strict=False))
        return Changes(tensors, rebound, values, random, rebound_buffers)


def _buffer_ids(modules: list[tuple[str, nn.Module]]) -> dict[tuple[int, str], tuple[str, int]]:
    return {(id(m), k): (f"{name}.{k}", id(t)) for name, m in modules for k, t in m.named_buffers(recurse=False)}


class Snapshot:
    """Copies of the tensors in ``tensors`` (and the generator states), restorable in place."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], random: bool):
        self.saved = [(t, t.detach().clone()) for _, t in tensors]
        self.rng = rng_snapshot() if random else []

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.saved:
                t.copy_(saved)
        rng_restore(self.rng)

    def values(self) -> list[torch.Tensor]:
        return [saved for _, saved in self.saved]

    def current(self) -> list[torch.Tensor]:
        return [t for t, _ in self.saved]
