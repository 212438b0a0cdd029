/*
 * t_link_untracked_race - another thread allocating while this process's
 * memory without an allocation call (a device heap, cuCtxSetLimit) is
 * reconciled from NVML.  Run under the shim with CUDA_DEVICE_MEMORY_LIMIT=4g
 * and GPUVISOR_SIM_ALLOC_MS=2000: thread A's 1 GiB allocation is in the
 * driver for 2 s, charged but not yet in NVML's figure; meanwhile B asks
 * for 3000 MiB, which does not fit (heap 1 GiB + A's 1 GiB + 3000 MiB is
 * past 4 GiB).  Prints "b=<CUresult>" and "used_mib=<after A>".
 */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

#include "cuda_protos.h"

CUresult cuCtxSetLimit(CUlimit, size_t);

static CUcontext ctx;

static void *slow(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(ctx);
    CUdeviceptr p;
    CUresult rc = cuMemAlloc_v2(&p, 1ULL << 30);
    printf("a=%d\n", (int)rc);
    return NULL;
}

int main(void)
{
    CUdevice d;
    if (cuInit(0) || cuDeviceGet(&d, 0) || cuDevicePrimaryCtxRetain(&ctx, d) ||
        cuCtxSetCurrent(ctx))
        return 2;
    if (cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, (8ULL << 20) + (1ULL << 30)))
        return 3;
    pthread_t t;
    pthread_create(&t, NULL, slow, NULL);
    usleep(1200 * 1000);            /* A is in the driver, and a second passed */
    CUdeviceptr q;
    CUresult b = cuMemAlloc_v2(&q, 3000ULL << 20);
    printf("b=%d\n", (int)b);
    pthread_join(t, NULL);
    size_t f = 0, total = 0;
    cuMemGetInfo_v2(&f, &total);
    printf("used_mib=%zu\n", (total - f) >> 20);
    return 0;
}
