/* bench-copy-gpu: device-to-device copy bandwidth (cudaMemcpy on one GPU),
 * the ceiling decode is measured against in bench/gpu_check.sh.
 *
 *   bench-copy-gpu [MIB]   (buffer size, default 2048 MiB)
 *
 * Prints "copy_gbps <GB/s>" counting bytes read + bytes written, best of 20
 * copies timed with CUDA events. Exits 77 without CUDA or a GPU. */
#include <stdio.h>
#include <stdlib.h>

#ifdef MOE_HAVE_CUDA
#include <cuda_runtime_api.h>

static int check(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return 0;
    fprintf(stderr, "bench-copy-gpu: %s: %s\n", what, cudaGetErrorString(e));
    return 1;
}

int main(int argc, char **argv)
{
    size_t mib = argc > 1 ? (size_t)strtoul(argv[1], NULL, 10) : 2048;
    size_t bytes = (mib ? mib : 1) << 20;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("bench-copy-gpu: no GPU, skipped\n");
        return 77;
    }
    void *a = NULL, *b = NULL;
    cudaEvent_t t0, t1;
    if (check(cudaMalloc(&a, bytes), "cudaMalloc") || check(cudaMalloc(&b, bytes), "cudaMalloc") ||
        check(cudaMemset(a, 1, bytes), "cudaMemset") || check(cudaEventCreate(&t0), "event") ||
        check(cudaEventCreate(&t1), "event"))
        return 1;
    float best = 1e30f;
    for (int i = 0; i < 21; i++) {
        cudaEventRecord(t0, 0);
        cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0);
        cudaEventRecord(t1, 0);
        if (check(cudaEventSynchronize(t1), "copy"))
            return 1;
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, t0, t1);
        if (i > 0 && ms < best) /* the first copy warms up */
            best = ms;
    }
    printf("copy_gbps %.1f (%zu MiB, best of 20, read + write)\n", 2.0 * (double)bytes / best / 1e6,
           mib);
    cudaFree(a);
    cudaFree(b);
    return 0;
}
#else
int main(void)
{
    printf("bench-copy-gpu: built without CUDA, skipped\n");
    return 77;
}
#endif
