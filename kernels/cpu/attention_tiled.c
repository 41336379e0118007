/* Causal grouped-query attention, tiled (FlashAttention-style) on AVX-512
 * and on AVX2: the fast twin of cpu_attention_ref (attention.c), f32
 * throughout, used in both the exact and the fast mode. The AVX2 tiles
 * (8 lanes, 16 registers: smaller tiles) do each lane's operations in the
 * AVX-512 order, so both ISAs give the same bits (unit/test_kernels checks
 * it where a processor has both).
 *
 * A task is a group of up to FA_ROWS query rows -- consecutive batch tokens
 * of one sequence times the n_head / n_kv_head query heads that share a KV
 * head -- against that KV head. Keys are visited in chunks of FA_KB
 * positions aligned to absolute positions (0, 64, 128, ...), up to the
 * group's last position:
 *   S^T (keys x rows) = K_chunk Q^T     FMAs: a key element broadcast against
 *                                       16 rows of the transposed queries
 *   online softmax per row, vectorised over rows (lanes): running max m,
 *   running sum l, rescale alpha = exp(m_old - m_new); keys after a row's
 *   own position are masked (p = 0 exactly)
 *   O (rows x d_head) = alpha O + P V   FMAs: p broadcast against V rows
 * so every K and V element loaded feeds up to FA_ROWS rows, and nothing is a
 * scalar dot product.
 *
 * Each row's arithmetic is the same whatever group it is in (the lanes are
 * independent, the chunks are at absolute positions, a masked key adds an
 * exact 0 and multiplies by an exact 1), so a token gives bit-identical
 * output in a prefill, a chunked prefill or a decode step. exp is a vector
 * polynomial (Cody-Waite reduction, degree 6: ~2 ulp) instead of libm's
 * expf; the sums run in another order than the reference's: the results
 * agree with it to ~1e-6 (tests/unit/test_kernels.c holds both to 1e-5 of a
 * double reference).
 *
 * A BF16 cache's rows of a chunk are widened (exactly, inline) into per-thread
 * scratch first, so the arithmetic is that of an F32 cache holding the same
 * rounded values, bit for bit; only half the bytes come from memory. A
 * sequence with more tokens in the call than one task's group (a prefill
 * chunk) has its rows widened once for the call instead (fa_plan_wide): each
 * of its groups would otherwise widen every key before it again.
 *
 * Wide heads (multi-head latent attention: one row of kv_lora_rank +
 * qk_rope_dim, 320 .. 576) go through the same tiles: scores run over any d,
 * and O is accumulated in column chunks of up to FA_PV_D (each output
 * element's sum is the same whatever the chunking, so a head of d <= FA_PV_D
 * computes exactly as before). With d_v (struct moe_attn_params) only the
 * first d_v columns of V are accumulated; a cache whose V is its K (latent)
 * is widened from BF16 once.
 *
 * AMX (p->fast, a BF16 cache, AMX-BF16; d_head a multiple of 32 up to
 * FA_AMX_MAX_D, V as wide as K and its own cache, blocks of a multiple of 16
 * slots): the same tiles, chunks and online softmax, with both products on
 * tdpbf16ps. S^T = K Q^T takes 16 keys' rows straight from the cache as the
 * A operand (16 consecutive positions share a block) and Q^T, rounded to
 * bf16 and transposed into dword pairs once per task, as B; P V takes P
 * rounded to bf16 (rows x keys) as A and a chunk's V rows interleaved in
 * key pairs as B, into f32 tiles added to alpha O. Rounding q and p to bf16
 * (8 significant bits) is what GPU attention kernels do; unit/test_kernels
 * holds the result to the f32 reference within a documented tolerance.
 * Every row's arithmetic is still independent of its group (each tile
 * element is one row's dot product, masked keys and padded rows are exact
 * zeros), so the bit-identity across prefill, chunks and decode holds on
 * AMX too: decode-sized calls take the same path.
 *
 * fp16 P V (p->fast and not p->batch_invariant, AVX512-FP16 without AMX,
 * d_v a multiple of 32 up to FA_PV_D; the generic AVX-512 task, i.e. the
 * calls that are not decode's heads tasks): after the f32 scores and online
 * softmax, a chunk's P and V rows are rounded to fp16 and O = alpha O + P V
 * takes vfmadd231ph, 32 columns a vector, whose sum over the chunk's (up
 * to 64) keys stays in fp16 and is then added to O in f32. Where the f32
 * FMAs do 16 multiply-adds an instruction these do 32 at the same rate
 * (Emerald Rapids: P V 14.6 -> 10.7 ms of a 512-token chunk at 4096
 * positions, 2 threads; the whole call 34.8 -> 32.0); P is stored as its
 * fp16 value twice in a dword, so its broadcast is a load, not a shuffle
 * that would take an FMA port. A chunk whose V rows hold a value beyond
 * FA_PH_MAX_V (its fp16 sums could then overflow) takes the f32 P V.
 * Against the f32 reference ~3e-3 of max |out| on random data (llama.cpp
 * sums a whole row's P V in fp16); unit/test_kernels holds it to 1e-2.
 *
 * fp16 scores (the same calls, over a BF16 cache, for the sequences widened
 * once for the call, fa_plan_wide): the wide copy is made in fp16 instead
 * of f32 -- K rows as fp16 pairs (each value twice in a dword: a broadcast
 * is a load), V rows as fp16 -- with each 256 positions' largest K row norm
 * and |v|. Q^T is scaled and rounded to fp16 once per task. S^T = K Q^T
 * runs on vfmadd231ph, 32 rows a vector, summed in fp16 (in segments of
 * FA_PH_SEG elements for wider heads), and stays fp16; the online softmax
 * runs on those 32 lanes (exp in fp16 arithmetic to ~1e-3, m kept as an
 * fp16 value so s - m is exact near the max, l summed in f32 over the very
 * fp16 p that P V uses) and writes P in the pair form the fp16 P V reads.
 * A chunk where a score could exceed FA_PH_MAX_S (the largest |q scale|
 * times the largest |k| of its 256 positions: Cauchy-Schwarz) or |v| could
 * exceed FA_PH_MAX_V takes the f32 scores and softmax on rows widened from
 * the cache as above. fp16 holds a score to ~1e-3 of its size (a sum of up
 * to 64 rounded products): about what rounding q to bf16 costs the AMX path
 * and GPU kernels. Emerald Rapids, 2 threads, a 512-token chunk at 4096
 * positions of the benchmark shape: 31.9 -> 18.0 ms; ~6e-3 of max |out|
 * against the f32 reference on random data (unit/test_kernels: 1e-2).
 *
 * Shapes: d_head <= FA_MAX_D and n_head / n_kv_head <= FA_ROWS; others take
 * the reference path. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "amx_x86.h"
#include "cpu_kernels.h"
#include "simd_x86.h"

#define FA_ROWS 64    /* query rows per task (4 vectors of 16) */
#define FA_KB 64      /* keys per chunk */
#define FA_MAX_D 1024 /* widest head (scratch is sized for the actual one) */
#define FA_PV_D 128   /* O columns per PV pass: 8 vectors */
#define FA_AMX_MAX_D 256
#define FA_PH_MAX_V 512.0f /* |v| above it: f32 P V (64 x 512 < 65504) */
/* fp16 scores: a chunk whose max |q scale| max |k| (norms of rows: by
 * Cauchy-Schwarz a bound on every score and partial sum) exceeds it takes
 * the f32 scores: fp16 holds a score to ~1e-3 of its size, so beyond this
 * its rounding could reach a sizeable fraction of a unit (and p's error
 * e^that), and far below fp16's overflow */
#define FA_PH_MAX_S 1024.0f
#define FA_PH_SEG 64     /* fp16 score sums over at most this many elements */
#define FA_WIDEN_POS 256 /* positions a widening task covers: whole chunks */

bool cpu_attention_tiled_supported(const struct moe_attn_params *p)
{
#if defined(__x86_64__)
    return cpu_kernels_isa() >= CPU_ISA_AVX2 && p->d_head <= FA_MAX_D &&
           p->n_head / p->n_kv_head <= FA_ROWS;
#else
    (void)p;
    return false;
#endif
}

#if defined(__x86_64__)

#define FA_TARGET MOE_AVX512_TARGET

/* The cache slot of position pos of the sequence whose block table is blocks. */
static inline size_t fa_slot(const struct moe_attn_params *p, const int32_t *blocks, int pos)
{
    return (size_t)blocks[pos / p->block_size] * p->block_size + pos % p->block_size;
}

/* The width of V's rows: d_v, or the whole head. */
static inline int fa_dv(const struct moe_attn_params *p)
{
    return p->d_v ? p->d_v : p->d_head;
}

/* Floats a widened row of d elements takes: whole vectors of 16. */
static inline int fa_ld(int d)
{
    return (d + 15) / 16 * 16;
}

struct fa_group {
    int t0, nt; /* batch rows [t0, t0 + nt), one sequence */
    int max_pos;
    int wide; /* its sequence's entry in fa_job.wide, or -1 */
};

/* How many keys the group's chunk at c0 holds (0 past its last position). */
static inline int fa_chunk_keys(const struct fa_group *g, int c0)
{
    const int rest = g->max_pos + 1 - c0;
    return rest < 0 ? 0 : rest < FA_KB ? rest : FA_KB;
}

/* A sequence's K and V rows at positions [0, n_pos) widened from a BF16
 * cache once for the call, [KV head][position][ldk or ldv] (no V rows when
 * V is K). Tasks take their rows from here instead of widening every chunk
 * themselves. */
struct fa_wide {
    int seq, n_pos;
    int task0;         /* its first task in fa_widen_task's numbering */
    size_t k_at, v_at; /* floats into fa_job.wide_buf */
};

struct fa_job {
    const struct moe_attn_params *p;
    bool amx;                      /* fa_task_amx */
    enum cpu_isa isa;              /* else fa_task_avx512 or fa_task_avx2 */
    const struct fa_group *groups; /* heaviest first */
    int n_group;
    int rep;      /* query heads per KV head */
    bool heads;   /* a task is a group's every KV head (fa_task_avx2_heads) */
    bool heads16; /* ... on AVX-512, four heads a vector (fa_task_avx512_heads) */
    bool pv_ph;   /* fa_task_avx512 sums P V in fp16 (see the top) */
    bool ph;      /* ... and the scores too, from fp16 wide copies (see the top) */
    struct fa_wide *wide;
    int n_wide, n_widen_tasks;
    float *wide_buf;
    float *wide_max; /* ph: max |k| (row norm), max |v| (element) per widening task and KV head */
    float *scratch;
    size_t scratch_stride; /* floats per thread */
};

/* Per-thread scratch, in floats, for heads of d (K) and dv (V) rounded up
 * to 16 (ldk, ldv): Q^T (d, rows); O (rows, ldv); S^T, then P^T (keys,
 * rows); a chunk's K and V rows widened from BF16 (keys, ldk / ldv); the
 * rows' m, l and alpha; for the fp16 P V, P^T as dwords (keys, rows) and
 * the chunk's V rows in fp16 (keys, ldv halves). */
static size_t fa_scratch_floats(int ldk, int ldv)
{
    return (size_t)ldk * FA_ROWS + (size_t)FA_ROWS * ldv + (size_t)FA_KB * FA_ROWS +
           (size_t)FA_KB * ldk + (size_t)FA_KB * ldv + 3 * FA_ROWS + (size_t)FA_KB * FA_ROWS +
           (size_t)FA_KB * ldv / 2 + (size_t)ldk * FA_ROWS / 2;
}

/* n bf16 values widened (exactly) to f32: inline, since a decode step widens
 * a short row per key and head (a call per row cost ~14% of a 16-sequence
 * decode step at 300 positions). */
/* S^T[j][rows] = sum_k K[j][k] Q^T[k][rows] for J keys (pointers kp) and
 * MV vectors of 16 rows. */
FA_TARGET static inline __attribute__((always_inline)) void fa_scores(const int J, const int MV,
                                                                      const float *const *kp, int d,
                                                                      const float *qt, float *st,
                                                                      float scale)
{
    __m512 acc[16][4];
#pragma GCC unroll 16
    for (int j = 0; j < J; j++)
#pragma GCC unroll 4
        for (int v = 0; v < MV; v++)
            acc[j][v] = _mm512_setzero_ps();
    for (int k = 0; k < d; k++) {
        __m512 q[4];
#pragma GCC unroll 4
        for (int v = 0; v < MV; v++)
            q[v] = _mm512_loadu_ps(qt + (size_t)k * FA_ROWS + 16 * v);
#pragma GCC unroll 16
        for (int j = 0; j < J; j++) {
            __m512 kb = _mm512_set1_ps(kp[j][k]);
#pragma GCC unroll 4
            for (int v = 0; v < MV; v++)
                acc[j][v] = _mm512_fmadd_ps(kb, q[v], acc[j][v]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 16
    for (int j = 0; j < J; j++)
#pragma GCC unroll 4
        for (int v = 0; v < MV; v++)
            _mm512_storeu_ps(st + (size_t)j * FA_ROWS + 16 * v, _mm512_mul_ps(acc[j][v], sc));
}

FA_TARGET static void fa_scores_any(int J, int MV, const float *const *kp, int d, const float *qt,
                                    float *st, float scale)
{
#define FS_CASE(JJ, VV)                                                                            \
    case (JJ)*8 + (VV): fa_scores(JJ, VV, kp, d, qt, st, scale); return;
    switch (J * 8 + MV) {
        FS_CASE(6, 4)
        FS_CASE(8, 3)
        FS_CASE(12, 2)
        FS_CASE(16, 1)
        FS_CASE(4, 4)
        FS_CASE(4, 3)
        FS_CASE(4, 2)
        FS_CASE(4, 1)
        FS_CASE(1, 4)
        FS_CASE(1, 3)
        FS_CASE(1, 2)
        FS_CASE(1, 1)
    default: break;
    }
#undef FS_CASE
    MOE_ASSERT(0 && "fa_scores_any: unsupported tile");
}

/* O[rows r0, r0 + RS, ... (RT of them)] = alpha O + sum_j P^T[j][r] V[j] over
 * nk keys, ND vectors of columns from `col` (the last masked by dm); O rows
 * ldo apart. V rows are f32 (vp) or, with B16, bf16 read in place (vb,
 * whole vectors), widened exactly. */
FA_TARGET static inline __attribute__((always_inline)) void
fa_pv(const int RT, const int ND, const bool B16, const int RS, int r0, int nk,
      const float *const *vp, const uint16_t *const *vb, int col, const float *pt,
      const float *alpha, float *o, int ldo, __mmask16 dm)
{
    __m512 acc[8][8];
    o += col;
#pragma GCC unroll 8
    for (int r = 0; r < RT; r++) {
        __m512 a = _mm512_set1_ps(alpha[r0 + RS * r]);
#pragma GCC unroll 8
        for (int v = 0; v < ND; v++)
            acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)(r0 + RS * r) * ldo + 16 * v), a);
    }
    for (int j = 0; j < nk; j++) {
        __m512 vv[8];
#pragma GCC unroll 8
        for (int v = 0; v < ND; v++) {
            if (B16)
                vv[v] = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                          (const __m256i *)(vb[j] + col + 16 * v))),
                                      16));
            else
                vv[v] = v == ND - 1 ? _mm512_maskz_loadu_ps(dm, vp[j] + col + 16 * v)
                                    : _mm512_loadu_ps(vp[j] + col + 16 * v);
        }
