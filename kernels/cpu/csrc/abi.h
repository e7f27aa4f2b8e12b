/*
 * The interface of the native CPU library: the constants it shares with its Python
 * caller and the prototype of every exported function. Declared here only: every
 * source includes this header (so the compiler checks each definition against its
 * prototype), and kernels/cpu/abi.py reads it to get the same constants and to give
 * ctypes each function's signature. So this file keeps to what that reader parses:
 * ``#define NAME integer`` constants, each optionally followed by a one-line comment,
 * and prototypes whose parameter types are ``int``, ``int64_t``, ``float`` or pointers.
 */
#ifndef PAGEDSERVE_ABI_H
#define PAGEDSERVE_ABI_H

#include <stdint.h>

/* KV cache element types (``dtype`` of paged_attention). */
#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_F16 2

/* Weight-only quantization formats (``fmt`` of qgemm and qdequant), and the weights per
 * block along k of the GGUF formats. */
#define QF_Q8_0 0
#define QF_Q4_0 1
#define QF_Q4_1 2
#define QF_INT8 3
#define QK 32

/* The longest head paged_attention and rope take (their stack buffers). */
#define MAX_HEAD_DIM 512

/* paged_attention's status codes (0: success); each comment is the caller's message. */
#define PA_ERR_GQA -1 /* num_heads is not a multiple of num_kv_heads */
#define PA_ERR_HEAD_DIM -2 /* head_dim outside 1..MAX_HEAD_DIM */
#define PA_ERR_DTYPE -3 /* unsupported KV cache dtype */
#define PA_ERR_NOMEM -4 /* out of memory for the kernel's buffers */
#define PA_ERR_RANGE -5 /* a context length, query length or block id is out of range */
#define PA_ERR_SLOT -6 /* a KV write slot is out of range */

/* How long the kernels' idle worker threads spin for the next task before they sleep
 * (microseconds; pool_set_spin_us changes it). */
#define DEFAULT_SPIN_US 300

/* pool.c: the kernels' thread pool. */
int pool_size(void);
void pool_set_spin_us(int spin_us);

/* paged_attention_cpu.c */
int paged_attention(const float *query, void *k_cache, void *v_cache, int dtype,
                    const int32_t *block_tables, const int32_t *seq_lens,
                    const int32_t *query_start_loc, int64_t q_stride, float *out, int num_seqs,
                    int num_heads, int num_kv_heads, int head_dim, int block_size, int num_blocks,
                    int max_blocks_per_seq, int max_seq_len, float scale, const void *key,
                    const void *value, int64_t kv_stride, const int64_t *slots, int num_rows,
                    int num_threads);

/* fused_ops_cpu.c */
const char *simd_isa(void);
void add_rms_norm_f32(float *residual, const float *delta, const float *weight, float eps,
                      float *out, int rows, int dim, int64_t out_stride, int num_threads);
void add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, const uint16_t *weight,
                       float eps, uint16_t *out, int rows, int dim, int64_t out_stride,
                       int num_threads);
void rope_f32(float *x, int64_t row_stride, int rows, int heads, int head_dim,
              const float *cos, const float *sin, int num_threads);
void rope_bf16(uint16_t *x, int64_t row_stride, int rows, int heads, int head_dim,
               const uint16_t *cos, const uint16_t *sin, int num_threads);
void silu_mul_f32(const float *gate_up, float *out, int rows, int inter, int num_threads);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter,
                   int num_threads);
void argmax_f32(const float *x, int64_t row_stride, int rows, int cols, int64_t *out,
                int num_threads);

/* gemm_cpu.c */
int gemm_f32_available(void);
int64_t gemm_f32_packed_size(int64_t n, int64_t k);
void gemm_f32_pack(const float *w, int64_t n, int64_t k, float *packed);
void gemm_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed,
              int64_t n, const float *bias, float *y, int64_t ldy, int num_threads);

/* qgemm_cpu.c */
int qgemm_row_bytes(int fmt, int64_t k);
int qgemm(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k, const void *qs,
          const uint16_t *d, const uint16_t *mn, const float *scale, int64_t n,
          const float *bias, float *y, int64_t ldy, int num_threads);
int qdequant(int fmt, const void *qs, const uint16_t *d, const uint16_t *mn,
             const float *scale, int64_t k, const int64_t *rows, int64_t count, float *out,
             int num_threads);

#endif
