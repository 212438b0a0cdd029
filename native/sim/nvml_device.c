/*
 * nvml_device.c - NVML device handles and queries.  NVML ignores
 * CUDA_VISIBLE_DEVICES: it lists every node device in node order, and a
 * handle is simply a pointer into a per-node table.  A MIG device handle
 * points into a table by GPU, GPU-instance slot and compute-instance slot;
 * it names whatever instance is in that slot, and fails once there is
 * none.
 */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "sim.h"

#define G(i) {i, -1, -1}
static struct nvmlDevice_st g_dev[SIM_MAX_DEV] = {
    G(0), G(1), G(2), G(3), G(4), G(5), G(6), G(7),
    G(8), G(9), G(10), G(11), G(12), G(13), G(14), G(15),
};
#undef G
static struct nvmlDevice_st g_mig[SIM_MAX_DEV][SIM_MIG_SLOTS][SIM_MIG_SLOTS];
static pthread_once_t g_mig_once = PTHREAD_ONCE_INIT;

static void mig_init(void)
{
    for (int g = 0; g < SIM_MAX_DEV; g++)
        for (int s = 0; s < SIM_MIG_SLOTS; s++)
            for (int c = 0; c < SIM_MIG_SLOTS; c++)
                g_mig[g][s][c] = (struct nvmlDevice_st){g, s, c};
}

int sim_nvml_node(nvmlDevice_t d)
{
    if (!d || d < &g_dev[0] || d >= &g_dev[sim_ndev()])
        return -1;
    return d->node;
}

nvmlDevice_t sim_nvml_gpu_handle(int gpu)
{
    return &g_dev[gpu];
}

nvmlDevice_t sim_nvml_mig_handle(int gpu, int slot, int ci)
{
    pthread_once(&g_mig_once, mig_init);
    return &g_mig[gpu][slot][ci];
}

int sim_nvml_mig(nvmlDevice_t d, sim_migdev *out)
{
    const struct nvmlDevice_st *lo = &g_mig[0][0][0];
    const struct nvmlDevice_st *hi = lo + SIM_MAX_DEV * SIM_MIG_SLOTS * SIM_MIG_SLOTS;
    if (!d || d < lo || d >= hi)
        return -1;
    pthread_once(&g_mig_once, mig_init);
    sim_shared *S = sim_state();
    if (!S || d->node >= (int)S->ndev || !sim_mig_mode(d->node))
        return -1;
    const sim_gi *gi = &S->gi[d->node][d->gi];
    if (!gi->active || !gi->ci[d->ci].active)
        return -1;
    out->gpu = d->node;
    out->slot = d->gi;
    out->ci = d->ci;
    out->node = sim_gi_node(d->node, d->gi);
    snprintf(out->uuid, sizeof out->uuid, "%s", gi->ci[d->ci].uuid);
    return 0;
}

SIM_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n)
{
    NVML_ENTRY("nvmlDeviceGetCount_v2");
    return sim_nvml_put_uint(n, (unsigned)sim_ndev());
}

SIM_API nvmlReturn_t nvmlDeviceGetCount(unsigned int *n)
{
    return nvmlDeviceGetCount_v2(n);
}

SIM_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i,
                                                   nvmlDevice_t *d)
{
    NVML_ENTRY("nvmlDeviceGetHandleByIndex_v2");
    if (!d || i >= (unsigned)sim_ndev())
        return NVML_ERROR_INVALID_ARGUMENT;
    *d = &g_dev[i];
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d)
{
    return nvmlDeviceGetHandleByIndex_v2(i, d);
}

SIM_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid,
                                               nvmlDevice_t *d)
{
    NVML_ENTRY("nvmlDeviceGetHandleByUUID");
    if (!uuid || !d)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < sim_ndev(); i++)
        if (!strcasecmp(sim_dev(i)->uuid, uuid)) {
            *d = &g_dev[i];
            return NVML_SUCCESS;
        }
    sim_migdev m[SIM_MAX_DEV * SIM_MIG_SLOTS];
    int n = sim_mig_devices(-1, m, SIM_MAX_DEV * SIM_MIG_SLOTS);
    for (int i = 0; i < n; i++)
        if (!strcasecmp(m[i].uuid, uuid)) {
            *d = sim_nvml_mig_handle(m[i].gpu, m[i].slot, m[i].ci);
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

SIM_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus,
                                                      nvmlDevice_t *d)
{
    NVML_ENTRY("nvmlDeviceGetHandleByPciBusId_v2");
    if (!bus || !d)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned dom = 0, b = 0, dv = 0, fn = 0;
    char extra;
    if (sscanf(bus, "%x:%x:%x.%x%c", &dom, &b, &dv, &fn, &extra) != 4) {
        dom = 0;
        if (sscanf(bus, "%x:%x.%x%c", &b, &dv, &fn, &extra) != 3)
            return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (dom != 0 || dv != 0 || fn != 0 || b >= (unsigned)sim_ndev())
        return NVML_ERROR_NOT_FOUND;
    *d = &g_dev[b];
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus,
                                                   nvmlDevice_t *d)
{
    return nvmlDeviceGetHandleByPciBusId_v2(bus, d);
}

SIM_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t dev, unsigned int *i)
{
    NVML_GPU_ENTRY("nvmlDeviceGetIndex", dev, node);
    return sim_nvml_put_uint(i, (unsigned)node);
}

