/* The (SF-)AdamW step's per-entry arithmetic and its portable block loop, for scalar_step.c: the
 * hyperparameters (hyper_t), the magnitude bounds of the early tests (clean_limit_, input_limit_), the sums
 * of squares of pass 1, one entry's gates and values (entry_), the loop over a block of entries that
 * every build runs where a block needs the exact path (update_block_t_) and the generic build's form of it
 * (update_block_spec, at the end). scalar_avx512.h, included in the
 * middle, is the AVX-512 form of the block loop and its sums; scalar_step.c includes the other SIMD forms
 * after this file (they call update_block on their rare paths) and drives the blocks over tensors and
 * threads.
 *
 * Included by scalar_step.c only (static inline: one translation unit, compiled with its flags).
 */
#ifndef NONANS_SCALAR_ENTRY_H
#define NONANS_SCALAR_ENTRY_H

#include <float.h>

#include "common.h"

typedef struct {
    float one_m_b1, b2, one_m_b2, eps, wd, c, coef;
} hyper_t;

/* Finite hyperparameters, the precondition of every test on the inputs alone (clean_limit_, and so
 * input_limit_ and the bf16 groups): where one is not — a tensor lr a scheduler filled with NaN makes lr,
 * wdf and lrc NaN — the stock arithmetic makes y NaN from finite inputs, which a bound on the inputs cannot
 * see. fmax drops a NaN operand, so clean_limit_'s factor stayed finite and, until 2026-11-27, the AVX2
 * loop's early test passed such blocks and stored NaN parameters where the gated loop keeps p (the AVX-512
 * loop tests the new values, which a NaN reaches). For bf16 there is a second reason: the stock
 * arithmetic's NaN carries its payload, and the NaN-free rounding of a tested group (f32_to_bf16_rne_)
 * carries a payload whose top mantissa bits are all set into the sign bit — a NaN y would be stored as -0.
 * NaNs from the arithmetic on finite values (the default NaN) and from bf16 inputs (low half 0) round to
 * NaN. Once per block. */
static inline int finite_hyper_(float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h) {
    const float x[] = {s, lr, wdf, lrc, bc1, bc2, h.one_m_b1, h.b2, h.one_m_b2, h.eps, h.wd, h.c, h.coef};
    int ok = 1;
    for (size_t i = 0; i < sizeof x / sizeof x[0]; i++) ok &= finitef_(x[i]);
    return ok;
}

/* The magnitude bound of the AVX2 loop's early test (input_limit_ below, which tightens it; the
 * AVX-512 loop tests the new values of four vectors at once instead) for one tensor's block: the largest L
 * such that, when |g|, |p| and |z| (AdamW: |m|) are at most L and the new v is finite and not negative,
 * every value the stock arithmetic computes is finite; 0 when no such bound exists (a non-finite
 * hyperparameter, finite_hyper_; eps = 0: sqrt(0) + 0
 * divides by zero; a bias correction of 0, which validated betas never give but which would divide by zero
 * too), and then the loop takes the late test. With S = max(1, |s|) (s: the spike guard's scale)
 * and lerpk = 1 + 2·max(|w|, |1-w|) for a lerp of weight w (either of lerpf_'s forms, both operands at most
 * M in magnitude, stays within lerpk·M):
 *
 *   the new v ≥ 0 gives a denominator sqrt(v / bc2) + eps ≥ eps, or +Inf (then d = 0);
 *   AdamW:  |m| ≤ S·lerpk·L = mk·L;  |m / bc1| ≤ mk·L / bc1;  |d| ≤ mk·L / (bc1·eps);
 *           |y| = |p·wdf - lr·d| ≤ (|wdf| + |lr|·mk / (bc1·eps))·L;
 *   SF:     |d| ≤ (|s| / eps + |λ|)·L = dk·L (λ only with decoupled z decay); |z - d·lr| ≤ (1 + |lr|·dk)·L;
 *           |y| = |lerp(p, z, c) + d·lrc| ≤ (lerpk + |lrc|·dk)·L;  z - p inside the lerp ≤ 2L.
 *
 * L is FLT_MAX / 8 over the largest of these factors: eight, not one, covers the few roundings (each at most
 * a factor 1 + 2⁻²⁴) between a bound and the value. Computed in double, once per block. */
