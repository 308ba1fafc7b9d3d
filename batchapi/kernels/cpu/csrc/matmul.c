/* A linear layer whose weight is stored in bf16 and multiplied in fp32: y = x W^T + b.
 *
 * For CPUs without native bf16 matmuls, where the engine computes in fp32: a bf16 checkpoint's
 * weights widened to fp32 are exactly the fp32 weights, so keeping them in bf16 and widening each
 * one as it is used gives the fp32 layer's arithmetic on half the bytes. A decode step reads every
 * weight once, so on such a CPU the step is bound by those bytes.
 *
 * Packed layout (batchapi/kernels/cpu/matmul.py packs it): the N outputs in panels of 16, each
 * panel [K][16] bf16 with the columns of a k in the order 0, 8, 1, 9, ..., 7, 15, so one 32-byte
 * load holds columns 0-7 in the high halves of its 32-bit lanes once shifted left by 16, and
 * columns 8-15 once the low halves are masked off: two fp32 vectors for three instructions.
 * N is padded to a multiple of 16 with zero columns, which are computed and never stored.
 *
 * Batch invariance by construction: every output y[m][n] is one fused multiply-add chain over
 * k = 0, 1, ..., K-1 from 0.0f, then + b[n], in every build (AVX2 with FMA, or plain C with
 * fmaf), whatever the number of rows, the tile a row falls in or the thread that runs it.
 * Rows are taken in tiles of up to 6 (12 accumulators of 8 outputs), panels split between the
 * threads, rows in chunks of CHUNK_ROWS so a chunk's activations stay in cache across panels.
 */
#define _GNU_SOURCE /* syscall(), for AMX's permission */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define PANEL 16
#define MAX_TILE 6
#define CHUNK_ROWS 96

/* A thread's running greedy choice for each row of a call (the *_argmax kernels): the largest output
 * so far as stored (bf16 widened, or fp32), its column (the first of ties), and the first NaN's column
 * (-1: none) */
typedef struct {
    float *value;
    int64_t *column, *nan;
} Best;

/* output `v` (as stored) of column `col` folded into row 0 of `best`; columns come in
 * order, and the largest moves only to a strictly larger value, so the first of ties stays */
INLINE void fold_value(float v, int64_t col, Best best) {
    if (v != v) {
        if (*best.nan < 0) *best.nan = col;
    } else if (v > *best.value) {
        *best.value = v;
        *best.column = col;
    }
}

/* room for `team` threads' choices for m rows (values, then columns: the largest's, then the first
 * NaN's), set to none; 0 where there is no memory */
static int best_start(int team, int64_t m, float **values, int64_t **columns) {
    *values = malloc((size_t)(team * m + 1) * sizeof **values);
    *columns = malloc((size_t)(2 * team * m + 1) * sizeof **columns);
    if (!*values || !*columns) {
        free(*values), free(*columns);
        return 0;
    }
    for (int64_t i = 0; i < team * m; i++) (*values)[i] = -INFINITY, (*columns)[i] = 0, (*columns)[team * m + i] = -1;
    return 1;
}

/* thread t's Best for rows [0, m) */
static Best best_of(int t, int team, int64_t m, float *values, int64_t *columns) {
    return (Best){values + t * m, columns + t * m, columns + team * m + t * m};
}

/* the threads' choices merged into chosen[m] and freed: the first NaN, else the first largest (by
 * column: the screen interleaves the threads' columns) */
static void best_finish(int team, int64_t m, float *values, int64_t *columns, int64_t *chosen) {
    for (int64_t r = 0; r < m; r++) {
        float top = -INFINITY;
        int64_t column = 0, nan = -1;
        for (int t = 0; t < team; t++) {
            const int64_t i = t * m + r, first_nan = columns[team * m + i];
            if (first_nan >= 0 && (nan < 0 || first_nan < nan)) nan = first_nan;
            if (values[i] > top || (values[i] == top && values[i] > -INFINITY && columns[i] < column))
                top = values[i], column = columns[i];
        }
        chosen[r] = nan >= 0 ? nan : column;
    }
    free(values), free(columns);
}

INLINE Best best_at(Best best, int64_t r) {
    return best.value ? (Best){best.value + r, best.column + r, best.nan + r} : best;
}

/* a row's `cols` fp32 outputs v (columns col0..) folded into row 0 of `best` as fold_value folds them
 * one by one; a whole panel none of whose outputs is NaN or above the best so far, at once */
INLINE void fold_row(const float *v, int cols, int64_t col0, Best best) {
#ifdef HAVE_AVX2
    if (cols >= PANEL) {
        const __m256 top = _mm256_set1_ps(*best.value);
        const __m256 a = _mm256_cmp_ps(_mm256_loadu_ps(v), top, _CMP_NLE_UQ); /* above it, or NaN */
        const __m256 b = _mm256_cmp_ps(_mm256_loadu_ps(v + 8), top, _CMP_NLE_UQ);
        if (!_mm256_movemask_ps(_mm256_or_ps(a, b))) return;
    }
#endif
    for (int j = 0; j < cols && j < PANEL; j++) fold_value(v[j], col0 + j, best);
}

#ifdef HAVE_AVX2
/* rows [0, MR) of the tile, one panel: x rows at stride xs, out rows at stride ys, `cols` <= 16 stored */
#define TILE_KERNEL(MR)                                                                                        \
    static void tile_##MR(const float *x, int64_t xs, const uint16_t *panel, int64_t k, const float *bias,     \
                          float *y, int64_t ys, int cols, Best best, int64_t col0) {                          \
        __m256 lo[MR], hi[MR];                                                                                \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) lo[r] = hi[r] = _mm256_setzero_ps();            \
        const __m256i mask = _mm256_set1_epi32((int)0xffff0000u);                                             \
        for (int64_t i = 0; i < k; i++) {                                                                     \
            __m256i w = _mm256_loadu_si256((const __m256i *)(panel + i * PANEL));                            \
            __m256 w_lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));                                      \
            __m256 w_hi = _mm256_castsi256_ps(_mm256_and_si256(w, mask));                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                            \
                __m256 a = _mm256_broadcast_ss(x + r * xs + i);                                               \
                lo[r] = _mm256_fmadd_ps(a, w_lo, lo[r]);                                                      \
                hi[r] = _mm256_fmadd_ps(a, w_hi, hi[r]);                                                      \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                                \
            float tmp[PANEL];                                                                                 \
            __m256 b_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();                                 \
            __m256 b_hi = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();                             \
            _mm256_storeu_ps(tmp, _mm256_add_ps(lo[r], b_lo));                                                \
            _mm256_storeu_ps(tmp + 8, _mm256_add_ps(hi[r], b_hi));                                            \
            if (best.value) /* the row's greedy choice instead of its outputs */                              \
                fold_row(tmp, cols, col0, best_at(best, r));                                                  \
            else                                                                                              \
                memcpy(y + r * ys, tmp, (size_t)cols * sizeof(float));                                        \
        }                                                                                                     \
    }
