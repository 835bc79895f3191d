"""Pure PyTorch reproducer: a hand-captured CUDA graph fails its replay with "an illegal memory access" after
``torch.compile(mode="reduce-overhead")`` runs in the same process, when an earlier graph was freed.

    python docs/repro/cublas_workspace_fault.py compile bert              # the fault
    python docs/repro/cublas_workspace_fault.py compile_clear_before bert # the workaround: replay OK

Flags in the first argument (joined with "_"): ``compile`` (run a reduce-overhead compile of B), ``clearws``
(instead, clear the cuBLAS workspaces and empty the cache directly), ``noA`` (no first graph), ``clear_before``
(clear the workspaces before each hand capture: the workaround). Second argument: ``bert`` (BERT-base fp16,
batch 1, 128 tokens) or ``mlp`` (two small Linear layers). Prints the graph-pool segments (address, MiB, pool
id) after B's capture and before the failing replay: docs/pytorch-cublas-workspace-fault.md reads them.
"""

import gc
import sys

import torch
from torch import nn

what, model = sys.argv[1], sys.argv[2]
torch.manual_seed(0)


def make():
    if model == "bert":
        from transformers import BertConfig, BertModel

        return BertModel(BertConfig()).eval().cuda().half(), torch.randint(0, 1000, (1, 128), device="cuda")
    net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).eval().cuda()
    return net, torch.randn(4, 256, device="cuda")


def graph(m, x):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            m(x)
    torch.cuda.current_stream().wait_stream(s)
    if "clear_before" in what:
        torch._C._cuda_clearCublasWorkspaces()  # the workaround: this capture makes its own workspace, in its pool
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        m(x)
    return g


def segments(tag):
    print(tag, [(hex(s["address"]), s["total_size"] >> 20, tuple(s.get("segment_pool_id") or ()))
                for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id") or ()) != (0, 0)], flush=True)


with torch.no_grad():
    if "noA" not in what:
        a, xa = make()
        g_a = graph(a, xa)  # its capture makes the cuBLAS workspace of the capture stream, in A's pool
        g_a.replay()
        torch.cuda.synchronize()
        del g_a, a  # A's pool has no graph left, but the workspace (held by cuBLAS) keeps its segment alive
        gc.collect()
    b, xb = make()
    g_b = graph(b, xb)  # reuses that workspace: B's kernels now point into A's dead pool
    g_b.replay()
    torch.cuda.synchronize()
    segments("after B")
    if "compile" in what:
        c = torch.compile(b.forward if model == "bert" else b, mode="reduce-overhead")
        for _ in range(3):
            c(xb)  # CUDA graph trees clear the cuBLAS workspaces around warm-up and recording
    if "clearws" in what:
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    segments("before replay")
    g_b.replay()
    torch.cuda.synchronize()
    print(what, model, "REPLAY OK", flush=True)
