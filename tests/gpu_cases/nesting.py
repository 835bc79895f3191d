"""One nesting of WHILE/IF conditional nodes, run by tests/test_gpu_control.py in a process of its own (a native
crash then fails one test instead of killing the run): a transducer-style greedy decoder (outer WHILE over
frames, inner WHILE over the symbols of one frame, an IF around the emitting step), captured by a plain
torch.cuda.graph and by GraphRunner, each compared with the Python loop.

    python tests/gpu_cases/nesting.py CASE plain|runner|both
"""
import faulthandler
import sys

import torch
from torch import nn

import cgutils as cg

faulthandler.enable()
case, vias = sys.argv[1], ["plain", "runner"] if sys.argv[2] == "both" else [sys.argv[2]]
torch.manual_seed(0)
H, V, T, U = 64, 16, 6, 4
dev = "cuda"
enc = torch.randn(T, H, device=dev)
joint, pred, emb = nn.Linear(H, V).to(dev), nn.Linear(H, H).to(dev), nn.Embedding(V, H).to(dev)
h = torch.zeros(H, device=dev)
out = torch.full((T * U,), -1, dtype=torch.long, device=dev)
n_out = torch.zeros(1, dtype=torch.long, device=dev)
t = torch.zeros(1, dtype=torch.long, device=dev)
sym = torch.zeros(1, dtype=torch.long, device=dev)
oc, ic = torch.ones(1, dtype=torch.bool, device=dev), torch.ones(1, dtype=torch.bool, device=dev)
k = torch.zeros(1, dtype=torch.long, device=dev)
emit = torch.zeros(1, dtype=torch.bool, device=dev)
POOL = [None]

def emit_body():
    if case == "raise_midway" and torch.cuda.is_current_stream_capturing():
        raise ValueError("a body that fails while it is captured")
    out.index_copy_(0, n_out, k)
    n_out.add_(1)
    h.copy_(torch.tanh(pred(emb(k)).squeeze(0) + h))

def skip_body():
    h.mul_(0.5)

def inner_body():
    f = enc.index_select(0, t).squeeze(0)
    k.copy_(joint(f + h).argmax().view(1))
    emit.copy_(k != 0)
    if case in ("while_while_if", "raise_midway"):
        cg.if_node(emit, emit_body, pool=POOL[0])
    elif case == "while_while_ifelse":
        cg.if_node(emit, emit_body, skip_body, pool=POOL[0])
    elif case == "while_while_while":
        c3 = torch.ones(1, dtype=torch.bool, device=dev)
        j = torch.zeros(1, dtype=torch.long, device=dev)
        def third():
            h.add_(0.01)
            j.add_(1)
            c3.copy_(j < 2)
        cg.while_node(c3, third, max_iters=3, pool=POOL[0])
        emit_body()
    else:
        emit_body()
    sym.add_(1)
    ic.copy_(emit & (sym < U))

def outer_body():
    ic.fill_(True)
    sym.zero_()
    if case == "while_if":
        cg.if_node(ic, inner_body, pool=POOL[0])
    else:
        cg.while_node(ic, inner_body, max_iters=U, pool=POOL[0])
    t.add_(1)
    oc.copy_(t < T)

def decode(x):
    h.copy_(x)
    out.fill_(-1)
    n_out.zero_()
    t.zero_()
    oc.fill_(True)
    if case == "if_while":
        cg.if_node(oc, lambda: cg.while_node(oc, outer_body, max_iters=T, pool=POOL[0]), pool=POOL[0])
    else:
        cg.while_node(oc, outer_body, max_iters=T, pool=POOL[0])
    return out.clone(), h.clone()

x = torch.randn(H, device=dev) * 0.1
for via in vias:
    POOL[0] = None  # a plain capture passes its pool; GraphRunner announces its own
    with torch.no_grad():
        ref = decode(x)
        print(case, via, "eager tokens", ref[0].tolist()[:12], flush=True)
        if case == "raise_midway":
            try:
                cg.GraphRunner(decode)(x)
            except Exception as exc:  # the body's error, then a clean capture in the same process
                print("raised", type(exc).__name__, str(exc).splitlines()[0], flush=True)
            case = "while_while_if"
            ref = decode(x)
        if via == "runner":
            r = cg.GraphRunner(decode)
            got = r(x)
        else:
            g, POOL[0] = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                decode(x)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g, pool=POOL[0]):
                st = decode(x)
            g.replay()
            torch.cuda.synchronize()
            got = st
        ok = torch.equal(got[0], ref[0]) and torch.allclose(got[1], ref[1], atol=1e-5)
        print(case, via, "EQUAL" if ok else "DIFFERENT", got[0].tolist()[:12], flush=True)
