/* Decode-time GEMV for CPUs: y[M,N] = x[M,K] @ W[N,K]^T (+ b), M small (1..8).
 *
 * Why this exists: at decode, a linear layer reads every weight once and does 2 FLOPs per weight
 * (intensity ~ M FLOP/byte), so its speed is the memory bandwidth it reaches. PyTorch's CPU GEMV
 * reaches ~35-45 % of read bandwidth at the small shapes of a 135M model; a plain row-parallel loop,
 * vectorised by the compiler, reaches ~85-95 %. Each weight row (K elements) is read once and
 * stays in L1 while it is dotted with the M input rows.
 *
 * Reference: torch.nn.functional.linear (see minillm/kernels/cpu_gemv.py and tests/test_cpu_gemv.py).
 * Build: cc -O3 -march=native -ffast-math -fopenmp -shared -fPIC (done on first use, then cached).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = ((uint32_t)b) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* fp32 weights, fp32 activations. */
void gemv_f32(const float *restrict W, const float *restrict x, const float *restrict bias,
              float *restrict y, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *w = W + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < K; k++) acc += w[k] * xm[k];
            y[m * N + n] = acc + (bias ? bias[n] : 0.f);
        }
    }
}

/* bf16 weights and activations, fp32 accumulation (as torch's CPU bf16 matmul). */
void gemv_bf16(const uint16_t *restrict W, const uint16_t *restrict x, const uint16_t *restrict bias,
               uint16_t *restrict y, int64_t M, int64_t N, int64_t K) {
    float *xf = (float *)malloc(sizeof(float) * M * K); /* M*K <= 8*16k floats: tiny next to W */
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *w = W + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = xf + m * K;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < K; k++) acc += bf16_to_f32(w[k]) * xm[k];
            y[m * N + n] = f32_to_bf16(acc + (bias ? bf16_to_f32(bias[n]) : 0.f));
        }
    }
    free(xf);
}

/* Streaming read of n floats (a bandwidth probe for the roofline): returns their sum. */
double read_sum_f32(const float *restrict a, int64_t n) {
    double total = 0.0;
#pragma omp parallel reduction(+ : total)
    {
        float acc = 0.f;
#pragma omp for simd schedule(static) reduction(+ : acc) nowait
        for (int64_t i = 0; i < n; i++) acc += a[i];
        total += acc;
    }
    return total;
}
