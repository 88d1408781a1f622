/* Portability check of the native CPU kernels: every compiler and target the package may meet (gcc / clang, x86-64
 * with and without AVX, aarch64 with and without dotprod; see tests/kernels/test_native_portability.py) builds this
 * one program, which runs the main kernels on fixed pseudo-random inputs and compares each result with a plain
 * scalar reference computed here in double precision.  It prints one line per check and exits 1 when any differs
 * beyond its tolerance.
 *
 * Build: cc -O3 -ffast-math [-march=...] [-fopenmp] -I minillm/kernels/cpu/csrc check_kernels.c -lm
 * (the library's own flags: a bug that only the vectoriser or -ffast-math exposes shows here too).
 *
 * Tolerances: an fp32 dot product of K terms summed in another order moves by a few eps (6e-8) times the sum of the
 * terms' magnitudes |terms| (here K <= 576: worst case K * eps ~ 3.5e-5, typical sqrt(K) * eps ~ 1.5e-6), so sums
 * are held to SUM_RTOL * |terms|; a bf16 store adds its rounding, half an ulp = 2^-8 of the value.  A wrong nibble,
 * scale, block layout, head or tail moves a result by a sizeable fraction of |terms|: far outside. */
#include "decode.c" /* quant.c + native.c + the fused step: the one translation unit of the library's fused build */

#include <stdio.h>

#define SUM_RTOL 2e-5 /* of the sum of |terms|: fp32 summation order, see above */
#define BF16_RTOL (1.0 / 256) /* of |value|: one rounding to bf16 (8 significant bits) */

/* ---------------------------------------------------------------- inputs and comparison */

/* xorshift64: the same numbers on every compiler and machine (no libc rand). Uniform in [-1, 1). */
static float urand(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (float)(*s >> 40) * (2.f / 16777216.f) - 1.f;
}

static uint32_t irand(uint64_t *s, uint32_t n) { /* uniform in [0, n) */
    return (uint32_t)((urand(s) + 1.f) * 0.5f * (float)n) % n;
}

static float *frand(uint64_t *s, int64_t n) {
    float *a = malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) a[i] = urand(s);
    return a;
}

/* A normal IEEE half: sign (when signed), exponent -6..-1, random mantissa; decoded here without quant.c's h2f. */
static uint16_t half_rand(uint64_t *s, int is_signed) {
    uint16_t sign = is_signed && urand(s) < 0.f ? 0x8000u : 0u;
    return (uint16_t)(sign | (uint16_t)((9 + irand(s, 6)) << 10) | (uint16_t)irand(s, 1024));
}

static double half_value(uint16_t h) {
    double v = ldexp(1.0 + (h & 0x3ffu) / 1024.0, (int)((h >> 10) & 0x1fu) - 15);
    return h & 0x8000u ? -v : v;
}

/* Scales (or mins) [n] as fp16 bits or as the same values in fp32; want [n] gets the values. */
static void *scales_rand(uint64_t *s, int64_t n, int f16, int is_signed, double *want) {
    void *p = malloc(f16 ? 2 * n : 4 * n);
    for (int64_t i = 0; i < n; i++) {
        uint16_t h = half_rand(s, is_signed);
        want[i] = half_value(h);
        if (f16) ((uint16_t *)p)[i] = h;
        else ((float *)p)[i] = (float)want[i];
    }
    return p;
}

/* bf16 by truncation: the reference reads the same bits back, so no rounding rule is assumed here. */
static uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static double bf16_value(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* got [n] against want [n]: |got - want| <= rtol * mag[i] + 1e-6 (mag: the sum of |terms| or |value|; 1e-6 for
 * values near zero).  Prints one line; returns 1 on a mismatch. */
static int compare(const char *what, const float *got, const double *want, const double *mag, int64_t n,
                   double rtol) {
    double worst = 0.0;
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        double ratio = fabs((double)got[i] - want[i]) / (rtol * mag[i] + 1e-6);
        if (!(ratio <= worst)) worst = ratio, at = i; /* a NaN is the worst */
    }
    int bad = !(worst <= 1.0);
    printf("%s %-44s max err/tol %.3g (at %lld: %.7g, reference %.7g)\n", bad ? "FAIL" : "ok  ", what, worst,
           (long long)at, got[at], want[at]);
    return bad;
}

/* Rows computed alone must equal the same rows computed together, bit for bit (the kernels promise it: speculative
 * decoding's greedy output depends on it). */
static int same_bits(const char *what, const float *together, const float *alone, int64_t n) {
    int bad = memcmp(together, alone, sizeof(float) * n) != 0;
    printf("%s %-44s rows alone == rows together, bit for bit\n", bad ? "FAIL" : "ok  ", what);
    return bad;
}

/* Q4_0 (a NULL mins pointer: m = -8 d): the Q4_1 mins m = -8 d [n] materialised in the scales' format (fp16: the
 * exponent + 3 and the sign set, exact for scales_rand's halves) — a NULL-mins call must give these bits. */
static void *q4_0_mins(const void *sc, int64_t n, int f16) {
    void *p = malloc(f16 ? 2 * n : 4 * n);
    for (int64_t i = 0; i < n; i++)
        if (f16) ((uint16_t *)p)[i] = (uint16_t)((((const uint16_t *)sc)[i] + (3u << 10)) | 0x8000u);
        else ((float *)p)[i] = -8.f * ((const float *)sc)[i];
    return p;
}

