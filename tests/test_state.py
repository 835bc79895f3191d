"""Functions with state: in-place updates of inputs and module buffers, attributes rebound in forward,
Python values changed in forward. GraphRunner must leave what the caller sees as K eager calls would
(CPU; replays simulated by tests/simulation.py, which shares module buffers as a real graph does)."""

import warnings

import pytest
import torch

import cgutils as cg
from cgutils.pitfalls.outside import run_in_threads


class Normalise(torch.nn.Module):
    """The image model of a real bug report: its first step normalises the input in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor(0.5))
        self.register_buffer("std", torch.tensor(2.0))

    def forward(self, img):
        img.sub_(self.mean).div_(self.std)
        return img * 3


class Counter(torch.nn.Module):
    """A decode step in miniature: a position held in a CUDA tensor, advanced in place every call, and a
    cache written at that position."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pos", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(8))

    def forward(self, x):
        self.cache.index_copy_(0, self.pos.view(1), x.sum().view(1))
        self.pos.add_(1)
        return self.cache * 1


def test_an_input_normalised_in_place_equals_eager_including_the_callers_tensor(simulated):
    """GraphRunner blamed "randomness such as dropout or a CPU value" (warm-ups normalised the static
    input four times), and a replay changed only the static buffer, never the caller's tensor."""
    model = Normalise()
    runner = cg.GraphRunner(model, backend=simulated)
    for i in range(3):
        x = torch.randn(2, 4)
        mine, theirs = x.clone(), x.clone()
        with pytest.warns(UserWarning, match="updates img in place") if i == 0 else warnings.catch_warnings():
            got = runner(mine)
        torch.testing.assert_close(got, model(theirs))
        torch.testing.assert_close(mine, theirs)  # the caller's tensor changed as eager changes it


