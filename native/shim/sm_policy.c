/*
 * sm_policy.c - the share the SM gate enforces, from the container's policy.
 *
 * Every 100 ms while anything in the region gates launches, the policy
 * thread (sm_policy_thread.c, when the meter in sm_meter.c says) sets the
 * share the gate (sm_gate.c) enforces:
 *   fixed-share  the limit, even when the GPU is idle;
 *   burst-share  the limit, or what the other containers leave (minus 10 %)
 *                when that is more;
 *   best-effort  what the other containers leave (minus 10 %), at least 1 %;
 * next to other containers that use all of their share (their slots in
 * the launch-order file say so), the lenders split the spare capacity in
 * proportion to their limits instead (split_share);
 * and 0 (paused) while the region's yield flag is set (a higher-priority
 * container is active; set by the supervisor, as a lease it renews: the
 * pause ends by itself when the lease does), with or without a limit: a
 * container without a limit is gated only while its flag is set (at 0 %,
 * or 100 % once the lease ended), and goes back to the fast path when the
 * flag is cleared or, the lease ended, at its next launch.  "The
 * other containers' use" is NVML's per-process utilisation over the last
 * 300 ms of every process that is not registered in this container's
 * region, or the node agent's figure for the other containers (passed on by
 * the supervisor) when that is larger and fresh, so lent capacity comes back
 * within a few hundred milliseconds once another container works.  While
 * that use cannot be read (no NVML, or its per-process query fails with
 * anything but "no samples"), nothing is lent: the share is the limit.  The
 * same update hands NVML's per-process samples to the calibration
 * (sm_calib.c) and tells the gate who else works on the device.
 */
#include <stdatomic.h>
#include <time.h>

#include "log.h"
#include "sm.h"

#define OTHERS_ACTIVE 300                   /* 3 %: someone else is working */
#define MARGIN 1000                         /* 10 % kept free for the others */
#define RECENT_US 300000ULL                 /* window for the others' use */
#define AGENT_FRESH_NS (2ULL * 1000000000ULL) /* the agent's figure counts this long */
#define OTHERS_RISE 500                     /* 5 %: the others want more */
#define LEND_STEP 1000                      /* lend back 10 % more per update */
#define FULL_USE 9900                       /* 99 %: the device has no idle time */
#define WANT_SLACK 500                      /* using "all of its share": within 5 %, */
#define WANT_SLACK_PART 5                   /* or a fifth of the share if more */
/* NVML's window of a process's use reaches back RECENT_US and a sample
 * period more (a real GPU samples about every 200 ms) */
#define WAS_WINDOW_NS ((RECENT_US + 200000ULL) * 1000ULL)
#define WAS_KEPT 8                          /* shares kept for it (updates) */

/* Devices this process has gated launches on, for the policy updates. */
static struct watched {
    _Atomic(const gv_devinfo *) info;
    struct gv_sm *sm;
    nvmlDevice_t nvml;
    int have_nvml;
    uint64_t others_before;     /* the others' use at the last update */
    uint64_t lent;              /* the lent share at the last update */
    int split;                  /* the last update split with other lenders */
    /* The shares in force until the last updates (ring, newest at
     * was_next - 1): what NVML's window of this container's use saw. */
    struct { uint64_t until; uint32_t share; } was[WAS_KEPT];
    unsigned was_next;
} watched[GV_MAX_DEVICES];

void gv_sm_watch(const gv_devinfo *d, struct gv_sm *sm)
{
    if (!atomic_load_explicit(&watched[d->region_dev].info, memory_order_relaxed)) {
        watched[d->region_dev].sm = sm;
        atomic_store(&watched[d->region_dev].info, d);
    }
}

void gv_sm_policy_reset(void)
{
    for (int i = 0; i < GV_MAX_DEVICES; i++) {
        atomic_store(&watched[i].info, NULL);
        watched[i].others_before = watched[i].lent = 0;
        watched[i].split = 0;
        watched[i].was_next = 0;
        for (int k = 0; k < WAS_KEPT; k++)
            watched[i].was[k].until = 0;
    }
}

