/*
 * graph_record.c - what an executable graph's memory nodes do, read at its
 * instantiation (hooks_graph.c charges its launches from the record).
 *
 * The graph's nodes are read with cuGraphGetNodes / cuGraphNodeGetType /
 * cuGraphMem{Alloc,Free}NodeGetParams, in node order, its child graphs'
 * too (cuGraphChildGraphNodeGetGraph), down to GV_GRAPH_DEPTH levels.  The
 * record (gexec, graph_int.h) lists its allocation and free nodes, its
 * allocation bytes by device, the devices whose pools a launch locks and
 * its flags; its GV_K_GEXEC table entry (nothing charged) holds one
 * reference, each launch in flight another.  Nodes that cannot all be read
 * or recorded fail the instantiation: the graph may have memory nodes.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "graph_int.h"

typedef CUresult (*nodes_fn)(CUgraph, CUgraphNode *, size_t *);
typedef CUresult (*type_fn)(CUgraphNode, CUgraphNodeType *);
typedef CUresult (*alloc_params_fn)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *);
typedef CUresult (*free_params_fn)(CUgraphNode, CUdeviceptr *);
typedef CUresult (*child_fn)(CUgraphNode, CUgraph *);

/* How deep child graphs are read below the graph instantiated; one deeper
 * fails the instantiation (CUDA_ERROR_NOT_SUPPORTED), as its memory nodes
 * would go uncharged.  (The recursion's stack is bounded by it too.) */
#define GV_GRAPH_DEPTH 32

static atomic_int seen;          /* an executable graph here has memory nodes */

int gv_graph_mem_seen(void) { return atomic_load_explicit(&seen, memory_order_relaxed); }

void gv_graph_rec_put(gexec *r)
{
    if (r && atomic_fetch_sub(&r->refs, 1) == 1)
        free(r);
}

/* Memory nodes read so far, in node order (a child graph's in its node's
 * place). */
typedef struct opvec {
    gop *v;
    size_t n, cap;
} opvec;

static CUresult push_op(opvec *o, gop op)
{
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 16;
        gop *v = cap > SIZE_MAX / sizeof *v ? NULL : realloc(o->v, cap * sizeof *v);
        if (!v)
            return CUDA_ERROR_OUT_OF_MEMORY;
        o->v = v;
        o->cap = cap;
    }
    o->v[o->n++] = op;
    return CUDA_SUCCESS;
}

/* Append g's memory nodes to o, and those of its child graphs, depth
 * levels below the graph instantiated.  Fails, with the driver's error,
 * CUDA_ERROR_OUT_OF_MEMORY or CUDA_ERROR_NOT_SUPPORTED (a device not
 * accounted for, a child graph past GV_GRAPH_DEPTH), when they cannot all
 * be read or recorded. */
static CUresult read_nodes(CUgraph g, int depth, opvec *o)
{
    size_t n = 0;
    CUresult rc = GV_REAL(cuGraphGetNodes, nodes_fn)(g, NULL, &n);
    if (rc != CUDA_SUCCESS || n == 0)
        return rc;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    if (!nodes)
        return CUDA_ERROR_OUT_OF_MEMORY;
    rc = GV_REAL(cuGraphGetNodes, nodes_fn)(g, nodes, &n);
    for (size_t i = 0; i < n && rc == CUDA_SUCCESS; i++) {
        CUgraphNodeType t;
        rc = GV_REAL(cuGraphNodeGetType, type_fn)(nodes[i], &t);
        gop op = { 0, 0, -1 };
        if (rc != CUDA_SUCCESS) {
            break;
        } else if (t == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            CUDA_MEM_ALLOC_NODE_PARAMS prm;
            memset(&prm, 0, sizeof prm);
            rc = GV_REAL(cuGraphMemAllocNodeGetParams, alloc_params_fn)(nodes[i], &prm);
            if (rc == CUDA_SUCCESS && (prm.poolProps.location.id < 0 ||
                                       prm.poolProps.location.id >= GV_MAX_ORDINALS))
                rc = CUDA_ERROR_NOT_SUPPORTED;  /* a device not accounted for */
            if (rc != CUDA_SUCCESS || prm.bytesize == 0)
                continue;
            op = (gop){ prm.dptr, prm.bytesize, prm.poolProps.location.id };
        } else if (t == CU_GRAPH_NODE_TYPE_MEM_FREE) {
            rc = GV_REAL(cuGraphMemFreeNodeGetParams, free_params_fn)(nodes[i], &op.addr);
            if (rc != CUDA_SUCCESS)
                continue;
        } else if (t == CU_GRAPH_NODE_TYPE_GRAPH) {
            CUgraph child = NULL;
            if (depth >= GV_GRAPH_DEPTH)
                rc = CUDA_ERROR_NOT_SUPPORTED;  /* too deep to read */
            else if ((rc = GV_REAL(cuGraphChildGraphNodeGetGraph, child_fn)(nodes[i], &child)) ==
                     CUDA_SUCCESS)
                rc = read_nodes(child, depth + 1, o);
            continue;
        } else {
            continue;
        }
        rc = push_op(o, op);
    }
    free(nodes);
    return rc;
}

