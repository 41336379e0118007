/* vLLM-compatible serving metrics from per-request records (metrics.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_percentile(const double *sorted, size_t n, double p)
{
    if (n == 0)
        return 0;
    double pos = p / 100.0 * (double)(n - 1);
    if (pos <= 0)
        return sorted[0];
    if (pos >= (double)(n - 1))
        return sorted[n - 1];
    size_t lo = (size_t)pos;
    double frac = pos - (double)lo;
    return sorted[lo] + (sorted[lo + 1] - sorted[lo]) * frac;
}

void bench_stat_compute(double *v, size_t n, const double *pcts, int n_pct, struct bench_stat *out)
{
    memset(out, 0, sizeof(*out));
    out->n = n;
    if (n == 0)
        return;
    qsort(v, n, sizeof(double), cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    double mean = sum / (double)n, ss = 0;
    for (size_t i = 0; i < n; i++)
        ss += (v[i] - mean) * (v[i] - mean);
    out->mean = mean * 1e3;
    out->std = sqrt(ss / (double)n) * 1e3;
    out->median = bench_percentile(v, n, 50) * 1e3;
    for (int i = 0; i < n_pct && i < BENCH_MAX_PCT; i++)
        out->pct[i] = bench_percentile(v, n, pcts[i]) * 1e3;
}

double bench_record_tpot(const struct bench_record *r)
{
    if (r->output_len <= 1)
        return 0;
    return (r->e2el_s - r->ttft_s) / (double)(r->output_len - 1);
}

bool bench_record_good(const struct bench_record *r, const struct bench_goodput *g)
{
    if (!r->success)
        return false;
    if (g->has_ttft && r->ttft_s * 1e3 > g->ttft_ms)
        return false;
    if (g->has_tpot && bench_record_tpot(r) * 1e3 > g->tpot_ms)
        return false;
    if (g->has_e2el && r->e2el_s * 1e3 > g->e2el_ms)
        return false;
    return true;
}

struct event {
    double t;
    int delta;
};

static int cmp_event(const void *a, const void *b)
{
    const struct event *x = a, *y = b;
    if (x->t != y->t)
        return (x->t > y->t) - (x->t < y->t);
    return x->delta - y->delta; /* an end before a start at the same instant */
}

static void count_status(struct bench_metrics *m, const char *status)
{
    for (int i = 0; i < m->n_status; i++)
        if (!strcmp(m->status[i], status)) {
            m->status_count[i]++;
            return;
        }
    int slot = m->n_status;
    if (slot == BENCH_MAX_STATUS) {
        slot = BENCH_MAX_STATUS - 1;
        if (strcmp(m->status[slot], "other")) {
            strcpy(m->status[slot], "other");
        }
        m->status_count[slot]++;
        return;
    }
    snprintf(m->status[slot], BENCH_STATUS_MAX, "%s", status[0] ? status : "?");
    m->status_count[slot] = 1;
    m->n_status++;
}

static void sort_status(struct bench_metrics *m)
{
    for (int i = 1; i < m->n_status; i++)
        for (int j = i; j > 0 && m->status_count[j] > m->status_count[j - 1]; j--) {
            char tmp[BENCH_STATUS_MAX];
            memcpy(tmp, m->status[j], sizeof tmp);
            memcpy(m->status[j], m->status[j - 1], sizeof tmp);
            memcpy(m->status[j - 1], tmp, sizeof tmp);
            int c = m->status_count[j];
            m->status_count[j] = m->status_count[j - 1];
            m->status_count[j - 1] = c;
        }
}

enum moe_status bench_metrics_compute(const struct bench_record *recs, size_t n, double duration_s,
                                      const double *pcts, int n_pct, const struct bench_goodput *g,
                                      struct bench_metrics *m)
{
    memset(m, 0, sizeof(*m));
    m->duration_s = duration_s;
    m->n_pct = n_pct < BENCH_MAX_PCT ? n_pct : BENCH_MAX_PCT;
    memcpy(m->pcts, pcts, (size_t)m->n_pct * sizeof(double));
    size_t n_itl = 0;
    for (size_t i = 0; i < n; i++)
        if (recs[i].success && recs[i].n_chunks > 1)
            n_itl += (size_t)recs[i].n_chunks - 1;
    size_t nv = n ? n : 1;
    double *ttft = malloc(nv * sizeof(double)), *tpot = malloc(nv * sizeof(double));
    double *e2el = malloc(nv * sizeof(double)), *itl = malloc((n_itl ? n_itl : 1) * sizeof(double));
    double *srv[6];
    for (int k = 0; k < 6; k++)
        srv[k] = malloc(nv * sizeof(double));
    struct event *ev = malloc(2 * nv * sizeof(*ev));
    enum moe_status st = MOE_ERR_NOMEM;
    bool ok = ttft && tpot && e2el && itl && ev;
    for (int k = 0; k < 6; k++)
        ok = ok && srv[k];
    if (!ok)
        goto done;

