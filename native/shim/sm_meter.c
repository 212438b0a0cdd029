/*
 * sm_meter.c - measuring the GPU time of gated launches.
 *
 * A gated launch is bracketed by two events on its stream.  A meter thread
 * (one per process, started with the first gated launch) waits for the end
 * event, reads the elapsed time, teaches the estimate table and settles
 * the difference between what was charged and what the kernel took on the
 * pacing clock (sm_gate.c).  Only real driver APIs are used: events here
 * and, for the policies it has run every 100 ms to set the share the gate
 * enforces (sm_policy.c, on a thread of their own: sm_policy_thread.c),
 * NVML device utilisation.
 */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "sm.h"

#define POLICY_PERIOD_NS (100ULL * 1000 * 1000)
/* A segment of the turn's holder (gv_sm_begin) takes launches only while
 * it holds less than this of estimates: a segment is settled in one lump
 * at its end, and longer ones moved the pacing clock, and so the turns, in
 * lumps (make bench-sm's time-sliced windows 0.2-2.0 points coarser in 14
 * of 18 sides without the bound, alike with it; docs/benchmarks.md). */
#define SEG_TURN_NS 1000000ULL
#define POLL_NS 100000L                     /* events of kernels in flight: every 100 us */
#define IDLE_POLLS 10u                      /* then nothing in flight for 1 ms: */
#define NAP_NS 10000000L                    /* nap, at most 10 ms at a time */

struct rec {
    struct rec *next;
    CUcontext ctx;
    CUstream stream;            /* (with ctx) its launches finish in order */
    CUevent begin, end;
    struct gv_sm *sm;
    int dev;                    /* region device */
    uintptr_t key;
    uint64_t est;
    uint64_t started;           /* when its begin event was first seen done; 0: not yet */
    uint64_t over;              /* run time past est charged while it ran */
    uint64_t stretch;           /* CPU time from the begin event to the launch's
                                 * return, when over STRETCH_NS; else 0 */
    uint32_t share;
    uint32_t n;                 /* launches it measures: 1, or a segment's (est: their sum) */
    uint32_t arb_n;             /* of those, the ones the arbiter counted (gv_sm_admission) */
    int segment;                /* a segment's: its end event recorded later, not after it */
    uint32_t idx;               /* 1 + its place in `pool`; 0: malloc'd */
    _Atomic uint32_t free_next; /* the next on a pool stack (idx; 0: none) */
};

/* A launch whose calls, from recording the begin event to the launch's
 * return, took longer than this on the CPU (its thread was not run, or the
 * driver blocked) may be measured long: on a device that had nothing else
 * to do, the begin event is done when recorded, and the kernel starts only
 * when it is launched, so the events also hold the wait, up to that CPU
 * time.  At a 10 % limit every such millisecond holds the container's
 * next launches back 10 ms.  A driver's launch takes microseconds. */
#define STRETCH_NS (500ULL * 1000)

/* What a launch's events measured (ns), for one whose CPU side stretched:
 * the kernel ran at most `measured` and at least `measured - stretch`;
 * the function's recent average, within those bounds. */
static uint64_t unstretched(uint64_t measured, uint64_t stretch, uint64_t est)
{
    uint64_t lo = measured > stretch ? measured - stretch : 0;
    return est < lo ? lo : est > measured ? measured : est;
}

static _Atomic(struct rec *) inbox;
static atomic_int started;
/* 1 while the meter thread naps with nothing in flight: the next launch
 * wakes it (futex), so its kernel is measured from the first poll on. */
static atomic_int napping;
/* 1: run the policies at the next turn, not only every POLICY_PERIOD_NS
 * (gv_sm_meter_refresh). */
static atomic_int refresh;
/* A context about to be destroyed (gv_sm_ctx_destroying): the meter drops
 * its launches at its next turn, then clears the word and adds 1 to
 * `forgot` (a futex word the destroying thread waits on).  Process-private
 * words, as `napping`: no lock to leave held if the process dies or forks. */
static _Atomic(CUcontext) forget_req;
static atomic_uint forgot;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

typedef CUresult (*ev_create_fn)(CUevent *, unsigned int);
typedef CUresult (*ev_destroy_fn)(CUevent);
typedef CUresult (*ev_record_fn)(CUevent, CUstream);
typedef CUresult (*ev_query_fn)(CUevent);
typedef CUresult (*ev_elapsed_fn)(float *, CUevent, CUevent);
typedef CUresult (*capturing_fn)(CUstream, int *);

static void pool_reset(void);
static void segs_reset(void);
static atomic_uint ctx_gen;     /* contexts and streams destroyed (see launch_device) */

static void fork_child(void)
{
    /* The meter thread does not survive fork; the child starts its own. */
    atomic_store(&inbox, NULL);
    atomic_store(&started, 0);
    atomic_store(&napping, 0);
    atomic_store(&refresh, 0);
    atomic_store(&forget_req, NULL);
    atomic_store(&forgot, 0);
    atomic_fetch_add(&ctx_gen, 1);
    pool_reset();
    segs_reset();
    gv_sm_fork_child();
    gv_cal_reset();
    gv_sm_policy_reset();
    gv_sm_policy_thread_fork();
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, fork_child); }

/* ---- the meter thread ------------------------------------------------------ */

static CUresult elapsed(float *ms, CUevent a, CUevent b)
{
    /* The driver's newest variant, looked up once (the same in a forked
     * child: the same driver). */
    static _Atomic(ev_elapsed_fn) fn;
    ev_elapsed_fn f = atomic_load_explicit(&fn, memory_order_relaxed);
    if (!f) {
        f = gv_real_sym(GV_SYM_cuEventElapsedTime_v2)
                ? GV_REAL(cuEventElapsedTime_v2, ev_elapsed_fn)
                : GV_REAL(cuEventElapsedTime, ev_elapsed_fn);
        atomic_store_explicit(&fn, f, memory_order_relaxed);
    }
    return f(ms, a, b);
}


/* ---- the pool of records and their events ------------------------------------
 *
 * Creating and destroying two events per launch cost more than the rest of
 * the gate (callgrind, make bench: about 1,700 of 5,000 instructions added
 * per launch on the simulated driver).  A record the meter settled keeps
 * its events, which belong to its context, on a stack of spares for that
 * context; the next launch in the context takes them and records them
 * again.  Stacks of entries of a static array, the head a 64-bit word
 * (a tag bumped at every change, the top entry's idx): no lock, and no
 * ABA.  Only the meter thread pushes spares and ties a stack to a context
 * or unties it (a context destroyed: its spares' events destroyed while it
 * lives, gv_sm_ctx_destroying); launch threads only take from them. */
#define POOL_RECS 1024u
#define POOL_CTXS 8u

static struct rec pool[POOL_RECS];
static _Atomic uint32_t pool_used;      /* entries of pool handed out at least once */
static _Atomic uint64_t pool_free;      /* stack: entries without events */
static struct spares {
    _Atomic(CUcontext) ctx;             /* NULL: free (written by the meter only) */
    _Atomic uint64_t head;              /* stack: records with events of ctx */
} spares[POOL_CTXS];

