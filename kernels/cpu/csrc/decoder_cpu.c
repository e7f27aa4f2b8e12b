/*
 * A whole stack of decoder layers in one call, for steps whose every linear runs in
 * this library (decode steps and short chunks).
 *
 * Driven from Python, a decode step of a 30-layer model makes ~300 calls into this
 * library (two norms, four linears, two RoPEs, attention and SiLU-and-multiply a
 * layer), each with its argument checks, tensor allocations and ctypes marshalling:
 * milliseconds a step when the arithmetic of a small model takes a few more. Here the
 * same kernels run in the same order with the same arguments and thread counts, so the
 * result is bit-identical to the per-op path; only the Python between them is gone.
 *
 * The model is described once by two int64 tables (the DM_* and DL_* offsets of
 * abi.h): its sizes, and per layer the addresses of its norms, KV caches and linears.
 * A linear is either a float32 weight packed for gemm_f32 (LIN_F32) or a weight-only
 * quantized one in a QF_* format packed for qgemm_packed; one whose weight columns are
 * stored in another order (act-order checkpoints, LIN_ORDER) multiplies its input
 * gathered in that order. Activations are float32 throughout.
 *
 * Gemma's layers (DM_ACTIVATION, DL_ATTN_OUT_NORM, DL_MLP_OUT_NORM) norm the attention's
 * and the MLP's outputs before their residual adds and gate the MLP with GELU-tanh; its
 * norm weights arrive as 1 + weight. Each layer names its RoPE tables (Gemma 3's sliding
 * layers rotate at another base) and its KV group: with a hybrid cache the sliding
 * layers read their own block tables and write their own slots (the DS_* step table).
 *
 * A layer with experts (DL_MOE) routes each row as engine/models/moe.py does: a softmax
 * over the router's logits, the top_k most likely experts (the lower index first on a
 * tie), their probabilities renormalized where MOE_NORM_TOPK says; the rows are grouped
 * by expert and every expert the step uses multiplies its rows in one call per
 * projection; a row's outputs, each scaled by its weight, are summed in ascending expert
 * order. The products and sums are the per-op path's, bit for bit; the softmax and the
 * shared expert's sigmoid use libm's expf, not torch's vectorized exp, so those (and the
 * outputs after them) can differ from the per-op path in the last bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "abi.h"

#define PTR(table, i) ((void *)(intptr_t)(table)[i])

/* The widest input of a layer's linears. */
static int64_t max_k(const int64_t *model) {
    const int64_t hidden = model[DM_HIDDEN], q = model[DM_HEADS] * model[DM_HEAD_DIM];
    const int64_t wide = hidden > q ? hidden : q;
    return wide > model[DM_INTER] ? wide : model[DM_INTER];
}

/* Scratch floats per row: the normed input, the fused QKV row, the attention output,
 * the gate/up row and its SiLU product, the row's cos and sin, and a linear's input
 * gathered in its weight's column order. */
static int64_t scratch_per_row(const int64_t *model) {
    const int64_t hidden = model[DM_HIDDEN], d = model[DM_HEAD_DIM];
    const int64_t q = model[DM_HEADS] * d, kv = model[DM_KV_HEADS] * d;
    return hidden + (q + 2 * kv) + q + 3 * model[DM_INTER] + 2 * d + max_k(model);
}

int64_t decoder_scratch_size(const int64_t *model, int rows) {
    return (scratch_per_row(model) + model[DM_MOE_ROW]) * rows;
}

/* Scratch floats a row for the experts of ``moe``: the router's logits, the expert
 * counts (int32, E + 1 a call), the row's weights, its experts and their slots (int32),
 * its gathered inputs and its experts' outputs, their gate/up and SiLU rows (or the
 * shared expert's), the shared gate's logit, the router's taken flags (E bytes a call),
 * and a linear's gathered input. */
