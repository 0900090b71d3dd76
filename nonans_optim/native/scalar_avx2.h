/* The AVX2 form of scalar_entry.h's update_block, for CPUs without AVX-512 (compiled in where -march=native
 * gives AVX2 and scalar_avx512.h is not compiled in; NONANS_NATIVE_SIMD=avx2 selects it on an AVX-512 CPU
 * too, so that tests/test_native_simd.py can compare it with the portable build there as well).
 *
 * Why: gcc vectorises the portable gated loop only by if-converting its selects, which without AVX-512's
 * masked operations means computing both sides of each with plain 256-bit ops: "repair" ran about 1.5x
 * "off" at 1M entries (AVX2-only AMD EPYC; 10.6x before -fno-trapping-math let it vectorise at all, see
 * native/__init__.py). This loop tests, then computes: a group of 32 entries is checked on its inputs
 * (input_limit_: magnitudes of g, p and z or m under a bound, the old v in range), and only a group that
 * fails — none on a clean step — is computed by the portable gated loop; the others run the stock
 * arithmetic, nothing else. A held or "skip" tensor's block runs the portable loop throughout.
 *
 * AVX2 has no VFPCLASSPS or VRANGEPS, so the test works on the bit patterns: with the sign bit cleared, an
 * IEEE float's bits order like unsigned integers — every finite value below +Inf (0x7f800000), below every
 * NaN — so the largest magnitude over a group is one unsigned max per operand, and one compare against the
 * bound's bits tests it, NaN and ±Inf included. The old v's raw bits must be at most those of FLT_MAX / 4
 * as unsigned, which fails a sign bit (-0 too, which only sends its group to the exact path).
 *
 * The arithmetic is the portable loop's, op for op (no FMA: -ffp-contract=off, and intrinsics are never
 * contracted), so a clean step writes the portable build's bits, and "off" runs the same vector code
 * without the test. */
#ifndef NONANS_SCALAR_AVX2_H
#define NONANS_SCALAR_AVX2_H
#if defined(__AVX2__) && !defined(NONANS_AVX512) && !defined(NONANS_PORTABLE) && !defined(NONANS_NO_AVX2)
#define NONANS_AVX2 1
#include <immintrin.h>

typedef struct {
    __m256 s, b2, one_m_b2, w, one_m_w, bc1, bc2, eps, lr, lrc, wdf, wd, c, one_m_c;
} y8hyper_t;

/* lerpf_ (common.h) on 8 lanes; small: the uniform weight's branch, decided once per block. */
static inline __attribute__((always_inline)) __m256 y8lerp_(__m256 a, __m256 b, __m256 w, __m256 one_m_w, int small) {
    const __m256 diff = _mm256_sub_ps(b, a);
    return small ? _mm256_add_ps(a, _mm256_mul_ps(w, diff)) : _mm256_sub_ps(b, _mm256_mul_ps(diff, one_m_w));
}

/* The stock arithmetic of one vector (update_block with gate = 0): the values it stores. */
typedef struct {
    __m256 vn, st_new, y; /* st: z (schedule-free) or m (AdamW) */
} y8val_t;

/* From the loaded inputs (scalar_avx2_bf16.h widens bf16 ones); y8stock_ loads them at entry j. */
static inline __attribute__((always_inline)) y8val_t y8arith_(const int sf, const int decay_z, const int small,
                                                              __m256 gr, __m256 po, __m256 st, __m256 vo,
                                                              const y8hyper_t *k) {
    y8val_t x;
    const __m256 gs = _mm256_mul_ps(gr, k->s);
    const __m256 g2 = _mm256_mul_ps(_mm256_mul_ps(k->one_m_b2, gs), gs);
    x.vn = _mm256_add_ps(_mm256_mul_ps(vo, k->b2), g2);
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_div_ps(x.vn, k->bc2)), k->eps);
    if (sf) {
        __m256 d = _mm256_div_ps(gs, denom);
        if (decay_z) d = _mm256_add_ps(d, _mm256_mul_ps(st, k->wd));
        x.y = _mm256_add_ps(y8lerp_(po, st, k->c, k->one_m_c, small), _mm256_mul_ps(d, k->lrc));
        x.st_new = _mm256_sub_ps(st, _mm256_mul_ps(d, k->lr));
    } else {
        x.st_new = y8lerp_(st, gs, k->w, k->one_m_w, small);
        const __m256 d = _mm256_div_ps(_mm256_div_ps(x.st_new, k->bc1), denom);
        x.y = _mm256_sub_ps(_mm256_mul_ps(po, k->wdf), _mm256_mul_ps(k->lr, d));
    }
    return x;
}

