/* Varlen multi-head attention on packed rows, CPU: softmax(q k^T * scale) v per sequence and head.
 *
 * Input: qkv (N, 3D) rows [q heads | k heads | v heads] (D = H * Dh), fp32 or bf16; cu (B + 1) int64 row
 * offsets of the B sequences. Output (N, D), fp32 or bf16. Every sequence attends only to its own rows
 * (FlashAttention's varlen layout), so packed real tokens need no padding, mask or gather.
 *
 * One work item is one (sequence, head): its K and V are packed once into a per-thread buffer (K
 * transposed in 16-key blocks, V as rows; in bf16 as the pairs _mm512_dpbf16_ps reduces over), then
 * queries go in blocks of 8 rows: a full row of scores (sequences of a few hundred tokens fit in L1/L2),
 * exact softmax in fp32 with a vectorised exp2, then P v. The scale and log2(e) are folded into q.
 *
 * Compute modes: 0 fp32 (AVX512F FMA where compiled with __AVX512F__), 1 bf16 products with fp32
 * accumulation (q, k, v and the softmax probabilities rounded to bf16; _mm512_dpbf16_ps where compiled
 * with __AVX512BF16__, else the same rounding emulated in the portable path). The portable path below
 * (#else and the generic item) compiles with any C11 compiler on x86-64 or aarch64.
 *
 * Threads: OpenMP over work items when built with -fopenmp (linked against the process's own OpenMP
 * runtime, torch's libgomp: one thread pool), nthreads from the caller (torch.get_num_threads()).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define TN_ABI 2
#define CAP_OPENMP 1
#define CAP_AVX512 2
#define CAP_AVX512BF16 4
#define ROWS 8 /* query rows per block: 8 rows x 32 keys (or 32 dims) = 16 zmm accumulators */

typedef uint16_t bf16_t;

int tn_attn_abi(void) { return TN_ABI; }

int tn_attn_caps(void) {
    int c = 0;
#ifdef _OPENMP
    c |= CAP_OPENMP;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
    c |= CAP_AVX512;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    c |= CAP_AVX512BF16;
#endif
    return c;
}

