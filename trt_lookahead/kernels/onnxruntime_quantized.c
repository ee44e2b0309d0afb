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
 * block of codes is 32 bytes. With AVX-512's 32 vector registers 8 rows share a record. Where the compiler targets
 * AVX-512 BW and VNNI (WIDE), 4-bit weights run on 512-bit vectors: a group is 16 channels, and each instruction
 * does the work of two (a CPU that splits a 512-bit operation in two still issues half the instructions); 8-bit
 * weights stay in 8-channel groups (see WIDE). The sums are the same 16-element sums, so the float operations and
 * the bits are the same at every width, with and without VNNI (tests/kernels/test_quantized_kernel.py builds the
 * narrower paths and compares them). The tile code is written once for both widths: onnxruntime_quantized_tile.h.
 *
 * An 8-bit weight whose codes are all below 32 (a GGUF's Q5_0, Q5_1 and Q5_K blocks: engine/quantize.py keeps them
 * as 8-bit codes) is copied into 5-bit records: a 4-bit record's bytes of the codes' low 4 bits, then a plane of
 * their fifth bits, 20 code bytes a (channel, block) with VNNI (24 without) against 32, unpacked as a 4-bit record's
 * with one OR of the fifth bits a vector (five_bit_codes, FIFTH). The products are the same integer sums, so the
 * bits are the 8-bit records'; a one-row product streams two thirds of the bytes (docs/design.md 6.9).
 */
#include "onnxruntime_api.h"

#if QUANTIZED_KERNEL
#include <immintrin.h>
#include <sys/mman.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1 /* unsigned x signed byte products, 4 added to each 32-bit lane, in one instruction */
#define DPBUSD_256 _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define VNNI 1
#define DPBUSD_256 _mm256_dpbusd_avx_epi32
#else
#define VNNI 0
#endif
/* 4-bit weights' products on 512-bit vectors too (AVX-512 BW: their byte and 16-bit operations): 16 channels a
 * record. Not 8-bit ones: a one-row product streams 16-channel 8-bit records slower from memory than 8-channel
 * ones (docs/results/2026-12-01-int4-wide-vnni.md), and a greedy step's lm_head is one. */
#if VNNI && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WIDE 1
#else
#define WIDE 0
#endif
#define BLOCK 32 /* weights per (channel, block): engine/quantize.py's BLOCK_SIZE */
#define NIBBLE_BYTES (BLOCK / 2) /* a block's 4-bit codes, or a 5-bit block's low 4 bits */
#define FIFTH_BYTES (VNNI ? BLOCK / 8 : BLOCK / 4) /* a 5-bit block's plane of fifth bits (see five_bit_codes) */
#if VNNI
#define GROUP 8   /* channels whose blocks lie together in the kernel's copy of the weight, one a 32-bit lane */
#define VECTORS 2 /* a row's sums per group: the channels' halves 0 (elements 0-7, 16-23), then 1 (8-15, 24-31) */
#else
#define GROUP 4   /* lanes c and 4 + c channel c's halves */
#define VECTORS 1
#endif
#define WIDE_GROUP 16 /* channels a 4-bit record holds where WIDE: one a lane of a 512-bit vector */
/* a row's block of codes as the products read it: with VNNI, 32 bytes; without, 4- and 5-bit, 128, 8-bit, 32 int16 */
#define A_BYTES(bits) (VNNI ? 32 : (bits) != 8 ? 128 : 64)
#ifdef __AVX512VL__
#define ROWS 8 /* rows multiplied together where there are more than one: their accumulators stay in registers */
#else
#define ROWS 4
#endif
#define TASK_CHANNELS 16 /* channels per parallel task: whole groups at every width */
#define AHEAD 8         /* records prefetched ahead of the one multiplied: without, a product of several rows
                         * waited on memory at each group (docs/results/2026-12-01-cpu-vnni.md) */
#define CODE_MAX 127.0f /* an activation code's largest magnitude (engine/quantize.py's ACTIVATION_CODE) */

/* A (group, block)'s record in the kernel's copy of the weight, so that a group's blocks stream in order: the
 * group's channels' code bytes (4-bit, and 8-bit with VNNI: dword by dword, see make_weight; 8-bit without:
 * channel by channel; 5-bit: a 4-bit record's bytes of their low 4 bits, then the plane of their fifth bits), then
 * their d and then their e, each `half` ? float16 : float32. Channels past N repeat the last. A group is
 * group_of(bits) channels. */
