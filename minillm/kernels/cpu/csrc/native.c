/* Decode-time GEMV for CPUs: y[M,N] = x[M,K] @ W[N,K]^T (+ b), M small (1..MAX_ROWS = 32, a decode batch).
 *
 * Why this exists: at decode, a linear layer reads every weight once and does 2 FLOPs per weight and input row
 * (intensity ~ M/2 FLOP/byte in fp32), so its speed is the memory bandwidth it reaches. PyTorch's CPU GEMV
 * reaches well under half of the read bandwidth at the small shapes of a 135M model; a row-parallel loop of vector
 * FMAs comes close to all of it. Each weight row (K elements) is read once and stays in L1 while it is dotted with
 * the M input rows, so 2..8 rows (speculative verification's γ + 1) cost little more than one; and a row's result does
 * not depend on M (see the GEMV section), so speculation's greedy output equals plain decode's.
 *
 * Reference: torch.nn.functional.linear (see minillm/kernels/cpu/native.py and tests/kernels/test_cpu_native.py).
 * Build: cc -O3 -march=native -ffast-math -fopenmp -shared -fPIC (done on first use, then cached).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>
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

/* ---------------------------------------------------------------- GEMV: y[M, N] = x[M, K] @ W[N, K]^T (+ b)
 *
 * Cost: the weights are read once per call whatever M is (N * K * 4 bytes fp32, 2 bytes bf16) and each weight meets
 * the M input rows in registers: 2 * M FLOPs per weight.  The kernel (gv_tile) takes NT weight rows and R input rows
 * (both compile-time constants, so the NT * R accumulators are registers), vectorised along K: per vector of K, NT
 * weight loads and R activation loads feed NT * R FMAs.  R = 1 takes one weight row at a time: one sequential
 * stream, which the hardware prefetcher follows best unaided (one FMA chain per row still outruns memory).  From
 * R = 2, tiles of up to 4 weight rows share each activation load; their 4 interleaved row streams defeat the hardware
 * prefetcher (markedly slower from memory), so the next tile is prefetched into L2 by hand.  More than GV_ROWS
 * rows take several row blocks over the same weight tile (NT * K * 4 bytes, in L1).  On the host this was tuned on
 * (SmolLM2-135M's fp32 layers, 2-core Zen 4, AVX-512), 2..8 rows cost little more than one row (clearly less than
 * the old 4x4-tile kernel); at 8 rows the FMAs (about one vector FMA a cycle a core) begin to take as long as the
 * memory stream.
 *
 * Exactness: every (weight row, input row) pair is summed the same way whatever tile, row block, M or thread it lands
 * in: one vector accumulator of GV_LANES lanes, fed the K / GV_LANES full vectors in order by FMAs, then the
 * zero-padded tail vector, then one fixed horizontal sum, then + bias.  Pairs share loads, never arithmetic.  So row
 * m of a multi-row call equals a 1-row call on row m bit for bit: speculative verification (γ + 1 rows per sequence)
 * then gives exactly plain decode's logits and greedy output is identical with and without speculation.  Different
 * builds (AVX-512, AVX2, portable) have different lane counts and so round differently from each other; within a
 * build the results do not depend on M.
 *
 * SIMD levels (as quant.c's QSIMD): AVX-512 F/BW/VL + FMA (16 lanes, masked tail loads), AVX2 + FMA (8 lanes), else
 * GCC/clang vector extensions (8 lanes) that the compiler maps to SSE, NEON, ... — correct everywhere.  bf16 weights
 * are widened to fp32 and meet fp32 inputs, except on AVX512-BF16 builds, which multiply bf16 pairs (gv_tile_bf16,
 * after gv_tile). */
#include "split.h" /* the OpenMP functions (or one-thread stand-ins) and SPLIT_UNITS */
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GV_INLINE static inline __attribute__((always_inline))
/* The exactness above holds only if the sums keep their written order, which -ffast-math lets the compiler change:
 * clang does, differently in each tile shape's inlined copy (seen on aarch64, -mcpu=apple-m1: rows then depended on
 * M).  So the two operations that define the order say so; everything else keeps fast-math.  GCC has no such pragma
 * and keeps the order here (tests/kernels/test_native_portability.py checks both compilers). */
#ifdef __clang__
#define GV_IN_ORDER _Pragma("clang fp reassociate(off)")
#else
#define GV_IN_ORDER
#endif
#define GV_UNROLL _Pragma("GCC unroll 8") /* the tile loops, so that the accumulators become registers */
#define GV_ROWS 8   /* input rows per block; more rows take more blocks over the same (L1-resident) weight tile */
#define GV_TILE 4   /* most weight rows per tile (NT); thread ranges start at multiples of it */
#define GV_SPLIT (1 << 18) /* weights below which one thread runs the GEMV: a parallel region's start and join
                            * (futex calls, even for one thread) cost as much as the GEMV itself */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__)
#define GV_SIMD 512
#define GV_LANES 16
typedef __m512 gv_t;
/* Keep v in a register: else GCC folds a load into each FMA that uses it (the activation into all NT, seen at R = 4),
 * NT loads where one does, and the loads are what limits the kernel once the weights are in cache. */
