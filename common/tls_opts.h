/* TLS settings shared by every listener and every outgoing connection of a
 * process: one certificate, key and CA set, given once on the command line,
 * used by the gRPC ports (rpc_server.c, rpc_client.c), the HTTP ports
 * (http_server.c), the KV data plane (worker/disagg/kv_link.c) and nothing
 * else to configure.
 *
 *   --tls-cert FILE   PEM certificate chain this process presents: as a server
 *                     on each of its ports, and as its client certificate on
 *                     the connections it opens (mutual TLS)
 *   --tls-key FILE    its private key (PEM)
 *   --tls-ca FILE     PEM CA certificates: servers this process connects to
 *                     must present a certificate that chains to them; the
 *                     internal ports (a worker's gRPC port, every KV data
 *                     plane port) then also require and verify client
 *                     certificates against them (mutual TLS)
 *   --tls-dir DIR     DIR/tls.crt, DIR/tls.key and DIR/ca.crt, those that
 *                     exist (a Kubernetes TLS Secret mounted as a folder);
 *                     explicit --tls-cert/--tls-key/--tls-ca win
 *   --tls-server-name NAME  the name a server's certificate must carry,
 *                     instead of the host in the address dialled (for
 *                     workers known by pod IP: one name in the certificate)
 *
 * None of them: plaintext everywhere (the default, for the loopback quick
 * start).
 *
 * Reload. moe_tls_reload (the mains call it on SIGHUP) reads the files again
 * and checks them; new connections get the new material, open ones keep
 * theirs. A reload that fails (a missing file, a key that does not match the
 * certificate) keeps the previous material and says why. Every generation
 * stays allocated until moe_tls_destroy (a few KB per reload), so that a
 * pointer handed out by moe_tls_current is never left dangling.
 *
 * Threads: every function is thread-safe. */
#ifndef MOE_TLS_OPTS_H
#define MOE_TLS_OPTS_H

#include <stdbool.h>
#include <stdint.h>

#include "moe_error.h"

/* Paths as given on the command line (borrowed). */
struct moe_tls_opts {
    const char *cert_file;
    const char *key_file;
    const char *ca_file;
    const char *dir; /* --tls-dir */
    const char *server_name;
};

/* The help lines of the flags above, for usage() texts. */
#define MOE_TLS_USAGE                                                                              \
    "  --tls-cert FILE     PEM certificate this process presents (servers; client\n"               \
    "                      certificate for mutual TLS); TLS is off without it\n"                   \
    "  --tls-key FILE      its PEM private key\n"                                                  \
    "  --tls-ca FILE       PEM CAs that peers' certificates must chain to (internal\n"             \
    "                      ports then require client certificates: mutual TLS)\n"                  \
    "  --tls-dir DIR       DIR/tls.crt, DIR/tls.key, DIR/ca.crt (those present)\n"                 \
    "  --tls-server-name N name servers' certificates must carry (default: the host\n"             \
    "                      dialled); certificates and keys are re-read on SIGHUP\n"

/* Takes flag `k` with value `v` into *o when it is one of the flags above:
 * returns true if it was. */
bool moe_tls_cli_flag(struct moe_tls_opts *o, const char *k, const char *v);

/* True when any TLS flag was given. */
bool moe_tls_opts_any(const struct moe_tls_opts *o);

/* One generation of loaded material: NUL-terminated PEM text; cert_pem and
 * key_pem are both NULL or both set, ca_pem may be NULL. */
struct moe_tls_material {
    const char *cert_pem;
    const char *key_pem;
    const char *ca_pem;
    uint64_t generation; /* 1 for the first load, +1 per successful reload */
    char serial[80];     /* the certificate's serial number in hex ("" without one) */
    char subject[256];   /* and its subject, for log lines */
};

struct moe_tls;

/* Reads and checks the files named by `o` (the certificate parses, the key
 * matches it, the CA file holds at least one certificate, and the
 * certificate chains to the CA when both are given). No TLS flag: *out =
 * NULL and MOE_OK (TLS off). A certificate without a key or a key without a
 * certificate is MOE_ERR_INVALID. Errors name the flag and the file. On
 * success *out is the caller's (moe_tls_destroy). */
enum moe_status moe_tls_create(const struct moe_tls_opts *o, struct moe_tls **out,
                               struct moe_error *err);

/* Frees every generation. NULL is a no-op. Only once nothing uses it. */
void moe_tls_destroy(struct moe_tls *t);

/* Reads the files again (see above). NULL is a no-op (MOE_OK). */
enum moe_status moe_tls_reload(struct moe_tls *t, struct moe_error *err);

/* The newest material; valid until moe_tls_destroy. */
const struct moe_tls_material *moe_tls_current(struct moe_tls *t);

/* True when this process has a certificate and key (it can serve). */
bool moe_tls_has_identity(struct moe_tls *t);

/* True when a CA file was given (peers are verified against it; internal
 * servers require client certificates). */
bool moe_tls_has_ca(struct moe_tls *t);

/* --tls-server-name, or NULL. */
const char *moe_tls_server_name(const struct moe_tls *t);

/* An OpenSSL context (SSL_CTX *) for the newest material, for code that
 * speaks TLS over its own sockets (the KV data plane). A server context
 * needs an identity; with a CA it requires and verifies client
 * certificates. A client context verifies the server against the CA (or the
 * system's roots without one) and presents the identity when there is one.
 * Made once per generation and kept until moe_tls_destroy: the caller must
 * not free it. NULL and err on failure. */
void *moe_tls_ssl_ctx(struct moe_tls *t, bool server, struct moe_error *err);

#endif
