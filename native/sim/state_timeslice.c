/*
 * state_timeslice.c - the time-slicing mode of the simulated device
 * (GPUVISOR_SIM_TIMESLICE_US > 0), as a real GPU behaves between contexts.
 *
 * Every process has one FIFO queue per device (sim_tsq in the node state)
 * of kernels, each with its remaining time, and zero-length event markers.
 * The device runs one queue at a time.  The resident queue keeps the
 * device until it has nothing left, or until its turn of one timeslice has
 * passed while another queue has work; then its running kernel is
 * preempted and keeps its remaining time.  The turn is counted from when
 * another queue first waits (the timeslice timer reloads while the queue
 * is alone).  A switch costs GPUVISOR_SIM_CTXSW_US when the outgoing queue
 * still had work, GPUVISOR_SIM_CTXSW_IDLE_US when it had none; nothing
 * runs during it.  Queues take turns round-robin.  A marker is done (an
 * event "reached") when its queue is resident and gets to it.
 *
 * There is no executor: replay() advances the device lazily, under the
 * node lock, from where it was left to now, at every launch, record,
 * query, synchronize and NVML read.  Work arrives only at "now" (a launch
 * replays first), so the replay never needs to look ahead.
 *
 * NVML: replay() writes into the device's interval ring (state_timeline.c)
 * the time each pid had a kernel started and not done, resident or
 * preempted (so two busy processes each read ~100 %, as on an H200), and,
 * under pid 0, the time the device had work or was switching.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include "sim.h"

#define NS_US 1000ULL

static uint64_t g_slice_ns, g_sw_ns, g_sw_idle_ns;
static int g_cfg_rc;
static pthread_once_t g_cfg_once = PTHREAD_ONCE_INIT;

/* a non-negative integer from 0 to hi (unset: fallback); -1 reported */
static int knob(const char *var, unsigned long long hi, unsigned long long fallback,
                unsigned long long *out)
{
    const char *v = getenv(var);
    *out = fallback;
    if (!v || !*v)
        return 0;
    unsigned long long n;
    if (sim_parse_ull(v, &n) || n > hi) {
        sim_log("%s=%s is not an integer from 0 to %llu", var, v, hi);
        return -1;
    }
    *out = n;
    return 0;
}

static void read_config(void)
{
    unsigned long long slice, sw, idle;
    int bad = knob("GPUVISOR_SIM_TIMESLICE_US", 1000000, 0, &slice);
    bad |= knob("GPUVISOR_SIM_CTXSW_US", 100000, 180, &sw);
    bad |= knob("GPUVISOR_SIM_CTXSW_IDLE_US", 100000, 60, &idle);
    g_cfg_rc = bad ? -1 : 0;
    g_slice_ns = bad ? 0 : slice * NS_US;
    g_sw_ns = sw * NS_US;
    g_sw_idle_ns = idle * NS_US;
}

int sim_ts_config(void)
{
    pthread_once(&g_cfg_once, read_config);
    return g_cfg_rc;
}

uint64_t sim_ts_us(void)
{
    pthread_once(&g_cfg_once, read_config);
    return g_slice_ns / NS_US;
}

/* ---- NVML intervals -------------------------------------------------- */

/* Record [a, b) for pid in node's ring.  Called in time order of b, so the
 * ring's ends stay ordered; a piece that continues one of the newest few
 * entries of the same pid extends it. */
static void put_interval(int node, int32_t pid, uint64_t a, uint64_t b)
{
    sim_timeline *t = &sim_state()->tl[node];
    if (b <= a)
        return;
    uint64_t h = t->head;
    for (uint64_t i = 0; i < 4 && i < h && i < SIM_TL_RING; i++) {
        sim_interval *e = &t->ring[(h - 1 - i) % SIM_TL_RING];
        if (e->pid == pid && e->end == a) {
            e->end = b;
            return;
        }
    }
    sim_interval *e = &t->ring[h % SIM_TL_RING];
    if (h >= SIM_TL_RING)
        t->evicted_until = e->end;
    e->pid = pid;
    e->start = a;
    e->end = b;
    __atomic_store_n(&t->head, h + 1, __ATOMIC_RELEASE);
}

/* ---- the device ------------------------------------------------------ */

static int has_work(const sim_tsq *q)
{
    return q->pid && q->head > q->tail;
}

