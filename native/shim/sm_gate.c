/*
 * sm_gate.c - pacing kernel launches to the container's share of GPU time.
 *
 * Each device entry of the region carries a pacing clock, `tat` (the
 * "theoretical arrival time" of the generic cell-rate algorithm).  A launch
 * whose kernel is expected to run c ns on a container with share s (1/100 %)
 * moves the clock c * 10000 / s ns forward: the container may only be
 * `TOLERANCE_NS` ahead of wall-clock time, so over any interval its kernels
 * get at most s of the GPU, plus that small tolerance.  Idle time earns no
 * credit beyond LAG_NS (the clock is never admitted from further behind
 * "now" than that), so the share is a cap even on an idle GPU.  The clock is one 64-bit word
 * changed by CAS: no lock, and a process killed at any point leaves it valid.
 *
 * The cost c comes from measurement (sm_meter.c): before a kernel's time is
 * known the launch is charged an estimate (the function's recent average),
 * and when its events complete the difference is settled on the clock.
 */
#include <stdatomic.h>
#include <time.h>

#include "core.h"
#include "sm.h"

#define TOLERANCE_NS (4ULL * 1000 * 1000)
/* How far the clock may lag behind now: refunds of over-estimated kernels
 * (settled after the fact) stay usable, and a container back from idle may
 * start with at most (LAG + TOLERANCE) x share of GPU work. */
#define LAG_NS (10ULL * 1000 * 1000)
#define MAX_SLEEP_NS (20ULL * 1000 * 1000)
/* A launch held by the clock sleeps until the container is this much less
 * than TOLERANCE_NS ahead, not just back at it: the launches after the wait
 * then go through in a run (a stream's segment, sm_meter.c, lasts until
 * the next wait), instead of one or two between waits each a poll of the
 * meter apart.  The clock is not moved: the credit is spent after the
 * wait, so the share over time is the same.  At most what the share
 * leaves idle of the tolerance: at 90 % a 2 ms sleep drained the queue and
 * left gaps (window sd 1.0-1.1 against 0.75 before), at 0.4 ms 0.73-0.74. */
#define WAKE_CREDIT_NS (2000ULL * 1000)
#define DEFAULT_ESTIMATE_NS 1000000ULL   /* unknown kernels: 1 ms until measured */
/* What each process may have in flight (admitted, not yet finished): a
 * short queue, because on a time-sliced device a kernel queued behind
 * other processes' work measures their time too (the deeper the queues,
 * the noisier the measurements), and work admitted but stuck behind other
 * containers' kernels runs later at more than the share.  At least one
 * launch always goes; two while no other process of the container keeps
 * the device busy, so that it does not wait for the meter thread's
 * settling between a process's kernels (sm_policy.c tells which).
 *
 * With no other container on the device, the whole container keeps at
 * most 4 ms x share in flight, split evenly between its processes that
 * work on the device, and below 50 % one kernel at a time per process:
 * every kernel admitted before the last one's time is known was admitted
 * on an estimate, so a deeper queue lets a burst of long kernels overshoot
 * further, while at a high share a queue too short leaves gaps the share
 * does not allow.  A bound per process instead made a container's queue
 * grow with its processes.  Windows' standard deviation with 2 ms per
 * process -> with this bound (make bench-sm workload, 20 s runs, 2-3
 * seeds): 75 % x 4 processes 1.8-1.9 -> 1.6-1.7, 25 % x 2 1.9-2.1 ->
 * 1.7-1.8, 90 % x 1 1.4 -> 1.0; 50 % x 3, 90 % x 2 and 50 % x 1
 * unchanged.  (Not with other containers working: on a launch-order
 * device a process's part of a busy device follows the work it keeps
 * queued, and a short queue next to a deep one starves.) */
