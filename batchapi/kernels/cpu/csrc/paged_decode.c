/* Paged decode attention on CPU: one query token per sequence, keys and values read in place
 * from the block pool (no gather copy), one pass over the context with an online softmax.
 *
 * Built by batchapi/kernels/cpu/build.py with the machine's C compiler (-O3 -march=native) and
 * called through ctypes. Layouts are those of the Triton kernel and its torch twin:
 *   q, out        [T, Hq, D]                       row of the decode token: cu_seqlens_q[s]
 *   k/v cache     [num_blocks, block_size, Hkv, D]
 *   block_tables  [B, table_stride] int32
 * Each (sequence, kv head) pair is one task: its Hq/Hkv query heads share every key and value
 * row loaded. Storage is fp32 or bf16; arithmetic is fp32 (bf16 q.k products are exact in fp32).
 * A sliding window (window > 0) starts a row's walk at its first visible key, context_len -
 * window, possibly mid-block: the blocks before it may be freed (their table entries -1, or
 * another sequence's now) and are never read. A soft cap (softcap > 0) maps each scaled score s
 * to softcap * tanh(s / softcap) before the softmax (Gemma 2).
 * Three builds of the same algorithm, chosen by the compiler's target: AVX-512 (the main one,
 * described at its code), AVX2 with FMA, and plain C for any other CPU. Each reads no key or
 * value row past the context and no element past a row; the AVX-512 one asks for (prefetches)
 * the rows of later blocks, which reads nothing into the result. Where the CPU has AMX (and the OS
 * grants its tiles), bf16 storage with head sizes a multiple of 32 runs on the tile unit instead,
 * the probabilities rounded to bf16 for their products with the values (described at its code):
 * a decode step of SmolLM2 with 1,000-token contexts at 16 / 64 sequences 0.89 / 0.81x as long, with
 * 100-token ones at 32 / 96 sequences 0.94 / 0.97x, at 8 and 256 the same (docs/BENCHMARKS.md).
 */
#define _GNU_SOURCE /* syscall(), for AMX's permission */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 32 /* the per-task arrays live on the stack: about 70 KB (AVX2, plain) or 40 KB at these maxima */

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

/* tanh in fp32 without libm, vectorizable: Eigen's rational approximation (an odd degree-13 over
 * an even degree-6 polynomial) on x clamped to +-7.9, past which fp32 tanh rounds to +-1; relative
 * error under 4e-7 */
INLINE float tanh_rational(float x) {
    x = x > 7.90531110763549805f ? 7.90531110763549805f : x < -7.90531110763549805f ? -7.90531110763549805f : x;
    const float x2 = x * x;
    float p = -2.76076847742355e-16f;
    p = p * x2 + 2.00018790482477e-13f;
    p = p * x2 - 8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * x2 + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    return x * p / q;
}

/* Gemma 2's attention logit soft cap */
INLINE float soft_cap(float s, float softcap) { return softcap * tanh_rational(s / softcap); }

/* the first key of a row's window: transformers' sliding window, keys p - window + 1 .. p for the
 * query at p = context_len - 1; window 0 is the whole context */
INLINE int window_start(int context_len, int window) {
    return window > 0 && context_len > window ? context_len - window : 0;
}

/* the task after this one, whose first blocks a task asks the memory for ahead of time */
typedef struct {
    const int32_t *table; /* NULL: none */
    int context_len, start; /* start: its window's first key */
    int64_t head_at; /* its kv head's element offset in a token's row */
} Upcoming;

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* AVX-512: a task walks its context in chunks of up to 16 consecutive tokens of one block.
 * Q.K: per query head, one vector of partial dot products per token, then a transpose-reduce
 * turns the 16 vectors into one vector of the chunk's 16 scores, and the online softmax (the
 * running maximum, exp, the sums) runs on that vector. bf16 with AVX512_BF16: dpbf16 multiplies
 * the bf16 q and k exactly and sums in fp32; the scale is applied to the scores.
 * P.V: in fp32 (probabilities are never rounded); up to 4 query heads x 64 columns of
 * accumulators stay in registers over the chunk's value rows, each row converted once for them.
 * A bf16 row of 32 elements converts in two instructions to its even and its odd elements as
 * fp32, so bf16 accumulators hold the columns in that split order until the output is written.
 * Row tails (head sizes not a multiple of the vector) and the tokens of a chunk past the context
 * are masked loads, which read nothing. Head sizes 64 and 128 and whole chunks of 16 are
 * compile-time constants (see run), so that their loops unroll and their accumulators stay in
 * registers. */
#include <immintrin.h>
#define LANES 16 /* tokens of a chunk: their scores fill one vector */
#define TILE_HEADS 4
#define TILE_COLS 64 /* P.V accumulators in registers: TILE_HEADS x TILE_COLS / 16 vectors */
#define VECS (MAX_HEAD_DIM / 16)

/* masks of the elements of a vector that lie before the row's end, `left` elements away */
INLINE __mmask32 first32(int left) { return left >= 32 ? 0xffffffffu : left <= 0 ? 0 : (1u << left) - 1; }
INLINE __mmask16 first16(int left) { return (__mmask16)(left >= 16 ? 0xffffu : left <= 0 ? 0 : (1u << left) - 1); }

INLINE __m512 bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
INLINE __m512 bf16_odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* fp32 to bf16 as f32_to_bf16 does, 16 at a time: the bf16 bits in the high half of each lane */
INLINE __m512i round_bf16(__m512 x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(b, _mm512_set1_epi32(0x00400000)));
}

/* exp_nonpos on 16 lanes, and for x up to SLACK as well */
INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