@pytest.mark.parametrize("validate", [True, False])
def test_a_stateful_step_called_k_times_leaves_the_state_of_k_eager_calls(simulated, validate):
    """Warm-up (3 calls) and validation advanced the position 5 times on the first call, so the cache was
    written at the wrong places from then on."""
    graphed, eager = Counter(), Counter()
    runner = cg.GraphRunner(graphed, validate=validate, backend=simulated)
    for k in range(5):
        x = torch.full((3,), float(k + 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = runner(x)
        torch.testing.assert_close(got, eager(x))
        assert int(graphed.pos) == int(eager.pos) == k + 1
    torch.testing.assert_close(graphed.cache, eager.cache)
    assert runner.stats.captures == 1 and runner.stats.replays == 4  # the first call was the one eager call


def test_buckets_with_an_in_place_update_are_refused_by_name(simulated):
    """Padding writes the padded positions into the state (a cache) that eager never writes: a clear error
    naming the tensor instead of a padding check that blames the attention mask."""
    runner = cg.GraphRunner(Counter(), buckets={0: (4,)}, backend=simulated)
    with pytest.raises(cg.InputError, match=r"updates Counter\.pos, Counter\.cache in place"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner(torch.ones(3))


class Keeps(torch.nn.Module):
    """Keeps features for later, as users do to read an intermediate result, and counts calls in Python."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.hidden = x * 2
        self.calls += 1
        return self.hidden + 1


def test_attributes_rebound_in_forward_are_named(simulated):
    """After a replay, model.hidden held the tensor from capture time (or from a validation call), and
    nothing said so. (That it follows each replay needs a real graph: tests/test_gpu.py.)"""
    model = Keeps()
    runner = cg.GraphRunner(model, backend=simulated)
    with pytest.warns(UserWarning) as record:  # no match=: pytest would re-emit the other warning
        runner(torch.ones(3))
    messages = [str(w.message) for w in record]
    assert any("rebinds Keeps.hidden" in m for m in messages)
    assert any("Keeps.calls" in m and "holds no tensor" in m for m in messages)


def test_a_runner_shared_by_threads_gives_each_call_its_own_result(simulated):
    """Copy-in, replay and copy-out of one call were not kept together: another thread's copy-in could land
    between them, and the result belonged to the other thread's input."""
    runner = cg.GraphRunner(lambda x: x * 2, backend=simulated)
    runner(torch.zeros(4))
    wrong = []

    def worker(t):
        for i in range(50):
            x = torch.full((4,), float(t * 1000 + i))
            if not torch.equal(runner(x), x * 2):
                wrong.append((t, i))

    run_in_threads(worker)
    assert wrong == [] and runner.stats.replays == 8 * 50 + 1


def test_many_shapes_warn_with_numbers(simulated):
    """24 sequence lengths gave 24 graphs silently; CUDAGraph Trees warns after 8."""
    runner = cg.GraphRunner(lambda x: x + 1, backend=simulated)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for n in range(1, 13):
            runner(torch.ones(n))
    hits = [str(w.message) for w in record if "graphs captured" in str(w.message)]
    assert len(hits) == 1 and "9 graphs captured" in hits[0] and "MiB" in hits[0] and "buckets" in hits[0]


_GLOBAL_STEP = Counter()


def _quiet(runner, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return runner(*args)


def test_state_reached_through_a_global_a_partial_or_an_object_is_watched(simulated):
    """Only the module itself, a bound method's module and closure cells were watched: a module reached
    through a global (the README's "model via a lambda" at module scope), a functools.partial or a plain
    object's method advanced its position once per warm-up and validation call."""
    import functools

    class Holder:
        def __init__(self):
            self.model = Counter()

        def step(self, x):
            return self.model(x)

    def step(x, buf):
        buf.add_(1)
        return x + buf

    holder, buf = Holder(), torch.zeros(())
    cases = [(lambda x: _GLOBAL_STEP(x), lambda: _GLOBAL_STEP.pos), (functools.partial(step, buf=buf), lambda: buf),
             (holder.step, lambda: holder.model.pos)]
    for fn, pos in cases:
        start = int(pos())
        runner = cg.GraphRunner(fn, backend=simulated)
        for _ in range(3):
            _quiet(runner, torch.zeros(1))
        assert int(pos()) - start == 3


def test_an_input_updated_in_place_under_inference_mode_is_seen(simulated):
    """Inference tensors keep no version counter, so an input normalised in place under
    torch.inference_mode() went unnoticed: wrong output, caller's tensor unchanged."""
    model = Normalise()
    runner = cg.GraphRunner(model, backend=simulated)
    with torch.inference_mode():
        for _ in range(2):
            x = torch.full((2,), 4.0)
            mine, theirs = x.clone(), x.clone()
            got = _quiet(runner, mine)
            torch.testing.assert_close(got, model(theirs))
            torch.testing.assert_close(mine, theirs)


def test_a_buffer_rebound_out_of_place_is_refused_by_name(simulated):
    """`self.pos = self.pos + 1` replaces the buffer: a replay reads and writes the captured addresses,
    so the position would never move. It got no warning, then a baked_value error about dropout."""
    class Rebinds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("pos", torch.zeros(()))

        def forward(self, x):
            self.pos = self.pos + 1
            return x + self.pos

    with pytest.raises(cg.InputError, match=r"rebinds Rebinds\.pos to a new tensor.*add_"):
        _quiet(cg.GraphRunner(Rebinds(), backend=simulated), torch.zeros(1))


def test_an_input_updated_in_place_that_shares_memory_with_another_is_refused(simulated):
    """f(a, b) = a.add_(1) + b called as runner(x, x): each argument got its own static buffer, so the
    update did not reach b and the result was 1 where eager gives 2, silently."""
    def f(a, b):
        a.add_(1)
        return a + b

    runner = cg.GraphRunner(f, backend=simulated)
    x = torch.zeros(1)
    with pytest.raises(cg.InputError, match="updates a in place, and b shares its memory"):
        _quiet(runner, x, x)
    _quiet(runner, torch.zeros(1), torch.zeros(1))  # separate tensors: fine
    y = torch.zeros(1)
    with pytest.raises(cg.InputError, match="shares its memory"):
        _quiet(runner, y, y[:1])


def test_a_failed_validation_leaves_the_state_of_one_call(simulated):
    """A validation failure left the position advanced by every warm-up and the validation call."""
    class Drifts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("pos", torch.zeros(()))
            self.step = 0

        def forward(self, x):
            self.step += 1  # a Python value that a replay cannot follow
            self.pos.add_(self.step)
            return x + self.pos

    model = Drifts()
    with pytest.raises(cg.CaptureError):
        _quiet(cg.GraphRunner(model, backend=simulated), torch.zeros(1))
    assert int(model.pos) == 1 and model.step == 1  # as one eager call left them


def test_validate_replays_checks_a_stateful_function_from_the_same_state(simulated):
    """validate_replays was skipped for functions with state, without a word."""
    graphed, eager = Counter(), Counter()
    runner = cg.GraphRunner(graphed, validate_replays=10, backend=simulated)
    for k in range(5):
        x = torch.full((3,), float(k))
        torch.testing.assert_close(_quiet(runner, x), eager(x))
    assert int(graphed.pos) == 5 and torch.equal(graphed.cache, eager.cache)
    simulated.graphs[0].replay = lambda: None  # a replay that stops following the state: caught
    with pytest.raises(cg.CaptureError, match="differs from eager"):
        _quiet(runner, torch.ones(3))


def test_warnings_point_at_the_callers_line(simulated):
    """Warnings used fixed stack levels and pointed inside cgutils when capture_buckets called in."""
    runner = cg.GraphRunner(Counter(), backend=simulated)
    with pytest.warns(UserWarning, match="in place") as record:
        runner(torch.zeros(3))
    assert record[0].filename == __file__


def test_a_runner_first_called_under_inference_mode_works_outside_it(simulated):
    """The static input buffers were made under torch.inference_mode() on the first call, so a later call
    outside it failed to copy into them ("Inplace update to inference tensor outside InferenceMode")."""
    runner = cg.GraphRunner(lambda x: x * 2, backend=simulated)
    with torch.inference_mode():
        runner(torch.ones(3))
    torch.testing.assert_close(runner(torch.full((3,), 2.0)), torch.full((3,), 4.0))
