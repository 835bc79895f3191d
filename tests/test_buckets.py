"""Buckets: the bucket policy, padding, the learned output cuts, capture_buckets and eager fallback
(CPU; replays simulated by tests/simulation.py)."""

import warnings

import pytest
import torch

import cgutils as cg
from cgutils.capture.buckets import Buckets, apply_cuts, copy_padded, learn_cuts


@pytest.mark.parametrize("buckets, msg", [([128], "dict"), ({1: []}, "non-empty"), ({-1: [4]}, "dims"),
                                          ({1: [0]}, "positive"), ({1: "ab"}, "positive")])
def test_bad_buckets_are_rejected(buckets, msg):
    with pytest.raises(cg.InputError, match=msg):
        cg.GraphRunner(lambda x: x, buckets=buckets)


def test_bucket_shapes_and_padding_helpers():
    assert cg.GraphRunner(lambda x, m: x, buckets={1: (64, 32, 128)}).buckets == {1: (32, 64, 128)}
    policy = Buckets({1: (64, 32, 128)})
    assert policy.target_shape(torch.zeros(2, 40)) == (2, 64)
    assert policy.target_shape(torch.zeros(2, 129)) is None  # above the largest bucket: eager fallback
    assert policy.target_shape(torch.zeros(5)) == (5,)  # too few dims: not bucketed
    buf = torch.empty(2, 4)
    copy_padded(buf, torch.ones(2, 3), pad=-1.0)
    assert buf.tolist() == [[1, 1, 1, -1], [1, 1, 1, -1]]


def test_output_cuts_are_learned_from_eager_shapes():
    """A pooled output of hidden size 64 under a 64 bucket was cut to the caller's length, since the
    cut test was "size equals the bucket"; the dims to cut are now learned from an eager call."""
    padded = {1: (64, 40)}
    replayed = {"h": torch.zeros(2, 64, 8), "pooled": torch.zeros(2, 64), "attn": torch.zeros(2, 4, 64, 64)}
    eager = {"h": torch.zeros(2, 40, 8), "pooled": torch.zeros(2, 64), "attn": torch.zeros(2, 4, 40, 40)}
    cuts, ambiguous = learn_cuts(replayed, eager, padded)
    assert ambiguous == set()
    out = apply_cuts(replayed, cuts, padded)
    assert {k: tuple(v.shape) for k, v in out.items()} == {"h": (2, 40, 8), "pooled": (2, 64), "attn": (2, 4, 40, 40)}
    later = apply_cuts(replayed, cuts, {1: (64, 33)})  # another caller length, same graph
    assert tuple(later["attn"].shape) == (2, 4, 33, 33) and tuple(later["pooled"].shape) == (2, 64)
    with pytest.raises(cg.CaptureError, match=r"output\['h'\] dim 1 is 65 padded vs 41") as err:
        learn_cuts({"h": torch.zeros(2, 65)}, {"h": torch.zeros(2, 41)}, padded)  # length + 1: not cuttable
    assert err.value.cause == "padding"


def test_bucketed_arguments_must_agree_on_the_bucketed_length():
    policy = Buckets({1: (8,)})
    with pytest.raises(cg.InputError, match="differ there"):
        policy.check_lengths([("a", torch.zeros(1, 5)), ("b", torch.zeros(1, 3))])
    policy.check_lengths([("a", torch.zeros(1, 5)), ("b", torch.zeros(1, 5, 2)), ("c", torch.zeros(7))])


def test_pad_value_names_and_values_are_checked():
    with pytest.raises(cg.InputError, match="numbers"):
        cg.GraphRunner(lambda x: x, pad_value={"x": "a"})
    policy = Buckets({1: (8,)}, pad_value={"attention_masks": 0, "x": -1})
    with pytest.raises(cg.InputError, match="attention_masks"):
        policy.check_pad_names([("x", torch.zeros(1)), ("m", torch.zeros(1))])
    assert policy.pad_of("x") == -1 and policy.pad_of("m") == 0
    nested = Buckets({1: (8,)}, pad_value={"batch['mask']": 0, "batch": 5})
    assert nested.pad_of("batch['mask']") == 0 and nested.pad_of("batch['ids']") == 5


