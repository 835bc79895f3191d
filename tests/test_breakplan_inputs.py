"""BreakPlan, Break and PieceCapture given names and objects they cannot use: each says what was wrong and what
to pass instead (an InputError), and a capture that fails while hooking the breaks leaves no hook behind. CPU only."""

import types

import pytest
import torch
from torch import nn

from cgutils.capture import Break, BreakPlan
from cgutils.capture.piecewise import PieceCapture
from cgutils.errors import InputError


class Transform(nn.Module):
    def __init__(self):
        super().__init__()
        self.min_size = (800,)

    def forward(self, x):
        return x * 2

    def postprocess(self, boxes, scale):
        return boxes * scale


class Detector(nn.Module):
    """The top-level forward calls a submodule's method itself (torchvision's detectors)."""

    def __init__(self):
        super().__init__()
        self.transform, self.head = Transform(), nn.Linear(3, 3)

    def forward(self, x):
        return self.transform.postprocess(self.head(self.transform(x)), 0.5)


@pytest.mark.parametrize("breaks,match", [
    (["transform.postprocesss"], r"Transform has no method 'postprocesss'; close: \['postprocess'\]"),
    (["transfrom.postprocess"], r"no submodule \(or method of one\) named 'transfrom.postprocess'.*"
                                r"close: \['transform.postprocess'"),
    (["tranform"], r"close: \['transform'"),
    (["transform.min_size"], r"transform.min_size is an attribute of Transform \(a tuple\), not a method"),
    (["head.weight"], r"head.weight is an attribute of Linear \(a Parameter\), not a method"),
    (["transform.to"], r"to is nn.Module's own API .*name the submodule itself, 'transform'"),
    (["transform.state_dict"], r"nn.Module's own API"),
    (["transform.__class__"], r"a Python special name"),
    (["transform.forward"], r"forward is what runs when transform is called; name the submodule itself, 'transform'"),
    (["forward"], r"'forward' is Detector's own attribute: the top-level forward's code is what is captured"),
    ({"transform": "sync", "head": "sync"}, r"got a dict \(keys \['transform', 'head'\]\).*pass list\(breaks\)"),
    ([nn.Linear(3, 3)], r"the Linear object given is not a submodule of Detector"),
    ([nn.Conv2d], r"Detector has no Conv2d among its submodules"),
])
def test_break_plan_says_what_is_wrong_with_a_name_or_object(breaks, match):
    """Each of these was accepted (a dict read as its keys, nn.Module methods and dunders as method breaks, an
    outside module or a class without instances as a break that never happens) or refused without a hint."""
    with pytest.raises(InputError, match=match):
        BreakPlan(Detector(), breaks)


def test_a_module_shared_under_two_names_resolves_by_either():
    """named_modules() gives a shared module's first name only: its second name was 'no submodule'."""
    net = Detector()
    net.again = net.transform
    assert BreakPlan(net, ["again"]).modules() == [net.transform]
    assert BreakPlan(net, ["again.postprocess"]).methods() == [(net.transform, "postprocess")]


def test_a_class_no_instance_of_which_runs_in_the_first_call_of_a_function():
    """With a function as the root, a class is looked for while the first warm-up call runs: one that never ran
    was accepted and named no break."""
    lin = nn.Linear(3, 3)
    plan = BreakPlan(lambda x: lin(x), [nn.Linear, nn.Conv2d])
    with pytest.raises(InputError, match="no Conv2d ran in the first call of the function"), plan.watching():
        lin(torch.ones(1, 3))
    assert plan.modules() == [lin]
    ok = BreakPlan(lambda x: lin(x), nn.Linear)
    with ok.watching():
        lin(torch.ones(1, 3))
    assert ok.modules() == [lin]
    with pytest.raises(ValueError, match="the call's own"), BreakPlan(lambda x: x, nn.Conv2d).watching():
        raise ValueError("the call's own error is the one to see")


def test_a_break_of_a_method_that_does_not_exist_says_so_when_made():
    """Break(method=<typo>) was made, then raised AttributeError in the middle of a replay."""
    with pytest.raises(InputError, match=r"Break 'transform.postprocesss': Transform has no method 'postprocesss'; "
                                         r"close: \['postprocess'\]"):
        Break("transform.postprocesss", "named", Transform(), (), {}, None, method="postprocesss")


def test_a_capture_that_fails_hooking_a_method_leaves_no_hook_behind(monkeypatch):
    """PieceCapture.run made its hooks before its try: a method break gone since the plan was made raised
    AttributeError and left the hooks made before it on the modules."""
    net = Detector()
    scale = net.transform.scale = lambda x: x * 3  # an instance attribute: its hook must put it back
    net.transform.gone = lambda x: x
    plan = BreakPlan(net, ["head", "transform.scale", "transform.gone"])
    del net.transform.gone
    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    with pytest.raises(InputError, match="method break: Transform has no method 'gone'"):
        PieceCapture(plan, None, stream).run(lambda: net(torch.ones(1, 3)))
    for module in net.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert vars(net.transform)["scale"] is scale and "gone" not in vars(net.transform)
