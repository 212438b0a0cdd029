/*
 * t_sim_basic.c - exercises the simulated libcuda.so.1 through dlopen:
 * device queries, contexts, every allocation API, pools, VMM, arrays, OOM,
 * cuGetProcAddress versions/flags and CUDA_VISIBLE_DEVICES.
 *
 * usage: t_sim_basic [path/to/libcuda.so.1]   (or GV_SIM_LIBCUDA=...)
 * Uses its own state file (unlinked at exit) and device spec.
 * Prints "OK" and exits 0, or prints the failing check and exits 1.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gv_cuda.h"
#include "sim_test.h"

#define MIB (1024ULL * 1024ULL)
#define GIB (1024ULL * MIB)



/* typed function pointers, looked up by exact exported name */
#define F(name, ret, args) static ret(*name) args;
#define FUNCS                                                                 \
    F(cuInit, CUresult, (unsigned))                                           \
    F(cuDriverGetVersion, CUresult, (int *))                                  \
    F(cuGetProcAddress, CUresult, (const char *, void **, int, cuuint64_t))   \
    F(cuGetProcAddress_v2, CUresult, (const char *, void **, int, cuuint64_t, \
                                      CUdriverProcAddressQueryResult *))      \
    F(cuGetErrorName, CUresult, (CUresult, const char **))                    \
    F(cuGetErrorString, CUresult, (CUresult, const char **))                  \
    F(cuDeviceGet, CUresult, (CUdevice *, int))                               \
    F(cuDeviceGetCount, CUresult, (int *))                                    \
    F(cuDeviceGetName, CUresult, (char *, int, CUdevice))                     \
    F(cuDeviceGetUuid_v2, CUresult, (CUuuid *, CUdevice))                     \
    F(cuDeviceTotalMem, CUresult, (unsigned *, CUdevice))                     \
    F(cuDeviceTotalMem_v2, CUresult, (size_t *, CUdevice))                    \
    F(cuDeviceGetAttribute, CUresult, (int *, int, CUdevice))                 \
    F(cuDeviceGetPCIBusId, CUresult, (char *, int, CUdevice))                 \
    F(cuDeviceGetDefaultMemPool, CUresult, (CUmemoryPool *, CUdevice))        \
    F(cuDeviceGetMemPool, CUresult, (CUmemoryPool *, CUdevice))               \
    F(cuDeviceSetMemPool, CUresult, (CUdevice, CUmemoryPool))                 \
    F(cuCtxCreate_v2, CUresult, (CUcontext *, unsigned, CUdevice))            \
    F(cuCtxCreate_v4, CUresult, (CUcontext *, CUctxCreateParams *, unsigned,  \
                                 CUdevice))                                   \
    F(cuCtxDestroy_v2, CUresult, (CUcontext))                                 \
    F(cuCtxGetCurrent, CUresult, (CUcontext *))                               \
    F(cuCtxSetCurrent, CUresult, (CUcontext))                                 \
    F(cuCtxPushCurrent_v2, CUresult, (CUcontext))                             \
    F(cuCtxPopCurrent_v2, CUresult, (CUcontext *))                            \
    F(cuCtxGetDevice, CUresult, (CUdevice *))                                 \
    F(cuCtxGetDevice_v2, CUresult, (CUdevice *, CUcontext))                   \
    F(cuCtxSynchronize, CUresult, (void))                                     \
    F(cuCtxSynchronize_v2, CUresult, (CUcontext))                             \
    F(cuDevicePrimaryCtxRetain, CUresult, (CUcontext *, CUdevice))            \
    F(cuDevicePrimaryCtxRelease_v2, CUresult, (CUdevice))                     \
    F(cuDevicePrimaryCtxReset_v2, CUresult, (CUdevice))                       \
    F(cuDevicePrimaryCtxGetState, CUresult, (CUdevice, unsigned *, int *))    \
    F(cuMemGetInfo, CUresult, (unsigned *, unsigned *))                       \
    F(cuMemGetInfo_v2, CUresult, (size_t *, size_t *))                        \
    F(cuMemAlloc, CUresult, (CUdeviceptr_v1 *, unsigned))                     \
    F(cuMemAlloc_v2, CUresult, (CUdeviceptr *, size_t))                       \
    F(cuMemAllocPitch_v2, CUresult, (CUdeviceptr *, size_t *, size_t, size_t, \
                                     unsigned))                               \
    F(cuMemAllocManaged, CUresult, (CUdeviceptr *, size_t, unsigned))         \
    F(cuMemAdvise, CUresult, (CUdeviceptr, size_t, CUmem_advise, CUdevice))   \
    F(cuMemPrefetchAsync, CUresult, (CUdeviceptr, size_t, CUdevice, CUstream)) \
    F(cuMemFree, CUresult, (CUdeviceptr_v1))                                  \
    F(cuMemFree_v2, CUresult, (CUdeviceptr))                                  \
    F(cuMemAllocHost_v2, CUresult, (void **, size_t))                         \
    F(cuMemFreeHost, CUresult, (void *))                                      \
    F(cuMemGetAddressRange_v2, CUresult, (CUdeviceptr *, size_t *,            \
                                          CUdeviceptr))                       \
    F(cuMemcpyHtoD_v2, CUresult, (CUdeviceptr, const void *, size_t))         \
    F(cuMemsetD8_v2, CUresult, (CUdeviceptr, unsigned char, size_t))          \
    F(cuArrayCreate_v2, CUresult, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *)) \
    F(cuArray3DCreate_v2, CUresult, (CUarray *,                               \
                                     const CUDA_ARRAY3D_DESCRIPTOR *))        \
    F(cuArrayDestroy, CUresult, (CUarray))                                    \
    F(cuArrayGetDescriptor_v2, CUresult, (CUDA_ARRAY_DESCRIPTOR *, CUarray))  \
    F(cuArrayGetMemoryRequirements, CUresult,                                 \
      (CUDA_ARRAY_MEMORY_REQUIREMENTS *, CUarray, CUdevice))                  \
    F(cuMipmappedArrayCreate, CUresult, (CUmipmappedArray *,                  \
                                         const CUDA_ARRAY3D_DESCRIPTOR *,     \
                                         unsigned))                           \
    F(cuMipmappedArrayDestroy, CUresult, (CUmipmappedArray))                  \
    F(cuMipmappedArrayGetMemoryRequirements, CUresult,                        \
      (CUDA_ARRAY_MEMORY_REQUIREMENTS *, CUmipmappedArray, CUdevice))         \
    F(cuMemCreate, CUresult, (CUmemGenericAllocationHandle *, size_t,         \
                              const CUmemAllocationProp *,                    \
                              unsigned long long))                            \
    F(cuMemRelease, CUresult, (CUmemGenericAllocationHandle))                 \
    F(cuMemAddressReserve, CUresult, (CUdeviceptr *, size_t, size_t,          \
                                      CUdeviceptr, unsigned long long))       \
    F(cuMemAddressFree, CUresult, (CUdeviceptr, size_t))                      \
    F(cuMemMap, CUresult, (CUdeviceptr, size_t, size_t,                       \
                           CUmemGenericAllocationHandle, unsigned long long)) \
    F(cuMemUnmap, CUresult, (CUdeviceptr, size_t))                            \
    F(cuMemSetAccess, CUresult, (CUdeviceptr, size_t,                         \
                                 const CUmemAccessDesc *, size_t))            \
    F(cuMemGetAllocationGranularity, CUresult,                                \
      (size_t *, const CUmemAllocationProp *, int))                           \
    F(cuMemGetAllocationPropertiesFromHandle, CUresult,                       \
      (CUmemAllocationProp *, CUmemGenericAllocationHandle))                  \
    F(cuMemAllocAsync, CUresult, (CUdeviceptr *, size_t, CUstream))           \
    F(cuMemAllocFromPoolAsync, CUresult, (CUdeviceptr *, size_t,              \
                                          CUmemoryPool, CUstream))            \
    F(cuMemFreeAsync, CUresult, (CUdeviceptr, CUstream))                      \
    F(cuMemPoolCreate, CUresult, (CUmemoryPool *, const CUmemPoolProps *))    \
    F(cuMemPoolDestroy, CUresult, (CUmemoryPool))                             \
    F(cuMemPoolTrimTo, CUresult, (CUmemoryPool, size_t))                      \
    F(cuMemPoolSetAttribute, CUresult, (CUmemoryPool, int, void *))           \
    F(cuMemPoolGetAttribute, CUresult, (CUmemoryPool, int, void *))           \
    F(cuStreamCreate, CUresult, (CUstream *, unsigned))                       \
    F(cuStreamDestroy_v2, CUresult, (CUstream))                               \
    F(cuStreamSynchronize, CUresult, (CUstream))                              \
    F(cuStreamQuery, CUresult, (CUstream))                                    \
    F(cuStreamGetCtx, CUresult, (CUstream, CUcontext *))
