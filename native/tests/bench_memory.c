/*
 * bench_memory.c - what the interposer adds per memory call (make bench).
 *
 * One process opens the simulated driver (build/sim/libcuda.so.1) and the
 * interposer (build/libgpuvisor.so) side by side with dlopen: the driver's
 * own entry points are the "direct" calls, the interposer's exported
 * entry points (which forward to that same driver) are the "with shim"
 * calls.  Both act on the same driver instance, context and device.
 *
 * For 1, 8 and 64 processes registered in the shared region (this one
 * plus helpers, each a copy of this program run as `--hold`, holding a
 * 2 MiB allocation made through the interposer) it times
 *   - cuMemAlloc_v2(1 MiB) + cuMemFree_v2 (charged as 2 MiB), and
 *   - cuMemGetInfo_v2,
 * direct and with the shim in alternating batches (ABBA order), and
 * reports the median ns/op over the batches of each.  A second pass does
 * the same with the device's quota lifted (gv_device_set_limit to
 * GV_UNLIMITED), i.e. the path a container without a memory limit takes.
 *
 * Output: a Markdown table on stdout; with --write FILE the section
 * "## Memory quota: per-call cost (make bench)" of FILE is replaced (the
 * other sections are kept).
 *
 * Plain C11 + libc/libdl/pthread; no link-time dependency on the driver.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpuvisor.h"
#include "gv_cuda.h"

#include "bench_common.h"

#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

#define SECTION "## Memory quota: per-call cost (make bench)"
#define MAX_PROCS 256
#define MAX_NS 8
#define ALLOC_BYTES (1u << 20)
#define HOLD_BYTES (2u << 20)
#define SIM_DEVICES "1x80g"
#define GOAL_NS 300.0
/* 4 TiB of simulated address space, less headroom for the helpers. */
#define SIM_VA_ALLOCS 4.0e6

typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*devget_fn)(CUdevice *, int);
typedef CUresult (*retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*setcur_fn)(CUcontext);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*info_fn)(size_t *, size_t *);
typedef int (*plist_fn)(int32_t *, int);
typedef int (*setlim_fn)(int, uint64_t);
typedef int (*devcount_fn)(void);
typedef int (*getlim_fn)(int, uint64_t *);

/* One set of entry points: the driver's own, or the interposer's. */
struct api {
    alloc_fn alloc;
    free_fn free;
    info_fn info;
};

static const char *limit_text = "8g";   /* --limit */
static uint64_t limit_bytes;

static struct {
    struct api direct, shim;
    plist_fn process_list;
    setlim_fn set_limit;
    devcount_fn device_count;
    getlim_fn get_limit;
} g;



/* An entry point as the application sees it: the interposer's replacement
 * if it has one, else the driver's. */

/* path joined with rel, resolved into out (PATH_MAX bytes); 0 on success. */


/* Environment for this process and the helpers (inherited through exec). */
static void setup_env(const char *dir)
{
    static const char *scrub[] = {
        "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DISABLE_CONTROL", "CUDA_VISIBLE_DEVICES",
        "LD_PRELOAD", "GPUVISOR_SIM_NVML_FAIL", NULL
    };
    for (int i = 0; scrub[i]; i++)
        unsetenv(scrub[i]);
    char p[2 * PATH_MAX];
    snprintf(p, sizeof p, "%s/sim.state", dir);
    setenv("GPUVISOR_SIM_STATE", p, 1);
    setenv("GPUVISOR_SIM_DEVICES", SIM_DEVICES, 1);
    snprintf(p, sizeof p, "%s/region.shr", dir);
    setenv("CUDA_DEVICE_MEMORY_SHARED_CACHE", p, 1);
    setenv("CUDA_DEVICE_MEMORY_LIMIT", limit_text, 1);
    setenv("GPUVISOR_REAL_LIBCUDA", libs.sim, 1);
    if (libs.nvml[0])
        setenv("GPUVISOR_REAL_LIBNVML", libs.nvml, 1);
}

