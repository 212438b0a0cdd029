/*
 * t_sm_arbiter - unit tests of the launch order between containers
 * (native/shim/sm_arbiter.c, linked alone with stand-ins for the region
 * path, the node directory and the log).
 *
 * Each "container" is a forked process with its own region path (the
 * container's identity is its region file's); they share one node
 * directory, so one launch-order file.  A child is told what to do over a
 * pipe and answers over another, so the parent can kill or stop it at a
 * known point.
 *
 *   t_sm_arbiter DIR   prints "t_sm_arbiter: OK" and exits 0 when all pass
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_protos.h"   /* CHECK (counts failures in gv_test_failures) */
#include "hooks.h"
#include "log.h"
#include "sm.h"

#define MS 1000000ULL
#define UUID "GPU-00000000-0000-0000-0000-000000000001"

/* ---- stand-ins for what sm_arbiter.c uses from the rest of the shim ------ */

static char node_dir[512];
static char region_file[600];
static int logged;

uint64_t gv_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

gv_region *gv_core_region(void) { return (gv_region *)region_file; }
const char *region_path(const gv_region *r) { return (const char *)r; }

int gv_node_dir(char *buf, size_t len)
{
    if (!node_dir[0])
        return 0;
    snprintf(buf, len, "%s", node_dir);
    return 1;
}

void gv_log(int level, const char *fmt, ...)
{
    (void)level;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "gpuvisor(test): ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    logged++;
}

/* ---- containers in child processes ------------------------------------------ */

struct child {
    pid_t pid;
    int to, from;
};

static void be_container(const char *name)
{
    snprintf(region_file, sizeof region_file, "%s/%s.shr", node_dir, name);
    int fd = open(region_file, O_RDWR | O_CREAT, 0600);
    if (fd >= 0)
        close(fd);
}

/* Commands: 'c' check with a clock `arg` ns ahead of now (answers the
 * result), 'w' keep waiting with that clock (answers once, then loops
 * until killed), 'a' admitted, 's' settled, 'f' fork a child that is
 * admitted three times (it answers its own check's result), 'k' kill that
 * child. */
static void child_loop(int in, int out)
{
    pid_t grandchild = -1;
    for (;;) {
        char cmd;
        long long arg;
        if (read(in, &cmd, 1) != 1 || read(in, &arg, sizeof arg) != sizeof arg)
            _exit(0);
        uint64_t now = gv_mono_ns();
        int r = 0;
        switch (cmd) {
        case 'c':
            r = gv_arb_check(0, UUID, now + (uint64_t)arg, now);
            break;
        case 'w':
            r = gv_arb_check(0, UUID, now + (uint64_t)arg, now);
            if (write(out, &r, sizeof r) != sizeof r)
                _exit(1);
            for (;;) {
                usleep(50);
                now = gv_mono_ns();
                gv_arb_check(0, UUID, now + (uint64_t)arg, now);
            }
        case 'a':
            gv_arb_admitted(0, UUID, now);
            break;
        case 's':
            gv_arb_settled(0);
            break;
        case 'f': {
            pid_t p = fork();
            grandchild = p;
            if (p == 0) {
                gv_arb_admitted(0, UUID, gv_mono_ns());
                gv_arb_admitted(0, UUID, gv_mono_ns());
                gv_arb_admitted(0, UUID, gv_mono_ns());
                now = gv_mono_ns();
                r = gv_arb_check(0, UUID, now, now);
                if (write(out, &r, sizeof r) != sizeof r)
                    _exit(1);
                pause();
                _exit(0);
            }
            continue;   /* the grandchild answers */
        }
        case 'k':
            if (grandchild > 0) {
                kill(grandchild, SIGKILL);
                waitpid(grandchild, NULL, 0);
            }
            break;
        default:
            _exit(2);
        }
        if (write(out, &r, sizeof r) != sizeof r)
            _exit(1);
    }
}

