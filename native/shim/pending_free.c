/*
 * pending_free.c - cuMemFreeAsync of a plain allocation (cuMemAlloc's, not
 * a pool block's): its charge stays until the stream reaches the free.
 *
 * The driver frees such a block only when the work queued before the free
 * is done.  Released at queue time, its charge let the container allocate
 * past its quota while the old block still existed.  So an event is
 * recorded behind the free, and the charge is released by the first hook to
 * see that event complete: an allocation (gv_charge_begin), cuMemGetInfo,
 * cuDeviceTotalMem or NVML's memory query, a reading of untracked memory,
 * the synchronisations that prove it (cuStreamSynchronize,
 * cuCtxSynchronize, cuEventSynchronize, hooked here for that, and to
 * settle the memory pools they may shrink),
 * the queries that answer CUDA_SUCCESS (cuStreamQuery, cuEventQuery,
 * hooked here for that alone), and cuStreamDestroy (hooked here for that
 * alone too: after it a program may make no call at all): never later than
 * the synchronisation, query or destruction that shows the stream got
 * there.  (The driver has no host callback
 * the interposer could use without a thread of its own.)  The free is in
 * flight (charge.c) from before its driver call until its bytes are counted
 * here as pending (gv_pending_frees_bytes); from then until its charge goes
 * back NVML may show the block or not, so a reading of untracked memory
 * takes NVML's figure as a range that wide (untracked.c).  A context's
 * memory is not measured while any free is pending (hooks_context.c).
 *
 * At most MAX_PENDING frees wait at once, in a fixed table of slots, each
 * claimed and handed over by compare-and-swap on its state (no lock).  A
 * free that finds no slot, or whose event cannot be made, waits for its
 * stream instead, then releases its charge.  A context destroyed (or a
 * primary context released for the last time, or reset) takes its blocks
 * and its events with it: its pending frees are taken out of the reapers'
 * reach before the driver call (no event handle of a dead context is ever
 * used) and released after it.  Everything here is process-local: a
 * process killed at any point leaves nothing that others wait on, and its
 * charges go with its region slot.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>

#include "hooks.h"
#include "log.h"
#include "sm.h"

#define MAX_PENDING GV_PENDING_MAX

enum { SLOT_FREE, SLOT_BUSY, SLOT_WAITING, SLOT_HELD };

static struct pending {
    atomic_int state;
    int dev;                    /* region device entry */
    uint64_t bytes;
    CUcontext ctx;              /* the stream's, the event's */
    CUevent ev;
} slots[MAX_PENDING];
static atomic_int waiting;      /* slots not free */
/* Bytes of the pending frees, by region device entry: added before the free
 * lands (its flight ends) and taken off only after its charge went back. */
static _Atomic uint64_t pending_bytes[GV_MAX_DEVICES];
static atomic_int top;          /* slots ever used: [0, top) */
static pthread_once_t once = PTHREAD_ONCE_INIT;

typedef CUresult (*ev_create_fn)(CUevent *, unsigned int);
typedef CUresult (*ev_record_fn)(CUevent, CUstream);
typedef CUresult (*ev_fn)(CUevent);
typedef CUresult (*ctx_fn)(CUcontext);
typedef CUresult (*ctx_out_fn)(CUcontext *);
typedef CUresult (*stream_fn)(CUstream);
typedef CUresult (*void_fn)(void);

static void child_reset(void)
{
    /* A forked child cannot use its parent's CUDA objects, and charges
     * nothing to its parent's slot. */
    for (int i = 0; i < MAX_PENDING; i++)
        atomic_store(&slots[i].state, SLOT_FREE);
    for (int i = 0; i < GV_MAX_DEVICES; i++)
        atomic_store(&pending_bytes[i], 0);
    atomic_store(&waiting, 0);
    atomic_store(&top, 0);
}

static void setup(void) { pthread_atfork(NULL, NULL, child_reset); }

/* An event behind what stream has queued so far, made in ctx (the stream's
 * context); 0, or -1 when it cannot be made. */
