"""Figures for every benchmark suite and lesson: matplotlib helpers that save PNG and SVG.

Every function takes the DataFrames that :mod:`cgutils.bench` returns, so the same code draws live
measurements and recorded ones; display names of variants, methods, decoders and setups come from the
suites' labels in :data:`cgutils.bench.SUITES`.
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, NullFormatter

from .. import env
from ..bench.registry import SUITES

FIGURES = env.REPO_ROOT / "figures"
"""Committed figures: written only while recording on a GPU (``make record``)."""
SCRATCH_FIGURES = env.REPO_ROOT / "build" / "figures"
"""Where other runs (``make run``, the tests, a notebook in JupyterLab) write, so they never touch
the committed files."""
COLORS = {"eager": "#7f7f7f", "graph_runner": "#76b900", "raw_graph": "#1f77b4", "compile_ro": "#ff7f0e",
          "graph_runner_compiled": "#3d6b00",
          "article": "#000000"}


def save_figure(fig, name: str, data: Iterable[str] = (), folder: Path | str | None = None) -> list[Path]:
    """Save ``fig`` as ``<folder>/<name>.png`` (150 dpi) and ``.svg``; returns the paths.

    Args:
        fig: a matplotlib figure.
        name: file stem, e.g. ``"launch_chain"``.
        data: the store entries the figure was drawn from (names as in ``%%recorded --save VAR:NAME``,
            or a file under the store such as ``traces/bert_eager.json.gz``). Their content hashes go into
            the figure's metadata (PNG text and SVG ``dc:description``, :func:`figure_sources`), so that a
            committed figure older than its committed data is caught (tests/test_figures.py).
        folder: default ``figures/`` while recording (``CGUTILS_RECORD=1``) or redrawing the committed
            figures (``CGUTILS_REDRAW_FIGURES=1``, ``python -m cgutils figures``), else ``build/figures/``.

    Metadata that changes per run (software version, date, SVG element ids) is left out so that
    re-drawing the same data gives the same files.

    Raises:
        RecordingError: a ``data`` name has no file in the current store (:func:`cgutils.store.current_store`).
    """
    from ..libcode import file_hash
    from ..store import current_store, recording_enabled

    names = [data] if isinstance(data, str) else list(data)
    store = current_store() if names else None
    sources = {n: file_hash(store.value_file(n)) for n in names} if store is not None else {}
    description = json.dumps({"data": sources, "store": store.slug if store else None}, sort_keys=True)
    redraw = recording_enabled() or os.environ.get("CGUTILS_REDRAW_FIGURES") == "1"
    folder = Path(folder) if folder is not None else (FIGURES if redraw else SCRATCH_FIGURES)
    plt.rcParams["svg.hashsalt"] = "cgutils"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{name}.png", folder / f"{name}.svg"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight", metadata={"Software": None, "Description": description})
    fig.savefig(paths[1], bbox_inches="tight", metadata={"Date": None, "Creator": None, "Description": description})
    return paths


def figure_sources(path: Path | str) -> dict:
    """What :func:`save_figure` wrote into a figure's metadata: ``{"data": {name: hash}, "store": slug}``;
    ``{}`` for a figure without it. Reads PNG text chunks or the SVG's ``dc:description``."""
    import re

    p = Path(path)
    if p.suffix == ".png":
        from PIL import Image

        with Image.open(p) as im:
            text = im.text.get("Description")
    else:
        m = re.search(r"<dc:description>(.*?)</dc:description>", p.read_text(encoding="utf-8"), re.S)
        text = html.unescape(m.group(1)) if m else None
    return json.loads(text) if text else {}


