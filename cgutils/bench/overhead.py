"""Launch overhead (notebook 01): per-launch cost eager vs per replayed node, the kernel size that
hides a launch, and how launch-bound the seed models are. The measurements live in
:mod:`cgutils.overhead`; this is the suite around them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..overhead import chain_sweep, crossover, fit_per_launch, launch_bound_table, size_sweep
from .common import Options, print_tables


def measure_suite(opts: Options) -> tuple:
    """The suite's tables, in the registry's order: ``(overhead_chain, overhead_size, launch_bound)``.

    Raises:
        NoCudaError: without a CUDA device.
    """
    return chain_sweep(), size_sweep(), launch_bound_table()


def report(frames: Mapping[str, Any], source: str, prov: dict, markdown: bool) -> None:
    """Print the tables, then the fitted per-launch costs (µs) and the crossover kernel size."""
    print_tables(frames, markdown)
    fit = fit_per_launch(frames["overhead_chain"])
    print(f"\nper eager launch: {fit['eager_slope_us']:.2f} µs; per replayed graph node: "
          f"{fit['replay_slope_us']:.2f} µs (least-squares slopes, weighted by 1/time)")
    print(f"kernel size where GPU time equals one eager launch: "
          f"{crossover(frames['overhead_size'], fit['eager_slope_us']):.3g} elements (fp32)")
    print(f"Source: {source}")
