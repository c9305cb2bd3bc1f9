/* gpt2kit's int8 weight-only product for x86 CPUs with AVX2 and FMA.
 *
 *   y[r, n] = s[n] * sum_k W[n, k] * x[r, k]  (+ b[n])
 *
 * x (R, K) float32 activations, W (N, K) int8 weights (one row per output channel), s (N,) float32
 * scales, b (N,) float32 bias or NULL, y (R, N) float32; all contiguous. Weight-only int8: the
 * activations stay float32 and the int8 dot product is exact up to float32 summation order, the
 * per-channel scale is applied once per output (not once per weight, as ATen's
 * _weight_int8pack_mm does).
 *
 * Why it exists: a decode step reads every weight once, so the kernel should stream int8 at memory
 * bandwidth. Per 8 weights this does one widening load (int8 -> int32), one convert to float and
 * one FMA per row of x. With one row of x (a decode step at batch 1) the channels are summed one
 * after another, so each thread reads its part of W as one sequential stream, prefetched 4 KiB
 * ahead (faster than interleaving 4 channels). With more rows, 2 channels and 4 rows at a time
 * (then pairs of rows, then one), so each widened weight feeds four FMAs and a block of 4 channels is
 * read from memory once and from cache for the other rows (faster at 8 rows than 4 channels and 2
 * rows; prefetching the next block there was not reliably faster, so it is not done; the figures are
 * in docs/benchmarks.md, "Figures behind the code's choices"). Threads split the
 * output channels (OpenMP: the process's libgomp, the one PyTorch loaded, so the two share one
 * thread pool).
 *
 * Built by gpt2kit/decode/native.py with the system's C compiler on first use; measured against
 * the other kernels like any of them (gpt2kit/decode/int8.py). Legend: R rows, K in, N out. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "solo.h"

/* How far ahead of the single-row loop to prefetch the weights, in bytes: 4 KiB was the fastest of
 * 0.5-16 KiB on a Zen 3 EPYC over a whole GPT-2 124M step's matrices. A prefetch never faults, so
 * prefetching past the end of the matrix is harmless. */
#define PREFETCH 4096