/* soft_cap on 16 lanes: the same rational tanh */
INLINE __m512 soft_cap16(__m512 s, float softcap) {
    const __m512 x = _mm512_max_ps(_mm512_min_ps(_mm512_div_ps(s, _mm512_set1_ps(softcap)),
                                                 _mm512_set1_ps(7.90531110763549805f)),
                                   _mm512_set1_ps(-7.90531110763549805f));
    const __m512 x2 = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-2.76076847742355e-16f);
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.00018790482477e-13f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-8.60467152213735e-11f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(5.12229709037114e-08f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(1.48572235717979e-05f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(6.37261928875436e-04f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(4.89352455891786e-03f));
    __m512 q = _mm512_set1_ps(1.19825839466702e-06f);
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(1.18534705686654e-04f));
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(2.26843463243900e-03f));
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(4.89352518554385e-03f));
    return _mm512_mul_ps(_mm512_set1_ps(softcap), _mm512_div_ps(_mm512_mul_ps(x, p), q));
}

/* the sums of each of 16 vectors, in order, in one vector: 15 adds and 30 shuffles */
INLINE __m512 sum_each16(const __m512 x[LANES]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit quarter: x0 x1 x0 x1 */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per quarter: x0 x1 x2 x3 */
        const __m512d lo = _mm512_castps_pd(a[2 * i]), hi = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    for (int i = 0; i < 2; i++) /* quarters 0+1, 2+3 of b[2i], then of b[2i+1] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

#if defined(__AVX512BF16__)
#define QK_DPBF16 1 /* bf16 q kept as bf16: qv holds 32 raw elements a vector (dpbf16 counts denormals as 0) */
#else
#define QK_DPBF16 0
#endif

/* q of one head into vectors: fp32 in column order; bf16 raw for dpbf16, else fp32 in split order */
INLINE void load_q(const void *q, int64_t at, int d, int bf16, __m512 *qv) {
    if (!bf16) {
        for (int i = 0; i < d; i += 16) qv[i / 16] = _mm512_maskz_loadu_ps(first16(d - i), (const float *)q + at + i);
        return;
    }
    for (int i = 0; i < d; i += 32) {
        const __m512i x = _mm512_maskz_loadu_epi16(first32(d - i), (const uint16_t *)q + at + i);
        if (QK_DPBF16) {
            qv[i / 32] = _mm512_castsi512_ps(x);
        } else {
            qv[i / 16] = bf16_even(x);
            qv[i / 16 + 1] = bf16_odd(x);
        }
    }
}

/* partial sums of <q, row>: their 16 lanes add up to the dot product; a row not `live` (past the
 * context) is not read and sums to 0 */
INLINE __m512 dot_parts(const __m512 *qv, const void *row, int d, int bf16, int live) {
    __m512 a = _mm512_setzero_ps();
    if (!bf16) {
        for (int i = 0; i < d; i += 16) {
            const __m512 x = _mm512_maskz_loadu_ps(live ? first16(d - i) : 0, (const float *)row + i);
            a = _mm512_fmadd_ps(qv[i / 16], x, a);
        }
        return a;
    }
    for (int i = 0; i < d; i += 32) {
        const __m512i x = _mm512_maskz_loadu_epi16(live ? first32(d - i) : 0, (const uint16_t *)row + i);
#if QK_DPBF16
        a = _mm512_dpbf16_ps(a, (__m512bh)qv[i / 32], (__m512bh)x);
#else
        a = _mm512_fmadd_ps(qv[i / 16], bf16_even(x), a);
        a = _mm512_fmadd_ps(qv[i / 16 + 1], bf16_odd(x), a);
#endif
    }
    return a;
}

/* columns [c0, c0 + TILE_COLS) of a row as four fp32 vectors (bf16: in split order), zero past d */
INLINE void row_tile(const void *row, int c0, int d, int bf16, __m512 v[TILE_COLS / 16]) {
    if (bf16) {
        for (int k = 0; k < 2; k++) {
            const __m512i x = _mm512_maskz_loadu_epi16(first32(d - c0 - 32 * k), (const uint16_t *)row + c0 + 32 * k);
            v[2 * k] = bf16_even(x);
            v[2 * k + 1] = bf16_odd(x);
        }
    } else {
        for (int k = 0; k < 4; k++)
            v[k] = _mm512_maskz_loadu_ps(first16(d - c0 - 16 * k), (const float *)row + c0 + 16 * k);
    }
}

/* Blocks lie anywhere in the pool, where the hardware prefetchers do not look: while a chunk's
 * values are summed, the same rows of the block AHEAD blocks on (of this task or of the next)
 * are asked for, into L2: L2 tracks more misses at once than L1, and DRAM needs many in flight. */
#define AHEAD 4
typedef struct {
    const char *k, *v; /* NULL: none */
} Ahead;

/* row t's `bytes` of the keys and values ahead (rows `row_bytes` apart) asked for into L2 */
INLINE void ask_ahead(const Ahead *ahead, int t, int64_t row_bytes, int bytes) {
    if (!ahead || !ahead->k) return;
    for (int i = 0; i < bytes; i += 64) {
        _mm_prefetch(ahead->k + t * row_bytes + i, _MM_HINT_T1);
        _mm_prefetch(ahead->v + t * row_bytes + i, _MM_HINT_T1);
    }
}

/* acc = acc * corr + sum_t p[t] v_t for `heads` query heads (a constant at each call) over the
 * chunk's n value rows, TILE_COLS columns at a time */
INLINE void pv_tile(__m512 (*acc)[VECS], const float (*p)[LANES], const float *corr, int heads, const void *v_cache,
                    int64_t at, int64_t stride, int n, int d, int bf16, const Ahead *ahead) {
    const size_t esize = bf16 ? 2 : 4;
    for (int c0 = 0; c0 < d; c0 += TILE_COLS) {
        __m512 a[TILE_HEADS][TILE_COLS / 16], v[TILE_COLS / 16];
        for (int g = 0; g < heads; g++)
            for (int k = 0; k < TILE_COLS / 16; k++)
                a[g][k] = _mm512_mul_ps(acc[g][c0 / 16 + k], _mm512_set1_ps(corr[g]));
        for (int t = 0; t < n; t++) {
            /* spread over the rows: a burst would stall on the miss buffers */
            if (c0 == 0) ask_ahead(ahead, t, stride * (int64_t)esize, d * (int)esize);
            row_tile((const char *)v_cache + (at + t * stride) * esize, c0, d, bf16, v);
            /* p[g][t] broadcast by the FMA itself from memory ({1to16}): compilers broadcast it into a
             * register first, an instruction more on the vector units that are the bottleneck here */
            for (int g = 0; g < heads; g++) {
                for (int k = 0; k < TILE_COLS / 16; k++)
                    __asm__("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(a[g][k]) : "v"(v[k]), "m"(p[g][t]));
            }
        }
        for (int g = 0; g < heads; g++)
            for (int k = 0; k < TILE_COLS / 16; k++) acc[g][c0 / 16 + k] = a[g][k];
    }
}

/* the scores (times scale, soft-capped where softcap > 0) of a chunk's n tokens (n <= LANES), from
 * element offset `at`, for all `group` query heads: one vector a head, -inf in the lanes past n */
INLINE void chunk_scores(const void *k_cache, int64_t at, int64_t stride, int n, int group, int d, float scale,
                         float softcap, int bf16, __m512 (*qv)[VECS], __m512 *s) {
    const int64_t row_bytes = stride * (bf16 ? 2 : 4);
    for (int g = 0; g < group; g++) {
        const char *row = (const char *)k_cache + at * (bf16 ? 2 : 4);
        __asm__("" : "+r"(row)); /* else the 16 row addresses are hoisted out of the head loop, and spilled */
        __m512 part[LANES];
#pragma GCC unroll 16
        for (int t = 0; t < LANES; t++, row += row_bytes) part[t] = dot_parts(qv[g], row, d, bf16, t < n);
        __m512 x = _mm512_mul_ps(sum_each16(part), _mm512_set1_ps(scale));
        if (softcap > 0.0f) x = soft_cap16(x, softcap);
        s[g] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), first16(n), x);
    }
}

