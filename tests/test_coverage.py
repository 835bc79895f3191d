"""Graph coverage of a trace (issue 26): the share of GPU work inside graph launches and the eager islands, on
synthetic Kineto traces and on the recorded BERT-base traces, checked against the parser's kernel-level links."""

import pytest
from test_trace import ev, kineto_events, write

import cgutils as cg
from cgutils.trace import is_graph_launch, load_trace


def test_islands_busy_time_and_context_of_a_synthetic_trace(tmp_path):
    """kineto_events: four eager activities (three launch APIs and a copy), then a replay of three kernels."""
    extra = [ev("cuda_runtime", "cudaLaunchKernel", 190.0, 3.0, correlation=7),
             ev("kernel", "after", 195.0, 2.0, correlation=7, stream=7, device=0),
             ev("kernel", "orphan", 198.0, 1.0, correlation=99, stream=7, device=0),  # no runtime call: unattributed
             ev("kernel", "lost1", 300.0, 1.0, correlation=98, stream=7, device=0),  # two from one missing call:
             ev("kernel", "lost2", 302.0, 1.0, correlation=98, stream=7, device=0)]  # a replay's, most likely
    events = kineto_events()
    for e in events:  # the replay runs on the stream the eager work used (k3, a branch, on another one)
        if e.get("name") in ("k1", "k2"):
            e["args"]["stream"] = 7
    cov = cg.graph_coverage(load_trace(write(tmp_path, {"traceEvents": events + extra})))
    s = cov.summary
    assert (s.activities, s.graphed_activities, s.kernels, s.graphed_kernels) == (11, 3, 10, 3)
    assert s.graphed_busy_us == pytest.approx(12.0)  # k1 110-115, k2 115-120, k3 118-122 overlap once
    assert s.gpu_busy_us == pytest.approx(2 + 4 + 3 + 1 + 12 + 2 + 1 + 2)
    assert (s.graph_launches, s.unattributed, s.unattributed_shared, s.islands) == (1, 3, 2, 2)
    first, second = cov.islands.to_dict("records")
    assert (first["activities"], first["kernels"], first["launch_calls"]) == (4, 3, 4)
    assert (first["cpu_op"], first["range"], first["first"], first["last"]) == ("aten::add", "forward", "add_kernel",
                                                                                  "Memcpy DtoD")
    assert (second["activities"], second["launch_calls"], second["first"], second["last"]) == (4, 1, "after", "lost2")
    assert "27.3% of 11 GPU activities ran in 1 graph launch; 2 eager islands; 2 more activities share" in str(cov)


def test_a_trace_without_gpu_work_has_no_islands(tmp_path):
    cov = cg.graph_coverage(load_trace(write(tmp_path, {"traceEvents": [ev("cpu_op", "aten::mm", 0, 5)]})))
    assert cov.summary.activities == 0 and cov.islands.empty and cov.summary.graphed_time_fraction != 0.0


@pytest.mark.parametrize("name, graphed", [("bert_eager", False), ("bert_replay", True)])
def test_recorded_traces_agree_with_the_kernel_level_links(name, graphed):
    path = cg.env.REPO_ROOT / "results" / "nvidia-h200" / "traces" / f"{name}.json.gz"
    trace = load_trace(path)
    cov = cg.graph_coverage(trace)
    links = trace.links()
    truth = links[is_graph_launch(links.call) & (links.kind == "kernel")]
    assert cov.summary.graphed_kernels == len(truth) and cov.summary.kernels == len(trace.kernels)
    if graphed:  # a replay's kernels all come from its graph launches; only the runner's copies are eager
        assert cov.summary.graphed_kernels == cov.summary.kernels
        assert (cov.islands.kernels == 0).all() and cov.summary.graphed_time_fraction > 0.9
    else:
        assert cov.summary.graphed_activities == 0 and len(cov.islands) == 1
        assert cov.islands.activities.iloc[0] == cov.summary.activities


def test_the_cli_prints_coverage_and_islands(capsys):
    from cgutils.__main__ import main

    path = cg.env.REPO_ROOT / "results" / "nvidia-h200" / "traces" / "bert_replay.json.gz"
    assert main(["trace", str(path), "--coverage", "--islands", "2"]) == 0
    out = capsys.readouterr().out
    assert "graph coverage:" in out and "eager islands (first 2 of 3" in out


def test_per_thread_stream_launches_devices_and_processes(tmp_path):
    """From a new user's pass: cudaGraphLaunch_ptsz replays counted as eager; islands and busy time crossed devices;
    the CPU op came from another process with the same thread id."""
    def on(dev, e):
        e["args"]["device"] = dev
        return e

    events = [
        ev("cpu_op", "aten::add", 0.0, 50.0), {**ev("cpu_op", "OTHER_PROC_op", 0.0, 60.0), "pid": 9},
        ev("cuda_runtime", "cudaLaunchKernel", 1.0, 1.0, correlation=1), on(0, ev("kernel", "e1", 10.0, 2.0, correlation=1)),
        ev("cuda_runtime", "cudaGraphLaunch_ptsz", 2.0, 1.0, correlation=2),
        on(1, ev("kernel", "g1", 11.0, 2.0, correlation=2)), on(1, ev("kernel", "g2", 13.0, 2.0, correlation=2)),
        ev("cuda_runtime", "cudaLaunchKernel", 3.0, 1.0, correlation=3), on(0, ev("kernel", "e2", 14.0, 2.0, correlation=3)),
    ]
    cov = cg.graph_coverage(load_trace(write(tmp_path, {"traceEvents": events})))
    s = cov.summary
    assert (s.graph_launches, s.graphed_activities, s.islands) == (1, 2, 1)  # e1, e2: one island on device 0
    assert s.gpu_busy_us == pytest.approx(8.0) and s.graphed_busy_us == pytest.approx(4.0)  # per device, summed
    assert cov.islands.cpu_op.tolist() == ["aten::add"]


