"""The Triton kernels of :mod:`cgutils.generation.fused_step` (its docstring says what each does), and their
Programmatic Dependent Launch (PDL) variants.

PDL (compute capability >= 9.0; NVIDIA CUDA Programming Guide, "Programmatic Dependent Launch and
Synchronization"; Triton's tutorial 11, persistent matmul / ``launch_pdl``): a kernel launched with
``launch_pdl=True`` (``cudaLaunchAttributeProgrammaticStreamSerialization``) may start while the kernel before
it in the stream (or CUDA graph) still runs, as soon as every program of that one has executed
``griddepcontrol.launch_dependents`` (``tl.extra.cuda.gdc_launch_dependents()``) or exited. It must execute
``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait()``), which returns once the earlier kernel has completed and
its writes are visible, before it touches anything another kernel writes or reads. With ``GDC`` set, every
kernel here waits before its first such load or store (activations, residual, KV cache, partials, split-K
workspace and counters, ``pos``, ``token``) and lets its dependents launch right after the wait; with ``PDL``
set, the matrix-vector kernels load their whole block of model parameters (weights, biases, LayerNorm gains;
written by no kernel) BEFORE the wait, so those DRAM reads overlap the previous kernel's tail. That layout is
``benchmarks/pdl_probe.py``'s (one (K, BN) weight block per program, in registers, products on CUDA cores in
fp32, one pass per batch row; 49 GPT-2-shaped products on the H200: 177.9 us plain, 117.7 us PDL with weights
before the wait); the whole step's speed is in :mod:`.fused_step`'s docstring (``benchmarks/decode_floor.py``).

Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) ``gdc_wait()`` raises (an InterpreterError:
"``_semantic`` argument must be provided outside of JIT functions", Triton 3.8), and the launcher drops the
``launch_pdl`` keyword (not a kernel argument): so ``GDC`` is a separate constexpr, False there, while ``PDL``
keeps the same arithmetic on the CPU as on the GPU.
"""

try:
    import triton
    import triton.language as tl
