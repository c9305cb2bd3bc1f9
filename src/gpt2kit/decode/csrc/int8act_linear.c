/* gpt2kit's int8 x int8 product (int8 weights and int8 activations, "W8A8"), as CTranslate2's int8
 * and ONNX Runtime's dynamic quantization compute one: the activations are quantized per row on
 * the fly, the products accumulate exactly in int32, the result is rescaled once per output.
 *
 *   per row r:  a = max_k |x[r, k]|,  sx[r] = a / 127,  q[r, k] = rint(x[r, k] * (127 / a)) in [-127, 127]
 *               (a below FLT_MIN: q = 0, sx = 0; a not finite: q = 0, sx = NaN, so the row's outputs are NaN)
 *   y[r, n] = ((float)acc[r, n] * sx[r]) * s[n]  (+ b[n]),   acc[r, n] = sum_k q[r, k] * W[n, k]  (int32, exact)
 *
 * x (R, K) float32, W (N, K) int8, s (N,) float32, b (N,) float32 or NULL, y (R, N) float32, all
 * contiguous. rint rounds half to even (the default rounding mode), as torch.round does; the
 * float32 operations are done in this order with -ffp-contract=off, so gpt2kit/decode/int8act.py's
 * torch formulation of the same arithmetic gives the same bits. The int32 sum is exact while
 * K * 127 * 128 < 2^31 (K <= 131072; int8act.py refuses larger K).
 *
 * Two instruction sets, chosen by gpt2kit/decode/native.py from the CPU's flags (both are compiled
 * into the one library, the AVX-512 one by a function attribute, so the library loads on AVX2 CPUs):
 *   AVX-512 VNNI  vpdpbusd multiplies unsigned by signed bytes, four per int32 lane: the activations
 *                 are stored as q + 128 (unsigned) and 128 * sum_k W[n, k], summed by the same
 *                 instruction against ones, is subtracted (exact, for any int8 weight, -128 included)
 *   AVX2          the activations widened to int16 once per row, the weights per load; vpmaddwd
 *                 sums pairs of int16 products into int32 (no saturation: |pair| <= 2 * 128 * 127)
 * Blocking as csrc/int8_linear.c: threads split the output channels in blocks of 4; within a
 * block, 4 rows x 2 channels at a time (each loaded weight feeds 4 rows), then 2 rows, then 1 (one
 * sequential stream per channel, prefetched ahead). Legend: R rows, K in, N out. */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH 4096

/* --- per-row quantization (plain C: it reads R * K floats once, against N * K weights) ------------- */

/* sx[r] and q as the row's codes: as int16 (AVX2 kernel) or as q + 128 in a byte (VNNI kernel). */
static void quantize_row(const float *x, long K, float *sx, int16_t *q16, uint8_t *qu8) {
    float a = 0.0f;
    int finite = 1;
    for (long k = 0; k < K; k++) {
        float v = fabsf(x[k]);
        finite &= isfinite(v) != 0;
        a = v > a ? v : a;
    }
    if (!finite || a < FLT_MIN) {
        *sx = finite ? 0.0f : NAN;
        if (q16) memset(q16, 0, K * sizeof(int16_t));
        if (qu8) memset(qu8, 128, K);
        return;
    }
    const float inv = 127.0f / a;
    *sx = a / 127.0f;
    for (long k = 0; k < K; k++) {
        float v = rintf(x[k] * inv);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        if (q16) q16[k] = (int16_t)v;
        if (qu8) qu8[k] = (uint8_t)((int)v + 128);
    }
}

static inline void store_row(float *y, long n, int32_t acc, float sx, const float *s, const float *b) {
    float v = ((float)acc * sx) * s[n];
    y[n] = b ? v + b[n] : v;
}

/* --- AVX2: int16 activations, vpmaddwd -------------------------------------------------------------- */

