"""The speedup table: eager vs GraphRunner vs raw ``torch.cuda.graph`` vs ``torch.compile``.

One run measures every variant of every workload side by side, so ratios are taken under the same
conditions: per workload and dtype, every variant is set up first (capture, compilation), then all are
timed in interleaved trials (:func:`cgutils.timing.interleaved_trials`), a shuffled order per trial, and
each speedup is the median of per-trial ratios. Variants of the step that one timed iteration calls:

* ``eager``: the PyTorch module as is.
* ``graph_runner``: :class:`cgutils.GraphRunner` (copies inputs in, replays, clones outputs).
* ``raw_graph``: a hand-written ``torch.cuda.graph`` capture per input shape; a call is ``copy_``
  into the static input and ``replay()``: the floor that any wrapper adds overhead to.
* ``compile_ro``: ``torch.compile(mode="reduce-overhead")``, Inductor kernels replayed through CUDA
  graph trees.
* ``graph_runner_compiled``: ``GraphRunner(step, compile=True)``: the same Inductor kernels (``mode="default"``)
  captured and replayed by GraphRunner; set up and timed in the same phase and trials as ``compile_ro``.
"""

from __future__ import annotations

import gc
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .. import env
from ..capture import GraphRunner, capture_graph
from ..checks import check_int, require_cuda
from ..errors import InputError
from ..overhead import gpu_activity
from ..timing import interleaved_trials, measure, summarize_trials
from ..workloads import WORKLOADS, Built, get_workload
from .common import Options, error_status, iters_for

VARIANTS = ("eager", "graph_runner", "raw_graph", "compile_ro", "graph_runner_compiled")
VARIANT_LABELS = {"eager": "eager", "graph_runner": "cgutils.GraphRunner",
                  "raw_graph": "raw torch.cuda.graph", "compile_ro": 'torch.compile("reduce-overhead")',
                  "graph_runner_compiled": "GraphRunner(compile=True)"}
COMPILED = ("compile_ro", "graph_runner_compiled")
"""The variants that run Inductor's kernels: set up and timed in the second phase, side by side."""


class RawGraphs:
    """The minimal hand-written runner: one ``torch.cuda.graph`` per input shape, no checks.

    A call copies the inputs into the captured static buffers and replays; it returns the static
    output itself (overwritten by the next replay).
    """

    def __init__(self, fn: Callable[..., Any], warmup: int = 3):
        self.fn, self.warmup = fn, warmup
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple, Any]] = {}
        self.pool = None

    def __call__(self, *args: torch.Tensor) -> Any:
        key = tuple(a.shape for a in args)
        if key not in self.graphs:
            static = tuple(a.clone() for a in args)
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            g, out = capture_graph(lambda: self.fn(*static), warmup=self.warmup, pool=self.pool)
            self.graphs[key] = (g, static, out)
        g, static, out = self.graphs[key]
        for s, a in zip(static, args, strict=False):  # the whole per-call cost: copy in, replay
            s.copy_(a)
        g.replay()
        return out


def make_step(kind: str, built: Built, args: tuple = ()) -> Callable[..., Any] | str:
    """The step implementation for a variant (speedup table) or method (graph-methods table), or a
    string saying why it is skipped. ``raw_graph`` and ``manual_graph`` are the same hand-written graph."""
    if kind == "eager":
        return built.step
    if kind in ("raw_graph", "manual_graph"):
        return RawGraphs(built.step)
    if kind == "graph_runner":
        return GraphRunner(built.step)
    if kind == "make_graphed_callables":
        built.model.requires_grad_(False)  # inference: no backward graph to capture
        return torch.cuda.make_graphed_callables(built.step, args)
    if kind == "compile_ro":
        # Also where shapes change every step (GPT-2 without a KV cache): what reduce-overhead does with a
        # new shape (recompile, record one more graph) is measured, not assumed; notebook 02 shows it.
        return torch.compile(built.step, mode="reduce-overhead")
    if kind == "graph_runner_compiled":
        return GraphRunner(built.step, compile=True)
    if kind == "graph_runner_compiled_static":
        # returns the static outputs, as torch.compile's CUDA graphs do: like for like with compile_ro
        return GraphRunner(built.step, compile=True, clone_outputs=False)
    raise ValueError(kind)


