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
 * and weight j+16 (high nibble); d and m per group of G weights (G a multiple of 32), w = d*q + m.  Q4_0 (mins =
 * NULL): the same blocks without m, w = d*(q - 8): every path takes m = -8*d (q4_min) where it reads m otherwise.
 * int8: w = s * q, s per group of G weights along K (G = K: per output channel; G = 32: GGUF Q8_0).
 * Q6_K (q6k_gemm_q8, int8-activation path only): GGUF's 210-byte super-blocks of 256 weights as the file stores
 * them, w = d * sc * q per 16 weights (its own section, before W8A8, says how the 6-bit codes are read).
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
 * Batch 1 (the decode case) takes 4 weight rows at a time against the one input row (q4_q8_row4, q8_q8_row4), the
 * activation loads shared, the tile PF_TILES ahead prefetched; a row's result is the same bits whichever kernel and
 * tile computes it and however many rows share the call (tests/kernels/test_linear_stack.py and test_native_
 * portability.py check it; vf_pin and TILE_Q8 below say why it needs care under -ffast-math).
 * Scales/mins come in three formats (scale_fmt, SF_* below): fp32, fp16, or K records (GGUF Q4_K's two levels, int4
 * with G = 32 only); activations fp32 or bf16 (x_bf16 = 1; then y is bf16 too).
 * Past one tile of rows: q8_q8_rows takes the weight rows in L2-sized blocks, every tile of input rows over a block
 * (a row's 1-row bits); the prefill GEMM for Q8_0 / Q4_x blocks (q8_gemm_prefill, q4_gemm_prefill, at the end)
 * tiles the same arithmetic over 32-column weight panels, 4 x 32 outputs in registers, and so does q6k_gemm_q8 past
 * 8 rows on AVX-512 VNNI builds (its L2-blocked rows elsewhere).
 * W8A8 (w8a8_gemm, at the end): int8 weights per channel times int8 activations rounded per token, exact int32 sums.
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

#include "split.h" /* the OpenMP functions (or one-thread stand-ins) and SPLIT_UNITS */

#define QTILE 8  /* input rows per register tile; more rows take more tiles over the same (L1-resident) weight row */
#define QB 32    /* weights per block: Q4_1 / Q8_0 / Q8_1 */
/* Many input rows (prefill): blocks of weight rows of about this many bytes stay in L2 while every tile of input
 * rows passes over them, so each weight byte comes from memory once per call (q8_q8_rows, a8_rows). */
#define L2_BLOCK (192 * 1024)
/* Batch-1 4-row tiles prefetch the tile PF_TILES ahead (its weights, scales and mins) with locality hint PF_LOC
 * (1: prefetcht2 on x86, a fill of the outer caches rather than L1).  Chosen on the SmolLM2 stack streamed from
 * memory (2-core AMD EPYC, C harness, interleaved rounds): 4 tiles into L2 beat the first version of this tiling
 * (2 tiles into L1) clearly for int4 and int8 alike; 3, 6 and 8 tiles fell in between. */
#ifndef PF_TILES
#define PF_TILES 4
#endif
#ifndef PF_LOC
#define PF_LOC 1
#endif
#define INLINE static inline __attribute__((always_inline))
/* The functions between PRECISE_MATH_BEGIN and PRECISE_MATH_END are compiled without -ffast-math's licence to
 * approximate or reassociate (the activation rounding, whose quotients near k + 1/2 must round as the reference). */
#if defined(__clang__)
#define PRECISE_MATH_BEGIN _Pragma("float_control(precise, on, push)")
#define PRECISE_MATH_END _Pragma("float_control(pop)")
#elif defined(__GNUC__)
#define PRECISE_MATH_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"no-unsafe-math-optimizations\")")
#define PRECISE_MATH_END _Pragma("GCC pop_options")
#else
#define PRECISE_MATH_BEGIN
#define PRECISE_MATH_END
#endif

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

/* Scale formats, the kernels' scale_fmt argument (minillm/kernels/cpu/quant.py's scale_format maps a weight to it):
 * fp32 or fp16 per group, or K records — per row and 256 weights (8 groups of 32) a 10-byte record, an fp16
 * super-value then 8 uint8 sub-values, group i's value = super * sub in fp32 (exact: an 11-bit mantissa times a
 * 6-bit integer; minillm/quant/weight.py's expand_k_records is the Python twin).  Group i is in record i >> 3 because
 * a row's K / 32 groups are a multiple of 8: records never straddle rows. */
#define SF_F32 0
#define SF_F16 1
#define SF_KREC 2
#define KREC_BYTES 10
/* The product is pinned (here and in the vector loads): -ffast-math could otherwise reassociate super * sub * dx into
 * super * (sub * dx), whose rounding differs from the fp32 form's d * dx. */
static inline float krec_at(const void *s, int64_t i) {
    const uint8_t *r = (const uint8_t *)s + (i >> 3) * KREC_BYTES;
    uint16_t h;
    memcpy(&h, r, 2);
    float v = h2f(h) * (float)r[2 + (i & 7)];
    __asm__("" : "+m"(v));
    return v;
}

/* Byte offset of group i's scale in a scale array (for prefetches). */
static inline int64_t scale_byte(int fmt, int64_t i) {
    return fmt == SF_KREC ? (i >> 3) * KREC_BYTES : fmt == SF_F16 ? 2 * i : 4 * i;
}

static inline float scale_at(const void *s, int fmt, int64_t i) {
    return fmt == SF_KREC ? krec_at(s, i) : fmt == SF_F16 ? h2f(((const uint16_t *)s)[i]) : ((const float *)s)[i];
}

/* A Q4_0 block's min from its scale d: m = -8*d in fp32.  Exact (a power-of-two multiple, finite for any fp16 d), so
 * each kernel computes with the value a stored m = -8*d would have given it, and its result is the same bits.  The
 * one place that says "a NULL mins pointer is Q4_0" (minillm/quant/weight.py's symmetric_mins is its Python twin). */
#define Q4_0_MIN(d) (-8.f * (d))

/* m of group i: stored (Q4_1, mins != NULL) or Q4_0_MIN of its scale (mins == NULL). */
static inline float q4_min(const void *mins, const void *scales, int fmt, int64_t i) {
    return mins ? scale_at(mins, fmt, i) : Q4_0_MIN(scale_at(scales, fmt, i));
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

/* Run CALL(n0, n1) over the N weight rows: in this thread below 2^18 weights, where a parallel region's start and
 * join cost as much as the GEMV itself; else over the OpenMP team in units of 4 rows (the batch-1 tile), each thread
 * its own contiguous range first (split.h SPLIT_UNITS: a thread descheduled by another process has its leftover rows
 * taken by its partner instead of keeping it waiting).  On the 2-core AMD EPYC this was tuned on (libgomp), an empty
 * region or a barrier is cheap next to a GEMV while the idle thread spins (libgomp's default between regions),
 * several times more with OMP_WAIT_POLICY=passive (the idle thread sleeps).  So the ~121 regions of a SmolLM2 decode
 * step are a small fraction of an int4 stack at 2 threads — not what keeps it from the read bandwidth. */
#define SPLIT_ROWS(N, K, CALL)                                                                               \
    do {                                                                                                     \
        if ((N) * (K) < (1 << 18) || omp_get_max_threads() == 1) {                                           \
            CALL(0, (N));                                                                                    \
        } else {                                                                                             \
            SPLIT_UNITS((N), 4, CALL);                                                                       \
        }                                                                                                    \
    } while (0)

/* ---------------------------------------------------------------- exact paths (fp32 activations) */

/* One weight row n against R input rows: 32 dequantized weights per block, shared by the R rows. */
INLINE void q4_exact_row(const uint8_t *restrict p, const void *sc, const void *mi, int fmt, int64_t row,
                         const float *restrict x, float *restrict out, int64_t K, int64_t G, const int R) {
    float acc[QTILE][QB] = {{0.f}};
    const int64_t ng = K / G;
    for (int64_t g = 0; g < ng; g++) { /* no integer division in the loop: tens of cycles each, per block */
        const float d = scale_at(sc, fmt, row * ng + g), mn = q4_min(mi, sc, fmt, row * ng + g);
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
INLINE void q8_exact_row(const int8_t *restrict w, const void *sc, int fmt, int64_t row, const float *restrict x,
                         float *restrict out, int64_t K, int64_t G, const int R) {
    const int64_t ng = K / G;
    if (G % QB == 0) { /* 32 lanes per input row, the group's scale folded into the block's 32 floats */
        float acc[QTILE][QB] = {{0.f}};
        for (int64_t g = 0; g < ng; g++) {
            const float s = scale_at(sc, fmt, row * ng + g);
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
            s += scale_at(sc, fmt, row * ng + g) * a;
        }
        out[m] = s;
    }
}

/* Rows n0..n1 of y for one thread (no OpenMP inside: the caller splits the rows), x already fp32. */
static void q4_exact_rows(const uint8_t *restrict P, const void *scales, const void *mins, int scale_fmt,
                          const float *restrict x, int x_bf16, void *y, int64_t M, int64_t N, int64_t K, int64_t G,
                          int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < M; m0 += QTILE) {
            float out[QTILE];
            const int64_t mr = M - m0 < QTILE ? M - m0 : QTILE;
#define Q4_EXACT(R) q4_exact_row(P + n * (K / 2), scales, mins, scale_fmt, n, x + m0 * K, out, K, G, R)
            FOR_TILE(mr, Q4_EXACT)
#undef Q4_EXACT
            for (int64_t m = 0; m < mr; m++) store_y(y, x_bf16, (m0 + m) * N + n, out[m]);
        }
}

static void q8_exact_rows(const int8_t *restrict W, const void *scales, int scale_fmt, const float *restrict x,
                          int x_bf16, void *y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < M; m0 += QTILE) {
            float out[QTILE];
            const int64_t mr = M - m0 < QTILE ? M - m0 : QTILE;
#define Q8_EXACT(R) q8_exact_row(W + n * K, scales, scale_fmt, n, x + m0 * K, out, K, G, R)
            FOR_TILE(mr, Q8_EXACT)
#undef Q8_EXACT
            for (int64_t m = 0; m < mr; m++) store_y(y, x_bf16, (m0 + m) * N + n, out[m]);
        }
}

void q4_gemm(const uint8_t *restrict P, const void *scales, const void *mins, int scale_fmt, const void *xin,
             int x_bf16, void *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    float *owned;
    const float *restrict x = x_f32(xin, x_bf16, M * K, &owned);
#define Q4_EXACT_ROWS(n0, n1) q4_exact_rows(P, scales, mins, scale_fmt, x, x_bf16, y, M, N, K, G, n0, n1)
    SPLIT_ROWS(N, K, Q4_EXACT_ROWS);
#undef Q4_EXACT_ROWS
    free(owned);
}

void q8_gemm(const int8_t *restrict W, const void *scales, int scale_fmt, const void *xin, int x_bf16, void *y,
             int64_t M, int64_t N, int64_t K, int64_t G) {
    float *owned;
    const float *restrict x = x_f32(xin, x_bf16, M * K, &owned);
#define Q8_EXACT_ROWS(n0, n1) q8_exact_rows(W, scales, scale_fmt, x, x_bf16, y, M, N, K, G, n0, n1)
    SPLIT_ROWS(N, K, Q8_EXACT_ROWS);
#undef Q8_EXACT_ROWS
    free(owned);
}

/* ---------------------------------------------------------------- int8-activation paths */

/* The weights are read in chunks of 64 bytes: 4 Q4_1 blocks (128 weights) or 2 int8 blocks (64 weights), one
 * 512-bit register, or two 256-bit ones.  Each chunk's integer dot products land in 16 int32 lanes (4 lanes per Q4_1
 * block: its low and high nibbles meet the activations in the same lanes; 8 lanes per int8 block), which are turned
 * into floats and scaled lane-wise (d_block * dx_block), so a row costs one horizontal sum at its end instead of one
 * per block.  The activations are laid out once per call to match (xprep_t), so the weight bytes need no shuffles:
 * per Q4_1 chunk 64 bytes of the 4 blocks' first 16 activations (the low nibbles' partners), then 64 of their last 16.
 * A row's last chunk, when K/32 is not a multiple of 4 (2), is copied into a zero-padded buffer; the activations'
 * padding is zero too, so padded lanes add nothing. */
#define CHUNK 64 /* weight bytes per chunk */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__) && defined(__F16C__)
#define QSIMD 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QSIMD 256
#else
#define QSIMD 0
#endif
/* The int8-activation row kernels take their tile's row count R as a compile-time constant (FOR_TILE) where SIMD
 * registers hold the accumulators.  The portable C keeps them in memory at any R, so there one copy with a runtime R:
 * 8x less code (and a compile of quant.c at -O3 several times shorter), and every row summed by
 * the same instructions — separately optimised copies reassociated the lane sums differently under -ffast-math, so
 * a row's result depended on how many rows shared the call. */
#if QSIMD
#define TILE_Q8(mr, BODY) FOR_TILE(mr, BODY)
#else
#define TILE_Q8(mr, BODY) { BODY((int)(mr)); }
#endif

#if QSIMD == 512
typedef __m512i vb; /* 64 bytes */
typedef __m512i vi; /* 16 int32 lanes */
typedef __m512 vf;  /* 16 fp32 lanes */
#if defined(__AVX512VNNI__)
#define Q8_BIAS 1 /* int8 weights enter vpdpbusd as w + 128 (unsigned); xprep_t.xc holds the -128 * sum(x) lanes */
typedef __m512i q8w_t;
#else
typedef struct { __m512i u; __mmask64 neg; } q8w_t; /* |w| (the unsigned operand) and where w < 0 */
#endif
typedef __m128 f4;  /* 4 scales, one per Q4_1 block of a chunk */
INLINE vb vb_load(const void *p) { return _mm512_loadu_si512(p); }
INLINE vb vb_load_part(const void *p, int n) { return _mm512_maskz_loadu_epi8((1ULL << n) - 1, p); } /* n < 64 */
INLINE f4 f4_load(const void *s, int fmt, int64_t off, int n) { /* n (1..4) scales from off, zeros after */
    if (fmt == SF_KREC) { /* one product per scale (int8 weights never come in records; kept general) */
        float b[4] = {0.f, 0.f, 0.f, 0.f};
        for (int i = 0; i < n; i++) b[i] = krec_at(s, off + i);
        return _mm_loadu_ps(b);
    }
    if (n == 4) return fmt ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)s + off)))
                           : _mm_loadu_ps((const float *)s + off);
    const __mmask8 k = (__mmask8)((1u << n) - 1); /* masked: no read past the row's last scale */
    return fmt ? _mm_cvtph_ps(_mm_maskz_loadu_epi16(k, (const uint16_t *)s + off))
               : _mm_maskz_loadu_ps(k, (const float *)s + off);
}
INLINE vb vb_nib_lo(vb w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
#if defined(__GFNI__) /* one instruction: each byte times a bit matrix over GF(2), here the matrix of x >> 4 */
INLINE vb vb_nib_hi(vb w) { return _mm512_gf2p8affine_epi64_epi8(w, _mm512_set1_epi64(0x1020408000000000LL), 0); }
#else
INLINE vb vb_nib_hi(vb w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
#endif
INLINE vi dot_u8s8(vi acc, vb u, vb s) { /* lane l += sum of bytes 4l..4l+3 of u (unsigned) * s (signed) */
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else /* pairs into int16 (u <= 128 and |s| <= 127 here: |pair| <= 32512, no saturation), then pairs into int32 */
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
INLINE vi q4_dot(vb lo, vb hi, const int8_t *x) {
    return dot_u8s8(dot_u8s8(_mm512_setzero_si512(), lo, vb_load(x)), hi, vb_load(x + CHUNK));
}
#ifdef Q8_BIAS
INLINE q8w_t q8_prep(vb w) { return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)); } /* w + 128 as uint8 */
INLINE vi q8_dot(q8w_t w, const int8_t *x, const int32_t *xc) { /* (w + 128) * x summed from -128 * sum(x) */
    return _mm512_dpbusd_epi32(_mm512_loadu_si512(xc), w, vb_load(x));
}
#else
INLINE q8w_t q8_prep(vb w) {
    q8w_t r = {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)};
    return r;
}
INLINE vi q8_dot(q8w_t w, const int8_t *x, const int32_t *xc) { /* |w| * (x with w's sign) = w * x, byte by byte */
    (void)xc;
    const vb xv = vb_load(x);
    return dot_u8s8(_mm512_setzero_si512(), w.u, _mm512_mask_sub_epi8(xv, w.neg, _mm512_setzero_si512(), xv));
}
#endif
INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
INLINE vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
INLINE vf vf_load_h(const void *s, int fmt, int64_t off, int n) { /* n (1..16) scales from off, zeros after */
    if (fmt == SF_KREC && !(off & 7) && (n == 16 || n == 8)) { /* whole records: 8 sub-values to a super-value */
        const uint8_t *r = (const uint8_t *)s + (off >> 3) * KREC_BYTES;
        uint16_t h0, h1 = 0;
        memcpy(&h0, r, 2);
        __m128i sub = _mm_loadl_epi64((const __m128i *)(r + 2)); /* record 0's 8 sub-values; record 1's after */
        if (n == 16) {
            memcpy(&h1, r + KREC_BYTES, 2);
            sub = _mm_unpacklo_epi64(sub, _mm_loadl_epi64((const __m128i *)(r + KREC_BYTES + 2)));
        }
        const __m512 sup = _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16((short)h1), _mm_set1_epi16((short)h0)));
        __m512 v = _mm512_mul_ps(sup, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sub))); /* exact, as krec_at */
        __asm__("" : "+v"(v)); /* pinned (krec_at says why) */
        return v;
    }
    if (fmt == SF_KREC) { /* anywhere else: one product per value */
        _Alignas(64) float b[16] = {0.f};
        for (int i = 0; i < n; i++) b[i] = krec_at(s, off + i);
        return _mm512_load_ps(b);
    }
    if (n == 16) return fmt ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + off)))
                            : _mm512_loadu_ps((const float *)s + off);
    const __mmask16 k = (__mmask16)((1u << n) - 1); /* masked: no read past the row's last scale */
    return fmt ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)s + off))
               : _mm512_maskz_loadu_ps(k, (const float *)s + off);
}
INLINE vf vf_cvt(vi a) { return _mm512_cvtepi32_ps(a); }
INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
/* The sum of 16 lanes in a fixed tree: lane i + lane i+8, then i + i+4, then i + i+2, then 0 + 1.  vf_sum4 sums 4
 * vectors with the same pairs (4 rows' reductions share their shuffles), so a row's sum is the same bits whichever
 * of the two computes it. */
