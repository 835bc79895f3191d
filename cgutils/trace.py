"""Kineto / Chrome trace analysis: load a torch.profiler trace into DataFrames, link every runtime or
driver call to the GPU work it started (graph-aware), and summarise launch overhead.

Units: every ``ts`` (start) and ``dur`` (duration) column is in microseconds (µs), as in the Chrome
trace format ("Trace Event Format", Google; Kineto writes ``ts``/``dur`` in µs with fractional parts).
A top-level ``displayTimeUnit`` only changes how viewers display times, not the unit of ``ts``/``dur``,
so it is ignored.

Linking: CUPTI gives each runtime/driver API call a correlation id and stamps the GPU activities it
started with the same id. A ``cudaGraphLaunch`` starts every kernel of the graph, and CUPTI reports
each replayed kernel with the graph launch's correlation id, so the link is one call to many
activities. Peers that only follow ``cudaLaunchKernel`` miss those kernels, and the launches made
through ``cudaLaunchKernelExC`` or the driver's ``cuLaunchKernel(Ex)`` (HolisticTraceAnalysis issues
#61 and #290).
"""

from __future__ import annotations

import functools
import gzip
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .checks import first_line
from .errors import InputError, TraceFormatError

# Kineto category names, current and older spellings, mapped to our tables.
_CATEGORY = {
    "cpu_op": "ops", "operator": "ops",
    "cuda_runtime": "runtime", "runtime": "runtime", "cuda_driver": "runtime",
    "kernel": "kernels",
    "gpu_memcpy": "memory", "memcpy": "memory", "gpu_memset": "memory", "memset": "memory",
    "user_annotation": "annotations", "gpu_user_annotation": "annotations",
}



def is_graph_launch(names: pd.Series) -> pd.Series:
    """Which runtime/driver call names launch a graph (bool Series, same index; a list or array becomes a Series):
    every name containing ``GraphLaunch``, which covers ``cudaGraphLaunch``, ``cuGraphLaunch``, ``hipGraphLaunch``,
    their per-thread default-stream forms (``cudaGraphLaunch_ptsz``, ``hipGraphLaunch_spt``) and versioned ones
    (``cudaGraphLaunch_v10000``). The one rule for every count of graph launches in cgutils."""
    if isinstance(names, str):
        raise InputError(f"is_graph_launch takes a Series (or list) of call names, not one string: "
                         f"pass [{names!r}]")
    if not isinstance(names, pd.Series):
        names = pd.Series(list(names))
    return names.astype(str).str.contains("GraphLaunch", regex=False)

_COLUMNS = {
    "ops": ["name", "ts", "dur", "pid", "tid", "external_id"],
    "runtime": ["name", "ts", "dur", "pid", "tid", "correlation", "api"],
    "kernels": ["name", "ts", "dur", "device", "stream", "correlation"],
    "memory": ["name", "ts", "dur", "device", "stream", "correlation", "kind", "bytes"],
    "annotations": ["name", "ts", "dur", "pid", "tid", "side"],
}