TRIALS = Options.trials
"""Default number of interleaved trials per workload and dtype (the CLI's ``--trials``)."""

COLUMNS = ["workload", "dtype", "variant", "median_ms", "p10_ms", "p90_ms", "n", "trials", "setup_s", "speedup",
           "speedup_p10", "speedup_p90", "gpu_ops", "gpu_time_ms", "forwards", "article_eager_ms", "article_graph_ms", "status",
           "gpu"]
"""Columns of :func:`speedup_table`, in order."""


def trial_iters(ms_per_iter: float, budget_s: float, trials: int) -> int:
    """Timed iterations per variant per trial: the :func:`~cgutils.bench.common.iters_for` budget (10 to
    500 iterations at ``ms_per_iter`` ms) split evenly over ``trials``, at least 1 per trial."""
    return max(1, math.ceil(iters_for(ms_per_iter, budget_s) / trials))


def _measure_workload(wl, dtype: str, variants: list[str], budget_s: float, trials: int, bar,
                      trial_log: list | None = None) -> list[dict]:
    """Rows of the speedup table for one workload and dtype (see :func:`speedup_table`)."""
    built = wl.build(dtype, "cuda")
    inputs = built.inputs(0)
    with torch.no_grad():
        eager_ms = measure(lambda: built.iterate(built.step, inputs), warmup=3, iters=3).median_ms
    common = {"workload": wl.name, "dtype": dtype, "forwards": built.steps_per_iter,
              "article_eager_ms": wl.article_ms[0] if wl.article_ms else None,
              "article_graph_ms": wl.article_ms[1] if wl.article_ms else None,
              "gpu": torch.cuda.get_device_name(0)}
    rows = {v: {**common, "variant": v} for v in variants}
    # Two phases: the hand-captured graphs (GraphRunner, raw) first, freed before torch.compile's CUDA graph
    # trees are set up. With all of them alive together, and a GraphRunner of another BERT freed before,
    # freeing them ended in "CUDA error: unspecified launch failure" on the H200 (torch 2.11, commit 2207457);
    # each pair alone ran clean. Eager runs in both phases, so every speedup is paired within its own trials.
    for number, phase in enumerate(phases(variants)):
        if phase:
            _measure_phase(built, inputs, phase, rows, eager_ms, budget_s, trials, bar, trial_log, number)
        gc.collect()  # drop this phase's graphs before the next phase captures
    bar.update(len(variants))
    return list(rows.values())


def _gpu_work(wl, dtype: str) -> dict:
    """``gpu_ops`` and ``gpu_time_ms`` of one eager iteration of a workload, from torch.profiler.

    Called only once every trial of the table is timed: after a torch.profiler session, launches in the same
    process stay slower (CUPTI stays attached: pytorch/pytorch#144455; ``benchmarks/profiler_aftereffect.py``),
    which would inflate every later timing, eager's most."""
    built = wl.build(dtype, "cuda")
    inputs = built.inputs(0)
    with torch.no_grad():
        gpu_ops, gpu_us = gpu_activity(lambda: built.iterate(built.step, inputs))
    return {"gpu_ops": gpu_ops, "gpu_time_ms": gpu_us / 1e3}


def phases(variants: list[str]) -> tuple[list[str], list[str]]:
    """The two timing phases of one workload and dtype: the hand-captured graphs (and eager), then the
    :data:`COMPILED` variants with eager again as their paired baseline."""
    compiled = [v for v in variants if v in COMPILED]
    return [v for v in variants if v not in compiled], ["eager"] * ("eager" in variants) + compiled


