/* Host memory for the model's weights: 64-byte aligned, freed with free().
 * From MOE_HOST_HUGE_MIN bytes on, 2 MiB aligned and marked for transparent
 * huge pages (Linux madvise(MADV_HUGEPAGE); where the kernel runs THP in its
 * default "madvise" mode, nothing else asks for them). A decode step streams
 * every active weight once, ~1.2 GB on the benchmark shape: on 4 KiB pages
 * a TLB miss per 4 KiB, on 2 MiB pages one per 2 MiB. bf16, 2 threads,
 * Emerald Rapids, 5 alternated rounds: 16-sequence decode 268 -> 282 tok/s,
 * prefill level. Only weights: with the backend's other buffers (activations,
 * scratch) on huge pages too, bf16 prefill of 512 tokens fell 13% (their
 * first touch, a fresh huge page zeroed and perhaps compacted for, falls
 * inside the first forward). */
#ifndef MOE_HOST_MEM_H
#define MOE_HOST_MEM_H

#include <stddef.h>

#define MOE_HOST_HUGE_MIN ((size_t)2 << 20)

/* `bytes` (0 counts as 64) of uninitialised host memory as above, or NULL
 * when out of memory. */
void *moe_host_alloc(size_t bytes);

/* `bytes` (0 counts as 64) of zeroed host memory, 64-byte aligned, freed with
 * free(), or NULL when out of memory: the CPU backend's buffers. From
 * MOE_HOST_LAZY_ZERO_MIN bytes on, the whole pages inside the buffer are
 * handed back to the kernel (madvise MADV_DONTNEED), which zeroes each on its
 * first touch, instead of being written now: a buffer's pages are faulted in
 * as it is used. The KV cache (512 MiB by default) was memset whole at
 * start-up: 0.4 s of page faults in every process, seconds under the
 * sanitizers, and all of it resident before a block held a token. */
#define MOE_HOST_LAZY_ZERO_MIN ((size_t)1 << 20)
void *moe_host_alloc_zeroed(size_t bytes);

/* Whether the memory at p lies in a mapping the kernel may back with huge
 * pages, as /proc/self/smaps says ("THPeligible"): 1 yes, 0 no, -1 where
 * that cannot be told (no /proc, a kernel without the field). For tests. */
int moe_host_thp_eligible(const void *p);

#endif
