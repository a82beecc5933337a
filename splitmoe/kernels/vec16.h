/* Vectors of 16 floats for the native CPU kernels (`moe_cpu.c`, `attention_cpu.c`,
 * `linear_cpu.c`), and the weight-row dot products the MoE and linear kernels share: GCC's vector
 * extensions, one AVX-512 register or two AVX2 ones, whatever -march=native targets. A sum across
 * lanes goes pairwise (`hsum`): an `omp simd` reduction sums the lanes one by one through memory,
 * several times slower on a decode step's short dot products. */
#ifndef SPLITMOE_VEC16_H
#define SPLITMOE_VEC16_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline v16 load_f32(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 bfloat16 values widened to float32 (the top half of each float's bits). */
static inline v16 load_bf16(const uint16_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    v16 v;
    memcpy(&v, &w, sizeof v);
    return v;
}

static inline float hsum(v16 a) {
    v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

#define ROWS 4

static inline float same(float v) { return v; }

/* out[r * ld + n] = sum_k in[r][k] * w[n][k] for r < nr (<= ROWS), n < N: each weight row read
 * once for up to ROWS rows of input (with `omp simd` reductions instead of these vectors, a
 * realistic-preset MoE layer took ~10% longer). rows_gemm_f32: float32 w; rows_gemm_bf16:
 * bfloat16 w widened as it is read. */
#define DEFINE_ROWS_GEMM(NAME, WT, LOAD, LOAD_V)                                                \
    static inline void NAME(const float *const *in, int64_t nr, const WT *w, int64_t N,        \
                            int64_t K, float *out, int64_t ld) {                                \
        const float *i0 = in[0], *i1 = in[nr > 1 ? 1 : 0], *i2 = in[nr > 2 ? 2 : 0],            \
                    *i3 = in[nr > 3 ? 3 : 0];                                                   \
        for (int64_t n = 0; n < N; n++) {                                                       \
            const WT *wn = w + n * K;                                                           \
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                         \
            int64_t k = 0;                                                                      \
            for (; k + 16 <= K; k += 16) {                                                      \
                v16 wk = LOAD_V(wn + k);                                                        \
                a0 += load_f32(i0 + k) * wk;                                                    \
                a1 += load_f32(i1 + k) * wk;                                                    \
                a2 += load_f32(i2 + k) * wk;                                                    \
                a3 += load_f32(i3 + k) * wk;                                                    \
            }                                                                                   \
            float t0 = hsum(a0), t1 = hsum(a1), t2 = hsum(a2), t3 = hsum(a3);                   \
            for (; k < K; k++) { /* K past a multiple of 16 */                                  \
                float wk = LOAD(wn[k]);                                                         \
                t0 += i0[k] * wk, t1 += i1[k] * wk, t2 += i2[k] * wk, t3 += i3[k] * wk;         \
            }                                                                                   \
            out[n] = t0;                                                                        \
            if (nr > 1) out[ld + n] = t1;                                                       \
            if (nr > 2) out[2 * ld + n] = t2;                                                   \
            if (nr > 3) out[3 * ld + n] = t3;                                                   \
        }                                                                                       \
    }

DEFINE_ROWS_GEMM(rows_gemm_f32, float, same, load_f32)
DEFINE_ROWS_GEMM(rows_gemm_bf16, uint16_t, bf16_to_f32, load_bf16)

#if defined(__AVX512BF16__)
#include <immintrin.h>

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                          /* nearest even */
    return (uint16_t)(u >> 16);
}

/* Where the compiler targets AVX512-BF16: rows_gemm_* on bf16 inputs and weights (K a multiple
 * of 32), pairs of bf16 values multiplied into float32 sums (`vdpbf16ps`, twice the products of
 * an FMA per instruction), as the libraries' bf16 GEMMs compute; f32_to_bf16 rounds to nearest
 * even. */
static inline void rows_gemm_dp(const uint16_t *const *in, int64_t nr, const uint16_t *w,
                                int64_t N, int64_t K, float *out, int64_t ld) {
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
#endif

#endif
