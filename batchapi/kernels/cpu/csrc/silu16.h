/* SiLU-and-mul on 16 fp32 lanes with AVX-512, for both libraries that compute it: elementwise.c's
 * silu_and_mul and matmul.c's gate_up layer with it in its epilogue (linear_amx_silu). One copy of
 * the arithmetic, so that the two give the same bits. build.py hashes this header with each source.
 * Every function is elementwise: lanes may hold any columns. */
#ifndef BATCHAPI_SILU16_H
#define BATCHAPI_SILU16_H
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>

#include "common.h"

/* x rounded to bf16 (kept in fp32), nearest even. Without torch's NaN test: every value that
 * reaches it came from bf16 storage or from arithmetic on such values, so a NaN's low 16 bits are
 * zero (x86 keeps a NaN operand's payload, and makes new NaNs 0xffc00000) and the carry below
 * cannot reach its exponent. */
INLINE __m512 round_bf16_16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)); /* ties to even */
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

/* e^x within about 1 ulp (Cephes expf: x = n ln2 + r, |r| <= ln2/2, e^r by a polynomial, times 2^n
 * by scalef, which also gives inf above 88.7 and denormals, then 0, below -87.3). |x| is clamped
 * to 89 first, keeping its sign (vrangeps; NaN passes), so that n stays finite: inf - inf is NaN. */
INLINE __m512 cephes_exp16(__m512 x) {
    x = _mm512_range_ps(x, _mm512_set1_ps(89.0f), 0x02); /* the smaller magnitude, x's sign */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

INLINE __m512 silu16(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), cephes_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

/* silu(g) * u as torch computes it on bf16 tensors: each op's result rounded to bf16 */
INLINE __m512 silu_mul_bf16_16(__m512 g, __m512 u) {
    return round_bf16_16(_mm512_mul_ps(round_bf16_16(silu16(g)), u));
}
#endif
#endif
