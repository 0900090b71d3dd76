/* The direction side of impl="fused" on the spectral path: NorMuon, RMS matching, the (schedule-free)
 * update, the update guard and the counts, on the NS5 output. The whole design is described at the top
 * of spectral_pre.c (the momentum side); ground truth: nonans_optim/optimizers/_spectral.py.
 */
#include <stdlib.h>

#include "common.h"

/* Pass B over one row: d = O·rsc, the update, the guard; sf/decay/gate/bf/chk are constants at every call
 * site (one straight vector loop per variant). Adds the row's update counts to *un, *ub. The portable form;
 * update_row_avx512_ below is the same in intrinsics, which the build uses where the CPU has them. bf: the
 * rows are a bf16 parameter's (and z's), widened: the guard tests finiteness as they will be stored. chk
 * (ungated bf16 rows): *check receives Σ 2·y (+ 2·z), update_row_bf16_'s test of the new values. */
static inline __attribute__((always_inline)) void update_row_(
        const int sf, const int decay, const int gate, const int bf, const int chk, float *check,
        const float *restrict orow, float *restrict pr, float *restrict zr, int64_t C, float rsc, float lr,
        float lrc, float wdf, float wd, float c, int keep, int64_t *un_out, int64_t *ub_out) {
    int un = 0, ub = 0;
    float ck = 0.0f;
#pragma omp simd reduction(+ : un, ub, ck)
    for (int64_t j = 0; j < C; j++) {
        float d = orow[j] * rsc;
        const float po = pr[j];
        float y, zo = 0.0f, zn = 0.0f;
        if (sf) {
            zo = zr[j];
            if (decay) d = d + zo * wd; /* skipped when λ = 0, as eager does: 0·z would turn an Inf z into NaN */
            y = lerpf_(po, zo, c) + d * lrc;
            zn = zo - d * lr;
        } else {
            y = po * wdf - lr * d;
        }
        if (gate) {
            un += y != y;
            ub += !storable_(y, bf);
            y = (storable_(y, bf) & !keep) ? y : po;
            if (sf) {
                un += zn != zn;
                ub += !storable_(zn, bf);
                zn = (storable_(zn, bf) & !keep) ? zn : zo;
            }
        }
        if (chk) ck += y * 2.0f + (sf ? zn * 2.0f : 0.0f);
        pr[j] = y;
        if (sf) zr[j] = zn;
    }
    *un_out += un;
    *ub_out += ub;
    if (chk) *check = ck;
}

#include "simd_avx512.h"
#ifdef NONANS_AVX512
/* One vector of update_row_ in AVX-512 (simd_avx512.h): the stock update, one test of y (+ z), and the
 * guard and counts only behind it. */
static inline __attribute__((always_inline)) void vec_row_(
        const int sf, const int decay, const int gate, const int full, __mmask16 lm, const float *restrict orow,
        float *restrict pr, float *restrict zr, int64_t j, __m512 rsc, const vparam_t *k, int keep, int64_t *un,
        int64_t *ub, const int chk, __m512 *acc) {
    const __m512 d = _mm512_mul_ps(vload_(full, lm, orow + j), rsc), po = vload_(full, lm, pr + j);
    const __m512 zo = sf ? vload_(full, lm, zr + j) : _mm512_setzero_ps();
    __m512 zn = zo, y = vparam_(sf, decay, d, po, zo, k, &zn);
    if (gate) {
        const __mmask16 km = keep ? lm : 0;
        const __mmask16 any = _mm512_fpclass_ps_mask(sf ? _mm512_add_ps(y, zn) : y, NONFINITE_) & lm;
        if (__builtin_expect((any | km) != 0, 0)) {
            y = guard_(y, po, _mm512_fpclass_ps_mask(y, NONFINITE_) & lm, km, un, ub);
            if (sf) zn = guard_(zn, zo, _mm512_fpclass_ps_mask(zn, NONFINITE_) & lm, km, un, ub);
        }
    }
    if (chk) { /* each product rounded before the add: a value past 2^127 is ±Inf there, so nothing cancels */
        const __m512 two = _mm512_set1_ps(2.0f), y2 = _mm512_mul_ps(y, two);
        *acc = _mm512_add_ps(*acc, sf ? _mm512_add_ps(y2, _mm512_mul_ps(zn, two)) : y2);
    }
    vstore_(full, lm, pr + j, y);
    if (sf) vstore_(full, lm, zr + j, zn);
}

