/* Native CPU kernels for an attention rank's per-layer work in float32 (the "cpu" backend).
 *
 * Built on first use by splitmoe/kernels/cpu_native.py with the system C compiler
 * (cc -O3 -march=native) and called through ctypes: plain C, no Python or torch headers, so it
 * compiles in well under a second. Every function takes raw pointers plus element strides; the
 * Python wrappers check shapes, dtypes, devices and strides before calling. The decode layer and
 * the fused MoE split their work over the rank's threads (splitmoe_set_threads; one thread per
 * rank is how ranks share a CPU, so most runs are single-threaded) in a way that leaves every
 * result bit-identical to the one-thread run.
 *
 * Why: on CPU an attention rank's decode layer is dominated by per-op overheads of tiny tensors,
 * not by arithmetic. Decode attention in PyTorch gathers every sequence's K/V blocks into a
 * padded copy and then runs SDPA over [B, kv heads, g, L] in per-(batch, head) GEMMs of a few
 * rows; RMSNorm is six small ops. Here each is one pass over its data.
 */
#define _GNU_SOURCE /* syscall, clock_gettime, sched_yield under -std=c11 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* ---- thread pool ---------------------------------------------------------------------------- */

/* parallel_for(n, fn, ctx) runs fn(ctx, i, thread) for every chunk i < n on the calling thread
 * and the pool's workers, and returns when all are done. Chunks are claimed one at a time from
 * a single atomic word (generation << 32 | n << 16 | next chunk), so a worker that wakes late
 * finds less or nothing to do and the caller never waits for a worker that claimed nothing:
 * with no workers (one thread, or a forked child, whose workers did not survive the fork) the
 * caller runs every chunk itself. Workers spin for SPIN_NS after the last job, then sleep on a
 * futex: within a decode step the next call follows in microseconds; between steps the core
 * is free for the other processes. A job's fn / ctx are read only after a chunk of it is
 * claimed; the job cannot have finished then, so the caller has not replaced them. Jobs from
 * several caller threads at once do not share the pool: the second runs on its own thread. */
typedef void (*chunk_fn)(void *ctx, int64_t chunk, int thread);

#define MAX_THREADS 64
#define SPIN_NS 200000

static struct {
    _Atomic uint64_t state; /* generation << 32 | chunks << 16 | next unclaimed chunk */
    _Atomic int64_t done;   /* chunks of the current job finished */
    _Atomic uint32_t wake;  /* futex word, bumped when a job is posted while a worker sleeps */
    _Atomic int sleepers;
    _Atomic int busy; /* a caller thread is running a job */
    chunk_fn fn;
    void *ctx;
    int threads; /* the caller + workers */
    pthread_mutex_t grow;
} pool = {.threads = 1, .grow = PTHREAD_MUTEX_INITIALIZER};

#define JOB_CHUNKS(s) ((int64_t)(((s) >> 16) & 0xffff))
#define JOB_NEXT(s) ((int64_t)((s)&0xffff))

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t value) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
#else
    (void)word, (void)value;
    sched_yield();
#endif
}

static void futex_wake_all(_Atomic uint32_t *word) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* Claims and runs chunks of the posted job until none is left. */
static void run_chunks(int thread) {
    uint64_t s = atomic_load(&pool.state);
    while (JOB_NEXT(s) < JOB_CHUNKS(s)) {
        if (!atomic_compare_exchange_weak(&pool.state, &s, s + 1)) continue; /* s reloaded */
        pool.fn(pool.ctx, JOB_NEXT(s), thread);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        s = atomic_load(&pool.state);
    }
}

static void *pool_worker(void *arg) {
    const int thread = (int)(intptr_t)arg;
    for (;;) {
        const int64_t idle_since = now_ns();
        uint64_t s;
        for (int spins = 0;; spins++) {
            s = atomic_load(&pool.state);
            if (JOB_NEXT(s) < JOB_CHUNKS(s) && thread < pool.threads) break;
            if ((spins & 63) || now_ns() - idle_since < SPIN_NS) {
                cpu_relax();
                continue;
            }
            const uint32_t w = atomic_load(&pool.wake);
            atomic_fetch_add(&pool.sleepers, 1);
            s = atomic_load(&pool.state); /* a job posted before the count rose: no wake for it */
            if (JOB_NEXT(s) >= JOB_CHUNKS(s) || thread >= pool.threads) futex_wait(&pool.wake, w);
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        run_chunks(thread);
    }
    return NULL;
}

/* Sets the threads the parallel kernels use (the caller + n - 1 workers, started on first
 * need; workers past n are never stopped, only left asleep); returns the count in effect, which
 * is lower than n if a thread could not be started. Not while a kernel runs: the kernels size
 * per-thread scratch by it. */
int splitmoe_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    static int started = 1;
    pthread_mutex_lock(&pool.grow);
    for (; started < n; started++) {
        pthread_t tid;
        if (pthread_create(&tid, NULL, pool_worker, (void *)(intptr_t)started)) break;
        pthread_detach(tid);
    }
    pool.threads = n < started ? n : started;
    pthread_mutex_unlock(&pool.grow);
    return pool.threads;
}

static void parallel_for(int64_t n, chunk_fn fn, void *ctx) {
    if (n > 0xffff) n = 0xffff; /* callers keep to far fewer chunks */
    int idle = 0;
    if (pool.threads < 2 || n < 2 || !atomic_compare_exchange_strong(&pool.busy, &idle, 1)) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store(&pool.done, 0);
    const uint64_t generation = (atomic_load(&pool.state) >> 32) + 1;
    atomic_store(&pool.state, generation << 32 | (uint64_t)n << 16);
    if (atomic_load(&pool.sleepers)) {
        atomic_fetch_add(&pool.wake, 1);
        futex_wake_all(&pool.wake);
    }
    run_chunks(0);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < n) cpu_relax();
    atomic_store(&pool.busy, 0);
}

/* How many chunks of `per` rows cover `rows`. */
static inline int64_t chunks_of(int64_t rows, int64_t per) { return (rows + per - 1) / per; }

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
/* e^r of the reduction (x - n ln2, ln2 in two parts) and the polynomial, for a float or a
 * vector of floats (exp_nonpositive16) */