#pragma GCC unroll 8
        for (int r = 0; r < RT; r++) {
            __m512 pb = _mm512_set1_ps(pt[(size_t)j * FA_ROWS + r0 + RS * r]);
#pragma GCC unroll 8
            for (int v = 0; v < ND; v++)
                acc[r][v] = _mm512_fmadd_ps(pb, vv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 8
        for (int v = 0; v < ND; v++)
            _mm512_storeu_ps(o + (size_t)(r0 + RS * r) * ldo + 16 * v, acc[r][v]);
}

/* Rows per PV tile for ND vectors of d: about 24 accumulators. */
static int fa_pv_rows(int nd)
{
    static const int rows[9] = {0, 8, 8, 8, 6, 4, 4, 3, 3};
    return rows[nd];
}

FA_TARGET static void fa_pv_any(int RT, int ND, int r0, int nk, const float *const *vp, int col,
                                const float *pt, const float *alpha, float *o, int ldo,
                                __mmask16 dm)
{
#define PV_CASE(RR, DD)                                                                            \
    case (RR)*16 + (DD):                                                                           \
        fa_pv(RR, DD, false, 1, r0, nk, vp, NULL, col, pt, alpha, o, ldo, dm);                     \
        return;
    switch (RT * 16 + ND) {
        PV_CASE(8, 1)
        PV_CASE(8, 2)
        PV_CASE(8, 3)
        PV_CASE(6, 4)
        PV_CASE(4, 5)
        PV_CASE(4, 6)
        PV_CASE(3, 7)
        PV_CASE(3, 8)
        PV_CASE(4, 1)
        PV_CASE(4, 2)
        PV_CASE(4, 3)
        PV_CASE(4, 4)
        PV_CASE(2, 1)
        PV_CASE(2, 2)
        PV_CASE(2, 3)
        PV_CASE(2, 4)
        PV_CASE(2, 5)
        PV_CASE(2, 6)
        PV_CASE(2, 7)
        PV_CASE(2, 8)
        PV_CASE(1, 1)
        PV_CASE(1, 2)
        PV_CASE(1, 3)
        PV_CASE(1, 4)
        PV_CASE(1, 5)
        PV_CASE(1, 6)
        PV_CASE(1, 7)
        PV_CASE(1, 8)
    default: break;
    }
#undef PV_CASE
    MOE_ASSERT(0 && "fa_pv_any: unsupported tile");
}

/* ---- fp16 P V (see the top) ----
 * Compiled where MOE_HAVE_FP16 (simd_x86.h: gcc 12+); elsewhere pv_ph stays
 * false. */
#define FA_PH MOE_HAVE_FP16

#if FA_PH
#define FA_PH_TARGET MOE_FP16_TARGET

/* The outer-product tile both fp16 products use: acc[i][v] = the fp16 sum
 * over k < nk of A[i][k] B[k][32 v .. 32 v + 32), for I rows of A held as
 * fp16 pairs (dwords; element (i, k) at a[i ai + k ak]: its broadcast is a
 * load) and NV vectors of B's rows (row k at b + k ldb halves). */
FA_PH_TARGET static inline __attribute__((always_inline)) void
fa_tile_ph(const int I, const int NV, int nk, const uint32_t *a, size_t ai, size_t ak,
           const uint16_t *b, size_t ldb, __m512h acc[16][4])
{
#pragma GCC unroll 16
    for (int i = 0; i < I; i++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            acc[i][v] = _mm512_setzero_ph();
    for (int k = 0; k < nk; k++) {
        __m512h bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            bv[v] = _mm512_castsi512_ph(
                _mm512_loadu_si512((const void *)(b + (size_t)k * ldb + 32 * v)));
#pragma GCC unroll 16
        for (int i = 0; i < I; i++) {
            const __m512h ab = _mm512_castsi512_ph(_mm512_set1_epi32((int)a[i * ai + k * ak]));
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                acc[i][v] = _mm512_fmadd_ph(ab, bv[v], acc[i][v]);
        }
    }
}

/* O[rows r0 .. r0 + RT) (cols 0 .. 32 NDH) = alpha O + the fp16 sum over nk
 * keys of P^T[j][r] V16[j] (P as dwords p16, V rows ldh halves apart). */
FA_PH_TARGET static inline __attribute__((always_inline)) void
fa_pv_ph(const int RT, const int NDH, int r0, int nk, const uint16_t *v16, int ldh,
         const uint32_t *p16, const float *alpha, float *o, int ldo)
{
    __m512h acc[16][4];
    fa_tile_ph(RT, NDH, nk, p16 + r0, 1, FA_ROWS, v16, (size_t)ldh, acc);
#pragma GCC unroll 16
    for (int r = 0; r < RT; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r0 + r]);
        float *orow = o + (size_t)(r0 + r) * ldo;
#pragma GCC unroll 4
        for (int v = 0; v < NDH; v++) {
            __m512 lo, hi;
            fp16_to_f32x2(acc[r][v], &lo, &hi);
            _mm512_storeu_ps(orow + 32 * v, _mm512_fmadd_ps(_mm512_loadu_ps(orow + 32 * v), a, lo));
            _mm512_storeu_ps(orow + 32 * v + 16,
                             _mm512_fmadd_ps(_mm512_loadu_ps(orow + 32 * v + 16), a, hi));
        }
    }
}

FA_PH_TARGET static void fa_pv_ph_any(int RT, int NDH, int r0, int nk, const uint16_t *v16, int ldh,
                                      const uint32_t *p16, const float *alpha, float *o, int ldo)
{
#define PH_CASE(RR, DD)                                                                            \
    case (RR)*8 + (DD): fa_pv_ph(RR, DD, r0, nk, v16, ldh, p16, alpha, o, ldo); return;
    switch (RT * 8 + NDH) {
        PH_CASE(16, 1)
        PH_CASE(12, 2)
        PH_CASE(8, 3)
        PH_CASE(6, 4)
        PH_CASE(4, 1)
        PH_CASE(4, 2)
        PH_CASE(4, 3)
        PH_CASE(4, 4)
        PH_CASE(2, 1)
        PH_CASE(2, 2)
        PH_CASE(2, 3)
        PH_CASE(2, 4)
        PH_CASE(1, 1)
        PH_CASE(1, 2)
        PH_CASE(1, 3)
        PH_CASE(1, 4)
    default: break;
    }
#undef PH_CASE
    MOE_ASSERT(0 && "fa_pv_ph_any: unsupported tile");
}

/* fp16 scores: S^T[j][rows] = sum_k K[j][k] Q^T[k][rows] for J keys (K rows
 * as fp16 pairs, ldk apart) and MH vectors of 32 rows of qh (Q^T times
 * scale, fp16), summed in fp16, into sh as fp16 (FA_ROWS apart). Heads wider
 * than FA_PH_SEG are summed in segments of it, added in fp16 (each a sum of
 * fewer and smaller terms). */
FA_PH_TARGET static inline __attribute__((always_inline)) void
fa_scores_ph(const int J, const int MH, const uint32_t *k2, int ldk, int d, const uint16_t *qh,
             uint16_t *sh)
{
    for (int k0 = 0; k0 < d; k0 += FA_PH_SEG) {
        const int k1 = d - k0 > FA_PH_SEG ? k0 + FA_PH_SEG : d;
        __m512h acc[16][4];
        fa_tile_ph(J, MH, k1 - k0, k2 + k0, (size_t)ldk, 1, qh + (size_t)k0 * FA_ROWS, FA_ROWS,
                   acc);
#pragma GCC unroll 12
        for (int j = 0; j < J; j++)
#pragma GCC unroll 2
            for (int v = 0; v < MH; v++) {
                uint16_t *out = sh + (size_t)j * FA_ROWS + 32 * v;
                __m512h x = acc[j][v];
                if (k0)
                    x = _mm512_add_ph(x, _mm512_castsi512_ph(_mm512_loadu_si512((void *)out)));
                _mm512_storeu_si512((void *)out, _mm512_castph_si512(x));
            }
    }
}

FA_PH_TARGET static void fa_scores_ph_any(int J, int MH, const uint32_t *k2, int ldk, int d,
                                          const uint16_t *qh, uint16_t *sh)
{
#define SH_CASE(JJ, VV)                                                                            \
    case (JJ)*4 + (VV): fa_scores_ph(JJ, VV, k2, ldk, d, qh, sh); return;
    switch (J * 4 + MH) {
        SH_CASE(12, 2)
        SH_CASE(12, 1)
        SH_CASE(4, 2)
        SH_CASE(4, 1)
        SH_CASE(1, 2)
        SH_CASE(1, 1)
    default: break;
    }
#undef SH_CASE
    MOE_ASSERT(0 && "fa_scores_ph_any: unsupported tile");
}

/* O = alpha O + P V in fp16 tiles for rows [0, n_rows) from P^T in fp16
 * pairs (p16) and nk V rows in fp16 (v16, ldh apart). */
FA_PH_TARGET static void fa_pv_ph_rows(int nk, int n_rows, int dv, const uint16_t *v16, int ldh,
                                       const uint32_t *p16, const float *alpha, float *o, int ldo)
{
    /* about 24 accumulators a tile, as the f32 P V */
    const int ndh = dv / 32, rt = ndh == 1 ? 16 : ndh == 2 ? 12 : ndh == 3 ? 8 : 6;
    int r = 0;
    for (; r + rt <= n_rows; r += rt)
        fa_pv_ph_any(rt, ndh, r, nk, v16, ldh, p16, alpha, o, ldo);
    for (; r + 4 <= n_rows; r += 4)
        fa_pv_ph_any(4, ndh, r, nk, v16, ldh, p16, alpha, o, ldo);
    for (; r + 2 <= n_rows; r += 2)
        fa_pv_ph_any(2, ndh, r, nk, v16, ldh, p16, alpha, o, ldo);
    for (; r < n_rows; r++)
        fa_pv_ph_any(1, ndh, r, nk, v16, ldh, p16, alpha, o, ldo);
}

/* exp(x) in fp16 for x <= 0 (or -inf), 32 lanes: x clamped at -24 (exp
 * of it is below fp16's least subnormal: exactly 0), n = round(x log2 e),
 * r = x - n ln 2 with ln 2 in two parts, the Taylor polynomial of degree 4
 * (|r| <= ln 2 / 2: relative error < 5e-5), scaled by 2^n. Every fp16 x
 * in [-17, 0] gives exp x within 5.7e-4 relative (0.84 of an fp16 ulp) where
 * the result is a normal fp16. */
