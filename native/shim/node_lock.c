/*
 * node_lock.c - one context creation at a time on the node.
 *
 * Creating a context is measured from outside (hooks_context.c): NVML's
 * list of processes and their memory before and after.  When processes of
 * several containers create contexts in the same moment (a node's pods
 * restarting together; a real driver takes 100 ms or more per context),
 * each sees the others' new PIDs and memory too: none learns the PID NVML
 * shows for it, and the context charged is the sum of all of them.  So the
 * measured part is serialised across the node by flock(2) on a file in a
 * directory every container shares: HAMi's device plugin mounts the host's
 * /tmp/vgpulock into each container it gives a GPU share, and gpuvisor
 * uses its own file there.  Without that directory nothing is locked.
 *
 * A process killed while holding the lock releases it (the kernel drops
 * the lock with the last descriptor of the open file).  A holder that does
 * not finish is waited for at most WAIT_NS; then the context is created
 * without the lock, as without the directory.  The descriptor is
 * close-on-exec, and a child forked while it is held closes its copy at
 * once (the parent's lock stays: a flock lock belongs to the open file,
 * which the parent's descriptor keeps), so a child never holds the lock nor
 * waits for itself.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hooks.h"
#include "log.h"

#define DEFAULT_PATH "/tmp/vgpulock/gpuvisor.lock"
#define WAIT_NS (5ULL * 1000 * 1000 * 1000)
#define POLL_NS (1000 * 1000)

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static int open_lock(const char *path)
{
    /* Made here: 0666 past the umask, for the node's other users.  One that
     * exists keeps its mode: the node agent's context.lock is 0644, and a
     * library running as its owner (root in a container) made it 0666. */
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0)
        (void)fchmod(fd, 0666);
    else if (errno == EEXIST)
        fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0 && (errno == EACCES || errno == EROFS || errno == EPERM))
        fd = open(path, O_RDONLY | O_CLOEXEC);  /* flock needs no write access */
    if (fd < 0 && errno != ENOENT) {
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            gv_log(GV_LOG_INFO, GV_ENV_NODE_LOCK " %s: cannot open it; contexts are created "
                   "without the node lock", path);
    }
    return fd;
}

/* The lock file's descriptors this process has open, locked or waiting
 * for the lock: a forked child closes its copies, which would otherwise
 * keep the lock (flock belongs to the open file description, which fork
 * shares) after the parent unlocks.  A few threads may be creating
 * contexts at once. */
#define TRACKED 8
static atomic_int tracked[TRACKED] = { -1, -1, -1, -1, -1, -1, -1, -1 };
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void track(int fd)
{
    for (int i = 0; i < TRACKED; i++) {
        int free_slot = -1;
        if (atomic_compare_exchange_strong(&tracked[i], &free_slot, fd))
            return;
    }
}

static void untrack(int fd)
{
    for (int i = 0; i < TRACKED; i++) {
        int mine = fd;
        if (atomic_compare_exchange_strong(&tracked[i], &mine, -1))
            return;
    }
}

static void fork_child(void)
{
    for (int i = 0; i < TRACKED; i++) {
        int fd = atomic_exchange(&tracked[i], -1);
        if (fd >= 0)
            close(fd);
    }
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, fork_child); }

static const char *lock_path(void)
{
    const char *path = getenv(GV_ENV_NODE_LOCK);
    return path ? path : DEFAULT_PATH;
}

int gv_node_dir(char *buf, size_t len)
{
    const char *path = lock_path(), *slash = strrchr(path, '/');
    const char *dir = slash ? path : ".";
    size_t n = !slash ? 1 : slash == path ? 1 : (size_t)(slash - path);
    if (!*path || n + 1 > len)
        return 0;                       /* turned off, or too long */
    memcpy(buf, dir, n);
    buf[n] = 0;
    struct stat st;
    return stat(buf, &st) == 0 && S_ISDIR(st.st_mode);
}

