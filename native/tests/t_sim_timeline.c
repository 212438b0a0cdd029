/*
 * t_sim_timeline.c - the simulated kernel timeline through dlopen: kernel
 * durations, asynchronous launches, streams/events ordering, default
 * streams, device-wide serialisation (across streams and processes), the
 * bounded launch queue, graphs (explicit and captured), cuLaunchKernelEx,
 * cooperative launches and cuGetProcAddress for the new entry points.
 *
 * usage: t_sim_timeline [path/to/libcuda.so.1]   (or GV_SIM_LIBCUDA=...)
 * Uses its own state file (unlinked at exit) and device spec.
 * Prints "OK" and exits 0, or prints the failing check and exits 1.
 * Timing checks have generous upper bounds (loaded CI machines).
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gv_cuda.h"
#include "sim_test.h"


/* a value within [lo, hi] */
#define NEAR(v, lo, hi)                                                 \
    do {                                                                \
        double v_ = (v);                                                \
        if (!(v_ >= (lo) && v_ <= (hi))) {                              \
            printf("FAIL %s:%d: %s = %.3f, want [%g, %g]\n", __FILE__,  \
                   __LINE__, #v, v_, (double)(lo), (double)(hi));       \
            fflush(stdout);                                             \
            exit(1);                                                    \
        }                                                               \
    } while (0)


typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned,
                              unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*coop_fn)(CUfunction, unsigned, unsigned, unsigned,
                            unsigned, unsigned, unsigned, unsigned,
                            CUstream, void **);

#define F(name, ret, args) static ret(*name) args;
#define FUNCS                                                                 \
    F(cuInit, CUresult, (unsigned))                                           \
    F(cuGetProcAddress_v2, CUresult, (const char *, void **, int, cuuint64_t, \
                                      CUdriverProcAddressQueryResult *))      \
    F(cuCtxCreate_v2, CUresult, (CUcontext *, unsigned, CUdevice))            \
    F(cuCtxSynchronize, CUresult, (void))                                     \
    F(cuModuleLoadData, CUresult, (CUmodule *, const void *))                 \
    F(cuModuleLoadDataEx, CUresult, (CUmodule *, const void *, unsigned,      \
                                     void *, void **))                        \
    F(cuModuleUnload, CUresult, (CUmodule))                                   \
    F(cuModuleGetFunction, CUresult, (CUfunction *, CUmodule, const char *))  \
    F(cuFuncGetName, CUresult, (const char **, CUfunction))                   \
    F(cuStreamCreate, CUresult, (CUstream *, unsigned))                       \
    F(cuStreamCreateWithPriority, CUresult, (CUstream *, unsigned, int))      \
    F(cuStreamDestroy_v2, CUresult, (CUstream))                               \
    F(cuStreamSynchronize, CUresult, (CUstream))                              \
    F(cuStreamSynchronize_ptsz, CUresult, (CUstream))                         \
    F(cuStreamQuery, CUresult, (CUstream))                                    \
    F(cuStreamQuery_ptsz, CUresult, (CUstream))                               \
    F(cuStreamWaitEvent, CUresult, (CUstream, CUevent, unsigned))             \
    F(cuEventCreate, CUresult, (CUevent *, unsigned))                         \
    F(cuEventDestroy_v2, CUresult, (CUevent))                                 \
    F(cuEventRecord, CUresult, (CUevent, CUstream))                           \
    F(cuEventRecord_ptsz, CUresult, (CUevent, CUstream))                      \
    F(cuEventRecordWithFlags, CUresult, (CUevent, CUstream, unsigned))        \
    F(cuEventQuery, CUresult, (CUevent))                                      \
    F(cuEventSynchronize, CUresult, (CUevent))                                \
    F(cuEventElapsedTime, CUresult, (float *, CUevent, CUevent))              \
    F(cuEventElapsedTime_v2, CUresult, (float *, CUevent, CUevent))           \
    F(cuLaunchKernelEx, CUresult, (const CUlaunchConfig *, CUfunction,        \
                                   void **, void **))                         \
    F(cuGraphCreate, CUresult, (CUgraph *, unsigned))                         \
    F(cuGraphDestroy, CUresult, (CUgraph))                                    \
    F(cuGraphAddKernelNode_v2, CUresult, (CUgraphNode *, CUgraph,             \
                                          const CUgraphNode *, size_t,        \
                                          const CUDA_KERNEL_NODE_PARAMS *))   \
    F(cuGraphAddDependencies_v2, CUresult, (CUgraph, const CUgraphNode *,     \
                                            const CUgraphNode *,              \
                                            const CUgraphEdgeData *, size_t)) \
    F(cuGraphGetNodes, CUresult, (CUgraph, CUgraphNode *, size_t *))          \
    F(cuGraphInstantiateWithFlags, CUresult, (CUgraphExec *, CUgraph,         \
                                              unsigned long long))            \
    F(cuGraphLaunch, CUresult, (CUgraphExec, CUstream))                       \
    F(cuGraphExecDestroy, CUresult, (CUgraphExec))                            \
    F(cuStreamBeginCapture_v2, CUresult, (CUstream, CUstreamCaptureMode))     \
    F(cuStreamEndCapture, CUresult, (CUstream, CUgraph *))                    \
    F(cuStreamIsCapturing, CUresult, (CUstream, CUstreamCaptureStatus *))
