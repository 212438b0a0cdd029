/*
 * hooks_context.c - memory that contexts take.
 *
 * A context reserves device memory of its own (hundreds of MiB on real
 * GPUs).  The driver does not say how much, so it is measured: NVML's
 * per-process usage of this process (under its own PID, or the host PID it
 * learned: below; if neither is listed, the device's used memory) before
 * and after the context is created.  The
 * measured cost is charged to the quota; if it does not fit, the context
 * is destroyed again and the call fails with CUDA_ERROR_OUT_OF_MEMORY.
 * Both snapshots and the creation are made under the node lock
 * (node_lock.c), so other containers' new contexts stay out of them.
 *
 * A context that does not fit would still take its memory on the device
 * while it is created and measured, past the quota.  So the container
 * learns what a context costs on each device (the smallest non-zero cost
 * any of its processes measured, kept in the region: region_ctx_cost) and
 * reserves that much before the driver is called; a reservation that does
 * not fit fails the call with CUDA_ERROR_OUT_OF_MEMORY and the driver
 * creates nothing.  The reservation is then settled on the measured cost
 * (more reserved, or the difference given back).  A container that has
 * measured no context yet reserves what the containers of the node
 * measured on the GPU (the smallest, kept in the node-wide file of the
 * launch order: sm_arbiter.c), so that its first context is covered too.
 * While no cost is known at all, nothing is reserved in advance.
 *
 * Destroying a context also frees every allocation made in it, so those
 * charges are released with it; and its events, so the SM meter is done
 * with the launches made in it first (gv_sm_ctx_destroying).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "hooks.h"
#include "log.h"
#include "sm.h"

#define MAX_CTX_COST (16ULL << 30)   /* a larger delta is noise from others */

#define SNAP_PIDS 64

typedef struct {
    int ok;
    int proc_seen;
    int charged_read;               /* charged was read */
    int charged_ok;                 /* ... and in step with NVML's figure */
    uint64_t charged;               /* what this process has charged on the device */
    uint64_t dev_used;
    uint64_t proc_used;
    unsigned npids;                 /* the processes NVML listed */
    uint32_t pids[SNAP_PIDS];
    uint64_t used[SNAP_PIDS];
} snapshot;

/* ---- the PID NVML shows for this process -------------------------------
 *
 * Learned the way HAMi-core does it: the one PID that NVML lists after this
 * process created a context on a device and did not list before; kept in
 * nvml_pid.c, where both the memory and the SM path read it.  Other
 * processes of the node creating contexts in the same moment would add new
 * PIDs of their own: the before/after pair is taken under the node lock
 * (node_lock.c) where containers share one.  If two new PIDs appear all
 * the same, nothing is learned (the next context may tell). */
static void learn_self(const snapshot *before, snapshot *after)
{
    if (!before->ok || !after->ok || after->proc_seen)
        return;                 /* listed as itself: one PID namespace */
    unsigned fresh = 0, at = 0;
    for (unsigned i = 0; i < after->npids; i++) {
        unsigned j = 0;
        while (j < before->npids && before->pids[j] != after->pids[i])
            j++;
        if (j == before->npids) {
            fresh++;
            at = i;
        }
    }
    if (fresh != 1) {
        gv_log(GV_LOG_DEBUG, "NVML does not list this process; %u new PIDs after its context "
               "was created, so its NVML PID is not known yet", fresh);
        return;
    }
    uint32_t pid = after->pids[at];
    gv_nvml_self_learned(pid);
    after->proc_seen = 1;
    after->proc_used = after->used[at];
    gv_log(GV_LOG_INFO, "NVML lists this process as PID %u (another PID namespace)", pid);
}

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static int nvml_ok;

static void nvml_init(void)
{
    nvml_ok = GV_REAL(nvmlInit_v2, nvmlReturn_t (*)(void))() == NVML_SUCCESS;
    if (!nvml_ok)
        gv_log(GV_LOG_WARN, "NVML unavailable: context memory is not measured");
}