def speedup_bars(summary, title: str = ""):
    """Graph speedup over eager per workload (bars per variant), the source article's A100 speedup as
    a black tick. One panel per dtype. ``summary`` is :func:`cgutils.bench.summary_table`'s output.

    Where the summary has ``<variant>_speedup_p10`` and ``_p90`` (a table measured in interleaved
    trials), each bar carries an error bar from the 10th to the 90th percentile across trials."""
    variants = [v for v in ("graph_runner", "raw_graph", "compile_ro", "graph_runner_compiled")
                if f"{v}_speedup" in summary]
    fig, panels = _dtype_panels(summary)
    for ax, dtype, part, xs in panels:
        for v, at, width in _bar_slots(variants, xs):
            ax.bar(at, part[f"{v}_speedup"], width, label=_label(v), color=COLORS[v], yerr=_speedup_range(part, v),
                   error_kw={"ecolor": "#222", "elinewidth": 0.8, "capsize": 2})
        ax.scatter(list(xs), part["article_speedup"], marker="_", s=600, color=COLORS["article"],
                   linewidths=2.5, label="source article, A100 (graph)", zorder=3)
        ax.axhline(1.0, color="#444", lw=0.8, ls="--")
        ax.set_xticks(list(xs), [w.replace("-", "-\n", 1) for w in part["workload"]], fontsize=8)
        ax.set_title(f"{dtype}, batch 1")
        ax.set_ylabel("speedup over eager (x)")
        ax.tick_params(labelleft=True)  # sharey hides the right panel's labels: each panel is read on its own
    _legend_below(fig, fig.axes[0], title)
    return fig


def _speedup_range(part, v: str):
    """Error bar lengths ``[below, above]`` for ``v``'s speedup bars: median to p10 and to p90 across
    trials; ``None`` (no error bars) where the summary has no range columns (tables recorded before
    interleaved trials)."""
    if f"{v}_speedup_p10" not in part or f"{v}_speedup_p90" not in part:
        return None
    mid = part[f"{v}_speedup"]
    below = (mid - part[f"{v}_speedup_p10"]).clip(lower=0).fillna(0)
    above = (part[f"{v}_speedup_p90"] - mid).clip(lower=0).fillna(0)
    return [below.to_numpy(), above.to_numpy()]


def latency_bars(summary, title: str = ""):
    """Median latency (ms, log scale) per workload and variant, one panel per dtype."""
    variants = [v for v in ("eager", "graph_runner", "raw_graph", "compile_ro", "graph_runner_compiled")
                if v in summary]
    fig, panels = _dtype_panels(summary)
    for ax, dtype, part, xs in panels:
        for v, at, width in _bar_slots(variants, xs):
            ax.bar(at, part[v], width, label=_label(v), color=COLORS[v])
        ax.set_yscale("log")
        _plain_log_labels(ax.yaxis)
        ax.tick_params(labelleft=True)
        ax.set_xticks(list(xs), [w.replace("-", "-\n", 1) for w in part["workload"]], fontsize=8)
        ax.set_title(f"{dtype}, batch 1")
        ax.set_ylabel("median latency per iteration (ms, log scale)")
    _legend_below(fig, fig.axes[0], title)
    return fig


def _dtype_panels(summary):
    """One panel per dtype sharing a y axis: the figure and ``(ax, dtype, rows of that dtype, x positions)``."""
    dtypes = _dtypes(summary)
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4), sharey=True, squeeze=False)
    parts = [summary[summary["dtype"] == d].reset_index(drop=True) for d in dtypes]
    return fig, [(ax, d, part, range(len(part))) for ax, d, part in zip(axes[0], dtypes, parts, strict=False)]


def _bar_slots(variants, xs):
    """``(variant, bar x positions, bar width)``: the variants side by side around each x."""
    width = 0.8 / max(1, len(variants))
    return [(v, [x + (i - (len(variants) - 1) / 2) * width for x in xs], width) for i, v in enumerate(variants)]