INLINE float vf_sum(vf a) {
    const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
INLINE void vf_sum4(vf a, vf b, vf c, vf d, float out[4]) {
    const vf ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE)); /* [a8 | b8] */
    const vf cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    vf v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD)); /* [a4 b4 c4 d4] */
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E)); /* i + i+2 within each row's 4 */
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1)); /* 0 + 1 */
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0,
                                                                                    0, 0, 0, 0, 0, 0), v)));
}
INLINE vf vf_expand4(f4 s) { /* s[0..3] -> each 4 times */
    return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(s));
}
INLINE vf vf_spread4(vf v, int j) { /* lanes 4j..4j+3 of v, each 4 times (j a constant: the index is one register) */
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                                  _mm512_set1_epi32(4 * j)), v);
}
INLINE vf vf_expand2(f4 s) { /* s[0..1] -> each 8 times */
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(s));
}
#elif QSIMD == 256
typedef struct { __m256i a, b; } vb;
typedef struct { __m256i a, b; } vi;
typedef struct { __m256 a, b; } vf;
typedef vb q8w_t; /* the weights themselves: vpsignb moves their sign onto x */
typedef __m128 f4;
INLINE vb vb_load(const void *p) {
    vb r = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
    return r;
}
INLINE vb vb_load_part(const void *p, int n) { /* a row's last chunk: a copy, zero-padded */
    uint8_t buf[CHUNK] = {0};
    memcpy(buf, p, n);
    return vb_load(buf);
}
INLINE f4 f4_load(const void *s, int fmt, int64_t off, int n) {
    if (n == 4 && fmt == SF_F16) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)s + off)));
    if (n == 4 && fmt == SF_F32) return _mm_loadu_ps((const float *)s + off);
    float b[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < n; i++) b[i] = scale_at(s, fmt, off + i);
    return _mm_loadu_ps(b);
}
INLINE vb vb_nib_lo(vb w) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    vb r = {_mm256_and_si256(w.a, m), _mm256_and_si256(w.b, m)};
    return r;
}
#if defined(__GFNI__)
INLINE vb vb_nib_hi(vb w) {
    const __m256i a = _mm256_set1_epi64x(0x1020408000000000LL); /* the bit matrix of x >> 4 (see the 512-bit path) */
    vb r = {_mm256_gf2p8affine_epi64_epi8(w.a, a, 0), _mm256_gf2p8affine_epi64_epi8(w.b, a, 0)};
    return r;
}
#else
INLINE vb vb_nib_hi(vb w) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    vb r = {_mm256_and_si256(_mm256_srli_epi16(w.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(w.b, 4), m)};
    return r;
}
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
INLINE __m256i q4_dot8(__m256i lo, __m256i hi, const int8_t *xl, const int8_t *xh) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)xl), b = _mm256_loadu_si256((const __m256i *)xh);
#ifdef DPBUSD
    return DPBUSD(DPBUSD(_mm256_setzero_si256(), lo, a), hi, b);
#else /* nibble * int8 pairs into int16 (|sum| <= 4 * 15 * 127: no saturation), then pairs into int32 */
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, a), _mm256_maddubs_epi16(hi, b)),
                             _mm256_set1_epi16(1));
#endif
}
INLINE vi q4_dot(vb lo, vb hi, const int8_t *x) {
    vi r = {q4_dot8(lo.a, hi.a, x, x + CHUNK), q4_dot8(lo.b, hi.b, x + 32, x + CHUNK + 32)};
    return r;
}
#ifdef DPBUSD
#define Q8_BIAS 1 /* as in the 512-bit path: w + 128 unsigned, the lanes start at -128 * sum(x) */
INLINE q8w_t q8_prep(vb w) {
    const __m256i b = _mm256_set1_epi8((char)0x80);
    vb r = {_mm256_xor_si256(w.a, b), _mm256_xor_si256(w.b, b)};
    return r;
}
INLINE vi q8_dot(q8w_t w, const int8_t *x, const int32_t *xc) {
    vi r = {DPBUSD(_mm256_loadu_si256((const __m256i *)xc), w.a, _mm256_loadu_si256((const __m256i *)x)),
            DPBUSD(_mm256_loadu_si256((const __m256i *)xc + 1), w.b, _mm256_loadu_si256((const __m256i *)x + 1))};
    return r;
}
#else /* vpmaddubsw saturates int16 pairs: (w + 128) * x would overflow, so the sign moves onto x instead */
INLINE q8w_t q8_prep(vb w) { return w; }
INLINE __m256i q8_dot8(__m256i w, const int8_t *x) { /* |w| * (x with w's sign): |products| <= 128 * 127 */
    const __m256i s = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), w), u = _mm256_sign_epi8(w, w);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
INLINE vi q8_dot(q8w_t w, const int8_t *x, const int32_t *xc) {
    (void)xc;
    vi r = {q8_dot8(w.a, x), q8_dot8(w.b, x + 32)};
    return r;
}
#endif
INLINE vf vf_zero(void) {
    vf r = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    return r;
}
INLINE vf vf_load(const float *p) {
    vf r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    return r;
}
INLINE vf vf_load_h(const void *s, int fmt, int64_t off, int n) { /* n (1..16) scales from off, zeros after */
    if (fmt == SF_KREC && !(off & 7) && (n == 16 || n == 8)) { /* whole records, as the 512-bit path */
        const uint8_t *r = (const uint8_t *)s + (off >> 3) * KREC_BYTES;
        uint16_t h;
        memcpy(&h, r, 2);
        vf v = vf_zero();
        v.a = _mm256_mul_ps(_mm256_set1_ps(h2f(h)),
                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(r + 2)))));
        if (n == 16) {
            memcpy(&h, r + KREC_BYTES, 2);
            v.b = _mm256_mul_ps(_mm256_set1_ps(h2f(h)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                            _mm_loadl_epi64((const __m128i *)(r + KREC_BYTES + 2)))));
        }
        __asm__("" : "+x"(v.a), "+x"(v.b)); /* pinned (krec_at says why) */
        return v;
    }
    if (n == 16 && fmt == SF_F16) {
        vf r = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + off))),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + off + 8)))};
        return r;
    }
    if (n == 16 && fmt == SF_F32) return vf_load((const float *)s + off);
    float b[16] = {0.f};
    for (int i = 0; i < n; i++) b[i] = scale_at(s, fmt, off + i);
    return vf_load(b);
}
INLINE vf vf_cvt(vi a) {
    vf r = {_mm256_cvtepi32_ps(a.a), _mm256_cvtepi32_ps(a.b)};
    return r;
}
INLINE vf vf_mul(vf a, vf b) {
    vf r = {_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)};
    return r;
}
INLINE vf vf_fma(vf a, vf b, vf c) {
    vf r = {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)};
    return r;
}
INLINE vf vf_add(vf a, vf b) {
    vf r = {_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)};
    return r;
}
INLINE float vf_sum(vf v) {
    const __m256 a = _mm256_add_ps(v.a, v.b);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
INLINE void vf_sum4(vf a, vf b, vf c, vf d, float out[4]) { /* as vf_sum, one row at a time */
    out[0] = vf_sum(a), out[1] = vf_sum(b), out[2] = vf_sum(c), out[3] = vf_sum(d);
}
INLINE vf vf_expand4(f4 s) {
    const __m256 v = _mm256_castps128_ps256(s);
    vf r = {_mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)),
            _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3))};
    return r;
}
INLINE vf vf_expand2(f4 s) {
    vf r = {_mm256_broadcastss_ps(s), _mm256_broadcastss_ps(_mm_movehdup_ps(s))};
    return r;
}
INLINE vf vf_spread4(vf v, int j) { /* lanes 4j..4j+3 of v (lanes 0-7 in .a, 8-15 in .b), each 4 times */
    const __m256 src = j < 2 ? v.a : v.b;
    const int b = (j % 2) * 4;
    vf r = {_mm256_permutevar8x32_ps(src, _mm256_setr_epi32(b, b, b, b, b + 1, b + 1, b + 1, b + 1)),
            _mm256_permutevar8x32_ps(src, _mm256_setr_epi32(b + 2, b + 2, b + 2, b + 2, b + 3, b + 3, b + 3, b + 3))};
    return r;
}
#endif
#if QSIMD
INLINE f4 f4_loadf(const float *p) { return _mm_loadu_ps(p); }
#else /* portable C over the same lanes: loops the compiler may vectorise (e.g. to ARM sdot with dotprod) */
/* The lanes are summed in the written order: -ffast-math would let clang reassociate them, differently in each
 * inlined copy, and a row's result would then depend on how many rows share the call.  (GCC keeps the order here.) */
#ifdef __clang__
#pragma clang fp reassociate(off)
#endif
typedef struct { uint8_t v[CHUNK]; } vb;
typedef struct { int32_t v[16]; } vi;
typedef struct { float v[16]; } vf;
typedef vb q8w_t;
typedef struct { float v[4]; } f4;
INLINE vb vb_load(const void *p) {
    vb r;
    memcpy(r.v, p, CHUNK);
    return r;
}
INLINE vb vb_load_part(const void *p, int n) {
    vb r = {{0}};
    memcpy(r.v, p, n);
    return r;
}
INLINE f4 f4_load(const void *s, int fmt, int64_t off, int n) {
    f4 r = {{0.f}};
    for (int i = 0; i < n; i++) r.v[i] = scale_at(s, fmt, off + i);
    return r;
}
INLINE f4 f4_loadf(const float *p) {
    f4 r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
INLINE vb vb_nib_lo(vb w) {
    for (int j = 0; j < CHUNK; j++) w.v[j] &= 0x0F;
    return w;
}
INLINE vb vb_nib_hi(vb w) {
    for (int j = 0; j < CHUNK; j++) w.v[j] >>= 4;
    return w;
}
INLINE vi q4_dot(vb lo, vb hi, const int8_t *x) {
    vi r;
    for (int l = 0; l < 16; l++) {
        int32_t s = 0;
        for (int j = 4 * l; j < 4 * l + 4; j++) s += (int32_t)lo.v[j] * x[j] + (int32_t)hi.v[j] * x[CHUNK + j];
        r.v[l] = s;
    }
    return r;
}
INLINE q8w_t q8_prep(vb w) { return w; }
INLINE vi q8_dot(q8w_t w, const int8_t *x, const int32_t *xc) {
    (void)xc;
    vi r;
    for (int l = 0; l < 16; l++) {
        int32_t s = 0;
        for (int j = 4 * l; j < 4 * l + 4; j++) s += (int32_t)(int8_t)w.v[j] * x[j];
        r.v[l] = s;
    }
    return r;
}
INLINE vf vf_zero(void) {
    vf r = {{0.f}};
    return r;
}
INLINE vf vf_load(const float *p) {
    vf r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
INLINE vf vf_load_h(const void *s, int fmt, int64_t off, int n) {
    vf r = {{0.f}};
    for (int i = 0; i < n; i++) r.v[i] = scale_at(s, fmt, off + i);
    return r;
}
INLINE vf vf_cvt(vi a) {
    vf r;
    for (int l = 0; l < 16; l++) r.v[l] = (float)a.v[l];
    return r;
}
INLINE vf vf_mul(vf a, vf b) {
    for (int l = 0; l < 16; l++) a.v[l] *= b.v[l];
    return a;
}
INLINE vf vf_fma(vf a, vf b, vf c) {
    for (int l = 0; l < 16; l++) c.v[l] += a.v[l] * b.v[l];
    return c;
}
INLINE vf vf_add(vf a, vf b) {
    for (int l = 0; l < 16; l++) a.v[l] += b.v[l];
    return a;
}
INLINE float vf_sum(vf a) {
    float s = 0.f;
    for (int l = 0; l < 16; l++) s += a.v[l];
    return s;
}
INLINE void vf_sum4(vf a, vf b, vf c, vf d, float out[4]) {
    out[0] = vf_sum(a), out[1] = vf_sum(b), out[2] = vf_sum(c), out[3] = vf_sum(d);
}
INLINE vf vf_expand4(f4 s) {
    vf r;
    for (int l = 0; l < 16; l++) r.v[l] = s.v[l / 4];
    return r;
}
INLINE vf vf_expand2(f4 s) {
    vf r;
    for (int l = 0; l < 16; l++) r.v[l] = s.v[l / 8];
    return r;
}
INLINE vf vf_spread4(vf v, int j) {
    vf r;
    for (int l = 0; l < 16; l++) r.v[l] = v.v[4 * j + l / 4];
    return r;
}
#ifdef __clang__
#pragma clang fp reassociate(on)
#endif
#endif

/* a, opaque to the optimiser: -ffast-math may reassociate a chain of adds (a + b) + c differently where the same
 * function is inlined twice, and a row's sum must be the same bits on every path; an add whose input is pinned
 * cannot be regrouped. */
INLINE vf vf_pin(vf a) {
    __asm__("" : "+m"(a));
    return a;
}

/* n (1..16) mins of consecutive groups from off, zeros after: stored (vf_load_h), or for Q4_0 (mi == NULL) Q4_0_MIN
 * of the same groups' scales d16 (already loaded by the caller, zeros after n), lane by lane. */
INLINE vf vf_load_min(const void *mi, vf d16, int fmt, int64_t off, int n) {
    static const float unit[16] = {Q4_0_MIN(1.f), Q4_0_MIN(1.f), Q4_0_MIN(1.f), Q4_0_MIN(1.f), Q4_0_MIN(1.f),
                                   Q4_0_MIN(1.f), Q4_0_MIN(1.f), Q4_0_MIN(1.f), Q4_0_MIN(1.f), Q4_0_MIN(1.f),
                                   Q4_0_MIN(1.f), Q4_0_MIN(1.f), Q4_0_MIN(1.f), Q4_0_MIN(1.f), Q4_0_MIN(1.f),
                                   Q4_0_MIN(1.f)}; /* -8 * d = d * -8 exactly */
    return mi ? vf_load_h(mi, fmt, off, n) : vf_mul(d16, vf_load(unit));
}

/* n consecutive scales (any format) -> fp32, fp16 8 at a time with F16C. */
static inline void to_f32(const void *s, int fmt, int64_t off, int64_t n, float *restrict out) {
    int64_t i = 0;
#if defined(__F16C__)
    if (fmt == SF_F16)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + off + i))));