static struct child spawn(const char *name)
{
    int a[2], b[2];
    struct child c = { -1, -1, -1 };
    if (pipe(a) || pipe(b))
        return c;
    c.pid = fork();
    if (c.pid == 0) {
        close(a[1]);
        close(b[0]);
        be_container(name);
        child_loop(a[0], b[1]);
    }
    close(a[0]);
    close(b[1]);
    c.to = a[1];
    c.from = b[0];
    return c;
}

static int ask(struct child *c, char cmd, long long arg)
{
    int r = -99;
    if (write(c->to, &cmd, 1) != 1 || write(c->to, &arg, sizeof arg) != sizeof arg)
        return -98;
    if (read(c->from, &r, sizeof r) != sizeof r)
        return -97;
    return r;
}

static void tell(struct child *c, char cmd)
{
    long long arg = 0;
    if (write(c->to, &cmd, 1) != 1 || write(c->to, &arg, sizeof arg) != sizeof arg)
        return;
}

static void finish(struct child *c)
{
    close(c->to);
    close(c->from);
    kill(c->pid, SIGKILL);
    waitpid(c->pid, NULL, 0);
}

/* Checks by c, with a clock `ahead` ns ahead of now, until one does not
 * hold it (1: go, or -1: the launch order is out of play, the container's
 * own rules apply); the time that took (ns), or UINT64_MAX after `limit`. */
