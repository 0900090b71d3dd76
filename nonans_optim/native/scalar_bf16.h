/* The bf16 form of scalar_entry.h's update_block under a gate: test the inputs, then run the stock loop.
 *
 * Why: the gated loop (update_block_t_ with bf = 1) selects and counts per entry, and the bf16 step is
 * bound by its arithmetic (two divisions and a square root per entry, the conversions), not by memory, so
 * that work shows: "repair" ran 1.49x (AdamW) and 1.47x (SFAdamW) the "off" step on the default GPT in bf16
 * (a scratch script, 2026-11-26, policy switched on one optimizer, 30 interleaved rounds, Intel Xeon, 2
 * threads), where fp32 runs within a few percent.
 *
 * How: scalar_avx2.h's early test, on bf16 bits, inside the loop that computes. Per group of SPEC_BF16
 * entries, one loop loads g, p, v and m (AdamW) or z (schedule-free), runs the stock arithmetic (entry_,
 * update_block_t_'s own) into three small arrays of rounded bits, and takes the largest magnitude of g, p
 * and m or z and the largest raw bit pattern of the old v. Where the magnitudes are within input_limit_
 * and v within [+0, FLT_MAX / 4], every value the stock arithmetic computes is finite and far below bf16's
 * largest finite value, so no gate of the gated loop fires and the stock values are the gated loop's
 * bits, with nothing to count: the arrays are copied out. A group that fails (a NaN or ±Inf anywhere, or
 * a magnitude past the bound) is computed again by the gated loop from its untouched inputs, which
 * decides and counts per entry; so is a tail shorter than a group. With the sign bit cleared, bf16 bit
 * patterns order like their magnitudes, every NaN above +Inf (0x7F80), so each test is an unsigned max;
 * the bound's bits are truncated, never above the bound, and a sign bit on v (-0 too, which only costs
 * the exact path) fails. No value of a tested group can be NaN, so its rounding skips the NaN select.
 *
 * Tried first, on a scratch C driver (one thread, 262K entries, repair / off of the whole native step):
 * speculating — the stock loop writing in place, a backup of the old values, the written bits tested —
 * about 1.2x, the backup's copies most of it; the same test as a separate pass over the group before the
 * stock loop, 1.14-1.33x (a pass of its own does not overlap the arithmetic, which bounds this step);
 * this form with groups of 32 entries 1.14x (AdamW) and 1.09x (SFAdamW), 64 entries 1.07-1.09x and
 * 1.03-1.05x. python -m experiments bf16-cpu measures what it costs in a real step. */
#ifndef NONANS_SCALAR_BF16_H
#define NONANS_SCALAR_BF16_H

#define SPEC_BF16 64 /* entries per tested group: four 16-lane vectors of fp32 arithmetic, two of bf16 bits */

/* Bits of a non-negative float as bf16, rounded toward zero: a bound that never exceeds x. */
static inline uint16_t bf16_floor_bits_(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)(u >> 16);
}

/* The frame the SIMD bf16 loops (scalar_avx512_bf16.h, scalar_avx2_bf16.h) share, around their steps of
 * `step` entries over [b0, b1): a block that the portable loop takes whole — a held or "skip" tensor's, or
 * one with a non-finite hyperparameter, under "off" too (their tests read rounded values, see
 * finite_hyper_) — is run here and 1 returned; else 0, and bf16_tail_ runs the entries after the last
 * whole step. */
#define BF16_BLOCK_ARGS_ p, g, m, v, z, b0, b1, s, lr, wdf, lrc, bc1, bc2, h
static inline __attribute__((always_inline)) int bf16_whole_block_(
        const int sf, const int gate, const int decay_z, void *restrict p, const void *restrict g,
        void *restrict m, void *restrict v, void *restrict z, int64_t b0, int64_t b1, float s, float lr,
        float wdf, float lrc, float bc1, float bc2, const hyper_t h, int hold, int keep_all, int64_t *c) {
    if (!(gate && (hold || keep_all)) && finite_hyper_(s, lr, wdf, lrc, bc1, bc2, h)) return 0;
    update_block_t_(1, sf, gate, 0, decay_z, p, g, m, v, z, b0, b1, s, lr, wdf, lrc, bc1, bc2, h, hold, keep_all, c);
    return 1;
}

