/*
 * cuda_memory.c - linear device memory (cuMemAlloc/Pitch/Managed/Free),
 * page-locked host memory, memory info, address ranges and the no-op
 * copies.  Device allocations charge their size rounded up to 2 MiB.
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

CUresult sim_dev_alloc(CUdeviceptr *out, uint64_t size, int low)
{
    struct CUctx_st *c;
    SIM_TRY(sim_current(&c));
    if (!out || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_fault_alloc())
        return CUDA_ERROR_OUT_OF_MEMORY;
    sim_alloc_delay();                  /* before the memory is taken */
    uint64_t phys = sim_round_up(size, SIM_GRAN);
    if (phys < size || sim_charge(c->node, phys) < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&sim_mu);
    sim_alloc a = {0};
    a.addr = sim_va_next(c->node, size, low);
    a.size = sim_round_up(size, SIM_ALIGN);
    a.charged = phys;
    a.node = c->node;
    a.kind = low ? SIM_K_LOW : SIM_K_ALLOC;
    a.ctx = c;
    if (!a.addr || sim_tab_insert(&a) < 0) {
        pthread_mutex_unlock(&sim_mu);
        sim_uncharge(c->node, phys);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&sim_mu);
    *out = a.addr;
    return CUDA_SUCCESS;
}

void sim_free_entry_locked(sim_alloc *a)
{
    if (a->kind == SIM_K_POOL) {
        sim_pool_block_free_locked(a);
        return;
    }
    if (a->kind == SIM_K_GRAPH) {
        sim_gmem_free_locked(a);
        return;
    }
    int node = a->node;
    uint64_t ch = a->charged;
    if (a->kind == SIM_K_MANAGED)
        free(a->pages);
    sim_tab_remove(a->addr);
    sim_uncharge(node, ch);
}

void sim_ctx_release_allocs(struct CUctx_st *c)
{
    pthread_mutex_lock(&sim_mu);
    sim_alloc *a;
    while ((a = sim_tab_next_ctx(c)))
        sim_free_entry_locked(a);
    pthread_mutex_unlock(&sim_mu);
}

SIM_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    return sim_dev_alloc(dptr, size, 0);
}

SIM_API CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int size)
{
    CUdeviceptr p = 0;
    if (!dptr)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_dev_alloc(&p, size, 1);
    if (rc == CUDA_SUCCESS)
        *dptr = (CUdeviceptr_v1)p;
    return rc;
}