def test_what_is_not_a_trace_is_refused_and_an_empty_one_says_so(tmp_path):
    with pytest.raises(cg.InputError, match="load_trace"):
        cg.graph_coverage({"traceEvents": []})
    cov = cg.graph_coverage(load_trace(write(tmp_path, {"traceEvents": [ev("cpu_op", "aten::mm", 0, 5)]})))
    assert str(cov) == "graph coverage: no GPU activity in this trace"


def test_work_on_another_stream_neither_ends_nor_splits_an_island(tmp_path):
    """Regression (HTA's trace_diff trace): NCCL kernels on a communication stream, running while graph kernels ran
    on the compute stream, were cut into 54 one-activity islands; with two GPUs the islands came out device by
    device, not in time order, and named neither."""
    events = [ev("cuda_runtime", "cudaGraphLaunch", 0.0, 2.0, correlation=1)]
    events += [ev("kernel", f"g{i}", 10.0 + 10 * i, 5.0, correlation=1, stream=7, device=0) for i in range(4)]
    events += [ev("cuda_runtime", "cudaLaunchKernel", 1.0 + i, 0.5, correlation=10 + i) for i in range(3)]
    events += [ev("kernel", f"nccl{i}", 12.0 + 10 * i, 6.0, correlation=10 + i, stream=14, device=0) for i in range(3)]
    events += [ev("cuda_runtime", "cudaLaunchKernel", 5.0, 0.5, correlation=20),
               ev("kernel", "other_gpu", 11.0, 1.0, correlation=20, stream=7, device=1)]
    cov = cg.graph_coverage(load_trace(write(tmp_path, {"traceEvents": events})))
    isl = cov.islands
    assert len(isl) == 2 and list(isl.start_us) == sorted(isl.start_us)
    assert list(zip(isl.device, isl.stream, isl.activities)) == [(1, 7, 1), (0, 14, 3)]


@pytest.mark.parametrize("field, value", [("device", [0]), ("pid", {"a": 1}), ("tid", [1])])
def test_lists_and_objects_as_ids_do_not_raise_pandas_errors(tmp_path, field, value):
    """Regression (hand-made traces): a list or object as args.device, pid or tid raised 'unhashable type'."""
    launch, kernel = (ev("cuda_runtime", "cudaLaunchKernel", 0.0, 1.0, correlation=1),
                      ev("kernel", "k", 5.0, 1.0, correlation=1, stream=7, device=0))
    if field == "device":
        kernel["args"]["device"] = value
    else:
        launch[field] = value
    cov = cg.graph_coverage(load_trace(write(tmp_path, {"traceEvents": [launch, kernel]})))
    assert cov.summary.activities == 1 and len(cov.islands) == 1


def test_zero_duration_and_path_arguments(tmp_path):
    import pathlib

    path = write(tmp_path, {"traceEvents": [ev("cuda_runtime", "cudaGraphLaunch", 0.0, 1.0, correlation=1),
                                            ev("kernel", "k", 5.0, 0.0, correlation=1, stream=7, device=0)]})
    cov = cg.graph_coverage(pathlib.PurePosixPath(path))  # any os.PathLike, as load_trace takes
    assert "nan" not in str(cov) and "no GPU-busy time" in str(cov)
    with pytest.raises(cg.InputError, match="empty path"):
        cg.graph_coverage("")


def test_each_island_names_its_own_first_and_last_activity(tmp_path):
    """Islands on two streams, numbered by time, took their first/last kernel names by row position: the
    stream-7 island (kernA, kernB at t=105) was labelled kernC..kernD, the stream-13 one kernA..kernB."""
    k = lambda name, ts, corr, stream: ev("kernel", name, ts, 10, correlation=corr, stream=stream, device=0)  # noqa: E731
    events = [ev("cuda_runtime", "cudaLaunchKernel", 100, 5, correlation=1),
              ev("cuda_runtime", "cudaLaunchKernel", 110, 5, correlation=2),
              ev("cuda_runtime", "cudaGraphLaunch", 150, 5, correlation=3),
              ev("cuda_runtime", "cudaLaunchKernel", 300, 5, correlation=4),
              ev("cuda_runtime", "cudaLaunchKernel", 310, 5, correlation=5),
              k("kernA", 105, 1, 7), k("kernB", 120, 2, 7), k("g1", 160, 3, 7), k("g2", 175, 3, 7),
              k("kernC", 305, 4, 13), k("kernD", 320, 5, 13)]
    islands = cg.graph_coverage(load_trace(write(tmp_path, {"traceEvents": events}))).islands
    assert islands[["stream", "first", "last"]].values.tolist() == [[7, "kernA", "kernB"], [13, "kernC", "kernD"]]
