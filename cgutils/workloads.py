"""The seed workloads: BERT-base, ResNet-50 and GPT-2, built from configs with random weights.

No weights or tokenizers are downloaded at any point: the architectures come from the
``transformers`` configs (``BertConfig()`` and ``GPT2Config()`` defaults are bert-base-uncased and
gpt2, 124M parameters) and from ``torchvision.models.resnet50(weights=None)``. Random weights give the
same kernels and the same latency as trained ones; only the numbers computed differ.

Each workload is batch 1, as in the source article's table. A :class:`Built` workload separates the
*step* (the callable a graph captures) from the *iteration* (what one timed sample runs): for BERT
and ResNet they are the same forward; for GPT-2 the iteration is a greedy loop of 100 steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .checks import require_cuda
from .errors import InputError

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@dataclass
class Built:
    """A workload instantiated on a device.

    Attributes:
        model: the ``nn.Module`` in eval mode.
        step: the callable that a graph captures; ``step(*inputs)``.
        inputs: a factory ``inputs(seed) -> tuple`` of fresh, deterministic step inputs.
        iterate: ``iterate(step_impl, inputs) -> result`` runs one timed sample with a given
            implementation of ``step`` (eager, graphed, compiled).
        kernels_note: what one iteration contains, in words.
        shapes_change: the step's input shapes change within one iteration (one graph per shape).
        steps_per_iter: forwards (step calls) per iteration.
    """

    model: nn.Module
    step: Callable[..., Any]
    inputs: Callable[[int], tuple]
    iterate: Callable[[Callable[..., Any], tuple], Any]
    kernels_note: str = ""
    shapes_change: bool = False
    steps_per_iter: int = 1


@dataclass(frozen=True)
class Workload:
    """A named recipe for a :class:`Built` workload.

    Attributes:
        name: identifier used in tables and on the CLI, e.g. ``"bert-base-seq128"``.
        description: one line for tables.
        article_ms: the source article's (eager, graph) latency on an NVIDIA A100 at batch 1, ms, as
            published; ``None`` where the article has no such row.
    """

    name: str
    description: str
    builder: Callable[[torch.dtype, torch.device], Built] = field(repr=False)
    article_ms: tuple[float, float] | None = None

    def build(self, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cuda") -> Built:
        """Instantiate the model with random weights on ``device`` in ``dtype`` (``"fp32"``/``"fp16"``).

        Raises:
            InputError: for an unknown dtype name.
            NoCudaError: for a CUDA device when none is visible (pass ``device="cpu"``).
        """
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise InputError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
            dtype = DTYPES[dtype]
        if torch.device(device).type == "cuda":
            require_cuda(f"{self.name}.build(device='cuda')", "build(dtype, device='cpu') runs on the CPU")
        torch.manual_seed(0)  # same random weights every build
        return self.builder(dtype, torch.device(device))


def _single_forward(model: nn.Module, inputs: Callable[[int], tuple], note: str) -> Built:
    return Built(model=model, step=model, inputs=inputs,
                 iterate=lambda step, args: step(*args), kernels_note=note)


def _bert(seq_len: int) -> Callable[[torch.dtype, torch.device], Built]:
    def build(dtype: torch.dtype, device: torch.device) -> Built:
        from transformers import BertConfig, BertModel

        model = BertModel(BertConfig()).to(device=device, dtype=dtype).eval()
        vocab = model.config.vocab_size

        def inputs(seed: int) -> tuple:
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, vocab, (1, seq_len), generator=g)  # (B, T) int64
            mask = torch.ones(1, seq_len, dtype=torch.int64)  # (B, T)
            return ids.to(device), mask.to(device)

        def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

        built = _single_forward(model, inputs, f"one forward, batch 1, {seq_len} tokens")
        built.step = forward
        return built

    return build


def _resnet50(dtype: torch.dtype, device: torch.device) -> Built:
    import torchvision

    model = torchvision.models.resnet50(weights=None).to(device=device, dtype=dtype).eval()

    def inputs(seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(1, 3, 224, 224, generator=g).to(device=device, dtype=dtype),)  # (B, C, H, W)

    return _single_forward(model, inputs, "one forward, batch 1, 224x224 image")


GPT2_PROMPT_LEN = 32
GPT2_NEW_TOKENS = 100


def _gpt2(dtype: torch.dtype, device: torch.device) -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config()).to(device=device, dtype=dtype).eval()
    vocab = model.config.vocab_size

    def inputs(seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab, (1, GPT2_PROMPT_LEN), generator=g).to(device),)  # (B, T)

    def next_token(input_ids: torch.Tensor) -> torch.Tensor:
        # Full-prefix recompute (no KV cache): every step is a pure function of the token tensor, so
        # a graph can capture it; its shape grows by one per step, so each length is its own graph,
        # the source article's one-graph-per-shape runner. Notebook 06 replaces this with a static
        # KV cache and one graph for all steps.
        logits = model(input_ids=input_ids, use_cache=False).logits  # (B, T, V)
        return logits[:, -1, :].argmax(dim=-1, keepdim=True)  # (B, 1) int64

    def iterate(step: Callable[..., Any], args: tuple) -> torch.Tensor:
        ids = args[0]
        for _ in range(GPT2_NEW_TOKENS):
            ids = torch.cat([ids, step(ids)], dim=1)
        return ids  # (B, T + 100)

    return Built(model=model, step=next_token, inputs=inputs, iterate=iterate,
                 kernels_note=f"greedy decode of {GPT2_NEW_TOKENS} tokens after a "
                              f"{GPT2_PROMPT_LEN}-token prompt, full recompute per token",
                 shapes_change=True, steps_per_iter=GPT2_NEW_TOKENS)


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("bert-base-seq128", "BERT-base encoder, 128 tokens", _bert(128), (3.2, 2.4)),
    Workload("bert-base-seq512", "BERT-base encoder, 512 tokens", _bert(512), (11.8, 10.1)),
    Workload("gpt2-generate100", "GPT-2 (124M) greedy, 100 new tokens", _gpt2, (245.0, 238.0)),
    Workload("resnet50", "ResNet-50, one 224x224 image", _resnet50, (1.8, 1.2)),
]}
"""All seed workloads by name. ``article_ms`` source: the source article's table (NVIDIA A100, batch 1)."""


def get_workload(name: str) -> Workload:
    """Look up a workload by name.

    Raises:
        InputError: naming the known workloads when ``name`` is not one of them.
    """
    try:
        return WORKLOADS[name]
    except KeyError:
        raise InputError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
