/* Prefill attention over a paged KV pool (of float32, or bfloat16 built with KV_BF16: kv_t,
 * paged_attention.c), float32 sums: S new tokens of one sequence, at
 * positions start .. start+S-1, attending causally to every key before them (a cached
 * prefix's, read in place from its pages) and to themselves. Their own K and V are in their
 * pages already (the caller writes them first), so all keys are read the same way, and a
 * prefill with nothing cached is the case start = 0.
 *
 * Built at run time by mooncake/engine/native/__init__.py, like paged_attention.c (which it
 * includes), with HEAD_DIM and PAGE_TOKENS fixed:
 *
 *   q      S rows of heads x HEAD_DIM floats: head c of new token i at
 *          q[i * q_row + c * q_head] (heads = kv_heads x group; query head c reads KV head
 *          c / group, as torch's grouped-query attention does)
 *   kpool  [pages, kv_heads, HEAD_DIM, PAGE_TOKENS] (K transposed within a page)
 *   vpool  [pages, kv_heads, PAGE_TOKENS, HEAD_DIM]
 *   pages  the sequence's pool pages in order, covering its start + S positions
 *   out    [S, heads, HEAD_DIM], contiguous
 *
 * Unlike decode, this is bound by arithmetic, not memory: every key is read by every query
 * row that sees it. A tile is ROWS query rows of one KV head (the rows of consecutive new
 * tokens and the query heads that share the KV head, flattened); a job is TPJ consecutive
 * tiles, which walk the keys together in blocks of KB, so a block comes from memory once
 * for all of them (measured here: 8 tiles a job ran long prompts' attention ~15 % faster
 * than 2, whose K and V outgrow the L2), and for each block a tile
 *
 *   1. scores the ROWS rows against KB keys, ROWS x KB / 2 sums kept in vector registers
 *      while each K row (one HEAD_DIM index across 16 tokens) is read once for all rows;
 *   2. updates each row's maximum, scales what it summed so far (the online softmax of
 *      flash attention) and turns the scores into weights exp(score - maximum) (as powers
 *      of 2: exp2_le0);
 *   3. adds the KB values weighted by them, half the rows at a time, their HEAD_DIM sums in
 *      registers while each V row is read once for those rows.
 *
 * The jobs go out KV head by KV head, so the threads read the same head's keys (a head's K
 * and V of 2,048 tokens are 1 MiB; ordered tile-major, each thread's caches held every
 * head's and the kernel ran ~15 % slower), the last tiles first: they see the most keys, so
 * the threads finish together.
 *
 * Only the last blocks a tile sees can hold keys some of its rows may not (later
 * positions): there a key past a row's position scores -infinity, by a select (not
 * arithmetic: a key slot past the sequence's end may hold anything, even a NaN), and
 * values are summed only up to the tile's last visible key.
 *
 * Written with GCC's vector extensions, W floats a vector: with AVX-512, W = 16 (one
 * register); otherwise W = 8 (one AVX2 register). The register tiles are sized to the
 * machine's 32 or 16 vector registers: a block's scores are summed for SK x W keys at a time
 * (ROWS x SK sums), its values VC vectors of a row's HEAD_DIM at a time (HALF x VC sums).
 * Sized for AVX-512 alone, an AVX2 build spilled its sums to memory on every step and ran
 * at a fifteenth of its speed (10.6 GFLOP/s, 2 threads). HEAD_DIM and PAGE_TOKENS must be
 * multiples of 16 and PAGE_TOKENS must divide 64, else the loader takes the torch path.
 *
 * BF16 (built with PREFILL_BF16 where the CPU has AVX512_BF16 and HEAD_DIM is a multiple of
 * 32; EngineSettings.attention = "bfloat16"): the scores and the weighted values are
 * bfloat16 dot products, each multiplying 32 pairs into 16 float32 sums where an FMA
 * multiplies 16, so twice the products an instruction. A job converts each block of keys
 * and values once for all of its tiles (block_convert), into the pairs the products take:
 * two HEAD_DIM indices of a key, two keys of a value; a tile rounds its scaled queries
 * once, and a block's softmax weights after the exponentials. Maxima, sums of weights and
 * the running output stay float32. On a 2-vCPU Zen 4 EPYC: 256 rows of SmolLM2's heads over
 * 2,048 keys in 4.0 ms, 6.4 in float32 (~285 and ~177 GFLOP/s); blocks of 128 keys ran ~4 %
 * faster than 64 there.
 */
