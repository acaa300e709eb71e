/* Per-tensor asymmetric uint8 quantisation of fp32 rows, with a per-column multiplier, in two passes.
 *
 * What an int8 GEMM's activation needs before oneDNN's u8 x s8 kernel, done by torch as four to six
 * passes (smoothing multiply, zeroing of the columns computed in fp32 elsewhere, aminmax, quantize_per_tensor):
 *
 *   y[i, j] = x[i, j] * s[j]                     (s: SmoothQuant's 1/s, 0 for an outlier column; NULL: 1)
 *   lo = min(0, min y), hi = max(0, max y)      (the range holds 0, so 0 is exact)
 *   scale = max(hi - lo, 1e-8) / 255,  zp = clamp(round(-lo / scale), 0, 255)
 *   q[i, j] = clamp(nearbyint(fma(y[i, j], 1 / scale, zp)), 0, 255)
 *
 * bit for bit as torch.quantize_per_tensor computes it (one fused multiply-add in float, rounded half to even:
 * not round(y / scale) + zp, which differs in about 1 of 10^5 values). Pass one reads x for
 * the range, pass two reads it again and writes q: two reads of x and one write of q.
 *
 * Threads: OpenMP over rows when built with -fopenmp (torch's libgomp, see cpu_attention.py), nthreads from
 * the caller. AVX512F where compiled with it, a portable loop otherwise.
 */
#include <stdint.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define TN_Q8_ABI 1

int tn_q8_abi(void) { return TN_Q8_ABI; }

/* min and max of one row's y over k columns into *lo, *hi; returns 0 where every y is finite (v - v is 0 for
 * a finite v, NaN for inf or NaN; min/max alone would let a NaN through) */
static float row_range(const float *x, const float *s, int64_t k, float *lo, float *hi) {
    float l = *lo, h = *hi, bad = 0.0f;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 vl = _mm512_set1_ps(l), vh = _mm512_set1_ps(h), vb = _mm512_setzero_ps();
    for (; j + 16 <= k; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        if (s) v = _mm512_mul_ps(v, _mm512_loadu_ps(s + j));
        vl = _mm512_min_ps(vl, v);
        vh = _mm512_max_ps(vh, v);
        vb = _mm512_add_ps(vb, _mm512_sub_ps(v, v));
    }
    l = _mm512_reduce_min_ps(vl);
    h = _mm512_reduce_max_ps(vh);
    bad = _mm512_reduce_add_ps(vb);
#endif
    for (; j < k; j++) {
        float v = s ? x[j] * s[j] : x[j];
        l = v < l ? v : l;
        h = v > h ? v : h;
        bad += v - v;
    }
    *lo = l;
    *hi = h;
    return bad;
}

static void row_quant(const float *x, const float *s, int64_t k, float inv, float zp, uint8_t *q) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 vi = _mm512_set1_ps(inv), vz = _mm512_set1_ps(zp), v0 = _mm512_setzero_ps(),
                 v255 = _mm512_set1_ps(255.0f);
    for (; j + 16 <= k; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        if (s) v = _mm512_mul_ps(v, _mm512_loadu_ps(s + j));
        v = _mm512_roundscale_ps(_mm512_fmadd_ps(v, vi, vz), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, v0), v255);
        _mm_storeu_si128((__m128i *)(q + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
    }
#endif
    for (; j < k; j++) {
        float v = nearbyintf(fmaf(s ? x[j] * s[j] : x[j], inv, zp));
        v = v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v);
        q[j] = (uint8_t)v;
    }
}

/* x: n rows of k floats, row stride ld; s: k multipliers or NULL; q: n x k bytes (contiguous).
 * Writes the scale and zero point used; returns 0, or -1 when the range is not finite (q untouched). */
int tn_quantize_u8(const float *x, int64_t n, int64_t k, int64_t ld, const float *s, uint8_t *q,
                   double *scale_out, int64_t *zp_out, int nthreads) {
    float lo = 0.0f, hi = 0.0f, bad = 0.0f;
    (void)nthreads;
#ifdef _OPENMP
#pragma omp parallel for reduction(min : lo) reduction(max : hi) reduction(+ : bad) num_threads(nthreads) \
    if (nthreads > 1 && n > 64)
#endif
    for (int64_t i = 0; i < n; i++) {
        float l = 0.0f, h = 0.0f;
        bad += row_range(x + i * ld, s, k, &l, &h);
        lo = l < lo ? l : lo;
        hi = h > hi ? h : hi;
    }
    if (bad != 0.0f || !isfinite(lo) || !isfinite(hi)) return -1;
    double range = (double)hi - (double)lo;
    double scale = (range > 1e-8 ? range : 1e-8) / 255.0;
    double z = nearbyint(-(double)lo / scale);
    int64_t zp = z < 0.0 ? 0 : (z > 255.0 ? 255 : (int64_t)z);
    float inv = 1.0f / (float)scale;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && n > 64)
#endif
    for (int64_t i = 0; i < n; i++) row_quant(x + i * ld, s, k, inv, (float)zp, q + i * k);
    *scale_out = scale;
    *zp_out = zp;
    return 0;
}
