"""Nested arguments and outputs: map over, flatten and compare the tensors in tuples, lists, dicts and
dataclasses (namedtuples and ``transformers.ModelOutput`` included)."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch


def tree_map(fn: Callable[[torch.Tensor], Any], obj: Any, objects: bool = False) -> Any:
    """Apply ``fn`` to every tensor in a nest of tuples, lists, dicts and dataclasses.

    Handles namedtuples and ``transformers.ModelOutput`` (a dict subclass and a dataclass). With
    ``objects``, also a plain object whose attributes hold tensors (torchvision's ``ImageList``): a shallow
    copy with its attributes mapped (see :func:`holds_tensors`). Other leaves are returned unchanged.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if objects and holds_tensors(obj):
        new = copy.copy(obj)
        new.__dict__.update({k: tree_map(fn, v, objects) for k, v in vars(obj).items()})
        return new
    if isinstance(obj, dict):
        mapped = {k: tree_map(fn, v, objects) for k, v in obj.items()}
        try:
            return type(obj)(**mapped) if is_model_output(obj) else type(obj)(mapped)
        except TypeError:
            return mapped
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(tree_map(fn, v, objects) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map(fn, v, objects) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: tree_map(fn, getattr(obj, f.name), objects)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def tree_leaves(obj: Any, path: str = "output", objects: bool = False) -> list[tuple[str, Any]]:
    """Flatten a nest (as in :func:`tree_map`, ``objects`` likewise) into ``(path, leaf)`` pairs, paths like
    ``output[0]`` or ``output[0].tensors``."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if objects and holds_tensors(obj):
        return [p for k, v in vars(obj).items() for p in tree_leaves(v, f"{path}.{k}", objects)]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in tree_leaves(v, f"{path}[{k!r}]", objects)]
    if isinstance(obj, (tuple, list)):
        return [p for i, v in enumerate(obj) for p in tree_leaves(v, f"{path}[{i}]", objects)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [p for f in dataclasses.fields(obj) for p in tree_leaves(getattr(obj, f.name),
                                                                        f"{path}.{f.name}", objects)]
    return [(path, obj)]


def holds_tensors(obj: Any) -> bool:
    """A plain object (not a container, dataclass, module or class) with a tensor among its attributes, one
    level down or inside lists, tuples and dicts there: torchvision's ``ImageList`` (``.tensors``,
    ``.image_sizes``), which its detectors pass from one submodule to the next."""
    if (isinstance(obj, (torch.Tensor, dict, list, tuple, type, torch.nn.Module)) or dataclasses.is_dataclass(obj)
            or not hasattr(obj, "__dict__")):
        return False
    return any(isinstance(t, torch.Tensor) for v in vars(obj).values() for _, t in tree_leaves(v))


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nest, in the order :func:`tree_map` visits them."""
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) or t, obj)  # keep the tensors in place: a rebuilt dataclass may read them
    return found


def nbytes(obj: Any) -> int:
    """Bytes held by the tensors of a nest (``numel * element_size``, views counted whole)."""
    return sum(t.numel() * t.element_size() for _, t in tree_leaves(obj) if isinstance(t, torch.Tensor))


def is_model_output(obj: Any) -> bool:
    """True for a ``transformers.ModelOutput`` (checked by class name: transformers is optional here)."""
    return any(c.__name__ == "ModelOutput" for c in type(obj).__mro__)


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
