"""torch.distributed helpers on the CPU (gloo backend, two processes): the rank-divergence check that turns
a capture hang into an error, the communicator warm-up, and tensor-parallel linears equal to the unsharded
layers."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from cgutils.capture.ranks import agree_across_ranks, warm_up_collectives
from cgutils.errors import CaptureError, InputError
from cgutils.generation.tensor_parallel import ColumnParallelLinear, RowParallelLinear

WORLD = 2


def _worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        result = {}
        warm_up_collectives("cpu")
        torch.manual_seed(0)  # the same full layers on every rank, as loaded from one checkpoint
        fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        x = torch.randn(3, 8)
        full = fc2(nn.functional.gelu(fc1(x)))
        sharded = RowParallelLinear.from_linear(fc2)(nn.functional.gelu(ColumnParallelLinear.from_linear(fc1)(x)))
        result["max_err"] = float((sharded - full).abs().max())
        result["shard_rows"] = ColumnParallelLinear.from_linear(fc1).weight.shape[0]
        agree_across_ranks("x:(3, 8) float32", what="the MLP capture")  # same everywhere: no error
        try:
            agree_across_ranks(f"x:({2 + 2 * rank}, 8) float32", what="GraphRunner(mlp) capture")
        except CaptureError as exc:
            result["divergence"] = (exc.cause, str(exc))
        # tensor-parallel GPT-2 (2 ranks, 2 heads each) against transformers' greedy tokens
        from transformers import GPT2Config, GPT2LMHeadModel

        from cgutils import hf_generate
        from cgutils.generation.tensor_parallel import TensorParallelKVState, tp_generate
        torch.manual_seed(0)
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4)).eval()
        prompt = torch.randint(0, gpt2.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
        result["tp_tokens"] = tp_generate(gpt2, prompt, 12)
        result["tokens"] = hf_generate(gpt2, prompt, 12)
        # requests that differ between ranks: gloo aborted both processes on the first all-reduce
        for key, (p, n) in {"shape": (prompt[:, : 4 + rank], 3), "tokens": ((prompt + rank) % 100, 3),
                            "invalid": (prompt, 0 if rank == 0 else 3)}.items():
            try:
                tp_generate(gpt2, p, n)
            except CaptureError as exc:
                result[f"differ_{key}"] = str(exc)
        result["kv_heads"] = TensorParallelKVState(gpt2, 1, 16).kv_cache.shape[3]
        try:
            TensorParallelKVState(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=24, n_head=3)), 1, 8)
        except InputError as exc:
            result["bad_heads"] = str(exc)
        # GraphRunner as one rank of the group (CPU simulation of capture): same shapes capture, different
        # shapes are named on every rank before anything waits in a collective
        from simulation import SimulatedBackend

        import cgutils as cg
        torch.manual_seed(0)
        lin = nn.Linear(3, 3)
        runner = cg.GraphRunner(lin, distributed=True, backend=SimulatedBackend())
        result["same_shapes"] = float((runner(torch.ones(2, 3)) - lin(torch.ones(2, 3))).abs().max())
        try:
            runner(torch.ones(4 + 2 * rank, 3))  # a new shape on both ranks, so both capture
        except CaptureError as exc:
            result["runner_divergence"] = str(exc)
        torch.save(result, f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"{r}.pt") for r in range(WORLD)]


def test_tensor_parallel_mlp_equals_the_unsharded_one(results):
    for r in results:
        assert r["shard_rows"] == 16 // WORLD
        assert r["max_err"] < 1e-6


def test_tensor_parallel_gpt2_tokens_equal_transformers(results):
    for r in results:
        assert r["kv_heads"] == 4 // WORLD
        assert torch.equal(r["tp_tokens"], r["tokens"])
        assert "3 heads do not divide among 2 ranks" in r["bad_heads"]


def test_tp_generate_refuses_requests_that_differ_between_ranks(results):
    for r in results:
        assert "rank 0: 'prompt (2, 4) torch.int64" in r["differ_shape"] and "rank 1: 'prompt (2, 5)" in r["differ_shape"]
        assert "tokens sha256:" in r["differ_tokens"] and "ranks disagree about tp_generate's request" in r["differ_tokens"]
        assert r["differ_tokens"].endswith("Pass every rank the same prompt (tokens and shape) and the same max_new_tokens")
        assert "rank 0: 'an invalid request: max_new_tokens must be an int >= 1" in r["differ_invalid"]


def test_graph_runner_names_a_rank_that_would_capture_other_shapes(results):
    for r in results:
        assert r["same_shapes"] < 1e-6
        assert "rank 0: 'input:(4, 3) float32'" in r["runner_divergence"]
        assert "rank 1: 'input:(6, 3) float32'" in r["runner_divergence"]


def test_divergent_ranks_raise_on_every_rank_naming_each(results):
    for rank, r in enumerate(results):
        cause, message = r["divergence"]
        assert cause == "rank_divergence"
        assert f"this is rank {rank} of 2" in message
        assert "rank 0: 'x:(2, 8) float32'" in message and "rank 1: 'x:(4, 8) float32'" in message


def test_without_a_process_group_or_with_bad_shapes_the_errors_say_what_to_do():
    if not dist.is_initialized():
        with pytest.raises(InputError, match="init_process_group"):
            agree_across_ranks("x")
        with pytest.raises(InputError, match="init_process_group"):
            warm_up_collectives("cpu")
    with pytest.raises(InputError, match="not divisible"):
        ColumnParallelLinear(nn.Linear(3, 5), 0, 2)
    with pytest.raises(InputError, match="not divisible"):
        RowParallelLinear(nn.Linear(5, 3), 0, 2)
    with pytest.raises(InputError, match="nn.Linear"):
        ColumnParallelLinear(nn.Conv1d(2, 2, 1), 0, 2)
    for rank, world, match in ((2, 2, "rank 2 is not one of the 2 ranks"), (-1, 2, "rank must be an int >= 0"),
                               (0, 0, "world must be an int >= 1")):
        with pytest.raises(InputError, match=match):
            ColumnParallelLinear(nn.Linear(4, 4), rank, world)
        with pytest.raises(InputError, match=match):
            RowParallelLinear(nn.Linear(4, 4), rank, world)
    if not torch.cuda.is_available():
        from cgutils.errors import NoCudaError
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
            try:
                with pytest.raises(NoCudaError, match="pass device='cpu'"):
                    warm_up_collectives("cuda")
            finally:
                dist.destroy_process_group()
    with pytest.raises(InputError, match="this rank's 2 input features"):
        RowParallelLinear(nn.Linear(4, 3), 0, 2)(torch.ones(1, 4))  # the full activation, not the shard
    import cgutils as cg
    with pytest.raises(InputError, match="distributed must be"):
        cg.GraphRunner(nn.Linear(2, 2), distributed="world")


def _skipping_worker(rank, init_file, out_dir):
    """Rank 1 never reaches the comparison (it is busy elsewhere); rank 0 must not hang.

    Rank 1 stays alive until rank 0 has its error, so rank 0 meets the group's timeout and not a closed
    connection; both leave by ``os._exit``, because tearing down a gloo group after a timed-out collective can
    abort the process in C++ ("terminate called without an active exception", seen on CI), which is torch's
    teardown and not what this test is about."""
    import datetime
    import os
    import time

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=3))
    done = f"{out_dir}/skip0.pt"
    if rank == 0:
        result = {}
        try:
            agree_across_ranks("x:(2, 8) float32", what="GraphRunner(mlp) capture")
        except CaptureError as exc:
            result["timeout"] = (exc.cause, str(exc))
        torch.save(result, done + ".part")
        os.replace(done + ".part", done)
    else:
        deadline = time.monotonic() + 50
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)


def test_a_rank_that_never_comes_ends_in_an_error_not_a_hang(tmp_path):
    import time

    start = time.monotonic()
    mp.spawn(_skipping_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    assert time.monotonic() - start < 60
    result = torch.load(tmp_path / "skip0.pt")
    assert "timeout" in result, "rank 0's comparison returned although rank 1 never came"
    cause, message = result["timeout"]
    assert cause == "rank_divergence" and "rank 0 of 2 waited" in message and "GraphRunner(mlp) capture" in message
