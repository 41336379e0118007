/* sim-placement: runs the expert placement planner (coordinator/planner.h)
 * on synthetic skewed traffic or on recorded traces, at sizes far beyond
 * this machine, and reports the balance before and after planning and the
 * number of expert moves.
 *
 *   sim-placement                        the preset sizes (see PRESETS)
 *   sim-placement --experts E --ranks N [--redundant R] [--layers L]
 *                 [--zipf S] [--tokens T] [--steps K] [--windows W]
 *                 [--drift D] [--seed X] [--tolerance T] [--write-trace FILE]
 *   sim-placement --trace FILE --ranks N [--redundant R] [--tolerance T]
 *
 * Synthetic traffic: per step and layer, T tokens each pick top-k = 8
 * experts (drawn independently) from a Zipf(S) distribution over a
 * permutation of the experts that differs per layer; after every window of
 * K steps, D * E random adjacent swaps per layer move the hot set (drift).
 *
 * The loop: the placement starts as the default even split; after each
 * window the planner plans from that window's counts, and the plan is
 * scored on the NEXT window (out of sample, as it would run). Reported:
 * imbalance = sum over layers of the busiest rank's tokens / the mean rank's
 * (1 = perfect; balancedness = 1 / imbalance), for the default split, the
 * plan as predicted on its own window, and the plan on the next window; the
 * replicas moved per replan (first plan, then the mean of the later ones).
 *
 * Trace format (what `moectl experts stats --json` prints, and the fields of
 * WorkerLoad): a sequence of JSON objects, one per window,
 *   {"stats_layers": L, "stats_experts": E, "stats_steps": K,
 *    "expert_tokens": [L * E counts, row-major (layer, expert)]}
 * --write-trace writes the synthetic windows in this format, one per line. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "planner.h"
#include "clock.h"

#define TOP_K 8

struct sim_opts {
    int n_expert, n_rank, n_redundant, n_layer;
    double zipf;
    int tokens;  /* tokens per step */
    int steps;   /* steps per window */
    int windows; /* windows */
    double drift;
    uint64_t seed;
    double tolerance;
    const char *trace;
    const char *write_trace;
};

/* One row of the report. */
struct sim_result {
    double imb_default;   /* mean over scored windows */
    double imb_predicted; /* the plan on its own window */
    double imb_next;      /* the plan on the next window */
    int moves_first;
    double moves_later; /* mean over later replans */
    int slots;
    double plan_ms; /* mean planner time */
    int n_scored;
};

static uint64_t rng_next(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    uint64_t x = *s;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}

