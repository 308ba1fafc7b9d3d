/* The elementwise ops of the CPU path: RMSNorm (with or without the residual add), SiLU-and-mul,
 * rotary embedding and the KV-cache store, and the sampler's greedy argmax and token bitmask (the
 * grammar's mask applied in place, twin in batchapi/kernels/torch/bitmask.py); built like
 * paged_decode.c (build.py), called by elementwise.py.
 *
 * Each reproduces its torch twin (batchapi/kernels/torch/elementwise.py) rounding for rounding. In bf16
 * every torch op rounds its fp32 result to bf16 (nearest even), so these round after the same
 * steps; in fp32 they take the same steps without the roundings (and without fused multiply-adds:
 * -std=c11 keeps gcc from contracting). Only the exp differs; even the variance adds in torch's order.
 *
 * Layouts: an input is [rows, ...] with each row dense and `*_stride` elements from one row to
 * the next (the engine's q, k and v are column slices of one qkv matrix); outputs are contiguous.
 * Rows are independent, so a result does not depend on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define MAX_ROTARY_DIM 512 /* a row's cos and sin, converted, live on the stack */
#define PARALLEL_MIN 16384  /* elements: below this a second thread costs more to wake than it saves */
#define BITMASK_PARALLEL_MIN (1LL << 19) /* logits of apply_token_bitmask: ~20 us of work in one thread */
#define ARGMAX_PARALLEL_MIN (1LL << 18) /* logits of argmax_rows: ~30 us of work in one thread */

INLINE float element(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The kernels work on pairs of vectors holding 32 consecutive elements of a row (2 in the portable
 * code). bf16 pairs hold the even elements in `a` and the odd ones in `b`: a 32-bit word of bf16
 * storage is (odd << 16 | even), so splitting and joining cost one shift and one mask. Every op is
 * elementwise, so any layout works as long as all operands share it. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "silu16.h"
#define STEP 32
typedef __m512 vec;

INLINE __mmask32 lanes(int64_t left) { return left >= 32 ? 0xffffffffu : (__mmask32)((1ull << left) - 1u); }

INLINE vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
INLINE vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
INLINE vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
INLINE vec splat(float x) { return _mm512_set1_ps(x); }

/* x rounded to bf16 (kept in fp32) when bf16, else x (silu16.h: without torch's NaN test) */
INLINE vec rnd(vec x, int bf16) { return bf16 ? round_bf16_16(x) : x; }

typedef struct {
    vec a, b;
} pair;

INLINE pair load(const void *p, int64_t i, int64_t left, int bf16) {
    const __mmask32 m = lanes(left);
    if (bf16) {
        const __m512i w = _mm512_maskz_loadu_epi16(m, (const uint16_t *)p + i);
        return (pair){_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
                      _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)))};
    }
    return (pair){_mm512_maskz_loadu_ps((__mmask16)m, (const float *)p + i),
                  _mm512_maskz_loadu_ps((__mmask16)(m >> 16), (const float *)p + i + 16)};
}

/* stores x, which rnd() has already rounded when bf16 */
INLINE void store(void *p, int64_t i, int64_t left, pair x, int bf16) {
    const __mmask32 m = lanes(left);
    if (bf16) {
        const __m512i even = _mm512_srli_epi32(_mm512_castps_si512(x.a), 16);
        const __m512i w = _mm512_or_si512(even, _mm512_castps_si512(x.b));
        _mm512_mask_storeu_epi16((uint16_t *)p + i, m, w);
        return;
    }
    _mm512_mask_storeu_ps((float *)p + i, (__mmask16)m, x.a);
    _mm512_mask_storeu_ps((float *)p + i + 16, (__mmask16)(m >> 16), x.b);
}

/* SiLU: silu16.h's (e^x within about 1 ulp), which matmul.c's linear_amx_silu shares */
INLINE vec silu(vec g) { return silu16(g); }

