/*
 * sm_arbiter.c - the order of launches between containers on one GPU.
 *
 * Each container paces itself with its own clock (sm_gate.c).  A real GPU
 * time-slices between contexts (one per process): while two have work,
 * each runs about 2 ms at a time and a running kernel is preempted at the
 * end of its slice.  The events around a kernel then also hold the other
 * context's slice, the container is charged for it and runs short (50:50
 * gave 40 / 50 % on an H100; the simulator's time-slicing mode, 39 / 38).
 * So, next to another container, one process at a time holds the device:
 * the turn, one word of a file per GPU in the node directory that every
 * container shares (the directory of the node lock, node_lock.c; HAMi's
 * device plugin mounts the host's /tmp/vgpulock into each container):
 *   - the holder launches by its own clock, with at most TURN_INFLIGHT_NS
 *     of estimates in flight; its turn ends when it has charged its
 *     container's limit's part of TURN_CYCLE_NS (split between its
 *     processes) while another process waits, or when its clock runs ahead;
 *     what a turn charged beyond that length is charged at the start of the
 *     process's next turn (the carry, below), so its turns average their
 *     length however long its kernels are;
 *   - a free turn goes to the waiting process whose container's clock is
 *     furthest behind (within MARGIN_NS), and only once every other
 *     process's launches are measured (the device drained), so that only
 *     one context has work on the device at a time;
 *   - a holder idle for LAPSE_NS with nothing in flight, or not heard from
 *     for FRESH_NS (killed, stopped), holds nobody;
 *   - time spent waiting for the turn is credited (sm_gate.c);
 *   - while the turn is in play (gv_arb_exclusive), each process's events
 *     hold its own kernels only, and its measured times are settled as
 *     measured, not scaled by NVML's per-process samples (sm_calib.c): on
 *     an H200 those spread by 9-21 points while processes took turns, the
 *     scaling charged each container 3-6 points under what it ran, and a
 *     30 % container's 100 ms windows swung by 18-27 % of its mean (2.6-2.8 %
 *     without it).  A process that does not take turns (no library, no
 *     limit) time-slices with the holder whatever the scaling: NVML counts
 *     a preempted kernel as busy too, so it could not correct that.
 * The simulator's time-slicing mode, make bench-sm workload, 3 s pairs,
 * share of the unlimited device: 50:50 38.9 / 37.8 -> 48.6 / 48.6, 30:70
 * 23.2 / 59.1 -> 28.7 / 69.5 (docs/benchmarks.md).  An H200, PyTorch's
 * 8192 products, three runs: 50:50 47.8-49.4 / 48.3-49.3, 30:70 28.1-29.8 /
 * 67.3-69.4 (before the turn, same sitting: 44.2 / 47.4 and 31.1 / 63.8).
 *
 * A container alone keeps its own rules (the turn is in play only while
 * another container launched on the device in the last ACTIVE_NS or waits
 * for the turn).  The turn is taken only where it fits (turn_fits: all
 * fixed-share, limits adding up to 100 % at most) and only on a device
 * that preempts a running kernel for another context's slice (every GPU
 * since Pascal says so: CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED;
 * the simulator's launch-order timeline runs each kernel to its end, its
 * events measure its own time, and there the turn only made the 100 ms
 * windows swing: pairs' sd 1.8-3.3 -> 2.9-7.9 points); elsewhere the launch
 * order of before (order_check) stands.  Whatever a neighbour writes into the file, a launch
 * waits for the turn at most TURN_WAIT_NS; then its process leaves the
 * turn alone on that device for BYPASS_NS, doubling while it goes on.
 *
 * Each slot also carries its container's terms (limit, policy, the PID
 * NVML shows for the process) and when the container last used all of its
 * share, so that lenders next to each other split the spare capacity
 * (sm_policy.c) instead of the first keeping what it took.
 *
 * Each process has a slot (claimed with CAS, no lock).  Everything it says
 * expires on its own: its in-flight count stops counting FRESH_NS after
 * its process last showed signs of life (the meter renews it every poll
 * while kernels are in flight), and a claim to be waiting WAITING_NS
 * (TURN_WAITING_NS for the turn) after it was last renewed (every poll of
 * the waiting launch).  So a process killed or stopped at any instruction
 * holds no other container for longer than that, and its slot is taken
 * over after STALE_NS.  Times are
 * CLOCK_MONOTONIC, which all containers of a node share.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "file_space.h"
#include "hooks.h"
#include "log.h"
#include "sm.h"

#define ARB_MAGIC 0x6776617262000002ULL     /* "gvarb", layout version 2 (the turn) */
#define ARB_SLOTS 128
#define MARGIN_NS (500ULL * 1000)
/* Without the turn (below): at most DEPTH gated launches in flight on the
 * device over all containers, and a container more than BEHIND_NS behind
 * its share does not wait (sm_gate.c's mark). */
