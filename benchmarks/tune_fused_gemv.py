"""Issue 25: a search of the fused decode step's launch shapes (``fused_step.TUNING``), one GPU run of ~1.5 min.

decode_floor.py measured the fused step at 0.369 ms at batch 1 on an H200, 291 µs of it in the 48 matrix-vector
kernels (``_ln_gemv_kernel``), ~5.4-6.5 µs each whatever their matrix (1.2-4.7 MB): latency-bound, not
bandwidth-bound. The hypothesis under test: more programs in flight (split-K, a smaller BN), another K step
(BK), warps and pipeline stages change that latency. GPT-2 small (random weights, as decode_floor.py builds
it) in fp16, a 32-token prompt and 128 new tokens (cache 160), batch 1 and 8.

Per batch, coordinate descent over the roles (qkv, proj, fc, proj2, lm_head), each once: the role's candidates
(``CANDIDATES``, 11-12 each, the current shape first) with every other role at the best so far. The roles'
kernels run one after another in the graph, so their times add: one pass suffices. Each candidate is
``FusedKVState(model, batch, 160, tuning=...)`` with its decode step captured in one CUDA graph; a check run
(prefill, 127 replays) whose first ``--check-steps`` tokens must equal the default table's (a candidate that
changes them, or raises, is recorded as such and never chosen; the whole run's agreement and the largest fp32
logit difference at the last checked step are recorded too); then ``--rounds`` timed rounds interleaved
across the role's candidates, in rotating order: prefill, then CUDA events around the 127 replays. ms per
step is the median over the rounds; the fastest candidate replaces the current one if it gains more than
``--min-gain-us`` µs per step.

Then one table for every batch ("merged": per role, the candidate whose gain summed over the batches is the
largest, among those right at every batch), and a final interleaved comparison at each batch of the default
table, that batch's best and the merged one (``--final-rounds``), with a torch.profiler breakdown per kernel
(grids labelled with their roles) of the default and merged steps.

Time: the ~150 Triton compilations (~0.6 s each) are done first, while the GPU is idle, by ``--jobs`` worker
processes filling Triton's on-disk cache (~20 s; each compiles its share with ``JITFunction.warmup``, nothing
launched); then ~110 candidates at ~0.4 s each and the final comparison: ~80-100 s in all (~160 s with
``--jobs 0``). A candidate is started only while the elapsed time is under ``--budget-s`` less a reserve for
the final comparison, so the run ends within about ``--budget-s`` (170) whatever the estimate's errors;
candidates left out are recorded as skipped.

    python benchmarks/tune_fused_gemv.py --out DIR [--batches 1 8] [--roles qkv fc] [--jobs 8] [--budget-s 170]
                                         [--candidates qkv=16,256,2,3,4 ...]
    python benchmarks/tune_fused_gemv.py --smoke --out DIR   # CPU, Triton's interpreter, a tiny GPT-2

Writes ``DIR/tune_fused_gemv.json`` (provenance: versions, GPU, ``CGUTILS_GIT_COMMIT``; written after each
batch too) and prints a table per role, the best table per batch, the gains, and ``TUNING = {...}`` to paste
into cgutils/generation/fused_step.py. ``--smoke``: the first two candidates per role, eager steps, no graphs,
no profile, no workers; its timings mean nothing.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the fused kernels are defined: before triton is imported

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cgutils.bench.decode as df  # noqa: E402  (decode_floor.py's measurement; after TRITON_INTERPRET is set)
from cgutils.errors import InputError  # noqa: E402
from cgutils.generation import fused_step  # noqa: E402
from cgutils.generation.fused_kernels import KERNELS  # noqa: E402
from cgutils.generation.fused_step import ROLES, FusedKVState  # noqa: E402

T0 = time.perf_counter()
DEFAULT = {r: tuple(v) for r, v in fused_step.TUNING.items()}  # the module's table, the baseline

# (BN, BK, split, stages, warps) per role, and what each tests. GPT-2 small: qkv (768 -> 2304) and fc
# (768 -> 3072) run 72 and 96 programs of 3 K steps by default on 132 SMs; proj (768 -> 768, one head per K
# step) 24 x 12 programs; proj2 (3072 -> 768) 24 x 4 programs of 3 K steps; lm_head 393 programs of 12 steps.
_LN_GEMV = [
    ((32, 256, 1, 3, 4), "the table before the sweep"),
    ((16, 256, 1, 3, 4), "BN 16: twice the programs"),
    ((32, 128, 2, 3, 4), "split-K 2: twice the programs, 3 steps of 128"),
    ((16, 128, 2, 3, 4), "BN 16 and split 2: 4x the programs"),
    ((32, 256, 3, 2, 4), "split-K 3: 3x the programs, one K step each"),
    ((16, 256, 3, 2, 4), "BN 16 and split 3: 6x the programs, one K step each"),
    ((64, 256, 1, 3, 4), "BN 64: half the programs (the other way)"),
    ((32, 128, 1, 4, 4), "BK 128: 6 K steps, 4 stages"),
    ((32, 64, 1, 4, 4), "BK 64: 12 K steps, 4 stages"),
    ((32, 256, 1, 2, 4), "2 stages"),
    ((32, 256, 1, 3, 8), "8 warps"),
    ((32, 256, 1, 3, 2), "2 warps"),
]
CANDIDATES = {
    "qkv": _LN_GEMV,
    "fc": _LN_GEMV,
    "proj": [
        ((32, 64, 12, 2, 4), "the table before the sweep"),
        ((16, 64, 12, 2, 4), "BN 16: twice the programs"),
        ((64, 64, 12, 2, 4), "BN 64: half the programs"),
        ((32, 64, 6, 2, 4), "split 6: two heads a program, half the programs"),
        ((16, 64, 6, 2, 4), "BN 16, two heads a program"),
        ((32, 64, 4, 3, 4), "split 4: three heads a program"),
        ((16, 64, 4, 3, 4), "BN 16, three heads a program"),
        ((32, 64, 3, 3, 4), "split 3: four heads a program"),
        ((32, 64, 12, 1, 4), "1 stage"),
        ((32, 64, 12, 2, 2), "2 warps"),
        ((32, 64, 12, 2, 8), "8 warps"),
        ((16, 64, 12, 2, 2), "BN 16 and 2 warps: 4x the programs' count, small ones"),
    ],
    "proj2": [
        ((32, 256, 4, 3, 4), "the table before the sweep"),
        ((16, 256, 4, 3, 4), "BN 16: twice the programs"),
        ((32, 256, 6, 3, 4), "split 6: 1.5x the programs, 2 K steps each"),
        ((32, 256, 12, 2, 4), "split 12: 3x the programs, one K step each"),
        ((16, 256, 6, 3, 4), "BN 16 and split 6: 3x the programs"),
        ((32, 128, 8, 3, 4), "BK 128, split 8: twice the programs, 3 steps of 128"),
        ((16, 128, 8, 3, 4), "BK 128, BN 16, split 8: 4x the programs"),
        ((64, 256, 12, 2, 4), "BN 64, split 12: 1.5x the programs, one step each"),
        ((32, 256, 2, 3, 4), "split 2: half the programs (the other way)"),
        ((32, 128, 4, 4, 4), "BK 128: 6 K steps, 4 stages"),
        ((32, 256, 4, 3, 8), "8 warps"),
        ((32, 256, 4, 3, 2), "2 warps"),
    ],
    "lm_head": [
        ((128, 64, 1, 3, 4), "the table before the sweep"),
        ((64, 64, 1, 3, 4), "BN 64: twice the programs"),
        ((256, 64, 1, 3, 4), "BN 256: half the programs"),
        ((128, 128, 1, 3, 4), "BK 128: 6 K steps"),
        ((128, 32, 1, 4, 4), "BK 32: 24 K steps, 4 stages"),
        ((128, 64, 1, 4, 4), "4 stages"),
        ((128, 64, 1, 2, 4), "2 stages"),
        ((128, 64, 1, 3, 8), "8 warps"),
        ((64, 128, 1, 3, 4), "BN 64, BK 128"),
        ((256, 64, 1, 3, 8), "BN 256, 8 warps"),
        ((256, 128, 1, 2, 8), "BN 256, BK 128, 8 warps"),
    ],
}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def candidates(role: str, args) -> list[tuple[tuple, str]]:
    """The role's candidates: the module's current shape first, then CANDIDATES' others and --candidates'
    (the first two in smoke mode, the extra ones always)."""
    out = [(DEFAULT[role], "current (fused_step.TUNING)")]
    out += [(tuple(s), why) for s, why in CANDIDATES[role] if tuple(s) != DEFAULT[role]]
    if args.smoke:
        out = out[:2]
    out += [(s, "from --candidates") for r, s in args.extra if r == role and s not in [c for c, _ in out]]
    return out


def kernel_role(kernel, meta: dict) -> str | None:
    """Which role a launch of the plan serves (None: attention)."""
    if kernel in (KERNELS["lm_head_gemv"], KERNELS["argmax_finish"]):
        return "lm_head"
    if kernel is not KERNELS["ln_gemv"]:
        return None
    if meta["EPI"] == 2:
        return "qkv"
    if meta["SRC"] == 1:
        return "proj"
    return "fc" if meta["GELU"] else "proj2"


def launch_of(state: FusedKVState, role: str) -> dict:
    ls = dict(state.launch_shapes[role])
    gx, gy = ls["grid"]
    ls.update(grid=[gx, gy], programs=gx * gy, k_steps_per_program=-(-ls["KPER"] // ls["KSTEP"]))
    return ls


class Candidate(df.GraphRoute):
    """One tuning table's fused step at one batch: decode_floor's graph route (the state, its step, a graph
    replay on the GPU) with the token check and timing rounds of the sweep."""

    def __init__(self, model, batch: int, tuning: dict, args, cuda: bool):
        self.tuning = dict(tuning)
        super().__init__(FusedKVState(model, batch, args.max_len, tuning=tuning), args.prompts[batch],
                         args.new_tokens, cuda)
        self.check_info: dict = {}

    def generate(self, steps: int, window: int):
        """Prefill and ``steps`` steps: ((tokens, logits) after the first ``window`` tokens, all tokens)."""
        T = self.prompt.shape[1]
        k = max(1, min(window, steps + 1) - 1)
        with torch.no_grad():
            self.state.prefill(self.prompt)
            for _ in range(k):
                self.step()
            early = self.state.generated[:, : T + k + 1].clone(), self.state.last_logits.clone()
            for _ in range(steps - k):
                self.step()
            return early, self.state.generated[:, : T + steps + 1].clone()

    def check_against(self, ref: Candidate | None, args) -> dict:
        (toks, logits), full = self.generate(args.new_tokens - 1, args.check_steps)
        self.early, self.full = (toks, logits), full
        if ref is None:
            ref = self
        P = self.prompt.shape[1]
        window = df.compare_tokens(toks, ref.early[0], P)
        info = {"window_tokens": toks.shape[1] - P, "window": window,
                "whole_run": df.compare_tokens(full, ref.full, P),
                "max_abs_logit_diff_at_window_end": float((logits - ref.early[1]).abs().max())}
        self.check_info = info
        return info

    def time_round(self, steps: int) -> float:
        """ms per step over ``steps`` steps after a prefill (CUDA events; the host clock in smoke mode)."""
        with torch.no_grad():
            self.state.prefill(self.prompt)

        def run():
            for _ in range(steps):
                self.step()

        return df.elapsed_ms(run, self.cuda) / steps


def time_left(args) -> float:
    return args.budget_s - (time.perf_counter() - T0)


def stats(samples: list[float]) -> dict:
    p10, med, p90 = np.percentile(samples, [10, 50, 90])
    return {"median": float(med), "p10": float(p10), "p90": float(p90), "n": len(samples),
            "samples": [float(s) for s in samples]}


def timed_rounds(entries: list, rounds: int, steps: int) -> None:
    """``rounds`` rounds over the live (record, candidate) pairs, order rotating; a candidate that raises is
    marked and left out of later rounds."""
    for rnd in range(rounds):
        live = [(r, c) for r, c in entries if c is not None and r["status"] in ("ok", "tokens differ")]
        if not live:
            break
        turn = rnd % len(live)
        for rec, cand in live[turn:] + live[:turn]:
            try:
                rec.setdefault("samples", []).append(cand.time_round(steps))
            except Exception as exc:
                rec.update(status="error", error=df.error_text(exc))
    for rec, _ in entries:
        if rec.get("samples"):
            rec["ms_per_step"] = stats(rec.pop("samples"))


def choose(records: list[dict], min_gain_us: float) -> int:
    """Index of the record to keep: the fastest whose tokens agree (status "ok"), if it beats the current
    one (``"current": True``) by more than ``min_gain_us`` per step; else the current one."""
    cur = next(i for i, r in enumerate(records) if r.get("current"))
    ok = [i for i, r in enumerate(records) if r["status"] == "ok" and "ms_per_step" in r]
    if cur not in ok or not ok:
        return cur
    best = min(ok, key=lambda i: records[i]["ms_per_step"]["median"])
    gain_us = (records[cur]["ms_per_step"]["median"] - records[best]["ms_per_step"]["median"]) * 1e3
    return best if best != cur and gain_us > min_gain_us else cur


def build(model, batch: int, tuning: dict, ref: Candidate | None, args, cuda: bool, rec: dict):
    """A candidate built and checked into ``rec`` (status ok / tokens differ / invalid / error); None if it failed."""
    try:
        cand = Candidate(model, batch, tuning, args, cuda)
        info = cand.check_against(ref, args)
    except InputError as exc:
        rec.update(status="invalid", error=df.error_text(exc))
        return None
    except Exception as exc:
        rec.update(status="error", error=df.error_text(exc))
        return None
    rec.update(status="ok" if info["window"]["equal"] else "tokens differ", tokens=info)
    return cand


def search(model, batch: int, args, cuda: bool) -> dict:
    """Coordinate descent over args.roles at one batch (see the module docstring)."""
    log(f"batch {batch}: the default table")
    ref_rec: dict = {}
    ref = build(model, batch, DEFAULT, None, args, cuda, ref_rec)
    if ref is None:
        raise RuntimeError(f"the default table fails at batch {batch}: {ref_rec.get('error')}")
    best, current = dict(DEFAULT), ref
    out: dict = {"batch": batch, "roles": {}}
    for role in args.roles:
        others = ", ".join(f"{r} {fmt(v)}" for r, v in best.items() if r != role)
        log(f"batch {batch}: {role}, {len(candidates(role, args))} candidates; the others at {others}")
        entries = []
        for spec, why in candidates(role, args):
            rec: dict = {"tuning": list(spec), "why": why}
            if spec == best[role]:
                cand = current
                rec.update(current=True, status="ok", tokens=current.check_info)
            elif time_left(args) < args.reserve_s:
                cand = None
                rec.update(status="skipped", error=f"time budget: {time_left(args):.0f} s left, reserve {args.reserve_s} s")
            else:
                cand = build(model, batch, {**best, role: spec}, ref, args, cuda, rec)
            if cand is not None:
                rec["launch"] = launch_of(cand.state, role)
            entries.append((rec, cand))
        timed_rounds(entries, args.rounds, args.timed_steps)
        records = [r for r, _ in entries]
        cur_ms = next(r for r in records if r.get("current")).get("ms_per_step", {}).get("median")
        for r in records:
            if "ms_per_step" in r and cur_ms is not None:
                r["delta_us_per_step"] = (r["ms_per_step"]["median"] - cur_ms) * 1e3
        pick = choose(records, args.min_gain_us)
        records[pick]["chosen"] = True
        out["roles"][role] = {"current": list(best[role]), "chosen": records[pick]["tuning"],
                              "gain_us_per_step": -records[pick].get("delta_us_per_step", 0.0), "candidates": records}
        best[role] = tuple(records[pick]["tuning"])
        current = entries[pick][1]
        del entries
        gc.collect()
        print(role_table(batch, role, out["roles"][role], model.config), flush=True)
    out["best_tuning"] = {r: list(v) for r, v in best.items()}
    out["predicted_gain_us_per_step"] = sum(r["gain_us_per_step"] for r in out["roles"].values())
    return out


def merge(searched: list[dict], min_gain_us: float) -> tuple[dict, dict]:
    """One table for every batch: per role, the candidate with the largest gain summed over the batches among
    those right (status ok, timed) at every batch that searched the role, if that sum beats
    ``min_gain_us`` per batch; else the default. Valid because each role is searched once from its default,
    so every batch's deltas are against the same shape."""
    tuning, table = dict(DEFAULT), {}
    for role in ROLES:
        per = [{tuple(r["tuning"]): r for r in b["roles"][role]["candidates"]} for b in searched if role in b["roles"]]
        if not per:
            continue
        common = [s for s in per[0] if all(s in p and p[s]["status"] == "ok" and "delta_us_per_step" in p[s] for p in per)]
        sums = {s: sum(p[s]["delta_us_per_step"] for p in per) for s in common}
        table[role] = [{"tuning": list(s), "delta_us_per_step_summed": d} for s, d in sorted(sums.items(), key=lambda kv: kv[1])]
        if sums:
            s, d = min(sums.items(), key=lambda kv: kv[1])
            if -d > min_gain_us * len(per):
                tuning[role] = s
    return tuning, table


