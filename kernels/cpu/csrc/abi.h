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

/* KV cache element types (``dtype`` of paged_attention; its ``key_dtype``, the type of
 * the step's K/V rows, is the cache's or DTYPE_F32). */
#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_F16 2
/* An 8-bit cache: each KV head's row of a cache block is its head_dim int8 codes, then
 * their float32 scale (KV_I8_SCALE_BYTES more bytes), each value code * scale; the
 * cache's elements are bytes, head_dim + KV_I8_SCALE_BYTES a row. The step's K/V rows
 * come in float32 and are quantized on the way in: scale = max |x| / 127, code =
 * round-half-even(x * (1 / scale)), 0 for a zero row. */
#define DTYPE_I8 3
#define KV_I8_SCALE_BYTES 4

/* KV cache layouts (``kv_layout`` of paged_attention): the order of a cache block's
 * rows and KV heads, each head's head_dim elements contiguous. */
#define KV_ROWS_FIRST 0 /* [num_blocks, block_size, num_kv_heads, head_dim] */
#define KV_HEADS_FIRST 1 /* [num_blocks, num_kv_heads, block_size, head_dim] */

/* Weight-only quantization formats (``fmt`` of qgemm, qgemm_pack, qgemm_packed,
 * qdequant and qdequant_packed), and the weights per block along k of the GGUF formats:
 * QK for the first ones, QK_K for the K-quants. */
#define QF_Q8_0 0
#define QF_Q4_0 1
#define QF_Q4_1 2
#define QF_INT8 3
#define QF_Q5_0 4
#define QF_Q5_1 5
#define QF_Q4_K 6
#define QF_Q5_K 7
#define QF_Q6_K 8
/* Set in a format code (QF_Q8_0, QF_Q4_0, QF_Q4_1): its products quantize the
 * activations to 8 bits and take integer dot products (qgemm_i8.h), over a packed
 * layout of their own (qgemm_pack, qgemm_packed, qdequant_packed with the same code). */
#define QFLAG_I8A 64
#define QK 32
#define QK_K 256
/* Bytes of one GGML block of the formats kept as the file's blocks (Q5_0 .. Q6_K: one
 * plane, each row its blocks as the GGUF file stores them). */
#define QB_Q5_0 22
#define QB_Q5_1 24
#define QB_Q4_K 144
#define QB_Q5_K 176
#define QB_Q6_K 210

/* The longest head paged_attention and rope take (their stack buffers). */
#define MAX_HEAD_DIM 512

/* paged_attention's status codes (0: success); each comment is the caller's message. */
#define PA_ERR_GQA -1 /* num_heads is not a multiple of num_kv_heads */
#define PA_ERR_HEAD_DIM -2 /* head_dim outside 1..MAX_HEAD_DIM */
#define PA_ERR_DTYPE -3 /* unsupported KV cache dtype */
#define PA_ERR_NOMEM -4 /* out of memory for the kernel's buffers */
#define PA_ERR_RANGE -5 /* a context length, query length or block id is out of range */
#define PA_ERR_SLOT -6 /* a KV write slot is out of range */
#define PA_ERR_LAYOUT -8 /* unknown KV cache layout */
#define PA_ERR_BLOCK_SIZE -9 /* block_size is not positive */
#define PA_ERR_WINDOW -10 /* window is negative, or softcap is negative or not finite */

/* decoder_layers' model table: int64 entries at these offsets. */
#define DM_NUM_LAYERS 0
#define DM_HIDDEN 1
#define DM_HEADS 2
#define DM_KV_HEADS 3
#define DM_HEAD_DIM 4
#define DM_INTER 5
#define DM_KV_DTYPE 6
#define DM_BLOCK_SIZE 7
#define DM_NUM_BLOCKS 8
#define DM_KV_LAYOUT 9
#define DM_MOE_ROW 10 /* scratch floats a row the layers' experts need (moe_scratch_per_row) */
#define DM_ACTIVATION 11 /* the gated MLP's activation: ACT_SILU or ACT_GELU_TANH */
#define DM_SIZE 12
#define ACT_SILU 0
#define ACT_GELU_TANH 1
/* decoder_layers' layer table: DL_SIZE int64 entries a layer (addresses as integers,
 * 0 for none), its four linears at DL_QKV.. as LIN_SIZE entries each; DL_MOE: the
 * address of the layer's experts' table (MOE_*), which then stand in for DL_GATE_UP and
 * DL_DOWN. */
