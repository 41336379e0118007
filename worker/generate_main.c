/* moe-generate: offline runner. Loads a model, runs one prompt, prints the
 * generated ids, the text and the speed; optionally dumps the prompt logits.
 *
 *   moe-generate --model DIR (--prompt TEXT | --tokens 1,2,3) [-n N]
 *                [--temperature T] [--top-p P] [--top-k K] [--seed S]
 *                [--dtype f32|bf16|int8] [--threads N] [--device auto|cpu|cuda[:N]]
 *                [--logits-out FILE] [--ignore-eos]
 *   moe-generate --model DIR --prompts-file FILE.jsonl [scheduler options]
 *                runs many prompts through the engine as one offline batch
 */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "backend.h"
#include "engine/generate.h"
#include "engine/draft.h"
#include "engine/engine.h"
#include "engine/engine_args.h"
#include "group/group.h"
#include "group/launch.h"
#include "kv/kv_cache.h"
#include "model/model.h"
#include "engine/offline.h"
#include "engine/perplexity.h"
#include "placement.h"
#include "engine/spec.h"
#include "tokenizer.h"

struct args {
    struct moe_launch_args launch; /* the group's flags, parsed by group/launch.c */
    const char *prompt;
    const char *tokens;
    const char *logits_out;
    int n_predict;
    float temperature;
    float top_p;
    int top_k;
    unsigned long long seed;
    bool ignore_eos;
    /* offline batch through the engine */
    struct moe_engine_args engine; /* the engine's flags, parsed by engine/engine_args.c */
    const char *prompts_file;
    bool print_outputs;
    bool host_sampling;
    bool warmup;
    const char *placement_switch; /* under mpirun */
    /* the quality meter */
    const char *perplexity;
    int ctx;
    const char *kl_save;
    const char *kl_base;
    const char *expert_stats;
};

static void usage(FILE *f)
{
    fprintf(
        f, "usage: moe-generate --model DIR (--prompt TEXT | --tokens 1,2,3) [options]\n"
           "  -n N                tokens to generate (default 32)\n"
           "  --temperature T     0 = greedy (default 0)\n"
           "  --top-p P           nucleus sampling, (0, 1] (default 1)\n"
           "  --top-k K           keep the K most likely tokens, 0 = off (default 0)\n"
           "  --seed S            sampling seed (default 0)\n"
           "  --dtype T           weights in memory: f32, bf16 (default), int8 (Linear\n"
           "                      weights quantized per output row at load) or int4 (per\n"
           "                      group of --group-size columns); int8, int4: CPU only\n"
           "  --group-size G      int4 columns per scale: 32 (default), 64 or 128\n"
           "  --exact             f32 activations in every matmul (default: bf16 / int8\n"
           "                      activations where the CPU has dot-product instructions)\n"
           "  --batch-invariant   every token's results independent of what it is batched\n"
           "                      with (deterministic serving; CPU: slower prefill)\n"
           "  --no-cuda-graphs    never replay decode steps as CUDA graphs (graphs run\n"
           "                      only where MOE_CUDA_GRAPHS=1 until a GPU has run them)\n"
           "  --threads N         CPU threads, 0 = all cores (default 0)\n"
           "  --device D          auto|cpu|cuda|cuda:N (default auto; cuda: under mpirun\n"
           "                      each rank takes the GPU of its local rank)\n"
           "  --logits-out FILE   write prompt logits: f32 LE, one row of vocab_size per position\n"
           "  --ignore-eos        do not stop at an end-of-sequence token\n"
           "offline batch (engine):\n"
           "  --prompts-file F    JSON Lines: {\"prompt\": TEXT} or {\"tokens\": [..]}, optional\n"
           "                      max_tokens, temperature, top_p, top_k, seed, stop, ...\n"
           "                      (-n, --temperature, ... give the defaults)\n"
           "  --kv-blocks N       KV cache blocks (default: from --kv-memory)\n"
           "  --kv-memory MIB     KV cache budget in MiB (default 512)\n"
           "  --kv-dtype T        KV cache elements: bf16 (CPU default: twice the tokens in\n"
           "                      the same memory) or f32 (CUDA default, and with --exact;\n"
           "                      bf16 on CUDA: opt-in, not yet measured on a GPU)\n"
           "  --block-size N      tokens per KV block (default 16)\n"
           "  --max-batch-tokens N  token budget per step (default 512)\n"
           "  --max-running N     cap on running sequences (default 64)\n"
           "  --no-prefix-cache   disable prefix caching\n"
           "  --spec-tokens K     speculative decoding: up to K draft tokens per decode step,\n"
           "                      0..16, 0 = off (default 0); same output, fewer steps\n"
           "  --draft-model DIR   draft the guesses with this small model (the model's\n"
           "                      tokenizer; default: n-gram lookup in the sequence)\n"
           "  --spec-max-batch N  no drafts in a step with more than N decode rows\n"
           "                      (0 = no limit; default 8)\n"
           "  --spec-policy P     acceptance (default): draft as many as the sequence's\n"
           "                      recent guesses were kept; cost: only the guesses that\n"
           "                      raise throughput at the measured step and draft costs\n"
           "  --print-outputs     print every request's tokens (and text)\n"
           "  --host-sampling     sample on the host (default on a GPU: greedy and\n"
           "                      temperature / top_p rows drawn on the device)\n"
           "quality meter (definitions in the README):\n"
           "  --perplexity FILE   perplexity of the text in FILE, in windows of --ctx tokens\n"
           "  --ctx N             window length (default 512, at most max_position_embeddings)\n"
           "  --kl-save F.bin     also save this run's next-token distributions as a base\n"
           "  --kl-base F.bin     KL divergence and top-1 agreement against a saved base\n"
           "  --expert-stats F    after the run, write the tokens routed to each expert as\n"
           "                      JSON (the format of moectl --json experts stats; moe-prune\n"
           "                      reads it)\n"
           "  --profile           print where the forward time went, per rank (stderr)\n"
           "  --warmup            --prompt / --tokens: run the prompt's prefill once first,\n"
           "                      untimed and uncounted (as llama-bench's warm-up run: the\n"
           "                      first forward also pays for first-touch memory)\n"
           "under mpirun (one model replica over all ranks):\n"
           "  --tp T              tensor-parallel size for attention (default 1)\n"
           "  --dp-attention      data-parallel attention (TP 1): every rank runs attention\n"
           "                      for its own sequences over its own KV cache (--kv-blocks /\n"
           "                      --kv-memory per rank); experts stay split over all ranks\n"
           "  --placement F.json  expert placement (default: even contiguous split)\n"
           "  --placement-switch F.json  move to this placement while running (epoch 1)\n"
           "  --comm-timeout-ms MS  a collective that takes longer fails the group (default "
           "10000)\n");
}

