/* Bearer tokens (see auth_token.h). Only SHA-256 digests of the accepted
 * tokens are kept in memory after a load. */
#include "auth_token.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include "read_file.h"

#define TOKEN_FILE_MAX (1u << 20)

struct moe_tokens {
    char flag[64];
    char path[4096];
    pthread_rwlock_t lock;
    uint8_t (*digests)[SHA256_DIGEST_LENGTH]; /* lock: (n) */
    int n;
};

/* Calls fn(token, len, line, user) for every token line of `text`; stops
 * and returns the first error. */
typedef enum moe_status (*token_fn)(const char *tok, size_t len, int line, void *user);

static enum moe_status each_token(const char *flag, const char *path, char *text, token_fn fn,
                                  void *user, struct moe_error *err)
{
    int line = 0, n = 0;
    for (char *p = text; *p;) {
        char *nl = strchr(p, '\n');
        char *end = nl ? nl : p + strlen(p);
        char *next = nl ? nl + 1 : end;
        line++;
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        while (end > p && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r'))
            end--;
        size_t len = (size_t)(end - p);
        if (len && *p != '#') {
            for (size_t i = 0; i < len; i++)
                if ((unsigned char)p[i] < 0x21 || (unsigned char)p[i] > 0x7e)
                    return moe_error_set(err, MOE_ERR_INVALID,
                                         "%s %s: line %d: a token holds only visible ASCII "
                                         "characters (byte 0x%02x at column %zu)",
                                         flag, path, line, (unsigned char)p[i], i + 1);
            if (len < MOE_TOKEN_MIN || len > MOE_TOKEN_MAX)
                return moe_error_set(err, MOE_ERR_INVALID,
                                     "%s %s: line %d: a token of %zu characters (%d to %d "
                                     "wanted)",
                                     flag, path, line, len, MOE_TOKEN_MIN, MOE_TOKEN_MAX);
            enum moe_status st = fn(p, len, line, user);
            if (st)
                return st;
            n++;
        }
        p = next;
    }
    if (n == 0)
        return moe_error_set(err, MOE_ERR_INVALID, "%s %s: no token in the file", flag, path);
    return MOE_OK;
}

static char *read_text(const char *flag, const char *path, struct moe_error *err)
{
    char *text;
    if (moe_read_text(path, TOKEN_FILE_MAX, &text, err))
        moe_error_prefix(err, "%s", flag);
    return text;
}

struct digest_list {
    uint8_t (*d)[SHA256_DIGEST_LENGTH];
    int n, cap;
};

static enum moe_status add_digest(const char *tok, size_t len, int line, void *user)
{
    (void)line;
    struct digest_list *l = user;
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 4;
        void *p = realloc(l->d, (size_t)cap * sizeof *l->d);
        if (!p)
            return MOE_ERR_NOMEM;
        l->d = p;
        l->cap = cap;
    }
    SHA256((const unsigned char *)tok, len, l->d[l->n++]);
    return MOE_OK;
}

static enum moe_status load_digests(struct moe_tokens *t, struct digest_list *l,
                                    struct moe_error *err)
{
    char *text = read_text(t->flag, t->path, err);
    if (!text)
        return err ? err->code : MOE_ERR_IO;
    enum moe_status st = each_token(t->flag, t->path, text, add_digest, l, err);
    if (st == MOE_ERR_NOMEM)
        moe_error_set(err, st, "%s %s: out of memory", t->flag, t->path);
    OPENSSL_cleanse(text, strlen(text));
    free(text);
    if (st) {
        free(l->d);
        l->d = NULL;
    }
    return st;
}

enum moe_status moe_tokens_load(const char *flag, const char *path, struct moe_tokens **out,
                                struct moe_error *err)
{
    *out = NULL;
    struct moe_tokens *t = calloc(1, sizeof *t);
    if (!t)
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", flag);
    snprintf(t->flag, sizeof t->flag, "%s", flag);
    snprintf(t->path, sizeof t->path, "%s", path);
    struct digest_list l = {0};
    enum moe_status st = load_digests(t, &l, err);
    if (st) {
        free(t);
        return st;
    }
    t->digests = l.d;
    t->n = l.n;
    pthread_rwlock_init(&t->lock, NULL);
    *out = t;
    return MOE_OK;
}

enum moe_status moe_tokens_reload(struct moe_tokens *t, struct moe_error *err)
{
    if (!t)
        return MOE_OK;
    struct digest_list l = {0};
    enum moe_status st = load_digests(t, &l, err);
    if (st)
        return moe_error_prefix(err, "token reload (the previous tokens stay accepted)");
    pthread_rwlock_wrlock(&t->lock);
    void *old = t->digests;
    t->digests = l.d;
    t->n = l.n;
    pthread_rwlock_unlock(&t->lock);
    free(old);
    return MOE_OK;
}

void moe_tokens_destroy(struct moe_tokens *t)
{
    if (!t)
        return;
    free(t->digests);
    pthread_rwlock_destroy(&t->lock);
    free(t);
}

int moe_tokens_count(struct moe_tokens *t)
{
    pthread_rwlock_rdlock(&t->lock);
    int n = t->n;
    pthread_rwlock_unlock(&t->lock);
    return n;
}

bool moe_tokens_check_bearer(struct moe_tokens *t, const char *value, size_t len)
{
    if (!value || len < 7 || strncasecmp(value, "bearer", 6) || value[6] != ' ')
        return false;
    size_t i = 6;
    while (i < len && value[i] == ' ')
        i++;
    const char *tok = value + i;
    size_t tl = len - i;
    while (tl && (tok[tl - 1] == ' ' || tok[tl - 1] == '\t'))
        tl--;
    if (tl == 0 || tl > MOE_TOKEN_MAX)
        return false;
    uint8_t d[SHA256_DIGEST_LENGTH];
    SHA256((const unsigned char *)tok, tl, d);
    int hit = 0;
    pthread_rwlock_rdlock(&t->lock);
    for (int k = 0; k < t->n; k++)
        hit |= CRYPTO_memcmp(d, t->digests[k], sizeof d) == 0;
    pthread_rwlock_unlock(&t->lock);
    return hit != 0;
}

struct first_token {
    char *tok;
};

static enum moe_status take_first(const char *tok, size_t len, int line, void *user)
{
    (void)line;
    struct first_token *f = user;
    if (!f->tok) {
        if (!(f->tok = malloc(len + 1)))
            return MOE_ERR_NOMEM;
        memcpy(f->tok, tok, len);
        f->tok[len] = '\0';
    }
    return MOE_OK;
}

enum moe_status moe_token_read(const char *flag, const char *path, char **out,
                               struct moe_error *err)
{
    *out = NULL;
    char *text = read_text(flag, path, err);
    if (!text)
        return err ? err->code : MOE_ERR_IO;
    struct first_token f = {0};
    enum moe_status st = each_token(flag, path, text, take_first, &f, err);
    if (st == MOE_ERR_NOMEM)
        moe_error_set(err, st, "%s %s: out of memory", flag, path);
    OPENSSL_cleanse(text, strlen(text));
    free(text);
    if (st) {
        free(f.tok);
        return st;
    }
    *out = f.tok;
    return MOE_OK;
}
