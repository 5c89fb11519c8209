/* The CPU backend: FlashAttention's tiled online-softmax algorithm, forward and backward, for one
 * accumulation type T. Included once per type by cpu.c with these names defined:
 *   T            float or double              SUF        f32 or f64
 *   OPS          simd_f32() / simd_f64()      LOAD_ROW   load_row_f32 / load_row_f64
 *   STORE_ROW    store_row_f32 / _f64         TANH, LOG, LOG2, EXP  libm functions for T
 *
 * Legend (attn_params.h): q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv),
 * out (B, Sq, Hq, Dv), lse (B, Hq, Sq), bias and mask (B, Hb, Sq, Sk).
 *
 * K and V (and in the backward Q and dO) are first packed into T tiles padded for the SIMD
 * product: memory linear in the sequence length, never Sq * Sk. Work is split over (batch, head,
 * query block) in the forward and (batch, kv head, key chunk) in the backward; every reduction
 * runs in a fixed order, so results do not depend on the thread count or the schedule.
 */

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)

/* Per-sequence tile bookkeeping: tile i of sequence b is packed at index off[b] + i. */
typedef struct {
    int64_t *off;       /* (B + 1) prefix sums of tiles per sequence */
    int64_t max_tiles;  /* most tiles in one sequence */
} FN(tiling);

static int FN(tiling_init)(FN(tiling) *t, const attn_params *p, int is_q, int64_t tile)
{
    t->off = (int64_t *)malloc(sizeof(int64_t) * (p->B + 1));
    if (!t->off)
        return -1;
    t->off[0] = 0;
    t->max_tiles = 0;
    for (int64_t b = 0; b < p->B; b++) {
        seq_t s = is_q ? seq_q(p, b) : seq_k(p, b);
        int64_t n = (s.len + tile - 1) / tile;
        t->off[b + 1] = t->off[b] + n;
        t->max_tiles = imax64(t->max_tiles, n);
    }
    return 0;
}

/* Sequence b holding packed tile g (binary search in the prefix sums). */
static int64_t FN(tiling_seq)(const FN(tiling) *t, int64_t B, int64_t g)
{
    int64_t lo = 0, hi = B;
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (t->off[mid] <= g)
            lo = mid;
        else
            hi = mid;
    }
    return lo;   /* off[lo] <= g < off[lo + 1]: empty sequences are never returned */
}

static void *FN(alloc_bytes)(size_t bytes) { return cpu_alloc_bytes(bytes); }

static void *FN(alloc)(size_t n_elems) { return FN(alloc_bytes)(n_elems * sizeof(T)); }

/* Frees what FN(alloc)(n_elems) returned: a large block may be kept for the next call (cpu.c). */
static void FN(free_n)(void *ptr, size_t n_elems) { cpu_free_bytes(ptr, n_elems * sizeof(T)); }

static int FN(nthreads)(const attn_params *p) { return cpu_threads(p->num_threads); }

/* Pointer to row `row` of head `h` of batch item `b` of a (B, S, H, D)-strided tensor. */
static inline const char *FN(row_ptr)(const tensor4 *t, attn_dtype dt, int64_t b, int64_t row,
                                      int64_t h)
{
    return (const char *)t->ptr + (b * t->s[0] + row * t->s[1] + h * t->s[2]) * (int64_t)dtype_size(dt);
}

/* lse[b, h, row] (b the batch index in memory); lse is stored in T, the accumulation type. */
static inline T *FN(lse_at)(const attn_params *p, int64_t b, int64_t h, int64_t row)
{
    return (T *)p->lse.ptr + b * p->lse.s[0] + h * p->lse.s[1] + row * p->lse.s[2];
}

/* Query tile g of a tiling with H heads per tile: its sequence, head, first row and real rows. */
static seq_t FN(q_tile)(const FN(tiling) *t, const attn_params *p, int64_t H, int64_t g,
                        int64_t *h, int64_t *r0, int64_t *nr)
{
    int64_t tile = g / H, b = FN(tiling_seq)(t, p->B, tile);
    seq_t sq = seq_q(p, b);
    *h = g % H;
    *r0 = (tile - t->off[b]) * BQ;
    *nr = imin64(BQ, sq.len - *r0);
    return sq;
}

/* Pack key tile g of the tiling (tile index * Hk + kv head) into those of these that are not
 * NULL, each an array of tiles: kt (D x BK) transposed, kr (BK x DP) row-major,
 * vr (BK x DvP) row-major, vt (Dv x BK). Columns/rows past the sequence's length are zero. */
static void FN(pack_kv)(const attn_params *p, const FN(tiling) *tiles, int64_t g, int64_t DP,
                        int64_t DvP, T *kt, T *kr, T *vr, T *vt, T *row)
{
    const int64_t tile = g / p->Hk, hk = g % p->Hk, b = FN(tiling_seq)(tiles, p->B, tile);
    const int64_t kb = tile - tiles->off[b];
    if (kt) kt += g * p->D * BK;
    if (kr) kr += g * BK * DP;
    if (vr) vr += g * BK * DvP;
    if (vt) vt += g * p->Dv * BK;
    seq_t sk = seq_k(p, b);
    int64_t D = p->D, Dv = p->Dv;
    for (int64_t j = 0; j < BK; j++) {
        int64_t c = kb * BK + j;
        int valid = c < sk.len;
        int64_t mb = 0, mr = 0;
        if (valid)
            key_row(p, &sk, b, c, &mb, &mr);
        /* a row lands in its row-major tile (else in `row`); the transposed tile takes it from there */
        if (kt || kr) {
            T *x = kr ? kr + j * DP : row;
            if (valid)
                LOAD_ROW(FN(row_ptr)(&p->k, p->dtype, mb, mr, hk), p->k.s[3], D, p->dtype, x);
            else
                memset(x, 0, sizeof(T) * D);
            if (kr)
                memset(x + D, 0, sizeof(T) * (DP - D));
            if (kt)
                for (int64_t d = 0; d < D; d++) kt[d * BK + j] = x[d];
        }
        if (vr || vt) {
            T *x = vr ? vr + j * DvP : row;
            if (valid)
                LOAD_ROW(FN(row_ptr)(&p->v, p->dtype, mb, mr, hk), p->v.s[3], Dv, p->dtype, x);
            else
                memset(x, 0, sizeof(T) * Dv);
            if (vr)
                memset(x + Dv, 0, sizeof(T) * (DvP - Dv));
            if (vt)
                for (int64_t d = 0; d < Dv; d++) vt[d * BK + j] = x[d];
        }
    }
}

/* Load rows [r0, r0 + nr) of head h of a (B, S, H, n)-tensor into dst (rows padded to Mr with
 * zeros, ld columns, columns past n zero). */
