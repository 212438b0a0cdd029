/*
 * cuda_graph.c - CUDA graphs with kernel (and empty) nodes, and stream
 * capture.  A graph is a list of nodes in the order they were added (a
 * valid topological order for graphs built through the API, since a node's
 * dependencies must exist before it); edges are checked but otherwise
 * ignored, as the device runs one kernel at a time anyway.  Instantiation
 * copies the kernels; cuGraphLaunch queues them in order on its stream
 * (cuda_launch.c), or appends them to the graph if that stream is
 * capturing.  Kernels launched into a capturing stream are appended to the
 * capture graph instead of running.  Memory allocation and free nodes
 * (cuda_graph_mem.c) are run in node order when the graph is launched,
 * before its kernels are queued.  As in CUDA, a graph with memory nodes
 * (a moved child graph's included) has at most one executable graph at a
 * time: another instantiation before cuGraphExecDestroy is
 * CUDA_ERROR_INVALID_VALUE.
 *
 * Child graph nodes (CU_GRAPH_NODE_TYPE_GRAPH) own their graph, whose
 * nodes run in place of the node.  As in CUDA, a child graph that is
 * cloned into its node (cuGraphAddChildGraphNode, or cuGraphAddNode with
 * CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE) may hold no memory nodes: the call
 * fails with CUDA_ERROR_INVALID_VALUE.  One moved into its node
 * (cuGraphAddNode with CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE, CUDA 12.9) may,
 * and can then no longer be instantiated, destroyed, added to another
 * graph or given memory nodes.  No memory node can be added to any graph
 * a node owns (cuGraphChildGraphNodeGetGraph's).
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

#define GRAPH_MAGIC 0x47524148u
#define NODE_MAGIC 0x4e4f4445u
#define EXEC_MAGIC 0x47455845u

struct CUgraphNode_st {
    uint32_t magic;
    int type;                           /* CUgraphNodeType */
    struct CUgraph_st *g;
    sim_kern k;
    struct sim_gmem *gm;                /* memory nodes: one reference */
    struct CUgraph_st *child;           /* child graph nodes: owned */
};

struct CUgraph_st {
    uint32_t magic;
    int n, cap;
    struct CUgraphNode_st **nodes;
    struct CUgraphNode_st *owner;       /* the child graph node holding it */
    int moved;                          /* moved into owner, not cloned */
    struct CUgraphExec_st *inst;        /* its live instantiation, if it
                                         * (or a graph under it) has memory
                                         * nodes: there is at most one */
};

struct CUgraphExec_st {
    uint32_t magic;
    int n;
    sim_kern *k;
    int nm;                             /* memory nodes, in node order */
    sim_gmop *m;
    unsigned long long flags;
    struct CUgraph_st *src;             /* the graph it is the one
                                         * instantiation of (memory nodes),
                                         * while both live */
};

static __thread CUstreamCaptureMode t_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
static unsigned long long g_capture_ids;

struct CUgraph_st *sim_graph_new(void)
{
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    g->magic = GRAPH_MAGIC;
    sim_reg_add(g);                     /* caller holds sim_mu */
    return g;
}

void sim_graph_free(struct CUgraph_st *g)
{
    if (g->inst)
        g->inst->src = NULL;            /* the executable graph outlives it */
    for (int i = 0; i < g->n; i++) {
        if (g->nodes[i]->gm)
            sim_gmem_unref_locked(g->nodes[i]->gm);
        if (g->nodes[i]->child)
            sim_graph_free(g->nodes[i]->child);
        sim_reg_del(g->nodes[i]);
        g->nodes[i]->magic = 0;
        free(g->nodes[i]);
    }
    sim_reg_del(g);
    g->magic = 0;
    free(g->nodes);
    free(g);
}

static int graph_ok_locked(struct CUgraph_st *g)
{
    return g && sim_reg_has(g) && g->magic == GRAPH_MAGIC;
}

