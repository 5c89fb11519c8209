/* Which key columns a block of query rows visits under causal and window masks, and the inverse
 * (flash-attention's block.h). One function per question, shared by forward and backward.
 *
 * Alignment for Lq != Lk: bottom-right causal keeps c <= r + (Lk - Lq), so the last query row sees
 * every key; top-left keeps c <= r. A window (left, right) is relative to the bottom-right
 * diagonal: r + (Lk - Lq) - left <= c <= r + (Lk - Lq) + right, -1 meaning unbounded.
 */
#ifndef ATTNEXT_BLOCK_H
#define ATTNEXT_BLOCK_H

#include "attn_params.h"

ATTN_FN int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }
ATTN_FN int64_t imax64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Key columns [*lo, *hi) that rows [r0, r1) may attend to (empty when *lo >= *hi). */
ATTN_FN void kv_range(const attn_params *p, int64_t r0, int64_t r1, int64_t Lq, int64_t Lk,
                            int64_t *lo, int64_t *hi)
{
    int64_t off = Lk - Lq, l = 0, h = Lk;
    if (p->causal == CAUSAL_BOTTOM_RIGHT)
        h = imin64(h, r1 + off);
    if (p->causal == CAUSAL_TOP_LEFT)
        h = imin64(h, r1);
    if (p->window_right >= 0)
        h = imin64(h, r1 + off + p->window_right);
    if (p->window_left >= 0)
        l = imax64(l, r0 + off - p->window_left);
    *lo = l;
    *hi = h;
}

/* Query rows [*lo, *hi) that may attend to some key in [c0, c1). */
ATTN_FN void q_range(const attn_params *p, int64_t c0, int64_t c1, int64_t Lq, int64_t Lk,
                           int64_t *lo, int64_t *hi)
{
    int64_t off = Lk - Lq, l = 0, h = Lq;
    if (p->causal == CAUSAL_BOTTOM_RIGHT)
        l = imax64(l, c0 - off);
    if (p->causal == CAUSAL_TOP_LEFT)
        l = imax64(l, c0);
    if (p->window_right >= 0)
        l = imax64(l, c0 - off - p->window_right);
    if (p->window_left >= 0)
        h = imin64(h, c1 - off + p->window_left);
    *lo = l;
    *hi = h;
}

/* True when causal and window keep every pair of rows [r0, r1) x columns [c0, c1). */
ATTN_FN int tile_inside_band(const attn_params *p, int64_t r0, int64_t r1, int64_t c0,
                                   int64_t c1, int64_t Lq, int64_t Lk)
{
    int64_t lo_last, hi_first, lo, hi;
    kv_range(p, r0, r0 + 1, Lq, Lk, &lo, &hi_first);   /* narrowest upper bound: first row */
    kv_range(p, r1 - 1, r1, Lq, Lk, &lo_last, &hi);     /* highest lower bound: last row */
    return c0 >= lo_last && c1 <= hi_first;
}

#endif
