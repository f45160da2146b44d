/* GEMMs over block-quantized weights with float32 activations: y[M, N] = x[M, K] @ W[N, K]^T.
 *
 * Built at run time by mooncake/engine/native/__init__.py (see there). The weights stay in
 * the blocks of 32 values a GGUF file stores them in, so a decode step reads 5 - 8.5 bits per
 * weight from memory instead of 32, and each value is the file's value exactly:
 *
 *   q4: qs [N, K/2] uint8, dm [N, K/32, 2] float32: w = d * q + m, q a 4-bit value; byte j
 *       of a block holds element j in its low nibble and element j + 16 in its high one
 *       (GGUF's Q4_1 layout; Q4_0 is the same with m = -8 d).
 *   q8: qs [N, K] int8, d [N, K/32] float32: w = d * q (GGUF's Q8_0).
 *
 * The activations are not quantized (llama.cpp quantizes them to 8 bits per block to use
 * integer dot products): each block is widened to float32 in registers and multiplied in
 * float32, so results differ from a float32 GEMM over the dequantized weights only in the
 * order of the sums. Rows of x are taken in tiles of up to 8 that share every widened block
 * (a decode batch of up to 8 reads the weights once); output rows are split over the calling
 * process's OpenMP threads (torch's runtime, as for paged_attention.c).
 *
 * With AVX-512, or AVX2 and FMA, the inner loops are written with intrinsics; elsewhere
 * plain loops the compiler vectorizes as it can (correct everywhere). The plain loops are
 * ~10x slower than the AVX2 ones on an AVX2-only EPYC (gcc does not vectorize their
 * widening and its 32 accumulators per row), so a CPU without AVX-512 needs its own path.
 */
#include <stddef.h>
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32

/* Block b of row n as 32 floats (the portable GEMM and the dequantization read blocks so). */
static inline void block_q4(const uint8_t* qs, const float* sc, int n, int nb, int b,
                            float* w) {
    const uint8_t* q = qs + ((size_t)n * nb + b) * 16;
    const float* dm = sc + ((size_t)n * nb + b) * 2;
    for (int j = 0; j < 16; j++) {
        w[j] = dm[0] * (float)(q[j] & 15) + dm[1];
        w[j + 16] = dm[0] * (float)(q[j] >> 4) + dm[1];
    }
}

static inline void block_q8(const uint8_t* qs, const float* sc, int n, int nb, int b,
                            float* w) {
    const int8_t* q = (const int8_t*)qs + ((size_t)n * nb + b) * QK;
    const float d = sc[(size_t)n * nb + b];
    for (int j = 0; j < QK; j++) w[j] = d * (float)q[j];
}

#ifdef __AVX512F__
#define Q_TILE(NAME, MT, WIDEN)                                                              \
    static void NAME(const uint8_t* qs, const float* sc, const float* x, int K, float* y,   \
                     int N, int n0, int n1) {                                                \
        const int nb = K / QK;                                                               \
        for (int n = n0; n < n1; n++) {                                                      \
            __m512 a0[MT], a1[MT];                                                           \
            for (int r = 0; r < MT; r++) { a0[r] = _mm512_setzero_ps(); a1[r] = a0[r]; }     \
            for (int b = 0; b < nb; b++) {                                                   \
                __m512 lo, hi;                                                               \
                WIDEN(qs, sc, n, nb, b, lo, hi);                                             \
                for (int r = 0; r < MT; r++) {                                               \
                    const float* xr = x + (size_t)r * K + (size_t)b * QK;                    \
                    a0[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), a0[r]);                 \
                    a1[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), a1[r]);            \
                }                                                                            \
            }                                                                                \
            for (int r = 0; r < MT; r++)                                                     \
                y[(size_t)r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));    \
        }                                                                                    \
    }

/* Rows of 3 to 8 (decode batches): two output columns at a time, so each x vector loaded
 * is multiplied by both columns' widened blocks (a load per two FMAs, not per FMA), one
 * accumulator a (row, column): 2 x MT of them, enough FMAs in flight to cover their
 * latency. On a 2-vCPU Zen 4 EPYC, 8 rows of SmolLM2's GEMMs: 0.97-1.07x on the 576-wide
 * inputs, 1.56x on the 1,536-wide one (whose 8 rows of x, 48 KiB, outgrow L1), and batch-8
 * decode ~370 -> ~400 tok/s. */
