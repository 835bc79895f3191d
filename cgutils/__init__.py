"""cgutils: CUDA Graphs for PyTorch inference: capture/replay, timing, recorded results.

Public API (re-exports only; each name lives in the module that owns it).
"""

from .annotate import annotate_modules, nvtx_range
from .capture import GraphInfo, GraphRunner, RunnerStats, max_rel_error, validate_replay
from .diagnose import SyncPoint, SyncRecorder, explain, find_sync_points
from .env import mode, provenance
from .errors import (
                     CaptureError,
                     CgutilsError,
                     InputError,
                     NoCudaError,
                     RecordedCellError,
                     RecordingError,
                     StaleRecordingError,
                     TraceFormatError,
)
from .recorded import ResultsStore, check_recordings, setup_notebook
from .timing import Timing, device_sync, measure
from .trace import Trace, compare, load_trace, profile
from .workloads import WORKLOADS, get_workload

__all__ = [
    "GraphRunner", "RunnerStats", "GraphInfo", "max_rel_error", "validate_replay", "explain", "find_sync_points",
    "SyncPoint", "SyncRecorder", "RecordedCellError", "mode", "provenance",
    "CaptureError", "CgutilsError", "InputError", "NoCudaError", "RecordingError", "StaleRecordingError",
    "ResultsStore", "check_recordings", "setup_notebook", "Timing", "device_sync", "measure",
    "WORKLOADS", "get_workload", "nvtx_range", "annotate_modules", "TraceFormatError", "Trace", "compare",
    "load_trace", "profile",
]
__version__ = "0.1.0"
