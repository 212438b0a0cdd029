/*
 * cuda_procaddr.c - cuGetProcAddress / cuGetProcAddress_v2.
 *
 * The table maps a base name to the CUDA version that introduced it and
 * to its ABI variants: the variant with the highest min-version not above
 * the caller's cudaVersion wins; with CU_GET_PROC_ADDRESS_PER_THREAD_
 * DEFAULT_STREAM the variant's per-thread (_ptsz/_ptds) symbol is used
 * where one exists.  Symbols are resolved with dlsym on this library's own
 * handle, never RTLD_DEFAULT, so an LD_PRELOAD interposer can't be handed
 * its own wrappers back.
 */
#include <dlfcn.h>
#include <string.h>

#include "sim.h"

typedef struct { int minver; const char *sym, *pt; } pa_var;
typedef struct { const char *name; int intro; pa_var v[4]; } pa_ent;

#define ONE(n, ver) {n, ver, {{ver, n, NULL}}}
#define ONEPT(n, ver, pt) {n, ver, {{ver, n, pt}}}
#define V2(n, ver, v2ver) {n, ver, {{ver, n, NULL}, {v2ver, n "_v2", NULL}}}

static const pa_ent g_tab[] = {
    ONE("cuInit", 2000),
    ONE("cuDriverGetVersion", 2020),
    V2("cuGetProcAddress", 11030, 12000),
    ONE("cuGetErrorName", 6000),
    ONE("cuGetErrorString", 6000),
    ONE("cuDeviceGet", 2000),
    ONE("cuDeviceGetCount", 2000),
    ONE("cuDeviceGetName", 2000),
    V2("cuDeviceGetUuid", 9020, 11040),
    V2("cuDeviceTotalMem", 2000, 3020),
    ONE("cuDeviceGetAttribute", 2000),
    ONE("cuDeviceGetPCIBusId", 4010),
    ONE("cuDeviceGetDefaultMemPool", 11020),
    ONE("cuDeviceGetMemPool", 11020),
    ONE("cuDeviceSetMemPool", 11020),
    {"cuCtxCreate", 2000, {{2000, "cuCtxCreate", NULL},
                           {3020, "cuCtxCreate_v2", NULL},
                           {11040, "cuCtxCreate_v3", NULL},
                           {12050, "cuCtxCreate_v4", NULL}}},
    V2("cuCtxDestroy", 2000, 4000),
    ONE("cuCtxGetCurrent", 4000),
    ONE("cuCtxSetCurrent", 4000),
    V2("cuCtxPushCurrent", 2000, 4000),
    V2("cuCtxPopCurrent", 2000, 4000),
    V2("cuCtxGetDevice", 2000, 13000),
    V2("cuCtxSynchronize", 2000, 13000),
    ONE("cuCtxGetApiVersion", 3020),
    ONE("cuCtxSetLimit", 3010),
    ONE("cuCtxGetLimit", 3010),
    ONE("cuDevicePrimaryCtxRetain", 7000),
    V2("cuDevicePrimaryCtxRelease", 7000, 11000),
    V2("cuDevicePrimaryCtxReset", 7000, 11000),
    ONE("cuDevicePrimaryCtxGetState", 7000),
    V2("cuDevicePrimaryCtxSetFlags", 7000, 11000),
    V2("cuMemGetInfo", 2000, 3020),
    V2("cuMemAlloc", 2000, 3020),
    V2("cuMemAllocPitch", 2000, 3020),
    ONE("cuMemAllocManaged", 6000),
    V2("cuMemAdvise", 8000, 12020),
    V2("cuMemPrefetchAsync", 8000, 12020),
    V2("cuMemFree", 2000, 3020),
    V2("cuMemAllocHost", 2000, 3020),
    ONE("cuMemFreeHost", 2000),
    ONE("cuMemHostAlloc", 2020),
    V2("cuMemHostGetDevicePointer", 2020, 3020),
    V2("cuMemHostRegister", 4000, 6050),
    ONE("cuMemHostUnregister", 4000),
    V2("cuMemGetAddressRange", 2000, 3020),
    {"cuMemcpyHtoD", 2000, {{2000, "cuMemcpyHtoD", NULL},
                            {3020, "cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2_ptds"}}},
    {"cuMemcpyDtoH", 2000, {{2000, "cuMemcpyDtoH", NULL},
                            {3020, "cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2_ptds"}}},
    {"cuMemsetD8", 2000, {{2000, "cuMemsetD8", NULL},
                          {3020, "cuMemsetD8_v2", "cuMemsetD8_v2_ptds"}}},
    V2("cuArrayCreate", 2000, 3020),
    V2("cuArray3DCreate", 2000, 3020),
    ONE("cuArrayDestroy", 2000),
    V2("cuArrayGetDescriptor", 2000, 3020),
    ONE("cuArrayGetMemoryRequirements", 11060),
    ONE("cuMipmappedArrayCreate", 5000),
    ONE("cuMipmappedArrayDestroy", 5000),
    ONE("cuMipmappedArrayGetMemoryRequirements", 11060),
    ONE("cuMemCreate", 10020),
    ONE("cuMemRelease", 10020),
    ONE("cuMemAddressReserve", 10020),
    ONE("cuMemAddressFree", 10020),
    ONE("cuMemRetainAllocationHandle", 11000),
    ONE("cuMemMap", 10020),
    ONE("cuMemUnmap", 10020),
    ONE("cuMemSetAccess", 10020),
    ONE("cuMemGetAllocationGranularity", 10020),
    ONE("cuMemGetAllocationPropertiesFromHandle", 10020),
    ONEPT("cuMemAllocAsync", 11020, "cuMemAllocAsync_ptsz"),
    ONEPT("cuMemAllocFromPoolAsync", 11020, "cuMemAllocFromPoolAsync_ptsz"),
    ONEPT("cuMemFreeAsync", 11020, "cuMemFreeAsync_ptsz"),
    ONE("cuMemPoolCreate", 11020),
    ONE("cuMemPoolDestroy", 11020),
    ONE("cuMemPoolTrimTo", 11020),
    ONE("cuMemPoolSetAttribute", 11020),
    ONE("cuMemPoolGetAttribute", 11020),
    ONE("cuStreamCreate", 2000),
    ONE("cuStreamCreateWithPriority", 5050),
    V2("cuStreamDestroy", 2000, 4000),
    ONEPT("cuStreamSynchronize", 2000, "cuStreamSynchronize_ptsz"),
    ONEPT("cuStreamQuery", 2000, "cuStreamQuery_ptsz"),
    {"cuStreamGetCtx", 9020, {{9020, "cuStreamGetCtx", "cuStreamGetCtx_ptsz"},
                              {12050, "cuStreamGetCtx_v2",
                               "cuStreamGetCtx_v2_ptsz"}}},
    ONEPT("cuStreamGetFlags", 5050, "cuStreamGetFlags_ptsz"),
    ONEPT("cuStreamGetPriority", 5050, "cuStreamGetPriority_ptsz"),
    ONE("cuCtxGetStreamPriorityRange", 5050),
    ONEPT("cuStreamWaitEvent", 3020, "cuStreamWaitEvent_ptsz"),
    /* modules, libraries, functions */
    ONE("cuModuleLoad", 2000),
    ONE("cuModuleLoadData", 2000),
    ONE("cuModuleLoadDataEx", 2010),
    ONE("cuModuleLoadFatBinary", 2000),
    ONE("cuModuleUnload", 2000),
    ONE("cuModuleGetFunction", 2000),
    ONE("cuFuncGetName", 12030),
    ONE("cuFuncGetModule", 11000),
    ONE("cuLibraryLoadData", 12000),
    ONE("cuLibraryUnload", 12000),
    ONE("cuLibraryGetKernel", 12000),
    ONE("cuLibraryGetModule", 12000),
    ONE("cuKernelGetFunction", 12000),
    ONE("cuKernelGetName", 12030),
    /* launches */
    ONEPT("cuLaunchKernel", 4000, "cuLaunchKernel_ptsz"),
    ONEPT("cuLaunchKernelEx", 11060, "cuLaunchKernelEx_ptsz"),
    ONEPT("cuLaunchCooperativeKernel", 9000, "cuLaunchCooperativeKernel_ptsz"),
    ONE("cuLaunch", 2000),
    ONE("cuLaunchGrid", 2000),
    ONE("cuLaunchGridAsync", 2000),
    ONE("cuFuncSetBlockShape", 2000),
    ONE("cuParamSetSize", 2000),
    ONE("cuParamSeti", 2000),
    ONE("cuParamSetv", 2000),
    /* events */
    ONE("cuEventCreate", 2000),
    V2("cuEventDestroy", 2000, 4000),
    ONEPT("cuEventRecord", 2000, "cuEventRecord_ptsz"),
    ONEPT("cuEventRecordWithFlags", 11010, "cuEventRecordWithFlags_ptsz"),
    ONE("cuEventQuery", 2000),
    ONE("cuEventSynchronize", 2000),
    V2("cuEventElapsedTime", 2000, 12080),
    /* graphs and capture */
    ONE("cuGraphCreate", 10000),
    ONE("cuGraphDestroy", 10000),
    V2("cuGraphAddKernelNode", 10000, 12000),
    ONE("cuGraphAddEmptyNode", 10000),
    ONE("cuGraphAddChildGraphNode", 10000),
    ONE("cuGraphChildGraphNodeGetGraph", 10000),
    V2("cuGraphAddNode", 12020, 12030),
    V2("cuGraphAddDependencies", 10000, 12030),
    ONE("cuGraphAddMemAllocNode", 11040),
    ONE("cuGraphAddMemFreeNode", 11040),
    ONE("cuGraphMemAllocNodeGetParams", 11040),
    ONE("cuGraphMemFreeNodeGetParams", 11040),
    ONE("cuDeviceGetGraphMemAttribute", 11040),
    ONE("cuDeviceSetGraphMemAttribute", 11040),
    ONE("cuDeviceGraphMemTrim", 11040),
    ONE("cuGraphGetNodes", 10000),
    ONE("cuGraphNodeGetType", 10000),
    {"cuGraphInstantiate", 10000, {{10000, "cuGraphInstantiate", NULL},
                                   {11000, "cuGraphInstantiate_v2", NULL},
                                   {12000, "cuGraphInstantiateWithFlags",
                                    NULL}}},
    ONE("cuGraphInstantiateWithFlags", 11040),
    ONEPT("cuGraphInstantiateWithParams", 12000, "cuGraphInstantiateWithParams_ptsz"),
    ONE("cuGraphExecDestroy", 10000),
    ONEPT("cuGraphLaunch", 10000, "cuGraphLaunch_ptsz"),
    ONEPT("cuGraphUpload", 11010, "cuGraphUpload_ptsz"),
    {"cuStreamBeginCapture", 10000,
     {{10000, "cuStreamBeginCapture", "cuStreamBeginCapture_ptsz"},
      {10010, "cuStreamBeginCapture_v2", "cuStreamBeginCapture_v2_ptsz"}}},
    ONEPT("cuStreamEndCapture", 10000, "cuStreamEndCapture_ptsz"),
    ONEPT("cuStreamIsCapturing", 10000, "cuStreamIsCapturing_ptsz"),
    ONE("cuThreadExchangeStreamCaptureMode", 10010),
};

