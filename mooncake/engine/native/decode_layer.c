/* One decoder layer of a decode step (one new token per sequence), whole, in C.
 *
 * A decode step of a small model on the CPU is bound by the interpreter, not the memory: with
 * the weights in quantized blocks (quant_gemm.c) SmolLM2's GEMMs take ~5 ms a step, and the
 * ~30 small torch calls per layer around them (norms, RoPE, the KV write, views, the SwiGLU
 * product, residual adds) took as long again. `mc_decode_layers` runs every layer's whole
 * sequence of operations on its rows, in one OpenMP parallel region for the whole step (the
 * GEMMs, the attention and the element-wise steps shared out among its threads, barriers
 * between them: one fork per step, not five per layer), calling the quantized GEMM and the
 * paged attention kernel of this same translation unit:
 *
 *   h = rms_norm(x) * attn_norm;  qkv = h @ Wqkv^T;  q, k = rope(q, k)
 *   k, v -> the sequence's next page slot;  a = paged_attention(q)
 *   x += a @ Wo^T;  h = rms_norm(x) * ffn_norm;  g, u = h @ Wgate_up^T
 *   x += (silu(g) * u) @ Wdown^T
 *
 * the same math as Block.forward over PagedDecode (engine/model.py, engine/paged.py), in
 * float32; results differ from it by rounding order only (tests/engine/test_fused.py). Built
 * with HEAD_DIM and PAGE_TOKENS fixed, like paged_attention.c, which it includes.
 */
#include <math.h>
#include <stdint.h>

#include "paged_attention.c"
#include "quant_gemm.c"

typedef struct {
    int32_t kind; /* 0: q4, 1: q8 (quant_gemm.c's formats) */
    int32_t n, k;
    const uint8_t* qs;
    const float* scales;
} mc_qweight;

typedef struct {
    float* x;               /* [M, hidden] the residual stream, updated in place */
    const float* attn_norm; /* [hidden] */
    const float* ffn_norm;  /* [hidden] */
    mc_qweight w[4];        /* qkv, o, gate_up, down */
    const float* cos;       /* [M, rot] */
    const float* sin;       /* [M, rot] */
    kv_t* kpool;            /* [pages, kv_heads, D, P] this layer's (kv_t: paged_attention.c) */
    kv_t* vpool;            /* [pages, kv_heads, P, D] */
    const int64_t* page;    /* [M] the page and slot of each row's new token */
    const int64_t* offset;  /* [M] */
    const int32_t* table;   /* [M, max_pages] */
    const int32_t* lens;    /* [M] tokens to attend to, the new one included */
    float* scratch;         /* mc_decode_scratch_floats(...) floats */
    int32_t M, hidden, heads, kv_heads, ffn, rot, max_pages, threads;
    float eps, scale;
} mc_layer_args;

long mc_decode_scratch_floats(int M, int hidden, int heads, int kv_heads, int ffn) {
    const long nq = (long)heads * D, nkv = (long)kv_heads * D;
    return (long)M * (hidden + (nq + 2 * nkv) + nq + nq + 2L * ffn + ffn);
}

/* Thread t's share of y = x @ W^T (quant_gemm.c's gemm_slice), inside a parallel region. */
static void qgemm_ws(const mc_qweight* w, const float* x, float* y, int M) {
    int t = 0, T = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    T = omp_get_num_threads();
#endif
    gemm_slice(w->kind == 0 ? Q4_TILES : Q8_TILES, w->qs, w->scales, x, y, M, w->n, w->k, t, T);
}

static void rms_norm_row(const float* x, const float* w, float* out, int n, float eps) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* Rotate-half RoPE of one head in place: dims i and i + rot/2 form a pair. */
static void rope(float* v, const float* c, const float* s, int rot) {
    const int half = rot / 2;
    for (int i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
    }
}

/* 0, or why a layer's arguments are refused: 1 a GEMM's inner size is not whole blocks,
 * 2 a weight's shape does not fit the layer's. */
static int check_layer(const mc_layer_args* a) {
    const int H = a->hidden, nq = a->heads * D, nkv = a->kv_heads * D;
    if (a->w[0].n != nq + 2 * nkv || a->w[1].n != H || a->w[2].n != 2 * a->ffn || a->w[3].n != H)
        return 2;
    if (a->w[0].k != H || a->w[1].k != nq || a->w[2].k != H || a->w[3].k != a->ffn) return 2;
    for (int i = 0; i < 4; i++)
        if (a->w[i].k % QK) return 1;
    return 0;
}