/* the online softmax step of a chunk of n tokens: p = e^(s - m) and the factor corr on the
 * earlier sums. The running maximum m moves only when a score passes it by more than SLACK:
 * exponents up to e^SLACK cost fp32 nothing, and most chunks then skip the rescale. */
#define SLACK 8.0f
INLINE void chunk_softmax(const __m512 *s, int n, int group, float *m, __m512 *l, float (*p)[LANES],
                          float *corr) {
    for (int g = 0; g < group; g++) {
        corr[g] = 1.0f;
        if (_mm512_cmp_ps_mask(s[g], _mm512_set1_ps(m[g] + SLACK), _CMP_GT_OQ)) {
            const float mx = _mm512_reduce_max_ps(s[g]);
            corr[g] = exp_nonpos(m[g] - mx);
            m[g] = mx;
        }
        const __m512 e = _mm512_maskz_mov_ps(first16(n), exp16(_mm512_sub_ps(s[g], _mm512_set1_ps(m[g]))));
        l[g] = _mm512_fmadd_ps(l[g], _mm512_set1_ps(corr[g]), e);
        _mm512_store_ps(p[g], e);
    }
}

/* acc = acc * corr + sum_t p[t] v_t over a chunk's n value rows, for all `group` query heads */
INLINE void chunk_values(const void *v_cache, int64_t at, int64_t stride, int n, int group, int d, int bf16,
                         const float (*p)[LANES], const float *corr, __m512 (*acc)[VECS], const Ahead *ahead) {
    for (int g = 0; g < group; g += TILE_HEADS) {
        const int heads = group - g < TILE_HEADS ? group - g : TILE_HEADS;
        if (heads == 4) pv_tile(acc + g, p + g, corr + g, 4, v_cache, at, stride, n, d, bf16, g ? NULL : ahead);
        else if (heads == 3) pv_tile(acc + g, p + g, corr + g, 3, v_cache, at, stride, n, d, bf16, g ? NULL : ahead);
        else if (heads == 2) pv_tile(acc + g, p + g, corr + g, 2, v_cache, at, stride, n, d, bf16, g ? NULL : ahead);
        else pv_tile(acc + g, p + g, corr + g, 1, v_cache, at, stride, n, d, bf16, g ? NULL : ahead);
    }
}

/* a chunk: up to LANES consecutive tokens of one block, at offsets that are multiples of LANES
 * within it; the first of a window that starts mid-chunk and the last of the context maybe fewer */
typedef struct {
    int block, offset, n; /* its block's index in the table, its first token's offset in that block */
} Chunk;

/* what a task's chunks share */
typedef struct {
    const void *k_cache, *v_cache;
    const int32_t *table;
    int64_t token_stride, block_stride, head_at; /* head_at: the kv head's offset in a token's row */
    int context_len, start, bs, group, d, bf16; /* start: the window's first key */
    float scale, softcap;
    Upcoming next;
} Task;

