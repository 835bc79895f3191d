"""Trace parsing and launch analysis on synthetic Kineto traces, and malformed input (hypothesis)."""

import gzip
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cgutils as cg
from cgutils.trace import load_trace, union_length


def ev(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 2, "ts": ts, "dur": dur, "args": args}


def kineto_events():
    """An eager step (three launch APIs), a graph replay of three kernels, a memcpy, and annotations."""
    return [
        ev("user_annotation", "forward", 0.0, 200.0),
        ev("cpu_op", "aten::add", 1.0, 12.0, **{"External id": 7}),
        ev("cuda_runtime", "cudaLaunchKernel", 5.0, 6.0, correlation=1),
        ev("kernel", "add_kernel", 20.0, 2.0, correlation=1, stream=7, device=0),
        ev("cuda_runtime", "cudaLaunchKernelExC", 15.0, 5.0, correlation=2),
        ev("kernel", "gemm", 30.0, 4.0, correlation=2, stream=7, device=0),
        ev("cuda_driver", "cuLaunchKernel", 25.0, 4.0, correlation=3),
        ev("kernel", "triton_fused", 40.0, 3.0, correlation=3, stream=7, device=0),
        ev("cuda_runtime", "cudaMemcpyAsync", 50.0, 3.0, correlation=4),
        ev("gpu_memcpy", "Memcpy DtoD", 55.0, 1.0, correlation=4, stream=7, device=0, bytes=4096),
        ev("user_annotation", "replay", 100.0, 80.0),
        ev("cuda_runtime", "cudaGraphLaunch", 101.0, 8.0, correlation=5),
        ev("kernel", "k1", 110.0, 5.0, correlation=5, stream=9, device=0),
        ev("kernel", "k2", 115.0, 5.0, correlation=5, stream=9, device=0),
        ev("kernel", "k3", 118.0, 4.0, correlation=5, stream=10, device=0),  # overlaps k2 on another stream
        ev("cuda_runtime", "cudaStreamSynchronize", 130.0, 40.0, correlation=6),
        ev("gpu_user_annotation", "replay", 110.0, 12.0),
        {"ph": "s", "cat": "ac2g", "id": 5, "ts": 101.0},  # flow events are ignored
        {"ph": "M", "name": "process_name", "args": {"name": "python"}},
    ]


def write(tmp_path, obj, name="t.json", gz=False):
    data = json.dumps(obj).encode()
    p = tmp_path / (name + (".gz" if gz else ""))
    p.write_bytes(gzip.compress(data) if gz else data)
    return p


@pytest.fixture
def trace(tmp_path):
    return load_trace(write(tmp_path, {"schemaVersion": 1, "traceEvents": kineto_events()}, gz=True))


def test_tables_and_units(trace):
    assert len(trace.kernels) == 6 and len(trace.memory) == 1 and len(trace.ops) == 1
    assert set(trace.runtime.api) == {"runtime", "driver"}
    assert trace.memory.bytes.iloc[0] == 4096 and trace.memory.kind.iloc[0] == "memcpy"
    assert list(trace.annotations.side) == ["cpu", "cpu", "gpu"]
    assert trace.kernels.ts.is_monotonic_increasing


def test_graph_launch_links_to_every_replayed_kernel(trace):
    links = trace.links()
    graph = links[links.call == "cudaGraphLaunch"]
    assert list(graph.name) == ["k1", "k2", "k3"]
    assert set(links.call) == {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemcpyAsync",
                               "cudaGraphLaunch"}  # cudaStreamSynchronize starts no GPU work


def test_launch_stats(trace):
    s = trace.launch_stats().set_index("call")
    assert s.loc["cudaLaunchKernel", "launch_delay_us"] == 15.0 and s.loc["cudaLaunchKernel", "cpu_us"] == 6.0
    g = s.loc["cudaGraphLaunch"]
    assert g.activities == 3 and g.gpu_us == 14.0 and g.span_us == 12.0 and g.launch_delay_us == 9.0


