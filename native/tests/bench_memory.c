/*
 * bench_memory.c - what an interposer adds per memory call (make bench).
 *
 * The operations below, each measured by the harness in bench_common.h
 * (a process linked with -lcuda, the interposer preloaded or not, helpers
 * of the same container beside it; wall time and callgrind instructions):
 *   - cuMemAlloc_v2(1 MiB) + cuMemFree_v2, with a memory limit and without;
 *   - cuMemGetInfo_v2, with a memory limit and without;
 *   - a refused cuMemAlloc_v2 of 64 MiB: the measuring process first fills
 *     the quota (the device, direct) with 64 MiB allocations, then every
 *     call is refused;
 *   - under CUDA_OVERSUBSCRIBE=true (docs/oversubscription.md), a 32g quota
 *     on the 16g device, no node directory: the 1 MiB pair within the
 *     container's guarantee (S = 2: to the device), and beyond it (S = 16,
 *     2 GiB taken first: spilled, managed memory advised to the host;
 *     direct: those driver calls, made by the program itself).
 * To add a case: a call (and a set-up) below, and a row in ops[].
 */
#include <dlfcn.h>

#include "gv_cuda.h"

#include "bench_common.h"

#define SECTION "## Memory quota: per-call cost (make bench)"
#define ALLOC_BYTES (1u << 20)
#define REFUSED_BYTES (64u << 20)

static void alloc_free(long i)
{
    (void)i;
    CUdeviceptr p;
    check(cuMemAlloc_v2(&p, ALLOC_BYTES), "cuMemAlloc_v2");
    check(cuMemFree_v2(p), "cuMemFree_v2");
}

static void get_info(long i)
{
    (void)i;
    size_t free_b, total_b;
    check(cuMemGetInfo_v2(&free_b, &total_b), "cuMemGetInfo_v2");
}

/* Fill the quota (direct: the device) until an allocation is refused. */
static void fill(void)
{
    CUdeviceptr p;
    CUresult rc;
    int n = 0;
    while ((rc = cuMemAlloc_v2(&p, REFUSED_BYTES)) == CUDA_SUCCESS)
        if (++n > 100000)
            die("64 MiB allocations never refused");
    if (rc != CUDA_ERROR_OUT_OF_MEMORY)
        die("filling the quota: cuMemAlloc_v2: %d", rc);
}

static void refused(long i)
{
    (void)i;
    CUdeviceptr p;
    CUresult rc = cuMemAlloc_v2(&p, REFUSED_BYTES);
    if (rc != CUDA_ERROR_OUT_OF_MEMORY)
        die("a 64 MiB allocation with the quota full: %d, not CUDA_ERROR_OUT_OF_MEMORY", rc);
}

/* Take the 2 GiB guarantee (S = 16 of 32g) on the device first. */
static void take_guarantee(void)
{
    CUdeviceptr p;
    check(cuMemAlloc_v2(&p, 2ull << 30), "cuMemAlloc_v2 (the guarantee)");
}

/* Whether this process runs without an interposer (direct): the driver's
 * own cuMemAlloc_v2 is the one a call reaches. */
static int direct(void)
{
    static int known = -1;
    if (known < 0) {
        Dl_info info;
        void *f = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
        known = f && dladdr(f, &info) && info.dli_fname && strstr(info.dli_fname, "libcuda");
    }
    return known;
}

/* Spilled: through an interposer, the 1 MiB pair it spills; direct, the
 * driver calls a spilled allocation is made of (native/shim/oversub.c):
 * managed memory advised to the host and mapped for the device, and its
 * free.  So what the library adds is its decision and bookkeeping. */
static void spilled_pair(long i)
{
    if (!direct()) {
        alloc_free(i);
        return;
    }
    CUdeviceptr p;
    check(cuMemAllocManaged(&p, ALLOC_BYTES, CU_MEM_ATTACH_GLOBAL), "cuMemAllocManaged");
    check(cuMemAdvise(p, ALLOC_BYTES, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_DEVICE_CPU),
          "cuMemAdvise");
    check(cuMemAdvise(p, ALLOC_BYTES, CU_MEM_ADVISE_SET_ACCESSED_BY, 0), "cuMemAdvise");
    check(cuMemFree_v2(p), "cuMemFree_v2");
}

#define OVER_ENV "CUDA_OVERSUBSCRIBE=true GPUVISOR_NODE_LOCK= GPUVISOR_MEMORY_SCALING="

static const struct bench_op ops[] = {
    { .name = "alloc-free", .label = "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB), limit " BENCH_LIMIT,
      .mem_limit = BENCH_LIMIT, .call = alloc_free, .goal_ns = 300 },
    { .name = "info", .label = "cuMemGetInfo_v2, limit " BENCH_LIMIT, .mem_limit = BENCH_LIMIT,
      .call = get_info },
    { .name = "refused", .label = "refused cuMemAlloc_v2 (64 MiB), limit " BENCH_LIMIT " full",
      .mem_limit = BENCH_LIMIT, .setup = fill, .call = refused, .no_driver = 1, .goal_ns = 2000 },
    { .name = "alloc-free-nolimit", .label = "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB), no limit",
      .call = alloc_free },
    { .name = "info-nolimit", .label = "cuMemGetInfo_v2, no limit", .call = get_info },
    { .name = "oversub-device", .label = "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB), oversubscribed, "
      "within the guarantee", .mem_limit = "32g", .env = OVER_ENV "2", .alone = 1,
      .call = alloc_free },
    { .name = "oversub-spilled", .label = "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB), oversubscribed, "
      "spilled", .mem_limit = "32g", .env = OVER_ENV "16", .alone = 1, .setup = take_guarantee,
      .call = spilled_pair },
};

static void intro(FILE *f)
{
    fprintf(f,
            "What an interposer adds per memory call. With a limit "
            "(`CUDA_DEVICE_MEMORY_LIMIT=" BENCH_LIMIT "`) every allocation reserves and "
            "releases quota in the container's region; *no limit* is the path of a container "
            "without one. *Refused*: the measuring process first fills the quota with 64 MiB "
            "allocations (direct: the %s device, so the driver refuses), then every call is "
            "refused; with libgpuvisor the first refusal of each 100 ms in the container also "
            "looks for dead processes' memory (docs/region.md), which the warm-up takes, so "
            "the figures are a refusal without that look. The simulated driver's calls do "
            "little (a process-shared mutex, a hash table), far less than a real driver's "
            "`cuMemAlloc`: read what the library adds. *Oversubscribed* "
            "(`CUDA_OVERSUBSCRIBE=true`, a 32g quota, no node directory, "
            "docs/oversubscription.md): *within the guarantee* (S = 2) goes to the device; "
            "*spilled* (S = 16, its 2 GiB guarantee taken first) is served from host memory "
            "(`cuMemAllocManaged` and two `cuMemAdvise`); its direct column makes those "
            "driver calls itself (and `cuMemFree_v2`), so what the library adds there is "
            "its decision and bookkeeping.\n\n",
            BENCH_SIM_DEVICES);
}

int main(int argc, char **argv)
{
    static const struct bench_spec spec = {
        .name = "bench_memory", .section = SECTION, .command = "make bench", BENCH_OPS(ops),
        .default_ops = "alloc-free,info,refused,alloc-free-nolimit,info-nolimit,oversub-device,"
                       "oversub-spilled",
        .default_procs = "1,8,64", .intro = intro,
    };
    return bench_main(argc, argv, &spec);
}
