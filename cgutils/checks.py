"""Shared argument checks and message helpers: one wording for each kind of bad input.

Every check raises :class:`~cgutils.errors.InputError` (or :class:`~cgutils.errors.NoCudaError`) with a
message that names the argument, what it got, and what it takes.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from .errors import InputError, NoCudaError


def is_int(value: Any) -> bool:
    """True for a Python ``int`` that is not a bool (``True`` is an ``int`` in Python). NumPy and torch integer
    scalars are not ``int`` instances and give False: pass ``int(value)``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for an int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, minimum: int = 0, why: str = "") -> int:
    """Return ``value`` if it is an int (not a bool) ``>= minimum``.

    Raises:
        InputError: naming ``name``, the bound and ``why`` (what the number means), e.g.
            ``warmup must be an int >= 1 (lazy initialisation must not be captured), got 0``.
    """
    if not is_int(value) or value < minimum:
        reason = f" ({why})" if why else ""
        raise InputError(f"{name} must be an int >= {minimum}{reason}, got {value!r}")
    return value


def check_no_arg_callable(what: str, fn: Any) -> Any:
    """Return ``fn`` if it is callable; ``what`` names the caller (or the argument) in the error.

    Raises:
        InputError: e.g. ``measure needs a callable with no arguments, e.g. lambda: model(x); got Tensor``.
    """
    if not callable(fn):
        raise InputError(f"{what} needs a callable with no arguments, e.g. lambda: model(x); got {type(fn).__name__}")
    return fn


def check_index(name: str, value: Any, count: int, what: str) -> int:
    """Return ``value`` if it indexes one of ``count`` items (``0..count-1``, or negative from the end).

    Raises:
        InputError: naming ``name``, the range and ``what`` the items are, e.g.
            ``launch=5: the trace holds 2 graph launches (0..1, or negative from the end)``.
    """
    if not is_int(value) or not -count <= value < count:
        raise InputError(f"{name}={value!r}: {what} ({count} of them: 0..{count - 1}, or negative from the end)")
    return value


def check_sizes(name: str, sizes: Any, *, example: str = "(128, 256, 512)") -> tuple[int, ...]:
    """A non-empty collection of positive ints (bucket sizes), sorted and without repeats.

    Raises:
        InputError: not iterable, empty, or holding something other than positive ints (bools too).
    """
    try:
        vals = tuple(sizes)
    except TypeError:
        vals = ()
    if not vals or not all(is_int(b) and b > 0 for b in vals):
        raise InputError(f"{name} must be a non-empty sequence of positive ints, e.g. {example}, got {sizes!r}")
    return tuple(sorted(set(vals)))


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text.

    CUDA errors from PyTorch carry several lines of generic advice (``CUDA_LAUNCH_BLOCKING=1`` ...)
    that bury the point; callers keep the full exception (``.original``, ``raise ... from``).
    """
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def require_cuda(what: str, fix: str = "") -> None:
    """Raise :class:`NoCudaError` unless a CUDA device is visible.

    Args:
        what: the subject, phrased to precede "needs a CUDA device", e.g. ``"speedup_table"``.
        fix: what to do instead (appended after a semicolon), e.g. ``"the notebooks show the recorded table"``.
    """
    if not torch.cuda.is_available():
        tail = f"; {fix}" if fix else ""
        raise NoCudaError(f"{what} needs a CUDA device and none is visible "
                          f"(torch.cuda.is_available() is False){tail}")


_PACKAGE = str(Path(__file__).resolve().parent)


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside cgutils: the user's line that called in,
    however deep inside cgutils the warning is raised (a fixed ``stacklevel`` breaks when one more
    cgutils frame sits in between, e.g. ``capture_buckets`` calling ``__call__``)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the function that called warn_caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