static inline __attribute__((always_inline)) y8val_t y8stock_(
        const int sf, const int decay_z, const int small, const float *restrict p, const float *restrict g,
        const float *restrict m, const float *restrict v, const float *restrict z, int64_t j, const y8hyper_t *k) {
    return y8arith_(sf, decay_z, small, _mm256_loadu_ps(g + j), _mm256_loadu_ps(p + j),
                    _mm256_loadu_ps(sf ? z + j : m + j), _mm256_loadu_ps(v + j), k);
}

static inline __attribute__((always_inline)) void y8store_(const int sf, float *restrict p, float *restrict m,
                                                           float *restrict v, float *restrict z, int64_t j,
                                                           const y8val_t *x) {
    _mm256_storeu_ps(p + j, x->y);
    _mm256_storeu_ps(v + j, x->vn);
    _mm256_storeu_ps(sf ? z + j : m + j, x->st_new);
}

static inline __attribute__((always_inline)) __m256i y8abs_(__m256 x, __m256i absmask) {
    return _mm256_and_si256(_mm256_castps_si256(x), absmask);
}

/* The exact path for [j0, j1): the portable gated loop (update_block), which reads what nothing has written
 * yet and adds what it counts to c. */
#define Y8_EXACT_(j0, j1) update_block(sf, 1, 0, decay_z, p, g, m, v, z, j0, j1, s, lr, wdf, lrc, bc1, bc2, h, 0, 0, c)

/* The vectors of [b0, b1) with the lerp form (small: its uniform weight below 0.5) and the kind of test
 * (lim > 0: the early test on the inputs; 0: the late test on the new values) fixed at compile time: a
 * branch on a weight decided at run time stayed in every vector of the gated loop (gcc unswitches it
 * only from the smaller "off" loop). Returns the first entry it left to the caller (the tail). */
static inline __attribute__((always_inline)) int64_t y8_loop_(
        const int sf, const int gate, const int decay_z, const int small, const int early,
        float *restrict p, const float *restrict g, float *restrict m, float *restrict v, float *restrict z,
        int64_t b0, int64_t b1, float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h,
        const y8hyper_t *k, float lim, int64_t *c) {
    const __m256i vlim = _mm256_castps_si256(_mm256_set1_ps(lim)), absmask = _mm256_set1_epi32(0x7fffffff);
    const __m256i vmax = _mm256_castps_si256(_mm256_set1_ps(FLT_MAX / 4.0f)), finmax = _mm256_set1_epi32(0x7f7fffff);
    const float *st = sf ? z : m;
    int64_t j = b0;
    if (gate && early) {
        for (; j + 32 <= b1; j += 32) {
            __m256i mx = _mm256_setzero_si256(), vx = mx;
            for (int q = 0; q < 32; q += 8) {
                mx = _mm256_max_epu32(mx, _mm256_max_epu32(y8abs_(_mm256_loadu_ps(g + j + q), absmask),
                                                           y8abs_(_mm256_loadu_ps(p + j + q), absmask)));
                mx = _mm256_max_epu32(mx, y8abs_(_mm256_loadu_ps(st + j + q), absmask));
                vx = _mm256_max_epu32(vx, _mm256_castps_si256(_mm256_loadu_ps(v + j + q)));
            }
            /* signed compare: mx has no sign bit; unsigned for v, where a sign bit must fail */
            const __m256i over = _mm256_or_si256(
                    _mm256_cmpgt_epi32(mx, vlim),
                    _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_max_epu32(vx, vmax), vmax), _mm256_set1_epi32(-1)));
            if (__builtin_expect(!_mm256_testz_si256(over, over), 0)) {
                Y8_EXACT_(j, j + 32);
                continue;
            }
            for (int q = 0; q < 32; q += 8) {
                const y8val_t x = y8stock_(sf, decay_z, small, p, g, m, v, z, j + q, k);
                y8store_(sf, p, m, v, z, j + q, &x);
            }
        }
        return j;
    }
    for (; j + 8 <= b1; j += 8) {
        const y8val_t x = y8stock_(sf, decay_z, small, p, g, m, v, z, j, k);
        if (gate) { /* no bound: test the new values (a sum is non-finite if any term is) */
            __m256 sum = _mm256_add_ps(x.vn, x.y);
            if (sf) sum = _mm256_add_ps(sum, x.st_new);
            const __m256i over = _mm256_cmpgt_epi32(y8abs_(sum, absmask), finmax);
            if (__builtin_expect(!_mm256_testz_si256(over, over), 0)) {
                Y8_EXACT_(j, j + 8);
                continue;
            }
        }
        y8store_(sf, p, m, v, z, j, &x);
    }
    return j;
}

