/*
 * cuda_pool.c - the stream-ordered allocator.  A pool holds `reserved`
 * physical memory (charged to this process) of which `used` is handed out.
 *   alloc:  grow reserved by the shortfall rounded up to 2 MiB
 *   free:   used shrinks, reserved stays
 *   sync:   reserved shrinks to roundup2M(max(used, release threshold)), at
 *           cuStreamSynchronize, cuCtxSynchronize and cuEventSynchronize
 *   trim:   reserved shrinks to roundup2M(max(used, keep))
 * Blocks are 512-byte aligned; they live in the allocation table as
 * SIM_K_POOL entries pointing at their pool.
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

#define POOL_MAGIC 0x504f4f4cu

static struct CUmemPoolHandle_st g_def[SIM_MAX_DEV];    /* by ordinal */
static struct CUmemPoolHandle_st *g_cur[SIM_MAX_DEV];
static struct CUmemPoolHandle_st *g_pools;              /* all pools */

static void pool_init(struct CUmemPoolHandle_st *p, int ord, int def)
{
    memset(p, 0, sizeof *p);
    p->magic = POOL_MAGIC;
    p->ordinal = ord;
    p->node = sim_ord_node(ord);
    p->is_default = def;
    for (int i = 0; i < 4; i++)
        p->reuse[i] = 1;
    p->next = g_pools;
    g_pools = p;
    sim_reg_add(p);
}

/* default pool of ordinal; sim_mu held */
static struct CUmemPoolHandle_st *def_pool(int ord)
{
    if (!g_def[ord].magic)
        pool_init(&g_def[ord], ord, 1);
    return &g_def[ord];
}

static struct CUmemPoolHandle_st *cur_pool(int ord)
{
    return g_cur[ord] ? g_cur[ord] : def_pool(ord);
}

static int pool_ok(struct CUmemPoolHandle_st *p)
{
    return p && sim_reg_has(p) && p->magic == POOL_MAGIC && !p->destroyed;
}

/* shrink reserved to roundup2M(max(used, keep)); sim_mu held.  Returns
 * what it gave back. */
static uint64_t pool_shrink(struct CUmemPoolHandle_st *p, uint64_t keep)
{
    uint64_t want = p->used > keep ? p->used : keep;
    if (want >= p->reserved)
        return 0;
    want = sim_round_up(want, SIM_GRAN);
    if (want >= p->reserved)
        return 0;
    uint64_t give = p->reserved - want;
    p->reserved = want;
    sim_uncharge(p->node, give);
    return give;
}

void sim_pools_sync(int ordinal)
{
    uint64_t given = 0;
    pthread_mutex_lock(&sim_mu);
    for (struct CUmemPoolHandle_st *p = g_pools; p; p = p->next)
        if (ordinal < 0 || p->ordinal == ordinal || p->ordinal < 0)
            given += pool_shrink(p, p->destroyed ? 0 : p->threshold);
    pthread_mutex_unlock(&sim_mu);
    if (given)
        sim_free_delay();
}

void sim_pool_block_free_locked(sim_alloc *a)
{
    struct CUmemPoolHandle_st *p = a->pool;
    p->used -= a->size < p->used ? a->size : p->used;
    sim_tab_remove(a->addr);
    if (p->destroyed)
        pool_shrink(p, 0);
}

static CUresult pool_alloc(struct CUmemPoolHandle_st *p, CUdeviceptr *out,
                           size_t size)
{
    if (sim_fault_alloc())
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t bs = sim_round_up(size, SIM_ALIGN);
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&sim_mu);
    uint64_t avail = p->reserved - p->used, grow = 0;
    if (bs > avail) {
        grow = sim_round_up(bs - avail, SIM_GRAN);
        if ((p->max_size && p->reserved + grow > p->max_size) ||
            (p->node >= 0 && sim_charge(p->node, grow) < 0)) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            goto out;
        }
    }
    sim_alloc a = {0};
    a.addr = sim_va_next(p->node, bs, 0);
    a.size = bs;
    a.node = p->node;
    a.kind = SIM_K_POOL;
    a.pool = p;
    if (!a.addr || sim_tab_insert(&a) < 0) {
        sim_uncharge(p->node, grow);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    p->reserved += grow;
    p->used += bs;
    if (p->reserved > p->reserved_high)
        p->reserved_high = p->reserved;
    if (p->used > p->used_high)
        p->used_high = p->used;
    *out = a.addr;
out:
    pthread_mutex_unlock(&sim_mu);
    return rc;
}

/* In a capturing stream, allocations and frees become graph memory nodes
 * (cuda_graph_mem.c) instead of running. */
static CUresult alloc_async(CUdeviceptr *dptr, size_t size, int from_pool, CUmemoryPool pool,
                            CUstream s, int ptsz)
{
    struct CUctx_st *c;
    CUresult rc = sim_stream_ctx(s, &c);
    if (rc)
        return rc;
    if (!dptr || !size)
        return CUDA_ERROR_INVALID_VALUE;
    if (from_pool) {                    /* cuMemAllocFromPoolAsync's pool */
        pthread_mutex_lock(&sim_mu);
        int ok = pool_ok(pool);
        pthread_mutex_unlock(&sim_mu);
        if (!ok)
            return CUDA_ERROR_INVALID_VALUE;
    }
    if (sim_capture_alloc(s, ptsz, dptr, size, &rc))
        return rc;
    if (!from_pool) {                   /* cuMemAllocAsync: the current pool */
        pthread_mutex_lock(&sim_mu);
        pool = cur_pool(c->ordinal);
        pthread_mutex_unlock(&sim_mu);
    }
    return pool_alloc(pool, dptr, size);
}

