"""Benchmark suites: one module per suite, and :mod:`~cgutils.bench.registry`, the one list of them
that the CLI and the plots loop over.

* :mod:`~cgutils.bench.speedup`: eager vs GraphRunner vs raw ``torch.cuda.graph`` vs ``torch.compile``.
* :mod:`~cgutils.bench.overhead`: launch cost (measurements in :mod:`cgutils.overhead`).
* :mod:`~cgutils.bench.methods`: four ways to get a graph.
* :mod:`~cgutils.bench.generation`: GPT-2 decoders; :mod:`~cgutils.bench.decode`: the decode step's routes against
  the bandwidth floor.
* :mod:`~cgutils.bench.memory`: graph memory, pools, buckets, validation cost.
* :mod:`~cgutils.bench.pitfalls`: the pitfall catalogue (entries in :mod:`cgutils.pitfalls`).

Re-exports only: ``from cgutils.bench import speedup_table`` and the like keep working.
"""

from ..overhead import launch_bound_table
from .common import Options
from .decode import DecodeFloorConfig, decode_floor_frames, decode_floor_run
from .generation import DECODER_LABELS, DECODERS, batch_sweep, decode_step_times, generation_table
from .memory import MEMORY_BUCKETS, MEMORY_SEQS, SETUP_LABELS, memory_table, validation_cost
from .methods import METHOD_LABELS, METHODS, graph_methods_table, method_targets
from .registry import DEFAULT_SUITE, SUITES, Suite
from .speedup import (
    VARIANT_LABELS,
    VARIANTS,
    RawGraphs,
    eager_reference,
    make_step,
    markdown_table,
    speedup_table,
    summary_table,
)

__all__ = [
    "SUITES", "DEFAULT_SUITE", "Suite", "Options",
    "VARIANTS", "VARIANT_LABELS", "RawGraphs", "make_step", "speedup_table", "summary_table", "markdown_table",
    "eager_reference",
    "METHODS", "METHOD_LABELS", "graph_methods_table", "method_targets",
    "DECODERS", "DECODER_LABELS", "generation_table", "decode_step_times", "batch_sweep",
    "DecodeFloorConfig", "decode_floor_run", "decode_floor_frames",
    "MEMORY_SEQS", "MEMORY_BUCKETS", "SETUP_LABELS", "memory_table", "validation_cost",
    "launch_bound_table",
]
