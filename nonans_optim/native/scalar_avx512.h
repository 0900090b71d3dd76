/* The AVX-512 form of scalar_entry.h's update_block and of pass 1's sum of squares (see simd_avx512.h for
 * when it is compiled in, and why intrinsics). The portable update loop ran 1.7x (AdamW) and 2.5x
 * (SFAdamW) its "off" loop on cache-resident data; this one about 1.05–1.1x (a C driver over 262K
 * entries, one thread), and 1.00–1.03x once it tested vectors in pairs with the lerp form fixed at
 * compile time (13 x 262K entries, one thread, best of 30 rounds), with the same bits. A vector-at-a-time
 * loop then gained from testing the loaded values and the new v instead of the new values (an "early" test
 * on the inputs' magnitudes, which did not wait for the end of the divide-and-square-root chain: SFAdamW
 * 1.025x → 1.007x, same driver). Those drivers held one layout of the arrays in memory; across layouts
 * (4K aliasing, vec_quad_) the ratio moved far more, and the clean loops of both policies now take four
 * vectors per step — where the late test's wait is hidden behind the other three vectors' work and its
 * fewer operations win: on the default GPT, one process per run alternating the two builds on the same
 * tensors (2026-11-25, 5 processes x 40 rounds), repair/off went from 1.037 to 1.013 (AdamW) and 1.032
 * to 1.026 (SFAdamW) with 2 threads, 1.038 to 1.034 and 1.058 to 1.052 with one; so the quads test late.
 *
 * Pass 1's sum of squares runs four independent vector accumulators (one chain was latency-bound), the
 * 64 lanes of scalar_entry.h's sumsq_portable, added in the same order — the guard's scale, and so every
 * value a step with a triggered guard writes, is the same in both builds. */
#ifndef NONANS_SCALAR_AVX512_H
#define NONANS_SCALAR_AVX512_H
#include "simd_avx512.h"
#ifdef NONANS_AVX512
#include <float.h>

typedef struct {
    __m512 s, one_m_b2, b2, w, one_m_w, bc1, bc2, eps;
    int small_w;
    vparam_t u;
} vhyper_t;

/* The arithmetic of one vector from its loaded inputs: new v, m (AdamW), y and z (schedule-free).
 * gated: the exact resolution — the gradient gate (gbad: its non-finite lanes) and the second-moment
 * gate, which must precede the denominator, with vb counting non-finite new v; otherwise the stock
 * arithmetic, which is what a vector with no non-finite value anywhere computes under either. */
static inline __attribute__((always_inline)) void arith_(
        const int sf, const int decay_z, const int gated, __m512 gs, __m512 vo, __m512 mo, __m512 po, __m512 zo,
        __mmask16 gbad, __mmask16 lm, const vhyper_t *k, __m512 *vn_, __m512 *mn_, __m512 *y_, __m512 *zn_,
        int64_t *vb) {
    const __m512 g2 = _mm512_mul_ps(_mm512_mul_ps(k->one_m_b2, gs), gs);
    __m512 vn = _mm512_add_ps(_mm512_mul_ps(vo, k->b2), g2), mn;
    if (sf) mn = gated ? _mm512_maskz_mov_ps((__mmask16)~gbad, gs) : gs; /* a missing entry moves nothing */
    else mn = vlerp_(mo, gated ? _mm512_mask_blend_ps(gbad, gs, mo) : gs, k->w, k->one_m_w, k->small_w);
    if (gated) { /* new v or (AdamW) new m not finite: a missing observation, both moments kept, the
                  * entry moves nothing in z (scalar_entry.h's update_block); it counts once */
        __mmask16 miss = _mm512_fpclass_ps_mask(vn, NONFINITE_) & lm;
        if (!sf) miss |= _mm512_fpclass_ps_mask(mn, NONFINITE_) & lm;
        vn = _mm512_mask_blend_ps(miss, vn, vo);
        mn = sf ? _mm512_maskz_mov_ps((__mmask16)~miss, mn) : _mm512_mask_blend_ps(miss, mn, mo);
        *vb += __builtin_popcount(miss);
    }
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(_mm512_div_ps(vn, k->bc2)), k->eps);
    const __m512 d = sf ? _mm512_div_ps(mn, denom) : _mm512_div_ps(_mm512_div_ps(mn, k->bc1), denom);
    *y_ = vparam_(sf, decay_z, d, po, zo, &k->u, zn_);
    *vn_ = vn;
    *mn_ = mn;
}

