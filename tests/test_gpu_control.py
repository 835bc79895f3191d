"""GPU tests (``pytest -m gpu``) for WHILE/IF conditional nodes inside torch captures and GraphRunner, and
for StopTokenDecoder's one launch per sequence."""

import pytest
import torch
from torch import nn

import cgutils as cg
from cgutils.errors import InputError

pytestmark = pytest.mark.gpu
pytest.importorskip("cuda.bindings")


def _graph(fn):
    """Capture ``fn(pool)`` in a plain torch capture after one eager warm-up call."""
    g, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(None)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g, pool=pool):
        fn(pool)
    return g


def test_while_node_repeats_the_body_until_the_condition_clears():
    x = torch.zeros(1, device="cuda")
    n = torch.tensor([10.0], device="cuda")
    cond = torch.ones(1, dtype=torch.bool, device="cuda")
    held = {}

    def fn(pool):
        x.zero_()
        cond.copy_(x < n)

        def body():
            x.add_(1)
            cond.copy_(x < n)

        held["count"] = cg.while_node(cond, body, max_iters=1000, pool=pool)

    g = _graph(fn)
    for target in (10, 1000 - 3, 0, 37):
        n.fill_(target)
        g.replay()
        torch.cuda.synchronize()
        assert int(x) == target and int(held["count"]) == target


def test_while_node_body_with_temporaries_equals_eager():
    torch.manual_seed(0)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16) / 8
    state = torch.randn(64, 8, device="cuda", dtype=torch.bfloat16)
    start = state.clone()
    i = torch.zeros(1, dtype=torch.int64, device="cuda")
    cond = torch.ones(1, dtype=torch.bool, device="cuda")

    def fn(pool):
        state.copy_(start)
        i.zero_()
        cond.fill_(True)

        def body():
            state.copy_(torch.tanh(w @ state) + 0.5 * state)  # temporaries from the capture's pool
            i.add_(1)
            cond.copy_(i < 100)

        cg.while_node(cond, body, max_iters=1000, pool=pool)

    g = _graph(fn)
    state.zero_()
    g.replay()
    torch.cuda.synchronize()
    expected = start.clone()
    for _ in range(100):
        expected = torch.tanh(w @ expected) + 0.5 * expected
    assert torch.equal(state, expected)


def test_max_iters_stops_a_loop_whose_condition_never_clears():
    x = torch.zeros(1, device="cuda")
    cond = torch.ones(1, dtype=torch.int32, device="cuda")

    def fn(pool):
        x.zero_()
        cg.while_node(cond, lambda: x.add_(1), max_iters=7, pool=pool)

    g = _graph(fn)
    g.replay()
    torch.cuda.synchronize()
    assert int(x) == 7


def test_if_node_runs_only_the_chosen_branch():
    pred = torch.ones(1, dtype=torch.bool, device="cuda")
    a, b = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")

    def fn(pool):
        cg.if_node(pred, lambda: a.add_(1), lambda: b.add_(1), pool=pool)

    g = _graph(fn)
    a.zero_(), b.zero_()
    for p in (True, False, False, True, True):
        pred.fill_(p)
        g.replay()
    torch.cuda.synchronize()
    assert (int(a), int(b)) == (3, 2)