    size_t n_ok = 0, n_tpot = 0, n_srv = 0, n_ev = 0, k_itl = 0;
    int good = 0;
    double user_sum = 0;
    int user_n = 0;
    double t_min = INFINITY, t_max = 0;
    for (size_t i = 0; i < n; i++) {
        const struct bench_record *r = &recs[i];
        if (!r->success) {
            m->failed++;
            count_status(m, r->status);
            continue;
        }
        m->completed++;
        m->total_input += r->input_len;
        m->total_output += r->output_len;
        ttft[n_ok] = r->ttft_s;
        e2el[n_ok] = r->e2el_s;
        n_ok++;
        if (r->output_len > 1) {
            tpot[n_tpot++] = bench_record_tpot(r);
            if (r->e2el_s > r->ttft_s) {
                user_sum += (double)(r->output_len - 1) / (r->e2el_s - r->ttft_s);
                user_n++;
            }
        }
        for (int c = 1; c < r->n_chunks; c++)
            itl[k_itl++] = r->chunk_t[c] - r->chunk_t[c - 1];
        if (!isnan(r->srv_e2e_ms)) {
            const double v[6] = {r->srv_queue_ms,  r->srv_prefill_ms, r->srv_ttft_ms,
                                 r->srv_decode_ms, r->srv_e2e_ms,     r->srv_transfer_ms};
            for (int k = 0; k < 6; k++)
                srv[k][n_srv] = v[k] * 1e-3;
            n_srv++;
        }
        if (g && bench_record_good(r, g))
            good++;
        ev[n_ev++] = (struct event){r->start_s, +1};
        ev[n_ev++] = (struct event){r->start_s + r->e2el_s, -1};
        if (r->start_s < t_min)
            t_min = r->start_s;
        if (r->start_s + r->e2el_s > t_max)
            t_max = r->start_s + r->e2el_s;
    }
    double d = duration_s > 0 ? duration_s : 1e-9;
    m->request_throughput = m->completed / d;
    m->output_throughput = (double)m->total_output / d;
    m->total_token_throughput = (double)(m->total_input + m->total_output) / d;
    m->request_goodput = (g && (g->has_ttft || g->has_tpot || g->has_e2el)) ? good / d : NAN;
    m->mean_user_tok_s = user_n ? user_sum / user_n : 0;
    bench_stat_compute(ttft, n_ok, pcts, m->n_pct, &m->ttft);
    bench_stat_compute(tpot, n_tpot, pcts, m->n_pct, &m->tpot);
    bench_stat_compute(itl, k_itl, pcts, m->n_pct, &m->itl);
    bench_stat_compute(e2el, n_ok, pcts, m->n_pct, &m->e2el);
    m->has_server = n_srv > 0;
    struct bench_stat *ss[6] = {&m->srv_queue,  &m->srv_prefill, &m->srv_ttft,
                                &m->srv_decode, &m->srv_e2e,     &m->srv_transfer};
    for (int k = 0; k < 6; k++)
        bench_stat_compute(srv[k], n_srv, pcts, m->n_pct, ss[k]);

    /* Peak concurrency: sweep over half-open [start, end). */
    qsort(ev, n_ev, sizeof(*ev), cmp_event);
    int cur = 0;
    for (size_t i = 0; i < n_ev; i++) {
        cur += ev[i].delta;
        if (cur > m->max_concurrent_requests)
            m->max_concurrent_requests = cur;
    }
    /* Busiest one-second bucket of output tokens (from the first start). */
    if (n_ok) {
        size_t nb = (size_t)ceil(t_max - t_min) + 1;
        double *b = calloc(nb, sizeof(double));
        if (!b)
            goto done;
        for (size_t i = 0; i < n; i++) {
            const struct bench_record *r = &recs[i];
            if (!r->success)
                continue;
            for (int c = 0; c < r->n_chunks; c++) {
                double t = r->start_s + r->chunk_t[c] - t_min;
                size_t k = t < 0 ? 0 : (size_t)t;
                if (k < nb)
                    b[k] += r->chunk_n[c];
            }
        }
        for (size_t k = 0; k < nb; k++)
            if (b[k] > m->max_output_tokens_per_s)
                m->max_output_tokens_per_s = b[k];
        free(b);
    }
    sort_status(m);
    st = MOE_OK;
done:
    free(ttft);
    free(tpot);
    free(e2el);
    free(itl);
    for (int k = 0; k < 6; k++)
        free(srv[k]);
    free(ev);
    return st;
}

enum moe_status bench_timeline(const struct bench_record *recs, size_t n, double duration_s,
                               double bin_s, double **tok_per_s, double **concurrency,
                               size_t *n_bins)
{
    size_t nb = (size_t)ceil(duration_s / bin_s);
    if (nb == 0)
        nb = 1;
    double *tok = calloc(nb, sizeof(double)), *conc = calloc(nb, sizeof(double));
    if (!tok || !conc) {
        free(tok);
        free(conc);
        return MOE_ERR_NOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        const struct bench_record *r = &recs[i];
        for (int c = 0; c < r->n_chunks; c++) {
            double t = r->start_s + r->chunk_t[c];
            size_t k = t < 0 ? 0 : (size_t)(t / bin_s);
            if (k >= nb)
                k = nb - 1;
            tok[k] += r->chunk_n[c];
        }
        /* Time the request was in flight inside each bucket. */
        double a = r->start_s, e = r->start_s + (r->success ? r->e2el_s : 0);
        if (!r->success && r->n_chunks)
            e = r->start_s + r->chunk_t[r->n_chunks - 1];
        for (size_t k = a < 0 ? 0 : (size_t)(a / bin_s); k < nb; k++) {
            double lo = (double)k * bin_s, hi = lo + bin_s;
            if (lo >= e)
                break;
            double ov = fmin(hi, e) - fmax(lo, a);
            if (ov > 0)
                conc[k] += ov / bin_s;
        }
    }
    for (size_t k = 0; k < nb; k++)
        tok[k] /= bin_s;
    *tok_per_s = tok;
    *concurrency = conc;
    *n_bins = nb;
    return MOE_OK;
}