static inline __attribute__((always_inline)) void update_row_avx512_(
        const int sf, const int decay, const int gate, const int chk, float *check, const float *restrict orow,
        float *restrict pr, float *restrict zr, int64_t C, float rsc, float lr, float lrc, float wdf, float wd,
        float c, int keep, int64_t *un_out, int64_t *ub_out) {
    const vparam_t k = vparam_make_(lr, lrc, wdf, wd, c);
    const __m512 r = _mm512_set1_ps(rsc);
    __m512 acc = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= C; j += 16)
        vec_row_(sf, decay, gate, 1, (__mmask16)0xFFFF, orow, pr, zr, j, r, &k, keep, un_out, ub_out, chk, &acc);
    if (j < C)
        vec_row_(sf, decay, gate, 0, vlanes_(C - j), orow, pr, zr, j, r, &k, keep, un_out, ub_out, chk, &acc);
    if (chk) *check = _mm512_reduce_add_ps(acc); /* any order: only its finiteness is read */
}
#define UPDATE_ROW_(sf, decay, gate, ...) update_row_avx512_(sf, decay, gate, 0, NULL, __VA_ARGS__)
#define STOCK_ROW_CHECKED_(sf, decay, check, ...) update_row_avx512_(sf, decay, 0, 1, check, __VA_ARGS__)
#else
#define UPDATE_ROW_(sf, decay, gate, ...) update_row_(sf, decay, gate, 0, 0, NULL, __VA_ARGS__)
#define STOCK_ROW_CHECKED_(sf, decay, check, ...) update_row_(sf, decay, 0, 1, 1, check, __VA_ARGS__)
#endif

/* Pass B over one row of a bf16 parameter (and z): widened into the thread's row buffers, updated there and
 * rounded back once per value. The parameter's rows stay untouched until then, so a kept value is written
 * back as the bits it had.
 *
 * The row first takes the stock loop (the AVX-512 form where the build has it), which under a gate also
 * sums 2·y (+ 2·z): non-finite wherever a new value is NaN, ±Inf or at least 2^127 (its doubling overflows
 * before any addition could cancel it), which covers every value that rounds to Inf in bf16
 * ((2 - 2^-8)·2^127; a finite sum that overflows, or a value between 2^127 and that bound, only costs the
 * exact path: spectral_rows.h's row_check_ rule). Only a row that fails — or a held or "skip" tensor's — is
 * widened again and computed by the portable loop with the guard, which decides and counts per entry; the
 * stock values are that loop's wherever every new value is storable. The guarded portable loop on every row
 * made "repair" cost SF-NorMuon's bf16 post call about 0.4 ms of its 2.3 ms, and a separate pass for the
 * test about 0.3 ms (default GPT, 2 threads, a scratch script timing the C calls, 2026-11-27). */
