/*
 * t_link_free_async - cuMemFreeAsync of a cuMemAlloc block keeps its charge
 * until the stream reaches the free.  Run under the shim with
 * CUDA_DEVICE_MEMORY_LIMIT=1g on the simulator (32 MiB contexts):
 *
 *   a 768 MiB block is freed into a stream busy with a 1 s kernel; a
 *   512 MiB allocation must be refused while the free is pending (the
 *   driver frees the block only when the stream gets there), and succeed
 *   once argv[1] has shown the stream got there:
 *     sync     cuStreamSynchronize(stream)
 *     ctxsync  cuCtxSynchronize()
 *     event    cuEventSynchronize on an event recorded after the free
 *     ptsz     as sync, through cuMemFreeAsync_ptsz and the per-thread
 *              default stream (cuStreamSynchronize_ptsz(NULL))
 *     poll     nothing: 1.2 s later the allocation itself sees it
 *     destroy  the stream's context (not current) is destroyed, block and
 *              all
 *     sdestroy 1.2 s later (no CUDA call meanwhile), cuStreamDestroy_v2 of
 *              the stream, which has got there; then "take" runs with no
 *              further call from this process
 *   or polls a query every 10 ms until it answers CUDA_SUCCESS (no
 *   synchronisation at all):
 *     query          cuStreamQuery(stream)
 *     ptszquery      cuStreamQuery_ptsz(NULL), the free as in ptsz
 *     evquery        cuEventQuery on an event recorded after the free
 *     procaddr       cuStreamQuery from cuGetProcAddress_v2
 *     procaddr_ptsz  the same with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_
 *                    STREAM (cuStreamQuery_ptsz), the free as in ptsz
 *     dlsym          cuEventQuery from dlsym on a dlopen'ed libcuda.so.1
 *   and then another process of the container ("take": this program again)
 *   allocates 512 MiB, which fits only once the block's charge is back.
 *
 * Prints "pending=<CUresult> during=<MiB> synced=<MiB> after=<CUresult>":
 * during and synced are the container's usage (gv_device_get_used, which
 * releases nothing itself) while pending and just after argv[1]; the query
 * modes add "polls=<queries made>" and the other process prints
 * "take=<CUresult>".
 * Three more modes, "many", "threads" and "devices", are described at
 * their functions.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <spawn.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_protos.h"

CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuStreamQuery_ptsz(CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuCtxSetLimit(CUlimit, size_t);
CUresult cuCtxGetLimit(size_t *, CUlimit);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr, CUstream);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void **, void **);

#include "link_must.h"

/* ---- many: more frees pending than the table holds ------------------ */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* 300 blocks of 2 MiB freed behind a 1 s kernel: the first 256 wait in the
 * table, the next free waits for the stream itself (about 1 s), and the
 * rest find the table emptied by the allocation before them.  Prints
 * "many blocked=<1 if some free waited> used=<MiB after a sync>". */
static int many(CUfunction spin)
{
    CUstream s;
    MUST(cuStreamCreate(&s, 0));
    CUdeviceptr p[300];
    for (int i = 0; i < 300; i++)
        MUST(cuMemAlloc_v2(&p[i], 2 * MiB));
    uint32_t us = 1000 * 1000;
    void *params[] = { &us };
    MUST(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, params, NULL));
    double slowest = 0;
    for (int i = 0; i < 300; i++) {
        double t0 = now_s();
        MUST(cuMemFreeAsync(p[i], s));
        if (now_s() - t0 > slowest)
            slowest = now_s() - t0;
    }
    MUST(cuStreamSynchronize(s));
    printf("many blocked=%d used=%llu\n", slowest > 0.5, (unsigned long long)gv_test_used_mib());
    return 0;
}

/* ---- threads: frees queued, reached, synchronised and their streams
 *      destroyed concurrently ---------------------------------------- */

static CUcontext shared_ctx;
static CUfunction shared_spin;

static void *churn(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(shared_ctx);
    CUstream s;
    if (cuStreamCreate(&s, 0))
        return (void *)1;
    uint32_t us = 200;
    void *params[] = { &us };
    for (int i = 0; i < 300; i++) {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, 4 * MiB))
            continue;                       /* the others' pending frees fill the quota */
        cuLaunchKernel(shared_spin, 1, 1, 1, 1, 1, 1, 0, s, params, NULL);
        if (cuMemFreeAsync(p, s))
            return (void *)1;
        if (i % 7 == 0)
            cuStreamSynchronize(s);
        if (i % 11 == 0) {
            size_t f, t;
            cuMemGetInfo_v2(&f, &t);
        }
        if (i % 13 == 0) {                  /* its frees reached, or not yet */
            if (cuStreamDestroy_v2(s) || cuStreamCreate(&s, 0))
                return (void *)1;
        }
    }
    cuStreamSynchronize(s);
    return NULL;
}

/* Four threads; then one more allocation (which releases whatever the
 * streams reached since their last synchronisation).  Prints
 * "threads failed=<n> used=<MiB>". */
