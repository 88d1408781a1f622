/* One native call per decode step for the whole decoder stack (all layers), on CPU, fp32 or bf16 activations.
 *
 * Why: once the weights are int4, a decode token of a 135M model reads ~80 MB in its GEMVs, but the
 * layer-by-layer Python path around them costs about as much time again: per layer ~120 ATen ops (views,
 * transposes, empty), ctypes wrappers and their checks, module calls, over 30 layers.  This file runs the same
 * kernels (quant.c's GEMVs, native.c's norm / RoPE / KV write / paged attention) in the same order on the same
 * inputs from one C loop, so the result equals the per-layer native path up to nothing (the same functions in the
 * same order: bit for bit) and Python pays one ctypes call per step instead of ~3600 ops.
 *
 * One translation unit: both sources are included, not copied, so a faster quant.c GEMV speeds this up too.
 * Reference: ``Transformer.hidden_states`` on the model's kernels (``minillm/kernels/cpu/fused.py`` drives this).
 *
 * Threads: each GEMV splits its weight rows over the OpenMP team in its own parallel region (quant.c SPLIT_ROWS),
 * ~121 regions a step; native.c's attention splits its heads in another.  linear_stack below runs the same GEMVs in
 * one region with barriers instead, to measure the difference (perf/bench/quant.py: within noise of the per-GEMV
 * regions on 2 cores, where a region's start and join are cheap next to a GEMV).  A step in one region would also
 * need the attention split by head inside it (native.c's function takes all heads, and two threads beat one on a
 * SmolLM2 layer's attention) — the next step, with a head-range attention and an fp32 row-range GEMV.
 *
 * Rows: M ≤ 32 (token, position, KV slot, block table, context length) tuples.  Row r attends to the first lens[r]
 * positions of its sequence (its own included), read through its block table; all rows' K/V are written before
 * any row attends, so several consecutive rows of one sequence (speculative verification) are exactly causal.
 */
#include "quant.c"
#include "native.c"

enum { LIN_F32 = 0, LIN_INT8 = 1, LIN_INT4 = 2, LIN_W8A8 = 3, LIN_BF16 = 4, LIN_Q6K = 5 };

/* One linear layer y [M, N] = x [M, K] @ W^T (+ bias): fp32 W [N, K]; int8 codes [N, K] with scales [N, K/G];
 * Q4_1 packed [N, K/2] with scales and mins in scale format scale_fmt (quant.c SF_*), or Q4_0 with mins NULL
 * (quant.c q4_min); W8A8: int8 codes [N, K] with per-channel scales [N] (G = K) and, in place of mins, the static
 * input scale (one fp32) or NULL (dynamic, per token: quant.c w8a8_gemm); GGUF Q6_K super-blocks [N, K/256, 210]
 * (quant.c q6k_gemm_q8_rows: their scales are inside them; scales, mins NULL); bf16 W [N, K].  bias [N] in the
 * activation dtype (fp32, or bf16 with a bf16 W) or NULL.  fp32 activations take every kind but LIN_BF16; bf16
 * activations LIN_BF16 only (the caller checks). */
typedef struct {
    int64_t kind, scale_fmt, N, K, G;
    const void *w, *scales, *mins;
    const void *bias;
} linear_t;

/* One decoder layer: its two RMSNorm weights [hidden], four linears and its K/V caches
 * [num_blocks, block_size, H_kv, D], all in the activation dtype (fp32 or bf16: the step's). */
typedef struct {
    const void *input_norm, *post_norm;
    linear_t qkv, o, gate_up, down;
    void *k_cache, *v_cache;
} layer_t;

/* Quantized weights always take the int8-activation kernels (kernels/select.py's choice for decode rows), for any
 * M: those kernels quantize each row of x on its own and sum each row in the same order whatever M is, so a row's
 * result does not depend on the rows beside it — speculative verification (γ + 1 rows) then gives exactly the
 * logits plain one-row decode steps give, and greedy output is the same with and without speculation.  (The
 * per-layer path switches to the dequantizing reference past quant.py's MAX_ROWS = 8 rows, a different rounding.)
 * int8 shapes not in blocks of 32 run exact, as there. */
