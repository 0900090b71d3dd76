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
 * The per-row arithmetic the passes run (an entry, a row's Σ M², a row's update and its check) is in
 * spectral_rows.h; this file drives it over rows and threads and keeps the counts.
 *
 * Compiled with -ffp-contract=off like scalar_step.c: a clean "repair" step is bit-identical to "off".
 */
#include <stdlib.h>

#include "common.h"
#include "spectral_rows.h"

enum { NPRE = 3 };   /* per tensor and thread, pre: grad nan, grad non-finite, moment overflow */

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
