"""Nested arguments and outputs: map over, flatten and compare the tensors in tuples, lists, dicts and
dataclasses (namedtuples and ``transformers.ModelOutput`` included), and with ``objects=True`` in plain
objects' attributes."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import InputError

# Never opened as plain objects: containers and dataclasses have rules of their own; modules, classes,
# functions and Python modules carry a __dict__ that reaches half the program (and parameters that are state,
# not values passed on)
_NOT_OBJECTS = (torch.Tensor, dict, list, tuple, type, nn.Module, types.ModuleType, types.FunctionType,
                types.MethodType, types.BuiltinFunctionType, functools.partial)


def tree_map(fn: Callable[[torch.Tensor], Any], obj: Any, objects: bool = False) -> Any:
    """Apply ``fn`` to every tensor in a nest of tuples, lists, dicts and dataclasses.

    Containers come back as the same type with the new items: a ``dict`` or ``list`` subclass as a shallow
    copy of the original (``copy.copy``, which keeps what its ``__init__`` set: a ``defaultdict``'s
    ``default_factory``, an ``OrderedDict``'s order, a ``transformers.ModelOutput``'s attributes) with
    its items replaced, else (an immutable subclass) as its constructor called with the items, as
    ``dict(items)``; a namedtuple through ``_make``; another tuple subclass (``torch.Size``,
    ``torch.return_types``) through its constructor called with the items, as ``tuple(items)``. A rebuilt
    container must hold exactly the new items. Other leaves are returned unchanged.

    With ``objects``, also a plain object (neither container, dataclass, module, class nor function) from
    whose attributes (``__dict__`` and ``__slots__``) a tensor can be reached, at any depth, through
    containers and other such objects: torchvision's ``ImageList``, detectron2's ``Instances`` (whose
    ``Boxes`` hold the tensor). It comes back as a shallow copy with those attributes mapped; an object
    from which no tensor can be reached comes back as itself.

    Raises:
        InputError: a container subclass cannot be rebuilt holding its new items (neither way above gives
            its type with exactly those items); or, with ``objects``, an object from which tensors are
            reached refers back to itself (a copy would still point at the original's tensors) or cannot be
            copied. The message names the type.
    """
    return _map(fn, obj, _Walk() if objects else None)


def tree_leaves(obj: Any, path: str = "output", objects: bool = False) -> list[tuple[str, Any]]:
    """Flatten a nest (as in :func:`tree_map`, ``objects`` likewise) into ``(path, leaf)`` pairs, paths like
    ``output[0]`` or ``output[0].tensors``. With ``objects``, an object from which no tensor can be reached
    is one leaf, and an object met again inside itself (a cycle) is a leaf there."""
    return _leaves(obj, path, set() if objects else None)


def holds_tensors(obj: Any) -> bool:
    """A plain object (see :func:`tree_map`'s ``objects``) from whose attributes a tensor can be reached."""
    return _fields(obj) is not None and any(isinstance(t, torch.Tensor) for _, t in _leaves(obj, "", set()))


@dataclasses.dataclass
class _Walk:
    """One ``tree_map(objects=True)``: tensors mapped so far (an object with none under it is left as it is,
    decided while mapping it, not by a second walk), the objects being mapped and those met again inside
    themselves."""

    found: int = 0
    active: set[int] = dataclasses.field(default_factory=set)
    cycled: set[int] = dataclasses.field(default_factory=set)


def _map(fn: Callable[[torch.Tensor], Any], obj: Any, walk: _Walk | None) -> Any:
    if isinstance(obj, torch.Tensor):
        if walk is not None:
            walk.found += 1
        return fn(obj)
    if walk is not None and (fields := _fields(obj)) is not None:
        return _map_object(fn, obj, fields, walk)
    if isinstance(obj, dict):
        return _rebuilt_dict(obj, {k: _map(fn, v, walk) for k, v in obj.items()})
    if isinstance(obj, (tuple, list)):
        return _rebuilt_sequence(obj, [_map(fn, v, walk) for v in obj])
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map(fn, getattr(obj, f.name), walk)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _map_object(fn: Callable[[torch.Tensor], Any], obj: Any, fields: dict[str, Any], walk: _Walk) -> Any:
    if id(obj) in walk.active:
        walk.cycled.add(id(obj))
        return obj
    walk.active.add(id(obj))
    before = walk.found
    try:
        mapped = {k: _map(fn, v, walk) for k, v in fields.items()}
    finally:
        walk.active.discard(id(obj))
    if walk.found == before:
        return obj
    name = type(obj).__qualname__
    if id(obj) in walk.cycled:
        raise InputError(
            f"a {name} whose attributes hold tensors refers back to itself through them; its copy with the "
            f"tensors mapped would still point at the original's. Return the tensors in a tuple, dict or "
            f"dataclass instead, or drop the back-reference.")
    try:
        new = copy.copy(obj)
    except Exception as exc:
        raise InputError(f"a {name} whose attributes hold tensors cannot be copied to map them "
                         f"(copy.copy raised {type(exc).__name__}: {exc}); give {name} a __copy__, or return its "
                         f"tensors in a tuple, dict or dataclass instead") from exc
    slots = _slots(type(obj))
    for k, v in mapped.items():
        if k in slots:
            slots[k].__set__(new, v)
        else:
            new.__dict__[k] = v  # as the original holds it: no __setattr__ or property in between
    return new


def _leaves(obj: Any, path: str, active: set[int] | None) -> list[tuple[str, Any]]:
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if active is not None and id(obj) not in active and (fields := _fields(obj)) is not None:
        active.add(id(obj))
        try:
            found = [p for k, v in fields.items() for p in _leaves(v, f"{path}.{k}", active)]
        finally:
            active.discard(id(obj))
        return found if any(isinstance(t, torch.Tensor) for _, t in found) else [(path, obj)]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _leaves(v, f"{path}[{k!r}]", active)]
    if isinstance(obj, (tuple, list)):
        return [p for i, v in enumerate(obj) for p in _leaves(v, f"{path}[{i}]", active)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [p for f in dataclasses.fields(obj) for p in _leaves(getattr(obj, f.name), f"{path}.{f.name}", active)]
    return [(path, obj)]


def _fields(obj: Any) -> dict[str, Any] | None:
    """A plain object's attributes (``__dict__`` entries, then set ``__slots__``), or ``None`` for anything else."""
    if isinstance(obj, _NOT_OBJECTS) or dataclasses.is_dataclass(obj):
        return None
    slots = _slots(type(obj))
    own = getattr(obj, "__dict__", None)
    if type(own) is not dict and not slots:
        return None
    fields = dict(own) if type(own) is dict else {}
    for name, slot in slots.items():
        try:
            fields[name] = slot.__get__(obj, type(obj))
        except AttributeError:  # a slot never set
            pass
    return fields


@functools.lru_cache(maxsize=1024)
def _slots(cls: type) -> dict[str, Any]:
    """``cls``'s ``__slots__`` over its MRO, by stored (mangled) name: their member descriptors."""
    found: dict[str, Any] = {}
    for c in cls.__mro__:
        names = c.__dict__.get("__slots__", ())
        for n in (names,) if isinstance(names, str) else names:
            stored = f"_{c.__name__.lstrip('_')}{n}" if n.startswith("__") and not n.endswith("__") else n
            if isinstance(c.__dict__.get(stored), types.MemberDescriptorType):
                found.setdefault(stored, c.__dict__[stored])
    return found


def _rebuilt_dict(obj: dict, mapped: dict) -> dict:
    if type(obj) is dict:
        return mapped
    # a copy first: it keeps what __init__ set, whatever arguments __init__ takes; an immutable subclass may
    # still be made by its constructor, which then must take the items as dict's does
    return _rebuilt(obj, mapped, [("copy.copy with the items set", lambda: _copy_set(obj, mapped.items())),
                                  (f"{type(obj).__name__}(items)", lambda: type(obj)(mapped))])


def _rebuilt_sequence(obj: tuple | list, items: list) -> tuple | list:
    kind = type(obj)
    if kind is list:
        return items
    if kind is tuple:
        return tuple(items)
    if isinstance(obj, list):
        return _rebuilt(obj, items, [("copy.copy with the items set", lambda: _copy_set(obj, [(slice(None), items)])),
                                     (f"{kind.__name__}(items)", lambda: kind(items))])
    if hasattr(kind, "_make"):  # a namedtuple: _make skips a __new__ that may take other arguments
        new = _rebuilt(obj, items, [(f"{kind.__name__}._make(items)", lambda: kind._make(items))])
    else:  # a structseq (torch.return_types), torch.Size: the constructor takes the items as tuple's does
        new = _rebuilt(obj, items, [(f"{kind.__name__}(items)", lambda: kind(items))])
    if getattr(obj, "__dict__", None):  # a subclass without __slots__ = (): what was set on it besides the items
        new.__dict__.update(obj.__dict__)
    return new


def _copy_set(obj: Any, items: Any) -> Any:
    new = copy.copy(obj)
    for k, v in items:
        new[k] = v  # through the subclass: ModelOutput keeps its attributes in step with its items
    return new


def _rebuilt(obj: Any, items: dict | list, attempts: list[tuple[str, Callable[[], Any]]]) -> Any:
    """The first of ``attempts`` that gives ``obj``'s type holding ``items`` (and nothing else).

    Raises:
        InputError: none did; the message names the type and what each attempt gave.
    """
    failed = []
    for how, build in attempts:
        try:
            new = build()
        except Exception as exc:
            failed.append(f"{how} raised {exc!r}")
            continue
        if type(new) is not type(obj):
            failed.append(f"{how} gave a {type(new).__qualname__}")
        elif not _holds(new, items):
            failed.append(f"{how} gave one holding other items")
        else:
            return new
    name = type(obj).__qualname__
    base = next(b.__name__ for b in (dict, list, tuple) if isinstance(obj, b))
    raise InputError(f"cannot rebuild a {name} (a {base} subclass) with its tensors replaced: {'; '.join(failed)}. "
                     f"Pass or return a plain dict, list, tuple, namedtuple or dataclass instead, or give {name} a "
                     f"__copy__ that keeps its items, or a constructor that takes them as {base}(items) does.")


def _holds(new: Any, items: dict | list) -> bool:
    if isinstance(items, dict):  # dict's own views: a subclass's __getitem__ may compute
        return list(dict.keys(new)) == list(items) and all(map(_same_item, dict.values(new), items.values()))
    return len(new) == len(items) and all(map(_same_item, new, items))


def _same_item(a: Any, b: Any) -> bool:
    """The item put in is the item held: the same tensor, an equal other value (torch.Size hands out new ints)."""
    return a is b or not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and same_value(a, b)


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nest, in the order :func:`tree_map` visits them."""
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) or t, obj)  # keep the tensors in place: a rebuilt dataclass may read them
    return found


def nbytes(obj: Any) -> int:
    """Bytes held by the tensors of a nest (``numel * element_size``, views counted whole)."""
    return sum(t.numel() * t.element_size() for _, t in tree_leaves(obj) if isinstance(t, torch.Tensor))


def is_plain(x: Any) -> bool:
    """A value with a meaningful ``==``: numbers, strings, None, torch dtypes/devices/sizes, numpy data."""
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)):
        return True
    return type(x).__module__ == "numpy"


def same_value(a: Any, b: Any) -> bool:
    """Equality for plain values that also holds for the same NaN twice and for equal numpy arrays."""
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


def opaque_types(obj: Any) -> list[str]:
    """Names of the leaf types in a nest that are neither tensors nor plain values (e.g. a transformers
    cache object): GraphRunner cannot clone, cut back or compare what they hold."""
    return sorted({type(v).__name__ for _, v in tree_leaves(obj) if not isinstance(v, torch.Tensor) and not is_plain(v)})
