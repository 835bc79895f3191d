"""Control flow on the device, the parts that run without a GPU: while_node/if_node argument checks and
their eager (Python-loop) meaning, and StopTokenDecoder against transformers' EOS-stopping generate."""

import pytest
import torch
from simulation import SimulatedBackend
from transformers import GPT2Config, GPT2LMHeadModel

import cgutils as cg
from cgutils.errors import InputError
from cgutils.generation.until_eos import StopTokenDecoder, hf_generate_until_eos


def test_while_node_eager_runs_while_the_condition_holds_and_stops_at_max_iters():
    x, cond = torch.zeros(1), torch.ones(1, dtype=torch.bool)

    def body():
        x.add_(1)
        cond.copy_(x < 5)

    assert int(cg.while_node(cond, body, max_iters=100)) == 5 and int(x) == 5
    cond.fill_(True)
    with pytest.warns(UserWarning, match="stopped at max_iters=3"):
        assert int(cg.while_node(cond, lambda: x.add_(1), max_iters=3)) == 3 and int(x) == 8  # never clears: capped
    assert int(cg.while_node(torch.zeros(1, dtype=torch.int32), body, max_iters=3)) == 0


def test_if_node_eager_runs_one_branch():
    seen = []
    cg.if_node(torch.tensor([True]), lambda: seen.append("then"), lambda: seen.append("else"))
    cg.if_node(torch.tensor([0], dtype=torch.int64), lambda: seen.append("then"), lambda: seen.append("else"))
    cg.if_node(torch.tensor([False]), lambda: seen.append("then"))
    assert seen == ["then", "else"]


@pytest.mark.parametrize("cond,match", [
    (torch.ones(2, dtype=torch.bool), "one-element"),
    (torch.ones(1), "bool or integer"),
    (1, "got int"),
])
def test_conditions_are_checked(cond, match):
    with pytest.raises(InputError, match=match):
        cg.while_node(cond, lambda: None, max_iters=1)
    with pytest.raises(InputError, match=match):
        cg.if_node(cond, lambda: None)


def test_loop_arguments_are_checked():
    cond = torch.ones(1, dtype=torch.bool)
    with pytest.raises(InputError, match="max_iters must be an int >= 0"):
        cg.while_node(cond, lambda: None, max_iters=-1)
    with pytest.raises(TypeError):
        cg.while_node(cond, lambda: None)  # max_iters is required: an unbounded loop could hang the GPU
    with pytest.raises(InputError, match="body must be a function"):
        cg.while_node(cond, "step", max_iters=1)
    with pytest.raises(InputError, match="else_body must be a function"):
        cg.if_node(cond, lambda: None, 3)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4)).eval()


def _eos_for(model, prompt, after=3):
    """A token that row 0 emits first at some step >= ``after`` of plain greedy decoding (so EOS stopping
    matters), and that step."""
    row = cg.hf_generate(model, prompt, 20)[0, prompt.shape[1]:].tolist()
    step = next(i for i in range(after, len(row)) if row[i] not in row[:i])
    return row[step], step


@pytest.mark.parametrize("loop", ["eager", "host", "device"])
def test_stop_token_decoder_equals_transformers(tiny, loop):
    # seed 6: row 0 turns to a new token at step 6, rows 1 and 2 never emit it (they run to the limit)
    prompt = torch.randint(0, tiny.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(6))
    eos, step = _eos_for(tiny, prompt)
    expected = hf_generate_until_eos(tiny, prompt, 20, eos)
    dec = StopTokenDecoder(tiny, eos, loop=loop, backend=SimulatedBackend())
    got = dec.generate(prompt, 20)
    assert torch.equal(got, expected), (got, expected)
    assert dec.slots == [(4, 6, 128)]  # batch bucket, prompt length, length bucket
    assert (got[0, 6:] == eos).nonzero()[0].item() == step and (got[0, 6 + step:] == eos).all()  # row 0 ended there
    timings = {}
    dec.generate(prompt, 20, timings=timings)
    assert 0 < timings["first_token_ms"] <= timings["last_token_ms"]
    if loop == "device":
        assert dec.last_launches == 1 and dec.last_syncs == 2  # the prompt's token-id check, the length
        assert timings["first_token_ms"] == timings["last_token_ms"]  # nothing readable before the end
    elif loop == "host":
        assert dec.last_launches == got.shape[1] - 6 and dec.last_syncs == dec.last_launches + 2


