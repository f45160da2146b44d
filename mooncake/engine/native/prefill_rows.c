/* A prefill's RoPE between its GEMMs, one pass over memory (engine.model).
 *
 * mc_rope_qkv: the q, k and v of a block of rows out of their fused GEMM's result, RoPE'd
 * (q, k) and laid out head-major for attention. In torch it is a transpose, a float32 copy
 * of each of x * cos, the rotated half, its negation, their concatenation, the product with
 * sin and the sum, then a rounding back to bfloat16: ~9 ms of a 3,000-row SmolLM2 layer on
 * a 2-vCPU Xeon, a sixth of the layer. Here one read and one write per element.
 *
 * The math is torch's (HF's rotate_half RoPE over the first `rot` dims of each head; the
 * rest pass through): out[i] = x[i] cos[i] - x[i + rot/2] sin[i] for i < rot/2, out[i] =
 * x[i] cos[i] + x[i - rot/2] sin[i] for rot/2 <= i < rot, every product and sum a float32
 * rounding as torch does them (no fused multiply-add: see the pragma), so the result is
 * bit for bit the torch path's (tested).
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even, NaN kept a quiet NaN: c10::BFloat16's conversion. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if (f != f) return 0x7FC0;
    bits += ((bits >> 16) & 1) + 0x7FFF;
    return (uint16_t)(bits >> 16);
}

static inline float load(const void* base, long i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

static inline void store(void* base, long i, float x, int bf16) {
    if (bf16)
        ((uint16_t*)base)[i] = f32_to_bf16(x);
    else
        ((float*)base)[i] = x;
}

/* Rows r in [0, rows) of `qkv` ([rows, (heads + 2 kv_heads) * dim], q then k then v, row
 * stride `ld` elements; bfloat16 if in_bf16 else float32), with cos, sin [rows, rot] float32
 * contiguous. Writes k, v [kv_heads, kv_len, dim] at position kv_row0 + r, and, for rows
 * r >= q_from, q [heads, q_len, dim] at position q_row0 + r - q_from (bfloat16 if out_bf16
 * else float32). Returns non-zero for arguments it cannot take. */
int mc_rope_qkv(const void* qkv, int in_bf16, long ld, long rows, int heads, int kv_heads,
                int dim, int rot, const float* cos_, const float* sin_, void* q, void* k,
                void* v, int out_bf16, long q_len, long kv_len, long kv_row0, long q_from,
                long q_row0, int threads) {
    if (rot > dim || rot % 2 || rows < 0 || heads < 1 || kv_heads < 1) return 1;
    const int half = rot / 2, all = heads + 2 * kv_heads;
    const long units = rows * all;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long u = 0; u < units; u++) {
        const long r = u / all;
        const int h = (int)(u % all);
        const long src = r * ld + (long)h * dim;
        void* out;
        long dst;
        int rotate = 1;
        if (h < heads) {
            if (r < q_from) continue;
            out = q;
            dst = ((long)h * q_len + q_row0 + r - q_from) * dim;
        } else if (h < heads + kv_heads) {
            out = k;
            dst = ((long)(h - heads) * kv_len + kv_row0 + r) * dim;
        } else {
            out = v;
            dst = ((long)(h - heads - kv_heads) * kv_len + kv_row0 + r) * dim;
            rotate = 0;
        }
        const float* c = cos_ + r * rot;
        const float* s = sin_ + r * rot;
        if (rotate) {
            for (int i = 0; i < half; i++) {
                float x1 = load(qkv, src + i, in_bf16), x2 = load(qkv, src + i + half, in_bf16);
                float a = x1 * c[i], b = x2 * s[i];
                store(out, dst + i, a - b, out_bf16);
                float a2 = x2 * c[i + half], b2 = x1 * s[i + half];
                store(out, dst + i + half, a2 + b2, out_bf16);
            }
        }
        for (int i = rotate ? rot : 0; i < dim; i++)
            store(out, dst + i, load(qkv, src + i, in_bf16), out_bf16);
    }
    return 0;
}
