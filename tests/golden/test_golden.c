/* Golden test: the C forward pass against Hugging Face transformers.
 *
 *   test_golden FIXTURE_DIR f32|bf16|int8|bf16fast|int8fast|kvbf16
 *
 * FIXTURE_DIR holds a checkpoint written by tests/golden/make_fixtures.py with
 * golden.json (prompts, ids, greedy continuations) and logits_f32.bin /
 * logits_bf16.bin (reference logits at every prompt position). "bf16" loads
 * the weights as bf16 and compares against transformers run in f32 on the
 * same bf16-rounded weights, so both modes are held to the same tolerance.
 *
 * Checked, per prompt:
 *   - our tokenizer gives the reference ids;
 *   - prompt logits: max|ours - ref| / max|ref| <= 1e-4;
 *   - the 32-token greedy continuation is identical;
 *   - chunked prefill (3 tokens per step) gives the same logits as one step;
 *   - all prompts at once, as separate sequences in one batch with scattered
 *     KV blocks, give the same logits as each alone.
 * bf16 is also compared with the f32 reference and the difference printed:
 * it is the cost of bf16 weights, not a property of the engine. It is not
 * held to a bound: on these tiny random models a rounded router weight can
 * flip an expert choice (the Qwen3 fixture's router margins are ~1e-4),
 * which changes logits by tens of percent in any bf16 implementation.
 *
 * "int8" (--dtype int8: Linear weights quantized per output row) has no
 * transformers reference; it is held instead to an f32 model whose weights
 * ARE the dequantized int8 weights (the model's dequantized hook, loaded
 * in the same process): the prompt logits, in one pass (AVX-512 packed
 * prefill on the long prompt) and one token per pass (the GEMV tiles), must
 * match to 1e-4 relative and the greedy continuations must be identical. The
 * int8-vs-f32 logits error and the int8-vs-bf16 greedy agreement are printed
 * as information: they measure quantization, not the engine.
 *
 * "bf16fast" / "int8fast" load the model as the binaries do by default:
 * moe_model_opts.fast, so the Linear layers run on the CPU's dot-product
 * paths (activations rounded to bf16, or quantized per token to int8:
 * kernels/cpu/matmul_dot.c; on Intel without AMX, bf16 calls of 8+ tokens
 * run the exact kernels or, with AVX512-FP16, fp16 streaming tiles (8-31)
 * and the fp16 panels of kernels/cpu/matmul.c (32+): there bf16fast runs
 * twice, the default paths and vdpbf16ps forced), and a BF16 KV cache; they hold
 * the prompt logits, in one pass and one token per pass, to transformers
 * (bf16: logits_bf16.bin) or to the exact int8 model (int8: no transformers
 * reference exists for quantized weights). Each matmul is within 2^-8 of
 * sum|x w| (bf16) or half a quantization step of x (int8) of the exact one,
 * but on these tiny random models that perturbation is larger than the
 * smallest router margins (~1e-4 on the Qwen3 fixture), so at a few
 * positions an expert choice flips and those logits move by tens of percent
 * (later positions attend to the changed K/V) in any engine that rounds
 * activations. The bound is therefore on the distribution of per-position
 * errors (max|ours - ref| / max|ref| of each position's logits): median
 * <= 2e-2 and 75th percentile <= 1e-1 for bf16 (measured with BF16 KV:
 * median 0.005 / 0.012, p75 0.006 / 0.034 on Mixtral / Qwen3), median <= 1e-1
 * and 75th percentile <= 2.5e-1 for int8 (0.017 / 0.066, 0.020 / 0.097); a broken kernel
 * (a lost offset or scale) is off by ~100% everywhere. The worst position is
 * printed, and so is the greedy agreement, not required: the fixtures'
 * greedy margins (> 2e-3) are below the perturbation. The fast logits must
 * differ from the exact engine's (the fast path really ran). SKIPPED (77)
 * where the processor has no such path.
 *
 * "kvbf16" isolates the BF16 KV cache: f32 weights, exact matmuls, K and V
 * rounded to bf16 as they are written, held to transformers in f32 with the
 * bf16 bounds above (measured: median 0.0018 / 0.0055, p75 0.0022 / 0.036 on
 * Mixtral / Qwen3; the Qwen3 tail is its router margins again). The kernels'
 * BF16 path itself is held bit for bit to F32 caches of the rounded values
 * in tests/unit/test_kernels.c. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/cpu_kernels.h"
#include "engine/generate.h"
#include "model/model.h"
#include "quant.h"
#include "testlib.h"
#include "tokenizer.h"

#define LOGIT_TOL 1e-4
/* fast modes, per-position logits rel err (see the comment at the top) */
#define FAST_BF16_MEDIAN 2e-2
#define FAST_BF16_P75 1e-1
#define FAST_I8_MEDIAN 1e-1
#define FAST_I8_P75 2.5e-1
/* kvbf16: exact matmuls, K and V rounded to bf16 in the cache */
#define KV_BF16_MEDIAN 2e-2
#define KV_BF16_P75 1e-1
#define BATCH_TOL 1e-5
#define MAX_PROMPTS 16

