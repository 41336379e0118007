/* Template text -> tokens, as jinja2's lexer does it with the options
 * transformers uses (trim_blocks=True, lstrip_blocks=True):
 *  - newlines (\r\n, \r, \n) become \n and one trailing newline is dropped
 *    (keep_trailing_newline=False);
 *  - {%- {{- {#- strip all whitespace before the tag; -%} -}} -#} all after;
 *  - lstrip_blocks: spaces and tabs between the start of a line and a {% or
 *    {# tag are removed (not before {{, not with {%+);
 *  - trim_blocks: the first newline after %} or #} is removed (not after
 *    +%}).
 * Inside a tag, the end marker is looked for before each token, so a
 * string may hold "%}" but "}}" closes a {{ tag wherever a token starts. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

struct lexer {
    const char *src;
    size_t n, pos;
    int line;
    const char *name;
    struct jarena *arena;
    struct jtoken *tok;
    size_t n_tok, cap_tok;
    struct moe_error *err;
    bool failed;
};

static void lerr(struct lexer *L, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void lerr(struct lexer *L, int line, const char *fmt, ...)
{
    if (L->failed)
        return;
    char msg[MOE_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    moe_error_set(L->err, MOE_ERR_FORMAT, "%s:%d: %s", L->name, line, msg);
    L->failed = true;
}

static struct jtoken *push(struct lexer *L, int type, int line)
{
    if (L->n_tok == L->cap_tok) {
        size_t cap = L->cap_tok ? 2 * L->cap_tok : 256;
        struct jtoken *nt = jarena_alloc(L->arena, cap * sizeof(*nt));
        if (!nt) {
            lerr(L, line, "out of memory");
            return NULL;
        }
        if (L->n_tok)
            memcpy(nt, L->tok, L->n_tok * sizeof(*nt));
        L->tok = nt;
        L->cap_tok = cap;
    }
    struct jtoken *t = &L->tok[L->n_tok++];
    memset(t, 0, sizeof(*t));
    t->type = type;
    t->line = line;
    return t;
}

static char *dupn(struct lexer *L, const char *p, size_t n)
{
    char *s = jarena_alloc(L->arena, n + 1);
    if (!s) {
        lerr(L, L->line, "out of memory");
        return NULL;
    }
    memcpy(s, p, n);
    s[n] = 0;
    return s;
}

static int count_nl(const char *p, size_t n)
{
    int k = 0;
    for (size_t i = 0; i < n; i++)
        k += p[i] == '\n';
    return k;
}

/* Length of the run of Python whitespace (regex \s) at p. */
static size_t ws_run(const char *p, size_t n)
{
    size_t i = 0;
    while (i < n) {
        size_t adv;
        uint32_t cp = ju8_dec(p + i, n - i, &adv);
        if (!jpy_isspace(cp))
            break;
        i += adv;
    }
    return i;
}

/* Length of text after Python's str.rstrip(). */
static size_t rstrip_len(const char *p, size_t n)
{
    size_t end = n;
    while (end > 0) {
        size_t start = end - 1;
        while (start > 0 && ((unsigned char)p[start] & 0xc0) == 0x80)
            start--;
        size_t adv;
        uint32_t cp = ju8_dec(p + start, end - start, &adv);
        if (!jpy_isspace(cp))
            break;
        end = start;
    }
    return end;
}

static bool emit_data(struct lexer *L, const char *p, size_t n, int line)
{
    if (n == 0)
        return true;
    struct jtoken *t = push(L, JT_DATA, line);
    if (!t)
        return false;
    t->str = dupn(L, p, n);
    t->len = n;
    return t->str != NULL;
}