static void stack_push(_Atomic uint64_t *head, struct rec *r)
{
    uint64_t h = atomic_load_explicit(head, memory_order_relaxed), n;
    do {
        atomic_store_explicit(&r->free_next, (uint32_t)h, memory_order_relaxed);
        n = (((h >> 32) + 1) << 32) | r->idx;
    } while (!atomic_compare_exchange_weak_explicit(head, &h, n, memory_order_release,
                                                    memory_order_relaxed));
}

static struct rec *stack_pop(_Atomic uint64_t *head)
{
    uint64_t h = atomic_load_explicit(head, memory_order_acquire);
    for (;;) {
        uint32_t i = (uint32_t)h;
        if (i == 0 || i > POOL_RECS)
            return NULL;
        uint32_t next = atomic_load_explicit(&pool[i - 1].free_next, memory_order_relaxed);
        uint64_t n = (((h >> 32) + 1) << 32) | next;
        if (atomic_compare_exchange_weak_explicit(head, &h, n, memory_order_acquire,
                                                  memory_order_acquire))
            return &pool[i - 1];
    }
}

/* Every entry of a stack (now empty), as a list through free_next. */
static struct rec *stack_take_all(_Atomic uint64_t *head)
{
    uint64_t h = atomic_load_explicit(head, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(head, &h, ((h >> 32) + 1) << 32,
                                                  memory_order_acquire, memory_order_relaxed))
        ;
    uint32_t i = (uint32_t)h;
    return i && i <= POOL_RECS ? &pool[i - 1] : NULL;
}

static struct rec *stack_next(struct rec *r)
{
    uint32_t i = atomic_load_explicit(&r->free_next, memory_order_relaxed);
    return i && i <= POOL_RECS ? &pool[i - 1] : NULL;
}

/* A record for a launch: an entry of the pool without events, or one of
 * the heap (idx 0); NULL when out of memory. */
static struct rec *rec_new(void)
{
    struct rec *r = stack_pop(&pool_free);
    if (r)
        return r;
    if (atomic_load_explicit(&pool_used, memory_order_relaxed) < POOL_RECS) {
        uint32_t i = atomic_fetch_add_explicit(&pool_used, 1, memory_order_relaxed);
        if (i < POOL_RECS) {
            pool[i].idx = i + 1;
            return &pool[i];
        }
    }
    r = calloc(1, sizeof *r);
    return r;
}

static void rec_free(struct rec *r)
{
    if (r->idx)
        stack_push(&pool_free, r);
    else
        free(r);
}

/* A spare record with events of ctx (made in it), or NULL.  The head is
 * read before the context the stack is tied to, at every try: a stack is
 * emptied (its head changes) before it is untied and tied to another
 * context, so a pop that succeeds took from ctx's own stack. */
static struct rec *spare_take(CUcontext ctx)
{
    for (unsigned k = 0; k < POOL_CTXS; k++) {
        for (;;) {
            uint64_t h = atomic_load_explicit(&spares[k].head, memory_order_acquire);
            if (atomic_load_explicit(&spares[k].ctx, memory_order_acquire) != ctx)
                break;
            uint32_t i = (uint32_t)h;
            if (i == 0 || i > POOL_RECS)
                return NULL;
            uint32_t next = atomic_load_explicit(&pool[i - 1].free_next, memory_order_relaxed);
            uint64_t n = (((h >> 32) + 1) << 32) | next;
            if (atomic_compare_exchange_strong_explicit(&spares[k].head, &h, n,
                                                        memory_order_acquire,
                                                        memory_order_relaxed))
                return &pool[i - 1];
        }
    }
    return NULL;
}

static void destroy_events(struct rec *r)
{
    ev_destroy_fn destroy = GV_REAL(cuEventDestroy_v2, ev_destroy_fn);
    if (r->begin)
        destroy(r->begin);
    if (r->end)
        destroy(r->end);
    r->begin = r->end = NULL;
}

/* The meter is done with r: its events kept as a spare of its context
 * (the meter thread only), or destroyed with it. */
static void recycle(struct rec *r, int keep)
{
    struct spares *free_slot = NULL;
    for (unsigned k = 0; keep && r->idx && k < POOL_CTXS; k++) {
        CUcontext c = atomic_load_explicit(&spares[k].ctx, memory_order_relaxed);
        if (c == r->ctx) {
            stack_push(&spares[k].head, r);
            return;
        }
        if (!c && !free_slot)
            free_slot = &spares[k];
    }
    if (keep && r->idx && free_slot) {
        atomic_store_explicit(&free_slot->ctx, r->ctx, memory_order_release);
        stack_push(&free_slot->head, r);
        return;
    }
    destroy_events(r);
    rec_free(r);
}

/* ctx is about to be destroyed: its spares' events with it (the meter
 * thread only). */
static void spares_forget(CUcontext ctx)
{
    for (unsigned k = 0; k < POOL_CTXS; k++) {
        if (atomic_load_explicit(&spares[k].ctx, memory_order_relaxed) != ctx)
            continue;
        for (struct rec *r = stack_take_all(&spares[k].head), *next; r; r = next) {
            next = stack_next(r);
            destroy_events(r);
            rec_free(r);
        }
        atomic_store_explicit(&spares[k].ctx, NULL, memory_order_release);
    }
}

static void drop(struct rec *r)
{
    recycle(r, 0);
}

/* ---- segments: launches back to back on one stream, measured together ------
 *
 * A pair of events per launch costs more than the rest of the gate (two
 * records, an elapsed time and a settling: about 2,100 of 3,000
 * instructions added per launch on the simulated driver).  A thread that
 * launches on one stream back to back (the time since its last gated
 * launch returned no longer than that launch took inside the hook, or the
 * stream still busy with the work admitted so far, by the estimates)
 * opens a segment instead: the begin event is recorded before the launch
 * as usual, the end event is not; the launches that follow on the stream
 * join it with no event of their own, each charged its estimate at
 * admission as before; the segment ends (its end event recorded on the
 * stream, then handed to the meter, which settles the sum of the charges
 * against the measured time at once) when
 *   - a launch of the thread does not join it: another stream, a wait at
 *     the gate, a share changed, SEG_MAX launches;
 *   - the thread's admission is about to wait (its launches in flight are
 *     settled only once their segment ends; the stream is about to stand
 *     idle), or the thread to synchronise (gv_sm_syncing: the end event
 *     goes in behind the work waited for);
 *   - the meter finds no launch in it for SEG_IDLE_NS at two polls;
 *   - a context or a stream is about to be destroyed, or a stream capture
 *     to begin (every segment ends: no event is recorded later into a
 *     destroyed or capturing stream).
 * Only while no other process is seen working on the device (others'
 * kernels queued between the launches would be measured in the segment:
 * sm_gate.c's `alone`), the turn between containers is not in play, no
 * capture is in progress, and not on a per-thread default stream (the
 * meter could not end it there).  Another thread launching on the stream
 * meanwhile (a tag per stream says who launched last) ends the thread's
 * segment at its next launch.  A segment holds, besides its kernels, the
 * time the stream stood idle between its launches or before its end event
 * (the launch loop's own time, the meter's delay at its end, a launching
 * thread that was not run), as a pair of events holds a launch call's own
 * time on an idle stream; so segments teach the estimate table nothing:
 * the estimates would grow, predict streams busy longer, and segments
 * would hold more idle time. */
