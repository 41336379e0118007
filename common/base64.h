/* Standard base64 (RFC 4648, alphabet A-Z a-z 0-9 + /, '=' padding), as used
 * by etcd's JSON gateway for keys and values. */
#ifndef MOE_BASE64_H
#define MOE_BASE64_H

#include <stddef.h>

#include "moe_error.h"

/* Length of the encoding of `n` bytes, without the terminating NUL. */
size_t moe_base64_encoded_len(size_t n);

/* Upper bound of the decoded length of `len` base64 characters. */
size_t moe_base64_decoded_max(size_t len);

/* Encodes `n` bytes of `src` into `dst`, which must hold
 * moe_base64_encoded_len(n) + 1 bytes; `dst` is NUL-terminated. */
void moe_base64_encode(const void *src, size_t n, char *dst);

/* Decodes `len` characters of `src` (padding required, no whitespace) into
 * `dst`, which must hold moe_base64_decoded_max(len) bytes; stores the
 * decoded length in *out_len. Returns MOE_ERR_FORMAT naming the offending
 * offset on malformed input (dst contents are then unspecified). */
enum moe_status moe_base64_decode(const char *src, size_t len, unsigned char *dst, size_t *out_len,
                                  struct moe_error *err);

#endif
