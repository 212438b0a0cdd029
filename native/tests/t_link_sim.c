/*
 * t_link_sim.c - a program linked with -lcuda -lnvidia-ml against the
 * simulated driver, like an ordinary CUDA program: the exported names
 * bind, and both libraries see the same node state.
 *
 * Run with LD_LIBRARY_PATH=build/sim and a private GPUVISOR_SIM_STATE
 * (GPUVISOR_SIM_DEVICES unset or one device of any size).
 * Prints "OK" and exits 0, or the failing check and exits 1.
 */
#include <stdio.h>
#include <unistd.h>

#include "gv_cuda.h"

/* our own prototypes (gv_cuda.h declares types only) */
CUresult cuInit(unsigned int);
CUresult cuDeviceGetCount(int *);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int, nvmlDevice_t *);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t,
                                                     unsigned int *,
                                                     nvmlProcessInfo_t *);

#define CHECK(c)                                                        \
    do {                                                                \
        if (!(c)) {                                                     \
            printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #c);         \
            return 1;                                                   \
        }                                                               \
    } while (0)

int main(void)
{
    int n = 0;
    unsigned nn = 0, cnt = 4;
    CUcontext c;
    CUdeviceptr p;
    size_t f, t;
    nvmlDevice_t h;
    nvmlMemory_t m;
    nvmlProcessInfo_t procs[4];
    CHECK(cuInit(0) == CUDA_SUCCESS);
    CHECK(cuDeviceGetCount(&n) == CUDA_SUCCESS && n >= 1);
    CHECK(cuCtxCreate_v2(&c, 0, 0) == CUDA_SUCCESS);
    CHECK(cuMemAlloc_v2(&p, 64 << 20) == CUDA_SUCCESS);
    CHECK(cuMemGetInfo_v2(&f, &t) == CUDA_SUCCESS);
    CHECK(nvmlInit_v2() == NVML_SUCCESS);
    CHECK(nvmlDeviceGetCount_v2(&nn) == NVML_SUCCESS && nn == (unsigned)n);
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &h) == NVML_SUCCESS);
    CHECK(nvmlDeviceGetMemoryInfo(h, &m) == NVML_SUCCESS);
    CHECK(m.total == t && m.free == f && m.used == (96ULL << 20));
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(h, &cnt, procs) ==
          NVML_SUCCESS);
    CHECK(cnt == 1 && procs[0].pid == (unsigned)getpid() &&
          procs[0].usedGpuMemory == (96ULL << 20));
    CHECK(cuMemFree_v2(p) == CUDA_SUCCESS);
    CHECK(cuCtxDestroy_v2(c) == CUDA_SUCCESS);
    CHECK(nvmlDeviceGetMemoryInfo(h, &m) == NVML_SUCCESS && m.used == 0);
    cnt = 0;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(h, &cnt, NULL) ==
          NVML_SUCCESS && cnt == 0);
    CHECK(nvmlShutdown() == NVML_SUCCESS);
    printf("OK\n");
    return 0;
}