#define DEPTH 3u
#define BEHIND_NS (5ULL * 1000 * 1000)
#define FRESH_NS (20ULL * 1000 * 1000)
#define WAITING_NS (300ULL * 1000)
/* A claim to wait for the turn lasts longer: a waiting launch renews it
 * every ARB_POLL_NS (sm_gate.c), but on a loaded machine its thread often
 * waits longer than WAITING_NS for a CPU, and the holder then kept its
 * turn past TURN_NS or took it again at once (traced, 50:50 time-sliced,
 * load 11: 34 of 546 turns taken again with nobody waiting; 1 of 496 with
 * 2 ms), which makes turns, and so each 100 ms window's split, coarser.
 * A waiter killed holds the others at most this long. */
#define TURN_WAITING_NS (2ULL * 1000 * 1000)
#define ACTIVE_NS (50ULL * 1000 * 1000)
#define STALE_NS (1000ULL * 1000 * 1000)
#define WANTS_NS (300ULL * 1000 * 1000)   /* "used all its share" lasts this long */
/* The turn: */
/* Estimated GPU time a holder charges while others wait: its container's
 * limit's part of a cycle of TURN_CYCLE_NS, split between the container's
 * processes in play (50:50 -> 10 + 10 ms; 10:90 -> 2 + 18; 20:30:50 -> 4 +
 * 6 + 10), at least TURN_MIN_NS; TURN_NS where the limit is not said.
 *
 * Why 20 ms: every turn costs the device a context switch and the drain of
 * the last holder's kernels, about 0.3 ms on an H200 (the meters' total
 * fell 3-6 points short of the wall time), and the side that fills the
 * device loses it.  With a 10 ms cycle an H200 (PyTorch's 8192 products,
 * 1.65 ms each) gave 30:70 29.5-30.0 / 66.2-66.6 and 10:90 10.1-10.2 /
 * 86.9-87.4 (share of one unlimited process's throughput); with 20 ms,
 * 29.3-29.5 / 68.1-68.5 and 10.0-10.1 / 88.4-88.8, 50:50 48.7-48.8 each
 * (48.0-48.2): every side within 2 points.  The price: a small container's
 * 100 ms windows are coarser (a 10 % one's sd 9.3-9.9 % of its mean
 * instead of 3.4-4.6, a 30 % one's 5.6-6.4 instead of 4.8-5.2; 50:50 3.5-4.4
 * either way), a launch may wait up to 18 ms for its turn next to a 90 %
 * container (9 before), and the simulator's make bench-sm pairs' window sd
 * rose by 0.2-1.5 points (docs/benchmarks.md, "Fourth sitting").  A
 * 15 ms cycle was worse than either (a 30 % container's windows 7.2-8.0 %,
 * 10:90's 90 at 87.3).
 *
 * Before that (the simulator, where a handover costs less): turns of
 * 10 ms for every share made the split of 100 ms windows coarse: a perfect
 * turn-taker on make bench-sm's workload (kernels of 20 us - 5 ms, whole
 * kernels per turn, the furthest behind next) has window sd 3.6-4.4 points
 * with them and 1.5-2.4 with this cycle (tests/bench/sm_floor.py --turns).
 * The simulator's time-slicing mode, 12 sittings before and after, load
 * 3-13, split part of the window sd (docs/benchmarks.md): 10:90 2.4 -> 2.1,
 * 20:30:50 3.2 / 3.4 / 3.9 -> 2.7 / 2.9 / 3.2, 50 x 2 : 50 4.0 -> 3.1,
 * 30:70 and 50:50 alike (3.4-3.7); twice the handovers cost up to a point
 * of the total.  A 20 ms cycle helped less there (10:90 worse). */
#define TURN_NS (10ULL * 1000 * 1000)
#define TURN_CYCLE_NS (20ULL * 1000 * 1000)
#define TURN_MIN_NS (1ULL * 1000 * 1000)
/* The carry: a turn ends at the first launch after the holder charged its
 * length, so whole kernels round every turn up (1.65 ms kernels at 30:70:
 * 3.3 ms turns for 3, 8.25 for 7, the 30 % container got 28.6 % of the
 * work).  What a turn that ended so (others waiting) charged beyond its
 * length, at most one length, is charged at the start of the process's
 * next turn, which then ends that much sooner; every turn still admits at
 * least one launch.  What a holder charges past its length while nobody
 * waits is not carried (it took nobody's time; its own clock counts it),
 * and a turn that ends otherwise carries nothing: the holder lapsed idle
 * or its clock ran ahead (gv_arb_not_waiting; its clock holds it back
 * already) before it charged its length with others waiting; the carry it
 * opened with was spent in that turn.  The turn going out of play (a
 * container alone, or not a case for the turn) drops a carry, and one not
 * used within ACTIVE_NS of its turn's end is forgotten (the turn was not
 * in play for a while, the neighbours may be others).  Process-private,
 * per device; a forked child starts without. */
/* What a holder keeps in flight (estimates): 4 ms, the model's value, left
 * the device idle while a holder's launching thread waited for a CPU
 * (Python workers on a loaded 2-core machine: 45 / 46 at 50:50, 47 / 47
 * with 8 ms). */
