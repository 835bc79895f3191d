"""Piecewise runners (breaks="auto") of BERT-base fp16 at three guard positions, built one after another and then
replayed in turns, each compared with its own model run eagerly: run by tests/test_gpu_pieces.py in a process of
its own (an illegal memory access poisons the CUDA context for whatever runs after it). Before the fix, the final
pieces baked in the cuBLAS workspace that a throw-away capture made in its own pool; the next runner's capture
emptied the cache and the first runner's replay wrote into freed memory (H200, torch 2.11, notebook 09).

    python tests/gpu_cases/auto_breaks_workspace.py [--no-fix]   # --no-fix: without the workspace drop
"""
import copy
import faulthandler
import sys

import torch
from torch import nn
from transformers import BertConfig, BertModel

import cgutils as cg
from cgutils.capture import piecewise

faulthandler.enable()
if "--no-fix" in sys.argv:
    piecewise.fresh_cublas_workspaces = lambda: None


class Guard(nn.Module):
    def forward(self, x):
        if not torch.isfinite(x).all():  # a sync: capture cannot hold it
            raise FloatingPointError("non-finite activations")
        return x


class Guarded(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.guard, self.layer = Guard(), layer

    def forward(self, hidden_states, *args, **kwargs):
        return self.layer(self.guard(hidden_states), *args, **kwargs)


torch.manual_seed(0)
plain = BertModel(BertConfig()).cuda().half().eval()
ids = torch.randint(0, plain.config.vocab_size, (1, 128), device="cuda")
mask = torch.ones(1, 128, dtype=torch.int64, device="cuda")
pairs = []
with torch.no_grad():
    for at in (0, 6, 11):
        model = copy.deepcopy(plain)
        model.encoder.layer[at] = Guarded(model.encoder.layer[at])
        runner = cg.GraphRunner(model, breaks="auto")
        runner(input_ids=ids, attention_mask=mask)
        pairs.append((model, runner))
    worst = 0.0
    for _ in range(5):
        for model, runner in pairs:
            got = runner(input_ids=ids, attention_mask=mask).last_hidden_state
            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            worst = max(worst, cg.max_rel_error(got, want))
    torch.cuda.synchronize()
print(f"REPLAYS OK, max relative error {worst:.1e}")
assert worst < 1e-2, worst
