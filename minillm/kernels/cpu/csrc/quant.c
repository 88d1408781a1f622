/* Weight-only quantized GEMV / small-batch GEMM for CPUs: y[M,N] = x[M,K] @ dequant(W)[N,K]^T, M small (decode).
 *
 * Why: decode streams every weight once per token, so its time is bytes / bandwidth.  int8 weights are 4x fewer
 * bytes than fp32 and Q4_1 int4 blocks (5 bits per weight) 6.4x fewer — if the kernel dequantizes in registers
 * instead of writing a float copy back to memory, and if its arithmetic keeps up with the bytes: at 5 bits a weight,
 * 20 GB/s is 32 G weights/s, a few instructions per 32 weights per core.  OpenMP splits the N weight rows across
 * threads; each row (K/2 bytes for int4) is read once and dotted with all M input rows (tiles of QTILE rows, the row
 * staying in L1 between tiles), so the weights are streamed once per batch.
 *
 * Formats (minillm/quant/weight.py).  int4 = Q4_1: per 32-weight block 16 bytes, byte j holds weight j (low nibble)
 * and weight j+16 (high nibble); d and m per group of G weights (G a multiple of 32), w = d*q + m.
 * int8: w = s * q, s per group of G weights along K (G = K: per output channel; G = 32: GGUF Q8_0).
 *
 * Two paths per format:
 *  - exact (q4_gemm, q8_gemm): fp32 activations.  Each block is dequantized to 32 floats exactly as the reference
 *    does (d*q + m, s*q), shared by the M rows, then one FMA per weight and row: the W4A16/W8A16 reference up to fp32
 *    summation order.  Plain C that the compiler vectorises; one int->float convert per weight is its cost.
 *  - int8 activations (q4_gemm_q8, q8_gemm_q8), llama.cpp's Q8_1/Q8_0 scheme: each row of x is rounded per block
 *    of 32 to int8, xq = rint(x / dx), dx = max|x| / 127, and per block
 *        sum_j w_j xhat_j = d*dx * sum_j q_j xq_j  +  m * dx * sum_j xq_j        (xhat = dx * xq)
 *    with the 32 products in integers (AVX-512 VNNI vpdpbusd, AVX2 vpmaddubsw + vpmaddwd, or plain C): one
 *    instruction per 32 weights instead of 32 converts and FMAs.  The result is exactly the reference applied to
 *    xhat (up to fp32 summation order); xhat differs from x by at most dx/2 per element (minillm's
 *    quant.q8_activation_ref is the PyTorch twin of the rounding).
 * Scales/mins are fp32 or fp16 (scale_f16 = 1); activations fp32 or bf16 (x_bf16 = 1; then y is bf16 too).
 * Build: cc -O3 -march=native -ffast-math -fopenmp -shared -fPIC on first use, cached.  Without AVX2 (or on ARM)
 * the integer path is plain C loops, correct everywhere and vectorised where the compiler can.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QTILE 8  /* input rows per register tile; more rows take more tiles over the same (L1-resident) weight row */
#define QB 32    /* weights per block: Q4_1 / Q8_0 / Q8_1 */
#define INLINE static inline __attribute__((always_inline))

