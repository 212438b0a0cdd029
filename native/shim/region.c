/*
 * region.c - the container-wide shared accounting region.  See region.h for
 * the accounting model and docs/region.md for the file format.
 *
 * Everything shared lives in the mapping; the handle holds only the mapping
 * and a per-process cache of the caller's slot, which a fork child drops.
 * The hot path (region_reserve / region_release / region_used) uses
 * sequentially consistent atomics only: no locks, no system calls except
 * sched_yield while backing off.
 */
#include "region.h"

#include "gpuvisor.h"
#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ---- layout ------------------------------------------------------------ */

#define CACHELINE 64

struct gv_header {
    uint64_t magic;
    uint32_t version;
    uint32_t header_size;      /* sizeof(struct gv_header) */
    uint64_t total_size;       /* sizeof(struct gv_shm) == file size */
    uint32_t max_slots;
    uint32_t max_devices;
    _Atomic uint32_t slot_hwm; /* slots [0, hwm) have ever been claimed */
    uint32_t reserved0;
    uint64_t created_unix;
    uint64_t reserved[2];
};

struct gv_dev {
    _Alignas(CACHELINE) _Atomic uint64_t state;   /* DEV_FREE/READY/INIT|owner */
    _Atomic uint64_t limit;                       /* GV_UNLIMITED: none */
    _Atomic uint64_t physical_total;
    _Atomic uint64_t oom_count;
    unsigned char uuid[16];                       /* valid once READY */
    _Alignas(CACHELINE) _Atomic uint64_t total;   /* sum of used[]: see below */
    _Alignas(CACHELINE) _Atomic uint64_t gate;    /* 0 open, else closer|FLAG_BIT */
    _Alignas(CACHELINE) _Atomic uint64_t used[GV_MAX_SLOTS];
    _Alignas(CACHELINE) _Atomic uint64_t inside[GV_MAX_SLOTS];  /* ops in progress */
};

struct gv_shm {
    struct gv_header hdr;
    _Alignas(CACHELINE) _Atomic uint64_t owner[GV_MAX_SLOTS];
    _Alignas(CACHELINE) _Atomic uint64_t image[GV_MAX_SLOTS];
    struct gv_dev dev[GV_MAX_DEVICES];
};

struct gv_region {
    struct gv_shm *m;
    _Atomic uint64_t slot_cache;   /* fork generation << 32 | slot state */
    char path[];
};

/* Owner words: start time << 22 | pid.  Bit 63 marks "being reclaimed by"
 * for slots and "being initialised by" for device entries. */
#define PID_BITS 22
#define PID_MASK ((UINT64_C(1) << PID_BITS) - 1)
#define START_MASK ((UINT64_C(1) << 41) - 1)
#define FLAG_BIT (UINT64_C(1) << 63)
#define DEV_FREE UINT64_C(0)
#define DEV_READY UINT64_C(1)

#define SLOT_NONE 0u
#define SLOT_CLAIMING 0xffffffffu

#define MAX_RESERVE (UINT64_C(1) << 62)   /* bigger requests: GV_ENOMEM */
#define RESERVE_TRIES 200

/* ---- process-local state ------------------------------------------------ */

static _Atomic uint64_t g_self_owner;   /* this process; reset in a fork child */
static _Atomic uint32_t g_fork_gen;     /* bumped in every fork child */
static _Atomic uint64_t g_image;        /* random per loaded image */
static _Atomic unsigned g_test_delay_us;
static _Atomic int g_release_underflow_logged;
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

static _Thread_local uint64_t t_owner;      /* this thread's (tid, start) */
static _Thread_local uint32_t t_owner_gen;
static _Thread_local uint64_t t_rng;

static void atfork_child(void)
{
    atomic_store(&g_self_owner, 0);
    atomic_fetch_add(&g_fork_gen, 1);
}

static void register_atfork(void)
{
    pthread_atfork(NULL, NULL, atfork_child);
}

static uint64_t make_owner(int32_t pid, uint64_t start)
{
    return ((start & START_MASK) << PID_BITS) | ((uint64_t)(uint32_t)pid & PID_MASK);
}

static int owner_alive(uint64_t w)
{
    w &= ~FLAG_BIT;
    return gv_proc_alive((int32_t)(w & PID_MASK), w >> PID_BITS);
}