/* from the window's first key to the end of its chunk; with no window, block 0's first chunk */
INLINE Chunk first_chunk(const Task *tk) {
    Chunk c = {tk->start / tk->bs, tk->start % tk->bs, 0};
    const int chunk_end = c.offset - c.offset % LANES + LANES, block_end = chunk_end < tk->bs ? chunk_end : tk->bs;
    const int left = tk->context_len - tk->start;
    c.n = left < block_end - c.offset ? left : block_end - c.offset;
    return c;
}

INLINE Chunk chunk_after(const Task *tk, Chunk c) {
    c.offset += LANES - c.offset % LANES; /* a first chunk that began mid-chunk: back on the grid */
    if (c.offset >= tk->bs) c.block++, c.offset = 0;
    const int start = c.block * tk->bs + c.offset, in_block = tk->bs - c.offset;
    c.n = tk->context_len - start < in_block ? tk->context_len - start : in_block;
    c.n = c.n < LANES ? (c.n > 0 ? c.n : 0) : LANES;
    return c;
}

INLINE int64_t block_at(const Task *tk, int block) {
    return (int64_t)tk->table[block] * tk->block_stride + tk->head_at;
}

INLINE int64_t chunk_at(const Task *tk, Chunk c) { return block_at(tk, c.block) + c.offset * tk->token_stride; }

INLINE void score_chunk(const Task *tk, Chunk c, __m512 (*qv)[VECS], __m512 *s) {
    const int64_t at = chunk_at(tk, c);
    if (c.n == LANES) /* whole chunks with a constant count: their loops unroll */
        chunk_scores(tk->k_cache, at, tk->token_stride, LANES, tk->group, tk->d, tk->scale, tk->softcap, tk->bf16,
                     qv, s);
    else
        chunk_scores(tk->k_cache, at, tk->token_stride, c.n, tk->group, tk->d, tk->scale, tk->softcap, tk->bf16, qv,
                     s);
}

/* the rows AHEAD blocks past chunk c's, at its offset: of this task, or past its end of the next
 * one's window; NULL where there are none */
INLINE const char *rows_ahead(const Task *tk, Chunk c, const void *cache) {
    const int esize = tk->bf16 ? 2 : 4, block = c.block + AHEAD, past = block - (tk->context_len + tk->bs - 1) / tk->bs;
    if (past < 0) return (const char *)cache + (block_at(tk, block) + c.offset * tk->token_stride) * esize;
    const int next_block = tk->next.start / tk->bs + past;
    if (!tk->next.table || next_block * tk->bs + c.offset >= tk->next.context_len) return NULL;
    return (const char *)cache + ((int64_t)tk->next.table[next_block] * tk->block_stride + tk->next.head_at +
                                  c.offset * tk->token_stride) * esize;
}

/* chunk c's rows of `cache` asked for into L1 (nothing where c is past the context): the next chunk's
 * keys while this one's softmax runs, its values while this one's are summed. AHEAD brought them to
 * L2; their loads from there still stalled the sums (a sixth of attention's samples sat on the value
 * rows' loads) */
INLINE void ask_l1(const Task *tk, Chunk c, const void *cache) {
    const int esize = tk->bf16 ? 2 : 4;
    if (!c.n) return;
    const char *row = (const char *)cache + chunk_at(tk, c) * esize;
    for (int t = 0; t < c.n; t++, row += tk->token_stride * esize)
        for (int i = 0; i < tk->d * esize; i += 64) _mm_prefetch(row + i, _MM_HINT_T0);
}

/* the rows of the chunk after this one into L1: `next` of this task, or past its end the next task's
 * first. bench/kernels_cpu.py --layers 30 (keys and values from memory), 256 sequences: 1.15x faster
 * at 40+-30 keys, 1.00-1.02x at 90+-50 (a C program calling the kernel: 1.07-1.10x there) */
INLINE void ask_l1_after(const Task *tk, Chunk next, const void *cache) {
    if (next.n) {
        ask_l1(tk, next, cache);
    } else if (tk->next.table) {
        Task up = *tk;
        up.table = tk->next.table, up.context_len = tk->next.context_len, up.start = tk->next.start;
        up.head_at = tk->next.head_at;
        ask_l1(&up, first_chunk(&up), cache);
    }
}

INLINE void sum_chunk(const Task *tk, Chunk c, const float (*p)[LANES], const float *corr, __m512 (*acc)[VECS]) {
    const int64_t at = chunk_at(tk, c);
    const Ahead ahead = {rows_ahead(tk, c, tk->k_cache), rows_ahead(tk, c, tk->v_cache)};
    if (c.n == LANES)
        chunk_values(tk->v_cache, at, tk->token_stride, LANES, tk->group, tk->d, tk->bf16, p, corr, acc, &ahead);
    else
        chunk_values(tk->v_cache, at, tk->token_stride, c.n, tk->group, tk->d, tk->bf16, p, corr, acc, &ahead);
}

