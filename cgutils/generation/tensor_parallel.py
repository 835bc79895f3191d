"""Tensor-parallel greedy GPT-2 decoding: the static-KV-cache step of :mod:`cgutils.generation.static_kv`, split
across the ranks of a torch.distributed group (Megatron-LM's layout: Shoeybi et al. 2019, section 3).

:class:`ColumnParallelLinear` and :class:`RowParallelLinear` split an ``nn.Linear`` across the ranks: a
column-parallel layer keeps a slice of the output features (no communication), the row-parallel layer after it
a slice of the input features, and one all-reduce sums the partial outputs. The decode step keeps each rank's
share of the attention heads (their query/key/value columns, their rows of the output projection and their
slice of the KV cache) and of the MLP's hidden features; embeddings, layer norms and the LM head are
replicated. Two all-reduces per layer (after the attention output projection and after the MLP) sum the
partial results, so every rank holds the same hidden state and produces the same token. The step keeps fixed
shapes and addresses, as the one-GPU step does, so one CUDA graph per rank can hold it, all-reduces included
(NCCL documentation, "Using NCCL with CUDA Graphs").
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..capture.ranks import agree_across_ranks, rank_and_world
from ..checks import check_int
from ..errors import InputError
from .request import check_prompt
from .static_kv import StaticKVState

# --- tensor-parallel linear layers (Megatron-LM's column/row split) -----------------------------------


def _shard(n: int, rank: int, world: int, what: str) -> slice:
    world = check_int("world", world, minimum=1, why="the number of ranks")
    rank = check_int("rank", rank, minimum=0, why="this process's rank")
    if rank >= world:
        raise InputError(f"rank {rank} is not one of the {world} ranks (0..{world - 1}); use from_linear(linear), "
                         f"which reads both from the process group")
    if n % world:
        raise InputError(f"{what} ({n}) is not divisible by the number of ranks ({world}); choose a world size "
                         f"that divides it")
    size = n // world
    return slice(rank * size, (rank + 1) * size)


class ColumnParallelLinear(nn.Module):
    """This rank's slice of an ``nn.Linear``'s output features: ``(…, in) -> (…, out / world)``, no
    communication. Follow it with a :class:`RowParallelLinear` (or gather the outputs).

    Attributes:
        weight: ``(out / world, in)``; bias: ``(out / world,)`` or ``None``.
    """

    def __init__(self, linear: nn.Linear, rank: int, world: int):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise InputError(f"expected an nn.Linear, got {type(linear).__name__}")
        rows = _shard(linear.out_features, rank, world, "out_features")
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone()) if linear.bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: Any = None) -> ColumnParallelLinear:
        """This process's shard of ``linear`` (rank and world size from ``group``)."""
        return cls(linear, *rank_and_world(group))

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features_here={self.weight.shape[0]}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's slice of an ``nn.Linear``'s input features, followed by an all-reduce of the partial
    outputs: ``(…, in / world) -> (…, out)``, equal on every rank. The bias is added once, after the sum.

    Attributes:
        weight: ``(out, in / world)``; bias: ``(out,)`` or ``None``; group: the process group reduced over.
    """

    def __init__(self, linear: nn.Linear, rank: int, world: int, group: Any = None):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise InputError(f"expected an nn.Linear, got {type(linear).__name__}")
        cols = _shard(linear.in_features, rank, world, "in_features")
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.group = group

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: Any = None) -> RowParallelLinear:
        """This process's shard of ``linear`` (rank and world size from ``group``)."""
        return cls(linear, *rank_and_world(group), group=group)

    def extra_repr(self) -> str:
        return f"in_features_here={self.weight.shape[1]}, out_features={self.weight.shape[0]}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise InputError(f"RowParallelLinear expects this rank's {self.weight.shape[1]} input features (the "
                             f"output of a ColumnParallelLinear), got {x.shape[-1]}: pass the column-parallel "
                             f"layer's output, not the full activation")
        out = nn.functional.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)  # in place; captured as a collective kernel under NCCL
        return out + self.bias if self.bias is not None else out


# --- the static-KV GPT-2 step split across ranks -----------------------------------------------------