FA_PH_TARGET static inline __attribute__((always_inline)) __m512h exp_ph(__m512h x)
{
    x = _mm512_max_ph(x, _mm512_set1_ph((_Float16)-24.0f));
    const __m512h n = _mm512_roundscale_ph(_mm512_mul_ph(x, _mm512_set1_ph((_Float16)1.44269504f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512h r = _mm512_fnmadd_ph(n, _mm512_set1_ph((_Float16)0.693359375f), x);
    r = _mm512_fnmadd_ph(n, _mm512_set1_ph((_Float16)-2.12194440e-4f), r);
    __m512h pl = _mm512_fmadd_ph(_mm512_set1_ph((_Float16)(1.0f / 24)), r,
                                 _mm512_set1_ph((_Float16)(1.0f / 6)));
    pl = _mm512_fmadd_ph(pl, r, _mm512_set1_ph((_Float16)0.5f));
    pl = _mm512_fmadd_ph(pl, r, _mm512_set1_ph((_Float16)1.0f));
    pl = _mm512_fmadd_ph(pl, r, _mm512_set1_ph((_Float16)1.0f));
    return _mm512_scalef_ph(pl, n);
}

/* The online softmax of fa_softmax for the ph path, 32 rows a vector, in
 * fp16: the chunk's scores sh (fp16, scaled) become P^T in p16 as fp16
 * pairs (each value twice in a dword, for fa_pv_ph's broadcasts). m stays an
 * fp16 value (the largest score seen), so s - m is exact where s is within
 * a factor 2 of m and one fp16 rounding otherwise; p = exp_ph(s - m); l sums
 * in f32 the fp16 p that P V uses; alpha = exp(m_old - m_new) in f32. Keys
 * after a row's position give p = 0 exactly; masks only in chunks that
 * reach past a row's position. */
FA_PH_TARGET static void fa_softmax_ph(uint16_t *sh, uint32_t *p16, int nk, int c0, int mh,
                                       const int32_t *rpos, float *mrow, float *lrow, float *alpha)
{
    /* word i of a 32-word vector from word i / 2 (rows 0..15) or 16 + i / 2 */
    const __m512i pair_lo = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9,
                                             8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
    const __m512h neg_inf = _mm512_castsi512_ph(_mm512_set1_epi16((short)0xfc00));
    for (int v = 0; v < mh; v++) {
        const __m512i pos_lo = _mm512_loadu_si512((const void *)(rpos + 32 * v));
        const __m512i pos_hi = _mm512_loadu_si512((const void *)(rpos + 32 * v + 16));
        __m512h cmax = neg_inf;
        if (c0 + nk - 1 > _mm512_reduce_min_epi32(_mm512_min_epi32(pos_lo, pos_hi))) {
            for (int kk = 0; kk < nk; kk++) {
                uint16_t *s = sh + (size_t)kk * FA_ROWS + 32 * v;
                const __m512i key = _mm512_set1_epi32(c0 + kk);
                const __mmask32 masked = (__mmask32)_mm512_cmpgt_epi32_mask(key, pos_lo) |
                                         (__mmask32)_mm512_cmpgt_epi32_mask(key, pos_hi) << 16;
                const __m512h sv = _mm512_castsi512_ph(_mm512_mask_mov_epi16(
                    _mm512_loadu_si512((void *)s), masked, _mm512_castph_si512(neg_inf)));
                _mm512_storeu_si512((void *)s, _mm512_castph_si512(sv));
                cmax = _mm512_max_ph(cmax, sv);
            }
        } else {
            for (int kk = 0; kk < nk; kk++)
                cmax = _mm512_max_ph(cmax, _mm512_castsi512_ph(_mm512_loadu_si512((
                                               const void *)(sh + (size_t)kk * FA_ROWS + 32 * v))));
        }
        __m512 cm_lo, cm_hi;
        fp16_to_f32x2(cmax, &cm_lo, &cm_hi);
        const __m512 mold_lo = _mm512_loadu_ps(mrow + 32 * v);
        const __m512 mold_hi = _mm512_loadu_ps(mrow + 32 * v + 16);
        /* every row sees key 0 in chunk 0, so m is finite from then on. m is
         * rounded up to fp16 (exact where every chunk was fp16; after a chunk
         * of f32 scores it may not be) and kept as that value, so p <= 1 and
         * alpha scale to the same m; an m beyond fp16 stays f32 (its p are
         * exp(s - inf) = 0, which exp(s - m) is for the scores allowed here) */
        __m512 mnew_lo = _mm512_max_ps(mold_lo, cm_lo);
        __m512 mnew_hi = _mm512_max_ps(mold_hi, cm_hi);
        const __m256i up_lo = _mm512_cvtps_ph(mnew_lo, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
        const __m256i up_hi = _mm512_cvtps_ph(mnew_hi, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
        const __m512h mnew =
            _mm512_castsi512_ph(_mm512_inserti64x4(_mm512_castsi256_si512(up_lo), up_hi, 1));
        const __m512 inf = _mm512_set1_ps(INFINITY);
        fp16_to_f32x2(mnew, &cm_lo, &cm_hi);
        mnew_lo = _mm512_mask_mov_ps(cm_lo, _mm512_cmp_ps_mask(cm_lo, inf, _CMP_EQ_OQ), mnew_lo);
        mnew_hi = _mm512_mask_mov_ps(cm_hi, _mm512_cmp_ps_mask(cm_hi, inf, _CMP_EQ_OQ), mnew_hi);
        __m512 sum_lo = _mm512_setzero_ps(), sum_hi = _mm512_setzero_ps();
        for (int kk = 0; kk < nk; kk++) {
            const __m512h e =
                exp_ph(_mm512_sub_ph(_mm512_castsi512_ph(_mm512_loadu_si512(
                                         (const void *)(sh + (size_t)kk * FA_ROWS + 32 * v))),
                                     mnew));
            const __m512i eb = _mm512_castph_si512(e);
            uint32_t *pp = p16 + (size_t)kk * FA_ROWS + 32 * v;
            _mm512_storeu_si512((void *)pp, _mm512_permutexvar_epi16(pair_lo, eb));
            _mm512_storeu_si512((void *)(pp + 16), _mm512_permutexvar_epi16(pair_hi, eb));
            __m512 e_lo, e_hi;
            fp16_to_f32x2(e, &e_lo, &e_hi);
            sum_lo = _mm512_add_ps(sum_lo, e_lo);
            sum_hi = _mm512_add_ps(sum_hi, e_hi);
        }
        const __m512 a_lo = exp_avx512(_mm512_sub_ps(mold_lo, mnew_lo));
        const __m512 a_hi = exp_avx512(_mm512_sub_ps(mold_hi, mnew_hi));
        _mm512_storeu_ps(lrow + 32 * v,
                         _mm512_fmadd_ps(_mm512_loadu_ps(lrow + 32 * v), a_lo, sum_lo));
        _mm512_storeu_ps(lrow + 32 * v + 16,
                         _mm512_fmadd_ps(_mm512_loadu_ps(lrow + 32 * v + 16), a_hi, sum_hi));
        _mm512_storeu_ps(mrow + 32 * v, mnew_lo);
        _mm512_storeu_ps(mrow + 32 * v + 16, mnew_hi);
        _mm512_storeu_ps(alpha + 32 * v, a_lo);
        _mm512_storeu_ps(alpha + 32 * v + 16, a_hi);
    }
}

/* The chunk's P V in fp16 for rows [0, n_rows): V rows (vp, f32) and P^T (pt)
 * rounded into v16 and p16 first. Returns false, having changed nothing in
 * O, when a V value exceeds FA_PH_MAX_V: the caller runs the f32 P V. */
FA_PH_TARGET static bool fa_chunk_pv_ph(int nk, int n_rows, int dv, const float *const *vp,
                                        const float *pt, const float *alpha, float *o, int ldo,
                                        uint32_t *p16, uint16_t *v16)
{
    __m512 vmax = _mm512_setzero_ps();
    for (int j = 0; j < nk; j++)
        for (int k = 0; k < dv; k += 16) {
            const __m512 x = _mm512_loadu_ps(vp[j] + k);
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(x));
            _mm256_storeu_si256((__m256i *)(v16 + (size_t)j * dv + k),
                                _mm256_castph_si256(_mm512_cvtxps_ph(x)));
        }
    if (!(_mm512_reduce_max_ps(vmax) <= FA_PH_MAX_V))
        return false;
    const int mv = (n_rows + 15) / 16;
    for (int j = 0; j < nk; j++)
        for (int v = 0; v < mv; v++) {
            _mm512_storeu_si512((void *)(p16 + (size_t)j * FA_ROWS + 16 * v),
                                fp16_pairs16(_mm512_loadu_ps(pt + (size_t)j * FA_ROWS + 16 * v)));
        }
    fa_pv_ph_rows(nk, n_rows, dv, v16, dv, p16, alpha, o, ldo);
    return true;
}
#endif /* FA_PH */

/* The online softmax over a chunk's nk keys at c0, 16 rows per vector:
 * S^T in pt (scaled by `scale` here: 1 where the scores came scaled) becomes
 * P^T; keys after a row's position are masked (p = 0 exactly); m, l and
 * alpha per row. */
FA_TARGET static void fa_softmax(float *pt, int nk, int c0, int mv, const int32_t *rpos,
                                 float *mrow, float *lrow, float *alpha, float scale)
{
    const __m512 sc = _mm512_set1_ps(scale);
    for (int v = 0; v < mv; v++) {
        const __m512i posv = _mm512_loadu_si512((const void *)(rpos + 16 * v));
        __m512 cmax = _mm512_set1_ps(-INFINITY);
        for (int kk = 0; kk < nk; kk++) {
            float *s = pt + (size_t)kk * FA_ROWS + 16 * v;
            __mmask16 masked = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(c0 + kk), posv);
            __m512 sv = _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_loadu_ps(s), sc), masked,
                                           _mm512_set1_ps(-INFINITY));
            _mm512_storeu_ps(s, sv);
            cmax = _mm512_max_ps(cmax, sv);
        }
        __m512 mold = _mm512_loadu_ps(mrow + 16 * v);
        __m512 mnew = _mm512_max_ps(mold, cmax);
        /* every row sees key 0 in chunk 0, so mnew is finite from then on */
        __m512 a = exp_avx512(_mm512_sub_ps(mold, mnew));
        __m512 sum = _mm512_setzero_ps();
        for (int kk = 0; kk < nk; kk++) {
            float *s = pt + (size_t)kk * FA_ROWS + 16 * v;
            __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s), mnew));
            _mm512_storeu_ps(s, e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(lrow + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(lrow + 16 * v), a, sum));
        _mm512_storeu_ps(mrow + 16 * v, mnew);
        _mm512_storeu_ps(alpha + 16 * v, a);
    }
}

/* ---- AMX (see the top) ---- */

/* Per-thread scratch of the AMX task, in floats, on top of the f32 one: Q^T
 * as B tiles (d/32 steps x 4 row groups x 1 KB), P as A tiles (4 row groups
 * x 2 key steps x 1 KB), V as B tiles (d/16 column tiles x 2 key steps x
 * 1 KB), one 16 x 16 f32 tile of PV. */
static size_t fa_amx_scratch_floats(int d)
{
    return ((size_t)d / 32 * 4 * 256) + (size_t)4 * 2 * 256 + (size_t)d / 16 * 2 * 256 + 256;
}

/* The scores of one 16-key group: S^T[key][row] for the mv row groups, from
 * the K rows at kb (stride ldk bytes) and Q^T tiles qb, into st (FA_ROWS
 * apart). */
static void fa_amx_scores(int mv, int n_ks, const char *kb, int64_t ldk, const char *qb, float *st)
{
    AMX_ZERO(0);
    AMX_ZERO(1);
    AMX_ZERO(2);
    AMX_ZERO(3);
    for (int ks = 0; ks < n_ks; ks++) {
        const char *q = qb + (size_t)ks * 4 * 1024;
        AMX_LOAD(4, kb + ks * 64, ldk);
        AMX_LOAD(5, q, 64);
        AMX_DP("tdpbf16ps", 0, 4, 5);
        if (mv > 1) {
            AMX_LOAD(6, q + 1024, 64);
            AMX_DP("tdpbf16ps", 1, 4, 6);
        }
        if (mv > 2) {
            AMX_LOAD(7, q + 2048, 64);
            AMX_DP("tdpbf16ps", 2, 4, 7);
        }
        if (mv > 3) {
            AMX_LOAD(5, q + 3072, 64);
            AMX_DP("tdpbf16ps", 3, 4, 5);
        }
    }
    const int64_t lds = FA_ROWS * 4;
    AMX_STORE(0, st, lds);
    if (mv > 1)
        AMX_STORE(1, st + 16, lds);
    if (mv > 2)
        AMX_STORE(2, st + 32, lds);
    if (mv > 3)
        AMX_STORE(3, st + 48, lds);
}

/* C (16 x 16 f32) = sum over n_s key steps of A (P rows) . B (V columns). */
static void fa_amx_pv(int n_s, const char *pa, const char *vb, float *c)
{
    AMX_ZERO(0);
    for (int s = 0; s < n_s; s++) {
        AMX_LOAD(4, pa + (size_t)s * 1024, 64);
        AMX_LOAD(6, vb + (size_t)s * 1024, 64);
        AMX_DP("tdpbf16ps", 0, 4, 6);
    }
    AMX_STORE(0, c, 64);
}

#define FA_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,avx2")))