#define MAX_INFLIGHT_NS (2ULL * 1000 * 1000)
#define INFLIGHT_PER_SHARE_NS (4ULL * 1000 * 1000) /* x share, per container */
/* A container whose clock lags "now" by this much is behind its share. */
#define BEHIND_NS (LAG_NS / 2)
#define MAX_INFLIGHT_LAUNCHES 1024u
#define ARB_POLL_NS 50000ULL             /* a launch held by the launch order */
/* A launch about to join its thread's open segment (sm_meter.c: no other
 * process seen working on the device) skips the arbiter (its look at the
 * other containers, and counting the launch in its slot) for this long
 * after the arbiter last looked and saw no other container: a container
 * that starts working on the device meanwhile is seen at most this late,
 * and sees this process working (its slot was heard from then, and the
 * segment's first launch stays counted in flight until the segment is
 * settled), as any process that is not yet its turn's holder. */
#define ARB_QUIET_NS 1000000ULL
#define EST_SLOTS 4096u

uint64_t gv_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void sleep_ns(uint64_t ns)
{
    struct timespec ts = { (time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL) };
    nanosleep(&ts, NULL);
}

/* ---- estimates: the recent cost of each function or graph ---------------- */

static _Atomic(uintptr_t) est_key[EST_SLOTS];
static _Atomic uint64_t est_ns[EST_SLOTS];
static _Atomic uint64_t est_any = DEFAULT_ESTIMATE_NS;   /* over all kernels */

static unsigned est_home(uintptr_t key)
{
    uint64_t h = (uint64_t)key * 0x9e3779b97f4a7c15ULL;
    return (unsigned)(h >> 40) & (EST_SLOTS - 1);
}

uint64_t gv_sm_estimate(uintptr_t key)
{
    unsigned i = est_home(key);
    for (unsigned n = 0; n < 16; n++, i = (i + 1) & (EST_SLOTS - 1)) {
        uintptr_t k = atomic_load_explicit(&est_key[i], memory_order_acquire);
        if (k == key) {
            uint64_t v = atomic_load_explicit(&est_ns[i], memory_order_relaxed);
            if (v)
                return v;
            break;
        }
        if (k == 0)
            break;
    }
    return atomic_load_explicit(&est_any, memory_order_relaxed);
}

static void ewma(_Atomic uint64_t *slot, uint64_t sample)
{
    uint64_t old = atomic_load_explicit(slot, memory_order_relaxed);
    uint64_t nv = old ? old - old / 4 + sample / 4 : sample;
    atomic_store_explicit(slot, nv ? nv : 1, memory_order_relaxed);
}

void gv_sm_learn(uintptr_t key, uint64_t ns)
{
    ewma(&est_any, ns);
    unsigned i = est_home(key);
    for (unsigned n = 0; n < 16; n++, i = (i + 1) & (EST_SLOTS - 1)) {
        uintptr_t k = atomic_load_explicit(&est_key[i], memory_order_acquire);
        if (k == 0) {
            uintptr_t zero = 0;
            if (!atomic_compare_exchange_strong(&est_key[i], &zero, key) && zero != key)
                continue;
            k = key;
        }
        if (k == key) {
            ewma(&est_ns[i], ns);
            return;
        }
    }
    /* Table crowded here: the global average stands in for this key. */
}

/* ---- is anything gated ----------------------------------------------------- */

static _Atomic uint64_t gating_cache;   /* region_sm_gated's, for this process */

int gv_sm_gating(void)
{
    return region_sm_gated(gv_core_region(), &gating_cache);
}

/* ---- the pacing clock ------------------------------------------------------ */

/* Estimated GPU time and launches this process has in flight on each
 * region device, and who else works there: per device, so that a long
 * kernel on one GPU does not hold launches on another. */
static struct inflight {
    _Atomic uint64_t ns;
    _Atomic uint32_t n;
    atomic_int company;         /* 0 until the policies first say: see fork_child */
    atomic_int procs;
    atomic_int held;            /* a launch waited for the clock since the policies last asked */
    _Atomic uint64_t next_no;   /* the region's launch count after this process's last launch */
} inflight[GV_MAX_DEVICES];

static struct inflight *inflight_of(int dev)
{
    return &inflight[dev >= 0 && dev < GV_MAX_DEVICES ? dev : 0];
}

