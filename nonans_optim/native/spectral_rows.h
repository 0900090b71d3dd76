/* The per-row arithmetic of spectral_pre.c's momentum side: one entry (the gate, MONA, the buffer, the NS5
 * input M), a row's Σ M² for passes 1 and 2, a row's update for pass 3, the speculation's check of a row, and
 * the rows a pass reads (a bf16 gradient or MONA row widened into scratch). spectral_pre.c holds the passes
 * that drive them over rows and threads and their bookkeeping (counts, the spike guard, the hold rule).
 *
 * Included by spectral_pre.c only (static inline: one translation unit, compiled with its flags).
 */
#ifndef NONANS_SPECTRAL_ROWS_H
#define NONANS_SPECTRAL_ROWS_H

#include "common.h"

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
static inline __attribute__((always_inline)) double row_msq_(
        const float *restrict gr, const float *restrict bo, int64_t C, float s, int gate, float one_m_mu, float mu,
        int nesterov, const int mona, const mona_t mo, const float *restrict pr, const float *restrict ar, int bf16,
        int *big, const int want_g, float *gss) {
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
static inline __attribute__((always_inline)) int row_update_(
        const float *restrict gr, float *restrict b, float *restrict x, int64_t C, float s, int gate, float one_m_mu,
        float mu, int nesterov, double inv, const int mona, const mona_t mo, float *restrict pr, float *restrict ar,
        int bf16) {
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

#endif /* NONANS_SPECTRAL_ROWS_H */