static void FN(load_rows)(const tensor4 *t, attn_dtype dt, seq_t s, int64_t h, int64_t r0,
                          int64_t nr, int64_t Mr, int64_t n, int64_t ld, T *dst)
{
    for (int64_t i = 0; i < Mr; i++) {
        T *d = dst + i * ld;
        if (i < nr)
            LOAD_ROW(FN(row_ptr)(t, dt, s.mem_b, s.start + r0 + i, h), t->s[3], n, dt, d);
        for (int64_t x = i < nr ? n : 0; x < ld; x++)
            d[x] = 0;
    }
}

/* A thread's buffers for score_mod / mask_mod (interp.h): the interpreter's registers, the kept
 * pairs of a tile, the pairs inside the lengths, mask_mod's result, and (backward) the scores
 * score_mod was given. All tiles are BQ x BK, row-major. */
typedef struct {
    void *scratch;
    unsigned char *keep, *inside, *mk;
    T *s2;
    void *stash;
} FN(mod_bufs);

static int FN(mod_bufs_init)(FN(mod_bufs) *mb, const interp_mods *mods, int with_s2)
{
    memset(mb, 0, sizeof *mb);
    if (!mods)
        return 0;
    mb->scratch = FN(alloc_bytes)((size_t)interp_scratch_bytes(mods, sizeof(T)));
    mb->keep = (unsigned char *)malloc(BQ * BK);
    mb->inside = (unsigned char *)malloc(BQ * BK);
    mb->mk = (unsigned char *)malloc(BQ * BK);
    if (with_s2 && interp_has(&mods->score)) {
        mb->s2 = (T *)FN(alloc)(BQ * BK);
        mb->stash = FN(alloc_bytes)((size_t)interp_stash_bytes(mods, sizeof(T), BQ * BK));
        if (!mb->s2 || !mb->stash)
            return -1;
    }
    return mb->scratch && mb->keep && mb->inside && mb->mk ? 0 : -1;
}

static void FN(mod_bufs_free)(FN(mod_bufs) *mb)
{
    free(mb->scratch); free(mb->keep); free(mb->inside); free(mb->mk); free(mb->s2); free(mb->stash);
}

/* Marks pairs (i < nr, j < n) of a BQ x BK tile as inside the sequence lengths. */
static void FN(mark_inside)(unsigned char *inside, int64_t nr, int64_t n)
{
    for (int64_t i = 0; i < nr; i++)
        for (int64_t j = 0; j < BK; j++)
            inside[i * BK + j] = j < n;
}

/* The score pipeline of docs/design.md's steps 1-6 over a tile S[nr x n] of raw q.k products for
 * rows r0.., columns c0..: scale, softcap, bias, alibi, score_mod, then -inf for every pair a
 * mask drops. With `tanh_out`, also stores tanh(s / softcap) for the backward. With score_mod or
 * mask_mod (mb not NULL), the kept pairs are found first (mask_mod is skipped when mask_full: the
 * block mask says it keeps the whole tile), score_mod runs on them only, mb->keep holds them
 * afterwards and mb->s2 (when allocated) the scores score_mod was given. Returns 0, or -1 when a
 * lookup was out of range (p->mods->err says where). */
static int FN(score_tile)(const attn_params *p, int64_t b, int64_t h, int64_t r0, int64_t nr,
                          int64_t c0, int64_t n, int64_t Lq, int64_t Lk, T *S, T *tanh_out,
                          T *rowbuf, unsigned char *maskbuf, FN(mod_bufs) *mb, int mask_full)
{
    const T scale = (T)p->scale, cap = (T)p->softcap;
    const int64_t off = Lk - Lq;
    T slope = 0;
    if (p->alibi.ptr) {
        const char *a = (const char *)p->alibi.ptr
                        + (b * p->alibi.s[0] + h * p->alibi.s[1]) * (int64_t)dtype_size(p->alibi_dtype);
        LOAD_ROW(a, 1, 1, p->alibi_dtype, &slope);
    }
    for (int64_t i = 0; i < nr; i++) {
        const int64_t r = r0 + i;
        T *s = S + i * BK;
        int64_t lo, hi;
        kv_range(p, r, r + 1, Lq, Lk, &lo, &hi);
        for (int64_t j = 0; j < n; j++)
            s[j] *= scale;
        if (cap > 0) {
            T *t = tanh_out ? tanh_out + i * BK : NULL;
            for (int64_t j = 0; j < n; j++) {
                T th = TANH(s[j] / cap);
                s[j] = cap * th;
                if (t) t[j] = th;
            }
        }
        if (p->bias.ptr) {
            int64_t hb = h / (p->Hq / p->bias_heads);
            const char *src = (const char *)p->bias.ptr
                + (b * p->bias.s[0] + hb * p->bias.s[1] + r * p->bias.s[2] + c0 * p->bias.s[3])
                  * (int64_t)dtype_size(p->bias_dtype);
            LOAD_ROW(src, p->bias.s[3], n, p->bias_dtype, rowbuf);
            for (int64_t j = 0; j < n; j++)
                s[j] += rowbuf[j];
        }
        if (p->alibi.ptr)
            for (int64_t j = 0; j < n; j++) {
                int64_t dist = r + off - (c0 + j);
                s[j] -= slope * (T)(dist < 0 ? -dist : dist);
            }
        if (p->mask.ptr) {
            int64_t hm = h / (p->Hq / p->mask_heads);
            const unsigned char *m = (const unsigned char *)p->mask.ptr
                + b * p->mask.s[0] + hm * p->mask.s[1] + r * p->mask.s[2] + c0 * p->mask.s[3];
            for (int64_t j = 0; j < n; j++)
                maskbuf[j] = m[j * p->mask.s[3]];
        }
        if (mb) {
            unsigned char *keep = mb->keep + i * BK;
            for (int64_t j = 0; j < BK; j++)
                keep[j] = j < n && c0 + j >= lo && c0 + j < hi && (!p->mask.ptr || maskbuf[j]);
            for (int64_t j = n; j < BK; j++)
                s[j] = 0;   /* columns past the keys: defined values for the interpreter */
            continue;
        }
        if (p->mask.ptr)
            for (int64_t j = 0; j < n; j++)
                if (!maskbuf[j])
                    s[j] = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            int64_t c = c0 + j;
            if (c < lo || c >= hi)
                s[j] = -INFINITY;
        }
    }
    if (!mb)
        return 0;
    const interp_mods *mods = p->mods;
    const int64_t np = nr * BK;
    if (interp_has(&mods->mask) && !mask_full) {
        interp_tile t = {b, h, r0, c0, BK, np, mb->inside};
        FN(mark_inside)(mb->inside, nr, n);
        if (FN(interp_eval)(mods, &mods->mask, &t, NULL, NULL, NULL, mb->mk, NULL, NULL, mb->scratch))
            return -1;
        for (int64_t k = 0; k < np; k++)
            mb->keep[k] &= mb->mk[k];
    }
    if (interp_has(&mods->score)) {
        interp_tile t = {b, h, r0, c0, BK, np, mb->keep};
        /* the backward keeps score_mod's input and the values its derivative reads */
        const interp_prog *pg = mb->s2 ? &mods->score_bwd : &mods->score;
        if (mb->s2)
            memcpy(mb->s2, S, sizeof(T) * np);
        if (FN(interp_eval)(mods, pg, &t, S, NULL, S, NULL, NULL, mb->stash, mb->scratch))
            return -1;
    }
    for (int64_t k = 0; k < np; k++)
        if (!mb->keep[k])
            S[k] = -INFINITY;
    return 0;
}

