/* Element types of tensors, and the scalar conversions between them. */
#ifndef MOE_DTYPE_H
#define MOE_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum moe_dtype {
    MOE_DTYPE_F32 = 0,
    MOE_DTYPE_F16,
    MOE_DTYPE_BF16,
    /* Symmetric int8 weights with one f32 scale per output row (W8A16):
     * w ~= q * scale[row]. Made at load from f32/bf16 checkpoints (common/quant.h);
     * never read from or written to a file. */
    MOE_DTYPE_I8,
    /* Symmetric 4-bit weights in groups of G (32, 64 or 128) along each row,
     * one f32 scale per group (W4A16): w ~= (u - 8) * scale[row][k / G],
     * u in [0, 15], two per byte (common/quant.h has the layout). Made at
     * load like I8; its elements are half a byte, so moe_dtype_size is 0 and
     * code addresses it through the moe_q4_* helpers. */
    MOE_DTYPE_I4,
};

/* Bytes per element (I8: the int8 values alone, not the row scales; I4: 0,
 * see above). */
static inline size_t moe_dtype_size(enum moe_dtype t)
{
    switch (t) {
    case MOE_DTYPE_F32: return 4;
    case MOE_DTYPE_F16:
    case MOE_DTYPE_BF16: return 2;
    case MOE_DTYPE_I8: return 1;
    case MOE_DTYPE_I4: return 0;
    }
    return 0;
}

/* "F32", "F16", "BF16", "I8" (the spellings safetensors uses), "I4". */
static inline const char *moe_dtype_name(enum moe_dtype t)
{
    switch (t) {
    case MOE_DTYPE_F32: return "F32";
    case MOE_DTYPE_F16: return "F16";
    case MOE_DTYPE_BF16: return "BF16";
    case MOE_DTYPE_I8: return "I8";
    case MOE_DTYPE_I4: return "I4";
    }
    return "?";
}

static inline float moe_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch does; NaN stays NaN. */
static inline uint16_t moe_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* IEEE half to float, subnormals included. */
static inline float moe_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) {
                man <<= 1;
                exp--;
            }
            man &= 0x3ffu;
            u = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif
