/*
 * sm_calib.c - calibrating measured kernel times against NVML.
 *
 * Events bracket a kernel, but when other processes queue kernels between
 * this process's launch and its events (they take turns at the driver), the
 * bracket also covers some of their time and the kernel looks longer than
 * it ran.  NVML's per-process utilisation counts only this process's own
 * kernels.  Measured times are scaled by the ratio of the two over the
 * last CAL_WINDOW_NS (only ever scaled down), so that what is settled on
 * the pacing clock is this process's own GPU time.
 *
 * The comparison has to be like with like, or its noise becomes the
 * container's error (scaling down only, a noisy ratio charges too little
 * on average, and a ratio that wanders for a second or two shifts the
 * share for that long):
 *  - NVML's side is read sample by sample: each query asks for what is
 *    newer than this process's newest sample already taken, so each answer
 *    covers (previous sample, newest sample] exactly, rounded to a whole
 *    percent of one sample rather than of the whole window.  Only this
 *    process's own timestamps count: the driver does not publish every
 *    process's sample of a period at once, and asking from another
 *    process's newer timestamp hides this one's when it comes (on an H200,
 *    two processes sharing the GPU each lost about half of their samples
 *    to a reader that asked from the newest of anyone's, so the ratio came
 *    out low and their container ran 5-15 points over its limit:
 *    docs/benchmarks.md, "SM quota on a real GPU");
 *  - the events' side is placed in time: each measured kernel is spread
 *    over 1 ms buckets from its end (when the meter saw it finish) back by
 *    its length, and the ratio compares the buckets of the same interval
 *    as NVML's samples, so that a long kernel or graph at the window's
 *    edge is split as NVML splits it instead of counted whole on one side.
 *
 * Under the turn between containers (sm_arbiter.c, gv_arb_exclusive) the
 * meter settles what it measured, unscaled: the others drain before a
 * process holds the device, so its events are its own, and NVML's
 * per-process samples only add their noise there (on an H200 they spread
 * by 9-21 points while processes took turns, and the scaling charged each
 * container 3-6 points under what it ran).
 *
 * The meter thread (sm_meter.c) records measured kernels and scales
 * settlements; the policy thread (sm_policy_thread.c) asks NVML and hands
 * the answer over.  A process-private spinlock keeps the two apart, held
 * only for this file's arithmetic (never across NVML's query); a forked
 * child clears it.  native/tests/t_sm_calib.c tests the file alone.
 */
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "sm.h"

#define BUCKET_NS 1000000ULL              /* 1 ms */
#define BUCKETS 4096u                     /* 4 s of history */
#define CAL_WINDOW_NS 2000000000ULL       /* compared over the last 2 s */
/* Samples that ended less than this long ago are left for the next round:
 * a kernel that straddles a sample's end is only in the buckets once it
 * has finished (the workload's longest graph runs 20 ms). */
#define SETTLED_NS (30ULL * 1000 * 1000)
#define INTERVALS 256u                    /* NVML samples kept */

/* One per device this process measures on, made on first use. */
struct cal {
    struct bucket { uint64_t id, ns; } bucket[BUCKETS];
    /* NVML's samples as CPU-time us, converted when used (the offset
     * between the clocks jitters by microseconds from one reading to the
     * next). */
    struct interval { unsigned long long from, to; uint64_t busy; int mine; } iv[INTERVALS];
    unsigned iv_head, iv_n;
    unsigned long long seen_us;           /* NVML timestamp of the newest sample taken */
    double ratio;
};
static struct cal *cals[GV_MAX_DEVICES];
static atomic_flag busy = ATOMIC_FLAG_INIT;

static void lock(void)
{
    while (atomic_flag_test_and_set_explicit(&busy, memory_order_acquire))
        sched_yield();
}

static void unlock(void) { atomic_flag_clear_explicit(&busy, memory_order_release); }

static struct cal *cal_of(int dev)
{
    if (dev < 0 || dev >= GV_MAX_DEVICES)
        return NULL;
    if (!cals[dev]) {
        cals[dev] = calloc(1, sizeof *cals[dev]);
        if (cals[dev])
            cals[dev]->ratio = 1.0;
    }
    return cals[dev];
}

void gv_cal_reset(void)
{
    atomic_flag_clear(&busy);       /* a forked child: nobody else runs */
    for (int d = 0; d < GV_MAX_DEVICES; d++)
        if (cals[d]) {
            memset(cals[d], 0, sizeof *cals[d]);
            cals[d]->ratio = 1.0;
        }
}

static void record(int dev, uint64_t end, uint64_t ns)
{
    struct cal *c = cal_of(dev);
    if (!c || !ns || !end)
        return;
    uint64_t start = end > ns ? end - ns : 0;
    uint64_t b0 = start / BUCKET_NS, b1 = (end - 1) / BUCKET_NS;
    if (b1 - b0 >= BUCKETS) {
        b0 = b1 - (BUCKETS - 1);
        start = b0 * BUCKET_NS;
    }
    for (uint64_t b = b0; b <= b1; b++) {
        uint64_t lo = b * BUCKET_NS > start ? b * BUCKET_NS : start;
        uint64_t hi = (b + 1) * BUCKET_NS < end ? (b + 1) * BUCKET_NS : end;
        struct bucket *s = &c->bucket[b % BUCKETS];
        if (s->id != b + 1) {                 /* ids are b + 1: 0 is "empty" */
            s->id = b + 1;
            s->ns = 0;
        }
        s->ns += hi - lo;
    }
}

void gv_cal_record(int dev, uint64_t end, uint64_t ns)
{
    lock();
    record(dev, end, ns);
    unlock();
}