#else
/* portable C: pairs of two elements, plain float arithmetic */
#define VEC_PORTABLE
#define STEP 2
typedef float vec;
typedef struct {
    float a, b;
} pair;

INLINE vec add(vec a, vec b) { return a + b; }
INLINE vec sub(vec a, vec b) { return a - b; }
INLINE vec mul(vec a, vec b) { return a * b; }
INLINE vec splat(float x) { return x; }
INLINE vec rnd(vec x, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }
INLINE vec silu(vec g) { return g / (1.0f + expf(-g)); }

INLINE pair load(const void *p, int64_t i, int64_t left, int bf16) {
    return (pair){element(p, i, bf16), left > 1 ? element(p, i + 1, bf16) : 0.0f};
}
INLINE void store1(void *p, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(x); /* exact: x is rounded already */
    else
        ((float *)p)[i] = x;
}
INLINE void store(void *p, int64_t i, int64_t left, pair x, int bf16) {
    store1(p, i, x.a, bf16);
    if (left > 1) store1(p, i + 1, x.b, bf16);
}
#endif

/* ---- RMSNorm ---- */

/* The variance's sum of squares adds in the order of torch's sum kernel (row_sum and multi_row_sum in
 * aten/src/ATen/native/cpu/SumKernel.cpp, in the 8-lane AVX2 build torch runs on x86 also where
 * AVX-512 is there): 8-lane vectors into four interleaved accumulators, cascaded every 2^power rows
 * of four vectors, the leftover vectors into the first, the scalar tail, then the lanes in turn;
 * rows under 8 elements take its scalar row_sum). Any order would be allowed; this one leaves the
 * twin's results bit for bit the same where torch runs that kernel. */
#define SUM_LANES 8

INLINE float square(const void *p, int64_t i, int bf16) {
    const float v = element(p, i, bf16);
    return v * v; /* rounded to fp32, as x.pow(2) is */
}

#ifdef VEC_PORTABLE
typedef struct {
    float l[SUM_LANES];
} lanes8;

INLINE lanes8 zero8(void) { return (lanes8){{0.0f}}; }
INLINE lanes8 add8(lanes8 a, lanes8 b) {
    for (int l = 0; l < SUM_LANES; l++) a.l[l] += b.l[l];
    return a;
}
INLINE lanes8 squares8(const void *p, int64_t at, int bf16) {
    lanes8 x;
    for (int l = 0; l < SUM_LANES; l++) x.l[l] = square(p, at + l, bf16);
    return x;
}
INLINE void spill8(float *dst, lanes8 x) { memcpy(dst, x.l, sizeof x.l); }
#else
typedef __m256 lanes8;

INLINE lanes8 zero8(void) { return _mm256_setzero_ps(); }
INLINE lanes8 add8(lanes8 a, lanes8 b) { return _mm256_add_ps(a, b); }
INLINE lanes8 squares8(const void *p, int64_t at, int bf16) {
    __m256 v;
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + at));
        v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
        v = _mm256_loadu_ps((const float *)p + at);
    }
    return _mm256_mul_ps(v, v);
}
INLINE void spill8(float *dst, lanes8 x) { _mm256_storeu_ps(dst, x); }
#endif

static int64_t ceil_log2(int64_t x) { return x <= 1 ? 0 : 64 - __builtin_clzll((uint64_t)x - 1); }

