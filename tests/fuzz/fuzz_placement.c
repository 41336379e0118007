/* Fuzz target: the worker's expert placement JSON (common/placement.c,
 * moe_placement_parse): a --placement file, or the "placement" the group
 * leader reads from etcd. Input: byte 0 sets the shape (ranks 1..8, bits
 * 0-2; layers 1..4, bits 3-4; experts 1, 2, 4 or 8, bits 5-6), the rest is
 * the JSON text. An accepted placement must give every expert 1 to
 * MOE_PLACEMENT_MAX_REPLICAS distinct ranks in [0, n_rank), and
 * moe_placement_pick a rank that holds the expert. */
#include "fuzz.h"
#include "placement.h"

#define NAME "placement.json"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int n_rank = 1 + (data[0] & 7), n_layer = 1 + ((data[0] >> 3) & 3);
    int n_expert = 1 << ((data[0] >> 5) & 3);
    char *text = fuzz_cstr(data + 1, size - 1);
    if (!text)
        return 0;
    struct moe_placement p = {0};
    struct moe_error err = {0};
    enum moe_status st = moe_placement_parse(text, NAME, n_layer, n_expert, n_rank, &p, &err);
    free(text);
    if (st != MOE_OK) {
        FUZZ_CHECK(err.code == st && fuzz_msg_ok(err.msg) && strstr(err.msg, NAME) && !p.ranks,
                   "status %d: '%s'", st, err.msg);
        return 0;
    }
    FUZZ_CHECK(p.n_layer == n_layer && p.n_expert == n_expert && p.n_rank == n_rank, "shape");
    for (int l = 0; l < n_layer; l++)
        for (int e = 0; e < n_expert; e++) {
            int n = moe_placement_n_replicas(&p, l, e);
            FUZZ_CHECK(n >= 1 && n <= MOE_PLACEMENT_MAX_REPLICAS, "layer %d expert %d: %d replicas",
                       l, e, n);
            for (int i = 0; i < n; i++) {
                int r = moe_placement_rank(&p, l, e, i);
                FUZZ_CHECK(r >= 0 && r < n_rank, "layer %d expert %d: rank %d", l, e, r);
                for (int j = 0; j < i; j++)
                    FUZZ_CHECK(moe_placement_rank(&p, l, e, j) != r, "rank %d twice", r);
            }
            for (int token = 0; token < 3; token++)
                FUZZ_CHECK(moe_placement_holds(&p, l, e, moe_placement_pick(&p, l, e, token, 0)),
                           "pick gives a rank without the expert");
        }
    moe_placement_free(&p);
    return 0;
}
