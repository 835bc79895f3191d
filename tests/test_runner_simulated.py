"""GraphRunner's whole call path (and GreedyDecoder's graph mode) on the CPU, with CUDA graphs simulated.

The GPU tests run GraphRunner for real but only on the lent H200. Most of GraphRunner is Python around
three CUDA calls (capture, replay, pool accounting): argument binding, the input check and its fast
path, static-buffer substitution, bucket padding, slicing, eager fallback and validation. Here those
three calls are replaced by a stand-in with a graph's static-buffer semantics, so the Python paths run
end to end in CI:

- "capture" runs the function once on the static input buffers and keeps its output tensors;
- "replay" runs the function again on the same static input buffers and writes the result into
  those same output tensors, in place, as a replayed graph rewrites its static outputs.

What the stand-in cannot show (kernels frozen at capture, streams, memory pools) stays in test_gpu.py.
"""

import dataclasses
import warnings

import pytest
import torch

import cgutils as cg
import cgutils.capture as capture
import cgutils.generation as generation
from cgutils.capture import tree_leaves


class _SimulatedGraph:
    def __init__(self, fn, static_out):
        self.fn, self.static_out = fn, static_out

    def replay(self):
        with torch.no_grad():
            fresh = self.fn()
        for (_, dst), (_, src) in zip(tree_leaves(self.static_out), tree_leaves(fresh), strict=True):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


def _simulated_capture(fn, *, warmup=3, pool=None, on_last_warmup=None, what="function", debug=False):
    with torch.no_grad():
        for _ in range(warmup):
            out = fn()
        if on_last_warmup is not None:
            on_last_warmup(out)
        static_out = fn()
    return _SimulatedGraph(fn, static_out), static_out


