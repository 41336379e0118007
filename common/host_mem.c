/* Host memory for large buffers: see host_mem.h. */
#define _GNU_SOURCE
#include "host_mem.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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

void *moe_host_alloc_zeroed(size_t bytes)
{
    if (bytes == 0)
        bytes = 64;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes) != 0)
        return NULL;
    unsigned char *b = p;
    if (bytes >= MOE_HOST_LAZY_ZERO_MIN) {
        /* the page-aligned interior [lo, hi) by the kernel, the ends here; the
         * block is ours whole, so no page in [lo, hi) holds another's bytes.
         * Private anonymous memory (the heap, an mmapped chunk) reads as
         * zero after MADV_DONTNEED, until written. */
        const long ps = sysconf(_SC_PAGESIZE);
        const uintptr_t page = ps > 0 ? (uintptr_t)ps : 4096, at = (uintptr_t)b;
        const uintptr_t lo = (at + page - 1) & ~(page - 1), hi = (at + bytes) & ~(page - 1);
        if (lo < hi && madvise((void *)lo, hi - lo, MADV_DONTNEED) == 0) {
            memset(b, 0, lo - at);
            memset((void *)hi, 0, at + bytes - hi);
            return p;
        }
    }
    memset(b, 0, bytes);
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