def _measure_phase(built: Built, inputs: tuple, variants: list[str], rows: dict, eager_ms: float, budget_s: float,
                   trials: int, bar, trial_log: list | None, phase: int) -> None:
    """Set up ``variants`` one after the other, then time them in interleaved trials; fills ``rows``. An
    ``eager`` row already filled by an earlier phase keeps its figures (it is this phase's baseline only)."""
    name, dtype = rows[variants[-1]]["workload"], rows[variants[-1]]["dtype"]
    runs: dict[str, Callable[[], Any]] = {}
    # Set-up, one variant after the other: capture or compilation happens here, never while timing.
    # (compile_ro records its CUDA graph tree on a later call: in interleaved_trials' untimed warm-up.)
    # The phase starts from a clean compile cache, reset once: a reset between the compiled variants would
    # throw away the first one's compiled code, and it would recompile inside the trials' warm-up.
    if any(v in COMPILED for v in variants):
        torch._dynamo.reset()
    for variant in variants:
        bar.set_postfix_str(f"{name} {dtype} {variant} set-up")
        try:
            step = make_step(variant, built)
            if isinstance(step, str):
                rows[variant]["status"] = step
                continue
            with torch.no_grad():
                t0 = time.perf_counter()
                built.iterate(step, inputs)
                torch.cuda.synchronize()
                setup_s = time.perf_counter() - t0
            rows[variant].setdefault("setup_s", setup_s)
            runs[variant] = lambda step=step: built.iterate(step, inputs)
        except Exception as exc:  # one failing variant must not lose the rest of the table
            rows[variant]["status"] = error_status(exc, 200)
    if not runs or (set(runs) == {"eager"} and rows["eager"].get("status") == "ok"):
        return  # nothing to time, or only a baseline already measured (its variant failed in set-up)
    bar.set_postfix_str(f"{name} {dtype}: {trials} interleaved trials")
    failed: dict[str, BaseException] = {}
    with torch.no_grad():
        frame = interleaved_trials(runs, trials=trials, iters=trial_iters(eager_ms, budget_s, trials),
                                   warmup=5, failed=failed)
    for variant, exc in failed.items():
        rows[variant]["status"] = error_status(exc, 200)
    baseline_done = rows.get("eager", {}).get("status") == "ok"
    if trial_log is not None:
        trial_log.append(frame.assign(workload=name, dtype=dtype, phase=phase))
    if len(frame):
        summary = summarize_trials(frame, "eager" if "eager" in set(frame.variant) else None)
        for r in summary.to_dict("records"):
            if r["variant"] == "eager" and baseline_done:
                continue
            rows[r["variant"]].update({k: v for k, v in r.items() if k != "variant"}, status="ok")


