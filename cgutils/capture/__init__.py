"""Capture and replay: GraphRunner and the pieces it stands on, one job per module.

- :mod:`.nest`: map over, flatten and compare nested arguments and outputs.
- :mod:`.signature`: a call bound to parameter names; input checks against the first call.
- :mod:`.compare`: replay against eager (relative error, tolerances, validation and its diagnoses).
- :mod:`.graph`: warm-up stream, capture, RNG/autocast hygiene, pool bytes; :class:`CudaBackend`.
- :mod:`.buckets`: the bucket policy and the learned output cuts (shared with ``generation``).
- :mod:`.stats`: what a runner has captured and replayed.
- :mod:`.inspect`: what a captured graph holds: node tables, module attribution, GPU time per node.
- :mod:`.breakplan`: which module (or submodule method) calls run eagerly between graph pieces.
- :mod:`.piecewise`: graph pieces around those eager calls.
- :mod:`.control`: WHILE and IF conditional nodes around captured work (control flow on the device).
- :mod:`.bodysync`: what a conditional node's body may not do (host syncs), checked while it runs.
- :mod:`.poolscope`: which memory pool the capture running in this thread records into.
- :mod:`.cudadriver`: cuda-python's driver bindings, imported on first use.
- :mod:`.ranks`: rank agreement before capture and communicator warm-up (``distributed=``).
- :mod:`.weights`: the parameters and buffers a graph reads, replaced after capture or loaded in place.
- :mod:`.views`: read-only views of a runner's graphs (node tables, pieces, time per piece).
- :mod:`.runner`: :class:`GraphRunner`, which only coordinates.
"""

from .breakplan import BreakPlan
from .buckets import Buckets, pick_bucket
from .compare import default_rtol, max_rel_error, validate_replay
from .control import if_node, while_node
from .graph import CudaBackend, capture_graph, pool_reserved_bytes, reset_rng_after_failed_capture
from .inspect import (
    NODE_COLUMNS,
    NodeAttribution,
    graph_node_types,
    kernel_family,
    node_counts,
    node_table,
    node_times,
    short_kernel_name,
    time_by_module,
    to_dot,
)
from .nest import tree_leaves, tree_map
from .piecewise import Break, PiecewiseGraph
from .runner import GraphRunner
from .signature import ArgSpec, Call, bind_names, check_inputs
from .stats import GraphInfo, RunnerStats

__all__ = [
    "GraphRunner", "GraphInfo", "RunnerStats", "CudaBackend", "capture_graph", "pool_reserved_bytes",
    "reset_rng_after_failed_capture", "max_rel_error", "default_rtol", "validate_replay", "graph_node_types", "Buckets",
    "pick_bucket", "ArgSpec", "Call", "bind_names", "check_inputs", "tree_map", "tree_leaves",
    "NODE_COLUMNS", "NodeAttribution", "kernel_family", "node_counts", "node_table", "node_times", "time_by_module",
    "to_dot", "short_kernel_name", "Break", "BreakPlan", "PiecewiseGraph", "while_node", "if_node",
]
