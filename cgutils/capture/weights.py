"""The parameters and buffers a captured graph reads, and whether they were replaced after capture.

A graph reads its weights at the addresses it was captured with. Loading new values *into* those tensors
(``model.load_state_dict(sd)``, ``param.copy_(...)``) is seen by the next replay; replacing the tensors is
not: ``load_state_dict(sd, assign=True)``, ``module.weight = nn.Parameter(...)``, a new buffer, and the
conversions that swap a tensor's storage (``.half()``, ``.to()``, ``.cuda()``: ``nn.Module._apply`` sets
``param.data``). Replays would then compute with the old weights (or read freed memory) without a word.

Checking every tensor's address on every call would cost tens of µs (BERT-base: 201 tensors), so the check
is driven by events and costs one integer comparison per call while nothing happens:

- torch's process-wide parameter and buffer registration hooks
  (``torch.nn.modules.module.register_module_parameter_registration_hook`` and the buffer one) fire on
  every ``setattr`` of a parameter or buffer, which ``assign=True`` uses;
- a weak reference to each captured tensor's storage fires when that storage is freed, which a conversion
  does to the old storage once nothing else holds it.

Either bumps a counter; a runner that sees the counter move compares its captured tensors with the
module's current ones (identity, storage, address, dtype, shape) and names what differs. What no event
reveals: a conversion while something else keeps the old storages alive (a ``state_dict()`` you kept):
the old tensors stay valid and the replay reads them. Load weights in place (:func:`load_in_place`) to
keep graphs and avoid both.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import InputError

_events = [0]  # bumped by the hooks and by dying storages; compared by every WeightWatch


def _bump(*_: Any) -> None:
    # Under torch.compile's tracing the increment would become a guard on the counter, which the next call has
    # moved: a recompile per call (transformers' decoders slice their ModuleList in forward, which registers
    # modules). What compiled code registers lives only inside its call, so nothing a graph reads is missed.
    if torch.compiler.is_compiling():
        return
    _events[0] += 1  # returns None: a registration hook's return value would replace the registered tensor


@functools.cache
def _install_hooks() -> tuple:
    hooks = nn.modules.module
    return (hooks.register_module_parameter_registration_hook(_bump),
            hooks.register_module_buffer_registration_hook(_bump),
            hooks.register_module_module_registration_hook(_bump))


def module_of(fn: Callable[..., Any]) -> nn.Module | None:
    """The module whose weights ``fn`` reads: ``fn`` itself, the module of a bound method (``model.forward``,
    ``model.generate``), or of a ``functools.partial`` of either; ``None`` for other functions."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by qualified name, tied ones under each of their names (as in state_dict)."""
    found = dict(module.named_parameters(remove_duplicate=False))
    found.update((n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None)
    return found


class WeightWatch:
    """What one module's parameters and buffers were at capture, and whether they are still those tensors.

    Args:
        module: the module a runner captured.

    Use :meth:`arm` after each capture and :meth:`replaced` before each replay.
    """

    def __init__(self, module: nn.Module):
        _install_hooks()
        self.module = module
        self.seen = -1
        self.captured: dict[str, tuple] = {}
        self._refs: list[weakref.ref] = []

    def arm(self) -> None:
        """Note the module's tensors as they are now (just captured)."""
        self.captured, self._refs = {}, []
        for name, t in _tensors(self.module).items():
            storage = t.untyped_storage()
            self.captured[name] = (weakref.ref(t), weakref.ref(storage), t.data_ptr(), t.dtype, t.device, t.shape)
            self._refs.append(weakref.ref(storage, _bump))
        self.seen = _events[0]

    def replaced(self) -> list[str]:
        """Names of the parameters and buffers replaced, converted, added or removed since :meth:`arm`;
        empty when none were (one integer comparison while no hook or storage has fired)."""
        if self.seen == _events[0]:
            return []
        now = _tensors(self.module)
        changed = [n for n in self.captured if n not in now] + [n for n in now if n not in self.captured]
        for name, (tensor, storage, ptr, dtype, device, shape) in self.captured.items():
            t = now.get(name)
            # a storage that died was replaced, even if the new one has its address
            if t is not None and (t is not tensor() or storage() is None or t.data_ptr() != ptr
                                  or (t.dtype, t.device, t.shape) != (dtype, device, shape)):
                changed.append(name)
        if not changed:
            self.seen = _events[0]  # an unrelated event (another module built, a tensor of another model freed)
        return changed


@torch.no_grad()
def load_in_place(module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> int:
    """Copy ``state_dict``'s tensors into ``module``'s existing parameters and buffers, so that graphs
    captured from it read the new values on their next replay (nothing is captured again).

    Unlike ``module.load_state_dict(sd)``, which casts silently, a dtype that differs from the captured
    tensor's is refused: the graph's kernels were chosen for that dtype.

    Args:
        module: the captured module.
        state_dict: name -> tensor, as from ``model.state_dict()`` (any device: copied to the tensor's device).
        strict: every parameter and buffer of ``module`` must be given, and nothing else.

    Returns:
        the number of tensors copied.

    Raises:
        InputError: a name ``module`` lacks or (``strict``) one it has but was not given, a value that is
            not a tensor, or a shape or dtype other than the existing tensor's; nothing is copied then.
    """
    if not isinstance(state_dict, Mapping):
        raise InputError(f"state_dict must be a mapping of names to tensors (model.state_dict()), got "
                         f"{type(state_dict).__name__}")
    own = _tensors(module)
    required = [k for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)]
    unexpected = [k for k in state_dict if k not in own]
    missing = [k for k in required if k not in state_dict] if strict else []
    wrong = [f"{k}: {type(v).__name__}, not a tensor" for k, v in state_dict.items()
             if k in own and not isinstance(v, torch.Tensor)]
    wrong += [f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}, the captured tensor is "
              f"{tuple(own[k].shape)} {str(own[k].dtype).replace('torch.', '')}" for k, v in state_dict.items()
              if k in own and isinstance(v, torch.Tensor) and (v.shape, v.dtype) != (own[k].shape, own[k].dtype)]
    if unexpected or missing or wrong:
        lines = ([f"not in the module: {', '.join(unexpected[:5])}"] if unexpected else []) + (
            [f"missing (strict=True): {', '.join(missing[:5])}"] if missing else []) + wrong[:5]
        raise InputError("cannot load these weights in place, nothing was copied:\n  " + "\n  ".join(lines) +
                         "\nConvert them first (sd = {k: v.to(dtype) ...}), or pass strict=False to load a subset")
    names = [k for k in state_dict if k in own]
    if names:
        torch._foreach_copy_([own[k] for k in names], [state_dict[k] for k in names])
    return len(names)
