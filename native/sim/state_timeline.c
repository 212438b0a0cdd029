/*
 * state_timeline.c - the per-device kernel timeline in the node state.
 *
 * No executor: a kernel is an interval [start, end) on its device's
 * CLOCK_MONOTONIC timeline (system-wide, so comparable across processes).
 * A launch takes the node lock, starts at max(now, busy_until, dep), moves
 * busy_until to its end and appends (pid, start, end) to the device's ring
 * of recent intervals, which NVML reads for utilization.  Kernels queued by
 * a process that dies keep their slots, like work already submitted to a
 * real GPU.
 */
#include <errno.h>
#include <time.h>
#include <unistd.h>

#include "sim.h"

uint64_t sim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

void sim_sleep_until(uint64_t t)
{
    struct timespec ts = {(time_t)(t / 1000000000ULL),
                          (long)(t % 1000000000ULL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

uint64_t sim_tl_launch(int node, uint64_t dep, uint64_t dur)
{
    sim_shared *S = sim_state();
    if (sim_ts_us())
        return sim_ts_launch(node, dur);  /* one FIFO per process: dep holds */
    uint64_t now = sim_now_ns();
    if (!S || !sim_node_ok(node))
        return (dep > now ? dep : now) + dur;
    int32_t pid = (int32_t)getpid();
    sim_timeline *t = &S->tl[node];
    sim_state_lock();
    uint64_t start = t->busy_until;
    if (start < now)
        start = now;
    if (start < dep)
        start = dep;
    uint64_t end = start + dur;
    uint64_t h = t->head;
    sim_interval *last = h ? &t->ring[(h - 1) % SIM_TL_RING] : NULL;
    if (last && last->pid == pid && last->end == start) {
        last->end = end;                /* back to back: one interval */
    } else if (dur) {
        sim_interval *e = &t->ring[h % SIM_TL_RING];
        if (h >= SIM_TL_RING)
            t->evicted_until = e->end;  /* before the entry is lost */
        e->pid = pid;
        e->start = start;
        e->end = end;
        __atomic_store_n(&t->head, h + 1, __ATOMIC_RELEASE);
    }
    t->launches++;
    t->busy_until = end;
    sim_state_unlock();
    return end;
}

int sim_tl_history(int node, uint64_t from, sim_interval *out, int max,
                   uint64_t *known)
{
    sim_shared *S = sim_state();
    *known = 0;
    if (!S || !sim_node_ok(node))
        return 0;
    sim_timeline *t = &S->tl[node];
    int n = 0;
    sim_ts_sync_history(node);
    sim_state_lock();
    uint64_t h = t->head;
    uint64_t lo = h > SIM_TL_RING ? h - SIM_TL_RING : 0;
    *known = t->evicted_until;
    /* intervals are in time order: walk back from the newest */
    uint64_t i = h;
    while (i > lo) {
        const sim_interval *e = &t->ring[(i - 1) % SIM_TL_RING];
        if (e->end <= from)
            break;
        i--;
    }
    for (; i < h && n < max; i++)
        out[n++] = t->ring[i % SIM_TL_RING];
    sim_state_unlock();
    return n;
}

uint64_t sim_tl_others_until(int node)
{
    sim_shared *S = sim_state();
    if (!S || !sim_node_ok(node))
        return 0;
    int32_t pid = (int32_t)getpid();
    sim_timeline *t = &S->tl[node];
    uint64_t until = 0;
    sim_state_lock();
    /* Back-to-back kernels of one process share an interval, so the latest
     * few intervals hold every kernel still queued. */
    uint64_t h = t->head;
    for (uint64_t i = 0; i < 64 && i < h && i < SIM_TL_RING; i++) {
        const sim_interval *e = &t->ring[(h - 1 - i) % SIM_TL_RING];
        if (e->pid != pid && e->end > until)
            until = e->end;
    }
    sim_state_unlock();
    return until;
}
