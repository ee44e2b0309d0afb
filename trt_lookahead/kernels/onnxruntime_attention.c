/* LookaheadAttention's onnxruntime CPU kernel (float32): the node onnx_op.decompose(native=True) writes.
 *
 * Node "MaskedAttention", domain "trt_lookahead.cpu":
 *   inputs  query [B, T, Hq, D], key [B, T, Hkv, D], value [B, T, Hkv, D],
 *           key_cache [B, Hkv, S, D], value_cache [B, Hkv, S, D]   (float32)
 *           cache_len [B] int32, visible [B, T, T] bool (step slot t sees step slot j; built once per graph
 *           by ONNX ops from kernels/mask.py's closed form, so the mask is written in one place)
 *           shape [R] int64 (optional: the constant shape of the Reshape that read the output in the exported
 *           graph, without zeros, at most one -1; onnx_op._reshape_after)
 *   output  [B, T, Hq, D] float32, or that memory as `shape` (the Reshape in its place: one node a layer fewer)
 *   attrs   num_q_heads, num_kv_heads, head_dim (INT), scale (FLOAT)
 *
 * Row-invariant by construction (docs/design.md section 4.2): a query's keys are its row's cache_len cached
 * keys, then the step keys it sees, in slot order (a chain's slots are in position order), and everything
 * over them runs in that order with the same code whatever T, B or the other rows hold: one dot product per
 * key (fixed lanes, combined in a fixed order), the maximum, exp, the denominator and the weighted values
 * summed key by key. A token verified in a lookahead step therefore gets the bits of the same token decoded
 * alone. Built with -ffp-contract=off so that no fused multiply-add differs between code paths.
 * onnxruntime's C API: onnxruntime_api.h; registered by onnxruntime_ops.c.
 */
#include "onnxruntime_api.h"
#include "onnxruntime_vector.h"

/* ---- the attention ----------------------------------------------------------------------------------------- */

#define VALUE_CHUNK 64 /* output dims one query's weighted-value sums keep in registers */
#define KEY_TILE 64    /* cached keys every query of a head goes over before the next ones (a multiple of 8) */

typedef float v4 __attribute__((vector_size(16)));

static inline v4 halves(v8 a) {
    return __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
}
static inline v4 pair_sums(v4 a, v4 b) { /* (a0 + a1, a2 + a3, b0 + b1, b2 + b3) */
    return __builtin_shufflevector(a, b, 0, 2, 4, 6) + __builtin_shufflevector(a, b, 1, 3, 5, 7);
}

/* s[i] = e^(s[i] - top) for i < n, 8 at a time (the last lanes padded), so every score takes the same path */
static void exp_minus(float *s, int64_t n, float top) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(s + i, exp8(load8(s + i) - top));
    if (i < n) {
        float pad[8] = {0};
        memcpy(pad, s + i, sizeof(float) * (size_t)(n - i));
        v8 e = exp8(load8(pad) - top);
        memcpy(s + i, &e, sizeof(float) * (size_t)(n - i));
    }
}

/* The dot product of a query and a key, D floats: lane l (of 8) sums the products at dims = l mod 8 in order,
 * then ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), then the dims past the last multiple of 8 in order.
 * `dot` and `dots8` compute exactly this; a key's score is the same whichever computes it. */
