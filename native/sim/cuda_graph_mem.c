/*
 * cuda_graph_mem.c - graph memory nodes and the per-device graph pool.
 *
 * An allocation node gets its address when it is made (a record here,
 * shared by the node and every executable graph made from it).  Launching
 * the graph makes the allocation live: the device's graph pool grows to
 * cover the highest use the launch reaches (in 2 MiB steps, charged to this
 * process), and the pool keeps that memory after the allocation is freed,
 * by a free node, cuMemFreeAsync or cuMemFree, until cuDeviceGraphMemTrim.
 * cuGraphUpload reserves what a launch would need without running it.
 * cuDeviceGetGraphMemAttribute reports the pool as the real driver does.
 *
 * Simplifications: a launch's memory nodes run in node order when it is
 * queued (edges are ignored, as for kernels); an allocation still live when
 * its graph is launched again is an error unless the graph was instantiated
 * with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH; the only free nodes
 * are of graph allocations.  All under sim_mu.
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

struct sim_gmem {
    CUdeviceptr addr;
    uint64_t size;
    int ordinal, node;
    int live;                           /* allocated, not yet freed */
    int scratch;                        /* live while a launch is checked */
    int refs;                           /* nodes, executable graphs, live entry */
    struct sim_gmem *next;
};

static struct sim_gmem *g_all;
static struct {
    uint64_t used, used_high, reserved, reserved_high;
} g_pool[SIM_MAX_DEV];                  /* by ordinal */

static struct sim_gmem *gmem_new_locked(int ordinal, uint64_t size)
{
    int node = sim_ord_node(ordinal);
    if (node < 0 || !size)
        return NULL;
    struct sim_gmem *gm = calloc(1, sizeof *gm);
    if (!gm)
        return NULL;
    gm->size = sim_round_up(size, SIM_ALIGN);
    gm->addr = sim_va_next(node, gm->size, 0);
    if (!gm->addr) {
        free(gm);
        return NULL;
    }
    gm->ordinal = ordinal;
    gm->node = node;
    gm->refs = 1;
    gm->next = g_all;
    g_all = gm;
    return gm;
}

static struct sim_gmem *gmem_find_locked(CUdeviceptr addr)
{
    for (struct sim_gmem *gm = g_all; gm; gm = gm->next)
        if (gm->addr == addr)
            return gm;
    return NULL;
}

void sim_gmem_ref_locked(struct sim_gmem *gm) { gm->refs++; }

void sim_gmem_unref_locked(struct sim_gmem *gm)
{
    if (--gm->refs > 0)
        return;
    for (struct sim_gmem **p = &g_all; *p; p = &(*p)->next)
        if (*p == gm) {
            *p = gm->next;
            break;
        }
    free(gm);
}


/* The allocation ends (free node, cuMemFree(Async), its context destroyed):
 * the pool keeps its memory. */
void sim_gmem_free_locked(sim_alloc *a)
{
    struct sim_gmem *gm = a->gmem;
    sim_tab_remove(a->addr);
    gm->live = 0;
    g_pool[gm->ordinal].used -= gm->size;
    sim_gmem_unref_locked(gm);
}