/* The inputs of one vector at entry j (lm: the live lanes of a partial last vector; full: all 16). */
typedef struct {
    __m512 gr, gs, vo, mo, po, zo;
} vin_t;

static inline __attribute__((always_inline)) vin_t vin_load_(
        const int sf, const int full, __mmask16 lm, float *restrict p, const float *restrict g,
        float *restrict m, float *restrict v, float *restrict z, int64_t j, const vhyper_t *k) {
    vin_t x;
    x.gr = vload_(full, lm, g + j);
    x.gs = _mm512_mul_ps(x.gr, k->s);
    x.vo = vload_(full, lm, v + j);
    x.po = vload_(full, lm, p + j);
    x.mo = sf ? _mm512_setzero_ps() : vload_(full, lm, m + j);
    x.zo = sf ? vload_(full, lm, z + j) : _mm512_setzero_ps();
    return x;
}

/* The exact (gated) values of one vector, counted: the path of a vector that failed the test below, and
 * of every vector of a held or "skip" tensor. */
static inline __attribute__((always_inline)) void vec_exact_(
        const int sf, const int decay_z, const vin_t *x, __mmask16 lm, const vhyper_t *k, int hold, int skip_all,
        __m512 *vn, __m512 *mn, __m512 *y, __m512 *zn, int64_t *vb, int64_t *un, int64_t *ub) {
    const __mmask16 keep = hold ? lm : 0;
    arith_(sf, decay_z, 1, x->gs, x->vo, x->mo, x->po, x->zo, _mm512_fpclass_ps_mask(x->gr, NONFINITE_), lm, k,
           vn, mn, y, zn, vb);
    *y = guard_(*y, x->po, _mm512_fpclass_ps_mask(*y, NONFINITE_) & lm, keep, un, ub);
    if (sf) *zn = guard_(*zn, x->zo, _mm512_fpclass_ps_mask(*zn, NONFINITE_) & lm, keep, un, ub);
    if (skip_all) { /* "skip": the tensor had a bad entry; counted, nothing written */
        *y = x->po;
        *vn = x->vo;
        *mn = x->mo;
        *zn = x->zo;
    }
}

static inline __attribute__((always_inline)) void vec_store_(
        const int sf, const int full, __mmask16 lm, float *restrict p, float *restrict m, float *restrict v,
        float *restrict z, int64_t j, __m512 vn, __m512 mn, __m512 y, __m512 zn) {
    vstore_(full, lm, p + j, y);
    vstore_(full, lm, v + j, vn);
    if (sf) vstore_(full, lm, z + j, zn);
    else vstore_(full, lm, m + j, mn);
}

/* The value the speculation tests, non-finite wherever new v, y or (schedule-free) z is: v·y + z (AdamW:
 * v·y + acc, acc a former check or 0 for none), one FMA. A product or sum with a NaN or ±Inf operand is
 * NaN or ±Inf — 0·Inf is NaN, Inf - Inf is NaN — so no non-finite value goes unseen; a finite v·y or sum
 * can still overflow (|v·y| beyond FLT_MAX: a gradient near 1e15 beside a parameter near 1e8), which only
 * sends the vector to the exact path, whose values are then the same. Why a product and not the sum
 * v + y + z it replaced: one operation for three values instead of two — the test is most of what the
 * clean gated loop adds to "off" (with no test at all it ran at "off"'s speed), and 512-bit FP operations
 * share two ports with the divides and square roots that bound the loop. A scratch driver calling
 * nonans_scalar_step on the default GPT's 52 tensors, the two builds and "off" interleaved in one process
 * (2026-11-26, Intel Xeon with AVX-512, 4 processes x 100 rounds, 2 threads): repair/off SFAdamW
 * 1.026-1.050 → 1.011-1.037, the new build 0.9-1.8% faster in every process; AdamW about 0.5%. */
static inline __attribute__((always_inline)) __m512 vcheck_(const int sf, __m512 vn, __m512 y, __m512 zn,
                                                             __m512 acc) {
    return _mm512_fmadd_ps(vn, y, sf ? zn : acc);
}

/* One vector of update_block at entry j. Counts: vb, non-finite new v (the loop's moment stage, before
 * subtracting the bad gradient entries); un/ub, NaN/non-finite new y and z. exact: a held or "skip"
 * tensor, computed with the gates throughout (a compile-time constant, so the clean loop tests nothing
 * else).
 *
 * Speculate, then verify, in registers: the stock arithmetic first, then one test of vcheck_'s v·y (+ z).
 * A non-finite gradient entry makes its new v non-finite (NaN² is NaN, ±Inf² is Inf), and a new v, y or
 * z that is NaN or ±Inf makes the check so; when the test finds nothing, no gate would have selected
 * anything and the stock values are the exact ones. Only a vector that fails it is computed again with
 * the gates — from the inputs still in registers, since nothing has been stored. The check can also
 * overflow where every term is finite; that only takes the exact path. A new m that overflowed (AdamW)
 * is not in the test, and needs not be: it makes d, and so y, non-finite. */