def speedup_vs_ops(summary, variant: str = "graph_runner", title: str = ""):
    """Speedup of ``variant`` against GPU activities per forward: does launching more kernels mean a larger gain?"""
    fig, ax = plt.subplots(figsize=(6, 4))
    per_forward = summary["gpu_ops_per_forward"]
    speedup = summary[f"{variant}_speedup"]
    for dtype, marker in (("fp32", "o"), ("fp16", "s")):
        m = summary["dtype"] == dtype
        ax.scatter(per_forward[m], speedup[m], marker=marker, s=50, color=COLORS[variant], edgecolor="k", label=dtype)
    # neighbours along x get labels above and below in turn: side by side they overlapped
    for k, i in enumerate(per_forward.sort_values().index):
        ax.annotate(f"{summary.loc[i, 'workload']} {summary.loc[i, 'dtype']}", (per_forward[i], speedup[i]),
                    fontsize=7, xytext=(5, 5 if k % 2 == 0 else -11), textcoords="offset points")
    ax.axhline(1.0, color="#444", lw=0.8, ls="--")
    ax.set_xlabel("GPU activities per forward (kernels + copies)")
    ax.set_ylabel(f"{_label(variant)} speedup over eager (x)")
    ax.margins(x=0.2)
    ax.legend(fontsize=8)
    return _finish(fig, ax, title)


def _finish(fig, ax, title: str):
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def _dtypes(summary) -> list[str]:
    order = {"fp32": 0, "fp16": 1}
    return sorted(dict.fromkeys(summary["dtype"]), key=lambda d: order.get(d, 9))


def _legend_below(fig, ax, title: str) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))


def _label(v: str) -> str:
    return SUITES["speedup"].label(v)