static struct CUgraphNode_st *add_node_locked(struct CUgraph_st *g, int type,
                                              const sim_kern *k, struct sim_gmem *gm)
{
    if (g->n == g->cap) {
        int cap = g->cap ? g->cap * 2 : 16;
        void *p = realloc(g->nodes, (size_t)cap * sizeof *g->nodes);
        if (!p)
            return NULL;
        g->nodes = p;
        g->cap = cap;
    }
    struct CUgraphNode_st *nd = calloc(1, sizeof *nd);
    if (!nd)
        return NULL;
    nd->magic = NODE_MAGIC;
    nd->type = type;
    nd->g = g;
    if (k)
        nd->k = *k;
    if (gm) {
        nd->gm = gm;
        sim_gmem_ref_locked(gm);
    }
    g->nodes[g->n++] = nd;
    sim_reg_add(nd);
    return nd;
}

CUresult sim_graph_append_locked(struct CUgraph_st *g, const sim_kern *k)
{
    return add_node_locked(g, CU_GRAPH_NODE_TYPE_KERNEL, k, NULL)
               ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult sim_graph_append_mem_locked(struct CUgraph_st *g, int type,
                                     struct sim_gmem *gm)
{
    return add_node_locked(g, type, NULL, gm) ? CUDA_SUCCESS
                                              : CUDA_ERROR_OUT_OF_MEMORY;
}

SIM_API CUresult cuGraphCreate(CUgraph *pg, unsigned int flags)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!pg || flags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    struct CUgraph_st *g = sim_graph_new();
    pthread_mutex_unlock(&sim_mu);
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pg = g;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuGraphDestroy(CUgraph g)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    int ok = graph_ok_locked(g) && !g->owner;   /* its node's to destroy */
    if (ok)
        sim_graph_free(g);
    pthread_mutex_unlock(&sim_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* deps must be nodes of g */
static int deps_ok_locked(struct CUgraph_st *g, const CUgraphNode *deps,
                          size_t n)
{
    if (n && !deps)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!deps[i] || !sim_reg_has(deps[i]) ||
            deps[i]->magic != NODE_MAGIC || deps[i]->g != g)
            return 0;
    return 1;
}

static CUresult add_node(CUgraphNode *out, CUgraph g, const CUgraphNode *deps,
                         size_t ndeps, int type, const sim_kern *k,
                         struct sim_gmem *gm)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    CUresult rc = CUDA_SUCCESS;
    if (!graph_ok_locked(g) || !deps_ok_locked(g, deps, ndeps))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (gm && g->owner)
        rc = CUDA_ERROR_INVALID_VALUE;  /* no memory node in a child graph */
    struct CUgraphNode_st *nd = rc ? NULL : add_node_locked(g, type, k, gm);
    if (!rc && !nd)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_unlock(&sim_mu);
    if (!rc)
        *out = nd;
    return rc;
}

static CUresult kernel_node(CUgraphNode *out, CUgraph g,
                            const CUgraphNode *deps, size_t ndeps,
                            CUfunction f, const unsigned grid[3],
                            const unsigned block[3], unsigned shmem,
                            void **params, void **extra)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    sim_kern k;
    rc = sim_kern_make(&k, f, grid, block, shmem, params, extra);
    if (rc)
        return rc == CUDA_ERROR_INVALID_HANDLE ? CUDA_ERROR_INVALID_VALUE : rc;
    return add_node(out, g, deps, ndeps, CU_GRAPH_NODE_TYPE_KERNEL, &k, NULL);
}

SIM_API CUresult cuGraphAddKernelNode_v2(CUgraphNode *out, CUgraph g,
                                         const CUgraphNode *deps, size_t n,
                                         const CUDA_KERNEL_NODE_PARAMS_v2 *p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    const unsigned grid[3] = {p->gridDimX, p->gridDimY, p->gridDimZ};
    const unsigned block[3] = {p->blockDimX, p->blockDimY, p->blockDimZ};
    CUfunction f = p->func ? p->func : (CUfunction)p->kern;
    return kernel_node(out, g, deps, n, f, grid, block, p->sharedMemBytes,
                       p->kernelParams, p->extra);
}

SIM_API CUresult cuGraphAddKernelNode(CUgraphNode *out, CUgraph g,
                                      const CUgraphNode *deps, size_t n,
                                      const CUDA_KERNEL_NODE_PARAMS_v1 *p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    const unsigned grid[3] = {p->gridDimX, p->gridDimY, p->gridDimZ};
    const unsigned block[3] = {p->blockDimX, p->blockDimY, p->blockDimZ};
    return kernel_node(out, g, deps, n, p->func, grid, block,
                       p->sharedMemBytes, p->kernelParams, p->extra);
}