static CUresult make_live(struct sim_gmem *gm, struct CUctx_st *ctx)
{
    sim_alloc a = {0};
    a.addr = gm->addr;
    a.size = gm->size;
    a.node = gm->node;
    a.kind = SIM_K_GRAPH;
    a.ctx = ctx;
    a.gmem = gm;
    if (sim_tab_insert(&a) < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gm->live = 1;
    gm->refs++;
    uint64_t *used = &g_pool[gm->ordinal].used;
    *used += gm->size;
    if (*used > g_pool[gm->ordinal].used_high)
        g_pool[gm->ordinal].used_high = *used;
    return CUDA_SUCCESS;
}

/* Check the ops against what is live and find each device's peak use. */
static CUresult plan(const sim_gmop *ops, int n, unsigned long long flags,
                     uint64_t peak[SIM_MAX_DEV])
{
    uint64_t cur[SIM_MAX_DEV];
    for (int d = 0; d < SIM_MAX_DEV; d++)
        cur[d] = peak[d] = g_pool[d].used;
    for (int i = 0; i < n; i++)
        ops[i].gm->scratch = ops[i].gm->live;
    for (int i = 0; i < n; i++) {
        struct sim_gmem *gm = ops[i].gm;
        int d = gm->ordinal;
        if (ops[i].free) {
            if (!gm->scratch)
                return CUDA_ERROR_INVALID_VALUE;    /* not allocated */
            gm->scratch = 0;
            cur[d] -= gm->size;
            continue;
        }
        if (gm->scratch) {
            if (!(flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH))
                return CUDA_ERROR_INVALID_VALUE;    /* still live */
            cur[d] -= gm->size;
        }
        gm->scratch = 1;
        cur[d] += gm->size;
        if (cur[d] > peak[d])
            peak[d] = cur[d];
    }
    return CUDA_SUCCESS;
}

/* Grow each device's pool to its peak; all or nothing. */
static CUresult reserve(const uint64_t peak[SIM_MAX_DEV])
{
    uint64_t grow[SIM_MAX_DEV] = {0};
    for (int d = 0; d < SIM_MAX_DEV; d++) {
        if (peak[d] <= g_pool[d].reserved)
            continue;
        grow[d] = sim_round_up(peak[d] - g_pool[d].reserved, SIM_GRAN);
        if (sim_fault_alloc() || sim_charge(sim_ord_node(d), grow[d]) < 0) {
            while (d-- > 0)
                if (grow[d])
                    sim_uncharge(sim_ord_node(d), grow[d]);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    for (int d = 0; d < SIM_MAX_DEV; d++) {
        g_pool[d].reserved += grow[d];
        if (g_pool[d].reserved > g_pool[d].reserved_high)
            g_pool[d].reserved_high = g_pool[d].reserved;
    }
    return CUDA_SUCCESS;
}

CUresult sim_gmem_run_locked(const sim_gmop *ops, int n, unsigned long long flags,
                             int upload, struct CUctx_st *ctx)
{
    uint64_t peak[SIM_MAX_DEV];
    CUresult rc = plan(ops, n, flags, peak);
    if (rc == CUDA_SUCCESS)
        rc = reserve(peak);
    for (int i = 0; rc == CUDA_SUCCESS && !upload && i < n; i++) {
        struct sim_gmem *gm = ops[i].gm;
        if (gm->live) {                 /* a free node, or auto-free */
            sim_alloc *a = sim_tab_find(gm->addr);
            if (a)
                sim_gmem_free_locked(a);
        }
        if (!ops[i].free)
            rc = make_live(gm, ctx);
    }
    return rc;
}

/* ---- nodes ------------------------------------------------------------- */

SIM_API CUresult cuGraphAddMemAllocNode(CUgraphNode *out, CUgraph g,
                                        const CUgraphNode *deps, size_t n,
                                        CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!p || !p->bytesize || p->poolProps.allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_ord_node(p->poolProps.location.id) < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&sim_mu);
    struct sim_gmem *gm = gmem_new_locked(p->poolProps.location.id, p->bytesize);
    pthread_mutex_unlock(&sim_mu);
    if (!gm)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUdeviceptr addr = gm->addr;
    rc = sim_graph_add_mem(out, g, deps, n, CU_GRAPH_NODE_TYPE_MEM_ALLOC, gm);
    if (rc == CUDA_SUCCESS)
        p->dptr = addr;
    return rc;
}

SIM_API CUresult cuGraphAddMemFreeNode(CUgraphNode *out, CUgraph g,
                                       const CUgraphNode *deps, size_t n,
                                       CUdeviceptr dptr)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    struct sim_gmem *gm = gmem_find_locked(dptr);
    if (gm)
        sim_gmem_ref_locked(gm);
    pthread_mutex_unlock(&sim_mu);
    if (!gm)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_graph_add_mem(out, g, deps, n, CU_GRAPH_NODE_TYPE_MEM_FREE, gm);
}

/* A copy of the record of memory node nd of this type (its address, size
 * and device never change once made). */
static CUresult node_record(CUgraphNode nd, int type, const void *out, struct sim_gmem *rec)
{
    SIM_TRY(sim_check_args(!out));
    pthread_mutex_lock(&sim_mu);
    struct sim_gmem *gm = sim_graph_node_gmem(nd, type);
    if (gm)
        *rec = *gm;
    pthread_mutex_unlock(&sim_mu);
    return gm ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuGraphMemAllocNodeGetParams(CUgraphNode nd,
                                              CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    struct sim_gmem gm;
    CUresult rc = node_record(nd, CU_GRAPH_NODE_TYPE_MEM_ALLOC, p, &gm);
    if (rc)
        return rc;
    if ((rc = sim_cuda_fail("cuGraphMemAllocNodeGetParams")))
        return rc;
    memset(p, 0, sizeof *p);
    p->poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p->poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p->poolProps.location.id = gm.ordinal;
    p->bytesize = gm.size;
    p->dptr = gm.addr;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuGraphMemFreeNodeGetParams(CUgraphNode nd, CUdeviceptr *dptr)
{
    struct sim_gmem gm;
    CUresult rc = node_record(nd, CU_GRAPH_NODE_TYPE_MEM_FREE, dptr, &gm);
    if (rc == CUDA_SUCCESS)
        rc = sim_cuda_fail("cuGraphMemFreeNodeGetParams");
    if (rc == CUDA_SUCCESS)
        *dptr = gm.addr;
    return rc;
}

/* ---- stream capture ---------------------------------------------------- */

/* Stream s's capture graph with sim_mu locked (r gets the stream), or
 * NULL with sim_mu not locked when s is not capturing. */
static struct CUgraph_st *capture_lock(CUstream s, int ptsz, sim_sref *r)
{
    if (sim_stream_ref(s, ptsz, r) != CUDA_SUCCESS)
        return NULL;
    pthread_mutex_lock(&sim_mu);
    struct CUgraph_st *g =
        r->s && r->s->capture == CU_STREAM_CAPTURE_STATUS_ACTIVE ? r->s->cap_graph : NULL;
    if (!g)
        pthread_mutex_unlock(&sim_mu);
    return g;
}

int sim_capture_alloc(CUstream s, int ptsz, CUdeviceptr *dptr, size_t size, CUresult *rc)
{
    sim_sref r;
    struct CUgraph_st *g = capture_lock(s, ptsz, &r);
    if (!g)
        return 0;
    struct sim_gmem *gm = gmem_new_locked(r.ctx->ordinal, size);
    *rc = gm ? sim_graph_append_mem_locked(g, CU_GRAPH_NODE_TYPE_MEM_ALLOC, gm)
             : CUDA_ERROR_OUT_OF_MEMORY;
    if (gm) {
        *dptr = gm->addr;
        sim_gmem_unref_locked(gm);      /* the node holds it */
    }
    pthread_mutex_unlock(&sim_mu);
    return 1;
}

int sim_capture_free(CUstream s, int ptsz, CUdeviceptr dptr, CUresult *rc)
{
    sim_sref r;
    struct CUgraph_st *g = capture_lock(s, ptsz, &r);
    if (!g)
        return 0;
    struct sim_gmem *gm = gmem_find_locked(dptr);
    *rc = gm ? sim_graph_append_mem_locked(g, CU_GRAPH_NODE_TYPE_MEM_FREE, gm)
             : CUDA_ERROR_NOT_SUPPORTED;        /* only graph allocations */
    pthread_mutex_unlock(&sim_mu);
    return 1;
}

/* ---- the device's graph pool ------------------------------------------- */

static CUresult device_ok(CUdevice dev)
{
    SIM_TRY(sim_check_init());
    return sim_ord_node(dev) < 0 ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, CUgraphMem_attribute attr,
                                              void *value)
{
    CUresult rc = device_ok(dev);
    if (rc || (rc = sim_cuda_fail("cuDeviceGetGraphMemAttribute")))
        return rc;
    if (!value || attr < CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT ||
        attr > CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    const uint64_t v[] = {g_pool[dev].used, g_pool[dev].used_high, g_pool[dev].reserved,
                          g_pool[dev].reserved_high};
    memcpy(value, &v[attr], sizeof v[attr]);
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

/* Only the high watermarks can be set, and only to zero. */
SIM_API CUresult cuDeviceSetGraphMemAttribute(CUdevice dev, CUgraphMem_attribute attr,
                                              void *value)
{
    SIM_TRY(device_ok(dev));
    uint64_t v;
    if (!value || (attr != CU_GRAPH_MEM_ATTR_USED_MEM_HIGH &&
                   attr != CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH))
        return CUDA_ERROR_INVALID_VALUE;
    memcpy(&v, value, sizeof v);
    if (v != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    if (attr == CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)
        g_pool[dev].used_high = 0;
    else
        g_pool[dev].reserved_high = 0;
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

/* Give the pool's memory that no live allocation uses back to the device. */
SIM_API CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    SIM_TRY(device_ok(dev));
    int node = sim_ord_node(dev);
    pthread_mutex_lock(&sim_mu);
    uint64_t keep = sim_round_up(g_pool[dev].used, SIM_GRAN);
    if (keep < g_pool[dev].reserved) {
        sim_uncharge(node, g_pool[dev].reserved - keep);
        g_pool[dev].reserved = keep;
    }
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}
