/* One rank's load (runner.h): dispatcher + pool of request threads. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runner.h"
#include "clock.h"

struct job {
    int64_t index;
    double arrival_s;
    struct bench_item item;
};

struct pool {
    const struct bench_run_opts *o;
    double t_origin;
    pthread_mutex_t mu;
    pthread_cond_t cond;      /* a job was queued, or stop */
    pthread_cond_t idle_cond; /* a thread became idle */
    struct job **queue;       /* FIFO ring */
    size_t q_cap, q_head, q_len;
    bool stop;
    int n_threads, n_idle, in_flight;
    pthread_t threads[BENCH_MAX_INFLIGHT];
    struct bench_run_result *res;
    size_t done, failed;
    double last_done_s;
    bool nomem;
};

static void *worker(void *arg)
{
    struct pool *p = arg;
    const struct bench_run_opts *o = p->o;
    struct bench_conn *conn = bench_conn_create(o->target);
    pthread_mutex_lock(&p->mu);
    if (!conn)
        p->nomem = true;
    for (;;) {
        while (!p->q_len && !p->stop)
            pthread_cond_wait(&p->cond, &p->mu);
        if (!p->q_len && p->stop)
            break;
        struct job *j = p->queue[p->q_head];
        p->q_head = (p->q_head + 1) % p->q_cap;
        p->q_len--;
        p->n_idle--;
        p->in_flight++;
        pthread_mutex_unlock(&p->mu);

        struct bench_record rec = {0};
        rec.index = j->index;
        rec.rank = o->rank;
        rec.target = o->target_index;
        rec.arrival_s = j->arrival_s;
        char rid[128];
        snprintf(rid, sizeof rid, "%s%s%lld", o->rid_prefix, o->warmup ? "warmup-" : "",
                 (long long)j->index);
        if (conn) {
            bench_conn_run(conn, &j->item, rid, p->t_origin, &rec);
        } else {
            rec.start_s = moe_now() - p->t_origin;
            snprintf(rec.status, sizeof rec.status, "NOMEM");
            snprintf(rec.error, sizeof rec.error, "no connection object (out of memory)");
        }
        bench_item_clear(&j->item);
        free(j);
        double now = moe_now() - p->t_origin;

        pthread_mutex_lock(&p->mu);
        struct bench_run_result *res = p->res;
        if (res->n == res->cap) {
            size_t cap = res->cap ? 2 * res->cap : 256;
            struct bench_record *g = realloc(res->recs, cap * sizeof(*g));
            if (g) {
                res->recs = g;
                res->cap = cap;
            }
        }
        if (res->n < res->cap) {
            res->recs[res->n++] = rec;
        } else {
            bench_record_clear(&rec);
            p->nomem = true;
        }
        p->done++;
        if (!rec.success)
            p->failed++;
        if (now > p->last_done_s)
            p->last_done_s = now;
        p->in_flight--;
        p->n_idle++;
        pthread_cond_broadcast(&p->idle_cond);
    }
    pthread_mutex_unlock(&p->mu);
    bench_conn_destroy(conn);
    return NULL;
}

/* With p->mu held. */
static enum moe_status spawn(struct pool *p, struct moe_error *err)
{
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 512 << 10);
    int rc = pthread_create(&p->threads[p->n_threads], &attr, worker, p);
    pthread_attr_destroy(&attr);
    if (rc)
        return moe_error_set(err, MOE_ERR_NOMEM, "cannot start request thread %d: %s", p->n_threads,
                             strerror(rc));
    p->n_threads++;
    p->n_idle++;
    return MOE_OK;
}

/* With p->mu held. */
static enum moe_status push(struct pool *p, struct job *j, struct moe_error *err)
{
    if (p->q_len == p->q_cap) {
        size_t cap = p->q_cap ? 2 * p->q_cap : 256;
        struct job **q = malloc(cap * sizeof(*q));
        if (!q)
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        for (size_t i = 0; i < p->q_len; i++)
            q[i] = p->queue[(p->q_head + i) % p->q_cap];
        free(p->queue);
        p->queue = q;
        p->q_cap = cap;
        p->q_head = 0;
    }
    p->queue[(p->q_head + p->q_len) % p->q_cap] = j;
    p->q_len++;
    if (p->o->max_concurrency == 0 && p->n_idle < (int)p->q_len &&
        p->n_threads < BENCH_MAX_INFLIGHT) {
        enum moe_status st = spawn(p, err);
        if (st)
            return st;
    }
    pthread_cond_signal(&p->cond);
    return MOE_OK;
}

static void progress_line(struct pool *p, size_t n_sent, size_t n_total, double t)
{
    const char *label = p->o->label ? p->o->label : "", *sep = p->o->label ? ": " : "";
    const char *share = p->o->size > 1 ? " (this rank's share)" : "";
    if (n_total)
        fprintf(stderr, "moe-bench: %s%s%zu/%zu done%s (%zu failed), %d in flight, %.1f s\n", label,
                sep, p->done, n_total, share, p->failed, p->in_flight, t);
    else
        fprintf(stderr,
                "moe-bench: %s%s%zu done (%zu failed) of %zu sent%s, %d in flight, %.1f s\n", label,
                sep, p->done, p->failed, n_sent, share, p->in_flight, t);
}