#define EXP_REDUCE(x, n) (((x) - (n) * 0.693359375f) + (n) * 2.12194440e-4f)
#define EXP_POLY(r)                                                                              \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) +          \
        4.1665795894e-2f) * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) +     \
     (r) + 1.0f)
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = EXP_REDUCE(x, n);
    const float p = EXP_POLY(r);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* The 8 sums of the lanes of a[0..7], as one vector (r[j] = sum of a[j]'s lanes): a transposing
 * tree of shuffles and adds, ~2.5 operations per sum instead of ~10 for one horizontal sum. */
static inline v8f sum_lanes8(const v8f a[8]) {
    v8f b[4], c[2];
    for (int j = 0; j < 4; j++)
        b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(a[2 * j], a[2 * j + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int j = 0; j < 2; j++)
        c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(b[2 * j], b[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* res[j] = q . k[j] (n elements) for 8 rows k[j]: 8 dot products at the cost of ~3. */
static inline void dot8(const float *q, const float *const k[8], int64_t n, float res[8]) {
    v8f acc[8] = {{0}};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f qv = load8(q + i);
        for (int j = 0; j < 8; j++) acc[j] += qv * load8(k[j] + i);
    }
    const v8f r = sum_lanes8(acc);
    memcpy(res, &r, sizeof r);
    for (; i < n; i++)
        for (int j = 0; j < 8; j++) res[j] += q[i] * k[j][i];
}

typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

/* Lanes of a where mask is set, else of b. */
static inline v16f select16(v16i mask, v16f a, v16f b) {
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}

/* exp_nonpositive on 16 lanes: the same reduction and polynomial, n rounded to nearest (the
 * scalar form rounds halves up: either is a valid reduction) so that every step is a vector op. */
static inline v16f exp_nonpositive16(v16f x) {
    const v16f lo = (v16f){0} - 87.3f;
    x = select16(x < lo, lo, x);
    const v16f round = (v16f){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const v16f n = (x * 1.44269504f + round) - round;
    const v16f r = EXP_REDUCE(x, n);
    const v16f p = EXP_POLY(r);
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16f)bits;
}

/* r[j] = the sum of a[j]'s 16 lanes, j < 16: a transposing tree of 15 shuffle-adds (~3
 * operations per sum). */
static inline v16f sum_lanes16(const v16f a[16]) {
    v16f b[8], c[4], e[2];
    for (int j = 0; j < 8; j++)
        b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24,
                                       10, 26, 12, 28, 14, 30) +
               __builtin_shufflevector(a[2 * j], a[2 * j + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25,
                                       11, 27, 13, 29, 15, 31);
    for (int j = 0; j < 4; j++)
        c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                       24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(b[2 * j], b[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                       26, 27, 14, 15, 30, 31);
    for (int j = 0; j < 2; j++)
        e[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                       10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(c[2 * j], c[2 * j + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                       14, 15, 28, 29, 30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                                   23) +
           __builtin_shufflevector(e[0], e[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                   29, 30, 31);
}

/* The largest of x[0..n-1] (NaN-free input), 8 lanes at a time. */
static inline float max_of(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
    if (n >= 8) {
        v8f mv = load8(x);
        for (i = 8; i + 8 <= n; i += 8) {
            const v8f v = load8(x + i);
            const v8i gt = v > mv;
            mv = (v8f)(((v8i)v & gt) | ((v8i)mv & ~gt));
        }
        for (int j = 0; j < 8; j++) m = mv[j] > m ? mv[j] : m;
    }
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* x[i] = e^(x[i] - m) in place (every x[i] <= m); returns their sum, accumulated 8 lanes wide. */
static inline float exp_sum(float *x, int64_t n, float m) {
    v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        for (int j = 0; j < 8; j++) v[j] = exp_nonpositive(x[i + j] - m);
        memcpy(x + i, &v, sizeof v);
        acc += v;
    }
    float total = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (; i < n; i++) {
        x[i] = exp_nonpositive(x[i] - m);
        total += x[i];
    }
    return total;
}

/* Asks for the n floats at p to be brought into cache (a hint: never faults). */
static inline void prefetch(const float *p, int64_t n) {
    for (int64_t off = 0; off < n; off += 16) __builtin_prefetch(p + off);
}

static inline float sum_squares(const float *a, int64_t n) { return dot(a, a, n); }

/* The longest of the sequences' lengths (seq_lens[seq_index[b]], b < num_seqs; seq_index NULL
 * means b), or -1 if a sequence is longer than its block table row (table_width blocks) or reads
 * a block id outside 0..num_blocks-1: every block a decode reads must exist. */
static int64_t check_tables(const int32_t *block_tables, int64_t table_st, int64_t table_width,
                            int64_t num_blocks, const int64_t *seq_lens, const int64_t *seq_index,
                            int64_t num_seqs, int64_t block_size) {
    int64_t max_len = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t s = seq_index ? seq_index[b] : b;
        const int64_t len = seq_lens[s];
        const int32_t *table = block_tables + s * table_st;
        if (len < 0 || len > table_width * block_size) return -1;
        for (int64_t blk = 0; blk * block_size < len; blk++)
            if (table[blk] < 0 || table[blk] >= num_blocks) return -1;
        if (len > max_len) max_len = len;
    }
    return max_len;
}

static int decode_attention(const float *q, int64_t q_st, int64_t q_sh, const float *k_cache,
                            const float *v_cache, const int32_t *block_tables, int64_t table_st,
                            const int64_t *seq_lens, const int64_t *seq_index,
                            const int64_t *rows, int64_t num_seqs, int64_t max_len, int64_t nh,
                            int64_t nkv, int64_t d, int64_t block_size, float scale, float *out,
                            int64_t o_st, int64_t o_sh);

/* Causal attention of one-token queries over a paged KV cache (decode), GQA aware.
 *
 * q[t, h, :] at q + t * q_st + h * q_sh; out likewise with o_st / o_sh (head_dim contiguous).
 * k_cache, v_cache: [num_blocks, block_size, nkv, d] contiguous. Decode sequence b (of num_seqs)
 * is the step's sequence s = seq_index[b]: it reads seq_lens[s] keys through block_tables[s, :]
 * (row stride table_st) and writes query row rows[b]; seq_index / rows NULL mean b. Query head h reads KV head h / (nh / nkv).
 * Softmax in float32 over the scaled scores, then the probability-weighted sum of V.
 * Returns 0; -1 if the scratch scores could not be allocated; -3 (nothing computed) if a
 * sequence is longer than its table row (table_width blocks) or a block id is outside
 * 0..num_blocks-1. */
int splitmoe_decode_attention_f32(const float *q, int64_t q_st, int64_t q_sh,
                                  const float *k_cache, const float *v_cache,
                                  const int32_t *block_tables, int64_t table_st,
                                  int64_t table_width, int64_t num_blocks,
                                  const int64_t *seq_lens, const int64_t *seq_index,
                                  const int64_t *rows, int64_t num_seqs, int64_t nh,
                                  int64_t nkv, int64_t d, int64_t block_size, float scale,
                                  float *out, int64_t o_st, int64_t o_sh) {
    const int64_t max_len = check_tables(block_tables, table_st, table_width, num_blocks,
                                         seq_lens, seq_index, num_seqs, block_size);
    if (max_len < 0) return -3;
    return decode_attention(q, q_st, q_sh, k_cache, v_cache, block_tables, table_st, seq_lens,
                            seq_index, rows, num_seqs, max_len, nh, nkv, d, block_size, scale,
                            out, o_st, o_sh);
}

/* One sequence of decode attention, any head_dim: query heads qt + h * q_sh, output heads
 * ot + h * o_sh, len keys through table; scores: scratch of nh * len + nh * d floats. */
static void attend_seq_any(const float *qt, int64_t q_sh, const float *k_cache,
                           const float *v_cache, const int32_t *table, int64_t len, int64_t nh,
                           int64_t nkv, int64_t d, int64_t block_size, float scale, float *ot,
                           int64_t o_sh, float *scores) {
    const int64_t g = nh / nkv;
    const int64_t slot_st = nkv * d;               /* elements per cache slot */
    const int64_t block_st = block_size * slot_st; /* elements per cache block */
    const int64_t nblk = (len + block_size - 1) / block_size;
    /* scores[h * len + l] = q_h . k_l * scale, 8 keys at a time (keys past the end repeat
     * the last one); the 8 keys' rows stay in L1 across the heads */
    for (int64_t l0 = 0; l0 < len; l0 += 8) {
        const int64_t ahead = (l0 + 8) / block_size + 1; /* the block after the next chunk's */
        if (l0 / block_size != (l0 + 8) / block_size && ahead < nblk)
            prefetch(k_cache + (int64_t)table[ahead] * block_st, block_st);
        const float *kp[8];
        for (int64_t j = 0; j < 8; j++) {
            const int64_t l = l0 + j < len ? l0 + j : len - 1;
            kp[j] = k_cache + (int64_t)table[l / block_size] * block_st + l % block_size * slot_st;
        }
        for (int64_t h = 0; h < nh; h++) {
            const float *kh[8];
            float r[8];
            for (int j = 0; j < 8; j++) kh[j] = kp[j] + h / g * d;
            dot8(qt + h * q_sh, kh, d, r);
            for (int64_t j = 0; j < 8 && l0 + j < len; j++) scores[h * len + l0 + j] = r[j] * scale;
        }
    }
    /* softmax of each head's row, normalised in place */
    for (int64_t h = 0; h < nh; h++) {
        float *sc = scores + h * len;
        const float inv = 1.0f / exp_sum(sc, len, max_of(sc, len));
        for (int64_t l = 0; l < len; l++) sc[l] *= inv;
    }
    /* the heads' outputs accumulate in scratch that nothing else points to, so the
     * compiler keeps the d-long updates in vector registers */
    float *restrict acc = scores + nh * len;
    memset(acc, 0, sizeof(float) * (size_t)(nh * d));
    /* out_h = sum_l p_hl v_l, a block at a time, the next one prefetched */
    for (int64_t blk = 0; blk < nblk; blk++) {
        const float *vb = v_cache + (int64_t)table[blk] * block_st;
        if (blk + 1 < nblk) prefetch(v_cache + (int64_t)table[blk + 1] * block_st, block_st);
        const int64_t l0 = blk * block_size;
        const int64_t n = len - l0 < block_size ? len - l0 : block_size;
        for (int64_t i = 0; i < n; i++) {
            const float *v = vb + i * slot_st;
            for (int64_t h = 0; h < nh; h++) {
                const float p = scores[h * len + l0 + i];
                const float *vh = v + h / g * d;
                float *restrict o = acc + h * d;
                for (int64_t e = 0; e < d; e++) o[e] += p * vh[e];
            }
        }
    }
    for (int64_t h = 0; h < nh; h++) memcpy(ot + h * o_sh, acc + h * d, sizeof(float) * (size_t)d);
}

/* attend_seq_any for head_dim = 16 D16, a KV head's query heads HG at a time (D16 and HG
 * constants where it is inlined; HG divides the heads per KV head): the scores of 16 keys per
 * head in 16 lanes (sum_lanes16), the softmax 16 lanes wide (exp_nonpositive16), and the heads'
 * outputs kept in HG x D16 registers while each V row is read once for all of them. scores: HG
 * rows of len rounded up to 16; offs: as many int64. */
static inline __attribute__((always_inline)) void
attend_seq16(const float *qt, int64_t q_sh, const float *k_cache, const float *v_cache,
             const int32_t *table, int64_t len, int64_t nh, int64_t nkv, int64_t block_size,
             float scale, float *ot, int64_t o_sh, float *scores, int64_t *offs, const int D16,
             const int HG) {
    const int64_t d = 16 * D16, g = nh / nkv, lp = (len + 15) / 16 * 16;
    const int64_t slot_st = nkv * d, block_st = block_size * slot_st;
    const int64_t nblk = (len + block_size - 1) / block_size;
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    /* offs[l]: key l's slot in either cache (the keys past the end: the last key's), counted
     * along the table rather than divided out per key */
    for (int64_t l = 0, blk = 0, i = 0; l < lp; l++) {
        offs[l] = (int64_t)table[blk] * block_st + i * slot_st;
        if (l + 1 < len && ++i == block_size) {
            blk++;
            i = 0;
        }
    }
    for (int64_t kh = 0; kh < nkv; kh++) {
        for (int64_t h0 = kh * g; h0 < (kh + 1) * g; h0 += HG) {
            /* scores[hh * lp + l] = q . k_l * scale, 16 keys at a time (keys past the end
             * repeat the last one) */
            for (int64_t l0 = 0; l0 < len; l0 += 16) {
                const int64_t ahead = (l0 + 16) / block_size + 1;
                if (kh == 0 && l0 / block_size != (l0 + 16) / block_size && ahead < nblk)
                    prefetch(k_cache + (int64_t)table[ahead] * block_st, block_st);
                const float *kp[16];
                for (int64_t j = 0; j < 16; j++) kp[j] = k_cache + offs[l0 + j] + kh * d;
#pragma GCC unroll 1 /* one head's 16 accumulators at a time: unrolled, they spill */
                for (int hh = 0; hh < HG; hh++) {
                    const float *qh = qt + (h0 + hh) * q_sh;
                    v16f acc[16];
                    for (int j = 0; j < 16; j++) {
                        acc[j] = load16(qh) * load16(kp[j]);
                        for (int c = 1; c < D16; c++) acc[j] += load16(qh + 16 * c) * load16(kp[j] + 16 * c);
                    }
                    store16(scores + hh * lp + l0, sum_lanes16(acc) * scale);
                }
            }
            /* softmax of each head's row (the padding lanes repeat the last key's score, so
             * they do not change the max; their exponentials are zeroed), normalised */
            for (int hh = 0; hh < HG; hh++) {
                float *sc = scores + hh * lp;
                v16f mv = load16(sc);
                for (int64_t i = 16; i < lp; i += 16) {
                    const v16f v = load16(sc + i);
                    mv = select16(v > mv, v, mv);
                }
                float m = mv[0];
                for (int j = 1; j < 16; j++) m = mv[j] > m ? mv[j] : m;
                v16f sum = {0};
                for (int64_t i = 0; i < lp; i += 16) {
                    v16f e = exp_nonpositive16(load16(sc + i) - m);
                    if (i + 16 > len) e = select16(lane < (v16i){0} + (int32_t)(len - i), e, (v16f){0});
                    store16(sc + i, e);
                    sum += e;
                }
                const v16f s8 = __builtin_shufflevector(sum, sum, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2,
                                                        3, 4, 5, 6, 7) +
                                __builtin_shufflevector(sum, sum, 8, 9, 10, 11, 12, 13, 14, 15, 8,
                                                        9, 10, 11, 12, 13, 14, 15);
                const float total =
                    ((s8[0] + s8[4]) + (s8[2] + s8[6])) + ((s8[1] + s8[5]) + (s8[3] + s8[7]));
                const float inv = 1.0f / total;
                for (int64_t i = 0; i < lp; i += 16) store16(sc + i, load16(sc + i) * inv);
            }
            /* out_h = sum_l p_hl v_l: each V row read once for the HG heads */
            v16f acc[16]; /* [HG][D16]: fixed-size arrays (not VLAs), so they live in registers */
            for (int i = 0; i < HG * D16; i++) acc[i] = (v16f){0};
            for (int64_t blk = 0; blk < nblk; blk++) {
                if (kh == 0 && blk + 1 < nblk)
                    prefetch(v_cache + (int64_t)table[blk + 1] * block_st, block_st);
                const int64_t l0 = blk * block_size;
                const int64_t n = len - l0 < block_size ? len - l0 : block_size;
                for (int64_t i = 0; i < n; i++) {
                    const float *v = v_cache + offs[l0 + i] + kh * d;
                    v16f vr[8];
                    for (int c = 0; c < D16; c++) vr[c] = load16(v + 16 * c);
                    for (int hh = 0; hh < HG; hh++) {
                        const float p = scores[hh * lp + l0 + i];
                        for (int c = 0; c < D16; c++) acc[hh * D16 + c] += p * vr[c];
                    }
                }
            }
            for (int hh = 0; hh < HG; hh++) {
                for (int c = 0; c < D16; c++) store16(ot + (h0 + hh) * o_sh + 16 * c, acc[hh * D16 + c]);
            }
        }
    }
}

/* attend_seq16 for head_dim 16, 32, 64 or 128, with the most query heads per pass (8, 4, 2 or
 * 1) that divides the heads per KV head and keeps HG x D16 <= 16 accumulators; returns 0
 * (nothing done) for other head dims. (A branch that a head dim cannot take is compiled with
 * HG = 1 rather than with an accumulator set too large for the registers.) */
#define ATTEND16(D16, HG)                                                                        \
    attend_seq16(qt, q_sh, k_cache, v_cache, table, len, nh, nkv, block_size, scale, ot, o_sh,   \
                 scores, offs, D16, HG)
#define ATTEND16_HEADS(D16)                                                                      \
    do {                                                                                         \
        if ((D16) <= 2 && g % 8 == 0)                                                            \
            ATTEND16(D16, (D16) <= 2 ? 8 : 1);                                                   \
        else if ((D16) <= 4 && g % 4 == 0)                                                       \
            ATTEND16(D16, (D16) <= 4 ? 4 : 1);                                                   \
        else if (g % 2 == 0)                                                                     \
            ATTEND16(D16, 2);                                                                    \
        else                                                                                     \
            ATTEND16(D16, 1);                                                                    \
    } while (0)
static int attend_seq_16_lanes(const float *qt, int64_t q_sh, const float *k_cache,
                               const float *v_cache, const int32_t *table, int64_t len,
                               int64_t nh, int64_t nkv, int64_t d, int64_t block_size,
                               float scale, float *ot, int64_t o_sh, float *scores,
                               int64_t *offs) {
    const int64_t g = nh / nkv;
    switch (d) {
    case 16: ATTEND16_HEADS(1); return 1;
    case 32: ATTEND16_HEADS(2); return 1;
    case 64: ATTEND16_HEADS(4); return 1;
    case 128: ATTEND16_HEADS(8); return 1;
    default: return 0;
    }
}

/* splitmoe_decode_attention_f32 on tables already checked (max_len: the longest sequence). */
static int decode_attention(const float *q, int64_t q_st, int64_t q_sh, const float *k_cache,
                            const float *v_cache, const int32_t *block_tables, int64_t table_st,
                            const int64_t *seq_lens, const int64_t *seq_index,
                            const int64_t *rows, int64_t num_seqs, int64_t max_len, int64_t nh,
                            int64_t nkv, int64_t d, int64_t block_size, float scale, float *out,
                            int64_t o_st, int64_t o_sh) {
    const int64_t lp = (max_len > 0 ? max_len : 1) + 16;
    int64_t *offs = malloc(sizeof(int64_t) * (size_t)lp + sizeof(float) * (size_t)(nh * lp + nh * d));
    if (!offs) return -1;
    float *scores = (float *)(offs + lp);
    const int64_t block_st = block_size * nkv * d; /* elements per cache block */
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t s = seq_index ? seq_index[b] : b;
        const int64_t len = seq_lens[s];
        const int32_t *table = block_tables + s * table_st;
        /* The next sequence's K and V blocks are asked into L2 while this one computes, and
         * each next block into L1: blocks are scattered pages, and a sequence at a time
         * otherwise waits on one cache miss after another. Cold-cache batch 128 x 80 keys:
         * 951 -> 705 us with the 8-key scores below (bench as in docs/kernels.md). */
        if (b + 1 < num_seqs) {
            const int64_t s1 = seq_index ? seq_index[b + 1] : b + 1;
            const int32_t *t1 = block_tables + s1 * table_st;
            for (int64_t blk = 0; blk * block_size < seq_lens[s1]; blk++) {
                const float *k1 = k_cache + (int64_t)t1[blk] * block_st;
                const float *v1 = v_cache + (int64_t)t1[blk] * block_st;
                for (int64_t off = 0; off < block_st; off += 16) {
                    __builtin_prefetch(k1 + off, 0, 2);
                    __builtin_prefetch(v1 + off, 0, 2);
                }
            }
        }
        const float *qt = q + (rows ? rows[b] : b) * q_st;
        float *ot = out + (rows ? rows[b] : b) * o_st;
        if (len == 0) {
            for (int64_t h = 0; h < nh; h++) memset(ot + h * o_sh, 0, sizeof(float) * (size_t)d);
            continue;
        }
        if (!attend_seq_16_lanes(qt, q_sh, k_cache, v_cache, table, len, nh, nkv, d, block_size,
                                 scale, ot, o_sh, scores, offs))
            attend_seq_any(qt, q_sh, k_cache, v_cache, table, len, nh, nkv, d, block_size, scale,
                           ot, o_sh, scores);
    }
    free(offs);
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

/* ---- fused MoE ------------------------------------------------------------------------------ */

/* C[M, N] = A[M, K] @ B[K, N] (row-major, leading dims lda / ldb / ldc), in register tiles of
 * 4 rows x TILE_N columns: per step of K, TILE_N / 16 vectors of B and 4 broadcasts of A feed
 * 4 x TILE_N / 16 FMAs. The compiler keeps the tile in registers (AVX-512: 16 of 32). */
#ifdef __AVX512F__
#define TILE_V 4
#else
#define TILE_V 2
#endif
#define TILE_N (16 * TILE_V)

/* One tile: ROWS rows x 16 V columns, all of K. */
#define GEMM_TILE(NAME, ROWS, V)                                                                 \
    static void NAME(const float *A, int64_t lda, const float *B, int64_t ldb, float *C,         \
                     int64_t ldc, int64_t K) {                                                   \
        v16f c[ROWS][V];                                                                         \
        for (int r = 0; r < ROWS; r++)                                                           \
            for (int v = 0; v < V; v++) c[r][v] = (v16f){0};                                     \
        for (int64_t p = 0; p < K; p++) {                                                        \
            v16f b[V];                                                                           \
            for (int v = 0; v < V; v++) b[v] = load16(B + p * ldb + 16 * v);                     \
            for (int r = 0; r < ROWS; r++) {                                                     \
                const float a = A[r * lda + p];                                                  \
                for (int v = 0; v < V; v++) c[r][v] += a * b[v];                                 \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < ROWS; r++)                                                           \
            for (int v = 0; v < V; v++) store16(C + r * ldc + 16 * v, c[r][v]);                  \
    }
GEMM_TILE(gemm_tile4, 4, TILE_V)
GEMM_TILE(gemm_tile1, 1, TILE_V)
GEMM_TILE(gemm_tile4_16, 4, 1) /* 16-column strips past the last whole tile (a router's E) */
GEMM_TILE(gemm_tile1_16, 1, 1)

static void gemm(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                 int64_t M, int64_t N, int64_t K) {
    int64_t j = 0;
    for (; j + TILE_N <= N; j += TILE_N) {
        int64_t i = 0;
        for (; i + 4 <= M; i += 4) gemm_tile4(A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, K);
        for (; i < M; i++) gemm_tile1(A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, K);
    }
    for (; j + 16 <= N; j += 16) {
        int64_t i = 0;
        for (; i + 4 <= M; i += 4)
            gemm_tile4_16(A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, K);
        for (; i < M; i++) gemm_tile1_16(A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, K);
    }
    for (; j < N; j++) /* the last < 16 columns */
        for (int64_t i = 0; i < M; i++) {
            float s = 0.0f;
            for (int64_t p = 0; p < K; p++) s += A[i * lda + p] * B[p * ldb + j];
            C[i * ldc + j] = s;
        }
}

/* out[i] = silu(gate[i]) * up[i], silu(x) = x * sigmoid(x) with e^-|x| from the non-positive
 * exp; branch-free, so the loop vectorises (a scalar silu was ~half of the layer at 8 rows per
 * expert). */
static void silu_mul(const float *gate, const float *up, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        const float e = exp_nonpositive(-fabsf(g));
        out[i] = g * ((g < 0 ? e : 1.0f) / (1.0f + e)) * up[i];
    }
}

struct fused_moe {
    const float *x;
    int64_t x_st; /* elements from one row of x to the next */
    int64_t N, H, I, k;
    const float *w13t, *w2t;
    const float *weights;
    const int64_t *start, *order, *pos; /* pairs grouped by expert; pos: each pair's place */
    const int64_t *experts;             /* the experts with rows, in ascending order */
    float *y;                           /* [N k, H]: each pair's FFN output, in grouped order */
    float *scratch;                     /* per thread: [max_rows, H + 3 I] */
    int64_t scratch_st;
    float *out;
};

/* Phase one, one expert per chunk: its rows gathered, FFN_e into their places in y. */
static void fused_moe_expert(void *ctx, int64_t chunk, int thread) {
    const struct fused_moe *m = ctx;
    const int64_t H = m->H, I = m->I, e = m->experts[chunk];
    const int64_t rows = m->start[e + 1] - m->start[e];
    const int64_t *pairs = m->order + m->start[e];
    float *a = m->scratch + thread * m->scratch_st;
    float *h = a + rows * H;         /* [rows, 2I]: gate | up */
    float *act = h + rows * 2 * I;   /* [rows, I] */
    for (int64_t r = 0; r < rows; r++)
        memcpy(a + r * H, m->x + pairs[r] / m->k * m->x_st, sizeof(float) * (size_t)H);
    gemm(a, H, m->w13t + e * H * 2 * I, 2 * I, h, 2 * I, rows, 2 * I, H);
    for (int64_t r = 0; r < rows; r++) silu_mul(h + r * 2 * I, h + r * 2 * I + I, act + r * I, I);
    gemm(act, I, m->w2t + e * I * H, H, m->y + m->start[e] * H, H, rows, H, I);
}

#define MOE_TOKENS_PER_CHUNK 8

/* Phase two, 8 tokens per chunk: out[t] += w * y of t's pairs in ascending expert order (their
 * places in y ascend so), as the one-thread sum. */
static void fused_moe_sum(void *ctx, int64_t chunk, int thread) {
    (void)thread;
    const struct fused_moe *m = ctx;
    const int64_t H = m->H, k = m->k, t0 = chunk * MOE_TOKENS_PER_CHUNK;
    const int64_t t1 = t0 + MOE_TOKENS_PER_CHUNK < m->N ? t0 + MOE_TOKENS_PER_CHUNK : m->N;
    for (int64_t t = t0; t < t1; t++) {
        int64_t q[64]; /* this token's places in y, ascending; -1: slot served elsewhere */
        int64_t n = 0;
        for (int64_t j = 0; j < k; j++) {
            const int64_t p = m->pos[t * k + j];
            if (p < 0) continue;
            int64_t i = n++;
            for (; i > 0 && q[i - 1] > p; i--) q[i] = q[i - 1];
            q[i] = p;
        }
        float *o = m->out + t * H;
        for (int64_t i = 0; i < n; i++) {
            const float w = m->weights[m->order[q[i]]];
            const float *y = m->y + q[i] * H;
            for (int64_t c = 0; c < H; c++) o[c] += y[c] * w;
        }
    }
}

/* Routed experts of one MoE layer: out[t] = sum_j weights[t, j] * FFN_e(x[t]) over the slots j
 * with e = expert_ids[t, j] in [0, E) (-1: served elsewhere, skipped), where
 * FFN_e(v) = (silu(v W1_e) * (v W3_e)) W2_e. Weights pre-transposed for row-major GEMMs:
 * w13t [E, H, 2I] (gate columns, then up), w2t [E, I, H]. x [N, H] with rows x_st floats
 * apart (a received message's rows, read in place), out [N, H] contiguous.
 * Pairs are grouped by expert (counting sort, stable); the experts run in parallel, each on its
 * gathered rows, and then each token's outputs are added into out in ascending expert order
 * (fused_moe_ref's order of the sums), so the threads do not change a bit of the result.
 * out must hold zeros. Returns 0; -1 if scratch memory could not be allocated; -2 for an expert
 * id >= E; -5 for k > 64 (nothing computed for either). */
int splitmoe_fused_moe_f32(const float *x, int64_t x_st, int64_t N, int64_t H, const float *w13t,
                           const float *w2t, int64_t E, int64_t I, const int64_t *expert_ids,
                           const float *weights, int64_t k, float *out) {
    if (k > 64) return -5;
    for (int64_t p = 0; p < N * k; p++)
        if (expert_ids[p] >= E) return -2;
    const int64_t threads = pool.threads;
    int64_t *index = calloc((size_t)(E + 1 + E + 2 * N * k + E + 1), sizeof(int64_t));
    if (!index) return -1;
    int64_t *start = index, *fill = start + E + 1, *order = fill + E, *pos = order + N * k;
    int64_t *experts = pos + N * k;
    for (int64_t p = 0; p < N * k; p++)
        if (expert_ids[p] >= 0) start[expert_ids[p] + 1]++;
    int64_t max_rows = 0, active = 0;
    for (int64_t e = 0; e < E; e++) {
        if (start[e + 1] > max_rows) max_rows = start[e + 1];
        if (start[e + 1]) experts[active++] = e;
        start[e + 1] += start[e];
    }
    memcpy(fill, start, sizeof(int64_t) * (size_t)E);
    for (int64_t p = 0; p < N * k; p++) {
        pos[p] = expert_ids[p] >= 0 ? fill[expert_ids[p]]++ : -1;
        if (pos[p] >= 0) order[pos[p]] = p;
    }
    const int64_t scratch_st = max_rows * (H + 3 * I);
    float *y = malloc(sizeof(float) * (size_t)(start[E] * H + threads * scratch_st + 1));
    if (!y) {
        free(index);
        return -1;
    }
    struct fused_moe m = {x,     x_st,  N,   H,       I, k, w13t, w2t, weights, start, order,
                          pos,   experts, y, y + start[E] * H, scratch_st, out};
    parallel_for(active, fused_moe_expert, &m);
    parallel_for(chunks_of(N, MOE_TOKENS_PER_CHUNK), fused_moe_sum, &m);
    free(index);
    free(y);
    return 0;
}

/* splitmoe_fused_moe_f32 on a received message's packed rows, read in place: row t holds x[t]
 * (H floats), then its k int32 local expert ids, then its k float32 weights (the transport's
 * row layout, splitmoe/comm/transport.py), row_bytes = 4 H + 8 k apart. Returns as
 * splitmoe_fused_moe_f32 does. */
int splitmoe_fused_moe_rows_f32(const uint8_t *rows, int64_t N, int64_t H, const float *w13t,
                                const float *w2t, int64_t E, int64_t I, int64_t k, float *out) {
    if (k > 64) return -5;
    const int64_t row_bytes = 4 * H + 8 * k;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(N * k + 1));
    float *weights = malloc(sizeof(float) * (size_t)(N * k + 1));
    if (!ids || !weights) {
        free(ids);
        free(weights);
        return -1;
    }
    for (int64_t t = 0; t < N; t++) {
        const uint8_t *row = rows + t * row_bytes + 4 * H;
        for (int64_t j = 0; j < k; j++) {
            int32_t id;
            memcpy(&id, row + 4 * j, 4);
            ids[t * k + j] = id;
            memcpy(&weights[t * k + j], row + 4 * (k + j), 4);
        }
    }
    const int rc = splitmoe_fused_moe_f32((const float *)rows, row_bytes / 4, N, H, w13t, w2t, E,
                                          I, ids, weights, k, out);
    free(ids);
    free(weights);
    return rc;
}

/* ---- router and KV store -------------------------------------------------------------------- */

/* Top-k routing of rows of router logits [T, E] (contiguous): the k largest logits of each row
 * (descending; ties to the lower expert id), their softmax probabilities over all E experts
 * computed in float32, renormalised to sum to 1 when renorm is set. ids [T, k] int64, weights
 * [T, k] float32. k <= E <= 4096. Returns 0, or -1 for a bad k / E. */
int splitmoe_route_f32(const float *logits, int64_t T, int64_t E, int64_t k, int renorm,
                       int64_t *ids, float *weights) {
    if (k < 1 || k > E || E > 4096) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *row = logits + t * E;
        int64_t *id = ids + t * k;
        float *w = weights + t * k;
        for (int64_t j = 0; j < k; j++) { /* insertion into the sorted top-k so far */
            id[j] = -1;
            w[j] = -INFINITY;
        }
        for (int64_t e = 0; e < E; e++) {
            const float v = row[e];
            if (!(v > w[k - 1])) continue; /* (NaN never enters) */
            int64_t j = k - 1;
            for (; j > 0 && v > w[j - 1]; j--) {
                w[j] = w[j - 1];
                id[j] = id[j - 1];
            }
            w[j] = v;
            id[j] = e;
        }
        const float m = w[0];
        float total = 0.0f;
        for (int64_t e = 0; e < E; e++) total += exp_nonpositive(row[e] - m);
        float kept = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            w[j] = exp_nonpositive(w[j] - m) / total;
            kept += w[j];
        }
        if (renorm)
            for (int64_t j = 0; j < k; j++) w[j] /= kept;
    }
    return 0;
}

/* Writes this step's keys and values into their cache slots: k[t, :, :] at k + t * k_st (nkv
 * heads of d, contiguous), likewise v; caches [num_slots, nkv, d] contiguous. Returns 0, or -1
 * (nothing written) for a slot outside 0..num_slots-1. */
static void store_kv(const float *k, int64_t k_st, const float *v, int64_t v_st, float *k_cache,
                     float *v_cache, const int64_t *slots, int64_t T, int64_t slot_elems) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + slots[t] * slot_elems, k + t * k_st, sizeof(float) * (size_t)slot_elems);
        memcpy(v_cache + slots[t] * slot_elems, v + t * v_st, sizeof(float) * (size_t)slot_elems);
    }
}

static int slots_fit(const int64_t *slots, int64_t T, int64_t num_slots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 0;
    return 1;
}

int splitmoe_store_kv_f32(const float *k, int64_t k_st, const float *v, int64_t v_st,
                          float *k_cache, float *v_cache, const int64_t *slots, int64_t T,
                          int64_t slot_elems, int64_t num_slots) {
    if (!slots_fit(slots, T, num_slots)) return -1; /* nothing written */
    store_kv(k, k_st, v, v_st, k_cache, v_cache, slots, T, slot_elems);
    return 0;
}

/* ---- dispatch rows -------------------------------------------------------------------------- */

/* The rows an attention rank dispatches (Transport.route + Transport.pack): one row per (token,
 * distinct destination expert rank), grouped by destination (ascending), tokens ascending within
 * a destination. A row is the token's x bytes (x_row_bytes), then k int32 local slot ids (-1 for
 * slots on other ranks), then the token's k float32 router weights. slots [T, k] int64 (slot of
 * each (token, expert)); slot_rank / slot_local [num_slots]: the expert rank and local id of each
 * slot. Writes rows [P, row_bytes] and token_index [P] (P <= T * min(k, R)) and counts [R];
 * returns P, or -1 for a slot id out of range / a rank >= R. */
int64_t splitmoe_route_pack(const int64_t *slots, int64_t T, int64_t k, const int64_t *slot_rank,
                            const int64_t *slot_local, int64_t num_slots, int64_t R,
                            const uint8_t *x, int64_t x_row_bytes, const float *weights,
                            uint8_t *rows, int64_t *token_index, int64_t *counts) {
    const int64_t row_bytes = x_row_bytes + 8 * k;
    memset(counts, 0, sizeof(int64_t) * (size_t)R);
    for (int64_t t = 0; t < T; t++) /* rows per destination: a rank counts once per token */
        for (int64_t j = 0; j < k; j++) {
            const int64_t s = slots[t * k + j];
            if (s < 0 || s >= num_slots || slot_rank[s] < 0 || slot_rank[s] >= R) return -1;
            int seen = 0;
            for (int64_t i = 0; i < j; i++) seen |= slot_rank[slots[t * k + i]] == slot_rank[s];
            if (!seen) counts[slot_rank[s]]++;
        }
    int64_t *at = malloc(sizeof(int64_t) * (size_t)(R + 1));
    if (!at) return -2;
    at[0] = 0;
    for (int64_t r = 0; r < R; r++) at[r + 1] = at[r] + counts[r];
    const int64_t P = at[R];
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t r = slot_rank[slots[t * k + j]];
            int seen = 0;
            for (int64_t i = 0; i < j; i++) seen |= slot_rank[slots[t * k + i]] == r;
            if (seen) continue;
            const int64_t p = at[r]++;
            uint8_t *row = rows + p * row_bytes;
            token_index[p] = t;
            memcpy(row, x + t * x_row_bytes, (size_t)x_row_bytes);
            int32_t ids[64];
            for (int64_t i = 0; i < k; i++) {
                const int64_t si = slots[t * k + i];
                ids[i] = slot_rank[si] == r ? (int32_t)slot_local[si] : -1;
            }
            memcpy(row + x_row_bytes, ids, sizeof(int32_t) * (size_t)k);
            memcpy(row + x_row_bytes + 4 * k, weights + t * k, sizeof(float) * (size_t)k);
        }
    free(at);
    return P;
}

