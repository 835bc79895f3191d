"""NVTX ranges that also appear in torch.profiler traces, and per-module annotation.

An NVTX range (``nvtx.push_range``) shows in Nsight Systems but not in a torch.profiler trace, and a
``torch.profiler.record_function`` shows in the Chrome trace but not in Nsight. :class:`nvtx_range`
opens both under one name, so the same label marks the same code in both tools.
"""

from __future__ import annotations

import functools
import time
from contextlib import ContextDecorator
from typing import Any

import torch
from torch import nn

try:  # the nvtx package (NVIDIA's); torch.cuda.nvtx is the fallback
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - depends on the environment
    _nvtx = None


@functools.lru_cache(maxsize=1)
def _cuda() -> bool:
    # asked once: torch.cuda.is_available() costs about a microsecond, every range would pay it
    return torch.cuda.is_available()


def _push(name: str, color: str | None) -> bool:
    if not _cuda():
        return False  # no CUDA: nothing to see in Nsight, keep only the profiler range
    if _nvtx is not None:
        _nvtx.push_range(message=name, color=color)
    else:
        torch.cuda.nvtx.range_push(name)
    return True


def _pop() -> None:
    if _nvtx is not None:
        _nvtx.pop_range()
    else:
        torch.cuda.nvtx.range_pop()


# Objects told when a range opens or closes (:class:`cgutils.capture.inspect.NodeAttribution` while it
# watches a capture): they call range_enter(name) / range_exit(). Empty outside such a capture.
range_listeners: list[Any] = []


class nvtx_range(ContextDecorator):  # noqa: N801 - reads like the nvtx/torch functions it pairs
    """A named range seen by both Nsight Systems (NVTX) and torch.profiler (``record_function``).

    Usable as a context manager or a decorator::

        with cgutils.nvtx_range("decode", color="green"):
            step()

        @cgutils.nvtx_range("prefill")
        def prefill(...): ...

    Args:
        name: the range's label in both tools.
        color: NVTX colour name (``"green"``, ``"blue"``...) when the ``nvtx`` package is installed;
            ignored by the ``torch.cuda.nvtx`` fallback and by torch.profiler.

    Without CUDA only the torch.profiler range is opened. Ranges nest; each ``__exit__`` closes the
    innermost one opened by this object (use one object per thread).
    """

    def __init__(self, name: str, color: str | None = None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"nvtx_range needs a non-empty string name, got {name!r}")
        self.name, self.color = name, color
        self._stack: list[tuple[Any, bool]] = []

    def __enter__(self) -> nvtx_range:
        for listener in range_listeners:
            listener.range_enter(self.name)
        rf = torch.profiler.record_function(self.name)
        rf.__enter__()
        self._stack.append((rf, _push(self.name, self.color)))
        return self

    def __exit__(self, *exc: Any) -> None:
        rf, pushed = self._stack.pop()
        if pushed:
            _pop()
        rf.__exit__(*exc)
        for listener in range_listeners:
            listener.range_exit()


class ModuleAnnotations:
    """Hooks placed by :func:`annotate_modules`; ``remove()`` takes them all off again."""

    def __init__(self, handles: list, names: list[str]):
        self._handles, self.names = handles, names

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> ModuleAnnotations:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def annotate_modules(model: nn.Module, depth: int = 1, prefix: str | None = None,
                     color: str | None = None) -> ModuleAnnotations:
    """Wrap the forward of every submodule down to ``depth`` levels in an :class:`nvtx_range` named after
    it (e.g. ``BertModel.encoder.layer.3``), through forward pre- and post-hooks.

    Args:
        model: the module to annotate.
        depth: 0 annotates the model itself only; 1 its children too; and so on.
        prefix: label prefix; default the model's class name.
        color: NVTX colour for all ranges.

    Returns:
        :class:`ModuleAnnotations`; call ``.remove()`` (or use it as a context manager) to take the
        hooks off. A submodule shared under two names is annotated once, under its first name.
    """
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    prefix = prefix or type(model).__name__
    handles, names = [], []
    for name, mod in model.named_modules():
        level = 0 if name == "" else name.count(".") + 1
        if level > depth:
            continue
        label = prefix if name == "" else f"{prefix}.{name}"
        rng = nvtx_range(label, color)
        handles.append(mod.register_forward_pre_hook(lambda m, a, rng=rng: rng.__enter__() and None))
        close = lambda m, a, o, rng=rng: rng.__exit__(None, None, None)  # noqa: E731
        handles.append(mod.register_forward_hook(close, always_call=True))  # closes it when forward raises too
        names.append(label)
    return ModuleAnnotations(handles, names)


def range_overhead_us(iters: int = 20000) -> dict[str, float]:
    """CPU cost of entering and leaving one range with no profiler attached, µs per range.

    Returns:
        ``nvtx_range`` (ours: NVTX + record_function), ``record_function`` alone, and ``nvtx`` alone
        (NVTX push/pop; without CUDA only the cached availability check remains), each the median
        of 5 runs of ``iters`` ranges minus an empty loop.
    """
    import statistics

    def per_range(enter_exit) -> float:
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters):
                enter_exit()
            runs.append((time.perf_counter() - t0) / iters * 1e6)
        return statistics.median(runs)

    rng = nvtx_range("overhead")

    def ours():
        with rng:
            pass

    def rf():
        with torch.profiler.record_function("overhead"):
            pass

    def raw_nvtx():
        if _push("overhead", None):
            _pop()

    floor = per_range(lambda: None)
    return {"nvtx_range": per_range(ours) - floor, "record_function": per_range(rf) - floor,
            "nvtx": per_range(raw_nvtx) - floor}