def speedup_table(workloads: Iterable[str] | None = None, dtypes: Iterable[str] = ("fp32", "fp16"),
                  variants: Iterable[str] = VARIANTS, budget_s: float = 2.0, progress: bool = True,
                  trials: int = TRIALS, trial_log: list | None = None):
    """Measure every (workload, dtype, variant) at batch 1 and return one row per combination.

    Every timing comes before any profiling: one eager iteration per workload and dtype is profiled
    (``gpu_ops``, ``gpu_time_ms``) only after all trials, because launches can stay slower in a process
    torch.profiler has run in (pytorch/pytorch#144455; ``benchmarks/profiler_aftereffect.py``).

    Per workload and dtype, every variant is set up first (its first call: capture or compilation,
    timed as ``setup_s``); then they are timed together in ``trials`` interleaved trials
    (:func:`cgutils.timing.interleaved_trials`: 5 untimed calls per variant first, then per trial one
    untimed and the timed calls of each variant, in a shuffled order). ``compile_ro`` and
    ``graph_runner_compiled`` are set up and timed together in a second phase, with eager again as their
    paired baseline, after the other variants' graphs are freed (see ``_measure_workload``). A variant that fails in set-up or in a trial gets an
    ``error: ...`` row; the others are still measured.

    Args:
        workloads: names from :data:`cgutils.workloads.WORKLOADS`; default all.
        dtypes: ``"fp32"`` and/or ``"fp16"``.
        variants: subset of :data:`VARIANTS`.
        budget_s: approximate timed seconds of eager per workload and dtype: 10 to 500 timed eager
            iterations, chosen from the eager latency and split evenly over the trials (at least 1 per
            trial; :func:`trial_iters`). The graph variants take the same number of iterations.
        progress: show a tqdm progress bar.
        trials: interleaved trials per workload and dtype (>= 1).
        trial_log: if given, one frame per workload and dtype is appended to it: the per-trial rows of
            :func:`cgutils.timing.interleaved_trials` with ``workload``, ``dtype`` and ``phase`` columns
            added (how much each variant moved from trial to trial; the compiled variants are timed in
            phase 1 against their own eager baseline, after the other graphs are freed).

    Returns:
        ``pandas.DataFrame`` with columns ``workload, dtype, variant``, ``median_ms`` (median across
        trials of the per-trial median latency per iteration, ms), ``p10_ms``, ``p90_ms`` (10th and
        90th percentile across trials of those per-trial medians, ms), ``n`` (timed iterations, all
        trials), ``trials``, ``setup_s`` (first call: capture or compilation, s), ``speedup`` (median
        across trials of eager's median / this variant's median in the same trial),
        ``speedup_p10``, ``speedup_p90`` (10th / 90th percentile across trials of those ratios),
        ``gpu_ops`` (GPU activities per iteration, eager), ``gpu_time_ms`` (their summed GPU time, ms, from
        torch.profiler: the GPU's own work, which no replay removes), ``forwards`` (step calls per iteration),
        ``article_eager_ms``, ``article_graph_ms`` (source article, A100), ``status`` (``ok``,
        ``skipped: ...`` or ``error: ...``), ``gpu``. Without an ``eager`` variant the speedups are NaN.

    Raises:
        InputError: ``trials`` is not an int >= 1.
        NoCudaError: without a CUDA device.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    check_int("trials", trials, minimum=1, why="interleaved trials per workload and dtype")
    require_cuda("speedup_table", "`python -m cgutils bench` shows the recorded table instead")
    names = list(workloads) if workloads is not None else list(WORKLOADS)
    dtypes, variants = list(dtypes), list(dict.fromkeys(variants))  # one row per variant
    rows: list[dict] = []
    with tqdm(total=len(names) * len(dtypes) * len(variants), disable=not progress,
              desc="speedup table") as bar:
        for name in names:
            for dtype in dtypes:
                rows += _measure_workload(get_workload(name), dtype, variants, budget_s, trials, bar, trial_log)
                _free_workload()
        # the profiler last: no trial may run in a process it has touched (see _gpu_work)
        for name in names:
            for dtype in dtypes:
                wl = get_workload(name)
                bar.set_postfix_str(f"{wl.name} {dtype}: GPU activities (torch.profiler)")
                try:
                    work = _gpu_work(wl, dtype)
                except Exception as exc:  # the timings stand without it: NaN, and say why
                    warnings.warn(f"speedup_table: profiling {wl.name} {dtype} failed, its gpu_ops and "
                                  f"gpu_time_ms are NaN: {error_status(exc, 200)}", stacklevel=2)
                    work = {"gpu_ops": float("nan"), "gpu_time_ms": float("nan")}
                for r in rows:
                    if r["workload"] == wl.name and r["dtype"] == dtype:
                        r.update(work)
                _free_workload()
    return pd.DataFrame(rows).reindex(columns=COLUMNS)


def _free_workload() -> None:
    gc.collect()  # free this model's weights and graphs before building the next
    torch.cuda.empty_cache()


def eager_reference(table, workload: str, dtype: str) -> dict:
    """The suite's one eager figure for a configuration: its row of a speedup table (as recorded by
    notebook 05), so that other notebooks put their own single measurements next to it.

    Args:
        table: a :func:`speedup_table` frame.
        workload, dtype: e.g. ``"bert-base-seq128"``, ``"fp16"``.

    Returns:
        ``{"median_ms", "p10_ms", "p90_ms", "trials"}`` (``trials`` is NaN for a table measured before
        interleaved trials; its p10/p90 are then over calls of one block).

    Raises:
        InputError: the table has no ``ok`` eager row for that workload and dtype.
    """
    rows = table[(table.workload == workload) & (table.dtype == dtype) & (table.variant == "eager")
                 & (table.status == "ok")]
    if rows.empty:
        raise InputError(f"no eager row for {workload} {dtype} in the speedup table; its workloads: "
                         f"{sorted(set(table.workload))}, dtypes: {sorted(set(table.dtype))}")
    r = rows.iloc[0]
    return {"median_ms": float(r.median_ms), "p10_ms": float(r.p10_ms), "p90_ms": float(r.p90_ms),
            "trials": float(r.get("trials", float("nan")))}


GRAPH_VARIANTS = ("graph_runner", "raw_graph", "compile_ro", "graph_runner_compiled")
"""The variants whose speedup over eager the summary shows."""


def has_trial_ranges(df) -> bool:
    """Whether a speedup table was measured in interleaved trials (it has ``trials``, ``speedup_p10``
    and ``speedup_p90``). Tables recorded before then timed each variant in one block: no ranges."""
    return {"trials", "speedup_p10", "speedup_p90"} <= set(df.columns) and bool(df["trials"].notna().any())


def summary_table(df) -> Any:
    """Wide view of a speedup table: one row per workload and dtype, median ms per variant, and the
    graph speedups; the source article's A100 figures alongside.

    For a table measured in interleaved trials (:func:`has_trial_ranges`), each variant's ms column
    ``<v>`` is followed by ``<v>_p10`` and ``<v>_p90`` (10th / 90th percentile across trials of the
    per-trial medians, ms); ``<v>_speedup`` is the paired speedup (median across trials of eager / ``v``
    in the same trial) followed by ``<v>_speedup_p10`` and ``<v>_speedup_p90``; a last column
    ``trials`` gives the fewest trials of the row's variants. For an older table, ``<v>_speedup`` is
    eager's median / ``v``'s median and there are no range columns. ``gpu_time_ms`` (one eager iteration's
    summed GPU time) is carried over where the table has it.
    """
    import pandas as pd

    ok = df[df.status == "ok"]
    index = ["workload", "dtype"]
    wide = ok.pivot_table(index=index, columns="variant", values="median_ms")
    wide = wide.reindex(columns=[v for v in VARIANTS if v in wide.columns])
    ranged = has_trial_ranges(df)

    def pivot(col: str):
        return ok.pivot_table(index=index, columns="variant", values=col).reindex(index=wide.index,
                                                                                  columns=wide.columns)

    if ranged:
        out = pd.DataFrame(index=wide.index)
        lo, hi = pivot("p10_ms"), pivot("p90_ms")
        for v in wide.columns:
            out[v], out[f"{v}_p10"], out[f"{v}_p90"] = wide[v], lo[v], hi[v]
    else:
        out = wide.copy()
    if "eager" in wide:
        if ranged:
            mid, lo, hi = pivot("speedup"), pivot("speedup_p10"), pivot("speedup_p90")
        for v in GRAPH_VARIANTS:
            if v not in wide:
                continue
            if ranged:
                out[f"{v}_speedup"], out[f"{v}_speedup_p10"], out[f"{v}_speedup_p90"] = mid[v], lo[v], hi[v]
            else:
                out[f"{v}_speedup"] = wide["eager"] / wide[v]
    art = df.drop_duplicates(["workload", "dtype"]).set_index(["workload", "dtype"])
    out["article_a100_eager_ms"] = art["article_eager_ms"]
    out["article_a100_graph_ms"] = art["article_graph_ms"]
    out["article_speedup"] = art["article_eager_ms"] / art["article_graph_ms"]
    out["gpu_ops_per_forward"] = art["gpu_ops"] / art["forwards"]
    if "gpu_time_ms" in art:  # tables recorded before 2026-12-02 lack it
        out["gpu_time_ms"] = art["gpu_time_ms"]
    if ranged:
        out["trials"] = ok.groupby(index)["trials"].min()
    return out.reset_index()


def markdown_table(df, prov: dict) -> str:
    """The README's results table: per workload and dtype, eager and graph latencies (ms), speedups,
    and the source article's A100 figures; followed by a provenance line from ``prov``.

    For a table measured in interleaved trials, eager ms and the GraphRunner speedup show their range
    across trials, e.g. ``8.77× (8.61–8.90)``, and the last line says how many trials; an older table
    (no ``trials`` column) gives the table it always gave.
    """
    import pandas as pd

    s = summary_table(df)
    ranged = has_trial_ranges(df)

    def num(v):
        return f"{v:.2f}"

    def ms(v):
        return "n/a" if v != v else num(v)

    def x(v):
        return "n/a" if v != v else f"{v:.2f}×"

    def spread(r, col):  # " (p10–p90)" across trials, or nothing
        lo, hi = r.get(f"{col}_p10", float("nan")), r.get(f"{col}_p90", float("nan"))
        return f" ({num(lo)}–{num(hi)})" if ranged and lo == lo and hi == hi else ""

    rows = []
    for _, r in s.iterrows():
        rows.append({
            "workload": r["workload"], "dtype": r["dtype"],
            "eager ms": ms(r.get("eager", float("nan"))) + spread(r, "eager"),
            "GraphRunner ms": ms(r.get("graph_runner", float("nan"))),
            "speedup": x(r.get("graph_runner_speedup", float("nan"))) + spread(r, "graph_runner_speedup"),
            "raw graph ms": ms(r.get("raw_graph", float("nan"))),
            "compile (reduce-overhead) ms": ms(r.get("compile_ro", float("nan"))),
            **({"GraphRunner(compile=True) ms": ms(r.get("graph_runner_compiled", float("nan")))}
               if "graph_runner_compiled" in s else {}),
            "article A100": f"{ms(r['article_a100_eager_ms'])} → {ms(r['article_a100_graph_ms'])} ms "
                            f"({x(r['article_speedup'])})",
        })
    table = pd.DataFrame(rows).to_markdown(index=False)
    if not ranged:
        return f"{table}\n\nMeasured on {env.describe(prov)}; batch 1, median of CUDA-event timings."
    counts = sorted({int(t) for t in df.loc[df.status == "ok", "trials"].dropna()})
    n = f"{counts[0]}" if counts[0] == counts[-1] else f"{counts[0]}–{counts[-1]}"
    return (f"{table}\n\nMeasured on {env.describe(prov)}; batch 1, CUDA-event timings; median of {n} "
            "interleaved trials; range p10–p90 across trials.")


def measure_suite(opts: Options) -> tuple:
    """The suite's tables, in the registry's order: ``(speedup,)``."""
    variants = opts.variants if opts.variants is not None else VARIANTS
    return (speedup_table(opts.workloads, opts.dtypes, variants, budget_s=opts.budget_s, trials=opts.trials),)


def report(frames: Mapping[str, Any], source: str, prov: dict, markdown: bool) -> None:
    """Print the speedup table's wide summary, or with ``markdown`` the README's table (no source
    line: the table's last line states the provenance)."""
    import pandas as pd

    df = frames["speedup"]
    if markdown:
        print(markdown_table(df, prov))
        return
    if has_trial_ranges(df):
        print("Median latency per iteration in ms (eager, graph_runner, raw_graph, compile_ro, "
              "graph_runner_compiled where measured): the median "
              "across interleaved trials of each trial's median, *_p10/*_p90 its range across trials; speedups "
              "are paired: the median across trials of eager / variant in the same trial; article_* are the "
              "source article's A100 figures.")
    else:
        print("Median latency per iteration in ms (eager, graph_runner, raw_graph, compile_ro); speedups are "
              "eager / variant from the same run; article_* are the source article's A100 figures.")
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.precision", 3):
        print(summary_table(df).to_string(index=False))
    for _, r in df[df.status != "ok"].iterrows():
        print(f"  note: {r['workload']} {r['dtype']} {r['variant']}: {r['status']}")
    print(f"Source: {source}")
