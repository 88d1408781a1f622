/* Decode-time GEMV for CPUs: y[M,N] = x[M,K] @ W[N,K]^T (+ b), M small (1..MAX_ROWS = 32, a decode batch).
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
#include <math.h>

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = ((uint32_t)b) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Batch 1: one FMA per weight, each weight row read once (bandwidth bound).
 * Batch 2..MAX_ROWS: a register tile of 4 weight rows x 4 input rows, vectorised along K: per step of K, 4 weight
 * loads and 4 input loads feed 16 FMAs into 16 accumulators.  A 4-row tile of W (4 K-rows, ~9 KB at K = 576)
 * stays in L1 while every 4-row block of x passes over it, so W is streamed from memory once for the whole batch.
 * (One weight row against 4 input rows — 5 loads per 4 FMAs — was load bound from ~4 rows.)  Tile rows beyond
 * M or N alias row 0 and are dropped.  STORE_Y(i, n, v) writes output element i = m * N + n. */
#define GEMV_ROWS(T, LOAD, XT, STORE_Y)                                                                  \
    if (M == 1) {                                                                                        \
        _Pragma("omp parallel for schedule(static)")                                                    \
        for (int64_t n = 0; n < N; n++) {                                                                \
            const T *w = W + n * K;                                                                      \
            float a = 0.f;                                                                               \
            _Pragma("omp simd reduction(+ : a)")                                                        \
            for (int64_t k = 0; k < K; k++) a += LOAD(w[k]) * x[k];                                      \
            STORE_Y(n, n, a);                                                                            \
        }                                                                                                \
    } else {                                                                                             \
        _Pragma("omp parallel for schedule(static)")                                                    \
        for (int64_t n0 = 0; n0 < N; n0 += 4) {                                                          \
            const T *w0 = W + n0 * K, *w1 = n0 + 1 < N ? w0 + K : w0;                                    \
            const T *w2 = n0 + 2 < N ? w0 + 2 * K : w0, *w3 = n0 + 3 < N ? w0 + 3 * K : w0;              \
            for (int64_t m0 = 0; m0 < M; m0 += 4) {                                                      \
                const XT *x0 = x + m0 * K, *x1 = m0 + 1 < M ? x0 + K : x0;                               \
                const XT *x2 = m0 + 2 < M ? x0 + 2 * K : x0, *x3 = m0 + 3 < M ? x0 + 3 * K : x0;         \
                float a00 = 0.f, a01 = 0.f, a02 = 0.f, a03 = 0.f, a10 = 0.f, a11 = 0.f, a12 = 0.f;       \
                float a13 = 0.f, a20 = 0.f, a21 = 0.f, a22 = 0.f, a23 = 0.f, a30 = 0.f, a31 = 0.f;       \
                float a32 = 0.f, a33 = 0.f;                                                              \
                _Pragma("omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33)") \
                for (int64_t k = 0; k < K; k++) {                                                        \
                    float c0 = x0[k], c1 = x1[k], c2 = x2[k], c3 = x3[k];                                \
                    float u0 = LOAD(w0[k]), u1 = LOAD(w1[k]), u2 = LOAD(w2[k]), u3 = LOAD(w3[k]);        \
                    a00 += u0 * c0; a01 += u0 * c1; a02 += u0 * c2; a03 += u0 * c3;                      \
                    a10 += u1 * c0; a11 += u1 * c1; a12 += u1 * c2; a13 += u1 * c3;                      \
                    a20 += u2 * c0; a21 += u2 * c1; a22 += u2 * c2; a23 += u2 * c3;                      \
                    a30 += u3 * c0; a31 += u3 * c1; a32 += u3 * c2; a33 += u3 * c3;                      \
                }                                                                                        \
                float acc[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13},                           \
                                   {a20, a21, a22, a23}, {a30, a31, a32, a33}};                          \
                for (int64_t i = 0; i < 4 && n0 + i < N; i++)                                            \
                    for (int64_t j = 0; j < 4 && m0 + j < M; j++)                                        \
                        STORE_Y((m0 + j) * N + n0 + i, n0 + i, acc[i][j]);                               \
            }                                                                                            \
        }                                                                                                \
    }

/* fp32 weights, fp32 activations. */
void gemv_f32(const float *restrict W, const float *restrict x, const float *restrict bias,
              float *restrict y, int64_t M, int64_t N, int64_t K) {
#define STORE_F32(i, n, v) y[i] = (v) + (bias ? bias[n] : 0.f)
    GEMV_ROWS(float, load_f32, float, STORE_F32)
#undef STORE_F32
}

