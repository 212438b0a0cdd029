/*
 * cuda_device.c - device queries.  A CUdevice is a CUDA ordinal (index
 * into the CUDA_VISIBLE_DEVICES list); sim_ord_node() maps it to the node
 * device in the state file.
 */
#include <stdio.h>
#include <string.h>

#include "sim.h"

#define DEV_PROLOGUE(dev, node)                  \
    CUresult rc_ = sim_check_init();             \
    if (rc_)                                     \
        return rc_;                              \
    int node = sim_ord_node(dev);                \
    if (node < 0)                                \
        return CUDA_ERROR_INVALID_DEVICE

SIM_API CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    SIM_TRY(sim_check_args(!dev));
    if (sim_ord_node(ordinal) < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetCount(int *count)
{
    SIM_TRY(sim_check_args(!count));
    *count = sim_nvisible();
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    DEV_PROLOGUE(dev, node);
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", sim_dev(node)->name);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    DEV_PROLOGUE(dev, node);
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned char b[16];
    (void)node;
    if (sim_uuid_bytes(sim_ord_uuid(dev), b) < 0)
        return CUDA_ERROR_UNKNOWN;
    memcpy(uuid->bytes, b, 16);
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuDeviceGetUuid_v2, cuDeviceGetUuid);

SIM_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    DEV_PROLOGUE(dev, node);
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = sim_dev(node)->total;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    size_t t;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuDeviceTotalMem_v2(&t, dev);
    if (rc == CUDA_SUCCESS)
        *bytes = t > 0xffffffffULL ? 0xffffffffU : (unsigned int)t;
    return rc;
}

SIM_API CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute attr,
                                      CUdevice dev)
{
    DEV_PROLOGUE(dev, node);
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    switch ((int)attr) {
    /* compute capability 9.0 launch limits, the ones cuda_launch.c enforces */
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = SIM_MAX_BLOCK_THREADS; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: *v = SIM_MAX_BLOCK_X; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *v = SIM_MAX_BLOCK_Y; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *v = SIM_MAX_BLOCK_Z; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *v = SIM_MAX_GRID_X; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: *v = SIM_MAX_GRID_YZ; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *v = SIM_MAX_GRID_YZ; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *v = 48 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = SIM_MAX_SHMEM; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *v = SIM_SM_THREADS; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: *v = SIM_SM_BLOCKS; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: *v = 64 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *v = 64 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *v = 32; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = sim_dev(node)->sms; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *v = sim_node_gpu(node); break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: *v = 1; break;
    /* Only the time-slicing mode preempts a running kernel for another
     * context's slice; the launch-order timeline runs each to its end. */
    case CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED: *v = sim_ts_us() ? 1 : 0; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *v = 1; break;
    default:
        if ((int)attr <= 0 || (int)attr > 200)
            return CUDA_ERROR_INVALID_VALUE;
        *v = 0;                         /* not modelled */
    }
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetPCIBusId(char *buf, int len, CUdevice dev)
{
    DEV_PROLOGUE(dev, node);
    if (!buf || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(buf, (size_t)len, "0000:%02x:00.0", (unsigned)sim_node_gpu(node));
    return CUDA_SUCCESS;
}
