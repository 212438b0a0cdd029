/*
 * hooks_pool.c - the stream-ordered allocator (memory pools): the hooks of
 * cuMemAllocAsync, cuMemAllocFromPoolAsync, cuMemFreeAsync and the
 * cuMemPool* calls that grow, shrink or end a pool.  What a pool is charged
 * (its reserve, as the driver reports it), and the records that hold it,
 * are in pool_account.c.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "oversub.h"
#include "pool_int.h"

typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*alloc_pool_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);

/* The device of a pool not made through cuMemPoolCreate here: a device's
 * default or current pool.  Pools may serve streams of other devices, so
 * the stream's device is only the last resort, for a pool that is neither. */
static int pool_device(CUmemoryPool p, CUstream stream, int *ordinal)
{
    typedef CUresult (*getpool_fn)(CUmemoryPool *, CUdevice);
    int n = 0;
    if (GV_REAL(cuDeviceGetCount, CUresult (*)(int *))(&n) == CUDA_SUCCESS) {
        for (int i = 0; i < n; i++) {
            CUmemoryPool q = NULL;
            if ((GV_REAL(cuDeviceGetDefaultMemPool, getpool_fn)(&q, i) == CUDA_SUCCESS && q == p) ||
                (GV_REAL(cuDeviceGetMemPool, getpool_fn)(&q, i) == CUDA_SUCCESS && q == p)) {
                *ordinal = i;
                return 1;
            }
        }
    }
    return gv_ordinal_of_stream(stream, ordinal, NULL) == CUDA_SUCCESS;
}

struct async_args {
    void *real;
    CUdeviceptr *dptr;
    size_t n;
    CUmemoryPool pool;
    CUstream stream;
};

static CUresult call_alloc_async(void *v)
{
    struct async_args *a = v;
    return ((alloc_async_fn)a->real)(a->dptr, a->n, a->stream);
}

static CUresult call_alloc_pool(void *v)
{
    struct async_args *a = v;
    return ((alloc_pool_fn)a->real)(a->dptr, a->n, a->pool, a->stream);
}

/* Under CUDA_OVERSUBSCRIBE, an allocation whose pool would have to grow
 * past what the device may give this container (oversub.c) is served from
 * host memory instead, as cuMemAlloc's is: managed memory advised to the
 * host (its part within the rules prefetched to the device), charged like
 * any allocation and recorded as spilled.  It is no block of the pool:
 * cuMemFreeAsync of it waits for its stream, then frees it (free_async
 * below), and cuMemFree frees it at once. */
/* The device had no room for the pool's growth: none for the spill
 * either, whatever the rules would let it take. */