static CUresult free_async(CUdeviceptr dptr, CUstream s, int ptsz)
{
    struct CUctx_st *c;
    CUresult rc = sim_stream_ctx(s, &c);
    if (rc)
        return rc;
    if (sim_capture_free(s, ptsz, dptr, &rc))
        return rc;
    pthread_mutex_lock(&sim_mu);
    sim_alloc *a = sim_tab_find(dptr);
    if (a)
        sim_free_entry_locked(a);
    pthread_mutex_unlock(&sim_mu);
    if (!a)
        return CUDA_ERROR_INVALID_VALUE;
    sim_free_delay();
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *d, size_t n, CUmemoryPool p,
                                         CUstream s)
{
    return alloc_async(d, n, 1, p, s, 0);
}

SIM_API CUresult cuMemAllocAsync(CUdeviceptr *d, size_t n, CUstream s)
{
    return alloc_async(d, n, 0, NULL, s, 0);
}

SIM_API CUresult cuMemFreeAsync(CUdeviceptr d, CUstream s)
{
    return free_async(d, s, 0);
}

SIM_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t n, CUstream s)
{
    return alloc_async(d, n, 0, NULL, s, 1);
}

SIM_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *d, size_t n,
                                              CUmemoryPool p, CUstream s)
{
    return alloc_async(d, n, 1, p, s, 1);
}

SIM_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr d, CUstream s)
{
    return free_async(d, s, 1);
}

/* ---- pool objects ---------------------------------------------------- */

SIM_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *pr)
{
    SIM_TRY(sim_check_args(!pool || !pr || pr->allocType != CU_MEM_ALLOCATION_TYPE_PINNED));
    /* Host-located pools (CUDA 12.2+) hold host memory: no device's. */
    int host = pr->location.type == CU_MEM_LOCATION_TYPE_HOST ||
               pr->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA;
    if (!host && pr->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (!host && sim_ord_node(pr->location.id) < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    struct CUmemPoolHandle_st *p = malloc(sizeof *p);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&sim_mu);
    pool_init(p, host ? -1 : pr->location.id, 0);
    p->max_size = pr->maxSize;
    pthread_mutex_unlock(&sim_mu);
    *pool = p;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    if (!pool_ok(pool) || pool->is_default) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (pool->ordinal >= 0 && g_cur[pool->ordinal] == pool)
        g_cur[pool->ordinal] = NULL;
    pool->destroyed = 1;                /* outstanding blocks release later */
    sim_reg_del(pool);
    pool_shrink(pool, 0);
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    int ok = pool_ok(pool);
    if (ok)
        pool_shrink(pool, keep);
    pthread_mutex_unlock(&sim_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Sets attribute attr of pool from *v; sim_mu held, pool valid. */
static CUresult pool_set_locked(CUmemoryPool pool, CUmemPool_attribute attr, const void *v)
{
    if (attr >= 1 && attr <= 3)
        pool->reuse[attr] = *(const int *)v;
    else if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        pool->threshold = *(const cuuint64_t *)v;
    else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH && !*(const cuuint64_t *)v)
        pool->reserved_high = pool->reserved;
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH && !*(const cuuint64_t *)v)
        pool->used_high = pool->used;
    else
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* Reads attribute attr of pool into *v; sim_mu held, pool valid. */
static CUresult pool_get_locked(CUmemoryPool pool, CUmemPool_attribute attr, void *v)
{
    if (attr >= 1 && attr <= 3)
        *(int *)v = pool->reuse[attr];
    else if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        *(cuuint64_t *)v = pool->threshold;
    else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
        *(cuuint64_t *)v = pool->reserved;
    else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
        *(cuuint64_t *)v = pool->reserved_high;
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        *(cuuint64_t *)v = pool->used;
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH)
        *(cuuint64_t *)v = pool->used_high;
    else
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* cuMemPoolSetAttribute (set) and cuMemPoolGetAttribute: the checks and
 * the lock they share. */
static CUresult pool_attribute(CUmemoryPool pool, CUmemPool_attribute attr, void *v, int set)
{
    SIM_TRY(sim_check_args(!v));
    pthread_mutex_lock(&sim_mu);
    CUresult rc = !pool_ok(pool) ? CUDA_ERROR_INVALID_VALUE
                  : set          ? pool_set_locked(pool, attr, v)
                                 : pool_get_locked(pool, attr, v);
    pthread_mutex_unlock(&sim_mu);
    return rc;
}

SIM_API CUresult cuMemPoolSetAttribute(CUmemoryPool pool,
                                       CUmemPool_attribute attr, void *v)
{
    return pool_attribute(pool, attr, v, 1);
}

SIM_API CUresult cuMemPoolGetAttribute(CUmemoryPool pool,
                                       CUmemPool_attribute attr, void *v)
{
    return pool_attribute(pool, attr, v, 0);
}

/* ---- device <-> pool ------------------------------------------------- */

/* dev's default pool (current == 0) or current one. */
static CUresult get_pool(CUmemoryPool *pool, CUdevice dev, int current)
{
    SIM_TRY(sim_check_dev(pool != NULL, dev, NULL));
    pthread_mutex_lock(&sim_mu);
    *pool = current ? cur_pool(dev) : def_pool(dev);
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    return get_pool(pool, dev, 0);
}

SIM_API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    return get_pool(pool, dev, 1);
}

SIM_API CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    CUresult rc = sim_check_dev(1, dev, NULL);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    if (pool == &g_def[dev])
        def_pool(dev);
    if (!pool_ok(pool) || pool->ordinal != dev)
        rc = CUDA_ERROR_INVALID_VALUE;
    else
        g_cur[dev] = pool;
    pthread_mutex_unlock(&sim_mu);
    return rc;
}