#define CODE_BYTES(bits) ((bits) == 5 ? NIBBLE_BYTES + FIFTH_BYTES : BLOCK * (bits) / 8)
/* a 4- or 5-bit record's code bytes that one vector of the products loads: with VNNI, one dword per channel */
#define RAW_BYTES(group) (VNNI ? 4 * (group) : 32)
#define SCALE_BYTES(half) ((half) ? 2 : 4)
#define RECORD_BYTES(group, bits, half) ((group) * (CODE_BYTES(bits) + 2 * SCALE_BYTES(half)))

static inline int64_t group_of(int64_t bits) { return WIDE && bits != 8 ? WIDE_GROUP : GROUP; }
static inline int64_t record_bytes(int64_t bits, int64_t half) { return RECORD_BYTES(group_of(bits), bits, half); }

typedef struct {
    const uint8_t *records; /* [ceil(N / group), blocks] record_bytes(bits, half) each (the Kernel's) */
    const uint8_t *a;       /* [M, blocks, A_BYTES(bits)] the rows' codes */
    const float *s, *sums;  /* [M, blocks] each block's scale and scaled code sum */
    float *y;               /* [M, N] */
    int64_t M, N, blocks, bits, half; /* bits: the records' codes, 4, 5 or 8 */
} Product;

/* Row r's codes, scales and sums. A block's codes go as the products read them (a record's layout, make_weight):
 * with VNNI, 32 bytes, each dword k the 4 codes dword k of a channel's record multiplies (4- and 5-bit, chunk q's even
 * elements at 2q, its odd ones at 2q + 1; 8-bit, elements 4k .. 4k + 3); without, 4- and 5-bit weights, four vectors of
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
            _mm256_storeu_si256((__m256i *)out, bits != 8 ? _mm256_shuffle_epi8(bytes, even_odd) : bytes);
        } else if (bits != 8) { /* each half of chunks (0 | 1), then (2 | 3), picked per lane */
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

/* The fifth bits of a 5-bit record's codes whose low 4 bits are the low (parity 0) or high (1) nibbles of the
 * record's raw vector v, t = 2v + parity, as 16 or 0 in each byte: each plane byte's bit t moved to bit 4. The
 * shifts are 16-bit, but one of at most 4 places moves no bit the mask keeps across a byte. */
#define FIFTH(plane, t, SHIFT_LEFT16, SHIFT_RIGHT16, AND, SET1_8) \
    AND((t) <= 4 ? SHIFT_LEFT16(plane, 4 - (t)) : SHIFT_RIGHT16(plane, (t) - 4), SET1_8(0x10))

/* 8 (or 16) of a record's d or e as float32 */
static inline __m256 eight(const uint8_t *at, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at)) : _mm256_loadu_ps((const float *)at);
}
#if WIDE
static inline __m512 sixteen(const uint8_t *at, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at)) : _mm512_loadu_ps((const float *)at);
}
#endif

#if !VNNI
/* AVX2's group of 4 channels, for onnxruntime_quantized_tile.h */
typedef const uint8_t *Operands_256[1]; /* the record itself */
typedef __m256i Dots_256;               /* a row's sums of a group: lanes c and 4 + c channel c's */
static inline void weight_operands_256(const uint8_t *record, int bits, const uint8_t **w) {
    (void)bits, w[0] = record;
}

/* A group's block products with one row: dots[0] lanes c and 4 + c channel c's, each the exact integer sum of
 * q * a over a fixed 16 of the block's 32 elements (0-7 and 16-23 in lane c, 8-15 and 24-31 in lane 4 + c). */
static inline void block_dots_256(const uint8_t *const *w, const uint8_t *a, int bits, __m256i dots[VECTORS]) {
    const uint8_t *record = w[0];
    if (bits != 8) { /* per chunk pair, low nibbles x even elements + high x odd (5-bit: with their fifth bits);
                      * 16-bit sums: |sum| <= 8 * 31 * 127 */
        const __m256i mask = _mm256_set1_epi8(0x0f);
        __m256i sums = _mm256_setzero_si256(), plane = _mm256_setzero_si256();
        if (bits == 5) plane = _mm256_loadu_si256((const __m256i *)(record + GROUP * NIBBLE_BYTES));
        for (int h = 0; h < 2; h++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(record + RAW_BYTES(GROUP) * h));
            __m256i low = _mm256_and_si256(raw, mask), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            if (bits == 5) {
                low = _mm256_or_si256(low, FIFTH(plane, 2 * h, _mm256_slli_epi16, _mm256_srli_epi16, _mm256_and_si256,
                                                 _mm256_set1_epi8));
                high = _mm256_or_si256(high, FIFTH(plane, 2 * h + 1, _mm256_slli_epi16, _mm256_srli_epi16,
                                                   _mm256_and_si256, _mm256_set1_epi8));
            }
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

/* a record's d and e, lane by lane as block_dots' sums lie: the 4 d twice; the 4 e, then zeros (e added once a
 * channel) */
static inline void group_scales_256(const uint8_t *scales, int half, __m256 *d, __m256 *e) {
    const __m128 d4 = half ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)scales)) : _mm_loadu_ps((const float *)scales);
    const uint8_t *mins = scales + GROUP * SCALE_BYTES(half);
    const __m128 e4 = half ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)mins)) : _mm_loadu_ps((const float *)mins);
    *d = _mm256_set_m128(d4, d4), *e = _mm256_zextps128_ps256(e4);
}
#endif