FA_AMX_TARGET static void fa_task_amx(const struct fa_job *j, int task, int thread)
{
    const struct moe_attn_params *p = j->p;
    const struct fa_group *g = &j->groups[task / p->n_kv_head];
    const int kvh = task % p->n_kv_head;
    const int d = p->d_head, rep = j->rep;
    const int n_rows = g->nt * rep;
    const int mv = (n_rows + 15) / 16, n_ks = d / 32, nct = d / 16;
    const size_t slot_stride = (size_t)p->n_kv_head * d;
    const int64_t ldk = (int64_t)slot_stride * 2; /* bytes between a key's rows */
    float *o = j->scratch + (size_t)thread * j->scratch_stride;
    float *pt = o + (size_t)FA_ROWS * d;
    float *mrow = pt + (size_t)FA_KB * FA_ROWS, *lrow = mrow + FA_ROWS, *alpha = lrow + FA_ROWS;
    char *qb = (char *)(alpha + FA_ROWS);
    char *pa = qb + (size_t)n_ks * 4 * 1024;
    char *vb = pa + (size_t)4 * 2 * 1024;
    float *ct = (float *)(vb + (size_t)nct * 2 * 1024);
    int32_t rpos[FA_ROWS];

    /* Q^T tiles: for step ks and row group rg, 16 dword rows (pairs of d)
     * x 16 query rows; padded rows are zero queries at the last position. */
    for (int r = 0; r < mv * 16; r++) {
        rpos[r] = r < n_rows ? p->tok_pos[g->t0 + r / rep] : g->max_pos;
        mrow[r] = -INFINITY;
        lrow[r] = 0.0f;
    }
    for (int rg = 0; rg < mv; rg++)
        for (int ks = 0; ks < n_ks; ks++) {
            __m512 v[16];
            for (int i = 0; i < 16; i++) {
                const int r = rg * 16 + i;
                if (r >= n_rows) {
                    v[i] = _mm512_setzero_ps();
                    continue;
                }
                const int t = g->t0 + r / rep, h = kvh * rep + r % rep;
                const float *q = p->q + ((size_t)t * p->n_head + h) * d + ks * 32;
                v[i] = _mm512_castsi512_ps(
                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q)));
            }
            transpose16_avx512(v); /* v[dp]: pair dp of the 16 rows */
            char *dst = qb + ((size_t)ks * 4 + (size_t)rg) * 1024;
            for (int dp = 0; dp < 16; dp++)
                _mm512_storeu_ps((float *)(dst + dp * 64), v[dp]);
        }
    memset(o, 0, (size_t)mv * 16 * d * sizeof(float));

    const int32_t *blocks = p->block_tables + (size_t)p->tok_seq[g->t0] * p->max_blocks;
    const uint16_t *kc = p->k_cache, *vc = p->v_cache;
    /* vpermt2w indices: key 2kp's and key 2kp+1's element c, c + 1, ... */
    __m512i ilo, ihi;
    {
        uint16_t lo[32], hi[32];
        for (int i = 0; i < 16; i++) {
            lo[2 * i] = (uint16_t)i;
            lo[2 * i + 1] = (uint16_t)(32 + i);
            hi[2 * i] = (uint16_t)(16 + i);
            hi[2 * i + 1] = (uint16_t)(48 + i);
        }
        ilo = _mm512_loadu_si512((const void *)lo);
        ihi = _mm512_loadu_si512((const void *)hi);
    }
    for (int c0 = 0; c0 <= g->max_pos; c0 += FA_KB) {
        const int nk = fa_chunk_keys(g, c0);
        const int n_kg = (nk + 15) / 16, n_s = (nk + 31) / 32;
        /* S^T, 16 keys at a time: their rows are 16 consecutive slots */
        for (int kg = 0; kg < n_kg; kg++) {
            int pos = c0 + kg * 16;
            size_t slot = fa_slot(p, blocks, pos);
            fa_amx_scores(mv, n_ks, (const char *)(kc + slot * slot_stride + (size_t)kvh * d), ldk,
                          qb, pt + (size_t)kg * 16 * FA_ROWS);
        }
        fa_softmax(pt, nk, c0, mv, rpos, mrow, lrow, alpha, p->scale);
        /* P as A tiles: row group rg, key step s: 16 rows x 32 keys of bf16
         * (keys past nk are zero) */
        for (int rg = 0; rg < mv; rg++)
            for (int s2 = 0; s2 < n_s; s2++) {
                __m512 lo[16], hi[16];
                for (int i = 0; i < 16; i++) {
                    int k0 = s2 * 32 + i, k1 = k0 + 16;
                    lo[i] = k0 < nk ? _mm512_loadu_ps(pt + (size_t)k0 * FA_ROWS + 16 * rg)
                                    : _mm512_setzero_ps();
                    hi[i] = k1 < nk ? _mm512_loadu_ps(pt + (size_t)k1 * FA_ROWS + 16 * rg)
                                    : _mm512_setzero_ps();
                }
                transpose16_avx512(lo); /* lo[r]: keys 0..15 of row r */
                transpose16_avx512(hi);
                char *dst = pa + ((size_t)rg * 2 + (size_t)s2) * 1024;
                for (int r = 0; r < 16; r++)
                    _mm512_storeu_si512((void *)(dst + r * 64),
                                        (__m512i)_mm512_cvtne2ps_pbh(hi[r], lo[r]));
            }
        /* V as B tiles: column tile ct, key step s: 16 key pairs x 16
         * columns of (key 2kp, key 2kp + 1) */
        for (int kp = 0; kp < n_s * 16; kp++) {
            const int k0 = 2 * kp, k1 = k0 + 1;
            const uint16_t *v0 =
                k0 < nk ? vc + fa_slot(p, blocks, c0 + k0) * slot_stride + (size_t)kvh * d : NULL;
            const uint16_t *v1 =
                k1 < nk ? vc + fa_slot(p, blocks, c0 + k1) * slot_stride + (size_t)kvh * d : NULL;
            for (int c32 = 0; c32 < d; c32 += 32) {
                __m512i a =
                    v0 ? _mm512_loadu_si512((const void *)(v0 + c32)) : _mm512_setzero_si512();
                __m512i b =
                    v1 ? _mm512_loadu_si512((const void *)(v1 + c32)) : _mm512_setzero_si512();
                __m512i r0 = _mm512_permutex2var_epi16(a, ilo, b); /* columns c32 .. c32 + 15 */
                __m512i r1 = _mm512_permutex2var_epi16(a, ihi, b); /* c32 + 16 .. c32 + 31 */
                const int ct0 = c32 / 16, s2 = kp / 16, row = kp % 16;
                _mm512_storeu_si512((void *)(vb + ((size_t)ct0 * 2 + s2) * 1024 + row * 64), r0);
                _mm512_storeu_si512((void *)(vb + ((size_t)(ct0 + 1) * 2 + s2) * 1024 + row * 64),
                                    r1);
            }
        }
        /* O = alpha O + P V, one 16 x 16 tile at a time */
        for (int rg = 0; rg < mv; rg++)
            for (int c = 0; c < nct; c++) {
                fa_amx_pv(n_s, pa + (size_t)rg * 2 * 1024, vb + (size_t)c * 2 * 1024, ct);
                for (int i = 0; i < 16; i++) {
                    float *orow = o + (size_t)(rg * 16 + i) * d + c * 16;
                    _mm512_storeu_ps(orow, _mm512_fmadd_ps(_mm512_loadu_ps(orow),
                                                           _mm512_set1_ps(alpha[rg * 16 + i]),
                                                           _mm512_loadu_ps(ct + i * 16)));
                }
            }
    }
    for (int r = 0; r < n_rows; r++) {
        const int t = g->t0 + r / rep, h = kvh * rep + r % rep;
        float *out = p->out + ((size_t)t * p->n_head + h) * d;
        const __m512 inv = _mm512_set1_ps(1.0f / lrow[r]);
        for (int k = 0; k < d; k += 16)
            _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)r * d + k), inv));
    }
}

/* ---- the f32 task: shared set-up and finish, one chunk loop per ISA ---- */

/* One task's state: its group and KV head, and its views of the thread's
 * scratch (the fa_scratch_floats layout). */
struct fa_ctx {
    const struct moe_attn_params *p;
    const struct fa_group *g;
    int kvh, d, dv, n_rows, ldk, ldv, rep;
    size_t slot_stride;
    bool wide;            /* BF16 cache: rows widened into kw / vw */
    bool same_kv;         /* a latent row: V is K's first dv */
    const float *kf, *vf; /* the group's KV head in its fa_wide copy, or NULL */
    const int32_t *blocks;
    float *qt, *o, *pt, *kw, *vw, *mrow, *lrow, *alpha;
    uint32_t *p16;      /* fp16 P V: P^T, each fp16 twice in a dword */
    uint16_t *v16;      /* fp16 P V: the chunk's V rows */
    const uint32_t *kh; /* ph: the KV head's K rows in the wide copy, fp16 pairs (ldk apart) */
    const uint16_t *vh; /* ph: its V rows, fp16 (dv apart) */
    const float *wmax;  /* ph: the sequence's widening tasks' maxima (fa_job.wide_max) */
    uint16_t *qh;       /* ph: Q^T times scale in fp16 (d, FA_ROWS) */
    float qnorm;        /* ph: max |q scale| over the rows (norms) */
    int32_t rpos[FA_ROWS];
};

/* Q^T: row r = token i * rep + head g; rows padded to a multiple of 16 are
 * zero queries at the group's last position (finite, discarded); O zero,
 * m = -inf, l = 0. Plain C: the same for every ISA. */
static void fa_begin(const struct fa_job *j, int task, int thread, struct fa_ctx *c)
{
    const struct moe_attn_params *p = j->p;
    const struct fa_group *g = &j->groups[task / p->n_kv_head];
    c->p = p;
    c->g = g;
    c->kvh = task % p->n_kv_head;
    c->rep = j->rep;
    c->d = p->d_head;
    c->dv = fa_dv(p);
    c->n_rows = g->nt * j->rep;
    c->ldk = fa_ld(c->d);
    c->ldv = fa_ld(c->dv);
    c->slot_stride = (size_t)p->n_kv_head * c->d;
    c->wide = p->kv_dtype == MOE_DTYPE_BF16;
    c->same_kv = p->v_cache == p->k_cache;
    c->blocks = p->block_tables + (size_t)p->tok_seq[g->t0] * p->max_blocks;
    c->kf = c->vf = NULL;
    c->kh = NULL;
    c->vh = NULL;
    if (g->wide >= 0 && j->ph) {
        const struct fa_wide *w = &j->wide[g->wide];
        c->kh = (const uint32_t *)(j->wide_buf + w->k_at) + (size_t)c->kvh * w->n_pos * c->ldk;
        c->vh = (const uint16_t *)(j->wide_buf + w->v_at) + (size_t)c->kvh * w->n_pos * c->dv;
        c->wmax = j->wide_max + (size_t)w->task0 * p->n_kv_head * 2;
    } else if (g->wide >= 0) {
        const struct fa_wide *w = &j->wide[g->wide];
        c->kf = j->wide_buf + w->k_at + (size_t)c->kvh * w->n_pos * c->ldk;
        c->vf = c->same_kv ? NULL : j->wide_buf + w->v_at + (size_t)c->kvh * w->n_pos * c->ldv;
    }
    c->qt = j->scratch + (size_t)thread * j->scratch_stride;
    c->o = c->qt + (size_t)c->ldk * FA_ROWS;
    c->pt = c->o + (size_t)FA_ROWS * c->ldv;
    c->kw = c->pt + (size_t)FA_KB * FA_ROWS;
    c->vw = c->kw + (size_t)FA_KB * c->ldk;
    c->mrow = c->vw + (size_t)FA_KB * c->ldv;
    c->lrow = c->mrow + FA_ROWS;
    c->alpha = c->lrow + FA_ROWS;
    c->p16 = (uint32_t *)(c->alpha + FA_ROWS);
    c->v16 = (uint16_t *)(c->p16 + (size_t)FA_KB * FA_ROWS);
    c->qh = c->v16 + (size_t)FA_KB * c->ldv;
    const int padded = (c->n_rows + 15) / 16 * 16;
    memset(c->qt, 0, (size_t)c->d * FA_ROWS * sizeof(float));
    for (int r = 0; r < FA_ROWS; r++) { /* every row: the ph softmax takes 32 a vector */
        c->rpos[r] = r < c->n_rows ? p->tok_pos[g->t0 + r / c->rep] : g->max_pos;
        c->mrow[r] = -INFINITY;
        c->lrow[r] = 0.0f;
    }
    for (int r = 0; r < c->n_rows; r++) {
        const int t = g->t0 + r / c->rep, h = c->kvh * c->rep + r % c->rep;
        const float *q = p->q + ((size_t)t * p->n_head + h) * c->d;
        for (int k = 0; k < c->d; k++)
            c->qt[(size_t)k * FA_ROWS + r] = q[k];
    }
    memset(c->o, 0, (size_t)padded * c->ldv * sizeof(float));
}

/* The cache slots of the n keys at positions pos0, pos0 + 1, ...: the block
 * and the offset in it advance key by key (a division per key cost ~4% of
 * a decode call). */
static inline void fa_slots(const struct fa_ctx *c, int pos0, int n, size_t *slot)
{
    const int bs = c->p->block_size;
    int b = pos0 / bs, in = pos0 % bs;
    for (int i = 0; i < n; i++) {
        slot[i] = (size_t)c->blocks[b] * bs + in;
        if (++in == bs) {
            in = 0;
            b++;
        }
    }
}

/* Requests into L2 the K and V rows of this task's KV head in a slot. */
static inline __attribute__((always_inline)) void fa_prefetch(const struct fa_ctx *c, size_t slot)
{
    const struct moe_attn_params *p = c->p;
    const size_t es = c->wide ? sizeof(uint16_t) : sizeof(float);
    const size_t off = (slot * c->slot_stride + (size_t)c->kvh * c->d) * es;
    const char *k = (const char *)p->k_cache + off, *v = (const char *)p->v_cache + off;
    for (size_t b = 0; b < (size_t)c->d * es; b += 64)
        _mm_prefetch(k + b, _MM_HINT_T1);
    if (!c->same_kv)
        for (size_t b = 0; b < (size_t)c->dv * es; b += 64)
            _mm_prefetch(v + b, _MM_HINT_T1);
}

/* The K and V rows of the chunk's nk keys at c0 as f32 (kp, vp): in the
 * cache for F32, widened by `widen` (an ISA's bf16 -> f32, inlined) for
 * BF16. Each key's rows of the next chunk are requested as this one's are
 * read: the slots lie in blocks scattered over the cache, which the
 * hardware prefetchers do not follow, so they now arrive while this chunk's
 * products run. Decode of 16 sequences (bench-kernels --attention's shape,
 * Zen 3, 2 threads, medians of 5 alternated runs): 4096 positions 12.4 ->
 * 11.4 ms a call, 1024 2.10 -> 1.99 ms; a 512-token prefill chunk at 4096
 * unchanged. The gather still costs about what the products do there
 * (one thread, 4096 positions: ~12 ms of gather alone, ~9 ms of products
 * alone, 22 ms both): the next step is reading bf16 rows in the tiles. */
