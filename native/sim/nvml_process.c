/*
 * nvml_process.c - running-process lists.  Compute processes are the live
 * processes with physical usage on the device (dead ones are reaped
 * first); usedGpuMemory is that usage.  Graphics lists are always empty.
 * INSUFFICIENT_SIZE semantics as in NVML: *count = needed.
 */
#include <string.h>

#include "sim.h"

#define NA_ID 0xffffffffu

/* fills up to *count entries via put(); returns NVML code */
static nvmlReturn_t list(nvmlDevice_t dev, unsigned int *count, void *out,
                         int v1)
{
    int node = sim_nvml_node(dev);
    if (node < 0 || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    sim_proc procs[SIM_MAX_ROWS];
    int n = sim_procs(node, procs, SIM_MAX_ROWS);
    if (n > SIM_MAX_ROWS)
        n = SIM_MAX_ROWS;
    if ((unsigned)n > *count) {
        *count = (unsigned)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n && !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < n; i++) {
        if (v1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)out + i;
            p->pid = sim_nvml_pid(procs[i].pid);
            p->usedGpuMemory = procs[i].used;
        } else {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)out + i;
            p->pid = sim_nvml_pid(procs[i].pid);
            p->usedGpuMemory = procs[i].used;
            p->gpuInstanceId = NA_ID;
            p->computeInstanceId = NA_ID;
        }
    }
    *count = (unsigned)n;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(
    nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_v1_t *infos)
{
    NVML_ENTRY("nvmlDeviceGetComputeRunningProcesses");
    return list(dev, count, infos, 1);
}

SIM_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(
    nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_t *infos)
{
    NVML_ENTRY("nvmlDeviceGetComputeRunningProcesses_v2");
    return list(dev, count, infos, 0);
}

SIM_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(
    nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_t *infos)
{
    NVML_ENTRY("nvmlDeviceGetComputeRunningProcesses_v3");
    return list(dev, count, infos, 0);
}

static nvmlReturn_t empty(nvmlDevice_t dev, unsigned int *count)
{
    if (sim_nvml_node(dev) < 0 || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(
    nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_v1_t *infos)
{
    (void)infos;
    NVML_ENTRY("nvmlDeviceGetGraphicsRunningProcesses");
    return empty(dev, count);
}

SIM_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(
    nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_t *infos)
{
    (void)infos;
    NVML_ENTRY("nvmlDeviceGetGraphicsRunningProcesses_v2");
    return empty(dev, count);
}

SIM_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(
    nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_t *infos)
{
    (void)infos;
    NVML_ENTRY("nvmlDeviceGetGraphicsRunningProcesses_v3");
    return empty(dev, count);
}