static float dot(const float *q, const float *k, int64_t D) {
    float l[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        for (int j = 0; j < 8; j++) l[j] = l[j] + q[i + j] * k[i + j];
    float s = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
    for (; i < D; i++) s = s + q[i] * k[i];
    return s;
}

/* s[0..8) = dot(q, key r) for the 8 keys at k + r * stride, the lanes reduced 8 keys at a time */
static void dots8(const float *q, const float *k, int64_t stride, int64_t D, float *s) {
    v8 acc[8] = {{0}};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        v8 qv = load8(q + i);
        for (int r = 0; r < 8; r++) acc[r] = acc[r] + qv * load8(k + r * stride + i);
    }
    v4 x[8];
    for (int r = 0; r < 8; r++) x[r] = halves(acc[r]);
    v4 y0 = pair_sums(x[0], x[1]), y1 = pair_sums(x[2], x[3]), y2 = pair_sums(x[4], x[5]), y3 = pair_sums(x[6], x[7]);
    v4 lo = pair_sums(y0, y1), hi = pair_sums(y2, y3);
    for (int r = 0; r < 4; r++) s[r] = lo[r], s[4 + r] = hi[r];
    for (int r = 0; r < 8; r++)
        for (int64_t j = i; j < D; j++) s[r] = s[r] + q[j] * k[r * stride + j];
}

/* out[0..D) += p[c] * (v + c * stride)[0..D) for the n keys in order: each dim one chain, continued from out */
static void weighted_sum(const float *p, const float *v, int64_t stride, int64_t n, int64_t D, float *out) {
    int64_t d0 = 0;
    for (; d0 + VALUE_CHUNK <= D; d0 += VALUE_CHUNK) {
        v8 acc[VALUE_CHUNK / 8];
        for (int r = 0; r < VALUE_CHUNK / 8; r++) acc[r] = load8(out + d0 + 8 * r);
        for (int64_t c = 0; c < n; c++) {
            const float w = p[c];
            for (int r = 0; r < VALUE_CHUNK / 8; r++) acc[r] = acc[r] + w * load8(v + c * stride + d0 + 8 * r);
        }
        for (int r = 0; r < VALUE_CHUNK / 8; r++) store8(out + d0 + 8 * r, acc[r]);
    }
    for (int64_t d = d0; d < D; d++) {
        float o = out[d];
        for (int64_t c = 0; c < n; c++) o = o + p[c] * v[c * stride + d];
        out[d] = o;
    }
}

typedef struct {
    const float *q, *k, *v, *kc, *vc;
    const int32_t *cache_len;
    const uint8_t *visible;
    float *out;
    int64_t T, Hq, Hkv, D, S;
    float scale;
    int failed;
} Problem;

/* Row b, query head h: each of its T queries over the row's cached keys, then the step keys it sees. The cached
 * keys go in tiles of KEY_TILE, every query over a tile before the next, so that a tile's rows are read from
 * memory once per head. */
static int attend_head(Problem *p, int64_t b, int64_t h) {
    const int64_t T = p->T, D = p->D, kvh = h / (p->Hq / p->Hkv), L = p->cache_len[b];
    if (L < 0 || L > p->S) return 1;
    const int64_t keys = L + T, step = p->Hkv * D, qstep = p->Hq * D; /* a slot's stride in key / value, query / out */
    /* per query: [keys] scores (the step keys it sees packed after the cache's), [D] the query scaled */
    float *scores = malloc(sizeof(float) * (size_t)(T * (keys + D)));
    if (!scores) return 1;
    float *qs = scores + T * keys;
    const float *kc = p->kc + (b * p->Hkv + kvh) * p->S * D; /* [S, D] */
    const float *vc = p->vc + (b * p->Hkv + kvh) * p->S * D;
    const uint8_t *visible = p->visible + b * T * T;         /* [T, T] */
    float *out = p->out + b * T * qstep + h * D;             /* query t's at out + t * qstep */
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 0; d < D; d++) qs[t * D + d] = p->q[(b * T + t) * qstep + h * D + d] * p->scale;
    for (int64_t c0 = 0; c0 < L; c0 += KEY_TILE) {
        const int64_t c1 = c0 + KEY_TILE < L ? c0 + KEY_TILE : L;
        for (int64_t t = 0; t < T; t++) {
            int64_t c = c0;
            for (; c + 8 <= c1; c += 8) dots8(qs + t * D, kc + c * D, D, D, scores + t * keys + c);
            for (; c < c1; c++) scores[t * keys + c] = dot(qs + t * D, kc + c * D, D);
        }
    }
    for (int64_t t = 0; t < T; t++) {
        float *s = scores + t * keys, top = -INFINITY;
        int64_t n = L;
        for (int64_t j = 0; j < T; j++)
            if (visible[t * T + j]) s[n++] = dot(qs + t * D, p->k + (b * T + j) * step + kvh * D, D);
        for (int64_t i = 0; i < n; i++) top = s[i] > top ? s[i] : top;
        exp_minus(s, n, top);
        memset(out + t * qstep, 0, sizeof(float) * (size_t)D);
    }
    for (int64_t c0 = 0; c0 < L; c0 += KEY_TILE) {
        const int64_t c1 = c0 + KEY_TILE < L ? c0 + KEY_TILE : L;
        for (int64_t t = 0; t < T; t++) weighted_sum(scores + t * keys + c0, vc + c0 * D, D, c1 - c0, D, out + t * qstep);
    }
    for (int64_t t = 0; t < T; t++) {
        const float *s = scores + t * keys;
        int64_t n = L;
        for (int64_t j = 0; j < T; j++) /* the step keys continue the cache's chains, in slot order */
            if (visible[t * T + j]) weighted_sum(s + n++, p->v + (b * T + j) * step + kvh * D, D, 1, D, out + t * qstep);
        float total = 0.0f;
        for (int64_t i = 0; i < n; i++) total = total + s[i];
        for (int64_t d = 0; d < D; d++) out[t * qstep + d] = out[t * qstep + d] / total;
    }
    free(scores);
    return 0;
}

