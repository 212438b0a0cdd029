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
/* the GPU-instance and compute-instance ids of usage on node (NA_ID for a
 * whole GPU); usage is per GPU instance, so the compute instance given is
 * its first one */
static void mig_ids(int node, unsigned *gi, unsigned *ci)
{
    *gi = *ci = NA_ID;
    if (node < SIM_MAX_DEV)
        return;
    const sim_gi *g = &sim_state()->gi[sim_node_gpu(node)][(node - SIM_MAX_DEV) % SIM_MIG_SLOTS];
    *gi = g->id;
    for (int c = 0; c < SIM_MIG_SLOTS; c++)
        if (g->ci[c].active && (*ci == NA_ID || g->ci[c].id < *ci))
            *ci = g->ci[c].id;
}

static nvmlReturn_t list(nvmlDevice_t dev, unsigned int *count, void *out,
                         int v1)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    sim_proc procs[SIM_MAX_ROWS];
    int n;
    sim_migdev m;
    int node = sim_nvml_node(dev);
    if (sim_nvml_mig(dev, &m) == 0) {
        n = sim_procs(m.node, procs, SIM_MAX_ROWS);
    } else if (node >= 0) {
        n = sim_state()->topology ? sim_procs_gpu(node, procs, SIM_MAX_ROWS)
                                  : sim_procs(node, procs, SIM_MAX_ROWS);
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    nvmlReturn_t rc = NVML_SUCCESS;
    if (n > SIM_MAX_ROWS)
        n = SIM_MAX_ROWS;
    if ((unsigned)n > *count) {
        *count = (unsigned)n;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
        goto done;
    }
    if (n && !out) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
        goto done;
    }
    for (int i = 0; i < n; i++) {
        if (v1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)out + i;
            p->pid = sim_nvml_pid(procs[i].pid);
            p->usedGpuMemory = procs[i].used;
        } else {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)out + i;
            p->pid = sim_nvml_pid(procs[i].pid);
            p->usedGpuMemory = procs[i].used;
            mig_ids(procs[i].node, &p->gpuInstanceId, &p->computeInstanceId);
        }
    }
    *count = (unsigned)n;
done:
    return rc;
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
    sim_migdev m;
    if ((sim_nvml_node(dev) < 0 && sim_nvml_mig(dev, &m) < 0) || !count)
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