static CUresult refuse_device(CUdeviceptr *dptr, void *arg)
{
    (void)dptr;
    (void)arg;
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult spill_async(int why, int ordinal, CUdeviceptr *dptr, size_t n)
{
    /* Managed memory is made in the current context, placed on its device:
     * one of another device cannot take it (the driver's refusal stands). */
    int cur;
    CUcontext ctx;
    if (gv_current(&cur, &ctx) != CUDA_SUCCESS || cur != ordinal)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gv_charge c;
    CUresult rc = gv_charge_begin(&c, ordinal, ctx, n);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t spilled = 0;
    rc = !c.active ? CUDA_ERROR_OUT_OF_MEMORY
         : gv_oversub_alloc(&c, dptr, n, &spilled,
                            why == GV_SPILL_REFUSED ? refuse_device : NULL, NULL, 0);
    if (rc != CUDA_SUCCESS) {
        gv_charge_cancel(&c);
        return rc;
    }
    /* A spilled entry even when all of it went to the device after all
     * (the others freed meanwhile): managed memory is freed as such. */
    gv_charge_commit(&c, GV_K_SPILL, *dptr, spilled);
    return CUDA_SUCCESS;
}

/* An allocation into a stream being captured becomes a graph allocation
 * node: it takes nothing now, and hooks_graph.c charges the graph's launch. */
static int capturing(CUstream stream, int ptsz)
{
    typedef CUresult (*capturing_fn)(CUstream, CUstreamCaptureStatus *);
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult rc = ptsz ? GV_REAL(cuStreamIsCapturing_ptsz, capturing_fn)(stream, &st)
                       : GV_REAL(cuStreamIsCapturing, capturing_fn)(stream, &st);
    return rc == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

static CUresult alloc_async(alloc_async_fn real, free_async_fn real_free,
                            CUdeviceptr *dptr, size_t n, CUstream stream, int ptsz)
{
    GV_ENFORCING_OR(real(dptr, n, stream));
    if (capturing(stream, ptsz))
        return real(dptr, n, stream);
    int ordinal;
    CUmemoryPool pool = NULL;
    if (!dptr || n == 0 || gv_ordinal_of_stream(stream, &ordinal, NULL) != CUDA_SUCCESS ||
        GV_REAL(cuDeviceGetMemPool, CUresult (*)(CUmemoryPool *, CUdevice))(&pool, ordinal) != CUDA_SUCCESS)
        return real(dptr, n, stream);
    pool_rec *r;
    if (!gv_pool_find(pool) && !gv_pool_live(pool))
        return real(dptr, n, stream);
    CUresult rc = gv_pool_rec_for(pool, ordinal, 0, &r);
    if (rc != CUDA_SUCCESS)
        return rc == CUDA_ERROR_INVALID_DEVICE ? real(dptr, n, stream) : rc;
    if (r->host)
        return real(dptr, n, stream);
    struct async_args a = { (void *)real, dptr, n, pool, stream };
    int spill = 0;
    pthread_mutex_lock(&r->lock);
    rc = gv_pool_alloc(r, n, dptr, stream, call_alloc_async, &a, real_free, &spill);
    pthread_mutex_unlock(&r->lock);
    return spill ? spill_async(spill, ordinal, dptr, n) : rc;
}

static CUresult alloc_from_pool(alloc_pool_fn real, free_async_fn real_free, CUdeviceptr *dptr,
                                size_t n, CUmemoryPool pool, CUstream stream, int ptsz)
{
    GV_ENFORCING_OR(real(dptr, n, pool, stream));
    if (!dptr || n == 0 || !pool || capturing(stream, ptsz))
        return real(dptr, n, pool, stream);
    gv_pool_setup();
    pool_rec *r = gv_pool_find(pool);
    int ordinal;
    if (!r) {
        /* Not recorded at cuMemPoolCreate: a device's default pool, or a
         * handle the driver refuses (destroyed, or no pool at all), which
         * takes no record and no charge. */
        if (!gv_pool_live(pool) || !pool_device(pool, stream, &ordinal))
            return real(dptr, n, pool, stream);
        CUresult rc = gv_pool_rec_for(pool, ordinal, 0, &r);
        if (rc != CUDA_SUCCESS)
            return rc == CUDA_ERROR_INVALID_DEVICE ? real(dptr, n, pool, stream) : rc;
    }
    if (r->host)                /* host memory: no device's quota */
        return real(dptr, n, pool, stream);
    struct async_args a = { (void *)real, dptr, n, pool, stream };
    int spill = 0;
    pthread_mutex_lock(&r->lock);
    CUresult rc = gv_pool_alloc(r, n, dptr, stream, call_alloc_pool, &a, real_free, &spill);
    pthread_mutex_unlock(&r->lock);
    return spill ? spill_async(spill, r->ordinal, dptr, n) : rc;
}

struct free_args {
    free_async_fn real;
    CUdeviceptr p;
    CUstream stream;
};

static CUresult call_free_async(void *v)
{
    struct free_args *f = v;
    return f->real(f->p, f->stream);
}

static CUresult free_async(free_async_fn real, CUdeviceptr p, CUstream stream, int ptsz)
{
    GV_ENFORCING_ELSE_PASS(real(p, stream));
    /* Captured, it only records a free node (of a graph allocation, which
     * nothing here charged): the memory stays until the graph runs it. */
    if (capturing(stream, ptsz))
        return real(p, stream);
    struct free_args f = { real, p, stream };
    CUresult rc;
    if (gv_pool_free_block(p, call_free_async, &f, &rc))
        return rc;
    if (gv_graph_free_alloc(p, call_free_async, &f, &rc))
        return rc;
    /* A plain allocation may also be freed stream-ordered: the driver frees
     * it when the stream gets there, and its charge stays until then
     * (pending_free.c), in flight as cuMemFree's is. */
    gv_alloc a;
    gv_charge_flying();
    if (gv_table_take(GV_K_SPILL, p, &a)) {
        /* Spilled (managed) memory is not the stream-ordered allocator's:
         * wait for the stream, then free it (oversub.c). */
        rc = GV_REAL(cuStreamSynchronize, CUresult (*)(CUstream))(stream);
        if (rc == CUDA_SUCCESS)
            rc = GV_REAL(cuMemFree_v2, CUresult (*)(CUdeviceptr))(p);
        if (rc == CUDA_SUCCESS)
            gv_uncharge_alloc(&a);
        else
            gv_table_put(&a);
        gv_charge_landed();
        return rc;
    }
    if (!gv_table_take(GV_K_PTR, p, &a)) {
        gv_charge_landed();
        return real(p, stream);
    }
    rc = real(p, stream);
    if (rc != CUDA_SUCCESS) {
        gv_table_put(&a);
        gv_charge_landed();
        return rc;
    }
    gv_pending_free(a.dev, a.bytes, stream, ptsz);
    return rc;
}

GV_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t n, CUstream s)
{
    return alloc_async(GV_REAL(cuMemAllocAsync, alloc_async_fn),
                       GV_REAL(cuMemFreeAsync, free_async_fn), dptr, n, s, 0);
}

GV_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t n, CUstream s)
{
    return alloc_async(GV_REAL(cuMemAllocAsync_ptsz, alloc_async_fn),
                       GV_REAL(cuMemFreeAsync_ptsz, free_async_fn), dptr, n, s, 1);
}

