"""CPU tests for graph inspection (on the recorded BERT-base node table and trace-shaped frames, and a
simulated capture) and for piecewise capture's parts that need no GPU (break plans, breaks, replay order)."""

import builtins
import types

import pandas as pd
import pytest
import torch
from simulation import SimulatedBackend
from torch import nn

import cgutils as cg
from cgutils.capture import Break, BreakPlan, PiecewiseGraph, tree_leaves, tree_map
from cgutils.capture.inspect import NodeAttribution, kernel_family, short_kernel_name
from cgutils.diagnose import failure_site
from cgutils.errors import CaptureError, DependencyError, InputError
from cgutils.store import current_store


def _recorded_nodes():
    nodes = current_store().load_frame("bert_graph_nodes")
    return nodes.assign(kernel=nodes.kernel.fillna(""), module=nodes.module.fillna(""),
                        depends_on=nodes.depends_on.map(lambda s: [int(float(i)) for i in str(s).split() if i != "nan"]))


def test_recorded_bert_graph_meets_the_attribution_targets():
    nodes = _recorded_nodes()
    check = current_store().load_value("bert_graph_check")
    kernels = nodes[nodes.type == "KERNEL"]
    assert len(kernels) == check["kernel_nodes"]
    assert check["matched"] == check["activities"] == (nodes.type.isin(["KERNEL", "MEMSET", "MEMCPY"])).sum()
    assert (kernels.module != "").mean() >= 0.99
    per_module = cg.time_by_module(nodes)
    assert abs(per_module.gpu_us.sum() - check["launch_gpu_us"]) <= 0.05 * check["launch_gpu_us"]


def _trace(names, kinds=None, call="cudaGraphLaunch", corr=7):
    kinds = kinds or ["kernel"] * len(names)
    links = pd.DataFrame({"call": call, "call_ts": 0.0, "call_dur": 5.0, "correlation": corr, "name": names,
                          "ts": [10.0 * i for i in range(len(names))], "dur": [1.0 + i for i in range(len(names))],
                          "stream": 7, "kind": kinds})
    return types.SimpleNamespace(links=lambda: links, path="fake.json")


def _table(kernels):
    rows = [{"index": i, "type": "KERNEL" if k != "MEMSET" else "MEMSET", "kernel": k if k != "MEMSET" else "",
             "family": "", "grid": (1, 1, 1), "block": (1, 1, 1), "shared_mem_bytes": 0, "param_bytes": 0,
             "module": f"m{i % 2}", "range": "", "depends_on": [i - 1] if i else []} for i, k in enumerate(kernels)]
    return pd.DataFrame(rows)


def test_node_times_matches_by_name_in_order():
    table = _table(["a", "b", "MEMSET", "a"])
    timed = cg.node_times(table, _trace(["a", "b", "Memset (Device)", "a"], ["kernel", "kernel", "memset", "kernel"]))
    assert list(timed.gpu_us) == [1.0, 2.0, 3.0, 4.0]
    assert timed.attrs["matched"] == timed.attrs["activities"] == 4 and not timed.attrs["unmatched_activities"]
    by_module = cg.time_by_module(timed)
    assert by_module.set_index("module").gpu_us.to_dict() == {"m1": 6.0, "m0": 4.0}
    assert by_module.share.sum() == pytest.approx(1.0)


def test_node_times_reports_what_it_could_not_match():
    timed = cg.node_times(_table(["a"]), _trace(["a", "z"]))
    assert timed.attrs["unmatched_activities"] == ["z"] and timed.attrs["matched"] == 1


def test_node_times_needs_a_graph_launch():
    with pytest.raises(InputError, match="no cudaGraphLaunch"):
        cg.node_times(_table(["a"]), _trace(["a"], call="cudaLaunchKernel"))
    with pytest.raises(InputError, match="graph launches"):
        cg.node_times(_table(["a"]), _trace(["a"]), launch=3)
    with pytest.raises(InputError, match="node table"):
        cg.node_times(pd.DataFrame({"x": [1]}), _trace(["a"]))