/* Decodes a string literal body as Python's unicode-escape does. */
static bool lex_string(struct lexer *L, char q)
{
    int line = L->line;
    size_t i = L->pos + 1;
    size_t end = i;
    while (end < L->n && L->src[end] != q) {
        if (L->src[end] == '\\' && end + 1 < L->n)
            end++;
        end++;
    }
    if (end >= L->n) {
        lerr(L, line, "unterminated string");
        return false;
    }
    char *out = jarena_alloc(L->arena, end - i + 1);
    if (!out) {
        lerr(L, line, "out of memory");
        return false;
    }
    size_t o = 0;
    while (i < end) {
        char ch = L->src[i];
        if (ch != '\\') {
            out[o++] = ch;
            i++;
            continue;
        }
        char e = L->src[i + 1];
        i += 2;
        uint32_t cp;
        int nhex = 0;
        switch (e) {
        case '\n': continue;
        case '\\': out[o++] = '\\'; continue;
        case '\'': out[o++] = '\''; continue;
        case '"': out[o++] = '"'; continue;
        case 'a': out[o++] = '\a'; continue;
        case 'b': out[o++] = '\b'; continue;
        case 'f': out[o++] = '\f'; continue;
        case 'n': out[o++] = '\n'; continue;
        case 'r': out[o++] = '\r'; continue;
        case 't': out[o++] = '\t'; continue;
        case 'v': out[o++] = '\v'; continue;
        case 'x': nhex = 2; break;
        case 'u': nhex = 4; break;
        case 'U': nhex = 8; break;
        case 'N': lerr(L, line, "\\N{...} escapes are not supported"); return false;
        default:
            if (e >= '0' && e <= '7') {
                cp = (uint32_t)(e - '0');
                for (int k = 0; k < 2 && i < end && L->src[i] >= '0' && L->src[i] <= '7'; k++)
                    cp = cp * 8 + (uint32_t)(L->src[i++] - '0');
                char enc[4];
                size_t ne = ju8_enc(cp, enc);
                memcpy(out + o, enc, ne); /* \ooo is at most 4 bytes in, 2 out */
                o += ne;
                continue;
            }
            out[o++] = '\\'; /* unknown escapes stay as they are */
            out[o++] = e;
            continue;
        }
        cp = 0;
        for (int k = 0; k < nhex; k++) {
            char h = i < end ? L->src[i] : 0;
            int d = h >= '0' && h <= '9'   ? h - '0'
                    : h >= 'a' && h <= 'f' ? h - 'a' + 10
                    : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                           : -1;
            if (d < 0) {
                lerr(L, line, "truncated \\%c escape in a string", e);
                return false;
            }
            cp = cp * 16 + (uint32_t)d;
            i++;
        }
        if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
            lerr(L, line, "escape \\%c%0*x is not a valid character", e, nhex, cp);
            return false;
        }
        char enc[4];
        size_t ne = ju8_enc(cp, enc);
        memcpy(out + o, enc, ne); /* the escape text is longer than its encoding */
        o += ne;
    }
    out[o] = 0;
    struct jtoken *t = push(L, JT_STRING, line);
    if (!t)
        return false;
    t->str = out;
    t->len = o;
    L->line += count_nl(L->src + L->pos, end + 1 - L->pos);
    L->pos = end + 1;
    return true;
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

/* Digits with single underscores between them (Python literals). */
static size_t digit_run(const char *p, size_t n)
{
    size_t i = 0;
    if (i >= n || !is_digit(p[i]))
        return 0;
    while (i < n && (is_digit(p[i]) || (p[i] == '_' && i + 1 < n && is_digit(p[i + 1]))))
        i++;
    return i;
}

