/* compare-logits: checks `moe-generate --logits-out` output against the
 * golden fixtures (tests/golden), for runs on a device the golden test
 * driver does not create (bench/gpu_check.sh runs it with --device cuda).
 *
 *   compare-logits --ids FIXTURE_DIR P          prints prompt P's ids "1,2,3"
 *   compare-logits --greedy FIXTURE_DIR DTYPE P prints its greedy path "5 6 7"
 *   compare-logits FIXTURE_DIR DTYPE P FILE     compares FILE (raw f32 rows,
 *       one per prompt position) with logits_DTYPE.bin prompt P: prints
 *       max|ours - ref| / max|ref| and exits 0 when <= 1e-4 (the golden
 *       test's tolerance), 1 otherwise, 2 on bad input.
 *   compare-logits --fast FIXTURE_DIR DTYPE P FILE   the same for a run with
 *       bf16 activations (fast matmuls): the error of each position's logits
 *       (max|ours - ref| / max|ref| of its row), held as test_golden's
 *       bf16fast mode holds the CPU's fast paths: median <= 2e-2 and 75th
 *       percentile <= 1e-1 (a few positions of the tiny random fixtures flip
 *       an expert choice under any rounding of the activations).
 *
 * MOELOGIT format (tests/golden/README.md): "MOELOGIT", u32 version 1,
 * u32 n_prompts, then per prompt u32 n_pos, u32 vocab, n_pos x vocab f32 LE. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LOGIT_TOL 1e-4
#define FAST_TOL_MEDIAN 2e-2
#define FAST_TOL_P75 1e-1

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1))) {
            if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
                free(buf);
                buf = NULL;
            } else {
                buf[n] = '\0';
                *len = (size_t)n;
            }
        }
    }
    fclose(f);
    return buf;
}

static uint32_t rd_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The `prompts[p]` object of FIXTURE/golden.json, or NULL (message printed). */
static cJSON *golden_prompt(const char *dir, int p, cJSON **root)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/golden.json", dir);
    size_t len = 0;
    char *text = read_file(path, &len);
    if (!text) {
        fprintf(stderr, "compare-logits: cannot read %s\n", path);
        return NULL;
    }
    *root = cJSON_Parse(text);
    free(text);
    cJSON *prompts = cJSON_GetObjectItemCaseSensitive(*root, "prompts");
    cJSON *pr = cJSON_GetArrayItem(prompts, p);
    if (!pr)
        fprintf(stderr, "compare-logits: %s: no prompt %d\n", path, p);
    return pr;
}

static int print_array(const char *dir, int p, const char *key, const char *sep)
{
    cJSON *root = NULL;
    cJSON *pr = golden_prompt(dir, p, &root);
    cJSON *arr = pr ? cJSON_GetObjectItemCaseSensitive(pr, key) : NULL;
    if (!cJSON_IsArray(arr)) {
        fprintf(stderr, "compare-logits: %s/golden.json prompt %d: no array '%s'\n", dir, p, key);
        cJSON_Delete(root);
        return 2;
    }
    int i = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, arr) printf("%s%d", i++ ? sep : "", (int)v->valuedouble);
    printf("\n");
    cJSON_Delete(root);
    return 0;
}

/* Per-position errors of n_pos rows of `vocab` logits (ours against the
 * little-endian f32 rows at ref): median and 75th percentile into med, p75,
 * the largest into worst. A NaN counts as the largest error. */
static void position_errors(const float *ours, const unsigned char *ref, uint32_t n_pos,
                            uint32_t vocab, double *med, double *p75, double *worst)
{
    double *e = calloc(n_pos ? n_pos : 1, sizeof *e);
    for (uint32_t t = 0; t < n_pos; t++) {
        double num = 0.0, den = 1e-30;
        for (uint32_t v = 0; v < vocab; v++) {
            size_t k = (size_t)t * vocab + v;
            float r;
            memcpy(&r, ref + 4 * k, 4);
            double d = fabs((double)ours[k] - r);
            if (d != d)
                d = INFINITY;
            if (d > num)
                num = d;
            if (fabs(r) > den)
                den = fabs(r);
        }
        e[t] = num / den;
    }
    qsort(e, n_pos, sizeof *e, cmp_double);
    *med = n_pos ? e[n_pos / 2] : 0.0;
    *p75 = n_pos ? e[(size_t)n_pos * 3 / 4] : 0.0;
    *worst = n_pos ? e[n_pos - 1] : 0.0;
    free(e);
}

