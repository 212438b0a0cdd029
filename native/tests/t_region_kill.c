/*
 * t_region_kill - SIGKILL storm.  Workers reserve/release in tight loops,
 * reclaim dead slots (slowed down so kills land mid-reclaim) and claim new
 * device entries (slowed down so kills land mid-initialisation); the parent
 * SIGKILLs random workers at random times and replaces them.  After each
 * round: nobody hung (workers run under alarm()), everything is reclaimed,
 * usage is exactly 0 and the full limit can be reserved again.
 *
 *   t_region_kill PATH [--rounds 20] [--workers 6] [--round-ms 150] [--spill]
 *
 * --spill: the oversubscribed variant: reservations count part of
 * themselves as spilled to host memory, or move part there later, and
 * after each round the spilled count is exactly 0 too.
 */
#include "region_test.h"
#include "region_impl.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>

#define MIB (UINT64_C(1) << 20)
#define LIMIT (32 * MIB)
#define EXTRA_UUIDS 4           /* device entries claimed under fire */

static gv_region *g_r;
static int g_dev;
static _Atomic uint64_t *g_ops;
static int g_spill;

static void worker(int id, int round)
{
    alarm(10);                  /* a hung worker dies of SIGALRM: reported */
    uint64_t seed = ((uint64_t)getpid() << 16) ^ (uint64_t)id * 0x9E3779B97F4A7C15ULL;
    int slot = region_self_slot(g_r);
    if (slot < 0)
        _exit(3);
    if (id % 3 == 0)
        region_test_set_delay_us(300);   /* slow reclaims and device inits */
    if (round < EXTRA_UUIDS && id % 2 == 0) {
        unsigned char u[16];
        t_uuid(u, 50 + round);
        if (region_device_lookup(g_r, u, MIB, MIB) < 0)
            _exit(4);
    }
    uint64_t held[8], spilled[8];
    int n = 0;
    for (uint64_t it = 0;; it++) {
        uint64_t x = t_rand(&seed);
        if (n < 8 && (n == 0 || (x & 1))) {
            uint64_t sz = 1 + (x >> 20) % (LIMIT / 6);
            uint64_t sp = g_spill && (x >> 44 & 1) ? sz / 2 : 0;
            int rc = region_reserve_spill(g_r, g_dev, slot, sz, sp);
            if (rc == 0) {
                if (g_spill && sp == 0 && (x >> 45 & 1)) {
                    sp = sz / 3;
                    region_spill_move(g_r, g_dev, slot, sp);
                }
                spilled[n] = sp;
                held[n++] = sz;
            } else if (rc != GV_ENOMEM) {
                _exit(5);
            }
        } else {
            --n;
            region_release_spill(g_r, g_dev, slot, held[n], spilled[n]);
        }
        if ((x & 0xff) == 0)
            region_reclaim_dead(g_r);
        atomic_fetch_add(g_ops, 1);
    }
}

static pid_t spawn(int id, int round)
{
    pid_t p = fork();
    CHECK(p >= 0);
    if (p == 0)
        worker(id, round);
    return p;
}

static void reap(pid_t p, int *hung)
{
    int st;
    pid_t w;
    while ((w = waitpid(p, &st, 0)) < 0 && errno == EINTR)
        ;
    CHECK(w == p);
    if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL)
        return;
    fprintf(stderr, "worker %d: status 0x%x (%s)\n", (int)p, st,
            WIFSIGNALED(st) && WTERMSIG(st) == SIGALRM ? "hung" : "failed");
    (*hung)++;
}

/* Processes killed inside the gate (between entering and leaving it),
 * others dead with memory held, then two reclaimers at once: the one that
 * closes the gate first must not wait for a slot the other has taken over,
 * whose inside count is a dead process's.  Returns the rounds that hung. */
