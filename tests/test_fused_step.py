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
from pathlib import Path

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


def test_pdl_step_matches_the_plain_step_batch_1(child):
    """pdl=True (its whole-block, row-by-row arithmetic; the interpreter compiles the waits out): tokens, logits,
    cache, generated and pos as StaticKVState's, with PDL_TUNING (the projection and down-projection split)."""
    _passed(child, "pdl_batch1")


def test_pdl_step_matches_the_plain_step_batch_3(child):
    """Batch 3, pdl=True: two heads per projection program, a K block not a power of two (the down-projection,
    96 rows in a 128-row block, the last split 64 rows), LayerNorm across K splits."""
    _passed(child, "pdl_batch3")


def test_pdl_greedy_loop_equals_the_eager_decoder(child):
    _passed(child, "pdl_greedy_loop")


def test_pdl_arguments_are_checked(monkeypatch):
    import cgutils.generation.fused_step as fs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for bad in ("yes", 1, None):
        with pytest.raises(InputError, match=r"pdl must be a bool .*Programmatic Dependent Launch"):
            fs.FusedKVState(_small_gpt2(), 1, 8, pdl=bad)
    state = fs.FusedKVState(_small_gpt2(), 1, 8, pdl=True)  # the interpreter: allowed, PDL_TUNING's shapes
    assert state.pdl and state.tuning == fs.check_tuning(base=fs.PDL_TUNING)
    assert state.launch_shapes["qkv"]["KSTEP"] == state.launch_shapes["qkv"]["KPER"] == 32
    assert all(meta["PDL"] and not meta["GDC"] for _, _, _, meta in state._plan if "PDL" in meta)
    assert not fs.FusedKVState(_small_gpt2(), 1, 8).pdl
    monkeypatch.delenv("TRITON_INTERPRET")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(InputError, match=r"pdl=True: Programmatic Dependent Launch needs compute capability 9\.0.*8\.6"):
        fs.check_pdl(True, cuda)
    assert fs.check_pdl(False, cuda) is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fs.check_pdl(True, cuda) is True


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
    # wrong types and zero sizes: raw TypeError / ZeroDivisionError before
    for kwargs, name in ((dict(batch="1"), "batch"), (dict(batch=1.0), "batch"), (dict(max_len=0), "max_len"),
                         (dict(max_len="16"), "max_len"), (dict(attn_block=32.0), "attn_block"),
                         (dict(max_splits="8"), "max_splits")):
        with pytest.raises(InputError, match=f"{name} must be an int"):
            fs.FusedKVState(model, **{"batch": 1, "max_len": 8, **kwargs})
    state = fs.FusedKVState(model, 2, 8)
    assert state.kernels_per_step == 5 * 1 + 2
    with pytest.raises(InputError, match="does not fit"):
        fs.greedy_tokens(state, torch.zeros(2, 6, dtype=torch.int64), 4)
    monkeypatch.setattr(fs, "triton", None)
    with pytest.raises(InputError, match="needs Triton"):
        fs.FusedKVState(model, 1, 8)


def _small_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=2, n_layer=1, n_positions=16, vocab_size=50)).eval()