#else
#define TILE_KERNEL(MR)                                                                                        \
    static void tile_##MR(const float *x, int64_t xs, const uint16_t *panel, int64_t k, const float *bias,     \
                          float *y, int64_t ys, int cols, Best best, int64_t col0) {                          \
        float acc[MR][PANEL];                                                                                 \
        memset(acc, 0, sizeof acc);                                                                           \
        for (int64_t i = 0; i < k; i++) {                                                                     \
            const uint16_t *w = panel + i * PANEL;                                                            \
            for (int r = 0; r < MR; r++) {                                                                    \
                float a = x[r * xs + i];                                                                      \
                for (int j = 0; j < 8; j++) {                                                                 \
                    acc[r][j] = fmaf(a, bf16_to_f32(w[2 * j]), acc[r][j]);                                    \
                    acc[r][j + 8] = fmaf(a, bf16_to_f32(w[2 * j + 1]), acc[r][j + 8]);                        \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < MR; r++) {                                                                        \
            for (int j = 0; j < PANEL; j++) acc[r][j] += bias ? bias[j] : 0.0f;                               \
            if (best.value)                                                                                   \
                fold_row(acc[r], cols, col0, best_at(best, r));                                               \
            else                                                                                              \
                memcpy(y + r * ys, acc[r], (size_t)cols * sizeof(float));                                     \
        }                                                                                                     \
    }
#endif

TILE_KERNEL(1)
TILE_KERNEL(2)
TILE_KERNEL(3)
TILE_KERNEL(4)
TILE_KERNEL(5)
TILE_KERNEL(6)

/* this OpenMP thread's number in its team (0 outside one) */
INLINE int thread_index(void) {
#ifdef _OPENMP
    extern int omp_get_thread_num(void);
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* the number of threads of this OpenMP team (1 outside one) */
INLINE int team_size(void) {
#ifdef _OPENMP
    extern int omp_get_num_threads(void);
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* this OpenMP thread's contiguous share [first, last) of `total` units (all of them outside a team) */
INLINE void thread_share(int64_t total, int64_t *first, int64_t *last) {
    const int t = thread_index(), nt = team_size();
    *first = total * t / nt;
    *last = total * (t + 1) / nt;
}

typedef void (*tile_fn)(const float *, int64_t, const uint16_t *, int64_t, const float *, float *, int64_t, int, Best,
                        int64_t);
static const tile_fn TILES[MAX_TILE + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* linear_bf16w's work: outputs into y, or (chosen != NULL) each row's greedy choice into chosen[m].
 * The panels are split between `threads` threads in contiguous ranges; each walks the rows in chunks,
 * a row's panels in order of columns. */
static int bf16w_linear(const float *x, int64_t xs, int64_t m, const uint16_t *packed, int64_t n, int64_t k,
                        const float *bias, float *y, int64_t ys, int threads, int64_t *chosen) {
    if (m < 0 || n < 0 || k < 0 || xs < k || (!chosen && ys < n)) return -1;
    int64_t panels = (n + PANEL - 1) / PANEL;
    /* a thread's share is whole panels; below ~1 MFLOP a call runs on one thread */
    int parallel = threads > 1 && m * n * k >= (1 << 19) && panels > 1, team = parallel ? threads : 1;
    float *values = NULL;
    int64_t *columns = NULL;
    if (chosen && !best_start(team, m, &values, &columns)) return -1;
#pragma omp parallel num_threads(team) if (parallel)
    {
        int64_t first, last;
        thread_share(panels, &first, &last);
        const Best mine = chosen ? best_of(thread_index(), team, m, values, columns) : (Best){NULL, NULL, NULL};
        for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
            int64_t m1 = m0 + CHUNK_ROWS < m ? m0 + CHUNK_ROWS : m;
            for (int64_t p = first; p < last; p++) {
                const uint16_t *panel = packed + p * k * PANEL;
                int cols = (int)(n - p * PANEL < PANEL ? n - p * PANEL : PANEL);
                const float *b = bias ? bias + p * PANEL : NULL;
                float tail_bias[PANEL];
                if (b && cols < PANEL) { /* the last panel's bias, padded like its columns */
                    memset(tail_bias, 0, sizeof tail_bias);
                    memcpy(tail_bias, b, (size_t)cols * sizeof(float));
                    b = tail_bias;
                }
                for (int64_t r = m0; r < m1; r += MAX_TILE) {
                    int rows = (int)(m1 - r < MAX_TILE ? m1 - r : MAX_TILE);
                    TILES[rows](x + r * xs, xs, panel, k, b, chosen ? NULL : y + r * ys + p * PANEL, ys, cols,
                                best_at(mine, r), p * PANEL);
                }
            }
        }
    }
    if (chosen) best_finish(team, m, values, columns, chosen);
    return 0;
}

/* y [m, n] (row stride ys) = x [m, k] (row stride xs) times the packed weight, plus bias [n] (or NULL) */
int linear_bf16w(const float *x, int64_t xs, int64_t m, const uint16_t *packed, int64_t n, int64_t k,
                 const float *bias, float *y, int64_t ys, int threads) {
    return bf16w_linear(x, xs, m, packed, n, k, bias, y, ys, threads, NULL);
}

/* argmax of linear_bf16w's outputs for each row, into chosen[m] (int64), without writing them: the
 * index torch.argmax gives on them (the first of ties; the first NaN where there is one). A greedy
 * step's lm_head: at 256 rows SmolLM2's 49,152 fp32 logits a row are 50 MB written and read back. */
int linear_bf16w_argmax(const float *x, int64_t xs, int64_t m, const uint16_t *packed, int64_t n, int64_t k,
                        const float *bias, int64_t *chosen, int threads) {
    if (m == 0) return 0; /* nothing to choose (chosen may be NULL) */
    if (chosen == NULL) return -1;
    return bf16w_linear(x, xs, m, packed, n, k, bias, NULL, 0, threads, chosen);
}

/* ------------------------------------------------------------------------------------------------
 * A bf16 linear layer on CPUs with AVX512-BF16 (and no AMX): y = bf16(x W^T + b), x and W bf16.
 *
 * oneDNN's bf16 kernel runs a decode step's calls (1 to ~100 rows) well below the FMA units' rate on
 * such a CPU (a 2-core EPYC Zen 4: 20 GFLOP/s at 1 row, 150 at 8, 300 at 48, the weights streamed
 * from memory); this one reads each weight panel once per call and keeps it in cache for all rows.
 *
 * Packed layout (matmul.py's pack_pairs): the N outputs in panels of 16, each panel [ceil(K/2)][16]
 * 32-bit words holding the pair (w[n][2i], w[n][2i + 1]) in its low and high halves, the last pair's
 * high half 0 where K is odd; N padded to whole panels with zero columns, computed and never stored.
 * One 64-byte load is a panel's pair i, and VDPBF16PS multiplies it by a row's pair broadcast.
 *
 * Batch invariance by construction: every output is one chain over the pairs i = 0, 1, ... from
 * 0.0f, each pair added as VDPBF16PS adds it (the odd element's product fused into the sum, then the
 * even one's, each rounded to nearest even, denormals read and written as zero), then + b[n] in fp32
 * and rounded to bf16, whatever the rows, the tile or the thread. The plain-C build does the same
 * operations one at a time (fmaf and explicit flushes): a CPU without AVX512-BF16 gets the bits too,
 * slowly (the tests use it; the engine picks oneDNN or fp32 there).
 * Tiles of up to 8 rows by 3 panels (24 of the 32 vector registers accumulate); a group's first tile
 * asks for the next group's weights (into L2), which the hardware prefetchers do not foresee.
 */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_AVX512BF16 1
#include "silu16.h"
#endif

#define PAIR_TILE_ROWS 8
#define SILU_TILE_ROWS 12 /* linear_bf16_silu's tiles: 12 rows by 2 panels, the 24 accumulators of 8 by 3 */
#define PAIR_TILE_PANELS 3

/* the pair of bf16 at p as one 32-bit word; `half` only the first (the odd K's last pair) */
INLINE uint32_t pair_at(const uint16_t *p, int half) {
    uint32_t word;
    if (half) return (uint32_t)p[0];
    memcpy(&word, p, sizeof word);
    return word;
}

/* what VDPBF16PS and VCVTNEPS2BF16 do to denormals */
INLINE float flush(float f) { return fabsf(f) < 1.17549435e-38f ? copysignf(0.0f, f) : f; }

INLINE uint16_t f32_to_bf16_daz(float f) { return f32_to_bf16(flush(f)); }

/* The plain-C tiles' sums rounded to nearest even, as VDPBF16PS rounds, whatever the caller's mode
 * (a caller's fesetround applies to fmaf); nearest_end puts the caller's back. On x86-64 denormals
 * are flushed by `flush` explicitly and MXCSR's DAZ and FTZ are cleared, so the caller's change
 * nothing either; elsewhere only the rounding mode is set. */
#if defined(__x86_64__)
#include <xmmintrin.h>
INLINE int nearest_begin(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(0x1F80u); /* to nearest, every exception masked */
    return (int)csr;
}
INLINE void nearest_end(int csr) { _mm_setcsr((unsigned)csr); }
#else
#include <fenv.h>
INLINE int nearest_begin(void) {
    const int mode = fegetround();
    fesetround(FE_TONEAREST);
    return mode;
}
INLINE void nearest_end(int mode) { fesetround(mode); }
#endif

#ifdef HAVE_AVX512BF16
/* 16 fp32 sums as the layer stores them: rounded to bf16 (VCVTNEPS2BF16), widened back */
INLINE __m512 as_stored(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* a row's 16 gate sums and their 16 up sums, each as stored, through silu_and_mul's arithmetic
 * (silu16.h) into y's `live` columns: the epilogue of linear_bf16_silu's and linear_amx_silu's tiles */
INLINE void store_silu16(__m512 gate, __m512 up, uint16_t *y, __mmask16 live) {
    const __m512 both = silu_mul_bf16_16(as_stored(gate), as_stored(up)); /* already bf16: its high halves */
    _mm256_mask_storeu_epi16(y, live, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(both), 16)));
}

/* a row's `np` panels of fp32 outputs (bias added), columns col0.. of which `cols` are live, folded
 * into row 0 of `best` as fold_value would fold them one by one after rounding to bf16, but in any
 * order of calls (a dealt unit may come after a later one): a tie keeps the first column, and the
 * first NaN is the first by column */
INLINE void fold_panels(__m512 *v, int np, int cols, int64_t col0, Best best) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 most = minus_inf;
    for (int p = 0; p < np; p++) {
        const int c = cols - p * PANEL;
        const __mmask16 live = (__mmask16)(c >= PANEL ? 0xffff : c > 0 ? (1u << c) - 1 : 0);
        v[p] = as_stored(v[p]);
        const __mmask16 nan = _mm512_mask_cmp_ps_mask(live, v[p], v[p], _CMP_UNORD_Q);
        if (nan && (*best.nan < 0 || col0 + p * PANEL + __builtin_ctz(nan) < *best.nan))
            *best.nan = col0 + p * PANEL + __builtin_ctz(nan);
        v[p] = _mm512_mask_blend_ps(live & (__mmask16)~nan, minus_inf, v[p]);
        most = _mm512_max_ps(most, v[p]);
    }
    const float top = _mm512_reduce_max_ps(most);
    if (top > *best.value || (top == *best.value && top > -INFINITY)) { /* a tie: the first column */
        for (int p = 0; p < np; p++) {
            const __mmask16 at = _mm512_cmp_ps_mask(v[p], _mm512_set1_ps(top), _CMP_EQ_OQ);
            if (at) {
                const int64_t column = col0 + p * PANEL + __builtin_ctz(at);
                if (top > *best.value || column < *best.column) *best.value = top, *best.column = column;
                break;
            }
        }
    }
}
#endif

#ifdef HAVE_AVX512BF16
/* a tile's fp32 sums acc[MR][NP] (rows by panels) + bias, rounded to bf16 and stored, or (best.value)
 * folded into the rows' greedy choices instead */
#define PAIR_EPILOGUE(MR, NP, SILU)                                                                            \
    const Best best = bestp ? *bestp : (Best){NULL, NULL, NULL};                                              \
    if (SILU) { /* panel 0 a gate panel, panel 1 its up panel: silu_and_mul's bits on the outputs as stored */ \
        const __mmask16 live = (__mmask16)(cols >= PANEL ? 0xffff : (1u << cols) - 1);                        \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)                                                 \
            store_silu16(acc[r][0], acc[r][1], y + r * ys, live);                                             \
        return;                                                                                               \
    }                                                                                                         \
    if (best.value) { /* the rows' greedy choices instead of the outputs */                                   \
        for (int r = 0; r < MR; r++) {                                                                        \
            __m512 v[NP];                                                                                     \
            for (int p = 0; p < NP; p++)                                                                      \
                v[p] = bias ? _mm512_add_ps(acc[r][p], _mm512_loadu_ps(bias + p * PANEL)) : acc[r][p];       \
            fold_panels(v, NP, cols, col0, best_at(best, r));                                                 \
        }                                                                                                     \
        return;                                                                                               \
    }                                                                                                         \
    _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)                                                     \
        _Pragma("GCC unroll 3") for (int p = 0; p < NP; p++) {                                                \
            __m512 v = bias ? _mm512_add_ps(acc[r][p], _mm512_loadu_ps(bias + p * PANEL)) : acc[r][p];       \
            __m256i out = (__m256i)_mm512_cvtneps_pbh(v);                                                     \
            int c = cols - p * PANEL;                                                                         \
            if (c >= PANEL)                                                                                   \
                _mm256_storeu_si256((__m256i *)(y + r * ys + p * PANEL), out);                                \
            else if (c > 0)                                                                                   \
                _mm256_mask_storeu_epi16(y + r * ys + p * PANEL, (__mmask16)((1u << c) - 1), out);            \
        }

/* A row's pair of K times the tile's NP weight vectors into its accumulators a_r0..a_r2, the pair
 * broadcast by VDPBF16PS itself from memory ({1to16}). Compilers broadcast it into a register
 * first (it feeds NP instructions): a VPBROADCASTD a row, which took a vector pipe from VDPBF16PS
 * (an EPYC Zen 4: 87-90% of VDPBF16PS's peak on one thread before, 96-99% after, 1.07-1.12x on two
 * threads). The products are the same with the two operands swapped, summed in the same order: the
 * same bits. Named accumulators, not an array: GCC keeps an array under inline asm in memory. */
#define DP1(acc, wv, at) __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(wv), "m"(*(at)))
/* row r's step of K: OP (DP1, or the screen's DQ1) of its operand at `at` with the tile's NP weight
 * vectors w0..w2 into its accumulators A_r0..A_r2; every row of the tile in turn */