static bool lex_number(struct lexer *L)
{
    const char *p = L->src + L->pos;
    size_t n = L->n - L->pos;
    bool after_dot = L->pos > 0 && L->src[L->pos - 1] == '.';
    size_t k = digit_run(p, n);
    size_t flen = 0;
    if (!after_dot) { /* float: digits (.digits)? (e[+-]digits)? with one of them */
        size_t j = k;
        bool frac = false, expo = false;
        if (j + 1 < n && p[j] == '.' && is_digit(p[j + 1])) {
            j += 1 + digit_run(p + j + 1, n - j - 1);
            frac = true;
        }
        if (j < n && (p[j] == 'e' || p[j] == 'E')) {
            size_t m = j + 1;
            if (m < n && (p[m] == '+' || p[m] == '-'))
                m++;
            size_t d = digit_run(p + m, n - m);
            if (d) {
                j = m + d;
                expo = true;
            }
        }
        if (frac || expo)
            flen = j;
    }
    char buf[128];
    if (flen) {
        size_t o = 0;
        for (size_t i = 0; i < flen && o < sizeof(buf) - 1; i++)
            if (p[i] != '_')
                buf[o++] = p[i];
        buf[o] = 0;
        struct jtoken *t = push(L, JT_FLOAT, L->line);
        if (!t)
            return false;
        t->fval = strtod(buf, NULL);
        L->pos += flen;
        return true;
    }
    int base = 10;
    size_t start = 0, len = k;
    if (p[0] == '0' && n > 2 && strchr("xXoObB", p[1])) {
        base = (p[1] == 'x' || p[1] == 'X') ? 16 : (p[1] == 'o' || p[1] == 'O') ? 8 : 2;
        start = 2;
        len = 2;
        while (len < n &&
               (p[len] == '_' || (base == 16 && strchr("0123456789abcdefABCDEF", p[len])) ||
                (base == 8 && p[len] >= '0' && p[len] <= '7') ||
                (base == 2 && (p[len] == '0' || p[len] == '1'))))
            len++;
    }
    size_t o = 0;
    for (size_t i = start; i < len && o < sizeof(buf) - 1; i++)
        if (p[i] != '_')
            buf[o++] = p[i];
    buf[o] = 0;
    errno = 0;
    long long v = strtoll(buf, NULL, base);
    if (errno == ERANGE) {
        lerr(L, L->line, "integer literal %s does not fit in 64 bits", buf);
        return false;
    }
    struct jtoken *t = push(L, JT_INT, L->line);
    if (!t)
        return false;
    t->ival = v;
    L->pos += len;
    return true;
}

static const char *const ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                  "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                  "=",  ".",  ":",  "|",  ",",  ";",  ">", "<", NULL};

/* Tokens of one {% %} or {{ }} tag; returns false on error. On success
 * L->pos is past the end marker and *ends_nl says whether what it consumed
 * ended with a newline (jinja2's line_starting). */
static bool lex_tag(struct lexer *L, bool block, bool *ends_nl)
{
    int open_line = L->line;
    for (;;) {
        const char *p = L->src + L->pos;
        size_t n = L->n - L->pos;
        if (n == 0) {
            lerr(L, open_line, "unexpected end of template: %s tag opened here is not closed",
                 block ? "{%" : "{{");
            return false;
        }
        const char *close = block ? "%}" : "}}";
        bool strip_after = false, matched = false, keep = false;
        size_t mlen = 0;
        if (n >= 3 && p[0] == '-' && memcmp(p + 1, close, 2) == 0) {
            matched = strip_after = true;
            mlen = 3;
        } else if (block && n >= 3 && p[0] == '+' && memcmp(p + 1, close, 2) == 0) {
            matched = keep = true;
            mlen = 3;
        } else if (n >= 2 && memcmp(p, close, 2) == 0) {
            matched = true;
            mlen = 2;
        }
        if (matched) {
            struct jtoken *t = push(L, block ? JT_BLOCK_END : JT_VAR_END, L->line);
            if (!t)
                return false;
            size_t end = L->pos + mlen;
            if (strip_after)
                end += ws_run(L->src + end, L->n - end);
            else if (block && !keep && end < L->n && L->src[end] == '\n')
                end++; /* trim_blocks */
            *ends_nl = end > L->pos && L->src[end - 1] == '\n';
            L->line += count_nl(L->src + L->pos, end - L->pos);
            L->pos = end;
            return true;
        }
        size_t w = ws_run(p, n);
        if (w) {
            L->line += count_nl(p, w);
            L->pos += w;
            continue;
        }
        char ch = p[0];
        if (ch == '\'' || ch == '"') {
            if (!lex_string(L, ch))
                return false;
            continue;
        }
        if (is_digit(ch)) {
            if (!lex_number(L))
                return false;
            continue;
        }
        if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_') {
            size_t k = 1;
            while (k < n && ((p[k] >= 'a' && p[k] <= 'z') || (p[k] >= 'A' && p[k] <= 'Z') ||
                             is_digit(p[k]) || p[k] == '_'))
                k++;
            struct jtoken *t = push(L, JT_NAME, L->line);
            if (!t)
                return false;
            t->str = dupn(L, p, k);
            t->len = k;
            if (!t->str)
                return false;
            L->pos += k;
            continue;
        }
        const char *op = NULL;
        for (int i = 0; ops[i]; i++) {
            size_t k = strlen(ops[i]);
            if (n >= k && memcmp(p, ops[i], k) == 0) {
                op = ops[i];
                break;
            }
        }
        if (!op) {
            size_t adv;
            uint32_t cp = ju8_dec(p, n, &adv);
            if (cp < 0x80 && cp >= 0x20)
                lerr(L, L->line, "unexpected character '%c'", (char)cp);
            else
                lerr(L, L->line, "unexpected character U+%04X", cp);
            return false;
        }
        struct jtoken *t = push(L, JT_OP, L->line);
        if (!t)
            return false;
        t->str = op;
        t->len = strlen(op);
        L->pos += t->len;
    }
}