/* the next queue after cur with work, round-robin (cur itself last) */
static int next_queue(const sim_tsdev *d, int cur)
{
    for (int i = 1; i <= SIM_TS_CTX; i++) {
        int k = ((cur < 0 ? -1 : cur) + i + SIM_TS_CTX) % SIM_TS_CTX;
        if (has_work(&d->q[k]))
            return k;
    }
    return -1;
}

static int others_wait(const sim_tsdev *d, int cur)
{
    for (int k = 0; k < SIM_TS_CTX; k++)
        if (k != cur && has_work(&d->q[k]))
            return 1;
    return 0;
}

static void start_switch(sim_tsdev *d, int to, uint64_t cost)
{
    d->next = to;
    d->sw_until = d->t + cost;
}

/* replay node's device up to now; node lock held */
static void replay(int node, uint64_t now)
{
    sim_tsdev *d = &sim_state()->ts[node];
    if (!d->t) {
        d->t = now;
        d->cur = d->next = -1;
    }
    while (d->t < now) {
        if (d->next >= 0) {                     /* switching */
            if (d->sw_until > now) {
                d->t = now;
                break;
            }
            d->t = d->sw_until;
            d->cur = d->next;
            d->next = -1;
            d->slice_start = d->t;
            continue;
        }
        sim_tsq *q = d->cur >= 0 ? &d->q[d->cur] : NULL;
        if (!q || !has_work(q)) {
            int to = next_queue(d, d->cur);
            if (to < 0) {                       /* idle until now */
                if (d->busy_since) {
                    put_interval(node, 0, d->busy_since, d->t);
                    d->busy_since = 0;
                }
                d->t = now;
                break;
            }
            if (!d->busy_since)
                d->busy_since = d->t;
            if (d->cur < 0)
                d->cur = to, d->slice_start = d->t;
            else if (to != d->cur)
                start_switch(d, to, g_sw_idle_ns);
            else
                d->slice_start = d->t;
            continue;
        }
        if (!d->busy_since)
            d->busy_since = d->t;
        uint64_t seq = q->tail, *rem = &q->rem[seq % SIM_TS_Q];
        if (!*rem) {                            /* a marker, or a 0 ns kernel */
            q->done[seq % SIM_TS_Q] = d->t;
            __atomic_store_n(&q->tail, seq + 1, __ATOMIC_RELEASE);
            continue;
        }
        int contended = others_wait(d, d->cur);
        uint64_t until = d->t + *rem;
        if (until > now)
            until = now;
        if (contended) {
            uint64_t turn_end = d->slice_start + g_slice_ns;
            if (turn_end < d->t)
                turn_end = d->t;
            if (until > turn_end)
                until = turn_end;
        }
        if (!q->busy_since)
            q->busy_since = d->t;
        /* time first: a process killed between the two stores leaves a
         * kernel with time to spare, never one whose remaining time wraps */
        uint64_t ran = until - d->t;
        d->t = until;
        *rem -= ran;
        if (!contended)
            d->slice_start = d->t;              /* alone: the timer reloads */
        if (!*rem) {
            q->done[seq % SIM_TS_Q] = d->t;
            __atomic_store_n(&q->tail, seq + 1, __ATOMIC_RELEASE);
            put_interval(node, q->pid, q->busy_since, d->t);
            q->busy_since = 0;
        } else if (contended && d->t >= d->slice_start + g_slice_ns) {
            start_switch(d, next_queue(d, d->cur), g_sw_ns);   /* preempt */
        }
    }
    /* what is still going on is known up to now */
    for (int k = 0; k < SIM_TS_CTX; k++) {
        sim_tsq *q = &d->q[k];
        if (q->busy_since && q->busy_since < now) {
            put_interval(node, q->pid, q->busy_since, now);
            q->busy_since = now;
        }
    }
    if (d->busy_since && d->busy_since < now) {
        put_interval(node, 0, d->busy_since, now);
        d->busy_since = now;
    }
}

/* ---- this process's queue -------------------------------------------- */

static int alive(int32_t pid)
{
    return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
}

static struct {
    int32_t pid;
    int slot;
} g_mine[SIM_MAX_NODE];

/* this process's queue on node, claimed if needed; node lock held.
 * -1: every queue is taken by live processes or busy. */
static int my_queue(int node)
{
    sim_tsdev *d = &sim_state()->ts[node];
    int32_t me = (int32_t)getpid();
    if (g_mine[node].pid == me && d->q[g_mine[node].slot].pid == me)
        return g_mine[node].slot;
    for (int k = 0; k < SIM_TS_CTX; k++)
        if (d->q[k].pid == me)
            return g_mine[node].pid = me, g_mine[node].slot = k;
    for (int k = 0; k < SIM_TS_CTX; k++) {
        sim_tsq *q = &d->q[k];
        if (q->head > q->tail || q->busy_since || (q->pid && alive(q->pid)))
            continue;
        q->pid = me;
        g_mine[node].pid = me;
        g_mine[node].slot = k;
        return k;
    }
    return -1;
}

