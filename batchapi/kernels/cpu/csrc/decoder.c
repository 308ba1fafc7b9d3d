/* A Llama-family decoder's layers in one call: each layer's input norm, qkv projection, rotary and
 * KV store (and the step's copies of a shared prefix's rows inside a block), paged attention, output
 * projection, post-attention norm and gated SiLU MLP, for all layers of a step, by the same C kernels
 * the model's Python calls one by one (elementwise.c, matmul.c, paged_decode.c), with the same
 * arguments: the same bits.
 *
 * Why: on a small CPU the Python between those ~300 calls a step (argument checks, torch.empty,
 * ctypes) ran on one thread while the other waited: 14-16% of a decode step's wall time at ~60
 * sequences on 2 cores (perf: the OpenMP worker spinning for its next region).
 *
 * In bf16 (the projections in linear_bf16 or linear_amx) or in float32 (the projections' weights
 * stored in bf16, linear_bf16w: a CPU without native bf16 matmuls); activations, norms, caches and
 * rope tables all of the one dtype the Python path would pass its kernels.
 *
 * The kernels live in their own libraries (each with its own state, such as matmul.c's choice of
 * instructions), so this one takes their entry points as function pointers, from ctypes. Built by
 * batchapi/kernels/cpu/build.py; called by batchapi/kernels/cpu/decoder.py.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*linear_fn)(const void *x, int64_t xs, int64_t m, const void *packed, int64_t n, int64_t k,
                         const float *bias, void *y, int64_t ys, int threads);
typedef int (*norm_fn)(const void *x, int64_t x_stride, const void *residual, int64_t residual_stride,
                       const void *weight, void *out, void *summed, int64_t rows, int64_t h, float eps, int bf16,
                       int threads);
typedef int (*act_fn)(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t inter, int bf16,
                      int threads);
typedef int (*rotary_store_fn)(const void *q, int64_t q_stride, int64_t hq, void *q_out, const void *k,
                               int64_t k_stride, const void *v, int64_t v_stride, int64_t hkv, void *k_cache,
                               void *v_cache, const void *slots, int slots_i64, int64_t num_slots,
                               const int64_t *positions, const void *cos_sin, int64_t cs_stride, int64_t max_pos,
                               int cs_bf16, int64_t rows, int64_t d, int bf16, int threads);
typedef int (*attention_fn)(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *context_lens, const int32_t *cu_seqlens_q,
                            int num_tables, const int32_t *seq_ids, int num_seqs, int64_t num_q_rows, void *out,
                            int hq, int hkv, int d, int bs, float scale, int window, float softcap, int num_threads);

/* the entry points, from their libraries */
typedef struct {
    norm_fn norm;
    act_fn act;
    rotary_store_fn rotary_store;
    attention_fn attention;
} Kernels;

/* one layer: its four projections (each its kernel and packed weight), norms and caches; gate_act_fn,
 * where not NULL, the gate_up projection and SiLU-and-mul in one kernel (matmul.c's linear_amx_silu:
 * the same bits as gate_up_fn then the act kernel), which writes act without gate_up */
typedef struct {
    linear_fn qkv_fn, o_fn, gate_up_fn, down_fn, gate_act_fn;
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias; /* as its kernel takes it (linear_bf16's panel form), or NULL */
    const void *input_norm, *post_norm;
    void *k_cache, *v_cache;
    const void *cos_sin; /* [max_pos, d] */
    int64_t cs_stride, max_pos;
    int cs_bf16, window;
} Layer;

/* what the layers share: the model's sizes */
typedef struct {
    int64_t hidden, inter, hq, hkv, d, block_size, num_slots;
    float eps, scale;
    int bf16; /* the activations' dtype: bf16, else float32 */
} Shape;

/* a step: its tokens, the attention plan (attention.py's _Plan) and the buffers the layers write */
typedef struct {
    int64_t tokens;
    const int64_t *positions;
    const void *slots;
    int slots_i64;
    const int32_t *tables, *context_lens, *q_rows, *rows; /* the plan: one query row a token */
    int64_t table_stride;
    const void *x;                  /* [T, hidden]: the embeddings, layer 0's input and first residual */
    void *mlp_out;                  /* [T, hidden]: each layer's output (its o_proj's on the way) */
    void *residual[2];              /* [T, hidden] each: the residual, written in turn */
    void *normed;                   /* [T, hidden] */
    void *qkv, *q, *attn;           /* [T, hq d + 2 hkv d], [T, hq d], [T, hq d] */
    void *gate_up, *act;            /* [T, 2 inter], [T, inter] */
    /* prefix reuse inside a block (the scheduler's KVCopy): after each layer's KV store, the rows of
     * slots copy_src[i] copied to copy_dst[i], wave by wave (wave w: [wave_ends[w-1], wave_ends[w])),
     * each wave's rows read before any is written, through copy_rows (the longest wave's rows) */
    int64_t num_waves;
    const int64_t *wave_ends, *copy_src, *copy_dst;
    void *copy_rows;
} Step;

