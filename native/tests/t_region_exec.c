/*
 * t_region_exec.c - a process that exec()s from one thread while its main
 * thread holds the region (a device's gate, a slot being reclaimed) must
 * not block the container.
 *
 * exec() from any thread keeps the process's pid and start time: the main
 * thread's identity, which names the gate's closer, still looks alive
 * after the main thread vanished mid-reclaim.  If the new program does
 * not use the region (here: sleep), nobody would ever open the gate.
 *
 * usage: t_region_exec PATH
 */
#include "region_test.h"

#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>

#define MIB (UINT64_C(1) << 20)

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "t_region_exec: hung waiting for a gate closed by a "
                              "process that exec'd a program without the region\n";
    (void)!write(2, msg, sizeof msg - 1);
    _exit(1);
}

static const char *g_path;

/* arg NULL: exec sleep; else exec this test as the new image. */
static void *exec_soon(void *arg)
{
    usleep(300 * 1000);           /* the main thread is in the reclaim's delay */
    if (arg != NULL)
        execl("/proc/self/exe", "t_region_exec", g_path, "--new-image", (char *)NULL);
    else
        execl("/bin/sleep", "sleep", "30", (char *)NULL);
    _exit(4);
}

static void *first_use_in_a_worker(void *arg)
{
    gv_region *r = arg;
    if (region_drop_old_image(r) != 1)   /* the library's set-up, in this thread */
        _exit(7);
    int s = region_self_slot(r);
    unsigned char u[16];
    t_uuid(u, 3);
    int dev = region_device_lookup(r, u, 0, 0);
    if (s < 0 || dev < 0 || region_reserve(r, dev, s, 2 * MIB) != 0)
        _exit(6);
    return NULL;
}

/* The image a thread exec()ed while the main thread held the gate: it
 * uses the region first from a thread other than the main one (whose
 * identity the old main thread had), which sets the library up (drops
 * the old image's slot) as a hook called there first would. */
static int new_image(void)
{
    alarm(10);
    gv_region *r = t_open_region(g_path);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, first_use_in_a_worker, r) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    region_close(r);
    return 0;
}

/* Until child (forked, exec_soon) runs sleep. */
static void wait_for_sleep(pid_t child)
{
    char p[64], comm[64];
    snprintf(p, sizeof p, "/proc/%d/comm", (int)child);
    for (int i = 0; i < 500; i++) {
        FILE *f = fopen(p, "r");
        int got = f != NULL && fgets(comm, sizeof comm, f) != NULL;
        if (f != NULL)
            fclose(f);
        if (got && strncmp(comm, "sleep", 5) == 0)
            return;
        usleep(10 * 1000);
    }
    CHECK(!"the child never exec'd sleep");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *path = argv[1];
    g_path = path;
    if (t_flag(argc, argv, "--new-image"))
        return new_image();
    gv_region *r = t_fresh_region(path);
    unsigned char u[16];
    t_uuid(u, 3);
    int dev = region_device_lookup(r, u, 64 * MIB, 16 * MIB);
    CHECK(dev >= 0);
    int me = region_self_slot(r);
    CHECK(me >= 0);

    /* 1: the gate and a slot being reclaimed. */
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        /* A dead process's slot holding memory (this pid, a start time it
         * never had), reclaimed by the main thread: it closes the gate and
         * marks the slot, then sleeps in the middle (the test delay) while
         * another thread exec()s. */
        int dead = region_test_claim_slot(r, getpid(), 1);
        CHECK(dead >= 0);
        CHECK_EQ(region_reserve(r, dev, dead, 4 * MIB), 0);
        region_test_set_delay_us(5 * 1000 * 1000);
        pthread_t t;
        CHECK(pthread_create(&t, NULL, exec_soon, NULL) == 0);
        region_reclaim_dead(r);
        _exit(5);                 /* exec came first: not reached */
    }
    wait_for_sleep(child);
    signal(SIGALRM, on_alarm);
    alarm(20);
    /* The gate: a reservation and a release go through it. */
    CHECK_EQ(region_reserve(r, dev, me, 8 * MIB), 0);
    region_release(r, dev, me, 8 * MIB);
    /* The slot left "being reclaimed" by the vanished thread is taken over. */
    region_reclaim_dead(r);
    int32_t pids[8];
    CHECK_EQ(region_process_list(r, pids, 8), 1);
    CHECK_EQ(pids[0], getpid());
    CHECK_EQ(region_used(r, dev), 0);
    CHECK_EQ(region_test_inside(r, dev), 0);
    alarm(0);
    printf("gate and slot of an exec'd closer taken over: ok\n");
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);

    /* 2: a device entry being initialised. */
    unsigned char u2[16];
    t_uuid(u2, 4);
    child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        region_test_set_delay_us(5 * 1000 * 1000);
        pthread_t t;
        CHECK(pthread_create(&t, NULL, exec_soon, NULL) == 0);
        region_device_lookup(r, u2, 64 * MIB, 16 * MIB);
        _exit(5);
    }
    wait_for_sleep(child);
    alarm(20);
    int dev2 = region_device_lookup(r, u2, 64 * MIB, 32 * MIB);
    CHECK(dev2 > dev);
    CHECK_EQ(region_limit(r, dev2), 32 * MIB);   /* initialised again, by us */
    alarm(0);
    printf("device entry of an exec'd initialiser taken over: ok\n");
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);

    /* 3: as 1, but the program exec()ed uses the region, first from a
     * thread other than its main one. */
    child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        int mine = region_self_slot(r);
        CHECK(mine >= 0);
        CHECK_EQ(region_reserve(r, dev, mine, MIB), 0);
        int dead = region_test_claim_slot(r, getpid(), 1);
        CHECK(dead >= 0);
        CHECK_EQ(region_reserve(r, dev, dead, 4 * MIB), 0);
        region_test_set_delay_us(5 * 1000 * 1000);
        pthread_t t;
        CHECK(pthread_create(&t, NULL, exec_soon, (void *)1) == 0);
        region_reclaim_dead(r);
        _exit(5);
    }
    int st;
    CHECK(waitpid(child, &st, 0) == child);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fprintf(stderr, "new image: %s %d\n", WIFEXITED(st) ? "exit" : "signal",
                WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    alarm(20);
    CHECK_EQ(region_reserve(r, dev, me, 8 * MIB), 0);
    region_release(r, dev, me, 8 * MIB);
    region_reclaim_dead(r);       /* the new image exited without leaving */
    CHECK_EQ(region_process_list(r, pids, 8), 1);
    CHECK_EQ(region_used(r, dev), 0);
    CHECK_EQ(region_test_inside(r, dev), 0);
    alarm(0);
    printf("old main thread's holdings taken over by the new image: ok\n");

    region_close(r);
    unlink(path);
    printf("t_region_exec: OK\n");
    return 0;
}