static int same_q4_0(const char *what, const float *null_mins, const float *stored, int64_t n) {
    int bad = memcmp(null_mins, stored, sizeof(float) * n) != 0;
    printf("%s %-44s Q4_0 (mins NULL) == m = -8 d stored, bit for bit\n", bad ? "FAIL" : "ok  ", what);
    return bad;
}

/* ---------------------------------------------------------------- GEMV (native.c) */

/* y [M, N] = x [M, K] @ W [N, K]^T + b (double), and each output's sum of |terms|. */
static void linear_ref(const float *W, const float *x, const float *b, int64_t M, int64_t N, int64_t K,
                       double *want, double *mag) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double s = b ? b[n] : 0.0, a = b ? fabs(b[n]) : 0.0;
            for (int64_t k = 0; k < K; k++) {
                double t = (double)W[n * K + k] * x[m * K + k];
                s += t, a += fabs(t);
            }
            want[m * N + n] = s, mag[m * N + n] = a;
        }
}

static int check_gemv_f32(uint64_t *s, int64_t M, int64_t N, int64_t K, int with_bias) {
    float *W = frand(s, N * K), *x = frand(s, M * K), *b = with_bias ? frand(s, N) : NULL;
    float *y = malloc(sizeof(float) * M * N), *y1 = malloc(sizeof(float) * M * N);
    double *want = malloc(sizeof(double) * M * N), *mag = malloc(sizeof(double) * M * N);
    gemv_f32(W, x, b, y, M, N, K);
    linear_ref(W, x, b, M, N, K, want, mag);
    char what[96];
    snprintf(what, sizeof what, "gemv_f32 M=%lld N=%lld K=%lld%s", (long long)M, (long long)N, (long long)K,
             with_bias ? " +bias" : "");
    int bad = compare(what, y, want, mag, M * N, SUM_RTOL);
    if (M > 1) {
        for (int64_t m = 0; m < M; m++) gemv_f32(W, x + m * K, b, y1 + m * N, 1, N, K);
        bad |= same_bits(what, y, y1, M * N);
    }
    free(W), free(x), free(b), free(y), free(y1), free(want), free(mag);
    return bad;
}

static int check_gemv_bf16(uint64_t *s, int64_t M, int64_t N, int64_t K) {
    float *Wf = frand(s, N * K), *xf = frand(s, M * K), *bf = frand(s, N), *got = malloc(sizeof(float) * M * N);
    uint16_t *W = malloc(2 * N * K), *x = malloc(2 * M * K), *b = malloc(2 * N), *y = malloc(2 * M * N);
    for (int64_t i = 0; i < N * K; i++) W[i] = bf16_bits(Wf[i]), Wf[i] = (float)bf16_value(W[i]);
    for (int64_t i = 0; i < M * K; i++) x[i] = bf16_bits(xf[i]), xf[i] = (float)bf16_value(x[i]);
    for (int64_t i = 0; i < N; i++) b[i] = bf16_bits(bf[i]), bf[i] = (float)bf16_value(b[i]);
    double *want = malloc(sizeof(double) * M * N), *mag = malloc(sizeof(double) * M * N);
    gemv_bf16(W, x, b, y, M, N, K);
    linear_ref(Wf, xf, bf, M, N, K, want, mag);
    /* tolerance SUM_RTOL * |terms| + BF16_RTOL * |value| (the store's rounding), written as one magnitude */
    for (int64_t i = 0; i < M * N; i++)
        got[i] = (float)bf16_value(y[i]), mag[i] += fabs(want[i]) * BF16_RTOL / SUM_RTOL;
    char what[96];
    snprintf(what, sizeof what, "gemv_bf16 M=%lld N=%lld K=%lld +bias", (long long)M, (long long)N, (long long)K);
    int bad = compare(what, got, want, mag, M * N, SUM_RTOL);
    free(Wf), free(xf), free(bf), free(got), free(W), free(x), free(b), free(y), free(want), free(mag);
    return bad;
}

/* ---------------------------------------------------------------- quantized GEMMs (quant.c) */

/* x [M, K] as the int8-activation kernels see it (quant.c's header): per block of 32, dx = max|x| / 127 and
 * xq = rint(x / dx), written x * (1 / dx) as quant.c's xprep computes it (the two can differ in the last bit, so in
 * a rounding tie); xhat = dx * xq. */
static void q8_activation_ref(const float *x, int64_t M, int64_t K, double *xhat) {
    for (int64_t i = 0; i < M * K; i += QB) {
        float amax = 0.f;
        for (int j = 0; j < QB; j++) amax = fmaxf(amax, fabsf(x[i + j]));
        const float dx = amax / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
        for (int j = 0; j < QB; j++) xhat[i + j] = (double)dx * rintf(x[i + j] * inv);
    }
}

/* want [M, N] = xs [M, K] @ w [N, K]^T in double, mag the sums of |terms|. */
static void dot_ref(const double *w, const double *xs, int64_t M, int64_t N, int64_t K, double *want, double *mag) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double a = 0.0, t = 0.0;
            for (int64_t k = 0; k < K; k++) {
                double p = w[n * K + k] * xs[m * K + k];
                t += p, a += fabs(p);
            }
            want[m * N + n] = t, mag[m * N + n] = a;
        }
}