#define ARRAY_LEN(t) (sizeof(t) / sizeof *(t))

/* The options whose value needs its own check (not a plain string or a
 * whole number in a range): 0, or the exit code of a bad value. */
static int parse_special(const char *k, const char *v, struct args *a)
{
    long n;
    if (!strcmp(k, "--temperature")) {
        if (!cli_parse_float(v, 0.0f, 100.0f, &a->temperature))
            return cli_fail("--temperature: '%s' is not a number in [0, 100]", v);
    } else if (!strcmp(k, "--top-p")) {
        if (!cli_parse_float(v, 0.0f, 1.0f, &a->top_p) || a->top_p == 0.0f)
            return cli_fail("--top-p: '%s' is not a number in (0, 1]", v);
    } else if (!strcmp(k, "--top-k")) {
        if (!cli_parse_long(v, 0, INT_MAX, &n))
            return cli_fail("--top-k: '%s' is not a whole number >= 0", v);
        a->top_k = (int)n;
    } else if (!strcmp(k, "--seed")) {
        char *end;
        errno = 0;
        a->seed = strtoull(v, &end, 10);
        if (errno || end == v || *end || *v == '-')
            return cli_fail("--seed: '%s' is not a whole number >= 0", v);
    }
    return 0;
}

/* The options that make sense together: a model and exactly one source of
 * prompts. */
static int check_args(const struct args *a)
{
    int rc = moe_launch_cli_check(&a->launch);
    if (rc)
        return rc;
    if ((a->prompt != NULL) + (a->tokens != NULL) + (a->prompts_file != NULL) +
            (a->perplexity != NULL) !=
        1)
        return cli_fail("give exactly one of --prompt TEXT, --tokens IDS, --prompts-file FILE or "
                        "--perplexity FILE");
    if ((a->kl_save || a->kl_base || a->ctx) && !a->perplexity)
        return cli_fail("--ctx, --kl-save and --kl-base go with --perplexity FILE");
    if (a->engine.given && !a->prompts_file)
        return cli_fail("%s goes with --prompts-file (the engine); --prompt, --tokens and "
                        "--perplexity run one sequence without it",
                        a->engine.given);
    if (a->warmup && !a->prompt && !a->tokens)
        return cli_fail("--warmup goes with --prompt TEXT or --tokens IDS");
    if (a->logits_out && a->prompts_file)
        return cli_fail("--logits-out works with one prompt, not with --prompts-file");
    return 0;
}