INLINE float sum_of_squares(const void *s, int64_t h, int bf16) {
    float total = 0.0f;
    if (h < SUM_LANES) { /* torch's scalar row_sum: four interleaved sums, the tail into the first */
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int64_t e = 0;
        for (; e + 4 <= h; e += 4)
            for (int k = 0; k < 4; k++) acc[k] += square(s, e + k, bf16);
        for (; e < h; e++) acc[0] += square(s, e, bf16);
        return ((acc[0] + acc[1]) + acc[2]) + acc[3];
    }
    const int64_t vectors = h / SUM_LANES, rows = vectors / 4;
    const int64_t power = ceil_log2(rows) / 4 > 4 ? ceil_log2(rows) / 4 : 4, step = (int64_t)1 << power;
    lanes8 acc[4][4]; /* [cascade level][accumulator] */
    for (int lv = 0; lv < 4; lv++)
        for (int k = 0; k < 4; k++) acc[lv][k] = zero8();
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++) acc[0][k] = add8(acc[0][k], squares8(s, (4 * i + k) * SUM_LANES, bf16));
        for (int lv = 1; lv < 4; lv++) {
            for (int k = 0; k < 4; k++) {
                acc[lv][k] = add8(acc[lv][k], acc[lv - 1][k]);
                acc[lv - 1][k] = zero8();
            }
            if (i & ((step - 1) << (lv * power))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++) acc[0][k] = add8(acc[0][k], squares8(s, (4 * i + k) * SUM_LANES, bf16));
    for (int lv = 1; lv < 4; lv++)
        for (int k = 0; k < 4; k++) acc[0][k] = add8(acc[0][k], acc[lv][k]);
    for (int64_t t = 4 * rows; t < vectors; t++) acc[0][0] = add8(acc[0][0], squares8(s, t * SUM_LANES, bf16));
    for (int k = 1; k < 4; k++) acc[0][0] = add8(acc[0][0], acc[0][k]);
    for (int64_t e = vectors * SUM_LANES; e < h; e++) total += square(s, e, bf16);
    float lane[SUM_LANES];
    spill8(lane, acc[0][0]);
    for (int l = 0; l < SUM_LANES; l++) total += lane[l];
    return total;
}

INLINE vec rms_scale(vec s, vec inv, vec w, int bf16) { return rnd(mul(w, rnd(mul(s, inv), bf16)), bf16); }

/* out = weight * bf16(s * rsqrt(mean(s^2) + eps)), s = x, or bf16(x + residual) written to summed */
INLINE void rms_row(const void *x, const void *residual, const void *weight, void *out, void *summed, int64_t h,
                    float eps, int bf16) {
    if (residual) {
        for (int64_t i = 0; i < h; i += STEP) {
            const pair a = load(x, i, h - i, bf16), b = load(residual, i, h - i, bf16);
            store(summed, i, h - i, (pair){rnd(add(a.a, b.a), bf16), rnd(add(a.b, b.b), bf16)}, bf16);
        }
    }
    const void *s_row = residual ? summed : x;
    const vec inv = splat(1.0f / sqrtf(sum_of_squares(s_row, h, bf16) / (float)h + eps));
    for (int64_t i = 0; i < h; i += STEP) {
        const pair s = load(s_row, i, h - i, bf16), w = load(weight, i, h - i, bf16);
        store(out, i, h - i, (pair){rms_scale(s.a, inv, w.a, bf16), rms_scale(s.b, inv, w.b, bf16)}, bf16);
    }
}

/* residual NULL: rms_norm; else fused_add_rms_norm, x + residual written to summed [rows, h] */
int rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t residual_stride, const void *weight,
             void *out, void *summed, int64_t rows, int64_t h, float eps, int bf16, int threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * h >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const char *x_row = (const char *)x + r * x_stride * size;
        const char *res_row = residual ? (const char *)residual + r * residual_stride * size : NULL;
        char *out_row = (char *)out + r * h * size, *sum_row = residual ? (char *)summed + r * h * size : NULL;
        if (bf16) /* two copies of the row loop, each with its dtype fixed */
            rms_row(x_row, res_row, weight, out_row, sum_row, h, eps, 1);
        else
            rms_row(x_row, res_row, weight, out_row, sum_row, h, eps, 0);
    }
    return 0;
}

/* ---- SiLU and mul ---- */

INLINE vec silu_mul(vec g, vec u, int bf16) { return rnd(mul(rnd(silu(g), bf16), u), bf16); }