#endif
    for (; i < n; i++) out[i] = scale_at(s, fmt, off + i);
}

/* The activations' int8 blocks in the chunk layout (once per call, before the threads split the rows;
 * on the stack up to XPREP_STACK bytes: a malloc and free cost about as much as a small GEMV).
 * Per input row: xq, the int8 codes (Q4_1: per chunk the 4 blocks' first halves, then their second halves; int8:
 * in order), zero-padded to whole chunks; dxl, each block's step dx = max|x| / 127 repeated on its lanes (4 per Q4_1
 * block, 8 per int8 block); for Q4_1 also dxb, each block's dx once, xsb, per block dx * sum(xq) (the sum of xhat
 * that the block's min m multiplies) — both zero-padded to a multiple of 16 floats, read 16 at a time — and xsg,
 * the same sums per group of G.  rint rounds half to even, as torch.round does in the PyTorch twin
 * (quant.q8_activation_ref).  For int8 weights on VNNI (Q8_BIAS) also xc: per chunk 16 int32 lanes, -128 times the
 * sum of the lane's 4 codes, where vpdpbusd's sum of (w + 128) * x starts so that it ends at sum w * x exactly (the
 * same integer as before, one xor per chunk instead of the abs / sign-mask / masked-negate the signed weights took).
 * Cost: M*K reads and ~2-3 M*K bytes written, nothing next to the N*K weights. */
typedef struct {
    void *mem;
    int8_t *xq;
    float *dxl, *dxb, *xsb, *xsg;
    int32_t *xc;
    int64_t sq, sl, sb, sg, sc; /* per-row strides of xq (bytes), dxl, xsb and dxb, xsg (floats), xc (int32) */
} xprep_t;

#ifdef Q8_BIAS
#define XC_LANES 16 /* xc lanes per int8 chunk */
#else
#define XC_LANES 0
#endif

#define ROUND16(n) (((n) + 15) / 16 * 16)

/* Bytes xprep uses for M rows of K (a caller passing its own buffer sizes it with this). */
static size_t xprep_bytes(int64_t M, int64_t K, int64_t G, int q4) {
    const int64_t nb = K / QB, bpc = q4 ? 4 : 2, nc = (nb + bpc - 1) / bpc, ng = K / G;
    const int64_t floats = nc * 16 + (q4 ? 2 * ROUND16(nc * 4) + ng : 0), ints = q4 ? 0 : nc * XC_LANES;
    return (size_t)M * ((size_t)nc * CHUNK * (q4 ? 2 : 1) + sizeof(float) * (size_t)(floats + ints));
}

/* Precise math: under -ffast-math amax / 127.f becomes amax * (1/127.f), a different dx in ~4 % of blocks (and every
 * code of such a block scaled by it), and a quotient near k + 1/2 may round the other way from the reference's. */
PRECISE_MATH_BEGIN
static xprep_t xprep(const void *xin, int x_bf16, int64_t M, int64_t K, int64_t G, int q4, void *buf,
                     size_t buf_bytes) {
    const int64_t nb = K / QB, bpc = q4 ? 4 : 2, nc = (nb + bpc - 1) / bpc, ng = K / G;
    xprep_t p = {0};
    p.sq = nc * CHUNK * (q4 ? 2 : 1), p.sl = nc * 16, p.sb = q4 ? ROUND16(nc * 4) : 0, p.sg = q4 ? ng : 0;
    p.sc = q4 ? 0 : nc * XC_LANES;
    const size_t bytes = xprep_bytes(M, K, G, q4);
    p.mem = bytes <= buf_bytes ? memset(buf, 0, bytes) : calloc(1, bytes); /* zeros: the chunks' padding */
    p.dxl = (float *)p.mem, p.xsb = p.dxl + M * p.sl, p.dxb = p.xsb + M * p.sb, p.xsg = p.dxb + M * p.sb;
    p.xc = (int32_t *)(p.xsg + M * p.sg);
    p.xq = (int8_t *)(p.xc + M * p.sc);
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            float xb[QB];
            for (int j = 0; j < QB; j++) {
                const int64_t i = m * K + b * QB + j;
                xb[j] = x_bf16 ? bf2f(((const uint16_t *)xin)[i]) : ((const float *)xin)[i];
            }
            float amax = 0.f;
            for (int j = 0; j < QB; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            int8_t q[QB];
            int32_t s = 0;
            for (int j = 0; j < QB; j++) {
                q[j] = (int8_t)rintf(xb[j] * id);
                s += q[j];
            }
            const int64_t c = b / bpc, i = b % bpc;
            int8_t *xr = p.xq + m * p.sq;
            if (q4) {
                memcpy(xr + c * 2 * CHUNK + i * 16, q, 16);
                memcpy(xr + c * 2 * CHUNK + CHUNK + i * 16, q + 16, 16);
                for (int l = 0; l < 4; l++) p.dxl[m * p.sl + b * 4 + l] = d;
                p.xsb[m * p.sb + b] = d * (float)s;
                p.dxb[m * p.sb + b] = d;
                p.xsg[m * p.sg + b / (G / QB)] += d * (float)s; /* blocks of a group are consecutive */
            } else {
                memcpy(xr + b * QB, q, QB);
                for (int l = 0; l < 8; l++) p.dxl[m * p.sl + b * 8 + l] = d;
                for (int l = 0; l < 8 && p.sc; l++) /* block b fills lanes 8 (b % 2) .. + 7 of chunk b / 2 */
                    p.xc[m * p.sc + b * 8 + l] = -128 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
            }
        }
    return p;
}
PRECISE_MATH_END

/* One Q4_1 weight row against R input rows (tile m0).  G32 (a compile-time 1 or 0) — groups of 32: the blocks are
 * taken 16 at a time (4 chunks): their 16 scales and 16 mins converted in one instruction each, the mins' term
 * sum_b m_b * (sum of xhat in b) accumulated in 16 lanes (am), each chunk's 4 scales spread over its lanes from the
 * 16; otherwise dwb [nb + 4] holds this row's scale per block (expanded from its groups) and the mins' term is one
 * dot over the groups (mt).  Two accumulators per row (even and odd chunks), so that one chain of FMAs does not wait
 * on its latency every chunk — at every R: a row's sums must not depend on how many rows share the call
 * (speculative verification runs γ + 1 rows where plain decode runs one; greedy output must be identical), so the
 * products, the accumulation order, the tail and the reduction are the same at every R and in q4_q8_row4 below. */
INLINE void q4_q8_row(const uint8_t *restrict p, const void *sc, const void *mi, int fmt, int64_t n,
                      const xprep_t *x, int64_t m0, float *restrict out, int64_t K, int64_t G,
                      float *restrict dwb, const int R, const int G32) {
    const int64_t nb = K / QB, ng = K / G;
    vf a0[QTILE], a1[QTILE], am[QTILE];
    float mt[QTILE];
    for (int m = 0; m < R; m++) a0[m] = vf_zero(), a1[m] = vf_zero(), am[m] = vf_zero(), mt[m] = 0.f;
    if (!G32) {
        float dw[ng];
        to_f32(sc, fmt, n * ng, ng, dw);
        for (int64_t b = 0; b < nb; b++) dwb[b] = dw[b / (G / QB)];
        for (int64_t b = nb; b < nb + 4; b++) dwb[b] = 0.f; /* read by the last chunk */
        if (mi) to_f32(mi, fmt, n * ng, ng, dw);
        else /* Q4_0: dw holds this row's scales (above) */
            for (int64_t g = 0; g < ng; g++) dw[g] = Q4_0_MIN(dw[g]);
        for (int m = 0; m < R; m++) {
            float t = 0.f;
            for (int64_t g = 0; g < ng; g++) t += dw[g] * x->xsg[(m0 + m) * x->sg + g];
            mt[m] = t;
        }
    }
    /* chunk c = g / 4 + J of 16 blocks from g (NBLK of its 4 blocks real), summed into a0 (J even) or a1 (J odd) */
#define Q4_CHUNK(ACC, J, NBLK)                                                                                 \
    do {                                                                                                       \
        const int64_t c_ = g / 4 + (J);                                                                        \
        const vb w_ = (NBLK) == 4 ? vb_load(p + c_ * CHUNK) : vb_load_part(p + c_ * CHUNK, (NBLK) * 16);       \
        const vb lo_ = vb_nib_lo(w_), hi_ = vb_nib_hi(w_);                                                     \
        const vf sw_ = G32 ? vf_spread4(sw16, J) : vf_expand4(f4_loadf(dwb + c_ * 4));                         \
        for (int m = 0; m < R; m++) {                                                                          \
            const vi d_ = q4_dot(lo_, hi_, x->xq + (m0 + m) * x->sq + c_ * 2 * CHUNK);                         \
            ACC[m] = vf_fma(vf_cvt(d_), vf_mul(sw_, vf_load(x->dxl + (m0 + m) * x->sl + c_ * 16)), ACC[m]);    \
        }                                                                                                      \
    } while (0)
#define Q4_GROUP_START                                                                                         \
    const int nbg_ = nb - g < 16 ? (int)(nb - g) : 16;                                                         \
    vf sw16 = vf_zero();                                                                                       \
    if (G32) {                                                                                                 \
        sw16 = vf_load_h(sc, fmt, n * ng + g, nbg_);                                                           \
        const vf mn16_ = vf_load_min(mi, sw16, fmt, n * ng + g, nbg_);                                         \
        for (int m = 0; m < R; m++) am[m] = vf_fma(mn16_, vf_load(x->xsb + (m0 + m) * x->sb + g), am[m]);      \
    }
    int64_t g = 0;
    for (; g + 16 <= nb; g += 16) { /* 16 blocks: 4 whole chunks */
        Q4_GROUP_START
        Q4_CHUNK(a0, 0, 4);
        Q4_CHUNK(a1, 1, 4);
        Q4_CHUNK(a0, 2, 4);
        Q4_CHUNK(a1, 3, 4);
    }
    if (g < nb) { /* the last 1..15 blocks: whole chunks, then one of 1..3 blocks (zero-padded, as its activations) */
        Q4_GROUP_START
        const int left = (int)(nb - g);
        if (left > 0) Q4_CHUNK(a0, 0, left >= 4 ? 4 : left);
        if (left > 4) Q4_CHUNK(a1, 1, left >= 8 ? 4 : left - 4);
        if (left > 8) Q4_CHUNK(a0, 2, left >= 12 ? 4 : left - 8);
        if (left > 12) Q4_CHUNK(a1, 3, left - 12);
    }
#undef Q4_CHUNK
#undef Q4_GROUP_START
    for (int m = 0; m < R; m++)
        out[m] = G32 ? vf_sum(vf_add(vf_pin(vf_add(a0[m], a1[m])), am[m])) : vf_sum(vf_add(a0[m], a1[m])) + mt[m];
}

/* Batch 1, groups of 32 (GGUF Q4_1, the decode case): 4 weight rows at a time against the one input row.  Per 16
 * blocks and row: the 16 scales times the activations' 16 dx (one convert, one multiply), the 16 mins into the
 * mins' lanes (one convert, one FMA); per chunk the activations are loaded once for the 4 rows, and a row's chunk
 * costs its weight load, two nibble masks, two integer dot products, one convert, the spread of 4 products to their
 * lanes and one FMA.  Each row's products, chunk order and reduction are q4_q8_row's (see there): the same bits.
 * The 4 rows are 4 short interleaved streams (a row is 4.5 lines at K = 576), which the hardware prefetchers do not
 * follow: each chunk step prefetches 4 lines of the tile PF_TILES ahead in address order, so a tile's lines are all
 * requested early (SmolLM2 stack, 1 thread, streamed: 4.6 -> 3.5 ms with 2 tiles; the same row 1 tile ahead, as
 * this did before, ~4.6; no prefetch ~7). */
INLINE void q4_q8_row4(const uint8_t *restrict p, const void *sc, const void *mi, int fmt, int64_t n,
                       const xprep_t *x, float out[4], int64_t K) {
    const int64_t nb = K / QB, ng = nb, rowb = K / 2;
    vf a0[4], a1[4], am[4], sd[4];
    for (int r = 0; r < 4; r++) a0[r] = vf_zero(), a1[r] = vf_zero(), am[r] = vf_zero();
#define Q4_CHUNK4(ACC, J, NBLK)                                                                                \
    do {                                                                                                       \
        const int64_t c_ = g / 4 + (J);                                                                        \
        const int8_t *xr_ = x->xq + c_ * 2 * CHUNK;                                                            \
        for (int r = 0; r < 4; r++) {                                                                          \
            const uint8_t *pr_ = p + r * rowb + c_ * CHUNK;                                                    \
            __builtin_prefetch(p + 4 * PF_TILES * rowb + (c_ * 4 + r) * CHUNK, 0, PF_LOC); /* address order */ \
            const vb w_ = (NBLK) == 4 ? vb_load(pr_) : vb_load_part(pr_, (NBLK) * 16);                         \
            const vi d_ = q4_dot(vb_nib_lo(w_), vb_nib_hi(w_), xr_);                                           \
            ACC[r] = vf_fma(vf_cvt(d_), vf_spread4(sd[r], J), ACC[r]);                                         \
        }                                                                                                      \
    } while (0)
#define Q4_GROUP_START4                                                                                        \
    const int nbg_ = nb - g < 16 ? (int)(nb - g) : 16;                                                         \
    const vf dx16_ = vf_load(x->dxb + g), xs16_ = vf_load(x->xsb + g);                                         \
    for (int r = 0; r < 4; r++) {                                                                              \
        const int64_t ahead_ = (n + r + 4 * PF_TILES) * ng + g; /* the scales and mins PF_TILES tiles ahead */ \
        __builtin_prefetch((const char *)sc + scale_byte(fmt, ahead_), 0, PF_LOC);                            \
        if (mi) __builtin_prefetch((const char *)mi + scale_byte(fmt, ahead_), 0, PF_LOC);                    \
        const vf d16_ = vf_load_h(sc, fmt, (n + r) * ng + g, nbg_);                                            \
        sd[r] = vf_mul(d16_, dx16_);                                                                           \
        am[r] = vf_fma(vf_load_min(mi, d16_, fmt, (n + r) * ng + g, nbg_), xs16_, am[r]);                      \
    }
    int64_t g = 0;
    for (; g + 16 <= nb; g += 16) {
        Q4_GROUP_START4
        Q4_CHUNK4(a0, 0, 4);
        Q4_CHUNK4(a1, 1, 4);
        Q4_CHUNK4(a0, 2, 4);
        Q4_CHUNK4(a1, 3, 4);
    }
    if (g < nb) {
        Q4_GROUP_START4
        const int left = (int)(nb - g);
        if (left > 0) Q4_CHUNK4(a0, 0, left >= 4 ? 4 : left);
        if (left > 4) Q4_CHUNK4(a1, 1, left >= 8 ? 4 : left - 4);
        if (left > 8) Q4_CHUNK4(a0, 2, left >= 12 ? 4 : left - 8);
        if (left > 12) Q4_CHUNK4(a1, 3, left - 12);
    }
#undef Q4_CHUNK4
#undef Q4_GROUP_START4
    vf_sum4(vf_add(vf_pin(vf_add(a0[0], a1[0])), am[0]), vf_add(vf_pin(vf_add(a0[1], a1[1])), am[1]),
            vf_add(vf_pin(vf_add(a0[2], a1[2])), am[2]), vf_add(vf_pin(vf_add(a0[3], a1[3])), am[3]), out);
}

