/* The expert placement planner. Per layer, in three steps:
 *
 * 1. Replica counts. Every expert starts with one replica; each redundant
 *    replica goes, one at a time, to the expert whose load per replica is the
 *    highest (ties: an expert that already has more replicas in the current
 *    placement, then the lowest index).
 * 2. Packing. Replicas, heaviest first, go to the least loaded rank that has
 *    a free slot and does not hold the expert yet (longest-processing-time
 *    greedy), then a local search moves or swaps single replicas between the
 *    most loaded rank and another while that lowers the maximum.
 * 3. Staying put. A second packing first tries the ranks that already hold
 *    the expert, as long as a rank stays under (1 + keep_tolerance) times the
 *    best maximum found in step 2. When that packing ends within the same
 *    bound it wins (it moves fewer experts); otherwise the step-2 packing
 *    does. A layer whose current placement already has the target replica
 *    count and an imbalance within the tolerance is not touched at all. */
#include "planner.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int moe_placement_max_slots(const struct moe_placement *m)
{
    int best = 0;
    int *count = calloc((size_t)m->n_rank, sizeof *count);
    if (!count)
        return m->n_expert; /* an upper bound */
    for (int l = 0; l < m->n_layer; l++) {
        memset(count, 0, (size_t)m->n_rank * sizeof *count);
        for (int e = 0; e < m->n_expert; e++)
            for (int i = 0; i < moe_placement_n_replicas(m, l, e); i++) {
                int r = moe_placement_rank(m, l, e, i);
                if (r >= 0 && r < m->n_rank && ++count[r] > best)
                    best = count[r];
            }
    }
    free(count);
    return best;
}

int moe_placement_n_redundant(const struct moe_placement *m)
{
    int best = 0;
    for (int l = 0; l < m->n_layer; l++) {
        int n = 0;
        for (int e = 0; e < m->n_expert; e++)
            n += moe_placement_n_replicas(m, l, e);
        if (n - m->n_expert > best)
            best = n - m->n_expert;
    }
    return best;
}

int moe_placement_n_moves(const struct moe_placement *from, const struct moe_placement *to)
{
    int moves = 0;
    for (int l = 0; l < to->n_layer; l++)
        for (int e = 0; e < to->n_expert; e++)
            for (int i = 0; i < moe_placement_n_replicas(to, l, e); i++)
                if (!moe_placement_holds(from, l, e, moe_placement_rank(to, l, e, i)))
                    moves++;
    return moves;
}

void planner_predict(const struct moe_placement *m, const double *load, double *rank_load)
{
    memset(rank_load, 0, (size_t)m->n_layer * m->n_rank * sizeof *rank_load);
    for (int l = 0; l < m->n_layer; l++)
        for (int e = 0; e < m->n_expert; e++) {
            int n = moe_placement_n_replicas(m, l, e);
            if (n < 1)
                continue;
            double w = load[(size_t)l * m->n_expert + e] / n;
            for (int i = 0; i < n; i++) {
                int r = moe_placement_rank(m, l, e, i);
                if (r >= 0 && r < m->n_rank)
                    rank_load[(size_t)l * m->n_rank + r] += w;
            }
        }
}

double planner_imbalance(const double *rank_load, int n_layer, int n_rank)
{
    double sum_max = 0, sum_mean = 0;
    for (int l = 0; l < n_layer; l++) {
        double mx = 0, sum = 0;
        for (int r = 0; r < n_rank; r++) {
            double v = rank_load[(size_t)l * n_rank + r];
            sum += v;
            if (v > mx)
                mx = v;
        }
        sum_max += mx;
        sum_mean += sum / n_rank;
    }
    return sum_mean > 0 ? sum_max / sum_mean : 1.0;
}

/* ---- one layer ------------------------------------------------------------- */

/* Scratch for packing one layer. */
struct pack {
    int n_rank, n_expert, slots;
    double *load;   /* (n_rank) */
    int *count;     /* (n_rank) */
    int *item;      /* (n_rank, slots) expert of each filled slot */
    double *item_w; /* (n_rank, slots) its load */
    uint8_t *held;  /* (n_rank, n_expert) */
    uint8_t *home;  /* (n_rank, n_expert) held in the current placement */
};

/* One replica to place. */
struct replica {
    int expert;
    double w;
};

