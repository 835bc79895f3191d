"""Latency measurement: warm-up, then timed calls, reported as robust statistics in milliseconds.

On a CUDA device each call is bracketed by a pair of CUDA events recorded on the current stream, so
the time is the GPU-side span from the start of the first kernel the call issues to the end of its
last one, including any idle gaps between them (launch overhead shows up as such gaps). Without CUDA,
``time.perf_counter`` brackets each call. Warm-up calls are never timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .checks import check_int, require_cuda
from .errors import InputError


@dataclass(frozen=True)
class Timing:
    """Summary of repeated timed calls.

    Attributes:
        median_ms: median latency per call, ms.
        p10_ms: 10th percentile, ms.
        p90_ms: 90th percentile, ms.
        n: number of timed calls (warm-up excluded).
        clock: ``"cuda_event"`` or ``"perf_counter"``.
    """

    median_ms: float
    p10_ms: float
    p90_ms: float
    n: int
    clock: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return (f"{self.median_ms:.3f} ms median (p10 {self.p10_ms:.3f}, p90 {self.p90_ms:.3f}, "
                f"n={self.n}, {self.clock})")


def summarize(samples_ms: np.typing.ArrayLike, clock: str) -> Timing:
    """Reduce per-call samples (ms) to median, p10 and p90 (linear interpolation, numpy's default).

    Raises:
        InputError: if there are no samples or any is negative or not finite.
    """
    s = np.asarray(samples_ms, dtype=np.float64).ravel()
    if s.size == 0:
        raise InputError("no timing samples: measure() needs iters >= 1")
    if not np.all(np.isfinite(s)) or np.any(s < 0):
        raise InputError(f"timing samples must be finite and >= 0, got {s[~np.isfinite(s) | (s < 0)][:3]}")
    p10, med, p90 = np.percentile(s, [10, 50, 90])
    return Timing(float(med), float(p10), float(p90), int(s.size), clock)


def device_sync(device: torch.device | str | None = None) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU)."""
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type == "cuda":
        if torch.cuda.is_available():
            torch.cuda.synchronize(dev)


def measure(fn: Callable[[], Any], *, warmup: int = 10, iters: int = 100,
            device: torch.device | str | None = None) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``iters`` timed ones.

    Args:
        fn: a callable with no arguments; its result is discarded.
        warmup: calls made before timing starts (lazy initialisation, autotuning, caches).
        iters: timed calls, each timed on its own so the spread is real, not averaged away.
        device: ``"cuda"`` (default when CUDA is available) times with CUDA events on the current
            stream; ``"cpu"`` times with ``time.perf_counter``.

    Returns:
        Timing with median, p10, p90 in ms and n == iters.

    Raises:
        InputError: ``fn`` not callable; ``warmup``/``iters`` not ints or out of range; a device other
            than CUDA or CPU. Exceptions raised by ``fn`` propagate.
        NoCudaError: ``device="cuda"`` when no CUDA device is visible.
    """
    if not callable(fn):
        raise InputError(f"measure needs a callable with no arguments, e.g. lambda: model(x); got {type(fn).__name__}")
    check_int("warmup", warmup, minimum=0, why="untimed calls before timing starts")
    check_int("iters", iters, minimum=1, why="timed calls")
    try:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"unknown device {device!r}; use 'cuda' or 'cpu'") from exc
    if dev.type not in ("cuda", "cpu"):
        raise InputError(f"measure times on 'cuda' (CUDA events) or 'cpu' (perf_counter), not {dev.type!r}")
    if dev.type == "cuda":
        require_cuda("measure(device='cuda')", "use device='cpu'")

    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        samples = np.empty(iters)
        for i in range(iters):
            t0 = time.perf_counter()
            fn()
            samples[i] = (time.perf_counter() - t0) * 1e3
        return summarize(samples, "perf_counter")

    torch.cuda.synchronize(dev)  # the warm-up must not leak into the first timed call
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(dev)
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends, strict=False)], "cuda_event")
