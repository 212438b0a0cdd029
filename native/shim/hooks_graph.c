/*
 * hooks_graph.c - graph memory: what a graph's allocation nodes take.
 *
 * A graph allocation (cuGraphAddMemAllocNode, or cuMemAllocAsync captured
 * into a graph) gets its address when the node is made, but its physical
 * memory only when the graph is launched or uploaded, from a per-device
 * graph pool that keeps it after the allocation is freed, until
 * cuDeviceGraphMemTrim.  A cuMemAllocAsync captured into a graph therefore
 * takes nothing (pool_account.c settles on the ordinary pool's reserve, which
 * it does not move), and the quota is charged here instead:
 *
 *  - instantiation records the executable graph's memory nodes (read with
 *    cuGraphGetNodes / cuGraphNodeGetType / cuGraphMem{Alloc,Free}Node-
 *    GetParams), those of its child graphs too (cuGraphChildGraphNode-
 *    GetGraph: CUDA 12.9 lets a graph with memory nodes be moved into a
 *    child graph node), and its flags, in a record its GV_K_GEXEC entry
 *    points to (graph_record.c); a graph whose nodes cannot be read or
 *    recorded, or with child graphs nested deeper than GV_GRAPH_DEPTH, is
 *    destroyed and its instantiation fails (it may have memory nodes);
 *  - a launch or upload of such a graph first charges what the pool may
 *    have to grow (the pool's use, less the graph's own allocations still
 *    live, plus its allocation bytes on the device, less its reserve) and
 *    fails with CUDA_ERROR_OUT_OF_MEMORY, without launching, when the quota
 *    cannot take it; afterwards the charge is settled on the pool's real
 *    reserve (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT).  A pool that cannot
 *    be read is charged all the graph's allocation bytes (the most it can
 *    grow by), kept until it can be read;
 *  - a trim, an executable graph's destruction and a context's destruction
 *    settle it again.
 *
 * The graph's own allocations still live are left out (graph_live.c keeps
 * which are).
 *
 * One mutex per device, held across the launch of a graph with memory
 * nodes on it (several are taken in ascending order; a free node of
 * another graph's allocation locks them all); launches of graphs without
 * memory nodes only read a flag.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "graph_int.h"
#include "log.h"

typedef CUresult (*inst_fn)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
typedef CUresult (*inst_flags_fn)(CUgraphExec *, CUgraph, unsigned long long);
typedef CUresult (*inst_params_fn)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);
typedef CUresult (*exec_fn)(CUgraphExec);
typedef CUresult (*upload_fn)(CUgraphExec, CUstream);
typedef CUresult (*trim_fn)(CUdevice);
typedef CUresult (*attr_fn)(CUdevice, CUgraphMem_attribute, void *);

static struct gpool {
    pthread_mutex_t lock;
    uint64_t charged;            /* the pool's reserve, as charged */
    int dev;                     /* region device entry; valid once charged */
} pools[GV_MAX_ORDINALS];
static atomic_int unreadable_logged;
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;

static void child_reset(void)
{
    /* A forked child holds no graph memory of its own. */
    for (int i = 0; i < GV_MAX_ORDINALS; i++) {
        pthread_mutex_init(&pools[i].lock, NULL);
        pools[i].charged = 0;
    }
    gv_graph_live_child_reset();
}

static void setup(void)
{
    for (int i = 0; i < GV_MAX_ORDINALS; i++)
        pthread_mutex_init(&pools[i].lock, NULL);
    pthread_atfork(NULL, NULL, child_reset);
}

pthread_mutex_t *gv_graph_pool_lock(int ordinal)
{
    pthread_once(&setup_once, setup);
    return &pools[ordinal].lock;
}

static uint64_t pool_attr(int ordinal, CUgraphMem_attribute attr)
{
    uint64_t v = 0;
    if (GV_REAL(cuDeviceGetGraphMemAttribute, attr_fn)((CUdevice)ordinal, attr, &v) !=
        CUDA_SUCCESS)
        return UINT64_MAX;
    return v;
}

/* Bring ordinal's charge in line with its pool's reserve (lock held); an
 * unreadable reserve leaves the charge as it is (a launch then charged all
 * its allocations: nothing it took goes uncharged). */