static int cmp_replica(const void *a, const void *b)
{
    const struct replica *x = a, *y = b;
    if (x->w != y->w)
        return x->w > y->w ? -1 : 1;
    return x->expert - y->expert;
}

static void pack_reset(struct pack *pk)
{
    memset(pk->load, 0, (size_t)pk->n_rank * sizeof *pk->load);
    memset(pk->count, 0, (size_t)pk->n_rank * sizeof *pk->count);
    memset(pk->held, 0, (size_t)pk->n_rank * pk->n_expert);
}

static void pack_put(struct pack *pk, int r, int e, double w)
{
    int s = pk->count[r]++;
    pk->item[r * pk->slots + s] = e;
    pk->item_w[r * pk->slots + s] = w;
    pk->load[r] += w;
    pk->held[(size_t)r * pk->n_expert + e] = 1;
}

/* Moves slot s of rank p to rank q. */
static void pack_move(struct pack *pk, int p, int s, int q)
{
    int e = pk->item[p * pk->slots + s];
    double w = pk->item_w[p * pk->slots + s];
    int last = --pk->count[p];
    pk->item[p * pk->slots + s] = pk->item[p * pk->slots + last];
    pk->item_w[p * pk->slots + s] = pk->item_w[p * pk->slots + last];
    pk->load[p] -= w;
    pk->held[(size_t)p * pk->n_expert + e] = 0;
    pack_put(pk, q, e, w);
}

/* Every rank is full or holds e: free a slot on a rank without e by moving
 * one of its replicas to a rank with room. Returns that rank, or -1. */
static int pack_repair(struct pack *pk, int e)
{
    for (int q = 0; q < pk->n_rank; q++) {
        if (pk->count[q] >= pk->slots)
            continue;
        for (int p = 0; p < pk->n_rank; p++) {
            if (p == q || pk->held[(size_t)p * pk->n_expert + e])
                continue;
            for (int s = 0; s < pk->count[p]; s++) {
                int f = pk->item[p * pk->slots + s];
                if (!pk->held[(size_t)q * pk->n_expert + f]) {
                    pack_move(pk, p, s, q);
                    return p;
                }
            }
        }
    }
    return -1;
}

/* Places one replica of e (load w). sticky: a rank that held e before and
 * stays within `bound` wins first. Returns false if it cannot be placed. */
static bool pack_place(struct pack *pk, int e, double w, bool sticky, double bound)
{
    int best = -1;
    if (sticky) {
        for (int r = 0; r < pk->n_rank; r++) {
            size_t i = (size_t)r * pk->n_expert + e;
            if (!pk->home[i] || pk->held[i] || pk->count[r] >= pk->slots || pk->load[r] + w > bound)
                continue;
            if (best < 0 || pk->load[r] < pk->load[best])
                best = r;
        }
    }
    if (best < 0) {
        for (int r = 0; r < pk->n_rank; r++) {
            size_t i = (size_t)r * pk->n_expert + e;
            if (pk->held[i] || pk->count[r] >= pk->slots)
                continue;
            if (best < 0 || pk->load[r] < pk->load[best])
                best = r;
            else if (pk->load[r] == pk->load[best]) {
                size_t j = (size_t)best * pk->n_expert + e;
                /* ties: a rank that held it, then the emptier one */
                if ((pk->home[i] && !pk->home[j]) ||
                    (pk->home[i] == pk->home[j] && pk->count[r] < pk->count[best]))
                    best = r;
            }
        }
    }
    if (best < 0)
        best = pack_repair(pk, e);
    if (best < 0)
        return false;
    pack_put(pk, best, e, w);
    return true;
}

static double pack_max(const struct pack *pk)
{
    double mx = 0;
    for (int r = 0; r < pk->n_rank; r++)
        if (pk->load[r] > mx)
            mx = pk->load[r];
    return mx;
}

/* Local search: moves or swaps one replica between the most loaded rank and
 * another while that lowers the pair's maximum, until the maximum is at most
 * `target` or nothing helps. */
