"""Capture and replay semantics on the CPU simulation (tests/simulation.py): each call's inputs reach the
graph, static outputs, nested and opaque outputs, autocast states, capture arguments."""

import collections
import dataclasses
import warnings

import pytest
import torch

import cgutils as cg
from cgutils.capture import capture_graph, tree_leaves, tree_map
from cgutils.capture.graph import autocast_without_cache


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: tuple


Pair = collections.namedtuple("Pair", "a b")


def test_tree_map_rebuilds_nested_outputs():
    from transformers.modeling_outputs import BaseModelOutput

    t = torch.ones(2)
    nest = {"m": BaseModelOutput(last_hidden_state=t), "d": Out(t, (t, 1)), "p": Pair(t, [t, "s"])}
    doubled = tree_map(lambda x: x * 2, nest)
    assert isinstance(doubled["m"], BaseModelOutput) and torch.equal(doubled["m"].last_hidden_state, t * 2)
    assert isinstance(doubled["d"], Out) and doubled["d"].extra[1] == 1
    assert isinstance(doubled["p"], Pair) and doubled["p"].b[1] == "s"
    assert torch.equal(doubled["p"].b[0], t * 2)
    paths = [p for p, leaf in tree_leaves(nest) if isinstance(leaf, torch.Tensor)]
    assert paths == ["output['m']['last_hidden_state']", "output['d'].logits", "output['d'].extra[0]",
                     "output['p'][0]", "output['p'][1][0]"]


def test_capture_runs_with_the_autocast_cache_off(monkeypatch):
    """Captured under autocast with its cast cache on, a graph reads cached weight casts that are freed
    when the autocast context exits (torch.cuda.make_graphed_callables refuses that setting)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with autocast_without_cache():
        assert not torch.is_autocast_enabled("cuda")  # outside autocast: nothing changes
    with torch.autocast("cuda", dtype=torch.float16):
        assert torch.is_autocast_cache_enabled()
        with autocast_without_cache():
            assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.float16
            assert not torch.is_autocast_cache_enabled()
        assert torch.is_autocast_cache_enabled()


def test_replay_reads_each_calls_inputs(simulated):
    runner = cg.GraphRunner(lambda a, b: a * 2 + b, backend=simulated)
    for i in range(3):
        a, b = torch.randn(2, 3), torch.randn(2, 3)
        assert torch.equal(runner(a, b), a * 2 + b), f"call {i}"
    assert len(simulated.graphs) == 1 and runner.stats.replays == 3


def test_static_outputs_are_rewritten_by_the_next_replay(simulated):
    runner = cg.GraphRunner(lambda x: x + 1, clone_outputs=False, backend=simulated)
    first = runner(torch.zeros(2))
    second = runner(torch.full((2,), 10.0))
    assert first is second and torch.equal(first, torch.full((2,), 11.0))
    safe = cg.GraphRunner(lambda x: x + 1, backend=simulated)
    a = safe(torch.zeros(2))
    safe(torch.full((2,), 10.0))
    assert torch.equal(a, torch.ones(2))


def test_outputs_with_objects_and_values_pass_validation(simulated):
    class Cache:  # compares by identity, like a transformers cache
        pass

    runner = cg.GraphRunner(lambda x: (x * 2, Cache(), "label"), validate_replays=2, backend=simulated)
    with pytest.warns(UserWarning, match="outputs hold Cache, which GraphRunner cannot look inside"):
        runner(torch.full((2,), 1.0))
    for v in (1.0, 2.0, 3.0):
        out = runner(torch.full((2,), v))
        assert torch.equal(out[0], torch.full((2,), 2 * v)) and out[2] == "label"


def test_each_autocast_state_gets_its_own_graph(simulated, monkeypatch):
    """One graph served calls with and without torch.autocast: kernels captured in fp32 replayed for an
    fp16 autocast call (and the other way round), silently in the wrong precision."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else torch.autocast("cuda") turns itself off
    runner = cg.GraphRunner(lambda x: x @ x, backend=simulated)
    x = torch.rand(4, 4)
    runner(x)
    with torch.autocast("cuda", dtype=torch.float16):
        runner(x)
        runner(x)
        with torch.autocast("cuda", enabled=False):
            runner(x)
    assert [g.signature for g in runner.stats.graphs] == [
        "x:(4, 4) float32", "x:(4, 4) float32 (autocast float16)"]
    assert [g.replays for g in runner.stats.graphs] == [2, 2]


def test_dataclass_outputs_that_read_their_fields(simulated):
    @dataclasses.dataclass
    class Out:
        h: torch.Tensor
        n: int = 0

        def __post_init__(self):
            self.n = self.h.shape[-1]

    runner = cg.GraphRunner(lambda x: Out(x * 2), buckets={1: (8,)}, backend=simulated)
    assert runner(torch.rand(1, 5, 3)).h.shape == (1, 5, 3)


def test_a_transformers_cache_in_the_outputs_is_warned_about(simulated):
    """GPT-2 returns a cache object by default; its tensors are static buffers that were neither cloned nor
    cut back, silently: every call got the same cache object, at the padded length."""
    from transformers import GPT2Config, GPT2Model

    model = GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).eval()
    runner = cg.GraphRunner(model, buckets={1: (8,)}, backend=simulated)
    ids = torch.randint(0, 100, (1, 5))
    with pytest.warns(UserWarning, match="use_cache=False"):
        runner(ids, attention_mask=torch.ones_like(ids))
    quiet = cg.GraphRunner(model, buckets={1: (8,)}, backend=simulated)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet(ids, attention_mask=torch.ones_like(ids), use_cache=False)


def test_capture_graph_refuses_no_warmup():
    with pytest.raises(cg.InputError, match="warmup must be an int >= 1"):
        capture_graph(lambda: None, warmup=0)

