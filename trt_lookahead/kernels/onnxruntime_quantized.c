/* QuantizedMatMul: a projection by block-quantized weights with int8 activations, onnxruntime CPU kernel. It
 * replaces a 4- or 8-bit MatMulNBits node of accuracy_level 4 and that node's Q4_1 mins term (engine/quantize.py
 * native_products writes it), on the same initializers.
 *
 * Node "QuantizedMatMul", domain "trt_lookahead.cpu":
 *   inputs  x [..., K] float32; and constant initializers: codes [N, blocks, 32 * bits / 8] uint8 (4-bit: byte j
 *           holds element 2j in its low nibble, 2j + 1 in its high one), scales [N * blocks] float32, zero_points
 *           uint8 (4-bit: [N, ceil(blocks / 2)] two per byte, low nibble first; 8-bit: [N * blocks]), mins
 *           [blocks, N] float32 (optional; attribute mins = 1 where given)
 *   output  [..., N] float32
 *   attrs   K, N, bits, mins (INT)
 *
 * The weight is w = d * q + e per (channel, block), e = m - d * z (d the scale, z the zero point, m the min, 0
 * without mins). Each row of x is cut into blocks of 32 along K (the last zero-padded), each block quantized to
 * int8 codes a = round(x * (127 / amax)) (half to even) with the scale s = amax / 127 and the sum S = s * sum(a),
 * as llama.cpp's Q8_1 blocks. Then, per output channel, over the blocks in order:
 *
 *     lanes[l] = fma(float(dot_l), d * s, lanes[l])   l < 4, dot_l the exact integer sum of q * a over a fixed
 *                                                     8 of the block's 32 elements
 *     tail     = fma(e, S, tail)
 *     y        = ((lanes0 + lanes2) + (lanes1 + lanes3)) + tail
 *
 * Row-invariant by construction: a row's codes depend only on the row, the integer sums are exact, and every
 * float operation above runs in this order for every row count and thread split (channels are split across
 * threads, rows tiled through the same code), so a product of one row has the bits of the same row among 64,
 * and an exact engine need not pad a step to two rows (docs/design.md 6.9).
 *
 * The kernel copies the weight once, when onnxruntime creates it, into records that stream in the order it reads
 * them: per group of 4 channels and block, their codes, d and e. Two channels share each 256-bit product: a 4-bit
 * record's 32 bytes (two channels' 16) split into low and high nibbles multiply the even and odd elements' codes,
 * which quantize_row lays out twice over. Needs AVX2, FMA and F16C (QUANTIZED_KERNEL); onnxruntime's C API:
 * onnxruntime_api.h; registered by onnxruntime_ops.c.
 */
#include "onnxruntime_api.h"

#if QUANTIZED_KERNEL
#include <immintrin.h>
#include <sys/mman.h>

#define BLOCK 32        /* weights per (channel, block): engine/quantize.py's BLOCK_SIZE */
#define A_BYTES 64      /* a row's block of activation codes as the products read it (see quantize_row) */
#define GROUP 4         /* channels whose blocks lie together in the kernel's copy of the weight (two pairs) */
#define ROWS 3          /* rows multiplied together where there are more than one */
#define TASK_GROUPS 4   /* groups per parallel task */
#define CODE_MAX 127.0f /* an activation code's largest magnitude (engine/quantize.py's ACTIVATION_CODE) */

/* A (group, block)'s record in the kernel's copy of the weight, so that a group's blocks stream in order: the
 * four channels' code bytes, then their d and then their e, each `half` ? float16 : float32. Channels past N
 * repeat the last. */
#define CODE_BYTES(bits) (BLOCK * (bits) / 8)
#define SCALE_BYTES(half) ((half) ? 2 : 4)
#define RECORD(bits, half) (GROUP * CODE_BYTES(bits) + 2 * GROUP * SCALE_BYTES(half))

typedef struct {
    const uint8_t *records; /* [ceil(N / GROUP), blocks] RECORD(bits, half) each (the Kernel's) */
    const uint8_t *a;       /* [M, blocks, A_BYTES] the rows' codes */
    const float *s, *sums;  /* [M, blocks] each block's scale and scaled code sum */
    float *y;               /* [M, N] */
    int64_t M, N, blocks, bits, half;
} Product;