static void snap(const gv_devinfo *d, snapshot *s)
{
    typedef nvmlReturn_t (*by_uuid_fn)(const char *, nvmlDevice_t *);
    typedef nvmlReturn_t (*mem_fn)(nvmlDevice_t, nvmlMemory_t *);
    typedef nvmlReturn_t (*procs_fn)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *);
    memset(s, 0, sizeof *s);
    pthread_once(&nvml_once, nvml_init);
    uint64_t begun = gv_charges_begun();
    nvmlDevice_t h;
    nvmlMemory_t m;
    if (!nvml_ok || GV_REAL(nvmlDeviceGetHandleByUUID, by_uuid_fn)(d->uuid_str, &h) != NVML_SUCCESS ||
        GV_REAL(nvmlDeviceGetMemoryInfo, mem_fn)(h, &m) != NVML_SUCCESS)
        return;
    s->ok = 1;
    s->dev_used = m.used;
    nvmlProcessInfo_t infos[256];
    unsigned int n = 256;
    if (GV_REAL(nvmlDeviceGetComputeRunningProcesses_v3, procs_fn)(h, &n, infos) != NVML_SUCCESS)
        return;
    unsigned int me = gv_nvml_self_pid();
    for (unsigned int i = 0; i < n && i < 256; i++) {
        /* A process may be listed more than once (one row per context
         * or instance): add them up. */
        int known = infos[i].usedGpuMemory != NVML_VALUE_NOT_AVAILABLE;
        uint64_t used = known ? infos[i].usedGpuMemory : 0;
        if (infos[i].pid == me && known) {
            s->proc_seen = 1;
            s->proc_used += used;
        }
        unsigned j = 0;
        while (j < s->npids && s->pids[j] != infos[i].pid)
            j++;
        if (j < s->npids) {
            s->used[j] += used;
        } else if (s->npids < SNAP_PIDS) {
            s->pids[s->npids] = infos[i].pid;
            s->used[s->npids++] = used;
        }
    }
    /* What this process charged meanwhile: read after NVML, and in step
     * with it only if no charge was in flight and none began since. */
    gv_region *r = gv_core_region();
    int slot = r ? region_self_slot(r) : -1;
    if (slot >= 0) {
        s->charged = region_slot_resident(r, d->region_dev, slot);
        s->charged_read = 1;
        /* A pending stream-ordered free may land in NVML at any moment:
         * the context would look smaller by its block. */
        s->charged_ok = !gv_charges_in_flight() && !gv_pending_frees_waiting() &&
                        gv_charges_begun() == begun;
    }
}

/* The "after" reading, in step with this process's charges if it can be.
 * While another thread's charge is in flight, NVML's figure and the
 * charges disagree: an allocation reserved before the driver answered
 * would be taken out of the context's cost, and so would a free the driver
 * has made before the quota was given back; with nothing taken out, any
 * free made meanwhile would be.  Either way the context would look smaller
 * than it is (charged nothing, if a thread freed as much meanwhile).  A
 * charge lands when its driver call answers: read again, every
 * millisecond, until none is in flight, for at most a second. */
#define AFTER_TRIES 1000

static void snap_after(const gv_devinfo *d, snapshot *s)
{
    for (int i = 0;; i++) {
        gv_pending_frees_reap();    /* stream-ordered frees land when reached */
        snap(d, s);
        if (!s->ok || !s->charged_read || s->charged_ok || i >= AFTER_TRIES)
            return;
        struct timespec ts = { 0, 1000 * 1000 };
        nanosleep(&ts, NULL);
    }
}

static uint64_t cost(const snapshot *before, const snapshot *after)
{
    uint64_t c = 0;
    if (!before->ok || !after->ok)
        return 0;
    if (after->proc_seen) {
        uint64_t b = before->proc_seen ? before->proc_used : 0;
        /* Other threads of this process may have allocated or freed on the
         * device meanwhile: what they charged is not the context's.  Taken
         * out only when the last reading was in step (otherwise an
         * allocation charged but not yet in NVML's figure would be taken
         * out too, and the context under-charged); a change that began
         * before the first reading can only leave the cost too high. */
        if (after->charged_ok && before->charged_read) {
            b += after->charged;
            b = b > before->charged ? b - before->charged : 0;
        }
        c = after->proc_used > b ? after->proc_used - b : 0;
    } else {
        c = after->dev_used > before->dev_used ? after->dev_used - before->dev_used : 0;
    }
    return c > MAX_CTX_COST ? MAX_CTX_COST : c;
}

