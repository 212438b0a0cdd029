/*
 * nvml_mig.c - the MIG part of NVML: mode, GPU-instance and
 * compute-instance profiles, placements, capacity, create / list /
 * destroy, and the MIG device handles (state_mig.c keeps the state).
 *
 * Handles are pointers into per-process tables by GPU, GI slot and CI
 * slot; a handle names whatever instance is in its slot and fails with
 * NVML_ERROR_INVALID_ARGUMENT once there is none.  Profile ids are the
 * ones the profile info gives (nvidia-smi's), as in NVML.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "sim.h"

static struct nvmlGpuInstance_st g_gi[SIM_MAX_DEV][SIM_MIG_SLOTS];
static struct nvmlComputeInstance_st g_ci[SIM_MAX_DEV][SIM_MIG_SLOTS][SIM_MIG_SLOTS];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void tables_init(void)
{
    for (int g = 0; g < SIM_MAX_DEV; g++)
        for (int s = 0; s < SIM_MIG_SLOTS; s++) {
            g_gi[g][s] = (struct nvmlGpuInstance_st){g, s};
            for (int c = 0; c < SIM_MIG_SLOTS; c++)
                g_ci[g][s][c] = (struct nvmlComputeInstance_st){g, s, c};
        }
}

static nvmlGpuInstance_t gi_handle(int gpu, int slot)
{
    pthread_once(&g_once, tables_init);
    return &g_gi[gpu][slot];
}

static nvmlComputeInstance_t ci_handle(int gpu, int slot, int ci)
{
    pthread_once(&g_once, tables_init);
    return &g_ci[gpu][slot][ci];
}

/* the GI a handle names now, or NULL */
static const sim_gi *gi_of(nvmlGpuInstance_t h)
{
    const struct nvmlGpuInstance_st *lo = &g_gi[0][0];
    if (!h || h < lo || h >= lo + SIM_MAX_DEV * SIM_MIG_SLOTS || h->gpu >= sim_ndev())
        return NULL;
    const sim_gi *g = &sim_state()->gi[h->gpu][h->slot];
    return g->active && sim_mig_mode(h->gpu) ? g : NULL;
}

static const sim_ci *ci_of(nvmlComputeInstance_t h)
{
    const struct nvmlComputeInstance_st *lo = &g_ci[0][0][0];
    if (!h || h < lo || h >= lo + SIM_MAX_DEV * SIM_MIG_SLOTS * SIM_MIG_SLOTS)
        return NULL;
    const sim_gi *g = gi_of(gi_handle(h->gpu, h->slot));
    return g && g->ci[h->ci].active ? &g->ci[h->ci] : NULL;
}

/* A query of a MIG-capable GPU, out where its answer goes:
 * NVML_ERROR_INVALID_ARGUMENT without out, NVML_ERROR_NOT_SUPPORTED on a
 * GPU without MIG. */
static nvmlReturn_t mig_query(int gpu, const void *out)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    return sim_mig_capable(gpu) ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

/* ---- mode ------------------------------------------------------------ */

SIM_API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *current,
                                          unsigned int *pending)
{
    NVML_GPU_ENTRY("nvmlDeviceGetMigMode", dev, gpu);
    NVML_TRY(mig_query(gpu, current && pending ? current : NULL));
    *current = *pending = (unsigned)sim_mig_mode(gpu);
    return NVML_SUCCESS;
}

/* The change applies at once when no process uses the GPU (and, to
 * disable, no GPU instance is left); otherwise NVML_ERROR_IN_USE and the
 * mode stays. */
SIM_API nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t dev, unsigned int mode,
                                          nvmlReturn_t *activation)
{
    NVML_GPU_ENTRY("nvmlDeviceSetMigMode", dev, gpu);
    if (!activation || mode > NVML_DEVICE_MIG_ENABLE)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = sim_mig_set_mode(gpu, (int)mode);
    *activation = rc;
    return rc;
}

/* ---- GPU-instance profiles ------------------------------------------- */