#define TURN_INFLIGHT_NS (8ULL * 1000 * 1000)
#define LAPSE_NS (200ULL * 1000)          /* a holder idle this long, nothing in flight, lets go */
/* The most a launch waits for the turn; then this process leaves the turn
 * alone on that device for BYPASS_NS, twice as long at each bound hit
 * within BYPASS_MAX_NS of the last, up to BYPASS_MAX_NS. */
#define TURN_WAIT_NS (150ULL * 1000 * 1000)
#define BYPASS_NS (250ULL * 1000 * 1000)
#define BYPASS_MAX_NS (8000ULL * 1000 * 1000)
#define IDX_MASK 0xffULL

struct arb_slot {
    _Atomic uint64_t owner;         /* the owning process's token; 0: free */
    _Atomic uint64_t container;     /* which container (its region file) */
    _Atomic uint64_t beat;          /* last sign of life */
    _Atomic uint64_t tat;           /* its container's clock, while waiting */
    _Atomic uint64_t wait_at;       /* when it last said it is waiting; 0: not */
    _Atomic uint64_t launched_at;   /* its last gated launch */
    _Atomic uint32_t inflight;      /* its gated launches not yet measured */
    /* Its container's terms, for the lenders' split (sm_policy.c): the
     * PID NVML shows for the process | limit % << 22 | policy << 29; 0: not
     * said (a library before this word left it 0).  Set by the policy
     * thread (sm_policy_thread.c). */
    _Atomic uint32_t terms;
    /* When its process last found its container using all of its share
     * (sm_policy.c); 0: never. */
    _Atomic uint64_t wants_at;
};

struct arb_file {
    _Atomic uint64_t magic;
    _Atomic uint32_t used;          /* slots [0, used) were ever claimed */
    uint32_t pad0;
    /* The enqueue word of every container on the GPU (sm_enqueue.c); a
     * library without it left this word 0 and never reads it. */
    _Atomic uint64_t enqueue;
    /* The smallest non-zero context cost any container measured on the GPU
     * (hooks_context.c), for a container that has measured none yet; 0
     * while none did (a library before this word never writes it). */
    _Atomic uint64_t ctx_cost;
    /* The turn: who holds the device, (owner token & ~IDX_MASK) | slot
     * index; 0: nobody.  Changed by CAS (layout version 2). */
    _Atomic uint64_t turn;
    uint64_t pad[3];
    struct arb_slot slot[ARB_SLOTS];
};

enum { UNTRIED, OPENING, MAPPED, NONE };

static struct arb_dev {
    _Atomic int state;
    struct arb_file *f;
    _Atomic(struct arb_slot *) me;  /* NULL: no slot (yet) */
    /* This process's side of the turn (process-private): */
    _Atomic uint64_t charged;       /* estimated GPU time charged in its turn */
    _Atomic uint64_t carry;         /* its last turn's overshoot, for its next (TURN_MIN_NS's note) */
    _Atomic uint64_t carry_at;      /* when that turn ended */
    _Atomic uint64_t wait_since;    /* when its launches began to wait for the turn; 0: not */
    _Atomic uint64_t bypass_until;  /* leaves the turn alone until then */
    _Atomic uint64_t bypass_len;    /* the last bypass's length */
    _Atomic int in_order;           /* the device runs each kernel to its end: no turn */
    _Atomic uint64_t quiet_at;      /* when gv_arb_check last saw no other container; 0: it saw one */
    _Atomic uint64_t turn_at;       /* when gv_arb_check last went by the turn */
} arbs[GV_MAX_DEVICES];

static _Atomic uint64_t token;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* A token no other process on the node uses at the same time. */
static uint64_t my_token(void)
{
    uint64_t t = atomic_load(&token);
    if (!t) {
        t = gv_node_mix(gv_node_mix((uint64_t)getpid(), gv_mono_ns()), (uint64_t)(uintptr_t)&t) | 1;
        atomic_store(&token, t);
    }
    return t;
}

static void fork_child(void)
{
    /* The child keeps the mappings but not its parent's slots; a mapping
     * another thread was making when it forked is made again. */
    atomic_store(&token, 0);
    for (int i = 0; i < GV_MAX_DEVICES; i++) {
        atomic_store(&arbs[i].me, NULL);
        atomic_store(&arbs[i].charged, 0);
        atomic_store(&arbs[i].carry, 0);
        atomic_store(&arbs[i].wait_since, 0);
        atomic_store(&arbs[i].quiet_at, 0);
        atomic_store(&arbs[i].turn_at, 0);
        int opening = OPENING;
        atomic_compare_exchange_strong(&arbs[i].state, &opening, UNTRIED);
    }
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, fork_child); }

/* This process's slot for dev, if it still owns it (one silent for over
 * STALE_NS may have been taken over: what it says then is not its own). */
static struct arb_slot *mine(int dev)
{
    if (dev < 0 || dev >= GV_MAX_DEVICES)
        return NULL;
    /* Acquire: the slot lies in a mapping another thread may have made
     * (the meter and policy threads read it; a launching thread mapped
     * it). */
    struct arb_slot *s = atomic_load_explicit(&arbs[dev].me, memory_order_acquire);
    if (!s || atomic_load_explicit(&s->owner, memory_order_relaxed) !=
                  atomic_load_explicit(&token, memory_order_relaxed))
        return NULL;
    return s;
}