/* Row r's codes, scales and sums. A block's codes go as the products read them: 4-bit weights, the even elements'
 * codes twice then the odd elements' twice (int8, matching a record's low nibbles, then its high ones, for both
 * channels of a pair); 8-bit weights, the 32 codes as int16. */
static void quantize_row(const float *x, int64_t K, int64_t blocks, int64_t bits, uint8_t *a, float *s, float *sums) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes packs' lane interleave */
    const __m256i even_odd = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                              0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int64_t b = 0; b < blocks; b++) {
        float v[BLOCK] = {0};
        const int64_t n = K - b * BLOCK < BLOCK ? K - b * BLOCK : BLOCK;
        memcpy(v, x + b * BLOCK, sizeof(float) * (size_t)n);
        __m256 top = _mm256_setzero_ps(); /* the largest |x|: a maximum, in any order the same */
        for (int i = 0; i < BLOCK; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude));
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, top);
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? CODE_MAX / amax : 0.0f);
        __m256i c[4]; /* x * inverse rounded half to even (the default rounding mode), elements 8i .. 8i + 7 */
        for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), inverse));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
        int32_t parts[8], sum = 0;
        _mm256_storeu_si256((__m256i *)parts, total);
        for (int i = 0; i < 8; i++) sum += parts[i];
        const __m256i low = _mm256_packs_epi32(c[0], c[1]), high = _mm256_packs_epi32(c[2], c[3]); /* |c| <= 127 */
        uint8_t *out = a + b * A_BYTES;
        if (bits == 4) { /* bytes in element order, then each 16's even elements before its odd ones */
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(low, high), in_order);
            const __m256i split = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, even_odd), 0xd8);
            _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(split, 0x44));       /* even, even */
            _mm256_storeu_si256((__m256i *)(out + 32), _mm256_permute4x64_epi64(split, 0xee)); /* odd, odd */
        } else { /* int16 in element order */
            _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(low, 0xd8));
            _mm256_storeu_si256((__m256i *)(out + 32), _mm256_permute4x64_epi64(high, 0xd8));
        }
        s[b] = amax / CODE_MAX;
        sums[b] = s[b] * (float)sum;
    }
}

/* A pair's block products: lanes 0-3 the first channel's, 4-7 the second's, each lane the exact integer sum of
 * q * a over 8 of the block's elements (a fixed subset per lane). */
static inline __m256i pair_dot(const uint8_t *record, const uint8_t *a, int bits) {
    if (bits == 4) { /* low nibbles x even elements + high nibbles x odd: |sum| <= 4 * 15 * 127 fits 16 bits */
        const __m256i raw = _mm256_loadu_si256((const __m256i *)record), mask = _mm256_set1_epi8(0x0f);
        const __m256i low = _mm256_and_si256(raw, mask), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_loadu_si256((const __m256i *)a)),
                                              _mm256_maddubs_epi16(high, _mm256_loadu_si256((const __m256i *)(a + 32))));
        return _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
    }
    const __m256i a0 = _mm256_loadu_si256((const __m256i *)a), a1 = _mm256_loadu_si256((const __m256i *)(a + 32));
    __m256i dots[2];
    for (int c = 0; c < 2; c++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(record + c * CODE_BYTES(8)));
        dots[c] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), a0),
                                   _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), a1));
    }
    /* hadd: (c0 l0+l1, l2+l3, c1 l0+l1, l2+l3 | c0 l4+l5, l6+l7, c1 ..), then the first channel's four lanes first */
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(dots[0], dots[1]), 0xd8);
}

/* a record's four d (or e) as float32 */
static inline __m128 four(const uint8_t *at, int half) {
    return half ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)at)) : _mm_loadu_ps((const float *)at);
}

/* rows r0 .. r0 + rows of group g's channels. The row count only chooses how many accumulators stay in
 * registers: each (row, channel) runs the same chains. */
