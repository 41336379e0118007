/* The one clock of the project: monotonic time (CLOCK_MONOTONIC), for
 * timeouts, deadlines, latencies and rates. Never wall-clock time: these do
 * not jump when the system clock is set. */
#ifndef MOE_CLOCK_H
#define MOE_CLOCK_H

#include <stdint.h>

double moe_now(void);      /* seconds */
int64_t moe_now_ms(void);  /* milliseconds */
uint64_t moe_now_ns(void); /* nanoseconds */

#endif
