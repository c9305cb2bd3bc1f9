/* gpt2kit's float32 product for a few rows, on the layout a float32 decode model keeps its matrices in.
 *
 *   y[m, n] = b[n] + sum_k x[m, k] * Wt[k, n]        (b NULL: no bias)
 *
 * x (M, K) float32, contiguous; Wt (K, N) float32 with row stride ldw >= N (decode/layout.py stores
 * a float32 nn.Linear's weight (N, K) as the transpose of a contiguous (K, N) tensor, as
 * transformers' Conv1D does; the tied LM head likewise); b (N,) float32 or NULL; y (M, N) float32,
 * contiguous. M is small (a decode step's rows): the cost is streaming Wt from memory once.
 *
 * How: Wt's rows are cut into PARTS contiguous halves (k < K/2 and the rest, on a multiple of KR), so a
 * thread streams one contiguous block of memory, whole rows at a time: measured on a 2-core EPYC
 * (docs/benchmarks.md), this reads a step's matrices faster than giving each thread half of
 * every row (the previous design), which cut every row into two short runs the prefetcher restarts on.
 * A part adds its rows into its own partial y (part 0 into y itself, after the bias; the others into
 * scratch), chunk by chunk of CHUNK / M columns (a chunk of y stays in L2), KR rows of Wt at a time:
 * for each 16 (AVX-512) or 8 (AVX2) columns, KR weight vectors are loaded once and feed KR * M FMAs
 * into one accumulator per row, loaded and stored once, while the same columns of the next KR rows
 * are prefetched into L2 (the hardware prefetcher alone left the 8 streams slower). Then
 * y += partial, column by column.
 * Threads take the (part, column group) items of an OpenMP loop: with 2 threads one part each; with
 * more, the columns are split too; with one, it runs both parts in turn. Each output is summed the
 * same way whichever thread runs it, so the result does not depend on the thread count (csrc/solo.h
 * relies on that). The sum is (b + rows of part 0 in k order) + (rows of part 1 in k order), not
 * MKL's order: equal to float32 round-off, not to the bit.
 *
 * Two instruction sets in one library (chosen by gpt2kit/decode/native.py from the CPU's flags; the
 * AVX-512 function by a target attribute, so the library loads on AVX2 CPUs): isa 1 AVX2 + FMA
 * (8 lanes, the column tail scalar in the lanes' order), isa 2 AVX-512F (16 lanes, the tail masked).
 * Legend: M rows, K in, N out. */
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#include "solo.h"

#ifndef CHUNK
#define CHUNK 16384 /* y floats per chunk (CHUNK / M columns, rounded down to 16): 64 KiB of y, in L2 */
#endif
#define KR 8     /* rows of Wt per pass over a chunk of y */
#define MAXM 8   /* rows of x per pass: more rows run in passes of MAXM */
#define PARTS 2  /* contiguous blocks of Wt's rows, each summed on its own */

#define AVX512 __attribute__((target("avx512f")))

