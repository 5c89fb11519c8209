/* What both forward kernels (attn_fwd.cu on mma.sync, attn_fwd_sm90.cu on wgmma) do to a tile
 * once its scores are in registers, and how they finish: the score hook and masks, the online
 * softmax step, the epilogue writing out and lse, and the zero rows after a packed batch.
 *
 * Register layout: a warp's scores are MT m16 tiles x NT n8 tiles in the mma C-fragment layout
 * (attn_common.cuh's legend); wgmma's m64nN accumulator is the same layout per warp (warp w of
 * the warpgroup owns rows 16w..16w+15), so both kernels call these with their own MT and NT.
 * Row numbers are packed rows: under PACK_GQA packed row pr is query row pr / G of head
 * h + pr % G; otherwise G = 1.
 *
 * Switches beyond attn_common.cuh's: PAGED (attn_fwd.cu: k, v a paged cache, each key row read
 * through the page table), PACK_GQA, SPLIT_KV (attn_fwd.cu's decode paths; 0 when
 * undefined).
 */
#ifndef ATTNEXT_ATTN_FWD_TILE_CUH
#define ATTNEXT_ATTN_FWD_TILE_CUH

#include "attn_common.cuh"

#ifndef PACK_GQA
#define PACK_GQA 0
#endif
#ifndef SPLIT_KV
#define SPLIT_KV 0
#endif
#ifndef PAGED
#define PAGED 0
#endif

/* Packed rows after the last sequence (varlen): zero output, lse -inf. */
template <int TILE_M, int NTHREADS>
DEV void zero_tail(const attn_params &p, int64_t h)
{
    int64_t first = packed_end_q(&p);
    elem_t *out = (elem_t *)p.out.ptr + h * p.out.s[2];
    float *lse = (float *)p.lse.ptr + h * p.lse.s[1];
    for (int64_t r = first + blockIdx.x * TILE_M; r < p.Sq; r += (int64_t)gridDim.x * TILE_M)
        for (int i = threadIdx.x; i < TILE_M * HEAD_DIM_V; i += NTHREADS) {
            int64_t row = r + i / HEAD_DIM_V;
            if (row < p.Sq) {
                out[row * p.out.s[1] + (i % HEAD_DIM_V) * p.out.s[3]] = 0;
                if (i % HEAD_DIM_V == 0 && lse)
                    lse[row * p.lse.s[2]] = NEG_INF;
            }
        }
}

/* Query tile x of the tiles_x of sequence b in the Hopper kernels' BLOCK_M x BLOCK_N tiles: the
 * sequences' extents, rows [m0, r_end) (r_end: the end of the real rows) and the key tiles
 * n_first..n_last it visits (kv_range: the causal / window band; none: n_last < n_first). False
 * when the tile lies past the sequence's rows. DENSE: a batch without cu_seqlens or seqused (the
 * persistent grid's: select.fwd_persist), whose sequences are the tensors' whole rows, known
 * without seq_q / seq_k's reads and clamps (half the producer's serial path to a tile's Q copy). */
template <bool DENSE = false>
DEV bool query_tile(const attn_params &p, int64_t b, int x, int tiles_x, seq_t &sq, seq_t &sk, int &m0, int &r_end,
                    int &n_first, int &n_last)
{
    if (DENSE) {
        sq = {0, p.Sq, p.Sq, b};
        sk = {0, p.Sk, p.Sk, b};
    } else {
        sq = seq_q(&p, b);
        sk = seq_k(&p, b);
    }
    m0 = (tiles_x - 1 - x) * BLOCK_M;                   /* x = 0: the last rows (the most keys under causal) */
    if (m0 >= sq.rows)
        return false;
    r_end = min(m0 + BLOCK_M, (int)sq.len);
    int64_t lo = 0, hi = 0;
    if (m0 < sq.len)
        kv_range(&p, m0, r_end, (int)sq.len, (int)sk.len, &lo, &hi);
    n_first = (int)(lo / BLOCK_N);
    n_last = hi > lo ? (int)((hi - 1) / BLOCK_N) : -1;
    return true;
}

/* Whether the tile of packed rows [m0, m0 + block_m) x key columns [c0, c0 + block_n) needs the
 * per-element tests: a mask array or a mask_mod that may mask some pair of it, a tile past either
 * length, or a tile crossing the causal / window band. r_end: the end of the packed rows with a
 * real query. */
