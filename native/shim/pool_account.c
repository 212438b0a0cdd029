/*
 * pool_account.c - the records of the memory pools the hooks of
 * hooks_pool.c meet, and the charges on their reserves.
 *
 * A pool holds physical memory (its reserve) beyond what is allocated from
 * it, and keeps it after cuMemFreeAsync until a synchronisation or a trim
 * gives it back.  So the quota is charged with each pool's reserve, read
 * from the driver (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), not with the
 * sizes of the blocks: nothing the driver really holds goes uncounted.
 * The synchronisation hooks (pending_free.c) and every reading of untracked
 * memory (untracked.c) settle the charges on the reserves, and no such
 * reading is used while a pool is charged more than its reserve.
 *
 * Pools are found in a fixed table without a global lock (CAS to claim a
 * record); each record has its own mutex, held across the driver call that
 * may grow or shrink that pool.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "oversub.h"
#include "pool_int.h"

#define MAX_POOLS 256

static pool_rec pools[MAX_POOLS];
static atomic_int active;        /* records in use */
/* Serialises claiming records (once per pool, off the allocation path), so
 * that two threads meeting a pool for the first time make one record. */
static pthread_mutex_t claim_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;

typedef CUresult (*getattr_fn)(CUmemoryPool, CUmemPool_attribute, void *);

static void child_reset(void)
{
    /* A forked child holds no pools of its own. */
    pthread_mutex_init(&claim_lock, NULL);
    for (int i = 0; i < MAX_POOLS; i++) {
        pthread_mutex_init(&pools[i].lock, NULL);
        atomic_store(&pools[i].pool, 0);
        atomic_store(&pools[i].ready, 0);
        atomic_store(&pools[i].destroyed, 0);
        pools[i].charged = 0;
        pools[i].blocks = 0;
    }
    atomic_store(&active, 0);
}

static void setup(void)
{
    for (int i = 0; i < MAX_POOLS; i++)
        pthread_mutex_init(&pools[i].lock, NULL);
    pthread_atfork(NULL, NULL, child_reset);
}

void gv_pool_setup(void) { pthread_once(&setup_once, setup); }

static uint64_t pool_attr(CUmemoryPool p, CUmemPool_attribute attr)
{
    cuuint64_t v = 0;
    if (GV_REAL(cuMemPoolGetAttribute, getattr_fn)(p, attr, &v) != CUDA_SUCCESS)
        return UINT64_MAX;
    return v;
}

/* The record of pool p: a live pool's, or (any) also a destroyed one's
 * whose blocks are not all freed yet. */
static pool_rec *lookup(CUmemoryPool p, int any)
{
    for (int i = 0; i < MAX_POOLS; i++)
        if (atomic_load_explicit(&pools[i].pool, memory_order_acquire) == (uintptr_t)p &&
            atomic_load_explicit(&pools[i].ready, memory_order_acquire) &&
            (any || !atomic_load(&pools[i].destroyed)))
            return &pools[i];
    return NULL;
}

pool_rec *gv_pool_find(CUmemoryPool p) { return lookup(p, 0); }

void gv_pool_release_rec(pool_rec *r)
{
    r->charged = 0;
    r->blocks = 0;
    atomic_store(&r->ready, 0);
    atomic_store(&r->destroyed, 0);
    atomic_store(&r->pool, 0);
    atomic_fetch_sub(&active, 1);
}

/* A new pool has the handle of a destroyed one that still had blocks: the
 * driver has let the old pool go, so its blocks went with it unseen (a
 * context destroyed, say).  Its charge goes too. */
static void forget_destroyed(CUmemoryPool p)
{
    pool_rec *r = lookup(p, 1);
    if (!r)
        return;
    pthread_mutex_lock(&r->lock);
    if (atomic_load(&r->destroyed) && atomic_load(&r->pool) == (uintptr_t)p) {
        gv_uncharge(r->dev, r->charged);
        gv_pool_release_rec(r);
    }
    pthread_mutex_unlock(&r->lock);
}

/* Claim a record for pool p (claim_lock held), or find the one it has;
 * CUDA_ERROR_OUT_OF_MEMORY when every record is in use. */