static uint64_t self_owner(void)
{
    uint64_t w = atomic_load(&g_self_owner);
    if (w == 0) {
        int32_t pid = (int32_t)getpid();
        w = make_owner(pid, gv_proc_start_time(pid));
        atomic_store(&g_self_owner, w);
    }
    return w;
}

/* Identity of the calling thread, for short exclusive operations (device
 * initialisation, reclaiming) that another thread of the same process
 * must be able to tell apart from its own. */
static uint64_t thread_owner(void)
{
    uint32_t gen = atomic_load(&g_fork_gen);
    if (t_owner == 0 || t_owner_gen != gen) {
        int32_t tid = (int32_t)syscall(SYS_gettid);
        t_owner = make_owner(tid, gv_proc_start_time(tid));
        t_owner_gen = gen;
    }
    return t_owner;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t image_id(void)
{
    uint64_t v = atomic_load(&g_image);
    if (v == 0) {
        uint64_t n = now_ns() ^ ((uint64_t)(uintptr_t)&g_image << 16) ^
                     ((uint64_t)getpid() << 40);
        n = n * UINT64_C(0x9E3779B97F4A7C15) | 1;
        uint64_t zero = 0;
        atomic_compare_exchange_strong(&g_image, &zero, n);
        v = atomic_load(&g_image);
    }
    return v;
}

static void test_delay(void)
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
static void backoff(int slot, int tries)
{
    if (t_rng == 0)
        t_rng = (now_ns() ^ (uint64_t)(uintptr_t)&t_rng) | 1;
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

static void set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ---- liveness ------------------------------------------------------------ */

/* Reads state (field 3) and start time (field 22) of /proc/<pid>/stat.
 * Returns 0, or -1 with errno set. */
static int read_stat(int32_t pid, char *state, uint64_t *start)
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
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (p == NULL) {
            errno = EINVAL;
            return -1;
        }
        p++;
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
    if (pid <= 0 || read_stat(pid, &st, &start) != 0)
        return 0;
    return start;
}

int gv_proc_alive(int32_t pid, uint64_t start)
{
    if (pid <= 0)
        return 0;
    if (kill(pid, 0) != 0 && errno != EPERM)
        return 0;
    char st;
    uint64_t now;
    if (read_stat(pid, &st, &now) != 0) {
        /* Gone in between -> dead.  No usable /proc at all -> trust kill(). */
        if (errno == ENOENT || errno == ESRCH)
            return access("/proc/self/stat", R_OK) != 0;
        return 1;
    }
    if (st == 'Z' || st == 'X' || st == 'x')
        return 0;
    return (now & START_MASK) == (start & START_MASK);
}

/* ---- open / close ------------------------------------------------------- */

static int io_error(const char *path, const char *what, char *err, size_t errlen)
{
    set_err(err, errlen, "gpuvisor: region %s: %s: %s", path, what, strerror(errno));
    return GV_EIO;
}

/* Create path atomically: a fully initialised temp file linked into place.
 * Returns 0 when the file now exists (ours or someone else's). */
static int create_file(const char *path, char *err, size_t errlen)
{
    size_t len = strlen(path);
    char *tmpl = malloc(len + 8);
    if (tmpl == NULL)
        return io_error(path, "out of memory", err, errlen);
    memcpy(tmpl, path, len);
    memcpy(tmpl + len, ".XXXXXX", 8);
    int fd = mkostemp(tmpl, O_CLOEXEC);
    if (fd < 0) {
        int rc = io_error(path, "cannot create temporary file", err, errlen);
        free(tmpl);
        return rc;
    }
    struct gv_header h;
    memset(&h, 0, sizeof h);
    h.magic = GV_REGION_MAGIC;
    h.version = GV_REGION_VERSION;
    h.header_size = sizeof(struct gv_header);
    h.total_size = sizeof(struct gv_shm);
    h.max_slots = GV_MAX_SLOTS;
    h.max_devices = GV_MAX_DEVICES;
    h.created_unix = (uint64_t)time(NULL);
    int rc = 0;
    /* Shared by every user of the container. */
    if (fchmod(fd, 0666) != 0 || ftruncate(fd, (off_t)sizeof(struct gv_shm)) != 0 ||
        pwrite(fd, &h, sizeof h, 0) != (ssize_t)sizeof h)
        rc = io_error(path, "cannot initialise temporary file", err, errlen);
    close(fd);
    if (rc == 0 && link(tmpl, path) != 0 && errno != EEXIST)
        rc = io_error(path, "cannot link into place", err, errlen);
    unlink(tmpl);
    free(tmpl);
    return rc;
}

static int validate(int fd, const char *path, char *err, size_t errlen)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return io_error(path, "fstat", err, errlen);
    const char *pre = "gpuvisor: region";
    if (!S_ISREG(st.st_mode)) {
        set_err(err, errlen, "%s %s: not a regular file, not a gpuvisor region", pre, path);
        return GV_ECORRUPT;
    }
    struct gv_header h;
    memset(&h, 0, sizeof h);
    ssize_t n = pread(fd, &h, sizeof h, 0);
    if (n < 0)
        return io_error(path, "read", err, errlen);
    if (n < (ssize_t)sizeof h.magic) {
        set_err(err, errlen, "%s %s: truncated (%lld bytes), not a gpuvisor region",
                pre, path, (long long)st.st_size);
        return GV_ECORRUPT;
    }
    if (h.magic != GV_REGION_MAGIC) {
        set_err(err, errlen, "%s %s: bad magic 0x%016llx, not a gpuvisor region",
                pre, path, (unsigned long long)h.magic);
        return GV_ECORRUPT;
    }
    if (n < (ssize_t)sizeof h) {
        set_err(err, errlen, "%s %s: truncated header (%lld bytes)", pre, path,
                (long long)st.st_size);
        return GV_ECORRUPT;
    }
    if (h.version != GV_REGION_VERSION) {
        set_err(err, errlen, "%s %s: version %u, this library speaks %u", pre, path,
                h.version, GV_REGION_VERSION);
        return GV_ECORRUPT;
    }
    if (h.header_size != sizeof h || h.total_size != sizeof(struct gv_shm) ||
        h.max_slots != GV_MAX_SLOTS || h.max_devices != GV_MAX_DEVICES) {
        set_err(err, errlen,
                "%s %s: layout mismatch (header %u bytes, %u slots, %u devices, %llu "
                "total; expected %zu, %u, %u, %zu)", pre, path, h.header_size,
                h.max_slots, h.max_devices, (unsigned long long)h.total_size,
                sizeof h, GV_MAX_SLOTS, GV_MAX_DEVICES, sizeof(struct gv_shm));
        return GV_ECORRUPT;
    }
    if ((uint64_t)st.st_size != h.total_size) {
        set_err(err, errlen, "%s %s: file is %lld bytes, expected %llu (truncated?)",
                pre, path, (long long)st.st_size, (unsigned long long)h.total_size);
        return GV_ECORRUPT;
    }
    return GV_OK;
}

