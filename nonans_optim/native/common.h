/* Shared by the native kernels: policy and stage codes, and the scalar helpers every loop uses. */
#ifndef NONANS_COMMON_H
#define NONANS_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { POLICY_OFF = 0, POLICY_REPAIR = 1, POLICY_SKIP = 2 };
/* Stage rows of the (P, S, 2) count block: the order of nonans_optim.resolution.STAGES. */
enum { ST_GRAD = 0, ST_MOMENT = 1, ST_DIRECTION = 2, ST_UPDATE = 3, ST_LOSS = 4, ST_SPIKE = 5, NSTAGE = 6 };
enum { NCOUNT = 5 };          /* per tensor: grad nan, grad non-finite, v overflow, update nan, update non-finite */
#define BLOCK 16384           /* int32 counters per block, flushed to int64: no overflow at any size */

static inline int finitef_(float x) { return fabsf(x) < INFINITY; }

/* torch.lerp's formula (aten/src/ATen/native/Lerp.h): exact at both ends, so lerp(m, m, w) == m. */
static inline float lerpf_(float a, float b, float w) {
    return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

/* The spike guard of nonans_optim/functional/spike.py::spike_scale, for one tensor: the norm of its finite
 * entries in double (guard_sumsq_), the comparison and cap/norm in double, the EMA in fp32 — a norm beyond
 * FLT_MAX triggers with a finite scale but never seeds the EMA, and only a complete gradient (no non-finite
 * entry) updates it. The scale is at least the smallest fp32 subnormal: a capped ±Inf entry stays ±Inf. */
static inline float spike_(double norm, int complete, float ema, float factor, float beta, float one_m_beta,
                           float *new_ema, int *trig) {
    const int fin = fabs(norm) < INFINITY, seeded = ema > 0.0f;
    const float cap = factor * ema;
    const int t = fin && seeded && norm > (double)cap;
    const float observed = t ? cap : (float)norm;
    *new_ema = complete && fin && finitef_(observed) && observed > 0.0f
                   ? (seeded ? ema * beta + one_m_beta * observed : observed) : ema; /* not a zero g (spike.py) */
    *trig = t;
    return t ? (float)fmax((double)cap / norm, 0x1p-149) : 1.0f;
}

/* bf16 ↔ fp32 as torch converts them (c10/util/BFloat16.h): round to nearest even, any NaN → 0x7FC0. */
static inline float bf16_to_f32_(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The rounding alone, for a value known not to be NaN (scalar_bf16.h's tested groups skip the select). */
static inline uint16_t f32_to_bf16_rne_(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline uint16_t f32_to_bf16_(float f) { return f != f ? 0x7FC0 : f32_to_bf16_rne_(f); }

/* Entry j of an array stored as fp32 (bf = 0) or bf16 (bf = 1), as fp32; bf is a compile-time constant at
 * every call, so the other branch is gone and the loop around it vectorises as a plain fp32 (or widening)
 * loop. */
static inline float ld_(const void *a, int64_t j, const int bf) {
    return bf ? bf16_to_f32_(((const uint16_t *)a)[j]) : ((const float *)a)[j];
}

/* x stored at entry j, rounded once (bf16: to nearest even, as torch's .to(torch.bfloat16)). */
static inline void st_(void *a, int64_t j, float x, const int bf) {
    if (bf) ((uint16_t *)a)[j] = f32_to_bf16_(x);
    else ((float *)a)[j] = x;
}

/* Row helpers of the spectral loops. A bf16 row is widened into an fp32 row buffer first (it stays in L1),
 * so every arithmetic loop runs on plain fp32 arrays and vectorises, and narrowed back once. */
static inline void widen_row_(const void *restrict src, int bf16, float *restrict dst, int64_t C) {
    if (!bf16) {
        memcpy(dst, src, (size_t)C * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)src;
#pragma omp simd
    for (int64_t j = 0; j < C; j++) dst[j] = bf16_to_f32_(h[j]);
}

static inline void narrow_row_(const float *restrict src, void *restrict dst, int bf16, int64_t C) {
    if (!bf16) {
        memcpy(dst, src, (size_t)C * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)dst;
#pragma omp simd
    for (int64_t j = 0; j < C; j++) h[j] = f32_to_bf16_(src[j]);
}

/* Finite *as stored*: for bf16, below the magnitude that rounds to Inf ((2 - 2^-8)·2^127: bf16's largest
 * finite value plus half an ulp, a tie that rounds to the even Inf), as nonans_optim.detection.storable_mask
 * compares in fp32; a finite fp32 value above it would be written as Inf. */
static inline int storable_(float x, const int bf) { return fabsf(x) < (bf ? 0x1.FFp127f : INFINITY); }

/* The sum of squares of the finite entries of x[0, n), which the spike guard adds up, given their fp32 sum
 * part over all entries: part itself when finite and at least 2^-100 (every entry finite, no square
 * overflowed, and the squares that matter are normal fp32 numbers); otherwise Σ x² over the finite entries
 * again in double:
 *  - a NaN/±Inf entry, or one above about 1.8e19 whose square overflowed: finite in double for any finite
 *    fp32 entries (n·FLT_MAX² is far below DBL_MAX), so the guard sees the largest finite spikes, also
 *    beside a NaN (functional/spike.py: the fp16-overflow pattern), instead of a non-finite norm it would
 *    let through;
 *  - a gradient below about 1e-19, whose fp32 squares are subnormal or 0: the fp32 sum lost the norm (|g|
 *    = 1e-24 gave 0, so the EMA and the spike decisions differed from spike.py's float64 norm — the fuzz
 *    audit, 2026-11-26). An all-zero gradient is told apart by a scan that stops at its first non-zero
 *    entry, and stays 0.
 * Rare, so scalar and in a fixed order (the same in every build). */
static inline double guard_sumsq_t_(float part, const void *x, int64_t n, const int bf) {
    if (fabsf(part) < INFINITY && part >= 0x1p-100f) return part;
    if (part == 0.0f) {
        int64_t j = 0;
        while (j < n && ld_(x, j, bf) == 0.0f) j++;
        if (j == n) return 0.0;
    }
    double acc = 0.0;
    for (int64_t j = 0; j < n; j++)
        if (finitef_(ld_(x, j, bf))) acc += (double)ld_(x, j, bf) * (double)ld_(x, j, bf);
    return acc;
}

static inline double guard_sumsq_(float part, const float *x, int64_t n) { return guard_sumsq_t_(part, x, n, 0); }

/* Resolution.recent() for the parameter at global index j: an event within the repeat window, the hold
 * rule's precondition (one place for both kernels; the torch method is the ground truth). The loss stage
 * is the optimizer's, not the parameter's (resolution.PARAM_STAGES). */
static inline int recent_event_(const int64_t *clean_streak, const int64_t *events, int64_t j, int64_t window) {
    int64_t ev = 0;
    for (int s = 0; s < NSTAGE; s++) ev += s == ST_LOSS ? 0 : events[j * NSTAGE + s];
    return clean_streak[j] < window && ev > 0;
}

/* Thread id and count inside a parallel region (0 and 1 without OpenMP). */
static inline int thread_id_(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int thread_count_(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

#endif
