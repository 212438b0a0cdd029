/*
 * t_link_pool_sync_race - a synchronisation gives a memory pool's reserve
 * back while untracked memory (a 1 GiB device heap, cuCtxSetLimit) is
 * reconciled from NVML.  Run under the shim with CUDA_DEVICE_MEMORY_LIMIT=4g
 * and GPUVISOR_SIM_FREE_MS=1200 (a synchronisation that shrinks a pool, as
 * every call that gives memory back, returns 1.2 s after NVML shows the
 * memory gone), 32 MiB contexts:
 *
 *   a pool with a release threshold of 0; 512 MiB is allocated from it and
 *   freed (cuMemFreeAsync): the pool keeps the 512 MiB until argv[1]
 *   synchronises, which gives it all back:
 *     stream  cuStreamSynchronize(stream)
 *     ctx     cuCtxSynchronize()
 *     event   cuEventSynchronize on an event recorded after the free
 *     ptsz    as stream, through the _ptsz entry points and the per-thread
 *             default stream
 *
 * Round one alone: "synced_a" is the container's usage just after the
 * synchronisation (gv_device_get_used, which settles nothing itself).
 * Round two while another thread allocates 2 MiB every 25 ms (each
 * allocation may take a reading of NVML, at most once a second, so one
 * falls inside the synchronisation): "synced" as before, once that thread
 * stopped; "after" the usage cuMemGetInfo_v2 reports; "n" the thread's
 * blocks; "low" how often that thread saw the container's usage below the
 * context, the heap and its own blocks.
 *
 * The pool's charge used to follow its reserve only at the next re-read
 * (cuMemGetInfo, a pool call, a refused allocation): synced_a was 512 MiB
 * high; and a reading taken between the synchronisation and that re-read
 * saw NVML without the 512 MiB while they were still charged, and took
 * them off the heap's charge: once the pool's charge followed, the
 * container's usage was 512 MiB short until the next reading.  Every
 * figure must be 32 + 1024 (+ 2 n) MiB.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "cuda_protos.h"

CUresult cuCtxSetLimit(CUlimit, size_t);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr, CUstream);

#define BASE (32 + 1024)        /* the context and the heap, MiB */
#include "link_must.h"

static const char *mode;
static CUcontext ctx;
static CUstream stream;
static CUmemoryPool pool;
static atomic_int stop;
static int blocks, low;

static void *allocator(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(ctx);
    while (!atomic_load(&stop)) {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, 2 * MiB) == CUDA_SUCCESS)
            blocks++;
        if (gv_test_used_mib() < BASE + 2ULL * blocks)
            low++;
        usleep(25 * 1000);
    }
    return NULL;
}

/* One round: 512 MiB from the pool, freed, then argv[1]'s synchronisation. */
static int round_trip(void)
{
    int ptsz = !strcmp(mode, "ptsz");
    CUdeviceptr p;
    if (ptsz) {
        MUST(cuMemAllocFromPoolAsync_ptsz(&p, 512 * MiB, pool, NULL));
        MUST(cuMemFreeAsync_ptsz(p, NULL));
        MUST(cuStreamSynchronize_ptsz(NULL));
        return 0;
    }
    MUST(cuMemAllocFromPoolAsync(&p, 512 * MiB, pool, stream));
    MUST(cuMemFreeAsync(p, stream));
    if (!strcmp(mode, "stream")) {
        MUST(cuStreamSynchronize(stream));
    } else if (!strcmp(mode, "ctx")) {
        MUST(cuCtxSynchronize());
    } else if (!strcmp(mode, "event")) {
        CUevent ev;
        MUST(cuEventCreate(&ev, 0));
        MUST(cuEventRecord(ev, stream));
        MUST(cuEventSynchronize(ev));
    } else {
        return 2;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    mode = argv[1];
    MUST(gv_test_primary_ctx(0, &ctx));
    MUST(cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 8 * MiB + 1024 * MiB));
    MUST(cuStreamCreate(&stream, 0));
    CUmemPoolProps props = gv_test_device_pool_props(0);
    MUST(cuMemPoolCreate(&pool, &props));
    cuuint64_t threshold = 0;
    MUST(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));

    int rc = round_trip();
    if (rc)
        return rc;
    uint64_t synced_a = gv_test_used_mib();

    pthread_t t;
    pthread_create(&t, NULL, allocator, NULL);
    usleep(100 * 1000);
    rc = round_trip();
    atomic_store(&stop, 1);
    pthread_join(t, NULL);
    if (rc)
        return rc;
    uint64_t synced = gv_test_used_mib();
    size_t f = 0, total = 0;
    MUST(cuMemGetInfo_v2(&f, &total));
    printf("synced_a=%llu n=%d synced=%llu after=%llu low=%d\n", (unsigned long long)synced_a,
           blocks, (unsigned long long)synced, (unsigned long long)((total - f) / MiB), low);
    return 0;
}
