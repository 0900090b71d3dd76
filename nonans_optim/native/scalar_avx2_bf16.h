/* The AVX2 form of the bf16 (SF-)AdamW loop (scalar_bf16.h is the portable one, scalar_avx512_bf16.h the
 * AVX-512 one, whose reasoning this follows): the same bits, for CPUs without AVX-512.
 *
 * Why: as on AVX-512, the portable bf16 loop is bound by its instruction count, most of it conversions, so
 * its tested groups' input test (a mask and a max per bf16 array) shows in the step: "repair" ran 1.08x
 * (AdamW) and 1.06x (SFAdamW) "off" in the AVX2 build (a scratch C driver calling nonans_scalar_step,
 * 262K entries, one thread, NONANS_NATIVE_SIMD=avx2 on an AVX-512 Intel Xeon, 2026-11-27).
 *
 * How, per 32 entries (two 256-bit loads of 16 bf16 per array): each load widens in one operation per 8
 * entries — the even entries by a shift of each 32-bit lane by 16, the odd ones by masking off its low
 * half —, scalar_avx2.h's stock arithmetic (y8arith_, op for op the portable entry_) runs on each half,
 * the rounding is f32_to_bf16_rne_'s on 8 lanes and one 16-bit blend packs two halves back in entry order.
 * Both policies test the rounded values, as scalar_avx512_bf16.h does (why the rounding sum read as fp32 is
 * non-finite exactly where the stored bf16 value is, and why finite hyperparameters — scalar_bf16.h's
 * finite_hyper_ — rule out a NaN carried into the sign bit): v·y + z (or + m) over the 32 entries. The test
 * comes before the stores (AVX2 has 16 vector registers: the six packed results stay in them, where a
 * put-back would hold the loaded values instead), and a group that fails is computed by the portable loop
 * from its untouched inputs — the gated one, or "off"'s, which writes 0x7FC0 for a NaN and stores what
 * overflowed. A held or "skip" tensor and a tail shorter than a group go there too.
 *
 * Why "off" tests too: writing torch's NaN (0x7FC0) in the vector loop, a compare and a blend per rounded
 * vector, made "off" 1.09x (AdamW) and 1.20x (SFAdamW) slower than the portable loop it replaces, and
 * "repair" 0.81-0.89x of it (same driver) — a ratio met by slowing "off". With the test, both policies run
 * this same loop and store the same clean bits. */
#ifndef NONANS_SCALAR_AVX2_BF16_H
#define NONANS_SCALAR_AVX2_BF16_H
#ifdef NONANS_AVX2

#define Y8BF_GROUP_ 32 /* entries per test: two 16-entry loads per array, four 8-lane vectors of arithmetic */

static inline __attribute__((always_inline)) __m256i y8bf_load_(const uint16_t *x) {
    return _mm256_loadu_si256((const __m256i *)x);
}

/* The 8 even (half 0) or odd (half 1) entries of 16 bf16 values, as fp32. */
static inline __attribute__((always_inline)) __m256 y8bf_half_(__m256i x, const int half) {
    return _mm256_castsi256_ps(half ? _mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u))
                                    : _mm256_slli_epi32(x, 16));
}

/* x rounded to bf16 in the high half of each lane (scalar_avx512_bf16.h's bf_round_ on 8 lanes). */
static inline __attribute__((always_inline)) __m256i y8bf_round_(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
}

/* The 16 bf16 values of two rounded halves, back in entry order: the even entries shifted into the low
 * 16 bits of each lane, the odd ones' high 16 bits blended in (0xAA: the odd 16-bit words). */
static inline __attribute__((always_inline)) __m256i y8bf_pack_(__m256i lo, __m256i hi) {
    return _mm256_blend_epi16(_mm256_srli_epi32(lo, 16), hi, 0xAA);
}

/* v·y + s, non-finite where any term is (scalar_avx512.h's vcheck_). */
static inline __attribute__((always_inline)) __m256 y8bf_check_(__m256i v, __m256i y, __m256i s) {
#ifdef __FMA__
    return _mm256_fmadd_ps(_mm256_castsi256_ps(v), _mm256_castsi256_ps(y), _mm256_castsi256_ps(s));
#else
    return _mm256_add_ps(_mm256_mul_ps(_mm256_castsi256_ps(v), _mm256_castsi256_ps(y)), _mm256_castsi256_ps(s));
#endif
}

/* One group of 32 entries at j: computed, tested, stored — or, when the test fails, computed again by the
 * portable loop (gated, or "off"'s) from the inputs nothing has written yet. */
