"""Plots of one measurement swept over a setting: chain length, kernel size, batch size."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from ..bench.registry import SUITES
from . import COLORS


def time_per_item(trials_summary, x: str, title: str = "", variants=("eager", "graph_runner")):
    """Median time per item (ms divided by ``x``: per image at each batch size) of each variant against ``x``,
    the p10–p90 range across trials as error bars, both axes logarithmic.

    Args:
        trials_summary: rows of :func:`cgutils.timing.summarize_trials` (``variant``, ``median_ms``, ``p10_ms``,
            ``p90_ms``, in ms) with a column ``x`` holding the setting (a positive count).
        x: that column's name, e.g. ``"batch"``.

    Replayed times move little from trial to trial, so this view, not the speedup over a noisy eager, is the
    stable one; where the two lines meet, replay has nothing left to remove.
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for v in variants:
        d = trials_summary[trials_summary.variant == v].sort_values(x)
        per = d[x].to_numpy(dtype=float)
        mid = d.median_ms.to_numpy() / per
        err = [mid - d.p10_ms.to_numpy() / per, d.p90_ms.to_numpy() / per - mid]
        ax.errorbar(per, mid, yerr=err, marker="o", color=COLORS.get(v, "#444"), ecolor="#444", capsize=3,
                    label=SUITES["speedup"].label(v))  # the names the speedup table's plots use
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda val, _: f"{val:g}"))
    ax.set_xlabel(x)
    ax.set_ylabel(f"ms per item (median / {x}; bars: p10–p90)")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def _band(ax, x, frame, col: str, color: str) -> None:
    """Shade the p10–p90 range across trials of ``col`` where the frame has it (older recordings do not)."""
    if f"{col}_p10_us" in frame and f"{col}_p90_us" in frame:
        ax.fill_between(x, frame[f"{col}_p10_us"], frame[f"{col}_p90_us"], color=color, alpha=0.25, lw=0)


def chain_plot(chain, fit: dict, title: str = ""):
    """Chain time against chain length (log-log), eager and replay, with the fitted per-launch slopes and the
    p10–p90 range across trials shaded; where :func:`cgutils.overhead.chain_sweep` timed the host too, a second
    panel gives one call's host time (µs) next to the GPU's view of the eager chain."""
    host = "host_eager_us" in chain
    fig, axes = plt.subplots(1, 2 if host else 1, figsize=(11 if host else 6.5, 4), squeeze=False)
    ax = axes[0][0]
    ax.loglog(chain.n, chain.eager_us, "o-", color=COLORS["eager"],
              label=f"eager: {fit['eager_slope_us']:.2f} µs per launch (fitted slope)")
    ax.loglog(chain.n, chain.replay_us, "s-", color=COLORS["graph_runner"],
              label=f"graph replay: {fit['replay_slope_us']:.2f} µs per node (fitted slope)")
    _band(ax, chain.n, chain, "eager", COLORS["eager"])
    _band(ax, chain.n, chain, "replay", COLORS["graph_runner"])
    ax.set_xlabel("kernels in the chain (tiny in-place adds)")
    ax.set_ylabel("time per chain (µs, CUDA events)")
    ax.set_title("as the GPU sees it (shaded: p10–p90 across trials)", fontsize=8)
    ax.legend(fontsize=8)
    if host:
        hx = axes[0][1]
        hx.loglog(chain.n, chain.eager_us, ":", color=COLORS["eager"], label="eager chain, GPU's view (left panel)")
        hx.loglog(chain.n, chain.host_eager_us, "o-", color=COLORS["eager"], label="eager chain: issuing its launches")
        hx.loglog(chain.n, chain.host_replay_us, "s-", color=COLORS["graph_runner"], label="one graph.replay() call")
        hx.set_xlabel("kernels in the chain (graph nodes for the replay)")
        hx.set_ylabel("host time per call (µs, perf_counter)")
        hx.set_title("as the host sees it", fontsize=8)
        hx.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def size_plot(sizes, launch_us: float, crossover_elements: float, title: str = ""):
    """One elementwise op against its size: eager call, one-node replay, kernel GPU time (log-log, µs), the
    p10–p90 range across trials shaded; the size at which the kernel's GPU time equals one eager launch is
    marked."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.loglog(sizes.elements, sizes.eager_us, "o-", color=COLORS["eager"], label="eager call")
    ax.loglog(sizes.elements, sizes.replay_us, "s-", color=COLORS["graph_runner"], label="one-node graph replay")
    ax.loglog(sizes.elements, sizes.kernel_us, "^-", color=COLORS["raw_graph"], label="kernel GPU time")
    _band(ax, sizes.elements, sizes, "eager", COLORS["eager"])
    _band(ax, sizes.elements, sizes, "replay", COLORS["graph_runner"])
    ax.axhline(launch_us, color="#444", lw=0.8, ls="--", label=f"one eager launch ({launch_us:.1f} µs)")
    if crossover_elements == crossover_elements:
        ax.axvline(crossover_elements, color="#d62728", lw=1, label=f"crossover ≈ {crossover_elements:.2g} elements")
    ax.set_xlabel("elements (fp32)")
    ax.set_ylabel("µs per call (CUDA events)")
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