/* At exit: the slots go back (claim resets what they held). */
__attribute__((destructor)) static void release_slots(void)
{
    uint64_t t = atomic_load(&token);
    for (int i = 0; t && i < GV_MAX_DEVICES; i++) {
        struct arb_slot *s = atomic_load(&arbs[i].me);
        if (!s)
            continue;
        uint64_t held = (t & ~IDX_MASK) | (uint64_t)(s - arbs[i].f->slot);
        atomic_compare_exchange_strong(&arbs[i].f->turn, &held, 0);
        uint64_t o = t;
        atomic_compare_exchange_strong(&s->owner, &o, 0);
    }
}

static gv_node_file arb_node_file = {
    .kind = "sm", .what = "launch-order",
    .lost = "launches on this GPU are not ordered with other containers' and no context "
            "cost is shared, so a first context is created unreserved",
};

/* A slot whose owner has not been heard from for STALE_NS is free to take
 * over; so is one whose beat is far in the future: written before a reboot
 * (the file may outlive it, CLOCK_MONOTONIC does not). */
static int stale(uint64_t beat, uint64_t now)
{
    return beat + STALE_NS <= now || beat > now + STALE_NS;
}

/* Whether a slot's word counts now: heard from within FRESH_NS. */
static int fresh(uint64_t beat, uint64_t now)
{
    return beat + FRESH_NS >= now && beat <= now + STALE_NS;
}

static struct arb_slot *claim(struct arb_file *f, uint64_t now)
{
    uint64_t me = my_token(), who = gv_node_container();
    if (!who)
        return NULL;
    for (int i = 0; i < ARB_SLOTS; i++) {
        struct arb_slot *s = &f->slot[i];
        uint64_t o = atomic_load(&s->owner);
        uint64_t b = atomic_load(&s->beat);
        if (o && !stale(b, now))
            continue;
        /* The beat first, so that nobody else sees a stale slot stale from
         * then on; then the owner, which one claimer alone can move from
         * what it saw (two may both move a free slot's beat). */
        if (!atomic_compare_exchange_strong(&s->beat, &b, now) ||
            !atomic_compare_exchange_strong(&s->owner, &o, me))
            continue;
        atomic_store(&s->inflight, 0);
        atomic_store(&s->wait_at, 0);
        atomic_store(&s->launched_at, 0);
        atomic_store(&s->terms, 0);
        atomic_store(&s->wants_at, 0);
        atomic_store(&s->container, who);
        uint32_t used = atomic_load(&f->used);
        while (used < (uint32_t)i + 1 &&
               !atomic_compare_exchange_weak(&f->used, &used, (uint32_t)i + 1))
            ;
        return s;
    }
    return NULL;
}

/* The node-wide file of region device dev (mapped at the first call), or
 * NULL: no node directory, or another thread is mapping it right now. */
static struct arb_file *file_for(int dev, const char *uuid)
{
    if (dev < 0 || dev >= GV_MAX_DEVICES)
        return NULL;
    struct arb_dev *a = &arbs[dev];
    int st = atomic_load_explicit(&a->state, memory_order_acquire);
    if (st == UNTRIED) {
        pthread_once(&atfork_once, register_atfork);
        if (!atomic_compare_exchange_strong(&a->state, &st, OPENING))
            return NULL;
        a->f = gv_node_file_map(&arb_node_file, uuid, ARB_MAGIC, sizeof(struct arb_file),
                                NULL);
        atomic_store_explicit(&a->state, a->f ? MAPPED : NONE, memory_order_release);
        st = a->f ? MAPPED : NONE;
    }
    return st == MAPPED ? a->f : NULL;
}

/* This process's slot for region device dev, or NULL. */
static struct arb_slot *slot_for(int dev, const char *uuid, uint64_t now)
{
    if (!file_for(dev, uuid))
        return NULL;
    struct arb_dev *a = &arbs[dev];
    struct arb_slot *s = atomic_load(&a->me);
    /* Taken over while this process was idle for over STALE_NS: another. */
    if (s && atomic_load_explicit(&s->owner, memory_order_relaxed) != my_token())
        s = NULL;
    if (!s) {
        s = claim(a->f, now);
        atomic_store(&a->me, s);
    }
    return s;
}

/* The turn word this process's slot me stands for. */
static uint64_t turn_word(struct arb_file *f, struct arb_slot *me)
{
    return (my_token() & ~IDX_MASK) | (uint64_t)(me - f->slot);
}

/* Whether the turn word t names a holder that still holds the device: its
 * slot is owned by the process it names, heard from within FRESH_NS, and
 * it has launches in flight or launched within LAPSE_NS. */
