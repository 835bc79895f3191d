"""Marks in a replay: a CUDA event and the host clock before each step (graph piece or eager break) and after the
last, so one call's GPU timeline and host time can be cut into steps without a profiler (notebook 09)."""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import torch

from ..errors import InputError


class StepMarks:
    """CUDA events and host clock readings taken during marked replays (:meth:`PiecewiseGraph.marked`,
    :meth:`GraphRunner.step_marks <cgutils.capture.views.GraphViews.step_marks>`): one before each step of a
    replay, in replay order, and one after its last step."""

    def __init__(self, names: list[str], kinds: list[str]):
        self._steps = [*zip(names, kinds), ("to the next call", "between calls")]
        self._marks: list[tuple[int, Any, float]] = []

    def mark(self, step: int) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._marks.append((step, ev, time.perf_counter()))

    def clear(self) -> None:
        """Forget the marks so far (e.g. those of warm-up calls)."""
        self._marks.clear()

    def table(self) -> pd.DataFrame:
        """One row per step of each marked replay but the last (whose closing mark only ends the replay before
        it): ``call`` (0, 1, ...), ``order`` (the step's place in a replay), ``step`` (``piece i``, the break's
        module, or ``to the next call``: from the end of one replay to the start of the next, the caller's own
        work), ``kind`` (``graph`` / ``eager`` / ``between calls``), ``gpu_us`` (µs of GPU stream time from this
        step's event to the next's) and ``host_us`` (µs of host time between the same two marks). Syncs the device.

        Raises:
            InputError: fewer than two marked replays.
        """
        per_call = len(self._steps)
        if len(self._marks) <= per_call:
            raise InputError(f"{len(self._marks)} marks, not enough for one step table: make at least two marked "
                             f"replays (each leaves {per_call} marks, the next one closes it)")
        torch.cuda.synchronize()
        rows = []
        for i in range(len(self._marks) - per_call):
            step, ev, host = self._marks[i]
            _, nxt_ev, nxt_host = self._marks[i + 1]
            name, kind = self._steps[step]
            rows.append({"call": i // per_call, "order": step, "step": name, "kind": kind,
                         "gpu_us": ev.elapsed_time(nxt_ev) * 1e3, "host_us": (nxt_host - host) * 1e6})
        return pd.DataFrame(rows)


class MarkedRuns(list):
    """A replay's step list with marks in it (so :meth:`PiecewiseGraph.marked` can refuse to nest)."""


def marking(marks: StepMarks, step: int, run: Any) -> Any:
    def marked_run():
        marks.mark(step)
        run()
    return marked_run
