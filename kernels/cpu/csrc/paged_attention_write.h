/*
 * The K/V write of paged_attention_cpu.c: this step's rows into their cache slots, in
 * either cache layout. Kept in its own file for length only: it is included once, at
 * this point of that source, whose shape_t and cache_at it uses.
 */
#include <string.h>

#include "abi.h"
#include "convert.h"

/* Rows ``[t0, t1)`` of ``key``/``value`` (``num_kv_heads * head_dim`` elements of
 * ``src_dtype``, rows ``kv_stride`` elements apart) to cache slots ``slots[t]``; -1 is
 * skipped. A slot's heads are one copy where the layout keeps them together. float32
 * rows into a 16-bit cache are rounded to nearest even, as torch's ``.to()``; into an
 * int8 cache each head's row is quantized (quantize_row_i8). */
typedef struct {
    const shape_t *sh;
    void *k_cache, *v_cache;
    const void *key, *value;
    int64_t kv_stride;
    const int64_t *slots;
    int dtype, src_dtype;
} write_task_t;

static void convert_row(void *dst, const float *src, int n, int dtype) {
    if (dtype == DTYPE_BF16) {
        uint16_t *d = dst;
        for (int i = 0; i < n; ++i) d[i] = f32_bf16(src[i]);
        return;
    }
#ifdef __FLT16_MAX__
    _Float16 *d = dst;
    for (int i = 0; i < n; ++i) d[i] = (_Float16)src[i];
#endif
}

/* One KV head's ``n`` float32 values as an int8 cache row: ``n`` codes, then the scale
 * (abi.h's DTYPE_I8; kernels/torch_ref.py's quantize_kv_rows gives the same bits). A NaN
 * value's code is 0. */
static void quantize_row_i8(char *dst, const float *src, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) {
        const float a = fabsf(src[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int8_t *q = (int8_t *)dst;
    for (int i = 0; i < n; ++i) {
        float v = rintf(src[i] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)(v == v ? v : 0.0f);
    }
    memcpy(dst + n, &d, sizeof d);
}

static void write_rows(void *ctx, int64_t t0, int64_t t1, int worker) {
    (void)worker;
    const write_task_t *w = ctx;
    const shape_t *sh = w->sh;
    const int D = sh->head_dim, bs = sh->block_size;
    if (w->dtype == DTYPE_I8) { /* from float32 rows (checked), a head at a time */
        for (int64_t t = t0; t < t1; ++t) {
            if (w->slots[t] < 0) continue;
            const int64_t block = w->slots[t] / bs;
            const int r = (int)(w->slots[t] % bs);
            for (int h = 0; h < sh->num_kv_heads; ++h) {
                const int64_t dst = cache_at(sh, block, r, h), src = t * w->kv_stride + (int64_t)h * D;
                quantize_row_i8((char *)w->k_cache + dst, (const float *)w->key + src, D);
                quantize_row_i8((char *)w->v_cache + dst, (const float *)w->value + src, D);
            }
        }
        return;
    }
    const int elem = w->dtype == DTYPE_F32 ? 4 : 2, src_elem = w->src_dtype == DTYPE_F32 ? 4 : 2;
    const int together = sh->head_stride == D, copies = together ? 1 : sh->num_kv_heads;
    const int n = (together ? sh->num_kv_heads : 1) * D; /* elements a copy */
    for (int64_t t = t0; t < t1; ++t) {
        if (w->slots[t] < 0) continue;
        const int64_t block = w->slots[t] / bs;
        const int r = (int)(w->slots[t] % bs);
        for (int h = 0; h < copies; ++h) {
            const int64_t dst = cache_at(sh, block, r, h) * elem;
            const int64_t src = (t * w->kv_stride + (int64_t)h * D) * src_elem;
            char *k_dst = (char *)w->k_cache + dst, *v_dst = (char *)w->v_cache + dst;
            const char *k_src = (const char *)w->key + src, *v_src = (const char *)w->value + src;
            if (w->src_dtype == w->dtype) {
                memcpy(k_dst, k_src, (size_t)n * elem);
                memcpy(v_dst, v_src, (size_t)n * elem);
            } else {
                convert_row(k_dst, (const float *)k_src, n, w->dtype);
                convert_row(v_dst, (const float *)v_src, n, w->dtype);
            }
        }
    }
}
