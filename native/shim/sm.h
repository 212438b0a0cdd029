/*
 * sm.h - the SM-time quota: pacing (sm_gate.c), measurement (sm_meter.c),
 * policies (sm_policy.c), calibration of measured times against NVML
 * (sm_calib.c), used by the launch hooks (hooks_launch.c).
 */
#ifndef GV_SM_H
#define GV_SM_H

#include <stdatomic.h>
#include <stdint.h>

#include "core.h"
#include "region.h"

uint64_t gv_mono_ns(void);

/* Expected GPU time of a launch of key (a function or a graph), in ns. */
uint64_t gv_sm_estimate(uintptr_t key);
/* Record a measured GPU time for key. */
void gv_sm_learn(uintptr_t key, uint64_t ns);
/* What an admission tells its launch (a may be NULL): */
struct gv_sm_admission {
    void (*waiting)(void);  /* in: called once, before its first wait (or NULL) */
    uint64_t start;         /* out: the time of its first look */
    int waited;             /* out: it waited (for the clock, the turn, its launches) */
    int turn;               /* out: the turn between containers was in play */
    int alone;              /* out: the policies saw no other process working on the device */
    int holds;              /* out: it went as the holder of the turn (the device is its own) */
    int joins;              /* in: it will likely join its thread's open segment (sm_meter.c) */
    int arb;                /* out: 1: counted by the arbiter (gv_arb_admitted), to settle there */
};
/* Wait until the container may start cost_ns more of GPU work, and charge
 * it; returns the share (1/100 %) it was charged at. */
uint32_t gv_sm_admit(struct gv_sm *sm, int dev, const char *uuid, uint64_t cost_ns,
                     struct gv_sm_admission *a);
/* A launch charged charged_ns at share turned out to take actual_ns; _n:
 * n launches measured together, charged_ns their charges added up;
 * arb: how many of them the arbiter counted (gv_sm_admission's arb). */
void gv_sm_settle(struct gv_sm *sm, int dev, uint32_t share, uint64_t charged_ns, uint64_t actual_ns,
                  uint32_t arb);
void gv_sm_settle_n(struct gv_sm *sm, int dev, uint32_t share, uint64_t charged_ns,
                    uint64_t actual_ns, uint32_t n, uint32_t arb);

/* Whether a launch on region device dev waited because the container's
 * clock ran ahead (it used all of its share) since the last call. */
int gv_sm_took_held(int dev);
/* A kernel still running has taken extra_ns past what it was charged. */
void gv_sm_overrun(struct gv_sm *sm, int dev, uint32_t share, uint64_t extra_ns);
/* Who else works on the device (sets how much work this process may keep
 * in flight): a mask of other containers' processes, other processes of
 * this container, and whether the device was busy all the time lately;
 * and how many of this container's processes work on it (this one
 * included, at least 1); for region device dev.  GV_SM_NOBODY: NVML
 * showed no process running kernels there lately (GV_SM_OTHERS is set
 * with it: for the in-flight bound that is not known; a launch may still
 * open a segment, sm_meter.c).  GV_SM_KNOWN is added
 * by gv_sm_set_company (before the meter's first word, the gate assumes
 * other containers). */
enum { GV_SM_OTHERS = 1, GV_SM_MATES = 2, GV_SM_FULL = 4, GV_SM_KNOWN = 8, GV_SM_NOBODY = 16 };
void gv_sm_set_company(int dev, int company, int procs);
/* Calibration against NVML (sm_calib.c; the meter and policy threads),
 * per region device:
 *  - gv_cal_record: a measured kernel that ended at `end` (monotonic)
 *    after raw_ns;
 *  - gv_cal_since: the lastSeenTimeStamp to ask NVML's per-process
 *    utilisation with; gv_cal_update: its answer (n samples), this
 *    process's PID and the CPU (realtime) and monotonic clocks, read
 *    together;
 *  - gv_cal_scale: a measured time scaled to this process's own (the
 *    ratio, gv_cal_ratio, is applied only below 1);
 *  - gv_cal_reset: forget everything (a forked child). */
void gv_cal_record(int dev, uint64_t end, uint64_t raw_ns);
unsigned long long gv_cal_since(int dev, uint64_t real_ns);
void gv_cal_update(int dev, unsigned long long since, const nvmlProcessUtilizationSample_t *s,
                   unsigned n, unsigned me, uint64_t real_ns, uint64_t mono_ns);