static void pack_refine(struct pack *pk, double target)
{
    int max_iter = 8 * pk->n_rank * pk->slots + 64;
    for (int it = 0; it < max_iter; it++) {
        int p = 0;
        for (int r = 1; r < pk->n_rank; r++)
            if (pk->load[r] > pk->load[p])
                p = r;
        double m = pk->load[p];
        if (m <= target || m <= 0)
            return;
        double best_new = m * (1 - 1e-9);
        int bs = -1, bq = -1, bt = -1; /* slot on p, rank q, slot on q (-1: a move) */
        for (int s = 0; s < pk->count[p]; s++) {
            int a = pk->item[p * pk->slots + s];
            double wa = pk->item_w[p * pk->slots + s];
            for (int q = 0; q < pk->n_rank; q++) {
                if (q == p || pk->held[(size_t)q * pk->n_expert + a])
                    continue;
                if (pk->count[q] < pk->slots) {
                    double nm = fmax(m - wa, pk->load[q] + wa);
                    if (nm < best_new) {
                        best_new = nm;
                        bs = s, bq = q, bt = -1;
                    }
                }
                for (int t = 0; t < pk->count[q]; t++) {
                    int b = pk->item[q * pk->slots + t];
                    double wb = pk->item_w[q * pk->slots + t];
                    if (wb >= wa || pk->held[(size_t)p * pk->n_expert + b])
                        continue;
                    double nm = fmax(m - wa + wb, pk->load[q] - wb + wa);
                    if (nm < best_new) {
                        best_new = nm;
                        bs = s, bq = q, bt = t;
                    }
                }
            }
        }
        if (bs < 0)
            return;
        if (bt < 0) {
            pack_move(pk, p, bs, bq);
        } else {
            /* swap: b goes to p first (p has the slot of a free after a leaves) */
            int b = pk->item[bq * pk->slots + bt];
            double wb = pk->item_w[bq * pk->slots + bt];
            int a = pk->item[p * pk->slots + bs];
            double wa = pk->item_w[p * pk->slots + bs];
            pk->item[p * pk->slots + bs] = b;
            pk->item_w[p * pk->slots + bs] = wb;
            pk->item[bq * pk->slots + bt] = a;
            pk->item_w[bq * pk->slots + bt] = wa;
            pk->load[p] += wb - wa;
            pk->load[bq] += wa - wb;
            pk->held[(size_t)p * pk->n_expert + a] = 0;
            pk->held[(size_t)p * pk->n_expert + b] = 1;
            pk->held[(size_t)bq * pk->n_expert + b] = 0;
            pk->held[(size_t)bq * pk->n_expert + a] = 1;
        }
    }
}

/* Packs every replica; false if one cannot be placed. */
static bool pack_all(struct pack *pk, const struct replica *reps, int n_rep, bool sticky,
                     double bound)
{
    pack_reset(pk);
    for (int i = 0; i < n_rep; i++)
        if (!pack_place(pk, reps[i].expert, reps[i].w, sticky, bound))
            return false;
    return true;
}

/* Writes the packing of layer l into m. */
static void pack_store(const struct pack *pk, struct moe_placement *m, int l)
{
    memset(m->n_replicas + (size_t)l * m->n_expert, 0, (size_t)m->n_expert);
    for (int r = 0; r < pk->n_rank; r++)
        for (int s = 0; s < pk->count[r]; s++)
            moe_placement_add(m, l, pk->item[r * pk->slots + s], r, NULL);
}

/* Per-layer scratch owned by planner_plan. */
struct scratch {
    struct pack pk;
    int *n_rep;           /* (n_expert) replica counts */
    struct replica *reps; /* (n_expert + n_redundant) */
    int *best_item;       /* (n_rank, slots) copy of the best packing */
    int *best_count;      /* (n_rank) */
    double *best_w;       /* (n_rank, slots) */
};

static void scratch_free(struct scratch *s)
{
    free(s->pk.load);
    free(s->pk.count);
    free(s->pk.item);
    free(s->pk.item_w);
    free(s->pk.held);
    free(s->pk.home);
    free(s->n_rep);
    free(s->reps);
    free(s->best_item);
    free(s->best_count);
    free(s->best_w);
}