#define Q_TILE2(NAME, MT, WIDEN, ONE)                                                        \
    static void NAME(const uint8_t* qs, const float* sc, const float* x, int K, float* y,   \
                     int N, int n0, int n1) {                                                \
        const int nb = K / QK;                                                               \
        int n = n0;                                                                          \
        for (; n + 2 <= n1; n += 2) {                                                        \
            __m512 a[MT], c[MT];                                                             \
            for (int r = 0; r < MT; r++) { a[r] = _mm512_setzero_ps(); c[r] = a[r]; }       \
            for (int b = 0; b < nb; b++) {                                                   \
                __m512 lo, hi, lo2, hi2;                                                     \
                WIDEN(qs, sc, n, nb, b, lo, hi);                                             \
                WIDEN(qs, sc, n + 1, nb, b, lo2, hi2);                                       \
                for (int r = 0; r < MT; r++) {                                               \
                    const float* xr = x + (size_t)r * K + (size_t)b * QK;                    \
                    const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);   \
                    a[r] = _mm512_fmadd_ps(lo, x0, a[r]);                                    \
                    c[r] = _mm512_fmadd_ps(lo2, x0, c[r]);                                   \
                    a[r] = _mm512_fmadd_ps(hi, x1, a[r]);                                    \
                    c[r] = _mm512_fmadd_ps(hi2, x1, c[r]);                                   \
                }                                                                            \
            }                                                                                \
            for (int r = 0; r < MT; r++) {                                                   \
                y[(size_t)r * N + n] = _mm512_reduce_add_ps(a[r]);                           \
                y[(size_t)r * N + n + 1] = _mm512_reduce_add_ps(c[r]);                       \
            }                                                                                \
        }                                                                                    \
        if (n < n1) ONE(qs, sc, x, K, y, N, n, n1); /* an odd column left: Q_TILE's */     \
    }

/* The 32 values of block b of row n as two vectors of 16 floats. */
#define WIDEN_Q4(qs, sc, n, nb, b, lo, hi)                                                     \
    do {                                                                                       \
        const __m512i v = _mm512_cvtepu8_epi32(                                                \
            _mm_loadu_si128((const __m128i*)((qs) + ((size_t)(n) * (nb) + (b)) * 16)));        \
        const float* dm = (sc) + ((size_t)(n) * (nb) + (b)) * 2;                               \
        const __m512 d = _mm512_set1_ps(dm[0]), m = _mm512_set1_ps(dm[1]);                     \
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))),   \
                             d, m);                                                            \
        hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m);               \
    } while (0)

#define WIDEN_Q8(qs, sc, n, nb, b, lo, hi)                                                     \
    do {                                                                                       \
        const int8_t* q = (const int8_t*)(qs) + ((size_t)(n) * (nb) + (b)) * QK;               \
        const __m512 d = _mm512_set1_ps((sc)[(size_t)(n) * (nb) + (b)]);                       \
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                            \
                 _mm_loadu_si128((const __m128i*)q))), d);                                     \
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                            \
                 _mm_loadu_si128((const __m128i*)(q + 16)))), d);                              \
    } while (0)

#elif defined(__AVX2__) && defined(__FMA__)
/* Eight floats a vector: a block is four; each row keeps NACC accumulators (more for few
 * rows, so a decode step's one row is not one long chain of dependent FMAs). */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define Q_TILE_N(NAME, MT, NACC, WIDEN)                                                      \
    static void NAME(const uint8_t* qs, const float* sc, const float* x, int K, float* y,   \
                     int N, int n0, int n1) {                                                \
        const int nb = K / QK;                                                               \
        for (int n = n0; n < n1; n++) {                                                      \
            __m256 acc[MT][NACC];                                                            \
            for (int r = 0; r < MT; r++)                                                     \
                for (int a = 0; a < NACC; a++) acc[r][a] = _mm256_setzero_ps();              \
            for (int b = 0; b < nb; b++) {                                                   \
                __m256 w[4];                                                                 \
                WIDEN(qs, sc, n, nb, b, w);                                                  \
                for (int r = 0; r < MT; r++) {                                               \
                    const float* xr = x + (size_t)r * K + (size_t)b * QK;                    \
                    for (int i = 0; i < 4; i++)                                              \
                        acc[r][i % NACC] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), \
                                                           acc[r][i % NACC]);                \
                }                                                                            \
            }                                                                                \
            for (int r = 0; r < MT; r++) {                                                   \
                __m256 t = acc[r][0];                                                        \
                for (int a = 1; a < NACC; a++) t = _mm256_add_ps(t, acc[r][a]);              \
                y[(size_t)r * N + n] = hsum256(t);                                           \
            }                                                                                \
        }                                                                                    \
    }