static inline __m256i widen16(const int8_t *p) { /* 16 int8 -> 16 int16 */
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline int32_t tail16(const int8_t *w, const int16_t *q, long k0, long K) {
    int32_t t = 0;
    for (long k = k0; k < K; k++) t += (int32_t)w[k] * q[k];
    return t;
}

#define MADD(acc, w, q) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)(q))))

static void block_avx2(const int16_t *q, const float *sx, long R, long K, const int8_t *W, long N,
                       const float *s, const float *b, float *y, long n0, long width) {
    const long K16 = K & ~15L;
    long r = 0;
    for (; width == 4 && r + 4 <= R; r += 4) { /* 4 rows x 2 channels */
        const int16_t *qa = q + r * K, *qb = qa + K, *qc = qb + K, *qd = qc + K;
        for (long j = 0; j < 4; j += 2) {
            const int8_t *u = W + (n0 + j) * K, *v = u + K;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
            for (long k = 0; k < K16; k += 16) {
                __m256i wu = widen16(u + k), wv = widen16(v + k);
                MADD(a0, wu, qa + k); MADD(a1, wv, qa + k); MADD(b0, wu, qb + k); MADD(b1, wv, qb + k);
                MADD(c0, wu, qc + k); MADD(c1, wv, qc + k); MADD(d0, wu, qd + k); MADD(d1, wv, qd + k);
            }
            const long n = n0 + j;
            store_row(y + r * N, n, hsum_epi32(a0) + tail16(u, qa, K16, K), sx[r], s, b);
            store_row(y + r * N, n + 1, hsum_epi32(a1) + tail16(v, qa, K16, K), sx[r], s, b);
            store_row(y + (r + 1) * N, n, hsum_epi32(b0) + tail16(u, qb, K16, K), sx[r + 1], s, b);
            store_row(y + (r + 1) * N, n + 1, hsum_epi32(b1) + tail16(v, qb, K16, K), sx[r + 1], s, b);
            store_row(y + (r + 2) * N, n, hsum_epi32(c0) + tail16(u, qc, K16, K), sx[r + 2], s, b);
            store_row(y + (r + 2) * N, n + 1, hsum_epi32(c1) + tail16(v, qc, K16, K), sx[r + 2], s, b);
            store_row(y + (r + 3) * N, n, hsum_epi32(d0) + tail16(u, qd, K16, K), sx[r + 3], s, b);
            store_row(y + (r + 3) * N, n + 1, hsum_epi32(d1) + tail16(v, qd, K16, K), sx[r + 3], s, b);
        }
    }
    for (; r + 2 <= R; r += 2) { /* 2 rows, channel by channel */
        const int16_t *qa = q + r * K, *qb = qa + K;
        for (long j = 0; j < width; j++) {
            const int8_t *w = W + (n0 + j) * K;
            __m256i a0 = _mm256_setzero_si256(), b0 = a0;
            for (long k = 0; k < K16; k += 16) {
                __m256i wk = widen16(w + k);
                MADD(a0, wk, qa + k); MADD(b0, wk, qb + k);
            }
            store_row(y + r * N, n0 + j, hsum_epi32(a0) + tail16(w, qa, K16, K), sx[r], s, b);
            store_row(y + (r + 1) * N, n0 + j, hsum_epi32(b0) + tail16(w, qb, K16, K), sx[r + 1], s, b);
        }
    }
    for (; r < R; r++) { /* one row: one sequential stream per channel */
        const int16_t *qa = q + r * K;
        for (long j = 0; j < width; j++) {
            const int8_t *w = W + (n0 + j) * K;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0;
            long k = 0;
            for (; k + 32 <= K16; k += 32) {
                if ((k & 63) == 0) _mm_prefetch((const char *)(w + k + PREFETCH), _MM_HINT_T0);
                MADD(a0, widen16(w + k), qa + k);
                MADD(a1, widen16(w + k + 16), qa + k + 16);
            }
            for (; k < K16; k += 16) MADD(a0, widen16(w + k), qa + k);
            store_row(y + r * N, n0 + j, hsum_epi32(_mm256_add_epi32(a0, a1)) + tail16(w, qa, K16, K), sx[r], s, b);
        }
    }
}

/* --- AVX-512 VNNI: q + 128 as bytes, vpdpbusd ---------------------------------------------------------- */

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

VNNI static inline __mmask64 tail_mask(long k, long K) {
    long n = K - k;
    return n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1);
}

