/*
 * t_link_ctx_race - a thread allocates 1 GiB while another thread's
 * context is being created and measured (run under the shim with
 * GPUVISOR_SIM_CTX_CREATE_MS=1000).  The context is charged what NVML
 * shows it took, not the other thread's allocation: once that is freed,
 * what is left charged is the two contexts.
 *
 *   t_link_ctx_race create|primary   prints "after_free_mib=<N>"
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cuda_protos.h"

static CUcontext first;
static CUdeviceptr big;
static CUresult big_rc = CUDA_ERROR_UNKNOWN;

static void *allocate(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(first);
    usleep(300 * 1000);         /* inside the other thread's 1 s creation */
    big_rc = cuMemAlloc_v2(&big, 1ULL << 30);
    return NULL;
}

int main(int argc, char **argv)
{
    int primary = argc > 1 && !strcmp(argv[1], "primary");
    CUdevice d;
    if (cuInit(0) || cuDeviceGet(&d, 0))
        return 2;
    /* The context that exists already, and the one measured meanwhile. */
    CUresult rc = primary ? cuCtxCreate_v2(&first, 0, d) : cuDevicePrimaryCtxRetain(&first, d);
    if (rc || cuCtxSetCurrent(first))
        return 3;
    pthread_t t;
    pthread_create(&t, NULL, allocate, NULL);
    CUcontext second;
    rc = primary ? cuDevicePrimaryCtxRetain(&second, d) : cuCtxCreate_v2(&second, 0, d);
    pthread_join(t, NULL);
    if (rc || big_rc)
        return 4;
    cuCtxSetCurrent(first);
    cuMemFree_v2(big);
    size_t f = 0, total = 0;
    cuMemGetInfo_v2(&f, &total);
    printf("after_free_mib=%zu\n", (total - f) >> 20);
    return 0;
}