#define Q_TILE(NAME, MT, WIDEN) Q_TILE_N(NAME, MT, ((MT) <= 2 ? 4 : (MT) == 3 ? 2 : 1), WIDEN)

/* The 32 values of block b of row n as four vectors of 8 floats, in element order. */
#define WIDEN_Q4(qs, sc, n, nb, b, w)                                                          \
    do {                                                                                       \
        const __m128i raw =                                                                    \
            _mm_loadu_si128((const __m128i*)((qs) + ((size_t)(n) * (nb) + (b)) * 16));         \
        const __m128i nib = _mm_set1_epi8(15);                                                 \
        const __m128i lo = _mm_and_si128(raw, nib);                  /* elements 0..15 */     \
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib); /* 16..31 */          \
        const float* dm = (sc) + ((size_t)(n) * (nb) + (b)) * 2;                               \
        const __m256 d = _mm256_set1_ps(dm[0]), m = _mm256_set1_ps(dm[1]);                     \
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);            \
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), \
                               d, m);                                                          \
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);            \
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), \
                               d, m);                                                          \
    } while (0)

#define WIDEN_Q8(qs, sc, n, nb, b, w)                                                          \
    do {                                                                                       \
        const int8_t* q = (const int8_t*)(qs) + ((size_t)(n) * (nb) + (b)) * QK;               \
        const __m256 d = _mm256_set1_ps((sc)[(size_t)(n) * (nb) + (b)]);                       \
        for (int i = 0; i < 4; i++)                                                            \
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(                      \
                       _mm_loadl_epi64((const __m128i*)(q + 8 * i)))), d);                     \
    } while (0)

#else /* portable */
#define Q_TILE(NAME, MT, WIDEN)                                                              \
    static void NAME(const uint8_t* qs, const float* sc, const float* x, int K, float* y,   \
                     int N, int n0, int n1) {                                                \
        const int nb = K / QK;                                                               \
        for (int n = n0; n < n1; n++) {                                                      \
            float acc[MT][QK];                                                               \
            for (int r = 0; r < MT; r++)                                                     \
                for (int j = 0; j < QK; j++) acc[r][j] = 0.f;                                \
            for (int b = 0; b < nb; b++) {                                                   \
                float w[QK];                                                                 \
                WIDEN(qs, sc, n, nb, b, w);                                                  \
                for (int r = 0; r < MT; r++) {                                               \
                    const float* xr = x + (size_t)r * K + (size_t)b * QK;                    \
                    for (int j = 0; j < QK; j++) acc[r][j] += w[j] * xr[j];                  \
                }                                                                            \
            }                                                                                \
            for (int r = 0; r < MT; r++) {                                                   \
                float s = 0.f;                                                               \
                for (int j = 0; j < QK; j++) s += acc[r][j];                                 \
                y[(size_t)r * N + n] = s;                                                    \
            }                                                                                \
        }                                                                                    \
    }

#define WIDEN_Q4(qs, sc, n, nb, b, w) block_q4(qs, sc, n, nb, b, w)
#define WIDEN_Q8(qs, sc, n, nb, b, w) block_q8(qs, sc, n, nb, b, w)
#endif

/* A tile for every row count up to 8, so that a decode batch's rows past its last whole 8 are
 * one pass over the weights, not one per power of two they split into: with tiles of 1, 2,
 * 4 and 8 only, batch 3 read the weights twice and 7 three times (a 2-vCPU Xeon, SmolLM2's
 * decode step at 256 tokens of context: batch 3 25.4 ms, 4 16.6 ms, 7 35.1 ms, 8 24.4 ms). */