/* The 8-lane constants of one block's arithmetic (and of scalar_avx2_bf16.h's). */
static inline y8hyper_t y8hyper_make_(float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h) {
    const y8hyper_t k = {
        _mm256_set1_ps(s), _mm256_set1_ps(h.b2), _mm256_set1_ps(h.one_m_b2), _mm256_set1_ps(h.one_m_b1),
        _mm256_set1_ps(1.0f - h.one_m_b1), _mm256_set1_ps(bc1), _mm256_set1_ps(bc2), _mm256_set1_ps(h.eps),
        _mm256_set1_ps(lr), _mm256_set1_ps(lrc), _mm256_set1_ps(wdf), _mm256_set1_ps(h.wd), _mm256_set1_ps(h.c),
        _mm256_set1_ps(1.0f - h.c)};
    return k;
}

/* update_block (scalar_entry.h) for [b0, b1), same arguments and counts. Under a gate with a bound, each
 * group of 32 entries is tested on its inputs (input_limit_) and then computed and stored vector by vector,
 * or, when it fails, computed by the portable gated loop; without a bound (eps = 0), each vector's new v,
 * y (and z) are tested before they are stored. "off" computes and stores. The tail and held or kept-whole
 * blocks run the portable loop. */
static inline __attribute__((always_inline)) void update_block_avx2(
        const int sf, const int gate, const int clean, const int decay_z,
        float *restrict p, const float *restrict g, float *restrict m, float *restrict v, float *restrict z,
        int64_t b0, int64_t b1, float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h,
        int hold, int keep_all, int64_t *c) {
    if (gate && (hold || keep_all)) {
        update_block(sf, gate, clean, decay_z, p, g, m, v, z, b0, b1, s, lr, wdf, lrc, bc1, bc2, h, hold,
                     keep_all, c);
        return;
    }
    const y8hyper_t k = y8hyper_make_(s, lr, wdf, lrc, bc1, bc2, h);
    const float lim = gate ? input_limit_(sf, decay_z, s, lr, wdf, lrc, bc1, bc2, h) : 0.0f;
    const int small = fabsf(sf ? h.c : h.one_m_b1) < 0.5f, early = lim > 0.0f;
#define Y8_LOOP_(small_, early_) y8_loop_(sf, gate, decay_z, small_, early_, p, g, m, v, z, b0, b1, s, lr, wdf, \
                                         lrc, bc1, bc2, h, &k, lim, c)
    const int64_t j = small ? (early ? Y8_LOOP_(1, 1) : Y8_LOOP_(1, 0)) : (early ? Y8_LOOP_(0, 1) : Y8_LOOP_(0, 0));
#undef Y8_LOOP_
    if (j < b1)
        update_block(sf, gate, clean, decay_z, p, g, m, v, z, j, b1, s, lr, wdf, lrc, bc1, bc2, h, 0, 0, c);
}
#undef Y8_EXACT_
#endif
#endif
