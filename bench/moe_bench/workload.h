/* Workloads of moe-bench: where prompts come from. Every workload is
 * index-addressable: item i is the same on every rank and in every run with
 * the same --seed, so ranks can take disjoint shares of one global sequence
 * without talking to each other.
 *
 *   random             prompts of random token ids, input / output lengths
 *                      uniform in [len*(1-r), len*(1+r)] (vLLM's range ratio)
 *   sharegpt           a ShareGPT-format JSON file: [{"id", "conversations":
 *                      [{"from", "value"}, ...]}]; first turn = prompt, second =
 *                      the completion whose token count is the output length
 *   prefix_repetition  N shared prefixes of L tokens, each followed by
 *                      distinct suffixes of S tokens; prompt i uses prefix i % N
 *   trace              JSON Lines {"timestamp" (ms), "input_length",
 *                      "output_length", optional "hash_ids"} as in the
 *                      Mooncake traces: each hash id is one block of
 *                      --trace-block-size tokens made from the id, so equal
 *                      ids give equal (cacheable) prefixes
 *
 * With a tokenizer, random ids are drawn from its non-special tokens and a
 * text prompt is adjusted until it re-tokenizes to the wanted length; without
 * one, ids are drawn from [0, vocab) and prompts travel as token ids. */
#ifndef MOE_BENCH_WORKLOAD_H
#define MOE_BENCH_WORKLOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bench.h"
#include "tokenizer.h"

enum bench_dataset {
    BENCH_DS_RANDOM,
    BENCH_DS_SHAREGPT,
    BENCH_DS_PREFIX,
    BENCH_DS_TRACE,
};

/* "random", "sharegpt", "prefix_repetition", "trace" -> kind; false if unknown. */
bool bench_dataset_parse(const char *s, enum bench_dataset *out);
const char *bench_dataset_name(enum bench_dataset kind);

struct bench_workload_opts {
    enum bench_dataset kind;
    const char *path; /* sharegpt / trace file */
    uint64_t seed;
    const struct moe_tokenizer *tok; /* borrowed; may be NULL */
    int vocab;                       /* ids are drawn below this (0: the tokenizer's) */
    bool want_text;                  /* prompts must carry text */
    int random_input_len, random_output_len;
    double random_range_ratio; /* [0, 1) */
    int sharegpt_output_len;   /* 0: the completion's token count */
    int prefix_len, suffix_len, num_prefixes, prefix_output_len;
    int trace_block_size;
};

struct bench_workload;

/* Builds the workload (reads and validates the file, tokenizes it). Errors
 * name the file, the line or entry and the field. */
enum moe_status bench_workload_create(const struct bench_workload_opts *opts,
                                      struct bench_workload **out, struct moe_error *err);

void bench_workload_destroy(struct bench_workload *w);

/* Number of distinct items of a file workload; 0 for generated ones (any
 * index is valid). */
size_t bench_workload_size(const struct bench_workload *w);

/* Fills *item (owned by the caller: bench_item_clear) with item `index`.
 * File workloads repeat from the start past their size. */
enum moe_status bench_workload_item(const struct bench_workload *w, int64_t index,
                                    struct bench_item *item, struct moe_error *err);

/* The trace timestamp of item `index` (seconds from the first line; 0 for
 * workloads without timestamps). Past the file's end the trace repeats,
 * shifted by its span each time. */
double bench_workload_timestamp(const struct bench_workload *w, int64_t index);

/* A warm-up prompt: random ids (a stream of its own, so it warms no prefix
 * of the measured prompts) with the lengths of item `index`. */
enum moe_status bench_workload_warmup_item(const struct bench_workload *w, int64_t index,
                                           struct bench_item *item, struct moe_error *err);

#endif
