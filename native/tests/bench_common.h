/*
 * bench_common.h - the harness of the per-call benchmarks (bench_memory.c
 * and bench_launch.c; make bench, make bench-sm).  A program lists its
 * operations (struct bench_op) and calls bench_main(); everything else is
 * here.
 *
 * Each operation is measured the way an application pays for it: in a
 * process of its own, a copy of the program linked with -lcuda (the
 * simulated driver, build/sim/libcuda.so.1), with an interposer preloaded
 * (LD_PRELOAD) or none ("direct").  The interposers are build/libgpuvisor.so
 * and, given --library PATH (make bench LIBRARY=...), any other one: a
 * peer, measured in the same run, with the extra variables it needs
 * (--library-env "NAME=VALUE ...").
 *
 * For each library and each process count N (--procs 1,8,64), N-1 helper
 * processes of the same container (the same region file and limits, the
 * same library preloaded) each hold a context and 2 MiB; the measuring
 * process is the Nth.  Operations whose containers differ (a memory limit
 * or not, an SM limit) get a container each.  The measuring process then
 *   - times --batches batches of --iters calls after a warm-up, and prints
 *     the median ns per call and the median CPU time per call of its other
 *     threads (an interposer's meter thread);
 *   - and, under `valgrind --tool=callgrind` (--callgrind N), counts the
 *     instructions of all its threads in BENCH_CG_BATCHES batches of N calls
 *     after the same warm-up (counters zeroed before each batch, dumped
 *     after it): the median batch over N is the instructions per call.  A
 *     median, because work that follows the clock rather than the calls (a
 *     look for dead processes at most every 100 ms, a meter thread's
 *     polls) comes far more often per call under callgrind, which runs
 *     about 50 times slower.
 *
 * Output: a Markdown section on stdout; with --write FILE that section of
 * FILE is replaced (the other sections are kept).
 * Plain C11 + libc/libdl/pthread; the driver through -lcuda only.
 */
#ifndef GV_BENCH_COMMON_H
#define GV_BENCH_COMMON_H

#include <dirent.h>
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

#include "cuda_protos.h"

/* Callgrind's client requests (header-only macros, no library): each
 * counted batch's instructions are dumped on their own.  Without valgrind's
 * headers the instruction columns stay empty. */
#if defined(__has_include)
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define BENCH_HAVE_CALLGRIND 1
#endif
#endif
#ifndef BENCH_HAVE_CALLGRIND
#define BENCH_HAVE_CALLGRIND 0
#define CALLGRIND_ZERO_STATS
#define CALLGRIND_DUMP_STATS_AT(s) ((void)(s))
#endif

#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

#define BENCH_MAX_PROCS 256
#define BENCH_MAX_NS 8
#define BENCH_MAX_OPS 16
#define BENCH_WARM 50
#define BENCH_CG_BATCHES 11
#define BENCH_SIM_DEVICES "1x16g"
#define BENCH_LIMIT "8g"

/* One operation: a container (its limits) and a call. */
struct bench_op {
    const char *name;       /* for --ops */
    const char *label;      /* the table's operation column */
    const char *mem_limit;  /* CUDA_DEVICE_MEMORY_LIMIT of its container, or NULL */
    const char *sm_limit;   /* CUDA_DEVICE_SM_LIMIT of its container, or NULL */
    const char *env;        /* more "NAME=VALUE ..." for its container, or NULL */
    int ours_only;          /* its set-up needs libgpuvisor's own functions: not
                             * measured with a peer (direct: without that set-up) */
    int alone;              /* a container of its own, whatever its limits */
    void (*setup)(void);    /* in the measuring process, after its context */
    void (*call)(long i);   /* the i-th call */
    int no_driver;          /* an interposer answers without calling the driver:
                             * what it adds is its whole figure (direct: the
                             * driver's own answer, for reference) */
    double goal_ns;         /* at most this many ns added (0: none) */
    double goal_instr;      /* at most this many instructions added (0: none) */
};

/* What a program passes to bench_main. */
struct bench_spec {
    const char *name;           /* for messages */
    const char *section;        /* "## ..." */
    const char *command;        /* "make bench" */
    const char *flags;          /* the program's own first arguments, or NULL */
    const struct bench_op *ops;
    int nops;
    const char *default_ops;    /* comma-separated names */
    const char *default_procs;  /* "1,8,64" */
    int other_cpu_column;       /* show the other threads' CPU time */
    void (*intro)(FILE *f);     /* what the section says before the table */
};

/* .ops and .nops of a bench_spec from an array. */
#define BENCH_OPS(a) .ops = (a), .nops = (int)(sizeof(a) / sizeof((a)[0]))

enum { LIB_DIRECT, LIB_OURS, LIB_PEER, BENCH_LIBS };

struct bench_cell {
    int measured;
    double ns, other_ns;   /* medians per call */
    double instr;          /* per call; < 0: not counted */
};