static inline __attribute__((always_inline)) void tile(const Product *p, int64_t g, int64_t r0, int rows, int bits,
                                                       int half) {
    __m256 lanes[ROWS][2]; /* per pair: lanes 0-3 its first channel's, 4-7 its second's */
    __m128 tail[ROWS];     /* lane c: channel c's offset sums */
    for (int r = 0; r < rows; r++) {
        tail[r] = _mm_setzero_ps();
        lanes[r][0] = lanes[r][1] = _mm256_setzero_ps();
    }
    const __m256i pair_lanes[2] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)};
    const uint8_t *record = p->records + g * p->blocks * RECORD(bits, half);
    for (int64_t b = 0; b < p->blocks; b++, record += RECORD(bits, half)) {
        const uint8_t *scales = record + GROUP * CODE_BYTES(bits);
        const __m256 d = _mm256_castps128_ps256(four(scales, half));
        const __m128 e = four(scales + GROUP * SCALE_BYTES(half), half);
        for (int c = 0; c < 2; c++) {
            const __m256 ds = _mm256_permutevar8x32_ps(d, pair_lanes[c]); /* (d0 x4, d1 x4) of the pair */
            for (int r = 0; r < rows; r++) {
                const int64_t row = (r0 + r) * p->blocks + b;
                const __m256 dot = _mm256_cvtepi32_ps(pair_dot(record + 2 * c * CODE_BYTES(bits), p->a + row * A_BYTES, bits));
                lanes[r][c] = _mm256_fmadd_ps(dot, _mm256_mul_ps(ds, _mm256_set1_ps(p->s[row])), lanes[r][c]);
            }
        }
        for (int r = 0; r < rows; r++)
            tail[r] = _mm_fmadd_ps(e, _mm_set1_ps(p->sums[(r0 + r) * p->blocks + b]), tail[r]);
    }
    for (int r = 0; r < rows; r++) {
        float t[GROUP], l[2][8];
        _mm_storeu_ps(t, tail[r]);
        _mm256_storeu_ps(l[0], lanes[r][0]);
        _mm256_storeu_ps(l[1], lanes[r][1]);
        for (int c = 0; c < GROUP && g * GROUP + c < p->N; c++) {
            const float *h = l[c / 2] + 4 * (c % 2); /* the channel's four lanes */
            p->y[(r0 + r) * p->N + g * GROUP + c] = ((h[0] + h[2]) + (h[1] + h[3])) + t[c];
        }
    }
}

static inline __attribute__((always_inline)) void groups(const Product *p, int64_t first, int64_t end, int bits,
                                                         int half) {
    for (int64_t g = first; g < end; g++) {
        int64_t r0 = 0;
        for (; r0 + ROWS <= p->M; r0 += ROWS) tile(p, g, r0, ROWS, bits, half);
        for (; r0 < p->M; r0++) tile(p, g, r0, 1, bits, half);
    }
}

static void multiply_task(void *data, size_t task) {
    const Product *p = data;
    const int64_t all = (p->N + GROUP - 1) / GROUP, first = (int64_t)task * TASK_GROUPS;
    const int64_t end = first + TASK_GROUPS < all ? first + TASK_GROUPS : all;
    if (p->bits == 4 && p->half) groups(p, first, end, 4, 1); /* constants: each compiles to its own loops */
    else if (p->bits == 4) groups(p, first, end, 4, 0);
    else if (p->half) groups(p, first, end, 8, 1);
    else groups(p, first, end, 8, 0);
}

/* ---- the kernel ------------------------------------------------------------------------------------------- */

#define MAX_RANK 8
enum { INPUTS = 5, X = 0, CODES = 1, SCALES = 2, ZEROS = 3, MINS = 4 };
static const int INPUT_TYPES[INPUTS] = {TYPE_FLOAT, TYPE_UINT8, TYPE_FLOAT, TYPE_UINT8, TYPE_FLOAT};

/* The weight as the kernel reads it, made once from the node's constant inputs into memory of its own (not the
 * engine file's pages): RECORD(bits, half) per (group, block) */
typedef struct {
    const OrtApi *api;
    int64_t K, N, bits, blocks;
    int64_t half;     /* every d and e is a float16 exactly (a GGUF's blocks): the records hold them so */
    uint8_t *records; /* [ceil(N / GROUP), blocks] RECORD(bits, half) each */
} Kernel;

/* a value's data, rank and dims */
static OrtStatus *tensor(const OrtApi *api, const OrtValue *value, void **data, size_t *rank, int64_t *dims) {
    OrtShape *info;
    TRY(API(api, GET_TENSOR_TYPE_AND_SHAPE, GetTensorTypeAndShapeFn)(value, &info));
    OrtStatus *status = API(api, GET_DIMENSIONS_COUNT, GetDimensionsCountFn)(info, rank);
    if (!status && (*rank < 1 || *rank > MAX_RANK)) status = fail(api, "QuantizedMatMul: an input of rank 0 or above 8");
    if (!status) status = API(api, GET_DIMENSIONS, GetDimensionsFn)(info, dims, *rank);
    API(api, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, ReleaseShapeFn)(info);
    if (status) return status;
    return API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)((OrtValue *)value, data);
}

