"""The speedup table: eager vs GraphRunner vs raw ``torch.cuda.graph`` vs ``torch.compile``.

One run measures every variant of every workload side by side, so ratios are taken under the same
conditions. Variants of the step that one timed iteration calls:

* ``eager``: the PyTorch module as is.
* ``graph_runner``: :class:`cgutils.GraphRunner` (copies inputs in, replays, clones outputs).
* ``raw_graph``: a hand-written ``torch.cuda.graph`` capture per input shape; a call is ``copy_``
  into the static input and ``replay()``: the floor that any wrapper adds overhead to.
* ``compile_ro``: ``torch.compile(mode="reduce-overhead")``, Inductor kernels replayed through CUDA
  graph trees. Skipped where shapes change every step (GPT-2 full-recompute decoding).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .. import env
from ..capture import GraphRunner, capture_graph
from ..checks import require_cuda
from ..overhead import gpu_activity
from ..timing import measure
from ..workloads import WORKLOADS, Built, get_workload
from .common import Options, error_status, iters_for

VARIANTS = ("eager", "graph_runner", "raw_graph", "compile_ro")
VARIANT_LABELS = {"eager": "eager", "graph_runner": "cgutils.GraphRunner",
                  "raw_graph": "raw torch.cuda.graph", "compile_ro": 'torch.compile("reduce-overhead")'}


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
        if built.shapes_change:
            return "skipped: input shape changes every step (one recompilation per length)"
        return torch.compile(built.step, mode="reduce-overhead")
    if kind == "graph_runner_compiled":
        return GraphRunner(built.step, compile=True)
    if kind == "graph_runner_compiled_static":
        # returns the static outputs, as torch.compile's CUDA graphs do: like for like with compile_ro
        return GraphRunner(built.step, compile=True, clone_outputs=False)
    raise ValueError(kind)


def _measure_workload(wl, dtype: str, variants: list[str], budget_s: float, bar) -> list[dict]:
    """Rows of the speedup table for one workload and dtype (see :func:`speedup_table`)."""
    built = wl.build(dtype, "cuda")
    inputs = built.inputs(0)
    with torch.no_grad():
        eager_ms = measure(lambda: built.iterate(built.step, inputs), warmup=3, iters=3).median_ms
        gpu_ops, _ = gpu_activity(lambda: built.iterate(built.step, inputs))
    iters = iters_for(eager_ms, budget_s)
    common = {"workload": wl.name, "dtype": dtype, "gpu_ops": gpu_ops, "forwards": built.steps_per_iter,
              "article_eager_ms": wl.article_ms[0] if wl.article_ms else None,
              "article_graph_ms": wl.article_ms[1] if wl.article_ms else None,
              "gpu": torch.cuda.get_device_name(0)}
    rows = []
    for variant in variants:
        bar.set_postfix_str(f"{wl.name} {dtype} {variant}")
        row = {**common, "variant": variant}
        if variant == "compile_ro":
            torch._dynamo.reset()  # each compiled variant starts from a clean cache
        step = make_step(variant, built)
        if isinstance(step, str):
            rows.append({**row, "status": step})
            bar.update()
            continue
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                built.iterate(step, inputs)  # capture or compilation happens here
                torch.cuda.synchronize()
                setup_s = time.perf_counter() - t0
                t = measure(lambda step=step: built.iterate(step, inputs), warmup=5, iters=iters)
            rows.append({**row, **t.as_dict(), "setup_s": setup_s, "status": "ok"})
        except Exception as exc:  # one failing variant must not lose the rest of the table
            rows.append({**row, "status": error_status(exc, 200)})
        bar.update()
    return rows


def speedup_table(workloads: Iterable[str] | None = None, dtypes: Iterable[str] = ("fp32", "fp16"),
                  variants: Iterable[str] = VARIANTS, budget_s: float = 2.0, progress: bool = True):
    """Measure every (workload, dtype, variant) at batch 1 and return one row per combination.

    Args:
        workloads: names from :data:`cgutils.workloads.WORKLOADS`; default all.
        dtypes: ``"fp32"`` and/or ``"fp16"``.
        variants: subset of :data:`VARIANTS`.
        budget_s: approximate timed seconds per row; iterations are chosen from the eager latency
            (10 to 500).
        progress: show a tqdm progress bar.

    Returns:
        ``pandas.DataFrame`` with columns ``workload, dtype, variant, median_ms, p10_ms, p90_ms, n,
        setup_s`` (first call: capture or compilation, s), ``speedup`` (eager median / this median,
        same run), ``gpu_ops`` (GPU activities per iteration, eager), ``forwards`` (step calls per
        iteration), ``article_eager_ms``,
        ``article_graph_ms`` (source article, A100), ``status`` (``ok``, ``skipped: ...`` or
        ``error: ...``), ``gpu``.

    Raises:
        NoCudaError: without a CUDA device.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    require_cuda("speedup_table", "`python -m cgutils bench` shows the recorded table instead")
    names = list(workloads) if workloads is not None else list(WORKLOADS)
    dtypes, variants = list(dtypes), list(variants)
    rows: list[dict] = []
    with tqdm(total=len(names) * len(dtypes) * len(variants), disable=not progress,
              desc="speedup table") as bar:
        for name in names:
            for dtype in dtypes:
                rows += _measure_workload(get_workload(name), dtype, variants, budget_s, bar)
                gc.collect()  # free this model's weights and graphs before building the next
                torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    eager = df[df.variant == "eager"].set_index(["workload", "dtype"])["median_ms"]
    df["speedup"] = [eager.get((w, d), float("nan")) / m if m == m else float("nan")
                     for w, d, m in zip(df.workload, df.dtype, df.get("median_ms", [float("nan")] * len(df)), strict=False)]
    cols = ["workload", "dtype", "variant", "median_ms", "p10_ms", "p90_ms", "n", "setup_s", "speedup",
            "gpu_ops", "forwards", "article_eager_ms", "article_graph_ms", "status", "gpu"]
    return df.reindex(columns=cols)