static inline __attribute__((always_inline)) void vec_update_(
        const int sf, const int gate, const int decay_z, const int full, const int exact, __mmask16 lm,
        float *restrict p, const float *restrict g, float *restrict m, float *restrict v, float *restrict z,
        int64_t j, const vhyper_t *k, int hold, int skip_all, int64_t *vb, int64_t *un, int64_t *ub) {
    const vin_t x = vin_load_(sf, full, lm, p, g, m, v, z, j, k);
    __m512 vn, mn, y, zn = x.zo;
    if (gate && exact) {
        vec_exact_(sf, decay_z, &x, lm, k, hold, skip_all, &vn, &mn, &y, &zn, vb, un, ub);
    } else {
        arith_(sf, decay_z, 0, x.gs, x.vo, x.mo, x.po, x.zo, 0, lm, k, &vn, &mn, &y, &zn, vb);
        if (gate && __builtin_expect(
                (_mm512_fpclass_ps_mask(vcheck_(sf, vn, y, zn, _mm512_setzero_ps()), NONFINITE_) & lm) != 0, 0))
            vec_exact_(sf, decay_z, &x, lm, k, 0, 0, &vn, &mn, &y, &zn, vb, un, ub);
    }
    vec_store_(sf, full, lm, p, m, v, z, j, vn, mn, y, zn);
}

#define QUAD_ 4 /* vectors per step of the clean loop (vec_quad_) */

/* The exact path of a quad that failed its test: reloaded (vec_quad_ has put its loaded values back),
 * computed with the gates and stored, vector by vector. Out of line and cold, so that the hot loop keeps
 * no registers for it. */
static __attribute__((noinline, cold)) void quad_exact_(
        const int sf, const int decay_z, float *restrict p, const float *restrict g, float *restrict m,
        float *restrict v, float *restrict z, int64_t j, const vhyper_t *k, int64_t *vb, int64_t *un, int64_t *ub) {
    const __mmask16 all = (__mmask16)0xFFFF;
    for (int q = 0; q < QUAD_; q++) {
        const vin_t x = vin_load_(sf, 1, all, p, g, m, v, z, j + 16 * q, k);
        __m512 vn, mn, y, zn = x.zo;
        vec_exact_(sf, decay_z, &x, all, k, 0, 0, &vn, &mn, &y, &zn, vb, un, ub);
        vec_store_(sf, 1, all, p, m, v, z, j + 16 * q, vn, mn, y, zn);
    }
}

/* Four full vectors at j … j + 48 of a clean loop, "off" (gate 0) and the gated one alike: every load and
 * then each vector's arithmetic and its stores; the gated loop then tests the four (schedule-free: the sum
 * of their vcheck_ values; AdamW: one vcheck_ chain through the four) and, in a quad that fails, puts the
 * loaded values back and takes quad_exact_.
 *
 * Why store before the test: the stock values are the exact ones unless the test fails, which a clean step
 * never does, so the stores need not wait for it. When they came after it (until 2026-11-26), each quad's
 * stores sat behind a branch on its last vector's y, the end of the divide-and-square-root chain, and the
 * gated loop held more of the core's window than "off" (our reading of why the late test cost something
 * once the data was cache-resident, not a measured mechanism). Loop-only scratch A/B (one process
 * alternating the two builds, min of 20 calls, one tensor, 2 threads; 2026-11-26): repair/off at 65,536 /
 * 262,144 / 1,048,576 entries went from 1.010 / 1.032 / 1.012 to 0.999 / 1.019 / 1.019 (AdamW) and from
 * 1.062 / 1.046 / 1.024 to 1.005 / 1.018 / 1.014 (SFAdamW); ``python -m experiments simd`` measures the
 * builds as they are (one tensor, whole step), and on the default GPT the same-tensor controls of
 * ``python -m experiments overhead`` did not resolve the change (they moved more between runs of the same
 * code). The put-back keeps the four loaded vectors of p, v and m (or z) alive until the test: registers,
 * some of which gcc spills to the stack.
 *
 * Why four, loads before stores, for "off" too: 4K aliasing. A load whose address matches an older store's
 * in its low 12 bits waits for that store, although the addresses differ; a vector-at-a-time loop whose
 * stored array (p, or m/z) sits one cache line ahead of a loaded one (g, v, ...) modulo 4096 has every
 * iteration's loads wait on the previous iteration's stores, whose values end the divide-and-square-root
 * chain. Where the arrays sit is the allocator's choice, so the loop's speed was a per-process lottery:
 * ``python -m experiments aliasing`` on commit 812ff8b (2026-11-25; the "before" columns of RESULTS.md,
 * "Native loop time by array offsets: 4K aliasing" as published at ba31408 — the section's baseline is now a
 * later build) measured the vector-at-a-time "off" loop at up to 1.32x its aligned time and the former
 * two-vector gated loop at up to 1.17x, which moved repair/off between 0.88 and 1.07 from one layout to
 * another. With four vectors per step only one boundary in four can stall, and both policies run the same
 * loop shape, so a layout slows both alike (the section as published at 86bfde0, AMD: "off" at most 1.05x
 * aligned, repair/off 1.02-1.05 on every layout; at 54b1018, Intel, with vcheck_'s FMA test: "off" at most
 * 1.034x aligned, repair/off 0.997-1.024). */