/* Measured time in [lo, hi), a bucket cut by either end counted pro rata. */
static uint64_t measured(const struct cal *c, uint64_t lo, uint64_t hi)
{
    if (hi <= lo)
        return 0;
    uint64_t sum = 0;
    uint64_t b0 = lo / BUCKET_NS, b1 = (hi - 1) / BUCKET_NS;
    if (b1 - b0 >= BUCKETS)
        return 0;                             /* older than the history */
    for (uint64_t b = b0; b <= b1; b++) {
        const struct bucket *s = &c->bucket[b % BUCKETS];
        if (s->id != b + 1)
            continue;
        uint64_t a = b * BUCKET_NS > lo ? b * BUCKET_NS : lo;
        uint64_t z = (b + 1) * BUCKET_NS < hi ? (b + 1) * BUCKET_NS : hi;
        sum += s->ns * (z - a) / BUCKET_NS;
    }
    return sum;
}

/* Where the next query starts: this process's newest sample taken, but
 * never more than CAL_WINDOW_NS back (what is older is not compared
 * anyway): a process idle while others work would otherwise ask from
 * further and further back, and an answer of one entry per sample could
 * outgrow the meter's buffer, so that the ratio froze. */
unsigned long long gv_cal_since(int dev, uint64_t real_ns)
{
    lock();
    struct cal *c = cal_of(dev);
    unsigned long long floor = (real_ns - CAL_WINDOW_NS) / 1000;
    unsigned long long since = c && c->seen_us > floor ? c->seen_us : floor;
    unlock();
    return since;
}

/* Take NVML's answer for what is newer than `since`: one interval. */
static void take_samples(struct cal *c, unsigned long long since,
                         const nvmlProcessUtilizationSample_t *s, unsigned n, unsigned me,
                         uint64_t real_ns)
{
    /* This process's newest sample, and its part of the time since the
     * last one taken.  NVML may answer with one entry per process covering
     * all the new samples, or one per sample. */
    unsigned long long real_us = real_ns / 1000, newest = 0, prev = since;
    if (c->seen_us && since < c->seen_us)
        return;                               /* not an answer to gv_cal_since */
    for (unsigned i = 0; i < n; i++)
        if (s[i].pid == me && s[i].timeStamp > newest && s[i].timeStamp <= real_us)
            newest = s[i].timeStamp;
    if (newest <= since)
        return;                               /* nothing new of this process's */
    if (!c->seen_us) {                        /* the first answer: where to start */
        c->seen_us = newest;
        return;
    }
    double busy = 0;
    int mine = 0;
    for (;;) {                                /* this process's entries, oldest first */
        unsigned long long next = 0;
        unsigned util = 0;
        for (unsigned i = 0; i < n; i++)
            if (s[i].pid == me && s[i].timeStamp > prev && s[i].timeStamp <= newest &&
                (!next || s[i].timeStamp < next)) {
                next = s[i].timeStamp;
                util = s[i].smUtil;
            }
        if (!next)
            break;
        busy += (double)(util > 100 ? 100 : util) / 100.0 * (double)(next - prev) * 1000.0;
        mine = 1;
        prev = next;
    }
    struct interval *v = &c->iv[c->iv_head];
    v->from = since;
    v->to = newest;
    v->busy = (uint64_t)busy;
    v->mine = mine;
    c->iv_head = (c->iv_head + 1) % INTERVALS;
    if (c->iv_n < INTERVALS)
        c->iv_n++;
    c->seen_us = newest;
}

static void update(int dev, unsigned long long since, const nvmlProcessUtilizationSample_t *s,
                   unsigned n, unsigned me, uint64_t real_ns, uint64_t mono_ns)
{
    struct cal *c = cal_of(dev);
    if (!c)
        return;
    take_samples(c, since, s, n, me, real_ns);
    /* The newest intervals that are settled, back to CAL_WINDOW_NS (in
     * NVML's CPU-time microseconds). */
    unsigned long long settled = (real_ns - SETTLED_NS) / 1000, lo = 0, hi = 0;
    uint64_t nv = 0;
    int mine = 0;
    for (unsigned i = 0; i < c->iv_n; i++) {
        const struct interval *v = &c->iv[(c->iv_head + INTERVALS - 1 - i) % INTERVALS];
        if (v->to > settled)
            continue;
        if (!hi)
            hi = v->to;
        if ((hi - v->from) * 1000 > CAL_WINDOW_NS)
            break;
        nv += v->busy;
        lo = v->from;
        mine |= v->mine;
    }
    if (!mine || !lo || (hi - lo) * 1000 < CAL_WINDOW_NS / 4)
        return;               /* NVML does not see this PID (containers), or too little yet */
    /* The buckets are monotonic time. */
    uint64_t off = real_ns - mono_ns;
    uint64_t ev = measured(c, lo * 1000 - off, hi * 1000 - off);
    if (ev < (hi - lo) * 1000 / 50)           /* < 2 % busy: too little to judge */
        return;
    double r = (double)nv / (double)ev;
    c->ratio = r > 1.25 ? 1.25 : (r < 0.3 ? 0.3 : r);
}

void gv_cal_update(int dev, unsigned long long since, const nvmlProcessUtilizationSample_t *s,
                   unsigned n, unsigned me, uint64_t real_ns, uint64_t mono_ns)
{
    lock();
    update(dev, since, s, n, me, real_ns, mono_ns);
    unlock();
}

double gv_cal_ratio(int dev)
{
    lock();
    const struct cal *c = dev >= 0 && dev < GV_MAX_DEVICES ? cals[dev] : NULL;
    double r = c ? c->ratio : 1.0;
    unlock();
    return r;
}

uint64_t gv_cal_scale(int dev, uint64_t raw)
{
    double r = gv_cal_ratio(dev);
    return r < 1.0 ? (uint64_t)((double)raw * r) : raw;
}
