/* Prefill attention over a paged KV pool, float32: S new tokens of one sequence, at
 * positions start .. start+S-1, attending causally to every key before them (a cached
 * prefix's, read in place from its pages) and to themselves. Their own K and V are in their
 * pages already (the caller writes them first), so all keys are read the same way, and a
 * prefill with nothing cached is the case start = 0.
 *
 * Built at run time by mooncake/engine/native/__init__.py, like paged_attention.c (whose
 * exponential it shares), with HEAD_DIM and PAGE_TOKENS fixed:
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
 *      flash attention) and turns the scores into weights exp(score - maximum);
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
 * multiples of 16 and PAGE_TOKENS must divide KB, else the loader takes the torch path.
 */
#include "paged_attention.c"

#if D % 16 == 0 && P % 16 == 0 && 64 % P == 0
#define PREFILL_SUPPORTED 1
#define KB 64           /* keys of a block */
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

/* sc[r][t] = qs[r] . K[key kb + t] for the ROWS rows and KB keys of a block, SK x W keys
 * at a time (ROWS x SK vector sums). kh is this KV head's block of page 0, `page` floats
 * apart; the sequence has npg pages. */
ALWAYS_INLINE void block_scores(const float (*qs)[D], const float* kh, size_t page,
                                const int32_t* pages, int npg, int kb, float (*sc)[KB]) {
    for (int t0 = 0; t0 < KB; t0 += SK * W) {
        /* Each W-key vector lies within one page (W divides P). Keys past the sequence's
         * last page are scored against that page (and masked): the page table ends there. */
        const float* ks[SK];
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
            for (int j = 0; j < SK; j++) k[j] = vload(ks[j] + d * P);
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
ALWAYS_INLINE void block_values(const float (*w)[KB], const float* alpha, const float* vh,
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
            const float* base = vh + (size_t)pages[(kb + t0) / P] * page + c0 * W;
            const int n = m - t0 < P ? m - t0 : P;
            for (int t = 0; t < n; t++) {
                const float* v = base + (size_t)t * D;
                vf vv[VC];
                #pragma GCC unroll 4
                for (int c = 0; c < VC; c++) vv[c] = vload(v + c * W);
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

/* A tile: ROWS flattened rows of S x group for one KV head (row f is query head
 * h * group + f % group of new token f / group), their scaled queries, and their running
 * softmax: maxima m, sums of weights l, and the weighted sums of V, o. */
typedef struct {
    float qs[ROWS][D] __attribute__((aligned(64)));
    float o[ROWS][D] __attribute__((aligned(64)));
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
    }
}

/* The keys [kb, kb + KB) into a tile's running softmax (kb <= t->hi). */
static void tile_block(tile_state* t, const float* kh, const float* vh, size_t page,
                       const int32_t* pages, int npg, int kb) {
    float sc[ROWS][KB] __attribute__((aligned(64)));
    float alpha[ROWS];
    block_scores((const float (*)[D])t->qs, kh, page, pages, npg, kb, sc);
    const int masked = kb + KB - 1 > t->lo; /* some row may not see every key of it */
    for (int r = 0; r < ROWS; r++) {
        float* s = sc[r];
        if (masked)
            for (int j = 0; j < KB; j++) s[j] = kb + j <= t->lim[r] ? s[j] : -INFINITY;
        vf big = vsplat(t->m[r]);
        for (int j = 0; j < KB; j += W) big = vmax(vload(s + j), big);
        const float top = hmax(big);
        /* Key 0, in the first block, is seen by every row: top is finite from there. */
        alpha[r] = exp_le0(t->m[r] - top);
        t->m[r] = top;
        for (int j = 0; j < KB; j++) s[j] = exp_le0(s[j] - top);
        vf part = vload(s);
        for (int j = W; j < KB; j += W) part += vload(s + j);
        t->l[r] = t->l[r] * alpha[r] + hsum(part);
    }
    /* Keys past the tile's last visible one weigh 0 for every row, and may not be written:
     * not summed. */
    const int keys = t->hi - kb + 1 < KB ? t->hi - kb + 1 : KB;
    for (int r0 = 0; r0 < ROWS; r0 += HALF)
        block_values((const float (*)[KB])sc, alpha, vh, page, pages, kb, keys, r0, t->o);
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
static void prefill_job(const float* q, long q_row, long q_head, const float* kpool,
                        const float* vpool, const int32_t* pages, float* out, int S,
                        int start, int kv_heads, int group, float scale, int h, int tile0,
                        int n) {
    const size_t page = (size_t)kv_heads * P * D;
    const int npg = (start + S + P - 1) / P;
    const float* kh = kpool + (size_t)h * D * P;
    const float* vh = vpool + (size_t)h * P * D;
    tile_state ts[TPJ];
    int hi = 0;
    for (int i = 0; i < n; i++) {
        tile_init(&ts[i], q, q_row, q_head, S, start, group, scale, h, (tile0 + i) * ROWS);
        hi = ts[i].hi > hi ? ts[i].hi : hi;
    }
    for (int kb = 0; kb <= hi; kb += KB)
        for (int i = 0; i < n; i++)
            if (kb <= ts[i].hi) tile_block(&ts[i], kh, vh, page, pages, npg, kb);
    for (int i = 0; i < n; i++)
        tile_finish(&ts[i], out, S, kv_heads * group, group, h, (tile0 + i) * ROWS);
}
#endif

/* Whether this build has the kernel (HEAD_DIM and PAGE_TOKENS it supports). */
int mc_paged_prefill_supported(void) {
#ifdef PREFILL_SUPPORTED
    return 1;
#else
    return 0;
#endif
}

/* 0; 1 for a shape this build does not support (the caller takes the torch path). */
int mc_paged_prefill_f32(const float* q, long q_row, long q_head, const float* kpool,
                         const float* vpool, const int32_t* pages, float* out, int S,
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
