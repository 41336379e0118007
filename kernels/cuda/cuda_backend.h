/* The CUDA backend's destroy hook, for kernels/backend.c (no CUDA headers). */
#ifndef MOE_CUDA_BACKEND_H
#define MOE_CUDA_BACKEND_H

#include "backend.h"

/* Frees a backend made by moe_backend_cuda_create. NULL is a no-op. */
void cuda_backend_destroy(struct moe_backend *be);

#endif
