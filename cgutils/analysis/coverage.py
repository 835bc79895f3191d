"""Graph coverage of a profiler trace: how much of the GPU's work ran inside CUDA graph launches, and every eager
island between them, with the CPU context that launched it.

A serving engine or ``torch.compile(mode="reduce-overhead")`` can fall back to eager without a word (a graph
break, a skipped graph, a shape that was never captured). The trace says what really happened: every GPU
activity carries the correlation id of the runtime call that started it (CUPTI; Kineto writes it as
``args.correlation``), and the activities of a replay all carry the id of its ``cudaGraphLaunch``
(:meth:`cgutils.trace.Trace.links`). So each kernel, copy and memset is *graphed* (started by a graph launch)
or *eager* (by any other call), and a run of consecutive eager activities between graphed ones is an *island*.
Coverage is counted in GPU-busy time (the union of activity intervals, overlaps once) and in activities.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..capture.inspect import short_kernel_name
from ..errors import InputError
from ..trace import Trace, is_graph_launch, load_trace, union_length

ISLAND_COLUMNS = ["island", "device", "stream", "start_us", "end_us", "activities", "kernels", "gpu_us",
                  "launch_calls", "cpu_op", "range", "first", "last"]


@dataclass
class Coverage:
    """What :func:`graph_coverage` found.

    Attributes:
        summary: ``pandas.Series``: ``gpu_busy_us``, ``graphed_busy_us``, ``eager_busy_us`` (µs, unions of
            activity intervals), ``graphed_time_fraction`` (graphed / busy), ``activities``,
            ``graphed_activities``, ``graphed_activity_fraction``, ``kernels``, ``graphed_kernels``,
            ``graph_launches``, ``eager_launch_calls``, ``islands``, ``unattributed`` (activities whose
            correlation id matches no runtime call: counted eager, with no CPU context; a trace that starts while
            work is queued has some), ``unattributed_shared`` (those of them that share their correlation id with
            another activity: one call started several, which only a graph launch does, so likely a replay whose
            ``cudaGraphLaunch`` the trace lacks).
        islands: one row per eager island, in GPU time order (by start): ``island`` (0-based), ``device`` and
            ``stream`` (an island is a run of eager activities on one stream, ended by a graphed activity on that
            stream: work on other streams meanwhile, a collective on a communication stream say, neither ends nor
            joins it), ``start_us``/``end_us``
            (from the trace's first activity), ``activities``, ``kernels``, ``gpu_us`` (summed durations),
            ``launch_calls`` (distinct calls that started them), ``cpu_op`` (the innermost CPU operator around
            the island's first launch call, on its thread), ``range`` (the innermost CPU annotation around it:
            ``record_function``, :func:`cgutils.nvtx_range`), ``first``/``last`` (kernel or copy names).
        activities: every GPU activity with ``graphed`` (bool) and ``island`` (-1 for graphed ones).
    """

    summary: pd.Series
    islands: pd.DataFrame
    activities: pd.DataFrame

    def __str__(self) -> str:
        s = self.summary
        if not s.activities:
            return "graph coverage: no GPU activity in this trace"
        if not s.gpu_busy_us > 0:
            return (f"graph coverage: no GPU-busy time (all {int(s.activities)} GPU activities have zero duration); "
                    f"{s.graphed_activity_fraction:.1%} of them ran in {int(s.graph_launches)} graph launch"
                    f"{'es' if s.graph_launches != 1 else ''}")
        return (f"graph coverage: {s.graphed_time_fraction:.1%} of {s.gpu_busy_us:.0f} µs GPU-busy time and "
                f"{s.graphed_activity_fraction:.1%} of {int(s.activities)} GPU activities ran in "
                f"{int(s.graph_launches)} graph launch{'es' if s.graph_launches != 1 else ''}; {int(s.islands)} eager "
                f"island{'s' if s.islands != 1 else ''}"
                + (f"; {int(s.unattributed_shared)} more activities share correlation ids that no single launch "
                   f"call in the trace carries (likely graph launches whose call is missing)"
                   if s.unattributed_shared else ""))


def graph_coverage(trace: Trace | str | Path) -> Coverage:
    """The share of a trace's GPU work that ran inside CUDA graph launches, and its eager islands.

    Args:
        trace: a :class:`~cgutils.trace.Trace`, or the path of a torch.profiler Chrome trace (``.json`` or
            ``.json.gz``; read with :func:`cgutils.load_trace`).

    Returns:
        :class:`Coverage`. A trace without GPU activity gives zeros and NaN fractions, no islands.

    Raises:
        TraceFormatError: the file is not a trace (from :func:`cgutils.load_trace`).
    """
    if not isinstance(trace, (Trace, str, os.PathLike)):
        raise InputError(f"graph_coverage takes a cgutils.Trace or the path of a trace file, got {type(trace).__name__}; "
                         f"load a file with cgutils.load_trace(path)")
    if isinstance(trace, str) and not trace.strip():
        raise InputError("graph_coverage got an empty path; pass the path of a torch.profiler trace (.json or .json.gz)")
    t = trace if isinstance(trace, Trace) else load_trace(Path(trace))
    acts = t.device_activity()
    # islands never cross streams: each stream's activities in their start order
    acts = acts.assign(device=_hashable(acts.device.fillna(-1)), stream=_hashable(acts.stream.fillna(-1)))
    # ids compared as text: a trace that writes device 0 here and "0" there must neither raise nor split a stream
    acts = acts.sort_values(["device", "stream", "ts"], kind="stable",
                            key=lambda c: c if c.name == "ts" else c.astype(str)).reset_index(drop=True)
    calls = t.launch_calls()
    by_corr = calls.drop_duplicates("correlation").set_index("correlation")
    call_name = acts.correlation.map(by_corr.name)
    graphed = is_graph_launch(call_name.fillna("")).to_numpy()
    island = np.full(len(acts), -1)
    eager_idx = np.flatnonzero(~graphed)
    if len(eager_idx):
        lane = acts[["device", "stream"]].astype(str).groupby(["device", "stream"], sort=False).ngroup().to_numpy()
        # consecutive eager activities of one stream form an island; a graphed one between them on that stream, or
        # another stream, ends it
        breaks = np.concatenate([[True], (np.diff(eager_idx) > 1) | (lane[eager_idx][1:] != lane[eager_idx][:-1])])
        run = np.cumsum(breaks) - 1
        starts = acts.ts.to_numpy()[eager_idx][breaks]
        order = np.argsort(starts, kind="stable")  # numbered in GPU time order, across streams and devices
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        island[eager_idx] = rank[run]
    acts = acts.assign(call=call_name, graphed=graphed, island=island)

    def busy(mask: np.ndarray) -> float:  # summed over devices: each device's busy time counts once
        part = acts[mask]
        return float(sum(union_length(g.ts.to_numpy(), (g.ts + g.dur).to_numpy()) for _, g in part.groupby("device")))

    total, g_busy = busy(np.ones(len(acts), bool)), busy(graphed)
    n, n_g = len(acts), int(graphed.sum())
    kernels = (acts.kind == "kernel").to_numpy()
    islands = _islands(t, acts, by_corr)
    launches = is_graph_launch(calls.name)
    summary = pd.Series(dtype=object, data={  # object: counts stay ints
        "gpu_busy_us": total, "graphed_busy_us": g_busy, "eager_busy_us": busy(~graphed),
        "graphed_time_fraction": g_busy / total if total > 0 else float("nan"),
        "activities": n, "graphed_activities": n_g, "graphed_activity_fraction": n_g / n if n else float("nan"),
        "kernels": int(kernels.sum()), "graphed_kernels": int((kernels & graphed).sum()),
        "graph_launches": int(launches.sum()), "eager_launch_calls": int((~launches).sum()),
        "islands": len(islands), "unattributed": int(acts.call.isna().sum()),
        "unattributed_shared": int((acts.call.isna() & acts.correlation.duplicated(keep=False)
                                    & (acts.correlation >= 0)).sum()),
    })
    return Coverage(summary=summary, islands=islands, activities=acts)


def _islands(t: Trace, acts: pd.DataFrame, by_corr: pd.DataFrame) -> pd.DataFrame:
    eager = acts[acts.island >= 0]
    if eager.empty:
        return pd.DataFrame(columns=ISLAND_COLUMNS)
    t0 = float(acts.ts.min())
    linked = eager.correlation.where(eager.correlation.isin(by_corr.index))
    g = (eager.assign(end=eager.ts + eager.dur, linked=linked, is_kernel=eager.kind == "kernel")
         .sort_values("ts", kind="stable").groupby("island"))
    out = g.agg(device=("device", "first"), stream=("stream", "first"), start_us=("ts", "min"), end_us=("end", "max"), activities=("ts", "size"), kernels=("is_kernel", "sum"),
                gpu_us=("dur", "sum"), launch_calls=("linked", "nunique"), first_call=("linked", "first"))
    # head/tail keep the frame's row order, not the islands': aligned by island number before they are read
    firsts, lasts = (part.set_index("island").reindex(out.index) for part in (g.head(1), g.tail(1)))
    out["first"] = [_short(n, k) for n, k in zip(firsts.name, firsts.kind, strict=True)]
    out["last"] = [_short(n, k) for n, k in zip(lasts.name, lasts.kind, strict=True)]
    out[["start_us", "end_us"]] -= t0
    # the CPU context of each island: spans around its first launch call, on that call's process and thread
    calls = by_corr.reindex(out.first_call.dropna().astype("int64"))
    queries = pd.DataFrame({"island": out.index[out.first_call.notna()], "pid": _hashable(calls.pid).to_numpy(),
                            "tid": _hashable(calls.tid).to_numpy(), "ts": calls.ts.to_numpy()})
    ops, notes = t.ops, t.annotations[t.annotations.side == "cpu"]
    ops, notes = (df.assign(pid=_hashable(df.pid), tid=_hashable(df.tid)) for df in (ops, notes))
    out["cpu_op"] = _innermost(ops, queries).reindex(out.index).fillna("")
    out["range"] = _innermost(notes, queries).reindex(out.index).fillna("")
    out = out.reset_index().astype({"activities": int, "kernels": int, "launch_calls": int})
    return out[ISLAND_COLUMNS]


def _hashable(values: pd.Series) -> pd.Series:
    """A trace's ids as written, but lists and objects (which some writers put in ``pid``, ``tid`` or
    ``args.device``) as their text, so that they can be grouped and sorted instead of raising a pandas error."""
    return values.map(lambda v: v if v is None or isinstance(v, (int, float, str)) else str(v))


def _short(name: str, kind: str) -> str:
    return short_kernel_name(name) if kind == "kernel" else str(name)


def _innermost(spans: pd.DataFrame, queries: pd.DataFrame) -> pd.Series:
    """For each query (``island``, ``pid``, ``tid``, ``ts``), the name of the innermost span of that thread open at
    ``ts``, by island. One sweep per thread over span starts, span ends and queries in time order, with a stack of
    open spans (spans of one thread nest; one that ended is popped before a query is answered)."""
    found: dict[Any, str] = {}
    if spans.empty or queries.empty:
        return pd.Series(found, dtype=object)
    for (pid, tid), qs in queries.groupby(["pid", "tid"], dropna=False):
        mine = spans[(spans.pid == pid) & (spans.tid == tid)] if pd.notna(pid) else spans[spans.tid == tid]
        mine = mine.sort_values(["ts", "dur"], ascending=[True, False], kind="stable")
        starts, ends, names = mine.ts.to_numpy(), (mine.ts + mine.dur).to_numpy(), mine.name.to_numpy()
        stack: list[int] = []
        k = 0
        for island, ts in sorted(zip(qs.island, qs.ts, strict=True), key=lambda q: q[1]):
            while k < len(starts) and starts[k] <= ts:
                while stack and ends[stack[-1]] < starts[k]:
                    stack.pop()
                stack.append(k)
                k += 1
            while stack and ends[stack[-1]] < ts:
                stack.pop()
            found[island] = str(names[stack[-1]]) if stack else ""
    return pd.Series(found, dtype=object)