/* the step's copies lie in the pool and its waves in order; else nothing may be copied */
static int copies_valid(const Step *st, int64_t num_slots) {
    int64_t from = 0;
    for (int64_t w = 0; w < st->num_waves; w++) {
        if (st->wave_ends[w] < from) return 0;
        for (int64_t i = from; i < st->wave_ends[w]; i++)
            if (st->copy_src[i] < 0 || st->copy_src[i] >= num_slots || st->copy_dst[i] < 0 ||
                st->copy_dst[i] >= num_slots)
                return 0;
        from = st->wave_ends[w];
    }
    return 1;
}

/* a layer's copies in one cache (rows of `row` bytes): as the Python path's flat[dst] = flat[src] */
static void copy_kv(const Step *st, char *cache, int64_t row) {
    char *rows = (char *)st->copy_rows;
    int64_t from = 0;
    for (int64_t w = 0; w < st->num_waves; w++) {
        const int64_t to = st->wave_ends[w];
        for (int64_t i = from; i < to; i++) memcpy(rows + (i - from) * row, cache + st->copy_src[i] * row, (size_t)row);
        for (int64_t i = from; i < to; i++) memcpy(cache + st->copy_dst[i] * row, rows + (i - from) * row, (size_t)row);
        from = to;
    }
}

/* Runs `num_layers` layers; after it mlp_out holds the last layer's output and residual[0] its
 * residual (an odd number of fused norms writes residual[0] last). Returns 0, or 1 + the layer whose
 * kernel refused its call: the caller runs the step's layers again in Python, whose wrapper of that
 * kernel raises what it raises. The checks that can refuse (positions, slots, the plan's rows, the
 * copies' slots) are the same in every layer, so they refuse in layer 0, before its KV store writes
 * anything. */
int decoder_layers(const Kernels *kn, const Shape *sh, const Layer *layers, int num_layers, const Step *st,
                   int threads) {
    const int64_t t = st->tokens, h = sh->hidden, qs = sh->hq * sh->d, kvs = sh->hkv * sh->d;
    const int64_t qkv_n = qs + 2 * kvs, size = sh->bf16 ? 2 : 4;
    const int bf16 = sh->bf16;
    const void *residual = st->x;
    int next = 0, rc = 0;
    if (!copies_valid(st, sh->num_slots)) return 1;
    for (int i = 0; i < num_layers; i++) {
        const Layer *ly = layers + i;
        if (i == 0) { /* layer 0: the input norm of x alone, x the residual */
            rc = kn->norm(st->x, h, NULL, 0, ly->input_norm, st->normed, NULL, t, h, sh->eps, bf16, threads);
        } else {
            rc = kn->norm(st->mlp_out, h, residual, h, ly->input_norm, st->normed, st->residual[next], t, h,
                          sh->eps, bf16, threads);
            residual = st->residual[next];
            next ^= 1;
        }
        if (rc) return i + 1;
        rc = ly->qkv_fn(st->normed, h, t, ly->qkv, qkv_n, h, ly->qkv_bias, st->qkv, qkv_n, threads);
        if (rc) return i + 1;
        const char *qkv = (const char *)st->qkv;
        rc = kn->rotary_store(qkv, qkv_n, sh->hq, st->q, qkv + qs * size, qkv_n, qkv + (qs + kvs) * size, qkv_n,
                              sh->hkv, ly->k_cache, ly->v_cache, st->slots, st->slots_i64, sh->num_slots,
                              st->positions, ly->cos_sin, ly->cs_stride, ly->max_pos, ly->cs_bf16, t, sh->d, bf16,
                              threads);
        if (rc) return i + 1;
        copy_kv(st, (char *)ly->k_cache, kvs * size);
        copy_kv(st, (char *)ly->v_cache, kvs * size);
        rc = kn->attention(st->q, ly->k_cache, ly->v_cache, st->tables, st->table_stride, st->context_lens,
                           st->q_rows, (int)t, st->rows, (int)t, t, st->attn, (int)sh->hq, (int)sh->hkv, (int)sh->d,
                           (int)sh->block_size, sh->scale, ly->window, 0.0f, threads);
        if (rc) return i + 1;
        rc = ly->o_fn(st->attn, qs, t, ly->o, h, qs, NULL, st->mlp_out, h, threads);
        if (rc) return i + 1;
        rc = kn->norm(st->mlp_out, h, residual, h, ly->post_norm, st->normed, st->residual[next], t, h, sh->eps,
                      bf16, threads);
        if (rc) return i + 1;
        residual = st->residual[next];
        next ^= 1;
        if (ly->gate_act_fn) {
            rc = ly->gate_act_fn(st->normed, h, t, ly->gate_up, 2 * sh->inter, h, NULL, st->act, sh->inter, threads);
        } else {
            rc = ly->gate_up_fn(st->normed, h, t, ly->gate_up, 2 * sh->inter, h, NULL, st->gate_up, 2 * sh->inter,
                                threads);
            if (rc) return i + 1;
            rc = kn->act(st->gate_up, 2 * sh->inter, st->act, t, sh->inter, bf16, threads);
        }
        if (rc) return i + 1;
        rc = ly->down_fn(st->act, sh->inter, t, ly->down, h, sh->inter, NULL, st->mlp_out, h, threads);
        if (rc) return i + 1;
    }
    return 0;
}