/* int8 weights against R input rows.  MODE (compile-time): 0 per output channel (G = K: the row's one scale
 * multiplies the sum at the end), 1 groups of 32 (GGUF Q8_0: 2 scales per chunk), 2 other groups (dwb, as above). */
INLINE void q8_q8_row(const int8_t *restrict w, const void *sc, int fmt, int64_t n, const xprep_t *x, int64_t m0,
                      float *restrict out, int64_t K, int64_t G, float *restrict dwb, const int R, const int MODE) {
    const int64_t nb = K / QB, ng = K / G, nc = nb / 2;
    const int rem = (int)(nb % 2);
    vf a0[QTILE], a1[QTILE];
    for (int m = 0; m < R; m++) a0[m] = vf_zero(), a1[m] = vf_zero();
    if (MODE == 2) {
        float dw[ng];
        to_f32(sc, fmt, n * ng, ng, dw);
        for (int64_t b = 0; b < nb; b++) dwb[b] = dw[b / (G / QB)];
        for (int64_t b = nb; b < nb + 4; b++) dwb[b] = 0.f; /* read by the last chunk */
    }
#define Q8_CHUNK(ACC, NBLK, CI)                                                                                    \
    do {                                                                                                       \
        const q8w_t wp_ = q8_prep(NBLK == 2 ? vb_load(w + (CI) * CHUNK) : vb_load_part(w + (CI) * CHUNK, QB));       \
        vf sw_ = vf_zero();                                                                                    \
        if (MODE) sw_ = vf_expand2(MODE == 1 ? f4_load(sc, fmt, n * ng + 2 * (CI), NBLK) : f4_loadf(dwb + 2 * (CI))); \
        for (int m = 0; m < R; m++) {                                                                          \
            const vf d_ = vf_cvt(q8_dot(wp_, x->xq + (m0 + m) * x->sq + (CI) * CHUNK,                              \
                                        x->xc + (m0 + m) * x->sc + (CI) * 16));                                   \
            const vf dx_ = vf_load(x->dxl + (m0 + m) * x->sl + (CI) * 16);                                        \
            ACC[m] = vf_fma(d_, MODE ? vf_mul(sw_, dx_) : dx_, ACC[m]);                                        \
        }                                                                                                      \
    } while (0)
    int64_t c = 0;
    for (; c + 2 <= nc; c += 2) {
        Q8_CHUNK(a0, 2, c);
        Q8_CHUNK(a1, 2, c + 1);
    }
    if (c < nc) {
        Q8_CHUNK(a0, 2, c);
        c++;
    }
    if (rem) Q8_CHUNK(a1, 1, c); /* the last block, zero-padded */
#undef Q8_CHUNK
    const float s = MODE == 0 ? scale_at(sc, fmt, n) : 1.f;
    for (int m = 0; m < R; m++) out[m] = s * vf_sum(vf_add(a0[m], a1[m]));
}

/* Batch 1, per-channel scales or groups of 32 (MODE 0 or 1, as q8_q8_row): 4 weight rows at a time against the
 * one input row, the activation, xc and dx loads shared by the 4 rows (1.75 loads a chunk and row instead of 4).
 * Each row's products, chunk order and reduction are q8_q8_row's, so its result is the same bits.  The 4 rows are 4
 * interleaved streams the hardware prefetchers do not follow; as in q4_q8_row4, each chunk step prefetches 4 lines
 * of the tile PF_TILES ahead in address order. */
INLINE void q8_q8_row4(const int8_t *restrict w, const void *sc, int fmt, int64_t n, const xprep_t *x, float out[4],
                       int64_t K, const int MODE) {
    const int64_t nb = K / QB, ng = MODE ? nb : 1, nc = nb / 2;
    const int rem = (int)(nb % 2);
    vf a0[4], a1[4];
    for (int r = 0; r < 4; r++) a0[r] = vf_zero(), a1[r] = vf_zero();
#define Q8_CHUNK4(ACC, NBLK, CI)                                                                               \
    do {                                                                                                       \
        const int8_t *xr_ = x->xq + (CI) * CHUNK;                                                              \
        const int32_t *xc_ = x->xc + (CI) * 16;                                                                \
        const vf dx_ = vf_load(x->dxl + (CI) * 16);                                                            \
        for (int r = 0; r < 4; r++) {                                                                          \
            const int8_t *wr_ = w + r * K + (CI) * CHUNK;                                                      \
            __builtin_prefetch(w + 4 * PF_TILES * K + ((CI) * 4 + r) * CHUNK, 0, PF_LOC);                      \
            const q8w_t wp_ = q8_prep(NBLK == 2 ? vb_load(wr_) : vb_load_part(wr_, QB));                       \
            const vf d_ = vf_cvt(q8_dot(wp_, xr_, xc_));                                                       \
            const vf s_ = MODE ? vf_expand2(f4_load(sc, fmt, (n + r) * ng + 2 * (CI), NBLK)) : dx_;           \
            if (MODE) ACC[r] = vf_fma(d_, vf_mul(s_, dx_), ACC[r]);                                            \
            else ACC[r] = vf_fma(d_, dx_, ACC[r]);                                                             \
        }                                                                                                      \
    } while (0)
    int64_t c = 0; /* q8_q8_row's order: even chunks in a0, odd in a1, an odd last one in a0, the tail in a1 */
    for (; c + 2 <= nc; c += 2) {
        Q8_CHUNK4(a0, 2, c);
        Q8_CHUNK4(a1, 2, c + 1);
    }
    if (c < nc) {
        Q8_CHUNK4(a0, 2, c);
        c++;
    }
    if (rem) Q8_CHUNK4(a1, 1, c);
#undef Q8_CHUNK4
    vf_sum4(vf_add(a0[0], a1[0]), vf_add(a0[1], a1[1]), vf_add(a0[2], a1[2]), vf_add(a0[3], a1[3]), out);
    if (MODE == 0)
        for (int r = 0; r < 4; r++) out[r] *= scale_at(sc, fmt, n + r);
}

/* Rows n0..n1 of y for one thread; dwb: a row's scale per block (groups other than 32). */
static void q4_q8_rows(const uint8_t *restrict P, const void *scales, const void *mins, int scale_fmt,
                       const xprep_t *x, int x_bf16, void *y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0,
                       int64_t n1) {
    float dwb[K / QB + 4];
    int64_t n = n0;
    if (QSIMD && M == 1 && G == QB) /* portable C: every row through q4_q8_row (TILE_Q8) */
        for (; n + 4 <= n1; n += 4) {
            float out[4];
            q4_q8_row4(P + n * (K / 2), scales, mins, scale_fmt, n, x, out, K);
            for (int r = 0; r < 4; r++) store_y(y, x_bf16, n + r, out[r]);
        }
    for (; n < n1; n++)
        for (int64_t m0 = 0; m0 < M; m0 += QTILE) {
            float out[QTILE];
            const int64_t mr = M - m0 < QTILE ? M - m0 : QTILE;
#define Q4_Q8(R)                                                                                               \
    if (G == QB) q4_q8_row(P + n * (K / 2), scales, mins, scale_fmt, n, x, m0, out, K, G, dwb, R, 1);          \
    else q4_q8_row(P + n * (K / 2), scales, mins, scale_fmt, n, x, m0, out, K, G, dwb, R, 0)
            TILE_Q8(mr, Q4_Q8)
#undef Q4_Q8
            for (int64_t m = 0; m < mr; m++) store_y(y, x_bf16, (m0 + m) * N + n, out[m]);
        }
}

static void q8_q8_rows(const int8_t *restrict W, const void *scales, int scale_fmt, const xprep_t *x, int x_bf16,
                       void *y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
    float dwb[K / QB + 4];
    /* Batch 1: 4-row tiles (q8_q8_row4).  Alone they are faster in L2 but slower streamed, the 4 interleaved
     * 9-line streams (K = 576) untrained by the hardware prefetchers; with the tile PF_TILES = 4 ahead prefetched
     * in address order into L2 they are faster both ways (BENCHMARKS.md, "int8, batch 1: a 4-row tile"). */
    int64_t n = n0;
    if (QSIMD && M == 1 && (G == K || G == QB)) /* portable C: every row through q8_q8_row (TILE_Q8) */
        for (; n + 4 <= n1; n += 4) {
            float out[4];
            if (G == K) q8_q8_row4(W + n * K, scales, scale_fmt, n, x, out, K, 0);
            else q8_q8_row4(W + n * K, scales, scale_fmt, n, x, out, K, 1);
            for (int r = 0; r < 4; r++) store_y(y, x_bf16, n + r, out[r]);
        }
    /* Past one tile of input rows (decode.c's stacks take up to 32 rows): weight rows in blocks of L2_BLOCK bytes,
     * every tile of input rows over a block before the next (the tile's codes and steps stay in L1 across the
     * block's rows).  Each (weight row, tile) is the same q8_q8_row call in either order: the same bits as row by
     * row. */
    const int64_t blk = M <= QTILE ? n1 - n : (L2_BLOCK / K > 1 ? L2_BLOCK / K : 1);
    for (int64_t b0 = n; b0 < n1; b0 += blk) {
        const int64_t b1 = b0 + blk < n1 ? b0 + blk : n1;
        for (int64_t m0 = 0; m0 < M; m0 += QTILE) {
            const int64_t mr = M - m0 < QTILE ? M - m0 : QTILE;
            for (int64_t r = b0; r < b1; r++) {
                float out[QTILE];
#define Q8_Q8(R)                                                                                               \
    if (G == K) q8_q8_row(W + r * K, scales, scale_fmt, r, x, m0, out, K, G, dwb, R, 0);                       \
    else if (G == QB) q8_q8_row(W + r * K, scales, scale_fmt, r, x, m0, out, K, G, dwb, R, 1);                 \
    else q8_q8_row(W + r * K, scales, scale_fmt, r, x, m0, out, K, G, dwb, R, 2)
                TILE_Q8(mr, Q8_Q8)
#undef Q8_Q8
                for (int64_t m = 0; m < mr; m++) store_y(y, x_bf16, (m0 + m) * N + r, out[m]);
            }
        }
    }
}

#define XPREP_STACK 32768 /* activations prepared on the stack up to this many bytes (M = 8, K = 1536 takes 22 KB) */

/* Needs K % 32 == 0 and G % 32 == 0 (always so for Q4_1; the wrapper sends other int8 shapes to q8_gemm). */
void q4_gemm_q8(const uint8_t *restrict P, const void *scales, const void *mins, int scale_fmt, const void *xin,
                int x_bf16, void *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    _Alignas(64) unsigned char buf[XPREP_STACK];
    const xprep_t x = xprep(xin, x_bf16, M, K, G, 1, buf, sizeof buf);
#define Q4_Q8_ROWS(n0, n1) q4_q8_rows(P, scales, mins, scale_fmt, &x, x_bf16, y, M, N, K, G, n0, n1)
    SPLIT_ROWS(N, K, Q4_Q8_ROWS);
#undef Q4_Q8_ROWS
    if (x.mem != buf) free(x.mem);
}

void q8_gemm_q8(const int8_t *restrict W, const void *scales, int scale_fmt, const void *xin, int x_bf16, void *y,
                int64_t M, int64_t N, int64_t K, int64_t G) {
    _Alignas(64) unsigned char buf[XPREP_STACK];
    const xprep_t x = xprep(xin, x_bf16, M, K, G, 0, buf, sizeof buf);
#define Q8_Q8_ROWS(n0, n1) q8_q8_rows(W, scales, scale_fmt, &x, x_bf16, y, M, N, K, G, n0, n1)
    SPLIT_ROWS(N, K, Q8_Q8_ROWS);
#undef Q8_Q8_ROWS
    if (x.mem != buf) free(x.mem);
}

/* A per-thread scratch buffer for weight rows repacked per L2 block (q6k_q8_rows' unpacked rows, a8_rows_panel's
 * panels): one per thread that has asked for one, reused by its later calls and never freed.  It is bounded: it
 * only grows to the largest block asked for, and each caller sizes its blocks to about L2_BLOCK bytes (at least a few
 * rows of the widest K seen); the threads that hold one are the OpenMP team and the callers, which normally live as
 * long as the process (a thread that ends leaves its one buffer behind).  Kept rather than allocated per call: a
 * buffer this size comes from mmap, and an mmap, its page faults and a munmap on every GEMM would be pure overhead.
 * NULL when the allocation fails (the caller falls back to a path without it). */
static __thread void *block_sbuf;
static __thread size_t block_scap;

static void *block_buf(size_t bytes) {
    if (bytes > block_scap) {
        free(block_sbuf);
        block_sbuf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        block_scap = block_sbuf ? bytes : 0;
    }
    return block_sbuf;
}

/* ---------------------------------------------------------------- Q6_K weights x int8 activations (any M) */

/* GGUF Q6_K as the file stores it (minillm/quant/weight.py Q6KWeight): per row and 256 weights a 210-byte
 * super-block, ql 128 bytes (low 4 bits), qh 64 (high 2 bits), 16 int8 sub-scales sc (one per 16 weights), fp16 d;
 * w = (d * sc) * q, q = (low | high << 4) - 32.  Half h of a super-block (weights 128h..128h+127) owns ql bytes
 * 64h.. and qh bytes 32h..: weight i of a half takes ql byte i % 64 (low nibble for i < 64, high after) and qh byte
 * i % 32, bits 2 * (i / 32).  So one 64-byte load of a half's ql is two chunks of 64 weights in order: its low
 * nibbles (i 0..63, high bits: qh's fields 0 and 1) and its high nibbles (i 64..127, fields 2 and 3) — no
 * shuffles.  The half's 32 qh bytes become once H = [qh, qh >> 2] (64 bytes, q6_h): then bits 4-5 of H hold the
 * high nibbles' fields and bits 4-5 of H << 4 the low nibbles' fields, in chunk order.
 * x is rounded per block of 32 by xprep, as for int8 weights (the same codes, dx lanes and chunk order), and per
 * 16 weights with scale s = d * sc
 *     sum_j s * q_j * xhat_j = s * dx * sum_j (u_j - 32) * xq_j,   u = q + 32 in 0..63 (unsigned bytes)
 * with the integer sum taken lane by lane (4 weights a lane, 4 lanes per 16) by vpdpbusd, or vpmaddubsw + vpmaddwd
 * (pairs <= 2 * 63 * 127: no saturation), or plain C, each lane starting from -32 times its 4 codes' sum (x32,
 * made once per call), so it ends exactly at sum q * xq.  Then per lane acc += sum * ((d * sc) * dx) in fp32:
 * the reference on xhat (quant.q8_activation_ref) up to fp32 summation order.  d * sc is exact in fp32 (an 11-bit
 * mantissa times an 8-bit integer) and pinned, so -ffast-math cannot regroup it with dx.  A row is one sequential
 * stream of 210 bytes per 256 weights; at batch 1 four rows share the activation loads (q6k_q8_row4). */
#define QK_K 256       /* weights per K-quant super-block */
#define Q6K_BYTES 210  /* bytes per Q6_K super-block */