def test_time_by_module_folds_to_a_depth():
    timed = _table(["a", "b"]).assign(module=["encoder.layer.0.attention", "encoder.layer.1.output"], gpu_us=[1.0, 2.0])
    assert set(cg.time_by_module(timed, depth=2).module) == {"encoder.layer"}
    with pytest.raises(InputError):
        cg.time_by_module(timed, depth=0)


def test_dot_export_and_counts():
    table = _table(["void at::native::vectorized_elementwise_kernel<4, Add>(int, Add)", "MEMSET"])
    dot = cg.to_dot(table)
    assert dot.startswith('digraph "cuda_graph"') and "n0 -> n1;" in dot
    assert "at::native::vectorized_elementwise_kernel" in dot and "<4" not in dot
    counts = cg.node_counts(table)
    assert counts.nodes.sum() == 2


@pytest.mark.parametrize("name,family", [
    ("nvjet_sm90_hsh_64x16_64x16_2x4_h_bz_bias_TNT", "gemm"),
    ("triton_poi_fused_add_0", "elementwise"),
    ("some_library_kernel", "other"),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize64x64x64", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half>", "normalization"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_f16f16", "convolution"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::Half>>", "elementwise"),
])
def test_kernel_family(name, family):
    assert kernel_family(name) == family


def test_short_kernel_name():
    assert short_kernel_name("void at::native::foo<int, 3>(char*, long)") == "at::native::foo"
    assert short_kernel_name("nvjet_abc") == "nvjet_abc"
    assert short_kernel_name("void at::native::(anonymous namespace)::softmax_warp_forward<float>(float*)") \
        == "at::native::softmax_warp_forward"


def test_cublas_nvjet_kernels_are_gemms():
    assert kernel_family("nvjet_tst_128x64_64x4_1x1_v_bz_NNN") == "gemm"


def test_to_dot_reads_a_recorded_table():
    """A table read back from CSV holds depends_on as text ("0 3") or NaN: to_dot iterated its characters."""
    nodes = current_store().load_frame("bert_graph_nodes")
    dot = cg.to_dot(nodes)
    edges = [line for line in dot.splitlines() if "->" in line]
    assert len(edges) == sum(len(str(d).split()) for d in nodes.depends_on.dropna())
    assert "  n0 -> n1;" in edges


def test_node_times_refuses_several_pieces_at_once():
    table = pd.concat([_table(["a"]).assign(piece=0), _table(["a"]).assign(index=1, piece=1)], ignore_index=True)
    with pytest.raises(InputError, match="one at a time"):
        cg.node_times(table, _trace(["a", "a"]))
    one = cg.node_times(table[table.piece == 1], _trace(["a"]))
    assert one.attrs["matched"] == 1


def test_node_table_of_a_null_handle_or_without_a_driver(monkeypatch):
    pytest.importorskip("cuda.bindings")  # without it node_table raises DependencyError first (torch 2.8's wheels lack it)
    import cgutils.capture.inspect as inspect_mod
    with pytest.raises(InputError, match="null cudaGraph_t"):
        cg.node_table(0)

    def no_libcuda(*_):
        raise RuntimeError("Failed to dlopen libcuda.so.1")

    fake = types.SimpleNamespace(CUgraph=lambda h: h, cuGraphGetNodes=no_libcuda)
    monkeypatch.setattr(inspect_mod, "cuda_driver", lambda: fake)
    with pytest.raises(cg.CgutilsError, match="needs the NVIDIA driver"):
        cg.node_table(12345)


def test_attribution_gives_nodes_to_the_innermost_module_and_range():
    nodes: list[int] = []

    class Leaf(nn.Module):
        def forward(self, x):
            nodes.append(len(nodes) + 100)  # "a kernel": one new node
            return x

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Leaf(), Leaf()

        def forward(self, x):
            x = self.a(x)
            nodes.append(999)  # work in the root's own forward
            with cg.nvtx_range("tail"):
                return self.b(x)

    root = Root()
    with NodeAttribution(root, nodes_now=lambda: list(nodes)) as attribution:
        root(torch.ones(1))
    assert attribution.owner == {100: ("a", ""), 999: ("Root", ""), 102: ("b", "tail")}
    assert attribution.order == [100, 999, 102]
    assert not nn.modules.module._global_forward_hooks  # hooks removed


