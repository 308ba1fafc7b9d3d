/* Paged decode attention on CPU: one query token per sequence, keys and values read in place
 * from the block pool (no gather copy), one pass over the context with an online softmax.
 *
 * Built by batchapi/kernels/native.py with the machine's C compiler (-O3 -march=native) and
 * called through ctypes. Layouts are those of the Triton kernel and its torch twin:
 *   q, out        [T, Hq, D]                       row of the decode token: cu_seqlens_q[s]
 *   k/v cache     [num_blocks, block_size, Hkv, D]
 *   block_tables  [B, table_stride] int32
 * Each (sequence, kv head) pair is one task: its Hq/Hkv query heads share every key and value
 * row loaded. Storage is fp32 or bf16; arithmetic is fp32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 32 /* the per-task arrays live on the stack: about 70 KB at these maxima */
#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

/* d elements at element offset `at` of an fp32 or bf16 array, as fp32 */
INLINE void load(const void *base, int64_t at, float *dst, int d, int bf16) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + at;
#pragma omp simd
        for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + at, (size_t)d * sizeof(float));
    }
}

/* e^x for x <= 0 in fp32, vectorizable (no libm call): 2^(x log2 e) split into 2^n * 2^f with
 * f in [-0.5, 0.5], 2^f by a degree-6 polynomial; relative error about 2e-7. Below -87 it
 * returns about 2^-126, which weighs nothing next to the softmax maximum's 1. */
INLINE float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    const float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits = (int32_t)((uint32_t)bits + ((uint32_t)(int32_t)n << 23)); /* n in [-126, 0]: a normal float */
    memcpy(&p, &bits, sizeof p);
    return p;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC 8
/* out[0..3] = <q, k_j> for four key rows; d a multiple of 8 */
INLINE void dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3, int d,
                 float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
           a3 = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* acc += sum_t p[t] v_t over n value rows; d a multiple of 8, at most MAX_HEAD_DIM */
