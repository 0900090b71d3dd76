/* One fused (SF-)AdamW step with the resolution stage, for contiguous fp32 or bf16 CPU tensors.
 *
 * The readable ground truth is nonans_optim/optimizers/_scalar.py (impl="loop"); the arithmetic below is
 * the one of optimizers/_compiled.py::_one_tensor, written once more as a C loop because inductor (torch
 * 2.13, CPU) splits that graph into several passes per tensor and runs the counts as separate reductions.
 * Here every entry is read once and written once, and the detection and the event counts ride along in
 * registers, which is how torch's own fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp)
 * reaches memory bandwidth.
 *
 * Passes over a tensor:
 *   1. only when a decision must precede any write (the spike guard needs the gradient's norm, "skip"
 *      needs to know whether any entry is bad, the hold rule whether *every* entry is bad): the sum of
 *      squares and the non-finite count of g, per chunk. Threads take whole chunks, and each reads the
 *      same chunks in pass 2, which it has just pulled into its L2 cache;
 *   2. the update: gate, moments, direction, parameter, last-line update guard, counts — in a leaner
 *      loop for each block that pass 1 found free of non-finite g (update_block, "clean").
 *
 * bf16 (every tensor of a call: parameter, gradient, exp_avg/z, exp_avg_sq): each entry is widened to fp32,
 * the step runs in fp32 and each result is rounded once as it is stored — what torch's fused CPU AdamW does
 * for bf16 (opmath float, aten/src/ATen/native/cpu/FusedAdamKernel.cpp) and what inductor's compiled graph
 * computes (impl="compiled", where impl="fused" sent bf16 groups before; impl="auto" sent them to the eager
 * foreach step). Bit for bit, then, the fp32 loop run on the widened values and rounded at the end, except
 * where a value is finite in fp32 and Inf once stored in bf16: the gates test finiteness *as stored*
 * (storable_), like the other implementations (tests/test_fused_bf16.py holds both). The portable loop
 * serves bf16 in every build (the SIMD forms are fp32's), under a gate through scalar_bf16.h's tested
 * groups; gcc vectorises its widening loads and rounding stores.
 *
 * Compiled with -ffp-contract=off (no FMA contraction): a clean "repair" step must be bit-identical to
 * "off", and both run this same code, so the only difference may be the selects, which change nothing
 * on a clean entry. Build and loading: nonans_optim/native/__init__.py.
 */
#include <float.h>
#include <stdlib.h>

#include "common.h"

typedef struct {
    float one_m_b1, b2, one_m_b2, eps, wd, c, coef;
} hyper_t;

/* The magnitude bound of the AVX2 loop's early test (input_limit_ below, which tightens it; the
 * AVX-512 loop tests the new values of four vectors at once instead) for one tensor's block: the largest L
 * such that, when |g|, |p| and |z| (AdamW: |m|) are at most L and the new v is finite and not negative,
 * every value the stock arithmetic computes is finite; 0 when no such bound exists (eps = 0: sqrt(0) + 0
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
    if (!(eps > 0.0) || !(bc2 > 0.0f) || !(k < INFINITY)) return 0.0f; /* !(k < Inf): a NaN k too, which fmax drops */
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

#include "scalar_avx2.h" /* after update_block, which its rare paths call */
#include "scalar_bf16.h" /* after update_block_t_, which it runs */
#include "scalar_avx512_bf16.h" /* after both: the portable bf16 loop is the exact path of these two */
#include "scalar_avx2_bf16.h"
#if defined(NONANS_AVX512)
#define UPDATE_BLOCK update_block_avx512
#define UPDATE_BLOCK_BF16 update_block_bf16_avx512
#elif defined(NONANS_AVX2)
#define UPDATE_BLOCK update_block_avx2
#define UPDATE_BLOCK_BF16 update_block_bf16_avx2
#else
#define UPDATE_BLOCK update_block
#define UPDATE_BLOCK_BF16 update_block_bf16_
#endif

/* The vector width in bits of the (SF-)AdamW loop compiled in: 512 (scalar_avx512.h), 256 (scalar_avx2.h),
 * or 0 for the portable loops alone. */
int nonans_simd_width(void) {
#if defined(NONANS_AVX512)
    return 512;
#elif defined(NONANS_AVX2)
    return 256;
#else
    return 0;
#endif
}

/* Pass 2 over [lo, hi) of one tensor, block by block. bad: pass 1's per-chunk non-finite counts of this
 * tensor (chunks are the blocks), or NULL when pass 1 did not run; a block it found clean takes the
 * clean loop. */