static int mark(CUstream stream, int ptsz, CUcontext ctx, CUevent *out)
{
    CUcontext cur = NULL;
    GV_REAL(cuCtxGetCurrent, ctx_out_fn)(&cur);
    int pushed = ctx && ctx != cur;
    if (pushed && GV_REAL(cuCtxPushCurrent_v2, ctx_fn)(ctx) != CUDA_SUCCESS)
        return -1;
    CUevent ev = NULL;
    CUresult rc = GV_REAL(cuEventCreate, ev_create_fn)(&ev, CU_EVENT_DISABLE_TIMING);
    if (rc == CUDA_SUCCESS) {
        rc = ptsz ? GV_REAL(cuEventRecord_ptsz, ev_record_fn)(ev, stream)
                  : GV_REAL(cuEventRecord, ev_record_fn)(ev, stream);
        if (rc != CUDA_SUCCESS)
            GV_REAL(cuEventDestroy_v2, ev_fn)(ev);
    }
    if (pushed) {
        CUcontext popped;
        GV_REAL(cuCtxPopCurrent_v2, ctx_out_fn)(&popped);
    }
    if (rc != CUDA_SUCCESS)
        return -1;
    *out = ev;
    return 0;
}

static void count(int dev, uint64_t bytes, int sign)
{
    if (dev >= 0 && dev < GV_MAX_DEVICES) {
        if (sign > 0)
            atomic_fetch_add(&pending_bytes[dev], bytes);
        else
            atomic_fetch_sub(&pending_bytes[dev], bytes);
    }
}

/* Slot s (held by the caller) is done: its charge goes back, and only then
 * do its bytes leave the pending ones (a reading that saw them gone also
 * sees the charge gone, or a charge that moved while it read). */
static void release(struct pending *s, int destroy_event)
{
    if (destroy_event)
        GV_REAL(cuEventDestroy_v2, ev_fn)(s->ev);
    gv_uncharge(s->dev, s->bytes);
    count(s->dev, s->bytes, -1);
    atomic_fetch_sub(&waiting, 1);
    atomic_store_explicit(&s->state, SLOT_FREE, memory_order_release);
}

static int put(int dev, uint64_t bytes, CUcontext ctx, CUevent ev)
{
    for (int i = 0; i < MAX_PENDING; i++) {
        int expected = SLOT_FREE;
        if (!atomic_compare_exchange_strong(&slots[i].state, &expected, SLOT_BUSY))
            continue;
        slots[i].dev = dev;
        slots[i].bytes = bytes;
        slots[i].ctx = ctx;
        slots[i].ev = ev;
        int t = atomic_load(&top);
        while (t <= i && !atomic_compare_exchange_weak(&top, &t, i + 1))
            ;
        count(dev, bytes, 1);
        atomic_fetch_add(&waiting, 1);
        atomic_store_explicit(&slots[i].state, SLOT_WAITING, memory_order_release);
        return 0;
    }
    return -1;
}

void gv_pending_free(int dev, uint64_t bytes, CUstream stream, int ptsz)
{
    pthread_once(&once, setup);
    int ordinal;
    CUcontext ctx = NULL;
    CUevent ev;
    if (gv_ordinal_of_stream(stream, &ordinal, &ctx) == CUDA_SUCCESS &&
        mark(stream, ptsz, ctx, &ev) == 0) {
        /* Once its bytes count as pending, the free lands: a reading of
         * untracked memory takes them as a range (untracked.c). */
        if (put(dev, bytes, ctx, ev) == 0) {
            gv_charge_landed();
            return;
        }
        gv_pending_frees_reap();
        if (put(dev, bytes, ctx, ev) == 0) {
            gv_charge_landed();
            return;
        }
        GV_REAL(cuEventDestroy_v2, ev_fn)(ev);
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            gv_log(GV_LOG_WARN, "more than %d stream-ordered frees of cuMemAlloc blocks are "
                   "pending; further ones wait for their stream", MAX_PENDING);
    }
    /* No way to tell when the stream gets there: wait until it has. */
    CUstreamCaptureMode mode;
    int relaxed = gv_capture_relax(&mode);
    if (ptsz)
        GV_REAL(cuStreamSynchronize_ptsz, stream_fn)(stream);
    else
        GV_REAL(cuStreamSynchronize, stream_fn)(stream);
    gv_capture_restore(relaxed, mode);
    gv_uncharge(dev, bytes);
    gv_charge_landed();
}

