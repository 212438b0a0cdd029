/*
 * hooks_graph.c - graph memory: what a graph's allocation nodes take.
 *
 * A graph allocation (cuGraphAddMemAllocNode, or cuMemAllocAsync captured
 * into a graph) gets its address when the node is made, but its physical
 * memory only when the graph is launched or uploaded, from a per-device
 * graph pool that keeps it after the allocation is freed, until
 * cuDeviceGraphMemTrim.  A cuMemAllocAsync captured into a graph therefore
 * takes nothing (hooks_pool.c settles on the ordinary pool's reserve, which
 * it does not move), and the quota is charged here instead:
 *
 *  - instantiation records the executable graph's allocation bytes (the sum
 *    of its allocation nodes, read with cuGraphGetNodes / cuGraphNode-
 *    GetType / cuGraphMemAllocNodeGetParams);
 *  - a launch or upload of such a graph first charges what the pool may
 *    have to grow (the pool's use plus those bytes, less its reserve) and
 *    fails with CUDA_ERROR_OUT_OF_MEMORY, without launching, when the quota
 *    cannot take it; afterwards the charge is settled on the pool's real
 *    reserve (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT);
 *  - a trim, an executable graph's destruction and a context's destruction
 *    settle it again.
 *
 * A graph whose allocation nodes are on several devices is checked on each
 * of them, for the bytes it allocates there (kept in a list beside the
 * table, which has room for one device).
 *
 * One mutex per device, held across the launch of a graph that allocates
 * (several are taken in ascending order); launches of graphs without
 * allocation nodes only read a flag.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "hooks.h"
#include "log.h"

typedef CUresult (*inst_fn)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
typedef CUresult (*inst_flags_fn)(CUgraphExec *, CUgraph, unsigned long long);
typedef CUresult (*inst_params_fn)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);
typedef CUresult (*exec_fn)(CUgraphExec);
typedef CUresult (*upload_fn)(CUgraphExec, CUstream);
typedef CUresult (*trim_fn)(CUdevice);
typedef CUresult (*attr_fn)(CUdevice, CUgraphMem_attribute, void *);
typedef CUresult (*nodes_fn)(CUgraph, CUgraphNode *, size_t *);
typedef CUresult (*type_fn)(CUgraphNode, CUgraphNodeType *);
typedef CUresult (*alloc_params_fn)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *);

static struct gpool {
    pthread_mutex_t lock;
    uint64_t charged;            /* the pool's reserve, as charged */
    int dev;                     /* region device entry; valid once charged */
} pools[GV_MAX_ORDINALS];
static atomic_int seen;          /* an executable graph here allocates */
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;

/* Executable graphs with allocation nodes on several devices: the bytes on
 * each.  Rare, so a list under one mutex. */
static struct multi {
    struct multi *next;
    CUgraphExec exec;
    uint64_t bytes[GV_MAX_ORDINALS];
} *multis;
static pthread_mutex_t multis_lock = PTHREAD_MUTEX_INITIALIZER;

static void child_reset(void)
{
    /* A forked child holds no graph memory of its own. */
    for (int i = 0; i < GV_MAX_ORDINALS; i++) {
        pthread_mutex_init(&pools[i].lock, NULL);
        pools[i].charged = 0;
    }
    pthread_mutex_init(&multis_lock, NULL);
}

static void setup(void)
{
    for (int i = 0; i < GV_MAX_ORDINALS; i++)
        pthread_mutex_init(&pools[i].lock, NULL);
    pthread_atfork(NULL, NULL, child_reset);
}

int gv_graph_mem_seen(void) { return atomic_load_explicit(&seen, memory_order_relaxed); }

static uint64_t pool_attr(int ordinal, CUgraphMem_attribute attr)
{
    uint64_t v = 0;
    if (GV_REAL(cuDeviceGetGraphMemAttribute, attr_fn)((CUdevice)ordinal, attr, &v) !=
        CUDA_SUCCESS)
        return UINT64_MAX;
    return v;
}

/* Bring ordinal's charge in line with its pool's reserve (lock held). */
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

/* ---- instantiation: how much an executable graph allocates ------------ */

/* Add the sizes of g's allocation nodes to per[], by device.  Graphs whose
 * nodes cannot be read count as allocating nothing. */
