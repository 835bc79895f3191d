"""GPU tests (``pytest -m gpu``) for graph inspection (node tables, module attribution, trace join) and
piecewise capture (graph pieces around modules that cannot be captured)."""

import warnings

import pytest
import torch
from torch import nn

import cgutils as cg
from cgutils.errors import CaptureError

pytestmark = pytest.mark.gpu


class Guard(nn.Module):
    """A NaN check: a Python ``if`` on a CUDA tensor, so a CPU-GPU sync that capture cannot hold."""

    def forward(self, x):
        if not torch.isfinite(x).all():
            raise FloatingPointError("non-finite activations")
        return x


class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class GuardedStack(nn.Module):
    def __init__(self, depth=4, guard_at=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.guard, self.guard_at = Guard(), guard_at

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i == self.guard_at:
                x = self.guard(x)
            x = block(x)
        return x


def _model():
    torch.manual_seed(0)
    return GuardedStack().cuda().eval()


def test_whole_graph_fails_and_auto_breaks_capture_the_rest():
    model, x = _model(), torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        expected = model(x)
    with pytest.raises(CaptureError):
        cg.GraphRunner(model)(x)
    runner = cg.GraphRunner(model, breaks="auto")
    got = runner(x)
    assert cg.max_rel_error(got, expected) <= 1e-5
    pieces = runner.pieces()
    assert list(pieces.kind) == ["graph", "eager", "graph"]
    assert pieces.name.iloc[1] == "guard" and pieces.why.iloc[1]
    x2 = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        expected2 = model(x2)
    assert cg.max_rel_error(runner(x2), expected2) <= 1e-5  # replay reads the new input through the break
    times = runner.segment_times(iters=3)
    assert len(times) == 3 and (times.us > 0).all()


def test_named_break_and_break_that_raises_at_replay():
    model = _model()
    runner = cg.GraphRunner(model, breaks=["guard"])
    x = torch.randn(8, 64, device="cuda")
    runner(x)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError):  # the eager break still checks every call
        runner(bad)


def test_break_shape_change_is_named():
    class Shrink(nn.Module):
        def forward(self, x):
            return x[: int(x.sum().item() > 0) + 1]  # data-dependent length

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.cut, self.post = nn.Linear(4, 4), Shrink(), nn.Linear(4, 4)

        def forward(self, x):
            return self.post(self.cut(self.pre(x)))

    torch.manual_seed(0)
    m = M().cuda().eval()
    runner = cg.GraphRunner(m, breaks="auto", validate=False)
    x = torch.ones(4, 4, device="cuda")
    runner(x)
    with pytest.raises(CaptureError, match="captured as"):
        for sign in (1.0, -1.0, 1.0, -1.0):
            runner(x * sign * 100)


def test_sync_in_top_level_function_is_explained():
    lin = nn.Linear(4, 4).cuda()

    def f(x):
        y = lin(x)
        if y.sum() > 0:
            y = y * 2
        return y

    with pytest.raises(CaptureError, match="top-level function"):
        cg.GraphRunner(f, breaks="auto")(torch.randn(2, 4, device="cuda"))
    # the caller's stream and generators are usable afterwards
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.randn(3, device="cuda")


def test_node_table_attributes_nodes_to_modules_and_matches_trace(tmp_path):
    pytest.importorskip("cuda.bindings")
    model, x = _model(), torch.randn(8, 64, device="cuda")
    model.guard_at = 99  # no guard: one whole graph
    runner = cg.GraphRunner(model, inspect=True)
    runner(x)
    table = runner.node_table()
    kernels = table[table.type == "KERNEL"]
    assert len(kernels) >= 8  # two linears and a ReLU per block, plus adds
    assert (kernels.kernel != "").all() and (kernels.module != "").mean() >= 0.99
    assert set(kernels.module) >= {"blocks.0.fc1", "blocks.3.fc2"}
    assert "digraph" in cg.to_dot(table)
    path = cg.profile(lambda: runner(x), tmp_path / "replay.json.gz", warmup=1, active=2)
    timed = cg.node_times(table, cg.load_trace(path))
    assert timed.attrs["activities"] == timed.attrs["matched"] == len(kernels) + (table.type.isin(["MEMSET", "MEMCPY"])).sum()
    per_module = cg.time_by_module(timed, depth=2)
    assert abs(per_module.gpu_us.sum() - timed.attrs["launch_gpu_us"]) <= 0.05 * timed.attrs["launch_gpu_us"]


def test_node_table_without_inspect_says_how():
    runner = cg.GraphRunner(nn.Linear(4, 4).cuda().eval())
    runner(torch.randn(2, 4, device="cuda"))
    with pytest.raises(cg.InputError, match="inspect=True"):
        runner.node_table()