/* g's memory nodes, its child graphs' included: *out a record of them with
 * one reference, or NULL when it has none.  Fails, with the driver's error,
 * CUDA_ERROR_OUT_OF_MEMORY or CUDA_ERROR_NOT_SUPPORTED, when they cannot
 * all be read or recorded: the graph may have some. */
static CUresult read_graph(CUgraph g, unsigned long long flags, gexec **out)
{
    *out = NULL;
    opvec o = { NULL, 0, 0 };
    gexec *r = NULL;
    CUresult rc = read_nodes(g, 0, &o);
    if (rc != CUDA_SUCCESS || o.n == 0)
        goto out;
    r = o.n > (SIZE_MAX - sizeof *r) / sizeof r->ops[0]
            ? NULL : calloc(1, sizeof *r + o.n * sizeof r->ops[0]);
    if (!r) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    memcpy(r->ops, o.v, o.n * sizeof r->ops[0]);
    r->n = o.n;
    atomic_init(&r->refs, 1);
    r->autofree = (flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0;
    for (size_t i = 0; i < r->n; i++) {
        gop *op = &r->ops[i];
        if (op->size) {
            r->per[op->ordinal] += op->size;
            r->lock |= 1ULL << op->ordinal;
            continue;
        }
        r->frees = 1;
        for (size_t j = 0; j < r->n && op->ordinal < 0; j++)
            if (r->ops[j].size && r->ops[j].addr == op->addr)
                op->ordinal = r->ops[j].ordinal;
        if (op->ordinal < 0) {
            /* Made by another graph, on a device not known here: every
             * device's pool is locked for its launch. */
            int count = 0;
            if (GV_REAL(cuDeviceGetCount, CUresult (*)(int *))(&count) != CUDA_SUCCESS ||
                count <= 0 || count >= GV_MAX_ORDINALS)
                r->lock = ~0ULL;
            else
                r->lock |= (1ULL << count) - 1;
        }
    }
    *out = r;
    r = NULL;
out:
    free(o.v);
    free(r);
    return rc;
}

/* An executable graph's entry is gone: drop its record's reference. */
void gv_graph_exec_dropped(uint64_t aux) { gv_graph_rec_put((gexec *)(uintptr_t)aux); }

/* e is gone: forget it; 1 if it was tracked. */
int gv_graph_untrack_exec(CUgraphExec e)
{
    gv_alloc a;
    if (!gv_table_take(GV_K_GEXEC, (uint64_t)(uintptr_t)e, &a))
        return 0;
    gv_graph_exec_dropped(a.aux);
    return 1;
}

/* After a successful instantiation: remember an executable graph with
 * memory nodes (GV_K_GEXEC, aux = its record, nothing charged to the
 * entry).  Fails when they cannot be read or recorded.  The entry has no
 * context, so a context's destruction leaves it: CUDA lists no CUgraphExec
 * among what cuCtxDestroy takes, and a graph that can still be launched
 * (the simulator's can, from another context) must still be charged. */
CUresult gv_graph_track_exec(CUgraphExec e, CUgraph g, unsigned long long flags)
{
    gexec *r;
    CUresult rc = read_graph(g, flags, &r);
    if (rc != CUDA_SUCCESS || !r)
        return rc;
    int ordinal = -1;              /* the first device it allocates on */
    for (int i = 0; i < GV_MAX_ORDINALS && ordinal < 0; i++)
        if (r->per[i])
            ordinal = i;
    const gv_devinfo *d = NULL;
    if (ordinal >= 0 && (rc = gv_device(ordinal, &d)) != CUDA_SUCCESS) {
        gv_graph_rec_put(r);
        return rc;
    }
    gv_alloc a = { .key = (uint64_t)(uintptr_t)e, .kind = GV_K_GEXEC,
                   .dev = d ? d->region_dev : -1, .bytes = 0, .aux = (uint64_t)(uintptr_t)r,
                   .ctx = NULL };
    if (gv_table_put(&a) != 0) {
        gv_graph_rec_put(r);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    atomic_store_explicit(&seen, 1, memory_order_relaxed);
    return CUDA_SUCCESS;
}