static void open_libs(void)
{
    /* The driver first, by the same path the interposer will open: one
     * instance, so both sets of entry points share its state. */
    libs.hsim = dlopen(libs.sim, RTLD_NOW | RTLD_LOCAL);
    if (!libs.hsim)
        die("dlopen %s: %s", libs.sim, dlerror());
    libs.hlib = dlopen(libs.lib, RTLD_NOW | RTLD_LOCAL);
    if (!libs.hlib)
        die("dlopen %s: %s", libs.lib, dlerror());
    g.direct.alloc = (alloc_fn)need_sym(libs.hsim, "cuMemAlloc_v2", libs.sim);
    g.direct.free = (free_fn)need_sym(libs.hsim, "cuMemFree_v2", libs.sim);
    g.direct.info = (info_fn)need_sym(libs.hsim, "cuMemGetInfo_v2", libs.sim);
    g.shim.alloc = (alloc_fn)need_sym(libs.hlib, "cuMemAlloc_v2", libs.lib);
    g.shim.free = (free_fn)need_sym(libs.hlib, "cuMemFree_v2", libs.lib);
    g.shim.info = (info_fn)need_sym(libs.hlib, "cuMemGetInfo_v2", libs.lib);
    if ((void *)g.shim.alloc == (void *)g.direct.alloc)
        die("%s does not replace cuMemAlloc_v2", libs.lib);
    g.process_list = (plist_fn)need_sym(libs.hlib, "gv_process_list", libs.lib);
    g.set_limit = (setlim_fn)need_sym(libs.hlib, "gv_device_set_limit", libs.lib);
    g.device_count = (devcount_fn)need_sym(libs.hlib, "gv_device_count", libs.lib);
    g.get_limit = (getlim_fn)need_sym(libs.hlib, "gv_device_get_limit", libs.lib);
}

/* cuInit, device 0, primary context current: through the interposer, so the
 * context is charged and the process registered as an application's is. */
static void cuda_setup(void)
{
    CUresult rc = ((init_fn)app_sym("cuInit"))(0);
    if (rc)
        die("cuInit: %d", rc);
    CUdevice dev;
    if ((rc = ((devget_fn)app_sym("cuDeviceGet"))(&dev, 0)))
        die("cuDeviceGet: %d", rc);
    CUcontext ctx;
    if ((rc = ((retain_fn)app_sym("cuDevicePrimaryCtxRetain"))(&ctx, dev)))
        die("cuDevicePrimaryCtxRetain: %d", rc);
    if ((rc = ((setcur_fn)app_sym("cuCtxSetCurrent"))(ctx)))
        die("cuCtxSetCurrent: %d", rc);
}

/* --- helper: a registered process that holds 2 MiB until told to go ---- */

static int hold_main(int ready_fd, int hold_fd)
{
    default_paths();
    open_libs();
    cuda_setup();
    CUdeviceptr p;
    CUresult rc = g.shim.alloc(&p, HOLD_BYTES);
    char c = rc == CUDA_SUCCESS ? 'y' : 'n';
    if (write(ready_fd, &c, 1) != 1)
        return 1;
    close(ready_fd);
    char buf[16];
    while (read(hold_fd, buf, sizeof buf) > 0)   /* until the parent closes it */
        ;
    return rc == CUDA_SUCCESS ? 0 : 1;
}

static cpu_set_t orig_affinity;
static int have_orig_affinity;
static pid_t helpers[MAX_PROCS];
static int nhelpers;
static int hold_w = -1, hold_r = -1;

