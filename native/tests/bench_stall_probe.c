/*
 * bench_stall_probe.c - how late this machine wakes a thread up, per CPU,
 * while the SM-quota benchmark runs (make bench-sm, tests/bench/sm_bench.py).
 *
 * usage: bench_stall_probe END_NS [PERIOD_US]
 *
 * One thread per CPU the process may run on, pinned to it, asks to be woken
 * every PERIOD_US (default 250) on an absolute CLOCK_MONOTONIC schedule
 * until END_NS, and notes every wake-up that came 1 ms or more late.  The
 * threads ask for SCHED_FIFO (priority 1): a thread the kernel may run at
 * once is then late only when the CPU itself was unavailable - the
 * hypervisor ran something else, or kernel work that cannot be preempted
 * held it - not because the benchmark's own processes were busy.  Without
 * the privilege they stay SCHED_OTHER and say so ("fifo": false): then
 * their lateness also counts the benchmark's own load.
 *
 * On a 2-CPU virtual machine, idle, a SCHED_OTHER thread woken every
 * 100 us was late by 1 ms or more 37-40 times in 10 s (up to 6.9 ms), a
 * SCHED_FIFO one 5-21 times (up to 6.6 ms), while Linux's steal counter
 * rose by 0.09 s.  The launchers and meter threads of the benchmark, which
 * are SCHED_OTHER, wait at least as long as these threads (also for kernel
 * threads a FIFO thread preempts: kdamond ran up to 4.1 ms at a time in a
 * sched_switch trace), and the simulated device drains meanwhile.  The
 * benchmark prints these stalls next to each window that misses its goal:
 * a miss with none near it is not the machine's doing.
 *
 * At END_NS: one JSON line, {"fifo": bool, "cpus": n, "period_us": p,
 * "stalls": [[cpu, at_ns, late_ns], ...]} (at_ns: when the wake-up was
 * due).  Exit 0, or 2 on bad arguments.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define MAX_CPUS 256
#define MAX_STALLS 4096                 /* per CPU */
#define LATE_NS 1000000ULL

struct probe {
    int cpu;
    int fifo;
    unsigned n;
    uint64_t at[MAX_STALLS], late[MAX_STALLS];
};

static uint64_t end_ns, period_ns;

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void *run(void *arg)
{
    struct probe *p = arg;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(p->cpu, &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    struct sched_param sp = { .sched_priority = 1 };
    p->fifo = pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp) == 0;
    uint64_t due = mono_ns() + period_ns;
    while (due < end_ns) {
        struct timespec ts = { (time_t)(due / 1000000000ULL), (long)(due % 1000000000ULL) };
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
            ;
        uint64_t now = mono_ns();
        if (now - due >= LATE_NS && p->n < MAX_STALLS) {
            p->at[p->n] = due;
            p->late[p->n++] = now - due;
        }
        due += period_ns;
        if (due <= now)                 /* missed ticks: the next one ahead */
            due = now + period_ns - (now - due) % period_ns;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: bench_stall_probe END_NS [PERIOD_US]\n");
        return 2;
    }
    char *e;
    end_ns = strtoull(argv[1], &e, 10);
    if (*e || !end_ns) {
        fprintf(stderr, "bench_stall_probe: END_NS: not a CLOCK_MONOTONIC time: '%s'\n", argv[1]);
        return 2;
    }
    unsigned long us = 250;
    if (argc == 3) {
        us = strtoul(argv[2], &e, 10);
        if (*e || us == 0 || us > 100000) {
            fprintf(stderr, "bench_stall_probe: PERIOD_US: expected 1..100000, got '%s'\n", argv[2]);
            return 2;
        }
    }
    period_ns = us * 1000ULL;
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof mine, &mine) != 0)
        return 2;
    static struct probe probes[MAX_CPUS];
    pthread_t th[MAX_CPUS];
    int n = 0;
    for (int c = 0; c < MAX_CPUS && c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &mine))
            continue;
        probes[n].cpu = c;
        if (pthread_create(&th[n], NULL, run, &probes[n]) != 0)
            break;
        n++;
    }
    int fifo = n > 0;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        fifo = fifo && probes[i].fifo;
    }
    printf("{\"fifo\": %s, \"cpus\": %d, \"period_us\": %lu, \"stalls\": [",
           fifo ? "true" : "false", n, us);
    const char *sep = "";
    for (int i = 0; i < n; i++) {
        for (unsigned k = 0; k < probes[i].n; k++) {
            printf("%s[%d, %llu, %llu]", sep, probes[i].cpu,
                   (unsigned long long)probes[i].at[k], (unsigned long long)probes[i].late[k]);
            sep = ", ";
        }
    }
    printf("]}\n");
    return 0;
}
