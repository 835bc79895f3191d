"""Issue 25, a probe before any change to the fused decode step: does Programmatic Dependent Launch (PDL)
shorten a CUDA graph of GPT-2-shaped matrix-vector kernels, and by how much?

The fused step (``cgutils.generation.fused_step``) is 62 kernels per token; on the H200 its matrix-vector
kernels read 1.2-4.7 MB each in 5-6.5 µs (``results/nvidia-h200/decode_floor``), far from the ~1 µs the
bytes alone take at the device's copy bandwidth: each kernel pays a ramp-up (launch, CTA scheduling, the first
DRAM round trips) that the next kernel cannot start before the last one ends. On compute capability 9.0, PDL
lets a kernel launched with ``cudaLaunchAttributeProgrammaticStreamSerialization`` (Triton: ``launch_pdl=True``)
start while the one before it runs; it must execute ``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait()``)
before touching anything the earlier kernel writes or reads (NVIDIA CUDA Programming Guide, "Programmatic
Dependent Launch and Synchronization"). Weights are written by nobody, so they may be loaded before the wait.

A chain of 12 layers x (QKV 768->2304, projection 768->768, MLP up 768->3072, MLP down 3072->768) plus the
lm_head (768->50257), fp16 weights, fp32 activations, each kernel reading the previous one's output, is
captured in one CUDA graph three ways:

- ``plain``: ordinary launches;
- ``pdl_wait_first``: PDL launches, each kernel waits first and then loads everything (only the launch and
  CTA set-up overlap the previous kernel);
- ``pdl_prefetch``: PDL launches, each kernel loads its weight block, then waits, then loads its input.

The outputs of the three are compared bit for bit (a race would show as a difference), then each graph is
replayed in interleaved trials (order rotated per trial), CUDA events around ``--replays`` replays. The floor:
weight bytes over the bandwidth of a 1 GiB device ``copy_`` (read + write) timed in the same run.

    python benchmarks/pdl_probe.py --out DIR [--trials 7] [--replays 200]

Writes ``DIR/pdl_probe.json`` (provenance) and prints a table. Needs a CUDA GPU of compute capability >= 9.0
and Triton with ``tl.extra.cuda.gdc_wait``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from cgutils.bench.decode import copy_bandwidth
from cgutils.env import provenance

try:
    import triton
    import triton.language as tl
except ImportError:  # the probe needs Triton; main() says so
    triton = None

LAYERS = 12
SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # (K, N) of one layer's four products
LM_HEAD = (768, 50257)
BLOCK_BYTES = 32 * 1024  # one program's weight block: fits in registers at 4 warps (64 fp16 pairs a thread)

if triton is not None:

    @triton.jit
    def _gemv(w_ptr, x_ptr, y_ptr, N, K: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr,
              PDL: tl.constexpr, PREFETCH: tl.constexpr):
        # y[N] = W[N, K] @ x[K]; one program holds a (BN, K) block of W in registers.
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.arange(0, KP)
        wmask = (rows[:, None] < N) & (cols[None, :] < K)
        if PREFETCH:  # W is written by no kernel: safe to read before the wait
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=wmask, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()  # the previous kernel has finished and its writes are visible
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its own prologue
        if not PREFETCH:
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=wmask, other=0.0)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(y_ptr + rows, y, mask=rows < N)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class Chain:
    """The 49 products, their weights (fp16, ~0.02 scale) and fp32 activation buffers; ``run(variant)``
    launches all of them on the current stream."""

    def __init__(self, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        dims = SHAPES * LAYERS + [LM_HEAD]
        self.weights = [torch.randn(n, k, generator=g, device="cuda", dtype=torch.float16) * 0.02 for k, n in dims]
        self.x0 = torch.randn(768, generator=g, device="cuda")
        self.outs = [torch.empty(n, device="cuda") for _, n in dims]
        self.dims = dims

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)

    def run(self, variant: str) -> torch.Tensor:
        pdl, prefetch = variant != "plain", variant == "pdl_prefetch"
        x = self.x0
        for (k, n), w, y in zip(self.dims, self.weights, self.outs):
            kp = _pow2(k)
            bn = max(1, min(64, BLOCK_BYTES // (kp * 2)))
            meta = {"launch_pdl": True} if pdl else {}
            _gemv[(triton.cdiv(n, bn),)](w, x, y, n, K=k, KP=kp, BN=bn, PDL=pdl, PREFETCH=prefetch, num_warps=4,
                                          **meta)
            x = y  # the next product reads this one's output (its first K values)
        return self.outs[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for pdl_probe.json")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--replays", type=int, default=200, help="replays between two CUDA events, per trial")
    args = ap.parse_args(argv)
    if triton is None or not torch.cuda.is_available():
        sys.exit("pdl_probe needs a CUDA GPU and Triton")
    if torch.cuda.get_device_capability()[0] < 9:
        sys.exit(f"PDL needs compute capability >= 9.0; this GPU is {torch.cuda.get_device_capability()}")
    args.out.mkdir(parents=True, exist_ok=True)
    chain = Chain()
    variants = ("plain", "pdl_wait_first", "pdl_prefetch")
    results = {}
    for v in variants:  # eager once (compiles), then bit-for-bit against plain
        results[v] = chain.run(v).clone()
    torch.cuda.synchronize()
    equal = {v: bool(torch.equal(results[v], results["plain"])) for v in variants}
    graphs = {}
    for v in variants:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain.run(v)
        torch.cuda.current_stream().wait_stream(side)
        graphs[v] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[v]):
            chain.run(v)
    replayed = {}
    for v in variants:
        graphs[v].replay()
        torch.cuda.synchronize()
        replayed[v] = chain.outs[-1].clone()
    equal_replay = {v: bool(torch.equal(replayed[v], results["plain"])) for v in variants}
    rows = []
    for trial in range(args.trials):
        order = variants[trial % 3:] + variants[:trial % 3]
        for v in order:
            for _ in range(5):
                graphs[v].replay()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.replays):
                graphs[v].replay()
            b.record()
            b.synchronize()
            rows.append({"trial": trial, "variant": v, "us_per_step": a.elapsed_time(b) * 1e3 / args.replays})
    gbps = copy_bandwidth(True)["GBps_read_plus_write"]  # decode_floor's: median of 5 copies of 1 GiB
    floor_us = chain.weight_bytes / (gbps * 1e9) * 1e6
    summary = {}
    for v in variants:
        us = np.array([r["us_per_step"] for r in rows if r["variant"] == v])
        summary[v] = {"median_us": float(np.median(us)), "p10_us": float(np.percentile(us, 10)),
                      "p90_us": float(np.percentile(us, 90)), "kernels": len(chain.dims),
                      "us_per_kernel": float(np.median(us)) / len(chain.dims),
                      "ratio_to_floor": float(np.median(us)) / floor_us, "equal_eager": equal[v],
                      "equal_replay": equal_replay[v]}
    out = {"provenance": {**provenance(), "triton": triton.__version__}, "args": {k: str(v) for k, v in vars(args).items()},
           "weight_bytes": chain.weight_bytes, "copy_GBps_read_plus_write": gbps, "floor_us": floor_us,
           "summary": summary, "trials": rows}
    (args.out / "pdl_probe.json").write_text(json.dumps(out, indent=1))
    print(f"floor {floor_us:.1f} µs ({chain.weight_bytes / 1e6:.0f} MB at {gbps:.0f} GB/s)")
    for v, s in summary.items():
        print(f"{v:16s} {s['median_us']:7.1f} µs/step (p10-p90 {s['p10_us']:.1f}-{s['p90_us']:.1f}), "
              f"{s['us_per_kernel']:.2f} µs/kernel, {s['ratio_to_floor']:.2f}x floor, equal {s['equal_eager']}/"
              f"{s['equal_replay']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