static int node_flock(void)
{
    pthread_once(&atfork_once, register_atfork);
    const char *path = lock_path();
    if (!*path)
        return -1;                      /* turned off */
    int fd = open_lock(path);
    if (fd < 0)
        return -1;                      /* no shared directory: nothing to lock */
    track(fd);                          /* from here: a fork in between closes it */
    uint64_t deadline = mono_ns() + WAIT_NS;
    for (;;) {
        if (flock(fd, LOCK_EX | LOCK_NB) == 0)
            return fd;
        if (errno != EWOULDBLOCK && errno != EINTR)
            break;
        if (mono_ns() >= deadline) {
            gv_log(GV_LOG_WARN, GV_ENV_NODE_LOCK " %s: held by another process for over %llu s; "
                   "creating the context without it (its memory and NVML PID may be mismeasured)",
                   path, (unsigned long long)(WAIT_NS / 1000000000ULL));
            break;
        }
        struct timespec ts = { 0, POLL_NS };
        nanosleep(&ts, NULL);
    }
    untrack(fd);
    close(fd);
    return -1;
}

/* ---- HAMi-core's lock ---------------------------------------------------
 *
 * While some containers of a node still run HAMi-core (a migration),
 * contexts are created under its lock too.  HAMi-core's lock is a file
 * whose existence means "held": a process takes it by creating it
 * exclusively (O_CREAT | O_EXCL) and gives it back by removing it, and a
 * waiter that has retried long enough removes it as left behind.  It is
 * taken here only while the node lock is held, and only where its
 * directory exists (HAMi mounts /tmp/vgpulock into the containers it
 * shares a GPU with), for at most HAMI_WAIT_NS; a file older than
 * HAMI_STALE_S is a killed holder's and is removed.  Never waits for
 * ever: a holder killed while holding it costs each context HAMI_WAIT_NS
 * at most, until the file is old enough to be removed. */
#define GV_ENV_HAMI_LOCK "GPUVISOR_HAMI_LOCK"
#define HAMI_DEFAULT_PATH "/tmp/vgpulock/lock"
#define HAMI_WAIT_NS (2ULL * 1000 * 1000 * 1000)
#define HAMI_POLL_NS (10 * 1000 * 1000)
#define HAMI_STALE_S 60

static __thread int t_hami_held;        /* this thread created HAMi-core's lock */

static const char *hami_path(void)
{
    const char *path = getenv(GV_ENV_HAMI_LOCK);
    return path ? path : HAMI_DEFAULT_PATH;
}

static void hami_lock(void)
{
    const char *path = hami_path();
    if (!*path)
        return;                         /* turned off */
    uint64_t deadline = mono_ns() + HAMI_WAIT_NS;
    for (;;) {
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
        if (fd >= 0) {
            close(fd);
            t_hami_held = 1;
            return;
        }
        if (errno != EEXIST)
            return;                     /* no HAMi directory (ENOENT), or not ours to use */
        struct stat st;
        if (lstat(path, &st) == 0 && time(NULL) - st.st_mtime > HAMI_STALE_S) {
            gv_log(GV_LOG_WARN, GV_ENV_HAMI_LOCK " %s: HAMi-core's lock, left for over %d s "
                   "by a holder that is gone; removed", path, HAMI_STALE_S);
            unlink(path);
            continue;
        }
        if (mono_ns() >= deadline) {
            static atomic_int said;
            if (!atomic_exchange(&said, 1))
                gv_log(GV_LOG_WARN, GV_ENV_HAMI_LOCK " %s: HAMi-core's lock held for over "
                       "%llu s; creating the context without it", path,
                       (unsigned long long)(HAMI_WAIT_NS / 1000000000ULL));
            return;
        }
        struct timespec ts = { 0, HAMI_POLL_NS };
        nanosleep(&ts, NULL);
    }
}

int gv_node_lock(void)
{
    int fd = node_flock();
    if (fd >= 0)
        hami_lock();
    return fd;
}

void gv_node_unlock(int fd)
{
    if (fd < 0)
        return;
    if (t_hami_held) {
        t_hami_held = 0;
        unlink(hami_path());            /* gives HAMi-core's lock back */
    }
    untrack(fd);
    close(fd);                          /* drops the lock */
}
