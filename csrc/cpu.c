/* Instantiates the CPU backend (cpu_impl.h) for float and double accumulation and routes a call
 * by dtype: float16, bfloat16 and float32 accumulate in float32, float64 in float64. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "block.h"
#include "convert.h"
#include "cpu.h"
#include "seqlen.h"
#include "simd.h"

/* Tile sizes: a query tile of BQ rows against key tiles of BK columns (multiples of both SIMD
 * alignments). The backward splits keys into chunks until it has at least MIN_BWD_TASKS tasks;
 * the count depends on the shape only, so results never depend on the thread count. */
#define BQ 64
#define BK 64
#define MIN_BWD_TASKS 16
#define ROUND_UP(x, a) (((x) + (a) - 1) / (a) * (a))

#define T float
#define SUF f32
#define OPS simd_f32()
#define LOAD_ROW load_row_f32
#define STORE_ROW store_row_f32
#define TANH tanhf
#define LOG logf
#include "cpu_impl.h"
#undef T
#undef SUF
#undef OPS
#undef LOAD_ROW
#undef STORE_ROW
#undef TANH
#undef LOG

#define T double
#define SUF f64
#define OPS simd_f64()
#define LOAD_ROW load_row_f64
#define STORE_ROW store_row_f64
#define TANH tanh
#define LOG log
#include "cpu_impl.h"

int cpu_forward(const attn_params *p)
{
    return p->dtype == DT_F64 ? cpu_forward_f64(p) : cpu_forward_f32(p);
}

int cpu_backward(const attn_params *p)
{
    return p->dtype == DT_F64 ? cpu_backward_f64(p) : cpu_backward_f32(p);
}
