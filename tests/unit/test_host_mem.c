/* moe_host_alloc (common/host_mem.c, the weights' memory): alignment, every byte writable, small
 * buffers 64-byte aligned, large ones 2 MiB aligned and in a mapping the
 * kernel may back with huge pages (its smaps says THPeligible), freed with
 * free(). The huge-page check is reported skipped where THP is off. */
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
    return test_summary();
}