static int holding(struct arb_file *f, uint64_t t, uint64_t now)
{
    uint64_t i = t & IDX_MASK;
    if (!t || i >= ARB_SLOTS)
        return 0;
    struct arb_slot *s = &f->slot[i];
    uint64_t o = atomic_load_explicit(&s->owner, memory_order_relaxed);
    if (!o || (o & ~IDX_MASK) != (t & ~IDX_MASK) ||
        !fresh(atomic_load_explicit(&s->beat, memory_order_relaxed), now))
        return 0;
    if (atomic_load_explicit(&s->inflight, memory_order_relaxed))
        return 1;
    uint64_t l = atomic_load_explicit(&s->launched_at, memory_order_relaxed);
    return l + LAPSE_NS >= now && l <= now + STALE_NS;
}

/* A launch waits for the turn (the answer 0); past TURN_WAIT_NS of waiting
 * this process leaves the turn alone for a while (-1): whatever a
 * neighbour writes into the node's file, it holds this process's launches
 * at most that long per bypass, the bypasses doubling while it goes on. */
static int wait_turn(struct arb_dev *a, struct arb_slot *me, uint64_t tat, uint64_t now)
{
    atomic_store_explicit(&me->tat, tat, memory_order_relaxed);
    atomic_store_explicit(&me->wait_at, now, memory_order_relaxed);
    uint64_t since = atomic_load_explicit(&a->wait_since, memory_order_relaxed);
    if (!since) {
        atomic_store_explicit(&a->wait_since, now, memory_order_relaxed);
        return 0;
    }
    if (now < since + TURN_WAIT_NS)
        return 0;
    uint64_t until = atomic_load_explicit(&a->bypass_until, memory_order_relaxed);
    uint64_t len = atomic_load_explicit(&a->bypass_len, memory_order_relaxed);
    len = until && now < until + BYPASS_MAX_NS && len ? len * 2 : BYPASS_NS;
    len = len < BYPASS_MAX_NS ? len : BYPASS_MAX_NS;
    atomic_store_explicit(&a->bypass_len, len, memory_order_relaxed);
    atomic_store_explicit(&a->bypass_until, now + len, memory_order_relaxed);
    atomic_store_explicit(&a->wait_since, 0, memory_order_relaxed);
    atomic_store_explicit(&me->wait_at, 0, memory_order_relaxed);
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gv_log(GV_LOG_WARN, "a launch waited %llu ms for its turn on the GPU; this process "
               "takes no turns there for %llu ms (a process that holds the turn and does not "
               "let go, or a node-wide file written by something else)",
               (unsigned long long)(TURN_WAIT_NS / 1000000), (unsigned long long)(len / 1000000));
    return -1;
}

/* Whether the turn fits the containers in play: every live slot says its
 * container's terms, all fixed-share, and their limits add up to at most
 * 100 %.  The turn's order (furthest behind first) splits an oversubscribed
 * device in proportion to the limits (30 % next to 100 % got 23 %), and a
 * burst-share or best-effort container's share moves with the others'
 * use; those keep the launch order below, under which a container behind
 * its share goes by its own rules (its guarantee holds: 30 next to 100). */
static int turn_fits(struct arb_file *f, uint32_t used, uint64_t now)
{
    unsigned sum = 0;
    for (uint32_t i = 0; i < used && i < ARB_SLOTS; i++) {
        struct arb_slot *s = &f->slot[i];
        if (!atomic_load_explicit(&s->owner, memory_order_relaxed) ||
            !fresh(atomic_load_explicit(&s->beat, memory_order_relaxed), now))
            continue;
        uint32_t t = atomic_load_explicit(&s->terms, memory_order_relaxed);
        if (!t || (t >> 29) != GV_SM_FIXED)
            return 0;
        uint64_t c = atomic_load_explicit(&s->container, memory_order_relaxed);
        int seen = 0;               /* counted at an earlier slot of its container */
        for (uint32_t j = 0; j < i && !seen; j++)
            seen = atomic_load_explicit(&f->slot[j].container, memory_order_relaxed) == c &&
                   atomic_load_explicit(&f->slot[j].owner, memory_order_relaxed) &&
                   fresh(atomic_load_explicit(&f->slot[j].beat, memory_order_relaxed), now);
        if (!seen)
            sum += t >> 22 & 0x7f;
    }
    return sum <= 100;
}

/* How long this process's turns are (TURN_NS's note). */
static uint64_t turn_len(struct arb_file *f, struct arb_slot *me, uint32_t used, uint64_t now)
{
    uint32_t t = atomic_load_explicit(&me->terms, memory_order_relaxed);
    uint64_t limit = t >> 22 & 0x7f;
    if (!t || !limit)
        return TURN_NS;
    uint64_t who = atomic_load_explicit(&me->container, memory_order_relaxed);
    uint64_t procs = 1;             /* this container's processes in play, itself too */
    for (uint32_t i = 0; i < used && i < ARB_SLOTS; i++) {
        struct arb_slot *s = &f->slot[i];
        if (s == me || atomic_load_explicit(&s->container, memory_order_relaxed) != who ||
            !atomic_load_explicit(&s->owner, memory_order_relaxed) ||
            !fresh(atomic_load_explicit(&s->beat, memory_order_relaxed), now))
            continue;
        if (atomic_load_explicit(&s->wait_at, memory_order_relaxed) + TURN_WAITING_NS >= now ||
            atomic_load_explicit(&s->launched_at, memory_order_relaxed) + ACTIVE_NS >= now)
            procs++;
    }
    uint64_t len = TURN_CYCLE_NS * limit / 100 / procs;
    return len > TURN_MIN_NS ? len : TURN_MIN_NS;
}