static int threads(CUcontext prim, CUfunction spin)
{
    shared_ctx = prim;
    shared_spin = spin;
    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        pthread_create(&t[i], NULL, churn, NULL);
    int failed = 0;
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(t[i], &r);
        failed += r != NULL;
    }
    MUST(cuCtxSynchronize());
    printf("threads failed=%d used=%llu\n", failed, (unsigned long long)gv_test_used_mib());
    return 0;
}

/* ---- devices: frees of two devices released by each other's readings -- */

static CUcontext dev_ctx[2];
static CUfunction dev_spin[2];

/* As churn, on device (arg), and every third block a reading of untracked
 * memory (cuCtxSetLimit setting the stack limit to what it is), which
 * releases the frees the streams reached on both devices and reads again
 * the other device where its charge may be short. */
static void *churn_device(void *arg)
{
    int dev = (int)(intptr_t)arg;
    cuCtxSetCurrent(dev_ctx[dev]);
    CUstream s;
    if (cuStreamCreate(&s, 0))
        return (void *)1;
    uint32_t us = 200;
    void *params[] = { &us };
    size_t stack;
    if (cuCtxGetLimit(&stack, CU_LIMIT_STACK_SIZE))
        return (void *)1;
    for (int i = 0; i < 200; i++) {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, 4 * MiB))
            continue;
        cuLaunchKernel(dev_spin[dev], 1, 1, 1, 1, 1, 1, 0, s, params, NULL);
        if (cuMemFreeAsync(p, s))
            return (void *)1;
        if (i % 3 == 0 && cuCtxSetLimit(CU_LIMIT_STACK_SIZE, stack))
            return (void *)1;
        if (i % 7 == 0)
            cuStreamSynchronize(s);
    }
    cuStreamSynchronize(s);
    return NULL;
}

static uint64_t used_mib(int dev)
{
    int (*get)(int, uint64_t *) = (int (*)(int, uint64_t *))dlsym(RTLD_DEFAULT,
                                                                  "gv_device_get_used");
    uint64_t v = 0;
    if (!get || get(dev, &v) != 0)
        return UINT64_MAX;
    return v / MiB;
}

/* Four threads, two on each device's primary context (device 0's is prim,
 * with spin).  Then, a second later, a reading of every device
 * (cuMemGetInfo).  Prints "devices failed=<n> used=<MiB on 0>,<MiB on 1>". */
static int devices(CUcontext prim, CUfunction spin)
{
    CUdevice d1;
    CUmodule mod;
    dev_ctx[0] = prim;
    dev_spin[0] = spin;
    MUST(cuDeviceGet(&d1, 1));
    MUST(cuDevicePrimaryCtxRetain(&dev_ctx[1], d1));
    MUST(cuCtxSetCurrent(dev_ctx[1]));
    MUST(cuModuleLoadData(&mod, "any image"));
    MUST(cuModuleGetFunction(&dev_spin[1], mod, "spin"));
    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        pthread_create(&t[i], NULL, churn_device, (void *)(intptr_t)(i % 2));
    int failed = 0;
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(t[i], &r);
        failed += r != NULL;
    }
    struct timespec ts = { 1, 100 * 1000 * 1000 };
    nanosleep(&ts, NULL);
    size_t f, tot;
    MUST(cuMemGetInfo_v2(&f, &tot));
    printf("devices failed=%d used=%llu,%llu\n", failed, (unsigned long long)used_mib(0),
           (unsigned long long)used_mib(1));
    return 0;
}

/* ---- query modes ------------------------------------------------------ */

extern char **environ;

/* "take": another process of the container allocates 512 MiB.  Prints
 * "take=<CUresult>". */
static int take(void)
{
    MUST(gv_test_primary_ctx(0, NULL));
    CUdeviceptr p;
    CUresult rc = cuMemAlloc_v2(&p, 512 * MiB);
    if (rc == CUDA_SUCCESS)
        cuMemFree_v2(p);
    printf("take=%d\n", (int)rc);
    return 0;
}

/* Run "take" in a new process (this program again, same environment). */
static int spawn_take(void)
{
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return 3;
    self[n] = 0;
    char *args[] = { self, "take", NULL };
    fflush(stdout);
    pid_t pid;
    if (posix_spawn(&pid, self, NULL, NULL, args, environ) != 0)
        return 3;
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
        return 3;
    return 0;
}

typedef CUresult (*stream_query_fn)(CUstream);
typedef CUresult (*event_query_fn)(CUevent);

/* Poll mode's query (of stream, or of the event later) every 10 ms until it
 * answers CUDA_SUCCESS; the number of queries, or -1 on another answer or
 * a query that cannot be found. */