int region_open(const char *path, gv_region **out, char *err, size_t errlen)
{
    if (out == NULL || path == NULL || path[0] == '\0') {
        set_err(err, errlen, "gpuvisor: region: no path given");
        return GV_EINVAL;
    }
    pthread_once(&g_atfork_once, register_atfork);
    int fd = -1;
    for (int attempt = 0; attempt < 16; attempt++) {
        fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd >= 0 || errno != ENOENT)
            break;
        int rc = create_file(path, err, errlen);
        if (rc != 0)
            return rc;
    }
    if (fd < 0)
        return io_error(path, "open", err, errlen);
    int rc = validate(fd, path, err, errlen);
    if (rc != GV_OK) {
        close(fd);
        return rc;
    }
    void *p = mmap(NULL, sizeof(struct gv_shm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        rc = io_error(path, "mmap", err, errlen);
        close(fd);
        return rc;
    }
    close(fd);
    size_t len = strlen(path);
    gv_region *r = malloc(sizeof *r + len + 1);
    if (r == NULL) {
        munmap(p, sizeof(struct gv_shm));
        errno = ENOMEM;
        return io_error(path, "allocate handle", err, errlen);
    }
    r->m = p;
    atomic_init(&r->slot_cache, 0);
    memcpy(r->path, path, len + 1);
    *out = r;
    return GV_OK;
}

void region_close(gv_region *r)
{
    if (r == NULL)
        return;
    munmap(r->m, sizeof(struct gv_shm));
    free(r);
}

const char *region_path(const gv_region *r)
{
    return r != NULL ? r->path : NULL;
}

/* ---- slots ---------------------------------------------------------------- */