def annotate_profile(prof: dict, state: FusedKVState) -> dict:
    """Label the profile's kernels with the roles whose grid they launch."""
    for k in prof.get("top_kernels", []):
        roles = []
        for role in ROLES:
            gx, gy = state.launch_shapes[role]["grid"]
            name = "_lm_head_gemv_kernel" if role == "lm_head" else "_ln_gemv_kernel"
            if k["name"].startswith(name) and k["grid"] == f"[{gx}, {gy}, 1]":
                roles.append(role)
        k["roles"] = roles
    return prof


def final(model, batch: int, tables: dict, args, cuda: bool) -> dict:
    """Default, this batch's best and the merged table, interleaved; gains against the default."""
    distinct: dict = {}
    for name, tuning in tables.items():
        distinct.setdefault(tuple(tuple(tuning[r]) for r in ROLES), []).append(name)
    entries, ref = [], None
    for key, names in distinct.items():
        rec: dict = {"names": names, "tuning": {r: list(v) for r, v in zip(ROLES, key)}}
        cand = build(model, batch, dict(zip(ROLES, key)), ref, args, cuda, rec)
        ref = ref or cand
        entries.append((rec, cand))
    timed_rounds(entries, args.final_rounds, args.timed_steps)
    out: dict = {"batch": batch, "configs": [r for r, _ in entries]}
    base = entries[0][0].get("ms_per_step", {}).get("median")
    for rec, cand in entries:
        if base and "ms_per_step" in rec:
            rec["gain_us_per_step"] = (base - rec["ms_per_step"]["median"]) * 1e3
            rec["gain_pct"] = 100 * (base - rec["ms_per_step"]["median"]) / base
        if cuda and args.profile and cand is not None and time_left(args) > 8 and \
                any(n in rec["names"] for n in ("default", "merged")):
            try:
                rec["profile"] = annotate_profile(df.kernel_profile(*cand.profiled()), cand.state)
            except Exception as exc:
                rec["profile_error"] = df.error_text(exc)
    return out