static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else /* IEEE half -> float by bits (normals, subnormals, inf/nan) */
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, mant = h & 0x3ffu, u;
    if (e == 0) {
        if (mant == 0) u = s;
        else { /* subnormal: normalise */
            e = 113;
            while (!(mant & 0x400u)) { mant <<= 1; e--; }
            u = s | (e << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (e == 31) u = s | 0x7f800000u | (mant << 13);
    else u = s | ((e + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float bf2f(uint16_t b) {
    uint32_t u = ((uint32_t)b) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float scale_at(const void *s, int f16, int64_t i) {
    return f16 ? h2f(((const uint16_t *)s)[i]) : ((const float *)s)[i];
}

/* x as fp32 (a copy only for bf16 input: M*K floats, tiny next to W). */
static const float *x_f32(const void *x, int x_bf16, int64_t n, float **owned) {
    *owned = NULL;
    if (!x_bf16) return (const float *)x;
    float *f = (float *)malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) f[i] = bf2f(((const uint16_t *)x)[i]);
    *owned = f;
    return f;
}

static inline void store_y(void *y, int x_bf16, int64_t i, float v) {
    if (x_bf16) ((uint16_t *)y)[i] = f2bf(v);
    else ((float *)y)[i] = v;
}

/* Run BODY(r) with r = rows in this tile as a compile-time constant, so the per-row accumulators of an
 * always-inlined row kernel become registers (a runtime count would keep them in memory). */
#define FOR_TILE(mr, BODY)                                                                                   \
    switch (mr) {                                                                                            \
    case 1: BODY(1); break; case 2: BODY(2); break; case 3: BODY(3); break; case 4: BODY(4); break;         \
    case 5: BODY(5); break; case 6: BODY(6); break; case 7: BODY(7); break; default: BODY(8); break;         \
    }

/* ---------------------------------------------------------------- exact paths (fp32 activations) */

/* One weight row n against R input rows: 32 dequantized weights per block, shared by the R rows. */
INLINE void q4_exact_row(const uint8_t *restrict p, const void *sc, const void *mi, int f16, int64_t row,
                         const float *restrict x, float *restrict out, int64_t K, int64_t G, const int R) {
    float acc[QTILE][QB] = {{0.f}};
    const int64_t ng = K / G;
    for (int64_t g = 0; g < ng; g++) { /* no integer division in the loop: ~40 cycles each, per block */
        const float d = scale_at(sc, f16, row * ng + g), mn = scale_at(mi, f16, row * ng + g);
        for (int64_t b = g * (G / QB); b < (g + 1) * (G / QB); b++) {
            const uint8_t *restrict pb = p + b * (QB / 2);
            float w[QB]; /* d*q + m as the reference computes it (one FMA when contracted) */
            for (int j = 0; j < QB / 2; j++) w[j] = d * (float)(pb[j] & 0x0F) + mn;
            for (int j = 0; j < QB / 2; j++) w[QB / 2 + j] = d * (float)(pb[j] >> 4) + mn;
            for (int m = 0; m < R; m++) {
                const float *restrict xb = x + m * K + b * QB;
#pragma omp simd
                for (int j = 0; j < QB; j++) acc[m][j] += w[j] * xb[j];
            }
        }
    }
    for (int m = 0; m < R; m++) {
        float s = 0.f;
        for (int j = 0; j < QB; j++) s += acc[m][j];
        out[m] = s;
    }
}

/* Any group size G dividing K (per-channel int8 with K not a multiple of 32 lands here with G = K). */
INLINE void q8_exact_row(const int8_t *restrict w, const void *sc, int f16, int64_t row, const float *restrict x,
                         float *restrict out, int64_t K, int64_t G, const int R) {
    const int64_t ng = K / G;
    if (G % QB == 0) { /* 32 lanes per input row, the group's scale folded into the block's 32 floats */
        float acc[QTILE][QB] = {{0.f}};
        for (int64_t g = 0; g < ng; g++) {
            const float s = scale_at(sc, f16, row * ng + g);
            for (int64_t b = g * (G / QB); b < (g + 1) * (G / QB); b++) {
                float q[QB];
#pragma omp simd
                for (int j = 0; j < QB; j++) q[j] = s * (float)w[b * QB + j];
                for (int m = 0; m < R; m++) {
                    const float *restrict xb = x + m * K + b * QB;
#pragma omp simd
                    for (int j = 0; j < QB; j++) acc[m][j] += q[j] * xb[j];
                }
            }
        }
        for (int m = 0; m < R; m++) {
            float s = 0.f;
            for (int j = 0; j < QB; j++) s += acc[m][j];
            out[m] = s;
        }
        return;
    }
    for (int m = 0; m < R; m++) { /* one reduction per group */
        float s = 0.f;
        for (int64_t g = 0; g < ng; g++) {
            float a = 0.f;
            const float *restrict xg = x + m * K + g * G;
            const int8_t *restrict wg = w + g * G;
#pragma omp simd reduction(+ : a)
            for (int64_t k = 0; k < G; k++) a += (float)wg[k] * xg[k];
            s += scale_at(sc, f16, row * ng + g) * a;
        }
        out[m] = s;
    }
}

void q4_gemm(const uint8_t *restrict P, const void *scales, const void *mins, int scale_f16, const void *xin,
             int x_bf16, void *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    float *owned;
    const float *restrict x = x_f32(xin, x_bf16, M * K, &owned);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m0 = 0; m0 < M; m0 += QTILE) {
            float out[QTILE];
            const int64_t mr = M - m0 < QTILE ? M - m0 : QTILE;
#define Q4_EXACT(R) q4_exact_row(P + n * (K / 2), scales, mins, scale_f16, n, x + m0 * K, out, K, G, R)
            FOR_TILE(mr, Q4_EXACT)
#undef Q4_EXACT
            for (int64_t m = 0; m < mr; m++) store_y(y, x_bf16, (m0 + m) * N + n, out[m]);
        }
    }
    free(owned);
}

void q8_gemm(const int8_t *restrict W, const void *scales, int scale_f16, const void *xin, int x_bf16, void *y,
             int64_t M, int64_t N, int64_t K, int64_t G) {
    float *owned;
    const float *restrict x = x_f32(xin, x_bf16, M * K, &owned);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m0 = 0; m0 < M; m0 += QTILE) {
            float out[QTILE];
            const int64_t mr = M - m0 < QTILE ? M - m0 : QTILE;
#define Q8_EXACT(R) q8_exact_row(W + n * K, scales, scale_f16, n, x + m0 * K, out, K, G, R)
            FOR_TILE(mr, Q8_EXACT)
#undef Q8_EXACT
            for (int64_t m = 0; m < mr; m++) store_y(y, x_bf16, (m0 + m) * N + n, out[m]);
        }
    }
    free(owned);
}

/* ---------------------------------------------------------------- int8-activation paths */

/* x [M, K] -> xq int8 [M, K], dx [M, K/32] (block scale), sx [M, K/32] = dx * sum(xq) (the block's sum of xhat).
 * rint rounds half to even, as torch.round does in the PyTorch twin. */
static void quantize_x(const float *restrict x, int64_t n, int8_t *restrict xq, float *restrict dx,
                       float *restrict sx) {
    for (int64_t b = 0; b < n / QB; b++) {
        const float *restrict xb = x + b * QB;
        float amax = 0.f;
        for (int j = 0; j < QB; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int32_t s = 0;
        for (int j = 0; j < QB; j++) {
            const int32_t q = (int32_t)rintf(xb[j] * id);
            xq[b * QB + j] = (int8_t)q;
            s += q;
        }
        dx[b] = d;
        sx[b] = d * (float)s;
    }
}

/* A block of 32 weight codes (wq_t) and per-row accumulators (vacc_t): 8 fp32 lanes under AVX2, one float in C. */
#if defined(__AVX2__)
typedef __m256i q4blk_t;
typedef struct { __m256i u, w; } q8blk_t; /* |w| (unsigned operand) and w (its sign goes onto x) */
typedef __m256 vacc_t;

static inline __m256i dot_u8s8(__m256i u, __m256i s) { /* 8 lanes, each the sum of 4 products u8 * s8 */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else /* pairs into int16 (|products| <= 2 * 128 * 127: no saturation), then pairs into int32 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
INLINE q4blk_t q4_load(const uint8_t *p) { /* 16 bytes -> 32 codes in weight order (low nibbles, then high) */
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}
INLINE q8blk_t q8_load(const int8_t *p) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)p);
    q8blk_t b = {_mm256_sign_epi8(w, w), w};
    return b;
}
INLINE vacc_t vacc_zero(void) { return _mm256_setzero_ps(); }
INLINE vacc_t q4_fma(vacc_t acc, q4blk_t c, const int8_t *xq, float s) {
    const __m256i d = dot_u8s8(c, _mm256_loadu_si256((const __m256i *)xq));
    return _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(d), acc);
}
INLINE vacc_t q8_fma(vacc_t acc, q8blk_t c, const int8_t *xq, float s) {
    const __m256i d = dot_u8s8(c.u, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xq), c.w));
    return _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(d), acc);
}
INLINE vacc_t vacc_add(vacc_t a, vacc_t b) { return _mm256_add_ps(a, b); }
INLINE float vacc_sum(vacc_t a) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
#else /* portable C: integer dot products the compiler may vectorise (e.g. to ARM sdot with dotprod) */
typedef struct { int8_t v[QB]; } q4blk_t;
typedef struct { int8_t v[QB]; } q8blk_t;
typedef float vacc_t;

