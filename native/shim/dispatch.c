/*
 * dispatch.c - how callers reach the hooks.
 *
 *  1. Exported symbols: programs linked with -lcuda / -lnvidia-ml bind to
 *     the hooks because LD_PRELOAD puts this library first.
 *  2. dlsym: clients that dlopen the driver and look names up on that
 *     handle (nvidia-ml-py, cuda-python, nvidia-smi) get the hooks from
 *     this library's dlsym, which wraps the C library's.
 *  3. cuGetProcAddress(_v2): the CUDA runtime and cuda-python ask the
 *     driver for entry points by base name and ABI version.  The real
 *     driver answers; if its answer is an entry point we hook, the caller
 *     gets our hook for exactly that ABI variant.
 */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "hooks.h"
#include "log.h"

GV_NO_SANITIZE void *gv_dlsym_default(void *handle, const char *name);

/* ---- the hook table -------------------------------------------------- */

static gv_hook *table;
static size_t table_len;
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static int by_name(const void *a, const void *b)
{
    return strcmp(((const gv_hook *)a)->name, ((const gv_hook *)b)->name);
}

static void table_build(void)
{
    const gv_hook *families[] = { gv_hooks_memory, gv_hooks_array, gv_hooks_vmm, gv_hooks_pool,
                                  gv_hooks_context, gv_hooks_info, gv_hooks_nvml,
                                  gv_hooks_procaddr, gv_hooks_launch, gv_hooks_graph,
                                  gv_hooks_untracked, gv_hooks_sync, gv_hooks_capture };
    size_t n = 0;
    for (size_t f = 0; f < sizeof families / sizeof *families; f++)
        for (const gv_hook *h = families[f]; h->name; h++)
            n++;
    table = calloc(n, sizeof *table);
    if (!table)
        return;
    for (size_t f = 0; f < sizeof families / sizeof *families; f++)
        for (const gv_hook *h = families[f]; h->name; h++)
            table[table_len++] = *h;
    qsort(table, table_len, sizeof *table, by_name);
}