/* sum_k q[k] * w[k] for the bytes (q + 128) of up to 4 rows against one channel w: dpbusd on the
 * shifted bytes, minus 128 * sum_k w[k] (the same instruction against ones). */
VNNI static void dot_vnni(const uint8_t *const *qs, int rows, const int8_t *w, long K, int32_t *out, int prefetch) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    __m512i comp = _mm512_setzero_si512();
    for (long k = 0; k < K; k += 64) {
        const __mmask64 m = tail_mask(k, K);
        if (prefetch) _mm_prefetch((const char *)(w + k + PREFETCH), _MM_HINT_T0);
        const __m512i wk = _mm512_maskz_loadu_epi8(m, w + k);
        comp = _mm512_dpbusd_epi32(comp, ones, wk);
        for (int i = 0; i < rows; i++)
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_maskz_loadu_epi8(m, qs[i] + k), wk);
    }
    const int32_t c = 128 * _mm512_reduce_add_epi32(comp);
    for (int i = 0; i < rows; i++) out[i] = _mm512_reduce_add_epi32(acc[i]) - c;
}

VNNI static void block_vnni(const uint8_t *q, const float *sx, long R, long K, const int8_t *W, long N,
                            const float *s, const float *b, float *y, long n0, long width) {
    for (long r = 0; r < R; r += 4) {
        const int rows = R - r >= 4 ? 4 : (int)(R - r);
        const uint8_t *qs[4];
        for (int i = 0; i < rows; i++) qs[i] = q + (r + i) * K;
        for (long j = 0; j < width; j++) {
            int32_t acc[4];
            dot_vnni(qs, rows, W + (n0 + j) * K, K, acc, R == 1);
            for (int i = 0; i < rows; i++) store_row(y + (r + i) * N, n0 + j, acc[i], sx[r + i], s, b);
        }
    }
}

/* --- the entry points ---------------------------------------------------------------------------------- */

int gpt2kit_int8act_linear_abi(void) { return 1; } /* bumped when the signatures below change */

/* isa: 1 AVX2, 2 AVX-512 VNNI (the caller checked the CPU has it). Returns 0, or -1 when the
 * scratch memory could not be allocated (y is then untouched). */
int gpt2kit_int8act_linear(const float *x, long R, long K, const int8_t *W, long N, const float *s,
                           const float *b, float *y, int threads, int isa) {
    if (R <= 0) return 0;
    float *sx = malloc(R * sizeof(float));
    void *q = malloc((size_t)R * (size_t)(K > 0 ? K : 1) * (isa == 2 ? 1 : sizeof(int16_t)));
    if (!sx || !q) {
        free(sx);
        free(q);
        return -1;
    }
    const long blocks = (N + 3) / 4;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long r = 0; r < R; r++)
            quantize_row(x + r * K, K, sx + r, isa == 2 ? NULL : (int16_t *)q + r * K,
                         isa == 2 ? (uint8_t *)q + r * K : NULL);
        #pragma omp for schedule(static)
        for (long i = 0; i < blocks; i++) {
            const long n0 = 4 * i, width = N - n0 >= 4 ? 4 : N - n0;
            if (isa == 2) block_vnni(q, sx, R, K, W, N, s, b, y, n0, width);
            else block_avx2(q, sx, R, K, W, N, s, b, y, n0, width);
        }
    }
    free(sx);
    free(q);
    return 0;
}
