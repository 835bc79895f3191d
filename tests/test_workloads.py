import pytest
import torch

import cgutils as cg
from cgutils.workloads import GPT2_NEW_TOKENS, WORKLOADS


def test_workloads_and_article_figures():
    assert set(WORKLOADS) == {"bert-base-seq128", "bert-base-seq512", "gpt2-generate100", "resnet50"}
    # the source article's table (A100, batch 1)
    assert WORKLOADS["resnet50"].article_ms == (1.8, 1.2)
    assert WORKLOADS["gpt2-generate100"].article_ms == (245.0, 238.0)


def test_unknown_names_are_clear():
    with pytest.raises(cg.InputError, match="known: bert-base-seq128"):
        cg.get_workload("bert")
    with pytest.raises(cg.InputError, match="unknown dtype 'fp8'"):
        WORKLOADS["resnet50"].build("fp8", "cpu")


def test_building_on_cuda_without_cuda_says_what_to_do(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(cg.NoCudaError, match=r"resnet50.build\(device='cuda'\) needs a CUDA device.*device='cpu'"):
        WORKLOADS["resnet50"].build("fp32", "cuda")


def test_resnet_builds_on_cpu_with_deterministic_inputs():
    built = WORKLOADS["resnet50"].build("fp32", "cpu")
    (x,) = built.inputs(0)
    assert x.shape == (1, 3, 224, 224) and x.dtype == torch.float32
    assert torch.equal(built.inputs(0)[0], x) and not torch.equal(built.inputs(1)[0], x)
    with torch.no_grad():
        assert built.iterate(built.step, (x,)).shape == (1, 1000)


def test_gpt2_iteration_generates_100_tokens_on_cpu():
    built = WORKLOADS["gpt2-generate100"].build("fp32", "cpu")
    (ids,) = built.inputs(0)
    calls = []

    def fake_step(t):  # stands in for the model: records shapes, returns one token
        calls.append(t.shape[1])
        return torch.zeros(1, 1, dtype=torch.int64)

    out = built.iterate(fake_step, (ids,))
    assert out.shape == (1, ids.shape[1] + GPT2_NEW_TOKENS)
    assert calls == list(range(ids.shape[1], ids.shape[1] + GPT2_NEW_TOKENS))  # one new shape per step
    assert built.shapes_change and built.steps_per_iter == GPT2_NEW_TOKENS
