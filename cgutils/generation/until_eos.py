"""Greedy GPT-2 decoding that stops at an end-of-sequence token, with the stop check on the host or on the GPU.

A decoder that stops at an end-of-sequence (EOS) token must look at each new token. Checked on the host,
that is a ``.item()`` per step: a sync that a graph cannot hold, so each step is its own graph launch
followed by a wait (``loop="host"``). Checked on the GPU, the whole sequence (prefill, then a WHILE
conditional node around the decode step, :func:`cgutils.while_node`) is one graph: one launch per
sequence and one sync at the end to read the length (``loop="device"``).

The stopping rule is transformers' greedy ``generate`` with ``eos_token_id`` and ``pad_token_id``: a row
that has produced EOS produces ``pad_token_id`` from then on, and decoding stops when every row has
produced EOS or ``max_new_tokens`` tokens exist (transformers ``GenerationMixin._sample``; compared
token for token in the GPU tests and notebook 10).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from torch import nn

from ..capture.control import while_node
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
from .static_kv import StaticKVState

LOOPS = ("device", "host", "eager")


class StopState(StaticKVState):
    """A :class:`~cgutils.generation.StaticKVState` for one prompt length, with the stopping state.

    Buffers (besides the parent's): ``prompt`` ``(batch, prompt_len)`` int64 (copied in before a call);
    ``done`` ``(batch,)`` bool (row has produced EOS); ``running`` ``(1,)`` bool (decode another token);
    ``limit`` ``(1,)`` int64 (prompt length + ``max_new_tokens``).
    """

    def __init__(self, model: nn.Module, batch: int, prompt_len: int, max_len: int, eos: int, pad: int):
        super().__init__(model, batch, max_len)
        dev = self.pos.device
        self.eos, self.pad = eos, pad
        self.register_buffer("prompt", torch.zeros(batch, prompt_len, dtype=torch.int64, device=dev))
        self.register_buffer("done", torch.zeros(batch, dtype=torch.bool, device=dev))
        self.register_buffer("running", torch.zeros(1, dtype=torch.bool, device=dev))
        self.register_buffer("limit", torch.zeros(1, dtype=torch.int64, device=dev))

    def _update_running(self) -> None:
        # pos + 1 tokens exist (prompt included): go on while some row is open and fewer than limit exist
        self.running.copy_((~self.done.all()) & (self.pos + 1 < self.limit))

    def start(self) -> None:
        """Prefill ``prompt``; the first token may already be EOS."""
        self.prefill(self.prompt)
        self.done.copy_(self.token[:, 0] == self.eos)
        self._update_running()

    def step(self) -> None:
        """One token for every row (``pad`` for finished rows), all on the GPU."""
        nxt = self.logits(self.token, self.pos)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        nxt = torch.where(self.done[:, None], self.pad, nxt)
        self.generated.index_copy_(1, self.pos + 1, nxt)
        self.token.copy_(nxt)
        self.pos.add_(1)
        self.done.logical_or_(nxt[:, 0] == self.eos)
        self._update_running()

    def sequence(self) -> None:
        """The whole sequence: prefill, then decode steps while ``running`` (a WHILE node under capture)."""
        self.start()
        while_node(self.running, self.step, max_iters=self.generated.shape[1] - self.prompt.shape[1] - 1)


class StopTokenDecoder:
    """Greedy GPT-2 decoding until every row has produced ``eos_token_id`` or ``max_new_tokens`` exist.

    Example::

        dec = StopTokenDecoder(model.cuda().half().eval(), eos_token_id=50256, loop="device")
        tokens = dec.generate(prompt_ids, max_new_tokens=64)   # (B, T + n) int64, n <= 64

    Args:
        model: a transformers ``GPT2LMHeadModel`` in eval mode on a CUDA device (``"eager"`` also runs
            on the CPU).
        eos_token_id: the token that ends a row.
        pad_token_id: what a finished row produces (default: ``eos_token_id``, as GPT-2 checkpoints set).
        loop: ``"device"``: one graph per sequence (prefill + a WHILE node around the decode step), one
            launch and one sync per sequence; ``"host"``: a prefill graph and a one-step graph, with a
            ``.item()`` stop check after each step; ``"eager"``: the same steps without graphs.
        batch_buckets, length_buckets: as for :class:`~cgutils.generation.GreedyDecoder` (graphs are kept
            per batch bucket, prompt length and length bucket).
        backend: the CUDA calls that capture (the tests pass a CPU simulation).

    Attributes:
        last_launches: graph launches of the last :meth:`generate` call.
        last_syncs: host waits on the GPU in the last call: the token-id check of the prompt, the stop
            checks, and the final length read (``loop="device"``: 2).

    Raises:
        InputError: unknown ``loop``; a CPU model with a graph loop; token ids outside the vocabulary.
    """

    def __init__(self, model: nn.Module, eos_token_id: int, *, pad_token_id: int | None = None,
                 loop: str = "device", batch_buckets=BATCH_BUCKETS, length_buckets=LENGTH_BUCKETS,
                 backend: CudaBackend = CUDA):
        if loop not in LOOPS:
            raise InputError(f"loop must be one of {LOOPS}, got {loop!r}")
        check_gpt2(model, "StopTokenDecoder")
        vocab = model.config.vocab_size
        self.eos = check_int("eos_token_id", eos_token_id, minimum=0, why="a token id")
        self.pad = self.eos if pad_token_id is None else check_int("pad_token_id", pad_token_id, minimum=0,
                                                                  why="a token id")
        for name, v in (("eos_token_id", self.eos), ("pad_token_id", self.pad)):
            if v >= vocab:
                raise InputError(f"{name}={v} is outside the vocabulary [0, {vocab})")
        device = next(model.parameters()).device
        if loop != "eager" and device.type != backend.device_type:
            raise InputError(f"loop={loop!r} needs the model on a CUDA device (it is on {device}); "
                             f"move it with model.cuda() or use loop='eager'")
        if model.training:
            warnings.warn("StopTokenDecoder got a model in training mode (dropout on: tokens vary from call to "
                          "call); call model.eval()", stacklevel=2)
        self.model, self.loop, self._backend = model, loop, backend
        self.batch_buckets = check_sizes("batch_buckets", batch_buckets, example="(1, 2, 4, 8)")
        self.length_buckets = capped_length_buckets(model, length_buckets)
        self._slots: dict[tuple[int, int, int], tuple[StopState, Any, Any]] = {}
        self._pool = backend.new_pool() if loop != "eager" else None
        self.last_launches = self.last_syncs = 0

    @property
    def slots(self) -> list[tuple[int, int, int]]:
        """(batch bucket, prompt length, length bucket) of each graph (set of graphs) kept so far."""
        return list(self._slots)

    def _slot(self, batch: int, prompt_len: int, max_len: int) -> tuple[StopState, Any, Any]:
        key = (batch, prompt_len, max_len)
        if key not in self._slots:
            state = StopState(self.model, batch, prompt_len, max_len, self.eos, self.pad)
            if self.loop == "eager":
                self._slots[key] = (state, state.start, state.step)
            else:
                # warm-up runs the code eagerly: let it decode one step so the step's kernels load first
                state.limit.fill_(prompt_len + 2)
                what = f"GPT-2 {{}} (batch {batch}, prompt {prompt_len}, cache {max_len})"
                if self.loop == "device":
                    graph, _ = self._backend.capture(state.sequence, warmup=2, pool=self._pool,
                                                     what=what.format("sequence with a WHILE node"))
                    self._slots[key] = (state, graph.replay, None)
                else:
                    start, _ = self._backend.capture(state.start, warmup=2, pool=self._pool, what=what.format("prefill"))
                    step, _ = self._backend.capture(state.step, warmup=2, pool=self._pool, what=what.format("step"))
                    self._slots[key] = (state, start.replay, step.replay)
        return self._slots[key]

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int = 100, *,
                 timings: dict | None = None) -> torch.Tensor:
        """Greedy continuation of ``prompt`` until EOS in every row or ``max_new_tokens``.

        Args:
            prompt: (B, T) int64 token ids in ``[0, vocab)`` on the model's device.
            max_new_tokens: the most tokens to generate (>= 1); the first comes from the prefill.
            timings: if a dict is given, ``first_token_ms`` and ``last_token_ms`` are set in it: host wall
                time (ms, from the call's start after the input checks) until the first and the last token
                could be read on the host. With ``loop="device"`` both come at the end of the one launch.

        Returns:
            (B, T + n) int64, 1 <= n <= ``max_new_tokens``: the prompt and the generated tokens, finished
            rows padded with ``pad_token_id`` (as transformers' ``generate`` returns them).

        Raises:
            InputError: wrong dtype, rank or device of ``prompt``; token ids outside the vocabulary; sizes
                beyond the buckets or GPT-2's position table.
        """
        if timings is not None and not isinstance(timings, dict):
            raise InputError(f"timings must be a dict to fill in, got {type(timings).__name__}")
        b, T = check_prompt(self.model, prompt, max_new_tokens)  # one sync, counted in last_syncs
        B, S = pick_sizes(self.model, b, T + max_new_tokens, self.batch_buckets, self.length_buckets)
        state, start, step = self._slot(B, T, S)
        t0 = time.perf_counter()
        first = None
        state.prompt.copy_(pad_rows(prompt, B))
        state.limit.fill_(T + max_new_tokens)
        start()
        launches, syncs = (1, 1) if self.loop != "eager" else (0, 1)  # syncs: the token-id check above
        if step is not None:  # stop check on the host: one sync per step
            while True:
                syncs += 1
                running = bool(state.running)
                first = first if first is not None else time.perf_counter()  # the prefill's token is readable
                if not running:
                    break
                step()
                launches += self.loop == "host"
        length = int(state.pos) + 1  # the one sync of loop="device"
        last = time.perf_counter()
        if timings is not None:
            timings.update(first_token_ms=((first or last) - t0) * 1e3, last_token_ms=(last - t0) * 1e3)
        self.last_launches, self.last_syncs = launches, syncs + 1
        return state.generated[:b, :length].clone()


def hf_generate_until_eos(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, eos_token_id: int,
                          pad_token_id: int | None = None) -> torch.Tensor:
    """transformers' own greedy ``generate`` with EOS stopping, for comparison: (B, T + n) int64."""
    pad = eos_token_id if pad_token_id is None else pad_token_id
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=eos_token_id, pad_token_id=pad)
