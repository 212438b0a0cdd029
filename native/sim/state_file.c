/*
 * state_file.c - the node state every simulated-driver process shares.
 *
 * The file (GPUVISOR_SIM_STATE, default /tmp/gpuvisor-sim-<uid>.state) is
 * created atomically: a fully initialised temp file in the same directory
 * is link()ed into place; the loser of a race opens the winner's file.
 * It holds the device table and one row of physical usage per process,
 * guarded by a process-shared robust mutex.  A process that exits gives
 * its row back in an atexit handler, as a real driver frees a process's
 * device memory in its own exit-time teardown, before the libraries'
 * destructors run; rows of processes that died without it (killed) are
 * reaped lazily (when memory would not fit, when usage is reported).
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sys/auxv.h>

#include "sim.h"

static sim_shared *S;
static int g_open_rc = SIM_ERR_FILE;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pid_t g_row_pid;
static int g_row = -1;

/* ---- /proc helpers --------------------------------------------------- */

/* state char and start time (field 22) of pid; -1 if it does not exist */
static int read_stat(int pid, char *state, uint64_t *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ')
        return -1;
    p += 2;                             /* field 3: state */
    *state = *p;
    for (int f = 3; f < 22 && p; f++) {
        p = strchr(p, ' ');
        if (p)
            p++;
    }
    if (!p)
        return -1;
    *start = strtoull(p, NULL, 10);
    return 0;
}

uint64_t sim_proc_start(int pid)
{
    char st;
    uint64_t start;
    return read_stat(pid, &st, &start) < 0 ? 0 : start;
}

static int row_alive(const sim_row *r)
{
    int pid = r->pid;
    if (pid <= 0)
        return 0;
    if (kill(pid, 0) < 0 && errno == ESRCH)
        return 0;
    char st;
    uint64_t start;
    if (read_stat(pid, &st, &start) < 0)
        return errno == EACCES;         /* unreadable /proc: trust kill() */
    if (st == 'Z' || st == 'X' || start != r->start)
        return 0;
    return 1;
}

/* ---- lock ------------------------------------------------------------ */

static void lock(void)
{
    /* Robust, so a holder killed at any instruction hands the lock on
     * (EOWNERDEAD; every update is a single store, so the state is whole).
     * Waits are bounded and retried: a wake-up lost when a process dies in
     * the middle of the futex hand-over must not leave a waiter asleep on a
     * free lock. */
    for (;;) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        int r = pthread_mutex_timedlock(&S->lock, &ts);
        if (r == EOWNERDEAD)
            pthread_mutex_consistent(&S->lock);
        if (r != ETIMEDOUT)
            return;
    }
}

static void unlock(void)
{
    pthread_mutex_unlock(&S->lock);
}

/* ---- open / create --------------------------------------------------- */

static void default_path(char *buf, size_t len)
{
    const char *p = getenv("GPUVISOR_SIM_STATE");
    if (p && *p)
        snprintf(buf, len, "%s", p);
    else
        snprintf(buf, len, "/tmp/gpuvisor-sim-%u.state", (unsigned)getuid());
}

static int create_file(const char *path, const sim_spec *spec,
                       const char *spec_str)
{
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmpXXXXXX", path);
    int fd = mkstemp(tmp);
    if (fd < 0)
        return -1;
    int rc = -1;
    sim_shared *m = MAP_FAILED;
    if (ftruncate(fd, sizeof(sim_shared)) < 0)
        goto out;
    m = mmap(NULL, sizeof *m, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
        goto out;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&m->lock, &a);
    pthread_mutexattr_destroy(&a);
    m->ndev = (uint32_t)spec->ndev;
    memcpy(m->dev, spec->dev, sizeof spec->dev);
    m->topology = (uint32_t)spec->topology;
    m->nvswitch = (uint32_t)spec->nvswitch;
    for (int i = 0; i < SIM_MAX_DEV; i++) {
        m->topo[i] = spec->topo[i];
        m->mig_mode[i] = spec->mig[i];
        if (!spec->topology) {
            m->topo[i].model = -1;
            m->topo[i].pcie_switch = m->topo[i].pcie_upstream = m->topo[i].host_bridge = -1;
            memset(m->topo[i].link_peer, SIM_LINK_NONE, sizeof m->topo[i].link_peer);
        }
    }
    snprintf(m->spec, sizeof m->spec, "%s", spec_str);
    m->size = sizeof *m;
    m->version = SIM_VERSION;
    m->magic = SIM_MAGIC;
    if (link(tmp, path) < 0)
        rc = errno == EEXIST ? 1 : -1;
    else
        rc = 0;
out:
    if (m != MAP_FAILED)
        munmap(m, sizeof *m);
    close(fd);
    unlink(tmp);
    return rc;
}

static void lock(void);
static void unlock(void);
static void give_row_back(void);

/* Identity of this exec image: the kernel's per-exec random bytes
 * (AT_RANDOM), the same for both simulated libraries in one image. */
