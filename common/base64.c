#include "base64.h"

static const char b64_alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t moe_base64_encoded_len(size_t n)
{
    return (n + 2) / 3 * 4;
}

size_t moe_base64_decoded_max(size_t len)
{
    return len / 4 * 3 + 3;
}

void moe_base64_encode(const void *src, size_t n, char *dst)
{
    const unsigned char *s = src;
    size_t i = 0;
    char *d = dst;
    for (; i + 3 <= n; i += 3) {
        unsigned v = (unsigned)s[i] << 16 | (unsigned)s[i + 1] << 8 | s[i + 2];
        *d++ = b64_alphabet[v >> 18 & 63];
        *d++ = b64_alphabet[v >> 12 & 63];
        *d++ = b64_alphabet[v >> 6 & 63];
        *d++ = b64_alphabet[v & 63];
    }
    if (i < n) {
        unsigned v = (unsigned)s[i] << 16;
        if (i + 1 < n)
            v |= (unsigned)s[i + 1] << 8;
        *d++ = b64_alphabet[v >> 18 & 63];
        *d++ = b64_alphabet[v >> 12 & 63];
        *d++ = i + 1 < n ? b64_alphabet[v >> 6 & 63] : '=';
        *d++ = '=';
    }
    *d = '\0';
}

/* 0..63 for an alphabet character, -1 otherwise. */
static int b64_value(unsigned char c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == '+')
        return 62;
    if (c == '/')
        return 63;
    return -1;
}

enum moe_status moe_base64_decode(const char *src, size_t len, unsigned char *dst, size_t *out_len,
                                  struct moe_error *err)
{
    if (len % 4 != 0)
        return moe_error_set(err, MOE_ERR_FORMAT, "base64: length %zu is not a multiple of 4", len);
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        int v[4];
        int n_pad = 0;
        for (int j = 0; j < 4; j++) {
            unsigned char c = (unsigned char)src[i + j];
            if (c == '=' && i + 4 == len && j >= 2) {
                v[j] = 0;
                n_pad++;
                continue;
            }
            v[j] = b64_value(c);
            if (v[j] < 0 || n_pad)
                return moe_error_set(err, MOE_ERR_FORMAT,
                                     "base64: invalid character 0x%02x at offset %zu", c, i + j);
        }
        unsigned w =
            (unsigned)v[0] << 18 | (unsigned)v[1] << 12 | (unsigned)v[2] << 6 | (unsigned)v[3];
        dst[o++] = (unsigned char)(w >> 16);
        if (n_pad < 2)
            dst[o++] = (unsigned char)(w >> 8);
        if (n_pad < 1)
            dst[o++] = (unsigned char)w;
    }
    *out_len = o;
    return MOE_OK;
}