/* one (sequence, kv head): its `group` query heads against the sequence's context */
INLINE void decode_task(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                        int context_len, int start, int64_t q_row, void *out, int hq, int hkv, int d, int bs, int kvh,
                        float scale, float softcap, int bf16, Upcoming upcoming) {
    const int group = hq / hkv;
    const Task tk = {k_cache, v_cache, table, (int64_t)hkv * d, (int64_t)bs * hkv * d, (int64_t)kvh * d,
                     context_len, start, bs, group, d, bf16, scale, softcap, upcoming};
    __m512 qv[MAX_GROUP][VECS], acc[MAX_GROUP][VECS], l[MAX_GROUP], s[MAX_GROUP]; /* l: softmax sums per lane */
    float m[MAX_GROUP], p[MAX_GROUP][LANES] __attribute__((aligned(64))), corr[MAX_GROUP];
    const int64_t q_at = (q_row * hq + (int64_t)kvh * group) * d;
    const int tiles = (d + TILE_COLS - 1) / TILE_COLS;
    for (int g = 0; g < group; g++) {
        load_q(q, q_at + (int64_t)g * d, d, bf16, qv[g]);
        for (int k = 0; k < tiles * TILE_COLS / 16; k++) acc[g][k] = _mm512_setzero_ps();
        m[g] = -INFINITY;
        l[g] = _mm512_setzero_ps();
    }
    for (Chunk c = first_chunk(&tk), next; c.n; c = next) {
        next = chunk_after(&tk, c);
        score_chunk(&tk, c, qv, s);
        ask_l1_after(&tk, next, k_cache);
        chunk_softmax(s, c.n, group, m, l, p, corr);
        ask_l1_after(&tk, next, v_cache);
        sum_chunk(&tk, c, (const float (*)[LANES])p, corr, acc);
    }
    for (int g = 0; g < group; g++) {
        const int64_t at = q_at + (int64_t)g * d;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[g]));
        if (bf16) {
            for (int i = 0; i < d; i += 32) {
                const __m512i even = round_bf16(_mm512_mul_ps(acc[g][i / 16], inv));
                const __m512i odd = round_bf16(_mm512_mul_ps(acc[g][i / 16 + 1], inv));
                const __m512i both = _mm512_or_si512(_mm512_srli_epi32(even, 16),
                                                     _mm512_and_si512(odd, _mm512_set1_epi32((int)0xffff0000u)));
                _mm512_mask_storeu_epi16((uint16_t *)out + at + i, first32(d - i), both);
            }
        } else {
            for (int i = 0; i < d; i += 16)
                _mm512_mask_storeu_ps((float *)out + at + i, first16(d - i), _mm512_mul_ps(acc[g][i / 16], inv));
        }
    }
}
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* AMX, for bf16 storage and head sizes a multiple of 32: a task's chunks two at a time (up to 32
 * keys) on the tile unit, whose products run at many times the vector units' rate.
 * Q.K: a chunk's 16 key rows are an A tile as they lie in their block (16 rows of 32 elements, a
 * token's row apart), the task's query heads one B tile (a row a pair of q's elements, a column a
 * head), so one TDPBF16PS a 32 elements gives the chunk's scores, a row a key; each head's column
 * is picked out into a vector for the softmax above (chunk_softmax, as the vector path): from the
 * rows stored packed by two permutes where there are at most 4 heads (a step 0.97-1.00x as long as
 * with the gather that takes any number, the same bits), else gathered.
 * P.V: the two chunks' probabilities, rounded to bf16, are an A tile (a row a head, 32 keys); the
 * value rows, interleaved two keys at a time into B tiles of 16 columns, give each head's sums over
 * the 32 keys in fp32, which are added to its accumulators. The interleave is unpack's, which works
 * in quarters of a vector: a tile's columns are, of their 32, 0-3, 8-11, 16-19, 24-27 (or 4-7,
 * 12-15, ...); the accumulators keep that order, put back once at the output.
 * Rounding: bf16 products exact and summed in fp32, as the vector path, in the tile unit's order;
 * the probabilities rounded to bf16 for their products with the values (as flash attention does on
 * GPUs), the softmax's denominator summed from them unrounded. A row's result depends on its own
 * keys alone, in the same order whatever the batch. Nothing past the context is read: a chunk of
 * fewer than 16 keys is copied with masked loads into a buffer whose rows after them are zero. */
#define HAVE_AMX_ATTENTION 1
/* the tile registers' uses (numbers: the intrinsics paste them into the instruction) */
#define T_K 0
#define T_Q 1
#define T_S 2
#define T_P 3
#define T_V 4
#define T_O 5

static void amx_attention_configure(int group) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[T_K] = 16, c.colsb[T_K] = 64;                        /* 16 keys x 32 elements */
    c.rows[T_Q] = 16, c.colsb[T_Q] = (uint16_t)(4 * group);     /* 16 element pairs x the heads */
    c.rows[T_S] = 16, c.colsb[T_S] = (uint16_t)(4 * group);     /* 16 keys x the heads' scores */
    c.rows[T_P] = (uint8_t)group, c.colsb[T_P] = 64;            /* the heads x 32 keys */
    c.rows[T_V] = 16, c.colsb[T_V] = 64;                        /* 16 key pairs x 16 columns */
    c.rows[T_O] = (uint8_t)group, c.colsb[T_O] = 64;            /* the heads x 16 columns' sums */
    _tile_loadconfig(&c);
}

/* the scores of chunk c for one kv head's query heads (as chunk_scores): qt those heads as B tiles
 * ([d / 32][16 element pairs][group], a tile a 32 elements); kbuf the copy of a chunk shorter than 16 */