@pytest.mark.parametrize("tuning, message", [
    ({"qkvv": (32, 256, 1, 3, 4)}, r"unknown role 'qkvv'; the roles are qkv, proj, fc, proj2, lm_head"),
    ({"qkv": (48, 256, 1, 3, 4)}, r"tuning\['qkv'\] field BN must be a power of two >= 16"),
    ({"fc": (32, 8, 1, 3, 4)}, r"tuning\['fc'\] field BK must be a power of two >= 16"),
    ({"proj2": (32, 256, 0, 3, 4)}, r"tuning\['proj2'\] field split must be an int >= 1"),
    ({"lm_head": (128, 64, 2, 3, 4)}, r"tuning\['lm_head'\] field split .*1 for lm_head, got 2"),
    ({"proj": (32, 64, 12, 0, 4)}, r"tuning\['proj'\] field stages must be an int >= 1"),
    ({"qkv": (32, 256, 1, 3, 3)}, r"tuning\['qkv'\] field warps must be a power of two 1..32"),
    ({"qkv": (32, 256, 1, 3, 64)}, r"tuning\['qkv'\] field warps"),
    ({"qkv": (32, 256, 1, 3)}, r"tuning\['qkv'\] must be five ints"),
    ({"fc": (32, 256, 1.0, 3, 4)}, r"tuning\['fc'\] must be five ints"),
    ({"fc": (32, 256, True, 3, 4)}, r"tuning\['fc'\] must be five ints"),
    ({"proj": "32,64,12,2,4"}, r"tuning\['proj'\] must be five ints"),
    ([("qkv", (32, 256, 1, 3, 4))], r"tuning must be a mapping"),
])
def test_a_bad_tuning_raises_input_error_naming_role_and_field(monkeypatch, tuning, message):
    import cgutils.generation.fused_step as fs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    before = dict(fs.TUNING)
    with pytest.raises(InputError, match=message):
        fs.FusedKVState(_small_gpt2(), 1, 8, tuning=tuning)
    assert fs.TUNING == before


def test_a_tuning_keyword_applies_to_that_state_only(monkeypatch):
    """The search runs candidates in one process: a table passed to one state, the module's TUNING untouched;
    roles left out take TUNING's; launch_shapes shows the clamped launch (n_embd 32: BK 32, one split)."""
    import cgutils.generation.fused_step as fs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, before = _small_gpt2(), dict(fs.TUNING)
    state = fs.FusedKVState(model, 2, 8, tuning={"qkv": [16, 64, 2, 2, 4], "lm_head": (64, 32, 1, 2, 8)})
    assert fs.TUNING == before
    assert state.tuning == {**before, "qkv": (16, 64, 2, 2, 4), "lm_head": (64, 32, 1, 2, 8)}
    assert state.launch_shapes["qkv"] == dict(BN=16, BK=32, KSTEP=32, KPER=32, SPLIT=1, num_stages=2, num_warps=4,
                                              grid=(6, 1))
    assert state.launch_shapes["lm_head"]["grid"] == (1, 1) and state.launch_shapes["lm_head"]["num_warps"] == 8
    default = fs.FusedKVState(model, 2, 8)
    assert default.tuning == fs.check_tuning() == before and default.kernels_per_step == state.kernels_per_step


