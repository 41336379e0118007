/* Per-request records (and their wire form for the MPI gather), the clock
 * and the random number generator of moe-bench. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "clock.h"
#include "rng.h"

void bench_item_clear(struct bench_item *item)
{
    if (!item)
        return;
    free(item->ids);
    free(item->text);
    memset(item, 0, sizeof(*item));
}

enum moe_status bench_record_add_chunk(struct bench_record *r, double t, int n_tokens)
{
    if (r->n_chunks == r->cap_chunks) {
        int cap = r->cap_chunks ? 2 * r->cap_chunks : 64;
        double *ct = realloc(r->chunk_t, (size_t)cap * sizeof(*ct));
        if (!ct)
            return MOE_ERR_NOMEM;
        r->chunk_t = ct;
        int32_t *cn = realloc(r->chunk_n, (size_t)cap * sizeof(*cn));
        if (!cn)
            return MOE_ERR_NOMEM;
        r->chunk_n = cn;
        r->cap_chunks = cap;
    }
    r->chunk_t[r->n_chunks] = t;
    r->chunk_n[r->n_chunks] = n_tokens;
    r->n_chunks++;
    return MOE_OK;
}

void bench_record_clear(struct bench_record *r)
{
    if (!r)
        return;
    free(r->chunk_t);
    free(r->chunk_n);
    r->chunk_t = NULL;
    r->chunk_n = NULL;
    r->n_chunks = r->cap_chunks = 0;
}

/* ---- wire form: per record the struct's scalar head (pointers zeroed), then
 * n_chunks doubles and n_chunks int32s. Both ends are the same binary on
 * hosts of one architecture (an mpirun job), so the layout is the struct's. */

#define REC_MAGIC 0x4d42524543ull /* "MBREC" */

enum moe_status bench_records_pack(const struct bench_record *recs, size_t n, uint8_t **out,
                                   size_t *len)
{
    size_t total = sizeof(uint64_t) * 2;
    for (size_t i = 0; i < n; i++)
        total += sizeof(struct bench_record) +
                 (size_t)recs[i].n_chunks * (sizeof(double) + sizeof(int32_t));
    uint8_t *buf = malloc(total);
    if (!buf)
        return MOE_ERR_NOMEM;
    uint8_t *p = buf;
    uint64_t head[2] = {REC_MAGIC, n};
    memcpy(p, head, sizeof head);
    p += sizeof head;
    for (size_t i = 0; i < n; i++) {
        struct bench_record r = recs[i];
        r.chunk_t = NULL;
        r.chunk_n = NULL;
        r.cap_chunks = 0;
        memcpy(p, &r, sizeof r);
        p += sizeof r;
        size_t nc = (size_t)recs[i].n_chunks;
        if (nc) {
            memcpy(p, recs[i].chunk_t, nc * sizeof(double));
            p += nc * sizeof(double);
            memcpy(p, recs[i].chunk_n, nc * sizeof(int32_t));
            p += nc * sizeof(int32_t);
        }
    }
    *out = buf;
    *len = total;
    return MOE_OK;
}