int64_t moe_scratch_per_row(const int64_t *moe, int64_t hidden) {
    const int64_t e = moe[MOE_EXPERTS], k = moe[MOE_TOP_K], inter = moe[MOE_INTER];
    const int64_t shared = moe[MOE_SHARED_INTER];
    const int64_t act = k * inter > shared ? k * inter : shared;
    int64_t widest = hidden > inter ? hidden : inter;
    widest = widest > shared ? widest : shared;
    return 3 * e + 1 + 3 * k + 2 * k * hidden + 3 * act + 1 + widest;
}

/* y [rows, n] = x [rows, k] @ W^T (+ bias) for the linear at ``lin`` (LIN_* offsets);
 * ``gather`` holds rows * k floats for an input taken in LIN_ORDER. A pair-packed
 * gate/up weight (LIN_F32_PAIR) gives its product as ``pair_mode`` says: PAIR_SPLIT the
 * plain one, PAIR_SILU or PAIR_GELU_TANH its gate, y [rows, n / 2]. */
static int linear_as(const int64_t *lin, const float *x, int rows, float *y, float *gather,
                     int pair_mode, int num_threads) {
    const int64_t n = lin[LIN_N], k = lin[LIN_K];
    const float *bias = PTR(lin, LIN_BIAS);
    const int64_t *order = PTR(lin, LIN_ORDER);
    if (order) {
        for (int r = 0; r < rows; ++r)
            for (int64_t j = 0; j < k; ++j) gather[r * k + j] = x[r * k + order[j]];
        x = gather;
    }
    if (lin[LIN_FMT] == LIN_F32) {
        gemm_f32(x, k, rows, k, PTR(lin, LIN_W), n, bias, y, n, num_threads);
        return 0;
    }
    if (lin[LIN_FMT] == LIN_F32_PAIR)
        return gemm_f32_pair(x, k, rows, k, PTR(lin, LIN_W), n / 2, bias, pair_mode, y,
                             pair_mode == PAIR_SPLIT ? n : n / 2, num_threads)
                   ? DEC_ERR_LINEAR
                   : 0;
    if (lin[LIN_FMT] == LIN_STACK) { /* each part's columns of y in turn */
        const int64_t *parts = PTR(lin, LIN_W);
        int64_t col = 0;
        for (int64_t p = 0; p < parts[0]; ++p) {
            const int64_t *part = parts + 1 + p * LIN_SIZE;
            if (qgemm_packed((int)part[LIN_FMT], x, k, rows, k, PTR(part, LIN_W), part[LIN_N],
                             PTR(part, LIN_BIAS), y + col, n, num_threads))
                return DEC_ERR_LINEAR;
            col += part[LIN_N];
        }
        return 0;
    }
    return qgemm_packed((int)lin[LIN_FMT], x, k, rows, k, PTR(lin, LIN_W), n, bias, y, n,
                        num_threads)
               ? DEC_ERR_LINEAR
               : 0;
}

/* linear_as with a pair-packed weight's plain product. */
static int linear(const int64_t *lin, const float *x, int rows, float *y, float *gather,
                  int num_threads) {
    return linear_as(lin, x, rows, y, gather, PAIR_SPLIT, num_threads);
}

/* RMSNorm of each head of the ``heads`` heads at the start of every row (row stride
 * ``stride``), in place: the per-head norm of Qwen3's queries and keys. */
static void head_norm(float *x, int64_t stride, int rows, int heads, int head_dim,
                      const float *weight, float eps, int num_threads) {
    for (int r = 0; r < rows; ++r)
        add_rms_norm_f32(x + r * stride, 0, weight, eps, x + r * stride, heads, head_dim,
                         head_dim, num_threads);
}

/* Whether probability ``a`` ranks above ``b`` (a NaN above any number, as torch.topk
 * ranks it). */
static int ranks_above(float a, float b) { return isnan(b) ? 0 : isnan(a) || a > b; }