static const char *bench_name = "bench";

static struct {
    char lib[PATH_MAX];    /* libgpuvisor.so */
    char sim[PATH_MAX];    /* sim/libcuda.so.1 */
    char nvml[PATH_MAX];   /* sim/libnvidia-ml.so.1, or "" */
    char simdir[PATH_MAX];
    char self[PATH_MAX];
    char peer[PATH_MAX];   /* --library, or "" */
    const char *peer_env;  /* --library-env */
    const char *peer_name; /* --library-name */
} libs;

static char tmpdir[PATH_MAX / 2];   /* room for its subfolders and files */
static pid_t parent_pid;

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", bench_name);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static void check(CUresult rc, const char *what)
{
    if (rc != CUDA_SUCCESS)
        die("%s: %d", what, rc);
}

/* path joined with rel, resolved into out (PATH_MAX bytes); 0 on success. */
static int resolve(char *out, const char *dir, const char *rel)
{
    char joined[2 * PATH_MAX];
    snprintf(joined, sizeof joined, "%s%s", dir, rel);
    char buf[PATH_MAX];
    if (!realpath(joined, buf))
        return -1;
    snprintf(out, PATH_MAX, "%s", buf);
    return 0;
}

static void default_paths(void)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        die("readlink /proc/self/exe: %s", strerror(errno));
    exe[n] = '\0';
    snprintf(libs.self, sizeof libs.self, "%s", exe);
    char *slash = strrchr(exe, '/');
    if (slash)
        *slash = '\0';
    /* The binary lives in $(BUILD)/bench/: the libraries are one level up. */
    if (libs.lib[0] ? resolve(libs.lib, libs.lib, "") : resolve(libs.lib, exe, "/../libgpuvisor.so"))
        die("cannot find libgpuvisor.so next to %s (run make first, or pass --lib)", exe);
    if (resolve(libs.sim, exe, "/../sim/libcuda.so.1"))
        die("cannot find sim/libcuda.so.1 next to %s (run make first)", exe);
    snprintf(libs.simdir, sizeof libs.simdir, "%s", libs.sim);
    slash = strrchr(libs.simdir, '/');
    if (slash)
        *slash = '\0';
    if (resolve(libs.nvml, libs.simdir, "/libnvidia-ml.so.1"))
        libs.nvml[0] = '\0';
    if (libs.peer[0] && resolve(libs.peer, libs.peer, ""))
        die("LIBRARY=%s: no such file", libs.peer);
}

static void cleanup_tmp(void)
{
    if (!tmpdir[0] || getpid() != parent_pid)
        return;
    /* Two levels: tmpdir/<container>/<files>. */
    DIR *d = opendir(tmpdir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.')
                continue;
            char sub[2 * PATH_MAX];
            snprintf(sub, sizeof sub, "%s/%s", tmpdir, e->d_name);
            DIR *s = opendir(sub);
            if (s) {
                struct dirent *f;
                while ((f = readdir(s)))
                    if (f->d_name[0] != '.')
                        unlinkat(dirfd(s), f->d_name, 0);
                closedir(s);
                rmdir(sub);
            } else {
                unlink(sub);
            }
        }
        closedir(d);
    }
    rmdir(tmpdir);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void cpu_model(char *buf, size_t len)
{
    snprintf(buf, len, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char *c = strchr(line, ':');
            if (c) {
                c++;
                while (*c == ' ' || *c == '\t')
                    c++;
                c[strcspn(c, "\n")] = '\0';
                snprintf(buf, len, "%s", c);
            }
            break;
        }
    }
    fclose(f);
}

static inline uint64_t clock_ns(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static cpu_set_t orig_affinity;

/* The calling thread on the last allowed CPU (usually the least busy). */
static int pin_cpu(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0)
        return -1;
    orig_affinity = set;
    int cpu = -1;
    for (int i = 0; i < CPU_SETSIZE; i++)
        if (CPU_ISSET(i, &set))
            cpu = i;
    if (cpu < 0)
        return -1;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return sched_setaffinity(0, sizeof set, &set) == 0 ? cpu : -1;
}

/* --- in the measuring process and the helpers --------------------------- */

static CUcontext bench_ctx;

/* cuInit, device 0, its primary context current: as an application does. */
static void cuda_setup(void)
{
    check(gv_test_primary_ctx(0, &bench_ctx), "cuInit, primary context of device 0");
}

/* A function of the preloaded libgpuvisor, or NULL under another library. */
static void *ours_sym(const char *name)
{
    return dlsym(RTLD_DEFAULT, name);
}

/* A helper: a process of the container that holds a context and 2 MiB
 * until the parent closes its end of hold_fd. */
