/*
 * graph_int.h - what hooks_graph.c (the pool charge, the hooks),
 * graph_record.c (an executable graph's memory nodes, read at its
 * instantiation) and graph_live.c (which graph allocations are live)
 * share.  Internal to them.
 */
#ifndef GV_GRAPH_INT_H
#define GV_GRAPH_INT_H

#include <pthread.h>
#include <stdatomic.h>

#include "hooks.h"

/* What an executable graph's memory nodes do, read at its instantiation.
 * Shared by its table entry (GV_K_GEXEC, aux) and each launch in flight,
 * each holding a reference: a launch racing the graph's destruction
 * (a bug of the program's) reads no freed memory. */
typedef struct gop {
    CUdeviceptr addr;
    uint64_t size;               /* 0: a free node */
    int ordinal;                 /* -1: a free node of an allocation made elsewhere */
} gop;

typedef struct gexec {
    atomic_int refs;
    int autofree;                /* CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH */
    int frees;                   /* it has free nodes */
    uint64_t lock;               /* the devices whose pools a launch locks */
    uint64_t per[GV_MAX_ORDINALS]; /* allocation bytes by device */
    size_t n;
    gop ops[];
} gexec;

/* hooks_graph.c: ordinal's graph pool mutex (set up on first use). */
pthread_mutex_t *gv_graph_pool_lock(int ordinal);

/* graph_record.c: drop a reference to r (freed with the last); an
 * executable graph's entry is gone (aux: its record); forget e (1 if it was
 * tracked); after a successful instantiation, remember e if g has memory
 * nodes (fails when they cannot be read or recorded). */
void gv_graph_rec_put(gexec *r);
void gv_graph_exec_dropped(uint64_t aux);
int gv_graph_untrack_exec(CUgraphExec e);
CUresult gv_graph_track_exec(CUgraphExec e, CUgraph g, unsigned long long flags);

/* graph_live.c */
uint64_t gv_graph_own_live(const gexec *r, int ordinal);
void gv_graph_forget_live(const gexec *r);
/* Context destructions begun before now, and whether none was under way. */
unsigned long gv_graph_teardowns(int *calm);
void gv_graph_live_child_reset(void);

#endif
