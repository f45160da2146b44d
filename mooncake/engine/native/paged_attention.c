/* Decode attention over a paged KV pool (one new query token per sequence), float32 sums
 * over a pool of float32, or of bfloat16 where built with KV_BF16 (kv_t below).
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
 * A decode step's attention reads every K and V byte of the batch once from memory, and
 * little else: it is bound by the memory, so the kernel is shaped to read each byte once
 * and to keep the memory busy:
 *
 * - The query heads that share a KV head (up to TILE of them) are scored against each K
 *   page and summed over each V page together, so a page is read once for all of them.
 * - The pages AHEAD of the one computed are prefetched into the L2 (the pages of a
 *   sequence lie anywhere in the pool, so the hardware prefetcher cannot guess them).
 * - A job is (sequence, KV head, split): where the batch has fewer (sequence, KV head)
 *   pairs than the threads could share (batch 1), a sequence's pages are split into
 *   ranges computed apart, each with its own maximum and sum, and merged after (as
 *   flash-decoding does). Jobs are spread over the calling process's OpenMP threads
 *   (torch's own runtime: the loader links the libgomp torch already loaded).
 *
 * A job reads its pages in one pass: each page's scores, then its V weighted by
 * exp(score - the running maximum); where a later page raises the maximum, what was summed
 * so far is scaled down to it (the online softmax of flash attention). The exponential is
 * a polynomial the compiler vectorizes (exp_diff), not libm's expf, one call per score.
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
#define TILE 4          /* query heads scored together against one page */
#define SPLIT_PAGES 4   /* the fewest pages a split of a sequence gets */
#define LINE 64         /* bytes of a cache line */
#define AHEAD 4         /* pages prefetched ahead of the one computed, into the L2 */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* A pool element, kv_t: a float, or with KV_BF16 a bfloat16 (the top 16 bits of a float32)
 * that kv_get widens exactly (a shift, which the compiler vectorizes) and kv_put rounds to
 * nearest even as torch's .to(torch.bfloat16) does (a NaN stays a quiet NaN). A bfloat16
 * pool halves the bytes a decode step reads, which is what bounds it. */