void gv_sm_set_company(int dev, int company, int procs)
{
    struct inflight *f = inflight_of(dev);
    atomic_store_explicit(&f->company, company | GV_SM_KNOWN, memory_order_relaxed);
    atomic_store_explicit(&f->procs, procs > 1 ? procs : 1, memory_order_relaxed);
}

/* Before the admission's first wait: said once (a->waiting), so that the
 * launching thread can end the stream's open segment first (sm_meter.c:
 * the stream is about to stand idle, and the launches in flight that the
 * wait may be for are settled only once their segment has ended). */
static void waits(struct gv_sm_admission *a)
{
    if (a && !a->waited) {
        a->waited = 1;
        a->joins = 0;       /* its segment ends: the arbiter is asked again */
        if (a->waiting)
            a->waiting();
    }
}

uint32_t gv_sm_admit(struct gv_sm *sm, int dev, const char *uuid, uint64_t cost_ns,
                     struct gv_sm_admission *a)
{
    uint64_t start = 0, turn_since = 0, now;
    uint32_t share;
    int skip_arb = 0;
    for (;;) {
        share = atomic_load_explicit(&sm->share, memory_order_relaxed);
        if (share > 10000)
            share = 10000;
        /* Even with the whole GPU lent (share 100 %), pace: that keeps the
         * work queued ahead of the device short, so a lower share takes
         * effect at once instead of after a deep queue drains. */
        now = gv_mono_ns();
        if (!start) {
            start = now;
            if (a)
                a->start = now;
        }
        /* The limit was lifted (and no pause is set) while this launch
         * waited: nothing gates it any more, as nothing gates the
         * container's next launches.  Waiting on would pay out, at the old
         * share, the lead a long kernel ran up (4 s after a 200 ms kernel
         * at 5 %), unless the meter happened to update the share first. */
        if (!region_sm_gates(sm)) {
            if (share == 0)
                share = 10000;
            break;
        }
        /* The yield flag is read here too: a container without a limit
         * is on the fast path until it is set, so no meter of its own may
         * yet have set the share to 0 (the gate must pause at once). */
        int yielding = region_sm_yielding(sm, now);
        if (share == 0 && !yielding && !gv_sm_meter_refresh()) {
            /* A share of 0 outside a pause, and no meter thread in this
             * process (it could not be started) to run the policies that
             * change it: the limit stands in.  The share is the region's:
             * a process killed while the pause lasted leaves the 0 its
             * meter set (the pause cleared or its lease ended since), and
             * this process's launches waited for good. */
            uint32_t limit = atomic_load_explicit(&sm->limit, memory_order_relaxed);
            share = limit && limit < 100 ? limit * 100 : 10000;
        } else if (share == 0 || yielding) {   /* paused: yielding */
            /* A share of 0 outside a pause is one the meter set while the
             * pause lasted (or set from a look taken just before it was
             * cleared).  Only its next policy update changes it, and a
             * meter with nothing gated in its region (the pause cleared
             * and the limit lifted at once) sleeps until the next gated
             * launch is posted: this one, which waited here for good; so
             * it is woken (gv_sm_meter_refresh, above). */
            waits(a);
            sleep_ns(1000000);
            continue;
        }
        /* Work admitted but stuck behind other containers' kernels would
         * run later at more than the share: bound what is in flight. */
        struct inflight *f = inflight_of(dev);
        uint64_t queued = atomic_load_explicit(&f->ns, memory_order_relaxed);
        uint32_t count = atomic_load_explicit(&f->n, memory_order_relaxed);
        int company = atomic_load_explicit(&f->company, memory_order_relaxed);
        /* For a segment (sm_meter.c): nobody else seen working, or not
         * known yet (the policies' first look; a mate's kernel measured in
         * a segment meanwhile is charged twice, never missed). */
        int alone = !(company & GV_SM_KNOWN) || (company & GV_SM_NOBODY) ||
                    !(company & (GV_SM_OTHERS | GV_SM_MATES));
        if (!(company & GV_SM_KNOWN))
            company = GV_SM_OTHERS;         /* not known yet: as if others worked */
        uint32_t min = company & GV_SM_MATES ? 1 : 2;
        uint64_t cap = MAX_INFLIGHT_NS;
        if (!(company & GV_SM_OTHERS)) {
            /* No other container on the device: the container's bound,
             * split between its processes; below 50 % one kernel at a time
             * per process does not idle the device for long, and keeps
             * bursts admitted on estimates small. */
            int procs = atomic_load_explicit(&f->procs, memory_order_relaxed);
            procs = procs > 1 ? procs : 1;
            cap = INFLIGHT_PER_SHARE_NS * share / 10000 / (uint64_t)procs;
            if (share < 5000)
                min = 1;
        }
        uint64_t tat = atomic_load_explicit(&sm->tat, memory_order_relaxed);
        if (tat + BEHIND_NS <= now) {
            /* Behind its share: one launch more.  While the device has
             * idle time (gaps open between kernels, or the launching
             * threads were not scheduled in time), also a deeper queue, as
             * deep as the container is behind (at most LAG_NS more), so a
             * launcher that gets the CPU late still keeps the device busy.
             * Not on a device that was busy all the time (others' work
             * ran, GV_SM_FULL): a deep queue there takes the device from
             * them in bursts, and both sides' 100 ms windows swing (pairs
             * at 50:50 and 30:70: standard deviation 3.5-4.5 points with
             * it, 2.3-2.6 without). */
            min++;
            if (!(company & GV_SM_FULL))
                cap = cap * 2 + (now - tat);
        }
        /* Next to other containers working on the device, the turn
         * (sm_arbiter.c): one process at a time has work on the device,
         * so that its events measure its own kernels only (a time-sliced
         * GPU preempts a context's kernel for another's slice, and the
         * events around it measure both); it replaces this process's own
         * in-flight bound then.  Not while this container's clock is too
         * far ahead to launch anyway.  Time spent waiting for the turn is
         * not idle time: the lag floor is taken from when the wait began
         * (a small container that waited through others' turns longer
         * than LAG_NS lost the difference). */
        int arb = -1;
        uint64_t ref = turn_since ? turn_since : now;
        uint64_t floor0 = ref > LAG_NS ? ref - LAG_NS : 0;
        uint64_t base0 = tat > floor0 ? tat : floor0;
        if (a && a->joins) {
            uint64_t quiet = gv_arb_quiet_at(dev);      /* 0: saw one; later: another thread's */
            skip_arb = quiet && now - quiet <= ARB_QUIET_NS;
        }
        if (base0 <= now + TOLERANCE_NS && !skip_arb) {
            arb = gv_arb_check(dev, uuid, base0, now, queued, count, cost_ns);
            if (arb == 0 || arb == 2) {
                if (arb == 0 && !turn_since)
                    turn_since = now;
                waits(a);
                sleep_ns(ARB_POLL_NS);
                continue;
            }
        }
        if (arb < 0 && count >= min && (queued + cost_ns > cap || count >= MAX_INFLIGHT_LAUNCHES)) {
            waits(a);
            sleep_ns(50000);
            continue;
        }
        uint64_t inc = cost_ns * 10000 / share;
        uint64_t t = atomic_load(&sm->tat);
        uint64_t floor = ref > LAG_NS ? ref - LAG_NS : 0;
        uint64_t base = t > floor ? t : floor;
        if (base > now + TOLERANCE_NS) {
            gv_arb_not_waiting(dev);
            struct inflight *h = inflight_of(dev);
            if (!atomic_load_explicit(&h->held, memory_order_relaxed))
                atomic_store_explicit(&h->held, 1, memory_order_relaxed);
            /* The credit back, at most what the share leaves idle of a
             * tolerance (90 %: 0.4 ms), so that a high share's queue does
             * not drain while it sleeps. */
            uint64_t credit = TOLERANCE_NS * (10000 - share) / 10000;
            uint64_t ahead = base - now - TOLERANCE_NS +
                             (credit < WAKE_CREDIT_NS ? credit : WAKE_CREDIT_NS);
            waits(a);
            sleep_ns(ahead < MAX_SLEEP_NS ? ahead : MAX_SLEEP_NS);
            continue;
        }
        if (atomic_compare_exchange_weak(&sm->tat, &t, base + inc)) {
            if (a) {
                a->turn = arb >= 0;
                a->holds = arb == 1 && gv_arb_holds(dev);
                a->alone = alone;
            }
            break;
        }
    }
    atomic_fetch_add_explicit(&inflight_of(dev)->ns, cost_ns, memory_order_relaxed);
    atomic_fetch_add_explicit(&inflight_of(dev)->n, 1, memory_order_relaxed);
    /* `now`: the clock read of the look that admitted it (a CAS later). */
    if (!skip_arb)
        gv_arb_admitted(dev, uuid, now, cost_ns);
    if (a)
        a->arb = !skip_arb;
    uint64_t waited = now - start;
    if (waited > 1000)
        atomic_fetch_add_explicit(&sm->wait_ns, waited, memory_order_relaxed);
    uint64_t no = atomic_fetch_add_explicit(&sm->launches, 1, memory_order_relaxed);
    /* Another process of the container launched through the gate on the
     * device since this process last did (the region's count moved in
     * between): not alone, whatever the policies' last look said (they
     * see a mate only once NVML has sampled its kernels). */
    uint64_t mine = atomic_exchange_explicit(&inflight_of(dev)->next_no, no + 1,
                                             memory_order_relaxed);
    if (a && mine != no)
        a->alone = 0;
    return share;
}

