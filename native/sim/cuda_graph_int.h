/*
 * cuda_graph_int.h - the graph objects that cuda_graph.c (graphs and their
 * nodes) and cuda_graph_exec.c (executable graphs) share.  Internal to them.
 */
#ifndef GV_SIM_GRAPH_INT_H
#define GV_SIM_GRAPH_INT_H

#include "sim.h"

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

/* Whether g is a live graph handle; sim_mu held. */
SIM_HIDDEN int sim_graph_ok_locked(struct CUgraph_st *g);

#endif /* GV_SIM_GRAPH_INT_H */