static int hold_main(int ready_fd, int hold_fd)
{
    cuda_setup();
    CUdeviceptr p;
    CUresult rc = cuMemAlloc_v2(&p, 2u << 20);
    char c = rc == CUDA_SUCCESS ? 'y' : 'n';
    if (write(ready_fd, &c, 1) != 1)
        return 1;
    close(ready_fd);
    char buf[16];
    while (read(hold_fd, buf, sizeof buf) > 0)
        ;
    return rc == CUDA_SUCCESS ? 0 : 1;
}

/* The measuring process: set up, warm up, then time or count (pin < 0:
 * under callgrind, one dump per batch). */
static int child_main(const struct bench_op *op, long iters, int batches, int pin)
{
    cuda_setup();
    if (op->setup)
        op->setup();
    long i = 0;
    for (; i < BENCH_WARM; i++)
        op->call(i);
    int (*plist)(int32_t *, int) = (int (*)(int32_t *, int))ours_sym("gv_process_list");
    int32_t pids[BENCH_MAX_PROCS];
    int procs = plist ? plist(pids, BENCH_MAX_PROCS) : -1;
    if (pin > 0)
        pin_cpu();   /* threads started in the warm-up stay where they are */
    if (pin < 0) {
        for (int b = 0; b < batches; b++) {
            CALLGRIND_ZERO_STATS;
            for (long k = 0; k < iters; k++, i++)
                op->call(i);
            CALLGRIND_DUMP_STATS_AT("batch");
        }
        printf("ns 0 other 0 procs %d\n", procs);
        return 0;
    }
    double ns[batches], other[batches];
    for (int b = 0; b < batches; b++) {
        uint64_t p0 = clock_ns(CLOCK_PROCESS_CPUTIME_ID), c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
        uint64_t t0 = clock_ns(CLOCK_MONOTONIC);
        for (long k = 0; k < iters; k++, i++)
            op->call(i);
        uint64_t t1 = clock_ns(CLOCK_MONOTONIC);
        uint64_t p1 = clock_ns(CLOCK_PROCESS_CPUTIME_ID), c1 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
        double own = (double)(c1 - c0), all = (double)(p1 - p0);
        ns[b] = (double)(t1 - t0) / (double)iters;
        other[b] = (all > own ? all - own : 0) / (double)iters;
    }
    printf("ns %.3f other %.3f procs %d\n", median(ns, batches), median(other, batches), procs);
    fflush(stdout);
    return 0;
}

/* --- the parent --------------------------------------------------------- */

struct bench_cfg {
    int ns[BENCH_MAX_NS];
    int nn;
    int batches;
    long iters;
    long cg_iters;        /* --callgrind: 0 = no instruction counts */
    int pin;
    const char *write;
    int ops[BENCH_MAX_OPS];
    int nops;
};

static const char *lib_path(int lib)
{
    return lib == LIB_OURS ? libs.lib : lib == LIB_PEER ? libs.peer : NULL;
}

static const char *lib_name(int lib)
{
    if (lib == LIB_DIRECT)
        return "direct";
    if (lib == LIB_OURS)
        return "libgpuvisor";
    if (libs.peer_name && *libs.peer_name)
        return libs.peer_name;
    const char *s = strrchr(libs.peer, '/');
    return s ? s + 1 : libs.peer;
}

/* Set each "NAME=VALUE" of the blank-separated list (what names it in errors). */
static void set_env_list(const char *list, const char *what)
{
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *s = buf, *tok, *save; (tok = strtok_r(s, " \t\n", &save)); s = NULL) {
        char *eq = strchr(tok, '=');
        if (!eq || eq == tok)
            die("%s: \"%s\" is not NAME=VALUE", what, tok);
        *eq = '\0';
        setenv(tok, eq + 1, 1);
    }
}

/* The environment of a process of container dir, run with library lib
 * ("role" names its own simulator state). */
static void child_env(int lib, const struct bench_op *op, const char *dir, const char *role)
{
    char p[3 * PATH_MAX];
    snprintf(p, sizeof p, "%s/%s.state", dir, role);
    /* Its own simulated-driver state: the simulator scans its process table
     * on every cuMemGetInfo, which would make the direct call grow with N.
     * The region file is the container's. */
    setenv("GPUVISOR_SIM_STATE", p, 1);
    setenv("GPUVISOR_SIM_DEVICES", BENCH_SIM_DEVICES, 1);
    snprintf(p, sizeof p, "%s/region.shr", dir);
    setenv("CUDA_DEVICE_MEMORY_SHARED_CACHE", p, 1);
    if (op->mem_limit)
        setenv("CUDA_DEVICE_MEMORY_LIMIT", op->mem_limit, 1);
    if (op->sm_limit)
        setenv("CUDA_DEVICE_SM_LIMIT", op->sm_limit, 1);
    const char *old = getenv("LD_LIBRARY_PATH");
    snprintf(p, sizeof p, "%s%s%s", libs.simdir, old && *old ? ":" : "", old ? old : "");
    setenv("LD_LIBRARY_PATH", p, 1);
    if (lib == LIB_OURS) {
        setenv("GPUVISOR_REAL_LIBCUDA", libs.sim, 1);
        if (libs.nvml[0])
            setenv("GPUVISOR_REAL_LIBNVML", libs.nvml, 1);
    }
    if (lib == LIB_PEER && libs.peer_env)
        set_env_list(libs.peer_env, "LIBRARY_ENV");
    if (op->env)
        set_env_list(op->env, op->name);
    if (lib_path(lib))
        setenv("LD_PRELOAD", lib_path(lib), 1);
}