uint64_t gv_pending_frees_bytes(int dev)
{
    if (dev < 0 || dev >= GV_MAX_DEVICES)
        return 0;
    return atomic_load_explicit(&pending_bytes[dev], memory_order_acquire);
}

int gv_pending_frees_waiting(void) { return atomic_load_explicit(&waiting, memory_order_acquire); }

/* Thread-local: a reading of untracked memory reaps first, and what it
 * releases is read by it (and by the readings it makes of the other
 * devices it released frees of, untracked.c), not by a reading nested in
 * it. */
static _Thread_local int reading;

_Static_assert(GV_MAX_DEVICES <= 32, "a mask of region device entries fits an unsigned");

/* Releases the frees the streams have reached; returns how many, and puts
 * the region device entries they were charged to in *devs. */
static int reap(unsigned *devs)
{
    *devs = 0;
    if (atomic_load_explicit(&waiting, memory_order_acquire) == 0)
        return 0;
    int n = atomic_load(&top), released = 0;
    CUstreamCaptureMode mode;
    int relaxed = gv_capture_relax(&mode);
    for (int i = 0; i < n; i++) {
        int expected = SLOT_WAITING;
        if (!atomic_compare_exchange_strong(&slots[i].state, &expected, SLOT_BUSY))
            continue;
        CUresult q = GV_REAL(cuEventQuery, ev_fn)(slots[i].ev);
        if (q == CUDA_ERROR_NOT_READY) {
            atomic_store_explicit(&slots[i].state, SLOT_WAITING, memory_order_release);
            continue;
        }
        /* Reached; or the event answers an error (its context is broken):
         * either way the block is no longer the quota's to hold. */
        int dev = slots[i].dev;
        release(&slots[i], q == CUDA_SUCCESS);
        if (dev >= 0 && dev < GV_MAX_DEVICES)
            *devs |= 1u << dev;
        released++;
    }
    gv_capture_restore(relaxed, mode);
    return released;
}

void gv_pending_frees_reap(void)
{
    unsigned devs;
    if (reap(&devs) && !reading) {
        reading = 1;
        gv_untracked_pending_released();
        reading = 0;
    }
}

unsigned gv_pending_frees_reap_quietly(void)
{
    int was = reading;
    reading = 1;
    unsigned devs;
    reap(&devs);
    reading = was;
    return devs;
}

void gv_pending_frees_hold(CUcontext ctx, gv_pending_set *held)
{
    memset(held, 0, sizeof *held);
    if (!ctx || atomic_load_explicit(&waiting, memory_order_acquire) == 0)
        return;
    int n = atomic_load(&top);
    for (int i = 0; i < n; i++) {
        for (;;) {
            int expected = SLOT_WAITING;
            if (atomic_compare_exchange_strong(&slots[i].state, &expected, SLOT_BUSY)) {
                int ours = slots[i].ctx == ctx;
                atomic_store_explicit(&slots[i].state, ours ? SLOT_HELD : SLOT_WAITING,
                                      memory_order_release);
                if (ours)
                    held->bits[i / 64] |= 1ULL << (i % 64);
                break;
            }
            if (expected != SLOT_BUSY)
                break;          /* free, or another destroyer's */
            sched_yield();      /* a reaper's cuEventQuery, or a free being queued */
        }
    }
}

void gv_pending_frees_unhold(gv_pending_set *held, int gone)
{
    for (int i = 0; i < MAX_PENDING; i++) {
        if (!(held->bits[i / 64] & (1ULL << (i % 64))))
            continue;
        if (gone)
            release(&slots[i], 0);      /* its event went with the context
                                         * (and its destroyer reads again) */
        else
            atomic_store_explicit(&slots[i].state, SLOT_WAITING, memory_order_release);
    }
}

/* ---- synchronisations: they may prove a pending free reached -------- */

/* After a synchronisation: the frees it showed reached go back, and the
 * pools it may have shrunk (the driver gives a pool's reserve above its
 * release threshold back at a synchronisation) are charged their reserve
 * again.  With neither, two atomic loads. */