static int compare(const char *dir, const char *dtype, int p, const char *ours_path, bool fast)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/logits_%s.bin", dir, dtype);
    size_t len = 0, olen = 0;
    unsigned char *ref = (unsigned char *)read_file(path, &len);
    float *ours = (float *)read_file(ours_path, &olen);
    int rc = 2;
    if (!ref || !ours) {
        fprintf(stderr, "compare-logits: cannot read %s\n", !ref ? path : ours_path);
        goto out;
    }
    if (len < 16 || memcmp(ref, "MOELOGIT", 8) != 0 || rd_u32(ref + 8) != 1) {
        fprintf(stderr, "compare-logits: %s: not a MOELOGIT v1 file\n", path);
        goto out;
    }
    uint32_t n_prompts = rd_u32(ref + 12);
    size_t off = 16;
    for (uint32_t i = 0; i < n_prompts; i++) {
        if (off + 8 > len)
            break;
        uint32_t n_pos = rd_u32(ref + off), vocab = rd_u32(ref + off + 4);
        size_t n = (size_t)n_pos * vocab;
        off += 8;
        if (off + n * 4 > len)
            break;
        if ((int)i == p) {
            if (olen != n * 4) {
                fprintf(stderr, "compare-logits: %s holds %zu bytes, expected %u x %u f32\n",
                        ours_path, olen, n_pos, vocab);
                goto out;
            }
            if (fast) {
                double med, p75, worst;
                position_errors(ours, ref + off, n_pos, vocab, &med, &p75, &worst);
                rc = med <= FAST_TOL_MEDIAN && p75 <= FAST_TOL_P75 ? 0 : 1;
                printf("%s %s prompt %d (fast): %u positions, per-position rel err median %.3g "
                       "(tol %.0e), 75th percentile %.3g (tol %.0e), worst %.3g %s\n",
                       dir, dtype, p, n_pos, med, FAST_TOL_MEDIAN, p75, FAST_TOL_P75, worst,
                       rc ? "FAIL" : "ok");
                goto out;
            }
            double num = 0.0, den = 1e-30;
            for (size_t k = 0; k < n; k++) {
                float r;
                memcpy(&r, ref + off + 4 * k, 4);
                double e = fabs((double)ours[k] - r);
                if (!(e <= num))
                    num = e; /* NaN propagates */
                if (fabs(r) > den)
                    den = fabs(r);
            }
            double err = num / den;
            rc = err <= LOGIT_TOL ? 0 : 1;
            printf("%s %s prompt %d: %u positions, max rel err %.3g (tol %.0e) %s\n", dir, dtype, p,
                   n_pos, err, LOGIT_TOL, rc ? "FAIL" : "ok");
            goto out;
        }
        off += n * 4;
    }
    fprintf(stderr, "compare-logits: %s: no prompt %d (or truncated)\n", path, p);
out:
    free(ref);
    free(ours);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "--ids") == 0)
        return print_array(argv[2], atoi(argv[3]), "ids", ",");
    if (argc == 5 && strcmp(argv[1], "--greedy") == 0) {
        char key[64];
        snprintf(key, sizeof key, "greedy_%s", argv[3]);
        return print_array(argv[2], atoi(argv[4]), key, " ");
    }
    if (argc == 5)
        return compare(argv[1], argv[2], atoi(argv[3]), argv[4], false);
    if (argc == 6 && strcmp(argv[1], "--fast") == 0)
        return compare(argv[2], argv[3], atoi(argv[4]), argv[5], true);
    fprintf(stderr, "usage: compare-logits --ids DIR P | --greedy DIR DTYPE P | DIR DTYPE P FILE | "
                    "--fast DIR DTYPE P FILE\n");
    return 2;
}
