/*
 * t_region_race - many processes x threads reserve and release near the
 * limit; the limit must never be passed by a single byte.
 *
 *   t_region_race PATH [--procs 16] [--threads 4] [--ms 2000] [--hot-ms 1000]
 *                      [--duel-rounds 200] [--duel-procs 8] [--threads-only]
 *
 * Overshoot is measured two ways:
 *  - a ledger: every worker adds its amount to one shared atomic right
 *    after a successful reserve and removes it right before releasing.
 *    The ledger is a subset of what is granted, so ledger > limit proves
 *    an overshoot.  Its maximum is tracked at every add.
 *  - an observer thread samples region_used() continuously.  A sum over
 *    many counters is not a snapshot, so only samples taken while no
 *    reserve/release was in progress anywhere are counted ("quiescent").
 * --threads-only runs every worker as a thread of this process with its own
 * slot (for ThreadSanitizer, which does not follow forks).
 * --spill: the oversubscribed variant: every other reservation counts half
 * of itself as spilled to host memory (region_reserve_spill), some move a
 * third later (region_spill_move), and releases give both back; the spilled
 * count must come back to exactly 0 and never pass the usage at quiescent
 * samples.
 */
#include "region_test.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#define MIB (UINT64_C(1) << 20)
#define HELD_MAX 4

struct shared {
    _Atomic uint64_t ledger, ledger_max;
    _Atomic uint64_t ok, refused, released;
    _Atomic uint64_t begun, ended;      /* reserve/release operations */
    _Atomic int stop;
    /* duel */
    _Atomic int round, release_round;
    _Atomic uint64_t done, acks, winners;
};

static struct shared *S;
static const char *g_path;
static gv_region *g_r;
static int g_dev, g_duel_dev;
static uint64_t g_limit = 64 * MIB;
static int g_threads_only;
static int g_spill;
static uint64_t g_max_n;   /* sizes: all workers together ask ~1.25x the limit */

static void atomic_max(_Atomic uint64_t *m, uint64_t v)
{
    uint64_t cur = atomic_load(m);
    while (v > cur && !atomic_compare_exchange_weak(m, &cur, v))
        ;
}

/* A slot for the calling worker: the process's own, or (threads-only) a
 * slot owned by this thread's (tid, start), which is alive as long as the
 * thread is. */
static int worker_slot(void)
{
    if (!g_threads_only)
        return region_self_slot(g_r);
    int32_t tid = (int32_t)syscall(SYS_gettid);
    int s = region_test_claim_slot(g_r, tid, gv_proc_start_time(tid));
    CHECK(s >= 0);
    return s;
}

static void *worker(void *arg)
{
    uint64_t seed = (uint64_t)(uintptr_t)arg * 0x9E3779B97F4A7C15ULL ^ (uint64_t)getpid() << 20;
    int slot = worker_slot();
    CHECK(slot >= 0);
    uint64_t held[HELD_MAX], spilled[HELD_MAX];
    int nheld = 0;
    while (!atomic_load(&S->stop)) {
        uint64_t x = t_rand(&seed);
        if (nheld < HELD_MAX && (nheld == 0 || (x & 3) != 0)) {
            uint64_t n = 1 + (x >> 16) % g_max_n;
            uint64_t sp = g_spill && (x >> 40 & 1) ? n / 2 : 0;
            atomic_fetch_add(&S->begun, 1);
            int rc = region_reserve_spill(g_r, g_dev, slot, n, sp);
            if (rc == 0) {
                uint64_t v = atomic_fetch_add(&S->ledger, n) + n;
                atomic_max(&S->ledger_max, v);
                if (g_spill && sp == 0 && (x >> 41 & 1)) {
                    sp = n / 3;          /* refused on the device: spilled */
                    region_spill_move(g_r, g_dev, slot, sp);
                }
                spilled[nheld] = sp;
                held[nheld++] = n;
                atomic_fetch_add(&S->ok, 1);
            } else {
                CHECK_EQ(rc, GV_ENOMEM);
                atomic_fetch_add(&S->refused, 1);
            }
            atomic_fetch_add(&S->ended, 1);
        } else {
            int i = (int)((x >> 8) % (uint64_t)nheld);
            uint64_t n = held[i], sp = spilled[i];
            --nheld;
            held[i] = held[nheld];
            spilled[i] = spilled[nheld];
            atomic_fetch_add(&S->begun, 1);
            atomic_fetch_sub(&S->ledger, n);
            region_release_spill(g_r, g_dev, slot, n, sp);
            atomic_fetch_add(&S->released, 1);
            atomic_fetch_add(&S->ended, 1);
        }
        if ((x & 0x30000) == 0)
            sched_yield();
    }
    while (nheld > 0) {
        --nheld;
        atomic_fetch_sub(&S->ledger, held[nheld]);
        region_release_spill(g_r, g_dev, slot, held[nheld], spilled[nheld]);
    }
    return NULL;
}

struct obs { uint64_t max, samples, quiescent, spill_over; };

