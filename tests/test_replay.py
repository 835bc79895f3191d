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



class _Named(dict):
    """A dict subclass whose __init__ takes a positional argument of its own before the items."""

    def __init__(self, name, *args, **kwargs):
        self.name = name
        super().__init__(*args, **kwargs)


class _KwargsOnly(dict):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)


def test_tree_map_rebuilds_dict_subclasses_faithfully():
    """`type(obj)(mapped)` put a positional-__init__ subclass's items into its name (it came back empty), and a
    kwargs-only one came back as a plain dict."""
    from transformers.modeling_outputs import BaseModelOutput

    t = torch.ones(2)
    named = tree_map(lambda x: x * 2, _Named("boxes", a=t, b=1))
    assert type(named) is _Named and named.name == "boxes" and list(named) == ["a", "b"]
    assert torch.equal(named["a"], t * 2) and named["b"] == 1
    kwargs_only = tree_map(lambda x: x * 2, _KwargsOnly(a=t))
    assert type(kwargs_only) is _KwargsOnly and torch.equal(kwargs_only["a"], t * 2)
    ordered = tree_map(lambda x: x * 2, collections.OrderedDict([("z", t), ("a", t)]))
    assert type(ordered) is collections.OrderedDict and list(ordered) == ["z", "a"]
    default = tree_map(lambda x: x * 2, collections.defaultdict(list, a=t))
    assert type(default) is collections.defaultdict and default.default_factory is list
    out = tree_map(lambda x: x * 2, BaseModelOutput(last_hidden_state=t, hidden_states=(t,)))
    assert type(out) is BaseModelOutput and list(out) == ["last_hidden_state", "hidden_states"]
    assert torch.equal(out.last_hidden_state, t * 2) and out[0] is out.last_hidden_state and out.attentions is None


def test_tree_map_rebuilds_sequence_subclasses_faithfully():
    class Labelled(list):
        def __init__(self, label, items):
            self.label = label
            super().__init__(items)

    class WithDefault(Pair):
        def __new__(cls, a, b=0):
            return super().__new__(cls, a, b)

    t = torch.ones(2)
    labelled = tree_map(lambda x: x * 2, Labelled("l", [t, 3]))
    assert type(labelled) is Labelled and labelled.label == "l" and torch.equal(labelled[0], t * 2)
    assert labelled[1] == 3
    assert type(tree_map(lambda x: x * 2, WithDefault(t, 5))) is WithDefault
    assert tree_map(lambda x: x, torch.Size([1000, 3])) == torch.Size([1000, 3])  # new int objects, equal values
    top = tree_map(lambda x: x * 2, torch.max(torch.ones(2, 2), 0))
    assert type(top).__name__ == "max" and torch.equal(top.values, t * 2)


def test_tree_map_names_a_container_it_cannot_rebuild():
    """A container the old code could not rebuild came back as something else (a plain dict) or raised TypeError."""

    class Pairish(tuple):
        def __new__(cls, a, b):
            return super().__new__(cls, (a, b))

    class Frozen(dict):
        def __init__(self, name, items):
            super().__init__(items)

        def __setitem__(self, key, value):
            raise TypeError("Frozen is read-only")

    with pytest.raises(cg.InputError, match=r"cannot rebuild a .*Pairish \(a tuple subclass\)"):
        tree_map(lambda x: x * 2, Pairish(torch.ones(1), 2))
    with pytest.raises(cg.InputError, match=r"Frozen \(a dict subclass\).*read-only"):
        tree_map(lambda x: x * 2, Frozen("f", {"a": torch.ones(1)}))


class _Boxes:
    def __init__(self, tensor):
        self.tensor = tensor


class _Instances:
    """detectron2's Instances in miniature: its only tensor sits in a Boxes object, inside a dict."""

    def __init__(self, boxes):
        self._fields, self.image_size = {"pred_boxes": boxes}, (4, 4)


class _Slotted:
    __slots__ = ("scores", "__private", "unset")

    def __init__(self, scores, private):
        self.scores, self.__private = scores, private


def test_objects_reach_tensors_in_nested_objects_and_slots():
    """objects=True looked one level down: an object whose tensors sat in a nested object (or whose class used
    __slots__) came back as itself, so a break's static output still pointed at the capture's tensors."""
    t = torch.ones(2)
    inst = _Instances(_Boxes(t))
    copied = tree_map(lambda x: x.clone(), inst, objects=True)
    assert copied is not inst and copied._fields["pred_boxes"].tensor is not t
    assert torch.equal(copied._fields["pred_boxes"].tensor, t) and copied.image_size == (4, 4)
    assert [p for p, _ in tree_leaves(inst, objects=True)] == ["output._fields['pred_boxes'].tensor",
                                                               "output.image_size[0]", "output.image_size[1]"]
    slotted = _Slotted(t, _Boxes(t))
    copied = tree_map(lambda x: x * 2, slotted, objects=True)
    assert type(copied) is _Slotted and torch.equal(copied.scores, t * 2)
    assert torch.equal(copied._Slotted__private.tensor, t * 2) and not hasattr(copied, "unset")
    assert [p for p, _ in tree_leaves(slotted, objects=True)] == ["output.scores", "output._Slotted__private.tensor"]
    no_tensor = _Boxes("not a tensor")
    assert tree_map(lambda x: x * 2, no_tensor, objects=True) is no_tensor
    assert tree_leaves(no_tensor, objects=True) == [("output", no_tensor)]


def test_objects_refuse_a_cycle_through_tensors():
    class Node:
        def __init__(self):
            self.me, self.value = self, torch.ones(1)

    node = Node()
    with pytest.raises(cg.InputError, match="Node whose attributes hold tensors refers back to itself"):
        tree_map(lambda x: x * 2, node, objects=True)
    assert [p for p, _ in tree_leaves(node, objects=True)] == ["output.me", "output.value"]  # the cycle: a leaf
    harmless = _Boxes(None)
    harmless.tensor = harmless  # a cycle that reaches no tensor leaves the object as it is
    assert tree_map(lambda x: x * 2, harmless, objects=True) is harmless


def test_objects_are_flattened_once():
    """tree_leaves(objects=True), run on each break's outputs at every replay, walked an object's attributes twice:
    once to decide whether they held tensors (holds_tensors), once to flatten them."""
    walks = []

    class Counted(list):
        def __iter__(self):
            walks.append(1)
            return super().__iter__()

    images = _Boxes(Counted([torch.ones(1), torch.ones(1)]))
    assert len(tree_leaves(images, objects=True)) == 2
    assert len(walks) == 1


def test_graph_stats_split_the_first_call_into_warm_up_capture_and_validation(simulated):
    """Notebook 11 timed the first call under cProfile to see where it went; the stats now say it themselves."""
    import time

    def slow(x):
        time.sleep(0.01)  # every call: the 3 warm-ups, the capture's one, the validation's eager one
        return x * 2

    runner = cg.GraphRunner(slow, backend=simulated)
    runner(torch.ones(3))
    g = runner.stats.graphs[0]
    assert g.warmup_ms >= 30 and g.record_ms >= 10 and g.validate_ms > 0
    assert g.warmup_ms + g.record_ms + g.validate_ms <= g.capture_ms
    unchecked = cg.GraphRunner(slow, validate=False, backend=simulated)
    unchecked(torch.ones(3))
    assert unchecked.stats.graphs[0].validate_ms is None
    assert set(runner.stats.to_frame().columns) >= {"warmup_ms", "record_ms", "validate_ms"}
