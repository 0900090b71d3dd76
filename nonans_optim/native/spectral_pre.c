/* The elementwise work around NS5 on the spectral path (NS5 + optional NorMuon + optional schedule-free),
 * for contiguous fp32 or bf16 CPU parameters and gradients (a bf16 gradient row is widened before each pass
 * reads it, as are bf16 MONA rows, which pass 3 rounds once as it stores them; spectral_post.c rounds a bf16
 * parameter's rows once); the momentum buffer is fp32 or bf16.
 *
 * Ground truth: nonans_optim/optimizers/_spectral.py (impl="loop"). The arithmetic is that of
 * optimizers/_compiled_spectral.py (_pre and _post) written as row loops: inductor (torch 2.13, CPU) ran
 * those two graphs as about 4x the passes their byte traffic needs (a scratch measurement, 2026-11-22, commit
 * d737121; not in RESULTS.md). Here:
 *
 *   pre, per matrix (rows split across threads; every pass of a thread covers the same rows, so the
 *   later passes read from its L2 cache):
 *     1. (resolution on) gradient statistics: sum of squares (the spike guard), non-finite counts, and
 *        whether each row was entirely finite (the NorMuon row gate); and the gate and momentum
 *        (+ Nesterov) into the NS5 input M, for its row sums of squares only (fp32, a row again in double
 *        where fp32 squares overflow or underflow), assuming the spike guard will not fire;
 *     2. only where it did fire: the row sums of M² again with the guard's scale;
 *     3. the same arithmetic again, now writing the buffer and X = M / ‖M‖_F in the hot dtype (bf16 or
 *        fp32) — the NS5 input, zero staying zero;
 *   post, per matrix, on the NS5 output O (hot dtype, the parameter's layout):
 *     A. per row: Σ O², Σ O, the NorMuon row moment and 1/dᵢ;
 *     B. U = O · (1/dᵢ) · (0.2·sqrt(mn)/‖Ô‖_F), the (schedule-free) update, the update guard and hold
 *        rule, and the counts.
 *
 * Compiled with -ffp-contract=off like scalar_step.c: a clean "repair" step is bit-identical to "off".
 */
#include <stdlib.h>

#include "common.h"

enum { NPRE = 3 };   /* per tensor and thread, pre: grad nan, grad non-finite, moment overflow */
/* row_ok values: 0 the row's gradient had a bad entry, 1 entirely finite, ROW_SPEC entirely finite and
 * KL-Shampoo's input (no earlier pass looked for a buffer overflow: pass 3 speculates and checks,
 * row_check_), ROW_GATED entirely finite but the row takes the gated arithmetic anyway (a buffer may
 * overflow there). post only asks "nonzero?". */
enum { ROW_SPEC = 2, ROW_GATED = 3 };

/* MONA's constants (alpha, 1-beta), whether this is the tensor's first step (G_prev starts as G), and abf:
 * the buffers are bf16 under a gate — A is kept where its new value is not finite *as stored* (storable_),
 * and the ungated sums of passes 1 and 2 test A too (row_msq_). */
typedef struct {
    float alpha, one_m_beta;
    int first, abf;
} mona_t;

/* One entry of the momentum side: the gate, MONA (when mona: G̃ = G + α·A with A ← lerp(A, G - G_prev,
 * 1-β), both buffers keeping their values where g is missing — functional/momentum.py::mona_), the
 * buffer's new value (fp32, rounded only on the write) and the NS5 input M = lerp(g_in, buf, μ)
 * (Nesterov) or buf. pn/an receive MONA's new G_prev and A. Under the gate, A and the buffer also keep
 * their values where the new one overflowed with a finite g (the difference inside a lerp; for a bf16
 * buffer, the value as stored) — a missing observation for that buffer, so M there is the old buffer
 * value — and *ov counts the entries where either did (the moment stage). */
