/*
 * bench_sm_worker.c - the workload of the SM-quota benchmark (make bench-sm,
 * tests/bench/sm_bench.py).  Linked with -lcuda like an ordinary CUDA
 * program; run with libgpuvisor.so preloaded.
 *
 * usage: bench_sm_worker SECONDS SEED [PHASE_MS [KERNEL_US]]
 *
 * Sets up (cuInit, primary context, a non-blocking stream, three modules
 * each with a `spin` function, eight CUDA graphs of 1-4 spin kernels),
 * prints "ready", waits for a line on stdin, then launches back to back for
 * SECONDS: about 80 % cuLaunchKernel, 10 % cuLaunchKernelEx, 10 %
 * cuGraphLaunch.  Every kernel runs log-uniform 20 us .. 5 ms on the
 * simulated device (spin's first parameter); grid sizes are random and
 * independent of the duration, and the function (module) is picked at
 * random, so neither predicts what a launch costs.  The worker always has
 * work queued: what it gets is what its quota allows.
 *
 * The ideal-scheduler model (tests/bench/sm_floor.py, WorkerProcess) draws
 * the same launches from the same generator in the same order; a change to
 * what is drawn here, or when, must be made there too
 * (tests/test_bench_sm_smoke.py checks the two agree).
 *
 * PHASE_MS > 0: alternate idle and busy phases of PHASE_MS each, idle first
 * (the side of a burst-share pair that is idle half the time).
 *
 * KERNEL_US > 0 (PHASE_MS 0): instead, the shape of make bench-gpu's
 * PyTorch worker (tests/bench/torch_sm.py) on the legacy default stream:
 * batches of 3 kernels of KERNEL_US each, an event recorded after each
 * batch, and a wait on the batch before last (at most two batches queued).
 * KERNEL_US:J draws each kernel uniform within +-J % of KERNEL_US (from
 * SEED); a suffix xN makes batches of N kernels (KERNEL_US[:J]xN).  The
 * report adds the host time of each wait's end and the kernels done by
 * then ("marks": [[s, kernels], ...]), from which the driver
 * (tests/bench/sm_shared.py --kernel-us) computes 100 ms windows.
 *
 * At the end: synchronize, print one JSON line (pid, t0_ns = CLOCK_MONOTONIC
 * at "go", launch counts, requested GPU time).  Exit 0, or 3 with
 * {"error": ...} on a driver error.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_protos.h"   /* our own prototypes (gv_cuda.h declares types only) */

#define NFUNCS 3
#define NGRAPHS 8
#define MAX_NODES 4
#define CU_STREAM_NON_BLOCKING_FLAG 0x1
#define BATCH 3                 /* kernels per batch, unless told */
#define RING 3                  /* events: the batch before last is waited on */
#define MAX_MARKS 65536

static void fail(const char *what, CUresult rc)
{
    printf("{\"error\": \"%s returned %d\"}\n", what, (int)rc);
    fflush(stdout);
    exit(3);
}

#define OK(call)                                                             \
    do {                                                                     \
        CUresult rc_ = (call);                                               \
        if (rc_ != CUDA_SUCCESS)                                             \
            fail(#call, rc_);                                                \
    } while (0)

/* xorshift64*: a small, seedable generator */
static uint64_t rng_state;
static uint64_t rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1DULL;
}
static double unit(void) { return (double)(rnd() >> 11) / 9007199254740992.0; }

/* log-uniform 20 us .. 5 ms */
static uint32_t duration_us(void)
{
    double lo = 20.0, hi = 5000.0;
    double v = lo * exp(unit() * log(hi / lo));
    return (uint32_t)(v + 0.5);
}