static inline __attribute__((always_inline)) void update_range(
        const int bf, const int sf, const int gate, const int decay_z,
        void *restrict p, const void *restrict g, void *restrict m, void *restrict v, void *restrict z,
        int64_t lo, int64_t hi, float s, float lr, float bc1, float bc2, const hyper_t h,
        int hold, int keep_all, const int64_t *bad, int64_t *out) {
    const float wdf = 1.0f - lr * h.wd, lrc = lr * h.coef;
    int64_t tot[NCOUNT] = {0, 0, 0, 0, 0};
    for (int64_t b0 = lo; b0 < hi; b0 += BLOCK) {
        const int64_t b1 = b0 + BLOCK < hi ? b0 + BLOCK : hi;
        const int clean = gate && bad != NULL && bad[b0 / BLOCK] == 0 && !hold && !keep_all;
        if (bf) /* one variant: "clean" only spares the exact path, which a clean bf16 group rarely takes */
            UPDATE_BLOCK_BF16(sf, gate, 0, decay_z, p, g, m, v, z, b0, b1, s, lr, wdf, lrc, bc1, bc2, h, hold,
                               keep_all, tot);
        else if (clean)
            UPDATE_BLOCK(sf, gate, 1, decay_z, p, g, m, v, z, b0, b1, s, lr, wdf, lrc, bc1, bc2, h, 0, 0, tot);
        else
            UPDATE_BLOCK(sf, gate, 0, decay_z, p, g, m, v, z, b0, b1, s, lr, wdf, lrc, bc1, bc2, h, hold,
                         keep_all, tot);
    }
    if (hold) tot[3] = tot[4] = 0; /* a held tensor writes nothing, so it counts no update */
    for (int k = 0; k < NCOUNT; k++) out[k] = tot[k];
}

/* Pass 1 over one BLOCK-sized chunk of g: its sum of squares (fp32 lanes, full vector width; a double
 * accumulator halved it and made the pass compute-bound) and its non-finite count. The chunk sums are
 * added in chunk order afterwards, so the norm — and a triggered spike guard's scale — does not depend
 * on the thread count. Any NaN or ±Inf entry makes the sum non-finite, so only such a chunk (rare) is
 * read again to count them, and such a chunk, or one whose squares overflowed, has the squares of its
 * finite entries summed again in double (guard_sumsq_): the guard's norm is of the finite entries, finite
 * for any gradient (functional/spike.py, the other implementations' float64 norm). */
static inline __attribute__((always_inline)) void chunk_stats_t_(const int bf, const void *restrict g, int64_t b0,
                                                                 int64_t b1, double *ss, int64_t *bad) {
#ifdef NONANS_AVX512
    const float part = bf ? sumsq_t_(1, g, b0, b1) : sumsq_avx512(g, b0, b1);
#else
    const float part = sumsq_t_(bf, g, b0, b1);
#endif
    int nbb = 0;
    if (!finitef_(part)) {
#pragma omp simd reduction(+ : nbb)
        for (int64_t j = b0; j < b1; j++) nbb += !finitef_(ld_(g, j, bf));
    }
    *ss = guard_sumsq_t_(part, bf ? (const void *)((const uint16_t *)g + b0) : (const void *)((const float *)g + b0),
                         b1 - b0, bf);
    *bad = nbb;
}

static void chunk_stats(const int bf, const void *restrict g, int64_t b0, int64_t b1, double *ss, int64_t *bad) {
    if (bf) chunk_stats_t_(1, g, b0, b1, ss, bad);
    else chunk_stats_t_(0, g, b0, b1, ss, bad);
}

/* Pass 2 of one tensor's thread range under the given variant: update_range with the per-call flags turned
 * into compile-time constants (one specialised loop each). */
static inline __attribute__((always_inline)) void update_tensor_(
        const int bf, int sf, int gate, int decay_z, void *p, const void *g, void *m, void *v, void *z,
        int64_t lo, int64_t hi, float s, float l, float b1c, float b2c, const hyper_t h, int hold, int keep_all,
        const int64_t *bad, int64_t *out) {
    if (sf) {
        if (!gate && decay_z) update_range(bf, 1, 0, 1, p, g, m, v, z, lo, hi, s, l, b1c, b2c, h, 0, 0, NULL, out);
        else if (!gate) update_range(bf, 1, 0, 0, p, g, m, v, z, lo, hi, s, l, b1c, b2c, h, 0, 0, NULL, out);
        else if (decay_z) update_range(bf, 1, 1, 1, p, g, m, v, z, lo, hi, s, l, b1c, b2c, h, hold, keep_all, bad, out);
        else update_range(bf, 1, 1, 0, p, g, m, v, z, lo, hi, s, l, b1c, b2c, h, hold, keep_all, bad, out);
    } else {
        if (!gate) update_range(bf, 0, 0, 0, p, g, m, v, z, lo, hi, s, l, b1c, b2c, h, 0, 0, NULL, out);
        else update_range(bf, 0, 1, 0, p, g, m, v, z, lo, hi, s, l, b1c, b2c, h, hold, keep_all, bad, out);
    }
}

