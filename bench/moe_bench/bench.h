/* moe-bench: the serving load generator. Types shared by its parts.
 *
 *   workload.c   prompts (random, ShareGPT, prefix repetition, trace replay),
 *                index-addressable and reproducible from --seed
 *   schedule.c   arrival times (inf, Poisson, gamma; a trace's timestamps)
 *   client_*.c   one request against one target (gRPC Generate stream, or
 *                OpenAI SSE over libcurl), filling a bench_record
 *   runner.c     one rank's load: dispatcher + bounded pool of request threads
 *   record.c     per-request records, packed for the MPI gather
 *   metrics.c    vLLM's definitions (TTFT, TPOT, ITL, E2EL, goodput)
 *   report.c     summary table, result JSON, per-request JSONL
 *   plot.c       PNG charts drawn with cairo
 *
 * Times inside a run are seconds on the client's monotonic clock, relative
 * to the run's common start (every rank starts from the same instant). */
#ifndef MOE_BENCH_H
#define MOE_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_error.h"
#include "clock.h"

/* ---- one prompt of a workload ------------------------------------------------ */

struct bench_item {
    int32_t *ids; /* (n_ids) prompt token ids, or NULL when only text is known */
    int n_ids;
    char *text;         /* prompt text, or NULL when only ids are known */
    int input_len;      /* prompt tokens as the client counts them */
    int output_len;     /* max_tokens asked for */
    double timestamp_s; /* trace arrival (--fixed-schedule); 0 otherwise */
};

/* Frees what the item owns and zeroes it. NULL is a no-op. */
void bench_item_clear(struct bench_item *item);

/* ---- one request's outcome ---------------------------------------------------- */

#define BENCH_STATUS_MAX 48
#define BENCH_ERROR_MAX 256

struct bench_record {
    int64_t index;  /* global request index (disjoint across ranks) */
    int32_t rank;   /* MPI rank that sent it */
    int32_t target; /* index into the --base-url list */
    int32_t success;
    int32_t input_len;           /* server's prompt_tokens when it says, else the client's */
    int32_t output_len;          /* generated tokens (server usage, else counted) */
    int32_t expected_output_len; /* max_tokens asked for */
    int32_t counted_tokens;      /* tokens the client counted in the stream */
    /* The server's own accounting, -1 where it gave none. */
    int32_t server_prompt_tokens, server_completion_tokens, server_cached_tokens;
    double arrival_s; /* scheduled arrival */
    double start_s;   /* request sent (>= arrival: client-side queueing before) */
    double ttft_s;    /* first token - start */
    double e2el_s;    /* last token - start (vLLM's "latency") */
    /* gRPC Timings of the last message (ms); NAN when absent. */
    double srv_queue_ms, srv_prefill_ms, srv_ttft_ms, srv_decode_ms, srv_e2e_ms, srv_transfer_ms;
    char status[BENCH_STATUS_MAX]; /* "OK", "UNAVAILABLE", "HTTP 503", "finish:error" ... */
    char error[BENCH_ERROR_MAX];   /* one line, empty on success */
    char finish[16];               /* "length", "stop", ... as the server said */
    /* One entry per streamed chunk that carried tokens: its arrival time
     * (relative to start_s) and its token count. ITL i = chunk_t[i+1] - chunk_t[i]. */
    int n_chunks, cap_chunks;
    double *chunk_t;  /* (n_chunks) */
    int32_t *chunk_n; /* (n_chunks) */
};

/* Appends one token-carrying chunk at time t (relative to start). */
enum moe_status bench_record_add_chunk(struct bench_record *r, double t, int n_tokens);

/* Frees the chunk arrays. */
void bench_record_clear(struct bench_record *r);

/* Serializes records into one malloc'd buffer (*out, *len) for MPI. */
enum moe_status bench_records_pack(const struct bench_record *recs, size_t n, uint8_t **out,
                                   size_t *len);

/* Appends the records in buf (len bytes) to *recs / *n (grown with realloc).
 * A malformed buffer is MOE_ERR_FORMAT. */
enum moe_status bench_records_unpack(const uint8_t *buf, size_t len, struct bench_record **recs,
                                     size_t *n, size_t *cap, struct moe_error *err);

/* ---- monotonic clock ----------------------------------------------------------- */

double bench_now_realtime(void);  /* CLOCK_REALTIME seconds */
void bench_sleep_until(double t); /* monotonic seconds */

/* ---- random numbers (reproducible from --seed) ----------------------------------- */

struct bench_rng {
    uint64_t s[4];
};

/* Seeds from (seed, stream, index): the same triple gives the same numbers
 * on every rank and every run. */
void bench_rng_seed(struct bench_rng *r, uint64_t seed, uint64_t stream, uint64_t index);
uint64_t bench_rng_u64(struct bench_rng *r);
double bench_rng_uniform(struct bench_rng *r);         /* [0, 1) */
double bench_rng_gamma(struct bench_rng *r, double k); /* shape k, scale 1 */
/* Whole number in [lo, hi]. */
int64_t bench_rng_range(struct bench_rng *r, int64_t lo, int64_t hi);

#endif