/* NVML's per-process samples of a device newer than `since` (CPU time,
 * us): how many were written to s (at most MAX_SAMPLES); NO_SAMPLES when
 * NVML has none (NVML_ERROR_NOT_FOUND: no process ran kernels since), or
 * -(NVML's error code) when the query failed otherwise. */
#define MAX_SAMPLES 1024u   /* 2 s of 200 ms samples of 100 processes (32 KiB) */
#define NO_SAMPLES (-(int)NVML_ERROR_NOT_FOUND)
static int proc_samples(nvmlDevice_t nvml, unsigned long long since,
                        nvmlProcessUtilizationSample_t s[MAX_SAMPLES])
{
    typedef nvmlReturn_t (*procutil_fn)(nvmlDevice_t, nvmlProcessUtilizationSample_t *,
                                        unsigned int *, unsigned long long);
    unsigned int n = MAX_SAMPLES;
    nvmlReturn_t rc = GV_REAL(nvmlDeviceGetProcessUtilization, procutil_fn)(nvml, s, &n, since);
    if (rc != NVML_SUCCESS)
        return rc == NVML_ERROR_NOT_FOUND ? NO_SAMPLES : -(int)(rc > 0 && rc < 1000000 ? rc : 999);
    return (int)(n < MAX_SAMPLES ? n : MAX_SAMPLES);
}

/* The other containers on the device that used all of their share lately
 * (their processes' slots in the launch-order file say so, sm_arbiter.c),
 * and what everything else there used. */
struct lenders {
    uint64_t rest;          /* 1/100 %: the use of every other process not in one of them */
    uint64_t guaranteed;    /* 1/100 %: the limits of the burst-share ones */
    unsigned weight;        /* the same, %: their weights */
    int burst, best;        /* how many are burst-share, best-effort */
    uint64_t fixed;         /* 1/100 %: the limits of the fixed-share ones */
    int nfixed;             /* how many are fixed-share */
};

#define MAX_LENDERS 64

/* Count pid's use (1/100 %) into l: its container is a lender that wants
 * more (each container once, seen[] holding those counted), or it is in
 * the rest. */
static void count_other(int dev, unsigned pid, uint64_t use, uint64_t now, struct lenders *l,
                        uint64_t seen[MAX_LENDERS], int *nseen)
{
    struct gv_arb_terms t;
    if (!gv_arb_terms_of(dev, pid, now, &t) || !t.wants || t.limit == 0 ||
        t.policy > GV_SM_BEST_EFFORT) {
        l->rest += use;
        return;
    }
    for (int k = 0; k < *nseen; k++)
        if (seen[k] == t.container)
            return;
    if (*nseen >= MAX_LENDERS) {
        l->rest += use;
        return;
    }
    seen[(*nseen)++] = t.container;
    if (t.policy == GV_SM_FIXED) {
        l->nfixed++;            /* at its cap: uses its limit, never more */
        l->fixed += (uint64_t)t.limit * 100;
    } else if (t.policy == GV_SM_BURST) {
        l->burst++;
        l->weight += t.limit;
        l->guaranteed += (uint64_t)t.limit * 100;
    } else {
        l->best++;
    }
}

/* The other containers' use of w's device over the last RECENT_US, in 1/100 %:
 * NVML per-process utilisation of every PID that is not one of ours.
 * *company: who else used it meanwhile (GV_SM_OTHERS: other containers'
 * processes, GV_SM_MATES: other processes of this one, or 0), and
 * GV_SM_FULL when all processes together kept it busy (>= FULL_USE);
 * *procs: how many of this container's processes used it (this one
 * counted always); *error: 0, or NVML's error code when the query failed
 * (the use is then not known: 0 is returned, and must not be lent from);
 * *l: the other lenders that want more, and the rest's use; *own: this
 * container's use. */