/* tile_256 and groups_256: 256-bit vectors, GROUP channels a record */
#define W 256
#define W_GROUP GROUP
#define Floats __m256
#define F_LANES 8
#define F_ZERO _mm256_setzero_ps
#define F_SET1 _mm256_set1_ps
#define F_MUL _mm256_mul_ps
#define F_FMADD _mm256_fmadd_ps
#define F_STORE _mm256_storeu_ps
#define F_FROM_INTS _mm256_cvtepi32_ps
#define F_SCALES eight
#define Ints __m256i
#define I_LOAD(at) _mm256_loadu_si256((const __m256i *)(at))
#define I_ZERO _mm256_setzero_si256
#define I_AND _mm256_and_si256
#define I_SHIFT16 _mm256_srli_epi16 /* each 16-bit lane right */
#define I_SHIFTL16 _mm256_slli_epi16
#define I_OR _mm256_or_si256
#define I_SET1_8 _mm256_set1_epi8
#define I_SET1_32 _mm256_set1_epi32
#define I_DPBUSD DPBUSD_256
#include "onnxruntime_quantized_tile.h"

#if WIDE /* tile_512 and groups_512: 512-bit vectors, WIDE_GROUP channels a (4-bit) record */
#define W 512
#define W_GROUP WIDE_GROUP
#define Floats __m512
#define F_LANES 16
#define F_ZERO _mm512_setzero_ps
#define F_SET1 _mm512_set1_ps
#define F_MUL _mm512_mul_ps
#define F_FMADD _mm512_fmadd_ps
#define F_STORE _mm512_storeu_ps
#define F_FROM_INTS _mm512_cvtepi32_ps
#define F_SCALES sixteen
#define Ints __m512i
#define I_LOAD(at) _mm512_loadu_si512((const void *)(at))
#define I_ZERO _mm512_setzero_si512
#define I_AND _mm512_and_si512
#define I_SHIFT16 _mm512_srli_epi16
#define I_SHIFTL16 _mm512_slli_epi16
#define I_OR _mm512_or_si512
#define I_SET1_8 _mm512_set1_epi8
#define I_SET1_32 _mm512_set1_epi32
#define I_DPBUSD _mm512_dpbusd_epi32
#include "onnxruntime_quantized_tile.h"
#endif

static void multiply_task(void *data, size_t task) {
    const Product *p = data;
    const int64_t group = group_of(p->bits), all = (p->N + group - 1) / group;
    const int64_t first = (int64_t)task * (TASK_CHANNELS / group);
    const int64_t end = first + TASK_CHANNELS / group < all ? first + TASK_CHANNELS / group : all;
#if WIDE
#define NIBBLE_GROUPS groups_512 /* 4- and 5-bit records' */
#else
#define NIBBLE_GROUPS groups_256
#endif
    /* constants: each compiles to its own loops */
    if (p->bits == 4) p->half ? NIBBLE_GROUPS(p, first, end, 4, 1) : NIBBLE_GROUPS(p, first, end, 4, 0);
    else if (p->bits == 5) p->half ? NIBBLE_GROUPS(p, first, end, 5, 1) : NIBBLE_GROUPS(p, first, end, 5, 0);
    else p->half ? groups_256(p, first, end, 8, 1) : groups_256(p, first, end, 8, 0);
#undef NIBBLE_GROUPS
}

/* ---- the kernel ------------------------------------------------------------------------------------------- */

enum { INPUTS = 5, X = 0, CODES = 1, SCALES = 2, ZEROS = 3, MINS = 4 };
static const int INPUT_TYPES[INPUTS] = {TYPE_FLOAT, TYPE_UINT8, TYPE_FLOAT, TYPE_UINT8, TYPE_FLOAT};

/* The weight as the kernel reads it, made once from the node's constant inputs into memory of its own (not the
 * engine file's pages): record_bytes(record_bits, half) per (group, block) */
