"""The pitfall catalogue as a suite: every entry of :data:`cgutils.pitfalls.PITFALLS` run, its
diagnosis and its fix checked. The catalogue itself lives in :mod:`cgutils.pitfalls`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import pitfalls
from ..checks import require_cuda
from .common import Options, print_tables

SHOWN = ("key", "kind", "exception", "cause", "op", "line", "fix_ok")
"""The columns that the plain-text report shows; ``--markdown`` prints the full table."""


def measure_suite(opts: Options) -> tuple:
    """The suite's tables, in the registry's order: ``(pitfalls,)``.

    Raises:
        NoCudaError: without a CUDA device.
    """
    # catalogue_table records each entry's failure as a row, NoCudaError included: check first, so
    # that a run without CUDA stops here instead of writing a table of "no CUDA" rows
    require_cuda("the pitfalls suite", "`python -m cgutils bench pitfalls` shows the recorded table instead")
    return (pitfalls.catalogue_table(),)


def report(frames: Mapping[str, Any], source: str, prov: dict, markdown: bool) -> None:
    """Print the catalogue's outcome columns, or with ``markdown`` docs/pitfalls.md's table as is
    (no source line: the page is pasted whole)."""
    df = frames["pitfalls"]
    if markdown:
        print(pitfalls.markdown_table(df), end="")
        return
    cols = [c for c in SHOWN if c in df]
    print_tables({"pitfalls (the full table: --markdown, or docs/pitfalls.md)": df[cols]}, markdown)
    print(f"Source: {source}")