static void graph_alloc_bytes(CUgraph g, uint64_t per[GV_MAX_ORDINALS])
{
    size_t n = 0;
    if (GV_REAL(cuGraphGetNodes, nodes_fn)(g, NULL, &n) != CUDA_SUCCESS || n == 0)
        return;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    if (!nodes)
        return;
    if (GV_REAL(cuGraphGetNodes, nodes_fn)(g, nodes, &n) == CUDA_SUCCESS) {
        for (size_t i = 0; i < n; i++) {
            CUgraphNodeType t;
            CUDA_MEM_ALLOC_NODE_PARAMS prm;
            if (GV_REAL(cuGraphNodeGetType, type_fn)(nodes[i], &t) != CUDA_SUCCESS ||
                t != CU_GRAPH_NODE_TYPE_MEM_ALLOC)
                continue;
            memset(&prm, 0, sizeof prm);
            if (GV_REAL(cuGraphMemAllocNodeGetParams, alloc_params_fn)(nodes[i], &prm) !=
                    CUDA_SUCCESS ||
                prm.poolProps.location.id < 0 || prm.poolProps.location.id >= GV_MAX_ORDINALS)
                continue;
            per[prm.poolProps.location.id] += prm.bytesize;
        }
    }
    free(nodes);
}

/* Forget e's per-device bytes, if it had any. */
/* Take e's record of bytes per device out of the list (NULL: none). */
static struct multi *detach_multi(CUgraphExec e)
{
    struct multi *m = NULL;
    pthread_mutex_lock(&multis_lock);
    for (struct multi **pp = &multis; *pp; pp = &(*pp)->next) {
        if ((*pp)->exec == e) {
            m = *pp;
            *pp = m->next;
            break;
        }
    }
    pthread_mutex_unlock(&multis_lock);
    return m;
}

static void attach_multi(struct multi *m)
{
    pthread_mutex_lock(&multis_lock);
    m->next = multis;
    multis = m;
    pthread_mutex_unlock(&multis_lock);
}

void gv_graph_exec_forget(CUgraphExec e) { free(detach_multi(e)); }

/* Remember e's bytes on each device (a reused handle's record replaced);
 * 0, or -1 when out of memory. */
static int remember_multi(CUgraphExec e, const uint64_t per[GV_MAX_ORDINALS])
{
    gv_graph_exec_forget(e);
    struct multi *m = malloc(sizeof *m);
    if (!m)
        return -1;
    m->exec = e;
    memcpy(m->bytes, per, sizeof m->bytes);
    attach_multi(m);
    return 0;
}

/* e is gone: forget it; 1 if it was tracked. */
static int untrack_exec(CUgraphExec e)
{
    if (!gv_table_take(GV_K_GEXEC, (uint64_t)(uintptr_t)e, NULL))
        return 0;
    gv_graph_exec_forget(e);
    return 1;
}

/* After a successful instantiation: remember an executable graph that
 * allocates (GV_K_GEXEC, aux = bytes, nothing charged to the entry). */
static void track_exec(CUgraphExec e, CUgraph g)
{
    uint64_t per[GV_MAX_ORDINALS] = { 0 }, bytes = 0;
    graph_alloc_bytes(g, per);
    int ordinal = -1, multi = 0;   /* the first device it allocates on; others? */
    for (int i = 0; i < GV_MAX_ORDINALS; i++) {
        if (!per[i])
            continue;
        if (ordinal < 0)
            ordinal = i;
        else
            multi = 1;
        bytes += per[i];
    }
    const gv_devinfo *d;
    if (ordinal < 0 || gv_device(ordinal, &d) != CUDA_SUCCESS)
        return;
    if (!multi)
        gv_graph_exec_forget(e);            /* a reused handle's record */
    else if (remember_multi(e, per) != 0)   /* then refused at launch */
        gv_log(GV_LOG_ERROR, "out of memory recording a graph's allocations");
    CUcontext ctx = NULL;
    GV_REAL(cuCtxGetCurrent, CUresult (*)(CUcontext *))(&ctx);
    gv_alloc a = { .key = (uint64_t)(uintptr_t)e, .kind = GV_K_GEXEC, .dev = d->region_dev,
                   .bytes = 0, .aux = GV_GEXEC_AUX(bytes, ordinal, multi), .ctx = ctx };
    if (gv_table_put(&a) == 0)                  /* replaces a reused handle's */
        atomic_store_explicit(&seen, 1, memory_order_relaxed);
}

/* ---- launch and upload ------------------------------------------------ */

/* Lock ordinal's pool and charge what it may grow by for `bytes` more;
 * the lock stays held on success. */