Q_TILE(q4_1, 1, WIDEN_Q4) Q_TILE(q4_2, 2, WIDEN_Q4)
Q_TILE(q8_1, 1, WIDEN_Q8) Q_TILE(q8_2, 2, WIDEN_Q8)
#ifdef __AVX512F__
Q_TILE(q4_3c, 3, WIDEN_Q4) Q_TILE(q4_4c, 4, WIDEN_Q4) Q_TILE(q4_5c, 5, WIDEN_Q4)
Q_TILE(q4_6c, 6, WIDEN_Q4) Q_TILE(q4_7c, 7, WIDEN_Q4) Q_TILE(q4_8c, 8, WIDEN_Q4)
Q_TILE(q8_3c, 3, WIDEN_Q8) Q_TILE(q8_4c, 4, WIDEN_Q8) Q_TILE(q8_5c, 5, WIDEN_Q8)
Q_TILE(q8_6c, 6, WIDEN_Q8) Q_TILE(q8_7c, 7, WIDEN_Q8) Q_TILE(q8_8c, 8, WIDEN_Q8)
Q_TILE2(q4_3, 3, WIDEN_Q4, q4_3c) Q_TILE2(q4_4, 4, WIDEN_Q4, q4_4c)
Q_TILE2(q4_5, 5, WIDEN_Q4, q4_5c) Q_TILE2(q4_6, 6, WIDEN_Q4, q4_6c)
Q_TILE2(q4_7, 7, WIDEN_Q4, q4_7c) Q_TILE2(q4_8, 8, WIDEN_Q4, q4_8c)
Q_TILE2(q8_3, 3, WIDEN_Q8, q8_3c) Q_TILE2(q8_4, 4, WIDEN_Q8, q8_4c)
Q_TILE2(q8_5, 5, WIDEN_Q8, q8_5c) Q_TILE2(q8_6, 6, WIDEN_Q8, q8_6c)
Q_TILE2(q8_7, 7, WIDEN_Q8, q8_7c) Q_TILE2(q8_8, 8, WIDEN_Q8, q8_8c)
#else
Q_TILE(q4_3, 3, WIDEN_Q4) Q_TILE(q4_4, 4, WIDEN_Q4) Q_TILE(q4_5, 5, WIDEN_Q4)
Q_TILE(q4_6, 6, WIDEN_Q4) Q_TILE(q4_7, 7, WIDEN_Q4) Q_TILE(q4_8, 8, WIDEN_Q4)
Q_TILE(q8_3, 3, WIDEN_Q8) Q_TILE(q8_4, 4, WIDEN_Q8) Q_TILE(q8_5, 5, WIDEN_Q8)
Q_TILE(q8_6, 6, WIDEN_Q8) Q_TILE(q8_7, 7, WIDEN_Q8) Q_TILE(q8_8, 8, WIDEN_Q8)
#endif

typedef void (*tile_fn)(const uint8_t*, const float*, const float*, int, float*, int, int, int);

/* Thread t of T's share of y: output columns [N t / T, N (t + 1) / T), every row: whole
 * tiles of 8 rows, then the rest (1..7) as one tile. `tiles[m - 1]` takes m rows. */
static void gemm_slice(const tile_fn* tiles, const uint8_t* qs, const float* sc, const float* x,
                       float* y, int M, int N, int K, int t, int T) {
    const int n0 = (int)((long)N * t / T), n1 = (int)((long)N * (t + 1) / T);
    int r = 0;
    for (; r + 8 <= M; r += 8) tiles[7](qs, sc, x + (size_t)r * K, K, y + (size_t)r * N, N, n0, n1);
    if (M > r) tiles[M - r - 1](qs, sc, x + (size_t)r * K, K, y + (size_t)r * N, N, n0, n1);
}

static int gemm(const tile_fn* tiles, const uint8_t* qs, const float* sc, const float* x,
                float* y, int M, int N, int K, int threads) {
    if (K % QK || M < 0 || N < 0) return 1;
    #pragma omp parallel num_threads(threads)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        T = omp_get_num_threads();
#endif
        gemm_slice(tiles, qs, sc, x, y, M, N, K, t, T);
    }
    return 0;
}

static const tile_fn Q4_TILES[8] = {q4_1, q4_2, q4_3, q4_4, q4_5, q4_6, q4_7, q4_8};
static const tile_fn Q8_TILES[8] = {q8_1, q8_2, q8_3, q8_4, q8_5, q8_6, q8_7, q8_8};