static uint64_t others_recent(struct watched *w, int *company, int *procs, int *error,
                              struct lenders *l, uint64_t *own)
{
    *own = 0;
    uint64_t counted[MAX_LENDERS];
    int ncounted = 0;
    uint64_t mono = gv_mono_ns();
    int dev = (int)(w - watched);
    *l = (struct lenders){ 0 };
    nvmlProcessUtilizationSample_t samples[MAX_SAMPLES];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long since = (unsigned long long)ts.tv_sec * 1000000ULL +
                               (unsigned long long)ts.tv_nsec / 1000 - RECENT_US;
    *company = GV_SM_OTHERS;             /* not known: as if others worked */
    *procs = 1;
    *error = 0;
    int got = proc_samples(w->nvml, since, samples);
    if (got < 0) {
        if (got != NO_SAMPLES)
            *error = -got;
        else
            *company |= GV_SM_NOBODY;   /* no process ran kernels lately */
        return 0;
    }
    unsigned int n = (unsigned int)got;
    /* This container's processes, by the PIDs NVML may show for them: the
     * registered ones and, inside a PID namespace, the host's they learned. */
    uint32_t ours[512];
    int nlocal = region_process_list(gv_core_region(), (int32_t *)ours, 256);
    int nours = nlocal < 0 ? 0 : nlocal < 256 ? nlocal : 256;
    int nhost = region_nvml_pid_list(gv_core_region(), ours + nours, 256);
    nours += nhost < 0 ? 0 : nhost < 256 ? nhost : 256;
    unsigned int me = gv_nvml_self_pid();
    /* A PID may have several samples: average them, then add up the PIDs;
     * a PID with any busy sample counts as working on the device. */
    int others = 0, mates = 0;
    uint64_t total = 0, all = 0;
    for (unsigned int i = 0; i < n; i++) {
        unsigned int pid = samples[i].pid;
        int mine = pid == me, seen = 0;
        for (int k = 0; k < nours && !mine; k++)
            mine = ours[k] == pid;
        for (unsigned int j = 0; j < i && !seen; j++)
            seen = samples[j].pid == pid;
        if (seen)
            continue;
        uint64_t sum = 0, cnt = 0;
        for (unsigned int j = i; j < n; j++)
            if (samples[j].pid == pid) {
                sum += samples[j].smUtil;
                cnt++;
            }
        all += sum * 100 / cnt;
        if (!mine) {
            total += sum * 100 / cnt;
            count_other(dev, pid, sum * 100 / cnt, mono, l, counted, &ncounted);
        }
        if (sum && pid != me) {
            mates += mine;
            others |= !mine;
        }
    }
    *own = all - total;
    *company = (others ? GV_SM_OTHERS : 0) | (mates ? GV_SM_MATES : 0);
    *procs = 1 + mates;
    if (all >= FULL_USE)
        *company |= GV_SM_FULL;
    return total > 10000 ? 10000 : total;
}

/* A lending policy that cannot read the others' use: said once a process. */
static void cannot_lend(const char *uuid, int error)
{
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gv_log(GV_LOG_WARN, "%s: nvmlDeviceGetProcessUtilization failed (NVML error %d): what the "
               "other containers use is not known, so burst-share and best-effort run at the "
               "limit", uuid, error);
}

/* Lending next to other containers that use all of their share: the
 * fixed-share ones among them keep their limits; the lenders among them
 * and this one split what is left past their limits (less the margin
 * while the rest work), in proportion to their limits (burst-share), or
 * evenly between best-effort ones when no burst-share one wants more.
 * Lent by the rule below instead, the first to borrow kept all it took:
 * it showed as the others' use, so it was not lent again (two burst-share
 * containers of 30 % came out 60 % and 30 %, of 20 % and 40 % 50 % and
 * 40 %); and a fixed-share neighbour at its cap left the margin idle. */