static inline __attribute__((always_inline)) void
fa_gather(const struct fa_ctx *c, int c0, int nk, const float **kp, const float **vp,
          void (*widen)(float *, const uint16_t *, int))
{
    const struct moe_attn_params *p = c->p;
    if (c->kf) {
        for (int i = 0; i < nk; i++) {
            kp[i] = c->kf + (size_t)(c0 + i) * c->ldk;
            vp[i] = c->same_kv ? kp[i] : c->vf + (size_t)(c0 + i) * c->ldv;
        }
        return;
    }
    const int next = c0 + FA_KB, n_next = fa_chunk_keys(c->g, c0 + FA_KB);
    size_t slot[FA_KB], slot_next[FA_KB];
    fa_slots(c, c0, nk, slot);
    fa_slots(c, next, n_next, slot_next);
    for (int i = 0; i < nk; i++) {
        if (i < n_next)
            fa_prefetch(c, slot_next[i]);
        size_t off = slot[i] * c->slot_stride + (size_t)c->kvh * c->d;
        if (c->wide) {
            float *kr = c->kw + (size_t)i * c->ldk, *vr = c->vw + (size_t)i * c->ldv;
            widen(kr, (const uint16_t *)p->k_cache + off, c->d);
            if (!c->same_kv)
                widen(vr, (const uint16_t *)p->v_cache + off, c->dv);
            kp[i] = kr;
            vp[i] = c->same_kv ? kr : vr;
        } else {
            kp[i] = (const float *)p->k_cache + off;
            vp[i] = (const float *)p->v_cache + off;
        }
    }
}

/* out = O / l for the task's rows (one rounded multiply each, as the
 * vector forms did). */
static void fa_end(const struct fa_ctx *c)
{
    const struct moe_attn_params *p = c->p;
    for (int r = 0; r < c->n_rows; r++) {
        const int t = c->g->t0 + r / c->rep, h = c->kvh * c->rep + r % c->rep;
        float *out = p->out + ((size_t)t * p->n_head + h) * c->dv;
        const float inv = 1.0f / c->lrow[r];
        const float *orow = c->o + (size_t)r * c->ldv;
        for (int k = 0; k < c->dv; k++)
            out[k] = orow[k] * inv;
    }
}

#if FA_PH
/* ph: Q^T times scale in fp16 (qh) and the largest norm of its rows. */
FA_TARGET static void fa_begin_ph(struct fa_ctx *c)
{
    const __m512 sc = _mm512_set1_ps(c->p->scale);
    __m512 ss[FA_ROWS / 16];
    for (int v = 0; v < FA_ROWS / 16; v++)
        ss[v] = _mm512_setzero_ps();
    for (int k = 0; k < c->d; k++)
        for (int v = 0; v < FA_ROWS / 16; v++) {
            const __m512 x =
                _mm512_mul_ps(_mm512_loadu_ps(c->qt + (size_t)k * FA_ROWS + 16 * v), sc);
            ss[v] = _mm512_fmadd_ps(x, x, ss[v]);
            _mm256_storeu_si256((__m256i *)(c->qh + (size_t)k * FA_ROWS + 16 * v),
                                _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    __m512 mx = ss[0];
    for (int v = 1; v < FA_ROWS / 16; v++)
        mx = _mm512_max_ps(mx, ss[v]);
    c->qnorm = sqrtf(_mm512_reduce_max_ps(mx));
}

/* ph: the chunk at c0 of a wide sequence with fp16 scores, its softmax into
 * fp16 P and fp16 P V. Returns false, having changed nothing, where the
 * chunk's maxima would let an fp16 sum overflow: the caller runs the f32
 * tiles on rows widened from the cache. */
FA_PH_TARGET static bool fa_chunk_ph(struct fa_ctx *c, int c0, int nk)
{
    const float *mx = c->wmax + ((size_t)(c0 / FA_WIDEN_POS) * c->p->n_kv_head + c->kvh) * 2;
    if (!(c->qnorm * mx[0] <= FA_PH_MAX_S && mx[1] <= FA_PH_MAX_V))
        return false;
    const int mh = (c->n_rows + 31) / 32, ldk = c->ldk;
    const uint32_t *k2 = c->kh + (size_t)c0 * ldk;
    uint16_t *sh = (uint16_t *)c->pt; /* S^T in fp16 */
    int i = 0;
    for (; i + 12 <= nk; i += 12)
        fa_scores_ph_any(12, mh, k2 + (size_t)i * ldk, ldk, c->d, c->qh, sh + (size_t)i * FA_ROWS);
    for (; i + 4 <= nk; i += 4)
        fa_scores_ph_any(4, mh, k2 + (size_t)i * ldk, ldk, c->d, c->qh, sh + (size_t)i * FA_ROWS);
    for (; i < nk; i++)
        fa_scores_ph_any(1, mh, k2 + (size_t)i * ldk, ldk, c->d, c->qh, sh + (size_t)i * FA_ROWS);
    fa_softmax_ph(sh, c->p16, nk, c0, mh, c->rpos, c->mrow, c->lrow, c->alpha);
    fa_pv_ph_rows(nk, c->n_rows, c->dv, c->vh + (size_t)c0 * c->dv, c->dv, c->p16, c->alpha, c->o,
                  c->ldv);
    return true;
}
#endif

FA_TARGET static void fa_task_avx512(const struct fa_job *j, int task, int thread)
{
    struct fa_ctx c;
    fa_begin(j, task, thread, &c);
#if FA_PH
    if (c.kh)
        fa_begin_ph(&c);
#endif
    const int mv = (c.n_rows + 15) / 16, dv = c.dv;
    const float *kp[FA_KB], *vp[FA_KB];
    const int jt = mv == 4 ? 6 : mv == 3 ? 8 : mv == 2 ? 12 : 16;
    for (int c0 = 0; c0 <= c.g->max_pos; c0 += FA_KB) {
        const int nk = fa_chunk_keys(c.g, c0);
#if FA_PH
        if (c.kh && fa_chunk_ph(&c, c0, nk))
            continue;
#endif
        fa_gather(&c, c0, nk, kp, vp, bf16_to_f32_avx512);
        /* tiles of jt keys, then of 4 (a full chunk of 64 leaves 4 after
         * tiles of 6 or 12: single keys there cost ~5% of a prefill), then
         * single keys */
        int i = 0;
        for (; i + jt <= nk; i += jt)
            fa_scores_any(jt, mv, kp + i, c.d, c.qt, c.pt + (size_t)i * FA_ROWS, c.p->scale);
        for (; i + 4 <= nk; i += 4)
            fa_scores_any(4, mv, kp + i, c.d, c.qt, c.pt + (size_t)i * FA_ROWS, c.p->scale);
        for (; i < nk; i++)
            fa_scores_any(1, mv, kp + i, c.d, c.qt, c.pt + (size_t)i * FA_ROWS, c.p->scale);
        /* the scores came scaled */
        fa_softmax(c.pt, nk, c0, mv, c.rpos, c.mrow, c.lrow, c.alpha, 1.0f);
#if FA_PH
        if (j->pv_ph &&
            fa_chunk_pv_ph(nk, c.n_rows, dv, vp, c.pt, c.alpha, c.o, c.ldv, c.p16, c.v16))
            continue;
#endif
        /* O's columns in passes of up to FA_PV_D (8 vectors) */
        for (int col = 0; col < dv; col += FA_PV_D) {
            const int nd = (dv - col > FA_PV_D ? FA_PV_D : dv - col + 15) / 16;
            const int left = dv - col - 16 * (nd - 1); /* columns in the last vector */
            const __mmask16 dm = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
            /* tiles of rt rows, then of 4 (where rt > 4) and 2, then single
             * rows (64 rows in tiles of 6 left 4 single rows: ~5% of a
             * prefill) */
            const int rt = fa_pv_rows(nd);
            int r = 0;
            for (; r + rt <= c.n_rows; r += rt)
                fa_pv_any(rt, nd, r, nk, vp, col, c.pt, c.alpha, c.o, c.ldv, dm);
            for (; rt > 4 && r + 4 <= c.n_rows; r += 4)
                fa_pv_any(4, nd, r, nk, vp, col, c.pt, c.alpha, c.o, c.ldv, dm);
            for (; r + 2 <= c.n_rows; r += 2)
                fa_pv_any(2, nd, r, nk, vp, col, c.pt, c.alpha, c.o, c.ldv, dm);
            for (; r < c.n_rows; r++)
                fa_pv_any(1, nd, r, nk, vp, col, c.pt, c.alpha, c.o, c.ldv, dm);
        }
    }
    fa_end(&c);
}

/* ---- AVX2: the same tiles on 8 lanes ----
 * Every lane still computes one (key, row) score or one (row, column)
 * output with the same operations in the same order as the AVX-512 tiles
 * (k ascending, keys ascending, exp_avx2 bit for bit exp_avx512), so the
 * two ISAs give bit-identical attention; only the tile shapes differ (16
 * ymm registers). */

#define FA2_TARGET MOE_AVX2_TARGET
#define FA2_PV_D 32 /* O columns per PV pass: 4 vectors */

/* S^T[j][rows] for J keys and MV vectors of 8 rows (qt, st already offset
 * to the first of them). */
FA2_TARGET static inline __attribute__((always_inline)) void fa2_scores(const int J, const int MV,
                                                                        const float *const *kp,
                                                                        int d, const float *qt,
                                                                        float *st, float scale)
{
    __m256 acc[12][2];
#pragma GCC unroll 12
    for (int j = 0; j < J; j++)
#pragma GCC unroll 2
        for (int v = 0; v < MV; v++)
            acc[j][v] = _mm256_setzero_ps();
    for (int k = 0; k < d; k++) {
        __m256 q[2];
#pragma GCC unroll 2
        for (int v = 0; v < MV; v++)
            q[v] = _mm256_loadu_ps(qt + (size_t)k * FA_ROWS + 8 * v);
#pragma GCC unroll 12
        for (int j = 0; j < J; j++) {
            __m256 kb = _mm256_broadcast_ss(kp[j] + k);
#pragma GCC unroll 2
            for (int v = 0; v < MV; v++)
                acc[j][v] = _mm256_fmadd_ps(kb, q[v], acc[j][v]);
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
#pragma GCC unroll 12
    for (int j = 0; j < J; j++)
#pragma GCC unroll 2
        for (int v = 0; v < MV; v++)
            _mm256_storeu_ps(st + (size_t)j * FA_ROWS + 8 * v, _mm256_mul_ps(acc[j][v], sc));
}

FA2_TARGET static void fa2_scores_any(int J, int MV, const float *const *kp, int d, const float *qt,
                                      float *st, float scale)
{
    if (J == 6 && MV == 2)
        fa2_scores(6, 2, kp, d, qt, st, scale);
    else if (J == 12 && MV == 1)
        fa2_scores(12, 1, kp, d, qt, st, scale);
    else if (J == 1 && MV == 2)
        fa2_scores(1, 2, kp, d, qt, st, scale);
    else if (J == 1 && MV == 1)
        fa2_scores(1, 1, kp, d, qt, st, scale);
    else
        MOE_ASSERT(0 && "fa2_scores_any: unsupported tile");
}

/* O[rows r0 .. r0+RT) = alpha O + sum_j P^T[j][r] V[j] over nk keys, ND
 * vectors of columns from `col`, the last one loaded under `last` (all
 * lanes when it is full); O rows ldo apart. */
FA2_TARGET static inline __attribute__((always_inline)) void
fa2_pv(const int RT, const int ND, const bool B16, int r0, int nk, const float *const *vp,
       const uint16_t *const *vb, int col, const float *pt, const float *alpha, float *o, int ldo,
       __m256i last, bool partial)
{
    __m256 acc[12][4];
    o += col;
#pragma GCC unroll 12
    for (int r = 0; r < RT; r++) {
        __m256 a = _mm256_set1_ps(alpha[r0 + r]);
#pragma GCC unroll 4
        for (int v = 0; v < ND; v++)
            acc[r][v] = _mm256_mul_ps(_mm256_loadu_ps(o + (size_t)(r0 + r) * ldo + 8 * v), a);
    }
    for (int j = 0; j < nk; j++) {
        __m256 vv[4];
#pragma GCC unroll 4
        for (int v = 0; v < ND; v++) {
            if (B16) /* whole vectors of a bf16 row, widened */
                vv[v] = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(vb[j] + col + 8 * v))),
                    16));
            else
                vv[v] = v == ND - 1 && partial ? _mm256_maskload_ps(vp[j] + col + 8 * v, last)
                                               : _mm256_loadu_ps(vp[j] + col + 8 * v);
        }
#pragma GCC unroll 12
        for (int r = 0; r < RT; r++) {
            __m256 pb = _mm256_broadcast_ss(pt + (size_t)j * FA_ROWS + r0 + r);
#pragma GCC unroll 4
            for (int v = 0; v < ND; v++)
                acc[r][v] = _mm256_fmadd_ps(pb, vv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 4
        for (int v = 0; v < ND; v++)
            _mm256_storeu_ps(o + (size_t)(r0 + r) * ldo + 8 * v, acc[r][v]);
}

/* Rows per PV tile for ND vectors of d: at most 12 accumulators. */
static int fa2_pv_rows(int nd)
{
    static const int rows[5] = {0, 12, 5, 3, 2};
    return rows[nd];
}

FA2_TARGET static void fa2_pv_any(int RT, int ND, int r0, int nk, const float *const *vp, int col,
                                  const float *pt, const float *alpha, float *o, int ldo,
                                  __m256i last, bool partial)
{
#define PV2_CASE(RR, DD)                                                                           \
    case (RR)*8 + (DD):                                                                            \
        fa2_pv(RR, DD, false, r0, nk, vp, NULL, col, pt, alpha, o, ldo, last, partial);            \
        return;
    switch (RT * 8 + ND) {
        PV2_CASE(12, 1)
        PV2_CASE(5, 2)
        PV2_CASE(3, 3)
        PV2_CASE(2, 4)
        PV2_CASE(1, 1)
        PV2_CASE(1, 2)
        PV2_CASE(1, 3)
        PV2_CASE(1, 4)
    default: break;
    }
#undef PV2_CASE
    MOE_ASSERT(0 && "fa2_pv_any: unsupported tile");
}

/* ---- AVX2, narrow tasks over a BF16 cache: the rows read in place ----
 * A task of at most 8 rows (one vector: a decode token's query heads of a
 * KV head) gets little reuse from a chunk's widened K and V rows, and
 * widening them into scratch cost as much as the products (16-sequence
 * decode at 4096 positions, one thread: ~12 ms of gather, ~9 ms of
 * products). These tiles read the cache's bf16 rows themselves and widen
 * in registers (a bf16 in the high half of a 32-bit lane is that f32), so
 * every product and sum is the widened tiles', in their order: the same
 * bits, without the scratch. */

/* fa2_scores for J keys and one vector of rows from bf16 cache rows (d
 * even): key j's row is kb[j] + ka. A 32-bit broadcast holds k and k + 1; a
 * shift gives k's value, a mask k + 1's. With PAIR, lanes 0-3 are one KV
 * head's rows (kb[j] + ka) and lanes 4-7 another's (kb[j] + kb2), each
 * 128-bit half broadcast from its own head's row: two heads of 4 rows fill
 * the vector that a decode token's 4 query heads per KV head filled half
 * of alone. */
FA2_TARGET static inline __attribute__((always_inline)) void
fa2_scores_b16(const int J, const bool PAIR, const uint16_t *const *kb, size_t ka, size_t kb2,
               int d, const float *qt, float *st, float scale)
{
    __m256 acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < J; j++)
        acc[j] = _mm256_setzero_ps();
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    for (int k = 0; k < d; k += 2) {
        const __m256 q0 = _mm256_loadu_ps(qt + (size_t)k * FA_ROWS);
        const __m256 q1 = _mm256_loadu_ps(qt + (size_t)(k + 1) * FA_ROWS);
#pragma GCC unroll 8
        for (int j = 0; j < J; j++) {
            /* the pair's 32 bits broadcast as they are (vbroadcastss moves
             * bits; a plain 4-byte load here cost ThreadSanitizer builds a
             * hook per load: 3x slower decode under TSan) */
            const float *pa = (const float *)(const void *)(kb[j] + ka + k);
            __m256i b = _mm256_castps_si256(_mm256_broadcast_ss(pa));
            if (PAIR) {
                const float *pb = (const float *)(const void *)(kb[j] + kb2 + k);
                b = _mm256_castps_si256(_mm256_insertf128_ps(
                    _mm256_castps128_ps256(_mm_broadcast_ss(pa)), _mm_broadcast_ss(pb), 1));
            }
            acc[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), q0, acc[j]);
            acc[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(b, odd)), q1, acc[j]);
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
#pragma GCC unroll 8
    for (int j = 0; j < J; j++)
        _mm256_storeu_ps(st + (size_t)j * FA_ROWS, _mm256_mul_ps(acc[j], sc));
}

/* fa2_scores_b16 over a chunk's nk keys: tiles of 8, then single keys. */
FA2_TARGET static void fa2_scores_b16_keys(bool pair, int nk, const uint16_t *const *kb, size_t ka,
                                           size_t kb2, int d, const float *qt, float *st,
                                           float scale)
{
    int i = 0;
    for (; i + 8 <= nk; i += 8, st += 8 * FA_ROWS) {
        if (pair)
            fa2_scores_b16(8, true, kb + i, ka, kb2, d, qt, st, scale);
        else
            fa2_scores_b16(8, false, kb + i, ka, kb2, d, qt, st, scale);
    }
    for (; i < nk; i++, st += FA_ROWS) {
        if (pair)
            fa2_scores_b16(1, true, kb + i, ka, kb2, d, qt, st, scale);
        else
            fa2_scores_b16(1, false, kb + i, ka, kb2, d, qt, st, scale);
    }
}

/* fa2_pv from bf16 rows vp read in place (whole vectors: dv a multiple of
 * 8), up to 4 rows and 2 vectors a tile. */
FA2_TARGET static void fa2_pv_b16_any(int RT, int ND, int r0, int nk, const uint16_t *const *vp,
                                      int col, const float *pt, const float *alpha, float *o,
                                      int ldo)
{
#define PVB_CASE(RR, DD)                                                                           \
    case (RR)*4 + (DD):                                                                            \
        fa2_pv(RR, DD, true, r0, nk, NULL, vp, col, pt, alpha, o, ldo, none, false);               \
        return;
    const __m256i none = _mm256_setzero_si256();
    switch (RT * 4 + ND) {
        PVB_CASE(4, 2)
        PVB_CASE(3, 2)
        PVB_CASE(2, 2)
        PVB_CASE(1, 2)
        PVB_CASE(4, 1)
        PVB_CASE(3, 1)
        PVB_CASE(2, 1)
        PVB_CASE(1, 1)
    default: break;
    }
#undef PVB_CASE
    MOE_ASSERT(0 && "fa2_pv_b16_any: unsupported tile");
}

/* The chunk's nk keys at c0 as pointers into the BF16 cache (kp, vp), the
 * next chunk's rows requested as in fa_gather. */
static void fa_point_b16(const struct fa_ctx *c, int c0, int nk, const uint16_t **kp,
                         const uint16_t **vp)
{
    const struct moe_attn_params *p = c->p;
    const int n_next = fa_chunk_keys(c->g, c0 + FA_KB);
    size_t slot[FA_KB];
    fa_slots(c, c0 + FA_KB, n_next, slot);
    for (int i = 0; i < n_next; i++)
        fa_prefetch(c, slot[i]);
    fa_slots(c, c0, nk, slot);
    for (int i = 0; i < nk; i++) {
        const size_t off = slot[i] * c->slot_stride + (size_t)c->kvh * c->d;
        kp[i] = (const uint16_t *)p->k_cache + off;
        vp[i] = c->same_kv ? kp[i] : (const uint16_t *)p->v_cache + off;
    }
}

/* fa_softmax on vectors of 8 rows (mv of them). */
FA2_TARGET static void fa2_softmax(float *pt, int nk, int c0, int mv, const int32_t *rpos,
                                   float *mrow, float *lrow, float *alpha)
{
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int v = 0; v < mv; v++) {
        const __m256i posv = _mm256_loadu_si256((const __m256i *)(rpos + 8 * v));
        __m256 cmax = ninf;
        for (int kk = 0; kk < nk; kk++) {
            float *s = pt + (size_t)kk * FA_ROWS + 8 * v;
            __m256 masked =
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c0 + kk), posv));
            __m256 sv = _mm256_blendv_ps(_mm256_loadu_ps(s), ninf, masked);
            _mm256_storeu_ps(s, sv);
            cmax = _mm256_max_ps(cmax, sv);
        }
        __m256 mold = _mm256_loadu_ps(mrow + 8 * v);
        __m256 mnew = _mm256_max_ps(mold, cmax);
        __m256 a = exp_avx2(_mm256_sub_ps(mold, mnew));
        __m256 sum = _mm256_setzero_ps();
        for (int kk = 0; kk < nk; kk++) {
            float *s = pt + (size_t)kk * FA_ROWS + 8 * v;
            __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s), mnew));
            _mm256_storeu_ps(s, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(lrow + 8 * v, _mm256_fmadd_ps(_mm256_loadu_ps(lrow + 8 * v), a, sum));
        _mm256_storeu_ps(mrow + 8 * v, mnew);
        _mm256_storeu_ps(alpha + 8 * v, a);
    }
}

