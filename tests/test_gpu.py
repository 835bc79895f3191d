"""GPU tests (``pytest -m gpu``, run on the lent H200): GraphRunner against eager on real workloads."""

import contextlib
import warnings

import pytest
import torch
from torch import nn

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


# --- diagnostics, validation and buckets -------------------------------------------------------------

def _syncs(x):
    a = x.sum().item()
    b = x[x > 0]
    if x.mean() > 0:
        a += 1
    print(x.max())
    return b * a


def test_find_sync_points_names_ops_and_user_lines():
    from cgutils.diagnose import find_sync_points

    x = torch.randn(64, device="cuda")
    df = find_sync_points(_syncs, x)
    first = _syncs.__code__.co_firstlineno
    got = list(zip(df.op, df.line - first))
    assert ("Tensor.item", 1) in got and ("Tensor.__getitem__", 2) in got and ("Tensor.__bool__", 3) in got
    assert any(line == 5 for _, line in got)  # print
    assert set(df.file) == {__file__}
    assert len(find_sync_points(lambda t: t * 2, x)) == 0


def test_capture_error_carries_sync_points():
    x = torch.randn(64, device="cuda")
    with pytest.raises(cg.CaptureError) as err:
        cg.GraphRunner(_syncs)(x)
    e = err.value
    assert e.cause == "sync" and e.sync_points is not None and len(e.sync_points) >= 4
    assert e.sync_points.line.iloc[0] == _syncs.__code__.co_firstlineno + 1
    assert "Tensor.item" in str(e) and "test_gpu.py" in str(e)


def _bert(dtype="fp32"):
    return WORKLOADS["bert-base-seq128"].build(dtype, "cuda")


def test_buckets_pad_mask_and_slice_outputs():
    built = _bert()
    runner = cg.GraphRunner(built.model, buckets={1: (64, 128)})
    for n in (100, 120):
        ids = torch.randint(0, 30000, (1, n), device="cuda")
        mask = torch.ones_like(ids)
        got = runner(input_ids=ids, attention_mask=mask)
        with torch.no_grad():
            want = built.model(input_ids=ids, attention_mask=mask)
        assert got.last_hidden_state.shape == (1, n, 768)
        assert cg.max_rel_error(got.last_hidden_state, want.last_hidden_state) <= 1e-3
    assert runner.stats.captures == 1 and "(1, 128)" in runner.stats.graphs[0].signature


def test_padding_without_mask_is_caught():
    built = _bert()
    runner = cg.GraphRunner(built.model, buckets={1: (128,)})
    ids = torch.randint(0, 30000, (1, 100), device="cuda")
    with pytest.raises(cg.CaptureError) as err:
        runner(input_ids=ids)  # no attention mask: real tokens attend to the padding
    assert err.value.cause == "padding"


