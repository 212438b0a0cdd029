/* region_file.c - creating, validating and mapping the region file. */
#include "region_impl.h"

#include "file_space.h"
#include "gpuvisor.h"
#include "log.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

/* ---- a file that outlived a reboot -------------------------------------- */

static _Atomic uint64_t g_test_boot;   /* region_test_set_boot */

void region_test_set_boot(uint64_t boot)
{
    atomic_store(&g_test_boot, boot);
}

/* This boot's identity: a hash of the kernel's random boot id, never 0;
 * 0 when it cannot be read. */
static uint64_t boot_stamp(void)
{
    uint64_t t = atomic_load(&g_test_boot);
    if (t != 0)
        return t;
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    char buf[64];
    ssize_t n = read(fd, buf, sizeof buf);
    close(fd);
    uint64_t h = UINT64_C(14695981039346656037);   /* FNV-1a */
    for (ssize_t i = 0; i < n && buf[i] != '\n'; i++) {
        h ^= (unsigned char)buf[i];
        h *= UINT64_C(1099511628211);
    }
    return n <= 0 ? 0 : (h ? h : 1);
}

/* CLOCK_MONOTONIC starts again at every boot, but a region file kept on
 * disk (a host directory mounted into the container) outlives a reboot:
 * a pacing clock or a pause lease of the last boot would lie up to that
 * boot's uptime in the future, and the container's launches would wait
 * until this boot's clock caught up.  The first process of a new boot to
 * open the file forgets every time kept there.  Nothing of the last boot
 * can still be running, so nobody is using them meanwhile.  A file made
 * where the boot id could not be read (0) is left as it is. */
static void forget_other_boot(gv_region *r)
{
    uint64_t boot = boot_stamp();
    uint64_t was = atomic_load(&r->m->hdr.boot);
    if (boot == 0 || was == boot || !atomic_compare_exchange_strong(&r->m->hdr.boot, &was, boot))
        return;
    if (was == 0)
        return;
    for (int i = 0; i < GV_MAX_DEVICES; i++) {
        if (!dev_ready(r, i))
            continue;
        struct gv_sm *sm = &r->m->dev[i].sm;
        atomic_store(&sm->tat, 0);
        atomic_store(&sm->others_at, 0);
        atomic_store(&sm->enqueue, 0);
        region_sm_set_yield(r, i, 0);   /* a change: cached answers look again */
    }
    gv_log(GV_LOG_INFO, "%s: made in another boot: its pacing clocks and pauses are reset",
           r->path);
}

/* ---- open / close ------------------------------------------------------- */

static int io_error(const char *path, const char *what, char *err, size_t errlen)
{
    rg_set_err(err, errlen, "gpuvisor: region %s: %s: %s", path, what, strerror(errno));
    return GV_EIO;
}

/* Create path atomically: a fully initialised temp file linked into place
 * (renamed over path when replace is set).  Returns 0 when the file now
 * exists (ours or someone else's). */
static int create_file(const char *path, int replace, char *err, size_t errlen)
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
    h.boot = boot_stamp();
    int rc = 0;
    /* Every block allocated now (file_space.c): a sparse file on a full
     * filesystem made every process of the container die of SIGBUS at its
     * first store into a page the filesystem could not back. */
    int space = gv_file_reserve(fd, sizeof(struct gv_shm), 1);
    if (space != 0) {
        rg_set_err(err, errlen, "gpuvisor: region %s: cannot reserve its %zu bytes: %s", path,
                   sizeof(struct gv_shm), strerror(space));
        rc = GV_EIO;
    /* Shared by every user of the container. */
    } else if (fchmod(fd, 0666) != 0 || pwrite(fd, &h, sizeof h, 0) != (ssize_t)sizeof h) {
        rc = io_error(path, "cannot initialise temporary file", err, errlen);
    }
    close(fd);
    if (rc == 0 && replace) {
        if (rename(tmpl, path) != 0)
            rc = io_error(path, "cannot rename into place", err, errlen);
    } else if (rc == 0 && link(tmpl, path) != 0 && errno != EEXIST) {
        rc = io_error(path, "cannot link into place", err, errlen);
    }
    unlink(tmpl);
    free(tmpl);
    return rc;
}

/* GV_EIO with the message if path is a symbolic link (to a missing file:
 * open() said ENOENT), else 0. */