def fmt(spec) -> str:
    return "(" + ", ".join(str(v) for v in spec) + ")"


def role_table(batch: int, role: str, rr: dict, cfg) -> str:
    C, F, V = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd, cfg.vocab_size
    K, N = {"qkv": (C, 3 * C), "proj": (C, C), "fc": (C, F), "proj2": (F, C), "lm_head": (C, V)}[role]
    lines = [f"batch {batch}, {role} (K {K}, N {N}); current {fmt(rr['current'])}",
             f"  {'(BN, BK, split, stages, warps)':32s} {'grid':>9s} {'steps':>5s} {'ms/step':>9s} {'d us':>7s}  status"]
    for r in rr["candidates"]:
        ls, ms = r.get("launch", {}), r.get("ms_per_step", {})
        grid = f"{ls['grid'][0]}x{ls['grid'][1]}" if ls else "-"
        status = r["status"] + (" (current)" if r.get("current") else "") + (" <- chosen" if r.get("chosen") else "")
        if r["status"] not in ("ok",) and r.get("error"):
            status += ": " + r["error"].splitlines()[0][:90]
        lines.append(f"  {fmt(r['tuning']):32s} {grid:>9s} {ls.get('k_steps_per_program', '-')!s:>5s} "
                     f"{ms.get('median', float('nan')):9.5f} {r.get('delta_us_per_step', float('nan')):+7.2f}  {status}")
    lines.append(f"  kept the current {fmt(rr['current'])}" if rr["chosen"] == rr["current"] else
                 f"  chosen {fmt(rr['chosen'])}: {rr['gain_us_per_step']:.2f} us/step faster than the current")
    return "\n".join(lines)


