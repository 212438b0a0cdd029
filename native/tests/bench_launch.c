/*
 * bench_launch.c - what the interposer adds per kernel launch (make bench-sm).
 *
 * Same pattern as bench_memory.c: one process opens the simulated driver
 * (build/sim/libcuda.so.1) and the interposer (build/libgpuvisor.so) side by
 * side with dlopen; the driver's own cuLaunchKernel is the "direct" launch,
 * the interposer's exported cuLaunchKernel (which forwards to that same
 * driver instance) the "with shim" one.  Launches are `spin` kernels of
 * 0 us on a non-blocking stream, so the device never falls behind and the
 * simulator's 1024-deep launch queue never fills; the stream is
 * synchronized every 500 launches (in both paths, inside the timing).
 *
 * Three SM settings, in this order, in one region:
 *   - no SM limit: the container never had one (the hooks' fast path);
 *   - limit 100 % (fixed-share), set live with gv_device_set_sm_limit: every
 *     launch goes through the gate (pacing clock, estimate, two events on
 *     the stream, a record handed to the meter thread).  100 % so that the
 *     gate never sleeps: what is timed is its bookkeeping, not pacing;
 *   - limit lifted (0) after having been set: the path of a container whose
 *     limit was removed live.
 * Each cell is the median ns/launch over the batches, direct and shim
 * batches in ABBA order, the launching thread pinned to one CPU.  The
 * meter thread (started before pinning, so it runs on the other CPUs) does
 * its share of the work off the launch path: its CPU time per launch is
 * reported separately (process CPU time minus the launching thread's,
 * shim batches minus direct batches).
 *
 * Output: the Markdown section "## SM quota: per-launch cost (make bench-sm)"
 * on stdout (tests/bench/sm_bench.py writes it into docs/benchmarks.md).
 * Plain C11 + libc/libdl/pthread; no link-time dependency on the driver.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "gpuvisor.h"
#include "gv_cuda.h"

#include "bench_common.h"

#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

#define SECTION "## SM quota: per-launch cost (make bench-sm)"
#define SYNC_EVERY 500
#define GOAL_NOLIMIT_NS 20.0

typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*devget_fn)(CUdevice *, int);
typedef CUresult (*retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*setcur_fn)(CUcontext);
typedef CUresult (*modload_fn)(CUmodule *, const void *);
typedef CUresult (*getfn_fn)(CUfunction *, CUmodule, const char *);
typedef CUresult (*streamcreate_fn)(CUstream *, unsigned int);
typedef CUresult (*sync_fn)(CUstream);
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void **, void **);
typedef int (*setsm_fn)(int, uint32_t);
typedef int (*getsmuse_fn)(int, uint64_t *, uint64_t *, uint64_t *);
typedef int (*devcount_fn)(void);

static struct {
    launch_fn direct, shim;
    sync_fn sync;
    setsm_fn set_sm;
    getsmuse_fn sm_usage;
    devcount_fn device_count;
} g;

static CUfunction spin;
static CUstream stream;
static cpu_set_t orig_affinity;



/* An entry point as the application sees it: the interposer's replacement
 * if it has one, else the driver's. */

/* path joined with rel, resolved into out (PATH_MAX bytes); 0 on success. */



static void setup_env(const char *dir)
{
    static const char *scrub[] = {
        "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT", "GPUVISOR_SM_POLICY",
        "GPU_CORE_UTILIZATION_POLICY", "CUDA_TASK_PRIORITY", "CUDA_DISABLE_CONTROL",
        "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "GPUVISOR_SIM_NVML_FAIL", NULL
    };
    for (int i = 0; scrub[i]; i++)
        unsetenv(scrub[i]);
    char p[2 * PATH_MAX];
    snprintf(p, sizeof p, "%s/sim.state", dir);
    setenv("GPUVISOR_SIM_STATE", p, 1);
    setenv("GPUVISOR_SIM_DEVICES", "1x80g", 1);
    snprintf(p, sizeof p, "%s/region.shr", dir);
    setenv("CUDA_DEVICE_MEMORY_SHARED_CACHE", p, 1);
    setenv("GPUVISOR_REAL_LIBCUDA", libs.sim, 1);
    if (libs.nvml[0])
        setenv("GPUVISOR_REAL_LIBNVML", libs.nvml, 1);
}

