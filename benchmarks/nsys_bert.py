"""BERT-base (seq128, fp16, batch 1) under Nsight Systems: the same calls notebook 07 profiles with
torch.profiler (``profile-bert``: modules annotated to depth 3, each call in an NVTX range ``forward``), either
eager forwards or GraphRunner replays, 20 of them between ``torch.cuda.profiler.start()`` and ``stop()`` so that
warm-up and capture stay out of the report. Run it through cgutils' nsys wrapper, one process per mode:

    python -m cgutils nsys --out results/nvidia-h200/nsys/bert_eager --range forward -- python benchmarks/nsys_bert.py eager
    python -m cgutils nsys --out results/nvidia-h200/nsys/bert_replay --range forward -- python benchmarks/nsys_bert.py replay
"""
import argparse

import torch

import cgutils as cg
from cgutils.checks import require_cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["eager", "replay"])
    parser.add_argument("--calls", type=int, default=20, help="calls inside the profiled range (default 20)")
    args = parser.parse_args()
    require_cuda("benchmarks/nsys_bert.py")
    built = cg.WORKLOADS["bert-base-seq128"].build("fp16", "cuda")
    ids, mask = built.inputs(0)
    hooks = cg.annotate_modules(built.model, depth=3)
    runner = cg.GraphRunner(built.step) if args.mode == "replay" else None
    step = (lambda: runner(ids, mask)) if runner else (lambda: built.step(ids, mask))
    with torch.no_grad():
        for _ in range(5):  # warm-up, and the runner's capture
            step()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for _ in range(args.calls):
            with cg.nvtx_range("forward"):
                step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    hooks.remove()
    print(f"{args.mode}: {args.calls} calls profiled on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
