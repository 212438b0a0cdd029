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

int gv_node_lock(void)
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

void gv_node_unlock(int fd)
{
    if (fd < 0)
        return;
    untrack(fd);
    close(fd);                          /* drops the lock */
}