void nonans_record_step_packed(const int64_t *pack, float backoff, float min_scale, const int64_t *step_counts,
                               int64_t step);

/* One step over n tensors. Returns 0, or 1 when scratch memory could not be allocated (nothing written).
 * bf16: every tensor of p, g, m, v, z is bf16 (else fp32); step stays fp32.
 *
 * step: the n fp32 state['step'] scalars, advanced here, and the bias corrections 1-β₁ᵗ, 1-β₂ᵗ computed
 * from them in double and rounded once (what the Python paths do with host floats); hp: the seven fp32
 * hyperparameters of hyper_t; gamma: the 0-d step size (lr · warmup · Polyak). Resolution tensors, all
 * indexed by sel (the global parameter index) and NULL under "off": scale (escalation multiplier of the
 * step size), clean_streak and events (the hold rule's "recent event", Resolution.recent), ema (spike
 * guard; factor <= 0: no guard) and the (P, S, 2) count block dense.
 *
 * rec (NULL: not this call's job): the packed counters of nonans_record_step_packed, when this call is the
 * step's only producer of counts (one (SF-)AdamW group, nothing recorded eagerly); dense must then be NULL:
 * the counts go to a zeroed scratch block and are folded into the counters at the end of this same call, as
 * record_step (rec_step: the optimizer's step number) would fold them afterwards — one C call per step,
 * not two, and no (P, S, 2) torch tensor to allocate (the Python glue of these is a visible part of a
 * memory-bound step's repair cost: RESULTS.md, "overhead"). */
int nonans_scalar_step(int64_t n, void **p, void **g, void **m, void **v, void **z, float **step,
                       const int64_t *numel, const float *gamma, double beta1, double beta2, const float *hp,
                       int policy, int sf, int decay_z, float factor, float beta, float one_m_beta, float *ema,
                       const int64_t *sel, const float *scale, const int64_t *clean_streak,
                       const int64_t *events, int64_t repeat_window, int64_t *dense, int nthreads,
                       const int64_t *rec, float backoff, float min_scale, int64_t rec_step, int bf16) {
    const int T = nthreads > 0 ? nthreads : 1;
    const int gate = policy != POLICY_OFF, guard = gate && factor > 0.0f;
    const hyper_t h = {hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6]};
    int64_t *own = NULL; /* the scratch count block when this call also records (rec) */
    if (gate && rec != NULL) {
        own = calloc((size_t)(rec[0] * NSTAGE * 2 + 1), sizeof(int64_t));
        if (!own) return 1;
        dense = own;
    }
    int64_t chunks = 0;
    for (int64_t i = 0; i < n; i++) chunks += (numel[i] + BLOCK - 1) / BLOCK;
    int64_t *cnt = calloc((size_t)(n * T * NCOUNT + chunks + n + 1), sizeof(int64_t));
    double *ss = calloc((size_t)(chunks + 1), sizeof(double));   /* per chunk of every tensor */
    float *new_ema = calloc((size_t)(n + 1), sizeof(float));
    int *trig = calloc((size_t)(n + 1), sizeof(int));
    if (!cnt || !ss || !new_ema || !trig) {
        free(cnt); free(ss); free(new_ema); free(trig); free(own);
        return 1;
    }
    int64_t *bad1 = cnt + n * T * NCOUNT, *chunk_off = bad1 + chunks;
    for (int64_t i = 0, acc = 0; i < n; i++) { chunk_off[i] = acc; acc += (numel[i] + BLOCK - 1) / BLOCK; }
    /* Per-tensor scalars, before any thread starts: the step count, bias corrections, step size, and
     * whether the parameter had an event within the repeat window (the hold rule's precondition). */
    float *lr = calloc((size_t)(3 * n + 1), sizeof(float));
    uint8_t *recent = calloc((size_t)(n + 1), 1);
    if (!lr || !recent) {
        free(cnt); free(ss); free(new_ema); free(trig); free(lr); free(recent); free(own);
        return 1;
    }
    float *bc = lr + n;
    float last_t = -1.0f; /* the tensors of a group are usually at one step: pow() once, not twice per tensor */
    for (int64_t i = 0; i < n; i++) {
        const float t = *step[i] + 1.0f;
        *step[i] = t;
        if (i == 0 || t != last_t) {
            bc[2 * i] = (float)(1.0 - pow(beta1, (double)t));
            bc[2 * i + 1] = (float)(1.0 - pow(beta2, (double)t));
            last_t = t;
        } else {
            bc[2 * i] = bc[2 * i - 2];
            bc[2 * i + 1] = bc[2 * i - 1];
        }
        lr[i] = scale != NULL ? *gamma * scale[sel[i]] : *gamma;
        if (gate && clean_streak != NULL) recent[i] = recent_event_(clean_streak, events, sel[i], repeat_window);
    }