/* ---- a decode layer's attention half -------------------------------------------------------- */

/* The attention half of one decoder layer for T one-token sequences (a decode step), in one
 * call: the per-op calls it replaces cost more than their arithmetic at decode batch sizes.
 * In place on the residual stream h [T, H] (contiguous):
 *   x = RMSNorm(h) * in_norm;  qkv = x Wqkv (+ b_qkv);  q and k heads RMSNormed per head with
 *   qk_norm_w [nh + nkv, d] (NULL: none) and rotated (cos / sin rows at t * cs_st, as
 *   splitmoe_norm_rope_f32);  k, v stored at slots[t];  o = decode attention of sequence t
 *   (seq_lens[t] keys through block_tables row t);  h += o Wo;  x_out = RMSNorm(h) * post_norm;
 *   with a router (router_t not NULL): top-k of x_out Wr -> ids / weights [T, k], as
 *   splitmoe_route_f32.
 * Weights transposed for row-major GEMMs: wqkv_t [H, (nh + 2 nkv) d], wo_t [nh d, H],
 * router_t [H, E]. The same steps, in the same order, as the per-op kernels.
 * Returns 0; -1 if scratch memory could not be allocated; -3 for a block table, sequence length
 * or slot that does not fit the cache, -5 for a bad k / E (nothing written for either). */
