/* Line charts with cairo (plot.h). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cairo.h>
#include <fontconfig/fontconfig.h>

#include "plot.h"

#define W 960
#define H 600
#define ML 90 /* margins: left, right (wider with a right axis), top, bottom */
#define MR 40
#define MR2 90
#define MT 60
#define MB 70

static const double palette[][3] = {
    {0.12, 0.47, 0.71}, {1.00, 0.50, 0.05}, {0.17, 0.63, 0.17}, {0.84, 0.15, 0.16},
    {0.58, 0.40, 0.74}, {0.55, 0.34, 0.29}, {0.89, 0.47, 0.76}, {0.50, 0.50, 0.50},
    {0.74, 0.74, 0.13}, {0.09, 0.75, 0.81},
};
#define N_COLORS (int)(sizeof palette / sizeof palette[0])

/* Round-number ticks over [lo, hi]: step 1, 2 or 5 x 10^k, about 6 of them. */
static double nice_step(double span)
{
    if (!(span > 0))
        return 1;
    double raw = span / 6, p = pow(10, floor(log10(raw))), f = raw / p;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * p;
}

static void range_of(const struct plot_series *s, int n, bool right, bool use_x, double *lo,
                     double *hi)
{
    *lo = INFINITY;
    *hi = -INFINITY;
    for (int i = 0; i < n; i++) {
        if (!use_x && s[i].right != right)
            continue;
        const double *v = use_x ? s[i].x : s[i].y;
        for (size_t k = 0; k < s[i].n; k++)
            if (isfinite(v[k])) {
                *lo = fmin(*lo, v[k]);
                *hi = fmax(*hi, v[k]);
            }
    }
    if (!isfinite(*lo)) {
        *lo = 0;
        *hi = 1;
    }
    if (*hi <= *lo) {
        double d = fabs(*lo) > 0 ? fabs(*lo) * 0.1 : 1;
        *lo -= d;
        *hi += d;
    }
}

/* Expands [lo, hi] to whole ticks; returns the step. */
static double axis_fit(double *lo, double *hi, bool from_zero)
{
    if (from_zero && *lo > 0)
        *lo = 0;
    double step = nice_step(*hi - *lo);
    *lo = floor(*lo / step) * step;
    *hi = ceil(*hi / step) * step;
    if (*hi <= *lo)
        *hi = *lo + step;
    return step;
}

static void fmt_tick(char *buf, size_t cap, double v, double step)
{
    if (fabs(v) < step * 1e-6)
        v = 0;
    if (step >= 1 || v == 0)
        snprintf(buf, cap, "%.0f", v);
    else {
        int dec = (int)ceil(-log10(step));
        snprintf(buf, cap, "%.*f", dec, v);
    }
}

static void text_at(cairo_t *cr, double x, double y, const char *s, double ax, double ay)
{
    cairo_text_extents_t e;
    cairo_text_extents(cr, s, &e);
    cairo_move_to(cr, x - e.width * ax - e.x_bearing, y - e.height * ay - e.y_bearing);
    cairo_show_text(cr, s);
}

enum moe_status plot_lines(const char *path, const struct plot_spec *spec,
                           const struct plot_series *s, int n_series, struct moe_error *err)
{
    cairo_surface_t *surf = cairo_image_surface_create(CAIRO_FORMAT_RGB24, W, H);
    if (cairo_surface_status(surf) != CAIRO_STATUS_SUCCESS) {
        cairo_surface_destroy(surf);
        return moe_error_set(err, MOE_ERR_NOMEM, "%s: cannot make an image", path);
    }
    cairo_t *cr = cairo_create(surf);
    bool y2 = spec->y2label != NULL;
    double x0 = ML, x1 = W - (y2 ? MR2 : MR), y0 = H - MB, y1 = MT;
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_paint(cr);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);

    double xl, xh, yl, yh, zl = 0, zh = 1;
    range_of(s, n_series, false, true, &xl, &xh);
    range_of(s, n_series, false, false, &yl, &yh);
    for (int i = 0; i < n_series; i++)
        if (s[i].point_labels) { /* room for the labels right of the points */
            xh += (xh - xl) * 0.15;
            yh += (yh - yl) * 0.05;
            break;
        }
    if (spec->cdf) {
        yl = 0;
        yh = 1;
    } else {
        yh += (yh - (spec->y_from_zero && yl > 0 ? 0 : yl)) * 0.15; /* room for the legend */
    }
    double xs = axis_fit(&xl, &xh, spec->y_from_zero);
    double ys = axis_fit(&yl, &yh, spec->y_from_zero);
    double zs = 1;
    if (y2) {
        range_of(s, n_series, true, false, &zl, &zh);
        zh += (zh - (zl > 0 ? 0 : zl)) * 0.15;
        zs = axis_fit(&zl, &zh, true);
    }