enum moe_status bench_run(const struct bench_run_opts *o, double t_origin,
                          struct bench_run_result *res, struct moe_error *err)
{
    memset(res, 0, sizeof(*res));
    struct pool *p = calloc(1, sizeof(*p));
    if (!p)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    p->o = o;
    p->t_origin = t_origin;
    p->res = res;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cond, NULL);
    pthread_cond_init(&p->idle_cond, NULL);
    enum moe_status st = MOE_OK;
    size_t n_mine = 0;
    if (!o->closed_loop && o->n_total > (size_t)o->rank)
        n_mine = (o->n_total - (size_t)o->rank + (size_t)o->size - 1) / (size_t)o->size;

    /* Prompts are made before the start so that the dispatcher only waits. */
    struct job **jobs = NULL;
    if (n_mine) {
        jobs = calloc(n_mine, sizeof(*jobs));
        if (!jobs) {
            st = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            goto out;
        }
        for (size_t k = 0; k < n_mine; k++) {
            int64_t idx = (int64_t)(o->rank + k * (size_t)o->size);
            jobs[k] = calloc(1, sizeof(struct job));
            if (!jobs[k]) {
                st = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
                goto out;
            }
            jobs[k]->index = idx;
            jobs[k]->arrival_s = o->arrivals ? o->arrivals[idx] : 0;
            st = o->warmup
                     ? bench_workload_warmup_item(o->w, o->item_base + idx, &jobs[k]->item, err)
                     : bench_workload_item(o->w, o->item_base + idx, &jobs[k]->item, err);
            if (st) {
                moe_error_prefix(err, "request %lld", (long long)idx);
                goto out;
            }
        }
    }
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < o->max_concurrency && !st; i++)
        st = spawn(p, err);
    pthread_mutex_unlock(&p->mu);
    if (st)
        goto stop;

    double next_progress = 1.0;
    size_t sent = 0;
    if (!o->closed_loop) {
        for (size_t k = 0; k < n_mine && !st; k++) {
            double at = jobs[k]->arrival_s;
            for (;;) { /* sleep to the arrival, printing progress on the way */
                double now = moe_now() - t_origin;
                if (o->progress && now >= next_progress) {
                    pthread_mutex_lock(&p->mu);
                    progress_line(p, sent, n_mine, now);
                    pthread_mutex_unlock(&p->mu);
                    next_progress = floor(now) + 1.0;
                }
                if (now >= at)
                    break;
                bench_sleep_until(t_origin + fmin(at, o->progress ? next_progress : at));
            }
            pthread_mutex_lock(&p->mu);
            st = push(p, jobs[k], err);
            pthread_mutex_unlock(&p->mu);
            if (!st) {
                jobs[k] = NULL;
                sent++;
            }
        }
    } else {
        /* Closed loop: a new request whenever a thread is idle, until the end. */
        int64_t idx = o->rank;
        for (;;) {
            double now = moe_now() - t_origin;
            if (now >= o->duration_s)
                break;
            pthread_mutex_lock(&p->mu);
            while (p->n_idle <= (int)p->q_len) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += 100 * 1000000L;
                if (ts.tv_nsec >= 1000000000L) {
                    ts.tv_sec++;
                    ts.tv_nsec -= 1000000000L;
                }
                pthread_cond_timedwait(&p->idle_cond, &p->mu, &ts);
                now = moe_now() - t_origin;
                if (now >= o->duration_s)
                    break;
                if (o->progress && now >= next_progress) {
                    progress_line(p, sent, 0, now);
                    next_progress = floor(now) + 1.0;
                }
            }
            pthread_mutex_unlock(&p->mu);
            if (now >= o->duration_s)
                break;
            struct job *j = calloc(1, sizeof(*j));
            if (!j) {
                st = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
                break;
            }
            j->index = idx;
            j->arrival_s = now;
            st = o->warmup ? bench_workload_warmup_item(o->w, o->item_base + idx, &j->item, err)
                           : bench_workload_item(o->w, o->item_base + idx, &j->item, err);
            if (st) {
                free(j);
                break;
            }
            pthread_mutex_lock(&p->mu);
            st = push(p, j, err);
            pthread_mutex_unlock(&p->mu);
            if (st) {
                bench_item_clear(&j->item);
                free(j);
                break;
            }
            sent++;
            idx += o->size;
        }
    }
    /* Wait for the rest, with progress. */
    pthread_mutex_lock(&p->mu);
    while (p->done < sent) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 200 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&p->idle_cond, &p->mu, &ts);
        double now = moe_now() - t_origin;
        if (o->progress && now >= next_progress) {
            progress_line(p, sent, o->closed_loop ? 0 : n_mine, now);
            next_progress = floor(now) + 1.0;
        }
    }
    pthread_mutex_unlock(&p->mu);
stop:
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cond);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++)
        pthread_join(p->threads[i], NULL);
    res->end_s = p->last_done_s;
    if (!st && p->nomem)
        st = moe_error_set(err, MOE_ERR_NOMEM, "out of memory while running");
out:
    if (jobs) {
        for (size_t k = 0; k < n_mine; k++)
            if (jobs[k]) {
                bench_item_clear(&jobs[k]->item);
                free(jobs[k]);
            }
        free(jobs);
    }
    free(p->queue);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cond);
    pthread_cond_destroy(&p->idle_cond);
    free(p);
    return st;
}

void bench_run_result_free(struct bench_run_result *res)
{
    if (!res)
        return;
    for (size_t i = 0; i < res->n; i++)
        bench_record_clear(&res->recs[i]);
    free(res->recs);
    memset(res, 0, sizeof(*res));
}