struct decode_layer {
    float *h;
    int64_t H;
    const float *in_norm, *post_norm;
    float eps;
    const float *wqkv_t, *b_qkv, *qk_norm_w, *cos_t, *sin_t;
    int64_t cs_st;
    float *k_cache, *v_cache;
    int64_t block_size;
    const int32_t *block_tables;
    int64_t table_st;
    const int64_t *seq_lens, *slots;
    int64_t max_len, nh, nkv, d;
    float scale;
    const float *wo_t, *router_t;
    int64_t E, k;
    int renorm;
    float *x_out;
    int64_t *ids;
    float *weights;
    int64_t rows_per_chunk, T_rows;
    _Atomic int rc; /* the first chunk's error */
};

/* The layer for rows r0 .. r0 + T - 1 (tables already checked). Each row's arithmetic is the
 * same whichever rows share the call: the GEMM tiles compute every element in the same order. */
static int decode_layer_rows(const struct decode_layer *a, int64_t r0, int64_t T) {
    const int64_t H = a->H, d = a->d, nh = a->nh, nkv = a->nkv, E = a->router_t ? a->E : 0;
    const int64_t nq = nh * d, nqkv = (nh + 2 * nkv) * d;
    float *h = a->h + r0 * H, *x_out = a->x_out + r0 * H;
    float *qkv = malloc(sizeof(float) * (size_t)(T * (nqkv + nq + H + E) + 1));
    if (!qkv) return -1;
    float *o = qkv + T * nqkv, *proj = o + T * nq, *logits = proj + T * H;
    int rc = 0;
    splitmoe_rms_norm_f32(h, H, 0, T, 1, H, a->in_norm, 0, a->eps, x_out, H, 0);
    gemm(x_out, H, a->wqkv_t, nqkv, qkv, nqkv, T, nqkv, H);
    if (a->b_qkv)
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = 0; c < nqkv; c++) qkv[t * nqkv + c] += a->b_qkv[c];
    rc = splitmoe_norm_rope_f32(qkv, nqkv, d, T, nh + nkv, d, a->qk_norm_w, d, a->eps,
                                a->cos_t + r0 * a->cs_st, a->sin_t + r0 * a->cs_st, a->cs_st);
    if (rc) goto done;
    store_kv(qkv + nq, nqkv, qkv + nq + nkv * d, nqkv, a->k_cache, a->v_cache, a->slots + r0, T,
             nkv * d);
    rc = decode_attention(qkv, nqkv, d, a->k_cache, a->v_cache, a->block_tables + r0 * a->table_st,
                          a->table_st, a->seq_lens + r0, NULL, NULL, T, a->max_len, nh, nkv, d,
                          a->block_size, a->scale, o, nq, d);
    if (rc) goto done;
    gemm(o, nq, a->wo_t, H, proj, H, T, H, nq);
    for (int64_t i = 0; i < T * H; i++) h[i] += proj[i];
    splitmoe_rms_norm_f32(h, H, 0, T, 1, H, a->post_norm, 0, a->eps, x_out, H, 0);
    if (a->router_t) {
        gemm(x_out, H, a->router_t, E, logits, E, T, E, H);
        rc = splitmoe_route_f32(logits, T, E, a->k, a->renorm, a->ids + r0 * a->k,
                                a->weights + r0 * a->k);
    }