/* Q4_1 [N, K] with groups of G: codes 0..15 packed per block of 32 (byte j: weight j low, weight j + 16 high),
 * scales d and mins m [N, K/G] (fp16 or fp32).  Both paths: q4_gemm (fp32 x) and q4_gemm_q8 (x rounded to int8). */
static int check_q4(uint64_t *s, int64_t M, int64_t N, int64_t K, int64_t G, int f16) {
    const int64_t ng = K / G;
    double *d = malloc(sizeof(double) * N * ng), *mn = malloc(sizeof(double) * N * ng);
    void *sc = scales_rand(s, N * ng, f16, 0, d), *mi = scales_rand(s, N * ng, f16, 1, mn);
    uint8_t *P = calloc(N * K / 2, 1);
    double *w = malloc(sizeof(double) * N * K);
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            uint8_t q = (uint8_t)irand(s, 16);
            const int64_t b = k / QB, j = k % QB;
            P[n * K / 2 + b * 16 + j % 16] |= j < 16 ? q : (uint8_t)(q << 4);
            w[n * K + k] = d[n * ng + k / G] * q + mn[n * ng + k / G];
        }
    float *x = frand(s, M * K), *y = malloc(sizeof(float) * M * N), *y1 = malloc(sizeof(float) * M * N);
    double *xs = malloc(sizeof(double) * M * K), *want = malloc(sizeof(double) * M * N),
           *mag = malloc(sizeof(double) * M * N);
    char what[96];
    int bad = 0;

    q4_gemm(P, sc, mi, f16, x, 0, y, M, N, K, G);
    for (int64_t i = 0; i < M * K; i++) xs[i] = x[i];
    dot_ref(w, xs, M, N, K, want, mag);
    snprintf(what, sizeof what, "q4_gemm M=%lld N=%lld K=%lld G=%lld %s", (long long)M, (long long)N, (long long)K,
             (long long)G, f16 ? "fp16" : "fp32");
    bad |= compare(what, y, want, mag, M * N, SUM_RTOL);

    q4_gemm_q8(P, sc, mi, f16, x, 0, y, M, N, K, G);
    q8_activation_ref(x, M, K, xs);
    dot_ref(w, xs, M, N, K, want, mag);
    snprintf(what, sizeof what, "q4_gemm_q8 M=%lld N=%lld K=%lld G=%lld %s", (long long)M, (long long)N,
             (long long)K, (long long)G, f16 ? "fp16" : "fp32");
    bad |= compare(what, y, want, mag, M * N, SUM_RTOL);
    if (M > 1) {
        for (int64_t m = 0; m < M; m++) q4_gemm_q8(P, sc, mi, f16, x + m * K, 0, y1 + m * N, 1, N, K, G);
        bad |= same_bits(what, y, y1, M * N);
    }
    void *m8 = q4_0_mins(sc, N * ng, f16); /* the same codes and scales as Q4_0: both paths */
    q4_gemm(P, sc, m8, f16, x, 0, y, M, N, K, G);
    q4_gemm(P, sc, NULL, f16, x, 0, y1, M, N, K, G);
    bad |= same_q4_0("q4_gemm", y1, y, M * N);
    q4_gemm_q8(P, sc, m8, f16, x, 0, y, M, N, K, G);
    q4_gemm_q8(P, sc, NULL, f16, x, 0, y1, M, N, K, G);
    bad |= same_q4_0(what, y1, y, M * N);
    free(d), free(mn), free(sc), free(mi), free(m8), free(P), free(w), free(x), free(y), free(y1), free(xs),
        free(want), free(mag);
    return bad;
}

/* Q4_K's two scale levels as K records (fmt 2): per row and 256 weights a 10-byte record, an fp16 super-value then
 * 8 sub-values (0..63), for d (d, sc) and for m (-dmin, mn); group g's value is super * sub in fp32, exact.  Both
 * GEMV paths must give the bits of the same weight with those products stored as fp32 scales and mins (fmt 0). */
static int check_q4_krec(uint64_t *s, int64_t M, int64_t N, int64_t K) {
    const int64_t ng = K / QB, nr = K / 256;
    uint8_t *rs = malloc(N * nr * 10), *rm = malloc(N * nr * 10), *P = malloc(N * K / 2);
    float *d = malloc(sizeof(float) * N * ng), *mn = malloc(sizeof(float) * N * ng);
    for (int64_t r = 0; r < N * nr; r++) {
        uint16_t hd = half_rand(s, 0), hm = (uint16_t)(half_rand(s, 0) | 0x8000u); /* d > 0, -dmin < 0 */
        memcpy(rs + 10 * r, &hd, 2), memcpy(rm + 10 * r, &hm, 2);
        for (int j = 0; j < 8; j++) {
            rs[10 * r + 2 + j] = (uint8_t)irand(s, 64), rm[10 * r + 2 + j] = (uint8_t)irand(s, 64);
            d[8 * r + j] = (float)half_value(hd) * (float)rs[10 * r + 2 + j];
            mn[8 * r + j] = (float)half_value(hm) * (float)rm[10 * r + 2 + j];
        }
    }
    for (int64_t i = 0; i < N * K / 2; i++) P[i] = (uint8_t)irand(s, 256);
    float *x = frand(s, M * K), *y = malloc(sizeof(float) * M * N), *y1 = malloc(sizeof(float) * M * N);
    char what[96];
    int bad = 0;
    for (int path = 0; path < 2; path++) {
        void (*gemv)(const uint8_t *, const void *, const void *, int, const void *, int, void *, int64_t, int64_t,
                     int64_t, int64_t) = path ? q4_gemm_q8 : q4_gemm;
        gemv(P, rs, rm, SF_KREC, x, 0, y, M, N, K, QB);
        gemv(P, d, mn, SF_F32, x, 0, y1, M, N, K, QB);
        snprintf(what, sizeof what, "%s M=%lld N=%lld K=%lld", path ? "q4_gemm_q8" : "q4_gemm", (long long)M,
                 (long long)N, (long long)K);
        const int differ = memcmp(y, y1, sizeof(float) * M * N) != 0;
        printf("%s %-44s K records == their fp32 products, bit for bit\n", differ ? "FAIL" : "ok  ", what);
        bad |= differ;
    }
    free(rs), free(rm), free(P), free(d), free(mn), free(x), free(y), free(y1);
    return bad;
}

