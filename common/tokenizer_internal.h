/* Private to the tokenizer (common/tokenizer*.c): the vocabulary, the BPE
 * model and the small hash maps behind them. Not a public interface. */
#ifndef MOE_TOKENIZER_INTERNAL_H
#define MOE_TOKENIZER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <pcre2.h>
#include <uninorm.h>

#include "moe_error.h"

/* Growable int32 array. */
struct tok_ids {
    int32_t *v;
    size_t n, cap;
};

bool tok_ids_push(struct tok_ids *a, int32_t x);

/* Open-addressing map from a token string to its id. The strings themselves
 * live in the vocabulary's id -> string table (`strs`/`lens`), the map only
 * holds ids. */
struct tok_str_map {
    int32_t *slot; /* (cap,) id or -1 */
    size_t cap;    /* power of two */
    size_t n;
};

/* Map from a pair of ids to (merge rank, merged id). */
struct tok_pair_map {
    uint64_t *key; /* (cap,) (a << 32 | b) + 1, 0 = empty */
    int32_t *rank; /* (cap,) */
    int32_t *id;   /* (cap,) */
    size_t cap, n;
};

/* A BPE model: vocabulary (token string <-> id) and merges. */
struct tok_bpe {
    char **strs;      /* (n_ids,) token string by id, NULL where no token */
    uint32_t *lens;   /* (n_ids,) byte length */
    int32_t n_ids;    /* one past the largest id */
    uint32_t max_len; /* the longest token string in bytes: a word of n bytes has at
                         least n / max_len tokens (without fuse_unk) */
    struct tok_str_map map;
    struct tok_pair_map merges;
    int32_t unk_id;        /* -1 when none */
    int32_t byte_ids[256]; /* ids of "<0xNN>" for byte fallback, -1 when absent */
    bool byte_fallback;
    bool fuse_unk;
    bool ignore_merges;
};

/* Fills `bpe` from the "model" object of tokenizer.json. `path` names the file
 * in messages. On error everything allocated is released. */
enum moe_status tok_bpe_load(struct tok_bpe *bpe, const cJSON *model, const char *path,
                             struct moe_error *err);

void tok_bpe_release(struct tok_bpe *bpe);

/* Id of the token string s[0..len), or -1. */
int32_t tok_bpe_lookup(const struct tok_bpe *bpe, const char *s, size_t len);

/* Scratch space reused across words of one encode call. */
struct tok_bpe_scratch {
    void *sym;  /* symbols */
    void *heap; /* merge candidates */
    size_t cap_sym, cap_heap;
};

void tok_bpe_scratch_release(struct tok_bpe_scratch *s);

/* Appends the ids of one pre-tokenized word (UTF-8, already mapped to the
 * vocabulary's alphabet) to `out`. Returns false on allocation failure. */
bool tok_bpe_encode_word(const struct tok_bpe *bpe, const char *w, size_t len,
                         struct tok_bpe_scratch *scratch, struct tok_ids *out);

/* Byte length of the UTF-8 sequence starting with byte `c` (1 for invalid). */
size_t tok_utf8_len(unsigned char c);

/* ---- the tokenizer ---- */

/* Growable byte string, NUL-terminated when p != NULL. */
struct sbuf {
    char *p;
    size_t n, cap;
};

enum norm_kind { NORM_UNICODE, NORM_PREPEND, NORM_REPLACE };
struct norm {
    enum norm_kind kind;
    uninorm_t form; /* NORM_UNICODE */
    char *a, *b;    /* PREPEND: a; REPLACE: a -> b */
    size_t na, nb;
};

enum split_behavior { SPLIT_ISOLATED, SPLIT_REMOVED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT };
enum prepend_scheme { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER };
enum pre_kind { PRE_SPLIT, PRE_BYTE_LEVEL, PRE_METASPACE };
struct pre {
    enum pre_kind kind;
    pcre2_code *re;               /* SPLIT, BYTE_LEVEL with use_regex */
    enum split_behavior behavior; /* SPLIT */
    bool invert;                  /* SPLIT */
    bool add_prefix_space;        /* BYTE_LEVEL */
    char repl[8];                 /* METASPACE replacement, UTF-8 */
    size_t n_repl;
    enum prepend_scheme scheme; /* METASPACE */
    bool split;                 /* METASPACE */
};

enum dec_kind {
    DEC_BYTE_LEVEL,
    DEC_METASPACE,
    DEC_REPLACE,
    DEC_BYTE_FALLBACK,
    DEC_FUSE,
    DEC_STRIP
};
struct dec {
    enum dec_kind kind;
    char *a, *b; /* REPLACE a -> b; STRIP: a = the character */
    size_t na, nb;
    int start, stop; /* STRIP */
    char repl[8];    /* METASPACE */
    size_t n_repl;
    enum prepend_scheme scheme;
};

struct added {
    char *content; /* as written in the file */
    char *match;   /* what is matched: content, normalized when `normalized` */
    size_t len, n_match;
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
};

struct moe_tokenizer {
    struct tok_bpe bpe;
    struct norm *norms;
    size_t n_norms;
    struct pre *pres;
    size_t n_pres;
    struct dec *decs;
    size_t n_decs;
    bool has_decoder;
    struct added *added;
    size_t n_added;
    bool added_first[2][256]; /* first bytes of added tokens, by `normalized` */
    int32_t *tmpl;            /* (n_tmpl,) ids; -1 marks the sequence */
    size_t n_tmpl;
    bool has_tmpl;
    int32_t n_vocab;
    const char **id_str;       /* (n_vocab,) token text by id (added content wins), NULL = hole */
    uint32_t *id_len;          /* (n_vocab,) */
    bool *id_special;          /* (n_vocab,) */
    uint16_t uni_of_byte[256]; /* GPT-2 bytes_to_unicode */
    int16_t byte_of_uni[512];  /* reverse, -1 where none */
};

/* Appends n bytes to b (keeping it NUL-terminated). False on allocation
 * failure. */
bool tok_sbuf_put(struct sbuf *b, const void *d, size_t n);

/* Normalizes s[0..n) with the tokenizer's normalizers into *out (its
 * contents replaced); `tmp` is scratch. False on allocation failure. */
bool tok_normalize(const struct moe_tokenizer *tok, const char *s, size_t n, struct sbuf *out,
                   struct sbuf *tmp);

#endif
