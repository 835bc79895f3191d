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
            # id(), not a weak reference to the tensor: torch.utils.swap_tensors (what conversions use under
            # torch.__future__.set_swap_module_params_on_conversion(True)) refuses tensors with weak references
            self.captured[name] = (id(t), weakref.ref(storage), t.data_ptr(), t.dtype, t.device, t.shape)
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
            if t is not None and (id(t) != tensor or storage() is None or t.data_ptr() != ptr
                                  or (t.dtype, t.device, t.shape) != (dtype, device, shape)):
                changed.append(name)
        if not changed:
            self.seen = _events[0]  # an unrelated event (another module built, a tensor of another model freed)
        return changed


def _split_prefix(unexpected: list[str], own: Mapping[str, Any]) -> str | None:
    """A prefix whose removal maps every unexpected key onto the module's (DataParallel's ``module.``,
    torch.compile's ``_orig_mod.``), or None."""
    first = unexpected[0]
    for cut in range(1, len(first)):
        prefix = first[:cut]
        if first[cut - 1] == "." and all(k.startswith(prefix) and k[cut:] in own for k in unexpected):
            return prefix
    return None


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@torch.no_grad()
def load_in_place(module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> int:
    """Copy ``state_dict``'s tensors into ``module``'s existing parameters and buffers, so that graphs
    captured from it read the new values on their next replay (nothing is captured again).

    Unlike ``module.load_state_dict(sd)``, which casts silently, a dtype that differs from the module's
    tensor is refused: the graph's kernels were chosen for that dtype. Extra state (``*._extra_state``
    entries, from ``get_extra_state``) is handed to the submodule's ``set_extra_state``, as
    ``load_state_dict`` does.

    Args:
        module: the captured module.
        state_dict: name -> tensor, as from ``model.state_dict()`` (any device: copied to the tensor's device;
            dense tensors only).
        strict: (bool) every parameter and buffer of ``module`` must be given, and nothing else. With
            ``False`` names the module lacks are skipped and a subset may be given, but a mapping none of
            whose names the module has is still refused (nothing would be loaded).

    Returns:
        the number of tensors copied.

    Raises:
        InputError: a key that is not a string, a name ``module`` lacks (``strict``) or one it has but was not
            given, a value that is not a dense tensor (meta, sparse), or a shape or dtype other than the
            module's tensor; nothing is copied then.
    """
    if not isinstance(state_dict, Mapping):
        raise InputError(f"state_dict must be a mapping of names to tensors (model.state_dict()), got "
                         f"{type(state_dict).__name__}")
    if not isinstance(strict, bool):
        raise InputError(f"strict must be True or False, got {strict!r}")
    not_str = [k for k in state_dict if not isinstance(k, str)]
    if not_str:
        raise InputError(f"state_dict keys must be parameter names (str), got {not_str[0]!r} "
                         f"({type(not_str[0]).__name__}); use model.state_dict() for the names")
    own = _tensors(module)
    full = module.state_dict(keep_vars=True)
    extra = {k for k, v in full.items() if not isinstance(v, torch.Tensor)}  # get_extra_state() entries
    unexpected = [k for k in state_dict if k not in own and k not in extra]
    missing = [k for k in full if k not in extra and k not in state_dict] if strict else []
    wrong, hints = [], []
    for k, v in state_dict.items():
        if k not in own:
            continue
        if not isinstance(v, torch.Tensor):
            wrong.append(f"{k}: {type(v).__name__}, not a tensor")
        elif v.layout != torch.strided or v.is_meta:
            wrong.append(f"{k}: a {'meta' if v.is_meta else str(v.layout).replace('torch.', '')} tensor, which "
                         f"holds no dense values to copy")
            hints.append("load real (dense) tensors, e.g. from a checkpoint file, not a meta or sparse state")
        elif v.shape != own[k].shape:
            wrong.append(f"{k}: shape {tuple(v.shape)}, the module's tensor is {tuple(own[k].shape)}")
            hints.append("the graphs were captured for the module's shapes: a model of another size needs a "
                         "runner of its own")
        elif v.dtype != own[k].dtype:
            wrong.append(f"{k}: {_short(v.dtype)}, the module's tensor is {_short(own[k].dtype)}")
            hints.append("convert them first (sd = {k: v.to(dtype) for k, v in sd.items()})")
    if unexpected and not strict and len(unexpected) < len(state_dict):
        unexpected = []  # strict=False skips names the module lacks, as load_state_dict does
    if unexpected:
        prefix = _split_prefix(unexpected, own)
        hints.append(f"the names carry a prefix {prefix!r} (a wrapped model's state_dict): strip it, "
                     f"{{k.removeprefix({prefix!r}): v for k, v in sd.items()}}" if prefix else
                     "compare the names with model.state_dict().keys()")
    if missing:
        hints.append("pass strict=False to load a subset")
    if unexpected or missing or wrong:
        lines = ([f"not in the module: {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else "")]
                 if unexpected else []) + ([f"missing (strict=True): {', '.join(missing[:5])}" +
                                            (" ..." if len(missing) > 5 else "")] if missing else []) + wrong[:5]
        raise InputError("cannot load these weights in place, nothing was copied:\n  " + "\n  ".join(lines) +
                         "\n" + "; ".join(dict.fromkeys(hints)))
    names = [k for k in state_dict if k in own]
    if names:
        torch._foreach_copy_([own[k] for k in names], [state_dict[k] for k in names])
    for k in (k for k in state_dict if k in extra):
        module.get_submodule(k.rpartition(".")[0]).set_extra_state(state_dict[k])
    return len(names)
