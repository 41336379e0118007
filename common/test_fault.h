/* Fault injection for the tests (SQLite style: always compiled, never armed
 * in production).
 *
 * A fault hook reads its setting through moe_fault_int, which answers only
 * when the environment holds MOE_TEST_FAULTS=1 as well as the hook's own
 * MOE_FAULT_* variable. No production start-up (deploy/quickstart.sh,
 * deploy/local-cluster.sh, the container images, the Helm chart) sets
 * MOE_TEST_FAULTS, so a stray MOE_FAULT_* variable in a production
 * environment does nothing. The hooks in the tree:
 *   MOE_FAULT_RANK, MOE_FAULT_AFTER_STEPS   worker/group/group.c: a rank dies by SIGKILL
 *   MOE_FAULT_TRANSFER_DELAY_MS             worker/disagg/kv_link.c: a sender sleeps per layer
 *   MOE_FAULT_DIE_DURING_TRANSFER           worker/disagg/kv_link.c: a sender exits mid-handoff
 *   MOE_FAULT_STEP_DELAY_MS                 worker/serve/service.c: every engine step is slower */
#ifndef MOE_TEST_FAULT_H
#define MOE_TEST_FAULT_H

#include <stdbool.h>

/* True when MOE_TEST_FAULTS=1 is set. */
bool moe_fault_armed(void);

/* The integer value of environment variable `name` when faults are armed and
 * it is set, else `dflt`. The first hook that reads a set value prints one
 * line on stderr naming it, so a log shows that a fault was injected. */
int moe_fault_int(const char *name, int dflt);

#endif