static void linear_run_f32(const linear_t *l, const float *x, float *y, int64_t M) {
    const float *bias = (const float *)l->bias;
    if (l->kind == LIN_F32) {
        gemv_f32((const float *)l->w, x, bias, y, M, l->N, l->K);
        return;
    }
    if (l->kind == LIN_W8A8) {
        w8a8_gemm((const int8_t *)l->w, l->scales, (int)l->scale_fmt, (const float *)l->mins, x, y, M, l->N, l->K);
    } else if (l->kind == LIN_Q6K) {
        q6k_gemm_q8_rows((const uint8_t *)l->w, x, 0, y, M, l->N, l->K);
    } else if (l->kind == LIN_INT8) {
        if (l->K % QB || l->G % QB)
            q8_gemm((const int8_t *)l->w, l->scales, (int)l->scale_fmt, x, 0, y, M, l->N, l->K, l->G);
        else
            q8_gemm_q8((const int8_t *)l->w, l->scales, (int)l->scale_fmt, x, 0, y, M, l->N, l->K, l->G);
    } else {
        q4_gemm_q8((const uint8_t *)l->w, l->scales, l->mins, (int)l->scale_fmt, x, 0, y, M, l->N, l->K, l->G);
    }
    if (bias) /* the per-layer path adds the bias after the quantized GEMV: y + bias */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < l->N; n++) y[m * l->N + n] += bias[n];
}

/* bf16 activations: bf16 weights only, native.c's bf16 GEMV (the per-layer path's ``native.linear`` for bf16 decode
 * rows; the bias added in fp32 before the one rounding to bf16). */
static void linear_run_bf16(const linear_t *l, const uint16_t *x, uint16_t *y, int64_t M) {
    gemv_bf16((const uint16_t *)l->w, x, (const uint16_t *)l->bias, y, M, l->N, l->K);
}

/* Rows n0..n1 of one quantized linear for one thread of an enclosing team, no OpenMP inside; xp: the activations
 * xprep laid out (int8-activation kernels only). */
static void linear_rows(const linear_t *l, const xprep_t *xp, const float *x, float *y, int64_t M, int64_t n0,
                        int64_t n1) {
    if (l->kind == LIN_INT8 && (l->K % QB || l->G % QB))
        q8_exact_rows((const int8_t *)l->w, l->scales, (int)l->scale_fmt, x, 0, y, M, l->N, l->K, l->G, n0, n1);
    else if (l->kind == LIN_INT8)
        q8_q8_rows((const int8_t *)l->w, l->scales, (int)l->scale_fmt, xp, 0, y, M, l->N, l->K, l->G, n0, n1);
    else
        q4_q8_rows((const uint8_t *)l->w, l->scales, l->mins, (int)l->scale_fmt, xp, 0, y, M, l->N, l->K, l->G, n0,
                   n1);
    const float *bias = (const float *)l->bias;
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) y[m * l->N + n] += bias[n];
}

static int linear_uses_xprep(const linear_t *l) {
    return l->kind == LIN_INT4 || (l->kind == LIN_INT8 && l->K % QB == 0 && l->G % QB == 0);
}

/* Benchmark entry (perf/bench/quant.py's native stack rows): the linears lins[0..n) in order, y_i [M, N_i] =
 * x_i [M, K_i] @ W_i^T (+ bias), with no Python between them, so a stack's time is its kernels' alone (Python
 * dispatch costs microseconds a call, 120 times over SmolLM2's linears); fp32 activations (every kind but LIN_BF16).
 * one_region = 0: each through linear_run_f32, as decode_stack runs them (an OpenMP region per GEMV: quant.c's
 * SPLIT_ROWS).  one_region = 1: one region for the whole stack, thread 0 preparing each GEMV's activations, the rows
 * split in contiguous equal ranges (multiples of 4: q4_q8_rows' tile), a barrier before and after each GEMV — the
 * layout a fused step inside one region would have, to measure what the per-GEMV regions cost next to it.  The outputs are the same either way (a row's result does
 * not depend on which thread computes it). */
void linear_stack(const linear_t *lins, int64_t n, const float *const *xs, float *const *ys, int64_t M,
                  int64_t one_region) {
    if (!one_region) {
        for (int64_t i = 0; i < n; i++) linear_run_f32(lins + i, xs[i], ys[i], M);
        return;
    }
    size_t bytes = 0;
    for (int64_t i = 0; i < n; i++)
        if (linear_uses_xprep(lins + i)) {
            const size_t b = xprep_bytes(M, lins[i].K, lins[i].G, lins[i].kind == LIN_INT4);
            bytes = b > bytes ? b : bytes;
        }
    void *buf = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    xprep_t xp = {0};
#pragma omp parallel
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int64_t i = 0; i < n; i++) {
            const linear_t *l = lins + i;
            if (t == 0 && linear_uses_xprep(l))
                xp = xprep(xs[i], 0, M, l->K, l->G, l->kind == LIN_INT4, buf, bytes);
#pragma omp barrier
            const int64_t q = (l->N + 3) / 4; /* 4-row tiles */
            const int64_t n0 = q * t / T * 4, n1 = q * (t + 1) / T * 4;
            if (l->kind != LIN_F32 && l->kind != LIN_W8A8 && l->kind != LIN_Q6K)
                linear_rows(l, &xp, xs[i], ys[i], M, n0 < l->N ? n0 : l->N, n1 < l->N ? n1 : l->N);
            else if (t == 0) /* no row-range fp32 / W8A8 / Q6_K GEMM here: theirs open a region, one thread inside */
                linear_run_f32(l, xs[i], ys[i], M);
#pragma omp barrier
        }
    }
    free(buf);
}