/* The launch order without the turn: wait (2) while DEPTH gated launches
 * are in flight over all containers, or while another container waiting to
 * launch has a clock more than MARGIN_NS behind this one's; not at all
 * (-1) once this container is BEHIND_NS behind its share. */
static int order_check(struct arb_file *f, struct arb_slot *me, uint64_t tat, uint64_t now)
{
    if (tat + BEHIND_NS <= now) {
        atomic_store_explicit(&me->wait_at, 0, memory_order_relaxed);
        return -1;
    }
    atomic_store_explicit(&me->tat, tat, memory_order_relaxed);
    atomic_store_explicit(&me->wait_at, now, memory_order_relaxed);
    uint64_t who = atomic_load_explicit(&me->container, memory_order_relaxed);
    uint32_t total = 0;
    uint64_t first = UINT64_MAX;
    uint32_t used = atomic_load_explicit(&f->used, memory_order_relaxed);
    for (uint32_t i = 0; i < used && i < ARB_SLOTS; i++) {
        struct arb_slot *s = &f->slot[i];
        if (!atomic_load_explicit(&s->owner, memory_order_relaxed) ||
            !fresh(atomic_load_explicit(&s->beat, memory_order_relaxed), now))
            continue;
        uint32_t n = atomic_load_explicit(&s->inflight, memory_order_relaxed);
        total += n < DEPTH ? n : DEPTH;
        if (atomic_load_explicit(&s->container, memory_order_relaxed) == who)
            continue;
        if (atomic_load_explicit(&s->wait_at, memory_order_relaxed) + WAITING_NS >= now) {
            uint64_t t = atomic_load_explicit(&s->tat, memory_order_relaxed);
            first = t < first ? t : first;
        }
    }
    if (total >= DEPTH)
        return 2;
    return first == UINT64_MAX || tat <= first + MARGIN_NS ? 1 : 2;
}

/* This process's turns on a device leave nothing to carry. */
static void no_carry(struct arb_dev *a)
{
    if (atomic_load_explicit(&a->carry, memory_order_relaxed))
        atomic_store_explicit(&a->carry, 0, memory_order_relaxed);
}

