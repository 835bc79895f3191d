"""Does launching get slower after torch.profiler has run in the process? (pytorch/pytorch#144455 reports that
Kineto leaves CUPTI attached after a profile ends.) One process per setting, plain PyTorch:

- host µs of one ``graph.replay()`` of a 256-node chain of tiny kernels, after a sync (median of 200 calls);
- host µs per eager launch of the same chain, back to back (median of 20 passes);
each measured before and after one ``torch.profiler.profile(activities=[CPU, CUDA])`` of a few calls, in a
fresh process, once with the environment as is, once with ``TEARDOWN_CUPTI=1`` in the process's environment from
its start, once with it set by the process itself (``os.environ``) after CUDA graphs were captured, and once set
around each session only (set before, the earlier value restored after), as a library would, and set by the process
with 50 ms of sleeps and syncs after each session, so that Kineto's pending teardown can finish before anything else,
and set around each session with those 50 ms before it is restored (what ``cgutils.overhead.profiler_session`` does)
(whether this torch honours each is what the run shows). Every setting then profiles a second time, with a graph replay inside (CUPTI
re-initialised after a teardown, with graphs alive: the crash torch's own comments warn of for CUDA 11/12),
measures again (``after2``), runs two sessions back to back and counts the GPU activities the second one saw (a
session started while a teardown is pending can see none: pytorch/kineto#1554), captures a new graph and checks
its replay's result.

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
if "--set-at-runtime" in sys.argv:
    import os
    os.environ["TEARDOWN_CUPTI"] = "1"
acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
import contextlib
import os


@contextlib.contextmanager
def session(activities):
    scoped = "--scoped" in sys.argv
    before_env = os.environ.get("TEARDOWN_CUPTI")
    if scoped:
        os.environ["TEARDOWN_CUPTI"] = "1"
    try:
        with torch.profiler.profile(activities=activities) as p:
            yield p
        if "--settle" in sys.argv:  # Kineto finalizes CUPTI's teardown at the exit of a later runtime call: give it some
            for _ in range(5):
                time.sleep(0.01)
                torch.cuda.synchronize()
    finally:  # settled before the variable is restored, so that the teardown still sees it
        if scoped:
            os.environ.pop("TEARDOWN_CUPTI", None) if before_env is None else os.environ.update(TEARDOWN_CUPTI=before_env)


def gpu_activities(prof):
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


with session(acts):
    for _ in range(3):
        g.replay(); chain()
    torch.cuda.synchronize()
after = measure()
with session(acts) as prof:
    g.replay()
    torch.cuda.synchronize()
seen = gpu_activities(prof)
after2 = measure()
with session(acts):  # a throw-away session, then the real one at once (what cgutils.gpu_activity does)
    x.add_(1.0)
    torch.cuda.synchronize()
with session(acts) as prof:
    g.replay()
    torch.cuda.synchronize()
back_to_back = gpu_activities(prof)
y = torch.zeros(4, device="cuda")
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2):
    y.add_(2.0)
g2.replay(); g2.replay(); torch.cuda.synchronize()
print(json.dumps({"before": before, "after": after, "after2": after2, "second_profile_gpu_activities": seen,
                  "back_to_back_gpu_activities": back_to_back,
                  "new_graph_ok": bool((y == 4).all()), "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name(0)}))
'''


RUNTIME = "TEARDOWN_CUPTI=1 set by the process"
SCOPED = "TEARDOWN_CUPTI=1 around each session only"
SETTLED = "TEARDOWN_CUPTI=1 set by the process, settled after each session"
SCOPED_SETTLED = "TEARDOWN_CUPTI=1 around each session, settled before it is restored"
SETTINGS = ("default", "TEARDOWN_CUPTI=1", RUNTIME, SCOPED, SETTLED, SCOPED_SETTLED)


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
    for setting in SETTINGS * args.repeats:
        env = dict(os.environ)
        env.pop("TEARDOWN_CUPTI", None)
        if setting == "TEARDOWN_CUPTI=1":
            env["TEARDOWN_CUPTI"] = "1"
        flags = {RUNTIME: ["--set-at-runtime"], SCOPED: ["--scoped"],
                 SETTLED: ["--set-at-runtime", "--settle"], SCOPED_SETTLED: ["--scoped", "--settle"]}.get(setting, [])
        run = subprocess.run([sys.executable, "-c", CHILD, *flags], env=env, capture_output=True, text=True,
                             timeout=180)
        if run.returncode != 0:
            rows.append({"setting": setting, "error": run.stderr[-2000:]})
            print(setting, "failed:", run.stderr[-500:], flush=True)
            continue
        res = json.loads(run.stdout.strip().splitlines()[-1])
        res["setting"] = setting
        rows.append(res)
        b, a = res["before"], res["after"]
        a2 = res["after2"]
        print(f"{setting:34s} replay host {b['replay_host_us']:6.1f} -> {a['replay_host_us']:6.1f} -> "
              f"{a2['replay_host_us']:6.1f} us; eager per launch {b['eager_host_us_per_launch']:5.2f} -> "
              f"{a['eager_host_us_per_launch']:5.2f} -> {a2['eager_host_us_per_launch']:5.2f} us; second profile saw "
              f"{res['second_profile_gpu_activities']} GPU activities, back to back "
              f"{res['back_to_back_gpu_activities']}, new graph ok: {res['new_graph_ok']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    (args.out / "profiler_aftereffect.json").write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1))
    if not any("error" not in r for r in rows):
        sys.exit("every child process failed (their errors are in the JSON)")


if __name__ == "__main__":
    main()