done:
    free(qkv);
    return rc;
}

static void decode_layer_chunk(void *ctx, int64_t chunk, int thread) {
    (void)thread;
    struct decode_layer *a = ctx;
    const int64_t r0 = chunk * a->rows_per_chunk, rows = a->rows_per_chunk;
    const int rc = decode_layer_rows(a, r0, rows < a->T_rows - r0 ? rows : a->T_rows - r0);
    int ok = 0;
    if (rc) atomic_compare_exchange_strong(&a->rc, &ok, rc);
}

/* The layer for all a->T_rows rows on the pool's threads, in chunks of 8 rows (4 below 32 rows):
 * two GEMM tiles of rows each, several chunks per thread so that sequences of unequal lengths
 * even out. On one thread, one chunk: each weight is then read once per call, not once per chunk
 * (1.02-1.03x at 16-32 rows; the same bits, as chunks do not change a row's arithmetic).
 * Returns the first chunk's error (0: none). */
static int decode_layer_run(struct decode_layer *a) {
    a->rows_per_chunk = pool.threads < 2 ? a->T_rows : a->T_rows < 32 ? 4 : 8;
    parallel_for(chunks_of(a->T_rows, a->rows_per_chunk), decode_layer_chunk, a);
    return a->rc;
}

int splitmoe_decode_layer_f32(float *h, int64_t T, int64_t H, const float *in_norm,
                              const float *post_norm, float eps, const float *wqkv_t,
                              const float *b_qkv, const float *qk_norm_w, const float *cos_t,
                              const float *sin_t, int64_t cs_st, float *k_cache, float *v_cache,
                              int64_t num_blocks, int64_t block_size,
                              const int32_t *block_tables, int64_t table_st,
                              int64_t table_width, const int64_t *seq_lens,
                              const int64_t *slots, int64_t nh, int64_t nkv, int64_t d,
                              float scale, const float *wo_t, const float *router_t, int64_t E,
                              int64_t k, int renorm, float *x_out, int64_t *ids,
                              float *weights) {
    if (router_t && (k < 1 || k > E || E > 4096)) return -5;
    const int64_t max_len = check_tables(block_tables, table_st, table_width, num_blocks,
                                         seq_lens, NULL, T, block_size);
    if (max_len < 0 || !slots_fit(slots, T, num_blocks * block_size)) return -3;
    struct decode_layer a = {
        h, H, in_norm, post_norm, eps, wqkv_t, b_qkv, qk_norm_w, cos_t, sin_t, cs_st, k_cache,
        v_cache, block_size, block_tables, table_st, seq_lens, slots, max_len, nh, nkv, d, scale,
        wo_t, router_t, E, k, renorm, x_out, ids, weights, 0, T, 0};
    return decode_layer_run(&a);
}

