"""Weights replaced after capture (issue 23): the runner sees it before the next replay, captures again and
says so; weights loaded in place need no capture. CPU: the watch itself, and GraphRunner on the simulation
whose replays read the tensors held at capture (tests/simulation.py)."""

import warnings

import pytest
import torch
from torch import nn

import cgutils as cg
from cgutils.capture.weights import WeightWatch, load_in_place, module_of
from cgutils.errors import InputError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).eval()


def _new_weights(model, seed=1):
    torch.manual_seed(seed)
    return {k: torch.rand_like(v) + 0.5 if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}


ROUTES = {
    "assign=True": lambda m: m.load_state_dict(_new_weights(m), assign=True),
    "setattr parameter": lambda m: setattr(m[0], "weight", nn.Parameter(torch.randn(8, 8))),
    "setattr buffer": lambda m: setattr(m[1], "running_mean", torch.ones(8)),
    "half": lambda m: m.half(),
    "to(float64) of a submodule": lambda m: m[2].to(torch.float64),
    "a submodule replaced": lambda m: m.__setitem__(2, nn.Linear(8, 4)),
    "a buffer added": lambda m: m[0].register_buffer("scale", torch.ones(1)),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_replacement_route_is_seen(route):
    m = _model()
    watch = WeightWatch(m)
    watch.arm()
    assert watch.replaced() == []
    ROUTES[route](m)
    assert watch.replaced(), route


def test_copies_in_place_and_unrelated_events_are_not_replacements():
    m = _model()
    watch = WeightWatch(m)
    watch.arm()
    m.load_state_dict(_new_weights(m))  # copies into the same tensors
    with torch.no_grad():
        m[0].weight.mul_(2)
    other = _model()  # another model's registrations fire the same process-wide hooks
    del other
    assert watch.replaced() == []
    assert watch.seen == cg.capture.weights._events[0]  # settled: the next calls compare one integer


def test_module_of_finds_the_module_behind_methods_and_partials():
    import functools

    m = _model()
    assert module_of(m) is m and module_of(m.forward) is m and module_of(functools.partial(m.forward)) is m
    assert module_of(lambda x: m(x)) is None


@pytest.mark.parametrize("route", ["assign=True", "setattr parameter", "a submodule replaced"])
def test_runner_captures_again_for_replaced_weights(route):
    """Before: every later call replayed the graph with the old weights, silently."""
    from simulation import SimulatedBackend

    m = _model()
    backend = SimulatedBackend(frozen=m)
    runner = cg.GraphRunner(m, backend=backend)
    x = torch.randn(4, 8)
    runner(x)
    runner(x)
    ROUTES[route](m)
    with pytest.warns(UserWarning, match="replaced after capture"):
        out = runner(x)
    torch.testing.assert_close(out, m(x))
    assert runner.stats.captures == 1 and len(backend.graphs) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(runner(x), m(x))  # the new graph replays, no second warning


def test_loading_in_place_keeps_the_graph_and_the_new_weights_take_effect():
    from simulation import SimulatedBackend

    m = _model()
    backend = SimulatedBackend(frozen=m)
    runner = cg.GraphRunner(m, backend=backend)
    x = torch.randn(4, 8)
    runner(x)
    assert runner.load_state_dict(_new_weights(m)) == len(m.state_dict())
    torch.testing.assert_close(runner(x), m(x))
    assert len(backend.graphs) == 1


def test_load_in_place_checks_before_copying_anything():
    m = _model()
    before = m[0].weight.clone()
    sd = _new_weights(m)
    bad = dict(sd, **{"2.weight": torch.randn(3, 8)})
    with pytest.raises(InputError, match=r"2\.weight: shape \(3, 8\), the module's tensor is \(4, 8\)"):
        load_in_place(m, bad)
    with pytest.raises(InputError, match="float16"):
        load_in_place(m, dict(sd, **{"0.weight": sd["0.weight"].half()}))
    with pytest.raises(InputError, match="missing"):
        load_in_place(m, {"0.weight": sd["0.weight"]})
    with pytest.raises(InputError, match="not in the module: nope"):
        load_in_place(m, dict(sd, nope=torch.ones(1)))
    with pytest.raises(InputError, match="mapping"):
        load_in_place(m, [1, 2])
    assert torch.equal(m[0].weight, before)
    assert load_in_place(m, {"0.weight": sd["0.weight"]}, strict=False) == 1
    assert torch.equal(m[0].weight, sd["0.weight"])


def test_load_in_place_refuses_meta_and_sparse_values_before_copying_anything():
    """Regression (new-user pass): a meta value raised only when its turn came, after earlier tensors were copied."""
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    sd = _new_weights(m)
    for bad in (torch.empty(4, 8, device="meta"), torch.eye(4, 8).to_sparse()):
        with pytest.raises(InputError, match="2.weight: a (meta|sparse_coo) tensor") as info:
            load_in_place(m, dict(sd, **{"2.weight": bad}))
        assert "dense" in str(info.value) and "to(dtype)" not in str(info.value)
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_load_in_place_checks_its_arguments_and_tailors_the_hint():
    m = _model()
    sd = _new_weights(m)
    with pytest.raises(InputError, match="keys must be parameter names"):
        load_in_place(m, {0: torch.ones(1)})
    with pytest.raises(InputError, match="strict must be True or False"):
        load_in_place(m, sd, strict="yes")
    with pytest.raises(InputError, match="missing") as info:
        load_in_place(m, {"0.weight": sd["0.weight"]})
    assert "strict=False" in str(info.value) and "to(dtype)" not in str(info.value)
    prefixed = {f"module.{k}": v for k, v in sd.items()}
    for strict in (True, False):  # none of the names matches: refused with strict=False too
        with pytest.raises(InputError, match=r"prefix 'module\.'.*strip it"):
            load_in_place(m, prefixed, strict=strict)
    assert load_in_place(m, dict(sd, nope=torch.ones(1)), strict=False) == len(sd)  # skipped, as torch does
    m.double()
    with pytest.raises(InputError, match="0.weight: float32, the module's tensor is float64"):
        load_in_place(m, sd)


def test_load_in_place_hands_extra_state_to_the_module():
    class WithExtra(nn.Linear):
        def get_extra_state(self):
            return {"step": self.step}

        def set_extra_state(self, state):
            self.step = state["step"]

    m = nn.Sequential(WithExtra(2, 2))
    m[0].step = 1
    sd = m.state_dict()
    assert "0._extra_state" in sd
    m[0].step = 5
    for strict in (True, False):
        assert load_in_place(m, sd, strict=strict) == 2
        assert m[0].step == 1


def test_a_swap_tensors_conversion_is_seen_and_not_refused():
    """Regression (new-user pass): the watch's weak references to the tensors made torch.utils.swap_tensors
    refuse every conversion under set_swap_module_params_on_conversion(True)."""
    m = _model()
    watch = WeightWatch(m)
    watch.arm()
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert m[0].weight.dtype == torch.float64
    assert "0.weight" in watch.replaced()


def test_tied_weights_load_under_both_names():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    sd = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    assert set(sd) == {"emb.weight", "head.weight"}
    load_in_place(m, sd)
    assert m.head.weight is m.emb.weight


def test_a_function_runner_cannot_load_weights(simulated):
    runner = cg.GraphRunner(lambda x: x * 2, backend=simulated)
    with pytest.raises(InputError, match="wraps a function"):
        runner.load_state_dict({})


def test_the_watch_hooks_do_not_make_torch_compile_recompile_every_call():
    """Regression (H200, notebook 11): with a runner's registration hooks installed, torch.compile of a
    transformers Llama recompiled on every call and gave up after 8, so reduce-overhead ran at eager speed.
    Llama's forward slices its ModuleList (``self.layers[:n]``), which registers modules; Dynamo traced the
    hook's counter increment and guarded on the counter, which the next call had moved."""
    from torch._dynamo.testing import CompileCounter

    class Sliced(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers[:2]:  # a new ModuleList per call, as transformers' decoders do
                x = layer(x)
            return x

    model = Sliced().eval()
    WeightWatch(model)  # installs the process-wide hooks
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(5):
            compiled(x)
    torch._dynamo.reset()
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times in 5 calls"
