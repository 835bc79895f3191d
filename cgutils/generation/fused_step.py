"""GPT-2's greedy decode step in ~5 fused Triton kernels per layer, for one CUDA graph replay per token.

:class:`StaticKVState`'s step runs ~13 PyTorch kernels per layer (LayerNorm, matrix-vector, bias, GELU,
residual add, cache write, attention over the whole cache under a mask); at batch 1 each of them moves a
few MB at most, so the step is paced by kernel count and latency rather than by memory bandwidth. Here
one kernel per layer does what sits between two full-row dependencies:

1. LayerNorm 1 + QKV matrix-vector + bias; the epilogue writes K and V straight into the cache at ``pos``
   (layer 0 also gathers the token and position embeddings, and writes the residual row);
2. decode attention of one query per (batch row, head) over keys ``0..pos`` only, split over key blocks
   (flash-decoding style): each program writes a partial softmax (weighted values, max, sum);
3. attention output projection + bias + residual add; its prologue merges the partial softmaxes;
4. LayerNorm 2 + MLP up-projection + bias + tanh-GELU;
5. MLP down-projection + bias + residual add.

Then LayerNorm f + lm_head (with a per-program argmax) and a one-program kernel that finishes the argmax
and does the bookkeeping (``generated``, ``token``, ``pos``). Matrix-vector products accumulate in fp32;
the residual stream and the other activations stay fp32 between kernels, the cache keeps the model dtype.
Everything reads ``pos`` on the device and launches a fixed grid, so the step captures into a CUDA graph.
A matrix-vector split over K is summed by the last of its programs to arrive (an integer counter,
``atomic_add``) in split order, never by float atomics: results are deterministic run to run.

``FusedKVState(..., pdl=True)`` (opt-in, compute capability >= 9.0): Programmatic Dependent Launch. Every kernel
is launched with ``launch_pdl=True``, so it may start while the one before it still runs; each waits
(``griddepcontrol.wait``) before touching anything another kernel writes or reads, and the matrix-vector
kernels load their whole block of parameters before that wait, overlapping the previous kernel's tail (NVIDIA
CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization"; Triton tutorial 11). The kernels
and the why are in :mod:`.fused_kernels`. Measured by ``benchmarks/decode_floor.py`` (route ``fused_pdl``, H200,
``results/nvidia-h200/decode_floor/decode_floor.json``): at batch 1 it beat ``pdl=False`` in the same run (0.288 vs
0.350 ms per step, tokens equal to the plain step's), at batch 8 it lost (0.866 vs 0.370 ms: its products make one
pass over the weight block per batch row); hence off by default, for batch 1 only.

Triton is imported if it is installed; without it importing this module works and :class:`FusedKVState`
raises :class:`~cgutils.errors.InputError`. On a CPU, set ``TRITON_INTERPRET=1`` before this module is
first imported: Triton's interpreter then runs the same kernels with numpy (slowly; what the tests do).
"""

import os
from collections.abc import Mapping, Sequence

import torch

from ..checks import check_int, is_int
from ..errors import InputError
from .fused_kernels import KERNELS, triton
from .request import check_gpt2
from .static_kv import StaticKVState

MAX_BATCH = 14  # B rows plus LayerNorm's two fill one 16-row MMA tile (tl.dot); more would double the tiles


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _launch(kernel, grid, *args, **meta) -> None:
    """One plain Triton launch (graph-capturable); a seam the tests and tools can wrap."""
    kernel[grid](*args, **meta)


# Launch shapes per matrix, (BN output columns, BK rows per step, K splits, pipeline stages, warps): for each
# matrix the fastest found by benchmarks/tune_fused_gemv.py on an H200 (GPT-2 small fp16, batch 1 and 8; its JSON in
# results/nvidia-h200/decode_floor/). At batch 1-8 each matrix-vector moves 1-5 MB and is latency-bound: what pays
# is enough programs in flight (132 SMs) and W loads pipelined across K steps.
# "qkv"/"fc": LayerNorm in front; "proj": attention output projection (BK is one head, the split is over
# heads); "proj2": the MLP down-projection (K = 4 * n_embd); "lm_head": (BN vocabulary rows, BK, 1, ...).
TUNING = {"qkv": (32, 256, 3, 2, 4), "fc": (32, 256, 1, 3, 4), "proj": (32, 64, 12, 1, 4),
          "proj2": (32, 256, 4, 3, 2), "lm_head": (128, 64, 1, 3, 4)}