static inline __attribute__((always_inline)) float momentum_entry_(
        float gr, float bo, float s, int gate, float one_m_mu, float mu, int nesterov, float *nb_out,
        const int mona, const mona_t mo, float po, float ao, float *pn, float *an, int bf16, int *ov) {
    float G = gr * s; /* s == 1.0f exactly unless the spike guard fired */
    const int ok = finitef_(gr);
    int over = 0; /* this entry overflowed a buffer: counted once */
    if (mona) {
        const float prev = mo.first ? (gate ? (ok ? G : 0.0f) : G) : po;
        const float na = lerpf_(ao, G - prev, mo.one_m_beta);
        const int keep_na = ok & storable_(na, mo.abf);
        over = ok & !keep_na;
        *an = gate ? (keep_na ? na : ao) : na;
        *pn = gate ? (ok ? G : prev) : G;
        G = G + mo.alpha * *an;
    }
    const float gin = gate ? (ok ? G : bo) : G; /* missing entry: the buffer keeps its value */
    float nb = lerpf_(bo, gin, one_m_mu);
    float din = gin;
    if (gate) { /* an overflow is a missing observation for the buffer: it and M continue from bo */
        /* finite as stored: for bf16, below the magnitude that rounds to Inf ((2 - 2^-8)·2^127, as
         * resolution.storable_mask); NaN fails either compare */
        const int nb_ok = fabsf(nb) < (bf16 ? 0x1.FFp127f : INFINITY);
        *ov += over | !nb_ok;
        nb = nb_ok ? nb : bo;
        din = nb_ok ? gin : bo;
    }
    *nb_out = nb;
    return nesterov ? lerpf_(din, nb, mu) : nb;
}

/* Row r of a gradient with C columns, as fp32: a bf16 gradient's row widened into dst (exact; it stays in
 * L1 for the pass that asked), an fp32 one in place. */
static const float *grad_row_(const void *g, int bf16, int64_t r, int64_t C, float *restrict dst) {
    if (!bf16) return (const float *)g + r * C;
    widen_row_((const uint16_t *)g + r * C, 1, dst, C);
    return dst;
}

/* Passes 1 and 2 over one row: Σ M², with M recomputed rather than stored (a stored fp32 M cost a 4-byte
 * write and read per entry more than recomputing it from g and the buffer, which pass 3 reads anyway).
 * pr/ar: MONA's G_prev and A rows (read only here; NULL without MONA). gss (want_g, a compile-time
 * constant): also Σ g² (fp32), in the same loop — the spike guard's sum and the row's finiteness test. */
static inline __attribute__((always_inline)) double row_msq_(const float *restrict gr, const float *restrict bo, int64_t C, float s, int gate,
                       float one_m_mu, float mu, int nesterov, const int mona, const mona_t mo,
                       const float *restrict pr, const float *restrict ar, int bf16, int *big,
                       const int want_g, float *gss) {
    float part = 0.0f, gpart = 0.0f, achk = 0.0f;
    int ov = 0; /* counted in pass 3, which writes */
#pragma omp simd reduction(+ : part, ov, gpart, achk)
    for (int64_t j = 0; j < C; j++) {
        float nb, pn, an;
        const float M = momentum_entry_(gr[j], bo[j], s, gate, one_m_mu, mu, nesterov, &nb, mona, mo,
                                        mona ? pr[j] : 0.0f, mona ? ar[j] : 0.0f, &pn, &an, bf16, &ov);
        part += M * M;
        if (want_g) gpart += gr[j] * gr[j];
        /* bf16 MONA, ungated: a new A at or above 2^127 (2·A overflows; every A that rounds to Inf in bf16
         * is) or not finite. An A that is Inf or NaN in fp32 reaches M (G + α·A), but one in bf16's window
         * does not when α is small: this sum is what sees it (row_check_'s rule). gcc unswitches the loop
         * on mo.abf, a constant per call. */
        if (mona && !gate && mo.abf) achk += an * 2.0f;
    }
    if (want_g) *gss = gpart;
    const int abad = !finitef_(achk);
    /* Exact enough unless a square overflowed or the row is so small that squares lost precision (or
     * underflowed): then this row, still in cache, again in double — the NS5 input stays scale invariant
     * over fp32's whole range (tests/test_fused_spectral.py). *big: a square overflowed (some |M| above
     * about 1.8e19), the only way an ungated row can hide a buffer overflow (see nonans_spectral_pre). */
    if (!abad && finitef_(part) && part > 1e-30f) return part;
    *big = !finitef_(part) || abad; /* abad: a bf16 MONA A that the gated arithmetic keeps */
    double acc = 0.0;
#pragma omp simd reduction(+ : acc, ov)
    for (int64_t j = 0; j < C; j++) {
        float nb, pn, an;
        const double M = momentum_entry_(gr[j], bo[j], s, gate, one_m_mu, mu, nesterov, &nb, mona, mo,
                                         mona ? pr[j] : 0.0f, mona ? ar[j] : 0.0f, &pn, &an, bf16, &ov);
        acc += M * M;
    }
    return acc;
}