static void *self_handle(void)
{
    static void *h;
    void *cur = __atomic_load_n(&h, __ATOMIC_ACQUIRE);
    if (cur)
        return cur;
    Dl_info info;
    if (!dladdr((void *)&g_tab, &info) || !info.dli_fname)
        return NULL;
    cur = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (cur)
        __atomic_store_n(&h, cur, __ATOMIC_RELEASE);
    return cur;
}

SIM_API CUresult cuGetProcAddress_v2(const char *name, void **pfn, int ver,
                                     cuuint64_t flags,
                                     CUdriverProcAddressQueryResult *st)
{
    if (!name || !pfn || (flags & ~(cuuint64_t)3) || flags == 3)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    const pa_ent *e = NULL;
    for (size_t i = 0; i < sizeof g_tab / sizeof g_tab[0]; i++)
        if (!strcmp(g_tab[i].name, name)) {
            e = &g_tab[i];
            break;
        }
    if (!e || ver < e->intro) {
        if (st)
            *st = e ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                    : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    const pa_var *best = &e->v[0];
    for (int i = 1; i < 4 && e->v[i].sym; i++)
        if (e->v[i].minver <= ver)
            best = &e->v[i];
    const char *sym = best->sym;
    if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best->pt)
        sym = best->pt;
    void *h = self_handle();
    void *f = h ? dlsym(h, sym) : NULL;
    if (!f) {
        if (st)
            *st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = f;
    if (st)
        *st = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuGetProcAddress(const char *name, void **pfn, int ver,
                                  cuuint64_t flags)
{
    return cuGetProcAddress_v2(name, pfn, ver, flags, NULL);
}
