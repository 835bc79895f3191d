"""GPT-2's greedy decode step against the memory-bandwidth floor, every route in one run on one GPU (issue 25;
notebook 06's appendix, ``python -m cgutils bench generation``, ``benchmarks/decode_floor.py``).

GPT-2 small (random weights, the workloads' model) in fp16, a 32-token prompt, 128 new tokens. Routes:

- ``plain``: ``StaticKVState.decode_step`` (PyTorch ops, SDPA over the whole cache) in one CUDA graph;
- ``fused``: ``FusedKVState.decode_step`` (:mod:`cgutils.generation.fused_step`, Triton) in one CUDA graph;
- ``fused_pdl``: the same with ``pdl=True`` (Programmatic Dependent Launch: each kernel's parameters loaded before it
  waits for the previous kernel; compute capability >= 9.0; its launch shapes are ``fused_step.PDL_TUNING``);
- ``hf``: transformers' ``generate(cache_implementation="static")``; its time per token is a whole generate call
  (prefill and host work included) over the new tokens.

Per route: ms per decode step (one token per batch row) as the median and p10/p90 across interleaved trials (the
route order rotates every trial; graph routes: CUDA events around the ``new_tokens - 1`` replays after a prefill);
the tokens of one generation compared between routes (equal, or the first differing step and, there, each route's
top-2 logit margin in fp32, so that a near-tie shows as one); kernels and GPU-busy µs per step by kernel class from
``torch.profiler`` (CUDA activity) over a few replays; the floor: weight bytes plus the keys/values of positions
``0..pos`` (averaged over the steps) over the bandwidth of a 1 GiB device ``copy_`` (read + write bytes, CUDA
events), and each route's ratio to it. A route that fails is recorded with its error; the others go on.
"""

from __future__ import annotations

import json
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..generation import StaticKVState, hf_generate
from ..timing import device_sync

ROUTES = ("plain", "fused", "fused_pdl", "hf")
PAIRS = (("fused", "plain"), ("fused_pdl", "plain"), ("fused_pdl", "fused"), ("plain", "hf"), ("fused", "hf"),
         ("fused_pdl", "hf"))
"""Token comparisons, ``(route, reference)``."""


def _fused():
    """:mod:`cgutils.generation.fused_step`, imported on first use: it imports Triton, which reads
    ``TRITON_INTERPRET`` once (``benchmarks/decode_floor.py --smoke`` sets it first)."""
    from ..generation import fused_step

    return fused_step


@dataclass
class DecodeFloorConfig:
    """What :func:`decode_floor_run` measures.

    Attributes:
        batches: batch sizes (rows decoded together), each >= 1.
        routes: names from :data:`ROUTES`.
        trials: interleaved trials per batch (each times every route once), >= 1.
        prompt_len: prompt tokens, >= 1.
        new_tokens: generated tokens per call, >= 2 (a prefill token and at least one decode step).
        tuning_table: the ``fused`` route's launch shapes (:func:`load_tuning`); ``None``: ``fused_step.TUNING``.
        smoke: CPU, Triton's interpreter, a tiny GPT-2, no graphs or profile: checks the code path; its timings
            mean nothing.
    """

    batches: tuple[int, ...] = (1, 8)
    routes: tuple[str, ...] = ROUTES
    trials: int = 5
    prompt_len: int = 32
    new_tokens: int = 128
    tuning_table: dict | None = None
    smoke: bool = False
    log: object = field(default=print, repr=False)

    def check(self) -> DecodeFloorConfig:
        """Raises InputError for an unknown route or an out-of-range count; returns ``self``."""
        from ..checks import check_int

        bad = [r for r in self.routes if r not in ROUTES]
        if bad or not self.routes:
            raise InputError(f"decode floor routes must be some of {ROUTES}, got {list(self.routes)}")
        for b in self.batches:
            check_int("batch", b, minimum=1, why="rows decoded together")
        check_int("trials", self.trials, minimum=1, why="interleaved trials per batch")
        check_int("prompt_len", self.prompt_len, minimum=1, why="prompt tokens")
        check_int("new_tokens", self.new_tokens, minimum=2, why="a prefill token and at least one decode step")
        if self.tuning_table is None:
            self.tuning_table = _fused().check_tuning()
        return self


