"""Issue 25: GPT-2's greedy decode step against the memory-bandwidth floor, one run on one GPU: the command line
of :func:`cgutils.bench.decode.decode_floor_run` (notebook 06 and ``python -m cgutils bench generation`` run the
same measurement), writing the whole result as JSON.

GPT-2 small (random weights, the workloads' model) in fp16, a 32-token prompt and 128 new tokens, batch 1
and 8. Four routes:

- ``plain``: ``StaticKVState.decode_step`` (PyTorch ops, SDPA over the whole cache) in one CUDA graph;
- ``fused``: ``FusedKVState.decode_step`` (``cgutils.generation.fused_step``, Triton) in one CUDA graph;
- ``fused_pdl``: the same with ``pdl=True``: Programmatic Dependent Launch, each kernel's parameters loaded
  before it waits for the previous kernel (``cgutils.generation.fused_kernels``; compute capability >= 9.0;
  ``--tuning`` does not apply: its shapes are ``fused_step.PDL_TUNING``);
- ``hf``: transformers' ``generate(cache_implementation="static")`` (``cgutils.generation.hf_generate``);
  its time per token is a whole generate call (prefill and host work included) over the new tokens.

For each: ms per decode step (a step yields one token per batch row) as the median and p10/p90 across
interleaved trials (the route order rotates every trial; graph routes: CUDA events around the 127 replays
after a prefill); the tokens of one generation, compared between routes (equal, or the first differing
step, and there, for the first row that differs, each route's top-2 logit margin in fp32, so that a near-tie
shows as one); kernels and GPU-busy µs per step by kernel class from ``torch.profiler`` (CUDA activity) over a
few replays; and the floor: weight bytes plus the keys/values of positions ``0..pos`` (averaged over the
steps), over the device-to-device bandwidth of a 1 GiB ``copy_`` (read + write bytes) timed by CUDA events.
Each route's ratio to that floor. A route that fails is recorded with its error; the others go on.

    python benchmarks/decode_floor.py --out DIR [--trials 9] [--batches 1 8] [--routes plain fused fused_pdl hf]
                                      [--tuning DIR/tune_fused_gemv.json]   # the fused route's launch shapes
    python benchmarks/decode_floor.py --smoke --out DIR   # CPU, Triton's interpreter, a tiny GPT-2

Writes ``DIR/decode_floor.json`` (provenance: versions, GPU, ``CGUTILS_GIT_COMMIT``) and prints a summary.
``--smoke`` checks the script end to end without a GPU: eager steps, no graphs, no CUDA profile; its
timings mean nothing. Its routes agree, so it records fused_vs_plain's and fused_pdl_vs_plain's margins at step 1
anyway (``"probe": true``).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the fused kernels are defined: before triton is imported

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from cgutils.bench.decode import ROUTES, DecodeFloorConfig, decode_floor_run, load_tuning  # noqa: E402
from cgutils.errors import InputError  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def summary(result: dict) -> str:
    lines = [f"GPU: {result['provenance'].get('gpu')}  copy bandwidth: "
             f"{(result.get('copy_bandwidth') or {}).get('GBps_read_plus_write', float('nan')):.0f} GB/s (read + write)"]
    for b in result["batches"]:
        fl = b["floor"]
        lines.append(f"\nbatch {b['batch']}: floor {fl.get('floor_us', float('nan')):.1f} us/step "
                     f"({fl['total_bytes'] / 1e6:.1f} MB: weights {fl['weight_bytes'] / 1e6:.1f}, "
                     f"cache {fl['cache_bytes_avg'] / 1e6:.1f})")
        for name, r in b["routes"].items():
            if "ms_per_step" not in r:
                lines.append(f"  {name:9s} FAILED: {r.get('error', '?').splitlines()[0]}")
                continue
            s, prof = r["ms_per_step"], r.get("profile", {})
            lines.append(f"  {name:9s} {s['median']:.4f} ms/step (p10 {s['p10']:.4f}, p90 {s['p90']:.4f}), "
                         f"x{r.get('ratio_to_floor', float('nan')):.1f} floor, "
                         f"{prof.get('kernels_per_step', float('nan')):.1f} kernels/step, "
                         f"GPU busy {prof.get('gpu_busy_us_per_step', float('nan')):.1f} us/step")
            for cls, us in list(prof.get("us_per_step_by_class", {}).items())[:6]:
                lines.append(f"           {cls:14s} {us:8.1f} us")
        for k, v in b["tokens"].items():
            lines.append(f"  tokens {k}: " + ("equal" if v["equal"] else
                                               f"differ from step {v.get('first_differing_step')} "
                                               f"(rows {v.get('rows_differing_there')}, {v.get('same_fraction', 0):.0%} same)"))
            mg = v.get("margins")
            for name, m in (mg or {}).get("routes", {}).items():
                at = f"step {mg['step']} row {mg['row']}" + (" (probe)" if mg.get("probe") else "")
                lines.append(f"    {name:9s} at {at}: token {m['token']}, " + (
                    f"top-2 margin {m['top2_margin']:.4g} (ids {m['top2_ids']}), own - rival {m['own_minus_rival_token']:.4g}"
                    if "top2_margin" in m else m.get("note") or m.get("error", "?").splitlines()[0]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for decode_floor.json")
    ap.add_argument("--trials", type=int, default=None, help="interleaved trials (default 9; smoke 2)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8; smoke 1 2)")
    ap.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 32; smoke 6)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens (default 128; smoke 4)")
    ap.add_argument("--tuning", default=None,
                    help="the fused route's launch shapes: tune_fused_gemv.json (its merged_tuning) or a JSON mapping "
                         "{role: [BN, BK, split, stages, warps]}; roles left out, or no --tuning: fused_step.TUNING")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny GPT-2: checks the script")
    args = ap.parse_args()
    try:
        tuning = load_tuning(args.tuning)
    except (OSError, ValueError, InputError) as exc:
        sys.exit(f"--tuning {args.tuning!r}: {exc}")
    s = args.smoke
    cfg = DecodeFloorConfig(batches=tuple(args.batches or ([1, 2] if s else [1, 8])), routes=tuple(args.routes),
                            trials=args.trials or (2 if s else 9), prompt_len=args.prompt_len or (6 if s else 32),
                            new_tokens=args.new_tokens or (4 if s else 128), tuning_table=tuning, smoke=s, log=log)
    try:
        result = decode_floor_run(cfg)
    except InputError as exc:
        sys.exit(f"decode_floor.py: {exc}")
    result["fused_tuning_from"] = args.tuning or "fused_step.TUNING"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_floor.json").write_text(json.dumps(result, indent=1))
    print(summary(result), flush=True)
    log(f"wrote {args.out / 'decode_floor.json'}")


if __name__ == "__main__":
    main()
