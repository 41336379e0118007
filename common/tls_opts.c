/* TLS settings and their reloadable material (see tls_opts.h). The files are
 * checked with OpenSSL; every generation is kept on a list until destroy. */
#include "tls_opts.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

#include "read_file.h"

#define TLS_MAX_FILE (1u << 20) /* a PEM file larger than 1 MiB is not a certificate */

struct tls_gen {
    struct moe_tls_material m;
    char *cert, *key, *ca; /* the PEM text m points into */
    SSL_CTX *ctx[2];       /* [server]: made on first use */
    struct tls_gen *prev;
};

struct moe_tls {
    char cert_file[4096], key_file[4096], ca_file[4096];
    char server_name[256];
    pthread_mutex_t mu;
    struct tls_gen *cur; /* mu; older generations hang off ->prev */
};

bool moe_tls_cli_flag(struct moe_tls_opts *o, const char *k, const char *v)
{
    if (!strcmp(k, "--tls-cert"))
        o->cert_file = v;
    else if (!strcmp(k, "--tls-key"))
        o->key_file = v;
    else if (!strcmp(k, "--tls-ca"))
        o->ca_file = v;
    else if (!strcmp(k, "--tls-dir"))
        o->dir = v;
    else if (!strcmp(k, "--tls-server-name"))
        o->server_name = v;
    else
        return false;
    return true;
}

bool moe_tls_opts_any(const struct moe_tls_opts *o)
{
    return o && (o->cert_file || o->key_file || o->ca_file || o->dir || o->server_name);
}

/* The first OpenSSL error as text (and the queue cleared). */
static const char *ssl_error(char *buf, size_t cap)
{
    unsigned long e = ERR_get_error();
    if (!e)
        snprintf(buf, cap, "no detail");
    else
        ERR_error_string_n(e, buf, cap);
    ERR_clear_error();
    return buf;
}

/* A whole (small, non-empty) PEM file, NUL-terminated. */
static char *read_file(const char *flag, const char *path, struct moe_error *err)
{
    char *text;
    moe_read_text(path, TLS_MAX_FILE, &text, err);
    if (text && !text[0]) {
        moe_error_set(err, MOE_ERR_FORMAT, "%s: empty file", path);
        free(text);
        text = NULL;
    }
    if (!text)
        moe_error_prefix(err, "%s", flag);
    return text;
}

/* Every certificate of a PEM text (at least one). */
static STACK_OF(X509) *
    pem_certs(const char *pem, const char *flag, const char *path, struct moe_error *err)
{
    STACK_OF(X509) *sk = sk_X509_new_null();
    BIO *b = BIO_new_mem_buf(pem, -1);
    X509 *x;
    while (sk && b && (x = PEM_read_bio_X509(b, NULL, NULL, NULL)))
        if (!sk_X509_push(sk, x))
            X509_free(x);
    ERR_clear_error(); /* the end of the text reads as an error */
    BIO_free(b);
    if (!sk || sk_X509_num(sk) == 0) {
        sk_X509_pop_free(sk, X509_free);
        moe_error_set(err, MOE_ERR_FORMAT, "%s %s: no PEM certificate in it", flag, path);
        return NULL;
    }
    return sk;
}

static EVP_PKEY *pem_key(const char *pem, const char *path, struct moe_error *err)
{
    BIO *b = BIO_new_mem_buf(pem, -1);
    EVP_PKEY *k = b ? PEM_read_bio_PrivateKey(b, NULL, NULL, NULL) : NULL;
    BIO_free(b);
    if (!k) {
        char e[256];
        moe_error_set(err, MOE_ERR_FORMAT, "--tls-key %s: not a PEM private key (%s)", path,
                      ssl_error(e, sizeof e));
    }
    return k;
}

static void gen_free(struct tls_gen *g)
{
    if (!g)
        return;
    SSL_CTX_free(g->ctx[0]);
    SSL_CTX_free(g->ctx[1]);
    free(g->cert);
    free(g->key);
    free(g->ca);
    free(g);
}