struct prompt {
    char *text;
    int32_t *ids;
    int n_ids;
    int32_t greedy[64];
    int n_greedy;
    float *ref; /* (n_ids, vocab) for the dtype under test */
    float *ref_f32;
};

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        if (len)
            *len = (size_t)n;
    }
    return buf;
}

static int32_t *json_ids(const cJSON *arr, int *n)
{
    *n = cJSON_GetArraySize(arr);
    int32_t *ids = malloc(((size_t)*n + 1) * sizeof *ids);
    for (int i = 0; i < *n; i++)
        ids[i] = (int32_t)cJSON_GetArrayItem(arr, i)->valuedouble;
    return ids;
}

/* Reads a MOELOGIT file into per-prompt arrays; returns 0 on success. */
static int read_logits(const char *path, struct prompt *p, int n_prompt, int vocab, bool f32_slot)
{
    size_t len;
    char *buf = read_file(path, &len);
    if (!buf || len < 16 || memcmp(buf, "MOELOGIT", 8)) {
        fprintf(stderr, "%s: missing or not a MOELOGIT file\n", path);
        free(buf);
        return -1;
    }
    uint32_t version, n;
    memcpy(&version, buf + 8, 4);
    memcpy(&n, buf + 12, 4);
    size_t off = 16;
    if (version != 1 || (int)n != n_prompt) {
        fprintf(stderr, "%s: version %u with %u prompts, expected 1 with %d\n", path, version, n,
                n_prompt);
        free(buf);
        return -1;
    }
    for (int i = 0; i < n_prompt; i++) {
        uint32_t n_pos, v;
        memcpy(&n_pos, buf + off, 4);
        memcpy(&v, buf + off + 4, 4);
        off += 8;
        size_t bytes = (size_t)n_pos * v * sizeof(float);
        if ((int)n_pos != p[i].n_ids || (int)v != vocab || off + bytes > len) {
            fprintf(stderr, "%s: prompt %d has %u x %u logits, expected %d x %d\n", path, i, n_pos,
                    v, p[i].n_ids, vocab);
            free(buf);
            return -1;
        }
        float *dst = malloc(bytes);
        memcpy(dst, buf + off, bytes);
        off += bytes;
        float **slot = f32_slot ? &p[i].ref_f32 : &p[i].ref;
        free(*slot); /* read before (check_fast runs twice on some processors) */
        *slot = dst;
    }
    free(buf);
    return 0;
}

/* max|a - b| / max|b| over n values. */
static double rel_err(const float *a, const float *b, size_t n)
{
    double md = 0, mb = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > md || isnan(d))
            md = isnan(d) ? INFINITY : d;
        if (fabs((double)b[i]) > mb)
            mb = fabs((double)b[i]);
    }
    return mb > 0 ? md / mb : md;
}

