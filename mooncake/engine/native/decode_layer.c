/* One decoder layer of a decode step (one new token per sequence), whole, in C.
 *
 * A decode step of a small model on the CPU is bound by the interpreter, not the memory: with
 * the weights in quantized blocks (quant_gemm.c) SmolLM2's GEMMs take ~5 ms a step, and the
 * ~30 small torch calls per layer around them (norms, RoPE, the KV write, views, the SwiGLU
 * product, residual adds) took as long again. This function runs a layer's whole sequence of
 * operations on its rows, calling the quantized GEMM and the paged attention kernel of this
 * same translation unit:
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
    float* kpool;           /* [pages, kv_heads, D, P] this layer's */
    float* vpool;           /* [pages, kv_heads, P, D] */
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

static int qgemm(const mc_qweight* w, const float* x, float* y, int M, int threads) {
    return w->kind == 0 ? mc_q4_gemm(w->qs, w->scales, x, y, M, w->n, w->k, threads)
                        : mc_q8_gemm(w->qs, w->scales, x, y, M, w->n, w->k, threads);
}

static void rms_norm(const float* x, const float* w, float* out, int M, int n, float eps) {
    for (int r = 0; r < M; r++) {
        const float* xr = x + (size_t)r * n;
        float ss = 0.f;
        for (int i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; i++) out[(size_t)r * n + i] = xr[i] * inv * w[i];
    }
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

int mc_decode_layer(const mc_layer_args* a) {
    const int M = a->M, H = a->hidden, nq = a->heads * D, nkv = a->kv_heads * D;
    const int wide = nq + 2 * nkv;
    if (a->w[0].n != wide || a->w[1].n != H || a->w[2].n != 2 * a->ffn || a->w[3].n != H)
        return 2;
    float* h = a->scratch;
    float* qkv = h + (size_t)M * H;
    float* q = qkv + (size_t)M * wide;
    float* att = q + (size_t)M * nq;
    float* gu = att + (size_t)M * nq;
    float* act = gu + (size_t)M * 2 * a->ffn;
    float* x = a->x;

    rms_norm(x, a->attn_norm, h, M, H, a->eps);
    if (qgemm(&a->w[0], h, qkv, M, a->threads)) return 1;
    const size_t page_k = (size_t)a->kv_heads * D * P; /* floats per page, per pool */
    for (int r = 0; r < M; r++) {
        float* row = qkv + (size_t)r * wide;
        const float* c = a->cos + (size_t)r * a->rot;
        const float* s = a->sin + (size_t)r * a->rot;
        for (int hd = 0; hd < a->heads; hd++) rope(row + hd * D, c, s, a->rot);
        for (int hd = 0; hd < a->kv_heads; hd++) rope(row + nq + hd * D, c, s, a->rot);
        for (int i = 0; i < nq; i++) q[(size_t)r * nq + i] = row[i];
        float* kp = a->kpool + (size_t)a->page[r] * page_k;
        float* vp = a->vpool + (size_t)a->page[r] * page_k;
        const int64_t o = a->offset[r];
        for (int hd = 0; hd < a->kv_heads; hd++)
            for (int d = 0; d < D; d++) {
                kp[((size_t)hd * D + d) * P + o] = row[nq + hd * D + d];
                vp[((size_t)hd * P + o) * D + d] = row[nq + nkv + hd * D + d];
            }
    }
    if (mc_paged_decode_f32(q, a->kpool, a->vpool, a->table, a->lens, att, M, a->kv_heads,
                            a->heads / a->kv_heads, a->max_pages, a->scale, a->threads))
        return 3;
    if (qgemm(&a->w[1], att, h, M, a->threads)) return 1;
    for (long i = 0; i < (long)M * H; i++) x[i] += h[i];
    rms_norm(x, a->ffn_norm, h, M, H, a->eps);
    if (qgemm(&a->w[2], h, gu, M, a->threads)) return 1;
    const int F = a->ffn;
    for (int r = 0; r < M; r++)
        for (int i = 0; i < F; i++) {
            const float g = gu[(size_t)r * 2 * F + i], u = gu[(size_t)r * 2 * F + F + i];
            act[(size_t)r * F + i] = g / (1.f + expf(-g)) * u;
        }
    if (qgemm(&a->w[3], act, h, M, a->threads)) return 1;
    for (long i = 0; i < (long)M * H; i++) x[i] += h[i];
    return 0;
}