#define ROW_STEP(OP, A, r, NP, at)                                                                             \
    if (r < mr) {                                                                                             \
        const __typeof__(at) at_ = (at);                                                                      \
        OP(A##r##0, w0, at_);                                                                                 \
        if (NP > 1) OP(A##r##1, w1, at_);                                                                      \
        if (NP > 2) OP(A##r##2, w2, at_);                                                                      \
    }
#define ROWS_STEP(OP, A, NP, AT)                                                                               \
    ROW_STEP(OP, A, 0, NP, AT(0)) ROW_STEP(OP, A, 1, NP, AT(1)) ROW_STEP(OP, A, 2, NP, AT(2))                 \
    ROW_STEP(OP, A, 3, NP, AT(3)) ROW_STEP(OP, A, 4, NP, AT(4)) ROW_STEP(OP, A, 5, NP, AT(5))                 \
    ROW_STEP(OP, A, 6, NP, AT(6)) ROW_STEP(OP, A, 7, NP, AT(7))
#define PAIR_ROWS(NP, AT)                                                                                      \
    ROWS_STEP(DP1, a, NP, AT) ROW_STEP(DP1, a, 8, NP, AT(8)) ROW_STEP(DP1, a, 9, NP, AT(9))                    \
    ROW_STEP(DP1, a, 10, NP, AT(10)) ROW_STEP(DP1, a, 11, NP, AT(11))
/* one pair i of K: the panels' weights (and the next group's asked for), then every row */
#define PAIR_STEP(NP, i, AT)                                                                                   \
    {                                                                                                          \
        const __m512 w0 = _mm512_loadu_ps(w + (i) * PANEL);                                                   \
        const __m512 w1 = NP > 1 ? _mm512_loadu_ps(w + pstride + (i) * PANEL) : w0;                            \
        const __m512 w2 = NP > 2 ? _mm512_loadu_ps(w + 2 * pstride + (i) * PANEL) : w0;                        \
        if (next) /* the next group's panels into L2 while this one computes: 1.05-1.1x at 8-48 rows */       \
            _Pragma("GCC unroll 3") for (int p = 0; p < NP; p++)                                               \
                _mm_prefetch((const char *)(next + p * pstride + (i) * PANEL), _MM_HINT_T1);                   \
        PAIR_ROWS(NP, AT)                                                                                      \
    }
#define ACC_ROW(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0;
#define ACC_OUT(r)                                                                                             \
    if (r < mr) acc[r][0] = a##r##0, acc[r][1] = a##r##1, acc[r][2] = a##r##2; /* past NP: never read */

#define PAIR_TILE_AS(NAME, MR, NP, SILU)                                                                       \
    static void NAME##_##MR##_##NP(const uint16_t *x, int64_t xs, const uint32_t *w, int64_t k,               \
                                      int64_t pstride, const float *bias, uint16_t *y, int64_t ys, int cols,  \
                                      const uint32_t *next, const Best *bestp, int64_t col0) {                \
        const int mr = MR; /* the rows of the tile: the helpers' rows past it are dead code */              \
        ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5) ACC_ROW(6) ACC_ROW(7)               \
        ACC_ROW(8) ACC_ROW(9) ACC_ROW(10) ACC_ROW(11) /* past MR: dead code */                                 \
        const int64_t whole = k / 2; /* pairs of two elements; K odd: a last one of one, its high half 0 */   \
        for (int64_t i = 0; i < whole; i++) {                                                                 \
            PAIR_STEP(NP, i, PAIR_IN_ROW)                                                                      \
        }                                                                                                     \
        if (k % 2) {                                                                                          \
            uint32_t last[MR];                                                                                \
            for (int r = 0; r < MR; r++) last[r] = pair_at(x + r * xs + 2 * whole, 1);                        \
            PAIR_STEP(NP, whole, PAIR_IN_LAST)                                                                 \
        }                                                                                                     \
        __m512 acc[SILU_TILE_ROWS][PAIR_TILE_PANELS];                                                         \
        ACC_OUT(0) ACC_OUT(1) ACC_OUT(2) ACC_OUT(3) ACC_OUT(4) ACC_OUT(5) ACC_OUT(6) ACC_OUT(7)                \
        ACC_OUT(8) ACC_OUT(9) ACC_OUT(10) ACC_OUT(11)                                                         \
        PAIR_EPILOGUE(MR, NP, SILU)                                                                           \
    }
#define PAIR_TILE(MR, NP) PAIR_TILE_AS(pair_tile, MR, NP, 0)
#define PAIR_SILU_TILE(MR, NP) PAIR_TILE_AS(pair_silu_tile, MR, NP, 1)
#define PAIR_IN_ROW(r) ((const uint32_t *)(x + (r) * xs + 2 * i))
#define PAIR_IN_LAST(r) (last + (r))

/* The same chains with VFMADD231PS, for CPUs that run VDPBF16PS at a fraction of their FMA rate (a Xeon
 * without AMX here: 164 GFLOP/s bf16 against 314 fp32 through oneDNN on 2 threads). A pair is the two
 * fused multiply-adds VDPBF16PS does, in its order: the odd element's product into the sum, then the
 * even one's, each rounded to nearest even, denormals read and written as zero (MXCSR set so for
 * the sums). Each step is one rounding of the exact acc + a * b in both: the same bits (NaNs and
 * infinities too: tests/kernels/cpu/test_matmul.py compares them). x comes widened to fp32 (xs
 * floats a row, 2 * pairs of them, the odd K's last one 0), so each row's element is a broadcast
 * operand of its multiply-adds;
 * a panel's pairs are split into its odd and even weights by a masked move (a mask register, not a
 * vector: 8 rows by 3 panels leave no vector spare) and a shift. The pair tile's 8 rows by 3 panels
 * (6 rows: 0.95-0.99x, 4 rows: 0.85x at 64-256 rows). */
#define FMA_TILE_AS(NAME, MR, NP, SILU)                                                                        \
    static void NAME##_##MR##_##NP(const float *x, int64_t xs, const uint32_t *w, int64_t k,                  \
                                     int64_t pstride, const float *bias, uint16_t *y, int64_t ys, int cols,   \
                                     const uint32_t *next, const Best *bestp, int64_t col0) {                 \
        __m512 acc[MR][NP];                                                                                   \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)                                                 \
            _Pragma("GCC unroll 3") for (int p = 0; p < NP; p++) acc[r][p] = _mm512_setzero_ps();             \
        const int64_t pairs = (k + 1) / 2;                                                                    \
        const unsigned csr = _mm_getcsr();                                                                    \
        /* the sums as VDPBF16PS makes them whatever the caller's MXCSR: to nearest even, no exception      \
         * unmasked, FTZ and DAZ; the epilogue runs under the caller's, as the VDPBF16PS tile's does */     \
        _mm_setcsr(0x9FC0u);                                                                              \
        for (int64_t i = 0; i < pairs; i++) {                                                                 \
            __m512 odd[NP], even[NP];                                                                         \
            _Pragma("GCC unroll 3") for (int p = 0; p < NP; p++) {                                            \
                const __m512i v = _mm512_loadu_si512((const void *)(w + p * pstride + i * PANEL));            \
                odd[p] = _mm512_castsi512_ps(_mm512_maskz_mov_epi16((__mmask32)0xAAAAAAAAu, v)); /* high halves */ \
                even[p] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                                      \
            }                                                                                                 \
            if (next)                                                                                         \
                _Pragma("GCC unroll 3") for (int p = 0; p < NP; p++)                                          \
                    _mm_prefetch((const char *)(next + p * pstride + i * PANEL), _MM_HINT_T1);                \
            _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {                                           \
                const __m512 a1 = _mm512_set1_ps(x[r * xs + 2 * i + 1]), a0 = _mm512_set1_ps(x[r * xs + 2 * i]); \
                _Pragma("GCC unroll 3") for (int p = 0; p < NP; p++) {                                        \
                    acc[r][p] = _mm512_fmadd_ps(a1, odd[p], acc[r][p]);                                       \
                    acc[r][p] = _mm512_fmadd_ps(a0, even[p], acc[r][p]);                                      \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        _mm_setcsr(csr);                                                                                      \
        PAIR_EPILOGUE(MR, NP, SILU)                                                                           \
    }
#define FMA_TILE(MR, NP) FMA_TILE_AS(fma_tile, MR, NP, 0)
#define FMA_SILU_TILE(MR, NP) FMA_TILE_AS(fma_silu_tile, MR, NP, 1)
#else
#define PAIR_TILE(MR, NP)                                                                                      \
    static void pair_tile_##MR##_##NP(const uint16_t *x, int64_t xs, const uint32_t *w, int64_t k,            \
                                      int64_t pstride, const float *bias, uint16_t *y, int64_t ys, int cols,  \
                                      const uint32_t *next, const Best *bestp, int64_t col0) {                \
        float acc[MR][NP * PANEL];                                                                            \
        (void)next;                                                                                           \
        memset(acc, 0, sizeof acc);                                                                           \
        int64_t pairs = (k + 1) / 2;                                                                          \
        const int mode = nearest_begin(); /* VDPBF16PS's rounding whatever the caller's */                    \
        for (int64_t i = 0; i < pairs; i++) {                                                                 \
            int half = 2 * i + 1 == k;                                                                        \
            for (int r = 0; r < MR; r++) {                                                                    \
                uint32_t a = pair_at(x + r * xs + 2 * i, half);                                               \
                float a0 = flush(bf16_to_f32((uint16_t)a)), a1 = flush(bf16_to_f32((uint16_t)(a >> 16)));    \
                for (int p = 0; p < NP; p++)                                                                  \
                    for (int j = 0; j < PANEL; j++) {                                                         \
                        uint32_t b = w[p * pstride + i * PANEL + j];                                          \
                        float *s = &acc[r][p * PANEL + j];                                                    \
                        *s = flush(fmaf(a1, flush(bf16_to_f32((uint16_t)(b >> 16))), flush(*s)));             \
                        *s = flush(fmaf(a0, flush(bf16_to_f32((uint16_t)b)), *s));                            \
                    }                                                                                         \
            }                                                                                                 \
        }                                                                                                     \
        nearest_end(mode);                                                                                    \
        const Best best = bestp ? *bestp : (Best){NULL, NULL, NULL};                                          \
        for (int r = 0; r < MR; r++)                                                                          \
            for (int j = 0; j < cols && j < NP * PANEL; j++) {                                                \
                uint16_t out = f32_to_bf16_daz(acc[r][j] + (bias ? bias[j] : 0.0f));                          \
                if (best.value)                                                                               \
                    fold_value(bf16_to_f32(out), col0 + j, best_at(best, r));                                 \
                else                                                                                          \
                    y[r * ys + j] = out;                                                                      \
            }                                                                                                 \
    }
#endif

/* a tile kind's functions for 1..PAIR_TILE_ROWS rows by 1..PAIR_TILE_PANELS panels, and their table
 * [panels][rows] (row 0 and column 0 unused) */
#define TILES_OF(TILE, NP) TILE(1, NP) TILE(2, NP) TILE(3, NP) TILE(4, NP) TILE(5, NP) TILE(6, NP) TILE(7, NP) \
    TILE(8, NP)
#define TILE_ROW(NAME, NP) {0, NAME##_1_##NP, NAME##_2_##NP, NAME##_3_##NP, NAME##_4_##NP, NAME##_5_##NP, \
    NAME##_6_##NP, NAME##_7_##NP, NAME##_8_##NP}
#define TILE_TABLE(NAME) {{0}, TILE_ROW(NAME, 1), TILE_ROW(NAME, 2), TILE_ROW(NAME, 3)}
/* ... and for 1..SILU_TILE_ROWS rows by NP panels */
#define TILES_OF_12(TILE, NP) TILES_OF(TILE, NP) TILE(9, NP) TILE(10, NP) TILE(11, NP) TILE(12, NP)
#define TILE_ROW_12(NAME, NP) {0, NAME##_1_##NP, NAME##_2_##NP, NAME##_3_##NP, NAME##_4_##NP, NAME##_5_##NP, \
    NAME##_6_##NP, NAME##_7_##NP, NAME##_8_##NP, NAME##_9_##NP, NAME##_10_##NP, NAME##_11_##NP, NAME##_12_##NP}

TILES_OF(PAIR_TILE, 1)
TILES_OF(PAIR_TILE, 2)
TILES_OF(PAIR_TILE, 3)

typedef void (*pair_tile_fn)(const uint16_t *, int64_t, const uint32_t *, int64_t, int64_t, const float *,
                             uint16_t *, int64_t, int, const uint32_t *, const Best *, int64_t);
static const pair_tile_fn PAIR_TILES_BY[PAIR_TILE_PANELS + 1][PAIR_TILE_ROWS + 1] = TILE_TABLE(pair_tile);

#ifdef HAVE_AVX512BF16
/* SiLU-and-mul in the epilogue (linear_bf16_silu): a gate panel and its up panel, pstride apart */
TILES_OF_12(PAIR_SILU_TILE, 2)
static const pair_tile_fn PAIR_SILU_TILES[SILU_TILE_ROWS + 1] = TILE_ROW_12(pair_silu_tile, 2);
#endif

#ifdef HAVE_AVX512BF16
TILES_OF(FMA_TILE, 1)
TILES_OF(FMA_TILE, 2)
TILES_OF(FMA_TILE, 3)

typedef void (*fma_tile_fn)(const float *, int64_t, const uint32_t *, int64_t, int64_t, const float *,
                            uint16_t *, int64_t, int, const uint32_t *, const Best *, int64_t);
static const fma_tile_fn FMA_TILES_BY[PAIR_TILE_PANELS + 1][PAIR_TILE_ROWS + 1] = TILE_TABLE(fma_tile);
TILES_OF_12(FMA_SILU_TILE, 2)
static const fma_tile_fn FMA_SILU_TILES[SILU_TILE_ROWS + 1] = TILE_ROW_12(fma_silu_tile, 2);

/* this thread's buffer of CHUNK_ROWS rows of `width` floats, kept across calls (NULL: no memory) */
static float *widened_rows(int64_t width) {
    static _Thread_local float *rows = NULL;
    static _Thread_local int64_t held = 0;
    if (rows == NULL || held < width) {
        float *grown = malloc((size_t)CHUNK_ROWS * (width > 0 ? width : 1) * sizeof *grown);
        if (grown == NULL) return NULL;
        free(rows);
        rows = grown;
        held = width;
    }
    return rows;
}

/* rows x [m, k] bf16 (row stride xs) as fp32 into `to`, `width` floats a row (k, or k + 1 with a 0) */
INLINE void widen_rows(const uint16_t *x, int64_t xs, int64_t m, int64_t k, float *to, int64_t width) {
    for (int64_t r = 0; r < m; r++, to += width) {
#pragma omp simd
        for (int64_t j = 0; j < k; j++) to[j] = bf16_to_f32(x[r * xs + j]);
        if (k < width) to[k] = 0.0f;
    }
}
#endif

/* 1 where this build multiplies with AVX512-BF16, 0 where in plain C (correct, slow) */
int linear_bf16_native(void) {
#ifdef HAVE_AVX512BF16
    return 1;
#else
    return 0;
#endif
}

/* Which instructions linear_bf16 and linear_bf16_argmax run where the build has AVX512-BF16: 0
 * VDPBF16PS, 1 VFMADD231PS (the same bits, FMA_TILE). choice 0 or 1 sets it for the process; any
 * other value only asks. Returns the instructions now in use (0 in the plain-C build). */
static int pair_fma = 0;

int linear_bf16_instructions(int choice) {
#ifdef HAVE_AVX512BF16
    if (choice == 0 || choice == 1) __atomic_store_n(&pair_fma, choice, __ATOMIC_RELAXED);
#else
    (void)choice;
#endif
    return __atomic_load_n(&pair_fma, __ATOMIC_RELAXED);
}

/* linear_bf16's work: outputs into y, or (chosen != NULL) each row's greedy choice into chosen[m], or
 * (silu) silu(gate) * up into y for a weight [gate; up], each half whole panels: a group is then gate
 * panel g and up panel g (half the panels on), a tile of 2 panels */
static int pair_linear(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n, int64_t k,
                       const float *bias, uint16_t *y, int64_t ys, int threads, int64_t *chosen, int silu) {
    if (m < 0 || n < 0 || k < 0 || xs < k || (!chosen && ys < (silu ? n / 2 : n))) return -1;
    if (silu && (bias || chosen || n % (2 * PANEL))) return -1;
    int64_t panels = (n + PANEL - 1) / PANEL, pstride = (k + 1) / 2 * PANEL;
    int64_t groups = silu ? panels / 2 : (panels + PAIR_TILE_PANELS - 1) / PAIR_TILE_PANELS;
#ifndef HAVE_AVX512BF16
    if (silu) return -1;
#endif
    int parallel = threads > 1 && m * n * k >= (1 << 19) && groups > 1, team = parallel ? threads : 1;
#ifdef HAVE_AVX512BF16
    const int fma = __atomic_load_n(&pair_fma, __ATOMIC_RELAXED);
    const int64_t width = (k + 1) / 2 * 2; /* a widened row: the odd K's last pair padded with 0 */
#endif
    float *values = NULL;
    int64_t *columns = NULL;
    int failed = 0;
    if (chosen && !best_start(team, m, &values, &columns)) return -1;
#pragma omp parallel num_threads(team) if (parallel) reduction(| : failed)
    {
        int64_t first, last;
        thread_share(groups, &first, &last);
        const Best mine = chosen ? best_of(thread_index(), team, m, values, columns) : (Best){NULL, NULL, NULL};
#ifdef HAVE_AVX512BF16
        float *wide = fma && first < last ? widened_rows(width) : NULL;
        failed = fma && first < last && wide == NULL;
#endif
        for (int64_t m0 = 0; m0 < m && !failed; m0 += CHUNK_ROWS) {
            int64_t m1 = m0 + CHUNK_ROWS < m ? m0 + CHUNK_ROWS : m;
#ifdef HAVE_AVX512BF16
            if (wide) widen_rows(x + m0 * xs, xs, m1 - m0, k, wide, width); /* once, for all this thread's groups */
#endif
            for (int64_t g = first; g < last; g++) {
                int64_t p0 = silu ? g : g * PAIR_TILE_PANELS;
                int np = (int)(panels - p0 < PAIR_TILE_PANELS ? panels - p0 : PAIR_TILE_PANELS);
                int cols = (int)((silu ? n / 2 : n) - p0 * PANEL);
                /* the first row tile asks for the next group of this thread's, where that is a whole one */
                int ahead = g + 1 < last && (silu || panels - p0 >= 2 * PAIR_TILE_PANELS);
                const int tile_rows = silu ? SILU_TILE_ROWS : PAIR_TILE_ROWS;
                for (int64_t r = m0; r < m1; r += tile_rows) {
                    int rows = (int)(m1 - r < tile_rows ? m1 - r : tile_rows);
                    const uint32_t *next = r == m0 && ahead ? packed + (p0 + (silu ? 1 : PAIR_TILE_PANELS)) * pstride
                                                            : NULL;
                    const float *b = bias ? bias + p0 * PANEL : NULL;
                    uint16_t *out = chosen ? NULL : y + r * ys + p0 * PANEL;
                    const Best row_best = best_at(mine, r); /* by pointer: a struct passed by value was a stall */
#ifdef HAVE_AVX512BF16
                    if (silu) { /* the up panel half the panels on, where the tile's second panel lies */
                        if (wide)
                            FMA_SILU_TILES[rows](wide + (r - m0) * width, width, packed + p0 * pstride, k,
                                                 panels / 2 * pstride, NULL, out, ys, cols, next, NULL, 0);
                        else
                            PAIR_SILU_TILES[rows](x + r * xs, xs, packed + p0 * pstride, k, panels / 2 * pstride,
                                                  NULL, out, ys, cols, next, NULL, 0);
                        continue;
                    }
                    if (wide) {
                        FMA_TILES_BY[np][rows](wide + (r - m0) * width, width, packed + p0 * pstride, k, pstride, b,
                                               out, ys, cols, next, chosen ? &row_best : NULL, p0 * PANEL);
                        continue;
                    }
#endif
                    PAIR_TILES_BY[np][rows](x + r * xs, xs, packed + p0 * pstride, k, pstride, b, out, ys, cols,
                                            next, chosen ? &row_best : NULL, p0 * PANEL);
                }
            }
        }
    }
    if (chosen) best_finish(team, m, values, columns, chosen);
    return failed ? -1 : 0;
}

/* y [m, n] bf16 (row stride ys) = x [m, k] bf16 (row stride xs) times the pair-packed weight, plus bias
 * [n] fp32 padded to whole panels (or NULL). Groups of 3 panels split between `threads` threads. */
int linear_bf16(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n, int64_t k,
                const float *bias, uint16_t *y, int64_t ys, int threads) {
    return pair_linear(x, xs, m, packed, n, k, bias, y, ys, threads, NULL, 0);
}

/* silu(x W_gate^T) * (x W_up^T) into y [m, n / 2] (stride ys), for W = [W_gate; W_up] [n, k] packed as
 * linear_bf16 reads it, each half whole panels (n a multiple of 32), no bias: the bits of silu_and_mul
 * (elementwise.c) on linear_bf16's outputs, without them written and read back. A tile is 12 rows by a
 * gate panel and its up panel (the 24 accumulators of the 8-row, 3-panel tile). -1 where the build has
 * no AVX512-BF16, or the shapes are not these. */
int linear_bf16_silu(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n, int64_t k,
                     const float *bias, uint16_t *y, int64_t ys, int threads) {
    return pair_linear(x, xs, m, packed, n, k, bias, y, ys, threads, NULL, 1);
}

/* argmax of linear_bf16's bf16 outputs for each row, into chosen[m] (int64), without writing them: the
 * index torch.argmax gives on them (the first of ties; the first NaN where there is one). A greedy
 * step's lm_head: at 256 rows SmolLM2's 49,152 logits a row are 25 MB written and read back. */
int linear_bf16_argmax(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n, int64_t k,
                       const float *bias, int64_t *chosen, int threads) {
    if (m == 0) return 0; /* nothing to choose (chosen may be NULL) */
    if (chosen == NULL) return -1;
    return pair_linear(x, xs, m, packed, n, k, bias, NULL, 0, threads, chosen, 0);
}

/* A greedy lm_head screened in int8 first (linear_bf16_argmax_screened): the same choice as
 * linear_bf16_argmax, exactly, for about half its arithmetic on a peaked distribution such as a chat
 * model's logits.
 *
 * Each output is first bounded, not computed: x's 16 pairs of the call with the largest magnitudes
 * (a model's outlier channels) times their weights in bf16 as VDPBF16PS adds them, plus the other
 * channels in int8 (x per row and the weight per column scaled to +-127; VPDPBUSD, four products an
 * element, twice VDPBF16PS's rate), and a bound on how far that lies from the kernel's fp32 chain:
 *     |v - a| <= |x_in| e + |r_x| m + 2 gamma |x| |w|   (times 1 + 2^-10, + |a| 2^-16 + 1e-30)
 * where x_in is x without those pairs, r_x its rounding to int8, e and m the norms of the column's
 * rounding and rounded weight (Cauchy-Schwarz on the two roundings), gamma = K 2^-24 the chain's own
 * rounding (and the approximation's), the rest the fp32 arithmetic of the bound. A row keeps the
 * largest lower bound L seen; a group of columns whose upper bounds all lie at or below the bf16 just
 * under bf16_down(L) cannot hold the row's largest bf16 output nor a tie with it (the column of L
 * rounds to at least bf16_down(L)), so only the other groups run the exact tile for that row and fold
 * its outputs as linear_bf16_argmax does. The choice is the first column of the largest output among
 * the columns computed, which hold every column of that largest value: the same index, bits for bits,
 * at any batch (the call's rows and its choice of pairs decide only how much runs exactly).
 * Where x or the bias is not finite, or x large enough that a bound could overflow, the call is
 * linear_bf16_argmax; denormals are read as zero, as VDPBF16PS reads them, and the bounds' fp32
 * arithmetic runs under its own MXCSR (to nearest, denormals kept), whatever the caller's.
 *
 * The weight comes twice: pair-packed (for the exact tiles and the 16 pairs) and as quads: per panel
 * of 16 columns, K / 4 vectors of 64 bytes, column c's four weights (q + 128, q in [-127, 127]) at
 * bytes 4c..4c+3; stats [4][panels * 16] fp32: per column the scale s (q = round(w / s)), e, m and
 * |w|, each rounded up (batchapi/kernels/cpu/matmul.py's pack_screen). x's quads go signed, the
 * weights unsigned: the sum of (q + 128) xq less 128 times the row's sum of xq. */
#if defined(HAVE_AVX512BF16) && defined(__AVX512VNNI__)
#define HAVE_SCREEN 1
#define SCREEN_PAIRS 16

/* a row of the call as the screen sees it */
typedef struct {
    float t;     /* x_in's scale: max |x_in| / 127 */
    int32_t sum; /* the sum of its int8 values */
    float x_in, r_x, g_x; /* |x_in|, |x_in - t xq|, 2 gamma |x|: rounded up */
} ScreenRow;

/* what a screen tile needs besides its rows */
typedef struct {
    const int8_t *xq;      /* x_in in int8 (the 16 pairs 0), by tiles of 8 rows: [m / 8][k / 4][8][4] */
    const uint32_t *xo;    /* [m][SCREEN_PAIRS]: x's 16 pairs as they are */
    const ScreenRow *rows; /* [m] */
    const int32_t *pairs;  /* the 16 pairs' indices */
    const uint16_t *x;     /* the call's x, for the exact tiles */
    int64_t xs, k, pstride, npad;
    const uint32_t *packed; /* pair-packed weight */
    const float *stats, *bias;
    int64_t n;
    float *floor, *below;   /* this thread's [m]: each row's largest lower bound, and the bf16 under it */
    int32_t *kept, *held;   /* this thread's [m][SCREEN_KEEP] groups that may hold the row's choice; [m] */
    float *kept_upper;      /* [m][SCREEN_KEEP]: their largest upper bounds */
    Best mine;              /* this thread's choices */
    int64_t exact;          /* this thread's exact (row, group) tiles */
} Screen;

/* A row's groups that may hold its choice wait in a list (in order of columns) until the thread's
 * groups are all bounded, then only those above the largest lower bound of all threads run exactly:
 * bounded in order, a row's floor rises slowly (at 256 rows of SmolLM2, 160 of 1,024 groups a row
 * clear the running floor; 15 the final one). A full list drops what its floor has passed, else
 * runs them. */
#define SCREEN_KEEP 128

/* row r's group g exactly, folded into its choice */
static void screen_exact(Screen *sc, int64_t r, int64_t g) {
    const int64_t p0 = g * PAIR_TILE_PANELS, panels = sc->npad / PANEL;
    const int np = (int)(panels - p0 < PAIR_TILE_PANELS ? panels - p0 : PAIR_TILE_PANELS);
    sc->exact++;
    const Best row_best = best_at(sc->mine, r);
    PAIR_TILES_BY[np][1](sc->x + r * sc->xs, sc->xs, sc->packed + p0 * sc->pstride, sc->k, sc->pstride,
                         sc->bias ? sc->bias + p0 * PANEL : NULL, NULL, 0, (int)(sc->n - p0 * PANEL), NULL,
                         &row_best, p0 * PANEL);
}

/* row r's kept groups whose upper bound lies above `below` run exactly, in order; the list empties */
static void screen_run(Screen *sc, int64_t r, float below) {
    const int32_t *kept = sc->kept + r * SCREEN_KEEP;
    const float *upper = sc->kept_upper + r * SCREEN_KEEP;
    for (int i = 0; i < sc->held[r]; i++)
        if (upper[i] > below) screen_exact(sc, r, kept[i]);
    sc->held[r] = 0;
}

/* group g kept for row r, whose upper bound is `upper` */
static void screen_keep(Screen *sc, int64_t r, int64_t g, float upper) {
    int32_t *kept = sc->kept + r * SCREEN_KEEP;
    float *uppers = sc->kept_upper + r * SCREEN_KEEP;
    if (sc->held[r] == SCREEN_KEEP) { /* full: drop what the floor has passed since */
        int held = 0;
        for (int i = 0; i < SCREEN_KEEP; i++)
            if (uppers[i] > sc->below[r]) kept[held] = kept[i], uppers[held++] = uppers[i];
        sc->held[r] = held;
        if (held == SCREEN_KEEP) screen_run(sc, r, -INFINITY);
    }
    kept[sc->held[r]] = (int32_t)g, uppers[sc->held[r]++] = upper;
}

/* the largest bf16 value strictly below bf16_down(f) (rounded towards -inf), or -inf: a column whose
 * upper bound is at most this rounds below the one whose lower bound is f */
static float bf16_below(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f == -INFINITY || f != f) return -INFINITY;
    if (bits & 0xffffu) bits = (bits & 0x80000000u) ? (bits & 0xffff0000u) + 0x10000u : bits & 0xffff0000u;
    float down;
    memcpy(&down, &bits, sizeof down);
    if (fabsf(down) < 1.17549435e-38f) /* 0 or a denormal, which rounding flushes to 0: the largest */
        return -1.17549435e-38f;        /* negative normal, which stays below it */
    bits += (bits & 0x80000000u) ? 0x10000u : (uint32_t)-0x10000;
    if ((bits & 0x7fffffffu) > 0x7f800000u) return -INFINITY;
    memcpy(&down, &bits, sizeof down);
    return down;
}

