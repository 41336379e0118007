/* Arrival times of a run (seconds from its start), the same on every rank:
 * each rank sends the requests of its share at their global times, so the
 * job's combined arrivals do not depend on the number of ranks.
 *
 *   rate inf        every request at t = 0
 *   burstiness 1    Poisson process (exponential gaps of mean 1/rate)
 *   burstiness b    gamma gaps of shape b and mean 1/rate: b < 1 burstier,
 *                   b > 1 more even (vLLM's --burstiness)
 * For a fixed count the gaps are scaled so the last arrival is at n / rate,
 * as vLLM does (steadier throughput across seeds). */
#ifndef MOE_BENCH_SCHEDULE_H
#define MOE_BENCH_SCHEDULE_H

#include <stddef.h>
#include <stdint.h>

#include "moe_error.h"

/* n arrivals into a malloc'd *out. */
enum moe_status bench_schedule_count(size_t n, double rate, double burstiness, uint64_t seed,
                                     double **out);

/* Arrivals before duration_s (rate finite) into malloc'd *out, *n of them. */
enum moe_status bench_schedule_duration(double duration_s, double rate, double burstiness,
                                        uint64_t seed, double **out, size_t *n);

#endif
