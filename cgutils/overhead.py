"""Launch overhead, measured: per-launch cost eager vs per-node cost in a replayed graph, the kernel
size at which GPU work hides the launch, the CPU-side dispatch cost, and how launch-bound real models are;
and the torch.profiler sessions that measure it (:func:`profiler_session`, :func:`profile`), which leave later
timings as they were.

All GPU timings use CUDA events (``cgutils.timing.measure``); every function returns a
``pandas.DataFrame`` in µs or ms as its columns say. The functions that need CUDA raise
:class:`~cgutils.errors.NoCudaError` without it; :func:`cpu_dispatch_cost` runs anywhere.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .capture import capture_graph
from .checks import check_int, check_no_arg_callable, require_cuda
from .errors import InputError
from .timing import measure, note_profiler_session

_FIX = "the notebooks show the recorded result instead"


def _chain(x: torch.Tensor, n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            x.add_(1.0)  # one tiny elementwise kernel per call: all launch, almost no work
    return run


def chain_sweep(lengths: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
                iters: int = 30, progress: bool = True):
    """Time a chain of ``n`` tiny kernels (an in-place add on one float) launched eagerly, and the same
    chain captured into one graph and replayed.

    Returns:
        DataFrame with columns ``n, eager_us, replay_us`` (median per chain, µs) and
        ``eager_us_per_op, replay_us_per_node``.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    require_cuda("chain_sweep", _FIX)
    x = torch.zeros(1, device="cuda")
    rows = []
    for n in tqdm(list(lengths), desc="kernel chains", disable=not progress):
        run = _chain(x, n)
        eager = measure(run, warmup=3, iters=iters).median_ms * 1e3
        graph, _ = capture_graph(run, warmup=1)
        replay = measure(graph.replay, warmup=3, iters=iters).median_ms * 1e3
        rows.append({"n": n, "eager_us": eager, "replay_us": replay})
        del graph
    df = pd.DataFrame(rows)
    df["eager_us_per_op"] = df.eager_us / df.n
    df["replay_us_per_node"] = df.replay_us / df.n
    return df


def fit_per_launch(df) -> dict[str, float]:
    """Weighted least-squares line through chain time against chain length (``numpy.polyfit``).

    ``df`` needs columns ``n``, ``eager_us`` and ``replay_us`` (as :func:`chain_sweep` returns). The
    weights are ``1 / time``, so each chain counts by its relative error: with chain lengths spaced
    on a log scale, an unweighted fit would be set by the longest chains alone and its intercept
    would mean nothing for short ones.

    Returns:
        ``eager_slope_us`` (µs per eager launch), ``replay_slope_us`` (µs per graph node),
        ``eager_intercept_us`` and ``replay_intercept_us`` (fixed cost per chain / per replay, µs).
    """
    e_slope, e_icpt = np.polyfit(df.n, df.eager_us, 1, w=1 / df.eager_us)
    r_slope, r_icpt = np.polyfit(df.n, df.replay_us, 1, w=1 / df.replay_us)
    return {"eager_slope_us": float(e_slope), "eager_intercept_us": float(e_icpt),
            "replay_slope_us": float(r_slope), "replay_intercept_us": float(r_icpt)}


def launch_cost(df) -> dict[str, float]:
    """One eager launch as the suite quotes it: the median eager µs per launch over the chain lengths that
    agree (64 <= n < the longest), with their range. The fitted slope (:func:`fit_per_launch`) goes through
    every length and is bent by the short chains' fixed cost. The longest chain is left out because earlier
    single-block sweeps on the H200 ran it faster per launch than the rest; in the interleaved sweep of notebook
    01 it fell inside the range, and the notebook prints whether it does and what the median would be with it.

    Args:
        df: :func:`chain_sweep`'s frame (columns ``n`` and ``eager_us_per_op``, µs).

    Returns:
        ``median_us``, ``min_us``, ``max_us`` (µs per launch) and ``n_min``, ``n_max`` (the chain lengths used).

    Raises:
        InputError: no chain length in that window (the sweep needs lengths from 64 and a longer one).
    """
    per = df.set_index("n").eager_us_per_op
    mid = per[(per.index >= 64) & (per.index < per.index.max())]
    if mid.empty:
        raise InputError(f"launch_cost needs chain lengths >= 64 below the longest; the sweep has {list(per.index)}")
    return {"median_us": float(mid.median()), "min_us": float(mid.min()), "max_us": float(mid.max()),
            "n_min": int(mid.index.min()), "n_max": int(mid.index.max())}


