/*
 * cuda_protos.h - prototypes of the driver and NVML entry points the C
 * test programs call directly (our own declarations, over gv_cuda.h).
 */
#ifndef GV_TEST_CUDA_PROTOS_H
#define GV_TEST_CUDA_PROTOS_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "gv_cuda.h"

#define MiB (1ULL << 20)

/* Region device 0's usage as the interposer counts it, in MiB
 * (gv_device_get_used, found at run time: it settles nothing itself);
 * UINT64_MAX without the interposer. */
static inline uint64_t gv_test_used_mib(void)
{
    int (*get)(int, uint64_t *) = (int (*)(int, uint64_t *))dlsym(RTLD_DEFAULT,
                                                                  "gv_device_get_used");
    uint64_t v = 0;
    if (!get || get(0, &v) != 0)
        return UINT64_MAX;
    return v / MiB;
}

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDeviceGetCount(int *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned int);
CUresult cuMemAdvise(CUdeviceptr, size_t, CUmem_advise, CUdevice);
CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
/* Launching: contexts, modules, streams, kernels and graphs. */
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamSynchronize_ptsz(CUstream);
CUresult cuStreamQuery(CUstream);
CUresult cuCtxSynchronize(void);
CUresult cuEventCreate(CUevent *, unsigned int);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventSynchronize(CUevent);
CUresult cuEventQuery(CUevent);
CUresult cuMemPoolCreate(CUmemoryPool *, const CUmemPoolProps *);
CUresult cuMemPoolSetAttribute(CUmemoryPool, CUmemPool_attribute, void *);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuGraphCreate(CUgraph *, unsigned int);
CUresult cuGraphAddKernelNode_v2(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                                 const CUDA_KERNEL_NODE_PARAMS *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int, nvmlDevice_t *);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);

static int gv_test_failures __attribute__((unused));

#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);   \
            fprintf(stderr, __VA_ARGS__);                                     \
            fputc('\n', stderr);                                              \
            gv_test_failures++;                                               \
        }                                                                     \
    } while (0)

#define CHECK_CU(call)                                                        \
    do {                                                                      \
        CUresult rc_ = (call);                                                \
        CHECK(rc_ == CUDA_SUCCESS, "%s returned %d", #call, rc_);             \
    } while (0)

/* cuInit, then the primary context of device ordinal made current (its
 * handle in *ctx, when ctx is not NULL): as most programs start.  The first
 * result that is not CUDA_SUCCESS, else CUDA_SUCCESS. */
static inline CUresult gv_test_primary_ctx(int ordinal, CUcontext *ctx)
{
    CUdevice d;
    CUcontext c;
    CUresult rc;
    if ((rc = cuInit(0)) || (rc = cuDeviceGet(&d, ordinal)) ||
        (rc = cuDevicePrimaryCtxRetain(&c, d)) || (rc = cuCtxSetCurrent(c)))
        return rc;
    if (ctx)
        *ctx = c;
    return CUDA_SUCCESS;
}

/* The properties of a pool of device ordinal's memory (cuMemPoolCreate). */
static inline CUmemPoolProps gv_test_device_pool_props(int ordinal)
{
    CUmemPoolProps props = {0};
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = ordinal;
    return props;
}

#endif
