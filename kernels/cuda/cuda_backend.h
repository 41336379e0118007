/* The CUDA backend's entry points outside the ops table, for kernels/backend.c
 * and tests (no CUDA headers). */
#ifndef MOE_CUDA_BACKEND_H
#define MOE_CUDA_BACKEND_H

#include <stddef.h>

#include "backend.h"

/* Frees a backend made by moe_backend_cuda_create. NULL is a no-op. */
void cuda_backend_destroy(struct moe_backend *be);

/* The first error recorded by an op since the last call (0: none; else the
 * cudaError_t, or -1), its one-line message copied to msg[cap] (msg may be
 * NULL); clears it. For tests of "unsupported shapes fail loudly". */
int cuda_backend_take_error(struct moe_backend *be, char *msg, size_t cap);

#endif
