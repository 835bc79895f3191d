"""Four ways to get a CUDA graph (notebook 02): manual ``torch.cuda.graph``,
``torch.cuda.make_graphed_callables``, ``torch.compile(mode="reduce-overhead")`` and
:class:`cgutils.GraphRunner` (plain and on a compiled step), on the same model, measured in one run."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..checks import require_cuda
from ..timing import measure
from ..workloads import get_workload
from .common import Options, error_status, print_tables
from .speedup import make_step

METHODS = ("eager", "manual_graph", "make_graphed_callables", "compile_ro", "graph_runner", "graph_runner_compiled",
           "graph_runner_compiled_static")
METHOD_LABELS = {
    "eager": "eager (no graph)",
    "manual_graph": "manual torch.cuda.graph",
    "make_graphed_callables": "torch.cuda.make_graphed_callables",
    "compile_ro": 'torch.compile(mode="reduce-overhead")',
    "graph_runner": "cgutils.GraphRunner",
    "graph_runner_compiled": "cgutils.GraphRunner(fn, compile=True)",
    "graph_runner_compiled_static": "cgutils.GraphRunner(fn, compile=True, clone_outputs=False)",
}


def _measure_method(wname: str, method: str, dtype: str, iters: int) -> dict:
    row = {"workload": wname, "dtype": dtype, "method": method, "gpu": torch.cuda.get_device_name(0)}
    # Forget earlier compilations (and free their CUDA graph pools) before the memory baseline, not
    # after it: freeing them inside the measured window made the extra memory come out negative.
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    built = get_workload(wname).build(dtype, "cuda")
    args = built.inputs(0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            step = make_step(method, built, args)
            out = step(*args)
            torch.cuda.synchronize()
            setup_s = time.perf_counter() - t0
            del out
            extra = torch.cuda.memory_reserved() - before
            t = measure(lambda: step(*args), warmup=10, iters=iters)
        return {**row, **t.as_dict(), "setup_s": setup_s, "extra_reserved_bytes": extra, "status": "ok"}
    except Exception as exc:  # how a method fails is part of the comparison
        return {**row, "status": error_status(exc, 240)}


def graph_methods_table(workloads: Iterable[str] = ("bert-base-seq128", "resnet50"), dtype: str = "fp16",
                        methods: Iterable[str] = METHODS, iters: int = 200, progress: bool = True):
    """The ways of getting a CUDA graph in PyTorch, on the same model, measured in one run.

    Each method gets a freshly built model. ``setup_s`` is the first call (capture, or compilation
    plus capture), ``extra_reserved_bytes`` the growth of ``torch.cuda.memory_reserved()`` over that
    first call (after ``empty_cache``), ``us_over_manual`` the per-call difference to the manual graph.

    Returns:
        DataFrame with columns ``workload, dtype, method, median_ms, p10_ms, p90_ms, n, setup_s,
        extra_reserved_bytes, us_over_manual, status, gpu``.

    Raises:
        NoCudaError: without a CUDA device.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    require_cuda("graph_methods_table", "`python -m cgutils bench methods` shows the recorded table instead")
    combos = [(w, m) for w in workloads for m in methods]
    rows = []
    for wname, method in tqdm(combos, desc="graph methods", disable=not progress):
        rows.append(_measure_method(wname, method, dtype, iters))
        gc.collect()  # the previous method's model and graphs die here, before the next baseline
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    if "median_ms" in df:
        manual = df[df.method == "manual_graph"].set_index("workload").median_ms
        df["us_over_manual"] = [(m - manual.get(w, float("nan"))) * 1e3 for w, m in zip(df.workload, df.median_ms)]
    return df


def method_targets(df) -> Any:
    """The issue's targets for the graph-methods table, as ratios measured in the same run.

    Returns:
        DataFrame per workload: ``runner_us_over_raw`` (GraphRunner minus the manual graph, µs per call;
        target <= 10), ``runner_vs_compile_ro`` and ``runner_compiled_vs_compile_ro`` (median latency
        ratios against ``torch.compile(mode="reduce-overhead")``; target <= 1), and
        ``runner_compiled_static_vs_compile_ro``: the same with ``clone_outputs=False``, which returns the
        static outputs as reduce-overhead does (like for like: no output copy).
    """
    import pandas as pd

    ok = df[df.status == "ok"].pivot_table(index="workload", columns="method", values="median_ms")
    rows = []
    nan = float("nan")
    for w, r in ok.iterrows():
        ms = {m: r.get(m, nan) for m in METHODS}  # a method that failed or was not run gives NaN ratios
        rows.append({"workload": w,
                     "runner_us_over_raw": (ms["graph_runner"] - ms["manual_graph"]) * 1e3,
                     "runner_vs_compile_ro": ms["graph_runner"] / ms["compile_ro"],
                     "runner_compiled_vs_compile_ro": ms["graph_runner_compiled"] / ms["compile_ro"],
                     "runner_compiled_static_vs_compile_ro": ms["graph_runner_compiled_static"] / ms["compile_ro"]})
    return pd.DataFrame(rows)


def measure_suite(opts: Options) -> tuple:
    """The suite's tables, in the registry's order: ``(graph_methods,)``."""
    return (graph_methods_table(),)


def report(frames: Mapping[str, Any], source: str, prov: dict, markdown: bool) -> None:
    """Print the graph-methods table and the issue's targets computed from it."""
    print_tables(frames, markdown)
    print("\ntargets (same run): GraphRunner <= 10 µs over the manual graph; ratios to "
          "torch.compile(reduce-overhead) <= 1")
    print(method_targets(frames["graph_methods"]).to_string(index=False, float_format="%.3f"))
    print(f"Source: {source}")
