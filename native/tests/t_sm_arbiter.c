/*
 * t_sm_arbiter - unit tests of the launch order between containers
 * (native/shim/sm_arbiter.c) and of the enqueue word (sm_enqueue.c), linked
 * alone with stand-ins for the region path, the node directory and the
 * log.
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
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
/* The region's device entry, shared by every process forked from here
 * (the enqueue word where there is no node directory). */
static struct gv_sm *entry_sm;

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
 * until killed), 'a' admitted, 'A' admitted with an estimate of `arg` ns, 's' settled, 'f' fork a child that is
 * admitted three times (it answers its own check's result, once held or
 * after 2 s, then stays alive), 'k' kill that child; with a clock `arg`
 * ns ahead, as if this process's clock were ahead (a file from before a
 * reboot, or another process's 1 s later): 'F' admitted three times, 'T'
 * check.  'n': its clock ran ahead (a turn it holds is over).  'L': its
 * container's limit is `arg` %.  'E' takes the enqueue word and keeps it (answers a struct took:
 * what it holds and when it asked), 'e' gives it back. */
struct took {
    uint64_t held, asked;
};

/* Each child's container is fixed-share at 20 % (at most 4 containers in
 * play at once: the turn fits) unless told otherwise ('L'), said as the
 * policy thread says it. */
static unsigned my_limit = 20;

static void terms(void)
{
    gv_arb_set_terms(0, (uint32_t)getpid(), my_limit, GV_SM_FIXED);
}

/* Before a process's first check, its slot is claimed (by a check) and
 * its terms said, as its policy thread says them within 100 ms of its
 * first launch. */
static void first_check(uint64_t tat, uint64_t now)
{
    static int said;
    if (!said) {
        gv_arb_check(0, UUID, tat, now, 0, 0, 0);
        terms();
        said = 1;
    }
}

/* Alive for good, as a process's meter is while its launches are in
 * flight. */
static void *beat(void *unused)
{
    (void)unused;
    for (;;) {
        usleep(100);
        gv_arb_alive(0, gv_mono_ns());
    }
    return NULL;
}