INLINE void silu_row(const char *gate, const char *up, char *out, int64_t inter, int bf16) {
    for (int64_t i = 0; i < inter; i += STEP) {
        const pair g = load(gate, i, inter - i, bf16), u = load(up, i, inter - i, bf16);
        store(out, i, inter - i, (pair){silu_mul(g.a, u.a, bf16), silu_mul(g.b, u.b, bf16)}, bf16);
    }
}

/* out [rows, inter] = silu(x[:, :inter]) * x[:, inter:] */
int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t inter, int bf16, int threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)x + r * x_stride * size;
        char *out_row = (char *)out + r * inter * size;
        if (bf16)
            silu_row(gate, gate + inter * size, out_row, inter, 1);
        else
            silu_row(gate, gate + inter * size, out_row, inter, 0);
    }
    return 0;
}

/* ---- rotary embedding ---- */

/* neox halves: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), each product, then the sum, rounded */
INLINE vec rot_first(vec x1, vec x2, vec c, vec s, int bf16) {
    return rnd(sub(rnd(mul(x1, c), bf16), rnd(mul(x2, s), bf16)), bf16);
}
INLINE vec rot_second(vec x1, vec x2, vec c, vec s, int bf16) {
    return rnd(add(rnd(mul(x2, c), bf16), rnd(mul(x1, s), bf16)), bf16);
}

/* one row's heads; cs: the row's cos (first half) and sin, already in x's dtype */
INLINE void rotate_row(const void *x, void *out, int64_t heads, const void *cs, int64_t half, int bf16) {
    for (int64_t h = 0; h < heads; h++) {
        const int64_t at = h * 2 * half;
        for (int64_t i = 0; i < half; i += STEP) {
            const int64_t left = half - i;
            const pair c = load(cs, i, left, bf16), s = load(cs, half + i, left, bf16);
            const pair x1 = load(x, at + i, left, bf16), x2 = load(x, at + half + i, left, bf16);
            store(out, at + i, left,
                  (pair){rot_first(x1.a, x2.a, c.a, s.a, bf16), rot_first(x1.b, x2.b, c.b, s.b, bf16)}, bf16);
            store(out, at + half + i, left,
                  (pair){rot_second(x1.a, x2.a, c.a, s.a, bf16), rot_second(x1.b, x2.b, c.b, s.b, bf16)}, bf16);
        }
    }
}

/* d elements of cos_sin's row, in the other dtype, into buf: the twin's .to(q.dtype) */
INLINE void convert_row(const void *src, int src_bf16, void *buf, int64_t d) {
    for (int64_t i = 0; i < d; i++) {
        if (src_bf16)
            ((float *)buf)[i] = bf16_to_f32(((const uint16_t *)src)[i]);
        else
            ((uint16_t *)buf)[i] = f32_to_bf16(((const float *)src)[i]);
    }
}

/* the cos/sin row of position pos in x's dtype: read in place, or converted into buf */
INLINE const void *cs_row(const void *cos_sin, int64_t pos, int64_t cs_stride, int cs_bf16, int bf16, float *buf,
                          int64_t d) {
    const void *cs = (const char *)cos_sin + pos * cs_stride * (cs_bf16 ? 2 : 4);
    if (cs_bf16 == bf16) return cs;
    convert_row(cs, cs_bf16, buf, d);
    return buf;
}

/* a row's q heads rotated into q_out, and its k heads into k_out unless that is NULL; the dtype
 * fixed in each call so the row loops specialise */
INLINE void rotate_qk(const char *q_row, char *q_out_row, int64_t hq, const char *k_row, char *k_out_row, int64_t hkv,
                      const void *cs, int64_t d, int bf16) {
    if (bf16) {
        rotate_row(q_row, q_out_row, hq, cs, d / 2, 1);
        if (k_out_row) rotate_row(k_row, k_out_row, hkv, cs, d / 2, 1);
    } else {
        rotate_row(q_row, q_out_row, hq, cs, d / 2, 0);
        if (k_out_row) rotate_row(k_row, k_out_row, hkv, cs, d / 2, 0);
    }
}

