/* The MoE expert FFN on CPU in one OpenMP region per layer (`moe_cpu.py` builds and calls it).
 *
 * order [P] holds the computed (token, slot) pairs' flat indices t * k + j, grouped by expert
 * (counts [E] of each); pair p reads token order[p] / k of x and is weighted by wt[order[p]].
 * Each thread takes whole experts (dynamic schedule) and runs an expert's gate/up GEMM,
 * SiLU-and-multiply and down GEMM on its few rows, reading each weight row once for up to ROWS
 * of them (at decode sizes the GEMMs are bound by reading the weights, and one parallel region
 * over experts replaces one per expert and projection); y[p] = weight * down(silu(gate) * up)
 * per pair. Then each token's row of out [N, H] is the sum of its slots' rows in slot order, so
 * the sums are the same whatever the threads did.
 *
 * The arithmetic is float32. `smoe_f32`: float32 x and weights; `smoe_bf16`: float32 x,
 * bfloat16 weights widened as they are read. Where the compiler targets AVX512-BF16,
 * `smoe_bf16dp`: bfloat16 x and weights, pairs of bf16 values multiplied into float32 sums
 * (`vdpbf16ps`), the SiLU-and-multiply output rounded to bfloat16 (nearest even) for the down
 * GEMM as a bf16 model computes it; H and I multiples of 32. w13 [E, 2I, H] (gate rows, then
 * up), w2 [E, H, I], row-major. Returns 0, or -3 out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

/* out[n] = the sum of token n's slots' rows of y (slot_row: -1 where not computed here). */
static void sum_tokens(const float *y, const int64_t *slot_row, int64_t N, int64_t k, int64_t H,
                       float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        float *o = out + n * H;
        memset(o, 0, sizeof(float) * H);
        for (int64_t j = 0; j < k; j++) {
            int64_t r = slot_row[n * k + j];
            if (r < 0) continue;
            const float *yr = y + r * H;
            for (int64_t c = 0; c < H; c++) o[c] += yr[c];
        }
    }
}

/* XT: the activations' type (x, and the SiLU output the down GEMM reads), TO_X its rounding. */
#define DEFINE_MOE(NAME, XT, WT, GEMM, TO_X)                                                    \
    int NAME(const XT *x, int64_t H, int64_t I, const WT *w13, const WT *w2,                  \
             const int64_t *counts, int64_t E, const int64_t *order, const float *wt,          \
             int64_t N, int64_t k, float *out, int threads) {                                  \
        int64_t P = 0, *starts = malloc(sizeof(int64_t) * (E + 1));                             \
        int64_t *slot_row = malloc(sizeof(int64_t) * N * k);                                    \
        if (!starts || !slot_row) goto oom;                                                     \
        for (int64_t e = 0; e < E; e++) starts[e] = P, P += counts[e];                          \
        starts[E] = P;                                                                          \
        float *y = malloc(sizeof(float) * (P ? P : 1) * H);                                     \
        if (!y) goto oom;                                                                       \
        for (int64_t s = 0; s < N * k; s++) slot_row[s] = -1;                                   \
        for (int64_t p = 0; p < P; p++) slot_row[order[p]] = p;                                 \
        int failed = 0;                                                                         \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                   \
        for (int64_t e = 0; e < E; e++) {                                                       \
            int64_t p0 = starts[e], p1 = starts[e + 1];                                         \
            if (p1 <= p0) continue;                                                             \
            float *h = malloc(sizeof(float) * ROWS * 2 * I + sizeof(XT) * ROWS * I);           \
            if (!h) {                                                                           \
                failed = 1;                                                                     \
                continue;                                                                       \
            }                                                                                   \
            XT *a = (XT *)(h + ROWS * 2 * I);                                                   \
            for (int64_t p = p0; p < p1; p += ROWS) {                                           \
                int64_t nr = p1 - p < ROWS ? p1 - p : ROWS;                                     \
                const XT *in[ROWS], *ain[ROWS];                                                 \
                for (int64_t r = 0; r < nr; r++) in[r] = x + order[p + r] / k * H;              \
                GEMM(in, nr, w13 + e * 2 * I * H, 2 * I, H, h, 2 * I);                          \
                for (int64_t r = 0; r < nr; r++) {                                              \
                    const float *g = h + r * 2 * I, *u = g + I;                                 \
                    XT *ar = a + r * I;                                                         \
                    for (int64_t i = 0; i < I; i++)                                             \
                        ar[i] = TO_X(g[i] / (1.f + expf(-g[i])) * u[i]);                        \
                    ain[r] = ar;                                                                \
                }                                                                               \
                GEMM(ain, nr, w2 + e * H * I, H, I, y + p * H, H);                              \
                for (int64_t r = 0; r < nr; r++) {                                              \
                    float s = wt[order[p + r]], *yr = y + (p + r) * H;                          \
                    for (int64_t j = 0; j < H; j++) yr[j] *= s;                                 \
                }                                                                               \
            }                                                                                   \
            free(h);                                                                            \
        }                                                                                       \
        if (!failed) sum_tokens(y, slot_row, N, k, H, out, threads);                            \
        free(y);                                                                                \
        free(starts);                                                                           \
        free(slot_row);                                                                         \
        return failed ? -3 : 0;                                                                 \
    oom:                                                                                        \
        free(starts);                                                                           \
        free(slot_row);                                                                         \
        return -3;                                                                              \
    }

DEFINE_MOE(smoe_f32, float, float, rows_gemm_f32, same)
DEFINE_MOE(smoe_bf16, float, uint16_t, rows_gemm_bf16, same)

#if defined(__AVX512BF16__)
DEFINE_MOE(smoe_bf16dp, uint16_t, uint16_t, rows_gemm_dp, f32_to_bf16)
#endif
