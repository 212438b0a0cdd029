/*
 * real.h - the real driver libraries behind the hooks.
 *
 * The interposer never links against libcuda or libnvidia-ml.  It opens
 * them at run time (GPUVISOR_REAL_LIBCUDA / GPUVISOR_REAL_LIBNVML, default
 * the sonames) and resolves each real entry point once, lazily, with the
 * real dlsym.  Every resolved pointer is cached in an atomic slot, so the
 * fast path is one relaxed load.
 */
#ifndef GV_REAL_H
#define GV_REAL_H

#include <stdatomic.h>
#include "gv_cuda.h"

#ifndef GV_EXPORT
#define GV_EXPORT __attribute__((visibility("default")))
#endif

/* For code that may run before a sanitizer runtime has initialised: the
 * sanitizers' own start-up calls dlsym(RTLD_NEXT, ...), which is ours. */
#define GV_NO_SANITIZE __attribute__((no_sanitize_address, no_sanitize_undefined, no_sanitize_thread))

/* Real CUDA entry points the library calls. */
#define GV_CUDA_SYMS(X) \
    X(cuInit) X(cuGetProcAddress) X(cuGetProcAddress_v2) \
    X(cuDeviceGetCount) X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2) \
    X(cuDeviceTotalMem) X(cuDeviceTotalMem_v2) X(cuDeviceGetAttribute) \
    X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxGetDevice) \
    X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) X(cuStreamGetCtx) \
    X(cuMemGetInfo) X(cuMemGetInfo_v2) \
    X(cuMemAlloc) X(cuMemAlloc_v2) X(cuMemAllocPitch) X(cuMemAllocPitch_v2) \
    X(cuMemAllocManaged) X(cuMemFree) X(cuMemFree_v2) X(cuMemAdvise) X(cuMemPrefetchAsync) \
    X(cuMemGetAllocationGranularity) \
    X(cuArrayCreate) X(cuArrayCreate_v2) X(cuArray3DCreate) X(cuArray3DCreate_v2) \
    X(cuArrayDestroy) X(cuArrayGetMemoryRequirements) \
    X(cuMipmappedArrayCreate) X(cuMipmappedArrayDestroy) \
    X(cuMipmappedArrayGetMemoryRequirements) \
    X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemAddressFree) \
    X(cuMemRetainAllocationHandle) \
    X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) \
    X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) \
    X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) \
    X(cuMemPoolCreate) X(cuMemPoolDestroy) X(cuMemPoolTrimTo) \
    X(cuMemPoolGetAttribute) X(cuDeviceGetMemPool) X(cuDeviceGetDefaultMemPool) \
    X(cuCtxCreate) X(cuCtxCreate_v2) X(cuCtxCreate_v3) X(cuCtxCreate_v4) \
    X(cuCtxDestroy) X(cuCtxDestroy_v2) X(cuCtxSetLimit) X(cuCtxGetLimit) \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) \
    X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxReset) \
    X(cuDevicePrimaryCtxReset_v2) \
    X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz) \
    X(cuLaunch) X(cuLaunchGrid) X(cuLaunchGridAsync) X(cuLaunchCooperativeKernelMultiDevice) \
    X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz) \
    X(cuGraphLaunch) X(cuGraphLaunch_ptsz) X(cuGraphUpload) X(cuGraphUpload_ptsz) \
    X(cuGraphInstantiate) X(cuGraphInstantiate_v2) X(cuGraphInstantiateWithFlags) \
    X(cuGraphInstantiateWithParams) X(cuGraphInstantiateWithParams_ptsz) \
    X(cuGraphExecDestroy) X(cuGraphGetNodes) X(cuGraphNodeGetType) X(cuGraphChildGraphNodeGetGraph) \
    X(cuGraphMemAllocNodeGetParams) X(cuGraphMemFreeNodeGetParams) X(cuDeviceGraphMemTrim) X(cuDeviceGetGraphMemAttribute) \
    X(cuEventCreate) X(cuEventDestroy_v2) X(cuEventRecord) X(cuEventRecord_ptsz) \
    X(cuEventQuery) X(cuEventElapsedTime) X(cuEventElapsedTime_v2) \
    X(cuStreamIsCapturing) X(cuStreamIsCapturing_ptsz) X(cuThreadExchangeStreamCaptureMode) \
    X(cuStreamBeginCapture) X(cuStreamBeginCapture_ptsz) X(cuStreamBeginCapture_v2) \
    X(cuStreamBeginCapture_v2_ptsz) X(cuStreamBeginCaptureToGraph) \
    X(cuStreamBeginCaptureToGraph_ptsz) X(cuStreamEndCapture) X(cuStreamEndCapture_ptsz) \
    X(cuStreamSynchronize) X(cuStreamSynchronize_ptsz) X(cuCtxSynchronize) \
    X(cuCtxSynchronize_v2) X(cuEventSynchronize) X(cuStreamQuery) X(cuStreamQuery_ptsz) \
    X(cuStreamDestroy) X(cuStreamDestroy_v2)

