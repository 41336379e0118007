/* Fault hooks answer only when a test arms them with MOE_TEST_FAULTS=1: a
 * MOE_FAULT_* variable alone (a stray one in a production environment) does
 * nothing. */
#include <stdlib.h>

#include "test_fault.h"
#include "testlib.h"

int main(void)
{
    unsetenv("MOE_TEST_FAULTS");
    setenv("MOE_FAULT_RANK", "3", 1);
    CHECK(!moe_fault_armed());
    CHECK(moe_fault_int("MOE_FAULT_RANK", -1) == -1);
    setenv("MOE_TEST_FAULTS", "0", 1);
    CHECK(moe_fault_int("MOE_FAULT_RANK", -1) == -1);
    setenv("MOE_TEST_FAULTS", "yes", 1);
    CHECK(moe_fault_int("MOE_FAULT_RANK", -1) == -1);
    setenv("MOE_TEST_FAULTS", "1", 1);
    CHECK(moe_fault_armed());
    CHECK(moe_fault_int("MOE_FAULT_RANK", -1) == 3);
    CHECK(moe_fault_int("MOE_FAULT_NOT_SET", 7) == 7);
    unsetenv("MOE_FAULT_RANK");
    CHECK(moe_fault_int("MOE_FAULT_RANK", -1) == -1);
    return test_summary();
}
