/* moe-mkmodel: writes a random-weight MoE checkpoint in the Hugging Face
 * layout (config.json + model.safetensors, or shards + index), for
 * benchmarks and tests that need a model of a given shape but not a trained
 * one. No Python needed; tensors are streamed to disk, so a multi-GB model
 * needs only a few MB of memory.
 *
 *   moe-mkmodel --arch mixtral --out /tmp/benchmodel --vocab 32000 --hidden 1024 \
 *       --layers 8 --heads 16 --kv-heads 4 --experts 8 --top-k 2 --ffn 2816 --dtype bf16
 *
 * Weights: N(0, std)-like values (Irwin-Hall sum of 4 uniforms, scaled) from
 * a xorshift64* generator seeded per tensor from (--seed, tensor index), so
 * a tensor's values do not depend on sharding. Norm weights are 1.
 * Tensor names are the Hub ones: Mixtral `block_sparse_moe.experts.E.w1/w2/w3`,
 * Qwen3-MoE `mlp.experts.E.gate_proj/up_proj/down_proj`, dense layers
 * `mlp.gate_proj/...`, `self_attn.q_norm/k_norm`; DeepSeek-V3 its latent
 * attention (`q_a_proj`, `q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`,
 * `kv_b_proj` and their norms), `mlp.gate.e_score_correction_bias` and
 * `mlp.shared_experts.*`, its first --first-dense layers dense:
 *
 *   moe-mkmodel --arch deepseek_v3 --out /tmp/dsv3 --vocab 32000 --hidden 1024 \
 *       --layers 8 --heads 16 --experts 64 --top-k 6 --ffn 256 --shared 2 \
 *       --q-lora 512 --kv-lora 256 --rope-dim 64 --nope-dim 64 --v-dim 64 \
 *       --groups 8 --topk-groups 4 --first-dense 1 --dense-ffn 2816 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "dtype.h"
#include "rng.h"

#define MK_MAX_LAYERS 256
#define MK_NAME_MAX 128
#define MK_CHUNK 65536 /* elements generated per write */

enum mk_arch { MK_MIXTRAL, MK_QWEN3_MOE, MK_DEEPSEEK_V3 };

struct mk_opts {
    enum mk_arch arch;
    const char *out;
    int vocab, d_model, n_layer, n_head, n_kv_head, d_head;
    int n_expert, top_k, d_ff, d_ff_dense;
    bool mlp_only[MK_MAX_LAYERS];
    bool have_mlp_only;
    bool tie;
    bool norm_topk_prob;
    enum moe_dtype dtype;
    uint64_t seed;
    int64_t shard_bytes; /* 0: one file */
    double std;
    double rope_theta;
    double rms_eps;
    int max_pos;
    int bos_id, eos_id;
    /* DeepSeek-V3 */
    int q_lora, kv_lora, rope_dim, nope_dim, v_dim, n_shared, n_group, topk_group, first_dense;
};

struct mk_tensor {
    char name[MK_NAME_MAX];
    int64_t rows, cols; /* rows == 1 and is_1d for vectors */
    bool is_1d;
    bool ones;      /* norm weight: all 1 */
    int64_t offset; /* byte offset inside its shard's data area */
    int shard;
};

struct mk_list {
    struct mk_tensor *t;
    size_t n, cap;
};

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("moe-mkmodel: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void usage(FILE *f)
{
    fputs("usage: moe-mkmodel --arch mixtral|qwen3_moe|deepseek_v3 --out DIR --vocab N --hidden N\n"
          "         --layers N --heads N --kv-heads N [--head-dim N] --experts N --top-k N\n"
          "         --ffn N [--dense-ffn N --mlp-only-layers I,J,...] [--dtype bf16|f32]\n"
          "         [--seed S] [--shard-mb N] [--std X] [--tie-embeddings]\n"
          "         [--norm-topk-prob 0|1] [--rope-theta X] [--rms-eps X] [--max-pos N]\n"
          "         [--bos ID] [--eos ID]\n"
          "  deepseek_v3: --kv-lora N --rope-dim N --nope-dim N --v-dim N [--q-lora N]\n"
          "         [--shared N] [--groups N --topk-groups N] [--first-dense N --dense-ffn N]\n"
          "         (--kv-heads is --heads; --head-dim is --rope-dim)\n"
          "Writes DIR/config.json and DIR/model.safetensors (or, with --shard-mb,\n"
          "model-0000i-of-0000n.safetensors + model.safetensors.index.json) holding\n"
          "random weights in the Hugging Face layout of the chosen architecture.\n"
          "--ffn is the expert FFN width (Mixtral intermediate_size, Qwen3-MoE\n"
          "moe_intermediate_size); --dense-ffn is Qwen3-MoE's intermediate_size used by\n"
          "the --mlp-only-layers (dense MLP) layers.\n",
          f);
}

static long long parse_int(const char *opt, const char *s, long long lo, long long hi)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end)
        die("%s: '%s' is not an integer", opt, s);
    if (v < lo || v > hi)
        die("%s: %lld is out of range [%lld, %lld]", opt, v, lo, hi);
    return v;
}