static uint64_t image_id(void)
{
    const unsigned char *r = (const unsigned char *)getauxval(AT_RANDOM);
    uint64_t id = 0;
    if (r)
        memcpy(&id, r, sizeof id);
    return id;
}

/* A row with our pid and start time but another image belongs to the
 * image this process replaced with exec: like the real driver, that
 * image's memory died with it, so the row goes as soon as we attach. */
static void drop_replaced_image(void)
{
    pid_t me = getpid();
    uint64_t start = sim_proc_start(me), image = image_id();
    lock();
    for (int i = 0; i < SIM_MAX_ROWS; i++)
        if (S->rows[i].pid == me && S->rows[i].start == start && S->rows[i].image != image)
            S->rows[i].pid = 0;         /* single store releases the row */
    unlock();
}

static void do_open(void)
{
    const char *topo = getenv("GPUVISOR_SIM_TOPOLOGY");
    const char *env = getenv("GPUVISOR_SIM_DEVICES");
    const char *spec_str = env && *env ? env : "1x16g";
    char topo_spec[SIM_SPEC_LEN];
    sim_spec spec;
    if (sim_ts_config() < 0) {
        g_open_rc = SIM_ERR_SPEC;
        return;
    }
    if (topo && *topo) {
        /* the file describes the node; GPUVISOR_SIM_DEVICES is not read */
        if (sim_parse_topology(topo, &spec) < 0) {
            g_open_rc = SIM_ERR_SPEC;
            return;
        }
        snprintf(topo_spec, sizeof topo_spec, "topology:%s", topo);
        spec_str = env = topo_spec;
    } else if (env && *env && sim_parse_spec(env, &spec) < 0) {
        sim_log("GPUVISOR_SIM_DEVICES=%s is malformed "
                "(expected e.g. 2x80g or 16g,24g:name=X:sms=N)", env);
        g_open_rc = SIM_ERR_SPEC;
        return;
    }
    if (!env || !*env)
        sim_parse_spec(spec_str, &spec);
    char path[4096];
    default_path(path, sizeof path);
    int fd = -1;
    for (int tries = 0; tries < 3 && fd < 0; tries++) {
        fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd >= 0 || errno != ENOENT)
            break;
        if (create_file(path, &spec, spec_str) < 0) {
            sim_log("cannot create state file %s: %s", path, strerror(errno));
            return;
        }
    }
    if (fd < 0) {
        sim_log("cannot open state file %s: %s", path, strerror(errno));
        return;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || (size_t)st.st_size != sizeof(sim_shared)) {
        sim_log("state file %s has the wrong size or format; remove it", path);
        close(fd);
        return;
    }
    S = mmap(NULL, sizeof *S, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (S == MAP_FAILED) {
        S = NULL;
        sim_log("cannot map state file %s: %s", path, strerror(errno));
        return;
    }
    if (S->magic != SIM_MAGIC || S->version != SIM_VERSION ||
        S->size != sizeof *S || S->ndev == 0 || S->ndev > SIM_MAX_DEV) {
        sim_log("state file %s has a bad magic, version or size; remove it",
                path);
        munmap(S, sizeof *S);
        S = NULL;
        return;
    }
    if (env && *env && strcmp(env, S->spec) != 0)
        sim_log("%s=%s differs from state file %s (%s); using the file's devices",
                topo && *topo ? "GPUVISOR_SIM_TOPOLOGY" : "GPUVISOR_SIM_DEVICES",
                topo && *topo ? topo : env, path, S->spec);
    drop_replaced_image();
    g_open_rc = SIM_OK;
    atexit(give_row_back);
}

int sim_state_open(void)
{
    pthread_once(&g_once, do_open);
    return g_open_rc;
}

int sim_ndev(void)
{
    return S ? (int)S->ndev : 0;
}

const sim_devinfo *sim_dev(int node)
{
    return &S->dev[node];
}

/* ---- rows ------------------------------------------------------------ */

/* At exit: this process's device memory is freed (a forked child that
 * never claimed a row of its own leaves its parent's alone). */
static void give_row_back(void)
{
    lock();
    if (g_row >= 0 && g_row_pid == getpid() && S->rows[g_row].pid == g_row_pid)
        __atomic_store_n(&S->rows[g_row].pid, 0, __ATOMIC_RELEASE);
    g_row = -1;
    unlock();
}

static void reap(void)
{
    for (int i = 0; i < SIM_MAX_ROWS; i++)
        if (S->rows[i].pid && i != g_row && !row_alive(&S->rows[i]))
            S->rows[i].pid = 0;         /* single store releases the row */
}

