/*
 * sm_enqueue.c - a gated launch's begin event, kernel and end event enter
 * the device's queue together.
 *
 * The meter measures a launch with the events recorded just before and
 * just after it (sm_meter.c).  On a device that runs what the processes
 * queue in order, another process's kernel queued between those three
 * calls runs between the two events, and is measured as part of this
 * launch: the simulator's timeline, in the make bench-sm workload with two
 * processes of one container at 90 %, measured 37 of 6430 launches too
 * long, by 45 ms in 7 s, in lumps of up to 5 ms (a whole kernel of the
 * other process, counted twice: once by each).  The pacing clock charged
 * those milliseconds, the container idled for them, and the calibration
 * against NVML took it back only over the following seconds, so the 100 ms
 * windows dipped by up to 9 points.
 *
 * So the three calls are made under a short lock that every gated process
 * on the device takes: the word in the node-wide launch-order file when
 * there is one (all containers, sm_arbiter.c), else the word in the
 * region's device entry (the container's own processes).  It is one
 * 64-bit word, the holder's CLOCK_MONOTONIC time when it took it (| 1, so
 * never 0), changed by CAS.  A holder is never waited for beyond STALE_NS
 * after it took the word: a process killed or stopped while holding it, or
 * one whose launch blocks (a full queue, a module loaded on first use),
 * costs the others at most that once, and the word is taken over.  The
 * holder gives it back only if it is still its own.
 *
 * The node-wide word lies in a file every container can write (mode 0666,
 * mounted into each): a neighbour that keeps storing the current time
 * there made it look taken for good, and held every other container's
 * gated launches (one waited 6 s; 500 launches a second fell to 230).  So
 * a launch waits for the node-wide word at most BOUND_NS, measured from
 * its own first look, whatever the word says; then it takes its region's
 * word instead (only the container's own processes write that one) and
 * goes on by its own region's clock, and this process leaves the node-wide
 * word alone on that device for BYPASS_NS.  A neighbour can cost each of
 * the container's processes at most BOUND_NS per BYPASS_NS that way (4 ms
 * in 250 ms); the
 * price of the bypass is the measurement that the word is for: while it
 * lasts, another container's kernel queued between this launch's events
 * may be measured as part of it.
 */
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "sm.h"

#define STALE_NS (2ULL * 1000 * 1000)
/* The most a launch waits for the node's word: twice STALE_NS, so that a
 * holder that stalls (taken over after STALE_NS) alone never trips it. */
#define BOUND_NS (2 * STALE_NS)
#define BYPASS_NS (250ULL * 1000 * 1000)
#define YIELDS 20                       /* then short sleeps */
#define NAP_NS 20000L
#define REGION_TAG 2ULL                 /* what begin returns: the region's word was taken */

/* Per region device: until when (CLOCK_MONOTONIC) this process leaves the
 * node's word alone after waiting BOUND_NS for it.  A forked child keeps
 * its parent's: the word is as stuck for it. */
static _Atomic uint64_t bypass_until[GV_MAX_DEVICES];

static _Atomic uint64_t *word_for(struct gv_sm *sm, int dev)
{
    _Atomic uint64_t *w = gv_arb_enqueue_word(dev);
    return w ? w : &sm->enqueue;
}

static int bypassing(int dev, uint64_t now)
{
    return dev >= 0 && dev < GV_MAX_DEVICES &&
           now < atomic_load_explicit(&bypass_until[dev], memory_order_relaxed);
}

/* Taken by nobody, or by a holder past STALE_NS (or from before a reboot:
 * CLOCK_MONOTONIC restarts, the node directory's file may not). */
static int free_at(uint64_t held, uint64_t now)
{
    return held == 0 || held + STALE_NS <= now || held > now + STALE_NS;
}

uint64_t gv_sm_enqueue_begin(struct gv_sm *sm, int dev)
{
    uint64_t start = gv_mono_ns();
    _Atomic uint64_t *w = word_for(sm, dev);
    /* tag: the region's word instead of the node's (none: the region's is
     * the word, as it is for a process without the node's file). */
    uint64_t tag = w == &sm->enqueue ? 0 : bypassing(dev, start) ? REGION_TAG : 0;
    if (tag)
        w = &sm->enqueue;
    for (unsigned tries = 0;; tries++) {
        uint64_t now = tries ? gv_mono_ns() : start;
        uint64_t held = atomic_load_explicit(w, memory_order_relaxed);
        uint64_t mine = (now & ~3ULL) | 1;
        if (free_at(held, now)) {
            if (atomic_compare_exchange_strong(w, &held, mine))
                return mine | tag;
            continue;                   /* someone else took it: look again */
        }
        if (w != &sm->enqueue && now - start >= BOUND_NS) {
            /* The node's word: held past the bound, by whatever wrote it. */
            atomic_store_explicit(&bypass_until[dev], now + BYPASS_NS, memory_order_relaxed);
            w = &sm->enqueue;
            tag = REGION_TAG;
            tries = 0;
            continue;
        }
        if (tries < YIELDS) {
            sched_yield();
        } else {
            struct timespec ts = { 0, NAP_NS };
            nanosleep(&ts, NULL);
        }
    }
}

void gv_sm_enqueue_end(struct gv_sm *sm, int dev, uint64_t held)
{
    if (!held)
        return;
    /* Taken over meanwhile (this holder was past STALE_NS): not ours. */
    _Atomic uint64_t *w = held & REGION_TAG ? &sm->enqueue : word_for(sm, dev);
    uint64_t mine = held & ~REGION_TAG;
    atomic_compare_exchange_strong(w, &mine, 0);
}
