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
 * min(n_rank, MOE_PLACEMENT_MAX_REPLICAS) of them, on distinct ranks. */
#ifndef MOE_PLANNER_H
#define MOE_PLANNER_H

#include <stdbool.h>
#include <stdint.h>

#include "moe_error.h"
#include "placement.h"

/* Most experts any rank holds in any layer. */
int moe_placement_max_slots(const struct moe_placement *m);

/* Largest number of redundant replicas (replicas - n_expert) of any layer. */
int moe_placement_n_redundant(const struct moe_placement *m);

/* Replicas present in `to` on a rank that did not hold that expert in
 * `from` (same shape): the experts a move has to load. */
int moe_placement_n_moves(const struct moe_placement *from, const struct moe_placement *to);

/* Predicted per-rank load: rank_load (n_layer, n_rank) receives, per layer,
 * the sum over the rank's replicas of load[layer][expert] / n_replicas.
 * `load` is (n_layer, n_expert). */
void planner_predict(const struct moe_placement *m, const double *load, double *rank_load);

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
    struct moe_placement map; /* the proposed placement */
    double *load_before;      /* (n_layer, n_rank) predicted, current placement */
    double *load_after;       /* (n_layer, n_rank) predicted, proposed placement */
    double imbalance_before;  /* planner_imbalance of load_before */
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
enum moe_status planner_plan(const struct planner_params *params,
                             const struct moe_placement *current, const double *load,
                             struct planner_result *out, struct moe_error *err);

/* Frees a result and zeroes it. NULL is a no-op. */
void planner_result_free(struct planner_result *r);

#endif
