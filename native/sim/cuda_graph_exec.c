/*
 * cuda_graph_exec.c - executable graphs: instantiation, cuGraphLaunch and
 * cuGraphUpload.  Instantiation copies the kernels; cuGraphLaunch queues
 * them in order on its stream (cuda_launch.c), or appends them to the graph
 * if that stream is capturing.  Memory allocation and free nodes
 * (cuda_graph_mem.c) are run in node order when the graph is launched,
 * before its kernels are queued.  As in CUDA, a graph with memory nodes
 * (a moved child graph's included) has at most one executable graph at a
 * time: another instantiation before cuGraphExecDestroy is
 * CUDA_ERROR_INVALID_VALUE.
 */
#include <stdlib.h>

#include "cuda_graph_int.h"

#define EXEC_MAGIC 0x47455845u

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
    SIM_TRY(sim_check_args(!pe || (flags & ~0xfULL)));
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&sim_mu);
    /* As in CUDA: a graph with memory nodes (its child graphs' included)
     * has at most one executable graph at a time; another instantiation
     * before cuGraphExecDestroy is an error. */
    if (!sim_graph_ok_locked(g) || (g->owner && g->moved) || inst_under_locked(g)) {
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

SIM_ALIAS(cuGraphInstantiate, cuGraphInstantiate_v2);

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
    SIM_TRY(sim_check_init());
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
    sim_sref r;
    CUresult rc = sim_stream_call(1, hs, ptsz, &r);
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