static inline __m256 widen8(const int8_t *p) { /* 8 int8 -> 8 float32 */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float tail(const int8_t *w, const float *x, long k0, long K) { /* K % 8 leftovers */
    float t = 0.0f;
    for (long k = k0; k < K; k++) t += (float)w[k] * x[k];
    return t;
}

static inline void store4(float *y, const float *s, const float *b, long n0, float d0, float d1, float d2,
                          float d3) {
    y[0] = d0 * s[n0]; y[1] = d1 * s[n0 + 1]; y[2] = d2 * s[n0 + 2]; y[3] = d3 * s[n0 + 3];
    if (b) { y[0] += b[n0]; y[1] += b[n0 + 1]; y[2] += b[n0 + 2]; y[3] += b[n0 + 3]; }
}

/* Output channels n0..n0+3, every row of x. */
static void block4(const float *x, long R, long K, const int8_t *W, long N, const float *s, const float *b,
                   float *y, long n0) {
    const int8_t *w0 = W + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const long K8 = K & ~7L;
    long r = 0;
    for (; r + 4 <= R; r += 4) { /* four rows, two channels at a time: each widened weight feeds four FMAs */
        const float *xa = x + r * K, *xb = xa + K, *xc = xb + K, *xd = xc + K;
        for (int j = 0; j < 4; j += 2) {
            const int8_t *u = W + (n0 + j) * K, *v = u + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
            for (long k = 0; k < K8; k += 8) {
                __m256 qu = widen8(u + k), qv = widen8(v + k);
                __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
                __m256 vc = _mm256_loadu_ps(xc + k), vd = _mm256_loadu_ps(xd + k);
                a0 = _mm256_fmadd_ps(qu, va, a0); a1 = _mm256_fmadd_ps(qv, va, a1);
                b0 = _mm256_fmadd_ps(qu, vb, b0); b1 = _mm256_fmadd_ps(qv, vb, b1);
                c0 = _mm256_fmadd_ps(qu, vc, c0); c1 = _mm256_fmadd_ps(qv, vc, c1);
                d0 = _mm256_fmadd_ps(qu, vd, d0); d1 = _mm256_fmadd_ps(qv, vd, d1);
            }
            const long n = n0 + j;
            const float bu = b ? b[n] : 0.0f, bv = b ? b[n + 1] : 0.0f;
            float *ya = y + r * N + n;
            ya[0] = (hsum(a0) + tail(u, xa, K8, K)) * s[n]; ya[1] = (hsum(a1) + tail(v, xa, K8, K)) * s[n + 1];
            ya += N;
            ya[0] = (hsum(b0) + tail(u, xb, K8, K)) * s[n]; ya[1] = (hsum(b1) + tail(v, xb, K8, K)) * s[n + 1];
            ya += N;
            ya[0] = (hsum(c0) + tail(u, xc, K8, K)) * s[n]; ya[1] = (hsum(c1) + tail(v, xc, K8, K)) * s[n + 1];
            ya += N;
            ya[0] = (hsum(d0) + tail(u, xd, K8, K)) * s[n]; ya[1] = (hsum(d1) + tail(v, xd, K8, K)) * s[n + 1];
            if (b) for (int i = 0; i < 4; i++) { y[(r + i) * N + n] += bu; y[(r + i) * N + n + 1] += bv; }
        }
    }
    for (; r + 2 <= R; r += 2) { /* two rows: each widened weight feeds two FMAs */
        const float *xa = x + r * K, *xb = xa + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
        for (long k = 0; k < K8; k += 8) {
            __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
            __m256 q0 = widen8(w0 + k), q1 = widen8(w1 + k), q2 = widen8(w2 + k), q3 = widen8(w3 + k);
            a0 = _mm256_fmadd_ps(q0, va, a0); a1 = _mm256_fmadd_ps(q1, va, a1);
            a2 = _mm256_fmadd_ps(q2, va, a2); a3 = _mm256_fmadd_ps(q3, va, a3);
            c0 = _mm256_fmadd_ps(q0, vb, c0); c1 = _mm256_fmadd_ps(q1, vb, c1);
            c2 = _mm256_fmadd_ps(q2, vb, c2); c3 = _mm256_fmadd_ps(q3, vb, c3);
        }
        store4(y + r * N + n0, s, b, n0, hsum(a0) + tail(w0, xa, K8, K), hsum(a1) + tail(w1, xa, K8, K),
               hsum(a2) + tail(w2, xa, K8, K), hsum(a3) + tail(w3, xa, K8, K));
        store4(y + (r + 1) * N + n0, s, b, n0, hsum(c0) + tail(w0, xb, K8, K), hsum(c1) + tail(w1, xb, K8, K),
               hsum(c2) + tail(w2, xb, K8, K), hsum(c3) + tail(w3, xb, K8, K));
    }
    for (; r < R; r++) { /* one row (decode at batch 1): channel after channel, one sequential stream */
        const float *xa = x + r * K;
        const int8_t *ws[4] = {w0, w1, w2, w3};
        float d[4];
        for (int j = 0; j < 4; j++) {
            const int8_t *w = ws[j];
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            long k = 0;
            for (; k + 32 <= K8; k += 32) {
                if ((k & 63) == 0) _mm_prefetch((const char *)(w + k + PREFETCH), _MM_HINT_T0);
                a0 = _mm256_fmadd_ps(widen8(w + k), _mm256_loadu_ps(xa + k), a0);
                a1 = _mm256_fmadd_ps(widen8(w + k + 8), _mm256_loadu_ps(xa + k + 8), a1);
                a2 = _mm256_fmadd_ps(widen8(w + k + 16), _mm256_loadu_ps(xa + k + 16), a2);
                a3 = _mm256_fmadd_ps(widen8(w + k + 24), _mm256_loadu_ps(xa + k + 24), a3);
            }
            for (; k < K8; k += 8) a0 = _mm256_fmadd_ps(widen8(w + k), _mm256_loadu_ps(xa + k), a0);
            d[j] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + tail(w, xa, K8, K);
        }
        store4(y + r * N + n0, s, b, n0, d[0], d[1], d[2], d[3]);
    }
}

/* One output channel (the last N % 4), every row. */
static void channel(const float *x, long R, long K, const int8_t *W, long N, const float *s, const float *b,
                    float *y, long n) {
    const int8_t *w = W + n * K;
    const long K8 = K & ~7L;
    for (long r = 0; r < R; r++) {
        const float *xa = x + r * K;
        __m256 a = _mm256_setzero_ps();
        for (long k = 0; k < K8; k += 8) a = _mm256_fmadd_ps(widen8(w + k), _mm256_loadu_ps(xa + k), a);
        y[r * N + n] = (hsum(a) + tail(w, xa, K8, K)) * s[n] + (b ? b[n] : 0.0f);
    }
}

int gpt2kit_int8_linear_abi(void) { return 1; } /* bumped when the signature below changes */

void gpt2kit_int8_linear(const float *x, long R, long K, const int8_t *W, long N, const float *s,
                         const float *b, float *y, int threads) {
    const long blocks = N / 4;
    solo_call sc = {0};
    threads = solo_begin(&sc, threads);
    #pragma omp parallel num_threads(threads)
    {
        SOLO_MARK(&sc);
        #pragma omp for schedule(static)
        for (long i = 0; i < blocks + N % 4; i++) {
            if (i < blocks) block4(x, R, K, W, N, s, b, y, 4 * i);
            else channel(x, R, K, W, N, s, b, y, 4 * blocks + (i - blocks));
        }
    }
    solo_end(&sc);
}

SOLO_EXPORT(int8_linear)
