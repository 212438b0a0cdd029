/*
 * untracked.c - device memory a driver gives a process without a call the
 * hooks charge: the per-thread stack, the device heap and the printf FIFO
 * (cuCtxSetLimit, and the stack the driver grows by itself when a kernel
 * needs more), module code and data, and whatever else no hook sees.
 *
 * NVML's per-process figure is what the device really gave this process.
 * What it shows beyond what the process has charged is charged too, as
 * memory already held (region_charge_held): never refused, so the
 * container's total may pass its limit, and its next allocations are then
 * refused until the memory comes back.  When the figure falls, the charge
 * follows it down.  The figure is re-read
 *   - at most once a second, on the allocation and memory-info paths;
 *   - at once after cuCtxSetLimit (tried again every millisecond, for a
 *     second at most, until a reading can be used: see below), which is
 *     refused (the old limit put back) when the memory it took does not
 *     fit the quota, or, raising a limit, when no reading could be used;
 *   - after a context is destroyed, and before an allocation is refused.
 * A reading is used only if the process's own charge did not move while
 * NVML was read, no charge of this process was in flight nor began
 * meanwhile (reserved before its driver call answered, or a free from
 * before its driver call until its charge is given back: the driver's
 * figure and the charge disagree by that much then; every free that gives
 * memory back is one, context destruction and VMM releases included;
 * cuMemFreeAsync of a plain block only until it is pending), and
 * not while this process is creating a context (its
 * memory is measured and charged then, hooks_context.c), nor while a
 * memory pool is charged more than the reserve the driver reports after
 * NVML was read (a synchronisation gave pool memory back and the charge
 * has not followed yet: the pools are settled before each reading, and the
 * synchronisation hooks settle them after the driver call); differences
 * under 2 MiB are ignored.  Stream-ordered frees the streams have reached
 * are released before each reading.  Those still pending (pending_free.c)
 * are charged, and NVML may show them freed or not: the reading is then a
 * range as wide as their bytes, and the charge moves only as far as the
 * range makes certain (up to its low end, down to its high end), so a
 * process that always has such a free pending (an async allocator's loop)
 * is still read.  The charge is then short of the truth by at most what
 * NVML showed freed of the pending blocks, which are still charged
 * themselves: the container's total is not short.  When they are released
 * it would be, so releasing pending frees reads again at once wherever the
 * charge was left below the reading's high end: a reading releases those of
 * every device before it reads its own, so it then reads again each other
 * device whose frees it released (reread_owed).  Nothing happens where
 * NVML does not list this process.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "hooks.h"
#include "log.h"

#define SLACK (2ULL << 20)

static struct held {
    pthread_mutex_t lock;
    uint64_t charged;
    atomic_int short_by_pending; /* charged below the reading's high end
                                  * (set under lock, read without) */
} held[GV_MAX_ORDINALS];
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;
static atomic_long last_tick;
static atomic_int logged;
static atomic_int holding;       /* devices with a charge */
static atomic_int shorted;       /* devices whose charge may be short */
/* This thread's: the region device entries whose pending frees a reading
 * released (before reading its own device) with no reading of them since,
 * and whether they are being read again already (reread_owed). */
static _Thread_local unsigned owed;
static _Thread_local int owing;

int gv_untracked_held(void) { return atomic_load_explicit(&holding, memory_order_relaxed) > 0; }

static void child_reset(void)
{
    /* A forked child holds no device memory of its own. */
    for (int i = 0; i < GV_MAX_ORDINALS; i++) {
        pthread_mutex_init(&held[i].lock, NULL);
        held[i].charged = 0;
        atomic_store(&held[i].short_by_pending, 0);
    }
    atomic_store(&holding, 0);
    atomic_store(&shorted, 0);
    owed = 0;
    owing = 0;
    gv_charges_fork_child();
}

static void setup(void)
{
    for (int i = 0; i < GV_MAX_ORDINALS; i++)
        pthread_mutex_init(&held[i].lock, NULL);
    pthread_atfork(NULL, NULL, child_reset);
}

static void reread_owed(void);

static unsigned dev_bit(const gv_devinfo *d)
{
    return d->region_dev >= 0 && d->region_dev < 32 ? 1u << d->region_dev : 0;
}