/* Real NVML entry points the library calls. */
#define GV_NVML_SYMS(X) \
    X(nvmlInit_v2) X(nvmlDeviceGetHandleByUUID) X(nvmlDeviceGetUUID) \
    X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2) \
    X(nvmlDeviceGetComputeRunningProcesses_v3) X(nvmlDeviceGetCount_v2) \
    X(nvmlDeviceGetHandleByIndex_v2) X(nvmlDeviceGetUtilizationRates) \
    X(nvmlDeviceGetProcessUtilization) X(nvmlShutdown)

#define GV_ENUM_ITEM(name) GV_SYM_##name,
enum gv_sym {
    GV_CUDA_SYMS(GV_ENUM_ITEM)
    GV_SYM_CUDA_END,
    GV_NVML_SYMS(GV_ENUM_ITEM)
    GV_SYM_COUNT
};
#undef GV_ENUM_ITEM

/* Resolve a real entry point (NULL when the driver lacks it). */
void *gv_real_sym(enum gv_sym id);
/* Record a pointer learned from the real cuGetProcAddress for a symbol the
 * library could not dlsym (drivers need not export every variant). */
void gv_real_learn(enum gv_sym id, void *fn);
/* Name of a symbol id. */
const char *gv_real_name(enum gv_sym id);
/* Find the id of a real symbol name, or -1. */
int gv_real_find(const char *name);

/* Handles of the real libraries (NULL if they cannot be opened). */
void *gv_real_cuda_handle(void);
void *gv_real_nvml_handle(void);

/* The C library's dlsym, bypassing the library's own override. */
GV_NO_SANITIZE void *gv_real_dlsym(void *handle, const char *name);
typedef void *(*gv_dlsym_fn)(void *, const char *);
GV_NO_SANITIZE gv_dlsym_fn gv_libc_dlsym(void);

/* Call a real entry point with its type spelled at the call site:
 *   GV_REAL(cuMemAlloc_v2, CUresult (*)(CUdeviceptr *, size_t))(p, n)
 * A missing entry point yields a stand-in that returns CUDA_ERROR_NOT_FOUND. */
#define GV_REAL(name, type) ((type)gv_real_fast(GV_SYM_##name))
void *gv_real_or_missing(enum gv_sym id);

/* Resolved entry points (real.c); the inline check keeps a hook's fast
 * path free of calls once its entry point is known. */
extern _Atomic(void *) gv_sym_cache[GV_SYM_COUNT];

static inline void *gv_real_fast(enum gv_sym id)
{
    void *fn = atomic_load_explicit(&gv_sym_cache[id], memory_order_acquire);
    return __builtin_expect(fn != NULL, 1) ? fn : gv_real_or_missing(id);
}

/* The library's own event queries and waits, made from a program's
 * threads: CUDA forbids such "potentially unsafe" calls to a thread in the
 * default GLOBAL interaction mode while another thread captures a graph in
 * GLOBAL mode (as torch.cuda.graph does), and the forbidden call
 * invalidates that capture.  Made in RELAXED mode, they are always
 * allowed (the events are never recorded in a capture), and the thread's
 * mode is put back after.  Returns whether there is a mode to put back. */
static inline int gv_capture_relax(CUstreamCaptureMode *saved)
{
    *saved = CU_STREAM_CAPTURE_MODE_RELAXED;
    return GV_REAL(cuThreadExchangeStreamCaptureMode, CUresult (*)(CUstreamCaptureMode *))(saved) ==
           CUDA_SUCCESS;
}

static inline void gv_capture_restore(int relaxed, CUstreamCaptureMode saved)
{
    if (relaxed)
        GV_REAL(cuThreadExchangeStreamCaptureMode, CUresult (*)(CUstreamCaptureMode *))(&saved);
}

#endif /* GV_REAL_H */
