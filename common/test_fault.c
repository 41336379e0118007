#include "test_fault.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool moe_fault_armed(void)
{
    const char *v = getenv("MOE_TEST_FAULTS");
    return v && !strcmp(v, "1");
}

int moe_fault_int(const char *name, int dflt)
{
    const char *v = moe_fault_armed() ? getenv(name) : NULL;
    if (!v || !*v)
        return dflt;
    fprintf(stderr, "moe: test fault injection armed: %s=%s\n", name, v);
    return atoi(v);
}