def test_eager_fallback_above_largest_bucket():
    built = _bert()
    runner = cg.GraphRunner(built.model, buckets={1: (64,)})
    ids = torch.randint(0, 30000, (1, 80), device="cuda")
    mask = torch.ones_like(ids)
    with pytest.warns(UserWarning, match="largest bucket"):
        got = runner(input_ids=ids, attention_mask=mask)
    runner(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        want = built.model(input_ids=ids, attention_mask=mask)
    assert runner.stats.fallbacks == 2 and runner.stats.captures == 0
    assert cg.max_rel_error(got.last_hidden_state, want.last_hidden_state) <= 1e-5


def test_capture_buckets_largest_first_shares_the_pool():
    built = _bert("fp16")
    runner = cg.GraphRunner(built.model, buckets={1: (64, 128, 256)})
    ids = torch.randint(0, 30000, (1, 100), device="cuda")
    st = runner.capture_buckets(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert st.captures == 3 and "(1, 256)" in st.graphs[0].signature and "(1, 64)" in st.graphs[-1].signature
    # later, smaller graphs reuse the pool the largest one grew
    assert st.graphs[1].pool_bytes + st.graphs[2].pool_bytes < st.graphs[0].pool_bytes


def test_validate_replays_catches_a_changed_python_value():
    from cgutils.pitfalls import Scaled

    model = Scaled(2.0)
    runner = cg.GraphRunner(model, validate_replays=3)
    x = torch.randn(8, device="cuda")
    runner(x)
    runner(x)
    model.scale = 5.0
    with pytest.raises(cg.CaptureError) as err:
        runner(x)
    assert err.value.cause == "baked_value"


def test_graph_runner_compile_option_matches_eager():
    built = _bert("fp16")
    runner = cg.GraphRunner(built.step, compile=True)
    args = built.inputs(0)
    with torch.no_grad():
        want = built.step(*args)
    assert cg.max_rel_error(runner(*args), want) <= 1e-2


def test_fused_graph_decoder_matches_transformers_fp32():
    from transformers import GPT2Config, GPT2LMHeadModel

    from cgutils.generation import GreedyDecoder, hf_generate

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda().eval()
    prompt = torch.randint(0, 50257, (1, 16), device="cuda")
    got = GreedyDecoder(model, "graph", fuse=True).generate(prompt, 40)
    assert torch.equal(got, hf_generate(model, prompt, 40))


def test_warmups_share_one_side_stream():
    """Each capture warmed up on a new side stream, and the allocator kept those blocks per stream:
    memory_reserved grew ~33 MiB per BERT-base capture although the graph pool did not."""
    import gc

    built = _bert("fp16")
    runner = cg.GraphRunner(built.model)
    gc.collect()
    torch.cuda.empty_cache()
    for i, n in enumerate((512, 448, 384, 320)):
        ids = torch.randint(0, 30000, (1, n), device="cuda")
        runner(input_ids=ids, attention_mask=torch.ones_like(ids))
        torch.cuda.synchronize()
        if i == 0:
            after_first = torch.cuda.memory_reserved()
    assert torch.cuda.memory_reserved() - after_first < 30 * 2**20


def test_autocast_call_gets_its_own_graph():
    """A graph captured in fp32 replayed for calls under torch.autocast (fp16 expected) and back."""
    lin = torch.nn.Linear(64, 64).cuda().eval()
    runner = cg.GraphRunner(lin)
    x = torch.randn(8, 64, device="cuda")
    assert runner(x).dtype == torch.float32
    with torch.autocast("cuda", dtype=torch.float16):
        half = runner(x)
        with torch.no_grad():
            want = lin(x)
    assert half.dtype == torch.float16 and cg.max_rel_error(half, want) <= 1e-2
    assert runner(x).dtype == torch.float32 and runner.stats.captures == 2


def test_pooled_output_as_wide_as_the_bucket_is_not_cut():
    """BERT with hidden size 256 under a 256 bucket: pooler_output (1, 256) was cut to the caller's length."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    bert = BertModel(BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=512)).cuda().eval()
    runner = cg.GraphRunner(bert, buckets={1: (128, 256)})
    ids = torch.randint(0, 30000, (1, 200), device="cuda")
    mask = torch.ones_like(ids)
    got = runner(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        want = bert(input_ids=ids, attention_mask=mask)
    assert got.last_hidden_state.shape == (1, 200, 256) and got.pooler_output.shape == (1, 256)
    assert cg.max_rel_error(got.pooler_output, want.pooler_output) <= 1e-3


def test_graph_captured_under_autocast_outlives_the_context():
    """With autocast's cast cache on during capture, the graph read cached fp16 weights that are freed
    when the context exits; a later replay (new context, memory reused) read garbage."""
    lin = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)).cuda().eval()
    runner = cg.GraphRunner(lin)
    x = torch.randn(16, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        runner(x)
    junk = [torch.full((256, 256), float("nan"), device="cuda", dtype=torch.float16) for _ in range(64)]
    with torch.autocast("cuda", dtype=torch.float16):
        got = runner(x)
        with torch.no_grad():
            want = lin(x)
    del junk
    assert cg.max_rel_error(got, want) <= 1e-2


# --- real use: threads and streams, state, failed captures, other threads' work ----------------------

def _mlp(width=1024, depth=8):
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    return torch.nn.Sequential(*layers).cuda().eval()


def test_threads_and_streams_each_get_their_own_result():
    """A runner shared by 8 worker threads, each on its own stream: results belonged to other threads'
    inputs (copy-in, replay and copy-out were not kept together, and streams were not ordered)."""
    from cgutils.pitfalls.outside import run_in_threads

    model = _mlp()
    runner = cg.GraphRunner(model)
    runner(torch.randn(4, 1024, device="cuda"))
    wrong, errors = [], []

    def worker(t):
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                for i in range(50):
                    x = torch.randn(4, 1024, device="cuda")
                    got = runner(x)
                    with torch.no_grad():
                        expected = model(x)
                    stream.synchronize()
                    if cg.max_rel_error(got, expected) > 1e-3:
                        wrong.append((t, i))
        except Exception as exc:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(exc)

    run_in_threads(worker)
    assert not errors, errors
    assert wrong == [] and runner.stats.replays == 401


def test_an_input_normalised_in_place_equals_eager_including_the_callers_tensor():
    """The handed example: a CaptureError blaming "randomness such as dropout or a CPU value"."""
    from test_state import Normalise

    model = Normalise().cuda()
    runner = cg.GraphRunner(model)
    for i in range(3):
        x = torch.randn(2, 3, 8, 8, device="cuda")
        mine, theirs = x.clone(), x.clone()
        got = runner(mine)
        with torch.no_grad():
            expected = model(theirs)
        assert torch.equal(got, expected) and torch.equal(mine, theirs), f"call {i}"


class _Step(torch.nn.Module):
    """A decode step in miniature: a device position counter and a cache written in place at it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pos", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(16, 8))
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        self.cache.index_copy_(0, self.pos.view(1), self.proj(x))
        self.pos.add_(1)
        return self.cache.sum(0)


@pytest.mark.parametrize("validate", [True, False])
def test_a_stateful_step_called_k_times_leaves_the_state_of_k_eager_calls(validate):
    graphed, eager = _Step().cuda(), _Step().cuda()
    eager.load_state_dict(graphed.state_dict())
    runner = cg.GraphRunner(graphed, validate=validate)
    for _ in range(7):
        x = torch.randn(1, 8, device="cuda")
        got = runner(x)
        with torch.no_grad():
            expected = eager(x)
        torch.testing.assert_close(got, expected)
    assert int(graphed.pos) == int(eager.pos) == 7
    torch.testing.assert_close(graphed.cache, eager.cache)


def test_a_failed_capture_leaves_the_stream_rng_and_capture_state_as_they_were():
    """torch.cuda.graph's __exit__ raised inside capture_end before leaving its stream context, so the
    caller stayed on the capture stream (notebook 04's default_stream entry then ran on it)."""
    x = torch.ones(4, device="cuda")
    stream, rng = torch.cuda.current_stream(), torch.cuda.get_rng_state()
    with pytest.raises(cg.CaptureError):
        cg.GraphRunner(lambda t: t * t.sum().item())(x)
    assert torch.cuda.current_stream() == stream and not torch.cuda.is_current_stream_capturing()
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    torch.rand(4, device="cuda")
    assert torch.equal(cg.GraphRunner(lambda t: t * 2)(x), x * 2)


def _background(work):
    """Run ``work()`` in a loop on another thread until the returned stop() is called; returns stop and the
    list of errors that thread met."""
    import threading

    stop, started, errors = threading.Event(), threading.Event(), []

    def loop():
        while not stop.is_set():
            try:
                work()
            except RuntimeError as exc:
                errors.append(exc)
            started.set()

    th = threading.Thread(target=loop, name="prefetch")
    th.start()
    started.wait()

    def halt():
        stop.set()
        th.join()

    return halt, errors


def test_other_threads_cuda_work_does_not_invalidate_capture():
    """A data-prefetch thread pinning batches and copying them on its own stream while the main thread
    captures: in the global capture mode such calls can invalidate the capture."""
    stream, sizes = torch.cuda.Stream(), iter(range(1 << 16, 1 << 30, 4096))

    def prefetch():
        batch = torch.empty(next(sizes), pin_memory=True)  # a new size: a new pinned allocation
        with torch.cuda.stream(stream):
            batch.to("cuda", non_blocking=True)
        stream.synchronize()

    halt, errors = _background(prefetch)
    try:
        model = _mlp(depth=32)
        x = torch.randn(4, 1024, device="cuda")
        got = cg.GraphRunner(model)(x)
    finally:
        halt()
    with torch.no_grad():
        assert cg.max_rel_error(got, model(x)) <= 1e-3
    assert not errors, errors[:1]


def test_a_device_sync_in_another_thread_is_named_by_the_diagnosis():
    """A device-wide sync from another thread broke the capture, and the diagnosis listed that thread's
    torch.cuda.synchronize() as syncs in the user's own function."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # let the other thread run during the capture, as a busy process would
    halt, _ = _background(lambda: torch.cuda.synchronize())  # looked up per call, as code does
    try:
        with pytest.raises(cg.CaptureError) as info:
            cg.GraphRunner(_mlp(depth=64))(torch.randn(4, 1024, device="cuda"))
    finally:
        halt()
        sys.setswitchinterval(old)
    assert info.value.cause == "other_thread" and "'prefetch'" in str(info.value)
    assert len(info.value.sync_points) == 0


class _Keeps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        self.hidden = self.lin(x)
        return self.hidden.relu()


def test_an_attribute_rebound_in_forward_follows_each_replay():
    model = _Keeps().cuda()
    runner = cg.GraphRunner(model)
    with pytest.warns(UserWarning, match=r"rebinds _Keeps\.hidden"):
        runner(torch.randn(2, 8, device="cuda"))
    for _ in range(3):
        x = torch.randn(2, 8, device="cuda")
        runner(x)
        with torch.no_grad():
            torch.testing.assert_close(model.hidden, model.lin(x))


class _Sampler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 100)

    def forward(self, x):
        return torch.multinomial(torch.softmax(self.proj(x), -1), 1)


def test_sampling_in_an_eval_model_validates_and_draws_fresh_samples():
    """torch.multinomial (intended randomness) failed validation as a "baked value", with advice to call
    model.eval() on a model already in eval mode."""
    model = _Sampler().cuda().eval()
    runner = cg.GraphRunner(model)
    x = torch.randn(64, 16, device="cuda")
    torch.cuda.manual_seed(123)
    first = runner(x)
    torch.cuda.manual_seed(123)
    with torch.no_grad():
        assert torch.equal(first, model(x))  # the first call is the one eager call, same generator state
    draws = [runner(x) for _ in range(3)]
    assert not all(torch.equal(d, draws[0]) for d in draws[1:])  # replays draw new samples
    torch.cuda.manual_seed(7)
    replayed = runner(x)
    torch.cuda.manual_seed(7)
    with torch.no_grad():
        assert torch.equal(replayed, model(x))  # a replay draws as eager does from the same state


class _KeepsAndCounts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros((), device="cuda"))

    def forward(self, x):
        self.n.add_(1)
        self.hidden = x + self.n
        return self.hidden * 2


@pytest.mark.parametrize("validate", [True, False])
def test_a_stateful_forward_that_stores_a_tensor_on_self(validate):
    """With validation on, the attribute was bound to the validation call's eager tensor and never followed
    a replay (found by a new-user walkthrough on the CPU simulation)."""
    model, twin = _KeepsAndCounts(), _KeepsAndCounts()
    runner = cg.GraphRunner(model, validate=validate)
    for v in (0.0, 10.0, 20.0):
        x = torch.full((2,), v, device="cuda")
        with pytest.warns(UserWarning) if v == 0.0 else contextlib.nullcontext():
            got = runner(x)
        torch.testing.assert_close(got, twin(x))
        torch.testing.assert_close(model.hidden, twin.hidden)
    assert int(model.n) == int(twin.n) == 3


def test_a_failed_capture_gives_its_pool_memory_back():
    """A capture invalidated by a sync kept its memory pool's reference for ever: the blocks it had taken
    (here 1 GiB) stayed reserved after their tensors were freed, once per failed capture."""
    x = torch.ones(4, device="cuda")

    def f():
        big = torch.ones(256 * 2**20, device="cuda")  # 1 GiB, taken from the capture's pool
        return big[:4] * float(x.sum())  # a sync: invalidates the capture

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    for _ in range(3):
        with pytest.raises(cg.CaptureError):
            cg.capture_graph(f, warmup=1)
        torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - before < 2**30


def test_a_fork_never_joined_is_diagnosed_as_unjoined():
    """CUDA said "capturing stream has unjoined work" and the CaptureError said cause="unforked_stream" and told
    the user to fork, which they had: the rerun read the fork as a join of an unforked stream."""
    side = torch.cuda.Stream()
    x = torch.ones(8, device="cuda")

    def f(x):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
        return y  # never joined back

    stream = torch.cuda.current_stream()
    with pytest.raises(cg.CaptureError) as err:
        cg.GraphRunner(f)(x)
    assert err.value.cause == "unjoined" and "never joined back" in str(err.value)
    assert "side.wait_stream(torch.cuda.current_stream())" in str(err.value)  # the fork's line, named
    assert torch.cuda.current_stream() == stream
    assert cg.GraphRunner(lambda x: x * 3)(x).sum().item() == 24.0


def test_syncs_inside_torchvision_name_its_lines_and_the_callers():
    """For Faster R-CNN the syncs named only the caller's line (`out = runner(...)`): torchvision/ was taken for
    torch/. Then breaks="auto" asserted inside the caching allocator and broke every later capture; then it
    stopped at `self.transform.postprocess(...)` (a submodule's method called from the top-level forward: "no
    break can wrap it"), and ImageList, passed between the submodules, was not buffered."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    m = tv.models.detection.fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone=None,
                                                               box_score_thresh=0.0).eval().cuda()
    images = [torch.rand(3, 320, 320, device="cuda")]
    with torch.no_grad():
        with pytest.raises(cg.CaptureError) as err:
            cg.GraphRunner(m)(images)
        syncs = err.value.sync_points
        lib = syncs[syncs.file.str.contains("torchvision")]
        assert len(lib) and lib.caller.str.contains("test_gpu.py").all()
        assert "torchvision" in str(err.value) and ", from " in str(err.value)
        ref = m(images)
        runner = cg.GraphRunner(m, breaks="auto")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = runner(images)
        # the throw-away captures that found the breaks warned "The CUDA Graph is empty" when abandoned
        assert not [w for w in caught if "Graph is empty" in str(w.message)]
        again = runner(images)  # a replay, not the capture's own run
        pieces = runner.pieces()
        print(pieces.to_string())
        assert "transform.postprocess" in set(pieces.name)
        assert (pieces.kind == "graph").any() and len(ref[0]["boxes"]) > 0
        for got in (out, again):
            assert set(got[0]) == {"boxes", "labels", "scores"}
            assert torch.equal(got[0]["labels"], ref[0]["labels"])
            assert cg.max_rel_error(got[0]["boxes"], ref[0]["boxes"]) < 1e-3
            assert cg.max_rel_error(got[0]["scores"], ref[0]["scores"]) < 1e-3
        x = torch.ones(4, device="cuda")
        assert cg.GraphRunner(lambda x: x * 3)(x).sum().item() == 12.0


def test_auto_breaks_at_a_submodule_method_the_top_level_forward_calls():
    """A sync inside `self.post.finish(...)`, called from the root's forward, ended breaks='auto' with an error."""

    class Post(nn.Module):
        def finish(self, y):
            return y * float(y.abs().sum().item() > 0)  # a host sync, in a method the root calls

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.post, self.out = nn.Linear(8, 8), Post(), nn.Linear(8, 8)

        def forward(self, x):
            return self.out(self.post.finish(self.lin(x)))

    m = Model().cuda().eval()
    x = torch.randn(4, 8, device="cuda")
    with torch.no_grad():
        runner = cg.GraphRunner(m, breaks="auto")
        assert cg.max_rel_error(runner(x), m(x)) < 1e-4
        x2 = torch.randn(4, 8, device="cuda")
        assert cg.max_rel_error(runner(x2), m(x2)) < 1e-4
        assert runner.pieces().name.tolist() == ["piece 0", "post.finish", "piece 1"]
        named = cg.GraphRunner(m, breaks=["post.finish"])
        assert cg.max_rel_error(named(x2), m(x2)) < 1e-4


def test_after_every_failed_capture_kind_the_allocator_and_later_captures_are_intact():
    """Faster R-CNN's failed capture once left the private pool's use count wrong, and the next capture and a
    reduce-overhead compile asserted inside CUDACachingAllocator. After each loud catalogue entry (each way a
    capture fails) and a failed breaks='auto': no memory left allocated, and a plain capture, a GraphRunner and
    torch.compile(mode="reduce-overhead") all work. A process of its own: dynamo and the pools start clean."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import gc, torch, cgutils as cg
        from torch import nn
        from cgutils.pitfalls import PITFALLS, run
        x = torch.randn(4, 8, device="cuda")
        def later_captures_work():
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                (x + 1)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                y = x + 1
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, x + 1)
            assert torch.equal(cg.GraphRunner(lambda t: t * 3)(x), x * 3)
        class Root(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)
            def forward(self, t):
                return self.lin(t) * float(t.sum().item() > 0)  # in the root's own lines: no break fits
        cases = {k: (lambda k=k: run(k)) for k, e in PITFALLS.items() if e.kind == "loud"}
        cases["auto_in_root"] = lambda: cg.GraphRunner(Root().cuda(), breaks="auto")(x)
        def allocated():
            gc.collect()
            torch.cuda.synchronize()
            torch._C._cuda_clearCublasWorkspaces()  # cuBLAS's workspaces are cached per stream, not leaked
            return torch.cuda.memory_allocated()
        leaked = {}
        later_captures_work()
        for key, case in cases.items():
            before = allocated()
            try:
                with torch.no_grad():
                    case()
            except cg.CaptureError:
                pass
            leaked[key] = allocated() - before
            later_captures_work()
            print("ok", key, leaked[key], flush=True)
        lin = nn.Linear(8, 8).cuda()
        f = torch.compile(lin, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):
                out = f(x)
            assert cg.max_rel_error(out, lin(x)) < 1e-3
        later_captures_work()
        print("LEAKED", {k: v for k, v in leaked.items() if v})
        print("ALL OK")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=500)
    print(run.stdout[-4000:])
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stderr[-3000:]
    assert "LEAKED {}" in run.stdout


def test_runner_graphs_survive_reduce_overhead_clearing_cublas_workspaces():
    """Pure PyTorch fault (docs/pytorch-cublas-workspace-fault.md): a graph whose cuBLAS workspace lived in a
    freed graph's pool failed its next replay with an illegal memory access once torch.compile(mode=
    "reduce-overhead") cleared the workspaces. Run in a process of its own: the fault ends the CUDA context."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import gc, torch, cgutils as cg
        from transformers import BertConfig, BertModel
        torch.manual_seed(0)
        def make():
            return BertModel(BertConfig()).eval().cuda().half()
        x = torch.randint(0, 1000, (1, 128), device="cuda")
        with torch.no_grad():
            a = cg.GraphRunner(make())
            a(x)
            del a
            gc.collect()
            m = make()
            b = cg.GraphRunner(m)
            ref = b(x).last_hidden_state
            c = torch.compile(m.forward, mode="reduce-overhead")
            for _ in range(3):
                c(x)
            out = b(x).last_hidden_state
            torch.cuda.synchronize()
            print("OK", cg.max_rel_error(out, ref))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]
    assert float(run.stdout.split("OK")[1]) < 1e-2