#include "paged_attention.c"

#if D % 16 == 0 && P % 16 == 0 && 64 % P == 0
#define PREFILL_SUPPORTED 1
#if defined(__AVX512BF16__) && defined(PREFILL_BF16) && D % 32 == 0
#define BF16 1          /* scores and values by bfloat16 dot products (see the top) */
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#define KB 128          /* keys of a block (measured: 3-5 % faster than 64, either precision) */
#else
#define KB 64           /* keys of a block */
#endif
#define TPJ 8           /* tiles of a job */
#define ROWS 12         /* query rows of a tile */
#define HALF (ROWS / 2) /* rows summed at once over V */
#ifdef __AVX512F__
#define W 16            /* floats of a vector */
#define SK 2            /* key vectors a block's scores sum at once */
/* Vectors of a row's values summed at once: 4, or what divides a head's row (a head of 32
 * is 2 vectors: with 4, the sums ran past its row into the next, NaN where it was last). */
#define VC ((D / 16) % 4 == 0 ? 4 : (D / 16) % 2 == 0 ? 2 : 1)
#else
#define W 8
#define SK 1
#define VC 1
#endif
#define DV (D / W)      /* vectors of a head's row */

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

ALWAYS_INLINE vf vload(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE void vstore(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* W pool elements widened to floats (a bfloat16 pool's by zero-extension and a shift). */
#ifdef KV_BF16
typedef uint16_t vh16 __attribute__((vector_size(W * 2)));
ALWAYS_INLINE vf kvload(const kv_t* p) {
    vh16 h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vi) << 16);
}
#else
ALWAYS_INLINE vf kvload(const kv_t* p) { return vload(p); }
#endif

/* Lane by lane, the larger of a and b (a select). */
ALWAYS_INLINE vf vmax(vf a, vf b) {
    const vi gt = a > b; /* all ones where a is larger */
    return (vf)((gt & (vi)a) | (~gt & (vi)b));
}

ALWAYS_INLINE vf vadd(vf a, vf b) { return a + b; }

/* v's W lanes combined by `op` in log2(W) halvings (a tree, not a chain of W - 1
 * dependent steps): lane i with lane i ^ (W / 2), then ^ (W / 4), ... ^ 1; every lane then
 * holds the result. hmax and hsum: the largest and the sum of a vector's lanes. */
#if W == 16
#define HALVE(v, op)                                                                           \
    do {                                                                                       \
        v = op(v, __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7})); \
        v = op(v, __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11})); \
        v = op(v, __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13})); \
        v = op(v, __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14})); \
    } while (0)
#else
#define HALVE(v, op)                                                                           \
    do {                                                                                       \
        v = op(v, __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3}));                         \
        v = op(v, __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5}));                         \
        v = op(v, __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6}));                         \
    } while (0)
#endif

ALWAYS_INLINE float hmax(vf v) {
    HALVE(v, vmax);
    return v[0];
}

ALWAYS_INLINE float hsum(vf v) {
    HALVE(v, vadd);
    return v[0];
}

ALWAYS_INLINE vf vsplat(float x) { return x - (vf){0}; }

/* The softmax weights are paged_attention.c's exp2_le0, in AVX-512 a 16-lane form of it
 * below. On a 2-vCPU Zen 5 EPYC the softmax took ~14 % of the kernel's time; the weights
 * by hand in AVX-512, summed as they are made, made the kernel 3-4 % faster, and blocks of
 * 128 keys 3-5 % more (256 rows over 2,048 keys: 336 -> 369 GFLOP/s; 2,048 rows, causal:
 * 329 -> 351). */
#ifdef __AVX512F__
/* exp2_le0 of 16 lanes: 2^n applied by vscalefps, and the lanes at -126 or below (or
 * -infinity, a masked key) zeroed by the same instruction's mask. */
ALWAYS_INLINE vf vexp2_le0(vf x) {
    const __m512 v = (__m512)x;
    const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-126.f), _CMP_GT_OQ);
    const __m512 n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(v, n);
    __m512 p = _mm512_set1_ps(EXP2_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return (vf)_mm512_maskz_scalef_ps(live, p, n);
}
#endif

/* sc[r][t] = qs[r] . K[key kb + t] for the ROWS rows and KB keys of a block, SK x W keys
 * at a time (ROWS x SK vector sums). kh is this KV head's block of page 0, `page` floats
 * apart; the sequence has npg pages. */