/* bf16 weights and activations, fp32 accumulation (as torch's CPU bf16 matmul). */
void gemv_bf16(const uint16_t *restrict W, const uint16_t *restrict xb, const uint16_t *restrict bias,
               uint16_t *restrict y, int64_t M, int64_t N, int64_t K) {
    float *x = (float *)malloc(sizeof(float) * M * K); /* M*K floats: tiny next to W */
    for (int64_t i = 0; i < M * K; i++) x[i] = bf16_to_f32(xb[i]);
#define STORE_BF16(i, n, v) y[i] = f32_to_bf16((v) + (bias ? bf16_to_f32(bias[n]) : 0.f))
    GEMV_ROWS(uint16_t, bf16_to_f32, float, STORE_BF16)
#undef STORE_BF16
    free(x);
}

/* Streaming read of n floats (a bandwidth probe for the roofline): returns their sum.  Chunks of 4096 floats are
 * summed in fp32 (vectorised) and the chunk sums in fp64, the chunks split across the threads. */
double read_sum_f32(const float *restrict a, int64_t n) {
    double total = 0.0;
    int64_t chunks = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t lo = c * 4096, hi = lo + 4096 < n ? lo + 4096 : n;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = lo; i < hi; i++) acc += a[i];
        total += acc;
    }
    return total;
}

/* 1 when this library was compiled with OpenMP (its loops split across threads), else 0 (one thread). */
int built_with_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Decode attention over a contiguous KV cache: one new query per sequence.
 * q [B, H_q, D] (contiguous), k/v [B, H_kv, S_max, D] with strides (sb, sh, D, 1), lens [B] (int64),
 * out [B, H_q, D].  Query head h reads K/V head h / G.  Reads each cached K and V row once per query
 * head (the G heads of a group hit L1/L2 for the second and later reads); the cost is the KV bytes.
 * Reference: minillm.attention.decode_attention.  T is float or uint16_t (bf16). */
#define DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                           \
    void NAME(const T *restrict q, const T *restrict k, const T *restrict v, const int64_t *restrict lens, \
              T *restrict out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t sb, int64_t sh,      \
              float scale) {                                                                               \
        int64_t G = Hq / Hkv;                                                                              \
        _Pragma("omp parallel for collapse(2) schedule(static)")                                          \
        for (int64_t b = 0; b < B; b++)                                                                    \
            for (int64_t h = 0; h < Hq; h++) {                                                             \
                int64_t S = lens[b];                                                                       \
                const T *qh = q + (b * Hq + h) * D;                                                        \
                const T *kh = k + b * sb + (h / G) * sh;                                                   \
                const T *vh = v + b * sb + (h / G) * sh;                                                   \
                float qf[D], acc[D], *p = (float *)malloc(sizeof(float) * (S > 0 ? S : 1));               \
                for (int64_t d = 0; d < D; d++) { qf[d] = LOAD(qh[d]) * scale; acc[d] = 0.f; }            \
                float m = -INFINITY;                                                                       \
                for (int64_t s = 0; s < S; s++) {                                                          \
                    const T *ks = kh + s * D;                                                              \
                    float dot = 0.f;                                                                       \
                    _Pragma("omp simd reduction(+ : dot)")                                                \
                    for (int64_t d = 0; d < D; d++) dot += qf[d] * LOAD(ks[d]);                            \
                    p[s] = dot;                                                                            \
                    if (dot > m) m = dot;                                                                  \
                }                                                                                          \
                float l = 0.f;                                                                             \
                for (int64_t s = 0; s < S; s++) { p[s] = expf(p[s] - m); l += p[s]; }                      \
                for (int64_t s = 0; s < S; s++) {                                                          \
                    const T *vs = vh + s * D;                                                              \
                    float w = p[s];                                                                        \
                    _Pragma("omp simd")                                                                    \
                    for (int64_t d = 0; d < D; d++) acc[d] += w * LOAD(vs[d]);                             \
                }                                                                                          \
                T *o = out + (b * Hq + h) * D;                                                             \
                for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[d] / l);                                  \
                free(p);                                                                                   \
            }                                                                                              \
    }