static double rng_unit(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- windows of counts ------------------------------------------------------------ */

struct windows {
    int n_layer, n_expert, n;
    double *counts; /* (n, n_layer, n_expert) */
};

static void windows_free(struct windows *w)
{
    free(w->counts);
    memset(w, 0, sizeof *w);
}

static int synth(const struct sim_opts *o, struct windows *w)
{
    int L = o->n_layer, E = o->n_expert;
    w->n_layer = L;
    w->n_expert = E;
    w->n = o->windows;
    w->counts = calloc((size_t)o->windows * L * E, sizeof *w->counts);
    int *perm = malloc((size_t)L * E * sizeof *perm);
    double *cdf = malloc((size_t)E * sizeof *cdf);
    if (!w->counts || !perm || !cdf) {
        free(perm);
        free(cdf);
        return -1;
    }
    uint64_t rng = o->seed * 2654435761ULL + 1;
    for (int l = 0; l < L; l++) {
        int *p = perm + (size_t)l * E;
        for (int e = 0; e < E; e++)
            p[e] = e;
        for (int e = E - 1; e > 0; e--) {
            int j = (int)(rng_next(&rng) % (uint64_t)(e + 1));
            int t = p[e];
            p[e] = p[j];
            p[j] = t;
        }
    }
    double z = 0;
    for (int k = 0; k < E; k++) {
        z += 1.0 / pow(k + 1, o->zipf);
        cdf[k] = z;
    }
    for (int k = 0; k < E; k++)
        cdf[k] /= z;
    int draws = o->tokens * (TOP_K < E ? TOP_K : E);
    for (int wi = 0; wi < o->windows; wi++) {
        double *c = w->counts + (size_t)wi * L * E;
        for (int l = 0; l < L; l++) {
            const int *p = perm + (size_t)l * E;
            for (int s = 0; s < o->steps; s++)
                for (int d = 0; d < draws; d++) {
                    double u = rng_unit(&rng);
                    int lo = 0, hi = E - 1;
                    while (lo < hi) {
                        int mid = (lo + hi) / 2;
                        if (cdf[mid] < u)
                            lo = mid + 1;
                        else
                            hi = mid;
                    }
                    c[(size_t)l * E + p[lo]] += 1;
                }
        }
        int swaps = (int)(o->drift * E + 0.5);
        for (int l = 0; l < L; l++) {
            int *p = perm + (size_t)l * E;
            for (int k = 0; k < swaps && E > 1; k++) {
                int i = (int)(rng_next(&rng) % (uint64_t)(E - 1));
                int t = p[i];
                p[i] = p[i + 1];
                p[i + 1] = t;
            }
        }
    }
    free(perm);
    free(cdf);
    return 0;
}

/* Reads a trace: a sequence of JSON objects (see the top comment). */
static int read_trace(const char *path, struct windows *w)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "sim-placement: %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 1 << 20, n = 0, k;
    char *text = malloc(cap);
    while (text && (k = fread(text + n, 1, cap - n - 1, f)) > 0) {
        n += k;
        if (n + 1 >= cap) {
            char *g = realloc(text, cap *= 2);
            if (!g)
                free(text);
            text = g;
        }
    }
    fclose(f);
    if (!text)
        return -1;
    text[n] = 0;
    memset(w, 0, sizeof *w);
    const char *at = text;
    int rc = 0;
    for (;;) {
        while (*at == ' ' || *at == '\n' || *at == '\r' || *at == '\t')
            at++;
        if (!*at)
            break;
        const char *end = NULL;
        cJSON *o = cJSON_ParseWithOpts(at, &end, 0);
        const cJSON *jl = cJSON_GetObjectItemCaseSensitive(o, "stats_layers");
        const cJSON *je = cJSON_GetObjectItemCaseSensitive(o, "stats_experts");
        const cJSON *jt = cJSON_GetObjectItemCaseSensitive(o, "expert_tokens");
        int L = cJSON_IsNumber(jl) ? (int)jl->valuedouble : 0;
        int E = cJSON_IsNumber(je) ? (int)je->valuedouble : 0;
        if (!o || L < 1 || E < 1 || cJSON_GetArraySize(jt) != L * E ||
            (w->n && (L != w->n_layer || E != w->n_expert))) {
            fprintf(stderr,
                    "sim-placement: %s: window %d: needs stats_layers, stats_experts and "
                    "expert_tokens of stats_layers x stats_experts counts (same shape in every "
                    "window)\n",
                    path, w->n);
            cJSON_Delete(o);
            rc = -1;
            break;
        }
        double *g = realloc(w->counts, (size_t)(w->n + 1) * L * E * sizeof *g);
        if (!g) {
            cJSON_Delete(o);
            rc = -1;
            break;
        }
        w->counts = g;
        w->n_layer = L;
        w->n_expert = E;
        double *c = w->counts + (size_t)w->n * L * E;
        int i = 0;
        const cJSON *v;
        cJSON_ArrayForEach(v, jt) c[i++] = cJSON_IsNumber(v) ? fmax(0, v->valuedouble) : 0;
        w->n++;
        cJSON_Delete(o);
        at = end;
    }
    free(text);
    if (!rc && w->n < 2) {
        fprintf(stderr,
                "sim-placement: %s: needs at least 2 windows (plan on one, score on "
                "the next)\n",
                path);
        rc = -1;
    }
    if (rc)
        windows_free(w);
    return rc;
}

static int write_trace(const char *path, const struct windows *w, int steps)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "sim-placement: %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t n = (size_t)w->n_layer * w->n_expert;
    for (int i = 0; i < w->n; i++) {
        fprintf(f,
                "{\"stats_layers\": %d, \"stats_experts\": %d, \"stats_steps\": %d, "
                "\"expert_tokens\": [",
                w->n_layer, w->n_expert, steps);
        for (size_t k = 0; k < n; k++)
            fprintf(f, "%s%.0f", k ? ", " : "", w->counts[(size_t)i * n + k]);
        fprintf(f, "]}\n");
    }
    return fclose(f) ? -1 : 0;
}