static inline __attribute__((always_inline)) void vec_quad_(
        const int sf, const int gate, const int decay_z, float *restrict p, const float *restrict g,
        float *restrict m, float *restrict v, float *restrict z, int64_t j, const vhyper_t *k, int64_t *vb,
        int64_t *un, int64_t *ub) {
    const __mmask16 all = (__mmask16)0xFFFF;
    vin_t x[QUAD_];
    for (int q = 0; q < QUAD_; q++) x[q] = vin_load_(sf, 1, all, p, g, m, v, z, j + 16 * q, k);
    /* each vector stored as soon as it is computed (after every load of the quad: no load of this quad
     * can wait on these stores), so its results die there and only the loaded values and the four checks
     * stay live: the put-back's registers spilled less, and both policies ran faster (loop-only scratch
     * A/B, 2026-11-26, against storing the four at the end: "off" and "repair" both 0.7-4% faster at
     * 65K/262K/1M entries, AdamW and SFAdamW) */
    __m512 check[QUAD_], chain = _mm512_setzero_ps();
    for (int q = 0; q < QUAD_; q++) {
        __m512 vn, mn, y, zn = x[q].zo;
        arith_(sf, decay_z, 0, x[q].gs, x[q].vo, x[q].mo, x[q].po, x[q].zo, 0, all, k, &vn, &mn, &y, &zn, vb);
        vec_store_(sf, 1, all, p, m, v, z, j + 16 * q, vn, mn, y, zn);
        if (gate && sf) check[q] = vcheck_(sf, vn, y, zn, chain);
        else if (gate) chain = vcheck_(sf, vn, y, zn, chain); /* AdamW: v·y added to the former check */
    }
    if (!gate) return;
    /* schedule-free: a pairwise tree, no chain of four (the former test's sums, the same tree: scratch A/B
     * on the default GPT, 2026-11-25, against a running sum from zero: repair/off AdamW 1.026 -> 1.017,
     * SFAdamW 1.030 -> 1.028). AdamW's chain takes one FMA per vector and no add; a chain of six FMAs for
     * schedule-free (products of z and y as well) measured no faster than this tree (same driver as
     * vcheck_'s, 2026-11-26). */
    _Static_assert(QUAD_ == 4, "the test's tree adds four vcheck_ values");
    const __m512 sum = sf ? _mm512_add_ps(_mm512_add_ps(check[0], check[1]), _mm512_add_ps(check[2], check[3]))
                          : chain;
    if (__builtin_expect(_mm512_fpclass_ps_mask(sum, NONFINITE_) != 0, 0)) {
        for (int q = 0; q < QUAD_; q++) /* the loaded values back: quad_exact_ reads them again */
            vec_store_(sf, 1, all, p, m, v, z, j + 16 * q, x[q].vo, x[q].mo, x[q].po, x[q].zo);
        quad_exact_(sf, decay_z, p, g, m, v, z, j, k, vb, un, ub);
    }
}

/* The vectors of [b0, b1), with the lerp form (small: the uniform weight, β₁'s 1-β₁ for AdamW or the
 * schedule-free c, is below 0.5) a compile-time constant: a weight decided at run time inside the loop
 * kept a compare and a branch in every iteration of the gated loop, which gcc hoists only from the
 * stock one. */