/* One layer, run by every thread of the enclosing parallel region. */
static void layer_ws(const mc_layer_args* a, const att_plan* plan) {
    const int M = a->M, H = a->hidden, F = a->ffn, nq = a->heads * D, nkv = a->kv_heads * D;
    const int wide = nq + 2 * nkv;
    float* h = a->scratch;
    float* qkv = h + (size_t)M * H;
    float* q = qkv + (size_t)M * wide;
    float* att = q + (size_t)M * nq;
    float* gu = att + (size_t)M * nq;
    float* act = gu + (size_t)M * 2 * F;
    float* x = a->x;
    const size_t page_k = (size_t)a->kv_heads * D * P; /* elements per page, per pool */

    #pragma omp for schedule(static)
    for (int r = 0; r < M; r++) rms_norm_row(x + (size_t)r * H, a->attn_norm, h + (size_t)r * H, H, a->eps);
    qgemm_ws(&a->w[0], h, qkv, M);
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int r = 0; r < M; r++) {
        float* row = qkv + (size_t)r * wide;
        const float* c = a->cos + (size_t)r * a->rot;
        const float* s = a->sin + (size_t)r * a->rot;
        for (int hd = 0; hd < a->heads; hd++) rope(row + hd * D, c, s, a->rot);
        for (int hd = 0; hd < a->kv_heads; hd++) rope(row + nq + hd * D, c, s, a->rot);
        for (int i = 0; i < nq; i++) q[(size_t)r * nq + i] = row[i];
        kv_t* kp = a->kpool + (size_t)a->page[r] * page_k;
        kv_t* vp = a->vpool + (size_t)a->page[r] * page_k;
        const int64_t o = a->offset[r];
        for (int hd = 0; hd < a->kv_heads; hd++)
            for (int d = 0; d < D; d++) {
                kp[((size_t)hd * D + d) * P + o] = kv_put(row[nq + hd * D + d]);
                vp[((size_t)hd * P + o) * D + d] = kv_put(row[nq + nkv + hd * D + d]);
            }
    }
    att_run(plan, q, a->kpool, a->vpool, a->table, a->lens, att, a->scale);
    qgemm_ws(&a->w[1], att, h, M);
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int r = 0; r < M; r++) {
        float* xr = x + (size_t)r * H;
        for (int i = 0; i < H; i++) xr[i] += h[(size_t)r * H + i];
        rms_norm_row(xr, a->ffn_norm, h + (size_t)r * H, H, a->eps);
    }
    qgemm_ws(&a->w[2], h, gu, M);
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (long i = 0; i < (long)M * F; i++) {
        const long r = i / F, c = i % F;
        const float g = gu[r * 2 * F + c], u = gu[r * 2 * F + F + c];
        act[i] = g / (1.f + expf(-g)) * u;
    }
    qgemm_ws(&a->w[3], act, h, M);
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (long i = 0; i < (long)M * H; i++) x[i] += h[i];
}

/* A decode step through `count` consecutive layers, in one parallel region: the layers
 * share the step's rows, positions, pages and scratch (layers[0]'s M, threads, table...),
 * each its own weights and pools. 0, or 1 / 2 (check_layer; 2 also where a layer's step
 * shape differs from layers[0]'s), 3 a length outside the page table, 4 no memory. */
int mc_decode_layers(const mc_layer_args* layers, int count) {
    if (count < 1) return 0;
    const mc_layer_args* a = &layers[0];
    for (int l = 0; l < count; l++) {
        const mc_layer_args* b = &layers[l];
        const int refused = check_layer(b);
        if (refused) return refused;
        /* One plan and one team for every layer: the step's shape is the same in each. */
        if (b->M != a->M || b->heads != a->heads || b->kv_heads != a->kv_heads ||
            b->max_pages != a->max_pages || b->lens != a->lens || b->table != a->table ||
            b->threads != a->threads)
            return 2;
    }
    att_plan plan;
    const int failed = att_plan_make(&plan, a->lens, a->M, a->kv_heads, a->heads / a->kv_heads,
                                     a->max_pages, a->threads);
    if (failed) return failed == 1 ? 3 : 4;
    #pragma omp parallel num_threads(a->threads)
    for (int l = 0; l < count; l++) layer_ws(&layers[l], &plan);
    att_plan_free(&plan);
    return 0;
}