def test_node_table_without_cuda_python_names_the_package(monkeypatch):
    real_import = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name.startswith("cuda"):
            raise ImportError("No module named 'cuda'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    with pytest.raises(DependencyError, match="pip install cuda-bindings"):
        cg.node_table(12345)
    # a runner asked to inspect says so when it is made, not inside its first capture
    with pytest.raises(DependencyError, match="pip install cuda-bindings"):
        cg.GraphRunner(nn.Linear(3, 3), inspect=True, backend=SimulatedBackend())


def test_runner_node_table_needs_inspect():
    runner = cg.GraphRunner(nn.Linear(3, 3), backend=SimulatedBackend())
    runner(torch.ones(2, 3))
    with pytest.raises(InputError, match="inspect=True"):
        runner.node_table()
    with pytest.raises(InputError, match="graph=5"):
        runner.pieces(graph=5)
    assert list(runner.pieces().kind) == ["graph"]


def test_runner_pieces_before_any_capture():
    with pytest.raises(InputError, match="call it once first") as info:
        cg.GraphRunner(nn.Linear(3, 3), backend=SimulatedBackend()).pieces()
    assert "lacks" not in str(info.value)
    no_gpu = SimulatedBackend()
    no_gpu.available = lambda: False
    with pytest.raises(InputError, match="which this machine lacks"):
        cg.GraphRunner(nn.Linear(3, 3), backend=no_gpu).pieces()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.mid, self.post = nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)

    def forward(self, x):
        return self.post(self.mid(self.pre(x)))


def test_break_plan_resolves_names_modules_and_classes():
    net = Net()
    assert BreakPlan(net, ["mid"]).why(net.mid) == "named"
    assert BreakPlan(net, net.pre).why(net.pre) == "named"
    plan = BreakPlan(net, nn.Linear)
    assert {plan.name(m) for m in plan.modules()} == {"pre", "post"}
    assert BreakPlan(net, "auto").auto and BreakPlan(net, "auto").why(net.mid) is None


@pytest.mark.parametrize("breaks,match", [
    (["midd"], r"no submodule \(or method of one\) named 'midd'"),
    (["mid.nosuch"], "'mid.nosuch': ReLU has no method 'nosuch'"),
    ([""], "root module itself"),
    ([3], "not a module name"),
    ([], "breaks is empty"),
    (42, "breaks must be"),
])
def test_break_plan_rejects_bad_breaks(breaks, match):
    with pytest.raises(InputError, match=match):
        BreakPlan(Net(), breaks)


def test_break_names_need_a_module_root():
    with pytest.raises(InputError, match="needs an nn.Module"):
        BreakPlan(lambda x: x, ["mid"])


def test_breaks_and_compile_cannot_combine():
    with pytest.raises(InputError, match="cannot be combined"):
        cg.GraphRunner(Net(), breaks="auto", compile=True)


def test_break_copies_into_static_buffers_and_rejects_a_new_shape():
    x = torch.ones(4, 3)
    keep = nn.Identity()
    brk = Break("keep", "named", keep, (x,), {}, torch.zeros(4, 3))
    x.mul_(2)  # the previous piece rewrote the break's input in place
    brk.run()
    assert torch.equal(brk.static_output, torch.full((4, 3), 2.0))
    short = Break("cut", "named", nn.Identity(), (torch.ones(2, 3),), {}, torch.zeros(4, 3))
    with pytest.raises(CaptureError, match="captured as") as info:
        short.run()
    assert info.value.cause == "break_shape"


