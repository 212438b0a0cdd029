/*
 * hooks.h - shared by the hook families (hooks_*.c) and the dispatcher.
 */
#ifndef GV_HOOKS_H
#define GV_HOOKS_H

#include "alloc_table.h"
#include "core.h"

/* At the top of an allocating hook: outside enforce mode either pass the
 * call through untouched or fail closed. */
#define GV_ENFORCING_OR(passcall)                                           \
    do {                                                                    \
        int m_ = gv_mode_fast();                                                 \
        if (__builtin_expect(m_ != GV_MODE_ENFORCE, 0))                     \
            return m_ == GV_MODE_PASSTHROUGH ? (passcall) : GV_FAIL_CUDA;   \
    } while (0)

/* For hooks that release: nothing to release outside enforce mode. */
#define GV_ENFORCING_ELSE_PASS(passcall)                                    \
    do {                                                                    \
        if (__builtin_expect(gv_mode_fast() != GV_MODE_ENFORCE, 0))              \
            return (passcall);                                              \
    } while (0)

/* pool_account.c: free p through call(arg) if it is a recorded block of a
 * memory pool (cuMemFree or cuMemFreeAsync), under the pool's lock; 0 if it
 * is not one (nothing done), else 1 with the driver's answer in *rc. */
int gv_pool_free_block(CUdeviceptr p, CUresult (*call)(void *), void *arg, CUresult *rc);

/* hooks_graph.c, graph_record.c, graph_live.c: graph memory.
 * gv_graph_mem_seen: some executable graph of this process has memory
 * nodes (the launch hooks' only check otherwise).  begin/end bracket a launch: begin charges what the graph
 * pool may grow by and returns CUDA_ERROR_OUT_OF_MEMORY (nothing launched)
 * when the quota cannot take it; end settles on the pool's real reserve;
 * between them, gv_graph_mem_launched records, after the driver's answer
 * rc to a launch into stream s, which graph allocations are live.
 * gv_graph_free_alloc frees p through call(arg) (cuMemFree or
 * cuMemFreeAsync) if it is a live graph allocation: 0 if it is not one
 * (nothing done), else 1 with the driver's answer in *rc.
 * gv_graph_mem_refresh re-reads every pool this process charged.
 * gv_graph_teardown_begin/end bracket a context's destruction (destroyed:
 * it was), which frees its graph allocations; its executable graphs' records
 * stay, as their launches must still be charged. */
typedef struct gv_graph_mem {
    uint64_t held;               /* ordinals whose pools are locked */
    void *rec;                   /* the graph's record, referenced */
    unsigned long begun;         /* context destructions begun before */
    int calm;                    /* and none was under way */
    int flying;                  /* in flight (charge.c) until _end */
} gv_graph_mem;
int gv_graph_mem_seen(void);
CUresult gv_graph_mem_begin(gv_graph_mem *m, CUgraphExec e);
void gv_graph_mem_launched(gv_graph_mem *m, CUresult rc, CUstream s, int ptsz);
void gv_graph_mem_end(gv_graph_mem *m);
int gv_graph_free_alloc(CUdeviceptr p, CUresult (*call)(void *), void *arg, CUresult *rc);
void gv_graph_mem_refresh(void);
void gv_graph_teardown_begin(void);
void gv_graph_teardown_end(CUcontext ctx, int destroyed);

/* hooks_context.c: this process's device memory on d as NVML counts it
 * (1), or 0 when NVML does not list this process; and whether a context
 * of this process is being created and measured right now. */
int gv_nvml_self_used(const gv_devinfo *d, uint64_t *used);
int gv_ctx_creating(void);

/* hooks_context.c: release everything charged against a context that the
 * driver destroyed together with the context (the caller has been in
 * flight since before the driver call, and reads untracked memory again
 * once it has landed). */
void gv_release_ctx_objects(CUcontext ctx);

/* Context creations are measured one at a time across the node (node_lock.c):
 * the lock file is $GPUVISOR_NODE_LOCK, by default in the directory HAMi's
 * device plugin shares between containers; empty: off.  gv_node_lock returns
 * a descriptor to pass to gv_node_unlock, or -1 when nothing was locked (no
 * such directory, turned off, or held by another process past a bound).
 * While it holds that lock it also takes HAMi-core's ($GPUVISOR_HAMI_LOCK,
 * /tmp/vgpulock/lock) where its directory exists, for a bounded time;
 * gv_node_unlock gives both back. */
#define GV_ENV_NODE_LOCK "GPUVISOR_NODE_LOCK"
int gv_node_lock(void);
/* The node directory (that of the node lock's file), written to buf: 1, or
 * 0 when it is turned off or does not exist. */
int gv_node_dir(char *buf, size_t len);
void gv_node_unlock(int fd);

/* The per-GPU files in the node directory that every container maps
 * (node_file.c): the launch order (sm_arbiter.c) and the guarantees
 * (oversub.c).  The file <dir>/gpuvisor-<kind>-<uuid> holds size bytes,
 * its first 8 an _Atomic uint64_t magic that a new file takes; lost says
 * what goes without it when it cannot be opened (said once per process:
 * told) or holds another magic. */
typedef struct gv_node_file {
    const char *kind;       /* "sm", "mem" */
    const char *what;       /* "launch-order", ... */
    const char *lost;
    atomic_int told;
} gv_node_file;
/* The file of GPU uuid mapped, or NULL (said in the log).  fdp: where its
 * descriptor is kept open; NULL: closed once mapped. */
void *gv_node_file_map(gv_node_file *nf, const char *uuid, uint64_t magic, size_t size,
                       int *fdp);
/* This container (its region file's identity on the node): non-zero, or 0
 * when the region file cannot be looked at. */
uint64_t gv_node_container(void);
/* A step of the hash that gv_node_container and the launch order's
 * process tokens are made with. */
uint64_t gv_node_mix(uint64_t h, uint64_t v);

/* The hook table (dispatch.c). */
typedef struct gv_hook {
    const char *name;   /* exported symbol name, e.g. "cuMemAlloc_v2" */
    void *fn;           /* our replacement */
} gv_hook;

/* Each hook family lists its hooks, NULL-terminated. */
extern const gv_hook gv_hooks_memory[], gv_hooks_array[], gv_hooks_vmm[], gv_hooks_pool[],
    gv_hooks_context[], gv_hooks_info[], gv_hooks_nvml[], gv_hooks_procaddr[],
    gv_hooks_launch[], gv_hooks_graph[], gv_hooks_untracked[], gv_hooks_sync[], gv_hooks_capture[];

/* Replacement for an exported driver symbol name, or NULL. */
void *gv_hook_for(const char *name);

#endif /* GV_HOOKS_H */