def size_sweep(sizes: Iterable[int] = tuple(int(10 ** e) for e in np.arange(0, 8.01, 0.5)),
               repeat: int = 20, iters: int = 30, progress: bool = True):
    """One elementwise op (``torch.mul(x, 2, out=y)``, fp32) from 1 to ~10^8 elements.

    Returns:
        DataFrame with columns ``elements, bytes`` (read + written), ``eager_us`` (one eager call, CUDA
        events: launch plus kernel as the GPU sees it), ``replay_us`` (the same op as a one-node graph
        replay), ``kernel_us`` (GPU time of the kernel alone: ``repeat`` copies replayed back to back in
        one graph, divided by ``repeat``).
    """
    import pandas as pd
    from tqdm.auto import tqdm

    require_cuda("size_sweep", _FIX)
    rows = []
    for n in tqdm(list(sizes), desc="kernel sizes", disable=not progress):
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)

        def op(x=x, y=y) -> None:
            torch.mul(x, 2.0, out=y)

        def many(op=op) -> None:
            for _ in range(repeat):
                op()

        eager = measure(op, warmup=5, iters=iters).median_ms * 1e3
        one, _ = capture_graph(op, warmup=1)
        replay = measure(one.replay, warmup=5, iters=iters).median_ms * 1e3
        block, _ = capture_graph(many, warmup=1)
        kernel = measure(block.replay, warmup=3, iters=iters).median_ms * 1e3 / repeat
        rows.append({"elements": n, "bytes": 2 * 4 * n, "eager_us": eager, "replay_us": replay, "kernel_us": kernel})
        del x, y, one, block
    return pd.DataFrame(rows)


def crossover(df, launch_us: float) -> float:
    """Element count at which the kernel's GPU time first equals ``launch_us``, interpolated linearly
    in log-log space between the two sizes around it; ``nan`` if it never does within the sweep."""
    k = df.sort_values("elements")
    above = np.nonzero(k.kernel_us.to_numpy() >= launch_us)[0]
    if len(above) == 0:
        return float("nan")
    i = above[0]
    if i == 0:
        return float(k.elements.iloc[0])
    x0, x1 = np.log(k.elements.iloc[i - 1]), np.log(k.elements.iloc[i])
    y0, y1 = np.log(k.kernel_us.iloc[i - 1]), np.log(k.kernel_us.iloc[i])
    return float(np.exp(x0 + (np.log(launch_us) - y0) * (x1 - x0) / (y1 - y0))) if y1 != y0 else float(np.exp(x1))


def cpu_dispatch_cost(ops: int = 2000, repeats: int = 15):
    """Per-op cost of PyTorch's Python and dispatcher layers: an add on a one-element CPU tensor, timed
    with ``time.perf_counter`` (runs anywhere). That CPU work also precedes every eager CUDA launch,
    and replay skips it.

    Returns:
        DataFrame with columns ``op`` and ``us_per_op`` (median over ``repeats`` runs of ``ops`` calls)
        for the same call through ``torch.add(out=)``, an in-place ``add_`` and a plain Python call.
    """
    import pandas as pd

    x, y = torch.zeros(1), torch.zeros(1)

    def py_noop(a, b):
        return a

    cases: dict[str, Callable[[], Any]] = {
        "torch.add(x, 1, out=y)": lambda: torch.add(x, 1.0, out=y),
        "x.add_(1)": lambda: x.add_(1.0),
        "Python function call (floor)": lambda: py_noop(x, y),
    }
    rows = []
    for name, fn in cases.items():
        def block(fn=fn):
            for _ in range(ops):
                fn()
        t = measure(block, warmup=2, iters=repeats, device="cpu")
        rows.append({"op": name, "us_per_op": t.median_ms * 1e3 / ops})
    return pd.DataFrame(rows)


