"""GPU tests (``pytest -m gpu``, run on the lent H200): GraphRunner against eager on real workloads."""

import pytest
import torch

import cgutils as cg
from cgutils.workloads import WORKLOADS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_graph_runner_equals_eager(name, dtype):
    built = WORKLOADS[name].build(dtype, "cuda")
    runner = cg.GraphRunner(built.step)
    args = built.inputs(0)
    with torch.no_grad():
        expected = built.step(*args)
    got = runner(*args)
    tol = 1e-2 if dtype == "fp16" else 1e-3
    assert cg.max_rel_error(got, expected) <= tol
    assert runner.stats.captures == 1 and runner.stats.replays == 1


def test_replay_after_new_input_gives_new_answer():
    built = WORKLOADS["bert-base-seq128"].build("fp32", "cuda")
    runner = cg.GraphRunner(built.model)
    ids0, mask = built.inputs(0)
    ids1, _ = built.inputs(1)
    out0 = runner(input_ids=ids0, attention_mask=mask).last_hidden_state
    out1 = runner(input_ids=ids1, attention_mask=mask).last_hidden_state
    with torch.no_grad():
        eager1 = built.model(input_ids=ids1, attention_mask=mask).last_hidden_state
    assert runner.stats.captures == 1 and runner.stats.replays == 2
    assert cg.max_rel_error(out1, eager1) <= 1e-3
    assert not torch.allclose(out0, out1)  # the replay read the new input, not the captured one


def test_nested_model_output_and_static_outputs():
    built = WORKLOADS["bert-base-seq128"].build("fp16", "cuda")
    runner = cg.GraphRunner(built.model, clone_outputs=False)
    ids0, mask = built.inputs(0)
    a = runner(input_ids=ids0, attention_mask=mask)
    first = a.last_hidden_state.clone()
    b = runner(input_ids=built.inputs(1)[0], attention_mask=mask)
    assert type(a).__name__ == "BaseModelOutputWithPoolingAndCrossAttentions"
    # static outputs: the second replay overwrote the tensor the first call returned
    assert a.last_hidden_state.data_ptr() == b.last_hidden_state.data_ptr()
    assert not torch.equal(first, a.last_hidden_state)


def test_memory_stats_are_positive():
    built = WORKLOADS["resnet50"].build("fp32", "cuda")
    runner = cg.GraphRunner(built.step)
    runner(*built.inputs(0))
    g = runner.stats.graphs[0]
    assert g.pool_bytes > 0 and g.static_input_bytes == 1 * 3 * 224 * 224 * 4
    assert g.static_output_bytes == 1000 * 4
    assert runner.stats.memory_bytes == g.pool_bytes + g.static_input_bytes


def test_one_graph_per_shape_shares_the_pool():
    built = WORKLOADS["bert-base-seq128"].build("fp16", "cuda")
    runner = cg.GraphRunner(built.step)
    ids, mask = built.inputs(0)
    runner(ids, mask)
    runner(ids[:, :64].contiguous(), mask[:, :64].contiguous())  # smaller: reuses the pool's blocks
    s = runner.stats
    assert s.captures == 2
    assert s.graphs[1].pool_bytes <= s.graphs[0].pool_bytes


def test_thousand_replays_do_not_grow_memory():
    built = WORKLOADS["bert-base-seq128"].build("fp16", "cuda")
    runner = cg.GraphRunner(built.step)
    args = built.inputs(0)
    runner(*args)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        out = runner(*args)
    del out
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before
    assert runner.stats.replays == 1001


def test_input_errors_on_gpu():
    built = WORKLOADS["bert-base-seq128"].build("fp32", "cuda")
    runner = cg.GraphRunner(built.step)
    ids, mask = built.inputs(0)
    runner(ids, mask)
    with pytest.raises(cg.InputError, match="attention_mask.*dtype"):
        runner(ids, mask.float())
    with pytest.raises(cg.InputError, match="input_ids.*dimensions"):
        runner(ids[0], mask)
    with pytest.raises(cg.InputError, match="input_ids.*cpu"):
        runner(ids.cpu(), mask)


def test_validation_catches_a_baked_in_value():
    x = torch.ones(4, device="cuda")

    def f(t):
        return t * 2 if t.sum() > 0 else t * 3  # Python branch on a tensor value: a sync, baked in

    with pytest.raises(cg.CaptureError):
        cg.GraphRunner(f)(x)


def test_measure_uses_cuda_events():
    x = torch.randn(1024, 1024, device="cuda")
    t = cg.measure(lambda: x @ x, warmup=3, iters=20)
    assert t.clock == "cuda_event" and t.n == 20 and 0 < t.p10_ms <= t.median_ms <= t.p90_ms


def test_failed_capture_leaves_cuda_usable():
    """Regression: a failed capture left the CUDA RNG in capture mode, so torch.randn failed after it."""
    x = torch.ones(4, device="cuda")
    with pytest.raises(cg.CaptureError) as info:
        cg.GraphRunner(lambda t: t * t.sum().item())(x)  # .item() syncs: illegal during capture
    assert info.value.original is not None and ".item()" in info.value.explanation
    torch.randn(8, device="cuda")  # raised "Offset increment outside graph capture" before the fix
    assert torch.equal(cg.GraphRunner(lambda t: t * 2)(x), x * 2)


def test_pool_bytes_counts_only_this_pool():
    pool = torch.cuda.graph_pool_handle()
    runner = cg.GraphRunner(torch.nn.Linear(1024, 1024).cuda().eval(), pool=pool)
    before = cg.capture.pool_reserved_bytes(pool)
    runner(torch.randn(64, 1024, device="cuda"))
    assert before == 0 and cg.capture.pool_reserved_bytes(pool) == runner.stats.graphs[0].pool_bytes > 0


def test_graph_methods_memory_is_not_negative():
    """Regression: torch._dynamo.reset() ran inside the measured window and freed the previous
    method's graph pool, so GraphRunner(torch.compile(fn)) reported negative extra memory."""
    from cgutils.bench import graph_methods_table

    df = graph_methods_table(["resnet50"], methods=["compile_ro", "graph_runner_compiled"], iters=5, progress=False)
    assert (df.status == "ok").all() and (df.extra_reserved_bytes >= 0).all()