def paste(tuning: dict) -> str:
    order = ("qkv", "fc", "proj", "proj2", "lm_head")  # the module's order
    items = [f'"{r}": {fmt(tuning[r])}' for r in order]
    return "TUNING = {" + ", ".join(items[:3]) + ",\n          " + ", ".join(items[3:]) + "}"


def summary(result: dict) -> str:
    lines = [f"GPU: {result['provenance'].get('gpu') or 'CPU (smoke)'}"]
    for b, fin in result.get("final", {}).items():
        lines.append(f"\nbatch {b}:")
        for rec in fin["configs"]:
            ms = rec.get("ms_per_step", {})
            lines.append(f"  {'/'.join(rec['names']):22s} {ms.get('median', float('nan')):.4f} ms/step "
                         f"(p10 {ms.get('p10', float('nan')):.4f}, p90 {ms.get('p90', float('nan')):.4f}), "
                         f"gain {rec.get('gain_us_per_step', float('nan')):+.1f} us ({rec.get('gain_pct', float('nan')):+.1f}%), "
                         f"{rec['status']}")
            for k in rec.get("profile", {}).get("top_kernels", [])[:7]:
                lines.append(f"      {k['name'][:22]:22s} grid {k['grid']:14s} {'/'.join(k.get('roles', [])) or '-':8s} "
                             f"{k['us_per_step']:7.1f} us/step ({k['per_step']:.0f} launches)")
    for b, tun in result.get("best_tuning", {}).items():
        lines.append(f"best at batch {b}: " + ", ".join(f"{r} {fmt(v)}" for r, v in tun.items()))
    if "merged_tuning" in result:
        lines.append("\nthe table for every batch, to paste into cgutils/generation/fused_step.py:\n"
                     + result["tuning_to_paste"])
    return "\n".join(lines)