def test_cgutils_profiler_sessions_leave_later_replays_unslowed_and_see_every_kernel():
    """Before profiler_session, a cgutils session left CUPTI attached: one replay of this 256-node graph then cost
    ~16x the host time for the rest of the process (benchmarks/profiler_aftereffect.py); and a session begun while
    a teardown was pending saw no kernel at all."""
    import statistics
    import time

    x = torch.zeros(1024, device="cuda")

    def chain():
        for _ in range(256):
            x.add_(1.0)

    graph, _ = cg.capture_graph(chain, warmup=2)

    def replay_host_us():
        samples = []
        for _ in range(200):
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph.replay()
            samples.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(samples)

    before = replay_host_us()
    seen = [cg.gpu_activity(graph.replay)[0] for _ in range(3)]  # back to back
    calls = cg.runtime_calls(graph.replay)
    after = replay_host_us()
    assert seen == [256, 256, 256]
    assert calls.get("cudaGraphLaunch") == 1 and "cudaLaunchKernel" not in calls, calls
    assert after < 2 * before + 2.0, f"replay host µs {before:.1f} before the sessions, {after:.1f} after"
    with warnings.catch_warnings():
        warnings.simplefilter("error", cg.timing.TimingAfterProfilerWarning)
        cg.host_us_per_call(graph.replay, calls=5)


