/* moe-generate: offline runner. Loads a model, runs one prompt, prints the
 * generated ids, the text and the speed; optionally dumps the prompt logits.
 *
 *   moe-generate --model DIR (--prompt TEXT | --tokens 1,2,3) [-n N]
 *                [--temperature T] [--top-p P] [--top-k K] [--seed S]
 *                [--dtype f32|bf16] [--threads N] [--device auto|cpu|cuda]
 *                [--logits-out FILE] [--ignore-eos]
 */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "generate.h"
#include "model.h"
#include "tokenizer.h"

struct args {
    const char *model;
    const char *prompt;
    const char *tokens;
    const char *logits_out;
    const char *device;
    int n_predict;
    float temperature;
    float top_p;
    int top_k;
    unsigned long long seed;
    enum moe_dtype dtype;
    int threads;
    bool ignore_eos;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moe-generate --model DIR (--prompt TEXT | --tokens 1,2,3) [options]\n"
            "  -n N                tokens to generate (default 32)\n"
            "  --temperature T     0 = greedy (default 0)\n"
            "  --top-p P           nucleus sampling, (0, 1] (default 1)\n"
            "  --top-k K           keep the K most likely tokens, 0 = off (default 0)\n"
            "  --seed S            sampling seed (default 0)\n"
            "  --dtype f32|bf16    weight type in memory (default bf16)\n"
            "  --threads N         CPU threads, 0 = all cores (default 0)\n"
            "  --device D          auto|cpu|cuda (default auto)\n"
            "  --logits-out FILE   write prompt logits: f32 LE, one row of vocab_size per position\n"
            "  --ignore-eos        do not stop at an end-of-sequence token\n");
}

/* Prints "moe-generate: <message>" and returns the exit code for bad usage. */
__attribute__((format(printf, 1, 2))) static int fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moe-generate: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 2;
}

static bool parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

static bool parse_float(const char *s, float lo, float hi, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        return false;
    *out = v;
    return true;
}

static int parse_args(int argc, char **argv, struct args *a)
{
    *a = (struct args){.n_predict = 32, .top_p = 1.0f, .dtype = MOE_DTYPE_BF16, .device = "auto"};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            usage(stdout);
            exit(0);
        }
        if (!strcmp(k, "--ignore-eos")) {
            a->ignore_eos = true;
            continue;
        }
        if (i + 1 >= argc)
            return fail("option '%s' needs a value", k);
        const char *v = argv[++i];
        long n;
        if (!strcmp(k, "--model")) {
            a->model = v;
        } else if (!strcmp(k, "--prompt")) {
            a->prompt = v;
        } else if (!strcmp(k, "--tokens")) {
            a->tokens = v;
        } else if (!strcmp(k, "--logits-out")) {
            a->logits_out = v;
        } else if (!strcmp(k, "--device")) {
            a->device = v;
        } else if (!strcmp(k, "-n") || !strcmp(k, "--n-predict")) {
            if (!parse_long(v, 0, 1 << 20, &n))
                return fail("-n: '%s' is not a whole number in [0, 1048576]", v);
            a->n_predict = (int)n;
        } else if (!strcmp(k, "--temperature")) {
            if (!parse_float(v, 0.0f, 100.0f, &a->temperature))
                return fail("--temperature: '%s' is not a number in [0, 100]", v);
        } else if (!strcmp(k, "--top-p")) {
            if (!parse_float(v, 0.0f, 1.0f, &a->top_p) || a->top_p == 0.0f)
                return fail("--top-p: '%s' is not a number in (0, 1]", v);
        } else if (!strcmp(k, "--top-k")) {
            if (!parse_long(v, 0, INT_MAX, &n))
                return fail("--top-k: '%s' is not a whole number >= 0", v);
            a->top_k = (int)n;
        } else if (!strcmp(k, "--seed")) {
            char *end;
            errno = 0;
            a->seed = strtoull(v, &end, 10);
            if (errno || end == v || *end || *v == '-')
                return fail("--seed: '%s' is not a whole number >= 0", v);
        } else if (!strcmp(k, "--dtype")) {
            if (!strcmp(v, "f32"))
                a->dtype = MOE_DTYPE_F32;
            else if (!strcmp(v, "bf16"))
                a->dtype = MOE_DTYPE_BF16;
            else
                return fail("--dtype: '%s' is not one of f32, bf16", v);
        } else if (!strcmp(k, "--threads")) {
            if (!parse_long(v, 0, 1024, &n))
                return fail("--threads: '%s' is not a whole number in [0, 1024]", v);
            a->threads = (int)n;
        } else {
            usage(stderr);
            return fail("unknown option '%s'", k);
        }
    }
    if (!a->model)
        return fail("--model DIR is required");
    if (!a->prompt == !a->tokens)
        return fail("give exactly one of --prompt TEXT or --tokens IDS");
    return 0;
}