static double parse_double(const char *opt, const char *s, double lo, double hi)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        die("%s: '%s' is not a number in [%g, %g]", opt, s, lo, hi);
    return v;
}

static void parse_layer_list(struct mk_opts *o, const char *s)
{
    const char *p = s;
    o->have_mlp_only = true;
    if (!*p)
        return; /* empty list: no dense layers */
    for (;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v >= MK_MAX_LAYERS)
            die("--mlp-only-layers: bad layer index in '%s' (want comma-separated integers in "
                "[0, %d))",
                s, MK_MAX_LAYERS);
        o->mlp_only[v] = true;
        if (*end == '\0')
            break;
        if (*end != ',')
            die("--mlp-only-layers: unexpected '%c' in '%s'", *end, s);
        p = end + 1;
    }
}

static void opts_parse(struct mk_opts *o, int argc, char **argv)
{
    memset(o, 0, sizeof(*o));
    int arch = -1;
    o->d_head = 0;
    o->d_ff_dense = 0;
    o->dtype = MOE_DTYPE_BF16;
    o->seed = 1;
    o->std = 0.02;
    o->rope_theta = -1;
    o->rms_eps = -1;
    o->max_pos = 32768;
    o->bos_id = 1;
    o->eos_id = 2;
    int norm_topk = -1;
    const long long big = INT_MAX;

    const struct {
        const char *name;
        long long lo, hi;
        int *dst;
    } ints[] = {
        {"--vocab", 1, big, &o->vocab},
        {"--hidden", 1, big, &o->d_model},
        {"--layers", 1, MK_MAX_LAYERS, &o->n_layer},
        {"--heads", 1, big, &o->n_head},
        {"--kv-heads", 1, big, &o->n_kv_head},
        {"--head-dim", 1, big, &o->d_head},
        {"--experts", 1, 65536, &o->n_expert},
        {"--top-k", 1, 65536, &o->top_k},
        {"--ffn", 1, big, &o->d_ff},
        {"--dense-ffn", 1, big, &o->d_ff_dense},
        {"--max-pos", 1, big, &o->max_pos},
        {"--bos", -1, big, &o->bos_id},
        {"--q-lora", 0, big, &o->q_lora},
        {"--kv-lora", 1, big, &o->kv_lora},
        {"--rope-dim", 2, big, &o->rope_dim},
        {"--nope-dim", 1, big, &o->nope_dim},
        {"--v-dim", 1, big, &o->v_dim},
        {"--shared", 0, 1024, &o->n_shared},
        {"--groups", 1, big, &o->n_group},
        {"--topk-groups", 1, big, &o->topk_group},
        {"--first-dense", 0, big, &o->first_dense},
        {"--eos", 0, big, &o->eos_id},
    };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            exit(0);
        }
        if (!strcmp(a, "--tie-embeddings")) {
            o->tie = true;
            continue;
        }
        if (strncmp(a, "--", 2) != 0) {
            usage(stderr);
            die("unexpected argument '%s'", a);
        }
        if (i + 1 >= argc)
            die("%s needs a value", a);
        const char *v = argv[++i];
        size_t k = 0;
        while (k < sizeof ints / sizeof ints[0] && strcmp(a, ints[k].name))
            k++;
        if (k < sizeof ints / sizeof ints[0]) {
            *ints[k].dst = (int)parse_int(a, v, ints[k].lo, ints[k].hi);
        } else if (!strcmp(a, "--arch")) {
            if (!strcmp(v, "mixtral"))
                arch = MK_MIXTRAL;
            else if (!strcmp(v, "qwen3_moe"))
                arch = MK_QWEN3_MOE;
            else if (!strcmp(v, "deepseek_v3"))
                arch = MK_DEEPSEEK_V3;
            else
                die("--arch: '%s' is not one of mixtral, qwen3_moe, deepseek_v3", v);
        } else if (!strcmp(a, "--out")) {
            o->out = v;
        } else if (!strcmp(a, "--mlp-only-layers")) {
            parse_layer_list(o, v);
        } else if (!strcmp(a, "--dtype")) {
            if (!strcmp(v, "bf16"))
                o->dtype = MOE_DTYPE_BF16;
            else if (!strcmp(v, "f32"))
                o->dtype = MOE_DTYPE_F32;
            else
                die("--dtype: '%s' is not one of bf16, f32", v);
        } else if (!strcmp(a, "--seed")) {
            o->seed = (uint64_t)parse_int(a, v, 0, LLONG_MAX);
        } else if (!strcmp(a, "--shard-mb")) {
            o->shard_bytes = parse_int(a, v, 1, 1 << 20) << 20;
        } else if (!strcmp(a, "--std")) {
            o->std = parse_double(a, v, 0.0, 100.0);
        } else if (!strcmp(a, "--norm-topk-prob")) {
            norm_topk = (int)parse_int(a, v, 0, 1);
        } else if (!strcmp(a, "--rope-theta")) {
            o->rope_theta = parse_double(a, v, 1e-3, 1e12);
        } else if (!strcmp(a, "--rms-eps")) {
            o->rms_eps = parse_double(a, v, 1e-12, 1.0);
        } else {
            usage(stderr);
            die("unknown option '%s'", a);
        }
    }

    if (arch < 0)
        die("--arch is required (mixtral, qwen3_moe or deepseek_v3)");
    o->arch = (enum mk_arch)arch;
    if (o->arch == MK_DEEPSEEK_V3) {
        if (!o->kv_lora || !o->rope_dim || !o->nope_dim || !o->v_dim)
            die("--arch deepseek_v3 needs --kv-lora, --rope-dim, --nope-dim and --v-dim");
        if (o->n_kv_head && o->n_kv_head != o->n_head)
            die("--kv-heads %d: DeepSeek-V3's keys come from one latent row for all %d heads",
                o->n_kv_head, o->n_head);
        o->n_kv_head = o->n_head;
        o->d_head = o->rope_dim;
        if (!o->n_group)
            o->n_group = 1;
        if (!o->topk_group)
            o->topk_group = o->n_group;
        if (o->n_expert > 0 &&
            (o->n_expert % o->n_group || o->n_expert / o->n_group < 2 ||
             o->topk_group > o->n_group || o->top_k > o->topk_group * (o->n_expert / o->n_group)))
            die("--groups %d / --topk-groups %d do not fit --experts %d with --top-k %d",
                o->n_group, o->topk_group, o->n_expert, o->top_k);
        if (o->first_dense > 0 && !o->d_ff_dense)
            die("--first-dense %d needs --dense-ffn (the dense MLP width)", o->first_dense);
        if (o->first_dense > o->n_layer)
            die("--first-dense %d is more than --layers %d", o->first_dense, o->n_layer);
        if (o->have_mlp_only)
            die("--mlp-only-layers applies to --arch qwen3_moe; DeepSeek-V3 has --first-dense");
    }
    if (!o->out)
        die("--out DIR is required");
    struct {
        const char *opt;
        int val;
    } req[] = {{"--vocab", o->vocab},        {"--hidden", o->d_model},
               {"--layers", o->n_layer},     {"--heads", o->n_head},
               {"--kv-heads", o->n_kv_head}, {"--experts", o->n_expert},
               {"--top-k", o->top_k},        {"--ffn", o->d_ff}};
    for (size_t i = 0; i < sizeof(req) / sizeof(req[0]); i++)
        if (req[i].val <= 0)
            die("%s is required", req[i].opt);
    if (o->n_head % o->n_kv_head)
        die("--heads %d is not a multiple of --kv-heads %d", o->n_head, o->n_kv_head);
    if (o->top_k > o->n_expert)
        die("--top-k %d is larger than --experts %d", o->top_k, o->n_expert);
    if (o->d_head == 0) {
        if (o->d_model % o->n_head)
            die("--hidden %d is not a multiple of --heads %d: give --head-dim", o->d_model,
                o->n_head);
        o->d_head = o->d_model / o->n_head;
    }
    if ((int64_t)o->n_head * o->d_head > INT_MAX)
        die("--heads x --head-dim is too large");
    if (o->d_head % 2)
        die("--head-dim %d must be even (RoPE rotates pairs)", o->d_head);
    if (o->bos_id >= o->vocab || o->eos_id >= o->vocab)
        die("--bos %d / --eos %d must be below --vocab %d", o->bos_id, o->eos_id, o->vocab);
    if (o->arch == MK_DEEPSEEK_V3) {
        for (int l = 0; l < o->first_dense; l++)
            o->mlp_only[l] = true;
        if (!o->d_ff_dense)
            o->d_ff_dense = o->d_ff;
        o->norm_topk_prob = norm_topk != 0;
        if (o->rope_theta < 0)
            o->rope_theta = 1e4;
        if (o->rms_eps < 0)
            o->rms_eps = 1e-6;
    } else if (o->arch == MK_MIXTRAL) {
        if (o->have_mlp_only || o->d_ff_dense)
            die("--mlp-only-layers and --dense-ffn apply to --arch qwen3_moe only");
        if (norm_topk == 0)
            die("--norm-topk-prob 0: Mixtral always renormalises the top-k weights");
        o->norm_topk_prob = true;
        if (o->rope_theta < 0)
            o->rope_theta = 1e6;
        if (o->rms_eps < 0)
            o->rms_eps = 1e-5;
    } else {
        bool any_dense = false;
        for (int l = 0; l < MK_MAX_LAYERS; l++) {
            if (o->mlp_only[l] && l >= o->n_layer)
                die("--mlp-only-layers: layer %d does not exist (--layers %d)", l, o->n_layer);
            any_dense |= o->mlp_only[l];
        }
        if (any_dense && o->d_ff_dense == 0)
            die("--mlp-only-layers needs --dense-ffn (the dense MLP width)");
        if (o->d_ff_dense == 0)
            o->d_ff_dense = o->d_ff;        /* config.json needs intermediate_size anyway */
        o->norm_topk_prob = norm_topk != 0; /* Qwen3-30B-A3B: true */
        if (o->rope_theta < 0)
            o->rope_theta = 1e6;
        if (o->rms_eps < 0)
            o->rms_eps = 1e-6;
    }
}