/* VPDPBUSD: the panel's quad vector (unsigned) times row x's quad broadcast from memory (signed) */
#define DQ1(acc, wv, at) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(wv), "m"(*(at)))
#define QUAD_ROWS(NP, AT) ROWS_STEP(DQ1, q, NP, AT)
#define QUAD_IN_ROW(r) ((const int32_t *)(xq + 32 * i + 4 * (r)))
#define PAIR_OUT_ROW(r) (sc->xo + (r0 + (r)) * SCREEN_PAIRS + o)
#define QACC_ROW(r) __m512i q##r##0 = _mm512_setzero_si512(), q##r##1 = q##r##0, q##r##2 = q##r##0;
/* row r's int8 sums as fp32 approximations t s (sum - 128 sum_xq), into a_r0..a_r2 */
#define QACC_SCALE(r, NP)                                                                                        \
    __m512 a##r##0 = s0, a##r##1 = s0, a##r##2 = s0;                                                          \
    if (r < mr) {                                                                                             \
        const ScreenRow *row_ = sc->rows + r0 + r;                                                            \
        const __m512i off_ = _mm512_set1_epi32(128 * row_->sum);                                              \
        const __m512 t_ = _mm512_set1_ps(row_->t);                                                            \
        a##r##0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q##r##0, off_)), s0), t_);  \
        if (NP > 1) a##r##1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q##r##1, off_)), s1), t_); \
        if (NP > 2) a##r##2 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q##r##2, off_)), s2), t_); \
    }