/* The top_k experts of one row's router ``logits`` [E] and their weights, the experts in
 * ascending order; ``taken`` holds E flags. A row of NaN logits gets NaN weights. */
static void route(const float *logits, int e, int k, int norm, int32_t *experts,
                  float *weights, float *probs, unsigned char *taken) {
    float mx = logits[0];
    for (int i = 1; i < e; ++i) mx = logits[i] > mx ? logits[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i < e; ++i) sum += probs[i] = expf(logits[i] - mx);
    for (int i = 0; i < e; ++i) probs[i] /= sum;
    memset(taken, 0, (size_t)e);
    float total = 0.0f;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int i = 0; i < e; ++i)
            if (!taken[i] && (best < 0 || ranks_above(probs[i], probs[best]))) best = i;
        taken[best] = 1; /* k <= e: an expert is always left */
        experts[j] = best;
        weights[j] = probs[best];
        total += probs[best];
    }
    if (norm)
        for (int j = 0; j < k; ++j) weights[j] /= total;
    for (int j = 1; j < k; ++j) /* insertion sort by expert, the weights alongside */
        for (int i = j; i > 0 && experts[i - 1] > experts[i]; --i) {
            const int32_t t = experts[i];
            experts[i] = experts[i - 1];
            experts[i - 1] = t;
            const float w = weights[i];
            weights[i] = weights[i - 1];
            weights[i - 1] = w;
        }
}

/* out [rows, hidden] = the experts of the table ``moe`` on x [rows, hidden]. */
static int experts_forward(const int64_t *moe, const float *x, int rows, int hidden,
                           float *out, float *scratch, int num_threads) {
    const int e = (int)moe[MOE_EXPERTS], k = (int)moe[MOE_TOP_K], inter = (int)moe[MOE_INTER];
    const int shared = (int)moe[MOE_SHARED_INTER];
    const int64_t act_w = (int64_t)k * inter > shared ? (int64_t)k * inter : shared;
    float *logits = scratch;
    int32_t *counts = (int32_t *)(logits + (int64_t)rows * e); /* e + 1 of rows * (e + 1) */
    float *weights = (float *)counts + (int64_t)rows * (e + 1);
    int32_t *chosen = (int32_t *)(weights + (int64_t)rows * k);
    int32_t *slot = chosen + (int64_t)rows * k;
    float *xs = (float *)(slot + (int64_t)rows * k);
    float *ys = xs + (int64_t)rows * k * hidden;
    float *gate_up = ys + (int64_t)rows * k * hidden;
    float *act = gate_up + (int64_t)rows * 2 * act_w;
    float *shared_logit = act + (int64_t)rows * act_w;
    unsigned char *taken = (unsigned char *)(shared_logit + rows);
    float *gather = shared_logit + rows + (int64_t)rows * e;
    int status = linear(moe + MOE_ROUTER, x, rows, logits, gather, num_threads);
    if (status) return status;
    for (int r = 0; r < rows; ++r) /* the probabilities overwrite the row's logits */
        route(logits + (int64_t)r * e, e, k, (int)moe[MOE_NORM_TOPK], chosen + r * k,
              weights + r * k, logits + (int64_t)r * e, taken);
    memset(counts, 0, sizeof(int32_t) * (e + 1));
    for (int i = 0; i < rows * k; ++i) ++counts[chosen[i] + 1];
    for (int i = 0; i < e; ++i) counts[i + 1] += counts[i]; /* counts[i]: expert i's first slot */
    for (int r = 0; r < rows; ++r) /* rows in order within an expert, as a stable sort */
        for (int j = 0; j < k; ++j) {
            const int s = counts[chosen[r * k + j]]++;
            slot[r * k + j] = s;
            memcpy(xs + (int64_t)s * hidden, x + (int64_t)r * hidden, sizeof(float) * hidden);
        }
    for (int i = 0, begin = 0; i < e; ++i) { /* counts[i] is now expert i's end */
        const int n = counts[i] - begin;
        if (n) {
            const int64_t *lin = moe + MOE_FIRST_EXPERT + 2 * (int64_t)i * LIN_SIZE;
            if ((status = linear(lin, xs + (int64_t)begin * hidden, n, gate_up, gather,
                                 num_threads)))
                return status;
            silu_mul_f32(gate_up, act, n, inter, num_threads);
            if ((status = linear(lin + LIN_SIZE, act, n, ys + (int64_t)begin * hidden, gather,
                                 num_threads)))
                return status;
        }
        begin = counts[i];
    }
    for (int r = 0; r < rows; ++r) {
        float *o = out + (int64_t)r * hidden;
        for (int j = 0; j < k; ++j) {
            const float *y = ys + (int64_t)slot[r * k + j] * hidden;
            const float w = weights[r * k + j];
            if (j == 0)
                for (int h = 0; h < hidden; ++h) o[h] = y[h] * w;
            else
                for (int h = 0; h < hidden; ++h) o[h] = o[h] + y[h] * w;
        }
    }
    if (!shared) return 0;
    if ((status = linear(moe + MOE_SHARED_GATE, x, rows, shared_logit, gather, num_threads)) ||
        (status = linear(moe + MOE_SHARED_GATE_UP, x, rows, gate_up, gather, num_threads)))
        return status;
    silu_mul_f32(gate_up, act, rows, shared, num_threads);
    if ((status = linear(moe + MOE_SHARED_DOWN, act, rows, ys, gather, num_threads)))
        return status;
    for (int r = 0; r < rows; ++r) {
        const float g = 1.0f / (1.0f + expf(-shared_logit[r]));
        float *o = out + (int64_t)r * hidden;
        const float *y = ys + (int64_t)r * hidden;
        for (int h = 0; h < hidden; ++h) o[h] = o[h] + g * y[h];
    }
    return 0;
}