/* ---- the loop -------------------------------------------------------------------------- */

static int simulate(const struct sim_opts *o, const struct windows *w, struct sim_result *res)
{
    struct moe_error err = {0};
    int L = w->n_layer, E = w->n_expert, N = o->n_rank;
    struct moe_placement cur = {0}, dflt = {0};
    double *rl = malloc((size_t)L * N * sizeof *rl);
    memset(res, 0, sizeof *res);
    if (!rl || moe_placement_default(L, E, N, &cur, &err) ||
        moe_placement_default(L, E, N, &dflt, &err)) {
        fprintf(stderr, "sim-placement: %s\n", err.msg[0] ? err.msg : "out of memory");
        free(rl);
        moe_placement_free(&cur);
        return -1;
    }
    struct planner_params pp = {.n_redundant = o->n_redundant, .keep_tolerance = o->tolerance};
    double t_plan = 0, later = 0;
    int n_later = 0;
    size_t stride = (size_t)L * E;
    for (int i = 0; i + 1 < w->n; i++) {
        struct planner_result r;
        double t0 = moe_now();
        if (planner_plan(&pp, &cur, w->counts + (size_t)i * stride, &r, &err)) {
            fprintf(stderr, "sim-placement: %d experts on %d ranks, redundant %d: %s\n", E, N,
                    o->n_redundant, err.msg);
            free(rl);
            moe_placement_free(&cur);
            moe_placement_free(&dflt);
            return -1;
        }
        t_plan += moe_now() - t0;
        if (i == 0) {
            res->moves_first = r.n_moves;
        } else {
            later += r.n_moves;
            n_later++;
        }
        res->slots = r.slots_per_rank;
        res->imb_predicted += r.imbalance_after;
        const double *next = w->counts + (size_t)(i + 1) * stride;
        planner_predict(&r.map, next, rl);
        res->imb_next += planner_imbalance(rl, L, N);
        planner_predict(&dflt, next, rl);
        res->imb_default += planner_imbalance(rl, L, N);
        moe_placement_free(&cur);
        cur = r.map; /* the plan is installed */
        memset(&r.map, 0, sizeof r.map);
        planner_result_free(&r);
        res->n_scored++;
    }
    int k = res->n_scored ? res->n_scored : 1;
    res->imb_default /= k;
    res->imb_predicted /= k;
    res->imb_next /= k;
    res->moves_later = n_later ? later / n_later : 0;
    res->plan_ms = 1e3 * t_plan / k;
    free(rl);
    moe_placement_free(&cur);
    moe_placement_free(&dflt);
    return 0;
}

static void print_header(void)
{
    printf("%-10s %6s %4s %5s %5s %6s | %8s %9s %9s | %7s %7s | %8s\n", "size", "layers", "R",
           "slots", "zipf", "drift", "default", "predicted", "next win", "moves1", "moves+",
           "plan ms");
}

static void print_row(const struct sim_opts *o, const struct windows *w, const struct sim_result *r)
{
    char size[32];
    snprintf(size, sizeof size, "%de/%dr", w->n_expert, o->n_rank);
    char zipf[16];
    if (o->trace)
        snprintf(zipf, sizeof zipf, "trace");
    else
        snprintf(zipf, sizeof zipf, "%.1f", o->zipf);
    printf("%-10s %6d %4d %5d %5s %6.2f | %8.3f %9.3f %9.3f | %7d %7.1f | %8.2f\n", size,
           w->n_layer, o->n_redundant, r->slots, zipf, o->trace ? 0.0 : o->drift, r->imb_default,
           r->imb_predicted, r->imb_next, r->moves_first, r->moves_later, r->plan_ms);
    fflush(stdout);
}

static int run_one(const struct sim_opts *o)
{
    struct windows w = {0};
    if (o->trace ? read_trace(o->trace, &w) : synth(o, &w)) {
        windows_free(&w);
        return 1;
    }
    if (o->write_trace && write_trace(o->write_trace, &w, o->steps)) {
        windows_free(&w);
        return 1;
    }
    struct sim_result r;
    int rc = simulate(o, &w, &r);
    if (!rc)
        print_row(o, &w, &r);
    windows_free(&w);
    return rc ? 1 : 0;
}