static inline float bf16_to_f32(bf16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline bf16_t f32_to_bf16(float f) { /* round to nearest even, as vcvtneps2bf16 */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((v.u >> 16) | 0x40u); /* NaN stays NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (bf16_t)(v.u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* 2^f on [-0.5, 0.5]: Taylor series of e^(f ln 2) to degree 7, relative error < 1e-8 before rounding */
#define EXP2_C1 0.6931471805599453f
#define EXP2_C2 0.2402265069591007f
#define EXP2_C3 0.05550410866482158f
#define EXP2_C4 0.009618129107628477f
#define EXP2_C5 0.0013333558146428443f
#define EXP2_C6 0.00015403530393381606f
#define EXP2_C7 1.525273380405984e-05f

static inline float exp2_scalar(float x) { /* x <= 0 here: scores minus their row maximum */
    if (x < -127.0f) x = -127.0f;
    float n = floorf(x + 0.5f), f = x - n;
    float p = EXP2_C7;
    p = p * f + EXP2_C6; p = p * f + EXP2_C5; p = p * f + EXP2_C4; p = p * f + EXP2_C3;
    p = p * f + EXP2_C2; p = p * f + EXP2_C1; p = p * f + 1.0f;
    return ldexpf(p, (int)n);
}

typedef struct {
    const char *qkv;   /* (N, 3D) rows */
    int64_t ld;        /* qkv row stride, elements */
    int in_bf16;
    char *out;         /* (N, D) rows */
    int64_t ld_out;
    int out_bf16;
    int64_t h, dh;     /* heads, head dim */
    float scale;       /* softmax scale * log2(e): scores are in the exp2 domain */
    int mode;          /* 0 fp32, 1 bf16 */
} Ctx;

static inline float ld_in(const Ctx *c, int64_t row, int64_t col) {
    return c->in_bf16 ? bf16_to_f32(((const bf16_t *)c->qkv)[row * c->ld + col])
                      : ((const float *)c->qkv)[row * c->ld + col];
}

static inline void st_out(const Ctx *c, int64_t row, int64_t col, float v) {
    if (c->out_bf16) ((bf16_t *)c->out)[row * c->ld_out + col] = f32_to_bf16(v);
    else ((float *)c->out)[row * c->ld_out + col] = v;
}

/* ---- portable item: any head dim, any ISA; bf16 mode emulated by rounding ---- */
static void item_generic(const Ctx *c, int64_t r0, int64_t L, int64_t hd, float *ws) {
    const int64_t dh = c->dh, D = c->h * dh;
    const int bf = c->mode == 1;
    float *K = ws, *V = K + L * dh, *q = V + L * dh, *s = q + dh, *o = s + L;
    for (int64_t j = 0; j < L; j++)
        for (int64_t d = 0; d < dh; d++) {
            float kv = ld_in(c, r0 + j, D + hd * dh + d), vv = ld_in(c, r0 + j, 2 * D + hd * dh + d);
            K[j * dh + d] = bf ? round_bf16(kv) : kv;
            V[j * dh + d] = bf ? round_bf16(vv) : vv;
        }
    for (int64_t i = 0; i < L; i++) {
        for (int64_t d = 0; d < dh; d++) {
            float qv = ld_in(c, r0 + i, hd * dh + d) * c->scale;
            q[d] = bf ? round_bf16(qv) : qv;
        }
        float mx = -INFINITY;
        for (int64_t j = 0; j < L; j++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < dh; d++) acc += q[d] * K[j * dh + d];
            s[j] = acc;
            mx = acc > mx ? acc : mx;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < L; j++) {
            float e = exp2_scalar(s[j] - mx);
            sum += e;
            s[j] = bf ? round_bf16(e) : e;
        }
        for (int64_t d = 0; d < dh; d++) o[d] = 0.0f;
        for (int64_t j = 0; j < L; j++)
            for (int64_t d = 0; d < dh; d++) o[d] += s[j] * V[j * dh + d];
        float inv = 1.0f / sum;
        for (int64_t d = 0; d < dh; d++) st_out(c, r0 + i, hd * dh + d, o[d] * inv);
    }
}

static size_t ws_generic(int64_t L, int64_t dh) { return (size_t)(2 * L * dh + dh + L + dh) * sizeof(float); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 2^x for x <= 0. `full`: degree 7 (~1e-7 relative, fp32 mode); else degree 5 (~3e-6, under the 4e-3 of
   the bf16 rounding the probabilities get in bf16 mode) */
static inline __m512 exp2_ps(__m512 x, int full) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(EXP2_C5);
    if (full) {
        p = _mm512_fmadd_ps(_mm512_set1_ps(EXP2_C7), f, _mm512_set1_ps(EXP2_C6));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C5));
    }
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 tail(int64_t left) { /* lanes [0, left) of 16 */
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

/* 16 values of a qkv row from col (fp32 or bf16 source), the lanes past `left` zero */
static inline __m512 load16(const Ctx *c, int64_t row, int64_t col, int64_t left) {
    __mmask16 m = tail(left);
    if (c->in_bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const bf16_t *)c->qkv + row * c->ld + col);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)c->qkv + row * c->ld + col);
}

/* the head's chunk of a qkv row (its q, k or v columns from col), into L1 ahead of use: an item reads 128-byte
   pieces of rows 4.6 KB apart (MiniLM), which the hardware prefetchers do not follow */
#define AHEAD 12
static inline void prefetch_chunk(const Ctx *c, int64_t row, int64_t col) {
    const char *p = c->qkv + (row * c->ld + col) * (c->in_bf16 ? 2 : 4);
    const int64_t bytes = c->dh * (c->in_bf16 ? 2 : 4);
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

static inline void store16(const Ctx *c, int64_t row, int64_t col, __m512 v, int64_t left) {
    __mmask16 m = tail(left);
    if (c->out_bf16) {
#if defined(__AVX512BF16__)
        __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
#else
        __m512i u = _mm512_castps_si512(v); /* round to nearest even (no NaNs out of a softmax of finite scores) */
        u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
        _mm256_mask_storeu_epi16((bf16_t *)c->out + row * c->ld_out + col, m, h);
    } else {
        _mm512_mask_storeu_ps((float *)c->out + row * c->ld_out + col, m, v);
    }
}

/* the running row maxima of a score tile: lanes of keys [jb, jb + 16) below L */
static inline void max_update(__m512 *mx, __m512 v, int64_t jb, int64_t L) {
    *mx = _mm512_mask_max_ps(*mx, tail(L - jb), *mx, v);
}

/* softmax of ROWS score rows of length L (row stride lp), given each row's maximum lanes mx: exp2(s - max)
   into S (fp32) or into P (bf16, when P is not NULL), 0 for keys in [L, lp); returns 1 / sum per row */
static void softmax_rows(float *S, bf16_t *P, int64_t lp, int64_t L, const __m512 *mx, float *inv) {
    __m512 m[ROWS], sum[ROWS];
    for (int r = 0; r < ROWS; r++) {
        m[r] = _mm512_set1_ps(_mm512_reduce_max_ps(mx[r]));
        sum[r] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < lp; j += 16) { /* rows inner: eight independent exp chains in flight */
        const __mmask16 live = tail(L - j);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            float *s = S + r * lp + j;
            __m512 e = _mm512_maskz_mov_ps(live, exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s), m[r]), P == NULL));
            sum[r] = _mm512_add_ps(sum[r], e);