GV_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t n, CUmemoryPool p, CUstream s)
{
    return alloc_from_pool(GV_REAL(cuMemAllocFromPoolAsync, alloc_pool_fn),
                           GV_REAL(cuMemFreeAsync, free_async_fn), dptr, n, p, s, 0);
}

GV_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t n, CUmemoryPool p,
                                                CUstream s)
{
    return alloc_from_pool(GV_REAL(cuMemAllocFromPoolAsync_ptsz, alloc_pool_fn),
                           GV_REAL(cuMemFreeAsync_ptsz, free_async_fn), dptr, n, p, s, 1);
}

GV_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    return free_async(GV_REAL(cuMemFreeAsync, free_async_fn), p, s, 0);
}

GV_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s)
{
    return free_async(GV_REAL(cuMemFreeAsync_ptsz, free_async_fn), p, s, 1);
}

GV_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    typedef CUresult (*fn)(CUmemoryPool *, const CUmemPoolProps *);
    fn real = GV_REAL(cuMemPoolCreate, fn);
    GV_ENFORCING_OR(real(pool, props));
    CUresult rc = real(pool, props);
    if (rc != CUDA_SUCCESS || !props)
        return rc;
    pool_rec *r;
    CUresult own;
    if (props->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        own = gv_pool_rec_for(*pool, props->location.id, 1, &r);
        /* Its blocks may be exported (IPC) or its size was capped: they
         * must come from the pool itself, never from host memory. */
        if (own == CUDA_SUCCESS)
            r->fixed = props->handleTypes != CU_MEM_HANDLE_TYPE_NONE || props->maxSize != 0;
    } else {
        /* Host-located (CUDA 12.2+): recorded so that its allocations pass
         * uncharged; unrecorded, they would be charged to a device. */
        gv_pool_setup();
        own = gv_pool_claim_once(*pool, -1, -1, 1, 1, &r);
    }
    if (own != CUDA_SUCCESS && own != CUDA_ERROR_INVALID_DEVICE) {
        /* It could not be accounted for: refused now rather than at its
         * first allocation. */
        GV_REAL(cuMemPoolDestroy, CUresult (*)(CUmemoryPool))(*pool);
        *pool = NULL;
        return own;
    }
    return rc;
}