GV_NO_SANITIZE void *gv_hook_for(const char *name)
{
    /* Plain character tests: this runs for every dlsym in the process,
     * sanitizer start-up included, where string interceptors are not ready. */
    if (!name || !((name[0] == 'c' && name[1] == 'u') ||
                   (name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l')))
        return NULL;
    pthread_once(&table_once, table_build);
    gv_hook key = { name, NULL };
    const gv_hook *h = table ? bsearch(&key, table, table_len, sizeof *table, by_name) : NULL;
    return h ? h->fn : NULL;
}

/* ---- dlsym ------------------------------------------------------------ */

/* RTLD_NEXT means "after the caller", and the C library finds the caller
 * from its own return address.  So that request is passed on as a tail
 * call (a jump): the C library then sees our caller's return address, as
 * if we were not there.  This also serves sanitizer runtimes, which look up
 * their real functions this way before they are initialised. */
GV_EXPORT GV_NO_SANITIZE __attribute__((optimize("optimize-sibling-calls")))
void *dlsym(void *handle, const char *name)
{
    if (handle == RTLD_NEXT)
        return gv_libc_dlsym()(handle, name);
    return gv_dlsym_default(handle, name);
}

GV_NO_SANITIZE void *gv_dlsym_default(void *handle, const char *name)
{
    void *r = gv_real_dlsym(handle, name);
    if (!r)
        return r;
    void *hook = gv_hook_for(name);
    if (!hook || hook == r)
        return r;
    int id = gv_real_find(name);
    if (id >= 0)
        gv_real_learn((enum gv_sym)id, r);   /* the caller's driver is the real one */
    return hook;
}

/* ---- cuGetProcAddress --------------------------------------------------- */

/* ABI variants of the entry points we hook: the symbol a given CUDA version
 * binds to (the highest min_version not above it), and the per-thread
 * default-stream variant. */
typedef struct variant {
    const char *base;
    struct { int min_version; const char *symbol; } by_version[4];
    const char *ptsz;
} variant;

static const variant variants[] = {
    { "cuArray3DCreate", { { 0, "cuArray3DCreate" }, { 3020, "cuArray3DCreate_v2" } }, NULL },
    { "cuArrayCreate", { { 0, "cuArrayCreate" }, { 3020, "cuArrayCreate_v2" } }, NULL },
    { "cuArrayDestroy", { { 0, "cuArrayDestroy" } }, NULL },
    { "cuCtxCreate", { { 0, "cuCtxCreate" }, { 3020, "cuCtxCreate_v2" }, { 11040, "cuCtxCreate_v3" },
                       { 12050, "cuCtxCreate_v4" } }, NULL },
    { "cuCtxDestroy", { { 0, "cuCtxDestroy" }, { 4000, "cuCtxDestroy_v2" } }, NULL },
    { "cuCtxSetLimit", { { 0, "cuCtxSetLimit" } }, NULL },
    { "cuCtxSynchronize", { { 0, "cuCtxSynchronize" }, { 13000, "cuCtxSynchronize_v2" } }, NULL },
    { "cuDeviceGraphMemTrim", { { 0, "cuDeviceGraphMemTrim" } }, NULL },
    { "cuDevicePrimaryCtxRelease", { { 0, "cuDevicePrimaryCtxRelease" },
                                     { 11000, "cuDevicePrimaryCtxRelease_v2" } }, NULL },
    { "cuDevicePrimaryCtxReset", { { 0, "cuDevicePrimaryCtxReset" },
                                   { 11000, "cuDevicePrimaryCtxReset_v2" } }, NULL },
    { "cuDevicePrimaryCtxRetain", { { 0, "cuDevicePrimaryCtxRetain" } }, NULL },
    { "cuDeviceTotalMem", { { 0, "cuDeviceTotalMem" }, { 3020, "cuDeviceTotalMem_v2" } }, NULL },
    { "cuEventQuery", { { 0, "cuEventQuery" } }, NULL },
    { "cuEventSynchronize", { { 0, "cuEventSynchronize" } }, NULL },
    { "cuGetProcAddress", { { 0, "cuGetProcAddress" }, { 12000, "cuGetProcAddress_v2" } }, NULL },
    { "cuGraphExecDestroy", { { 0, "cuGraphExecDestroy" } }, NULL },
    { "cuGraphInstantiate", { { 0, "cuGraphInstantiate" }, { 11000, "cuGraphInstantiate_v2" },
                              { 12000, "cuGraphInstantiateWithFlags" } }, NULL },
    { "cuGraphInstantiateWithFlags", { { 0, "cuGraphInstantiateWithFlags" } }, NULL },
    { "cuGraphInstantiateWithParams", { { 0, "cuGraphInstantiateWithParams" } },
      "cuGraphInstantiateWithParams_ptsz" },
    { "cuGraphLaunch", { { 0, "cuGraphLaunch" } }, "cuGraphLaunch_ptsz" },
    { "cuGraphUpload", { { 0, "cuGraphUpload" } }, "cuGraphUpload_ptsz" },
    { "cuInit", { { 0, "cuInit" } }, NULL },
    { "cuLaunch", { { 0, "cuLaunch" } }, NULL },
    { "cuLaunchCooperativeKernel", { { 0, "cuLaunchCooperativeKernel" } }, "cuLaunchCooperativeKernel_ptsz" },
    { "cuLaunchCooperativeKernelMultiDevice", { { 0, "cuLaunchCooperativeKernelMultiDevice" } }, NULL },
    { "cuLaunchGrid", { { 0, "cuLaunchGrid" } }, NULL },
    { "cuLaunchGridAsync", { { 0, "cuLaunchGridAsync" } }, NULL },
    { "cuLaunchKernel", { { 0, "cuLaunchKernel" } }, "cuLaunchKernel_ptsz" },
    { "cuLaunchKernelEx", { { 0, "cuLaunchKernelEx" } }, "cuLaunchKernelEx_ptsz" },
    { "cuMemAddressFree", { { 0, "cuMemAddressFree" } }, NULL },
    { "cuMemAlloc", { { 0, "cuMemAlloc" }, { 3020, "cuMemAlloc_v2" } }, NULL },
    { "cuMemAllocAsync", { { 0, "cuMemAllocAsync" } }, "cuMemAllocAsync_ptsz" },
    { "cuMemAllocFromPoolAsync", { { 0, "cuMemAllocFromPoolAsync" } }, "cuMemAllocFromPoolAsync_ptsz" },
    { "cuMemAllocManaged", { { 0, "cuMemAllocManaged" } }, NULL },
    { "cuMemAllocPitch", { { 0, "cuMemAllocPitch" }, { 3020, "cuMemAllocPitch_v2" } }, NULL },
    { "cuMemCreate", { { 0, "cuMemCreate" } }, NULL },
    { "cuMemFree", { { 0, "cuMemFree" }, { 3020, "cuMemFree_v2" } }, NULL },
    { "cuMemFreeAsync", { { 0, "cuMemFreeAsync" } }, "cuMemFreeAsync_ptsz" },
    { "cuMemGetInfo", { { 0, "cuMemGetInfo" }, { 3020, "cuMemGetInfo_v2" } }, NULL },
    { "cuMemMap", { { 0, "cuMemMap" } }, NULL },
    { "cuMemPoolCreate", { { 0, "cuMemPoolCreate" } }, NULL },
    { "cuMemPoolDestroy", { { 0, "cuMemPoolDestroy" } }, NULL },
    { "cuMemPoolTrimTo", { { 0, "cuMemPoolTrimTo" } }, NULL },
    { "cuMemRelease", { { 0, "cuMemRelease" } }, NULL },
    { "cuMemRetainAllocationHandle", { { 0, "cuMemRetainAllocationHandle" } }, NULL },
    { "cuMemUnmap", { { 0, "cuMemUnmap" } }, NULL },
    { "cuMipmappedArrayCreate", { { 0, "cuMipmappedArrayCreate" } }, NULL },
    { "cuMipmappedArrayDestroy", { { 0, "cuMipmappedArrayDestroy" } }, NULL },
    /* (A CUDA 10.0 caller asking for the per-thread variant gets the _v2
     * one's hook, which passes its stream on to what the driver answered.) */
    { "cuStreamBeginCapture", { { 0, "cuStreamBeginCapture" }, { 10010, "cuStreamBeginCapture_v2" } },
      "cuStreamBeginCapture_v2_ptsz" },
    { "cuStreamBeginCaptureToGraph", { { 0, "cuStreamBeginCaptureToGraph" } },
      "cuStreamBeginCaptureToGraph_ptsz" },
    { "cuStreamDestroy", { { 0, "cuStreamDestroy" }, { 4000, "cuStreamDestroy_v2" } }, NULL },
    { "cuStreamEndCapture", { { 0, "cuStreamEndCapture" } }, "cuStreamEndCapture_ptsz" },
    { "cuStreamQuery", { { 0, "cuStreamQuery" } }, "cuStreamQuery_ptsz" },
    { "cuStreamSynchronize", { { 0, "cuStreamSynchronize" } }, "cuStreamSynchronize_ptsz" },
};

static const variant *variant_of(const char *base)
{
    size_t lo = 0, hi = sizeof variants / sizeof *variants;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(base, variants[mid].base);
        if (c == 0)
            return &variants[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

/* Which exported symbol the driver's answer is.  Prefer identity with one
 * of the variants' exported addresses; otherwise apply the version rule. */
static const char *answered_symbol(const variant *v, void *fn, int version, cuuint64_t flags)
{
    void *h = gv_real_cuda_handle();
    if (h) {
        if (v->ptsz && gv_real_dlsym(h, v->ptsz) == fn)
            return v->ptsz;
        for (int i = 0; i < 4 && v->by_version[i].symbol; i++)
            if (gv_real_dlsym(h, v->by_version[i].symbol) == fn)
                return v->by_version[i].symbol;
    }
    if (v->ptsz && (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
        return v->ptsz;
    const char *best = NULL;
    for (int i = 0; i < 4 && v->by_version[i].symbol; i++)
        if (v->by_version[i].min_version <= version)
            best = v->by_version[i].symbol;
    return best;
}

static void substitute(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    const variant *v = symbol ? variant_of(symbol) : NULL;
    if (!v || !pfn || !*pfn)
        return;
    const char *exact = answered_symbol(v, *pfn, version, flags);
    void *hook = exact ? gv_hook_for(exact) : NULL;
    if (!hook)
        return;
    int id = gv_real_find(exact);
    if (id >= 0)
        gv_real_learn((enum gv_sym)id, *pfn);
    *pfn = hook;
}

typedef CUresult (*gpa_v1_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa_v2_fn)(const char *, void **, int, cuuint64_t,
                              CUdriverProcAddressQueryResult *);

GV_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                       cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    CUresult rc = GV_REAL(cuGetProcAddress_v2, gpa_v2_fn)(symbol, pfn, version, flags, status);
    if (rc == CUDA_SUCCESS)
        substitute(symbol, pfn, version, flags);
    return rc;
}

GV_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    CUresult rc = GV_REAL(cuGetProcAddress, gpa_v1_fn)(symbol, pfn, version, flags);
    if (rc == CUDA_SUCCESS)
        substitute(symbol, pfn, version, flags);
    return rc;
}

const gv_hook gv_hooks_procaddr[] = {
    { "cuGetProcAddress", (void *)cuGetProcAddress },
    { "cuGetProcAddress_v2", (void *)cuGetProcAddress_v2 },
    { NULL, NULL }
};
