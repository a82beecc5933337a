/* Vectors of 16 floats for the native CPU kernels (`moe_cpu.c`, `attention_cpu.c`): GCC's vector
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

#endif