def decoder_bars(gen, title: str = ""):
    """One generate call (ms, log scale) per decoder, labelled with tokens/s."""
    ok = gen[gen.status == "ok"].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(9.5, 0.45 * len(ok) + 1.4))  # wide: the decoder names take half of it
    # one colour per decoder: with fewer colours than bars matplotlib cycles, and two decoders looked alike
    colors = ["#7f7f7f", "#bcbd22", "#1f77b4", "#76b900", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
    ax.barh([SUITES["generation"].label(d) for d in ok.decoder], ok.median_ms,
            color=[colors[i % len(colors)] for i in range(len(ok))])
    for y, (ms, tps) in enumerate(zip(ok.median_ms, ok.tokens_per_s, strict=True)):
        ax.annotate(f" {ms:.0f} ms, {tps:.0f} tok/s", (ms, y), va="center", fontsize=8)
    ax.set_xscale("log")
    _plain_log_labels(ax.xaxis)
    ax.set_xlim(right=ok.median_ms.max() * 6)  # room for the labels right of the longest bar
    ax.invert_yaxis()
    ax.set_xlabel("one generate call, median (ms, log scale)")
    return _finish(fig, ax, title)


def step_latency(steps, title: str = ""):
    """Per-token decode latency (ms) over the steps of one generation, one line per mode."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for mode, part in steps.groupby("mode", sort=False):
        ax.plot(part.step, part.ms * 1e3, label=mode, color=COLORS["graph_runner" if mode == "graph" else "eager"])
    ax.set_xlabel("decode step")
    ax.set_ylabel("latency per token (µs)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return _finish(fig, ax, title)


def batch_throughput(sweep, title: str = ""):
    """Tokens per second against batch size, per mode; batch buckets marked."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for mode, part in sweep.groupby("mode", sort=False):
        ax.plot(part.batch, part.tokens_per_s, marker="o", label=mode,
                color=COLORS["graph_runner" if mode == "graph" else "eager"])
    for b in sorted(set(sweep.bucket)):
        ax.axvline(b, color="#ccc", lw=0.8, zorder=0)
    ax.set_xlabel("batch size (grey lines: batch buckets)")
    ax.set_ylabel("generated tokens per second")
    ax.legend(fontsize=8)
    return _finish(fig, ax, title)


def launch_bound_bars(bound, title: str = ""):
    """Stacked bars per model and mode: GPU busy time and GPU idle time (µs) of one forward."""
    fig, ax = plt.subplots(figsize=(8, 4))
    # model names break onto lines of their own: side by side they ran into each other at this width
    labels = [f"{m.replace(' ', chr(10), 1) if len(m) > 12 else m}\n{mode}" for m, mode in zip(bound.model, bound["mode"])]
    idle = (bound.wall_us - bound.busy_us).clip(lower=0)
    ax.bar(labels, bound.busy_us, color=COLORS["raw_graph"], label="GPU busy (kernels, copies, memsets)")
    ax.bar(labels, idle, bottom=bound.busy_us, color="#dddddd", label="GPU idle (waiting for launches)")
    for x, (w, f) in enumerate(zip(bound.wall_us, bound.idle_fraction)):
        ax.annotate(f"{f:.0%} idle", (x, w), ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("one forward (µs)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    return _finish(fig, ax, title)


def methods_bars(methods, title: str = ""):
    """Latency per way of getting a graph, one panel per workload."""
    ok = methods[methods.status == "ok"]
    names = list(dict.fromkeys(ok.workload))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 3.8), squeeze=False)
    for ax, w in zip(axes[0], names):
        part = ok[ok.workload == w]
        ax.barh([SUITES["methods"].label(m) for m in part.method], part.median_ms * 1e3, color="#76b900")
        for y, v in enumerate(part.median_ms * 1e3):
            ax.annotate(f" {v:.0f}", (v, y), va="center", fontsize=7)
        ax.invert_yaxis()
        us = part.median_ms * 1e3
        if us.max() > 10 * us.min():  # eager dwarfs the graphs: on a linear axis their bars are slivers
            ax.set_xscale("log")
            ax.set_xlim(left=10 ** math.floor(math.log10(us.min())))  # bars start at a round decade, not at the shortest
            _plain_log_labels(ax.xaxis)
        ax.set_xlabel("median per call (µs" + (", log scale)" if us.max() > 10 * us.min() else ")"))
        ax.set_title(w, fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def timeline(traces: dict, window_name: str = "forward", title: str = ""):
    """GPU activity per stream over one annotated window, one panel per trace (e.g. eager vs replay).

    Args:
        traces: ``{label: cgutils.trace.Trace}``.
        window_name: a CPU annotation; its last instance sets the time window (µs, from its start).
    """
    # one shared time axis: a packed replay must look as short as it is next to eager
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 1.6 + 1.1 * len(traces)), squeeze=False, sharex=True)
    spans = []
    for ax, (label, tr) in zip(axes[:, 0], traces.items()):
        ranges = tr.annotations[(tr.annotations.name == window_name) & (tr.annotations.side == "cpu")]
        t0, t1 = (ranges.ts.iloc[-1], ranges.ts.iloc[-1] + ranges.dur.iloc[-1]) if len(ranges) else (
            tr.kernels.ts.min(), (tr.kernels.ts + tr.kernels.dur).max())
        links = tr.links()
        acts = links[(links.call_ts >= t0) & (links.call_ts <= t1)]
        streams = sorted(acts.stream.dropna().unique())
        for i, s in enumerate(streams):
            part = acts[acts.stream == s]
            ax.broken_barh(list(zip(part.ts - t0, part.dur)), (i - 0.4, 0.8), color=COLORS["graph_runner"])
        calls = acts.drop_duplicates("correlation")
        ax.broken_barh(list(zip(calls.call_ts - t0, calls.call_dur)), (len(streams) - 0.4, 0.8), color=COLORS["eager"])
        ax.set_yticks(range(len(streams) + 1), [f"stream {int(s)}" for s in streams] + ["CPU launch calls"], fontsize=7)
        spans.append(max((acts.ts + acts.dur).max() - t0, 1.0) if len(acts) else 1.0)
        ax.set_title(f"{label}: {len(acts)} GPU activities from {calls.shape[0]} launch calls", fontsize=8)
    axes[-1, 0].set_xlim(0, max(spans) * 1.02)
    axes[-1, 0].set_xlabel(f"µs from the start of the last '{window_name}' range")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def share(fraction: float) -> str:
    """A fraction as a percentage that never rounds to 0% or 100% unless it is exactly that (0.995 -> "99.5%",
    where ``:.0%`` said "100%" beside a trace with eager islands)."""
    for digits in (0, 1, 2):  # the fewest decimals that keep a share off 0% and 100%
        text = f"{fraction:.{digits}%}"
        if fraction in (0, 1) or float(text[:-1]) not in (0.0, 100.0):
            break
    return text