static int64_t elements(const int64_t *dims, size_t rank) {
    int64_t n = 1;
    for (size_t i = 0; i < rank; i++) n *= dims[i];
    return n;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *context) {
    const Kernel *kn = kernel;
    const OrtApi *api = kn->api;
    const OrtValue *value;
    void *x;
    size_t rank;
    int64_t dims[MAX_RANK];
    TRY(API(api, KERNEL_CONTEXT_GET_INPUT, GetInputFn)(context, X, &value));
    TRY(tensor(api, value, &x, &rank, dims));
    const int64_t K = kn->K, N = kn->N, blocks = kn->blocks;
    if (dims[rank - 1] != K) return fail(api, "QuantizedMatMul: x's last dimension is not the node's K");
    int64_t out_dims[MAX_RANK];
    memcpy(out_dims, dims, sizeof(int64_t) * rank);
    out_dims[rank - 1] = N;
    OrtValue *output;
    TRY(API(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 0, out_dims, rank, &output));
    const int64_t M = elements(dims, rank - 1);
    Product p = {kn->records, NULL, NULL, NULL, NULL, M, N, blocks, kn->bits, kn->half};
    TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)(output, (void **)&p.y));
    if (M == 0) return NULL;
    const size_t bytes = (size_t)(M * blocks * A_BYTES) + (size_t)(2 * M * blocks) * sizeof(float);
    uint8_t *a = aligned_alloc(32, (bytes + 31) / 32 * 32); /* the codes, then the scales and sums */
    if (!a) return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "QuantizedMatMul: no memory for the rows' codes");
    float *s = (float *)(a + M * blocks * A_BYTES), *sums = s + M * blocks;
    for (int64_t r = 0; r < M; r++)
        quantize_row((const float *)x + r * K, K, blocks, kn->bits, a + r * blocks * A_BYTES, s + r * blocks,
                     sums + r * blocks);
    p.a = a, p.s = s, p.sums = sums;
    const size_t tasks = (size_t)(((N + GROUP - 1) / GROUP + TASK_GROUPS - 1) / TASK_GROUPS);
    OrtStatus *status = API(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, multiply_task, tasks, 0, &p);
    free(a);
    return status;
}

/* constant input i's data, or a message: the node's weights are initializers (engine/quantize.native_products) */
static OrtStatus *constant(const OrtApi *api, const OrtKernelInfo *info, size_t i, int64_t count, void **data) {
    int is_constant = 0;
    const OrtValue *value = NULL;
    size_t rank;
    int64_t dims[MAX_RANK];
    TRY(API(api, KERNEL_INFO_GET_CONSTANT_INPUT_TENSOR, GetConstantInputFn)(info, i, &is_constant, &value));
    if (!is_constant || !value) return fail(api, "QuantizedMatMul: scales, zero points and mins must be initializers");
    TRY(tensor(api, value, data, &rank, dims));
    if (elements(dims, rank) != count)
        return fail(api, "QuantizedMatMul: scales, zero points or mins disagree with the node's K, N and bits");
    return NULL;
}

/* memory for `bytes` of the kernel's weight, in huge pages where the system gives them on request */
static void *weight_memory(size_t bytes) {
    const size_t page = (size_t)2 << 20, align = bytes < page ? 64 : page; /* a small weight: no huge page */
    const size_t size = (bytes + align - 1) / align * align;
    void *memory = aligned_alloc(align, size);
#ifdef MADV_HUGEPAGE
    if (memory && align == page) madvise(memory, size, MADV_HUGEPAGE);
#endif
    return memory;
}

static int exact_half(float x) { return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)) == x; }

static void store_scale(uint8_t *at, float x, int64_t half) {
    if (half) {
        const uint16_t h = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
        memcpy(at, &h, sizeof h);
    } else {
        memcpy(at, &x, sizeof x);
    }
}