static int parse_args(int argc, char **argv, struct args *a)
{
    *a = (struct args){.n_predict = 32, .top_p = 1.0f};
    moe_launch_args_init(&a->launch);
    moe_engine_args_init(&a->engine);
    const struct cli_opt opts[] = {
        {"--ignore-eos", CLI_SWITCH, &a->ignore_eos, 0, 0},
        {"--profile", CLI_SWITCH, &a->launch.profile, 0, 0},
        {"--warmup", CLI_SWITCH, &a->warmup, 0, 0},
        {"--print-outputs", CLI_SWITCH, &a->print_outputs, 0, 0},
        {"--host-sampling", CLI_SWITCH, &a->host_sampling, 0, 0},
        {"--prompt", CLI_STR, &a->prompt, 0, 0},
        {"--tokens", CLI_STR, &a->tokens, 0, 0},
        {"--logits-out", CLI_STR, &a->logits_out, 0, 0},
        {"--placement-switch", CLI_STR, &a->placement_switch, 0, 0},
        {"--prompts-file", CLI_STR, &a->prompts_file, 0, 0},
        {"--perplexity", CLI_STR, &a->perplexity, 0, 0},
        {"--kl-save", CLI_STR, &a->kl_save, 0, 0},
        {"--kl-base", CLI_STR, &a->kl_base, 0, 0},
        {"--expert-stats", CLI_STR, &a->expert_stats, 0, 0},
        {"-n", CLI_INT, &a->n_predict, 0, 1 << 20},
        {"--n-predict", CLI_INT, &a->n_predict, 0, 1 << 20},
        {"--ctx", CLI_INT, &a->ctx, 4, 1 << 20},
        {"--temperature", CLI_OTHER, NULL, 0, 0},
        {"--top-p", CLI_OTHER, NULL, 0, 0},
        {"--top-k", CLI_OTHER, NULL, 0, 0},
        {"--seed", CLI_OTHER, NULL, 0, 0},
    };
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            usage(stdout);
            exit(0);
        }
        int rc = moe_engine_cli_flags(&a->launch, &a->engine, argc, argv, &i);
        if (rc != 1) {
            if (rc)
                return rc;
            continue;
        }
        const struct cli_opt *o;
        const char *v;
        rc = cli_take(opts, ARRAY_LEN(opts), argc, argv, &i, &o, &v);
        if (rc == 1) {
            usage(stderr);
            return cli_fail("unknown option '%s'", k);
        }
        if (rc || (o && (rc = parse_special(o->name, v, a))))
            return rc;
    }
    return check_args(a);
}

/* "1,2, 3" -> ids; every id must be a whole number in [0, vocab). */
static int parse_tokens(const char *s, int vocab, int32_t **out, int *n_out)
{
    size_t cap = 16, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids)
        return cli_fail("out of memory");
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
            return cli_fail("--tokens: '%.20s' is not a token id in [0, %d)", p, vocab);
        }
        if (n == cap) {
            int32_t *grown = realloc(ids, (cap *= 2) * sizeof *ids);
            if (!grown) {
                free(ids);
                return cli_fail("out of memory");
            }
            ids = grown;
        }
        ids[n++] = (int32_t)v;
        p = end;
        if (*p && *p != ',' && *p != ' ') {
            free(ids);
            return cli_fail("--tokens: unexpected character in '%s'", s);
        }
    }
    if (!n) {
        free(ids);
        return cli_fail("--tokens: no token ids in '%s'", s);
    }
    *out = ids;
    *n_out = (int)n;
    return 0;
}

static int write_logits(const char *path, const float *logits, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return cli_fail("%s: %s", path, strerror(errno));
    size_t w = fwrite(logits, sizeof *logits, n, f);
    int close_rc = fclose(f);
    if (w != n || close_rc)
        return cli_fail("%s: write failed: %s", path, strerror(errno));
    return 0;
}

/* --prompts-file: every prompt through the engine at once; prints the
 * throughput and the KV cache figures. Returns the exit code. */