/* Contexts of this process being created and measured now: what NVML
 * shows for the process then is not yet charged (untracked.c waits). */
static atomic_int creating;
static pthread_once_t creating_once = PTHREAD_ONCE_INIT;

/* A child forked in the middle of a creation is not creating anything. */
static void creating_child(void) { atomic_store(&creating, 0); }
static void creating_setup(void) { pthread_atfork(NULL, NULL, creating_child); }

static void creating_begin(void)
{
    pthread_once(&creating_once, creating_setup);
    atomic_fetch_add(&creating, 1);
}

int gv_ctx_creating(void) { return atomic_load_explicit(&creating, memory_order_relaxed) > 0; }

int gv_nvml_self_used(const gv_devinfo *d, uint64_t *used)
{
    snapshot s;
    snap(d, &s);
    if (!s.ok || !s.proc_seen)
        return 0;
    *used = s.proc_used;
    return 1;
}

/* ---- releasing what a destroyed context took -------------------------- */

/* (Executable graphs' entries have no context: they outlive it.) */
static int owned_by(const gv_alloc *a, void *ctx)
{
    return a->ctx == ctx && a->kind != GV_K_VMM && a->kind != GV_K_MAP &&
           a->kind != GV_K_GEXEC;
}

static void release_entry(const gv_alloc *a, void *unused)
{
    (void)unused;
    gv_uncharge_alloc(a);
}

void gv_release_ctx_objects(CUcontext ctx)
{
    if (ctx)
        gv_table_take_all(owned_by, release_entry, ctx);
    gv_graph_mem_refresh();
}

/* ---- reserving a context's cost before it is created -------------------- */

/* Reserve the cost the container learned for a context on d (nothing while
 * none is known: *held 0).  Made before the "before" snapshot and kept out
 * of flight (gv_charge_keep): the reservation is then in both snapshots'
 * charged figure and cancels out of the measured cost, and it does not
 * make the "after" reading wait for a charge to land.  Called with this
 * process's creation begun (creating_begin), so no reading of NVML takes
 * the reservation for memory given back meanwhile (untracked.c).
 * CUDA_ERROR_OUT_OF_MEMORY: it does not fit, and nothing was reserved. */
/* What the node's containers measured a context of d's GPU to take
 * (sm_arbiter.c), or 0.  The word lies in a file every container can
 * write: one that stored 1 TiB there made every new memory-limited
 * container's first context fail with out-of-memory.  A cost above a
 * quarter of the device's memory is ignored (contexts take 1-4 % of a
 * GPU's memory: 0.3-0.6 GiB on 16-80 GiB devices), said once per process;
 * the context is then created and measured, and its cost lowers the word
 * again (gv_arb_learn_ctx_cost). */
static uint64_t node_ctx_cost(const gv_devinfo *d)
{
    uint64_t cost = gv_arb_ctx_cost(d->region_dev, d->uuid_str);
    if (cost == 0 || cost <= d->physical_total / 4)
        return cost;
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gv_log(GV_LOG_WARN, "gpuvisor-sm-%s (node directory): a context cost of %llu bytes is "
               "implausible (more than a quarter of the device's %llu bytes): ignored, the "
               "context is measured", d->uuid_str, (unsigned long long)cost,
               (unsigned long long)d->physical_total);
    return 0;
}