/* int8 [N, K], w = s * q with s per group of G along K (G = K: per output channel).  q8_gemm takes any G dividing
 * K; q8_gemm_q8 needs K and G multiples of 32 (its wrapper sends other shapes to q8_gemm). */
static int check_q8(uint64_t *s, int64_t M, int64_t N, int64_t K, int64_t G, int f16) {
    const int64_t ng = K / G;
    double *sw = malloc(sizeof(double) * N * ng), *w = malloc(sizeof(double) * N * K);
    void *sc = scales_rand(s, N * ng, f16, 0, sw);
    int8_t *W = malloc(N * K);
    for (int64_t i = 0; i < N * K; i++) {
        W[i] = (int8_t)((int)irand(s, 255) - 127);
        w[i] = sw[i / K * ng + i % K / G] * W[i];
    }
    float *x = frand(s, M * K), *y = malloc(sizeof(float) * M * N);
    double *xs = malloc(sizeof(double) * M * K), *want = malloc(sizeof(double) * M * N),
           *mag = malloc(sizeof(double) * M * N);
    char what[96];
    int bad = 0;

    q8_gemm(W, sc, f16, x, 0, y, M, N, K, G);
    for (int64_t i = 0; i < M * K; i++) xs[i] = x[i];
    dot_ref(w, xs, M, N, K, want, mag);
    snprintf(what, sizeof what, "q8_gemm M=%lld N=%lld K=%lld G=%lld %s", (long long)M, (long long)N, (long long)K,
             (long long)G, f16 ? "fp16" : "fp32");
    bad |= compare(what, y, want, mag, M * N, SUM_RTOL);

    if (K % QB == 0 && G % QB == 0) {
        q8_gemm_q8(W, sc, f16, x, 0, y, M, N, K, G);
        q8_activation_ref(x, M, K, xs);
        dot_ref(w, xs, M, N, K, want, mag);
        snprintf(what, sizeof what, "q8_gemm_q8 M=%lld N=%lld K=%lld G=%lld %s", (long long)M, (long long)N,
                 (long long)K, (long long)G, f16 ? "fp16" : "fp32");
        bad |= compare(what, y, want, mag, M * N, SUM_RTOL);
    }
    free(sw), free(w), free(sc), free(W), free(x), free(y), free(xs), free(want), free(mag);
    return bad;
}

/* GGUF Q6_K blocks (q6k_gemm_q8): random ql, qh and sub-scale bytes, a signed fp16 d per 256 weights, dequantized
 * here from gguf's layout (weight i of half h: ql byte 64h + i % 64, low nibble below 64; qh byte 32h + i % 32, bits
 * 2 (i / 32)), x rounded as q8_activation_ref; and the rows of one call equal each row alone (batch 1 takes 4 weight
 * rows at a time, past 8 input rows weight rows unpacked per L2 block) — except past 8 rows on AVX-512 VNNI, whose
 * register-tiled GEMM (pf_tile_q6) sums in another order: there each row alone is checked against the reference. */
static int check_q6k(uint64_t *s, int64_t M, int64_t N, int64_t K) {
    const int64_t nsb = N * K / 256;
    uint8_t *W = malloc(nsb * 210);
    double *w = malloc(sizeof(double) * N * K);
    for (int64_t b = 0; b < nsb; b++) {
        uint8_t *blk = W + b * 210;
        for (int j = 0; j < 208; j++) blk[j] = (uint8_t)irand(s, 256);
        const uint16_t hd = half_rand(s, 1);
        memcpy(blk + 208, &hd, 2);
        for (int i = 0; i < 256; i++) {
            const int h = i / 128, l = i % 128;
            const int lo = (blk[64 * h + l % 64] >> (l < 64 ? 0 : 4)) & 15;
            const int hi = (blk[128 + 32 * h + l % 32] >> (2 * (l / 32))) & 3;
            w[b * 256 + i] = half_value(hd) * (int8_t)blk[192 + i / 16] * ((lo | hi << 4) - 32);
        }
    }
    float *x = frand(s, M * K), *y = malloc(sizeof(float) * M * N), *alone = malloc(sizeof(float) * M * N);
    double *xs = malloc(sizeof(double) * M * K), *want = malloc(sizeof(double) * M * N),
           *mag = malloc(sizeof(double) * M * N);
    char what[96];
    q6k_gemm_q8(W, x, 0, y, M, N, K);
    q8_activation_ref(x, M, K, xs);
    dot_ref(w, xs, M, N, K, want, mag);
    snprintf(what, sizeof what, "q6k_gemm_q8 M=%lld N=%lld K=%lld", (long long)M, (long long)N, (long long)K);
    int bad = compare(what, y, want, mag, M * N, SUM_RTOL);
    if (M > 1) {
        for (int64_t m = 0; m < M; m++) q6k_gemm_q8(W, x + m * K, 0, alone + m * N, 1, N, K);
        if (M <= 8 || !quant_prefill_tiled()) bad |= same_bits(what, y, alone, M * N);
        else bad |= compare(what, alone, want, mag, M * N, SUM_RTOL); /* the tiled GEMM: another summation order */
    }
    free(W), free(w), free(x), free(y), free(alone), free(xs), free(want), free(mag);
    return bad;
}