static int run_batch(const struct args *a, struct moe_model *model, struct moe_tokenizer *tok,
                     struct moe_group *group, const struct moe_model_opts *mopts,
                     struct moe_backend *be)
{
    const struct moe_config *cfg = moe_model_config(model);
    struct moe_error err = {0};
    struct moe_model *draft = NULL; /* the leader's alone */
    struct moe_engine_opts eo = {
        .forward = group ? moe_group_forward : NULL,
        .forward_ctx = group,
        .forward_ids = group && !group->dp, /* dp_forward gathers logits */
        .backend_sampling = be->device != MOE_DEVICE_CPU,
        .host_sampling = a->host_sampling,
    };
    if (moe_engine_args_apply(&a->engine, model, mopts, be, group ? group->dp_size : 1, &eo, &draft,
                              &err))
        return cli_fail("%s", err.msg);
    size_t block_bytes = moe_engine_block_bytes(model, draft, eo.block_size);
    struct moe_request_params defaults;
    moe_request_params_init(&defaults);
    defaults.max_tokens = a->n_predict > 0 ? a->n_predict : 16;
    defaults.sp = (struct moe_sampler_params){
        .temperature = a->temperature, .top_p = a->top_p, .top_k = a->top_k};
    defaults.ignore_eos = a->ignore_eos;
    if (a->seed) {
        defaults.has_seed = true;
        defaults.seed = a->seed;
    }
    struct moe_offline_set set = {0};
    struct moe_engine *e = NULL;
    struct moe_offline_report rep;
    int rc = 1;
    if (moe_offline_load(a->prompts_file, tok, &defaults, cfg->vocab_size, &set, &err) ||
        moe_engine_create(model, tok, &eo, &e, &err) ||
        moe_offline_run(e, &set, eo.block_size, &rep, &err)) {
        fprintf(stderr, "moe-generate: %s\n", err.msg);
        goto out;
    }
    for (int i = 0; i < set.n && a->print_outputs; i++) {
        const struct moe_offline_request *r = &set.req[i];
        printf("request %d (line %d): %s, tokens:", i, r->line, moe_finish_name(r->finish));
        for (int j = 0; j < r->n_out; j++)
            printf(" %d", r->out[j]);
        printf("\n");
        char *text = NULL;
        size_t len = 0;
        if (tok && !moe_tokenizer_decode(tok, r->out, (size_t)r->n_out, true, &text, &len, NULL))
            printf(
                "  text: %.*s\n",
                (int)(r->text_len >= 0 && r->text_len < (int64_t)len ? r->text_len : (int64_t)len),
                text);
        free(text);
    }
    printf("requests: %d, prompt tokens %lld (prefix-cache hits %lld), output tokens %lld\n", set.n,
           (long long)rep.prompt_tokens, (long long)rep.prefix_hit_tokens,
           (long long)rep.output_tokens);
    if (eo.kv_parts > 1) {
        struct moe_engine_stats st;
        moe_engine_stats(e, &st);
        printf(
            "dp attention: %d DP groups, each its own KV cache of %d blocks; tokens run per group:",
            eo.kv_parts, eo.n_block / eo.kv_parts);
        for (int r = 0; r < st.kv_parts; r++)
            printf(" %lld", (long long)st.part_tokens[r]);
        printf("\n");
    }
    printf("engine: %d KV blocks x %d tokens of %s (%.1f MiB, %zu bytes per token%s), max batch "
           "tokens %d, max running %d\n",
           eo.n_block, eo.block_size, moe_kv_dtype_flag(moe_model_kv_dtype(model)),
           (double)block_bytes * eo.n_block / (1 << 20), block_bytes / (size_t)eo.block_size,
           draft ? " with the draft's" : "", eo.max_batch_tokens ? eo.max_batch_tokens : 512,
           eo.max_running ? eo.max_running : 64);
    printf("time: %.2f s, %lld steps, %lld preemptions, peak running %d\n", rep.wall_s,
           (long long)rep.steps, (long long)rep.preemptions, rep.peak_running);
    if (eo.spec_tokens)
        printf(
            "speculation: up to %d draft tokens per step, %lld proposed, %lld accepted "
            "(%.1f%%)\n",
            eo.spec_tokens, (long long)rep.spec_draft_tokens, (long long)rep.spec_accepted_tokens,
            rep.spec_draft_tokens ? 100.0 * rep.spec_accepted_tokens / rep.spec_draft_tokens : 0.0);
    printf("throughput: %.1f output tokens/s, %.1f total tokens/s\n",
           rep.output_tokens / rep.wall_s, (rep.prompt_tokens + rep.output_tokens) / rep.wall_s);
    printf("latency: TTFT mean %.3f s p50 %.3f s p99 %.3f s, TPOT mean %.1f ms\n", rep.ttft_mean_s,
           rep.ttft_p50_s, rep.ttft_p99_s, rep.tpot_mean_s * 1e3);
    printf("kv utilisation: mean %.3f, min %.3f (tokens stored / slots of blocks held)\n",
           rep.kv_util_mean, rep.kv_util_min);
    if (rep.decode_steps)
        printf("decode step at batch %d: median %.3f ms (p10 %.3f, p90 %.3f) over %lld steps "
               "(every request running one token, after 2 warm-up steps)\n",
               set.n, rep.decode_step_p50_s * 1e3, rep.decode_step_p10_s * 1e3,
               rep.decode_step_p90_s * 1e3, (long long)rep.decode_steps);
    rc = 0;
out:
    moe_engine_destroy(e);
    moe_model_free(draft);
    moe_offline_free(&set);
    return rc;
}

