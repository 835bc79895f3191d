"""Greedy GPT-2 decoding with a static KV cache and graphed decode steps.

- :mod:`.request`: a decoding request's checks and the bucket sizes it is padded to (shared by the decoders).
- :mod:`.static_kv`: the static KV state and its decode step, :class:`GreedyDecoder`, transformers' ``generate``.
- :mod:`.until_eos`: decoding until an end-of-sequence token, the stop check on the host or in a WHILE node.
- :mod:`.tensor_parallel`: the decode step split across tensor-parallel ranks, and the parallel linear layers.
- :mod:`.fused_step`: the decode step in fused Triton kernels (62 per step instead of ~156; experimental, not
  yet behind :class:`GreedyDecoder`; ``benchmarks/decode_floor.py`` measures it against the bandwidth floor).
"""

from .request import (
    BATCH_BUCKETS,
    LENGTH_BUCKETS,
    capped_length_buckets,
    check_gpt2,
    check_prompt,
    pad_rows,
    pick_sizes,
)
from .static_kv import MODES, GreedyDecoder, StaticKVState, hf_generate
from .until_eos import LOOPS, StopState, StopTokenDecoder, hf_generate_until_eos

__all__ = ["BATCH_BUCKETS", "LENGTH_BUCKETS", "MODES", "LOOPS", "GreedyDecoder", "StaticKVState", "hf_generate",
           "StopState", "StopTokenDecoder", "hf_generate_until_eos", "capped_length_buckets", "check_gpt2",
           "check_prompt", "pad_rows", "pick_sizes"]