static pid_t helpers[BENCH_MAX_PROCS * BENCH_LIBS];
static int nhelpers, lib_helpers[BENCH_LIBS];
static int hold_w = -1, hold_r = -1;

static void spawn_helpers(int lib, const struct bench_op *op, const char *dir, int count)
{
    int rp[2];
    if (pipe2(rp, O_CLOEXEC) != 0)
        die("pipe: %s", strerror(errno));
    for (int i = 0; i < count; i++) {
        if (nhelpers >= BENCH_MAX_PROCS * BENCH_LIBS)
            die("too many processes");
        char role[32];
        snprintf(role, sizeof role, "helper-%d", nhelpers);
        pid_t pid = fork();
        if (pid < 0)
            die("fork: %s", strerror(errno));
        if (pid == 0) {
            sched_setaffinity(0, sizeof orig_affinity, &orig_affinity);
            child_env(lib, op, dir, role);
            int w = dup(rp[1]), r = dup(hold_r);
            char ws[16], rs[16];
            snprintf(ws, sizeof ws, "%d", w);
            snprintf(rs, sizeof rs, "%d", r);
            execl(libs.self, libs.self, "--hold", ws, rs, (char *)NULL);
            _exit(127);
        }
        helpers[nhelpers++] = pid;
        lib_helpers[lib]++;
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
        die("a helper process with %s failed to set up (%s)", lib_name(lib),
            r == 1 ? "its allocation was refused" : "it exited");
    }
    close(rp[0]);
}

static void stop_helpers(void)
{
    if (hold_w >= 0)
        close(hold_w);
    hold_w = hold_r = -1;
    for (int i = 0; i < nhelpers; i++)
        waitpid(helpers[i], NULL, 0);
    nhelpers = 0;
    memset(lib_helpers, 0, sizeof lib_helpers);
}

/* Run the measuring process; its stdout into out (size len).  With cg_out,
 * under callgrind writing there. */
static void run_child(int lib, int opi, const struct bench_op *op, const char *dir, long iters,
                      int batches, int pin, const char *cg_out, char *out, size_t len)
{
    static int runs;
    runs++;
    int fd[2];
    if (pipe2(fd, O_CLOEXEC) != 0)
        die("pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        sched_setaffinity(0, sizeof orig_affinity, &orig_affinity);
        dup2(fd[1], 1);
        char role[32];
        snprintf(role, sizeof role, "measured-%d", runs);   /* a fresh simulator state */
        child_env(lib, op, dir, role);
        char o[16], it[32], b[16], pn[8];
        snprintf(o, sizeof o, "%d", opi);
        snprintf(it, sizeof it, "%ld", iters);
        snprintf(b, sizeof b, "%d", batches);
        snprintf(pn, sizeof pn, "%d", pin);
        if (cg_out) {
            char arg[2 * PATH_MAX + 32];
            snprintf(arg, sizeof arg, "--callgrind-out-file=%s", cg_out);
            execlp("valgrind", "valgrind", "-q", "--tool=callgrind", arg, libs.self, "--child",
                   o, it, b, pn, (char *)NULL);
            fprintf(stderr, "%s: valgrind: %s (install valgrind, or --callgrind 0)\n",
                    bench_name, strerror(errno));
        } else {
            execl(libs.self, libs.self, "--child", o, it, b, pn, (char *)NULL);
        }
        _exit(127);
    }
    close(fd[1]);
    size_t n = 0;
    for (;;) {
        ssize_t r = read(fd[0], out + n, len - 1 - n);
        if (r > 0 && (n += (size_t)r) < len - 1)
            continue;
        if (r < 0 && errno == EINTR)
            continue;
        break;
    }
    out[n] = '\0';
    close(fd[0]);
    int st;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        die("%s with %s: the measuring process failed (%s %d)", op->name, lib_name(lib),
            WIFEXITED(st) ? "exit" : "signal", WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
}

/* Instructions of all threads in a callgrind output file (removed). */
static double callgrind_total(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        die("%s: %s", path, strerror(errno));
    char line[512];
    double v = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "summary:", 8) == 0 || strncmp(line, "totals:", 7) == 0)
            v = strtod(strchr(line, ':') + 1, NULL);
    fclose(f);
    unlink(path);
    if (v < 0)
        die("%s: no instruction total", path);
    return v;
}

#define BENCH_ROUNDS 4

