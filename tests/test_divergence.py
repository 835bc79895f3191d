"""find_divergence on the CPU: a simulated capture (tests/simulation.py) whose replay reads the parameters the
module held at capture, as a graph does; values only a GPU replay freezes are left to a GPU session."""

import pytest
import torch
from simulation import SimulatedBackend
from torch import nn

import cgutils as cg
from cgutils import find_divergence


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
    assert found.table.module.tolist() == ["a", "b", "c", ""]  # in the order the modules finished
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
    """A simulation whose replay also reads the plain Python attributes ``module`` had at capture, as a graph
    replays the value a kernel was captured with."""

    def __init__(self, module):
        super().__init__(frozen=module)
        self.module = module

    def capture(self, fn, **kw):
        graph, out = super().capture(fn, **kw)
        baked = {m: {k: v for k, v in vars(m).items() if isinstance(v, float)} for m in self.module.modules()}
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
                                                                   "": True}


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
    assert len(rows) == len(faults.CASES) >= 7
    assert sum(r["expected"] is None for r in rows) >= 3  # fault-free cases, for false alarms