/* y[0:M, c0:c1] += x[0:M, k0:k1] @ Wt[k0:k1, c0:c1], M <= MAXM; y's row stride is N. */
AVX512 static void rows512(const float *x, long M, long K, const float *W, long ldw, float *y, long N,
                           long k0, long k1, long c0, long c1) {
    const long w = c1 - c0, full = w & ~15L;
    const __mmask16 tm = (__mmask16)((1u << (w - full)) - 1u);
    long k = k0;
    for (; k + KR <= k1; k += KR) {
        const float *wk = W + k * ldw + c0, *next = k + 2 * KR <= k1 ? wk + KR * ldw : NULL;
        __m512 xs[MAXM][KR];
        for (long m = 0; m < M; m++)
            for (int i = 0; i < KR; i++) xs[m][i] = _mm512_set1_ps(x[m * K + k + i]);
        for (long c = 0; c < full; c += 16) {
            if (next)
                for (int i = 0; i < KR; i++) _mm_prefetch((const char *)(next + i * ldw + c), _MM_HINT_T1);
            __m512 ws[KR];
            for (int i = 0; i < KR; i++) ws[i] = _mm512_loadu_ps(wk + i * ldw + c);
            for (long m = 0; m < M; m++) {
                float *ym = y + m * N + c0 + c;
                __m512 acc = _mm512_loadu_ps(ym);
                for (int i = 0; i < KR; i++) acc = _mm512_fmadd_ps(ws[i], xs[m][i], acc);
                _mm512_storeu_ps(ym, acc);
            }
        }
        if (tm) {
            __m512 ws[KR];
            for (int i = 0; i < KR; i++) ws[i] = _mm512_maskz_loadu_ps(tm, wk + i * ldw + full);
            for (long m = 0; m < M; m++) {
                float *ym = y + m * N + c0 + full;
                __m512 acc = _mm512_maskz_loadu_ps(tm, ym);
                for (int i = 0; i < KR; i++) acc = _mm512_fmadd_ps(ws[i], xs[m][i], acc);
                _mm512_mask_storeu_ps(ym, tm, acc);
            }
        }
    }
    for (; k < k1; k++) { /* the part's last rows, fewer than KR */
        const float *wk = W + k * ldw + c0;
        for (long m = 0; m < M; m++) {
            const __m512 xm = _mm512_set1_ps(x[m * K + k]);
            float *ym = y + m * N + c0;
            for (long c = 0; c < full; c += 16)
                _mm512_storeu_ps(ym + c, _mm512_fmadd_ps(_mm512_loadu_ps(wk + c), xm, _mm512_loadu_ps(ym + c)));
            if (tm)
                _mm512_mask_storeu_ps(ym + full, tm, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, wk + full), xm,
                                                                     _mm512_maskz_loadu_ps(tm, ym + full)));
        }
    }
}

static void rows256(const float *x, long M, long K, const float *W, long ldw, float *y, long N,
                    long k0, long k1, long c0, long c1) {
    const long w = c1 - c0, full = w & ~7L;
    long k = k0;
    for (; k + KR <= k1; k += KR) {
        const float *wk = W + k * ldw + c0, *next = k + 2 * KR <= k1 ? wk + KR * ldw : NULL;
        for (long c = 0; c < full; c += 8) {
            if (next && (c & 15) == 0) /* one prefetch per 64-byte line */
                for (int i = 0; i < KR; i++) _mm_prefetch((const char *)(next + i * ldw + c), _MM_HINT_T1);
            __m256 ws[KR];
            for (int i = 0; i < KR; i++) ws[i] = _mm256_loadu_ps(wk + i * ldw + c);
            for (long m = 0; m < M; m++) {
                const float *xm = x + m * K + k;
                float *ym = y + m * N + c0 + c;
                __m256 acc = _mm256_loadu_ps(ym);
                for (int i = 0; i < KR; i++) acc = _mm256_fmadd_ps(ws[i], _mm256_broadcast_ss(xm + i), acc);
                _mm256_storeu_ps(ym, acc);
            }
        }
        for (long c = full; c < w; c++) /* the column tail, in the same order as the lanes */
            for (long m = 0; m < M; m++) {
                const float *xm = x + m * K + k;
                float *ym = y + m * N + c0 + c;
                for (int i = 0; i < KR; i++) *ym = __builtin_fmaf(wk[i * ldw + c], xm[i], *ym);
            }
    }
    for (; k < k1; k++) {
        const float *wk = W + k * ldw + c0;
        for (long m = 0; m < M; m++) {
            const __m256 xm = _mm256_set1_ps(x[m * K + k]);
            float *ym = y + m * N + c0;
            for (long c = 0; c < full; c += 8)
                _mm256_storeu_ps(ym + c, _mm256_fmadd_ps(_mm256_loadu_ps(wk + c), xm, _mm256_loadu_ps(ym + c)));
            for (long c = full; c < w; c++) ym[c] = __builtin_fmaf(wk[c], x[m * K + k], ym[c]);
        }
    }
}