static CUresult ctx_reserve(int ordinal, const gv_devinfo *d, uint64_t *held)
{
    *held = 0;
    gv_region *r = gv_core_region();
    uint64_t want = r ? region_ctx_cost(r, d->region_dev) : 0;
    const char *who = "as measured before";
    if (want == 0) {
        want = node_ctx_cost(d);
        who = "as another container of this node measured";
    }
    if (want == 0)
        return CUDA_SUCCESS;
    gv_charge c;
    CUresult rc = gv_charge_begin(&c, ordinal, NULL, want);
    if (rc != CUDA_SUCCESS) {
        if (rc == CUDA_ERROR_OUT_OF_MEMORY)
            gv_log(GV_LOG_INFO, "a context takes %llu bytes on device %d, %s: "
                   "refused before creating it", (unsigned long long)want, ordinal, who);
        return rc;
    }
    *held = c.bytes;
    gv_charge_keep(&c);
    return CUDA_SUCCESS;
}

/* The driver created a context on d and it was measured: n bytes.  The
 * container's cost for d is the smallest non-zero one measured. */
static void ctx_learn(const gv_devinfo *d, uint64_t n)
{
    gv_region *r = gv_core_region();
    if (r)
        region_learn_ctx_cost(r, d->region_dev, n);
    gv_arb_learn_ctx_cost(d->region_dev, d->uuid_str, n);
}

/* Charge a context measured at n bytes, taking over the reservation held
 * (gv_charge_begin's rounding on both, so the charge is what it was
 * without one).  On failure, nothing is charged or held any more. */
static CUresult ctx_charge(gv_charge *c, int ordinal, CUcontext ctx, const gv_devinfo *d,
                           uint64_t held, uint64_t n)
{
    if (held == 0)
        return gv_charge_begin(c, ordinal, ctx, n);
    CUresult rc = gv_charge_begin(c, ordinal, ctx, 0);
    if (rc != CUDA_SUCCESS) {
        gv_uncharge(d->region_dev, held);
        return rc;
    }
    c->bytes = held;            /* the charge's own now */
    rc = gv_charge_resize(c, n);
    if (rc != CUDA_SUCCESS)
        gv_charge_cancel(c);    /* gives the reservation back too */
    return rc;
}

/* ---- created contexts --------------------------------------------------- */

/* After the real call (rc): the "after" snapshot, which ends the node lock
 * taken for the "before" one (ctx_prepare), and the charge, which takes
 * over the reservation held (given back if the creation failed). */
static CUresult charge_new_ctx_measured(CUresult rc, CUcontext *pctx, int ordinal,
                                        const snapshot *before, const gv_devinfo *d, int lock,
                                        uint64_t held)
{
    if (rc != CUDA_SUCCESS || !pctx) {
        gv_node_unlock(lock);
        gv_uncharge(d->region_dev, held);
        return rc;
    }
    snapshot after;
    snap_after(d, &after);
    gv_node_unlock(lock);
    learn_self(before, &after);
    uint64_t n = cost(before, &after);
    ctx_learn(d, n);
    gv_charge c;
    rc = ctx_charge(&c, ordinal, *pctx, d, held, n);
    if (rc != CUDA_SUCCESS) {
        GV_REAL(cuCtxDestroy_v2, CUresult (*)(CUcontext))(*pctx);
        *pctx = NULL;
        return rc;
    }
    gv_charge_commit(&c, GV_K_CTX, (uint64_t)(uintptr_t)*pctx, 0);
    return CUDA_SUCCESS;
}

/* The same, and the end of this process's context creation. */
static CUresult charge_new_ctx(CUresult rc, CUcontext *pctx, int ordinal, const snapshot *before,
                               const gv_devinfo *d, int lock, uint64_t held)
{
    rc = charge_new_ctx_measured(rc, pctx, ordinal, before, d, lock, held);
    atomic_fetch_sub(&creating, 1);
    return rc;
}

/* Prepare: device info, the reservation of the learned cost, the node lock
 * and the "before" snapshot.  Non-zero: nothing held or locked; *err is
 * GV_FAIL_CUDA or CUDA_ERROR_OUT_OF_MEMORY (fail without the driver), or
 * anything else (pass through). */