INLINE void axpy_rows(float *acc, const float *p, const float *const *v, int n, int d) {
    for (int i = 0; i < d; i += 16) { /* two vectors of acc stay in registers across the rows */
        __m256 a0 = _mm256_loadu_ps(acc + i);
        __m256 a1 = i + 8 < d ? _mm256_loadu_ps(acc + i + 8) : _mm256_setzero_ps();
        for (int t = 0; t < n; t++) {
            const __m256 pt = _mm256_set1_ps(p[t]);
            a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v[t] + i), a0);
            if (i + 8 < d) a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v[t] + i + 8), a1);
        }
        _mm256_storeu_ps(acc + i, a0);
        if (i + 8 < d) _mm256_storeu_ps(acc + i + 8, a1);
    }
}
#else
#define VEC 1
INLINE void dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3, int d,
                 float *out) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    for (int i = 0; i < d; i++) {
        s0 += q[i] * k0[i];
        s1 += q[i] * k1[i];
        s2 += q[i] * k2[i];
        s3 += q[i] * k3[i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

INLINE void axpy_rows(float *acc, const float *p, const float *const *v, int n, int d) {
    for (int t = 0; t < n; t++)
        for (int i = 0; i < d; i++) acc[i] += p[t] * v[t][i];
}
#endif

/* pointers to the n rows (of d elements, `stride` apart) from element `at`, as fp32: fp32 rows
 * are read where they lie, bf16 rows are converted into buf */
INLINE void rows(const void *base, int64_t at, int64_t stride, int n, int d, int bf16,
                 float buf[][MAX_HEAD_DIM], const float **out) {
    for (int t = 0; t < n; t++) {
        if (bf16) {
            load(base, at + t * stride, buf[t], d, 1);
            out[t] = buf[t];
        } else {
            out[t] = (const float *)base + at + t * stride;
        }
    }
}

/* one (sequence, kv head): its `group` query heads against the sequence's context */
INLINE void decode_task(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                        int context_len, int64_t q_row, void *out, int hq, int hkv, int d, int bs, int kvh,
                        float scale, int bf16) {
    const int group = hq / hkv;
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], buf[MAX_BLOCK][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK];
    const float *kr[MAX_BLOCK], *vr[MAX_BLOCK];
    const int64_t token_stride = (int64_t)hkv * d, block_stride = (int64_t)bs * token_stride;
    for (int g = 0; g < group; g++) {
        load(q, (q_row * hq + (int64_t)kvh * group + g) * d, qf[g], d, bf16);
        for (int i = 0; i < d; i++) qf[g][i] *= scale;
        memset(acc[g], 0, (size_t)d * sizeof(float));
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int start = 0; start < context_len; start += bs) {
        const int n = context_len - start < bs ? context_len - start : bs;
        const int64_t first = (int64_t)table[start / bs] * block_stride + (int64_t)kvh * d;
        rows(k_cache, first, token_stride, n, d, bf16, buf, kr);
        for (int g = 0; g < group; g++) {
            /* scores four keys at a time: four independent sums keep the FMA units busy */
            int t = 0;
            if (d % VEC == 0) {
                for (; t + 4 <= n; t += 4) dot4(qf[g], kr[t], kr[t + 1], kr[t + 2], kr[t + 3], d, &s[g][t]);
            }
            for (; t < n; t++) {  /* the last n % 4 keys */
                float s0 = 0.0f;
                for (int i = 0; i < d; i++) s0 += qf[g][i] * kr[t][i];
                s[g][t] = s0;
            }
            /* online softmax, rescaled once per block */
            float mx = m[g];
            for (t = 0; t < n; t++) mx = s[g][t] > mx ? s[g][t] : mx;
            const float c = exp_nonpos(m[g] - mx);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (t = 0; t < n; t++) {
                s[g][t] = exp_nonpos(s[g][t] - mx);
                sum += s[g][t];
            }
            l[g] = l[g] * c + sum;
            m[g] = mx;
            if (c != 1.0f) {
#pragma omp simd
                for (int i = 0; i < d; i++) acc[g][i] *= c;
            }
        }
        rows(v_cache, first, token_stride, n, d, bf16, buf, vr);
        for (int g = 0; g < group; g++) {
            if (d % VEC == 0) {
                axpy_rows(acc[g], s[g], vr, n, d);
            } else {
                for (int t = 0; t < n; t++)
                    for (int i = 0; i < d; i++) acc[g][i] += s[g][t] * vr[t][i];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const int64_t at = (q_row * hq + (int64_t)kvh * group + g) * d;
        const float inv = 1.0f / l[g];
        if (bf16) {
            for (int i = 0; i < d; i++) ((uint16_t *)out)[at + i] = f32_to_bf16(acc[g][i] * inv);
        } else {
            for (int i = 0; i < d; i++) ((float *)out)[at + i] = acc[g][i] * inv;
        }
    }
}

INLINE int run(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
               int64_t table_stride, const int32_t *context_lens, const int32_t *cu_seqlens_q,
               const int32_t *seq_ids, int num_seqs, void *out, int hq, int hkv, int d, int bs, float scale,
               int num_threads, int bf16) {
    if (hkv <= 0 || hq % hkv || hq / hkv > MAX_GROUP || d <= 0 || d > MAX_HEAD_DIM || bs <= 0 || bs > MAX_BLOCK) return 1;
    const int64_t tasks = (int64_t)num_seqs * hkv;
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads)
    for (int64_t t = 0; t < tasks; t++) {
        const int seq = seq_ids[t / hkv], kvh = (int)(t % hkv);
        const int32_t *table = block_tables + (int64_t)seq * table_stride;
        /* the common head sizes as constants, so that their loops unroll */
        if (d == 64)
            decode_task(q, k_cache, v_cache, table, context_lens[seq], cu_seqlens_q[seq], out, hq, hkv, 64,
                        bs, kvh, scale, bf16);
        else if (d == 128)
            decode_task(q, k_cache, v_cache, table, context_lens[seq], cu_seqlens_q[seq], out, hq, hkv, 128,
                        bs, kvh, scale, bf16);
        else
            decode_task(q, k_cache, v_cache, table, context_lens[seq], cu_seqlens_q[seq], out, hq, hkv, d, bs,
                        kvh, scale, bf16);
    }
    return 0;
}

#define ENTRY(NAME, BF16)                                                                                   \
    int NAME(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,          \
             int64_t table_stride, const int32_t *context_lens, const int32_t *cu_seqlens_q,                \
             const int32_t *seq_ids, int num_seqs, void *out, int hq, int hkv, int d, int bs, float scale,  \
             int num_threads) {                                                                             \
        return run(q, k_cache, v_cache, block_tables, table_stride, context_lens, cu_seqlens_q, seq_ids,    \
                   num_seqs, out, hq, hkv, d, bs, scale, num_threads, BF16);                                \
    }

ENTRY(paged_decode_f32, 0)
ENTRY(paged_decode_bf16, 1)
