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
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define PANEL 16
#define MAX_TILE 6
#define CHUNK_ROWS 96

#ifdef HAVE_AVX2
/* rows [0, MR) of the tile, one panel: x rows at stride xs, out rows at stride ys, `cols` <= 16 stored */
#define TILE_KERNEL(MR)                                                                                        \
    static void tile_##MR(const float *x, int64_t xs, const uint16_t *panel, int64_t k, const float *bias,     \
                          float *y, int64_t ys, int cols) {                                                   \
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
            memcpy(y + r * ys, tmp, (size_t)cols * sizeof(float));                                            \
        }                                                                                                     \
    }
#else
#define TILE_KERNEL(MR)                                                                                        \
    static void tile_##MR(const float *x, int64_t xs, const uint16_t *panel, int64_t k, const float *bias,     \
                          float *y, int64_t ys, int cols) {                                                   \
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
        for (int r = 0; r < MR; r++)                                                                          \
            for (int j = 0; j < cols; j++) y[r * ys + j] = acc[r][j] + (bias ? bias[j] : 0.0f);               \
    }
#endif

TILE_KERNEL(1)
TILE_KERNEL(2)
TILE_KERNEL(3)
TILE_KERNEL(4)
TILE_KERNEL(5)
TILE_KERNEL(6)

typedef void (*tile_fn)(const float *, int64_t, const uint16_t *, int64_t, const float *, float *, int64_t, int);
static const tile_fn TILES[MAX_TILE + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* y [m, n] (row stride ys) = x [m, k] (row stride xs) times the packed weight, plus bias [n] (or NULL).
 * The panels are split between `threads` threads in contiguous ranges; each walks the rows in chunks. */
int linear_bf16w(const float *x, int64_t xs, int64_t m, const uint16_t *packed, int64_t n, int64_t k,
                 const float *bias, float *y, int64_t ys, int threads) {
    if (m < 0 || n < 0 || k < 0 || xs < k || ys < n) return -1;
    int64_t panels = (n + PANEL - 1) / PANEL;
    /* a thread's share is whole panels; below ~1 MFLOP a call runs on one thread */
    int parallel = threads > 1 && m * n * k >= (1 << 19) && panels > 1;
#pragma omp parallel num_threads(threads) if (parallel)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        extern int omp_get_num_threads(void);
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        int64_t first = panels * t / nt, last = panels * (t + 1) / nt;
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
                    TILES[rows](x + r * xs, xs, panel, k, b, y + r * ys + p * PANEL, ys, cols);
                }
            }
        }
    }
    return 0;
}