FUNCS
#undef F
#define F(name, ret, args) *(void **)&name = sym(#name);
static void load(void)
{
    sim_test_open();
    FUNCS
}

static const char *UUID2 = "GPU-11111111-2222-3333-4444-555555555555";

static size_t free_mem(void)
{
    size_t f, t;
    OK(cuMemGetInfo_v2(&f, &t));
    return f;
}

static uint64_t pool_attr(CUmemoryPool p, int attr)
{
    cuuint64_t v = 0;
    OK(cuMemPoolGetAttribute(p, attr, &v));
    return v;
}

/* ---- CUDA_VISIBLE_DEVICES, each case in a fresh child process -------- */

static void cvd_case(const char *value, int want_count, int want_node0)
{
    pid_t pid = fork();
    if (pid == 0) {
        if (value)
            setenv("CUDA_VISIBLE_DEVICES", value, 1);
        load();
        if (want_count == 0) {
            CU(cuInit(0), CUDA_ERROR_NO_DEVICE);
            _exit(0);
        }
        OK(cuInit(0));
        int n;
        OK(cuDeviceGetCount(&n));
        CHECK(n == want_count);
        int bus;
        OK(cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0));
        CHECK(bus == want_node0);
        CU(cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, n),
           CUDA_ERROR_INVALID_DEVICE);
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        printf("FAIL CUDA_VISIBLE_DEVICES=%s\n", value ? value : "(unset)");
        exit(1);
    }
}