static void attend_item(void *data, size_t item) {
    Problem *p = data;
    if (attend_head(p, (int64_t)item / p->Hq, (int64_t)item % p->Hq)) p->failed = 1;
}

/* ---- the kernel ------------------------------------------------------------------------------------------- */

typedef struct {
    const OrtApi *api;
    int64_t hq, hkv, d;
    float scale;
} Kernel;

enum { INPUTS = 8, SHAPE = 7 }; /* the shape last, optional */
static const int INPUT_TYPES[INPUTS] = {TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT, TYPE_INT32,
                                        TYPE_BOOL, TYPE_INT64};
static const int INPUT_RANKS[INPUTS] = {4, 4, 4, 4, 4, 1, 3, 1};

/* input i's data and dims (rank checked) */
static OrtStatus *input(const OrtApi *api, OrtKernelContext *context, size_t i, void **data, int64_t *dims) {
    size_t rank;
    TRY(input_tensor(api, context, i, data, &rank, dims));
    return rank == (size_t)INPUT_RANKS[i] ? NULL : fail(api, "MaskedAttention: an input of the wrong rank");
}

/* the output's dims: [B, T, Hq, D], or the optional shape input's (its -1 resolved) for as many elements */
static OrtStatus *output_dims(const OrtApi *api, OrtKernelContext *context, const int64_t q_shape[4], int64_t *dims,
                              size_t *rank) {
    const OrtValue *value;
    TRY(API(api, KERNEL_CONTEXT_GET_INPUT, GetInputFn)(context, SHAPE, &value));
    if (!value) { /* no shape input */
        memcpy(dims, q_shape, 4 * sizeof(int64_t));
        *rank = 4;
        return NULL;
    }
    void *data;
    int64_t shape_dims[MAX_RANK];
    size_t shape_rank;
    TRY(tensor(api, value, &data, &shape_rank, shape_dims));
    const int64_t count = shape_dims[0];
    if (shape_rank != 1 || count < 1 || count > MAX_RANK) return fail(api, "MaskedAttention: a shape of 1-8 dims");
    const int64_t *shape = data, elements = q_shape[0] * q_shape[1] * q_shape[2] * q_shape[3];
    int64_t known = 1, unknown = -1;
    for (int64_t i = 0; i < count; i++) {
        if (shape[i] == -1 && unknown < 0) unknown = i;
        else if (shape[i] > 0) known *= shape[i];
        else return fail(api, "MaskedAttention: a shape's dims are positive, with at most one -1");
    }
    memcpy(dims, shape, (size_t)count * sizeof(int64_t));
    if (unknown >= 0) dims[unknown] = elements / known;
    if (elements % known || (unknown < 0 && known != elements))
        return fail(api, "MaskedAttention: the shape input does not hold the output's elements");
    *rank = (size_t)count;
    return NULL;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *context) {
    const Kernel *kn = kernel;
    const OrtApi *api = kn->api;
    void *data[INPUTS];
    int64_t dims[INPUTS][MAX_RANK];
    for (size_t i = 0; i < SHAPE; i++) TRY(input(api, context, i, &data[i], dims[i]));
    const int64_t B = dims[0][0], T = dims[0][1], S = dims[3][2];
    const int64_t q_shape[4] = {B, T, kn->hq, kn->d}, kv_shape[4] = {B, T, kn->hkv, kn->d};
    const int64_t cache_shape[4] = {B, kn->hkv, S, kn->d}, visible_shape[3] = {B, T, T};
    int ok = memcmp(dims[0], q_shape, sizeof q_shape) == 0 && memcmp(dims[1], kv_shape, sizeof kv_shape) == 0
             && memcmp(dims[2], kv_shape, sizeof kv_shape) == 0 && memcmp(dims[3], cache_shape, sizeof cache_shape) == 0
             && memcmp(dims[4], cache_shape, sizeof cache_shape) == 0 && dims[5][0] == B
             && memcmp(dims[6], visible_shape, sizeof visible_shape) == 0;
    if (!ok) return fail(api, "MaskedAttention: input shapes disagree with each other or with the node's heads");
    int64_t out_dims[MAX_RANK];
    size_t out_rank = 0;
    TRY(output_dims(api, context, q_shape, out_dims, &out_rank));
    OrtValue *output;
    TRY(API(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 0, out_dims, out_rank, &output));
    Problem p = {data[0], data[1], data[2], data[3], data[4], data[5], data[6], NULL,
                 T, kn->hq, kn->hkv, kn->d, S, kn->scale, 0};
    TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)(output, (void **)&p.out));
    if (B * kn->hq > 0)
        TRY(API(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, attend_item, (size_t)(B * kn->hq), 0, &p));
    if (p.failed) return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "MaskedAttention: a cache_len out of "
                                                                 "range, or no memory for a row's scores");
    return NULL;
}