static int dangling_link(const char *path, char *err, size_t errlen)
{
    struct stat st;
    if (lstat(path, &st) != 0 || !S_ISLNK(st.st_mode))
        return 0;
    char target[512];
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n < 0)
        n = 0;
    target[n] = '\0';
    rg_set_err(err, errlen, "gpuvisor: region %s: a symbolic link to %s, which does not exist",
               path, n > 0 ? target : "a missing file");
    return GV_EIO;
}

int rg_validate(int fd, const char *path, char *err, size_t errlen)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return io_error(path, "fstat", err, errlen);
    const char *pre = "gpuvisor: region";
    if (!S_ISREG(st.st_mode)) {
        rg_set_err(err, errlen, "%s %s: not a regular file, not a gpuvisor region", pre, path);
        return GV_ECORRUPT;
    }
    struct gv_header h;
    memset(&h, 0, sizeof h);
    ssize_t n = pread(fd, &h, sizeof h, 0);
    if (n < 0)
        return io_error(path, "read", err, errlen);
    if (n < (ssize_t)sizeof h.magic) {
        rg_set_err(err, errlen, "%s %s: truncated (%lld bytes), not a gpuvisor region",
                pre, path, (long long)st.st_size);
        return GV_ECORRUPT;
    }
    if (h.magic != GV_REGION_MAGIC) {
        rg_set_err(err, errlen, "%s %s: bad magic 0x%016llx, not a gpuvisor region",
                pre, path, (unsigned long long)h.magic);
        return GV_ECORRUPT;
    }
    if (n < (ssize_t)sizeof h) {
        rg_set_err(err, errlen, "%s %s: truncated header (%lld bytes)", pre, path,
                (long long)st.st_size);
        return GV_ECORRUPT;
    }
    if (h.version != GV_REGION_VERSION) {
        rg_set_err(err, errlen, "%s %s: version %u, this library speaks %u", pre, path,
                h.version, GV_REGION_VERSION);
        return GV_ECORRUPT;
    }
    if (h.header_size != sizeof h || h.total_size != sizeof(struct gv_shm) ||
        h.max_slots != GV_MAX_SLOTS || h.max_devices != GV_MAX_DEVICES) {
        rg_set_err(err, errlen,
                "%s %s: layout mismatch (header %u bytes, %u slots, %u devices, %llu "
                "total; expected %zu, %u, %u, %zu)", pre, path, h.header_size,
                h.max_slots, h.max_devices, (unsigned long long)h.total_size,
                sizeof h, GV_MAX_SLOTS, GV_MAX_DEVICES, sizeof(struct gv_shm));
        return GV_ECORRUPT;
    }
    if ((uint64_t)st.st_size != h.total_size) {
        /* Either way: cut short (truncated while in use) or grown past
         * the region (written to, or another file under the magic). */
        rg_set_err(err, errlen, "%s %s: file is %lld bytes, expected %llu (too %s)",
                pre, path, (long long)st.st_size, (unsigned long long)h.total_size,
                (uint64_t)st.st_size < h.total_size ? "small" : "large");
        return GV_ECORRUPT;
    }
    return GV_OK;
}

/* ---- HAMi-core's region file -------------------------------------------- */

/* HAMi-core's shared region starts with a 32-bit initialised flag that
 * holds this number (its MULTIPROCESS_SHARED_REGION_MAGIC_FLAG).  A
 * container that restarts in place after libvgpu.so was swapped for this
 * library finds such a file at CUDA_DEVICE_MEMORY_SHARED_CACHE. */
int rg_is_hami_core_file(int fd)
{
    int32_t flag = 0;
    return pread(fd, &flag, sizeof flag, 0) == (ssize_t)sizeof flag && flag == HAMI_CORE_MAGIC;
}

/* The first process (other than this one) that maps the file (dev, ino),
 * or whose maps cannot be read (it might); 0 when none.  Never waits. */
static int32_t file_mapper(dev_t dev, ino_t ino)
{
    DIR *d = opendir("/proc");
    if (d == NULL)
        return -1;              /* cannot tell: someone might */
    int32_t self = (int32_t)getpid(), who = 0;
    struct dirent *e;
    while (who == 0 && (e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end != '\0' || pid <= 0 || pid == self)
            continue;
        char maps[48];
        snprintf(maps, sizeof maps, "/proc/%ld/maps", pid);
        FILE *f = fopen(maps, "re");
        if (f == NULL) {
            if (errno != ENOENT && errno != ESRCH)
                who = (int32_t)pid;     /* another user's: it might map it */
            continue;
        }
        char line[4096];
        while (who == 0 && fgets(line, sizeof line, f) != NULL) {
            unsigned maj, mnr;
            unsigned long long i;
            if (strchr(line, '\n') == NULL) {
                int ch;
                while ((ch = fgetc(f)) != EOF && ch != '\n')
                    ;
            }
            if (sscanf(line, "%*s %*s %*s %x:%x %llu", &maj, &mnr, &i) == 3 &&
                i == (unsigned long long)ino && maj == major(dev) && mnr == minor(dev))
                who = (int32_t)pid;
        }
        fclose(f);
    }
    closedir(d);
    return who;
}

