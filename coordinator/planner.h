/* The expert placement planner (EPLB-style): given the token load of every
 * (layer, expert) over a window and the current placement, proposes a new
 * placement that replicates the hottest experts into redundant slots and
 * packs the replicas onto ranks so that the most loaded rank carries as
 * little as possible, preferring to leave experts where they are.
 *
 * Pure computation: no I/O, no globals, deterministic (same input, same
 * output, on every machine). Used by the coordinator (Admin PlanPlacement)
 * and by bench/sim_placement.c.
 *
 * Model of the load: the tokens of an expert are spread evenly over its
 * replicas (replica load = expert load / n_replicas); a rank's load in a
 * layer is the sum of its replicas' loads. Each layer is its own all-to-all
 * step, so the cost of a placement is the sum over layers of the most loaded
 * rank, and its imbalance is sum_l max_r / sum_l mean_r (1 = perfect;
 * "balancedness" as EPLB reports it is the inverse, mean/max).
 *
 * Slots: every rank can hold `slots_per_rank` experts per layer. A layer has
 * n_expert + n_redundant replicas in total, each expert between 1 and
 * min(n_rank, PLANNER_MAX_REPLICAS) of them, on distinct ranks. */
#ifndef MOE_PLANNER_H
#define MOE_PLANNER_H

#include <stdbool.h>
#include <stdint.h>

#include "moe_error.h"

/* Same limit as MOE_PLACEMENT_MAX_REPLICAS in worker/model/placement.h (the
 * worker's file format). */
#define PLANNER_MAX_REPLICAS 8

/* A placement: for each layer and expert, the ranks holding a replica. */
struct planner_map {
    int n_layer;
    int n_expert;
    int n_rank;
    uint8_t *n_replicas; /* (n_layer, n_expert) */
    int16_t *ranks;      /* (n_layer, n_expert, PLANNER_MAX_REPLICAS), ascending per expert */
};

/* Allocates an empty map (every expert with 0 replicas). On error *m is
 * zeroed. The caller frees it with planner_map_free. */
enum moe_status planner_map_alloc(int n_layer, int n_expert, int n_rank, struct planner_map *m,
                                  struct moe_error *err);

/* The default placement, the same as the worker's (worker/model/placement.c):
 * expert e on rank e * n_rank / n_expert, one replica each. */
enum moe_status planner_map_default(int n_layer, int n_expert, int n_rank, struct planner_map *m,
                                    struct moe_error *err);

/* Deep copy of `src` into `dst` (freed by the caller). */
enum moe_status planner_map_copy(const struct planner_map *src, struct planner_map *dst,
                                 struct moe_error *err);

/* Frees the arrays and zeroes *m. NULL is a no-op. */
void planner_map_free(struct planner_map *m);

static inline int planner_map_n_replicas(const struct planner_map *m, int layer, int expert)
{
    return m->n_replicas[(size_t)layer * m->n_expert + expert];
}

static inline int planner_map_rank(const struct planner_map *m, int layer, int expert, int i)
{
    return m->ranks[((size_t)layer * m->n_expert + expert) * PLANNER_MAX_REPLICAS + i];
}

/* Adds `rank` to the replicas of (layer, expert), keeping them sorted.
 * MOE_ERR_INVALID (naming layer, expert and rank) when the rank is out of
 * range, already listed, or the expert is at PLANNER_MAX_REPLICAS. */
enum moe_status planner_map_add(struct planner_map *m, int layer, int expert, int rank,
                                struct moe_error *err);

/* True when `rank` holds `expert` in `layer`. */
bool planner_map_holds(const struct planner_map *m, int layer, int expert, int rank);

/* Checks the invariants: every expert has 1..PLANNER_MAX_REPLICAS replicas
 * on distinct ranks in [0, n_rank), and no rank holds more than
 * `slots_per_rank` experts in a layer (0: no slot limit). The error names
 * the layer, expert and rank ("layer 2 expert 5: rank 3 is not in [0, 2)"). */
enum moe_status planner_map_check(const struct planner_map *m, int slots_per_rank,
                                  struct moe_error *err);

/* Most experts any rank holds in any layer. */
int planner_map_max_slots(const struct planner_map *m);

/* Largest number of redundant replicas (replicas - n_expert) of any layer. */
int planner_map_n_redundant(const struct planner_map *m);

/* Replicas present in `to` on a rank that did not hold that expert in
 * `from` (same shape): the experts a move has to load. */
int planner_map_n_moves(const struct planner_map *from, const struct planner_map *to);

/* Predicted per-rank load: rank_load (n_layer, n_rank) receives, per layer,
 * the sum over the rank's replicas of load[layer][expert] / n_replicas.
 * `load` is (n_layer, n_expert). */
void planner_predict(const struct planner_map *m, const double *load, double *rank_load);

/* sum over layers of the max rank load / sum of the mean rank load, for
 * rank_load (n_layer, n_rank); 1.0 when there is no load at all. */
double planner_imbalance(const double *rank_load, int n_layer, int n_rank);

struct planner_params {
    /* Replicas beyond one per expert, per layer (0: none). */
    int n_redundant;
    /* Experts a rank can hold per layer; 0: just enough,
     * ceil((n_expert + n_redundant) / n_rank). */
    int slots_per_rank;
    /* A layer whose current placement already has the target replica count
     * and a predicted imbalance <= 1 + keep_tolerance is left unchanged; and
     * a packing that keeps experts in place is preferred when its most loaded
     * rank is within (1 + keep_tolerance) of the best packing found.
     * Typical: 0.05. */
    double keep_tolerance;
};

struct planner_result {
    struct planner_map map;  /* the proposed placement */
    double *load_before;     /* (n_layer, n_rank) predicted, current placement */
    double *load_after;      /* (n_layer, n_rank) predicted, proposed placement */
    double imbalance_before; /* planner_imbalance of load_before */
    double imbalance_after;
    int n_moves;          /* replicas placed on a rank that did not hold the expert */
    int n_removed;        /* replicas dropped from a rank */
    int n_layers_changed; /* layers whose placement differs */
    int slots_per_rank;   /* the slot count used */
    int n_redundant;      /* the redundant replica count used */
};

/* Plans a placement for the load `load` (n_layer, n_expert; tokens over a
 * window, >= 0) given the current placement `current` (whose shape sets
 * n_layer, n_expert, n_rank). On success *out is filled and owned by the
 * caller (planner_result_free). Errors: MOE_ERR_INVALID when the request
 * cannot fit ("redundant 40 needs 6 slots per rank, ranks have 5"), naming
 * the numbers; on error *out is zeroed. */
enum moe_status planner_plan(const struct planner_params *params, const struct planner_map *current,
                             const double *load, struct planner_result *out, struct moe_error *err);

/* Frees a result and zeroes it. NULL is a no-op. */
void planner_result_free(struct planner_result *r);

#endif