static CUresult pool_begin(int ordinal, uint64_t bytes)
{
    struct gpool *p = &pools[ordinal];
    pthread_mutex_lock(&p->lock);
    settle(ordinal);
    uint64_t used = pool_attr(ordinal, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT);
    uint64_t reserved = pool_attr(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT);
    if (used != UINT64_MAX && reserved != UINT64_MAX && used + bytes > reserved) {
        gv_charge c;
        CUresult rc = gv_charge_begin(&c, ordinal, NULL, used + bytes - reserved);
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

CUresult gv_graph_mem_begin(gv_graph_mem *m, CUgraphExec e)
{
    m->held = 0;
    gv_alloc a;
    if (!gv_table_get(GV_K_GEXEC, (uint64_t)(uintptr_t)e, &a))
        return CUDA_SUCCESS;
    int mode = gv_mode_fast();
    if (mode != GV_MODE_ENFORCE)
        return mode == GV_MODE_PASSTHROUGH ? CUDA_SUCCESS : GV_FAIL_CUDA;
    uint64_t per[GV_MAX_ORDINALS] = { 0 };
    if (GV_GEXEC_MULTI(a.aux)) {
        struct multi *r;
        pthread_mutex_lock(&multis_lock);
        for (r = multis; r && r->exec != e; r = r->next)
            ;
        if (r)
            memcpy(per, r->bytes, sizeof per);
        pthread_mutex_unlock(&multis_lock);
        if (!r)
            return CUDA_ERROR_OUT_OF_MEMORY;   /* its record could not be made */
    } else {
        per[GV_GEXEC_ORDINAL(a.aux)] = GV_GEXEC_BYTES(a.aux);
    }
    pthread_once(&setup_once, setup);
    /* Ascending order, so that launches on the same devices cannot deadlock. */
    for (int i = 0; i < GV_MAX_ORDINALS; i++) {
        if (!per[i])
            continue;
        CUresult rc = pool_begin(i, per[i]);
        if (rc != CUDA_SUCCESS) {
            gv_graph_mem_end(m);      /* gives back what the others charged */
            return rc;
        }
        if (!m->held)
            gv_charge_flying();       /* until settled: the driver has not answered */
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
    if (m->held)
        gv_charge_landed();
    m->held = 0;
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

/* After the real instantiation: track a graph that allocates.  (Failing
 * closed needs nothing here: cuInit already refuses.) */
static CUresult instantiated(CUresult rc, CUgraphExec *pe, CUgraph g)
{
    if (rc == CUDA_SUCCESS && pe && gv_mode_fast() == GV_MODE_ENFORCE)
        track_exec(*pe, g);
    return rc;
}

GV_EXPORT CUresult cuGraphInstantiate(CUgraphExec *pe, CUgraph g, CUgraphNode *err, char *log,
                                      size_t n)
{
    return instantiated(GV_REAL(cuGraphInstantiate, inst_fn)(pe, g, err, log, n), pe, g);
}

GV_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *pe, CUgraph g, CUgraphNode *err,
                                         char *log, size_t n)
{
    return instantiated(GV_REAL(cuGraphInstantiate_v2, inst_fn)(pe, g, err, log, n), pe, g);
}

GV_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g,
                                               unsigned long long flags)
{
    return instantiated(GV_REAL(cuGraphInstantiateWithFlags, inst_flags_fn)(pe, g, flags), pe, g);
}

/* With CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD the driver also uploads the graph
 * (and maps its memory): instantiate first, then upload through the hook. */
static CUresult inst_params(inst_params_fn real, upload_fn real_upload, CUgraphExec *pe,
                            CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *prm)
{
    if (!prm || !(prm->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) ||
        gv_mode_fast() != GV_MODE_ENFORCE)
        return instantiated(real(pe, g, prm), pe, g);
    CUDA_GRAPH_INSTANTIATE_PARAMS mine = *prm;
    mine.flags &= ~(cuuint64_t)CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD;
    CUresult rc = instantiated(real(pe, g, &mine), pe, g);
    prm->hErrNode_out = mine.hErrNode_out;
    prm->result_out = mine.result_out;
    if (rc != CUDA_SUCCESS || !pe)
        return rc;
    rc = upload(real_upload, *pe, prm->hUploadStream);
    if (rc != CUDA_SUCCESS) {
        untrack_exec(*pe);
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
    struct multi *m = detach_multi(e);
    CUresult rc = real(e);
    if (rc != CUDA_SUCCESS) {
        if (m)
            attach_multi(m);
        gv_table_put(&a);
        return rc;
    }
    free(m);
    settle_all();
    return rc;
}

GV_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    CUresult rc = GV_REAL(cuDeviceGraphMemTrim, trim_fn)(dev);
    if (rc == CUDA_SUCCESS && gv_graph_mem_seen() && gv_mode_fast() == GV_MODE_ENFORCE)
        settle_all();
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