# With pdl=True: one K step per program, its whole (KPER, BN) block of W (BK = KPER rounded up to a power of
# two; BK and stages are unused) held in registers: <= 32 KB of fp16 at 4 warps, benchmarks/pdl_probe.py's
# budget and shapes (BN 16 of a 768-row K in full; the down-projection in 4 splits, the projection 3 heads a
# program). Chosen by that rule, not yet searched on the GPU.
PDL_TUNING = {"qkv": (16, 1024, 1, 1, 4), "fc": (16, 1024, 1, 1, 4), "proj": (32, 64, 4, 1, 4),
              "proj2": (16, 1024, 4, 1, 4), "lm_head": (16, 1024, 1, 1, 4)}
ROLES = ("qkv", "proj", "fc", "proj2", "lm_head")  # the matrices, in the order a layer runs them
_RULES = {  # field: (its test, given the value and the role; what it must be)
    "BN": (lambda v, r: v >= 16 and not v & (v - 1), "a power of two >= 16 (columns per program; tl.dot's smallest tile)"),
    "BK": (lambda v, r: v >= 16 and not v & (v - 1), "a power of two >= 16 (rows per K step; proj's is one head whatever BK)"),
    "split": (lambda v, r: v >= 1 and (r != "lm_head" or v == 1), "an int >= 1 (programs sharing K), 1 for lm_head"),
    "stages": (lambda v, r: v >= 1, "an int >= 1 (pipeline stages)"),
    "warps": (lambda v, r: 1 <= v <= 32 and not v & (v - 1), "a power of two 1..32 (num_warps)")}


def check_tuning(tuning: Mapping | None = None, *, base: Mapping | None = None) -> dict[str, tuple[int, int, int, int, int]]:
    """``tuning`` (default: ``base``, default :data:`TUNING` as it is now) checked and completed: ``{role: (BN,
    BK, split, stages, warps)}`` for every role of :data:`ROLES`; a role that ``tuning`` leaves out takes
    ``base``'s (:data:`PDL_TUNING` for a ``pdl=True`` state).

    Raises:
        InputError: naming the role and field: not a mapping, an unknown role, a value not five ints, a field
            out of its range (``_RULES``; lm_head's split must be 1: its kernel has no split over K).
    """
    base = TUNING if base is None else base
    tuning = base if tuning is None else tuning
    if not isinstance(tuning, Mapping):
        raise InputError(f"tuning must be a mapping {{role: (BN, BK, split, stages, warps)}}, got {type(tuning).__name__}")
    for role in tuning:
        if role not in ROLES:
            raise InputError(f"tuning has an unknown role {role!r}; the roles are {', '.join(ROLES)}")
    out = {}
    for role in ROLES:
        spec = tuning.get(role, base[role])
        if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence) or len(spec) != 5 \
                or not all(is_int(v) for v in spec):
            raise InputError(f"tuning[{role!r}] must be five ints (BN, BK, split, stages, warps), got {spec!r}")
        for (field, (test, what)), v in zip(_RULES.items(), spec):
            if not test(v, role):
                raise InputError(f"tuning[{role!r}] field {field} must be {what}, got {v!r}")
        out[role] = tuple(spec)
    return out


def _gemv_shape(spec: tuple, K: int, N: int, kstep: int | None = None,
                pdl: bool = False) -> tuple[int, int, int, int, int, int, int]:
    """(BN, BK, KSTEP, KPER, SPLIT, stages, warps) of one matrix-vector from its ``spec`` (a TUNING value),
    clamped to the matrix (>= 16 for tl.dot); ``kstep``: rows per K step when fixed by the input (one head).
    ``pdl``: one K step of KPER rows (whole heads for the projection), BK its power of two, one stage."""
    bn, bk, split, stages, warps = spec
    bn = max(16, min(bn, _pow2(N)))
    if pdl:
        unit = kstep or 16
        kper = _cdiv(_cdiv(K, unit), split) * unit
        return bn, _pow2(kper), kper, kper, _cdiv(K, kper), 1, warps
    bk = max(16, _pow2(kstep) if kstep else min(bk, _pow2(K)))
    kstep = kstep or bk
    kper = _cdiv(_cdiv(K, kstep), split) * kstep
    return bn, bk, kstep, kper, _cdiv(K, kper), stages, warps


