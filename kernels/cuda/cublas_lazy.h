/* cuBLAS, loaded the first time a CUDA backend is created, not when the
 * program starts.
 *
 * Linked the ordinary way, libcublas and libcublasLt (hundreds of MB of
 * code with large relocation tables) cost every process of a CUDA build
 * ~0.1 s and ~200 MB of resident memory at start-up, GPU or not: the CPU
 * worker, the coordinator, moectl, every test. Here the build compiles
 * against cuBLAS's headers and links only the CUDA runtime; moe_cublas_load
 * dlopens the library (its soname, then the toolkit directory the build
 * found it in) and fills one pointer per function used. After this header
 * the cuBLAS names used below are those pointers, so call sites read as
 * plain cuBLAS calls.
 *
 * Include after <cublas_v2.h>, in C or CUDA C++. */
#ifndef MOE_CUBLAS_LAZY_H
#define MOE_CUBLAS_LAZY_H

#include <cublas_v2.h>

#include "moe_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every cuBLAS function this backend calls (the _v2 names behind
 * cublas_v2.h's macros), as the C API declares them (cublas_lazy.c checks
 * each type against the header's declaration; C++ also has an overload of
 * cublasGemmEx, hence spelled out rather than __typeof__). */
typedef cublasStatus_t (*moe_cublasCreate_v2_fn)(cublasHandle_t *handle);
typedef cublasStatus_t (*moe_cublasDestroy_v2_fn)(cublasHandle_t handle);
typedef cublasStatus_t (*moe_cublasSetStream_v2_fn)(cublasHandle_t handle, cudaStream_t stream);
typedef cublasStatus_t (*moe_cublasGemmEx_fn)(cublasHandle_t handle, cublasOperation_t transa,
                                              cublasOperation_t transb, int m, int n, int k,
                                              const void *alpha, const void *A, cudaDataType Atype,
                                              int lda, const void *B, cudaDataType Btype, int ldb,
                                              const void *beta, void *C, cudaDataType Ctype,
                                              int ldc, cublasComputeType_t computeType,
                                              cublasGemmAlgo_t algo);

#define MOE_CUBLAS_FUNCTIONS(X)                                                                    \
    X(cublasCreate_v2)                                                                             \
    X(cublasDestroy_v2)                                                                            \
    X(cublasSetStream_v2)                                                                          \
    X(cublasGemmEx)

#define MOE_CUBLAS_DECLARE(name) extern moe_##name##_fn moe_p_##name;
MOE_CUBLAS_FUNCTIONS(MOE_CUBLAS_DECLARE)
#undef MOE_CUBLAS_DECLARE

/* Loads cuBLAS once (thread-safe); MOE_ERR_UNSUPPORTED naming the library
 * and dlerror's reason when it cannot be loaded or lacks a function. */
enum moe_status moe_cublas_load(struct moe_error *err);

#ifdef __cplusplus
}
#endif

#ifndef MOE_CUBLAS_LAZY_IMPL
#define cublasCreate_v2 moe_p_cublasCreate_v2
#define cublasDestroy_v2 moe_p_cublasDestroy_v2
#define cublasSetStream_v2 moe_p_cublasSetStream_v2
#define cublasGemmEx moe_p_cublasGemmEx
#endif

#endif