/* W8A8 (w8a8_gemm): per-channel int8 weights, activations rounded to int8 per row (dynamic) or with one static
 * scale (codes clamped to +-127).  Reference: the codes and scales computed here in double (x / s rounded half to
 * even), their exact integer sums times s_x s_w: the kernel's float epilogue is one product away (rtol 1e-6 of
 * |value|); and rows alone equal rows together. */
static int check_w8a8(uint64_t *s, int64_t M, int64_t N, int64_t K, int f16, float static_scale) {
    double *sw = malloc(sizeof(double) * N);
    void *sc = scales_rand(s, N, f16, 0, sw);
    int8_t *W = malloc(N * K);
    for (int64_t i = 0; i < N * K; i++) W[i] = (int8_t)((int)irand(s, 255) - 127);
    float *x = frand(s, M * K), *y = malloc(sizeof(float) * M * N), *y1 = malloc(sizeof(float) * M * N);
    double *want = malloc(sizeof(double) * M * N), *mag = malloc(sizeof(double) * M * N);
    for (int64_t m = 0; m < M; m++) {
        double amax = 0.0;
        for (int64_t k = 0; k < K; k++) amax = fmax(amax, fabs((double)x[m * K + k]));
        const float sx = static_scale > 0.f ? static_scale : (float)amax / 127.f; /* one fp32 division, as torch */
        for (int64_t n = 0; n < N; n++) {
            int64_t acc = 0;
            for (int64_t k = 0; k < K; k++) {
                double q = nearbyint((double)x[m * K + k] / sx); /* the fp32 quotient's rounding, near enough */
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                acc += (int64_t)q * W[n * K + k];
            }
            want[m * N + n] = (double)acc * sx * sw[n], mag[m * N + n] = fabs(want[m * N + n]);
        }
    }
    const float ss = static_scale;
    char what[96];
    w8a8_gemm(W, sc, f16, static_scale > 0.f ? &ss : NULL, x, y, M, N, K);
    snprintf(what, sizeof what, "w8a8_gemm M=%lld N=%lld K=%lld %s %s", (long long)M, (long long)N, (long long)K,
             f16 ? "fp16" : "fp32", static_scale > 0.f ? "static" : "dynamic");
    int bad = compare(what, y, want, mag, M * N, 1e-6);
    for (int64_t m = 0; m < M; m++)
        w8a8_gemm(W, sc, f16, static_scale > 0.f ? &ss : NULL, x + m * K, y1 + m * N, 1, N, K);
    bad |= same_bits(what, y, y1, M * N);
    free(sw), free(sc), free(W), free(x), free(y), free(y1), free(want), free(mag);
    return bad;
}

/* ---------------------------------------------------------------- attention, norms, RoPE, SwiGLU (native.c) */

/* Paged decode attention: B sequences of lens[b] positions in blocks of bs scattered over the cache (block tables
 * [B, W] in reverse order, so a wrong table walk reads other positions); q a strided view (row stride (Hq + 2) D,
 * as in the packed qkv projection). */
static int check_paged_attention(uint64_t *s, int64_t Hq, int64_t Hkv, int64_t D) {
    enum { B = 3, BS = 4, W = 5 };
    const int32_t lens[B] = {1, 7, 20};
    const int64_t nblocks = B * W, rs = Hkv * D, sqb = (Hq + 2) * D, G = Hq / Hkv;
    int32_t tables[B * W];
    for (int64_t i = 0; i < B * W; i++) tables[i] = (int32_t)(B * W - 1 - i);
    float *q = frand(s, B * sqb), *k = frand(s, nblocks * BS * rs), *v = frand(s, nblocks * BS * rs);
    float *out = malloc(sizeof(float) * B * Hq * D);
    double *want = malloc(sizeof(double) * B * Hq * D), *mag = malloc(sizeof(double) * B * Hq * D);
    const float scale = 1.f / sqrtf((float)D);
    paged_decode_attention_f32(q, k, v, tables, lens, out, B, Hq, Hkv, D, BS, W, scale, sqb, D);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++) {
            double p[B * W * BS], mx = -1e300, l = 0.0;
            const float *qh = q + b * sqb + h * D;
            for (int64_t t = 0; t < lens[b]; t++) {
                const float *kt = k + ((int64_t)tables[b * W + t / BS] * BS + t % BS) * rs + (h / G) * D;
                double dot = 0.0;
                for (int64_t d = 0; d < D; d++) dot += (double)qh[d] * scale * kt[d];
                p[t] = dot, mx = dot > mx ? dot : mx;
            }
            for (int64_t t = 0; t < lens[b]; t++) p[t] = exp(p[t] - mx), l += p[t];
            for (int64_t d = 0; d < D; d++) {
                double o = 0.0, a = 0.0;
                for (int64_t t = 0; t < lens[b]; t++) {
                    const float *vt = v + ((int64_t)tables[b * W + t / BS] * BS + t % BS) * rs + (h / G) * D;
                    o += p[t] / l * vt[d], a += fabs(p[t] / l * vt[d]);
                }
                want[(b * Hq + h) * D + d] = o, mag[(b * Hq + h) * D + d] = a;
            }
        }
    char what[96];
    snprintf(what, sizeof what, "paged_decode_attention_f32 Hq=%lld Hkv=%lld D=%lld", (long long)Hq,
             (long long)Hkv, (long long)D);
    /* softmax's exp in fp32 (expf, vectorised under -ffast-math) adds a few ulps per weight on top of the sums */
    int bad = compare(what, out, want, mag, B * Hq * D, 4 * SUM_RTOL);
    free(q), free(k), free(v), free(out), free(want), free(mag);
    return bad;
}