/* The preset sizes: the issue's (64 experts on 8 ranks; 256 on 64 with 32
 * redundant) and neighbours (Mixtral-like 8e, Qwen3-235B-like 128e,
 * DeepSeek-V3-like 256e on 32 ranks). */
static const struct {
    int e, n, r;
    double zipf;
} PRESETS[] = {
    {8, 2, 0, 1.0},     {8, 2, 2, 1.0},     {64, 8, 0, 1.0},    {64, 8, 8, 0.8},
    {64, 8, 8, 1.0},    {64, 8, 8, 1.2},    {64, 8, 16, 1.0},   {128, 16, 16, 1.0},
    {256, 32, 32, 1.0}, {256, 64, 32, 0.8}, {256, 64, 32, 1.0}, {256, 64, 64, 1.0},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: sim-placement [--experts E --ranks N] [--redundant R] [--layers L] "
               "[--zipf S]\n"
               "                     [--tokens T] [--steps K] [--windows W] [--drift D] "
               "[--seed X]\n"
               "                     [--tolerance T] [--write-trace FILE]\n"
               "       sim-placement --trace FILE --ranks N [--redundant R] [--tolerance T]\n"
               "with no size: every preset size. Reports imbalance (busiest rank / mean, "
               "summed over layers)\nbefore and after planning, and replicas moved per "
               "replan.\n");
}

int main(int argc, char **argv)
{
    struct sim_opts o = {.n_layer = 16,
                         .zipf = 1.0,
                         .tokens = 1024,
                         .steps = 8,
                         .windows = 6,
                         .drift = 0.05,
                         .seed = 1,
                         .tolerance = 0.05};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "sim-placement: option '%s' needs a value\n", k);
            return 2;
        }
        const char *v = argv[++i];
        char *end;
        double x = strtod(v, &end);
        bool num = *v && !*end;
        if (!strcmp(k, "--trace"))
            o.trace = v;
        else if (!strcmp(k, "--write-trace"))
            o.write_trace = v;
        else if (!num) {
            fprintf(stderr, "sim-placement: %s: '%s' is not a number\n", k, v);
            return 2;
        } else if (!strcmp(k, "--experts") && x >= 1 && x <= 65536)
            o.n_expert = (int)x;
        else if (!strcmp(k, "--ranks") && x >= 1 && x <= 32767)
            o.n_rank = (int)x;
        else if (!strcmp(k, "--redundant") && x >= 0 && x <= 1e6)
            o.n_redundant = (int)x;
        else if (!strcmp(k, "--layers") && x >= 1 && x <= 1024)
            o.n_layer = (int)x;
        else if (!strcmp(k, "--zipf") && x >= 0 && x <= 10)
            o.zipf = x;
        else if (!strcmp(k, "--tokens") && x >= 1 && x <= 1e7)
            o.tokens = (int)x;
        else if (!strcmp(k, "--steps") && x >= 1 && x <= 1e6)
            o.steps = (int)x;
        else if (!strcmp(k, "--windows") && x >= 2 && x <= 1e4)
            o.windows = (int)x;
        else if (!strcmp(k, "--drift") && x >= 0 && x <= 100)
            o.drift = x;
        else if (!strcmp(k, "--seed") && x >= 0)
            o.seed = (uint64_t)x;
        else if (!strcmp(k, "--tolerance") && x >= 0 && x <= 10)
            o.tolerance = x;
        else {
            usage(stderr);
            fprintf(stderr, "sim-placement: unknown option or value out of range: %s %s\n", k, v);
            return 2;
        }
    }
    if (o.trace && !o.n_rank) {
        fprintf(stderr, "sim-placement: --trace needs --ranks N\n");
        return 2;
    }
    if (!o.trace && !o.n_expert != !o.n_rank) {
        fprintf(stderr, "sim-placement: give both --experts and --ranks (or neither: presets)\n");
        return 2;
    }
    print_header();
    if (o.trace || o.n_expert)
        return run_one(&o);
    int rc = 0;
    for (size_t i = 0; i < sizeof PRESETS / sizeof PRESETS[0]; i++) {
        struct sim_opts p = o;
        p.n_expert = PRESETS[i].e;
        p.n_rank = PRESETS[i].n;
        p.n_redundant = PRESETS[i].r;
        p.zipf = PRESETS[i].zipf;
        rc |= run_one(&p);
    }
    return rc;
}
