/* Expert placement: which ranks of a worker group hold which experts, per
 * MoE layer. One map for the worker (what to load, where to route) and the
 * coordinator's planner and placement store (what to propose, apply, roll
 * back). A rank loads only the experts placed on it; the MoE layer sends
 * each routed token row to one rank holding its expert.
 *
 * File format (JSON), for --placement FILE.json:
 *   {"n_rank": 2,
 *    "experts": [[0], [0], [0], [0], [0], [1], [1], [1]],   every MoE layer
 *    "layers": {"3": [[1], [0, 1], ...]}}                     optional overrides
 * experts[e] lists the ranks holding expert e (more than one: a replicated hot
 * expert). Default: an even contiguous split, expert e on rank
 * e * n_rank / n_expert. */
#ifndef MOE_PLACEMENT_H
#define MOE_PLACEMENT_H

#include <stdbool.h>
#include <stdint.h>

#include "moe_error.h"

#define MOE_PLACEMENT_MAX_REPLICAS 8

struct moe_placement {
    int n_layer;
    int n_expert;
    int n_rank;
    /* (n_layer, n_expert): replica count and ranks of each expert (in the
     * order given; moe_placement_add keeps them ascending) */
    uint8_t *n_replicas;
    int16_t *ranks; /* (n_layer, n_expert, MOE_PLACEMENT_MAX_REPLICAS) */
};

/* The default even, contiguous split. */
enum moe_status moe_placement_default(int n_layer, int n_expert, int n_rank,
                                      struct moe_placement *out, struct moe_error *err);

/* Parses a placement file; every expert needs at least one rank, ranks must
 * be in [0, n_rank) and distinct per expert, n_rank must match. Errors name
 * the file and the layer / expert. */
enum moe_status moe_placement_load(const char *path, int n_layer, int n_expert, int n_rank,
                                   struct moe_placement *out, struct moe_error *err);

/* moe_placement_load for the model in `model_dir` (layers and experts read
 * from its config.json). */
enum moe_status moe_placement_load_for_model(const char *path, const char *model_dir, int n_rank,
                                             struct moe_placement *out, struct moe_error *err);

/* The same from JSON text; `name` (a file, an etcd key) is used in messages. */
enum moe_status moe_placement_parse(const char *text, const char *name, int n_layer, int n_expert,
                                    int n_rank, struct moe_placement *out, struct moe_error *err);

void moe_placement_free(struct moe_placement *p);

static inline int moe_placement_n_replicas(const struct moe_placement *p, int layer, int expert)
{
    return p->n_replicas[layer * p->n_expert + expert];
}

static inline int moe_placement_rank(const struct moe_placement *p, int layer, int expert, int i)
{
    return p->ranks[((size_t)layer * p->n_expert + expert) * MOE_PLACEMENT_MAX_REPLICAS + i];
}

/* An empty map (every expert with 0 replicas). On error *m is zeroed. The
 * caller frees it with moe_placement_free. */
enum moe_status moe_placement_alloc(int n_layer, int n_expert, int n_rank, struct moe_placement *m,
                                    struct moe_error *err);

/* Deep copy of `src` into `dst` (freed by the caller). */
enum moe_status moe_placement_copy(const struct moe_placement *src, struct moe_placement *dst,
                                   struct moe_error *err);

/* Adds `rank` to the replicas of (layer, expert), keeping them sorted.
 * MOE_ERR_INVALID (naming layer, expert and rank) when the rank is out of
 * range, already listed, or the expert is at MOE_PLACEMENT_MAX_REPLICAS. */
enum moe_status moe_placement_add(struct moe_placement *m, int layer, int expert, int rank,
                                  struct moe_error *err);

/* Checks the invariants: every expert has 1..MOE_PLACEMENT_MAX_REPLICAS
 * replicas on distinct ranks in [0, n_rank), and no rank holds more than
 * `slots_per_rank` experts in a layer (0: no slot limit). The error names
 * the layer, expert and rank ("layer 2 expert 5: rank 3 is not in [0, 2)"). */
enum moe_status moe_placement_check(const struct moe_placement *m, int slots_per_rank,
                                    struct moe_error *err);

/* The map in the file format, every layer explicit (NULL when out of
 * memory); as a cJSON tree or as compact text (freed by the caller). */
struct cJSON;
struct cJSON *moe_placement_to_json(const struct moe_placement *m);
char *moe_placement_to_string(const struct moe_placement *m);

/* True when `rank` holds `expert` in `layer`. */
bool moe_placement_holds(const struct moe_placement *p, int layer, int expert, int rank);

/* The rank that computes `expert` for the token with global index `token`:
 * replicas take turns by token, so a replicated hot expert's load is split
 * evenly (preferring the caller's own replica would save a copy but leave
 * the load where the traffic comes from). */
int moe_placement_pick(const struct moe_placement *p, int layer, int expert, int token,
                       int my_rank);

#endif