class TensorParallelKVState(StaticKVState):
    """A :class:`~cgutils.generation.StaticKVState` holding this rank's share of GPT-2.

    Buffers (besides the parent's, with ``kv_cache`` of shape ``(layers, 2, batch, heads / world, max_len,
    head_dim)``): per layer ``attn_w`` ``(C, 3 C / world)``, ``attn_b``, ``proj_w`` ``(C / world, C)``,
    ``fc_w`` ``(C, 4 C / world)``, ``fc_b``, ``mlp_proj_w`` ``(4 C / world, C)``, in the model's dtype.

    Raises:
        InputError: torch.distributed is not initialised, or the heads or MLP width do not divide by the
            world size.
    """

    def __init__(self, model: nn.Module, batch: int, max_len: int, *, group: Any = None):
        rank, world = rank_and_world(group)
        cfg = model.config
        if cfg.n_head % world:
            raise InputError(f"GPT-2's {cfg.n_head} heads do not divide among {world} ranks; use a world size that "
                             f"divides the head count")
        heads = cfg.n_head // world
        super().__init__(model, batch, max_len, heads=heads)  # this rank's heads only in the KV cache
        self.group, self.world = group, world
        C, D = cfg.n_embd, self.head_dim
        cols = torch.arange(rank * heads * D, (rank + 1) * heads * D)
        qkv = torch.cat([cols + j * C for j in range(3)])  # this rank's q, k and v columns of c_attn
        inner = model.transformer.h[0].mlp.c_fc.weight.shape[1]
        mlp = torch.arange(rank * inner // world, (rank + 1) * inner // world)
        self.shards = nn.ModuleList()
        for blk in model.transformer.h:
            shard = nn.Module()
            # GPT-2's Conv1D computes x @ weight + bias with weight (in, out)
            shard.register_buffer("attn_w", blk.attn.c_attn.weight.detach()[:, qkv].clone())
            shard.register_buffer("attn_b", blk.attn.c_attn.bias.detach()[qkv].clone())
            shard.register_buffer("proj_w", blk.attn.c_proj.weight.detach()[cols].clone())
            shard.register_buffer("fc_w", blk.mlp.c_fc.weight.detach()[:, mlp].clone())
            shard.register_buffer("fc_b", blk.mlp.c_fc.bias.detach()[mlp].clone())
            shard.register_buffer("mlp_proj_w", blk.mlp.c_proj.weight.detach()[mlp].clone())
            self.shards.append(shard)

    def _reduce(self, part: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(part, group=self.group)
        return part

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """As :meth:`StaticKVState.logits`, from this rank's shards plus two all-reduces per layer."""
        tr = self.model.transformer
        B, T = tokens.shape
        H, D = self.n_head, self.head_dim
        x = tr.wte(tokens) + tr.wpe(positions)[None]
        bias = torch.where(self.key_pos[None, :] <= positions[:, None], self._open, self._masked)
        for i, (blk, w) in enumerate(zip(tr.h, self.shards, strict=True)):
            qkv = torch.addmm(w.attn_b, blk.ln_1(x).reshape(B * T, -1), w.attn_w).view(B, T, 3, H, D)
            q = qkv[:, :, 0].transpose(1, 2)
            self.kv_cache[i].index_copy_(3, positions, qkv[:, :, 1:].permute(2, 0, 3, 1, 4))
            att = F.scaled_dot_product_attention(q, self.kv_cache[i, 0], self.kv_cache[i, 1], attn_mask=bias)
            x = x + self._reduce(att.transpose(1, 2).reshape(B, T, H * D) @ w.proj_w) + blk.attn.c_proj.bias
            h = F.gelu(torch.addmm(w.fc_b, blk.ln_2(x).reshape(B * T, -1), w.fc_w), approximate="tanh")
            x = x + self._reduce((h @ w.mlp_proj_w).view(B, T, -1)) + blk.mlp.c_proj.bias
        return self.model.lm_head(tr.ln_f(x))


@torch.no_grad()
def tp_generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, *, group: Any = None) -> torch.Tensor:
    """Greedy continuation of ``prompt`` (B, T) int64 by ``max_new_tokens`` tokens, this rank's shard of GPT-2
    run eagerly (every rank calls it with the same prompt, and every rank's model holds the same weights, as
    loaded from one checkpoint: weights are not compared): (B, T + max_new_tokens) int64, equal on all ranks.

    The ranks first compare their requests (prompt shape and tokens, ``max_new_tokens``; one
    ``all_gather_object``): ranks that disagree would send all-reduces of different sizes (gloo aborts the
    process, NCCL hangs) or mix different prompts' partial sums into wrong tokens.

    Raises:
        InputError: as :class:`TensorParallelKVState`; a bad prompt or ``max_new_tokens``, when every rank passed
            the same one.
        CaptureError: the ranks' requests differ, also when only some are invalid (``cause="rank_divergence"``,
            the message lists each rank's request or its error), on every rank.
    """
    try:
        B, T = check_prompt(model, prompt, max_new_tokens)
        request, invalid = _describe(prompt, max_new_tokens), None
    except InputError as exc:  # told to the other ranks too, so that none waits in a collective
        request, invalid = f"an invalid request: {exc}", exc
    agree_across_ranks(request, what="tp_generate's request", group=group,
                       fix="Pass every rank the same prompt (tokens and shape) and the same max_new_tokens")
    if invalid is not None:
        raise invalid
    state = TensorParallelKVState(model, B, T + max_new_tokens, group=group)
    state.prefill(prompt)
    for _ in range(max_new_tokens - 1):
        state.decode_step()
    return state.generated[:, : T + max_new_tokens].clone()


def _describe(prompt: torch.Tensor, max_new_tokens: int) -> str:
    """The request as the ranks compare it: shape and dtype, a digest of the tokens, the length."""
    digest = hashlib.sha256(prompt.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:12]
    return f"prompt {tuple(prompt.shape)} {prompt.dtype} tokens sha256:{digest}, max_new_tokens={max_new_tokens}"