static void spawn_helpers(int count)
{
    int rp[2];
    if (pipe2(rp, O_CLOEXEC) != 0)
        die("pipe: %s", strerror(errno));
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        die("readlink: %s", strerror(errno));
    self[n] = '\0';
    for (int i = 0; i < count; i++) {
        if (nhelpers >= MAX_PROCS)
            die("too many processes");
        pid_t pid = fork();
        if (pid < 0)
            die("fork: %s", strerror(errno));
        if (pid == 0) {
            /* Keep only the ready pipe's write end and the hold pipe's read end. */
            if (have_orig_affinity)   /* helpers need not share our CPU */
                sched_setaffinity(0, sizeof orig_affinity, &orig_affinity);
            /* Its own simulated-driver state: the simulator scans its
             * process table on every cuMemGetInfo, which would make the
             * direct call grow with N.  The device (same default UUID)
             * and the region file are shared. */
            char st[2 * PATH_MAX];
            snprintf(st, sizeof st, "%s/helper-%d.state", tmpdir, nhelpers);
            setenv("GPUVISOR_SIM_STATE", st, 1);
            int w = dup(rp[1]), r = dup(hold_r);
            char ws[16], rs[16];
            snprintf(ws, sizeof ws, "%d", w);
            snprintf(rs, sizeof rs, "%d", r);
            execl(self, self, "--hold", ws, rs, (char *)NULL);
            _exit(127);
        }
        helpers[nhelpers++] = pid;
    }
    close(rp[1]);
    for (int got = 0; got < count;) {
        char c;
        ssize_t r = read(rp[0], &c, 1);
        if (r == 1 && c == 'y') {
            got++;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        die("a helper process failed to set up (%s)",
            r == 1 ? "its allocation was refused" : "it exited");
    }
    close(rp[0]);
}

static void stop_helpers(void)
{
    if (hold_w >= 0)
        close(hold_w);
    hold_w = -1;
    for (int i = 0; i < nhelpers; i++)
        waitpid(helpers[i], NULL, 0);
    nhelpers = 0;
}

static int registered(void)
{
    int32_t pids[MAX_PROCS];
    return g.process_list(pids, MAX_PROCS);
}

/* --- timing -------------------------------------------------------------- */

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

enum op { OP_ALLOC_FREE, OP_GETINFO };

static double run_batch(const struct api *a, enum op op, long iters)
{
    uint64_t t0 = now_ns();
    if (op == OP_ALLOC_FREE) {
        for (long i = 0; i < iters; i++) {
            CUdeviceptr p;
            CUresult rc = a->alloc(&p, ALLOC_BYTES);
            if (rc)
                die("cuMemAlloc_v2: %d", rc);
            if ((rc = a->free(p)))
                die("cuMemFree_v2: %d", rc);
        }
    } else {
        for (long i = 0; i < iters; i++) {
            size_t f, t;
            CUresult rc = a->info(&f, &t);
            if (rc)
                die("cuMemGetInfo_v2: %d", rc);
        }
    }
    return (double)(now_ns() - t0) / (double)iters;
}



struct result {
    int procs;
    int limited;
    enum op op;
    double direct, shim;
};

static void measure(struct result *res, enum op op, int batches, long iters)
{
    double d[batches], s[batches];
    run_batch(&g.direct, op, iters / 4 + 1);   /* warm up both paths */
    run_batch(&g.shim, op, iters / 4 + 1);
    for (int b = 0; b < batches; b++) {
        if (b % 2 == 0) {     /* ABBA: order effects cancel out */
            d[b] = run_batch(&g.direct, op, iters);
            s[b] = run_batch(&g.shim, op, iters);
        } else {
            s[b] = run_batch(&g.shim, op, iters);
            d[b] = run_batch(&g.direct, op, iters);
        }
    }
    res->op = op;
    res->direct = median(d, batches);
    res->shim = median(s, batches);
}

/* --- report -------------------------------------------------------------- */

static const char *op_name(enum op op)
{
    return op == OP_ALLOC_FREE ? "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB)" : "cuMemGetInfo_v2";
}


struct config {
    int ns[MAX_NS];
    int nn;
    int batches;
    long iters;
    int pin;
    int unlimited;
    const char *write;
};

/* Added ns/op of (limited, op) at the smallest and largest process count,
 * and the largest over all counts.  0 if the series is empty. */
static int series(const struct result *r, int n, int limited, enum op op,
                  double *first, double *last, double *max)
{
    int seen = 0;
    for (int i = 0; i < n; i++) {
        if (r[i].limited != limited || r[i].op != op)
            continue;
        double a = r[i].shim - r[i].direct;
        if (!seen++) {
            *first = a;
            *max = a;
        }
        *last = a;
        if (a > *max)
            *max = a;
    }
    return seen;
}

/* "Flat": from the smallest to the largest process count the added cost
 * grows by at most 20% of its value at the smallest (or 20 ns). */
static void flat_line(FILE *f, const struct config *cf, const struct result *r, int n,
                      int limited, enum op op, const char *label)
{
    double first = 0, last = 0, max = 0;
    if (!series(r, n, limited, op, &first, &last, &max) || cf->nn < 2)
        return;
    double growth = last - first, tol = first * 0.2 > 20 ? first * 0.2 : 20;
    int lo = cf->ns[0], hi = cf->ns[cf->nn - 1];
    fprintf(f, "- %s, %s: added %.0f ns at %d process%s, %.0f ns at %d (%+.0f ns, "
               "%+.2f ns per extra process): **%s**.\n",
            label, limited ? "quota enforced" : "no limit", first, lo, lo == 1 ? "" : "es",
            last, hi, growth, growth / (hi - lo), growth <= tol ? "flat" : "grows with N");
}

static char *render(const struct config *cf, const struct result *r, int n, int pinned_cpu)
{
    char *out = NULL;
    size_t outlen = 0;
    FILE *f = open_memstream(&out, &outlen);
    if (!f)
        die("open_memstream: %s", strerror(errno));
    char model[256], date[64];
    cpu_model(model, sizeof model);
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    struct utsname u;
    uname(&u);

    fprintf(f, "%s\n\n", SECTION);
    fprintf(f,
            "What the interposer adds per call on top of calling the driver directly, "
            "measured in one process: `native/tests/bench_memory.c` dlopens the simulated "
            "driver (`build/sim/libcuda.so.1`) and `build/libgpuvisor.so` side by side and "
            "calls the driver's own `cuMemAlloc_v2`/`cuMemFree_v2`/`cuMemGetInfo_v2` "
            "(direct) and the interposer's (with shim), which forward to that same driver "
            "instance and context. The quota is enforced: `CUDA_DEVICE_MEMORY_LIMIT=%s` on "
            "a simulated %s device, so every shim allocation reserves and releases quota in "
            "the shared region. \"Processes registered\" counts this process plus helper "
            "processes that each registered in the region by holding a 2 MiB allocation "
            "(checked with `gv_process_list`); each helper gives the simulator its own state "
            "file, because the simulator (unlike a real driver) checks every process in its "
            "table on each `cuMemGetInfo`, which would make the direct call itself grow with "
            "N. Each cell is the median ns/op over %d "
            "batches of %ld calls (pairs, for alloc+free), direct and shim batches "
            "interleaved in ABBA order%s. The \"no limit\" rows lift the device's quota "
            "with `gv_device_set_limit(dev, GV_UNLIMITED)`, the path a container without "
            "a memory limit takes. The simulated driver's calls do little (a process-shared "
            "mutex, a scan of its process table, a hash table), far less than a real "
            "driver's `cuMemAlloc`, which costs microseconds: read the added ns/op, not the "
            "ratio, as the interposer's cost.\n\n",
            limit_text, SIM_DEVICES, cf->batches, cf->iters,
            pinned_cpu >= 0 ? ", pinned to one CPU" : "");
    fprintf(f, "Machine: %ld CPUs, %s; Linux %s; %s.  \n",
            sysconf(_SC_NPROCESSORS_ONLN), model, u.release, date);
    fprintf(f, "Command: `make bench` (`build/bench/bench_memory --batches %d --iters %ld`).\n\n",
            cf->batches, cf->iters);
    fprintf(f, "| processes registered | quota | operation | direct ns/op | with shim ns/op "
               "| added ns/op | ratio |\n");
    fprintf(f, "|---:|---|---|---:|---:|---:|---:|\n");
    for (int i = 0; i < n; i++) {
        double add = r[i].shim - r[i].direct;
        fprintf(f, "| %d | %s | %s | %.0f | %.0f | %+.0f | %.2fx |\n", r[i].procs,
                r[i].limited ? limit_text : "no limit", op_name(r[i].op), r[i].direct,
                r[i].shim, add, r[i].direct > 0 ? r[i].shim / r[i].direct : 0.0);
    }

    /* Verdict. */
    double first = 0, last = 0, max = 0;
    fprintf(f, "\nGoals:\n\n");
    if (series(r, n, 1, OP_ALLOC_FREE, &first, &last, &max))
        fprintf(f, "- At most %.0f ns added per alloc+free pair (quota enforced): **%s** "
                   "(at most %.0f ns).\n", GOAL_NS, max <= GOAL_NS ? "met" : "not met", max);
    flat_line(f, cf, r, n, 1, OP_ALLOC_FREE, "alloc+free");
    flat_line(f, cf, r, n, 1, OP_GETINFO, "cuMemGetInfo");
    flat_line(f, cf, r, n, 0, OP_ALLOC_FREE, "alloc+free");
    flat_line(f, cf, r, n, 0, OP_GETINFO, "cuMemGetInfo");
    fclose(f);
    return out;
}

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            char *nb = realloc(buf, cap);
            if (!nb)
                die("out of memory");
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0)
            break;
    }
    fclose(f);
    buf[n] = '\0';
    *len = n;
    return buf;
}