def prewarm_items(args) -> list:
    items = [(b, None, None) for b in args.batches]
    items += [(b, role, spec) for b in args.batches for role in args.roles
              for spec, _ in candidates(role, args) if spec != DEFAULT[role]]
    return items


def prewarm_worker(args) -> None:
    """One worker's share of the compilations: each (batch, role, candidate)'s kernels for that role,
    compiled by ``JITFunction.warmup`` (nothing launched) into Triton's on-disk cache."""
    from transformers import GPT2Config, GPT2LMHeadModel

    t = time.perf_counter()
    i, n = args.prewarm_worker
    torch.manual_seed(0)  # GPT-2 small's shapes with two layers (layer 0's qkv gathers the embeddings)
    model = df.build_model(True) if args.smoke else \
        GPT2LMHeadModel(GPT2Config(n_layer=2)).to(device="cuda", dtype=torch.float16).eval()
    want = {"role": None}

    def warm(kernel, grid, *a, **meta):
        if want["role"] is None or kernel_role(kernel, meta) == want["role"]:
            try:
                kernel.warmup(*a, grid=grid, **meta)
            except (AttributeError, TypeError):  # no warmup in this Triton: a real launch compiles as well
                kernel[grid](*a, **meta)

    fused_step._launch = warm
    done, errors = 0, []
    for batch, role, spec in prewarm_items(args)[i::n]:
        want["role"] = role
        try:
            FusedKVState(model, batch, args.max_len, tuning={role: spec} if role else None).decode_step()
            done += 1
        except Exception as exc:
            errors.append(f"batch {batch} {role} {spec}: {type(exc).__name__}: {str(exc)[:200]}")
    if not args.smoke:
        torch.cuda.synchronize()
    print("PREWARM " + json.dumps({"worker": i, "items": done, "errors": errors, "s": time.perf_counter() - t}), flush=True)