/* q_out [rows, hq, d], k_out [rows, hkv, d]; d even, at most MAX_ROTARY_DIM. Returns -1, reading
 * nothing, if a position lies outside cos_sin's max_pos rows. */
int rotary(const void *q, int64_t q_stride, int64_t hq, void *q_out, const void *k, int64_t k_stride, int64_t hkv,
           void *k_out, const int64_t *positions, const void *cos_sin, int64_t cs_stride, int64_t max_pos,
           int cs_bf16, int64_t rows, int64_t d, int bf16, int threads) {
    if (d > MAX_ROTARY_DIM || d % 2) return -2;
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_pos) return -1;
    const int64_t size = bf16 ? 2 : 4, work = rows * (hq + hkv) * d;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && work >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = positions[r];
        if (pos < 0 || pos >= max_pos) continue; /* checked again: the positions are read a second time */
        float buf[MAX_ROTARY_DIM];
        const void *cs = cs_row(cos_sin, pos, cs_stride, cs_bf16, bf16, buf, d);
        rotate_qk((const char *)q + r * q_stride * size, (char *)q_out + r * hq * d * size, hq,
                  (const char *)k + r * k_stride * size, (char *)k_out + r * hkv * d * size, hkv, cs, d, bf16);
    }
    return 0;
}

/* ---- KV-cache store ---- */

INLINE int64_t slot_at(const void *slots, int slots_i64, int64_t r) {
    return slots_i64 ? ((const int64_t *)slots)[r] : ((const int32_t *)slots)[r];
}

/* key/value row r (row_bytes each) to slot slots[r] of the caches [num_slots, row_bytes]; a negative
 * slot is skipped. Returns -1, writing nothing, if a slot lies at or past num_slots. */
int store_kvcache(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                  void *v_cache, const void *slots, int slots_i64, int64_t rows, int64_t num_slots, int64_t row_bytes,
                  int64_t elem_size) {
    for (int64_t r = 0; r < rows; r++)
        if (slot_at(slots, slots_i64, r) >= num_slots) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t slot = slot_at(slots, slots_i64, r);
        if (slot < 0 || slot >= num_slots) continue; /* checked again: the slots are read a second time */
        memcpy((char *)k_cache + slot * row_bytes, (const char *)key + r * key_stride * elem_size, (size_t)row_bytes);
        memcpy((char *)v_cache + slot * row_bytes, (const char *)value + r * value_stride * elem_size,
               (size_t)row_bytes);
    }
    return 0;
}

/* rotary, with the rotated key and the value of each row written straight to its cache slot: q_out
 * [rows, hq, d] as rotary() gives it, k and v rows to slot slots[r] of the caches [num_slots, hkv * d]
 * (a negative slot: the row's key and value are dropped), as store_kvcache() would store rotary()'s
 * k_out. One pass, no k_out. Returns -1 (a position outside cos_sin) or -3 (a slot at or past
 * num_slots) before writing anything; -2 for an unsupported head size. */