def _tune_script():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "tune_fused_gemv.py"
    spec = importlib.util.spec_from_file_location("tune_fused_gemv", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_search_never_chooses_changed_tokens_and_needs_a_real_gain():
    tune = _tune_script()
    ms = lambda v: {"median": v}  # noqa: E731
    recs = [{"status": "ok", "current": True, "ms_per_step": ms(0.370)},
            {"status": "tokens differ", "ms_per_step": ms(0.300)}, {"status": "error"}, {"status": "invalid"},
            {"status": "ok", "ms_per_step": ms(0.3695)}]  # 0.5 us faster: noise
    assert tune.choose(recs, min_gain_us=1.0) == 0
    recs.append({"status": "ok", "ms_per_step": ms(0.360)})
    assert tune.choose(recs, min_gain_us=1.0) == 5
    a, b, cur = tune.DEFAULT["fc"], (16, 256, 1, 3, 4), (32, 128, 2, 3, 4)

    def batch(da, db, dc_status):
        rows = [{"tuning": list(a), "status": "ok", "delta_us_per_step": 0.0},
                {"tuning": list(b), "status": "ok", "delta_us_per_step": da},
                {"tuning": list(cur), "status": dc_status, "delta_us_per_step": db - 1.0}]
        return {"roles": {"fc": {"candidates": rows}}}

    merged, table = tune.merge([batch(-3.0, -2.0, "ok"), batch(+2.0, -2.0, "tokens differ")], 1.0)
    assert merged["fc"] == a  # b: 1 us gained in all, not over 1 us a batch; cur (6 us) changed tokens once
    assert [r["tuning"] for r in table["fc"]] == [list(b), list(a)]
    merged, _ = tune.merge([batch(-5.0, 0, "ok"), batch(-1.0, 0, "ok")], 1.0)
    assert merged["fc"] == b and merged["qkv"] == tune.DEFAULT["qkv"]


def test_tune_fused_gemv_smoke_runs_end_to_end(tmp_path):
    """--smoke: CPU, the interpreter, a tiny GPT-2, two candidates per role (here one role, for time) plus a
    split-K one and a bad one from --candidates, which is recorded as invalid and not chosen."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "tune_fused_gemv.py"), "--smoke", "--out",
                           str(tmp_path), "--batches", "1", "2", "--roles", "qkv",
                           "--candidates", "qkv=48,256,1,3,4", "qkv=16,32,2,2,4"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TUNING = {" in proc.stdout
    res = json.loads((tmp_path / "tune_fused_gemv.json").read_text())
    assert res["smoke"] and res["provenance"]["torch"] and "git_commit" in res["provenance"]
    current = tuple(res["default_tuning"]["qkv"])  # the module's TUNING when the sweep ran
    for b in ("1", "2"):
        roles = res["search"][b]["roles"]
        assert list(roles) == ["qkv"]
        qkv = {tuple(c["tuning"]): c for c in roles["qkv"]["candidates"]}
        assert len(qkv) == 4 and qkv[current].get("current")
        bad = qkv[(48, 256, 1, 3, 4)]
        assert bad["status"] == "invalid" and "field BN" in bad["error"] and not bad.get("chosen")
        split = qkv[(16, 32, 2, 2, 4)]
        assert split["status"] == "ok" and split["launch"]["SPLIT"] == 2 and split["tokens"]["window"]["equal"]
        for role in roles.values():
            assert sum(bool(c.get("chosen")) for c in role["candidates"]) == 1
            assert all("ms_per_step" in c for c in role["candidates"] if c["status"] == "ok")
        assert set(res["best_tuning"][b]) == {"qkv", "proj", "fc", "proj2", "lm_head"}
        assert res["final"][b]["configs"][0]["names"][0] == "default"
    assert set(res["merged_tuning"]) == {"qkv", "proj", "fc", "proj2", "lm_head"}


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
    tuning = dict(qkv=(16, 32, 2, 2, 4), fc=(16, 16, 4, 1, 4), proj=(16, 16, 4, 1, 4), proj2=(32, 64, 4, 2, 4))
    _compare_steps(3, 4, attn_block=8, max_splits=4, tuning=tuning)


def _pdl_batch3() -> None:
    tuning = dict(qkv=(16, 32, 2, 1, 4), proj=(16, 16, 2, 1, 4), fc=(32, 16, 3, 1, 4), proj2=(16, 16, 3, 1, 4))
    _compare_steps(3, 4, attn_block=8, max_splits=4, tuning=tuning, pdl=True)


def _greedy_loop(**kw) -> None:
    from cgutils.generation import GreedyDecoder
    from cgutils.generation.fused_step import FusedKVState, greedy_tokens

    model = _tiny()
    prompt = torch.randint(0, 101, (2, 5), generator=torch.Generator().manual_seed(7))
    want = GreedyDecoder(model, "eager").generate(prompt, max_new_tokens=6)
    got = greedy_tokens(FusedKVState(model, 2, 16, **kw), prompt, 6)
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    checks = {"decode_batch1": lambda: _compare_steps(1, 5, attn_block=8, max_splits=2),
              "greedy_loop": _greedy_loop, "decode_batch3": _batch3_split_k,
              "pdl_batch1": lambda: _compare_steps(1, 5, attn_block=8, max_splits=2, pdl=True),
              "pdl_batch3": _pdl_batch3, "pdl_greedy_loop": lambda: _greedy_loop(pdl=True)}
    with torch.no_grad():
        for name, fn in checks.items():
            try:
                fn()
                result = {"name": name, "ok": True, "detail": ""}
            except Exception:
                result = {"name": name, "ok": False, "detail": traceback.format_exc()[-3000:]}
            print("CHECK " + json.dumps(result), flush=True)
