/* Row-wise symmetric int8 and group-wise 4-bit quantization (see quant.h). */
#include "quant.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* roundf(x) as an integer, for |x| < 2^31, inline (a libm call per weight
 * kept the loops below scalar): the truncation t and x - t are exact, and
 * x - t decides the halves, away from zero. */
static inline int32_t round_half_away(float x)
{
    const int32_t t = (int32_t)x;
    const float f = x - (float)t;
    return t + (int32_t)(f >= 0.5f) - (int32_t)(f <= -0.5f);
}

/* The bits of max |w| over n values, a loop the compiler vectorises: |w|'s
 * bits order as its values do, and an infinity or a NaN has them at
 * 0x7f800000 or above. */
static int32_t max_abs_bits(const float *w, int64_t n)
{
    int32_t m = 0;
    for (int64_t k = 0; k < n; k++) {
        int32_t b;
        memcpy(&b, w + k, sizeof b);
        b &= 0x7fffffff;
        m = b > m ? b : m;
    }
    return m;
}

/* One row's scale (max |w| / 127) and codes q = round(w / s) (halves away
 * from zero, as roundf) clamped to [-127, 127]; false for an infinite or NaN
 * weight. Branch-free integer passes the compiler vectorises: loading the
 * benchmark-shape model as int8 spent ~2.5 of its 4.7 s in the roundf calls
 * of the loop this replaced (perf, Emerald Rapids). */
static bool quant_row(const float *w, int64_t n, int8_t *q, float *scale)
{
    const int32_t amax_bits = max_abs_bits(w, n);
    if (amax_bits >= 0x7f800000)
        return false;
    float amax;
    memcpy(&amax, &amax_bits, sizeof amax);
    const float s = amax / 127.0f;
    *scale = s;
    if (s == 0.0f) {
        memset(q, 0, (size_t)n);
        return true;
    }
    for (int64_t k = 0; k < n; k++) {
        /* Dividing (not multiplying by 127 / amax) keeps |w - q s| <= s / 2
         * up to one rounding of the quotient. */
        int32_t t = round_half_away(w[k] / s);
        t = t > 127 ? 127 : t;
        t = t < -127 ? -127 : t;
        q[k] = (int8_t)t;
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
    /* the largest magnitude, then the first weight that has it (its sign
     * sets the scale's) */
    const int32_t amax_bits = max_abs_bits(w, n);
    if (amax_bits >= 0x7f800000)
        return false;
    float amax, m = 0.0f;
    memcpy(&amax, &amax_bits, sizeof amax);
    for (int k = 0; amax_bits && k < n; k++)
        if (fabsf(w[k]) == amax) {
            m = w[k];
            break;
        }
    const float d = m / -8.0f;
    *scale = d;
    if (d == 0.0f) {
        for (int k = 0; k < n; k++)
            u[k] = 8; /* code 0 */
        return true;
    }
    for (int k = 0; k < n; k++) {
        int32_t v = round_half_away(w[k] / d);
        v = v > 7 ? 7 : v < -8 ? -8 : v;
        u[k] = (uint8_t)(v + 8);
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
