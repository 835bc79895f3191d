"""GraphRunner's input checks, output trees and error explanations: all testable without a GPU."""

import collections
import dataclasses

import pytest
import torch

import cgutils as cg
from cgutils.capture import ArgSpec, check_inputs, tree_leaves, tree_map

CUDA = torch.device("cuda", 0)


def spec(name, dtype=torch.int64, ndim=2, device=CUDA):
    return ArgSpec(name, True, dtype, ndim, device)


def test_cpu_tensor_is_named():
    with pytest.raises(cg.InputError, match=r"'input_ids' is a tensor on cpu.*input_ids.to\('cuda'\)"):
        check_inputs([spec("input_ids", device=torch.device("cpu"))], None)


def test_graph_runner_rejects_cpu_tensors_before_touching_cuda():
    runner = cg.GraphRunner(torch.nn.Linear(4, 4))
    with pytest.raises(cg.InputError, match="'input' is a tensor on cpu"):
        runner(torch.randn(1, 4))


def test_no_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(cg.NoCudaError, match="needs a CUDA device"):
        cg.GraphRunner(lambda: 1)()


def test_dtype_change_is_named_with_fix():
    ref = [spec("input_ids"), spec("attention_mask")]
    with pytest.raises(cg.InputError, match=r"'attention_mask' has dtype torch.float32.*strict=False"):
        check_inputs([spec("input_ids"), spec("attention_mask", dtype=torch.float32)], ref)


def test_rank_change_is_named():
    with pytest.raises(cg.InputError, match="'x' has 3 dimensions but had 2"):
        check_inputs([spec("x", ndim=3)], [spec("x")])


def test_non_strict_allows_new_dtype_and_rank():
    check_inputs([spec("x", dtype=torch.float16, ndim=3)], [spec("x")], strict=False)


def test_changed_non_tensor_argument_is_named():
    ref = [spec("x"), ArgSpec("use_cache", False, value=False)]
    with pytest.raises(cg.InputError, match="'use_cache' was False at capture and is now True.*baked"):
        check_inputs([spec("x"), ArgSpec("use_cache", False, value=True)], ref)


def test_changed_argument_set_is_reported():
    with pytest.raises(cg.InputError, match=r"missing: \['mask'\], new: \['other'\]"):
        check_inputs([spec("x"), spec("other")], [spec("x"), spec("mask")])


def test_tensor_becoming_value_is_reported():
    with pytest.raises(cg.InputError, match="'x' was a tensor at capture and is now 3"):
        check_inputs([ArgSpec("x", False, value=3)], [spec("x")])


def test_other_device_is_reported():
    with pytest.raises(cg.InputError, match="on cuda:1 but was captured on cuda:0"):
        check_inputs([spec("x", device=torch.device("cuda", 1))], [spec("x")])


def test_argument_names_come_from_the_signature():
    from cgutils.capture import _bind_names

    def f(input_ids, attention_mask=None, *, scale=1.0):
        return input_ids

    names = [n for n, _ in _bind_names(f, (torch.ones(1),), {"attention_mask": torch.ones(1), "scale": 2.0})]
    assert names == ["input_ids", "attention_mask", "scale"]
    names = [n for n, _ in _bind_names(torch.nn.Linear(2, 2), (torch.ones(2),), {})]
    assert names == ["input"]


def test_constructor_errors():
    with pytest.raises(cg.InputError, match="callable"):
        cg.GraphRunner(3)
    with pytest.raises(cg.InputError, match="warmup must be an int >= 1"):
        cg.GraphRunner(lambda x: x, warmup=0)
    with pytest.raises(cg.InputError, match="rtol must be a number >= 0"):
        cg.GraphRunner(lambda x: x, rtol=-1)


def test_training_mode_warns():
    with pytest.warns(UserWarning, match="eval"):
        cg.GraphRunner(torch.nn.Dropout(0.1))


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: tuple


Pair = collections.namedtuple("Pair", "a b")


def test_tree_map_rebuilds_nested_outputs():
    from transformers.modeling_outputs import BaseModelOutput

    t = torch.ones(2)
    nest = {"m": BaseModelOutput(last_hidden_state=t), "d": Out(t, (t, 1)), "p": Pair(t, [t, "s"])}
    doubled = tree_map(lambda x: x * 2, nest)
    assert isinstance(doubled["m"], BaseModelOutput) and torch.equal(doubled["m"].last_hidden_state, t * 2)
    assert isinstance(doubled["d"], Out) and doubled["d"].extra[1] == 1
    assert isinstance(doubled["p"], Pair) and doubled["p"].b[1] == "s"
    assert torch.equal(doubled["p"].b[0], t * 2)
    paths = [p for p, leaf in tree_leaves(nest) if isinstance(leaf, torch.Tensor)]
    assert paths == ["output['m']['last_hidden_state']", "output['d'].logits", "output['d'].extra[0]",
                     "output['p'][0]", "output['p'][1][0]"]


