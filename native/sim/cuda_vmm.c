/*
 * cuda_vmm.c - virtual memory management: physical handles (cuMemCreate),
 * address reservations and mappings.  A device-located handle charges its
 * size when created; the memory is given back when the handle has been
 * released AND every mapping of it is unmapped, as on a real device.
 * Reservations come from 0x200000000000 upwards, never reused.
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

#define VMM_MAGIC 0x564d4d48u
#define RESV_BASE 0x200000000000ULL

struct vmm_handle {
    uint32_t magic;
    int node;                           /* -1: host memory, not charged */
    int released;
    int refs;                           /* cuMemRetainAllocationHandle's */
    int maps;
    uint64_t size;
    CUmemAllocationProp prop;
};

struct resv { CUdeviceptr base; uint64_t size; struct resv *next; };
struct map {
    CUdeviceptr va;
    uint64_t size;
    struct vmm_handle *h;
    struct map *next;
};

static struct resv *g_resv;
static struct map *g_maps;
static uint64_t g_va = RESV_BASE;

static int loc_node(const CUmemLocation *l, int *node)
{
    switch (l->type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        *node = sim_ord_node(l->id);
        return *node < 0 ? -1 : 0;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        *node = -1;
        return 0;
    default:
        return -1;
    }
}

static struct vmm_handle *handle_of(CUmemGenericAllocationHandle h)
{
    struct vmm_handle *v = (struct vmm_handle *)(uintptr_t)h;
    if (!v || !sim_reg_has(v) || v->magic != VMM_MAGIC || v->released)
        return NULL;
    return v;
}

/* drop a reference; frees and uncharges at zero; sim_mu held */
static void handle_put(struct vmm_handle *v)
{
    if (!v->released || v->maps)
        return;
    sim_reg_del(v);
    v->magic = 0;
    if (v->node >= 0)
        sim_uncharge(v->node, v->size);
    free(v);
}

