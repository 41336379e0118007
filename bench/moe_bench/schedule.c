/* Arrival schedules (schedule.h). */
#include <math.h>
#include <stdlib.h>

#include "bench.h"
#include "schedule.h"

#define STREAM_ARRIVAL 101

static double gap(struct bench_rng *r, double rate, double burstiness)
{
    double theta = 1.0 / (rate * burstiness);
    return bench_rng_gamma(r, burstiness) * theta;
}

enum moe_status bench_schedule_count(size_t n, double rate, double burstiness, uint64_t seed,
                                     double **out)
{
    double *t = malloc((n ? n : 1) * sizeof(double));
    if (!t)
        return MOE_ERR_NOMEM;
    if (isinf(rate)) {
        for (size_t i = 0; i < n; i++)
            t[i] = 0;
        *out = t;
        return MOE_OK;
    }
    struct bench_rng r;
    bench_rng_seed(&r, seed, STREAM_ARRIVAL, 0);
    double acc = 0;
    for (size_t i = 0; i < n; i++) {
        acc += gap(&r, rate, burstiness);
        t[i] = acc;
    }
    if (n && acc > 0) {
        double k = ((double)n / rate) / acc;
        for (size_t i = 0; i < n; i++)
            t[i] *= k;
    }
    *out = t;
    return MOE_OK;
}

enum moe_status bench_schedule_duration(double duration_s, double rate, double burstiness,
                                        uint64_t seed, double **out, size_t *n)
{
    size_t cap = 256, k = 0;
    double *t = malloc(cap * sizeof(double));
    if (!t)
        return MOE_ERR_NOMEM;
    struct bench_rng r;
    bench_rng_seed(&r, seed, STREAM_ARRIVAL, 0);
    double acc = 0;
    for (;;) {
        acc += gap(&r, rate, burstiness);
        if (acc >= duration_s)
            break;
        if (k == cap) {
            double *g = realloc(t, 2 * cap * sizeof(double));
            if (!g) {
                free(t);
                return MOE_ERR_NOMEM;
            }
            t = g;
            cap *= 2;
        }
        t[k++] = acc;
    }
    *out = t;
    *n = k;
    return MOE_OK;
}