static int poll_query(const char *mode, CUstream stream, CUevent later)
{
    stream_query_fn sq = NULL;
    event_query_fn eq = NULL;
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    if (!strcmp(mode, "query")) {
        sq = cuStreamQuery;
    } else if (!strcmp(mode, "ptszquery")) {
        sq = cuStreamQuery_ptsz;
    } else if (!strcmp(mode, "evquery")) {
        eq = cuEventQuery;
    } else if (!strcmp(mode, "procaddr") || !strcmp(mode, "procaddr_ptsz")) {
        cuuint64_t flags = strcmp(mode, "procaddr") ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                                    : CU_GET_PROC_ADDRESS_DEFAULT;
        if (cuGetProcAddress_v2("cuStreamQuery", &fn, 12000, flags, &st) != CUDA_SUCCESS)
            return -1;
        sq = (stream_query_fn)fn;
    } else if (!strcmp(mode, "dlsym")) {
        void *drv = dlopen("libcuda.so.1", RTLD_NOW);
        if (!drv || !(fn = dlsym(drv, "cuEventQuery")))
            return -1;
        eq = (event_query_fn)fn;
    }
    if (!sq && !eq)
        return -1;
    for (int polls = 1;; polls++) {
        CUresult rc = sq ? sq(stream) : eq(later);
        if (rc == CUDA_SUCCESS)
            return polls;
        if (rc != CUDA_ERROR_NOT_READY)
            return -1;
        usleep(10 * 1000);
    }
}

static int is_query_mode(const char *mode)
{
    static const char *const modes[] = { "query", "ptszquery", "evquery", "procaddr",
                                         "procaddr_ptsz", "dlsym" };
    for (size_t i = 0; i < sizeof modes / sizeof *modes; i++)
        if (!strcmp(mode, modes[i]))
            return 1;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    const char *mode = argv[1];
    if (!strcmp(mode, "take"))
        return take();
    int ptsz = !strcmp(mode, "ptsz") || !strcmp(mode, "ptszquery") ||
               !strcmp(mode, "procaddr_ptsz");
    CUdevice d;
    CUcontext prim, other = NULL;
    MUST(cuInit(0));
    MUST(cuDeviceGet(&d, 0));
    MUST(cuDevicePrimaryCtxRetain(&prim, d));
    MUST(cuCtxSetCurrent(prim));
    if (!strcmp(mode, "destroy"))
        MUST(cuCtxCreate_v2(&other, 0, d));     /* current until popped below */
    CUstream s = NULL;
    if (!ptsz)
        MUST(cuStreamCreate(&s, 0));
    CUmodule mod;
    CUfunction spin;
    MUST(cuModuleLoadData(&mod, "any image"));
    MUST(cuModuleGetFunction(&spin, mod, "spin"));
    if (!strcmp(mode, "many"))
        return many(spin);
    if (!strcmp(mode, "threads"))
        return threads(prim, spin);
    if (!strcmp(mode, "devices"))
        return devices(prim, spin);
    CUdeviceptr block;
    MUST(cuMemAlloc_v2(&block, 768 * MiB));
    uint32_t us = 1000 * 1000;
    void *params[] = { &us };
    if (ptsz) {
        MUST(cuLaunchKernel_ptsz(spin, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
        MUST(cuMemFreeAsync_ptsz(block, NULL));
    } else {
        MUST(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, params, NULL));
        MUST(cuMemFreeAsync(block, s));
    }
    CUevent later = NULL;
    if (!strcmp(mode, "event") || !strcmp(mode, "evquery") || !strcmp(mode, "dlsym")) {
        MUST(cuEventCreate(&later, 0));
        MUST(cuEventRecord(later, s));
    }
    if (other) {
        CUcontext popped;
        MUST(cuCtxPopCurrent_v2(&popped));      /* the primary context is current again */
    }
    CUdeviceptr q;
    CUresult pending = cuMemAlloc_v2(&q, 512 * MiB);
    if (pending == CUDA_SUCCESS)
        cuMemFree_v2(q);
    uint64_t during = gv_test_used_mib();
    if (is_query_mode(mode)) {
        int polls = poll_query(mode, s, later);
        if (polls < 0)
            return 3;
        uint64_t synced = gv_test_used_mib();
        if (spawn_take())
            return 3;
        CUresult after = cuMemAlloc_v2(&q, 512 * MiB);
        printf("pending=%d during=%llu synced=%llu after=%d polls=%d\n", (int)pending,
               (unsigned long long)during, (unsigned long long)synced, (int)after, polls);
        return 0;
    }
    if (!strcmp(mode, "sync"))
        MUST(cuStreamSynchronize(s));
    else if (ptsz)
        MUST(cuStreamSynchronize_ptsz(NULL));
    else if (!strcmp(mode, "ctxsync"))
        MUST(cuCtxSynchronize());
    else if (!strcmp(mode, "event"))
        MUST(cuEventSynchronize(later));
    else if (!strcmp(mode, "poll"))
        usleep(1200 * 1000);
    else if (!strcmp(mode, "destroy"))
        MUST(cuCtxDestroy_v2(other));
    else if (!strcmp(mode, "sdestroy")) {
        usleep(1200 * 1000);
        MUST(cuStreamDestroy_v2(s));
    } else
        return 2;
    uint64_t synced = gv_test_used_mib();
    if (!strcmp(mode, "sdestroy") && spawn_take())
        return 3;
    CUresult after = cuMemAlloc_v2(&q, 512 * MiB);
    printf("pending=%d during=%llu synced=%llu after=%d\n", (int)pending,
           (unsigned long long)during, (unsigned long long)synced, (int)after);
    return 0;
}