#define MOE_MAX_EP_RANKS_PRINT 64

/* One line per rank on stderr: the phase split of the forward passes and the
 * expert-parallel bytes this rank sent. */
static void print_profile(const struct moe_model *model, const struct moe_group *group,
                          struct moe_backend *be, const struct moe_backend_counters *at_load)
{
    struct moe_model_profile p;
    moe_model_profile(model, &p);
    uint64_t bytes, rows;
    moe_model_ep_traffic(model, &bytes, &rows);
    double total =
        p.attention_s + p.router_s + p.dispatch_s + p.experts_s + p.combine_s + p.other_s;
    if (total <= 0)
        total = 1e-9;
    fprintf(
        stderr,
        "profile rank %d: %llu forwards, %llu tokens, %.3f s: attention %.3f s (%.0f%%), router "
        "%.3f s (%.0f%%), dispatch %.3f s (%.0f%%), experts %.3f s (%.0f%%), combine %.3f s "
        "(%.0f%%), other %.3f s (%.0f%%); ep_bytes_sent %llu moe_layer_tokens %llu "
        "rows_computed %llu\n",
        group ? group->rank : 0, (unsigned long long)p.forwards, (unsigned long long)p.tokens,
        total, p.attention_s, 100 * p.attention_s / total, p.router_s, 100 * p.router_s / total,
        p.dispatch_s, 100 * p.dispatch_s / total, p.experts_s, 100 * p.experts_s / total,
        p.combine_s, 100 * p.combine_s / total, p.other_s, 100 * p.other_s / total,
        (unsigned long long)bytes, (unsigned long long)p.moe_layer_tokens,
        (unsigned long long)moe_model_ep_rows_computed(model));
    if (be->ops->counters && p.forwards) {
        struct moe_backend_counters k;
        be->ops->counters(be, &k);
        double f = (double)p.forwards;
        fprintf(stderr,
                "profile rank %d: backend %s per forward (after the load): %.1f ops, %.1f host "
                "waits, %.1f uploads (%.0f bytes), %.1f downloads (%.0f bytes)\n",
                group ? group->rank : 0, be->name, (k.ops - at_load->ops) / f,
                (k.syncs - at_load->syncs) / f, (k.uploads - at_load->uploads) / f,
                (k.upload_bytes - at_load->upload_bytes) / f,
                (k.downloads - at_load->downloads) / f,
                (k.download_bytes - at_load->download_bytes) / f);
    }
}

/* What main builds; gen_run_close frees it. */
struct gen_run {
    struct args a;
    struct moe_error err;
    struct moe_launch launch;
    struct moe_group *group; /* = launch.group */
    struct moe_backend *be;  /* = launch.be */
    struct moe_model *model;
    const struct moe_config *cfg;
    double t_load;                       /* seconds moe_model_load took */
    struct moe_backend_counters at_load; /* the backend's counters after the load (--profile) */
    struct moe_tokenizer *tok;
    int32_t *prompt; /* (n_prompt) */
    int n_prompt;
    float *logits; /* (n_prompt, vocab_size) with --logits-out */
    char *text;    /* the generated tokens, decoded */
    struct moe_gen_result res;
};

/* Prints the error in g->err ("rank R: " first under mpirun); returns the
 * exit code of a failed run. */
static int report_error(const struct gen_run *g)
{
    if (g->group)
        fprintf(stderr, "moe-generate: rank %d: %s\n", g->group->rank, g->err.msg);
    else
        fprintf(stderr, "moe-generate: %s\n", g->err.msg);
    return 1;
}

/* MPI (when under mpirun) and the backend; with --placement-switch the
 * leader proposes the new placement for epoch 1 before anything runs. */
static enum moe_status start_group(struct gen_run *g, int *argc, char ***argv)
{
    const struct args *a = &g->a;
    enum moe_status rc = moe_launch_start(argc, argv, &a->launch, &g->launch, &g->err);
    if (rc)
        return rc;
    g->group = g->launch.group;
    g->be = g->launch.be;
    if (g->group && a->placement_switch && g->group->rank == 0) {
        struct moe_placement next;
        if ((rc = moe_placement_load_for_model(a->placement_switch, a->launch.model, g->group->size,
                                               &next, &g->err)))
            return rc;
        rc = moe_group_propose_placement(g->group, &next, 1, &g->err);
        moe_placement_free(&next);
    }
    return rc;
}