@pytest.fixture
def simulated(monkeypatch):
    """CPU tensors pass as CUDA tensors, and capture/replay are simulated (see the module docstring)."""
    real_check = capture.check_inputs

    def as_cuda(specs):
        cuda = torch.device("cuda", 0)
        return None if specs is None else [dataclasses.replace(s, device=cuda) if s.is_tensor else s
                                           for s in specs]

    def check_as_cuda(specs, reference, *, strict=True):
        return real_check(as_cuda(specs), as_cuda(reference), strict=strict)

    captures = []

    def counting_capture(fn, **kw):
        graph, out = _simulated_capture(fn, **kw)
        captures.append(graph)
        return graph, out

    monkeypatch.setattr(capture, "check_inputs", check_as_cuda)
    monkeypatch.setattr(capture, "capture_graph", counting_capture)
    monkeypatch.setattr(generation, "capture_graph", counting_capture)
    monkeypatch.setattr(capture, "pool_reserved_bytes", lambda pool: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    return captures


def masked_mean(x, attention_mask):
    """A toy attention: every position gets the mean of the unmasked positions, plus itself.
    x: (batch, seq, hidden) float32; attention_mask: (batch, seq) float32 of 0/1."""
    w = attention_mask.unsqueeze(-1)
    return x + (x * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)


def unmasked_mean(x):
    """The same without a mask: padded positions leak into every result."""
    return x + x.mean(1, keepdim=True)


def test_replay_reads_each_calls_inputs(simulated):
    runner = cg.GraphRunner(lambda a, b: a * 2 + b)
    for i in range(3):
        a, b = torch.randn(2, 3), torch.randn(2, 3)
        assert torch.equal(runner(a, b), a * 2 + b), f"call {i}"
    assert len(simulated) == 1 and runner.stats.replays == 3


def test_the_same_tensor_twice_then_two_tensors(simulated):
    """runner(x, x) must capture two static buffers, or runner(p, q) computes f(q, q)."""
    runner = cg.GraphRunner(lambda a, b: a - b)
    x = torch.ones(4)
    assert torch.equal(runner(x, x), torch.zeros(4))
    p, q = torch.full((4,), 5.0), torch.full((4,), 2.0)
    assert torch.equal(runner(p, q), torch.full((4,), 3.0))


def test_keyword_arguments_go_to_their_own_buffers(simulated):
    def f(x, attention_mask=None, token_type_ids=None):
        return x * (attention_mask if attention_mask is not None else 1) + (
            token_type_ids if token_type_ids is not None else 0)

    runner = cg.GraphRunner(f)
    x, m = torch.ones(1, 4), torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert torch.equal(runner(x, attention_mask=m), m)
    with pytest.raises(cg.InputError, match="token_type_ids"):
        runner(x, token_type_ids=torch.full((1, 4), 7.0))
    assert torch.equal(runner(x * 3, attention_mask=m), 3 * m)  # the accepted pattern still replays


def test_fast_path_still_catches_a_changed_dtype_and_value(simulated):
    runner = cg.GraphRunner(lambda x, scale: x * scale)
    runner(torch.ones(3), 2.0)
    runner(torch.ones(3), 2.0)
    with pytest.raises(cg.InputError, match="dtype"):
        runner(torch.ones(3, dtype=torch.float64), 2.0)
    with pytest.raises(cg.InputError, match="baked into the graph"):
        runner(torch.ones(3), 3.0)


def test_buckets_pad_slice_and_match_eager(simulated):
    runner = cg.GraphRunner(masked_mean, buckets={1: (8, 16)})
    for seq in (3, 8, 5, 11):
        x, m = torch.randn(1, seq, 4), torch.ones(1, seq)
        out = runner(x, m)
        assert out.shape == (1, seq, 4)
        torch.testing.assert_close(out, masked_mean(x, m))
    stats = runner.stats
    assert stats.captures == 2 and stats.fallbacks == 0
    assert [g.signature.split(" float32")[0] for g in stats.graphs] == ["x:(1, 8, 4)", "x:(1, 16, 4)"]


def test_padding_that_changes_the_result_is_caught(simulated):
    runner = cg.GraphRunner(unmasked_mean, buckets={1: (8,)})
    for attempt in range(2):  # the graph stays captured: a retry must not pass unchecked
        with pytest.raises(cg.CaptureError) as err:
            runner(torch.randn(1, 5, 4))
        assert err.value.cause == "padding", attempt


def test_above_the_largest_bucket_runs_eagerly_with_one_warning(simulated):
    runner = cg.GraphRunner(masked_mean, buckets={1: (8,)})
    with pytest.warns(UserWarning, match="exceed the largest bucket"):
        out = runner(torch.ones(1, 9, 2), torch.ones(1, 9))
    torch.testing.assert_close(out, masked_mean(torch.ones(1, 9, 2), torch.ones(1, 9)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner(torch.ones(1, 10, 2), torch.ones(1, 10))
    assert runner.stats.fallbacks == 2 and runner.stats.captures == 0


def test_capture_buckets_largest_first_then_only_replays(simulated):
    runner = cg.GraphRunner(masked_mean, buckets={1: (4, 8, 16)})
    stats = runner.capture_buckets(torch.randn(1, 6, 2), torch.ones(1, 6))
    assert [g.signature.split(" float32")[0] for g in stats.graphs] == ["x:(1, 16, 2)", "x:(1, 8, 2)", "x:(1, 4, 2)"]
    x, m = torch.randn(1, 7, 2), torch.ones(1, 7)
    torch.testing.assert_close(runner(x, m), masked_mean(x, m))
    assert runner.stats.captures == 3


def test_capture_buckets_checks_the_padding(simulated):
    runner = cg.GraphRunner(unmasked_mean, buckets={1: (4, 8)})
    with pytest.raises(cg.CaptureError) as err:
        runner.capture_buckets(torch.randn(1, 6, 2))
    assert err.value.cause == "padding"


def test_nested_arguments_and_named_pad_values(simulated):
    def f(batch):
        return masked_mean(batch["x"], batch["mask"])

    runner = cg.GraphRunner(f, buckets={1: (8,)}, pad_value={"batch['mask']": 0, "batch['x']": 99})
    x, m = torch.randn(1, 5, 3), torch.ones(1, 5)
    torch.testing.assert_close(runner({"x": x, "mask": m}), masked_mean(x, m))
    static_x = runner._graphs[next(iter(runner._graphs))].static_inputs[0]
    assert torch.all(static_x[:, 5:] == 99)  # the padding really holds the named value


def test_static_outputs_are_rewritten_by_the_next_replay(simulated):
    runner = cg.GraphRunner(lambda x: x + 1, clone_outputs=False)
    first = runner(torch.zeros(2))
    second = runner(torch.full((2,), 10.0))
    assert first is second and torch.equal(first, torch.full((2,), 11.0))
    safe = cg.GraphRunner(lambda x: x + 1)
    a = safe(torch.zeros(2))
    safe(torch.full((2,), 10.0))
    assert torch.equal(a, torch.ones(2))


def test_outputs_with_objects_and_values_pass_validation(simulated):
    class Cache:  # compares by identity, like a transformers cache
        pass

    runner = cg.GraphRunner(lambda x: (x * 2, Cache(), "label"), validate_replays=2)
    with pytest.warns(UserWarning, match="outputs hold Cache, which GraphRunner cannot look inside"):
        runner(torch.full((2,), 1.0))
    for v in (1.0, 2.0, 3.0):
        out = runner(torch.full((2,), v))
        assert torch.equal(out[0], torch.full((2,), 2 * v)) and out[2] == "label"


def test_validate_replays_compare_with_eager(simulated, monkeypatch):
    """A replay that disagrees with eager after capture is a CaptureError naming a baked value. Here a
    corrupted replay stands in for a baked-in value (the simulation recomputes, so it bakes nothing)."""
    runner = cg.GraphRunner(lambda x: x * 2, validate_replays=1)
    runner(torch.ones(2))
    graph = simulated[0]
    real_replay = graph.replay

    def corrupted():
        real_replay()
        graph.static_out.add_(1)

    monkeypatch.setattr(graph, "replay", corrupted)
    with pytest.raises(cg.CaptureError, match="next call captures a new one") as err:
        runner(torch.ones(2))
    assert err.value.cause == "baked_value"
    # The stale graph is dropped (a retry replayed it unchecked and returned [3, 3]): a new capture.
    assert torch.equal(runner(torch.ones(2)), torch.full((2,), 2.0)) and len(simulated) == 2


def _tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100, max_position_embeddings=64)
    return BertModel(config).eval()


def test_bert_with_attention_mask_through_buckets(simulated):
    """The notebook 03 recipe on a small random BERT: padded with a 0 mask, the real positions and the
    pooled [CLS] output equal eager at the caller's length; without a mask, padding is caught."""
    bert = _tiny_bert()
    runner = cg.GraphRunner(bert, buckets={1: (16, 32)})
    runner.capture_buckets(torch.randint(0, 100, (1, 20)), attention_mask=torch.ones(1, 20, dtype=torch.long))
    for seq in (5, 16, 23):
        ids, mask = torch.randint(0, 100, (1, seq)), torch.ones(1, seq, dtype=torch.long)
        out = runner(ids, attention_mask=mask)
        with torch.no_grad():
            ref = bert(ids, attention_mask=mask)
        assert out.last_hidden_state.shape == (1, seq, 32)
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=1e-4, atol=1e-5)
    assert runner.stats.captures == 2

    unmasked = cg.GraphRunner(bert, buckets={1: (16,)})
    with pytest.raises(cg.CaptureError) as err:
        unmasked(torch.randint(0, 100, (1, 9)))
    assert err.value.cause == "padding"


def test_an_output_as_wide_as_the_bucket_is_not_cut(simulated):
    """Outputs were cut wherever a size equalled the bucket: a (1, 8) pooled output under an 8 bucket
    came back as (1, 5). Also without validation, the cut dims come from one eager call."""
    def f(x):  # x: (1, seq, 8) -> per-position output and a pooled (1, 8) output
        return x * 2, x.amax(1)

    for validate in (True, False):
        runner = cg.GraphRunner(f, buckets={1: (8,)}, validate=validate)
        x = torch.rand(1, 5, 8)
        per_position, pooled = runner(x)
        assert per_position.shape == (1, 5, 8) and pooled.shape == (1, 8)
        torch.testing.assert_close(pooled, x.amax(1))


def test_two_bucketed_dims_are_learned_as_each_is_padded(simulated):
    runner = cg.GraphRunner(lambda x: x * 2, buckets={0: (4,), 1: (8,)})
    for shape in [(4, 5), (3, 8), (2, 3)]:
        x = torch.rand(shape)
        torch.testing.assert_close(runner(x), x * 2)
    assert runner.stats.captures == 1


@pytest.mark.parametrize("steps_per_graph", [1, 4])
def test_graph_mode_decoding_gives_the_eager_tokens(simulated, steps_per_graph):
    """GreedyDecoder's graph slots (a one-step graph and a block of steps, warm-up from a dummy prompt,
    remainder steps) with simulated replays: the tokens of the eager decoder, for two prompts in turn."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4)).eval()
    eager = generation.GreedyDecoder(model, mode="eager")
    graphed = generation.GreedyDecoder(model, mode="eager", steps_per_graph=steps_per_graph)
    graphed.mode = "graph"  # the CUDA check in __init__ is the only thing skipped
    for prompt in (torch.randint(0, 1000, (1, 5)), torch.randint(0, 1000, (1, 9))):
        assert torch.equal(graphed.generate(prompt, max_new_tokens=23), eager.generate(prompt, max_new_tokens=23))
    assert len(simulated) == 2  # one slot: its one-step graph and its block graph


def test_each_autocast_state_gets_its_own_graph(simulated):
    """One graph served calls with and without torch.autocast: kernels captured in fp32 replayed for an
    fp16 autocast call (and the other way round), silently in the wrong precision."""
    runner = cg.GraphRunner(lambda x: x @ x)
    x = torch.rand(4, 4)
    runner(x)
    with torch.autocast("cuda", dtype=torch.float16):
        runner(x)
        runner(x)
        with torch.autocast("cuda", enabled=False):
            runner(x)
    assert [g.signature for g in runner.stats.graphs] == [
        "x:(4, 4) float32", "x:(4, 4) float32 (autocast float16)"]
    assert [g.replays for g in runner.stats.graphs] == [2, 2]


# --- review of the learned cuts (helper), each failed before its fix -------------------------------------

def test_two_padded_dims_with_the_same_length_are_not_confused(simulated):
    """With buckets on dims 0 and 1 and a first call of (5, 5), an output dim was credited to the wrong
    input dim, and a later (3, 5) call cut the wrong axis."""
    for fn in (lambda x: x.sum(0), lambda x: x.transpose(0, 1) * 2):
        runner = cg.GraphRunner(fn, buckets={0: (8,), 1: (8,)})
        for shape in [(5, 5, 2), (3, 5, 2), (5, 3, 2), (2, 7, 2)]:
            x = torch.rand(shape)
            torch.testing.assert_close(runner(x), fn(x))


def test_dataclass_outputs_that_read_their_fields(simulated):
    @dataclasses.dataclass
    class Out:
        h: torch.Tensor
        n: int = 0

        def __post_init__(self):
            self.n = self.h.shape[-1]

    runner = cg.GraphRunner(lambda x: Out(x * 2), buckets={1: (8,)})
    assert runner(torch.rand(1, 5, 3)).h.shape == (1, 5, 3)


def test_output_structure_changed_by_padding_is_a_padding_error(simulated):
    runner = cg.GraphRunner(lambda x: (x * 2, "a" if x.shape[1] == 8 else ("a", "b")), buckets={1: (8,)})
    with pytest.raises(cg.CaptureError) as err:
        runner(torch.rand(1, 5, 3))
    assert err.value.cause == "padding"


def test_a_length_returned_as_a_number_is_a_padding_error_without_validation(simulated):
    """With validate=False the bucket size came back where the caller's length was returned."""
    runner = cg.GraphRunner(lambda x: (x * 2, x.shape[1]), buckets={1: (8,)}, validate=False)
    with pytest.raises(cg.CaptureError, match=r"output\[1\] is 8 padded vs 5") as err:
        runner(torch.rand(1, 5, 3))
    assert err.value.cause == "padding"



# --- second review (helper), each failed before its fix ---------------------------------------------------

def test_a_learned_dim_and_a_new_dim_with_the_same_length(simulated):
    """Dim 0 learned at (5, 8); then (3, 3) pads both dims to 8 with the same length: the stored dim-0
    cuts replaced this call's learned ones and the output came back (3, 8)."""
    for validate in (False, True):
        runner = cg.GraphRunner(lambda x: x * 2, buckets={0: (8,), 1: (8,)}, validate=validate)
        runner(torch.rand(5, 8))
        x = torch.rand(3, 3)
        torch.testing.assert_close(runner(x), x * 2)


def test_a_failed_first_call_does_not_fix_the_argument_structure(simulated):
    emb = torch.nn.Embedding(10, 4)
    runner = cg.GraphRunner(emb)
    with pytest.raises(RuntimeError):
        runner(torch.rand(2, 3))  # float indices: fails inside the module
    ids = torch.randint(0, 10, (2, 3))
    torch.testing.assert_close(runner(ids), emb(ids))

    def f(x, mask):
        return x * mask

    runner = cg.GraphRunner(f)
    with pytest.raises(TypeError):
        runner(torch.ones(2))  # mask missing
    assert torch.equal(runner(torch.ones(2), torch.zeros(2)), torch.zeros(2))


def test_a_replay_check_that_meets_other_shapes_is_a_capture_error(simulated):
    """A baked value that changes the output's shape came out of validate_replays as a bare InputError."""
    class M(torch.nn.Module):
        n = 2

        def forward(self, x):
            return x[: self.n] * 2

    model = M()
    runner = cg.GraphRunner(model, validate_replays=2)
    runner(torch.ones(4))
    simulated[0].replay = lambda: None  # as a real graph would: the slice length stays baked in
    model.n = 3
    with pytest.raises(cg.CaptureError, match="eager now gives other outputs") as err:
        runner(torch.ones(4))
    assert err.value.cause == "baked_value"


@pytest.mark.parametrize("clone", [True, False])
def test_padded_outputs_are_cloned_or_views_of_the_static_output(simulated, clone):
    runner = cg.GraphRunner(lambda x: x + 1, buckets={1: (8,)}, clone_outputs=clone)
    first = runner(torch.zeros(1, 5))
    runner(torch.full((1, 5), 10.0))
    assert torch.equal(first, torch.full((1, 5), 11.0 if not clone else 1.0))



# --- new-user walkthrough (helper), each failed before its fix ---------------------------------------------

def test_a_transformers_cache_in_the_outputs_is_warned_about(simulated):
    """GPT-2 returns a cache object by default; its tensors are static buffers that were neither cloned nor
    cut back, silently: every call got the same cache object, at the padded length."""
    from transformers import GPT2Config, GPT2Model

    model = GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).eval()
    runner = cg.GraphRunner(model, buckets={1: (8,)})
    ids = torch.randint(0, 100, (1, 5))
    with pytest.warns(UserWarning, match="use_cache=False"):
        runner(ids, attention_mask=torch.ones_like(ids))
    quiet = cg.GraphRunner(model, buckets={1: (8,)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet(ids, attention_mask=torch.ones_like(ids), use_cache=False)


def test_a_left_out_argument_is_named(simulated):
    def forward(input_ids, attention_mask=None):
        return input_ids * (1 if attention_mask is None else attention_mask)

    runner = cg.GraphRunner(forward)
    ids = torch.ones(1, 4)
    runner(ids, ids)
    with pytest.raises(cg.InputError, match=r"missing: \['attention_mask'\], new: none"):
        runner(ids)
    with pytest.raises(cg.InputError, match=r"missing: none, new: \['bogus'\]"):
        runner(ids, ids, bogus=1)


def test_capture_buckets_without_an_example_is_an_input_error(simulated):
    with pytest.raises(cg.InputError, match="needs an example call"):
        cg.GraphRunner(lambda x: x, buckets={1: (8,)}).capture_buckets()


def test_capture_graph_refuses_no_warmup():
    with pytest.raises(cg.InputError, match="warmup must be an int >= 1"):
        capture.capture_graph(lambda: None, warmup=0)