/* fd is path's HAMi-core region.  Replaces it with a fresh gpuvisor region
 * when no live process maps it: 1 when the caller should open path again
 * (replaced here, or by another process meanwhile), else GV_ECORRUPT with
 * the message.  The replacer holds flock on the old file, so two processes
 * of the container starting together replace it once: the second finds
 * path no longer naming the file it locked. */
static int replace_hami_core_file(int fd, const char *path, char *err, size_t errlen)
{
    if (flock(fd, LOCK_EX | LOCK_NB) != 0)
        return 1;                       /* another process is replacing it */
    struct stat have, now;
    if (fstat(fd, &have) != 0 || stat(path, &now) != 0 || have.st_ino != now.st_ino ||
        have.st_dev != now.st_dev)
        return 1;                       /* replaced already */
    int32_t who = file_mapper(have.st_dev, have.st_ino);
    if (who != 0) {
        rg_set_err(err, errlen,
                   "gpuvisor: region %s: HAMi-core's region file (magic %d), in use by "
                   "process %d%s; not a gpuvisor region", path, HAMI_CORE_MAGIC, (int)who,
                   who < 0 ? " (/proc unreadable)" : "");
        return GV_ECORRUPT;
    }
    int rc = create_file(path, 1, err, errlen);
    if (rc != 0)
        return rc;
    gv_log(GV_LOG_WARN, "region %s: replaced HAMi-core's region file (magic %d), which no "
           "live process maps, with a new gpuvisor region", path, HAMI_CORE_MAGIC);
    return 1;
}

int region_open(const char *path, gv_region **out, char *err, size_t errlen)
{
    if (out == NULL || path == NULL || path[0] == '\0') {
        rg_set_err(err, errlen, "gpuvisor: region: no path given");
        return GV_EINVAL;
    }
    pthread_once(&rg_atfork_once, rg_register_atfork);
    int fd = -1, rc = GV_OK;
    for (int replaced = 0; replaced < 200; replaced++) {
        fd = -1;
        for (int attempt = 0; attempt < 16; attempt++) {
            fd = open(path, O_RDWR | O_CLOEXEC);
            if (fd >= 0 || errno != ENOENT)
                break;
            /* A symbolic link to a missing file: link() would find the name
             * taken, and open() the file missing, for ever. */
            rc = dangling_link(path, err, errlen);
            if (rc != 0)
                return rc;
            rc = create_file(path, 0, err, errlen);
            if (rc != 0)
                return rc;
        }
        if (fd < 0)
            return io_error(path, "open", err, errlen);
        rc = rg_validate(fd, path, err, errlen);
        if (rc == GV_ECORRUPT && rg_is_hami_core_file(fd)) {
            int again = replace_hami_core_file(fd, path, err, errlen);
            close(fd);                      /* drops the flock */
            fd = -1;
            if (again != 1)
                return again;
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
            rc = GV_ECORRUPT;
            continue;
        }
        break;
    }
    if (fd < 0) {                       /* replaced 200 times over */
        rg_set_err(err, errlen, "gpuvisor: region %s: HAMi-core's region file (magic %d) "
                   "keeps coming back", path, HAMI_CORE_MAGIC);
        return GV_ECORRUPT;
    }
    if (rc != GV_OK) {
        close(fd);
        return rc;
    }
    /* A file made sparse (by a library before create_file reserved its
     * space, or copied so) gets its blocks now, while a full filesystem is
     * still an error rather than a SIGBUS; a filesystem that cannot say
     * is left to it (others may be storing into the file meanwhile). */
    int space = gv_file_reserve(fd, sizeof(struct gv_shm), 0);
    if (space == ENOSPC || space == EDQUOT) {
        rg_set_err(err, errlen, "gpuvisor: region %s: cannot reserve its %zu bytes: %s", path,
                   sizeof(struct gv_shm), strerror(space));
        close(fd);
        return GV_EIO;
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
    for (int d = 0; d < GV_MAX_DEVICES; d++)
        atomic_init(&r->quick_at[d], 0);
    memcpy(r->path, path, len + 1);
    forget_other_boot(r);
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
