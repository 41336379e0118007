/* moe_host_alloc (common/host_mem.c, the weights' memory): alignment, every byte writable, small
 * buffers 64-byte aligned, large ones 2 MiB aligned and in a mapping the
 * kernel may back with huge pages (its smaps says THPeligible), freed with
 * free(). The huge-page check is reported skipped where THP is off.
 * moe_host_alloc_zeroed (the CPU backend's buffers): 64-byte aligned, every
 * byte zero, small and large (the kernel zeroes those), also where the block
 * is memory the test wrote 0xa5 into and freed just before. */
#include <malloc.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host_mem.h"
#include "testlib.h"

static bool thp_enabled(void)
{
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f)
        return false;
    char line[128] = {0};
    bool on = fgets(line, sizeof line, f) && !strstr(line, "[never]");
    fclose(f);
    return on;
}

static size_t nonzero(const unsigned char *p, size_t bytes)
{
    size_t n = 0;
    for (size_t i = 0; i < bytes; i++)
        n += p[i] != 0;
    return n;
}

static void zeroed(void)
{
    static const size_t sizes[] = {0,
                                   1,
                                   63,
                                   4096,
                                   MOE_HOST_LAZY_ZERO_MIN - 1,
                                   MOE_HOST_LAZY_ZERO_MIN,
                                   3 * MOE_HOST_LAZY_ZERO_MIN + 12345};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        const size_t bytes = sizes[i], n = bytes ? bytes : 64;
        unsigned char *p = moe_host_alloc_zeroed(bytes);
        CHECKF(p != NULL, "moe_host_alloc_zeroed(%zu) failed\n", bytes);
        if (!p)
            continue;
        CHECKF((uintptr_t)p % 64 == 0, "moe_host_alloc_zeroed(%zu) = %p, not 64-aligned\n", bytes,
               (void *)p);
        CHECKF(nonzero(p, n) == 0, "moe_host_alloc_zeroed(%zu): %zu bytes not zero\n", bytes,
               nonzero(p, n));
        memset(p, 0xa5, n);
        CHECKF(p[0] == 0xa5 && p[n - 1] == 0xa5, "moe_host_alloc_zeroed(%zu) not writable\n",
               bytes);
        free(p);
    }
    /* Dirty memory: large blocks from the heap (no fresh mapping, glibc's
     * mallopt) and kept there when freed, so the second block is the first,
     * its bytes still 0xa5 until the kernel zeroes its pages. A sanitizer's
     * allocator ignores mallopt and quarantines freed blocks. */
    mallopt(M_MMAP_THRESHOLD, 256 << 20);
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
    const size_t bytes = 5 * MOE_HOST_LAZY_ZERO_MIN + 777;
    int reused = 0;
    for (int round = 0; round < 3; round++) {
        unsigned char *a = moe_host_alloc_zeroed(bytes);
        CHECKF(a != NULL, "moe_host_alloc_zeroed(%zu) failed\n", bytes);
        if (!a)
            return;
        memset(a, 0xa5, bytes);
        const uintptr_t at = (uintptr_t)a; /* a freed pointer's value is indeterminate */
        free(a);
        unsigned char *b = moe_host_alloc_zeroed(bytes);
        CHECKF(b != NULL, "moe_host_alloc_zeroed(%zu) failed\n", bytes);
        if (!b)
            return;
        reused += (uintptr_t)b == at;
        CHECKF(nonzero(b, bytes) == 0,
               "moe_host_alloc_zeroed(%zu) on freed, written memory: %zu "
               "bytes not zero\n",
               bytes, nonzero(b, bytes));
        free(b);
    }
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    printf("zeroed host memory: %d of 3 blocks reused (a sanitizer's allocator)\n", reused);
#else
    CHECKF(reused >= 1,
           "moe_host_alloc_zeroed: %d of 3 freed blocks reused: the dirty-memory "
           "case did not run\n",
           reused);
    printf("zeroed host memory: %d of 3 blocks of %zu bytes written, freed and handed out again: "
           "zero\n",
           reused, bytes);
#endif
}

int main(void)
{
    static const size_t sizes[] = {0,
                                   1,
                                   63,
                                   4096,
                                   MOE_HOST_HUGE_MIN - 1,
                                   MOE_HOST_HUGE_MIN,
                                   3 * MOE_HOST_HUGE_MIN + 12345,
                                   8 * MOE_HOST_HUGE_MIN};
    const int n = (int)(sizeof sizes / sizeof *sizes);
    const bool thp = thp_enabled();
    int eligible = 0, big = 0;
    bool unknown = false;
    for (int i = 0; i < n; i++) {
        const size_t bytes = sizes[i];
        unsigned char *p = moe_host_alloc(bytes);
        CHECKF(p != NULL, "moe_host_alloc(%zu) failed\n", bytes);
        if (!p)
            continue;
        const size_t align = bytes >= MOE_HOST_HUGE_MIN ? MOE_HOST_HUGE_MIN : 64;
        CHECKF((uintptr_t)p % align == 0, "moe_host_alloc(%zu) = %p, not %zu-aligned\n", bytes,
               (void *)p, align);
        memset(p, 0xa5, bytes ? bytes : 64);
        CHECKF(p[0] == 0xa5 && p[(bytes ? bytes : 64) - 1] == 0xa5, "moe_host_alloc(%zu)\n", bytes);
        if (bytes >= MOE_HOST_HUGE_MIN) {
            const int e = moe_host_thp_eligible(p);
            unknown |= e < 0;
            big++;
            eligible += e == 1;
        }
        free(p);
    }
    if (thp && !unknown) {
        CHECKF(eligible == big, "%d of %d large buffers in huge-page-eligible mappings\n", eligible,
               big);
        printf("host memory: %d large buffers 2 MiB aligned and huge-page eligible\n", big);
    } else {
        printf("SKIPPED: huge pages: transparent huge pages are off here, or /proc/self/smaps does "
               "not say (THPeligible)\n");
    }
    zeroed();
    return test_summary();
}
