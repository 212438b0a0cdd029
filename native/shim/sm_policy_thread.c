/*
 * sm_policy_thread.c - the policy updates (sm_policy.c) on a thread of
 * their own.
 *
 * A policy update asks NVML for per-process utilisation, twice per
 * device, and that query is not cheap: it can take milliseconds.  Run on
 * the meter thread (sm_meter.c), as it was, every such millisecond was one
 * in which no kernel's end was heard of, so the gate's bounds on the work
 * in flight held the container's next launches while the device drained.
 * Measured with the simulator's GPUVISOR_SIM_NVML_UTIL_MS (make bench-sm
 * workload, 6 s runs, worst 100 ms window / windows beyond +-5 points):
 * 90 % x 2 processes, NVML taking 20 ms: mean 85.9 %, -23, 24 of 50; the
 * 50:50 pair with 5 ms: A 48.7 %, 5 of 50 (at 0 ms: 49.5 %, none).
 *
 * So the meter only says when an update is due (every 100 ms, or at once
 * when the gate asks: gv_sm_meter_refresh), and this thread runs it.  A
 * due update posted while one runs is run once, right after.  If the
 * thread cannot be started, the meter runs the updates itself, as before.
 * The words are process-private: no lock to leave held if the process dies
 * or forks; a forked child starts its own thread (gv_sm_policy_thread_fork).
 */
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "sm.h"

enum { NOT_STARTED, RUNNING, CANNOT_START };

static atomic_int state;
static atomic_int due;          /* 1: run an update; the futex word the thread waits on */

static void *policy_thread(void *unused)
{
    (void)unused;
    for (;;) {
        while (!atomic_exchange(&due, 0))
            syscall(SYS_futex, &due, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
        gv_sm_policies();
    }
    return NULL;
}

/* Called by the meter thread only, whose signals are all blocked: the new
 * thread inherits that mask, so signals still go to the program's threads. */
static int start(void)
{
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int ok = pthread_create(&t, &a, policy_thread, NULL) == 0;
    pthread_attr_destroy(&a);
    return ok;
}

void gv_sm_policy_due(void)
{
    int st = atomic_load(&state);
    if (st == NOT_STARTED) {
        st = start() ? RUNNING : CANNOT_START;
        atomic_store(&state, st);
    }
    if (st == CANNOT_START) {
        gv_sm_policies();
        return;
    }
    if (!atomic_exchange(&due, 1))
        syscall(SYS_futex, &due, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

void gv_sm_policy_thread_fork(void)
{
    atomic_store(&state, NOT_STARTED);
    atomic_store(&due, 0);
}