/* this process's row, claimed on first use; caller holds the lock */
static int my_row(void)
{
    pid_t me = getpid();
    if (g_row >= 0 && g_row_pid == me)
        return g_row;
    g_row = -1;
    uint64_t start = sim_proc_start(me);
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < SIM_MAX_ROWS; i++) {
            sim_row *r = &S->rows[i];
            if (r->pid)
                continue;
            for (int d = 0; d < SIM_MAX_NODE; d++)
                r->used[d] = 0;
            r->start = start;
            r->image = image_id();
            __atomic_store_n(&r->pid, me, __ATOMIC_RELEASE);
            g_row = i;
            g_row_pid = me;
            return i;
        }
        reap();
    }
    return -1;
}

static uint64_t sum_used(int node)
{
    uint64_t t = 0;
    for (int i = 0; i < SIM_MAX_ROWS; i++)
        if (S->rows[i].pid)
            t += S->rows[i].used[node];
    return t;
}

/* node exists: a GPU, or a GPU instance that exists now (under the lock) */
static int node_ok_locked(int node)
{
    if (!S || node < 0)
        return 0;
    if (node < SIM_MAX_DEV)
        return node < (int)S->ndev;
    if (node >= SIM_MAX_NODE)
        return 0;
    int g = (node - SIM_MAX_DEV) / SIM_MIG_SLOTS, s = (node - SIM_MAX_DEV) % SIM_MIG_SLOTS;
    return g < (int)S->ndev && S->gi[g][s].active;
}

int sim_node_ok(int node)
{
    return node_ok_locked(node);
}

int sim_node_gpu(int node)
{
    if (node < SIM_MAX_DEV)
        return node;
    return (node - SIM_MAX_DEV) / SIM_MIG_SLOTS;
}

int sim_charge(int node, uint64_t bytes)
{
    if (!S || node < 0 || node >= SIM_MAX_NODE)
        return -1;
    uint64_t total = S->dev[node].total;
    if (bytes > total)
        return -1;
    lock();
    if (!node_ok_locked(node)) {
        unlock();
        return -1;
    }
    int row = my_row();
    if (row < 0) {
        unlock();
        return -1;
    }
    uint64_t used = sum_used(node);
    if (used + bytes > total) {
        reap();
        used = sum_used(node);
    }
    if (used + bytes > total) {
        unlock();
        return -1;
    }
    S->rows[row].used[node] += bytes;
    unlock();
    return 0;
}

void sim_uncharge(int node, uint64_t bytes)
{
    if (!S || node < 0 || node >= SIM_MAX_NODE || !bytes)
        return;
    lock();
    int row = my_row();
    if (row >= 0) {
        uint64_t u = S->rows[row].used[node];
        S->rows[row].used[node] = u > bytes ? u - bytes : 0;
    }
    unlock();
}

uint64_t sim_used(int node)
{
    if (!S || node < 0 || node >= SIM_MAX_NODE)
        return 0;
    lock();
    reap();
    uint64_t u = sum_used(node);
    unlock();
    return u;
}

uint64_t sim_used_gpu(int gpu)
{
    if (!S || gpu < 0 || gpu >= (int)S->ndev)
        return 0;
    lock();
    reap();
    uint64_t u = sum_used(gpu);
    for (int s = 0; s < SIM_MIG_SLOTS; s++)
        u += sum_used(sim_gi_node(gpu, s));
    unlock();
    return u;
}

/* the rows with usage on node, appended to out from *n */
static void procs_of(int node, sim_proc *out, int max, int *n)
{
    for (int i = 0; i < SIM_MAX_ROWS; i++) {
        sim_row *r = &S->rows[i];
        if (!r->pid || !r->used[node])
            continue;
        if (*n < max) {
            out[*n].pid = (unsigned)r->pid;
            out[*n].node = node;
            out[*n].used = r->used[node];
        }
        (*n)++;
    }
}

int sim_procs(int node, sim_proc *out, int max)
{
    if (!S || node < 0 || node >= SIM_MAX_NODE)
        return 0;
    int n = 0;
    lock();
    reap();
    procs_of(node, out, max, &n);
    unlock();
    return n;
}

int sim_procs_gpu(int gpu, sim_proc *out, int max)
{
    if (!S || gpu < 0 || gpu >= (int)S->ndev)
        return 0;
    int n = 0;
    lock();
    reap();
    procs_of(gpu, out, max, &n);
    for (int s = 0; s < SIM_MIG_SLOTS; s++)
        procs_of(sim_gi_node(gpu, s), out, max, &n);
    unlock();
    return n;
}

void sim_reap_locked(void)
{
    reap();
}

int sim_node_in_use_locked(int node)
{
    return sum_used(node) != 0;
}

int sim_gpu_in_use_locked(int gpu)
{
    if (sum_used(gpu))
        return 1;
    for (int s = 0; s < SIM_MIG_SLOTS; s++)
        if (sum_used(sim_gi_node(gpu, s)))
            return 1;
    return 0;
}

/* ---- access for the other state_*.c files ------------------------------ */

sim_shared *sim_state(void)
{
    return S;
}

void sim_state_lock(void)
{
    lock();
}

void sim_state_unlock(void)
{
    unlock();
}