DECODE_ATTENTION(decode_attention_f32, float, load_f32, store_f32)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* RMSNorm of M rows of K: y = x / sqrt(mean(x²) + eps) * w, statistics in fp32.  In bf16 the normalised value
 * is rounded to bf16 before the weight multiply, exactly as transformers' LlamaRMSNorm does.
 * Reference: torch.nn.functional.rms_norm / model.RMSNorm.  One pass to sum squares, one to scale. */
void rms_norm_f32(const float *restrict x, const float *restrict w, float *restrict y, int64_t M, int64_t K,
                  float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t k = 0; k < K; k++) ss += xm[k] * xm[k];
        float r = 1.f / sqrtf(ss / (float)K + eps);
#pragma omp simd
        for (int64_t k = 0; k < K; k++) y[m * K + k] = xm[k] * r * w[k];
    }
}

void rms_norm_bf16(const uint16_t *restrict x, const uint16_t *restrict w, uint16_t *restrict y, int64_t M,
                   int64_t K, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = x + m * K;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t k = 0; k < K; k++) { float f = bf16_to_f32(xm[k]); ss += f * f; }
        float r = 1.f / sqrtf(ss / (float)K + eps);
        for (int64_t k = 0; k < K; k++) {
            float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(xm[k]) * r));
            y[m * K + k] = f32_to_bf16(normed * bf16_to_f32(w[k]));
        }
    }
}

/* Decode attention over a paged KV cache: key/value position s of sequence b lives in physical block
 * tables[b, s / bs] at offset s % bs.  k/v [num_blocks, bs, H_kv, D] contiguous; q/out [B, H_q, D];
 * tables [B, W] int32; lens [B] int32; q row b, head h at q + b * sqb + h * sqh (a view into the packed qkv
 * projection needs no copy).  Reference: minillm.kernels.reference.paged_decode_attention_ref. */
#define PAGED_DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                      \
    void NAME(const T *restrict q, const T *restrict k, const T *restrict v, const int32_t *restrict tables, \
              const int32_t *restrict lens, T *restrict out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,  \
              int64_t bs, int64_t W, float scale, int64_t sqb, int64_t sqh) {                              \
        int64_t G = Hq / Hkv;                                                                              \
        _Pragma("omp parallel for collapse(2) schedule(static)")                                          \
        for (int64_t b = 0; b < B; b++)                                                                    \
            for (int64_t h = 0; h < Hq; h++) {                                                             \
                int64_t S = lens[b];                                                                       \
                const T *qh = q + b * sqb + h * sqh;                                                       \
                const int32_t *tb = tables + b * W;                                                        \
                float qf[D], acc[D], *p = (float *)malloc(sizeof(float) * (S > 0 ? S : 1));               \
                for (int64_t d = 0; d < D; d++) { qf[d] = LOAD(qh[d]) * scale; acc[d] = 0.f; }            \
                float m = -INFINITY;                                                                       \
                for (int64_t s = 0; s < S; s++) {                                                          \
                    const T *ks = k + (((int64_t)tb[s / bs] * bs + s % bs) * Hkv + h / G) * D;             \
                    float dot = 0.f;                                                                       \
                    _Pragma("omp simd reduction(+ : dot)")                                                \
                    for (int64_t d = 0; d < D; d++) dot += qf[d] * LOAD(ks[d]);                            \
                    p[s] = dot;                                                                            \
                    if (dot > m) m = dot;                                                                  \
                }                                                                                          \
                float l = 0.f;                                                                             \
                for (int64_t s = 0; s < S; s++) { p[s] = expf(p[s] - m); l += p[s]; }                      \
                for (int64_t s = 0; s < S; s++) {                                                          \
                    const T *vs = v + (((int64_t)tb[s / bs] * bs + s % bs) * Hkv + h / G) * D;             \
                    float w = p[s];                                                                        \
                    _Pragma("omp simd")                                                                    \
                    for (int64_t d = 0; d < D; d++) acc[d] += w * LOAD(vs[d]);                             \
                }                                                                                          \
                T *o = out + (b * Hq + h) * D;                                                             \
                for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[d] / l);                                  \
                free(p);                                                                                   \
            }                                                                                              \
    }