/* ---- tensor list ------------------------------------------------------------ */

static void list_add(struct mk_list *l, int64_t rows, int64_t cols, bool is_1d, bool ones,
                     const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void list_add(struct mk_list *l, int64_t rows, int64_t cols, bool is_1d, bool ones,
                     const char *fmt, ...)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 256;
        l->t = realloc(l->t, l->cap * sizeof(*l->t));
        if (!l->t)
            die("out of memory");
    }
    struct mk_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof(*t));
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof(t->name), fmt, ap);
    va_end(ap);
    t->rows = rows;
    t->cols = cols;
    t->is_1d = is_1d;
    t->ones = ones;
}

static void list_build(const struct mk_opts *o, struct mk_list *l)
{
    const int64_t d = o->d_model, q = (int64_t)o->n_head * o->d_head,
                  kv = (int64_t)o->n_kv_head * o->d_head;
    list_add(l, o->vocab, d, false, false, "model.embed_tokens.weight");
    for (int i = 0; i < o->n_layer; i++) {
        list_add(l, 1, d, true, true, "model.layers.%d.input_layernorm.weight", i);
        if (o->arch == MK_DEEPSEEK_V3) {
            const int64_t H = o->n_head, qh = o->nope_dim + o->rope_dim;
            const char *a = "model.layers.%d.self_attn.";
            char p[MK_NAME_MAX];
            snprintf(p, sizeof p, a, i);
            if (o->q_lora) {
                list_add(l, o->q_lora, d, false, false, "%sq_a_proj.weight", p);
                list_add(l, 1, o->q_lora, true, true, "%sq_a_layernorm.weight", p);
                list_add(l, H * qh, o->q_lora, false, false, "%sq_b_proj.weight", p);
            } else {
                list_add(l, H * qh, d, false, false, "%sq_proj.weight", p);
            }
            list_add(l, o->kv_lora + o->rope_dim, d, false, false, "%skv_a_proj_with_mqa.weight",
                     p);
            list_add(l, 1, o->kv_lora, true, true, "%skv_a_layernorm.weight", p);
            list_add(l, H * (o->nope_dim + o->v_dim), o->kv_lora, false, false,
                     "%skv_b_proj.weight", p);
            list_add(l, d, H * o->v_dim, false, false, "%so_proj.weight", p);
            list_add(l, 1, d, true, true, "model.layers.%d.post_attention_layernorm.weight", i);
            if (o->mlp_only[i]) {
                list_add(l, o->d_ff_dense, d, false, false, "model.layers.%d.mlp.gate_proj.weight",
                         i);
                list_add(l, o->d_ff_dense, d, false, false, "model.layers.%d.mlp.up_proj.weight",
                         i);
                list_add(l, d, o->d_ff_dense, false, false, "model.layers.%d.mlp.down_proj.weight",
                         i);
                continue;
            }
            list_add(l, o->n_expert, d, false, false, "model.layers.%d.mlp.gate.weight", i);
            list_add(l, 1, o->n_expert, true, false,
                     "model.layers.%d.mlp.gate.e_score_correction_bias", i);
            for (int e = 0; e < o->n_expert; e++) {
                char base[MK_NAME_MAX];
                snprintf(base, sizeof(base), "model.layers.%d.mlp.experts.%d", i, e);
                list_add(l, o->d_ff, d, false, false, "%s.gate_proj.weight", base);
                list_add(l, o->d_ff, d, false, false, "%s.up_proj.weight", base);
                list_add(l, d, o->d_ff, false, false, "%s.down_proj.weight", base);
            }
            if (o->n_shared) {
                const int64_t f = (int64_t)o->n_shared * o->d_ff;
                list_add(l, f, d, false, false,
                         "model.layers.%d.mlp.shared_experts.gate_proj.weight", i);
                list_add(l, f, d, false, false, "model.layers.%d.mlp.shared_experts.up_proj.weight",
                         i);
                list_add(l, d, f, false, false,
                         "model.layers.%d.mlp.shared_experts.down_proj.weight", i);
            }
            continue;
        }
        list_add(l, q, d, false, false, "model.layers.%d.self_attn.q_proj.weight", i);
        list_add(l, kv, d, false, false, "model.layers.%d.self_attn.k_proj.weight", i);
        list_add(l, kv, d, false, false, "model.layers.%d.self_attn.v_proj.weight", i);
        list_add(l, d, q, false, false, "model.layers.%d.self_attn.o_proj.weight", i);
        if (o->arch == MK_QWEN3_MOE) {
            list_add(l, 1, o->d_head, true, true, "model.layers.%d.self_attn.q_norm.weight", i);
            list_add(l, 1, o->d_head, true, true, "model.layers.%d.self_attn.k_norm.weight", i);
        }
        list_add(l, 1, d, true, true, "model.layers.%d.post_attention_layernorm.weight", i);
        if (o->arch == MK_MIXTRAL) {
            list_add(l, o->n_expert, d, false, false,
                     "model.layers.%d.block_sparse_moe.gate.weight", i);
            for (int e = 0; e < o->n_expert; e++) {
                const char *p = "model.layers.%d.block_sparse_moe.experts.%d";
                char base[MK_NAME_MAX];
                snprintf(base, sizeof(base), p, i, e);
                list_add(l, o->d_ff, d, false, false, "%s.w1.weight", base);
                list_add(l, d, o->d_ff, false, false, "%s.w2.weight", base);
                list_add(l, o->d_ff, d, false, false, "%s.w3.weight", base);
            }
        } else if (o->mlp_only[i]) {
            list_add(l, o->d_ff_dense, d, false, false, "model.layers.%d.mlp.gate_proj.weight", i);
            list_add(l, o->d_ff_dense, d, false, false, "model.layers.%d.mlp.up_proj.weight", i);
            list_add(l, d, o->d_ff_dense, false, false, "model.layers.%d.mlp.down_proj.weight", i);
        } else {
            list_add(l, o->n_expert, d, false, false, "model.layers.%d.mlp.gate.weight", i);
            for (int e = 0; e < o->n_expert; e++) {
                char base[MK_NAME_MAX];
                snprintf(base, sizeof(base), "model.layers.%d.mlp.experts.%d", i, e);
                list_add(l, o->d_ff, d, false, false, "%s.gate_proj.weight", base);
                list_add(l, o->d_ff, d, false, false, "%s.up_proj.weight", base);
                list_add(l, d, o->d_ff, false, false, "%s.down_proj.weight", base);
            }
        }
    }
    list_add(l, 1, d, true, true, "model.norm.weight");
    if (!o->tie)
        list_add(l, o->vocab, d, false, false, "lm_head.weight");
}

