/* Weight-only quantized GEMV / small-batch GEMM for CPUs: y[M,N] = x[M,K] @ dequant(W)[N,K]^T, M = 1..8.
 *
 * Why: decode streams every weight once per token, so its time is bytes / bandwidth.  int8 weights are 4x fewer
 * bytes than fp32 and Q4_1 int4 blocks (5 bits per weight) 6.4x fewer — if the kernel dequantizes in registers
 * instead of writing a float copy back to memory.  Each weight row is read once (OpenMP splits the N rows across
 * threads) and dotted with all M input rows while its codes sit in registers/L1.
 *
 * int4 (Q4_1 layout, see minillm/quant/weight.py): per 32-weight block, 16 bytes; byte j holds weight j (low
 * nibble) and weight j+16 (high nibble); d and m per group of G weights (G a multiple of 32), w = d*q + m.
 * Per group,  sum_k w_k x_k = d * sum_k q_k x_k + m * sum_k x_k:  the sums of x per group are computed once per
 * call (M*K/G floats), so the inner loop is one int->float convert and one FMA per weight and input row.
 * Each block is unpacked to 32 floats d*q in weight order (registers), and the products are kept in 32 lanes
 * (acc[j] += d q_j x_j) so the compiler vectorises along j and reduces across lanes once per row, not per block.
 * (Reading the high nibbles against x[j + 16] in the same loop defeated gcc's vectoriser: 4x slower.)
 *
 * int8: w = s * q, s per group of G weights along K (G = K: per output channel; G = 32: GGUF Q8_0).
 *
 * Results equal the reference (dequantize, then F.linear) up to fp32 summation order.
 * Scales/mins are fp32 or fp16 (scale_f16 = 1); activations fp32 or bf16 (x_bf16 = 1; then y is bf16 too).
 * Build: like native.c (cc -O3 -march=native -ffast-math -fopenmp -shared -fPIC), on first use, cached.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define QMAX_ROWS 8

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

void q4_gemm(const uint8_t *restrict P, const void *scales, const void *mins, int scale_f16, const void *xin,
             int x_bf16, void *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    float *owned;
    const float *restrict x = x_f32(xin, x_bf16, M * K, &owned);
    const int64_t ng = K / G;
    float *xs = (float *)malloc(sizeof(float) * M * ng); /* sum of x over each group, per input row */
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            float s = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) s += x[m * K + k];
            xs[m * ng + g] = s;
        }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *restrict p = P + n * (K / 2);
        float acc[QMAX_ROWS][32], mterm[QMAX_ROWS];
        memset(acc, 0, sizeof(float) * 32 * M);
        memset(mterm, 0, sizeof(float) * M);
        for (int64_t g = 0; g < ng; g++) { /* no integer division in the loop: ~40 cycles each, per block */
            const float d = scale_at(scales, scale_f16, n * ng + g), mn = scale_at(mins, scale_f16, n * ng + g);
            for (int64_t b = g * (G / 32); b < (g + 1) * (G / 32); b++) {
                const uint8_t *restrict pb = p + b * 16;
                for (int64_t m = 0; m < M; m++) { /* unpacked per input row: codes never leave registers */
                    const float *restrict xlo = x + m * K + b * 32, *restrict xhi = xlo + 16;
                    float *restrict alo = acc[m], *restrict ahi = acc[m] + 16;
#pragma omp simd
                    for (int j = 0; j < 16; j++) {
                        alo[j] += d * (float)(pb[j] & 0x0F) * xlo[j];
                        ahi[j] += d * (float)(pb[j] >> 4) * xhi[j];
                    }
                }
            }
            for (int64_t m = 0; m < M; m++) mterm[m] += mn * xs[m * ng + g]; /* the min's term, once per group */
        }
        for (int64_t m = 0; m < M; m++) {
            float s = mterm[m];
            for (int j = 0; j < 32; j++) s += acc[m][j];
            store_y(y, x_bf16, m * N + n, s);
        }
    }
    free(xs);
    free(owned);
}

void q8_gemm(const int8_t *restrict W, const void *scales, int scale_f16, const void *xin, int x_bf16, void *y,
             int64_t M, int64_t N, int64_t K, int64_t G) {
    float *owned;
    const float *restrict x = x_f32(xin, x_bf16, M * K, &owned);
    const int64_t ng = K / G;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *restrict w = W + n * K;
        float out[QMAX_ROWS];
        if (G % 32 == 0) { /* 32 lanes per input row, the group's scale folded in per block */
            float acc[QMAX_ROWS][32];
            memset(acc, 0, sizeof(float) * 32 * M);
            for (int64_t g = 0; g < ng; g++) {
                const float s = scale_at(scales, scale_f16, n * ng + g);
                for (int64_t b = g * (G / 32); b < (g + 1) * (G / 32); b++) {
                    float q[32];
#pragma omp simd
                    for (int j = 0; j < 32; j++) q[j] = s * (float)w[b * 32 + j];
                    for (int64_t m = 0; m < M; m++) {
                        const float *restrict xb = x + m * K + b * 32;
#pragma omp simd
                        for (int j = 0; j < 32; j++) acc[m][j] += q[j] * xb[j];
                    }
                }
            }
            for (int64_t m = 0; m < M; m++) {
                float s = 0.f;
                for (int j = 0; j < 32; j++) s += acc[m][j];
                out[m] = s;
            }
        } else { /* any group size (e.g. per channel with K not a multiple of 32): one reduction per group */
            for (int64_t m = 0; m < M; m++) {
                float s = 0.f;
                for (int64_t g = 0; g < ng; g++) {
                    float a = 0.f;
                    const float *restrict xg = x + m * K + g * G;
                    const int8_t *restrict wg = w + g * G;
#pragma omp simd reduction(+ : a)
                    for (int64_t k = 0; k < G; k++) a += (float)wg[k] * xg[k];
                    s += scale_at(scales, scale_f16, n * ng + g) * a;
                }
                out[m] = s;
            }
        }
        for (int64_t m = 0; m < M; m++) store_y(y, x_bf16, m * N + n, out[m]);
    }
    free(owned);
}

/* 1 when compiled with OpenMP (rows split across threads), else 0. */
int quant_built_with_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