/* ---- a whole decode step (colocated) -------------------------------------------------------- */

/* logits[t, v] = x[t, :] . w[v, :] for x [T, H], w [V, H] (an LM head as stored, [vocab, hidden];
 * all contiguous): 16 dot products at a time, 4 rows x 4 vocab rows, each in 16 lanes (H % 16
 * zero-padded) reduced by sum_lanes16. A tile past the last row or vocab row repeats its last
 * one and stores only the real ones, so each element is computed the same way wherever it falls
 * and whatever the thread count. Chunks of LM_HEAD_VOCAB vocab rows; within a chunk the 4 vocab
 * rows of a tile stay in L1 while the rows of x stream past (w is read from memory once). */
#define LM_HEAD_VOCAB 64

struct lm_head {
    const float *x, *w;
    float *logits;
    int64_t T, V, H;
};

static void lm_head_chunk(void *ctx, int64_t chunk, int thread) {
    (void)thread;
    const struct lm_head *a = ctx;
    const int64_t T = a->T, V = a->V, H = a->H, v1 = (chunk + 1) * LM_HEAD_VOCAB;
    for (int64_t v0 = chunk * LM_HEAD_VOCAB; v0 < (v1 < V ? v1 : V); v0 += 4) {
        const float *w[4];
        for (int j = 0; j < 4; j++) w[j] = a->w + (v0 + j < V ? v0 + j : V - 1) * H;
        for (int64_t t0 = 0; t0 < T; t0 += 4) {
            const float *x[4];
            for (int i = 0; i < 4; i++) x[i] = a->x + (t0 + i < T ? t0 + i : T - 1) * H;
            v16f acc[16];
            for (int j = 0; j < 16; j++) acc[j] = (v16f){0};
            int64_t p = 0;
            for (; p + 16 <= H; p += 16) {
                v16f wv[4];
                for (int j = 0; j < 4; j++) wv[j] = load16(w[j] + p);
                for (int i = 0; i < 4; i++) {
                    const v16f xv = load16(x[i] + p);
                    for (int j = 0; j < 4; j++) acc[4 * i + j] += xv * wv[j];
                }
            }
            if (p < H) { /* the last H % 16, zero-padded */
                float pad[8][16] = {{0}};
                for (int j = 0; j < 4; j++) memcpy(pad[j], w[j] + p, sizeof(float) * (size_t)(H - p));
                for (int i = 0; i < 4; i++)
                    memcpy(pad[4 + i], x[i] + p, sizeof(float) * (size_t)(H - p));
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) acc[4 * i + j] += load16(pad[4 + i]) * load16(pad[j]);
            }
            float out[16];
            store16(out, sum_lanes16(acc));
            for (int i = 0; i < 4 && t0 + i < T; i++)
                for (int j = 0; j < 4 && v0 + j < V; j++)
                    a->logits[(t0 + i) * V + v0 + j] = out[4 * i + j];
        }
    }
}

/* logits [T, V] = x [T, H] times w [V, H] transposed (see lm_head_chunk), on the pool's threads;
 * bit-identical for every thread count. */
void splitmoe_lm_head_f32(const float *x, int64_t T, int64_t H, const float *w, int64_t V,
                          float *logits) {
    struct lm_head m = {x, w, logits, T, V, H};
    parallel_for(chunks_of(V, LM_HEAD_VOCAB), lm_head_chunk, &m);
}

/* The addresses of one MoE decoder layer's weights, in the layouts of splitmoe_decode_layer_f32
 * (b_qkv and qk_norm_w may be NULL) and splitmoe_fused_moe_f32. The Python side passes a table
 * of them as int64 [L, 9]. */
struct step_layer {
    const float *in_norm, *post_norm, *wqkv_t, *b_qkv, *qk_norm_w, *wo_t, *router_t, *w13t, *w2t;
};
_Static_assert(sizeof(struct step_layer) == 9 * sizeof(int64_t), "a step layer is 9 addresses");

/* A whole decode step of T one-token sequences of a model whose L layers are all MoE layers
 * with every expert here (colocated), in one call: the per-layer calls, their wrappers and the
 * LM head in PyTorch cost as much as the layers' arithmetic at decode batch sizes.
 *   h = embed[input_ids];  per layer l: splitmoe_decode_layer_f32 (the attention half and the
 *   router; K / V of layer l at kv + l * kv_layer_st, V at + kv_v_off), then
 *   h += splitmoe_fused_moe_f32 (the routed experts);  logits [T, V] = RMSNorm(h) * final_norm
 *   times lm_head [V, H] transposed.
 * The same kernels in the same order as those calls, so h is bit-identical to theirs; the LM
 * head is its own (see lm_head_chunk). Block tables and slots are checked once for all layers.
 * Returns 0; -1 if scratch memory could not be allocated; -2 for a token id outside 0..V-1;
 * -3 for a block table, sequence length or slot that does not fit the cache; -5 for a bad
 * k / E (nothing written for -2, -3, -5). */
int splitmoe_decode_step_f32(const int64_t *input_ids, int64_t T, const float *embed, int64_t V,
                             int64_t H, const struct step_layer *layers, int64_t L, float eps,
                             const float *cos_t, const float *sin_t, int64_t cs_st, float *kv,
                             int64_t kv_layer_st, int64_t kv_v_off, int64_t num_blocks,
                             int64_t block_size, const int32_t *block_tables, int64_t table_st,
                             int64_t table_width, const int64_t *seq_lens, const int64_t *slots,
                             int64_t nh, int64_t nkv, int64_t d, float scale, int64_t E,
                             int64_t k, int renorm, int64_t I, const float *final_norm,
                             const float *lm_head, float *logits) {
    if (k < 1 || k > E || E > 4096 || k > 64) return -5;
    for (int64_t t = 0; t < T; t++)
        if (input_ids[t] < 0 || input_ids[t] >= V) return -2;
    const int64_t max_len = check_tables(block_tables, table_st, table_width, num_blocks,
                                         seq_lens, NULL, T, block_size);
    if (max_len < 0 || !slots_fit(slots, T, num_blocks * block_size)) return -3;
    float *h = malloc(sizeof(float) * (size_t)(3 * T * H + T * k + 1));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(T * k + 1));
    if (!h || !ids) {
        free(h);
        free(ids);
        return -1;
    }
    float *x = h + T * H, *moe = x + T * H, *weights = moe + T * H;
    for (int64_t t = 0; t < T; t++)
        memcpy(h + t * H, embed + input_ids[t] * H, sizeof(float) * (size_t)H);
    int rc = 0;
    for (int64_t l = 0; l < L && !rc; l++) {
        const struct step_layer *w = &layers[l];
        float *k_cache = kv + l * kv_layer_st;
        struct decode_layer a = {
            h, H, w->in_norm, w->post_norm, eps, w->wqkv_t, w->b_qkv, w->qk_norm_w, cos_t, sin_t,
            cs_st, k_cache, k_cache + kv_v_off, block_size, block_tables, table_st, seq_lens,
            slots, max_len, nh, nkv, d, scale, w->wo_t, w->router_t, E, k, renorm, x, ids,
            weights, 0, T, 0};
        rc = decode_layer_run(&a);
        if (rc) break;
        memset(moe, 0, sizeof(float) * (size_t)(T * H));
        rc = splitmoe_fused_moe_f32(x, H, T, H, w->w13t, w->w2t, E, I, ids, weights, k, moe);
        for (int64_t i = 0; i < T * H; i++) h[i] += moe[i];
    }
    if (!rc) {
        splitmoe_rms_norm_f32(h, H, 0, T, 1, H, final_norm, 0, eps, x, H, 0);
        splitmoe_lm_head_f32(x, T, H, lm_head, V, logits);
    }
    free(h);
    free(ids);
    return rc;
}

/* ---- shared-memory rings: the fast path of splitmoe.comm.shm ------------------------------- */

/* The layout is splitmoe/comm/shm.py's: a ring is a 128-byte header (int64 write position at
 * +0, read position at +64, "the writer sleeps on a full ring" at +104) followed by cap data
 * bytes; a frame is its int64 byte length, then the bytes. Positions only grow; the low 32 bits
 * of each are the futex word its waiter sleeps on (shared futexes: the rings live in files).
 * These calls never sleep: a send that does not fit now, or a frame that has not arrived within
 * the spin, is left to the Python side, which waits by the module's rules (the progress rule,
 * futex sleeps, the peer's liveness, the timeout). In Python each frame costs ~8 us of interpreter
 * work per side; here well under one. */
#define RING_HEADER 128
#define RING_W 0      /* int64 index of the write position */
#define RING_R 8      /* of the read position */
#define RING_SLEEPS 13 /* of the writer's "wake me when you read" flag */

static void ring_wake(int64_t *position) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)position, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
#else
    (void)position;
#endif
}

static void ring_put(uint8_t *data, int64_t cap, int64_t at, const void *src, int64_t n) {
    const int64_t off = at % cap, first = n < cap - off ? n : cap - off;
    memcpy(data + off, src, (size_t)first);
    if (n > first) memcpy(data, (const uint8_t *)src + first, (size_t)(n - first));
}

static void ring_get(const uint8_t *data, int64_t cap, int64_t at, void *dst, int64_t n) {
    const int64_t off = at % cap, first = n < cap - off ? n : cap - off;
    memcpy(dst, data + off, (size_t)first);
    if (n > first) memcpy((uint8_t *)dst + first, data, (size_t)(n - first));
}

/* Appends the frame of src[0, n) to the ring at base if all of it fits now: one publish of the
 * write position, then a wake of the reader's futex. Returns 1, or 0 (nothing written) when the
 * ring lacks room. Only the ring's one writer calls it. */
