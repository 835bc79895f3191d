"""Greedy GPT-2 generation (notebook 06): transformers' ``generate`` against cgutils' static-cache
decoder, eager, graphed, graphed after Inductor fusion, and compiled; per-token latency; batch sweep; and (from
:mod:`.decode`) the decode step's routes against the bandwidth floor."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..capture.buckets import pick_bucket
from ..checks import require_cuda
from ..generation import BATCH_BUCKETS, GreedyDecoder, hf_generate
from ..timing import measure
from ..workloads import get_workload
from .common import Options, error_status, iters_for, print_tables

_FIX = "`python -m cgutils bench generation` shows the recorded tables instead"

DECODERS = ("hf_dynamic", "hf_static", "cgutils_eager", "cgutils_graph", "cgutils_graph_fused", "cgutils_compile")
DECODER_LABELS = {"hf_dynamic": "transformers generate (dynamic cache)",
                  "hf_static": 'transformers generate (cache_implementation="static")',
                  "cgutils_eager": "cgutils static cache, eager", "cgutils_graph": "cgutils static cache, graph",
                  "cgutils_graph_fused": "cgutils static cache, graph of the Inductor-fused step",
                  "cgutils_compile": 'cgutils static cache, torch.compile("reduce-overhead")'}


def _gpt2(dtype: str, what: str):
    """The GPT-2 model (random weights) on the GPU; ``what`` names the caller in the NoCudaError."""
    require_cuda(what, _FIX)
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

    model = _gpt2(dtype, "generation_table")
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
            t = measure(runs[name], warmup=1, iters=iters_for(est, budget_s))
            rows.append({**row, **t.as_dict(), "setup_s": setup_s, "status": "ok",
                         "same_tokens_as_hf": bool(torch.equal(out, reference))})
        except Exception as exc:  # report, do not lose the other rows
            rows.append({**row, "status": error_status(exc, 200)})
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

    Raises:
        NoCudaError: without a CUDA device.
    """
    import pandas as pd

    model = _gpt2(dtype, "decode_step_times")
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

    Raises:
        NoCudaError: without a CUDA device.
        InputError: a batch size above the largest bucket (8).
    """
    import pandas as pd

    model = _gpt2(dtype, "batch_sweep")
    rows = []
    for mode in modes:
        dec = GreedyDecoder(model, mode)
        for b in batches:
            prompt = torch.randint(0, model.config.vocab_size, (b, prompt_len),
                                   generator=torch.Generator().manual_seed(b)).cuda()
            t = measure(lambda p=prompt, d=dec: d.generate(p, new_tokens), warmup=2,
                        iters=iters_for(50.0 if mode == "graph" else 500.0, budget_s))
            rows.append({"mode": mode, "batch": b, "bucket": pick_bucket(b, BATCH_BUCKETS, "batch size"),
                         "median_ms": t.median_ms, "tokens_per_s": b * new_tokens / (t.median_ms / 1e3)})
    return pd.DataFrame(rows)


def measure_suite(opts: Options) -> tuple:
    """The suite's tables, in the registry's order: ``(generation, generation_steps, generation_batch,
    decode_floor, decode_floor_classes)``; the last two from :func:`cgutils.bench.decode.decode_floor_run`."""
    from .decode import decode_floor_frames, decode_floor_run

    return (generation_table(), decode_step_times(), batch_sweep(), *decode_floor_frames(decode_floor_run()))


def report(frames: Mapping[str, Any], source: str, prov: dict, markdown: bool) -> None:
    """Print the generation tables (the per-step one shortened unless ``markdown``)."""
    print_tables(frames, markdown)
    print(f"Source: {source}")