def coverage_bands(coverages: dict, title: str = ""):
    """GPU activity over time, graphed (inside a graph launch) against eager, one row per trace.

    Args:
        coverages: ``{label: cgutils.graph_coverage(trace)}``; time runs from each trace's first GPU activity.
    """
    fig, ax = plt.subplots(figsize=(9, 0.7 * len(coverages) + 1.5))
    for row, cov in enumerate(coverages.values()):
        acts = cov.activities
        t0 = float(acts.ts.min()) if len(acts) else 0.0
        for graphed, color in ((True, COLORS["graph_runner"]), (False, COLORS["eager"])):
            part = acts[acts.graphed == graphed]
            ax.broken_barh(list(zip(part.ts - t0, part.dur)), (row - 0.35, 0.7), color=color)
    ax.set_yticks(range(len(coverages)), [f"{label}: {share(cov.summary.graphed_time_fraction)} graphed"
                                          for label, cov in coverages.items()], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("µs from the trace's first GPU activity")
    ax.legend(handles=[Patch(color=COLORS["graph_runner"], label="in a graph launch"),
                       Patch(color=COLORS["eager"], label="eager (an island)")], fontsize=8, ncol=2,
              frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.28))  # below the axes: not over the bars
    return _finish(fig, ax, title)


def memory_plot(mem, title: str = ""):
    """Memory added by CUDA graphs vs the number of sequence lengths served, one line per setup
    (``bench.memory_table``)."""
    # what the pools hold first (it only grows), then everything reserved (it can drop: the notebook says why)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, col, label in ((axes[0], "pool_bytes", "what the graphs' pools hold (MiB)"),
                           (axes[1], "reserved_bytes", "memory reserved since start (MiB)")):
        for setup, part in mem.groupby("setup", sort=False):
            graphs = int(part.graphs.iloc[-1])
            ax.plot(part.shapes, part[col] / 2**20, marker="o", label=f"{SUITES['memory'].label(setup)}: {graphs} graphs")
        ax.set_xlabel("lengths served (own pools captured shortest first, the others longest first)", fontsize=8)
        ax.set_ylabel(label)
        ax.tick_params(labelleft=True)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def baked_value_plot(calls, title: str = ""):
    """Output of eager vs replay over calls while a Python value changes (a silently wrong replay)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(calls.call, calls.eager, marker="o", label="eager")
    ax.plot(calls.call, calls.replay, marker="x", linestyle="--", label="graph replay")
    ax.set_xlabel("call")
    ax.set_ylabel("output mean")
    ax.legend(fontsize=8)
    _finish(fig, ax, title)
    return fig


def trial_spread(trials, variants=("eager", "graph_runner"), title: str = ""):
    """How much each trial's median moved from the median of all trials (%), per workload, dtype and variant:
    one dot per trial (``trials``: the rows :func:`cgutils.bench.speedup_table` appends to ``trial_log``)."""
    import numpy as np

    df = trials[trials.variant.isin(variants)].copy()
    df["config"] = df.workload + "\n" + df.dtype
    df["deviation_pct"] = 100 * (df.median_ms / df.groupby(["config", "variant"]).median_ms.transform("median") - 1)
    configs = list(dict.fromkeys(df.config))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(configs)), 4.2))
    width = 0.8 / len(variants)
    for k, v in enumerate(variants):
        d = df[df.variant == v]
        x = np.array([configs.index(c) for c in d.config]) + (k - (len(variants) - 1) / 2) * width
        ax.scatter(x, d.deviation_pct, s=14, color=COLORS.get(v, "#333"), label=_label(v), alpha=0.8)
    ax.axhline(0, color="#444", lw=0.8)
    ax.set_xticks(range(len(configs)), configs, fontsize=7, rotation=30, ha="right")  # long names overlapped flat
    ax.set_ylabel("trial median vs median of trials (%)")
    ax.legend(fontsize=8)
    return _finish(fig, ax, title)


def barh(values, xlabel: str, title: str = "", errors=None, color: str = "#76b900", log: bool | None = None):
    """Horizontal bars, one per entry of ``values`` (a ``pandas.Series``; its index labels the bars, first on
    top), with optional ``errors`` (``[below, above]`` arrays, e.g. a p10–p90 range) and values printed past the
    end of each bar's error bar (on it they were overprinted). ``log``: a log x axis; by default when the largest
    bar is 5× the smallest or more, where a linear axis squeezes the small ones together."""
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(values) + 1.4))
    y = list(range(len(values))[::-1])
    vals = [float(v) for v in values.values]
    ax.barh(y, vals, xerr=errors, color=color, ecolor="#444", capsize=3)
    ax.set_yticks(y, [str(i) for i in values.index], fontsize=8)
    above = [float(a) for a in errors[1]] if errors is not None else [0.0] * len(vals)
    positive = [v for v in vals if v > 0]
    if log is None:
        log = bool(positive) and max(positive) >= 5 * min(positive)
    for yi, v, a in zip(y, vals, above, strict=True):
        ax.annotate(f"{v:.3g}", (v + a, yi), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)
    if log:
        ax.set_xscale("log")
        _plain_log_labels(ax.xaxis)
        ax.set_xlim(right=max(v + a for v, a in zip(vals, above, strict=True)) * 2)
        xlabel += ", log scale"
    else:
        ax.margins(x=0.15)
    ax.set_xlabel(xlabel)
    return _finish(fig, ax, title)


def _plain_log_labels(axis) -> None:
    """Plain numbers on a log axis: the default 10^2-style labels and minor labels collided."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


