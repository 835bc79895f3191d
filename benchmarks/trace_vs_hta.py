"""Peer benchmark: cgutils.trace against HolisticTraceAnalysis (HTA) on the same traces, same run.

For each trace, each tool runs in a fresh subprocess (so imports and caches do not leak between them):
load the trace, then compute kernel launch statistics. Reported: wall time of load + stats, peak
resident memory above the post-import baseline (VmHWM - VmRSS from /proc/self/status), launches
found, and agreement on the launches both report. HTA rounds event start and end times down to whole
µs (its log cites pytorch/pytorch#122425), so each of its durations and delays can differ from the
exact value by up to 2 µs: numbers agree when they differ by less than 2 µs.

Traces: the BERT-base traces recorded on the H200 (results/nvidia-h200/traces/) and a synthetic trace
of 200,000 events written here. Needs the `bench` extra: `pip install -e '.[bench]'`.

    python benchmarks/trace_vs_hta.py [--events 200000]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, sys, time
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
tool, path = sys.argv[1], sys.argv[2]
if tool == "cgutils":
    from cgutils.trace import load_trace
else:
    import logging; logging.disable(logging.CRITICAL)
    from hta.trace_analysis import TraceAnalysis
base = rss("VmRSS:")
t0 = time.perf_counter()
if tool == "cgutils":
    t = load_trace(path)
    s = t.launch_stats()
    s = s.assign(delay_after_call=s.launch_delay_us - s.cpu_us)
    out = s[["correlation", "call", "cpu_us", "gpu_us", "delay_after_call", "activities"]]
else:
    import os
    a = TraceAnalysis(trace_dir=os.path.dirname(path))
    r = a.get_cuda_kernel_launch_stats(visualize=False)
    out = next(iter(r.values())) if r else None
elapsed = time.perf_counter() - t0
peak = rss("VmHWM:") - base
rows = [] if out is None else out.to_dict(orient="records")
print(json.dumps({"seconds": elapsed, "peak_bytes": peak, "rows": rows}))
'''


def synthetic_trace(path: Path, events: int, seed: int = 0) -> None:
    """A Kineto-like trace: per launch, one cpu_op, one cudaLaunchKernel and one kernel (3 events)."""
    rng = random.Random(seed)
    evs, ts = [], 0.0
    for i in range(events // 3):
        op_dur, call_dur, k_dur = rng.uniform(8, 20), rng.uniform(3, 9), rng.uniform(1, 30)
        evs.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": ts, "dur": op_dur,
                    "args": {"External id": i}})
        evs.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                    "ts": ts + 1, "dur": call_dur, "args": {"correlation": i + 1, "External id": i}})
        evs.append({"ph": "X", "cat": "kernel", "name": "add_kernel", "pid": 0, "tid": 7, "ts": ts + 1 + call_dur + 2,
                    "dur": k_dur, "args": {"correlation": i + 1, "stream": 7, "device": 0, "External id": i}})
        ts += op_dur + k_dur + 5
    doc = {"schemaVersion": 1, "distributedInfo": {"rank": 0}, "deviceProperties": [], "traceEvents": evs}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)


def run(tool: str, path: Path) -> dict:
    # each tool gets its own folder: HTA reads every trace in a directory
    with tempfile.TemporaryDirectory() as d:
        local = Path(d) / path.name
        shutil.copy(path, local)
        proc = subprocess.run([sys.executable, "-c", CHILD, tool, str(local)], capture_output=True, text=True,
                              cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def agreement(ours: list[dict], hta: list[dict]) -> tuple[int, float]:
    """(launches reported by both, fraction of them that agree on all three numbers within HTA's rounding)."""
    a = pd.DataFrame(ours)
    b = pd.DataFrame(hta)
    if a.empty or b.empty:
        return 0, float("nan")
    m = a.merge(b, on="correlation")
    if m.empty:
        return 0, float("nan")
    ok = ((m.cpu_us - m.cpu_duration).abs() < 2) & ((m.gpu_us - m.gpu_duration).abs() < 2) & \
         ((m.delay_after_call - m.launch_delay).abs() < 2)
    return len(m), float(ok.mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000, help="events in the synthetic trace")
    args = parser.parse_args()
    traces = sorted((ROOT / "results").glob("*/traces/*.json.gz"))
    tmp = Path(tempfile.mkdtemp())
    synth = tmp / f"synthetic_{args.events}.json.gz"
    synthetic_trace(synth, args.events)
    rows = []
    for path in [*traces, synth]:
        ours, hta = run("cgutils", path), run("hta", path)
        both, agree = agreement(ours.get("rows", []), hta.get("rows", []))
        rows.append({
            "trace": path.name,
            "cgutils_s": ours.get("seconds"), "hta_s": hta.get("seconds"),
            "time_ratio": (ours.get("seconds") or float("nan")) / (hta.get("seconds") or float("nan")),
            "cgutils_peak_MiB": (ours.get("peak_bytes") or 0) / 2**20, "hta_peak_MiB": (hta.get("peak_bytes") or 0) / 2**20,
            "memory_ratio": (ours.get("peak_bytes") or float("nan")) / (hta.get("peak_bytes") or float("nan")),
            "cgutils_launches": len(ours.get("rows", [])), "hta_launches": len(hta.get("rows", [])),
            "cgutils_gpu_activities": sum(r["activities"] for r in ours.get("rows", [])),
            "both": both, "agree_within_rounding": agree,
            "errors": "; ".join(f"{k}: {v['error']}" for k, v in (("cgutils", ours), ("hta", hta)) if "error" in v),
        })
    df = pd.DataFrame(rows)
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.precision", 3):
        print(df.to_string(index=False))
    out = ROOT / "build" / "bench" / "trace_vs_hta.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(f"wrote {out}; ratios are cgutils / HTA (lower is better), measured in this run on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
