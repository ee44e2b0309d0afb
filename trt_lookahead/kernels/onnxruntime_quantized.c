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
 *     lanes[l] = fma(float(dot_l), d * s, fma(l == 0 ? e : 0, S, lanes[l]))   l < 2, dot_l the exact integer sum
 *                                                                            of q * a over a fixed 16 of the
 *                                                                            block's 32 elements
 *     y        = lanes0 + lanes1
 *
 * Row-invariant by construction: a row's codes depend only on the row, the integer sums are exact, and every
 * float operation above runs in this order for every row count and thread split (channels are split across
 * threads, rows tiled through the same code), so a product of one row has the bits of the same row among 64,
 * and an exact engine need not pad a step to two rows (docs/design.md 6.9).
 *
 * The kernel copies the weight once, when onnxruntime creates it, into records that stream in the order it reads
 * them: per group of 4 channels and block, their codes, d and e. A block's products for all 4 channels come out
 * of one 256-bit vector of 32-bit sums, lanes c and 4 + c channel c's: a 4-bit record holds each 8-element chunk
 * of the block (4 code bytes) for the 4 channels side by side, so its low and high nibbles multiply the chunk's
 * even and odd elements' codes, which quantize_row lays out 4 times over: a 4-bit (row, group, block) costs 4
 * byte products, 1 widening and 3 float operations, and 4 rows share a record's loads and nibble splits. Needs
 * AVX2, FMA and F16C (QUANTIZED_KERNEL); onnxruntime's C API: onnxruntime_api.h; registered by
 * onnxruntime_ops.c.
 *
 * Where the compiler targets VNNI (AVX-512 VNNI with VL, or AVX-VNNI), one instruction adds 4 byte products to
 * each 32-bit lane: a group is 8 channels, one a lane, and a record holds each 4 code bytes (4-bit: 8 elements)
 * of the block for the 8 channels side by side. A tile loads a record's 8 vectors of codes once (4-bit: the low
 * nibbles of each 4 bytes, then their high ones) for all its rows, and each of a row's 8 code dwords (4-bit: a chunk's
 * even elements, then its odd ones), broadcast to every lane, multiplies one of them into one of two sums, the
 * channels' halves (0-7 and 16-23, then 8-15 and 24-31). Per 8 channels a (row, block) takes 8 byte products, 2
 * conversions and 4 float operations, 4-bit or 8-bit alike (as 4-channel groups, 6 float operations), and a row's
 * block of codes is 32 bytes. With AVX-512's 32 vector registers 8 rows share a record. The sums are the same
 * 16-element sums, so the float operations and the bits are the same with and without VNNI
 * (tests/kernels/test_quantized_kernel.py builds both and compares them).
 */
#include "onnxruntime_api.h"

#if QUANTIZED_KERNEL
#include <immintrin.h>
#include <sys/mman.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1 /* unsigned x signed byte products, 4 added to each 32-bit lane, in one instruction */
#define DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define VNNI 1
#define DPBUSD _mm256_dpbusd_avx_epi32
#else
#define VNNI 0
#endif
#define BLOCK 32        /* weights per (channel, block): engine/quantize.py's BLOCK_SIZE */
#if VNNI
#define GROUP 8   /* channels whose blocks lie together in the kernel's copy of the weight, one a 32-bit lane */
#define VECTORS 2 /* a row's sums per group: the channels' halves 0 (elements 0-7, 16-23), then 1 (8-15, 24-31) */
#else
#define GROUP 4   /* lanes c and 4 + c channel c's halves */
#define VECTORS 1
#endif
/* a row's block of codes as the products read it: with VNNI, 32 bytes; without, 4-bit, 128, 8-bit, 32 int16 */
#define A_BYTES(bits) (VNNI ? 32 : (bits) == 4 ? 128 : 64)
#ifdef __AVX512VL__
#define ROWS 8 /* rows multiplied together where there are more than one: their accumulators stay in registers */
#else
#define ROWS 4
#endif
#define TASK_GROUPS (16 / GROUP) /* groups per parallel task: 16 channels */
#define AHEAD 8         /* records prefetched ahead of the one multiplied: without, a product of several rows
                         * waited on memory at each group (docs/results/2026-12-01-cpu-vnni.md) */
