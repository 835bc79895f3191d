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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import env
from .capture import GraphRunner, capture_graph
from .errors import NoCudaError
from .overhead import gpu_activity
from .timing import measure, summarize
from .workloads import WORKLOADS, Built, get_workload

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


def _iters_for(ms_per_iter: float, budget_s: float) -> int:
    return int(min(500, max(10, budget_s * 1e3 / max(ms_per_iter, 1e-3))))


def _measure_workload(wl, dtype: str, variants: list[str], budget_s: float, bar) -> list[dict]:
    """Rows of the speedup table for one workload and dtype (see :func:`speedup_table`)."""
    built = wl.build(dtype, "cuda")
    inputs = built.inputs(0)
    with torch.no_grad():
        eager_ms = measure(lambda: built.iterate(built.step, inputs), warmup=3, iters=3).median_ms
        gpu_ops, _ = gpu_activity(lambda: built.iterate(built.step, inputs))
    iters = _iters_for(eager_ms, budget_s)
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
            rows.append({**row, "status": _error_status(exc, 200)})
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

    if not env.cuda_available():
        raise NoCudaError("speedup_table measures on a CUDA GPU and none is visible; "
                          "`python -m cgutils bench` shows the recorded table instead")
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
    from .env import describe

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
    import pandas as pd

    table = pd.DataFrame(rows).to_markdown(index=False)
    return f"{table}\n\nMeasured on {describe(prov)}; batch 1, median of CUDA-event timings."


# --- generation (notebook 06) -------------------------------------------------------------------------

DECODERS = ("hf_dynamic", "hf_static", "cgutils_eager", "cgutils_graph", "cgutils_graph_fused", "cgutils_compile")
DECODER_LABELS = {"hf_dynamic": "transformers generate (dynamic cache)",
                  "hf_static": 'transformers generate (cache_implementation="static")',
                  "cgutils_eager": "cgutils static cache, eager", "cgutils_graph": "cgutils static cache, graph",
                  "cgutils_graph_fused": "cgutils static cache, graph of the Inductor-fused step",
                  "cgutils_compile": 'cgutils static cache, torch.compile("reduce-overhead")'}


def _error_status(exc: BaseException, limit: int) -> str:
    """A table's status cell for a variant that failed: the exception class and its first line."""
    return f"error: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:limit]}"


def _gpt2(dtype: str):
    if not env.cuda_available():
        raise NoCudaError("the generation benchmarks measure on a CUDA GPU and none is visible")
    return get_workload("gpt2-generate100").build(dtype, "cuda").model  # the speedup table's GPT-2, same weights


