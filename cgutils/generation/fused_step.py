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

Triton is imported if it is installed; without it importing this module works and :class:`FusedKVState`
raises :class:`~cgutils.errors.InputError`. On a CPU, set ``TRITON_INTERPRET=1`` before this module is
first imported: Triton's interpreter then runs the same kernels with numpy (slowly; what the tests do).
"""

import os
from collections.abc import Mapping, Sequence

import torch

from ..checks import check_int, is_int
from ..errors import InputError
from .request import check_gpt2
from .static_kv import StaticKVState

try:
    import triton
    import triton.language as tl
except ImportError:  # only the fused step needs triton; FusedKVState says so
    triton = None

MAX_BATCH = 14  # B rows plus LayerNorm's two fill one 16-row MMA tile (tl.dot); more would double the tiles


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


if triton is not None:

    @triton.jit
    def _combine(part_ptr, pos, head, rows, kk, kmask, B: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                 NSPLIT: tl.constexpr, BLOCK_SPL: tl.constexpr, CHUNK: tl.constexpr):
        # Merge the attention kernel's partial softmaxes of one head, all rows at once: (BB, BLOCK_D), zero
        # past row B. Splits that start past pos hold nothing and are not read at all.
        sp = tl.arange(0, BLOCK_SPL)
        live = (rows[:, None] < B) & (sp[None, :] < NSPLIT) & (sp[None, :] * CHUNK <= pos)
        base = part_ptr + ((rows[:, None] * H + head) * NSPLIT + sp[None, :]) * (D + 2)  # (BB, BLOCK_SPL)
        m = tl.load(base + D, mask=live, other=-1e30)
        den = tl.load(base + D + 1, mask=live, other=0.0)
        acc = tl.load(base[:, :, None] + kk[None, None, :], mask=live[:, :, None] & kmask[None, None, :], other=0.0)
        wt = tl.exp(m - tl.max(m, axis=1)[:, None])
        return tl.sum(wt[:, :, None] * acc, axis=1) / tl.maximum(tl.sum(wt * den, axis=1), 1e-30)[:, None]

    @triton.jit
    def _ln_rows(xt, rows, g, beta, B: tl.constexpr):
        # LayerNorm after the product: LN(x) @ W = rstd * ((x * g) @ W - mean * (g @ W)) + beta @ W, so the
        # statistics need no pass of their own before the first W load. Rows B and B + 1 of the (>= 16-row)
        # MMA tile, idle anyway, carry g and beta and yield g @ W and beta @ W for free.
        r = rows[:, None]
        return tl.where(r < B, xt * g[None, :], tl.where(r == B, g[None, :], tl.where(r == B + 1, beta[None, :], 0.0)))

    @triton.jit
    def _ln_fix(acc, s1, s2, rows, eps, K: tl.constexpr, B: tl.constexpr):
        mean = s1 / K
        rstd = 1.0 / tl.sqrt(tl.maximum(s2 / K - mean * mean, 0.0) + eps)
        gw = tl.sum(tl.where(rows[:, None] == B, acc, 0.0), axis=0)
        bw = tl.sum(tl.where(rows[:, None] == B + 1, acc, 0.0), axis=0)
        return rstd[:, None] * (acc - mean[:, None] * gw[None, :]) + bw[None, :]

    @triton.jit
    def _ln_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, lnw_ptr, lnb_ptr, eps, tok_ptr, wte_ptr, wpe_ptr,
                        pos_ptr, part_ptr, kv_ptr, s_kv, s_b, s_h, s_s, S, ws_ptr, cnt_ptr,
                        B: tl.constexpr, BB: tl.constexpr, K: tl.constexpr, N: tl.constexpr, BK: tl.constexpr,
                        KSTEP: tl.constexpr, BN: tl.constexpr, KPER: tl.constexpr, SPLIT: tl.constexpr,
                        SRC: tl.constexpr, LN: tl.constexpr, GELU: tl.constexpr, EPI: tl.constexpr, H: tl.constexpr,
                        D: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_SPL: tl.constexpr, CHUNK: tl.constexpr,
                        PREC: tl.constexpr):
        # y[b, cols] = act(src(b) @ W[:, cols] + bias) for a (K, N) row-major W (GPT-2's Conv1D): program
        # (pid, sid) owns BN output columns, so the W rows it reads are contiguous, and K rows
        # [sid * KPER, (sid + 1) * KPER). The B rows are padded to an MMA tile (tl.dot). SRC: 0 rows of x,
        # 1 the attention partials, merged here (one head per K step), 2 token + position embeddings
        # (layer 0). EPI: 0 store, 1 add into out (the residual stream: own columns only, so in place is
        # safe), 2 q to out and k/v into the cache at pos.
        pid = tl.program_id(0)
        sid = tl.program_id(1)
        cols = pid * BN + tl.arange(0, BN)
        cmask = cols < N
        rows = tl.arange(0, BB)
        pos = tl.load(pos_ptr)
        kk = tl.arange(0, BK)
        acc = tl.zeros([BB, BN], dtype=tl.float32)
        s1 = tl.zeros([BB], dtype=tl.float32)
        s2 = tl.zeros([BB], dtype=tl.float32)
        for k0 in range(sid * KPER, sid * KPER + KPER, KSTEP):  # a loop, so that Triton pipelines the W loads
            ks = k0 + kk
            kmask = (kk < KSTEP) & (ks < K)
            m2 = (rows[:, None] < B) & kmask[None, :]
            if SRC == 0:
                xt = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=m2, other=0.0).to(tl.float32)
            elif SRC == 1:
                xt = _combine(part_ptr, pos, k0 // D, rows, kk, kmask, B, H, D, NSPLIT, BLOCK_SPL, CHUNK)
            else:
                tok = tl.load(tok_ptr + rows, mask=rows < B, other=0)
                xt = (tl.load(wte_ptr + tok[:, None] * K + ks[None, :], mask=m2, other=0.0).to(tl.float32)
                      + tl.load(wpe_ptr + pos * K + ks[None, :], mask=m2 & (pos < S), other=0.0).to(tl.float32))
                # column block 0 keeps the embedded rows as the residual stream (nobody reads it here)
                tl.store(x_ptr + rows[:, None] * K + ks[None, :], xt, mask=m2 & (pid == 0))
            if LN:
                s1 += tl.sum(xt, axis=1)
                s2 += tl.sum(xt * xt, axis=1)
                g = tl.load(lnw_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
                beta = tl.load(lnb_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
                xt = _ln_rows(xt, rows, g, beta, B)
            w = tl.load(w_ptr + ks[:, None] * N + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(xt.to(w.dtype), w, acc, input_precision=PREC)
        last = pid >= 0
        if SPLIT > 1:
            # Split-K without float atomics: every split leaves its partial in the workspace, and the last
            # of a column block to arrive (an int counter) sums them in split order: deterministic.
            tile = ws_ptr + ((pid * SPLIT + sid) * BB + rows) * (BN + 2)
            tl.store(tile[:, None] + tl.arange(0, BN)[None, :], acc)
            tl.store(tile + BN, s1)
            tl.store(tile + BN + 1, s2)
            tl.debug_barrier()  # all of this program's stores before its arrival (the atomic releases them)
            last = tl.atomic_add(cnt_ptr + pid, 1) == SPLIT - 1
            for sp in tl.static_range(SPLIT):
                tile = ws_ptr + ((pid * SPLIT + sp) * BB + rows) * (BN + 2)
                part = tl.load(tile[:, None] + tl.arange(0, BN)[None, :], mask=last, other=0.0, cache_modifier=".cg")
                t1 = tl.load(tile + BN, mask=last, other=0.0, cache_modifier=".cg")
                t2 = tl.load(tile + BN + 1, mask=last, other=0.0, cache_modifier=".cg")
                if sp == 0:
                    acc, s1, s2 = part, t1, t2
                else:
                    acc, s1, s2 = acc + part, s1 + t1, s2 + t2
            tl.store(cnt_ptr + pid, 0, mask=last)  # ready for the next kernel that uses the counters
        y = acc
        if LN:
            y = _ln_fix(acc, s1, s2, rows, eps, K, B)
        y += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if GELU:
            # tanh-GELU, as 0.5 * (1 + tanh(u)) == sigmoid(2u): no tanh op needed, no overflow to NaN
            u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
            y = y / (1.0 + tl.exp(tl.minimum(-2.0 * u, 80.0)))  # clamped: exp overflow (to inf) is harmless but noisy
        m2 = (rows[:, None] < B) & cmask[None, :] & last
        if EPI == 2:
            sec = cols // (H * D)  # 0 query, 1 key, 2 value: qkv.view(B, T, 3, H, D)
            within = cols % (H * D)
            tl.store(out_ptr + rows[:, None] * (H * D) + within[None, :], y, mask=m2 & (sec == 0)[None, :])
            dst = (kv_ptr + (sec - 1)[None, :] * s_kv + rows[:, None] * s_b + (within // D)[None, :] * s_h
                   + pos * s_s + (within % D)[None, :])
            tl.store(dst, y.to(kv_ptr.dtype.element_ty), mask=m2 & (sec > 0)[None, :] & (pos < S))
        else:
            offs = rows[:, None] * N + cols[None, :]
            if EPI == 1:
                y += tl.load(out_ptr + offs, mask=m2, other=0.0)
            tl.store(out_ptr + offs, y, mask=m2)

    @triton.jit
    def _attn_decode_kernel(q_ptr, kv_ptr, pos_ptr, part_ptr, scale, s_kv, s_b, s_h, s_s, S,
                            H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, NSPLIT: tl.constexpr,
                            BLOCK_S: tl.constexpr, BPS: tl.constexpr):
        # One query per (batch row, head); program (bh, split) covers BPS blocks of BLOCK_S keys with an online
        # softmax. Keys past pos are masked, so their loads never reach memory: the step reads pos + 1 keys.
        # Output: the split's partial softmax (weighted values, max, sum), merged by the c_proj kernel; a
        # merge here by the last split to finish (a counter) measured slower on an H200 (+1.4 us a layer).
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // H
        h = bh % H
        pos = tl.load(pos_ptr)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = tl.load(q_ptr + bh * D + d, mask=dm, other=0.0).to(tl.float32) * scale
        base = kv_ptr + b * s_b + h * s_h
        m = -1e30  # finite: a split with no live key then gives exp(-inf - m) = 0, not NaN
        den = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(BPS):
            j = (sp * BPS + i) * BLOCK_S + tl.arange(0, BLOCK_S)
            jm = (j <= pos) & (j < S)
            msk = jm[:, None] & dm[None, :]
            offs = j[:, None] * s_s + d[None, :]
            k = tl.load(base + offs, mask=msk, other=0.0).to(tl.float32)
            v = tl.load(base + s_kv + offs, mask=msk, other=0.0).to(tl.float32)
            s = tl.where(jm, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            den = den * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        mine = part_ptr + (bh * NSPLIT + sp) * (D + 2)
        tl.store(mine + d, acc, mask=dm)
        tl.store(mine + D, m)
        tl.store(mine + D + 1, den)

    @triton.jit
    def _lm_head_gemv_kernel(x_ptr, w_ptr, lnw_ptr, lnb_ptr, eps, logits_ptr, val_ptr, idx_ptr, V,
                             B: tl.constexpr, BB: tl.constexpr, C: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, NPROG: tl.constexpr, PREC: tl.constexpr):
        # logits = LN_f(x) @ wte.T with wte (V, C) row-major: a program owns BN vocabulary rows, each read
        # contiguously along C; it also leaves its (max, first argmax) per batch row for the finish kernel.
        pid = tl.program_id(0)
        vs = pid * BN + tl.arange(0, BN)
        vm = vs < V
        rows = tl.arange(0, BB)
        kk = tl.arange(0, BK)
        acc = tl.zeros([BB, BN], dtype=tl.float32)
        s1 = tl.zeros([BB], dtype=tl.float32)
        s2 = tl.zeros([BB], dtype=tl.float32)
        for k0 in range(0, C, BK):
            ks = k0 + kk
            km = ks < C
            xt = tl.load(x_ptr + rows[:, None] * C + ks[None, :], mask=(rows[:, None] < B) & km[None, :], other=0.0)
            s1 += tl.sum(xt, axis=1)
            s2 += tl.sum(xt * xt, axis=1)
            g = tl.load(lnw_ptr + ks, mask=km, other=0.0).to(tl.float32)
            beta = tl.load(lnb_ptr + ks, mask=km, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + vs[:, None] * C + ks[None, :], mask=vm[:, None] & km[None, :], other=0.0)
            acc = tl.dot(_ln_rows(xt, rows, g, beta, B).to(w.dtype), tl.trans(w), acc, input_precision=PREC)
        acc = _ln_fix(acc, s1, s2, rows, eps, C, B)
        m2 = (rows[:, None] < B) & vm[None, :]
        tl.store(logits_ptr + rows[:, None] * V + vs[None, :], acc, mask=m2)
        vals = tl.where(m2, acc, float("-inf"))
        mx = tl.max(vals, axis=1)
        first = tl.min(tl.where(vals == mx[:, None], vs[None, :], V), axis=1)  # ties: lowest id, as torch.argmax
        tl.store(val_ptr + rows * NPROG + pid, mx, mask=rows < B)
        tl.store(idx_ptr + rows * NPROG + pid, first, mask=rows < B)

    @triton.jit
    def _argmax_finish_kernel(val_ptr, idx_ptr, token_ptr, gen_ptr, pos_ptr, S, B: tl.constexpr, BB: tl.constexpr,
                              NPROG: tl.constexpr, BLOCK_P: tl.constexpr):
        # One program: it alone reads pos and then advances it, so no other program can see it half-updated.
        pos = tl.load(pos_ptr)
        rows = tl.arange(0, BB)
        best = tl.full([BB], float("-inf"), tl.float32)
        arg = tl.zeros([BB], dtype=tl.int32)
        for c in tl.static_range((NPROG + BLOCK_P - 1) // BLOCK_P):
            pp = c * BLOCK_P + tl.arange(0, BLOCK_P)
            m2 = (rows[:, None] < B) & (pp < NPROG)[None, :]
            offs = rows[:, None] * NPROG + pp[None, :]
            v = tl.load(val_ptr + offs, mask=m2, other=float("-inf"))
            i = tl.load(idx_ptr + offs, mask=m2, other=2147483647)
            mx = tl.max(v, axis=1)
            ci = tl.min(tl.where(v == mx[:, None], i, 2147483647), axis=1)
            arg = tl.where(mx > best, ci, arg)  # a tie keeps the earlier chunk's, lower, id
            best = tl.maximum(best, mx)
        tok = arg.to(tl.int64)
        tl.store(token_ptr + rows, tok, mask=rows < B)
        tl.store(gen_ptr + rows * S + pos + 1, tok, mask=(rows < B) & (pos + 1 < S))
        tl.store(pos_ptr, pos + 1)


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
ROLES = ("qkv", "proj", "fc", "proj2", "lm_head")  # the matrices, in the order a layer runs them
_RULES = {  # field: (its test, given the value and the role; what it must be)
    "BN": (lambda v, r: v >= 16 and not v & (v - 1), "a power of two >= 16 (columns per program; tl.dot's smallest tile)"),
    "BK": (lambda v, r: v >= 16 and not v & (v - 1), "a power of two >= 16 (rows per K step; proj's is one head whatever BK)"),
    "split": (lambda v, r: v >= 1 and (r != "lm_head" or v == 1), "an int >= 1 (programs sharing K), 1 for lm_head"),
    "stages": (lambda v, r: v >= 1, "an int >= 1 (pipeline stages)"),
    "warps": (lambda v, r: 1 <= v <= 32 and not v & (v - 1), "a power of two 1..32 (num_warps)")}


def check_tuning(tuning: Mapping | None = None) -> dict[str, tuple[int, int, int, int, int]]:
    """``tuning`` (default: :data:`TUNING` as it is now) checked and completed: ``{role: (BN, BK, split,
    stages, warps)}`` for every role of :data:`ROLES`; a role that ``tuning`` leaves out takes TUNING's.

    Raises:
        InputError: naming the role and field: not a mapping, an unknown role, a value not five ints, a field
            out of its range (``_RULES``; lm_head's split must be 1: its kernel has no split over K).
    """
    tuning = TUNING if tuning is None else tuning
    if not isinstance(tuning, Mapping):
        raise InputError(f"tuning must be a mapping {{role: (BN, BK, split, stages, warps)}}, got {type(tuning).__name__}")
    for role in tuning:
        if role not in ROLES:
            raise InputError(f"tuning has an unknown role {role!r}; the roles are {', '.join(ROLES)}")
    out = {}
    for role in ROLES:
        spec = tuning.get(role, TUNING[role])
        if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence) or len(spec) != 5 \
                or not all(is_int(v) for v in spec):
            raise InputError(f"tuning[{role!r}] must be five ints (BN, BK, split, stages, warps), got {spec!r}")
        for (field, (test, what)), v in zip(_RULES.items(), spec):
            if not test(v, role):
                raise InputError(f"tuning[{role!r}] field {field} must be {what}, got {v!r}")
        out[role] = tuple(spec)
    return out


def _gemv_shape(spec: tuple, K: int, N: int, kstep: int | None = None) -> tuple[int, int, int, int, int, int, int]:
    """(BN, BK, KSTEP, KPER, SPLIT, stages, warps) of one matrix-vector from its ``spec`` (a TUNING value),
    clamped to the matrix (>= 16 for tl.dot); ``kstep``: rows per K step when fixed by the input (one head)."""
    bn, bk, split, stages, warps = spec
    bn = max(16, min(bn, _pow2(N)))
    bk = max(16, _pow2(kstep) if kstep else min(bk, _pow2(K)))
    kstep = kstep or bk
    kper = _cdiv(_cdiv(K, kstep), split) * kstep
    return bn, bk, kstep, kper, _cdiv(K, kper), stages, warps


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
    counters, whatever the batch. ``launch_shapes`` gives each role's clamped launch (BN, BK, KSTEP, KPER,
    SPLIT, num_stages, num_warps, grid) and ``tuning`` the table it came from.

    Args:
        model: a transformers ``GPT2LMHeadModel`` (fp16, bf16 or fp32) on a CUDA device, or on the CPU
            with ``TRITON_INTERPRET=1`` set before this module was imported.
        batch: batch rows, 1..14.
        max_len: cache positions (<= ``n_positions``).
        attn_block: keys per attention block (a power of two); ``max_splits``: at most this many
            programs share the keys of one (row, head), each over ``ceil(blocks / splits)`` blocks.
        tuning: ``{role: (BN, BK, split, stages, warps)}``, roles left out (all, by default) taking :data:`TUNING`'s
            at construction: the speed, and through the order of fp32 sums the logits' last bits.

    Buffers added to :class:`StaticKVState`'s: ``last_logits`` (batch, vocab) fp32, the logits of the
    last decode step; the rest is scratch.

    Raises:
        InputError: triton missing; a model that is not GPT-2, on the CPU without the interpreter, in an
            unsupported dtype or with a non-contiguous parameter; batch outside 1..14; ``max_len`` too
            large; ``attn_block`` not a power of two; a bad ``tuning`` (:func:`check_tuning`).
    """

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, *, attn_block: int = 32,
                 max_splits: int = 8, tuning: Mapping | None = None):
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
        tuning = check_tuning(tuning)
        super().__init__(model, batch, max_len)
        self.tuning = tuning
        p = self.kv_cache
        if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise InputError(f"FusedKVState supports fp16, bf16 and fp32 models, got {p.dtype}")
        if p.device.type != "cuda" and not _interpreting():
            raise InputError(f"the fused step runs Triton kernels: the model must be on a CUDA device (it is on "
                             f"{p.device}), or set TRITON_INTERPRET=1 before importing {__name__} to run them "
                             "on the CPU with Triton's interpreter")
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
        shapes = {r: _gemv_shape(tuning[r], K, N, D if r == "proj" else None) for r, (K, N) in dims.items()}
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
                        CHUNK=bps * attn_block, PREC=prec, num_stages=stages, num_warps=warps)
            return _ln_gemv_kernel, (_cdiv(N, bn), split), args, meta

        plan = []
        attn_meta = dict(H=H, D=D, BLOCK_D=_pow2(D), NSPLIT=nsplit, BLOCK_S=attn_block, BPS=bps, num_warps=4)
        for i, blk in enumerate(tr.h):
            plan += [
                gemv("qkv", self._x, blk.attn.c_attn.weight, blk.attn.c_attn.bias, self._q, blk.ln_1,
                     2 if i == 0 else 0, epi=2, kv_i=kv[i]),
                (_attn_decode_kernel, (B * H, nsplit),
                 (self._q, kv[i], self.pos, self._part, 1.0 / D ** 0.5, *strides, max_len), attn_meta),
                gemv("proj", self._part, blk.attn.c_proj.weight, blk.attn.c_proj.bias, self._x, src=1, epi=1),
                gemv("fc", self._x, blk.mlp.c_fc.weight, blk.mlp.c_fc.bias, self._h, blk.ln_2, gelu=True),
                gemv("proj2", self._h, blk.mlp.c_proj.weight, blk.mlp.c_proj.bias, self._x, epi=1),
            ]
        plan += [
            (_lm_head_gemv_kernel, (nprog,),
             (self._x, model.lm_head.weight, tr.ln_f.weight, tr.ln_f.bias, eps, self.last_logits, self._best_val,
              self._best_idx, V),
             dict(B=B, BB=bb, C=C, BN=bn_lm, BK=bk_lm, NPROG=nprog, PREC=prec, num_warps=nw_lm, num_stages=st_lm)),
            (_argmax_finish_kernel, (1,),
             (self._best_val, self._best_idx, self.token, self.generated, self.pos, max_len),
             dict(B=B, BB=max(2, _pow2(B)), NPROG=nprog, BLOCK_P=min(_pow2(nprog), 8192 // max(2, _pow2(B))),
                  num_warps=4)),
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