double gv_cal_ratio(int dev);
uint64_t gv_cal_scale(int dev, uint64_t raw_ns);
void gv_cal_reset(void);
/* The launch order between containers on one device (sm_arbiter.c), for
 * region device dev (uuid: NVML's form, names the node-wide file):
 *  - gv_arb_check: may a launch of this process, whose container's clock
 *    stands at tat, with queued ns (count launches) of its own in flight,
 *    go now (1); should it wait for the turn (0: the wait is credited,
 *    see sm_gate.c) or for its own launches in flight (2); -1 when the
 *    turn is not in play (no node directory, no slot, no other container
 *    working on the device lately, or this process leaves the turn alone
 *    for a while after waiting too long for it).  It also says this
 *    process waits to launch;
 *  - gv_arb_admitted / gv_arb_settled: a gated launch of cost ns went /
 *    was measured;
 *  - gv_arb_alive: this process is alive (the meter, while in flight);
 *  - gv_arb_not_waiting: it no longer waits (its clock ran ahead: a turn
 *    it held is over);
 *  - gv_arb_wants: its container uses all of its share (sm_policy.c);
 *  - gv_arb_set_terms: this process's NVML PID and its container's limit
 *    and policy (the policy thread, at every update);
 *  - gv_arb_terms_of: those of the container whose process NVML shows as
 *    nvml_pid, and whether it used all of its share in the last 300 ms
 *    (1; 0 when no live slot says so). */
int gv_arb_check(int dev, const char *uuid, uint64_t tat, uint64_t now, uint64_t queued,
                 uint32_t count, uint64_t cost);
/* Whether region device dev preempts a running kernel for another
 * context's time slice (CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED;
 * devices.c, at its set-up): the turn is taken only on one that does (or
 * one that did not say); a device that runs each kernel to its end takes
 * the launch order. */
void gv_arb_set_preemption(int dev, int preempts);
void gv_arb_admitted(int dev, const char *uuid, uint64_t now, uint64_t cost);
void gv_arb_settled(int dev);
/* When gv_arb_check last looked and saw no other container working on the
 * device (gv_mono_ns); 0: its last look saw one, or none was taken. */
uint64_t gv_arb_quiet_at(int dev);
void gv_arb_settled_n(int dev, uint32_t n);   /* n launches at once (a segment's) */
void gv_arb_alive(int dev, uint64_t now);
void gv_arb_not_waiting(int dev);
/* gv_arb_holds: this process holds the turn on region device dev now. */
int gv_arb_holds(int dev);
/* gv_arb_exclusive: this process went by the turn in the last 50 ms, so
 * its events measure its own kernels only (the others drain first). */
int gv_arb_exclusive(int dev, uint64_t now);
void gv_arb_wants(int dev, uint64_t now);
struct gv_arb_terms {
    uint64_t container;     /* the container's identity on the node */
    unsigned limit;         /* its SM limit, % (0: none) */
    unsigned policy;        /* enum gv_sm_policy */
    int wants;              /* it used all of its share lately */
};
void gv_arb_set_terms(int dev, uint32_t nvml_pid, unsigned limit, unsigned policy);
int gv_arb_terms_of(int dev, uint32_t nvml_pid, uint64_t now, struct gv_arb_terms *out);
/* The smallest non-zero context cost any container measured on the GPU,
 * kept in the same node-wide file (0: none, or no node directory), and
 * lowering it to cost (hooks_context.c). */
uint64_t gv_arb_ctx_cost(int dev, const char *uuid);
void gv_arb_learn_ctx_cost(int dev, const char *uuid, uint64_t cost);
/* The node-wide enqueue word of region device dev (sm_enqueue.c), once
 * this process has mapped the device's launch-order file; else NULL. */
_Atomic uint64_t *gv_arb_enqueue_word(int dev);
/* A gated launch's begin event, kernel and end event are made between
 * these two (sm_enqueue.c): returns what to give back, never 0 (the time
 * it was taken in all but the two low bits), after at most a couple of
 * milliseconds whoever holds it or writes it. */