/* Wall time of op with every library: BENCH_ROUNDS rounds of batches/ROUNDS
 * batches each, the libraries' order turned round every other round (ABBA:
 * a machine that gets busier or quieter weighs on all alike); a cell is the
 * median of its rounds' medians. */
static void time_op(const struct bench_cfg *cf, int nl, int opi, const struct bench_op *op,
                    char dirs[][PATH_MAX], int procs, struct bench_cell *cells)
{
    double ns[BENCH_LIBS][BENCH_ROUNDS], other[BENCH_LIBS][BENCH_ROUNDS];
    int rounds = cf->batches < BENCH_ROUNDS ? 1 : BENCH_ROUNDS;
    int per = cf->batches / rounds;
    for (int r = 0; r < rounds; r++)
        for (int x = 0; x < nl; x++) {
            int lib = r % 2 ? nl - 1 - x : x;
            if (op->ours_only && lib == LIB_PEER)
                continue;
            char out[256];
            run_child(lib, opi, op, dirs[lib], cf->iters, per, cf->pin, NULL, out, sizeof out);
            int seen = -1;
            if (sscanf(out, "ns %lf other %lf procs %d", &ns[lib][r], &other[lib][r], &seen) != 3)
                die("%s: unexpected output of the measuring process: %s", op->name, out);
            if (lib == LIB_OURS && seen != procs)
                die("%s: %d processes registered in the region, expected %d", op->name, seen,
                    procs);
        }
    for (int lib = 0; lib < nl; lib++) {
        if (op->ours_only && lib == LIB_PEER)
            continue;
        cells[lib].ns = median(ns[lib], rounds);
        cells[lib].other_ns = median(other[lib], rounds);
        cells[lib].measured = 1;
    }
}

/* Instructions per call of op with lib (-1: not counted). */
static double count_op(const struct bench_cfg *cf, int lib, int opi, const struct bench_op *op,
                       const char *dir)
{
    if (cf->cg_iters <= 0)
        return -1;
    char out[256], cg[2 * PATH_MAX], dump[2 * PATH_MAX + 16];
    snprintf(cg, sizeof cg, "%s/callgrind.out", dir);
    run_child(lib, opi, op, dir, cf->cg_iters, BENCH_CG_BATCHES, -1, cg, out, sizeof out);
    double per[BENCH_CG_BATCHES];
    for (int b = 0; b < BENCH_CG_BATCHES; b++) {
        snprintf(dump, sizeof dump, "%s.%d", cg, b + 1);
        per[b] = callgrind_total(dump) / (double)cf->cg_iters;
    }
    callgrind_total(cg);   /* what ran after the last batch */
    return median(per, BENCH_CG_BATCHES);
}

/* --- the section ------------------------------------------------------ */

static void fmt_added(char *buf, size_t len, const struct bench_cell *c,
                      const struct bench_cell *d, int instr, int no_driver)
{
    if (!c->measured || (instr && c->instr < 0)) {
        snprintf(buf, len, "-");
        return;
    }
    double v = instr ? c->instr : c->ns, base = instr ? d->instr : d->ns;
    if (d->measured && (!instr || d->instr >= 0) && !no_driver)
        snprintf(buf, len, "%.0f (%+.0f)", v, v - base);
    else
        snprintf(buf, len, "%.0f", v);
}

static int libs_in_use(void)
{
    return libs.peer[0] ? BENCH_LIBS : LIB_PEER;
}