except ImportError:  # only the fused step needs triton; FusedKVState says so
    triton = None

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
    def _gdc(GDC: tl.constexpr):
        # PDL: wait until the previous kernel has completed (its writes visible), then let the next one launch
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _combine_cols(part_ptr, pos, r, ks, kmask, H: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr,
                      BLOCK_SPL: tl.constexpr, CHUNK: tl.constexpr):
        # _combine for one batch row r and any columns ks (head ks // D, lane ks % D): (BLOCK_K,)
        sp = tl.arange(0, BLOCK_SPL)
        live = (sp[:, None] < NSPLIT) & (sp[:, None] * CHUNK <= pos) & kmask[None, :]
        base = part_ptr + ((r * H + ks[None, :] // D) * NSPLIT + sp[:, None]) * (D + 2)  # (BLOCK_SPL, BLOCK_K)
        m = tl.load(base + D, mask=live, other=-1e30)
        den = tl.load(base + D + 1, mask=live, other=0.0)
        acc = tl.load(base + ks[None, :] % D, mask=live, other=0.0)
        wt = tl.exp(m - tl.max(m, axis=0)[None, :])
        return tl.sum(wt * acc, axis=0) / tl.maximum(tl.sum(wt * den, axis=0), 1e-30)

    @triton.jit
    def _pdl_gemv_rows(x_ptr, w_ptr, bias_ptr, lnw_ptr, lnb_ptr, tok_ptr, wte_ptr, wpe_ptr, pos_ptr, part_ptr, S,
                       pid, sid, cols, cmask, rows, B: tl.constexpr, BB: tl.constexpr, K: tl.constexpr,
                       N: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KPER: tl.constexpr, SRC: tl.constexpr,
                       LN: tl.constexpr, H: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr,
                       BLOCK_SPL: tl.constexpr, CHUNK: tl.constexpr, GDC: tl.constexpr):
        # _ln_gemv_kernel's main part with PDL: the program's whole (KPER, BN) block of W (BK = KPER rounded
        # up to a power of two), the bias and the LayerNorm gains are loaded before the wait; after it, one
        # pass over the block per batch row in fp32 (CUDA cores, as benchmarks/pdl_probe.py), the inputs
        # rounded to W's dtype as the tl.dot path does. Returns what the loop there leaves (acc with rows B,
        # B + 1 = g @ W, beta @ W; s1, s2), pos and the bias.
        kk = tl.arange(0, BK)
        ks = sid * KPER + kk
        kmask = (kk < KPER) & (ks < K)
        w = tl.load(w_ptr + ks[:, None] * N + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
        bvec = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if LN:
            g = tl.load(lnw_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
            beta = tl.load(lnb_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        _gdc(GDC)  # everything below reads or writes what other kernels do
        pos = tl.load(pos_ptr)
        wf = w.to(tl.float32)
        acc = tl.zeros([BB, BN], dtype=tl.float32)
        s1 = tl.zeros([BB], dtype=tl.float32)
        s2 = tl.zeros([BB], dtype=tl.float32)
        for r in tl.static_range(B):
            if SRC == 0:
                xr = tl.load(x_ptr + r * K + ks, mask=kmask, other=0.0).to(tl.float32)
            elif SRC == 1:
                xr = _combine_cols(part_ptr, pos, r, ks, kmask, H, D, NSPLIT, BLOCK_SPL, CHUNK)
            else:
                tok = tl.load(tok_ptr + r)
                xr = (tl.load(wte_ptr + tok * K + ks, mask=kmask, other=0.0).to(tl.float32)
                      + tl.load(wpe_ptr + pos * K + ks, mask=kmask & (pos < S), other=0.0).to(tl.float32))
                tl.store(x_ptr + r * K + ks, xr, mask=kmask & (pid == 0))  # the residual row, as the loop path
            if LN:
                s1 = tl.where(rows == r, tl.sum(xr, axis=0), s1)
                s2 = tl.where(rows == r, tl.sum(xr * xr, axis=0), s2)
                xr = xr * g
            yr = tl.sum(xr.to(w.dtype).to(tl.float32)[:, None] * wf, axis=0)
            acc = tl.where(rows[:, None] == r, yr[None, :], acc)
        if LN:
            acc = tl.where(rows[:, None] == B, tl.sum(g.to(w.dtype).to(tl.float32)[:, None] * wf, axis=0)[None, :], acc)
            acc = tl.where(rows[:, None] == B + 1,
                           tl.sum(beta.to(w.dtype).to(tl.float32)[:, None] * wf, axis=0)[None, :], acc)
        return acc, s1, s2, pos, bvec

    @triton.jit
    def _ln_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, lnw_ptr, lnb_ptr, eps, tok_ptr, wte_ptr, wpe_ptr,
                        pos_ptr, part_ptr, kv_ptr, s_kv, s_b, s_h, s_s, S, ws_ptr, cnt_ptr,
                        B: tl.constexpr, BB: tl.constexpr, K: tl.constexpr, N: tl.constexpr, BK: tl.constexpr,
                        KSTEP: tl.constexpr, BN: tl.constexpr, KPER: tl.constexpr, SPLIT: tl.constexpr,
                        SRC: tl.constexpr, LN: tl.constexpr, GELU: tl.constexpr, EPI: tl.constexpr, H: tl.constexpr,
                        D: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_SPL: tl.constexpr, CHUNK: tl.constexpr,
                        PREC: tl.constexpr, PDL: tl.constexpr, GDC: tl.constexpr):
        # y[b, cols] = act(src(b) @ W[:, cols] + bias) for a (K, N) row-major W (GPT-2's Conv1D): program
        # (pid, sid) owns BN output columns, so the W rows it reads are contiguous, and K rows
        # [sid * KPER, (sid + 1) * KPER). The B rows are padded to an MMA tile (tl.dot). SRC: 0 rows of x,
        # 1 the attention partials, merged here (one head per K step), 2 token + position embeddings
        # (layer 0). EPI: 0 store, 1 add into out (the residual stream: own columns only, so in place is
        # safe), 2 q to out and k/v into the cache at pos. PDL: _pdl_gemv_rows instead of the K loop.
        pid = tl.program_id(0)
        sid = tl.program_id(1)
        cols = pid * BN + tl.arange(0, BN)
        cmask = cols < N
        rows = tl.arange(0, BB)
        if PDL:
            acc, s1, s2, pos, bvec = _pdl_gemv_rows(x_ptr, w_ptr, bias_ptr, lnw_ptr, lnb_ptr, tok_ptr, wte_ptr, wpe_ptr,
                                                    pos_ptr, part_ptr, S, pid, sid, cols, cmask, rows, B, BB, K, N,
                                                    BK, BN, KPER, SRC, LN, H, D, NSPLIT, BLOCK_SPL, CHUNK, GDC)
        else:
            pos = tl.load(pos_ptr)
            acc = tl.zeros([BB, BN], dtype=tl.float32)
            s1 = tl.zeros([BB], dtype=tl.float32)
            s2 = tl.zeros([BB], dtype=tl.float32)
            kk = tl.arange(0, BK)
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
        if PDL:
            y += bvec[None, :]
        else:
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
                            BLOCK_S: tl.constexpr, BPS: tl.constexpr, GDC: tl.constexpr):
        # One query per (batch row, head); program (bh, split) covers BPS blocks of BLOCK_S keys with an online
        # softmax. Keys past pos are masked, so their loads never reach memory: the step reads pos + 1 keys.
        # Output: the split's partial softmax (weighted values, max, sum), merged by the c_proj kernel; a
        # merge here by the last split to finish (a counter) measured slower on an H200 (+1.4 us a layer).
        # No model parameter here: with PDL (GDC) it waits first.
        _gdc(GDC)
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
                             BK: tl.constexpr, NPROG: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
                             GDC: tl.constexpr):
        # logits = LN_f(x) @ wte.T with wte (V, C) row-major: a program owns BN vocabulary rows, each read
        # contiguously along C; it also leaves its (max, first argmax) per batch row for the finish kernel.
        pid = tl.program_id(0)
        vs = pid * BN + tl.arange(0, BN)
        vm = vs < V
        rows = tl.arange(0, BB)
        kk = tl.arange(0, BK)
        if PDL:
            # the whole (BN, C) block of wte (BK = C rounded up to a power of two) and the LayerNorm gains
            # before the wait; then one fp32 pass over it per batch row (see _pdl_gemv_rows)
            ks = kk
            km = ks < C
            w = tl.load(w_ptr + vs[:, None] * C + ks[None, :], mask=vm[:, None] & km[None, :], other=0.0)
            g = tl.load(lnw_ptr + ks, mask=km, other=0.0).to(tl.float32)
            beta = tl.load(lnb_ptr + ks, mask=km, other=0.0).to(tl.float32)
            _gdc(GDC)
            wf = w.to(tl.float32)
            acc = tl.zeros([BB, BN], dtype=tl.float32)
            s1 = tl.zeros([BB], dtype=tl.float32)
            s2 = tl.zeros([BB], dtype=tl.float32)
            for r in tl.static_range(B):
                xr = tl.load(x_ptr + r * C + ks, mask=km, other=0.0)
                s1 = tl.where(rows == r, tl.sum(xr, axis=0), s1)
                s2 = tl.where(rows == r, tl.sum(xr * xr, axis=0), s2)
                yr = tl.sum((xr * g).to(w.dtype).to(tl.float32)[None, :] * wf, axis=1)
                acc = tl.where(rows[:, None] == r, yr[None, :], acc)
            acc = tl.where(rows[:, None] == B, tl.sum(g.to(w.dtype).to(tl.float32)[None, :] * wf, axis=1)[None, :], acc)
            acc = tl.where(rows[:, None] == B + 1,
                           tl.sum(beta.to(w.dtype).to(tl.float32)[None, :] * wf, axis=1)[None, :], acc)
        else:
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
                              NPROG: tl.constexpr, BLOCK_P: tl.constexpr, GDC: tl.constexpr):
        # One program: it alone reads pos and then advances it, so no other program can see it half-updated.
        _gdc(GDC)
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

# The decode step's kernels by role, for fused_step and the tuning benchmark (the functions keep their names:
# profiles and results/ name kernels by them).
KERNELS = ({"ln_gemv": _ln_gemv_kernel, "attn_decode": _attn_decode_kernel, "lm_head_gemv": _lm_head_gemv_kernel,
            "argmax_finish": _argmax_finish_kernel} if triton is not None else {})
