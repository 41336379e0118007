/* Symmetric int8 weights with one f32 scale per row (MOE_DTYPE_I8).
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

#endif
