/* A dense projection on CPU at decode sizes (`linear_cpu.py` builds and calls it):
 * out [M, N] = x [M, K] w[N, K]^T (+ b [N]), float32 x and sums, float32 or bfloat16 w.
 *
 * At a decode step's few rows the libraries' GEMMs pack the weight for every call (no packed
 * copy is kept), and the weight comes from memory: a step reads every layer's weights in turn.
 * Here each thread takes blocks of NB weight rows (static schedule), and each block, read once
 * from memory into L1, serves every row of x, 4 rows at a time, in vectors of 16 floats
 * (`vec16.h`). Returns 0.
 */
#include <stdint.h>
#include <string.h>

#include "vec16.h"

#define NB 8 /* weight rows per block: 16 KB of float32 at K = 512, beside 4 rows of x in L1 */

static inline float same(float v) { return v; }

#define DEFINE_LINEAR(NAME, WT, LOAD, LOAD_V)                                                   \
    int NAME(const float *x, int64_t M, int64_t K, const WT *w, int64_t N, const float *b,     \
             float *out, int threads) {                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
        for (int64_t n0 = 0; n0 < N; n0 += NB) {                                                \
            int64_t n1 = n0 + NB < N ? n0 + NB : N;                                             \
            for (int64_t m = 0; m < M; m += 4) {                                                \
                int64_t nr = M - m < 4 ? M - m : 4;                                             \
                const float *x0 = x + m * K, *x1 = x0 + (nr > 1) * K, *x2 = x0 + (nr > 2) * 2 * K, \
                            *x3 = x0 + (nr > 3) * 3 * K;                                        \
                for (int64_t n = n0; n < n1; n++) {                                             \
                    const WT *wn = w + n * K;                                                   \
                    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                 \
                    int64_t k = 0;                                                              \
                    for (; k + 16 <= K; k += 16) {                                              \
                        v16 wk = LOAD_V(wn + k);                                                \
                        a0 += load_f32(x0 + k) * wk;                                            \
                        a1 += load_f32(x1 + k) * wk;                                            \
                        a2 += load_f32(x2 + k) * wk;                                            \
                        a3 += load_f32(x3 + k) * wk;                                            \
                    }                                                                           \
                    float t[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};                      \
                    for (; k < K; k++) { /* K past a multiple of 16 */                          \
                        float wk = LOAD(wn[k]);                                                 \
                        t[0] += x0[k] * wk, t[1] += x1[k] * wk, t[2] += x2[k] * wk;             \
                        t[3] += x3[k] * wk;                                                     \
                    }                                                                           \
                    for (int64_t r = 0; r < nr; r++)                                            \
                        out[(m + r) * N + n] = b ? t[r] + b[n] : t[r];                          \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        return 0;                                                                               \
    }

DEFINE_LINEAR(slinear_f32, float, same, load_f32)
DEFINE_LINEAR(slinear_bf16, uint16_t, bf16_to_f32, load_bf16)