static void test_visible(void)
{
    cvd_case(NULL, 3, 0);
    cvd_case("2,0", 2, 2);
    cvd_case(" 1 ", 1, 1);
    cvd_case("GPU-1111", 1, 2);                 /* unique UUID prefix */
    cvd_case(UUID2, 1, 2);
    cvd_case("1,bogus,0", 1, 1);                /* stops at bad token */
    cvd_case("0,0,1", 0, 0);                    /* an index twice: none (driver 580) */
    cvd_case("GPU-1111,2", 1, 2);               /* a repeat by UUID stops there */
    cvd_case("GPU-6776a51d", 0, 0);             /* ambiguous prefix */
    cvd_case("", 0, 0);
    cvd_case("7", 0, 0);
}

/* ---- device queries ---------------------------------------------------- */

static void test_device(void)
{
    int n, v;
    char name[128];
    OK(cuDeviceGetCount(&n));
    CHECK(n == 3);
    OK(cuDeviceGetName(name, sizeof name, 0));
    CHECK(!strcmp(name, "Sim H100"));
    OK(cuDeviceGetName(name, sizeof name, 2));
    CHECK(!strcmp(name, "gpuvisor simulated GPU"));
    CUuuid u;
    OK(cuDeviceGetUuid_v2(&u, 2));
    CHECK((unsigned char)u.bytes[0] == 0x11 && (unsigned char)u.bytes[15] == 0x55);
    size_t tot;
    OK(cuDeviceTotalMem_v2(&tot, 0));
    CHECK(tot == 6 * GIB);
    unsigned t32;
    OK(cuDeviceTotalMem(&t32, 0));
    CHECK(t32 == 0xffffffffu);
    OK(cuDeviceTotalMem(&t32, 2));
    CHECK(t32 == 512 * MIB);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
    CHECK(v == 10);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 2));
    CHECK(v == 108);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0));
    CHECK(v == 9);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
    CHECK(v == 1);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 0));
    CHECK(v == 1);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 1));
    CHECK(v == 1);
    OK(cuDeviceGetPCIBusId(name, sizeof name, 1));
    CHECK(!strcmp(name, "0000:01:00.0"));
    CU(cuDeviceGetName(name, sizeof name, 3), CUDA_ERROR_INVALID_DEVICE);
    const char *s;
    OK(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &s));
    CHECK(!strcmp(s, "CUDA_ERROR_OUT_OF_MEMORY"));
    OK(cuGetErrorString(CUDA_ERROR_INVALID_VALUE, &s));
    CU(cuGetErrorName(12345, &s), CUDA_ERROR_INVALID_VALUE);
}

/* ---- contexts ------------------------------------------------------------ */

static void test_contexts(void)
{
    CUcontext c, cur, p1, p2;
    CUdeviceptr d;
    CU(cuMemAlloc_v2(&d, 1), CUDA_ERROR_INVALID_CONTEXT);
    size_t f, t;
    CU(cuMemGetInfo_v2(&f, &t), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuCtxCreate_v2(&c, 0, 0));
    OK(cuCtxGetCurrent(&cur));
    CHECK(cur == c);
    CHECK(free_mem() == 6 * GIB - 32 * MIB);    /* a context takes 32 MiB */
    CUdevice dev = -1;
    OK(cuCtxGetDevice(&dev));
    CHECK(dev == 0);
    /* a context on device 1 with an allocation: destroy frees both */
    CUcontext c1;
    CUctxCreateParams prm = {0};
    OK(cuCtxCreate_v4(&c1, &prm, 0, 1));
    OK(cuCtxGetDevice_v2(&dev, NULL));
    CHECK(dev == 1);
    OK(cuCtxGetDevice_v2(&dev, c));
    CHECK(dev == 0);
    OK(cuMemAlloc_v2(&d, 100 * MIB));
    CHECK(free_mem() == 6 * GIB - 32 * MIB - 100 * MIB);
    OK(cuCtxPopCurrent_v2(&cur));
    CHECK(cur == c1);
    OK(cuCtxPushCurrent_v2(c1));
    OK(cuCtxDestroy_v2(c1));
    OK(cuCtxGetCurrent(&cur));
    CHECK(cur == c);
    CU(cuCtxDestroy_v2(c1), CUDA_ERROR_INVALID_CONTEXT);
    CU(cuMemFree_v2(d), CUDA_ERROR_INVALID_VALUE);  /* freed with c1 */
    /* primary context on device 1: refcounted, charged once */
    OK(cuDevicePrimaryCtxRetain(&p1, 1));
    OK(cuDevicePrimaryCtxRetain(&p2, 1));
    CHECK(p1 == p2);
    unsigned fl;
    int act;
    OK(cuDevicePrimaryCtxGetState(1, &fl, &act));
    CHECK(act == 1);
    OK(cuCtxPushCurrent_v2(p1));
    CHECK(free_mem() == 6 * GIB - 32 * MIB);
    OK(cuCtxSynchronize());
    OK(cuDevicePrimaryCtxRelease_v2(1));
    OK(cuDevicePrimaryCtxRelease_v2(1));
    OK(cuDevicePrimaryCtxGetState(1, &fl, &act));
    CHECK(act == 0);
    CU(cuDevicePrimaryCtxRelease_v2(1), CUDA_ERROR_INVALID_CONTEXT);
    CU(cuCtxSynchronize(), CUDA_ERROR_CONTEXT_IS_DESTROYED);  /* p1 is gone */
    OK(cuCtxPopCurrent_v2(&cur));
    OK(cuDevicePrimaryCtxRetain(&p1, 1));
    OK(cuDevicePrimaryCtxReset_v2(1));
    OK(cuDevicePrimaryCtxGetState(1, &fl, &act));
    CHECK(act == 0);
    OK(cuCtxSynchronize_v2(c));
    OK(cuCtxSetCurrent(c));
}

