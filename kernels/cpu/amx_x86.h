/* AMX tile instructions for the CPU kernels (matmul_dot.c, attention_tiled.c):
 * one tile configuration (palette 1, all 8 tiles 16 rows x 64 bytes) and the
 * instructions as inline asm. Everything is written with a "memory" clobber,
 * ldtilecfg included: gcc 12's _tile_loadconfig is declared as reading 8
 * bytes, so the stores that build the 64-byte config can be dropped
 * (../shared/NOTES.md), and its tileloadd / tilestored carry no memory
 * clobber either. x86-64 only; the caller checks CPU_FEAT_AMX_*. Internal to
 * kernels/cpu. */
#ifndef MOE_AMX_X86_H
#define MOE_AMX_X86_H

#if defined(__x86_64__)
#include <stdint.h>
#include <string.h>

struct amx_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static inline void amx_begin(void)
{
    struct amx_tilecfg cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

static inline void amx_end(void)
{
    __asm__ volatile("tilerelease" : : : "memory");
}

#define AMX_LOAD(tmm, base, stride)                                                                \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tmm                                             \
                     :                                                                             \
                     : "r"(base), "r"((int64_t)(stride))                                           \
                     : "memory")
#define AMX_STORE(tmm, base, stride)                                                               \
    __asm__ volatile("tilestored %%tmm" #tmm ", (%0,%1,1)"                                         \
                     :                                                                             \
                     : "r"(base), "r"((int64_t)(stride))                                           \
                     : "memory")
#define AMX_ZERO(tmm) __asm__ volatile("tilezero %%tmm" #tmm ::: "memory")
/* Intel order dst, src1 (A), src2 (B); AT&T reverses it. */
#define AMX_DP(insn, c, a, b)                                                                      \
    __asm__ volatile(insn " %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")

#endif
#endif
