/* Expert placement maps: the default split, files with uneven and replicated
 * placements, and every malformed file refused with its location. */
#include <string.h>

#include "placement.h"
#include "testlib.h"

static void expect_bad(const char *json, const char *needle)
{
    struct moe_placement p;
    struct moe_error err = {0};
    const char *path = test_write_temp("placement.json", json, strlen(json));
    CHECKF(moe_placement_load(path, 2, 4, 2, &p, &err) == MOE_ERR_FORMAT &&
               strstr(err.msg, needle) && strstr(err.msg, "placement.json"),
           "%s -> %s", json, err.msg);
}

int main(void)
{
    struct moe_placement p;
    struct moe_error err = {0};
    CHECK(moe_placement_default(3, 8, 2, &p, &err) == MOE_OK);
    for (int e = 0; e < 8; e++)
        CHECK(moe_placement_n_replicas(&p, 1, e) == 1 && moe_placement_rank(&p, 1, e, 0) == e / 4);
    moe_placement_free(&p);
    CHECK(moe_placement_default(1, 8, 3, &p, &err) == MOE_OK); /* 3,3,2 */
    int per_rank[3] = {0};
    for (int e = 0; e < 8; e++)
        per_rank[moe_placement_rank(&p, 0, e, 0)]++;
    CHECK(per_rank[0] == 3 && per_rank[1] == 3 && per_rank[2] == 2);
    moe_placement_free(&p);

    const char *uneven = "{\"n_rank\": 2, \"experts\": [[0],[0],[0],[1]],"
                         " \"layers\": {\"1\": [[1],[0,1],[0],[1]]}}";
    const char *path = test_write_temp("uneven.json", uneven, strlen(uneven));
    CHECKF(moe_placement_load(path, 2, 4, 2, &p, &err) == MOE_OK, "%s", err.msg);
    CHECK(moe_placement_holds(&p, 0, 2, 0) && !moe_placement_holds(&p, 0, 3, 0));
    CHECK(moe_placement_n_replicas(&p, 1, 1) == 2);
    CHECK(moe_placement_pick(&p, 1, 1, 7, 0) == 1 && moe_placement_pick(&p, 1, 1, 8, 0) == 0);
    CHECK(moe_placement_pick(&p, 1, 0, 5, 0) == 1);
    moe_placement_free(&p);

    expect_bad("[1, 2]", "not a JSON object");
    expect_bad("{\"n_rank\": 3, \"experts\": [[0],[0],[0],[1]]}", "n_rank");
    expect_bad("{\"n_rank\": 2, \"experts\": [[0],[0],[0]]}", "4 rank lists");
    expect_bad("{\"n_rank\": 2, \"experts\": [[0],[],[0],[1]]}", "expert 1");
    expect_bad("{\"n_rank\": 2, \"experts\": [[0],[5],[0],[1]]}", "rank 5");
    expect_bad("{\"n_rank\": 2, \"experts\": [[0],[1,1],[0],[1]]}", "twice");
    expect_bad("{\"n_rank\": 2, \"experts\": [[0],[0],[0],[1]], \"layers\": {\"9\": []}}", "'9'");
    CHECK(moe_placement_load("/nonexistent/p.json", 2, 4, 2, &p, &err) == MOE_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, "/nonexistent/p.json: No such file or directory"), "%s", err.msg);
    return test_summary();
}