static bool scratch_alloc(struct scratch *s, int n_expert, int n_rank, int slots, int n_redundant)
{
    memset(s, 0, sizeof *s);
    size_t rs = (size_t)n_rank * slots, re = (size_t)n_rank * n_expert;
    s->pk.n_rank = n_rank;
    s->pk.n_expert = n_expert;
    s->pk.slots = slots;
    s->pk.load = calloc((size_t)n_rank, sizeof(double));
    s->pk.count = calloc((size_t)n_rank, sizeof(int));
    s->pk.item = calloc(rs, sizeof(int));
    s->pk.item_w = calloc(rs, sizeof(double));
    s->pk.held = calloc(re, 1);
    s->pk.home = calloc(re, 1);
    s->n_rep = calloc((size_t)n_expert, sizeof(int));
    s->reps = calloc((size_t)n_expert + (size_t)n_redundant, sizeof *s->reps);
    s->best_item = calloc(rs, sizeof(int));
    s->best_count = calloc((size_t)n_rank, sizeof(int));
    s->best_w = calloc(rs, sizeof(double));
    return s->pk.load && s->pk.count && s->pk.item && s->pk.item_w && s->pk.held && s->pk.home &&
           s->n_rep && s->reps && s->best_item && s->best_count && s->best_w;
}

static void pack_save(struct scratch *s)
{
    size_t rs = (size_t)s->pk.n_rank * s->pk.slots;
    memcpy(s->best_item, s->pk.item, rs * sizeof(int));
    memcpy(s->best_w, s->pk.item_w, rs * sizeof(double));
    memcpy(s->best_count, s->pk.count, (size_t)s->pk.n_rank * sizeof(int));
}

static void pack_restore(struct scratch *s)
{
    size_t rs = (size_t)s->pk.n_rank * s->pk.slots;
    memcpy(s->pk.item, s->best_item, rs * sizeof(int));
    memcpy(s->pk.item_w, s->best_w, rs * sizeof(double));
    memcpy(s->pk.count, s->best_count, (size_t)s->pk.n_rank * sizeof(int));
}

/* Plans layer l into out->map. */
static enum moe_status plan_layer(const struct planner_params *pp, const struct moe_placement *cur,
                                  const double *load, int l, int slots, int cap, struct scratch *s,
                                  struct moe_placement *out, struct moe_error *err)
{
    int E = cur->n_expert, N = cur->n_rank, R = pp->n_redundant;
    const double *w = load + (size_t)l * E;

    /* step 1: replica counts */
    for (int e = 0; e < E; e++)
        s->n_rep[e] = 1;
    for (int k = 0; k < R; k++) {
        int best = -1;
        double bw = -1;
        for (int e = 0; e < E; e++) {
            if (s->n_rep[e] >= cap)
                continue;
            double v = w[e] / s->n_rep[e];
            if (best < 0 || v > bw ||
                (v == bw && moe_placement_n_replicas(cur, l, e) > s->n_rep[e] &&
                 moe_placement_n_replicas(cur, l, best) <= s->n_rep[best])) {
                best = e;
                bw = v;
            }
        }
        s->n_rep[best]++;
    }
    int n_rep = 0;
    for (int e = 0; e < E; e++)
        for (int i = 0; i < s->n_rep[e]; i++)
            s->reps[n_rep++] = (struct replica){e, w[e] / s->n_rep[e]};
    qsort(s->reps, (size_t)n_rep, sizeof *s->reps, cmp_replica);

    struct pack *pk = &s->pk;
    memset(pk->home, 0, (size_t)N * E);
    for (int e = 0; e < E; e++)
        for (int i = 0; i < moe_placement_n_replicas(cur, l, e); i++) {
            int r = moe_placement_rank(cur, l, e, i);
            if (r >= 0 && r < N)
                pk->home[(size_t)r * E + e] = 1;
        }

    /* step 2: the best packing */
    if (!pack_all(pk, s->reps, n_rep, false, 0))
        return moe_error_set(err, MOE_ERR_INTERNAL,
                             "layer %d: cannot pack %d replicas into %d ranks x %d slots", l, n_rep,
                             N, slots);
    pack_refine(pk, 0);
    double m_best = pack_max(pk);
    pack_save(s);

    /* step 3: the packing that stays put, if it is good enough */
    double bound = m_best * (1 + pp->keep_tolerance);
    if (pack_all(pk, s->reps, n_rep, true, bound)) {
        pack_refine(pk, bound);
        if (pack_max(pk) > bound)
            pack_restore(s);
    } else {
        pack_restore(s);
    }
    pack_store(pk, out, l);
    return MOE_OK;
}

void planner_result_free(struct planner_result *r)
{
    if (!r)
        return;
    moe_placement_free(&r->map);
    free(r->load_before);
    free(r->load_after);
    memset(r, 0, sizeof *r);
}