#define SCREEN_OUT(r)                                                                                          \
    if (r < mr) acc[r][0] = a##r##0, acc[r][1] = a##r##1, acc[r][2] = a##r##2;

/* One tile of MR rows (r0..) by NP panels (p0..): bounds, then the exact tile for each row whose
 * group may hold its choice. quads: the group's first panel's quads; cols: live columns from p0. */
#define SCREEN_TILE(MR, NP)                                                                                    \
    static void screen_tile_##MR##_##NP(Screen *sc, int64_t r0, int64_t p0, const uint8_t *quads, int cols,   \
                                        const uint8_t *next, int64_t next_p0) {                               \
        const int mr = MR;                                                                                    \
        const int64_t qstride = sc->k * PANEL; /* bytes a panel of quads */                                   \
        const int8_t *xq = sc->xq + r0 * sc->k; /* the tile's rows, quad by quad (screen_row) */                  \
        if (next) /* the next group's 16 pairs too: lines apart, which no prefetcher foresees */              \
            for (int o = 0; o < SCREEN_PAIRS; o++)                                                            \
                _Pragma("GCC unroll 3") for (int p = 0; p < PAIR_TILE_PANELS; p++)                             \
                    _mm_prefetch((const char *)(sc->packed + (next_p0 + p) * sc->pstride                        \
                                                + (int64_t)sc->pairs[o] * PANEL), _MM_HINT_T1);                \
        QACC_ROW(0) QACC_ROW(1) QACC_ROW(2) QACC_ROW(3) QACC_ROW(4) QACC_ROW(5) QACC_ROW(6) QACC_ROW(7)       \
        for (int64_t i = 0; i < sc->k / 4; i++) {                                                             \
            const __m512i w0 = _mm512_loadu_si512(quads + i * 64);                                            \
            const __m512i w1 = NP > 1 ? _mm512_loadu_si512(quads + qstride + i * 64) : w0;                    \
            const __m512i w2 = NP > 2 ? _mm512_loadu_si512(quads + 2 * qstride + i * 64) : w0;                \
            if (next)                                                                                         \
                _Pragma("GCC unroll 3") for (int p = 0; p < PAIR_TILE_PANELS; p++)                             \
                    _mm_prefetch((const char *)(next + p * qstride + i * 64), _MM_HINT_T1);                   \
            QUAD_ROWS(NP, QUAD_IN_ROW)                                                                         \
        }                                                                                                     \
        const float *scale = sc->stats + p0 * PANEL;                                                          \
        const __m512 s0 = _mm512_loadu_ps(scale), s1 = NP > 1 ? _mm512_loadu_ps(scale + PANEL) : s0;          \
        const __m512 s2 = NP > 2 ? _mm512_loadu_ps(scale + 2 * PANEL) : s0;                                   \
        QACC_SCALE(0, NP) QACC_SCALE(1, NP) QACC_SCALE(2, NP) QACC_SCALE(3, NP)                                         \
        QACC_SCALE(4, NP) QACC_SCALE(5, NP) QACC_SCALE(6, NP) QACC_SCALE(7, NP)                                         \
        for (int o = 0; o < SCREEN_PAIRS; o++) { /* the 16 pairs, as the exact chain multiplies them */       \
            const uint32_t *w = sc->packed + p0 * sc->pstride + (int64_t)sc->pairs[o] * PANEL;                \
            const __m512 w0 = _mm512_loadu_ps(w);                                                             \
            const __m512 w1 = NP > 1 ? _mm512_loadu_ps(w + sc->pstride) : w0;                                 \
            const __m512 w2 = NP > 2 ? _mm512_loadu_ps(w + 2 * sc->pstride) : w0;                             \
            ROWS_STEP(DP1, a, NP, PAIR_OUT_ROW)                                                               \
        }                                                                                                     \
        __m512 acc[MR][PAIR_TILE_PANELS];                                                                     \
        SCREEN_OUT(0) SCREEN_OUT(1) SCREEN_OUT(2) SCREEN_OUT(3)                                               \
        SCREEN_OUT(4) SCREEN_OUT(5) SCREEN_OUT(6) SCREEN_OUT(7)                                               \
        screen_rows(sc, r0, MR, p0, NP, cols, acc);                                                           \
    }