@dataclass
class Trace:
    """A parsed trace. Every DataFrame is sorted by ``ts``; times in µs.

    Attributes:
        path: the file read.
        ops: CPU operators (``cpu_op``): name, ts, dur, pid, tid, external_id.
        runtime: CUDA/HIP runtime and driver API calls: name, ts, dur, pid, tid, correlation,
            api (``runtime`` or ``driver``).
        kernels: GPU kernels: name, ts, dur, device, stream, correlation.
        memory: GPU memcpy/memset: name, ts, dur, device, stream, correlation, kind, bytes.
        annotations: ``record_function``/NVTX-style ranges: name, ts, dur, pid, tid, side (``cpu`` or
            ``gpu``).
        skipped: events left out, by reason (missing or malformed fields).
    """

    path: str
    ops: pd.DataFrame
    runtime: pd.DataFrame
    kernels: pd.DataFrame
    memory: pd.DataFrame
    annotations: pd.DataFrame
    skipped: dict[str, int] = field(default_factory=dict)

    # --- links ------------------------------------------------------------------------------------

    def device_activity(self) -> pd.DataFrame:
        """Kernels and memcpy/memset together: name, ts, dur, device, stream, correlation, kind."""
        return self._device_activity

    @functools.cached_property
    def _device_activity(self) -> pd.DataFrame:
        # built once: links, launch_stats and summary all start from it
        parts = [df for df in (self.kernels.assign(kind="kernel"), self.memory.drop(columns=["bytes"])) if len(df)]
        if not parts:
            return self.kernels.assign(kind=pd.Series(dtype=object))
        return pd.concat(parts, ignore_index=True).sort_values("ts", kind="stable").reset_index(drop=True)

    def launch_calls(self) -> pd.DataFrame:
        """Runtime and driver calls that started GPU work: those whose correlation id appears on a
        kernel, memcpy or memset. No list of API names is needed, so ``cudaLaunchKernelExC``,
        ``cuLaunchKernelEx``, ``cudaMemcpy2DAsync``, HIP's calls and future ones all count."""
        acts = self.device_activity()
        rt = self.runtime
        return rt[(rt.correlation >= 0) & rt.correlation.isin(acts.correlation)]

    def links(self) -> pd.DataFrame:
        """Every launch call joined to the GPU activities it started, by correlation id.

        Returns:
            One row per (call, activity): ``call``, ``call_ts``, ``call_dur``, ``correlation``,
            ``name``, ``ts``, ``dur``, ``stream``, ``kind``. A ``cudaGraphLaunch`` has one row per
            replayed kernel.
        """
        calls = self.launch_calls()[["name", "ts", "dur", "correlation"]].rename(
            columns={"name": "call", "ts": "call_ts", "dur": "call_dur"})
        acts = self.device_activity()[["name", "ts", "dur", "stream", "kind", "correlation"]]
        acts = acts[acts.correlation >= 0]
        return calls.merge(acts, on="correlation", how="inner").sort_values(["call_ts", "ts"]).reset_index(drop=True)

    def launch_stats(self) -> pd.DataFrame:
        """Per launch call: its CPU duration, the delay to its first GPU activity, and the GPU time.

        Returns:
            One row per launch call that started GPU work: ``call``, ``correlation``, ``call_ts``,
            ``cpu_us`` (the call's duration), ``launch_delay_us`` (first activity start − call start),
            ``activities`` (kernels/copies it started; many for a graph launch), ``gpu_us`` (their
            summed duration), ``span_us`` (first start to last end).
        """
        cols = ["call", "correlation", "call_ts", "cpu_us", "launch_delay_us", "activities", "gpu_us", "span_us"]
        calls = self.launch_calls()
        acts = self.device_activity()
        if calls.empty or acts.empty:
            return pd.DataFrame(columns=cols)
        # numeric aggregation per correlation id first, then one merge: string columns never go
        # through groupby, which keeps this vectorised on large traces
        acts = acts[acts.correlation >= 0]
        agg = acts.assign(end=acts.ts + acts.dur).groupby("correlation").agg(
            first=("ts", "min"), last=("end", "max"), activities=("ts", "size"), gpu_us=("dur", "sum"))
        out = calls.rename(columns={"name": "call", "ts": "call_ts", "dur": "cpu_us"}).merge(
            agg, left_on="correlation", right_index=True, how="inner")
        out["launch_delay_us"] = out["first"] - out["call_ts"]
        out["span_us"] = out["last"] - out["first"]
        return out[cols].sort_values("call_ts", kind="stable").reset_index(drop=True)

    # --- summaries ----------------------------------------------------------------------------------

    def summary(self, launch_bound_idle: float = 0.5) -> pd.Series:
        """Wall span, GPU busy/idle, kernels, launches and a launch-bound verdict with its numbers.

        Args:
            launch_bound_idle: the GPU idle fraction at and above which the trace is called
                launch-bound (default 0.5: the GPU waits more than it works).

        Returns:
            ``pandas.Series`` with ``wall_us`` (first to last CPU launch call or GPU activity),
            ``gpu_busy_us`` (union of activity intervals over all streams and devices),
            ``gpu_busy_fraction``, ``gpu_idle_fraction``, ``kernels``, ``gpu_activities`` (kernels,
            memcpy, memset), ``launches`` (calls that started GPU work), ``graph_launches``,
            ``kernels_per_launch`` (kernels / the calls that started a kernel: copies and their calls are
            left out), ``activities_per_launch``, ``median_launch_cpu_us``, ``median_kernel_us``, ``verdict``.
            A trace without GPU activity spans its CPU events (``wall_us``).
        """
        acts = self.device_activity()
        calls = self.launch_calls()
        starts = pd.concat([acts.ts, calls.ts])
        ends = pd.concat([acts.ts + acts.dur, calls.ts + calls.dur])
        if not len(starts):  # CPU-only: the span of what the CPU did
            cpu = [df for df in (self.ops, self.runtime, self.annotations) if len(df)]
            starts = pd.concat([df.ts for df in cpu]) if cpu else starts
            ends = pd.concat([df.ts + df.dur for df in cpu]) if cpu else ends
        wall = float(ends.max() - starts.min()) if len(starts) else 0.0
        busy = union_length(acts.ts.to_numpy(), (acts.ts + acts.dur).to_numpy())
        idle = 1 - busy / wall if wall > 0 else float("nan")
        launched = calls
        n_launch = len(launched)
        n_kernel_calls = int(launched.correlation.isin(self.kernels.correlation[self.kernels.correlation >= 0]).sum())
        s = pd.Series(dtype=object, data={
            "wall_us": wall, "gpu_busy_us": busy,
            "gpu_busy_fraction": busy / wall if wall > 0 else float("nan"), "gpu_idle_fraction": idle,
            "kernels": len(self.kernels), "gpu_activities": len(acts), "launches": n_launch,
            "graph_launches": int(is_graph_launch(launched.name).sum()),
            "kernels_per_launch": len(self.kernels) / n_kernel_calls if n_kernel_calls else float("nan"),
            "activities_per_launch": len(acts) / n_launch if n_launch else float("nan"),
            "median_launch_cpu_us": float(launched.dur.median()) if n_launch else float("nan"),
            "median_kernel_us": float(self.kernels.dur.median()) if len(self.kernels) else float("nan"),
        })
        n_cuda_calls = int(self.runtime.name.astype(str).str.match(r"(cuda|cu|hip)[A-Z]").sum()) if len(self.runtime) else 0
        if not len(acts) and n_cuda_calls:
            s["verdict"] = (f"CUDA activity not recorded: {n_cuda_calls} CUDA/HIP runtime or driver calls "
                            f"but no kernel, memcpy or memset; profile with ProfilerActivity.CUDA in activities")
        elif not len(acts):
            s["verdict"] = ("empty trace" if not (len(self.ops) or len(self.runtime) or len(self.annotations))
                            else "no GPU activity in this trace (CPU-only?)")
        elif idle >= launch_bound_idle:
            s["verdict"] = (f"launch-bound: the GPU is idle {idle:.0%} of the {wall:.0f} µs span; median kernel "
                            f"{s.median_kernel_us:.1f} µs vs median launch call {s.median_launch_cpu_us:.1f} µs")
        else:
            s["verdict"] = f"GPU-bound: the GPU is busy {1 - idle:.0%} of the {wall:.0f} µs span"
        return s

    def by_range(self, name: str) -> pd.DataFrame:
        """GPU work launched inside each CPU annotation called ``name`` (``record_function`` or
        :func:`cgutils.annotate.nvtx_range`): launch calls whose start falls inside the range, on any
        thread. Nested ranges of the same name give overlapping rows; do not sum those.

        Returns:
            One row per range instance: ``ts``, ``dur`` (the range, µs), ``launches``, ``activities``,
            ``gpu_us`` (summed activity time), ``gpu_span_us`` (first start to last end of that work).

        Raises:
            TraceFormatError: if no CPU annotation has that name (the message lists some that exist).
        """
        ranges = self.annotations[(self.annotations.name == name) & (self.annotations.side == "cpu")]
        if ranges.empty:
            known = sorted(set(self.annotations[self.annotations.side == "cpu"].name))[:10]
            raise TraceFormatError(f"{self.path}: no CPU annotation named {name!r}; some that exist: {known}")
        links = self.links()
        rows = []
        for ts, dur in zip(ranges.ts, ranges.dur):
            inside = links[(links.call_ts >= ts) & (links.call_ts <= ts + dur)]
            rows.append({"ts": ts, "dur": dur, "launches": inside.correlation.nunique(), "activities": len(inside),
                         "gpu_us": float(inside.dur.sum()),
                         "gpu_span_us": float((inside.ts + inside.dur).max() - inside.ts.min()) if len(inside) else 0.0})
        return pd.DataFrame(rows)


