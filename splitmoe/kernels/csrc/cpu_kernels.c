/* Native CPU kernels for an attention rank's per-layer work in float32 (the "cpu" backend).
 *
 * Built on first use by splitmoe/kernels/cpu_native.py with the system C compiler
 * (cc -O3 -march=native) and called through ctypes: plain C, no Python or torch headers, so it
 * compiles in well under a second. Every function is single-threaded (one thread per rank is
 * how ranks share a CPU) and takes raw pointers plus element strides; the Python wrappers check
 * shapes, dtypes, devices and strides before calling.
 *
 * Why: on CPU an attention rank's decode layer is dominated by per-op overheads of tiny tensors,
 * not by arithmetic. Decode attention in PyTorch gathers every sequence's K/V blocks into a
 * padded copy and then runs SDPA over [B, kv heads, g, L] in per-(batch, head) GEMMs of a few
 * rows; RMSNorm is six small ops. Here each is one pass over its data.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Dot product in 8-wide vectors (GCC/Clang vector extensions: AVX on x86, NEON pairs on
 * arm64), two independent accumulators, then a fixed pairwise sum of the lanes: no -ffast-math,
 * so the order of the additions is the code's. 2.4x faster than a 16-lane array accumulator
 * reduced in a loop (3.3 vs 7.9 ns at d = 32), whose partial stores defeated store forwarding. */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    v8f acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += load8(a + i) * load8(b + i);
        acc1 += load8(a + i + 8) * load8(b + i + 8);
    }
    if (i + 8 <= n) {
        acc0 += load8(a + i) * load8(b + i);
        i += 8;
    }
    acc0 += acc1;
    float s = ((acc0[0] + acc0[4]) + (acc0[2] + acc0[6])) + ((acc0[1] + acc0[5]) + (acc0[3] + acc0[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* e^x for x <= 0 (softmax after subtracting the row max), vectorisable: Cody-Waite reduction
 * x = n ln2 + r and Cephes' degree-6 polynomial for e^r, within ~2 ulp of expf; below -87.3
 * (where e^x is under float's normal range) it returns ~1e-38 instead of a denormal. Scalar
 * libm expf made softmax ~30% of decode attention. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

static inline float sum_squares(const float *a, int64_t n) { return dot(a, a, n); }

/* Causal attention of one-token queries over a paged KV cache (decode), GQA aware.
 *
 * q[t, h, :] at q + t * q_st + h * q_sh; out likewise with o_st / o_sh (head_dim contiguous).
 * k_cache, v_cache: [num_blocks, block_size, nkv, d] contiguous. Sequence b (of num_seqs) reads
 * seq_lens[b] keys through block_tables[seq_index[b], :] (row stride table_st) and writes query
 * row rows[b]; seq_index / rows NULL mean b. Query head h reads KV head h / (nh / nkv).
 * Softmax in float32 over the scaled scores, then the probability-weighted sum of V.
 * Returns 0, or -1 if the scratch scores could not be allocated. */
int splitmoe_decode_attention_f32(const float *q, int64_t q_st, int64_t q_sh,
                                  const float *k_cache, const float *v_cache,
                                  const int32_t *block_tables, int64_t table_st,
                                  const int64_t *seq_lens, const int64_t *seq_index,
                                  const int64_t *rows, int64_t num_seqs, int64_t nh,
                                  int64_t nkv, int64_t d, int64_t block_size, float scale,
                                  float *out, int64_t o_st, int64_t o_sh) {
    const int64_t g = nh / nkv;
    int64_t max_len = 0;
    for (int64_t b = 0; b < num_seqs; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    float *scores = malloc(sizeof(float) * (size_t)(nh * (max_len > 0 ? max_len : 1)));
    if (!scores) return -1;
    const int64_t slot_st = nkv * d;           /* elements per cache slot */
    const int64_t block_st = block_size * slot_st; /* elements per cache block */
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t len = seq_lens[b];
        const int64_t t = rows ? rows[b] : b;
        const int32_t *table = block_tables + (seq_index ? seq_index[b] : b) * table_st;
        const int64_t nblk = (len + block_size - 1) / block_size;
        const float *qt = q + t * q_st;
        float *ot = out + t * o_st;
        /* scores[h * len + l] = q_h . k_l * scale. Each block is read once, front to back, for
         * every head (a block is contiguous: the prefetcher streams it), and the next block is
         * prefetched: blocks are scattered pages, and a sequence at a time otherwise waits on
         * one cache miss after another (~3x slower on a cold cache at batch 128). */
        for (int64_t blk = 0; blk < nblk; blk++) {
            const float *kb = k_cache + (int64_t)table[blk] * block_st;
            if (blk + 1 < nblk) {
                const char *next = (const char *)(k_cache + (int64_t)table[blk + 1] * block_st);
                for (int64_t off = 0; off < block_st * 4; off += 64) __builtin_prefetch(next + off);
            }
            const int64_t l0 = blk * block_size;
            const int64_t n = len - l0 < block_size ? len - l0 : block_size;
            for (int64_t i = 0; i < n; i++)
                for (int64_t h = 0; h < nh; h++)
                    scores[h * len + l0 + i] = dot(qt + h * q_sh, kb + i * slot_st + h / g * d, d) * scale;
        }
        /* softmax of each head's row, normalised in place */
        for (int64_t h = 0; h < nh; h++) {
            float *sc = scores + h * len;
            float m = -INFINITY;
            for (int64_t l = 0; l < len; l++) m = sc[l] > m ? sc[l] : m;
            float total = 0.0f;
            for (int64_t l = 0; l < len; l++) sc[l] = exp_nonpositive(sc[l] - m);
            for (int64_t l = 0; l < len; l++) total += sc[l];
            const float inv = 1.0f / total;
            for (int64_t l = 0; l < len; l++) sc[l] *= inv;
            memset(ot + h * o_sh, 0, sizeof(float) * (size_t)d);
        }
        /* out_h = sum_l p_hl v_l, V blocks read the same way */
        for (int64_t blk = 0; blk < nblk; blk++) {
            const float *vb = v_cache + (int64_t)table[blk] * block_st;
            const char *next = (const char *)(blk + 1 < nblk
                                                  ? v_cache + (int64_t)table[blk + 1] * block_st
                                                  : k_cache + (int64_t)table[0] * block_st);
            if (blk + 1 < nblk || b + 1 < num_seqs) {
                if (blk + 1 == nblk) { /* the next sequence's first K block */
                    const int32_t *nt = block_tables + (seq_index ? seq_index[b + 1] : b + 1) * table_st;
                    next = (const char *)(k_cache + (int64_t)nt[0] * block_st);
                }
                for (int64_t off = 0; off < block_st * 4; off += 64) __builtin_prefetch(next + off);
            }
            const int64_t l0 = blk * block_size;
            const int64_t n = len - l0 < block_size ? len - l0 : block_size;
            for (int64_t i = 0; i < n; i++) {
                const float *v = vb + i * slot_st;
                for (int64_t h = 0; h < nh; h++) {
                    const float p = scores[h * len + l0 + i];
                    const float *vh = v + h / g * d;
                    float *o = ot + h * o_sh;
                    for (int64_t e = 0; e < d; e++) o[e] += p * vh[e];
                }
            }
        }
    }
    free(scores);
    return 0;
}

/* RMSNorm over the last dim of x[t, h, :] (n elements, contiguous) for t < rows, h < heads:
 * out = (x * rsqrt(mean(x^2) + eps)) * w[h], HF's order of operations. x at x + t * x_st +
 * h * x_sh, out at out + t * o_st + h * o_sh (out may alias x). w: NULL (no weight), one
 * [n] weight for every head (w_sh = 0), or one per head (w + h * w_sh). */
void splitmoe_rms_norm_f32(const float *x, int64_t x_st, int64_t x_sh, int64_t rows,
                           int64_t heads, int64_t n, const float *w, int64_t w_sh, float eps,
                           float *out, int64_t o_st, int64_t o_sh) {
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + t * x_st + h * x_sh;
            float *o = out + t * o_st + h * o_sh;
            const float r = 1.0f / sqrtf(sum_squares(xr, n) / (float)n + eps);
            if (w) {
                const float *wr = w + h * w_sh;
                for (int64_t i = 0; i < n; i++) o[i] = wr[i] * (xr[i] * r);
            } else {
                for (int64_t i = 0; i < n; i++) o[i] = xr[i] * r;
            }
        }
    }
}

/* In place on x[t, h, :] (d elements, contiguous) for t < rows, h < heads: optionally RMSNorm
 * with per-head weights (w + h * w_sh; w NULL: no norm), then rotary embedding,
 * x = x * cos[t] + roll(x, d / 2) * sin[t] with sin's first half negated (HF's
 * x * cos + rotate_half(x) * sin). cos / sin rows at t * cs_st. d is even and at most 1024. */
int splitmoe_norm_rope_f32(float *x, int64_t x_st, int64_t x_sh, int64_t rows, int64_t heads,
                           int64_t d, const float *w, int64_t w_sh, float eps, const float *cos_t,
                           const float *sin_t, int64_t cs_st) {
    if (d % 2 || d > 1024) return -1;
    float y[1024];
    const int64_t half = d / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_t + t * cs_st, *s = sin_t + t * cs_st;
        for (int64_t h = 0; h < heads; h++) {
            float *xr = x + t * x_st + h * x_sh;
            if (w) {
                const float *wr = w + h * w_sh;
                const float r = 1.0f / sqrtf(sum_squares(xr, d) / (float)d + eps);
                for (int64_t i = 0; i < d; i++) y[i] = wr[i] * (xr[i] * r);
            } else {
                memcpy(y, xr, sizeof(float) * (size_t)d);
            }
            for (int64_t i = 0; i < half; i++) xr[i] = y[i] * c[i] + y[i + half] * s[i];
            for (int64_t i = half; i < d; i++) xr[i] = y[i] * c[i] + y[i - half] * s[i];
        }
    }
    return 0;
}