def test_max_rel_error():
    a = torch.tensor([1.0, 2.0, 4.0])
    assert cg.max_rel_error(a, a.clone()) == 0.0
    assert cg.max_rel_error(a + torch.tensor([0.0, 0.0, 0.04]), a) == pytest.approx(0.01)
    assert cg.max_rel_error(torch.tensor([1, 2]), torch.tensor([1, 3])) == float("inf")
    with pytest.raises(cg.InputError, match="shape"):
        cg.max_rel_error(torch.ones(2), torch.ones(3))
    with pytest.raises(cg.InputError, match="cannot compare Tensor with float"):
        cg.max_rel_error(torch.ones(1), 1.0)


def test_nan_replay_never_passes_validation():
    """Regression: max() dropped a NaN error, so a replay producing NaN counted as exact."""
    nan, inf = float("nan"), float("inf")
    assert cg.max_rel_error(torch.tensor([nan]), torch.tensor([1.0])) == inf
    assert cg.max_rel_error(torch.tensor([1.0, 2.0]), torch.tensor([nan, 2.0])) == inf
    assert cg.max_rel_error(torch.tensor([inf]), torch.tensor([-inf])) == inf
    assert cg.max_rel_error(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0])) == 0.0  # same NaNs: equal


# error texts as PyTorch 2.11 / CUDA 13 print them
@pytest.mark.parametrize("text, key", [
    ("CUDA error: operation not permitted when stream is capturing", "sync"),
    ("CUDA error: operation failed due to a previous error during capture\n"
     "cudaErrorStreamCaptureInvalidated", "invalidated"),
    ("CUDA error: operation would make the legacy stream depend on a capturing blocking stream", "default_stream"),
    ("CUDA graphs must be captured on a non-default stream. (However, after capture, it's ok to replay "
     "them on the default stream.)", "default_stream"),
    ("Attempting to capture with a CPU generator", "rng"),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", "allocation"),
])
def test_explain_known_capture_errors(text, key):
    why = cg.explain(RuntimeError(text))
    assert why is not None and why.key == key
    assert why.cause and why.fix


def test_explain_follows_the_exception_chain():
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        except RuntimeError as inner:
            raise RuntimeError("wrapper text with nothing useful") from inner
    except RuntimeError as outer:
        assert cg.explain(outer).key == "sync"


def test_explain_unknown_returns_none():
    assert cg.explain("something else entirely") is None


def test_exception_tree():
    for exc in (cg.CaptureError, cg.InputError, cg.StaleRecordingError, cg.NoCudaError, cg.RecordingError):
        assert issubclass(exc, cg.CgutilsError)
    assert issubclass(cg.StaleRecordingError, cg.RecordingError)


# --- validation of replays, sync recording and buckets (CPU: fake replays, simulated sync warnings) ---

def _fake_graph(bug: str):
    """A stand-in for a captured graph y = 2 * x, with one of the static-buffer bugs."""
    static_x, static_y = torch.zeros(3), torch.zeros(3)
    state = {"x": static_x, "scale": 2.0}

    def replay(x):
        if bug == "rebind":
            state["x"] = x  # rebinding the name: the "graph" keeps reading static_x
        else:
            static_x.copy_(x)
        static_y.copy_(static_x * (3.0 if bug == "baked" else 2.0))
        return static_y if bug == "no_clone" else static_y.clone()

    return replay


@pytest.mark.parametrize("bug, cause", [("rebind", "stale_input"), ("no_clone", "overwritten_output"),
                                        ("baked", "baked_value")])
def test_validate_replay_names_the_static_buffer_bug(bug, cause):
    from cgutils.capture import validate_replay

    inputs = [(torch.full((3,), float(i + 1)),) for i in range(3)]
    with pytest.raises(cg.CaptureError) as err:
        validate_replay(_fake_graph(bug), lambda x: 2 * x, inputs)
    assert err.value.cause == cause and err.value.max_rel_error > 0