static void *observer(void *arg)
{
    struct obs *o = arg;
    while (!atomic_load(&S->stop)) {
        uint64_t e = atomic_load(&S->ended);
        uint64_t b = atomic_load(&S->begun);
        uint64_t u = region_used(g_r, g_dev);
        uint64_t sp = region_spilled(g_r, g_dev);
        uint64_t b2 = atomic_load(&S->begun);
        o->samples++;
        if (b == e && b2 == b) {        /* nothing in progress around the read */
            o->quiescent++;
            if (u > o->max)
                o->max = u;
            if (sp > u)
                o->spill_over++;
        }
        if ((o->samples & 63) == 0)
            sched_yield();
    }
    return NULL;
}

static void run_threads(int n, void *(*fn)(void *), long base)
{
    pthread_t th[256];
    CHECK(n <= 256);
    for (int i = 0; i < n; i++)
        CHECK(pthread_create(&th[i], NULL, fn, (void *)(uintptr_t)(base + i)) == 0);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
}

static void race(int procs, int threads, int ms)
{
    g_max_n = g_limit * 5 / 4 / (uint64_t)(procs * threads > 0 ? procs * threads : 1);
    struct obs o = {0, 0, 0, 0};
    pthread_t ot;
    uint64_t t0 = t_now_ms();
    pid_t kids[256];
    CHECK(procs <= 256);
    if (g_threads_only) {
        pthread_t th[1024];
        CHECK(procs * threads <= 1024);
        for (int i = 0; i < procs * threads; i++)
            CHECK(pthread_create(&th[i], NULL, worker, (void *)(uintptr_t)(i + 1)) == 0);
        CHECK(pthread_create(&ot, NULL, observer, &o) == 0);
        usleep((useconds_t)ms * 1000);
        atomic_store(&S->stop, 1);
        for (int i = 0; i < procs * threads; i++)
            pthread_join(th[i], NULL);
    } else {
        for (int p = 0; p < procs; p++) {
            kids[p] = fork();
            CHECK(kids[p] >= 0);
            if (kids[p] == 0) {
    alarm(60);
                g_r = t_open_region(g_path);      /* each process attaches itself */
                run_threads(threads, worker, (long)p * threads + 1);
                _exit(0);
            }
        }
        CHECK(pthread_create(&ot, NULL, observer, &o) == 0);
        usleep((useconds_t)ms * 1000);
        atomic_store(&S->stop, 1);
        for (int p = 0; p < procs; p++) {
            int st;
            CHECK(waitpid(kids[p], &st, 0) == kids[p]);
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                fprintf(stderr, "worker %d failed (status 0x%x)\n", p, st);
                _exit(1);
            }
        }
    }
    pthread_join(ot, NULL);
    uint64_t lmax = atomic_load(&S->ledger_max);
    uint64_t worst = lmax > o.max ? lmax : o.max;
    uint64_t overshoot = worst > g_limit ? worst - g_limit : 0;
    uint64_t final_used = region_used(g_r, g_dev);
    uint64_t final_inflight = region_test_inside(g_r, g_dev);
    uint64_t final_slots = region_test_slot_sum(g_r, g_dev);
    printf("race: mode=%s procs=%d threads=%d ms=%llu limit=%llu ok=%llu refused=%llu "
           "released=%llu ledger_max=%llu observed_max=%llu quiescent_samples=%llu/%llu "
           "final_used=%llu\n",
           g_threads_only ? "threads" : "processes", procs, threads,
           (unsigned long long)(t_now_ms() - t0), (unsigned long long)g_limit,
           (unsigned long long)atomic_load(&S->ok), (unsigned long long)atomic_load(&S->refused),
           (unsigned long long)atomic_load(&S->released), (unsigned long long)lmax,
           (unsigned long long)o.max, (unsigned long long)o.quiescent,
           (unsigned long long)o.samples, (unsigned long long)final_used);
    printf("overshoot=%llu bytes\n", (unsigned long long)overshoot);
    if (g_spill)
        printf("spill: final_spilled=%llu slot_spill_sum=%llu spill_over_used=%llu\n",
               (unsigned long long)region_spilled(g_r, g_dev),
               (unsigned long long)region_test_spill_sum(g_r, g_dev),
               (unsigned long long)o.spill_over);
    fflush(stdout);
    CHECK_EQ(overshoot, 0);
    CHECK_EQ(region_spilled(g_r, g_dev), 0);
    CHECK_EQ(region_test_spill_sum(g_r, g_dev), 0);
    CHECK_EQ(o.spill_over, 0);
    CHECK_EQ(final_used, 0);
    CHECK_EQ(final_inflight, 0);
    CHECK_EQ(final_slots, 0);
    CHECK_EQ(atomic_load(&S->ledger), 0);
    CHECK(atomic_load(&S->ok) > 0);
    CHECK(atomic_load(&S->refused) > 0);   /* we really were at the limit */
}

/* ---- last-bytes duel ---------------------------------------------------- */

#define DUEL_N (3 * MIB)