static inline __attribute__((always_inline)) void y8bf_group_(
        const int sf, const int gate, const int decay_z, const int small, void *restrict p, const void *restrict g,
        void *restrict m, void *restrict v, void *restrict z, int64_t j, const y8hyper_t *k, float s, float lr,
        float wdf, float lrc, float bc1, float bc2, const hyper_t h, int64_t *c) {
    const uint16_t *const G = (const uint16_t *)g;
    uint16_t *const P = (uint16_t *)p, *const V = (uint16_t *)v, *const S = (uint16_t *)(sf ? z : m);
    __m256i out[2][3]; /* [16-entry load][y, v, m or z] packed */
    __m256 chk = _mm256_setzero_ps();
    for (int q = 0; q < 2; q++) {
        const int64_t at = j + 16 * q;
        const __m256i rg = y8bf_load_(G + at), rp = y8bf_load_(P + at), rv = y8bf_load_(V + at);
        const __m256i rs = y8bf_load_(S + at);
        __m256i r[2][3];
        for (int half = 0; half < 2; half++) {
            const y8val_t x = y8arith_(sf, decay_z, small, y8bf_half_(rg, half), y8bf_half_(rp, half),
                                       y8bf_half_(rs, half), y8bf_half_(rv, half), k);
            r[half][0] = y8bf_round_(x.y);
            r[half][1] = y8bf_round_(x.vn);
            r[half][2] = y8bf_round_(x.st_new);
            chk = _mm256_add_ps(chk, y8bf_check_(r[half][1], r[half][0], r[half][2]));
        }
        for (int t = 0; t < 3; t++) out[q][t] = y8bf_pack_(r[0][t], r[1][t]);
    }
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(chk), _mm256_set1_epi32(0x7fffffff));
    const __m256i over = _mm256_cmpgt_epi32(bits, _mm256_set1_epi32(0x7f7fffff)); /* NaN or ±Inf */
    if (__builtin_expect(!_mm256_testz_si256(over, over), 0)) {
        update_block_t_(1, sf, gate, 0, decay_z, p, g, m, v, z, j, j + Y8BF_GROUP_, s, lr, wdf, lrc, bc1, bc2, h, 0,
                        0, c);
        return;
    }
    for (int q = 0; q < 2; q++) {
        _mm256_storeu_si256((__m256i *)(P + j + 16 * q), out[q][0]);
        _mm256_storeu_si256((__m256i *)(V + j + 16 * q), out[q][1]);
        _mm256_storeu_si256((__m256i *)(S + j + 16 * q), out[q][2]);
    }
}

static inline __attribute__((always_inline)) void y8bf_loop_(
        const int sf, const int gate, const int decay_z, const int small, void *restrict p, const void *restrict g,
        void *restrict m, void *restrict v, void *restrict z, int64_t b0, int64_t b1, const y8hyper_t *k, float s,
        float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h, int64_t *c) {
    for (int64_t j = b0; j + Y8BF_GROUP_ <= b1; j += Y8BF_GROUP_)
        y8bf_group_(sf, gate, decay_z, small, p, g, m, v, z, j, k, s, lr, wdf, lrc, bc1, bc2, h, c);
}

/* update_block_bf16_ (scalar_bf16.h) for [b0, b1), same arguments, same bits, same counts. */
static inline __attribute__((always_inline)) void update_block_bf16_avx2(
        const int sf, const int gate, const int clean, const int decay_z,
        void *restrict p, const void *restrict g, void *restrict m, void *restrict v, void *restrict z,
        int64_t b0, int64_t b1, float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h,
        int hold, int keep_all, int64_t *c) {
    (void)clean;
    if (bf16_whole_block_(sf, gate, decay_z, BF16_BLOCK_ARGS_, hold, keep_all, c)) return;
    const y8hyper_t k = y8hyper_make_(s, lr, wdf, lrc, bc1, bc2, h);
    if (fabsf(sf ? h.c : h.one_m_b1) < 0.5f)
        y8bf_loop_(sf, gate, decay_z, 1, p, g, m, v, z, b0, b1, &k, s, lr, wdf, lrc, bc1, bc2, h, c);
    else
        y8bf_loop_(sf, gate, decay_z, 0, p, g, m, v, z, b0, b1, &k, s, lr, wdf, lrc, bc1, bc2, h, c);
    bf16_tail_(sf, gate, decay_z, Y8BF_GROUP_, BF16_BLOCK_ARGS_, c);
}
#endif
#endif