static inline float clean_limit_(const int sf, const int decay_z, float s, float lr, float wdf, float lrc,
                                 float bc1, float bc2, const hyper_t h) {
    const double w = sf ? h.c : h.one_m_b1, lerpk = 1.0 + 2.0 * fmax(fabs(w), fabs(1.0 - w));
    const double S = fmax(1.0, fabs((double)s)), eps = h.eps;
    double k;
    if (sf) {
        const double dk = fabs((double)s) / eps + (decay_z ? fabs((double)h.wd) : 0.0);
        k = fmax(fmax(2.0, dk), fmax(1.0 + fabs((double)lr) * dk, lerpk + fabs((double)lrc) * dk));
    } else {
        const double mk = S * lerpk, dk = mk / (fabs((double)bc1) * eps);
        k = fmax(fmax(mk / fabs((double)bc1), dk), fabs((double)wdf) + fabs((double)lr) * dk);
    }
    if (!(eps > 0.0) || !(bc2 > 0.0f) || !(k < INFINITY) || !finite_hyper_(s, lr, wdf, lrc, bc1, bc2, h))
        return 0.0f; /* !(k < Inf): a NaN k too; fmax drops a NaN operand, hence the hyperparameters' own test */
    return (float)(FLT_MAX / 8.0 / k);
}

/* The early test's bound on the inputs alone, in double, once per block: |g|, |p| and |z| (AdamW: |m|) at
 * most L = min(clean_limit_, G) and the old v in [+0, FLT_MAX / 4]; 0 where clean_limit_ has no bound. With
 * G = sqrt(FLT_MAX / 4 / (1 - β₂)) / max(1, |s|), the new v = v·β₂ + ((1-β₂)·g·s)·g·s stays within
 * FLT_MAX / 2 (the factor 2 over the bound covers the roundings), so it is finite and not negative, which is
 * what clean_limit_'s derivation assumes of it. Every bound is far below bf16's largest finite value too, so
 * it serves the bf16 loop (scalar_bf16.h) as it is. Unlike scalar_avx512.h's test (of the new values), it
 * needs nothing the step computes, so a group of entries is tested before its arithmetic starts and nothing
 * speculative has to stay in registers while it is: AVX2 has 16 vector registers, and holding two vectors'
 * results for a test made the gated loop spill (a scratch C driver calling nonans_scalar_step, 1M entries,
 * one thread, 30 alternations: that pair form ran 1.19x "off" for AdamW and 1.47x for SFAdamW; this form
 * 1.07x and 1.23x). */
static inline float input_limit_(const int sf, const int decay_z, float s, float lr, float wdf, float lrc,
                                 float bc1, float bc2, const hyper_t h) {
    const float lim = clean_limit_(sf, decay_z, s, lr, wdf, lrc, bc1, bc2, h);
    const double G = sqrt((double)FLT_MAX / 4.0 / (double)h.one_m_b2) / fmax(1.0, fabs((double)s));
    return lim > 0.0f && h.one_m_b2 > 0.0f ? (float)fmin((double)lim, G) : 0.0f;
}

/* The sum of 16 lanes, halving: lanes[i] + lanes[i + 8], then + 4, + 2, + 1 (both builds' order). */
static inline float sum16_(float *lanes) {
    for (int w = 8; w > 0; w /= 2)
        for (int i = 0; i < w; i++) lanes[i] += lanes[i + w];
    return lanes[0];
}

/* Pass 1's fp32 sum of squares of g[b0, b1) in a fixed order that a vector loop reproduces: 64 lanes
 * (entry j + l of each full group of 64 into lane l; the rest, in order, into lanes 0–15), folded as
 * lanes l, l+16, l+32, l+48 → (l + (l+16)) + ((l+32) + (l+48)), then sum16_. Independent lanes, not one
 * running sum: one accumulator chain made the pass latency-bound. */