DEV bool tile_needs_mask(const attn_params &p, const score_ctx &sc, int m0, int block_m, int r_end, int c0,
                         int block_n, int G, int Lq, int Lk)
{
    return tile_maybe_masked(sc, m0 / G, (r_end - 1) / G + 1, c0, min(c0 + block_n, Lk))
           || c0 + block_n > Lk || m0 + block_m > Lq * G
           || !tile_inside_band(&p, m0 / G, (r_end - 1) / G + 1, c0, c0 + block_n, Lq, Lk);
}

/* The key columns [lo, hi) row r keeps by the lengths and the causal / window band; none for a
 * row past Lq or when the tile needs no per-element test (need false). */
DEV void row_band(const attn_params &p, bool need, int r, int Lq, int Lk, int &lo, int &hi)
{
    int64_t lo64 = 0, hi64 = 0;
    if (need && r < Lq)
        kv_range(&p, r, r + 1, Lq, Lk, &lo64, &hi64);
    lo = (int)lo64;
    hi = (int)hi64;
}

#if ATTN_GMODS
/* keep_pass over a forward tile (a warp's rows from packed row row0, key columns from c0): a
 * pair lies in the band of its row (row_band). */
template <int MT, int NT>
DEV void fwd_keep(const attn_params &p, const score_ctx &sc, const float (&s)[MT][NT][4], int row0, int c0,
                  bool need, int G, int Lq, int Lk, tile_keep<MT, NT> &keep, mod_fault &fault)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int lo[2 * MT], hi[2 * MT];
#pragma unroll
    for (int i = 0; i < 2 * MT; i++)
        row_band(p, need, (row0 + (i / 2) * 16 + g + (i % 2) * 8) / G, Lq, Lk, lo[i], hi[i]);
    keep_pass(sc, need, s, keep, fault, [&](int mt, int nt, int e, int &r, int &c, bool &band) {
        r = (row0 + mt * 16 + g + (e / 2) * 8) / G;
        c = c0 + nt * 8 + 2 * t + (e & 1);
        band = c >= lo[mt * 2 + e / 2] && c < hi[mt * 2 + e / 2];
    });
}

/* A tile of the generated kernels: which pairs it keeps first (fwd_keep: a mask_mod's verdicts,
 * its lookups in one batch), then every score branch-free (kept_score), in the softmax's units
 * (score_ctx's raw); one
 * report for the lookups of both that went out of range. score_tile's one path for every tile
 * with a score_mod (the score_mod's code exists once: each copy costs NVRTC time), its path for
 * the tiles a mask_mod alone may mask. */
template <int MT, int NT>
DEV void kept_tile(const attn_params &p, const score_ctx &sc, float (&s)[MT][NT][4], int row0, int c0, bool need,
                   int G, int Lq, int Lk)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    mod_fault fault = no_fault();
    tile_keep<MT, NT> keep;
    fwd_keep(p, sc, s, row0, c0, need, G, Lq, Lk, keep, fault);
#if !HAS_SCORE_MOD
    report_fault(sc, fault);      /* mask_mod's lookups alone: reported before the scores */
#endif
    /* with a score_mod that may run anywhere, every pair's score (the lookups clamp; a fault
     * counts where the pair is kept), then -inf where a tile that needs the test drops a pair: a
     * tile that needs none selects nothing */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = (row0 + mt * 16 + g + (e / 2) * 8) / G;
                const int c = c0 + nt * 8 + 2 * t + (e & 1);
                const float dot = s[mt][nt][e];
                int bad = 0;
#if SCORE_ANYWHERE && HAS_SCORE_MOD
                s[mt][nt][e] = score_of(sc, dot, r, c, bad);
                note_fault(fault, keep.at(mt, nt, e) ? bad : 0, r, c, dot);
#else
                s[mt][nt][e] = kept_unit_score(sc, keep.at(mt, nt, e), dot, r, c, bad);
                note_fault(fault, bad, r, c, dot);
#endif
            }
#if SCORE_ANYWHERE && HAS_SCORE_MOD
    if (need) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[mt][nt][e] = keep.at(mt, nt, e) ? s[mt][nt][e] : NEG_INF;
    }
#endif
#if HAS_SCORE_MOD
    report_fault(sc, fault);
#endif
}
#endif