/* Reads and checks the files into a new generation. */
static struct tls_gen *gen_load(const struct moe_tls *t, uint64_t generation, struct moe_error *err)
{
    struct tls_gen *g = calloc(1, sizeof *g);
    STACK_OF(X509) *chain = NULL, *cas = NULL;
    EVP_PKEY *key = NULL;
    X509_STORE *store = NULL;
    X509_STORE_CTX *vctx = NULL;
    if (!g) {
        moe_error_set(err, MOE_ERR_NOMEM, "TLS: out of memory");
        return NULL;
    }
    if (t->cert_file[0]) {
        if (!(g->cert = read_file("--tls-cert", t->cert_file, err)) ||
            !(g->key = read_file("--tls-key", t->key_file, err)) ||
            !(chain = pem_certs(g->cert, "--tls-cert", t->cert_file, err)) ||
            !(key = pem_key(g->key, t->key_file, err)))
            goto fail;
        X509 *leaf = sk_X509_value(chain, 0);
        if (X509_check_private_key(leaf, key) != 1) {
            ERR_clear_error();
            moe_error_set(err, MOE_ERR_INVALID,
                          "--tls-key %s: does not belong to the certificate in --tls-cert %s",
                          t->key_file, t->cert_file);
            goto fail;
        }
        BIGNUM *bn = ASN1_INTEGER_to_BN(X509_get_serialNumber(leaf), NULL);
        char *hex = bn ? BN_bn2hex(bn) : NULL;
        snprintf(g->m.serial, sizeof g->m.serial, "%s", hex ? hex : "");
        OPENSSL_free(hex);
        BN_free(bn);
        X509_NAME_oneline(X509_get_subject_name(leaf), g->m.subject, sizeof g->m.subject);
    }
    if (t->ca_file[0]) {
        if (!(g->ca = read_file("--tls-ca", t->ca_file, err)) ||
            !(cas = pem_certs(g->ca, "--tls-ca", t->ca_file, err)))
            goto fail;
        if (chain) { /* our own certificate must be one the peers accept */
            store = X509_STORE_new();
            vctx = X509_STORE_CTX_new();
            for (int i = 0; store && i < sk_X509_num(cas); i++)
                X509_STORE_add_cert(store, sk_X509_value(cas, i));
            if (!store || !vctx ||
                !X509_STORE_CTX_init(vctx, store, sk_X509_value(chain, 0), chain)) {
                moe_error_set(err, MOE_ERR_NOMEM, "TLS: out of memory");
                goto fail;
            }
            if (X509_verify_cert(vctx) != 1) {
                moe_error_set(err, MOE_ERR_INVALID,
                              "--tls-cert %s: does not chain to a CA in --tls-ca %s (%s)",
                              t->cert_file, t->ca_file,
                              X509_verify_cert_error_string(X509_STORE_CTX_get_error(vctx)));
                goto fail;
            }
        }
    }
    g->m.cert_pem = g->cert;
    g->m.key_pem = g->key;
    g->m.ca_pem = g->ca;
    g->m.generation = generation;
    sk_X509_pop_free(chain, X509_free);
    sk_X509_pop_free(cas, X509_free);
    EVP_PKEY_free(key);
    X509_STORE_CTX_free(vctx);
    X509_STORE_free(store);
    return g;
fail:
    sk_X509_pop_free(chain, X509_free);
    sk_X509_pop_free(cas, X509_free);
    EVP_PKEY_free(key);
    X509_STORE_CTX_free(vctx);
    X509_STORE_free(store);
    gen_free(g);
    return NULL;
}

/* DIR/NAME into buf when it exists. */
static void dir_file(char *buf, size_t cap, const char *dir, const char *name)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    if (access(p, F_OK) == 0)
        snprintf(buf, cap, "%s", p);
}

enum moe_status moe_tls_create(const struct moe_tls_opts *o, struct moe_tls **out,
                               struct moe_error *err)
{
    *out = NULL;
    if (!moe_tls_opts_any(o))
        return MOE_OK;
    struct moe_tls *t = calloc(1, sizeof *t);
    if (!t)
        return moe_error_set(err, MOE_ERR_NOMEM, "TLS: out of memory");
    if (o->dir) {
        if (access(o->dir, F_OK) != 0) {
            moe_error_set(err, MOE_ERR_IO, "--tls-dir %s: %s", o->dir, strerror(errno));
            free(t);
            return MOE_ERR_IO;
        }
        dir_file(t->cert_file, sizeof t->cert_file, o->dir, "tls.crt");
        dir_file(t->key_file, sizeof t->key_file, o->dir, "tls.key");
        dir_file(t->ca_file, sizeof t->ca_file, o->dir, "ca.crt");
    }
    if (o->cert_file)
        snprintf(t->cert_file, sizeof t->cert_file, "%s", o->cert_file);
    if (o->key_file)
        snprintf(t->key_file, sizeof t->key_file, "%s", o->key_file);
    if (o->ca_file)
        snprintf(t->ca_file, sizeof t->ca_file, "%s", o->ca_file);
    if (o->server_name)
        snprintf(t->server_name, sizeof t->server_name, "%s", o->server_name);
    enum moe_status st = MOE_OK;
    if (!t->cert_file[0] != !t->key_file[0])
        st = moe_error_set(err, MOE_ERR_INVALID, "%s",
                           t->cert_file[0] ? "--tls-cert needs --tls-key (its private key)"
                                           : "--tls-key needs --tls-cert (its certificate)");
    else if (!t->cert_file[0] && !t->ca_file[0])
        st = moe_error_set(err, MOE_ERR_INVALID,
                           "TLS: neither a certificate (--tls-cert/--tls-key) nor a CA "
                           "(--tls-ca) given%s%s",
                           o->dir ? " and nothing in --tls-dir " : "", o->dir ? o->dir : "");
    if (st) {
        free(t);
        return st;
    }
    pthread_mutex_init(&t->mu, NULL);
    if (!(t->cur = gen_load(t, 1, err))) {
        pthread_mutex_destroy(&t->mu);
        free(t);
        return err ? err->code : MOE_ERR_INVALID;
    }
    *out = t;
    return MOE_OK;
}