/* Replace (or append) our section of path; other sections stay as they are. */
static void write_section(const char *path, const char *section)
{
    size_t len = 0;
    char *old = slurp(path, &len);
    const char *head = old ? old : "# Benchmarks\n\n";
    const char *start = NULL, *end = NULL;
    for (const char *p = head; p && *p;) {
        if (strncmp(p, SECTION, strlen(SECTION)) == 0 &&
            (p[strlen(SECTION)] == '\n' || p[strlen(SECTION)] == '\0')) {
            start = p;
            break;
        }
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    if (start) {
        /* The section runs to the next "## " heading (or the end). */
        end = start + strlen(SECTION);
        for (;;) {
            end = strchr(end, '\n');
            if (!end) {
                end = start + strlen(start);
                break;
            }
            end++;
            if (strncmp(end, "## ", 3) == 0)
                break;
        }
    }
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f)
        die("%s: %s", tmp, strerror(errno));
    if (start) {
        fwrite(head, 1, (size_t)(start - head), f);
        fputs(section, f);
        if (*end)
            fprintf(f, "\n%s", end);
    } else {
        size_t hl = strlen(head);
        fputs(head, f);
        if (hl && head[hl - 1] != '\n')
            fputc('\n', f);
        if (hl && !(hl >= 2 && head[hl - 1] == '\n' && head[hl - 2] == '\n'))
            fputc('\n', f);
        fputs(section, f);
    }
    if (fclose(f) != 0 || rename(tmp, path) != 0)
        die("writing %s: %s", path, strerror(errno));
    free(old);
}