/* queue an item of dur ns; node lock held.  Returns its token (seq + 1),
 * 0 when no queue could be had (the work is then dropped), or UINT64_MAX
 * when the queue is full (the caller waits and tries again). */
static uint64_t enqueue(int node, uint64_t dur)
{
    replay(node, sim_now_ns());
    int k = my_queue(node);
    if (k < 0)
        return 0;
    sim_tsq *q = &sim_state()->ts[node].q[k];
    if (q->head - q->tail >= SIM_TS_Q)
        return UINT64_MAX;
    uint64_t seq = q->head;
    q->rem[seq % SIM_TS_Q] = dur;
    q->done[seq % SIM_TS_Q] = 0;
    __atomic_store_n(&q->head, seq + 1, __ATOMIC_RELEASE);
    return seq + 1;
}

static int valid_node(int node)
{
    return sim_state() && sim_node_ok(node);
}

/* enqueue, waiting while the queue is full (markers count too, so a
 * process's kernels and events can fill it past its launch bound) */
static uint64_t enqueue_wait(int node, uint64_t dur)
{
    for (;;) {
        sim_state_lock();
        uint64_t tok = enqueue(node, dur);
        sim_state_unlock();
        if (tok != UINT64_MAX)
            return tok;
        sim_sleep_until(sim_now_ns() + 100 * NS_US);
    }
}

uint64_t sim_ts_launch(int node, uint64_t dur)
{
    if (!valid_node(node))
        return 0;
    uint64_t tok = enqueue_wait(node, dur);
    sim_state_lock();
    sim_state()->tl[node].launches++;
    sim_state_unlock();
    if (!tok)
        sim_log("time-slicing: no free queue on device %d; kernel dropped", node);
    return tok;
}

uint64_t sim_tl_marker(int node)
{
    if (!valid_node(node))
        return 0;
    return enqueue_wait(node, 0);
}

/* state of token v: 1 done (stamp in *at), 0 not yet (*left: ns of this
 * queue's own work before it), under the node lock */
static int token_state(int node, uint64_t v, uint64_t *at, uint64_t *left)
{
    uint64_t now = sim_now_ns();
    sim_state_lock();
    replay(node, now);
    int k = my_queue(node);
    int done = 1;
    *at = now;
    *left = 0;
    if (k >= 0) {
        sim_tsq *q = &sim_state()->ts[node].q[k];
        uint64_t seq = v - 1;
        if (q->tail > seq) {
            if (q->tail - seq <= SIM_TS_Q)
                *at = q->done[seq % SIM_TS_Q];
        } else if (q->head > seq) {
            done = 0;
            for (uint64_t i = q->tail; i <= seq; i++)
                *left += q->rem[i % SIM_TS_Q];
        }
    }
    sim_state_unlock();
    return done;
}

int sim_tl_done(int node, uint64_t v)
{
    if (!sim_ts_us())
        return v <= sim_now_ns();
    if (!v || !valid_node(node))
        return 1;
    uint64_t at, left;
    return token_state(node, v, &at, &left);
}

void sim_tl_wait(int node, uint64_t v)
{
    if (!sim_ts_us()) {
        sim_sleep_until(v);
        return;
    }
    if (!v || !valid_node(node))
        return;
    uint64_t at, left;
    /* Sleep at least this queue's own work left, then look again: other
     * queues' turns only make it later. */
    while (!token_state(node, v, &at, &left)) {
        uint64_t nap = left > 50 * NS_US ? left : 50 * NS_US;
        sim_sleep_until(sim_now_ns() + nap);
    }
}

int sim_tl_stamp(int node, uint64_t v, uint64_t *at)
{
    if (!sim_ts_us()) {
        *at = v;
        return v <= sim_now_ns() ? 0 : -1;
    }
    uint64_t left;
    if (!v || !valid_node(node)) {
        *at = 0;
        return 0;
    }
    return token_state(node, v, at, &left) ? 0 : -1;
}

void sim_ts_sync_history(int node)
{
    if (!sim_ts_us() || !valid_node(node))
        return;
    sim_state_lock();
    replay(node, sim_now_ns());
    sim_state_unlock();
}