def masked_mean(x, attention_mask):
    """A toy attention: every position gets the mean of the unmasked positions, plus itself.
    x: (batch, seq, hidden) float32; attention_mask: (batch, seq) float32 of 0/1."""
    w = attention_mask.unsqueeze(-1)
    return x + (x * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)


def unmasked_mean(x):
    """The same without a mask: padded positions leak into every result."""
    return x + x.mean(1, keepdim=True)


def _tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100, max_position_embeddings=64)
    return BertModel(config).eval()


def test_buckets_pad_slice_and_match_eager(simulated):
    runner = cg.GraphRunner(masked_mean, buckets={1: (8, 16)}, backend=simulated)
    for seq in (3, 8, 5, 11):
        x, m = torch.randn(1, seq, 4), torch.ones(1, seq)
        out = runner(x, m)
        assert out.shape == (1, seq, 4)
        torch.testing.assert_close(out, masked_mean(x, m))
    stats = runner.stats
    assert stats.captures == 2 and stats.fallbacks == 0
    assert [g.signature.split(" float32")[0] for g in stats.graphs] == ["x:(1, 8, 4)", "x:(1, 16, 4)"]


def test_padding_that_changes_the_result_is_caught(simulated):
    runner = cg.GraphRunner(unmasked_mean, buckets={1: (8,)}, backend=simulated)
    for attempt in range(2):  # the graph stays captured: a retry must not pass unchecked
        with pytest.raises(cg.CaptureError) as err:
            runner(torch.randn(1, 5, 4))
        assert err.value.cause == "padding", attempt