#define GV_PIN(v) __asm__("" : "+v"(v))
GV_INLINE gv_t gv_zero(void) { return _mm512_setzero_ps(); }
GV_INLINE gv_t gv_f32(const float *p) { return _mm512_loadu_ps(p); }
GV_INLINE gv_t gv_f32_part(const float *p, int n) { /* n < 16 floats, zeros after; no read past them */
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
GV_INLINE gv_t gv_widen(__m256i b) { /* 16 bf16 -> fp32: the bits move to the high half */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
GV_INLINE gv_t gv_bf16(const uint16_t *p) { return gv_widen(_mm256_loadu_si256((const __m256i *)p)); }
GV_INLINE gv_t gv_bf16_part(const uint16_t *p, int n) {
    return gv_widen(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p));
}
GV_INLINE gv_t gv_fma(gv_t a, gv_t b, gv_t c) { return _mm512_fmadd_ps(a, b, c); }
GV_INLINE float gv_sum(gv_t a) { return _mm512_reduce_add_ps(a); }
/* weight rows per tile at R input rows: NT * R accumulators + NT weights + 1 activation within 32 zmm */
#define GV_NT(R) ((R) == 1 ? 1 : (R) <= 6 ? 4 : 3)
#elif defined(__AVX2__) && defined(__FMA__)
#define GV_SIMD 256
#define GV_LANES 8
typedef __m256 gv_t;
#define GV_PIN(v) __asm__("" : "+x"(v)) /* as above */
GV_INLINE gv_t gv_zero(void) { return _mm256_setzero_ps(); }
GV_INLINE gv_t gv_f32(const float *p) { return _mm256_loadu_ps(p); }
GV_INLINE gv_t gv_f32_part(const float *p, int n) { /* n < 8: lanes >= n masked off, not read */
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
GV_INLINE gv_t gv_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
GV_INLINE gv_t gv_bf16_part(const uint16_t *p, int n) { /* once per row: a zero-padded copy */
    uint16_t b[8] = {0};
    memcpy(b, p, sizeof(uint16_t) * n);
    return gv_bf16(b);
}
GV_INLINE gv_t gv_fma(gv_t a, gv_t b, gv_t c) { return _mm256_fmadd_ps(a, b, c); }
GV_INLINE float gv_sum(gv_t a) {
    GV_IN_ORDER /* clang's _mm_add_ps is a plain vector add */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define GV_NT(R) ((R) == 1 ? 1 : (R) == 2 ? 4 : (R) <= 4 ? 3 : (R) <= 6 ? 2 : 1) /* within 16 ymm */
#else
#define GV_SIMD 0
#define GV_LANES 8
typedef float gv_t __attribute__((vector_size(32))); /* GCC and clang lower it to the target's vectors */
#define GV_PIN(v) (void)0
GV_INLINE gv_t gv_zero(void) { return (gv_t){0.f}; }
GV_INLINE gv_t gv_f32(const float *p) {
    gv_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
GV_INLINE gv_t gv_f32_part(const float *p, int n) {
    gv_t v = gv_zero();
    memcpy(&v, p, sizeof(float) * n);
    return v;
}
GV_INLINE gv_t gv_bf16(const uint16_t *p) {
    gv_t v;
    for (int j = 0; j < GV_LANES; j++) v[j] = bf16_to_f32(p[j]);
    return v;
}
GV_INLINE gv_t gv_bf16_part(const uint16_t *p, int n) {
    gv_t v = gv_zero();
    for (int j = 0; j < n; j++) v[j] = bf16_to_f32(p[j]);
    return v;
}
GV_INLINE gv_t gv_fma(gv_t a, gv_t b, gv_t c) {
    GV_IN_ORDER
    return a * b + c;
}
GV_INLINE float gv_sum(gv_t a) {
    GV_IN_ORDER
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}
#define GV_NT(R) ((R) == 1 ? 1 : (R) == 2 ? 4 : (R) <= 4 ? 3 : 2)
#endif

#define GV_LOAD_f32(p) gv_f32(p)
#define GV_LOAD_bf16(p) gv_bf16(p)
#define GV_PART_f32(p, n) gv_f32_part(p, n)
#define GV_PART_bf16(p, n) gv_bf16_part(p, n)

/* NT weight rows w (row stride K) against R input rows x (fp32, row stride K): out[r * NT + i] = row i . row r. */
#define GV_TILE_FN(T, WT)                                                                                             \
    GV_INLINE void gv_tile_##T(const WT *restrict w, const float *restrict x, float *restrict out, int64_t K,         \
                               const int NT, const int R) {                                                           \
        gv_t acc[GV_TILE][GV_ROWS];                                                                                   \
        GV_UNROLL for (int i = 0; i < NT; i++)                                                                        \
            GV_UNROLL for (int r = 0; r < R; r++) acc[i][r] = gv_zero();                                              \
        const int64_t Kv = K - K % GV_LANES;                                                                          \
        for (int64_t k = 0; k < Kv; k += GV_LANES) {                                                                  \
            gv_t wv[GV_TILE];                                                                                         \
            GV_UNROLL for (int i = 0; i < NT; i++) {                                                                  \
                wv[i] = GV_LOAD_##T(w + i * K + k);                                                                   \
                GV_PIN(wv[i]);                                                                                        \
                if (NT > 1) __builtin_prefetch(w + (NT + i) * K + k, 0, 1); /* next tile's row i, to L2: above */     \
            }                                                                                                         \
            GV_UNROLL for (int r = 0; r < R; r++) {                                                                   \
                gv_t xv = gv_f32(x + r * K + k);                                                                      \
                GV_PIN(xv);                                                                                           \
                GV_UNROLL for (int i = 0; i < NT; i++) acc[i][r] = gv_fma(wv[i], xv, acc[i][r]);                      \
            }                                                                                                         \
        }                                                                                                             \
        if (Kv < K) { /* the tail, zero-padded: the padded lanes add 0 * 0 */                                         \
            const int n_ = (int)(K - Kv);                                                                             \
            gv_t wv[GV_TILE];                                                                                         \
            GV_UNROLL for (int i = 0; i < NT; i++) wv[i] = GV_PART_##T(w + i * K + Kv, n_);                           \
            GV_UNROLL for (int r = 0; r < R; r++) {                                                                   \
                const gv_t xv = gv_f32_part(x + r * K + Kv, n_);                                                      \
                GV_UNROLL for (int i = 0; i < NT; i++) acc[i][r] = gv_fma(wv[i], xv, acc[i][r]);                      \
            }                                                                                                         \
        }                                                                                                             \
        GV_UNROLL for (int r = 0; r < R; r++)                                                                         \
            GV_UNROLL for (int i = 0; i < NT; i++) out[r * NT + i] = gv_sum(acc[i][r]);                               \
    }
GV_TILE_FN(f32, float)
#if GV_SIMD == 512 && defined(__AVX512BF16__)
/* bf16 x bf16 pairs (AVX512-BF16's vdpbf16ps): with x kept in bf16, a weight is used as loaded, no widening, and
 * one instruction takes 32 weights (both halves of each pair multiplied exactly, added in fp32, denormals flushed)
 * where the widening path spends a widening and two FMAs: per weight, half the arithmetic of fp32 and half its
 * bytes.  Same tile, prefetch and exactness rules as gv_tile above, with vectors of 32 bf16 along K; the tail's
 * pairs are zero-padded.  Only this path is compiled where the CPU has the instruction, so a build's rows never
 * mix the two summation orders. */
#define GV_BF16_PAIRS 1
#define GV_BF16_LANES 32
GV_INLINE __m512i gv_bf16_pairs_part(const uint16_t *p, int n) { /* n < 32 bf16, zeros after; no read past them */
    return _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1), p);
}
GV_INLINE gv_t gv_dot_pairs(__m512i w, __m512i x, gv_t acc) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
GV_INLINE void gv_tile_bf16(const uint16_t *restrict w, const uint16_t *restrict x, float *restrict out, int64_t K,
                            const int NT, const int R) {
    gv_t acc[GV_TILE][GV_ROWS];
    GV_UNROLL for (int i = 0; i < NT; i++)
        GV_UNROLL for (int r = 0; r < R; r++) acc[i][r] = gv_zero();
    const int64_t Kv = K - K % GV_BF16_LANES;
    for (int64_t k = 0; k < Kv; k += GV_BF16_LANES) {
        __m512i wv[GV_TILE];
        GV_UNROLL for (int i = 0; i < NT; i++) {
            wv[i] = _mm512_loadu_si512(w + i * K + k);
            GV_PIN(wv[i]);
            if (NT > 1) __builtin_prefetch(w + (NT + i) * K + k, 0, 1);
        }
        GV_UNROLL for (int r = 0; r < R; r++) {
            __m512i xv = _mm512_loadu_si512(x + r * K + k);
            GV_PIN(xv);
            GV_UNROLL for (int i = 0; i < NT; i++) acc[i][r] = gv_dot_pairs(wv[i], xv, acc[i][r]);
        }
    }
    if (Kv < K) {
        const int n_ = (int)(K - Kv);
        __m512i wv[GV_TILE];
        GV_UNROLL for (int i = 0; i < NT; i++) wv[i] = gv_bf16_pairs_part(w + i * K + Kv, n_);
        GV_UNROLL for (int r = 0; r < R; r++) {
            const __m512i xv = gv_bf16_pairs_part(x + r * K + Kv, n_);
            GV_UNROLL for (int i = 0; i < NT; i++) acc[i][r] = gv_dot_pairs(wv[i], xv, acc[i][r]);
        }
    }
    GV_UNROLL for (int r = 0; r < R; r++)
        GV_UNROLL for (int i = 0; i < NT; i++) out[r * NT + i] = gv_sum(acc[i][r]);
}
typedef uint16_t gv_bf16_x_t; /* the bf16 kernel's inputs: bf16 as given */
#else
#define GV_BF16_PAIRS 0
GV_TILE_FN(bf16, uint16_t)
typedef float gv_bf16_x_t; /* the bf16 kernel's inputs: widened to fp32 once per call */
#endif

/* CALL(R) with r as the compile-time constant R (1..GV_ROWS): the kernel's accumulators then become registers
 * (runtime counts would keep them in memory).  Each R is one tile shape, GV_NT(R) x R, and its 1 x R remainder. */
#define GV_FOR_R(r, CALL)                                                                                             \
    switch (r) {                                                                                                      \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break;                   \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break;                  \
    }

GV_INLINE void gv_store_f32(float *y, const float *bias, int64_t i, int64_t n, float v) {
    y[i] = v + (bias ? bias[n] : 0.f);
}
GV_INLINE void gv_store_bf16(uint16_t *y, const uint16_t *bias, int64_t i, int64_t n, float v) {
    y[i] = f32_to_bf16(v + (bias ? bf16_to_f32(bias[n]) : 0.f)); /* one rounding, as torch's bf16 linear */
}

/* gv_block_T: weight rows n0..n1 in tiles of NT (the last ragged ones one at a time) against the R input rows from
 * m0.  gemv_T_range: columns n0..n1 of y [M, N] for all M rows, no OpenMP inside (a caller's parallel region may
 * hand each thread a range).  Up to GV_ROWS rows the tile shape is picked once per call, outside the loop over the
 * weights; more rows loop over row blocks inside each weight tile, so the tile is streamed from memory once. */
#define GV_RANGE_FN(T, WT, XT, YT)                                                                                    \
    GV_INLINE void gv_block_##T(const WT *restrict W, const XT *restrict x, const YT *restrict bias,                  \
                                YT *restrict y, int64_t N, int64_t K, int64_t n0, int64_t n1, int64_t m0,             \
                                const int NT, const int R) {                                                          \
        float out[GV_TILE * GV_ROWS];                                                                                 \
        int64_t n = n0;                                                                                               \
        for (; n + NT <= n1; n += NT) {                                                                               \
            gv_tile_##T(W + n * K, x + m0 * K, out, K, NT, R);                                                        \
            GV_UNROLL for (int r = 0; r < R; r++)                                                                     \
                GV_UNROLL for (int i = 0; i < NT; i++)                                                                \
                    gv_store_##T(y, bias, (m0 + r) * N + n + i, n + i, out[r * NT + i]);                              \
        }                                                                                                             \
        for (; n < n1; n++) {                                                                                         \
            gv_tile_##T(W + n * K, x + m0 * K, out, K, 1, R);                                                         \
            GV_UNROLL for (int r = 0; r < R; r++) gv_store_##T(y, bias, (m0 + r) * N + n, n, out[r]);                 \
        }                                                                                                             \
    }                                                                                                                 \
    void gemv_##T##_range(const WT *restrict W, const XT *restrict x, const YT *restrict bias,                        \
                          YT *restrict y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {                  \
        if (M <= 0) return;                                                                                           \
        if (M <= GV_ROWS) {                                                                                           \
            GV_FOR_R(M, GV_WHOLE_##T)                                                                                 \
            return;                                                                                                   \
        }                                                                                                             \
        for (int64_t n = n0; n < n1; n += GV_NT(GV_ROWS)) {                                                           \
            const int64_t e = n1 - n < GV_NT(GV_ROWS) ? n1 : n + GV_NT(GV_ROWS);                                      \
            for (int64_t m0 = 0; m0 < M; m0 += GV_ROWS) GV_FOR_R(M - m0, GV_ONE_TILE_##T)                             \
        }                                                                                                             \
    }
#define GV_WHOLE_f32(R) gv_block_f32(W, x, bias, y, N, K, n0, n1, 0, GV_NT(R), R)
#define GV_WHOLE_bf16(R) gv_block_bf16(W, x, bias, y, N, K, n0, n1, 0, GV_NT(R), R)
#define GV_ONE_TILE_f32(R) gv_block_f32(W, x, bias, y, N, K, n, e, m0, GV_NT(GV_ROWS), R)
#define GV_ONE_TILE_bf16(R) gv_block_bf16(W, x, bias, y, N, K, n, e, m0, GV_NT(GV_ROWS), R)
/* fp32 weights and activations: y[m, n] for n in [n0, n1), every m < M.  W [N, K], x [M, K], bias [N] or NULL. */
GV_RANGE_FN(f32, float, float, float)
/* bf16 weights, bias and output; x [M, K] in bf16 for the pairs kernel, else already fp32 (converted once by the
 * caller, exactly: bf16 -> fp32 is a shift); fp32 accumulation, one rounding to bf16 at the store (as torch's CPU
 * bf16 matmul). */
GV_RANGE_FN(bf16, uint16_t, gv_bf16_x_t, uint16_t)

/* Run CALL(n0, n1) over [0, N): in this thread below GV_SPLIT weights, else over the OpenMP team in units of
 * GV_TILE rows (split.h SPLIT_UNITS: each thread its own contiguous range first, a late thread's leftovers taken
 * over), so that (at most row counts) no thread gets a ragged tile mid-matrix. */
#define GV_SPLIT_ROWS(N, K, CALL)                                                                                     \
    do {                                                                                                              \
        if ((N) * (K) < GV_SPLIT || omp_get_max_threads() == 1) {                                                     \
            CALL(0, (N));                                                                                             \
        } else {                                                                                                      \
            SPLIT_UNITS((N), GV_TILE, CALL);                                                                          \
        }                                                                                                             \
    } while (0)

/* fp32 weights, fp32 activations: y [M, N] = x [M, K] @ W [N, K]^T (+ bias [N]). */
void gemv_f32(const float *restrict W, const float *restrict x, const float *restrict bias,
              float *restrict y, int64_t M, int64_t N, int64_t K) {
#define GV_F32(a, b) gemv_f32_range(W, x, bias, y, M, N, K, a, b)
    GV_SPLIT_ROWS(N, K, GV_F32);
#undef GV_F32
}

/* bf16 weights and activations, fp32 accumulation (as torch's CPU bf16 matmul). */
void gemv_bf16(const uint16_t *restrict W, const uint16_t *restrict xb, const uint16_t *restrict bias,
               uint16_t *restrict y, int64_t M, int64_t N, int64_t K) {
#if GV_BF16_PAIRS
    const uint16_t *x = xb;
#else
    float *x = (float *)malloc(sizeof(float) * M * K); /* M*K floats: tiny next to W */
    for (int64_t i = 0; i < M * K; i++) x[i] = bf16_to_f32(xb[i]);
#endif
#define GV_BF16(a, b) gemv_bf16_range(W, x, bias, y, M, N, K, a, b)
    GV_SPLIT_ROWS(N, K, GV_BF16);
#undef GV_BF16
#if !GV_BF16_PAIRS
    free(x);
#endif
}

/* Which vector width the GEMV compiled to: 512 (AVX-512), 256 (AVX2), 0 (portable vector extensions). */
int gemv_simd_level(void) { return GV_SIMD; }

/* 1 when the bf16 GEMV multiplies bf16 pairs (AVX512-BF16's vdpbf16ps), 0 when it widens the weights to fp32. */
int gemv_bf16_pairs(void) { return GV_BF16_PAIRS; }

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

/* ---- decode attention (one new query per sequence), shared by the dense and the paged cache.
 *
 * A GQA group's G = H_q / H_kv query heads read the same K/V head, so the work item is (row b, a range [h0, h1) of
 * its query heads), normally one whole group, and one pass over the keys serves the range's heads: chunk by chunk
 * (16 keys, or one paged block), the chunk's scores are computed head by head while its K rows sit in L1, then its V
 * rows are added to the range's accumulators; each K/V byte is read from memory once per step, not once per query
 * head.  The softmax is flash-decoding's online one: each head keeps a running max and sum, rescaled when a chunk
 * raises the max, so no buffer grows with the sequence; the sums differ from the references' (exact max first, then
 * one sum) by fp32 rounding only.
 *
 * Ranges per row (att_ranges): H_kv, one group each, unless the items would leave a thread idle (B · H_kv <
 * 2 · threads: batch 1 of a model with few K/V heads); then the row's heads split evenly over ceil(2 · threads / B)
 * ranges, and a range that starts or ends inside a group reads that group's K/V rows again (from cache when the
 * same thread had them).
 *
 * Determinism: each output (b, h) is computed whole by one thread, in key order, by the same per-head operations
 * whatever the batch, the range it falls in or the thread count, so a row's result does not depend on the batch
 * (speculative verification relies on it), and items may be scheduled dynamically (rows of unequal lengths).
 * The running max starts at -FLT_MAX, not -INFINITY: the build's -ffast-math promises the compiler no infinities
 * (clang 18+ warns -Wnan-infinity-disabled), and every finite score exceeds -FLT_MAX or equals it. */
#define ATT_CHUNK 16 /* keys per chunk of the dense cache (the paged one goes by blocks) */
static inline int64_t att_ranges(int64_t B, int64_t Hq, int64_t Hkv) {
    int64_t threads = omp_get_max_threads(), P = Hkv;
    if (threads > 1 && B * P < 2 * threads) P = (2 * threads + B - 1) / B;
    return P < Hq ? P : Hq;
}
/* Start item it: row b, heads [h0, h1) (range it % P of P); q row b head h at q + b * SQB + h * SQH, scaled;
 * ho[x]: the offset of head h0 + x's K/V head, HO elements per K/V head. */
#define ATT_BEGIN(T, LOAD, SQB, SQH, HO)                                                                       \
    int64_t b = it / P, h0 = it % P * Hq / P, h1 = (it % P + 1) * Hq / P, n_h = h1 - h0;                       \
    float qf[n_h * D], acc[n_h * D], m[n_h], l[n_h], p[n_h * CH]; /* p: one chunk's scores, head-major */      \
    int64_t ho[n_h];                                                                                           \
    for (int64_t x = 0; x < n_h; x++) {                                                                        \
        const T *qh = q + b * (SQB) + (h0 + x) * (SQH);                                                        \
        for (int64_t d = 0; d < D; d++) { qf[x * D + d] = LOAD(qh[d]) * scale; acc[x * D + d] = 0.f; }         \
        m[x] = -FLT_MAX;                                                                                       \
        l[x] = 0.f;                                                                                            \
        ho[x] = (h0 + x) / G * (HO);                                                                           \
    }
/* One chunk: keys j in [J0, J1) at rows KB + j * RS (K) and VB + j * RS (V), J1 - J0 <= CH; head x's K/V head at
 * ho[x] within a row.  PF(j) runs once per key, in the first head's pass (the paged kernel prefetches there). */
#define ATT_CHUNK_STEP(T, LOAD, KB, VB, RS, J0, J1, PF)                                                        \
    for (int64_t x = 0; x < n_h; x++) { /* the chunk's K rows stay in L1 for the range's heads */             \
        const float *qx = qf + x * D;                                                                          \
        for (int64_t j = J0; j < J1; j++) {                                                                    \
            if (x == 0) { PF(j) }                                                                              \
            const T *ks = (KB) + j * (RS) + ho[x];                                                             \
            float dot = 0.f;                                                                                   \
            _Pragma("omp simd reduction(+ : dot)")                                                             \
            for (int64_t d = 0; d < D; d++) dot += qx[d] * LOAD(ks[d]);                                        \
            p[x * CH + j] = dot;                                                                               \
        }                                                                                                      \
    }                                                                                                          \
    for (int64_t x = 0; x < n_h; x++) {                                                                        \
        float *px = p + x * CH, bm = m[x];                                                                     \
        for (int64_t j = J0; j < J1; j++) bm = px[j] > bm ? px[j] : bm;                                        \
        if (bm > m[x]) { /* rescale what was summed under the old max (nothing at first) */                    \
            float corr = m[x] == -FLT_MAX ? 0.f : expf(m[x] - bm);                                             \
            l[x] *= corr;                                                                                      \
            for (int64_t d = 0; d < D; d++) acc[x * D + d] *= corr;                                            \
            m[x] = bm;                                                                                         \
        }                                                                                                      \
        float lx = 0.f;                                                                                        \
        for (int64_t j = J0; j < J1; j++) { px[j] = expf(px[j] - bm); lx += px[j]; }                           \
        l[x] += lx;                                                                                            \
    }                                                                                                          \
    for (int64_t x = 0; x < n_h; x++) {                                                                        \
        float *ax = acc + x * D;                                                                               \
        for (int64_t j = J0; j < J1; j++) {                                                                    \
            const T *vs = (VB) + j * (RS) + ho[x];                                                             \
            float w = p[x * CH + j];                                                                           \
            _Pragma("omp simd")                                                                                \
            for (int64_t d = 0; d < D; d++) ax[d] += w * LOAD(vs[d]);                                          \
        }                                                                                                      \
    }
/* Write the item's outputs, out [B, H_q, D]. */
#define ATT_END(T, STORE)                                                                                      \
    for (int64_t x = 0; x < n_h; x++) {                                                                        \
        T *o = out + (b * Hq + h0 + x) * D;                                                                    \
        for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[x * D + d] / l[x]);                                   \
    }

/* Decode attention over a contiguous KV cache: q [B, H_q, D] (contiguous), k/v [B, H_kv, S_max, D] with strides
 * (sb, sh, D, 1), lens [B] (int64), out [B, H_q, D].  Query head h reads K/V head h / G.  Cost: the KV bytes (read
 * once per step), S * G dots, exps and axpys of D per (b, g).  Reference: minillm.attention.decode_attention.
 * T is float or uint16_t (bf16). */
#define ATT_NO_PREFETCH(j)
#define DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                                 \
    void NAME(const T *restrict q, const T *restrict k, const T *restrict v, const int64_t *restrict lens,     \
              T *restrict out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t sb, int64_t sh,          \
              float scale) {                                                                                   \
        int64_t G = Hq / Hkv, P = att_ranges(B, Hq, Hkv), CH = ATT_CHUNK;                                      \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                                       \
        for (int64_t it = 0; it < B * P; it++) {                                                               \
            ATT_BEGIN(T, LOAD, Hq * D, D, sh)                                                                  \
            const T *kb = k + b * sb, *vb = v + b * sb;                                                        \
            for (int64_t s0 = 0; s0 < lens[b]; s0 += CH) {                                                     \
                int64_t n = lens[b] - s0 < CH ? lens[b] - s0 : CH;                                             \
                ATT_CHUNK_STEP(T, LOAD, kb + s0 * D, vb + s0 * D, D, 0, n, ATT_NO_PREFETCH)                    \
            }                                                                                                  \
            ATT_END(T, STORE)                                                                                  \
        }                                                                                                      \
    }

DECODE_ATTENTION(decode_attention_f32, float, load_f32, store_f32)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Rows of the elementwise kernels (RMSNorm, RoPE, SiLU·mul) are split over OpenMP threads from this many elements
 * (rows × K) up: prefill chunks (hundreds of rows × 576) are split, decode steps (≤ 32 rows, a few thousand
 * elements: below the cost of waking an OpenMP team) stay in the calling thread.  Each row is computed whole by one
 * thread in one order, so a row's result does not depend on the split. */
#define ELT_SPLIT (1 << 16)

/* RMSNorm of M rows of K: y = x / sqrt(mean(x²) + eps) * w, statistics in fp32.  In bf16 the normalised value
 * is rounded to bf16 before the weight multiply, exactly as transformers' LlamaRMSNorm does.
 * Reference: torch.nn.functional.rms_norm / model.RMSNorm.  One pass to sum squares, one to scale. */
static inline void rms_norm_row_f32(const float *restrict xm, const float *restrict w, float *restrict ym, int64_t K,
                                    float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < K; k++) ss += xm[k] * xm[k];
    float r = 1.f / sqrtf(ss / (float)K + eps);
#pragma omp simd
    for (int64_t k = 0; k < K; k++) ym[k] = xm[k] * r * w[k];
}