def error_text(exc: BaseException) -> str:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return f"{type(exc).__name__}: {exc}\n" + "".join(tb[-3:])[-1500:]


def elapsed_ms(fn, cuda: bool) -> float:
    """Wall time of ``fn()`` on the GPU (CUDA events on the current stream) or the host (smoke)."""
    device_sync("cuda" if cuda else "cpu")
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def copy_bandwidth(cuda: bool) -> dict:
    """Device-to-device ``copy_`` bandwidth, bytes read + written per second (median of 5)."""
    n = (1 << 30) if cuda else (64 << 20)
    dev = "cuda" if cuda else "cpu"
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    for _ in range(2):
        dst.copy_(src)
    ms = float(np.median([elapsed_ms(lambda: dst.copy_(src), cuda) for _ in range(5)]))
    return {"bytes_copied": n, "ms": ms, "GBps_read_plus_write": 2 * n / (ms * 1e-3) / 1e9}


def load_tuning(text: str | None) -> dict:
    """The fused route's table: from a file (tune_fused_gemv.json: its ``merged_tuning``) or JSON text, checked
    and completed by ``_fused().check_tuning``; ``None``: the module's TUNING."""
    if text is None:
        return _fused().check_tuning()
    path = Path(text)
    if not path.exists() and not text.lstrip().startswith("{"):
        raise OSError("no such file, and not a JSON mapping")
    data = json.loads(path.read_text() if path.exists() else text)
    if isinstance(data, dict) and "merged_tuning" in data:
        data = data["merged_tuning"]
    return _fused().check_tuning(data)