static int64_t tensor_bytes(const struct mk_opts *o, const struct mk_tensor *t)
{
    return t->rows * t->cols * (int64_t)moe_dtype_size(o->dtype);
}

/* Assigns shards and offsets; returns the number of shards. */
static int list_place(const struct mk_opts *o, struct mk_list *l)
{
    int shard = 0;
    int64_t off = 0;
    for (size_t i = 0; i < l->n; i++) {
        int64_t b = tensor_bytes(o, &l->t[i]);
        if (o->shard_bytes && off > 0 && off + b > o->shard_bytes) {
            shard++;
            off = 0;
        }
        l->t[i].shard = shard;
        l->t[i].offset = off;
        off += b;
    }
    return shard + 1;
}

/* ---- growable string -------------------------------------------------------- */

struct mk_buf {
    char *s;
    size_t n, cap;
};

static void buf_printf(struct mk_buf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void buf_printf(struct mk_buf *b, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->n;
        int k = vsnprintf(b->s ? b->s + b->n : NULL, room, fmt, ap);
        va_end(ap);
        if (k < 0)
            die("formatting failed");
        if ((size_t)k < room) {
            b->n += (size_t)k;
            return;
        }
        b->cap = b->cap * 2 + (size_t)k + 256;
        b->s = realloc(b->s, b->cap);
        if (!b->s)
            die("out of memory");
    }
}