static void update_row_bf16_(int sf, int decay, int gate, const float *restrict orow, void *restrict p,
                             void *restrict z, float *restrict prow, float *restrict zrow, int64_t C, float rsc,
                             float lr, float lrc, float wdf, float wd, float c, int keep, int64_t *un, int64_t *ub) {
    widen_row_(p, 1, prow, C);
    if (sf) widen_row_(z, 1, zrow, C);
    if (!keep) {
        float check = 0.0f;
        if (!gate && !sf) UPDATE_ROW_(0, 0, 0, orow, prow, zrow, C, rsc, lr, lrc, wdf, wd, c, 0, un, ub);
        else if (!gate && !decay) UPDATE_ROW_(1, 0, 0, orow, prow, zrow, C, rsc, lr, lrc, wdf, wd, c, 0, un, ub);
        else if (!gate) UPDATE_ROW_(1, 1, 0, orow, prow, zrow, C, rsc, lr, lrc, wdf, wd, c, 0, un, ub);
        else if (!sf) STOCK_ROW_CHECKED_(0, 0, &check, orow, prow, zrow, C, rsc, lr, lrc, wdf, wd, c, 0, un, ub);
        else if (!decay) STOCK_ROW_CHECKED_(1, 0, &check, orow, prow, zrow, C, rsc, lr, lrc, wdf, wd, c, 0, un, ub);
        else STOCK_ROW_CHECKED_(1, 1, &check, orow, prow, zrow, C, rsc, lr, lrc, wdf, wd, c, 0, un, ub);
        if (finitef_(check)) {
            narrow_row_(prow, p, 1, C);
            if (sf) narrow_row_(zrow, z, 1, C);
            return;
        }
        widen_row_(p, 1, prow, C); /* a value not storable: the guarded loop, from the old values */
        if (sf) widen_row_(z, 1, zrow, C);
    }
    if (!sf) update_row_(0, 0, 1, 1, 0, NULL, orow, prow, zrow, C, rsc, lr, lrc, wdf, wd, c, keep, un, ub);
    else if (!decay) update_row_(1, 0, 1, 1, 0, NULL, orow, prow, zrow, C, rsc, lr, lrc, wdf, wd, c, keep, un, ub);
    else update_row_(1, 1, 1, 1, 0, NULL, orow, prow, zrow, C, rsc, lr, lrc, wdf, wd, c, keep, un, ub);
    narrow_row_(prow, p, 1, C);
    if (sf) narrow_row_(zrow, z, 1, C);
}

/* Σⱼ (O·inv)² of a tensor's rows in double: the rare path of ‖Ô‖_F, taken only when the fp32 row sums (or
 * their products with 1/dᵢ²) came out non-finite. NS5's output cannot get there, but a finite O whose squares
 * pass fp32's maximum (entries past ~1e19) would otherwise give ‖Ô‖_F = +Inf and a silently zero update;
 * in double no square of an fp32 value overflows. A non-finite O stays non-finite (the direction count). */
static double frobenius_sq_wide_(const void *o, int o_bf16, const float *inv, int64_t R, int64_t C) {
    double nsq = 0.0;
    for (int64_t r = 0; r < R; r++) {
        double sq = 0.0;
        for (int64_t j = 0; j < C; j++) {
            const double x = o_bf16 ? (double)bf16_to_f32_(((const uint16_t *)o)[r * C + j])
                                    : (double)((const float *)o)[r * C + j];
            sq += x * x;
        }
        nsq += sq * ((double)inv[r] * (double)inv[r]);
    }
    return nsq;
}

/* The direction side, on the NS5 outputs o (hot dtype, the parameters' layout). p, z (NULL without
 * schedule-free), v (NorMuon row moments, NULL without NorMuon): per tensor; row_ok and hold as pre wrote
 * them (hold: bit 0 the hold rule, bit 1 "skip" — nothing written, counts kept); hp = {1-β₂ᴺ, εᴺ, λ, c,
 * β(1-c)-1}; gamma: the 0-d step size; scale: escalation (gate only).
 * Returns 0, or 1 when scratch memory could not be allocated (nothing written). */
