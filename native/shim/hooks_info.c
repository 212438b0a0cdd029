/*
 * hooks_info.c - what the process is told about memory, and cuInit.
 *
 * With a quota Q and container usage U on a device with physical free F:
 *   total = min(Q, physical total)
 *   free  = min(total - U, F), and 0 when U >= total (never wraps)
 * Devices without a quota report the driver's own figures.
 */
#include <limits.h>

#include "hooks.h"
#include "oversub.h"

typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*info_v2_fn)(size_t *, size_t *);
typedef CUresult (*info_v1_fn)(unsigned int *, unsigned int *);
typedef CUresult (*total_v2_fn)(size_t *, CUdevice);
typedef CUresult (*total_v1_fn)(unsigned int *, CUdevice);

GV_EXPORT CUresult cuInit(unsigned int flags)
{
    init_fn real = GV_REAL(cuInit, init_fn);
    GV_ENFORCING_OR(real(flags));
    CUresult rc = real(flags);
    if (rc == CUDA_SUCCESS)
        gv_cuda_inited();
    return rc;
}

/* Quota view of a device, given the driver's physical figures.  A device
 * that has no region entry (the region is full) has no quota to show:
 * GV_FAIL_CUDA, as for its allocations, not the physical figures. */
static CUresult quota_view(int ordinal, uint64_t *free_b, uint64_t *total_b)
{
    const gv_devinfo *d;
    CUresult rc = gv_device(ordinal, &d);
    if (rc != CUDA_SUCCESS)
        return rc == CUDA_ERROR_INVALID_DEVICE ? CUDA_SUCCESS : rc;
    gv_region *r = gv_core_region();
    uint64_t limit = region_limit(r, d->region_dev);
    if (limit == GV_UNLIMITED)
        return CUDA_SUCCESS;
    gv_pools_refresh();
    gv_pending_frees_reap();
    gv_core_tidy();
    gv_untracked_tick();
    uint64_t used = region_used(r, d->region_dev);
    /* Oversubscribed, the quota is the device's size, and what does not
     * fit on the device is served from host memory (oversub.c). */
    int over = gv_oversub_on();
    uint64_t total = limit < *total_b || over ? limit : *total_b;
    uint64_t avail = used < total ? total - used : 0;
    *total_b = total;
    *free_b = avail < *free_b || over ? avail : *free_b;
    return CUDA_SUCCESS;
}

static CUresult mem_info(uint64_t *free_b, uint64_t *total_b)
{
    size_t f = 0, t = 0;
    CUresult rc = GV_REAL(cuMemGetInfo_v2, info_v2_fn)(&f, &t);
    if (rc != CUDA_SUCCESS)
        return rc;
    *free_b = f;
    *total_b = t;
    int ordinal;
    if (gv_current(&ordinal, NULL) == CUDA_SUCCESS &&
        (rc = quota_view(ordinal, free_b, total_b)) != CUDA_SUCCESS)
        return rc;
    return gv_mode() == GV_MODE_FAILED ? GV_FAIL_CUDA : CUDA_SUCCESS;
}

static unsigned int clamp32(uint64_t v) { return v > UINT_MAX ? UINT_MAX : (unsigned int)v; }

/* Stores v at p, when p is not NULL, as the entry point's type: size_t, or
 * for the v1 entry points unsigned int, clamped. */
static void put(void *p, int v1, uint64_t v)
{
    if (p && v1)
        *(unsigned int *)p = clamp32(v);
    else if (p)
        *(size_t *)p = (size_t)v;
}

/* One figure may be asked for alone (cudaMemGetInfo(&free, NULL)): it is
 * the quota's too, never the driver's. */
static CUresult mem_info_put(void *free_b, void *total_b, int v1)
{
    uint64_t f, t;
    CUresult rc = mem_info(&f, &t);
    if (rc == CUDA_SUCCESS) {
        put(free_b, v1, f);
        put(total_b, v1, t);
    }
    return rc;
}

GV_EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    info_v2_fn real = GV_REAL(cuMemGetInfo_v2, info_v2_fn);
    GV_ENFORCING_OR(real(free_b, total_b));
    return free_b || total_b ? mem_info_put(free_b, total_b, 0) : real(free_b, total_b);
}

GV_EXPORT CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b)
{
    info_v1_fn real = GV_REAL(cuMemGetInfo, info_v1_fn);
    GV_ENFORCING_OR(real(free_b, total_b));
    return free_b || total_b ? mem_info_put(free_b, total_b, 1) : real(free_b, total_b);
}

static CUresult total_mem(CUdevice dev, uint64_t *out)
{
    size_t t = 0;
    CUresult rc = GV_REAL(cuDeviceTotalMem_v2, total_v2_fn)(&t, dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t total = t, free_b = t;
    rc = quota_view(dev, &free_b, &total);
    if (rc != CUDA_SUCCESS)
        return rc;
    *out = total;
    return gv_mode() == GV_MODE_FAILED ? GV_FAIL_CUDA : CUDA_SUCCESS;
}

static CUresult total_mem_put(CUdevice dev, void *bytes, int v1)
{
    uint64_t t;
    CUresult rc = total_mem(dev, &t);
    if (rc == CUDA_SUCCESS)
        put(bytes, v1, t);
    return rc;
}

GV_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    total_v2_fn real = GV_REAL(cuDeviceTotalMem_v2, total_v2_fn);
    GV_ENFORCING_OR(real(bytes, dev));
    return bytes ? total_mem_put(dev, bytes, 0) : real(bytes, dev);
}

GV_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    total_v1_fn real = GV_REAL(cuDeviceTotalMem, total_v1_fn);
    GV_ENFORCING_OR(real(bytes, dev));
    return bytes ? total_mem_put(dev, bytes, 1) : real(bytes, dev);
}

const gv_hook gv_hooks_info[] = {
    { "cuInit", (void *)cuInit },
    { "cuMemGetInfo", (void *)cuMemGetInfo },
    { "cuMemGetInfo_v2", (void *)cuMemGetInfo_v2 },
    { "cuDeviceTotalMem", (void *)cuDeviceTotalMem },
    { "cuDeviceTotalMem_v2", (void *)cuDeviceTotalMem_v2 },
    { NULL, NULL }
};