/* ---- random values -------------------------------------------------------------- */

static uint64_t xorshift64s(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545f4914f6cdd1dull;
}

/* Mean 0, variance 1: four 16-bit uniforms summed (Irwin-Hall), centred and
 * scaled. Bounded by +-2*sqrt(3); close enough to normal for benchmarks. */
static float normalish(uint64_t *s)
{
    uint64_t r = xorshift64s(s);
    uint32_t sum = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) +
                   (uint32_t)((r >> 32) & 0xffff) + (uint32_t)(r >> 48);
    const float inv = 1.0f / 65536.0f, scale = 1.7320508f; /* sqrt(12 / 4) */
    return ((float)sum * inv + 2.0f * inv - 2.0f) * scale;
}

/* ---- writing -------------------------------------------------------------------- */

static void write_all(FILE *f, const void *p, size_t n, const char *path)
{
    if (n && fwrite(p, 1, n, f) != n)
        die("%s: write failed: %s", path, strerror(errno));
}

static void tensor_stream(const struct mk_opts *o, const struct mk_tensor *t, size_t index, FILE *f,
                          const char *path, void *chunk)
{
    uint64_t mix = o->seed * 0x100000001b3ull + index;
    uint64_t s = moe_splitmix64(&mix) | 1; /* xorshift state must be non-zero */
    int64_t n = t->rows * t->cols;
    float std = (float)o->std;
    for (int64_t i = 0; i < n; i += MK_CHUNK) {
        int64_t m = n - i < MK_CHUNK ? n - i : MK_CHUNK;
        if (o->dtype == MOE_DTYPE_F32) {
            float *c = chunk; /* (m) */
            for (int64_t j = 0; j < m; j++)
                c[j] = t->ones ? 1.0f : std * normalish(&s);
        } else {
            uint16_t *c = chunk; /* (m) */
            for (int64_t j = 0; j < m; j++)
                c[j] = moe_f32_to_bf16(t->ones ? 1.0f : std * normalish(&s));
        }
        write_all(f, chunk, (size_t)m * moe_dtype_size(o->dtype), path);
    }
}