def test_stop_token_decoder_without_eos_runs_to_the_limit(tiny):
    prompt = torch.randint(0, tiny.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(6))
    dec = StopTokenDecoder(tiny, eos_token_id=tiny.config.vocab_size - 1, loop="device", backend=SimulatedBackend())
    got = dec.generate(prompt, 12)
    assert got.shape == (1, 16) and torch.equal(got, cg.hf_generate(tiny, prompt, 12))


def test_stop_token_decoder_rejects_bad_arguments(tiny):
    with pytest.raises(InputError, match="loop must be one of"):
        StopTokenDecoder(tiny, 1, loop="gpu")
    with pytest.raises(InputError, match="outside the vocabulary"):
        StopTokenDecoder(tiny, tiny.config.vocab_size)
    with pytest.raises(InputError, match="needs the model on a CUDA device"):
        StopTokenDecoder(tiny, 1, loop="device")
    with pytest.raises(InputError, match="GPT2LMHeadModel"):
        StopTokenDecoder(torch.nn.Linear(2, 2), 1)
    dec = StopTokenDecoder(tiny, 1, loop="eager")
    with pytest.raises(InputError, match="timings must be a dict"):
        dec.generate(torch.zeros(1, 3, dtype=torch.int64), 3, timings=[])
    with pytest.raises(InputError, match="token ids must lie"):
        dec.generate(torch.tensor([[tiny.config.vocab_size]]), 3)


def test_recorded_device_loop_meets_the_targets():
    """The H200 recording of notebook 10: one graph launch per sequence (trace), tokens equal transformers
    for every loop, the stop at the chosen EOS, and the WHILE node's loop count following the data."""
    from cgutils.store import current_store

    store = current_store()
    check = store.load_value("control_generation_check")
    assert check["trace_graph_launches"] == check["device_graph_launches"] == 1 and check["device_syncs"] == 2
    assert all(check[f"{loop}_tokens_equal"] for loop in ("device", "host", "eager"))
    assert check["host_graph_launches"] == check["new_tokens"]  # the prefill graph, then one per further token
    if check["stop_step"] is not None:
        assert check["new_tokens"] == check["stop_step"] + 1
    rows = store.load_frame("control_while_rows")
    assert rows.equals_eager.all() and list(rows.iterations) == [7, 2, 20, 0]  # halvings that bring 100, 3, 1e6, 0.5 below 1
    gen = store.load_frame("control_generation").set_index("variant")
    assert gen.first_token_ms["device_loop"] == gen.last_token_ms["device_loop"]
    assert gen.first_token_ms["host_loop"] < gen.last_token_ms["host_loop"]


def test_nested_loops_run_eagerly_and_know_they_are_inside_a_body():
    from cgutils.capture.control import inside_body

    total, outer, inner = torch.zeros(1), torch.ones(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool)
    i, seen = torch.zeros(1), []

    def inner_body():
        total.add_(1)
        inner.copy_(total % 3 != 0)

    def outer_body():
        seen.append(inside_body())
        inner.fill_(True)
        cg.while_node(inner, inner_body, max_iters=10)
        i.add_(1)
        outer.copy_(i < 4)

    assert not inside_body()
    cg.while_node(outer, outer_body, max_iters=10)
    assert int(total) == 12 and int(i) == 4 and seen == [True] * 4 and not inside_body()


def test_a_cpu_loop_leaves_cuda_alone(monkeypatch):
    """The warm-up's sync check switched CUDA's process-wide sync debug mode even for CPU tensors, which
    initialises CUDA (a forked data-loader worker then fails)."""
    def touched(*_):
        raise AssertionError("CUDA touched")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", touched)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", touched)
    x, cond = torch.zeros(1), torch.ones(1, dtype=torch.bool)
    cg.while_node(cond, lambda: (x.add_(1), cond.copy_(x < 3)), max_iters=10)
    cg.if_node(cond, lambda: None, lambda: x.add_(1))
    assert int(x) == 4


