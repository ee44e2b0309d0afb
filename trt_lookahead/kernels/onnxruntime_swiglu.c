/* SwiGLU: a Llama MLP's gate and up halves, silu(gate) * up, onnxruntime CPU kernel. It replaces the 4 standard
 * nodes an exported layer spends between its fused gate-up product and its down product (Split, Sigmoid, Mul,
 * Mul; kernels/onnx_swiglu.py native_swiglu writes it): one pass over the product instead of four, and one node's
 * overhead instead of four (docs/design.md 6.4).
 *
 * Node "SwiGLU", domain "trt_lookahead.cpu":
 *   input   x [..., 2F, ...] float32: along `axis`, the gate's F values, then the up projection's F
 *   output  y [..., F, ...] float32
 *   attrs   axis (INT; negative counts from the last dim, as Split's)
 *
 * Per element, y = (g * s) * u with s the sigmoid of g from exp8 (onnxruntime_vector.h; swiglu8 below), the
 * same float32 operations on every element: y depends on g and u alone, never on the row count, a row's place in
 * the batch or the thread split (the exact step's premise, docs/design.md 4.2). Its results are not onnxruntime's
 * Sigmoid's (another approximation of the same function), so an engine's logits move by about float32 rounding
 * against the standard nodes', on every path alike. Registered by onnxruntime_ops.c;
 * onnxruntime's C API: onnxruntime_api.h.
 */
#include "onnxruntime_api.h"
#include "onnxruntime_vector.h"

#define TASK_ELEMENTS 16384 /* elements of y per parallel task, about: fewer and a task costs more than its work */

typedef struct {
    const OrtApi *api;
    int64_t axis;
} Kernel;

typedef struct {
    const float *x;
    float *y;
    int64_t outer, half, inner, per_task; /* y is [outer, half, inner]; x [outer, 2, half, inner] */
} Job;

/* silu(g) * u for 8 lanes: s = 1 / (1 + e) where g >= 0 and e / (1 + e) where not, e = e^-|g|, so that exp8's
 * argument is never positive and nothing overflows; y = (g * s) * u. */
static inline v8 swiglu8(v8 g, v8 u) {
    const v8 one = SPLAT(1.0f), sign = SPLAT(-0.0f);
    const i8 negative = g < (v8)SPLAT(0.0f);
    const v8 e = exp8((v8)((i8)g | (i8)sign));
    const v8 s = (v8)(((i8)e & negative) | ((i8)one & ~negative)) / (one + e);
    return (g * s) * u;
}

/* y = silu(g) * u over n elements, 8 at a time (the last lanes padded), so every element takes the same path */
static void swiglu(const float *g, const float *u, float *y, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) store8(y + j, swiglu8(load8(g + j), load8(u + j)));
    if (j < n) {
        float gate[8] = {0}, up[8] = {0};
        memcpy(gate, g + j, sizeof(float) * (size_t)(n - j));
        memcpy(up, u + j, sizeof(float) * (size_t)(n - j));
        const v8 tail = swiglu8(load8(gate), load8(up));
        memcpy(y + j, &tail, sizeof(float) * (size_t)(n - j));
    }
}

static void swiglu_task(void *data, size_t task) {
    const Job *job = data;
    const int64_t first = (int64_t)task * job->per_task;
    const int64_t end = first + job->per_task < job->outer ? first + job->per_task : job->outer;
    const int64_t n = job->half * job->inner; /* y's elements per outer index; x's gate and up, each */
    for (int64_t o = first; o < end; o++) swiglu(job->x + 2 * o * n, job->x + (2 * o + 1) * n, job->y + o * n, n);
}

static OrtStatus *compute(void *kernel, OrtKernelContext *context) {
    const Kernel *kn = kernel;
    const OrtApi *api = kn->api;
    void *x;
    size_t rank;
    int64_t dims[MAX_RANK];
    TRY(input_tensor(api, context, 0, &x, &rank, dims));
    const int64_t axis = kn->axis < 0 ? kn->axis + (int64_t)rank : kn->axis;
    if (axis < 0 || axis >= (int64_t)rank) return fail(api, "SwiGLU: axis is outside the input's dims");
    if (dims[axis] % 2) return fail(api, "SwiGLU: the input's split dim is odd, not a gate and an up half");
    Job job = {x, NULL, 1, dims[axis] / 2, 1, 1};
    for (int64_t i = 0; i < axis; i++) job.outer *= dims[i];
    for (int64_t i = axis + 1; i < (int64_t)rank; i++) job.inner *= dims[i];
    dims[axis] /= 2;
    OrtValue *output;
    TRY(API(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 0, dims, rank, &output));
    TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)(output, (void **)&job.y));
    const int64_t n = job.half * job.inner;
    if (job.outer == 0 || n == 0) return NULL;
    job.per_task = TASK_ELEMENTS / n > 1 ? TASK_ELEMENTS / n : 1;
    const size_t tasks = (size_t)((job.outer + job.per_task - 1) / job.per_task);
    if (tasks == 1) {
        swiglu_task(&job, 0);
        return NULL;
    }
    return API(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, swiglu_task, tasks, 0, &job);
}

static OrtStatus *create_kernel(const void *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    Kernel *kn = calloc(1, sizeof(Kernel));
    if (!kn) return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "SwiGLU: out of memory");
    kn->api = api;
    OrtStatus *status = API(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, GetAttributeInt64Fn)(info, "axis", &kn->axis);
    return keep_kernel(kn, status, out);
}

static const char *op_name(const void *op) { (void)op; return "SwiGLU"; }
static int input_type(const void *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t input_count(const void *op) { (void)op; return 1; }

const OrtCustomOp SWIGLU_OP = CUSTOM_OP(op_name, input_type, input_count, required, one_output, create_kernel, compute,
                                       free_kernel);
