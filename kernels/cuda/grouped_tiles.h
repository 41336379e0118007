/* The row-tile map of the tensor-core grouped GEMM (grouped_mma.cu), in a
 * header the CUDA kernel and the host tests share: a launch sized from
 * host totals alone has moe_grouped_tile_slots(n_rows, n_expert) slots, and
 * slot s of it takes the rows moe_grouped_tile_of gives (or none). C and
 * CUDA C: the functions are host and device code under nvcc. */
#ifndef MOE_CUDA_GROUPED_TILES_H
#define MOE_CUDA_GROUPED_TILES_H

#include <stdint.h>

#ifdef __CUDACC__
#define MOE_TILES_HD __host__ __device__
#else
#define MOE_TILES_HD
#endif

/* An upper bound on sum_e ceil(rows_e / bm) over experts whose rows add up
 * to n_rows: each expert with rows wastes less than one tile, and at most
 * min(n_expert, n_rows) experts have rows. */
static inline MOE_TILES_HD long long moe_grouped_tile_slots(int n_rows, int n_expert, int bm)
{
    return ((long long)n_rows + bm - 1) / bm + (n_expert < n_rows ? n_expert : n_rows);
}

/* Slot `slot` of a launch over the offsets off (n_expert + 1, ascending):
 * the experts' row tiles in expert order, bm rows each but an expert's last.
 * Returns the expert and sets its first row and row count, or -1 when the
 * slot is past the last tile. */
static inline MOE_TILES_HD int moe_grouped_tile_of(const int32_t *off, int n_expert, int slot,
                                                   int bm, int *row0, int *cnt)
{
    for (int e = 0; e < n_expert; e++) {
        const int c = off[e + 1] - off[e];
        if (c <= 0)
            continue;
        const int tiles = (c + bm - 1) / bm;
        if (slot < tiles) {
            *row0 = off[e] + slot * bm;
            *cnt = c - slot * bm < bm ? c - slot * bm : bm;
            return e;
        }
        slot -= tiles;
    }
    return -1;
}

#endif