/* Runs all prompts as one batch, each sequence on scattered blocks. */
static void check_batched(struct moe_model *m, struct prompt *p, int n_prompt, int vocab,
                          float **alone)
{
    const int bs = 4;
    int n_tok = 0, max_blocks = 0;
    for (int i = 0; i < n_prompt; i++) {
        n_tok += p[i].n_ids;
        int nb = (p[i].n_ids + bs - 1) / bs;
        if (nb > max_blocks)
            max_blocks = nb;
    }
    int n_block = n_prompt * max_blocks + 3;
    struct moe_kv_cache *kv = NULL;
    struct moe_error err = {0};
    CHECKF(moe_kv_cache_create(m, n_block, bs, &kv, &err) == MOE_OK, "%s", err.msg);
    if (!kv)
        return;
    int32_t *tables = malloc((size_t)n_prompt * max_blocks * sizeof *tables);
    int32_t *tokens = malloc((size_t)n_tok * sizeof *tokens);
    int32_t *pos = malloc((size_t)n_tok * sizeof *pos);
    int32_t *seq = malloc((size_t)n_tok * sizeof *seq);
    int32_t *slots = malloc((size_t)n_tok * sizeof *slots);
    int32_t *rows = malloc((size_t)n_tok * sizeof *rows);
    float *logits = malloc((size_t)n_tok * vocab * sizeof *logits);
    /* Interleave sequences' blocks, last block id first: block j of sequence i
     * is n_block - 1 - (j * n_prompt + i). */
    for (int i = 0; i < n_prompt; i++)
        for (int j = 0; j < max_blocks; j++)
            tables[i * max_blocks + j] = n_block - 1 - (j * n_prompt + i);
    /* Tokens interleaved round-robin across sequences. */
    int t = 0, done[MAX_PROMPTS] = {0};
    while (t < n_tok) {
        for (int i = 0; i < n_prompt; i++) {
            if (done[i] == p[i].n_ids)
                continue;
            int ps = done[i]++;
            tokens[t] = p[i].ids[ps];
            pos[t] = ps;
            seq[t] = i;
            slots[t] = tables[i * max_blocks + ps / bs] * bs + ps % bs;
            rows[t] = t;
            t++;
        }
    }
    struct moe_batch b = {
        .n_tok = n_tok,
        .tokens = tokens,
        .pos = pos,
        .seq = seq,
        .slots = slots,
        .n_seq = n_prompt,
        .block_tables = tables,
        .max_blocks = max_blocks,
        .n_logits = n_tok,
        .logit_rows = rows,
    };
    CHECKF(moe_model_forward(m, kv, &b, logits, &err) == MOE_OK, "%s", err.msg);
    double worst = 0;
    for (t = 0; t < n_tok; t++) {
        double e = rel_err(logits + (size_t)t * vocab, alone[seq[t]] + (size_t)pos[t] * vocab,
                           (size_t)vocab);
        if (e > worst)
            worst = e;
    }
    CHECKF(worst <= BATCH_TOL, "batched vs alone: rel err %.3g > %.1g", worst, BATCH_TOL);
    printf("  batch of %d sequences (%d tokens, scattered blocks): max rel err vs alone %.3g\n",
           n_prompt, n_tok, worst);
    moe_kv_cache_free(m, kv);
    free(tables);
    free(tokens);
    free(pos);
    free(seq);
    free(slots);
    free(rows);
    free(logits);
}

static struct moe_model *load_model_opts(const char *dir, struct moe_backend *be,
                                         enum moe_dtype dtype, bool dequantized, bool fast,
                                         enum moe_dtype kv_dtype)
{
    struct moe_error err = {0};
    struct moe_model *m = NULL;
    struct moe_model_opts mo = {.dtype = dtype,
                                .tp_size = 1,
                                .dequantized = dequantized,
                                .fast = fast,
                                .kv_dtype = kv_dtype};
    CHECKF(moe_model_load(dir, &mo, be, &m, &err) == MOE_OK, "%s (%s%s%s, %s KV): %s", dir,
           moe_dtype_name(dtype), dequantized ? ", dequantized" : "", fast ? ", fast" : "",
           moe_dtype_name(kv_dtype), err.msg);
    return m;
}

static struct moe_model *load_model(const char *dir, struct moe_backend *be, enum moe_dtype dtype,
                                    bool dequantized)
{
    return load_model_opts(dir, be, dtype, dequantized, false, MOE_DTYPE_F32);
}

/* An int4 model with `group` columns per scale (other dtypes ignore it). */
static struct moe_model *load_model_group(const char *dir, struct moe_backend *be,
                                          enum moe_dtype dtype, bool dequantized, int group)
{
    struct moe_error err = {0};
    struct moe_model *m = NULL;
    struct moe_model_opts mo = {
        .dtype = dtype, .q4_group = group, .tp_size = 1, .dequantized = dequantized};
    CHECKF(moe_model_load(dir, &mo, be, &m, &err) == MOE_OK, "%s (%s group %d%s): %s", dir,
           moe_dtype_name(dtype), group, dequantized ? ", dequantized" : "", err.msg);
    return m;
}

/* Prompt logits (n_ids, vocab) of `m`, the prompt run `chunk` tokens per
 * forward pass (0: all at once), and the greedy continuation in *res. */