static int concurrent_reclaims(const char *path, int rounds)
{
    _Atomic int *go = t_shared(sizeof *go);
    int hung = 0;
    for (int round = 0; round < rounds; round++) {
        for (int i = 0; i < 8; i++) {
            pid_t c = fork();
            CHECK(c >= 0);
            if (c == 0) {
                gv_region *q = t_open_region(path);
                int s = region_self_slot(q);
                CHECK(s >= 0);
                if (i % 2 == 0) {
                    CHECK_EQ(region_reserve(q, g_dev, s, MIB), 0);
                    _exit(0);                   /* dies holding memory */
                }
                atomic_fetch_add(&q->m->dev[g_dev].inside[s], 1);
                raise(SIGKILL);                 /* dies inside the gate */
            }
            while (waitpid(c, NULL, 0) < 0 && errno == EINTR)
                ;
        }
        atomic_store(go, 0);
        pid_t k[2];
        for (int i = 0; i < 2; i++) {
            k[i] = fork();
            CHECK(k[i] >= 0);
            if (k[i] == 0) {
                gv_region *q = t_open_region(path);
                while (!atomic_load(go))
                    ;
                region_reclaim_dead(q);
                _exit(0);
            }
        }
        usleep(2000);
        atomic_store(go, 1);
        int done = 0;
        for (int t = 0; t < 500 && done < 2; t++) {
            for (int i = 0; i < 2; i++)
                if (k[i] && waitpid(k[i], NULL, WNOHANG) == k[i]) {
                    k[i] = 0;
                    done++;
                }
            usleep(10000);
        }
        if (done < 2) {
            hung++;
            for (int i = 0; i < 2; i++)
                if (k[i]) {
                    kill(k[i], SIGKILL);
                    waitpid(k[i], NULL, 0);
                }
        }
        region_reclaim_dead(g_r);
    }
    return hung;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH [--rounds N] [--workers N] [--round-ms N]\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *path = argv[1];
    int rounds = (int)t_opt(argc, argv, "--rounds", 20);
    int nw = (int)t_opt(argc, argv, "--workers", 6);
    int round_ms = (int)t_opt(argc, argv, "--round-ms", 150);
    g_spill = t_flag(argc, argv, "--spill");
    CHECK(nw > 0 && nw <= 64);
    uint64_t t0 = t_now_ms();
    g_ops = t_shared(sizeof *g_ops);
    g_r = t_fresh_region(path);
    unsigned char u[16];
    t_uuid(u, 7);
    g_dev = region_device_lookup(g_r, u, 4 * LIMIT, LIMIT);
    CHECK(g_dev >= 0);
    int me = region_self_slot(g_r);
    CHECK(me >= 0);
    uint64_t seed = (uint64_t)getpid() * 0x9E3779B97F4A7C15ULL;
    uint64_t kills = 0, reclaimed = 0;
    int hung = 0;
    pid_t w[64];

    for (int round = 0; round < rounds; round++) {
        for (int i = 0; i < nw; i++)
            w[i] = spawn(i, round);
        uint64_t end = t_now_ms() + (uint64_t)round_ms;
        while (t_now_ms() < end) {
            usleep((useconds_t)(t_rand(&seed) % 3000));
            int i = (int)(t_rand(&seed) % (uint64_t)nw);
            kill(w[i], SIGKILL);
            kills++;
            reap(w[i], &hung);      /* killed workers are reaped, or left as */
            w[i] = spawn(i, round); /* zombies below: both must count as dead */
        }
        for (int i = 0; i < nw; i++) {
            kill(w[i], SIGKILL);
            kills++;
        }
        usleep(1000);
        alarm(20);
        /* Reclaim while the last victims are still zombies, then reap. */
        reclaimed += (uint64_t)region_reclaim_dead(g_r);
        for (int i = 0; i < nw; i++)
            reap(w[i], &hung);
        reclaimed += (uint64_t)region_reclaim_dead(g_r);
        uint64_t used = region_used(g_r, g_dev), infl = region_test_inside(g_r, g_dev);
        uint64_t slots = region_test_slot_sum(g_r, g_dev);
        uint64_t spilled = region_spilled(g_r, g_dev) + region_test_spill_sum(g_r, g_dev);
        if (used != 0 || infl != 0 || slots != 0 || hung != 0 || spilled != 0)
            fprintf(stderr, "round %d: used %llu slots %llu inside %llu hung %d spilled %llu\n",
                    round, (unsigned long long)used, (unsigned long long)slots,
                    (unsigned long long)infl, hung, (unsigned long long)spilled);
        CHECK_EQ(hung, 0);
        CHECK_EQ(spilled, 0);
        CHECK_EQ(used, 0);
        CHECK_EQ(slots, 0);
        CHECK_EQ(infl, 0);
        int32_t pids[8];
        CHECK_EQ(region_process_list(g_r, pids, 8), 1);     /* only us */
        CHECK_EQ(region_reserve(g_r, g_dev, me, LIMIT), 0);
        region_release(g_r, g_dev, me, LIMIT);
        /* Device entries claimed under fire: each uuid exactly once, ready. */
        for (int k = 0; k <= round && k < EXTRA_UUIDS; k++) {
            unsigned char x[16], y[16];
            t_uuid(x, 50 + k);
            int d = region_device_lookup(g_r, x, MIB, MIB);
            CHECK(d >= 0);
            for (int j = 0; j < region_device_count(g_r); j++) {
                region_device_uuid(g_r, j, y);
                CHECK(j == d || memcmp(x, y, 16) != 0);
            }
        }
        alarm(0);
    }
    int reclaim_hung = concurrent_reclaims(path, rounds);
    printf("concurrent reclaims: rounds=%d hung=%d used=%llu inside=%llu\n", rounds,
           reclaim_hung, (unsigned long long)region_used(g_r, g_dev),
           (unsigned long long)region_test_inside(g_r, g_dev));
    CHECK_EQ(reclaim_hung, 0);
    CHECK_EQ(region_used(g_r, g_dev), 0);
    CHECK_EQ(region_test_inside(g_r, g_dev), 0);
    printf("kill: rounds=%d workers=%d kills=%llu reclaimed=%llu ops=%llu hung=%d "
           "devices=%d final_used=%llu final_spilled=%llu ms=%llu\n", rounds, nw,
           (unsigned long long)kills,
           (unsigned long long)reclaimed, (unsigned long long)atomic_load(g_ops), hung,
           region_device_count(g_r), (unsigned long long)region_used(g_r, g_dev),
           (unsigned long long)region_spilled(g_r, g_dev), (unsigned long long)(t_now_ms() - t0));
    region_close(g_r);
    unlink(path);
    printf("t_region_kill: OK\n");
    return 0;
}