int gv_arb_check(int dev, const char *uuid, uint64_t tat, uint64_t now, uint64_t queued,
                 uint32_t count, uint64_t cost)
{
    struct arb_slot *me = slot_for(dev, uuid, now);
    if (!me) {
        /* No slot (no launch-order file, no container name, all taken):
         * nobody to see, nobody sees this process. */
        if (dev >= 0 && dev < GV_MAX_DEVICES &&
            atomic_load_explicit(&arbs[dev].quiet_at, memory_order_relaxed) != now)
            atomic_store_explicit(&arbs[dev].quiet_at, now, memory_order_relaxed);
        return -1;
    }
    struct arb_dev *a = &arbs[dev];
    struct arb_file *f = a->f;
    atomic_store_explicit(&me->beat, now, memory_order_relaxed);
    if (now < atomic_load_explicit(&a->bypass_until, memory_order_relaxed))
        return -1;
    uint64_t who = atomic_load_explicit(&me->container, memory_order_relaxed);
    int others = 0;                 /* another container works on the device */
    uint32_t elsewhere = 0;         /* launches other processes have in flight */
    uint64_t first = UINT64_MAX;    /* the least advanced clock waiting elsewhere */
    uint32_t used = atomic_load_explicit(&f->used, memory_order_relaxed);
    for (uint32_t i = 0; i < used && i < ARB_SLOTS; i++) {
        struct arb_slot *s = &f->slot[i];
        if (s == me || !atomic_load_explicit(&s->owner, memory_order_relaxed) ||
            !fresh(atomic_load_explicit(&s->beat, memory_order_relaxed), now))
            continue;
        elsewhere += atomic_load_explicit(&s->inflight, memory_order_relaxed);
        int waiting = atomic_load_explicit(&s->wait_at, memory_order_relaxed) + TURN_WAITING_NS >= now;
        if (waiting) {
            uint64_t t = atomic_load_explicit(&s->tat, memory_order_relaxed);
            first = t < first ? t : first;
        }
        if (atomic_load_explicit(&s->container, memory_order_relaxed) != who &&
            (waiting || atomic_load_explicit(&s->launched_at, memory_order_relaxed) + ACTIVE_NS >= now))
            others = 1;
    }
    uint64_t mine = turn_word(f, me);
    uint64_t t = atomic_load(&f->turn);
    /* For gv_arb_quiet_at: a look that saw another container, then one
     * that saw none. */
    if (atomic_load_explicit(&a->quiet_at, memory_order_relaxed) != (others ? 0 : now))
        atomic_store_explicit(&a->quiet_at, others ? 0 : now, memory_order_relaxed);
    if (others && (atomic_load_explicit(&a->in_order, memory_order_relaxed) ||
                   !turn_fits(f, used, now))) {
        /* Not a case for the turn: a turn this process held goes back. */
        atomic_store_explicit(&a->wait_since, 0, memory_order_relaxed);
        no_carry(a);
        if (t == mine)
            atomic_compare_exchange_strong(&f->turn, &t, 0);
        return order_check(f, me, tat, now);
    }
    if (!others) {
        /* A container alone: its own rules.  A turn it held goes back. */
        atomic_store_explicit(&me->wait_at, 0, memory_order_relaxed);
        atomic_store_explicit(&a->wait_since, 0, memory_order_relaxed);
        no_carry(a);
        if (t == mine)
            atomic_compare_exchange_strong(&f->turn, &t, 0);
        return -1;
    }
    if (atomic_load_explicit(&a->turn_at, memory_order_relaxed) != now)
        atomic_store_explicit(&a->turn_at, now, memory_order_relaxed);
    if (t == mine) {
        uint64_t charged = atomic_load_explicit(&a->charged, memory_order_relaxed);
        uint64_t len = charged >= TURN_MIN_NS ? turn_len(f, me, used, now) : TURN_MIN_NS;
        if (first != UINT64_MAX && charged >= len) {
            /* The turn is over: given back; the next holder waits until
             * this process's launches are measured (drained).  What it
             * charged beyond its length opens its next turn (the carry). */
            uint64_t over = charged - len;
            atomic_store_explicit(&a->carry, over < len ? over : len, memory_order_relaxed);
            atomic_store_explicit(&a->carry_at, now, memory_order_relaxed);
            atomic_store_explicit(&a->charged, 0, memory_order_relaxed);
            atomic_compare_exchange_strong(&f->turn, &t, 0);
            t = 0;
        } else {
            /* Past its length with nobody waiting: not carried. */
            if (charged > len)
                atomic_store_explicit(&a->charged, len, memory_order_relaxed);
            atomic_store_explicit(&me->wait_at, 0, memory_order_relaxed);
            atomic_store_explicit(&a->wait_since, 0, memory_order_relaxed);
            return count >= 2 && queued + cost > TURN_INFLIGHT_NS ? 2 : 1;
        }
    }
    if (t && holding(f, t, now))
        return wait_turn(a, me, tat, now);
    /* Free (or its holder lapsed, died or stopped): taken by the process
     * furthest behind its share, once the device has drained. */
    if ((first != UINT64_MAX && tat > first + MARGIN_NS) || elsewhere)
        return wait_turn(a, me, tat, now);
    atomic_store_explicit(&me->launched_at, now, memory_order_relaxed);
    if (!atomic_compare_exchange_strong(&f->turn, &t, mine))
        return wait_turn(a, me, tat, now);
    /* The turn opens with its last one's overshoot, if that ended lately. */
    uint64_t carry = atomic_exchange_explicit(&a->carry, 0, memory_order_relaxed);
    if (carry && atomic_load_explicit(&a->carry_at, memory_order_relaxed) + ACTIVE_NS < now)
        carry = 0;
    atomic_store_explicit(&a->charged, carry, memory_order_relaxed);
    atomic_store_explicit(&me->wait_at, 0, memory_order_relaxed);
    atomic_store_explicit(&a->wait_since, 0, memory_order_relaxed);
    return count >= 2 && queued + cost > TURN_INFLIGHT_NS ? 2 : 1;
}

int gv_arb_holds(int dev)
{
    struct arb_slot *s = mine(dev);
    if (!s)
        return 0;
    struct arb_file *f = arbs[dev].f;
    return atomic_load_explicit(&f->turn, memory_order_relaxed) == turn_word(f, s);
}

int gv_arb_exclusive(int dev, uint64_t now)
{
    if (dev < 0 || dev >= GV_MAX_DEVICES)
        return 0;
    uint64_t turn = atomic_load_explicit(&arbs[dev].turn_at, memory_order_relaxed);
    return turn && turn <= now + STALE_NS && turn + ACTIVE_NS >= now;
}

void gv_arb_set_preemption(int dev, int preempts)
{
    if (dev >= 0 && dev < GV_MAX_DEVICES)
        atomic_store_explicit(&arbs[dev].in_order, !preempts, memory_order_relaxed);
}

void gv_arb_admitted(int dev, const char *uuid, uint64_t now, uint64_t cost)
{
    struct arb_slot *s = slot_for(dev, uuid, now);
    if (!s)
        return;
    atomic_fetch_add_explicit(&s->inflight, 1, memory_order_relaxed);
    atomic_store_explicit(&s->wait_at, 0, memory_order_relaxed);
    atomic_store_explicit(&s->launched_at, now, memory_order_relaxed);
    atomic_store_explicit(&s->beat, now, memory_order_relaxed);
    atomic_fetch_add_explicit(&arbs[dev].charged, cost, memory_order_relaxed);
}

