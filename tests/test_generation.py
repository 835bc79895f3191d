"""Static-KV-cache greedy decoding: correctness against transformers on the CPU, errors, and GPU tests."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import cgutils as cg
from cgutils.generation import GreedyDecoder, StaticKVState, hf_generate


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4)).eval()


def test_eager_tokens_equal_transformers_greedy(tiny):
    prompt = torch.randint(0, tiny.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(3))
    ours = GreedyDecoder(tiny, mode="eager").generate(prompt, max_new_tokens=30)
    assert ours.shape == (3, 39)
    assert torch.equal(ours, hf_generate(tiny, prompt, 30))


def test_batch_bucket_padding_is_sliced_off(tiny):
    dec = GreedyDecoder(tiny, mode="eager")
    prompt = torch.randint(0, tiny.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(4))
    out = dec.generate(prompt, 10)
    assert out.shape == (3, 15) and dec.slots == [(4, 128)]
    assert torch.equal(out[1:2], dec.generate(prompt[1:2], 10))  # a row's answer does not depend on padding


def test_static_cache_shapes_do_not_change(tiny):
    state = StaticKVState(tiny, batch=1, max_len=16)
    ptr, shape = state.kv_cache.data_ptr(), state.kv_cache.shape
    with torch.no_grad():
        state.prefill(torch.zeros(1, 4, dtype=torch.int64))
        for _ in range(3):
            state.decode_step()
    assert int(state.pos) == 7 and state.kv_cache.data_ptr() == ptr and state.kv_cache.shape == shape


def test_errors_are_clear(tiny):
    with pytest.raises(cg.InputError, match="mode must be one of"):
        GreedyDecoder(tiny, mode="fast")
    with pytest.raises(cg.InputError, match="needs the model on a CUDA device"):
        GreedyDecoder(tiny, mode="graph")
    dec = GreedyDecoder(tiny, mode="eager")
    with pytest.raises(cg.InputError, match="int64"):
        dec.generate(torch.zeros(1, 4), 5)
    with pytest.raises(cg.InputError, match=r"\(batch, length\)"):
        dec.generate(torch.zeros(4, dtype=torch.int64), 5)
    with pytest.raises(cg.InputError, match="batch size 9 is larger than the largest bucket 8; pass a larger batch_buckets"):
        dec.generate(torch.zeros(9, 4, dtype=torch.int64), 5)
    with pytest.raises(cg.InputError, match="prompt \\+ new tokens 1030 .*at most 1024 positions"):
        dec.generate(torch.zeros(1, 30, dtype=torch.int64), 1000)
    with pytest.raises(cg.InputError, match="steps_per_graph must be an int >= 1"):
        GreedyDecoder(tiny, mode="eager", steps_per_graph=0)
    with pytest.raises(cg.InputError, match="max_new_tokens must be an int >= 1"):
        dec.generate(torch.zeros(1, 4, dtype=torch.int64), 0)
    with pytest.raises(cg.InputError, match="max_new_tokens must be an int >= 1, got 2.5"):
        dec.generate(torch.zeros(1, 4, dtype=torch.int64), 2.5)
    with pytest.raises(cg.InputError, match="at least one row and one token"):
        dec.generate(torch.zeros(0, 4, dtype=torch.int64), 5)
    with pytest.raises(cg.InputError, match=r"token ids must lie in \[0, 50257\)"):
        dec.generate(torch.full((1, 4), 50257), 5)
    with pytest.raises(cg.InputError, match="step_times uses CUDA events"):
        dec.generate(torch.zeros(1, 4, dtype=torch.int64), 5, step_times=[])
    with pytest.raises(cg.InputError, match="batch_buckets must be a non-empty sequence"):
        GreedyDecoder(tiny, mode="eager", batch_buckets=())
    with pytest.raises(cg.InputError, match="needs a transformers GPT2LMHeadModel"):
        GreedyDecoder(torch.nn.Linear(2, 2), mode="eager")


def test_length_buckets_are_capped_at_the_position_table():
    torch.manual_seed(0)
    short = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=100)).eval()
    dec = GreedyDecoder(short, mode="eager")
    assert dec.length_buckets == (100,)
    assert dec.generate(torch.zeros(1, 5, dtype=torch.int64), 15).shape == (1, 20)  # failed before: bucket 128 > 100


# --- GPU (the lent H200) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_fp32():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config()).cuda().eval()


def _prompt(seed, length=32, batch=1):
    return torch.randint(0, 50257, (batch, length), generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.gpu
def test_graph_tokens_equal_transformers_fp32(gpt2_fp32):
    prompt = _prompt(1)
    assert torch.equal(GreedyDecoder(gpt2_fp32, "graph").generate(prompt, 100), hf_generate(gpt2_fp32, prompt, 100))


@pytest.mark.gpu
def test_new_prompt_after_capture_gives_its_own_continuation(gpt2_fp32):
    dec = GreedyDecoder(gpt2_fp32, "graph")
    a, b = _prompt(1), _prompt(2)
    dec.generate(a, 50)
    assert torch.equal(dec.generate(b, 50), hf_generate(gpt2_fp32, b, 50))
    assert dec.slots == [(1, 128)]  # one graph served both prompts


@pytest.mark.gpu
def test_fp16_logits_within_tolerance():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda().half().eval()
    prompt = _prompt(3)
    state = StaticKVState(model, batch=1, max_len=128)
    with torch.no_grad():
        ours = state.logits(prompt, state.key_pos[:32]).float()
        theirs = model(prompt).logits.float()
    assert cg.max_rel_error(ours, theirs) <= 1e-2  # fp16: half-precision rounding of two attention paths


@pytest.mark.gpu
def test_no_memory_growth_over_1000_tokens(gpt2_fp32):
    dec = GreedyDecoder(gpt2_fp32, "graph")
    prompt = _prompt(4, length=16)
    dec.generate(prompt, 1000)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = dec.generate(prompt, 1000)
    del out
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before


@pytest.mark.gpu
def test_multi_step_graph_equals_one_step_graphs(gpt2_fp32):
    prompt = _prompt(5, batch=3)
    many = GreedyDecoder(gpt2_fp32, "graph", steps_per_graph=16).generate(prompt, 40)
    one = GreedyDecoder(gpt2_fp32, "graph", steps_per_graph=1).generate(prompt, 40)
    eager = GreedyDecoder(gpt2_fp32, "eager").generate(prompt, 40)
    assert torch.equal(many, one) and torch.equal(many, eager)


@pytest.mark.parametrize("steps_per_graph", [1, 4])
def test_graph_mode_decoding_gives_the_eager_tokens(simulated, steps_per_graph):
    """GreedyDecoder's graph slots (a one-step graph and a block of steps, warm-up from a dummy prompt,
    remainder steps) with simulated replays (tests/simulation.py): the tokens of the eager decoder, for
    two prompts in turn."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4)).eval()
    eager = GreedyDecoder(model, mode="eager")
    graphed = GreedyDecoder(model, mode="graph", steps_per_graph=steps_per_graph, backend=simulated)
    for prompt in (torch.randint(0, 1000, (1, 5)), torch.randint(0, 1000, (1, 9))):
        assert torch.equal(graphed.generate(prompt, max_new_tokens=23), eager.generate(prompt, max_new_tokens=23))
    # one slot: its one-step graph and its block graph; a block of one step is the one-step graph itself
    # (captured twice before, the second never replayed)
    assert len(simulated.graphs) == (1 if steps_per_graph == 1 else 2)


def test_bucket_sizes_must_be_positive_ints():
    """generation's own bucket check accepted True as a size (a bool is an int in Python); it now shares
    the check of GraphRunner's buckets."""
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)).eval()
    with pytest.raises(cg.InputError, match="batch_buckets must be a non-empty sequence of positive ints"):
        GreedyDecoder(model, mode="eager", batch_buckets=(True, 2))


@pytest.mark.parametrize("batch, max_len, message", [(1, 0, "max_len"), (0, 16, "batch"), (1, 2.5, "max_len")])
def test_static_cache_rejects_sizes_it_cannot_hold(tiny, batch, max_len, message):
    """StaticKVState(max_len=0) was accepted and made an empty cache that failed at the first prefill."""
    from cgutils.errors import InputError

    with pytest.raises(InputError, match=message):
        StaticKVState(tiny, batch=batch, max_len=max_len)
