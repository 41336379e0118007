/* Which device a process opens, and whether a group can run on what its
 * ranks opened (kernels/backend.h's --device flag, group/devices.h): the
 * flag's spellings and its refusals by value, the GPU of each local rank
 * (so eight ranks on an eight-GPU node take eight GPUs), a local rank with
 * no GPU of its own refused naming both numbers, and the group check fed
 * records this machine could not produce: a failed rank, a mixed CPU/GPU
 * group, two ranks of one node on one GPU (NCCL's "Duplicate GPU"), the
 * same ordinal on two nodes or under two NCCL_HOSTIDs (allowed); and that
 * a CUDA build maps cuBLAS and NCCL only once it needs them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "group/devices.h"
#include "testlib.h"
#ifdef MOE_HAVE_CUDA
#include "cuda/cublas_lazy.h"
#endif

static bool has(const struct moe_error *e, const char *s)
{
    return strstr(e->msg, s) != NULL;
}

static void flags(void)
{
    struct moe_device_flag f;
    struct moe_error err = {0};
    CHECK(moe_device_flag_parse("auto", &f, &err) == MOE_OK && f.kind == MOE_DEVICE_FLAG_AUTO &&
          f.ordinal == -1);
    CHECK(moe_device_flag_parse("cpu", &f, &err) == MOE_OK && f.kind == MOE_DEVICE_FLAG_CPU);
    CHECK(moe_device_flag_parse("cuda", &f, &err) == MOE_OK && f.kind == MOE_DEVICE_FLAG_CUDA &&
          f.ordinal == -1);
    CHECK(moe_device_flag_parse("cuda:0", &f, &err) == MOE_OK && f.ordinal == 0);
    CHECK(moe_device_flag_parse("cuda:7", &f, &err) == MOE_OK && f.ordinal == 7);
    const char *bad[] = {"cuda:", "cuda:-1", "cuda:x", "cuda:1x", "cuda:99999999999",
                         "cudax", "gpu",     "CPU",    "",        "cuda: 1"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        err = (struct moe_error){0};
        CHECKF(moe_device_flag_parse(bad[i], &f, &err) == MOE_ERR_INVALID &&
                   has(&err, "--device") && has(&err, bad[i]),
               "'%s': %s", bad[i], err.msg);
    }
    CHECK(moe_device_flag_parse(NULL, &f, &err) == MOE_ERR_INVALID);
}

static void ordinals(void)
{
    struct moe_device_flag by_rank = {.kind = MOE_DEVICE_FLAG_CUDA, .ordinal = -1};
    struct moe_error err = {0};
    int o;
    for (int r = 0; r < 8; r++)
        CHECK(moe_device_pick_ordinal(&by_rank, r, 8, &o, &err) == MOE_OK && o == r);
    CHECK(moe_device_pick_ordinal(&by_rank, 2, 2, &o, &err) == MOE_ERR_INVALID && o == -1);
    CHECKF(has(&err, "local rank 2") && has(&err, "2 GPUs") && has(&err, "--device cuda:N"), "%s",
           err.msg);
    struct moe_device_flag forced = {.kind = MOE_DEVICE_FLAG_CUDA, .ordinal = 1};
    for (int r = 0; r < 4; r++) /* forced: every local rank the same GPU */
        CHECK(moe_device_pick_ordinal(&forced, r, 2, &o, &err) == MOE_OK && o == 1);
    forced.ordinal = 3;
    CHECK(moe_device_pick_ordinal(&forced, 0, 2, &o, &err) == MOE_ERR_INVALID);
    CHECKF(has(&err, "cuda:3") && has(&err, "2 GPUs"), "%s", err.msg);
    forced.ordinal = 0;
    CHECK(moe_device_pick_ordinal(&forced, 0, 1, &o, &err) == MOE_OK && o == 0);
    CHECK(moe_device_pick_ordinal(&forced, 0, 0, &o, &err) == MOE_ERR_INVALID);
    CHECKF(has(&err, "0 GPUs"), "%s", err.msg);
}

static struct moe_rank_device gpu(int ordinal, int node, uint32_t host_id)
{
    struct moe_rank_device d = {
        .device = MOE_DEVICE_CUDA, .ordinal = ordinal, .node = node, .host_id = host_id};
    snprintf(d.msg, sizeof d.msg, "cuda:%d", ordinal);
    return d;
}