static inline void rms_norm_row_bf16(const uint16_t *restrict xm, const uint16_t *restrict w, uint16_t *restrict ym,
                                     int64_t K, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < K; k++) { float f = bf16_to_f32(xm[k]); ss += f * f; }
    float r = 1.f / sqrtf(ss / (float)K + eps);
    for (int64_t k = 0; k < K; k++) {
        float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(xm[k]) * r));
        ym[k] = f32_to_bf16(normed * bf16_to_f32(w[k]));
    }
}

void rms_norm_f32(const float *restrict x, const float *restrict w, float *restrict y, int64_t M, int64_t K,
                  float eps) {
#pragma omp parallel for schedule(static) if (M * K >= ELT_SPLIT)
    for (int64_t m = 0; m < M; m++) rms_norm_row_f32(x + m * K, w, y + m * K, K, eps);
}

void rms_norm_bf16(const uint16_t *restrict x, const uint16_t *restrict w, uint16_t *restrict y, int64_t M,
                   int64_t K, float eps) {
#pragma omp parallel for schedule(static) if (M * K >= ELT_SPLIT)
    for (int64_t m = 0; m < M; m++) rms_norm_row_bf16(x + m * K, w, y + m * K, K, eps);
}

/* Decode attention over a paged KV cache: key/value position s of sequence b lives in physical block
 * tables[b, s / bs] at offset s % bs.  k/v [num_blocks, bs, H_kv, D] contiguous; q/out [B, H_q, D];
 * tables [B, W] int32; lens [B] int32; q row b, head h at q + b * sqb + h * sqh (a view into the packed qkv
 * projection needs no copy).  Reference: minillm.kernels.reference.paged_decode_attention_ref.  The _window
 * variant keeps only the last `window` keys and the first `sinks` (window 0: all; reference.paged_window_attention_ref)
 * and skips every block whose table entry is negative (kv.eviction.EVICTED: freed, e.g. by H2O).
 *
 * Cost per (b, K/V head g): the kept keys' K/V bytes, read once per step (the block is the chunk of the shared
 * decode-attention loop above: its K rows, then its V rows), and per kept key G dots, exps and axpys of D. */