/* This rank's part of the model, timed; under mpirun one line per rank. */
static enum moe_status load_model(struct gen_run *g)
{
    struct moe_model_opts mo = g->launch.model_opts;
    g->t_load = moe_now();
    enum moe_status rc = moe_model_load(g->a.launch.model, &mo, g->be, &g->model, &g->err);
    if (rc)
        return rc;
    g->t_load = moe_now() - g->t_load;
    if (g->be->ops->counters)
        g->be->ops->counters(g->be, &g->at_load);
    g->cfg = moe_model_config(g->model);
    if (g->cfg->n_mtp && (!g->group || g->group->rank == 0))
        fprintf(stderr,
                "moe-generate: %s: num_nextn_predict_layers %d: the multi-token-prediction "
                "layers are not used (ignored at load)\n",
                g->a.launch.model, g->cfg->n_mtp);
    if (g->group) {
        fprintf(stderr, "moe-generate: rank %d of %d (tp %d/%d): %.1f MiB of weights\n",
                g->group->rank, g->group->size, g->group->tp_rank, g->group->tp_size,
                (double)moe_model_weight_bytes(g->model) / (1024.0 * 1024.0));
    }
    return MOE_OK;
}

/* The model's tokenizer.json: required with --prompt, optional otherwise
 * (random benchmark models have none). */
static enum moe_status load_tokenizer(struct gen_run *g)
{
    char tok_path[4096];
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", g->a.launch.model);
    FILE *probe = fopen(tok_path, "rb");
    if (!probe && !g->a.prompt && !g->a.perplexity)
        return MOE_OK;
    if (probe)
        fclose(probe);
    enum moe_status rc = moe_tokenizer_load(tok_path, &g->tok, &g->err);
    if (rc)
        return rc;
    if (moe_tokenizer_n_vocab(g->tok) > g->cfg->vocab_size)
        return moe_error_set(&g->err, MOE_ERR_FORMAT,
                             "%s: %d token ids but config.json vocab_size is %d", tok_path,
                             moe_tokenizer_n_vocab(g->tok), g->cfg->vocab_size);
    return MOE_OK;
}

/* The prompt's ids, from --prompt (encoded) or --tokens. Returns 0 or the
 * exit code, the error reported. */
static int read_prompt(struct gen_run *g)
{
    if (!g->a.prompt)
        return parse_tokens(g->a.tokens, g->cfg->vocab_size, &g->prompt, &g->n_prompt);
    size_t n = 0;
    if (moe_tokenizer_encode(g->tok, g->a.prompt, strlen(g->a.prompt), true, &g->prompt, &n,
                             &g->err))
        return report_error(g);
    if (n == 0) {
        moe_error_set(&g->err, MOE_ERR_INVALID, "--prompt: the prompt encodes to no tokens");
        return report_error(g);
    }
    g->n_prompt = (int)n;
    return 0;
}

/* The speed lines after a single-prompt run. */
static void print_speed(const struct gen_run *g)
{
    const struct args *a = &g->a;
    const struct moe_gen_result *res = &g->res;
    double decode_tps =
        res->n_tokens > 1 && res->decode_s > 0 ? (res->n_tokens - 1) / res->decode_s : 0;
    printf("model: %s (%s, %s%s, %.1f MiB of weights, loaded in %.2f s) on %s\n", a->launch.model,
           moe_launch_dtype_flag(a->launch.dtype), a->launch.exact ? "exact" : "fast",
           g->launch.model_opts.batch_invariant ? ", batch-invariant" : "",
           (double)moe_model_weight_bytes(g->model) / (1024.0 * 1024.0), g->t_load, g->be->label);
    printf("prefill: %d tokens in %.3f s, %.1f tokens/s\n", g->n_prompt, res->prefill_s,
           res->prefill_s > 0 ? g->n_prompt / res->prefill_s : 0);
    printf("decode: %d tokens in %.3f s, %.1f tokens/s%s\n",
           res->n_tokens > 0 ? res->n_tokens - 1 : 0, res->decode_s, decode_tps,
           res->stopped_at_eos ? " (stopped at EOS)" : "");
    if (g->group) {
        uint64_t bytes, rows;
        moe_model_ep_traffic(g->model, &bytes, &rows);
        printf("group: %d ranks, tp %d; rank 0 sent %llu bytes for %llu routed rows in the expert "
               "all-to-alls\n",
               g->group->size, g->group->tp_size, (unsigned long long)bytes,
               (unsigned long long)rows);
    }
}