static unsigned grid(void) { return 1 + (unsigned)(rnd() % 1024); }

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t)
{
    struct timespec ts = { (time_t)(t / 1000000000ULL), (long)(t % 1000000000ULL) };
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0)
        ;
}

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 5) {
        fprintf(stderr, "usage: bench_sm_worker SECONDS SEED [PHASE_MS [KERNEL_US]]\n");
        return 2;
    }
    double seconds = atof(argv[1]);
    rng_state = (uint64_t)strtoull(argv[2], NULL, 10) * 0x9E3779B97F4A7C15ULL + 88172645463325252ULL;
    uint64_t phase_ns = argc >= 4 ? (uint64_t)(atof(argv[3]) * 1e6) : 0;
    char *jit = NULL;
    uint32_t kernel_us = argc == 5 ? (uint32_t)strtoul(argv[4], &jit, 10) : 0;
    double jitter = jit && *jit == ':' ? (double)strtoul(jit + 1, &jit, 10) / 100 : 0;
    int batch = jit && *jit == 'x' ? atoi(jit + 1) : BATCH;
    if (batch < 1 || batch > 100000 || jitter >= 1 || (jit && *jit && *jit != 'x')) {
        fprintf(stderr, "bench_sm_worker: KERNEL_US %s: not US[:J][xN] with J < 100, N 1 to "
                "100000\n", argv[4]);
        return 2;
    }

    CUstream s;
    OK(gv_test_primary_ctx(0, NULL));
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING_FLAG));
    CUfunction fn[NFUNCS];
    for (int i = 0; i < NFUNCS; i++) {
        CUmodule m;
        char image[32];
        snprintf(image, sizeof image, "bench module %d", i);
        OK(cuModuleLoadData(&m, image));
        OK(cuModuleGetFunction(&fn[i], m, "spin"));
    }

    /* Graphs: 1-4 spin nodes each, in a chain; durations fixed at creation. */
    CUgraphExec graphs[NGRAPHS];
    uint64_t graph_us[NGRAPHS];
    static uint32_t node_us[NGRAPHS][MAX_NODES];
    static void *node_params[NGRAPHS][MAX_NODES][1];
    for (int g = 0; g < NGRAPHS; g++) {
        CUgraph graph;
        OK(cuGraphCreate(&graph, 0));
        int nodes = 1 + (int)(rnd() % MAX_NODES);
        CUgraphNode prev = NULL;
        graph_us[g] = 0;
        for (int k = 0; k < nodes; k++) {
            node_us[g][k] = duration_us();
            node_params[g][k][0] = &node_us[g][k];
            CUDA_KERNEL_NODE_PARAMS p;
            memset(&p, 0, sizeof p);
            p.func = fn[rnd() % NFUNCS];
            p.gridDimX = grid();
            p.gridDimY = p.gridDimZ = 1;
            p.blockDimX = 128;
            p.blockDimY = p.blockDimZ = 1;
            p.kernelParams = node_params[g][k];
            CUgraphNode node;
            OK(cuGraphAddKernelNode_v2(&node, graph, prev ? &prev : NULL, prev ? 1 : 0, &p));
            prev = node;
            graph_us[g] += node_us[g][k];
        }
        OK(cuGraphInstantiateWithFlags(&graphs[g], graph, 0));
    }

    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = 256;
    cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.hStream = s;

    printf("ready\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return 0;                                /* told to go away */

    uint64_t t0 = mono_ns(), end = t0 + (uint64_t)(seconds * 1e9);
    uint64_t n_kernel = 0, n_ex = 0, n_graph = 0, gpu_us = 0;
    if (kernel_us) {
        /* The PyTorch worker's shape (the header). */
        static float mark_s[MAX_MARKS];
        static uint32_t mark_n[MAX_MARKS];
        CUevent ev[RING];
        for (int i = 0; i < RING; i++)
            OK(cuEventCreate(&ev[i], 0));
        uint64_t k = 0, done = 0;   /* batches launched, kernels known done */
        size_t marks = 0;
        uint32_t us;
        void *params[] = { &us };
        CUstream bs = NULL;     /* PyTorch's default: the legacy default stream */
        while (mono_ns() < end) {
            for (int i = 0; i < batch; i++) {
                us = (uint32_t)(kernel_us * (1 + jitter * (2 * unit() - 1)) + 0.5);
                gpu_us += us;
                OK(cuLaunchKernel(fn[0], 132, 1, 1, 128, 1, 1, 0, bs, params, NULL));
            }
            n_kernel += (uint64_t)batch;
            OK(cuEventRecord(ev[k % RING], bs));
            if (k >= 2) {
                OK(cuEventSynchronize(ev[(k - 2) % RING]));
                done += (uint64_t)batch;
                if (marks < MAX_MARKS) {
                    mark_s[marks] = (float)((double)(mono_ns() - t0) / 1e9);
                    mark_n[marks++] = (uint32_t)done;
                }
            }
            k++;
        }
        OK(cuStreamSynchronize(bs));
        uint64_t t1 = mono_ns();
        printf("{\"pid\": %d, \"t0_ns\": %llu, \"wall_s\": %.4f, \"launch_kernel\": %llu, "
               "\"launch_ex\": 0, \"graph_launch\": 0, \"gpu_us\": %llu, \"kernel_us\": %u, "
               "\"marks\": [",
               (int)getpid(), (unsigned long long)t0, (double)(t1 - t0) / 1e9,
               (unsigned long long)n_kernel, (unsigned long long)gpu_us, kernel_us);
        for (size_t i = 0; i < marks; i++)
            printf("%s[%.6f, %u]", i ? ", " : "", (double)mark_s[i], mark_n[i]);
        printf("]}\n");
        fflush(stdout);
        return 0;
    }
    for (;;) {
        uint64_t now = mono_ns();
        if (now >= end)
            break;
        if (phase_ns && ((now - t0) / phase_ns) % 2 == 0) {   /* idle phase */
            uint64_t next = t0 + ((now - t0) / phase_ns + 1) * phase_ns;
            sleep_until(next < end ? next : end);
            continue;
        }
        double r = unit();
        if (r < 0.10) {
            int g = (int)(rnd() % NGRAPHS);
            OK(cuGraphLaunch(graphs[g], s));
            gpu_us += graph_us[g];
            n_graph++;
            continue;
        }
        uint32_t us = duration_us();
        void *params[] = { &us };
        CUfunction f = fn[rnd() % NFUNCS];
        if (r < 0.20) {
            cfg.gridDimX = grid();
            OK(cuLaunchKernelEx(&cfg, f, params, NULL));
            n_ex++;
        } else {
            OK(cuLaunchKernel(f, grid(), 1, 1, 128, 1, 1, 0, s, params, NULL));
            n_kernel++;
        }
        gpu_us += us;
    }
    OK(cuStreamSynchronize(s));
    uint64_t t1 = mono_ns();
    printf("{\"pid\": %d, \"t0_ns\": %llu, \"wall_s\": %.4f, \"launch_kernel\": %llu, "
           "\"launch_ex\": %llu, \"graph_launch\": %llu, \"gpu_us\": %llu}\n",
           (int)getpid(), (unsigned long long)t0, (double)(t1 - t0) / 1e9,
           (unsigned long long)n_kernel, (unsigned long long)n_ex,
           (unsigned long long)n_graph, (unsigned long long)gpu_us);
    fflush(stdout);
    return 0;
}