def test_validate_replay_passes_a_correct_replay_and_needs_two_inputs():
    from cgutils.capture import validate_replay

    inputs = [(torch.full((3,), float(i + 1)),) for i in range(3)]
    table = validate_replay(_fake_graph("none"), lambda x: 2 * x, inputs)
    assert list(table["max_rel_error"]) == [0.0, 0.0, 0.0]
    with pytest.raises(cg.InputError, match="at least two"):
        validate_replay(_fake_graph("none"), lambda x: 2 * x, inputs[:1])


def test_sync_recorder_reports_the_users_line_and_the_op():
    import warnings

    from cgutils.diagnose import SyncRecorder, _op_name

    def model(x):
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # stands in for PyTorch's debug-mode warning
        return x

    with SyncRecorder() as rec:
        model(torch.ones(1))
    line = model.__code__.co_firstlineno + 1
    df = rec.to_frame()
    assert list(df.columns) == ["op", "file", "line", "code", "function"]
    assert len(df) == 1 and df.line[0] == line and df.file[0] == __file__ and df.function[0] == "model"
    assert _op_name(torch.Tensor.item) == "Tensor.item" and _op_name(torch.nonzero) == "torch.nonzero"


def test_sync_recorder_passes_other_warnings_through():
    import warnings

    from cgutils.diagnose import SyncRecorder

    with pytest.warns(UserWarning, match="unrelated"), SyncRecorder() as rec:
        warnings.warn("unrelated", stacklevel=1)
    assert rec.points == []


def test_find_sync_points_without_cuda_says_so():
    from cgutils.diagnose import find_sync_points

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(cg.NoCudaError):
        find_sync_points(lambda: None)


@pytest.mark.parametrize("buckets, msg", [([128], "dict"), ({1: []}, "non-empty"), ({-1: [4]}, "dims"),
                                          ({1: [0]}, "positive"), ({1: "ab"}, "positive")])
def test_bad_buckets_are_rejected(buckets, msg):
    with pytest.raises(cg.InputError, match=msg):
        cg.GraphRunner(lambda x: x, buckets=buckets)


def test_bucket_shapes_and_padding_helpers():
    from cgutils.capture import _copy_padded

    runner = cg.GraphRunner(lambda x, m: x, buckets={1: (64, 32, 128)})
    assert runner.buckets == {1: (32, 64, 128)}
    assert runner._target_shape(torch.zeros(2, 40)) == (2, 64)
    assert runner._target_shape(torch.zeros(2, 129)) is None  # above the largest bucket: eager fallback
    assert runner._target_shape(torch.zeros(5)) == (5,)  # too few dims: not bucketed
    buf = torch.empty(2, 4)
    _copy_padded(buf, torch.ones(2, 3), pad=-1.0)
    assert buf.tolist() == [[1, 1, 1, -1], [1, 1, 1, -1]]


def test_output_cuts_are_learned_from_eager_shapes():
    """A pooled output of hidden size 64 under a 64 bucket was cut to the caller's length, since the
    cut test was "size equals the bucket"; the dims to cut are now learned from an eager call."""
    from cgutils.capture import _apply_cuts, _learn_cuts

    padded = {1: (64, 40)}
    replayed = {"h": torch.zeros(2, 64, 8), "pooled": torch.zeros(2, 64), "attn": torch.zeros(2, 4, 64, 64)}
    eager = {"h": torch.zeros(2, 40, 8), "pooled": torch.zeros(2, 64), "attn": torch.zeros(2, 4, 40, 40)}
    cuts, ambiguous = _learn_cuts(replayed, eager, padded)
    assert ambiguous == set()
    out = _apply_cuts(replayed, cuts, padded)
    assert {k: tuple(v.shape) for k, v in out.items()} == {"h": (2, 40, 8), "pooled": (2, 64), "attn": (2, 4, 40, 40)}
    later = _apply_cuts(replayed, cuts, {1: (64, 33)})  # another caller length, same graph
    assert tuple(later["attn"].shape) == (2, 4, 33, 33) and tuple(later["pooled"].shape) == (2, 64)
    with pytest.raises(cg.CaptureError, match=r"output\['h'\] dim 1 is 65 padded vs 41") as err:
        _learn_cuts({"h": torch.zeros(2, 65)}, {"h": torch.zeros(2, 41)}, padded)  # length + 1: not cuttable
    assert err.value.cause == "padding"