/* --prompt or --tokens: one sequence through moe_generate; prints the ids,
 * the text and the speed, and writes --logits-out. Returns the exit code. */
static int run_prompt(struct gen_run *g)
{
    const struct args *a = &g->a;
    int rc = read_prompt(g);
    if (rc)
        return rc;
    size_t n_logits = (size_t)g->n_prompt * (size_t)g->cfg->vocab_size;
    if (a->logits_out && !(g->logits = malloc(n_logits * sizeof *g->logits))) {
        moe_error_set(&g->err, MOE_ERR_NOMEM, "out of memory for %d rows of logits", g->n_prompt);
        return report_error(g);
    }
    struct moe_gen_opts go = {
        .n_predict = a->n_predict,
        .sp = {.temperature = a->temperature, .top_p = a->top_p, .top_k = a->top_k},
        .seed = a->seed,
        .ignore_eos = a->ignore_eos,
        .forward = g->group ? moe_group_forward : NULL,
        .forward_ctx = g->group,
    };
    if (a->warmup) {
        if (g->group) {
            moe_error_set(&g->err, MOE_ERR_INVALID,
                          "--warmup: single-process runs only (not under mpirun)");
            return report_error(g);
        }
        struct moe_gen_opts wo = go;
        wo.n_predict = 0;
        struct moe_gen_result wr;
        if (moe_generate(g->model, g->prompt, g->n_prompt, &wo, NULL, &wr, &g->err))
            return report_error(g);
        moe_gen_result_free(&wr);
        moe_model_reset_counters(g->model);
        if (g->be->ops->counters)
            g->be->ops->counters(g->be, &g->at_load);
    }
    if (moe_generate(g->model, g->prompt, g->n_prompt, &go, g->logits, &g->res, &g->err))
        return report_error(g);
    if (a->logits_out && (rc = write_logits(a->logits_out, g->logits, n_logits)))
        return rc;

    printf("tokens:");
    for (int i = 0; i < g->res.n_tokens; i++)
        printf(" %d", g->res.tokens[i]);
    printf("\n");
    if (g->tok) {
        size_t len;
        if (moe_tokenizer_decode(g->tok, g->res.tokens, (size_t)g->res.n_tokens, true, &g->text,
                                 &len, &g->err)) {
            report_error(g);
            return a->logits_out ? 0 : 1; /* the exit code this path has always had */
        }
        printf("text: %s\n", g->text);
    }
    print_speed(g);
    return 0;
}

/* --expert-stats FILE: the per-expert token counts of this run, in the
 * format of `moectl --json experts stats`. Returns the exit code. */
static int write_expert_stats(struct gen_run *g)
{
    const struct moe_config *c = g->cfg;
    const uint64_t *t = moe_model_expert_tokens(g->model);
    FILE *f = fopen(g->a.expert_stats, "w");
    if (!f)
        return cli_fail("--expert-stats %s: %s", g->a.expert_stats, strerror(errno));
    fprintf(f,
            "{\"stats_layers\": %d, \"stats_experts\": %d, \"source\": \"moe-generate\", "
            "\"expert_tokens\": [",
            c->n_layer, c->n_expert);
    for (int i = 0; i < c->n_layer * c->n_expert; i++)
        fprintf(f, "%s%llu", i ? ", " : "", (unsigned long long)t[i]);
    fprintf(f, "]}\n");
    if (fclose(f))
        return cli_fail("--expert-stats %s: write failed: %s", g->a.expert_stats, strerror(errno));
    return 0;
}

static void print_ppl_progress(void *ctx, int window, int n_window, double ppl)
{
    (void)ctx;
    fprintf(stderr, "[%d/%d] %.4f%s", window, n_window, ppl, window == n_window ? "\n" : " ");
}

/* --perplexity FILE: the quality meter (engine/perplexity.h). Returns the
 * exit code. */
