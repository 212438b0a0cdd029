/* region_proc.c - who we are, who is alive, and waiting politely. */
#include "region_impl.h"

#include "gpuvisor.h"
#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>

/* ---- process-local state ------------------------------------------------ */

static _Atomic uint64_t g_self_owner;   /* this process; reset in a fork child */
_Atomic uint32_t rg_fork_gen;     /* bumped in every fork child */
static _Atomic uint64_t g_image;        /* random per loaded image */
static _Atomic unsigned g_test_delay_us;
pthread_once_t rg_atfork_once = PTHREAD_ONCE_INIT;

static _Thread_local uint64_t t_owner;      /* this thread's (tid, start) */
static _Thread_local uint32_t t_owner_gen;
static _Thread_local uint64_t t_rng;

static void atfork_child(void)
{
    atomic_store(&g_self_owner, 0);
    atomic_fetch_add(&rg_fork_gen, 1);
}

void rg_register_atfork(void)
{
    pthread_atfork(NULL, NULL, atfork_child);
}

uint64_t rg_make_owner(int32_t pid, uint64_t start)
{
    return ((start & START_MASK) << PID_BITS) | ((uint64_t)(uint32_t)pid & PID_MASK);
}

int rg_owner_alive(uint64_t w)
{
    w &= ~FLAG_BIT;
    return gv_proc_alive((int32_t)(w & PID_MASK), w >> PID_BITS);
}

int rg_owner_left(gv_region *r, uint64_t w)
{
    w &= ~FLAG_BIT;
    return gv_proc_maps_file((int32_t)(w & PID_MASK), r->path) == 0;
}

uint64_t rg_self_owner(void)
{
    uint64_t w = atomic_load(&g_self_owner);
    if (w == 0) {
        int32_t pid = (int32_t)getpid();
        uint64_t start = gv_proc_start_time(pid);
        w = rg_make_owner(pid, start);
        if (start != 0)           /* unreadable now (fd table full): ask again */
            atomic_store(&g_self_owner, w);
    }
    return w;
}

/* Identity of the calling thread, for short exclusive operations (device
 * initialisation, reclaiming) that another thread of the same process
 * must be able to tell apart from its own. */
uint64_t rg_thread_owner(void)
{
    uint32_t gen = atomic_load(&rg_fork_gen);
    if (t_owner == 0 || t_owner_gen != gen) {
        int32_t tid = (int32_t)syscall(SYS_gettid);
        uint64_t start = gv_proc_start_time(tid);
        if (start == 0)
            return rg_make_owner(tid, 0);   /* not cached: asked again next time */
        t_owner = rg_make_owner(tid, start);
        t_owner_gen = gen;
    }
    return t_owner;
}

uint64_t rg_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t rg_image_id(void)
{
    uint64_t v = atomic_load(&g_image);
    if (v == 0) {
        uint64_t n = rg_now_ns() ^ ((uint64_t)(uintptr_t)&g_image << 16) ^
                     ((uint64_t)getpid() << 40);
        n = n * UINT64_C(0x9E3779B97F4A7C15) | 1;
        uint64_t zero = 0;
        atomic_compare_exchange_strong(&g_image, &zero, n);
        v = atomic_load(&g_image);
    }
    return v;
}