def test_a_cgutils_session_right_after_a_plain_one_still_sees_the_replay(tmp_path):
    """Session 21's recordings: after a plain torch.profiler session (CUPTI left attached), the first torn-down
    session saw nothing: notebook 11's runtime_calls came back empty and notebook 07's trace of a kept graph's
    replay held no graph launch with GPU work. The priming session fixed it (passed on the H200 at 466b1bc)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.zeros(1024, device="cuda")

    def chain():
        for _ in range(64):
            x.add_(1.0)

    def plain():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            chain()
            torch.cuda.synchronize()

    graph, _ = cg.capture_graph(chain, warmup=2)
    plain()
    assert cg.runtime_calls(graph.replay).get("cudaGraphLaunch") == 1
    plain()
    assert cg.gpu_activity(graph.replay)[0] == 64
    plain()
    runner = cg.GraphRunner(lambda t: t * 2 + 1, inspect=True)
    y = torch.randn(64, device="cuda")
    runner(y)
    trace = cg.load_trace(cg.profile(lambda: runner(y), tmp_path / "k.json.gz", warmup=2, active=3))
    links = trace.links()
    assert links[cg.is_graph_launch(links.call)].correlation.nunique() >= 3


def test_a_debug_capture_writes_a_dot_dump_that_counts_its_kernels(tmp_path):
    """capture_graph(debug=True) promised a dump; on torch 2.11 a graph made without keep_graph writes none."""
    x = torch.zeros(16, device="cuda")

    def three():
        for _ in range(3):
            x.add_(1.0)

    graph, _ = cg.capture_graph(three, warmup=1, debug=True)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 3.0))
    path = tmp_path / "g.dot"
    graph.debug_dump(str(path))
    assert path.exists(), "debug_dump wrote nothing"
    assert cg.graph_node_types(path.read_text()).get("KERNEL") == 3


@pytest.mark.parametrize("batch", [1, 3])
def test_the_pdl_fused_step_replayed_in_a_graph_gives_the_same_tokens_every_time(batch):
    """FusedKVState(pdl=True): every kernel launched with Programmatic Dependent Launch, weights loaded before
    griddepcontrol.wait. A wait placed too late would race with the kernel before it; under replay that shows
    as tokens that change from one generation to the next or differ from the reference: at batch 1 the plain
    step's, at batch 3 the fused step's without PDL (benchmarks/decode_floor.py measured both equal on the H200;
    the plain step differs from both fused ones at batch 8 on a near-tie, so it is not the batch-3 reference)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from cgutils.capture.graph import capture_graph
    from cgutils.generation import StaticKVState
    from cgutils.generation.fused_step import FusedKVState, greedy_tokens

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda().half().eval()
    prompt = torch.randint(0, 50257, (batch, 32), device="cuda")

    def replayed(state):
        with torch.no_grad():
            state.prefill(prompt)
        graph, _ = capture_graph(state.decode_step, warmup=2, what="decode step")
        with torch.no_grad():
            return [greedy_tokens(state, prompt, 48, graph.replay) for _ in range(2)]

    if batch == 1:
        with torch.no_grad():
            want = greedy_tokens(StaticKVState(model, batch, 96), prompt, 48)
    else:
        want = replayed(FusedKVState(model, batch, 96))[0]
    first, second = replayed(FusedKVState(model, batch, 96, pdl=True))
    assert torch.equal(first, second), "two generations from the same prompt differ: a race under replay"
    assert torch.equal(first, want), f"first differing position: {(first != want).nonzero()[:1].tolist()}"
