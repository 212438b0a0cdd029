/*
 * nvml_topo.c - where the GPUs sit: PCIe ancestry, NUMA node, NVLink and
 * peer-to-peer status, from the node's topology (GPUVISOR_SIM_TOPOLOGY;
 * state_topo.c).  Without a topology file every GPU is on NUMA node 0
 * behind a host bridge of its own and has no NVLink.
 *
 * The PCIe level of two GPUs is the nearest thing they share: the same
 * pcie_switch (SINGLE, `PIX`), the same pcie_upstream switch above two
 * switches (MULTIPLE, `PXB`), the same host_bridge (HOSTBRIDGE, `PHB`), the
 * same NUMA node (NODE), else SYSTEM (`SYS`).  As in NVML, the common
 * ancestor is the PCIe path only: NVLink is asked for separately.
 */
#include <stdio.h>
#include <string.h>

#include "sim.h"

#define SWITCHES 4                      /* NVSwitch chips link l goes to l % 4 */

static const sim_topo_gpu *topo(int gpu)
{
    return &sim_state()->topo[gpu];
}

static int level(int a, int b)
{
    if (a == b)
        return NVML_TOPOLOGY_INTERNAL;
    const sim_topo_gpu *x = topo(a), *y = topo(b);
    if (x->pcie_switch >= 0 && x->pcie_switch == y->pcie_switch)
        return NVML_TOPOLOGY_SINGLE;
    if (x->pcie_upstream >= 0 && x->pcie_upstream == y->pcie_upstream)
        return NVML_TOPOLOGY_MULTIPLE;
    if (x->host_bridge >= 0 && x->host_bridge == y->host_bridge)
        return NVML_TOPOLOGY_HOSTBRIDGE;
    if (x->numa == y->numa)
        return NVML_TOPOLOGY_NODE;
    return NVML_TOPOLOGY_SYSTEM;
}

/* NVLinks from a to b: direct ones, or through the NVSwitches */
static int links_between(int a, int b)
{
    if (a == b)
        return 0;
    const sim_topo_gpu *x = topo(a), *y = topo(b);
    int direct = 0, sw_a = 0, sw_b = 0;
    for (int l = 0; l < x->nlinks; l++) {
        direct += x->link_peer[l] == b;
        sw_a += x->link_peer[l] == SIM_LINK_SWITCH;
    }
    for (int l = 0; l < y->nlinks; l++)
        sw_b += y->link_peer[l] == SIM_LINK_SWITCH;
    return direct + (sw_a < sw_b ? sw_a : sw_b);
}