/* row_msq_ with the gate and MONA as compile-time constants in each branch. Only a row with a non-finite
 * entry takes the gated loop: elsewhere the gate selects g anyway, and the select costs in this
 * compute-bound loop (about 0.4 ms of a 3.1M-entry step). gss (ungated only; NULL: not wanted): Σ g². */
static double row_msq_dispatch_(const float *restrict gr, const float *restrict bo, int64_t C, float s,
                                int gated, float one_m_mu, float mu, int nesterov, const mona_t *mo,
                                const float *restrict pr, const float *restrict ar, int bf16, int *big,
                                float *gss) {
    const mona_t m = mo != NULL ? *mo : (mona_t){0.0f, 0.0f, 0, 0};
    if (mo != NULL)
        return gated ? row_msq_(gr, bo, C, s, 1, one_m_mu, mu, nesterov, 1, m, pr, ar, bf16, big, 0, NULL)
               : gss ? row_msq_(gr, bo, C, s, 0, one_m_mu, mu, nesterov, 1, m, pr, ar, 0, big, 1, gss)
                     : row_msq_(gr, bo, C, s, 0, one_m_mu, mu, nesterov, 1, m, pr, ar, 0, big, 0, NULL);
    return gated ? row_msq_(gr, bo, C, s, 1, one_m_mu, mu, nesterov, 0, m, NULL, NULL, bf16, big, 0, NULL)
           : gss ? row_msq_(gr, bo, C, s, 0, one_m_mu, mu, nesterov, 0, m, NULL, NULL, 0, big, 1, gss)
                 : row_msq_(gr, bo, C, s, 0, one_m_mu, mu, nesterov, 0, m, NULL, NULL, 0, big, 0, NULL);
}

/* Σ M² of one row for passes 1 and 2. ok: the row's row_ok entry (NULL under "off"). A row whose
 * gradient is entirely finite runs the ungated arithmetic, which cannot see a buffer overflowing (the
 * difference inside a lerp, or a bf16 buffer rounding to Inf). Any such overflow leaves M non-finite or
 * near fp32's maximum (M is the new buffer, or a lerp from a finite input towards it), far above the
 * 1.8e19 where M² overflows fp32: that row is marked ROW_GATED and summed again gated — exact anyway, so
 * a false alarm costs time only. */
static double row_msq_checked_(const float *restrict gr, const float *restrict bo, int64_t C, float s,
                               uint8_t *ok, float one_m_mu, float mu, int nesterov, const mona_t *mo,
                               const float *restrict pr, const float *restrict ar, int bf16) {
    int big = 0;
    const int gated = ok != NULL && *ok != 1;
    const double sum = row_msq_dispatch_(gr, bo, C, s, gated, one_m_mu, mu, nesterov, mo, pr, ar, bf16, &big,
                                         NULL);
    if (ok == NULL || gated || !big) return sum;
    *ok = ROW_GATED;
    return row_msq_dispatch_(gr, bo, C, s, 1, one_m_mu, mu, nesterov, mo, pr, ar, bf16, &big, NULL);
}