static int check_norms(uint64_t *s, int64_t M, int64_t K) {
    const float eps = 1e-5f;
    float *x = frand(s, M * K), *res = frand(s, M * K), *w = frand(s, K);
    float *y = malloc(sizeof(float) * M * K), *r = malloc(sizeof(float) * M * K);
    double *want = malloc(sizeof(double) * M * K), *mag = malloc(sizeof(double) * M * K);
    char what[96];
    int bad = 0;
    for (int pass = 0; pass < 2; pass++) { /* 0: rms_norm(x); 1: add_rms_norm(x, res) -> (rms_norm(x + res), x + res) */
        if (pass == 0) rms_norm_f32(x, w, y, M, K, eps);
        else add_rms_norm_f32(x, res, w, y, r, M, K, eps);
        for (int64_t m = 0; m < M; m++) {
            double ss = 0.0;
            for (int64_t k = 0; k < K; k++) {
                double v = (double)x[m * K + k] + (pass ? res[m * K + k] : 0.0);
                ss += v * v;
            }
            const double inv = 1.0 / sqrt(ss / K + eps);
            for (int64_t k = 0; k < K; k++) {
                double v = (double)x[m * K + k] + (pass ? res[m * K + k] : 0.0);
                want[m * K + k] = v * inv * w[k], mag[m * K + k] = fabs(want[m * K + k]);
            }
        }
        snprintf(what, sizeof what, "%s M=%lld K=%lld", pass ? "add_rms_norm_f32" : "rms_norm_f32", (long long)M,
                 (long long)K);
        bad |= compare(what, y, want, mag, M * K, SUM_RTOL);
    }
    for (int64_t i = 0; i < M * K; i++) want[i] = (double)x[i] + res[i], mag[i] = fabs(want[i]);
    snprintf(what, sizeof what, "add_rms_norm_f32 residual M=%lld K=%lld", (long long)M, (long long)K);
    bad |= compare(what, r, want, mag, M * K, SUM_RTOL);
    free(x), free(res), free(w), free(y), free(r), free(want), free(mag);
    return bad;
}

/* RoPE on R rows of H heads of a strided view (row stride (H + 1) D): y = x * cos + rotate_half(x) * sin. */
static int check_rope(uint64_t *s, int64_t R, int64_t H, int64_t D) {
    const int64_t sx = (H + 1) * D, half = D / 2;
    float *x = frand(s, R * sx), *c = frand(s, R * D), *sn = frand(s, R * D), *y = malloc(sizeof(float) * R * H * D);
    double *want = malloc(sizeof(double) * R * H * D), *mag = malloc(sizeof(double) * R * H * D);
    rope_f32(x, c, sn, y, R, H, D, sx);
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < D; d++) {
                const float *xi = x + r * sx + h * D;
                double rot = d < half ? -(double)xi[d + half] : xi[d - half];
                double a = (double)xi[d] * c[r * D + d], b = rot * sn[r * D + d];
                want[(r * H + h) * D + d] = a + b, mag[(r * H + h) * D + d] = fabs(a) + fabs(b);
            }
    char what[96];
    snprintf(what, sizeof what, "rope_f32 R=%lld H=%lld D=%lld", (long long)R, (long long)H, (long long)D);
    int bad = compare(what, y, want, mag, R * H * D, SUM_RTOL);
    free(x), free(c), free(sn), free(y), free(want), free(mag);
    return bad;
}

static int check_silu_mul(uint64_t *s, int64_t R, int64_t F) {
    float *x = frand(s, R * 2 * F), *y = malloc(sizeof(float) * R * F);
    double *want = malloc(sizeof(double) * R * F), *mag = malloc(sizeof(double) * R * F);
    for (int64_t i = 0; i < R * 2 * F; i++) x[i] *= 8.f; /* silu's curved part and both tails */
    silu_mul_f32(x, y, R, F);
    for (int64_t r = 0; r < R; r++)
        for (int64_t f = 0; f < F; f++) {
            double g = x[r * 2 * F + f], u = x[r * 2 * F + F + f];
            want[r * F + f] = g / (1.0 + exp(-g)) * u, mag[r * F + f] = fabs(want[r * F + f]);
        }
    char what[96];
    snprintf(what, sizeof what, "silu_mul_f32 R=%lld F=%lld", (long long)R, (long long)F);
    int bad = compare(what, y, want, mag, R * F, SUM_RTOL);
    free(x), free(y), free(want), free(mag);
    return bad;
}