static uint32_t hwm_of(const gv_region *r)
{
    uint32_t h = atomic_load(&r->m->hdr.slot_hwm);
    return h > GV_MAX_SLOTS ? GV_MAX_SLOTS : h;
}

static void raise_hwm(gv_region *r, uint32_t to)
{
    uint32_t h = atomic_load(&r->m->hdr.slot_hwm);
    while (h < to && !atomic_compare_exchange_weak(&r->m->hdr.slot_hwm, &h, to))
        ;
}

/* Accounting internals (defined with the accounting code below). */
static void forget_slot(gv_region *r, int slot);
static void recompute_locked(gv_region *r, int dev);
static void close_gate(gv_region *r, int dev);
static void wait_outside(gv_region *r, int dev, int forget);

/* Claim the lowest free slot for owner word w (hwm is raised first, so a
 * claimer killed right after its CAS still leaves a reclaimable slot). */
static int claim_free_slot(gv_region *r, uint64_t w)
{
    for (int i = 0; i < GV_MAX_SLOTS; i++) {
        if (atomic_load(&r->m->owner[i]) != 0)
            continue;
        raise_hwm(r, (uint32_t)i + 1);
        uint64_t zero = 0;
        if (atomic_compare_exchange_strong(&r->m->owner[i], &zero, w))
            return i;
    }
    return GV_EFULL;
}

static int claim_self_slot(gv_region *r)
{
    uint64_t me = self_owner(), img = image_id();
    uint32_t hwm = hwm_of(r);
    for (uint32_t i = 0; i < hwm; i++) {
        if (atomic_load(&r->m->owner[i]) != me)
            continue;
        /* Ours already: another handle of this image shares it; a slot of
         * the image before exec() (same pid and start) is reset. */
        if (atomic_load(&r->m->image[i]) != img) {
            forget_slot(r, (int)i);
            atomic_store(&r->m->image[i], img);
        }
        return (int)i;
    }
    for (int attempt = 0; attempt < 2; attempt++) {
        int s = claim_free_slot(r, me);
        if (s >= 0) {
            /* A free slot holds nothing; if a straggler of its last owner
             * wrote to it after it was given up, drop that. */
            forget_slot(r, s);
            atomic_store(&r->m->image[s], img);
            return s;
        }
        if (region_reclaim_dead(r) == 0)
            break;
    }
    gv_log(GV_LOG_ERROR, "region %s: all %d process slots are in use", r->path,
           GV_MAX_SLOTS);
    return GV_EFULL;
}

int region_self_slot(gv_region *r)
{
    if (r == NULL)
        return GV_EINVAL;
    uint64_t gen = atomic_load_explicit(&g_fork_gen, memory_order_relaxed);
    uint64_t c = atomic_load_explicit(&r->slot_cache, memory_order_acquire);
    for (;;) {
        if ((c >> 32) == gen) {
            uint32_t s = (uint32_t)c;
            if (s != SLOT_NONE && s != SLOT_CLAIMING)
                return (int)s - 1;
            if (s == SLOT_CLAIMING) {       /* another thread is registering */
                sched_yield();
                c = atomic_load(&r->slot_cache);
                continue;
            }
        }
        if (atomic_compare_exchange_weak(&r->slot_cache, &c, gen << 32 | SLOT_CLAIMING))
            break;
    }
    int s = claim_self_slot(r);
    atomic_store(&r->slot_cache, gen << 32 | (s >= 0 ? (uint32_t)s + 1 : SLOT_NONE));
    return s;
}

/* Give up this process's slot when it exits, so that others see its memory
 * gone at once rather than at the next reclaim.  Only when no thread of ours
 * is inside an accounting operation; otherwise the slot is left for the
 * reclaim of dead processes. */