static int run_perplexity(struct gen_run *g)
{
    const struct args *a = &g->a;
    size_t n = 0;
    if (moe_perplexity_tokenize_file(g->tok, a->perplexity, &g->prompt, &n, &g->err))
        return report_error(g);
    int ctx = a->ctx ? a->ctx : (g->cfg->max_pos < 512 ? g->cfg->max_pos : 512);
    struct moe_ppl_opts po = {.ctx = ctx,
                              .kl_save = a->kl_save,
                              .kl_base = a->kl_base,
                              .forward = g->group ? moe_group_forward : NULL,
                              .forward_ctx = g->group,
                              .progress = print_ppl_progress};
    struct moe_ppl_result r;
    if (moe_perplexity(g->model, g->prompt, n, &po, &r, &g->err))
        return report_error(g);
    printf("perplexity: %s, %zu tokens, %d windows of %d, %lld scored (positions %d..%d of each)\n",
           a->perplexity, n, r.n_window, ctx, (long long)r.n_scored, ctx / 2, ctx - 2);
    printf("ppl: %.6f (mean nll %.6f nats), %s weights, %s, %s KV, %.2f s\n", r.ppl, r.nll_mean,
           moe_launch_dtype_flag(a->launch.dtype), a->launch.exact ? "exact" : "fast",
           moe_kv_dtype_flag(moe_model_kv_dtype(g->model)), r.seconds);
    if (r.has_base)
        printf("kl: vs %s (base ppl %.6f): mean %.6g, median %.6g, p99 %.6g, max %.6g; top-1 "
               "agreement %.4f%%\n",
               a->kl_base, r.base_ppl, r.kl_mean, r.kl_median, r.kl_p99, r.kl_max, 100 * r.top1);
    if (a->kl_save)
        printf("saved: %s (%lld rows of %d log-probabilities)\n", a->kl_save, (long long)r.n_scored,
               g->cfg->vocab_size);
    return 0;
}

/* At the end, on every path: what --profile and --placement-switch report
 * (per rank, and for the group on the leader). */
static void print_group_report(const struct gen_run *g)
{
    const struct args *a = &g->a;
    struct moe_group *group = g->group;
    if (a->launch.profile && g->model)
        print_profile(g->model, group, g->be, &g->at_load);
    if (g->model) { /* CUDA graphs (opt-in): whether they ran */
        struct moe_model_profile p;
        moe_model_profile(g->model, &p);
        if (p.graphs_recorded || p.graphs_replayed)
            printf("graphs: %llu steps recorded, %llu replayed, of %llu forwards\n",
                   (unsigned long long)p.graphs_recorded, (unsigned long long)p.graphs_replayed,
                   (unsigned long long)p.forwards);
    }
    if (a->launch.profile && group && group->rank == 0 && group->size > 1) {
        uint64_t rows[MOE_MAX_EP_RANKS_PRINT], steps, max = 0, sum = 0;
        int n = group->size < MOE_MAX_EP_RANKS_PRINT ? group->size : MOE_MAX_EP_RANKS_PRINT;
        if (group->size <= MOE_MAX_EP_RANKS_PRINT) {
            moe_group_rank_rows(group, rows, &steps);
            printf("expert rows per rank over %llu steps:", (unsigned long long)steps);
            for (int r = 0; r < n; r++) {
                printf(" %llu", (unsigned long long)rows[r]);
                sum += rows[r];
                max = rows[r] > max ? rows[r] : max;
            }
            printf("; max/mean %.3f\n", sum ? (double)max * n / (double)sum : 0.0);
        }
    }
    if (group && group->rank == 0 && a->placement_switch) {
        double pause;
        int64_t epoch = moe_group_placement_epoch(group, &pause);
        printf("placement: epoch %lld in force, the switch paused one step for %.3f ms\n",
               (long long)epoch, pause * 1e3);
    }
}

/* Stops the group (on the leader) and frees what the run built. */
static void gen_run_close(struct gen_run *g)
{
    if (g->group && g->group->rank == 0) {
        struct moe_error stop_err;
        if (moe_group_stop(g->group, &stop_err))
            fprintf(stderr, "moe-generate: stopping the group: %s\n", stop_err.msg);
    }
    moe_gen_result_free(&g->res);
    free(g->text);
    free(g->logits);
    free(g->prompt);
    moe_tokenizer_free(g->tok);
    moe_model_free(g->model);
    moe_launch_finish(&g->launch);
}

int main(int argc, char **argv)
{
    cli_init("moe-generate");
    struct gen_run run = {0}, *g = &run;
    int rc = parse_args(argc, argv, &g->a);
    if (rc)
        return rc;

    if (start_group(g, &argc, &argv) || load_model(g))
        rc = report_error(g);
    else if (g->group && g->group->rank != 0) /* a follower: runs the leader's steps */
        rc = moe_group_follow(g->group, g->model, &g->err) ? report_error(g) : 0;
    else if (load_tokenizer(g))
        rc = report_error(g);
    else if (g->a.prompts_file)
        rc = run_batch(&g->a, g->model, g->tok, g->group, &g->launch.model_opts, g->be);
    else if (g->a.perplexity)
        rc = run_perplexity(g);
    else
        rc = run_prompt(g);
    if (!rc && g->a.expert_stats && g->model && (!g->group || g->group->rank == 0))
        rc = write_expert_stats(g);
    print_group_report(g);
    gen_run_close(g);
    return rc;
}
