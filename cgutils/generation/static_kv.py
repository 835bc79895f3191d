"""Greedy GPT-2 decoding with a static KV cache, so that one CUDA graph replays every decode step.

Why a static cache: transformers' default (dynamic) cache grows by one position per token, so each
decode step has new shapes and new addresses, and a graph captured for one step cannot replay the
next. Here the cache is preallocated as ``(layers, 2, batch, heads, max_len, head_dim)`` and written in
place at a position held in a GPU tensor; attention reads the whole cache under a mask built from that
tensor. Every step then has the same shapes and addresses, and the step's argmax, cache write and
position increment all happen on the GPU, so one ``graph.replay()`` produces one token with no CPU
work besides the launch.

The model is transformers' ``GPT2LMHeadModel`` (its modules and weights are reused as they are); the
attention math follows its ``GPT2Attention`` (scaled dot product, scale ``1/sqrt(head_dim)``, causal).
Batches are padded up to a batch-size bucket and the cache length to a length bucket, so a handful of
graphs serve every request.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..capture.graph import CUDA, CudaBackend
from ..checks import check_int, check_sizes
from ..errors import InputError
from .request import (
    BATCH_BUCKETS,
    LENGTH_BUCKETS,
    capped_length_buckets,
    check_gpt2,
    check_prompt,
    pad_rows,
    pick_sizes,
)

MODES = ("eager", "graph", "compile")



class StaticKVState(nn.Module):
    """The static KV cache and decode state of one (batch bucket, length bucket).

    Buffers (all on the model's device):
        kv_cache: ``(layers, 2, batch, heads, max_len, head_dim)``, model dtype: keys ``[:, 0]`` and
            values ``[:, 1]``, side by side so that one in-place write per layer stores both.
        pos: ``(1,)`` int64, position of ``token`` (the next input).
        token: ``(batch, 1)`` int64, the last generated token.
        generated: ``(batch, max_len)`` int64, prompt followed by generated tokens.

    The step launches as few kernels as the math allows, because inside a replayed graph each kernel
    still costs a few microseconds of GPU scheduling: GELU is the fused ``F.gelu(approximate="tanh")``
    (the same tanh formula as transformers' ``NewGELUActivation``, one kernel instead of eight),
    keys and values are written with one ``index_copy_``, and the causal mask is an additive bias
    built once per step.
    """

    def __init__(self, model: nn.Module, batch: int, max_len: int, heads: int | None = None):
        """Allocate the cache for ``model`` (a GPT2LMHeadModel), ``batch`` rows and ``max_len`` positions,
        on the model's device and in its dtype; ``heads``: the attention heads this state holds (default:
        all; a tensor-parallel rank holds its share).

        Raises:
            InputError: ``batch`` or ``max_len`` not an int >= 1 (a prompt needs one position, each decode step
                one more), or ``max_len`` larger than the model's position table.
        """
        super().__init__()
        check_int("batch", batch, minimum=1, why="rows of the cache")
        check_int("max_len", max_len, minimum=1, why="positions of the cache: the prompt's tokens and the generated ones")
        cfg = model.config
        if max_len > cfg.n_positions:
            raise InputError(f"max_len {max_len} exceeds GPT-2's {cfg.n_positions} positions")
        p = next(model.parameters())
        self.model = model
        self.n_head, self.head_dim = heads or cfg.n_head, cfg.n_embd // cfg.n_head
        shape = (cfg.n_layer, 2, batch, self.n_head, max_len, self.head_dim)
        self.register_buffer("kv_cache", torch.zeros(shape, dtype=p.dtype, device=p.device))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.int64, device=p.device))
        self.register_buffer("token", torch.zeros(batch, 1, dtype=torch.int64, device=p.device))
        self.register_buffer("generated", torch.zeros(batch, max_len, dtype=torch.int64, device=p.device))
        self.register_buffer("key_pos", torch.arange(max_len, device=p.device))
        self.register_buffer("_open", torch.zeros((), dtype=p.dtype, device=p.device))
        self.register_buffer("_masked", torch.tensor(float("-inf"), dtype=p.dtype, device=p.device))

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run ``tokens`` (B, T) at ``positions`` (T,) through GPT-2, writing their keys and values into
        the cache; returns logits (B, T, vocab) in the model dtype."""
        tr = self.model.transformer
        B, T = tokens.shape
        H, D = self.n_head, self.head_dim
        x = tr.wte(tokens) + tr.wpe(positions)[None]  # (B, T, C)
        # causal over the whole cache: key j is visible to the query at position p iff j <= p
        bias = torch.where(self.key_pos[None, :] <= positions[:, None], self._open, self._masked)  # (T, S)
        for i, blk in enumerate(tr.h):
            qkv = blk.attn.c_attn(blk.ln_1(x)).view(B, T, 3, H, D)
            q = qkv[:, :, 0].transpose(1, 2)  # (B, H, T, D)
            self.kv_cache[i].index_copy_(3, positions, qkv[:, :, 1:].permute(2, 0, 3, 1, 4))  # (2, B, H, T, D)
            att = F.scaled_dot_product_attention(q, self.kv_cache[i, 0], self.kv_cache[i, 1], attn_mask=bias)
            x = x + blk.attn.c_proj(att.transpose(1, 2).reshape(B, T, H * D))
            x = x + blk.mlp.c_proj(F.gelu(blk.mlp.c_fc(blk.ln_2(x)), approximate="tanh"))
        return self.model.lm_head(tr.ln_f(x))  # (B, T, V)

    def prefill(self, prompt: torch.Tensor) -> None:
        """Fill the cache with ``prompt`` (B, T) and set ``token`` to the first generated token."""
        T = prompt.shape[1]
        positions = self.key_pos[:T]
        nxt = self.logits(prompt, positions)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        self.generated[:, :T] = prompt
        self.generated[:, T : T + 1] = nxt
        self.token.copy_(nxt)
        self.pos.fill_(T)

    def decode_step(self) -> torch.Tensor:
        """One greedy token, entirely on the GPU (graph-safe: fixed shapes, no sync, no allocation
        that outlives the step). Returns the new token (B, 1)."""
        nxt = self.logits(self.token, self.pos)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        self.generated.index_copy_(1, self.pos + 1, nxt)
        self.token.copy_(nxt)
        self.pos.add_(1)
        return nxt


@dataclass
class _Slot:
    state: StaticKVState
    step: Any  # callable advancing one token: graph.replay, a compiled step, or the eager step
    block: Any = None  # graph mode: replays ``block_steps`` decode steps at once
    block_steps: int = 1


class GreedyDecoder:
    """Greedy decoding of a GPT-2 ``GPT2LMHeadModel`` with a static KV cache.

    Example::

        dec = GreedyDecoder(model.cuda().half().eval(), mode="graph")
        tokens = dec.generate(prompt_ids, max_new_tokens=100)   # (B, T + 100) int64

    Args:
        model: a transformers ``GPT2LMHeadModel`` in eval mode on a CUDA device (``"eager"`` also runs
            on the CPU).
        mode: ``"graph"`` (one CUDA graph replay per token), ``"eager"`` (the same step, launched kernel
            by kernel), or ``"compile"`` (the step through ``torch.compile(mode="reduce-overhead")``).
        batch_buckets: batch sizes a request is padded up to (rows repeated, outputs sliced back).
        length_buckets: cache lengths; a request uses the smallest that holds prompt + new tokens.
        fuse: graph mode: run the step through ``torch.compile`` (Inductor, ``mode="default"``) before
            capturing it, so that fused kernels (LayerNorm with the residual add, bias with GELU, ...)
            replace PyTorch's one-kernel-per-op step; the graph is still ours, captured as in
            plain graph mode. Compilation costs seconds on the first request of each bucket.
        steps_per_graph: graph mode: decode steps captured back to back in one graph (a second,
            one-step graph does the remainder). Each step reads and advances the position on the GPU,
            so a graph of 16 steps is 16 correct steps; it saves the CPU launch and the GPU's
            graph-launch latency between steps. 1 gives one replay per token.
        backend: the CUDA calls that capture the graph mode's steps (:class:`cgutils.capture.CudaBackend`;
            the tests pass a CPU simulation).

    Raises:
        InputError: unknown mode; a CPU model in graph or compile mode; a request larger than the
            largest bucket or GPT-2's position table.
    """

    def __init__(self, model: nn.Module, mode: str = "graph", *, batch_buckets=BATCH_BUCKETS,
                 length_buckets=LENGTH_BUCKETS, steps_per_graph: int = 16, fuse: bool = False,
                 backend: CudaBackend = CUDA):
        if mode not in MODES:
            raise InputError(f"mode must be one of {MODES}, got {mode!r}")
        check_gpt2(model, "GreedyDecoder")
        check_int("steps_per_graph", steps_per_graph, minimum=1, why="decode steps per captured graph")
        self.steps_per_graph = steps_per_graph
        if fuse and mode != "graph":
            raise InputError(f"fuse=True applies to mode='graph' (got mode={mode!r}); mode='compile' fuses already")
        self.fuse = fuse
        device = next(model.parameters()).device
        if mode != "eager" and device.type != backend.device_type:
            raise InputError(f"mode={mode!r} needs the model on a CUDA device (it is on {device}); "
                             f"move it with model.cuda() or use mode='eager'")
        if model.training:
            warnings.warn("GreedyDecoder got a model in training mode; call model.eval()", stacklevel=2)
        self.model, self.mode = model, mode
        self.batch_buckets = check_sizes("batch_buckets", batch_buckets, example="(1, 2, 4, 8)")
        self.length_buckets = capped_length_buckets(model, length_buckets)
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._backend = backend
        self._pool = backend.new_pool() if mode == "graph" else None

    @property
    def slots(self) -> list[tuple[int, int]]:
        """(batch bucket, length bucket) pairs prepared so far (one graph each in graph mode)."""
        return list(self._slots)

    def _slot(self, batch: int, max_len: int) -> _Slot:
        key = (batch, max_len)
        if key in self._slots:
            return self._slots[key]
        state = StaticKVState(self.model, batch, max_len)
        if self.mode == "eager":
            slot = _Slot(state, state.decode_step)
        elif self.mode == "compile":
            slot = _Slot(state, torch.compile(state.decode_step, mode="reduce-overhead"))
        else:
            # Warm-up advances the position for real, so it starts from a one-token dummy prompt and
            # must stay inside the cache: 1 + warm-up steps + 1 <= max_len.
            k = max(1, min(self.steps_per_graph, (max_len - 2) // 2))
            step = torch.compile(state.decode_step) if self.fuse else state.decode_step

            def block() -> None:
                for _ in range(k):
                    step()

            graphs = []
            # a block of one step is the one-step graph: captured once (a second capture was never replayed)
            for fn, n in ((step, 1),) if k == 1 else ((step, 1), (block, k)):
                with torch.no_grad():
                    state.prefill(torch.zeros(batch, 1, dtype=torch.int64, device=state.pos.device))
                graph, _ = self._backend.capture(fn, warmup=2, pool=self._pool,
                                         what=f"GPT-2 decode, {n} step(s) (batch {batch}, cache {max_len})")
                graphs.append(graph)
            slot = _Slot(state, graphs[0].replay, graphs[-1].replay, k)
        self._slots[key] = slot
        return slot

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int = 100, *,
                 step_times: list | None = None) -> torch.Tensor:
        """Greedy continuation of ``prompt``.

        Args:
            prompt: (B, T) int64 token ids in ``[0, vocab)`` on the model's device; all rows the same length.
            max_new_tokens: tokens to generate (>= 1); the first comes from the prefill.
            step_times: if a list is given, CUDA events time each decode step and their durations
                (ms) are appended to it (adds a little overhead; CUDA only). Steps are then replayed
                one graph per step, so each can be timed.

        Returns:
            (B, T + max_new_tokens) int64: the prompt followed by the generated tokens.

        Raises:
            InputError: wrong dtype, rank or device of ``prompt``; an empty prompt; token ids outside
                ``[0, vocab)``; sizes beyond the buckets or GPT-2's position table; ``step_times``
                without CUDA.
        """
        b, T = check_prompt(self.model, prompt, max_new_tokens)  # a sync, but outside any graph
        if step_times is not None and self.model.lm_head.weight.device.type != "cuda":
            raise InputError("step_times uses CUDA events; it needs the model on a CUDA device")
        B, S = pick_sizes(self.model, b, T + max_new_tokens, self.batch_buckets, self.length_buckets)
        slot = self._slot(B, S)
        slot.state.prefill(pad_rows(prompt, B))
        remaining = max_new_tokens - 1
        if slot.block is not None and step_times is None:
            for _ in range(remaining // slot.block_steps):
                slot.block()
            remaining %= slot.block_steps
        events = []
        for _ in range(remaining):
            if step_times is not None:
                events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                events[-1][0].record()
            slot.step()
            if step_times is not None:
                events[-1][1].record()
        if events:
            torch.cuda.synchronize()
            step_times.extend(start.elapsed_time(end) for start, end in events)
        return slot.state.generated[:b, : T + max_new_tokens].clone()


def hf_generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int = 100,
                cache_implementation: str | None = None) -> torch.Tensor:
    """transformers' own greedy ``generate``, for comparison: (B, T + max_new_tokens) int64.

    End-of-sequence stopping is switched off (random weights emit EOS at arbitrary points), so
    exactly ``max_new_tokens`` tokens are generated. ``cache_implementation="static"`` selects
    transformers' static cache, which compiles the forward (transformers docs, "KV cache strategies").
    """
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens,
                              "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    if cache_implementation:
        kwargs["cache_implementation"] = cache_implementation
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
