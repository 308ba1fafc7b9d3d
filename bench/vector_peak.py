"""The vector units' peak on this CPU: a loop of independent VDPBF16PS (where the CPU has AVX512-BF16),
of VPDPBUSD (int8, where it has AVX512-VNNI: the greedy lm_head's screen; on AVX2 alone the three
instructions that stand in for it) and of VFMADD231PS on
registers only (512-bit where the CPU has AVX-512, else 256-bit: AVX2's), 12 accumulators (more than
latency times throughput needs), on each of N threads at once. What the bf16 linear layers' kernel (kernels/cpu/csrc/matmul.c) can reach
at most; compare its GFLOP/s (engine_throughput.py's roofline line, kernels_cpu.py --op linear_bf16).

Usage: .venv/bin/python bench/vector_peak.py [--threads 2] [--seconds 1.5]
"""

import argparse
import subprocess
import tempfile
from pathlib import Path

from batchapi.kernels.cpu.build import _compiler

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define ACC 12
#define KEEP(a)                                                                                 \
    __asm__ volatile("" ::"v"(a[0]), "v"(a[1]), "v"(a[2]), "v"(a[3]), "v"(a[4]), "v"(a[5]), "v"(a[6]), "v"(a[7]), \
                     "v"(a[8]), "v"(a[9]), "v"(a[10]), "v"(a[11])) /* each sum kept, in its register */
#ifdef __AVX512F__
typedef __m512 vf; /* the widest float vector */
#define VF_SET1 _mm512_set1_ps
#define VF_FMA _mm512_fmadd_ps
#define VF_LANES 16
#else
typedef __m256 vf;
#define VF_SET1 _mm256_set1_ps
#define VF_FMA _mm256_fmadd_ps
#define VF_LANES 8
#endif
static double finish(const void *a, size_t bytes, double t, long n, int flops) {
    const double seconds = omp_get_wtime() - t;
    float sum = 0.0f, lanes[16 * ACC];
    memcpy(lanes, a, bytes);
    for (size_t j = 0; j < bytes / sizeof(float); j++) sum += lanes[j];
    if (sum == 1234.5f) puts("");
    return (double)n * ACC * flops / seconds / 1e9; /* FLOP: a product and a sum each */
}
static double fma_loop(long n) {
    vf a[ACC];
    for (int j = 0; j < ACC; j++) a[j] = VF_SET1(0.0f);
    const vf x = VF_SET1(1.0f), y = VF_SET1(1e-9f);
    const double t = omp_get_wtime();
    for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < ACC; j++) a[j] = VF_FMA(x, y, a[j]);
        KEEP(a);
    }
    return finish(a, sizeof a, t, n, 2 * VF_LANES);
}
#ifdef __AVX512BF16__
static double dpbf16_loop(long n) {
    __m512 a[ACC];
    for (int j = 0; j < ACC; j++) a[j] = _mm512_setzero_ps();
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3f80);
    const double t = omp_get_wtime();
    for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < ACC; j++) a[j] = _mm512_dpbf16_ps(a[j], x, y);
        KEEP(a);
    }
    return finish(a, sizeof a, t, n, 64);
}
#endif
#ifdef __AVX512VNNI__
static double dpbusd_loop(long n) { /* int8: 64 products a VPDPBUSD; "GFLOP" as 2 a product */
    __m512i q[ACC];
    for (int j = 0; j < ACC; j++) q[j] = _mm512_setzero_si512();
    const __m512i x = _mm512_set1_epi8(1);
    const double t = omp_get_wtime();
    for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < ACC; j++) q[j] = _mm512_dpbusd_epi32(q[j], x, x);
        KEEP(q);
    }
    const double seconds = omp_get_wtime() - t;
    long sum = 0;
    for (int j = 0; j < ACC; j++) sum += _mm512_reduce_add_epi32(q[j]);
    if (sum == 12345) puts("");
    return (double)n * ACC * 128 / seconds / 1e9;
}
#endif
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
/* int8 without VNNI: VPMADDUBSW (u8 x s8, pairs summed to s16), VPMADDWD by ones (to s32) and VPADDD, 32
 * products for the three, as an int8 screen would run them on AVX2 */
static double maddubs_loop(long n) {
    __m256i q[4], w[4]; /* the products depend on no sum: four sums are enough (one VPADDD a cycle each) */
    for (int j = 0; j < 4; j++) q[j] = _mm256_setzero_si256(), w[j] = _mm256_set1_epi8((char)(j + 1));
    const __m256i x = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    const double t = omp_get_wtime();
    for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < ACC; j++) {
            const __m256i p = _mm256_maddubs_epi16(x, w[j % 4]);
            __asm__ volatile("" : "+x"(w[j % 4])); /* w "changes": each product is made afresh */
            q[j % 4] = _mm256_add_epi32(q[j % 4], _mm256_madd_epi16(p, ones));
        }
    }
    const double seconds = omp_get_wtime() - t;
    int lanes[8 * 4];
    long sum = 0;
    memcpy(lanes, q, sizeof q);
    for (int j = 0; j < 8 * 4; j++) sum += lanes[j];
    if (sum == 12345) puts("");
    return (double)n * ACC * 64 / seconds / 1e9;
}
#endif
static double loop(int kind, long n) {
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
    if (kind == 2) return maddubs_loop(n);
#endif
#ifdef __AVX512VNNI__
    if (kind == 2) return dpbusd_loop(n);
#endif
#ifdef __AVX512BF16__
    if (kind == 1) return dpbf16_loop(n);
#endif
    return fma_loop(n);
}
int main(int argc, char **argv) {
    const int threads = atoi(argv[1]);
    const long n = atol(argv[2]);
#ifdef __AVX512F__
    static const char *names[] = {"VFMADD231PS (512-bit)", "VDPBF16PS", "VPDPBUSD (int8)"};
#else
    static const char *names[] = {"VFMADD231PS (256-bit)", "VDPBF16PS", "VPMADDUBSW + VPMADDWD + VPADDD (int8)"};
#endif
    for (int kind = 2; kind >= 0; kind--) {
#if !defined(__AVX512VNNI__) && !defined(__AVX2__)
        if (kind == 2) continue;
#endif
#ifndef __AVX512BF16__
        if (kind == 1) continue;
#endif
        double rate[64] = {0};
#pragma omp parallel num_threads(threads)
        rate[omp_get_thread_num()] = loop(kind, n);
        double total = 0.0;
        for (int i = 0; i < threads; i++) total += rate[i];
        printf("%s: %.1f GFLOP/s on %d threads (", names[kind], total, threads);
        for (int i = 0; i < threads; i++) printf("%s%.1f", i ? ", " : "", rate[i]);
        puts(" a thread)");
    }
    return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.5, help="about how long each loop runs")
    args = ap.parse_args()
    compiler = _compiler()
    if compiler is None:
        raise SystemExit("no C compiler (cc, gcc or $CC)")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.c", Path(tmp) / "peak"
        source.write_text(SOURCE)
        subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", "-o", str(binary), str(source)], check=True)
        iterations = int(args.seconds * 3e9 / 12)  # about one instruction a cycle at 3 GHz
        print(subprocess.run([str(binary), str(args.threads), str(iterations)], check=True, capture_output=True,
                             text=True).stdout, end="")


if __name__ == "__main__":
    main()