#define PX(v) (x0 + ((v)-xl) / (xh - xl) * (x1 - x0))
#define PY(v) (y0 - ((v)-yl) / (yh - yl) * (y0 - y1))
#define PZ(v) (y0 - ((v)-zl) / (zh - zl) * (y0 - y1))

    /* grid and ticks */
    char buf[64];
    cairo_set_font_size(cr, 13);
    cairo_set_line_width(cr, 1);
    for (double v = xl; v <= xh + xs * 1e-9; v += xs) {
        cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
        cairo_move_to(cr, PX(v), y0);
        cairo_line_to(cr, PX(v), y1);
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
        fmt_tick(buf, sizeof buf, v, xs);
        text_at(cr, PX(v), y0 + 8, buf, 0.5, 0);
    }
    for (double v = yl; v <= yh + ys * 1e-9; v += ys) {
        cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
        cairo_move_to(cr, x0, PY(v));
        cairo_line_to(cr, x1, PY(v));
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
        fmt_tick(buf, sizeof buf, v, ys);
        text_at(cr, x0 - 8, PY(v), buf, 1, 0.5);
    }
    if (y2)
        for (double v = zl; v <= zh + zs * 1e-9; v += zs) {
            fmt_tick(buf, sizeof buf, v, zs);
            text_at(cr, x1 + 8, PZ(v), buf, 0, 0.5);
        }
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    cairo_set_line_width(cr, 1.2);
    cairo_rectangle(cr, x0, y1, x1 - x0, y0 - y1);
    cairo_stroke(cr);

    /* labels */
    cairo_set_font_size(cr, 15);
    text_at(cr, (x0 + x1) / 2, H - 22, spec->xlabel, 0.5, 0.5);
    cairo_save(cr);
    cairo_translate(cr, 24, (y0 + y1) / 2);
    cairo_rotate(cr, -M_PI / 2);
    text_at(cr, 0, 0, spec->ylabel, 0.5, 0.5);
    cairo_restore(cr);
    if (y2) {
        cairo_save(cr);
        cairo_translate(cr, W - 22, (y0 + y1) / 2);
        cairo_rotate(cr, M_PI / 2);
        text_at(cr, 0, 0, spec->y2label, 0.5, 0.5);
        cairo_restore(cr);
    }
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
    cairo_set_font_size(cr, 18);
    text_at(cr, W / 2.0, 28, spec->title, 0.5, 0.5);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);

    /* series, clipped to the plot area */
    cairo_save(cr);
    cairo_rectangle(cr, x0, y1, x1 - x0, y0 - y1);
    cairo_clip(cr);
    cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
    for (int i = 0; i < n_series; i++) {
        const double *c = palette[i % N_COLORS];
        cairo_set_source_rgb(cr, c[0], c[1], c[2]);
        cairo_set_line_width(cr, 2.2);
        if (s[i].right)
            cairo_set_dash(cr, (const double[]){7, 4}, 2, 0);
        else
            cairo_set_dash(cr, NULL, 0, 0);
        bool pen = false;
        for (size_t k = 0; k < s[i].n; k++) {
            if (!isfinite(s[i].x[k]) || !isfinite(s[i].y[k])) {
                pen = false;
                continue;
            }
            double px = PX(s[i].x[k]), py = s[i].right ? PZ(s[i].y[k]) : PY(s[i].y[k]);
            if (pen)
                cairo_line_to(cr, px, py);
            else
                cairo_move_to(cr, px, py);
            pen = true;
        }
        cairo_stroke(cr);
        cairo_set_dash(cr, NULL, 0, 0);
        if (s[i].markers)
            for (size_t k = 0; k < s[i].n; k++) {
                double px = PX(s[i].x[k]), py = s[i].right ? PZ(s[i].y[k]) : PY(s[i].y[k]);
                cairo_arc(cr, px, py, 4.5, 0, 2 * M_PI);
                cairo_fill(cr);
                if (s[i].point_labels && s[i].point_labels[k]) {
                    cairo_set_font_size(cr, 12);
                    cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
                    text_at(cr, px + 7, py - 7, s[i].point_labels[k], 0, 1);
                    cairo_set_source_rgb(cr, c[0], c[1], c[2]);
                }
            }
    }
    cairo_restore(cr);

    /* legend, top left inside the plot */
    if (n_series > 1 || (n_series == 1 && s[0].name && s[0].name[0])) {
        cairo_set_font_size(cr, 13);
        double lw = 0;
        for (int i = 0; i < n_series; i++) {
            cairo_text_extents_t e;
            cairo_text_extents(cr, s[i].name ? s[i].name : "", &e);
            lw = fmax(lw, e.x_advance);
        }
        double bh = 20.0 * n_series + 10;
        double bx = spec->cdf ? x1 - 12 - (lw + 52) : x0 + 12;
        double by = spec->cdf ? y0 - 12 - bh : y1 + 12;
        cairo_set_source_rgba(cr, 1, 1, 1, 0.85);
        cairo_rectangle(cr, bx, by, lw + 52, bh);
        cairo_fill_preserve(cr);
        cairo_set_source_rgb(cr, 0.7, 0.7, 0.7);
        cairo_set_line_width(cr, 1);
        cairo_stroke(cr);
        for (int i = 0; i < n_series; i++) {
            const double *c = palette[i % N_COLORS];
            double ly = by + 15 + 20.0 * i;
            cairo_set_source_rgb(cr, c[0], c[1], c[2]);
            cairo_set_line_width(cr, 2.2);
            if (s[i].right)
                cairo_set_dash(cr, (const double[]){7, 4}, 2, 0);
            cairo_move_to(cr, bx + 8, ly);
            cairo_line_to(cr, bx + 36, ly);
            cairo_stroke(cr);
            cairo_set_dash(cr, NULL, 0, 0);
            cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
            text_at(cr, bx + 44, ly, s[i].name ? s[i].name : "", 0, 0.5);
        }
    }