/* The prefill GEMM (q4_gemm_prefill / q8_gemm_prefill): x rounded to int8 blocks as q8_activation_ref rounds it,
 * Q4_1 (q4 = 1: codes 0..15, d and m per group) or int8 (q4 = 0: codes -127..127, s per group) weights; M across
 * the 4-row register tiles' tails, N across the 32-column panels'; each row alone the bits it has among the others. */
static int check_prefill(uint64_t *s, int64_t M, int64_t N, int64_t K, int64_t G, int f16, int q4) {
    const int64_t ng = K / G;
    double *d = malloc(sizeof(double) * N * ng), *mn = malloc(sizeof(double) * N * ng);
    void *sc = scales_rand(s, N * ng, f16, 0, d), *mi = scales_rand(s, N * ng, f16, 1, mn);
    uint8_t *W = calloc(N * K, 1);
    double *w = malloc(sizeof(double) * N * K);
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            const int64_t i = n * ng + k / G, j = k % QB;
            if (q4) {
                const uint8_t q = (uint8_t)irand(s, 16);
                W[n * K / 2 + k / QB * 16 + j % 16] |= j < 16 ? q : (uint8_t)(q << 4);
                w[n * K + k] = d[i] * q + mn[i];
            } else {
                const int q = (int)irand(s, 255) - 127;
                W[n * K + k] = (uint8_t)(int8_t)q;
                w[n * K + k] = d[i] * q;
            }
        }
    float *x = frand(s, M * K), *y = malloc(sizeof(float) * M * N), *y1 = malloc(sizeof(float) * M * N);
    double *xs = malloc(sizeof(double) * M * K), *want = malloc(sizeof(double) * M * N),
           *mag = malloc(sizeof(double) * M * N);
    char what[96];
    if (q4) q4_gemm_prefill(W, sc, mi, f16, x, 0, y, M, N, K, G);
    else q8_gemm_prefill((const int8_t *)W, sc, f16, x, 0, y, M, N, K, G);
    q8_activation_ref(x, M, K, xs);
    dot_ref(w, xs, M, N, K, want, mag);
    snprintf(what, sizeof what, "%s M=%lld N=%lld K=%lld G=%lld %s", q4 ? "q4_gemm_prefill" : "q8_gemm_prefill",
             (long long)M, (long long)N, (long long)K, (long long)G, f16 ? "fp16" : "fp32");
    int bad = compare(what, y, want, mag, M * N, SUM_RTOL);
    for (int64_t m = 0; m < M; m++) {
        if (q4) q4_gemm_prefill(W, sc, mi, f16, x + m * K, 0, y1 + m * N, 1, N, K, G);
        else q8_gemm_prefill((const int8_t *)W, sc, f16, x + m * K, 0, y1 + m * N, 1, N, K, G);
    }
    bad |= same_bits(what, y, y1, M * N);
    if (q4) { /* the same codes and scales as Q4_0 */
        void *m8 = q4_0_mins(sc, N * ng, f16);
        q4_gemm_prefill(W, sc, m8, f16, x, 0, y, M, N, K, G);
        q4_gemm_prefill(W, sc, NULL, f16, x, 0, y1, M, N, K, G);
        bad |= same_q4_0(what, y1, y, M * N);
        free(m8);
    }
    free(d), free(mn), free(sc), free(mi), free(W), free(w), free(x), free(y), free(y1), free(xs), free(want),
        free(mag);
    return bad;
}

/* ---------------------------------------------------------------- split.h: GEMV rows over the team */

/* SPLIT_UNITS / SPLIT_TAKE hand every row out exactly once, in units (no range but the last ends mid-unit), and a
 * thread that arrives late finds its range taken: here every thread but 0 waits until thread 0 has claimed
 * everything, so thread 0 must have taken the others' whole ranges (with one thread, it owns them anyway). */
#define SPLIT_ROWS_N 1003
static int split_seen[SPLIT_ROWS_N], split_owner[SPLIT_ROWS_N], split_ragged;
#define SPLIT_MARK(n0, n1)                                                                                   \
    do {                                                                                                     \
        if ((n0) % 4 || ((n1) % 4 && (n1) != SPLIT_ROWS_N)) __atomic_store_n(&split_ragged, 1, __ATOMIC_RELAXED); \
        for (int64_t i = (n0); i < (n1); i++) {                                                              \
            __atomic_fetch_add(&split_seen[i], 1, __ATOMIC_RELAXED);                                         \
            split_owner[i] = omp_get_thread_num();                                                           \
        }                                                                                                    \
    } while (0)
static int check_split(void) {
    int bad = 0, late_done = 0;
    SPLIT_UNITS(SPLIT_ROWS_N, 4, SPLIT_MARK);
    for (int i = 0; i < SPLIT_ROWS_N; i++) bad |= split_seen[i] != 1;
    memset(split_seen, 0, sizeof split_seen);
    {
        SPLIT_DECLARE(SPLIT_ROWS_N, 4)
#pragma omp parallel num_threads(T_)
        {
            if (omp_get_thread_num() != 0)
                while (!__atomic_load_n(&late_done, __ATOMIC_ACQUIRE)) {}
            SPLIT_TAKE(SPLIT_MARK)
            if (omp_get_thread_num() == 0) __atomic_store_n(&late_done, 1, __ATOMIC_RELEASE);
        }
    }
    for (int i = 0; i < SPLIT_ROWS_N; i++) bad |= split_seen[i] != 1 || split_owner[i] != 0;
    bad |= split_ragged;
    printf("%s split: %d rows in units of 4 over %d threads, each once; a late thread's ranges taken over\n",
           bad ? "FAIL" : "ok  ", SPLIT_ROWS_N, omp_get_max_threads());
    return bad;
}