#if defined(__AVX512BF16__)
            if (P != NULL) {
                _mm256_storeu_si256((__m256i *)(P + r * lp + j), (__m256i)_mm512_cvtneps_pbh(e));
                continue;
            }
#endif
            _mm512_storeu_ps(s, e);
        }
    }
    for (int r = 0; r < ROWS; r++) inv[r] = 1.0f / _mm512_reduce_add_ps(sum[r]);
}

/* ---- fp32 item: K as [key block of 16][Dhp][16], V as [Lp][Dhp]; Dhp = Dh rounded up to 16 ---- */
static void item_f32(const Ctx *c, int64_t r0, int64_t L, int64_t hd, float *ws) {
    const int64_t dh = c->dh, D = c->h * dh, dhp = (dh + 15) & ~15, lp = (L + 15) & ~15;
    float *K = ws, *V = K + lp * dhp, *Q = V + lp * dhp, *S = Q + ROWS * dhp, *tmp = S + ROWS * lp;
    float inv[ROWS];
    for (int64_t a = 0; a < AHEAD && a < L; a++) { /* the first rows' q, k and v; the loops fetch AHEAD rows on */
        prefetch_chunk(c, r0 + a, hd * dh);
        prefetch_chunk(c, r0 + a, D + hd * dh);
        prefetch_chunk(c, r0 + a, 2 * D + hd * dh);
    }
    for (int64_t j = 0; j < lp; j++) {
        float *kb = K + (j >> 4) * dhp * 16 + (j & 15);
        if (j + AHEAD < L) {
            prefetch_chunk(c, r0 + j + AHEAD, D + hd * dh);
            prefetch_chunk(c, r0 + j + AHEAD, 2 * D + hd * dh);
        }
        for (int64_t d = 0; d < dhp; d += 16) {
            __m512 kv = j < L ? load16(c, r0 + j, D + hd * dh + d, dh - d) : _mm512_setzero_ps();
            __m512 vv = j < L ? load16(c, r0 + j, 2 * D + hd * dh + d, dh - d) : _mm512_setzero_ps();
            _mm512_storeu_ps(V + j * dhp + d, vv);
            _mm512_storeu_ps(tmp, kv);
            for (int e = 0; e < 16; e++) kb[(d + e) * 16] = tmp[e]; /* transpose: key j is lane j & 15 */
        }
    }
    for (int64_t i0 = 0; i0 < L; i0 += ROWS) {
        for (int64_t a = i0 + ROWS; a < i0 + 2 * ROWS && a < L; a++) prefetch_chunk(c, r0 + a, hd * dh);
        for (int r = 0; r < ROWS; r++)
            for (int64_t d = 0; d < dhp; d += 16) {
                __m512 qv = i0 + r < L ? load16(c, r0 + i0 + r, hd * dh + d, dh - d) : _mm512_setzero_ps();
                _mm512_storeu_ps(Q + r * dhp + d, _mm512_mul_ps(qv, _mm512_set1_ps(c->scale)));
            }
        __m512 mx[ROWS];
        for (int r = 0; r < ROWS; r++) mx[r] = _mm512_set1_ps(-INFINITY);
        int64_t jb = 0;
        for (; jb + 32 <= lp; jb += 32) { /* S[:, jb:jb+32] = Q K^T */
            __m512 a[ROWS][2];
            for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
            const float *k0 = K + (jb >> 4) * dhp * 16, *k1 = k0 + dhp * 16;
            for (int64_t d = 0; d < dhp; d++) {
                __m512 x0 = _mm512_loadu_ps(k0 + d * 16), x1 = _mm512_loadu_ps(k1 + d * 16);
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) {
                    __m512 qv = _mm512_set1_ps(Q[r * dhp + d]);
                    a[r][0] = _mm512_fmadd_ps(qv, x0, a[r][0]);
                    a[r][1] = _mm512_fmadd_ps(qv, x1, a[r][1]);
                }
            }
            for (int r = 0; r < ROWS; r++) {
                _mm512_storeu_ps(S + r * lp + jb, a[r][0]);
                _mm512_storeu_ps(S + r * lp + jb + 16, a[r][1]);
                max_update(&mx[r], a[r][0], jb, L);
                max_update(&mx[r], a[r][1], jb + 16, L);
            }
        }
        if (jb < lp) { /* a last block of 16 keys */
            __m512 a[ROWS];
            for (int r = 0; r < ROWS; r++) a[r] = _mm512_setzero_ps();
            const float *k0 = K + (jb >> 4) * dhp * 16;
            for (int64_t d = 0; d < dhp; d++) {
                __m512 x0 = _mm512_loadu_ps(k0 + d * 16);
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(Q[r * dhp + d]), x0, a[r]);
            }
            for (int r = 0; r < ROWS; r++) {
                _mm512_storeu_ps(S + r * lp + jb, a[r]);
                max_update(&mx[r], a[r], jb, L);
            }
        }
        softmax_rows(S, NULL, lp, L, mx, inv);
        int rows = L - i0 < ROWS ? (int)(L - i0) : ROWS;
        for (int64_t dc = 0; dc < dhp; dc += 32) { /* O[:, dc:dc+32] = P V */
            int two = dc + 16 < dhp;
            __m512 a[ROWS][2];
            for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
            for (int64_t j = 0; j < L; j++) {
                __m512 x0 = _mm512_loadu_ps(V + j * dhp + dc);
                __m512 x1 = two ? _mm512_loadu_ps(V + j * dhp + dc + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) {
                    __m512 p = _mm512_set1_ps(S[r * lp + j]);
                    a[r][0] = _mm512_fmadd_ps(p, x0, a[r][0]);
                    a[r][1] = _mm512_fmadd_ps(p, x1, a[r][1]);
                }
            }
            for (int r = 0; r < rows; r++) {
                __m512 s = _mm512_set1_ps(inv[r]);
                store16(c, r0 + i0 + r, hd * dh + dc, _mm512_mul_ps(a[r][0], s), dh - dc);
                if (two) store16(c, r0 + i0 + r, hd * dh + dc + 16, _mm512_mul_ps(a[r][1], s), dh - dc - 16);
            }
        }
    }
}