#if QSIMD == 512
/* H of a half's 32 qh bytes; u of its low-nibble chunk, (ql & 15) | ((H << 4) & 0x30), and of its high-nibble
 * chunk, (ql >> 4) | (H & 0x30), one vpternlogd each (a | (b & c)).  The 16-bit shifts move bits across the two
 * bytes of a lane; the 0x30 mask keeps only the byte's own. */
INLINE vb q6_h(const uint8_t *qh) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    return _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
}
INLINE vb q6_u_lo(vb ql, vb h) {
    return _mm512_ternarylogic_epi32(vb_nib_lo(ql), _mm512_slli_epi16(h, 4), _mm512_set1_epi8(0x30), 0xF8);
}
INLINE vb q6_u_hi(vb ql, vb h) {
    return _mm512_ternarylogic_epi32(vb_nib_hi(ql), h, _mm512_set1_epi8(0x30), 0xF8);
}
INLINE vi q6_dot(vb u, const int8_t *x, const int32_t *x32) { /* lane l: x32[l] + sum of bytes 4l..4l+3 of u * x */
    return dot_u8s8(_mm512_loadu_si512(x32), u, vb_load(x));
}
INLINE vf q6_scales(const uint8_t *blk) { /* the 16 d * sc of a super-block */
    uint16_t h;
    memcpy(&h, blk + 208, 2);
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192))));
    return _mm512_mul_ps(_mm512_set1_ps(h2f(h)), sc);
}
#elif QSIMD == 256
INLINE vb q6_h(const uint8_t *qh) { /* as the 512-bit path, in two halves */
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    vb r = {h, _mm256_srli_epi16(h, 2)};
    return r;
}
INLINE vb q6_u_lo(vb ql, vb h) {
    const __m256i m = _mm256_set1_epi8(0x30);
    const vb n = vb_nib_lo(ql);
    vb r = {_mm256_or_si256(n.a, _mm256_and_si256(_mm256_slli_epi16(h.a, 4), m)),
            _mm256_or_si256(n.b, _mm256_and_si256(_mm256_slli_epi16(h.b, 4), m))};
    return r;
}
INLINE vb q6_u_hi(vb ql, vb h) {
    const __m256i m = _mm256_set1_epi8(0x30);
    const vb n = vb_nib_hi(ql);
    vb r = {_mm256_or_si256(n.a, _mm256_and_si256(h.a, m)), _mm256_or_si256(n.b, _mm256_and_si256(h.b, m))};
    return r;
}
INLINE __m256i q6_dot8(__m256i u, const int8_t *x, const int32_t *x32) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x), c = _mm256_loadu_si256((const __m256i *)x32);
#ifdef DPBUSD
    return DPBUSD(c, u, xv);
#else
    return _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1)));
#endif
}
INLINE vi q6_dot(vb u, const int8_t *x, const int32_t *x32) {
    vi r = {q6_dot8(u.a, x, x32), q6_dot8(u.b, x + 32, x32 + 8)};
    return r;
}
INLINE vf q6_scales(const uint8_t *blk) {
    uint16_t h;
    memcpy(&h, blk + 208, 2);
    const __m256 d = _mm256_set1_ps(h2f(h));
    vf r = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 192))))),
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 200)))))};
    return r;
}
#else
INLINE vb q6_h(const uint8_t *qh) {
    vb r;
    for (int j = 0; j < 32; j++) r.v[j] = qh[j], r.v[32 + j] = qh[j] >> 2;
    return r;
}
INLINE vb q6_u_lo(vb ql, vb h) {
    for (int j = 0; j < CHUNK; j++) ql.v[j] = (ql.v[j] & 15) | ((h.v[j] << 4) & 0x30);
    return ql;
}
INLINE vb q6_u_hi(vb ql, vb h) {
    for (int j = 0; j < CHUNK; j++) ql.v[j] = (ql.v[j] >> 4) | (h.v[j] & 0x30);
    return ql;
}
INLINE vi q6_dot(vb u, const int8_t *x, const int32_t *x32) {
    vi r;
    for (int l = 0; l < 16; l++) {
        int32_t s = x32[l];
        for (int j = 4 * l; j < 4 * l + 4; j++) s += (int32_t)u.v[j] * x[j];
        r.v[l] = s;
    }
    return r;
}
INLINE vf q6_scales(const uint8_t *blk) {
    uint16_t h;
    memcpy(&h, blk + 208, 2);
    const float d = h2f(h);
    vf r;
    for (int i = 0; i < 16; i++) r.v[i] = d * (float)(int8_t)blk[192 + i];
    return r;
}
#endif

/* Many input rows (prefill): on AVX-512 VNNI builds q6k_gemm_q8 hands them to the prefill GEMM's register tiles
 * (pf_pack_q6, pf_tile_q6 at the end; another summation order).  Elsewhere q6k_q8_rows, where a weight row would be
 * re-read once per tile of QTILE input rows and its 6-bit codes unpacked each time, at a cost like the products'.
 * So past one tile the weight rows are taken in blocks of about L2_BLOCK bytes, each row unpacked once per call into
 * Q6U_BYTES(K) bytes of a per-thread buffer (block_buf): its u codes in chunk order (K bytes, 64 per chunk: exactly
 * the vectors q6_u_lo / q6_u_hi return), then its 16 scales d * sc per super-block (K / 16 floats, q6_scales'
 * vectors).  Every tile of input rows then runs over the block with the same row kernel reading those vectors
 * instead of making them: the same integers and the same fp32 operations in the same order, so a row's bits are the
 * decode kernel's (tests/quant/test_q6k.py and check_kernels.c check it on every build they run). */
#define Q6U_BYTES(K) ((K) + (K) / 16 * (int64_t)sizeof(float))

/* Row w (Q6K_BYTES per super-block) -> u [K] then sd [K / 16] at dst (Q6U_BYTES(K) bytes, 64-aligned). */
static void q6k_unpack_row(const uint8_t *restrict w, int64_t K, uint8_t *restrict dst) {
    float *sd = (float *)(dst + K);
    for (int64_t s = 0; s < K / QK_K; s++) {
        const uint8_t *restrict blk = w + s * Q6K_BYTES;
        const vb ql0 = vb_load(blk), ql1 = vb_load(blk + CHUNK);
        const vb h0 = q6_h(blk + 2 * CHUNK), h1 = q6_h(blk + 2 * CHUNK + 32);
        const vb u[4] = {q6_u_lo(ql0, h0), q6_u_hi(ql0, h0), q6_u_lo(ql1, h1), q6_u_hi(ql1, h1)};
        const vf sc = q6_scales(blk);
        memcpy(dst + s * 4 * CHUNK, u, sizeof u);
        memcpy(sd + s * 16, &sc, sizeof sc);
    }
}

/* One Q6_K weight row against R input rows (tile m0): per super-block its 16 scales once, then its 4 chunks of 64
 * weights, even chunks into a0 and odd into a1 (two FMA chains), the same order at every R.  UNP (a compile-time 0
 * or 1): w is the row as stored (0) or as q6k_unpack_row left it (1). */
INLINE void q6k_q8_row(const uint8_t *restrict w, const xprep_t *x, const int32_t *restrict x32, int64_t m0,
                       float *restrict out, int64_t K, const int R, const int UNP) {
    vf a0[QTILE], a1[QTILE];
    for (int m = 0; m < R; m++) a0[m] = vf_zero(), a1[m] = vf_zero();
    for (int64_t s = 0; s < K / QK_K; s++) {
        const uint8_t *restrict blk = w + s * Q6K_BYTES;
        const uint8_t *restrict uc = w + s * 4 * CHUNK; /* UNP: the super-block's 4 chunks of u */
        const vf sd = vf_pin(UNP ? vf_load((const float *)(w + K) + s * 16) : q6_scales(blk));
        /* chunk C (0..3) of the super-block: half C / 2, its ql's low (C even) or high nibbles */
#define Q6_CHUNK(ACC, U, C)                                                                                    \
    do {                                                                                                       \
        const vb u_ = (U);                                                                                     \
        const vf sw_ = vf_spread4(sd, C);                                                                      \
        const int64_t c_ = s * 4 + (C);                                                                        \
        for (int m = 0; m < R; m++) {                                                                          \
            const vi d_ = q6_dot(u_, x->xq + (m0 + m) * x->sq + c_ * CHUNK, x32 + (m0 + m) * (K / 4) + c_ * 16);  \
            ACC[m] = vf_fma(vf_cvt(d_), vf_mul(sw_, vf_load(x->dxl + (m0 + m) * x->sl + c_ * 16)), ACC[m]);    \
        }                                                                                                      \
    } while (0)
        if (UNP) {
            Q6_CHUNK(a0, vb_load(uc), 0);
            Q6_CHUNK(a1, vb_load(uc + CHUNK), 1);
            Q6_CHUNK(a0, vb_load(uc + 2 * CHUNK), 2);
            Q6_CHUNK(a1, vb_load(uc + 3 * CHUNK), 3);
        } else {
            const vb ql0 = vb_load(blk), ql1 = vb_load(blk + CHUNK);
            const vb h0 = q6_h(blk + 2 * CHUNK), h1 = q6_h(blk + 2 * CHUNK + 32);
            Q6_CHUNK(a0, q6_u_lo(ql0, h0), 0);
            Q6_CHUNK(a1, q6_u_hi(ql0, h0), 1);
            Q6_CHUNK(a0, q6_u_lo(ql1, h1), 2);
            Q6_CHUNK(a1, q6_u_hi(ql1, h1), 3);
        }
#undef Q6_CHUNK
    }
    for (int m = 0; m < R; m++) out[m] = vf_sum(vf_pin(vf_add(a0[m], a1[m]))); /* pinned: the sum as q6k_q8_row4's */
}

/* Batch 1: 4 weight rows at a time against the one input row, the activation loads (codes, x32 lanes, dx lanes)
 * shared by the 4 rows — alone, a row re-reads 3 activation bytes per weight from L2 (K = 8192: 72 KB of them per
 * row), which made it slower than the int8 path's 4-row tile.  Each row's products, chunk order and reduction are
 * q6k_q8_row's (vf_sum4 sums as vf_sum does): the same bits.  As in q8_q8_row4 the 4 rows are 4 interleaved streams,
 * so each step prefetches lines of each row of the tile PF_TILES ahead (a line per chunk). */
INLINE void q6k_q8_row4(const uint8_t *restrict w, const xprep_t *x, const int32_t *restrict x32, float out[4],
                        int64_t K) {
    const int64_t rowb = K / QK_K * Q6K_BYTES;
    vf a0[4], a1[4], sd[4];
    for (int r = 0; r < 4; r++) a0[r] = vf_zero(), a1[r] = vf_zero();
    for (int64_t s = 0; s < K / QK_K; s++) {
        const uint8_t *restrict blk = w + s * Q6K_BYTES; /* row r's super-block s is at blk + r * rowb */
        for (int r = 0; r < 4; r++) sd[r] = vf_pin(q6_scales(blk + r * rowb));
        /* half HF of the super-block: chunk 2 HF (its ql's low nibbles) into a0, chunk 2 HF + 1 (high) into a1 */
#define Q6_HALF4(HF)                                                                                           \
    do {                                                                                                       \
        const int64_t c_ = s * 4 + 2 * (HF);                                                                   \
        const int8_t *xr_ = x->xq + c_ * CHUNK;                                                                \
        const int32_t *xc_ = x32 + c_ * 16;                                                                    \
        const vf dx0_ = vf_load(x->dxl + c_ * 16), dx1_ = vf_load(x->dxl + c_ * 16 + 16);                      \
        for (int r = 0; r < 4; r++) {                                                                          \
            const uint8_t *br_ = blk + r * rowb;                                                               \
            __builtin_prefetch(br_ + 4 * PF_TILES * rowb + 2 * (HF) * CHUNK, 0, PF_LOC);                       \
            __builtin_prefetch(br_ + 4 * PF_TILES * rowb + (2 * (HF) + 1) * CHUNK, 0, PF_LOC);                 \
            const vb ql_ = vb_load(br_ + (HF) * CHUNK), h_ = q6_h(br_ + 2 * CHUNK + (HF) * 32);                \
            a0[r] = vf_fma(vf_cvt(q6_dot(q6_u_lo(ql_, h_), xr_, xc_)), vf_mul(vf_spread4(sd[r], 2 * (HF)), dx0_), \
                           a0[r]);                                                                             \
            a1[r] = vf_fma(vf_cvt(q6_dot(q6_u_hi(ql_, h_), xr_ + CHUNK, xc_ + 16)),                           \
                           vf_mul(vf_spread4(sd[r], 2 * (HF) + 1), dx1_), a1[r]);                              \
        }                                                                                                      \
    } while (0)
        Q6_HALF4(0);
        Q6_HALF4(1);
#undef Q6_HALF4
    }
    vf_sum4(vf_pin(vf_add(a0[0], a1[0])), vf_pin(vf_add(a0[1], a1[1])), vf_pin(vf_add(a0[2], a1[2])),
            vf_pin(vf_add(a0[3], a1[3])), out);
}

static void q6k_q8_rows(const uint8_t *restrict W, const xprep_t *x, const int32_t *x32, int x_bf16, void *y,
                        int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    const int64_t rowb = K / QK_K * Q6K_BYTES;
    int64_t n = n0;
    if (QSIMD && M == 1) /* portable C: every row through q6k_q8_row (TILE_Q8 says why) */
        for (; n + 4 <= n1; n += 4) {
            float out[4];
            q6k_q8_row4(W + n * rowb, x, x32, out, K);
            for (int r = 0; r < 4; r++) store_y(y, x_bf16, n + r, out[r]);
        }
    /* Past one tile of input rows: blocks of nb weight rows, each row unpacked once (the comment above
     * q6k_unpack_row), every tile over the block before the next; the tile's activations stay in cache across the
     * block's rows.  Without the buffer (allocation failed), the stored rows as at decode: the same bits. */
    const int64_t ub = Q6U_BYTES(K);
    const int64_t nb = L2_BLOCK / ub > 4 ? L2_BLOCK / ub : 4;
    uint8_t *buf = M > QTILE && n < n1 ? (uint8_t *)block_buf((size_t)(nb * ub)) : NULL;
    if (buf)
        for (int64_t b0 = n; b0 < n1; b0 += nb) {
            const int64_t b1 = b0 + nb < n1 ? b0 + nb : n1;
            for (int64_t r = b0; r < b1; r++) q6k_unpack_row(W + r * rowb, K, buf + (r - b0) * ub);
            for (int64_t m0 = 0; m0 < M; m0 += QTILE) {
                const int64_t mr = M - m0 < QTILE ? M - m0 : QTILE;
                for (int64_t r = b0; r < b1; r++) {
                    float out[QTILE];
#define Q6K_Q8U(R) q6k_q8_row(buf + (r - b0) * ub, x, x32, m0, out, K, R, 1)
                    TILE_Q8(mr, Q6K_Q8U)
#undef Q6K_Q8U
                    for (int64_t m = 0; m < mr; m++) store_y(y, x_bf16, (m0 + m) * N + r, out[m]);
                }
            }
        }
    else
        for (; n < n1; n++)
            for (int64_t m0 = 0; m0 < M; m0 += QTILE) { /* tiles over the (L1-resident) row */
                float out[QTILE];
                const int64_t mr = M - m0 < QTILE ? M - m0 : QTILE;
#define Q6K_Q8(R) q6k_q8_row(W + n * rowb, x, x32, m0, out, K, R, 0)
                TILE_Q8(mr, Q6K_Q8)
#undef Q6K_Q8
                for (int64_t m = 0; m < mr; m++) store_y(y, x_bf16, (m0 + m) * N + n, out[m]);
            }
}

#define X32_STACK 2048 /* lanes of x32 kept on the stack (M = 1, K = 8192) */