static void synced(void)
{
    gv_pending_frees_reap();
    gv_pools_refresh();
}

/* A synchronisation hook: the driver's call, then synced().  Before it,
 * the SM gate's open segment of this thread ends (sm_meter.c): its end
 * event goes in behind the work waited for, not after it. */
#define SYNC_HOOK(name, fn_t, params, args)                                    \
    GV_EXPORT CUresult name params                                             \
    {                                                                          \
        gv_sm_syncing();                                                       \
        CUresult rc = GV_REAL(name, fn_t) args;                                \
        synced();                                                              \
        return rc;                                                             \
    }

SYNC_HOOK(cuStreamSynchronize, stream_fn, (CUstream s), (s))
SYNC_HOOK(cuStreamSynchronize_ptsz, stream_fn, (CUstream s), (s))
SYNC_HOOK(cuCtxSynchronize, void_fn, (void), ())
SYNC_HOOK(cuCtxSynchronize_v2, ctx_fn, (CUcontext ctx), (ctx))
SYNC_HOOK(cuEventSynchronize, ev_fn, (CUevent e), (e))

/* ---- queries: an answer of CUDA_SUCCESS proves it as well ----------- */

/* The stream (or the work before the event) is done, so are the frees
 * queued in it: released now, not at the next allocation.  Nothing else is
 * done here (the driver gives pool memory back only at synchronisations);
 * with no free pending, one atomic load. */
static CUresult answered(CUresult rc)
{
    if (rc == CUDA_SUCCESS)
        gv_pending_frees_reap();
    return rc;
}

GV_EXPORT CUresult cuStreamQuery(CUstream s) { return answered(GV_REAL(cuStreamQuery, stream_fn)(s)); }

GV_EXPORT CUresult cuStreamQuery_ptsz(CUstream s)
{
    return answered(GV_REAL(cuStreamQuery_ptsz, stream_fn)(s));
}

GV_EXPORT CUresult cuEventQuery(CUevent e) { return answered(GV_REAL(cuEventQuery, ev_fn)(e)); }

/* ---- a stream destroyed: the frees queued in it may be done --------- */

/* cuStreamDestroy returns at once, and the driver lets the work queued in
 * the stream finish on its own: the frees the stream has reached by now
 * (their events, made apart from the stream, outlive it) are released
 * here, not at the process's next hook call, which may never come, while
 * the other processes of the container read the charge.  Those it has not
 * reached stay charged until a later hook finds them complete.  With no
 * free pending, one atomic load after the driver's answer. */
static CUresult destroyed(CUresult rc)
{
    gv_pending_frees_reap();
    return rc;
}

/* The SM gate's threads remember which context each stream belongs to
 * (sm_meter.c): forgotten before and after, so that a look racing with
 * the destruction is not kept either, and a new stream given the same
 * handle is looked up. */
#define DESTROY_HOOK(name)                                                     \
    GV_EXPORT CUresult name(CUstream s)                                        \
    {                                                                          \
        gv_sm_stream_destroying();                                             \
        CUresult rc = GV_REAL(name, stream_fn)(s);                             \
        gv_sm_stream_destroying();                                             \
        return destroyed(rc);                                                  \
    }

DESTROY_HOOK(cuStreamDestroy_v2)
DESTROY_HOOK(cuStreamDestroy)

const gv_hook gv_hooks_sync[] = {
    { "cuStreamSynchronize", (void *)cuStreamSynchronize },
    { "cuStreamSynchronize_ptsz", (void *)cuStreamSynchronize_ptsz },
    { "cuCtxSynchronize", (void *)cuCtxSynchronize },
    { "cuCtxSynchronize_v2", (void *)cuCtxSynchronize_v2 },
    { "cuEventSynchronize", (void *)cuEventSynchronize },
    { "cuStreamQuery", (void *)cuStreamQuery },
    { "cuStreamQuery_ptsz", (void *)cuStreamQuery_ptsz },
    { "cuEventQuery", (void *)cuEventQuery },
    { "cuStreamDestroy", (void *)cuStreamDestroy },
    { "cuStreamDestroy_v2", (void *)cuStreamDestroy_v2 },
    { NULL, NULL }
};