static nvmlReturn_t profile_by_index(int gpu, unsigned idx, const sim_gi_profile **out)
{
    if (!sim_mig_capable(gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    if (idx >= NVML_GPU_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = sim_gi_profile_by_index(gpu, (int)idx);
    return *out ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

static nvmlReturn_t profile_by_id(int gpu, unsigned id, const sim_gi_profile **out)
{
    if (!sim_mig_capable(gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    *out = sim_gi_profile_by_id(gpu, id);
    return *out ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

static void fill_v2(const sim_gi_profile *p, nvmlGpuInstanceProfileInfo_v2_t *i)
{
    unsigned version = i->version;
    memset(i, 0, sizeof *i);
    i->version = version;
    i->id = p->id;
    i->isP2pSupported = 0;
    i->sliceCount = p->compute_slices;
    i->instanceCount = p->max_count;
    i->multiprocessorCount = p->sms;
    i->copyEngineCount = p->ce;
    i->decoderCount = p->dec;
    i->encoderCount = p->enc;
    i->jpegCount = p->jpeg;
    i->ofaCount = p->ofa;
    i->memorySizeMB = p->mem_mib;
    snprintf(i->name, sizeof i->name, "MIG %s", p->name);
}

/* A GPU-instance profile's _v2 info, the profile named by its index or
 * (by_id) by its id. */
static nvmlReturn_t profile_info_v2(int gpu, unsigned key, int by_id,
                                    nvmlGpuInstanceProfileInfo_v2_t *info)
{
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlGpuInstanceProfileInfo_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    const sim_gi_profile *p;
    NVML_TRY(by_id ? profile_by_id(gpu, key, &p) : profile_by_index(gpu, key, &p));
    fill_v2(p, info);
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t dev, unsigned int profile,
                                                         nvmlGpuInstanceProfileInfo_t *info)
{
    NVML_GPU_ENTRY("nvmlDeviceGetGpuInstanceProfileInfo", dev, gpu);
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlGpuInstanceProfileInfo_v2_t v;
    v.version = nvmlGpuInstanceProfileInfo_v2;
    NVML_TRY(profile_info_v2(gpu, profile, 0, &v));
    /* v1 is v2's GV_NVML_GI_PROFILE_FIELDS: its unsigned ints lie alike,
     * memorySizeMB sits at another offset (alignment) */
    memcpy(info, &v.id, offsetof(nvmlGpuInstanceProfileInfo_t, memorySizeMB));
    info->memorySizeMB = v.memorySizeMB;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t dev, unsigned int profile,
                                                          nvmlGpuInstanceProfileInfo_v2_t *info)
{
    NVML_GPU_ENTRY("nvmlDeviceGetGpuInstanceProfileInfoV", dev, gpu);
    return profile_info_v2(gpu, profile, 0, info);
}

SIM_API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    nvmlDevice_t dev, unsigned int id, nvmlGpuInstanceProfileInfo_v2_t *info)
{
    NVML_GPU_ENTRY("nvmlDeviceGetGpuInstanceProfileInfoByIdV", dev, gpu);
    return profile_info_v2(gpu, id, 1, info);
}

/* Every legal placement of the profile, whatever exists and whatever the
 * mode (as NVML's _v2 says). */
SIM_API nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    nvmlDevice_t dev, unsigned int id, nvmlGpuInstancePlacement_t *pl, unsigned int *count)
{
    NVML_GPU_ENTRY("nvmlDeviceGetGpuInstancePossiblePlacements_v2", dev, gpu);
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    const sim_gi_profile *p;
    NVML_TRY(profile_by_id(gpu, id, &p));
    unsigned n = 0;
    for (unsigned s = 0; s < 32; s++)
        n += p->starts >> s & 1;
    if (!pl) {
        *count = n;
        return NVML_SUCCESS;
    }
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    n = 0;
    for (unsigned s = 0; s < 32; s++)
        if (p->starts >> s & 1) {
            pl[n].start = s;
            pl[n++].size = p->mem_slices;
        }
    *count = n;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t dev, unsigned int id,
                                                               unsigned int *count)
{
    NVML_GPU_ENTRY("nvmlDeviceGetGpuInstanceRemainingCapacity", dev, gpu);
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    const sim_gi_profile *p;
    NVML_TRY(profile_by_id(gpu, id, &p));
    return sim_gi_remaining(gpu, p, count);
}

/* ---- GPU instances --------------------------------------------------- */

static nvmlReturn_t create_gi(nvmlDevice_t dev, unsigned id, const nvmlGpuInstancePlacement_t *pl,
                              nvmlGpuInstance_t *out)
{
    int gpu = sim_nvml_node(dev);
    if (gpu < 0 || !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    const sim_gi_profile *p;
    nvmlReturn_t rc = profile_by_id(gpu, id, &p);
    if (rc)
        return rc;
    if (pl && (pl->size != p->mem_slices || pl->start >= 32))
        return NVML_ERROR_INVALID_ARGUMENT;
    int slot;
    rc = sim_gi_create(gpu, p, pl ? (int)pl->start : -1, &slot);
    if (rc == NVML_SUCCESS)
        *out = gi_handle(gpu, slot);
    return rc;
}

SIM_API nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t dev, unsigned int id,
                                                 nvmlGpuInstance_t *out)
{
    NVML_ENTRY("nvmlDeviceCreateGpuInstance");
    return create_gi(dev, id, NULL, out);
}

SIM_API nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(
    nvmlDevice_t dev, unsigned int id, const nvmlGpuInstancePlacement_t *pl,
    nvmlGpuInstance_t *out)
{
    NVML_ENTRY("nvmlDeviceCreateGpuInstanceWithPlacement");
    if (!pl)
        return NVML_ERROR_INVALID_ARGUMENT;
    return create_gi(dev, id, pl, out);
}

SIM_API nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t h)
{
    NVML_ENTRY("nvmlGpuInstanceDestroy");
    if (!gi_of(h))
        return NVML_ERROR_INVALID_ARGUMENT;
    return sim_gi_destroy(h->gpu, h->slot);
}

SIM_API nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t dev, unsigned int id,
                                               nvmlGpuInstance_t *out, unsigned int *count)
{
    NVML_GPU_ENTRY("nvmlDeviceGetGpuInstances", dev, gpu);
    if (!out || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    const sim_gi_profile *p;
    NVML_TRY(profile_by_id(gpu, id, &p));
    if (!sim_mig_mode(gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    const sim_model *m = sim_gpu_model(gpu);
    const sim_shared *S = sim_state();
    unsigned n = 0;
    for (unsigned gid = 0; gid < 16; gid++)
        for (int s = 0; s < SIM_MIG_SLOTS; s++) {
            const sim_gi *g = &S->gi[gpu][s];
            if (g->active && g->id == gid && &m->prof[g->prof] == p && n < p->max_count)
                out[n++] = gi_handle(gpu, s);
        }
    *count = n;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t dev, unsigned int id,
                                                  nvmlGpuInstance_t *out)
{
    NVML_GPU_ENTRY("nvmlDeviceGetGpuInstanceById", dev, gpu);
    NVML_TRY(mig_query(gpu, out));
    if (!sim_mig_mode(gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    for (int s = 0; s < SIM_MIG_SLOTS; s++) {
        const sim_gi *g = &sim_state()->gi[gpu][s];
        if (g->active && g->id == id) {
            *out = gi_handle(gpu, s);
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

SIM_API nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t h, nvmlGpuInstanceInfo_t *info)
{
    NVML_ENTRY("nvmlGpuInstanceGetInfo");
    const sim_gi *g = gi_of(h);
    if (!g || !info)
        return NVML_ERROR_INVALID_ARGUMENT;
    info->device = sim_nvml_gpu_handle(h->gpu);
    info->id = g->id;
    info->profileId = sim_gpu_model(h->gpu)->prof[g->prof].id;
    info->placement.start = g->start;
    info->placement.size = g->size;
    return NVML_SUCCESS;
}

/* ---- compute-instance profiles and instances -------------------------- */

static void fill_ci_v2(nvmlGpuInstance_t h, int idx, nvmlComputeInstanceProfileInfo_v2_t *i)
{
    const sim_gi *g = gi_of(h);
    const sim_gi_profile *gp = &sim_gpu_model(h->gpu)->prof[g->prof];
    unsigned k = sim_ci_slices(idx), c = gp->compute_slices;
    unsigned version = i->version;
    memset(i, 0, sizeof *i);
    i->version = version;
    i->id = (unsigned)idx;
    i->sliceCount = k;
    i->instanceCount = sim_ci_max(h->gpu, h->slot, idx);
    i->multiprocessorCount = gp->sms * k / c;
    i->sharedCopyEngineCount = gp->ce;
    i->sharedDecoderCount = gp->dec;
    i->sharedEncoderCount = gp->enc;
    i->sharedJpegCount = gp->jpeg;
    i->sharedOfaCount = gp->ofa;
    if (k == c)
        snprintf(i->name, sizeof i->name, "MIG %s", gp->name);
    else
        snprintf(i->name, sizeof i->name, "MIG %uc.%s", k, gp->name);
}

static nvmlReturn_t ci_profile_ok(nvmlGpuInstance_t h, unsigned idx, unsigned eng)
{
    if (!gi_of(h) || eng != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED ||
        idx >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    return sim_ci_supported(h->gpu, h->slot, (int)idx) ? NVML_SUCCESS
                                                       : NVML_ERROR_NOT_SUPPORTED;
}

/* A compute-instance profile's _v2 info. */
static nvmlReturn_t ci_profile_info_v2(nvmlGpuInstance_t h, unsigned int profile,
                                       unsigned int eng, nvmlComputeInstanceProfileInfo_v2_t *info)
{
    NVML_TRY(ci_profile_ok(h, profile, eng));
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlComputeInstanceProfileInfo_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    fill_ci_v2(h, (int)profile, info);
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(
    nvmlGpuInstance_t h, unsigned int profile, unsigned int eng,
    nvmlComputeInstanceProfileInfo_t *info)
{
    NVML_ENTRY("nvmlGpuInstanceGetComputeInstanceProfileInfo");
    nvmlComputeInstanceProfileInfo_v2_t v;
    v.version = nvmlComputeInstanceProfileInfo_v2;
    NVML_TRY(ci_profile_info_v2(h, profile, eng, &v));
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    memcpy(info, &v.id, sizeof *info);  /* v2's GV_NVML_CI_PROFILE_FIELDS */
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    nvmlGpuInstance_t h, unsigned int profile, unsigned int eng,
    nvmlComputeInstanceProfileInfo_v2_t *info)
{
    NVML_ENTRY("nvmlGpuInstanceGetComputeInstanceProfileInfoV");
    return ci_profile_info_v2(h, profile, eng, info);
}

SIM_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    nvmlGpuInstance_t h, unsigned int profile, unsigned int *count)
{
    NVML_ENTRY("nvmlGpuInstanceGetComputeInstanceRemainingCapacity");
    NVML_TRY(ci_profile_ok(h, profile, 0));
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    return sim_ci_remaining(h->gpu, h->slot, (int)profile, count);
}

SIM_API nvmlReturn_t nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    nvmlGpuInstance_t h, unsigned int profile, nvmlComputeInstancePlacement_t *pl,
    unsigned int *count)
{
    NVML_ENTRY("nvmlGpuInstanceGetComputeInstancePossiblePlacements");
    NVML_TRY(ci_profile_ok(h, profile, 0));
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned st[8];
    unsigned n = (unsigned)sim_ci_starts(h->gpu, h->slot, (int)profile, st, 8);
    if (!pl) {
        *count = n;
        return NVML_SUCCESS;
    }
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++) {
        pl[i].start = st[i];
        pl[i].size = sim_ci_slices((int)profile);
    }
    *count = n;
    return NVML_SUCCESS;
}

static nvmlReturn_t create_ci(nvmlGpuInstance_t h, unsigned profile, int start,
                              nvmlComputeInstance_t *out)
{
    nvmlReturn_t rc = ci_profile_ok(h, profile, 0);
    if (rc)
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    int ci;
    rc = sim_ci_create(h->gpu, h->slot, (int)profile, start, &ci);
    if (rc == NVML_SUCCESS)
        *out = ci_handle(h->gpu, h->slot, ci);
    return rc;
}

SIM_API nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t h,
                                                          unsigned int profile,
                                                          nvmlComputeInstance_t *out)
{
    NVML_ENTRY("nvmlGpuInstanceCreateComputeInstance");
    return create_ci(h, profile, -1, out);
}

SIM_API nvmlReturn_t nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    nvmlGpuInstance_t h, unsigned int profile, const nvmlComputeInstancePlacement_t *pl,
    nvmlComputeInstance_t *out)
{
    NVML_ENTRY("nvmlGpuInstanceCreateComputeInstanceWithPlacement");
    NVML_TRY(ci_profile_ok(h, profile, 0));
    if (!pl || pl->size != sim_ci_slices((int)profile))
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned st[8];
    int n = sim_ci_starts(h->gpu, h->slot, (int)profile, st, 8), legal = 0;
    for (int i = 0; i < n; i++)
        legal |= st[i] == pl->start;
    if (!legal)
        return NVML_ERROR_INVALID_ARGUMENT;  /* not one of its placements */
    return create_ci(h, profile, (int)pl->start, out);
}

SIM_API nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t h)
{
    NVML_ENTRY("nvmlComputeInstanceDestroy");
    if (!ci_of(h))
        return NVML_ERROR_INVALID_ARGUMENT;
    return sim_ci_destroy(h->gpu, h->slot, h->ci);
}

SIM_API nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t h,
                                                        unsigned int profile,
                                                        nvmlComputeInstance_t *out,
                                                        unsigned int *count)
{
    NVML_ENTRY("nvmlGpuInstanceGetComputeInstances");
    NVML_TRY(ci_profile_ok(h, profile, 0));
    if (!out || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    const sim_gi *g = gi_of(h);
    unsigned n = 0, max = sim_ci_max(h->gpu, h->slot, (int)profile);
    for (unsigned cid = 0; cid < 8; cid++)
        for (int c = 0; c < SIM_MIG_SLOTS; c++)
            if (g->ci[c].active && g->ci[c].id == cid && g->ci[c].prof == (int)profile &&
                n < max)
                out[n++] = ci_handle(h->gpu, h->slot, c);
    *count = n;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t h, unsigned int id,
                                                           nvmlComputeInstance_t *out)
{
    NVML_ENTRY("nvmlGpuInstanceGetComputeInstanceById");
    const sim_gi *g = gi_of(h);
    if (!g || !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int c = 0; c < SIM_MIG_SLOTS; c++)
        if (g->ci[c].active && g->ci[c].id == id) {
            *out = ci_handle(h->gpu, h->slot, c);
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

SIM_API nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t h,
                                                   nvmlComputeInstanceInfo_t *info)
{
    NVML_ENTRY("nvmlComputeInstanceGetInfo_v2");
    const sim_ci *c = ci_of(h);
    if (!c || !info)
        return NVML_ERROR_INVALID_ARGUMENT;
    info->device = sim_nvml_gpu_handle(h->gpu);
    info->gpuInstance = gi_handle(h->gpu, h->slot);
    info->id = c->id;
    info->profileId = (unsigned)c->prof;
    info->placement.start = c->start;
    info->placement.size = c->size;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t h,
                                                nvmlComputeInstanceInfo_t *info)
{
    return nvmlComputeInstanceGetInfo_v2(h, info);
}

/* ---- MIG device handles ---------------------------------------------- */

SIM_API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t dev, unsigned int *is_mig)
{
    NVML_ENTRY("nvmlDeviceIsMigDeviceHandle");
    sim_migdev m;
    if (!is_mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (sim_nvml_mig(dev, &m) == 0)
        *is_mig = 1;
    else if (sim_nvml_node(dev) >= 0)
        *is_mig = 0;
    else
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

/* The GI (ci == 0) or CI id of MIG device dev into *id. */
static nvmlReturn_t mig_id(nvmlDevice_t dev, unsigned int *id, int ci)
{
    sim_migdev m;
    if (!id)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (sim_nvml_mig(dev, &m) < 0)
        return sim_nvml_node(dev) >= 0 ? NVML_ERROR_NOT_SUPPORTED
                                       : NVML_ERROR_INVALID_ARGUMENT;
    const sim_gi *g = &sim_state()->gi[m.gpu][m.slot];
    *id = ci ? g->ci[m.ci].id : g->id;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t dev, unsigned int *id)
{
    NVML_ENTRY("nvmlDeviceGetGpuInstanceId");
    return mig_id(dev, id, 0);
}

SIM_API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t dev, unsigned int *id)
{
    NVML_ENTRY("nvmlDeviceGetComputeInstanceId");
    return mig_id(dev, id, 1);
}

SIM_API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t dev, unsigned int *count)
{
    NVML_GPU_ENTRY("nvmlDeviceGetMaxMigDeviceCount", dev, gpu);
    NVML_TRY(mig_query(gpu, count));
    *count = sim_gpu_model(gpu)->compute_slices;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t dev, unsigned int index,
                                                         nvmlDevice_t *out)
{
    NVML_GPU_ENTRY("nvmlDeviceGetMigDeviceHandleByIndex", dev, gpu);
    if (!out || !sim_mig_capable(gpu) || index >= sim_gpu_model(gpu)->compute_slices)
        return NVML_ERROR_INVALID_ARGUMENT;
    sim_migdev m[SIM_MIG_SLOTS * SIM_MIG_SLOTS];
    int n = sim_mig_devices(gpu, m, SIM_MIG_SLOTS * SIM_MIG_SLOTS);
    if ((int)index >= n)
        return NVML_ERROR_NOT_FOUND;
    *out = sim_nvml_mig_handle(gpu, m[index].slot, m[index].ci);
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig,
                                                                  nvmlDevice_t *out)
{
    NVML_ENTRY("nvmlDeviceGetDeviceHandleFromMigDeviceHandle");
    sim_migdev m;
    if (!out || sim_nvml_mig(mig, &m) < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = sim_nvml_gpu_handle(m.gpu);
    return NVML_SUCCESS;
}