static void groups(void)
{
    struct moe_error err = {0};
    struct moe_rank_device d[4];
    for (int r = 0; r < 4; r++) /* one node, four GPUs */
        d[r] = gpu(r, 0, 0);
    CHECKF(moe_rank_devices_check(d, 4, &err) == MOE_OK, "%s", err.msg);

    d[3] = gpu(1, 0, 0); /* rank 3 on rank 1's GPU */
    CHECK(moe_rank_devices_check(d, 4, &err) == MOE_ERR_INVALID);
    CHECKF(has(&err, "ranks 1 and 3") && has(&err, "cuda:1"), "%s", err.msg);
    d[3].node = 3; /* the same number on another node is another GPU */
    CHECKF(moe_rank_devices_check(d, 4, &err) == MOE_OK, "%s", err.msg);
    d[3].node = 0;
    d[3].host_id = 77; /* test-only: NCCL_HOSTID makes NCCL see two hosts */
    CHECKF(moe_rank_devices_check(d, 4, &err) == MOE_OK, "%s", err.msg);

    struct moe_rank_device cpu[3] = {{.device = MOE_DEVICE_CPU, .ordinal = -1},
                                     {.device = MOE_DEVICE_CPU, .ordinal = -1},
                                     {.device = MOE_DEVICE_CPU, .ordinal = -1}};
    CHECK(moe_rank_devices_check(cpu, 3, &err) == MOE_OK); /* CPU ranks never share a GPU */
    struct moe_rank_device mixed[2] = {gpu(0, 0, 0), cpu[0]};
    CHECK(moe_rank_devices_check(mixed, 2, &err) == MOE_ERR_INVALID);
    CHECKF(has(&err, "rank 0 runs on cuda:0, rank 1 on cpu"), "%s", err.msg);

    /* a rank that could not make its backend: everyone fails with its reason */
    struct moe_error why = {0};
    moe_error_set(&why, MOE_ERR_INVALID, "local rank 2 has no GPU of its own");
    moe_rank_device_fill(&d[2], NULL, &why, 0);
    CHECK(d[2].failed && d[2].ordinal == -1);
    CHECK(moe_rank_devices_check(d, 4, &err) == MOE_ERR_INVALID);
    CHECKF(has(&err, "rank 2: local rank 2 has no GPU of its own"), "%s", err.msg);
}

static void fill(void)
{
    struct moe_backend *be = NULL;
    struct moe_error err = {0};
    CHECKF(moe_backend_create_at("cpu", 1, 3, &be, &err) == MOE_OK && be, "%s", err.msg);
    if (!be)
        return;
    CHECK(be->ordinal == -1 && !strncmp(be->label, "cpu (1 thread, ", 15));
    setenv("NCCL_HOSTID", "test-a", 1);
    struct moe_rank_device a, b;
    moe_rank_device_fill(&a, be, NULL, 5);
    setenv("NCCL_HOSTID", "test-b", 1);
    moe_rank_device_fill(&b, be, NULL, 5);
    unsetenv("NCCL_HOSTID");
    CHECK(!a.failed && a.device == MOE_DEVICE_CPU && a.node == 5 && a.ordinal == -1);
    CHECK(a.host_id && b.host_id && a.host_id != b.host_id);
    CHECKF(!strcmp(a.msg, be->label), "%s vs %s", a.msg, be->label);
    moe_backend_destroy(be);
    /* the refusals reach the caller of moe_backend_create_at by value */
    CHECK(moe_backend_create_at("cuda:x", 1, 0, &be, &err) == MOE_ERR_INVALID && !be);
    CHECKF(has(&err, "cuda:x"), "%s", err.msg);
    if (moe_backend_cuda_device_count() == 0) { /* this machine: no GPU */
        CHECK(moe_backend_create_at("cuda:0", 1, 0, &be, &err) != MOE_OK && !be);
        CHECK(moe_backend_create_at("auto", 1, 5, &be, &err) == MOE_OK && be &&
              be->device == MOE_DEVICE_CPU);
        moe_backend_destroy(be);
    } else {
        int n = moe_backend_cuda_device_count();
        CHECK(moe_backend_create_at("cuda", 1, n, &be, &err) == MOE_ERR_INVALID && !be);
        CHECKF(has(&err, "no GPU of its own"), "%s", err.msg);
    }
}

/* Whether a shared object whose file name holds `lib` is mapped into this
 * process. */
static bool mapped(const char *lib)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f)
        return false;
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        const char *slash = strrchr(line, '/');
        found = slash && strstr(slash, lib) != NULL;
    }
    fclose(f);
    return found;
}

/* cuBLAS and NCCL are dlopened on first use (kernels/cuda/cublas_lazy.h,
 * worker/comm/comm_nccl.c): linked, they cost every process of a CUDA build
 * ~0.1 s and ~200 MB at start-up. After fill() opened CPU backends and asked
 * for GPUs (and, on a machine without one, tried cuda:0), neither is mapped;
 * then the loader maps cuBLAS and resolves every function it names. */
static void lazy_libraries(void)
{
    CHECK(!mapped("libcublas") && !mapped("libnccl"));
#ifdef MOE_HAVE_CUDA
    struct moe_error err = {0};
    CHECKF(moe_cublas_load(&err) == MOE_OK, "%s", err.msg);
    CHECK(mapped("libcublas.so") && mapped("libcublasLt.so"));
    CHECK(moe_p_cublasCreate_v2 && moe_p_cublasDestroy_v2 && moe_p_cublasSetStream_v2 &&
          moe_p_cublasGemmEx);
    CHECK(!mapped("libnccl")); /* still: only a communicator loads it (test_comm_nccl) */
#endif
}

int main(void)
{
    flags();
    ordinals();
    groups();
    fill();
    lazy_libraries();
    return test_summary();
}