/* A task of one vector of rows over a BF16 cache (d even, dv a multiple of
 * 8): fa_task_avx2's chunk loop on the cache's rows in place. */
FA2_TARGET static void fa_task_avx2_b16(struct fa_ctx *c)
{
    const uint16_t *kp[FA_KB], *vp[FA_KB];
    for (int c0 = 0; c0 <= c->g->max_pos; c0 += FA_KB) {
        const int nk = fa_chunk_keys(c->g, c0);
        fa_point_b16(c, c0, nk, kp, vp);
        fa2_scores_b16_keys(false, nk, kp, 0, 0, c->d, c->qt, c->pt, c->p->scale);
        fa2_softmax(c->pt, nk, c0, 1, c->rpos, c->mrow, c->lrow, c->alpha);
        /* P V: up to 4 rows a tile, 16 columns a pass (then 8) */
        for (int col = 0; col < c->dv; col += 16) {
            const int nd = c->dv - col >= 16 ? 2 : 1;
            for (int r = 0; r < c->n_rows; r += 4)
                fa2_pv_b16_any(c->n_rows - r < 4 ? c->n_rows - r : 4, nd, r, nk, vp, col, c->pt,
                               c->alpha, c->o, c->ldv);
        }
    }
    _mm256_zeroupper(); /* fa_end is SSE code (see tile_avx2_packed in matmul.c) */
    fa_end(c);
}

/* Heads mode (a task is a group's every KV head): the chunk's nk keys at c0
 * as pointers to their whole cache slots (kb, vb), and the next chunk's
 * slots (next, their count returned) for fa_heads_prefetch. */
static int fa_heads_point(const struct fa_ctx *c, int c0, int nk, const uint16_t **kb,
                          const uint16_t **vb, size_t *next)
{
    size_t slot[FA_KB];
    fa_slots(c, c0, nk, slot);
    for (int i = 0; i < nk; i++) {
        kb[i] = (const uint16_t *)c->p->k_cache + slot[i] * c->slot_stride;
        vb[i] = (const uint16_t *)c->p->v_cache + slot[i] * c->slot_stride;
    }
    const int n_next = fa_chunk_keys(c->g, c0 + FA_KB);
    fa_slots(c, c0 + FA_KB, n_next, next);
    return n_next;
}

/* Requests into L2 vector v's share (of n_vec) of the next chunk's whole K
 * and V slots (4096 positions, 2 threads: 9.2 -> 8.2 ms a call on AVX2). */
static inline __attribute__((always_inline)) void
fa_heads_prefetch(const struct fa_ctx *c, const size_t *next, int n_next, int v, int n_vec)
{
    const size_t slot_bytes = c->slot_stride * sizeof(uint16_t);
    for (int i = v * n_next / n_vec; i < (v + 1) * n_next / n_vec; i++) {
        const char *kr = (const char *)c->p->k_cache + next[i] * slot_bytes;
        const char *vr = (const char *)c->p->v_cache + next[i] * slot_bytes;
        for (size_t b = 0; b < slot_bytes; b += 64) {
            _mm_prefetch(kr + b, _MM_HINT_T1);
            _mm_prefetch(vr + b, _MM_HINT_T1);
        }
    }
}

/* A task of every KV head of one group whose rows per head fit a vector
 * (cpu_attention_tiled's heads mode: decode): head h's rows are rows rs h ..
 * rs h + nr of the scratch (rs 4 or 8, below), and each chunk reads whole
 * cache slots (every
 * head's K, then V, consecutive in a block) instead of a head's 128 bytes
 * in every 512, which the memory delivered at about half the rate. Each
 * head's arithmetic is fa_task_avx2_b16's. */
FA2_TARGET static void fa_task_avx2_heads(const struct fa_job *j, int task, int thread)
{
    const struct moe_attn_params *p = j->p;
    struct fa_ctx c;
    fa_begin(j, task * p->n_kv_head, thread, &c);
    const int nkv = p->n_kv_head, nr = c.n_rows, d = c.d;
    /* head hk's rows are rows rs * hk .. rs * hk + nr: two heads a vector
     * when 4 rows hold them (rs 4), else one (rs 8) */
    const int rs = nr <= 4 ? 4 : 8, n_vec = (rs * nkv + 7) / 8;
    memset(c.qt, 0, (size_t)d * FA_ROWS * sizeof(float));
    memset(c.o, 0, (size_t)8 * n_vec * c.ldv * sizeof(float));
    for (int r = 0; r < 8 * n_vec; r++) {
        c.rpos[r] = r % rs < nr ? p->tok_pos[c.g->t0 + r % rs / c.rep] : c.g->max_pos;
        c.mrow[r] = -INFINITY;
        c.lrow[r] = 0.0f;
    }
    for (int hk = 0; hk < nkv; hk++)
        for (int r = 0; r < nr; r++) {
            const int t = c.g->t0 + r / c.rep, h = hk * c.rep + r % c.rep;
            const float *q = p->q + ((size_t)t * p->n_head + h) * d;
            for (int k = 0; k < d; k++)
                c.qt[(size_t)k * FA_ROWS + rs * hk + r] = q[k];
        }
    const uint16_t *kb[FA_KB], *vb[FA_KB], *vp[FA_KB];
    size_t next[FA_KB];
    for (int c0 = 0; c0 <= c.g->max_pos; c0 += FA_KB) {
        const int nk = fa_chunk_keys(c.g, c0);
        const int n_next = fa_heads_point(&c, c0, nk, kb, vb, next);
        for (int v = 0; v < n_vec; v++) {
            fa_heads_prefetch(&c, next, n_next, v, n_vec);
            /* scores of the vector's rows: one head, or two (the second is
             * the first again past the last head: padding rows) */
            const float *qt = c.qt + 8 * v;
            float *pt = c.pt + 8 * v;
            const int h0 = rs == 8 ? v : 2 * v, h1 = rs == 8 || h0 + 1 == nkv ? h0 : h0 + 1;
            fa2_scores_b16_keys(rs == 4, nk, kb, (size_t)h0 * d, (size_t)h1 * d, d, qt, pt,
                                p->scale);
            fa2_softmax(pt, nk, c0, 1, c.rpos + 8 * v, c.mrow + 8 * v, c.lrow + 8 * v,
                        c.alpha + 8 * v);
            /* P V, head by head */
            for (int hk = h0; hk < (rs == 8 ? h0 + 1 : h0 + 2) && hk < nkv; hk++) {
                for (int n = 0; n < nk; n++)
                    vp[n] = vb[n] + (size_t)hk * d;
                for (int col = 0; col < c.dv; col += 16) {
                    const int nd = c.dv - col >= 16 ? 2 : 1;
                    for (int r = 0; r < nr; r += 4)
                        fa2_pv_b16_any(nr - r < 4 ? nr - r : 4, nd, rs * hk + r, nk, vp, col, c.pt,
                                       c.alpha, c.o, c.ldv);
                }
            }
        }
    }
    _mm256_zeroupper(); /* the rest is SSE code (see tile_avx2_packed in matmul.c) */
    for (int hk = 0; hk < nkv; hk++)
        for (int r = 0; r < nr; r++) {
            const int t = c.g->t0 + r / c.rep, h = hk * c.rep + r % c.rep;
            float *out = p->out + ((size_t)t * p->n_head + h) * c.dv;
            const float inv = 1.0f / c.lrow[rs * hk + r];
            const float *orow = c.o + (size_t)(rs * hk + r) * c.ldv;
            for (int k = 0; k < c.dv; k++)
                out[k] = orow[k] * inv;
        }
}

