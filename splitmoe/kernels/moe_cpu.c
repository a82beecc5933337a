/* The MoE expert FFN on CPU in one OpenMP region per layer (`moe_cpu.py` builds and calls it).
 *
 * The (token, expert) pairs come sorted by expert: expert e's are [starts[e], starts[e+1]),
 * pair p reads token tok[p] of x and is weighted by wt[p]. Each thread takes whole experts
 * (dynamic schedule) and runs an expert's gate/up GEMM, SiLU-and-multiply and down GEMM on its
 * few rows; y[p] = wt[p] * down(silu(gate) * up) is written per pair (no two threads write one
 * row). Then each token's row of out [N, H] is the sum of its pairs' rows in slot order
 * (slot_row[n * k + j]: the y row of token n's slot j, -1 where the slot is not computed here),
 * so the sums are the same whatever the threads did. An expert's weight rows are read once
 * for up to ROWS of its rows at a time: at decode sizes the GEMMs are bound by reading the
 * weights, and one parallel region over experts replaces one per expert and projection.
 *
 * x, y and the arithmetic are float32; the weights float32 (`smoe_f32`) or bfloat16 (`smoe_bf16`,
 * widened as they are read). w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I], row-major.
 *
 * Where the compiler targets AVX512-BF16, `smoe_bf16dp` takes bfloat16 activations too and
 * multiplies pairs of bf16 values into float32 sums (`vdpbf16ps`), reading the weights as they
 * are stored; the SiLU-and-multiply output is rounded to bfloat16 (nearest even) for the down
 * GEMM, as a bf16 model computes it. H and I must be multiples of 32.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define ROWS 4

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* out[r][n] = sum_k in[r][k] * w[n][k] for r < nr (<= ROWS), n < N; in rows are pointers. */
#define DEFINE_ROWS_GEMM(NAME, WT, LOAD)                                                        \
    static void NAME(const float *const *in, int64_t nr, const WT *w, int64_t N, int64_t K,    \
                     float *out, int64_t ld) {                                                  \
        const float *i0 = in[0], *i1 = in[nr > 1 ? 1 : 0], *i2 = in[nr > 2 ? 2 : 0],            \
                    *i3 = in[nr > 3 ? 3 : 0];                                                   \
        for (int64_t n = 0; n < N; n++) {                                                       \
            const WT *wn = w + n * K;                                                           \
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;                                       \
            _Pragma("omp simd reduction(+ : a0, a1, a2, a3)")                                   \
            for (int64_t k = 0; k < K; k++) {                                                   \
                float wk = LOAD(wn[k]);                                                         \
                a0 += i0[k] * wk;                                                               \
                a1 += i1[k] * wk;                                                               \
                a2 += i2[k] * wk;                                                               \
                a3 += i3[k] * wk;                                                               \
            }                                                                                   \
            out[n] = a0;                                                                        \
            if (nr > 1) out[ld + n] = a1;                                                       \
            if (nr > 2) out[2 * ld + n] = a2;                                                   \
            if (nr > 3) out[3 * ld + n] = a3;                                                   \
        }                                                                                       \
    }

/* out[n] = the sum of token n's pairs' rows of y, in slot order. */
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

#define F32_LOAD(v) (v)
DEFINE_ROWS_GEMM(rows_gemm_f32, float, F32_LOAD)
DEFINE_ROWS_GEMM(rows_gemm_bf16, uint16_t, bf16_to_f32)

