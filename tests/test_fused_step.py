"""FusedKVState (cgutils.generation.fused_step): the fused Triton decode step against StaticKVState's, on the CPU.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels with numpy, but only for kernels defined while
the variable is set, and pytest runs every test file in one process, where another file may have imported
triton or this module already. So the comparisons run in a child process: this file run as a script, one
JSON line per check; the tests below read them. A tiny random GPT-2 in fp32 keeps the interpreter fast.
"""

import importlib.util
import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

from cgutils.errors import InputError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.fixture(scope="module")
def child():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CHECK "):
            check = json.loads(line[len("CHECK "):])
            found[check["name"]] = check
    if not found:
        pytest.fail(f"the interpreter child produced no checks (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return found


def _passed(child, name):
    assert name in child, f"check {name} did not run"
    assert child[name]["ok"], child[name]["detail"]


def test_decode_step_matches_the_plain_step_batch_1(child):
    """Five steps from the same prefill: logits, token, cache, generated and pos as StaticKVState's; the keys
    span two attention splits of two blocks each (the last split's merge runs once pos reaches 16)."""
    _passed(child, "decode_batch1")


def test_decode_step_matches_the_plain_step_batch_3_split_k(child):
    """Batch 3 with every matrix-vector split over K (the last arrival sums the partials) and four
    one-block attention splits."""
    _passed(child, "decode_batch3")


def test_fused_greedy_loop_equals_the_eager_decoder(child):
    _passed(child, "greedy_loop")


def test_the_module_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "import cgutils, cgutils.generation.fused_step as f; assert f.triton is None; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_bad_requests_raise_input_error(monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    import cgutils.generation.fused_step as fs

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=2, n_layer=1, n_positions=16, vocab_size=50)).eval()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InputError, match="CUDA device.*TRITON_INTERPRET"):
        fs.FusedKVState(model, 1, 8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(InputError, match="batch 1..14"):
        fs.FusedKVState(model, 15, 8)
    with pytest.raises(InputError, match="power of two"):
        fs.FusedKVState(model, 1, 8, attn_block=12)
    with pytest.raises(InputError, match="exceeds"):
        fs.FusedKVState(model, 1, 32)
    with pytest.raises(InputError, match="GPT2LMHeadModel"):
        fs.FusedKVState(torch.nn.Linear(2, 2), 1, 8)
    state = fs.FusedKVState(model, 2, 8)
    assert state.kernels_per_step == 5 * 1 + 2
    with pytest.raises(InputError, match="does not fit"):
        fs.greedy_tokens(state, torch.zeros(2, 6, dtype=torch.int64), 4)
    monkeypatch.setattr(fs, "triton", None)
    with pytest.raises(InputError, match="needs Triton"):
        fs.FusedKVState(model, 1, 8)


# ---- the child: run with TRITON_INTERPRET=1 set before triton is imported ----

def _tiny():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=2, n_positions=64, vocab_size=101)).eval()


def _compare_steps(batch: int, steps: int, **kw) -> None:
    from cgutils.generation import StaticKVState
    from cgutils.generation.fused_step import FusedKVState

    model = _tiny()
    plain, fused = StaticKVState(model, batch, 32), FusedKVState(model, batch, 32, **kw)
    prompt = torch.randint(0, 101, (batch, 14), generator=torch.Generator().manual_seed(batch))
    plain.prefill(prompt)
    fused.prefill(prompt)
    for step in range(steps):
        want_logits = plain.logits(plain.token, plain.pos)[:, -1]  # rewrites the same cache entries
        want = plain.decode_step()
        got = fused.decode_step()
        torch.testing.assert_close(fused.last_logits, want_logits, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, step=step: f"step {step}: {m}")
        assert torch.equal(got, want), f"step {step}: tokens {got.flatten().tolist()} != {want.flatten().tolist()}"
        torch.testing.assert_close(fused.kv_cache, plain.kv_cache, rtol=1e-4, atol=1e-5)
        assert torch.equal(fused.pos, plain.pos) and torch.equal(fused.generated, plain.generated), f"step {step}"


def _batch3_split_k() -> None:
    import cgutils.generation.fused_step as fs

    fs.TUNING.update(qkv=(16, 32, 2, 2, 4), fc=(16, 16, 4, 1, 4), proj=(16, 16, 4, 1, 4), proj2=(32, 64, 4, 2, 4))
    _compare_steps(3, 4, attn_block=8, max_splits=4)


def _greedy_loop() -> None:
    from cgutils.generation import GreedyDecoder
    from cgutils.generation.fused_step import FusedKVState, greedy_tokens

    model = _tiny()
    prompt = torch.randint(0, 101, (2, 5), generator=torch.Generator().manual_seed(7))
    want = GreedyDecoder(model, "eager").generate(prompt, max_new_tokens=6)
    got = greedy_tokens(FusedKVState(model, 2, 16), prompt, 6)
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    checks = {"decode_batch1": lambda: _compare_steps(1, 5, attn_block=8, max_splits=2),
              "greedy_loop": _greedy_loop, "decode_batch3": _batch3_split_k}  # the last changes TUNING
    with torch.no_grad():
        for name, fn in checks.items():
            try:
                fn()
                result = {"name": name, "ok": True, "detail": ""}
            except Exception:
                result = {"name": name, "ok": False, "detail": traceback.format_exc()[-3000:]}
            print("CHECK " + json.dumps(result), flush=True)