static inline __attribute__((always_inline)) void bf16_tail_(
        const int sf, const int gate, const int decay_z, int64_t step, void *restrict p, const void *restrict g,
        void *restrict m, void *restrict v, void *restrict z, int64_t b0, int64_t b1, float s, float lr,
        float wdf, float lrc, float bc1, float bc2, const hyper_t h, int64_t *c) {
    const int64_t tail = b0 + (b1 - b0) / step * step;
    if (tail < b1)
        update_block_t_(1, sf, gate, 0, decay_z, p, g, m, v, z, tail, b1, s, lr, wdf, lrc, bc1, bc2, h, 0, 0, c);
}

/* update_block_t_(1, ...) for [b0, b1), same arguments, same bits, same counts. */
static inline __attribute__((always_inline)) void update_block_bf16_(
        const int sf, const int gate, const int clean, const int decay_z,
        void *restrict p, const void *restrict g, void *restrict m, void *restrict v, void *restrict z,
        int64_t b0, int64_t b1, float s, float lr, float wdf, float lrc, float bc1, float bc2, const hyper_t h,
        int hold, int keep_all, int64_t *c) {
    /* (input_limit_ is 0 for a non-finite hyperparameter: clean_limit_ asks finite_hyper_) */
    const float lim = gate && !hold && !keep_all ? input_limit_(sf, decay_z, s, lr, wdf, lrc, bc1, bc2, h) : 0.0f;
    if (!(lim > 0.0f)) { /* "off", a tensor decided by its whole gradient (held, "skip"), a non-finite
                          * hyperparameter, or no bound (eps = 0) */
        update_block_t_(1, sf, gate, clean, decay_z, p, g, m, v, z, b0, b1, s, lr, wdf, lrc, bc1, bc2, h, hold,
                        keep_all, c);
        return;
    }
    const uint16_t lb = bf16_floor_bits_(lim), vlb = bf16_floor_bits_(FLT_MAX / 4.0f);
    const uint16_t *const G = (const uint16_t *)g;
    uint16_t *const P = (uint16_t *)p, *const V = (uint16_t *)v, *const S = (uint16_t *)(sf ? z : m);
    int64_t j = b0;
    for (; j + SPEC_BF16 <= b1; j += SPEC_BF16) {
        uint16_t ty[SPEC_BF16], tv[SPEC_BF16], ts[SPEC_BF16], mx = 0, vx = 0;
#pragma omp simd reduction(max : mx, vx)
        for (int l = 0; l < SPEC_BF16; l++) {
            const uint16_t gb = G[j + l], pb = P[j + l], sb = S[j + l], vb = V[j + l];
            const uint16_t a = gb & 0x7FFFu, b = pb & 0x7FFFu, d = sb & 0x7FFFu, ab = a > b ? a : b;
            const uint16_t abd = ab > d ? ab : d;
            mx = abd > mx ? abd : mx;
            vx = vb > vx ? vb : vx;
            const entry_t e = entry_(1, sf, 0, 0, decay_z, bf16_to_f32_(gb), bf16_to_f32_(vb), bf16_to_f32_(sb),
                                     bf16_to_f32_(pb), s, lr, wdf, lrc, bc1, bc2, h, 0, 0);
            ty[l] = f32_to_bf16_rne_(e.y);
            tv[l] = f32_to_bf16_rne_(e.vn);
            ts[l] = f32_to_bf16_rne_(e.sn);
        }
        if (mx <= lb && vx <= vlb) {
            memcpy(P + j, ty, sizeof ty);
            memcpy(V + j, tv, sizeof tv);
            memcpy(S + j, ts, sizeof ts);
        } else {
            update_block_t_(1, sf, 1, clean, decay_z, p, g, m, v, z, j, j + SPEC_BF16, s, lr, wdf, lrc, bc1, bc2, h,
                            0, 0, c);
        }
    }
    if (j < b1)
        update_block_t_(1, sf, 1, clean, decay_z, p, g, m, v, z, j, b1, s, lr, wdf, lrc, bc1, bc2, h, 0, 0, c);
}
#endif