void moe_tls_destroy(struct moe_tls *t)
{
    if (!t)
        return;
    for (struct tls_gen *g = t->cur; g;) {
        struct tls_gen *prev = g->prev;
        gen_free(g);
        g = prev;
    }
    pthread_mutex_destroy(&t->mu);
    free(t);
}

enum moe_status moe_tls_reload(struct moe_tls *t, struct moe_error *err)
{
    if (!t)
        return MOE_OK;
    pthread_mutex_lock(&t->mu);
    uint64_t next = t->cur->m.generation + 1;
    pthread_mutex_unlock(&t->mu);
    struct tls_gen *g = gen_load(t, next, err);
    if (!g)
        return moe_error_prefix(err, "TLS reload (the previous certificate stays in use)");
    pthread_mutex_lock(&t->mu);
    g->prev = t->cur;
    t->cur = g;
    pthread_mutex_unlock(&t->mu);
    return MOE_OK;
}

const struct moe_tls_material *moe_tls_current(struct moe_tls *t)
{
    pthread_mutex_lock(&t->mu);
    const struct moe_tls_material *m = &t->cur->m;
    pthread_mutex_unlock(&t->mu);
    return m;
}

bool moe_tls_has_identity(struct moe_tls *t)
{
    return t && t->cert_file[0];
}

bool moe_tls_has_ca(struct moe_tls *t)
{
    return t && t->ca_file[0];
}

const char *moe_tls_server_name(const struct moe_tls *t)
{
    return t && t->server_name[0] ? t->server_name : NULL;
}

/* A context for generation g (made without the lock). */
static SSL_CTX *ctx_make(const struct tls_gen *g, bool server, struct moe_error *err)
{
    char e[256];
    SSL_CTX *ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    STACK_OF(X509) *chain = NULL, *cas = NULL;
    EVP_PKEY *key = NULL;
    if (!ctx) {
        moe_error_set(err, MOE_ERR_NOMEM, "TLS: SSL_CTX_new: %s", ssl_error(e, sizeof e));
        return NULL;
    }
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    if (server && !g->cert) {
        moe_error_set(err, MOE_ERR_INVALID,
                      "TLS: a server needs a certificate and key (--tls-cert, --tls-key)");
        goto fail;
    }
    if (g->cert) {
        struct moe_error ignored = {0};
        if (!(chain = pem_certs(g->cert, "--tls-cert", "", &ignored)) ||
            !(key = pem_key(g->key, "", &ignored)) ||
            SSL_CTX_use_certificate(ctx, sk_X509_value(chain, 0)) != 1 ||
            SSL_CTX_use_PrivateKey(ctx, key) != 1) {
            moe_error_set(err, MOE_ERR_INVALID, "TLS: cannot use the certificate: %s",
                          ssl_error(e, sizeof e));
            goto fail;
        }
        for (int i = 1; i < sk_X509_num(chain); i++)
            SSL_CTX_add1_chain_cert(ctx, sk_X509_value(chain, i));
    }
    if (g->ca) {
        struct moe_error ignored = {0};
        X509_STORE *store = SSL_CTX_get_cert_store(ctx);
        if (!(cas = pem_certs(g->ca, "--tls-ca", "", &ignored))) {
            moe_error_set(err, MOE_ERR_INVALID, "TLS: cannot read the CA certificates");
            goto fail;
        }
        for (int i = 0; i < sk_X509_num(cas); i++)
            X509_STORE_add_cert(store, sk_X509_value(cas, i));
        SSL_CTX_set_verify(
            ctx, server ? SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT : SSL_VERIFY_PEER,
            NULL);
    } else if (!server) {
        SSL_CTX_set_default_verify_paths(ctx);
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    }
    sk_X509_pop_free(chain, X509_free);
    sk_X509_pop_free(cas, X509_free);
    EVP_PKEY_free(key);
    return ctx;
fail:
    sk_X509_pop_free(chain, X509_free);
    sk_X509_pop_free(cas, X509_free);
    EVP_PKEY_free(key);
    SSL_CTX_free(ctx);
    return NULL;
}

void *moe_tls_ssl_ctx(struct moe_tls *t, bool server, struct moe_error *err)
{
    pthread_mutex_lock(&t->mu);
    struct tls_gen *g = t->cur;
    SSL_CTX *ctx = g->ctx[server];
    pthread_mutex_unlock(&t->mu);
    if (ctx)
        return ctx;
    SSL_CTX *made = ctx_make(g, server, err);
    if (!made)
        return NULL;
    pthread_mutex_lock(&t->mu);
    if (!g->ctx[server]) /* another thread may have made one meanwhile */
        g->ctx[server] = made, made = NULL;
    ctx = g->ctx[server];
    pthread_mutex_unlock(&t->mu);
    SSL_CTX_free(made);
    return ctx;
}