static void settle(int ordinal)
{
    struct gpool *p = &pools[ordinal];
    uint64_t reserved = pool_attr(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT);
    if (reserved == UINT64_MAX || reserved == p->charged)
        return;
    if (reserved < p->charged) {
        gv_uncharge(p->dev, p->charged - reserved);
        p->charged = reserved;
        return;
    }
    /* The driver already gave it: charged as held, never refused (the
     * launches that grow the pool were checked before they ran). */
    const gv_devinfo *d;
    gv_region *r = gv_core_region();
    int slot = r ? region_self_slot(r) : -1;
    if (slot < 0 || gv_device(ordinal, &d) != CUDA_SUCCESS ||
        region_charge_held(r, d->region_dev, slot, reserved - p->charged) != 0)
        return;
    p->dev = d->region_dev;
    p->charged = reserved;
    if (region_limit(r, d->region_dev) != GV_UNLIMITED &&
        region_used(r, d->region_dev) > region_limit(r, d->region_dev))
        gv_log(GV_LOG_WARN, "graph memory pool of device %d grew to %llu bytes, past the quota",
               ordinal, (unsigned long long)reserved);
}

/* Settle every device's pool (each under its own lock). */
static void settle_all(void)
{
    pthread_once(&setup_once, setup);
    const gv_devinfo *d;
    for (int i = 0; i < GV_MAX_ORDINALS; i++) {
        if (!gv_device_known(i, &d))
            continue;
        pthread_mutex_lock(&pools[i].lock);
        settle(i);
        pthread_mutex_unlock(&pools[i].lock);
    }
}

/* ---- launch and upload ------------------------------------------------ */

/* Lock ordinal's pool and charge what it may grow by for r's launch: its
 * use, less r's allocations that are live (freed or refused first), plus
 * r's allocation bytes there.  The lock stays held on success. */
static CUresult pool_begin(int ordinal, const gexec *r)
{
    struct gpool *p = &pools[ordinal];
    pthread_mutex_lock(&p->lock);
    settle(ordinal);
    if (!r->per[ordinal])
        return CUDA_SUCCESS;            /* only frees there */
    uint64_t used = pool_attr(ordinal, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT);
    uint64_t reserved = pool_attr(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT);
    uint64_t grow = r->per[ordinal];
    if (used == UINT64_MAX || reserved == UINT64_MAX) {
        /* Unreadable: its use being within its reserve, the pool grows by
         * at most r's allocations, charged until a settle can read it. */
        if (!atomic_exchange(&unreadable_logged, 1))
            gv_log(GV_LOG_WARN, "the graph memory pool of device %d cannot be read; "
                   "graph launches are charged all their allocations", ordinal);
    } else {
        uint64_t live = gv_graph_own_live(r, ordinal);
        if (live <= used)               /* (more would be no use the driver counts) */
            used -= live;
        grow = used + grow > reserved ? used + grow - reserved : 0;
    }
    if (grow) {
        gv_charge c;
        CUresult rc = gv_charge_begin(&c, ordinal, NULL, grow);
        if (rc != CUDA_SUCCESS) {
            pthread_mutex_unlock(&p->lock);
            return rc;
        }
        p->dev = c.dev;
        p->charged += c.bytes;   /* settled on the real reserve afterwards */
        gv_charge_keep(&c);
    }
    return CUDA_SUCCESS;
}

static void take_ref(gv_alloc *a, void *arg)
{
    gexec *r = (gexec *)(uintptr_t)a->aux;
    if (r)
        atomic_fetch_add(&r->refs, 1);
    *(gexec **)arg = r;
}

