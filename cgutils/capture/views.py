"""What a runner's captured graphs hold, for reading: node tables, pieces and breaks, time per piece.
A mixin of :class:`~cgutils.capture.runner.GraphRunner` (which keeps ``_graphs``, ``inspect``, ``_lock``
and ``_backend``), apart from the call path."""

from __future__ import annotations

import contextlib
from typing import Any

from ..checks import check_index
from ..errors import InputError
from .inspect import captured_node_table
from .piecewise import PiecewiseGraph


class GraphViews:
    """Read-only views of the graphs a runner captured, in capture order."""

    _graphs: dict
    inspect: bool
    _lock: Any
    _backend: Any

    def _entry(self, graph: int) -> Any:
        entries = list(self._graphs.values())
        if not entries:
            lacks = "" if self._backend.available() else ", which this machine lacks"
            raise InputError(f"{self!r} has captured no graph yet: call it once first (capture needs a CUDA device{lacks})")
        why = f"the graphs of {self!r} in capture order; stats.graphs names their signatures"
        return entries[check_index("graph", graph, len(entries), why)]

    def node_table(self, graph: int = -1):
        """The nodes of one graph (default: the latest), each with the module that added it
        (:func:`~cgutils.capture.inspect.captured_node_table`). InputError: made without ``inspect=True``, or
        ``graph`` out of range; DependencyError: no cuda-python."""
        if not self.inspect:
            raise InputError(f"{self!r} was made without inspect=True, so its graphs were not kept; make it with "
                             f"GraphRunner(fn, inspect=True) to read their nodes")
        entry = self._entry(graph)
        return captured_node_table(entry.graph, entry.attribution)

    def pieces(self, graph: int = -1):
        """Pieces and eager breaks of one graph in replay order (:meth:`PiecewiseGraph.table
        <cgutils.capture.piecewise.PiecewiseGraph.table>`; one piece without ``breaks``). InputError: nothing
        captured yet, or ``graph`` out of range."""
        return _pieces(self._entry(graph)).table()

    def segment_times(self, graph: int = -1, iters: int = 20):
        """Wall time of each piece and break of one graph, µs, over ``iters`` replays of the current static inputs
        (:meth:`PiecewiseGraph.segment_times <cgutils.capture.piecewise.PiecewiseGraph.segment_times>`).
        InputError: nothing captured yet, ``graph`` out of range, or ``iters`` < 1."""
        entry = self._entry(graph)
        with self._lock:
            return _pieces(entry).segment_times(iters)

    @contextlib.contextmanager
    def step_marks(self, graph: int = -1):
        """While in the block, each call that replays one graph (default: the latest) records a CUDA event and the
        host clock before each of its pieces and breaks and after the last; yields the
        :class:`~cgutils.capture.piecewise.StepMarks`, whose ``table()`` gives µs of GPU time and host time per
        step, per call, and between calls (the runner's own work). A whole graph is one step. No profiler, so no
        profiler overhead; each mark costs an event record. Restored on exit, also after an error.

        Raises:
            InputError: nothing captured yet, ``graph`` out of range, or that graph already marked.
        """
        entry = self._entry(graph)
        with self._lock:
            original = entry.graph
            pieces = _pieces(entry)
            entry.graph = pieces  # a whole graph becomes one piece: replayed the same way, now with marks
        try:
            with pieces.marked() as marks:
                yield marks
        finally:
            with self._lock:
                entry.graph = original


def _pieces(entry: Any) -> PiecewiseGraph:
    """An entry's graph as pieces: itself with ``breaks``, else one piece."""
    return entry.graph if isinstance(entry.graph, PiecewiseGraph) else PiecewiseGraph(pieces=[entry.graph])
