/* The metrics registry (see metrics.h). Families and series are append-only
 * lists guarded by one mutex (registration and rendering); values are plain
 * 64-bit words changed with relaxed atomics, doubles as their bit patterns. */
#include "metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double MOE_BUCKETS_TTFT[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06,  0.08,
                                   0.1,   0.25,  0.5,  0.75, 1.0,  2.5,   5.0,
                                   7.5,   10.0,  20.0, 40.0, 80.0, 160.0, 640.0};
const int MOE_N_BUCKETS_TTFT = (int)(sizeof MOE_BUCKETS_TTFT / sizeof MOE_BUCKETS_TTFT[0]);
const double MOE_BUCKETS_ITL[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                  0.075,  0.1,   0.15,   0.2,   0.3,  0.4,   0.5,
                                  0.75,   1.0,   2.5,    5.0,   10.0, 20.0,  80.0};
const int MOE_N_BUCKETS_ITL = (int)(sizeof MOE_BUCKETS_ITL / sizeof MOE_BUCKETS_ITL[0]);
const double MOE_BUCKETS_E2E[] = {0.01,  0.05,  0.1,   0.3,   0.5,    0.8,   1.0,  1.5,
                                  2.0,   2.5,   5.0,   10.0,  15.0,   20.0,  30.0, 60.0,
                                  120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
const int MOE_N_BUCKETS_E2E = (int)(sizeof MOE_BUCKETS_E2E / sizeof MOE_BUCKETS_E2E[0]);
const double MOE_BUCKETS_STEP[] = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                   0.025,   0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   10.0};
const int MOE_N_BUCKETS_STEP = (int)(sizeof MOE_BUCKETS_STEP / sizeof MOE_BUCKETS_STEP[0]);

enum kind { KIND_COUNTER, KIND_GAUGE, KIND_HISTOGRAM };

struct series {
    char *labels;      /* `a="1",b="x"` (escaped) or "" */
    uint64_t n;        /* counter: integer part */
    uint64_t d;        /* counter: fractional part; gauge: value; histogram: sum (double bits) */
    uint64_t *buckets; /* histogram: (n_bounds + 1) counts, the last one +Inf (not cumulative) */
    struct series *next;
};

struct family {
    char *name, *help;
    enum kind kind;
    double *bounds; /* histogram: (n_bounds) */
    int n_bounds;
    struct series *first, *last;
    struct family *next;
};

struct collector {
    moe_metrics_collect_fn fn;
    void *user;
    struct collector *next;
};

struct moe_metrics {
    pthread_mutex_t mu;
    struct family *first, *last;
    struct collector *collectors, *last_collector;
    char *const_labels; /* `model_name="x"` or "" */
};

/* The handle types are series; the names keep the kinds apart in the API. */
struct moe_counter {
    struct series s;
};
struct moe_gauge {
    struct series s;
};
struct moe_histogram {
    struct series s;
};

/* ---- atomics on doubles --------------------------------------------------------- */

