"""find_divergence on the CPU: a simulated capture (tests/simulation.py) whose replay reads the parameters the
module held at capture, as a graph does; values only a GPU replay freezes are left to a GPU session."""

import pytest
import torch
from simulation import SimulatedBackend
from torch import nn

import cgutils as cg
from cgutils import find_divergence
from cgutils.analysis.divergence import OUTPUT


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_a_fault_free_model_has_no_divergence():
    torch.manual_seed(0)
    model = Block().eval()
    found = find_divergence(model, torch.randn(2, 8), backend=SimulatedBackend(frozen=model))
    assert found.module is None and found.kind == ""
    assert found.table.module.tolist() == ["a", "b", "c", "", OUTPUT]  # in the order the calls finished
    assert not found.table.diverged.any()
    assert "equals eager" in str(found)


def test_a_weight_replaced_after_capture_is_no_divergence_through_the_runner():
    """GraphRunner sees replaced parameters and captures again (issue 23), so the compared replay is right."""
    torch.manual_seed(0)
    model = Block().eval()

    def new_weight():
        model.b.weight = nn.Parameter(torch.randn(8, 8))

    with pytest.warns(UserWarning, match="replaced after capture"):
        found = find_divergence(model, torch.randn(2, 8), change=new_weight, backend=SimulatedBackend(frozen=model))
    assert found.module is None


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 2.0  # a Python number: a graph bakes in the value it had at capture

    def forward(self, x):
        return self.lin(x) * self.scale


class BakedBackend(SimulatedBackend):
    """A simulation whose replay also reads the plain Python attributes (of the types in ``kinds``) that ``module``
    had at capture, as a graph replays the value a kernel was captured with."""

    def __init__(self, module, kinds=(float,)):
        super().__init__(frozen=module)
        self.module, self.kinds = module, kinds

    def capture(self, fn, **kw):
        graph, out = super().capture(fn, **kw)
        baked = {m: {k: v for k, v in vars(m).items() if isinstance(v, self.kinds) and not isinstance(v, bool)
                     and not k.startswith("_")} for m in self.module.modules()}
        replay = graph.replay

        def replay_baked():
            now = {m: {k: getattr(m, k) for k in d} for m, d in baked.items()}
            for m, d in baked.items():
                vars(m).update(d)
            try:
                replay()
            finally:
                for m, d in now.items():
                    vars(m).update(d)

        graph.replay = replay_baked
        return graph, out


def test_a_python_value_changed_after_capture_is_placed_and_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Scaled(), nn.Linear(8, 8)).eval()

    def change():
        model[1].scale = 3.0

    found = find_divergence(model, torch.randn(2, 8), change=change, backend=BakedBackend(model))
    assert (found.module, found.kind) == ("1", "python_value")
    assert "scale: 2.0 at capture, 3.0 now" in found.detail
    assert found.table.set_index("module").diverged.to_dict() == {"0": False, "1.lin": False, "1": True, "2": True,
                                                                   "": True, OUTPUT: True}


def test_new_inputs_through_static_buffers_are_no_divergence():
    torch.manual_seed(0)
    model = Block().eval()
    found = find_divergence(model, torch.randn(2, 8), replay_args=(torch.randn(2, 8),),
                            backend=SimulatedBackend(frozen=model))
    assert found.module is None


def test_only_modules_can_be_watched():
    with pytest.raises(cg.InputError, match="needs an nn.Module"):
        find_divergence(lambda x: x * 2, torch.randn(2))


