/*
 * t_link_sm_threads - gated launches from several threads at once: each
 * thread launches `spin` kernels on a stream of its own, through the pacing
 * gate, the enqueue word (sm_enqueue.c) and the meter thread, and a graph
 * now and then.  Run under the shim with an SM limit, and under
 * ThreadSanitizer (tests/test_sanitizers.py).  Given a number of seconds,
 * each thread launches for that long (at least LAUNCHES times): long
 * enough for the policy thread's updates and the calibration against NVML
 * (sm_policy_thread.c, sm_calib.c) to run beside the meter's settling.
 *
 *   t_link_sm_threads [SECONDS]   prints "launched=<N> failed=<M>"
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_protos.h"

#define THREADS 4
#define LAUNCHES 100

static CUcontext ctx;
static CUfunction spin;
static atomic_int launched, failed;
static double seconds;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void *worker(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    CUstream s;
    CUgraph g;
    CUgraphNode node;
    CUgraphExec exec;
    uint32_t graph_us = 150;
    void *graph_args[] = { &graph_us };
    CUDA_KERNEL_NODE_PARAMS p = { 0 };
    p.func = spin;
    p.gridDimX = p.gridDimY = p.gridDimZ = 1;
    p.blockDimX = 32;
    p.blockDimY = p.blockDimZ = 1;
    p.kernelParams = graph_args;
    if (cuCtxSetCurrent(ctx) || cuStreamCreate(&s, 0x1) || cuGraphCreate(&g, 0) ||
        cuGraphAddKernelNode_v2(&node, g, NULL, 0, &p) ||
        cuGraphInstantiateWithFlags(&exec, g, 0)) {
        atomic_fetch_add(&failed, 1);
        return NULL;
    }
    double end = now_s() + seconds;
    for (int i = 0; i < LAUNCHES || now_s() < end; i++) {
        seed = seed * 1103515245u + 12345u;
        uint32_t us = 50 + (seed >> 16) % 250;
        void *args[] = { &us };
        CUresult rc = i % 10 == 9 ? cuGraphLaunch(exec, s)
                                  : cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, s, args, NULL);
        atomic_fetch_add(rc == CUDA_SUCCESS ? &launched : &failed, 1);
    }
    if (cuStreamSynchronize(s) || cuStreamDestroy_v2(s))
        atomic_fetch_add(&failed, 1);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        seconds = atof(argv[1]);
    CUdevice d;
    CUmodule m;
    if (cuInit(0) || cuDeviceGet(&d, 0) || cuDevicePrimaryCtxRetain(&ctx, d) ||
        cuCtxSetCurrent(ctx) || cuModuleLoadData(&m, "any image") ||
        cuModuleGetFunction(&spin, m, "spin"))
        return 2;
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    printf("launched=%d failed=%d\n", atomic_load(&launched), atomic_load(&failed));
    return 0;
}
