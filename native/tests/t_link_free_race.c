/*
 * t_link_free_race - memory the driver gave without an allocation call (a
 * 1 GiB device heap, cuCtxSetLimit) is reconciled from NVML while another
 * thread's free is in the driver.  Run under the shim with
 * CUDA_DEVICE_MEMORY_LIMIT=4g, GPUVISOR_SIM_DEVICES=2x16g:ctx=256m,
 * GPUVISOR_SIM_FREE_MS=1000 and GPUVISOR_SIM_ALLOC_MS=1500:
 *
 *   t=0     thread A frees an object (argv[1] says which; NVML shows it gone
 *           at once, the driver call answers at t=1 s);
 *   t=0.3 s the main thread asks for 4 GiB, which is refused after a reading
 *           of NVML (the heap is charged, and the request is tight);
 *   t=0.6 s thread C allocates 64 MiB, in the driver until t=2.1 s: no
 *           reading is used while its charge is in flight;
 *   t=1 s   A is back: "during" is the container's usage then (C's 64 MiB
 *           included), "after" once C is back too.
 *
 * A reading taken while A's free was in the driver counted the freed
 * object's charge, not yet given back, as memory NVML no longer shows, and
 * took it off the heap's charge: after A, the container's usage was short
 * by the object's size until the next reading.  Both figures must be
 * 256 MiB (the context) + 1024 MiB (heap) + 64 MiB (C's allocation).
 *
 * Objects: destroy (a 256 MiB context, cuCtxDestroy), primary / reset (the
 * 256 MiB primary context, its last cuDevicePrimaryCtxRelease, or
 * cuDevicePrimaryCtxReset), release (an unmapped 512 MiB cuMemCreate
 * handle, cuMemRelease), unmap / addrfree (a released handle's only
 * mapping, cuMemUnmap or cuMemAddressFree), async (a 512 MiB cuMemAlloc
 * block, cuMemFreeAsync on the idle NULL stream).
 */
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "cuda_protos.h"

CUresult cuCtxSetLimit(CUlimit, size_t);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                     unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);

#define OBJ (512 * MiB)

static const char *mode;
static CUcontext main_ctx, other_ctx;
static CUmemGenericAllocationHandle handle;
static CUdeviceptr va, block;
static CUresult a_rc = CUDA_ERROR_UNKNOWN, c_rc = CUDA_ERROR_UNKNOWN;

static void *free_it(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(main_ctx);
    if (!strcmp(mode, "destroy"))
        a_rc = cuCtxDestroy_v2(other_ctx);
    else if (!strcmp(mode, "primary"))
        a_rc = cuDevicePrimaryCtxRelease_v2(0);
    else if (!strcmp(mode, "reset"))
        a_rc = cuDevicePrimaryCtxReset_v2(0);
    else if (!strcmp(mode, "release"))
        a_rc = cuMemRelease(handle);
    else if (!strcmp(mode, "unmap"))
        a_rc = cuMemUnmap(va, OBJ);
    else if (!strcmp(mode, "addrfree"))
        a_rc = cuMemAddressFree(va, OBJ);
    else if (!strcmp(mode, "async"))
        a_rc = cuMemFreeAsync(block, NULL);
    return NULL;
}

static void *slow_alloc(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(main_ctx);
    CUdeviceptr p;
    c_rc = cuMemAlloc_v2(&p, 64 * MiB);
    return NULL;
}

static int setup(void)
{
    if (!strcmp(mode, "destroy")) {
        CUcontext cur;
        return cuCtxCreate_v2(&other_ctx, 0, 0) || cuCtxPopCurrent_v2(&cur);
    }
    if (!strcmp(mode, "primary") || !strcmp(mode, "reset"))
        return cuDevicePrimaryCtxRetain(&other_ctx, 0) != CUDA_SUCCESS;
    if (!strcmp(mode, "async"))
        return cuMemAlloc_v2(&block, OBJ) != CUDA_SUCCESS;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    if (cuMemCreate(&handle, OBJ, &prop, 0))
        return 1;
    if (!strcmp(mode, "release"))
        return 0;
    return cuMemAddressReserve(&va, OBJ, 0, 0, 0) || cuMemMap(va, OBJ, 0, handle, 0) ||
           cuMemRelease(handle);
}

static size_t used_mib(void)
{
    size_t f = 0, total = 0;
    cuMemGetInfo_v2(&f, &total);
    return (total - f) / MiB;
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    mode = argv[1];
    CUdevice d;
    if (cuInit(0) || cuDeviceGet(&d, 0) || cuCtxCreate_v2(&main_ctx, 0, d))
        return 3;
    if (cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, (8ULL << 20) + (1ULL << 30)))
        return 4;
    if (setup())
        return 5;
    pthread_t a, c;
    pthread_create(&a, NULL, free_it, NULL);
    usleep(300 * 1000);
    CUdeviceptr q;
    CUresult b = cuMemAlloc_v2(&q, 4096 * MiB);
    usleep(300 * 1000);
    pthread_create(&c, NULL, slow_alloc, NULL);
    pthread_join(a, NULL);
    size_t during = used_mib();
    pthread_join(c, NULL);
    printf("a=%d b=%d c=%d during=%zu after=%zu\n", (int)a_rc, (int)b, (int)c_rc, during,
           used_mib());
    return 0;
}
