/* The CPU backend's entry points. Each returns 0, or -1 when memory runs out (nothing else can
 * fail: arguments were checked by attnext/api.py). Called without the GIL. */
#ifndef ATTNEXT_CPU_H
#define ATTNEXT_CPU_H

#include "attn_params.h"

/* out, lse from q, k, v (and the options in p) */
int cpu_forward(const attn_params *p);
/* dq, dk, dv written, dbias accumulated into, from dout, q, k, v, out, lse */
int cpu_backward(const attn_params *p);
/* Once per process, before any call: a child forked after the backend ran keeps working. */
void cpu_init(void);

#endif
