/*
 * graph_live.c - which graph allocations are live (hooks_graph.c charges
 * the pools they come from).
 *
 * A launch of a graph is charged what its pool may grow by, less the
 * graph's own allocations still live, because a relaunch either frees them
 * first (CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, which PyTorch
 * uses) or is refused by the driver (CUDA_ERROR_INVALID_VALUE).  Which are
 * live is kept by address (GV_K_GALLOC, nothing charged): put by the
 * launch that ran an allocation node, taken by a free node's launch, by
 * cuMemFree / cuMemFreeAsync (under the device's pool mutex, so never
 * while a launch counts it) and by its context's destruction.  In doubt an
 * allocation counts as not live: the relaunch is then charged in full.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "graph_int.h"

typedef CUresult (*capturing_fn)(CUstream, CUstreamCaptureStatus *);

/* Context destructions begun and done: the driver frees a destroyed
 * context's graph allocations before their GV_K_GALLOC entries go, so
 * while one is under way no entry is taken for live. */
static atomic_ulong teardowns_begun, teardowns_done;

void gv_graph_live_child_reset(void)
{
    atomic_store(&teardowns_begun, 0);
    atomic_store(&teardowns_done, 0);
}

unsigned long gv_graph_teardowns(int *calm)
{
    unsigned long done = atomic_load(&teardowns_done);
    unsigned long begun = atomic_load(&teardowns_begun);
    *calm = begun == done;
    return begun;
}

/* Bytes of r's allocations on ordinal that are live now (GV_K_GALLOC; the
 * pool's lock held, which frees and launches of them take): with
 * CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH the driver frees them
 * before the launch allocates them again, and without it the launch is
 * refused.  Read after the pool's use: a free after that lowers both.
 * None while a context is being destroyed (its allocations freed by the
 * driver, their entries not yet gone): done is read first, so equal counts
 * mean none was under way then. */
uint64_t gv_graph_own_live(const gexec *r, int ordinal)
{
    unsigned long done = atomic_load(&teardowns_done);
    if (atomic_load(&teardowns_begun) != done)
        return 0;
    uint64_t live = 0;
    for (size_t i = 0; i < r->n; i++) {
        gv_alloc a;
        if (r->ops[i].size && r->ops[i].ordinal == ordinal &&
            gv_table_get(GV_K_GALLOC, r->ops[i].addr, &a) &&
            GV_GALLOC_ORDINAL(a.aux) == ordinal)
            live += GV_GALLOC_SIZE(a.aux);
    }
    return live;
}

/* Take r's addresses for freed (in doubt, not live: a relaunch is then
 * charged in full). */
void gv_graph_forget_live(const gexec *r)
{
    for (size_t i = 0; i < r->n; i++)
        gv_table_take(GV_K_GALLOC, r->ops[i].addr, NULL);
}

static int stream_capturing(CUstream s, int ptsz)
{
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult rc = ptsz ? GV_REAL(cuStreamIsCapturing_ptsz, capturing_fn)(s, &st)
                       : GV_REAL(cuStreamIsCapturing, capturing_fn)(s, &st);
    return rc != CUDA_SUCCESS || st != CU_STREAM_CAPTURE_STATUS_NONE;
}

void gv_graph_mem_launched(gv_graph_mem *m, CUresult rc, CUstream s, int ptsz)
{
    const gexec *r = m->rec;
    if (!r)
        return;
    if (rc != CUDA_SUCCESS) {
        /* Refused before it ran, as CUDA answers; but a launch that can
         * free is not trusted to have freed nothing. */
        if (r->autofree || r->frees)
            gv_graph_forget_live(r);
        return;
    }
    if (!m->calm || stream_capturing(s, ptsz) ||
        atomic_load(&teardowns_begun) != m->begun) {
        gv_graph_forget_live(r);
        return;
    }
    CUcontext ctx = NULL;
    int ord;
    if (gv_ordinal_of_stream(s, &ord, &ctx) != CUDA_SUCCESS)
        ctx = NULL;                     /* dropped at any context's destruction */
    /* Live now: (what was) + its allocations - its frees. */
    for (size_t i = 0; i < r->n; i++) {
        const gop *op = &r->ops[i];
        if (!op->size)
            continue;
        const gv_devinfo *d;
        gv_alloc a = { .key = op->addr, .kind = GV_K_GALLOC,
                       .dev = gv_device(op->ordinal, &d) == CUDA_SUCCESS ? d->region_dev : -1,
                       .bytes = 0, .aux = GV_GALLOC_AUX(op->size, op->ordinal), .ctx = ctx };
        gv_table_put(&a);               /* (out of memory: taken for not live) */
    }
    for (size_t i = 0; i < r->n; i++)
        if (!r->ops[i].size)
            gv_table_take(GV_K_GALLOC, r->ops[i].addr, NULL);
    /* A context destruction begun meanwhile may have missed these entries. */
    if (atomic_load(&teardowns_begun) != m->begun)
        gv_graph_forget_live(r);
}

/* Free p through call(arg) if it is a live graph allocation, under its
 * device's pool lock (so that no launch reads it live meanwhile): its
 * entry goes, and comes back if the driver refuses. */
int gv_graph_free_alloc(CUdeviceptr p, CUresult (*call)(void *), void *arg, CUresult *rc)
{
    gv_alloc a;
    if (!gv_graph_mem_seen() || !gv_table_get(GV_K_GALLOC, p, &a))
        return 0;
    int ordinal = GV_GALLOC_ORDINAL(a.aux);
    if (ordinal < 0 || ordinal >= GV_MAX_ORDINALS)
        return 0;
    pthread_mutex_t *lock = gv_graph_pool_lock(ordinal);
    pthread_mutex_lock(lock);
    if (!gv_table_take(GV_K_GALLOC, p, &a)) {
        pthread_mutex_unlock(lock);
        return 0;                       /* freed meanwhile: the driver answers */
    }
    *rc = call(arg);
    if (*rc != CUDA_SUCCESS)
        gv_table_put(&a);
    pthread_mutex_unlock(lock);
    return 1;
}

/* A context is being destroyed: its graph allocations go with it. */
void gv_graph_teardown_begin(void) { atomic_fetch_add(&teardowns_begun, 1); }

static int galloc_of(const gv_alloc *a, void *ctx)
{
    return a->kind == GV_K_GALLOC && (a->ctx == ctx || a->ctx == NULL);
}

static void no_visit(const gv_alloc *a, void *arg)
{
    (void)a;
    (void)arg;
}

void gv_graph_teardown_end(CUcontext ctx, int destroyed)
{
    if (destroyed && gv_graph_mem_seen())
        gv_table_take_all(galloc_of, no_visit, ctx);
    atomic_fetch_add(&teardowns_done, 1);
}