#define SEGS 16u
#define SEG_MAX 256u                    /* launches in one segment */
/* The meter ends a segment that saw no launch for SEG_IDLE_NS at two of
 * its polls in a row (100 us apart): a launching thread that was not run
 * between two launches (the meter ran instead, on a busy CPU) does not
 * lose its segment at the first look. */
#define SEG_IDLE_NS 50000ULL
/* A thread whose launches were in a segment until a pause shorter than
 * this (the thread not run: it is no reason to measure the next launch
 * on its own) opens the next one with its next launch. */
#define SEG_RESUME_NS (10ULL * 1000 * 1000)
#define STREAM_TAGS 64u

struct seg {
    atomic_int lock;                    /* 1: held (briefly: no driver call but a record) */
    _Atomic uint64_t owner;             /* the thread that opens segments in it; 0: free */
    _Atomic(struct rec *) open;         /* the open segment; NULL: none */
    _Atomic uint64_t last;              /* when its last launch returned (gv_mono_ns) */
    _Atomic uint64_t seq;               /* segments opened in it */
    atomic_int joining;                 /* launches joining it in the driver's call now */
    uint64_t idle_seen;                 /* `last` when the meter last found it idle (meter only) */
    unsigned gen;                       /* ctx_gen when it was opened */
};
static struct seg segs[SEGS];
static atomic_int segs_open;
/* Per stream (hashed with its context): the thread that launched on it
 * last, gated. */
static _Atomic uint64_t stream_tag[STREAM_TAGS];

/* What each launching thread keeps (one thread-local object: each one
 * costs a call to find on every launch): its last looks at a context's
 * device and a stream's context (see launch_device), and its segments. */
static _Thread_local struct mine {
    struct {
        CUcontext ctx;
        unsigned gen;
        const gv_devinfo *d;
    } dev;
    struct {
        CUstream stream;
        CUcontext ctx;
        unsigned gen;
        const gv_devinfo *d;
    } stream;
    struct {
        struct seg *s;                  /* its slot in segs (owner: this thread) */
        uint64_t entry, exit;           /* its last gated launch: first look, return (0: waited) */
        uint64_t in_seg;                /* when its last launch in a segment returned; 0: none */
        uint64_t busy_until;            /* its stream's work admitted so far, by the estimates */
        CUstream stream;
        CUcontext ctx;
    } seg;
} t_;
#define t_seg (t_.seg)

/* The address of its object names the thread. */
static uint64_t thread_token(void)
{
    return (uint64_t)(uintptr_t)&t_;
}

static _Atomic uint64_t *tag_of(CUcontext ctx, CUstream stream)
{
    uint64_t h = ((uint64_t)(uintptr_t)stream ^ ((uint64_t)(uintptr_t)ctx >> 4)) *
                 0x9e3779b97f4a7c15ULL;
    return &stream_tag[h >> 58];
}

static void seg_lock(struct seg *g)
{
    for (;;) {
        int free_ = 0;
        if (atomic_compare_exchange_weak(&g->lock, &free_, 1))
            return;
        sched_yield();
    }
}

static int seg_trylock(struct seg *g)
{
    int free_ = 0;
    return atomic_compare_exchange_strong(&g->lock, &free_, 1);
}

static void seg_unlock(struct seg *g)
{
    atomic_store_explicit(&g->lock, 0, memory_order_release);
}

static void post(struct rec *r);
static void unmeasured(void);
static void wake(void);

/* End g's open segment (g locked; its context current): the end event
 * recorded now on its stream, the record handed to the meter. */
static void seg_end_locked(struct seg *g)
{
    struct rec *r = atomic_load(&g->open);
    if (!r)
        return;
    atomic_store(&g->open, NULL);
    atomic_fetch_sub(&segs_open, 1);
    if (GV_REAL(cuEventRecord, ev_record_fn)(r->end, r->stream) != CUDA_SUCCESS) {
        unmeasured();
        gv_sm_settle_n(r->sm, r->dev, r->share, r->est, r->est, r->n, r->arb_n);
        drop(r);
        return;
    }
    post(r);
}

/* The same from a thread other than the meter: the segment's context
 * pushed for the record if it is not current. */
static void seg_end_here(struct seg *g)
{
    struct rec *r = atomic_load(&g->open);
    if (!r)
        return;
    CUcontext cur = NULL;
    GV_REAL(cuCtxGetCurrent, CUresult (*)(CUcontext *))(&cur);
    int pushed = r->ctx != cur &&
                 GV_REAL(cuCtxPushCurrent_v2, CUresult (*)(CUcontext))(r->ctx) == CUDA_SUCCESS;
    seg_end_locked(g);
    if (pushed) {
        CUcontext popped;
        GV_REAL(cuCtxPopCurrent_v2, CUresult (*)(CUcontext *))(&popped);
    }
}

void gv_sm_segments_end(void)
{
    /* Every slot locked in turn, open or not: a launch that found no
     * capture in progress and is opening a segment holds its slot's lock
     * until the segment is open (and looks at the capture count again
     * under it), so it is ended here. */
    for (unsigned k = 0; k < SEGS; k++) {
        seg_lock(&segs[k]);
        seg_end_here(&segs[k]);
        seg_unlock(&segs[k]);
    }
}

void gv_sm_syncing(void)
{
    if (!atomic_load_explicit(&segs_open, memory_order_relaxed))
        return;     /* none open anywhere (and no limit: nothing more) */
    struct seg *g = t_seg.s;
    if (g && atomic_load_explicit(&g->open, memory_order_relaxed)) {
        seg_lock(g);
        seg_end_here(g);
        seg_unlock(g);
    }
}

/* The admission is about to wait: the thread's open segment ends first. */
static void seg_waiting(void)
{
    struct seg *g = t_seg.s;
    if (g && atomic_load(&g->open)) {
        seg_lock(g);
        seg_end_here(g);
        seg_unlock(g);
    }
}

/* A slot for this thread's segments, or NULL (all taken): a free one, or
 * one with no segment open and no launch for SEG_STALE_NS (its thread may
 * be gone, or launch no more). */
#define SEG_STALE_NS (1000ULL * 1000 * 1000)
static struct seg *seg_claim(uint64_t tok, uint64_t now)
{
    for (unsigned k = 0; k < SEGS; k++) {
        struct seg *g = &segs[k];
        uint64_t was = atomic_load_explicit(&g->owner, memory_order_relaxed);
        if (was && (atomic_load(&g->open) || atomic_load(&g->last) + SEG_STALE_NS > now))
            continue;
        if (atomic_compare_exchange_strong(&g->owner, &was, tok)) {
            atomic_store(&g->last, now);
            return t_seg.s = g;
        }
    }
    return NULL;
}

/* The meter: end the segments that saw no launch for SEG_IDLE_NS, and
 * free their slots (their thread may be gone; it claims one again). */
