"""What GraphRunner accepts: argument binding and names, the input check against the first call and its
fast path, constructor arguments. CPU only (input checks run before any CUDA call; replays simulated)."""

import pytest
import torch

import cgutils as cg
from cgutils.capture import ArgSpec, Call, bind_names, check_inputs

CUDA = torch.device("cuda", 0)


def pattern(leaves):
    """The fast-path key of a call whose leaves are ``leaves`` (``Call.pattern``)."""
    return Call((), {}, [], leaves).pattern()


def spec(name, dtype=torch.int64, ndim=2, device=CUDA):
    return ArgSpec(name, True, dtype, ndim, device)


def test_cpu_tensor_is_named():
    with pytest.raises(cg.InputError, match=r"'input_ids' is a tensor on cpu.*input_ids.to\('cuda'\)"):
        check_inputs([spec("input_ids", device=torch.device("cpu"))], None)


def test_graph_runner_rejects_cpu_tensors_before_touching_cuda():
    runner = cg.GraphRunner(torch.nn.Linear(4, 4))
    if torch.cuda.is_available():
        with pytest.raises(cg.InputError, match="'input' is a tensor on cpu"):
            runner(torch.randn(1, 4))
    else:  # "move it to cuda" cannot help here: the missing GPU is said first
        with pytest.raises(cg.NoCudaError, match="GraphRunner needs a CUDA device"):
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
    def f(input_ids, attention_mask=None, *, scale=1.0):
        return input_ids

    names = [n for n, _ in bind_names(f, (torch.ones(1),), {"attention_mask": torch.ones(1), "scale": 2.0})]
    assert names == ["input_ids", "attention_mask", "scale"]
    names = [n for n, _ in bind_names(torch.nn.Linear(2, 2), (torch.ones(2),), {})]
    assert names == ["input"]


def test_variadic_arguments_are_named_after_their_parameter():
    def f(input_ids, attention_mask=None, *rest, **extra):
        return input_ids

    leaves = bind_names(f, (torch.ones(1), torch.ones(1), torch.ones(1)), {"k": torch.ones(1)})
    assert [n for n, _ in leaves] == ["input_ids", "attention_mask", "rest[0]", "k"]


def test_call_pattern_includes_argument_names():
    """The fast path skipped the input check for input_ids+token_type_ids after input_ids+attention_mask,
    and the token types were copied into the attention-mask buffer."""
    ids, m = torch.ones(1, 4), torch.ones(1, 4)
    a = pattern([("input_ids", ids), ("attention_mask", m)])
    b = pattern([("input_ids", ids), ("token_type_ids", m)])
    assert a != b and a == pattern([("input_ids", ids), ("attention_mask", m)])


def test_reordered_keyword_arguments_are_named_as_such():
    cuda = torch.device("cuda")
    first = [ArgSpec("a", True, torch.float32, 2, cuda), ArgSpec("b", True, torch.float32, 2, cuda)]
    with pytest.raises(cg.InputError, match="another order"):
        check_inputs(first[::-1], first)


def test_call_patterns_recognise_nan_and_arrays():
    import numpy as np

    assert pattern([("x", float("nan"))]) == pattern([("x", float("nan"))])
    assert pattern([("a", np.arange(3))]) == pattern([("a", np.arange(3))])
    assert pattern([("a", np.arange(3))]) != pattern([("a", np.arange(4))])


def test_the_same_tensor_twice_gets_two_static_buffers():
    """Buffers were swapped in by tensor identity: runner(x, x) captured f(b1, b1), so a later
    runner(p, q) computed f(q, q)."""
    def f(a, b, *, c=None):
        return a

    x, y = torch.ones(1), torch.zeros(1)
    bufs = [torch.full((1,), float(i)) for i in range(3)]
    call = Call((x, x), {"c": [y]}, [("a", ("a", 0)), ("b", ("a", 1)), ("c", ("k", "c"))], [])
    s_args, s_kwargs = call.substitute(bufs)
    assert s_args[0] is bufs[0] and s_args[1] is bufs[1] and s_kwargs["c"][0] is bufs[2]


