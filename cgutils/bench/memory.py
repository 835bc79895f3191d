"""Memory per captured graph (notebook 03b): one pool per shape, one shared pool, buckets; and what
validation at capture costs."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..capture import GraphRunner
from ..checks import require_cuda
from ..timing import summarize
from ..workloads import Built, get_workload
from .common import Options, print_tables

_FIX = "`python -m cgutils bench memory` shows the recorded tables instead"

MEMORY_SEQS = (64, 128, 192, 256, 320, 384, 448, 512)
MEMORY_BUCKETS = (128, 256, 512)
SETUP_LABELS = {"own_pool": "one graph per length, own pool each", "shared_pool": "one graph per length, shared pool",
                "buckets": "buckets (padded), shared pool"}
"""Plot labels of :func:`memory_table`'s setups."""


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

    require_cuda("memory_table", _FIX)
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

    require_cuda("validation_cost", _FIX)
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


def measure_suite(opts: Options) -> tuple:
    """The suite's tables, in the registry's order: ``(graph_memory, validation_cost)``."""
    return memory_table(), validation_cost()


def report(frames: Mapping[str, Any], source: str, prov: dict, markdown: bool) -> None:
    """Print the graph-memory and validation-cost tables."""
    print_tables(frames, markdown)
    print(f"Source: {source}")