/* the bounds of a tile's approximations acc[rows][np]: each row's floor raised, and the group kept for
 * each row whose choice it may hold */
static inline void screen_rows(Screen *sc, int64_t r0, int rows, int64_t p0, int np, int cols,
                               __m512 (*acc)[PAIR_TILE_PANELS]) {
    const int64_t c0 = p0 * PANEL;
    __m512 e[PAIR_TILE_PANELS], m[PAIR_TILE_PANELS], n[PAIR_TILE_PANELS], b[PAIR_TILE_PANELS], tiny[PAIR_TILE_PANELS];
    __mmask16 live[PAIR_TILE_PANELS];
    for (int p = 0; p < np; p++) {
        e[p] = _mm512_loadu_ps(sc->stats + sc->npad + c0 + p * PANEL);
        m[p] = _mm512_loadu_ps(sc->stats + 2 * sc->npad + c0 + p * PANEL);
        n[p] = _mm512_loadu_ps(sc->stats + 3 * sc->npad + c0 + p * PANEL);
        b[p] = sc->bias ? _mm512_loadu_ps(sc->bias + c0 + p * PANEL) : _mm512_setzero_ps();
        tiny[p] = _mm512_fmadd_ps(_mm512_abs_ps(b[p]), _mm512_set1_ps(0x1p-16f), _mm512_set1_ps(1e-30f)); /* b's rounding */
        const int c = cols - p * PANEL;
        live[p] = (__mmask16)(c >= PANEL ? 0xffff : c > 0 ? (1u << c) - 1 : 0);
    }
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < rows; r++) {
        const ScreenRow *row = sc->rows + r0 + r;
        const __m512 x_in = _mm512_set1_ps(row->x_in), r_x = _mm512_set1_ps(row->r_x);
        const __m512 g_x = _mm512_set1_ps(row->g_x);
        __m512 upper = minus_inf, lower = minus_inf;
        for (int p = 0; p < np; p++) {
            const __m512 a = _mm512_add_ps(acc[r][p], b[p]);
            const __m512 bound = _mm512_fmadd_ps(x_in, e[p], _mm512_fmadd_ps(r_x, m[p], _mm512_fmadd_ps(g_x, n[p], tiny[p])));
            upper = _mm512_mask_max_ps(upper, live[p], upper, _mm512_add_ps(a, bound));
            lower = _mm512_mask_max_ps(lower, live[p], lower, _mm512_sub_ps(a, bound));
        }
        float *floor = sc->floor + r0 + r, *below = sc->below + r0 + r;
        if (_mm512_cmp_ps_mask(lower, _mm512_set1_ps(*floor), _CMP_GT_OQ)) {
            *floor = _mm512_reduce_max_ps(lower);
            *below = bf16_below(*floor);
        }
        if (_mm512_cmp_ps_mask(upper, _mm512_set1_ps(*below), _CMP_GT_OQ))
            screen_keep(sc, r0 + r, p0 / PAIR_TILE_PANELS, _mm512_reduce_max_ps(upper));
    }
}

TILES_OF(SCREEN_TILE, 1)
TILES_OF(SCREEN_TILE, 2)
TILES_OF(SCREEN_TILE, 3)

typedef void (*screen_tile_fn)(Screen *, int64_t, int64_t, const uint8_t *, int, const uint8_t *, int64_t);
static const screen_tile_fn SCREEN_TILES_BY[PAIR_TILE_PANELS + 1][PAIR_TILE_ROWS + 1] = TILE_TABLE(screen_tile);

/* x's SCREEN_PAIRS pairs of the largest magnitude over the call's rows (the first of equals), in order */
static void screen_pairs(const uint16_t *x, int64_t xs, int64_t m, int64_t k, int32_t *pairs, float *most) {
    const int64_t np = k / 2;
    for (int64_t i = 0; i < np; i++) most[i] = 0.0f;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < np; i++) {
            const float a = fabsf(bf16_to_f32(x[r * xs + 2 * i])), b = fabsf(bf16_to_f32(x[r * xs + 2 * i + 1]));
            const float big = a > b ? a : b;
            if (big > most[i]) most[i] = big;
        }
    for (int o = 0; o < SCREEN_PAIRS; o++) {
        int64_t top = -1;
        for (int64_t i = 0; i < np; i++)
            if (most[i] >= 0.0f && (top < 0 || most[i] > most[top])) top = i;
        pairs[o] = (int32_t)top;
        most[top] = -1.0f; /* taken */
    }
    for (int o = 1; o < SCREEN_PAIRS; o++) /* in order of K, as they lie in the weight */
        for (int j = o; j > 0 && pairs[j - 1] > pairs[j]; j--) {
            const int32_t t = pairs[j];
            pairs[j] = pairs[j - 1], pairs[j - 1] = t;
        }
}

/* row r of x as the screen sees it; 0 where it is not finite or large enough that a bound could
 * overflow (|x| times the largest |w| of a column beyond 1e30) */
static int screen_row(const uint16_t *xr, int64_t k, const int32_t *pairs, const char *taken, float w_norm,
                      int8_t *xq, uint32_t *xo, ScreenRow *row) { /* xq: the row's first quad; the next 32 on */
    double all = 0.0, in = 0.0, rounded = 0.0;
    float most = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float v = flush(bf16_to_f32(xr[i])); /* as VDPBF16PS reads it */
        all += (double)v * v;
        if (!taken[i / 2] && fabsf(v) > most) most = fabsf(v);
    }
    if (!(all <= 1e60) || !(sqrt(all) * w_norm <= 1e30)) return 0; /* NaN fails too */
    const float t = most / 127.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < k; i++) {
        const float v = flush(bf16_to_f32(xr[i]));
        int q = 0;
        if (!taken[i / 2]) {
            if (t > 0.0f) q = (int)rintf(v / t);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            in += (double)v * v;
            const double d = (double)v - (double)t * q;
            rounded += d * d;
        }
        xq[i / 4 * 32 + i % 4] = (int8_t)q;
        sum += q;
    }
    for (int o = 0; o < SCREEN_PAIRS; o++) xo[o] = pair_at(xr + 2 * pairs[o], 0);
    /* rounded up, with room for the fp32 arithmetic of a and its bound (2^-10 of the bound), and for the
     * bias's rounding and a's own (|a| 2^-16, where |a| <= |x| |w| + the bound) */
    const double up = 1.0 + 0x1p-10, gamma = (double)k * 0x1p-24 / (1.0 - (double)k * 0x1p-24);
    *row = (ScreenRow){t, sum, (float)(sqrt(in) * up * (1.0 + 0x1p-16)), (float)(sqrt(rounded) * up * (1.0 + 0x1p-16)),
                       (float)((2.0 * gamma + 0x1p-16) * sqrt(all) * up * (1.0 + 0x1p-16))};
    return 1;
}
#endif

/* 1 where this build screens (AVX512-BF16 and AVX512-VNNI), else 0 */
int linear_bf16_screen_native(void) {
#ifdef HAVE_SCREEN
    return 1;
#else
    return 0;
#endif
}

/* linear_bf16_argmax's choices, screened in int8 (above); `exact` (if not NULL) gets how many (row,
 * group of 3 panels) tiles ran exactly, of m times the groups. K a multiple of 4 of at least
 * 2 SCREEN_PAIRS; w_norm the largest |w| of a column (its norm). Where the build has no screen, or the
 * instructions are the FMA form, it is linear_bf16_argmax. */
static int screened_argmax(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n, int64_t k,
                           const float *bias, const uint8_t *quads, const float *stats, float w_norm,
                           int64_t *chosen, int64_t *exact, int threads);

int linear_bf16_argmax_screened(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n,
                                int64_t k, const float *bias, const uint8_t *quads, const float *stats,
                                float w_norm, int64_t *chosen, int64_t *exact, int threads) {
#ifdef HAVE_SCREEN
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(0x1F80u); /* the bounds' arithmetic as written whatever the caller's: to nearest, denormals kept */
    const int rc = screened_argmax(x, xs, m, packed, n, k, bias, quads, stats, w_norm, chosen, exact, threads);
    _mm_setcsr(csr);
    return rc;
#else
    return screened_argmax(x, xs, m, packed, n, k, bias, quads, stats, w_norm, chosen, exact, threads);
#endif
}

