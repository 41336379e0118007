/* Quantized Linear weights made at load: int8 with one f32 scale per row
 * (MOE_DTYPE_I8), and 4-bit in groups with one f32 scale per group
 * (MOE_DTYPE_I4).
 *
 * int8 (MOE_DTYPE_I8).
 *
 * A row w[0..n) becomes scale = max|w| / 127 and q[k] = round(w[k] / scale)
 * clamped to [-127, 127], so w[k] ~= q[k] * scale with an error of at most
 * scale / 2. An all-zero row gets scale 0 (and q 0). -128 is never used, so
 * the code is symmetric and the kernels need no offset.
 *
 * An I8 weight (n_rows, n_cols) lives in one buffer, so it is allocated,
 * moved and freed like any other weight: the n_rows * n_cols int8 values,
 * padded to 64 bytes, then the n_rows f32 scales. */
#ifndef MOE_QUANT_H
#define MOE_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Byte offset of the scales inside an I8 weight buffer. */
static inline size_t moe_i8_scale_offset(int64_t n_rows, int64_t n_cols)
{
    size_t q_bytes = (size_t)n_rows * (size_t)n_cols;
    return (q_bytes + 63) / 64 * 64;
}

/* Total bytes of an I8 weight buffer: values, padding, scales. */
static inline size_t moe_i8_weight_bytes(int64_t n_rows, int64_t n_cols)
{
    return moe_i8_scale_offset(n_rows, n_cols) + (size_t)n_rows * sizeof(float);
}

/* Quantizes n_rows rows of n_cols floats (w row-major, dense) into q (same
 * shape) and scale (n_rows). Returns false, writing nothing useful, when a
 * value is not finite (a NaN or Inf weight has no int8 image). */
bool moe_quant_i8_rows(const float *w, int64_t n_rows, int64_t n_cols, int8_t *q, float *scale);

/* w[r][k] = q[r][k] * scale[r]: the weights the int8 kernels compute with. */
void moe_dequant_i8_rows(const int8_t *q, const float *scale, int64_t n_rows, int64_t n_cols,
                         float *w);

/* 4-bit (MOE_DTYPE_I4), group size G in {32, 64, 128}; n_cols a multiple
 * of 32 (the block), not necessarily of G: a row's last group may be shorter
 * (n_cols % G columns), and a row has moe_q4_groups(n_cols, G) scales.
 * Each group g of a row gets d = m / -8, m its element of largest magnitude
 * (sign kept), and u[k] = clamp(round(w[k] / d) + 8, 0, 15): the extreme
 * lands exactly on a code and all 16 codes are used; w[k] ~= (u[k] - 8) d
 * with an error of at most |d| / 2 (|d| at the clamped +8 end). An all-zero
 * group gets d = 0.
 *
 * Layout of one weight buffer: the codes, row-major, n_cols / 2 bytes per
 * row, in blocks of 32 columns: byte j of a block (j < 16) holds column j in
 * its low nibble and column j + 16 in its high nibble, so 16 loaded bytes
 * widen to two runs of 16 consecutive columns with one mask and one shift;
 * then padding to 64 bytes; then the scales, f32, (n_rows, n_cols / G)
 * row-major. */
#define MOE_Q4_BLOCK 32

static inline bool moe_q4_group_valid(int group)
{
    return group == 32 || group == 64 || group == 128;
}

/* Scales per row: one per group, the last possibly shorter. */
static inline int64_t moe_q4_groups(int64_t n_cols, int group)
{
    return (n_cols + group - 1) / group;
}

/* Byte offset of the scales inside an I4 weight buffer. */
static inline size_t moe_q4_scale_offset(int64_t n_rows, int64_t n_cols)
{
    size_t q_bytes = (size_t)n_rows * (size_t)n_cols / 2;
    return (q_bytes + 63) / 64 * 64;
}

/* Total bytes of an I4 weight buffer: codes, padding, scales. */
static inline size_t moe_q4_weight_bytes(int64_t n_rows, int64_t n_cols, int group)
{
    return moe_q4_scale_offset(n_rows, n_cols) +
           (size_t)n_rows * (size_t)moe_q4_groups(n_cols, group) * sizeof(float);
}

/* The code of column k of a row of codes (see the layout above). */
static inline int moe_q4_code(const uint8_t *row, int64_t k)
{
    uint8_t b = row[(k / MOE_Q4_BLOCK) * (MOE_Q4_BLOCK / 2) + k % (MOE_Q4_BLOCK / 2)];
    return k % MOE_Q4_BLOCK < MOE_Q4_BLOCK / 2 ? b & 0x0f : b >> 4;
}

/* Quantizes n_rows rows of n_cols floats (dense) into codes q (n_rows *
 * n_cols / 2 bytes) and scale (n_rows, moe_q4_groups(n_cols, group)).
 * Returns false when a value is not finite. n_cols % 32 == 0 and
 * moe_q4_group_valid(group) are the caller's to check. */
bool moe_quant_q4_rows(const float *w, int64_t n_rows, int64_t n_cols, int group, uint8_t *q,
                       float *scale);

/* w[r][k] = (code - 8) * scale[r][k / group]: what the int4 kernels compute with. */
void moe_dequant_q4_rows(const uint8_t *q, const float *scale, int64_t n_rows, int64_t n_cols,
                         int group, float *w);

#endif