void gv_sm_overrun(struct gv_sm *sm, int dev, uint32_t share, uint64_t extra_ns)
{
    atomic_fetch_add_explicit(&inflight_of(dev)->ns, extra_ns, memory_order_relaxed);
    if (share)
        atomic_fetch_add(&sm->tat, extra_ns * 10000 / share);
}

void gv_sm_settle(struct gv_sm *sm, int dev, uint32_t share, uint64_t charged_ns, uint64_t actual_ns,
                  uint32_t arb)
{
    gv_sm_settle_n(sm, dev, share, charged_ns, actual_ns, 1, arb);
}

void gv_sm_settle_n(struct gv_sm *sm, int dev, uint32_t share, uint64_t charged_ns,
                    uint64_t actual_ns, uint32_t n, uint32_t arb)
{
    gv_arb_settled_n(dev, arb);
    atomic_fetch_sub_explicit(&inflight_of(dev)->ns, charged_ns, memory_order_relaxed);
    atomic_fetch_sub_explicit(&inflight_of(dev)->n, n, memory_order_relaxed);
    atomic_fetch_add_explicit(&sm->busy_ns, actual_ns, memory_order_relaxed);
    /* The charge was made at the share of that moment: settle at it too. */
    if (share == 0 || actual_ns == charged_ns)
        return;
    if (actual_ns > charged_ns) {
        atomic_fetch_add(&sm->tat, (actual_ns - charged_ns) * 10000 / share);
        return;
    }
    uint64_t back = (charged_ns - actual_ns) * 10000 / share;
    uint64_t t = atomic_load(&sm->tat);
    while (!atomic_compare_exchange_weak(&sm->tat, &t, t > back ? t - back : 0))
        ;
}

int gv_sm_took_held(int dev)
{
    return atomic_exchange_explicit(&inflight_of(dev)->held, 0, memory_order_relaxed);
}

void gv_sm_fork_child(void)
{
    for (int i = 0; i < GV_MAX_DEVICES; i++) {
        atomic_store(&inflight[i].held, 0);
        atomic_store(&inflight[i].ns, 0);
        atomic_store(&inflight[i].n, 0);
        atomic_store(&inflight[i].company, 0);
        atomic_store(&inflight[i].procs, 1);
    }
}