def test_summary_counts_overlap_once(trace):
    s = trace.summary()
    assert s.kernels == 6 and s.gpu_activities == 7 and s.launches == 5 and s.graph_launches == 1
    assert s.kernels_per_launch == pytest.approx(6 / 4) and s.activities_per_launch == pytest.approx(7 / 5)
    # busy = 2 + 4 + 3 + 1 + (110..122 union = 12)
    assert s.gpu_busy_us == pytest.approx(22.0)
    assert s.wall_us == pytest.approx(122.0 - 5.0)  # first launch call to last GPU activity end
    assert s.verdict.startswith("launch-bound")


def test_by_range(trace):
    r = trace.by_range("replay")
    assert r.launches.tolist() == [1] and r.activities.tolist() == [3] and r.gpu_span_us.tolist() == [12.0]
    with pytest.raises(cg.TraceFormatError, match="no CPU annotation named 'nope'.*forward"):
        trace.by_range("nope")


def test_compare(trace):
    df = cg.compare(trace, trace, labels=("eager", "graph"))
    assert df.loc["kernels", "graph / eager"] == 1.0


def testunion_length():
    import numpy as np

    assert union_length(np.array([0.0, 1.0, 5.0]), np.array([2.0, 3.0, 6.0])) == 4.0
    assert union_length(np.array([0.0, 1.0]), np.array([10.0, 2.0])) == 10.0
    assert union_length(np.array([]), np.array([])) == 0.0


def test_cpu_only_trace_is_a_correct_partial_result(tmp_path):
    t = load_trace(write(tmp_path, {"traceEvents": [ev("cpu_op", "aten::mm", 0, 5)]}))
    assert len(t.ops) == 1 and t.launch_stats().empty
    assert "no GPU activity" in t.summary().verdict


def test_events_missing_fields_are_skipped_and_counted(tmp_path):
    events = kineto_events() + [{"ph": "X", "cat": "kernel", "name": "x", "ts": 1.0},
                                {"ph": "X", "cat": "kernel", "name": "y", "ts": "soon", "dur": 1}]
    t = load_trace(write(tmp_path, {"traceEvents": events}))
    assert t.skipped == {"missing dur": 1, "ts or dur not a finite number (or dur < 0)": 1} and len(t.kernels) == 6


@pytest.mark.parametrize("content, needle", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"events": []}).encode(), "without a 'traceEvents' key"),
    (json.dumps([ev("kernel", "k", 0, 1)]).encode(), "a JSON array"),
    (gzip.compress(json.dumps({"traceEvents": kineto_events()}).encode())[:60], "truncated or corrupt"),
])
def test_bad_files_name_the_file_and_problem(tmp_path, content, needle):
    p = tmp_path / "bad.json"
    p.write_bytes(content)
    with pytest.raises(cg.TraceFormatError, match=needle) as info:
        load_trace(p)
    assert "bad.json" in str(info.value)


@pytest.mark.parametrize("bad", [{"ts": "nan", "dur": 1}, {"ts": 1, "dur": "inf"}, {"ts": 1, "dur": -5},
                                 {"ts": True, "dur": 1}])
def test_non_finite_negative_or_boolean_times_are_skipped(tmp_path, bad):
    """Regression: "nan"/"inf" strings, negative durations and booleans were read as numbers."""
    t = load_trace(write(tmp_path, {"traceEvents": kineto_events() + [{"ph": "X", "cat": "kernel", "name": "x", **bad}]}))
    assert len(t.kernels) == 6 and sum(t.skipped.values()) == 1
    assert 0 <= t.summary().gpu_busy_fraction <= 1