def test_param_names_are_bound_once_per_call_pattern():
    def f(input_ids, attention_mask=None, *rest, **extra):
        return input_ids

    runner = cg.GraphRunner(f)
    leaves = runner._leaves((torch.ones(1), torch.ones(1), torch.ones(1)), {"k": torch.ones(1)})
    assert [n for n, _ in leaves] == ["input_ids", "attention_mask", "rest[0]", "k"]
    assert len(runner._names) == 1


def test_one_user_call_that_syncs_many_times_is_one_sync_point():
    """Printing a CUDA tensor syncs once per formatted piece; it was reported 8 times for one print."""
    from cgutils.diagnose import SyncRecorder

    rec = SyncRecorder()

    def inner_syncs():
        rec._record("Tensor.__repr__", 1)  # three syncs inside one outermost torch call
        rec._record("Tensor.__repr__", 1)
        rec._record("Tensor.__repr__", 1)
        rec._record("Tensor.item", 2)
        rec._record("torch.cuda.synchronize")  # outside any torch call: always its own point
        rec._record("torch.cuda.synchronize")

    inner_syncs()
    assert [p.op for p in rec.points] == ["Tensor.__repr__", "Tensor.item", "torch.cuda.synchronize",
                                          "torch.cuda.synchronize"]


# --- review findings (helper walkthrough), each failed before its fix ---------------------------------

def test_call_pattern_includes_argument_names():
    """The fast path skipped the input check for input_ids+token_type_ids after input_ids+attention_mask,
    and the token types were copied into the attention-mask buffer."""
    from cgutils.capture import _call_pattern

    ids, m = torch.ones(1, 4), torch.ones(1, 4)
    a = _call_pattern([("input_ids", ids), ("attention_mask", m)])
    b = _call_pattern([("input_ids", ids), ("token_type_ids", m)])
    assert a != b and a == _call_pattern([("input_ids", ids), ("attention_mask", m)])


def test_reordered_keyword_arguments_are_named_as_such():
    from cgutils.capture import ArgSpec, check_inputs

    cuda = torch.device("cuda")
    first = [ArgSpec("a", True, torch.float32, 2, cuda), ArgSpec("b", True, torch.float32, 2, cuda)]
    with pytest.raises(cg.InputError, match="another order"):
        check_inputs(first[::-1], first)


def test_non_tensor_outputs_are_compared():
    assert cg.max_rel_error(999.0, 2.0) == float("inf")
    assert cg.max_rel_error(("a", None, 1), ("a", None, 1)) == 0.0
    assert cg.max_rel_error("a", "b") == float("inf")


def test_validate_replay_rejects_unusable_inputs():
    from cgutils.capture import validate_replay

    with pytest.raises(cg.InputError, match="argument tuples"):
        validate_replay(lambda v: v, lambda v: v, [torch.ones(1), torch.zeros(1)])
    with pytest.raises(cg.InputError, match="identical inputs"):
        validate_replay(lambda v: v, lambda v: v, [(torch.ones(1),), (torch.ones(1),)])
    with pytest.raises(cg.CaptureError):
        validate_replay(lambda v: 999.0, lambda v: v * 2, [(1.0,), (2.0,), (3.0,)])


def test_bucketed_arguments_must_agree_on_the_bucketed_length():
    runner = cg.GraphRunner(lambda a, b: a, buckets={1: (8,)})
    with pytest.raises(cg.InputError, match="differ there"):
        runner._check_bucketed_lengths([("a", torch.zeros(1, 5)), ("b", torch.zeros(1, 3))])
    runner._check_bucketed_lengths([("a", torch.zeros(1, 5)), ("b", torch.zeros(1, 5, 2)), ("c", torch.zeros(7))])


def test_pad_value_names_and_values_are_checked():
    with pytest.raises(cg.InputError, match="numbers"):
        cg.GraphRunner(lambda x: x, pad_value={"x": "a"})
    runner = cg.GraphRunner(lambda x, m: x, buckets={1: (8,)}, pad_value={"attention_masks": 0, "x": -1})
    with pytest.raises(cg.InputError, match="attention_masks"):
        runner._check_pad_names(["x", "m"])
    assert runner._pad_of("x") == -1 and runner._pad_of("m") == 0
    nested = cg.GraphRunner(lambda batch: batch, pad_value={"batch['mask']": 0, "batch": 5})
    assert nested._pad_of("batch['mask']") == 0 and nested._pad_of("batch['ids']") == 5