#define DL_INPUT_NORM 0
#define DL_POST_NORM 1
#define DL_Q_NORM 2
#define DL_K_NORM 3
#define DL_K_CACHE 4
#define DL_V_CACHE 5
#define DL_QKV 6
#define DL_O 12
#define DL_GATE_UP 18
#define DL_DOWN 24
#define DL_MOE 30
#define DL_WINDOW 31 /* the layer's sliding window (0: its whole context) */
/* Gemma: the RMSNorms of the attention's and the MLP's outputs before their residual
 * adds (0: none). */
#define DL_ATTN_OUT_NORM 32
#define DL_MLP_OUT_NORM 33
#define DL_COS 34 /* the layer's float32 RoPE tables [max_len, head_dim] */
#define DL_SIN 35
#define DL_GROUP 36 /* the KV group whose step entries (DS_*) the layer's attention reads */
#define DL_SIZE 37
/* decoder_layers' step table: DS_SIZE int64 entries a KV group (every group has the same
 * requests and query rows; its blocks and write slots are its own). */
#define DS_BLOCK_TABLES 0 /* int32 [num_seqs, DS_MAX_BLOCKS] */
#define DS_SEQ_LENS 1 /* int32 [num_seqs] */
#define DS_QUERY_START_LOC 2 /* int32 [num_seqs + 1], or 0 when every request decodes one row */
#define DS_SLOTS 3 /* int64 [rows] */
#define DS_MAX_BLOCKS 4
#define DS_MAX_SEQ_LEN 5
#define DS_SIZE 6
/* A layer's experts: their count, the experts a token takes, an expert's width, the
 * shared expert's width (0: none), whether a token's weights are renormalized to sum 1;
 * then LIN_SIZE entries each for the router, the shared expert's one-row gate, its
 * gate/up and its down (zeros without one), and from MOE_FIRST_EXPERT every expert's
 * gate/up and down. */
#define MOE_EXPERTS 0
#define MOE_TOP_K 1
#define MOE_INTER 2
#define MOE_SHARED_INTER 3
#define MOE_NORM_TOPK 4
#define MOE_ROUTER 5
#define MOE_SHARED_GATE 11
#define MOE_SHARED_GATE_UP 17
#define MOE_SHARED_DOWN 23
#define MOE_FIRST_EXPERT 29
/* A linear's entries: its format (LIN_F32: a float32 weight packed for gemm_f32, else a
 * QF_* code), the weight (gemm_f32's panels, or the quantized weight packed by
 * qgemm_pack), the bias, its shape, and the order of its input's columns that the
 * weight's columns are stored in (int64 [k]; 0: the input's own). */
#define LIN_FMT 0
#define LIN_W 1
#define LIN_BIAS 2
#define LIN_N 3
#define LIN_K 4
#define LIN_ORDER 5
#define LIN_SIZE 6
#define LIN_F32 -1
/* LIN_FMT of a stacked linear (parts of different QF_* formats, their outputs side by
 * side): LIN_W is the address of an int64 table of the part count, then LIN_SIZE entries
 * a part (its format, packed weight, bias or 0, rows, k; no order of its own). */
#define LIN_STACK -2
/* LIN_FMT of a float32 gate/up weight packed in pairs for gemm_f32_pair: the MLP's
 * gate comes from the product's epilogue. */
#define LIN_F32_PAIR -3
/* decoder_layers' own status code (it also returns paged_attention's). */
#define DEC_ERR_LINEAR -7 /* a quantized linear refused its format or shape */

/* How long the kernels' idle worker threads spin for the next task before they sleep
 * (microseconds; pool_set_spin_us changes it). */
#define DEFAULT_SPIN_US 300

/* pool.c: the kernels' thread pool. */
int pool_size(void);
void pool_set_spin_us(int spin_us);

/* paged_attention_cpu.c (``window`` > 0: each query attends to its last ``window``
 * positions only; ``softcap`` > 0: each scaled score s becomes softcap * tanh(s /
 * softcap); 0 and 0: the whole causal context, scores unchanged) */
int paged_attention(const float *query, void *k_cache, void *v_cache, int dtype, int kv_layout,
                    const int32_t *block_tables, const int32_t *seq_lens,
                    const int32_t *query_start_loc, int64_t q_stride, float *out, int num_seqs,
                    int num_heads, int num_kv_heads, int head_dim, int block_size, int num_blocks,
                    int max_blocks_per_seq, int max_seq_len, float scale, int window,
                    float softcap, const void *key, const void *value, int key_dtype,
                    int64_t kv_stride, const int64_t *slots, int num_rows, int num_threads);

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
/* gelu(gate, approximate="tanh") * up, as gate * sigmoid(2 * sqrt(2/pi) * (gate +
 * 0.044715 gate^3)) * up: the same function as 0.5 * gate * (1 + tanh(...)) * up. */