def test_missing_and_shared_correlation_ids_are_never_joined(tmp_path):
    """Regression: id -1 (missing) and ids shared by two calls were merged, giving wrong launch stats."""
    events = [ev("cuda_runtime", "cudaLaunchKernel", 0, 5), ev("kernel", "a", 10, 1),  # no correlation
              ev("cuda_runtime", "cudaLaunchKernel", 100, 5), ev("kernel", "b", 110, 1),
              ev("cuda_runtime", "cudaLaunchKernel", 200, 5, correlation=9), ev("kernel", "c", 210, 1, correlation=9),
              ev("cuda_runtime", "cudaLaunchKernel", 300, 5, correlation=9), ev("kernel", "d", 310, 1, correlation=9)]
    t = load_trace(write(tmp_path, {"traceEvents": events}))
    assert t.links().empty and t.launch_stats().empty
    assert t.skipped == {"runtime calls sharing a correlation id (not linked)": 2}


def test_a_graph_launch_written_as_runtime_and_driver_call_stays_linked(tmp_path):
    """A cudaGraphLaunch and the cuGraphLaunch it made, both under one correlation id, were both unlinked: the
    graph's kernels counted as eager work. The runtime call keeps the link; the driver call is counted aside."""
    events = [ev("cuda_runtime", "cudaGraphLaunch", 0, 9, correlation=4),
              ev("cuda_driver", "cuGraphLaunch", 2, 5, correlation=4),
              ev("kernel", "k1", 20, 3, correlation=4), ev("kernel", "k2", 24, 3, correlation=4)]
    t = load_trace(write(tmp_path, {"traceEvents": events}))
    stats = t.launch_stats()
    assert stats.call.tolist() == ["cudaGraphLaunch"] and stats.activities.tolist() == [2]
    assert t.summary().graph_launches == 1
    assert cg.graph_coverage(t).summary.graphed_activity_fraction == 1.0
    assert list(t.skipped.values()) == [1] and "runtime call keeps the link" in next(iter(t.skipped))


def test_per_thread_stream_graph_launches_count_in_the_summary(tmp_path):
    """cudaGraphLaunch_ptsz and hipGraphLaunch_spt counted 0 graph launches in the summary (an exact-name set)
    and 2 in the coverage check (a substring rule): one rule now serves both."""
    events = [ev("cuda_runtime", "cudaGraphLaunch_ptsz", 0, 9, correlation=1), ev("kernel", "k", 20, 3, correlation=1),
              ev("cuda_runtime", "hipGraphLaunch_spt", 40, 9, correlation=2), ev("kernel", "k", 60, 3, correlation=2)]
    t = load_trace(write(tmp_path, {"traceEvents": events}))
    assert t.summary().graph_launches == 2 == cg.graph_coverage(t).summary.graph_launches


def test_any_call_that_starts_gpu_work_is_a_launch(tmp_path):
    """Regression: calls outside a fixed name list (cudaMemcpy2DAsync, cuMemcpyHtoDAsync_v2) were not launches."""
    events = [ev("cuda_runtime", "cudaMemcpy2DAsync", 0, 5, correlation=1), ev("gpu_memcpy", "Memcpy2D", 10, 2, correlation=1),
              ev("cuda_driver", "cuMemcpyHtoDAsync_v2", 20, 5, correlation=2), ev("gpu_memcpy", "HtoD", 30, 2, correlation=2)]
    t = load_trace(write(tmp_path, {"traceEvents": events}))
    assert t.summary().launches == 2 and len(t.launch_stats()) == 2


def test_begin_end_events_are_counted_as_skipped(tmp_path):
    events = [{"ph": "B", "cat": "kernel", "name": "k", "ts": 0}, {"ph": "E", "cat": "kernel", "name": "k", "ts": 5}]
    with pytest.raises(cg.TraceFormatError, match="none of its 2 events could be read.*only complete 'X' events"):
        load_trace(write(tmp_path, {"traceEvents": events}))
    t = load_trace(write(tmp_path, {"traceEvents": kineto_events() + events}))
    assert len(t.kernels) == 6 and t.skipped == {"phase 'B' (only complete 'X' events are read)": 1, "phase 'E' (only complete 'X' events are read)": 1}


@pytest.mark.parametrize("doc, needle", [({"traceEvents": 5}, "traceEvents is number, not a list"),
                                         ({"traceEvents": {"a": 1}}, "traceEvents is start_map, not a list"),
                                         ({"traceEvents": None}, "traceEvents is null, not a list")])