SIM_API CUresult cuGraphAddEmptyNode(CUgraphNode *out, CUgraph g,
                                     const CUgraphNode *deps, size_t n)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    return add_node(out, g, deps, n, CU_GRAPH_NODE_TYPE_EMPTY, NULL, NULL);
}

/* ---- child graphs ------------------------------------------------------ */

/* Whether g, or a graph under it, has memory nodes; sim_mu held. */
static int has_mem_locked(const struct CUgraph_st *g)
{
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->gm || (g->nodes[i]->child && has_mem_locked(g->nodes[i]->child)))
            return 1;
    return 0;
}

/* A copy of g, which has no memory nodes (NULL: out of memory); sim_mu
 * held. */
static struct CUgraph_st *clone_locked(const struct CUgraph_st *g)
{
    struct CUgraph_st *c = sim_graph_new();
    for (int i = 0; c && i < g->n; i++) {
        const struct CUgraphNode_st *src = g->nodes[i];
        struct CUgraph_st *sub = src->child ? clone_locked(src->child) : NULL;
        struct CUgraphNode_st *nd = NULL;
        if (!src->child || sub)
            nd = add_node_locked(c, src->type, &src->k, NULL);
        if (!nd) {
            if (sub)
                sim_graph_free(sub);
            sim_graph_free(c);
            return NULL;
        }
        nd->child = sub;
        if (sub)
            sub->owner = nd;
    }
    return c;
}

/* Whether a is g or holds g (a graph moved into one of its own would hold
 * itself); sim_mu held. */
static int holds_locked(const struct CUgraph_st *a, const struct CUgraph_st *g)
{
    for (; g; g = g->owner ? g->owner->g : NULL)
        if (g == a)
            return 1;
    return 0;
}

/* A child graph node in g running child: a copy of it, which may have no
 * memory nodes, or (move) child itself, which then belongs to the node. */
static CUresult child_node(CUgraphNode *out, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                           CUgraph child, int move)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    struct CUgraph_st *sub = NULL;
    if (!graph_ok_locked(g) || !deps_ok_locked(g, deps, ndeps) || !graph_ok_locked(child) ||
        (child->owner && child->moved))
        rc = CUDA_ERROR_INVALID_VALUE;  /* a moved graph is its node's */
    else if (!move)
        rc = has_mem_locked(child) ? CUDA_ERROR_INVALID_VALUE
             : (sub = clone_locked(child)) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    else if (child->owner || holds_locked(child, g) || (g->owner && has_mem_locked(child)))
        rc = CUDA_ERROR_INVALID_VALUE;  /* (no memory node into a child graph) */
    else
        sub = child;
    struct CUgraphNode_st *nd = NULL;
    if (rc == CUDA_SUCCESS && !(nd = add_node_locked(g, CU_GRAPH_NODE_TYPE_GRAPH, NULL, NULL))) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        if (!move)
            sim_graph_free(sub);
    }
    if (nd) {
        nd->child = sub;
        sub->owner = nd;
        sub->moved = move;
    }
    pthread_mutex_unlock(&sim_mu);
    if (nd)
        *out = nd;
    return rc;
}

SIM_API CUresult cuGraphAddChildGraphNode(CUgraphNode *out, CUgraph g, const CUgraphNode *deps,
                                          size_t n, CUgraph child)
{
    return child_node(out, g, deps, n, child, 0);
}

/* cuGraphAddNode: child graph and empty nodes only (others not modelled). */
SIM_API CUresult cuGraphAddNode_v2(CUgraphNode *out, CUgraph g, const CUgraphNode *deps,
                                   const CUgraphEdgeData *edges, size_t n, CUgraphNodeParams *p)
{
    (void)edges;
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->type == CU_GRAPH_NODE_TYPE_EMPTY)
        return add_node(out, g, deps, n, CU_GRAPH_NODE_TYPE_EMPTY, NULL, NULL);
    if (p->type != CU_GRAPH_NODE_TYPE_GRAPH)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (p->graph.ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE &&
        p->graph.ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE)
        return CUDA_ERROR_INVALID_VALUE;
    return child_node(out, g, deps, n, p->graph.graph,
                      p->graph.ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE);
}

