"""Launch-overhead analysis: the fits and the crossover on known data (CPU), the sweeps on the GPU."""

import numpy as np
import pandas as pd
import pytest
import torch

import cgutils as cg
from cgutils import overhead
from cgutils.capture import graph_node_types


def test_fit_recovers_known_slopes():
    n = np.array([1, 2, 4, 8, 16, 32])
    df = pd.DataFrame({"n": n, "eager_us": 7.0 + 12.5 * n, "replay_us": 4.0 + 0.75 * n})
    fit = overhead.fit_per_launch(df)
    assert fit["eager_slope_us"] == pytest.approx(12.5) and fit["eager_intercept_us"] == pytest.approx(7.0)
    assert fit["replay_slope_us"] == pytest.approx(0.75) and fit["replay_intercept_us"] == pytest.approx(4.0)


def test_crossover_interpolates_in_log_space():
    df = pd.DataFrame({"elements": [10, 100, 1000, 10000], "kernel_us": [1.0, 1.0, 10.0, 100.0]})
    assert overhead.crossover(df, 10.0) == pytest.approx(1000)
    assert overhead.crossover(df, np.sqrt(10) * 10) == pytest.approx(np.sqrt(10) * 1000)
    assert overhead.crossover(df, 0.5) == 10  # already above at the smallest size
    assert np.isnan(overhead.crossover(df, 1000.0))  # never reached within the sweep


def test_cpu_dispatch_cost_runs_anywhere():
    df = overhead.cpu_dispatch_cost(ops=200, repeats=3)
    assert list(df.op) == ["torch.add(x, 1, out=y)", "x.add_(1)", "Python function call (floor)"]
    per = df.set_index("op").us_per_op
    assert (per > 0).all() and per["torch.add(x, 1, out=y)"] > per["Python function call (floor)"]


def test_graph_node_types_parses_cuda_dot():
    dot = ('digraph g {\n"g0_n0"[style="solid" shape="record" label="{KERNEL\\n| {ID | 0}}"];\n'
           '"g0_n1"[shape="record" label="{MEMSET\\n| {ID | 1}}"];\n"g0_n2"[label="{KERNEL| x}"];\n}')
    assert graph_node_types(dot) == {"KERNEL": 2, "MEMSET": 1}
    assert graph_node_types("not a graph") == {}


def test_cuda_functions_say_they_need_cuda(monkeypatch):
    """The check patched cgutils.env.cuda_available, which overhead no longer reads: on a GPU host it ran
    the sweep instead of testing the error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cg.NoCudaError, match="needs a CUDA device"):
        overhead.chain_sweep(lengths=(1,))


@pytest.mark.gpu
def test_replay_node_is_cheaper_than_eager_launch():
    chain = overhead.chain_sweep(lengths=(64, 256, 1024), iters=10, progress=False)
    fit = overhead.fit_per_launch(chain)
    assert 0 < fit["replay_slope_us"] < fit["eager_slope_us"]


@pytest.mark.gpu
def test_size_sweep_kernel_time_grows_with_size():
    sizes = overhead.size_sweep(sizes=(1, 10**7), repeat=5, iters=5, progress=False)
    assert sizes.kernel_us.iloc[1] > sizes.kernel_us.iloc[0] > 0


@pytest.mark.gpu
def test_runtime_calls_eager_vs_replay():
    from cgutils.capture import capture_graph

    x = torch.zeros(1, device="cuda")

    def run():
        for _ in range(5):
            x.add_(1)

    graph, _ = capture_graph(run, warmup=1)
    eager = overhead.runtime_calls(run)
    replay = overhead.runtime_calls(graph.replay)
    assert sum(v for k, v in eager.items() if k.startswith(("cudaLaunchKernel", "cuLaunchKernel"))) == 5
    assert replay.get("cudaGraphLaunch", 0) + replay.get("cuGraphLaunch", 0) == 1


def test_one_launch_is_the_median_over_the_chain_lengths_that_agree():
    """Notebook 01 and the numbers to remember each computed this median by hand (a copy-paste twin)."""
    import pandas as pd

    from cgutils.errors import InputError
    from cgutils.overhead import launch_cost

    chain = pd.DataFrame({"n": [1, 16, 64, 256, 1024, 4096], "eager_us_per_op": [30.0, 12.0, 9.5, 9.8, 10.4, 7.0]})
    assert launch_cost(chain) == {"median_us": 9.8, "min_us": 9.5, "max_us": 10.4, "n_min": 64, "n_max": 1024}
    with pytest.raises(InputError, match="chain lengths >= 64"):
        launch_cost(chain[chain.n < 64])
