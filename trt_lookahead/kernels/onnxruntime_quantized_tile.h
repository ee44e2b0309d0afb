/* One vector width of onnxruntime_quantized.c's products, included by it once per width (C's stand-in for a
 * template). The includer defines
 *   W                  the width in bits: the suffix of every function here (tile_256, groups_512, ..)
 *   W_GROUP            channels a record holds (with VNNI, one a 32-bit lane)
 *   Floats, F_*        the width's float32 vector and its operations (F_LANES lanes)
 *   Ints, I_*          with VNNI, the width's integer vector and its operations (I_SHIFT16 right, I_SHIFTL16 left)
 * and, without VNNI, the AVX2 path's own Operands_256, Dots_256, weight_operands_256, block_dots_256 and
 * group_scales_256.
 * The parameters are undefined at the end. The arithmetic is the includer's (its header comment): every width
 * runs the same float operations on the same 16-element integer sums, so every width gives the same bits.
 */
#define W_CAT_(name, width) name##_##width
#define W_CAT(name, width) W_CAT_(name, width)
#define W_NAME(name) W_CAT(name, W) /* name_W */
#define W_RECORD(bits, half) RECORD_BYTES(W_GROUP, bits, half)

#if VNNI
/* A (group, block)'s weight as the byte products take it, loaded once for all the rows of a tile: operand k
 * multiplies a row's dword k (quantize_row), lane c channel c's 4 codes: 4- and 5-bit, chunk k / 2's low nibbles
 * (its even elements) for even k, its high ones (odd elements) for odd k, 5-bit with their fifth bits; 8-bit,
 * elements 4k .. 4k + 3. */
typedef Ints W_NAME(Operands)[8];
typedef Ints W_NAME(Dots); /* a row's sums of a group: lane c channel c's */
static inline void W_NAME(weight_operands)(const uint8_t *record, int bits, Ints *w) {
    if (bits != 8) {
        const Ints mask = I_SET1_8(0x0f), plane = bits == 5 ? I_LOAD(record + W_GROUP * NIBBLE_BYTES) : I_ZERO();
        for (int q = 0; q < 4; q++) { /* raw vector q: chunk q */
            const Ints raw = I_LOAD(record + RAW_BYTES(W_GROUP) * q);
            w[2 * q] = I_AND(raw, mask);
            w[2 * q + 1] = I_AND(I_SHIFT16(raw, 4), mask);
            if (bits == 5) {
                w[2 * q] = I_OR(w[2 * q], FIFTH(plane, 2 * q, I_SHIFTL16, I_SHIFT16, I_AND, I_SET1_8));
                w[2 * q + 1] = I_OR(w[2 * q + 1], FIFTH(plane, 2 * q + 1, I_SHIFTL16, I_SHIFT16, I_AND, I_SET1_8));
            }
        }
    } else {
        for (int k = 0; k < 8; k++) w[k] = I_LOAD(record + 4 * W_GROUP * k);
    }
}

/* A group's block products with one row: dots[h] lane c channel c's exact integer sum of q * a over half h of the
 * block's elements (0-7 and 16-23, then 8-15 and 24-31: dword k lies in chunk k / 2). */
static inline void W_NAME(block_dots)(const Ints *w, const uint8_t *a, int bits, Ints dots[VECTORS]) {
    (void)bits;
    dots[0] = dots[1] = I_ZERO();
    for (int k = 0; k < 8; k++) {
        int32_t quad;
        memcpy(&quad, a + 4 * k, sizeof quad);
        dots[(k >> 1) & 1] = I_DPBUSD(dots[(k >> 1) & 1], w[k], I_SET1_32(quad));
    }
}

/* a record's d and e, lane c channel c's, as block_dots' sums lie (e added once a channel: in its half 0) */
static inline void W_NAME(group_scales)(const uint8_t *scales, int half, Floats *d, Floats *e) {
    *d = F_SCALES(scales, half), *e = F_SCALES(scales + W_GROUP * SCALE_BYTES(half), half);
}
#endif

