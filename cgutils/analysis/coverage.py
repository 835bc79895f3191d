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

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..capture.inspect import short_kernel_name
from ..trace import GRAPH_LAUNCHES, Trace, load_trace, union_length

ISLAND_COLUMNS = ["island", "start_us", "end_us", "activities", "kernels", "gpu_us", "launch_calls", "cpu_op",
                  "range", "first", "last"]


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
        islands: one row per eager island, in GPU time order: ``island`` (0-based), ``start_us``/``end_us``
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
        return (f"graph coverage: {s.graphed_time_fraction:.1%} of {s.gpu_busy_us:.0f} µs GPU-busy time and "
                f"{s.graphed_activity_fraction:.1%} of {int(s.activities)} GPU activities ran in "
                f"{int(s.graph_launches)} graph launch{'es' if s.graph_launches != 1 else ''}; {int(s.islands)} eager "
                f"island{'s' if s.islands != 1 else ''}"
                + (f"; {int(s.unattributed_shared)} more activities share correlation ids of launch calls the trace "
                   f"lacks (likely graph launches)" if s.unattributed_shared else ""))


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
    t = trace if isinstance(trace, Trace) else load_trace(trace)
    acts = t.device_activity().reset_index(drop=True)
    calls = t.launch_calls()
    by_corr = calls.drop_duplicates("correlation").set_index("correlation")
    call_name = acts.correlation.map(by_corr.name)
    graphed = call_name.isin(GRAPH_LAUNCHES).to_numpy()
    island = np.full(len(acts), -1)
    eager_idx = np.flatnonzero(~graphed)
    if len(eager_idx):
        # consecutive eager activities (in GPU start order) form one island; a graphed activity between ends it
        breaks = np.concatenate([[True], np.diff(eager_idx) > 1])
        island[eager_idx] = np.cumsum(breaks) - 1
    acts = acts.assign(call=call_name, graphed=graphed, island=island)
    start, end = acts.ts.to_numpy(), (acts.ts + acts.dur).to_numpy()
    busy = union_length(start, end)
    g_busy = union_length(start[graphed], end[graphed])
    n, n_g = len(acts), int(graphed.sum())
    kernels = (acts.kind == "kernel").to_numpy()
    islands = _islands(t, acts, by_corr)
    summary = pd.Series(dtype=object, data={  # object: counts stay ints
        "gpu_busy_us": busy, "graphed_busy_us": g_busy, "eager_busy_us": union_length(start[~graphed], end[~graphed]),
        "graphed_time_fraction": g_busy / busy if busy > 0 else float("nan"),
        "activities": n, "graphed_activities": n_g, "graphed_activity_fraction": n_g / n if n else float("nan"),
        "kernels": int(kernels.sum()), "graphed_kernels": int((kernels & graphed).sum()),
        "graph_launches": int(calls.name.isin(GRAPH_LAUNCHES).sum()),
        "eager_launch_calls": int((~calls.name.isin(GRAPH_LAUNCHES)).sum()),
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
    ops, ranges = t.ops, t.annotations[t.annotations.side == "cpu"]
    rows = []
    for k, part in eager.groupby("island", sort=True):
        launched = part.correlation[part.correlation.isin(by_corr.index)]
        first_call = by_corr.loc[launched.iloc[0]] if len(launched) else None
        rows.append({
            "island": int(k), "start_us": float(part.ts.min()) - t0, "end_us": float((part.ts + part.dur).max()) - t0,
            "activities": len(part), "kernels": int((part.kind == "kernel").sum()), "gpu_us": float(part.dur.sum()),
            "launch_calls": int(launched.nunique()),
            "cpu_op": _innermost(ops, first_call), "range": _innermost(ranges, first_call),
            "first": _short(part.iloc[0]), "last": _short(part.iloc[-1])})
    return pd.DataFrame(rows, columns=ISLAND_COLUMNS)


def _short(activity: pd.Series) -> str:
    return short_kernel_name(activity["name"]) if activity["kind"] == "kernel" else str(activity["name"])


def _innermost(spans: pd.DataFrame, call: pd.Series | None) -> str:
    """The name of the shortest span on ``call``'s thread that contains its start, or ``""``."""
    if call is None or spans.empty:
        return ""
    around = spans[(spans.tid == call.tid) & (spans.ts <= call.ts) & (spans.ts + spans.dur >= call.ts)]
    return "" if around.empty else str(around.loc[around.dur.idxmin(), "name"])