int region_leave(gv_region *r)
{
    if (r == NULL)
        return GV_EINVAL;
    uint64_t gen = atomic_load(&g_fork_gen);
    uint64_t c = atomic_load(&r->slot_cache);
    uint32_t cs = (uint32_t)c;
    if ((c >> 32) != gen || cs == SLOT_NONE || cs == SLOT_CLAIMING)
        return GV_ENOENT;
    int slot = (int)cs - 1;
    for (int dev = 0; dev < GV_MAX_DEVICES; dev++) {
        struct gv_dev *d = &r->m->dev[dev];
        if (atomic_load(&d->state) != DEV_READY || atomic_load(&d->used[slot]) == 0)
            continue;
        close_gate(r, dev);
        if (atomic_load(&d->inside[slot]) != 0) {     /* a thread of ours is busy */
            atomic_store(&d->gate, 0);
            return GV_EINVAL;
        }
        wait_outside(r, dev, slot);
        atomic_store(&d->used[slot], 0);
        recompute_locked(r, dev);
    }
    atomic_store(&r->slot_cache, gen << 32 | SLOT_NONE);
    atomic_store(&r->m->image[slot], 0);
    uint64_t me = self_owner();
    atomic_compare_exchange_strong(&r->m->owner[slot], &me, 0);
    return GV_OK;
}

/* Reclaim dead slots; dev >= 0 looks only at slots holding memory there. */
static int reclaim(gv_region *r, int dev)
{
    int n = 0;
    uint32_t hwm = hwm_of(r);
    uint64_t self = self_owner();
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t o = atomic_load(&r->m->owner[i]);
        if (o == 0 || o == self)
            continue;
        if (dev >= 0 && atomic_load(&r->m->dev[dev].used[i]) == 0 &&
            atomic_load(&r->m->dev[dev].inside[i]) == 0)
            continue;
        if (o & FLAG_BIT) {
            /* Being reclaimed: by a live thread (not this one) -> leave it. */
            if (o != (thread_owner() | FLAG_BIT) && owner_alive(o))
                continue;
        } else if (owner_alive(o)) {
            continue;
        }
        uint64_t mine = thread_owner() | FLAG_BIT;
        if (!atomic_compare_exchange_strong(&r->m->owner[i], &o, mine))
            continue;
        /* Exclusive now; forgetting is idempotent if we die and are taken over. */
        forget_slot(r, (int)i);
        atomic_store(&r->m->image[i], 0);
        atomic_compare_exchange_strong(&r->m->owner[i], &mine, 0);
        n++;
    }
    if (n > 0)
        gv_log(GV_LOG_INFO, "region %s: reclaimed %d slot(s) of dead processes", r->path, n);
    return n;
}

int region_reclaim_dead(gv_region *r)
{
    return r != NULL ? reclaim(r, -1) : 0;
}

int region_process_list(gv_region *r, int32_t *pids, int cap)
{
    if (r == NULL)
        return GV_EINVAL;
    int n = 0;
    uint32_t hwm = hwm_of(r);
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t o = atomic_load(&r->m->owner[i]);
        if (o == 0 || (o & FLAG_BIT))
            continue;
        if (pids != NULL && n < cap)
            pids[n] = (int32_t)(o & PID_MASK);
        n++;
    }
    return n;
}

int region_slot_of_pid(gv_region *r, int32_t pid)
{
    if (r == NULL || pid <= 0)
        return GV_EINVAL;
    uint64_t exact = make_owner(pid, gv_proc_start_time(pid));
    int any = GV_ENOENT;
    uint32_t hwm = hwm_of(r);
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t o = atomic_load(&r->m->owner[i]);
        if (o == 0 || (o & FLAG_BIT) || (int32_t)(o & PID_MASK) != pid)
            continue;
        if (o == exact)
            return (int)i;
        if (any < 0)
            any = (int)i;     /* a stale entry of an older process */
    }
    return any;
}

/* ---- devices ---------------------------------------------------------------- */

static int dev_ok(const gv_region *r, int dev)
{
    return r != NULL && dev >= 0 && dev < GV_MAX_DEVICES;
}

static int dev_ready(const gv_region *r, int dev)
{
    return dev_ok(r, dev) && atomic_load(&r->m->dev[dev].state) == DEV_READY;
}

static void init_device(struct gv_dev *d, const unsigned char uuid[16],
                        uint64_t physical_total, uint64_t limit)
{
    memcpy(d->uuid, uuid, 16);
    test_delay();
    atomic_store(&d->limit, limit);
    atomic_store(&d->physical_total, physical_total);
    atomic_store(&d->oom_count, 0);
    for (int i = 0; i < GV_MAX_SLOTS; i++) {
        atomic_store_explicit(&d->used[i], 0, memory_order_relaxed);
        atomic_store_explicit(&d->inside[i], 0, memory_order_relaxed);
    }
    atomic_store(&d->total, 0);
    atomic_store(&d->gate, 0);
}

