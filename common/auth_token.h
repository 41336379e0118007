/* Bearer tokens: the server side (a file of accepted tokens, checked in
 * constant time, re-read on SIGHUP) and the client side (the token a CLI
 * sends, read from a file).
 *
 * A token file holds one token per line (surrounding spaces and a trailing
 * CR stripped, blank lines and lines starting with '#' skipped); every token
 * in it is accepted, so a token is rotated by adding the new one, reloading,
 * moving the clients, removing the old one and reloading again. A token is
 * 16 to 4096 visible ASCII characters (0x21..0x7e: what an HTTP header and
 * gRPC metadata carry unchanged).
 *
 * Comparison: the presented token and every accepted one are hashed with
 * SHA-256 and all digests are compared with CRYPTO_memcmp, every one of them
 * whatever matched: the time taken depends on neither where a guess differs
 * nor which token matched. */
#ifndef MOE_AUTH_TOKEN_H
#define MOE_AUTH_TOKEN_H

#include <stdbool.h>
#include <stddef.h>

#include "moe_error.h"

#define MOE_TOKEN_MIN 16
#define MOE_TOKEN_MAX 4096

struct moe_tokens;

/* Reads the token file at `path`; `flag` ("--api-token-file") names it in
 * errors. No token in it, or a token that is too short, too long or has a
 * character outside 0x21..0x7e, is MOE_ERR_INVALID naming the file and the
 * line. On success *out is the caller's (moe_tokens_destroy). */
enum moe_status moe_tokens_load(const char *flag, const char *path, struct moe_tokens **out,
                                struct moe_error *err);

/* Reads the file again; on failure the previous tokens stay accepted.
 * NULL is a no-op (MOE_OK). */
enum moe_status moe_tokens_reload(struct moe_tokens *t, struct moe_error *err);

/* NULL is a no-op. */
void moe_tokens_destroy(struct moe_tokens *t);

/* Number of accepted tokens. */
int moe_tokens_count(struct moe_tokens *t);

/* True if `value` (len bytes, not necessarily NUL-terminated) is
 * "Bearer <token>" ("Bearer" in any case, one or more spaces) with one of
 * the accepted tokens. Thread-safe. */
bool moe_tokens_check_bearer(struct moe_tokens *t, const char *value, size_t len);

/* The client side: the first token in the file at `path` (checked as
 * above), malloc'd into *out (the caller frees it). */
enum moe_status moe_token_read(const char *flag, const char *path, char **out,
                               struct moe_error *err);

#endif