ALWAYS_INLINE void block_scores(const float (*qs)[D], const kv_t* kh, size_t page,
                                const int32_t* pages, int npg, int kb, float (*sc)[KB]) {
    for (int t0 = 0; t0 < KB; t0 += SK * W) {
        /* Each W-key vector lies within one page (W divides P). Keys past the sequence's
         * last page are scored against that page (and masked): the page table ends there. */
        const kv_t* ks[SK];
        #pragma GCC unroll 2
        for (int j = 0; j < SK; j++) {
            const int a = kb + t0 + j * W, pa = a / P < npg ? a / P : npg - 1;
            ks[j] = kh + (size_t)pages[pa] * page + a % P;
        }
        vf acc[SK][ROWS];
        #pragma GCC unroll 2
        for (int j = 0; j < SK; j++)
            #pragma GCC unroll 12
            for (int r = 0; r < ROWS; r++) acc[j][r] = (vf){0};
        for (int d = 0; d < D; d++) {
            vf k[SK];
            #pragma GCC unroll 2
            for (int j = 0; j < SK; j++) k[j] = kvload(ks[j] + d * P);
            #pragma GCC unroll 12
            for (int r = 0; r < ROWS; r++) {
                const vf q = vsplat(qs[r][d]);
                #pragma GCC unroll 2
                for (int j = 0; j < SK; j++) acc[j][r] += q * k[j];
            }
        }
        #pragma GCC unroll 2
        for (int j = 0; j < SK; j++)
            #pragma GCC unroll 12
            for (int r = 0; r < ROWS; r++) vstore(&sc[r][t0 + j * W], acc[j][r]);
    }
}

/* o[r] = o[r] * alpha[r] + sum over the first m keys of w[r][t] V[key kb + t], for rows
 * [r0, r0 + HALF), VC vectors of their HEAD_DIM at a time (one, on AVX2: measured best). */
ALWAYS_INLINE void block_values(const float (*w)[KB], const float* alpha, const kv_t* vh,
                                size_t page, const int32_t* pages, int kb, int m, int r0,
                                float (*o)[D]) {
    for (int c0 = 0; c0 < DV; c0 += VC) {
        vf acc[HALF][VC];
        #pragma GCC unroll 6
        for (int r = 0; r < HALF; r++) {
            const vf f = vsplat(alpha[r0 + r]);
            #pragma GCC unroll 4
            for (int c = 0; c < VC; c++) acc[r][c] = vload(&o[r0 + r][(c0 + c) * W]) * f;
        }
        for (int t0 = 0; t0 < m; t0 += P) { /* kb is a whole number of pages */
            const kv_t* base = vh + (size_t)pages[(kb + t0) / P] * page + c0 * W;
            const int n = m - t0 < P ? m - t0 : P;
            for (int t = 0; t < n; t++) {
                const kv_t* v = base + (size_t)t * D;
                vf vv[VC];
                #pragma GCC unroll 4
                for (int c = 0; c < VC; c++) vv[c] = kvload(v + c * W);
                #pragma GCC unroll 6
                for (int r = 0; r < HALF; r++) {
                    const vf x = vsplat(w[r0 + r][t0 + t]);
                    #pragma GCC unroll 4
                    for (int c = 0; c < VC; c++) acc[r][c] += x * vv[c];
                }
            }
        }
        #pragma GCC unroll 6
        for (int r = 0; r < HALF; r++)
            #pragma GCC unroll 4
            for (int c = 0; c < VC; c++) vstore(&o[r0 + r][(c0 + c) * W], acc[r][c]);
    }
}

#ifdef BF16
/* 32 floats as 32 bfloat16s in order (rounded to nearest even): lane i of the result, as
 * 32 bits, is the pair (x[2i], x[2i + 1]), what a bfloat16 dot product multiplies. */
ALWAYS_INLINE __m512i bf16_seq(const float* x) {
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
}