int mc_q4_gemm(const uint8_t* qs, const float* dm, const float* x, float* y, int M, int N,
               int K, int threads) {
    return gemm(Q4_TILES, qs, dm, x, y, M, N, K, threads);
}

int mc_q8_gemm(const uint8_t* qs, const float* d, const float* x, float* y, int M, int N,
               int K, int threads) {
    return gemm(Q8_TILES, qs, d, x, y, M, N, K, threads);
}

/* Rows n0..n1-1 of W as float32 (out [n1 - n0, K]): for GEMMs of many rows (a prefill),
 * which run faster as one float32 GEMM over a dequantized slice. One function a format, so
 * that its block is inlined and vectorized. The _bf16 ones write bfloat16 (uint16 bits),
 * rounded to the nearest even as torch rounds, for GEMMs in bfloat16 (engine.quant). */
#define DEQUANT(NAME, BLOCK, T)                                                                \
    int NAME(const uint8_t* qs, const float* sc, T* out, int n0, int n1, int K,                \
             int threads) {                                                                    \
        if (K % QK) return 1;                                                                  \
        const int nb = K / QK;                                                                 \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                      \
        for (int n = n0; n < n1; n++)                                                          \
            for (int b = 0; b < nb; b++)                                                       \
                BLOCK(qs, sc, n, nb, b, out + (size_t)(n - n0) * K + (size_t)b * QK);          \
        return 0;                                                                              \
    }

/* A float as bfloat16, rounded to the nearest even (the weights are finite). */
static inline uint16_t bf16_round(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* A block as floats, then rounded to bfloat16 (a loop the compiler vectorizes). */
#define BF16_BLOCK(NAME, BLOCK)                                                                \
    static inline void NAME(const uint8_t* qs, const float* sc, int n, int nb, int b,          \
                            uint16_t* w) {                                                     \
        float f[QK];                                                                           \
        BLOCK(qs, sc, n, nb, b, f);                                                            \
        for (int j = 0; j < QK; j++) w[j] = bf16_round(f[j]);                                  \
    }

#ifdef __AVX512F__
/* With AVX-512, a block widened as the GEMM tiles widen it (WIDEN_Q4, WIDEN_Q8): gcc's
 * vectorization of block_q4 ran the dequantization of SmolLM2's weights at ~17 G values
 * a second on a Zen 5 EPYC (2 threads), these at 24-27 G (into a buffer the caches hold). */
#define WIDE_BLOCK(NAME, WIDEN, T, STORE)                                                      \
    static inline void NAME(const uint8_t* qs, const float* sc, int n, int nb, int b, T* w) {  \
        __m512 lo, hi;                                                                         \
        WIDEN(qs, sc, n, nb, b, lo, hi);                                                       \
        STORE(w, lo, hi);                                                                      \
    }
#define STORE_F32(w, lo, hi) (_mm512_storeu_ps(w, lo), _mm512_storeu_ps((w) + 16, hi))
WIDE_BLOCK(block_q4_f32, WIDEN_Q4, float, STORE_F32)
WIDE_BLOCK(block_q8_f32, WIDEN_Q8, float, STORE_F32)
#else
#define block_q4_f32 block_q4
#define block_q8_f32 block_q8
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* With AVX512_BF16, the two halves of a widened block rounded by one instruction
 * (vcvtne2ps2bf16: nearest even, as bf16_round). */
#define STORE_BF16(w, lo, hi) _mm512_storeu_si512(w, (__m512i)_mm512_cvtne2ps_pbh(hi, lo))
WIDE_BLOCK(block_q4_bf16, WIDEN_Q4, uint16_t, STORE_BF16)
WIDE_BLOCK(block_q8_bf16, WIDEN_Q8, uint16_t, STORE_BF16)
#else
BF16_BLOCK(block_q4_bf16, block_q4_f32)
BF16_BLOCK(block_q8_bf16, block_q8_f32)
#endif

DEQUANT(mc_q4_dequant, block_q4_f32, float)
DEQUANT(mc_q8_dequant, block_q8_f32, float)
DEQUANT(mc_q4_dequant_bf16, block_q4_bf16, uint16_t)
DEQUANT(mc_q8_dequant_bf16, block_q8_bf16, uint16_t)