/* ---- linear allocations ------------------------------------------------- */

static void test_alloc(void)
{
    size_t f0 = free_mem();
    CUdeviceptr a, b, base;
    size_t size;
    OK(cuMemAlloc_v2(&a, 1000));
    OK(cuMemAlloc_v2(&b, 1000));
    CHECK(a != b && a % 512 == 0 && b % 512 == 0);
    CHECK(free_mem() == f0 - 4 * MIB);          /* 2 MiB granularity */
    OK(cuMemGetAddressRange_v2(&base, &size, a + 10));
    CHECK(base == a && size >= 1000);
    OK(cuMemcpyHtoD_v2(a, &size, 8));
    CU(cuMemsetD8_v2(a, 0, 1 << 20), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFree_v2(a));
    CU(cuMemFree_v2(a), CUDA_ERROR_INVALID_VALUE);
    CU(cuMemFree_v2(12345), CUDA_ERROR_INVALID_VALUE);
    CU(cuMemAlloc_v2(&a, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFree_v2(b));
    CHECK(free_mem() == f0);

    CUdeviceptr_v1 lo;
    OK(cuMemAlloc(&lo, 3 * MIB));
    CHECK(lo != 0 && lo % 512 == 0);
    CHECK(free_mem() == f0 - 4 * MIB);
    OK(cuMemFree(lo));
    unsigned f32, t32;
    OK(cuMemGetInfo(&f32, &t32));
    CHECK(t32 == 0xffffffffu);

    size_t pitch;
    OK(cuMemAllocPitch_v2(&a, &pitch, 1000, 3000, 4));
    CHECK(pitch == 1024);
    CHECK(free_mem() == f0 - 4 * MIB);          /* 1024*3000 -> 4 MiB */
    OK(cuMemFree_v2(a));
    CU(cuMemAllocPitch_v2(&a, &pitch, 1000, 10, 3), CUDA_ERROR_INVALID_VALUE);
    /* Managed memory lives on the host until prefetched to the device,
     * as far as the device has room; a preferred location of the host
     * takes it back. */
    OK(cuMemAllocManaged(&a, 5 * MIB, CU_MEM_ATTACH_GLOBAL));
    CHECK(free_mem() == f0);
    OK(cuMemPrefetchAsync(a, 3 * MIB, 0, NULL));
    CHECK(free_mem() == f0 - 4 * MIB);          /* pages 0 and 1 of 2 MiB */
    OK(cuMemAdvise(a + 2 * MIB, 1, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_DEVICE_CPU));
    CHECK(free_mem() == f0 - 2 * MIB);
    OK(cuMemAdvise(a, 5 * MIB, CU_MEM_ADVISE_SET_ACCESSED_BY, 0));
    CU(cuMemAdvise(a, 6 * MIB + 1, CU_MEM_ADVISE_SET_ACCESSED_BY, 0), CUDA_ERROR_INVALID_VALUE);
    CU(cuMemPrefetchAsync(a, MIB, 7, NULL), CUDA_ERROR_INVALID_DEVICE);
    OK(cuMemFree_v2(a));
    CHECK(free_mem() == f0);
    CU(cuMemAllocManaged(&a, 5 * MIB, 0), CUDA_ERROR_INVALID_VALUE);

    void *h;
    OK(cuMemAllocHost_v2(&h, 10 * MIB));
    memset(h, 1, 10 * MIB);
    CHECK(free_mem() == f0);                    /* host memory */
    OK(cuMemFreeHost(h));
    CU(cuMemFreeHost(h), CUDA_ERROR_INVALID_VALUE);

    /* OOM at physical capacity */
    CU(cuMemAlloc_v2(&a, f0 + 1), CUDA_ERROR_OUT_OF_MEMORY);
    CUdeviceptr blk[8];
    int n = 0;
    while (n < 8 && cuMemAlloc_v2(&blk[n], GIB) == CUDA_SUCCESS)
        n++;
    CHECK(n == (int)(f0 / GIB));
    CHECK(free_mem() == f0 - n * GIB);
    OK(cuMemAlloc_v2(&a, f0 - n * GIB));        /* exactly fills it */
    CHECK(free_mem() == 0);
    CU(cuMemAlloc_v2(&b, 1), CUDA_ERROR_OUT_OF_MEMORY);
    CUcontext c;
    CU(cuCtxCreate_v2(&c, 0, 0), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuCtxGetCurrent(&c));
    OK(cuMemFree_v2(a));
    while (n--)
        OK(cuMemFree_v2(blk[n]));
    CHECK(free_mem() == f0);
}

/* ---- memory pools --------------------------------------------------------- */

static void test_pools(void)
{
    size_t f0 = free_mem();
    CUmemoryPool def, cur;
    OK(cuDeviceGetDefaultMemPool(&def, 0));
    OK(cuDeviceGetMemPool(&cur, 0));
    CHECK(def == cur);
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    CUcontext sc;
    OK(cuStreamGetCtx(s, &sc));
    OK(cuStreamQuery(s));
    CUdeviceptr a, b;
    OK(cuMemAllocAsync(&a, MIB, s));
    CHECK(pool_attr(def, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 2 * MIB);
    CHECK(pool_attr(def, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == MIB);
    OK(cuMemAllocAsync(&b, MIB, s));            /* fits in reserve */
    CHECK(pool_attr(def, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 2 * MIB);
    CHECK(free_mem() == f0 - 2 * MIB);
    OK(cuMemFreeAsync(a, s));
    OK(cuMemFreeAsync(b, s));
    CU(cuMemFreeAsync(b, s), CUDA_ERROR_INVALID_VALUE);
    CHECK(pool_attr(def, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == 0);
    CHECK(pool_attr(def, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 2 * MIB);
    CHECK(free_mem() == f0 - 2 * MIB);          /* free keeps reserve */
    OK(cuStreamSynchronize(s));
    CHECK(pool_attr(def, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 0);
    CHECK(pool_attr(def, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) == 2 * MIB);
    CHECK(free_mem() == f0);

    /* release threshold keeps memory across sync; trim gives it back */
    cuuint64_t thr = 4 * MIB;
    OK(cuMemPoolSetAttribute(def, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &thr));
    OK(cuMemAllocAsync(&a, 5 * MIB + 1, NULL));
    CHECK(pool_attr(def, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 6 * MIB);
    OK(cuMemFreeAsync(a, NULL));
    OK(cuCtxSynchronize());
    CHECK(pool_attr(def, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 4 * MIB);
    CHECK(free_mem() == f0 - 4 * MIB);
    OK(cuMemPoolTrimTo(def, 0));
    CHECK(pool_attr(def, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 0);
    thr = 0;
    OK(cuMemPoolSetAttribute(def, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &thr));
    CU(cuMemAllocAsync(&a, f0 + 1, s), CUDA_ERROR_OUT_OF_MEMORY);

    /* explicit pool */
    CUmemPoolProps pp;
    memset(&pp, 0, sizeof pp);
    pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    pp.location.id = 0;
    CUmemoryPool p;
    OK(cuMemPoolCreate(&p, &pp));
    OK(cuMemAllocFromPoolAsync(&a, 3 * MIB, p, s));
    CHECK(pool_attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 4 * MIB);
    OK(cuDeviceSetMemPool(0, p));
    OK(cuMemAllocAsync(&b, MIB, s));            /* from p's spare reserve */
    CHECK(pool_attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 4 * MIB);
    CHECK(free_mem() == f0 - 4 * MIB);
    OK(cuMemFree_v2(b));
    OK(cuMemPoolDestroy(p));                    /* a still outstanding */
    OK(cuDeviceGetMemPool(&cur, 0));
    CHECK(cur == def);
    OK(cuMemFreeAsync(a, s));
    CHECK(free_mem() == f0);
    CU(cuMemPoolDestroy(def), CUDA_ERROR_INVALID_VALUE);
    CU(cuMemPoolDestroy(p), CUDA_ERROR_INVALID_VALUE);

    /* host-located pool: host memory, no device's */
    pp.location.type = CU_MEM_LOCATION_TYPE_HOST;
    OK(cuMemPoolCreate(&p, &pp));
    OK(cuMemAllocFromPoolAsync(&a, 20 * GIB, p, s));
    CHECK(pool_attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 20 * GIB);
    CHECK(free_mem() == f0);
    CU(cuDeviceSetMemPool(0, p), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFreeAsync(a, s));
    OK(cuStreamSynchronize(s));
    CHECK(pool_attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 0);
    OK(cuMemPoolDestroy(p));
    pp.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT;
    CU(cuMemPoolCreate(&p, &pp), CUDA_ERROR_NOT_SUPPORTED);
    OK(cuStreamDestroy_v2(s));
    CU(cuStreamDestroy_v2(s), CUDA_ERROR_INVALID_HANDLE);
    CU(cuStreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE);
}

/* ---- virtual memory management -------------------------------------------- */

static void test_vmm(void)
{
    size_t f0 = free_mem(), g = 0;
    CUmemAllocationProp pr;
    memset(&pr, 0, sizeof pr);
    pr.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    pr.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    pr.location.id = 0;
    OK(cuMemGetAllocationGranularity(&g, &pr, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK(g == 2 * MIB);
    OK(cuMemGetAllocationGranularity(&g, &pr, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CHECK(g == 2 * MIB);
    CUmemGenericAllocationHandle h, hh;
    CU(cuMemCreate(&h, 3 * MIB, &pr, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemCreate(&h, 4 * MIB, &pr, 0));
    CHECK(free_mem() == f0 - 4 * MIB);
    CUmemAllocationProp got;
    OK(cuMemGetAllocationPropertiesFromHandle(&got, h));
    CHECK(got.location.id == 0);
    CUdeviceptr va, base;
    size_t size;
    OK(cuMemAddressReserve(&va, 8 * MIB, 0, 0, 0));
    CHECK(va % (2 * MIB) == 0);
    OK(cuMemMap(va, 4 * MIB, 0, h, 0));
    CU(cuMemMap(va, 4 * MIB, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    CUmemAccessDesc ad = {{CU_MEM_LOCATION_TYPE_DEVICE, 0},
                          CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    OK(cuMemSetAccess(va, 4 * MIB, &ad, 1));
    OK(cuMemGetAddressRange_v2(&base, &size, va + 100));
    CHECK(base == va && size == 4 * MIB);
    OK(cuMemRelease(h));                        /* still mapped: kept */
    CHECK(free_mem() == f0 - 4 * MIB);
    CU(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemUnmap(va, 4 * MIB));
    CHECK(free_mem() == f0);
    CU(cuMemUnmap(va, 4 * MIB), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemAddressFree(va, 8 * MIB));
    CU(cuMemAddressFree(va, 8 * MIB), CUDA_ERROR_INVALID_VALUE);
    pr.location.type = CU_MEM_LOCATION_TYPE_HOST;
    OK(cuMemCreate(&hh, 64 * MIB, &pr, 0));     /* host: not device memory */
    CHECK(free_mem() == f0);
    OK(cuMemRelease(hh));
    pr.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CU(cuMemCreate(&h, 8 * GIB, &pr, 0), CUDA_ERROR_OUT_OF_MEMORY);
}

/* ---- arrays ------------------------------------------------------------------ */

static void test_arrays(void)
{
    size_t f0 = free_mem();
    CUarray a;
    CUDA_ARRAY_DESCRIPTOR d = {1000, 3000, CU_AD_FORMAT_FLOAT, 1};
    OK(cuArrayCreate_v2(&a, &d));
    /* row 4000 B -> 4096 B; 4096 * 3000 = 11.7 MiB -> 12 MiB */
    CHECK(free_mem() == f0 - 12 * MIB);
    CUDA_ARRAY_MEMORY_REQUIREMENTS r;
    /* only deferred-mapping arrays answer (below) */
    CU(cuArrayGetMemoryRequirements(&r, a, 0), CUDA_ERROR_INVALID_VALUE);
    CUDA_ARRAY_DESCRIPTOR back;
    OK(cuArrayGetDescriptor_v2(&back, a));
    CHECK(back.Width == 1000 && back.Height == 3000 && back.NumChannels == 1);
    OK(cuArrayDestroy(a));
    CU(cuArrayDestroy(a), CUDA_ERROR_INVALID_HANDLE);
    CHECK(free_mem() == f0);
    d.NumChannels = 3;
    CU(cuArrayCreate_v2(&a, &d), CUDA_ERROR_INVALID_VALUE);
    CUDA_ARRAY3D_DESCRIPTOR d3 = {64, 64, 64, CU_AD_FORMAT_UNSIGNED_INT8, 4, 0};
    OK(cuArray3DCreate_v2(&a, &d3));            /* 512*64*64 = 2 MiB */
    CHECK(free_mem() == f0 - 2 * MIB);
    OK(cuArrayDestroy(a));
    /* deferred mapping and sparse: no memory until mapped; requirements
     * for the deferred one only */
    CUDA_ARRAY3D_DESCRIPTOR dd = {1000, 3000, 0, CU_AD_FORMAT_FLOAT, 1,
                                  CUDA_ARRAY3D_DEFERRED_MAPPING};
    OK(cuArray3DCreate_v2(&a, &dd));
    CHECK(free_mem() == f0);
    OK(cuArrayGetMemoryRequirements(&r, a, 0));
    CHECK(r.size == 12 * MIB && r.alignment == 512);
    OK(cuArrayDestroy(a));
    dd.Flags = CUDA_ARRAY3D_SPARSE;
    OK(cuArray3DCreate_v2(&a, &dd));
    CHECK(free_mem() == f0);
    CU(cuArrayGetMemoryRequirements(&r, a, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuArrayDestroy(a));
    CHECK(free_mem() == f0);
    /* mipmap 1024^2 float4: 16 MiB + 4 MiB + 1 MiB = 21 -> 22 MiB */
    CUDA_ARRAY3D_DESCRIPTOR dm = {1024, 1024, 0, CU_AD_FORMAT_FLOAT, 4, 0};
    CUmipmappedArray m;
    OK(cuMipmappedArrayCreate(&m, &dm, 3));
    CU(cuMipmappedArrayGetMemoryRequirements(&r, m, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(free_mem() == f0 - 22 * MIB);
    OK(cuMipmappedArrayDestroy(m));
    CHECK(free_mem() == f0);
    dm.Flags = CUDA_ARRAY3D_DEFERRED_MAPPING;
    OK(cuMipmappedArrayCreate(&m, &dm, 3));
    CHECK(free_mem() == f0);
    OK(cuMipmappedArrayGetMemoryRequirements(&r, m, 0));
    CHECK(r.size == 22 * MIB);
    OK(cuMipmappedArrayDestroy(m));
    CHECK(free_mem() == f0);
}

/* ---- cuGetProcAddress ----------------------------------------------------------- */

static void *pa(const char *name, int ver, cuuint64_t fl, CUresult want,
                CUdriverProcAddressQueryResult want_st)
{
    void *fn = (void *)1;
    CUdriverProcAddressQueryResult st = 99;
    CUresult rc = cuGetProcAddress_v2(name, &fn, ver, fl, &st);
    if (rc != want || st != want_st) {
        printf("FAIL cuGetProcAddress_v2(%s, %d, %llu) = %d/%d\n", name, ver,
               (unsigned long long)fl, rc, st);
        exit(1);
    }
    return fn;
}

static void test_procaddr(void)
{
    const int S = CU_GET_PROC_ADDRESS_SUCCESS;
    CHECK(pa("cuMemAlloc", 3010, 0, 0, S) == sym("cuMemAlloc"));
    CHECK(pa("cuMemAlloc", 3020, 0, 0, S) == sym("cuMemAlloc_v2"));
    CHECK(pa("cuMemGetInfo", 12000, 0, 0, S) == sym("cuMemGetInfo_v2"));
    CHECK(pa("cuCtxCreate", 3000, 0, 0, S) == sym("cuCtxCreate"));
    CHECK(pa("cuCtxCreate", 11040, 0, 0, S) == sym("cuCtxCreate_v3"));
    CHECK(pa("cuCtxCreate", 12050, 0, 0, S) == sym("cuCtxCreate_v4"));
    CHECK(pa("cuCtxCreate", 13000, 0, 0, S) == sym("cuCtxCreate_v4"));
    CHECK(pa("cuCtxDestroy", 3020, 0, 0, S) == sym("cuCtxDestroy"));
    CHECK(pa("cuCtxDestroy", 4000, 0, 0, S) == sym("cuCtxDestroy_v2"));
    CHECK(pa("cuDevicePrimaryCtxRelease", 11000, 0, 0, S) ==
          sym("cuDevicePrimaryCtxRelease_v2"));
    CHECK(pa("cuDeviceGetUuid", 11030, 0, 0, S) == sym("cuDeviceGetUuid"));
    CHECK(pa("cuDeviceGetUuid", 11040, 0, 0, S) == sym("cuDeviceGetUuid_v2"));
    CHECK(pa("cuGetProcAddress", 12000, 0, 0, S) == sym("cuGetProcAddress_v2"));
    CHECK(pa("cuCtxSynchronize", 12080, 0, 0, S) == sym("cuCtxSynchronize"));
    CHECK(pa("cuCtxSynchronize", 13000, 0, 0, S) == sym("cuCtxSynchronize_v2"));
    CHECK(pa("cuCtxGetDevice", 13000, 0, 0, S) == sym("cuCtxGetDevice_v2"));
    CHECK(pa("cuStreamGetCtx", 12050, 0, 0, S) == sym("cuStreamGetCtx_v2"));
    CHECK(pa("cuStreamGetCtx", 12000, 2, 0, S) == sym("cuStreamGetCtx_ptsz"));
    CHECK(pa("cuMemAllocAsync", 12000, 0, 0, S) == sym("cuMemAllocAsync"));
    CHECK(pa("cuMemAllocAsync", 12000, 1, 0, S) == sym("cuMemAllocAsync"));
    CHECK(pa("cuMemAllocAsync", 12000, 2, 0, S) == sym("cuMemAllocAsync_ptsz"));
    CHECK(pa("cuMemFreeAsync", 12000, 2, 0, S) == sym("cuMemFreeAsync_ptsz"));
    CHECK(pa("cuStreamSynchronize", 12000, 2, 0, S) ==
          sym("cuStreamSynchronize_ptsz"));
    CHECK(pa("cuMemAlloc", 12000, 2, 0, S) == sym("cuMemAlloc_v2"));
    const int NS = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    CHECK(pa("cuMemCreate", 10010, 0, CUDA_ERROR_NOT_FOUND, NS) == NULL);
    CHECK(pa("cuMemCreate", 10020, 0, 0, S) == sym("cuMemCreate"));
    CHECK(pa("cuMemAllocAsync", 11010, 0, CUDA_ERROR_NOT_FOUND, NS) == NULL);
    CHECK(pa("cuArrayGetMemoryRequirements", 11050, 0, CUDA_ERROR_NOT_FOUND,
             NS) == NULL);
    const int NF = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CHECK(pa("cuNoSuchFunction", 13000, 0, CUDA_ERROR_NOT_FOUND, NF) == NULL);
    CHECK(pa("cuMemAlloc_v2", 13000, 0, CUDA_ERROR_NOT_FOUND, NF) == NULL);
    void *fn = NULL;
    OK(cuGetProcAddress("cuInit", &fn, 13000, 0));
    CHECK(fn == sym("cuInit"));
    OK(cuGetProcAddress_v2("cuInit", &fn, 13000, 0, NULL));
    CU(cuGetProcAddress_v2(NULL, &fn, 13000, 0, NULL), CUDA_ERROR_INVALID_VALUE);
    CU(cuGetProcAddress_v2("cuInit", &fn, 13000, 8, NULL),
       CUDA_ERROR_INVALID_VALUE);
    /* every base name resolves at the newest version, with both flags */
    static const char *all[] = {
        "cuInit", "cuDriverGetVersion", "cuGetProcAddress", "cuGetErrorName",
        "cuGetErrorString", "cuDeviceGet", "cuDeviceGetCount",
        "cuDeviceGetName", "cuDeviceGetUuid", "cuDeviceTotalMem",
        "cuDeviceGetAttribute", "cuDeviceGetPCIBusId",
        "cuDeviceGetDefaultMemPool", "cuDeviceGetMemPool",
        "cuDeviceSetMemPool", "cuCtxCreate", "cuCtxDestroy",
        "cuCtxGetCurrent", "cuCtxSetCurrent", "cuCtxPushCurrent",
        "cuCtxPopCurrent", "cuCtxGetDevice", "cuCtxSynchronize",
        "cuCtxGetApiVersion", "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxReset",
        "cuDevicePrimaryCtxGetState", "cuDevicePrimaryCtxSetFlags",
        "cuMemGetInfo", "cuMemAlloc", "cuMemAllocPitch", "cuMemAllocManaged",
        "cuMemAdvise", "cuMemPrefetchAsync",
        "cuMemFree", "cuMemAllocHost", "cuMemFreeHost",
        "cuMemGetAddressRange", "cuMemcpyHtoD", "cuMemcpyDtoH", "cuMemsetD8",
        "cuArrayCreate", "cuArray3DCreate", "cuArrayDestroy",
        "cuArrayGetDescriptor", "cuArrayGetMemoryRequirements",
        "cuMipmappedArrayCreate", "cuMipmappedArrayDestroy",
        "cuMipmappedArrayGetMemoryRequirements", "cuMemCreate",
        "cuMemRelease", "cuMemAddressReserve", "cuMemAddressFree", "cuMemMap",
        "cuMemUnmap", "cuMemSetAccess", "cuMemGetAllocationGranularity",
        "cuMemGetAllocationPropertiesFromHandle", "cuMemAllocAsync",
        "cuMemAllocFromPoolAsync", "cuMemFreeAsync", "cuMemPoolCreate",
        "cuMemPoolDestroy", "cuMemPoolTrimTo", "cuMemPoolSetAttribute",
        "cuMemPoolGetAttribute", "cuStreamCreate",
        "cuStreamCreateWithPriority", "cuStreamDestroy",
        "cuStreamSynchronize", "cuStreamQuery", "cuStreamGetCtx", NULL};
    for (int i = 0; all[i]; i++)
        for (int fl = 0; fl <= 2; fl++)
            CHECK(pa(all[i], 13000, (cuuint64_t)fl, 0, S) != NULL);
}

int main(int argc, char **argv)
{
    sim_test_lib(argc, argv);
    sim_test_state("sim-basic");
    char spec[256];
    snprintf(spec, sizeof spec, "2x6g:sms=10:name=Sim H100,512m:uuid=%s",
             UUID2);
    setenv("GPUVISOR_SIM_DEVICES", spec, 1);
    unsetenv("CUDA_VISIBLE_DEVICES");
    unsetenv("GPUVISOR_SIM_FAIL_ALLOC_AT");
    unsetenv("GPUVISOR_SIM_FAIL_ALLOC_EVERY");

    test_visible();
    load();
    int v = 0;
    OK(cuDriverGetVersion(&v));
    CHECK(v == 13000);
    int n;
    CU(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    CU(cuInit(1), CUDA_ERROR_INVALID_VALUE);
    OK(cuInit(0));
    test_device();
    test_procaddr();
    test_contexts();
    test_alloc();
    test_pools();
    test_vmm();
    test_arrays();
    printf("OK\n");
    return 0;
}