static float *prompt_logits(struct moe_model *m, const struct prompt *p, int vocab, int chunk,
                            struct moe_gen_result *res)
{
    struct moe_error err = {0};
    float *logits = malloc((size_t)p->n_ids * vocab * sizeof *logits);
    struct moe_gen_opts go = {.n_predict = p->n_greedy, .ignore_eos = true, .prefill_chunk = chunk};
    CHECKF(moe_generate(m, p->ids, p->n_ids, &go, logits, res, &err) == MOE_OK, "%s", err.msg);
    return logits;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Number of leading tokens two continuations share. */
static int same_prefix(const struct moe_gen_result *a, const struct moe_gen_result *b)
{
    int n = 0;
    while (n < a->n_tokens && n < b->n_tokens && a->tokens[n] == b->tokens[n])
        n++;
    return n;
}

/* A backend that says it is a GPU must refuse int8 at load, naming the flag,
 * before touching a weight: the CPU ops table under a CUDA device tag stands
 * in for one (no GPU here), so nothing can be computed by mistake. */
static void check_quant_refused_off_cpu(const char *dir, struct moe_backend *cpu,
                                        enum moe_dtype dtype, int group)
{
    struct moe_backend fake = *cpu;
    fake.name = "cuda";
    fake.device = MOE_DEVICE_CUDA;
    struct moe_model_opts mo = {.dtype = dtype, .q4_group = group, .tp_size = 1};
    struct moe_model *m = NULL;
    struct moe_error err = {0};
    const char *flag = dtype == MOE_DTYPE_I8 ? "--dtype int8" : "--dtype int4";
    enum moe_status st = moe_model_load(dir, &mo, &fake, &m, &err);
    CHECKF(st == MOE_ERR_UNSUPPORTED && !m && strstr(err.msg, flag) &&
               strstr(err.msg, "--device cpu"),
           "%s on a CUDA backend: status %d, message '%s'", flag, (int)st, err.msg);
    printf("  %s on a CUDA backend refused: %s\n", flag, err.msg);
    moe_model_free(m);
}

/* The int8 and int4 modes: see the comment at the top. */
static void check_quant(const char *dir, struct moe_backend *be, const struct prompt *p,
                        int n_prompt, enum moe_dtype dtype, int group)
{
    const char *name = dtype == MOE_DTYPE_I8 ? "int8" : "int4";
    struct moe_model *m8 = load_model_group(dir, be, dtype, false, group);
    struct moe_model *md = load_model_group(dir, be, dtype, true, group);
    struct moe_model *mf = load_model(dir, be, MOE_DTYPE_F32, false);
    struct moe_model *mb = load_model(dir, be, MOE_DTYPE_BF16, false);
    check_quant_refused_off_cpu(dir, be, dtype, group);
    if (!m8 || !md || !mf || !mb)
        goto done;
    int vocab = moe_model_config(m8)->vocab_size;
    printf("%s (%s, group %d): %d prompts; weights %.1f KiB %s, %.1f KiB bf16\n", dir, name, group,
           n_prompt, moe_model_weight_bytes(m8) / 1024.0, name,
           moe_model_weight_bytes(mb) / 1024.0);
    CHECK(moe_model_weight_bytes(m8) < moe_model_weight_bytes(mb));
    for (int i = 0; i < n_prompt; i++) {
        size_t n_logit = (size_t)p[i].n_ids * vocab;
        struct moe_gen_result r8, r8c, rd, rf, rb;
        float *l8 = prompt_logits(m8, &p[i], vocab, 0, &r8);
        float *l8c = prompt_logits(m8, &p[i], vocab, 1, &r8c);
        float *ld = prompt_logits(md, &p[i], vocab, 0, &rd);
        float *lf = prompt_logits(mf, &p[i], vocab, 0, &rf);
        float *lb = prompt_logits(mb, &p[i], vocab, 0, &rb);
        double e = rel_err(l8, ld, n_logit), ec = rel_err(l8c, ld, n_logit);
        CHECKF(e <= LOGIT_TOL, "prompt %d: %s vs dequantized f32 logits rel err %.3g > %.1g", i,
               name, e, LOGIT_TOL);
        CHECKF(ec <= LOGIT_TOL,
               "prompt %d: %s (1 token per pass) vs dequantized f32 logits rel err %.3g > %.1g", i,
               name, ec, LOGIT_TOL);
        int same = same_prefix(&r8, &rd);
        CHECKF(same == rd.n_tokens && r8.n_tokens == rd.n_tokens,
               "prompt %d: %s greedy differs from the dequantized f32 model at token %d", i, name,
               same);
        printf("  prompt %d: %d tokens, %s vs dequantized f32: logits rel err %.3g (one pass), "
               "%.3g (token by token), greedy %d/%d identical; info: %s vs f32 logits %.3g, "
               "%s vs bf16 greedy %d/%d identical\n",
               i, p[i].n_ids, name, e, ec, same, rd.n_tokens, name, rel_err(l8, lf, n_logit), name,
               same_prefix(&r8, &rb), rb.n_tokens);
        free(l8);
        free(l8c);
        free(ld);
        free(lf);
        free(lb);
        moe_gen_result_free(&r8);
        moe_gen_result_free(&r8c);
        moe_gen_result_free(&rd);
        moe_gen_result_free(&rf);
        moe_gen_result_free(&rb);
    }
done:
    moe_model_free(m8);
    moe_model_free(md);
    moe_model_free(mf);
    moe_model_free(mb);
}

/* A fixture whose Linear widths are not multiples of 32: --dtype int4 is
 * refused at load, naming the tensor and the group size, for every group. */
static void check_int4_refused(const char *dir, struct moe_backend *be)
{
    static const int groups[] = {32, 64, 128};
    for (int i = 0; i < 3; i++) {
        struct moe_model_opts mo = {.dtype = MOE_DTYPE_I4, .q4_group = groups[i], .tp_size = 1};
        struct moe_model *m = NULL;
        struct moe_error err = {0};
        enum moe_status st = moe_model_load(dir, &mo, be, &m, &err);
        char want[64];
        snprintf(want, sizeof want, "columns, not a multiple of 32");
        CHECKF(st == MOE_ERR_UNSUPPORTED && !m && strstr(err.msg, want) &&
                   strstr(err.msg, "tensor '"),
               "int4 group %d: status %d, '%s'", groups[i], (int)st, err.msg);
        printf("%s (int4, group %d): refused: %s\n", dir, groups[i], err.msg);
        moe_model_free(m);
    }
}

/* The perturbed modes: bf16fast, int8fast (fast matmuls and BF16 KV, the
 * binaries' defaults) and kvbf16 (exact matmuls, BF16 KV alone); see the
 * comment at the top. Returns false when this processor has no fast path
 * for the type (SKIPPED). */
static bool check_fast(const char *dir, struct moe_backend *be, struct prompt *p, int n_prompt,
                       enum moe_dtype dtype, bool fast, bool force_dot)
{
    /* Where vdpbf16ps is slower than f32 FMAs (CPU_FEAT_DPBF16_SLOW), the
     * bf16 fast path is the exact kernels by default from 8 tokens (fp16
     * streaming tiles and panels where the processor has AVX512-FP16): the
     * vdpbf16ps path is forced in a run of its own (force_dot), so it is
     * still held to transformers where it exists. */
    if (force_dot) {
        cpu_kernels_force_features(cpu_kernels_features() & ~CPU_FEAT_DPBF16_SLOW);
        printf("%s: vdpbf16ps forced (slower than f32 FMAs on this processor: not the default)\n",
               dir);
    }
    const char *path = fast ? cpu_matmul_fast_path(dtype) : "exact";
    if (!strcmp(path, "f32-fma")) {
        printf("SKIPPED: %s fast path: this processor has no dot-product path for %s\n", dir,
               moe_dtype_name(dtype));
        return false;
    }
    bool i8 =
        dtype == MOE_DTYPE_I8 || dtype == MOE_DTYPE_I4; /* held to the exact quantized model */
    struct moe_model *mf = load_model_opts(dir, be, dtype, false, fast, MOE_DTYPE_BF16);
    /* the exact model the fast one is held to (int8: its dequantized weights) */
    struct moe_model *me = load_model(dir, be, dtype, i8);
    if (!mf || !me)
        goto done;
    int vocab = moe_model_config(mf)->vocab_size;
    if (!i8) {
        char file[4096];
        snprintf(file, sizeof file, "%s/logits_%s.bin", dir,
                 dtype == MOE_DTYPE_BF16 ? "bf16" : "f32");
        if (read_logits(file, p, n_prompt, vocab, false) != 0) {
            CHECK(!"reference logits");
            goto done;
        }
    }
    const double tol_med = i8 ? FAST_I8_MEDIAN : fast ? FAST_BF16_MEDIAN : KV_BF16_MEDIAN;
    const double tol_p75 = i8 ? FAST_I8_P75 : fast ? FAST_BF16_P75 : KV_BF16_P75;
    printf("%s (%s weights, %s matmuls, BF16 KV): %d prompts against %s; per-position logits rel "
           "err held to median <= %.2g, 75th percentile <= %.2g\n",
           dir, moe_dtype_name(dtype), path, n_prompt,
           i8                        ? "the exact quantized model"
           : dtype == MOE_DTYPE_BF16 ? "transformers (bf16 weights)"
                                     : "transformers (f32)",
           tol_med, tol_p75);
    enum { MAX_POS = 4096 };
    static double pos_err[MAX_POS];
    int n_pos = 0;
    double worst = 0;
    int greedy_same = 0, greedy_total = 0;
    for (int i = 0; i < n_prompt; i++) {
        size_t n_logit = (size_t)p[i].n_ids * vocab;
        struct moe_gen_result rf, rfc, re;
        float *lf = prompt_logits(mf, &p[i], vocab, 0, &rf);   /* packed tiles on long prompts */
        float *lfc = prompt_logits(mf, &p[i], vocab, 1, &rfc); /* streaming tiles */
        float *le = prompt_logits(me, &p[i], vocab, 0, &re);
        const float *ref = i8 ? le : p[i].ref;
        double e = rel_err(lf, ref, n_logit), ec = rel_err(lfc, ref, n_logit);
        double d_exact = rel_err(lf, le, n_logit);
        for (int q = 0; q < p[i].n_ids && n_pos + 2 <= MAX_POS; q++) {
            pos_err[n_pos++] = rel_err(lf + (size_t)q * vocab, ref + (size_t)q * vocab, vocab);
            pos_err[n_pos++] = rel_err(lfc + (size_t)q * vocab, ref + (size_t)q * vocab, vocab);
        }
        /* The perturbed path really ran: its logits are not the exact ones. */
        CHECKF(d_exact > 0,
               "prompt %d: logits equal the exact ones (fast path or BF16 KV not used?)", i);
        const int32_t *want = i8 ? re.tokens : p[i].greedy;
        int n_want = i8 ? re.n_tokens : p[i].n_greedy, same = 0;
        while (same < n_want && same < rf.n_tokens && rf.tokens[same] == want[same])
            same++;
        greedy_same += same;
        greedy_total += n_want;
        worst = e > worst ? e : worst;
        worst = ec > worst ? ec : worst;
        printf("  prompt %d: %d tokens, logits rel err %.3g (one pass), %.3g (token by "
               "token), vs exact engine %.3g; info: greedy %d/%d identical to %s\n",
               i, p[i].n_ids, e, ec, d_exact, same, n_want,
               i8 ? "exact quantized" : "transformers");
        free(lf);
        free(lfc);
        free(le);
        moe_gen_result_free(&rf);
        moe_gen_result_free(&rfc);
        moe_gen_result_free(&re);
    }
    qsort(pos_err, (size_t)n_pos, sizeof pos_err[0], cmp_double);
    double med = n_pos ? pos_err[n_pos / 2] : INFINITY, p75 = n_pos ? pos_err[n_pos * 3 / 4] : 0;
    CHECKF(med <= tol_med, "median per-position logits rel err %.3g > %.2g", med, tol_med);
    CHECKF(p75 <= tol_p75, "75th percentile per-position logits rel err %.3g > %.2g", p75, tol_p75);
    printf("  %d positions (one pass and token by token): median %.3g, 75th percentile %.3g, "
           "worst %.3g (where expert choices flip, see the top); greedy tokens identical %d/%d "
           "(printed, not "
           "required: see the top of this file)\n",
           n_pos, med, p75, worst, greedy_same, greedy_total);
done:
    moe_model_free(mf);
    moe_model_free(me);
    return true;
}

int main(int argc, char **argv)
{
    int int4_group = 0; /* int4-32, int4-64, int4-128 */
    bool int4_refused = argc == 3 && !strcmp(argv[2], "int4-refused");
    if (argc == 3 && !strncmp(argv[2], "int4-", 5) && !int4_refused) {
        int4_group = atoi(argv[2] + 5);
        if (!moe_q4_group_valid(int4_group))
            int4_group = -1;
    }
    if (argc != 3 || int4_group < 0 ||
        (strcmp(argv[2], "f32") && strcmp(argv[2], "bf16") && strcmp(argv[2], "int8") &&
         strcmp(argv[2], "bf16fast") && strcmp(argv[2], "int8fast") && strcmp(argv[2], "kvbf16") &&
         strcmp(argv[2], "int4fast") && !int4_group && !int4_refused)) {
        fprintf(stderr, "usage: test_golden FIXTURE_DIR "
                        "f32|bf16|int8|int4-32|int4-64|int4-128|int4-refused|bf16fast|int8fast|"
                        "int4fast|kvbf16\n");
        return 2;
    }
    const char *dir = argv[1];
    bool fast = strstr(argv[2], "fast") != NULL;
    bool kv_bf16 = !strcmp(argv[2], "kvbf16");
    bool int8 = !strncmp(argv[2], "int8", 4);
    bool bf16 = !strncmp(argv[2], "bf16", 4);
    char path[4096];
    struct moe_error err = {0};

    snprintf(path, sizeof path, "%s/golden.json", dir);
    char *json_text = read_file(path, NULL);
    cJSON *root = json_text ? cJSON_Parse(json_text) : NULL;
    if (!root) {
        fprintf(stderr, "%s: missing or not JSON\n", path);
        return 1;
    }
    const cJSON *jprompts = cJSON_GetObjectItemCaseSensitive(root, "prompts");
    int n_prompt = cJSON_GetArraySize(jprompts);
    MOE_ASSERT(n_prompt > 0 && n_prompt <= MAX_PROMPTS);
    struct prompt p[MAX_PROMPTS] = {0};
    for (int i = 0; i < n_prompt; i++) {
        const cJSON *jp = cJSON_GetArrayItem(jprompts, i);
        p[i].text = strdup(cJSON_GetObjectItemCaseSensitive(jp, "text")->valuestring);
        p[i].ids = json_ids(cJSON_GetObjectItemCaseSensitive(jp, "ids"), &p[i].n_ids);
        int n;
        int32_t *g =
            json_ids(cJSON_GetObjectItemCaseSensitive(jp, bf16 ? "greedy_bf16" : "greedy_f32"), &n);
        MOE_ASSERT(n <= 64);
        memcpy(p[i].greedy, g, (size_t)n * sizeof *g);
        p[i].n_greedy = n;
        free(g);
    }

    struct moe_backend *be = NULL;
    struct moe_model *m = NULL;
    struct moe_tokenizer *tok = NULL;
    CHECKF(moe_backend_create("cpu", 0, &be, &err) == MOE_OK, "%s", err.msg);
    if (fast || kv_bf16) {
        bool ran = false;
        const enum moe_dtype dt = kv_bf16                        ? MOE_DTYPE_F32
                                  : bf16                         ? MOE_DTYPE_BF16
                                  : !strcmp(argv[2], "int4fast") ? MOE_DTYPE_I4
                                                                 : MOE_DTYPE_I8;
        const unsigned feats = cpu_kernels_features();
        const bool slow_dot = fast && dt == MOE_DTYPE_BF16 && (feats & CPU_FEAT_DPBF16_SLOW) &&
                              (feats & CPU_FEAT_AVX512_BF16) && !(feats & CPU_FEAT_AMX_BF16);
        /* there, the default path too where it has the fp16 tiles (every
         * prompt of 8+ tokens takes them in its dense projections) */
        if (be && slow_dot && cpu_matmul_fp16_panels())
            ran = check_fast(dir, be, p, n_prompt, dt, fast, false);
        if (be)
            ran = check_fast(dir, be, p, n_prompt, dt, fast, slow_dot) || ran;
        for (int i = 0; i < n_prompt; i++) {
            free(p[i].text);
            free(p[i].ids);
            free(p[i].ref);
        }
        cJSON_Delete(root);
        free(json_text);
        moe_backend_destroy(be);
        int rc = test_summary();
        return rc == 0 && !ran ? TEST_SKIP_CODE : rc;
    }
    if (int8 || int4_group || int4_refused) {
        if (be && int4_refused)
            check_int4_refused(dir, be);
        else if (be)
            check_quant(dir, be, p, n_prompt, int8 ? MOE_DTYPE_I8 : MOE_DTYPE_I4, int4_group);
        for (int i = 0; i < n_prompt; i++) {
            free(p[i].text);
            free(p[i].ids);
        }
        cJSON_Delete(root);
        free(json_text);
        moe_backend_destroy(be);
        return test_summary();
    }
    struct moe_model_opts mo = {.dtype = bf16 ? MOE_DTYPE_BF16 : MOE_DTYPE_F32, .tp_size = 1};
    CHECKF(be && moe_model_load(dir, &mo, be, &m, &err) == MOE_OK, "%s", err.msg);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    CHECKF(moe_tokenizer_load(path, &tok, &err) == MOE_OK, "%s", err.msg);
    if (!m)
        return test_summary();
    int vocab = moe_model_config(m)->vocab_size;

    snprintf(path, sizeof path, "%s/logits_%s.bin", dir, bf16 ? "bf16" : "f32");
    CHECK(read_logits(path, p, n_prompt, vocab, false) == 0);
    if (bf16) {
        snprintf(path, sizeof path, "%s/logits_f32.bin", dir);
        CHECK(read_logits(path, p, n_prompt, vocab, true) == 0);
    }

    float *alone[MAX_PROMPTS] = {0};
    printf("%s (%s): %d prompts\n", dir, argv[2], n_prompt);
    for (int i = 0; i < n_prompt && p[i].ref; i++) {
        /* tokenizer end to end */
        if (tok) {
            int32_t *ids = NULL;
            size_t n = 0;
            CHECKF(moe_tokenizer_encode(tok, p[i].text, strlen(p[i].text), true, &ids, &n, &err) ==
                       MOE_OK,
                   "%s", err.msg);
            bool same = (int)n == p[i].n_ids && !memcmp(ids, p[i].ids, n * sizeof *ids);
            CHECKF(same, "prompt %d: tokenizer gives %zu ids, reference %d (or different ids)", i,
                   n, p[i].n_ids);
            free(ids);
        }
        /* logits and greedy continuation in one pass */
        size_t n_logit = (size_t)p[i].n_ids * vocab;
        alone[i] = malloc(n_logit * sizeof(float));
        struct moe_gen_opts go = {.n_predict = p[i].n_greedy, .ignore_eos = true};
        struct moe_gen_result res;
        CHECKF(moe_generate(m, p[i].ids, p[i].n_ids, &go, alone[i], &res, &err) == MOE_OK, "%s",
               err.msg);
        double e = rel_err(alone[i], p[i].ref, n_logit);
        CHECKF(e <= LOGIT_TOL, "prompt %d: logits rel err %.3g > %.1g", i, e, LOGIT_TOL);
        int first_diff = -1;
        for (int j = 0; j < p[i].n_greedy && first_diff < 0; j++)
            if (j >= res.n_tokens || res.tokens[j] != p[i].greedy[j])
                first_diff = j;
        CHECKF(first_diff < 0, "prompt %d: greedy token %d differs (ours %d, reference %d)", i,
               first_diff, first_diff < res.n_tokens ? res.tokens[first_diff] : -1,
               p[i].greedy[first_diff < 0 ? 0 : first_diff]);
        printf("  prompt %d: %d tokens, logits rel err %.3g, greedy %d/%d identical", i, p[i].n_ids,
               e, first_diff < 0 ? p[i].n_greedy : first_diff, p[i].n_greedy);
        if (bf16) {
            printf(", vs f32 reference %.3g", rel_err(alone[i], p[i].ref_f32, n_logit));
        }
        printf("\n");
        moe_gen_result_free(&res);

        /* chunked prefill through the KV cache */
        float *chunked = malloc(n_logit * sizeof(float));
        struct moe_gen_opts gc = {.n_predict = 0, .prefill_chunk = 3, .block_size = 4};
        CHECKF(moe_generate(m, p[i].ids, p[i].n_ids, &gc, chunked, &res, &err) == MOE_OK, "%s",
               err.msg);
        double ec = rel_err(chunked, alone[i], n_logit);
        CHECKF(ec <= BATCH_TOL, "prompt %d: chunked prefill rel err %.3g > %.1g", i, ec, BATCH_TOL);
        moe_gen_result_free(&res);
        free(chunked);
    }
    bool all = true;
    for (int i = 0; i < n_prompt; i++)
        all = all && alone[i];
    if (all)
        check_batched(m, p, n_prompt, vocab, alone);

    for (int i = 0; i < n_prompt; i++) {
        free(p[i].text);
        free(p[i].ids);
        free(p[i].ref);
        free(p[i].ref_f32);
        free(alone[i]);
    }
    cJSON_Delete(root);
    free(json_text);
    moe_tokenizer_free(tok);
    moe_model_free(m);
    moe_backend_destroy(be);
    return test_summary();
}