def summary_table(df) -> Any:
    """Wide view of a speedup table: one row per workload and dtype, median ms per variant, and the
    graph speedups; the source article's A100 figures alongside."""
    ok = df[df.status == "ok"]
    wide = ok.pivot_table(index=["workload", "dtype"], columns="variant", values="median_ms")
    wide = wide.reindex(columns=[v for v in VARIANTS if v in wide.columns])
    out = wide.copy()
    if "eager" in wide:
        for v in ("graph_runner", "raw_graph", "compile_ro"):
            if v in wide:
                out[f"{v}_speedup"] = wide["eager"] / wide[v]
    art = df.drop_duplicates(["workload", "dtype"]).set_index(["workload", "dtype"])
    out["article_a100_eager_ms"] = art["article_eager_ms"]
    out["article_a100_graph_ms"] = art["article_graph_ms"]
    out["article_speedup"] = art["article_eager_ms"] / art["article_graph_ms"]
    out["gpu_ops_per_forward"] = art["gpu_ops"] / art["forwards"]
    return out.reset_index()


def markdown_table(df, prov: dict) -> str:
    """The README's results table: per workload and dtype, eager and graph latencies (ms), speedups,
    and the source article's A100 figures; followed by a provenance line from ``prov``."""
    import pandas as pd

    s = summary_table(df)

    def ms(v):
        return "n/a" if v != v else f"{v:.2f}"

    def x(v):
        return "n/a" if v != v else f"{v:.2f}×"

    rows = []
    for _, r in s.iterrows():
        rows.append({
            "workload": r["workload"], "dtype": r["dtype"],
            "eager ms": ms(r.get("eager", float("nan"))),
            "GraphRunner ms": ms(r.get("graph_runner", float("nan"))),
            "speedup": x(r.get("graph_runner_speedup", float("nan"))),
            "raw graph ms": ms(r.get("raw_graph", float("nan"))),
            "compile (reduce-overhead) ms": ms(r.get("compile_ro", float("nan"))),
            "article A100": f"{ms(r['article_a100_eager_ms'])} → {ms(r['article_a100_graph_ms'])} ms "
                            f"({x(r['article_speedup'])})",
        })
    table = pd.DataFrame(rows).to_markdown(index=False)
    return f"{table}\n\nMeasured on {env.describe(prov)}; batch 1, median of CUDA-event timings."


def measure_suite(opts: Options) -> tuple:
    """The suite's tables, in the registry's order: ``(speedup,)``."""
    variants = opts.variants if opts.variants is not None else VARIANTS
    return (speedup_table(opts.workloads, opts.dtypes, variants, budget_s=opts.budget_s),)


def report(frames: Mapping[str, Any], source: str, prov: dict, markdown: bool) -> None:
    """Print the speedup table's wide summary, or with ``markdown`` the README's table (no source
    line: the table's last line states the provenance)."""
    import pandas as pd

    df = frames["speedup"]
    if markdown:
        print(markdown_table(df, prov))
        return
    print("Median latency per iteration in ms (eager, graph_runner, raw_graph, compile_ro); speedups are "
          "eager / variant from the same run; article_* are the source article's A100 figures.")
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.precision", 3):
        print(summary_table(df).to_string(index=False))
    for _, r in df[df.status != "ok"].iterrows():
        print(f"  note: {r['workload']} {r['dtype']} {r['variant']}: {r['status']}")
    print(f"Source: {source}")
