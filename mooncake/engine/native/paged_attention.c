/* Decode attention over a paged KV pool (one new query token per sequence), float32.
 *
 * Built at run time by mooncake/engine/native/__init__.py with HEAD_DIM and PAGE_TOKENS
 * fixed at compile time, so the inner loops are fixed-width vector loops the compiler keeps
 * in registers:
 *
 *   q      [B, kv_heads, group, HEAD_DIM]       group = query heads per KV head (GQA)
 *   kpool  [pages, kv_heads, HEAD_DIM, PAGE_TOKENS]   K of a page, transposed: the scores of
 *          a page's PAGE_TOKENS tokens are PAGE_TOKENS-wide FMAs over HEAD_DIM, with no
 *          horizontal sums
 *   vpool  [pages, kv_heads, PAGE_TOKENS, HEAD_DIM]
 *   table  [B, max_pages] int32: the pool pages of sequence b, in order
 *   lens   [B] int32: tokens of sequence b to attend to (its new token included)
 *   out    [B, kv_heads, group, HEAD_DIM]
 *
 * One job per (sequence, KV head); jobs are spread over the calling process's OpenMP
 * threads (torch's own runtime: the loader links the libgomp torch already loaded).
 * Scores are kept for the whole sequence (two passes: scores + softmax, then the weighted
 * sum of V), which reads every K and V byte of the sequence once from memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef PAGE_TOKENS
#error "PAGE_TOKENS must be defined"
#endif
#define D HEAD_DIM
#define P PAGE_TOKENS

static void scores_of_page(const float* qs, const float* kt, float* out) {
    /* out[o] = sum_d qs[d] * K[o][d], K stored transposed as kt[d * P + o]; four
     * independent accumulators hide the FMA latency. */
    float a0[P], a1[P], a2[P], a3[P];
    for (int o = 0; o < P; o++) { a0[o] = 0.f; a1[o] = 0.f; a2[o] = 0.f; a3[o] = 0.f; }
    int d = 0;
    for (; d + 4 <= D; d += 4) {
        for (int o = 0; o < P; o++) {
            a0[o] += qs[d] * kt[d * P + o];
            a1[o] += qs[d + 1] * kt[(d + 1) * P + o];
            a2[o] += qs[d + 2] * kt[(d + 2) * P + o];
            a3[o] += qs[d + 3] * kt[(d + 3) * P + o];
        }
    }
    for (; d < D; d++)
        for (int o = 0; o < P; o++) a0[o] += qs[d] * kt[d * P + o];
    for (int o = 0; o < P; o++) out[o] = (a0[o] + a1[o]) + (a2[o] + a3[o]);
}

static void softmax_inplace(float* s, int n, int width) {
    float mx = s[0];
    for (int t = 1; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    float tot = 0.f;
    for (int t = 0; t < n; t++) { float e = expf(s[t] - mx); s[t] = e; tot += e; }
    float inv = 1.f / tot;
    for (int t = 0; t < n; t++) s[t] *= inv;
    for (int t = n; t < width; t++) s[t] = 0.f;  /* the unused tail of the last page */
}

static void one_job(const float* qh, const float* kpool, const float* vpool,
                    const int32_t* pages, int n, int h, int kv_heads, int group,
                    float scale, float* s, float* out) {
    const size_t page = (size_t)kv_heads * P * D;
    const int npg = (n + P - 1) / P;
    const int width = npg * P;
    for (int i = 0; i < group; i++) {
        float qs[D];
        for (int d = 0; d < D; d++) qs[d] = qh[i * D + d] * scale;
        float* si = s + (size_t)i * width;
        for (int j = 0; j < npg; j++)
            scores_of_page(qs, kpool + (size_t)pages[j] * page + (size_t)h * D * P, si + j * P);
        softmax_inplace(si, n, width);
        float acc0[D], acc1[D];
        for (int d = 0; d < D; d++) { acc0[d] = 0.f; acc1[d] = 0.f; }
        for (int j = 0; j < npg; j++) {
            const float* vh = vpool + (size_t)pages[j] * page + (size_t)h * P * D;
            const float* w = si + j * P;
            /* Only the written positions: the rest of the last page may hold anything (a
             * weight of 0 times a NaN left there is still NaN). */
            const int m = n - j * P < P ? n - j * P : P;
            int o = 0;
            for (; o + 1 < m; o += 2) {
                const float w0 = w[o], w1 = w[o + 1];
                for (int d = 0; d < D; d++) {
                    acc0[d] += w0 * vh[o * D + d];
                    acc1[d] += w1 * vh[(o + 1) * D + d];
                }
            }
            if (o < m)
                for (int d = 0; d < D; d++) acc0[d] += w[o] * vh[o * D + d];
        }
        for (int d = 0; d < D; d++) out[i * D + d] = acc0[d] + acc1[d];
    }
}

int mc_paged_decode_f32(const float* q, const float* kpool, const float* vpool,
                        const int32_t* table, const int32_t* lens, float* out, int batch,
                        int kv_heads, int group, int max_pages, float scale, int threads) {
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float* s = NULL;
        size_t cap = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int job = 0; job < batch * kv_heads; job++) {
            const int b = job / kv_heads, h = job % kv_heads;
            const int n = lens[b];
            if (n < 1 || n > max_pages * P) { failed = 1; continue; }
            const size_t need = (size_t)group * ((n + P - 1) / P) * P;
            if (need > cap) {
                free(s);
                cap = need * 2;
                s = (float*)malloc(sizeof(float) * cap);
                if (s == NULL) { cap = 0; failed = 1; continue; }
            }
            const size_t row = ((size_t)b * kv_heads + h) * group * D;
            one_job(q + row, kpool, vpool, table + (size_t)b * max_pages, n, h, kv_heads,
                    group, scale, s, out + row);
        }
        free(s);
    }
    return failed;
}