CLOCK_LABELS = {"wall_us": "wall time per call (CUDA events)", "cpu_us": "CPU time issuing it (thread clock)",
                "gpu_busy_us": "GPU busy time (profiler)"}


def clock_bars(per, title: str = ""):
    """Three clocks per variant, µs, as grouped horizontal bars on a log axis: wall time, the CPU time spent
    issuing the call, and the GPU's busy time (``per``: index variant, columns ``wall_us``, ``cpu_us``,
    ``gpu_busy_us``). Eager at batch 1 shows wall ≈ CPU ≫ GPU; a replay wall ≈ GPU ≫ CPU."""
    cols = [c for c in CLOCK_LABELS if c in per.columns]
    fig, ax = plt.subplots(figsize=(7.5, 0.9 * len(per) + 1.6))
    height = 0.8 / len(cols)
    colors = {"wall_us": "#444444", "cpu_us": COLORS["eager"], "gpu_busy_us": COLORS["graph_runner"]}
    for j, col in enumerate(cols):
        y = [len(per) - 1 - i + (len(cols) / 2 - j - 0.5) * height for i in range(len(per))]
        vals = [float(v) for v in per[col].values]
        ax.barh(y, vals, height=height * 0.95, color=colors[col], label=CLOCK_LABELS[col])
        for yi, v in zip(y, vals, strict=True):
            ax.annotate(f"{v:.0f}", (v, yi), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(len(per))[::-1], [str(i) for i in per.index], fontsize=8)
    ax.set_xscale("log")
    _plain_log_labels(ax.xaxis)
    ax.set_xlim(right=float(per[cols].max().max()) * 3)
    ax.set_xlabel("µs per call, log scale")
    ax.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    return _finish(fig, ax, title)