CUresult gv_graph_mem_begin(gv_graph_mem *m, CUgraphExec e)
{
    m->held = 0;
    m->flying = 0;
    m->rec = NULL;
    gexec *r = NULL;
    if (!gv_table_modify(GV_K_GEXEC, (uint64_t)(uintptr_t)e, take_ref, &r))
        return CUDA_SUCCESS;
    int mode = gv_mode_fast();
    if (mode != GV_MODE_ENFORCE) {
        gv_graph_rec_put(r);
        return mode == GV_MODE_PASSTHROUGH ? CUDA_SUCCESS : GV_FAIL_CUDA;
    }
    if (!r)
        return CUDA_ERROR_OUT_OF_MEMORY;       /* (every entry has a record) */
    pthread_once(&setup_once, setup);
    m->rec = r;
    m->begun = gv_graph_teardowns(&m->calm);
    /* In flight from before the first charge until settled (the driver
     * has not answered): no reading of untracked memory in between. */
    m->flying = 1;
    gv_charge_flying();
    /* Ascending order, so that launches on the same devices cannot deadlock. */
    for (int i = 0; i < GV_MAX_ORDINALS; i++) {
        if (!(r->lock & (1ULL << i)))
            continue;
        CUresult rc = pool_begin(i, r);
        if (rc != CUDA_SUCCESS) {
            gv_graph_mem_end(m);      /* gives back what the others charged */
            return rc;
        }
        m->held |= 1ULL << i;
    }
    return CUDA_SUCCESS;
}

void gv_graph_mem_end(gv_graph_mem *m)
{
    for (int i = 0; i < GV_MAX_ORDINALS; i++) {
        if (!(m->held & (1ULL << i)))
            continue;
        settle(i);
        pthread_mutex_unlock(&pools[i].lock);
    }
    if (m->flying)
        gv_charge_landed();
    m->flying = 0;
    m->held = 0;
    gv_graph_rec_put(m->rec);
    m->rec = NULL;
}

static CUresult upload(upload_fn real, CUgraphExec e, CUstream s)
{
    gv_graph_mem m;
    CUresult rc = gv_graph_mem_begin(&m, e);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(e, s);
    gv_graph_mem_end(&m);
    return rc;
}

GV_EXPORT CUresult cuGraphUpload(CUgraphExec e, CUstream s)
{
    return upload(GV_REAL(cuGraphUpload, upload_fn), e, s);
}

GV_EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream s)
{
    return upload(GV_REAL(cuGraphUpload_ptsz, upload_fn), e, s);
}

/* ---- instantiation hooks ---------------------------------------------- */

/* After the real instantiation: track a graph with memory nodes.  One
 * whose memory nodes cannot be read or recorded is destroyed and its
 * instantiation fails (it may have some, whose launches would go
 * uncharged).  (Failing closed needs nothing here: cuInit already refuses.) */
static CUresult instantiated(CUresult rc, CUgraphExec *pe, CUgraph g, unsigned long long flags)
{
    if (rc != CUDA_SUCCESS || !pe || gv_mode_fast() != GV_MODE_ENFORCE)
        return rc;
    if (gv_graph_mem_seen())
        gv_graph_untrack_exec(*pe);             /* a reused handle's */
    rc = gv_graph_track_exec(*pe, g, flags);
    if (rc != CUDA_SUCCESS) {
        gv_log(GV_LOG_ERROR, "the memory nodes of a graph being instantiated cannot be read "
               "or recorded (CUDA error %d); the instantiation is refused", (int)rc);
        GV_REAL(cuGraphExecDestroy, exec_fn)(*pe);
        *pe = NULL;
    }
    return rc;
}

GV_EXPORT CUresult cuGraphInstantiate(CUgraphExec *pe, CUgraph g, CUgraphNode *err, char *log,
                                      size_t n)
{
    return instantiated(GV_REAL(cuGraphInstantiate, inst_fn)(pe, g, err, log, n), pe, g, 0);
}

GV_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *pe, CUgraph g, CUgraphNode *err,
                                         char *log, size_t n)
{
    return instantiated(GV_REAL(cuGraphInstantiate_v2, inst_fn)(pe, g, err, log, n), pe, g, 0);
}

GV_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g,
                                               unsigned long long flags)
{
    return instantiated(GV_REAL(cuGraphInstantiateWithFlags, inst_flags_fn)(pe, g, flags), pe, g,
                        flags);
}

/* With CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD the driver also uploads the graph
 * (and maps its memory): instantiate first, then upload through the hook. */