SIM_API CUresult cuGraphAddNode(CUgraphNode *out, CUgraph g, const CUgraphNode *deps, size_t n,
                                CUgraphNodeParams *p)
{
    return cuGraphAddNode_v2(out, g, deps, NULL, n, p);
}

SIM_API CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode nd, CUgraph *pg)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if ((rc = sim_cuda_fail("cuGraphChildGraphNodeGetGraph")))
        return rc;
    if (!pg)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    int ok = nd && sim_reg_has(nd) && nd->magic == NODE_MAGIC && nd->child;
    if (ok)
        *pg = nd->child;
    pthread_mutex_unlock(&sim_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* A memory node holding gm (the caller's reference is kept by the node on
 * success and dropped on failure). */
CUresult sim_graph_add_mem(CUgraphNode *out, CUgraph g, const CUgraphNode *deps,
                           size_t ndeps, int type, struct sim_gmem *gm)
{
    CUresult rc = add_node(out, g, deps, ndeps, type, NULL, gm);
    pthread_mutex_lock(&sim_mu);
    sim_gmem_unref_locked(gm);
    pthread_mutex_unlock(&sim_mu);
    return rc;
}

/* The record of a memory node of this type, or NULL; sim_mu held. */
struct sim_gmem *sim_graph_node_gmem(CUgraphNode nd, int type)
{
    if (!nd || !sim_reg_has(nd) || nd->magic != NODE_MAGIC || nd->type != type)
        return NULL;
    return nd->gm;
}

SIM_API CUresult cuGraphAddDependencies_v2(CUgraph g, const CUgraphNode *from,
                                           const CUgraphNode *to,
                                           const CUgraphEdgeData *edges,
                                           size_t n)
{
    (void)edges;
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    int ok = graph_ok_locked(g) && deps_ok_locked(g, from, n) &&
             deps_ok_locked(g, to, n);
    for (size_t i = 0; ok && i < n; i++)
        ok = from[i] != to[i];
    pthread_mutex_unlock(&sim_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuGraphAddDependencies(CUgraph g, const CUgraphNode *from,
                                        const CUgraphNode *to, size_t n)
{
    return cuGraphAddDependencies_v2(g, from, to, NULL, n);
}

SIM_API CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *n)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if ((rc = sim_cuda_fail("cuGraphGetNodes")))
        return rc;
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    if (!graph_ok_locked(g)) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (nodes) {
        size_t m = *n < (size_t)g->n ? *n : (size_t)g->n;
        for (size_t i = 0; i < m; i++)
            nodes[i] = g->nodes[i];
        for (size_t i = m; i < *n; i++)
            nodes[i] = NULL;
        *n = m;
    } else {
        *n = (size_t)g->n;
    }
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuGraphNodeGetType(CUgraphNode nd, CUgraphNodeType *type)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if ((rc = sim_cuda_fail("cuGraphNodeGetType")))
        return rc;
    if (!type)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    int ok = nd && sim_reg_has(nd) && nd->magic == NODE_MAGIC;
    if (ok)
        *type = (CUgraphNodeType)nd->type;
    pthread_mutex_unlock(&sim_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- executable graphs ------------------------------------------------ */

/* Nodes of g and of the graphs under it; sim_mu held. */
static size_t nodes_under_locked(const struct CUgraph_st *g)
{
    size_t n = (size_t)g->n;
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->child)
            n += nodes_under_locked(g->nodes[i]->child);
    return n;
}

/* Copy g's kernels and memory nodes into e, a child graph's in its node's
 * place; sim_mu held. */
static void flatten_locked(struct CUgraphExec_st *e, const struct CUgraph_st *g)
{
    for (int i = 0; i < g->n; i++) {
        struct CUgraphNode_st *nd = g->nodes[i];
        if (nd->type == CU_GRAPH_NODE_TYPE_KERNEL)
            e->k[e->n++] = nd->k;
        else if (nd->child)
            flatten_locked(e, nd->child);
        else if (nd->gm) {
            sim_gmem_ref_locked(nd->gm);
            e->m[e->nm].gm = nd->gm;
            e->m[e->nm++].free = nd->type == CU_GRAPH_NODE_TYPE_MEM_FREE;
        }
    }
}

/* Whether g, or a graph under it, has a live instantiation (one with
 * memory nodes); sim_mu held. */
static int inst_under_locked(const struct CUgraph_st *g)
{
    if (g->inst)
        return 1;
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->child && inst_under_locked(g->nodes[i]->child))
            return 1;
    return 0;
}

SIM_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g,
                                             unsigned long long flags)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!pe || (flags & ~0xfULL))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&sim_mu);
    /* As in CUDA: a graph with memory nodes (its child graphs' included)
     * has at most one executable graph at a time; another instantiation
     * before cuGraphExecDestroy is an error. */
    if (!graph_ok_locked(g) || (g->owner && g->moved) || inst_under_locked(g)) {
        pthread_mutex_unlock(&sim_mu);
        free(e);
        return CUDA_ERROR_INVALID_VALUE;
    }
    size_t n = nodes_under_locked(g);
    e->k = calloc(n + 1, sizeof *e->k);
    e->m = calloc(n + 1, sizeof *e->m);
    if (!e->k || !e->m) {
        pthread_mutex_unlock(&sim_mu);
        free(e->k);
        free(e->m);
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    flatten_locked(e, g);
    if (e->nm) {
        e->src = g;
        g->inst = e;
    }
    e->flags = flags;
    e->magic = EXEC_MAGIC;
    sim_reg_add(e);
    pthread_mutex_unlock(&sim_mu);
    *pe = e;
    return CUDA_SUCCESS;
}