static void duel_contender(int rounds)
{
    int slot = worker_slot();
    CHECK(slot >= 0);
    for (int rd = 1; rd <= rounds; rd++) {
        while (atomic_load(&S->round) < rd)
            sched_yield();
        int rc = region_reserve(g_r, g_duel_dev, slot, DUEL_N);
        CHECK(rc == 0 || rc == GV_ENOMEM);
        if (rc == 0)
            atomic_fetch_add(&S->winners, 1);
        atomic_fetch_add(&S->done, 1);
        while (atomic_load(&S->release_round) < rd)
            sched_yield();
        if (rc == 0)
            region_release(g_r, g_duel_dev, slot, DUEL_N);
        atomic_fetch_add(&S->acks, 1);
    }
}

static void *duel_thread(void *arg)
{
    duel_contender((int)(uintptr_t)arg);
    return NULL;
}

static void duel(int procs, int rounds)
{
    /* Limit 10 MiB, 8 MiB held by us: room for exactly one 3 MiB piece
     * (two would need 6). */
    uint64_t limit = 10 * MIB, base = limit - DUEL_N - MIB;
    region_set_limit(g_r, g_duel_dev, limit);
    int me = region_self_slot(g_r);
    CHECK(me >= 0);
    CHECK_EQ(region_reserve(g_r, g_duel_dev, me, base), 0);
    pid_t kids[256];
    pthread_t th[256];
    CHECK(procs <= 256);
    for (int p = 0; p < procs; p++) {
        if (g_threads_only) {
            CHECK(pthread_create(&th[p], NULL, duel_thread, (void *)(uintptr_t)rounds) == 0);
            continue;
        }
        kids[p] = fork();
        CHECK(kids[p] >= 0);
        if (kids[p] == 0) {
            alarm(60);
            duel_contender(rounds);
            _exit(0);
        }
    }
    uint64_t one = 0, none = 0, multi = 0, prev = 0;
    uint64_t t0 = t_now_ms();
    for (int rd = 1; rd <= rounds; rd++) {
        atomic_store(&S->round, rd);
        while (atomic_load(&S->done) < (uint64_t)procs * (uint64_t)rd)
            sched_yield();
        uint64_t w = atomic_load(&S->winners) - prev;
        prev += w;
        if (w == 1)
            one++;
        else if (w == 0)
            none++;
        else
            multi++;
        CHECK(region_used(g_r, g_duel_dev) <= limit);
        atomic_store(&S->release_round, rd);
        while (atomic_load(&S->acks) < (uint64_t)procs * (uint64_t)rd)
            sched_yield();
    }
    for (int p = 0; p < procs; p++) {
        if (g_threads_only) {
            pthread_join(th[p], NULL);
            continue;
        }
        int st;
        CHECK(waitpid(kids[p], &st, 0) == kids[p]);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    region_release(g_r, g_duel_dev, me, base);
    printf("duel: contenders=%d rounds=%d one_winner=%llu no_winner=%llu "
           "several_winners=%llu ms=%llu\n", procs, rounds, (unsigned long long)one,
           (unsigned long long)none, (unsigned long long)multi,
           (unsigned long long)(t_now_ms() - t0));
    CHECK_EQ(multi, 0);
    /* With the in-flight refinement a round without a winner is rare. */
    CHECK(rounds == 0 || one * 4 >= (uint64_t)rounds * 3);
    CHECK_EQ(region_used(g_r, g_duel_dev), 0);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH [--procs N] [--threads N] [--ms N] "
                "[--hot-ms N] [--duel-rounds N] [--duel-procs N] [--threads-only]\n", argv[0]);
        return 2;
    }
    g_path = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    int procs = (int)t_opt(argc, argv, "--procs", 16);
    int threads = (int)t_opt(argc, argv, "--threads", 4);
    int ms = (int)t_opt(argc, argv, "--ms", 2000);
    int hot_ms = (int)t_opt(argc, argv, "--hot-ms", 1000);
    int drounds = (int)t_opt(argc, argv, "--duel-rounds", 200);
    int dprocs = (int)t_opt(argc, argv, "--duel-procs", 8);
    g_threads_only = t_flag(argc, argv, "--threads-only");
    g_spill = t_flag(argc, argv, "--spill");
    alarm(120);

    S = t_shared(sizeof *S);
    g_r = t_fresh_region(g_path);
    unsigned char u[16];
    t_uuid(u, 1);
    g_dev = region_device_lookup(g_r, u, 80 * MIB, g_limit);
    t_uuid(u, 2);
    g_duel_dev = region_device_lookup(g_r, u, 80 * MIB, GV_UNLIMITED);
    CHECK(g_dev >= 0 && g_duel_dev >= 0 && g_dev != g_duel_dev);

    /* Wide: many workers (the refusal path, which checks /proc for dead
     * slots, dominates).  Hot: few workers, millions of operations, which
     * is what catches a check-then-publish race on a 2-core machine. */
    race(procs, threads, ms);
    memset(S, 0, sizeof *S);
    if (hot_ms > 0)
        race(g_threads_only ? 1 : 2, g_threads_only ? 4 : 2, hot_ms);
    duel(dprocs, drounds);
    region_close(g_r);
    unlink(g_path);
    printf("t_region_race: OK\n");
    return 0;
}