int rotary_store(const void *q, int64_t q_stride, int64_t hq, void *q_out, const void *k, int64_t k_stride,
                 const void *v, int64_t v_stride, int64_t hkv, void *k_cache, void *v_cache, const void *slots,
                 int slots_i64, int64_t num_slots, const int64_t *positions, const void *cos_sin, int64_t cs_stride,
                 int64_t max_pos, int cs_bf16, int64_t rows, int64_t d, int bf16, int threads) {
    if (d > MAX_ROTARY_DIM || d % 2) return -2;
    for (int64_t r = 0; r < rows; r++) {
        if (positions[r] < 0 || positions[r] >= max_pos) return -1;
        if (slot_at(slots, slots_i64, r) >= num_slots) return -3;
    }
    const int64_t size = bf16 ? 2 : 4, work = rows * (hq + hkv) * d;
    const int64_t row_bytes = hkv * d * size;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && work >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = positions[r], slot = slot_at(slots, slots_i64, r);
        if (pos < 0 || pos >= max_pos || slot >= num_slots) continue; /* checked again: read a second time */
        float buf[MAX_ROTARY_DIM];
        const void *cs = cs_row(cos_sin, pos, cs_stride, cs_bf16, bf16, buf, d);
        char *k_slot = slot < 0 ? NULL : (char *)k_cache + slot * row_bytes;
        rotate_qk((const char *)q + r * q_stride * size, (char *)q_out + r * hq * d * size, hq,
                  (const char *)k + r * k_stride * size, k_slot, hkv, cs, d, bf16);
        if (k_slot) memcpy((char *)v_cache + slot * row_bytes, (const char *)v + r * v_stride * size, (size_t)row_bytes);
    }
    return 0;
}

/* ---- greedy argmax ---- */

/* out[r] = the index of row r's largest value, the first of ties, as torch.argmax picks it; a NaN
 * counts as the largest (the first NaN wins). Rows of fp32 or bf16, `stride` elements apart, shared
 * by the threads. The maximum, then the first index holding it (compared as floats: -0 ties +0). A
 * scalar search for that index took 5 of the 6 ms of 256 rows of 49,152 bf16 logits; in vectors of
 * 16, the whole call takes 1.2 ms on one thread (Xeon with AMX, family 6 model 167). */
int argmax_rows(const void *x, int64_t stride, int64_t rows, int64_t cols, int bf16, int64_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1 && rows * cols >= ARGMAX_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float best = -INFINITY;
        int nan = 0;
#ifndef VEC_PORTABLE
        if (bf16) { /* 64 values a step in two pairs of running maxima (a bf16 is the high half of its fp32) */
            const uint16_t *row = (const uint16_t *)x + r * stride;
            const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
            __m512 m[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                           _mm512_set1_ps(-INFINITY)};
            __mmask16 unordered = 0;
            int64_t i = 0;
            for (; i + 64 <= cols; i += 64) {
                for (int h = 0; h < 2; h++) {
                    const __m512i w = _mm512_loadu_si512(row + i + 32 * h);
                    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, high));
                    unordered |= _mm512_cmp_ps_mask(even, odd, _CMP_UNORD_Q);
                    m[2 * h] = _mm512_max_ps(m[2 * h], even);
                    m[2 * h + 1] = _mm512_max_ps(m[2 * h + 1], odd);
                }
            }
            best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
            nan = unordered != 0;
            for (; i < cols; i++) {
                const float v = bf16_to_f32(row[i]);
                best = v > best ? v : best;
                nan |= v != v;
            }
        } else
#endif
        if (bf16) {
            const uint16_t *row = (const uint16_t *)x + r * stride;
#pragma omp simd reduction(max : best) reduction(| : nan)
            for (int64_t i = 0; i < cols; i++) {
                const float v = bf16_to_f32(row[i]);
                best = v > best ? v : best;
                nan |= v != v;
            }
        } else {
            const float *row = (const float *)x + r * stride;
#pragma omp simd reduction(max : best) reduction(| : nan)
            for (int64_t i = 0; i < cols; i++) {
                const float v = row[i];
                best = v > best ? v : best;
                nan |= v != v;
            }
        }
        int64_t at = 0, i = 0;
#ifndef VEC_PORTABLE
        if (!nan) { /* the first index holding it, 16 at a time */
            const __m512 b = _mm512_set1_ps(best);
            for (; i + 16 <= cols; i += 16) {
                const __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                            _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + r * stride + i))), 16))
                                      : _mm512_loadu_ps((const float *)x + r * stride + i);
                const __mmask16 hit = _mm512_cmp_ps_mask(v, b, _CMP_EQ_OQ);
                if (hit) break;
            }
        }
