"""Which buckets to capture for a traffic sample: the ladder that minimises expected latency, padding included,
under a memory budget or a bucket count.

Each request of size ``n`` (tokens, batch rows) runs in the smallest captured bucket ``b >= n`` and costs that
bucket's replay time; a request above the largest bucket runs eagerly (``eager_ms``) or is not allowed. With the
candidate sizes sorted, the requests a bucket serves are exactly those between it and the next smaller chosen
bucket, so the best ladder is found exactly by dynamic programming over (largest bucket so far, memory used):
``O(candidates² × memory steps)`` array operations. Memory is what each graph adds (GraphRunner's
``stats.graphs[i].memory_bytes`` when the ladder is captured largest first, as ``capture_buckets`` does), rounded
up to ``memory_budget / steps``, so a plan never exceeds the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..errors import InputError


@dataclass
class BucketPlan:
    """A ladder chosen by :func:`plan_buckets`.

    Attributes:
        buckets: the sizes to capture, ascending.
        expected_ms: mean cost per request of the sample under the plan (ms).
        memory_bytes: summed memory of the chosen graphs (bytes, as given).
        padded_fraction: mean share of a request's bucket that is padding, ``(bucket - n) / bucket``.
        eager_requests: requests above the largest bucket (run eagerly).
        table: per bucket: ``bucket``, ``requests``, ``share``, ``mean_size``, ``replay_ms``, ``memory_bytes``.
    """

    buckets: tuple[int, ...]
    expected_ms: float
    memory_bytes: float
    padded_fraction: float
    eager_requests: int
    table: pd.DataFrame


def _as_function(what: str, value: Any, candidates: list[int] | None) -> Callable[[int], float]:
    if callable(value):
        return value
    if isinstance(value, Mapping):
        def look_up(size: int) -> float:
            if size not in value:
                raise InputError(f"{what} has no value for candidate size {size}: measure it, or leave it out of "
                                 f"candidates")
            return float(value[size])
        return look_up
    raise InputError(f"{what} must be a mapping {{size: value}} or a function of the size, got {type(value).__name__}")


def plan_buckets(lengths: Iterable[int], replay_ms: Mapping[int, float] | Callable[[int], float], *,
                 memory_bytes: Mapping[int, float] | Callable[[int], float] | None = None,
                 memory_budget: float | None = None, max_buckets: int | None = None,
                 candidates: Iterable[int] | None = None, eager_ms: Callable[[int], float] | None = None,
                 steps: int = 512) -> BucketPlan:
    """The bucket ladder that minimises the expected cost of the requests in ``lengths``.

    Args:
        lengths: a sample of request sizes (ints >= 1), e.g. prompt token counts from a log.
        replay_ms: replay time of a graph captured at each candidate size (ms): ``{size: ms}`` as measured
            (e.g. with :func:`cgutils.measure` on ``runner`` at each bucket), or a function of the size.
        memory_bytes: memory each candidate's graph adds (bytes); default 0 (no memory constraint).
        memory_budget: the most memory the chosen graphs may take together (bytes).
        max_buckets: the most buckets (graphs) to capture.
        candidates: sizes a bucket may have; default the keys of ``replay_ms`` when it is a mapping, else the
            distinct sizes in ``lengths``.
        eager_ms: cost of a request above the largest bucket, as a function of its size (ms); default: none
            allowed (the largest bucket must hold the largest request).
        steps: memory is counted in ``memory_budget / steps`` units, each graph's rounded up (default 512).

    Returns:
        :class:`BucketPlan`.

    Raises:
        InputError: an empty or non-positive sample, a bad option, no candidate that holds the largest request
            when ``eager_ms`` is not given, or no ladder within ``memory_budget`` / ``max_buckets``.
    """
    sizes = np.asarray(list(lengths))
    if sizes.size == 0 or not np.issubdtype(sizes.dtype, np.integer) or (sizes < 1).any():
        raise InputError("lengths must be a non-empty sample of request sizes, integers >= 1")
    if candidates is None:
        candidates = list(replay_ms) if isinstance(replay_ms, Mapping) else np.unique(sizes).tolist()
    cand = sorted({int(c) for c in candidates})
    if not cand or cand[0] < 1:
        raise InputError("candidates must be sizes >= 1")
    if max_buckets is not None and (not isinstance(max_buckets, int) or max_buckets < 1):
        raise InputError(f"max_buckets must be an int >= 1, got {max_buckets!r}")
    if memory_budget is not None and not (memory_budget > 0 and memory_bytes is not None):
        raise InputError("memory_budget needs memory_bytes (what each candidate's graph adds) and must be > 0")
    cost = _as_function("replay_ms", replay_ms, cand)
    mem = _as_function("memory_bytes", memory_bytes, cand) if memory_bytes is not None else (lambda _s: 0.0)
    if eager_ms is None and cand[-1] < sizes.max():
        raise InputError(f"the largest request ({int(sizes.max())}) is above every candidate (largest {cand[-1]}); "
                         f"add a larger candidate, or pass eager_ms for requests above the largest bucket")
    c_ms = np.array([cost(c) for c in cand], dtype=float)
    c_mem = np.array([mem(c) for c in cand], dtype=float)
    unit = memory_budget / steps if memory_budget is not None else None
    w = np.ceil(c_mem / unit).astype(int) if unit else np.zeros(len(cand), dtype=int)
    width = steps + 1 if unit else 1
    # requests per candidate interval: cum[j] = requests of size <= cand[j]
    cum = np.searchsorted(np.sort(sizes), cand, side="right")
    # best[k, j, m]: least total cost of the requests <= cand[j], served by buckets whose largest is cand[j], using
    # m memory units and k + 1 buckets (one layer, any number of buckets, without max_buckets)
    layers = min(max_buckets, len(cand)) if max_buckets else 1
    best = np.full((layers, len(cand), width), math.inf)
    back = np.full((layers, len(cand), width), -1, dtype=int)
    for j in range(len(cand)):
        if w[j] >= width:
            continue  # this graph alone is over the budget
        best[0, j, w[j]] = c_ms[j] * cum[j]  # the smallest bucket serves everything up to it
        for k in range(layers):
            src = k - 1 if max_buckets else 0  # the layer of the previous (smaller) bucket
            if (max_buckets and k == 0) or j == 0:
                continue
            prev = best[src, :j, : width - w[j]] + (c_ms[j] * (cum[j] - cum[:j]))[:, None]  # (i, m - w[j])
            i_best = np.argmin(prev, axis=0)
            value = prev[i_best, np.arange(prev.shape[1])]
            better = value < best[k, j, w[j]:]
            best[k, j, w[j]:][better] = value[better]
            back[k, j, w[j]:][better] = i_best[better]
    # the top bucket: one that holds the largest request, or any, with the requests above it run eagerly
    total = best.copy()
    if eager_ms is None:
        total[:, : int(np.searchsorted(cand, sizes.max())), :] = math.inf
    else:
        order = np.sort(sizes)
        tail = np.concatenate([np.cumsum([eager_ms(int(v)) for v in order[::-1]])[::-1], [0.0]])
        total += tail[np.searchsorted(order, cand, side="right")][None, :, None]  # eager cost of requests > cand[j]
    if not np.isfinite(total).any():
        raise InputError("no ladder fits memory_budget / max_buckets: raise the budget, or offer smaller candidates")
    k, j, m = (int(v) for v in np.unravel_index(np.argmin(total), total.shape))
    chosen = [cand[j]]
    while back[k, j, m] >= 0:
        i = int(back[k, j, m])
        m, j, k = m - w[j], i, (k - 1 if max_buckets else 0)
        chosen.append(cand[j])
    buckets = tuple(sorted(chosen))
    return _plan(sizes, buckets, cost, mem, eager_ms)


def _plan(sizes: np.ndarray, buckets: tuple[int, ...], cost: Callable, mem: Callable,
          eager_ms: Callable | None) -> BucketPlan:
    idx = np.searchsorted(buckets, sizes)  # the smallest bucket >= each request; len(buckets): none
    inside = idx < len(buckets)
    served = np.asarray(buckets)[idx[inside]]
    per_request = [cost(int(b)) for b in served] + ([eager_ms(int(v)) for v in sizes[~inside]] if eager_ms else [])
    rows = []
    for n, b in enumerate(buckets):
        mine = sizes[idx == n]
        rows.append({"bucket": b, "requests": len(mine), "share": len(mine) / len(sizes),
                     "mean_size": float(mine.mean()) if len(mine) else float("nan"), "replay_ms": cost(b),
                     "memory_bytes": mem(b)})
    return BucketPlan(buckets=buckets, expected_ms=float(np.mean(per_request)),
                      memory_bytes=float(sum(mem(b) for b in buckets)),
                      padded_fraction=float(np.mean((served - sizes[inside]) / served)) if inside.any() else 0.0,
                      eager_requests=int((~inside).sum()), table=pd.DataFrame(rows))
