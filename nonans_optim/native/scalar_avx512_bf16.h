/* The AVX-512 form of the bf16 (SF-)AdamW loop (scalar_bf16.h is the portable one): the same bits, with the
 * resolution's test as cheap as the fp32 loop's (scalar_avx512.h).
 *
 * Why: the bf16 step is bound by its instruction count, not by memory, and most of its instructions are
 * conversions. gcc vectorises the portable loop at 8 fp32 lanes (-march=native prefers 256-bit vectors) and
 * spends about six operations per 8 entries on each rounding store and two on each widening load, so the
 * tested groups' input test (scalar_bf16.h: a mask and a max per bf16 array) showed: "repair" ran 1.06-1.08x
 * "off" (a scratch C driver calling nonans_scalar_step, 262K entries, one thread, 2026-11-27, Intel Xeon);
 * with the test removed (unsafe, and only to find the cost) 0.98x. Here:
 *  - 32 bf16 entries load as one 512-bit vector and widen in one operation per 16: the even entries by a
 *    shift of each 32-bit lane by 16, the odd ones by masking off its low half. The arithmetic is
 *    elementwise, so it runs on the two halves as they are (scalar_avx512.h's arith_, op for op the
 *    portable entry_), and the two rounded halves pack back with one shift and one ternary-logic op.
 *  - Rounding is the portable f32_to_bf16_rne_ (round to nearest even, denormals kept), on 16 lanes: torch's
 *    bits. AVX512-BF16's VCVTNEPS2BF16 would round in one instruction but flushes denormals (Intel SDM), so
 *    it would not write torch's bits.
 *  - The test reads the *rounded* values: the 32-bit sum that rounds (x + 0x7FFF + lsb)
 *    holds the bf16 result in its high half, exponent included, so read as an fp32 number it is NaN or ±Inf
 *    exactly where the stored bf16 value is — a finite fp32 value that rounds to bf16's Inf too, which is
 *    what "finite as stored" (storable_) means. So scalar_avx512.h's vcheck_ applies as it is: v·y + z (or
 *    + m), one FMA per vector and a sum per four, non-finite wherever a stored value would be. The rounding
 *    sum carries into the sign bit only for a NaN whose mantissa's top eight bits are all set and whose low
 *    half is at least 0x8000; every NaN here is the default NaN (0xFFC00000) or one propagated from a bf16
 *    input (low half 0), so none does, as long as the hyperparameters are finite: a block with a non-finite
 *    one takes the portable loop (scalar_entry.h's finite_hyper_), under either policy.
 *
 * As scalar_avx512.h's vec_quad_: four vectors of fp32 arithmetic per step (here two 32-entry loads per
 * array), every load of the step before its first store (4K aliasing), the stores before the test (a clean
 * step never fails it), and a failing step puts its loaded bits back and is computed again by the portable
 * loop (update_block_t_): the gated one, which decides and counts per entry, or "off"'s, which writes
 * torch's NaN (0x7FC0) where a value is NaN and stores what overflowed. "off" tests as "repair" does rather
 * than write that NaN in the vector loop, so the two policies run one loop and store the same clean bits
 * (scalar_avx2_bf16.h measured why). A held or "skip" tensor and a tail
 * shorter than a step go to the portable loop, which writes the same bits (tests/test_native_simd.py
 * compares the builds in bf16 too). */
#ifndef NONANS_SCALAR_AVX512_BF16_H
#define NONANS_SCALAR_AVX512_BF16_H
#ifdef NONANS_AVX512

#define BF_STEP_ 64 /* entries per step: two 32-entry loads per array, four 16-lane vectors of arithmetic */

/* The 16 even (half 0) or 16 odd (half 1) entries of 32 bf16 values, as fp32: a shift of each 32-bit lane
 * by 16, or its low half masked off. */
static inline __attribute__((always_inline)) __m512 bf_half_(__m512i x, const int half) {
    return _mm512_castsi512_ps(half ? _mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u))
                                    : _mm512_slli_epi32(x, 16));
}

/* x rounded to bf16 in the high half of each lane (the low half is left over from the rounding sum):
 * f32_to_bf16_rne_ before its shift. */
static inline __attribute__((always_inline)) __m512i bf_round_(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
}

/* The 32 bf16 values of two rounded halves, back in entry order. */
static inline __attribute__((always_inline)) __m512i bf_pack_(__m512i lo, __m512i hi) {
    /* 0xF8 = A | (B & C): the shifted even halves, the odd halves' high 16 bits */
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(lo, 16), hi, _mm512_set1_epi32((int)0xFFFF0000u), 0xF8);
}

/* A step that failed its test: its loaded bits put back, then the portable loop on it (gated, or "off"'s;
 * the flags at run time: this path is rare). Out of line and cold, so that the hot loop keeps no
 * registers for it. */
static __attribute__((noinline, cold)) void bf_step_exact_(
        const int sf, const int gate, const int decay_z, void *restrict p, const void *restrict g,
        void *restrict m, void *restrict v, void *restrict z, int64_t j, const __m512i *raw, float s, float lr,
        float wdf, float lrc, float bc1, float bc2, const hyper_t h, int64_t *c) {
    uint16_t *const P = (uint16_t *)p, *const V = (uint16_t *)v, *const S = (uint16_t *)(sf ? z : m);
    for (int q = 0; q < 2; q++) {
        _mm512_storeu_si512(P + j + 32 * q, raw[3 * q]);
        _mm512_storeu_si512(V + j + 32 * q, raw[3 * q + 1]);
        _mm512_storeu_si512(S + j + 32 * q, raw[3 * q + 2]);
    }
    update_block_t_(1, sf, gate, 0, decay_z, p, g, m, v, z, j, j + BF_STEP_, s, lr, wdf, lrc, bc1, bc2, h, 0, 0, c);
}