def test_compile_options_are_checked():
    with pytest.raises(cg.InputError, match="CUDA graphs of its own"):
        cg.GraphRunner(lambda x: x, compile={"mode": "reduce-overhead"})
    with pytest.raises(cg.InputError, match="torch.compile rejected"):
        cg.GraphRunner(lambda x: x, compile={"bogus": 1})
    runner = cg.GraphRunner(lambda x: x, compile={})  # an empty dict still means: compile
    assert runner._call is not runner.fn


@pytest.mark.parametrize("text", ["expected argument seed to be an int, got str",
                                  "'Generator' object has no attribute 'x'"])
def test_explain_does_not_blame_the_rng_for_any_mention_of_seed(text):
    why = cg.explain(text)
    assert why is None or why.key != "rng"


# --- second review (helper), each failed before its fix -----------------------------------------------

def test_objects_without_value_equality_are_not_compared():
    """A transformers cache object in the outputs made every capture fail validation (inf)."""
    class Cache:  # compares by identity, like DynamicCache
        pass

    assert cg.max_rel_error((torch.ones(2), Cache()), (torch.ones(2), Cache())) == 0.0
    assert cg.max_rel_error((torch.ones(2), 3), (torch.ones(2), 4)) == float("inf")


def test_validate_replay_accepts_inputs_of_different_shapes():
    from cgutils.capture import validate_replay

    inputs = [(torch.ones(1, 100),), (torch.ones(1, 120),)]
    assert list(validate_replay(lambda t: t * 2, lambda t: t * 2, inputs).max_rel_error) == [0.0, 0.0]


def test_call_patterns_recognise_nan_and_arrays():
    import numpy as np

    from cgutils.capture import _call_pattern

    assert _call_pattern([("x", float("nan"))]) == _call_pattern([("x", float("nan"))])
    assert _call_pattern([("a", np.arange(3))]) == _call_pattern([("a", np.arange(3))])
    assert _call_pattern([("a", np.arange(3))]) != _call_pattern([("a", np.arange(4))])


def test_the_same_tensor_twice_gets_two_static_buffers():
    """Buffers were swapped in by tensor identity: runner(x, x) captured f(b1, b1), so a later
    runner(p, q) computed f(q, q)."""
    from cgutils.capture import _param_names, _substitute

    def f(a, b, *, c=None):
        return a

    x, y = torch.ones(1), torch.zeros(1)
    bufs = [torch.full((1,), float(i)) for i in range(3)]
    s_args, s_kwargs = _substitute(_param_names(f, 2, ("c",)), (x, x), {"c": [y]}, bufs)
    assert s_args[0] is bufs[0] and s_args[1] is bufs[1] and s_kwargs["c"][0] is bufs[2]


def test_inductor_cudagraphs_option_is_refused():
    with pytest.raises(cg.InputError, match="CUDA graphs of its own"):
        cg.GraphRunner(lambda x: x, compile={"options": {"triton.cudagraphs": True}})


def test_explain_recognises_manual_seed_during_capture():
    text = "CUDAGeneratorImpl::set_current_seed can be called during stream capture only if the generator is"
    assert cg.explain(text).key == "rng"


# --- third review (new-user walkthrough) ---------------------------------------------------------------

def test_validate_replay_does_not_call_a_nan_replay_stale():
    """NaN equals NaN in the 'all outputs equal the first' test, so a NaN replay was called stale_input."""
    from cgutils.capture import validate_replay

    with pytest.raises(cg.CaptureError) as err:
        validate_replay(lambda t: t * float("nan"), lambda t: t * 2, [(torch.ones(2),), (torch.zeros(2) + 3,)])
    assert err.value.cause == "nonfinite"


def test_explain_rejects_what_is_not_an_error():
    with pytest.raises(cg.InputError, match="exception or its message"):
        cg.explain(None)


def test_capture_runs_with_the_autocast_cache_off(monkeypatch):
    """Captured under autocast with its cast cache on, a graph reads cached weight casts that are freed
    when the autocast context exits (torch.cuda.make_graphed_callables refuses that setting)."""
    from cgutils.capture import _autocast_without_cache

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with _autocast_without_cache():
        assert not torch.is_autocast_enabled("cuda")  # outside autocast: nothing changes
    with torch.autocast("cuda", dtype=torch.float16):
        assert torch.is_autocast_cache_enabled()
        with _autocast_without_cache():
            assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.float16
            assert not torch.is_autocast_cache_enabled()
        assert torch.is_autocast_cache_enabled()