#undef PX
#undef PY
#undef PZ
    cairo_destroy(cr);
    cairo_status_t cs = cairo_surface_write_to_png(surf, path);
    cairo_surface_destroy(surf);
    if (cs != CAIRO_STATUS_SUCCESS)
        return moe_error_set(err, MOE_ERR_IO, "%s: cannot write the PNG: %s", path,
                             cairo_status_to_string(cs));
    return MOE_OK;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* CDF of v (n values, ms) as at most 2000 points: sorted x, y = rank / n. */
static enum moe_status cdf_of(double *v, size_t n, double **xs, double **ys, size_t *np)
{
    qsort(v, n, sizeof(double), cmp_double);
    size_t m = n < 2000 ? n : 2000;
    *xs = malloc((m + 1) * sizeof(double));
    *ys = malloc((m + 1) * sizeof(double));
    if (!*xs || !*ys)
        return MOE_ERR_NOMEM;
    size_t k = 0;
    if (n) {
        (*xs)[k] = v[0];
        (*ys)[k++] = 0;
    }
    for (size_t i = 0; i < m; i++) {
        size_t j = m == n ? i : (size_t)((double)(i + 1) / (double)m * (double)n) - 1;
        (*xs)[k] = v[j];
        (*ys)[k++] = (double)(j + 1) / (double)n;
    }
    *np = k;
    return MOE_OK;
}

enum cdf_kind { CDF_TTFT, CDF_ITL };

static enum moe_status plot_cdf(const char *dir, const struct plot_run *runs, int n_runs,
                                enum cdf_kind kind, struct moe_error *err)
{
    struct plot_series *s = calloc((size_t)n_runs, sizeof(*s));
    double **xs = calloc((size_t)n_runs, sizeof(double *)),
           **ys = calloc((size_t)n_runs, sizeof(double *));
    enum moe_status st = MOE_OK;
    if (!s || !xs || !ys) {
        st = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int r = 0; r < n_runs; r++) {
        size_t n = 0;
        for (size_t i = 0; i < runs[r].n; i++)
            if (runs[r].recs[i].success)
                n +=
                    kind == CDF_TTFT
                        ? 1
                        : (size_t)(runs[r].recs[i].n_chunks > 1 ? runs[r].recs[i].n_chunks - 1 : 0);
        double *v = malloc((n ? n : 1) * sizeof(double));
        if (!v) {
            st = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
            goto done;
        }
        size_t k = 0;
        for (size_t i = 0; i < runs[r].n; i++) {
            const struct bench_record *rec = &runs[r].recs[i];
            if (!rec->success)
                continue;
            if (kind == CDF_TTFT)
                v[k++] = rec->ttft_s * 1e3;
            else
                for (int c = 1; c < rec->n_chunks; c++)
                    v[k++] = (rec->chunk_t[c] - rec->chunk_t[c - 1]) * 1e3;
        }
        size_t np = 0;
        st = cdf_of(v, k, &xs[r], &ys[r], &np);
        free(v);
        if (st) {
            moe_error_set(err, st, "out of memory");
            goto done;
        }
        s[r] = (struct plot_series){.name = runs[r].name, .x = xs[r], .y = ys[r], .n = np};
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, kind == CDF_TTFT ? "ttft_cdf.png" : "itl_cdf.png");
    struct plot_spec spec = {
        .title = kind == CDF_TTFT ? "Time to first token (CDF)" : "Inter-token latency (CDF)",
        .xlabel = kind == CDF_TTFT ? "TTFT (ms)" : "ITL (ms)",
        .ylabel = "fraction of requests at or below",
        .y_from_zero = true,
        .cdf = true,
    };
    if (kind == CDF_ITL)
        spec.ylabel = "fraction of token gaps at or below";
    st = plot_lines(path, &spec, s, n_runs, err);
done:
    if (xs && ys)
        for (int r = 0; r < n_runs; r++) {
            free(xs[r]);
            free(ys[r]);
        }
    free(xs);
    free(ys);
    free(s);
    return st;
}