/* True when a tile needs no per-element work beyond the scale: every pair kept, nothing added. */
static int FN(tile_is_plain)(const attn_params *p, int64_t r0, int64_t nr, int64_t c0, int64_t n,
                             int64_t Lq, int64_t Lk)
{
    return !p->bias.ptr && !p->mask.ptr && !p->alibi.ptr && p->softcap <= 0
           && tile_inside_band(p, r0, r0 + nr, c0, c0 + n, Lq, Lk);
}

/* True when a tile's only per-element work is its band (causal, window, the lengths): nothing
 * added to the scores and no mask but the band's. A scale > 0 in T (softmax_cols scales by
 * (T)scale: a float32 call's tiny double scale may round to 0) keeps -inf where the band puts it. */
static int FN(band_only)(const attn_params *p)
{
    return !p->bias.ptr && !p->mask.ptr && !p->alibi.ptr && p->softcap <= 0 && (T)p->scale > (T)0;
}

/* -inf for every pair of a transposed tile St (n keys x BQ queries, rows r0.., columns c0..)
 * outside its query's band; the kept scores stay raw (softmax_cols scales them). For a
 * band_only call: the score pipeline's result without its two transposes. */
static void FN(band_cols)(const attn_params *p, int64_t r0, int64_t nr, int64_t c0, int64_t n,
                          int64_t Lq, int64_t Lk, T *St)
{
    for (int64_t i = 0; i < nr; i++) {
        int64_t lo, hi;
        kv_range(p, r0 + i, r0 + i + 1, Lq, Lk, &lo, &hi);
        const int64_t j_lo = imin64(imax64(lo - c0, 0), n), j_hi = imax64(imin64(hi - c0, n), j_lo);
        for (int64_t j = 0; j < j_lo; j++)
            St[j * BQ + i] = -INFINITY;
        for (int64_t j = j_hi; j < n; j++)
            St[j * BQ + i] = -INFINITY;
    }
}

/* mask_mod's block mask: the state (TILE_EMPTY / TILE_PARTIAL / TILE_FULL, cpu.c) of every
 * BQ x BK tile of every sequence, for each query head (or one for all heads when mask_mod does
 * not read h). Tile (qt, kt) of sequence b, head slot hm lives at
 * state[off[b] + (hm * nq(b) + qt) * nk(b) + kt], nq / nk the sequence's tiles: O(Lq Lk / tile^2)
 * bytes. A tile is settled by intervals first (interp_cell: most tiles of a document, causal
 * or window mask), else mask_mod is evaluated at every pair inside the lengths, as the reference
 * does; a tile where a lookup may leave its array is always evaluated, so a lookup out of range
 * there raises whatever the other masks say. */
typedef struct {
    FN(tiling) q, k;
    int64_t *off, heads;
    unsigned char *state;
} FN(block_mask);

static void FN(block_mask_free)(FN(block_mask) *bm)
{
    free(bm->q.off); free(bm->k.off); free(bm->off); free(bm->state);
}

static unsigned char FN(block_state)(const FN(block_mask) *bm, int64_t b, int64_t h, int64_t qt,
                                     int64_t kt)
{
    const int64_t nq = bm->q.off[b + 1] - bm->q.off[b], nk = bm->k.off[b + 1] - bm->k.off[b];
    const int64_t hm = bm->heads == 1 ? 0 : h;
    return bm->state[bm->off[b] + (hm * nq + qt) * nk + kt];
}

/* 0, -1 when memory runs out, -2 when a lookup was out of range */
static int FN(block_mask_build)(const attn_params *p, FN(block_mask) *bm)
{
    const interp_mods *mods = p->mods;
    memset(bm, 0, sizeof *bm);
    bm->heads = mods->mask_uses_h ? p->Hq : 1;
    bm->off = (int64_t *)malloc(sizeof(int64_t) * (p->B + 1));
    if (!bm->off || FN(tiling_init)(&bm->q, p, 1, BQ) || FN(tiling_init)(&bm->k, p, 0, BK))
        return -1;
    bm->off[0] = 0;
    for (int64_t b = 0; b < p->B; b++)
        bm->off[b + 1] = bm->off[b] + bm->heads * (bm->q.off[b + 1] - bm->q.off[b])
                                      * (bm->k.off[b + 1] - bm->k.off[b]);
    bm->state = (unsigned char *)malloc(bm->off[p->B] ? bm->off[p->B] : 1);
    if (!bm->state)
        return -1;
    const int64_t n_tasks = bm->q.off[p->B] * bm->heads;
    int err = 0;
    const int nt = FN(nthreads)(p);
#pragma omp parallel num_threads(nt)
    {
        FN(mod_bufs) mb;
        int ok = !FN(mod_bufs_init)(&mb, mods, 0);
        if (!ok) {
#pragma omp atomic write
            err = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n_tasks; task++) {
            int failed;
#pragma omp atomic read
            failed = mods->err->failed;
            if (!ok || failed) continue;
            const int64_t g = task / bm->heads, hm = task % bm->heads;
            const int64_t b = FN(tiling_seq)(&bm->q, p->B, g), qt = g - bm->q.off[b];
            const seq_t sq = seq_q(p, b), sk = seq_k(p, b);
            const int64_t nq = bm->q.off[b + 1] - bm->q.off[b], nk = bm->k.off[b + 1] - bm->k.off[b];
            const int64_t r0 = qt * BQ, nr = imin64(BQ, sq.len - r0);
            unsigned char *st = bm->state + bm->off[b] + (hm * nq + qt) * nk;
            for (int64_t kt = 0; kt < nk; kt++) {
                const int64_t c0 = kt * BK, n = imin64(BK, sk.len - c0);
                const int cell = nr > 0 && n > 0 ? interp_cell(&mods->mask, b, hm, r0, r0 + nr - 1, c0, c0 + n - 1,
                                                               mb.scratch) : 3;
                if (cell != 3) {            /* settled by intervals: every pair kept, or none */
                    st[kt] = cell == 1 ? TILE_FULL : TILE_EMPTY;
                    continue;
                }
                interp_tile t = {b, hm, r0, c0, BK, nr * BK, mb.inside};
                FN(mark_inside)(mb.inside, nr, n);
                if (FN(interp_eval)(mods, &mods->mask, &t, NULL, NULL, NULL, mb.mk, NULL, NULL, mb.scratch))
                    break;
                int64_t kept = 0;
                for (int64_t k = 0; k < nr * BK; k++)
                    kept += mb.mk[k] & mb.inside[k];
                st[kt] = kept == 0 ? TILE_EMPTY : kept == nr * n ? TILE_FULL : TILE_PARTIAL;
            }
        }
        FN(mod_bufs_free)(&mb);
    }
    return err ? err : mods->err->failed ? -2 : 0;
}

