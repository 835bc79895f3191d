"""What more than one benchmark suite uses: the CLI's measuring options, iteration budgets, the status
cell of a row that failed, and the plain printing of a suite's tables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..checks import first_line


@dataclass(frozen=True)
class Options:
    """The ``python -m cgutils bench`` flags that a suite's ``measure`` may read.

    Only the speedup suite reads them today; the other suites measure their fixed set-up.

    Attributes:
        workloads: names from :data:`cgutils.workloads.WORKLOADS`; ``None``: all.
        dtypes: ``"fp32"`` and/or ``"fp16"``.
        variants: speedup variants; ``None``: all of :data:`cgutils.bench.VARIANTS`.
        budget_s: approximate timed seconds per row (speedup suite: of eager per workload and dtype,
            all trials together).
        trials: interleaved trials per workload and dtype (speedup suite).
    """

    workloads: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] = ("fp32", "fp16")
    variants: tuple[str, ...] | None = None
    budget_s: float = 2.0
    trials: int = 7


def iters_for(ms_per_iter: float, budget_s: float) -> int:
    """Timed iterations that fill about ``budget_s`` seconds at ``ms_per_iter`` ms each (10 to 500)."""
    return int(min(500, max(10, budget_s * 1e3 / max(ms_per_iter, 1e-3))))


def error_status(exc: BaseException, limit: int) -> str:
    """A table's status cell for a variant that failed: the exception class and its first line,
    cut to ``limit`` characters."""
    return f"error: {type(exc).__name__}: {first_line(exc)[:limit]}"


def print_tables(frames: Mapping[str, Any], markdown: bool) -> None:
    """Print each DataFrame under its name: as markdown, or as text where a long per-step table shows
    its first 10 rows only."""
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.precision", 3):
        for name, df in frames.items():
            print(f"\n{name}:")
            if len(df) > 40 and not markdown:  # a per-step table: its head says what it holds
                print(df.head(10).to_string(index=False))
                print(f"... {len(df) - 10} more rows (--markdown prints all; the CSV is in results/)")
                continue
            print(df.to_markdown(index=False) if markdown else df.to_string(index=False))