/* y[M, N] = x[M, K] @ dequant(W)^T for Q6_K blocks W [N, K / 256, 210] (K a multiple of 256), x rounded to int8
 * blocks of 32 (xprep, as q8_gemm_q8); y in x's dtype (fp32, or bf16 when x_bf16). */
static void pf_gemm(const void *W, const void *scales, const void *mins, int fmt, const void *xin, int x_bf16,
                    void *y, int64_t M, int64_t N, int64_t K, int64_t G, int q4, int q6);
static int pf_tiled_q6(void);

/* The row kernel for any M: every row's result the same bits whatever rows share the call (decode.c's fused step
 * takes it for all its rows, as it takes q8_gemm_q8 / q4_gemm_q8, so speculative verification rows equal plain decode
 * rows); q6k_gemm_q8 below switches past QTILE rows to the prefill tiles where they are built. */
void q6k_gemm_q8_rows(const uint8_t *restrict W, const void *xin, int x_bf16, void *y, int64_t M, int64_t N,
                      int64_t K) {
    _Alignas(64) unsigned char buf[XPREP_STACK];
    const xprep_t x = xprep(xin, x_bf16, M, K, QB, 0, buf, sizeof buf);
    int32_t stk[X32_STACK];
    const int64_t nl = K / 4; /* lanes per input row: 16 per chunk of 64 codes */
    int32_t *x32 = M * nl <= X32_STACK ? stk : (int32_t *)malloc(sizeof(int32_t) * M * nl);
    for (int64_t m = 0; m < M; m++) {
        const int8_t *q = x.xq + m * x.sq;
        for (int64_t l = 0; l < nl; l++)
            x32[m * nl + l] = -32 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
    }
#define Q6K_ROWS(n0, n1) q6k_q8_rows(W, &x, x32, x_bf16, y, M, N, K, n0, n1)
    SPLIT_ROWS(N, K, Q6K_ROWS);
#undef Q6K_ROWS
    if (x32 != stk) free(x32);
    if (x.mem != buf) free(x.mem);
}

void q6k_gemm_q8(const uint8_t *restrict W, const void *xin, int x_bf16, void *y, int64_t M, int64_t N, int64_t K) {
    if (M > QTILE && pf_tiled_q6()) { /* AVX-512 VNNI: the prefill GEMM's register tiles (pf_pack_q6) */
        pf_gemm(W, NULL, NULL, SF_F32, xin, x_bf16, y, M, N, K, QB, 0, 1);
        return;
    }
    q6k_gemm_q8_rows(W, xin, x_bf16, y, M, N, K);
}

/* ---------------------------------------------------------------- W8A8: int8 x int8 -> int32 GEMM, any M */

/* W8A8 (quant/activation.py): int8 weights W [N, K] with one scale per output channel sw [N] (fp32 or fp16), and
 * int8 activations rounded per token — one scale per row of x, sx = max|x_m| / 127 (clamped to FLT_MIN), "dynamic" —
 * or with one calibrated per-tensor scale sx = *input_scale ("static", codes clamped to +-127):
 *     xq[m, k] = clamp(rint(x[m, k] / sx[m]), -127, 127),   y[m, n] = (float)(sum_k xq[m, k] * W[n, k]) * (sx[m] * sw[n])
 * The integer sum is exact in int32 (|sum| <= 127^2 K), so its order does not matter: every path (VNNI vpdpbusd,
 * AVX2, plain C), every tile and every row count gives the same integer, and the epilogue is one convert and one
 * product per element, written as quant.activation.w8a8_linear_int_mm computes it (acc * (sx * sw)) — the same bits
 * as that torch._int_mm path, not only the same value up to rounding: the rounding divides exactly (a8_row) and
 * the scale product is pinned (f_pin), so -ffast-math neither reassociates it nor fuses it into the convert.
 *
 * Three paths, one integer result: up to A8_FEW_ROWS rows (decode) the row tiles below, the weights streamed with
 * software prefetch; past it on AVX-512 VNNI the 16-row weight panels (a8_rows_panel, after a8_rows); elsewhere:
 * Blocking, for M in the hundreds (prefill) as for decode rows: the N weight rows split over the threads; each
 * thread takes blocks of A8_NB weight rows (sized so a block of L2_BLOCK bytes stays in L2) and sweeps every
 * activation row over the block in tiles of 4 activation rows x 4 weight rows: 16 integer accumulators (VNNI: 16
 * zmm registers), per 64 bytes of K 4 weight and 4 activation loads for 16 vpdpbusd.  A tile's 4 activation rows
 * (4K bytes) stay in L1 across the block's weight tiles; the block's weights in L2 across all activation rows, so
 * each weight byte comes from memory once per call and each activation byte once per block.
 * On VNNI the weights enter vpdpbusd as w + 128 (unsigned, one xor per 64 bytes, amortised over the tile's 4 rows)
 * and each row's sum is corrected by -128 * sum_k xq[m, k] (a8_t.xs): the same integer.  Cost of the activation
 * rounding: one read of x, M*K bytes written, before the threads split the rows (rows in parallel past 64K). */

typedef struct {
    void *mem;
    int8_t *xq;  /* [M, kp] codes, zero-padded to whole 64-byte chunks */
    float *sx;   /* [M] */
    int32_t *xs; /* [M] sum of the row's codes */
    int64_t kp;
} a8_t;

INLINE float f_pin(float a) { /* a, opaque to the optimiser (see vf_pin) */
    __asm__("" : "+m"(a));
    return a;
}

/* One row's rounding, compiled without the fast-math licence to approximate a division: under -ffast-math GCC
 * divides vectors by a reciprocal estimate refined by a Newton step (x86 -mrecip's default) and clang may multiply
 * by a hoisted 1 / d, either of which rounds a quotient near k + 1/2 to the other side of it from the reference. */
PRECISE_MATH_BEGIN
static void a8_row(const float *restrict x, const float *input_scale, int64_t K, int8_t *restrict q, float *sx,
                   int32_t *xs) {
    float s;
    if (input_scale) {
        s = *input_scale;
    } else {
        float amax = 0.f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
        s = amax / 127.f;
        if (!(s >= 1.17549435e-38f)) s = 1.17549435e-38f; /* clamp_min(FLT_MIN), as the reference */
    }
    const float d = s;
    int32_t sum = 0;
    for (int64_t k = 0; k < K; k++) {
        float v = x[k] / d;
        v = v > 127.f ? 127.f : v < -127.f ? -127.f : v; /* clamping first rounds the same: the bounds are integers */
        q[k] = (int8_t)lrintf(v); /* the current mode, half to even, as torch.round (a convert instruction; rintf
                                   * under -ffast-math may become x + 2^23 - 2^23, which reassociates to x) */
        sum += q[k];
    }
    *sx = s, *xs = sum;
}
PRECISE_MATH_END

static a8_t a8_prep(const float *x, const float *input_scale, int64_t M, int64_t K, void *buf, size_t buf_bytes) {
    a8_t a;
    a.kp = (K + CHUNK - 1) / CHUNK * CHUNK;
    const size_t bytes = (size_t)M * (a.kp + 8);
    a.mem = bytes <= buf_bytes ? memset(buf, 0, bytes) : calloc(1, bytes); /* zeros: the chunks' padding */
    a.sx = (float *)a.mem, a.xs = (int32_t *)(a.sx + M), a.xq = (int8_t *)(a.xs + M);
#pragma omp parallel for if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++) a8_row(x + m * K, input_scale, K, a.xq + m * a.kp, a.sx + m, a.xs + m);
    return a;
}

/* the integer accumulator: 16 int32 lanes, + w . x per 4 bytes */
#if QSIMD == 512
typedef __m512i a8acc;
INLINE a8acc a8_zero(void) { return _mm512_setzero_si512(); }
INLINE int32_t a8_sum(a8acc a) { return _mm512_reduce_add_epi32(a); }
INLINE void a8_sum4(a8acc a, a8acc b, a8acc c, a8acc d, int32_t out[4]) { /* vf_sum4's tree, in integers */
    const __m512i ab = _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xEE));
    const __m512i cd = _mm512_add_epi32(_mm512_shuffle_i32x4(c, d, 0x44), _mm512_shuffle_i32x4(c, d, 0xEE));
    __m512i v = _mm512_add_epi32(_mm512_shuffle_i32x4(ab, cd, 0x88), _mm512_shuffle_i32x4(ab, cd, 0xDD));
    v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0x4E));
    v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0xB1));
    _mm_storeu_si128((__m128i *)out, _mm512_castsi512_si128(_mm512_permutexvar_epi32(
                                         _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v)));
}
#ifdef Q8_BIAS
INLINE a8acc a8_dot(a8acc acc, q8w_t w, const int8_t *x) { return _mm512_dpbusd_epi32(acc, w, vb_load(x)); }
#else
INLINE a8acc a8_dot(a8acc acc, q8w_t w, const int8_t *x) { return _mm512_add_epi32(acc, q8_dot(w, x, NULL)); }
#endif
#elif QSIMD == 256
typedef vi a8acc;
INLINE a8acc a8_zero(void) {
    a8acc r = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    return r;
}
INLINE int32_t a8_sum(a8acc a) {
    const __m256i s = _mm256_add_epi32(a.a, a.b);
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1));
    return _mm_cvtsi128_si32(r);
}
#ifdef Q8_BIAS
INLINE a8acc a8_dot(a8acc acc, q8w_t w, const int8_t *x) {
    a8acc r = {DPBUSD(acc.a, w.a, _mm256_loadu_si256((const __m256i *)x)),
               DPBUSD(acc.b, w.b, _mm256_loadu_si256((const __m256i *)x + 1))};
    return r;
}
#else
INLINE a8acc a8_dot(a8acc acc, q8w_t w, const int8_t *x) {
    const vi d = q8_dot(w, x, NULL);
    a8acc r = {_mm256_add_epi32(acc.a, d.a), _mm256_add_epi32(acc.b, d.b)};
    return r;
}
#endif
#else
typedef vi a8acc;
INLINE a8acc a8_zero(void) {
    a8acc r = {{0}};
    return r;
}
INLINE int32_t a8_sum(a8acc a) {
    int32_t s = 0;
    for (int l = 0; l < 16; l++) s += a.v[l];
    return s;
}
INLINE a8acc a8_dot(a8acc acc, q8w_t w, const int8_t *x) {
    const vi d = q8_dot(w, x, NULL);
    for (int l = 0; l < 16; l++) acc.v[l] += d.v[l];
    return acc;
}
#endif

#if QSIMD != 512
INLINE void a8_sum4(a8acc a, a8acc b, a8acc c, a8acc d, int32_t out[4]) {
    out[0] = a8_sum(a), out[1] = a8_sum(b), out[2] = a8_sum(c), out[3] = a8_sum(d);
}
#endif

/* R activation rows (m0..) x C weight rows (w, rows K bytes apart) -> the exact integer sums out[r][c]. */
INLINE void a8_tile(const int8_t *restrict w, int64_t K, const a8_t *a, int64_t m0, int32_t out[4][4], const int R,
                    const int C, const int PF) {
    a8acc acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = a8_zero();
    const int64_t nc = K / CHUNK;
    const int tail = (int)(K % CHUNK);
    for (int64_t ch = 0; ch <= nc; ch++) {
        if (ch == nc && !tail) break;
        q8w_t wp[4];
        for (int c = 0; c < C; c++) {
            const int8_t *wc = w + c * K + ch * CHUNK;
            if (PF) __builtin_prefetch(w + 4 * PF_TILES * K + (ch * 4 + c) * CHUNK, 0, PF_LOC); /* address order */
            wp[c] = q8_prep(ch < nc ? vb_load(wc) : vb_load_part(wc, tail)); /* padding: 0 (x is 0 there too) */
        }
        for (int r = 0; r < R; r++) {
            const int8_t *xr = a->xq + (m0 + r) * a->kp + ch * CHUNK;
            for (int c = 0; c < C; c++) acc[r][c] = a8_dot(acc[r][c], wp[c], xr);
        }
    }
    for (int r = 0; r < R; r++) { /* 4 sums in one tree (a quarter of the shuffles): integers, any order is exact */
        if (C == 4) a8_sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], out[r]);
        else
            for (int c = 0; c < C; c++) out[r][c] = a8_sum(acc[r][c]);
#ifdef Q8_BIAS
        for (int c = 0; c < C; c++) out[r][c] -= 128 * a->xs[m0 + r]; /* sum (w + 128) x - 128 sum x */
#endif
    }
}

#define A8_TILE_R(R, C, PF)                                                                                  \
    switch (R) {                                                                                             \
    case 1: a8_tile(w, K, a, m0, acc, 1, C, PF); break; case 2: a8_tile(w, K, a, m0, acc, 2, C, PF); break;  \
    case 3: a8_tile(w, K, a, m0, acc, 3, C, PF); break; default: a8_tile(w, K, a, m0, acc, 4, C, PF); break; \
    }

#define A8_FEW_ROWS 4 /* up to this many rows (one tile of activation rows): the streaming few-row path */

/* Weight rows n0..n1 of y for one thread (no OpenMP inside). */
static void a8_rows(const int8_t *restrict W, const void *scales, int scale_fmt, const a8_t *a, float *restrict y,
                    int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    /* Few rows (decode, M <= A8_FEW_ROWS: one tile of activation rows): each weight byte is used by one tile only,
     * so no L2 blocking; the weights stream once, 4 interleaved rows at a time, which the hardware prefetchers do
     * not follow: as in q8_q8_row4, each chunk step prefetches 4 lines of the 4-row tile PF_TILES ahead in address
     * order (batch 1, SmolLM2's linears streamed, 1 thread: clearly faster than without). */
    const int few = M <= A8_FEW_ROWS;
    int64_t nb = few ? n1 - n0 : L2_BLOCK / (K > 0 ? K : 1) / 4 * 4;
    nb = nb < 4 ? 4 : nb;
    for (int64_t b0 = n0; b0 < n1; b0 += nb) {
        const int64_t b1 = b0 + nb < n1 ? b0 + nb : n1;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mr = M - m0 < 4 ? M - m0 : 4;
            for (int64_t n = b0; n < b1; n += 4) {
                const int8_t *w = W + n * K;
                const int64_t nr = b1 - n < 4 ? b1 - n : 4;
                int32_t acc[4][4];
                if (nr == 4 && few) { A8_TILE_R(mr, 4, 1) }
                else if (nr == 4) { A8_TILE_R(mr, 4, 0) }
                else { A8_TILE_R(mr, 1, 0) } /* the last 1..3 rows of the block: one at a time */
                if (nr != 4)
                    for (int64_t c = 1; c < nr; c++) {
                        int32_t one[4][4];
                        const int8_t *w1 = w + c * K;
                        switch (mr) {
                        case 1: a8_tile(w1, K, a, m0, one, 1, 1, 0); break;
                        case 2: a8_tile(w1, K, a, m0, one, 2, 1, 0); break;
                        case 3: a8_tile(w1, K, a, m0, one, 3, 1, 0); break;
                        default: a8_tile(w1, K, a, m0, one, 4, 1, 0); break;
                        }
                        for (int64_t r = 0; r < mr; r++) acc[r][c] = one[r][0];
                    }
                for (int64_t r = 0; r < mr; r++)
                    for (int64_t c = 0; c < nr; c++) {
                        const float s = f_pin(a->sx[m0 + r] * scale_at(scales, scale_fmt, n + c));
                        y[(m0 + r) * N + n + c] = (float)acc[r][c] * s;
                    }
            }
        }
    }
}
#undef A8_TILE_R