def test_the_seeded_fault_cases_build_and_run_eagerly():
    """benchmarks/divergence_faults.py is the GPU evaluation; on the CPU every case must still build and run."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "divergence_faults.py"
    spec = importlib.util.spec_from_file_location("divergence_faults", path)
    faults = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = faults  # its dataclasses look their module up there
    spec.loader.exec_module(faults)
    rows = faults.run("cpu")
    assert len(rows) == len(faults.CASES) >= 10
    assert sum(r["expected"] is None for r in rows) >= 4  # fault-free cases, for false alarms


def test_a_bound_method_that_calls_the_module_twice_is_compared_call_by_call():
    """Found by a helper: a bound method skipped the root's hooks, every pass ran together and the error blamed
    data-dependent control flow; a step-like method calling the module twice was compared on its last call only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Scaled()).eval()

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def step(self, x):
            return self.inner(self.inner(x))

    outer = Twice().eval()
    found = find_divergence(outer.step, torch.randn(2, 8), backend=SimulatedBackend(frozen=outer))
    assert found.module is None
    assert found.table.module.tolist() == ["inner.0", "inner.1.lin", "inner.1", "inner"] * 2 + [OUTPUT]
    assert found.table.call.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0]

    def change():
        model[1].scale = 5.0

    found = find_divergence(outer.step, torch.randn(2, 8), change=change, backend=BakedBackend(outer))
    assert (found.module, found.call, found.kind) == ("inner.1", 0, "python_value")


class Counter(nn.Module):
    """Advances a step buffer in place: a correct graph of it equals eager call for call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return self.lin(x) * self.steps


def test_state_updated_in_place_is_no_false_alarm_and_is_put_back():
    """Found by a helper: the eager reference started from the state the replay left (one step ahead), so a
    correct graph of a step counter read as a fault inside it, and the model was left three steps on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Counter()).eval()
    found = find_divergence(model, torch.randn(2, 8), backend=SimulatedBackend(frozen=model))
    assert found.module is None, str(found)
    assert float(model[1].steps) == 0.0  # as before the call


def test_a_changed_shape_is_a_divergence_not_an_error():
    class Cut(nn.Module):
        def __init__(self):
            super().__init__()
            self.keep = 3

        def forward(self, x):
            return x[:, : self.keep]

    model = nn.Sequential(nn.Linear(8, 8), Cut()).eval()
    found = find_divergence(model, torch.randn(2, 8), change=lambda: setattr(model[1], "keep", 2),
                            backend=BakedBackend(model, kinds=(int, float)))
    assert found.module == "1" and found.max_rel_error == float("inf") and found.kind == "python_value"


@pytest.mark.parametrize("bad, match", [
    ({"change": 3}, "change must be a function"),
    ({"replay_args": torch.ones(2)}, "replay_args must be a tuple"),
    ({"replay_kwargs": [1]}, "replay_kwargs must be a dict"),
    ({"rtol": "0.1"}, "rtol must be a finite number"),
    ({"rtol": -1}, "rtol must be a finite number"),
    ({"backend": "cpu"}, "backend must be a capture backend"),
])
def test_bad_arguments_are_refused_before_any_work(bad, match):
    with pytest.raises(cg.InputError, match=match):
        find_divergence(nn.Linear(2, 2), torch.ones(1, 2), **bad)


class Ema(nn.Module):
    """Moves its weight in place on every call (an EMA-like update): correct under GraphRunner, which keeps it as
    eager would."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(x)


def test_a_weight_updated_in_place_by_forward_is_no_false_alarm_and_is_put_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Ema()).eval()
    w = model[1].lin.weight.detach().clone()
    found = find_divergence(model, torch.randn(2, 8), backend=SimulatedBackend(frozen=model))
    assert found.module is None, str(found)
    assert torch.equal(model[1].lin.weight, w)  # as before the call


def test_without_cuda_or_a_backend_it_says_what_it_needs(monkeypatch):
    """A new user on a CPU got GraphRunner's message ("call the model eagerly instead"), which names another tool."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(cg.NoCudaError, match="find_divergence needs a CUDA device.*simulation"):
        find_divergence(nn.Linear(2, 2), torch.ones(1, 2))


def test_the_runners_messages_name_the_users_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Counter()).eval()
    with pytest.warns(UserWarning, match=r"GraphRunner\(Sequential"):
        find_divergence(model, torch.randn(2, 8), backend=SimulatedBackend(frozen=model))