static int ctx_prepare(int ordinal, const gv_devinfo **d, snapshot *before, CUresult *err,
                       int *lock, uint64_t *held)
{
    *err = gv_device(ordinal, d);
    if (*err != CUDA_SUCCESS)
        return 1;
    creating_begin();
    *err = ctx_reserve(ordinal, *d, held);
    if (*err != CUDA_SUCCESS) {
        atomic_fetch_sub(&creating, 1);
        return 1;
    }
    *lock = gv_node_lock();
    snap(*d, before);
    return 0;
}

#define CTX_CREATE_BODY(call, pctx, dev)                                       \
    GV_ENFORCING_OR(call);                                                     \
    const gv_devinfo *d;                                                       \
    snapshot before;                                                           \
    CUresult err;                                                              \
    int lock = -1;                                                             \
    uint64_t held = 0;                                                         \
    if (ctx_prepare(dev, &d, &before, &err, &lock, &held))                     \
        return err == GV_FAIL_CUDA || err == CUDA_ERROR_OUT_OF_MEMORY ? err : call; \
    return charge_new_ctx(call, pctx, dev, &before, d, lock, held)

typedef CUresult (*create_v2_fn)(CUcontext *, unsigned int, CUdevice);
typedef CUresult (*create_v3_fn)(CUcontext *, CUexecAffinityParam *, int, unsigned int, CUdevice);
typedef CUresult (*create_v4_fn)(CUcontext *, CUctxCreateParams *, unsigned int, CUdevice);
typedef CUresult (*destroy_fn)(CUcontext);

GV_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CTX_CREATE_BODY(GV_REAL(cuCtxCreate, create_v2_fn)(pctx, flags, dev), pctx, dev);
}

GV_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CTX_CREATE_BODY(GV_REAL(cuCtxCreate_v2, create_v2_fn)(pctx, flags, dev), pctx, dev);
}

GV_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n,
                                  unsigned int flags, CUdevice dev)
{
    CTX_CREATE_BODY(GV_REAL(cuCtxCreate_v3, create_v3_fn)(pctx, params, n, flags, dev), pctx, dev);
}

GV_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                                  CUdevice dev)
{
    CTX_CREATE_BODY(GV_REAL(cuCtxCreate_v4, create_v4_fn)(pctx, params, flags, dev), pctx, dev);
}

/* A context's memory, and everything allocated in it, goes in the driver
 * call; its charges only after it.  In flight meanwhile, so that no reading
 * of NVML takes what is gone but still charged for untracked memory that
 * went (untracked.c); read again once the charges are back. */
static CUresult destroy(destroy_fn real, CUcontext ctx)
{
    GV_ENFORCING_ELSE_PASS(real(ctx));
    gv_sm_ctx_destroying(ctx);
    gv_graph_teardown_begin();
    gv_pending_set held;
    gv_pending_frees_hold(ctx, &held);
    gv_charge_flying();
    CUresult rc = real(ctx);
    if (rc == CUDA_SUCCESS) {
        gv_alloc a;
        if (gv_table_take(GV_K_CTX, (uint64_t)(uintptr_t)ctx, &a))
            gv_uncharge(a.dev, a.bytes);
        gv_release_ctx_objects(ctx);
    }
    gv_pending_frees_unhold(&held, rc == CUDA_SUCCESS);
    gv_graph_teardown_end(ctx, rc == CUDA_SUCCESS);
    gv_charge_landed();
    if (rc == CUDA_SUCCESS)
        gv_untracked_reconcile_all();
    return rc;
}

GV_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) { return destroy(GV_REAL(cuCtxDestroy_v2, destroy_fn), ctx); }
GV_EXPORT CUresult cuCtxDestroy(CUcontext ctx) { return destroy(GV_REAL(cuCtxDestroy, destroy_fn), ctx); }

/* ---- primary contexts --------------------------------------------------- */

static struct primary {
    pthread_mutex_t lock;
    int refs;
    int reset;              /* reset while retained: the next retain makes it anew */
    uint64_t charged;       /* 0 until measured */
    int dev;
    CUcontext ctx;
} prim[GV_MAX_ORDINALS];
static pthread_once_t prim_once = PTHREAD_ONCE_INIT;