/* rows r0 .. r0 + rows of group g's channels. The row count only chooses how many accumulators stay in
 * registers: each (row, channel) runs the same chains. */
static inline __attribute__((always_inline)) void W_NAME(tile)(const Product *p, int64_t g, int64_t r0, int rows,
                                                               int bits, int half) {
    Floats lanes[ROWS][VECTORS]; /* lanes c and W_GROUP + c of a row's: channel c's halves */
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < VECTORS; h++) lanes[r][h] = F_ZERO();
    const uint8_t *record = p->records + g * p->blocks * W_RECORD(bits, half);
    for (int64_t b = 0; b < p->blocks; b++, record += W_RECORD(bits, half)) {
        for (int line = 0; line < W_RECORD(bits, half); line += 64) /* past the last record: a no-op, never a fault */
            _mm_prefetch((const char *)(record + AHEAD * W_RECORD(bits, half) + line), _MM_HINT_T0);
        Floats d, e;
        W_NAME(group_scales)(record + W_GROUP * CODE_BYTES(bits), half, &d, &e);
        W_NAME(Operands) w;
        W_NAME(weight_operands)(record, bits, w);
        for (int r = 0; r < rows; r++) {
            const int64_t row = (r0 + r) * p->blocks + b;
            W_NAME(Dots) dots[VECTORS];
            W_NAME(block_dots)(w, p->a + row * A_BYTES(bits), bits, dots);
            const Floats ds = F_MUL(d, F_SET1(p->s[row]));
            lanes[r][0] = F_FMADD(F_FROM_INTS(dots[0]), ds, F_FMADD(e, F_SET1(p->sums[row]), lanes[r][0]));
            for (int h = 1; h < VECTORS; h++) lanes[r][h] = F_FMADD(F_FROM_INTS(dots[h]), ds, lanes[r][h]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float l[2 * W_GROUP]; /* VECTORS * F_LANES of them */
        for (int h = 0; h < VECTORS; h++) F_STORE(l + F_LANES * h, lanes[r][h]);
        for (int c = 0; c < W_GROUP && g * W_GROUP + c < p->N; c++)
            p->y[(r0 + r) * p->N + g * W_GROUP + c] = l[c] + l[W_GROUP + c];
    }
}

/* groups first .. end - 1, every row: ROWS-row tiles, then one tile of the rows left */
static inline __attribute__((always_inline)) void W_NAME(groups)(const Product *p, int64_t first, int64_t end,
                                                                 int bits, int half) {
    const int64_t left = p->M % ROWS, tiled = p->M - left;
    for (int64_t g = first; g < end; g++) {
        for (int64_t r0 = 0; r0 < tiled; r0 += ROWS) W_NAME(tile)(p, g, r0, ROWS, bits, half);
        switch (left) { /* constant row counts: each its own registers */
        case 1: W_NAME(tile)(p, g, tiled, 1, bits, half); break;
        case 2: W_NAME(tile)(p, g, tiled, 2, bits, half); break;
        case 3: W_NAME(tile)(p, g, tiled, 3, bits, half); break;
#if ROWS > 4
        case 4: W_NAME(tile)(p, g, tiled, 4, bits, half); break;
        case 5: W_NAME(tile)(p, g, tiled, 5, bits, half); break;
        case 6: W_NAME(tile)(p, g, tiled, 6, bits, half); break;
        case 7: W_NAME(tile)(p, g, tiled, 7, bits, half); break;
#endif
        }
    }
}

#undef W_RECORD
#undef W_NAME
#undef W_CAT
#undef W_CAT_
#undef W
#undef W_GROUP
#undef Floats
#undef F_LANES
#undef F_ZERO
#undef F_SET1
#undef F_MUL
#undef F_FMADD
#undef F_STORE
#undef F_FROM_INTS
#undef F_SCALES
#undef Ints
#undef I_LOAD
#undef I_ZERO
#undef I_AND
#undef I_SHIFT16
#undef I_SHIFTL16
#undef I_OR
#undef I_SET1_8
#undef I_SET1_32
#undef I_DPBUSD
