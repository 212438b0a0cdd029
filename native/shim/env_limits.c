/*
 * env_limits.c - gv_env_device_limits (gpuvisor.h): the limits a workload's
 * environment gives a device, for the supervisor, which puts them back
 * when an administrator clears theirs.  Apart from api.c because it needs
 * the UUID -> CUDA ordinal map of devices.c.  Also gv_env_sm_settings: the
 * SM policy and priority the environment gives, which the supervisor
 * reports, read by the same rules (limits.c) the devices are set up with.
 */
#include "gpuvisor.h"

#include "core.h"
#include "limits.h"
#include "region.h"

#define fail gv_api_fail

/* The memory and SM limits env gives ordinal (env already selected with
 * limits_use_env); GV_OK, or GV_EINVAL with the reason in t_err. */
static int ordinal_limits(int ordinal, uint64_t physical_total, uint64_t *mem, unsigned *sm)
{
    char err[512];
    if (limits_memory_for_ordinal(ordinal, physical_total, mem, err, sizeof err) != GV_OK ||
        limits_sm_for_ordinal(ordinal, sm, err, sizeof err) != GV_OK)
        return fail(GV_EINVAL, "%s", err);
    if (limits_sm_policy() < 0)
        *sm = 0;                        /* GPU_CORE_UTILIZATION_POLICY=disable */
    return GV_OK;
}

static int env_device_limits(const char *uuid, uint64_t physical_total, uint64_t *mem_bytes,
                             uint32_t *sm_pct)
{
    unsigned char u[16];
    char err[512];
    if (uuid == NULL || gv_uuid_parse(uuid, u) != 0) {
        char q[97];
        limits_quote(q, sizeof q, uuid ? uuid : "(null)", 96);
        return fail(GV_EINVAL, "gpuvisor: gv_env_device_limits: \"%s\" is not a GPU UUID", q);
    }
    if (limits_check_env(err, sizeof err) != GV_OK || limits_sm_check_env(err, sizeof err) != GV_OK)
        return fail(GV_EINVAL, "%s", err);
    const char *cvd = limits_getenv("CUDA_VISIBLE_DEVICES");
    int ordinal = gv_ordinal_of_uuid_nvml(u, cvd);
    uint64_t mem;
    unsigned sm;
    if (ordinal >= 0) {
        if (ordinal_limits(ordinal, physical_total, &mem, &sm) != GV_OK)
            return GV_EINVAL;
        *mem_bytes = mem;
        *sm_pct = sm;
        return ordinal;
    }
    /* Not known: the strictest any ordinal gets (one without a variable of
     * its own gets the plain one). */
    uint64_t mem_min = GV_UNLIMITED;
    unsigned sm_min = 0;
    for (int o = 0; o < GV_MAX_ORDINALS; o++) {
        if (ordinal_limits(o, physical_total, &mem, &sm) != GV_OK)
            return GV_EINVAL;
        if (mem < mem_min)
            mem_min = mem;
        if (sm != 0 && (sm_min == 0 || sm < sm_min))
            sm_min = sm;
    }
    *mem_bytes = mem_min;
    *sm_pct = sm_min;
    char q[161];
    limits_quote(q, sizeof q, cvd ? cvd : "(unset)", 160);
    return fail(GV_ENOENT, "gpuvisor: device %s: its CUDA ordinal is not known (not in NVML's list "
                "through CUDA_VISIBLE_DEVICES=%s, or NVML unavailable)", uuid, q);
}

GV_EXPORT int gv_env_device_limits(const char *const *env, const char *uuid, uint64_t physical_total,
                                   uint64_t *mem_bytes, uint32_t *sm_pct)
{
    if (mem_bytes == NULL || sm_pct == NULL)
        return fail(GV_EINVAL, "gpuvisor: gv_env_device_limits: an output is NULL");
    limits_use_env(env);
    int rc = env_device_limits(uuid, physical_total, mem_bytes, sm_pct);
    limits_use_env(NULL);
    return rc;
}

GV_EXPORT int gv_env_sm_settings(const char *const *env, uint32_t *policy, uint32_t *priority)
{
    if (policy == NULL || priority == NULL)
        return fail(GV_EINVAL, "gpuvisor: gv_env_sm_settings: an output is NULL");
    char err[512];
    limits_use_env(env);
    int rc = limits_sm_check_env(err, sizeof err);
    int p = limits_sm_policy();
    unsigned prio = limits_task_priority();
    limits_use_env(NULL);
    if (rc != GV_OK)
        return fail(GV_EINVAL, "%s", err);
    *policy = p < 0 ? 0u : (uint32_t)p;   /* disable: no limit, fixed-share */
    *priority = prio;
    return GV_OK;
}