/* "1,2, 3" -> ids; every id must be a whole number in [0, vocab). */
static int parse_tokens(const char *s, int vocab, int32_t **out, int *n_out)
{
    size_t cap = 16, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids)
        return fail("out of memory");
    const char *p = s;
    while (*p) {
        while (*p == ' ' || *p == ',')
            p++;
        if (!*p)
            break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v >= vocab) {
            free(ids);
            return fail("--tokens: '%.20s' is not a token id in [0, %d)", p, vocab);
        }
        if (n == cap) {
            int32_t *grown = realloc(ids, (cap *= 2) * sizeof *ids);
            if (!grown) {
                free(ids);
                return fail("out of memory");
            }
            ids = grown;
        }
        ids[n++] = (int32_t)v;
        p = end;
        if (*p && *p != ',' && *p != ' ') {
            free(ids);
            return fail("--tokens: unexpected character in '%s'", s);
        }
    }
    if (!n) {
        free(ids);
        return fail("--tokens: no token ids in '%s'", s);
    }
    *out = ids;
    *n_out = (int)n;
    return 0;
}

static int write_logits(const char *path, const float *logits, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return fail("%s: %s", path, strerror(errno));
    size_t w = fwrite(logits, sizeof *logits, n, f);
    int close_rc = fclose(f);
    if (w != n || close_rc)
        return fail("%s: write failed: %s", path, strerror(errno));
    return 0;
}

int main(int argc, char **argv)
{
    struct args a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc;

    struct moe_error err = {0};
    struct moe_backend *be = NULL;
    struct moe_model *model = NULL;
    struct moe_tokenizer *tok = NULL;
    int32_t *prompt = NULL;
    float *logits = NULL;
    char *text = NULL;
    struct moe_gen_result res = {0};
    rc = 1;

    if (moe_backend_create(a.device, a.threads, &be, &err))
        goto fail;
    struct moe_model_opts mo = {.dtype = a.dtype, .tp_rank = 0, .tp_size = 1};
    double t_load = moe_now();
    if (moe_model_load(a.model, &mo, be, &model, &err))
        goto fail;
    t_load = moe_now() - t_load;
    const struct moe_config *cfg = moe_model_config(model);

    /* The tokenizer is optional with --tokens (random benchmark models have none). */
    char tok_path[4096];
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", a.model);
    FILE *probe = fopen(tok_path, "rb");
    if (probe || a.prompt) {
        if (probe)
            fclose(probe);
        if (moe_tokenizer_load(tok_path, &tok, &err))
            goto fail;
        if (moe_tokenizer_n_vocab(tok) > cfg->vocab_size) {
            moe_error_set(&err, MOE_ERR_FORMAT,
                          "%s: %d token ids but config.json vocab_size is %d", tok_path,
                          moe_tokenizer_n_vocab(tok), cfg->vocab_size);
            goto fail;
        }
    }

    int n_prompt = 0;
    if (a.prompt) {
        size_t n = 0;
        if (moe_tokenizer_encode(tok, a.prompt, strlen(a.prompt), true, &prompt, &n, &err))
            goto fail;
        if (n == 0) {
            moe_error_set(&err, MOE_ERR_INVALID, "--prompt: the prompt encodes to no tokens");
            goto fail;
        }
        n_prompt = (int)n;
    } else if ((rc = parse_tokens(a.tokens, cfg->vocab_size, &prompt, &n_prompt))) {
        goto out;
    }
    rc = 1;
    if (a.logits_out) {
        logits = malloc((size_t)n_prompt * (size_t)cfg->vocab_size * sizeof *logits);
        if (!logits) {
            moe_error_set(&err, MOE_ERR_NOMEM, "out of memory for %d rows of logits", n_prompt);
            goto fail;
        }
    }
    struct moe_gen_opts go = {
        .n_predict = a.n_predict,
        .sp = {.temperature = a.temperature, .top_p = a.top_p, .top_k = a.top_k},
        .seed = a.seed,
        .ignore_eos = a.ignore_eos,
    };
    if (moe_generate(model, prompt, n_prompt, &go, logits, &res, &err))
        goto fail;
    if (a.logits_out &&
        (rc = write_logits(a.logits_out, logits, (size_t)n_prompt * cfg->vocab_size)))
        goto out;

    printf("tokens:");
    for (int i = 0; i < res.n_tokens; i++)
        printf(" %d", res.tokens[i]);
    printf("\n");
    if (tok) {
        size_t len;
        if (moe_tokenizer_decode(tok, res.tokens, (size_t)res.n_tokens, true, &text, &len, &err))
            goto fail;
        printf("text: %s\n", text);
    }
    double decode_tps = res.n_tokens > 1 && res.decode_s > 0 ? (res.n_tokens - 1) / res.decode_s : 0;
    printf("model: %s (%s, %.1f MiB of weights, loaded in %.2f s) on %s\n", a.model,
           a.dtype == MOE_DTYPE_BF16 ? "bf16" : "f32",
           (double)moe_model_weight_bytes(model) / (1024.0 * 1024.0), t_load, be->name);
    printf("prefill: %d tokens in %.3f s, %.1f tokens/s\n", n_prompt, res.prefill_s,
           res.prefill_s > 0 ? n_prompt / res.prefill_s : 0);
    printf("decode: %d tokens in %.3f s, %.1f tokens/s%s\n", res.n_tokens > 0 ? res.n_tokens - 1 : 0,
           res.decode_s, decode_tps, res.stopped_at_eos ? " (stopped at EOS)" : "");
    rc = 0;
    goto out;

fail:
    fprintf(stderr, "moe-generate: %s\n", err.msg);
out:
    moe_gen_result_free(&res);
    free(text);
    free(logits);
    free(prompt);
    moe_tokenizer_free(tok);
    moe_model_free(model);
    moe_backend_destroy(be);
    return rc;
}
