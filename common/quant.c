/* Row-wise symmetric int8 and group-wise 4-bit quantization (see quant.h). */
#include "quant.h"

#include <math.h>

static bool quant_row(const float *w, int64_t n, int8_t *q, float *scale)
{
    float amax = 0.0f;
    for (int64_t k = 0; k < n; k++) {
        if (!isfinite(w[k]))
            return false;
        float a = fabsf(w[k]);
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.0f;
    *scale = s;
    for (int64_t k = 0; k < n; k++) {
        if (s == 0.0f) {
            q[k] = 0;
            continue;
        }
        /* Dividing (not multiplying by 127 / amax) keeps |w - q s| <= s / 2
         * up to one rounding of the quotient. */
        float v = roundf(w[k] / s);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[k] = (int8_t)v;
    }
    return true;
}

bool moe_quant_i8_rows(const float *w, int64_t n_rows, int64_t n_cols, int8_t *q, float *scale)
{
    for (int64_t r = 0; r < n_rows; r++)
        if (!quant_row(w + r * n_cols, n_cols, q + r * n_cols, scale + r))
            return false;
    return true;
}

void moe_dequant_i8_rows(const int8_t *q, const float *scale, int64_t n_rows, int64_t n_cols,
                         float *w)
{
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t k = 0; k < n_cols; k++)
            w[r * n_cols + k] = (float)q[r * n_cols + k] * scale[r];
}

/* One group of n values: its scale, and its codes into u (n). */
static bool quant_group_q4(const float *w, int n, uint8_t *u, float *scale)
{
    float m = 0.0f;
    for (int k = 0; k < n; k++) {
        if (!isfinite(w[k]))
            return false;
        m = fabsf(w[k]) > fabsf(m) ? w[k] : m;
    }
    float d = m / -8.0f;
    *scale = d;
    for (int k = 0; k < n; k++) {
        float v = d == 0.0f ? 0.0f : roundf(w[k] / d);
        v = v > 7.0f ? 7.0f : v < -8.0f ? -8.0f : v;
        u[k] = (uint8_t)((int)v + 8);
    }
    return true;
}

bool moe_quant_q4_rows(const float *w, int64_t n_rows, int64_t n_cols, int group, uint8_t *q,
                       float *scale)
{
    uint8_t u[128];
    const int64_t n_groups = moe_q4_groups(n_cols, group);
    for (int64_t r = 0; r < n_rows; r++) {
        uint8_t *row = q + r * (n_cols / 2);
        for (int64_t g = 0; g < n_groups; g++) {
            const int len = (int)(n_cols - g * group < group ? n_cols - g * group : group);
            if (!quant_group_q4(w + r * n_cols + g * group, len, u, scale + r * n_groups + g))
                return false;
            for (int b = 0; b < len; b += MOE_Q4_BLOCK) {
                uint8_t *dst = row + (g * group + b) / 2;
                for (int j = 0; j < MOE_Q4_BLOCK / 2; j++)
                    dst[j] = (uint8_t)(u[b + j] | u[b + j + MOE_Q4_BLOCK / 2] << 4);
            }
        }
    }
    return true;
}

void moe_dequant_q4_rows(const uint8_t *q, const float *scale, int64_t n_rows, int64_t n_cols,
                         int group, float *w)
{
    const int64_t n_groups = moe_q4_groups(n_cols, group);
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = q + r * (n_cols / 2);
        for (int64_t k = 0; k < n_cols; k++)
            w[r * n_cols + k] = (float)(moe_q4_code(row, k) - 8) * scale[r * n_groups + k / group];
    }
}