static size_t ws_f32(int64_t L, int64_t dh) {
    int64_t dhp = (dh + 15) & ~15, lp = (L + 15) & ~15;
    return (size_t)(2 * lp * dhp + ROWS * dhp + ROWS * lp + 16) * sizeof(float);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* 16 fp32 -> 16 bf16 (round to nearest even) */
static inline __m256i cvt16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* r[i] lane j -> r[j] lane i, 16 x 16 32-bit lanes */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* 32 dims of a key from col as bf16 (16 dim pairs), dims past `left` zero */
static inline __m512i load32_bf16(const Ctx *c, int64_t row, int64_t col, int64_t left) {
    if (c->in_bf16) {
        __mmask32 m = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
        return _mm512_maskz_loadu_epi16(m, (const bf16_t *)c->qkv + row * c->ld + col);
    }
    __m512 lo = load16(c, row, col, left), hi = load16(c, row, col + 16, left - 16);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* ---- bf16 item (vdpbf16ps: acc += a[2i] b[2i] + a[2i+1] b[2i+1]).
   K as [key block of 16][Dhp / 2][16 keys][2 dims]; V as [Lp / 2][Dhp][2 keys]; Q as [ROWS][Dhp];
   P as [ROWS][Lp] ---- */
static void item_bf16(const Ctx *c, int64_t r0, int64_t L, int64_t hd, char *wsc) {
    const int64_t dh = c->dh, D = c->h * dh, dhp = (dh + 15) & ~15, lp = (L + 31) & ~31;
    float *S = (float *)wsc;
    bf16_t *K = (bf16_t *)(S + ROWS * lp), *V = K + lp * dhp, *Q = V + lp * dhp, *P = Q + ROWS * dhp;
    float inv[ROWS];
    /* V interleave: for 16 dims d, keys (j, j+1) -> 32 bf16 [d0 j, d0 j+1, d1 j, ...] */
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t a = 0; a < AHEAD && a < L; a++) { /* the first rows' q, k and v; the loops fetch AHEAD rows on */
        prefetch_chunk(c, r0 + a, hd * dh);
        prefetch_chunk(c, r0 + a, D + hd * dh);
        prefetch_chunk(c, r0 + a, 2 * D + hd * dh);
    }
    for (int64_t j = 0; j < lp; j += 2) {
        for (int64_t a = j + AHEAD; a < j + AHEAD + 2 && a < L; a++) {
            prefetch_chunk(c, r0 + a, D + hd * dh);
            prefetch_chunk(c, r0 + a, 2 * D + hd * dh);
        }
        for (int64_t d = 0; d < dhp; d += 16) {
            __m512 v0 = j < L ? load16(c, r0 + j, 2 * D + hd * dh + d, dh - d) : _mm512_setzero_ps();
            __m512 v1 = j + 1 < L ? load16(c, r0 + j + 1, 2 * D + hd * dh + d, dh - d) : _mm512_setzero_ps();
            __m512i vv = _mm512_inserti64x4(_mm512_castsi256_si512(cvt16(v0)), cvt16(v1), 1);
            _mm512_storeu_si512(V + ((j >> 1) * dhp + d) * 2, _mm512_permutexvar_epi16(ilv, vv));
        }
    }
    for (int64_t jb = 0; jb < lp; jb += 16) /* K: 16 keys x 16 dim pairs transposed to 16 pair rows of 16 keys */
        for (int64_t d = 0; d < dhp; d += 32) {
            __m512i rows[16];
            for (int k = 0; k < 16; k++)
                rows[k] = jb + k < L ? load32_bf16(c, r0 + jb + k, D + hd * dh + d, dh - d) : _mm512_setzero_si512();
            transpose16(rows);
            uint32_t *kb = (uint32_t *)K + ((jb >> 4) * (dhp / 2) + d / 2) * 16;
            for (int p = 0; p < 16 && d + 2 * p < dhp; p++) _mm512_storeu_si512(kb + p * 16, rows[p]);
        }
    const uint32_t *K32 = (const uint32_t *)K, *Q32 = (const uint32_t *)Q, *P32 = (const uint32_t *)P;
    const __m512 sc = _mm512_set1_ps(c->scale);
    for (int64_t i0 = 0; i0 < L; i0 += ROWS) {
        for (int64_t a = i0 + ROWS; a < i0 + 2 * ROWS && a < L; a++) prefetch_chunk(c, r0 + a, hd * dh);
        for (int r = 0; r < ROWS; r++)
            for (int64_t d = 0; d < dhp; d += 16) {
                __m512 qv = i0 + r < L ? load16(c, r0 + i0 + r, hd * dh + d, dh - d) : _mm512_setzero_ps();
                _mm256_storeu_si256((__m256i *)(Q + r * dhp + d), cvt16(_mm512_mul_ps(qv, sc)));
            }
        __m512 mx[ROWS];
        for (int r = 0; r < ROWS; r++) mx[r] = _mm512_set1_ps(-INFINITY);
        for (int64_t jb = 0; jb < lp; jb += 32) { /* lp is a multiple of 32 */
            __m512 a[ROWS][2];
            for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
            const uint32_t *k0 = K32 + (jb >> 4) * (dhp / 2) * 16, *k1 = k0 + (dhp / 2) * 16;
            for (int64_t p = 0; p < dhp / 2; p++) {
                __m512bh x0 = (__m512bh)_mm512_loadu_si512(k0 + p * 16), x1 = (__m512bh)_mm512_loadu_si512(k1 + p * 16);
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) {
                    __m512bh qv = (__m512bh)_mm512_set1_epi32((int)Q32[r * (dhp / 2) + p]);
                    a[r][0] = _mm512_dpbf16_ps(a[r][0], qv, x0);
                    a[r][1] = _mm512_dpbf16_ps(a[r][1], qv, x1);
                }
            }
            for (int r = 0; r < ROWS; r++) {
                _mm512_storeu_ps(S + r * lp + jb, a[r][0]);
                _mm512_storeu_ps(S + r * lp + jb + 16, a[r][1]);
                max_update(&mx[r], a[r][0], jb, L);
                max_update(&mx[r], a[r][1], jb + 16, L);
            }
        }
        softmax_rows(S, P, lp, L, mx, inv);
        int rows = L - i0 < ROWS ? (int)(L - i0) : ROWS;
        const int64_t npair = (L + 1) / 2;
        for (int64_t dc = 0; dc < dhp; dc += 32) { /* O[:, dc:dc+32] = P V */
            int two = dc + 16 < dhp;
            __m512 a[ROWS][2];
            for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
            for (int64_t jp = 0; jp < npair; jp++) {
                const bf16_t *vr = V + (jp * dhp + dc) * 2;
                __m512bh x0 = (__m512bh)_mm512_loadu_si512(vr);
                __m512bh x1 = (__m512bh)(two ? _mm512_loadu_si512(vr + 32) : _mm512_setzero_si512());
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) {
                    __m512bh pv = (__m512bh)_mm512_set1_epi32((int)P32[r * (lp / 2) + jp]);
                    a[r][0] = _mm512_dpbf16_ps(a[r][0], pv, x0);
                    a[r][1] = _mm512_dpbf16_ps(a[r][1], pv, x1);
                }
            }
            for (int r = 0; r < rows; r++) {
                __m512 s = _mm512_set1_ps(inv[r]);
                store16(c, r0 + i0 + r, hd * dh + dc, _mm512_mul_ps(a[r][0], s), dh - dc);
                if (two) store16(c, r0 + i0 + r, hd * dh + dc + 16, _mm512_mul_ps(a[r][1], s), dh - dc - 16);
            }
        }
    }
}