/* Rows a and b, 16 floats each, as 16 pairs: lane i is (a[i], b[i]). */
ALWAYS_INLINE __m512i bf16_pairs(__m512 a, __m512 b) {
    const __m512i spread = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                            25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                            18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(spread, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* A block's keys and values for one KV head in bfloat16, laid out for the dot products:
 * k[i][t] pairs dimensions 2i and 2i + 1 of key kb + t, v[j][c] pairs keys kb + 2j and
 * kb + 2j + 1 at dimension c. Values past key `last` are zeros (their slots may hold
 * anything, and a weight of 0 times a NaN is a NaN). Made once a block for all of a job's
 * tiles. */
typedef struct {
    uint32_t k[D / 2][KB] __attribute__((aligned(64)));
    uint32_t v[KB / 2][D] __attribute__((aligned(64)));
} block_bf16;

static void block_convert(block_bf16* b, const kv_t* kh, const kv_t* vh, size_t page,
                          const int32_t* pages, int npg, int kb, int last) {
    for (int t0 = 0; t0 < KB; t0 += 16) {
        const int a = kb + t0, pa = a / P < npg ? a / P : npg - 1; /* as block_scores */
        const kv_t* k = kh + (size_t)pages[pa] * page + a % P;
        for (int i = 0; i < D / 2; i++)
            _mm512_store_si512(&b->k[i][t0], bf16_pairs((__m512)kvload(k + 2 * i * P),
                                                         (__m512)kvload(k + (2 * i + 1) * P)));
    }
    for (int t = 0; t < KB; t += 2) {
        const int a = kb + t;
        const kv_t* v = a <= last ? vh + (size_t)pages[a / P] * page + (size_t)(a % P) * D : 0;
        for (int c = 0; c < D; c += 16) {
            const __m512 lo = a <= last ? (__m512)kvload(v + c) : _mm512_setzero_ps();
            const __m512 hi = a + 1 <= last ? (__m512)kvload(v + D + c) : _mm512_setzero_ps();
            _mm512_store_si512(&b->v[t / 2][c], bf16_pairs(lo, hi));
        }
    }
}

/* block_scores over a converted block: qb[r][i] pairs a row's scaled query at dimensions
 * 2i and 2i + 1; one dot product multiplies 32 pairs, twice an FMA's 16. */
ALWAYS_INLINE void block_scores_bf16(const uint32_t (*qb)[D / 2], const block_bf16* b,
                                     float (*sc)[KB]) {
    for (int t0 = 0; t0 < KB; t0 += SK * W) {
        __m512 acc[SK][ROWS];
        #pragma GCC unroll 2
        for (int j = 0; j < SK; j++)
            #pragma GCC unroll 12
            for (int r = 0; r < ROWS; r++) acc[j][r] = _mm512_setzero_ps();
        for (int i = 0; i < D / 2; i++) {
            __m512bh k[SK];
            #pragma GCC unroll 2
            for (int j = 0; j < SK; j++) k[j] = (__m512bh)_mm512_load_si512(&b->k[i][t0 + j * W]);
            #pragma GCC unroll 12
            for (int r = 0; r < ROWS; r++) {
                const __m512bh q = (__m512bh)_mm512_set1_epi32((int)qb[r][i]);
                #pragma GCC unroll 2
                for (int j = 0; j < SK; j++) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], q, k[j]);
            }
        }
        #pragma GCC unroll 2
        for (int j = 0; j < SK; j++)
            #pragma GCC unroll 12
            for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(&sc[r][t0 + j * W], acc[j][r]);
    }
}

/* block_values over a converted block: wb[r][j] pairs a row's weights of keys 2j and
 * 2j + 1; the first `pairs` pairs are summed. */
ALWAYS_INLINE void block_values_bf16(const uint32_t (*wb)[KB / 2], const float* alpha,
                                     const block_bf16* b, int pairs, int r0, float (*o)[D]) {
    for (int c0 = 0; c0 < DV; c0 += VC) {
        __m512 acc[HALF][VC];
        #pragma GCC unroll 6
        for (int r = 0; r < HALF; r++) {
            const __m512 f = _mm512_set1_ps(alpha[r0 + r]);
            #pragma GCC unroll 4
            for (int c = 0; c < VC; c++)
                acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(&o[r0 + r][(c0 + c) * W]), f);
        }
        for (int j = 0; j < pairs; j++) {
            __m512bh vv[VC];
            #pragma GCC unroll 4
            for (int c = 0; c < VC; c++) vv[c] = (__m512bh)_mm512_load_si512(&b->v[j][(c0 + c) * W]);
            #pragma GCC unroll 6
            for (int r = 0; r < HALF; r++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)wb[r0 + r][j]);
                #pragma GCC unroll 4
                for (int c = 0; c < VC; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, vv[c]);
            }
        }
        #pragma GCC unroll 6
        for (int r = 0; r < HALF; r++)
            #pragma GCC unroll 4
            for (int c = 0; c < VC; c++) _mm512_storeu_ps(&o[r0 + r][(c0 + c) * W], acc[r][c]);
    }
}
#endif