static int screened_argmax(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n, int64_t k,
                           const float *bias, const uint8_t *quads, const float *stats, float w_norm,
                           int64_t *chosen, int64_t *exact, int threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, groups = (panels + PAIR_TILE_PANELS - 1) / PAIR_TILE_PANELS;
    if (exact) *exact = m * groups;
    if (m == 0) return 0;
    if (chosen == NULL || m < 0 || n < 0 || k < 0 || xs < k) return -1;
#ifdef HAVE_SCREEN
    int finite_bias = 1; /* a NaN or infinite bias would make its column's bounds NaN */
    for (int64_t j = 0; bias && j < n; j++) finite_bias &= isfinite(bias[j]) != 0;
    if (k % 4 || k < 2 * SCREEN_PAIRS || !finite_bias || __atomic_load_n(&pair_fma, __ATOMIC_RELAXED))
        return pair_linear(x, xs, m, packed, n, k, bias, NULL, 0, threads, chosen, 0);
    const int64_t pstride = (k + 1) / 2 * PANEL;
    int parallel = threads > 1 && m * n * k >= (1 << 19) && groups > 1, team = parallel ? threads : 1;
    int32_t pairs[SCREEN_PAIRS];
    int8_t *xq = malloc((size_t)((m + 7) / 8 * 8 * k));
    uint32_t *xo = malloc((size_t)m * SCREEN_PAIRS * sizeof *xo);
    ScreenRow *rows = malloc((size_t)m * sizeof *rows);
    float *bounds = malloc((size_t)(2 * team * m + k) * sizeof *bounds); /* floors, belows; the pairs' most */
    int32_t *kept = malloc((size_t)team * m * (SCREEN_KEEP + 1) * sizeof *kept);
    float *kept_upper = malloc((size_t)team * m * SCREEN_KEEP * sizeof *kept_upper);
    char *taken = calloc((size_t)(k / 2), 1);
    float *values = NULL;
    int64_t *columns = NULL, total = 0;
    int finite = 1;
    if (!xq || !xo || !rows || !bounds || !taken || !kept || !kept_upper || !best_start(team, m, &values, &columns)) {
        free(xq), free(xo), free(rows), free(bounds), free(taken), free(kept), free(kept_upper);
        return -1;
    }
    screen_pairs(x, xs, m, k, pairs, bounds + 2 * team * m);
    for (int o = 0; o < SCREEN_PAIRS; o++) taken[pairs[o]] = 1;
    for (int64_t r = 0; r < m && finite; r++)
        finite = screen_row(x + r * xs, k, pairs, taken, w_norm, xq + r / 8 * 8 * k + r % 8 * 4, xo + r * SCREEN_PAIRS,
                            rows + r);
    for (int64_t i = 0; i < 2 * team * m; i++) bounds[i] = -INFINITY; /* no floor yet: every group runs */
    if (finite) {
#pragma omp parallel num_threads(team) if (parallel) reduction(+ : total)
        {
            const int t = thread_index(), dealt = team_size(); /* OpenMP may start fewer than asked */
            const unsigned csr = _mm_getcsr();
            _mm_setcsr(0x1F80u); /* each thread's own MXCSR, as on the caller's */
            const Best mine = best_of(t, team, m, values, columns);
            Screen sc = {xq, xo, rows, pairs, x, xs, k, pstride, panels * PANEL, packed, stats, bias, n,
                         bounds + t * m, bounds + team * m + t * m, kept + t * m * SCREEN_KEEP,
                         kept + team * m * SCREEN_KEEP + t * m, kept_upper + t * m * SCREEN_KEEP, mine, 0};
            for (int64_t r = 0; r < m; r++) sc.held[r] = 0;
            for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
                const int64_t m1 = m0 + CHUNK_ROWS < m ? m0 + CHUNK_ROWS : m;
                /* the groups dealt in turn, so that each thread meets the common tokens (the low ids) early
                 * and its floors rise soon */
                for (int64_t g = t; g < groups; g += dealt) {
                    const int64_t p0 = g * PAIR_TILE_PANELS;
                    const int np = (int)(panels - p0 < PAIR_TILE_PANELS ? panels - p0 : PAIR_TILE_PANELS);
                    const int cols = (int)(n - p0 * PANEL);
                    const int ahead = g + dealt < groups && panels - (g + dealt) * PAIR_TILE_PANELS >= PAIR_TILE_PANELS;
                    const uint8_t *group = quads + p0 * k * PANEL;
                    for (int64_t r = m0; r < m1; r += PAIR_TILE_ROWS) {
                        const int rows_ = (int)(m1 - r < PAIR_TILE_ROWS ? m1 - r : PAIR_TILE_ROWS);
                        const uint8_t *next = r == m0 && ahead ? quads + (g + dealt) * PAIR_TILE_PANELS * k * PANEL : NULL;
                        SCREEN_TILES_BY[np][rows_](&sc, r, p0, group, cols, next, (g + dealt) * PAIR_TILE_PANELS);
                    }
                }
            }
#pragma omp barrier
            for (int64_t r = 0; r < m; r++) { /* every thread's floor known: what may hold the row's choice */
                float floor = -INFINITY;
                for (int u = 0; u < team; u++) floor = bounds[u * m + r] > floor ? bounds[u * m + r] : floor;
                screen_run(&sc, r, bf16_below(floor));
            }
            total += sc.exact;
            _mm_setcsr(csr);
        }
    }
    free(xq), free(xo), free(rows), free(bounds), free(taken), free(kept), free(kept_upper);
    if (!finite) {
        free(values), free(columns);
        return pair_linear(x, xs, m, packed, n, k, bias, NULL, 0, threads, chosen, 0);
    }
    best_finish(team, m, values, columns, chosen);
    if (exact) *exact = total;
    return 0;
#else
    (void)quads, (void)stats, (void)w_norm;
    return pair_linear(x, xs, m, packed, n, k, bias, NULL, 0, threads, chosen, 0);
#endif
}

/* The same layer on AMX tiles (TDPBF16PS), the same pair-packed weight: a packed panel's 16 pairs
 * [16][16] are one B tile as they lie (a row of 64 bytes a pair index), 16 rows of x at 32 K
 * elements an A tile. Tiles of 32 rows by 2 panels (four 16x16 fp32 accumulator tiles, two A, two B:
 * all eight tile registers); every row of a call against a group of two panels before the next, so
 * each weight is read from memory once a call; groups split between the threads. K must be a
 * multiple of 32 (no tail tile). Batch invariant by construction: each output is the chain of
 * TDPBF16PS over K in chunks of 32 in order from a zero tile, + bias in fp32, rounded to bf16; a
 * tile's rows are computed independently of each other (a row's sums never read another row), so
 * the last rows of a call (under 32) run in a thread's buffer of 32 rows whose other rows are left
 * from earlier calls and never stored, and a row's bits depend on nothing but its own values.
 * Linux hands a process AMX's tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(HAVE_AVX512BF16)
#define HAVE_AMX 1
#define AMX_ROWS 32
#define AMX_L1_WEIGHTS (40 << 10) /* a group's weights (2 panels x K bf16) that L1 (48 KB) keeps beside x's lines */
#define AMX_AHEAD 2       /* K steps ahead whose weights a group's first row tile asks for (see amx_tile) */
#define AMX_AHEAD_TILES 4 /* ... in calls of up to this many row tiles (128 rows) */
#define AMX_PARALLEL_WEIGHTS (128 << 10) /* elements (256 KB): a weight both threads stream, whatever the rows */

/* this thread's buffer of AMX_ROWS rows of at least k elements, kept across calls (NULL: no memory) */
static uint16_t *amx_tail_rows(int64_t k) {
    static _Thread_local uint16_t *rows = NULL;
    static _Thread_local int64_t held = 0;
    if (held < k) {
        uint16_t *grown = calloc((size_t)AMX_ROWS * k, sizeof *grown);
        if (grown == NULL) return NULL;
        free(rows);
        rows = grown;
        held = k;
    }
    return rows;
}

static void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* the tile's rows' outputs (fp32 sums) folded into `best` at the tile's first row, `col0` the
 * group's first column */
INLINE void fold_best(float (*acc)[2 * PANEL], const float *bias, int rows, int cols, int64_t col0, Best best) {
    for (int r = 0; r < rows; r++) {
        __m512 v[2] = {_mm512_load_ps(&acc[r][0]), _mm512_load_ps(&acc[r][PANEL])};
        if (bias)
            v[0] = _mm512_add_ps(v[0], _mm512_loadu_ps(bias)), v[1] = _mm512_add_ps(v[1], _mm512_loadu_ps(bias + PANEL));
        fold_panels(v, 2, cols, col0, best_at(best, r));
    }
}

/* rows [0, 32) of x (stride xs) against panels p0 and p1 (p1 == p0: one panel), rows < `rows` stored
 * in y, or with best.value set folded into it instead (col0: the group's first column). The weights
 * come from memory by the hardware's prefetchers, which follow each thread's groups in order (one run
 * of memory). A software prefetch of the next group (into L2, spread over this one's K steps) held a
 * fill buffer of the 16 a core has until its line came, the same buffers x's tile loads from L2 need:
 * a decode step at 96-160 sequences ran 1.05-1.10x longer with it. (On the Xeon measured, a core's
 * stream from memory does not run under its tiles at all: the two times add up; docs/BENCHMARKS.md.)
 * `ahead`: the group's weights come from memory here (its first row tile, in a call of up to
 * AMX_AHEAD_TILES), and the step AMX_AHEAD on is asked for into L1 as each step's tiles load: a tile
 * load waits for all 16 of its lines and its register for the step before's products, so the stream
 * otherwise stalls at every step. A decode step of SmolLM2 at 1 / 32 / 96 sequences 0.97 / 0.94 /
 * 0.97x as long with it (steps taking turns with and without, on the Xeon AMX model 167); at 192 and
 * 256 rows, where the products bound the call, 1.01-1.02x: not there.
 * `stream`: x's tiles loaded as data not to be kept in L1 (TILELOADDT1), so that the group's weights,
 * which the next row tiles load again, stay there.
 * `silu`: p0 a gate panel and p1 its up panel; what goes to y is silu(gate) * up, as silu_and_mul
 * (elementwise.c) computes it on the outputs rounded to bf16: `cols` (<= 16) columns a row */
static inline __attribute__((always_inline)) void amx_tile(const uint16_t *x, int64_t xs, const uint32_t *b0,
                                                             const uint32_t *b1, int64_t k, const float *bias,
                                                             uint16_t *y, int64_t ys, int rows, int cols, Best best,
                                                             int64_t col0, int ahead, const int stream,
                                                             const int silu) {
    float acc[AMX_ROWS][2 * PANEL] __attribute__((aligned(64)));
    const int64_t ahead_to = ahead ? k - AMX_AHEAD * 32 : 0; /* the K steps whose step AMX_AHEAD on is asked for */
    const int upper = rows > 16; /* rows 16-31 have a row to store: their tiles run (a row's sums are its own) */
    _tile_zero(0);
    _tile_zero(1);
    if (upper) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kc = 0; kc < k; kc += 32) {
        if (stream) {
            _tile_stream_loadd(4, x + kc, xs * 2);
            if (upper) _tile_stream_loadd(5, x + 16 * xs + kc, xs * 2);
        } else {
            _tile_loadd(4, x + kc, xs * 2);
            if (upper) _tile_loadd(5, x + 16 * xs + kc, xs * 2);
        }
        if (kc < ahead_to) {
            const char *a0 = (const char *)(b0 + (kc / 2 + AMX_AHEAD * 16) * PANEL);
            const char *a1 = (const char *)(b1 + (kc / 2 + AMX_AHEAD * 16) * PANEL);
            for (int i = 0; i < 16 * PANEL * 4; i += 64) _mm_prefetch(a0 + i, _MM_HINT_T0), _mm_prefetch(a1 + i, _MM_HINT_T0);
        }
        _tile_loadd(6, b0 + kc / 2 * PANEL, 64);
        _tile_loadd(7, b1 + kc / 2 * PANEL, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (upper) {
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, &acc[0][0], sizeof acc[0]);
    _tile_stored(1, &acc[0][PANEL], sizeof acc[0]);
    if (upper) {
        _tile_stored(2, &acc[16][0], sizeof acc[0]);
        _tile_stored(3, &acc[16][PANEL], sizeof acc[0]);
    }
    if (best.value) {
        fold_best(acc, bias, rows, cols, col0, best);
        return;
    }
    if (silu) { /* the outputs as stored (bf16), widened, through silu_and_mul's arithmetic */
        const __mmask16 live = (__mmask16)(cols >= PANEL ? 0xffff : (1u << cols) - 1);
        for (int r = 0; r < rows; r++)
            store_silu16(_mm512_load_ps(&acc[r][0]), _mm512_load_ps(&acc[r][PANEL]), y + r * ys, live);
        return;
    }
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < 2; p++) {
            int c = cols - p * PANEL;
            if (c <= 0) break;
            __m512 v = _mm512_load_ps(&acc[r][p * PANEL]);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p * PANEL));
            __m256i out = (__m256i)_mm512_cvtneps_pbh(v);
            _mm256_mask_storeu_epi16(y + r * ys + p * PANEL, (__mmask16)(c >= PANEL ? 0xffff : (1u << c) - 1), out);
        }
}

