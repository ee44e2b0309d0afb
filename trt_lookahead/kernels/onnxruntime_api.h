/* onnxruntime's C API as far as the CPU kernels of this library use it (onnxruntime_attention.c,
 * onnxruntime_quantized.c, registered together by onnxruntime_ops.c), declared by slot: the OrtApi table is
 * append-only, so a function's slot never moves. Slots and struct layouts: onnxruntime's
 * include/onnxruntime/core/session/onnxruntime_c_api.h; API version 17 (onnxruntime 1.17) or later.
 */
#ifndef TRT_LOOKAHEAD_ONNXRUNTIME_API_H
#define TRT_LOOKAHEAD_ONNXRUNTIME_API_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi; /* opaque here: read as a table of function pointers */
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtShape;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;

typedef struct {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum { API_VERSION = 17 };                               /* KernelContext_ParallelFor came with it */
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };         /* OrtErrorCode */
enum { TYPE_FLOAT = 1, TYPE_UINT8 = 2, TYPE_INT32 = 6, TYPE_INT64 = 7, TYPE_BOOL = 9 }; /* ONNXTensorElementDataType */
enum { INPUT_REQUIRED = 0, INPUT_OPTIONAL = 1 };                          /* OrtCustomOpInputOutputCharacteristic */

/* OrtApi slots */
enum {
    CREATE_STATUS = 0, CREATE_CUSTOM_OP_DOMAIN = 26, CUSTOM_OP_DOMAIN_ADD = 27, ADD_CUSTOM_OP_DOMAIN = 28,
    GET_TENSOR_MUTABLE_DATA = 51, GET_DIMENSIONS_COUNT = 61, GET_DIMENSIONS = 62,
    GET_TENSOR_TYPE_AND_SHAPE = 65, KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85, KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
    KERNEL_CONTEXT_GET_INPUT = 90, KERNEL_CONTEXT_GET_OUTPUT = 91, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99,
    KERNEL_INFO_GET_CONSTANT_INPUT_TENSOR = 249, KERNEL_CONTEXT_PARALLEL_FOR = 274,
};

typedef OrtStatus *(*CreateStatusFn)(int code, const char *msg);
typedef OrtStatus *(*CreateCustomOpDomainFn)(const char *domain, OrtCustomOpDomain **out);
typedef OrtStatus *(*CustomOpDomainAddFn)(OrtCustomOpDomain *domain, const void *op);
typedef OrtStatus *(*AddCustomOpDomainFn)(OrtSessionOptions *options, OrtCustomOpDomain *domain);
typedef OrtStatus *(*GetTensorMutableDataFn)(OrtValue *value, void **out);
typedef OrtStatus *(*GetDimensionsCountFn)(const OrtShape *info, size_t *out);
typedef OrtStatus *(*GetDimensionsFn)(const OrtShape *info, int64_t *dims, size_t count);
typedef OrtStatus *(*GetTensorTypeAndShapeFn)(const OrtValue *value, OrtShape **out);
typedef OrtStatus *(*GetAttributeFloatFn)(const OrtKernelInfo *info, const char *name, float *out);
typedef OrtStatus *(*GetAttributeInt64Fn)(const OrtKernelInfo *info, const char *name, int64_t *out);
typedef OrtStatus *(*GetInputFn)(const OrtKernelContext *context, size_t index, const OrtValue **out);
typedef OrtStatus *(*GetOutputFn)(OrtKernelContext *context, size_t index, const int64_t *dims, size_t count,
                                  OrtValue **out);
typedef void (*ReleaseShapeFn)(OrtShape *info);
typedef OrtStatus *(*GetConstantInputFn)(const OrtKernelInfo *info, size_t index, int *is_constant,
                                         const OrtValue **out);
typedef OrtStatus *(*ParallelForFn)(const OrtKernelContext *context, void (*fn)(void *, size_t), size_t total,
                                    size_t num_batch, void *data);

#define API(api, slot, type) ((type)(((void *const *)(api))[slot]))
#define TRY(expr) do { OrtStatus *status_ = (expr); if (status_) return status_; } while (0)

/* OrtCustomOp as of API_VERSION: `version`, then function pointers (onnxruntime reads the ones that version has) */
typedef struct {
    uint32_t version;
    void *(*CreateKernel)(const void *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const void *op);
    const char *(*GetExecutionProviderType)(const void *op);
    int (*GetInputType)(const void *op, size_t index);
    size_t (*GetInputTypeCount)(const void *op);
    int (*GetOutputType)(const void *op, size_t index);
    size_t (*GetOutputTypeCount)(const void *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const void *op, size_t index);
    int (*GetOutputCharacteristic)(const void *op, size_t index);
    int (*GetInputMemoryType)(const void *op, size_t index);
    int (*GetVariadicInputMinArity)(const void *op);
    int (*GetVariadicInputHomogeneity)(const void *op);
    int (*GetVariadicOutputMinArity)(const void *op);
    int (*GetVariadicOutputHomogeneity)(const void *op);
    OrtStatus *(*CreateKernelV2)(const void *op, const OrtApi *api, const OrtKernelInfo *info, void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);
    OrtStatus *(*InferOutputShapeFn)(const void *op, void *context);
    int (*GetStartVersion)(const void *op);
    int (*GetEndVersion)(const void *op);
} OrtCustomOp;

