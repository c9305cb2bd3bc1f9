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
 *   AVX2, 16-bit  the same kernel with codes of +-qmax in place of +-127 (a16_qmax: the widest that
 *                 keeps the int32 sums exact), the weight-only int8 kernel native-a16 of
 *                 gpt2kit/decode/int8.py: integer products at weight-only accuracy
 * Blocking as csrc/int8_linear.c: threads split the output channels in blocks of 4; within a
 * block, 4 rows x 2 channels at a time (each loaded weight feeds 4 rows), then (AVX2) 2 rows, then 1
 * (one sequential stream per channel, prefetched ahead); many rows go in tiles of TILE_BYTES of
 * codes, each tile passed by every channel block. Legend: R rows, K in, N out. */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "solo.h"

#define PREFETCH 4096
#define TILE_BYTES (192L << 10) /* a tile of rows' codes (the product's row tiles, below) */

/* --- per-row quantization (plain C: it reads R * K floats once, against N * K weights) ------------- */

/* sx[r] and q as the row's codes: as int16 (AVX2 kernel), as q + 128 in a byte (VNNI kernel), or as
 * int8 (for another GEMM: gpt2kit_int8act_quantize); the outputs not wanted are NULL. */
static void quantize_row(const float *x, long K, float qmax, float *sx, int16_t *q16, uint8_t *qu8, int8_t *q8) {
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
        if (q8) memset(q8, 0, K);
        return;
    }
    const float inv = qmax / a;
    *sx = a / qmax;
    for (long k = 0; k < K; k++) {
        float v = rintf(x[k] * inv);
        v = v > qmax ? qmax : v < -qmax ? -qmax : v;
        if (q16) q16[k] = (int16_t)v;
        if (qu8) qu8[k] = (uint8_t)((int)v + 128);
        if (q8) q8[k] = (int8_t)v;
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

VNNI static inline __m512i load_tail(const void *p, long n) { /* the last n < 64 bytes, zeros after */
    return _mm512_maskz_loadu_epi8((((__mmask64)1) << n) - 1, p);
}

#define DP(acc, u, w) acc = _mm512_dpbusd_epi32(acc, u, w)

/* sum(acc) - 128 * sum(comp), with one reduction (the lanes' int32 sums wrap alike, so the exact
 * result is what the wrapped lanes give whenever it fits in int32) */
VNNI static inline int32_t corrected(__m512i acc, __m512i comp) {
    return _mm512_reduce_add_epi32(_mm512_sub_epi32(acc, _mm512_slli_epi32(comp, 7)));
}

/* One channel w against one row of shifted codes u: sum_k (u[k] - 128) * w[k], streamed with prefetch. */
VNNI static int32_t dot1_vnni(const uint8_t *u, const int8_t *w, long K, int prefetch) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, c0 = a0, c1 = a0;
    long k = 0;
    for (; k + 128 <= K; k += 128) {
        if (prefetch) {
            _mm_prefetch((const char *)(w + k + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + k + PREFETCH + 64), _MM_HINT_T0);
        }
        const __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 64);
        DP(a0, _mm512_loadu_si512(u + k), w0); DP(c0, ones, w0);
        DP(a1, _mm512_loadu_si512(u + k + 64), w1); DP(c1, ones, w1);
    }
    for (; k + 64 <= K; k += 64) {
        const __m512i w0 = _mm512_loadu_si512(w + k);
        DP(a0, _mm512_loadu_si512(u + k), w0); DP(c0, ones, w0);
    }
    if (k < K) {
        const __m512i w0 = load_tail(w + k, K - k);
        DP(a0, load_tail(u + k, K - k), w0); DP(c0, ones, w0);
    }
    return corrected(_mm512_add_epi32(a0, a1), _mm512_add_epi32(c0, c1));
}

/* Two channels (w, v) against four rows of shifted codes: each loaded weight feeds four rows, each
 * loaded row two channels. out[2 * i + j]: row i, channel j. */