def test_more_argument_checks():
    cond = torch.ones(1, dtype=torch.bool)
    with pytest.raises(InputError, match="max_iters must be <= 2147483647"):
        cg.while_node(cond, lambda: None, max_iters=2**31)  # wrapped to a negative C int on the GPU
    with pytest.raises(InputError, match="body must be a function"):
        cg.if_node(cond, None)
    with pytest.raises(InputError, match="is on meta"):
        cg.while_node(torch.ones(1, dtype=torch.bool, device="meta"), lambda: None, max_iters=1)
    if hasattr(torch, "uint16"):
        assert int(cg.while_node(torch.zeros(1, dtype=torch.uint16), lambda: None, max_iters=1)) == 0


def test_conditional_nodes_need_cuda_bindings_13(monkeypatch):
    pytest.importorskip("cuda.bindings")
    from cuda import bindings

    from cgutils.capture.control import conditional_driver
    from cgutils.errors import DependencyError
    monkeypatch.setattr(bindings, "__version__", "12.9.0")
    with pytest.raises(DependencyError, match="cuda-bindings 13"):
        conditional_driver()


def test_a_generator_body_is_refused():
    def gen_body():
        yield 1

    with pytest.raises(InputError, match="ran nothing"):
        cg.while_node(torch.ones(1, dtype=torch.bool), gen_body, max_iters=3)


def test_higher_order_operators_and_compile_pass_through_the_sync_check():
    """A plain dispatch mode raised "no rule registered for HigherOrderOperator" for torch.cond in a body."""
    x, cond = torch.ones(2), torch.ones(1, dtype=torch.bool)

    def body():
        x.copy_(torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,)))
        cond.fill_(False)

    cg.while_node(cond, body, max_iters=2)
    assert x.tolist() == [2.0, 2.0]


def test_waits_for_gpu_names_the_syncs_a_body_cannot_hold():
    """The dispatch-mode check saw only .item()-like reads; boolean-mask indexing (a nonzero inside a kernel),
    torch.equal and pageable host-to-GPU copies passed it and then failed under capture; a pinned
    non_blocking copy back was refused although it is asynchronous."""
    from cgutils.capture.bodysync import waits_for_gpu

    aten = torch.ops.aten
    on_gpu = lambda t: t.device.type == "meta"  # noqa: E731  (meta stands in for CUDA here)
    g, mask, host = torch.ones(4, device="meta"), torch.ones(4, dtype=torch.bool, device="meta"), torch.ones(4)
    idx = torch.zeros(2, dtype=torch.int64, device="meta")
    cases = {
        "item": (aten._local_scalar_dense.default, (g,), {}),
        "equal": (aten.equal.default, (g, g), {}),
        "mask index": (aten.index.Tensor, (g, [mask]), {}),
        "mask put": (aten.index_put_.default, (g, [mask], g), {}),
        "nonzero": (aten.nonzero.default, (g,), {}),
        "repeat": (aten.repeat_interleave.Tensor, (idx,), {}),
        "to host": (aten._to_copy.default, (g,), {"device": torch.device("cpu")}),
        "copy back": (aten.copy_.default, (host, g), {}),
    }
    for name, (func, args, kwargs) in cases.items():
        assert waits_for_gpu(func, args, kwargs, on_gpu=on_gpu), name
    fine = {
        "int index": (aten.index.Tensor, (g, [idx]), {}),
        "add": (aten.add.Tensor, (g, g), {}),
        "repeat with size": (aten.repeat_interleave.Tensor, (idx,), {"output_size": 4}),
        "gpu copy": (aten.copy_.default, (g, g), {}),
        "cpu only": (aten.add.Tensor, (host, host), {}),
    }
    for name, (func, args, kwargs) in fine.items():
        assert waits_for_gpu(func, args, kwargs, on_gpu=on_gpu) is None, name


