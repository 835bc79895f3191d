"""Plots of one measurement swept over a setting, such as the batch size."""

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
