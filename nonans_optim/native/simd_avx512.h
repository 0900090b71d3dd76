/* AVX-512 helpers shared by the hand-vectorised loops (scalar_avx512.h: the (SF-)AdamW step;
 * spectral_post.c: the spectral update), compiled in when the library is built for a CPU with AVX-512F and
 * AVX-512DQ (-march=native) unless NONANS_PORTABLE is defined (NONANS_NATIVE_SIMD=portable). Each loop
 * keeps its portable form beside it, and tests/test_native_simd.py checks that both builds write the same
 * bits: the arithmetic is the portable loops', op for op (no FMA, the same association).
 *
 * Why intrinsics: not the arithmetic but the resolution's bookkeeping. Under `#pragma omp simd`, gcc 12
 * turns each `count += !finite(x)` into a mask, a zero-masked move of a ones vector and a vector add —
 * three 512-bit ops per count, which on Zen 4 (512-bit ops issued as two 256-bit halves) cost more than
 * the gates themselves: the portable AdamW "repair" loop ran 1.7x its "off" loop on cache-resident data.
 * Here the loops speculate and verify in registers: the stock arithmetic, one VFPCLASSPS test of a sum of
 * the new values (the (SF-)AdamW loop: of products and sums, scalar_avx512.h's vcheck_; a NaN or ±Inf in
 * any term makes it non-finite), and only a vector that fails — none on a clean step — is recomputed with
 * the gates and counted (POPCNT on the integer ports); the (SF-)AdamW loop tests four vectors at once
 * (scalar_avx512.h, vec_quad_). */
#ifndef NONANS_SIMD_AVX512_H
#define NONANS_SIMD_AVX512_H
#if defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(NONANS_PORTABLE) && !defined(NONANS_NO_AVX512)
#define NONANS_AVX512 1
#include <immintrin.h>

#define NONFINITE_ 0x99 /* VFPCLASSPS categories: QNaN | SNaN | +Inf | -Inf */

/* lerpf_ (common.h) on 16 lanes; the branch is on the uniform weight, decided once per block. */
static inline __attribute__((always_inline)) __m512 vlerp_(__m512 a, __m512 b, __m512 w, __m512 one_m_w,
                                                            int small) {
    const __m512 diff = _mm512_sub_ps(b, a);
    return small ? _mm512_add_ps(a, _mm512_mul_ps(w, diff)) : _mm512_sub_ps(b, _mm512_mul_ps(diff, one_m_w));
}

static inline __attribute__((always_inline)) __m512 vload_(int full, __mmask16 lm, const float *x) {
    return full ? _mm512_loadu_ps(x) : _mm512_maskz_loadu_ps(lm, x);
}

static inline __attribute__((always_inline)) void vstore_(int full, __mmask16 lm, float *x, __m512 val) {
    if (full) _mm512_storeu_ps(x, val);
    else _mm512_mask_storeu_ps(x, lm, val);
}

/* The update stage of one vector: keep the old value where the new one is not finite, or everywhere when
 * the tensor is held, and count NaN / non-finite new values. */
static inline __attribute__((always_inline)) __m512 guard_(__m512 x, __m512 old, __mmask16 bad, __mmask16 keep,
                                                            int64_t *un, int64_t *ub) {
    *ub += __builtin_popcount(bad);
    *un += __builtin_popcount(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) & bad);
    return _mm512_mask_blend_ps(bad | keep, x, old);
}

/* The new parameter (y) and schedule-free z from the direction d, as the portable loops compute them:
 * AdamW-style y = p·(1-lr·λ) - lr·d, or schedule-free y = lerp(p, z, c) + d·lr·coef and z - d·lr, with
 * λ·z added to d first when decay (skipped at λ = 0, where 0·z would turn an Inf z into NaN). */
typedef struct {
    __m512 lr, lrc, wdf, wd, c, one_m_c;
    int small_c;
} vparam_t;

static inline __attribute__((always_inline)) __m512 vparam_(const int sf, const int decay, __m512 d, __m512 po,
                                                             __m512 zo, const vparam_t *k, __m512 *zn) {
    if (!sf) return _mm512_sub_ps(_mm512_mul_ps(po, k->wdf), _mm512_mul_ps(k->lr, d));
    if (decay) d = _mm512_add_ps(d, _mm512_mul_ps(zo, k->wd));
    *zn = _mm512_sub_ps(zo, _mm512_mul_ps(d, k->lr));
    return _mm512_add_ps(vlerp_(po, zo, k->c, k->one_m_c, k->small_c), _mm512_mul_ps(d, k->lrc));
}

static inline vparam_t vparam_make_(float lr, float lrc, float wdf, float wd, float c) {
    const vparam_t k = {_mm512_set1_ps(lr), _mm512_set1_ps(lrc), _mm512_set1_ps(wdf), _mm512_set1_ps(wd),
                        _mm512_set1_ps(c), _mm512_set1_ps(1.0f - c), fabsf(c) < 0.5f};
    return k;
}

/* Lanes [0, n) of a 16-lane vector, n in [0, 16]. */
static inline __mmask16 vlanes_(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}
#endif
#endif
