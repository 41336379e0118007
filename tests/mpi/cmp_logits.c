/* cmp-logits A B TOL: compares two raw float32 logit files (moe-generate
 * --logits-out) and fails when max|a - b| / max|b| > TOL or the sizes differ.
 * Prints the relative error. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static float *read_all(const char *path, long *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    float *v = malloc((size_t)bytes + 4);
    *n = bytes / 4;
    if (!v || fread(v, 4, (size_t)*n, f) != (size_t)*n) {
        fprintf(stderr, "%s: read failed\n", path);
        free(v);
        v = NULL;
    }
    fclose(f);
    return v;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: cmp-logits A B TOL\n");
        return 2;
    }
    long na, nb;
    float *a = read_all(argv[1], &na), *b = read_all(argv[2], &nb);
    if (!a || !b || na != nb || na == 0) {
        fprintf(stderr, "cmp-logits: %s has %ld values, %s has %ld\n", argv[1], a ? na : -1,
                argv[2], b ? nb : -1);
        return 1;
    }
    double md = 0, mb = 0;
    for (long i = 0; i < na; i++) {
        double d = fabs((double)a[i] - b[i]);
        md = d > md || isnan(d) ? (isnan(d) ? INFINITY : d) : md;
        mb = fabs(b[i]) > mb ? fabs(b[i]) : mb;
    }
    double rel = md / (mb > 0 ? mb : 1), tol = atof(argv[3]);
    printf("max rel err %.3g (tolerance %.1g) over %ld logits\n", rel, tol, na);
    free(a);
    free(b);
    return rel <= tol ? 0 : 1;
}
