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
 */
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "sm.h"

#define STALE_NS (2ULL * 1000 * 1000)
#define YIELDS 20                       /* then short sleeps */
#define NAP_NS 20000L

static _Atomic uint64_t *word_for(struct gv_sm *sm, int dev)
{
    _Atomic uint64_t *w = gv_arb_enqueue_word(dev);
    return w ? w : &sm->enqueue;
}

/* Taken by nobody, or by a holder past STALE_NS (or from before a reboot:
 * CLOCK_MONOTONIC restarts, the node directory's file may not). */
static int free_at(uint64_t held, uint64_t now)
{
    return held == 0 || held + STALE_NS <= now || held > now + STALE_NS;
}

uint64_t gv_sm_enqueue_begin(struct gv_sm *sm, int dev)
{
    _Atomic uint64_t *w = word_for(sm, dev);
    for (unsigned tries = 0;; tries++) {
        uint64_t now = gv_mono_ns();
        uint64_t held = atomic_load_explicit(w, memory_order_relaxed);
        if (free_at(held, now)) {
            if (atomic_compare_exchange_strong(w, &held, now | 1))
                return now | 1;
            continue;                   /* someone else took it: look again */
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
    atomic_compare_exchange_strong(word_for(sm, dev), &held, 0);
}