/* RMSNorm of each row of x [rows, n], in place (Gemma's norms of the attention's and the
 * MLP's outputs; 0: none). */
static void out_norm(float *x, const float *weight, float eps, int rows, int n,
                     int num_threads) {
    if (weight) add_rms_norm_f32(x, 0, weight, eps, x, rows, n, n, num_threads);
}

/* Each row's RoPE cos and sin [rows, d] from the tables [max_len, d] at its position. */
static void gather_rope(const float *cos_table, const float *sin_table, const int64_t *positions,
                        int rows, int d, float *cos, float *sin) {
    for (int r = 0; r < rows; ++r) {
        memcpy(cos + (int64_t)r * d, cos_table + positions[r] * d, sizeof(float) * d);
        memcpy(sin + (int64_t)r * d, sin_table + positions[r] * d, sizeof(float) * d);
    }
}

int decoder_layers(const int64_t *model, const int64_t *layers, const int64_t *steps,
                   float *residual, float *out, float eps, float scale, float softcap,
                   const int64_t *positions, int rows, int num_seqs, float *scratch,
                   int num_threads) {
    const int hidden = (int)model[DM_HIDDEN], heads = (int)model[DM_HEADS];
    const int kv_heads = (int)model[DM_KV_HEADS], d = (int)model[DM_HEAD_DIM];
    const int inter = (int)model[DM_INTER];
    const int64_t q_size = (int64_t)heads * d, kv_size = (int64_t)kv_heads * d;
    const int64_t width = q_size + 2 * kv_size;
    float *x = scratch;
    float *qkv = x + (int64_t)rows * hidden;
    float *attn = qkv + rows * width;
    float *gate_up = attn + rows * q_size;
    float *act = gate_up + (int64_t)rows * 2 * inter;
    float *cos = act + (int64_t)rows * inter;
    float *sin = cos + (int64_t)rows * d;
    float *gather = sin + (int64_t)rows * d;
    const float *rope_of = 0; /* the table whose rows cos and sin hold */
    for (int64_t l = 0; l < model[DM_NUM_LAYERS]; ++l) {
        const int64_t *layer = layers + l * DL_SIZE;
        const int64_t *step = steps + layer[DL_GROUP] * DS_SIZE;
        if (PTR(layer, DL_COS) != rope_of) {
            rope_of = PTR(layer, DL_COS);
            gather_rope(rope_of, PTR(layer, DL_SIN), positions, rows, d, cos, sin);
        }
        /* The previous layer's MLP output is in ``out``; the first layer's input is the
         * embedding, already in ``residual``. */
        add_rms_norm_f32(residual, l ? out : 0, PTR(layer, DL_INPUT_NORM), eps, x, rows,
                         hidden, hidden, num_threads);
        int status = linear(layer + DL_QKV, x, rows, qkv, gather, num_threads);
        if (status) return status;
        if (layer[DL_Q_NORM]) {
            head_norm(qkv, width, rows, heads, d, PTR(layer, DL_Q_NORM), eps, num_threads);
            head_norm(qkv + q_size, width, rows, kv_heads, d, PTR(layer, DL_K_NORM), eps,
                      num_threads);
        }
        rope_f32(qkv, width, rows, heads, d, cos, sin, num_threads);
        rope_f32(qkv + q_size, width, rows, kv_heads, d, cos, sin, num_threads);
        status = paged_attention(
            qkv, PTR(layer, DL_K_CACHE), PTR(layer, DL_V_CACHE), (int)model[DM_KV_DTYPE],
            (int)model[DM_KV_LAYOUT], PTR(step, DS_BLOCK_TABLES), PTR(step, DS_SEQ_LENS),
            PTR(step, DS_QUERY_START_LOC), width, attn, num_seqs, heads, kv_heads, d,
            (int)model[DM_BLOCK_SIZE], (int)model[DM_NUM_BLOCKS], (int)step[DS_MAX_BLOCKS],
            (int)step[DS_MAX_SEQ_LEN], scale, (int)layer[DL_WINDOW], softcap, qkv + q_size,
            qkv + q_size + kv_size, DTYPE_F32, width, PTR(step, DS_SLOTS), rows, num_threads);
        if (status) return status;
        if ((status = linear(layer + DL_O, attn, rows, out, gather, num_threads))) return status;
        out_norm(out, PTR(layer, DL_ATTN_OUT_NORM), eps, rows, hidden, num_threads);
        add_rms_norm_f32(residual, out, PTR(layer, DL_POST_NORM), eps, x, rows, hidden, hidden,
                         num_threads);
        if (layer[DL_MOE]) {
            if ((status = experts_forward(PTR(layer, DL_MOE), x, rows, hidden, out,
                                          gather + (int64_t)rows * max_k(model), num_threads)))
                return status;
            out_norm(out, PTR(layer, DL_MLP_OUT_NORM), eps, rows, hidden, num_threads);
            continue;
        }
        const int gelu = model[DM_ACTIVATION] == ACT_GELU_TANH;
        const int64_t *gu = layer + DL_GATE_UP;
        if (gu[LIN_FMT] == LIN_F32_PAIR) { /* the gate in the product's epilogue */
            if ((status = linear_as(gu, x, rows, act, gather, gelu ? PAIR_GELU_TANH : PAIR_SILU,
                                    num_threads)))
                return status;
        } else {
            if ((status = linear(gu, x, rows, gate_up, gather, num_threads))) return status;
            if (gelu)
                gelu_tanh_mul_f32(gate_up, act, rows, inter, num_threads);
            else
                silu_mul_f32(gate_up, act, rows, inter, num_threads);
        }
        if ((status = linear(layer + DL_DOWN, act, rows, out, gather, num_threads))) return status;
        out_norm(out, PTR(layer, DL_MLP_OUT_NORM), eps, rows, hidden, num_threads);
    }
    return 0;
}