static void segs_idle(uint64_t now, CUcontext *current);

/* A forked child: the parent's segments and their events are not its own. */
static void segs_reset(void)
{
    for (unsigned k = 0; k < SEGS; k++) {
        atomic_store(&segs[k].lock, 0);
        atomic_store(&segs[k].owner, 0);
        atomic_store(&segs[k].open, NULL);
        atomic_store(&segs[k].last, 0);
    }
    atomic_store(&segs_open, 0);
    for (unsigned k = 0; k < STREAM_TAGS; k++)
        atomic_store(&stream_tag[k], 0);
}

/* A forked child: the parent's records and events are not its own (CUDA
 * is not usable across fork), and no other thread of the child holds an
 * entry: all of them are free again, their events forgotten. */
static void pool_reset(void)
{
    atomic_store(&pool_used, 0);
    atomic_store(&pool_free, 0);
    for (unsigned k = 0; k < POOL_CTXS; k++) {
        atomic_store(&spares[k].ctx, NULL);
        atomic_store(&spares[k].head, 0);
    }
}

/* r has not finished.  Once its begin event is done (its stream reached
 * it: the kernel runs), the time it runs past its estimate is charged as
 * it goes, every poll, instead of all at once when it ends.  The clock is
 * what the container's other processes and the other containers' launch
 * order (sm_arbiter.c) read: a kernel that turns out long must count from
 * the moment it is longer than charged, or a 600 ms kernel under a 50 %
 * limit let a mate process launch as if it had taken 1 ms, and in a full
 * pair its container looked behind and was let go first again.  The
 * charge is settled against the measured time at the end as before.
 * make bench-sm workload, 8 s runs, seeds 1-6, one sitting, window sd
 * without -> with: 50:50 A 2.24 -> 1.79, B 2.18 -> 1.89 (every seed
 * narrower); 50 % x 3 processes 1.47 -> 0.96. */
static void running(struct rec *r)
{
    uint64_t now = gv_mono_ns();
    if (!r->started) {
        if (GV_REAL(cuEventQuery, ev_query_fn)(r->begin) == CUDA_SUCCESS)
            r->started = now;
        return;
    }
    uint64_t ran = now - r->started, charged = r->est + r->over;
    if (ran > charged) {
        r->over += ran - charged;
        gv_sm_overrun(r->sm, r->dev, r->share, ran - charged);
    }
}

/* Settle r if its kernel has finished; 0 if it is still running.  With
 * `force` (its context is about to be destroyed), settled anyway: one
 * still running keeps what it was charged so far. */
static void make_current(CUcontext ctx, CUcontext *current)
{
    if (*current != ctx) {
        GV_REAL(cuCtxSetCurrent, CUresult (*)(CUcontext))(ctx);
        *current = ctx;
    }
}

/* known: what querying r's end event would answer, when known already;
 * else 0 (CUDA_SUCCESS is known too: pass it as QUERY_DONE). */
#define QUERY_ASK 0
#define QUERY_DONE 1
#define QUERY_NOT_READY 2

static int try_settle_known(struct rec *r, CUcontext *current, int force, int known)
{
    make_current(r->ctx, current);
    CUresult q = known == QUERY_DONE        ? CUDA_SUCCESS
                 : known == QUERY_NOT_READY ? CUDA_ERROR_NOT_READY
                                            : GV_REAL(cuEventQuery, ev_query_fn)(r->end);
    if (q == CUDA_ERROR_NOT_READY) {
        running(r);
        if (!force)
            return 0;
    }
    float ms = 0;
    if (q == CUDA_SUCCESS && elapsed(&ms, r->begin, r->end) == CUDA_SUCCESS && ms >= 0) {
        uint64_t raw = (uint64_t)((double)ms * 1e6);
        if (r->stretch)
            raw = unstretched(raw, r->stretch, r->est);
        uint64_t at = gv_mono_ns();
        gv_cal_record(r->dev, at, raw);
        /* Under the turn the events hold this process's kernels only
         * (sm_arbiter.c): NVML's noisy per-process samples would only
         * charge it less than it ran. */
        uint64_t ns = gv_arb_exclusive(r->dev, at) ? raw : gv_cal_scale(r->dev, raw);
        /* A stretched one taught nothing new, nor does a segment (it may
         * hold idle time between its launches, or after its last one: the
         * estimates would grow, predict the stream busy longer, and make
         * segments hold more idle time). */
        if (!r->stretch && !r->segment)
            gv_sm_learn(r->key, ns);
        gv_sm_settle_n(r->sm, r->dev, r->share, r->est + r->over, ns, r->n, r->arb_n);
    } else {
        uint64_t kept = r->est + r->over;   /* unknown: keep what was charged */
        gv_sm_settle_n(r->sm, r->dev, r->share, kept, kept, r->n, r->arb_n);
    }
    recycle(r, !force);
    return 1;
}

static int try_settle(struct rec *r, CUcontext *current, int force)
{
    return try_settle_known(r, current, force, QUERY_ASK);
}

static void segs_idle(uint64_t now, CUcontext *current)
{
    for (unsigned k = 0; k < SEGS; k++) {
        struct seg *g = &segs[k];
        if (!atomic_load_explicit(&g->open, memory_order_relaxed) ||
            atomic_load(&g->last) + SEG_IDLE_NS > now || !seg_trylock(g))
            continue;
        struct rec *r = atomic_load(&g->open);
        uint64_t last = atomic_load(&g->last);
        if (r && last + SEG_IDLE_NS <= now && !atomic_load(&g->joining)) {
            if (g->idle_seen == last) {
                make_current(r->ctx, current);
                seg_end_locked(g);
                atomic_store(&g->owner, 0);
            }
            g->idle_seen = last;
        }
        seg_unlock(g);
    }
}

/* ctx is about to be destroyed, and its events with it (a real driver
 * destroys them; their handles are reused for the program's next events):
 * settle and drop every launch made in it while ctx still lives, and make
 * it no longer this thread's current context. */
static void forget(CUcontext ctx, struct rec **head, CUcontext *current)
{
    for (struct rec **pp = head; *pp;) {
        struct rec *r = *pp;
        if (r->ctx != ctx) {
            pp = &r->next;
            continue;
        }
        *pp = r->next;
        try_settle(r, current, 1);      /* frees r */
    }
    spares_forget(ctx);
    if (*current == ctx) {
        GV_REAL(cuCtxSetCurrent, CUresult (*)(CUcontext))(NULL);
        *current = NULL;
    }
}

/* Nothing in flight for 1 ms: sleep until the next launch is posted (it
 * wakes the futex) or for at most NAP_NS, which bounds how late a policy
 * update can be.  Sleeping 1 ms instead, as before, left a kernel launched
 * during the sleep unsettled for up to 1 ms, holding its process at the
 * in-flight bound while the device drained.  make bench-sm workload, 7 s
 * runs, seeds 1-4, two sittings, window standard deviation before ->
 * after: 90 % x 2 processes 1.15-1.3 -> 1.0-1.1, 75 % x 4 1.5-1.55 ->
 * 1.2-1.35, 50 % x 3 1.8 -> 1.4-1.55; pairs within the noise.  While
 * nothing in the region gates launches (a limit lifted, a yield over),
 * there is no share to set: sleep until the next gated launch, instead of
 * reading NVML every 100 ms for as long as the process lives.  A
 * process-private futex word: no lock to leave held if the process dies
 * or forks. */
