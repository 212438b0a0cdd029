/*
 * region_peer.c - another container's region file, named by its path: the
 * node agent reads the region files of containers that load the library
 * without `gpuvisor run` (HAMi's per-container directories), and writes
 * their yield flags and the others' share into them (gpuvisor.h,
 * gv_region_file_*).
 *
 * The file belongs to an untrusted container, which may change it at any
 * moment.  So it is opened without following a symbolic link (a link in
 * the container's directory could name another container's region), never
 * created, never replaced (not even HAMi-core's), and read with pread into
 * a private copy, never mapped; whatever it holds only makes up what is
 * reported of that container.  The writes need the region's atomics: the
 * file is mapped for the moment of the write, under a SIGBUS guard, since
 * the container may truncate it meanwhile.
 */
#include "region_impl.h"

#include "gpuvisor.h"
#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ERR_MAX 512

static void format_uuid(const unsigned char u[16], char *buf, size_t len)
{
    snprintf(buf, len,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11],
             u[12], u[13], u[14], u[15]);
}

/* Open path (no symbolic link, no FIFO that would block, never created)
 * and check it is a region of this layout.  The fd, or a GV_E* code with
 * the reason set (gv_api_fail). */
static int peer_open(const char *path, int flags)
{
    char err[ERR_MAX];
    if (path == NULL || path[0] == '\0')
        return gv_api_fail(GV_EINVAL, "gpuvisor: region file: no path given");
    int fd = open(path, flags | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        if (errno == ELOOP)
            return gv_api_fail(GV_ECORRUPT, "gpuvisor: region %s: a symbolic link, not "
                               "followed, not a gpuvisor region", path);
        return gv_api_fail(GV_EIO, "gpuvisor: region %s: open: %s", path, strerror(errno));
    }
    int rc = rg_validate(fd, path, err, sizeof err);
    if (rc != GV_OK) {
        if (rc == GV_ECORRUPT && rg_is_hami_core_file(fd))
            gv_api_fail(rc, "gpuvisor: region %s: HAMi-core's region file (magic %d), not a "
                        "gpuvisor region", path, HAMI_CORE_MAGIC);
        else
            gv_api_fail(rc, "%s", err);
        close(fd);
        return rc;
    }
    return fd;
}

/* peer_open, and *d gets a device entry to read the region's into (the
 * caller frees it). */
static int peer_open_scratch(const char *path, int flags, struct gv_dev **d)
{
    int fd = peer_open(path, flags);
    if (fd < 0)
        return fd;
    *d = malloc(sizeof **d);
    if (*d == NULL) {
        close(fd);
        return gv_api_fail(GV_EIO, "gpuvisor: region %s: out of memory", path);
    }
    return fd;
}

static int read_at(int fd, void *buf, size_t len, off_t off, const char *path)
{
    ssize_t n = pread(fd, buf, len, off);
    if (n == (ssize_t)len)
        return GV_OK;
    if (n < 0)
        return gv_api_fail(GV_EIO, "gpuvisor: region %s: read: %s", path, strerror(errno));
    return gv_api_fail(GV_ECORRUPT, "gpuvisor: region %s: cut short while being read", path);
}

/* Device entry dev of the file into *d: its first lines (state to
 * reclaim_at) and its SM state; the per-slot arrays are not read. */
static int read_dev(int fd, int dev, struct gv_dev *d, const char *path)
{
    off_t base = (off_t)offsetof(struct gv_shm, dev) + (off_t)dev * (off_t)sizeof(struct gv_dev);
    int rc = read_at(fd, d, offsetof(struct gv_dev, used), base, path);
    if (rc == GV_OK)
        rc = read_at(fd, &d->sm, sizeof d->sm, base + (off_t)offsetof(struct gv_dev, sm), path);
    return rc;
}

GV_EXPORT int gv_region_file_devices(const char *path, struct gv_region_file_device *out, int cap)
{
    if (out == NULL || cap < 0)
        return gv_api_fail(GV_EINVAL, "gpuvisor: gv_region_file_devices: no buffer given");
    struct gv_dev *d;
    int fd = peer_open_scratch(path, O_RDONLY, &d);
    if (fd < 0)
        return fd;
    int n = 0, rc = GV_OK;
    uint64_t now = rg_now_ns();
    for (int i = 0; i < GV_MAX_DEVICES && n < cap; i++) {
        rc = read_dev(fd, i, d, path);
        if (rc != GV_OK)
            break;
        if (atomic_load(&d->state) != DEV_READY)
            continue;
        struct gv_region_file_device *o = &out[n++];
        memset(o, 0, sizeof *o);
        format_uuid(d->uuid, o->uuid, sizeof o->uuid);
        o->limit = atomic_load(&d->limit);
        o->used = atomic_load(&d->total);
        o->spilled = atomic_load(&d->spilled_total);
        o->physical_total = atomic_load(&d->physical_total);
        o->oom_count = atomic_load(&d->oom_count);
        o->sm_limit = atomic_load(&d->sm.limit);
        o->sm_share = atomic_load(&d->sm.share);
        o->sm_policy = atomic_load(&d->sm.policy);
        o->sm_priority = atomic_load(&d->sm.priority);
        o->busy_ns = atomic_load(&d->sm.busy_ns);
        o->wait_ns = atomic_load(&d->sm.wait_ns);
        o->launches = atomic_load(&d->sm.launches);
        uint64_t until = atomic_load(&d->sm.yield_until);
        o->yield_ms = until > now ? (until - now + 999999) / 1000000 : 0;
    }
    free(d);
    close(fd);
    return rc == GV_OK ? n : rc;
}