int region_device_lookup(gv_region *r, const unsigned char uuid[16],
                         uint64_t physical_total, uint64_t limit)
{
    if (r == NULL || uuid == NULL)
        return GV_EINVAL;
    for (int i = 0; i < GV_MAX_DEVICES; i++) {
        struct gv_dev *d = &r->m->dev[i];
        unsigned waits = 0;
        for (;;) {
            uint64_t s = atomic_load(&d->state);
            if (s == DEV_READY) {
                if (memcmp(d->uuid, uuid, 16) != 0)
                    break;
                uint64_t zero = 0;
                if (physical_total != 0)
                    atomic_compare_exchange_strong(&d->physical_total, &zero, physical_total);
                return i;
            }
            if (s != DEV_FREE && !(s & FLAG_BIT))
                break;                      /* garbage state: skip the entry */
            if (s != DEV_FREE && s != (thread_owner() | FLAG_BIT)) {
                /* Someone is initialising it; wait unless they died.  The
                 * liveness check reads /proc, so do it only now and then. */
                if (++waits % 16 != 0 || owner_alive(s)) {
                    sched_yield();
                    continue;
                }
            }
            uint64_t mine = thread_owner() | FLAG_BIT;
            if (!atomic_compare_exchange_strong(&d->state, &s, mine))
                continue;
            init_device(d, uuid, physical_total, limit);
            atomic_store(&d->state, DEV_READY);
            return i;
        }
    }
    return GV_EFULL;
}

int region_device_find(gv_region *r, const unsigned char uuid[16])
{
    if (r == NULL || uuid == NULL)
        return GV_EINVAL;
    for (int i = 0; i < GV_MAX_DEVICES; i++)
        if (dev_ready(r, i) && memcmp(r->m->dev[i].uuid, uuid, 16) == 0)
            return i;
    return GV_ENOENT;
}

int region_device_ready(gv_region *r, int dev)
{
    return dev_ready(r, dev);
}

int region_device_count(gv_region *r)
{
    if (r == NULL)
        return 0;
    int n = 0;
    for (int i = 0; i < GV_MAX_DEVICES; i++)
        if (atomic_load(&r->m->dev[i].state) != DEV_FREE)
            n = i + 1;
    return n;
}

void region_device_uuid(gv_region *r, int dev, unsigned char uuid[16])
{
    if (uuid == NULL)
        return;
    if (dev_ready(r, dev))
        memcpy(uuid, r->m->dev[dev].uuid, 16);
    else
        memset(uuid, 0, 16);
}

uint64_t region_device_physical_total(gv_region *r, int dev)
{
    return dev_ok(r, dev) ? atomic_load(&r->m->dev[dev].physical_total) : 0;
}

uint64_t region_limit(gv_region *r, int dev)
{
    return dev_ok(r, dev) ? atomic_load(&r->m->dev[dev].limit) : GV_UNLIMITED;
}

void region_set_limit(gv_region *r, int dev, uint64_t limit)
{
    if (dev_ok(r, dev))
        atomic_store(&r->m->dev[dev].limit, limit);
}

uint64_t region_oom_count(gv_region *r, int dev)
{
    return dev_ok(r, dev) ? atomic_load(&r->m->dev[dev].oom_count) : 0;
}

/* ---- accounting -------------------------------------------------------------- *
 *
 * Each device keeps a running total of what its slots hold, so checking a
 * reservation and reading usage cost the same whatever the number of
 * processes.  A reservation is one fetch_add on the total: the value it
 * returns is the exact sum including every earlier reservation, so two
 * racers for the last bytes cannot both fit, and a refused one is taken
 * back at once.  The slot's own counter is the truth for that process.
 *
 * The total and a slot's counter are two words, so a process killed between
 * updating one and the other would leave the total wrong.  Every update is
 * therefore made "inside a gate": the slot's inside[] counter is raised
 * first and lowered last.  Whoever reclaims a dead slot closes the gate (one
 * CAS on a word naming the closer), waits until no live slot is inside, and
 * recomputes the total from the slots' counters, leaving the dead one out.
 * Nobody can be half-way through an update then, whatever a dead process
 * was doing.  A closer that dies is taken over by the next process that
 * finds the gate shut.  The gate is only ever closed to reclaim a dead
 * process, so the fast path never waits on it in normal operation.
 */