def test_constructor_errors():
    with pytest.raises(cg.InputError, match="callable"):
        cg.GraphRunner(3)
    with pytest.raises(cg.InputError, match="warmup must be an int >= 1"):
        cg.GraphRunner(lambda x: x, warmup=0)
    with pytest.raises(cg.InputError, match="rtol must be a number >= 0"):
        cg.GraphRunner(lambda x: x, rtol=-1)


def test_compile_options_are_checked():
    with pytest.raises(cg.InputError, match="CUDA graphs of its own"):
        cg.GraphRunner(lambda x: x, compile={"mode": "reduce-overhead"})
    with pytest.raises(cg.InputError, match="torch.compile rejected"):
        cg.GraphRunner(lambda x: x, compile={"bogus": 1})
    runner = cg.GraphRunner(lambda x: x, compile={})  # an empty dict still means: compile
    assert runner._call is not runner.fn


def test_inductor_cudagraphs_option_is_refused():
    with pytest.raises(cg.InputError, match="CUDA graphs of its own"):
        cg.GraphRunner(lambda x: x, compile={"options": {"triton.cudagraphs": True}})


def test_training_mode_warns():
    with pytest.warns(UserWarning, match="eval"):
        cg.GraphRunner(torch.nn.Dropout(0.1))


def test_the_same_tensor_twice_then_two_tensors(simulated):
    """runner(x, x) must capture two static buffers, or runner(p, q) computes f(q, q)."""
    runner = cg.GraphRunner(lambda a, b: a - b, backend=simulated)
    x = torch.ones(4)
    assert torch.equal(runner(x, x), torch.zeros(4))
    p, q = torch.full((4,), 5.0), torch.full((4,), 2.0)
    assert torch.equal(runner(p, q), torch.full((4,), 3.0))


def test_keyword_arguments_go_to_their_own_buffers(simulated):
    def f(x, attention_mask=None, token_type_ids=None):
        return x * (attention_mask if attention_mask is not None else 1) + (
            token_type_ids if token_type_ids is not None else 0)

    runner = cg.GraphRunner(f, backend=simulated)
    x, m = torch.ones(1, 4), torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert torch.equal(runner(x, attention_mask=m), m)
    with pytest.raises(cg.InputError, match="token_type_ids"):
        runner(x, token_type_ids=torch.full((1, 4), 7.0))
    assert torch.equal(runner(x * 3, attention_mask=m), 3 * m)  # the accepted pattern still replays


def test_fast_path_still_catches_a_changed_dtype_and_value(simulated):
    runner = cg.GraphRunner(lambda x, scale: x * scale, backend=simulated)
    runner(torch.ones(3), 2.0)
    runner(torch.ones(3), 2.0)
    with pytest.raises(cg.InputError, match="dtype"):
        runner(torch.ones(3, dtype=torch.float64), 2.0)
    with pytest.raises(cg.InputError, match="baked into the graph"):
        runner(torch.ones(3), 3.0)


def test_a_failed_first_call_does_not_fix_the_argument_structure(simulated):
    emb = torch.nn.Embedding(10, 4)
    runner = cg.GraphRunner(emb, backend=simulated)
    with pytest.raises(RuntimeError):
        runner(torch.rand(2, 3))  # float indices: fails inside the module
    ids = torch.randint(0, 10, (2, 3))
    torch.testing.assert_close(runner(ids), emb(ids))

    def f(x, mask):
        return x * mask

    runner = cg.GraphRunner(f, backend=simulated)
    with pytest.raises(TypeError):
        runner(torch.ones(2))  # mask missing
    assert torch.equal(runner(torch.ones(2), torch.zeros(2)), torch.zeros(2))


def test_a_left_out_argument_is_named(simulated):
    def forward(input_ids, attention_mask=None):
        return input_ids * (1 if attention_mask is None else attention_mask)

    runner = cg.GraphRunner(forward, backend=simulated)
    ids = torch.ones(1, 4)
    runner(ids, ids)
    with pytest.raises(cg.InputError, match=r"missing: \['attention_mask'\], new: none"):
        runner(ids)
    with pytest.raises(cg.InputError, match=r"missing: none, new: \['bogus'\]"):
        runner(ids, ids, bogus=1)