static inline int32_t dot32(const int8_t *restrict a, const int8_t *restrict b) {
    int32_t s = 0;
    for (int j = 0; j < QB; j++) s += (int32_t)a[j] * (int32_t)b[j];
    return s;
}
INLINE q4blk_t q4_load(const uint8_t *p) {
    q4blk_t c;
    for (int j = 0; j < QB / 2; j++) c.v[j] = (int8_t)(p[j] & 0x0F);
    for (int j = 0; j < QB / 2; j++) c.v[QB / 2 + j] = (int8_t)(p[j] >> 4);
    return c;
}
INLINE q8blk_t q8_load(const int8_t *p) {
    q8blk_t c;
    memcpy(c.v, p, QB);
    return c;
}
INLINE vacc_t vacc_zero(void) { return 0.f; }
INLINE vacc_t q4_fma(vacc_t acc, q4blk_t c, const int8_t *xq, float s) { return acc + s * (float)dot32(c.v, xq); }
INLINE vacc_t q8_fma(vacc_t acc, q8blk_t c, const int8_t *xq, float s) { return acc + s * (float)dot32(c.v, xq); }
INLINE vacc_t vacc_add(vacc_t a, vacc_t b) { return a + b; }
INLINE float vacc_sum(vacc_t a) { return a; }
#endif