def test_piecewise_node_table_has_pieces():
    pytest.importorskip("cuda.bindings")
    runner = cg.GraphRunner(_model(), breaks="auto", inspect=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner(torch.randn(8, 64, device="cuda"))
    table = runner.node_table()
    assert set(table.piece) == {0, 1}
    assert not (table.module == "guard").any()  # the break ran eagerly: none of its work is in a graph
    # one index space across pieces (each piece's table started again at 0, so to_dot merged nodes)
    assert list(table["index"]) == list(range(len(table)))
    for piece, deps in zip(table.piece, table.depends_on, strict=True):
        assert set(table.piece[table["index"].isin(deps)]) <= {piece}
    # the attribution saw the final capture only, not the captures that found the break
    assert len(runner._entry(-1).attribution.order) == len(table)
    with pytest.raises(cg.InputError, match="one at a time"):
        cg.node_times(table, None)


def test_runner_captures_again_after_a_failed_capture():
    """A failed capture leaves its pool refusing later captures ("beginAllocateToPool: already recording to
    mempool_id", torch 2.11): the runner's next capture failed even once the cause was gone."""
    model, x = _model(), torch.randn(8, 64, device="cuda")
    runner = cg.GraphRunner(model)
    with pytest.raises(CaptureError):
        runner(x)
    model.guard_at = 99
    with torch.no_grad():
        expected = model(x)
    assert cg.max_rel_error(runner(x), expected) <= 1e-5


def test_capture_error_marks_the_failing_line():
    with pytest.raises(CaptureError, match="capture failed here") as info:
        cg.GraphRunner(_model())(torch.randn(8, 64, device="cuda"))
    assert "isfinite" in str(info.value)


def test_auto_breaks_with_an_ordinary_error_raise_it_and_leave_state_alone():
    """An ordinary error while "auto" tried a capture: the throw-away pool was released by hand and again by
    the graph's destructor (a double release in the allocator); then the caller's stream was made to wait on
    the still-capturing stream, an error ("legacy stream depend on a capturing blocking stream") that hid the
    model's own."""
    import gc

    class FailsWhenCaptured(nn.Module):
        def forward(self, x):
            if torch.cuda.is_current_stream_capturing():
                raise ValueError("a bug in the model, not a sync")
            return x

    model = nn.Sequential(nn.Linear(4, 4), FailsWhenCaptured()).cuda().eval()
    stream = torch.cuda.current_stream()
    with pytest.raises(CaptureError, match="a bug in the model"):
        cg.GraphRunner(model, breaks="auto")(torch.randn(2, 4, device="cuda"))
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.current_stream() == stream
    torch.randn(3, device="cuda")


def test_a_break_called_first_leaves_the_pool_and_the_process_usable():
    """The piece before a break that the root calls first captured nothing; its graph was dropped, and with it
    the pool's last reference, so the next piece's capture_begin asserted (use_count > 0) and every later capture
    or reduce-overhead compile in the process asserted too (use_count == 0): torchvision's Faster R-CNN with
    breaks="auto" (its transform runs first)."""

    class Syncs(nn.Module):
        def forward(self, x):
            return x * float(x.abs().sum().item() > 0)  # a host sync: a break

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.lin = Syncs(), nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(self.first(x))

    m = Model().cuda().eval()
    x = torch.randn(4, 8, device="cuda")
    with torch.no_grad():
        runner = cg.GraphRunner(m, breaks="auto")
        out = runner(x)
        assert cg.max_rel_error(out, m(x)) < 1e-4
        assert runner.pieces().name.tolist()[:2] == ["piece 0 (empty)", "first"]
        assert cg.GraphRunner(lambda x: x * 3)(x).sum().item() == pytest.approx(3 * x.sum().item(), rel=1e-5)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x + 1
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x + 1)


def test_auto_break_runners_replay_after_later_captures_in_a_process_of_their_own():
    """Three breaks='auto' runners of BERT-base built one after another, then replayed in turns: the first runner's
    replay hit an illegal memory access (its pieces used the cuBLAS workspace of a freed throw-away pool; notebook
    09 on the H200). In its own process: such a fault poisons the CUDA context."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent / "gpu_cases" / "auto_breaks_workspace.py"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "REPLAYS OK" in run.stdout, f"rc {run.returncode}\n{run.stdout}\n{run.stderr[-4000:]}"


def test_step_marks_time_each_piece_and_break_and_leave_the_runner_as_it_was():
    model = _model()
    runner = cg.GraphRunner(model, breaks="auto")
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        expected = model(x)
    runner(x)
    graph_before = runner._entry(-1).graph
    with runner.step_marks() as marks:
        for _ in range(3):
            got = runner(x)
    table = marks.table()
    assert list(table.kind[:4]) == ["graph", "eager", "graph", "between calls"] and set(table.call) == {0, 1}
    assert (table.gpu_us >= 0).all() and (table.host_us > 0).all()
    assert runner._entry(-1).graph is graph_before and cg.max_rel_error(got, expected) <= 1e-5
    whole = cg.GraphRunner(lambda t: t * 2 + 1)
    whole(x)
    kept = whole._entry(-1).graph
    with whole.step_marks() as marks:
        whole(x), whole(x)
    assert list(marks.table().step) == ["piece 0", "to the next call"]
    assert whole._entry(-1).graph is kept  # the whole graph is back, not the one-piece stand-in