#define DEFINE_MOE(NAME, WT, GEMM)                                                              \
    int NAME(const float *x, int64_t H, int64_t I, const WT *w13, const WT *w2,               \
             const int64_t *starts, int64_t E, const int64_t *tok, const float *wt, float *y,  \
             const int64_t *slot_row, int64_t N, int64_t k, float *out, int threads) {          \
        int failed = 0;                                                                         \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                   \
        for (int64_t e = 0; e < E; e++) {                                                       \
            int64_t p0 = starts[e], p1 = starts[e + 1];                                         \
            if (p1 <= p0) continue;                                                             \
            float *h = malloc(sizeof(float) * ROWS * (3 * I));                                  \
            if (!h) {                                                                           \
                failed = 1;                                                                     \
                continue;                                                                       \
            }                                                                                   \
            float *a = h + ROWS * 2 * I;                                                        \
            for (int64_t p = p0; p < p1; p += ROWS) {                                           \
                int64_t nr = p1 - p < ROWS ? p1 - p : ROWS;                                     \
                const float *in[ROWS];                                                          \
                for (int64_t r = 0; r < nr; r++) in[r] = x + tok[p + r] * H;                    \
                GEMM(in, nr, w13 + e * 2 * I * H, 2 * I, H, h, 2 * I);                          \
                const float *ain[ROWS];                                                         \
                for (int64_t r = 0; r < nr; r++) {                                              \
                    const float *g = h + r * 2 * I, *u = g + I;                                 \
                    float *ar = a + r * I;                                                      \
                    for (int64_t i = 0; i < I; i++) ar[i] = g[i] / (1.f + expf(-g[i])) * u[i];  \
                    ain[r] = ar;                                                                \
                }                                                                               \
                GEMM(ain, nr, w2 + e * H * I, H, I, y + p * H, H);                              \
                for (int64_t r = 0; r < nr; r++) {                                              \
                    float s = wt[p + r], *yr = y + (p + r) * H;                                 \
                    for (int64_t j = 0; j < H; j++) yr[j] *= s;                                 \
                }                                                                               \
            }                                                                                   \
            free(h);                                                                            \
        }                                                                                       \
        if (failed) return -3;                                                                  \
        sum_tokens(y, slot_row, N, k, H, out, threads);                                         \
        return 0;                                                                               \
    }

DEFINE_MOE(smoe_f32, float, rows_gemm_f32)
DEFINE_MOE(smoe_bf16, uint16_t, rows_gemm_bf16)

#if defined(__AVX512BF16__)
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (uint16_t)(u >> 16);
}

/* out[r][n] = sum_k in[r][k] * w[n][k], bf16 inputs and weights, K a multiple of 32. */
static void rows_gemm_dp(const uint16_t *const *in, int64_t nr, const uint16_t *w, int64_t N,
                         int64_t K, float *out, int64_t ld) {
    const uint16_t *i0 = in[0], *i1 = in[nr > 1 ? 1 : 0], *i2 = in[nr > 2 ? 2 : 0],
                   *i3 = in[nr > 3 ? 3 : 0];
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wn = w + n * K;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < K; k += 32) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wn + k);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(i0 + k), wv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(i1 + k), wv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(i2 + k), wv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(i3 + k), wv);
        }
        out[n] = _mm512_reduce_add_ps(a0);
        if (nr > 1) out[ld + n] = _mm512_reduce_add_ps(a1);
        if (nr > 2) out[2 * ld + n] = _mm512_reduce_add_ps(a2);
        if (nr > 3) out[3 * ld + n] = _mm512_reduce_add_ps(a3);
    }
}

int smoe_bf16dp(const uint16_t *x, int64_t H, int64_t I, const uint16_t *w13,
                const uint16_t *w2, const int64_t *starts, int64_t E, const int64_t *tok,
                const float *wt, float *y, const int64_t *slot_row, int64_t N, int64_t k,
                float *out, int threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t e = 0; e < E; e++) {
        int64_t p0 = starts[e], p1 = starts[e + 1];
        if (p1 <= p0) continue;
        float *h = malloc(sizeof(float) * ROWS * 2 * I);
        uint16_t *a = malloc(sizeof(uint16_t) * ROWS * I);
        if (!h || !a) {
            free(h);
            free(a);
            failed = 1;
            continue;
        }
        for (int64_t p = p0; p < p1; p += ROWS) {
            int64_t nr = p1 - p < ROWS ? p1 - p : ROWS;
            const uint16_t *in[ROWS];
            for (int64_t r = 0; r < nr; r++) in[r] = x + tok[p + r] * H;
            rows_gemm_dp(in, nr, w13 + e * 2 * I * H, 2 * I, H, h, 2 * I);
            const uint16_t *ain[ROWS];
            for (int64_t r = 0; r < nr; r++) {
                const float *g = h + r * 2 * I, *u = g + I;
                uint16_t *ar = a + r * I;
                for (int64_t i = 0; i < I; i++) ar[i] = f32_to_bf16(g[i] / (1.f + expf(-g[i])) * u[i]);
                ain[r] = ar;
            }
            rows_gemm_dp(ain, nr, w2 + e * H * I, H, I, y + p * H, H);
            for (int64_t r = 0; r < nr; r++) {
                float s = wt[p + r], *yr = y + (p + r) * H;
                for (int64_t j = 0; j < H; j++) yr[j] *= s;
            }
        }
        free(h);
        free(a);
    }
    if (failed) return -3;
    sum_tokens(y, slot_row, N, k, H, out, threads);
    return 0;
}
#endif
