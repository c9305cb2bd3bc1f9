/* gpt2kit's batch-1 decode step in one native call: the network of decode/step.py's decode_step for
 * one row, every block and the head, with the products on gpt2kit's own kernels.
 *
 * Why: at batch 1 the products stream the weights, and the rest of a step, about a hundred small
 * PyTorch calls and their Python (layer norms, attention for one query, the cache write, GELU,
 * residual adds), took a large share of a float32 token and a larger one of an int8 token
 * (docs/benchmarks.md, "The rest of the step in C", has the timings). Here that rest is plain loops
 * per block, and the products are the same C functions the Python step
 * calls (passed in as pointers: csrc/f32_linear.c's and csrc/int8_linear.c's, each with its own
 * threads and csrc/solo.h fallback).
 *
 * What it computes, per block (x the residual stream, C floats):
 *   h = LayerNorm(x; ln_1); qkv = h @ c_attn (+ b); k, v of each head written to the cache at
 *   position P; y = softmax(q . K[0..P] / sqrt(hs)) V[0..P] per head; x += y @ attn.c_proj (+ b);
 *   h = LayerNorm(x; ln_2); x += gelu_tanh(h @ c_fc (+ b)) @ mlp.c_proj (+ b)
 * then logits = LayerNorm(x; ln_f) @ head. The same math as the spec in other summation orders:
 * LayerNorm's moments in double, GELU as x / (1 + exp(-2u)) (= 0.5 x (1 + tanh u), u the usual
 * sqrt(2/pi) (x + 0.044715 x^3)), exp by a degree-7 polynomial after range reduction (~2 ulp).
 * Equal to the Python step within float32 round-off (tests/test_decode_native_step.py: logits
 * within 1e-4 over many steps, the same greedy tokens).
 *
 * Attention runs the heads on OpenMP threads (the products' pool), with csrc/solo.h's fallback to one
 * thread while threads start late. Instruction set: AVX2 + FMA (the glue is a few microseconds;
 * AVX-512 would not be measurable). Legend: C n_embd, nh heads, hs head size, P cached tokens. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "solo.h"

typedef void (*f32_linear_fn)(const float *x, long M, long K, const float *W, long ldw, long N, const float *b,
                              float *y, int threads, int isa);
typedef void (*int8_linear_fn)(const float *x, long R, long K, const signed char *W, long N, const float *s,
                               const float *b, float *y, int threads);

typedef struct { /* one product, as decode/native_step.py fills it */
    long kind;          /* 1: float32 Wt (K, N), row stride ldw; 2: int8 W (N, K) with per-row scales */
    const void *w;
    const float *scale; /* int8 only */
    const float *bias;  /* NULL: none */
    long K, N, ldw;
} Mat;

typedef struct {
    const float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
    Mat attn, proj, fc, mlp;
} Block;

typedef struct {
    long C, nh, n_layer;
    float eps;
    const Block *blocks;
    const float *lnf_w, *lnf_b;
    Mat head;
    f32_linear_fn f32;
    int8_linear_fn int8;
    long f32_isa;
} Net;

int gpt2kit_step_abi(void) { return 1; } /* bumped when a struct or the signature below changes */

static void product(const Net *net, const Mat *m, const float *x, float *y, int threads) {
    if (m->kind == 1) net->f32(x, 1, m->K, (const float *)m->w, m->ldw, m->N, m->bias, y, threads, (int)net->f32_isa);
    else net->int8(x, 1, m->K, (const signed char *)m->w, m->N, m->scale, m->bias, y, threads);
}

static void layer_norm(const float *x, long C, const float *w, const float *b, float eps, float *out) {
    double s = 0.0, ss = 0.0;
    for (long i = 0; i < C; i++) s += x[i];
    const double mean = s / (double)C;
    for (long i = 0; i < C; i++) { const double d = x[i] - mean; ss += d * d; }
    const float m = (float)mean, r = (float)(1.0 / sqrt(ss / (double)C + (double)eps));
    for (long i = 0; i < C; i++) out[i] = (x[i] - m) * r * w[i] + b[i];
}

