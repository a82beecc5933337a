/* Decode attention over a paged KV cache on CPU (`attention_cpu.py` builds and calls it).
 *
 * One query token per row: q [B, nkv, g, d] (a GQA group's g heads share KV head h), float32.
 * Row b reads the blocks blocks[b * nblk ...] of the caches k, v [blocks, bs, nkv, d] in order
 * (key t of the row is slot t % bs of its block t / bs) and attends to its keys lo <= t < hi
 * (span [B, 2]: its sequence, or the part of it in its window). Each (row, KV head) is one task
 * (static schedule): the group's scores against each key read once, a float32 softmax (with
 * sinks [nkv * g], a learned logit per head in the denominator only), then the weighted sum of
 * the values, read once. No copy of the keys: the torch path gathers every row's blocks into
 * a tensor for SDPA first. Each key's slice is requested AHEAD keys before its use.
 * out [B, nkv, g, d] float32. d a multiple of 16. Returns 0, or -3 out of memory.
 *
 * In vectors of 16 floats (`vec16.h`), the softmax's exponentials too (`exp16`: libm's expf
 * one score at a time took a fifth to a third of the kernel). `sattn_f32`: float32 caches;
 * `sattn_bf16`: bfloat16 caches widened as they are read.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

/* Keys ahead of the one in use whose head slice is requested from memory: the rows' blocks lie
 * anywhere in the pool, so the hardware prefetcher, which follows a stream within a page, misses
 * the first keys of every block. */
#define AHEAD 8
#define PREFETCH(p)                                                                             \
    do {                                                                                        \
        for (int64_t o_ = 0; o_ < d * (int64_t)sizeof *(p); o_ += 64)                           \
            __builtin_prefetch((const char *)(p) + o_);                                         \
    } while (0)

/* exp of x <= 0 (scores less their maximum), 16 at a time: 2^n e^r with n the nearest integer
 * to x / ln 2 and r = x - n ln 2 (ln 2 in two parts), e^r by Cephes' expf polynomial (within
 * 2 ulp of expf); below -87.3 it is taken at -87.3 (~1e-38: nothing beside the maximum's 1). */
typedef int32_t i32x16 __attribute__((vector_size(64)));
static inline v16 exp16(v16 x) {
    const float magic = 12582912.f; /* 1.5 * 2^23: adding it rounds to an integer */
    i32x16 low = x < -87.3f;
    x = (v16)(((i32x16)x & ~low) | ((i32x16)((v16){0} - 87.3f) & low));
    v16 t = x * 1.44269504088896341f + magic, n = t - magic;
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v16 y = p * r * r + r + 1.f;
    i32x16 ni = (i32x16)t - (i32x16)((v16){0} + magic);
    return y * (v16)((ni + 127) << 23);
}

#define DEFINE_DECODE(NAME, CT, LOAD)                                                           \
    int NAME(const float *q, const CT *kc, const CT *vc, const int64_t *blocks, int64_t nblk,   \
             const int64_t *span, int64_t B, int64_t nkv, int64_t g, int64_t d, int64_t bs,     \
             float scale, const float *sinks, float *out, int threads) {                        \
        int failed = 0;                                                                         \
        const int64_t nc = d / 16, row = nkv * d; /* vectors per head; a slot's stride */      \
        _Pragma("omp parallel num_threads(threads)") {                                          \
            float *s = malloc(sizeof(float) * (size_t)(g * nblk * bs));                         \
            int64_t *at = malloc(sizeof(int64_t) * (size_t)(nblk * bs + 1));                    \
            v16 *acc = aligned_alloc(64, sizeof(v16) * (size_t)(g * nc + 1));                   \
            if (!s || !at || !acc) {                                                            \
                _Pragma("omp atomic write") failed = 1;                                         \
            }                                                                                   \
            _Pragma("omp for schedule(static)")                                                 \
            for (int64_t task = 0; task < B * nkv; task++) {                                    \
                if (!s || !at || !acc) continue;                                                \
                int64_t b = task / nkv, h = task % nkv;                                         \
                int64_t lo = span[2 * b], n = span[2 * b + 1] - lo;                             \
                const float *qb = q + task * g * d;                                             \
                const int64_t *bt = blocks + b * nblk;                                          \
                for (int64_t j = 0, blk = lo / bs, sl = lo % bs; j < n; j++) { /* key offsets */ \
                    at[j] = (bt[blk] * bs + sl) * row + h * d;                                  \
                    if (++sl == bs) sl = 0, blk++;                                              \
                }                                                                               \
                for (int64_t j = 0; j < n; j++) { /* scores s[r * n + j] */                     \
                    if (j + AHEAD < n) PREFETCH(kc + at[j + AHEAD]);                            \
                    const CT *kp = kc + at[j];                                                  \
                    for (int64_t r = 0; r < g; r++) {                                           \
                        v16 a = load_f32(qb + r * d) * LOAD(kp);                                \
                        for (int64_t c = 1; c < nc; c++)                                        \
                            a += load_f32(qb + r * d + 16 * c) * LOAD(kp + 16 * c);             \
                        s[r * n + j] = hsum(a) * scale;                                         \
                    }                                                                           \
                }                                                                               \
                float denom[g];                                                                 \
                for (int64_t r = 0; r < g; r++) { /* softmax numerators in place */            \
                    float *sr = s + r * n, m = sinks ? sinks[h * g + r] : -INFINITY, z = 0.f;   \
                    for (int64_t j = 0; j < n; j++) m = sr[j] > m ? sr[j] : m;                  \
                    v16 zv = {0};                                                               \
                    int64_t j = 0;                                                              \
                    for (; j + 16 <= n; j += 16) {                                              \
                        v16 e = exp16(load_f32(sr + j) - m);                                    \
                        memcpy(sr + j, &e, sizeof e);                                           \
                        zv += e;                                                                \
                    }                                                                           \
                    for (z = hsum(zv); j < n; j++) z += (sr[j] = expf(sr[j] - m));              \
                    denom[r] = sinks ? z + expf(sinks[h * g + r] - m) : z;                      \
                }                                                                               \
                memset(acc, 0, sizeof(v16) * (size_t)(g * nc));                                 \
                for (int64_t j = 0; j < n; j++) { /* acc[r] += p[r][j] * v_j */                 \
                    if (j + AHEAD < n) PREFETCH(vc + at[j + AHEAD]);                            \
                    const CT *vp = vc + at[j];                                                  \
                    for (int64_t c = 0; c < nc; c++) {                                          \
                        v16 v = LOAD(vp + 16 * c);                                              \
                        for (int64_t r = 0; r < g; r++) acc[r * nc + c] += s[r * n + j] * v;    \
                    }                                                                           \
                }                                                                               \
                float *ob = out + task * g * d;                                                 \
                for (int64_t r = 0; r < g; r++)                                                 \
                    for (int64_t c = 0; c < nc; c++) {                                          \
                        v16 o = acc[r * nc + c] / denom[r];                                     \
                        memcpy(ob + r * d + 16 * c, &o, sizeof o);                              \
                    }                                                                           \
            }                                                                                   \
            free(s);                                                                            \
            free(at);                                                                           \
            free(acc);                                                                          \
        }                                                                                       \
        return failed ? -3 : 0;                                                                 \
    }

DEFINE_DECODE(sattn_f32, float, load_f32)
DEFINE_DECODE(sattn_bf16, uint16_t, load_bf16)
