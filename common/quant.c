/* Row-wise symmetric int8 quantization (see quant.h). */
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