/* Bytes of one stored weight, scales and mins included, read per row: [row bytes of w, of scales, of mins]. */
static void linear_row_bytes(const linear_t *l, int64_t out[3]) {
    const int64_t ng = l->G ? l->K / l->G : 0, sb = ng ? scale_byte((int)l->scale_fmt, ng) : 0; /* a row's */
    const int dense = l->kind == LIN_F32 || l->kind == LIN_BF16;
    out[0] = l->kind == LIN_F32  ? 4 * l->K
             : l->kind == LIN_BF16 ? 2 * l->K
             : l->kind == LIN_INT4 ? l->K / 2
             : l->kind == LIN_Q6K  ? l->K / 256 * 210 /* scales inside the blocks */
                                   : l->K;
    out[1] = dense || l->kind == LIN_Q6K ? 0 : sb;
    out[2] = l->kind == LIN_INT4 && l->mins ? sb : 0; /* Q4_0 stores no mins */
}

/* The memory roof of linear_stack's access pattern (perf/bench/quant.py's "read-only" rows): every stored byte of
 * the linears lins[0..n) read once, in the same order, each weight's rows split across the threads as the GEMVs
 * split them (one region per weight, contiguous equal ranges), with no arithmetic but an OR.  A GEMV over the stack
 * cannot be faster than this; the ratio of the two is the kernel's own efficiency, apart from the cost of streaming
 * 120 weights of 0.2-1 MB each in halves (every region restarts two streams the hardware prefetchers must learn
 * again), which a single 256 MiB read does not pay.  Returns the OR of the bytes' 64-bit words (kept, so the reads
 * are not optimised away). */
uint64_t stack_read(const linear_t *lins, int64_t n) {
    uint64_t acc = 0;
    for (int64_t i = 0; i < n; i++) {
        const linear_t *l = lins + i;
        int64_t rb[3];
        linear_row_bytes(l, rb);
        const void *base[3] = {l->w, l->scales, l->mins};
        const int64_t N = l->N;
#pragma omp parallel reduction(| : acc)
        {
            const int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), n0 = N * t / T, n1 = N * (t + 1) / T;
            uint64_t a[8] = {0};
            for (int s = 0; s < 3; s++) {
                if (!rb[s] || !base[s]) continue;
                const unsigned char *p = (const unsigned char *)base[s] + n0 * rb[s];
                const int64_t bytes = (n1 - n0) * rb[s];
                int64_t j = 0;
                for (; j + 64 <= bytes; j += 64) /* a cache line a step: 8 words ORed into 8 lanes (vectorised) */
                    for (int k = 0; k < 8; k++) {
                        uint64_t v;
                        memcpy(&v, p + j + 8 * k, 8);
                        a[k] |= v;
                    }
                for (; j < bytes; j++) a[0] |= p[j];
            }
            for (int k = 0; k < 8; k++) acc |= a[k];
        }
    }
    return acc;
}

/* Floats of scratch decode_stack needs for M rows (the caller allocates it once for its largest M). */
int64_t decode_scratch_floats(int64_t M, int64_t hidden, int64_t Hq, int64_t Hkv, int64_t D, int64_t F) {
    return M * (4 * hidden + (Hq + 2 * Hkv) * D + (Hq + Hkv) * D + Hq * D + 3 * F + 2 * D);
}

/* The decoder stack for M rows: x [M, hidden] (the token embeddings) -> out [M, hidden], the final-normed hidden
 * states, and when head is not NULL the LM head's logits [M, V] = out @ head^T (the head stays with the rest: a
 * Python call would pick another kernel past 8 rows and cost its own dispatch).  cos_tab / sin_tab [P, D]: RoPE's
 * tables for positions 0..P-1 (rows picked by positions [M]); slots [M] int64 flat KV slots; tables [M, W] int32
 * block tables; lens [M] int32 context lengths.  eps: every RMSNorm's; scale: attention's softmax scale.  scratch:
 * decode_scratch_floats(M, ...) floats.  Per layer, as models/llama.py DecoderLayer: (add +) RMSNorm, qkv, RoPE on q
 * and k, K/V to their slots, paged attention, o_proj, add + RMSNorm, gate_up, SiLU·mul, down; then the final
 * add + norm.
 *
 * One body for both activation dtypes (T float: decode_stack; T bf16 bits: decode_stack_bf16): x, out, logits, the
 * tables, the norms, the caches and every intermediate are T, and each step is native.c's T kernel — the ones the
 * per-layer path calls for T — so every intermediate is rounded to T where that path rounds it (each kernel's
 * output is a T tensor there too).  The bf16 step's linears are bf16 weights (linear_run_bf16). */