static size_t ws_bf16(int64_t L, int64_t dh) {
    int64_t dhp = (dh + 15) & ~15, lp = (L + 31) & ~31;
    return (size_t)ROWS * lp * sizeof(float) + (size_t)(2 * lp * dhp + ROWS * dhp + ROWS * lp) * sizeof(bf16_t) + 64;
}
#endif

/* Which item runs: 2 bf16 native, 1 fp32 AVX512, 0 portable. */
static int path_of(const Ctx *c) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (c->mode == 1) return 2;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (c->mode == 0) return 1;
#endif
    (void)c;
    return 0;
}

static size_t ws_size(int path, int64_t L, int64_t dh) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (path == 2) return ws_bf16(L, dh);
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (path == 1) return ws_f32(L, dh);
#endif
    (void)path;
    return ws_generic(L, dh);
}

static void run_item(const Ctx *c, int path, int64_t r0, int64_t L, int64_t hd, void *ws) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (path == 2) { item_bf16(c, r0, L, hd, (char *)ws); return; }
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (path == 1) { item_f32(c, r0, L, hd, (float *)ws); return; }
#endif
    (void)path;
    item_generic(c, r0, L, hd, (float *)ws);
}

/* Which kernel a mode runs here: 2 avx512-bf16, 1 avx512 fp32, 0 portable. */
int tn_attn_path(int mode) {
    Ctx c;
    memset(&c, 0, sizeof c);
    c.mode = mode;
    return path_of(&c);
}