int splitmoe_ring_send(uint8_t *base, int64_t cap, const uint8_t *src, int64_t n) {
    int64_t *pos = (int64_t *)base;
    uint8_t *data = base + RING_HEADER;
    const int64_t w = pos[RING_W];
    const int64_t r = __atomic_load_n(&pos[RING_R], __ATOMIC_ACQUIRE);
    if (cap - (w - r) < 8 + n) return 0;
    ring_put(data, cap, w, &n, 8);
    ring_put(data, cap, w + 8, src, n);
    __atomic_store_n(&pos[RING_W], w + 8 + n, __ATOMIC_RELEASE);
    ring_wake(&pos[RING_W]);
    return 1;
}

/* The byte length of the ring's next frame once all of it has arrived, polling for up to
 * spin_ns; -1 if it has not, or cannot (a frame larger than the ring arrives in pieces, which the
 * Python side reads as they come). Nothing is consumed either way. */
int64_t splitmoe_ring_peek(uint8_t *base, int64_t cap, int64_t spin_ns) {
    int64_t *pos = (int64_t *)base;
    const uint8_t *data = base + RING_HEADER;
    const int64_t r = pos[RING_R];
    int64_t deadline = 0;
    for (int64_t polls = 0;; polls++) {
        const int64_t avail = __atomic_load_n(&pos[RING_W], __ATOMIC_ACQUIRE) - r;
        if (avail >= 8) {
            int64_t n;
            ring_get(data, cap, r, &n, 8);
            if (n < 0 || n > cap - 8) return -1; /* never whole here: the Python side streams it */
            if (avail >= 8 + n) return n;
        }
        if ((polls & 63) == 0) {
            const int64_t now = now_ns();
            if (polls == 0) deadline = now + spin_ns;
            else if (now >= deadline) return -1;
        }
        cpu_relax();
    }
}

/* Takes the ring's next frame into dst if it has arrived whole within spin_ns and is n bytes
 * long: returns n; -1 if it has not arrived (nothing consumed); -2 if it is not n bytes long
 * (nothing consumed: the caller reports the diverged calls). Frees the room for the writer and
 * wakes it if it sleeps on a full ring. Only the ring's one reader calls it. */