static void open_libs(void)
{
    libs.hsim = dlopen(libs.sim, RTLD_NOW | RTLD_LOCAL);
    if (!libs.hsim)
        die("dlopen %s: %s", libs.sim, dlerror());
    libs.hlib = dlopen(libs.lib, RTLD_NOW | RTLD_LOCAL);
    if (!libs.hlib)
        die("dlopen %s: %s", libs.lib, dlerror());
    g.direct = (launch_fn)need_sym(libs.hsim, "cuLaunchKernel", libs.sim);
    g.shim = (launch_fn)need_sym(libs.hlib, "cuLaunchKernel", libs.lib);
    if ((void *)g.shim == (void *)g.direct)
        die("%s does not replace cuLaunchKernel", libs.lib);
    g.sync = (sync_fn)app_sym("cuStreamSynchronize");
    g.set_sm = (setsm_fn)need_sym(libs.hlib, "gv_device_set_sm_limit", libs.lib);
    g.sm_usage = (getsmuse_fn)need_sym(libs.hlib, "gv_device_get_sm_usage", libs.lib);
    g.device_count = (devcount_fn)need_sym(libs.hlib, "gv_device_count", libs.lib);
}

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
    CUmodule m;
    if ((rc = ((modload_fn)app_sym("cuModuleLoadData"))(&m, "bench module")))
        die("cuModuleLoadData: %d", rc);
    if ((rc = ((getfn_fn)app_sym("cuModuleGetFunction"))(&spin, m, "spin")))
        die("cuModuleGetFunction: %d", rc);
    if ((rc = ((streamcreate_fn)app_sym("cuStreamCreate"))(&stream, 0x1 /* non-blocking */)))
        die("cuStreamCreate: %d", rc);
}

/* --- timing -------------------------------------------------------------- */