/* One key tile's raw q.k in s become scores in the softmax's units (score_ctx's raw) for a warp's
 * rows: scale, the score hook, and -inf for masked pairs. row0: the packed row of the warp's
 * first row; c0: the tile's first key column. A tile that needs no mask takes no work per score
 * when the options leave the score plain and the scale is positive (its q.k are the units). */
template <int MT, int NT>
DEV void score_tile(const attn_params &p, const score_ctx &sc, float (&s)[MT][NT][4], int row0, int c0,
                    bool need_mask, int G, int Lq, int Lk)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if ATTN_GMODS && HAS_SCORE_MOD
    /* a score_mod: which pairs the tile keeps first (keep_pass: a mask_mod's lookups in one
     * batch), then one path for every tile, so that the score_mod's code exists once (each copy
     * costs NVRTC time), branch-free (kept_score) */
    kept_tile(p, sc, s, row0, c0, need_mask, G, Lq, Lk);
#else
    int bad = 0;
    if (!need_mask) {
#if SCORE_IS_PLAIN
        if (!sc.raw)
#endif
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = (row0 + mt * 16 + g + (e / 2) * 8) / G;
                    const int c = c0 + nt * 8 + 2 * t + (e & 1);
                    s[mt][nt][e] = unit_score(sc, s[mt][nt][e], r, c, bad);
                }
    } else {
#if ATTN_GMODS
        kept_tile(p, sc, s, row0, c0, true, G, Lq, Lk);     /* a mask_mod alone, masked tiles only */
#else
#pragma unroll
        for (int i = 0; i < 2 * MT; i++) {
            const int mt = i / 2, e0 = (i % 2) * 2;
            const int r = (row0 + mt * 16 + g + (i % 2) * 8) / G;
            int lo_r, hi_r;
            row_band(p, true, r, Lq, Lk, lo_r, hi_r);
            const uint64_t band = band_bits<NT>(lo_r, hi_r, c0, t);
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = e0; e < e0 + 2; e++) {
                    const int c = c0 + nt * 8 + 2 * t + (e & 1);
                    const bool keep = (band >> (2 * nt + (e & 1)) & 1) && mask_keeps(sc, r, c, bad);
                    s[mt][nt][e] = kept_unit_score(sc, keep, s[mt][nt][e], r, c, bad);
                }
        }
#endif
    }
#endif
}

/* How far (log2 units) a row's running maximum may lag behind its scores' before it moves
 * (FlashAttention-4's rescale threshold): P <= 2^STALE_MAX_LOG2 then, held in bf16 / fp16 /
 * float32 at the same relative precision as a P <= 1, though the largest P is no longer 1
 * exactly (bf16 out: ~3% more RMS error against float64; bench/NOTES.md, forward v30). */
#define STALE_MAX_LOG2 8.f

/* The online softmax over one tile of scores (the units of score_tile; to_log2 turns their
 * differences into log2 units): row maxima m (over the quad), l rescaled and summed, s
 * overwritten by P = exp2((S - m) to_log2), unnormalised; corrs[i] is the factor O's row i
 * must be multiplied by (1 when its maximum did not move). A row's m moves only when the tile
 * holds a score more than STALE_MAX_LOG2 above it (or m is still -inf): the sums and O stay
 * in step with the m they were taken against, so O / l and lse = m + log l are the same, and
 * after a row's first tiles its O is rarely rescaled (rescale_o: the warp skips when no row
 * moved). The maximum is subtracted before the change of units: no finite score overflows
 * (p <= 2^STALE_MAX_LOG2), and at huge magnitudes, where distinct scores differ by more than
 * the threshold, m moves to each new maximum, whose p is then exactly 1. */