SIM_API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t d1, nvmlDevice_t d2,
                                                         nvmlGpuTopologyLevel_t *out)
{
    NVML_GPU_ENTRY("nvmlDeviceGetTopologyCommonAncestor", d1, a);
    int b = sim_nvml_node(d2);
    if (b < 0 || !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = (nvmlGpuTopologyLevel_t)level(a, b);
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetTopologyNearestGpus(nvmlDevice_t dev,
                                                      nvmlGpuTopologyLevel_t lvl,
                                                      unsigned int *count, nvmlDevice_t *arr)
{
    NVML_GPU_ENTRY("nvmlDeviceGetTopologyNearestGpus", dev, a);
    int l = (int)lvl;
    if (!count || l < NVML_TOPOLOGY_INTERNAL || l > NVML_TOPOLOGY_SYSTEM || l % 10)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* the other GPUs at that level or nearer */
    nvmlDevice_t found[SIM_MAX_DEV];
    unsigned n = 0;
    for (int b = 0; b < sim_ndev(); b++)
        if (b != a && level(a, b) <= l)
            found[n++] = sim_nvml_gpu_handle(b);
    if (*count == 0) {
        *count = n;
        return NVML_SUCCESS;
    }
    if (!arr)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (n > *count)
        n = *count;
    memcpy(arr, found, n * sizeof *arr);
    *count = n;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t dev, unsigned int *node)
{
    NVML_GPU_ENTRY("nvmlDeviceGetNumaNodeId", dev, a);
    return sim_nvml_put_uint(node, (unsigned)topo(a)->numa);
}

/* the link of dev: NVML_SUCCESS with *peer, or why not (out: the
 * caller's out pointer, which a link query must have) */
static nvmlReturn_t link_of(int gpu, unsigned int link, const void *out, int *peer)
{
    const sim_topo_gpu *t = topo(gpu);
    if (t->nlinks == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= (unsigned)t->nlinks || !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *peer = t->link_peer[link];
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t dev, unsigned int link,
                                              nvmlEnableState_t *active)
{
    NVML_GPU_ENTRY("nvmlDeviceGetNvLinkState", dev, a);
    int peer;
    NVML_TRY(link_of(a, link, active, &peer));
    *active = peer == SIM_LINK_NONE ? NVML_FEATURE_DISABLED : NVML_FEATURE_ENABLED;
    return NVML_SUCCESS;
}

static void switch_pci(unsigned sw, nvmlPciInfo_t *p)
{
    memset(p, 0, sizeof *p);
    unsigned bus = 0xc0u + sw;
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "0000:%02X:00.0", bus);
    snprintf(p->busId, sizeof p->busId, "00000000:%02X:00.0", bus);
    p->bus = bus;
    p->pciDeviceId = 0x22a310de;        /* an NVSwitch */
}

SIM_API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t dev, unsigned int link,
                                                         nvmlPciInfo_t *pci)
{
    NVML_GPU_ENTRY("nvmlDeviceGetNvLinkRemotePciInfo_v2", dev, a);
    int peer;
    NVML_TRY(link_of(a, link, pci, &peer));
    if (peer == SIM_LINK_NONE)
        return NVML_ERROR_NOT_SUPPORTED;      /* nothing at the other end */
    if (peer == SIM_LINK_SWITCH)
        switch_pci(link % SWITCHES, pci);
    else
        sim_nvml_pci_info(peer, pci);
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t dev, unsigned int link,
                                                      nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(dev, link, pci);
}

SIM_API nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t dev, unsigned int link,
                                                         nvmlIntNvLinkDeviceType_t *type)
{
    NVML_GPU_ENTRY("nvmlDeviceGetNvLinkRemoteDeviceType", dev, a);
    int peer;
    NVML_TRY(link_of(a, link, type, &peer));
    *type = peer == SIM_LINK_SWITCH ? NVML_NVLINK_DEVICE_TYPE_SWITCH
          : peer == SIM_LINK_NONE ? NVML_NVLINK_DEVICE_TYPE_UNKNOWN
                                  : NVML_NVLINK_DEVICE_TYPE_GPU;
    return NVML_SUCCESS;
}

/* P2P: over NVLink when the two are linked; reads, writes and the PCIe
 * path need a path that does not cross sockets (SYS: the chipset does not
 * support it), atomics need NVLink. */
SIM_API nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t d1, nvmlDevice_t d2,
                                            nvmlGpuP2PCapsIndex_t idx, nvmlGpuP2PStatus_t *st)
{
    NVML_GPU_ENTRY("nvmlDeviceGetP2PStatus", d1, a);
    int b = sim_nvml_node(d2);
    if (b < 0 || !st || (int)idx < 0 || (int)idx >= NVML_P2P_CAPS_INDEX_UNKNOWN)
        return NVML_ERROR_INVALID_ARGUMENT;
    int nv = links_between(a, b) > 0, pcie = level(a, b) < NVML_TOPOLOGY_SYSTEM;
    switch ((int)idx) {
    case NVML_P2P_CAPS_INDEX_NVLINK:
        *st = nv ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
        break;
    case NVML_P2P_CAPS_INDEX_ATOMICS:
        *st = nv || a == b ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
        break;
    case NVML_P2P_CAPS_INDEX_PCI:
        *st = pcie ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED;
        break;
    default:                            /* read, write */
        *st = nv || pcie ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}
