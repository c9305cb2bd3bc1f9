/* gpt2kit's float32 product for a few rows, on the layout a float32 decode model keeps its matrices in.
 *
 *   y[m, n] = b[n] + sum_k x[m, k] * Wt[k, n]        (b NULL: no bias)
 *
 * x (M, K) float32, contiguous; Wt (K, N) float32 with row stride ldw >= N (decode/layout.py stores
 * a float32 nn.Linear's weight (N, K) as the transpose of a contiguous (K, N) tensor, as
 * transformers' Conv1D does; the tied LM head likewise); b (N,) float32 or NULL; y (M, N) float32,
 * contiguous. M is small (a decode step's rows): the cost is streaming Wt from memory once.
 *
 * How: threads split the output columns into contiguous ranges (OpenMP: the libgomp PyTorch loaded,
 * one thread pool for both); a thread walks its range in chunks of CHUNK / M columns and, for each chunk,
 * goes down the rows of Wt four at a time, adding x[m, k] * Wt[k, chunk] into y[m, chunk] (which stays
 * in L2: a chunk is CHUNK floats of y). So each thread reads, per row k, CHUNK contiguous floats
 * (whole cache lines, ahead of which the hardware prefetcher runs), each weight is loaded once and
 * feeds M FMAs, and nothing is reduced across lanes. The sum runs in k order (bias first), not in
 * MKL's order: equal to float32 round-off, not to the bit.
 *
 * Two instruction sets in one library (chosen by gpt2kit/decode/native.py from the CPU's flags; the
 * AVX-512 function by a target attribute, so the library loads on AVX2 CPUs): isa 1 AVX2 + FMA
 * (8 lanes, the column tail scalar), isa 2 AVX-512F (16 lanes, the tail masked).
 * Legend: M rows, K in, N out. */
#include <immintrin.h>
#include <omp.h>

#include "solo.h"

#ifndef CHUNK
#define CHUNK 16384 /* y floats per chunk (CHUNK / M columns, rounded down to 16): 64 KiB of y, in L2 */
#endif
#ifndef PF_ROWS
#define PF_ROWS 0 /* software prefetch this many rows of Wt ahead (0: the hardware prefetcher alone) */
#endif
#define MAXM 8 /* rows per pass: more rows run in passes of MAXM */

#define AVX512 __attribute__((target("avx512f")))

/* y[0:M, c0:c1] = (b) + x[0:M, :] @ Wt[:, c0:c1], M <= MAXM. */
AVX512 static void chunk512(const float *x, long M, long K, const float *W, long ldw, const float *b,
                            float *y, long N, long c0, long c1) {
    const long w = c1 - c0, full = w & ~15L;
    const __mmask16 tm = (__mmask16)((1u << (w - full)) - 1u);
    for (long m = 0; m < M; m++) {
        float *ym = y + m * N + c0;
        for (long c = 0; c < w; c++) ym[c] = b ? b[c0 + c] : 0.0f;
    }
    long k = 0;
    for (; k + 4 <= K; k += 4) {
        const float *w0 = W + k * ldw + c0, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
#if PF_ROWS
        const float *p = W + (k + PF_ROWS) * ldw + c0;
        for (long c = 0; c < w; c += 16) {
            _mm_prefetch((const char *)(p + c), _MM_HINT_T0); _mm_prefetch((const char *)(p + ldw + c), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 2 * ldw + c), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 3 * ldw + c), _MM_HINT_T0);
        }
#endif
        __m512 xs[MAXM][4];
        for (long m = 0; m < M; m++)
            for (int i = 0; i < 4; i++) xs[m][i] = _mm512_set1_ps(x[m * K + k + i]);
        for (long c = 0; c < full; c += 16) {
            const __m512 a = _mm512_loadu_ps(w0 + c), bb = _mm512_loadu_ps(w1 + c);
            const __m512 cc = _mm512_loadu_ps(w2 + c), d = _mm512_loadu_ps(w3 + c);
            for (long m = 0; m < M; m++) {
                float *ym = y + m * N + c0 + c;
                __m512 acc = _mm512_loadu_ps(ym);
                acc = _mm512_fmadd_ps(a, xs[m][0], acc);
                acc = _mm512_fmadd_ps(bb, xs[m][1], acc);
                acc = _mm512_fmadd_ps(cc, xs[m][2], acc);
                acc = _mm512_fmadd_ps(d, xs[m][3], acc);
                _mm512_storeu_ps(ym, acc);
            }
        }
        if (tm) {
            const __m512 a = _mm512_maskz_loadu_ps(tm, w0 + full), bb = _mm512_maskz_loadu_ps(tm, w1 + full);
            const __m512 cc = _mm512_maskz_loadu_ps(tm, w2 + full), d = _mm512_maskz_loadu_ps(tm, w3 + full);
            for (long m = 0; m < M; m++) {
                float *ym = y + m * N + c0 + full;
                __m512 acc = _mm512_maskz_loadu_ps(tm, ym);
                acc = _mm512_fmadd_ps(a, xs[m][0], acc);
                acc = _mm512_fmadd_ps(bb, xs[m][1], acc);
                acc = _mm512_fmadd_ps(cc, xs[m][2], acc);
                acc = _mm512_fmadd_ps(d, xs[m][3], acc);
                _mm512_mask_storeu_ps(ym, tm, acc);
            }
        }
    }
    for (; k < K; k++) { /* the last K % 4 rows of Wt */
        const float *w0 = W + k * ldw + c0;
        for (long m = 0; m < M; m++) {
            const __m512 xm = _mm512_set1_ps(x[m * K + k]);
            float *ym = y + m * N + c0;
            for (long c = 0; c < full; c += 16)
                _mm512_storeu_ps(ym + c, _mm512_fmadd_ps(_mm512_loadu_ps(w0 + c), xm, _mm512_loadu_ps(ym + c)));
            if (tm)
                _mm512_mask_storeu_ps(ym + full, tm, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, w0 + full), xm,
                                                                     _mm512_maskz_loadu_ps(tm, ym + full)));
        }
    }
}