#define CODE_MAX 127.0f /* an activation code's largest magnitude (engine/quantize.py's ACTIVATION_CODE) */

/* A (group, block)'s record in the kernel's copy of the weight, so that a group's blocks stream in order: the
 * GROUP channels' code bytes (4-bit, and 8-bit with VNNI: dword by dword, see make_weight; 8-bit without:
 * channel by channel), then their d and then their e, each `half` ? float16 : float32. Channels past N repeat the
 * last. */
#define CODE_BYTES(bits) (BLOCK * (bits) / 8)
#define SCALE_BYTES(half) ((half) ? 2 : 4)
#define RECORD(bits, half) (GROUP * CODE_BYTES(bits) + 2 * GROUP * SCALE_BYTES(half))

typedef struct {
    const uint8_t *records; /* [ceil(N / GROUP), blocks] RECORD(bits, half) each (the Kernel's) */
    const uint8_t *a;       /* [M, blocks, A_BYTES(bits)] the rows' codes */
    const float *s, *sums;  /* [M, blocks] each block's scale and scaled code sum */
    float *y;               /* [M, N] */
    int64_t M, N, blocks, bits, half;
} Product;

/* Row r's codes, scales and sums. A block's codes go as the products read them (a record's layout, make_weight):
 * with VNNI, 32 bytes, each dword k the 4 codes dword k of a channel's record multiplies (4-bit, chunk q's even
 * elements at 2q, its odd ones at 2q + 1; 8-bit, elements 4k .. 4k + 3); without, 4-bit weights, four vectors of
 * 32 bytes, each half of a vector the 4 even (or odd) elements of one 8-element chunk q of the block repeated for
 * the group's 4 channels, in the order (chunk 0 | chunk 1) even, odd, then (chunk 2 | chunk 3) even, odd; 8-bit,
 * the 32 codes as int16. */
static void quantize_row(const float *x, int64_t K, int64_t blocks, int64_t bits, uint8_t *a, float *s, float *sums) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes packs' lane interleave */
    /* per 16-byte lane (chunks 2h, 2h + 1): each chunk's even elements, then its odd ones */
    const __m256i even_odd = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                              0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const __m256i even = _mm256_setr_epi8(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6,
                                          8, 10, 12, 14, 8, 10, 12, 14, 8, 10, 12, 14, 8, 10, 12, 14);
    const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi8(1));
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
        uint8_t *out = a + b * A_BYTES(bits);
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(low, high), in_order); /* in order */
        if (VNNI) {
            _mm256_storeu_si256((__m256i *)out, bits == 4 ? _mm256_shuffle_epi8(bytes, even_odd) : bytes);
        } else if (bits == 4) { /* each half of chunks (0 | 1), then (2 | 3), picked per lane */
            for (int h = 0; h < 2; h++) { /* chunks: elements 16h .. 16h + 15 in each half */
                const __m256i chunks = _mm256_permute4x64_epi64(bytes, h ? 0xee : 0x44);
                _mm256_storeu_si256((__m256i *)(out + 64 * h), _mm256_shuffle_epi8(chunks, even));
                _mm256_storeu_si256((__m256i *)(out + 64 * h + 32), _mm256_shuffle_epi8(chunks, odd));
            }
        } else { /* int16 in element order */
            _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(low, 0xd8));
            _mm256_storeu_si256((__m256i *)(out + 32), _mm256_permute4x64_epi64(high, 0xd8));
        }
        s[b] = amax / CODE_MAX;
        sums[b] = s[b] * (float)sum;
    }
}

#if VNNI
/* A (group, block)'s weight as the byte products take it, loaded once for all the rows of a tile: operand k
 * multiplies a row's dword k (quantize_row), lane c channel c's 4 codes: 4-bit, chunk k / 2's low nibbles (its
 * even elements) for even k, its high ones (odd elements) for odd k; 8-bit, elements 4k .. 4k + 3. */