static char *render(const struct bench_spec *sp, const struct bench_cfg *cf,
                    struct bench_cell (*res)[BENCH_MAX_OPS][BENCH_LIBS])
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
    int nl = libs_in_use();

    fprintf(f, "%s\n\n", sp->section);
    sp->intro(f);
    fprintf(f,
            "Each process is a copy of `build/bench/%s`, linked with `-lcuda` (the simulated "
            "driver) and started with the interposer in `LD_PRELOAD`, or none (*direct*); "
            "the simulated device is %s, each process with its own simulator state (the "
            "simulator, unlike a driver, scans its process table on `cuMemGetInfo`), one region "
            "file per container. *Processes*: the measuring process plus helpers of the same "
            "container and library, each holding a context and 2 MiB%s. *ns*: the median over "
            "%d batches of %ld calls after %d warm-up calls%s (in %d rounds, the libraries "
            "taking turns in ABBA order; the median of the rounds' medians), and in brackets what the "
            "library adds to direct (where it answers without calling the driver, as on a "
            "refusal, its whole figure is what it adds, and direct is the driver's own answer). "
            "*Instructions*: `valgrind --tool=callgrind` over all threads of the measuring "
            "process, in %d batches of %ld calls after the same warm-up (the counters zeroed "
            "before each batch and dumped after it), the median batch over %ld%s: a median, "
            "because what follows the clock rather than the calls (with libgpuvisor, a refusal's "
            "look for dead processes at most every 100 ms; a meter thread's polls) comes about "
            "50 times as often per call under callgrind, which runs that much slower.",
            sp->name, BENCH_SIM_DEVICES, " (checked with `gv_process_list` for libgpuvisor)",
            cf->batches, cf->iters, BENCH_WARM,
            cf->pin ? ", the calling thread pinned to one CPU after the warm-up" : "",
            cf->batches < BENCH_ROUNDS ? 1 : BENCH_ROUNDS,
            BENCH_CG_BATCHES, cf->cg_iters, cf->cg_iters,
            cf->cg_iters > 0 ? "" : " (not counted in this run: `--callgrind 0`)");
    if (nl > LIB_PEER)
        fprintf(f, " *%s*: `%s`, the peer named by `LIBRARY`%s%s%s.", lib_name(LIB_PEER),
                libs.peer, libs.peer_env && *libs.peer_env ? " with `" : "",
                libs.peer_env && *libs.peer_env ? libs.peer_env : "",
                libs.peer_env && *libs.peer_env ? "`" : "");
    fprintf(f, "\n\nMachine: %ld CPUs, %s; Linux %s; %s.  \n", sysconf(_SC_NPROCESSORS_ONLN),
            model, u.release, date);
    fprintf(f, "Command: `%s`%s%s%s (`build/bench/%s%s%s --batches %d --iters %ld --callgrind %ld`).\n\n",
            sp->command, nl > LIB_PEER ? " `LIBRARY=" : "", nl > LIB_PEER ? libs.peer : "",
            nl > LIB_PEER ? "`" : "", sp->name, sp->flags ? " " : "", sp->flags ? sp->flags : "",
            cf->batches, cf->iters, cf->cg_iters);

    fprintf(f, "| processes | operation | direct ns | direct instructions |");
    for (int l = LIB_OURS; l < nl; l++)
        fprintf(f, " %s ns | %s instructions |", lib_name(l), lib_name(l));
    if (sp->other_cpu_column)
        fprintf(f, " other threads' CPU ns |");
    fprintf(f, "\n|---:|---|---:|---:|");
    for (int l = LIB_OURS; l < nl; l++)
        fprintf(f, "---:|---:|");
    if (sp->other_cpu_column)
        fprintf(f, "---:|");
    fputc('\n', f);
    for (int k = 0; k < cf->nn; k++)
        for (int j = 0; j < cf->nops; j++) {
            const struct bench_op *op = &sp->ops[cf->ops[j]];
            struct bench_cell *row = res[k][j];
            char a[64], b[64];
            fmt_added(a, sizeof a, &row[LIB_DIRECT], &row[LIB_DIRECT], 0, 1);
            fmt_added(b, sizeof b, &row[LIB_DIRECT], &row[LIB_DIRECT], 1, 1);
            fprintf(f, "| %d | %s | %s | %s |", cf->ns[k], op->label, a, b);
            for (int l = LIB_OURS; l < nl; l++) {
                fmt_added(a, sizeof a, &row[l], &row[LIB_DIRECT], 0, op->no_driver);
                fmt_added(b, sizeof b, &row[l], &row[LIB_DIRECT], 1, op->no_driver);
                fprintf(f, " %s | %s |", a, b);
            }
            if (sp->other_cpu_column) {
                fprintf(f, " ");
                for (int l = LIB_OURS; l < nl; l++)
                    if (row[l].measured)
                        fprintf(f, "%s%s %.0f", l > LIB_OURS ? "; " : "", lib_name(l),
                                row[l].other_ns - row[LIB_DIRECT].other_ns);
                fprintf(f, " |");
            }
            fputc('\n', f);
        }

    /* Goals, on libgpuvisor's figures. */
    fprintf(f, "\nGoals (libgpuvisor):\n\n");
    for (int j = 0; j < cf->nops; j++) {
        const struct bench_op *op = &sp->ops[cf->ops[j]];
        double worst_ns = -1e300, worst_in = -1e300, first = 0, last = 0;
        int have_in = 1;
        for (int k = 0; k < cf->nn; k++) {
            struct bench_cell *o = &res[k][j][LIB_OURS], *d = &res[k][j][LIB_DIRECT];
            struct bench_cell zero = { .measured = 1, .ns = 0, .instr = 0 };
            if (op->no_driver)
                d = &zero;
            double add = o->ns - d->ns;
            if (add > worst_ns)
                worst_ns = add;
            if (o->instr < 0 || d->instr < 0) {
                have_in = 0;
                continue;
            }
            double ai = o->instr - d->instr;
            if (ai > worst_in)
                worst_in = ai;
            if (k == 0)
                first = ai;
            last = ai;
        }
        if (op->goal_instr > 0 && !have_in)
            fprintf(f, "- %s: at most %.0f instructions added: not counted in this run.\n",
                    op->label, op->goal_instr);
        else if (op->goal_instr > 0)
            fprintf(f, "- %s: at most %.0f instructions added%s: **%s** (at most %.0f).\n",
                    op->label, op->goal_instr, cf->nn > 1 ? " at every process count" : "",
                    worst_in <= op->goal_instr ? "met" : "not met", worst_in);
        if (op->goal_ns > 0)
            fprintf(f, "- %s: at most %.0f ns added%s: **%s** (at most %.0f ns).\n", op->label,
                    op->goal_ns, cf->nn > 1 ? " at every process count" : "",
                    worst_ns <= op->goal_ns ? "met" : "not met", worst_ns);
        if (have_in && cf->nn > 1) {
            /* "Flat": from the smallest to the largest count the added
             * instructions grow by at most 20 % (or 50). */
            double growth = last - first, tol = first * 0.2 > 50 ? first * 0.2 : 50;
            fprintf(f, "- %s: %+.0f instructions added at %d process%s, %+.0f at %d: **%s**.\n",
                    op->label, first, cf->ns[0], cf->ns[0] == 1 ? "" : "es", last,
                    cf->ns[cf->nn - 1], growth <= tol ? "flat" : "grows with the processes");
        }
    }
    fclose(f);
    return out;
}