def start_workers(args) -> list:
    procs = []
    extra = [f"{r}={','.join(map(str, s))}" for r, s in args.extra]
    for i in range(args.jobs):
        logf = tempfile.NamedTemporaryFile("w+", prefix=f"tune_prewarm{i}_", suffix=".log", delete=False)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--prewarm-worker", str(i),
               str(args.jobs), "--batches", *map(str, args.batches), "--roles", *args.roles,
               "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
        if extra:
            cmd += ["--candidates", *extra]
        if args.smoke:  # the plumbing only: the interpreter compiles nothing
            cmd.append("--smoke")
        procs.append((subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}), logf))
    return procs


def join_workers(procs: list, timeout_s: float) -> dict:
    end = time.perf_counter() + timeout_s
    out: dict = {"workers": len(procs), "reports": [], "timed_out": []}
    for i, (proc, logf) in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, end - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()  # this run's own worker, by its handle
            proc.wait()
            out["timed_out"].append(i)
        logf.seek(0)
        text = logf.read()
        logf.close()
        os.unlink(logf.name)
        reports = [json.loads(line[len("PREWARM "):]) for line in text.splitlines() if line.startswith("PREWARM ")]
        out["reports"] += reports or [{"worker": i, "rc": proc.returncode, "tail": text[-1500:]}]
    return out