typedef __m256i Operands[8];
static inline void weight_operands(const uint8_t *record, int bits, __m256i *w) {
    if (bits == 4) {
        const __m256i mask = _mm256_set1_epi8(0x0f);
        for (int q = 0; q < 4; q++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(record + 32 * q));
            w[2 * q] = _mm256_and_si256(raw, mask);
            w[2 * q + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        }
    } else {
        for (int k = 0; k < 8; k++) w[k] = _mm256_loadu_si256((const __m256i *)(record + 32 * k));
    }
}

/* A group's block products with one row: dots[h] lane c channel c's exact integer sum of q * a over half h of the
 * block's elements (0-7 and 16-23, then 8-15 and 24-31: dword k lies in chunk k / 2). */
static inline void block_dots(const __m256i *w, const uint8_t *a, int bits, __m256i dots[VECTORS]) {
    (void)bits;
    dots[0] = dots[1] = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        int32_t quad;
        memcpy(&quad, a + 4 * k, sizeof quad);
        dots[(k >> 1) & 1] = DPBUSD(dots[(k >> 1) & 1], w[k], _mm256_set1_epi32(quad));
    }
}
#else
typedef const uint8_t *Operands[1]; /* the record itself */
static inline void weight_operands(const uint8_t *record, int bits, const uint8_t **w) { (void)bits, w[0] = record; }

/* A group's block products with one row: dots[0] lanes c and 4 + c channel c's, each the exact integer sum of
 * q * a over a fixed 16 of the block's 32 elements (0-7 and 16-23 in lane c, 8-15 and 24-31 in lane 4 + c). */
static inline void block_dots(const uint8_t *const *w, const uint8_t *a, int bits, __m256i dots[VECTORS]) {
    const uint8_t *record = w[0];
    if (bits == 4) { /* per chunk pair, low nibbles x even elements + high x odd; 16-bit sums: |sum| <= 8 * 15 * 127 */
        const __m256i mask = _mm256_set1_epi8(0x0f);
        __m256i sums = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(record + 32 * h));
            const __m256i low = _mm256_and_si256(raw, mask), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            const __m256i even = _mm256_loadu_si256((const __m256i *)(a + 64 * h));
            const __m256i odd = _mm256_loadu_si256((const __m256i *)(a + 64 * h + 32));
            sums = _mm256_add_epi16(sums, _mm256_add_epi16(_mm256_maddubs_epi16(low, even),
                                                           _mm256_maddubs_epi16(high, odd)));
        }
        dots[0] = _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
        return;
    }
    const __m256i a0 = _mm256_loadu_si256((const __m256i *)a), a1 = _mm256_loadu_si256((const __m256i *)(a + 32));
    __m256i channel[GROUP]; /* lane l: elements 2l, 2l + 1, 16 + 2l, 17 + 2l */
    for (int c = 0; c < GROUP; c++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(record + c * CODE_BYTES(8)));
        channel[c] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), a0),
                                      _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), a1));
    }
    /* per 128-bit half: (c0 l0+l1, l2+l3, c1 ..), then (c0 l0..l3, c1, c2, c3 | c0 l4..l7, c1, c2, c3) */
    dots[0] = _mm256_hadd_epi32(_mm256_hadd_epi32(channel[0], channel[1]), _mm256_hadd_epi32(channel[2], channel[3]));
}
#endif

/* 4 (or 8) of a record's d or e as float32 */
static inline __m128 four(const uint8_t *at, int half) {
    return half ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)at)) : _mm_loadu_ps((const float *)at);
}
static inline __m256 eight(const uint8_t *at, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at)) : _mm256_loadu_ps((const float *)at);
}

/* a record's d and e, lane by lane as block_dots' sums lie: e only in a channel's half 0, so that each channel
 * adds e * S once */
static inline void group_scales(const uint8_t *scales, int half, __m256 *d, __m256 *e) {
    const uint8_t *mins = scales + GROUP * SCALE_BYTES(half);
#if VNNI
    *d = eight(scales, half), *e = eight(mins, half);
#else /* the 4 d twice; the 4 e, then zeros */
    const __m128 d4 = four(scales, half);
    *d = _mm256_set_m128(d4, d4), *e = _mm256_zextps128_ps256(four(mins, half));
#endif
}