PAGED_DECODE_ATTENTION(paged_decode_attention_f32, float, load_f32, store_f32)
PAGED_DECODE_ATTENTION(paged_decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* ---- decode-step fusions: one call instead of a handful of ATen ops each (a decode layer is ~130 ops at a few
 * µs of dispatch apiece, which at batch 1 costs as much as reading the weights of a 135M model).  ROUND rounds an
 * intermediate to the storage type (bf16) where the PyTorch reference rounds it, so the two agree bit for bit up
 * to the order of fp32 operations.  All loops are single-threaded: rows × K elements of a decode step are a few
 * thousand, far below the cost of waking an OpenMP team. */
static inline float round_f32(float x) { return x; }
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* RoPE on R rows of H heads: x row r, head h at x + r * sx + h * D (a view into the qkv projection);
 * cos/sin [R, D] contiguous; y [R, H, D] contiguous.  y = x * cos + rotate_half(x) * sin with rotate_half(x) =
 * (-x2, x1), exactly the reference's (layers.rotary.apply_rope) products and sum. */
#define ROPE(NAME, T, LOAD, STORE, ROUND)                                                                  \
    void NAME(const T *restrict x, const T *restrict cs, const T *restrict sn, T *restrict y, int64_t R,   \
              int64_t H, int64_t D, int64_t sx) {                                                          \
        int64_t half = D / 2;                                                                              \
        for (int64_t r = 0; r < R; r++)                                                                    \
            for (int64_t h = 0; h < H; h++) {                                                              \
                const T *xi = x + r * sx + h * D, *c = cs + r * D, *s = sn + r * D;                        \
                T *yo = y + (r * H + h) * D;                                                               \
                for (int64_t d = 0; d < half; d++) {                                                       \
                    float x1 = LOAD(xi[d]), x2 = LOAD(xi[d + half]);                                       \
                    yo[d] = STORE(ROUND(x1 * LOAD(c[d])) + ROUND(-x2 * LOAD(s[d])));                       \
                    yo[d + half] = STORE(ROUND(x2 * LOAD(c[d + half])) + ROUND(x1 * LOAD(s[d + half])));   \
                }                                                                                          \
            }                                                                                              \
    }

ROPE(rope_f32, float, load_f32, store_f32, round_f32)
ROPE(rope_bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)

/* Residual add + RMSNorm: r = x + res (rounded to T, as the reference's add), y = rms_norm(r) * w.
 * x, res, r, y [M, K] contiguous. */
void add_rms_norm_f32(const float *restrict x, const float *restrict res, const float *restrict w, float *restrict y,
                      float *restrict r, int64_t M, int64_t K, float eps) {
    for (int64_t i = 0; i < M * K; i++) r[i] = x[i] + res[i];
    rms_norm_f32(r, w, y, M, K, eps);
}

void add_rms_norm_bf16(const uint16_t *restrict x, const uint16_t *restrict res, const uint16_t *restrict w,
                       uint16_t *restrict y, uint16_t *restrict r, int64_t M, int64_t K, float eps) {
    for (int64_t i = 0; i < M * K; i++) r[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(res[i]));
    rms_norm_bf16(r, w, y, M, K, eps);
}

/* SwiGLU's activation: y = silu(gate) * up for x = [gate | up] rows of 2F, y [R, F] (silu rounded to T first,
 * as F.silu(gate) * up). */
#define SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                                              \
    void NAME(const T *restrict x, T *restrict y, int64_t R, int64_t F) {                                  \
        for (int64_t r = 0; r < R; r++) {                                                                  \
            const T *g = x + r * 2 * F, *u = g + F;                                                        \
            for (int64_t f = 0; f < F; f++) {                                                              \
                float a = LOAD(g[f]);                                                                      \
                y[r * F + f] = STORE(ROUND(a / (1.f + expf(-a))) * LOAD(u[f]));                            \
            }                                                                                              \
        }                                                                                                  \
    }

SILU_MUL(silu_mul_f32, float, load_f32, store_f32, round_f32)
SILU_MUL(silu_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)

/* Store T new K and V rows of [H_kv, D] into their paged-cache slots: row t goes to slot slots[t] of caches
 * [num_slots, H_kv, D] contiguous; new row t of k at k + t * sk, of v at v + t * sv (head stride D).  Element size
 * es bytes: a copy, so one function serves every dtype. */
void write_kv(const char *restrict k, const char *restrict v, char *restrict kc, char *restrict vc,
              const int64_t *restrict slots, int64_t T, int64_t HD, int64_t sk, int64_t sv, int64_t es) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(kc + slots[t] * HD * es, k + t * sk * es, HD * es);
        memcpy(vc + slots[t] * HD * es, v + t * sv * es, HD * es);
    }
}