int main(void) {
    uint64_t s = 0x9e3779b97f4a7c15ull;
    int bad = 0;
    printf("built: gemv_simd_level %d, quant_simd_level %d, openmp %d (max threads %d)\n", gemv_simd_level(),
           quant_simd_level(), built_with_openmp(), omp_get_max_threads());
    /* GEMV: 1..8 rows (one row block: tile shapes per R), 11 rows (two blocks), K with a tail after the vectors,
     * N with ragged tiles; 640 x 512 weights (> GV_SPLIT) split over the OpenMP threads. */
    bad |= check_gemv_f32(&s, 1, 37, 100, 1);
    bad |= check_gemv_f32(&s, 3, 37, 100, 0);
    bad |= check_gemv_f32(&s, 8, 13, 64, 1);
    bad |= check_gemv_f32(&s, 11, 9, 40, 1);
    bad |= check_gemv_f32(&s, 2, 640, 512, 1);
    bad |= check_gemv_bf16(&s, 1, 37, 100);
    bad |= check_gemv_bf16(&s, 5, 19, 72);
    bad |= check_gemv_bf16(&s, 11, 9, 577); /* two row blocks; a K tail of 1 past 32-wide bf16 pairs */
    /* Q4_1: batch 1 with groups of 32 takes 4 weight rows at a time (N = 6: a remainder); K = 224 and 576 end in a
     * partial 4-block chunk; 9 rows span two 8-row tiles; 512 x 576 weights are split over the threads. */
    bad |= check_q4(&s, 1, 6, 576, 32, 0);
    bad |= check_q4(&s, 1, 6, 224, 32, 1);
    bad |= check_q4(&s, 5, 7, 224, 32, 0);
    bad |= check_q4(&s, 3, 9, 256, 64, 1);
    bad |= check_q4(&s, 9, 5, 128, 128, 0);
    bad |= check_q4(&s, 2, 512, 576, 32, 1);
    bad |= check_q4_krec(&s, 1, 6, 256);
    bad |= check_q4_krec(&s, 3, 9, 512);
    bad |= check_q4_krec(&s, 2, 512, 768);
    /* int8: per channel with K not in blocks of 32 (exact path only), Q8_0 groups of 32, groups of 64, a partial
     * 2-block chunk (K = 96), 9 rows, and a split over the threads. */
    bad |= check_q8(&s, 1, 7, 100, 100, 0);
    bad |= check_q8(&s, 1, 7, 96, 96, 1);
    bad |= check_q8(&s, 3, 5, 96, 32, 1);
    bad |= check_q8(&s, 4, 6, 128, 64, 0);
    bad |= check_q8(&s, 9, 3, 64, 32, 0);
    bad |= check_q8(&s, 2, 512, 576, 576, 1);
    /* Q6_K: one row (4-row tiles, a tail of 3), a tile with a tail, two tiles of input rows, a split over the
     * threads. */
    bad |= check_q6k(&s, 1, 7, 256);
    bad |= check_q6k(&s, 3, 9, 512);
    bad |= check_q6k(&s, 9, 5, 256);
    bad |= check_q6k(&s, 1, 514, 768);
    /* W8A8: 4x4 tiles with row and column tails, K with a partial 64-byte chunk (96, 100), K in whole chunks,
     * M = 70 past the parallel rounding's threshold, 512 x 576 weights split over the threads. */
    bad |= check_w8a8(&s, 1, 7, 96, 0, 0.f);
    bad |= check_w8a8(&s, 6, 9, 100, 1, 0.f);
    bad |= check_w8a8(&s, 5, 13, 128, 0, 0.004f);
    bad |= check_w8a8(&s, 70, 11, 1024, 1, 0.f);
    bad |= check_w8a8(&s, 3, 512, 576, 0, 0.f);
    bad |= check_paged_attention(&s, 4, 2, 16);
    bad |= check_paged_attention(&s, 3, 1, 24);
    bad |= check_norms(&s, 3, 100);
    bad |= check_rope(&s, 3, 2, 16);
    bad |= check_silu_mul(&s, 2, 50);
    bad |= check_split();
    /* The prefill GEMM: one row, 4-row tiles with tails (7, 130), panels with tails (N = 33, 70), groups of 64,
     * 130 x 70 x 576 split over the threads. */
    bad |= check_prefill(&s, 1, 33, 96, 32, 1, 1);
    bad |= check_prefill(&s, 7, 70, 256, 64, 0, 1);
    bad |= check_prefill(&s, 130, 70, 576, 32, 1, 1);
    bad |= check_prefill(&s, 1, 33, 96, 32, 1, 0);
    bad |= check_prefill(&s, 7, 70, 256, 64, 0, 0);
    bad |= check_prefill(&s, 130, 70, 576, 32, 1, 0);
    /* Q6_K past one tile: weight rows unpacked in 2 L2 blocks (614 + 87).  Last: the cases above keep their random
     * data (w8a8_gemm M=70 fails its tolerance on the data one case earlier would give it). */
    bad |= check_q6k(&s, 20, 701, 256);
    printf(bad ? "FAILED: a kernel differs from its reference (lines marked FAIL)\n" : "all kernels agree\n");
    return bad;
}