VNNI static void dot4x2_vnni(const uint8_t *ua, long K, const int8_t *w, const int8_t *v, int32_t *out) {
    const __m512i ones = _mm512_set1_epi8(1);
    const uint8_t *ub = ua + K, *uc = ub + K, *ud = uc + K;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
    __m512i cw = a0, cv = a0;
    for (long k = 0; k < K; k += 64) {
        const long n = K - k;
        __m512i x, y, qa, qb, qc, qd;
        if (n >= 64) {
            x = _mm512_loadu_si512(w + k); y = _mm512_loadu_si512(v + k);
            qa = _mm512_loadu_si512(ua + k); qb = _mm512_loadu_si512(ub + k);
            qc = _mm512_loadu_si512(uc + k); qd = _mm512_loadu_si512(ud + k);
        } else {
            x = load_tail(w + k, n); y = load_tail(v + k, n);
            qa = load_tail(ua + k, n); qb = load_tail(ub + k, n); qc = load_tail(uc + k, n); qd = load_tail(ud + k, n);
        }
        DP(cw, ones, x); DP(cv, ones, y);
        DP(a0, qa, x); DP(a1, qa, y); DP(b0, qb, x); DP(b1, qb, y);
        DP(c0, qc, x); DP(c1, qc, y); DP(d0, qd, x); DP(d1, qd, y);
    }
    out[0] = corrected(a0, cw); out[1] = corrected(a1, cv); out[2] = corrected(b0, cw); out[3] = corrected(b1, cv);
    out[4] = corrected(c0, cw); out[5] = corrected(c1, cv); out[6] = corrected(d0, cw); out[7] = corrected(d1, cv);
}

VNNI static void block_vnni(const uint8_t *q, const float *sx, long R, long K, const int8_t *W, long N,
                            const float *s, const float *b, float *y, long n0, long width) {
    long r = 0;
    for (; width == 4 && r + 4 <= R; r += 4) { /* 4 rows x 2 channels */
        for (long j = 0; j < 4; j += 2) {
            int32_t acc[8];
            const long n = n0 + j;
            dot4x2_vnni(q + r * K, K, W + n * K, W + (n + 1) * K, acc);
            for (int i = 0; i < 4; i++) {
                store_row(y + (r + i) * N, n, acc[2 * i], sx[r + i], s, b);
                store_row(y + (r + i) * N, n + 1, acc[2 * i + 1], sx[r + i], s, b);
            }
        }
    }
    for (; r < R; r++) /* the rest (decode at batch 1): one row, channel after channel */
        for (long j = 0; j < width; j++)
            store_row(y + r * N, n0 + j, dot1_vnni(q + r * K, W + (n0 + j) * K, K, R == 1), sx[r], s, b);
}

/* --- the entry points ---------------------------------------------------------------------------------- */

int gpt2kit_int8act_linear_abi(void) { return 2; } /* bumped when the signatures or isa codes below change */

/* The widest activation code of isa 3 for K inputs: sum_k |q[k] * W[n, k]| <= K * qmax * 128 stays
 * below 2^31 (and qmax within int16), so the int32 sums are exact: 21845 for K = 768, 5461 for 3072. */
static float a16_qmax(long K) {
    const long q = K > 0 ? 2147483647L / (128L * K) : 32767L;
    return (float)(q > 32767L ? 32767L : q < 127L ? 127L : q);
}

/* isa: 1 AVX2, 2 AVX-512 VNNI (the caller checked the CPU has it), 3 AVX2 with 16-bit activation
 * codes (qmax = a16_qmax(K) in place of 127: int16 activations, the weight-only accuracy class;
 * K above 131,072 would need qmax below 128 and is refused with -2). Returns 0, or -1 when the
 * scratch memory could not be allocated (y is then untouched). */