def generation_table(dtype: str = "fp16", batch: int = 1, prompt_len: int = 32, new_tokens: int = 100,
                     decoders: Iterable[str] = DECODERS, budget_s: float = 3.0, progress: bool = True):
    """Greedy GPT-2 generation of ``new_tokens`` tokens, every decoder measured in one run.

    Returns:
        ``pandas.DataFrame``, one row per decoder: ``decoder, median_ms, p10_ms, p90_ms, n`` (one whole
        generate call, ms), ``ms_per_token``, ``tokens_per_s``, ``setup_s`` (first call: capture or
        compilation, s), ``vs_graph`` (median / graphed median), ``same_tokens_as_hf`` (output equals
        transformers' dynamic-cache greedy output), ``status``, ``dtype``, ``batch``, ``gpu``.

    Raises:
        NoCudaError: without a CUDA device.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from .generation import GreedyDecoder, hf_generate

    if not env.cuda_available():
        raise NoCudaError("generation_table measures on a CUDA GPU and none is visible")
    model = _gpt2(dtype)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).cuda()
    reference = hf_generate(model, prompt, new_tokens)
    runs = {
        "hf_dynamic": lambda: hf_generate(model, prompt, new_tokens),
        "hf_static": lambda: hf_generate(model, prompt, new_tokens, cache_implementation="static"),
    }
    decs = {"cgutils_eager": GreedyDecoder(model, "eager"), "cgutils_graph": GreedyDecoder(model, "graph"),
            "cgutils_graph_fused": GreedyDecoder(model, "graph", fuse=True),
            "cgutils_compile": GreedyDecoder(model, "compile")}
    for name, dec in decs.items():
        runs[name] = (lambda d: lambda: d.generate(prompt, new_tokens))(dec)
    rows = []
    for name in tqdm(list(decoders), desc="generation", disable=not progress):
        row = {"decoder": name, "dtype": dtype, "batch": batch, "gpu": torch.cuda.get_device_name(0)}
        try:
            t0 = time.perf_counter()
            out = runs[name]()
            torch.cuda.synchronize()
            setup_s = time.perf_counter() - t0
            est = measure(runs[name], warmup=1, iters=1).median_ms
            t = measure(runs[name], warmup=1, iters=_iters_for(est, budget_s))
            rows.append({**row, **t.as_dict(), "setup_s": setup_s, "status": "ok",
                         "same_tokens_as_hf": bool(torch.equal(out, reference))})
        except Exception as exc:  # report, do not lose the other rows
            rows.append({**row, "status": _error_status(exc, 200)})
    df = pd.DataFrame(rows)
    if "median_ms" in df:
        df["ms_per_token"] = df["median_ms"] / new_tokens
        df["tokens_per_s"] = batch * new_tokens / (df["median_ms"] / 1e3)
        graph_ms = df.loc[df.decoder == "cgutils_graph", "median_ms"]
        df["vs_graph"] = df["median_ms"] / (graph_ms.iloc[0] if len(graph_ms) else float("nan"))
    return df


def decode_step_times(dtype: str = "fp16", prompt_len: int = 32, new_tokens: int = 100,
                      modes: Iterable[str] = ("eager", "graph")):
    """Per-token decode latency (ms, CUDA events) over one generation, per decoder mode.

    Returns:
        ``pandas.DataFrame`` with columns ``mode, step, ms`` (step 1 is the first decode step after
        the prefill).
    """
    import pandas as pd

    from .generation import GreedyDecoder

    model = _gpt2(dtype)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1)).cuda()
    rows = []
    for mode in modes:
        dec = GreedyDecoder(model, mode)
        dec.generate(prompt, new_tokens)  # warm-up and capture
        times: list[float] = []
        dec.generate(prompt, new_tokens, step_times=times)
        rows += [{"mode": mode, "step": i + 1, "ms": ms} for i, ms in enumerate(times)]
    return pd.DataFrame(rows)


def batch_sweep(dtype: str = "fp16", batches: Iterable[int] = range(1, 9), prompt_len: int = 32,
                new_tokens: int = 100, modes: Iterable[str] = ("eager", "graph"), budget_s: float = 1.0):
    """Tokens per second against batch size, padded to batch buckets (1, 2, 4, 8).

    Returns:
        ``pandas.DataFrame`` with columns ``mode, batch, bucket, median_ms, tokens_per_s``.
    """
    import pandas as pd

    from .generation import BATCH_BUCKETS, GreedyDecoder, _bucket

    model = _gpt2(dtype)
    rows = []
    for mode in modes:
        dec = GreedyDecoder(model, mode)
        for b in batches:
            prompt = torch.randint(0, model.config.vocab_size, (b, prompt_len),
                                   generator=torch.Generator().manual_seed(b)).cuda()
            t = measure(lambda p=prompt, d=dec: d.generate(p, new_tokens), warmup=2,
                        iters=_iters_for(50.0 if mode == "graph" else 500.0, budget_s))
            rows.append({"mode": mode, "batch": b, "bucket": _bucket(b, BATCH_BUCKETS, "batch size"),
                         "median_ms": t.median_ms, "tokens_per_s": b * new_tokens / (t.median_ms / 1e3)})
    return pd.DataFrame(rows)


# --- four ways to get a graph (notebook 02) --------------------------------------------------------------

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
        return {**row, "status": _error_status(exc, 240)}


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

    if not env.cuda_available():
        raise NoCudaError("graph_methods_table measures on a CUDA GPU and none is visible")
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


# --- memory per captured graph (notebook 03) -------------------------------------------------------------

MEMORY_SEQS = (64, 128, 192, 256, 320, 384, 448, 512)
MEMORY_BUCKETS = (128, 256, 512)


def memory_table(seqs: Iterable[int] = MEMORY_SEQS, buckets: Iterable[int] = MEMORY_BUCKETS,
                 dtype: str = "fp16", progress: bool = True):
    """Memory of CUDA graphs for BERT-base at several sequence lengths, three ways (batch 1).

    * ``own_pool``: one GraphRunner (hence one private memory pool) per length, as a naive
      "one graph per shape" setup does; the source article warns this wastes memory.
    * ``shared_pool``: one GraphRunner, one graph per length, all in one pool, captured longest first.
    * ``buckets``: one GraphRunner with ``buckets={1: buckets}``, longest first: lengths padded up to the next bucket,
      so ``len(buckets)`` graphs serve every length.

    Memory is what the graphs added, in bytes: growth of ``torch.cuda.memory_reserved()`` from before
    the first capture (after ``empty_cache``), plus the per-graph pool growth from GraphRunner stats.

    Returns:
        DataFrame with columns ``setup, shapes`` (lengths served so far), ``graphs`` (captured so far),
        ``reserved_bytes`` (growth of ``memory_reserved`` since the setup began; it can drop, because
        ``torch.cuda.graph`` empties the allocator cache before capturing), ``pool_bytes`` (cumulative
        growth of the graphs' pools), ``capture_ms``
        (that length's capture, 0 when no new graph), ``gpu``.

    Raises:
        NoCudaError: without a CUDA device.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    if not env.cuda_available():
        raise NoCudaError("memory_table captures graphs on a CUDA GPU and none is visible")
    seqs, buckets = sorted(seqs), tuple(sorted(buckets))
    built = get_workload("bert-base-seq128").build(dtype, "cuda")
    gpu = torch.cuda.get_device_name(0)

    setups = {"own_pool": list(seqs), "shared_pool": sorted(seqs, reverse=True), "buckets": sorted(seqs, reverse=True)}
    bar = tqdm(total=sum(len(v) for v in setups.values()), desc="graph memory", disable=not progress)
    # One untimed capture first: cuBLAS workspaces and other one-time allocations then sit in every
    # setup's baseline instead of in the first setup's growth.
    _memory_setup(built, "warm", [max(seqs)], buckets, gpu, None)
    rows = []
    for setup, order in setups.items():
        rows += _memory_setup(built, setup, order, buckets, gpu, bar)
    bar.close()
    return pd.DataFrame(rows)


def _memory_setup(built: Built, setup: str, order: list[int], buckets: tuple, gpu: str, bar) -> list[dict]:
    """One setup of :func:`memory_table`. A function of its own so that every runner (and its pool)
    is released on return, before the next setup's baseline: a runner still bound to a loop variable
    freed its pool inside the next setup's window and made that setup's growth look smaller."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    shared = {"shared_pool": lambda: GraphRunner(built.model),
              "buckets": lambda: GraphRunner(built.model, buckets={1: buckets})}.get(setup)
    runners = [shared()] if shared else []
    rows, pool = [], 0
    for i, n in enumerate(order, 1):
        if shared is None:
            runners.append(GraphRunner(built.model))
        ids = torch.randint(0, built.model.config.vocab_size, (1, n), device="cuda")
        graphs_before = runners[-1].stats.captures
        runners[-1](input_ids=ids, attention_mask=torch.ones_like(ids))
        torch.cuda.synchronize()
        st = runners[-1].stats
        new = st.graphs[-1] if st.captures > graphs_before else None
        pool += new.pool_bytes if new else 0
        rows.append({"setup": setup, "shapes": i, "seq": n, "graphs": sum(r.stats.captures for r in runners),
                     "reserved_bytes": torch.cuda.memory_reserved() - before, "pool_bytes": pool,
                     "capture_ms": new.capture_ms if new else 0.0, "gpu": gpu})
        if bar is not None:
            bar.update()
    return rows


def validation_cost(seqs: Iterable[int] = (128, 512), dtype: str = "fp16", repeats: int = 11, progress: bool = True):
    """What validation at capture costs: GraphRunner capture time with and without it (BERT-base).

    Each repeat builds a new GraphRunner and times its first call (warm-up, capture, and with
    ``validate=True`` one extra replay, one output clone and the comparison); cuBLAS/cuDNN are warm
    from untimed calls first, and the two settings alternate so that drift affects both.

    Returns:
        DataFrame with columns ``seq, validate, capture_ms`` (median over repeats), ``p10_ms``,
        ``p90_ms``, ``gpu``.

    Raises:
        NoCudaError: without a CUDA device.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    if not env.cuda_available():
        raise NoCudaError("validation_cost captures graphs on a CUDA GPU and none is visible")
    built = get_workload("bert-base-seq128").build(dtype, "cuda")
    rows = []
    for n in tqdm(list(seqs), desc="validation cost", disable=not progress):
        ids = torch.randint(0, built.model.config.vocab_size, (1, n), device="cuda")
        mask = torch.ones_like(ids)
        for validate in (False, True):  # untimed: warm cuBLAS/cuDNN for this shape
            GraphRunner(built.model, validate=validate)(input_ids=ids, attention_mask=mask)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for validate in (False, True):  # interleaved, so that drift hits both alike
                runner = GraphRunner(built.model, validate=validate)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner(input_ids=ids, attention_mask=mask)
                torch.cuda.synchronize()
                times[validate].append((time.perf_counter() - t0) * 1e3)
                del runner
        for validate, ts in times.items():
            t = summarize(ts, "perf_counter")
            rows.append({"seq": n, "validate": validate, "capture_ms": t.median_ms, "p10_ms": t.p10_ms,
                         "p90_ms": t.p90_ms, "gpu": torch.cuda.get_device_name(0)})
    return pd.DataFrame(rows)