SIM_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch,
                                    size_t width, size_t height,
                                    unsigned int elem)
{
    if (!dptr || !pitch || !width || !height ||
        (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t p = sim_round_up(width, SIM_ALIGN);
    if (height > ~(size_t)0 / p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = sim_dev_alloc(dptr, (uint64_t)p * height, 0);
    if (rc == CUDA_SUCCESS)
        *pitch = p;
    return rc;
}

SIM_API CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch,
                                 unsigned int width, unsigned int height,
                                 unsigned int elem)
{
    if (!dptr || !pitch || !width || !height ||
        (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t p = sim_round_up(width, SIM_ALIGN);
    CUdeviceptr d = 0;
    CUresult rc = sim_dev_alloc(&d, p * height, 1);
    if (rc == CUDA_SUCCESS) {
        *dptr = (CUdeviceptr_v1)d;
        *pitch = (unsigned int)p;
    }
    return rc;
}

SIM_API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    sim_alloc *a = sim_tab_find(dptr);
    if (!a) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    sim_free_entry_locked(a);
    pthread_mutex_unlock(&sim_mu);
    sim_free_delay();
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    return cuMemFree_v2(dptr);
}

/* As the real driver, either figure may be asked for alone (programs call
 * cudaMemGetInfo(&free, NULL) and cudaMemGetInfo(NULL, &total)); asking
 * for neither is CUDA_ERROR_INVALID_VALUE. */
SIM_API CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    struct CUctx_st *c;
    SIM_TRY(sim_current(&c));
    if (!free_b && !total_b)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t total = sim_dev(c->node)->total;
    uint64_t used = sim_used(c->node);
    if (total_b)
        *total_b = total;
    if (free_b)
        *free_b = used >= total ? 0 : total - used;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b)
{
    size_t f, t;
    if (!free_b && !total_b)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuMemGetInfo_v2(&f, &t);
    if (rc == CUDA_SUCCESS) {
        if (free_b)
            *free_b = f > 0xffffffffULL ? 0xffffffffU : (unsigned int)f;
        if (total_b)
            *total_b = t > 0xffffffffULL ? 0xffffffffU : (unsigned int)t;
    }
    return rc;
}

/* ---- address ranges and copies --------------------------------------- */

/* base/size of the allocation or VMM mapping containing p; 0 if found */
static int range_of(CUdeviceptr p, CUdeviceptr *base, uint64_t *size)
{
    pthread_mutex_lock(&sim_mu);
    sim_alloc *a = sim_tab_range(p);
    int rc = -1;
    if (a) {
        *base = a->addr;
        *size = a->size;
        rc = 0;
    }
    pthread_mutex_unlock(&sim_mu);
    if (rc < 0)
        rc = sim_vmm_range(p, base, size);
    return rc;
}

SIM_API CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize,
                                         CUdeviceptr dptr)
{
    SIM_TRY(sim_check_init());
    CUdeviceptr b;
    uint64_t s;
    if (range_of(dptr, &b, &s) < 0)
        return CUDA_ERROR_NOT_FOUND;
    if (pbase)
        *pbase = b;
    if (psize)
        *psize = s;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemGetAddressRange(CUdeviceptr_v1 *pbase,
                                      unsigned int *psize,
                                      CUdeviceptr_v1 dptr)
{
    CUdeviceptr b;
    size_t s;
    CUresult rc = cuMemGetAddressRange_v2(&b, &s, dptr);
    if (rc == CUDA_SUCCESS) {
        if (pbase)
            *pbase = (CUdeviceptr_v1)b;
        if (psize)
            *psize = (unsigned int)s;
    }
    return rc;
}

static CUresult check_span(CUdeviceptr p, size_t n)
{
    SIM_TRY(sim_check_init());
    CUdeviceptr b;
    uint64_t s;
    if (range_of(p, &b, &s) < 0 || n > s - (p - b))
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    if (!src && n)
        return CUDA_ERROR_INVALID_VALUE;
    return check_span(dst, n);
}

SIM_API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    if (!dst && n)
        return CUDA_ERROR_INVALID_VALUE;
    return check_span(src, n);
}

SIM_API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n)
{
    (void)v;
    return check_span(dst, n);
}

SIM_ALIAS(cuMemcpyHtoD_v2_ptds, cuMemcpyHtoD_v2);

SIM_ALIAS(cuMemcpyDtoH_v2_ptds, cuMemcpyDtoH_v2);

SIM_ALIAS(cuMemsetD8_v2_ptds, cuMemsetD8_v2);

SIM_API CUresult cuMemcpyHtoD(CUdeviceptr_v1 d, const void *s, unsigned int n)
{
    return cuMemcpyHtoD_v2(d, s, n);
}

SIM_API CUresult cuMemcpyDtoH(void *d, CUdeviceptr_v1 s, unsigned int n)
{
    return cuMemcpyDtoH_v2(d, s, n);
}

SIM_API CUresult cuMemsetD8(CUdeviceptr_v1 d, unsigned char v, unsigned int n)
{
    return cuMemsetD8_v2(d, v, n);
}

/* ---- page-locked host memory (plain malloc; no device memory) -------- *
 *
 * cuMemAllocHost / cuMemHostAlloc blocks are the simulator's own;
 * cuMemHostRegister ranges the caller's (registered, never freed here).
 * A mapped block's device address is its host address, as under UVA. */

#define HOST_ALLOC_FLAGS 0x7u       /* PORTABLE | DEVICEMAP | WRITECOMBINED */
#define HOST_REGISTER_FLAGS 0xfu    /* PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY */

