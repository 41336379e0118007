/* PNG line charts drawn with cairo (libcairo2): axes with round-number
 * ticks, grid, title, axis labels, a legend, an optional right-hand axis.
 * Why cairo: it is a C library that writes PNG itself (no external program
 * to find and drive, as gnuplot would be), it is in Debian, and its toy
 * text API with the DejaVu fonts is enough for labels. */
#ifndef MOE_BENCH_PLOT_H
#define MOE_BENCH_PLOT_H

#include <stdbool.h>
#include <stddef.h>

#include "metrics.h"

struct plot_series {
    const char *name;
    const double *x, *y; /* (n) */
    size_t n;
    bool markers;                    /* dots at the points (and labels from point_labels) */
    bool right;                      /* against the right-hand axis */
    const char *const *point_labels; /* (n) or NULL */
};

struct plot_spec {
    const char *title, *xlabel, *ylabel, *y2label; /* y2label: NULL = no right axis */
    bool y_from_zero;
    bool cdf; /* y fixed to [0, 1], legend bottom right; else headroom above the data */
};

/* Writes a 960x600 PNG to path. */
enum moe_status plot_lines(const char *path, const struct plot_spec *spec,
                           const struct plot_series *s, int n_series, struct moe_error *err);

/* One run of a sweep (or the only run) as the charts need it. */
struct plot_run {
    const char *name; /* "rate 4/s" */
    const struct bench_record *recs;
    size_t n;
    const struct bench_metrics *m;
};

/* Writes DIR/ttft_cdf.png, DIR/itl_cdf.png, DIR/throughput[_N].png per run
 * and, with >= 2 runs, DIR/sweep.png (output throughput against mean
 * per-user speed). Creates DIR if needed. */
enum moe_status plot_runs(const char *dir, const struct plot_run *runs, int n_runs,
                          struct moe_error *err);

/* Frees cairo's and fontconfig's process-wide font caches (so a leak
 * checker sees none). Call once, at exit, after the last plot. */
void plot_shutdown(void);

#endif