static void prim_child(void)
{
    for (int i = 0; i < GV_MAX_ORDINALS; i++) {
        pthread_mutex_init(&prim[i].lock, NULL);
        prim[i].refs = 0;
        prim[i].reset = 0;
        prim[i].charged = 0;
        prim[i].ctx = NULL;
    }
}

static void prim_setup(void)
{
    for (int i = 0; i < GV_MAX_ORDINALS; i++)
        pthread_mutex_init(&prim[i].lock, NULL);
    pthread_atfork(NULL, NULL, prim_child);
}

/* dev's primary context record, locked (dev a valid ordinal). */
static struct primary *prim_lock(CUdevice dev)
{
    pthread_once(&prim_once, prim_setup);
    struct primary *p = &prim[dev];
    pthread_mutex_lock(&p->lock);
    return p;
}

static CUresult prim_reset_locked(struct primary *p, CUresult (*real)(CUdevice), CUdevice dev);

GV_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    typedef CUresult (*fn)(CUcontext *, CUdevice);
    fn real = GV_REAL(cuDevicePrimaryCtxRetain, fn);
    GV_ENFORCING_OR(real(pctx, dev));
    const gv_devinfo *d;
    CUresult rc = gv_device(dev, &d);
    if (rc != CUDA_SUCCESS || !pctx)
        return rc == GV_FAIL_CUDA ? rc : real(pctx, dev);
    struct primary *p = prim_lock(dev);
    snapshot before;
    /* The driver makes the context at the first retain, and at the first
     * one after a reset (which leaves the retains as they were). */
    int measure = p->charged == 0, lock = -1, creates = p->refs == 0 || p->reset;
    uint64_t held = 0;
    if (measure) {
        creating_begin();
        /* Only where the driver will create it: a context this process
         * holds already but was charged nothing for (a measurement that
         * found nothing) takes no more memory when retained again. */
        rc = creates ? ctx_reserve(dev, d, &held) : CUDA_SUCCESS;
        if (rc != CUDA_SUCCESS) {
            atomic_fetch_sub(&creating, 1);
            pthread_mutex_unlock(&p->lock);
            return rc;
        }
        lock = gv_node_lock();
        snap(d, &before);
    }
    rc = real(pctx, dev);
    if (rc != CUDA_SUCCESS) {
        gv_node_unlock(lock);
        gv_uncharge(d->region_dev, held);
    } else {
        p->refs++;
        p->reset = 0;
        p->ctx = *pctx;
        if (measure) {
            snapshot after;
            snap_after(d, &after);
            gv_node_unlock(lock);
            learn_self(&before, &after);
            gv_charge c;
            uint64_t n = cost(&before, &after);
            if (creates)
                ctx_learn(d, n);
            if ((n || held) && ctx_charge(&c, dev, *pctx, d, held, n) != CUDA_SUCCESS) {
                GV_REAL(cuDevicePrimaryCtxRelease_v2, CUresult (*)(CUdevice))(dev);
                /* Made anew after a reset, it outlives this retain's
                 * release (the earlier retains still hold it): reset it
                 * again, as it was before the call, not left uncharged. */
                if (--p->refs > 0 && creates)
                    prim_reset_locked(p, GV_REAL(cuDevicePrimaryCtxReset_v2, CUresult (*)(CUdevice)),
                                      dev);
                rc = CUDA_ERROR_OUT_OF_MEMORY;
            } else if (n || held) {
                p->charged = c.bytes;
                p->dev = c.dev;
                gv_charge_keep(&c);
            }
        }
    }
    if (measure)
        atomic_fetch_sub(&creating, 1);
    pthread_mutex_unlock(&p->lock);
    return rc;
}

/* The primary context's memory is gone: release its charge and objects
 * (in flight since before the driver call, as for cuCtxDestroy). */