static void shard_name(char *dst, size_t cap, int shard, int n_shard)
{
    if (n_shard == 1)
        snprintf(dst, cap, "model.safetensors");
    else
        snprintf(dst, cap, "model-%05d-of-%05d.safetensors", shard + 1, n_shard);
}

static void path_join(char *dst, size_t cap, const char *dir, const char *name)
{
    if ((size_t)snprintf(dst, cap, "%s/%s", dir, name) >= cap)
        die("path too long: %s/%s", dir, name);
}

static void shard_write(const struct mk_opts *o, const struct mk_list *l, int shard, int n_shard,
                        void *chunk)
{
    char name[64], path[4096];
    shard_name(name, sizeof(name), shard, n_shard);
    path_join(path, sizeof(path), o->out, name);

    struct mk_buf h = {0};
    buf_printf(&h, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (size_t i = 0; i < l->n; i++) {
        const struct mk_tensor *t = &l->t[i];
        if (t->shard != shard)
            continue;
        buf_printf(&h, ",\"%s\":{\"dtype\":\"%s\",\"shape\":", t->name, moe_dtype_name(o->dtype));
        if (t->is_1d)
            buf_printf(&h, "[%" PRId64 "]", t->cols);
        else
            buf_printf(&h, "[%" PRId64 ",%" PRId64 "]", t->rows, t->cols);
        buf_printf(&h, ",\"data_offsets\":[%" PRId64 ",%" PRId64 "]}", t->offset,
                   t->offset + tensor_bytes(o, t));
    }
    buf_printf(&h, "}");
    while (h.n % 8) /* data area 8-byte aligned, as the reference writer does */
        buf_printf(&h, " ");

    FILE *f = fopen(path, "wb");
    if (!f)
        die("%s: cannot create: %s", path, strerror(errno));
    uint8_t len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (uint8_t)((uint64_t)h.n >> (8 * i));
    write_all(f, len, 8, path);
    write_all(f, h.s, h.n, path);
    for (size_t i = 0; i < l->n; i++)
        if (l->t[i].shard == shard)
            tensor_stream(o, &l->t[i], i, f, path, chunk);
    if (fclose(f) != 0)
        die("%s: close failed: %s", path, strerror(errno));
    free(h.s);
}

static void index_write(const struct mk_opts *o, const struct mk_list *l, int n_shard,
                        int64_t total)
{
    char path[4096], name[64];
    path_join(path, sizeof(path), o->out, "model.safetensors.index.json");
    FILE *f = fopen(path, "w");
    if (!f)
        die("%s: cannot create: %s", path, strerror(errno));
    fprintf(f, "{\n  \"metadata\": {\"total_size\": %" PRId64 "},\n  \"weight_map\": {\n", total);
    for (size_t i = 0; i < l->n; i++) {
        shard_name(name, sizeof(name), l->t[i].shard, n_shard);
        fprintf(f, "    \"%s\": \"%s\"%s\n", l->t[i].name, name, i + 1 < l->n ? "," : "");
    }
    fprintf(f, "  }\n}\n");
    if (ferror(f) || fclose(f) != 0)
        die("%s: write failed", path);
}

static void config_write(const struct mk_opts *o)
{
    char path[4096];
    path_join(path, sizeof(path), o->out, "config.json");
    FILE *f = fopen(path, "w");
    if (!f)
        die("%s: cannot create: %s", path, strerror(errno));
    bool mix = o->arch == MK_MIXTRAL;
    if (o->arch == MK_DEEPSEEK_V3) {
        fprintf(f, "{\n");
        fprintf(f, "  \"architectures\": [\"DeepseekV3ForCausalLM\"],\n");
        fprintf(f, "  \"model_type\": \"deepseek_v3\",\n");
        fprintf(f, "  \"vocab_size\": %d,\n", o->vocab);
        fprintf(f, "  \"hidden_size\": %d,\n", o->d_model);
        fprintf(f, "  \"num_hidden_layers\": %d,\n", o->n_layer);
        fprintf(f, "  \"num_attention_heads\": %d,\n", o->n_head);
        fprintf(f, "  \"num_key_value_heads\": %d,\n", o->n_head);
        if (o->q_lora)
            fprintf(f, "  \"q_lora_rank\": %d,\n", o->q_lora);
        else
            fprintf(f, "  \"q_lora_rank\": null,\n");
        fprintf(f, "  \"kv_lora_rank\": %d,\n", o->kv_lora);
        fprintf(f, "  \"qk_rope_head_dim\": %d,\n", o->rope_dim);
        fprintf(f, "  \"qk_nope_head_dim\": %d,\n", o->nope_dim);
        fprintf(f, "  \"v_head_dim\": %d,\n", o->v_dim);
        fprintf(f, "  \"n_routed_experts\": %d,\n", o->n_expert);
        fprintf(f, "  \"num_experts_per_tok\": %d,\n", o->top_k);
        fprintf(f, "  \"moe_intermediate_size\": %d,\n", o->d_ff);
        fprintf(f, "  \"n_shared_experts\": %d,\n", o->n_shared);
        fprintf(f, "  \"intermediate_size\": %d,\n", o->d_ff_dense);
        fprintf(f, "  \"first_k_dense_replace\": %d,\n", o->first_dense);
        fprintf(f, "  \"n_group\": %d,\n", o->n_group);
        fprintf(f, "  \"topk_group\": %d,\n", o->topk_group);
        fprintf(f, "  \"norm_topk_prob\": %s,\n", o->norm_topk_prob ? "true" : "false");
        fprintf(f, "  \"routed_scaling_factor\": 2.5,\n");
        fprintf(f, "  \"topk_method\": \"noaux_tc\",\n");
        fprintf(f, "  \"scoring_func\": \"sigmoid\",\n");
        fprintf(f, "  \"rope_interleave\": true,\n");
        fprintf(f, "  \"attention_bias\": false,\n");
        fprintf(f, "  \"num_nextn_predict_layers\": 0,\n");
        fprintf(f, "  \"hidden_act\": \"silu\",\n");
        fprintf(f, "  \"max_position_embeddings\": %d,\n", o->max_pos);
        fprintf(f, "  \"rms_norm_eps\": %.9g,\n", o->rms_eps);
        fprintf(f, "  \"rope_theta\": %.1f,\n", o->rope_theta);
        fprintf(f, "  \"tie_word_embeddings\": %s,\n", o->tie ? "true" : "false");
        if (o->bos_id >= 0)
            fprintf(f, "  \"bos_token_id\": %d,\n", o->bos_id);
        else
            fprintf(f, "  \"bos_token_id\": null,\n");
        fprintf(f, "  \"eos_token_id\": %d,\n", o->eos_id);
        fprintf(f, "  \"torch_dtype\": \"%s\"\n",
                o->dtype == MOE_DTYPE_BF16 ? "bfloat16" : "float32");
        fprintf(f, "}\n");
        if (ferror(f) || fclose(f) != 0)
            die("%s: write failed", path);
        return;
    }
    fprintf(f, "{\n");
    fprintf(f, "  \"architectures\": [\"%s\"],\n",
            mix ? "MixtralForCausalLM" : "Qwen3MoeForCausalLM");
    fprintf(f, "  \"model_type\": \"%s\",\n", mix ? "mixtral" : "qwen3_moe");
    fprintf(f, "  \"vocab_size\": %d,\n", o->vocab);
    fprintf(f, "  \"hidden_size\": %d,\n", o->d_model);
    fprintf(f, "  \"num_hidden_layers\": %d,\n", o->n_layer);
    fprintf(f, "  \"num_attention_heads\": %d,\n", o->n_head);
    fprintf(f, "  \"num_key_value_heads\": %d,\n", o->n_kv_head);
    fprintf(f, "  \"head_dim\": %d,\n", o->d_head);
    fprintf(f, "  \"num_experts_per_tok\": %d,\n", o->top_k);
    if (mix) {
        fprintf(f, "  \"num_local_experts\": %d,\n", o->n_expert);
        fprintf(f, "  \"intermediate_size\": %d,\n", o->d_ff);
        fprintf(f, "  \"router_aux_loss_coef\": 0.02,\n");
    } else {
        fprintf(f, "  \"num_experts\": %d,\n", o->n_expert);
        fprintf(f, "  \"moe_intermediate_size\": %d,\n", o->d_ff);
        fprintf(f, "  \"intermediate_size\": %d,\n", o->d_ff_dense);
        fprintf(f, "  \"decoder_sparse_step\": 1,\n");
        fprintf(f, "  \"mlp_only_layers\": [");
        bool first = true;
        for (int l = 0; l < o->n_layer; l++)
            if (o->mlp_only[l]) {
                fprintf(f, "%s%d", first ? "" : ", ", l);
                first = false;
            }
        fprintf(f, "],\n");
        fprintf(f, "  \"norm_topk_prob\": %s,\n", o->norm_topk_prob ? "true" : "false");
        fprintf(f, "  \"attention_bias\": false,\n");
        fprintf(f, "  \"use_sliding_window\": false,\n");
        fprintf(f, "  \"router_aux_loss_coef\": 0.001,\n");
    }
    fprintf(f, "  \"hidden_act\": \"silu\",\n");
    fprintf(f, "  \"max_position_embeddings\": %d,\n", o->max_pos);
    fprintf(f, "  \"rms_norm_eps\": %.9g,\n", o->rms_eps);
    fprintf(f, "  \"rope_theta\": %.1f,\n", o->rope_theta);
    fprintf(f, "  \"sliding_window\": null,\n");
    fprintf(f, "  \"tie_word_embeddings\": %s,\n", o->tie ? "true" : "false");
    if (o->bos_id >= 0)
        fprintf(f, "  \"bos_token_id\": %d,\n", o->bos_id);
    else
        fprintf(f, "  \"bos_token_id\": null,\n");
    fprintf(f, "  \"eos_token_id\": %d,\n", o->eos_id);
    fprintf(f, "  \"torch_dtype\": \"%s\",\n", o->dtype == MOE_DTYPE_BF16 ? "bfloat16" : "float32");
    fprintf(f, "  \"output_router_logits\": false\n");
    fprintf(f, "}\n");
    if (ferror(f) || fclose(f) != 0)
        die("%s: write failed", path);
}

/* A stale file of the other layout would make a reader pick the wrong one
 * (the index wins over model.safetensors). */
static void remove_stale(const struct mk_opts *o, int n_shard)
{
    char path[4096];
    path_join(path, sizeof(path), o->out,
              n_shard == 1 ? "model.safetensors.index.json" : "model.safetensors");
    if (unlink(path) != 0 && errno != ENOENT)
        die("%s: cannot remove stale file: %s", path, strerror(errno));
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    struct mk_opts o;
    opts_parse(&o, argc, argv);
    double t0 = now_s();

    struct stat st;
    if (stat(o.out, &st) == 0) {
        if (!S_ISDIR(st.st_mode))
            die("--out %s exists and is not a directory", o.out);
    } else if (mkdir(o.out, 0755) != 0) {
        die("--out %s: cannot create directory: %s", o.out, strerror(errno));
    }

    struct mk_list l = {0};
    list_build(&o, &l);
    int n_shard = list_place(&o, &l);
    int64_t total = 0, n_param = 0, n_active = 0;
    for (size_t i = 0; i < l.n; i++) {
        int64_t n = l.t[i].rows * l.t[i].cols;
        total += tensor_bytes(&o, &l.t[i]);
        n_param += n;
        bool expert = strstr(l.t[i].name, ".experts.") != NULL;
        bool embed = strstr(l.t[i].name, "embed_tokens") != NULL;
        if (!embed)
            n_active += expert ? n * o.top_k / o.n_expert : n;
    }

    void *chunk = malloc((size_t)MK_CHUNK * sizeof(float)); /* (MK_CHUNK) f32 or bf16 */
    if (!chunk)
        die("out of memory");
    remove_stale(&o, n_shard);
    config_write(&o);
    for (int s = 0; s < n_shard; s++)
        shard_write(&o, &l, s, n_shard, chunk);
    if (n_shard > 1)
        index_write(&o, &l, n_shard, total);
    free(chunk);

    double dt = now_s() - t0;
    printf("moe-mkmodel: wrote %s: %s, %zu tensors in %d file%s, %.1f M params "
           "(%.1f M active per token, embeddings excluded), %.1f MB %s, %.2f s (%.0f MB/s)\n",
           o.out,
           o.arch == MK_MIXTRAL     ? "mixtral"
           : o.arch == MK_QWEN3_MOE ? "qwen3_moe"
                                    : "deepseek_v3",
           l.n, n_shard, n_shard > 1 ? "s" : "", (double)n_param / 1e6, (double)n_active / 1e6,
           (double)total / 1e6, o.dtype == MOE_DTYPE_BF16 ? "bf16" : "f32", dt,
           (double)total / 1e6 / (dt > 0 ? dt : 1e-9));
    free(l.t);
    return 0;
}