def test_above_the_largest_bucket_runs_eagerly_with_one_warning(simulated):
    runner = cg.GraphRunner(masked_mean, buckets={1: (8,)}, backend=simulated)
    with pytest.warns(UserWarning, match="exceed the largest bucket"):
        out = runner(torch.ones(1, 9, 2), torch.ones(1, 9))
    torch.testing.assert_close(out, masked_mean(torch.ones(1, 9, 2), torch.ones(1, 9)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner(torch.ones(1, 10, 2), torch.ones(1, 10))
    assert runner.stats.fallbacks == 2 and runner.stats.captures == 0


def test_capture_buckets_largest_first_then_only_replays(simulated):
    runner = cg.GraphRunner(masked_mean, buckets={1: (4, 8, 16)}, backend=simulated)
    stats = runner.capture_buckets(torch.randn(1, 6, 2), torch.ones(1, 6))
    assert [g.signature.split(" float32")[0] for g in stats.graphs] == ["x:(1, 16, 2)", "x:(1, 8, 2)", "x:(1, 4, 2)"]
    x, m = torch.randn(1, 7, 2), torch.ones(1, 7)
    torch.testing.assert_close(runner(x, m), masked_mean(x, m))
    assert runner.stats.captures == 3


def test_capture_buckets_checks_the_padding(simulated):
    runner = cg.GraphRunner(unmasked_mean, buckets={1: (4, 8)}, backend=simulated)
    with pytest.raises(cg.CaptureError) as err:
        runner.capture_buckets(torch.randn(1, 6, 2))
    assert err.value.cause == "padding"


def test_capture_buckets_without_an_example_is_an_input_error(simulated):
    with pytest.raises(cg.InputError, match="needs an example call"):
        cg.GraphRunner(lambda x: x, buckets={1: (8,)}, backend=simulated).capture_buckets()


def test_nested_arguments_and_named_pad_values(simulated):
    def f(batch):
        return masked_mean(batch["x"], batch["mask"])

    runner = cg.GraphRunner(f, buckets={1: (8,)}, pad_value={"batch['mask']": 0, "batch['x']": 99}, backend=simulated)
    x, m = torch.randn(1, 5, 3), torch.ones(1, 5)
    torch.testing.assert_close(runner({"x": x, "mask": m}), masked_mean(x, m))
    static_x = runner._graphs[next(iter(runner._graphs))].static_inputs[0]
    assert torch.all(static_x[:, 5:] == 99)  # the padding really holds the named value


def test_bert_with_attention_mask_through_buckets(simulated):
    """The notebook 03 recipe on a small random BERT: padded with a 0 mask, the real positions and the
    pooled [CLS] output equal eager at the caller's length; without a mask, padding is caught."""
    bert = _tiny_bert()
    runner = cg.GraphRunner(bert, buckets={1: (16, 32)}, backend=simulated)
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

    unmasked = cg.GraphRunner(bert, buckets={1: (16,)}, backend=simulated)
    with pytest.raises(cg.CaptureError) as err:
        unmasked(torch.randint(0, 100, (1, 9)))
    assert err.value.cause == "padding"


def test_an_output_as_wide_as_the_bucket_is_not_cut(simulated):
    """Outputs were cut wherever a size equalled the bucket: a (1, 8) pooled output under an 8 bucket
    came back as (1, 5). Also without validation, the cut dims come from one eager call."""
    def f(x):  # x: (1, seq, 8) -> per-position output and a pooled (1, 8) output
        return x * 2, x.amax(1)

    for validate in (True, False):
        runner = cg.GraphRunner(f, buckets={1: (8,)}, validate=validate, backend=simulated)
        x = torch.rand(1, 5, 8)
        per_position, pooled = runner(x)
        assert per_position.shape == (1, 5, 8) and pooled.shape == (1, 8)
        torch.testing.assert_close(pooled, x.amax(1))


def test_two_bucketed_dims_are_learned_as_each_is_padded(simulated):
    runner = cg.GraphRunner(lambda x: x * 2, buckets={0: (4,), 1: (8,)}, backend=simulated)
    for shape in [(4, 5), (3, 8), (2, 3)]:
        x = torch.rand(shape)
        torch.testing.assert_close(runner(x), x * 2)
    assert runner.stats.captures == 1


def test_two_padded_dims_with_the_same_length_are_not_confused(simulated):
    """With buckets on dims 0 and 1 and a first call of (5, 5), an output dim was credited to the wrong
    input dim, and a later (3, 5) call cut the wrong axis."""
    for fn in (lambda x: x.sum(0), lambda x: x.transpose(0, 1) * 2):
        runner = cg.GraphRunner(fn, buckets={0: (8,), 1: (8,)}, backend=simulated)
        for shape in [(5, 5, 2), (3, 5, 2), (5, 3, 2), (2, 7, 2)]:
            x = torch.rand(shape)
            torch.testing.assert_close(runner(x), fn(x))


def test_output_structure_changed_by_padding_is_a_padding_error(simulated):
    runner = cg.GraphRunner(lambda x: (x * 2, "a" if x.shape[1] == 8 else ("a", "b")), buckets={1: (8,)}, backend=simulated)
    with pytest.raises(cg.CaptureError) as err:
        runner(torch.rand(1, 5, 3))
    assert err.value.cause == "padding"


def test_a_length_returned_as_a_number_is_a_padding_error_without_validation(simulated):
    """With validate=False the bucket size came back where the caller's length was returned."""
    runner = cg.GraphRunner(lambda x: (x * 2, x.shape[1]), buckets={1: (8,)}, validate=False, backend=simulated)
    with pytest.raises(cg.CaptureError, match=r"output\[1\] is 8 padded vs 5") as err:
        runner(torch.rand(1, 5, 3))
    assert err.value.cause == "padding"


def test_a_learned_dim_and_a_new_dim_with_the_same_length(simulated):
    """Dim 0 learned at (5, 8); then (3, 3) pads both dims to 8 with the same length: the stored dim-0
    cuts replaced this call's learned ones and the output came back (3, 8)."""
    for validate in (False, True):
        runner = cg.GraphRunner(lambda x: x * 2, buckets={0: (8,), 1: (8,)}, validate=validate, backend=simulated)
        runner(torch.rand(5, 8))
        x = torch.rand(3, 3)
        torch.testing.assert_close(runner(x), x * 2)


@pytest.mark.parametrize("clone", [True, False])
def test_padded_outputs_are_cloned_or_views_of_the_static_output(simulated, clone):
    runner = cg.GraphRunner(lambda x: x + 1, buckets={1: (8,)}, clone_outputs=clone, backend=simulated)
    first = runner(torch.zeros(1, 5))
    runner(torch.full((1, 5), 10.0))
    assert torch.equal(first, torch.full((1, 5), 11.0 if not clone else 1.0))