#pragma omp parallel num_threads(T)
    {
        const int tid = thread_id_(), nt = thread_count_();
        for (int64_t i = 0; i < n; i++) {
            const int64_t N = numel[i];
            if (N == 0) continue;
            /* Threads take whole chunks, the same ones in both passes (pass 2 re-reads from L2). */
            const int64_t nch = (N + BLOCK - 1) / BLOCK, c0 = nch * tid / nt, c1 = nch * (tid + 1) / nt;
            const int64_t lo = c0 * BLOCK, hi = c1 * BLOCK < N ? c1 * BLOCK : N, off = chunk_off[i];
            const void *gi = g[i];
            /* The same decision on every thread (all read the same inputs), so either all or none reach
             * the barrier. The hold rule needs a pre-pass only when the first entry is already bad. */
            const int rec = gate && recent[i]; /* the hold rule, under "repair" and "skip" as the loop's keep_flags */
            const int need1 = policy == POLICY_SKIP || guard || (rec && !finitef_(ld_(gi, 0, bf16)));
            float s = 1.0f;
            int hold = 0, keep_all = 0;
            if (need1) {
                for (int64_t ch = c0; ch < c1; ch++)
                    chunk_stats(bf16, gi, ch * BLOCK, (ch + 1) * BLOCK < N ? (ch + 1) * BLOCK : N, &ss[off + ch],
                                &bad1[off + ch]);
#pragma omp barrier
                double tot = 0.0;
                int64_t nbad = 0;
                for (int64_t ch = 0; ch < nch; ch++) { tot += ss[off + ch]; nbad += bad1[off + ch]; }
                if (guard) { /* ema is only written after the parallel region: every thread reads the old value */
                    float ne;
                    int tr;
                    s = spike_(sqrt(tot), nbad == 0, ema[sel[i]], factor, beta, one_m_beta, &ne, &tr);
                    if (tid == 0) { new_ema[i] = ne; trig[i] = tr; }
                }
                hold = rec && nbad == N;
                keep_all = policy == POLICY_SKIP && nbad > 0;
            }
            int64_t *out = &cnt[(i * T + tid) * NCOUNT];
            const float l = lr[i], b1c = bc[2 * i], b2c = bc[2 * i + 1];
            void *zi = sf ? z[i] : NULL, *mi = sf ? NULL : m[i], *pi = p[i], *vi = v[i];
            const int64_t *bad = need1 ? &bad1[off] : NULL; /* pass 1's per-chunk verdicts, when it ran */
            if (bf16)
                update_tensor_(1, sf, gate, decay_z, pi, gi, mi, vi, zi, lo, hi, s, l, b1c, b2c, h, hold, keep_all,
                               bad, out);
            else
                update_tensor_(0, sf, gate, decay_z, pi, gi, mi, vi, zi, lo, hi, s, l, b1c, b2c, h, hold, keep_all,
                               bad, out);
        }
    }
    if (gate && dense != NULL) {
        for (int64_t i = 0; i < n; i++) {
            int64_t c[NCOUNT] = {0, 0, 0, 0, 0};
            for (int t = 0; t < T; t++)
                for (int k = 0; k < NCOUNT; k++) c[k] += cnt[(i * T + t) * NCOUNT + k];
            int64_t *row = dense + sel[i] * NSTAGE * 2;
            row[ST_GRAD * 2] += c[0];
            row[ST_GRAD * 2 + 1] += c[1] - c[0];
            row[ST_MOMENT * 2 + 1] += c[2];
            row[ST_UPDATE * 2] += c[3];
            row[ST_UPDATE * 2 + 1] += c[4] - c[3];
            if (guard && numel[i] > 0) {
                row[ST_SPIKE * 2 + 1] += trig[i];
                ema[sel[i]] = new_ema[i];
            }
        }
    }
    if (own != NULL) nonans_record_step_packed(rec, backoff, min_scale, own, rec_step);
    free(cnt); free(ss); free(new_ema); free(trig); free(lr); free(recent); free(own);
    return 0;
}