/* n consecutive scales (fp16 or fp32) -> fp32, 8 at a time with F16C. */
static inline void to_f32(const void *s, int f16, int64_t off, int64_t n, float *restrict out) {
    int64_t i = 0;
#if defined(__F16C__)
    if (f16)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + off + i))));
#endif
    for (; i < n; i++) out[i] = scale_at(s, f16, off + i);
}

/* Per weight row, before its block loop: sc [R, nb] = d(group of block b) * dx[m, b], in vectorised loops, so the
 * block loop only broadcasts one float per block and row (scalar fp16 converts and multiplies there cost as much
 * as the integer dot itself).  tmp holds nb + ng floats. */
INLINE void block_scales(const void *sc, int f16, int64_t row, const float *restrict dx, float *restrict out,
                         float *restrict tmp, int64_t nb, int64_t ng, const int R) {
    const int64_t bpg = nb / ng;
    float *restrict dw = tmp, *restrict dwb = bpg == 1 ? tmp : tmp + ng;
    to_f32(sc, f16, row * ng, ng, dw);
    if (bpg > 1)
        for (int64_t g = 0; g < ng; g++)
            for (int64_t j = 0; j < bpg; j++) dwb[g * bpg + j] = dw[g];
    for (int m = 0; m < R; m++)
        for (int64_t b = 0; b < nb; b++) out[m * nb + b] = dwb[b] * dx[m * nb + b];
}

/* One Q4_1 weight row against R quantized input rows; xs [R, K/G]: per group, the sum of xhat.  Two accumulator
 * chains per row (even / odd blocks): one chain would wait on the FMA latency every block at batch 1. */
INLINE void q4_q8_row(const uint8_t *restrict p, const void *sc, const void *mi, int f16, int64_t row,
                      const int8_t *restrict xq, const float *restrict dx, const float *restrict xs,
                      float *restrict out, float *restrict tmp, int64_t K, int64_t G, const int R) {
    const int64_t ng = K / G, nb = K / QB;
    float *restrict s = tmp, *restrict mw = tmp + R * nb;
    float mt[QTILE];
    block_scales(sc, f16, row, dx, s, mw + ng, nb, ng, R);
    to_f32(mi, f16, row * ng, ng, mw);
    for (int m = 0; m < R; m++) { /* the mins' term: sum over groups of m_g * sum(xhat in g) */
        float t = 0.f;
        for (int64_t g = 0; g < ng; g++) t += mw[g] * xs[m * ng + g];
        mt[m] = t;
    }
    vacc_t a0[QTILE], a1[QTILE];
    for (int m = 0; m < R; m++) a0[m] = vacc_zero(), a1[m] = vacc_zero();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const q4blk_t c0 = q4_load(p + b * (QB / 2)), c1 = q4_load(p + (b + 1) * (QB / 2)); /* shared by R rows */
        for (int m = 0; m < R; m++) {
            a0[m] = q4_fma(a0[m], c0, xq + m * K + b * QB, s[m * nb + b]);
            a1[m] = q4_fma(a1[m], c1, xq + m * K + (b + 1) * QB, s[m * nb + b + 1]);
        }
    }
    if (b < nb) {
        const q4blk_t c0 = q4_load(p + b * (QB / 2));
        for (int m = 0; m < R; m++) a0[m] = q4_fma(a0[m], c0, xq + m * K + b * QB, s[m * nb + b]);
    }
    for (int m = 0; m < R; m++) out[m] = vacc_sum(vacc_add(a0[m], a1[m])) + mt[m];
}

/* int8 weights: one scale per group (per row when per-channel), so the block's scale is one scalar product. */
INLINE void q8_q8_row(const int8_t *restrict w, const void *sc, int f16, int64_t row, const int8_t *restrict xq,
                      const float *restrict dx, float *restrict out, int64_t K, int64_t G, const int R) {
    const int64_t ng = K / G, nb = K / QB, bpg = G / QB;
    vacc_t a0[QTILE], a1[QTILE];
    for (int m = 0; m < R; m++) a0[m] = vacc_zero(), a1[m] = vacc_zero();
    for (int64_t g = 0; g < ng; g++) {
        const float s = scale_at(sc, f16, row * ng + g);
        int64_t b = g * bpg;
        for (; b + 2 <= (g + 1) * bpg; b += 2) {
            const q8blk_t c0 = q8_load(w + b * QB), c1 = q8_load(w + (b + 1) * QB);
            for (int m = 0; m < R; m++) {
                a0[m] = q8_fma(a0[m], c0, xq + m * K + b * QB, s * dx[m * nb + b]);
                a1[m] = q8_fma(a1[m], c1, xq + m * K + (b + 1) * QB, s * dx[m * nb + b + 1]);
            }
        }
        if (b < (g + 1) * bpg) {
            const q8blk_t c0 = q8_load(w + b * QB);
            for (int m = 0; m < R; m++) a0[m] = q8_fma(a0[m], c0, xq + m * K + b * QB, s * dx[m * nb + b]);
        }
    }
    for (int m = 0; m < R; m++) out[m] = vacc_sum(vacc_add(a0[m], a1[m]));
}

