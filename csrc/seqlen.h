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

ATTN_FN seq_t seq_of(const int32_t *cu, const int32_t *used, int64_t static_len, int64_t b)
{
    seq_t s;
    s.start = cu ? cu[b] : 0;
    s.rows = cu ? (int64_t)cu[b + 1] - cu[b] : static_len;
    s.len = used ? used[b] : s.rows;
    s.mem_b = cu ? 0 : b;
    return s;
}

ATTN_FN seq_t seq_q(const attn_params *p, int64_t b)
{
    return seq_of(p->cu_seqlens_q, p->seqused_q, p->Sq, b);
}

ATTN_FN seq_t seq_k(const attn_params *p, int64_t b)
{
    return seq_of(p->cu_seqlens_k, p->seqused_k, p->Sk, b);
}

/* Rows of the q (or k) tensor past the last segment: padding of a packed batch. */
ATTN_FN int64_t packed_end_q(const attn_params *p)
{
    return p->cu_seqlens_q ? p->cu_seqlens_q[p->B] : p->Sq;
}

ATTN_FN int64_t packed_end_k(const attn_params *p)
{
    return p->cu_seqlens_k ? p->cu_seqlens_k[p->B] : p->Sk;
}

#endif