#define NATIVE_DOMAIN "trt_lookahead.cpu" /* the custom-op domain of every node here (kernels/onnx_op.py's NATIVE_DOMAIN) */

static inline OrtStatus *fail(const OrtApi *api, const char *msg) {
    return API(api, CREATE_STATUS, CreateStatusFn)(ORT_INVALID_ARGUMENT, msg);
}

#define MAX_RANK 8 /* the most dims a node's input may have here */

/* a tensor's data, rank (1 .. MAX_RANK) and dims */
static inline OrtStatus *tensor(const OrtApi *api, const OrtValue *value, void **data, size_t *rank, int64_t *dims) {
    OrtShape *info;
    TRY(API(api, GET_TENSOR_TYPE_AND_SHAPE, GetTensorTypeAndShapeFn)(value, &info));
    OrtStatus *status = API(api, GET_DIMENSIONS_COUNT, GetDimensionsCountFn)(info, rank);
    if (!status && (*rank < 1 || *rank > MAX_RANK)) status = fail(api, "a trt_lookahead.cpu node's input of rank 0 "
                                                                     "or above 8");
    if (!status) status = API(api, GET_DIMENSIONS, GetDimensionsFn)(info, dims, *rank);
    API(api, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, ReleaseShapeFn)(info);
    if (status) return status;
    return API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)((OrtValue *)value, data);
}

/* a kernel's input i: its data, rank and dims */
static inline OrtStatus *input_tensor(const OrtApi *api, OrtKernelContext *context, size_t i, void **data,
                                      size_t *rank, int64_t *dims) {
    const OrtValue *value;
    TRY(API(api, KERNEL_CONTEXT_GET_INPUT, GetInputFn)(context, i, &value));
    return tensor(api, value, data, rank, dims);
}

/* the attention's heads from a node's attributes num_q_heads, num_kv_heads and head_dim */
static inline OrtStatus *head_attributes(const OrtApi *api, const OrtKernelInfo *info, int64_t *hq, int64_t *hkv,
                                         int64_t *d) {
    TRY(API(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, GetAttributeInt64Fn)(info, "num_q_heads", hq));
    TRY(API(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, GetAttributeInt64Fn)(info, "num_kv_heads", hkv));
    return API(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, GetAttributeInt64Fn)(info, "head_dim", d);
}

/* The end of a kernel's create callback for a kernel state that owns nothing but itself (one calloc): kept as *out
 * where `status` is no failure, else freed and the failure returned. free_kernel is its destroy callback. */
static inline OrtStatus *keep_kernel(void *kernel, OrtStatus *status, void **out) {
    if (status) {
        free(kernel);
        return status;
    }
    *out = kernel;
    return NULL;
}
static inline void free_kernel(void *kernel) { free(kernel); }

/* the OrtCustomOp slots every op here fills alike: float32 outputs, on the CPU, nothing variadic */
static inline const char *op_provider(const void *op) { (void)op; return "CPUExecutionProvider"; }
static inline int default_memory(const void *op, size_t i) { (void)op; (void)i; return 0; }  /* OrtMemTypeDefault */
static inline int one(const void *op) { (void)op; return 1; }  /* variadic arity and homogeneity: none is variadic */
static inline int float_output(const void *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static inline size_t one_output(const void *op) { (void)op; return 1; }
static inline int required(const void *op, size_t i) { (void)op; (void)i; return INPUT_REQUIRED; }

/* an op's OrtCustomOp from its own callbacks: its name, inputs' types, count and characteristics (required or
 * optional), its output count, and its kernel's creation, computation and destruction */
#define CUSTOM_OP(name, input_type, input_count, input_characteristic, output_count, create, compute, destroy)    \
    {                                                                                                              \
        .version = API_VERSION, .GetName = name, .GetExecutionProviderType = op_provider,                          \
        .GetInputType = input_type, .GetInputTypeCount = input_count, .GetOutputType = float_output,              \
        .GetOutputTypeCount = output_count, .KernelDestroy = destroy, .GetInputCharacteristic = input_characteristic, \
        .GetOutputCharacteristic = required, .GetInputMemoryType = default_memory,                                 \
        .GetVariadicInputMinArity = one, .GetVariadicInputHomogeneity = one, .GetVariadicOutputMinArity = one,     \
        .GetVariadicOutputHomogeneity = one, .CreateKernelV2 = create, .KernelComputeV2 = compute,                  \
    }

/* QuantizedMatMul's kernel takes AVX2's byte products, fused multiply-adds and F16C: built only where the compiler
 * targets them (-march=native on such a CPU); elsewhere quantized products stay MatMulNBits nodes */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANTIZED_KERNEL 1
#else
#define QUANTIZED_KERNEL 0
#endif

extern const OrtCustomOp ATTENTION_OP, QUANTIZED_OP, ROTARY_OP, SWIGLU_OP;

#endif
