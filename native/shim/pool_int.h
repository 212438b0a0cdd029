/*
 * pool_int.h - what hooks_pool.c (the memory pool hooks) and pool_account.c
 * (the pools' records and the charges on their reserves) share.  Internal
 * to them.
 */
#ifndef GV_POOL_INT_H
#define GV_POOL_INT_H

#include <pthread.h>
#include <stdatomic.h>

#include "hooks.h"

typedef struct pool_rec {
    _Atomic(uintptr_t) pool;     /* 0 = free record */
    atomic_int ready;
    atomic_int destroyed;        /* destroyed with blocks still allocated */
    int host;                    /* host-located: nothing to charge */
    int fixed;                   /* IPC-exportable or capped (maxSize): its
                                    blocks must be its own, never spilled */
    pthread_mutex_t lock;
    int ordinal;
    int dev;                     /* region device entry */
    uint64_t charged;            /* reserve charged to the quota */
    uint64_t blocks;             /* destroyed: blocks not yet freed */
} pool_rec;

typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);

/* pool_account.c (see there).  gv_pool_setup: the records' mutexes, once,
 * before a record is looked up or claimed. */
void gv_pool_setup(void);
pool_rec *gv_pool_find(CUmemoryPool p);
void gv_pool_release_rec(pool_rec *r);
CUresult gv_pool_claim_once(CUmemoryPool p, int ordinal, int dev, int host, int fresh,
                            pool_rec **out);
CUresult gv_pool_rec_for(CUmemoryPool p, int ordinal, int fresh, pool_rec **out);
int gv_pool_live(CUmemoryPool p);
void gv_pool_settle(pool_rec *r);
enum { GV_SPILL_RULES = 1, GV_SPILL_REFUSED = 2 };   /* gv_pool_alloc's *spill */
CUresult gv_pool_alloc(pool_rec *r, size_t n, CUdeviceptr *dptr, CUstream stream,
                       CUresult rc_call(void *), void *arg, free_async_fn real_free,
                       int *spill);

#endif
