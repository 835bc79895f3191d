"""What GraphRunner's safety costs per call, measured side by side in one run on BERT-base fp16 (batch 1).

Host time per call is what GraphRunner adds: the GPU work of a call is the same graph either way. Each
variant enqueues ``--calls`` calls (the GPU queue holds them, so the loop measures the host's enqueue
time) and the median of interleaved trials is reported with its p10-p90 spread:

- raw replay: copy into static inputs, ``graph.replay()``, clone the output (the least any safe caller does);
- GraphRunner: the same through ``runner(...)`` (binding, input check fast path, lock, stream ordering,
  copy-back of in-place inputs when there are any, output clone).

Then throughput of one runner shared by 1 and by 8 threads (each thread on its own CUDA stream), with the
count of wrong results (each checked against eager). Then the check for weights replaced after capture
(``cgutils.capture.weights.WeightWatch`` on BERT-base's 201 parameters and buffers): host µs per call while
nothing changed (every call pays it), and once after an unrelated event (the full comparison); and updating
weights: ``runner.load_state_dict(sd)`` (copy in place, graph kept) against a capture again after
``load_state_dict(sd, assign=True)``, in ms. Writes a JSON summary with ``--out``.

    python benchmarks/runner_overhead.py [--calls 50] [--trials 15] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import torch

import cgutils as cg
from cgutils import host_us_per_call
from cgutils.workloads import WORKLOADS


def spread(samples: list[float]) -> dict:
    p10, med, p90 = np.percentile(samples, [10, 50, 90])
    return {"median": float(med), "p10": float(p10), "p90": float(p90), "n": len(samples)}


def threads_run(runner, model, n_threads: int, calls_per_thread: int) -> dict:
    inputs = [[(torch.randint(0, 30000, (1, 128), device="cuda"), torch.ones(1, 128, dtype=torch.int64, device="cuda"))
               for _ in range(calls_per_thread)] for _ in range(n_threads)]
    results: list[list] = [[] for _ in range(n_threads)]
    streams = [torch.cuda.Stream() for _ in range(n_threads)]

    def worker(t: int) -> None:
        with torch.cuda.stream(streams[t]):
            for ids, mask in inputs[t]:
                results[t].append(runner(ids, mask))

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    wrong = 0
    with torch.no_grad():
        for t in range(n_threads):
            for (ids, mask), got in zip(inputs[t], results[t], strict=True):
                wrong += cg.max_rel_error(got, model(ids, mask)) > 1e-2
    total = n_threads * calls_per_thread
    return {"threads": n_threads, "calls": total, "calls_per_s": total / wall, "wrong": int(wrong)}


def weights_run(model, ids, mask, trials: int) -> dict:
    """The weights-replaced check's cost per call, and new weights loaded in place vs captured again."""
    import warnings

    runner = cg.GraphRunner(model)
    runner(ids, mask)
    watch = runner._weights
    check = [host_us_per_call(watch.replaced, calls=1000, warmup=0) for _ in range(trials)]
    cg.capture.weights._bump()  # an event: the next check compares every tensor, then settles
    t0 = time.perf_counter()
    assert watch.replaced() == []
    full_us = (time.perf_counter() - t0) * 1e6
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    in_place, again = [], []
    for _ in range(trials):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.load_state_dict(sd)
        runner(ids, mask)
        torch.cuda.synchronize()
        in_place.append((time.perf_counter() - t0) * 1e3)
    for _ in range(min(trials, 5)):
        model.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner(ids, mask)  # sees the new tensors, captures again
        torch.cuda.synchronize()
        again.append((time.perf_counter() - t0) * 1e3)
    return {"tensors": len(watch.captured), "check_us": spread(check), "full_check_us": full_us,
            "load_in_place_ms": spread(in_place), "recapture_ms": spread(again)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50, help="calls per timed loop (default 50)")
    ap.add_argument("--trials", type=int, default=15, help="interleaved trials per variant (default 15)")
    ap.add_argument("--thread-calls", type=int, default=50, help="calls per thread in the threads run (default 50)")
    ap.add_argument("--out", help="write the summary as JSON here")
    args = ap.parse_args()
    cg.checks.require_cuda("benchmarks/runner_overhead.py")

    built = WORKLOADS["bert-base-seq128"].build("fp16", "cuda")
    ids, mask = built.inputs(0)
    runner = cg.GraphRunner(built.step)
    runner(ids, mask)
    static_ids, static_mask = ids.clone(), mask.clone()
    graph, static_out = cg.capture_graph(lambda: built.step(static_ids, static_mask), pool=torch.cuda.graph_pool_handle())

    def raw() -> torch.Tensor:
        static_ids.copy_(ids)
        static_mask.copy_(mask)
        graph.replay()
        return static_out.clone()

    variants = {"raw replay": raw, "GraphRunner": lambda: runner(ids, mask)}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        host_us_per_call(fn, calls=args.calls, warmup=0)  # warm
    for _ in range(args.trials):  # interleaved: host noise hits both alike
        for name, fn in variants.items():
            samples[name].append(host_us_per_call(fn, calls=args.calls, warmup=0))
    diffs = [r - w for r, w in zip(samples["GraphRunner"], samples["raw replay"], strict=True)]
    summary = {
        "provenance": cg.provenance(), "workload": "bert-base-seq128 fp16",
        "host_us_per_call": {k: spread(v) for k, v in samples.items()},
        "runner_minus_raw_us": spread(diffs),
        "threads": [threads_run(runner, built.step, n, args.thread_calls) for n in (1, 8)],
    }
    summary["throughput_8_vs_1"] = summary["threads"][1]["calls_per_s"] / summary["threads"][0]["calls_per_s"]
    summary["weights"] = weights_run(built.model, ids, mask, args.trials)
    for name, s in summary["host_us_per_call"].items():
        print(f"{name:12s} host µs/call: median {s['median']:.1f} (p10 {s['p10']:.1f}, p90 {s['p90']:.1f}, n={s['n']})")
    d = summary["runner_minus_raw_us"]
    print(f"GraphRunner - raw replay: {d['median']:.1f} µs/call (p10 {d['p10']:.1f}, p90 {d['p90']:.1f}), "
          f"median of paired trials {statistics.median(diffs):.1f}")
    for row in summary["threads"]:
        print(f"{row['threads']} thread(s): {row['calls_per_s']:.0f} calls/s over {row['calls']} calls, "
              f"{row['wrong']} wrong")
    print(f"throughput 8 threads / 1 thread: {summary['throughput_8_vs_1']:.2f}x")
    w = summary["weights"]
    print(f"weights-replaced check: {w['check_us']['median']:.2f} µs/call while nothing changed (p10 "
          f"{w['check_us']['p10']:.2f}, p90 {w['check_us']['p90']:.2f}); {w['full_check_us']:.0f} µs once after an "
          f"event ({w['tensors']} tensors)")
    print(f"new weights: load in place {w['load_in_place_ms']['median']:.2f} ms vs capture again "
          f"{w['recapture_ms']['median']:.1f} ms ({w['recapture_ms']['median'] / w['load_in_place_ms']['median']:.0f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