static uint64_t time_to_go(struct child *c, long long ahead, uint64_t limit)
{
    uint64_t t0 = gv_mono_ns();
    for (;;) {
        int r = ask(c, 'c', ahead);
        uint64_t dt = gv_mono_ns() - t0;
        if (r == 1 || r == -1)
            return dt;
        if (dt > limit)
            return UINT64_MAX;
        usleep(100);
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: t_sm_arbiter DIR\n");
        return 2;
    }
    snprintf(node_dir, sizeof node_dir, "%s/node", argv[1]);
    mkdir(node_dir, 0700);
    char path[700];
    snprintf(path, sizeof path, "%s/gpuvisor-sm-%s", node_dir, UUID);
    unlink(path);                   /* a fresh node */

    /* Alone on the device: not in play. */
    struct child x = spawn("x"), y = spawn("y");
    CHECK(ask(&x, 'c', 0) == -1, "a container alone: the launch order is not in play");
    CHECK(ask(&x, 'a', 0) == 0, "admitted");
    CHECK(ask(&x, 's', 0) == 0, "settled");

    /* Next to a container that launched lately, with nothing in flight and
     * nobody waiting: go. */
    CHECK(ask(&y, 'c', 2 * MS) == 1, "nothing in flight: go");
    ask(&y, 'a', 0);
    ask(&y, 's', 0);

    /* The container furthest behind goes first: x waits with its clock at
     * now; y's clock 2 ms ahead waits, 0.2 ms ahead goes (margin 0.5 ms). */
    int r0;
    struct child xw = spawn("x");                   /* another process of x */
    CHECK(ask(&xw, 'w', 0) == 1, "x waiting, and free to go itself");
    r0 = ask(&y, 'c', 2 * MS);
    CHECK(r0 == 0, "y 2 ms ahead of a waiting x: y waits (got %d)", r0);
    CHECK(ask(&y, 'c', 200 * 1000) == 1, "y within the margin of x: y goes");
    usleep(1000);   /* y's own claim to be waiting lapses */
    CHECK(ask(&x, 'c', 2 * MS) == 1, "x's own waiting process does not hold x");

    /* Killed while waiting: its claim lapses within WAITING_NS (0.3 ms). */
    kill(xw.pid, SIGKILL);
    waitpid(xw.pid, NULL, 0);
    uint64_t dt = time_to_go(&y, 2 * MS, 100 * MS);
    CHECK(dt < 20 * MS, "a waiting process killed held y for %llu us",
          (unsigned long long)(dt / 1000));

    /* Stopped while waiting: the same. */
    struct child xs = spawn("x");
    CHECK(ask(&xs, 'w', 0) == 1, "x waiting again");
    CHECK(ask(&y, 'c', 2 * MS) == 0, "y waits for it");
    kill(xs.pid, SIGSTOP);
    dt = time_to_go(&y, 2 * MS, 100 * MS);
    CHECK(dt < 20 * MS, "a waiting process stopped held y for %llu us",
          (unsigned long long)(dt / 1000));
    kill(xs.pid, SIGKILL);
    waitpid(xs.pid, NULL, 0);

    /* At most DEPTH (3) launches in flight over all containers. */
    ask(&x, 'a', 0);
    ask(&x, 'a', 0);
    CHECK(ask(&y, 'c', 0) == 1, "2 in flight: y goes");
    ask(&y, 'a', 0);
    CHECK(ask(&y, 'c', 0) == 0, "3 in flight: y waits");
    CHECK(ask(&x, 'c', 0) == 0, "3 in flight: x waits");
    ask(&x, 's', 0);
    CHECK(ask(&y, 'c', 0) == 1, "one measured: y goes");
    ask(&y, 's', 0);
    ask(&x, 's', 0);

    /* Killed with launches in flight: they stop counting within FRESH_NS
     * (20 ms) of its last sign of life. */
    struct child xk = spawn("x");
    ask(&xk, 'a', 0);
    ask(&xk, 'a', 0);
    ask(&xk, 'a', 0);
    CHECK(ask(&y, 'c', 0) == 0, "x's process has 3 in flight: y waits");
    kill(xk.pid, SIGKILL);
    waitpid(xk.pid, NULL, 0);
    dt = time_to_go(&y, 0, 500 * MS);
    CHECK(dt < 60 * MS, "a process killed with launches in flight held y for %llu us",
          (unsigned long long)(dt / 1000));

    /* A forked child has its own slot: its launches in flight are its own,
     * and its parent's settlements do not take them back. */
    struct child xf = spawn("x");
    ask(&y, 'a', 0);                /* y launched lately */
    ask(&y, 's', 0);
    ask(&xf, 'a', 0);
    int r = -99;
    tell(&xf, 'f');
    if (read(xf.from, &r, sizeof r) != sizeof r)
        r = -97;
    CHECK(r == 0, "the forked child sees 4 in flight (3 its own): waits (got %d)", r);
    ask(&xf, 's', 0);
    CHECK(ask(&y, 'c', 0) == 0, "the parent's settlement left the child's 3 in flight");
    ask(&xf, 'k', 0);
    dt = time_to_go(&y, 0, 500 * MS);
    CHECK(dt < 60 * MS, "a forked child killed with launches in flight held y for %llu us",
          (unsigned long long)(dt / 1000));
    finish(&xf);

    finish(&x);
    finish(&y);

    /* A file of another layout: not used, said once, nothing waits. */
    unlink(path);
    int fd = open(path, O_RDWR | O_CREAT, 0600);
    long long junk[64];
    memset(junk, 0x5a, sizeof junk);
    CHECK(fd >= 0 && write(fd, junk, sizeof junk) == (ssize_t)sizeof junk, "write junk");
    close(fd);
    x = spawn("x");
    y = spawn("y");
    ask(&x, 'a', 0);
    CHECK(ask(&y, 'c', 0) == -1, "a file of another layout: not in play");
    finish(&x);
    finish(&y);

    /* No node directory: not in play. */
    node_dir[0] = 0;
    x = spawn("x");
    CHECK(ask(&x, 'c', 0) == -1, "no node directory: not in play");
    finish(&x);

    if (gv_test_failures) {
        fprintf(stderr, "t_sm_arbiter: %d failure(s)\n", gv_test_failures);
        return 1;
    }
    printf("t_sm_arbiter: OK\n");
    return 0;
}