#if QSIMD == 512 && defined(Q8_BIAS)
/* Batches (M > A8_FEW_ROWS) on AVX-512 VNNI: the weights repacked per L2 block into 16-row panels in
 * vpdpbusd's own layout, so no sum ever crosses lanes.  A panel holds, per 4 bytes of K (k4), the 16 rows' 4 weight
 * bytes (+ 128, unsigned) in one 64-byte vector; an activation row's 4 codes at k4 are one broadcast int32, and
 *     acc[m][lane] += sum_j (w[n0 + lane][4 k4 + j] + 128) * xq[m][4 k4 + j]
 * accumulates 16 output channels of row m in the lanes of one register, started at -128 * sum_k xq[m, k] (a8_t.xs):
 * the same exact integers as a8_tile, with no horizontal sum and a vector epilogue (16 outputs: one convert, the
 * pinned scale product sx[m] * sw[n], one multiply, one store).  Register tile: A8P_MR activation rows x A8P_NP
 * panels (8 x 2: 16 accumulators, 2 weight loads and 8 broadcasts per 16 vpdpbusd), the block's panels (in L2)
 * swept once per tile of activation rows (in L1).  The repack — 16 rows x 64 bytes loaded, + 128, a 16 x 16 int32
 * transpose (64 shuffles), 16 stores — costs about what one 8-row tile's products over the same bytes cost, hence
 * the row threshold (more than A8_FEW_ROWS: on SmolLM2's linears, 1 thread, panels lose to the few-row path up to 4
 * rows and win clearly from 5); it reads each weight byte once per call, as the row-tile path does. */
#ifndef A8P_MR
#define A8P_MR 8
#endif
#ifndef A8P_NP
#define A8P_NP 2
#endif

/* Rows r0..r1 (r1 - r0 <= 16; missing rows are zeros) of W [., K] -> one panel: kp / 4 vectors of 16 lanes x 4 bytes,
 * each byte + 128.  K's tail past the last whole 64 bytes is read masked (padding: 128, met by zero activations). */
static void a8_pack_panel(const int8_t *restrict W, int64_t K, int64_t kp, int64_t r0, int64_t r1,
                          int8_t *restrict dst) {
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int64_t kc = 0; kc < kp; kc += 64) {
        const int64_t left = K - kc;
        const __mmask64 km = left >= 64 ? ~0ULL : left <= 0 ? 0ULL : (1ULL << left) - 1;
        __m512i r[16], t[16], u[16];
        for (int i = 0; i < 16; i++) {
            const int8_t *src = W + (r0 + i) * K + kc;
            __builtin_prefetch(W + (r0 + 16) * K + (kc / 64 * 16 + i) * 64, 0, PF_LOC); /* the next panel's lines */
            r[i] = _mm512_xor_si512(r0 + i < r1 ? _mm512_maskz_loadu_epi8(km, src) : _mm512_setzero_si512(), bias);
        }
        for (int i = 0; i < 8; i++) { /* lane L of t[2i], t[2i+1]: rows 2i, 2i+1 interleaved, columns 4L..4L+3 */
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 4; i++) { /* lane L of u[4i + c]: rows 4i..4i+3 at column 4L + c */
            u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        int8_t *d = dst + kc * 16;
        for (int c = 0; c < 4; c++) { /* column 4L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c] */
            const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
            const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
            const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
            const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
            _mm512_store_si512((__m512i *)(d + (0 + c) * 64), _mm512_shuffle_i32x4(v0, w0, 0x88));
            _mm512_store_si512((__m512i *)(d + (4 + c) * 64), _mm512_shuffle_i32x4(v0, w0, 0xDD));
            _mm512_store_si512((__m512i *)(d + (8 + c) * 64), _mm512_shuffle_i32x4(v1, w1, 0x88));
            _mm512_store_si512((__m512i *)(d + (12 + c) * 64), _mm512_shuffle_i32x4(v1, w1, 0xDD));
        }
    }
}

/* R activation rows (m0..) x P panels (pan, kp * 16 bytes apart, output channels n..; nv valid in the last) -> y. */
INLINE void a8_panel_tile(const int8_t *restrict pan, int64_t kp, int64_t K, const a8_t *a, int64_t m0,
                          const void *scales, int scale_fmt, float *restrict y, int64_t N, int64_t n, int nv,
                          const int R, const int P) {
    __m512i acc[A8P_MR][A8P_NP];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++) acc[r][q] = _mm512_set1_epi32(-128 * a->xs[m0 + r]);
    const int64_t nk4 = (K + 3) / 4;
    const int8_t *xr = a->xq + m0 * a->kp;
    for (int64_t k4 = 0; k4 < nk4; k4++) {
        __m512i w[A8P_NP];
        for (int q = 0; q < P; q++) w[q] = _mm512_load_si512((const __m512i *)(pan + q * kp * 16 + k4 * 64));
        for (int r = 0; r < R; r++) {
            int32_t xv;
            memcpy(&xv, xr + r * a->kp + 4 * k4, 4);
            const __m512i xb = _mm512_set1_epi32(xv);
            for (int q = 0; q < P; q++) acc[r][q] = _mm512_dpbusd_epi32(acc[r][q], w[q], xb);
        }
    }
    for (int q = 0; q < P; q++) {
        const int cnt = q == P - 1 ? nv : 16;
        const __mmask16 km = (__mmask16)(cnt >= 16 ? 0xFFFFu : (1u << cnt) - 1);
        const __m512 sw = vf_load_h(scales, scale_fmt, n + 16 * q, cnt);
        for (int r = 0; r < R; r++) {
            __m512 s = _mm512_mul_ps(_mm512_set1_ps(a->sx[m0 + r]), sw);
            __asm__("" : "+v"(s)); /* sx * sw rounded first, as the reference (see f_pin) */
            _mm512_mask_storeu_ps(y + (m0 + r) * N + n + 16 * q, km, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][q]), s));
        }
    }
}

#define A8P_R(R, P)                                                                                         \
    switch (R) {                                                                                             \
    case 1: a8_panel_tile(pan, kp, K, a, m0, scales, scale_fmt, y, N, n, nv, 1, P); break;                   \
    case 2: a8_panel_tile(pan, kp, K, a, m0, scales, scale_fmt, y, N, n, nv, 2, P); break;                   \
    case 3: a8_panel_tile(pan, kp, K, a, m0, scales, scale_fmt, y, N, n, nv, 3, P); break;                   \
    case 4: a8_panel_tile(pan, kp, K, a, m0, scales, scale_fmt, y, N, n, nv, 4, P); break;                   \
    case 5: a8_panel_tile(pan, kp, K, a, m0, scales, scale_fmt, y, N, n, nv, 5, P); break;                   \
    case 6: a8_panel_tile(pan, kp, K, a, m0, scales, scale_fmt, y, N, n, nv, 6, P); break;                   \
    case 7: a8_panel_tile(pan, kp, K, a, m0, scales, scale_fmt, y, N, n, nv, 7, P); break;                   \
    default: a8_panel_tile(pan, kp, K, a, m0, scales, scale_fmt, y, N, n, nv, 8, P); break;                  \
    }

/* Weight rows n0..n1 of y for one thread (no OpenMP inside), through panels; 0 when the buffer cannot be had. */
static int a8_rows_panel(const int8_t *restrict W, const void *scales, int scale_fmt, const a8_t *a,
                         float *restrict y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    const int64_t kp = a->kp;
    int64_t nb = L2_BLOCK / kp / 16 * 16;
    nb = nb < 16 ? 16 : nb;
    int8_t *buf = (int8_t *)block_buf((size_t)nb * kp); /* nb = max(16, L2_BLOCK / kp rounded down to 16 rows) */
    if (!buf) return 0;
    for (int64_t b0 = n0; b0 < n1; b0 += nb) {
        const int64_t b1 = b0 + nb < n1 ? b0 + nb : n1;
        for (int64_t r = b0; r < b1; r += 16)
            a8_pack_panel(W, K, kp, r, r + 16 < b1 ? r + 16 : b1, buf + (r - b0) * kp);
        for (int64_t m0 = 0; m0 < M; m0 += A8P_MR) {
            const int64_t mr = M - m0 < A8P_MR ? M - m0 : A8P_MR;
            for (int64_t n = b0; n < b1; n += 16 * A8P_NP) {
                const int8_t *pan = buf + (n - b0) * kp;
                const int64_t left = b1 - n;
                const int np = left >= 16 * A8P_NP ? A8P_NP : (int)((left + 15) / 16);
                const int nv = (int)(left - 16 * (np - 1) < 16 ? left - 16 * (np - 1) : 16);
                switch (np) { /* the block's last tile: fewer panels, the last one ragged */
                case 1: A8P_R(mr, 1) break;
#if A8P_NP > 2
                case 2: A8P_R(mr, 2) break;
                case 3: A8P_R(mr, A8P_NP > 3 ? 3 : A8P_NP) break;
#endif
                default: A8P_R(mr, A8P_NP) break;
                }
            }
        }
    }
    return 1;
}
#undef A8P_R
#endif

/* y [M, N] fp32 = W8A8(x [M, K] fp32, W [N, K] int8, sw [N]); input_scale: one fp32 (static) or NULL (per token). */
void w8a8_gemm(const int8_t *restrict W, const void *scales, int scale_fmt, const float *input_scale,
               const float *x, float *y, int64_t M, int64_t N, int64_t K) {
    _Alignas(64) unsigned char buf[XPREP_STACK];
    const a8_t a = a8_prep(x, input_scale, M, K, buf, sizeof buf);
    const a8_t *ap = &a;
#if QSIMD == 512 && defined(Q8_BIAS)
#define A8_ROWS(n0, n1)                                                                                      \
    if (M <= A8_FEW_ROWS || !a8_rows_panel(W, scales, scale_fmt, ap, y, M, N, K, n0, n1))               \
    a8_rows(W, scales, scale_fmt, ap, y, M, N, K, n0, n1)
#else
#define A8_ROWS(n0, n1) a8_rows(W, scales, scale_fmt, ap, y, M, N, K, n0, n1)
#endif
    SPLIT_ROWS(N, M * K, A8_ROWS);
#undef A8_ROWS
    if (a.mem != buf) free(a.mem);
}

/* The activation rounding alone (tests compare it with quant.activation.quantize_activation_int8): codes [M, K],
 * scales [M]. */
void w8a8_quantize(const float *x, const float *input_scale, int64_t M, int64_t K, int8_t *codes, float *scales) {
    const a8_t a = a8_prep(x, input_scale, M, K, NULL, 0);
    for (int64_t m = 0; m < M; m++) memcpy(codes + m * K, a.xq + m * a.kp, K), scales[m] = a.sx[m];
    free(a.mem);
}

/* 1 when compiled with OpenMP (rows split across threads), else 0. */
int quant_built_with_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Which integer dot product the int8-activation path compiled to: 4 AVX-512 VNNI (512-bit), 3 VNNI on 256-bit
 * registers, 2 vpmaddubsw (AVX2 or AVX-512BW), 0 portable C. */