/* A tile: ROWS flattened rows of S x group for one KV head (row f is query head
 * h * group + f % group of new token f / group), their scaled queries, and their running
 * softmax: maxima m, sums of weights l, and the weighted sums of V, o. */
typedef struct {
    float qs[ROWS][D] __attribute__((aligned(64)));
    float o[ROWS][D] __attribute__((aligned(64)));
#ifdef BF16
    uint32_t qb[ROWS][D / 2] __attribute__((aligned(64))); /* qs in bfloat16 pairs */
#endif
    float m[ROWS], l[ROWS];
    int lim[ROWS]; /* the last key each row sees: its own position */
    int lo, hi;    /* the fewest and the most keys any row sees, less one */
} tile_state;

/* Rows [row0, row0 + ROWS); rows past the end are computed as copies of the last and
 * not written. */
static void tile_init(tile_state* t, const float* q, long q_row, long q_head, int S,
                      int start, int group, float scale, int h, int row0) {
    const int rows = S * group;
    t->lo = 1 << 30;
    t->hi = 0;
    for (int r = 0; r < ROWS; r++) {
        const int f = row0 + r < rows ? row0 + r : rows - 1;
        const int i = f / group, c = h * group + f % group;
        const float* src = q + i * q_row + c * q_head;
        for (int d = 0; d < D; d++) t->qs[r][d] = src[d] * scale;
        for (int d = 0; d < D; d++) t->o[r][d] = 0.f;
        t->m[r] = -INFINITY;
        t->l[r] = 0.f;
        t->lim[r] = start + i;
        t->lo = t->lim[r] < t->lo ? t->lim[r] : t->lo;
        t->hi = t->lim[r] > t->hi ? t->lim[r] : t->hi;
#ifdef BF16
        for (int d = 0; d < D; d += 32) _mm512_store_si512(&t->qb[r][d / 2], bf16_seq(&t->qs[r][d]));
#endif
    }
}

/* The keys [kb, kb + KB) into a tile's running softmax (kb <= t->hi); with BF16, `b` is
 * the block converted (block_convert). */
static void tile_block(tile_state* t, const kv_t* kh, const kv_t* vh, size_t page,
                       const int32_t* pages, int npg, int kb, const void* b) {
    float sc[ROWS][KB] __attribute__((aligned(64)));
    float alpha[ROWS];
#ifdef BF16
    (void)kh; (void)vh; (void)page; (void)pages; (void)npg;
    block_scores_bf16((const uint32_t (*)[D / 2])t->qb, b, sc);
#else
    (void)b;
    block_scores((const float (*)[D])t->qs, kh, page, pages, npg, kb, sc);
#endif
    const int masked = kb + KB - 1 > t->lo; /* some row may not see every key of it */
    for (int r = 0; r < ROWS; r++) {
        float* s = sc[r];
        if (masked)
            for (int j = 0; j < KB; j++) s[j] = kb + j <= t->lim[r] ? s[j] : -INFINITY;
        vf big = vsplat(t->m[r]);
        for (int j = 0; j < KB; j += W) big = vmax(vload(s + j), big);
        const float top = hmax(big);
        /* Key 0, in the first block, is seen by every row: top is finite from there. */
        alpha[r] = exp_diff(t->m[r], top);
        t->m[r] = top;
#ifdef __AVX512F__
        /* exp(s - top) = 2^(s log2(e) - top log2(e)), the exponent by one FMA */
        const __m512 l2e = _mm512_set1_ps(LOG2E), t2 = _mm512_set1_ps(top * LOG2E);
        vf part = (vf){0};
        for (int j = 0; j < KB; j += W) {
            const vf e = vexp2_le0((vf)_mm512_fmsub_ps(_mm512_loadu_ps(s + j), l2e, t2));
            vstore(s + j, e);
            part += e;
        }
#else
        for (int j = 0; j < KB; j++) s[j] = exp_diff(s[j], top);
        vf part = vload(s);
        for (int j = W; j < KB; j += W) part += vload(s + j);
#endif
        t->l[r] = t->l[r] * alpha[r] + hsum(part);
    }
    /* Keys past the tile's last visible one weigh 0 for every row, and may not be written:
     * not summed. */
    const int keys = t->hi - kb + 1 < KB ? t->hi - kb + 1 : KB;
#ifdef BF16
    /* The weights in bfloat16 pairs; a pair's second key past the last is 0 in both. */
    uint32_t wb[ROWS][KB / 2] __attribute__((aligned(64)));
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < KB; j += 32) _mm512_store_si512(&wb[r][j / 2], bf16_seq(&sc[r][j]));
    for (int r0 = 0; r0 < ROWS; r0 += HALF)
        block_values_bf16((const uint32_t (*)[KB / 2])wb, alpha, b, (keys + 1) / 2, r0, t->o);