struct host_blk { char *p; size_t size; int registered; struct host_blk *next; };
static struct host_blk *g_host;

/* the block or registered range holding [p, p + n); sim_mu held */
static struct host_blk *host_find(const void *p, size_t n)
{
    const char *c = p;
    for (struct host_blk *b = g_host; b; b = b->next)
        if (c < b->p + b->size && c + n > b->p)
            return b;
    return NULL;
}

/* Link b in as [p, p + size); sim_mu held. */
static void host_push(struct host_blk *b, void *p, size_t size, int registered)
{
    b->p = p;
    b->size = size;
    b->registered = registered;
    b->next = g_host;
    g_host = b;
}

static CUresult host_alloc(void **pp, size_t size)
{
    struct CUctx_st *c;
    SIM_TRY(sim_current(&c));
    if (!pp || !size)
        return CUDA_ERROR_INVALID_VALUE;
    struct host_blk *b = malloc(sizeof *b);
    void *p = NULL;
    if (!b || posix_memalign(&p, 4096, size) != 0) {
        free(b);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&sim_mu);
    host_push(b, p, size, 0);
    pthread_mutex_unlock(&sim_mu);
    *pp = p;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemAllocHost_v2(void **pp, size_t size)
{
    return host_alloc(pp, size);
}

SIM_API CUresult cuMemAllocHost(void **pp, unsigned int size)
{
    return host_alloc(pp, size);
}

SIM_API CUresult cuMemHostAlloc(void **pp, size_t size, unsigned int flags)
{
    if (flags & ~HOST_ALLOC_FLAGS)
        return sim_check_init() ? sim_check_init() : CUDA_ERROR_INVALID_VALUE;
    return host_alloc(pp, size);
}

/* Unlink the entry starting at p, if it is of the kind asked for. */
static struct host_blk *host_take(void *p, int registered)
{
    pthread_mutex_lock(&sim_mu);
    struct host_blk **pp = &g_host, *b = NULL;
    for (; *pp; pp = &(*pp)->next)
        if ((*pp)->p == p && (*pp)->registered == registered) {
            b = *pp;
            *pp = b->next;
            break;
        }
    pthread_mutex_unlock(&sim_mu);
    return b;
}

SIM_API CUresult cuMemFreeHost(void *p)
{
    SIM_TRY(sim_check_init());
    struct host_blk *b = host_take(p, 0);
    if (!b)
        return CUDA_ERROR_INVALID_VALUE;
    free(b->p);
    free(b);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags)
{
    struct CUctx_st *c;
    SIM_TRY(sim_current(&c));
    if (!p || !size || (flags & ~HOST_REGISTER_FLAGS))
        return CUDA_ERROR_INVALID_VALUE;
    struct host_blk *b = malloc(sizeof *b);
    if (!b)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&sim_mu);
    if (host_find(p, size)) {
        pthread_mutex_unlock(&sim_mu);
        free(b);
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
    host_push(b, p, size, 1);
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuMemHostRegister, cuMemHostRegister_v2);

SIM_API CUresult cuMemHostUnregister(void *p)
{
    SIM_TRY(sim_check_args(!p));
    struct host_blk *b = host_take(p, 1);
    if (!b)
        return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    free(b);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned int flags)
{
    struct CUctx_st *c;
    SIM_TRY(sim_current(&c));
    if (!d || !p || flags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    int known = host_find(p, 1) != NULL;
    pthread_mutex_unlock(&sim_mu);
    if (!known)
        return CUDA_ERROR_INVALID_VALUE;
    *d = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemHostGetDevicePointer(CUdeviceptr_v1 *d, void *p, unsigned int flags)
{
    CUdeviceptr v = 0;
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuMemHostGetDevicePointer_v2(&v, p, flags);
    if (rc == CUDA_SUCCESS)
        *d = (CUdeviceptr_v1)v;
    return rc;
}