static inline uint64_t clock_ns(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

struct sample {
    double ns;         /* wall ns per launch */
    double other_cpu;  /* CPU ns per launch of the process's other threads */
};

static struct sample run_batch(launch_fn launch, long iters)
{
    static uint32_t us = 0;
    void *params[] = { &us };
    uint64_t p0 = clock_ns(CLOCK_PROCESS_CPUTIME_ID), c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    uint64_t t0 = clock_ns(CLOCK_MONOTONIC);
    for (long i = 0; i < iters; i++) {
        CUresult rc = launch(spin, 1, 1, 1, 32, 1, 1, 0, stream, params, NULL);
        if (rc)
            die("cuLaunchKernel: %d", rc);
        if ((i + 1) % SYNC_EVERY == 0 && (rc = g.sync(stream)))
            die("cuStreamSynchronize: %d", rc);
    }
    CUresult rc = g.sync(stream);
    if (rc)
        die("cuStreamSynchronize: %d", rc);
    uint64_t t1 = clock_ns(CLOCK_MONOTONIC);
    uint64_t p1 = clock_ns(CLOCK_PROCESS_CPUTIME_ID), c1 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    double own = (double)(c1 - c0), all = (double)(p1 - p0);
    return (struct sample){ (double)(t1 - t0) / (double)iters,
                            (all > own ? all - own : 0) / (double)iters };
}



struct result {
    const char *mode;
    double direct, shim, meter_cpu;
};

static void measure(struct result *res, int batches, long iters)
{
    double d[batches], s[batches], dm[batches], sm[batches];
    run_batch(g.direct, iters / 4 + 1);   /* warm up both paths */
    run_batch(g.shim, iters / 4 + 1);
    for (int b = 0; b < batches; b++) {
        struct sample x, y;
        if (b % 2 == 0) {     /* ABBA: order effects cancel out */
            x = run_batch(g.direct, iters);
            y = run_batch(g.shim, iters);
        } else {
            y = run_batch(g.shim, iters);
            x = run_batch(g.direct, iters);
        }
        d[b] = x.ns;
        dm[b] = x.other_cpu;
        s[b] = y.ns;
        sm[b] = y.other_cpu;
    }
    res->direct = median(d, batches);
    res->shim = median(s, batches);
    res->meter_cpu = median(sm, batches) - median(dm, batches);
}


static int pin_cpu(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0)
        return -1;
    orig_affinity = set;
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

static void unpin(void) { sched_setaffinity(0, sizeof orig_affinity, &orig_affinity); }


static void usage(void)
{
    fprintf(stderr, "usage: bench_launch [--batches 200] [--iters 1000] [--no-pin] [--lib PATH] [--sim PATH]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    bench_name = "bench_launch";
    int batches = 200, pin = 1;
    long iters = 1000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--batches") == 0 && v)
            batches = atoi(argv[++i]);
        else if (strcmp(a, "--iters") == 0 && v)
            iters = atol(argv[++i]);
        else if (strcmp(a, "--lib") == 0 && v)
            snprintf(libs.lib, sizeof libs.lib, "%s", argv[++i]);
        else if (strcmp(a, "--sim") == 0 && v)
            snprintf(libs.sim, sizeof libs.sim, "%s", argv[++i]);
        else if (strcmp(a, "--no-pin") == 0)
            pin = 0;
        else
            usage();
    }
    if (batches < 1 || batches > 10000 || iters < 1)
        usage();

    default_paths();
    snprintf(tmpdir, sizeof tmpdir, "%s/gvbench.XXXXXX",
             getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir))
        die("mkdtemp: %s", strerror(errno));
    parent_pid = getpid();
    atexit(cleanup_tmp);
    setup_env(tmpdir);
    open_libs();
    cuda_setup();
    /* One launch through the shim registers the device in the region. */
    struct sample first = run_batch(g.shim, 1);
    (void)first;
    if (g.device_count() != 1)
        die("expected 1 device entry in the region, found %d", g.device_count());

    int pinned = pin ? pin_cpu() : -1;
    struct result res[3];
    uint64_t l0 = 0, l1 = 0, busy, wait;

    res[0].mode = "none";
    measure(&res[0], batches, iters);
    g.sm_usage(0, &busy, &wait, &l0);
    if (l0 != 0)
        die("launches went through the gate without an SM limit");

    if (g.set_sm(0, 100) != 0)
        die("gv_device_set_sm_limit(0, 100) failed");
    if (pinned >= 0)
        unpin();             /* the meter thread starts now: not on our CPU */
    run_batch(g.shim, 10);
    if (pinned >= 0)
        pin_cpu();
    res[1].mode = "100 % (fixed-share)";
    uint64_t w0, lb;
    g.sm_usage(0, &busy, &w0, &lb);
    measure(&res[1], batches, iters);
    g.sm_usage(0, &busy, &wait, &l1);
    double waited = l1 > lb ? (double)(wait - w0) / (double)(l1 - lb) : 0;
    if (l1 == 0)
        die("no launch went through the gate with a 100 %% SM limit");

    if (g.set_sm(0, 0) != 0)
        die("gv_device_set_sm_limit(0, 0) failed");
    res[2].mode = "lifted (0) after 100 %";
    measure(&res[2], batches, iters);
    g.sm_usage(0, &busy, &wait, &l0);
    if (l0 != l1)
        die("launches went through the gate after the limit was lifted");

    char model[256], date[64];
    cpu_model(model, sizeof model);
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    struct utsname u;
    uname(&u);
    printf("%s\n\n", SECTION);
    printf("What the interposer adds per `cuLaunchKernel`, measured in one process: "
           "`native/tests/bench_launch.c` dlopens the simulated driver and `build/libgpuvisor.so` "
           "side by side (like `bench_memory.c`) and launches through the driver's own entry point "
           "(direct) and the interposer's (with shim), on the same context and non-blocking stream. "
           "Kernels are `spin` with 0 us, so the device never falls behind and the simulator's "
           "1024-deep queue never fills; the stream is synchronized every %d launches in both paths "
           "(inside the timing). Each cell is the median ns/launch over %d batches of %ld launches, "
           "direct and shim batches in ABBA order%s. SM settings, in this order, in one region: "
           "*none* (the container never had an SM limit: the hooks' fast path); *100 %%* "
           "(fixed-share, set live with `gv_device_set_sm_limit`): every launch goes through the "
           "gate - pacing clock, estimate, two events created and recorded on the stream, a record "
           "handed to the meter thread - and at 100 %% with 0 us kernels the gate never sleeps, so "
           "this is the gate's bookkeeping without any pacing delay (with a lower limit a launch "
           "also waits its turn, which is the quota working, not overhead); *lifted* (the limit set "
           "back to 0 after it was set: the region's flag that some entry once had a limit stays "
           "set, and the hooks check the process's cached answer to whether anything is gated "
           "now, which the region's change count keeps valid). "
           "\"Meter CPU\" is the CPU time per launch of the process's other threads (the meter "
           "thread: event queries, elapsed times, destroying the events), shim batches minus "
           "direct batches; it runs on another CPU, off the launch path. The simulator's launch is "
           "cheap (a process-shared lock and a few stores); a real driver's costs a few "
           "microseconds: read the added ns, not the ratio.\n\n",
           SYNC_EVERY, batches, iters, pinned >= 0 ? ", the launching thread pinned to one CPU" : "");
    printf("Machine: %ld CPUs, %s; Linux %s; %s.  \n", sysconf(_SC_NPROCESSORS_ONLN), model,
           u.release, date);
    printf("Command: `make bench-sm` (`build/bench/bench_launch --batches %d --iters %ld`).\n\n",
           batches, iters);
    printf("| SM limit | direct ns/launch | with shim ns/launch | added ns/launch | ratio "
           "| meter CPU ns/launch |\n");
    printf("|---|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < 3; i++)
        printf("| %s | %.0f | %.0f | %+.0f | %.2fx | %.0f |\n", res[i].mode, res[i].direct,
               res[i].shim, res[i].shim - res[i].direct,
               res[i].direct > 0 ? res[i].shim / res[i].direct : 0.0, res[i].meter_cpu);
    double add0 = res[0].shim - res[0].direct, add1 = res[1].shim - res[1].direct;
    printf("\nGoals:\n\n");
    printf("- At most %.0f ns added per launch without an SM limit: **%s** (%+.0f ns).\n",
           GOAL_NOLIMIT_NS, add0 <= GOAL_NOLIMIT_NS ? "met" : "not met", add0);
    printf("- With a limit (100 %%, gate without pacing delay): %+.0f ns added per launch on the "
           "launch path, plus %.0f ns of meter-thread CPU (no goal set); the gate's own count of "
           "time spent waiting (pacing) was %.0f ns per launch.\n",
           add1, res[1].meter_cpu, waited);
    return 0;
}