static uint64_t sat_add(uint64_t a, uint64_t b)
{
    uint64_t s = a + b;
    return s < a ? UINT64_MAX : s;
}

static void recompute(gv_region *r, int dev, int forget);

/* Wait for an open gate; take over a gate whose closer died. */
static void wait_gate(gv_region *r, int dev)
{
    struct gv_dev *d = &r->m->dev[dev];
    for (unsigned waits = 1;; waits++) {
        uint64_t g = atomic_load(&d->gate);
        if (g == 0)
            return;
        if (waits % 64 == 0 && !owner_alive(g)) {
            recompute(r, dev, -1);       /* finish the dead closer's work */
            continue;
        }
        sched_yield();
    }
}

static void enter(gv_region *r, int dev, int slot)
{
    struct gv_dev *d = &r->m->dev[dev];
    for (;;) {
        atomic_fetch_add(&d->inside[slot], 1);
        if (atomic_load(&d->gate) == 0)
            return;
        atomic_fetch_sub(&d->inside[slot], 1);
        wait_gate(r, dev);
    }
}

static void leave(gv_region *r, int dev, int slot)
{
    atomic_fetch_sub(&r->m->dev[dev].inside[slot], 1);
}

/* Close dev's gate for the calling thread (taking over a dead closer). */
static void close_gate(gv_region *r, int dev)
{
    struct gv_dev *d = &r->m->dev[dev];
    uint64_t mine = thread_owner() | FLAG_BIT;
    for (unsigned waits = 1;; waits++) {
        uint64_t g = atomic_load(&d->gate);
        if (g == mine)
            return;
        if (g == 0 || (waits % 64 == 0 && !owner_alive(g))) {
            if (atomic_compare_exchange_strong(&d->gate, &g, mine))
                return;
            continue;
        }
        sched_yield();
    }
}

/* Wait until no live slot other than `forget` is inside dev's gate. */
static void wait_outside(gv_region *r, int dev, int forget)
{
    struct gv_dev *d = &r->m->dev[dev];
    uint32_t hwm = hwm_of(r);
    for (uint32_t k = 0; k < hwm; k++) {
        for (unsigned waits = 1; (int)k != forget && atomic_load(&d->inside[k]) != 0; waits++) {
            /* A dead process stays inside for ever: its counter is left
             * out of the total below, so it does not matter where it died. */
            uint64_t o = atomic_load(&r->m->owner[k]);
            if (waits % 16 == 0 && (o == 0 || !owner_alive(o)))
                break;
            sched_yield();
        }
    }
}

/* With the gate closed: drop slot `forget` (if >= 0) and set the total to
 * the sum of the slots' counters; then open the gate. */
static void recompute(gv_region *r, int dev, int forget)
{
    struct gv_dev *d = &r->m->dev[dev];
    close_gate(r, dev);
    wait_outside(r, dev, forget);
    if (forget >= 0) {
        atomic_store(&d->used[forget], 0);
        test_delay();
        atomic_store(&d->inside[forget], 0);
    }
    recompute_locked(r, dev);
}

/* Gate closed by us, nobody live inside: set the total, open the gate. */
static void recompute_locked(gv_region *r, int dev)
{
    struct gv_dev *d = &r->m->dev[dev];
    uint64_t sum = 0;
    uint32_t hwm = hwm_of(r);
    for (uint32_t k = 0; k < hwm; k++)
        sum = sat_add(sum, atomic_load(&d->used[k]));
    atomic_store(&d->total, sum);
    atomic_store(&d->gate, 0);
}

/* Remove a slot's holdings from every device (its process is gone). */
static void forget_slot(gv_region *r, int slot)
{
    for (int dev = 0; dev < GV_MAX_DEVICES; dev++) {
        struct gv_dev *d = &r->m->dev[dev];
        if (atomic_load(&d->state) != DEV_READY)
            continue;
        if (atomic_load(&d->used[slot]) != 0 || atomic_load(&d->inside[slot]) != 0 ||
            atomic_load(&d->gate) != 0)
            recompute(r, dev, slot);
    }
}

static int refuse(struct gv_dev *d)
{
    atomic_fetch_add(&d->oom_count, 1);
    return GV_ENOMEM;
}