static CUresult inst_params(inst_params_fn real, upload_fn real_upload, CUgraphExec *pe,
                            CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *prm)
{
    if (!prm || !(prm->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) ||
        gv_mode_fast() != GV_MODE_ENFORCE) {
        CUresult rc = instantiated(real(pe, g, prm), pe, g, prm ? prm->flags : 0);
        if (rc != CUDA_SUCCESS && prm && prm->result_out == 0)
            prm->result_out = 1;    /* CUDA_GRAPH_INSTANTIATE_ERROR: refused here */
        return rc;
    }
    CUDA_GRAPH_INSTANTIATE_PARAMS mine = *prm;
    mine.flags &= ~(cuuint64_t)CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD;
    CUresult rc = instantiated(real(pe, g, &mine), pe, g, mine.flags);
    prm->hErrNode_out = mine.hErrNode_out;
    prm->result_out = rc != CUDA_SUCCESS && mine.result_out == 0 ? 1 : mine.result_out;
    if (rc != CUDA_SUCCESS || !pe)
        return rc;
    rc = upload(real_upload, *pe, prm->hUploadStream);
    if (rc != CUDA_SUCCESS) {
        gv_graph_untrack_exec(*pe);
        GV_REAL(cuGraphExecDestroy, exec_fn)(*pe);
        *pe = NULL;
    }
    return rc;
}

GV_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *pe, CUgraph g,
                                                CUDA_GRAPH_INSTANTIATE_PARAMS *prm)
{
    return inst_params(GV_REAL(cuGraphInstantiateWithParams, inst_params_fn),
                       GV_REAL(cuGraphUpload, upload_fn), pe, g, prm);
}

GV_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *pe, CUgraph g,
                                                     CUDA_GRAPH_INSTANTIATE_PARAMS *prm)
{
    return inst_params(GV_REAL(cuGraphInstantiateWithParams_ptsz, inst_params_fn),
                       GV_REAL(cuGraphUpload_ptsz, upload_fn), pe, g, prm);
}

/* ---- what gives graph memory back ------------------------------------- */

/* The records go before the driver destroys e, and come back if it does
 * not: once destroyed, its handle may be given to a graph instantiated on
 * another thread, whose records a later removal would take (its launches
 * then went uncharged). */
GV_EXPORT CUresult cuGraphExecDestroy(CUgraphExec e)
{
    exec_fn real = GV_REAL(cuGraphExecDestroy, exec_fn);
    gv_alloc a;
    if (!gv_graph_mem_seen() || !gv_table_take(GV_K_GEXEC, (uint64_t)(uintptr_t)e, &a))
        return real(e);
    gv_charge_flying();             /* the pool may shrink before its charge */
    CUresult rc = real(e);
    if (rc != CUDA_SUCCESS) {
        gv_charge_landed();
        gv_table_put(&a);
        return rc;
    }
    /* Its live allocations stay live (and charged) until freed. */
    gv_graph_exec_dropped(a.aux);
    settle_all();
    gv_charge_landed();
    return rc;
}

GV_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    if (!gv_graph_mem_seen() || gv_mode_fast() != GV_MODE_ENFORCE)
        return GV_REAL(cuDeviceGraphMemTrim, trim_fn)(dev);
    gv_charge_flying();             /* the pool shrinks before its charge */
    CUresult rc = GV_REAL(cuDeviceGraphMemTrim, trim_fn)(dev);
    if (rc == CUDA_SUCCESS)
        settle_all();
    gv_charge_landed();
    return rc;
}

void gv_graph_mem_refresh(void)
{
    if (gv_graph_mem_seen() && gv_mode_fast() == GV_MODE_ENFORCE)
        settle_all();
}

const gv_hook gv_hooks_graph[] = {
    { "cuGraphInstantiate", (void *)cuGraphInstantiate },
    { "cuGraphInstantiate_v2", (void *)cuGraphInstantiate_v2 },
    { "cuGraphInstantiateWithFlags", (void *)cuGraphInstantiateWithFlags },
    { "cuGraphInstantiateWithParams", (void *)cuGraphInstantiateWithParams },
    { "cuGraphInstantiateWithParams_ptsz", (void *)cuGraphInstantiateWithParams_ptsz },
    { "cuGraphUpload", (void *)cuGraphUpload },
    { "cuGraphUpload_ptsz", (void *)cuGraphUpload_ptsz },
    { "cuGraphExecDestroy", (void *)cuGraphExecDestroy },
    { "cuDeviceGraphMemTrim", (void *)cuDeviceGraphMemTrim },
    { NULL, NULL }
};
