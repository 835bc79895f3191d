"""Latency measurement: warm-up, then timed calls, reported as robust statistics in milliseconds.

On a CUDA device each call is bracketed by a pair of CUDA events recorded on the current stream, so
the time is the GPU-side span from the start of the first kernel the call issues to the end of its
last one, including any idle gaps between them (launch overhead shows up as such gaps). Without CUDA,
``time.perf_counter`` brackets each call. Warm-up calls are never timed.

Where the host is noisy (a shared VM whose CPU-bound eager forward moves by 2× between back-to-back
runs), one block of calls per variant is not enough: :func:`interleaved_trials` times every variant in
repeated trials, in a shuffled order per trial, and :func:`summarize_trials` reduces them to medians,
spreads across trials and speedups paired within each trial.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .checks import check_int, check_no_arg_callable, require_cuda
from .errors import InputError


@dataclass(frozen=True)
class Timing:
    """Summary of repeated timed calls.

    Attributes:
        median_ms: median latency per call, ms.
        p10_ms: 10th percentile, ms.
        p90_ms: 90th percentile, ms.
        n: number of timed calls (warm-up excluded).
        clock: ``"cuda_event"`` or ``"perf_counter"``.
    """

    median_ms: float
    p10_ms: float
    p90_ms: float
    n: int
    clock: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return (f"{self.median_ms:.3f} ms median (p10 {self.p10_ms:.3f}, p90 {self.p90_ms:.3f}, "
                f"n={self.n}, {self.clock})")


class TimingAfterProfilerWarning(UserWarning):
    """A host-bound timing ran after a torch.profiler session that left CUPTI attached, in the same process.

    After a plain session, Kineto leaves CUPTI attached (pytorch/pytorch#144455), and every later runtime call pays
    for its callbacks: on the H200 host the host cost of one 256-node graph's replay went from 4.2 to 52.9 µs
    (``benchmarks/profiler_aftereffect.py``, ``results/nvidia-h200/profiler_aftereffect``, torch 2.11). Eager
    forwards and small replays read slower; large replays, bound by the GPU, do not.
    :func:`cgutils.profiler_session` (what cgutils' own sessions use) tears CUPTI down after the session, so only
    its ``teardown=False`` sessions make a later timing warn. A plain ``torch.profiler.profile`` session of the
    caller's own is not seen (torch offers no hook to count them): time first, profile last.
    """


_profiler_sessions = 0  # cgutils.profiler_session(teardown=False) sessions so far: each left CUPTI attached
_after_profiler_warned = False


def note_profiler_session() -> None:
    """Count one torch.profiler session that left CUPTI attached (:func:`cgutils.profiler_session` with
    ``teardown=False`` calls this), so that a later :func:`measure` or :func:`host_us_per_call` warns once with
    :class:`TimingAfterProfilerWarning`."""
    global _profiler_sessions
    _profiler_sessions += 1


def _warn_if_after_profiler(what: str) -> None:
    global _after_profiler_warned
    if _profiler_sessions and not _after_profiler_warned:
        _after_profiler_warned = True
        warnings.warn(
            f"{what} runs after {_profiler_sessions} torch.profiler session(s) that left CUPTI attached in this "
            "process, so host-bound timings (eager forwards, small replays) read slower than in a fresh process "
            "(pytorch/pytorch#144455). Time first and profile last, or profile with cgutils.profiler_session "
            "(CUPTI torn down after the session). Shown once per process.",
            TimingAfterProfilerWarning, stacklevel=_outside_cgutils_stacklevel())


def _outside_cgutils_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package: the caller's line, however
    many cgutils frames (``interleaved_trials`` -> ``measure``) lie between."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(2), 2  # 1 is _warn_if_after_profiler, which calls warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def summarize(samples_ms: np.typing.ArrayLike, clock: str) -> Timing:
    """Reduce per-call samples (ms) to median, p10 and p90 (linear interpolation, numpy's default).

    Raises:
        InputError: if there are no samples or any is negative or not finite.
    """
    s = np.asarray(samples_ms, dtype=np.float64).ravel()
    if s.size == 0:
        raise InputError("no timing samples: measure() needs iters >= 1")
    if not np.all(np.isfinite(s)) or np.any(s < 0):
        raise InputError(f"timing samples must be finite and >= 0, got {s[~np.isfinite(s) | (s < 0)][:3]}")
    p10, med, p90 = np.percentile(s, [10, 50, 90])
    return Timing(float(med), float(p10), float(p90), int(s.size), clock)


def device_sync(device: torch.device | str | None = None) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU)."""
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type == "cuda":
        if torch.cuda.is_available():
            torch.cuda.synchronize(dev)


def _timing_device(device: torch.device | str | None, what: str) -> torch.device:
    """The device that ``what`` times on: CUDA (events) when available and not told otherwise, else CPU.

    Raises:
        InputError: a device that is neither CUDA nor CPU, or not a device at all.
        NoCudaError: CUDA asked for and none visible.
    """
    try:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"unknown device {device!r}; use 'cuda' or 'cpu'") from exc
    if dev.type not in ("cuda", "cpu"):
        raise InputError(f"{what} times on 'cuda' (CUDA events) or 'cpu' (perf_counter), not {dev.type!r}")
    if dev.type == "cuda":
        require_cuda(f"{what}(device='cuda')", "use device='cpu'")
    return dev


def measure(fn: Callable[[], Any], *, warmup: int = 10, iters: int = 100,
            device: torch.device | str | None = None) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``iters`` timed ones.

    Args:
        fn: a callable with no arguments; its result is discarded.
        warmup: calls made before timing starts (lazy initialisation, autotuning, caches).
        iters: timed calls, each timed on its own so the spread is real, not averaged away.
        device: ``"cuda"`` (default when CUDA is available) times with CUDA events on the current
            stream; ``"cpu"`` times with ``time.perf_counter``.

    Returns:
        Timing with median, p10, p90 in ms and n == iters.

    Raises:
        InputError: ``fn`` not callable; ``warmup``/``iters`` not ints or out of range; a device other
            than CUDA or CPU. Exceptions raised by ``fn`` propagate.
        NoCudaError: ``device="cuda"`` when no CUDA device is visible.

    Warns:
        TimingAfterProfilerWarning: once per process, on CUDA, after a profiler session that left CUPTI attached.
    """
    check_no_arg_callable("measure", fn)
    check_int("warmup", warmup, minimum=0, why="untimed calls before timing starts")
    check_int("iters", iters, minimum=1, why="timed calls")
    dev = _timing_device(device, "measure")
    if dev.type == "cuda":
        _warn_if_after_profiler("this timing")

    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        samples = np.empty(iters)
        for i in range(iters):
            t0 = time.perf_counter()
            fn()
            samples[i] = (time.perf_counter() - t0) * 1e3
        return summarize(samples, "perf_counter")

    torch.cuda.synchronize(dev)  # the warm-up must not leak into the first timed call
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(dev)
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends, strict=False)], "cuda_event")


def host_us_per_call(fn: Callable[[], Any], *, calls: int = 200, warmup: int = 1, clock: str = "wall") -> float:
    """Host µs per call of ``fn``, issued back to back ``calls`` times after ``warmup`` untimed calls.

    The GPU is synchronised before the first timed call and after the last one, outside the clock, so the
    figure is what the host spends issuing a call, not the GPU's time (:func:`measure` gives that).

    Args:
        fn: a callable with no arguments.
        calls: timed calls (>= 1).
        warmup: untimed calls first (>= 0).
        clock: ``"wall"`` (``time.perf_counter``: includes time the thread waits, e.g. blocked on a full
            launch queue) or ``"thread"`` (``time.thread_time``: CPU time of this thread only).

    Returns:
        µs per call (float).

    Raises:
        InputError: ``fn`` not callable; ``calls``/``warmup`` not ints or out of range; an unknown ``clock``.

    Warns:
        TimingAfterProfilerWarning: once per process, after a profiler session that left CUPTI attached.
    """
    check_no_arg_callable("host_us_per_call", fn)
    check_int("calls", calls, minimum=1, why="timed calls")
    check_int("warmup", warmup, minimum=0, why="untimed calls first")
    clocks = {"wall": time.perf_counter, "thread": time.thread_time}
    if clock not in clocks:
        raise InputError(f"clock must be one of {sorted(clocks)}, got {clock!r}")
    now = clocks[clock]
    if torch.cuda.is_available():
        _warn_if_after_profiler("this host timing")
    for _ in range(warmup):
        fn()
    device_sync()
    t0 = now()
    for _ in range(calls):
        fn()
    t1 = now()
    device_sync()
    return (t1 - t0) / calls * 1e6


TRIAL_COLUMNS = ("trial", "variant", "order", "median_ms", "p10_ms", "p90_ms", "n", "clock")
"""Columns of :func:`interleaved_trials`' frame, in order."""


def interleaved_trials(fns: Mapping[str, Callable[[], Any]], *, trials: int = 7, iters: int = 20,
                       warmup: int = 3, trial_warmup: int = 1, device: torch.device | str | None = None,
                       seed: int | None = 0,
                       failed: dict[str, BaseException] | None = None):
    """Time several variants of one computation in interleaved, repeated trials.

    First every variant is warmed up (``warmup`` untimed calls each, in the order of ``fns``). Then
    each of ``trials`` trials times every variant once with :func:`measure` (``trial_warmup`` untimed
    calls, then ``iters`` timed ones), the variants in a fresh order per trial. The order is drawn from
    a generator seeded with ``seed``: the variant that goes first rotates through a shuffled list of all
    variants (each goes first in ``trials // len(fns)`` or one more trials), the rest follow in a random
    order. A slow phase of a noisy host (another tenant, a frequency change) then falls on every variant
    alike instead of on whichever ran during it, and the trial-to-trial spread shows how noisy it was.

    Args:
        fns: ``{variant name: callable with no arguments}``; results are discarded. At least one.
        trials: number of trials (>= 1); each yields one median per variant.
        iters: timed calls per variant per trial (>= 1).
        warmup: untimed calls per variant before the first trial (>= 0): lazy initialisation,
            autotuning, CUDA-graph capture on first call.
        trial_warmup: untimed calls at the start of each variant's block in every trial (>= 0), so that
            the switch from another variant (cold caches) does not fall on a timed call.
        device: as for :func:`measure`: ``"cuda"`` (default when CUDA is available) times with CUDA
            events on the current stream, ``"cpu"`` with ``time.perf_counter``.
        seed: seeds the trial orders (``numpy.random.default_rng``); the same seed gives the same
            orders. ``None``: fresh orders every call.
        failed: if given, a variant whose call raises (warm-up or trial) is recorded here as
            ``{name: exception}``, left out of the remaining trials and dropped from the result; the
            others go on. If ``None`` (default), the exception propagates.

    Returns:
        ``pandas.DataFrame``, one row per (trial, variant), sorted by trial and then in the order of
        ``fns``; columns ``trial`` (0-based), ``variant``, ``order`` (0-based position of the variant
        in that trial's run order), ``median_ms``, ``p10_ms``, ``p90_ms`` (over the ``iters`` timed
        calls of that block, ms), ``n`` (== ``iters``), ``clock`` (``"cuda_event"`` or
        ``"perf_counter"``). :func:`summarize_trials` reduces it.

    Raises:
        InputError: ``fns`` empty, not a mapping, with a name that is not a string or a value that is
            not callable; ``trials``, ``iters``, ``warmup``, ``trial_warmup`` not ints or out of range;
            ``seed`` not a non-negative int or ``None``; a device other than CUDA or CPU.
        NoCudaError: ``device="cuda"`` when no CUDA device is visible.
        Exception: whatever a variant raises, when ``failed`` is ``None``.
    """
    import pandas as pd

    if not isinstance(fns, Mapping) or not fns:
        raise InputError("interleaved_trials needs at least one variant: a mapping {name: callable}, e.g. "
                         f"{{'eager': lambda: model(x), 'graph': lambda: runner(x)}}; got {fns!r}")
    for name, fn in fns.items():
        if not isinstance(name, str):
            raise InputError(f"variant names must be strings (they label the rows), got {name!r}")
        check_no_arg_callable(f"variant {name!r}", fn)
    check_int("trials", trials, minimum=1, why="each trial times every variant once")
    check_int("iters", iters, minimum=1, why="timed calls per variant per trial")
    check_int("warmup", warmup, minimum=0, why="untimed calls per variant before the first trial")
    check_int("trial_warmup", trial_warmup, minimum=0, why="untimed calls per variant at the start of each trial")
    if seed is not None:
        check_int("seed", seed, minimum=0, why="seeds the order of the variants in each trial; or None")
    dev = _timing_device(device, "interleaved_trials")

    names = list(fns)
    alive = dict(fns)

    def call(name: str, run: Callable[[], Any]) -> Any:
        if failed is None:
            return run()
        try:
            return run()
        except Exception as exc:  # one failing variant must not lose the others' trials
            failed[name] = exc
            del alive[name]
            return None

    for name in names:
        call(name, lambda fn=fns[name]: [fn() for _ in range(warmup)])
    rng = np.random.default_rng(seed)
    firsts = [names[i] for i in rng.permutation(len(names))]
    rows = []
    for trial in range(trials):
        first = firsts[trial % len(names)]
        rest = [n for n in names if n != first]
        order = [first, *(rest[i] for i in rng.permutation(len(rest)))]
        for pos, name in enumerate(order):
            if name not in alive:
                continue
            t = call(name, lambda fn=fns[name]: measure(fn, warmup=trial_warmup, iters=iters, device=dev))
            if t is not None:
                rows.append({"trial": trial, "variant": name, "order": pos, **t.as_dict()})
    frame = pd.DataFrame(rows, columns=list(TRIAL_COLUMNS))
    frame = frame[frame.variant.isin(list(alive))]  # a variant that failed in a later trial: no partial rows
    rank = {n: i for i, n in enumerate(names)}
    frame = frame.sort_values(["trial", "variant"], key=lambda c: c.map(rank) if c.name == "variant" else c)
    return frame.reset_index(drop=True)


SUMMARY_COLUMNS = ("variant", "median_ms", "p10_ms", "p90_ms", "n", "trials", "speedup", "speedup_p10",
                   "speedup_p90")
"""Columns of :func:`summarize_trials`' frame, in order."""


def summarize_trials(frame, baseline: str | None = None):
    """Reduce :func:`interleaved_trials`' frame to one row per variant, with speedups paired per trial.

    Every statistic is taken *across trials* of the per-trial medians: a trial's median (over its
    ``iters`` calls) is one sample, and the spread says how much the result moved from trial to trial,
    not how much single calls vary within a trial. Percentiles use numpy's default linear interpolation.

    Speedups are paired: in each trial, ``baseline``'s median divided by the variant's median in that
    same trial; those per-trial ratios are then reduced like the latencies. A slow phase of the host
    that hits both variants of one trial cancels in their ratio, which the ratio of the overall
    medians would not do.

    Args:
        frame: :func:`interleaved_trials`' output (columns ``trial``, ``variant``, ``median_ms``, ``n``).
        baseline: the variant the speedups are relative to (e.g. ``"eager"``); ``None``: no speedups
            (those columns are NaN).

    Returns:
        ``pandas.DataFrame``, one row per variant in order of first appearance in ``frame``; columns
        ``variant``, ``median_ms`` (median across trials of the per-trial medians, ms), ``p10_ms`` /
        ``p90_ms`` (10th / 90th percentile across trials of the per-trial medians, ms), ``n`` (timed
        calls, all trials together), ``trials`` (trials with a median for this variant), ``speedup``
        (median across trials of baseline median / variant median, same trial; 1.0 for the baseline
        itself), ``speedup_p10`` / ``speedup_p90`` (10th / 90th percentile across trials of those
        ratios). Trials missing the baseline or the variant give no ratio.

    Raises:
        InputError: ``frame`` is not a non-empty DataFrame with those columns; it holds two rows for one
            (trial, variant); a median is not finite and positive; ``baseline`` is not one of its
            variants.
    """
    import pandas as pd

    needed = {"trial", "variant", "median_ms", "n"}
    if not isinstance(frame, pd.DataFrame) or not needed <= set(frame.columns):
        have = sorted(frame.columns) if isinstance(frame, pd.DataFrame) else type(frame).__name__
        raise InputError(f"summarize_trials needs interleaved_trials' frame with columns {sorted(needed)}; "
                         f"got {have}")
    if frame.empty:
        raise InputError("summarize_trials got an empty frame: no variant completed a trial "
                         "(interleaved_trials' `failed` says why)")
    variants = list(pd.unique(frame["variant"]))
    if baseline is not None and baseline not in variants:
        raise InputError(f"baseline {baseline!r} is not a variant of this frame; choose one of {variants}")
    if frame.duplicated(["trial", "variant"]).any():
        dup = frame[frame.duplicated(["trial", "variant"])].iloc[0]
        raise InputError(f"the frame holds two rows for trial {dup['trial']}, variant '{dup['variant']}': "
                         "paired speedups need one median per variant per trial (concatenated two runs?)")
    med = frame["median_ms"].to_numpy(dtype=np.float64)
    if not np.all(np.isfinite(med)) or np.any(med <= 0):
        raise InputError(f"per-trial medians must be finite and > 0 ms, got {med[~np.isfinite(med) | (med <= 0)][:3]}; "
                         "0 ms means the clock did not resolve one call: time more work per call")

    per_trial = frame.pivot(index="trial", columns="variant", values="median_ms")  # (trials, variants)
    rows = []
    for v in variants:
        samples = per_trial[v].dropna().to_numpy()
        p10, p50, p90 = np.percentile(samples, [10, 50, 90])
        row = {"variant": v, "median_ms": float(p50), "p10_ms": float(p10), "p90_ms": float(p90),
               "n": int(frame.loc[frame.variant == v, "n"].sum()), "trials": int(samples.size),
               "speedup": np.nan, "speedup_p10": np.nan, "speedup_p90": np.nan}
        if baseline is not None:
            ratios = (per_trial[baseline] / per_trial[v]).dropna().to_numpy()  # paired: same trial
            if ratios.size:
                s10, s50, s90 = np.percentile(ratios, [10, 50, 90])
                row.update(speedup=float(s50), speedup_p10=float(s10), speedup_p90=float(s90))
        rows.append(row)
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))