GV_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    typedef CUresult (*fn)(CUmemoryPool, size_t);
    fn real = GV_REAL(cuMemPoolTrimTo, fn);
    GV_ENFORCING_ELSE_PASS(real(pool, keep));
    gv_pool_setup();
    pool_rec *r = gv_pool_find(pool);
    if (!r || r->host)
        return real(pool, keep);
    pthread_mutex_lock(&r->lock);
    gv_charge_flying();             /* the reserve shrinks before its charge */
    CUresult rc = real(pool, keep);
    gv_pool_settle(r);
    gv_charge_landed();
    pthread_mutex_unlock(&r->lock);
    return rc;
}

static int is_block_of(const gv_alloc *a, void *pool)
{
    return a->kind == GV_K_POOLPTR && a->aux == (uint64_t)(uintptr_t)pool;
}

GV_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    typedef CUresult (*fn)(CUmemoryPool);
    fn real = GV_REAL(cuMemPoolDestroy, fn);
    GV_ENFORCING_ELSE_PASS(real(pool));
    gv_pool_setup();
    pool_rec *r = gv_pool_find(pool);
    if (!r)
        return real(pool);
    if (r->host) {
        pthread_mutex_lock(&r->lock);
        CUresult rc = real(pool);
        if (rc == CUDA_SUCCESS)
            gv_pool_release_rec(r);
        pthread_mutex_unlock(&r->lock);
        return rc;
    }
    CUmemoryPool dflt = NULL;
    if (GV_REAL(cuDeviceGetDefaultMemPool, CUresult (*)(CUmemoryPool *, CUdevice))(
            &dflt, r->ordinal) == CUDA_SUCCESS && dflt == pool)
        return real(pool);      /* refused by the driver: the pool stays as it is */
    pthread_mutex_lock(&r->lock);
    gv_charge_flying();             /* the reserve goes before its charge */
    /* The driver keeps a destroyed pool's outstanding blocks until they are
     * freed: trim first, so that what stays charged is the reserve that
     * backs them, until the last of them is freed. */
    GV_REAL(cuMemPoolTrimTo, CUresult (*)(CUmemoryPool, size_t))(pool, 0);
    gv_pool_settle(r);
    uint64_t blocks = gv_table_count_if(is_block_of, pool);
    CUresult rc = real(pool);
    if (rc == CUDA_SUCCESS) {
        if (blocks && r->charged) {
            r->blocks = blocks;
            atomic_store(&r->destroyed, 1);
        } else {
            gv_uncharge(r->dev, r->charged);
            gv_pool_release_rec(r);
        }
    }
    gv_charge_landed();
    pthread_mutex_unlock(&r->lock);
    return rc;
}

const gv_hook gv_hooks_pool[] = {
    { "cuMemAllocAsync", (void *)cuMemAllocAsync },
    { "cuMemAllocAsync_ptsz", (void *)cuMemAllocAsync_ptsz },
    { "cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync },
    { "cuMemAllocFromPoolAsync_ptsz", (void *)cuMemAllocFromPoolAsync_ptsz },
    { "cuMemFreeAsync", (void *)cuMemFreeAsync },
    { "cuMemFreeAsync_ptsz", (void *)cuMemFreeAsync_ptsz },
    { "cuMemPoolCreate", (void *)cuMemPoolCreate },
    { "cuMemPoolTrimTo", (void *)cuMemPoolTrimTo },
    { "cuMemPoolDestroy", (void *)cuMemPoolDestroy },
    { NULL, NULL }
};