def union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length covered by a set of intervals (overlaps counted once): ``starts`` and ``ends`` are 1-D arrays
    (or lists, Series) of one length in one unit (a trace's µs); the result is in that unit.

    Raises:
        InputError: not 1-D numbers of equal length, a NaN or infinite bound, or an end before its start.
    """
    try:
        starts, ends = np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    except (TypeError, ValueError) as exc:
        raise InputError(f"union_length needs numeric starts and ends (µs): {exc}") from None
    if starts.ndim != 1 or starts.shape != ends.shape:
        raise InputError(f"union_length needs two 1-D arrays of one length; got shapes {starts.shape} and {ends.shape}")
    if not (np.isfinite(starts).all() and np.isfinite(ends).all()):
        raise InputError("union_length: a start or end is NaN or infinite; drop those intervals first")
    if (ends < starts).any():
        i = int(np.argmax(ends < starts))
        raise InputError(f"union_length: interval {i} ends ({ends[i]}) before it starts ({starts[i]})")
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    # a new covered block starts wherever an interval begins after everything before it has ended
    new_block = np.concatenate([[True], s[1:] > reach[:-1]])
    block_id = np.cumsum(new_block) - 1
    block_start = s[new_block]
    block_end = np.zeros(block_id[-1] + 1)
    np.maximum.at(block_end, block_id, e)
    return float((block_end - block_start).sum())


def compare(a: Trace, b: Trace, labels: tuple[str, str] = ("a", "b")) -> pd.DataFrame:
    """Side-by-side summaries of two traces (e.g. eager vs replay), with the ratio b / a for numbers."""
    sa, sb = a.summary(), b.summary()
    df = pd.DataFrame({labels[0]: sa, labels[1]: sb})
    num = pd.to_numeric(df[labels[0]], errors="coerce")
    den = pd.to_numeric(df[labels[1]], errors="coerce")
    df[f"{labels[1]} / {labels[0]}"] = den / num.replace(0, np.nan)
    return df


# --- loading -------------------------------------------------------------------------------------------


def _open(path: Path):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def _events(path: Path):
    """Yield the trace's events, streaming (the file is never held in memory as one object)."""
    import ijson

    with _open(path) as f:
        yield from ijson.items(f, "traceEvents.item", use_float=True)


def _has_trace_events(path: Path) -> tuple[bool, str]:
    """(whether the top level has a ``traceEvents`` list, what was found); stops right after it."""
    import ijson

    kind, after_key = "?", False
    with _open(path) as f:
        for prefix, event, value in ijson.parse(f, use_float=True):
            if after_key:
                return (True, "object") if event == "start_array" else (False, f"traceEvents is {event}, not a list")
            if prefix == "" and event in ("start_map", "start_array"):
                kind = "object" if event == "start_map" else "array"
                if kind == "array":
                    return False, kind
            elif prefix == "" and event == "map_key" and value == "traceEvents":
                after_key = True
    return False, kind


def _num(v: Any, nonneg: bool = False) -> float:
    """A finite float (``>= 0`` when ``nonneg``); ValueError otherwise. Booleans are not numbers here."""
    if isinstance(v, bool):
        raise ValueError(v)
    x = float(v)
    if not math.isfinite(x) or (nonneg and x < 0):
        raise ValueError(v)
    return x


def _correlation(v: Any) -> int | None:
    """A correlation id as an int (``-1``: none given), or ``None`` when it is not an integer: ``True`` would
    otherwise be read as id 1 and link unrelated events."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    if isinstance(v, (int, float)) and math.isfinite(v) and v == int(v):
        return int(v)
    return None


def _shared_correlation(rows: list[tuple], skipped: dict[str, int]) -> np.ndarray | None:
    """Which runtime-table rows (name, ts, dur, pid, tid, correlation, api) to unlink because another call
    claims their correlation id, or ``None``. A runtime call and the driver call it made under the same id
    (``cudaGraphLaunch`` over ``cuGraphLaunch``) are one launch: the runtime call keeps the link, so the
    graph's kernels are not counted as eager work. Any other sharing leaves no call to trust: all unlinked."""
    calls = pd.DataFrame({"id": pd.to_numeric(pd.Series([r[5] for r in rows]), errors="coerce").fillna(-1),
                          "runtime": [r[6] == "runtime" for r in rows]})
    shared = calls.id.duplicated(keep=False) & (calls.id >= 0)
    if not shared.any():
        return None
    runtimes = calls[shared].groupby("id").runtime.transform("sum")
    kept = pd.Series(False, index=calls.index)
    kept[shared] = (runtimes == 1) & calls.runtime[shared]
    wrapped = shared & ~kept & calls.id.isin(calls.id[kept])
    if wrapped.any():
        skipped["driver calls under a runtime call's correlation id (the runtime call keeps the link)"] = int(
            wrapped.sum())
    if (lost := shared & ~kept & ~wrapped).any():
        skipped["runtime calls sharing a correlation id (not linked)"] = int(lost.sum())
    return (shared & ~kept).to_numpy()


def load_trace(path: str | Path) -> Trace:
    """Load a Chrome/Kineto trace (``.json`` or ``.json.gz``, as torch.profiler exports) into a :class:`Trace`.

    The file is streamed event by event (``ijson``), so a large trace is parsed without first holding
    the whole JSON document as Python objects. Events missing ``ts``, ``dur`` or ``name``, or with
    non-numeric times, are skipped and counted in ``Trace.skipped``.

    An empty ``traceEvents`` list gives an empty :class:`Trace` (its summary's verdict: "empty trace").
    A correlation id that is not an integer (a bool, a string, a fraction) is dropped: the event is kept,
    never linked, and counted in ``Trace.skipped``.

    Raises:
        TraceFormatError: the file is missing, not JSON, a truncated gzip, has no ``traceEvents`` key (or
            it is not a list), or none of its events could be read. The message names the file and the problem.
    """
    import ijson

    p = Path(path)
    if not p.exists():
        raise TraceFormatError(f"{p}: no such trace file")
    rows: dict[str, list] = {k: [] for k in _COLUMNS}
    skipped: dict[str, int] = {}
    seen = 0

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    try:
        for ev in _events(p):
            seen += 1
            if not isinstance(ev, dict):
                skip("not an object")
                continue
            cat = str(ev.get("cat", "")).lower()
            table = _CATEGORY.get(cat)
            if table is None:
                continue
            if ev.get("ph", "X") != "X":
                skip(f"phase {ev.get('ph')!r} (only complete 'X' events are read)")
                continue
            try:
                name, ts, dur = str(ev["name"]), _num(ev["ts"]), _num(ev["dur"], nonneg=True)
            except KeyError as exc:
                skip(f"missing {exc.args[0]}")
                continue
            except (TypeError, ValueError, OverflowError):
                skip("ts or dur not a finite number (or dur < 0)")
                continue
            args = ev.get("args")
            args = args if isinstance(args, dict) else {}
            corr = args.get("correlation", -1)
            if (corr := _correlation(corr)) is None:
                skip("correlation id not an integer (event kept, not linked)")
                corr = -1
            if table == "ops":
                rows["ops"].append((name, ts, dur, ev.get("pid"), ev.get("tid"), args.get("External id")))
            elif table == "runtime":
                api = "driver" if cat == "cuda_driver" else "runtime"
                rows["runtime"].append((name, ts, dur, ev.get("pid"), ev.get("tid"), corr, api))
            elif table == "kernels":
                rows["kernels"].append((name, ts, dur, args.get("device"), args.get("stream", ev.get("tid")), corr))
            elif table == "memory":
                kind = "memset" if "memset" in cat else "memcpy"
                rows["memory"].append((name, ts, dur, args.get("device"), args.get("stream", ev.get("tid")), corr,
                                       kind, args.get("bytes")))
            else:
                side = "gpu" if cat.startswith("gpu") else "cpu"
                rows["annotations"].append((name, ts, dur, ev.get("pid"), ev.get("tid"), side))
    except ijson.IncompleteJSONError as exc:
        raise TraceFormatError(f"{p}: not valid JSON ({first_line(exc) or 'unexpected end'}); a file cut short, "
                               f"or not a JSON trace") from exc
    except ijson.JSONError as exc:
        raise TraceFormatError(f"{p}: not valid JSON ({first_line(exc)})") from exc
    except IsADirectoryError as exc:
        raise TraceFormatError(f"{p}: is a directory; pass one trace file") from exc
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceFormatError(f"{p}: cannot decompress ({exc}); the .gz file is truncated or corrupt") from exc
    except OSError as exc:
        raise TraceFormatError(f"{p}: cannot read ({exc.strerror or exc})") from exc

    # only an empty result needs telling apart "no traceEvents key" from "an empty list"
    has_key, kind = _has_trace_events(p) if seen == 0 else (True, "object")
    if not has_key:
        what = ("a JSON array" if kind == "array" else kind if kind.startswith("traceEvents")
                else "a JSON object without a 'traceEvents' key")
        raise TraceFormatError(f"{p}: {what}; expected a Chrome trace object with 'traceEvents' "
                               f"(as torch.profiler's export_chrome_trace writes)")
    if seen and sum(len(v) for v in rows.values()) == 0 and skipped:
        raise TraceFormatError(f"{p}: none of its {seen} events could be read ({skipped})")

    frames = {}
    for k, cols in _COLUMNS.items():
        if k == "runtime" and rows[k]:
            unlink = _shared_correlation(rows[k], skipped)
            if unlink is not None:
                rows[k] = [r[:5] + (-1,) + r[6:] if d else r for r, d in zip(rows[k], unlink)]
        df = pd.DataFrame(rows[k], columns=cols)
        df = df.astype({"ts": "float64", "dur": "float64"})  # also for empty tables: numeric groupbys stay vectorised
        if "correlation" in df:  # -1: no id; such events are never linked
            df["correlation"] = pd.to_numeric(df["correlation"], errors="coerce").fillna(-1).astype("int64")
        frames[k] = df.sort_values("ts", kind="stable").reset_index(drop=True)
    return Trace(path=str(p), skipped=skipped, **frames)