/* The kept keys of a query at position S - 1 are two position ranges: the sinks [0, a) and the window [lo, S)
 * (window 0, or S <= window: the second is [0, S) and the first empty).  PAGED_BLOCKS walks both, block by block
 * in table order, running its body with ko (the block's offset in the cache, in elements), its kept offsets
 * [j0, j1) and nko (the next block's offset in the same range, -1 when there is none to read); blocks holding no kept key, and blocks whose entry is negative (kv.eviction.EVICTED), are never read.
 * Walking the table avoids a 64-bit s / bs and s % bs per position. */
#define PAGED_BLOCKS(...) /* the body: variadic, so that its commas do not split it */                          \
    for (int64_t r = 0; r < 2; r++) {                                                                          \
        int64_t s0 = r ? lo : 0, s1 = r ? S : a;                                                               \
        for (int64_t i = s0 / bs; i * bs < s1; i++) {                                                          \
            if (tb[i] < 0) continue;                                                                           \
            int64_t ko = (int64_t)tb[i] * bs * rs;                                                             \
            int64_t nko = (i + 1) * bs < s1 && tb[i + 1] >= 0 ? (int64_t)tb[i + 1] * bs * rs : -1;             \
            int64_t j0 = s0 > i * bs ? s0 - i * bs : 0, j1 = s1 - i * bs < bs ? s1 - i * bs : bs;              \
            __VA_ARGS__                                                                                        \
        }                                                                                                      \
    }