int region_reserve(gv_region *r, int dev, int slot, uint64_t n)
{
    if (!dev_ok(r, dev) || slot < 0 || slot >= GV_MAX_SLOTS)
        return GV_EINVAL;
    struct gv_dev *d = &r->m->dev[dev];
    if (atomic_load(&d->state) != DEV_READY)
        return GV_ENOENT;
    if (n == 0)
        return GV_OK;
    if (n > MAX_RESERVE)
        return refuse(d);
    int tries = 0, reclaimed = 0;
    for (;;) {
        uint64_t limit = atomic_load(&d->limit);
        if (limit != GV_UNLIMITED && n > limit)
            return refuse(d);
        enter(r, dev, slot);
        uint64_t total = atomic_fetch_add(&d->total, n) + n;
        if (limit == GV_UNLIMITED || total <= limit) {
            atomic_fetch_add(&d->used[slot], n);
            leave(r, dev, slot);
            return GV_OK;
        }
        atomic_fetch_sub(&d->total, n);
        leave(r, dev, slot);
        /* Room now?  Then we only collided with racers that took theirs
         * back: retry after a short random wait. */
        if (atomic_load(&d->total) <= limit - n && ++tries < RESERVE_TRIES) {
            backoff(slot, tries);
            continue;
        }
        if (!reclaimed) {
            reclaimed = 1;
            if (reclaim(r, dev) > 0)
                continue;
        }
        return refuse(d);
    }
}

void region_release(gv_region *r, int dev, int slot, uint64_t n)
{
    if (!dev_ok(r, dev) || slot < 0 || slot >= GV_MAX_SLOTS || n == 0)
        return;
    struct gv_dev *d = &r->m->dev[dev];
    enter(r, dev, slot);
    _Atomic uint64_t *c = &d->used[slot];
    uint64_t old = atomic_load(c);
    while (!atomic_compare_exchange_weak(c, &old, old >= n ? old - n : 0))
        ;
    atomic_fetch_sub(&d->total, old >= n ? n : old);
    leave(r, dev, slot);
    if (old < n && !atomic_exchange(&g_release_underflow_logged, 1))
        gv_log(GV_LOG_ERROR,
               "region %s: device %d slot %d released %llu bytes but held only %llu "
               "(clamped to 0; accounting bug)", r->path, dev, slot,
               (unsigned long long)n, (unsigned long long)old);
}

uint64_t region_used(gv_region *r, int dev)
{
    if (!dev_ok(r, dev))
        return 0;
    /* May briefly include a reservation that is about to be refused. */
    return atomic_load(&r->m->dev[dev].total);
}

uint64_t region_slot_used(gv_region *r, int dev, int slot)
{
    if (!dev_ok(r, dev) || slot < 0 || slot >= GV_MAX_SLOTS)
        return 0;
    return atomic_load(&r->m->dev[dev].used[slot]);
}

/* ---- test hooks ------------------------------------------------------------ */

int region_test_claim_slot(gv_region *r, int32_t pid, uint64_t start)
{
    if (r == NULL || pid <= 0)
        return GV_EINVAL;
    return claim_free_slot(r, make_owner(pid, start));
}

int region_test_mark_reclaiming(gv_region *r, int slot, int32_t pid, uint64_t start)
{
    if (r == NULL || slot < 0 || slot >= GV_MAX_SLOTS || pid <= 0)
        return GV_EINVAL;
    raise_hwm(r, (uint32_t)slot + 1);
    atomic_store(&r->m->owner[slot], make_owner(pid, start) | FLAG_BIT);
    return GV_OK;
}

void region_test_set_delay_us(unsigned us)
{
    atomic_store(&g_test_delay_us, us);
}

uint64_t region_test_inside(gv_region *r, int dev)
{
    if (!dev_ok(r, dev))
        return 0;
    uint64_t sum = 0;
    uint32_t hwm = hwm_of(r);
    for (uint32_t k = 0; k < hwm; k++)
        sum = sat_add(sum, atomic_load(&r->m->dev[dev].inside[k]));
    return sum;
}

uint64_t region_test_slot_sum(gv_region *r, int dev)
{
    if (!dev_ok(r, dev))
        return 0;
    uint64_t sum = 0;
    uint32_t hwm = hwm_of(r);
    for (uint32_t k = 0; k < hwm; k++)
        sum = sat_add(sum, atomic_load(&r->m->dev[dev].used[k]));
    return sum;
}