SIM_API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t dev, unsigned int *m)
{
    NVML_GPU_ENTRY("nvmlDeviceGetMinorNumber", dev, node);
    return sim_nvml_put_uint(m, (unsigned)node);
}

SIM_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *buf,
                                       unsigned int len)
{
    NVML_ENTRY("nvmlDeviceGetUUID");
    sim_migdev m;
    if (sim_nvml_mig(dev, &m) == 0)
        return sim_nvml_put_str(buf, len, m.uuid);
    int node = sim_nvml_node(dev);
    if (node < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    return sim_nvml_put_str(buf, len, sim_dev(node)->uuid);
}

SIM_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *buf,
                                       unsigned int len)
{
    NVML_ENTRY("nvmlDeviceGetName");
    sim_migdev m;
    if (sim_nvml_mig(dev, &m) == 0)
        return sim_nvml_put_str(buf, len, sim_dev(m.node)->name);
    int node = sim_nvml_node(dev);
    if (node < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    return sim_nvml_put_str(buf, len, sim_dev(node)->name);
}

void sim_nvml_pci_info(int node, nvmlPciInfo_t *p)
{
    memset(p, 0, sizeof *p);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "0000:%02X:00.0",
             (unsigned)node & 0xffu);
    snprintf(p->busId, sizeof p->busId, "00000000:%02X:00.0", (unsigned)node & 0xffu);
    p->domain = 0;
    p->bus = (unsigned)node;
    p->device = 0;
    p->pciDeviceId = 0x233010de;
    p->pciSubSystemId = 0x16c110de;
}

SIM_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *p)
{
    NVML_GPU_ENTRY("nvmlDeviceGetPciInfo_v3", dev, node);
    if (!p)
        return NVML_ERROR_INVALID_ARGUMENT;
    sim_nvml_pci_info(node, p);
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t dev, nvmlPciInfo_t *p)
{
    return nvmlDeviceGetPciInfo_v3(dev, p);
}

/* the original entry point fills the original, 52-byte struct */
SIM_API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t dev, nvmlPciInfo_v1_t *p)
{
    NVML_GPU_ENTRY("nvmlDeviceGetPciInfo", dev, node);
    if (!p)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlPciInfo_t v;
    sim_nvml_pci_info(node, &v);
    memset(p, 0, sizeof *p);
    memcpy(p->busId, v.busIdLegacy, sizeof p->busId);
    p->domain = v.domain;
    p->bus = v.bus;
    p->device = v.device;
    p->pciDeviceId = v.pciDeviceId;
    p->pciSubSystemId = v.pciSubSystemId;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t dev,
                                                        int *major, int *minor)
{
    NVML_GPU_ENTRY("nvmlDeviceGetCudaComputeCapability", dev, node);
    (void)node;
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = 9;
    *minor = 0;
    return NVML_SUCCESS;
}

/* total and used memory of a GPU (its instances' included) or a MIG
 * device (its GPU instance's); -1 if dev is neither */
static int mem_of(nvmlDevice_t dev, uint64_t *total, uint64_t *used)
{
    sim_migdev mg;
    if (sim_nvml_mig(dev, &mg) == 0) {
        *total = sim_dev(mg.node)->total;
        *used = sim_used(mg.node);
        return 0;
    }
    int node = sim_nvml_node(dev);
    if (node < 0)
        return -1;
    *total = sim_dev(node)->total;
    *used = sim_state()->topology ? sim_used_gpu(node) : sim_used(node);
    return 0;
}

SIM_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m)
{
    NVML_ENTRY("nvmlDeviceGetMemoryInfo");
    uint64_t total, used;
    if (!m || mem_of(dev, &total, &used) < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (used > total)
        used = total;
    m->total = total;
    m->used = used;
    m->free = total - used;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev,
                                                nvmlMemory_v2_t *m)
{
    NVML_ENTRY("nvmlDeviceGetMemoryInfo_v2");
    uint64_t total, used;
    if (!m || mem_of(dev, &total, &used) < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (used > total)
        used = total;
    m->total = total;
    m->reserved = 0;
    m->used = used;
    m->free = total - used;
    return NVML_SUCCESS;
}

/* utilization: nvml_util.c */