#else
    for (int r0 = 0; r0 < ROWS; r0 += HALF)
        block_values((const float (*)[KB])sc, alpha, vh, page, pages, kb, keys, r0, t->o);
#endif
}

static void tile_finish(const tile_state* t, float* out, int S, int heads, int group, int h,
                        int row0) {
    for (int r = 0; r < ROWS && row0 + r < S * group; r++) {
        const int f = row0 + r, i = f / group, c = h * group + f % group;
        float* dst = out + ((size_t)i * heads + c) * D;
        const float inv = 1.f / t->l[r];
        for (int d = 0; d < D; d++) dst[d] = t->o[r][d] * inv;
    }
}

/* One job: KV head h, tiles [tile0, tile0 + n) (n <= TPJ). The tiles walk the keys
 * together, block by block, so a block read for the first is in the L1 for the others. */
static void prefill_job(const float* q, long q_row, long q_head, const kv_t* kpool,
                        const kv_t* vpool, const int32_t* pages, float* out, int S,
                        int start, int kv_heads, int group, float scale, int h, int tile0,
                        int n) {
    const size_t page = (size_t)kv_heads * P * D;
    const int npg = (start + S + P - 1) / P;
    const kv_t* kh = kpool + (size_t)h * D * P;
    const kv_t* vh = vpool + (size_t)h * P * D;
    tile_state ts[TPJ];
    int hi = 0;
    for (int i = 0; i < n; i++) {
        tile_init(&ts[i], q, q_row, q_head, S, start, group, scale, h, (tile0 + i) * ROWS);
        hi = ts[i].hi > hi ? ts[i].hi : hi;
    }
#ifdef BF16
    block_bf16 blk; /* each block converted once, for all of the job's tiles */
    const void* conv = &blk;
#else
    const void* conv = NULL;
#endif
    for (int kb = 0; kb <= hi; kb += KB) {
#ifdef BF16
        block_convert(&blk, kh, vh, page, pages, npg, kb, hi);
#endif
        for (int i = 0; i < n; i++)
            if (kb <= ts[i].hi) tile_block(&ts[i], kh, vh, page, pages, npg, kb, conv);
    }
    for (int i = 0; i < n; i++)
        tile_finish(&ts[i], out, S, kv_heads * group, group, h, (tile0 + i) * ROWS);
}
#endif

/* Whether this build multiplies in bfloat16 (BF16). */
int mc_paged_prefill_bf16(void) {
#ifdef BF16
    return 1;
#else
    return 0;
#endif
}

/* Whether this build has the kernel (HEAD_DIM and PAGE_TOKENS it supports). */
int mc_paged_prefill_supported(void) {
#ifdef PREFILL_SUPPORTED
    return 1;
#else
    return 0;
#endif
}

/* 0; 1 for a shape this build does not support (the caller takes the torch path). */
int mc_paged_prefill_f32(const float* q, long q_row, long q_head, const kv_t* kpool,
                         const kv_t* vpool, const int32_t* pages, float* out, int S,
                         int start, int kv_heads, int group, float scale, int threads) {
#ifdef PREFILL_SUPPORTED
    const int tiles = (S * group + ROWS - 1) / ROWS, per = (tiles + TPJ - 1) / TPJ;
    /* KV head by KV head, the last tiles first (see the top of the file). */
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int job = 0; job < per * kv_heads; job++) {
        const int h = job / per, first = (per - 1 - job % per) * TPJ;
        const int n = tiles - first < TPJ ? tiles - first : TPJ;
        prefill_job(q, q_row, q_head, kpool, vpool, pages, out, S, start, kv_heads, group,
                    scale, h, first, n);
    }
    return 0;
#else
    (void)q; (void)q_row; (void)q_head; (void)kpool; (void)vpool; (void)pages; (void)out;
    (void)S; (void)start; (void)kv_heads; (void)group; (void)scale; (void)threads;
    return 1;
#endif
}