static inline __attribute__((always_inline)) void vec_loop_(
        const int sf, const int gate, const int decay_z, const int small, const int exact, float *restrict p,
        const float *restrict g, float *restrict m, float *restrict v, float *restrict z, int64_t b0, int64_t b1,
        const vhyper_t *k0, int hold, int skip_all, int64_t *vb, int64_t *un, int64_t *ub) {
    vhyper_t k = *k0;
    if (sf) k.u.small_c = small; else k.small_w = small;
    int64_t j = b0;
    if (!exact) /* the tail of fewer than QUAD_ vectors goes vector by vector */
        for (; j + 16 * QUAD_ <= b1; j += 16 * QUAD_)
            vec_quad_(sf, gate, decay_z, p, g, m, v, z, j, &k, vb, un, ub);
    for (; j + 16 <= b1; j += 16)
        vec_update_(sf, gate, decay_z, 1, exact, (__mmask16)0xFFFF, p, g, m, v, z, j, &k, hold, skip_all, vb, un,
                    ub);
    if (j < b1)
        vec_update_(sf, gate, decay_z, 0, exact, vlanes_(b1 - j), p, g, m, v, z, j, &k, hold, skip_all, vb, un, ub);
}

/* The 16-lane constants of one block's arithmetic (and of scalar_avx512_bf16.h's). */
static inline vhyper_t vhyper_make_(float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h) {
    const vhyper_t k = {
        _mm512_set1_ps(s), _mm512_set1_ps(h.one_m_b2), _mm512_set1_ps(h.b2), _mm512_set1_ps(h.one_m_b1),
        _mm512_set1_ps(1.0f - h.one_m_b1), _mm512_set1_ps(bc1), _mm512_set1_ps(bc2), _mm512_set1_ps(h.eps),
        fabsf(h.one_m_b1) < 0.5f,
        vparam_make_(lr, lrc, wdf, h.wd, h.c)};
    return k;
}

/* update_block (scalar_entry.h) for [b0, b1), same arguments and counts. */
static inline __attribute__((always_inline)) void update_block_avx512(
        const int sf, const int gate, const int clean, const int decay_z,
        float *restrict p, const float *restrict g, float *restrict m, float *restrict v, float *restrict z,
        int64_t b0, int64_t b1, float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h,
        int hold, int keep_all, int64_t *c) {
    const vhyper_t k = vhyper_make_(s, lr, wdf, lrc, bc1, bc2, h);
    const int skip_all = !clean && keep_all;
    int64_t vb = 0, un = 0, ub = 0;
    const int small = sf ? k.u.small_c : k.small_w;
    if (gate && (hold || skip_all))
        vec_loop_(sf, gate, decay_z, small, 1, p, g, m, v, z, b0, b1, &k, hold, skip_all, &vb, &un, &ub);
    else if (small)
        vec_loop_(sf, gate, decay_z, 1, 0, p, g, m, v, z, b0, b1, &k, 0, 0, &vb, &un, &ub);
    else
        vec_loop_(sf, gate, decay_z, 0, 0, p, g, m, v, z, b0, b1, &k, 0, 0, &vb, &un, &ub);
    int64_t gn = 0, gb = 0;
    if (!clean && vb > 0) /* a bad gradient entry always makes its new v non-finite: recount from g */
        for (int64_t i = b0; i < b1; i++) {
            gn += g[i] != g[i];
            gb += !finitef_(g[i]);
        }
    c[0] += gn; c[1] += gb; c[2] += vb - gb; c[3] += un; c[4] += ub;
}

/* sumsq_portable (scalar_entry.h) in intrinsics: the same 64 lanes, the same order of additions. */
static inline float sumsq_avx512(const float *restrict g, int64_t b0, int64_t b1) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t j = b0;
    for (; j + 64 <= b1; j += 64) {
        const __m512 x0 = _mm512_loadu_ps(g + j), x1 = _mm512_loadu_ps(g + j + 16);
        const __m512 x2 = _mm512_loadu_ps(g + j + 32), x3 = _mm512_loadu_ps(g + j + 48);
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(x0, x0));
        a1 = _mm512_add_ps(a1, _mm512_mul_ps(x1, x1));
        a2 = _mm512_add_ps(a2, _mm512_mul_ps(x2, x2));
        a3 = _mm512_add_ps(a3, _mm512_mul_ps(x3, x3));
    }
    for (; j < b1; j += 16) {
        const __m512 x = _mm512_maskz_loadu_ps(vlanes_(b1 - j), g + j);
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(x, x));
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    return sum16_(lanes);
}
#endif
#endif