/* the records from the node's constant codes, scales, zero points and (has_mins) mins */
static OrtStatus *make_weight(const OrtApi *api, const OrtKernelInfo *info, Kernel *kn, int64_t has_mins) {
    const int64_t N = kn->N, blocks = kn->blocks, code_bytes = CODE_BYTES(kn->bits);
    void *codes, *scales, *zeros, *mins = NULL;
    TRY(constant(api, info, CODES, N * blocks * code_bytes, &codes));
    TRY(constant(api, info, SCALES, N * blocks, &scales));
    TRY(constant(api, info, ZEROS, kn->bits == 4 ? N * ((blocks + 1) / 2) : N * blocks, &zeros));
    if (has_mins) TRY(constant(api, info, MINS, N * blocks, &mins));
    const uint8_t *z8 = zeros;
    const float *d = scales;
    float *e = malloc(sizeof(float) * (size_t)(N * blocks)); /* [N, blocks] */
    if (!e) return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "QuantizedMatMul: no memory for the weight");
    kn->half = 1;
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < blocks; b++) {
            const int z = kn->bits == 4 ? (z8[n * ((blocks + 1) / 2) + b / 2] >> (4 * (b % 2))) & 0x0f
                                        : z8[n * blocks + b];
            const float m = mins ? ((const float *)mins)[b * N + n] : 0.0f;
            e[n * blocks + b] = m - d[n * blocks + b] * (float)z;
            kn->half = kn->half && exact_half(d[n * blocks + b]) && exact_half(e[n * blocks + b]);
        }
    const int64_t all = (N + GROUP - 1) / GROUP, record_bytes = RECORD(kn->bits, kn->half), scale = SCALE_BYTES(kn->half);
    kn->records = weight_memory((size_t)(all * blocks * record_bytes));
    if (!kn->records) {
        free(e);
        return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "QuantizedMatMul: no memory for the weight");
    }
    for (int64_t n = 0; n < all * GROUP; n++) { /* channels past N repeat the last */
        const int64_t from = (n < N ? n : N - 1) * blocks, c = n % GROUP;
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *record = kn->records + (n / GROUP * blocks + b) * record_bytes;
            uint8_t *floats = record + GROUP * code_bytes;
            memcpy(record + c * code_bytes, (const uint8_t *)codes + (from + b) * code_bytes, (size_t)code_bytes);
            store_scale(floats + c * scale, d[from + b], kn->half);
            store_scale(floats + (GROUP + c) * scale, e[from + b], kn->half);
        }
    }
    free(e);
    return NULL;
}

static OrtStatus *create_kernel(const void *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    Kernel *kn = calloc(1, sizeof(Kernel));
    if (!kn) return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "QuantizedMatMul: out of memory");
    kn->api = api;
    int64_t has_mins = 0;
    OrtStatus *status = API(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, GetAttributeInt64Fn)(info, "K", &kn->K);
    if (!status) status = API(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, GetAttributeInt64Fn)(info, "N", &kn->N);
    if (!status) status = API(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, GetAttributeInt64Fn)(info, "bits", &kn->bits);
    if (!status) status = API(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, GetAttributeInt64Fn)(info, "mins", &has_mins);
    if (!status && (kn->K <= 0 || kn->N <= 0 || (kn->bits != 4 && kn->bits != 8)))
        status = fail(api, "QuantizedMatMul: K and N must be positive and bits 4 or 8");
    if (!status) {
        kn->blocks = (kn->K + BLOCK - 1) / BLOCK;
        status = make_weight(api, info, kn, has_mins);
    }
    if (status) {
        free(kn->records);
        free(kn);
        return status;
    }
    *out = kn;
    return NULL;
}

static void destroy_kernel(void *kernel) {
    Kernel *kn = kernel;
    free(kn->records);
    free(kn);
}
static const char *op_name(const void *op) { (void)op; return "QuantizedMatMul"; }
static int input_type(const void *op, size_t i) { (void)op; return i < INPUTS ? INPUT_TYPES[i] : 0; }
static size_t input_count(const void *op) { (void)op; return INPUTS; }
static int input_characteristic(const void *op, size_t i) { (void)op; return i == MINS ? INPUT_OPTIONAL : INPUT_REQUIRED; }

const OrtCustomOp QUANTIZED_OP = CUSTOM_OP(op_name, input_type, input_count, input_characteristic, create_kernel,
                                          compute, destroy_kernel);
#endif