SIM_API CUresult cuMemGetAllocationGranularity(size_t *g,
                                               const CUmemAllocationProp *p,
                                               CUmemAllocationGranularity_flags f)
{
    SIM_TRY(sim_check_init());
    int node;
    if (!g || !p || (f != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
                     f != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    if (p->type != CU_MEM_ALLOCATION_TYPE_PINNED || loc_node(&p->location, &node))
        return CUDA_ERROR_INVALID_VALUE;
    *g = SIM_GRAN;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size,
                             const CUmemAllocationProp *p,
                             unsigned long long flags)
{
    SIM_TRY(sim_check_init());
    int node;
    if (!h || !p || flags || !size || size % SIM_GRAN ||
        p->type != CU_MEM_ALLOCATION_TYPE_PINNED || loc_node(&p->location, &node))
        return CUDA_ERROR_INVALID_VALUE;
    if (node >= 0 && (sim_fault_alloc() || sim_charge(node, size) < 0))
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct vmm_handle *v = calloc(1, sizeof *v);
    if (!v) {
        if (node >= 0)
            sim_uncharge(node, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    v->magic = VMM_MAGIC;
    v->node = node;
    v->size = size;
    v->prop = *p;
    pthread_mutex_lock(&sim_mu);
    sim_reg_add(v);
    pthread_mutex_unlock(&sim_mu);
    *h = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    struct vmm_handle *v = handle_of(h);
    if (v && v->refs > 0) {
        v->refs--;
    } else if (v) {
        v->released = 1;
        handle_put(v);
    }
    pthread_mutex_unlock(&sim_mu);
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    sim_free_delay();
    return CUDA_SUCCESS;
}

/* The handle mapped at addr (anywhere in a mapping), with one more
 * reference that a cuMemRelease must drop: also of a handle released while
 * still mapped, which it brings back. */
SIM_API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    SIM_TRY(sim_check_args(!h));
    CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
    pthread_mutex_lock(&sim_mu);
    struct map *m = g_maps;
    while (m && !(a >= m->va && a < m->va + m->size))
        m = m->next;
    if (m) {
        if (m->h->released)
            m->h->released = 0;
        else
            m->h->refs++;
        *h = (CUmemGenericAllocationHandle)(uintptr_t)m->h;
    }
    pthread_mutex_unlock(&sim_mu);
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuMemGetAllocationPropertiesFromHandle(
    CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    SIM_TRY(sim_check_args(!prop));
    pthread_mutex_lock(&sim_mu);
    struct vmm_handle *v = handle_of(h);
    if (v)
        *prop = v->prop;
    pthread_mutex_unlock(&sim_mu);
    return v ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size,
                                     size_t align, CUdeviceptr addr,
                                     unsigned long long flags)
{
    (void)addr;                         /* hints are not honoured */
    SIM_TRY(sim_check_init());
    if (!ptr || !size || size % SIM_GRAN || flags ||
        (align & (align - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t a = align > SIM_GRAN ? align : SIM_GRAN;
    struct resv *r = malloc(sizeof *r);
    if (!r)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&sim_mu);
    r->base = sim_round_up(g_va, a);
    r->size = size;
    g_va = r->base + size;
    r->next = g_resv;
    g_resv = r;
    pthread_mutex_unlock(&sim_mu);
    *ptr = r->base;
    return CUDA_SUCCESS;
}

/* unmap every mapping inside [va, va+size); sim_mu held */
static int unmap_range(CUdeviceptr va, uint64_t size)
{
    int n = 0;
    for (struct map **pp = &g_maps; *pp;) {
        struct map *m = *pp;
        if (m->va >= va && m->va + m->size <= va + size) {
            *pp = m->next;
            m->h->maps--;
            handle_put(m->h);
            free(m);
            n++;
        } else {
            pp = &m->next;
        }
    }
    return n;
}

SIM_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    struct resv **pp = &g_resv, *r = NULL;
    for (; *pp; pp = &(*pp)->next)
        if ((*pp)->base == ptr && (*pp)->size == size) {
            r = *pp;
            *pp = r->next;
            break;
        }
    if (r)
        unmap_range(r->base, r->size);
    pthread_mutex_unlock(&sim_mu);
    int found = r != NULL;
    free(r);
    if (!found)
        return CUDA_ERROR_INVALID_VALUE;
    sim_free_delay();
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                          CUmemGenericAllocationHandle h,
                          unsigned long long flags)
{
    CUresult rc = sim_check_args(!size || flags || size % SIM_GRAN || offset % SIM_GRAN);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    struct vmm_handle *v = handle_of(h);
    struct resv *r = g_resv;
    for (; r; r = r->next)
        if (ptr >= r->base && ptr - r->base < r->size)
            break;
    rc = CUDA_ERROR_INVALID_VALUE;
    if (!v || !r || size > r->size - (ptr - r->base) ||
        offset > v->size || size > v->size - offset)
        goto out;
    for (struct map *m = g_maps; m; m = m->next)
        if (ptr < m->va + m->size && m->va < ptr + size)
            goto out;                   /* already mapped */
    struct map *m = malloc(sizeof *m);
    if (!m) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    m->va = ptr;
    m->size = size;
    m->h = v;
    m->next = g_maps;
    g_maps = m;
    v->maps++;
    rc = CUDA_SUCCESS;
out:
    pthread_mutex_unlock(&sim_mu);
    return rc;
}

SIM_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    int bad = 0;
    for (struct map *m = g_maps; m; m = m->next)
        if (ptr < m->va + m->size && m->va < ptr + size &&
            !(m->va >= ptr && m->va + m->size <= ptr + size))
            bad = 1;                    /* would split a mapping */
    int n = bad ? 0 : unmap_range(ptr, size);
    pthread_mutex_unlock(&sim_mu);
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    sim_free_delay();
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size,
                                const CUmemAccessDesc *desc, size_t count)
{
    SIM_TRY(sim_check_args(!desc || !count || !size));
    for (size_t i = 0; i < count; i++) {
        int node;
        if (loc_node(&desc[i].location, &node) < 0)
            return CUDA_ERROR_INVALID_DEVICE;
    }
    CUdeviceptr b;
    uint64_t s;
    if (sim_vmm_range(ptr, &b, &s) < 0)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

int sim_vmm_range(CUdeviceptr p, CUdeviceptr *base, uint64_t *size)
{
    int rc = -1;
    pthread_mutex_lock(&sim_mu);
    for (struct map *m = g_maps; m; m = m->next)
        if (p >= m->va && p - m->va < m->size) {
            *base = m->va;
            *size = m->size;
            rc = 0;
            break;
        }
    pthread_mutex_unlock(&sim_mu);
    return rc;
}