struct jtoken *jinja_lex(const char *src, const char *name, struct jarena *arena, size_t *n_out,
                         struct moe_error *err)
{
    struct lexer L = {.name = name, .arena = arena, .err = err, .line = 1};
    /* newlines normalized, one trailing newline dropped */
    size_t n = strlen(src);
    char *s = jarena_alloc(arena, n + 1);
    if (!s) {
        moe_error_set(err, MOE_ERR_NOMEM, "%s: out of memory", name);
        return NULL;
    }
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (src[i] == '\r') {
            s[o++] = '\n';
            if (i + 1 < n && src[i + 1] == '\n')
                i++;
        } else {
            s[o++] = src[i];
        }
    }
    if (o > 0 && s[o - 1] == '\n')
        o--;
    s[o] = 0;
    L.src = s;
    L.n = o;

    bool line_starting = true;
    while (L.pos < L.n && !L.failed) {
        const char *p = L.src + L.pos;
        size_t left = L.n - L.pos;
        size_t at = left;
        char kind = 0;
        for (size_t i = 0; i + 1 < left; i++) {
            if (p[i] == '{' && (p[i + 1] == '{' || p[i + 1] == '%' || p[i + 1] == '#')) {
                at = i;
                kind = p[i + 1];
                break;
            }
        }
        if (!kind) {
            emit_data(&L, p, left, L.line);
            break;
        }
        size_t open_len = 2;
        char sign = 0;
        if (at + 2 < left && (p[at + 2] == '-' || p[at + 2] == '+')) {
            sign = p[at + 2];
            open_len = 3;
        }
        size_t text_len = at;
        if (sign == '-') {
            text_len = rstrip_len(p, at);
        } else if (sign != '+' && kind != '{') { /* lstrip_blocks */
            size_t l_pos = 0;
            for (size_t i = at; i > 0; i--)
                if (p[i - 1] == '\n') {
                    l_pos = i;
                    break;
                }
            if ((l_pos > 0 || line_starting) && ws_run(p + l_pos, at - l_pos) == at - l_pos)
                text_len = l_pos;
        }
        if (!emit_data(&L, p, text_len, L.line))
            break;
        L.line += count_nl(p, at + open_len);
        L.pos += at + open_len;
        int tag_line = L.line;
        if (kind == '#') {
            const char *q = L.src + L.pos;
            const char *e = strstr(q, "#}");
            if (!e) {
                lerr(&L, tag_line, "unclosed comment: {# without #}");
                break;
            }
            size_t end = (size_t)(e - L.src) + 2;
            if (e > q && e[-1] == '-')
                end += ws_run(L.src + end, L.n - end);
            else if (!(e > q && e[-1] == '+') && end < L.n && L.src[end] == '\n')
                end++;
            line_starting = L.src[end - 1] == '\n';
            L.line += count_nl(L.src + L.pos, end - L.pos);
            L.pos = end;
            continue;
        }
        bool block = kind == '%';
        if (!push(&L, block ? JT_BLOCK_BEGIN : JT_VAR_BEGIN, tag_line))
            break;
        if (!lex_tag(&L, block, &line_starting))
            break;
    }
    if (L.failed)
        return NULL;
    if (!push(&L, JT_EOF, L.line))
        return NULL;
    *n_out = L.n_tok;
    return L.tok;
}
