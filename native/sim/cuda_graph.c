/*
 * cuda_graph.c - CUDA graphs with kernel (and empty) nodes, and child graph
 * nodes.  A graph is a list of nodes in the order they were added (a
 * valid topological order for graphs built through the API, since a node's
 * dependencies must exist before it); edges are checked but otherwise
 * ignored, as the device runs one kernel at a time anyway.  Executable
 * graphs are in cuda_graph_exec.c, stream capture in cuda_graph_capture.c,
 * and what memory allocation and free nodes hold in cuda_graph_mem.c.
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

#include "cuda_graph_int.h"

#define GRAPH_MAGIC 0x47524148u
#define NODE_MAGIC 0x4e4f4445u

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

int sim_graph_ok_locked(struct CUgraph_st *g)
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
    SIM_TRY(sim_check_args(!pg || flags));
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
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    int ok = sim_graph_ok_locked(g) && !g->owner;   /* its node's to destroy */
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
    if (!sim_graph_ok_locked(g) || !deps_ok_locked(g, deps, ndeps))
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
    SIM_TRY(sim_check_init());
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
    CUresult rc = sim_check_args(!out);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    struct CUgraph_st *sub = NULL;
    if (!sim_graph_ok_locked(g) || !deps_ok_locked(g, deps, ndeps) || !sim_graph_ok_locked(child) ||
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
    SIM_TRY(sim_check_args(!p));
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
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    int ok = sim_graph_ok_locked(g) && deps_ok_locked(g, from, n) &&
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
    if (!sim_graph_ok_locked(g)) {
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