static uint32_t split_share(const struct lenders *l, uint32_t limit, uint32_t policy)
{
    uint64_t margin = l->rest >= OTHERS_ACTIVE ? MARGIN : 0;
    uint64_t taken = l->rest + margin + l->fixed;
    uint64_t cap = taken < 10000 ? 10000 - taken : 0;
    uint64_t own = policy == GV_SM_BURST ? (uint64_t)limit * 100 : 0;
    uint64_t left = cap > own + l->guaranteed ? cap - own - l->guaranteed : 0;
    uint64_t part;
    if (policy == GV_SM_BURST)
        part = left * limit / (limit + l->weight);
    else
        part = l->burst ? 0 : left / (uint64_t)(1 + l->best);
    uint64_t floor = policy == GV_SM_BURST ? (uint64_t)limit * 100 : 100;
    uint64_t share = own + part;
    return (uint32_t)(share > floor ? share : floor);
}

/* The lowest share in force over NVML's window of this container's use,
 * was (in force until now) included, after keeping was for later updates.
 * Taken as the share the use must reach, a container whose share had just
 * gone up did not "use all of its share" until the window had passed the
 * rise: lenders beside it left the split for the rule below, and a best-
 * effort pair (10 % each) kept 10-20 % of the device idle (measured:
 * docs/interposer.md, "SM policies"). */
static uint32_t share_in_window(struct watched *w, uint32_t was, uint64_t now)
{
    unsigned at = w->was_next++ % WAS_KEPT;
    w->was[at].until = now;
    w->was[at].share = was;
    uint32_t low = was;
    for (unsigned k = 1; k < WAS_KEPT; k++) {
        unsigned i = (at + WAS_KEPT - k) % WAS_KEPT;
        /* In force until w->was[i].until: in the window if that is in it. */
        if (!w->was[i].until || w->was[i].until + WAS_WINDOW_NS < now)
            break;
        low = w->was[i].share < low ? w->was[i].share : low;
    }
    return low;
}