/* Pass 3 over one row: in place, b becomes the new buffer value (and pr/ar MONA's new rows) and x the NS5
 * input M / ‖M‖ (fp32; the caller narrows both). In fp32 when 1/‖M‖ is a normal fp32 number (a one-ulp
 * difference from the double product, below bf16's resolution), else in double (‖M‖ beyond fp32's
 * range). inv == 1 writes M itself (the KL-Shampoo input, normalised after preconditioning). Returns the
 * row's moment-overflow count (0 unless gated). */
static inline __attribute__((always_inline)) int row_update_(const float *restrict gr, float *restrict b, float *restrict x, int64_t C, float s,
                        int gate, float one_m_mu, float mu, int nesterov, double inv, const int mona,
                        const mona_t mo, float *restrict pr, float *restrict ar, int bf16) {
    const int narrow = inv == 0.0 || (inv > 1e-37 && inv < 1e37);
    const float inv_f = (float)inv;
    int ov = 0;
    if (narrow) {
#pragma omp simd reduction(+ : ov)
        for (int64_t j = 0; j < C; j++) {
            float nb, pn = 0.0f, an = 0.0f;
            x[j] = momentum_entry_(gr[j], b[j], s, gate, one_m_mu, mu, nesterov, &nb, mona, mo,
                                   mona ? pr[j] : 0.0f, mona ? ar[j] : 0.0f, &pn, &an, bf16, &ov) * inv_f;
            b[j] = nb;
            if (mona) { pr[j] = pn; ar[j] = an; }
        }
    } else {
#pragma omp simd reduction(+ : ov)
        for (int64_t j = 0; j < C; j++) {
            float nb, pn = 0.0f, an = 0.0f;
            x[j] = (float)((double)momentum_entry_(gr[j], b[j], s, gate, one_m_mu, mu, nesterov, &nb, mona, mo,
                                                   mona ? pr[j] : 0.0f, mona ? ar[j] : 0.0f, &pn, &an, bf16,
                                                   &ov) * inv);
            b[j] = nb;
            if (mona) { pr[j] = pn; ar[j] = an; }
        }
    }
    return ov;
}

static int row_update_dispatch_(const float *restrict gr, float *restrict b, float *restrict x, int64_t C,
                                float s, int gated, float one_m_mu, float mu, int nesterov, double inv,
                                const mona_t *mo, float *restrict pr, float *restrict ar, int bf16) {
    const mona_t m = mo != NULL ? *mo : (mona_t){0.0f, 0.0f, 0, 0};
    if (mo != NULL)
        return gated ? row_update_(gr, b, x, C, s, 1, one_m_mu, mu, nesterov, inv, 1, m, pr, ar, bf16)
                     : row_update_(gr, b, x, C, s, 0, one_m_mu, mu, nesterov, inv, 1, m, pr, ar, 0);
    return gated ? row_update_(gr, b, x, C, s, 1, one_m_mu, mu, nesterov, inv, 0, m, NULL, NULL, bf16)
                 : row_update_(gr, b, x, C, s, 0, one_m_mu, mu, nesterov, inv, 0, m, NULL, NULL, 0);
}

/* The test of a row that row_update_ computed ungated (pass 3's speculation), on b, its new buffer values
 * in fp32: Σ B, B doubled for a bf16 buffer — non-finite wherever the gate would have kept an old value
 * (momentum_entry_): a non-finite B (a NaN or ±Inf term makes the sum so), a B at or above 2^127 (2·B
 * overflows), which covers every B that rounds to Inf in bf16 ((2 - 2^-8)·2^127), and a non-finite MONA A,
 * which makes G + α·A and so B non-finite (0·Inf is NaN). A finite sum that overflows, or a B between
 * 2^127 and that bound, only sends the row to the gated arithmetic, which writes the same values there.
 * A loop of its own over the row (in L1): the same sum inside row_update_'s loop left that loop about
 * 3x slower (FullFusion's pre call on the default GPT, scratch A/B, 2026-11-26). */