int gv_untracked_reconcile(int ordinal)
{
    const gv_devinfo *d;
    gv_region *r = gv_core_region();
    if (!r || ordinal < 0 || ordinal >= GV_MAX_ORDINALS || gv_device(ordinal, &d) != CUDA_SUCCESS)
        return 0;
    int slot = region_self_slot(r);
    if (slot < 0)
        return 0;
    /* A stream-ordered free the stream has reached is pending until a
     * hook sees it: release it first (this reading is the one that follows
     * its release), so that its block widens no range.  Those of other
     * devices it releases are read again after this reading (reread_owed);
     * this device's are read by it, whoever released them. */
    owed = (owed | gv_pending_frees_reap_quietly()) & ~dev_bit(d);
    /* A pool the driver shrank since its charge was last settled (at a
     * synchronisation, say) is charged what NVML no longer shows: settle
     * first, and use no reading taken while one still is (the driver may
     * shrink it meanwhile). */
    gv_pools_refresh();
    pthread_once(&setup_once, setup);
    struct held *h = &held[ordinal];
    pthread_mutex_lock(&h->lock);
    uint64_t begun = gv_charges_begun();
    uint64_t before = region_slot_resident(r, d->region_dev, slot), nvml = 0;
    int busy = gv_ctx_creating() || gv_charges_in_flight();
    int listed = !busy && gv_nvml_self_used(d, &nvml);
    int seen = listed && gv_pools_settled();
    /* After NVML, before the charge: a pending free released meanwhile
     * moved the charge first. */
    uint64_t pending = gv_pending_frees_bytes(d->region_dev);
    uint64_t after = region_slot_resident(r, d->region_dev, slot);
    int used = seen && before == after && !gv_ctx_creating() && !gv_charges_in_flight() &&
               gv_charges_begun() == begun;
    if (used) {
        /* The pending frees are still charged, and NVML shows anything from
         * none to all of them freed: the untracked memory lies between lo
         * and hi.  The charge moves only as far as is certain, up to lo or
         * down to hi, so it never counts a pending block twice (the block's
         * own charge stays until the stream reaches it) nor drops a block's
         * charge before its stream has reached it.  With none pending, lo
         * and hi are the same figure. */
        uint64_t tracked = after > h->charged ? after - h->charged : 0;
        uint64_t lo = nvml > tracked ? nvml - tracked : 0;
        uint64_t hi = nvml + pending > tracked ? nvml + pending - tracked : 0;
        lo -= lo % SLACK;
        hi -= hi % SLACK;
        uint64_t want = h->charged < lo ? lo : h->charged > hi ? hi : h->charged;
        if (want > h->charged) {
            region_charge_held(r, d->region_dev, slot, want - h->charged);
            if (!atomic_exchange(&logged, 1))
                gv_log(GV_LOG_INFO, "device %d: %llu bytes the driver gave this process without an "
                       "allocation call (stack, heap, modules) are charged to the quota",
                       ordinal, (unsigned long long)(want - h->charged));
        } else if (want < h->charged) {
            region_release(r, d->region_dev, slot, h->charged - want);
        }
        if (!h->charged != !want)
            atomic_fetch_add(&holding, want ? 1 : -1);
        h->charged = want;
        /* Below the high end, the charge may be short by pending blocks
         * NVML showed freed: once they are released it is (their charge
         * goes too), so they read again then (gv_untracked_pending_released). */
        int shortish = want < hi;
        if (shortish != atomic_load_explicit(&h->short_by_pending, memory_order_relaxed))
            atomic_fetch_add(&shorted, shortish ? 1 : -1);
        atomic_store_explicit(&h->short_by_pending, shortish, memory_order_relaxed);
    }
    pthread_mutex_unlock(&h->lock);
    /* Outside the lock: with nothing released elsewhere, one load. */
    if (owed && !owing)
        reread_owed();
    return used ? 1 : (!busy && !listed) ? 0 : -1;
}

/* Rounds of reread_owed: a device read again may release frees of one
 * read before it, which is then read again in the next round.  Frees other
 * threads keep queueing could go on forever: past this many rounds, what is
 * left waits for the next reading (a second at most on the allocation
 * paths), as it did before. */
#define REREAD_ROUNDS 4

/* A reading released pending frees of other devices (owed) and read only
 * its own: a device whose charge was left below its range's high end is
 * short by up to their bytes now that their charge is gone, as after any
 * release (gv_untracked_pending_released), so it is read again now.  The
 * readings made here add to owed rather than come back here (owing). */
