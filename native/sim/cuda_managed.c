/*
 * cuda_managed.c - managed memory (cuMemAllocManaged) and where it lives:
 * cuMemAdvise, cuMemPrefetchAsync (v1 and _v2).
 *
 * The simulator runs no kernels, so nothing touches managed memory and
 * nothing migrates on its own: its pages (2 MiB) live on the host from
 * the allocation, and on the device only once prefetched there
 * (cuMemPrefetchAsync to a device), as far as the device has room; the
 * pages that do not fit stay on the host.  A preferred location of the
 * host (cuMemAdvise SET_PREFERRED_LOCATION, CU_DEVICE_CPU) or a prefetch
 * to the host moves pages back.  Device-resident pages are charged to the
 * process on that device like any allocation, so the node's physical use
 * (cuMemGetInfo, NVML) never counts more than the device holds.
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

SIM_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags)
{
    struct CUctx_st *c;
    SIM_TRY(sim_current(&c));
    if (!dptr || size == 0 || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_fault_alloc())
        return CUDA_ERROR_OUT_OF_MEMORY;
    sim_alloc_delay();
    uint64_t npages = sim_round_up(size, SIM_GRAN) / SIM_GRAN;
    if (npages == 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    unsigned char *pages = calloc(npages, 1);
    if (!pages)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&sim_mu);
    sim_alloc a = {0};
    a.addr = sim_va_next(c->node, size, 0);
    a.size = sim_round_up(size, SIM_ALIGN);
    a.charged = 0;                      /* on the host until prefetched */
    a.node = c->node;
    a.kind = SIM_K_MANAGED;
    a.ctx = c;
    a.pages = pages;
    if (!a.addr || sim_tab_insert(&a) < 0) {
        pthread_mutex_unlock(&sim_mu);
        free(pages);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&sim_mu);
    *dptr = a.addr;
    return CUDA_SUCCESS;
}

/* The managed allocation holding [p, p + n), or NULL (sim_mu held). */
static sim_alloc *managed_range(CUdeviceptr p, size_t n)
{
    sim_alloc *a = sim_tab_range(p);
    if (!a || a->kind != SIM_K_MANAGED || n == 0 || n > a->size - (p - a->addr))
        return NULL;
    return a;
}

/* Move the pages of [p, p + n) to the host (node < 0) or to node, as far
 * as it has room (sim_mu held). */
static void move_pages(sim_alloc *a, CUdeviceptr p, size_t n, int node)
{
    uint64_t first = (p - a->addr) / SIM_GRAN;
    uint64_t last = (p - a->addr + n - 1) / SIM_GRAN;
    if (node >= 0 && node != a->node) {
        /* Pages live on one device at a time here: the others come home. */
        for (uint64_t i = 0; i * SIM_GRAN < a->size; i++)
            if (a->pages[i]) {
                a->pages[i] = 0;
                sim_uncharge(a->node, SIM_GRAN);
                a->charged -= SIM_GRAN;
            }
        a->node = node;
    }
    for (uint64_t i = first; i <= last; i++) {
        if (node < 0 && a->pages[i]) {
            a->pages[i] = 0;
            sim_uncharge(a->node, SIM_GRAN);
            a->charged -= SIM_GRAN;
        } else if (node >= 0 && !a->pages[i]) {
            if (sim_charge(a->node, SIM_GRAN) < 0)
                return;                 /* full: the rest stays on the host */
            a->pages[i] = 1;
            a->charged += SIM_GRAN;
        }
    }
}

/* CU_DEVICE_CPU: -1; a device ordinal: its node; -2: invalid. */
static int where(CUdevice d)
{
    if (d == CU_DEVICE_CPU)
        return -1;
    int node = sim_ord_node((int)d);
    return node < 0 ? -2 : node;
}

static int where_loc(CUmemLocation loc)
{
    switch (loc.type) {
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        return -1;
    case CU_MEM_LOCATION_TYPE_DEVICE:
        return where(loc.id);
    default:
        return -2;
    }
}

/* move_range's node for a range whose pages stay where they are */
#define STAY (-3)

/* Move the pages of managed range [p, p + n) to node (-1: the host), or
 * leave them (STAY); CUDA_ERROR_INVALID_VALUE unless it is managed memory. */
static CUresult move_range(CUdeviceptr p, size_t n, int node)
{
    pthread_mutex_lock(&sim_mu);
    sim_alloc *a = managed_range(p, n);
    if (a && node != STAY)
        move_pages(a, p, n, node);
    pthread_mutex_unlock(&sim_mu);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult do_advise(CUdeviceptr p, size_t n, CUmem_advise advice, int node)
{
    SIM_TRY(sim_check_args(advice < CU_MEM_ADVISE_SET_READ_MOSTLY ||
                                 advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY));
    int needs_place = advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION ||
                      advice == CU_MEM_ADVISE_SET_ACCESSED_BY;
    if (needs_place && node == -2)
        return CUDA_ERROR_INVALID_DEVICE;
    /* A preferred location of the host takes the pages there; one of a
     * device is where they go when touched, which nothing does here. */
    int host = advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION && node < 0;
    return move_range(p, n, host ? -1 : STAY);
}

static CUresult do_prefetch(CUdeviceptr p, size_t n, int node)
{
    SIM_TRY(sim_check_init());
    if (node == -2)
        return CUDA_ERROR_INVALID_DEVICE;
    return move_range(p, n, node);
}

SIM_API CUresult cuMemAdvise(CUdeviceptr p, size_t n, CUmem_advise advice, CUdevice d)
{
    return do_advise(p, n, advice, where(d));
}

SIM_API CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, CUmem_advise advice, CUmemLocation loc)
{
    return do_advise(p, n, advice, where_loc(loc));
}

SIM_API CUresult cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice d, CUstream s)
{
    (void)s;                            /* done at once: no kernel runs */
    return do_prefetch(p, n, where(d));
}

SIM_API CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation loc,
                                       unsigned int flags, CUstream s)
{
    (void)s;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return do_prefetch(p, n, where_loc(loc));
}