static char *slurp(const char *path)
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
    return buf;
}

/* Replace (or append) section title of path; other sections stay as they are. */
static void write_section(const char *path, const char *title, const char *section)
{
    char *old = slurp(path);
    const char *head = old ? old : "# Benchmarks\n\n";
    const char *start = NULL, *end = NULL;
    size_t tl = strlen(title);
    for (const char *p = head; p && *p;) {
        if (strncmp(p, title, tl) == 0 && (p[tl] == '\n' || p[tl] == '\0')) {
            start = p;
            break;
        }
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    if (start) {
        /* The section runs to the next "## " heading (or the end). */
        end = start + tl;
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
    char tmp[PATH_MAX + 32];
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

static void bench_usage(const struct bench_spec *sp)
{
    fprintf(stderr,
            "usage: %s [--procs %s] [--ops %s] [--batches 200] [--iters 1000]\n"
            "       [--callgrind 50] [--no-pin] [--lib PATH] [--library PATH]\n"
            "       [--library-env 'NAME=VALUE ...'] [--library-name NAME] [--write FILE]\n",
            sp->name, sp->default_procs, sp->default_ops);
    exit(2);
}

static int find_op(const struct bench_spec *sp, const char *name)
{
    for (int i = 0; i < sp->nops; i++)
        if (strcmp(sp->ops[i].name, name) == 0)
            return i;
    return -1;
}

static void parse_list(const struct bench_spec *sp, struct bench_cfg *cf, const char *procs,
                       const char *ops)
{
    char buf[256];
    cf->nn = 0;
    snprintf(buf, sizeof buf, "%s", procs);
    for (char *s = buf, *tok, *save; (tok = strtok_r(s, ",", &save)); s = NULL) {
        int n = atoi(tok);
        if (n < 1 || n > BENCH_MAX_PROCS || cf->nn >= BENCH_MAX_NS ||
            (cf->nn && n <= cf->ns[cf->nn - 1]))
            die("--procs %s: increasing counts from 1 to %d, at most %d", procs,
                BENCH_MAX_PROCS, BENCH_MAX_NS);
        cf->ns[cf->nn++] = n;
    }
    cf->nops = 0;
    snprintf(buf, sizeof buf, "%s", ops);
    for (char *s = buf, *tok, *save; (tok = strtok_r(s, ",", &save)); s = NULL) {
        int i = find_op(sp, tok);
        if (i < 0 || cf->nops >= BENCH_MAX_OPS)
            die("--ops: no operation \"%s\" (%s)", tok, sp->default_ops);
        cf->ops[cf->nops++] = i;
    }
    if (!cf->nn || !cf->nops)
        bench_usage(sp);
}

/* Whether ops a and b run in the same container (the same limits). */
static int same_container(const struct bench_op *a, const struct bench_op *b)
{
    if ((a->alone || b->alone) && a != b)
        return 0;
    return (a->mem_limit ? b->mem_limit && !strcmp(a->mem_limit, b->mem_limit) : !b->mem_limit) &&
           (a->sm_limit ? b->sm_limit && !strcmp(a->sm_limit, b->sm_limit) : !b->sm_limit);
}

static int bench_main(int argc, char **argv, const struct bench_spec *sp)
{
    bench_name = sp->name;
    if (argc == 4 && strcmp(argv[1], "--hold") == 0)
        return hold_main(atoi(argv[2]), atoi(argv[3]));
    if (argc == 6 && strcmp(argv[1], "--child") == 0) {
        int opi = atoi(argv[2]);
        if (opi < 0 || opi >= sp->nops)
            die("--child: no operation %d", opi);
        return child_main(&sp->ops[opi], atol(argv[3]), atoi(argv[4]), atoi(argv[5]));
    }

    struct bench_cfg cf = { .batches = 200, .iters = 1000, .cg_iters = 50, .pin = 1 };
    const char *procs = sp->default_procs, *ops = sp->default_ops;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--no-pin") == 0) {
            cf.pin = 0;
            continue;
        }
        if (!v)
            bench_usage(sp);
        i++;
        if (strcmp(a, "--procs") == 0)
            procs = v;
        else if (strcmp(a, "--ops") == 0)
            ops = v;
        else if (strcmp(a, "--batches") == 0)
            cf.batches = atoi(v);
        else if (strcmp(a, "--iters") == 0)
            cf.iters = atol(v);
        else if (strcmp(a, "--callgrind") == 0)
            cf.cg_iters = atol(v);
        else if (strcmp(a, "--write") == 0)
            cf.write = v;
        else if (strcmp(a, "--lib") == 0)
            snprintf(libs.lib, sizeof libs.lib, "%s", v);
        else if (strcmp(a, "--library") == 0)
            snprintf(libs.peer, sizeof libs.peer, "%s", v);
        else if (strcmp(a, "--library-env") == 0)
            libs.peer_env = v;
        else if (strcmp(a, "--library-name") == 0)
            libs.peer_name = v;
        else
            bench_usage(sp);
    }
    if (cf.batches < 1 || cf.batches > 10000 || cf.iters < 1 || cf.cg_iters < 0)
        bench_usage(sp);
    if (cf.cg_iters > 0 && !BENCH_HAVE_CALLGRIND)
        die("built without valgrind/callgrind.h: pass --callgrind 0, or install valgrind's "
            "headers and rebuild");
    parse_list(sp, &cf, procs, ops);
    static const char *scrub[] = {
        "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT", "GPUVISOR_SM_POLICY",
        "GPU_CORE_UTILIZATION_POLICY", "CUDA_TASK_PRIORITY", "CUDA_DISABLE_CONTROL",
        "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "GPUVISOR_SIM_NVML_FAIL",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE", NULL
    };
    for (int i = 0; scrub[i]; i++)
        unsetenv(scrub[i]);
    default_paths();
    if (sched_getaffinity(0, sizeof orig_affinity, &orig_affinity) != 0)
        die("sched_getaffinity: %s", strerror(errno));
    snprintf(tmpdir, sizeof tmpdir, "%s/gvbench.XXXXXX",
             getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir))
        die("mkdtemp: %s", strerror(errno));
    parent_pid = getpid();
    atexit(cleanup_tmp);
    signal(SIGPIPE, SIG_IGN);

    static struct bench_cell res[BENCH_MAX_NS][BENCH_MAX_OPS][BENCH_LIBS];
    int done[BENCH_MAX_OPS] = { 0 }, nl = libs_in_use();
    /* One container per library and distinct limits, its helpers alive
     * while its operations are measured. */
    for (int j = 0; j < cf.nops; j++) {
        if (done[j])
            continue;
        const struct bench_op *first = &sp->ops[cf.ops[j]];
        char dirs[BENCH_LIBS][PATH_MAX];
        for (int lib = 0; lib < nl; lib++) {
            snprintf(dirs[lib], sizeof dirs[lib], "%s/%d-%d", tmpdir, lib, j);
            if (mkdir(dirs[lib], 0700) != 0)
                die("mkdir %s: %s", dirs[lib], strerror(errno));
        }
        int hp[2];
        if (pipe2(hp, O_CLOEXEC) != 0)
            die("pipe: %s", strerror(errno));
        hold_r = hp[0];
        hold_w = hp[1];
        for (int k = 0; k < cf.nn; k++) {
            for (int lib = 0; lib < nl; lib++)
                spawn_helpers(lib, first, dirs[lib], cf.ns[k] - 1 - lib_helpers[lib]);
            fprintf(stderr, "%s: %d process%s\n", bench_name, cf.ns[k], cf.ns[k] == 1 ? "" : "es");
            for (int m = j; m < cf.nops; m++) {
                const struct bench_op *op = &sp->ops[cf.ops[m]];
                if (!same_container(first, op))
                    continue;
                done[m] = 1;
                time_op(&cf, nl, cf.ops[m], op, dirs, cf.ns[k], res[k][m]);
                for (int lib = 0; lib < nl; lib++)
                    res[k][m][lib].instr = op->ours_only && lib == LIB_PEER
                                               ? -1
                                               : count_op(&cf, lib, cf.ops[m], op, dirs[lib]);
            }
        }
        stop_helpers();
    }

    char *text = render(sp, &cf, res);
    fputs(text, stdout);
    fflush(stdout);
    if (cf.write) {
        write_section(cf.write, sp->section, text);
        fprintf(stderr, "%s: wrote section \"%s\" of %s\n", bench_name, sp->section, cf.write);
    }
    free(text);
    return 0;
}

#endif /* GV_BENCH_COMMON_H */