#ifdef KV_BF16
typedef uint16_t kv_t;
ALWAYS_INLINE float kv_get(kv_t x) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)x << 16};
    return c.f;
}
ALWAYS_INLINE kv_t kv_put(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (kv_t)0x7fc0;
    return (kv_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}
#else
typedef float kv_t;
ALWAYS_INLINE float kv_get(kv_t x) { return x; }
ALWAYS_INLINE kv_t kv_put(float f) { return f; }
#endif

ALWAYS_INLINE void prefetch_block(const kv_t* p, size_t elems) {
    for (size_t i = 0; i < elems; i += LINE / sizeof(kv_t)) __builtin_prefetch(p + i, 0, 1);
}

/* A softmax weight e^(s - top) as 2^x, x = s log2(e) - top log2(e) <= 0 (one FMA): x = n + f
 * with n an integer and |f| <= 1/2 (exactly), 2^f by its degree-6 Taylor polynomial
 * (relative error below 1.2e-7), times 2^n built in the exponent bits; at -126 and below
 * it is 0. Plain arithmetic, so a loop of it becomes vector code. Unlike e^x computed
 * directly, no step splits x by ln 2. The one exponential of decode and prefill attention
 * (prefill_attention.c adds a 16-lane AVX-512 form of it, vexp2_le0). */
#define LOG2E 1.44269504088896341f
#define EXP2_C6 1.5403530e-4f /* ln(2)^k / k!, k = 6 .. 1 */
#define EXP2_C5 1.3333558e-3f
#define EXP2_C4 9.6181291e-3f
#define EXP2_C3 5.5504109e-2f
#define EXP2_C2 2.4022651e-1f
#define EXP2_C1 6.9314718e-1f

ALWAYS_INLINE float exp2_le0(float x) {
    x = x < -126.f ? -126.f : x;
    const float n = __builtin_roundf(x), f = x - n;
    float p = EXP2_C6;
    p = p * f + EXP2_C5;
    p = p * f + EXP2_C4;
    p = p * f + EXP2_C3;
    p = p * f + EXP2_C2;
    p = p * f + EXP2_C1;
    p = p * f + 1.f;
    union { float f; int32_t i; } two = {.i = ((int32_t)n + 127) << 23};
    const float e = p * two.f;
    return x <= -126.f ? 0.f : e;
}

/* e^(s - top) for s <= top: the exponent by one FMA, then exp2_le0. */
ALWAYS_INLINE float exp_diff(float s, float top) {
    return exp2_le0(__builtin_fmaf(s, LOG2E, -top * LOG2E));
}

/* out[i * stride + o] = sum_d qs[i * D + d] * K[o][d] for the G heads of a tile, K stored
 * transposed as kt[d * P + o]; four accumulators per head hide the FMA latency. G is a
 * constant where this is inlined, so the arrays stay in registers. */
ALWAYS_INLINE void scores_tile(const int G, const float* qs, const kv_t* kt, float* out,
                               size_t stride) {
    float a0[TILE][P], a1[TILE][P], a2[TILE][P], a3[TILE][P];
    for (int i = 0; i < G; i++)
        for (int o = 0; o < P; o++) { a0[i][o] = 0.f; a1[i][o] = 0.f; a2[i][o] = 0.f; a3[i][o] = 0.f; }
    int d = 0;
    for (; d + 4 <= D; d += 4) {
        float k0[P], k1[P], k2[P], k3[P]; /* four K rows widened once for the tile's heads */
        for (int o = 0; o < P; o++) {
            k0[o] = kv_get(kt[d * P + o]);
            k1[o] = kv_get(kt[(d + 1) * P + o]);
            k2[o] = kv_get(kt[(d + 2) * P + o]);
            k3[o] = kv_get(kt[(d + 3) * P + o]);
        }
        for (int i = 0; i < G; i++) {
            const float* q = qs + i * D + d;
            for (int o = 0; o < P; o++) {
                a0[i][o] += q[0] * k0[o];
                a1[i][o] += q[1] * k1[o];
                a2[i][o] += q[2] * k2[o];
                a3[i][o] += q[3] * k3[o];
            }
        }
    }
    for (; d < D; d++)
        for (int i = 0; i < G; i++)
            for (int o = 0; o < P; o++) a0[i][o] += qs[i * D + d] * kv_get(kt[d * P + o]);
    for (int i = 0; i < G; i++)
        for (int o = 0; o < P; o++)
            out[i * stride + o] = (a0[i][o] + a1[i][o]) + (a2[i][o] + a3[i][o]);
}

/* acc[i * D + d] += sum_o w[i * stride + o] * V[o][d] over the m written tokens of a page,
 * for the G heads of a tile. One or two heads keep a second accumulator (odd tokens), so
 * there are always enough independent sums to hide the FMA latency. */
ALWAYS_INLINE void values_tile(const int G, const float* w, size_t stride, const kv_t* vh,
                               int m, float* acc) {
    float s0[TILE][D], s1[TILE][D];
    for (int i = 0; i < G; i++)
        for (int d = 0; d < D; d++) { s0[i][d] = acc[i * D + d]; s1[i][d] = 0.f; }
    int o = 0;
    if (G <= 2)
        for (; o + 1 < m; o += 2) {
            float w0[TILE], w1[TILE];
            for (int i = 0; i < G; i++) { w0[i] = w[i * stride + o]; w1[i] = w[i * stride + o + 1]; }
            const kv_t *p0 = vh + o * D, *p1 = p0 + D;
            float v0[D], v1[D];
            for (int d = 0; d < D; d++) { v0[d] = kv_get(p0[d]); v1[d] = kv_get(p1[d]); }
            for (int i = 0; i < G; i++)
                for (int d = 0; d < D; d++) {
                    s0[i][d] += w0[i] * v0[d];
                    s1[i][d] += w1[i] * v1[d];
                }
        }
    for (; o < m; o++) {
        float w0[TILE];
        for (int i = 0; i < G; i++) w0[i] = w[i * stride + o];
        const kv_t* p0 = vh + o * D;
        float v0[D];
        for (int d = 0; d < D; d++) v0[d] = kv_get(p0[d]);
        for (int i = 0; i < G; i++)
            for (int d = 0; d < D; d++) s0[i][d] += w0[i] * v0[d];
    }
    for (int i = 0; i < G; i++)
        for (int d = 0; d < D; d++) acc[i * D + d] = s0[i][d] + s1[i][d];
}

/* One tile of G heads over pages [j0, j1) of a sequence of n tokens: the sum acc [G, D]
 * of V weighted by exp(score - mx), each head's maximum score mx and sum of weights. */
ALWAYS_INLINE void tile_range(const int G, const float* qh, const kv_t* kpool,
                              const kv_t* vpool, const int32_t* pages, int j0, int j1, int n,
                              int h, int kv_heads, float scale, float* acc, float* mx,
                              float* sum) {
    const size_t page = (size_t)kv_heads * P * D;
    const kv_t* kh = kpool + (size_t)h * D * P; /* this KV head's block of page 0 */
    const kv_t* vh = vpool + (size_t)h * P * D;
    float qs[TILE * D], m[TILE], tot[TILE];
    for (int i = 0; i < G; i++) {
        for (int d = 0; d < D; d++) qs[i * D + d] = qh[i * D + d] * scale;
        m[i] = -INFINITY;
        tot[i] = 0.f;
    }
    for (int i = 0; i < G * D; i++) acc[i] = 0.f;
    for (int j = j0; j < j1 && j < j0 + AHEAD; j++) {
        prefetch_block(kh + (size_t)pages[j] * page, D * P);
        prefetch_block(vh + (size_t)pages[j] * page, P * D);
    }
    for (int j = j0; j < j1; j++) {
        if (j + AHEAD < j1) {
            prefetch_block(kh + (size_t)pages[j + AHEAD] * page, D * P);
            prefetch_block(vh + (size_t)pages[j + AHEAD] * page, P * D);
        }
        float sc[TILE][P];
        scores_tile(G, qs, kh + (size_t)pages[j] * page, &sc[0][0], P);
        /* Only the written positions: the rest of the last page may hold anything (a weight
         * of 0 times a NaN left there is still NaN, so those tokens are not summed). */
        const int valid = n - j * P < P ? n - j * P : P;
        for (int i = 0; i < G; i++) {
            float top = m[i];
            for (int o = 0; o < valid; o++) top = sc[i][o] > top ? sc[i][o] : top;
            if (top > m[i]) { /* scale what was summed down to the new maximum */
                const float f = exp_diff(m[i], top);
                for (int d = 0; d < D; d++) acc[i * D + d] *= f;
                tot[i] *= f;
                m[i] = top;
            }
            float t = 0.f;
            for (int o = 0; o < P; o++) {
                const float e = o < valid ? exp_diff(sc[i][o], top) : 0.f;
                sc[i][o] = e;
                t += e;
            }
            tot[i] += t;
        }
        values_tile(G, &sc[0][0], P, vh + (size_t)pages[j] * page, valid, acc);
    }
    for (int i = 0; i < G; i++) { mx[i] = m[i]; sum[i] = tot[i]; }
}

/* Every head of one (sequence, KV head) over pages [j0, j1), tile by tile. With mx and sum
 * (a split of the sequence), acc gets the unnormalized sums and they the maxima and sums
 * of weights, for the merge; without (mx NULL: the whole sequence), acc gets the
 * attention itself. */
static void job_range(const float* qh, const kv_t* kpool, const kv_t* vpool,
                      const int32_t* pages, int j0, int j1, int n, int h, int kv_heads,
                      int group, float scale, float* acc, float* mx, float* sum) {
    for (int i0 = 0; i0 < group; i0 += TILE) {
        const int g = group - i0 < TILE ? group - i0 : TILE;
        const float* q = qh + (size_t)i0 * D;
        float tile_mx[TILE], tile_sum[TILE];
        float *a = acc + (size_t)i0 * D, *m = mx ? mx + i0 : tile_mx, *t = mx ? sum + i0 : tile_sum;
        switch (g) {
        case 1: tile_range(1, q, kpool, vpool, pages, j0, j1, n, h, kv_heads, scale, a, m, t); break;
        case 2: tile_range(2, q, kpool, vpool, pages, j0, j1, n, h, kv_heads, scale, a, m, t); break;
        case 3: tile_range(3, q, kpool, vpool, pages, j0, j1, n, h, kv_heads, scale, a, m, t); break;
        default: tile_range(4, q, kpool, vpool, pages, j0, j1, n, h, kv_heads, scale, a, m, t); break;
        }
        if (mx == NULL)
            for (int i = 0; i < g; i++)
                for (int d = 0; d < D; d++) a[(size_t)i * D + d] /= t[i];
    }
}

/* How a batch's attention is cut into jobs: the splits per (sequence, KV head), and the
 * splits' partial sums where there are several. The same for every layer of a step. */
typedef struct {
    int batch, kv_heads, group, max_pages, splits;
    float *part, *pmax, *psum; /* [pairs, splits, group] x (D, 1, 1); NULL for one split */
} att_plan;

/* 0, 1 for a length outside the page table, 2 for no memory. */
static int att_plan_make(att_plan* plan, const int32_t* lens, int batch, int kv_heads,
                         int group, int max_pages, int threads) {
    int widest = 0;
    for (int b = 0; b < batch; b++) {
        if (lens[b] < 1 || lens[b] > max_pages * P) return 1;
        widest = lens[b] > widest ? lens[b] : widest;
    }
    /* Enough jobs for every thread several times over, none of fewer than SPLIT_PAGES
     * pages. */
    const int pairs = batch * kv_heads, widest_pages = (widest + P - 1) / P;
    int splits = (4 * threads + pairs - 1) / pairs;
    if (splits > widest_pages / SPLIT_PAGES) splits = widest_pages / SPLIT_PAGES;
    if (splits < 1) splits = 1;
    *plan = (att_plan){batch, kv_heads, group, max_pages, splits, NULL, NULL, NULL};
    if (splits > 1) {
        const size_t parts = (size_t)pairs * splits * group;
        plan->part = (float*)malloc(sizeof(float) * parts * (D + 2));
        if (plan->part == NULL) return 2;
        plan->pmax = plan->part + parts * D;
        plan->psum = plan->pmax + parts;
    }
    return 0;
}

static void att_plan_free(att_plan* plan) { free(plan->part); }

/* The attention of one layer, run by every thread of the enclosing parallel region (its
 * loops are shared out among them; all have passed its last barrier when it returns):
 * mc_paged_decode_f32's region here, a whole decode step's in decode_layer.c. */
static void att_run(const att_plan* plan, const float* q, const kv_t* kpool,
                    const kv_t* vpool, const int32_t* table, const int32_t* lens, float* out,
                    float scale) {
    const int kv_heads = plan->kv_heads, group = plan->group, splits = plan->splits;
    const int pairs = plan->batch * kv_heads, max_pages = plan->max_pages;
    float *part = plan->part, *pmax = plan->pmax, *psum = plan->psum;
    #pragma omp for schedule(dynamic, 1)
    for (int job = 0; job < pairs * splits; job++) {
        const int pair = job / splits, split = job % splits;
        const int b = pair / kv_heads, h = pair % kv_heads;
        const int n = lens[b], npg = (n + P - 1) / P;
        const int j0 = (int)((long)npg * split / splits);
        const int j1 = (int)((long)npg * (split + 1) / splits);
        const int32_t* pages = table + (size_t)b * max_pages;
        const size_t row = (size_t)pair * group;
        if (splits == 1) {
            job_range(q + row * D, kpool, vpool, pages, j0, j1, n, h, kv_heads, group, scale,
                      out + row * D, NULL, NULL);
        } else {
            const size_t at = ((size_t)pair * splits + split) * group;
            if (j1 > j0)
                job_range(q + row * D, kpool, vpool, pages, j0, j1, n, h, kv_heads, group,
                          scale, part + at * D, pmax + at, psum + at);
            else
                for (int i = 0; i < group; i++) { pmax[at + i] = -INFINITY; psum[at + i] = 0.f; }
        }
    }
    if (splits > 1) {
        /* A pair's splits merged, each scaled to the largest maximum. */
        #pragma omp for schedule(static)
        for (int ph = 0; ph < pairs * group; ph++) {
            const int pair = ph / group, i = ph % group;
            float m = -INFINITY;
            for (int sp = 0; sp < splits; sp++) {
                const float v = pmax[((size_t)pair * splits + sp) * group + i];
                m = v > m ? v : m;
            }
            float acc[D], tot = 0.f;
            for (int d = 0; d < D; d++) acc[d] = 0.f;
            for (int sp = 0; sp < splits; sp++) {
                const size_t at = ((size_t)pair * splits + sp) * group + i;
                if (psum[at] == 0.f) continue; /* an empty split */
                const float f = exp_diff(pmax[at], m);
                tot += f * psum[at];
                for (int d = 0; d < D; d++) acc[d] += f * part[at * D + d];
            }
            float* o = out + ((size_t)pair * group + i) * D;
            for (int d = 0; d < D; d++) o[d] = acc[d] / tot;
        }
    }
}

int mc_paged_decode_f32(const float* q, const kv_t* kpool, const kv_t* vpool,
                        const int32_t* table, const int32_t* lens, float* out, int batch,
                        int kv_heads, int group, int max_pages, float scale, int threads) {
    att_plan plan;
    const int failed = att_plan_make(&plan, lens, batch, kv_heads, group, max_pages, threads);
    if (failed) return failed;
    #pragma omp parallel num_threads(threads)
    att_run(&plan, q, kpool, vpool, table, lens, out, scale);
    att_plan_free(&plan);
    return 0;
}

/* n floats as pool elements, each as kv_put makes it (what a decode step writes): for the
 * tests, which check a bfloat16 pool's rounding against torch's. */
void mc_kv_put(const float* src, kv_t* dst, long n) {
    for (long i = 0; i < n; i++) dst[i] = kv_put(src[i]);
}

/* Whole store blocks into pool pages (KVPool.write_blocks): for each of `layers` layers
 * (the source's `src_layer` elements apart, the pool's `pool_layer`), n blocks of T tokens
 * in the pool's element type, block j at j * block_stride elements as [2][kv_heads][T][D] (K, then V), its T / P pages
 * pages[j * T / P ...]. A page gets each head's K transposed ([D][P], the layout above) and
 * its V as it is ([P][D]): one pass over the source, the pages split over the threads.
 * Returns 1 if T is not a whole number of pages. */
int mc_write_blocks_f32(const kv_t* src, long src_layer, long block_stride, int layers,
                        int n, int T, const int32_t* pages, kv_t* kpool, kv_t* vpool,
                        long pool_layer, int kv_heads, int threads) {
    if (T % P) return 1;
    const int per = T / P;
    const size_t page = (size_t)kv_heads * P * D;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < (long)layers * n * per; i++) {
        const int layer = (int)(i / (n * per)), b = (int)(i % (n * per));
        const int j = b / per, pg = b % per;
        const size_t at = (size_t)layer * pool_layer + (size_t)pages[b] * page;
        const kv_t* blk = src + (size_t)layer * src_layer + (size_t)j * block_stride;
        for (int h = 0; h < kv_heads; h++) {
            const kv_t* ks = blk + ((size_t)h * T + (size_t)pg * P) * D;
            const kv_t* vs = ks + (size_t)kv_heads * T * D;
            kv_t* kd = kpool + at + (size_t)h * D * P;
            for (int d = 0; d < D; d++)
                for (int t = 0; t < P; t++) kd[d * P + t] = ks[t * D + d];
            memcpy(vpool + at + (size_t)h * P * D, vs, sizeof(kv_t) * P * D);
        }
    }
    return 0;
}
