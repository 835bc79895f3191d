"""What a decoding request is checked against, and the sizes it is padded to: shared by every decoder here.

A decoder keeps one static KV state (and its graphs) per (batch bucket, length bucket): a request's batch is
padded up to the next batch bucket by repeating its last row, and its cache length (prompt + new tokens) up to
the next length bucket, capped at GPT-2's position table (``config.n_positions``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..capture.buckets import pick_bucket
from ..checks import check_int, check_sizes
from ..errors import InputError

BATCH_BUCKETS = (1, 2, 4, 8)

LENGTH_BUCKETS = (128, 256, 512, 1024)



def check_gpt2(model: nn.Module, who: str) -> None:
    """Raise :class:`InputError` unless ``model`` looks like a transformers ``GPT2LMHeadModel``."""
    if not (hasattr(model, "transformer") and hasattr(model, "lm_head") and hasattr(model.config, "n_positions")):
        raise InputError(f"{who} needs a transformers GPT2LMHeadModel, got {type(model).__name__}")


def capped_length_buckets(model: nn.Module, length_buckets: Any) -> tuple[int, ...]:
    """The checked length buckets, capped at GPT-2's position table (a longer cache is useless)."""
    n_pos = model.config.n_positions
    return tuple(sorted({min(b, n_pos) for b in check_sizes("length_buckets", length_buckets,
                                                            example="(128, 256, 512, 1024)")}))


def check_prompt(model: nn.Module, prompt: Any, max_new_tokens: Any) -> tuple[int, int]:
    """Check a decoding request; returns the prompt's ``(batch, length)``. One host sync (the token-id range).

    Raises:
        InputError: ``prompt`` is not a non-empty (batch, length) int64 tensor on the model's device, holds
            ids outside ``[0, vocab)``, or ``max_new_tokens`` is not an int >= 1.
    """
    dev = model.lm_head.weight.device
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype != torch.int64:
        raise InputError("prompt must be a (batch, length) int64 tensor of token ids, got "
                         f"{getattr(prompt, 'dtype', type(prompt).__name__)} "
                         f"with shape {tuple(getattr(prompt, 'shape', ()))}")
    if prompt.device != dev:
        raise InputError(f"prompt is on {prompt.device} but the model is on {dev}; use prompt.to({str(dev)!r})")
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    b, T = prompt.shape
    if b == 0 or T == 0:
        raise InputError(f"prompt must hold at least one row and one token, got shape {tuple(prompt.shape)}")
    vocab = model.config.vocab_size
    lo, hi = torch.stack(torch.aminmax(prompt)).tolist()
    if lo < 0 or hi >= vocab:
        raise InputError(f"token ids must lie in [0, {vocab}), got values from {lo} to {hi}")
    return b, T


def pick_sizes(model: nn.Module, batch: int, length: int, batch_buckets: tuple, length_buckets: tuple) -> tuple[int, int]:
    """The (batch bucket, length bucket) that hold ``batch`` rows of ``length`` positions (prompt + new tokens).

    Raises:
        InputError: larger than the largest bucket, or than GPT-2's position table.
    """
    n_pos = model.config.n_positions
    B = pick_bucket(batch, batch_buckets, "batch size", "pass a larger batch_buckets=(..., n) or split the batch")
    S = pick_bucket(length, length_buckets, "prompt + new tokens",
                    f"GPT-2 holds at most {n_pos} positions: shorten the prompt or generate fewer tokens"
                    if length > n_pos else "pass a larger length_buckets=(..., n)")
    return B, S


def pad_rows(prompt: torch.Tensor, batch: int) -> torch.Tensor:
    """``prompt`` with its last row repeated up to ``batch`` rows (outputs of padding rows are sliced off)."""
    b, T = prompt.shape
    return torch.cat([prompt, prompt[-1:].expand(batch - b, T)]) if batch > b else prompt