typedef struct {
    const OrtApi *api;
    int64_t K, N, bits, blocks; /* bits: the node's codes, 4 or 8 */
    int64_t record_bits; /* the records': the node's, or 5 where every 8-bit code is below 32 (a GGUF's Q5 blocks:
                          * the same sums from two thirds of the bytes) */
    int64_t half;        /* every d and e is a float16 exactly (a GGUF's blocks): the records hold them so */
    uint8_t *records;    /* [ceil(N / group_of(record_bits)), blocks] record_bytes(record_bits, half) each */
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
    const int64_t bits = kn->record_bits;
    Product p = {kn->records, NULL, NULL, NULL, NULL, M, N, blocks, bits, kn->half};
    TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)(output, (void **)&p.y));
    if (M == 0) return NULL;
    const size_t bytes = (size_t)(M * blocks * A_BYTES(bits)) + (size_t)(2 * M * blocks) * sizeof(float);
    uint8_t *a = aligned_alloc(32, (bytes + 31) / 32 * 32); /* the codes, then the scales and sums */
    if (!a) return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "QuantizedMatMul: no memory for the rows' codes");
    float *s = (float *)(a + M * blocks * A_BYTES(bits)), *sums = s + M * blocks;
    for (int64_t r = 0; r < M; r++)
        quantize_row((const float *)x + r * K, K, blocks, bits, a + r * blocks * A_BYTES(bits), s + r * blocks,
                     sums + r * blocks);
    p.a = a, p.s = s, p.sums = sums;
    const size_t tasks = (size_t)((N + TASK_CHANNELS - 1) / TASK_CHANNELS);
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

/* Channel c's block of 8-bit codes, each below 32, into its place in a 5-bit record of `group` channels (zeroed
 * before): their low 4 bits where a 4-bit record holds them (make_weight), their fifth bits in the plane after the
 * group's NIBBLE_BYTES each. The code whose low 4 bits are the low (parity 0) or high (1) nibble of byte p of the
 * record's raw vector v (RAW_BYTES each) has its fifth bit at bit 2v + parity of the plane's byte p, so one vector
 * of the plane holds the fifth bits of every raw vector's nibbles (FIFTH). */
static void five_bit_codes(uint8_t *record, int64_t group, int64_t c, const uint8_t *code) {
    uint8_t *plane = record + group * NIBBLE_BYTES;
    for (int i = 0; i < BLOCK; i++) {
        const int j = i / 2, parity = i % 2;                  /* element i's byte in a 4-bit block, and nibble */
        const int64_t at = 4 * (group * (j / 4) + c) + j % 4; /* dword j / 4 of the group's channels side by side */
        record[at] |= (uint8_t)((code[i] & 0x0f) << (4 * parity));
        plane[at % RAW_BYTES(group)] |= (uint8_t)((code[i] >> 4) << (2 * (at / RAW_BYTES(group)) + parity));
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
    kn->record_bits = kn->bits;
    if (kn->bits == 8) {
        int below = 1; /* every code below 32 */
        for (int64_t i = 0; i < N * blocks * code_bytes && below; i++) below = ((const uint8_t *)codes)[i] < 32;
        kn->record_bits = below ? 5 : 8;
    }
    const int64_t bits = kn->record_bits, group = group_of(bits), all = (N + group - 1) / group;
    const int64_t scale = SCALE_BYTES(kn->half), record_size = record_bytes(bits, kn->half);
    const size_t size = (size_t)(all * blocks * record_size);
    kn->records = weight_memory(size);
    if (!kn->records) {
        free(e);
        return API(api, CREATE_STATUS, CreateStatusFn)(ORT_FAIL, "QuantizedMatMul: no memory for the weight");
    }
    if (bits == 5) memset(kn->records, 0, size); /* five_bit_codes sets bits; the other records are copied whole */
    for (int64_t n = 0; n < all * group; n++) { /* channels past N repeat the last */
        const int64_t from = (n < N ? n : N - 1) * blocks, c = n % group;
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *record = kn->records + (n / group * blocks + b) * record_size;
            uint8_t *floats = record + group * CODE_BYTES(bits);
            const uint8_t *code = (const uint8_t *)codes + (from + b) * code_bytes;
            if (bits == 5)
                five_bit_codes(record, group, c, code);
            else if (bits == 4 || VNNI) /* dword k of the group's channels side by side */
                for (int k = 0; k < code_bytes / 4; k++) memcpy(record + 4 * (group * k + c), code + 4 * k, 4);
            else
                memcpy(record + c * code_bytes, code, (size_t)code_bytes);
            store_scale(floats + c * scale, d[from + b], kn->half);
            store_scale(floats + (group + c) * scale, e[from + b], kn->half);
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