void rg_test_delay(void)
{
    unsigned us = atomic_load_explicit(&g_test_delay_us, memory_order_relaxed);
    if (us != 0)
        usleep(us);
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

/* Random short wait between retries; the slot is mixed in so that forked
 * siblings (same inherited seed) do not back off in lockstep. */
void rg_backoff(int slot, int tries)
{
    if (t_rng == 0)
        t_rng = (rg_now_ns() ^ (uint64_t)(uintptr_t)&t_rng) | 1;
    t_rng ^= t_rng << 13;
    t_rng ^= t_rng >> 7;
    t_rng ^= t_rng << 17;
    uint64_t v = t_rng ^ ((uint64_t)(slot + 1) * UINT64_C(0x9E3779B97F4A7C15));
    if (tries > 2 || (v & 1))
        sched_yield();
    unsigned spins = (unsigned)((v >> 8) % (16u << (tries < 6 ? tries : 6)));
    for (unsigned i = 0; i < spins; i++)
        cpu_relax();
}

void rg_set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void rg_set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ---- liveness ------------------------------------------------------------ */

/* Reads state (field 3), number of threads (field 20) and start time
 * (field 22) of /proc/<pid>/stat.  Returns 0, or -1 with errno set. */
static int read_stat(int32_t pid, char *state, long *threads, uint64_t *start)
{
    char path[48], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n;
    do
        n = read(fd, buf, sizeof buf - 1);
    while (n < 0 && errno == EINTR);
    int saved = errno;
    close(fd);
    if (n <= 0) {
        errno = n < 0 ? saved : ESRCH;
        return -1;
    }
    buf[n] = '\0';
    /* comm (field 2) may hold spaces and ')': parse after the last ')'. */
    char *p = strrchr(buf, ')');
    if (p == NULL || p[1] != ' ' || p[2] == '\0') {
        errno = EINVAL;
        return -1;
    }
    *state = p[2];
    p += 3;
    /* p is at the space that ends field 3; step to field 22. */
    *threads = 0;
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (p == NULL) {
            errno = EINVAL;
            return -1;
        }
        p++;
        if (field + 1 == 20)
            *threads = strtol(p, NULL, 10);
    }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(p, &end, 10);
    if (end == p || errno != 0) {
        errno = EINVAL;
        return -1;
    }
    *start = v;
    return 0;
}

uint64_t gv_proc_start_time(int32_t pid)
{
    char st;
    uint64_t start;
    long threads;
    if (pid <= 0 || read_stat(pid, &st, &threads, &start) != 0)
        return 0;
    return start;
}

int gv_proc_maps_file(int32_t pid, const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0)
        return -1;
    char maps[48];
    snprintf(maps, sizeof maps, "/proc/%d/maps", (int)pid);
    FILE *f = fopen(maps, "re");
    if (f == NULL)
        return -1;
    char line[4096];
    int found = 0, read_any = 0;
    while (!found && fgets(line, sizeof line, f) != NULL) {
        read_any = 1;
        unsigned maj, mnr;
        unsigned long long ino;
        if (strchr(line, '\n') == NULL) {          /* a long path: skip the rest */
            int ch;
            while ((ch = fgetc(f)) != EOF && ch != '\n')
                ;
        }
        if (sscanf(line, "%*s %*s %*s %x:%x %llu", &maj, &mnr, &ino) == 3 &&
            ino == (unsigned long long)st.st_ino && maj == major(st.st_dev) &&
            mnr == minor(st.st_dev))
            found = 1;
    }
    fclose(f);
    return found ? 1 : read_any ? 0 : -1;
}

int gv_proc_alive(int32_t pid, uint64_t start)
{
    if (pid <= 0)
        return 0;
    int hidden = 0;
    if (kill(pid, 0) != 0) {
        if (errno != EPERM)
            return 0;
        hidden = 1;                 /* exists, another user's */
    }
    char st;
    long threads;
    uint64_t now;
    if (read_stat(pid, &st, &threads, &now) != 0) {
        /* Gone in between -> dead.  No usable /proc at all, or another
         * user's process that /proc hides (hidepid=2) -> trust kill(). */
        if (errno == ENOENT || errno == ESRCH)
            return hidden || access("/proc/self/stat", R_OK) != 0;
        return 1;
    }
    /* A zombie leader whose other threads still run (its main thread
     * called pthread_exit) is a live process. */
    if ((st == 'Z' || st == 'X' || st == 'x') && threads <= 1)
        return 0;
    return (now & START_MASK) == (start & START_MASK);
}
void region_test_set_delay_us(unsigned us)
{
    atomic_store(&g_test_delay_us, us);
}
