"""The one list of benchmark suites. The CLI (``python -m cgutils bench [suite]``) and the plots loop
over :data:`SUITES`; adding a suite is one module in ``cgutils/bench/`` and one entry here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from . import generation, memory, methods, overhead, pitfalls, speedup
from .common import Options


@dataclass(frozen=True)
class Suite:
    """One benchmark suite.

    Attributes:
        name: the CLI's suite argument, e.g. ``"memory"``.
        description: one line for ``--help``.
        tables: the results tables it writes (``results/<gpu>/<table>.csv``; names shared with the
            notebooks' ``--save``); the first one's provenance is the suite's.
        measure: ``measure(options)`` runs it on the GPU and returns one DataFrame per table, in the
            order of ``tables``; raises :class:`~cgutils.errors.NoCudaError` without CUDA.
        report: ``report(frames, source, prov, markdown)`` prints ``{table: DataFrame}`` measured or
            recorded, ``source`` saying which (a line), ``prov`` the provenance dict.
        labels: display names of the rows' variants, methods, decoders or setups, for plots.
    """

    name: str
    description: str
    tables: tuple[str, ...]
    measure: Callable[[Options], tuple]
    report: Callable[[Mapping[str, Any], str, dict, bool], None]
    labels: Mapping[str, str] = field(default_factory=dict)

    def run(self, options: Options | None = None) -> dict[str, Any]:
        """Measure the suite (``options``: the CLI's flags, default :class:`Options`'s defaults):
        ``{table: DataFrame}`` in the order of :attr:`tables`.

        Raises:
            NoCudaError: without a CUDA device.
            RuntimeError: ``measure`` returned a different number of tables than :attr:`tables` names
                (a bug in the suite).
        """
        frames = tuple(self.measure(options or Options()))
        if len(frames) != len(self.tables):
            raise RuntimeError(f"suite {self.name!r} measured {len(frames)} tables but registers "
                               f"{len(self.tables)}: {self.tables}")
        return dict(zip(self.tables, frames, strict=True))

    def label(self, key: str) -> str:
        """The display name of ``key`` (a variant, method, decoder or setup), else ``key`` itself."""
        return self.labels.get(key, key)


def _index(suites: Iterable[Suite]) -> Mapping[str, Suite]:
    """``{name: suite}``, refusing a name or a table registered twice (one would silently hide the other)."""
    out: dict[str, Suite] = {}
    tables: dict[str, str] = {}
    for s in suites:
        if s.name in out:
            raise ValueError(f"benchmark suite {s.name!r} is registered twice")
        for t in s.tables:
            if t in tables:
                raise ValueError(f"results table {t!r} is written by suites {tables[t]!r} and {s.name!r}")
            tables[t] = s.name
        out[s.name] = s
    return MappingProxyType(out)


SUITES: Mapping[str, Suite] = _index([
    Suite("speedup", "eager vs graphs per workload", ("speedup",),
          speedup.measure_suite, speedup.report, speedup.VARIANT_LABELS),
    Suite("overhead", "launch cost, kernel size, launch-bound fraction",
          ("overhead_chain", "overhead_size", "launch_bound"), overhead.measure_suite, overhead.report),
    Suite("methods", "four ways to get a graph", ("graph_methods",),
          methods.measure_suite, methods.report, methods.METHOD_LABELS),
    Suite("generation", "GPT-2 decoders; the decode step against the bandwidth floor",
          ("generation", "generation_steps", "generation_batch", "decode_floor", "decode_floor_classes"),
          generation.measure_suite, generation.report, generation.DECODER_LABELS),
    Suite("memory", "graph memory per shape, shared pool, buckets, validation cost",
          ("graph_memory", "validation_cost"), memory.measure_suite, memory.report, memory.SETUP_LABELS),
    Suite("pitfalls", "the pitfall catalogue", ("pitfalls",), pitfalls.measure_suite, pitfalls.report),
])
"""Every benchmark suite by name, in the CLI's order."""

DEFAULT_SUITE = "speedup"
"""What ``python -m cgutils bench`` runs without a suite argument."""