template <int MT, int NT>
DEV void softmax_update(float (&s)[MT][NT][4], float (&m)[2 * MT], float (&l)[2 * MT], float (&corrs)[2 * MT],
                        float to_log2, float stale_log2 = STALE_MAX_LOG2)
{
#pragma unroll
    for (int i = 0; i < 2 * MT; i++) {
        const int mt = i / 2, e0 = (i % 2) * 2;
        float mx = m[i];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            mx = fmaxf(mx, fmaxf(s[mt][nt][e0], s[mt][nt][e0 + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if ((mx - m[i]) * to_log2 <= stale_log2)       /* false while m is -inf (NaN, +inf) */
            mx = m[i];
        const float base = mx == NEG_INF ? 0.f : mx;   /* a row with nothing kept yet stays 0 */
        const float corr = fast_exp2((m[i] - base) * to_log2);
        m[i] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[mt][nt][e0] = fast_exp2((s[mt][nt][e0] - base) * to_log2);
            s[mt][nt][e0 + 1] = fast_exp2((s[mt][nt][e0 + 1] - base) * to_log2);
            sum += s[mt][nt][e0] + s[mt][nt][e0 + 1];
        }
        l[i] = l[i] * corr + sum;
        corrs[i] = corr;
    }
}

/* softmax_lazy's rows: every row of the warp has a maximum m with |m to_log2| < LAZY_MC_MAX (not
 * -inf: a row's first tiles; not huge, where m to_log2's rounding would move P by more than a few
 * float32 ulps, and past 2^31 by whole tiles' weights). A warp vote: the others take
 * softmax_update. */
#define LAZY_MC_MAX 256.f
template <int MT>
DEV bool lazy_rows(const float (&m)[2 * MT], float to_log2)
{
    bool ok = true;
#pragma unroll
    for (int i = 0; i < 2 * MT; i++)
        ok &= fabsf(m[i] * to_log2) < LAZY_MC_MAX;          /* false for -inf and NaN */
    return __all_sync(0xffffffffu, ok);
}

/* softmax_update's common case without the row maxima, for a warp whose rows all pass lazy_rows
 * (LAZY_MAX: attn_fwd_sm90.cu's WS kernel on plain calls, whose softmax is bound by its
 * instruction issue): s becomes P = exp2(S to_log2 - m to_log2) against m as it stands, one FFMA
 * and an exp2 a score, and the tile is kept where every thread's partial sum of each of its rows
 * is at most 2^STALE_MAX_LOG2. Then so is every p (to the FFMA's rounding): the tile holds no
 * score that softmax_update would move m for, and O needs no rescale. m to_log2 is rounded once
 * a row (at most 2^-17 log2 units under LAZY_MC_MAX): a factor common to the row's P and l while
 * m stands, which O / l cancels. Else (a sum larger, inf or NaN in any lane: warp-uniform) it
 * returns false with l as it was and s holding the P it took, sums[i] each row's partial sum. */
template <int MT, int NT>
DEV bool softmax_lazy(float (&s)[MT][NT][4], const float (&m)[2 * MT], float (&l)[2 * MT], float (&sums)[2 * MT],
                      float to_log2)
{
    bool kept = true;
#pragma unroll
    for (int i = 0; i < 2 * MT; i++) {
        const int mt = i / 2, e0 = (i % 2) * 2;
        const float mc = m[i] * to_log2;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[mt][nt][e0] = fast_exp2(fmaf(s[mt][nt][e0], to_log2, -mc));
            s[mt][nt][e0 + 1] = fast_exp2(fmaf(s[mt][nt][e0 + 1], to_log2, -mc));
            sum += s[mt][nt][e0] + s[mt][nt][e0 + 1];
        }
        sums[i] = sum;
        kept &= sum <= (float)(1 << (int)STALE_MAX_LOG2);   /* false for NaN */
    }
    if (!__all_sync(0xffffffffu, kept))
        return false;
#pragma unroll
    for (int i = 0; i < 2 * MT; i++)
        l[i] += sums[i];
    return true;
}

/* The scores back from softmax_lazy's P where no p overflowed: s = m + log2(p) / to_log2 (lg2's
 * error ~2^-22 of the log2 units; p = 0, a score under m by more than 126 log2 units or masked,
 * gives -inf, which the m it moves to maps to 0 again). */
template <int MT, int NT>
DEV void scores_from_p(float (&s)[MT][NT][4], const float (&m)[2 * MT], float to_log2)
{
    const float to_units = 1.f / to_log2;
#pragma unroll
    for (int i = 0; i < 2 * MT; i++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = (i % 2) * 2; e < (i % 2) * 2 + 2; e++)
                s[i / 2][nt][e] = m[i] + fast_log2(s[i / 2][nt][e]) * to_units;
}

/* O's rows (a thread's 2 * MT) times their factors f, in place. */
template <int MT, int OT>
DEV void scale_rows(float (&o)[MT][OT][4], const float (&f)[2 * MT])
{
#pragma unroll
    for (int i = 0; i < 2 * MT; i++)
#pragma unroll
        for (int nt = 0; nt < OT; nt++) {
            o[i / 2][nt][(i % 2) * 2] *= f[i];
            o[i / 2][nt][(i % 2) * 2 + 1] *= f[i];
        }
}

/* O's rows times corrs, skipped when no row of the warp moved (after the first tiles the
 * maxima rarely do). */
template <int MT, int OT>
DEV void rescale_o(float (&o)[MT][OT][4], const float (&corrs)[2 * MT])
{
    bool moved = false;
#pragma unroll
    for (int i = 0; i < 2 * MT; i++)
        moved |= corrs[i] != 1.f;
    if (__any_sync(0xffffffffu, moved))
        scale_rows(o, corrs);
}

/* One key tile of the online softmax for a warp's rows: score_tile, softmax_update, rescale_o. */
template <int MT, int NT, int OT>
DEV void softmax_step(const attn_params &p, const score_ctx &sc, float (&s)[MT][NT][4],
                      float (&o)[MT][OT][4], float (&m)[2 * MT], float (&l)[2 * MT], int row0, int c0,
                      bool need_mask, int G, int Lq, int Lk)
{
    float corrs[2 * MT];
    score_tile(p, sc, s, row0, c0, need_mask, G, Lq, Lk);
    softmax_update(s, m, l, corrs, sc.to_log2);
    rescale_o(o, corrs);
}

/* The A fragment (mma m16n8k16 / wgmma m64nNk16 register operand) of P's keys 16kk..16kk+15. */
template <int MT, int NT>
DEV void p_fragment(const float (&s)[MT][NT][4], int mt, int kk, uint32_t (&a)[4])
{
    a[0] = pack2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
    a[1] = pack2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
    a[2] = pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
    a[3] = pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
}

/* The end of a warp's rows: inv[i] = 1 / l (0 for rows that keep nothing and for padding
 * rows), and lse = log(l) + max (-inf for those rows) written to lse, or under SPLIT_KV to this
 * split's lse_accum slot. With sinks (not under SPLIT_KV: attn_fwd_combine adds them) a real
 * row's sum gains exp(sink): inv = e^(max - M) / l', lse = M + log l', l' = l e^(max - M) +
 * e^(sink - M), M the larger of the two; a real row that keeps nothing gets lse = sink.
 * row0: the packed row of the warp's first row; h: the block's (first)
 * query head; to_natural: score_ctx's, the max's units to the natural score. */
template <int MT>
DEV void finish_rows(const attn_params &p, const seq_t &sq, float to_natural, const float (&m)[2 * MT],
                     const float (&l)[2 * MT], int row0, int64_t b, int64_t h, int G, int split, int Lq,
                     float (&inv)[2 * MT])
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float ls[2 * MT];                                    /* every row's quad sum first: the */
#pragma unroll                                           /* shuffles of all rows in flight at once */
    for (int i = 0; i < 2 * MT; i++)
        ls[i] = l[i] + __shfl_xor_sync(0xffffffffu, l[i], 1);
#pragma unroll
    for (int i = 0; i < 2 * MT; i++)
        ls[i] += __shfl_xor_sync(0xffffffffu, ls[i], 2);
#pragma unroll
    for (int i = 0; i < 2 * MT; i++) {
        const float li = ls[i];
        const int pr = row0 + (i / 2) * 16 + g + (i % 2) * 8;
        const int r = pr / G;
        const int64_t hr = h + pr % G;
        const bool live = r < Lq && li != 0.f;          /* l is a sum of exp2 >= 0; NaN stays NaN */
        /* by the hardware's approximations (MUFU.RCP, MUFU.LG2: within a few float32 ulps of 1 / l
         * and log2 l), where IEEE division and log2f took a range test, a slow-path call and a
         * polynomial each: a serial chain at every tile's end, when both computing warpgroups
         * finish together and the tensor cores idle. A live l is at least 1 (the row's maximum
         * keeps p = 1 or more) and at most Sk 2^8, so neither meets its edge cases. */
        inv[i] = live ? fast_rcp(li) : 0.f;
        float lse_r = live ? m[i] * to_natural + fast_log2(li) * LN2 : NEG_INF;
#if !SPLIT_KV
        if (p.sinks && r < Lq) {
            const float sink = ((const float *)p.sinks)[hr];
            if (!live) {
                lse_r = sink;
            } else if (sink != NEG_INF) {
                const float mn = m[i] * to_natural, M = fmaxf(mn, sink), a = expf(mn - M);
                const float l2 = li * a + expf(sink - M);
                inv[i] = a / l2;
                lse_r = M + logf(l2);
            }
        }
#endif
        if (t != 0 || r >= sq.rows)
            continue;
#if SPLIT_KV
        {   /* the split's maximum and sum, not its lse: at 1e10 lse rounds log(sum) away, and
             * attn_fwd_combine must weigh splits of different sums apart */
            const int64_t at = ((split * p.B + b) * p.Hq + hr) * p.Sq + r;
            p.lse_accum[at] = live ? m[i] * to_natural : NEG_INF;
            p.lse_accum[(int64_t)p.num_splits * p.B * p.Hq * p.Sq + at] = live ? li : 0.f;
        }
#else
        if (p.lse.ptr)                                   /* a GPU call returning no lse has none */
            ((float *)p.lse.ptr)[sq.mem_b * p.lse.s[0] + hr * p.lse.s[1] + (sq.start + r) * p.lse.s[2]] = lse_r;
#endif
    }
}