INLINE void amx_scores(const Task *tk, Chunk c, const uint32_t *qt, uint16_t (*kbuf)[MAX_HEAD_DIM], __m512 *s) {
    const uint16_t *rows = (const uint16_t *)tk->k_cache + chunk_at(tk, c);
    int64_t stride = tk->token_stride * 2;
    if (c.n < LANES) {
        for (int t = 0; t < LANES; t++)
            for (int i = 0; i < tk->d; i += 32)
                _mm512_store_si512(&kbuf[t][i], _mm512_maskz_loadu_epi16(t < c.n ? ~0u : 0, rows + t * tk->token_stride + i));
        rows = &kbuf[0][0], stride = sizeof kbuf[0];
    }
    float sc[LANES][LANES] __attribute__((aligned(64)));
    _tile_zero(T_S);
    for (int i = 0; i < tk->d; i += 32) {
        _tile_loadd(T_K, rows + i, stride);
        _tile_loadd(T_Q, qt + i / 2 * tk->group, 4 * tk->group);
        _tile_dpbf16ps(T_S, T_K, T_Q);
    }
    if (tk->group <= 4) { /* the tile's rows packed (16 x group scores, group vectors), a head's picked out */
        float *packed = &sc[0][0];
        _tile_stored(T_S, packed, 4 * tk->group);
        const int vecs = tk->group; /* 16 x group floats */
        const __m512 v0 = _mm512_load_ps(packed), v1 = vecs > 1 ? _mm512_load_ps(packed + 16) : _mm512_setzero_ps();
        const __m512 v2 = vecs > 2 ? _mm512_load_ps(packed + 32) : _mm512_setzero_ps();
        const __m512 v3 = vecs > 3 ? _mm512_load_ps(packed + 48) : _mm512_setzero_ps();
        const __m512i key = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(tk->group));
        for (int g = 0; g < tk->group; g++) {
            const __m512i at = _mm512_add_epi32(key, _mm512_set1_epi32(g)); /* head g of key k: k * group + g */
            const __m512 low = _mm512_permutex2var_ps(v0, at, v1), high = _mm512_permutex2var_ps(v2, at, v3);
            __m512 x = _mm512_mask_mov_ps(low, _mm512_cmpge_epi32_mask(at, _mm512_set1_epi32(32)), high);
            x = _mm512_mul_ps(x, _mm512_set1_ps(tk->scale));
            if (tk->softcap > 0.0f) x = soft_cap16(x, tk->softcap);
            s[g] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), first16(c.n), x);
        }
        return;
    }
    _tile_stored(T_S, sc, sizeof sc[0]);
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(LANES));
    for (int g = 0; g < tk->group; g++) {
        __m512 x = _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(g)), &sc[0][0], 4),
                                 _mm512_set1_ps(tk->scale));
        if (tk->softcap > 0.0f) x = soft_cap16(x, tk->softcap);
        s[g] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), first16(c.n), x);
    }
}

/* chunk c's value rows as rows 8 * half .. 8 * half + 7 of the B tiles vb (a tile a 16 columns): key
 * pairs interleaved, zero past the chunk's keys; the rows AHEAD blocks on are asked for meanwhile */
INLINE void amx_values(const Task *tk, Chunk c, int half, uint16_t (*vb)[16][32]) {
    if (!c.n) {
        for (int r = 0; r < LANES / 2; r++)
            for (int j = 0; j < tk->d / 16; j++) _mm512_store_si512(vb[j][8 * half + r], _mm512_setzero_si512());
        return;
    }
    const Ahead ahead = {rows_ahead(tk, c, tk->k_cache), rows_ahead(tk, c, tk->v_cache)};
    const int64_t ts = tk->token_stride;
    const uint16_t *rows = (const uint16_t *)tk->v_cache + chunk_at(tk, c);
    for (int r = 0; r < LANES / 2; r++) {
        const int t = 2 * r;
        for (int u = t; u < t + 2 && u < c.n; u++) ask_ahead(&ahead, u, ts * 2, tk->d * 2);
        for (int i = 0; i < tk->d; i += 32) {
            const __m512i a = _mm512_maskz_loadu_epi16(t < c.n ? ~0u : 0, rows + t * ts + i);
            const __m512i b = _mm512_maskz_loadu_epi16(t + 1 < c.n ? ~0u : 0, rows + (t + 1) * ts + i);
            _mm512_store_si512(vb[i / 16][8 * half + r], _mm512_unpacklo_epi16(a, b));
            _mm512_store_si512(vb[i / 16 + 1][8 * half + r], _mm512_unpackhi_epi16(a, b));
        }
    }
}