static CUresult claim(CUmemoryPool p, int ordinal, int dev, int host, pool_rec **out)
{
    for (int i = 0; i < MAX_POOLS; i++) {
        for (;;) {
            uintptr_t expected = 0;
            if (atomic_compare_exchange_strong(&pools[i].pool, &expected, (uintptr_t)p)) {
                pools[i].ordinal = ordinal;
                pools[i].dev = dev;
                pools[i].host = host;
                pools[i].fixed = 0;
                pools[i].charged = 0;
                atomic_fetch_add(&active, 1);
                atomic_store_explicit(&pools[i].ready, 1, memory_order_release);
                *out = &pools[i];
                return CUDA_SUCCESS;
            }
            if (expected != (uintptr_t)p)
                break;                      /* another pool's: the next record */
            if (atomic_load_explicit(&pools[i].ready, memory_order_acquire)) {
                *out = &pools[i];
                return CUDA_SUCCESS;
            }
            /* p's record being released (gv_pool_release_rec clears ready
             * before pool): look at it again. */
        }
    }
    gv_log(GV_LOG_ERROR, "more than %d memory pools in use; allocations from another one "
                         "are refused (CUDA_ERROR_OUT_OF_MEMORY)", MAX_POOLS);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* p's record, claimed under claim_lock unless it has one (fresh: p was just
 * created, so a destroyed pool's record with its handle is forgotten). */
CUresult gv_pool_claim_once(CUmemoryPool p, int ordinal, int dev, int host, int fresh,
                            pool_rec **out)
{
    pthread_mutex_lock(&claim_lock);
    if (fresh)
        forget_destroyed(p);
    pool_rec *r = gv_pool_find(p);
    CUresult rc = r ? CUDA_SUCCESS : claim(p, ordinal, dev, host, &r);
    pthread_mutex_unlock(&claim_lock);
    *out = r;
    return rc;
}

/* Record for the live device pool p on ordinal, claiming one if new (with
 * fresh set: p was just created, so a destroyed pool's record with its
 * handle is forgotten).  Fails with gv_device's error, or
 * CUDA_ERROR_OUT_OF_MEMORY when every record is in use: a pool that cannot
 * be accounted for is not used (fail closed). */
CUresult gv_pool_rec_for(CUmemoryPool p, int ordinal, int fresh, pool_rec **out)
{
    pthread_once(&setup_once, setup);
    pool_rec *r = gv_pool_find(p);
    if (r) {
        *out = r;
        return CUDA_SUCCESS;
    }
    const gv_devinfo *d;
    CUresult rc = gv_device(ordinal, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    return gv_pool_claim_once(p, ordinal, d->region_dev, 0, fresh, out);
}

/* Whether p is a pool the driver knows, and no destroyed one this process
 * still keeps a record of (it takes no allocations: the driver refuses it). */
int gv_pool_live(CUmemoryPool p)
{
    pool_rec *r = lookup(p, 1);     /* (a live one: claimed by another thread) */
    if (r && atomic_load(&r->destroyed))
        return 0;
    return pool_attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) != UINT64_MAX;
}

/* Bring the charge in line with the driver's reserve (lock held). */
void gv_pool_settle(pool_rec *r)
{
    if (r->host)
        return;
    uint64_t reserved = pool_attr((CUmemoryPool)atomic_load(&r->pool),
                                  CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    if (reserved == UINT64_MAX || reserved == r->charged)
        return;
    if (reserved < r->charged) {
        gv_uncharge(r->dev, r->charged - reserved);
        r->charged = reserved;
        return;
    }
    gv_charge c;
    if (gv_charge_begin(&c, r->ordinal, NULL, reserved - r->charged) == CUDA_SUCCESS) {
        r->charged += c.bytes;
        gv_charge_keep(&c);
    } else {
        gv_log(GV_LOG_WARN, "pool reserve grew to %llu bytes past the quota",
               (unsigned long long)reserved);
    }
}

int gv_pools_active(void) { return atomic_load_explicit(&active, memory_order_relaxed) > 0; }

void gv_pools_refresh(void)
{
    if (!gv_pools_active())
        return;
    for (int i = 0; i < MAX_POOLS; i++) {
        pool_rec *r = &pools[i];
        if (!atomic_load(&r->pool) || !atomic_load(&r->ready) || atomic_load(&r->destroyed) ||
            r->host)
            continue;
        if (pthread_mutex_trylock(&r->lock) == 0) {
            if (!atomic_load(&r->destroyed))
                gv_pool_settle(r);
            pthread_mutex_unlock(&r->lock);
        }
    }
}

int gv_pools_settled(void)
{
    if (!gv_pools_active())
        return 1;
    for (int i = 0; i < MAX_POOLS; i++) {
        pool_rec *r = &pools[i];
        uintptr_t p = atomic_load(&r->pool);
        if (!p || !atomic_load(&r->ready) || atomic_load(&r->destroyed) || r->host)
            continue;
        if (pthread_mutex_trylock(&r->lock) != 0)
            return 0;               /* being grown, shrunk or settled right now */
        int ok = 1;
        if (atomic_load(&r->pool) == p && !atomic_load(&r->destroyed)) {
            uint64_t reserved = pool_attr((CUmemoryPool)p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
            ok = reserved == UINT64_MAX || reserved >= r->charged;
        }
        pthread_mutex_unlock(&r->lock);
        if (!ok)
            return 0;
    }
    return 1;
}

/* The record of the pool a block came from (aux of its GV_K_POOLPTR
 * entry).  A destroyed pool's handle cannot be given to a new pool while
 * the driver still keeps the old one for its blocks. */
static pool_rec *rec_of_block(uint64_t aux) { return lookup((CUmemoryPool)(uintptr_t)aux, 1); }

/* A block of r was freed (lock held): a live pool's charge follows its
 * reserve; a destroyed pool's keeps what it held until its last block is
 * freed, when the driver releases the pool. */
static void block_freed(pool_rec *r)
{
    if (!atomic_load(&r->destroyed)) {
        gv_pool_settle(r);
        return;
    }
    if (--r->blocks == 0) {
        gv_uncharge(r->dev, r->charged);
        gv_pool_release_rec(r);
    }
}

/* Free block p through call(arg) (cuMemFree or cuMemFreeAsync) under its
 * pool record's lock, taking the block's entry only once that lock is held.
 * cuMemPoolDestroy counts a pool's blocks under the same lock, so it counts
 * this block or sees it freed, never an entry already taken whose free has
 * not reached the pool: that left the count one short, and a destroyed
 * pool's charge went back while the driver still held its last block.
 * Returns 0 when p is no recorded pool block (nothing done), else 1 with
 * the driver's answer in *rc. */
int gv_pool_free_block(CUdeviceptr p, CUresult (*call)(void *), void *arg, CUresult *rc)
{
    pthread_once(&setup_once, setup);
    gv_alloc a;
    pool_rec *r;
    for (;;) {
        if (!gv_table_get(GV_K_POOLPTR, p, &a))
            return 0;
        r = rec_of_block(a.aux);
        if (!r)
            break;
        pthread_mutex_lock(&r->lock);
        if (atomic_load(&r->pool) == (uintptr_t)a.aux && atomic_load(&r->ready))
            break;
        pthread_mutex_unlock(&r->lock);     /* released meanwhile: look again */
    }
    if (!gv_table_take(GV_K_POOLPTR, p, &a)) {
        /* Another thread freed it first: the driver answers this free. */
        if (r)
            pthread_mutex_unlock(&r->lock);
        return 0;
    }
    /* In flight until the charge follows: the driver may give the pool's
     * memory back (a destroyed pool's, with its last block) in the call. */
    gv_charge_flying();
    *rc = call(arg);
    if (*rc != CUDA_SUCCESS)
        gv_table_put(&a);
    if (r) {
        if (*rc == CUDA_SUCCESS)
            block_freed(r);
        else if (!atomic_load(&r->destroyed))
            gv_pool_settle(r);
        pthread_mutex_unlock(&r->lock);
    }
    gv_charge_landed();
    return 1;
}

/* Allocate n bytes from pool record r through `call`; lock held by caller.
 * Charges the growth the pool may need first, then settles on the driver's
 * reserve afterwards.  Under CUDA_OVERSUBSCRIBE (spill given, the pool not
 * fixed), a growth the rules do not let on the device (*spill =
 * GV_SPILL_RULES), or that the driver refuses for want of memory
 * (GV_SPILL_REFUSED), is not made: CUDA_ERROR_OUT_OF_MEMORY, nothing
 * charged, and the caller serves the allocation from host memory
 * (hooks_pool.c). */
CUresult gv_pool_alloc(pool_rec *r, size_t n, CUdeviceptr *dptr, CUstream stream,
                       CUresult rc_call(void *), void *arg, free_async_fn real_free,
                       int *spill)
{
    CUmemoryPool p = (CUmemoryPool)atomic_load(&r->pool);
    gv_pool_settle(r);
    uint64_t reserved = pool_attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    uint64_t used = pool_attr(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
    uint64_t spare = (reserved != UINT64_MAX && used != UINT64_MAX && reserved > used)
                     ? reserved - used : 0;
    gv_charge c;
    memset(&c, 0, sizeof c);
    if (n > spare) {
        CUresult rc = gv_charge_begin(&c, r->ordinal, NULL, n - spare);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    int lockfd = -1;
    int may_spill = spill && c.active && !r->fixed && gv_oversub_on();
    if (may_spill && !gv_oversub_device_ok(&c, &lockfd)) {
        gv_charge_cancel(&c);
        *spill = GV_SPILL_RULES;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = rc_call(arg);
    if (rc != CUDA_SUCCESS) {
        if (c.active)
            gv_charge_cancel(&c);
        gv_pool_settle(r);            /* in case the pool grew all the same */
        if (may_spill) {
            gv_oversub_done(r->dev, lockfd);
            *spill = rc == CUDA_ERROR_OUT_OF_MEMORY ? GV_SPILL_REFUSED : 0;
        }
        return rc;
    }
    if (c.active) {
        r->charged += c.bytes;       /* gv_pool_settle() below trims it to the truth */
        gv_charge_keep(&c);
    }
    uint64_t before = r->charged;
    gv_pool_settle(r);
    uint64_t now = pool_attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    if (now != UINT64_MAX && now > r->charged) {
        /* The pool grew past what the quota could take: undo. */
        real_free(*dptr, stream);
        GV_REAL(cuMemPoolTrimTo, CUresult (*)(CUmemoryPool, size_t))(p, 0);
        gv_pool_settle(r);
        (void)before;
        if (may_spill)
            gv_oversub_done(r->dev, lockfd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gv_alloc a = { .key = *dptr, .kind = GV_K_POOLPTR, .dev = r->dev, .bytes = 0,
                   .aux = (uint64_t)(uintptr_t)p, .ctx = NULL };
    gv_table_put(&a);
    if (may_spill)
        gv_oversub_done(r->dev, lockfd);
    return CUDA_SUCCESS;
}