static inline __attribute__((always_inline)) float sumsq_t_(const int bf, const void *restrict g, int64_t b0,
                                                             int64_t b1) {
    float acc[64] = {0.0f};
    int64_t j = b0;
    for (; j + 64 <= b1; j += 64)
#pragma omp simd
        for (int l = 0; l < 64; l++) acc[l] += ld_(g, j + l, bf) * ld_(g, j + l, bf);
    for (int64_t t = 0; j + t < b1; t++) acc[t % 16] += ld_(g, j + t, bf) * ld_(g, j + t, bf);
    float lanes[16];
    for (int l = 0; l < 16; l++) lanes[l] = (acc[l] + acc[l + 16]) + (acc[l + 32] + acc[l + 48]);
    return sum16_(lanes);
}

static inline float sumsq_portable(const float *restrict g, int64_t b0, int64_t b1) { return sumsq_t_(0, g, b0, b1); }

#include "scalar_avx512.h"

/* One entry's values from its loaded inputs (so: m for AdamW, z for schedule-free): the new parameter y,
 * v and m or z, and what the gates did (miss: a missing observation, un/ub: the update stage's NaN and
 * non-finite counts, with z's added for schedule-free). The arithmetic of update_block_t_'s loop, shared
 * with scalar_bf16.h's tested loop, so that both write the same bits. */
typedef struct {
    float y, vn, sn;
    int miss, un, ub;
} entry_t;

static inline __attribute__((always_inline)) entry_t entry_(
        const int bf, const int sf, const int gate, const int clean, const int decay_z, float gr, float vo,
        float so, float po, float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h,
        int hold, int keep_all) {
    entry_t e = {0.0f, 0.0f, 0.0f, 0, 0, 0};
    const int ok = clean ? 1 : finitef_(gr);
    const float gs = gr * s; /* s == 1.0f exactly unless the spike guard fired */
    const float g2 = h.one_m_b2 * gs * gs;
    float vn = vo * h.b2 + g2;
    float mo = sf ? 0.0f : so, mn, zo = sf ? so : 0.0f, zn = 0.0f, y;
    if (sf) {
        mn = gate ? (ok ? gs : 0.0f) : gs; /* no first moment: a missing entry moves nothing */
    } else {
        mn = lerpf_(mo, gate ? (ok ? gs : mo) : gs, h.one_m_b1); /* missing: m keeps its value */
    }
    if (gate) {
        /* a finite g can still overflow m (g - m inside the lerp) or v (g²): a missing observation, as
         * a bad g is (whose new v is never finite) — both moments keep their values and the entry moves
         * nothing in z (functional/adam.py::_observed; keeping only the one that overflowed moved a
         * parameter by ~1e35). The moment stage counts such entries once; a bad g never makes m
         * non-finite (it is gated to m itself), so vbad - (bad g) stays the moment count. */
        e.miss = !storable_(vn, bf) | (sf ? 0 : !storable_(mn, bf));
        vn = e.miss ? vo : vn;
        mn = e.miss ? (sf ? 0.0f : mo) : mn;
    }
    const float denom = sqrtf(vn / bc2) + h.eps;
    float d = sf ? mn / denom : (mn / bc1) / denom;
    if (sf) {
        if (decay_z) d = d + zo * h.wd;
        y = lerpf_(po, zo, h.c) + d * lrc;
        zn = zo - d * lr;
    } else {
        y = po * wdf - lr * d;
    }
    if (gate) {
        e.un = y != y;
        e.ub = !storable_(y, bf);
        y = (storable_(y, bf) & !hold) ? y : po;
        if (sf) {
            e.un += zn != zn;
            e.ub += !storable_(zn, bf);
            zn = (storable_(zn, bf) & !hold) ? zn : zo;
        }
        if (!clean && keep_all) { /* "skip": the tensor had a bad entry; counted, nothing written */
            y = po;
            vn = vo;
            mn = mo;
            zn = zo;
        }
    }
    e.y = y;
    e.vn = vn;
    e.sn = sf ? zn : mn;
    return e;
}