/* One step of 64 entries at j (gate: "repair" or "skip" on a tensor decided entry by entry; 0: "off"). */
static inline __attribute__((always_inline)) void bf_step_(
        const int sf, const int gate, const int decay_z, void *restrict p, const void *restrict g,
        void *restrict m, void *restrict v, void *restrict z, int64_t j, const vhyper_t *k, float s, float lr,
        float wdf, float lrc, float bc1, float bc2, const hyper_t h, int64_t *c) {
    const uint16_t *const G = (const uint16_t *)g;
    uint16_t *const P = (uint16_t *)p, *const V = (uint16_t *)v, *const S = (uint16_t *)(sf ? z : m);
    __m512i raw[6], rg[2]; /* raw: p, v, m or z of each half of the step, in that order */
    for (int q = 0; q < 2; q++) {
        rg[q] = _mm512_loadu_si512(G + j + 32 * q);
        raw[3 * q] = _mm512_loadu_si512(P + j + 32 * q);
        raw[3 * q + 1] = _mm512_loadu_si512(V + j + 32 * q);
        raw[3 * q + 2] = _mm512_loadu_si512(S + j + 32 * q);
    }
    __m512 check[4];
    int64_t unused = 0;
    for (int q = 0; q < 2; q++) {
        __m512i out[2][3]; /* [half][y, v, m or z] rounded */
        for (int half = 0; half < 2; half++) {
            const __m512 gr = bf_half_(rg[q], half), po = bf_half_(raw[3 * q], half);
            const __m512 vo = bf_half_(raw[3 * q + 1], half), so = bf_half_(raw[3 * q + 2], half);
            __m512 vn, mn, y, zn = sf ? so : _mm512_setzero_ps();
            arith_(sf, decay_z, 0, _mm512_mul_ps(gr, k->s), vo, sf ? _mm512_setzero_ps() : so, po,
                   sf ? so : _mm512_setzero_ps(), 0, (__mmask16)0xFFFF, k, &vn, &mn, &y, &zn, &unused);
            out[half][0] = bf_round_(y);
            out[half][1] = bf_round_(vn);
            out[half][2] = bf_round_(sf ? zn : mn);
            check[2 * q + half] = vcheck_(1, _mm512_castsi512_ps(out[half][1]), _mm512_castsi512_ps(out[half][0]),
                                          _mm512_castsi512_ps(out[half][2]), _mm512_setzero_ps());
        }
        _mm512_storeu_si512(P + j + 32 * q, bf_pack_(out[0][0], out[1][0]));
        _mm512_storeu_si512(V + j + 32 * q, bf_pack_(out[0][1], out[1][1]));
        _mm512_storeu_si512(S + j + 32 * q, bf_pack_(out[0][2], out[1][2]));
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(check[0], check[1]), _mm512_add_ps(check[2], check[3]));
    if (__builtin_expect(_mm512_fpclass_ps_mask(sum, NONFINITE_) != 0, 0))
        bf_step_exact_(sf, gate, decay_z, p, g, m, v, z, j, raw, s, lr, wdf, lrc, bc1, bc2, h, c);
}

static inline __attribute__((always_inline)) void bf_loop_(
        const int sf, const int gate, const int decay_z, const int small, void *restrict p, const void *restrict g,
        void *restrict m, void *restrict v, void *restrict z, int64_t b0, int64_t b1, const vhyper_t *k0, float s,
        float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h, int64_t *c) {
    vhyper_t k = *k0;
    if (sf) k.u.small_c = small; else k.small_w = small;
    for (int64_t j = b0; j + BF_STEP_ <= b1; j += BF_STEP_)
        bf_step_(sf, gate, decay_z, p, g, m, v, z, j, &k, s, lr, wdf, lrc, bc1, bc2, h, c);
}

/* update_block_bf16_ (scalar_bf16.h) for [b0, b1), same arguments, same bits, same counts. */
static inline __attribute__((always_inline)) void update_block_bf16_avx512(
        const int sf, const int gate, const int clean, const int decay_z,
        void *restrict p, const void *restrict g, void *restrict m, void *restrict v, void *restrict z,
        int64_t b0, int64_t b1, float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h,
        int hold, int keep_all, int64_t *c) {
    (void)clean;
    if (bf16_whole_block_(sf, gate, decay_z, BF16_BLOCK_ARGS_, hold, keep_all, c)) return;
    const vhyper_t k = vhyper_make_(s, lr, wdf, lrc, bc1, bc2, h);
    const int small = sf ? k.u.small_c : k.small_w;
    if (small) bf_loop_(sf, gate, decay_z, 1, p, g, m, v, z, b0, b1, &k, s, lr, wdf, lrc, bc1, bc2, h, c);
    else bf_loop_(sf, gate, decay_z, 0, p, g, m, v, z, b0, b1, &k, s, lr, wdf, lrc, bc1, bc2, h, c);
    bf16_tail_(sf, gate, decay_z, BF_STEP_, BF16_BLOCK_ARGS_, c);
}
#endif
#endif
