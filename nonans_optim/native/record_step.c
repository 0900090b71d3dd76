/* The resolution counters' per-step fold (Resolution.record_step) for CPU tensors; nonans_scalar_step
 * (scalar_step.c) calls the packed form at the end of a step whose counts it alone produced. */
#include "common.h"

/* Resolution.record_step (nonans_optim/resolution.py, the ground truth; tests/test_fused.py checks that
 * both leave identical tensors) for CPU tensors: about twenty small torch ops there, one loop here —
 * on a 52-tensor model those ops cost more than the repair itself. Same order of operations, same fp32
 * arithmetic on the scale (x·0.5, x·2 and the clamps are exact in any order). */
void nonans_record_step(int64_t P, int64_t K, const int64_t *step_counts, int64_t step, float backoff,
                        float min_scale, int64_t growth_interval, int64_t repeat_window, int64_t *counts,
                        int64_t *events, int64_t *ring_counts, int64_t *ring_step, uint8_t *ring_escalated,
                        int64_t *ring_ptr, float *scale, int64_t *clean_streak, int64_t *escalations,
                        const int64_t *numel, uint8_t *ring_held) {
    const int64_t slot = ((*ring_ptr % K) + K) % K; /* torch.remainder: non-negative for K > 0 */
    int any = 0;
    for (int64_t i = 0; i < P; i++) {
        const int64_t *c = step_counts + i * NSTAGE * 2;
        int param_event = 0, seen_before = 0, loss_event = 0; /* the loss stage is nobody's (PARAM_STAGES) */
        for (int s = 0; s < NSTAGE; s++) {
            const int ev = c[2 * s] + c[2 * s + 1] > 0;
            if (s == ST_LOSS) {
                loss_event = ev;
            } else {
                param_event |= ev;
                seen_before |= events[i * NSTAGE + s] > 0;
            }
        }
        const int64_t streak = clean_streak[i];
        const int repeated = param_event && seen_before && streak < repeat_window;
        const int grown = ((streak + 1) % growth_interval + growth_interval) % growth_interval == 0;
        const float old = scale[i];
        float ns = old;
        if (repeated) {
            ns = old * backoff;
            ns = ns < min_scale ? min_scale : ns;
        } else if (grown && !param_event) {
            ns = old * 2.0f;
            ns = ns > 1.0f ? 1.0f : ns;
        }
        const int escalated = repeated && ns < old;
        /* held (the hold rule of the update kernels): a gradient with no finite entry on a parameter that
         * had an event within the window — exactly "repeated" with the whole tensor missing */
        const int held = repeated && numel[i] > 0 && c[ST_GRAD * 2] + c[ST_GRAD * 2 + 1] == numel[i];
        if (escalated) escalations[i] += 1;
        clean_streak[i] = param_event ? 0 : streak + 1;
        if (ns != old) scale[i] = ns;
        /* Only what changes is written: a clean step adds zeros to counts and events and finds the free
         * ring slot already zero (the last clean step wrote it), so it only reads them. The torch path
         * writes them all; the values are the same, but on a memory-bound step every cache line dirtied
         * here is one more write-back. */
        int64_t *ring = ring_counts + (slot * P + i) * NSTAGE * 2;
        for (int s = 0; s < NSTAGE; s++) {
            if (c[2 * s] + c[2 * s + 1] > 0) {
                counts[(i * NSTAGE + s) * 2] += c[2 * s];
                counts[(i * NSTAGE + s) * 2 + 1] += c[2 * s + 1];
                events[i * NSTAGE + s] += 1;
            }
            if (ring[2 * s] != c[2 * s]) ring[2 * s] = c[2 * s];
            if (ring[2 * s + 1] != c[2 * s + 1]) ring[2 * s + 1] = c[2 * s + 1];
        }
        if (ring_escalated[slot * P + i] != (uint8_t)escalated) ring_escalated[slot * P + i] = (uint8_t)escalated;
        if (ring_held[slot * P + i] != (uint8_t)held) ring_held[slot * P + i] = (uint8_t)held;
        any |= param_event | loss_event; /* the ring keeps every step that had an event */
    }
    ring_step[slot] = step;
    *ring_ptr += any;
}

/* nonans_record_step with its per-optimizer constants packed once into one int64 array — P, K,
 * growth_interval, repeat_window, then the eleven counter pointers in nonans_record_step's order — so that a
 * step's call converts five arguments instead of seventeen (ctypes spends about as long converting them as
 * the loop above takes on a 52-parameter model; nonans_optim/native/__init__.py::record_step). */
void nonans_record_step_packed(const int64_t *pack, float backoff, float min_scale, const int64_t *step_counts,
                               int64_t step) {
    int64_t *const *q = (int64_t *const *)(pack + 4);
    nonans_record_step(pack[0], pack[1], step_counts, step, backoff, min_scale, pack[2], pack[3], q[0], q[1], q[2],
                       q[3], (uint8_t *)q[4], q[5], (float *)q[6], q[7], q[8], q[9], (uint8_t *)q[10]);
}
