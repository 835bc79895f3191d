"""What a GraphRunner has done: one :class:`GraphInfo` per captured graph, and :class:`RunnerStats`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class GraphInfo:
    """One captured graph.

    Attributes:
        signature: input shapes and dtypes, e.g. ``input_ids:(1, 128) int64``.
        capture_ms: wall time of the whole first call at this shape: warm-up plus capture plus validation, ms.
        warmup_ms: of that, the warm-up calls, until the GPU finished them, ms (``None`` when the capture
            failed before or the backend ran no warm-up).
        record_ms: of that, the capture proper: recording the calls into a graph and instantiating it, ms.
        validate_ms: of that, the validation (one replay against one eager call), ms; ``None`` when off.
        pool_bytes: bytes newly reserved by the shared memory pool during this capture (later graphs
            reuse blocks freed by earlier ones, so this can be 0 for them).
        static_input_bytes: bytes of the static input buffers (allocated outside the pool).
        static_output_bytes: bytes of the static outputs (live in the pool).
        max_rel_error: largest relative error of replay against eager at capture (0.0 if identical;
            ``None`` when validation was off).
        replays: replays of this graph so far.
    """

    signature: str
    capture_ms: float
    pool_bytes: int
    static_input_bytes: int
    static_output_bytes: int
    max_rel_error: float | None
    replays: int = 0
    warmup_ms: float | None = None
    record_ms: float | None = None
    validate_ms: float | None = None

    @property
    def memory_bytes(self) -> int:
        """Memory this graph added: pool growth plus its static input buffers, bytes."""
        return self.pool_bytes + self.static_input_bytes


@dataclass
class RunnerStats:
    """Snapshot of a GraphRunner's work.

    Attributes:
        captures: graphs captured.
        replays: replays over all graphs.
        graphs: one :class:`GraphInfo` per captured graph, in capture order.
        fallbacks: calls run eagerly because an input was larger than the largest bucket.
    """

    captures: int
    replays: int
    graphs: list[GraphInfo] = field(default_factory=list)
    fallbacks: int = 0

    @property
    def memory_bytes(self) -> int:
        """Total memory added by all graphs, bytes."""
        return sum(g.memory_bytes for g in self.graphs)

    def to_frame(self):
        """One row per graph as a ``pandas.DataFrame`` (memory in bytes, time in ms)."""
        import pandas as pd

        return pd.DataFrame([{**dataclasses.asdict(g), "memory_bytes": g.memory_bytes}
                             for g in self.graphs])
