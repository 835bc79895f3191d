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

PLAN_COLUMNS = ["bucket", "requests", "share", "mean_size", "replay_ms", "memory_bytes"]
"""Columns of :attr:`BucketPlan.table` (also when the plan is empty)."""


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


def _as_function(what: str, value: Any) -> Callable[[int], float]:
    """``value`` (a number, a mapping ``{size: value}`` or a function of the size) as a checked function: every
    value it gives is a finite number >= 0."""
    if isinstance(value, bool) or value is None:
        raise InputError(f"{what} must be a number, a mapping {{size: value}} or a function of the size, got {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        number = float(value)
        value = lambda _size: number  # noqa: E731 - one value for every size
    elif isinstance(value, Mapping):
        table = value
        if table and all(isinstance(k, str) for k in table):
            raise InputError(f"{what}'s keys are strings ({next(iter(table))!r}): sizes must be ints, e.g. "
                             f"{{int(k): v for k, v in {what}.items()}} after reading JSON")

        def value(size: int) -> float:
            if size not in table:
                raise InputError(f"{what} has no value for size {size}: "
                                 + ("a request above the largest bucket; give eager_ms for every request size, or "
                                    "as one number or a function of the size" if what == "eager_ms" else
                                    "measure it, or leave it out of candidates"))
            return table[size]
    elif not callable(value):
        raise InputError(f"{what} must be a number, a mapping {{size: value}} or a function of the size, got "
                         f"{type(value).__name__}")
    fn = value

    def checked(size: int) -> float:
        try:
            given = fn(size)
        except InputError:
            raise
        except Exception as exc:  # the caller's function: name the size it failed on, keep its error as the cause
            raise InputError(f"{what}({size}) raised {type(exc).__name__}: {exc}") from exc
        try:
            v = float(given)
        except (TypeError, ValueError):
            v = math.nan
        if not (math.isfinite(v) and v >= 0):
            raise InputError(f"{what} for size {size} is {given!r}: it must be a finite number >= 0")
        return v
    return checked


def _sizes(what: str, values: Any) -> np.ndarray:
    """``values`` as a 1-D int64 array of sizes >= 1 (integral floats accepted), or an InputError saying why not."""
    if isinstance(values, (str, bytes)):  # iterable, but one size per character
        raise InputError(f"{what} must be an iterable of sizes (ints >= 1), got a {type(values).__name__}: "
                         f"{values!r:.40}; parse it first, e.g. [int(v) for v in text.split()]")
    try:
        items = list(values)
    except TypeError as exc:
        raise InputError(f"{what} must be an iterable of sizes (ints >= 1), got {type(values).__name__}") from exc
    if any(isinstance(v, (bool, np.bool_)) for v in items):
        raise InputError(f"{what} holds a bool; sizes are ints >= 1")
    try:
        arr = np.asarray(items, dtype=float)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{what} must be an iterable of sizes (ints >= 1), got {type(values).__name__}") from exc
    if arr.ndim != 1 or arr.size == 0:
        raise InputError(f"{what} must be a non-empty, flat sequence of sizes (ints >= 1)")
    if not np.isfinite(arr).all() or (arr != np.round(arr)).any() or (arr < 1).any():
        raise InputError(f"{what} must hold sizes that are integers >= 1")
    if (arr >= _MAX_SIZE).any():  # above it, float64 no longer holds every integer and int64 wraps
        raise InputError(f"{what} holds a size of {arr.max():.3g}: sizes must be below 2**53")
    return arr.astype(np.int64)


_MAX_SIZE = 2.0**53
_MAX_CELLS = 2**26  # table cells of the search (layers x candidates x memory units): about 1 GiB with back-pointers


def plan_buckets(lengths: Iterable[int], replay_ms: Mapping[int, float] | Callable[[int], float], *,
                 memory_bytes: Mapping[int, float] | Callable[[int], float] | None = None,
                 memory_budget: float | None = None, max_buckets: int | None = None,
                 candidates: Iterable[int] | None = None,
                 eager_ms: float | Mapping[int, float] | Callable[[int], float] | None = None,
                 steps: int = 512) -> BucketPlan:
    """The bucket ladder that minimises the expected cost of the requests in ``lengths``.

    Args:
        lengths: a sample of request sizes (ints >= 1), e.g. prompt token counts from a log.
        replay_ms: replay time of a graph captured at each candidate size (ms): ``{size: ms}`` as measured
            (e.g. with :func:`cgutils.measure` on ``runner`` at each bucket; a ``pandas.Series`` indexed by size
            works the same), a function of the size, or one number for every size.
        memory_bytes: memory each candidate's graph adds (bytes); default 0 (no memory constraint).
        memory_budget: the most memory the chosen graphs may take together (bytes).
        max_buckets: the most buckets (graphs) to capture.
        candidates: sizes a bucket may have; default the keys of ``replay_ms`` when it is a mapping, else the
            distinct sizes in ``lengths``.
        eager_ms: cost of a request above the largest bucket (ms): a number, ``{size: ms}`` or a function of the
            size; default: none allowed (the largest bucket must hold the largest request).
        steps: without a common unit of the memory values (see below), memory is counted in
            ``memory_budget / steps`` units, each graph's rounded up (default 512).

    Memory is tracked exactly when the budget and each graph's memory are whole multiples of one unit that splits
    the budget into at most 4096 (byte counts usually are); otherwise in ``budget / steps`` units rounded up, so
    a plan never exceeds the budget but may miss one that fills it to within a unit. With ``eager_ms`` the plan
    may be empty (every request eager) when no graph pays or fits.

    Returns:
        :class:`BucketPlan`.

    Raises:
        InputError: an empty or non-positive sample, a bad option, a cost or memory function that raises (its
            error is the ``__cause__``), no candidate that holds the largest request
            when ``eager_ms`` is not given, or no ladder within ``memory_budget`` / ``max_buckets``.
    """
    sizes = _sizes("lengths", lengths)
    # a Series indexed by size (a measurement loop's column) is a mapping: its index gives the default candidates
    replay_ms, memory_bytes, eager_ms = (v.to_dict() if isinstance(v, pd.Series) else v
                                         for v in (replay_ms, memory_bytes, eager_ms))
    given = candidates is not None
    if candidates is None:
        candidates = list(replay_ms) if isinstance(replay_ms, Mapping) else np.unique(sizes).tolist()
    cand = sorted(set(_sizes("candidates" if given else "replay_ms's keys (the candidates by default)",
                             candidates).tolist()))
    if max_buckets is not None:
        if isinstance(max_buckets, bool) or not isinstance(max_buckets, (int, np.integer)) or max_buckets < 1:
            raise InputError(f"max_buckets must be an int >= 1, got {max_buckets!r}")
        max_buckets = None if max_buckets >= len(cand) else int(max_buckets)  # no limit then
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise InputError(f"steps must be an int >= 1 (memory units in the budget), got {steps!r}")
    if memory_budget is not None:
        if memory_bytes is None:
            raise InputError("memory_budget needs memory_bytes: what each candidate's graph adds (bytes)")
        if (isinstance(memory_budget, (bool, np.bool_)) or not isinstance(memory_budget, (int, float, np.integer,
                                                                                           np.floating))
                or not (math.isfinite(memory_budget) and memory_budget > 0)):
            raise InputError(f"memory_budget must be a finite number > 0 (bytes), got {memory_budget!r}")
        memory_budget = float(memory_budget)
    cost = _as_function("replay_ms", replay_ms)
    mem = _as_function("memory_bytes", memory_bytes) if memory_bytes is not None else (lambda _s: 0.0)
    eager = _as_function("eager_ms", eager_ms) if eager_ms is not None else None
    if eager is None and cand[-1] < sizes.max():
        raise InputError(f"the largest request ({int(sizes.max())}) is above every candidate (largest {cand[-1]}); "
                         f"add a larger candidate, or pass eager_ms for requests above the largest bucket")
    c_ms = np.array([cost(c) for c in cand], dtype=float)
    c_mem = np.array([mem(c) for c in cand], dtype=float)
    w, width = _memory_units(c_mem, memory_budget, int(steps))
    # requests per candidate interval: cum[j] = requests of size <= cand[j]
    cum = np.searchsorted(np.sort(sizes), cand, side="right")
    layers = max_buckets or 1
    if layers * len(cand) * width > _MAX_CELLS:
        raise InputError(f"the search would need {layers * len(cand) * width:,} table cells ({len(cand)} candidates, "
                         f"{width} memory units, {layers} bucket counts): offer fewer candidates, lower steps, or "
                         f"drop max_buckets")
    # best[k, j, m]: least total cost of the requests <= cand[j], served by buckets whose largest is cand[j], using
    # m memory units and k + 1 buckets (one layer, any number of buckets, without max_buckets)
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
    all_eager = math.inf
    if eager is None:
        total[:, : int(np.searchsorted(cand, sizes.max())), :] = math.inf
    else:
        order = np.sort(sizes)
        costs = np.array([eager(int(v)) for v in order[::-1]])
        tail = np.concatenate([np.cumsum(costs)[::-1], [0.0]])
        total += tail[np.searchsorted(order, cand, side="right")][None, :, None]  # eager cost of requests > cand[j]
        all_eager = float(tail[0])  # no graph at all
    if eager is not None and all_eager <= total.min():
        return _plan(sizes, (), cost, mem, eager)
    if not np.isfinite(total).any():
        smallest = (f" (the smallest candidate's graph takes {c_mem.min():g} bytes against a budget of "
                    f"{memory_budget:g}: a budget in other units than memory_bytes?)"
                    if memory_budget is not None and c_mem.min() > memory_budget else "")
        raise InputError("no ladder fits memory_budget / max_buckets: raise the budget, or offer smaller candidates "
                         f"(or pass eager_ms, which allows running everything eagerly){smallest}")
    k, j, m = (int(v) for v in np.unravel_index(np.argmin(total), total.shape))
    chosen = [cand[j]]
    while back[k, j, m] >= 0:
        i = int(back[k, j, m])
        m, j, k = m - w[j], i, (k - 1 if max_buckets else 0)
        chosen.append(cand[j])
    buckets = tuple(sorted(chosen))
    return _plan(sizes, buckets, cost, mem, eager)


def _memory_units(c_mem: np.ndarray, budget: float | None, steps: int) -> tuple[np.ndarray, int]:
    """Each candidate's memory in whole units, and the number of unit counts the search tracks (budget + 1).

    Exact when the budget and every graph's memory are whole multiples of one unit that divides the budget into at
    most 4096 (their greatest common divisor, for byte counts); otherwise ``budget / steps``, each graph's memory
    rounded up, so a plan never exceeds the budget but may miss one that fills it within that rounding."""
    if budget is None:
        return np.zeros(len(c_mem), dtype=int), 1
    values = [*c_mem.tolist(), float(budget)]
    if all(v == int(v) for v in values):
        unit = 0
        for v in values:
            unit = math.gcd(unit, int(v))
        if unit and budget / unit <= 4096:
            return (c_mem // unit).astype(int), int(budget // unit) + 1
    unit = budget / steps
    return np.ceil(c_mem / unit - 1e-9).astype(int), steps + 1


def _plan(sizes: np.ndarray, buckets: tuple[int, ...], cost: Callable, mem: Callable,
          eager_ms: Callable | None) -> BucketPlan:
    idx = np.searchsorted(np.asarray(buckets, dtype=np.int64), sizes)  # the smallest bucket >= each request
    inside = idx < len(buckets)
    served = np.asarray(buckets, dtype=np.int64)[idx[inside]]
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
                      eager_requests=int((~inside).sum()), table=pd.DataFrame(rows, columns=PLAN_COLUMNS))