/* amx_tile with x kept in L1 and with x streamed past it, each with and without SiLU, compiled for
 * its case */
typedef void (*amx_tile_fn)(const uint16_t *, int64_t, const uint32_t *, const uint32_t *, int64_t, const float *,
                            uint16_t *, int64_t, int, int, Best, int64_t, int);
#define AMX_TILE_AS(NAME, STREAM, SILU)                                                                       \
    static void NAME(const uint16_t *x, int64_t xs, const uint32_t *b0, const uint32_t *b1, int64_t k,        \
                     const float *bias, uint16_t *y, int64_t ys, int rows, int cols, Best best, int64_t col0, \
                     int ahead) {                                                                             \
        amx_tile(x, xs, b0, b1, k, bias, y, ys, rows, cols, best, col0, ahead, STREAM, SILU);                 \
    }
AMX_TILE_AS(amx_tile_kept, 0, 0)
AMX_TILE_AS(amx_tile_streamed, 1, 0)
AMX_TILE_AS(amx_tile_kept_silu, 0, 1)
AMX_TILE_AS(amx_tile_streamed_silu, 1, 1)
#endif

/* 1 where this build and the kernel may use AMX tiles (built for them, and the OS grants them) */
int linear_amx_native(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

#ifdef HAVE_AMX
/* linear_amx's work: outputs into y, or (chosen != NULL) each row's greedy choice into chosen[m], or
 * (silu) silu(gate) * up into y for a weight [gate; up], each half whole panels: a group is then gate
 * panel g and up panel g (half the panels on) */
static int amx_linear(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n, int64_t k,
                      const float *bias, uint16_t *y, int64_t ys, int threads, int64_t *chosen, int silu) {
    if (m < 0 || n < 0 || k < 0 || xs < k || (!chosen && ys < (silu ? n / 2 : n)) || k % 32 || !amx_permitted())
        return -1;
    if (silu && (bias || chosen || n % (2 * PANEL))) return -1;
    int64_t panels = (n + PANEL - 1) / PANEL, pstride = k / 2 * PANEL, half = silu ? panels / 2 : 0;
    int64_t groups = silu ? half : (panels + 1) / 2;
    int64_t whole = m / AMX_ROWS * AMX_ROWS;
    /* both threads where the products are many, or the weight is large enough that streaming it on
     * both cores beats the region's start (SmolLM2's 576 x 576 o_proj at one row: a decode step of 1
     * sequence 0.96x as long so) */
    int parallel = threads > 1 && (m * n * k >= (1 << 19) || (m > 0 && n * k >= AMX_PARALLEL_WEIGHTS)) && groups > 1;
    /* x streamed past L1 where a group's weights fit there and more than two row tiles load them,
     * or two whole ones: SmolLM2's K-576 projections 1.2-1.5x at 256 rows with the weights in cache,
     * 1.2-1.3x at 1,024 rows with them in memory (a decode step's 256 rows, the weights from memory:
     * no change). A single row tile keeps x in L1 instead (every group reads it), and so do a row
     * tile and a short one: at 40-60 rows, the weights from memory, SmolLM2's gate_up, qkv and greedy
     * lm_head took 1.13-1.25x as long streamed, and a decode step of 40 or 48 sequences 1.05-1.07x;
     * at 64 rows streaming won (a step 0.96x). Weights of a larger K (its down projection) do not
     * fit: there, as loaded */
    const int64_t tiles = whole / AMX_ROWS + (whole < m), halfway = tiles / 2; /* row tiles; the last maybe short */
    const int streamed = (tiles >= 3 || (tiles == 2 && whole == m)) && k * 2 * PANEL * 2 <= AMX_L1_WEIGHTS;
    const amx_tile_fn tile = silu ? (streamed ? amx_tile_streamed_silu : amx_tile_kept_silu)
                                  : (streamed ? amx_tile_streamed : amx_tile_kept);
    int failed = 0, team = parallel ? (threads < MAX_TEAM ? threads : MAX_TEAM) : 1; /* Deal's most */
    /* the choice: each thread's best of its groups for every row, merged in the threads' order after */
    float *values = NULL;
    int64_t *columns = NULL;
    if (chosen && !best_start(team, m, &values, &columns)) return -1;
    /* the work in halves of groups (a group's first half of its row tiles, then the rest; whole groups
     * where there is one row tile), dealt in contiguous shares (common.h's Deal: a thread done with
     * its own takes the last units of another's): an odd number of groups (SmolLM2's o and down
     * projections have 9) splits evenly, and a thread that runs slower does fewer */
    const int64_t halves = tiles >= 2 ? 2 : 1;
    Deal deal;
    deal_even(&deal, team, halves * groups);
#pragma omp parallel num_threads(team) if (parallel) reduction(| : failed)
    {
        const int me = thread_index();
        const Best mine = chosen ? best_of(me, team, m, values, columns) : (Best){NULL, NULL, NULL};
        uint16_t *tail = NULL; /* the last rows (under 32) in a tile of their own, copied once for all groups */
        int configured = 0;
        int64_t claimed = 0, claim_end = 0; /* units taken from this thread's share, not yet run */
        while (!failed) {
            int64_t u;
            if (claimed < claim_end || deal_own(&deal, me, &claimed, &claim_end)) u = claimed++;
            else if ((u = deal_steal(&deal, me)) < 0) break;
            const int64_t g = u / halves, h = u % halves;
            const int64_t t0 = h ? halfway : 0, t1 = h || halves == 1 ? tiles : halfway;
            if (t0 == t1) continue;
            if (whole < m && t1 * AMX_ROWS > m && tail == NULL) {
                if ((tail = amx_tail_rows(k)) == NULL) {
                    failed = 1;
                    break;
                }
                for (int64_t r = whole; r < m; r++) memcpy(tail + (r - whole) * k, x + r * xs, (size_t)k * 2);
            }
            if (!configured) amx_configure(), configured = 1;
            int64_t p0 = silu ? g : 2 * g, p1 = silu ? g + half : p0 + 1 < panels ? p0 + 1 : p0;
            int cols = (int)(silu ? PANEL : n - p0 * PANEL < 2 * PANEL ? n - p0 * PANEL : 2 * PANEL);
            if (p1 == p0 && cols > PANEL) cols = PANEL;
            const uint32_t *b0 = packed + p0 * pstride, *b1 = packed + p1 * pstride;
            const float *gb = bias ? bias + p0 * PANEL : NULL;
            uint16_t *gy = chosen ? NULL : y + (silu ? g : p0) * PANEL; /* the group's first output column */
            for (int64_t i = t0; i < t1; i++) {
                const int64_t r = i * AMX_ROWS;
                const int short_tile = r + AMX_ROWS > m; /* the tail's copy */
                tile(short_tile ? tail : x + r * xs, short_tile ? k : xs, b0, b1, k, gb, gy ? gy + r * ys : NULL,
                     ys, (int)(short_tile ? m - r : AMX_ROWS), cols, best_at(mine, r), p0 * PANEL,
                     i == 0 && tiles <= AMX_AHEAD_TILES);
            }
        }
        if (configured) _tile_release();
    }
    if (chosen) best_finish(team, m, values, columns, chosen);
    return failed ? -1 : 0;
}
#endif

/* linear_bf16 on AMX tiles (arguments alike); -1 where the build or the OS has no AMX, or K % 32 */
int linear_amx(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n, int64_t k,
               const float *bias, uint16_t *y, int64_t ys, int threads) {
#ifdef HAVE_AMX
    return amx_linear(x, xs, m, packed, n, k, bias, y, ys, threads, NULL, 0);
#else
    (void)x, (void)xs, (void)m, (void)packed, (void)n, (void)k, (void)bias, (void)y, (void)ys, (void)threads;
    return -1;
#endif
}

/* silu(x W_gate^T) * (x W_up^T) into y [m, n / 2] (stride ys), for W = [W_gate; W_up] [n, k] packed as
 * linear_amx reads it (pack_pairs), each half whole panels (n a multiple of 32), no bias: the bits of
 * silu_and_mul (elementwise.c) on linear_amx's outputs, without them written and read back (an MLP's
 * gate_up at 256 rows is 1.5 MB of outputs for SmolLM2). -1 where the build or the OS has no AMX, or
 * the shapes are not these. */
int linear_amx_silu(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n, int64_t k,
                    const float *bias, uint16_t *y, int64_t ys, int threads) {
#ifdef HAVE_AMX
    return amx_linear(x, xs, m, packed, n, k, bias, y, ys, threads, NULL, 1);
#else
    (void)x, (void)xs, (void)m, (void)packed, (void)n, (void)k, (void)bias, (void)y, (void)ys, (void)threads;
    return -1;
#endif
}

/* argmax of linear_amx's bf16 outputs for each row, into chosen[m] (int64), without writing them: the
 * index torch.argmax gives on them (the first of ties; the first NaN where there is one). A greedy
 * step's lm_head: at 256 rows SmolLM2's 49,152 logits a row are 25 MB written and read back. */
int linear_amx_argmax(const uint16_t *x, int64_t xs, int64_t m, const uint32_t *packed, int64_t n, int64_t k,
                      const float *bias, int64_t *chosen, int threads) {
#ifdef HAVE_AMX
    if (m == 0 && k % 32 == 0 && amx_permitted()) return 0; /* nothing to choose (chosen may be NULL) */
    if (chosen == NULL) return -1;
    return amx_linear(x, xs, m, packed, n, k, bias, NULL, 0, threads, chosen, 0);
#else
    (void)x, (void)xs, (void)m, (void)packed, (void)n, (void)k, (void)bias, (void)chosen, (void)threads;
    return -1;
#endif
}