static void prim_drop(struct primary *p)
{
    if (p->charged)
        gv_uncharge(p->dev, p->charged);
    p->charged = 0;
    gv_release_ctx_objects(p->ctx);
}

static CUresult prim_release(CUresult (*real)(CUdevice), CUdevice dev)
{
    GV_ENFORCING_ELSE_PASS(real(dev));
    if (dev < 0 || dev >= GV_MAX_ORDINALS)
        return real(dev);
    struct primary *p = prim_lock(dev);
    if (p->refs == 1)       /* the last release destroys it */
        gv_sm_ctx_destroying(p->ctx);
    gv_graph_teardown_begin();
    gv_pending_set held;
    gv_pending_frees_hold(p->refs == 1 ? p->ctx : NULL, &held);   /* the last release */
    gv_charge_flying();
    CUresult rc = real(dev);
    int dropped = rc == CUDA_SUCCESS && p->refs > 0 && --p->refs == 0;
    if (dropped)
        prim_drop(p);
    gv_pending_frees_unhold(&held, dropped);
    gv_graph_teardown_end(p->ctx, dropped);
    gv_charge_landed();
    pthread_mutex_unlock(&p->lock);
    if (dropped)
        gv_untracked_reconcile_all();
    return rc;
}

/* Reset p's context through real (p's lock held). */
static CUresult prim_reset_locked(struct primary *p, CUresult (*real)(CUdevice), CUdevice dev)
{
    gv_sm_ctx_destroying(p->ctx);
    gv_graph_teardown_begin();
    gv_pending_set held;
    gv_pending_frees_hold(p->ctx, &held);
    gv_charge_flying();
    CUresult rc = real(dev);
    if (rc == CUDA_SUCCESS) {
        prim_drop(p);       /* the next retain measures it again */
        p->reset = 1;       /* ... and the driver makes it anew then */
    }
    gv_pending_frees_unhold(&held, rc == CUDA_SUCCESS);
    gv_graph_teardown_end(p->ctx, rc == CUDA_SUCCESS);
    gv_charge_landed();
    return rc;
}

static CUresult prim_reset(CUresult (*real)(CUdevice), CUdevice dev)
{
    GV_ENFORCING_ELSE_PASS(real(dev));
    if (dev < 0 || dev >= GV_MAX_ORDINALS)
        return real(dev);
    struct primary *p = prim_lock(dev);
    CUresult rc = prim_reset_locked(p, real, dev);
    pthread_mutex_unlock(&p->lock);
    if (rc == CUDA_SUCCESS)
        gv_untracked_reconcile_all();
    return rc;
}

typedef CUresult (*dev_fn)(CUdevice);
GV_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return prim_release(GV_REAL(cuDevicePrimaryCtxRelease_v2, dev_fn), dev); }
GV_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return prim_release(GV_REAL(cuDevicePrimaryCtxRelease, dev_fn), dev); }
GV_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) { return prim_reset(GV_REAL(cuDevicePrimaryCtxReset_v2, dev_fn), dev); }
GV_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return prim_reset(GV_REAL(cuDevicePrimaryCtxReset, dev_fn), dev); }

const gv_hook gv_hooks_context[] = {
    { "cuCtxCreate", (void *)cuCtxCreate },
    { "cuCtxCreate_v2", (void *)cuCtxCreate_v2 },
    { "cuCtxCreate_v3", (void *)cuCtxCreate_v3 },
    { "cuCtxCreate_v4", (void *)cuCtxCreate_v4 },
    { "cuCtxDestroy", (void *)cuCtxDestroy },
    { "cuCtxDestroy_v2", (void *)cuCtxDestroy_v2 },
    { "cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain },
    { "cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease },
    { "cuDevicePrimaryCtxRelease_v2", (void *)cuDevicePrimaryCtxRelease_v2 },
    { "cuDevicePrimaryCtxReset", (void *)cuDevicePrimaryCtxReset },
    { "cuDevicePrimaryCtxReset_v2", (void *)cuDevicePrimaryCtxReset_v2 },
    { NULL, NULL }
};