uint64_t gv_arb_quiet_at(int dev)
{
    if (dev < 0 || dev >= GV_MAX_DEVICES)
        return 0;
    return atomic_load_explicit(&arbs[dev].quiet_at, memory_order_relaxed);
}

void gv_arb_settled(int dev)
{
    gv_arb_settled_n(dev, 1);
}

void gv_arb_settled_n(int dev, uint32_t k)
{
    struct arb_slot *s = mine(dev);
    if (!s || !k)
        return;
    uint32_t n = atomic_load(&s->inflight);
    while (n && !atomic_compare_exchange_weak(&s->inflight, &n, n > k ? n - k : 0))
        ;
}

void gv_arb_alive(int dev, uint64_t now)
{
    struct arb_slot *s = mine(dev);
    if (s)
        atomic_store_explicit(&s->beat, now, memory_order_relaxed);
}

void gv_arb_not_waiting(int dev)
{
    struct arb_slot *s = mine(dev);
    if (!s)
        return;
    atomic_store_explicit(&s->wait_at, 0, memory_order_relaxed);
    atomic_store_explicit(&arbs[dev].wait_since, 0, memory_order_relaxed);
    /* Its clock ran ahead: a turn it held is over. */
    struct arb_file *f = arbs[dev].f;
    uint64_t t = turn_word(f, s);
    if (atomic_load_explicit(&f->turn, memory_order_relaxed) == t) {
        atomic_store_explicit(&arbs[dev].charged, 0, memory_order_relaxed);
        atomic_compare_exchange_strong(&f->turn, &t, 0);
    }
}

void gv_arb_wants(int dev, uint64_t now)
{
    struct arb_slot *s = mine(dev);
    if (s)
        atomic_store_explicit(&s->wants_at, now, memory_order_relaxed);
}

#define TERMS_PID_MASK ((1u << 22) - 1)

void gv_arb_set_terms(int dev, uint32_t nvml_pid, unsigned limit, unsigned policy)
{
    struct arb_slot *s = mine(dev);
    if (!s || nvml_pid == 0 || nvml_pid > TERMS_PID_MASK || limit > 100 || policy > 3)
        return;
    uint32_t t = nvml_pid | (uint32_t)limit << 22 | (uint32_t)policy << 29;
    if (atomic_load_explicit(&s->terms, memory_order_relaxed) != t)
        atomic_store_explicit(&s->terms, t, memory_order_relaxed);
}

int gv_arb_terms_of(int dev, uint32_t nvml_pid, uint64_t now, struct gv_arb_terms *out)
{
    if (dev < 0 || dev >= GV_MAX_DEVICES || nvml_pid == 0 ||
        atomic_load_explicit(&arbs[dev].state, memory_order_acquire) != MAPPED)
        return 0;
    struct arb_file *f = arbs[dev].f;
    uint32_t used = atomic_load_explicit(&f->used, memory_order_relaxed);
    for (uint32_t i = 0; i < used && i < ARB_SLOTS; i++) {
        struct arb_slot *s = &f->slot[i];
        uint32_t t = atomic_load_explicit(&s->terms, memory_order_relaxed);
        if ((t & TERMS_PID_MASK) != nvml_pid || !atomic_load_explicit(&s->owner, memory_order_relaxed) ||
            stale(atomic_load_explicit(&s->beat, memory_order_relaxed), now))
            continue;
        out->container = atomic_load_explicit(&s->container, memory_order_relaxed);
        out->limit = t >> 22 & 0x7f;
        out->policy = t >> 29;
        uint64_t held = 0;
        /* Whether any process of that container used all of its share lately. */
        for (uint32_t j = 0; j < used && j < ARB_SLOTS; j++) {
            struct arb_slot *m = &f->slot[j];
            if (atomic_load_explicit(&m->container, memory_order_relaxed) != out->container ||
                !atomic_load_explicit(&m->owner, memory_order_relaxed))
                continue;
            uint64_t h = atomic_load_explicit(&m->wants_at, memory_order_relaxed);
            held = h > held ? h : held;
        }
        out->wants = held && held <= now + STALE_NS && held + WANTS_NS >= now;
        return 1;
    }
    return 0;
}

_Atomic uint64_t *gv_arb_enqueue_word(int dev)
{
    if (dev < 0 || dev >= GV_MAX_DEVICES ||
        atomic_load_explicit(&arbs[dev].state, memory_order_acquire) != MAPPED)
        return NULL;
    return &arbs[dev].f->enqueue;
}

uint64_t gv_arb_ctx_cost(int dev, const char *uuid)
{
    struct arb_file *f = file_for(dev, uuid);
    return f ? atomic_load_explicit(&f->ctx_cost, memory_order_relaxed) : 0;
}

void gv_arb_learn_ctx_cost(int dev, const char *uuid, uint64_t cost)
{
    struct arb_file *f = file_for(dev, uuid);
    if (!f || cost == 0)
        return;
    uint64_t old = atomic_load(&f->ctx_cost);
    while ((old == 0 || cost < old) && !atomic_compare_exchange_weak(&f->ctx_cost, &old, cost))
        ;
}