enum moe_status bench_records_unpack(const uint8_t *buf, size_t len, struct bench_record **recs,
                                     size_t *n, size_t *cap, struct moe_error *err)
{
    uint64_t head[2];
    if (len < sizeof head)
        return moe_error_set(err, MOE_ERR_FORMAT, "record buffer: %zu bytes, no header", len);
    memcpy(head, buf, sizeof head);
    if (head[0] != REC_MAGIC)
        return moe_error_set(err, MOE_ERR_FORMAT, "record buffer: bad magic");
    const uint8_t *p = buf + sizeof head, *end = buf + len;
    for (uint64_t i = 0; i < head[1]; i++) {
        if ((size_t)(end - p) < sizeof(struct bench_record))
            return moe_error_set(err, MOE_ERR_FORMAT, "record buffer: record %llu truncated",
                                 (unsigned long long)i);
        struct bench_record r;
        memcpy(&r, p, sizeof r);
        p += sizeof r;
        size_t nc = r.n_chunks > 0 ? (size_t)r.n_chunks : 0;
        if (r.n_chunks < 0 || (size_t)(end - p) < nc * (sizeof(double) + sizeof(int32_t)))
            return moe_error_set(err, MOE_ERR_FORMAT, "record buffer: chunks of %llu truncated",
                                 (unsigned long long)i);
        r.chunk_t = NULL;
        r.chunk_n = NULL;
        r.cap_chunks = 0;
        r.n_chunks = 0;
        r.status[BENCH_STATUS_MAX - 1] = 0;
        r.error[BENCH_ERROR_MAX - 1] = 0;
        r.finish[sizeof r.finish - 1] = 0;
        if (nc) {
            r.chunk_t = malloc(nc * sizeof(double));
            r.chunk_n = malloc(nc * sizeof(int32_t));
            if (!r.chunk_t || !r.chunk_n) {
                free(r.chunk_t);
                free(r.chunk_n);
                return moe_error_set(err, MOE_ERR_NOMEM, "record buffer: out of memory");
            }
            memcpy(r.chunk_t, p, nc * sizeof(double));
            p += nc * sizeof(double);
            memcpy(r.chunk_n, p, nc * sizeof(int32_t));
            p += nc * sizeof(int32_t);
            r.n_chunks = r.cap_chunks = (int)nc;
        }
        if (*n == *cap) {
            size_t nc2 = *cap ? 2 * *cap : 256;
            struct bench_record *g = realloc(*recs, nc2 * sizeof(*g));
            if (!g) {
                bench_record_clear(&r);
                return moe_error_set(err, MOE_ERR_NOMEM, "record buffer: out of memory");
            }
            *recs = g;
            *cap = nc2;
        }
        (*recs)[(*n)++] = r;
    }
    if (p != end)
        return moe_error_set(err, MOE_ERR_FORMAT, "record buffer: %zu trailing bytes",
                             (size_t)(end - p));
    return MOE_OK;
}

/* ---- clock ---------------------------------------------------------------------- */

double bench_now_realtime(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void bench_sleep_until(double t)
{
    if (!(t > 0))
        return;
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* ---- xoshiro256** seeded through splitmix64 (common/rng.h) ------------------------ */

void bench_rng_seed(struct bench_rng *r, uint64_t seed, uint64_t stream, uint64_t index)
{
    uint64_t x = seed;
    uint64_t a = moe_splitmix64(&x) ^ (stream * 0xd1b54a32d192ed03ull);
    uint64_t b = moe_splitmix64(&a) ^ (index * 0x8cb92ba72f3d8dd7ull);
    for (int i = 0; i < 4; i++)
        r->s[i] = moe_splitmix64(&b);
}

uint64_t bench_rng_u64(struct bench_rng *r)
{
    return moe_xoshiro256ss(r->s);
}

double bench_rng_uniform(struct bench_rng *r)
{
    return moe_u64_to_unit(bench_rng_u64(r));
}

int64_t bench_rng_range(struct bench_rng *r, int64_t lo, int64_t hi)
{
    if (hi <= lo)
        return lo;
    uint64_t span = (uint64_t)(hi - lo) + 1;
    return lo + (int64_t)(bench_rng_u64(r) % span);
}

static double rng_normal(struct bench_rng *r)
{
    double u1 = bench_rng_uniform(r), u2 = bench_rng_uniform(r);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

/* Marsaglia and Tsang (2000); shape < 1 by the boost U^(1/k). */
double bench_rng_gamma(struct bench_rng *r, double k)
{
    if (k < 1.0) {
        double u = bench_rng_uniform(r);
        return bench_rng_gamma(r, k + 1.0) * pow(u > 0 ? u : 1e-300, 1.0 / k);
    }
    double d = k - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = rng_normal(r), v = 1.0 + c * x;
        if (v <= 0)
            continue;
        v = v * v * v;
        double u = bench_rng_uniform(r);
        if (u < 1.0 - 0.0331 * x * x * x * x)
            return d * v;
        if (log(u > 0 ? u : 1e-300) < 0.5 * x * x + d * (1.0 - v + log(v)))
            return d * v;
    }
}