static OrtStatus *create_kernel(const void *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    Kernel *kn = calloc(1, sizeof(Kernel));
    if (!kn) return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "MaskedAttention: out of memory");
    kn->api = api;
    OrtStatus *status = head_attributes(api, info, &kn->hq, &kn->hkv, &kn->d);
    if (!status) status = API(api, KERNEL_INFO_GET_ATTRIBUTE_FLOAT, GetAttributeFloatFn)(info, "scale", &kn->scale);
    if (!status && (kn->hq <= 0 || kn->hkv <= 0 || kn->d <= 0 || kn->hq % kn->hkv))
        status = fail(api, "MaskedAttention: num_q_heads must be a positive multiple of num_kv_heads");
    return keep_kernel(kn, status, out);
}

static const char *op_name(const void *op) { (void)op; return "MaskedAttention"; }
static int input_type(const void *op, size_t i) { (void)op; return i < INPUTS ? INPUT_TYPES[i] : 0; }
static size_t input_count(const void *op) { (void)op; return INPUTS; }

static int input_characteristic(const void *op, size_t i) {
    (void)op;
    return i == SHAPE ? INPUT_OPTIONAL : INPUT_REQUIRED;
}

const OrtCustomOp ATTENTION_OP = CUSTOM_OP(op_name, input_type, input_count, input_characteristic, one_output,
                                          create_kernel, compute, free_kernel);