int64_t splitmoe_ring_recv(uint8_t *base, int64_t cap, uint8_t *dst, int64_t n, int64_t spin_ns) {
    const int64_t got = splitmoe_ring_peek(base, cap, spin_ns);
    if (got < 0) return -1;
    if (got != n) return -2;
    int64_t *pos = (int64_t *)base;
    const int64_t r = pos[RING_R];
    ring_get(base + RING_HEADER, cap, r + 8, dst, n);
    __atomic_store_n(&pos[RING_R], r + 8 + n, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the store above before the flag's load */
    if (__atomic_load_n(&pos[RING_SLEEPS], __ATOMIC_RELAXED)) {
        pos[RING_SLEEPS] = 0;
        ring_wake(&pos[RING_R]);
    }
    return n;
}

/* ---- dispatch, routed and sent in one call -------------------------------------------------- */

/* An attention rank's whole dispatch of one MoE layer under a fixed expert -> slot map (the
 * static balancer), in one call where Python's separate steps cost more than their work at
 * decode batch sizes: the slot of each (token, expert) of ids [T, k] (expert ids in 0..E-1)
 * through expert_slot [E] (NULL: the expert id itself), each pair added to load [E] (NULL: not
 * counted), splitmoe_route_pack's rows, and one frame per expert rank r sent on its
 * shared-memory ring (rings[r]: the ring's base address, cap data bytes; an empty frame where it
 * gets no rows), as splitmoe_ring_send. sent[r] = 1 for each frame sent, 0 where the ring lacked
 * room: the caller sends those frames (rows grouped by destination, counts[r] of them each).
 * Returns P, -1 for an expert id or slot out of range (nothing counted, nothing sent), -2 if
 * scratch memory could not be allocated. */
int64_t splitmoe_dispatch_send(const int64_t *ids, int64_t T, int64_t k, const int64_t *expert_slot,
                               int64_t E, int64_t *load, const int64_t *slot_rank,
                               const int64_t *slot_local, int64_t num_slots, int64_t R,
                               const uint8_t *x, int64_t x_row_bytes, const float *weights,
                               uint8_t *rows, int64_t *token_index, int64_t *counts,
                               const int64_t *rings, int64_t cap, int64_t *sent) {
    int64_t stack_slots[1024];
    int64_t *slots = T * k <= 1024 ? stack_slots : malloc(sizeof(int64_t) * (size_t)(T * k));
    if (!slots) return -2;
    for (int64_t i = 0; i < T * k; i++) {
        const int64_t e = ids[i];
        if (e < 0 || e >= E) {
            if (slots != stack_slots) free(slots);
            return -1;
        }
        slots[i] = expert_slot ? expert_slot[e] : e;
    }
    const int64_t P = splitmoe_route_pack(slots, T, k, slot_rank, slot_local, num_slots, R, x,
                                          x_row_bytes, weights, rows, token_index, counts);
    if (slots != stack_slots) free(slots);
    if (P < 0) return P;
    if (load)
        for (int64_t i = 0; i < T * k; i++) load[ids[i]]++;
    const int64_t row_bytes = x_row_bytes + 8 * k;
    int64_t at = 0;
    for (int64_t r = 0; r < R; r++) {
        sent[r] = splitmoe_ring_send((uint8_t *)(intptr_t)rings[r], cap, rows + at * row_bytes,
                                     counts[r] * row_bytes);
        at += counts[r];
    }
    return P;
}

/* ---- a decode micro-batch's layers with the experts on other ranks -------------------------- */

/* An attention rank's decode step when the routed experts live on expert ranks reached over
 * shared-memory rings (attention-FFN disaggregation), one call per (layer, micro-batch): the
 * unit the ping-pong pipeline interleaves. At decode batch sizes the Python around the per-layer
 * kernels (the combine's frames and sums, the decode layer's wrapper, the dispatch's routing
 * and bookkeeping) cost about as much as the kernels did.
 *
 * The rank's model, cache and rings, set once (and the per-layer maps between steps): */
struct remote_model {
    const struct step_layer *layers; /* [L] (w13t / w2t unused) */
    int64_t L, H, nh, nkv, d, E, k, renorm, V;
    double eps, scale;
    const float *embed, *final_norm, *lm_head;
    float *kv;                     /* the paged pool: layer l's K at kv + l * kv_layer_st */
    int64_t kv_layer_st, kv_v_off; /* its V at K + kv_v_off */
    int64_t num_blocks, block_size;
    const int64_t *expert_slot; /* [L] addresses of each layer's expert -> slot map [E] (0: id) */
    const int64_t *load;        /* [L] addresses of each layer's load counts [E] (0: none) */
    const int64_t *slot_rank, *slot_local;
    int64_t num_slots, R;
    const int64_t *rings_out; /* [R] the ring towards each expert rank (dispatch) */
    const int64_t *rings_in;  /* [R] the ring from each expert rank (partial sums) */
    const int64_t *staged_in; /* [R] the address of the count (int64) of bytes from each one
                                 that the Python side moved into staging while it waited */
    int64_t cap_out, cap_in, spin_ns;
};

/* One micro-batch of a step: its T one-token sequences (as splitmoe_decode_step_f32 takes
 * them), the buffers its calls share (Pmax = T * min(k, R) rows), and what carries from one
 * call to the next. */
struct remote_batch {
    const struct remote_model *m;
    int64_t T;
    /* the step's inputs: each sequence's token, its position (the tokens before it in the
     * cache) and its block table row; the RoPE table (rows 0 .. rope_rows - 1, d floats each) */
    const int64_t *input_ids, *positions;
    const int32_t *block_tables;
    int64_t table_st, table_width;
    const float *rope_cos, *rope_sin;
    int64_t rope_rows;
    /* derived from them at layer 0: [T, d] RoPE rows (cs_st = d, set once), [T] lengths and KV
     * slots */
    float *cos_t, *sin_t;
    int64_t cs_st;
    int64_t *seq_lens, *slots;
    float *h, *x, *weights, *partial, *sum; /* [T, H], [T, H], [T, k], [Pmax, H], [T, H] */
    int64_t *ids, *token_index;             /* [T, k], [Pmax] */
    uint8_t *rows;                          /* [Pmax, H * 4 + 8 k] */
    int64_t *counts;                        /* [L, R]: each layer's rows per expert rank */
    int64_t *sent, *got;                    /* [R]: the last dispatch's frames sent, partial
                                               sums received */
    int64_t *stamps;                        /* [L + 1, 4] ns (see splitmoe_remote_layer) */
    float *logits;                          /* [T, V] */
    int64_t max_len, P, pending, waiting, wait_rank;
};

/* Call `layer` of a micro-batch, layer = 0 .. L (L: the last one's combine and the logits):
 *   1. (layer > 0) the combine of layer - 1: each expert rank's frame of partial sums (as many
 *      rows as it was sent) from its ring, then h += their sum per token (the rows of a token in
 *      rank order onto zeros, as torch's index_add_ does; a rank's rows as they are where one
 *      rank got every token), the same bits as FlatTransport.combine and the residual add;
 *   2. (layer < L) the decode layer (splitmoe_decode_layer_f32's steps; layer 0 first takes the
 *      embedding rows), then splitmoe_dispatch_send of x and the top-k under the layer's map;
 *   3. (layer = L) logits = RMSNorm(h) * final_norm times lm_head, as splitmoe_decode_step_f32.
 * stamps[layer] gets the clock (CLOCK_MONOTONIC ns, time.perf_counter's) at the call's start,
 * once the combine is done, the layer is done and the dispatch is done.
 * Returns 0 when done; 1 when the frame from expert rank wait_rank has not arrived within the
 * spin, or begins with bytes the Python side staged (nothing else received is lost: got[] marks
 * the frames taken; the caller receives that one into partial, sets got[wait_rank] and calls
 * again); 2 when done but some frames did not
 * fit their rings (sent[r] = 0: the caller sends them); -1 out of scratch memory; -2 a token id
 * outside 0..V-1; -3 a position or block table that does not fit the cache or the RoPE table;
 * -5 an expert id or slot out of range; -6 the frame from wait_rank is not the size expected (nothing
 * consumed: the caller reports the diverged calls). Before any work for -2 and -3. */
int64_t splitmoe_remote_layer(struct remote_batch *b, int64_t layer) {
    const struct remote_model *m = b->m;
    const int64_t T = b->T, H = m->H, R = m->R, k = m->k;
    int64_t *stamps = b->stamps + 4 * layer;
    if (!b->waiting) stamps[0] = now_ns();
    if (layer == 0) { /* the inputs' checks; each sequence's length, KV slot and RoPE rows */
        const int64_t d = m->d, bs = m->block_size;
        for (int64_t t = 0; t < T; t++)
            if (b->input_ids[t] < 0 || b->input_ids[t] >= m->V) return -2;
        for (int64_t t = 0; t < T; t++) {
            if (b->positions[t] < 0 || b->positions[t] >= b->rope_rows) return -3;
            b->seq_lens[t] = b->positions[t] + 1;
        }
        /* (every block up to each position exists, so each slot lies in the cache) */
        b->max_len = check_tables(b->block_tables, b->table_st, b->table_width, m->num_blocks,
                                  b->seq_lens, NULL, T, bs);
        if (b->max_len < 0) return -3;
        for (int64_t t = 0; t < T; t++) {
            const int64_t pos = b->positions[t];
            b->slots[t] = (int64_t)b->block_tables[t * b->table_st + pos / bs] * bs + pos % bs;
            memcpy(b->cos_t + t * d, b->rope_cos + pos * d, sizeof(float) * (size_t)d);
            memcpy(b->sin_t + t * d, b->rope_sin + pos * d, sizeof(float) * (size_t)d);
        }
        for (int64_t t = 0; t < T; t++)
            memcpy(b->h + t * H, m->embed + b->input_ids[t] * H, sizeof(float) * (size_t)H);
        b->pending = 0;
    }
    if (b->pending) {
        const int64_t *counts = b->counts + (layer - 1) * R;
        int64_t at = 0, most = 0;
        for (int64_t r = 0; r < R; r++) {
            const int64_t n = counts[r];
            if (n && !b->got[r]) {
                if (*(const int64_t *)(intptr_t)m->staged_in[r]) { /* the frame starts there */
                    b->wait_rank = r;
                    b->waiting = 1;
                    return 1;
                }
                const int64_t got = splitmoe_ring_recv(
                    (uint8_t *)(intptr_t)m->rings_in[r], m->cap_in,
                    (uint8_t *)(b->partial + at * H), n * H * (int64_t)sizeof(float), m->spin_ns);
                if (got < 0) {
                    b->wait_rank = r;
                    b->waiting = got == -1;
                    return got == -1 ? 1 : -6;
                }
                b->got[r] = 1;
            }
            at += n;
            if (n > most) most = n;
        }
        b->waiting = 0;
        if (b->P == T && most == T) { /* one rank's rows are each token's sum, in token order */
            for (int64_t i = 0; i < T * H; i++) b->h[i] += b->partial[i];
        } else {
            memset(b->sum, 0, sizeof(float) * (size_t)(T * H));
            for (int64_t p = 0; p < b->P; p++) {
                float *s = b->sum + b->token_index[p] * H;
                const float *src = b->partial + p * H;
                for (int64_t c = 0; c < H; c++) s[c] += src[c];
            }
            for (int64_t i = 0; i < T * H; i++) b->h[i] += b->sum[i];
        }
        b->pending = 0;
    }
    stamps[1] = now_ns();
    if (layer == m->L) {
        if (T) {
            splitmoe_rms_norm_f32(b->h, H, 0, T, 1, H, m->final_norm, 0, (float)m->eps, b->x, H,
                                  0);
            splitmoe_lm_head_f32(b->x, T, H, m->lm_head, m->V, b->logits);
        }
        stamps[2] = stamps[3] = now_ns();
        return 0;
    }
    const struct step_layer *w = &m->layers[layer];
    if (T) {
        float *k_cache = m->kv + layer * m->kv_layer_st;
        struct decode_layer a = {
            b->h, H, w->in_norm, w->post_norm, (float)m->eps, w->wqkv_t, w->b_qkv, w->qk_norm_w,
            b->cos_t, b->sin_t, b->cs_st, k_cache, k_cache + m->kv_v_off, m->block_size,
            b->block_tables, b->table_st, b->seq_lens, b->slots, b->max_len, m->nh, m->nkv, m->d,
            (float)m->scale, w->wo_t, w->router_t, m->E, k, (int)m->renorm, b->x, b->ids,
            b->weights, 0, T, 0};
        const int rc = decode_layer_run(&a);
        if (rc) return rc;
    }
    stamps[2] = now_ns();
    const int64_t P = splitmoe_dispatch_send(
        b->ids, T, k, (const int64_t *)(intptr_t)m->expert_slot[layer], m->E,
        (int64_t *)(intptr_t)m->load[layer], m->slot_rank, m->slot_local, m->num_slots, R,
        (const uint8_t *)b->x, H * (int64_t)sizeof(float), b->weights, b->rows, b->token_index,
        b->counts + layer * R, m->rings_out, m->cap_out, b->sent);
    stamps[3] = now_ns();
    if (P < 0) return P == -1 ? -5 : -1;
    b->P = P;
    b->pending = 1;
    for (int64_t r = 0; r < R; r++) b->got[r] = 0;
    for (int64_t r = 0; r < R; r++)
        if (!b->sent[r]) return 2;
    return 0;
}


/* ---- an expert rank's (layer, micro-batch) ------------------------------------------------- */

/* An expert rank's share of one MoE layer and micro-batch, the tokens coming from the attention
 * ranks over shared-memory rings (the expert side of splitmoe_remote_layer and of the flat
 * transport on those rings), in one call: each attention rank's frame of packed rows (an empty
 * one included) into rows, splitmoe_fused_moe_rows_f32 on them, and each attention rank's
 * partial sums back as a frame on its ring (none where it sent no rows). The same frames and
 * bits as FlatTransport.receive, LocalExperts.compute_batch and FlatTransport.send_back. */
struct expert_call {
    int64_t H, k, I, A;
    const int64_t *layers; /* [moe layers, 3]: each one's w13t and w2t addresses and expert count */
    const int64_t *rings_out, *rings_in, *staged_in; /* [A], as struct remote_model's */
    int64_t cap_out, cap_in, spin_ns;
    uint8_t *rows;      /* [capacity, 4 H + 8 k] */
    float *y;           /* [capacity, H] */
    int64_t capacity;   /* rows */
    int64_t *counts;    /* [A] rows from each attention rank */
    int64_t *got;       /* [A] its frame taken (set by the caller for the frames it receives) */
    int64_t *sent;      /* [A] its partial sums sent */
    int64_t *stamps;    /* [4] ns: the call's start, received, computed, sent */
    int64_t N, waiting, wait_rank, need;
};

/* Call `layer` (its index among the MoE layers). Returns 0 when done; 1 when the frame from
 * attention rank wait_rank has not arrived whole within the spin, or begins with bytes the
 * Python side staged (the caller receives it into rows after the rows taken so far, sets
 * counts[wait_rank] and got[wait_rank], and calls again); 3 when rows lacks room for it (need:
 * the rows wanted; nothing consumed: the caller grows the buffers and calls again); 2 when done
 * but some partial sums did not fit their rings (sent[a] = 0: the caller sends them); -6 when
 * the frame from wait_rank is not whole rows (nothing consumed: the caller's receive reports
 * the diverged calls); -1 out of scratch memory; -5 a bad local expert id or k. */
int64_t splitmoe_expert_layer(struct expert_call *c, int64_t layer) {
    const int64_t H = c->H, k = c->k, A = c->A, row_bytes = 4 * H + 8 * k;
    if (!c->waiting) {
        c->stamps[0] = now_ns();
        for (int64_t a = 0; a < A; a++) c->counts[a] = 0;
    }
    int64_t at = 0;
    for (int64_t a = 0; a < A; a++) {
        if (!c->got[a]) {
            uint8_t *ring = (uint8_t *)(intptr_t)c->rings_in[a];
            const int64_t n = *(const int64_t *)(intptr_t)c->staged_in[a]
                                  ? -1
                                  : splitmoe_ring_peek(ring, c->cap_in, c->spin_ns);
            c->wait_rank = a;
            c->waiting = 1;
            if (n < 0) return 1;
            if (n % row_bytes) return -6;
            if (at + n / row_bytes > c->capacity) {
                c->need = at + n / row_bytes;
                return 3;
            }
            splitmoe_ring_recv(ring, c->cap_in, c->rows + at * row_bytes, n, 0);
            c->counts[a] = n / row_bytes;
            c->got[a] = 1;
        }
        at += c->counts[a];
    }
    c->waiting = 0;
    c->N = at;
    c->stamps[1] = now_ns();
    const int64_t *w = c->layers + 3 * layer;
    memset(c->y, 0, sizeof(float) * (size_t)(at * H));
    int rc = 0;
    if (at)
        rc = splitmoe_fused_moe_rows_f32(c->rows, at, H, (const float *)(intptr_t)w[0],
                                         (const float *)(intptr_t)w[1], w[2], c->I, k, c->y);
    c->stamps[2] = now_ns();
    if (rc) return rc;
    int all = 1;
    at = 0;
    for (int64_t a = 0; a < A; a++) {
        const int64_t n = c->counts[a];
        c->sent[a] = !n || splitmoe_ring_send((uint8_t *)(intptr_t)c->rings_out[a], c->cap_out,
                                             (const uint8_t *)(c->y + at * H),
                                             n * H * (int64_t)sizeof(float));
        all &= (int)c->sent[a];
        at += n;
    }
    for (int64_t a = 0; a < A; a++) c->got[a] = 0;
    c->stamps[3] = now_ns();
    return all ? 0 : 2;
}

/* The sizes of the structs the Python side mirrors (struct remote_model, remote_batch and
 * expert_call), for its check that they match. */
int64_t splitmoe_remote_struct_bytes(int64_t which) {
    const size_t sizes[3] = {sizeof(struct remote_model), sizeof(struct remote_batch),
                             sizeof(struct expert_call)};
    return which >= 0 && which < 3 ? (int64_t)sizes[which] : -1;
}