/* A row's sum with its head's sink joined (attn_params.h: sinks): for a row of maximum m and
 * sum l (relative to m), l' = l e^(m - M) + e^(sink - M) relative to M, the larger of m and
 * the sink, which goes to *M. */
static T FN(with_sink)(T m, T l, T sink, T *M)
{
    *M = m > sink ? m : sink;
    return l * EXP(m - *M) + EXP(sink - *M);
}

/* The online softmax of one query tile over its key tiles: rows r0 .. r0 + nr of sequence b,
 * query head h (tile qb), queries transposed in Qt (DP x BQ), keys packed in kr. Sets each row's
 * maximum m (natural units) and sum l, and with O (BQ x DvP, zeroed) also O = sum of p V over
 * the packed values vr, unnormalised. The forward's loop, and the backward's where a row's lse
 * lost them (row_stats). Returns 0, or -1 when a lookup was out of range (mods->err says
 * where). St (BK x BQ), S (BQ x BK), alpha (BQ), row, maskbuf and mb are the thread's buffers. */
static int FN(online_softmax)(const attn_params *p, const FN(tiling) *kt_tiles, const FN(block_mask) *bm,
                              int64_t b, int64_t h, int64_t qb, int64_t nr, seq_t sq, seq_t sk,
                              int64_t DP, int64_t DvP, const T *Qt, const T *kr, const T *vr, T *O,
                              T *m, T *l, T *alpha, T *St, T *S, T *row, unsigned char *maskbuf,
                              FN(mod_bufs) *mb)
{
    const interp_mods *mods = p->mods;
    const int has_score_mod = mods && interp_has(&mods->score);
    const int has_mask_mod = mods && interp_has(&mods->mask);
    const int64_t r0 = qb * BQ, D = p->D, hk = h / (p->Hq / p->Hk);
    for (int64_t i = 0; i < BQ; i++) {
        m[i] = -INFINITY;
        l[i] = 0;
    }
    int64_t lo, hi;
    kv_range(p, r0, r0 + nr, sq.len, sk.len, &lo, &hi);
    for (int64_t kb = imax64(lo, 0) / BK; kb * BK < hi; kb++) {
        const int64_t c0 = kb * BK, n = imin64(BK, sk.len - c0);
        const int64_t g = (kt_tiles->off[b] + kb) * p->Hk + hk;
        const int state = has_mask_mod ? FN(block_state)(bm, b, h, qb, kb) : TILE_FULL;
        if (state == TILE_EMPTY)
            continue;
        const int mods_here = has_score_mod || state == TILE_PARTIAL;
        /* scores transposed, St = K Q^T (a query per column), so the softmax's maxima and sums
         * are vertical vector operations; P V is then St^T V */
        OPS->gemm((int)ROUND_UP(n, SIMD_M_ALIGN), BQ, (int)D, kr + g * BK * DP, DP, Qt, BQ, St, BQ, 0);
        T scale = (T)p->scale;
        if (!mods_here && FN(band_only)(p) && !FN(tile_is_plain)(p, r0, nr, c0, n, sq.len, sk.len)) {
            FN(band_cols)(p, r0, nr, c0, n, sq.len, sk.len, St);
        } else if (mods_here || !FN(tile_is_plain)(p, r0, nr, c0, n, sq.len, sk.len)) {
            /* the per-element pipeline works on rows of queries */
            for (int64_t i = 0; i < nr; i++)
                for (int64_t j = 0; j < n; j++)
                    S[i * BK + j] = St[j * BQ + i];
            if (FN(score_tile)(p, b, h, r0, nr, c0, n, sq.len, sk.len, S, NULL, row, maskbuf,
                               mods_here ? mb : NULL, state == TILE_FULL))
                return -1;
            for (int64_t j = 0; j < n; j++)
                for (int64_t i = 0; i < nr; i++)
                    St[j * BQ + i] = S[i * BK + j];
            scale = 1;
        }
        OPS->softmax_cols((int)n, BQ, BQ, St, scale, m, l, alpha);
        if (!O)
            continue;
        OPS->gemm_tn_scaled(BQ, (int)DvP, (int)n, St, BQ, vr + g * BK * DvP, DvP, O, DvP, alpha);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Forward                                                                                   */
/* ---------------------------------------------------------------------------------------- */

int FN(cpu_forward)(const attn_params *p)
{
    const int64_t B = p->B, Hq = p->Hq, Hk = p->Hk, D = p->D, Dv = p->Dv;
    const int64_t DP = ROUND_UP(D, SIMD_N_ALIGN), DvP = ROUND_UP(Dv, SIMD_N_ALIGN);
    const interp_mods *mods = p->mods;
    const int has_mask_mod = mods && interp_has(&mods->mask);
    int err = 0;
    FN(tiling) kt_tiles = {0};
    FN(block_mask) bm = {0};
    T *kr = NULL, *vr = NULL;
    if (FN(tiling_init)(&kt_tiles, p, 0, BK))
        return -1;
    const int64_t n_kv_tiles = kt_tiles.off[B] * Hk;
    const size_t n_kr = (size_t)n_kv_tiles * BK * DP, n_vr = (size_t)n_kv_tiles * BK * DvP;
    kr = (T *)FN(alloc)(n_kr);
    vr = (T *)FN(alloc)(n_vr);
    if (!kr || !vr) {
        err = -1;
        goto done;
    }

    int64_t max_rows = 0, rows = 0;
    for (int64_t b = 0; b < B; b++) {
        max_rows = imax64(max_rows, seq_q(p, b).rows);
        rows += seq_q(p, b).rows;
    }
    const int64_t nqb = (max_rows + BQ - 1) / BQ;
    /* q and out in T itself, rows of stride 1: Q tiles transposed straight from q (no copy
     * first), out's rows streamed past the caches when it is large (cpu.c: STREAM_OUT_BYTES) */
    const int in_t = p->dtype == (sizeof(T) == 4 ? DT_F32 : DT_F64);
    const int q_direct = in_t && p->q.s[3] == 1 && D == DP && (uintptr_t)p->q.ptr % sizeof(T) == 0;
    const int stream_out = in_t && p->out.s[3] == 1
                           && (size_t)(rows * Hq * Dv) * sizeof(T) >= STREAM_OUT_BYTES;
    const int nt = FN(nthreads)(p);
    if (has_mask_mod && (err = FN(block_mask_build)(p, &bm)))
        goto done;

#pragma omp parallel num_threads(nt)
    {
        T *row = (T *)FN(alloc)(imax64(imax64(D, Dv), BK));
        T *Qs = (T *)FN(alloc)(BQ * DP), *Qt = (T *)FN(alloc)(DP * BQ);
        T *St = (T *)FN(alloc)(BK * BQ), *S = (T *)FN(alloc)(BQ * BK);
        T *O = (T *)FN(alloc)(BQ * DvP);
        T *m = (T *)FN(alloc)(BQ), *l = (T *)FN(alloc)(BQ), *alpha = (T *)FN(alloc)(BQ);
        unsigned char *maskbuf = (unsigned char *)malloc(BK);
        FN(mod_bufs) mb;
        int ok = !FN(mod_bufs_init)(&mb, mods, 0);
        ok = ok && row && Qs && Qt && St && S && O && m && l && alpha && maskbuf;
        if (!ok) {
#pragma omp atomic write
            err = -1;
        }

        /* pack K and V tiles */
#pragma omp for schedule(dynamic, 4)
        for (int64_t g = 0; g < n_kv_tiles; g++)
            if (ok)
                FN(pack_kv)(p, &kt_tiles, g, DP, DvP, NULL, kr, vr, NULL, row);

#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * Hq * nqb; task++) {
            int failed = 0;
            if (mods) {
#pragma omp atomic read
                failed = mods->err->failed;
            }
            if (!ok || failed) continue;
            const int64_t b = task / (Hq * nqb), h = (task / nqb) % Hq, qb = task % nqb;
            const seq_t sq = seq_q(p, b), sk = seq_k(p, b);
            const int64_t r0 = qb * BQ;
            if (r0 >= sq.rows) continue;
            const int64_t r1 = imin64(r0 + BQ, sq.rows);
            const int64_t nr = imax64(0, imin64(sq.len - r0, r1 - r0));   /* real rows */
            for (int64_t i = 0; i < BQ; i++)
                l[i] = 0;
            if (nr > 0) {
                if (q_direct && nr == BQ) {
                    const T *q0 = (const T *)FN(row_ptr)(&p->q, p->dtype, sq.mem_b, sq.start + r0, h);
                    OPS->transpose(BQ, (int)DP, q0, p->q.s[1], Qt, BQ);
                } else {
                    FN(load_rows)(&p->q, p->dtype, sq, h, r0, nr, BQ, D, DP, Qs);
                    OPS->transpose(BQ, (int)DP, Qs, DP, Qt, BQ);
                }
                memset(O, 0, sizeof(T) * BQ * DvP);
                FN(online_softmax)(p, &kt_tiles, &bm, b, h, qb, nr, sq, sk, DP, DvP, Qt, kr, vr, O,
                                   m, l, alpha, St, S, row, maskbuf, &mb);
            }
            const T sink = p->sinks ? ((const T *)p->sinks)[h] : (T)-INFINITY;
            for (int64_t i = 0; i < r1 - r0; i++) {
                const int64_t r = r0 + i;
                char *dst = (char *)FN(row_ptr)(&p->out, p->dtype, sq.mem_b, sq.start + r, h);
                T lse = -INFINITY;
                /* a dead row keeps no key: every p was exp2(-inf) = 0. A NaN score (or a +inf
                 * one, inf - inf) makes l NaN: that row is NaN, as IEEE arithmetic says, not 0 */
                if (i < nr && l[i] != 0) {
                    T inv = 1 / l[i];
                    lse = m[i] + LOG(l[i]);
                    if (sink != -INFINITY) {        /* the sink joins the sum */
                        T M;
                        const T l2 = FN(with_sink)(m[i], l[i], sink, &M);
                        inv = EXP(m[i] - M) / l2;
                        lse = M + LOG(l2);
                    }
                    for (int64_t d = 0; d < Dv; d++)
                        row[d] = O[i * DvP + d] * inv;
                } else {
                    memset(row, 0, sizeof(T) * Dv);
                    if (i < nr)            /* a real row that keeps no key: the sink alone */
                        lse = sink;
                }
                if (stream_out)
                    stream_copy(dst, row, sizeof(T) * Dv);
                else
                    STORE_ROW(dst, p->out.s[3], Dv, p->dtype, row);
                *FN(lse_at)(p, sq.mem_b, h, sq.start + r) = lse;
            }
            if (stream_out)
                stream_fence();
        }

        /* rows of a packed batch after its last sequence */
#pragma omp for
        for (int64_t t = packed_end_q(p); t < p->Sq; t++) {
            if (!ok) continue;
            for (int64_t h = 0; h < Hq; h++) {
                char *dst = (char *)FN(row_ptr)(&p->out, p->dtype, 0, t, h);
                for (int64_t d = 0; d < Dv; d++) row[d] = 0;
                STORE_ROW(dst, p->out.s[3], Dv, p->dtype, row);
                *FN(lse_at)(p, 0, h, t) = -INFINITY;
            }
        }
        free(row); free(Qs); free(Qt); free(St); free(S); free(O); free(m); free(l); free(alpha);
        free(maskbuf);
        FN(mod_bufs_free)(&mb);
    }
    if (!err && mods && mods->err->failed)
        err = -2;
done:
    FN(block_mask_free)(&bm);
    free(kt_tiles.off);
    FN(free_n)(kr, n_kr);
    FN(free_n)(vr, n_vr);
    return err;
}

/* True when a row's lse, stored at T's precision, is too large to hold its log(sum): lse = m +
 * log(l) rounds away what log(l) adds to the maximum m once ulp(lse) is no longer small (a row
 * of -1e10 fills: lse = -1e10 exactly, and exp(s - lse) = 1 for each of n keys, not 1 / n). The
 * limits keep the relative error of exp(s - lse) under 4e-6 (float) and 1e-10 (double). */
static int FN(lse_lost)(T lse)
{
    const T limit = sizeof(T) == sizeof(float) ? (T)64 : (T)(1 << 20);
    return isfinite(lse) && (lse > limit || lse < -limit);
}

/* The backward's softmax offsets of the rows of one query tile whose lse is lost (lse_lost),
 * from their scores again: lm = the row's maximum, lz = log2 of its sum, as the forward had them.
 * Q: the packed tile (BQ x DP); the rest as online_softmax's. */
static void FN(row_stats)(const attn_params *p, const FN(tiling) *kt_tiles, const FN(block_mask) *bm,
                          int64_t b, int64_t h, int64_t r0, int64_t nr, int64_t DP, int64_t DvP,
                          const T *Q, const T *kr, T *lm, T *lz, T *Qt, T *m, T *l, T *alpha, T *St,
                          T *S, T *row, unsigned char *maskbuf, FN(mod_bufs) *mb)
{
    OPS->transpose(BQ, (int)DP, Q, DP, Qt, BQ);
    if (FN(online_softmax)(p, kt_tiles, bm, b, h, r0 / BQ, nr, seq_q(p, b), seq_k(p, b), DP, DvP, Qt, kr,
                           NULL, NULL, m, l, alpha, St, S, row, maskbuf, mb))
        return;
    const T sink = p->sinks ? ((const T *)p->sinks)[h] : (T)-INFINITY;
    for (int64_t i = 0; i < nr; i++)
        if (FN(lse_lost)(lm[i]) && isfinite(m[i]) && l[i] > 0) {
            lz[i] = LOG2(FN(with_sink)(m[i], l[i], sink, &lm[i]));   /* as in the forward */
        }
}

/* ---------------------------------------------------------------------------------------- */
/* Backward                                                                                  */
/* ---------------------------------------------------------------------------------------- */

/* Write rows of a (B, S, H, n) gradient tensor that no sequence owns (padding) as zeros. */
static void FN(zero_padding_rows)(const tensor4 *t, attn_dtype dt, const attn_params *p, int is_q,
                                  int64_t H, int64_t n, T *zeros)
{
    for (int64_t b = 0; b < p->B; b++) {
        seq_t s = is_q ? seq_q(p, b) : seq_k(p, b);
        for (int64_t r = s.len; r < s.rows; r++)
            for (int64_t h = 0; h < H; h++)
                STORE_ROW((char *)FN(row_ptr)(t, dt, s.mem_b, s.start + r, h), t->s[3], n, dt, zeros);
    }
    int64_t end = is_q ? packed_end_q(p) : packed_end_k(p), S = is_q ? p->Sq : p->Sk;
    for (int64_t r = end; r < S; r++)
        for (int64_t h = 0; h < H; h++)
            STORE_ROW((char *)FN(row_ptr)(t, dt, 0, r, h), t->s[3], n, dt, zeros);
}

int FN(cpu_backward)(const attn_params *p)
{
    const int64_t B = p->B, Hq = p->Hq, Hk = p->Hk, D = p->D, Dv = p->Dv;
    const int64_t DP = ROUND_UP(D, SIMD_N_ALIGN), DvP = ROUND_UP(Dv, SIMD_N_ALIGN);
    const int64_t G = Hq / Hk;
    const int has_dbias = p->dbias.ptr != NULL;
    const interp_mods *mods = p->mods;
    const int has_score_mod = mods && interp_has(&mods->score);
    const int has_mask_mod = mods && interp_has(&mods->mask);
    const int64_t n_grad = has_score_mod ? mods->n_grad : 0;
    int err = 0;
    FN(tiling) kt_tiles = {0}, q_tiles = {0};
    FN(block_mask) bm = {0};
    double *dacc = NULL;
    T *kt = NULL, *kr = NULL, *vt = NULL, *qr = NULL, *dor = NULL, *lm = NULL, *lz = NULL,
      *delta = NULL, *dqp = NULL;
    size_t n_kt = 0, n_kr = 0, n_vt = 0, n_qr = 0, n_dor = 0, n_dqp = 0;   /* their elements */
    if (FN(tiling_init)(&kt_tiles, p, 0, BK) || FN(tiling_init)(&q_tiles, p, 1, BQ)) {
        err = -1;
        goto done;
    }
    const int64_t n_kv_tiles = kt_tiles.off[B] * Hk, n_q_tiles = q_tiles.off[B] * Hq;

    /* Tasks: (batch, kv head, key chunk). A dbias broadcast over batch, heads or columns would be
     * written by several tasks at once, so such a dimension is walked inside one task instead.
     * score_mod's array gradients are accumulated per task and summed in task order; when that
     * would take more than DTENSOR_BYTES, one task walks everything. */
    const int one_task = n_grad > 0 && (double)B * Hk * imax64(kt_tiles.max_tiles, 1) * n_grad
                                       * sizeof(double) > DTENSOR_BYTES;
    const int share_b = one_task || (has_dbias && B > 1 && p->dbias.s[0] == 0);
    const int share_h = one_task || (has_dbias && Hk > 1 && p->bias_heads == 1);
    const int share_c = one_task || (has_dbias && p->dbias.s[3] == 0);
    const int64_t TB = share_b ? 1 : B, TH = share_h ? 1 : Hk;
    const int64_t max_kb = kt_tiles.max_tiles, outer = imax64(TB * TH, 1);
    const int64_t NC = share_c ? 1 : imin64(imax64(max_kb, 1), (MIN_BWD_TASKS + outer - 1) / outer);

    n_kt = (size_t)n_kv_tiles * D * BK;
    n_kr = (size_t)n_kv_tiles * BK * DP;
    n_vt = (size_t)n_kv_tiles * Dv * BK;
    n_qr = (size_t)n_q_tiles * BQ * DP;
    n_dor = (size_t)n_q_tiles * BQ * DvP;
    n_dqp = (size_t)NC * n_q_tiles * BQ * DP;
    kt = (T *)FN(alloc)(n_kt);
    kr = (T *)FN(alloc)(n_kr);
    vt = (T *)FN(alloc)(n_vt);
    qr = (T *)FN(alloc)(n_qr);
    dor = (T *)FN(alloc)(n_dor);
    lm = (T *)FN(alloc)((size_t)n_q_tiles * BQ);
    lz = (T *)FN(alloc)((size_t)n_q_tiles * BQ);
    delta = (T *)FN(alloc)((size_t)n_q_tiles * BQ);
    dqp = (T *)FN(alloc)(n_dqp);
    if (!kt || !kr || !vt || !qr || !dor || !lm || !lz || !delta || !dqp) {
        err = -1;
        goto done;
    }
    memset(dqp, 0, sizeof(T) * n_dqp);
    const int64_t n_tasks = TB * TH * NC;
    if (n_grad > 0 && !(dacc = (double *)calloc((size_t)(n_tasks * n_grad), sizeof(double)))) {
        err = -1;
        goto done;
    }
    if (has_mask_mod && (err = FN(block_mask_build)(p, &bm)))
        goto done;

    const int nt = FN(nthreads)(p);
#pragma omp parallel num_threads(nt)
    {
        const int64_t W = imax64(imax64(DP, DvP), BK);
        T *row = (T *)FN(alloc)(W);
        T *S = (T *)FN(alloc)(BQ * BK), *dP = (T *)FN(alloc)(BQ * BK);
        T *th = (T *)FN(alloc)(BQ * BK);
        T *dK = (T *)FN(alloc)(BK * DP), *dV = (T *)FN(alloc)(BK * DvP);
        /* row_stats' buffers */
        T *Qt = (T *)FN(alloc)(DP * BQ), *St = (T *)FN(alloc)(BK * BQ);
        T *m = (T *)FN(alloc)(BQ), *l = (T *)FN(alloc)(BQ), *alpha = (T *)FN(alloc)(BQ);
        unsigned char *maskbuf = (unsigned char *)malloc(BK);
        FN(mod_bufs) mb;
        int ok = !FN(mod_bufs_init)(&mb, mods, 1);
        ok = ok && row && S && dP && th && dK && dV && Qt && St && m && l && alpha && maskbuf;
        if (!ok) {
#pragma omp atomic write
            err = -1;
        }

#pragma omp for schedule(dynamic, 4)
        for (int64_t g = 0; g < n_kv_tiles; g++)
            if (ok)
                FN(pack_kv)(p, &kt_tiles, g, DP, DvP, kt, kr, NULL, vt, row);

        /* pack Q and dO tiles, each row's softmax offsets (lm, lz: P = exp2((s - lm) log2 e - lz)),
         * delta = rowsum(dO * O). A row whose lse is -inf keeps no key (and padding rows are
         * such rows), nor does one whose lse is its sink's (whatever it keeps weighs under
         * float rounding): it has no gradient path, so its q, dO and delta are packed as 0, and the
         * task loop zeroes its dS and the dq row, so that no NaN or inf in its dO, out, q, or at
         * keys it does not keep, reaches a gradient as 0 * NaN. Rows whose lse is too large to
         * hold log(sum) (lse_lost) get their maximum and sum again (row_stats). */
#pragma omp for schedule(dynamic, 4)
        for (int64_t g = 0; g < n_q_tiles; g++) {
            if (!ok) continue;
            int64_t h, r0, nr;
            seq_t sq = FN(q_tile)(&q_tiles, p, Hq, g, &h, &r0, &nr);
            T *Q = qr + g * BQ * DP, *dO = dor + g * BQ * DvP;
            FN(load_rows)(&p->q, p->dtype, sq, h, r0, nr, BQ, D, DP, Q);
            FN(load_rows)(&p->dout, p->dtype, sq, h, r0, nr, BQ, Dv, DvP, dO);
            int lost = 0;
            const T sink = p->sinks ? ((const T *)p->sinks)[h] : (T)-INFINITY;
            for (int64_t i = 0; i < BQ; i++) {
                T L = -INFINITY, dl = 0;
                if (i < nr)
                    L = *FN(lse_at)(p, sq.mem_b, h, sq.start + r0 + i);
                if (L == sink)
                    L = -INFINITY;
                if (L == -INFINITY) {
                    memset(Q + i * DP, 0, sizeof(T) * DP);
                    memset(dO + i * DvP, 0, sizeof(T) * DvP);
                } else {
                    LOAD_ROW(FN(row_ptr)(&p->out, p->dtype, sq.mem_b, sq.start + r0 + i, h), p->out.s[3], Dv, p->dtype, row);
                    const T *dor_i = dO + i * DvP;
                    for (int64_t d = 0; d < Dv; d++)
                        dl += row[d] * dor_i[d];
                    lost |= FN(lse_lost)(L);
                }
                if (L != -INFINITY && p->dlse.ptr)     /* dS = P (dP - delta + dlse) */
                    dl -= *(const T *)((const T *)p->dlse.ptr + sq.mem_b * p->dlse.s[0] + h * p->dlse.s[1]
                                       + (sq.start + r0 + i) * p->dlse.s[2]);
                lm[g * BQ + i] = L;
                lz[g * BQ + i] = 0;
                delta[g * BQ + i] = dl;
            }
            /* rows whose lse lost log(sum): their maximum and sum again (a lookup out of range
             * there sets mods->err, and the task loop stops) */
            if (lost)
                FN(row_stats)(p, &kt_tiles, &bm, FN(tiling_seq)(&q_tiles, B, g / Hq), h, r0, nr, DP, DvP, Q, kr, lm + g * BQ,
                              lz + g * BQ, Qt, m, l, alpha, St, S, row, maskbuf, &mb);
        }

#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n_tasks; task++) {
            int failed = 0;
            if (mods) {
#pragma omp atomic read
                failed = mods->err->failed;
            }
            if (!ok || failed) continue;
            const int64_t tb = task / (TH * NC), task_hk = (task / NC) % TH, ch = task % NC;
            double *task_dacc = dacc ? dacc + task * n_grad : NULL;
            for (int64_t b = share_b ? 0 : tb; b < (share_b ? B : tb + 1); b++) {
                const seq_t sq = seq_q(p, b), sk = seq_k(p, b);
                const int64_t nkb = kt_tiles.off[b + 1] - kt_tiles.off[b];
                const int64_t kb_lo = ch * max_kb / NC, kb_hi = imin64((ch + 1) * max_kb / NC, nkb);
                for (int64_t hk = share_h ? 0 : task_hk; hk < (share_h ? Hk : task_hk + 1); hk++) {
                    for (int64_t kb = kb_lo; kb < kb_hi; kb++) {
                        const int64_t c0 = kb * BK, n = imin64(BK, sk.len - c0);
                        const int64_t gk = (kt_tiles.off[b] + kb) * Hk + hk;
                        memset(dK, 0, sizeof(T) * BK * DP);
                        memset(dV, 0, sizeof(T) * BK * DvP);
                        int64_t qlo, qhi;
                        q_range(p, c0, c0 + n, sq.len, sk.len, &qlo, &qhi);
                        for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
                            for (int64_t qb = imax64(qlo, 0) / BQ; qb * BQ < qhi && !failed; qb++) {
                                const int64_t r0 = qb * BQ, nr = imin64(BQ, sq.len - r0);
                                const int state = has_mask_mod ? FN(block_state)(&bm, b, h, qb, kb) : TILE_FULL;
                                if (state == TILE_EMPTY)
                                    continue;
                                const int mods_here = has_score_mod || state == TILE_PARTIAL;
                                const int64_t Mr = ROUND_UP(nr, SIMD_M_ALIGN);
                                const int64_t gq = (q_tiles.off[b] + qb) * Hq + h;
                                const T *Q = qr + gq * BQ * DP, *dO = dor + gq * BQ * DvP;
                                OPS->gemm((int)Mr, BK, (int)D, Q, DP, kt + gk * D * BK, BK, S, BK, 0);
                                T scale = (T)p->scale;
                                int plain = !mods_here && FN(tile_is_plain)(p, r0, nr, c0, n, sq.len, sk.len);
                                if (!plain) {
                                    if (FN(score_tile)(p, b, h, r0, nr, c0, n, sq.len, sk.len, S,
                                                       p->softcap > 0 ? th : NULL, row, maskbuf,
                                                       mods_here ? &mb : NULL, state == TILE_FULL)) {
                                        failed = 1;
                                        break;
                                    }
                                    scale = 1;
                                }
                                OPS->exp_rows((int)nr, (int)n, BK, S, scale, lm + gq * BQ, lz + gq * BQ);
                                /* P's padding (rows >= nr, columns >= n) must be 0 */
                                for (int64_t i = 0; i < Mr; i++)
                                    for (int64_t j = (i < nr ? n : 0); j < BK; j++)
                                        S[i * BK + j] = 0;
                                OPS->gemm((int)Mr, BK, (int)Dv, dO, DvP, vt + gk * Dv * BK, BK, dP, BK, 0);
                                OPS->gemm_tn(BK, (int)DvP, (int)Mr, S, BK, dO, DvP, dV, DvP, 1);
                                /* dS = P * (dP - delta), in place in S; 0 in a row that keeps
                                 * no key (lse -inf: padding rows too), whatever NaN dP holds */
                                const T *dl = delta + gq * BQ, *l2 = lm + gq * BQ;
                                for (int64_t i = 0; i < Mr; i++) {
                                    T *s = S + i * BK;
                                    const T *dp = dP + i * BK, d = dl[i];
                                    if (l2[i] == -INFINITY)
                                        memset(s, 0, sizeof(T) * BK);
                                    else
                                        for (int64_t j = 0; j < BK; j++)
                                            s[j] *= dp[j] - d;
                                }
                                if (has_score_mod) {
                                    /* through score_mod: dS of its input, and its arrays' gradients */
                                    interp_tile t = {b, h, r0, c0, BK, nr * BK, mb.keep};
                                    if (FN(interp_eval)(mods, &mods->grad, &t, mb.s2, S, S, NULL,
                                                        task_dacc, mb.stash, mb.scratch)) {
                                        failed = 1;
                                        break;
                                    }
                                    for (int64_t k = 0; k < nr * BK; k++)
                                        if (!mb.keep[k])
                                            S[k] = 0;
                                }
                                if (has_dbias) {
                                    int64_t hb = h / (Hq / p->bias_heads);
                                    for (int64_t i = 0; i < nr; i++) {
                                        T *db = (T *)p->dbias.ptr + b * p->dbias.s[0] + hb * p->dbias.s[1]
                                                + (r0 + i) * p->dbias.s[2] + c0 * p->dbias.s[3];
                                        for (int64_t j = 0; j < n; j++)
                                            db[j * p->dbias.s[3]] += S[i * BK + j];
                                    }
                                }
                                if (p->softcap > 0)
                                    for (int64_t i = 0; i < nr; i++)
                                        if (l2[i] != -INFINITY)   /* else dS is 0, th maybe NaN */
                                            for (int64_t j = 0; j < n; j++)
                                                S[i * BK + j] *= 1 - th[i * BK + j] * th[i * BK + j];
                                OPS->gemm_tn(BK, (int)DP, (int)Mr, S, BK, Q, DP, dK, DP, 1);
                                T *dq = dqp + ((size_t)ch * n_q_tiles + gq) * BQ * DP;
                                OPS->gemm((int)Mr, (int)DP, (int)n, S, BK, kr + gk * BK * DP, DP, dq, DP, 1);
                            }
                        }
                        for (int64_t j = 0; j < n; j++) {
                            for (int64_t d = 0; d < D; d++)
                                row[d] = dK[j * DP + d] * (T)p->scale;
                            STORE_ROW((char *)FN(row_ptr)(&p->dk, p->dtype, sk.mem_b, sk.start + c0 + j, hk), p->dk.s[3], D, p->dtype, row);
                            STORE_ROW((char *)FN(row_ptr)(&p->dv, p->dtype, sk.mem_b, sk.start + c0 + j, hk), p->dv.s[3], Dv, p->dtype, dV + j * DvP);
                        }
                    }
                }
            }
        }

        /* dq = scale * sum over key chunks, in chunk order; 0 in a row that keeps no key (its
         * dS is 0, but dS K is 0 * NaN at a NaN key) */
#pragma omp for schedule(dynamic, 4)
        for (int64_t g = 0; g < n_q_tiles; g++) {
            if (!ok) continue;
            int64_t h, r0, nr;
            seq_t sq = FN(q_tile)(&q_tiles, p, Hq, g, &h, &r0, &nr);
            for (int64_t i = 0; i < nr; i++) {
                if (lm[g * BQ + i] == -INFINITY)
                    memset(row, 0, sizeof(T) * D);
                else
                    for (int64_t d = 0; d < D; d++) {
                        T acc = 0;
                        for (int64_t c = 0; c < NC; c++)
                            acc += dqp[((size_t)c * n_q_tiles + g) * BQ * DP + i * DP + d];
                        row[d] = acc * (T)p->scale;
                    }
                STORE_ROW((char *)FN(row_ptr)(&p->dq, p->dtype, sq.mem_b, sq.start + r0 + i, h), p->dq.s[3], D, p->dtype, row);
            }
        }

#pragma omp single
        {
            if (ok) {
                memset(row, 0, sizeof(T) * W);
                FN(zero_padding_rows)(&p->dq, p->dtype, p, 1, Hq, D, row);
                FN(zero_padding_rows)(&p->dk, p->dtype, p, 0, Hk, D, row);
                FN(zero_padding_rows)(&p->dv, p->dtype, p, 0, Hk, Dv, row);
            }
        }
        free(row); free(S); free(dP); free(th); free(dK); free(dV);
        free(Qt); free(St); free(m); free(l); free(alpha);
        free(maskbuf);
        FN(mod_bufs_free)(&mb);
    }
    if (!err && mods && mods->err->failed)
        err = -2;
    /* score_mod's array gradients: the tasks' sums, in task order */
    if (!err && n_grad > 0)
        for (int64_t t = 0; t < n_tasks; t++)
            for (int64_t e = 0; e < n_grad; e++)
                mods->dtensors[e] += dacc[t * n_grad + e];
done:
    FN(block_mask_free)(&bm);
    free(dacc);
    free(kt_tiles.off); free(q_tiles.off);
    FN(free_n)(kt, n_kt); FN(free_n)(kr, n_kr); FN(free_n)(vt, n_vt); FN(free_n)(qr, n_qr);
    FN(free_n)(dor, n_dor); FN(free_n)(dqp, n_dqp);
    free(lm); free(lz); free(delta);
    return err;
}

#undef FN
#undef CAT
#undef CAT_