/* Work (multiply-adds) below which a call runs on one thread: waking a team costs more than it saves
   (~10-20 us quiet, milliseconds on a loaded machine) */
#define SERIAL_WORK (1 << 20)

/* Returns 0; -2 when cu is not 0 = cu[0] <= cu[1] <= ... <= cu[nseq] = n_rows (nothing computed); -1 when a work
   buffer could not be allocated (the output is then incomplete). The caller checked the strides and dtypes. */
int tn_varlen_attention(const void *qkv, int64_t n_rows, int64_t ld, int in_bf16, const int64_t *cu, int64_t nseq,
                        int64_t heads, int64_t head_dim, float scale, void *out, int64_t ld_out, int out_bf16,
                        int mode, int nthreads) {
    Ctx c = {(const char *)qkv, ld, in_bf16, (char *)out, ld_out, out_bf16, heads, head_dim,
             scale * 1.4426950408889634f, mode};
    if (cu[0] != 0 || cu[nseq] != n_rows) return -2;
    int64_t lmax = 0;
    double work = 0.0;
    for (int64_t b = 0; b < nseq; b++) {
        int64_t L = cu[b + 1] - cu[b];
        if (L < 0) return -2;
        lmax = L > lmax ? L : lmax;
        work += 2.0 * (double)L * (double)L * (double)(head_dim * heads);
    }
    if (lmax == 0) return 0;
    if (work < SERIAL_WORK) nthreads = 1;
    const int path = path_of(&c);
    const size_t ws = ws_size(path, lmax, head_dim);
    const int64_t items = nseq * heads;
    int failed = 0;
    (void)nthreads;
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) reduction(| : failed)
#endif
    {
        void *buf = aligned_alloc(64, (ws + 63) & ~(size_t)63);
        if (buf == NULL) failed = 1;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t it = 0; it < items; it++) {
            int64_t b = it / heads, hd = it % heads, L = cu[b + 1] - cu[b];
            if (L > 0 && buf != NULL) run_item(&c, path, cu[b], L, hd, buf);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