/* ---- writing, under a SIGBUS guard -------------------------------------- */

/* One guarded write at a time, process-wide: the handler is installed for
 * its length only and knows the one thread it guards. */
static pthread_mutex_t g_bus_lock = PTHREAD_MUTEX_INITIALIZER;
static sigjmp_buf g_bus_jmp;
static _Atomic unsigned long g_bus_thread;      /* pthread_self() of the guarded writer */
static struct sigaction g_bus_old;

static void on_sigbus(int sig, siginfo_t *info, void *uc)
{
    (void)info;
    (void)uc;
    if (atomic_load(&g_bus_thread) == (unsigned long)pthread_self())
        siglongjmp(g_bus_jmp, 1);
    /* Not the guarded access: the faulting instruction runs again under
     * the disposition the process had. */
    sigaction(sig, &g_bus_old, NULL);
}

/* The change, on the mapped region r (dev found by uuid). */
static void apply_sm(gv_region *r, int dev, uint32_t yield_ms, uint32_t others_bp)
{
    if (yield_ms != GV_KEEP) {
        uint64_t until = yield_ms ? rg_now_ns() + (uint64_t)yield_ms * 1000000ULL : 0;
        region_sm_set_yield(r, dev, until);
    }
    if (others_bp != GV_KEEP) {
        struct gv_sm *sm = region_sm(r, dev);
        if (sm != NULL) {
            atomic_store(&sm->others, others_bp);
            atomic_store(&sm->others_at, rg_now_ns());
        }
    }
}

GV_EXPORT int gv_region_file_set_sm(const char *path, const char *uuid, uint32_t yield_ms,
                                    uint32_t others_bp)
{
    const char *fn = "gpuvisor: gv_region_file_set_sm";
    if (uuid == NULL)
        return gv_api_fail(GV_EINVAL, "%s: no uuid given", fn);
    if (yield_ms != GV_KEEP && yield_ms > GV_SM_YIELD_MAX_MS)
        return gv_api_fail(GV_EINVAL, "%s: yield_ms=%u: more than %u ms", fn, yield_ms,
                           GV_SM_YIELD_MAX_MS);
    if (others_bp != GV_KEEP && others_bp > 10000)
        return gv_api_fail(GV_EINVAL, "%s: others_bp=%u is not 0..10000", fn, others_bp);
    struct gv_dev *d;
    int fd = peer_open_scratch(path, O_RDWR, &d);
    if (fd < 0)
        return fd;
    int dev = -1, rc = GV_OK;
    for (int i = 0; i < GV_MAX_DEVICES && dev < 0 && rc == GV_OK; i++) {
        rc = read_dev(fd, i, d, path);
        char have[48];
        if (rc == GV_OK && atomic_load(&d->state) == DEV_READY) {
            format_uuid(d->uuid, have, sizeof have);
            if (strcmp(have, uuid) == 0)
                dev = i;
        }
    }
    free(d);
    if (rc == GV_OK && dev < 0)
        rc = gv_api_fail(GV_ENOENT, "gpuvisor: region %s: no entry for device %.60s", path, uuid);
    if (rc != GV_OK) {
        close(fd);
        return rc;
    }
    size_t len = strlen(path);
    gv_region *r = malloc(sizeof *r + len + 1);
    void *p = mmap(NULL, sizeof(struct gv_shm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int map_errno = errno;
    close(fd);
    if (r == NULL || p == MAP_FAILED) {
        free(r);
        if (p != MAP_FAILED)
            munmap(p, sizeof(struct gv_shm));
        return gv_api_fail(GV_EIO, "gpuvisor: region %s: mmap: %s", path,
                           strerror(r == NULL ? ENOMEM : map_errno));
    }
    r->m = p;
    atomic_init(&r->slot_cache, 0);
    memcpy(r->path, path, len + 1);

    pthread_mutex_lock(&g_bus_lock);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_bus_old);
    atomic_store(&g_bus_thread, (unsigned long)pthread_self());
    if (sigsetjmp(g_bus_jmp, 1) == 0)
        apply_sm(r, dev, yield_ms, others_bp);
    else
        rc = gv_api_fail(GV_ECORRUPT, "gpuvisor: region %s: cut short while being written "
                         "(SIGBUS)", path);
    atomic_store(&g_bus_thread, 0);
    sigaction(SIGBUS, &g_bus_old, NULL);
    pthread_mutex_unlock(&g_bus_lock);

    munmap(p, sizeof(struct gv_shm));
    free(r);
    return rc;
}