/* ---- AVX-512 decode: four KV heads a vector ----
 * A decode call's task of every KV head (heads mode, as fa_task_avx2_heads)
 * on 16 lanes: lane 4 r + h of vector v is row r (<= 4 rows a head) of KV
 * head 4 v + h. Each key's rows of those four heads are widened and
 * interleaved element by element (a 4 x 16 transpose per 16 elements), so
 * the score operand for element k -- the four heads' K[k], one per lane of
 * a 128-bit group -- is one vbroadcastf32x4 load, with no shuffle or
 * widening per product as the AVX2 tiles need (two broadcasts, an insert, a
 * shift and a mask per pair of elements for 8 lanes). Every lane does the
 * AVX2 tiles' operations in their order (scores: 0, then fma over k
 * ascending, times the scale; P V: O alpha, then fma over keys ascending),
 * so the bits are theirs: unit/test_kernels holds the two to each other. */

/* Key row kr's elements of heads h0 .. h0 + nh (nh <= 4; missing heads
 * zero) as f32 in groups of four: element k of head h0 + i at
 * tb[(k / 16) 64 + (k % 4) 16 + (k % 16 / 4) 4 + i]. d a multiple of 16. */
FA_TARGET static void fa5_interleave4(const uint16_t *kr, int nh, int d, float *tb)
{
    for (int k0 = 0; k0 < d; k0 += 16, tb += 64) {
        __m512 a[4];
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++)
            a[h] = h < nh ? _mm512_castsi512_ps(
                                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                      (const __m256i *)(kr + (size_t)h * d + k0))),
                                                  16))
                          : _mm512_setzero_ps();
        /* per 128-bit group l: t0 = a0, a1 of 4l, 4l+1; t1 of 4l+2, 4l+3 */
        const __m512d t0 = _mm512_castps_pd(_mm512_unpacklo_ps(a[0], a[1]));
        const __m512d t1 = _mm512_castps_pd(_mm512_unpackhi_ps(a[0], a[1]));
        const __m512d t2 = _mm512_castps_pd(_mm512_unpacklo_ps(a[2], a[3]));
        const __m512d t3 = _mm512_castps_pd(_mm512_unpackhi_ps(a[2], a[3]));
        _mm512_storeu_ps(tb, _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2)));      /* 4l */
        _mm512_storeu_ps(tb + 16, _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2))); /* 4l+1 */
        _mm512_storeu_ps(tb + 32, _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3))); /* 4l+2 */
        _mm512_storeu_ps(tb + 48, _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3))); /* 4l+3 */
    }
}

/* S^T[j][16 lanes] for J keys interleaved by fa5_interleave4 (key j at
 * tb + 4 d j). */
FA_TARGET static inline __attribute__((always_inline)) void
fa5_scores4(const int J, const float *tb, int d, const float *qt, float *st, float scale)
{
    __m512 acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < J; j++)
        acc[j] = _mm512_setzero_ps();
    for (int k0 = 0; k0 < d; k0 += 16) {
        const float *g = tb + (size_t)k0 * 4;
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            const __m512 q = _mm512_loadu_ps(qt + (size_t)(k0 + i) * FA_ROWS);
            const int off = i % 4 * 16 + i / 4 * 4;
#pragma GCC unroll 8
            for (int j = 0; j < J; j++)
                acc[j] = _mm512_fmadd_ps(
                    _mm512_broadcast_f32x4(_mm_loadu_ps(g + (size_t)j * 4 * d + off)), q, acc[j]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 8
    for (int j = 0; j < J; j++)
        _mm512_storeu_ps(st + (size_t)j * FA_ROWS, _mm512_mul_ps(acc[j], sc));
}

FA_TARGET static void fa5_scores4_any(int J, const float *tb, int d, const float *qt, float *st,
                                      float scale)
{
    switch (J) {
    case 8: fa5_scores4(8, tb, d, qt, st, scale); return;
    case 1: fa5_scores4(1, tb, d, qt, st, scale); return;
    default: break;
    }
    MOE_ASSERT(0 && "fa5_scores4_any: unsupported tile");
}

/* fa_pv for RT rows of one head (lanes lane0, lane0 + 4, ...) from bf16 V
 * rows vb. */
FA_TARGET static void fa5_pv_b16_any(int RT, int ND, int lane0, int nk, const uint16_t *const *vb,
                                     int col, const float *pt, const float *alpha, float *o,
                                     int ldo)
{
#define PV5_CASE(RR, DD)                                                                           \
    case (RR)*8 + (DD):                                                                            \
        fa_pv(RR, DD, true, 4, lane0, nk, NULL, vb, col, pt, alpha, o, ldo, 0xffff);               \
        return;
    switch (RT * 8 + ND) {
        PV5_CASE(1, 1)
        PV5_CASE(1, 2)
        PV5_CASE(1, 3)
        PV5_CASE(1, 4)
        PV5_CASE(2, 1)
        PV5_CASE(2, 2)
        PV5_CASE(2, 3)
        PV5_CASE(2, 4)
        PV5_CASE(3, 1)
        PV5_CASE(3, 2)
        PV5_CASE(3, 3)
        PV5_CASE(3, 4)
        PV5_CASE(4, 1)
        PV5_CASE(4, 2)
        PV5_CASE(4, 3)
        PV5_CASE(4, 4)
    default: break;
    }
#undef PV5_CASE
    MOE_ASSERT(0 && "fa5_pv_b16_any: unsupported tile");
}

/* fa_task_avx2_heads on AVX-512 for rows of at most 4 a head, d and d_v
 * multiples of 16 (cpu_attention_tiled's heads16). */
FA_TARGET static void fa_task_avx512_heads(const struct fa_job *j, int task, int thread)
{
    const struct moe_attn_params *p = j->p;
    struct fa_ctx c;
    fa_begin(j, task * p->n_kv_head, thread, &c);
    const int nkv = p->n_kv_head, nr = c.n_rows, d = c.d, n_vec = (nkv + 3) / 4;
    memset(c.qt, 0, (size_t)d * FA_ROWS * sizeof(float));
    memset(c.o, 0, (size_t)16 * n_vec * c.ldv * sizeof(float));
    for (int lane = 0; lane < 16 * n_vec; lane++) {
        const int r = lane % 16 / 4, hk = lane / 16 * 4 + lane % 4;
        c.rpos[lane] = r < nr && hk < nkv ? p->tok_pos[c.g->t0 + r / c.rep] : c.g->max_pos;
        c.mrow[lane] = -INFINITY;
        c.lrow[lane] = 0.0f;
        if (r >= nr || hk >= nkv)
            continue;
        const int t = c.g->t0 + r / c.rep, h = hk * c.rep + r % c.rep;
        const float *q = p->q + ((size_t)t * p->n_head + h) * d;
        for (int k = 0; k < d; k++)
            c.qt[(size_t)k * FA_ROWS + lane] = q[k];
    }
    float *tb = c.kw; /* 8 keys x 4 heads x d: within the scratch's FA_KB x ldk */
    const uint16_t *kb[FA_KB], *vb[FA_KB], *vp[FA_KB];
    size_t next[FA_KB];
    for (int c0 = 0; c0 <= c.g->max_pos; c0 += FA_KB) {
        const int nk = fa_chunk_keys(c.g, c0);
        const int n_next = fa_heads_point(&c, c0, nk, kb, vb, next);
        for (int v = 0; v < n_vec; v++) {
            fa_heads_prefetch(&c, next, n_next, v, n_vec);
            const int h0 = 4 * v, nh = nkv - h0 < 4 ? nkv - h0 : 4;
            float *pt = c.pt + 16 * v;
            /* tiles of 8 keys, then single keys */
            for (int i = 0, jt = 8; i < nk; i += jt) {
                jt = nk - i >= 8 ? 8 : 1;
                for (int jj = 0; jj < jt; jj++)
                    fa5_interleave4(kb[i + jj] + (size_t)h0 * d, nh, d, tb + (size_t)jj * 4 * d);
                fa5_scores4_any(jt, tb, d, c.qt + 16 * v, pt + (size_t)i * FA_ROWS, p->scale);
            }
            /* the scores came scaled */
            fa_softmax(pt, nk, c0, 1, c.rpos + 16 * v, c.mrow + 16 * v, c.lrow + 16 * v,
                       c.alpha + 16 * v, 1.0f);
            for (int hh = 0; hh < nh; hh++) {
                for (int n = 0; n < nk; n++)
                    vp[n] = vb[n] + (size_t)(h0 + hh) * d;
                for (int col = 0; col < c.dv; col += 64) {
                    const int nd = (c.dv - col) / 16 < 4 ? (c.dv - col) / 16 : 4;
                    fa5_pv_b16_any(nr, nd, 16 * v + hh, nk, vp, col, c.pt, c.alpha, c.o, c.ldv);
                }
            }
        }
    }
    for (int hk = 0; hk < nkv; hk++)
        for (int r = 0; r < nr; r++) {
            const int lane = hk / 4 * 16 + 4 * r + hk % 4;
            const int t = c.g->t0 + r / c.rep, h = hk * c.rep + r % c.rep;
            float *out = p->out + ((size_t)t * p->n_head + h) * c.dv;
            const float inv = 1.0f / c.lrow[lane];
            const float *orow = c.o + (size_t)lane * c.ldv;
            for (int k = 0; k < c.dv; k++)
                out[k] = orow[k] * inv;
        }
}

FA2_TARGET static void fa_task_avx2(const struct fa_job *j, int task, int thread)
{
    struct fa_ctx c;
    fa_begin(j, task, thread, &c);
    const int mv = (c.n_rows + 7) / 8, dv = c.dv;
    if (mv == 1 && c.wide && c.d % 2 == 0 && dv % 8 == 0) {
        fa_task_avx2_b16(&c);
        return;
    }
    const float *kp[FA_KB], *vp[FA_KB];
    for (int c0 = 0; c0 <= c.g->max_pos; c0 += FA_KB) {
        const int nk = fa_chunk_keys(c.g, c0);
        fa_gather(&c, c0, nk, kp, vp, bf16_to_f32_avx2);
        /* scores: row vectors in pairs (6 keys a tile), an odd one alone (12) */
        for (int v0 = 0; v0 < mv; v0 += 2) {
            const int m2 = mv - v0 >= 2 ? 2 : 1, jt = m2 == 2 ? 6 : 12;
            const float *qt = c.qt + 8 * v0;
            float *st = c.pt + 8 * v0;
            int i = 0;
            for (; i + jt <= nk; i += jt)
                fa2_scores_any(jt, m2, kp + i, c.d, qt, st + (size_t)i * FA_ROWS, c.p->scale);
            for (; i < nk; i++)
                fa2_scores_any(1, m2, kp + i, c.d, qt, st + (size_t)i * FA_ROWS, c.p->scale);
        }
        fa2_softmax(c.pt, nk, c0, mv, c.rpos, c.mrow, c.lrow, c.alpha);
        for (int col = 0; col < dv; col += FA2_PV_D) {
            const int nd = (dv - col > FA2_PV_D ? FA2_PV_D : dv - col + 7) / 8;
            const int left = dv - col - 8 * (nd - 1); /* columns in the last vector */
            const __m256i last = _mm256_cmpgt_epi32(_mm256_set1_epi32(left),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            const bool partial = left < 8;
            const int rt = fa2_pv_rows(nd);
            int r = 0;
            for (; r + rt <= c.n_rows; r += rt)
                fa2_pv_any(rt, nd, r, nk, vp, col, c.pt, c.alpha, c.o, c.ldv, last, partial);
            for (; r < c.n_rows; r++)
                fa2_pv_any(1, nd, r, nk, vp, col, c.pt, c.alpha, c.o, c.ldv, last, partial);
        }
    }
    _mm256_zeroupper(); /* fa_end is SSE code (see tile_avx2_packed in matmul.c) */
    fa_end(&c);
}

FA_AMX_TARGET static void fa_task_amx_scoped(const struct fa_job *j, int task, int thread)
{
    amx_begin();
    fa_task_amx(j, task, thread);
    amx_end();
}

/* A task whose rows fit one AVX2 vector over a BF16 cache runs
 * fa_task_avx2_b16 (the cache's rows read in place) on AVX-512 processors
 * too: the same bits as the AVX-512 tiles (see the AVX2 section), and the
 * AVX-512 tiles would widen each chunk into scratch for at most 8 of their
 * 16 lanes. 16-sequence decode, bench-kernels --attention, Xeon (Emerald
 * Rapids, AVX-512), 2 threads: 2048 positions 3.3 -> 2.1 ms a call. */
static bool fa_narrow_b16(const struct fa_job *j, int task)
{
    const struct moe_attn_params *p = j->p;
    const int dv = fa_dv(p);
    return j->groups[task / p->n_kv_head].nt * j->rep <= 8 && p->kv_dtype == MOE_DTYPE_BF16 &&
           p->d_head % 2 == 0 && dv % 8 == 0;
}

static void fa_task(void *arg, int task, int thread)
{
    const struct fa_job *j = arg;
    if (j->heads16)
        fa_task_avx512_heads(j, task, thread);
    else if (j->heads)
        fa_task_avx2_heads(j, task, thread);
    else if (j->amx)
        fa_task_amx_scoped(j, task, thread);
    else if (j->isa == CPU_ISA_AVX512 &&
             (!fa_narrow_b16(j, task) || (j->ph && j->groups[task / j->p->n_kv_head].wide >= 0)))
        fa_task_avx512(j, task, thread); /* a ph wide copy is fp16: the AVX2 tiles cannot read it */
    else
        fa_task_avx2(j, task, thread);
}

/* ph: positions [pos0, pos1) of the wide sequence s as fp16: K rows as
 * pairs (ldk dwords), V rows (dv halves); the largest norm of a K row and
 * the largest |v| of every KV head into the widening task's maxima. */
FA_TARGET static void fa_widen_ph(const struct fa_job *j, const struct fa_wide *s, int task,
                                  int pos0, int pos1)
{
    const struct moe_attn_params *p = j->p;
    const int d = p->d_head, dv = fa_dv(p), ldk = fa_ld(d);
    uint32_t *kh = (uint32_t *)(j->wide_buf + s->k_at);
    uint16_t *vh = (uint16_t *)(j->wide_buf + s->v_at);
    const int32_t *blocks = p->block_tables + (size_t)s->seq * p->max_blocks;
    for (int h = 0; h < p->n_kv_head; h++) {
        float kmax = 0.0f;
        __m512 vmax = _mm512_setzero_ps();
        for (int pos = pos0; pos < pos1; pos++) {
            const size_t off = (fa_slot(p, blocks, pos) * p->n_kv_head + (size_t)h) * d;
            const size_t at = (size_t)h * s->n_pos + (size_t)pos;
            const uint16_t *kb = (const uint16_t *)p->k_cache + off;
            const uint16_t *vb = (const uint16_t *)p->v_cache + off;
            __m512 ss = _mm512_setzero_ps();
            for (int k = 0; k < d; k += 16) {
                const __m512 x = bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(kb + k)));
                ss = _mm512_fmadd_ps(x, x, ss);
                _mm512_storeu_si512((void *)(kh + at * ldk + k), fp16_pairs16(x));
            }
            const float norm2 = _mm512_reduce_add_ps(ss);
            kmax = norm2 > kmax ? norm2 : kmax;
            for (int k = 0; k < dv; k += 16) {
                const __m512 x = bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(vb + k)));
                vmax = _mm512_max_ps(vmax, _mm512_abs_ps(x));
                _mm256_storeu_si256(
                    (__m256i *)(vh + at * dv + k),
                    _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
        }
        float *mx = j->wide_max + ((size_t)task * p->n_kv_head + h) * 2;
        mx[0] = sqrtf(kmax);
        mx[1] = _mm512_reduce_max_ps(vmax);
    }
}