/* O = O * inv in place for a warp's rows (finish_rows' inv), exactly 0 where inv is 0, a row that
 * keeps no key (an unkept NaN or inf value may sit in its O as 0 * NaN): one multiply an element,
 * and before it, only where a row of the warp keeps no key (rare), that row's O set to 0 (then
 * 0 * 0 = +0; no test an element on the common path). */
template <int MT, int OT>
DEV void normalize_o(float (&o)[MT][OT][4], const float (&inv)[2 * MT])
{
    bool dead = false;
#pragma unroll
    for (int i = 0; i < 2 * MT; i++)
        dead |= inv[i] == 0.f;
    if (__any_sync(0xffffffffu, dead)) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < OT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    o[mt][nt][e] = inv[2 * mt + e / 2] != 0.f ? o[mt][nt][e] : 0.f;
        asm volatile("");                                /* a branch, not a select an element */
    }
    scale_rows(o, inv);
}

/* out = O (normalize_o's) for a warp's rows, element by element through out's strides (under
 * SPLIT_KV: the float32 partial into this split's o_accum slot). */
template <int MT, int OT>
DEV void store_o(const attn_params &p, const seq_t &sq, const float (&o)[MT][OT][4], int row0, int64_t b,
                 int64_t h, int G, int split)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2 * MT; i++) {
        const int mt = i / 2, e0 = (i % 2) * 2;
        const int pr = row0 + mt * 16 + g + (i % 2) * 8;
        const int r = pr / G;
        const int64_t hr = h + pr % G;
        if (r >= sq.rows)
            continue;
#if SPLIT_KV
        float *orow = p.o_accum + (((split * p.B + b) * p.Hq + hr) * p.Sq + r) * HEAD_DIM_V;
#pragma unroll
        for (int nt = 0; nt < OT; nt++) {
            const int d = nt * 8 + 2 * t;
            if (d < HEAD_DIM_V)
                orow[d] = o[mt][nt][e0];
            if (d + 1 < HEAD_DIM_V)
                orow[d + 1] = o[mt][nt][e0 + 1];
        }
#else
        elem_t *orow = (elem_t *)p.out.ptr + sq.mem_b * p.out.s[0] + (sq.start + r) * p.out.s[1] + hr * p.out.s[2];
#pragma unroll
        for (int nt = 0; nt < OT; nt++) {
            const int d = nt * 8 + 2 * t;
            if (d < HEAD_DIM_V)
                orow[d * p.out.s[3]] = f32_to_elem(o[mt][nt][e0]);
            if (d + 1 < HEAD_DIM_V)
                orow[(d + 1) * p.out.s[3]] = f32_to_elem(o[mt][nt][e0 + 1]);
        }
#endif
    }
}

/* finish_rows, normalize_o (O in place), then store_o. */
template <int MT, int OT>
DEV void write_out(const attn_params &p, const seq_t &sq, float to_natural, float (&o)[MT][OT][4],
                   const float (&m)[2 * MT], const float (&l)[2 * MT], int row0, int64_t b, int64_t h,
                   int G, int split, int Lq)
{
    float inv[2 * MT];
    finish_rows<MT>(p, sq, to_natural, m, l, row0, b, h, G, split, Lq, inv);
    normalize_o(o, inv);
    store_o(p, sq, o, row0, b, h, G, split);
}

#endif
