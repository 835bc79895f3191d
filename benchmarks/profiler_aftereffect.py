"""Does launching get slower after torch.profiler has run in the process? (pytorch/pytorch#144455 reports that
Kineto leaves CUPTI attached after a profile ends.) One process per setting, plain PyTorch:

- host µs of one ``graph.replay()`` of a 256-node chain of tiny kernels, after a sync (median of 200 calls);
- host µs per eager launch of the same chain, back to back (median of 20 passes);
each measured before and after one ``torch.profiler.profile(activities=[CPU, CUDA])`` of a few calls, in a
fresh process, once with the environment as is and once with ``TEARDOWN_CUPTI=1`` (read by Kineto when the
profiler starts; whether this torch honours it is what the run shows).

    python benchmarks/profiler_aftereffect.py --out DIR   # writes DIR/profiler_aftereffect.json
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from cgutils.env import provenance

CHILD = r'''
import json, statistics, sys, time
import torch
n = 256
x = torch.zeros(1024, device="cuda")
def chain():
    for _ in range(n):
        x.add_(1.0)
for _ in range(3):
    chain()
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    chain()
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g):
    chain()
g.replay(); torch.cuda.synchronize()
def measure():
    rep = []
    for _ in range(200):
        torch.cuda.synchronize()
        t = time.perf_counter(); g.replay(); rep.append((time.perf_counter() - t) * 1e6)
    eag = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter(); chain(); eag.append((time.perf_counter() - t) * 1e6 / n)
    torch.cuda.synchronize()
    return {"replay_host_us": statistics.median(rep), "eager_host_us_per_launch": statistics.median(eag)}
before = measure()
acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
with torch.profiler.profile(activities=acts):
    for _ in range(3):
        g.replay(); chain()
    torch.cuda.synchronize()
after = measure()
print(json.dumps({"before": before, "after": after, "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name(0)}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="directory to write profiler_aftereffect.json into")
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per setting (>= 1, default 2)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out must be a directory (it holds profiler_aftereffect.json); {args.out} is a file")
    import torch  # only here: --help works without it

    if not torch.cuda.is_available():
        sys.exit("profiler_aftereffect.py times CUDA launches: it needs a CUDA GPU (none is visible here)")
    rows = []
    for setting in ("default", "TEARDOWN_CUPTI=1") * args.repeats:
        env = dict(os.environ)
        if setting != "default":
            env["TEARDOWN_CUPTI"] = "1"
        run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=180)
        if run.returncode != 0:
            rows.append({"setting": setting, "error": run.stderr[-2000:]})
            print(setting, "failed:", run.stderr[-500:], flush=True)
            continue
        res = json.loads(run.stdout.strip().splitlines()[-1])
        res["setting"] = setting
        rows.append(res)
        b, a = res["before"], res["after"]
        print(f"{setting:18s} replay host {b['replay_host_us']:7.1f} -> {a['replay_host_us']:7.1f} us; eager per launch "
              f"{b['eager_host_us_per_launch']:6.2f} -> {a['eager_host_us_per_launch']:6.2f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    (args.out / "profiler_aftereffect.json").write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1))
    if not any("error" not in r for r in rows):
        sys.exit("every child process failed (their errors are in the JSON)")


if __name__ == "__main__":
    main()