static float row_check_(const float *restrict b, int64_t C, int bf16) { /* (also on a bf16 MONA A row) */
    const float k = bf16 ? 2.0f : 1.0f;
    float c = 0.0f;
#pragma omp simd reduction(+ : c)
    for (int64_t j = 0; j < C; j++) c += b[j] * k;
    return c;
}

/* MONA's G_prev and A rows r as fp32 rows to update: fp32 buffers in place; bf16 ones (mbf) widened into the
 * scratch rows prow and arow (pass 3 narrows them back), their stored bits untouched until then. */
static void mona_rows_(void *pi, void *ai, int mbf, int64_t r, int64_t C, float *prow, float *arow, float **pr,
                       float **ar) {
    if (pi == NULL) {
        *pr = *ar = NULL;
    } else if (!mbf) {
        *pr = (float *)pi + r * C;
        *ar = (float *)ai + r * C;
    } else {
        widen_row_((const uint16_t *)pi + r * C, 1, prow, C);
        widen_row_((const uint16_t *)ai + r * C, 1, arow, C);
        *pr = prow;
        *ar = arow;
    }
}

/* The momentum side. g, buf, x: per tensor; rows/cols: the matrix shape (buf and x have the same layout
 * as g); hp = {1-μ, μ}. MONA (NULL without it): mona_prev and mona_avg per tensor (g's layout; fp32, or
 * bf16 where mona_bf16), mona_hp = {α, 1-β}. raw: x receives M itself (fp32; KL-Shampoo preconditions it
 * and the caller normalises), and the passes that only serve the norm of M are skipped. Resolution (all
 * NULL/0 under "off"): as in scalar_step.c, plus row_ok (out, concatenated rows of every tensor: whether the
 * row's gradient was entirely finite; required unless "off") and hold (out, one per tensor: bit 0 the hold
 * rule, bit 1 a "skip" tensor that had a bad entry). scale_out and bad_out (out, optional, one per tensor):
 * the spike guard's scale of g and the count of non-finite gradient entries (0 under "off"). g_bf16: g is
 * bf16 (widened row by row). Returns 0, or 1 when scratch memory could not be allocated (nothing
 * written). */