int gpt2kit_int8act_linear(const float *x, long R, long K, const int8_t *W, long N, const float *s,
                           const float *b, float *y, int threads, int isa) {
    if (R <= 0) return 0;
    if (isa == 3 && K > 131072L) return -2;
    const float qmax = isa == 3 ? a16_qmax(K) : 127.0f;
    float *sx = malloc(R * sizeof(float));
    /* rows of codes on 64-byte lines (a row of K bytes starts on one where K is a multiple of 64), so
     * a 64-byte load of them does not straddle two */
    const size_t bytes = (size_t)R * (size_t)(K > 0 ? K : 1) * (isa == 2 ? 1 : sizeof(int16_t));
    void *q = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!sx || !q) {
        free(sx);
        free(q);
        return -1;
    }
    const long blocks = (N + 3) / 4;
    /* Many rows (a prompt) go in tiles whose codes stay in the core's L2 while every channel block of
     * the thread passes over them (a multiple of 4 rows, for the 4-row blocks); a few rows are one tile. */
    const long row_bytes = (K > 0 ? K : 1) * (isa == 2 ? 1 : (long)sizeof(int16_t));
    long tile = (TILE_BYTES / row_bytes) & ~3L;
    tile = tile < 4 ? 4 : tile;
    solo_call sc = {0};
    threads = solo_begin(&sc, threads);
    #pragma omp parallel num_threads(threads)
    {
        SOLO_MARK(&sc);
        #pragma omp for schedule(static)
        for (long r = 0; r < R; r++)
            quantize_row(x + r * K, K, qmax, sx + r, isa == 2 ? NULL : (int16_t *)q + r * K,
                         isa == 2 ? (uint8_t *)q + r * K : NULL, NULL);
        for (long r0 = 0; r0 < R; r0 += tile) {
            const long rt = R - r0 < tile ? R - r0 : tile;
            const void *qt = (const char *)q + r0 * row_bytes;
            #pragma omp for schedule(static)
            for (long i = 0; i < blocks; i++) {
                const long n0 = 4 * i, width = N - n0 >= 4 ? 4 : N - n0;
                if (isa == 2) block_vnni(qt, sx + r0, rt, K, W, N, s, b, y + r0 * N, n0, width);
                else block_avx2(qt, sx + r0, rt, K, W, N, s, b, y + r0 * N, n0, width);
            }
        }
    }
    solo_end(&sc);
    free(sx);
    free(q);
    return 0;
}

/* The two halves of the arithmetic above around another int8 GEMM (torch._int_mm, oneDNN's, which is
 * faster for many rows): q (R, K) int8 and sx (R,) from x, and y from that GEMM's int32 sums acc
 * (R, N). The same operations as quantize_row and store_row, so the result is the same bits as
 * gpt2kit_int8act_linear's (and as gpt2kit/decode/int8act.py's torch formulation). Rows in parallel. */
void gpt2kit_int8act_quantize(const float *x, long R, long K, int8_t *q, float *sx, int threads) {
    solo_call sc = {0};
    threads = solo_begin(&sc, threads);
    #pragma omp parallel num_threads(threads)
    {
        SOLO_MARK(&sc);
        #pragma omp for schedule(static)
        for (long r = 0; r < R; r++) quantize_row(x + r * K, K, 127.0f, sx + r, NULL, NULL, q + r * K);
    }
    solo_end(&sc);
}

void gpt2kit_int8act_rescale(const int32_t *acc, long R, long N, const float *sx, const float *s, const float *b,
                             float *y, int threads) {
    solo_call sc = {0};
    threads = solo_begin(&sc, threads);
    #pragma omp parallel num_threads(threads)
    {
        SOLO_MARK(&sc);
        #pragma omp for schedule(static)
        for (long r = 0; r < R; r++)
            for (long n = 0; n < N; n++) store_row(y + r * N, n, acc[r * N + n], sx[r], s, b);
    }
    solo_end(&sc);
}

SOLO_EXPORT(int8act_linear)