def check_pdl(pdl, device: torch.device) -> bool:
    """``pdl`` checked: a bool, and True only where the kernels run on a GPU of compute capability >= 9.0 (or
    under Triton's interpreter, which runs PDL's arithmetic without the launch attribute and the waits).

    Raises:
        InputError: ``pdl`` not a bool; ``pdl=True`` on a CUDA device of compute capability < 9.0.
    """
    if not isinstance(pdl, bool):
        raise InputError(f"pdl must be a bool (True: Programmatic Dependent Launch), got {type(pdl).__name__} {pdl!r}")
    if pdl and device.type == "cuda" and not _interpreting():
        cap = tuple(torch.cuda.get_device_capability(device))
        if cap < (9, 0):
            raise InputError(f"pdl=True: Programmatic Dependent Launch needs compute capability 9.0 or newer (Hopper); "
                             f"{device} is {cap[0]}.{cap[1]}; use pdl=False")
    return pdl


def _dense(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise InputError(f"FusedKVState reads {what} in place and needs it contiguous (got strides {t.stride()}); "
                         "call .contiguous() on the parameter's data first")
    return t


class FusedKVState(StaticKVState):
    """:class:`StaticKVState` with a decode step of fused Triton kernels (the same cache and buffers).

    ``prefill`` is the plain path (T > 1 tokens at once). :meth:`decode_step` launches ``5 * layers + 2`` kernels
    (62 for GPT-2 small) and no PyTorch op: see the module docstring. It reads the model's parameters in place
    (no weight copies, so in-place weight updates are seen) and adds only fp32 scratch: per batch row
    ``2 * n_embd + n_inner + vocab`` values, the attention partials (``heads * splits * (head_dim + 2)``) and the
    lm_head's per-program maxima, about 0.25 MB per row for GPT-2 small; plus a split-K workspace (about 0.6 MB with the default :data:`TUNING`) and int32
    counters, whatever the batch. ``pdl=True``: Programmatic Dependent Launch (module docstring,
    :mod:`.fused_kernels`), with :data:`PDL_TUNING`'s shapes; the same cache and buffers, the same tokens as the
    plain step (the products summed in another order: the logits' last bits differ). ``launch_shapes`` gives each role's clamped launch (BN, BK, KSTEP, KPER,
    SPLIT, num_stages, num_warps, grid) and ``tuning`` the table it came from.

    Args:
        model: a transformers ``GPT2LMHeadModel`` (fp16, bf16 or fp32) on a CUDA device, or on the CPU
            with ``TRITON_INTERPRET=1`` set before this module was imported.
        batch: batch rows, 1..14.
        max_len: cache positions (<= ``n_positions``).
        attn_block: keys per attention block (a power of two); ``max_splits``: at most this many
            programs share the keys of one (row, head), each over ``ceil(blocks / splits)`` blocks.
        tuning: ``{role: (BN, BK, split, stages, warps)}``, roles left out (all, by default) taking :data:`TUNING`'s
            at construction (:data:`PDL_TUNING`'s with ``pdl=True``): the speed, and through the order of fp32 sums
            the logits' last bits.
        pdl: launch every kernel with Programmatic Dependent Launch (compute capability >= 9.0; default False:
            faster at batch 1, slower at batch 8, by the module docstring's measurement).

    Buffers added to :class:`StaticKVState`'s: ``last_logits`` (batch, vocab) fp32, the logits of the
    last decode step; the rest is scratch.

    Raises:
        InputError: triton missing; a model that is not GPT-2, on the CPU without the interpreter, in an
            unsupported dtype or with a non-contiguous parameter; batch outside 1..14; ``max_len`` too
            large; ``attn_block`` not a power of two; a bad ``tuning`` (:func:`check_tuning`); a bad ``pdl``
            (:func:`check_pdl`).
    """

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, *, attn_block: int = 32,
                 max_splits: int = 8, tuning: Mapping | None = None, pdl: bool = False):
        if triton is None:
            raise InputError("the fused decode step needs Triton (pip install triton; it ships with CUDA "
                             "builds of torch); StaticKVState runs the same decoding without it")
        check_gpt2(model, "FusedKVState")
        if not 1 <= check_int("batch", batch, minimum=1, why="rows decoded at once") <= MAX_BATCH:
            raise InputError(f"FusedKVState takes batch 1..{MAX_BATCH} (one 16-row MMA tile), got {batch}")
        check_int("max_len", max_len, minimum=1, why="cache positions")
        check_int("max_splits", max_splits, minimum=1, why="programs sharing one row's keys")
        if check_int("attn_block", attn_block, minimum=2, why="keys per attention block") & (attn_block - 1):
            raise InputError(f"attn_block must be a power of two >= 2, got {attn_block}")
        check_pdl(pdl, torch.device("cpu"))  # the type; the device's capability below
        tuning = check_tuning(tuning, base=PDL_TUNING if pdl else TUNING)
        super().__init__(model, batch, max_len)
        self.tuning = tuning
        p = self.kv_cache
        if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise InputError(f"FusedKVState supports fp16, bf16 and fp32 models, got {p.dtype}")
        if p.device.type != "cuda" and not _interpreting():
            raise InputError(f"the fused step runs Triton kernels: the model must be on a CUDA device (it is on "
                             f"{p.device}), or set TRITON_INTERPRET=1 before importing {__name__} to run them "
                             "on the CPU with Triton's interpreter")
        self.pdl = check_pdl(pdl, p.device)
        gdc = pdl and not _interpreting()  # the interpreter has no gdc_wait: fused_kernels' docstring
        launch = dict(PDL=pdl, GDC=gdc, **({"launch_pdl": True} if pdl else {}))
        cfg, tr = model.config, model.transformer
        C, H, D, V = cfg.n_embd, self.n_head, self.head_dim, cfg.vocab_size
        F = cfg.n_inner or 4 * C
        dev, B, f32 = p.device, batch, dict(dtype=torch.float32, device=p.device)
        eps = float(cfg.layer_norm_epsilon)
        for name, prm in model.named_parameters():
            _dense(prm, name)
        nblocks = _cdiv(max_len, attn_block)
        bps = _cdiv(nblocks, min(nblocks, max_splits))
        nsplit = _cdiv(nblocks, bps)
        bn_lm, bk_lm, _, _, _, st_lm, nw_lm = _gemv_shape(tuning["lm_head"], C, V)
        if pdl:
            bk_lm, st_lm = _pow2(C), 1
        nprog = _cdiv(V, bn_lm)
        for name, shape in (("_x", (B, C)), ("_q", (B, C)), ("_h", (B, F)), ("last_logits", (B, V)),
                            ("_part", (B * H * nsplit, D + 2)), ("_best_val", (B, nprog))):
            self.register_buffer(name, torch.zeros(shape, **f32), persistent=False)
        self.register_buffer("_best_idx", torch.zeros(B, nprog, dtype=torch.int32, device=dev), persistent=False)

        kv = [self.kv_cache[i] for i in range(cfg.n_layer)]
        strides = kv[0].stride()[:4]  # (k/v, row, head, position); head_dim is contiguous
        bb = max(16, _pow2(B + 2))  # an MMA tile of rows: B rows, LayerNorm's g and beta, padding
        prec = "ieee" if p.dtype == torch.float32 else "tf32"  # fp32 models: exact fp32 products, no TF32
        wte, wpe = tr.wte.weight, tr.wpe.weight
        if model.lm_head.weight.shape != (V, C):
            raise InputError(f"lm_head weight must be (vocab, n_embd) = {(V, C)}, got {tuple(model.lm_head.weight.shape)}")
        dims = {"qkv": (C, 3 * C), "proj": (C, C), "fc": (C, F), "proj2": (F, C)}
        shapes = {r: _gemv_shape(tuning[r], K, N, D if r == "proj" else None, pdl) for r, (K, N) in dims.items()}
        keys = ("BN", "BK", "KSTEP", "KPER", "SPLIT", "num_stages", "num_warps")
        self.launch_shapes = {r: {**dict(zip(keys, sh)), "grid": (_cdiv(dims[r][1], sh[0]), sh[4])} for r, sh in shapes.items()}
        self.launch_shapes["lm_head"] = {**dict(zip(keys, (bn_lm, bk_lm, bk_lm, C, 1, st_lm, nw_lm))), "grid": (nprog, 1)}
        # split-K workspace and arrival counters, shared by the matrix-vectors (they run one after another and
        # leave the counters at 0)
        tiles = max(_cdiv(dims[r][1], sh[0]) * sh[4] for r, sh in shapes.items())
        self.register_buffer("_ws", torch.zeros(tiles * bb * (max(sh[0] for sh in shapes.values()) + 2), **f32),
                             persistent=False)
        self.register_buffer("_cnt", torch.zeros(_cdiv(max(3 * C, F), 16), dtype=torch.int32, device=dev),
                             persistent=False)

        def gemv(role, x, w, bias, out, ln=None, src=0, gelu=False, epi=0, kv_i=kv[0]):
            K, N = w.shape
            bn, bk, kstep, kper, split, stages, warps = shapes[role]
            lnw, lnb = (ln.weight, ln.bias) if ln is not None else (bias, bias)
            args = (x, w, bias, out, lnw, lnb, eps, self.token, wte, wpe, self.pos, self._part, kv_i, *strides,
                    max_len, self._ws, self._cnt)
            meta = dict(B=B, BB=bb, K=K, N=N, BK=bk, KSTEP=kstep, BN=bn, KPER=kper, SPLIT=split, SRC=src,
                        LN=ln is not None, GELU=gelu, EPI=epi, H=H, D=D, NSPLIT=nsplit, BLOCK_SPL=max(2, _pow2(nsplit)),
                        CHUNK=bps * attn_block, PREC=prec, num_stages=stages, num_warps=warps, **launch)
            return KERNELS["ln_gemv"], (_cdiv(N, bn), split), args, meta

        plan = []
        no_pdl = {k: v for k, v in launch.items() if k != "PDL"}  # the kernels without parameters: GDC only
        attn_meta = dict(H=H, D=D, BLOCK_D=_pow2(D), NSPLIT=nsplit, BLOCK_S=attn_block, BPS=bps, num_warps=4, **no_pdl)
        for i, blk in enumerate(tr.h):
            plan += [
                gemv("qkv", self._x, blk.attn.c_attn.weight, blk.attn.c_attn.bias, self._q, blk.ln_1,
                     2 if i == 0 else 0, epi=2, kv_i=kv[i]),
                (KERNELS["attn_decode"], (B * H, nsplit),
                 (self._q, kv[i], self.pos, self._part, 1.0 / D ** 0.5, *strides, max_len), attn_meta),
                gemv("proj", self._part, blk.attn.c_proj.weight, blk.attn.c_proj.bias, self._x, src=1, epi=1),
                gemv("fc", self._x, blk.mlp.c_fc.weight, blk.mlp.c_fc.bias, self._h, blk.ln_2, gelu=True),
                gemv("proj2", self._h, blk.mlp.c_proj.weight, blk.mlp.c_proj.bias, self._x, epi=1),
            ]
        plan += [
            (KERNELS["lm_head_gemv"], (nprog,),
             (self._x, model.lm_head.weight, tr.ln_f.weight, tr.ln_f.bias, eps, self.last_logits, self._best_val,
              self._best_idx, V),
             dict(B=B, BB=bb, C=C, BN=bn_lm, BK=bk_lm, NPROG=nprog, PREC=prec, num_warps=nw_lm, num_stages=st_lm,
                  **launch)),
            (KERNELS["argmax_finish"], (1,),
             (self._best_val, self._best_idx, self.token, self.generated, self.pos, max_len),
             dict(B=B, BB=max(2, _pow2(B)), NPROG=nprog, BLOCK_P=min(_pow2(nprog), 8192 // max(2, _pow2(B))),
                  num_warps=4, **no_pdl)),
        ]
        self._plan = plan
        self.splits, self.blocks_per_split = nsplit, bps

    @property
    def kernels_per_step(self) -> int:
        """Kernels one :meth:`decode_step` launches (``5 * layers + 2``)."""
        return len(self._plan)

    def decode_step(self) -> torch.Tensor:
        """One greedy token through the fused kernels (graph-safe: fixed grids, ``pos`` read on the device,
        no allocation, no sync). Afterwards ``generated[:, pos + 1]`` and ``token`` hold the token (a token
        past ``max_len - 1`` is not stored), ``pos`` has advanced by one and ``last_logits`` holds the
        step's logits (batch, vocab) fp32. Returns the ``token`` buffer (batch, 1) int64 itself, which the
        next step overwrites (clone it to keep it). Stepping past ``pos == max_len - 1`` leaves the cache
        unwritten and the output meaningless (the plain step raises there; checking would need a sync)."""
        for kernel, grid, args, meta in self._plan:
            _launch(kernel, grid, *args, **meta)
        return self.token


@torch.no_grad()
def greedy_tokens(state: StaticKVState, prompt: torch.Tensor, max_new_tokens: int, step=None) -> torch.Tensor:
    """Greedy decoding on ``state`` (a :class:`StaticKVState` or :class:`FusedKVState`): prefill ``prompt``
    (batch, T) int64, then ``max_new_tokens - 1`` calls of ``step`` (default ``state.decode_step``; pass a
    captured graph's ``replay``). Returns (batch, T + max_new_tokens) int64, a copy.

    Raises:
        InputError: ``prompt`` not (state's batch, T) or ``T + max_new_tokens`` beyond the cache.
    """
    B, S = state.generated.shape
    if prompt.dim() != 2 or prompt.shape[0] != B or prompt.shape[1] + max_new_tokens > S or max_new_tokens < 1:
        raise InputError(f"prompt {tuple(prompt.shape)} with {max_new_tokens} new tokens does not fit a state of "
                         f"batch {B} and {S} positions")
    state.prefill(prompt)
    for _ in range(max_new_tokens - 1):
        (step or state.decode_step)()
    return state.generated[:, : prompt.shape[1] + max_new_tokens].clone()