int quant_simd_level(void) {
#if QSIMD == 512 && defined(__AVX512VNNI__)
    return 4;
#elif QSIMD == 256 && defined(DPBUSD)
    return 3;
#elif QSIMD
    return 2;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------ prefill: x in Q8 blocks x Q8_0 / Q4_x / Q6_K, tiled */

/* Many rows (prefill, M in the hundreds) of block-quantized weights: llama.cpp's Q8_0 x Q8_0 / Q4_x x Q8_0 scheme as
 * a register-tiled GEMM.  x is rounded per row and block of 32 (pf_round_row: dx = max|x| / 127, xq = rint(x / dx)
 * computed as x * (1 / dx), quant.q8_activation_ref's rounding bit for bit) and per block b, row m, column n
 *     Q8_0:  y[m, n] += (float)(sum_j q[n, 32b + j] xq[m, 32b + j]) * (d[n, b] * dx[m, b])
 *     Q4_x:  y[m, n] += (float)(sum_j q[n, 32b + j] xq[m, 32b + j]) * (d[n, b] * dx[m, b]) + mn[n, b] * xs[m, b]
 * with xs[m, b] = dx[m, b] * sum_j xq[m, 32b + j] (the min's term, once per activation block): the reference applied
 * to xhat = dx * xq, the integer block sums exact, one fp32 rounding per product and per accumulation.
 *
 * The layout is what makes it fast.  Threads take panels of PF_NR = 32 weight columns; each panel is copied once
 * per call into a thread-local buffer (Q8_0: 32 K bytes, Q4: 16 K bytes, + 128 / 256 bytes of fp32 scales and mins
 * per block: K = 8192 is 288 KB, an L2's worth) in which one 64-byte load holds 4 consecutive k of 16 columns, the
 * operand order of vpdpbusd: lane c sums 4 products for column c.  A tile of PF_MR activation rows x 32 columns
 * keeps 2 PF_MR int32 accumulators (the block's sums) and 2 PF_MR fp32 ones in zmm registers; each activation
 * 4-byte group is broadcast from memory into the instruction, each weight load serves PF_MR rows, and a block's
 * epilogue (convert, scale product, FMA: 3 instructions per 8 vpdpbusd) runs in the lanes of its columns with no
 * horizontal sums.  Q8_0 weights enter vpdpbusd's unsigned operand as q + 128 (xor'ed at the copy) and each
 * block's sum starts at -128 * sum_j xq (xc); Q4 nibbles are unsigned as they are: a 64-byte load of the copy gives
 * k 4i..4i+3 in its low nibbles and k 16+4i.. in its high ones, as the Q4_1 packing stores a block.
 * The copy costs one read of the weights per call (the GEMM reads each weight byte M / PF_MR times from L2), no
 * memory at rest.  Rounding x: one read of x, M * K bytes written, rows split over the threads.
 * Without AVX-512 VNNI the same arithmetic in plain C (correct everywhere, slow: quant.py routes prefill here only
 * when quant_prefill_tiled() says the tiles are compiled). */
#define PF_NR 32 /* weight columns per panel: 2 zmm of 16 lanes */
#ifndef PF_MR
#define PF_MR 4 /* activation rows per register tile: 16 accumulators + 2 weights + 2 scales of 32 zmm */
#endif
#if QSIMD == 512 && defined(__AVX512VNNI__)
#define PF_TILED 1
#else
#define PF_TILED 0
#endif

typedef struct {
    int8_t *xq;  /* [M, K] codes */
    float *dx;   /* [M, nb] block steps */
    float *xs;   /* [M, nb] dx * sum of the block's codes (the term a Q4 min multiplies) */
    int32_t *xc; /* [M, nb] -128 * sum of the block's codes (Q8_0: the bias of the weights' unsigned operand) */
    int32_t *xc16; /* [M, 2 nb] or NULL: -32 * sum of each 16 codes (Q6_K: the bias of its unsigned u = q + 32) */
} pfx_t;

/* One row's blocks rounded, without the fast-math licence (as a8_row: a reciprocal estimate or a hoisted division
 * would round a quotient near k + 1/2 differently from the reference). */
PRECISE_MATH_BEGIN
static void pf_round_row(const void *xin, int x_bf16, int64_t m, int64_t K, const pfx_t *p) {
    const int64_t nb = K / QB;
    for (int64_t b = 0; b < nb; b++) {
        float xb[QB], amax = 0.f;
        for (int j = 0; j < QB; j++) {
            const int64_t i = m * K + b * QB + j;
            xb[j] = x_bf16 ? bf2f(((const uint16_t *)xin)[i]) : ((const float *)xin)[i];
            const float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int32_t s = 0;
        for (int j = 0; j < QB; j++) {
            const int8_t q = (int8_t)rintf(xb[j] * id);
            p->xq[m * K + b * QB + j] = q;
            s += q;
        }
        p->dx[m * nb + b] = d, p->xs[m * nb + b] = d * (float)s, p->xc[m * nb + b] = -128 * s;
        if (p->xc16)
            for (int h = 0; h < 2; h++) {
                int32_t s16 = 0;
                for (int j = 16 * h; j < 16 * h + 16; j++) s16 += p->xq[m * K + b * QB + j];
                p->xc16[(m * nb + b) * 2 + h] = -32 * s16;
            }
    }
}
PRECISE_MATH_END

/* Panel n0 .. n0 + 32 (nv real columns, the rest zero weights and scales) into the tiled copy.  Q8_0 (q4 = 0):
 * wp[b][i][v] = 64 bytes, byte 4c + t = q[n0 + 16v + c, 32b + 4i + t] + 128 (i < 8).  Q4 (q4 = 1): wp[b][i][v] = 64
 * bytes, byte 4c + t = packed byte 16b + 4i + t of row n0 + 16v + c (i < 4).  sp / mp [nb][32]: d and m per block. */
static void pf_pack(const void *W, const void *scales, const void *mins, int fmt, int q4, int64_t n0, int nv,
                    int64_t K, int64_t G, uint8_t *restrict wp, float *restrict sp, float *restrict mp) {
    const int64_t nb = K / QB, ng = K / G, bpg = G / QB, rowb = q4 ? K / 2 : K, steps = q4 ? 4 : 8;
    for (int c = 0; c < PF_NR; c++) {
        const uint8_t *row = (const uint8_t *)W + (n0 + c) * rowb;
        const int v = c / 16, l = c % 16;
        for (int64_t b = 0; b < nb; b++)
            for (int64_t i = 0; i < steps; i++) {
                uint32_t word = 0; /* a padding column: code 0 (biased: 128) */
                if (c < nv) memcpy(&word, row + b * (q4 ? 16 : 32) + 4 * i, 4);
                if (!q4) word ^= 0x80808080u;
                memcpy(wp + b * steps * 128 + i * 128 + v * 64 + 4 * l, &word, 4);
            }
    }
    for (int c = 0; c < PF_NR; c++) /* by groups: no integer division per block */
        for (int64_t g = 0; g < ng; g++) {
            const float d = c < nv ? scale_at(scales, fmt, (n0 + c) * ng + g) : 0.f;
            const float m = c < nv && q4 ? q4_min(mins, scales, fmt, (n0 + c) * ng + g) : 0.f;
            for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
                sp[b * PF_NR + c] = d;
                if (q4) mp[b * PF_NR + c] = m;
            }
        }
}

#if PF_TILED
INLINE __m512i pf_bcast(const int8_t *p) { /* 4 codes into every lane (folds into vpdpbusd's {1to16} operand) */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* R (1..PF_MR, a constant) activation rows from m0 over one panel: out[r][32]. */
INLINE void pf_tile(const uint8_t *restrict wp, const float *restrict sp, const float *restrict mp, const pfx_t *x,
                    int64_t m0, int64_t K, float out[PF_MR][PF_NR], const int R, const int Q4) {
    const int64_t nb = K / QB;
    __m512 f0[PF_MR], f1[PF_MR];
    for (int r = 0; r < R; r++) f0[r] = _mm512_setzero_ps(), f1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i a0[PF_MR], a1[PF_MR];
        const int8_t *xb = x->xq + m0 * K + b * QB;
        for (int r = 0; r < R; r++)
            a0[r] = a1[r] = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(x->xc[(m0 + r) * nb + b]);
        if (Q4) {
            const uint8_t *wb = wp + b * 512;
            for (int i = 0; i < 4; i++) {
                const __m512i w0 = _mm512_loadu_si512(wb + i * 128), w1 = _mm512_loadu_si512(wb + i * 128 + 64);
                const __m512i l0 = vb_nib_lo(w0), l1 = vb_nib_lo(w1), h0 = vb_nib_hi(w0), h1 = vb_nib_hi(w1);
                for (int r = 0; r < R; r++) {
                    const __m512i xl = pf_bcast(xb + r * K + 4 * i), xh = pf_bcast(xb + r * K + 16 + 4 * i);
                    a0[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a0[r], l0, xl), h0, xh);
                    a1[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a1[r], l1, xl), h1, xh);
                }
            }
        } else {
            const uint8_t *wb = wp + b * 1024;
            for (int i = 0; i < 8; i++) {
                const __m512i w0 = _mm512_loadu_si512(wb + i * 128), w1 = _mm512_loadu_si512(wb + i * 128 + 64);
                for (int r = 0; r < R; r++) {
                    const __m512i xv = pf_bcast(xb + r * K + 4 * i);
                    a0[r] = _mm512_dpbusd_epi32(a0[r], w0, xv);
                    a1[r] = _mm512_dpbusd_epi32(a1[r], w1, xv);
                }
            }
        }
        const __m512 s0 = _mm512_loadu_ps(sp + b * PF_NR), s1 = _mm512_loadu_ps(sp + b * PF_NR + 16);
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(x->dx[(m0 + r) * nb + b]);
            f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), _mm512_mul_ps(s0, dx), f0[r]);
            f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[r]), _mm512_mul_ps(s1, dx), f1[r]);
        }
        if (Q4) {
            const __m512 n0 = _mm512_loadu_ps(mp + b * PF_NR), n1 = _mm512_loadu_ps(mp + b * PF_NR + 16);
            for (int r = 0; r < R; r++) {
                const __m512 xs = _mm512_set1_ps(x->xs[(m0 + r) * nb + b]);
                f0[r] = _mm512_fmadd_ps(n0, xs, f0[r]);
                f1[r] = _mm512_fmadd_ps(n1, xs, f1[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], f0[r]), _mm512_storeu_ps(out[r] + 16, f1[r]);
}

/* GGUF Q6_K (q6k_gemm_q8 past one tile of rows, on these builds): each panel column is unpacked (q6k_unpack_row:
 * u = q + 32 in 0..63, and d * sc per 16 weights) and laid out as the Q8_0 copy is, u unsigned as it is: wp[b][i][v]
 * 64 bytes, byte 4c + t = u[n0 + 16v + c, 32b + 4i + t]; sp [2 nb][32] the d * sc of each 16 weights.  Per block
 * of 32 and row, each half of 16 (its own weight scale) sums in int32 from -32 * sum of its 16 codes (xc16), so it
 * ends at sum q * xq exactly; then f += (float)sum * (s * dx): the reference on xhat up to fp32 summation order (one
 * rounding per 16-weight term), not the decode kernel's order.  tmp: Q6U_BYTES(K) bytes. */
static void pf_pack_q6(const uint8_t *W, int64_t n0, int nv, int64_t K, uint8_t *restrict wp, float *restrict sp,
                       uint8_t *restrict tmp) {
    const int64_t nb = K / QB, rowb = K / QK_K * Q6K_BYTES;
    const float *sd = (const float *)(tmp + K);
    for (int c = 0; c < PF_NR; c++) {
        const int v = c / 16, l = c % 16;
        if (c < nv) q6k_unpack_row(W + (n0 + c) * rowb, K, tmp);
        else memset(tmp, 0, (size_t)Q6U_BYTES(K)); /* a padding column: u = 0, scale 0 */
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < 8; i++) memcpy(wp + b * 1024 + i * 128 + v * 64 + 4 * l, tmp + b * QB + 4 * i, 4);
        for (int64_t g = 0; g < 2 * nb; g++) sp[g * PF_NR + c] = sd[g];
    }
}

INLINE void pf_tile_q6(const uint8_t *restrict wp, const float *restrict sp, const pfx_t *x, int64_t m0, int64_t K,
                       float out[PF_MR][PF_NR], const int R) {
    const int64_t nb = K / QB;
    __m512 f0[PF_MR], f1[PF_MR];
    for (int r = 0; r < R; r++) f0[r] = _mm512_setzero_ps(), f1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xb = x->xq + m0 * K + b * QB;
        for (int h = 0; h < 2; h++) {
            __m512i a0[PF_MR], a1[PF_MR];
            for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_set1_epi32(x->xc16[((m0 + r) * nb + b) * 2 + h]);
            const uint8_t *wb = wp + b * 1024 + h * 512;
            for (int i = 0; i < 4; i++) {
                const __m512i w0 = _mm512_loadu_si512(wb + i * 128), w1 = _mm512_loadu_si512(wb + i * 128 + 64);
                for (int r = 0; r < R; r++) {
                    const __m512i xv = pf_bcast(xb + r * K + 16 * h + 4 * i);
                    a0[r] = _mm512_dpbusd_epi32(a0[r], w0, xv);
                    a1[r] = _mm512_dpbusd_epi32(a1[r], w1, xv);
                }
            }
            const float *sh = sp + (2 * b + h) * PF_NR;
            const __m512 s0 = _mm512_loadu_ps(sh), s1 = _mm512_loadu_ps(sh + 16);
            for (int r = 0; r < R; r++) {
                const __m512 dx = _mm512_set1_ps(x->dx[(m0 + r) * nb + b]);
                f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), _mm512_mul_ps(s0, dx), f0[r]);
                f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[r]), _mm512_mul_ps(s1, dx), f1[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], f0[r]), _mm512_storeu_ps(out[r] + 16, f1[r]);
}
#define PF_TILE(R)                                                                                             \
    do {                                                                                                       \
        if (Q6) pf_tile_q6(wp, sp, x, m0, K, out, R);                                                          \
        else pf_tile(wp, sp, mp, x, m0, K, out, R, Q4);                                                        \
    } while (0)
#else
/* The portable twin: the same products, block sums and per-block scaling, one column at a time. */
static void pf_tile_c(const uint8_t *restrict wp, const float *restrict sp, const float *restrict mp, const pfx_t *x,
                      int64_t m0, int64_t K, float out[PF_MR][PF_NR], int R, int Q4) {
    const int64_t nb = K / QB;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PF_NR; c++) {
            const int v = c / 16, l = c % 16;
            float f = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *xb = x->xq + (m0 + r) * K + b * QB;
                int32_t s = Q4 ? 0 : x->xc[(m0 + r) * nb + b];
                for (int i = 0; i < (Q4 ? 4 : 8); i++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t u = wp[b * (Q4 ? 512 : 1024) + i * 128 + v * 64 + 4 * l + t];
                        if (Q4) s += (u & 0x0F) * xb[4 * i + t] + (u >> 4) * xb[16 + 4 * i + t];
                        else s += u * xb[4 * i + t];
                    }
                const float dx = x->dx[(m0 + r) * nb + b];
                f += (float)s * (sp[b * PF_NR + c] * dx);
                if (Q4) f += mp[b * PF_NR + c] * x->xs[(m0 + r) * nb + b];
            }
            out[r][c] = f;
        }
}
#define PF_TILE(R) pf_tile_c(wp, sp, mp, x, m0, K, out, R, Q4)
#endif

/* Panels p0 .. p1 of one thread: copy, then every tile of activation rows over it.  Q6 (tiled builds only): W is
 * Q6_K blocks (sp then spans sp and mp: 2 nb x 32 scales). */
static void pf_panels(const void *W, const void *scales, const void *mins, int fmt, const pfx_t *x, int x_bf16,
                      void *y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t p0, int64_t p1, const int Q4,
                      const int Q6) {
    const int64_t nb = K / QB;
    const size_t wbytes = (size_t)(nb * (Q4 ? 512 : 1024) + 2 * nb * PF_NR * sizeof(float));
    uint8_t *wp = aligned_alloc(64, wbytes + (Q6 ? (size_t)Q6U_BYTES(K) : 0));
    float *sp = (float *)(wp + nb * (Q4 ? 512 : 1024)), *mp = sp + nb * PF_NR;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * PF_NR;
        const int nv = N - n0 < PF_NR ? (int)(N - n0) : PF_NR;
#if PF_TILED
        if (Q6) pf_pack_q6((const uint8_t *)W, n0, nv, K, wp, sp, wp + wbytes);
        else
#endif
        pf_pack(W, scales, mins, fmt, Q4, n0, nv, K, G, wp, sp, mp);
        for (int64_t m0 = 0; m0 < M; m0 += PF_MR) {
            _Alignas(64) float out[PF_MR][PF_NR];
            const int64_t mr = M - m0 < PF_MR ? M - m0 : PF_MR;
#if PF_TILED
            switch (mr) {
            case 1: PF_TILE(1); break; case 2: PF_TILE(2); break; case 3: PF_TILE(3); break;
#if PF_MR > 4
            case 4: PF_TILE(4); break; case 5: PF_TILE(5); break;
#endif
            default: PF_TILE(PF_MR);
            }
#else
            PF_TILE((int)mr);
#endif
            for (int64_t r = 0; r < mr; r++)
                for (int c = 0; c < nv; c++) store_y(y, x_bf16, (m0 + r) * N + n0 + c, out[r][c]);
        }
    }
    free(wp);
}

/* y [M, N] = xhat [M, K] @ dequant(W)^T for Q8_0 (q4 = 0: W int8 [N, K], scales [N, K / G]) or Q4_x (q4 = 1: W the
 * Q4_1 packing [N, K / 2], scales and mins [N, K / G]); K and G multiples of 32.  Rounding x, then the panels, in
 * one parallel region (a barrier between); the panels are split as split.h splits GEMV rows (a late thread's taken
 * over). */
static void pf_gemm(const void *W, const void *scales, const void *mins, int fmt, const void *xin, int x_bf16,
                    void *y, int64_t M, int64_t N, int64_t K, int64_t G, int q4, int q6) {
    const int64_t nb = K / QB, np = (N + PF_NR - 1) / PF_NR, ex = q6 ? 20 : 12; /* per row and block: dx xs xc xc16 */
    void *mem = malloc((size_t)(M * K + M * nb * ex));
    const pfx_t x = {(int8_t *)mem + M * nb * ex, (float *)mem, (float *)mem + M * nb, (int32_t *)mem + 2 * M * nb,
                     q6 ? (int32_t *)mem + 3 * M * nb : NULL};
    SPLIT_DECLARE(np, 1)
#define PF_PANELS(p0, p1)                                                                                      \
    do {                                                                                                       \
        if (q6) pf_panels(W, scales, mins, fmt, &x, x_bf16, y, M, N, K, G, p0, p1, 0, 1);                     \
        else if (q4) pf_panels(W, scales, mins, fmt, &x, x_bf16, y, M, N, K, G, p0, p1, 1, 0);                \
        else pf_panels(W, scales, mins, fmt, &x, x_bf16, y, M, N, K, G, p0, p1, 0, 0);                        \
    } while (0)
#pragma omp parallel num_threads(T_) if (M * N * K >= (1 << 22))
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int64_t m = M * t / T; m < M * (t + 1) / T; m++) pf_round_row(xin, x_bf16, m, K, &x);
#pragma omp barrier
        SPLIT_TAKE(PF_PANELS)
    }
#undef PF_PANELS
    free(mem);
}

void q8_gemm_prefill(const int8_t *W, const void *scales, int scale_fmt, const void *xin, int x_bf16, void *y,
                     int64_t M, int64_t N, int64_t K, int64_t G) {
    pf_gemm(W, scales, NULL, scale_fmt, xin, x_bf16, y, M, N, K, G, 0, 0);
}

void q4_gemm_prefill(const uint8_t *P, const void *scales, const void *mins, int scale_fmt, const void *xin,
                     int x_bf16, void *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    pf_gemm(P, scales, mins, scale_fmt, xin, x_bf16, y, M, N, K, G, 1, 0);
}

/* The prefill GEMM's rounding of x alone: codes [M, K] int8, dx [M, K / 32] (to test against the reference). */
void q8_prefill_round(const void *xin, int x_bf16, int64_t M, int64_t K, int8_t *codes, float *dx) {
    const int64_t nb = K / QB;
    float *xs = malloc(sizeof(float) * M * nb);
    int32_t *xc = malloc(sizeof(int32_t) * M * nb);
    const pfx_t x = {codes, dx, xs, xc, NULL};
    for (int64_t m = 0; m < M; m++) pf_round_row(xin, x_bf16, m, K, &x);
    free(xs), free(xc);
}

/* 1 when the prefill GEMM runs on its AVX-512 VNNI register tiles, 0 when on the portable C twin. */
int quant_prefill_tiled(void) { return PF_TILED; }
static int pf_tiled_q6(void) { return PF_TILED; }