TEARDOWN_ENV = "TEARDOWN_CUPTI"  # Kineto's switch: tear CUPTI down when a session ends


def _settle_teardown() -> None:
    """Give a pending CUPTI teardown the runtime calls it finishes on.

    Kineto tears CUPTI down on the exit callback of a runtime call made after the session, not when the session
    ends; a session started before then saw no GPU activity at all (pytorch/kineto#1554; 0 of 256 kernels on the
    H200 in ``benchmarks/profiler_aftereffect.py``). Five 10 ms sleeps, each followed by a sync, let it finish
    there (256 of 256): ~50 ms per session.
    """
    for _ in range(5):
        time.sleep(0.01)
        torch.cuda.synchronize()


@contextlib.contextmanager
def _quiet_profile(**kwargs: Any):
    """``torch.profiler.profile(**kwargs)`` without its once-per-process "Profiler clears events at the end of each
    cycle" warning: cgutils' sessions are single cycles."""
    from torch.profiler import profile

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(**kwargs) as prof:
            yield prof


def _prime_teardown() -> None:
    """A throw-away session, torn down and settled, before the real one.

    After a plain session (CUPTI left attached), the first session run with ``TEARDOWN_CUPTI=1`` saw no GPU work at
    all on the H200 (torch 2.11): notebook 07's trace of a replay held no graph launch with GPU work, and notebook 11's
    ``runtime_calls`` came back empty, while the session after it was whole. This session takes that place; it is
    also the throw-away first session of a process, whose counts can hold extra activities.
    """
    from torch.profiler import ProfilerActivity

    with _quiet_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        torch.cuda.synchronize()
    _settle_teardown()


@contextlib.contextmanager
def profiler_session(*, activities: list, teardown: bool = True, **kwargs: Any):
    """``torch.profiler.profile(activities=activities, **kwargs)`` that leaves later timings as they were before it.

    With CUDA and ``teardown`` (default), ``TEARDOWN_CUPTI=1`` is set in ``os.environ`` for the session and the
    teardown Kineto then leaves pending is given runtime calls to finish on (:func:`_settle_teardown`, ~50 ms)
    before the variable is put back as it was. Before the session the same settling runs, then a throw-away session
    (:func:`_prime_teardown`), so that neither a teardown left pending nor CUPTI left attached by the caller's own
    plain session can blind this one (~100 ms per session in all). Measured on the H200 (torch 2.11, one process per
    setting, ``benchmarks/profiler_aftereffect.py``): a plain session left one small replay's host cost ~16×
    higher for the rest of the process; torn down and settled, it stayed as before and a session right after saw
    every kernel. torch.profiler's once-per-process "Profiler clears events at the end of each cycle" warning is
    silenced (:func:`_quiet_profile`).

    Args:
        activities: ``torch.profiler.ProfilerActivity`` values.
        teardown: ``False`` for a plain session (CUPTI stays attached; a later :func:`cgutils.measure` or
            :func:`cgutils.host_us_per_call` warns once with ``cgutils.timing.TimingAfterProfilerWarning``).
        **kwargs: passed to ``torch.profiler.profile`` (``schedule``, ``on_trace_ready``, ``record_shapes``).

    Yields:
        The ``torch.profiler.profile`` object.

    Raises:
        InputError: ``activities`` not a non-empty list of ``ProfilerActivity``; ``teardown`` not a bool.
        NoCudaError: ``ProfilerActivity.CUDA`` asked for without a CUDA device.
    """
    from torch.profiler import ProfilerActivity

    if not isinstance(activities, (list, tuple)) or not activities or \
            not all(isinstance(a, ProfilerActivity) for a in activities):
        raise InputError("activities must be a non-empty list of torch.profiler.ProfilerActivity values, e.g. "
                         f"[ProfilerActivity.CPU, ProfilerActivity.CUDA]; got {activities!r}")
    if not isinstance(teardown, bool):
        raise InputError(f"teardown must be True or False, got {teardown!r}")
    if ProfilerActivity.CUDA in activities:
        require_cuda("profiler_session with ProfilerActivity.CUDA", "profile with [ProfilerActivity.CPU] only")
    cuda = torch.cuda.is_available()
    teardown = teardown and cuda
    previous = os.environ.get(TEARDOWN_ENV)
    try:
        if teardown:
            _settle_teardown()
            os.environ[TEARDOWN_ENV] = "1"
            _prime_teardown()
        with _quiet_profile(activities=activities, **kwargs) as prof:
            yield prof
        if teardown:
            _settle_teardown()
    finally:
        if teardown:
            if previous is None:
                os.environ.pop(TEARDOWN_ENV, None)
            else:
                os.environ[TEARDOWN_ENV] = previous
        if cuda and not teardown:  # only a session that left CUPTI attached makes later timings warn
            note_profiler_session()