def test_a_plain_capture_without_the_pool_is_told_how():
    if hasattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph"):
        pytest.skip("torch >= 2.14 finds the capturing graph itself")
    cond = torch.ones(1, dtype=torch.bool, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(InputError, match="graph_pool_handle"):
        with torch.cuda.graph(g):
            cg.while_node(cond, lambda: None, max_iters=1)
    torch.randn(3, device="cuda")  # the caller's state is usable


class Collatz(nn.Module):
    """Steps of the Collatz map until 1: how many depends on the data, so only a device loop can graph it."""

    def forward(self, n):
        n = n.clone()
        steps = torch.zeros_like(n)
        cond = (n != 1).any().reshape(1)

        def body():
            odd = n % 2 == 1
            live = n != 1
            n.copy_(torch.where(live, torch.where(odd, 3 * n + 1, n // 2), n))
            steps.add_(live.long())
            cond.copy_((n != 1).any().reshape(1))

        cg.while_node(cond, body, max_iters=1000)
        return steps


def test_while_node_inside_graph_runner_is_validated_and_follows_the_data():
    runner = cg.GraphRunner(Collatz())
    for values, expected in (([6, 7, 1], [8, 16, 0]), ([27, 2, 3], [111, 1, 7])):
        out = runner(torch.tensor(values, device="cuda"))
        assert out.tolist() == expected
    assert len(runner.stats.graphs) == 1 and runner.stats.replays >= 1


def test_a_body_that_syncs_is_refused_before_capture():
    """Under capture, a syncing body failed on the body stream and the process crashed at the end of the
    capture (torch 2.11): the eager warm-up now refuses it first."""
    cond = torch.ones(1, dtype=torch.bool, device="cuda")

    def bad(x):
        c = cond.clone()
        cg.while_node(c, lambda: c.fill_(bool(x.sum() > 5)), max_iters=3)
        return x + 1

    stream = torch.cuda.current_stream()
    with pytest.raises(InputError, match="wait for the GPU"):
        cg.GraphRunner(bad)(torch.zeros(1, device="cuda"))
    assert torch.cuda.current_stream() == stream and torch.cuda.get_sync_debug_mode() == 0
    assert cg.GraphRunner(lambda x: x * 2)(torch.ones(1, device="cuda")).item() == 2.0


def test_stop_token_decoder_one_launch_per_sequence_equals_transformers(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from cgutils.generation.until_eos import StopTokenDecoder, hf_generate_until_eos
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4)).cuda().eval()
    prompt = torch.randint(0, model.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(6)).cuda()
    free = cg.hf_generate(model, prompt, 20)[0, 6:].tolist()
    step = next(i for i in range(3, 20) if free[i] not in free[:i])
    eos = free[step]
    expected = hf_generate_until_eos(model, prompt, 20, eos)
    for loop in ("device", "host", "eager"):
        dec = StopTokenDecoder(model, eos, loop=loop)
        got = dec.generate(prompt, 20)
        assert torch.equal(got, expected), loop
    dec = StopTokenDecoder(model, eos, loop="device")
    dec.generate(prompt, 20)
    path = cg.profile(lambda: dec.generate(prompt, 20), tmp_path / "seq.json.gz", warmup=1, active=1)
    links = cg.load_trace(path).links()
    assert links[links.call.str.contains("GraphLaunch")].correlation.nunique() == 1


def test_nested_while_nodes_are_captured():
    """A while_node inside another's body reused the one body stream, which was already capturing."""
    total = torch.zeros(1, device="cuda")
    i = torch.zeros(1, device="cuda")
    outer, inner = torch.ones(1, dtype=torch.bool, device="cuda"), torch.ones(1, dtype=torch.bool, device="cuda")

    def fn(pool):
        total.zero_(), i.zero_(), outer.fill_(True)

        def inner_body():
            total.add_(1)
            inner.copy_(total % 3 != 0)

        def outer_body():
            inner.fill_(True)
            cg.while_node(inner, inner_body, max_iters=10, pool=pool)
            i.add_(1)
            outer.copy_(i < 4)

        cg.while_node(outer, outer_body, max_iters=10, pool=pool)

    g = _graph(fn)
    total.fill_(-1)
    g.replay()
    torch.cuda.synchronize()
    assert (int(total), int(i)) == (12, 4)


def test_a_syncing_branch_the_warm_up_never_took_is_refused_at_capture():
    """The warm-up's sync check saw only the branch it ran; the other branch's sync reached the capture
    and crashed the process."""
    x = torch.ones(4, device="cuda")
    pred = torch.zeros(1, dtype=torch.bool, device="cuda")

    def f(x):
        y = x * 2
        cg.if_node(pred, lambda: y.fill_(float(y.sum().item())))  # never taken while warming up
        return y

    stream = torch.cuda.current_stream()
    # the body's own InputError, not the "previous error during capture" that ending the capture raised after it
    with pytest.raises(InputError, match="wait for the GPU"):
        cg.GraphRunner(f)(x)
    assert torch.cuda.current_stream() == stream
    assert cg.GraphRunner(lambda x: x * 3)(x).sum().item() == 12.0


def test_two_threads_capture_conditional_nodes_at_once():
    import threading

    results, errors = {}, []

    def work(k):
        try:
            x = torch.zeros(1, device="cuda")
            n = torch.tensor([float(10 * (k + 1))], device="cuda")

            def f(x):
                x = x.clone()
                cond = (x < n).reshape(1)

                def body():
                    x.add_(1)
                    cond.copy_(x < n)

                cg.while_node(cond, body, max_iters=1000)
                return x

            runner = cg.GraphRunner(f)
            results[k] = [float(runner(x)) for _ in range(3)]
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {0: [10.0] * 3, 1: [20.0] * 3}


def test_a_wrong_pool_is_named_before_the_graph_is_touched():
    cond = torch.ones(1, dtype=torch.bool, device="cuda")
    g, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    other = torch.cuda.graph_pool_handle()
    with pytest.raises(InputError, match="is not the memory pool"):
        with torch.cuda.graph(g, pool=pool):
            cg.while_node(cond, lambda: None, max_iters=1, pool=other)
    torch.randn(3, device="cuda")


def test_a_break_inside_a_conditional_body_is_refused():
    class Guard(nn.Module):
        def forward(self, x):
            return x

    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.guard = Guard()

        def forward(self, x):
            x = x.clone()
            cond = (x < 3).any().reshape(1)

            def body():
                x.copy_(self.guard(x + 1))
                cond.copy_((x < 3).any().reshape(1))

            cg.while_node(cond, body, max_iters=10)
            return x

    with pytest.raises(cg.CaptureError, match="inside the body"):
        cg.GraphRunner(Loop(), breaks=["guard"])(torch.zeros(2, device="cuda"))


def test_a_loop_test_that_syncs_is_listed_once():
    """The failing line of a Python loop synced once per iteration in the eager rerun, and every one of those
    lines was printed and marked "capture failed here"."""
    def halve(x):
        x = x.clone()
        while (x >= 1).any():
            x = torch.where(x >= 1, x / 2, x)
        return x

    with pytest.raises(cg.CaptureError) as info:
        cg.GraphRunner(halve)(torch.full((4,), 100.0, device="cuda"))
    assert str(info.value).count("capture failed here") == 1
    assert "(x" in str(info.value)  # the count of its syncs


def test_syncs_inside_kernels_and_host_copies_are_refused_in_a_body():
    x = torch.randn(8, device="cuda")
    cond = torch.ones(1, dtype=torch.bool, device="cuda")
    pinned = torch.empty(8).pin_memory()
    for bad in (lambda: x[x > 0].sum(), lambda: torch.equal(x, x), lambda: x.copy_(torch.ones(8))):
        with pytest.raises(InputError, match="wait for the GPU"):
            cg.while_node(cond.clone(), bad, max_iters=1)
    c = cond.clone()
    cg.while_node(c, lambda: (pinned.copy_(x, non_blocking=True), c.fill_(False)), max_iters=1)  # asynchronous


def test_the_eager_loops_reading_their_condition_are_not_listed_as_syncs():
    """find_sync_points listed the eager if_node's read of its predicate as a sync at the caller's line; under
    capture the GPU reads it, so the diagnosis of a failed capture pointed at a line that was fine."""
    x = torch.ones(4, device="cuda")
    pred = torch.ones(1, dtype=torch.bool, device="cuda")
    cond = torch.ones(1, dtype=torch.bool, device="cuda")

    def f():
        y = x * 2
        cg.if_node(pred, lambda: y.mul_(3))
        cg.while_node(cond, lambda: cond.fill_(False), max_iters=4)
        return y

    assert len(cg.find_sync_points(f)) == 0

    def g():
        f()
        return x.sum().item()

    assert [r.op for r in cg.find_sync_points(g).itertuples()] == ["Tensor.item"]


def test_random_draws_in_a_while_body_repeat_under_capture_so_they_are_refused(monkeypatch):
    """Shown first with the check switched off: inside one replay, every iteration of a WHILE body draws the
    same numbers (one captured Philox offset), while the eager loop draws afresh. So the check refuses them."""
    from cgutils.capture import bodysync

    rows = torch.zeros(3, 4, device="cuda")
    step = torch.zeros(1, dtype=torch.int64, device="cuda")
    cond = torch.ones(1, dtype=torch.bool, device="cuda")

    def body():
        rows.copy_(torch.cat([rows[1:], torch.rand(1, 4, device="cuda")]))
        step.add_(1)
        cond.copy_(step < 3)

    def f():
        step.zero_()
        cond.fill_(True)
        cg.while_node(cond, body, max_iters=10, pool=pool)

    pool = torch.cuda.graph_pool_handle()
    with monkeypatch.context() as m:
        m.setattr(bodysync, "draws_random", lambda *a: False)
        f()  # eager: three different rows
        assert not torch.equal(rows[0], rows[1])
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            f()
        rows.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert int(step) == 3 and torch.equal(rows[0], rows[1]) and torch.equal(rows[1], rows[2])
        del g

    x = torch.ones(4, device="cuda")
    stream = torch.cuda.current_stream()

    def noisy(x):
        c = torch.ones(1, dtype=torch.bool, device="cuda")
        cg.while_node(c, lambda: (x.add_(torch.randn_like(x)), c.fill_(False)), max_iters=3)
        return x * 1

    with pytest.raises(InputError, match="draws random numbers"):
        cg.GraphRunner(noisy)(x.clone())
    assert torch.cuda.current_stream() == stream
    p = torch.ones(1, dtype=torch.bool, device="cuda")
    cg.if_node(p, lambda: x.add_(torch.randn_like(x)))  # an IF body runs once per replay: allowed


_NESTINGS = ["while_while_if", "while_while_ifelse", "while_while_while", "while_if", "if_while", "while_while_plain",
             "raise_midway"]


@pytest.mark.parametrize("case", _NESTINGS)
def test_every_nesting_equals_the_python_loop_in_a_process_of_its_own(case):
    """A WHILE inside a WHILE with an IF around the emitting step (a transducer's greedy decoder) was reported to
    kill the process with SIGSEGV inside cuStreamBeginCaptureToGraph. Each nesting up to three deep, and a body
    that raises while it is captured, runs here in its own process, by a plain capture and by GraphRunner."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent / "gpu_cases" / "nesting.py"
    run = subprocess.run([sys.executable, str(script), case, "both"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{case}: rc {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert run.stdout.count("EQUAL") == 2 and "DIFFERENT" not in run.stdout, run.stdout
    if case == "raise_midway":  # the process lives on (it died with SIGSEGV before 2c7e250) and captures again
        assert "raised CaptureError" in run.stdout, run.stdout


def test_a_body_that_raises_two_levels_down_is_named_in_the_error():
    """GraphRunner's error named torch's 'operation failed due to a previous error during capture' (capture_end
    on the invalidated capture), the body's own error only in __context__ (H200, 2c7e250)."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent / "gpu_cases" / "nesting.py"
    run = subprocess.run([sys.executable, str(script), "raise_midway", "runner"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "a body that fails" in run.stdout, run.stdout