/* One block [b0, b1) of pass 2, adding its five counts to c. bf/sf/gate/clean/decay_z are compile-time
 * constants at every call site, so the compiler emits one straight vector loop per variant (bf: the
 * tensors are bf16, see the top of this file; update_block is the fp32 form).
 *
 * Counting is most of the resolution's arithmetic once the data is cache-resident (python -m experiments
 * overhead, "by tensor size"), so the loop keeps three counters, not five: a non-finite g always gives a
 * non-finite new v (NaN² is NaN, ±Inf² is Inf), so one count of non-finite new v (and new m) covers both
 * the bad gradient entries and the finite ones whose square or lerp overflowed (the moment stage, counted
 * as functional/adam.py counts it). Only a block where it is nonzero counts its NaN and non-finite gradient
 * entries again, from g, which the loop never writes — exact, and rare. clean: pass 1 found no non-finite
 * g in this block (and the tensor is neither held nor kept whole), so the gradient gate selects nothing
 * and the recount is not needed. This is the portable form; scalar_avx512.h and scalar_avx2.h have the same
 * loop in AVX-512 and AVX2 intrinsics, which the build uses where the CPU has them, and scalar_bf16.h the
 * test that lets a bf16 block run it without the gates. */
static inline __attribute__((always_inline)) void update_block_t_(
        const int bf, const int sf, const int gate, const int clean, const int decay_z,
        void *restrict p, const void *restrict g, void *restrict m, void *restrict v, void *restrict z,
        int64_t b0, int64_t b1, float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h,
        int hold, int keep_all, int64_t *c) {
    int vbad = 0, un = 0, ub = 0;
    void *const st = sf ? z : m;
#pragma omp simd reduction(+ : vbad, un, ub)
    for (int64_t j = b0; j < b1; j++) {
        const entry_t e = entry_(bf, sf, gate, clean, decay_z, ld_(g, j, bf), ld_(v, j, bf), ld_(st, j, bf),
                                 ld_(p, j, bf), s, lr, wdf, lrc, bc1, bc2, h, hold, keep_all);
        vbad += e.miss;
        un += e.un;
        ub += e.ub;
        st_(p, j, e.y, bf);
        st_(v, j, e.vn, bf);
        st_(st, j, e.sn, bf);
    }
    int gn = 0, gb = 0;
    if (!clean && vbad > 0) {
#pragma omp simd reduction(+ : gn, gb)
        for (int64_t j = b0; j < b1; j++) {
            const float gj = ld_(g, j, bf);
            gn += gj != gj;
            gb += !finitef_(gj);
        }
    }
    c[0] += gn; c[1] += gb; c[2] += vbad - gb; c[3] += un; c[4] += ub;
}

static inline __attribute__((always_inline)) void update_block(
        const int sf, const int gate, const int clean, const int decay_z,
        float *restrict p, const float *restrict g, float *restrict m, float *restrict v, float *restrict z,
        int64_t b0, int64_t b1, float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h,
        int hold, int keep_all, int64_t *c) {
    update_block_t_(0, sf, gate, clean, decay_z, p, g, m, v, z, b0, b1, s, lr, wdf, lrc, bc1, bc2, h, hold,
                    keep_all, c);
}