static void nap(void)
{
    atomic_store(&napping, 1);
    if (!atomic_load(&inbox) && !atomic_load(&refresh) && !atomic_load(&forget_req) &&
        !atomic_load(&segs_open)) {
        struct timespec ts = { 0, NAP_NS };
        syscall(SYS_futex, &napping, FUTEX_WAIT_PRIVATE, 1, gv_sm_gating() ? &ts : NULL, NULL, 0);
    }
    atomic_store(&napping, 0);
}

static void *meter(void *unused)
{
    (void)unused;
    /* This thread queries events, a "potentially unsafe" call that CUDA
     * forbids to a thread in the default (GLOBAL) capture interaction mode
     * while another thread captures a graph in GLOBAL mode, as
     * torch.cuda.graph does: the query fails and invalidates that capture.
     * In THREAD_LOCAL mode only this thread's own captures (none) concern
     * it, as for PyTorch's NCCL watchdog (pytorch/pytorch#148594). */
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    GV_REAL(cuThreadExchangeStreamCaptureMode, CUresult (*)(CUstreamCaptureMode *))(&mode);
    struct rec *head = NULL, **tail = &head;
    CUcontext current = NULL;
    uint64_t next_policy = 0;
    unsigned idle = 0;
    for (;;) {
        /* Read before the inbox: every launch posted before the request
         * was is in it. */
        CUcontext gone = atomic_load(&forget_req);
        /* Segments idle for SEG_IDLE_NS ended: handed to the inbox. */
        if (atomic_load(&segs_open))
            segs_idle(gv_mono_ns(), &current);
        struct rec *got = atomic_exchange(&inbox, NULL);
        if (got || head || atomic_load(&segs_open))
            idle = 0;
        struct rec *rev = NULL;
        while (got) {                       /* the inbox is LIFO: restore order */
            struct rec *n = got->next;
            got->next = rev;
            rev = got;
            got = n;
        }
        for (; rev; rev = rev->next) {
            *tail = rev;
            tail = &rev->next;
        }
        *tail = NULL;
        if (gone) {
            forget(gone, &head, &current);
            /* (Not cleared if the destroying thread gave up waiting and
             * another context was posted since.) */
            CUcontext expected = gone;
            atomic_compare_exchange_strong(&forget_req, &expected, NULL);
            atomic_fetch_add(&forgot, 1);
            syscall(SYS_futex, &forgot, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        }
        /* Alive on every device with kernels in flight: a slot not renewed
         * stops counting them after 20 ms (sm_arbiter.c). */
        if (head) {
            uint64_t seen = 0, now = gv_mono_ns();
            for (struct rec *r = head; r; r = r->next) {
                if (r->dev >= 0 && r->dev < GV_MAX_DEVICES && !(seen & (1ULL << r->dev))) {
                    seen |= 1ULL << r->dev;
                    gv_arb_alive(r->dev, now);
                }
            }
        }
        /* Every finished launch, not only those before the first
         * unfinished one: a long kernel on one device, or stream, must not
         * hold the settling of those that ended elsewhere (a 20 s kernel on
         * another GPU held launches here for its whole length). */
        /* Launches on one stream finish in order: the newest one posted
         * on each stream is asked first, and where it is done, so are all
         * before it, settled without asking each (a launcher that ran
         * ahead of the meter posted several). */
        struct { CUcontext ctx; CUstream stream; struct rec *last; int known; } strm[16];
        unsigned nstrm = 0;
        for (struct rec *r = head; r; r = r->next) {
            unsigned b = 0;
            while (b < nstrm && (strm[b].ctx != r->ctx || strm[b].stream != r->stream))
                b++;
            if (b == nstrm) {
                if (nstrm == 16)
                    continue;
                strm[nstrm].ctx = r->ctx;
                strm[nstrm++].stream = r->stream;
            }
            strm[b].last = r;
        }
        for (unsigned b = 0; b < nstrm; b++) {
            make_current(strm[b].ctx, &current);
            CUresult q = GV_REAL(cuEventQuery, ev_query_fn)(strm[b].last->end);
            strm[b].known = q == CUDA_SUCCESS          ? QUERY_DONE
                            : q == CUDA_ERROR_NOT_READY ? QUERY_NOT_READY
                                                        : QUERY_ASK;
        }
        struct rec **pp = &head;
        struct { CUcontext ctx; CUstream stream; } busy[16];
        unsigned nbusy = 0;
        while (*pp) {
            struct rec *r = *pp, *next = r->next;
            unsigned b = 0;     /* a stream found running: what follows waits */
            while (b < nbusy && (busy[b].ctx != r->ctx || busy[b].stream != r->stream))
                b++;
            int known = QUERY_ASK;     /* the stream's newest not done: ask the older */
            for (unsigned k = 0; k < nstrm; k++)
                if (strm[k].ctx == r->ctx && strm[k].stream == r->stream &&
                    (strm[k].known == QUERY_DONE || strm[k].last == r))
                    known = strm[k].known;
            if (b == nbusy && try_settle_known(r, &current, 0, known)) {    /* frees r */
                *pp = next;
                continue;
            }
            if (b == nbusy && nbusy < 16) {
                busy[nbusy].ctx = r->ctx;
                busy[nbusy++].stream = r->stream;
            }
            pp = &r->next;
        }
        tail = pp;
        uint64_t now = gv_mono_ns();
        if (now >= next_policy || atomic_exchange(&refresh, 0)) {
            gv_sm_policy_due();     /* run on its own thread: NVML can be slow */
            next_policy = now + POLICY_PERIOD_NS;
        }
        /* Polling on for 1 ms after the last launch: a process launching
         * back to back does not make a futex call per launch. */
        if (idle++ < IDLE_POLLS) {
            struct timespec ts = { 0, POLL_NS };
            nanosleep(&ts, NULL);
        } else {
            nap();
        }
    }
    return NULL;
}

/* Launches posted with no meter thread to measure them (it could not be
 * started): settled at what they were charged, as unmeasured launches
 * are, or they stayed in flight for good, and the gate's in-flight bound
 * held the process's launches longer and longer (200 launches of 100 us
 * at 50 % took 18 s), then for good at MAX_INFLIGHT_LAUNCHES. */
static void settle_unmetered(void)
{
    for (struct rec *r = atomic_exchange(&inbox, NULL), *next; r; r = next) {
        next = r->next;
        gv_sm_settle_n(r->sm, r->dev, r->share, r->est, r->est, r->n, r->arb_n);
        drop(r);
    }
}

static void start_meter(void)
{
    if (atomic_load(&started))
        return;
    /* The fork handler first: a child forked just after `started` is set
     * must still reset it, or its launches would wait for a meter that
     * does not run there. */
    pthread_once(&atfork_once, register_atfork);
    int expected = 0;
    if (!atomic_compare_exchange_strong(&started, &expected, 1))
        return;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);   /* signals go to the program's threads */
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    if (pthread_create(&t, &a, meter, NULL) != 0) {
        /* Tried again at the next gated launch (threads may be free then);
         * said once. */
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            gv_log(GV_LOG_ERROR, "cannot start the SM meter thread; launches are paced on "
                                 "estimates until it starts");
        atomic_store(&started, 0);
        settle_unmetered();     /* what another thread posted meanwhile */
    }
    pthread_attr_destroy(&a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* ---- the launch side ---------------------------------------------------------- */

/* Wake the meter thread if it naps. */
static void wake(void)
{
    if (atomic_load(&napping) && atomic_exchange(&napping, 0))
        syscall(SYS_futex, &napping, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

int gv_sm_meter_refresh(void)
{
    if (!atomic_load(&started))
        return 0;
    if (!atomic_exchange(&refresh, 1))
        wake();
    return 1;
}

/* A gated launch could not be measured: charged its estimate (said once). */
static void unmeasured(void)
{
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gv_log(GV_LOG_WARN, "a launch could not be timed with events; it is charged the "
                            "recent average of its kernel");
}

/* The device of a context never changes while it lives, nor the context
 * of a stream: each thread keeps its last look at both (a stream's context
 * and device, and the current context's device: four driver calls, about
 * 750 instructions on the simulated driver), valid while no context or
 * stream has been destroyed since (ctx_gen, bumped by gv_sm_ctx_destroying
 * before a context goes, around every stream's destruction, and in a
 * forked child), so a handle reused by a new context or stream is looked
 * up again. */
/* (t_dev and t_stream: in the thread's object, above.) */

static CUresult device_of(struct mine *t, CUcontext ctx, unsigned gen, const gv_devinfo **d)
{
    if (t->dev.ctx == ctx && t->dev.gen == gen) {
        *d = t->dev.d;
        return CUDA_SUCCESS;
    }
    /* A forked child forgets what its parent's threads looked up: the
     * handler that bumps ctx_gen there is registered before the first. */
    pthread_once(&atfork_once, register_atfork);
    int ordinal;
    CUresult rc = gv_ordinal_of_ctx(ctx, &ordinal);
    if (rc == CUDA_SUCCESS)
        rc = gv_device(ordinal, d);
    if (rc == CUDA_SUCCESS) {
        t->dev.ctx = ctx;
        t->dev.gen = gen;
        t->dev.d = *d;
    }
    return rc;
}

/* The current context (asked once per launch, when needed). */
static CUcontext current_ctx(CUcontext *cur, int *have)
{
    if (!*have) {
        *cur = NULL;
        GV_REAL(cuCtxGetCurrent, CUresult (*)(CUcontext *))(cur);
        *have = 1;
    }
    return *cur;
}

/* The context and device of a launch on stream (the current context's
 * for a default stream). */
static int launch_device(struct mine *t, CUstream stream, CUcontext *cur, int *have,
                         CUcontext *ctx, const gv_devinfo **d)
{
    unsigned gen = atomic_load_explicit(&ctx_gen, memory_order_acquire);
    if (stream == NULL || stream == GV_CU_STREAM_LEGACY || stream == GV_CU_STREAM_PER_THREAD) {
        *ctx = current_ctx(cur, have);  /* the current context's default stream */
        return *ctx && device_of(t, *ctx, gen, d) == CUDA_SUCCESS;
    }
    if (t->stream.stream == stream && t->stream.gen == gen) {
        *ctx = t->stream.ctx;
        *d = t->stream.d;
        return 1;
    }
    CUcontext c = NULL;
    if (GV_REAL(cuStreamGetCtx, CUresult (*)(CUstream, CUcontext *))(stream, &c) !=
            CUDA_SUCCESS ||
        !c || device_of(t, c, gen, d) != CUDA_SUCCESS)
        return 0;
    *ctx = c;
    t->stream.stream = stream;
    t->stream.ctx = c;
    t->stream.gen = gen;
    t->stream.d = *d;
    return 1;
}

void gv_sm_stream_destroying(void)
{
    atomic_fetch_add(&ctx_gen, 1);
    gv_sm_segments_end();
}

/* A gated launch that the meter will not read: the events it has are
 * destroyed, and the spare record it took goes back without them. */
static void drop_events(gv_sm_launch *l)
{
    if (l->begin)
        GV_REAL(cuEventDestroy_v2, ev_destroy_fn)(l->begin);
    if (l->end)
        GV_REAL(cuEventDestroy_v2, ev_destroy_fn)(l->end);
    if (l->rec) {
        struct rec *spare = l->rec;
        spare->begin = spare->end = NULL;
        rec_free(spare);
    }
}

int gv_sm_begin(gv_sm_launch *l, CUstream stream, int ptsz, uintptr_t key)
{
    memset(l, 0, sizeof *l);
    CUcontext ctx = NULL, cur = NULL;
    int have_cur = 0;
    const gv_devinfo *d;
    struct mine *t = &t_;
    /* Found once: the compiler would find it again at each use (a call
     * each, under -fPIC). */
    __asm__("" : "+r"(t));
    l->mine = t;    /* for gv_sm_end: not found again there */
    if (!launch_device(t, stream, &cur, &have_cur, &ctx, &d))
        return 0;
    struct gv_sm *sm = region_sm(gv_core_region(), d->region_dev);
    if (!sm || !region_sm_gates(sm))
        return 0;   /* no limit, and not asked to yield */
    if (atomic_load_explicit(&sm->limit, memory_order_relaxed) == 0) {
        /* Gated only by its yield flag: once the lease has ended without
         * being cleared (its setter died or hung), clear it, so that this
         * and the container's other processes go back to the fast path. */
        uint64_t until = atomic_load(&sm->yield_until);
        if (until != 0 && !region_sm_yielding(sm, gv_mono_ns())) {
            region_sm_end_yield(gv_core_region(), d->region_dev, until);
            if (!region_sm_gates(sm))
                return 0;
        }
    }
    /* Recorded into a graph, not run: nothing to pace.  The driver is
     * asked only while this process has a capture in progress. */
    int capturing = 0;
    if (atomic_load_explicit(&gv_sm_captures, memory_order_relaxed)) {
        if (ptsz)
            GV_REAL(cuStreamIsCapturing_ptsz, capturing_fn)(stream, &capturing);
        else
            GV_REAL(cuStreamIsCapturing, capturing_fn)(stream, &capturing);
    }
    if (capturing)
        return 0;
    gv_sm_watch(d, sm);
    start_meter();
    l->gated = 1;
    l->sm = sm;
    l->dev = d->region_dev;
    l->ctx = ctx;
    l->stream = stream;
    l->ptsz = ptsz;
    l->key = key;
    l->est = gv_sm_estimate(key);
    /* Likely to join its open segment on this stream (decided below). */
    struct seg *g0 = t->seg.s;
    struct gv_sm_admission adm = {
        .waiting = seg_waiting,
        .joins = g0 && t->seg.stream == stream && t->seg.ctx == ctx &&
                 atomic_load_explicit(&g0->open, memory_order_relaxed) != NULL,
    };
    l->share = gv_sm_admit(sm, d->region_dev, d->uuid_str, l->est, &adm);
    l->arb = (uint32_t)adm.arb;
    l->start = adm.waited ? 0 : adm.start;
    /* Segments (above): back to back on the same stream, alone, or as the
     * holder of the turn (the others drained before it took it, and wait
     * for its launches, a segment's too, to be measured), then up to
     * SEG_TURN_NS of estimates a segment. */
    uint64_t tok = (uint64_t)(uintptr_t)t;     /* names the thread */
    _Atomic uint64_t *tag = tag_of(ctx, stream);
    int only_mine = atomic_load_explicit(tag, memory_order_relaxed) == tok;
    if (!only_mine)
        atomic_store_explicit(tag, tok, memory_order_relaxed);
    /* Joining an open segment after a gap (the thread was not run, say)
     * charges the gap, as ending it here would (its end event recorded
     * now); a pause longer than SEG_IDLE_NS has ended it (the meter). */
    int solo = adm.holds || (!adm.turn && adm.alone);     /* nobody else's kernels on the device */
    int join = l->start && solo;
    struct seg *g = t->seg.s;
    if (g && atomic_load_explicit(&g->owner, memory_order_relaxed) != tok)
        g = t->seg.s = NULL;
    unsigned gen = atomic_load_explicit(&ctx_gen, memory_order_acquire);
    struct rec *r = g ? atomic_load(&g->open) : NULL;
    if (r) {
        /* Only this thread opens segments in g and counts launches in
         * them; others (the meter, a thread destroying a stream) may end
         * one at any time: r is looked at, then taken as still open if g
         * still holds it, unchanged, once this launch says it joins (the
         * meter leaves a segment being joined alone). */
        uint64_t seq = atomic_load(&g->seq);
        if (join && only_mine && r->stream == stream && r->ctx == ctx &&
            r->share == l->share && r->n < SEG_MAX && g->gen == gen &&
            (!adm.holds || r->est < SEG_TURN_NS) &&
            !atomic_load(&gv_sm_captures)) {
            atomic_fetch_add(&g->joining, 1);
            if (atomic_load(&g->open) == r && atomic_load(&g->seq) == seq) {
                /* Joins it, no event of its own: counted in it once
                 * launched (gv_sm_end), if it is still open then. */
                atomic_store_explicit(&g->last, adm.start, memory_order_relaxed);
                l->seg = g;
                l->seq = seq;
                return 1;
            }
            atomic_fetch_sub(&g->joining, 1);
        }
        seg_lock(g);
        seg_end_here(g);
        seg_unlock(g);
    }
    if (!l->arb) {
        /* It skipped the arbiter to join, and does not: counted there now,
         * so that a segment it opens stays in flight for other containers. */
        gv_arb_admitted(d->region_dev, d->uuid_str, adm.start, l->est);
        l->arb = 1;
    }
    /* Not joining.  Back to back: soon after the thread's last launch on the stream, or
     * while the stream is still busy with the work admitted so far (by
     * the estimates). */
    int b2b = l->start && solo && ctx && !ptsz &&
              stream != GV_CU_STREAM_PER_THREAD && t->seg.exit && t->seg.stream == stream &&
              t->seg.ctx == ctx && l->start >= t->seg.exit &&
              (l->start - t->seg.exit <= t->seg.exit - t->seg.entry ||
               t->seg.busy_until > l->start);
    int resume = join && t->seg.in_seg && adm.start - t->seg.in_seg <= SEG_RESUME_NS &&
                 ctx && !ptsz && stream != GV_CU_STREAM_PER_THREAD;
    if ((b2b || resume) && only_mine && atomic_load(&started) &&
        (g || (g = seg_claim(tok, adm.start)))) {
        l->seg = g;     /* opens one once launched (gv_sm_end) */
        l->opens = 1;
    }
    /* The events belong to the stream's context, which need not be this
     * thread's current one (a stream may be launched on with another
     * context current, or none): made there, or they could not be made or
     * recorded, and every such launch went unmeasured at an estimate that
     * never learns (a 20 % limit ran 5 ms kernels at 100 %). */
    int pushed = ctx && ctx != current_ctx(&cur, &have_cur) &&
                 GV_REAL(cuCtxPushCurrent_v2, CUresult (*)(CUcontext))(ctx) == CUDA_SUCCESS;
    ev_create_fn create = GV_REAL(cuEventCreate, ev_create_fn);
    ev_record_fn record = ptsz ? GV_REAL(cuEventRecord_ptsz, ev_record_fn)
                               : GV_REAL(cuEventRecord, ev_record_fn);
    /* From the begin event to the end event (gv_sm_end), no other gated
     * process on the device enqueues: its kernel would run, and be
     * measured, between them (sm_enqueue.c). */
    /* No meter thread (it could not be started): nothing would read the
     * events; the launch is charged its estimate. */
    /* A spare pair of the context's events when the meter kept one. */
    struct rec *spare = ctx && atomic_load(&started) ? spare_take(ctx) : NULL;
    int made;
    if (spare) {
        l->rec = spare;
        l->begin = spare->begin;
        l->end = spare->end;
        made = 1;
    } else {
        made = atomic_load(&started) && create(&l->begin, 0) == CUDA_SUCCESS &&
               create(&l->end, 0) == CUDA_SUCCESS;
    }
    if (made)
        l->enqueue = gv_sm_enqueue_begin(sm, l->dev);
    if (!made || record(l->begin, stream) != CUDA_SUCCESS) {
        gv_sm_enqueue_end(sm, l->dev, l->enqueue);
        l->enqueue = 0;
        drop_events(l);
        l->begin = l->end = NULL;
        l->rec = NULL;
        if (atomic_load(&started))
            unmeasured();
    }
    if (pushed) {
        CUcontext popped;
        GV_REAL(cuCtxPopCurrent_v2, CUresult (*)(CUcontext *))(&popped);
    }
    return 1;
}

/* A launch that joined an open segment has returned.  Ended meanwhile
 * (another thread ended every segment, a stream destroyed, say): its
 * kernel may lie after the end event, so it is charged its estimate
 * alone, as an unmeasured launch. */
static void seg_joined(gv_sm_launch *l, CUresult rc, uint64_t now)
{
    struct seg *g = l->seg;
    seg_lock(g);
    struct rec *r = atomic_load(&g->open);
    int still = r && atomic_load(&g->seq) == l->seq;
    if (rc == CUDA_SUCCESS && still) {
        r->n++;
        r->arb_n += l->arb;
        r->est += l->est;
        r->stretch = 0;
        atomic_store(&g->last, now);
    }
    atomic_fetch_sub(&g->joining, 1);
    seg_unlock(g);
    if (rc != CUDA_SUCCESS)
        gv_sm_settle(l->sm, l->dev, l->share, l->est, 0, l->arb);   /* not launched */
    else if (!still)
        gv_sm_settle(l->sm, l->dev, l->share, l->est, l->est, l->arb);
}

void gv_sm_end(gv_sm_launch *l, CUresult rc)
{
    if (!l->gated)
        return;
    uint64_t now = gv_mono_ns();
    struct mine *t = l->mine;   /* this thread's (gv_sm_begin) */
    /* The back-to-back test of the thread's next launch (segments). */
    if (t->seg.stream != l->stream || t->seg.ctx != l->ctx || t->seg.busy_until < now)
        t->seg.busy_until = now;
    t->seg.busy_until += rc == CUDA_SUCCESS ? l->est : 0;
    t->seg.entry = l->start;
    t->seg.exit = l->start ? now : 0;
    t->seg.stream = l->stream;
    t->seg.ctx = l->ctx;
    t->seg.in_seg = l->seg && rc == CUDA_SUCCESS ? now : 0;
    if (l->seg && !l->opens) {
        seg_joined(l, rc, now);
        return;
    }
    if (rc != CUDA_SUCCESS || !l->begin)
        l->seg = NULL;          /* opens nothing */
    if (rc != CUDA_SUCCESS || !l->begin) {
        gv_sm_enqueue_end(l->sm, l->dev, l->enqueue);
        /* Not launched: give the charge back.  Unmeasured: keep it. */
        gv_sm_settle(l->sm, l->dev, l->share, l->est, rc != CUDA_SUCCESS ? 0 : l->est, l->arb);
        drop_events(l);
        return;
    }
    ev_record_fn record = l->ptsz ? GV_REAL(cuEventRecord_ptsz, ev_record_fn)
                                  : GV_REAL(cuEventRecord, ev_record_fn);
    struct rec *r = NULL;
    /* The enqueue word holds the time it was taken, just before the begin
     * event was recorded. */
    uint64_t stretch = l->enqueue ? now - (l->enqueue & ~3ULL) : 0;
    /* One that opens a segment records no end event: a later one does. */
    CUresult recorded = l->seg ? CUDA_SUCCESS : record(l->end, l->stream);
    gv_sm_enqueue_end(l->sm, l->dev, l->enqueue);
    if (recorded != CUDA_SUCCESS)
        unmeasured();
    else
        r = l->rec ? (struct rec *)l->rec : rec_new();
    if (!r) {
        gv_sm_settle(l->sm, l->dev, l->share, l->est, l->est, l->arb);
        drop_events(l);
        return;
    }
    r->ctx = l->ctx;
    r->stream = l->stream;
    r->begin = l->begin;
    r->end = l->end;
    r->sm = l->sm;
    r->dev = l->dev;
    r->key = l->key;
    r->est = l->est;
    r->started = 0;
    r->over = 0;
    r->stretch = stretch > STRETCH_NS ? stretch : 0;
    r->share = l->share;
    r->n = 1;
    r->arb_n = l->arb;
    r->segment = 0;
    if (l->seg) {
        /* Opened, unless a capture began meanwhile: its thread waits for
         * this lock (gv_sm_segments_end) before the capture begins, so the
         * end event recorded here goes in before it. */
        struct seg *g = l->seg;
        seg_lock(g);
        if (!atomic_load(&gv_sm_captures) && !atomic_load(&g->open) &&
            atomic_load(&g->owner) == thread_token()) {
            r->segment = 1;
            g->gen = atomic_load_explicit(&ctx_gen, memory_order_acquire);
            atomic_store(&g->last, now);
            atomic_fetch_add(&g->seq, 1);
            atomic_fetch_add(&segs_open, 1);
            atomic_store(&g->open, r);
            seg_unlock(g);
            wake();     /* the meter ends it if nothing follows */
            return;
        }
        if (record(l->end, l->stream) != CUDA_SUCCESS) {
            seg_unlock(g);
            unmeasured();
            gv_sm_settle(l->sm, l->dev, l->share, l->est, l->est, l->arb);
            drop(r);
            return;
        }
        seg_unlock(g);
    }
    post(r);
}

static void post(struct rec *r)
{
    r->next = atomic_load(&inbox);
    while (!atomic_compare_exchange_weak(&inbox, &r->next, r))
        ;
    /* A meter start that failed after this launch found it started:
     * either that start's settle_unmetered took r, or this sees 0. */
    if (!atomic_load(&started))
        settle_unmetered();
    wake();
}

/* ---- a context being destroyed ---------------------------------------------- */

#define FORGET_WAIT_NS (1000ULL * 1000 * 1000)

/* Sleep on `forgot` while it reads seen, until the deadline, at most 10 ms. */
static void wait_forgot(unsigned seen, uint64_t deadline)
{
    uint64_t now = gv_mono_ns();
    if (now >= deadline)
        return;
    uint64_t left = deadline - now;
    struct timespec ts = { 0, (long)(left < 10000000ULL ? left : 10000000ULL) };
    syscall(SYS_futex, &forgot, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
}

/* The meter took too long (stuck in a driver call?): the context is
 * destroyed all the same, or cuCtxDestroy would hang with it. */
static void gave_up(void)
{
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gv_log(GV_LOG_ERROR, "the SM meter did not let go of a context being destroyed within "
                             "1 s; its launches' events may be used after it");
}

void gv_sm_ctx_destroying(CUcontext ctx)
{
    if (!ctx)
        return;
    atomic_fetch_add(&ctx_gen, 1);
    gv_sm_segments_end();       /* their end events recorded while ctx lives */
    if (!atomic_load(&started)) {
        /* No meter thread (none started yet, it could not start, or a
         * forked child): a launch posted meanwhile is settled here. */
        settle_unmetered();
        return;
    }
    /* The driver waits for the context's work when it destroys it: waited
     * for here, so that the meter measures its last kernels as any other,
     * rather than settling them at what they were charged. */
    if (GV_REAL(cuCtxPushCurrent_v2, CUresult (*)(CUcontext))(ctx) == CUDA_SUCCESS) {
        GV_REAL(cuCtxSynchronize, CUresult (*)(void))();
        CUcontext popped;
        GV_REAL(cuCtxPopCurrent_v2, CUresult (*)(CUcontext *))(&popped);
    }
    uint64_t deadline = gv_mono_ns() + FORGET_WAIT_NS;
    for (;;) {      /* one context at a time: another thread's first */
        unsigned seen = atomic_load(&forgot);
        CUcontext none = NULL;
        if (atomic_compare_exchange_strong(&forget_req, &none, ctx))
            break;
        if (!atomic_load(&started)) {
            settle_unmetered();
            return;
        }
        if (gv_mono_ns() >= deadline) {
            gave_up();
            return;
        }
        wake();
        wait_forgot(seen, deadline);
    }
    wake();
    for (;;) {
        unsigned seen = atomic_load(&forgot);
        if (atomic_load(&forget_req) != ctx)
            return;     /* done (or the same context posted again: done too) */
        int no_meter = !atomic_load(&started);
        if (no_meter || gv_mono_ns() >= deadline) {
            CUcontext mine = ctx;
            if (atomic_compare_exchange_strong(&forget_req, &mine, NULL) && no_meter)
                settle_unmetered();
            if (!no_meter)
                gave_up();
            return;
        }
        wait_forgot(seen, deadline);
    }
}