static enum moe_status plot_timeline(const char *dir, const struct plot_run *run, int idx,
                                     bool numbered, struct moe_error *err)
{
    double dur = run->m->duration_s > 0 ? run->m->duration_s : 1;
    double bin = dur <= 60 ? 1.0 : dur / 60;
    if (dur < 10)
        bin = dur / 10;
    double *tok = NULL, *conc = NULL;
    size_t nb = 0;
    if (bench_timeline(run->recs, run->n, dur, bin, &tok, &conc, &nb))
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    double *t = malloc(nb * sizeof(double));
    if (!t) {
        free(tok);
        free(conc);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    for (size_t k = 0; k < nb; k++)
        t[k] = ((double)k + 0.5) * bin;
    struct plot_series s[2] = {
        {.name = "output tokens/s", .x = t, .y = tok, .n = nb},
        {.name = "requests in flight (right axis)", .x = t, .y = conc, .n = nb, .right = true},
    };
    char path[4096], title[160];
    if (numbered)
        snprintf(path, sizeof path, "%s/throughput_%d.png", dir, idx + 1);
    else
        snprintf(path, sizeof path, "%s/throughput.png", dir);
    snprintf(title, sizeof title, "Throughput and concurrency over time%s%s",
             run->name[0] ? ", " : "", run->name);
    struct plot_spec spec = {.title = title,
                             .xlabel = "time since start (s)",
                             .ylabel = "output tokens/s",
                             .y2label = "requests in flight",
                             .y_from_zero = true};
    enum moe_status st = plot_lines(path, &spec, s, 2, err);
    free(t);
    free(tok);
    free(conc);
    return st;
}

static enum moe_status plot_sweep(const char *dir, const struct plot_run *runs, int n_runs,
                                  struct moe_error *err)
{
    double *x = malloc((size_t)n_runs * sizeof(double)),
           *y = malloc((size_t)n_runs * sizeof(double));
    const char **labels = calloc((size_t)n_runs, sizeof(char *));
    if (!x || !y || !labels) {
        free(x);
        free(y);
        free(labels);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    for (int r = 0; r < n_runs; r++) {
        x[r] = runs[r].m->mean_user_tok_s;
        y[r] = runs[r].m->output_throughput;
        labels[r] = runs[r].name;
    }
    struct plot_series s = {
        .name = "", .x = x, .y = y, .n = (size_t)n_runs, .markers = true, .point_labels = labels};
    char path[4096];
    snprintf(path, sizeof path, "%s/sweep.png", dir);
    struct plot_spec spec = {.title = "Throughput against per-user speed",
                             .xlabel = "per-user speed: mean (output - 1) / (E2EL - TTFT), tok/s",
                             .ylabel = "output throughput (tok/s)",
                             .y_from_zero = true};
    enum moe_status st = plot_lines(path, &spec, &s, 1, err);
    free(x);
    free(y);
    free(labels);
    return st;
}

enum moe_status plot_runs(const char *dir, const struct plot_run *runs, int n_runs,
                          struct moe_error *err)
{
    if (mkdir(dir, 0777) && errno != EEXIST)
        return moe_error_set(err, MOE_ERR_IO, "--plot %s: cannot make the folder: %s", dir,
                             strerror(errno));
    enum moe_status st = plot_cdf(dir, runs, n_runs, CDF_TTFT, err);
    if (!st)
        st = plot_cdf(dir, runs, n_runs, CDF_ITL, err);
    for (int r = 0; r < n_runs && !st; r++)
        st = plot_timeline(dir, &runs[r], r, n_runs > 1, err);
    if (!st && n_runs > 1)
        st = plot_sweep(dir, runs, n_runs, err);
    return st;
}

void plot_shutdown(void)
{
    cairo_debug_reset_static_data();
    FcFini();
}
