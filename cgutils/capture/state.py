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


def owned_modules(fn: Callable[..., Any]) -> list[tuple[str, nn.Module]]:
    """The modules whose state a call of ``fn`` can change: ``fn`` itself, the module of a bound method,
    modules in a closure or ``functools.partial``; each with a display name (``model``, ``model.encoder``)."""
    roots: list[tuple[str, nn.Module]] = []
    target = fn.func if isinstance(fn, functools.partial) else fn
    if isinstance(target, nn.Module):
        roots.append((type(target).__name__, target))
    elif isinstance(getattr(target, "__self__", None), nn.Module):
        roots.append((type(target.__self__).__name__, target.__self__))
    for i, cell in enumerate(getattr(target, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, nn.Module):
            roots.append((target.__code__.co_freevars[i], value))
    seen: set[int] = set()
    out = []
    for root_name, root in roots:
        for name, m in root.named_modules():
            if id(m) not in seen:
                seen.add(id(m))
                out.append((f"{root_name}.{name}" if name else root_name, m))
    return out


def _closure_tensors(fn: Callable[..., Any]) -> list[tuple[str, torch.Tensor]]:
    target = fn.func if isinstance(fn, functools.partial) else fn
    cells = getattr(target, "__closure__", None) or ()
    names = getattr(getattr(target, "__code__", None), "co_freevars", ())
    out = []
    for name, cell in zip(names, cells, strict=False):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, torch.Tensor):
            out.append((name, value))
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
    """

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    rebound: list[tuple[str, nn.Module, str]] = field(default_factory=list)
    values: list[str] = field(default_factory=list)
    random: bool = False

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
        candidates = list(inputs) + _closure_tensors(fn) + [
            (f"{name}.{k}", t) for name, m in modules
            for k, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]]
        for name, t in candidates:
            if id(t) not in seen:
                seen.add(id(t))
                self._tensors.append((name, t, _version(t)))
        self._modules = modules
        self._attrs = _attributes(modules)
        self._offsets = _rng_offsets()

    def changes(self) -> Changes:
        tensors = [(n, t) for n, t, v in self._tensors if v is not None and _version(t) != v]
        now = _attributes(self._modules)
        rebound, values = [], []
        for key, (name, module, value) in now.items():
            before = self._attrs.get(key)
            if before is None or before[2] is not value:
                rebound.append((name, module, key[1]))
                if not any(isinstance(leaf, torch.Tensor) for _, leaf in tree_leaves(value)):
                    values.append(name)
        random = any(a is not None and a != b for a, b in zip(self._offsets, _rng_offsets(), strict=False))
        return Changes(tensors, rebound, values, random)


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
