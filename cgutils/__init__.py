"""cgutils: CUDA Graphs for PyTorch inference: capture/replay, timing, recorded results.

Public API (re-exports only; each name lives in the module that owns it).
"""

import sys

from .analysis import BucketPlan, Coverage, Divergence, find_divergence, graph_coverage, plan_buckets
from .annotate import annotate_modules, nvtx_range, range_overhead_us
from .bench import (
    DECODER_LABELS,
    METHOD_LABELS,
    SUITES,
    VARIANT_LABELS,
    DecodeFloorConfig,
    batch_sweep,
    decode_floor_frames,
    decode_floor_run,
    decode_step_times,
    eager_reference,
    generation_table,
    graph_methods_table,
    memory_table,
    method_targets,
    speedup_table,
    summary_table,
    validation_cost,
)
from .capture import (
    CudaBackend,
    GraphInfo,
    GraphRunner,
    NodeAttribution,
    PiecewiseGraph,
    RunnerStats,
    capture_graph,
    default_rtol,
    graph_node_types,
    if_node,
    max_rel_error,
    node_counts,
    node_table,
    node_times,
    pool_reserved_bytes,
    reset_rng_after_failed_capture,
    short_kernel_name,
    time_by_module,
    to_dot,
    validate_replay,
    while_node,
)
from .diagnose import SyncPoint, SyncRecorder, explain, find_sync_points, user_code
from .env import mode, provenance
from .errors import (
    CaptureError,
    CgutilsError,
    DependencyError,
    InputError,
    NoCudaError,
    RecordedCellError,
    RecordingError,
    StaleRecordingError,
    TraceFormatError,
    exception_chain,
)
from .generation import GreedyDecoder, StaticKVState, StopTokenDecoder, hf_generate, hf_generate_until_eos
from .overhead import gpu_activity, profile, profiler_session, runtime_calls
from .pitfalls import PITFALLS, DropoutNet, Scaled
from .recorded import setup_notebook
from .store import ResultsStore, check_recordings, current_store
from .timing import Timing, device_sync, host_us_per_call, interleaved_trials, measure, summarize_trials
from .trace import Trace, compare, is_graph_launch, load_trace, union_length
from .workloads import WORKLOADS, get_workload

__all__ = [
    # capture and replay
    "GraphRunner", "RunnerStats", "GraphInfo", "CudaBackend", "capture_graph", "pool_reserved_bytes",
    "reset_rng_after_failed_capture", "graph_node_types", "max_rel_error", "default_rtol", "validate_replay",
    # inside the graph, piecewise capture
    "node_table", "node_counts", "node_times", "time_by_module", "to_dot", "short_kernel_name", "NodeAttribution",
    "PiecewiseGraph",
    # control flow on the device
    "while_node", "if_node", "StopTokenDecoder", "hf_generate_until_eos",
    # diagnosis and the pitfall catalogue
    "explain", "find_sync_points", "user_code", "SyncPoint", "SyncRecorder", "PITFALLS", "DropoutNet", "Scaled",
    # errors
    "CaptureError", "CgutilsError", "DependencyError", "InputError", "NoCudaError", "RecordingError", "StaleRecordingError",
    "RecordedCellError", "TraceFormatError", "exception_chain",
    # timing, annotation, traces, launch overhead
    "Timing", "device_sync", "host_us_per_call", "measure", "interleaved_trials", "summarize_trials", "nvtx_range", "annotate_modules",
    "range_overhead_us", "Trace", "compare", "is_graph_launch", "load_trace", "profile", "union_length", "Coverage", "graph_coverage", "BucketPlan", "plan_buckets", "Divergence", "find_divergence", "gpu_activity", "profiler_session", "runtime_calls",
    # workloads, generation, benchmark suites
    "WORKLOADS", "get_workload", "GreedyDecoder", "StaticKVState", "hf_generate", "SUITES", "speedup_table",
    "summary_table", "eager_reference", "graph_methods_table", "method_targets", "memory_table", "validation_cost",
    "generation_table", "decode_step_times", "batch_sweep", "DecodeFloorConfig", "decode_floor_run", "decode_floor_frames", "VARIANT_LABELS", "METHOD_LABELS", "DECODER_LABELS",
    # results store, recorded notebooks, environment
    "ResultsStore", "current_store", "check_recordings", "setup_notebook", "mode", "provenance",
]
__version__ = "0.1.0"

from . import moved as _moved  # noqa: E402  (old module paths, after the packages they point into)

_moved.register(sys.modules[__name__])