def test_non_list_trace_events_is_an_error(tmp_path, doc, needle):
    """Regression: a non-list traceEvents loaded as an empty trace."""
    with pytest.raises(cg.TraceFormatError, match=needle):
        load_trace(write(tmp_path, doc))


def test_directory_and_json_errors_are_one_clear_line(tmp_path):
    with pytest.raises(cg.TraceFormatError, match="is a directory"):
        load_trace(tmp_path)
    p = tmp_path / "bin.json"
    p.write_bytes(b"\x00\x01garbage\nmore")
    with pytest.raises(cg.TraceFormatError) as info:
        load_trace(p)
    assert "\n" not in str(info.value) and "not valid JSON" in str(info.value)


def test_empty_trace_verdict(tmp_path):
    assert load_trace(write(tmp_path, {"traceEvents": []})).summary().verdict == "empty trace"


def test_missing_file(tmp_path):
    with pytest.raises(cg.TraceFormatError, match="no such trace file"):
        load_trace(tmp_path / "none.json")


def test_all_events_unreadable_is_an_error(tmp_path):
    with pytest.raises(cg.TraceFormatError, match="none of its 2 events"):
        load_trace(write(tmp_path, {"traceEvents": [{"cat": "kernel", "ph": "X"}, {"cat": "kernel", "ph": "X"}]}))


json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20)
event_like = st.fixed_dictionaries({}, optional={
    "ph": st.sampled_from(["X", "B", "i", 3]), "cat": st.sampled_from(["kernel", "cuda_runtime", "gpu_memcpy",
                                                                       "user_annotation", "cpu_op", "x"]),
    "name": json_values, "ts": json_values, "dur": json_values, "args": json_values, "pid": json_values})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(event_like | json_values, max_size=12), cut=st.integers(min_value=0, max_value=400),
       gz=st.booleans())
def test_malformed_traces_never_raise_anything_else(tmp_path, events, cut, gz):
    data = json.dumps({"traceEvents": events}).encode()
    if cut:
        data = data[: max(1, len(data) - cut)]
    p = tmp_path / ("h.json.gz" if gz else "h.json")
    p.write_bytes(gzip.compress(data) if gz else data)
    try:
        t = load_trace(p)
    except cg.TraceFormatError as exc:
        assert str(p) in str(exc)
        return
    t.summary()
    t.launch_stats()  # a parsed trace always yields consistent summaries


@pytest.mark.gpu
def test_real_graph_replay_trace_links_every_kernel(tmp_path):
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).cuda().eval()
    x = torch.randn(4, 256, device="cuda")
    runner = cg.GraphRunner(model)
    runner(x)
    with cg.nvtx_range("forward"):
        pass
    path = cg.profile(lambda: runner(x), tmp_path / "replay", warmup=1, active=2)
    t = load_trace(path)
    graph = t.links()
    graph = graph[graph.call.isin(["cudaGraphLaunch", "cuGraphLaunch"])]
    assert graph.correlation.nunique() == 2  # one graph launch per active step
    replayed = t.kernels[t.kernels.correlation.isin(graph.correlation)]
    assert len(replayed) >= 2 * 8  # every Linear's kernel(s), per replay
    assert t.summary().graph_launches == 2


def test_annotations_reach_the_profiler_trace(tmp_path):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with cg.annotate_modules(model, depth=1) as hooks:
        path = cg.profile(lambda: model(torch.randn(2, 4)), tmp_path / "cpu", warmup=1, active=1)
    assert hooks.names == ["Sequential", "Sequential.0", "Sequential.1"]
    names = set(load_trace(path).annotations.name)
    assert {"Sequential", "Sequential.0", "Sequential.1"} <= names
    assert len(model._forward_pre_hooks) == 0  # removed on exit


def test_nvtx_range_as_decorator_and_nested():
    @cg.nvtx_range("outer")
    def f():
        with cg.nvtx_range("inner"):
            return 3

    assert f() == 3 and f() == 3
    with pytest.raises(ValueError, match="non-empty string"):
        cg.nvtx_range("")