/* rows r0 .. r0 + rows of group g's channels. The row count only chooses how many accumulators stay in
 * registers: each (row, channel) runs the same chains. */
static inline __attribute__((always_inline)) void tile(const Product *p, int64_t g, int64_t r0, int rows, int bits,
                                                       int half) {
    __m256 lanes[ROWS][VECTORS]; /* lanes c and GROUP + c of a row's: channel c's halves */
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < VECTORS; h++) lanes[r][h] = _mm256_setzero_ps();
    const uint8_t *record = p->records + g * p->blocks * RECORD(bits, half);
    for (int64_t b = 0; b < p->blocks; b++, record += RECORD(bits, half)) {
        for (int line = 0; line < RECORD(bits, half); line += 64) /* past the last record: a no-op, never a fault */
            _mm_prefetch((const char *)(record + AHEAD * RECORD(bits, half) + line), _MM_HINT_T0);
        __m256 d, e;
        group_scales(record + GROUP * CODE_BYTES(bits), half, &d, &e);
        Operands w;
        weight_operands(record, bits, w);
        for (int r = 0; r < rows; r++) {
            const int64_t row = (r0 + r) * p->blocks + b;
            __m256i dots[VECTORS];
            block_dots(w, p->a + row * A_BYTES(bits), bits, dots);
            const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(p->s[row]));
            lanes[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[0]), ds,
                                          _mm256_fmadd_ps(e, _mm256_set1_ps(p->sums[row]), lanes[r][0]));
            for (int h = 1; h < VECTORS; h++)
                lanes[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[h]), ds, lanes[r][h]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float l[8 * VECTORS];
        for (int h = 0; h < VECTORS; h++) _mm256_storeu_ps(l + 8 * h, lanes[r][h]);
        for (int c = 0; c < GROUP && g * GROUP + c < p->N; c++)
            p->y[(r0 + r) * p->N + g * GROUP + c] = l[c] + l[GROUP + c];
    }
}

static inline __attribute__((always_inline)) void groups(const Product *p, int64_t first, int64_t end, int bits,
                                                         int half) {
    const int64_t left = p->M % ROWS, tiled = p->M - left;
    for (int64_t g = first; g < end; g++) {
        for (int64_t r0 = 0; r0 < tiled; r0 += ROWS) tile(p, g, r0, ROWS, bits, half);
        switch (left) { /* constant row counts: each its own registers */
        case 1: tile(p, g, tiled, 1, bits, half); break;
        case 2: tile(p, g, tiled, 2, bits, half); break;
        case 3: tile(p, g, tiled, 3, bits, half); break;
#if ROWS > 4
        case 4: tile(p, g, tiled, 4, bits, half); break;
        case 5: tile(p, g, tiled, 5, bits, half); break;
        case 6: tile(p, g, tiled, 6, bits, half); break;
        case 7: tile(p, g, tiled, 7, bits, half); break;
#endif
        }
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
    const size_t bytes = (size_t)(M * blocks * A_BYTES(kn->bits)) + (size_t)(2 * M * blocks) * sizeof(float);
    uint8_t *a = aligned_alloc(32, (bytes + 31) / 32 * 32); /* the codes, then the scales and sums */
    if (!a) return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "QuantizedMatMul: no memory for the rows' codes");
    float *s = (float *)(a + M * blocks * A_BYTES(kn->bits)), *sums = s + M * blocks;
    for (int64_t r = 0; r < M; r++)
        quantize_row((const float *)x + r * K, K, blocks, kn->bits, a + r * blocks * A_BYTES(kn->bits),
                     s + r * blocks, sums + r * blocks);
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
            const uint8_t *code = (const uint8_t *)codes + (from + b) * code_bytes;
            if (kn->bits == 4 || VNNI) /* dword k of the group's channels side by side */
                for (int k = 0; k < code_bytes / 4; k++) memcpy(record + 4 * (GROUP * k + c), code + 4 * k, 4);
            else
                memcpy(record + c * code_bytes, code, (size_t)code_bytes);
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

const OrtCustomOp QUANTIZED_OP = CUSTOM_OP(op_name, input_type, input_count, input_characteristic, one_output,
                                          create_kernel, compute, destroy_kernel);
#endif