def gpu_activity(run: Callable[[], Any]) -> tuple[int, float]:
    """GPU activities (kernels, memcpy, memset) of one call of ``run`` and their summed GPU time (µs),
    from torch.profiler (CUPTI). Kernels replayed by a graph are reported as well where CUPTI
    supports it; a count of 0 for a replay means it did not. The first profiler session of a process
    can report extra activities; :func:`profiler_session`'s throw-away session runs first.

    The session is a :func:`profiler_session`: CUPTI is torn down after it, so timings made later in
    the process are not slowed by it (a plain torch.profiler session leaves CUPTI attached: pytorch/pytorch#144455;
    ``benchmarks/profiler_aftereffect.py``).

    Raises:
        NoCudaError: without a CUDA device.
    """
    from torch.profiler import ProfilerActivity

    require_cuda("gpu_activity", _FIX)
    torch.cuda.synchronize()
    with profiler_session(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    acts = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(acts), float(sum(e.time_range.elapsed_us() for e in acts))


def launch_bound_table(progress: bool = True):
    """How launch-bound the seed models are, eager vs replay (fp16, batch 1).

    For BERT-base (128 tokens), ResNet-50 and one GPT-2 decode step with a static KV cache: GPU
    activities per forward and their summed GPU time (torch.profiler), the forward's time as the GPU
    sees it (CUDA events, median), and the GPU idle fraction ``1 - busy / wall``. Every case is timed
    before any is profiled (see :func:`gpu_activity`).

    Returns:
        DataFrame with columns ``model, mode, kernels, busy_us, wall_us, idle_fraction`` and
        ``busy_source`` (``profiler``, or ``eager profile`` where the profiler saw no replayed kernels
        and the eager kernels, the same ones, stand in).
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from .generation import StaticKVState
    from .workloads import WORKLOADS

    require_cuda("launch_bound_table", _FIX)

    def single(workload: str) -> Callable[[], Callable[[], Any]]:
        def make():
            b = WORKLOADS[workload].build("fp16", "cuda")
            args = b.inputs(0)
            return lambda: b.step(*args)

        return make

    def gpt2_step():
        b = WORKLOADS["gpt2-generate100"].build("fp16", "cuda")
        state = StaticKVState(b.model, batch=1, max_len=256)
        with torch.no_grad():
            state.prefill(b.inputs(0)[0])
        return state.decode_step

    cases = [("BERT-base seq128", single("bert-base-seq128")), ("ResNet-50", single("resnet50")),
             ("GPT-2 decode step", gpt2_step)]
    # Two passes: every case timed first, then every case profiled, because launches can stay slower in a
    # process torch.profiler has run in (pytorch/pytorch#144455; benchmarks/profiler_aftereffect.py).
    wall: dict[tuple[str, str], float] = {}
    work: dict[tuple[str, str], tuple[int, float]] = {}
    with tqdm(total=2 * len(cases), desc="launch-bound fraction", disable=not progress) as bar:
        for profiled in (False, True):
            for name, make in cases:
                with torch.no_grad():
                    step = make()
                    graph, _ = capture_graph(step, warmup=3)
                    for mode, run in (("eager", step), ("replay", graph.replay)):
                        if profiled:
                            work[name, mode] = gpu_activity(run)
                        else:
                            wall[name, mode] = measure(run, warmup=5, iters=50).median_ms * 1e3
                del graph, step
                torch.cuda.empty_cache()
                bar.update()
    rows = []
    for name, _ in cases:
        for mode in ("eager", "replay"):
            (n, busy), source = work[name, mode], "profiler"
            if n == 0 and mode == "replay":
                (n, busy), source = work[name, "eager"], "eager profile"
            w = wall[name, mode]
            rows.append({"model": name, "mode": mode, "kernels": n, "busy_us": busy, "wall_us": w,
                         "idle_fraction": max(0.0, 1 - busy / w) if w else float("nan"), "busy_source": source})
    return pd.DataFrame(rows)


PUBLISHED_LAUNCH_US = [
    {"source": "the source article (kernel launch overhead, NVIDIA GPUs, PyTorch)", "low_us": 5.0, "high_us": 15.0},
]
"""Published per-launch costs to compare against, with their sources."""


def runtime_calls(run: Callable[[], Any]) -> dict[str, int]:
    """CUDA runtime and driver API calls (``cuda*``/``cu*`` events on the CPU side of a torch.profiler
    trace) made by one call of ``run``, by name, e.g. ``{"cudaLaunchKernel": 211}`` eager or
    ``{"cudaGraphLaunch": 1}`` for a replay.

    Raises:
        NoCudaError: without a CUDA device.
    """
    import collections

    from torch.profiler import ProfilerActivity

    require_cuda("runtime_calls", _FIX)
    torch.cuda.synchronize()
    with profiler_session(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = (e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU)
    return dict(collections.Counter(n for n in names if n.startswith("cu") and n != "cudaDeviceSynchronize"))


def profile(fn: Callable[[], Any], path: str | Path, *, warmup: int = 2, active: int = 3,
            record_shapes: bool = False) -> Path:
    """Profile ``fn()`` with torch.profiler and write a gzipped Chrome trace that opens in Perfetto.

    ``warmup`` calls run under the profiler's warm-up phase (traced but discarded, so start-up costs
    stay out), then ``active`` calls are recorded, each followed by a device sync. CPU activity always, CUDA
    when available. The session is a :func:`profiler_session`: CUPTI is torn down after it (~100 ms with its
    priming and settling), so timings made later in the process read as they did before it.
    :func:`cgutils.load_trace` reads the file.

    Args:
        fn: callable with no arguments, e.g. ``lambda: model(x)``.
        path: output file; ``.json.gz`` is appended unless it already ends in ``.json`` or ``.json.gz``.
            Missing parent folders are made.
        warmup: traced-and-discarded calls (>= 0).
        active: recorded calls (>= 1).
        record_shapes: record the input shapes of each operator (a larger trace).

    Returns:
        The path written.

    Raises:
        InputError: ``fn`` not callable; ``warmup``/``active`` not ints or out of range; ``record_shapes`` not a
            bool; a ``path`` whose folder cannot be made or written (checked before ``fn`` runs).
    """
    from torch.profiler import ProfilerActivity, schedule

    check_no_arg_callable("profile", fn)
    check_int("warmup", warmup, minimum=0, why="traced calls discarded before the recorded ones")
    check_int("active", active, minimum=1, why="recorded calls")
    if not isinstance(record_shapes, bool):
        raise InputError(f"record_shapes must be True or False, got {record_shapes!r}")
    out = Path(path)
    if not out.name.endswith((".json", ".json.gz")):
        out = out.with_name(out.name + ".json.gz")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"profile cannot make the folder for the trace {out}: {exc}; pass a path you can write") from exc
    if out.is_dir() or not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise InputError(f"profile cannot write the trace to {out}; pass a writable file path")
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profiler_session(activities=acts, record_shapes=record_shapes,
                          schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
                          on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
        for _ in range(warmup + active):
            fn()
            if cuda:
                torch.cuda.synchronize()
            prof.step()
    return out