/* Set w's share; *company, *procs: who else works on its device. */
static void update_share(struct watched *w, int *company, int *procs)
{
    struct gv_sm *sm = w->sm;
    uint32_t limit = atomic_load(&sm->limit);
    uint32_t policy = atomic_load(&sm->policy);
    uint32_t share;
    int error = 0;
    struct lenders l = { 0 };
    int dev = (int)(w - watched);
    uint64_t own = 0;
    int after_split = w->split;
    w->split = 0;
    gv_arb_set_terms(dev, gv_nvml_self_pid(), limit, policy);
    uint64_t others = w->have_nvml ? others_recent(w, company, procs, &error, &l, &own) : 0;
    /* Does this container use all of its share: its launches waited for
     * its clock lately, and NVML shows it using about the share that was
     * in force over NVML's window (the lowest of them, share_in_window; a
     * busy machine may keep it a little below)?  One whose
     * launches wait now and then in bursts, but which uses less, does
     * not: lenders beside it would keep room for it that it leaves idle. */
    uint32_t was = share_in_window(w, atomic_load(&sm->share), gv_mono_ns());
    uint64_t slack = was / WANT_SLACK_PART > WANT_SLACK ? was / WANT_SLACK_PART : WANT_SLACK;
    if (gv_sm_took_held(dev) && w->have_nvml && !error && limit && own + slack >= was)
        gv_arb_wants(dev, gv_mono_ns());
    if (region_sm_yielding(sm, gv_mono_ns())) {
        share = 0;
    } else if (limit == 0) {
        share = 10000;
    } else if (policy == GV_SM_FIXED || !w->have_nvml || error) {
        /* Without the others' use nothing is lent: a failed query is not
         * "nobody else works" (taken so, a lender kept the whole GPU from
         * a fixed-share neighbour for good). */
        if (policy != GV_SM_FIXED && w->have_nvml) {
            cannot_lend(atomic_load(&w->info)->uuid_str, error);
            w->lent = 0;
        }
        share = limit * 100;
    } else if (l.burst + l.best + l.nfixed > 0) {
        share = split_share(&l, limit, policy);
        w->others_before = others;
        w->lent = share;
        w->split = 1;
    } else {
        /* Lend what the others leave: their use over the last 300 ms (NVML
         * per-process samples; every PID not in this container), minus a
         * margin, never below the floor (how fast it moves: below). */
        /* The node agent's view, when the supervisor passed one on lately. */
        uint64_t at = atomic_load(&sm->others_at), now = gv_mono_ns();
        uint64_t agent = atomic_load(&sm->others);
        if (at && now >= at && now - at < AGENT_FRESH_NS && agent > others)
            others = agent;
        uint64_t floor = policy == GV_SM_BURST ? (uint64_t)limit * 100 : 100;
        uint64_t room = others < OTHERS_ACTIVE ? 10000
                        : (others + MARGIN < 10000 ? 10000 - others - MARGIN : 0);
        /* What the others use is also what this container leaves them: on a
         * time-sliced device a container that wants more than it gets
         * shows only what it gets.  So when their use grows, give back all
         * that was lent at once (their growth shows within one or two NVML
         * samples), and lend again step by step while their use holds;
         * with nobody else working, or their use falling, lend all there
         * is at once.  Right after a split (the other lenders no longer
         * said they wanted more, if only for an update), their use then
         * was theirs growing into the parts the split gave them, not the
         * others' use this rule goes by: hold what was lent, as far as
         * there is room.  Read as the others' use rising, it gave all
         * back, down to the floor: a best-effort pair at 1 % each in turn,
         * whose use then fell short of its share, so that it stopped
         * saying it wanted more, and its neighbour left the split too. */
        uint64_t lend;
        if (after_split && others >= OTHERS_ACTIVE)
            lend = w->lent < room ? w->lent : room;
        else if (others >= OTHERS_ACTIVE && others >= w->others_before + OTHERS_RISE)
            lend = 0;
        else if (others < OTHERS_ACTIVE || others + OTHERS_RISE <= w->others_before)
            lend = room;
        else
            lend = w->lent + LEND_STEP < room ? w->lent + LEND_STEP : room;
        w->others_before = others;
        w->lent = lend;
        share = (uint32_t)(lend > floor ? lend : floor);
    }
    region_sm_set_share(sm, share);
}

/* Hand NVML's per-process samples newer than the last taken to sm_calib.c. */
static void calibrate(int dev, nvmlDevice_t nvml)
{
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    uint64_t mono = gv_mono_ns();
    uint64_t real_ns = (uint64_t)rt.tv_sec * 1000000000ULL + (uint64_t)rt.tv_nsec;
    unsigned long long since = gv_cal_since(dev, real_ns);
    nvmlProcessUtilizationSample_t samples[MAX_SAMPLES];
    int n = proc_samples(nvml, since, samples);
    if (n >= 0)
        gv_cal_update(dev, since, samples, (unsigned)n, gv_nvml_self_pid(), real_ns, mono);
}

void gv_sm_policies(void)
{
    static int nvml_tried;
    if (!nvml_tried) {
        nvml_tried = 1;
        GV_REAL(nvmlInit_v2, nvmlReturn_t (*)(void))();
    }
    for (int i = 0; i < GV_MAX_DEVICES; i++) {
        struct watched *w = &watched[i];
        const gv_devinfo *info = atomic_load(&w->info);
        if (!info)
            continue;
        if (!w->have_nvml) {
            typedef nvmlReturn_t (*by_uuid_fn)(const char *, nvmlDevice_t *);
            w->have_nvml = GV_REAL(nvmlDeviceGetHandleByUUID, by_uuid_fn)(info->uuid_str, &w->nvml) ==
                           NVML_SUCCESS;
        }
        int c = GV_SM_OTHERS, p = 1;
        update_share(w, &c, &p);
        gv_sm_set_company(i, c, p);
        if (w->have_nvml)
            calibrate(i, w->nvml);
    }
}