class _Piece:
    """Stands in for a captured graph: each replay appends its name to ``log``."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def replay(self):
        self.log.append(self.name)


def test_piecewise_graph_replays_in_order():
    calls = []

    class Rec(nn.Module):
        def forward(self, x):
            calls.append("break")
            return x

    x = torch.ones(1)
    graph = PiecewiseGraph([_Piece("p0", calls), None, _Piece("p2", calls)],
                           [Break("r0", "named", Rec(), (x,), {}, torch.zeros(1)),
                            Break("r1", "named", Rec(), (x,), {}, torch.zeros(1))])
    graph.replay()
    assert calls == ["p0", "break", "break", "p2"]
    table = graph.table()
    assert list(table.kind) == ["graph", "eager", "graph", "eager", "graph"]
    assert table.name.iloc[2] == "piece 1 (empty)"


def test_failure_site_follows_the_exception_chain():
    def user_line():
        raise ValueError("first")

    try:
        try:
            user_line()
        except ValueError:
            raise RuntimeError("while ending the capture") from None
    except RuntimeError as exc:
        outer = exc
    try:
        user_line()
    except ValueError as inner:
        outer.__context__ = inner
    site = failure_site(outer, user_files=[__file__])
    assert site is not None and site.op == "ValueError" and "raise ValueError" in site.code


def test_break_rejects_a_changed_python_value():
    """A break returning (tensor, flag) with a new flag was accepted: the next piece kept the old branch."""
    flag = {"value": True}

    class Flagged(nn.Module):
        def forward(self, x):
            return x, flag["value"]

    brk = Break("flagged", "named", Flagged(), (torch.ones(2),), {}, (torch.zeros(2), True))
    brk.run()
    flag["value"] = False
    with pytest.raises(CaptureError, match="captured for True"):
        brk.run()


def test_out_of_memory_does_not_make_a_break():
    from cgutils.capture import piecewise
    from cgutils.diagnose import explain

    why = explain(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert why is not None and why.key not in piecewise._BREAKABLE


class _ImageList:
    """torchvision's ImageList in miniature: a plain object whose attributes hold a tensor and sizes."""

    def __init__(self, tensors, image_sizes):
        self.tensors, self.image_sizes = tensors, image_sizes


class _Transform(nn.Module):
    def forward(self, x):
        return _ImageList(x * 2, [tuple(x.shape[-2:])])

    def postprocess(self, boxes, scale):
        return [{"boxes": boxes * scale}]


class _Detector(nn.Module):
    """A detector's layout: the top-level forward calls a submodule's method itself (no forward hook sees it)."""

    def __init__(self):
        super().__init__()
        self.transform, self.head = _Transform(), nn.Linear(3, 3)

    def forward(self, x):
        images = self.transform(x)
        return self.transform.postprocess(self.head(images.tensors), 0.5)


def test_an_object_holding_tensors_is_mapped_only_when_asked():
    """torchvision passes ImageList between its detector's submodules: a break returning one kept its tensors
    unbuffered (the next piece read the capture's tensor), and a new ImageList at replay failed as a changed value."""
    images = _ImageList(torch.ones(2, 3), [(2, 3)])
    copied = tree_map(lambda t: t.clone(), images, objects=True)
    assert isinstance(copied, _ImageList) and copied is not images and copied.tensors is not images.tensors
    assert copied.image_sizes == [(2, 3)] and torch.equal(copied.tensors, images.tensors)
    assert tree_map(lambda t: t.clone(), images) is images  # the runner's inputs and outputs: unchanged rule
    assert [p for p, _ in tree_leaves(images, objects=True)] == ["output.tensors", "output.image_sizes[0][0]",
                                                                   "output.image_sizes[0][1]"]
    assert tree_leaves(nn.Linear(2, 2), objects=True)[0][1].__class__ is nn.Linear  # modules stay leaves


def test_a_break_of_a_returned_object_copies_its_tensors_into_the_static_ones():
    x = torch.ones(2, 3)
    static = tree_map(lambda t: t.clone(), _Transform()(x), objects=True)
    brk = Break("transform", "named", _Transform(), (x,), {}, static)
    x.mul_(3)
    brk.run()
    assert torch.equal(static.tensors, torch.full((2, 3), 6.0))


def test_a_submodule_method_can_be_named_as_a_break_and_replays_as_that_method():
    net = _Detector()
    plan = BreakPlan(net, ["transform.postprocess"])
    assert plan.methods() == [(net.transform, "postprocess")] and plan.modules() == []
    assert plan.why(net.transform, "postprocess") == "named" and plan.why(net.transform) is None
    assert plan.name(net.transform, "postprocess") == "transform.postprocess"
    boxes = torch.ones(2, 3)
    brk = Break("transform.postprocess", "named", net.transform, (boxes, 0.5), {}, [{"boxes": torch.zeros(2, 3)}],
                method="postprocess")
    brk.run()
    assert torch.equal(brk.static_output[0]["boxes"], torch.full((2, 3), 0.5))