/* Widens FA_WIDEN_POS positions of one fa_wide sequence, every KV head. */
static void fa_widen_task(void *arg, int task, int thread)
{
    (void)thread;
    const struct fa_job *j = arg;
    const struct moe_attn_params *p = j->p;
    int w = 0;
    while (w + 1 < j->n_wide && j->wide[w + 1].task0 <= task)
        w++;
    const struct fa_wide *s = &j->wide[w];
    const bool same_kv = p->v_cache == p->k_cache;
    float *kf = j->wide_buf + s->k_at, *vf = j->wide_buf + s->v_at;
    const int d = p->d_head, dv = fa_dv(p);
    const int ldk = fa_ld(d), ldv = fa_ld(dv);
    const int32_t *blocks = p->block_tables + (size_t)s->seq * p->max_blocks;
    const int pos0 = (task - s->task0) * FA_WIDEN_POS;
    const int pos1 = pos0 + FA_WIDEN_POS < s->n_pos ? pos0 + FA_WIDEN_POS : s->n_pos;
    if (j->ph) {
        fa_widen_ph(j, s, task, pos0, pos1);
        return;
    }
    for (int pos = pos0; pos < pos1; pos++) {
        const size_t row = fa_slot(p, blocks, pos) * p->n_kv_head;
        for (int h = 0; h < p->n_kv_head; h++) {
            const size_t off = (row + (size_t)h) * d, at = (size_t)h * s->n_pos + (size_t)pos;
            cpu_vec_from_bf16(kf + at * ldk, (const uint16_t *)p->k_cache + off, d);
            if (!same_kv)
                cpu_vec_from_bf16(vf + at * ldv, (const uint16_t *)p->v_cache + off, dv);
        }
    }
}

/* Floats of widened K and V a call may hold (fa_plan_wide): by default
 * 64 MiB: K and V of 32768 positions of the benchmark shape (4 KV heads
 * of 64). */
static _Atomic size_t g_fa_wide_max = (size_t)16 << 20;

size_t cpu_attention_tiled_wide_limit(size_t floats)
{
    return atomic_exchange(&g_fa_wide_max, floats);
}

/* Over a BF16 cache, every sequence with more tokens in the call than a
 * group holds (a prefill chunk) gets its rows widened once (fa_wide):
 * otherwise each of its groups widens every key before it again, chunk by
 * chunk -- 32 times over for a 512-token chunk of 4 query heads a KV head
 * (Emerald Rapids, a 512-token chunk at 4096 positions of the benchmark
 * shape: 39.6 -> 35.0 ms on 2 threads, 85.7 -> 69.4 ms on 1; the copy is
 * 8 MB, read from L2/L3 where the widening took ~20% of the tiles' time).
 * Sequences past the limit (cpu_attention_tiled_wide_limit) keep widening
 * per chunk. Returns the floats wide_buf needs; fills j->wide (n_wide
 * entries), n_widen_tasks and each group's wide. */
static size_t fa_plan_wide(struct fa_job *j, struct fa_group *groups, int n_group,
                           int tok_per_group)
{
    const struct moe_attn_params *p = j->p;
    const size_t ldk = (size_t)fa_ld(p->d_head), ldv = (size_t)fa_ld(fa_dv(p));
    const bool same_kv = p->v_cache == p->k_cache;
    const size_t limit = atomic_load(&g_fa_wide_max);
    size_t total = 0;
    j->n_wide = j->n_widen_tasks = 0;
    for (int g = 0; g < n_group; g++)
        groups[g].wide = -1;
    if (p->kv_dtype != MOE_DTYPE_BF16 || j->amx || j->heads)
        return 0;
    /* groups are in batch order here: a sequence's groups are adjacent */
    for (int g = 0; g < n_group;) {
        const int seq = p->tok_seq[groups[g].t0];
        int end = g, max_pos = -1;
        for (; end < n_group && p->tok_seq[groups[end].t0] == seq; end++)
            max_pos = groups[end].max_pos > max_pos ? groups[end].max_pos : max_pos;
        const size_t v_floats = j->ph ? ldv / 2 : same_kv ? 0 : ldv;
        const size_t need = (size_t)(max_pos + 1) * p->n_kv_head * (ldk + v_floats);
        if (end - g >= 2 && groups[g].nt == tok_per_group && total + need <= limit) {
            struct fa_wide *w = &j->wide[j->n_wide];
            *w = (struct fa_wide){.seq = seq, .n_pos = max_pos + 1, .task0 = j->n_widen_tasks};
            w->k_at = total;
            w->v_at = total + (size_t)w->n_pos * p->n_kv_head * ldk;
            total += need;
            j->n_widen_tasks += (w->n_pos + FA_WIDEN_POS - 1) / FA_WIDEN_POS;
            for (int k = g; k < end; k++)
                groups[k].wide = j->n_wide;
            j->n_wide++;
        }
        g = end;
    }
    return total;
}

static int fa_group_cmp(const void *a, const void *b)
{
    const struct fa_group *x = a, *y = b;
    if (x->max_pos != y->max_pos)
        return x->max_pos > y->max_pos ? -1 : 1; /* heaviest first */
    return x->t0 - y->t0;
}

void cpu_attention_tiled(struct moe_threadpool *pool, const struct moe_attn_params *p)
{
    MOE_ASSERT(moe_kv_dtype_valid(p->kv_dtype));
    if (p->n_tok <= 0)
        return;
    const int rep = p->n_head / p->n_kv_head;
    const int tok_per_group = FA_ROWS / rep;
    struct fa_group *groups = malloc((size_t)p->n_tok * sizeof *groups);
    MOE_ASSERT(groups != NULL);
    int n_group = 0;
    for (int t = 0; t < p->n_tok;) {
        struct fa_group g = {.t0 = t, .nt = 0, .max_pos = -1, .wide = -1};
        while (t < p->n_tok && g.nt < tok_per_group && p->tok_seq[t] == p->tok_seq[g.t0]) {
            g.max_pos = p->tok_pos[t] > g.max_pos ? p->tok_pos[t] : g.max_pos;
            g.nt++;
            t++;
        }
        groups[n_group++] = g;
    }
    int n_threads = moe_threadpool_size(pool);
    const int dv = fa_dv(p);
    const bool amx = p->fast && p->kv_dtype == MOE_DTYPE_BF16 &&
                     (cpu_kernels_features() & CPU_FEAT_AMX_BF16) && p->d_head % 32 == 0 &&
                     p->d_head <= FA_AMX_MAX_D && dv == p->d_head && p->v_cache != p->k_cache &&
                     p->block_size % 16 == 0;
    struct fa_job j = {
        .p = p,
        .amx = amx,
        .isa = cpu_kernels_isa(),
        .groups = groups,
        .n_group = n_group,
        .rep = rep,
        .scratch_stride = fa_scratch_floats(fa_ld(p->d_head), fa_ld(dv)),
    };
    if (amx)
        j.scratch_stride = (size_t)FA_ROWS * p->d_head + (size_t)FA_KB * FA_ROWS + 3 * FA_ROWS +
                           fa_amx_scratch_floats(p->d_head) + 16;
    j.scratch = malloc((size_t)n_threads * j.scratch_stride * sizeof(float));
    MOE_ASSERT(j.scratch != NULL);
    /* Decode over a BF16 cache (AVX2 tiles, also on AVX-512: fa_narrow_b16): a task per group with
     * every KV head when each head's rows fit a vector and there are groups enough for the threads
     * (fa_task_avx2_heads; with fewer, a task per KV head keeps the threads busy). 16 sequences,
     * bench-kernels --attention, Zen 3, 2 threads, medians of 7 alternated runs: 4096
     * positions 10.8 -> 9.0 ms, 1024 1.62 -> 1.27 ms, 512 0.73 -> 0.59 ms a call. On AVX-512,
     * rows of at most 4 a head, d and d_v multiples of 16: four heads a vector
     * (fa_task_avx512_heads; Emerald Rapids, 2 threads, medians of 5 alternated runs against
     * the AVX2 heads task: 4096 positions 4.31 -> 3.57 ms, 2048 2.09 -> 1.68, 512 0.53 ->
     * 0.44). */
    j.heads = !amx && p->kv_dtype == MOE_DTYPE_BF16 && p->v_cache != p->k_cache &&
              p->n_kv_head > 1 && 8 * p->n_kv_head <= FA_ROWS && p->d_head % 2 == 0 &&
              dv % 8 == 0 && n_group >= 2 * n_threads;
    for (int g = 0; g < n_group && j.heads; g++)
        j.heads = groups[g].nt * rep <= 8;
    j.pv_ph = FA_PH && !amx && p->fast && !p->batch_invariant && j.isa == CPU_ISA_AVX512 &&
              (cpu_kernels_features() & CPU_FEAT_AVX512_FP16) && dv % 32 == 0 && dv <= FA_PV_D;
    /* ph: BF16 cache sequences widened for the call (fa_plan_wide) get fp16 copies */
    j.ph =
        j.pv_ph && p->kv_dtype == MOE_DTYPE_BF16 && p->v_cache != p->k_cache && p->d_head % 16 == 0;
    j.heads16 = j.heads && j.isa == CPU_ISA_AVX512 && p->d_head % 16 == 0 && dv % 16 == 0 &&
                p->n_kv_head <= 16;
    for (int g = 0; g < n_group && j.heads16; g++)
        j.heads16 = groups[g].nt * rep <= 4;
    j.wide = malloc((size_t)n_group * sizeof *j.wide);
    MOE_ASSERT(j.wide != NULL);
    const size_t wide_floats = fa_plan_wide(&j, groups, n_group, tok_per_group);
    if (wide_floats) {
        j.wide_buf = malloc(wide_floats * sizeof(float));
        if (j.ph)
            j.wide_max = malloc((size_t)j.n_widen_tasks * p->n_kv_head * 2 * sizeof(float));
    }
    if (wide_floats &&
        (!j.wide_buf ||
         (j.ph && !j.wide_max))) { /* no memory for the copies: widen chunk by chunk */
        for (int g = 0; g < n_group; g++)
            groups[g].wide = -1;
    } else if (wide_floats) {
        if (n_threads == 1)
            for (int t = 0; t < j.n_widen_tasks; t++)
                fa_widen_task(&j, t, 0);
        else
            moe_threadpool_run(pool, j.n_widen_tasks, fa_widen_task, &j);
    }
    qsort(groups, (size_t)n_group, sizeof *groups, fa_group_cmp);
    int n_tasks = j.heads ? n_group : n_group * p->n_kv_head;
    if (n_tasks == 1 || n_threads == 1) {
        for (int t = 0; t < n_tasks; t++)
            fa_task(&j, t, 0);
    } else {
        moe_threadpool_run(pool, n_tasks, fa_task, &j);
    }
    free(j.wide_buf);
    free(j.wide_max);
    free(j.wide);
    free(j.scratch);
    free(groups);
}

#else

void cpu_attention_tiled(struct moe_threadpool *pool, const struct moe_attn_params *p)
{
    (void)pool;
    (void)p;
    MOE_ASSERT(0 && "cpu_attention_tiled: x86-64 (AVX2 or AVX-512) only");
}

#endif