def test_empty_tables_keep_numeric_times(tmp_path):
    """Regression: a trace without memcpy gave object-dtype times, and launch_stats fell back to a
    per-group Python loop (seconds on a 200k-event trace)."""
    events = [e for e in kineto_events() if e.get("cat") not in ("gpu_memcpy",)]
    t = load_trace(write(tmp_path, {"traceEvents": events}))
    assert t.memory.empty and t.memory.ts.dtype == "float64"
    assert t.device_activity().ts.dtype == "float64"


def test_a_bool_correlation_id_links_nothing(tmp_path):
    """`"correlation": true` was read as id 1: twenty unrelated kernels looked like one graph launch's."""
    events = [ev("cuda_runtime", "cudaLaunchKernel", 0.0, 2.0, correlation=1),
              ev("kernel", "k0", 5.0, 1.0, correlation=1, stream=7, device=0)]
    events += [ev("kernel", f"k{i}", 10.0 + i, 0.5, correlation=True, stream=7, device=0) for i in range(1, 21)]
    t = load_trace(write(tmp_path, {"traceEvents": events}))
    assert t.launch_stats().activities.tolist() == [1]
    assert t.skipped == {"correlation id not an integer (event kept, not linked)": 20}
    assert len(t.kernels) == 21


def test_kernels_per_launch_leaves_copies_out(tmp_path):
    """A memcpy call counted as a launch: the summary's kernels_per_launch mixed copies with graph launches."""
    s = load_trace(write(tmp_path, {"traceEvents": kineto_events()})).summary()
    assert s.launches == 5 and s.kernels == 6
    assert s.kernels_per_launch == 6 / 4  # three eager kernel launches and one graph launch


def test_a_cpu_only_trace_spans_its_cpu_events(tmp_path):
    events = [ev("cpu_op", "aten::mm", 0.0, 30.0), ev("user_annotation", "step", 5.0, 40.0)]
    s = load_trace(write(tmp_path, {"traceEvents": events})).summary()
    assert s.wall_us == 45.0 and s.verdict == "no GPU activity in this trace (CPU-only?)"


def test_cuda_calls_without_cuda_activity_say_the_activity_was_not_recorded(tmp_path):
    """A trace with cudaGraphLaunch calls but no kernels (ProfilerActivity.CUDA left out) was called CPU-only."""
    events = [ev("cpu_op", "aten::mm", 0.0, 30.0), ev("cuda_runtime", "cudaGraphLaunch", 5.0, 4.0, correlation=3)]
    s = load_trace(write(tmp_path, {"traceEvents": events})).summary()
    assert s.verdict.startswith("CUDA activity not recorded: 1 CUDA/HIP") and "ProfilerActivity.CUDA" in s.verdict


def test_an_empty_trace_events_list_is_an_empty_trace(tmp_path):
    t = load_trace(write(tmp_path, {"traceEvents": []}))
    assert t.summary().verdict == "empty trace" and t.kernels.empty


def test_union_length_and_is_graph_launch_refuse_bad_input():
    """A new user got raw numpy/pandas errors, and -4.0 for an end before its start, before these checks."""
    import numpy as np
    import pandas as pd

    from cgutils.errors import InputError
    from cgutils.trace import is_graph_launch, union_length

    assert union_length([0, 2], [3, 4]) == 4.0  # lists work
    for bad in (([5.0], [1.0]), ([0.0, np.nan], [1.0, 2.0]), ([0.0, 1.0], [2.0]), (np.zeros((2, 2)), np.ones((2, 2))),
                (["a"], ["b"])):
        with pytest.raises(InputError):
            union_length(*bad)
    assert is_graph_launch(["cudaGraphLaunch", "cudaLaunchKernel"]).tolist() == [True, False]
    assert is_graph_launch(pd.Series(["cuGraphLaunch_ptsz"], index=[7])).index.tolist() == [7]
    with pytest.raises(InputError):
        is_graph_launch("cudaGraphLaunch")