uint64_t gv_sm_enqueue_begin(struct gv_sm *sm, int dev);
void gv_sm_enqueue_end(struct gv_sm *sm, int dev, uint64_t held);
/* The share may be stale (0 with no pause in force): the policies run at
 * once, the meter thread woken if it sleeps (sm_meter.c); 0 when no meter
 * thread runs in this process to run them (it could not be started). */
int gv_sm_meter_refresh(void);
/* ctx is about to be destroyed (cuCtxDestroy, a primary context's reset
 * or last release): its work is waited for and the meter settles every
 * launch made in it and destroys their events while it still lives;
 * returns within about a second whatever the meter does (sm_meter.c). */
void gv_sm_ctx_destroying(CUcontext ctx);
/* A stream is being destroyed, or was (called around the driver's call):
 * what each thread remembers of streams' contexts is looked up again. */
void gv_sm_stream_destroying(void);
/* A stream capture is about to begin (hooks_capture.c, after counting
 * it): every open segment of launches is ended first (sm_meter.c), so
 * that no event is recorded later into a stream that captures. */
void gv_sm_segments_end(void);
/* The calling thread is about to wait for work (a synchronisation): its
 * open segment ends first. */
void gv_sm_syncing(void);
/* Stream captures this process has begun and not seen end
 * (hooks_capture.c): while 0, no stream captures, and a gated launch does
 * not ask the driver whether its stream does. */
extern atomic_uint gv_sm_captures;
/* Reset process-local gate state in a forked child. */
void gv_sm_fork_child(void);
/* The policies (sm_policy.c), per region device this process launches on:
 *  - gv_sm_watch: d (gated launches go to it, through sm) is to be
 *    watched from now on;
 *  - gv_sm_policies: set the share of every device watched, tell the gate
 *    who else works on it and feed the calibration (the policy thread,
 *    every 100 ms);
 *  - gv_sm_policy_reset: watch nothing (a forked child). */
void gv_sm_watch(const gv_devinfo *d, struct gv_sm *sm);
void gv_sm_policies(void);
void gv_sm_policy_reset(void);
/* The thread that runs gv_sm_policies (sm_policy_thread.c): the meter
 * says an update is due; a forked child starts its own thread. */
void gv_sm_policy_due(void);
void gv_sm_policy_thread_fork(void);

/* A launch going through the gate. */
typedef struct gv_sm_launch {
    int gated;              /* 0: launch untouched */
    struct gv_sm *sm;
    int dev;                /* region device entry */
    CUcontext ctx;
    CUstream stream;
    int ptsz;               /* per-thread default stream semantics */
    uintptr_t key;
    uint64_t est;
    uint32_t share;         /* the share the launch was charged at */
    CUevent begin, end;     /* NULL when they could not be made */
    uint64_t enqueue;       /* the enqueue word held (sm_enqueue.c); 0: none */
    void *rec;              /* the meter's pooled record begin and end came with
                             * (sm_meter.c); NULL: they were created */
    void *seg;              /* the slot of the segment this launch joins or
                             * opens (sm_meter.c); NULL: none */
    int opens;              /* 1: it opens seg (begin event, no end event) */
    uint64_t start;         /* its first look at the gate (0: it waited there) */
    uint64_t seq;           /* the segment it joins: seg's count of segments then */
    void *mine;             /* the launching thread's own (sm_meter.c), found once */
    uint32_t arb;           /* counted by the arbiter (gv_sm_admission's arb) */
} gv_sm_launch;

/* Does anything in the region gate launches now?  A few loads while nothing
 * changed since the last look (sm_gate.c, region_sm_gated). */
int gv_sm_gating(void);

/* Could any launch of this process be gated?  Two loads for a container
 * that never had an SM limit nor a yield flag (whatever its priority): the
 * fast path; a few more for one whose limit was lifted or whose yield
 * flag was cleared. */
static inline int gv_sm_maybe(void)
{
    return gv_mode_fast() == GV_MODE_ENFORCE &&
           atomic_load_explicit(gv_sm_any_flag, memory_order_relaxed) != 0 && gv_sm_gating();
}

/* Before the real launch: 1 if gated (paced, begin event recorded). */
int gv_sm_begin(gv_sm_launch *l, CUstream stream, int ptsz, uintptr_t key);
/* After the real launch. */
void gv_sm_end(gv_sm_launch *l, CUresult rc);

#endif /* GV_SM_H */
