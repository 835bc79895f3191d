"""Replay against eager: relative error, validate_replay's diagnoses of the static-buffer bugs, and
GraphRunner's validate_replays (CPU; replays simulated by tests/simulation.py)."""

import pytest
import torch

import cgutils as cg
from cgutils.capture import validate_replay


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


def test_non_tensor_outputs_are_compared():
    assert cg.max_rel_error(999.0, 2.0) == float("inf")
    assert cg.max_rel_error(("a", None, 1), ("a", None, 1)) == 0.0
    assert cg.max_rel_error("a", "b") == float("inf")


def test_objects_without_value_equality_are_not_compared():
    """A transformers cache object in the outputs made every capture fail validation (inf)."""
    class Cache:  # compares by identity, like DynamicCache
        pass

    assert cg.max_rel_error((torch.ones(2), Cache()), (torch.ones(2), Cache())) == 0.0
    assert cg.max_rel_error((torch.ones(2), 3), (torch.ones(2), 4)) == float("inf")


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
    inputs = [(torch.full((3,), float(i + 1)),) for i in range(3)]
    with pytest.raises(cg.CaptureError) as err:
        validate_replay(_fake_graph(bug), lambda x: 2 * x, inputs)
    assert err.value.cause == cause and err.value.max_rel_error > 0
    # a baked value's message names the tool that finds where it is (it named only the kinds of value)
    assert ("cgutils.find_divergence" in str(err.value)) == (cause == "baked_value")


def test_validate_replay_passes_a_correct_replay_and_needs_two_inputs():
    inputs = [(torch.full((3,), float(i + 1)),) for i in range(3)]
    table = validate_replay(_fake_graph("none"), lambda x: 2 * x, inputs)
    assert list(table["max_rel_error"]) == [0.0, 0.0, 0.0]
    with pytest.raises(cg.InputError, match="at least two"):
        validate_replay(_fake_graph("none"), lambda x: 2 * x, inputs[:1])


def test_validate_replay_rejects_unusable_inputs():
    with pytest.raises(cg.InputError, match="argument tuples"):
        validate_replay(lambda v: v, lambda v: v, [torch.ones(1), torch.zeros(1)])
    with pytest.raises(cg.InputError, match="identical inputs"):
        validate_replay(lambda v: v, lambda v: v, [(torch.ones(1),), (torch.ones(1),)])
    with pytest.raises(cg.CaptureError):
        validate_replay(lambda v: 999.0, lambda v: v * 2, [(1.0,), (2.0,), (3.0,)])


def test_validate_replay_accepts_inputs_of_different_shapes():
    inputs = [(torch.ones(1, 100),), (torch.ones(1, 120),)]
    assert list(validate_replay(lambda t: t * 2, lambda t: t * 2, inputs).max_rel_error) == [0.0, 0.0]


def test_validate_replay_does_not_call_a_nan_replay_stale():
    """NaN equals NaN in the 'all outputs equal the first' test, so a NaN replay was called stale_input."""
    with pytest.raises(cg.CaptureError) as err:
        validate_replay(lambda t: t * float("nan"), lambda t: t * 2, [(torch.ones(2),), (torch.zeros(2) + 3,)])
    assert err.value.cause == "nonfinite"


def test_validate_replays_compare_with_eager(simulated, monkeypatch):
    """A replay that disagrees with eager after capture is a CaptureError naming a baked value. Here a
    corrupted replay stands in for a baked-in value (the simulation recomputes, so it bakes nothing)."""
    runner = cg.GraphRunner(lambda x: x * 2, validate_replays=1, backend=simulated)
    runner(torch.ones(2))
    graph = simulated.graphs[0]
    real_replay = graph.replay

    def corrupted():
        real_replay()
        graph.static_out.add_(1)

    monkeypatch.setattr(graph, "replay", corrupted)
    with pytest.raises(cg.CaptureError, match="next call captures a new one") as err:
        runner(torch.ones(2))
    assert err.value.cause == "baked_value" and "cgutils.find_divergence" in str(err.value)
    # The stale graph is dropped (a retry replayed it unchecked and returned [3, 3]): a new capture.
    assert torch.equal(runner(torch.ones(2)), torch.full((2,), 2.0)) and len(simulated.graphs) == 2


def test_a_replay_check_that_meets_other_shapes_is_a_capture_error(simulated):
    """A baked value that changes the output's shape came out of validate_replays as a bare InputError."""
    class M(torch.nn.Module):
        n = 2

        def forward(self, x):
            return x[: self.n] * 2

    model = M()
    runner = cg.GraphRunner(model, validate_replays=2, backend=simulated)
    runner(torch.ones(4))
    simulated.graphs[0].replay = lambda: None  # as a real graph would: the slice length stays baked in
    model.n = 3
    with pytest.raises(cg.CaptureError, match="eager now gives other outputs") as err:
        runner(torch.ones(4))
    assert err.value.cause == "baked_value"



def test_a_first_replay_that_differs_names_find_divergence():
    from cgutils.capture.compare import check_first_replay

    with pytest.raises(cg.CaptureError, match=r"cgutils\.find_divergence") as err:
        check_first_replay(torch.ones(3), torch.zeros(3) + 2, rtol=1e-3)
    assert err.value.cause == "baked_value"