def test_a_method_hook_shadows_the_method_and_is_removed_cleanly():
    from cgutils.capture.breakplan import MethodHook

    t, seen = _Transform(), []

    def wrap(call):
        def wrapper(*a, **k):
            seen.append("wrapped")
            return call(*a, **k)
        return wrapper

    hook = MethodHook(t, "postprocess", wrap)
    t.postprocess(torch.ones(1), 1.0)
    hook.remove()
    t.postprocess(torch.ones(1), 1.0)
    assert seen == ["wrapped"] and "postprocess" not in vars(t)


def test_auto_names_the_submodule_method_the_top_level_forward_called():
    """A sync in `self.transform.postprocess(...)`, called from the root's forward, ended breaks='auto' with
    "no break can wrap it" (torchvision's Faster R-CNN): the method becomes the break."""
    from cgutils.capture.breakplan import submodule_method

    class Syncs(_Detector):
        def forward(self, x):
            return self.transform.postprocess(x, float(x.sum()))

    class Transform(_Transform):
        def postprocess(self, boxes, scale):
            return self._helper(boxes)

        def _helper(self, boxes):
            raise RuntimeError("operation not permitted when stream is capturing")

    net = Syncs()
    net.transform = Transform()
    try:
        net(torch.ones(2, 3))
    except RuntimeError as exc:
        found = submodule_method(exc, BreakPlan(net, "auto"))
    assert found == (net.transform, "postprocess")  # the call the top-level code made, not its helper


def test_auto_breaks_drop_cublas_workspaces_between_the_throw_away_and_the_final_capture(monkeypatch):
    """The throw-away captures of breaks='auto' made cuBLAS's workspace in their own pools: the final capture must
    not find it cached (it replayed into freed memory: an illegal memory access in notebook 09 on the H200)."""
    from cgutils.capture import piecewise
    from cgutils.capture.breakplan import BreakPlan

    events = []

    class FakeCapture:
        def __init__(self, plan, pool, stream, keep_graph=False):
            self.pool, self.result = pool, "graph"

        def run(self, fn):
            events.append(("capture", self.pool))
            return fn()

        def abandon(self):
            events.append(("abandon", self.pool))

    pools = iter(range(100))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("throw-away", next(pools)))
    monkeypatch.setattr(piecewise, "PieceCapture", FakeCapture)
    monkeypatch.setattr(piecewise, "fresh_cublas_workspaces", lambda: events.append(("drop workspaces",)))
    model = nn.Linear(2, 2)
    graph, out = piecewise.capture_pieces(lambda: "out", BreakPlan(model, "auto"), ("final", 0), stream=None)
    assert (graph, out) == ("graph", "out")
    assert events == [("drop workspaces",), ("capture", ("throw-away", 0)), ("drop workspaces",),
                      ("capture", ("final", 0))]


class _Ticking:
    """Stands in for torch.cuda.Event: 'GPU time' is the order in which events were recorded, 1 ms apart."""
    clock = 0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        _Ticking.clock += 1
        self.at = _Ticking.clock

    def elapsed_time(self, other):
        return float(other.at - self.at)


def test_marked_replay_cuts_each_call_into_steps_and_restores_replay(monkeypatch):
    from cgutils.capture.piecewise import PiecewiseGraph

    monkeypatch.setattr(torch.cuda, "Event", _Ticking)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ran = []
    pg = PiecewiseGraph(pieces=[_Piece("a", ran)])
    with pg.marked() as marks:
        with pytest.raises(cg.InputError, match="already being marked"):
            with pg.marked():
                pass
        pg.replay()
        with pytest.raises(cg.InputError, match="at least two marked"):
            marks.table()
        pg.replay()
        pg.replay()
    table = marks.table()
    assert list(table.step) == ["piece 0", "to the next call"] * 2
    assert list(table.kind) == ["graph", "between calls"] * 2 and list(table.call) == [0, 0, 1, 1]
    assert (table.gpu_us == 1000.0).all() and (table.host_us >= 0).all()
    pg.replay()  # outside the block: no marks
    assert ran == ["a"] * 4 and len(marks.table()) == 4