void gelu_tanh_mul_f32(const float *gate_up, float *out, int rows, int inter,
                       int num_threads);
void argmax_f32(const float *x, int64_t row_stride, int rows, int cols, int64_t *out,
                int num_threads);

/* gemm_cpu.c */
int gemm_f32_available(void);
int64_t gemm_f32_packed_size(int64_t n, int64_t k);
void gemm_f32_pack(const float *w, int64_t n, int64_t k, float *packed);
void gemm_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed,
              int64_t n, const float *bias, float *y, int64_t ldy, int num_threads);
/* A gate/up weight [2 * inter, k] packed in pairs of gate and up columns, and its product
 * (mode: the plain [m, 2 * inter] product, or act(gate) * up [m, inter]; -1 for another
 * mode). Available where gemm_f32 is. */
#define PAIR_NONE 0
#define PAIR_SPLIT 1
#define PAIR_SILU 2
#define PAIR_GELU_TANH 3
int64_t gemm_f32_pair_packed_size(int64_t inter, int64_t k);
void gemm_f32_pair_pack(const float *w, int64_t inter, int64_t k, float *packed);
int gemm_f32_pair(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed,
                  int64_t inter, const float *bias, int mode, float *y, int64_t ldy,
                  int num_threads);
/* GFLOP/s of num_threads threads' register-only multiply-adds (0 on the portable build,
 * or when OpenMP gives fewer threads). */
float fma_peak_gflops(int num_threads);

/* qgemm_cpu.c */
/* The 8-bit-activation products' integer dots (a bit each): AVX2's maddubs (on the AVX2
 * and AVX-512 builds) and VNNI's vpdpbusd (AVX-VNNI on AVX2 builds, AVX-512 VNNI on
 * AVX-512 builds, where the compiler has it), at 256 bits, or at 512 (VNNI512: two
 * column groups a vector, AVX-512 builds). qgemm_i8_dots_built: the kinds built (0 on
 * the portable build); qgemm_i8_dots: the kind in use (the widest VNNI built and on this
 * CPU, else maddubs);
 * qgemm_i8_use_dots: use one kind (0; -1 where not built or not on this CPU). Every kind
 * gives the same sums, bit for bit. */
#define I8_DOTS_MADDUBS 1
#define I8_DOTS_VNNI 2
#define I8_DOTS_VNNI512 4
int qgemm_i8_dots_built(void);
int qgemm_i8_dots(void);
int qgemm_i8_use_dots(int dots);
int qgemm_row_bytes(int fmt, int64_t k);
int64_t qgemm_packed_size(int fmt, int64_t n, int64_t k);
int qgemm_pack(int fmt, const void *qs, const uint16_t *d, const uint16_t *mn,
               const float *scale, int64_t n, int64_t k, void *packed);
int qgemm_packed(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k,
                 const void *packed, int64_t n, const float *bias, float *y, int64_t ldy,
                 int num_threads);
int qgemm(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k, const void *qs,
          const uint16_t *d, const uint16_t *mn, const float *scale, int64_t n,
          const float *bias, float *y, int64_t ldy, int num_threads);
int qdequant(int fmt, const void *qs, const uint16_t *d, const uint16_t *mn,
             const float *scale, int64_t k, const int64_t *rows, int64_t count, float *out,
             int num_threads);
int qdequant_packed(int fmt, const void *packed, int64_t n, int64_t k, const int64_t *rows,
                    int64_t count, float *out, int num_threads);

/* decoder_cpu.c */
int64_t decoder_scratch_size(const int64_t *model, int rows);
int64_t moe_scratch_per_row(const int64_t *moe, int64_t hidden);
/* ``softcap`` > 0: the attention's scores soft-capped (Gemma 2), as paged_attention's. */
int decoder_layers(const int64_t *model, const int64_t *layers, const int64_t *steps,
                   float *residual, float *out, float eps, float scale, float softcap,
                   const int64_t *positions, int rows, int num_seqs, float *scratch,
                   int num_threads);

/* shm_sync.c: shm_wait spins this often before it yields the core, and returns
 * SHM_TIMEOUT when its time is up with a flag still behind. */
#define SHM_SPINS 4000
#define SHM_TIMEOUT -1 /* a peer did not publish in time */
void shm_publish(int64_t *flag, int64_t seq);
int shm_wait(const int64_t *flags, int n, int64_t stride, int64_t seq, int64_t timeout_us);

#endif