static uint64_t bits_of(double v)
{
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

static double double_of(uint64_t b)
{
    double v;
    memcpy(&v, &b, sizeof v);
    return v;
}

static void atomic_add_double(uint64_t *p, double v)
{
    uint64_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, bits_of(double_of(old) + v), true,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        ;
}

/* ---- recording ---------------------------------------------------------------------- */

void moe_counter_add(struct moe_counter *c, uint64_t n)
{
    if (c)
        __atomic_add_fetch(&c->s.n, n, __ATOMIC_RELAXED);
}

void moe_counter_inc(struct moe_counter *c)
{
    if (c)
        __atomic_add_fetch(&c->s.n, 1, __ATOMIC_RELAXED);
}

void moe_counter_add_f(struct moe_counter *c, double v)
{
    if (c && v > 0)
        atomic_add_double(&c->s.d, v);
}

void moe_counter_set(struct moe_counter *c, double v)
{
    if (!c)
        return;
    __atomic_store_n(&c->s.n, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->s.d, bits_of(v), __ATOMIC_RELAXED);
}

void moe_gauge_set(struct moe_gauge *g, double v)
{
    if (g)
        __atomic_store_n(&g->s.d, bits_of(v), __ATOMIC_RELAXED);
}

void moe_gauge_add(struct moe_gauge *g, double v)
{
    if (g)
        atomic_add_double(&g->s.d, v);
}

/* The family of a histogram series is needed for its bounds: the bounds are
 * copied in front of the bucket counts instead (one allocation), so that
 * observe touches only the series. */
struct hist_layout {
    int n_bounds;
    const double *bounds;
};

void moe_histogram_observe(struct moe_histogram *h, double v)
{
    if (!h)
        return;
    const struct hist_layout *lay = (const struct hist_layout *)(void *)h->s.buckets - 1;
    int lo = 0, hi = lay->n_bounds; /* first bound >= v, or n_bounds (+Inf) */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (lay->bounds[mid] >= v)
            hi = mid;
        else
            lo = mid + 1;
    }
    __atomic_add_fetch(&h->s.buckets[lo], 1, __ATOMIC_RELAXED);
    atomic_add_double(&h->s.d, v);
}

double moe_counter_value(const struct moe_counter *c)
{
    if (!c)
        return 0;
    return (double)__atomic_load_n(&c->s.n, __ATOMIC_RELAXED) +
           double_of(__atomic_load_n(&c->s.d, __ATOMIC_RELAXED));
}

double moe_gauge_value(const struct moe_gauge *g)
{
    return g ? double_of(__atomic_load_n(&g->s.d, __ATOMIC_RELAXED)) : 0;
}

static int hist_n_bounds(const struct series *s)
{
    return ((const struct hist_layout *)(const void *)s->buckets - 1)->n_bounds;
}

uint64_t moe_histogram_count(const struct moe_histogram *h)
{
    if (!h)
        return 0;
    uint64_t n = 0;
    for (int i = 0; i <= hist_n_bounds(&h->s); i++)
        n += __atomic_load_n(&h->s.buckets[i], __ATOMIC_RELAXED);
    return n;
}

/* ---- registry ------------------------------------------------------------------------ */

struct moe_metrics *moe_metrics_create(void)
{
    struct moe_metrics *m = calloc(1, sizeof *m);
    if (!m)
        return NULL;
    m->const_labels = strdup("");
    if (!m->const_labels) {
        free(m);
        return NULL;
    }
    pthread_mutex_init(&m->mu, NULL);
    return m;
}

static void series_free(struct series *s)
{
    if (s->buckets)
        free((struct hist_layout *)(void *)s->buckets - 1);
    free(s->labels);
    free(s);
}