/* decode_task on the tile unit (the arguments are the same, storage bf16) */
INLINE void decode_task_amx(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                            int context_len, int start, int64_t q_row, void *out, int hq, int hkv, int d, int bs,
                            int kvh, float scale, float softcap, Upcoming upcoming) {
    const int group = hq / hkv;
    const Task tk = {k_cache, v_cache, table, (int64_t)hkv * d, (int64_t)bs * hkv * d, (int64_t)kvh * d,
                     context_len, start, bs, group, d, 1, scale, softcap, upcoming};
    uint32_t qt[MAX_GROUP * MAX_HEAD_DIM / 2] __attribute__((aligned(64))); /* [d / 32][16 pairs][group] */
    uint16_t kbuf[LANES][MAX_HEAD_DIM] __attribute__((aligned(64)));
    uint16_t vb[MAX_HEAD_DIM / 16][16][32] __attribute__((aligned(64)));
    uint16_t pb[MAX_GROUP][32] __attribute__((aligned(64)));
    float ob[MAX_GROUP][16] __attribute__((aligned(64)));
    float p[2][MAX_GROUP][LANES] __attribute__((aligned(64))), corr[2][MAX_GROUP], m[MAX_GROUP];
    __m512 acc[MAX_GROUP][VECS], l[MAX_GROUP], s[MAX_GROUP];
    const int64_t q_at = (q_row * hq + (int64_t)kvh * group) * d;
    for (int g = 0; g < group; g++) {
        const uint16_t *qg = (const uint16_t *)q + q_at + (int64_t)g * d;
        for (int i = 0; i < d / 2; i++) qt[i * group + g] = qg[2 * i] | (uint32_t)qg[2 * i + 1] << 16;
        for (int j = 0; j < d / 16; j++) acc[g][j] = _mm512_setzero_ps();
        m[g] = -INFINITY;
        l[g] = _mm512_setzero_ps();
    }
    for (Chunk c = first_chunk(&tk); c.n;) {
        const Chunk pair[2] = {c, chunk_after(&tk, c)};
        c = pair[1].n ? chunk_after(&tk, pair[1]) : pair[1];
        for (int h = 0; h < 2; h++) {
            if (pair[h].n) {
                amx_scores(&tk, pair[h], qt, kbuf, s);
                chunk_softmax(s, pair[h].n, group, m, l, p[h], corr[h]);
            } else {
                for (int g = 0; g < group; g++) _mm512_store_ps(p[h][g], _mm512_setzero_ps()), corr[h][g] = 1.0f;
            }
        }
        for (int g = 0; g < group; g++) { /* the first chunk's probabilities against the second's maximum */
            const __m512 p0 = _mm512_mul_ps(_mm512_load_ps(p[0][g]), _mm512_set1_ps(corr[1][g]));
            _mm512_store_si512(pb[g], (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(p[1][g]), p0));
            corr[0][g] *= corr[1][g];
        }
        amx_values(&tk, pair[0], 0, vb);
        amx_values(&tk, pair[1], 1, vb);
        _tile_loadd(T_P, pb, sizeof pb[0]);
        for (int j = 0; j < d / 16; j++) {
            _tile_loadd(T_V, vb[j], sizeof vb[0][0]);
            _tile_zero(T_O);
            _tile_dpbf16ps(T_O, T_P, T_V);
            _tile_stored(T_O, ob, sizeof ob[0]);
            for (int g = 0; g < group; g++)
                acc[g][j] = _mm512_fmadd_ps(acc[g][j], _mm512_set1_ps(corr[0][g]), _mm512_load_ps(ob[g]));
        }
    }
    /* the columns back in order: of each 32, tile 2j's quarters hold 0-3, 8-11, 16-19, 24-27 */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int g = 0; g < group; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[g]));
        for (int i = 0; i < d; i += 32) {
            const __m512 lo = acc[g][i / 16], hi = acc[g][i / 16 + 1];
            const __m512i a = round_bf16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv));
            const __m512i b = round_bf16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv));
            uint16_t *o = (uint16_t *)out + q_at + (int64_t)g * d + i;
            _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(_mm512_srli_epi32(a, 16)));
            _mm256_storeu_si256((__m256i *)(o + 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
        }
    }
}
#endif /* AMX */
#else
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
                        int context_len, int start, int64_t q_row, void *out, int hq, int hkv, int d, int bs, int kvh,
                        float scale, float softcap, int bf16, Upcoming upcoming) {
    (void)upcoming; /* no prefetching here */
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
    /* block by block from the window's first key (maybe mid-block) */
    for (int at = start; at < context_len; at = (at / bs + 1) * bs) {
        const int end = (at / bs + 1) * bs, n = (context_len < end ? context_len : end) - at;
        const int64_t first = (int64_t)table[at / bs] * block_stride + (at % bs) * token_stride + (int64_t)kvh * d;
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
            if (softcap > 0.0f) {
#pragma omp simd
                for (t = 0; t < n; t++) s[g][t] = soft_cap(s[g][t], softcap);
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
#endif /* AVX-512 */

/* 1 (the default) where bf16 decode may run on AMX tiles, 0 to keep it on the vector units (the
 * tests and benches run both) */
static int use_amx = 1;
void paged_decode_set_amx(int on) { use_amx = on; }

/* 1 where this build and the OS give bf16 decode the tile path (head sizes a multiple of 32) */
int paged_decode_amx(void) {
#ifdef HAVE_AMX_ATTENTION
    return amx_permitted();
#else
    return 0;
#endif
}

#define TASK_COST 16 /* keys' worth; more than 0, so that every task weighs and the last share ends at the end */
INLINE int64_t task_work(int len, int window) {
    const int start = window_start(len, window);
    return (int64_t)(len > start ? len - start : 0) + TASK_COST;
}

/* This thread's share [first, last) of the tasks (sequence-major, kv head-minor), contiguous and
 * weighed by work: a task's keys, plus TASK_COST for what a task costs whatever its length.
 * Contiguous, because a task asks for the next one's first blocks ahead of time, into its own core's
 * L2: tasks dealt out in turns (schedule(dynamic, 4) before) began every fourth task maybe on the
 * other core, its first blocks asked for into the wrong cache; a step's attention, its keys and
 * values from memory, took 1.13-1.19x as long so on a 2-core EPYC Zen 5 (docs/BENCHMARKS.md). Each
 * thread finds its share alone: thread i's first task is the first whose work before it reaches
 * total * i / team, its last the next thread's first, so the shares tile the tasks. */
INLINE void task_share(const int32_t *seq_ids, int num_seqs, int hkv, const int32_t *context_lens, int window,
                       int64_t *first, int64_t *last) {
#ifdef _OPENMP
    const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
#else
    const int64_t me = 0, team = 1;
#endif
    int64_t total = 0;
    for (int i = 0; i < num_seqs; i++) total += task_work(context_lens[seq_ids[i]], window) * hkv;
    const int64_t lo = total * me / team, hi = total * (me + 1) / team;
    const int64_t tasks = (int64_t)num_seqs * hkv;
    int64_t done = 0, t = 0; /* done: the work of the tasks before t */
    *first = *last = tasks;
    for (int i = 0; i < num_seqs && t < tasks; i++) {
        const int64_t work = task_work(context_lens[seq_ids[i]], window);
        if (done + (hkv - 1) * work < lo) { /* every head's task before this share: a sequence at a time */
            t += hkv, done += hkv * work;
            continue;
        }
        for (int h = 0; h < hkv; h++, t++, done += work) {
            if (*first == tasks && done >= lo) *first = t;
            if (done >= hi) {
                *last = t;
                return;
            }
        }
    }
}

INLINE int run(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
               int64_t table_stride, const int32_t *context_lens, const int32_t *cu_seqlens_q, int num_tables,
               const int32_t *seq_ids, int num_seqs, int64_t num_q_rows, void *out, int hq, int hkv, int d, int bs,
               float scale, int window, float softcap, int num_threads, int bf16) {
    if (hkv <= 0 || hq % hkv || hq / hkv > MAX_GROUP || d <= 0 || d > MAX_HEAD_DIM || bs <= 0 || bs > MAX_BLOCK) return 1;
    /* every row's sequence and query token in range, before anything is read through them (the
     * caller checks the block ids the windows cover, once a step) */
    for (int i = 0; i < num_seqs; i++) {
        if (seq_ids[i] < 0 || seq_ids[i] >= num_tables) return 2;
        if (cu_seqlens_q[seq_ids[i]] < 0 || cu_seqlens_q[seq_ids[i]] >= num_q_rows) return 3;
    }
#ifdef HAVE_AMX_ATTENTION
    const int amx = use_amx && bf16 && d % 32 == 0 && amx_permitted();
#endif
#pragma omp parallel num_threads(num_threads)
    {
        int64_t first, last;
        task_share(seq_ids, num_seqs, hkv, context_lens, window, &first, &last);
#ifdef HAVE_AMX_ATTENTION
        if (amx && first < last) amx_attention_configure(hq / hkv);
#endif
        for (int64_t t = first; t < last; t++) {
            const int seq = seq_ids[t / hkv], kvh = (int)(t % hkv);
            const int32_t *table = block_tables + (int64_t)seq * table_stride;
            const int len = context_lens[seq], start = window_start(len, window);
            Upcoming next = {NULL, 0, 0, 0};
            if (t + 1 < last) { /* the next task is this thread's too: its first blocks go to this cache */
                const int s = seq_ids[(t + 1) / hkv];
                next = (Upcoming){block_tables + (int64_t)s * table_stride, context_lens[s],
                                  window_start(context_lens[s], window), (int64_t)((t + 1) % hkv) * d};
            }
#ifdef HAVE_AMX_ATTENTION
            if (amx) {
                if (d == 64)
                    decode_task_amx(q, k_cache, v_cache, table, len, start, cu_seqlens_q[seq], out, hq, hkv, 64, bs,
                                    kvh, scale, softcap, next);
                else
                    decode_task_amx(q, k_cache, v_cache, table, len, start, cu_seqlens_q[seq], out, hq, hkv, d, bs,
                                    kvh, scale, softcap, next);
                continue;
            }
#endif
            /* the common head sizes as constants, so that their loops unroll */
            if (d == 64)
                decode_task(q, k_cache, v_cache, table, len, start, cu_seqlens_q[seq], out, hq, hkv, 64, bs, kvh,
                            scale, softcap, bf16, next);
            else if (d == 128)
                decode_task(q, k_cache, v_cache, table, len, start, cu_seqlens_q[seq], out, hq, hkv, 128, bs, kvh,
                            scale, softcap, bf16, next);
            else
                decode_task(q, k_cache, v_cache, table, len, start, cu_seqlens_q[seq], out, hq, hkv, d, bs, kvh,
                            scale, softcap, bf16, next);
        }
#ifdef HAVE_AMX_ATTENTION
        if (amx && first < last) _tile_release();
#endif
    }
    return 0;
}

/* returns 0, or 1 for shapes it does not take, 2 for a seq id outside the tables, 3 for a query
 * row outside q; nothing is read through a bad index. window 0 and softcap 0: neither. */
#define ENTRY(NAME, BF16)                                                                                   \
    int NAME(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,          \
             int64_t table_stride, const int32_t *context_lens, const int32_t *cu_seqlens_q, int num_tables, \
             const int32_t *seq_ids, int num_seqs, int64_t num_q_rows, void *out, int hq, int hkv, int d,   \
             int bs, float scale, int window, float softcap, int num_threads) {                             \
        return run(q, k_cache, v_cache, block_tables, table_stride, context_lens, cu_seqlens_q, num_tables, \
                   seq_ids, num_seqs, num_q_rows, out, hq, hkv, d, bs, scale, window, softcap, num_threads,  \
                   BF16);                                                                                   \
    }

ENTRY(paged_decode_f32, 0)
ENTRY(paged_decode_bf16, 1)

/* The blocks each of `rows` rows' windows cover (its whole context where window is 0), checked before
 * the kernel reads them, once a step (kernels/cpu/attention.py): 0, or 1 where a row's context is empty,
 * 2 where a table is shorter than its context, 3 where an id within a window lies outside the pool of
 * num_blocks blocks; each over all rows before the next (the entries before a window may be -1). */
int paged_check_tables(const int32_t *tables, int64_t stride, int64_t max_blocks, const int32_t *context_lens,
                       int rows, int bs, int window, int64_t num_blocks) {
    if (bs <= 0) return 2;
    for (int r = 0; r < rows; r++)
        if (context_lens[r] < 1) return 1;
    for (int r = 0; r < rows; r++)
        if (((int64_t)context_lens[r] + bs - 1) / bs > max_blocks) return 2;
    for (int r = 0; r < rows; r++) {
        const int len = context_lens[r];
        const int64_t end = ((int64_t)len + bs - 1) / bs; /* within max_blocks (above) */
        for (int64_t b = window_start(len, window) / bs; b < end; b++) {
            const int32_t id = tables[(int64_t)r * stride + b];
            if (id < 0 || id >= num_blocks) return 3;
        }
    }
    return 0;
}