FUNCS
#undef F
static launch_fn cuLaunchKernel, cuLaunchKernel_ptsz;
static coop_fn cuLaunchCooperativeKernel;

#define F(name, ret, args) *(void **)&name = sym(#name);
static void load(void)
{
    sim_test_open();
    FUNCS
    *(void **)&cuLaunchKernel = sym("cuLaunchKernel");
    *(void **)&cuLaunchKernel_ptsz = sym("cuLaunchKernel_ptsz");
    *(void **)&cuLaunchCooperativeKernel = sym("cuLaunchCooperativeKernel");
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static CUfunction g_spin, g_grid;
static char **g_argv;
static CUevent g_e0, g_e1;

/* queue spin(us) on s */
static CUresult spin(CUstream s, uint32_t us)
{
    void *params[] = {&us};
    return cuLaunchKernel(g_spin, 1, 1, 1, 32, 1, 1, 0, s, params, NULL);
}

static float elapsed(void)
{
    float ms = -1;
    OK(cuEventSynchronize(g_e1));
    OK(cuEventElapsedTime(&ms, g_e0, g_e1));
    return ms;
}

static void test_modules(void)
{
    CUmodule m, m2;
    CU(cuModuleLoadData(&m, NULL), CUDA_ERROR_INVALID_VALUE);
    OK(cuModuleLoadData(&m, "any image at all"));
    OK(cuModuleLoadDataEx(&m2, "\x7f" "ELF", 0, NULL, NULL));
    OK(cuModuleGetFunction(&g_spin, m, "spin"));
    OK(cuModuleGetFunction(&g_grid, m, "saxpy"));
    CUfunction again, other;
    OK(cuModuleGetFunction(&again, m, "spin"));
    CHECK(again == g_spin);
    OK(cuModuleGetFunction(&other, m2, "whatever_name"));
    const char *name = NULL;
    OK(cuFuncGetName(&name, g_grid));
    CHECK(name && !strcmp(name, "saxpy"));
    OK(cuModuleUnload(m2));
    CU(cuModuleUnload(m2), CUDA_ERROR_INVALID_HANDLE);
    uint32_t us = 1;
    void *params[] = {&us};
    CU(cuLaunchKernel(other, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL),
       CUDA_ERROR_INVALID_HANDLE);
    CU(cuLaunchKernel(g_spin, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL),
       CUDA_ERROR_INVALID_VALUE);               /* spin needs its param */
    CU(cuLaunchKernel(g_grid, 0, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL),
       CUDA_ERROR_INVALID_VALUE);
    CU(cuLaunchKernel(g_grid, 1, 1, 1, 1025, 1, 1, 0, NULL, NULL, NULL),
       CUDA_ERROR_INVALID_VALUE);
    OK(cuCtxSynchronize());
}

static void test_durations(void)
{
    OK(cuEventCreate(&g_e0, CU_EVENT_DEFAULT));
    OK(cuEventCreate(&g_e1, CU_EVENT_BLOCKING_SYNC));
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    uint32_t us[] = {1000, 5000, 20000};
    for (int i = 0; i < 3; i++) {
        OK(cuEventRecord(g_e0, s));
        OK(spin(s, us[i]));
        OK(cuEventRecord(g_e1, s));
        NEAR(elapsed(), us[i] / 1000.0, us[i] / 1000.0 + 3);
    }
    /* 1 us per block: 40 x 25 x 5 = 5000 blocks = 5 ms */
    OK(cuEventRecord(g_e0, s));
    OK(cuLaunchKernel(g_grid, 40, 25, 5, 256, 1, 1, 0, s, NULL, NULL));
    OK(cuEventRecord(g_e1, s));
    NEAR(elapsed(), 5.0, 8.0);
    /* spin's parameter through "extra" */
    uint32_t v = 3000;
    size_t sz = sizeof v;
    void *extra[] = {GV_CU_LAUNCH_PARAM_BUFFER_POINTER, &v,
                     GV_CU_LAUNCH_PARAM_BUFFER_SIZE, &sz,
                     GV_CU_LAUNCH_PARAM_END};
    OK(cuEventRecord(g_e0, s));
    OK(cuLaunchKernel(g_spin, 1, 1, 1, 1, 1, 1, 0, s, NULL, extra));
    OK(cuEventRecord(g_e1, s));
    NEAR(elapsed(), 3.0, 6.0);
    float ms;
    OK(cuEventElapsedTime_v2(&ms, g_e0, g_e1));
    NEAR(ms, 3.0, 6.0);
    /* timing disabled / never recorded */
    CUevent nt, fresh;
    OK(cuEventCreate(&nt, CU_EVENT_DISABLE_TIMING));
    OK(cuEventCreate(&fresh, 0));
    OK(cuEventQuery(fresh));                    /* never recorded: done */
    OK(cuEventRecord(nt, s));
    CU(cuEventElapsedTime(&ms, g_e0, nt), CUDA_ERROR_INVALID_HANDLE);
    CU(cuEventElapsedTime(&ms, g_e0, fresh), CUDA_ERROR_INVALID_HANDLE);
    OK(cuEventDestroy_v2(nt));
    OK(cuEventDestroy_v2(fresh));
    OK(cuStreamDestroy_v2(s));
}

static void test_async(void)
{
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    double t0 = now_ms();
    OK(spin(s, 200000));                        /* 200 ms */
    OK(cuEventRecord(g_e1, s));
    CHECK(now_ms() - t0 < 50);                  /* returned at once */
    CU(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    CU(cuEventQuery(g_e1), CUDA_ERROR_NOT_READY);
    float ms;
    OK(cuEventRecord(g_e0, s));                 /* after e1 in the stream */
    CU(cuEventElapsedTime(&ms, g_e1, g_e0), CUDA_ERROR_NOT_READY);
    OK(cuStreamSynchronize(s));
    NEAR(now_ms() - t0, 195, 400);
    OK(cuStreamQuery(s));
    OK(cuEventQuery(g_e1));
    /* an event waits only for the work recorded before it */
    OK(cuEventRecord(g_e0, s));
    OK(spin(s, 100000));
    CUevent mid;
    OK(cuEventCreate(&mid, 0));
    OK(cuEventRecord(mid, s));
    OK(spin(s, 100000));
    OK(cuEventRecord(g_e1, s));
    t0 = now_ms();
    OK(cuEventSynchronize(mid));
    NEAR(now_ms() - t0, 90, 180);
    CU(cuEventQuery(g_e1), CUDA_ERROR_NOT_READY);
    OK(cuEventElapsedTime(&ms, g_e0, mid));
    NEAR(ms, 99, 110);
    NEAR(elapsed(), 199, 215);
    OK(cuEventDestroy_v2(mid));
    OK(cuStreamDestroy_v2(s));
}

/* two streams of one context share the device: one kernel at a time */
static void test_serialise(void)
{
    CUstream a, b;
    OK(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
    OK(cuStreamCreateWithPriority(&b, CU_STREAM_NON_BLOCKING, -1));
    double t0 = now_ms();
    OK(cuEventRecord(g_e0, a));
    OK(spin(a, 50000));
    OK(spin(b, 50000));
    OK(spin(a, 50000));
    OK(cuEventRecord(g_e1, b));                 /* after 2 kernels */
    NEAR(elapsed(), 99, 115);
    CU(cuStreamQuery(a), CUDA_ERROR_NOT_READY);
    OK(cuCtxSynchronize());                     /* waits for every stream */
    NEAR(now_ms() - t0, 148, 300);
    OK(cuStreamQuery(a));
    /* cross-stream dependency through an event */
    OK(cuEventRecord(g_e0, a));
    OK(spin(a, 30000));
    CUevent ev;
    OK(cuEventCreate(&ev, 0));
    OK(cuEventRecord(ev, a));
    OK(cuStreamWaitEvent(b, ev, 0));
    OK(cuEventRecord(g_e1, b));
    NEAR(elapsed(), 29, 45);
    OK(cuEventDestroy_v2(ev));
    OK(cuStreamDestroy_v2(a));
    OK(cuStreamDestroy_v2(b));
}

/* legacy default stream waits for blocking streams; per-thread stream */
static void test_default_streams(void)
{
    CUstream blk, nb;
    OK(cuStreamCreate(&blk, 0));
    OK(cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
    OK(spin(blk, 60000));
    CU(cuStreamQuery(NULL), CUDA_ERROR_NOT_READY);      /* legacy waits */
    CU(cuStreamQuery(GV_CU_STREAM_LEGACY), CUDA_ERROR_NOT_READY);
    OK(cuStreamQuery(nb));                              /* does not */
    OK(cuStreamQuery_ptsz(NULL));                       /* per-thread idle */
    OK(cuStreamSynchronize(NULL));
    OK(cuStreamQuery(blk));
    /* per-thread stream, by handle and by NULL through _ptsz */
    uint32_t us = 40000;
    void *params[] = {&us};
    OK(cuLaunchKernel_ptsz(g_spin, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
    CU(cuStreamQuery(GV_CU_STREAM_PER_THREAD), CUDA_ERROR_NOT_READY);
    CU(cuStreamQuery_ptsz(NULL), CUDA_ERROR_NOT_READY);
    OK(cuEventRecord_ptsz(g_e1, NULL));
    CU(cuEventQuery(g_e1), CUDA_ERROR_NOT_READY);
    OK(cuStreamSynchronize_ptsz(NULL));
    OK(cuEventQuery(g_e1));
    /* the legacy stream: launch, record, sync */
    OK(cuEventRecord(g_e0, NULL));
    OK(spin(NULL, 20000));
    OK(cuEventRecordWithFlags(g_e1, NULL, 0));
    NEAR(elapsed(), 19, 30);
    OK(cuStreamDestroy_v2(blk));
    OK(cuStreamDestroy_v2(nb));
}

/* launches block once SIM_QUEUE_DEPTH (1024) are pending in a context */
static void test_queue_bound(void)
{
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    double t0 = now_ms();
    for (int i = 0; i < 1000; i++)
        OK(spin(s, 500));
    double t_fill = now_ms() - t0;
    CHECK(t_fill < 100);                        /* 500 ms of work queued */
    for (int i = 0; i < 224; i++)
        OK(spin(s, 500));
    /* launch 1224 waited for launch 200 to complete (>= 100 ms) */
    double t_all = now_ms() - t0;
    if (t_all < 95) {
        printf("FAIL queue did not block: 1224 launches in %.1f ms\n", t_all);
        exit(1);
    }
    CU(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    OK(cuStreamSynchronize(s));
    NEAR(now_ms() - t0, 605, 1200);
    OK(cuStreamDestroy_v2(s));
}

static CUDA_KERNEL_NODE_PARAMS spin_node(uint32_t *us)
{
    static void *params[8];
    static int k;
    void **p = &params[k++ % 8];
    *p = us;
    CUDA_KERNEL_NODE_PARAMS np;
    memset(&np, 0, sizeof np);
    np.func = g_spin;
    np.gridDimX = np.gridDimY = np.gridDimZ = 1;
    np.blockDimX = np.blockDimY = np.blockDimZ = 1;
    np.kernelParams = p;
    return np;
}

static void test_graphs(void)
{
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    /* explicit: a -> b, a -> c, 10 + 20 + 30 ms */
    CUgraph g;
    OK(cuGraphCreate(&g, 0));
    uint32_t t1 = 10000, t2 = 20000, t3 = 30000;
    CUDA_KERNEL_NODE_PARAMS p1 = spin_node(&t1), p2 = spin_node(&t2),
                            p3 = spin_node(&t3);
    CUgraphNode a, b, c;
    OK(cuGraphAddKernelNode_v2(&a, g, NULL, 0, &p1));
    OK(cuGraphAddKernelNode_v2(&b, g, &a, 1, &p2));
    OK(cuGraphAddKernelNode_v2(&c, g, NULL, 0, &p3));
    OK(cuGraphAddDependencies_v2(g, &a, &c, NULL, 1));
    t1 = t2 = t3 = 999999;                      /* params were copied */
    size_t n = 0;
    OK(cuGraphGetNodes(g, NULL, &n));
    CHECK(n == 3);
    CUgraphExec ge;
    OK(cuGraphInstantiateWithFlags(&ge, g, 0));
    OK(cuGraphDestroy(g));                      /* exec is independent */
    OK(cuEventRecord(g_e0, s));
    double t0 = now_ms();
    OK(cuGraphLaunch(ge, s));
    OK(cuGraphLaunch(ge, s));
    CHECK(now_ms() - t0 < 50);
    OK(cuEventRecord(g_e1, s));
    NEAR(elapsed(), 119, 140);
    /* captured: launches go into the graph and do not run */
    CUstreamCaptureStatus st;
    OK(cuStreamIsCapturing(s, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_NONE);
    CU(cuStreamBeginCapture_v2(NULL, CU_STREAM_CAPTURE_MODE_GLOBAL),
       CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    OK(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    OK(cuStreamIsCapturing(s, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CU(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
       CUDA_ERROR_ILLEGAL_STATE);
    t0 = now_ms();
    OK(spin(s, 25000));
    OK(cuLaunchKernel(g_grid, 5000, 1, 1, 64, 1, 1, 0, s, NULL, NULL));
    OK(cuGraphLaunch(ge, s));                   /* 60 ms more, captured */
    CUgraph cg;
    OK(cuStreamEndCapture(s, &cg));
    CHECK(cg != NULL);
    OK(cuStreamQuery(s));                       /* nothing ran */
    CHECK(now_ms() - t0 < 80);                  /* run, the 90 ms would have taken longer */
    OK(cuStreamIsCapturing(s, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_NONE);
    OK(cuGraphGetNodes(cg, NULL, &n));
    CHECK(n == 5);
    CUgraphExec ce;
    OK(cuGraphInstantiateWithFlags(&ce, cg, 0));
    OK(cuEventRecord(g_e0, s));
    OK(cuGraphLaunch(ce, s));
    OK(cuEventRecord(g_e1, s));
    NEAR(elapsed(), 89, 110);                   /* 25 + 5 + 60 */
    /* a synchronize during capture invalidates it */
    OK(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    OK(spin(s, 1000));
    CU(cuStreamSynchronize(s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    OK(cuStreamIsCapturing(s, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    CU(cuStreamEndCapture(s, &cg), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CHECK(cg == NULL);
    CU(cuStreamEndCapture(s, &cg), CUDA_ERROR_ILLEGAL_STATE);
    OK(cuGraphExecDestroy(ce));
    OK(cuGraphExecDestroy(ge));
    OK(cuStreamDestroy_v2(s));
}

static void test_launch_ex(void)
{
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    uint32_t us = 15000;
    void *params[] = {&us};
    CUlaunchAttribute attr;
    memset(&attr, 0, sizeof attr);
    attr.id = CU_LAUNCH_ATTRIBUTE_PRIORITY;
    attr.value.priority = -1;
    CUlaunchConfig cfg = {1, 1, 1, 128, 1, 1, 0, s, &attr, 1};
    OK(cuEventRecord(g_e0, s));
    OK(cuLaunchKernelEx(&cfg, g_spin, params, NULL));
    OK(cuEventRecord(g_e1, s));
    NEAR(elapsed(), 14.9, 25);
    CU(cuLaunchKernelEx(NULL, g_spin, params, NULL), CUDA_ERROR_INVALID_VALUE);
    /* grid-based, cooperative through the attribute: 10 sms here */
    attr.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attr.value.cooperative = 1;
    CUlaunchConfig big = {1000, 1, 1, 1024, 1, 1, 0, s, &attr, 1};
    CU(cuLaunchKernelEx(&big, g_grid, NULL, NULL),
       CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
    CUlaunchConfig fit = {20, 1, 1, 1024, 1, 1, 0, s, &attr, 1};
    OK(cuEventRecord(g_e0, s));
    OK(cuLaunchKernelEx(&fit, g_grid, NULL, NULL));
    OK(cuEventRecord(g_e1, s));
    NEAR(elapsed(), 0.015, 3);
    /* cuLaunchCooperativeKernel */
    CU(cuLaunchCooperativeKernel(g_grid, 321, 1, 1, 1, 1, 1, 0, s, NULL),
       CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);        /* > 10 x 32 */
    OK(cuEventRecord(g_e0, s));
    OK(cuLaunchCooperativeKernel(g_spin, 1, 1, 1, 64, 1, 1, 0, s, params));
    OK(cuEventRecord(g_e1, s));
    NEAR(elapsed(), 14.9, 25);
    OK(cuStreamDestroy_v2(s));
}

/* another process's kernels occupy the same device; a dead process's
 * queued kernels still run */
static void test_processes(void)
{
    int pfd[2];
    CHECK(pipe(pfd) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        /* CUDA cannot be used in a child forked after cuInit (as with a
         * real driver): the other process is a fresh image of this test
         * (spin_child) */
        close(pfd[0]);
        char fd[16];
        snprintf(fd, sizeof fd, "%d", pfd[1]);
        setenv("GV_T_TIMELINE_CHILD_FD", fd, 1);
        execv("/proc/self/exe", g_argv);
        _exit(127);
    }
    close(pfd[1]);
    char ch;
    CHECK(read(pfd[0], &ch, 1) == 1);
    close(pfd[0]);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) &&
          WEXITSTATUS(st) == 0);
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    double t0 = now_ms();
    OK(cuEventRecord(g_e0, s));
    OK(spin(s, 10000));
    OK(cuEventRecord(g_e1, s));
    /* Contexts time-slice the device: our events, like our kernel, are
     * reached only after the child's queued kernel; so they bracket our
     * own 10 ms exactly. */
    OK(cuEventSynchronize(g_e0));
    NEAR(now_ms() - t0, 100, 175);              /* queued behind the child */
    NEAR(elapsed(), 9.9, 11);
    OK(cuStreamDestroy_v2(s));
}

/* ---- cuGetProcAddress ---------------------------------------------------- */

static void *pa(const char *name, int ver, cuuint64_t fl)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = 99;
    CUresult rc = cuGetProcAddress_v2(name, &fn, ver, fl, &st);
    if (rc != CUDA_SUCCESS || st != CU_GET_PROC_ADDRESS_SUCCESS || !fn) {
        printf("FAIL cuGetProcAddress_v2(%s, %d, %llu) = %d/%d\n", name, ver,
               (unsigned long long)fl, rc, st);
        exit(1);
    }
    return fn;
}

static void test_procaddr(void)
{
    static const struct { const char *base; int ver; int fl; const char *sym; } c[] = {
        {"cuLaunchKernel", 4000, 0, "cuLaunchKernel"},
        {"cuLaunchKernel", 13000, 2, "cuLaunchKernel_ptsz"},
        {"cuLaunchKernelEx", 11060, 0, "cuLaunchKernelEx"},
        {"cuLaunchKernelEx", 12000, 2, "cuLaunchKernelEx_ptsz"},
        {"cuLaunchCooperativeKernel", 9000, 2, "cuLaunchCooperativeKernel_ptsz"},
        {"cuModuleLoadData", 2000, 0, "cuModuleLoadData"},
        {"cuModuleLoadDataEx", 2010, 0, "cuModuleLoadDataEx"},
        {"cuModuleGetFunction", 13000, 2, "cuModuleGetFunction"},
        {"cuModuleUnload", 2000, 0, "cuModuleUnload"},
        {"cuEventCreate", 2000, 0, "cuEventCreate"},
        {"cuEventDestroy", 3000, 0, "cuEventDestroy"},
        {"cuEventDestroy", 4000, 0, "cuEventDestroy_v2"},
        {"cuEventRecord", 2000, 0, "cuEventRecord"},
        {"cuEventRecord", 12000, 2, "cuEventRecord_ptsz"},
        {"cuEventRecordWithFlags", 11010, 2, "cuEventRecordWithFlags_ptsz"},
        {"cuEventQuery", 2000, 0, "cuEventQuery"},
        {"cuEventSynchronize", 2000, 0, "cuEventSynchronize"},
        {"cuEventElapsedTime", 12000, 0, "cuEventElapsedTime"},
        {"cuEventElapsedTime", 12080, 0, "cuEventElapsedTime_v2"},
        {"cuStreamWaitEvent", 3020, 2, "cuStreamWaitEvent_ptsz"},
        {"cuStreamQuery", 2000, 2, "cuStreamQuery_ptsz"},
        {"cuCtxSynchronize", 13000, 0, "cuCtxSynchronize_v2"},
        {"cuGraphCreate", 10000, 0, "cuGraphCreate"},
        {"cuGraphAddKernelNode", 10000, 0, "cuGraphAddKernelNode"},
        {"cuGraphAddKernelNode", 12000, 0, "cuGraphAddKernelNode_v2"},
        {"cuGraphAddDependencies", 12000, 0, "cuGraphAddDependencies"},
        {"cuGraphAddDependencies", 12030, 0, "cuGraphAddDependencies_v2"},
        {"cuGraphInstantiate", 10000, 0, "cuGraphInstantiate"},
        {"cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2"},
        {"cuGraphInstantiate", 12000, 0, "cuGraphInstantiateWithFlags"},
        {"cuGraphInstantiateWithFlags", 11040, 0, "cuGraphInstantiateWithFlags"},
        {"cuGraphLaunch", 10000, 0, "cuGraphLaunch"},
        {"cuGraphLaunch", 10000, 2, "cuGraphLaunch_ptsz"},
        {"cuGraphExecDestroy", 10000, 0, "cuGraphExecDestroy"},
        {"cuGraphDestroy", 10000, 0, "cuGraphDestroy"},
        {"cuStreamBeginCapture", 10000, 0, "cuStreamBeginCapture"},
        {"cuStreamBeginCapture", 10000, 2, "cuStreamBeginCapture_ptsz"},
        {"cuStreamBeginCapture", 10010, 0, "cuStreamBeginCapture_v2"},
        {"cuStreamBeginCapture", 13000, 2, "cuStreamBeginCapture_v2_ptsz"},
        {"cuStreamEndCapture", 10000, 2, "cuStreamEndCapture_ptsz"},
        {"cuStreamIsCapturing", 10000, 2, "cuStreamIsCapturing_ptsz"},
        {"cuLibraryLoadData", 12000, 0, "cuLibraryLoadData"},
        {"cuLibraryGetKernel", 12000, 0, "cuLibraryGetKernel"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++)
        if (pa(c[i].base, c[i].ver, (cuuint64_t)c[i].fl) != sym(c[i].sym)) {
            printf("FAIL cuGetProcAddress_v2(%s, %d, %d) is not %s\n",
                   c[i].base, c[i].ver, c[i].fl, c[i].sym);
            exit(1);
        }
    void *fn;
    CUdriverProcAddressQueryResult st;
    CU(cuGetProcAddress_v2("cuLaunchKernelEx", &fn, 11050, 0, &st),
       CUDA_ERROR_NOT_FOUND);
    CHECK(st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    CU(cuGetProcAddress_v2("cuGraphCreate", &fn, 9020, 0, &st),
       CUDA_ERROR_NOT_FOUND);
}

/* the other process of test_processes: queues a 150 ms kernel on the
 * parent's node, says so, and exits (its work stays queued) */
static int spin_child(int fd)
{
    load();
    CUcontext c;
    CUmodule m;
    if (cuInit(0) || cuCtxCreate_v2(&c, 0, 0) || cuModuleLoadData(&m, "image") ||
        cuModuleGetFunction(&g_spin, m, "spin") || spin(NULL, 150000))
        _exit(2);
    if (write(fd, "x", 1) != 1)
        _exit(3);
    _exit(0);
}

int main(int argc, char **argv)
{
    g_argv = argv;
    sim_test_lib(argc, argv);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (getenv("GV_T_TIMELINE_CHILD_FD"))
        return spin_child(atoi(getenv("GV_T_TIMELINE_CHILD_FD")));
    sim_test_state("sim-timeline");
    setenv("GPUVISOR_SIM_DEVICES", "1x4g:sms=10", 1);
    unsetenv("CUDA_VISIBLE_DEVICES");
    load();
    OK(cuInit(0));
    test_procaddr();
    CUcontext ctx;
    OK(cuCtxCreate_v2(&ctx, 0, 0));
    test_modules();
    test_durations();
    test_async();
    test_serialise();
    test_default_streams();
    test_queue_bound();
    test_graphs();
    test_launch_ex();
    test_processes();
    printf("OK\n");
    return 0;
}