void moe_metrics_destroy(struct moe_metrics *m)
{
    if (!m)
        return;
    for (struct family *f = m->first, *fn; f; f = fn) {
        fn = f->next;
        for (struct series *s = f->first, *sn; s; s = sn) {
            sn = s->next;
            series_free(s);
        }
        free(f->name);
        free(f->help);
        free(f->bounds);
        free(f);
    }
    for (struct collector *c = m->collectors, *cn; c; c = cn) {
        cn = c->next;
        free(c);
    }
    free(m->const_labels);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static bool valid_name(const char *s, bool colon)
{
    if (!s || !*s)
        return false;
    for (size_t i = 0; s[i]; i++) {
        char ch = s[i];
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_' ||
                  (colon && ch == ':') || (i > 0 && ch >= '0' && ch <= '9');
        if (!ok)
            return false;
    }
    return true;
}

/* A growing string; `oom` once an allocation failed. */
struct strbuf {
    char *buf;
    size_t len, cap;
    bool oom;
};

static void sb_put(struct strbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->buf, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->buf = p;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    b->buf[b->len] = '\0';
}

static void sb_str(struct strbuf *b, const char *s)
{
    sb_put(b, s, strlen(s));
}

static void sb_printf(struct strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(struct strbuf *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n < sizeof tmp) {
        sb_put(b, tmp, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = true;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb_put(b, big, (size_t)n);
    free(big);
}

/* Label values: backslash, double quote and newline escaped. */
static void sb_label_value(struct strbuf *b, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\')
            sb_str(b, "\\\\");
        else if (*v == '"')
            sb_str(b, "\\\"");
        else if (*v == '\n')
            sb_str(b, "\\n");
        else
            sb_put(b, v, 1);
    }
}

enum moe_status moe_metrics_set_label(struct moe_metrics *m, const char *name, const char *value,
                                      struct moe_error *err)
{
    if (!valid_name(name, false))
        return moe_error_set(err, MOE_ERR_INVALID, "metrics: bad label name '%s'",
                             name ? name : "(null)");
    struct strbuf b = {0};
    pthread_mutex_lock(&m->mu);
    sb_str(&b, m->const_labels);
    if (m->const_labels[0])
        sb_str(&b, ",");
    sb_printf(&b, "%s=\"", name);
    sb_label_value(&b, value ? value : "");
    sb_str(&b, "\"");
    if (!b.oom) {
        free(m->const_labels);
        m->const_labels = b.buf;
    }
    pthread_mutex_unlock(&m->mu);
    if (b.oom) {
        free(b.buf);
        return moe_error_set(err, MOE_ERR_NOMEM, "metrics: out of memory");
    }
    return MOE_OK;
}

/* The escaped label string of a NULL-terminated name, value list; NULL on a
 * bad name or no memory. */
static char *format_labels(va_list ap)
{
    struct strbuf b = {0};
    sb_str(&b, "");
    for (;;) {
        const char *k = va_arg(ap, const char *);
        if (!k)
            break;
        const char *v = va_arg(ap, const char *);
        if (!valid_name(k, false) || !strcmp(k, "le") || !v) {
            free(b.buf);
            return NULL;
        }
        if (b.len)
            sb_str(&b, ",");
        sb_printf(&b, "%s=\"", k);
        sb_label_value(&b, v);
        sb_str(&b, "\"");
    }
    if (b.oom) {
        free(b.buf);
        return NULL;
    }
    return b.buf;
}

static struct series *lookup(struct moe_metrics *m, const char *name, const char *help,
                             enum kind kind, const double *bounds, int n_bounds, char *labels)
{
    if (!m || !labels || !valid_name(name, true))
        goto fail;
    if (kind == KIND_HISTOGRAM) {
        if (!bounds || n_bounds < 1)
            goto fail;
        for (int i = 1; i < n_bounds; i++)
            if (!(bounds[i] > bounds[i - 1]))
                goto fail;
    }
    pthread_mutex_lock(&m->mu);
    struct family *f = m->first;
    while (f && strcmp(f->name, name))
        f = f->next;
    if (f) {
        bool same = f->kind == kind;
        if (same && kind == KIND_HISTOGRAM)
            same = f->n_bounds == n_bounds &&
                   !memcmp(f->bounds, bounds, (size_t)n_bounds * sizeof *bounds);
        if (!same) {
            pthread_mutex_unlock(&m->mu);
            goto fail;
        }
        for (struct series *s = f->first; s; s = s->next)
            if (!strcmp(s->labels, labels)) {
                pthread_mutex_unlock(&m->mu);
                free(labels);
                return s;
            }
    } else {
        f = calloc(1, sizeof *f);
        if (!f || !(f->name = strdup(name)) || !(f->help = strdup(help ? help : ""))) {
            if (f) {
                free(f->name);
                free(f);
            }
            pthread_mutex_unlock(&m->mu);
            goto fail;
        }
        f->kind = kind;
        if (kind == KIND_HISTOGRAM) {
            f->bounds = malloc((size_t)n_bounds * sizeof *bounds);
            if (!f->bounds) {
                free(f->name);
                free(f->help);
                free(f);
                pthread_mutex_unlock(&m->mu);
                goto fail;
            }
            memcpy(f->bounds, bounds, (size_t)n_bounds * sizeof *bounds);
            f->n_bounds = n_bounds;
        }
        if (m->last)
            m->last->next = f;
        else
            m->first = f;
        m->last = f;
    }
    /* A series is allocated with the size of the largest handle type. */
    struct series *s = calloc(1, sizeof(struct moe_histogram));
    if (s && kind == KIND_HISTOGRAM) {
        struct hist_layout *lay =
            calloc(1, sizeof *lay + (size_t)(n_bounds + 1) * sizeof(uint64_t));
        if (lay) {
            lay->n_bounds = n_bounds;
            lay->bounds = f->bounds;
            s->buckets = (uint64_t *)(void *)(lay + 1);
        } else {
            free(s);
            s = NULL;
        }
    }
    if (!s) {
        pthread_mutex_unlock(&m->mu);
        goto fail;
    }
    s->labels = labels;
    if (f->last)
        f->last->next = s;
    else
        f->first = s;
    f->last = s;
    pthread_mutex_unlock(&m->mu);
    return s;
fail:
    free(labels);
    return NULL;
}

struct moe_counter *moe_metrics_counter(struct moe_metrics *m, const char *name, const char *help,
                                        ...)
{
    va_list ap;
    va_start(ap, help);
    char *labels = format_labels(ap);
    va_end(ap);
    return (struct moe_counter *)lookup(m, name, help, KIND_COUNTER, NULL, 0, labels);
}

struct moe_gauge *moe_metrics_gauge(struct moe_metrics *m, const char *name, const char *help, ...)
{
    va_list ap;
    va_start(ap, help);
    char *labels = format_labels(ap);
    va_end(ap);
    return (struct moe_gauge *)lookup(m, name, help, KIND_GAUGE, NULL, 0, labels);
}

struct moe_histogram *moe_metrics_histogram(struct moe_metrics *m, const char *name,
                                            const char *help, const double *bounds, int n_bounds,
                                            ...)
{
    va_list ap;
    va_start(ap, n_bounds);
    char *labels = format_labels(ap);
    va_end(ap);
    return (struct moe_histogram *)lookup(m, name, help, KIND_HISTOGRAM, bounds, n_bounds, labels);
}

enum moe_status moe_metrics_add_collector(struct moe_metrics *m, moe_metrics_collect_fn fn,
                                          void *user, struct moe_error *err)
{
    struct collector *c = calloc(1, sizeof *c);
    if (!c)
        return moe_error_set(err, MOE_ERR_NOMEM, "metrics: out of memory");
    c->fn = fn;
    c->user = user;
    pthread_mutex_lock(&m->mu);
    if (m->last_collector)
        m->last_collector->next = c;
    else
        m->collectors = c;
    m->last_collector = c;
    pthread_mutex_unlock(&m->mu);
    return MOE_OK;
}

/* ---- rendering -------------------------------------------------------------------------- */

struct moe_metrics_out {
    struct strbuf b;
    const char *const_labels;
};

/* The shortest of %.15g..%.17g that reads back as v (0.1, not 0.10000000000000001). */
static void fmt_double(char *buf, size_t cap, double v)
{
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}

static void put_value(struct strbuf *b, double v)
{
    if (isnan(v))
        sb_str(b, "NaN");
    else if (isinf(v))
        sb_str(b, v > 0 ? "+Inf" : "-Inf");
    else if (v == floor(v) && fabs(v) < 9007199254740992.0)
        sb_printf(b, "%.0f", v);
    else {
        char tmp[40];
        fmt_double(tmp, sizeof tmp, v);
        sb_str(b, tmp);
    }
}

static void put_help(struct strbuf *b, const char *help)
{
    for (; *help; help++) {
        if (*help == '\\')
            sb_str(b, "\\\\");
        else if (*help == '\n')
            sb_str(b, "\\n");
        else
            sb_put(b, help, 1);
    }
}

void moe_metrics_out_family(struct moe_metrics_out *out, const char *name, const char *type,
                            const char *help)
{
    sb_printf(&out->b, "# HELP %s ", name);
    put_help(&out->b, help ? help : "");
    sb_printf(&out->b, "\n# TYPE %s %s\n", name, type);
}

/* name{const,labels,extra} value */
static void put_sample(struct moe_metrics_out *out, const char *name, const char *suffix,
                       const char *labels, const char *extra, double value)
{
    struct strbuf *b = &out->b;
    sb_str(b, name);
    sb_str(b, suffix);
    bool any = false;
    const char *parts[3] = {out->const_labels, labels, extra};
    for (int i = 0; i < 3; i++) {
        if (!parts[i] || !parts[i][0])
            continue;
        sb_str(b, any ? "," : "{");
        sb_str(b, parts[i]);
        any = true;
    }
    if (any)
        sb_str(b, "}");
    sb_str(b, " ");
    put_value(b, value);
    sb_str(b, "\n");
}

void moe_metrics_out_sample(struct moe_metrics_out *out, const char *name, const char *labels,
                            double value)
{
    put_sample(out, name, "", labels, NULL, value);
}

void moe_metrics_escape(char *dst, size_t cap, const char *value)
{
    size_t o = 0;
    for (; *value && o + 3 < cap; value++) {
        if (*value == '\\' || *value == '"') {
            dst[o++] = '\\';
            dst[o++] = *value;
        } else if (*value == '\n') {
            dst[o++] = '\\';
            dst[o++] = 'n';
        } else {
            dst[o++] = *value;
        }
    }
    if (cap)
        dst[o < cap ? o : cap - 1] = '\0';
}

static const char *kind_name(enum kind k)
{
    return k == KIND_COUNTER ? "counter" : k == KIND_GAUGE ? "gauge" : "histogram";
}

enum moe_status moe_metrics_render(struct moe_metrics *m, char **text, size_t *len,
                                   struct moe_error *err)
{
    struct moe_metrics_out out;
    memset(&out, 0, sizeof out);
    pthread_mutex_lock(&m->mu);
    out.const_labels = m->const_labels;
    sb_str(&out.b, "");
    for (struct collector *c = m->collectors; c; c = c->next)
        c->fn(c->user, &out);
    for (struct family *f = m->first; f; f = f->next) {
        if (!f->first)
            continue;
        moe_metrics_out_family(&out, f->name, kind_name(f->kind), f->help);
        for (struct series *s = f->first; s; s = s->next) {
            if (f->kind == KIND_COUNTER) {
                put_sample(&out, f->name, "", s->labels, NULL,
                           moe_counter_value((struct moe_counter *)s));
            } else if (f->kind == KIND_GAUGE) {
                put_sample(&out, f->name, "", s->labels, NULL,
                           moe_gauge_value((struct moe_gauge *)s));
            } else {
                uint64_t cum = 0;
                char le[64];
                for (int i = 0; i <= f->n_bounds; i++) {
                    cum += __atomic_load_n(&s->buckets[i], __ATOMIC_RELAXED);
                    if (i < f->n_bounds) {
                        char num[40];
                        fmt_double(num, sizeof num, f->bounds[i]);
                        snprintf(le, sizeof le, "le=\"%s\"", num);
                    } else
                        snprintf(le, sizeof le, "le=\"+Inf\"");
                    put_sample(&out, f->name, "_bucket", s->labels, le, (double)cum);
                }
                put_sample(&out, f->name, "_sum", s->labels, NULL,
                           double_of(__atomic_load_n(&s->d, __ATOMIC_RELAXED)));
                put_sample(&out, f->name, "_count", s->labels, NULL, (double)cum);
            }
        }
    }
    pthread_mutex_unlock(&m->mu);
    if (out.b.oom) {
        free(out.b.buf);
        return moe_error_set(err, MOE_ERR_NOMEM, "metrics: out of memory rendering");
    }
    *text = out.b.buf;
    *len = out.b.len;
    return MOE_OK;
}
