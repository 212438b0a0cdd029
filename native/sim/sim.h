/*
 * sim.h - private declarations of gpuvisor's simulated GPU driver
 * (build/sim/libcuda.so.1 and build/sim/libnvidia-ml.so.1).
 *
 * Two layers:
 *   state_*.c  node state shared by every process through a mmap'd file
 *              (devices, per-process physical usage, robust mutex), the
 *              device-spec parser and the fault-injection knobs.  Linked
 *              into both libraries.
 *   cuda_*.c   the driver API, with process-local objects (contexts,
 *   nvml_*.c   allocation table, pools, streams, VMM) / the NVML API.
 */
#ifndef GV_SIM_H
#define GV_SIM_H

#include <pthread.h>
#include <stdint.h>
#include <stddef.h>
#include "gv_cuda.h"

#define SIM_API __attribute__((visibility("default")))
#define SIM_HIDDEN __attribute__((visibility("hidden")))
/* name is another symbol of target, a function of the same parameters
 * defined in the same file (an older or per-thread entry point that does
 * what the newer one does): one body, two exported names */
#define SIM_ALIAS(name, target) \
    SIM_API __typeof__(target) name __attribute__((alias(#target)))

#define SIM_MAX_DEV 16                  /* GPUs, and CUDA ordinals */
#define SIM_MIG_SLOTS 7                 /* GPU instances a GPU holds at once */
/* A "node" is a memory domain with its own devinfo, usage column and
 * timeline: 0..SIM_MAX_DEV-1 the GPUs, then SIM_MIG_SLOTS per GPU for its
 * GPU instances (sim_gi_node). */
#define SIM_MAX_NODE (SIM_MAX_DEV + SIM_MAX_DEV * SIM_MIG_SLOTS)
#define SIM_NVLINKS 18                  /* NVLinks a GPU may have */
#define SIM_MAX_ROWS 512
#define SIM_NAME_LEN 96
#define SIM_UUID_LEN 48
#define SIM_SPEC_LEN 512

#define SIM_MIB (1024ULL * 1024ULL)
#define SIM_GIB (1024ULL * SIM_MIB)
#define SIM_GRAN (2ULL * SIM_MIB)       /* physical page granularity */
#define SIM_ALIGN 512ULL                /* address alignment */

#define SIM_DRIVER_VERSION 13000
#define SIM_DRIVER_STRING "580.65.06"

static inline uint64_t sim_round_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

/* ---- shared state file (state_file.c) ------------------------------- */

#define SIM_MAGIC 0x47565349u           /* "GVSI" */
#define SIM_VERSION 5u

typedef struct sim_devinfo {
    uint64_t total;                     /* bytes */
    uint64_t ctx_size;                  /* bytes a context takes */
    int32_t sms;
    int32_t pad;
    char name[SIM_NAME_LEN];
    char uuid[SIM_UUID_LEN];            /* "GPU-xxxxxxxx-xxxx-..." */
} sim_devinfo;

/* One row per process that ever charged memory.  A row is owned while
 * pid != 0; claiming zeroes used[] first and stores pid last, releasing is
 * the single store pid = 0.  used[] values are only changed by their owner,
 * each change a single 8-byte store under the lock, so a process killed at
 * any instruction leaves usage attributable to its (dead) pid only. */
typedef struct sim_row {
    volatile int32_t pid;
    int32_t pad;
    uint64_t start;                     /* /proc/<pid>/stat field 22 */
    uint64_t image;                     /* which exec image of the pid */
    volatile uint64_t used[SIM_MAX_NODE];
} sim_row;

/* Kernel timeline of one device (state_timeline.c).  The device runs one
 * kernel at a time in launch order across all processes: a launch starts at
 * max(now, busy_until, its stream's dependencies).  ring[] keeps the most
 * recent intervals (CLOCK_MONOTONIC ns) for NVML utilization; back-to-back
 * kernels of one pid merge into one interval.  Updates are ordered so that
 * a process killed at any instruction leaves a consistent timeline: the
 * entry is written before head is bumped, evicted_until is raised before an
 * entry is overwritten. */
#define SIM_TL_RING 8192

typedef struct sim_interval {
    int32_t pid;
    int32_t pad;
    uint64_t start, end;
} sim_interval;

typedef struct sim_timeline {
    volatile uint64_t busy_until;       /* end of the last queued kernel */
    volatile uint64_t head;             /* intervals ever written */
    volatile uint64_t evicted_until;    /* history before this is lost */
    uint64_t launches;                  /* kernels ever queued */
    sim_interval ring[SIM_TL_RING];
} sim_timeline;

/* Where a GPU sits (GPUVISOR_SIM_TOPOLOGY; state_topo.c).  Fixed when the
 * state file is created. */
typedef struct sim_topo_gpu {
    int32_t model;                      /* sim_models index, -1: none */
    int32_t numa;
    int32_t pcie_switch;                /* -1: none (its own) */
    int32_t pcie_upstream;              /* switch above the switch, -1: none */
    int32_t host_bridge;                /* -1: none (its own) */
    int32_t nlinks;                     /* NVLinks it has (0: no NVLink) */
    int32_t mig_capable;
    int32_t pad;
    int8_t link_peer[SIM_NVLINKS];      /* GPU index, SIM_LINK_* */
    char pad2[6];
} sim_topo_gpu;

#define SIM_LINK_NONE (-1)              /* an inactive link */
#define SIM_LINK_SWITCH (-2)            /* a link to an NVSwitch */

/* MIG state (state_mig.c), changed under the lock.  A slot is created by
 * filling it, then storing active = 1; destroyed by the store active = 0,
 * so a process killed at any instruction leaves whole slots only. */
typedef struct sim_ci {
    volatile int32_t active;
    uint32_t id;
    int32_t prof;                       /* compute-instance profile id */
    uint32_t start, size;               /* in compute slices of its GI */
    char uuid[SIM_UUID_LEN];            /* "MIG-..." */
} sim_ci;

typedef struct sim_gi {
    volatile int32_t active;
    uint32_t id;
    int32_t prof;                       /* index in its model's profiles */
    uint32_t start, size;               /* in memory slices */
    sim_ci ci[SIM_MIG_SLOTS];
} sim_gi;

/* Time-slicing mode (state_timeslice.c, GPUVISOR_SIM_TIMESLICE_US > 0):
 * one FIFO queue per process and device (a "context" of the device's
 * runlist) of kernels with their remaining ns and zero-length event
 * markers.  The device is replayed lazily up to t under the node lock.
 * Queues of a process that dies keep running; an empty queue of a dead
 * pid is free for another process. */
#define SIM_TS_CTX 16
#define SIM_TS_Q 1024                   /* items per queue (>= SIM_QUEUE_DEPTH) */

typedef struct sim_tsq {
    volatile int32_t pid;
    int32_t pad;
    uint64_t head;                      /* items ever queued */
    uint64_t tail;                      /* items ever done */
    uint64_t busy_since;                /* a kernel started, not done; 0 none */
    uint64_t rem[SIM_TS_Q];             /* remaining ns of item seq % Q */
    uint64_t done[SIM_TS_Q];            /* completion stamp of item seq % Q */
} sim_tsq;

typedef struct sim_tsdev {
    uint64_t t;                         /* replayed up to */
    int32_t cur;                        /* resident queue, -1 none */
    int32_t next;                       /* switching to, -1 not switching */
    uint64_t sw_until;                  /* the switch ends */
    uint64_t slice_start;               /* the resident queue's turn began */
    uint64_t busy_since;                /* device busy (work or switch); 0 idle */
    sim_tsq q[SIM_TS_CTX];
} sim_tsdev;

typedef struct sim_shared {
    uint32_t magic;
    uint32_t version;
    uint64_t size;
    pthread_mutex_t lock;               /* process-shared, robust */
    uint32_t ndev;
    uint32_t topology;                  /* 1: made from GPUVISOR_SIM_TOPOLOGY */
    char spec[SIM_SPEC_LEN];            /* spec the file was created from */
    sim_devinfo dev[SIM_MAX_NODE];      /* GPUs, then GPU instances */
    sim_topo_gpu topo[SIM_MAX_DEV];
    volatile int32_t mig_mode[SIM_MAX_DEV];
    uint32_t nvswitch;
    uint32_t pad;
    uint64_t mig_serial;                /* instances ever created */
    sim_gi gi[SIM_MAX_DEV][SIM_MIG_SLOTS];
    sim_row rows[SIM_MAX_ROWS];
    sim_timeline tl[SIM_MAX_NODE];
    sim_tsdev ts[SIM_MAX_NODE];
} sim_shared;

enum { SIM_OK = 0, SIM_ERR_SPEC = 1, SIM_ERR_FILE = 2 };

typedef struct sim_proc {
    unsigned int pid;
    int node;                           /* the node the usage is on */
    uint64_t used;
} sim_proc;

SIM_HIDDEN int sim_state_open(void);                 /* once; SIM_OK/ERR */
SIM_HIDDEN int sim_ndev(void);
SIM_HIDDEN const sim_devinfo *sim_dev(int node);
SIM_HIDDEN int sim_charge(int node, uint64_t bytes); /* 0 or -1 (OOM) */
SIM_HIDDEN void sim_uncharge(int node, uint64_t bytes);
SIM_HIDDEN uint64_t sim_used(int node);              /* reaps the dead */
SIM_HIDDEN int sim_procs(int node, sim_proc *out, int max);
/* a GPU's usage and processes, its GPU instances' included */
SIM_HIDDEN uint64_t sim_used_gpu(int gpu);
SIM_HIDDEN int sim_procs_gpu(int gpu, sim_proc *out, int max);
SIM_HIDDEN int sim_node_ok(int node);                /* exists now */
SIM_HIDDEN int sim_node_gpu(int node);               /* the GPU it is on */
SIM_HIDDEN uint64_t sim_proc_start(int pid);         /* 0 if unknown */
SIM_HIDDEN sim_shared *sim_state(void);              /* NULL if not open */
SIM_HIDDEN void sim_state_lock(void);
SIM_HIDDEN void sim_state_unlock(void);

/* ---- kernel timeline (state_timeline.c) ----------------------------- */

SIM_HIDDEN uint64_t sim_now_ns(void);                /* CLOCK_MONOTONIC */
SIM_HIDDEN void sim_sleep_until(uint64_t t_ns);      /* CLOCK_MONOTONIC */
/* queue a kernel of dur_ns on node, not before dep_ns; returns its end */
SIM_HIDDEN uint64_t sim_tl_launch(int node, uint64_t dep_ns, uint64_t dur_ns);
/* when the kernels other processes have queued on node will be done */
SIM_HIDDEN uint64_t sim_tl_others_until(int node);
/* Time-slicing mode.  Knobs are read once (sim_ts_config, from the state
 * open): 0 ok, -1 a bad value (reported, one line naming the variable).
 * sim_ts_us() is the timeslice, 0 when the mode is off.  In the mode the
 * values kept in streams, contexts and events are tokens of this process's
 * queue on the node (0: nothing queued), not times; the sim_tl_* calls
 * below take and give either, by mode. */
SIM_HIDDEN int sim_ts_config(void);
SIM_HIDDEN uint64_t sim_ts_us(void);
/* queue an event marker on node (mode on only); returns its token */
SIM_HIDDEN uint64_t sim_tl_marker(int node);
/* queue a kernel of dur_ns (mode on only); returns its token */
SIM_HIDDEN uint64_t sim_ts_launch(int node, uint64_t dur_ns);
/* bring node's interval ring up to now (mode on; else nothing) */
SIM_HIDDEN void sim_ts_sync_history(int node);
/* 1 if the work up to v (a time or a token) is done */
SIM_HIDDEN int sim_tl_done(int node, uint64_t v);
/* sleep until the work up to v is done */
SIM_HIDDEN void sim_tl_wait(int node, uint64_t v);
/* when the work up to v was done: 0 and *at, or -1 not yet */
SIM_HIDDEN int sim_tl_stamp(int node, uint64_t v, uint64_t *at);
/* copy the intervals that end after from_ns (oldest first) into out (at
 * most max); *known = start of the history still held */
SIM_HIDDEN int sim_tl_history(int node, uint64_t from_ns, sim_interval *out,
                              int max, uint64_t *known);

/* ---- spec, knobs, log (state_spec.c) -------------------------------- */

typedef struct sim_spec {
    int ndev;
    sim_devinfo dev[SIM_MAX_DEV];
    int topology;                       /* from GPUVISOR_SIM_TOPOLOGY */
    int nvswitch;
    int mig[SIM_MAX_DEV];               /* starts in MIG mode */
    sim_topo_gpu topo[SIM_MAX_DEV];
} sim_spec;

SIM_HIDDEN void sim_log(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
SIM_HIDDEN int sim_parse_size(const char *s, uint64_t *out);
SIM_HIDDEN int sim_parse_spec(const char *s, sim_spec *out); /* 0 / -1 */
SIM_HIDDEN int sim_uuid_bytes(const char *uuid, unsigned char out[16]); /* GPU-/MIG- */
SIM_HIDDEN void sim_default_uuid(int index, char *buf, size_t len);
/* The decimal digits v (nothing else, no overflow) into *out; 0, or -1
 * when v is not such a number. */
SIM_HIDDEN int sim_parse_ull(const char *v, unsigned long long *out);
SIM_HIDDEN int sim_knob_uint(const char *var, unsigned long long *out);
/* var as an integer from lo to hi; fallback when unset, or when malformed or
 * out of range (said in one line naming var and its value). */
SIM_HIDDEN unsigned long long sim_knob_range(const char *var, unsigned long long lo,
                                             unsigned long long hi,
                                             unsigned long long fallback);

/* ---- topology file, models, MIG (state_topo.c, state_models.c,
 *      state_mig.c, state_json.c) ------------------------------------ */

/* GPUVISOR_SIM_TOPOLOGY=path: the node it describes into out; 0, or -1
 * after one line that names the file and the field. */
SIM_HIDDEN int sim_parse_topology(const char *path, sim_spec *out);

typedef struct sim_gi_profile {
    int index;                          /* NVML_GPU_INSTANCE_PROFILE_* */
    unsigned id;                        /* the profile id (nvidia-smi's) */
    const char *name;                   /* "1g.10gb" */
    unsigned mem_mib;
    unsigned mem_slices;                /* placement size */
    unsigned compute_slices;
    unsigned sms;
    unsigned max_count;                 /* on an empty GPU */
    unsigned starts;                    /* bit s: a placement starts at s */
    unsigned ce, dec, enc, jpeg, ofa;
} sim_gi_profile;

typedef struct sim_model {
    const char *names[3];               /* NVML names it goes by */
    unsigned mem_mib;
    unsigned sms;
    unsigned nvlinks;
    unsigned mem_slices, compute_slices; /* 0: not MIG-capable */
    int nprof;
    sim_gi_profile prof[8];
} sim_model;

SIM_HIDDEN int sim_model_find(const char *name);     /* index or -1 */
SIM_HIDDEN const sim_model *sim_model_get(int index); /* NULL if none */
/* the model of a GPU (NULL: none or no topology) */
SIM_HIDDEN const sim_model *sim_gpu_model(int gpu);

/* the node of GPU instance slot s of GPU g */
static inline int sim_gi_node(int g, int s)
{
    return SIM_MAX_DEV + g * SIM_MIG_SLOTS + s;
}

/* One CUDA/NVML MIG device: a compute instance. */
typedef struct sim_migdev {
    int gpu, slot, ci;                  /* GPU, GI slot, CI slot */
    int node;                           /* the GI's node */
    char uuid[SIM_UUID_LEN];
} sim_migdev;

/* the MIG devices of gpu (-1: of every GPU) in enumeration order: by GPU,
 * then GPU-instance id, then compute-instance id; returns how many */
SIM_HIDDEN int sim_mig_devices(int gpu, sim_migdev *out, int max);
/* 1 if some live process has memory on gpu or on one of its instances */
SIM_HIDDEN int sim_gpu_in_use_locked(int gpu);
SIM_HIDDEN int sim_mig_capable(int gpu);
SIM_HIDDEN int sim_mig_mode(int gpu);                /* 1: enabled */
SIM_HIDDEN nvmlReturn_t sim_mig_set_mode(int gpu, int mode);
SIM_HIDDEN const sim_gi_profile *sim_gi_profile_by_index(int gpu, int index);
SIM_HIDDEN const sim_gi_profile *sim_gi_profile_by_id(int gpu, unsigned id);
SIM_HIDDEN nvmlReturn_t sim_gi_remaining(int gpu, const sim_gi_profile *p, unsigned *count);
/* start < 0: the first free placement; *slot the new GI's slot */
SIM_HIDDEN nvmlReturn_t sim_gi_create(int gpu, const sim_gi_profile *p, int start, int *slot);
SIM_HIDDEN nvmlReturn_t sim_gi_destroy(int gpu, int slot);
SIM_HIDDEN int sim_gi_compute_slices(int gpu, int slot);  /* 0: no such GI */
SIM_HIDDEN unsigned sim_ci_slices(int idx);
SIM_HIDDEN int sim_ci_supported(int gpu, int slot, int idx);
SIM_HIDDEN unsigned sim_ci_max(int gpu, int slot, int idx);
SIM_HIDDEN int sim_ci_starts(int gpu, int slot, int idx, unsigned *out, int max);
SIM_HIDDEN nvmlReturn_t sim_ci_remaining(int gpu, int slot, int idx, unsigned *count);
SIM_HIDDEN nvmlReturn_t sim_ci_create(int gpu, int slot, int idx, int start, int *ci);
SIM_HIDDEN nvmlReturn_t sim_ci_destroy(int gpu, int slot, int ci);
SIM_HIDDEN int sim_node_in_use_locked(int node);
SIM_HIDDEN void sim_reap_locked(void);

/* ---- CUDA side, process local (cuda_*.c) ---------------------------- */

#define SIM_CTX_MAGIC 0x43545831u
#define SIM_QUEUE_DEPTH 1024            /* pending launches per context */

/* launch limits of compute capability 9.0 (cuDeviceGetAttribute reports
 * them, cuda_launch.c enforces them) */
#define SIM_MAX_BLOCK_THREADS 1024
#define SIM_MAX_BLOCK_X 1024
#define SIM_MAX_BLOCK_Y 1024
#define SIM_MAX_BLOCK_Z 64
#define SIM_MAX_GRID_X 0x7fffffff
#define SIM_MAX_GRID_YZ 65535
#define SIM_MAX_SHMEM (227 * 1024)      /* dynamic, opt-in */
#define SIM_SM_THREADS 2048             /* resident per SM */
#define SIM_SM_BLOCKS 32                /* resident per SM */

struct CUctx_st {
    uint32_t magic;
    int alive;
    int ordinal;                        /* CUDA ordinal */
    int node;                           /* node device index */
    unsigned flags;
    int primary;
    int refcount;                       /* primary: retain count */
    uint64_t charged;                   /* context memory + limits' + modules' */
    uint64_t epoch;                     /* activations so far */
    uint64_t limit[7];                  /* cuCtxSetLimit, by CUlimit */
    /* kernel timeline (cuda_launch.c), CLOCK_MONOTONIC ns, under sim_mu */
    uint64_t legacy_end;                /* work in the legacy stream */
    uint64_t blocking_end;              /* legacy + blocking streams */
    uint64_t all_end;                   /* everything in the context */
    uint64_t pend_head;                 /* launches ever queued */
    uint64_t pend[SIM_QUEUE_DEPTH];     /* end times of the last launches */
};

enum sim_kind { SIM_K_ALLOC = 1, SIM_K_POOL = 2, SIM_K_LOW = 3, SIM_K_GRAPH = 4, SIM_K_MANAGED = 5 };

typedef struct sim_alloc {
    CUdeviceptr addr;
    uint64_t size;                      /* as requested (rounded to 512) */
    uint64_t charged;                   /* physical bytes charged */
    int node;
    int kind;
    struct CUctx_st *ctx;
    struct CUmemPoolHandle_st *pool;
    struct sim_gmem *gmem;              /* SIM_K_GRAPH: its allocation node's */
    unsigned char *pages;               /* SIM_K_MANAGED: 1 per 2 MiB page on the device */
} sim_alloc;

struct CUmemPoolHandle_st {
    uint32_t magic;
    int ordinal;                        /* -1: host-located */
    int node;                           /* -1: host-located */
    int is_default;
    int destroyed;
    uint64_t reserved, reserved_high;
    uint64_t used, used_high;
    uint64_t threshold;
    uint64_t max_size;                  /* 0 = unlimited */
    int reuse[4];
    struct CUmemPoolHandle_st *next;
};

struct CUstream_st {
    uint32_t magic;
    struct CUctx_st *ctx;
    unsigned flags;
    int priority;
    uint64_t ready;                     /* completion of its work so far */
    int capture;                        /* CUstreamCaptureStatus */
    int cap_mode;
    struct CUgraph_st *cap_graph;
    unsigned long long cap_id;
    const void *cap_thread;             /* the thread that began the capture */
};

/* a resolved stream: s == NULL is the context's legacy default stream;
 * the per-thread default stream is a thread-local stream object */
typedef struct sim_sref {
    struct CUctx_st *ctx;
    struct CUstream_st *s;
} sim_sref;

#define SIM_FUNC_MAGIC 0x46554e43u
#define SIM_MOD_MAGIC 0x4d4f4431u
#define SIM_FUNC_NAME 256

struct CUfunc_st {
    uint32_t magic;
    int spin;                           /* named "spin": param 0 = us */
    /* set by the legacy cuFuncSetBlockShape / cuParamSet* (0: unset) */
    unsigned block[3];
    uint32_t param0;
    int have_param0;
    struct CUmod_st *mod;
    struct CUfunc_st *next;
    char name[SIM_FUNC_NAME];
};

struct CUmod_st {
    uint32_t magic;
    int library;                        /* made by cuLibraryLoadData */
    struct CUctx_st *ctx;
    struct CUfunc_st *funcs;
    uint64_t charged;                   /* device memory, in ctx->charged */
    uint64_t epoch;                     /* ctx->epoch when loaded */
};

/* one kernel ready to run: its duration is fixed when it is launched or
 * added to a graph (parameters are read then, as the driver copies them) */
typedef struct sim_kern {
    struct CUfunc_st *f;
    uint64_t dur_ns;
    unsigned grid[3], block[3], shmem;
} sim_kern;

extern SIM_HIDDEN pthread_mutex_t sim_mu;   /* guards all process state */

SIM_HIDDEN CUresult sim_check_init(void);
/* sim_check_init's error, else CUDA_ERROR_INVALID_VALUE when bad (the
 * caller's test of its arguments, which reads no driver state) */
SIM_HIDDEN CUresult sim_check_args(int bad);
/* Returns a failed step's error (of type type, 0 for success) from the
 * calling entry point: SIM_TRY for CUresult, NVML_TRY for nvmlReturn_t. */
#define SIM_RETURN_IF_FAILED(type, step)            \
    do {                                            \
        type try_rc_ = (step);                      \
        if (try_rc_)                                \
            return try_rc_;                         \
    } while (0)
#define SIM_TRY(check) SIM_RETURN_IF_FAILED(CUresult, check)
SIM_HIDDEN int sim_nvisible(void);
SIM_HIDDEN int sim_ord_node(int ordinal);   /* -1 if invalid */
SIM_HIDDEN const char *sim_ord_uuid(int ordinal); /* its UUID (MIG-... on MIG) */
/* The checks of a call about device dev, in the driver's order: not
 * initialised, then out_ok == 0 (a NULL out pointer: INVALID_VALUE), then an
 * invalid ordinal (INVALID_DEVICE).  node (may be NULL) gets its node. */
SIM_HIDDEN CUresult sim_check_dev(int out_ok, CUdevice dev, int *node);
SIM_HIDDEN CUresult sim_current(struct CUctx_st **out);
SIM_HIDDEN int sim_ctx_valid(struct CUctx_st *c);
/* A call that names a context, NULL for the current one: the checks in the
 * driver's order (not initialised or no current context, then out_ok == 0:
 * INVALID_VALUE, then a context that is not live: INVALID_CONTEXT); *c
 * gets the context. */
SIM_HIDDEN CUresult sim_ctx_or_current(CUcontext ctx, int out_ok, struct CUctx_st **c);
SIM_HIDDEN int sim_fault_alloc(void);       /* 1: this allocation fails */
/* GPUVISOR_SIM_CUDA_FAIL knob (read at cuInit): CUDA_ERROR_UNKNOWN if fn is
 * listed, else CUDA_SUCCESS.  Only the functions that call it honour it. */
SIM_HIDDEN CUresult sim_cuda_fail(const char *fn);
/* A new context takes GPUVISOR_SIM_CTX_CREATE_MS (a real driver's take 100 ms
 * or more): sleeps that long, once the context is registered. */
SIM_HIDDEN void sim_ctx_create_delay(void);
SIM_HIDDEN void sim_alloc_delay(void);       /* GPUVISOR_SIM_ALLOC_MS */
SIM_HIDDEN void sim_event_query_delay(void); /* GPUVISOR_SIM_EVENT_QUERY_MS */
SIM_HIDDEN void sim_launch_delay(void);      /* GPUVISOR_SIM_LAUNCH_US */
SIM_HIDDEN void sim_record_delay(void);      /* GPUVISOR_SIM_RECORD_US */
/* A call that gave device memory back takes GPUVISOR_SIM_FREE_MS more,
 * after the memory is given back (NVML shows it gone meanwhile). */
SIM_HIDDEN void sim_free_delay(void);
/* Device memory a module loaded into a context takes (code and data), from
 * GPUVISOR_SIM_MODULE_MIB: 0 unless set. */
SIM_HIDDEN uint64_t sim_module_bytes(void);

/* handle registry: membership test for opaque handles */
SIM_HIDDEN void sim_reg_add(const void *p);
SIM_HIDDEN void sim_reg_del(const void *p);
SIM_HIDDEN int sim_reg_has(const void *p);

/* allocation table (cuda_table.c); callers hold sim_mu */
SIM_HIDDEN int sim_tab_insert(const sim_alloc *a);
SIM_HIDDEN sim_alloc *sim_tab_find(CUdeviceptr addr);      /* exact */
SIM_HIDDEN sim_alloc *sim_tab_range(CUdeviceptr addr);     /* contains */
SIM_HIDDEN void sim_tab_remove(CUdeviceptr addr);
SIM_HIDDEN sim_alloc *sim_tab_next_ctx(struct CUctx_st *c);
SIM_HIDDEN CUdeviceptr sim_va_next(int node, uint64_t size, int low);

/* allocate/free device memory of kind ALLOC/LOW (cuda_memory.c) */
SIM_HIDDEN CUresult sim_dev_alloc(CUdeviceptr *out, uint64_t size, int low);
SIM_HIDDEN void sim_free_entry_locked(sim_alloc *a);
SIM_HIDDEN void sim_ctx_release_allocs(struct CUctx_st *c);
/* Destroy every event of c (cuda_event.c): its context is destroyed. */
SIM_HIDDEN void sim_ctx_drop_events(struct CUctx_st *c);

/* VMM mappings (cuda_vmm.c): range of the mapping containing p */
SIM_HIDDEN int sim_vmm_range(CUdeviceptr p, CUdeviceptr *base, uint64_t *size);

/* streams (cuda_stream.c): context a stream belongs to; NULL, legacy and
 * per-thread handles mean the current context */
SIM_HIDDEN CUresult sim_stream_ctx(CUstream s, struct CUctx_st **out);

/* streams with the timeline (cuda_stream.c, cuda_launch.c).  ptsz: the
 * call came through a _ptsz entry point, so NULL means per-thread. */
SIM_HIDDEN CUresult sim_stream_ref(CUstream h, int ptsz, sim_sref *out);
/* A call on stream h: not initialised, then args_ok == 0 (the call's other
 * arguments are wrong: INVALID_VALUE), then sim_stream_ref. */
SIM_HIDDEN CUresult sim_stream_call(int args_ok, CUstream h, int ptsz, sim_sref *out);
SIM_HIDDEN uint64_t sim_sref_ready_locked(const sim_sref *r);
SIM_HIDDEN void sim_sref_after_locked(const sim_sref *r, uint64_t t);
SIM_HIDDEN CUresult sim_sref_sync(const sim_sref *r);
SIM_HIDDEN void sim_ctx_sync_wait(struct CUctx_st *c);
/* validate a function and compute its duration */
SIM_HIDDEN CUresult sim_kern_make(sim_kern *k, CUfunction f, const unsigned grid[3],
                                  const unsigned block[3], unsigned shmem,
                                  void **params, void **extra);
/* run (or capture) kernels on a stream, in order */
SIM_HIDDEN CUresult sim_launch(const sim_sref *r, const sim_kern *k, int n);
/* graphs (cuda_graph.c): capture appends to the stream's graph */
SIM_HIDDEN CUresult sim_graph_append_locked(struct CUgraph_st *g, const sim_kern *k);
SIM_HIDDEN struct CUgraph_st *sim_graph_new(void);
SIM_HIDDEN void sim_graph_free(struct CUgraph_st *g);

/* graph memory (cuda_graph_mem.c): one record per allocation node's
 * address; an executable graph holds its memory nodes as a list of ops */
struct sim_gmem;
typedef struct sim_gmop {
    struct sim_gmem *gm;
    int free;                           /* 0: allocate, 1: free */
} sim_gmop;
SIM_HIDDEN void sim_gmem_ref_locked(struct sim_gmem *gm);
SIM_HIDDEN void sim_gmem_unref_locked(struct sim_gmem *gm);
/* run an executable graph's memory ops (upload: only reserve for them) */
SIM_HIDDEN CUresult sim_gmem_run_locked(const sim_gmop *ops, int n, unsigned long long flags,
                                        int upload, struct CUctx_st *ctx);
SIM_HIDDEN void sim_gmem_free_locked(sim_alloc *a);
/* graph side of memory nodes (cuda_graph.c) */
SIM_HIDDEN CUresult sim_graph_add_mem(CUgraphNode *out, CUgraph g, const CUgraphNode *deps,
                                      size_t ndeps, int type, struct sim_gmem *gm);
SIM_HIDDEN CUresult sim_graph_append_mem_locked(struct CUgraph_st *g, int type,
                                                struct sim_gmem *gm);
SIM_HIDDEN struct sim_gmem *sim_graph_node_gmem(CUgraphNode nd, int type);
/* stream capture of cuMemAllocAsync / cuMemFreeAsync: 0 if s is not
 * capturing (nothing done), else 1 with the call's result in *rc */
SIM_HIDDEN int sim_capture_alloc(CUstream s, int ptsz, CUdeviceptr *dptr, size_t size,
                                 CUresult *rc);
SIM_HIDDEN int sim_capture_free(CUstream s, int ptsz, CUdeviceptr dptr, CUresult *rc);
/* A "potentially unsafe" call (cuEventQuery, cuEventSynchronize) made by
 * this thread while a capture forbids it (its capture mode rules, see
 * cuda_graph_capture.c): the captures that forbid it are invalidated and
 * it returns 1 (the call answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED). */
SIM_HIDDEN int sim_capture_forbids(void);
/* s, being destroyed, no longer captures (sim_mu held). */
SIM_HIDDEN void sim_capture_forget_locked(struct CUstream_st *s);

/* pools (cuda_pool.c) */
/* A synchronisation on ordinal (-1: all devices) shrinks pools to their
 * release threshold; one that gave memory back then waits
 * GPUVISOR_SIM_FREE_MS, as every call that gives memory back does. */
SIM_HIDDEN void sim_pools_sync(int ordinal);
SIM_HIDDEN void sim_pool_block_free_locked(sim_alloc *a);

/* ---- NVML side (nvml_*.c) -------------------------------------------- */

/* A device handle: a GPU (gi < 0), or a MIG device (GPU instance slot
 * gi, compute instance slot ci of GPU node). */
struct nvmlDevice_st { int node; int gi; int ci; };
struct nvmlGpuInstance_st { int gpu; int slot; };
struct nvmlComputeInstance_st { int gpu; int slot; int ci; };

SIM_HIDDEN nvmlDevice_t sim_nvml_gpu_handle(int gpu);
SIM_HIDDEN void sim_nvml_pci_info(int gpu, nvmlPciInfo_t *p);
SIM_HIDDEN nvmlDevice_t sim_nvml_mig_handle(int gpu, int slot, int ci);
/* s into buf of len bytes, as NVML's string getters give it:
 * NVML_ERROR_INSUFFICIENT_SIZE when it does not fit with its NUL */
SIM_HIDDEN nvmlReturn_t sim_nvml_put_str(char *buf, unsigned int len, const char *s);
/* v into *out, as NVML's getters of one number give it:
 * NVML_ERROR_INVALID_ARGUMENT when out is NULL */
SIM_HIDDEN nvmlReturn_t sim_nvml_put_uint(unsigned int *out, unsigned int v);
/* the MIG device a handle names now: 0, or -1 if it is not one (or no
 * longer exists) */
SIM_HIDDEN int sim_nvml_mig(nvmlDevice_t d, sim_migdev *out);

/* GPUVISOR_SIM_NVML_FAIL knob: the code fn must fail with, or 0 */
SIM_HIDDEN nvmlReturn_t sim_nvml_fail(const char *fn);
/* The PID NVML reports for pid: pid + GPUVISOR_SIM_NVML_PID_OFFSET (as a
 * real driver reports host PIDs to a process in a PID namespace). */
SIM_HIDDEN unsigned sim_nvml_pid(unsigned pid);
SIM_HIDDEN int sim_nvml_ready(void);
SIM_HIDDEN int sim_nvml_node(nvmlDevice_t d);         /* -1 if invalid */

#define NVML_TRY(step) SIM_RETURN_IF_FAILED(nvmlReturn_t, step)

/* every NVML entry point starts with this */
#define NVML_ENTRY(fn)                              \
    do {                                            \
        nvmlReturn_t fr_ = sim_nvml_fail(fn);       \
        if (fr_)                                    \
            return fr_;                             \
        if (!sim_nvml_ready())                      \
            return NVML_ERROR_UNINITIALIZED;        \
    } while (0)

/* ... and one that takes a GPU's handle declares int gpu, its node index,
 * after NVML_ENTRY: NVML_ERROR_INVALID_ARGUMENT for a handle that names
 * no GPU. */
#define NVML_GPU_ENTRY(fn, dev, gpu)                \
    NVML_ENTRY(fn);                                 \
    int gpu = sim_nvml_node(dev);                   \
    if (gpu < 0)                                    \
        return NVML_ERROR_INVALID_ARGUMENT

#endif /* GV_SIM_H */