/* pre-CUDA-12 form (cuGraphInstantiate / _v2) */
SIM_API CUresult cuGraphInstantiate_v2(CUgraphExec *pe, CUgraph g,
                                       CUgraphNode *err, char *log,
                                       size_t logsz)
{
    if (err)
        *err = NULL;
    if (log && logsz)
        log[0] = 0;
    return cuGraphInstantiateWithFlags(pe, g, 0);
}

SIM_API CUresult cuGraphInstantiate(CUgraphExec *pe, CUgraph g,
                                    CUgraphNode *err, char *log, size_t logsz)
{
    return cuGraphInstantiate_v2(pe, g, err, log, logsz);
}

static CUresult graph_launch(CUgraphExec e, CUstream hs, int ptsz, int run);
SIM_API CUresult cuGraphExecDestroy(CUgraphExec e);

/* CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD also uploads to hUploadStream. */
static CUresult inst_params(CUgraphExec *pe, CUgraph g,
                            CUDA_GRAPH_INSTANTIATE_PARAMS *p, int ptsz)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    p->hErrNode_out = NULL;
    CUresult rc = cuGraphInstantiateWithFlags(
        pe, g, p->flags & ~(cuuint64_t)CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD);
    p->result_out = rc == CUDA_SUCCESS ? 0 : 1;   /* SUCCESS / ERROR */
    if (rc || !(p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD))
        return rc;
    rc = graph_launch(*pe, p->hUploadStream, ptsz, 0);
    if (rc) {
        cuGraphExecDestroy(*pe);
        *pe = NULL;
    }
    return rc;
}

SIM_API CUresult cuGraphInstantiateWithParams(CUgraphExec *pe, CUgraph g,
                                              CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    return inst_params(pe, g, p, 0);
}

SIM_API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *pe, CUgraph g,
                                                   CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    return inst_params(pe, g, p, 1);
}

static int exec_ok(struct CUgraphExec_st *e)
{
    pthread_mutex_lock(&sim_mu);
    int ok = e && sim_reg_has(e) && e->magic == EXEC_MAGIC;
    pthread_mutex_unlock(&sim_mu);
    return ok;
}

SIM_API CUresult cuGraphExecDestroy(CUgraphExec e)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    int ok = e && sim_reg_has(e) && e->magic == EXEC_MAGIC;
    if (ok) {
        sim_reg_del(e);
        e->magic = 0;
        if (e->src)
            e->src->inst = NULL;        /* the graph may be instantiated again */
        for (int i = 0; i < e->nm; i++)
            sim_gmem_unref_locked(e->m[i].gm);
    }
    pthread_mutex_unlock(&sim_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    free(e->k);
    free(e->m);
    free(e);
    return CUDA_SUCCESS;
}