static void chunk256(const float *x, long M, long K, const float *W, long ldw, const float *b,
                     float *y, long N, long c0, long c1) {
    const long w = c1 - c0, full = w & ~7L;
    for (long m = 0; m < M; m++) {
        float *ym = y + m * N + c0;
        for (long c = 0; c < w; c++) ym[c] = b ? b[c0 + c] : 0.0f;
    }
    long k = 0;
    for (; k + 4 <= K; k += 4) {
        const float *w0 = W + k * ldw + c0, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
#if PF_ROWS
        const float *p = W + (k + PF_ROWS) * ldw + c0;
        for (long c = 0; c < w; c += 16) {
            _mm_prefetch((const char *)(p + c), _MM_HINT_T0); _mm_prefetch((const char *)(p + ldw + c), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 2 * ldw + c), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 3 * ldw + c), _MM_HINT_T0);
        }
#endif
        __m256 xs[MAXM][4];
        for (long m = 0; m < M; m++)
            for (int i = 0; i < 4; i++) xs[m][i] = _mm256_set1_ps(x[m * K + k + i]);
        for (long c = 0; c < full; c += 8) {
            const __m256 a = _mm256_loadu_ps(w0 + c), bb = _mm256_loadu_ps(w1 + c);
            const __m256 cc = _mm256_loadu_ps(w2 + c), d = _mm256_loadu_ps(w3 + c);
            for (long m = 0; m < M; m++) {
                float *ym = y + m * N + c0 + c;
                __m256 acc = _mm256_loadu_ps(ym);
                acc = _mm256_fmadd_ps(a, xs[m][0], acc);
                acc = _mm256_fmadd_ps(bb, xs[m][1], acc);
                acc = _mm256_fmadd_ps(cc, xs[m][2], acc);
                acc = _mm256_fmadd_ps(d, xs[m][3], acc);
                _mm256_storeu_ps(ym, acc);
            }
        }
        for (long c = full; c < w; c++) /* the column tail, in the same order as the lanes */
            for (long m = 0; m < M; m++) {
                const float *xm = x + m * K + k;
                float *ym = y + m * N + c0 + c;
                *ym = __builtin_fmaf(w0[c], xm[0], *ym);
                *ym = __builtin_fmaf(w1[c], xm[1], *ym);
                *ym = __builtin_fmaf(w2[c], xm[2], *ym);
                *ym = __builtin_fmaf(w3[c], xm[3], *ym);
            }
    }
    for (; k < K; k++) {
        const float *w0 = W + k * ldw + c0;
        for (long m = 0; m < M; m++) {
            const __m256 xm = _mm256_set1_ps(x[m * K + k]);
            float *ym = y + m * N + c0;
            for (long c = 0; c < full; c += 8)
                _mm256_storeu_ps(ym + c, _mm256_fmadd_ps(_mm256_loadu_ps(w0 + c), xm, _mm256_loadu_ps(ym + c)));
            for (long c = full; c < w; c++) ym[c] = __builtin_fmaf(w0[c], x[m * K + k], ym[c]);
        }
    }
}

int gpt2kit_f32_linear_abi(void) { return 1; } /* bumped when the signature below changes */

/* isa: 1 AVX2 + FMA, 2 AVX-512F (the caller checked the CPU has it). */
void gpt2kit_f32_linear(const float *x, long M, long K, const float *W, long ldw, long N, const float *b,
                        float *y, int threads, int isa) {
    const long units = (N + 15) / 16; /* threads split the columns in units of 16 (one cache line) */
    threads = solo_threads(threads);
    double starts[SOLO_MAX_THREADS] = {0};
    const double t0 = threads > 1 ? solo_now() : 0.0;
    #pragma omp parallel num_threads(threads)
    {
        if (threads > 1) SOLO_START(starts, threads);
        const int T = omp_get_num_threads(), t = omp_get_thread_num();
        long u0 = units * t / T, u1 = units * (t + 1) / T;
        long n0 = u0 * 16, n1 = u1 * 16 < N ? u1 * 16 : N;
        const long rows = M < MAXM ? M : MAXM, width = (CHUNK / rows) & ~15L;
        for (long c = n0; c < n1; c += width) {
            const long c1 = c + width < n1 ? c + width : n1;
            for (long m = 0; m < M; m += MAXM) {
                const long r = M - m < MAXM ? M - m : MAXM;
                if (isa == 2) chunk512(x + m * K, r, K, W, ldw, b, y + m * N, N, c, c1);
                else chunk256(x + m * K, r, K, W, ldw, b, y + m * N, N, c, c1);
            }
        }
    }
    solo_after(threads, t0, starts);
}

SOLO_EXPORT(f32_linear)