/* update_block for [b0, b1) as the generic build runs it (scalar_step.c: a CPU without the AVX-512 and
 * AVX2 forms — aarch64, say — unless NONANS_PORTABLE asks for the exact loops alone): same arguments,
 * same bits, same counts. Under a gate with a bound (input_limit_), each group of SPEC_F32 entries runs
 * the stock arithmetic (entry_ without gates) into three small arrays while the same loop takes the
 * largest magnitude of g, p and m or z and the largest raw bits of the old v; a group within the bound
 * cannot fire a gate (clean_limit_'s derivation), so its arrays are the gated loop's values and are copied
 * out; a group that fails, and the tail, are computed again by the gated loop from their untouched
 * inputs. The test on bit patterns is the AVX2 form's (scalar_avx2.h), the frame scalar_bf16.h's.
 *
 * Why: gcc vectorises the gated loop by if-converting its selects, computing both sides of each. On an
 * x86 CPU with AVX-512 (python -m experiments simd, 2026-11-27, RESULTS.md "simd-avx512"; fp32, 65K / 1M /
 * 16M entries) "repair" ran 1.14 / 1.09 / 1.19x "off" (AdamW) and 1.24 / 1.49 / 1.31x (SFAdamW) in the exact
 * portable build, 1.07 / 1.02 / 1.01x and 1.05 / 1.06 / 1.02x in this form. The bf16 loop has run this
 * frame since 2026-11-26. No aarch64 machine has measured it; built here without AVX-512's masked vectors
 * (-mno-avx512f, closer to NEON), the gated loop's C call ran 1.8-2.2x "off" and this form's 1.06-1.38x (a
 * scratch script, not in RESULTS.md). */
#define SPEC_F32 64

static inline uint32_t f32_bits_(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline __attribute__((always_inline)) void update_block_spec(
        const int sf, const int gate, const int clean, const int decay_z,
        float *restrict p, const float *restrict g, float *restrict m, float *restrict v, float *restrict z,
        int64_t b0, int64_t b1, float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h,
        int hold, int keep_all, int64_t *c) {
    const float lim = gate && !hold && !keep_all ? input_limit_(sf, decay_z, s, lr, wdf, lrc, bc1, bc2, h) : 0.0f;
    if (!(lim > 0.0f)) { /* "off", a held or "skip" tensor, no bound (eps = 0, a non-finite hyperparameter) */
        update_block(sf, gate, clean, decay_z, p, g, m, v, z, b0, b1, s, lr, wdf, lrc, bc1, bc2, h, hold, keep_all,
                     c);
        return;
    }
    const uint32_t lb = f32_bits_(lim), vlb = f32_bits_(FLT_MAX / 4.0f);
    float *const S = sf ? z : m;
    int64_t j = b0;
    for (; j + SPEC_F32 <= b1; j += SPEC_F32) {
        float ty[SPEC_F32], tv[SPEC_F32], ts[SPEC_F32];
        uint32_t mx = 0, vx = 0;
#pragma omp simd reduction(max : mx, vx)
        for (int l = 0; l < SPEC_F32; l++) {
            const float gf = g[j + l], pf = p[j + l], sv = S[j + l], vf = v[j + l];
            const uint32_t a = f32_bits_(gf) & 0x7FFFFFFFu, b = f32_bits_(pf) & 0x7FFFFFFFu;
            const uint32_t d = f32_bits_(sv) & 0x7FFFFFFFu, vb = f32_bits_(vf), ab = a > b ? a : b;
            const uint32_t abd = ab > d ? ab : d;
            mx = abd > mx ? abd : mx;
            vx = vb > vx ? vb : vx;
            const entry_t e = entry_(0, sf, 0, 0, decay_z, gf, vf, sv, pf, s, lr, wdf, lrc, bc1, bc2, h, 0, 0);
            ty[l] = e.y;
            tv[l] = e.vn;
            ts[l] = e.sn;
        }
        if (mx <= lb && vx <= vlb) {
            memcpy(p + j, ty, sizeof ty);
            memcpy(v + j, tv, sizeof tv);
            memcpy(S + j, ts, sizeof ts);
        } else {
            update_block(sf, 1, clean, decay_z, p, g, m, v, z, j, j + SPEC_F32, s, lr, wdf, lrc, bc1, bc2, h, 0, 0, c);
        }
    }
    if (j < b1)
        update_block(sf, 1, clean, decay_z, p, g, m, v, z, j, b1, s, lr, wdf, lrc, bc1, bc2, h, 0, 0, c);
}

#endif /* NONANS_SCALAR_ENTRY_H */