/* e^x for 8 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor polynomial to r^7 (Horner, FMA),
 * times 2^n built in the exponent bits. Inputs clamped to [-87, 88] (the result then saturates). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);   /* ln2's high bits */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);      /* and the rest */
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static void gelu(float *f, long n) { /* in place; n a multiple of 8 (C is, for every GPT-2 size) */
    const __m256 c = _mm256_set1_ps(-2.0f * 0.7978845608028654f), a = _mm256_set1_ps(0.044715f);
    const __m256 one = _mm256_set1_ps(1.0f);
    for (long i = 0; i < n; i += 8) {
        const __m256 x = _mm256_loadu_ps(f + i);
        const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 m2u = _mm256_mul_ps(c, _mm256_fmadd_ps(a, x3, x)); /* -2u */
        _mm256_storeu_ps(f + i, _mm256_div_ps(x, _mm256_add_ps(one, exp8(m2u))));
    }
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One head: scores over keys [0, P] (P + 1 of them: the new one was written at P), softmax, values.
 * q, out: hs floats; K, V: rows of hs floats with stride s_pos; sc: room for P + 8 floats. */
static void head(const float *q, const float *K, const float *V, long s_pos, long n, long hs, float *sc,
                 float *out) {
    const float scale = 1.0f / sqrtf((float)hs);
    float mx = -INFINITY;
    for (long j = 0; j < n; j++) {
        const float *k = K + j * s_pos;
        __m256 acc = _mm256_setzero_ps();
        for (long d = 0; d < hs; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
        sc[j] = hsum8(acc) * scale;
        if (sc[j] > mx) mx = sc[j];
    }
    const long n8 = (n + 7) & ~7L;
    for (long j = n; j < n8; j++) sc[j] = mx; /* padding, any finite value: masked to 0 below */
    __m256 tot = _mm256_setzero_ps();
    const __m256 vmx = _mm256_set1_ps(mx);
    for (long j = 0; j < n8; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vmx));
        if (j + 8 > n) { /* the padding lanes weigh nothing */
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)), lane));
            e = _mm256_and_ps(e, keep);
        }
        _mm256_storeu_ps(sc + j, e);
        tot = _mm256_add_ps(tot, e);
    }
    const float inv = 1.0f / hsum8(tot);
    __m256 acc[8]; /* hs <= 64 */
    const long nv = hs / 8;
    for (long d = 0; d < nv; d++) acc[d] = _mm256_setzero_ps();
    for (long j = 0; j < n; j++) {
        const __m256 p = _mm256_set1_ps(sc[j]);
        const float *v = V + j * s_pos;
        for (long d = 0; d < nv; d++) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * d), acc[d]);
    }
    const __m256 vi = _mm256_set1_ps(inv);
    for (long d = 0; d < nv; d++) _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], vi));
}

/* x (C): the token's embedding in, clobbered. kv: the batch row's cache, the float at
 * [layer, which (0 keys, 1 values), head, pos, d] at kv + layer s_layer + which s_kv + head s_head
 * + pos s_pos + d. Writes position P of every layer and logits (head.N floats). Returns 0, or -1
 * when a buffer cannot be allocated (nothing written then but possibly some cache columns at P,
 * which the caller rewrites on its fallback). */
int gpt2kit_step(const Net *net, float *x, float *kv, long s_layer, long s_kv, long s_head, long s_pos, long P,
                 float *logits, int threads) {
    const long C = net->C, nh = net->nh, hs = C / nh, n = P + 1;
    long widest = 4 * C;
    for (long l = 0; l < net->n_layer; l++) {
        const Block *b = &net->blocks[l];
        if (b->attn.N > widest) widest = b->attn.N;
        if (b->fc.N > widest) widest = b->fc.N;
    }
    float *buf = (float *)malloc(sizeof(float) * (size_t)(3 * C + widest + 8));
    float *sc = (float *)malloc(sizeof(float) * (size_t)(nh * (n + 8)));
    if (!buf || !sc || hs % 8 || hs > 64 || C % 8) {
        free(buf);
        free(sc);
        return -1;
    }
    float *h = buf, *y = h + C, *a = y + C, *wide = a + C; /* wide: qkv (3C) or the MLP's hidden (4C) */
    for (long l = 0; l < net->n_layer; l++) {
        const Block *b = &net->blocks[l];
        layer_norm(x, C, b->ln1_w, b->ln1_b, net->eps, h);
        product(net, &b->attn, h, wide, threads);
        float *K = kv + l * s_layer, *V = K + s_kv;
        for (long i = 0; i < nh; i++) {
            memcpy(K + i * s_head + P * s_pos, wide + C + i * hs, sizeof(float) * (size_t)hs);
            memcpy(V + i * s_head + P * s_pos, wide + 2 * C + i * hs, sizeof(float) * (size_t)hs);
        }
        solo_call call = {0};
        const int t = solo_begin(&call, threads);
        #pragma omp parallel num_threads(t)
        {
            SOLO_MARK(&call);
            #pragma omp for schedule(static)
            for (long i = 0; i < nh; i++)
                head(wide + i * hs, K + i * s_head, V + i * s_head, s_pos, n, hs, sc + i * (n + 8), y + i * hs);
        }
        solo_end(&call);
        product(net, &b->proj, y, a, threads);
        for (long i = 0; i < C; i++) x[i] += a[i];
        layer_norm(x, C, b->ln2_w, b->ln2_b, net->eps, h);
        product(net, &b->fc, h, wide, threads);
        gelu(wide, b->fc.N);
        product(net, &b->mlp, wide, a, threads);
        for (long i = 0; i < C; i++) x[i] += a[i];
    }
    layer_norm(x, C, net->lnf_w, net->lnf_b, net->eps, h);
    product(net, &net->head, h, logits, threads);
    free(buf);
    free(sc);
    return 0;
}

SOLO_EXPORT(step)
