/* lab_cpu_roof.py's driver (see there): one core's FMA roof per vector width, the SIMD table's
 * products (csrc/cpu/simd.c) at the CPU tiles' shapes, its softmax_cols, and the forward's
 * key-tile step built from them. Built with the extension's flags. */
#define _POSIX_C_SOURCE 200112L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static volatile float sink;

#if defined(__x86_64__)
/* ACC independent FMA chains (more than latency x ports on every core of the last decade) */
#define FMA_LOOP(NAME, TARGET, VT, SET1, FMA, LANES, ACC)                                   \
    __attribute__((target(TARGET))) static double NAME(long n)                              \
    {                                                                                       \
        VT a[ACC], b = SET1(0.999f), c = SET1(0.001f);                                      \
        for (int i = 0; i < ACC; i++)                                                       \
            a[i] = SET1((float)i);                                                          \
        const double t = now();                                                             \
        for (long k = 0; k < n; k++)                                                        \
            _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++)                          \
                a[i] = FMA(a[i], b, c);                                                     \
        const double dt = now() - t;                                                        \
        float s = 0;                                                                        \
        for (int i = 0; i < ACC; i++)                                                       \
            s += ((float *)&a[i])[0];                                                       \
        sink = s;                                                                           \
        return 2.0 * LANES * ACC * n / dt / 1e9;                                            \
    }
FMA_LOOP(fma256, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, 8, 12)
FMA_LOOP(fma512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, 16, 16)
#endif

int main(int argc, char **argv)
{
    const int reps = argc > 1 ? atoi(argv[1]) : 30;
    const simd_ops_f32 *o = simd_f32();
    printf("SIMD variant %s (ATTNEXT_SIMD caps it); GF/s one core, the best of %d runs (FMA roofs: %d)\n",
           simd_name(), reps, reps / 3 + 1);
#if defined(__x86_64__)
    __builtin_cpu_init();
    double best = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        for (int r = 0; r < reps / 3 + 1; r++) {
            const double g = fma256(20000000);
            best = g > best ? g : best;
        }
        printf("FMA roof, 256-bit: %.1f\n", best);
    }
    if (__builtin_cpu_supports("avx512f")) {
        best = 0;
        for (int r = 0; r < reps / 3 + 1; r++) {
            const double g = fma512(10000000);
            best = g > best ? g : best;
        }
        printf("FMA roof, 512-bit: %.1f\n", best);
    }
#endif
    /* the forward's St = K Q^T (gemm) and O += P^T V (gemm_tn), the backward's likewise */
    static const int shapes[][3] = {{64, 64, 64}, {64, 64, 128}, {64, 128, 64}, {64, 128, 128}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        float *A = aligned_alloc(64, (size_t)M * K * 4), *B = aligned_alloc(64, (size_t)K * N * 4),
              *C = aligned_alloc(64, (size_t)M * N * 4);
        for (int i = 0; i < M * K; i++)
            A[i] = (float)(i % 17) / 17.f;
        for (int i = 0; i < K * N; i++)
            B[i] = (float)(i % 13) / 13.f;
        memset(C, 0, (size_t)M * N * 4);
        for (int tn = 0; tn < 2; tn++) {
            double fastest = 1e30;
            for (int r = 0; r < reps; r++) {
                const double t = now();
                for (int it = 0; it < 200; it++) {
                    if (tn)
                        o->gemm_tn(M, N, K, A, M, B, N, C, N, 1);
                    else
                        o->gemm(M, N, K, A, K, B, N, C, N, 1);
                }
                const double dt = now() - t;
                fastest = dt < fastest ? dt : fastest;
            }
            printf("%-7s M%d N%d K%d: %.1f\n", tn ? "gemm_tn" : "gemm", M, N, K, 2.0 * M * N * K * 200 / fastest / 1e9);
        }
        sink = C[0];
        free(A);
        free(B);
        free(C);
    }
    /* the forward's online-softmax step on a 64 x 64 tile of transposed scores (St), restored
     * before each call so that every call takes the same path: ns a score */
    {
        enum { N = 64, COLS = 64 };
        float *St = aligned_alloc(64, N * COLS * 4), *S0 = aligned_alloc(64, N * COLS * 4);
        float m[COLS], l[COLS], alpha[COLS];
        for (int i = 0; i < N * COLS; i++)
            S0[i] = (float)((i * 7919) % 1000) / 250.f - 2.f;
        double fastest = 1e30;
        for (int r = 0; r < reps; r++) {
            double spent = 0;
            for (int it = 0; it < 200; it++) {
                memcpy(St, S0, N * COLS * 4);
                for (int c = 0; c < COLS; c++) {
                    m[c] = 1.f;
                    l[c] = 1.f;
                }
                const double t = now();
                o->softmax_cols(N, COLS, COLS, St, 0.125f, m, l, alpha);
                spent += now() - t;
            }
            fastest = spent < fastest ? spent : fastest;
        }
        sink = St[0] + l[0];
        printf("softmax_cols n%d cols%d: %.3f ns a score\n", N, COLS, fastest / 200 / (N * COLS) * 1e9);
        free(St);
        free(S0);
    }
    /* the forward's key-tile step as cpu_impl.h's online_softmax runs it (St = K Q^T,
     * softmax_cols, O = alpha O + P V), 16 query tiles each over a head's 16 packed K / V tiles
     * (S1024: 1 MiB of K and V at D128), without the call's packing, Q tiles and output: what
     * the forward would run at if those cost nothing */
    for (int D = 64; D <= 128; D += 64) {
        enum { B = 64, TILES = 16 };
        const size_t kv_bytes = (size_t)TILES * B * D * 4;
        float *kr = aligned_alloc(64, kv_bytes), *vr = aligned_alloc(64, kv_bytes);
        float *Qt = aligned_alloc(64, (size_t)D * B * 4), *St = aligned_alloc(64, B * B * 4);
        float *O = aligned_alloc(64, (size_t)B * D * 4), m[B], l[B], alpha[B];
        for (int i = 0; i < TILES * B * D; i++) {
            kr[i] = (float)((i * 7919L) % 1000) / 1000.f - .5f;
            vr[i] = (float)((i * 7907L) % 1000) / 1000.f - .5f;
        }
        for (int i = 0; i < D * B; i++)
            Qt[i] = (float)((i * 31) % 1000) / 1000.f - .5f;
        double fastest = 1e30;
        for (int r = 0; r < reps; r++) {
            const double t = now();
            for (int task = 0; task < TILES; task++) {
                memset(O, 0, (size_t)B * D * 4);
                for (int i = 0; i < B; i++) {
                    m[i] = -1e30f;
                    l[i] = 0;
                }
                for (int kb = 0; kb < TILES; kb++) {
                    o->gemm(B, B, D, kr + (size_t)kb * B * D, D, Qt, B, St, B, 0);
                    o->softmax_cols(B, B, B, St, 0.088f, m, l, alpha);
                    o->gemm_tn_scaled(B, D, B, St, B, vr + (size_t)kb * B * D, D, O, D, alpha);
                }
            }
            const double dt = now() - t;
            fastest = dt < fastest ? dt : fastest;
        }
        sink = O[0] + l[0];
        printf("step D%d (K Q^T, softmax_cols, P V; K / V cycled through %d tiles): %.2f us, "
               "%.1f GF/s\n", D, TILES, fastest / (TILES * TILES) * 1e6,
               4.0 * B * B * D * TILES * TILES / fastest / 1e9);
        free(kr);
        free(vr);
        free(Qt);
        free(St);
        free(O);
    }
    return 0;
}