#define DECODE_STACK(NAME, T, SFX)                                                                                  \
    void NAME(const layer_t *layers, int64_t n_layers, const T *x, const T *final_norm, const T *cos_tab,           \
              const T *sin_tab, const int64_t *positions, const int64_t *slots, const int32_t *tables,              \
              const int32_t *lens, int64_t M, int64_t W, int64_t hidden, int64_t Hq, int64_t Hkv, int64_t D,        \
              int64_t F, int64_t block_size, float eps, float scale, const linear_t *head, float *scratch, T *out,   \
              T *logits) {                                                                                          \
        const int64_t nqk = (Hq + Hkv) * D, nqkv = (Hq + 2 * Hkv) * D;                                              \
        T *res_a = (T *)scratch, *res_b = res_a + M * hidden, *h = res_b + M * hidden, *mo = h + M * hidden;        \
        T *qkv = mo + M * hidden, *qk = qkv + M * nqkv, *att = qk + M * nqk, *gu = att + M * Hq * D;                \
        T *act = gu + 2 * M * F, *cs = act + M * F, *sn = cs + M * D;                                               \
        for (int64_t m = 0; m < M; m++) { /* this step's RoPE rows, [M, D] each */                                  \
            memcpy(cs + m * D, cos_tab + positions[m] * D, sizeof(T) * D);                                          \
            memcpy(sn + m * D, sin_tab + positions[m] * D, sizeof(T) * D);                                          \
        }                                                                                                           \
        if (n_layers == 0) {                                                                                        \
            rms_norm_##SFX(x, final_norm, out, M, hidden, eps);                                                     \
            if (head) linear_run_##SFX(head, out, logits, M);                                                       \
            return;                                                                                                 \
        }                                                                                                           \
        /* the residual stream ping-pongs between two buffers: add_rms_norm's output may not alias its inputs */    \
        const T *res = x;                                                                                           \
        T *spare = res_a;                                                                                           \
        for (int64_t l = 0; l < n_layers; l++) {                                                                    \
            const layer_t *L = layers + l;                                                                          \
            T *kc = (T *)L->k_cache, *vc = (T *)L->v_cache;                                                         \
            if (l == 0) {                                                                                           \
                rms_norm_##SFX(x, (const T *)L->input_norm, h, M, hidden, eps);                                     \
            } else {                                                                                                \
                add_rms_norm_##SFX(mo, res, (const T *)L->input_norm, h, spare, M, hidden, eps);                    \
                res = spare;                                                                                        \
                spare = spare == res_a ? res_b : res_a;                                                             \
            }                                                                                                       \
            linear_run_##SFX(&L->qkv, h, qkv, M); /* (M, (H_q + 2 H_kv) D) */                                       \
            rope_##SFX(qkv, cs, sn, qk, M, Hq + Hkv, D, nqkv); /* q and k rotated: (M, H_q + H_kv, D) */            \
            write_kv((const char *)(qk + Hq * D), (const char *)(qkv + nqk), (char *)kc, (char *)vc, slots, M,      \
                     Hkv * D, nqk, nqkv, sizeof(T));                                                                \
            paged_decode_attention_##SFX(qk, kc, vc, tables, lens, att, M, Hq, Hkv, D, block_size, W, scale, nqk,   \
                                         D); /* (M, H_q, D) */                                                      \
            linear_run_##SFX(&L->o, att, mo, M);                                                                    \
            add_rms_norm_##SFX(mo, res, (const T *)L->post_norm, h, spare, M, hidden, eps);                         \
            res = spare;                                                                                            \
            spare = spare == res_a ? res_b : res_a;                                                                 \
            linear_run_##SFX(&L->gate_up, h, gu, M); /* (M, 2F) */                                                  \
            silu_mul_##SFX(gu, act, M, F);                                                                          \
            linear_run_##SFX(&L->down, act, mo, M);                                                                 \
        }                                                                                                           \
        add_rms_norm_##SFX(mo, res, final_norm, out, spare, M, hidden, eps);                                        \
        if (head) linear_run_##SFX(head, out, logits, M); /* (M, V) */                                              \
    }

DECODE_STACK(decode_stack, float, f32)
DECODE_STACK(decode_stack_bf16, uint16_t, bf16)
