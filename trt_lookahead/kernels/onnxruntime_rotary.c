/* RotaryQKV: a layer's fused QKV projection split into its query, key and value heads, the rotary embedding
 * applied to the query and key heads, onnxruntime CPU kernel. It replaces the 16 standard nodes an exported Llama
 * layer spends on that (kernels/onnx_op.py native_rotary writes it); one node instead of those costs a step
 * their per-node overhead, which at one token is a sizeable share of a small model's step (docs/design.md 6.4).
 *
 * Node "RotaryQKV", domain "trt_lookahead.cpu":
 *   inputs  x [rows, (Hq + 2 Hkv) * D] float32 (the heads in order: Hq query, Hkv key, Hkv value heads),
 *           cos, sin [rows, 1, D] float32 (sin negated on the first half of D, as the exported graph's table),
 *           q_shape, kv_shape [4] int64: the outputs' dims (B, T, Hq, D) and (B, T, Hkv, D), B * T = rows
 *           (B or T may be -1, inferred as the Reshapes it replaces infer it)
 *   outputs q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D] float32
 *   attrs   num_q_heads, num_kv_heads, head_dim (INT)
 *
 * A rotated head is y[j] = x[j] * cos[j] + x[(j + D/2) % D] * sin[j]: two products and a sum, each rounded to
 * float32 in that order (no fused multiply-add: the library is compiled with -ffp-contract=off), which is what
 * the Mul, Mul and Add nodes it replaces compute, so the graph's results keep their bits. Registered by
 * onnxruntime_ops.c; onnxruntime's C API: onnxruntime_api.h.
 */
#include "onnxruntime_api.h"

enum { X, COS, SIN, Q_SHAPE, KV_SHAPE, INPUTS };
enum { Q, K, V, OUTPUTS };
static const int INPUT_TYPES[INPUTS] = {TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT, TYPE_INT64, TYPE_INT64};

typedef struct {
    const OrtApi *api;
    int64_t hq, hkv, d;
} Kernel;

/* input i's data and element count */
static OrtStatus *input(const OrtApi *api, OrtKernelContext *context, size_t i, void **data, int64_t *count) {
    size_t rank;
    int64_t dims[MAX_RANK];
    TRY(input_tensor(api, context, i, data, &rank, dims));
    *count = 1;
    for (size_t r = 0; r < rank; r++) *count *= dims[r];
    return NULL;
}

/* heads of D from x, rotated by one row's cos and sin, into out (each half of a head a loop of its own, so that
 * the compiler vectorises it) */
static void rotate(const float *x, const float *cos, const float *sin, int64_t heads, int64_t d, float *out) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++, x += d, out += d) {
        for (int64_t j = 0; j < half; j++) out[j] = x[j] * cos[j] + x[j + half] * sin[j];
        for (int64_t j = half; j < d; j++) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
    }
}

/* the dims a Reshape of `rows` rows of `heads` heads of d into `shape` [B, T, heads, d] gives (B or T may be -1:
 * inferred, as Reshape infers it), or 0 where they do not fit */
static int reshaped(const int64_t *shape, int64_t rows, int64_t heads, int64_t d, int64_t *dims) {
    memcpy(dims, shape, 4 * sizeof(int64_t));
    if (dims[2] != heads || dims[3] != d || (dims[0] == -1 && dims[1] == -1)) return 0;
    if (dims[0] == -1 && dims[1] > 0 && rows % dims[1] == 0) dims[0] = rows / dims[1];
    if (dims[1] == -1 && dims[0] > 0 && rows % dims[0] == 0) dims[1] = rows / dims[0];
    return dims[0] >= 0 && dims[1] >= 0 && dims[0] * dims[1] == rows;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *context) {
    const Kernel *kn = kernel;
    const OrtApi *api = kn->api;
    void *data[INPUTS];
    int64_t count[INPUTS];
    for (size_t i = 0; i < INPUTS; i++) TRY(input(api, context, i, &data[i], &count[i]));
    const int64_t hq = kn->hq, hkv = kn->hkv, d = kn->d, width = (hq + 2 * hkv) * d;
    if (count[Q_SHAPE] != 4 || count[KV_SHAPE] != 4)
        return fail(api, "RotaryQKV: q_shape and kv_shape must hold 4 dims each");
    const int64_t rows = count[X] / width;
    int64_t shapes[OUTPUTS][4];
    const int ok = count[X] == rows * width && count[COS] == rows * d && count[SIN] == rows * d
                   && reshaped(data[Q_SHAPE], rows, hq, d, shapes[Q])
                   && reshaped(data[KV_SHAPE], rows, hkv, d, shapes[K])
                   && shapes[K][0] == shapes[Q][0] && shapes[K][1] == shapes[Q][1];
    if (!ok) return fail(api, "RotaryQKV: input shapes disagree with each other or with the node's heads");
    memcpy(shapes[V], shapes[K], sizeof shapes[K]);
    float *out[OUTPUTS];
    for (int o = 0; o < OUTPUTS; o++) {
        OrtValue *value;
        TRY(API(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, (size_t)o, shapes[o], 4, &value));
        TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)(value, (void **)&out[o]));
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *x = (const float *)data[X] + r * width;
        const float *cos = (const float *)data[COS] + r * d, *sin = (const float *)data[SIN] + r * d;
        rotate(x, cos, sin, hq, d, out[Q] + r * hq * d);
        rotate(x + hq * d, cos, sin, hkv, d, out[K] + r * hkv * d);
        memcpy(out[V] + r * hkv * d, x + (hq + hkv) * d, sizeof(float) * (size_t)(hkv * d));
    }
    return NULL;
}

static OrtStatus *create_kernel(const void *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    Kernel *kn = calloc(1, sizeof(Kernel));
    if (!kn) return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "RotaryQKV: out of memory");
    kn->api = api;
    OrtStatus *status = head_attributes(api, info, &kn->hq, &kn->hkv, &kn->d);
    if (!status && (kn->hq <= 0 || kn->hkv <= 0 || kn->d <= 0 || kn->d % 2))
        status = fail(api, "RotaryQKV: heads must be positive and head_dim even");
    return keep_kernel(kn, status, out);
}

static const char *op_name(const void *op) { (void)op; return "RotaryQKV"; }
static int input_type(const void *op, size_t i) { (void)op; return i < INPUTS ? INPUT_TYPES[i] : 0; }
static size_t input_count(const void *op) { (void)op; return INPUTS; }
static size_t output_count(const void *op) { (void)op; return OUTPUTS; }

const OrtCustomOp ROTARY_OP = CUSTOM_OP(op_name, input_type, input_count, required, output_count, create_kernel,
                                       compute, free_kernel);