#endif
        for (; i < cols; i++) { /* the first index holding it (from the vector holding it, above) */
            const float v = element(x, r * stride + i, bf16);
            if (nan ? v != v : v == best) {
                at = i;
                break;
            }
        }
        out[r] = at;
    }
    return 0;
}

/* ---- token bitmask ---- */

/* Row `row` (cols logits) under its mask (the words covering cols): each zero bit j of word w stores
 * -inf at token 32 w + j, bits of tokens >= cols ignored. A word of all ones is skipped: the grammar
 * allows a few tokens or nearly all, so a row is mostly whole words of one kind or the other. */
INLINE void mask_row(void *row, const uint32_t *mask, int64_t cols, int bf16) {
    const int64_t used = (cols + 31) / 32;
    for (int64_t w = 0; w < used; w++) {
        uint32_t keep = mask[w];
        if (w == used - 1 && cols % 32) keep |= ~(uint32_t)0 << (cols % 32); /* tokens past cols: left alone */
        if (keep == ~(uint32_t)0) continue;
        const uint32_t drop = ~keep;
#ifndef VEC_PORTABLE
        if (bf16) { /* one masked store of 32 lanes: the lanes kept are not written */
            _mm512_mask_storeu_epi16((uint16_t *)row + 32 * w, (__mmask32)drop, _mm512_set1_epi16((short)0xff80));
        } else {
            const __m512 minus_inf = _mm512_castsi512_ps(_mm512_set1_epi32((int)0xff800000u));
            _mm512_mask_storeu_ps((float *)row + 32 * w, (__mmask16)drop, minus_inf);
            _mm512_mask_storeu_ps((float *)row + 32 * w + 16, (__mmask16)(drop >> 16), minus_inf);
        }
#else
        if (bf16) {
            uint16_t *at = (uint16_t *)row + 32 * w;
            if (!keep) /* a whole word: never the last, partial one, whose unused bits are ones now */
                for (int j = 0; j < 32; j++) at[j] = 0xff80u;
            else
                for (uint32_t d = drop; d; d &= d - 1) at[__builtin_ctz(d)] = 0xff80u;
        } else {
            float *at = (float *)row + 32 * w;
            if (!keep)
                for (int j = 0; j < 32; j++) at[j] = -INFINITY;
            else
                for (uint32_t d = drop; d; d &= d - 1) at[__builtin_ctz(d)] = -INFINITY;
        }
#endif
    }
}

/* In place: logits[rows[k], v] = -inf wherever bit v of mask row k is 0 (bit j of word w is token
 * 32 w + j), for v < cols; allowed logits keep their bits. mask [n_rows, words] int32, words * 32 >=
 * cols; logits [batch, cols] of fp32 or bf16, rows `stride` elements apart. Rows listed twice get
 * both masks (each store writes -inf or nothing, so threads sharing a row agree). Returns -1,
 * writing nothing, if a row lies outside [0, batch). */
int apply_token_bitmask(void *logits, int64_t stride, int64_t batch, int64_t cols, const int32_t *mask,
                        int64_t words, const int64_t *rows, int64_t n_rows, int bf16, int threads) {
    for (int64_t k = 0; k < n_rows; k++)
        if (rows[k] < 0 || rows[k] >= batch) return -1;
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n_rows * cols >= BITMASK_PARALLEL_MIN)
    for (int64_t k = 0; k < n_rows; k++) {
        const int64_t r = rows[k];
        if (r < 0 || r >= batch) continue; /* checked again: the rows are read a second time */
        char *row = (char *)logits + r * stride * size;
        if (bf16)
            mask_row(row, (const uint32_t *)mask + k * words, cols, 1);
        else
            mask_row(row, (const uint32_t *)mask + k * words, cols, 0);
    }
    return 0;
}