int nonans_spectral_pre(int64_t n, void **g, void **buf, int buf_bf16, void **x, int x_bf16,
                        const int64_t *rows, const int64_t *cols, float **step, const float *hp, int nesterov,
                        void **mona_prev, void **mona_avg, const float *mona_hp, int raw,
                        int policy, float factor, float beta, float one_m_beta, float *ema, const int64_t *sel,
                        const int64_t *clean_streak, const int64_t *events, int64_t repeat_window,
                        uint8_t *row_ok, uint8_t *hold, float *scale_out, int64_t *bad_out, int64_t *dense,
                        int nthreads, int g_bf16, int mona_bf16) {
    const int T = nthreads > 0 ? nthreads : 1;
    const int gate = policy != POLICY_OFF, guard = gate && factor > 0.0f;
    const float one_m_mu = hp[0], mu = hp[1];
    int64_t total_rows = 0;
    for (int64_t i = 0; i < n; i++) total_rows += rows[i];
    /* Row sums of squares (gradient, M), added in row order after a barrier: the spike guard's norm and
     * the NS5 input's scale then do not depend on the thread count. */
    double *part = calloc((size_t)(2 * total_rows + 1), sizeof(double));
    int64_t *cnt = calloc((size_t)(n * T * NPRE + 2 * n + 1), sizeof(int64_t));
    float *new_ema = calloc((size_t)(n + 1), sizeof(float));
    int *trig = calloc((size_t)(n + 1), sizeof(int));
    int64_t max_cols = 1;
    for (int64_t i = 0; i < n; i++) max_cols = cols[i] > max_cols ? cols[i] : max_cols;
    /* per thread: buffer row, X row, MONA's two rows for a "skip" tensor (computed, never written back), and
     * a bf16 gradient's row widened */
    float *rowbufs = malloc((size_t)(5 * T * max_cols) * sizeof(float));
    if (!part || !cnt || !new_ema || !trig || !rowbufs) { /* before anything is written */
        free(part); free(cnt); free(new_ema); free(trig); free(rowbufs);
        return 1;
    }
    int64_t *row_off = cnt + n * T * NPRE, *recent = row_off + n;
    for (int64_t i = 0, acc = 0; i < n; i++) {
        *step[i] += 1.0f;
        row_off[i] = acc;
        acc += rows[i];
        recent[i] = gate && recent_event_(clean_streak, events, sel[i], repeat_window);
    }
#pragma omp parallel num_threads(T)
    {
        const int tid = thread_id_(), nt = thread_count_();
        float *brow = rowbufs + 5 * tid * max_cols, *xrow = brow + max_cols, *prow = xrow + max_cols,
              *arow = prow + max_cols, *growb = arow + max_cols;
        for (int64_t i = 0; i < n; i++) {
            const int64_t R = rows[i], C = cols[i];
            const int64_t r0 = R * tid / nt, r1 = R * (tid + 1) / nt;
            const void *gi = g[i];
            float s = 1.0f;
            int skip = 0;
            const mona_t mo = {mona_hp != NULL ? mona_hp[0] : 0.0f, mona_hp != NULL ? mona_hp[1] : 0.0f,
                               *step[i] == 1.0f, gate && mona_bf16};
            const mona_t *mop = mona_prev != NULL ? &mo : NULL;
            void *pi = mona_prev != NULL ? mona_prev[i] : NULL, *ai = mona_avg != NULL ? mona_avg[i] : NULL;
            const int mbf = pi != NULL && mona_bf16;
            double *gsq = part + row_off[i], *msq = part + total_rows + row_off[i];
            /* pass 1: gradient statistics and, speculating that the spike guard will not fire (s = 1),
             * the row sums of M². Nothing is written before pass 3, so a wrong guess costs one more
             * read-only pass over this tensor (pass 2), and only on a step where the guard fires.
             * Under a gate, Σ g² rides in the ungated Σ M² loop (row_msq_'s gss), speculating too — that
             * the row is entirely finite: a separate Σ g² loop before it was all of what "repair" added
             * to this loop's time (Muon on the default GPT: about 0.5 ms of a 4-5 ms pre call with it,
             * none without it; a scratch A/B of two builds in one process, 2026-11-26). A row where
             * the guess fails (a NaN or ±Inf g makes Σ g² non-finite) is summed again gated, from cache. */
            const size_t bsz = buf_bf16 ? 2 : 4, xsz = x_bf16 ? 2 : 4;
            int64_t nan_c = 0, bad_c = 0;
            for (int64_t r = r0; r < r1; r++) {
                const float *gr = grad_row_(gi, g_bf16, r, C, growb);
                float *pr, *ar;
                if (!raw) mona_rows_(pi, ai, mbf, r, C, prow, arow, &pr, &ar); /* raw: pass 1 reads no M */
                else pr = ar = NULL;
                if (!raw) widen_row_((const char *)buf[i] + (size_t)(r * C) * bsz, buf_bf16, brow, C);
                if (!gate) {
                    if (!raw)
                        msq[r] = row_msq_checked_(gr, brow, C, 1.0f, NULL, one_m_mu, mu, nesterov, mop, pr, ar,
                                                  buf_bf16);
                    continue;
                }
                uint8_t *ok = row_ok + row_off[i] + r;
                float part_ss = 0.0f;
                double ms = 0.0;
                int nn = 0, nb = 0, big = 0;
                if (raw) { /* no norm of M to take (KL's path): Σ g² alone */
#pragma omp simd reduction(+ : part_ss)
                    for (int64_t j = 0; j < C; j++) part_ss += gr[j] * gr[j];
                } else {
                    ms = row_msq_dispatch_(gr, brow, C, 1.0f, 0, one_m_mu, mu, nesterov, mop, pr, ar, buf_bf16,
                                           &big, &part_ss);
                }
                /* A NaN or ±Inf entry makes the row's sum non-finite: only such a row (or one whose
                 * squares overflowed, then summed again in double: guard_sumsq_) is read again to count
                 * them — per-entry counters in the loop above cost more than the sum (see
                 * native/simd_avx512.h). */
                if (!finitef_(part_ss)) {
#pragma omp simd reduction(+ : nn, nb)
                    for (int64_t j = 0; j < C; j++) {
                        nn += gr[j] != gr[j];
                        nb += !finitef_(gr[j]);
                    }
                }
                gsq[r] = guard_sumsq_(part_ss, gr, C);
                nan_c += nn;
                bad_c += nb;
                *ok = nb == 0;
                if (raw) { /* pass 3 writes M itself: a finite row speculates there (ROW_SPEC) */
                    if (*ok) *ok = ROW_SPEC;
                    continue;
                }
                /* a bad entry, or (row_msq_checked_'s case) a square of M that overflowed, which the ungated
                 * arithmetic cannot tell from a buffer overflow: the row again, gated */
                if (nb > 0 || big) {
                    if (nb == 0) *ok = ROW_GATED;
                    ms = row_msq_dispatch_(gr, brow, C, 1.0f, 1, one_m_mu, mu, nesterov, mop, pr, ar, buf_bf16,
                                           &big, NULL);
                }
                msq[r] = ms;
            }
            cnt[(i * T + tid) * NPRE] = nan_c;
            cnt[(i * T + tid) * NPRE + 1] = bad_c;
#pragma omp barrier
            if (gate) {
                double tot = 0.0;
                int64_t nbad = 0;
                for (int64_t r = 0; r < R; r++) tot += gsq[r];
                for (int t = 0; t < nt; t++) nbad += cnt[(i * T + t) * NPRE + 1];
                if (guard) { /* ema is only written after the parallel region */
                    float ne;
                    int tr;
                    s = spike_(sqrt(tot), nbad == 0, ema[sel[i]], factor, beta, one_m_beta, &ne, &tr);
                    if (tid == 0) { new_ema[i] = ne; trig[i] = tr; }
                }
                /* bit 0, hold: no finite entry and a recent event (the loop's keep_flags, under "repair" and
                 * "skip"); bit 1, "skip" with a bad entry: the whole step is computed and counted, and
                 * neither the parameter nor any state is written (the loop's snapshot restore). */
                skip = policy == POLICY_SKIP && nbad > 0;
                if (tid == 0) hold[i] = (uint8_t)((recent[i] && nbad == R * C) | (skip << 1));
                if (tid == 0 && bad_out != NULL) bad_out[i] = nbad;
            }
            if (tid == 0 && scale_out != NULL) scale_out[i] = s;
            if (tid == 0 && bad_out != NULL && !gate) bad_out[i] = 0;
            if (s != 1.0f && !raw) { /* pass 2: the guard fired (the same decision on every thread) */
                for (int64_t r = r0; r < r1; r++) {
                    widen_row_((const char *)buf[i] + (size_t)(r * C) * bsz, buf_bf16, brow, C);
                    float *pr, *ar;
                    mona_rows_(pi, ai, mbf, r, C, prow, arow, &pr, &ar);
                    msq[r] = row_msq_checked_(grad_row_(gi, g_bf16, r, C, growb), brow, C, s,
                                              gate ? row_ok + row_off[i] + r : NULL,
                                              one_m_mu, mu, nesterov, mop, pr, ar, buf_bf16);
                }
#pragma omp barrier
            }
            double msum = 0.0;
            if (!raw)
                for (int64_t r = 0; r < R; r++) msum += msq[r];
            const double inv = raw ? 1.0 : msum > 0.0 ? 1.0 / sqrt(msum) : 0.0;
            /* pass 3 */
            int64_t ov_c = 0;
            for (int64_t r = r0; r < r1; r++) {
                char *bdst = (char *)buf[i] + (size_t)(r * C) * bsz;
                widen_row_(bdst, buf_bf16, brow, C);
                float *pr, *ar;
                mona_rows_(pi, ai, mbf, r, C, prow, arow, &pr, &ar); /* bf16: scratch rows already */
                const float *pr0 = pr, *ar0 = ar; /* MONA's rows as they were */
                const size_t rb = (size_t)C * sizeof(float);
                if (skip && pr != NULL && !mbf) { /* MONA's rows are updated in scratch copies, then dropped */
                    memcpy(prow, pr, rb);
                    memcpy(arow, ar, rb);
                    pr = prow;
                    ar = arow;
                }
                const uint8_t ok = gate ? row_ok[row_off[i] + r] : 1;
                const float *gr = grad_row_(gi, g_bf16, r, C, growb);
                if (ok == ROW_SPEC) {
                    /* KL-Shampoo's input: an entirely finite row, whose buffer (and MONA's A) can still
                     * overflow, which no pass before this one looked for. Speculate the ungated arithmetic,
                     * which is the gated one unless row_check_ finds such an entry; the buffer and X rows are
                     * scratch until narrowed, MONA's are backed up (or are scratch already). The gated
                     * arithmetic on every such row had FullFusion's pre call at 15.3 ms under "repair"
                     * against 8.8 ms "off"; this build: 3.6 ms and 2.9 ms (default GPT, 2 threads, a scratch
                     * A/B of the two builds in one process, 2026-11-26). */
                    if (pr != NULL && !skip && !mbf) {
                        memcpy(prow, pr, rb);
                        memcpy(arow, ar, rb);
                    }
                    row_update_dispatch_(gr, brow, xrow, C, s, 0, one_m_mu, mu, nesterov, inv, mop, pr, ar,
                                         buf_bf16);
                    if (!finitef_(row_check_(brow, C, buf_bf16)) || (mbf && !finitef_(row_check_(ar, C, 1)))) {
                        /* failed: again from the old values, gated */
                        widen_row_(bdst, buf_bf16, brow, C);
                        if (mbf) {
                            mona_rows_(pi, ai, mbf, r, C, prow, arow, &pr, &ar);
                        } else if (pr != NULL) {
                            memcpy(pr, skip ? pr0 : prow, rb);
                            memcpy(ar, skip ? ar0 : arow, rb);
                        }
                        ov_c += row_update_dispatch_(gr, brow, xrow, C, s, 1, one_m_mu, mu, nesterov, inv,
                                                     mop, pr, ar, buf_bf16);
                    }
                } else {
                    ov_c += row_update_dispatch_(gr, brow, xrow, C, s, gate && ok != 1, one_m_mu, mu,
                                                 nesterov, inv, mop, pr, ar, buf_bf16);
                }
                if (!skip) narrow_row_(brow, bdst, buf_bf16, C);
                if (!skip && mbf) { /* bf16 MONA rows: rounded once, as stored */
                    narrow_row_(pr, (uint16_t *)pi + r * C, 1, C);
                    narrow_row_(ar, (uint16_t *)ai + r * C, 1, C);
                }
                narrow_row_(xrow, (char *)x[i] + (size_t)(r * C) * xsz, x_bf16, C);
            }
            cnt[(i * T + tid) * NPRE + 2] = ov_c;
        }
    }
    if (gate && dense != NULL) {
        for (int64_t i = 0; i < n; i++) {
            int64_t nan_c = 0, bad_c = 0, ov_c = 0;
            for (int t = 0; t < T; t++) {
                nan_c += cnt[(i * T + t) * NPRE];
                bad_c += cnt[(i * T + t) * NPRE + 1];
                ov_c += cnt[(i * T + t) * NPRE + 2];
            }
            int64_t *row = dense + sel[i] * NSTAGE * 2;
            row[ST_GRAD * 2] += nan_c;
            row[ST_GRAD * 2 + 1] += bad_c - nan_c;
            row[ST_MOMENT * 2 + 1] += ov_c;
            if (guard) {
                row[ST_SPIKE * 2 + 1] += trig[i];
                ema[sel[i]] = new_ema[i];
            }
        }
    }
    free(part); free(cnt); free(new_ema); free(trig); free(rowbufs);
    return 0;
}
