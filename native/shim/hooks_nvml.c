/*
 * hooks_nvml.c - NVML's memory queries show the container's quota.
 *
 * An NVML handle is matched to the container's device by UUID (NVML
 * indices differ from CUDA ordinals, and CUDA_VISIBLE_DEVICES may hide or
 * reorder devices).  Devices the container does not see, and devices
 * without a quota, keep the driver's figures.
 */
#include <string.h>

#include "hooks.h"
#include "limits.h"
#include "log.h"
#include "oversub.h"

typedef nvmlReturn_t (*mem_fn)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*mem_v2_fn)(nvmlDevice_t, nvmlMemory_v2_t *);
typedef nvmlReturn_t (*uuid_fn)(nvmlDevice_t, char *, unsigned int);

/* Outside enforce mode: pass the query through, or fail closed. */
#define ENFORCING_OR_PASS(passcall)                                         \
    do {                                                                    \
        int m_ = gv_mode();                                                 \
        if (m_ != GV_MODE_ENFORCE)                                          \
            return m_ == GV_MODE_PASSTHROUGH ? (passcall) : GV_FAIL_NVML;   \
    } while (0)

/* Region entry for an NVML device, registering it if the container sees
 * it but no CUDA process has used it yet.  -1: not ours. */
static int entry_for(nvmlDevice_t dev, uint64_t physical_total)
{
    char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    unsigned char uuid[16];
    if (GV_REAL(nvmlDeviceGetUUID, uuid_fn)(dev, text, sizeof text) != NVML_SUCCESS ||
        gv_uuid_parse(text, uuid) != 0)
        return -1;
    gv_region *r = gv_core_region();
    int e = region_device_find(r, uuid);
    /* An entry this process has taken the limit of (below) once. */
    static _Atomic uint32_t taken;
    if (e >= 0 && (atomic_load_explicit(&taken, memory_order_relaxed) >> e & 1))
        return e;
    int ordinal = gv_ordinal_of_uuid(uuid);
    if (ordinal < 0)
        return e >= 0 ? e : -1;
    uint64_t limit;
    char err[512];
    if (limits_memory_for_ordinal(ordinal, physical_total, &limit, err, sizeof err) != 0) {
        gv_log(GV_LOG_ERROR, "%s; NVML memory queries fail with NVML_ERROR_NO_PERMISSION", err);
        gv_core_fail();
        return -2;
    }
    if (e < 0)
        e = region_device_lookup(r, uuid, physical_total, limit);
    if (e < 0)
        return -2;
    /* An entry left by an earlier run gets this environment's limit, or
     * is refused while processes of another limit live. */
    if (gv_device_take_limit(e, ordinal, text, limit) != 0) {
        gv_core_fail();
        return -2;
    }
    atomic_fetch_or(&taken, 1u << e);
    return e;
}

/* Apply the quota to total/free/used, and when it does, zero *reserved
 * (_v2's; NULL for the unversioned struct): the quota view has no driver
 * reserve (also at 100 %).  Returns an NVML status. */
static nvmlReturn_t quota_view(nvmlDevice_t dev, unsigned long long *total,
                               unsigned long long *free_b, unsigned long long *used,
                               unsigned long long *reserved)
{
    int e = entry_for(dev, *total);
    if (e == -2)
        return GV_FAIL_NVML;
    if (e < 0)
        return NVML_SUCCESS;
    gv_region *r = gv_core_region();
    uint64_t limit = region_limit(r, e);
    if (limit == GV_UNLIMITED)
        return NVML_SUCCESS;
    /* As cuMemGetInfo: the stream-ordered frees the streams have reached
     * are not the quota's any more (one atomic load with none pending). */
    gv_pending_frees_reap();
    gv_core_tidy();
    uint64_t u = region_used(r, e);
    int over = gv_oversub_on();           /* the quota is the device's size */
    uint64_t t = limit < *total || over ? limit : *total;
    uint64_t avail = u < t ? t - u : 0;
    *total = t;
    *used = u < t ? u : t;
    *free_b = avail < *free_b || over ? avail : *free_b;
    if (reserved)
        *reserved = 0;
    return NVML_SUCCESS;
}

/* The two memory-info hooks: the driver's answer, seen through the quota
 * (_v2 also says what is reserved: nothing, under a quota). */
#define MEMORY_INFO_HOOK(name, mem_t, fn_t, reserved)                           \
    GV_EXPORT nvmlReturn_t name(nvmlDevice_t dev, mem_t *mem)                   \
    {                                                                           \
        fn_t real = GV_REAL(name, fn_t);                                        \
        ENFORCING_OR_PASS(real(dev, mem));                                      \
        nvmlReturn_t rc = real(dev, mem);                                       \
        if (rc != NVML_SUCCESS || !mem)                                         \
            return rc;                                                          \
        return quota_view(dev, &mem->total, &mem->free, &mem->used, reserved);  \
    }

MEMORY_INFO_HOOK(nvmlDeviceGetMemoryInfo, nvmlMemory_t, mem_fn, NULL)
MEMORY_INFO_HOOK(nvmlDeviceGetMemoryInfo_v2, nvmlMemory_v2_t, mem_v2_fn, &mem->reserved)

const gv_hook gv_hooks_nvml[] = {
    { "nvmlDeviceGetMemoryInfo", (void *)nvmlDeviceGetMemoryInfo },
    { "nvmlDeviceGetMemoryInfo_v2", (void *)nvmlDeviceGetMemoryInfo_v2 },
    { NULL, NULL }
};