static void reread_owed(void)
{
    owing = 1;
    for (int round = 0; owed && round < REREAD_ROUNDS; round++) {
        unsigned devs = owed;
        owed = 0;
        if (atomic_load_explicit(&shorted, memory_order_relaxed) == 0)
            break;
        const gv_devinfo *d;
        for (int i = 0; i < GV_MAX_ORDINALS; i++)
            if (gv_device_known(i, &d) && (devs & dev_bit(d)) &&
                atomic_load_explicit(&held[i].short_by_pending, memory_order_relaxed))
                gv_untracked_reconcile(i);
    }
    owed = 0;
    owing = 0;
}

void gv_untracked_reconcile_all(void)
{
    /* Each device is read in turn; what a reading releases of a device read
     * earlier in the loop is read again after it (of one read later, by
     * that device's own reading). */
    int was = owing;
    owing = 1;
    const gv_devinfo *d;
    for (int i = 0; i < GV_MAX_ORDINALS; i++)
        if (gv_device_known(i, &d))
            gv_untracked_reconcile(i);
    owing = was;
    if (owed && !owing)
        reread_owed();
}

void gv_untracked_pending_released(void)
{
    if (atomic_load_explicit(&shorted, memory_order_relaxed) > 0)
        gv_untracked_reconcile_all();
}

void gv_untracked_tick(void)
{
    if (gv_once_a_second(&last_tick))
        gv_untracked_reconcile_all();
}

/* ---- cuCtxSetLimit ------------------------------------------------------ */

typedef CUresult (*set_limit_fn)(CUlimit, size_t);
typedef CUresult (*get_limit_fn)(size_t *, CUlimit);

/* A reading of ordinal that is used, if one can be had: while another
 * charge of this process is in flight (an allocation or a free in the
 * driver) none is, so it is tried again every millisecond, for a second at
 * most.  As gv_untracked_reconcile. */
#define SETLIMIT_TRIES 1000

static int reconcile_in_step(int ordinal)
{
    for (int i = 0;; i++) {
        int got = gv_untracked_reconcile(ordinal);
        if (got >= 0 || i >= SETLIMIT_TRIES)
            return got;
        struct timespec ts = { 0, 1000 * 1000 };
        nanosleep(&ts, NULL);
    }
}

/* The limits whose memory the driver sets aside on the device: the stack,
 * printf FIFO and heap, and the device runtime's (CUDA dynamic
 * parallelism) reserve for synchronisation depth and pending launches.
 * The others (L2 cache, shared memory) take no device memory. */
static int takes_memory(CUlimit which)
{
    return (int)which >= CU_LIMIT_STACK_SIZE &&
           (which <= CU_LIMIT_MALLOC_HEAP_SIZE || which == CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH ||
            which == CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT);
}

GV_EXPORT CUresult cuCtxSetLimit(CUlimit which, size_t value)
{
    set_limit_fn real = GV_REAL(cuCtxSetLimit, set_limit_fn);
    GV_ENFORCING_ELSE_PASS(real(which, value));
    int ordinal;
    size_t old = 0;
    if (!takes_memory(which) || gv_current(&ordinal, NULL) != CUDA_SUCCESS ||
        GV_REAL(cuCtxGetLimit, get_limit_fn)(&old, which) != CUDA_SUCCESS)
        return real(which, value);
    CUresult rc = real(which, value);
    if (rc != CUDA_SUCCESS)
        return rc;
    int got = value != old ? reconcile_in_step(ordinal) : gv_untracked_reconcile(ordinal);
    const gv_devinfo *d;
    gv_region *r = gv_core_region();
    if (gv_device(ordinal, &d) != CUDA_SUCCESS || !r)
        return rc;
    uint64_t limit = region_limit(r, d->region_dev);
    if (limit == GV_UNLIMITED || value <= old)
        return rc;
    /* No reading could be used: what the limit took is not known, and the
     * quota fails closed.  (A skipped reading used to let a heap past the
     * quota while another thread's charge was in flight.) */
    if (got < 0)
        gv_log(GV_LOG_INFO, "cuCtxSetLimit(%d, %zu): the memory it took cannot be measured "
               "while this process's other charges are in flight; the limit is set back to %zu",
               (int)which, value, old);
    else if (region_used(r, d->region_dev) <= limit)
        return rc;
    else
        gv_log(GV_LOG_INFO, "cuCtxSetLimit(%d, %zu) took more device memory than the quota has "
               "left; the limit is set back to %zu", (int)which, value, old);
    real(which, old);
    gv_untracked_reconcile(ordinal);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

const gv_hook gv_hooks_untracked[] = {
    { "cuCtxSetLimit", (void *)cuCtxSetLimit },
    { NULL, NULL }
};