/* Key j of a block: prefetch row j of the next block in the table (when it is kept: nko >= 0) into L2, K and V,
 * the range's columns.  Blocks lie anywhere in the pool, so the hardware prefetchers, which follow a run of
 * addresses, only find a block's lines after its first misses: fetched a block ahead, the lines wait in L2. */
#define PAGED_PREFETCH(j)                                                                                      \
    if (nko >= 0)                                                                                              \
        for (int64_t c = c0; c < c1; c += line) {                                                              \
            __builtin_prefetch(k + nko + (j) * rs + c, 0, 2);                                                  \
            __builtin_prefetch(v + nko + (j) * rs + c, 0, 2);                                                  \
        }
#define PAGED_DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                           \
    void NAME##_window(const T *restrict q, const T *restrict k, const T *restrict v,                          \
                       const int32_t *restrict tables, const int32_t *restrict lens, T *restrict out, int64_t B, \
                       int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t W, float scale, int64_t sqb,    \
                       int64_t sqh, int64_t window, int64_t sinks) {                                           \
        int64_t G = Hq / Hkv, P = att_ranges(B, Hq, Hkv), CH = bs, rs = Hkv * D;                              \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                                       \
        for (int64_t it = 0; it < B * P; it++) {                                                               \
            ATT_BEGIN(T, LOAD, sqb, sqh, D)                                                                    \
            int64_t S = lens[b];                                                                               \
            int64_t lo = window > 0 && S > window ? S - window : 0, a = sinks < lo ? sinks : lo;               \
            const int32_t *tb = tables + b * W;                                                                \
            /* the columns a row of the range reads: [c0, c1) of each token's H_kv * D */                     \
            int64_t c0 = ho[0], c1 = ho[n_h - 1] + D, line = 64 / (int64_t)sizeof(T);                          \
            PAGED_BLOCKS(ATT_CHUNK_STEP(T, LOAD, k + ko, v + ko, rs, j0, j1, PAGED_PREFETCH))                  \
            ATT_END(T, STORE)                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    void NAME(const T *restrict q, const T *restrict k, const T *restrict v, const int32_t *restrict tables,   \
              const int32_t *restrict lens, T *restrict out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,    \
              int64_t bs, int64_t W, float scale, int64_t sqb, int64_t sqh) {                                  \
        NAME##_window(q, k, v, tables, lens, out, B, Hq, Hkv, D, bs, W, scale, sqb, sqh, 0, 0);                \
    }

PAGED_DECODE_ATTENTION(paged_decode_attention_f32, float, load_f32, store_f32)
PAGED_DECODE_ATTENTION(paged_decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* ---- decode-step fusions: one call instead of a handful of ATen ops each (a decode layer is ~130 ops at a few
 * µs of dispatch apiece, which at batch 1 costs as much as reading the weights of a 135M model).  ROUND rounds an
 * intermediate to the storage type (bf16) where the PyTorch reference rounds it, so the two agree bit for bit up
 * to the order of fp32 operations.  Rows are split over threads past ELT_SPLIT elements only (prefill chunks). */
static inline float round_f32(float x) { return x; }
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* RoPE on R rows of H heads: x row r, head h at x + r * sx + h * D (a view into the qkv projection);
 * cos/sin [R, D] contiguous; y [R, H, D] contiguous.  y = x * cos + rotate_half(x) * sin with rotate_half(x) =
 * (-x2, x1), exactly the reference's (layers.rotary.apply_rope) products and sum. */
#define ROPE(NAME, T, LOAD, STORE, ROUND)                                                                  \
    void NAME(const T *restrict x, const T *restrict cs, const T *restrict sn, T *restrict y, int64_t R,   \
              int64_t H, int64_t D, int64_t sx) {                                                          \
        int64_t half = D / 2;                                                                              \
        _Pragma("omp parallel for schedule(static) if (R * H * D >= ELT_SPLIT)")                           \
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
#pragma omp parallel for schedule(static) if (M * K >= ELT_SPLIT)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = m * K; k < (m + 1) * K; k++) r[k] = x[k] + res[k];
        rms_norm_row_f32(r + m * K, w, y + m * K, K, eps);
    }
}

void add_rms_norm_bf16(const uint16_t *restrict x, const uint16_t *restrict res, const uint16_t *restrict w,
                       uint16_t *restrict y, uint16_t *restrict r, int64_t M, int64_t K, float eps) {
#pragma omp parallel for schedule(static) if (M * K >= ELT_SPLIT)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = m * K; k < (m + 1) * K; k++) r[k] = f32_to_bf16(bf16_to_f32(x[k]) + bf16_to_f32(res[k]));
        rms_norm_row_bf16(r + m * K, w, y + m * K, K, eps);
    }
}

/* SwiGLU's activation: y = silu(gate) * up for x = [gate | up] rows of 2F, y [R, F] (silu rounded to T first,
 * as F.silu(gate) * up). */
#define SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                                              \
    void NAME(const T *restrict x, T *restrict y, int64_t R, int64_t F) {                                  \
        _Pragma("omp parallel for schedule(static) if (R * F >= ELT_SPLIT)")                               \
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

/* ---- sampling: one token per row from softmax(logits / T)
 *
 * minillm/sampling/sampler.py's plain-temperature rows (no min-p, top-k or top-p filter) without the PyTorch path's
 * V-sized temporaries per row (the fp32 copy, the -inf mask, the softmax, its float64 cumulative sum: at a 49k-128k
 * vocabulary most of a sampled decode step's sampling time).  Per row: the max m; then blocks of SAMPLE_BLOCK
 * exponentials e_j = exp((x_j - m) / T) (m's own e is 1, so the total is >= 1), each block summed in double; then the
 * block where u * total falls, walking the block sums, and in it the first index where the running sum exceeds
 * u * total — that block's exponentials recomputed by the same (never inlined) function, so the walk meets exactly
 * the values the total summed.  A draw from the same distribution as the reference (which normalises in fp32 before
 * its cumulative sum): the two differ only where u * total lies within rounding of a boundary between two tokens.
 * A row with a non-finite logit (-inf from a grammar mask or a logit bias; the build's -ffast-math assumes none) is
 * left to the reference: its out is -1.  logits [*, V] fp32; for b < B, row index[b] of it with temperature[b]
 * (finite, > 0) and u[b] in [0, 1) -> out[b], a token id.  Rows are split across the threads. */
#define SAMPLE_BLOCK 256

__attribute__((noinline)) static void sample_block_exp(const float *restrict x, int64_t n, float m, float t,
                                                        float *restrict e) {
    for (int64_t j = 0; j < n; j++) e[j] = expf((x[j] - m) / t);
}

static double sample_block_sum(const float *e, int64_t n) {
    double s = 0.0;
    for (int64_t j = 0; j < n; j++) s += e[j];
    return s;
}

void sample_temperature(const float *logits, const int64_t *index, const float *temperature, const double *u,
                        int64_t B, int64_t V, int64_t *out) {
    int64_t nb = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        const float *x = logits + index[b] * V;
        float t = temperature[b], m = -FLT_MAX, e[SAMPLE_BLOCK];
        uint32_t nonfinite = 0;
        for (int64_t j = 0; j < V; j++) { /* a bit test: -ffast-math lets the compiler assume isfinite() */
            uint32_t bits;
            memcpy(&bits, x + j, 4);
            nonfinite |= (bits & 0x7f800000u) == 0x7f800000u;
            m = x[j] > m ? x[j] : m;
        }
        double *sums = nonfinite || V < 1 ? NULL : malloc((size_t)nb * sizeof(double));
        if (sums == NULL) {
            out[b] = -1;
            continue;
        }
        double total = 0.0;
        for (int64_t k = 0; k < nb; k++) {
            int64_t n = k < nb - 1 ? SAMPLE_BLOCK : V - k * SAMPLE_BLOCK;
            sample_block_exp(x + k * SAMPLE_BLOCK, n, m, t, e);
            sums[k] = sample_block_sum(e, n);
            total += sums[k];
        }
        double target = u[b] * total, acc = 0.0;
        int64_t k = 0;
        while (k < nb - 1 && acc + sums[k] <= target) acc += sums[k++];
        while (k > 0 && sums[k] == 0.0) acc -= sums[--k]; /* u * total rounded past the end: the last block with weight */
        int64_t n = k < nb - 1 ? SAMPLE_BLOCK : V - k * SAMPLE_BLOCK, pick = -1;
        sample_block_exp(x + k * SAMPLE_BLOCK, n, m, t, e);
        for (int64_t j = 0; j < n; j++) {
            acc += e[j];
            if (acc > target) {
                pick = j;
                break;
            }
        }
        if (pick < 0) /* the block's sum passed the target and its running sum rounded short: its last weighted index */
            for (pick = n - 1; pick > 0 && e[pick] == 0.f; pick--) {}
        out[b] = k * SAMPLE_BLOCK + pick;
        free(sums);
    }
}