static void child_loop(int in, int out)
{
    pid_t grandchild = -1;
    uint64_t held = 0;
    for (;;) {
        char cmd;
        long long arg;
        if (read(in, &cmd, 1) != 1 || read(in, &arg, sizeof arg) != sizeof arg)
            _exit(0);
        terms();
        uint64_t now = gv_mono_ns();
        int r = 0;
        switch (cmd) {
        case 'c':
            first_check(now + (uint64_t)arg, now);
            r = gv_arb_check(0, UUID, now + (uint64_t)arg, now, 0, 0, 0);
            break;
        case 'w':
            first_check(now + (uint64_t)arg, now);
            r = gv_arb_check(0, UUID, now + (uint64_t)arg, now, 0, 0, 0);
            if (write(out, &r, sizeof r) != sizeof r)
                _exit(1);
            for (;;) {
                usleep(50);
                terms();
                now = gv_mono_ns();
                gv_arb_check(0, UUID, now + (uint64_t)arg, now, 0, 0, 0);
            }
        case 'a':
            gv_arb_admitted(0, UUID, now, MS);
            break;
        case 'A':
            gv_arb_admitted(0, UUID, now, (uint64_t)arg);
            break;
        case 'F':
            for (int i = 0; i < 3; i++)
                gv_arb_admitted(0, UUID, now + (uint64_t)arg, MS);
            break;
        case 'T':
            first_check(now + (uint64_t)arg, now + (uint64_t)arg);
            r = gv_arb_check(0, UUID, now + (uint64_t)arg, now + (uint64_t)arg, 0, 0, 0);
            break;
        case 's':
            gv_arb_settled(0);
            break;
        case 'q':           /* its last check saw no other container */
            r = gv_arb_quiet_at(0) != 0;
            break;
        case 'n':
            gv_arb_not_waiting(0);
            break;
        case 'L':
            my_limit = (unsigned)arg;
            break;
        case 'E': {
            struct took t = { 0, now };
            t.held = held = gv_sm_enqueue_begin(entry_sm, 0);
            if (write(out, &t, sizeof t) != sizeof t)
                _exit(1);
            continue;
        }
        case 'e':
            gv_sm_enqueue_end(entry_sm, 0, held);
            held = 0;
            break;
        case 'f': {
            pid_t p = fork();
            grandchild = p;
            if (p == 0) {
                gv_arb_admitted(0, UUID, gv_mono_ns(), MS);
                gv_arb_admitted(0, UUID, gv_mono_ns(), MS);
                gv_arb_admitted(0, UUID, gv_mono_ns(), MS);
                terms();
                /* Until held, for up to 2 s: the parent keeps the other
                 * container launching meanwhile. */
                uint64_t t0 = gv_mono_ns();
                do {
                    now = gv_mono_ns();
                    r = gv_arb_check(0, UUID, now, now, 0, 0, 0);
                    if (r != 0)
                        usleep(1000);
                } while (r != 0 && gv_mono_ns() - t0 < 2000 * MS);
                if (write(out, &r, sizeof r) != sizeof r)
                    _exit(1);
                beat(NULL);
            }
            /* This process's launch stays in flight: its meter keeps it
             * alive, or after FRESH_NS (20 ms; a loaded machine may take
             * that long to run the grandchild) it would stop counting and
             * the grandchild would take the turn. */
            pthread_t t;
            if (pthread_create(&t, NULL, beat, NULL) != 0)
                _exit(1);
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
        terms();
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

/* c takes the enqueue word: what it holds, when it asked, and when it got
 * the answer (the parent's clock). */
static struct took take(struct child *c, uint64_t *answered)
{
    struct took t = { 0, 0 };
    char cmd = 'E';
    long long arg = 0;
    if (write(c->to, &cmd, 1) != 1 || write(c->to, &arg, sizeof arg) != sizeof arg ||
        read(c->from, &t, sizeof t) != sizeof t)
        t.held = 0;
    *answered = gv_mono_ns();
    return t;
}

/* Two processes (containers on one node, or processes of one container)
 * take the enqueue word: the second waits until the first gives it back,
 * or for at most 2 ms after the first took it (STALE_NS), killed or not;
 * never longer.  word: where it is, for the parent to read. */
static void check_enqueue(struct child *a, struct child *b, _Atomic uint64_t *word,
                          const char *where)
{
    uint64_t got;
    struct took ta = take(a, &got);
    CHECK(ta.held && atomic_load(word) == ta.held, "%s: a holds the word", where);
    ask(a, 'e', 0);
    CHECK(atomic_load(word) == 0, "%s: given back", where);

    /* Held by a: b gets it 2 ms after a took it, not before. */
    ta = take(a, &got);
    struct took tb = take(b, &got);
    CHECK(tb.held && tb.held >= ta.held + 2 * MS,
          "%s: b took the word %lld us after a, who kept it", where,
          (long long)(tb.held - ta.held) / 1000);
    ask(a, 'e', 0);
    CHECK(atomic_load(word) == tb.held, "%s: a's late give-back left b's hold", where);
    ask(b, 'e', 0);

    /* Killed while holding it: b waits no longer than that. */
    ta = take(a, &got);
    kill(a->pid, SIGKILL);
    waitpid(a->pid, NULL, 0);
    tb = take(b, &got);
    CHECK(tb.held >= ta.held + 2 * MS && got - tb.asked < 100 * MS,
          "%s: a killed while holding the word held b for %lld us", where,
          (long long)(got - tb.asked) / 1000);
    ask(b, 'e', 0);

    /* A word from before a reboot (an hour ahead of the clock): free. */
    atomic_store(word, (gv_mono_ns() + 3600000 * MS) | 1);
    tb = take(b, &got);
    CHECK(tb.held && tb.held < gv_mono_ns() && got - tb.asked < 100 * MS,
          "%s: a word from before a reboot held b for %lld us", where,
          (long long)(got - tb.asked) / 1000);
    ask(b, 'e', 0);
}

/* take(), but gives up (held 0) when c has not answered within ms. */
static struct took take_within(struct child *c, int ms, uint64_t *answered)
{
    struct took t = { 0, 0 };
    char cmd = 'E';
    long long arg = 0;
    struct pollfd p = { c->from, POLLIN, 0 };
    if (write(c->to, &cmd, 1) != 1 || write(c->to, &arg, sizeof arg) != sizeof arg ||
        poll(&p, 1, ms) != 1 || read(c->from, &t, sizeof t) != sizeof t)
        t.held = 0;
    *answered = gv_mono_ns();
    return t;
}

/* A neighbour that keeps storing the current time in the node's enqueue
 * word (the file is mode 0666, in every container): each launch waits for
 * it at most 4 ms, then takes its region's word, and the process leaves
 * the node's word alone for 250 ms; afterwards it takes the node's again.
 * The neighbour stores a time 1 ms ahead of the clock, so that its word
 * still looks held when it is itself descheduled for up to 3 ms; one
 * descheduled for longer (a loaded 2-core machine) leaves the word stale,
 * and a launch may then rightly take it: so the bound is checked on the
 * launches that went by the region's word, and every launch within 100 ms.
 * c: a process of a container with the node's file mapped. */
static void check_stalled_word(struct child *c, _Atomic uint64_t *word)
{
    atomic_store(word, 0);
    pid_t hostile = fork();
    if (hostile == 0) {
        for (;;) {
            atomic_store(word, (gv_mono_ns() + MS) | 1);
            usleep(10);
        }
    }
    for (uint64_t t0 = gv_mono_ns(); !atomic_load(word) && gv_mono_ns() - t0 < 1000 * MS;)
        usleep(100);    /* until it has started */
    uint64_t got, first = 0, worst = 0;
    int tagged = 0, consistent = 0, n = 20, answered = 0, tried = 0;
    /* 20 launches, and more (up to 200) until one went by the region's
     * word: a neighbour descheduled for over 3 ms at every try leaves
     * nothing to wait for (8 sanitizer runs on 2 busy cores did that). */
    for (int i = 0; i < n || (!tagged && i < 200); i++) {
        tried++;
        struct took t = take_within(c, 2000, &got);
        if (!t.held)
            break;
        answered++;
        uint64_t waited = got - t.asked;
        if ((t.held & 2) && !tagged++)
            first = waited;     /* the launch that waited out the bound */
        else
            worst = waited > worst ? waited : worst;
        consistent += (t.held & 2) != 0 && atomic_load(&entry_sm->enqueue) == (t.held & ~2ULL);
        ask(c, 'e', 0);
    }
    CHECK(answered == tried, "a neighbour storing the time in the node's word: %d of %d "
          "launches went within 2 s", answered, tried);
    CHECK(tagged > 0 && consistent == tagged, "%d of %d went by the region's word, %d of them "
          "holding it", tagged, answered, consistent);
    CHECK(first >= 4 * MS && first < 100 * MS, "the first by the region's word waited %lld us "
          "(4 ms bound)", (long long)first / 1000);
    CHECK(worst < 100 * MS, "a launch waited %lld us", (long long)worst / 1000);
    printf("t_sm_arbiter: stalled node word: the first launch by the region's word waited %lld "
           "us, %d went by it, the others at most %lld us\n", (long long)first / 1000, tagged,
           (long long)worst / 1000);
    kill(hostile, SIGKILL);
    waitpid(hostile, NULL, 0);
    if (answered != tried) {
        kill(c->pid, SIGKILL);  /* still waiting for the word */
        return;
    }
    atomic_store(word, 0);
    usleep(300 * 1000);
    struct took t = take_within(c, 2000, &got);
    CHECK(t.held && !(t.held & 2) && atomic_load(word) == t.held,
          "250 ms after the neighbour stopped the node's word is taken again");
    ask(c, 'e', 0);
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
/* How soon, at most, a process killed or stopped while it holds the turn
 * or has launches in flight lets the others go, as the test checks it: it
 * lets go FRESH_NS (20 ms) after its last sign of life, and a slot that
 * did not would hold them until STALE_NS (1 s); the rest is what a loaded
 * 2-core machine adds between the kill and the others' next check (CI saw
 * 87 ms with sanitizer runs beside it). */
#define DIED_MS 250

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

/* c launches and its launch is measured: c's container launched lately
 * (the launch order is in play for the others for ACTIVE_NS, 50 ms; on a
 * loaded machine that long may pass between two steps of a test). */
static void lately(struct child *c)
{
    ask(c, 'a', 0);
    ask(c, 's', 0);
}

/* One turn of `holder` with `waiter` waiting, as the gate drives it: the
 * holder takes the turn (its clock 10 ms behind the waiter's), launches
 * kernels estimated at `cost` until its check says the turn is over, and
 * its launches are measured.  Before each of the holder's checks the
 * waiter renews its claim; a check more than 1.5 ms after it (a loaded
 * machine: the claim lasts 2 ms) launches nothing and is asked again.
 * What the holder charged, or 0 when the turn did not go so within 2 s or
 * the holder's last turn ended over `fresh` ns ago (then the carry is
 * forgotten by design: the caller runs again). */
static uint64_t one_turn(struct child *holder, struct child *waiter, long long cost,
                         uint64_t *ended, uint64_t fresh)
{
    uint64_t t0 = gv_mono_ns(), charged = 0;
    int r;
    do
        r = ask(holder, 'c', -30 * (long long)MS);
    while (r != 1 && gv_mono_ns() - t0 < 2000 * MS);
    if (r != 1)
        return 0;
    int valid = !*ended || gv_mono_ns() - *ended < fresh;
    int n = 0;
    ask(holder, 'A', cost);
    charged += (uint64_t)cost;
    n++;
    for (;;) {
        uint64_t claimed = gv_mono_ns();
        ask(waiter, 'c', -20 * (long long)MS);
        r = ask(holder, 'c', 0);
        if (r == 0)
            break;
        if (r != 1 || gv_mono_ns() - t0 > 2000 * MS) {
            valid = 0;
            break;
        }
        if (gv_mono_ns() - claimed > 1500 * 1000ULL)
            continue;
        ask(holder, 'A', cost);
        charged += (uint64_t)cost;
        n++;
    }
    *ended = gv_mono_ns();
    for (int i = 0; i < n; i++)
        ask(holder, 's', 0);
    return valid ? charged : 0;
}

/* Whether c, with a clock `ahead` ns ahead of now, gets `want` from its
 * check within 2 s, next to peer's container, which launches lately before
 * each try.  What the checks see is fixed by the steps before them, except
 * that claims lapse with time: a waiting claim 0.3 ms after its last
 * renewal, in-flight launches 20 ms after their process's last sign of
 * life.  On a loaded machine (sanitizers, 2 cores) a process may miss a
 * renewal now and then, so one check alone may find a claim lapsed. */
static int expect(struct child *c, struct child *peer, long long ahead, int want)
{
    uint64_t t0 = gv_mono_ns();
    do {
        lately(peer);
        if (ask(c, 'c', ahead) == want)
            return 1;
    } while (gv_mono_ns() - t0 < 2000 * MS);
    return 0;
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
    entry_sm = mmap(NULL, sizeof *entry_sm, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                     -1, 0);
    if (entry_sm == MAP_FAILED)
        return 2;

    /* Alone on the device: not in play. */
    struct child x = spawn("x"), y = spawn("y");
    int r;
    CHECK(ask(&x, 'c', 0) == -1, "a container alone: the launch order is not in play");
    CHECK(ask(&x, 'q', 0) == 1, "a container alone: its check saw no other (gv_arb_quiet_at)");
    CHECK(ask(&x, 'a', 0) == 0, "admitted");
    CHECK(ask(&x, 's', 0) == 0, "settled");

    /* Next to a container that launched lately, with nothing in flight and
     * nobody waiting: go. */
    CHECK(expect(&y, &x, 2 * MS, 1), "nothing in flight: go");
    CHECK(ask(&y, 'q', 0) == 0, "next to x, which launched lately: not quiet (gv_arb_quiet_at)");
    lately(&y);

    /* The process furthest behind its share takes a free turn.  y holds
     * the turn with a launch in flight; another process of x waits with its
     * clock at now (and keeps checking).  y charges 12 ms in all: with x
     * waiting its turn is over, and y, 2 ms ahead of x, waits too; once
     * y's launches are measured x takes the turn. */
    struct child xw = spawn("x");
    CHECK(expect(&y, &x, 0, 1), "y holds the turn");
    ask(&y, 'a', 0);
    CHECK(ask(&xw, 'w', 0) == 0, "x waits while y holds the turn with a launch in flight");
    for (int i = 0; i < 10; i++)
        ask(&y, 'a', 0);
    /* (x's claim to wait lapses 0.3 ms after its last check: a loaded
     * machine may deschedule x that long, and y's check then rightly goes;
     * x's next check renews it.) */
    r = -99;
    for (uint64_t t2 = gv_mono_ns(); r != 0 && gv_mono_ns() - t2 < 2000 * MS; usleep(100))
        r = ask(&y, 'c', 2 * MS);
    CHECK(r == 0, "y's turn is over; 2 ms ahead of a waiting x, y waits (got %d)", r);
    for (int i = 0; i < 11; i++)
        ask(&y, 's', 0);
    usleep(5000);                   /* x takes it (its checks every 50 us) */
    /* Killed holding it, nothing in flight: within LAPSE_NS, and at worst
     * FRESH_NS (20 ms) after its last sign of life; loaded machines. */
    kill(xw.pid, SIGKILL);
    waitpid(xw.pid, NULL, 0);
    uint64_t dt = time_to_go(&y, 2 * MS, 500 * MS);
    CHECK(dt < DIED_MS * MS, "a waiting process killed held y for %llu us",
          (unsigned long long)(dt / 1000));

    /* The turn: one process at a time has work on the device.  y holds it
     * (it went last); with launches in flight it keeps it, and x waits. */
    CHECK(expect(&y, &x, 0, 1), "y holds the turn");
    ask(&y, 'a', 0);
    ask(&y, 'a', 0);
    CHECK(expect(&x, &y, 0, 0), "y holds the turn with 2 in flight: x waits");
    ask(&y, 's', 0);
    ask(&y, 's', 0);
    /* Idle for LAPSE_NS (0.2 ms) with nothing in flight: it lets go. */
    dt = time_to_go(&x, 0, 100 * MS);
    CHECK(dt < 20 * MS, "y idle with nothing in flight held x for %llu us",
          (unsigned long long)(dt / 1000));
    /* x charges 11 ms (a turn is at most 10 ms while another waits): at its next
     * check, with y waiting and behind it, it gives the turn back; y takes
     * it only once x's launches are measured (the device drained). */
    for (int i = 0; i < 11; i++)
        ask(&x, 'a', 0);
    r = -99;
    uint64_t t1 = gv_mono_ns();
    do {        /* (y's claim to wait lapses after 0.3 ms: asked together) */
        ask(&y, 'c', 0);
        r = ask(&x, 'c', 2 * MS);
    } while (r != 0 && gv_mono_ns() - t1 < 2000 * MS);
    CHECK(r == 0, "x's turn is over once it charged 10 ms with y waiting (got %d)", r);
    CHECK(ask(&y, 'c', 0) == 0, "x's launches still in flight: y waits for the drain");
    for (int i = 0; i < 11; i++)
        ask(&x, 's', 0);
    dt = time_to_go(&y, 0, 100 * MS);
    CHECK(dt < 20 * MS, "x drained: y waited %llu us more", (unsigned long long)(dt / 1000));

    /* Killed or stopped while holding the turn with launches in flight: its
     * word stops counting within FRESH_NS (20 ms) of its last sign of life. */
    for (int stop = 0; stop < 2; stop++) {
        struct child xk = spawn("x");
        dt = time_to_go(&xk, 0, 500 * MS);
        CHECK(dt < 100 * MS, "x's new process takes the turn (%llu us)",
              (unsigned long long)(dt / 1000));
        ask(&xk, 'a', 0);
        ask(&xk, 'a', 0);
        ask(&xk, 'a', 0);
        CHECK(expect(&y, &xk, 0, 0), "x's process holds the turn with 3 in flight: y waits");
        kill(xk.pid, stop ? SIGSTOP : SIGKILL);
        dt = time_to_go(&y, 0, 500 * MS);
        CHECK(dt < DIED_MS * MS, "a process %s holding the turn with launches in flight held y "
              "for %llu us", stop ? "stopped" : "killed", (unsigned long long)(dt / 1000));
        kill(xk.pid, SIGKILL);
        waitpid(xk.pid, NULL, 0);
    }

    /* A forked child has its own slot: its launches in flight are its own,
     * and its parent's settlements do not take them back. */
    struct child xf = spawn("x");
    ask(&xf, 'a', 0);
    r = -99;
    tell(&xf, 'f');
    for (;;) {                      /* y launches lately until it answers */
        lately(&y);
        struct pollfd pfd = { .fd = xf.from, .events = POLLIN };
        if (poll(&pfd, 1, 1) != 0) {
            if (read(xf.from, &r, sizeof r) != sizeof r)
                r = -97;
            break;
        }
    }
    CHECK(r == 0, "the forked child sees 4 in flight (3 its own): waits (got %d)", r);
    ask(&xf, 's', 0);
    CHECK(expect(&y, &xf, 0, 0), "the parent's settlement left the child's 3 in flight");
    ask(&xf, 'k', 0);
    dt = time_to_go(&y, 0, 500 * MS);
    CHECK(dt < DIED_MS * MS, "a forked child killed with launches in flight held y for %llu us",
          (unsigned long long)(dt / 1000));
    finish(&xf);

    /* A process silent for over 1 s loses its slot to another (here q,
     * whose clock is 1.5 s ahead, so x's slot, the first, looks that old to
     * it): what the old owner says then is not counted for the new one.
     * q has 3 in flight; x settling three times must not take them back. */
    struct child q = spawn("q");
    uint64_t t0 = gv_mono_ns();
    ask(&y, 'n', 0);                /* y holds the turn no longer */
    do {        /* again if too slow a machine let q's word lapse meanwhile */
        ask(&q, 'F', 1500 * MS);
        ask(&x, 's', 0);
        ask(&x, 's', 0);
        ask(&x, 's', 0);
        r = ask(&y, 'T', 1500 * MS);
    } while (r != 0 && gv_mono_ns() - t0 < 2000 * MS);
    CHECK(r == 0, "x's settlements left the slot's new owner its 3 in flight (got %d)", r);
    finish(&q);

    /* A process killed with 3 launches in flight and its clock an hour
     * ahead (what a file that outlived a reboot holds): its slot counts for
     * nothing, although its beat looks fresh until the clock catches up. */
    struct child z = spawn("z");
    ask(&z, 'F', 3600000 * MS);
    kill(z.pid, SIGKILL);
    waitpid(z.pid, NULL, 0);
    CHECK(expect(&y, &x, 0, 1), "a slot from before a reboot holds nobody");

    /* A waiter whose thread got no CPU for 1 ms (a loaded machine) still
     * counts as waiting: the holder that charged its turn gives it back,
     * instead of keeping it as if nobody waited (the claim lapsed after
     * 0.3 ms before).  Rounds where more than 1.8 ms passed between x's
     * claim and y's check do not count (the claim lasts 2 ms). */
    int rounds = 0, gave = 0, kept = 0;
    for (uint64_t t2 = gv_mono_ns(); rounds < 5 && gv_mono_ns() - t2 < 5000 * MS;) {
        if (time_to_go(&y, 0, 100 * MS) == UINT64_MAX)
            continue;
        for (int i = 0; i < 11; i++)
            ask(&y, 'a', 0);
        uint64_t claimed = gv_mono_ns();     /* before x's claim, after y's check */
        int w = ask(&x, 'c', 0);
        usleep(1000);
        r = ask(&y, 'c', 2 * MS);
        uint64_t gap = gv_mono_ns() - claimed;
        for (int i = 0; i < 11; i++)
            ask(&y, 's', 0);
        if (w != 0 || gap > 1800 * 1000ULL)
            continue;
        rounds++;
        if (r == 0)
            gave++;
        else
            kept++;
    }
    CHECK(rounds > 0 && kept == 0, "a waiter silent for 1 ms: y gave its turn back in %d of "
          "%d rounds (kept it in %d)", gave, rounds, kept);

    /* A turn is the holder's container's limit's part of a 20 ms cycle
     * (TURN_CYCLE_NS), so that every container gets a turn each cycle: at
     * 10:90, 2 ms for x and 18 ms for y.  With y waiting, x gives its turn
     * back once it charged 2 ms (it kept it up to 10 ms before the cycle: a
     * window of 100 ms then held 0, 1 or 2 of x's turns); y, with x
     * waiting, keeps its turn after 10 ms and gives it back after 20.
     * Rounds where y's claim lapsed (a loaded machine) are tried again. */
    ask(&x, 'L', 10);
    ask(&y, 'L', 90);
    int xr = -99, yr = -99;
    for (uint64_t t2 = gv_mono_ns(); xr != 0 && gv_mono_ns() - t2 < 5000 * MS;) {
        ask(&y, 'n', 0);            /* y holds no turn, and does not wait */
        if (!expect(&x, &y, 0, 1))  /* x takes the turn, y launched lately */
            continue;
        ask(&x, 'a', 0);
        ask(&x, 'a', 0);
        ask(&y, 'c', 0);            /* y waits (x has 2 in flight) */
        xr = ask(&x, 'c', 2 * MS);
        ask(&x, 's', 0);
        ask(&x, 's', 0);
        ask(&x, 'n', 0);            /* a turn x still holds ends: each round a new one */
    }
    CHECK(xr == 0, "x at 10 %% gave its turn back after 2 ms with y waiting (got %d)", xr);
    /* (Rounds count where y then gave its turn back after 20 ms: x's
     * claim, renewed before each of y's checks, was seen.) */
    int yrounds = 0;
    for (uint64_t t2 = gv_mono_ns(); yrounds < 3 && gv_mono_ns() - t2 < 5000 * MS;) {
        /* Its last round charged 1 ms beyond its turn: forgotten after
         * 50 ms (ACTIVE_NS), so that this checks the length alone. */
        usleep(60 * 1000);
        ask(&x, 'n', 0);
        if (!expect(&y, &x, 0, 1))
            continue;
        for (int i = 0; i < 10; i++)
            ask(&y, 'a', 0);
        ask(&x, 'c', 0);            /* x waits */
        int r10 = ask(&y, 'c', 2 * MS);
        for (int i = 0; i < 10; i++)
            ask(&y, 'a', 0);
        ask(&x, 'c', 0);
        int r20 = ask(&y, 'c', 2 * MS);
        for (int i = 0; i < 20; i++)
            ask(&y, 's', 0);
        ask(&y, 'n', 0);
        if (r20 != 0)
            continue;
        yrounds++;
        if (r10 != 1)
            yr = r10;
    }
    CHECK(yrounds > 0 && yr == -99, "y at 90 %% kept its turn after 10 ms with x waiting in each "
          "of %d rounds (got %d once)", yrounds, yr);

    /* Turns average their length: what a turn charged beyond it is
     * charged at the start of the holder's next turn.  At 30:70 with
     * kernels of 1.65 ms (an H200's 8192 products), x's turns of 3 ms held
     * 2 kernels and y's of 7 ms 5 (3.3 and 8.25 ms): x got 28.6 % of the
     * work.  Now over 30 cycles x's part of what both charged is within
     * 0.75 points of 30 %.  Runs where a cycle took over 40 ms (a loaded
     * machine; a carry is forgotten after 50 ms) or a turn did not go as
     * it should are run again. */
    ask(&x, 'L', 30);
    ask(&y, 'L', 70);
    double part = -1;
    for (uint64_t t2 = gv_mono_ns(); part < 0 && gv_mono_ns() - t2 < 10000 * MS;) {
        /* The processes of x killed above no longer count as in play
         * (FRESH_NS, 20 ms; x's turns would be half as long), nor do
         * carries from the rounds above (ACTIVE_NS, 50 ms). */
        usleep(60 * 1000);
        ask(&x, 'n', 0);
        ask(&y, 'n', 0);
        lately(&x);
        lately(&y);
        uint64_t xe = 0, ye = 0, xs = 0, ys = 0;
        int ok = 1;
        for (int cycle = 0; ok && cycle < 32; cycle++) {
            uint64_t cx = one_turn(&x, &y, 1650 * 1000LL, &xe, 40 * MS);
            uint64_t cy = cx ? one_turn(&y, &x, 1650 * 1000LL, &ye, 40 * MS) : 0;
            ok = cx && cy;
            if (cycle >= 2) {       /* from the first turns' carries on */
                xs += cx;
                ys += cy;
            }
        }
        if (ok)
            part = 100.0 * (double)xs / (double)(xs + ys);
    }
    printf("t_sm_arbiter: 30:70, 1.65 ms kernels: x charged %.2f %% of both's turns\n", part);
    CHECK(part > 29.25 && part < 30.75, "30:70 with 1.65 ms kernels: x's part of the charged work "
          "%.2f %% (30 within 0.75 points; whole kernels per turn gave 28.6)", part);

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

    /* No node directory: not in play; the enqueue word is the region's,
     * for the container's processes. */
    node_dir[0] = 0;
    x = spawn("x");
    CHECK(ask(&x, 'c', 0) == -1, "no node directory: not in play");
    finish(&x);
    struct child ea = spawn("x"), eb = spawn("x");
    ask(&ea, 'a', 0);
    ask(&eb, 'a', 0);
    check_enqueue(&ea, &eb, &entry_sm->enqueue, "region");
    finish(&ea);
    finish(&eb);

    /* The enqueue word in the node's file, for every container (last: the
     * parent maps the file, and its children would inherit that). */
    snprintf(node_dir, sizeof node_dir, "%s/node", argv[1]);
    unlink(path);
    ea = spawn("x");
    eb = spawn("y");
    ask(&ea, 'a', 0);
    ask(&eb, 'a', 0);
    gv_arb_check(0, UUID, gv_mono_ns(), gv_mono_ns(), 0, 0, 0);    /* maps it here too */
    _Atomic uint64_t *node_word = gv_arb_enqueue_word(0);
    CHECK(node_word != NULL, "the node's file holds an enqueue word");
    if (node_word)
        check_enqueue(&ea, &eb, node_word, "node");
    CHECK(atomic_load(&entry_sm->enqueue) == 0, "with a node file the region's word is unused");
    if (node_word)
        check_stalled_word(&eb, node_word);   /* ea was killed */
    finish(&ea);
    finish(&eb);

    if (gv_test_failures) {
        fprintf(stderr, "t_sm_arbiter: %d failure(s)\n", gv_test_failures);
        return 1;
    }
    printf("t_sm_arbiter: OK\n");
    return 0;
}