def parse_candidate(text: str) -> tuple[str, tuple]:
    try:
        role, vals = text.split("=")
        spec = tuple(int(v) for v in vals.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want ROLE=BN,BK,SPLIT,STAGES,WARPS") from None
    if role not in ROLES or len(spec) != 5:
        raise argparse.ArgumentTypeError(f"{text!r}: ROLE one of {', '.join(ROLES)}, then five ints")
    return role, spec


def write(result: dict, out: Path) -> None:
    result["wall_s"] = time.perf_counter() - T0
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune_fused_gemv.json").write_text(json.dumps(result, indent=1))


def estimate_s(args) -> float:
    """A rough wall time: startup, compilations (workers or here), builds, timed rounds, the final comparison."""
    builds = len(prewarm_items(args))  # a reference per batch, then every other candidate
    kernels = 8 * len(args.batches) + sum(2 if r in ("qkv", "lm_head") else 1 for b in args.batches for r in args.roles
                                          for _ in candidates(r, args)[1:])
    compile_s = (8 + kernels * 0.6 / args.jobs) if args.jobs else kernels * 0.6
    step_s = 0.4e-3 * (args.new_tokens - 1)
    per_build = 0.1 + step_s
    timing = sum(len(candidates(r, args)) for r in args.roles) * len(args.batches) * args.rounds * (step_s + 0.005)
    fin = len(args.batches) * (3 * per_build + 3 * args.final_rounds * step_s + (4 if args.profile else 0))
    return 12 + compile_s + builds * per_build + timing + fin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for tune_fused_gemv.json")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8; smoke 1 2)")
    ap.add_argument("--roles", nargs="+", choices=ROLES, default=list(ROLES), help="roles to search, in this order")
    ap.add_argument("--candidates", dest="extra", nargs="+", type=parse_candidate, default=[],
                    metavar="ROLE=BN,BK,SPLIT,STAGES,WARPS", help="more candidates (appended to the role's list)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 32; smoke 6)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens (default 128; smoke 2)")
    ap.add_argument("--check-steps", type=int, default=None,
                    help="generated tokens that must equal the default table's (default 16; smoke 2)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per candidate (default 5; smoke 1)")
    ap.add_argument("--final-rounds", type=int, default=None, help="rounds of the final comparison (default 9; smoke 1)")
    ap.add_argument("--min-gain-us", type=float, default=1.0, help="least gain per step that changes a role (µs)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no candidate past this less --reserve-s (default 170)")
    ap.add_argument("--reserve-s", type=float, default=25.0, help="seconds kept for the final comparison")
    ap.add_argument("--jobs", type=int, default=None,
                    help="compile worker processes, 0 for none (default min(8, cores/2); smoke 0)")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the final torch.profiler breakdown")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny GPT-2: checks the script")
    ap.add_argument("--prewarm-worker", type=int, nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    s = args.smoke
    args.batches = args.batches or ([1, 2] if s else [1, 8])
    args.prompt_len = args.prompt_len or (6 if s else 32)
    args.new_tokens = args.new_tokens or (2 if s else 128)
    args.check_steps = max(2, args.check_steps or (2 if s else 16))
    args.rounds = args.rounds or (1 if s else 5)
    args.final_rounds = args.final_rounds or (1 if s else 9)
    args.budget_s = args.budget_s or (900.0 if s else 170.0)
    args.jobs = (0 if s else min(8, max(1, (os.cpu_count() or 2) // 2))) if args.jobs is None else args.jobs
    args.timed_steps = 1 if s else args.new_tokens - 1
    args.max_len = args.prompt_len + args.new_tokens
    if args.new_tokens < 2:
        sys.exit("--new-tokens must be >= 2 (one decode step at least)")
    if args.prewarm_worker:
        return prewarm_worker(args)
    cuda = not s
    if cuda and not torch.cuda.is_available():
        sys.exit("tune_fused_gemv.py needs a CUDA GPU (or --smoke)")
    procs = start_workers(args) if args.jobs else []
    prov = df.versioned_provenance()
    est = estimate_s(args)
    result: dict = {"provenance": prov, "smoke": s,
                    "args": {k: str(v) for k, v in vars(args).items()}, "estimate_s": est,
                    "default_tuning": {r: list(v) for r, v in DEFAULT.items()},
                    "candidates": {r: [[list(c), why] for c, why in candidates(r, args)] for r in args.roles},
                    "search": {}, "best_tuning": {}, "final": {}}
    log(f"{prov.get('gpu') or 'CPU (smoke)'}, torch {prov['torch']}, triton {prov['triton']}; "
        f"{sum(len(candidates(r, args)) for r in args.roles)} candidates per batch at batches {args.batches}, "
        f"{args.jobs} compile workers; estimate ~{est:.0f} s, budget {args.budget_s:.0f} s")
    model = df.build_model(s)
    args.prompts = {b: torch.randint(0, model.config.vocab_size, (b, args.prompt_len),
                                     generator=torch.Generator().manual_seed(1)).to(model.lm_head.weight.device)
                    for b in args.batches}
    if procs:
        log(f"waiting for {len(procs)} compile workers")
        result["prewarm"] = pw = join_workers(procs, min(90.0, 0.5 * args.budget_s))
        errs = [e for r in pw["reports"] for e in r.get("errors", [])]
        log(f"compile workers done: {sum(r.get('items', 0) for r in pw['reports'])} configs, {len(errs)} errors"
            + (f", timed out: {pw['timed_out']}" if pw["timed_out"] else "") + (f" (first: {errs[0][:160]})" if errs else ""))
    searched = []
    for batch in args.batches:
        try:
            searched.append(search(model, batch, args, cuda))
            result["search"][str(batch)] = searched[-1]
            result["best_tuning"][str(batch)] = searched[-1]["best_tuning"]
        except Exception as exc:
            result["search"][str(batch)] = {"batch": batch, "error": df.error_text(exc)}
            log(f"batch {batch} failed: {exc}")
        write(result, args.out)
    merged, table = merge(searched, args.min_gain_us)
    result.update(merged_tuning={r: list(v) for r, v in merged.items()}, merged_table=table, tuning_to_paste=paste(merged))
    for sr in searched:
        b = sr["batch"]
        log(f"batch {b}: final comparison")
        try:
            result["final"][str(b)] = final(model, b, {"default": DEFAULT, f"best_b{b}": sr["best_tuning"],
                                                       "merged": merged}, args, cuda)
        except Exception as exc:
            result["final"][str(b)] = {"batch": b, "error": df.error_text(exc), "configs": []}
    write(result, args.out)
    print(summary(result), flush=True)
    log(f"wrote {args.out / 'tune_fused_gemv.json'}")


if __name__ == "__main__":
    main()
