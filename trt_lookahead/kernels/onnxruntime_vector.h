/* 8-float vectors in GCC's vector extensions, and e^x over them, for the C kernels that run elementwise float32
 * math the same way on every element (onnxruntime_attention.c's softmax, onnxruntime_swiglu.c's sigmoid): straight-
 * line operations, no fused multiply-add (the library is compiled with -ffp-contract=off), so a result depends on
 * its inputs alone, never on where in a buffer they lie.
 */
#ifndef TRT_LOOKAHEAD_ONNXRUNTIME_VECTOR_H
#define TRT_LOOKAHEAD_ONNXRUNTIME_VECTOR_H

#include <stdint.h>

/* 8 floats, loaded from any address; a compiler without 256-bit registers splits them */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));
#define SPLAT(x) {x, x, x, x, x, x, x, x}

static inline v8 load8(const float *p) { return *(const v8 *)p; }
static inline void store8(float *p, v8 x) { *(v8 *)p = x; }

/* e^x for 8 lanes of x <= 0 (scores minus their maximum): x = n ln2 + r with n = round(x / ln2) and |r| <= ln2 / 2,
 * e^r by a degree-7 polynomial (Cephes' expf coefficients; within 1 ulp of e^x over [-87, 0]), times 2^n; 0 below
 * the normal floats' range, and NaN stays NaN. */
static inline v8 exp8(v8 x) {
    const v8 lowest = SPLAT(-87.3f), round = SPLAT(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const i8 normal = (x >= lowest) | (x != x);
    x = (v8)((i8)x & normal) + (v8)((i8)lowest & ~normal);
    v8 t = x * 1.44269504088896341f + round;
    v8 n = t - round;
    v8 r = x - n * 0.693359375f - n * -2.12194440e-4f;
    v8 y = 1.9875691500e-4f * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    const i8 scale = (((i8)t - (i8)round) + 127) << 23; /* 2^n from the rounded sum's low bits */
    return (v8)((i8)(y * (v8)scale) & normal);
}

#endif
