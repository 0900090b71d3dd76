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
 *
 * The per-entry arithmetic, the exact portable block loop and its generic form (tested groups, for a CPU
 * without the SIMD forms) are in scalar_entry.h, the SIMD forms in scalar_avx512.h, scalar_avx2.h and (bf16)
 * scalar_*bf16.h; this file drives the blocks over tensors and threads and keeps the counts.
 */
#include <float.h>
#include <stdlib.h>

#include "common.h"
#include "scalar_entry.h" /* hyper_t, entry_, the portable update_block (and scalar_avx512.h) */
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
#elif defined(NONANS_PORTABLE)
#define UPDATE_BLOCK update_block /* the exact loops alone: the reference the other builds are tested against */
#define UPDATE_BLOCK_BF16 update_block_bf16_
#else
#define UPDATE_BLOCK update_block_spec /* the generic build: scalar_entry.h's tested groups */
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

/* Which form of the fp32 (SF-)AdamW loop this build runs: "avx512", "avx2", "generic" (scalar_entry.h's
 * tested groups, on a CPU with neither SIMD form) or "portable" (the exact loops alone, NONANS_PORTABLE: the
 * reference the others are compared with bit for bit). The vector width cannot tell the last two apart. */
const char *nonans_scalar_form(void) {
#if defined(NONANS_AVX512)
    return "avx512";
#elif defined(NONANS_AVX2)
    return "avx2";
#elif defined(NONANS_PORTABLE)
    return "portable";
#else
    return "generic";
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
