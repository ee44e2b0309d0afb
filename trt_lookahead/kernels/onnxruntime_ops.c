/* The library onnxruntime loads (SessionOptions.register_custom_ops_library): the CPU kernels of
 * onnxruntime_attention.c, onnxruntime_rotary.c, onnxruntime_swiglu.c and onnxruntime_quantized.c in one domain,
 * "trt_lookahead.cpu".
 */
#include "onnxruntime_api.h"

/* what SessionOptions.register_custom_ops_library calls */
__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options,
                                                                    const OrtApiBase *base) {
    const OrtApi *api = base->GetApi(API_VERSION);
    if (!api) return NULL; /* a runtime older than API_VERSION: the session then names the unknown op */
    OrtCustomOpDomain *domain;
    TRY(API(api, CREATE_CUSTOM_OP_DOMAIN, CreateCustomOpDomainFn)(NATIVE_DOMAIN, &domain));
    TRY(API(api, CUSTOM_OP_DOMAIN_ADD, CustomOpDomainAddFn)(domain, &ATTENTION_OP));
    TRY(API(api, CUSTOM_OP_DOMAIN_ADD, CustomOpDomainAddFn)(domain, &ROTARY_OP));
    TRY(API(api, CUSTOM_OP_DOMAIN_ADD, CustomOpDomainAddFn)(domain, &SWIGLU_OP));
#if QUANTIZED_KERNEL
    TRY(API(api, CUSTOM_OP_DOMAIN_ADD, CustomOpDomainAddFn)(domain, &QUANTIZED_OP));
#endif
    return API(api, ADD_CUSTOM_OP_DOMAIN, AddCustomOpDomainFn)(options, domain);
}

/* Whether this build holds QuantizedMatMul (kernels/onnxruntime_library.py asks before writing such nodes) */
__attribute__((visibility("default"))) int trt_lookahead_quantized_matmul(void) { return QUANTIZED_KERNEL; }