static int pin_cpu(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0)
        return -1;
    orig_affinity = set;
    have_orig_affinity = 1;
    int cpu = -1;
    for (int i = 0; i < CPU_SETSIZE; i++)
        if (CPU_ISSET(i, &set))
            cpu = i;      /* the last allowed CPU: usually the least busy */
    if (cpu < 0)
        return -1;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return sched_setaffinity(0, sizeof set, &set) == 0 ? cpu : -1;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: bench_memory [--procs 1,8,64] [--batches 200] [--iters 1000]\n"
            "                    [--limit 8g] [--no-pin] [--no-unlimited] [--lib PATH] [--sim PATH]\n"
            "                    [--write docs/benchmarks.md]\n");
    exit(2);
}


int main(int argc, char **argv)
{
    bench_name = "bench_memory";
    if (argc == 4 && strcmp(argv[1], "--hold") == 0)
        return hold_main(atoi(argv[2]), atoi(argv[3]));

    struct config cf = { .ns = { 1, 8, 64 }, .nn = 3, .batches = 200, .iters = 1000,
                         .pin = 1, .unlimited = 1, .write = NULL };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--procs") == 0 && v) {
            cf.nn = 0;
            for (char *s = argv[++i], *tok; (tok = strtok(s, ",")); s = NULL) {
                int n = atoi(tok);
                if (n < 1 || n > MAX_PROCS || cf.nn >= MAX_NS ||
                    (cf.nn && n <= cf.ns[cf.nn - 1]))
                    die("--procs: increasing counts from 1 to %d, at most %d", MAX_PROCS, MAX_NS);
                cf.ns[cf.nn++] = n;
            }
            if (!cf.nn)
                usage();
        } else if (strcmp(a, "--batches") == 0 && v) {
            cf.batches = atoi(argv[++i]);
        } else if (strcmp(a, "--iters") == 0 && v) {
            cf.iters = atol(argv[++i]);
        } else if (strcmp(a, "--limit") == 0 && v) {
            limit_text = argv[++i];
        } else if (strcmp(a, "--write") == 0 && v) {
            cf.write = argv[++i];
        } else if (strcmp(a, "--lib") == 0 && v) {
            snprintf(libs.lib, sizeof libs.lib, "%s", argv[++i]);
        } else if (strcmp(a, "--sim") == 0 && v) {
            snprintf(libs.sim, sizeof libs.sim, "%s", argv[++i]);
        } else if (strcmp(a, "--no-pin") == 0) {
            cf.pin = 0;
        } else if (strcmp(a, "--no-unlimited") == 0) {
            cf.unlimited = 0;
        } else {
            usage();
        }
    }
    if (cf.batches < 1 || cf.iters < 1 || cf.batches > 10000)
        usage();
    /* The simulator hands out device addresses from a 4 TiB range per device
     * and never reuses them: every 1 MiB allocation uses up 1 MiB of it. */
    double allocs = (double)cf.nn * (cf.unlimited ? 2 : 1) * 2 *
                    ((double)cf.batches * (double)cf.iters + (double)cf.iters / 4 + 1);
    if (allocs > SIM_VA_ALLOCS)
        die("%.0f allocations of 1 MiB would exhaust the simulator's address range "
            "(%.0f at most, it never reuses addresses): lower --batches or --iters",
            allocs, SIM_VA_ALLOCS);

    default_paths();
    snprintf(tmpdir, sizeof tmpdir, "%s/gvbench.XXXXXX",
             getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir))
        die("mkdtemp: %s", strerror(errno));
    parent_pid = getpid();
    atexit(cleanup_tmp);
    setup_env(tmpdir);
    signal(SIGPIPE, SIG_IGN);

    int hp[2];
    if (pipe2(hp, O_CLOEXEC) != 0)
        die("pipe: %s", strerror(errno));
    hold_r = hp[0];
    hold_w = hp[1];

    open_libs();
    cuda_setup();
    /* One allocation through the shim registers this process. */
    CUdeviceptr p0;
    if (g.shim.alloc(&p0, ALLOC_BYTES) || g.shim.free(p0))
        die("first allocation through the shim failed");
    if (g.device_count() != 1)
        die("expected 1 device entry in the region, found %d", g.device_count());
    if (g.get_limit(0, &limit_bytes) != 0 || limit_bytes == GV_UNLIMITED)
        die("CUDA_DEVICE_MEMORY_LIMIT=%s did not set a quota", limit_text);

    int pinned = cf.pin ? pin_cpu() : -1;

    struct result res[MAX_NS * 4];
    int nres = 0;
    int have = registered();
    if (have != 1)
        die("expected this process alone in the region, found %d", have);
    for (int k = 0; k < cf.nn; k++) {
        int want = cf.ns[k];
        if (want > have)
            spawn_helpers(want - have);
        have = registered();
        if (have != want)
            die("gv_process_list: %d processes registered, expected %d", have, want);
        fprintf(stderr, "bench_memory: %d processes registered\n", have);
        for (int lim = 1; lim >= (cf.unlimited ? 0 : 1); lim--) {
            if (g.set_limit(0, lim ? limit_bytes : GV_UNLIMITED) != 0)
                die("gv_device_set_limit failed");
            for (int op = OP_ALLOC_FREE; op <= OP_GETINFO; op++) {
                struct result *r = &res[nres++];
                r->procs = want;
                r->limited = lim;
                measure(r, (enum op)op, cf.batches, cf.iters);
            }
        }
        if (g.set_limit(0, limit_bytes) != 0)
            die("gv_device_set_limit failed");
    }
    stop_helpers();

    /* Table: enforced-limit rows first, then the no-limit ones. */
    struct result sorted[MAX_NS * 4];
    int ns = 0;
    for (int lim = 1; lim >= 0; lim--)
        for (int i = 0; i < nres; i++)
            if (res[i].limited == lim)
                sorted[ns++] = res[i];
    char *text = render(&cf, sorted, ns, pinned);
    fputs(text, stdout);
    fflush(stdout);
    if (cf.write) {
        write_section(cf.write, text);
        fprintf(stderr, "bench_memory: wrote section \"%s\" of %s\n", SECTION, cf.write);
    }
    free(text);
    return 0;
}
