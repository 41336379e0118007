/* Host memory for large buffers: see host_mem.h. */
#define _GNU_SOURCE
#include "host_mem.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

void *moe_host_alloc(size_t bytes)
{
    if (bytes == 0)
        bytes = 64;
    const size_t align = bytes >= MOE_HOST_HUGE_MIN ? MOE_HOST_HUGE_MIN : 64;
    void *p = NULL;
    if (posix_memalign(&p, align, bytes) != 0)
        return NULL;
#ifdef MADV_HUGEPAGE
    /* whole huge pages only: the tail past the last 2 MiB boundary stays on
     * small pages, so no huge page reaches past the buffer. A kernel without
     * THP refuses the advice, which changes nothing. */
    if (align == MOE_HOST_HUGE_MIN)
        (void)madvise(p, bytes / MOE_HOST_HUGE_MIN * MOE_HOST_HUGE_MIN, MADV_HUGEPAGE);
#endif
    return p;
}

int moe_host_thp_eligible(const void *p)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f)
        return -1;
    const uintptr_t a = (uintptr_t)p;
    char line[512];
    bool in = false;
    int eligible = -1;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) { /* a mapping's first line */
            in = a >= lo && a < hi;
            continue;
        }
        int v;
        if (in && sscanf(line, "THPeligible: %d", &v) == 1) {
            eligible = v == 1;
            break;
        }
    }
    fclose(f);
    return eligible;
}
