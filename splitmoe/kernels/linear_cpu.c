/* A dense projection on CPU at decode sizes (`linear_cpu.py` builds and calls it):
 * out [M, N] = x [M, K] w[N, K]^T (+ b [N]), float32 sums: `slinear_f32` float32 x and w,
 * `slinear_bf16` float32 x and bfloat16 w (widened as it is read), and where the compiler
 * targets AVX512-BF16 `slinear_bf16dp` bfloat16 x and w (K a multiple of 32, `rows_gemm_dp`).
 *
 * At a decode step's few rows the libraries' GEMMs pack the weight for every call (no packed
 * copy is kept), and the weight comes from memory: a step reads every layer's weights in turn.
 * Here each thread takes blocks of NB weight rows (static schedule), and each block, read once
 * from memory into L1, serves every row of x, ROWS at a time (`rows_gemm_*` of `vec16.h`).
 * Returns 0.
 */
#include <stdint.h>

#include "vec16.h"

#define NB 8 /* weight rows per block: 16 KB of float32 at K = 512, beside 4 rows of x in L1 */

#define DEFINE_LINEAR(NAME, XT, WT, GEMM)                                                       \
    int NAME(const XT *x, int64_t M, int64_t K, const WT *w, int64_t N, const float *b,     \
             float *out, int threads) {                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
        for (int64_t n0 = 0; n0 < N; n0 += NB) {                                                \
            int64_t nb = N - n0 < NB ? N - n0 : NB;                                             \
            for (int64_t m = 0; m < M; m += ROWS) {                                             \
                int64_t nr = M - m < ROWS ? M - m : ROWS;                                       \
                const XT *in[ROWS];                                                             \
                for (int64_t r = 0; r < ROWS; r++) in[r] = x + (m + (r < nr ? r : 0)) * K;      \
                GEMM(in, nr, w + n0 * K, nb, K, out + m * N + n0, N);                           \
                for (int64_t r = 0; b && r < nr; r++)                                           \
                    for (int64_t n = n0; n < n0 + nb; n++) out[(m + r) * N + n] += b[n];        \
            }                                                                                   \
        }                                                                                       \
        return 0;                                                                               \
    }

DEFINE_LINEAR(slinear_f32, float, float, rows_gemm_f32)
DEFINE_LINEAR(slinear_bf16, float, uint16_t, rows_gemm_bf16)
#if defined(__AVX512BF16__)
DEFINE_LINEAR(slinear_bf16dp, uint16_t, uint16_t, rows_gemm_dp)
#endif