def versioned_provenance() -> dict:
    """:func:`cgutils.env.provenance` plus the installed ``triton`` and ``transformers`` versions (``None`` where
    one is not installed): the fused route's kernels depend on both."""
    import importlib.metadata

    from ..env import provenance

    prov = provenance()
    for dist in ("triton", "transformers"):
        try:
            prov[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            prov[dist] = None
    return prov


def build_model(smoke: bool):
    if smoke:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(n_embd=64, n_head=4, n_layer=2, n_positions=64, vocab_size=101)
        return GPT2LMHeadModel(cfg).eval()
    from ..checks import require_cuda
    from ..workloads import get_workload

    require_cuda("decode_floor_run", "`python -m cgutils bench generation` shows the recorded tables instead")
    return get_workload("gpt2-generate100").build("fp16", "cuda").model  # the speedup table's GPT-2, same weights


def floor_bytes(model, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Bytes one decode step must read at least: every weight once (the position table: one row), and
    the keys and values of positions 0..pos, averaged over the ``new_tokens - 1`` decode steps."""
    cfg = model.config
    wpe = model.transformer.wpe.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - wpe.numel() * wpe.element_size()
    weights += cfg.n_embd * wpe.element_size()
    keys = np.mean([pos + 1 for pos in range(prompt_len, prompt_len + new_tokens - 1)])
    cache = float(keys * 2 * cfg.n_layer * batch * cfg.n_embd * wpe.element_size())
    return {"weight_bytes": int(weights), "cache_bytes_avg": cache, "total_bytes": weights + cache}


class GraphRoute:
    """A static-cache state's step, captured in one CUDA graph (eager in smoke mode)."""

    def __init__(self, state: StaticKVState, prompt: torch.Tensor, new_tokens: int, cuda: bool):
        self.state, self.prompt, self.n, self.cuda = state, prompt, new_tokens, cuda
        self.step = state.decode_step
        if cuda:
            from ..capture.graph import capture_graph

            with torch.no_grad():
                state.prefill(prompt)  # warm-up steps advance pos for real: start them from the prompt
            self.graph, _ = capture_graph(state.decode_step, warmup=2, what=f"{type(state).__name__} step")
            self.step = self.graph.replay

    def tokens(self) -> torch.Tensor:
        return _fused().greedy_tokens(self.state, self.prompt, self.n, self.step)

    def ms_per_step(self) -> float:
        with torch.no_grad():
            self.state.prefill(self.prompt)

        def steps():
            for _ in range(self.n - 1):
                self.step()

        return elapsed_ms(steps, self.cuda) / (self.n - 1)

    def logits_at(self, step: int) -> torch.Tensor:
        """fp32 logits (batch, vocab) behind generated token ``step`` (0: the prefill's) of a generation as in
        :meth:`tokens`: the prefill's logits, or ``step - 1`` steps and then the step itself, whose logits are
        the fused state's ``last_logits``; the plain state runs its step's ops once eagerly (the same kernels
        as its graph) at that position."""
        st, T = self.state, self.prompt.shape[1]
        with torch.no_grad():
            if step == 0:  # both states prefill through StaticKVState.logits
                return st.logits(self.prompt, st.key_pos[:T])[:, -1].float()
            st.prefill(self.prompt)
            for _ in range(step - 1):
                self.step()
            if hasattr(st, "last_logits"):  # the fused state keeps its step's fp32 logits
                self.step()
                return st.last_logits.clone()
            return st.logits(st.token, st.pos)[:, -1].float()

    def profiled(self, reps: int = 5):
        with torch.no_grad():
            self.state.prefill(self.prompt)

        def steps():
            for _ in range(reps):
                self.step()

        return steps, reps


class HFRoute:
    def __init__(self, model, prompt: torch.Tensor, new_tokens: int, cuda: bool):
        self.model, self.prompt, self.n, self.cuda = model, prompt, new_tokens, cuda

    def tokens(self) -> torch.Tensor:
        return hf_generate(self.model, self.prompt, self.n, cache_implementation="static")

    def ms_per_step(self) -> float:
        return elapsed_ms(self.tokens, self.cuda) / self.n

    def profiled(self):
        return self.tokens, self.n


def kernel_profile(fn, per: int) -> dict:
    """Kernels, memcpy/memset and GPU-busy µs per step from a torch.profiler trace (CUDA activity) of ``fn``."""
    from torch.profiler import ProfilerActivity

    from ..capture.inspect import kernel_family
    from ..overhead import profiler_session

    torch.cuda.synchronize()
    with profiler_session(activities=[ProfilerActivity.CUDA]) as prof:  # CUPTI torn down: later trials unslowed
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    by_class, by_name, counts = defaultdict(float), defaultdict(lambda: [0, 0.0]), defaultdict(int)
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name, dur = e.get("name", "?"), float(e.get("dur", 0.0))
        cls = kernel_family(name) if cat == "kernel" else cat.replace("gpu_", "")
        counts[cat] += 1
        by_class[cls] += dur
        key = (name[:120], str(e.get("args", {}).get("grid", "")))  # one Triton kernel serves several matrices
        by_name[key][0] += 1
        by_name[key][1] += dur
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:16]
    return {"kernels_per_step": counts["kernel"] / per,
            "memcpy_memset_per_step": (counts["gpu_memcpy"] + counts["gpu_memset"]) / per,
            "gpu_busy_us_per_step": sum(by_class.values()) / per,
            "us_per_step_by_class": {k: v / per for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n, "grid": g, "per_step": c / per, "us_per_step": d / per}
                            for (n, g), (c, d) in top],
            "steps_profiled": per}