static CUresult graph_launch(CUgraphExec e, CUstream hs, int ptsz, int run)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    sim_sref r;
    rc = sim_stream_ref(hs, ptsz, &r);
    if (rc)
        return rc;
    if (!exec_ok(e))
        return CUDA_ERROR_INVALID_VALUE;
    if (e->nm) {
        int capturing = r.s && r.s->capture != CU_STREAM_CAPTURE_STATUS_NONE;
        if (capturing)
            return CUDA_ERROR_NOT_SUPPORTED;    /* not modelled */
        pthread_mutex_lock(&sim_mu);
        rc = sim_gmem_run_locked(e->m, e->nm, e->flags, !run, r.ctx);
        pthread_mutex_unlock(&sim_mu);
        if (rc)
            return rc;
    }
    return run ? sim_launch(&r, e->k, e->n) : CUDA_SUCCESS;
}

SIM_API CUresult cuGraphLaunch(CUgraphExec e, CUstream s)
{
    return graph_launch(e, s, 0, 1);
}

SIM_API CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream s)
{
    return graph_launch(e, s, 1, 1);
}

SIM_API CUresult cuGraphUpload(CUgraphExec e, CUstream s)
{
    return graph_launch(e, s, 0, 0);
}

SIM_API CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream s)
{
    return graph_launch(e, s, 1, 0);
}

/* ---- stream capture ---------------------------------------------------- */

static CUresult begin_capture(CUstream hs, int mode, int ptsz)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (mode < CU_STREAM_CAPTURE_MODE_GLOBAL ||
        mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    sim_sref r;
    rc = sim_stream_ref(hs, ptsz, &r);
    if (rc)
        return rc;
    if (!r.s)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;   /* legacy stream */
    pthread_mutex_lock(&sim_mu);
    if (r.s->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    struct CUgraph_st *g = sim_graph_new();
    if (g) {
        r.s->cap_graph = g;
        r.s->cap_mode = mode;
        r.s->cap_id = ++g_capture_ids;
        r.s->capture = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    }
    pthread_mutex_unlock(&sim_mu);
    return g ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

SIM_API CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode)
{
    return begin_capture(s, (int)mode, 0);
}

SIM_API CUresult cuStreamBeginCapture_v2_ptsz(CUstream s,
                                              CUstreamCaptureMode mode)
{
    return begin_capture(s, (int)mode, 1);
}

SIM_API CUresult cuStreamBeginCapture(CUstream s)
{
    return begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL, 0);
}

SIM_API CUresult cuStreamBeginCapture_ptsz(CUstream s)
{
    return begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL, 1);
}

static CUresult end_capture(CUstream hs, CUgraph *pg, int ptsz)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!pg)
        return CUDA_ERROR_INVALID_VALUE;
    sim_sref r;
    rc = sim_stream_ref(hs, ptsz, &r);
    if (rc)
        return rc;
    if (!r.s)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&sim_mu);
    int st = r.s->capture;
    struct CUgraph_st *g = r.s->cap_graph;
    r.s->capture = CU_STREAM_CAPTURE_STATUS_NONE;
    r.s->cap_graph = NULL;
    if (st == CU_STREAM_CAPTURE_STATUS_INVALIDATED && g) {
        sim_graph_free(g);
        g = NULL;
    }
    pthread_mutex_unlock(&sim_mu);
    *pg = g;
    if (st == CU_STREAM_CAPTURE_STATUS_NONE)
        return CUDA_ERROR_ILLEGAL_STATE;
    if (st == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamEndCapture(CUstream s, CUgraph *pg)
{
    return end_capture(s, pg, 0);
}

SIM_API CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *pg)
{
    return end_capture(s, pg, 1);
}

static CUresult is_capturing(CUstream hs, CUstreamCaptureStatus *st, int ptsz)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!st)
        return CUDA_ERROR_INVALID_VALUE;
    sim_sref r;
    rc = sim_stream_ref(hs, ptsz, &r);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    *st = r.s ? (CUstreamCaptureStatus)r.s->capture
              : CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st)
{
    return is_capturing(s, st, 0);
}

SIM_API CUresult cuStreamIsCapturing_ptsz(CUstream s,
                                          CUstreamCaptureStatus *st)
{
    return is_capturing(s, st, 1);
}

SIM_API CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!mode || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL ||
        *mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = t_mode;
    t_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}