def test_without_cuda_capture_says_so_first():
    """A CPU tensor on a machine without CUDA was answered with "move it to cuda"; capture_graph raised
    torch's raw "Found no NVIDIA driver" from deep inside."""
    from simulation import SimulatedBackend

    from cgutils.errors import NoCudaError
    no_gpu = SimulatedBackend()
    no_gpu.available = lambda: False
    with pytest.raises(NoCudaError, match="GraphRunner needs a CUDA device"):
        cg.GraphRunner(torch.nn.Linear(2, 2), backend=no_gpu)(torch.ones(1, 2))
    if not torch.cuda.is_available():
        with pytest.raises(NoCudaError, match="capture_graph needs a CUDA device"):
            cg.capture_graph(lambda: None, warmup=1)


def test_stop_token_decoder_warns_about_a_model_in_training_mode():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2))  # train() by default
    with pytest.warns(UserWarning, match="training mode"):
        StopTokenDecoder(model, 1, loop="eager")


def test_a_failed_capture_shows_our_own_error_not_its_consequence():
    """Ending a capture after a body's sync was refused raises "operation failed due to a previous error during
    capture", with the refusal as its context; capture_graph showed the consequence (H200) and must show ours."""
    from cgutils.errors import first_cgutils_error

    ours = InputError("a conditional node's body made the host wait for the GPU")
    try:
        try:
            raise ours
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as consequence:
        assert first_cgutils_error(consequence) is ours
    assert first_cgutils_error(RuntimeError("no error of ours")) is None
    top = cg.CaptureError("raised as it is")
    assert first_cgutils_error(top) is top


def test_an_eager_only_sync_is_allowed_in_a_body_and_nests():
    from cgutils.diagnose import eager_only_sync, in_eager_only_sync

    assert not in_eager_only_sync()
    with eager_only_sync():
        with eager_only_sync():
            assert in_eager_only_sync()
        assert in_eager_only_sync()
    assert not in_eager_only_sync()


def test_random_draws_are_recognised_on_cuda_only():
    from cgutils.capture.bodysync import draws_random

    aten = torch.ops.aten
    assert draws_random(aten.randn.default, ([3],), {"device": torch.device("cuda")})
    assert not draws_random(aten.randn.default, ([3],), {"device": torch.device("cpu")})
    cpu = torch.zeros(3)
    assert not draws_random(aten.normal_.default, (cpu,), {})
    assert not draws_random(aten.add.Tensor, (cpu, cpu), {})
    # a CPU body may draw (the eager loop draws afresh each time): nothing to refuse
    cond = torch.ones(1, dtype=torch.bool)
    seen = []
    cg.while_node(cond, lambda: (seen.append(torch.rand(1)), cond.fill_(len(seen) < 3)), max_iters=5)
    assert len(seen) == 3 and len({float(s) for s in seen}) == 3


def test_attention_and_dropout_draw_only_with_dropout_on():
    """scaled_dot_product_attention is tagged as seeded whatever its dropout_p: GPT-2's decode step (dropout_p=0)
    was refused as drawing random numbers inside StopTokenDecoder's WHILE body (H200)."""
    from cgutils.capture.bodysync import draws_random

    aten = torch.ops.aten
    q = torch.zeros(1, 1, 2, 4)
    cuda = torch.device("cuda")
    assert not draws_random(aten._scaled_dot_product_efficient_attention.default, (q, q, q, None, False, 0.0),
                            {"device": cuda})
    # as the dispatcher passes it: arguments left at their default (dropout_p=0.0) are not in args (H200)
    assert not draws_random(aten._scaled_dot_product_efficient_attention.default, (q, q, q, None, False),
                            {"device": cuda})
    assert draws_random(aten._scaled_dot_product_efficient_attention.default, (q, q, q, None, False, 0.1),
                        {"device": cuda})
    assert not draws_random(aten.native_dropout.default, (q, 0.5, False), {"device": cuda})
    assert not draws_random(aten.native_dropout.default, (q, 0.0, True), {"device": cuda})
    assert draws_random(aten.native_dropout.default, (q, 0.5, True), {"device": cuda})
    assert draws_random(aten.bernoulli_.float, (q, 0.0), {"device": cuda})  # p is a probability, not dropout