def compare_tokens(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> dict:
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape:
        return {"equal": False, "note": f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"}
    diff = (a[:, prompt_len:] != b[:, prompt_len:])
    if not diff.any():
        return {"equal": True}
    cols = diff.any(0).nonzero().flatten()
    first = int(cols[0])
    return {"equal": False, "first_differing_step": first, "rows_differing_there": diff[:, first].nonzero().flatten().tolist(),
            "same_fraction": float(1 - diff.float().mean())}


def margins_at(routes: dict, toks: dict, ref: str, other: str, step: int, row: int, prompt_len: int) -> dict:
    """Where two routes' tokens first differ (generated token ``step`` of batch row ``row``): each route's top-2
    logits there as fp32 (plain: the model's fp16 logits; fused: its fp32 ones), their margin, and its own
    token's logit minus the other route's token's; small margins on both sides mean a near-tie that rounding
    can tip. transformers' route keeps no logits."""
    out: dict = {"step": step, "row": row, "reference": ref, "routes": {}}
    chosen = {n: int(toks[n][row, prompt_len + step]) for n in (ref, other)}
    for name, rival in ((ref, other), (other, ref)):
        route = routes.get(name)
        if not isinstance(route, GraphRoute):
            out["routes"][name] = {"token": chosen[name], "note": "no logits (transformers' generate, or the route failed)"}
            continue
        try:
            lg = route.logits_at(step)[row].float().cpu()
        except Exception as exc:
            out["routes"][name] = {"token": chosen[name], "error": error_text(exc)}
            continue
        val, ids = lg.topk(2)
        out["routes"][name] = {"token": chosen[name], "recomputed_argmax": int(lg.argmax()),
                               "top2_ids": ids.tolist(), "top2_logits": val.tolist(),
                               "top2_margin": float(val[0] - val[1]),
                               "own_minus_rival_token": float(lg[chosen[name]] - lg[chosen[rival]])}
    return out


def run_batch(model, batch: int, args: DecodeFloorConfig, cuda: bool, bw: dict | None) -> dict:
    """One batch size: every route set up, timed in interleaved trials, profiled, its tokens compared."""
    FusedKVState = _fused().FusedKVState
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(model.lm_head.weight.device)
    max_len = args.prompt_len + args.new_tokens
    out: dict = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "cache_len": max_len,
                 "routes": {}}
    routes: dict = {}
    for name in args.routes:
        rec = out["routes"][name] = {}
        args.log(f"batch {batch}: setting up {name}")
        try:
            t = time.perf_counter()
            if name == "plain":
                routes[name] = GraphRoute(StaticKVState(model, batch, max_len), prompt, args.new_tokens, cuda)
            elif name in ("fused", "fused_pdl"):
                pdl = name == "fused_pdl"
                state = FusedKVState(model, batch, max_len, tuning=None if pdl else args.tuning_table, pdl=pdl)
                rec["kernels_per_step_launched"] = state.kernels_per_step
                routes[name] = GraphRoute(state, prompt, args.new_tokens, cuda)
            else:
                routes[name] = HFRoute(model, prompt, args.new_tokens, cuda)
            rec["tokens"] = routes[name].tokens()  # first generation: Triton/Inductor compile for the fused/hf routes
            device_sync("cuda" if cuda else "cpu")
            rec["setup_s"] = time.perf_counter() - t
            routes[name].ms_per_step()  # one untimed round after the setup
        except Exception as exc:  # keep the other routes
            rec["error"] = error_text(exc)
            routes.pop(name, None)
            args.log(f"batch {batch}: {name} failed: {exc}")
    samples: dict = {n: [] for n in routes}
    names = list(routes)
    args.log(f"batch {batch}: {args.trials} interleaved trials of {names}")
    for trial in range(args.trials):
        turn = trial % max(1, len(names))
        for name in names[turn:] + names[:turn]:
            if name not in routes:
                continue
            try:
                samples[name].append(routes[name].ms_per_step())
            except Exception as exc:
                out["routes"][name]["error"] = error_text(exc)
                routes.pop(name)
    floor = floor_bytes(model, batch, args.prompt_len, args.new_tokens)
    if bw:
        floor["floor_us"] = floor["total_bytes"] / (bw["GBps_read_plus_write"] * 1e9) * 1e6
    out["floor"] = floor
    for name, ms in samples.items():
        if not ms:
            continue
        rec = out["routes"][name]
        p10, med, p90 = np.percentile(ms, [10, 50, 90])
        rec.update(ms_per_step={"median": float(med), "p10": float(p10), "p90": float(p90), "n": len(ms)})
        if "floor_us" in floor:
            rec["ratio_to_floor"] = float(med) * 1e3 / floor["floor_us"]
        if cuda and name in routes:
            try:
                rec["profile"] = kernel_profile(*routes[name].profiled())
            except Exception as exc:
                rec["profile_error"] = error_text(exc)
    toks = {n: r.pop("tokens") for n, r in out["routes"].items() if "tokens" in r}
    out["tokens"] = {f"{a}_vs_{b}": compare_tokens(toks[a], toks[b], args.prompt_len)
                     for a, b in PAIRS if a in toks and b in toks}
    for key, cmp in out["tokens"].items():
        other, ref = key.split("_vs_")  # the second route of a pair is the reference
        probe = (args.smoke and key in ("fused_vs_plain", "fused_pdl_vs_plain") and cmp.get("equal")
                 and args.new_tokens > 1)  # the path runs
        if "first_differing_step" in cmp or probe:
            step, row = (cmp["first_differing_step"], cmp["rows_differing_there"][0]) if not probe else (1, 0)
            cmp["margins"] = margins_at(routes, toks, ref, other, step, row, args.prompt_len)
            cmp["margins"]["probe"] = bool(probe)
    return out


def decode_floor_run(config: DecodeFloorConfig | None = None, model=None) -> dict:
    """Measure every route of ``config`` (default :class:`DecodeFloorConfig`) on GPT-2 fp16 (the workloads' model;
    ``model``: another GPT-2 ``LMHeadModel``, already on its device and dtype).

    Returns:
        a JSON-serialisable dict: ``provenance`` (versions, GPU, commit; plus ``triton``, ``transformers``),
        ``config``, ``fused_tuning``, ``copy_bandwidth`` (``bytes_copied``, ``ms``, ``GBps_read_plus_write``) and
        ``batches``: per batch, ``floor`` (``weight_bytes``, ``cache_bytes_avg``, ``total_bytes``, ``floor_us``),
        ``routes`` (per route: ``ms_per_step`` {median, p10, p90, n} in ms, ``ratio_to_floor``, ``setup_s``,
        ``profile`` (``kernels_per_step``, ``gpu_busy_us_per_step``, ``us_per_step_by_class``, ``top_kernels``),
        or ``error``) and ``tokens`` (``"<route>_vs_<reference>"``: ``equal``, or where they first differ).

    Raises:
        InputError: a bad config (:meth:`DecodeFloorConfig.check`).
        NoCudaError: without a CUDA device (unless ``config.smoke``).
    """
    from ..checks import require_cuda

    cfg = (config or DecodeFloorConfig()).check()
    cuda = not cfg.smoke
    if cuda:
        require_cuda("decode_floor_run", "`python -m cgutils bench generation` shows the recorded tables instead")
    prov = versioned_provenance()
    result: dict = {"provenance": prov, "smoke": cfg.smoke,
                    "config": {"batches": list(cfg.batches), "routes": list(cfg.routes), "trials": cfg.trials,
                               "prompt_len": cfg.prompt_len, "new_tokens": cfg.new_tokens},
                    "fused_tuning": {k: list(v) for k, v in cfg.tuning_table.items()}, "batches": []}
    t0 = time.perf_counter()
    try:
        result["copy_bandwidth"] = copy_bandwidth(cuda)
        cfg.log(f"copy bandwidth {result['copy_bandwidth']['GBps_read_plus_write']:.0f} GB/s (read + write)")
    except Exception as exc:  # the routes are still worth measuring; the floor ratio is then left out
        result["copy_bandwidth_error"] = error_text(exc)
    model = model if model is not None else build_model(cfg.smoke)
    for batch in cfg.batches:
        try:
            with torch.no_grad():
                result["batches"].append(run_batch(model, batch, cfg, cuda, result.get("copy_bandwidth")))
        except Exception as exc:  # keep the other batches
            result["batches"].append({"batch": batch, "error": error_text(exc), "routes": {}, "tokens": {},
                                      "floor": {"total_bytes": 0, "weight_bytes": 0, "cache_bytes_avg": 0}})
    result["wall_s"] = time.perf_counter() - t0
    return result


def _tokens_vs(tokens: dict, route: str, ref: str):
    """True/False: the route's tokens equal the reference's; None: not compared (one of them failed, or it is
    the reference)."""
    cmp = tokens.get(f"{route}_vs_{ref}") or tokens.get(f"{ref}_vs_{route}")
    return None if cmp is None else bool(cmp["equal"])


def decode_floor_frames(run: dict):
    """Flatten a :func:`decode_floor_run` result into two tables (``python -m cgutils bench generation``).

    Returns:
        ``(routes, classes)``: ``routes`` has one row per batch and route: ``batch, route, ms_per_step, p10_ms,
        p90_ms, n, tokens_per_s, kernels_per_step, gpu_busy_us, floor_us, x_floor`` (``NaN`` for ``hf``, whose
        ms per step is a whole call over the new tokens), ``tokens_equal_plain``, ``tokens_equal_hf``,
        ``status``, ``gpu``; ``classes`` has ``batch, route, kernel_class, us_per_step`` (GPU-busy µs per step).
    """
    import pandas as pd

    gpu = run.get("provenance", {}).get("gpu")
    rows, class_rows = [], []
    for b in run.get("batches", []):
        floor_us = b.get("floor", {}).get("floor_us", float("nan"))
        for route, r in b.get("routes", {}).items():
            row = {"batch": b["batch"], "route": route, "gpu": gpu, "floor_us": floor_us}
            if "ms_per_step" not in r:
                rows.append({**row, "status": "error: " + (r.get("error") or "no result").splitlines()[0][:200]})
                continue
            s, prof = r["ms_per_step"], r.get("profile") or {}
            rows.append({**row, "ms_per_step": s["median"], "p10_ms": s["p10"], "p90_ms": s["p90"], "n": s["n"],
                         "tokens_per_s": b["batch"] / (s["median"] * 1e-3),
                         "kernels_per_step": prof.get("kernels_per_step", float("nan")),
                         "gpu_busy_us": prof.get("gpu_busy_us_per_step", float("nan")),
                         "x_floor": float("nan") if route == "hf" else r.get("ratio_to_floor", float("nan")),
                         "tokens_equal_plain": _tokens_vs(b.get("tokens", {}), route, "plain"),
                         "tokens_equal_hf": _tokens_vs(b.get("tokens", {}), route, "hf"),
                         "status": "ok" if prof else "ok (not profiled)"})
            class_rows += [{"batch": b["batch"], "route": route, "kernel_class": c, "us_per_step": us}
                           for c, us in prof.get("us_per_step_by_class", {}).items()]
    cols = ["batch", "route", "ms_per_step", "p10_ms", "p90_ms", "n", "tokens_per_s", "kernels_per_step",
            "gpu_busy_us", "floor_us", "x_floor", "tokens_equal_plain", "tokens_equal_hf", "status", "gpu"]
    return (pd.DataFrame(rows).reindex(columns=cols),
            pd.DataFrame(class_rows).reindex(columns=["batch", "route", "kernel_class", "us_per_step"]))