/* The activations' int8 blocks for M rows: xq [M, K], dx [M, K/32], and per group of G the sum of xhat [M, K/G]
 * (M*K bytes + a few floats: computed once per call, before the threads split the weight rows). */
typedef struct { int8_t *xq; float *dx, *xs; } xq_t;

static xq_t xq_make(const void *xin, int x_bf16, int64_t M, int64_t K, int64_t G) {
    float *owned;
    const float *x = x_f32(xin, x_bf16, M * K, &owned);
    xq_t q = {(int8_t *)malloc(M * K), (float *)malloc(sizeof(float) * M * (K / QB)),
              (float *)malloc(sizeof(float) * M * (K / G))};
    float *sx = (float *)malloc(sizeof(float) * M * (K / QB));
    quantize_x(x, M * K, q.xq, q.dx, sx);
    for (int64_t i = 0; i < M * (K / G); i++) { /* blocks of a group are consecutive; groups never span rows */
        float s = 0.f;
        for (int64_t b = i * (G / QB); b < (i + 1) * (G / QB); b++) s += sx[b];
        q.xs[i] = s;
    }
    free(sx);
    free(owned);
    return q;
}

static void xq_free(xq_t q) {
    free(q.xq);
    free(q.dx);
    free(q.xs);
}

/* Needs K % 32 == 0 and G % 32 == 0 (always so for Q4_1; the wrapper sends other int8 shapes to q8_gemm). */
void q4_gemm_q8(const uint8_t *restrict P, const void *scales, const void *mins, int scale_f16, const void *xin,
                int x_bf16, void *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    const xq_t q = xq_make(xin, x_bf16, M, K, G);
    const int64_t nb = K / QB, ng = K / G;
#pragma omp parallel
    {
        float *tmp = (float *)malloc(sizeof(float) * (QTILE * nb + 3 * ng + nb)); /* per thread: row scales */
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            for (int64_t m0 = 0; m0 < M; m0 += QTILE) {
                float out[QTILE];
                const int64_t mr = M - m0 < QTILE ? M - m0 : QTILE;
#define Q4_Q8(R) q4_q8_row(P + n * (K / 2), scales, mins, scale_f16, n, q.xq + m0 * K, q.dx + m0 * nb, \
                           q.xs + m0 * ng, out, tmp, K, G, R)
                FOR_TILE(mr, Q4_Q8)
#undef Q4_Q8
                for (int64_t m = 0; m < mr; m++) store_y(y, x_bf16, (m0 + m) * N + n, out[m]);
            }
        }
        free(tmp);
    }
    xq_free(q);
}

void q8_gemm_q8(const int8_t *restrict W, const void *scales, int scale_f16, const void *xin, int x_bf16, void *y,
                int64_t M, int64_t N, int64_t K, int64_t G) {
    const xq_t q = xq_make(xin, x_bf16, M, K, G);
    const int64_t nb = K / QB;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m0 = 0; m0 < M; m0 += QTILE) {
            float out[QTILE];
            const int64_t mr = M - m0 < QTILE ? M - m0 : QTILE;
#define Q8_Q8(R) q8_q8_row(W + n * K, scales, scale_f16, n, q.xq + m0 * K, q.dx + m0 * nb, out, K, G, R)
            FOR_TILE(mr, Q8_Q8)
#undef Q8_Q8
            for (int64_t m = 0; m < mr; m++) store_y(y, x_bf16, (m0 + m) * N + n, out[m]);
        }
    }
    xq_free(q);
}

/* 1 when compiled with OpenMP (rows split across threads), else 0. */
int quant_built_with_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Which integer dot product the int8-activation path compiled to: 3 VNNI, 2 AVX2, 0 portable C. */
int quant_simd_level(void) {
#if defined(__AVX2__) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 3;
#elif defined(__AVX2__)
    return 2;
#else
    return 0;
#endif
}