enum moe_status planner_plan(const struct planner_params *pp, const struct moe_placement *cur,
                             const double *load, struct planner_result *out, struct moe_error *err)
{
    memset(out, 0, sizeof *out);
    struct scratch s;
    memset(&s, 0, sizeof s);
    enum moe_status rc;
    int E = cur->n_expert, N = cur->n_rank, L = cur->n_layer;
    int R = pp->n_redundant;
    int cap = N < MOE_PLACEMENT_MAX_REPLICAS ? N : MOE_PLACEMENT_MAX_REPLICAS;
    if (R < 0 || (int64_t)E + R > (int64_t)E * cap) {
        int most = E * (cap - 1);
        return moe_error_set(err, MOE_ERR_INVALID,
                             "redundant %d: between 0 and %d redundant replicas fit (%d experts, "
                             "at most %d replicas each on %d ranks)",
                             R, most, E, cap, N);
    }
    int need = (E + R + N - 1) / N;
    int slots = pp->slots_per_rank > 0 ? pp->slots_per_rank : need;
    if (slots < need)
        return moe_error_set(err, MOE_ERR_INVALID,
                             "redundant %d: %d replicas need %d slots per rank on %d ranks, ranks "
                             "have %d",
                             R, E + R, need, N, slots);
    for (int e = 0; e < E * L; e++)
        if (!(load[e] >= 0) || !isfinite(load[e]))
            return moe_error_set(err, MOE_ERR_INVALID, "load of layer %d expert %d is %g", e / E,
                                 e % E, load[e]);
    if ((rc = moe_placement_alloc(L, E, N, &out->map, err)))
        goto fail;
    out->load_before = calloc((size_t)L * N, sizeof(double));
    out->load_after = calloc((size_t)L * N, sizeof(double));
    if (!out->load_before || !out->load_after || !scratch_alloc(&s, E, N, slots, R)) {
        rc = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
        goto fail;
    }
    planner_predict(cur, load, out->load_before);
    int *count = s.pk.count; /* reused as per-rank counters for the keep rule */
    for (int l = 0; l < L; l++) {
        /* keep a layer that already fits and is balanced enough */
        int total = 0;
        bool fits = true;
        memset(count, 0, (size_t)N * sizeof *count);
        for (int e = 0; e < E; e++) {
            int n = moe_placement_n_replicas(cur, l, e);
            total += n;
            fits = fits && n >= 1;
            for (int i = 0; i < n; i++) {
                int r = moe_placement_rank(cur, l, e, i);
                if (r < 0 || r >= N || ++count[r] > slots)
                    fits = false;
            }
        }
        double imb = planner_imbalance(out->load_before + (size_t)l * N, 1, N);
        if (fits && total == E + R && imb <= 1 + pp->keep_tolerance) {
            memcpy(out->map.n_replicas + (size_t)l * E, cur->n_replicas + (size_t)l * E, (size_t)E);
            memcpy(out->map.ranks + (size_t)l * E * MOE_PLACEMENT_MAX_REPLICAS,
                   cur->ranks + (size_t)l * E * MOE_PLACEMENT_MAX_REPLICAS,
                   (size_t)E * MOE_PLACEMENT_MAX_REPLICAS * sizeof *cur->ranks);
            continue;
        }
        if ((rc = plan_layer(pp, cur, load, l, slots, cap, &s, &out->map, err)))
            goto fail;
    }
    planner_predict(&out->map, load, out->load_after);
    out->imbalance_before = planner_imbalance(out->load_before, L, N);
    out->imbalance_after = planner_imbalance(out->load_after, L, N);
    out->n_moves = moe_placement_n_moves(cur, &out->map);
    out->n_removed = moe_placement_n_moves(&out->map, cur);
    for (int l = 0; l < L; l++) {
        size_t o = (size_t)l * E;
        bool same = !memcmp(out->map.n_replicas + o, cur->n_replicas + o, (size_t)E);
        for (int e = 0; e < E && same; e++)
            for (int i = 0; i < moe_placement_n_replicas(cur, l, e) && same; i++)
                same = moe_placement_rank(cur, l, e, i) == moe_placement_rank(&out->map, l, e, i);
        out->n_layers_changed += !same;
    }
    out->slots_per_rank = slots;
    out->n_redundant = R;
    scratch_free(&s);
    return MOE_OK;

fail:
    scratch_free(&s);
    planner_result_free(out);
    return rc;
}
