/* Where sequence b starts and how long it is: the one place that reads cu_seqlens and seqused
 * (flash-attention's seqlen.h). Shared by the CPU backend and, through the same struct, the GPU
 * host code.
 *
 *   rows  : rows of the segment in the tensor (varlen: cu[b+1] - cu[b]; else Sq or Sk)
 *   len   : actual length (seqused[b] when given, else rows); rows [len, rows) are padding
 *   start : first row of the segment in the tensor's sequence dimension
 *   mem_b : the batch index in memory (0 for varlen, whose tensors hold one packed batch item)
 */
#ifndef ATTNEXT_SEQLEN_H
#define ATTNEXT_SEQLEN_H

#include "attn_params.h"

typedef struct {
    int64_t start, rows, len, mem_b;
} seq_t;

ATTN_FN int64_t clamp_len(int64_t x, int64_t lo, int64_t hi)
{
    return x < lo ? lo : x > hi ? hi : x;
}

/* static_len: the tensor's rows (varlen: the packed rows T); max_rows: varlen's bound on a
 * segment (attn_params.h). Lengths the host checked pass through unchanged; the GPU's device
 * lengths (read by no host) are clamped so that every segment lies inside the tensor, holds at
 * most max_rows rows, and uses at most its rows: wrong lengths give wrong rows, never an access
 * past an array (attn_lengths.cu reports them). */
ATTN_FN seq_t seq_of(const int32_t *cu, const int32_t *used, int64_t static_len, int64_t max_rows, int64_t b)
{
    seq_t s;
    if (cu) {
        s.start = clamp_len(cu[b], 0, static_len);
        s.rows = clamp_len((int64_t)cu[b + 1] - s.start, 0, static_len - s.start);
        if (s.rows > max_rows)
            s.rows = max_rows;
    } else {
        s.start = 0;
        s.rows = static_len;
    }
    s.len = used ? clamp_len(used[b], 0, s.rows) : s.rows;
    s.mem_b = cu ? 0 : b;
    return s;
}

ATTN_FN seq_t seq_q(const attn_params *p, int64_t b)
{
    return seq_of(p->cu_seqlens_q, p->seqused_q, p->Sq, p->max_rows_q, b);
}

ATTN_FN seq_t seq_k(const attn_params *p, int64_t b)
{
    return seq_of(p->cu_seqlens_k, p->seqused_k, p->Sk, p->max_rows_k, b);
}

/* Where key row c of sequence b lives: the (batch index in memory, row) of k and v, through the
 * page table of a paged cache, else as seq_k's segment sk says. A page index out of range (a
 * CUDA table the host never read: attn_lengths.cu's attn_pages reports it) is clamped into k's
 * pages, so it reads nothing outside them. */
ATTN_FN void key_row(const attn_params *p, const seq_t *sk, int64_t b, int64_t c, int64_t *mem_b, int64_t *row)
{
    if (p->block_table) {
        /* 32-bit division where it fits (all real caches): a GPU's 64-bit one is a long routine */
        const int64_t j = (c | p->page_size) >> 32 ? c / p->page_size
                                                     : (int64_t)((uint32_t)c / (uint32_t)p->page_size);
        *mem_b = clamp_len(p->block_table[b * p->bt_stride + j], 0, p->num_pages - 1);
        *row = c - j * p->page_size;
    } else {
        *mem_b = sk->mem_b;
        *row = sk->start + c;
    }
}

/* Rows of the q (or k) tensor past the last segment: padding of a packed batch. */
ATTN_FN int64_t packed_end_q(const attn_params *p)
{
    return p->cu_seqlens_q ? clamp_len(p->cu_seqlens_q[p->B], 0, p->Sq) : p->Sq;
}

ATTN_FN int64_t packed_end_k(const attn_params *p)
{
    return p->cu_seqlens_k ? clamp_len(p->cu_seqlens_k[p->B], 0, p->Sk) : p->Sk;
}

#endif