/* One item: part p's rows of Wt into its partial (y for part 0, after the bias), columns n0:n1. */
static void item(const float *x, long M, long K, const float *W, long ldw, long N, const float *b,
                 float *y, float *scratch, int isa, long p, long n0, long n1) {
    const long k0 = p == 0 ? 0 : (K / PARTS * p) & ~(long)(KR - 1);
    const long k1 = p == PARTS - 1 ? K : (K / PARTS * (p + 1)) & ~(long)(KR - 1);
    float *out = p == 0 ? y : scratch + (p - 1) * M * N;
    for (long m = 0; m < M; m++)
        for (long c = n0; c < n1; c++) out[m * N + c] = p == 0 && b ? b[c] : 0.0f;
    const long rows = M < MAXM ? M : MAXM, width = (CHUNK / rows) & ~15L;
    for (long c = n0; c < n1; c += width) {
        const long c1 = c + width < n1 ? c + width : n1;
        for (long m = 0; m < M; m += MAXM) {
            const long r = M - m < MAXM ? M - m : MAXM;
            if (isa == 2) rows512(x + m * K, r, K, W, ldw, out + m * N, N, k0, k1, c, c1);
            else rows256(x + m * K, r, K, W, ldw, out + m * N, N, k0, k1, c, c1);
        }
    }
}

int gpt2kit_f32_linear_abi(void) { return 1; } /* bumped when the signature below changes */

/* isa: 1 AVX2 + FMA, 2 AVX-512F (the caller checked the CPU has it). */
void gpt2kit_f32_linear(const float *x, long M, long K, const float *W, long ldw, long N, const float *b,
                        float *y, int threads, int isa) {
    const long units = (N + 15) / 16; /* columns are split in units of 16 (one cache line) */
    float *scratch = (float *)malloc(sizeof(float) * (size_t)((PARTS - 1) * M * N));
    if (!scratch) { /* no memory for the partials: one part's worth of work, in k order, into y */
        for (long m = 0; m < M; m++)
            for (long c = 0; c < N; c++) y[m * N + c] = b ? b[c] : 0.0f;
        for (long m = 0; m < M; m += MAXM) {
            const long r = M - m < MAXM ? M - m : MAXM;
            if (isa == 2) rows512(x + m * K, r, K, W, ldw, y + m * N, N, 0, K, 0, N);
            else rows256(x + m * K, r, K, W, ldw, y + m * N, N, 0, K, 0, N);
        }
        return;
    }
    solo_call sc = {0};
    threads = solo_begin(&sc, threads);
    /* column groups: 1 while the parts keep the threads busy, else enough for one item per thread */
    const long groups = threads <= PARTS ? 1 : (threads + PARTS - 1) / PARTS;
    #pragma omp parallel num_threads(threads)
    {
        SOLO_MARK(&sc);
        #pragma omp for schedule(static)
        for (long it = 0; it < PARTS * groups; it++) {
            const long p = it % PARTS, g = it / PARTS;
            const long n0 = units * g / groups * 16, n1e = units * (g + 1) / groups * 16;
            item(x, M, K, W, ldw, N, b, y, scratch, isa, p, n0, n1e < N ? n1e : N);
        }
        #pragma omp for schedule(static)
        for (long u = 0; u < units; u++) { /* y += the other parts, in part order */
            const long c0 = u * 16, c1 = c0 + 16 < N ? c0 + 16 : N;
            for (long m = 0; m < M; m++)
                for (long p = 1; p < PARTS; p++) {
                    const float *s = scratch + (p - 1) * M * N + m * N;
                    for (long c = c0; c < c1; c++) y[m * N + c] += s[c];
                }
        }
    }
    solo_end(&sc);
    free(scratch);
}

SOLO_EXPORT(f32_linear)