int nonans_spectral_post(int64_t n, void **o, int o_bf16, void **p, void **z, float **v, const int64_t *rows,
                         const int64_t *cols, const uint8_t *row_ok, const uint8_t *hold, const float *gamma,
                         const float *hp, int normuon, int sf, int decay, int policy, const int64_t *sel,
                         const float *scale, int64_t *dense, int nthreads, int p_bf16) {
    const int T = nthreads > 0 ? nthreads : 1;
    const int gate = policy != POLICY_OFF;
    const float one_m_b2 = hp[0], eps = hp[1], wd = hp[2], c = hp[3], coef = hp[4];
    int64_t total_rows = 0;
    for (int64_t i = 0; i < n; i++) total_rows += rows[i];
    float *rs = calloc((size_t)(3 * total_rows + 1), sizeof(float));   /* Σ O², Σ O, 1/dᵢ per row */
    /* update counts, NorMuon moment-overflow counts (per tensor and thread), row offsets, dir counts */
    int64_t *cnt = calloc((size_t)(3 * n * T + 3 * n + 1), sizeof(int64_t));
    if (!rs || !cnt) {
        free(rs); free(cnt);
        return 1;
    }
    int64_t *mom = cnt + 2 * n * T, *row_off = mom + n * T, *dirc = row_off + n;
    int64_t max_cols = 1;
    for (int64_t i = 0, acc = 0; i < n; i++) {
        row_off[i] = acc;
        acc += rows[i];
        max_cols = cols[i] > max_cols ? cols[i] : max_cols;
    }
    /* per thread: the widened O row, and a bf16 parameter's p and z rows */
    const int64_t nbuf = (o_bf16 ? 1 : 0) + (p_bf16 ? 2 : 0);
    float *rowbufs = nbuf ? malloc((size_t)(T * nbuf * max_cols) * sizeof(float)) : NULL;
    if (nbuf && !rowbufs) {
        free(rs); free(cnt);
        return 1;
    }
#pragma omp parallel num_threads(T)
    {
        const int tid = thread_id_(), nt = thread_count_();
        float *rowbuf = nbuf ? rowbufs + tid * nbuf * max_cols : NULL;
        float *prow = p_bf16 ? rowbuf + (o_bf16 ? max_cols : 0) : NULL, *zrow = p_bf16 ? prow + max_cols : NULL;
        for (int64_t i = 0; i < n; i++) {
            const int64_t R = rows[i], C = cols[i], base = row_off[i];
            const int64_t r0 = R * tid / nt, r1 = R * (tid + 1) / nt;
            float *row_sq = rs + base, *row_sum = rs + total_rows + base, *inv = rs + 2 * total_rows + base;
            /* pass A */
            int64_t mom_t = 0;
            for (int64_t r = r0; r < r1; r++) {
                float sq = 0.0f, sm = 0.0f;
                if (o_bf16) {
                    const uint16_t *orow = (const uint16_t *)o[i] + r * C;
#pragma omp simd reduction(+ : sq, sm)
                    for (int64_t j = 0; j < C; j++) { const float x = bf16_to_f32_(orow[j]); sq += x * x; sm += x; }
                } else {
                    const float *orow = (const float *)o[i] + r * C;
#pragma omp simd reduction(+ : sq, sm)
                    for (int64_t j = 0; j < C; j++) { const float x = orow[j]; sq += x * x; sm += x; }
                }
                row_sq[r] = sq;
                row_sum[r] = sm;
                float d = 1.0f;
                if (normuon) {
                    const float vo = v[i][r];
                    float vn = lerpf_(vo, sq / (float)C, one_m_b2);
                    if (gate) { /* a row that saw a bad gradient keeps its moment; so does one whose moment
                                 * overflowed with a finite gradient (counted: the moment stage), and its
                                 * direction divides by the kept value, not by +Inf (which would zero the row) */
                        const int ok = row_ok[base + r], over = ok && !finitef_(vn);
                        mom_t += over;
                        vn = ok && !over ? vn : vo;
                    }
                    d = 1.0f / (sqrtf(vn) + eps);
                    if (gate) vn = finitef_(vn) ? vn : vo;
                    if (!(gate && (hold[i] & 2))) v[i][r] = vn; /* "skip": used for this step, not kept */
                }
                inv[r] = d;
            }
            mom[i * T + tid] = mom_t;
#pragma omp barrier
            /* ‖Ô‖_F and the RMS-matching factor: the same sum, in the same order, on every thread */
            double nsq = 0.0;
            for (int64_t r = 0; r < R; r++) nsq += (double)(row_sq[r] * inv[r] * inv[r]);
            if (__builtin_expect(!isfinite(nsq), 0)) nsq = frobenius_sq_wide_(o[i], o_bf16, inv, R, C);
            const float norm = (float)sqrt(nsq);
            const float target = (float)(0.2 * sqrt((double)(R * C)));
            const float fac = norm > 0.0f ? target / norm : 0.0f;
            if (gate && tid == 0) { /* ΣU = Σᵢ row_scaleᵢ·ΣⱼOᵢⱼ: finite iff every entry of U is */
                float total = 0.0f;
                for (int64_t r = 0; r < R; r++) total += row_sum[r] * (inv[r] * fac);
                dirc[2 * i] = total != total;
                dirc[2 * i + 1] = isinf(total) != 0;
            }
            const float lr = gate ? *gamma * scale[sel[i]] : *gamma;
            const float lrc = lr * coef, wdf = 1.0f - lr * wd;
            const int keep = gate && hold[i] != 0, held = gate && (hold[i] & 1);
            int64_t un_t = 0, ub_t = 0;
            /* pass B (a bf16 row is widened into the thread's row buffer first, which stays in L1) */
            for (int64_t r = r0; r < r1; r++) {
                const float rsc = inv[r] * fac;
                const float *orow = (const float *)o[i] + r * C;
                if (o_bf16) {
                    widen_row_((const uint16_t *)o[i] + r * C, 1, rowbuf, C);
                    orow = rowbuf;
                }
                if (p_bf16) {
                    update_row_bf16_(sf, decay, gate, orow, (uint16_t *)p[i] + r * C,
                                     sf ? (void *)((uint16_t *)z[i] + r * C) : NULL, prow, zrow, C, rsc, lr, lrc, wdf,
                                     wd, c, keep, &un_t, &ub_t);
                    continue;
                }
                float *pr = (float *)p[i] + r * C, *zr = sf ? (float *)z[i] + r * C : NULL;
                if (!gate && !sf) UPDATE_ROW_(0, 0, 0, orow, pr, zr, C, rsc, lr, lrc, wdf, wd, c, 0, &un_t, &ub_t);
                else if (!gate && !decay)
                    UPDATE_ROW_(1, 0, 0, orow, pr, zr, C, rsc, lr, lrc, wdf, wd, c, 0, &un_t, &ub_t);
                else if (!gate) UPDATE_ROW_(1, 1, 0, orow, pr, zr, C, rsc, lr, lrc, wdf, wd, c, 0, &un_t, &ub_t);
                else if (!sf) UPDATE_ROW_(0, 0, 1, orow, pr, zr, C, rsc, lr, lrc, wdf, wd, c, keep, &un_t, &ub_t);
                else if (!decay) UPDATE_ROW_(1, 0, 1, orow, pr, zr, C, rsc, lr, lrc, wdf, wd, c, keep, &un_t, &ub_t);
                else UPDATE_ROW_(1, 1, 1, orow, pr, zr, C, rsc, lr, lrc, wdf, wd, c, keep, &un_t, &ub_t);
            }
            cnt[(i * T + tid) * 2] = held ? 0 : un_t; /* a held tensor writes nothing, so counts nothing */
            cnt[(i * T + tid) * 2 + 1] = held ? 0 : ub_t; /* a skipped one counts what it would have written */
        }
    }
    if (gate && dense != NULL) {
        for (int64_t i = 0; i < n; i++) {
            int64_t un = 0, ub = 0, mo = 0;
            for (int t = 0; t < T; t++) {
                un += cnt[(i * T + t) * 2];
                ub += cnt[(i * T + t) * 2 + 1];
                mo += mom[i * T + t];
            }
            int64_t *row = dense + sel[i] * NSTAGE * 2;
            row[ST_MOMENT * 2 + 1] += mo;
            row[ST_DIRECTION * 2] += dirc[2 * i];
            row[ST_DIRECTION * 2 + 1] += dirc[2 * i + 1];
            row[ST_UPDATE * 2] += un;
            row[ST_UPDATE * 2 + 1] += ub - un;
        }
    }
    free(rs); free(cnt); free(rowbufs);
    return 0;
}
