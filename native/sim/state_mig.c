/*
 * state_mig.c - MIG on the simulated node: the mode, GPU instances (GIs)
 * and compute instances (CIs), kept in the node state under its lock so
 * that every process sees the same instances.
 *
 * A GI takes memory slices [start, start + size) at one of its profile's
 * legal placements and its profile's compute slices; GIs may not overlap,
 * their compute slices may not add up to more than the GPU's, and a GPU
 * holds at most a profile's instance count of it.  A GI's id follows its
 * placement as on a real GPU ((memory slices / size - 1) + start / size:
 * 0 for the whole GPU, 1-2 the halves, 3-6 the quarters, 7-14 the
 * eighths).  Each GI is a node of its own (sim_gi_node): the memory
 * domain that processes on its MIG devices charge.  A CI takes compute
 * slices of its GI; each CI is one MIG device with its own MIG- UUID.
 *
 * Usage is tracked per GI: a GI, or one of its CIs, is in use while a live
 * process has memory on the GI; destroying it then fails with
 * NVML_ERROR_IN_USE, as it does on a real GPU.
 */
#include <stdio.h>
#include <string.h>

#include "sim.h"

/* compute slices of a compute-instance profile index (0 if none) */
static unsigned ci_slices(int idx)
{
    static const unsigned k[NVML_COMPUTE_INSTANCE_PROFILE_COUNT] = {1, 2, 3, 4, 7, 8, 6, 0, 0};
    return idx >= 0 && idx < NVML_COMPUTE_INSTANCE_PROFILE_COUNT ? k[idx] : 0;
}

unsigned sim_ci_slices(int idx)
{
    return ci_slices(idx);
}

/* placement alignment of a k-slice compute instance */
static unsigned ci_align(unsigned k)
{
    return k <= 1 ? 1 : k <= 2 ? 2 : k <= 4 ? 4 : 8;
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* a new MIG- UUID, from the GPU's UUID and the node's serial (locked) */
static void new_uuid(sim_shared *S, int gpu, char *buf, size_t len)
{
    unsigned char b[16] = {0};
    sim_uuid_bytes(S->dev[gpu].uuid, b);
    uint64_t seed = 0;
    memcpy(&seed, b, 8);
    uint64_t serial = ++S->mig_serial;
    uint64_t h1 = mix(seed ^ serial), h2 = mix(h1 ^ (uint64_t)gpu);
    snprintf(buf, len, "MIG-%08x-%04x-%04x-%04x-%012llx", (unsigned)(h1 >> 32),
             (unsigned)(h1 >> 16) & 0xffffu, 0x4000u | ((unsigned)h1 & 0x0fffu),
             0x8000u | ((unsigned)(h2 >> 48) & 0x3fffu),
             (unsigned long long)(h2 & 0xffffffffffffULL));
}

const sim_gi_profile *sim_gi_profile_by_index(int gpu, int index)
{
    const sim_model *m = sim_gpu_model(gpu);
    if (!m)
        return NULL;
    for (int i = 0; i < m->nprof; i++)
        if (m->prof[i].index == index)
            return &m->prof[i];
    return NULL;
}

const sim_gi_profile *sim_gi_profile_by_id(int gpu, unsigned id)
{
    const sim_model *m = sim_gpu_model(gpu);
    if (!m)
        return NULL;
    for (int i = 0; i < m->nprof; i++)
        if (m->prof[i].id == id)
            return &m->prof[i];
    return NULL;
}

int sim_mig_capable(int gpu)
{
    sim_shared *S = sim_state();
    return S && gpu >= 0 && gpu < (int)S->ndev && S->topology && S->topo[gpu].mig_capable;
}

int sim_mig_mode(int gpu)
{
    sim_shared *S = sim_state();
    return sim_mig_capable(gpu) ? S->mig_mode[gpu] : 0;
}

nvmlReturn_t sim_mig_set_mode(int gpu, int mode)
{
    sim_shared *S = sim_state();
    if (!sim_mig_capable(gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    sim_state_lock();
    nvmlReturn_t rc = NVML_SUCCESS;
    sim_reap_locked();
    if (S->mig_mode[gpu] == mode) {
        rc = NVML_SUCCESS;
    } else if (sim_gpu_in_use_locked(gpu)) {
        rc = NVML_ERROR_IN_USE;         /* a process uses the GPU */
    } else {
        for (int s = 0; s < SIM_MIG_SLOTS; s++)
            if (S->gi[gpu][s].active)
                rc = NVML_ERROR_IN_USE; /* its instances must go first */
        if (!rc)
            S->mig_mode[gpu] = mode;
    }
    sim_state_unlock();
    return rc;
}

/* memory slices the GPU's GIs hold (bit mask) and compute slices in use */
static void occupied(sim_shared *S, const sim_model *m, int gpu, unsigned *mem, unsigned *compute,
                     int skip_slot)
{
    *mem = 0;
    *compute = 0;
    for (int s = 0; s < SIM_MIG_SLOTS; s++) {
        const sim_gi *g = &S->gi[gpu][s];
        if (!g->active || s == skip_slot)
            continue;
        *mem |= ((1u << g->size) - 1) << g->start;
        *compute += m->prof[g->prof].compute_slices;
    }
}

static unsigned count_of(sim_shared *S, int gpu, int prof)
{
    unsigned n = 0;
    for (int s = 0; s < SIM_MIG_SLOTS; s++)
        if (S->gi[gpu][s].active && S->gi[gpu][s].prof == prof)
            n++;
    return n;
}

/* how many more GIs of profile p fit (locked): placements taken greedily */
static unsigned remaining_locked(sim_shared *S, const sim_model *m, int gpu, int p)
{
    const sim_gi_profile *pr = &m->prof[p];
    unsigned mem, compute;
    occupied(S, m, gpu, &mem, &compute, -1);
    unsigned have = count_of(S, gpu, p), n = 0;
    for (unsigned st = 0; st < m->mem_slices; st++) {
        if (!(pr->starts >> st & 1))
            continue;
        unsigned want = ((1u << pr->mem_slices) - 1) << st;
        if (mem & want || compute + pr->compute_slices > m->compute_slices ||
            have + n >= pr->max_count)
            continue;
        mem |= want;
        compute += pr->compute_slices;
        n++;
    }
    return n;
}

nvmlReturn_t sim_gi_remaining(int gpu, const sim_gi_profile *pr, unsigned *count)
{
    sim_shared *S = sim_state();
    const sim_model *m = sim_gpu_model(gpu);
    if (!m || !sim_mig_mode(gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    sim_state_lock();
    *count = remaining_locked(S, m, gpu, (int)(pr - m->prof));
    sim_state_unlock();
    return NVML_SUCCESS;
}

nvmlReturn_t sim_gi_create(int gpu, const sim_gi_profile *pr, int start, int *slot_out)
{
    sim_shared *S = sim_state();
    const sim_model *m = sim_gpu_model(gpu);
    if (!m || !sim_mig_mode(gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    if (start >= 0 && (start >= (int)m->mem_slices || !(pr->starts >> start & 1)))
        return NVML_ERROR_INVALID_ARGUMENT;     /* not one of its placements */
    int p = (int)(pr - m->prof);
    sim_state_lock();
    unsigned mem, compute;
    occupied(S, m, gpu, &mem, &compute, -1);
    nvmlReturn_t rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
    int slot = -1;
    for (int s = 0; s < SIM_MIG_SLOTS && slot < 0; s++)
        if (!S->gi[gpu][s].active)
            slot = s;
    if (!S->mig_mode[gpu])
        rc = NVML_ERROR_NOT_SUPPORTED;  /* disabled meanwhile */
    else if (slot >= 0 && count_of(S, gpu, p) < pr->max_count &&
        compute + pr->compute_slices <= m->compute_slices) {
        for (unsigned st = 0; st < m->mem_slices; st++) {
            if (start >= 0 && (int)st != start)
                continue;
            unsigned want = ((1u << pr->mem_slices) - 1) << st;
            if (!(pr->starts >> st & 1) || (mem & want))
                continue;
            int node = sim_gi_node(gpu, slot);
            sim_devinfo *d = &S->dev[node];
            memset(d, 0, sizeof *d);
            d->total = (uint64_t)pr->mem_mib * SIM_MIB;
            d->ctx_size = S->dev[gpu].ctx_size;
            d->sms = (int32_t)pr->sms;
            char parent[SIM_NAME_LEN];
            memcpy(parent, S->dev[gpu].name, sizeof parent);
            parent[60] = 0;
            snprintf(d->name, sizeof d->name, "%.60s MIG %.20s", parent, pr->name);
            new_uuid(S, gpu, d->uuid, sizeof d->uuid);
            sim_gi *g = &S->gi[gpu][slot];
            memset((void *)g->ci, 0, sizeof g->ci);
            g->id = (m->mem_slices / pr->mem_slices - 1) + st / pr->mem_slices;
            g->prof = p;
            g->start = st;
            g->size = pr->mem_slices;
            /* a new node: no usage (a dead process's is reaped) and an
             * empty timeline */
            sim_reap_locked();
            memset(&S->tl[node], 0, sizeof S->tl[node] - sizeof S->tl[node].ring);
            __atomic_store_n(&g->active, 1, __ATOMIC_RELEASE);
            *slot_out = slot;
            rc = NVML_SUCCESS;
            break;
        }
    }
    sim_state_unlock();
    return rc;
}

nvmlReturn_t sim_gi_destroy(int gpu, int slot)
{
    sim_shared *S = sim_state();
    sim_state_lock();
    sim_gi *g = &S->gi[gpu][slot];
    nvmlReturn_t rc = NVML_SUCCESS;
    sim_reap_locked();
    if (!g->active) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (sim_node_in_use_locked(sim_gi_node(gpu, slot))) {
        rc = NVML_ERROR_IN_USE;
    } else {
        for (int c = 0; c < SIM_MIG_SLOTS; c++)
            if (g->ci[c].active)
                rc = NVML_ERROR_IN_USE; /* compute instances first */
        if (!rc)
            __atomic_store_n(&g->active, 0, __ATOMIC_RELEASE);
    }
    sim_state_unlock();
    return rc;
}

/* ---- compute instances ---------------------------------------------- */

int sim_gi_compute_slices(int gpu, int slot)
{
    sim_shared *S = sim_state();
    const sim_model *m = sim_gpu_model(gpu);
    const sim_gi *g = &S->gi[gpu][slot];
    return m && g->active ? (int)m->prof[g->prof].compute_slices : 0;
}

/* 1 if CI profile idx fits GI slot's compute slices c: k <= c, and a
 * whole-GPU-sized profile only in a whole GPU */
int sim_ci_supported(int gpu, int slot, int idx)
{
    unsigned c = (unsigned)sim_gi_compute_slices(gpu, slot), k = ci_slices(idx);
    if (!c || !k || k > c)
        return 0;
    return k == 1 || k == 2 || k == 3 || k == 4 || k == c;
}

unsigned sim_ci_max(int gpu, int slot, int idx)
{
    unsigned c = (unsigned)sim_gi_compute_slices(gpu, slot), k = ci_slices(idx);
    return sim_ci_supported(gpu, slot, idx) ? c / k : 0;
}

/* legal starts of CI profile idx in GI slot, into out; returns how many */
int sim_ci_starts(int gpu, int slot, int idx, unsigned *out, int max)
{
    unsigned c = (unsigned)sim_gi_compute_slices(gpu, slot), k = ci_slices(idx);
    if (!sim_ci_supported(gpu, slot, idx))
        return 0;
    int n = 0;
    for (unsigned s = 0; s + k <= c; s += ci_align(k))
        if (n < max)
            out[n++] = s;
    return n;
}

static unsigned ci_used_mask(const sim_gi *g)
{
    unsigned mask = 0;
    for (int c = 0; c < SIM_MIG_SLOTS; c++)
        if (g->ci[c].active)
            mask |= ((1u << g->ci[c].size) - 1) << g->ci[c].start;
    return mask;
}

nvmlReturn_t sim_ci_remaining(int gpu, int slot, int idx, unsigned *count)
{
    sim_shared *S = sim_state();
    unsigned st[8];
    int ns = sim_ci_starts(gpu, slot, idx, st, 8);
    if (!ns)
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned k = ci_slices(idx), n = 0;
    sim_state_lock();
    unsigned used = ci_used_mask(&S->gi[gpu][slot]);
    for (int i = 0; i < ns; i++) {
        unsigned want = ((1u << k) - 1) << st[i];
        if (!(used & want)) {
            used |= want;
            n++;
        }
    }
    sim_state_unlock();
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t sim_ci_create(int gpu, int slot, int idx, int start, int *ci_out)
{
    sim_shared *S = sim_state();
    unsigned st[8];
    int ns = sim_ci_starts(gpu, slot, idx, st, 8);
    if (!ns)
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned k = ci_slices(idx);
    sim_state_lock();
    sim_gi *g = &S->gi[gpu][slot];
    nvmlReturn_t rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
    if (!g->active) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        int free_ci = -1;
        for (int c = 0; c < SIM_MIG_SLOTS && free_ci < 0; c++)
            if (!g->ci[c].active)
                free_ci = c;
        unsigned used = ci_used_mask(g);
        for (int i = 0; i < ns && free_ci >= 0; i++) {
            unsigned want = ((1u << k) - 1) << st[i];
            if ((start >= 0 && (int)st[i] != start) || (used & want))
                continue;
            sim_ci *ci = &g->ci[free_ci];
            ci->id = st[i];
            ci->prof = idx;
            ci->start = st[i];
            ci->size = k;
            new_uuid(S, gpu, ci->uuid, sizeof ci->uuid);
            __atomic_store_n(&ci->active, 1, __ATOMIC_RELEASE);
            *ci_out = free_ci;
            rc = NVML_SUCCESS;
            break;
        }
    }
    sim_state_unlock();
    return rc;
}

nvmlReturn_t sim_ci_destroy(int gpu, int slot, int ci)
{
    sim_shared *S = sim_state();
    sim_state_lock();
    sim_gi *g = &S->gi[gpu][slot];
    nvmlReturn_t rc = NVML_SUCCESS;
    sim_reap_locked();
    if (!g->active || !g->ci[ci].active)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (sim_node_in_use_locked(sim_gi_node(gpu, slot)))
        rc = NVML_ERROR_IN_USE;
    else
        __atomic_store_n(&g->ci[ci].active, 0, __ATOMIC_RELEASE);
    sim_state_unlock();
    return rc;
}

/* ---- MIG devices ----------------------------------------------------- */

int sim_mig_devices(int gpu, sim_migdev *out, int max)
{
    sim_shared *S = sim_state();
    if (!S || !S->topology)
        return 0;
    int n = 0;
    sim_state_lock();
    for (int g = 0; g < (int)S->ndev; g++) {
        if ((gpu >= 0 && g != gpu) || !S->mig_mode[g])
            continue;
        /* GIs by id, CIs by id: ids are below 16 */
        for (unsigned gid = 0; gid < 16; gid++)
            for (int s = 0; s < SIM_MIG_SLOTS; s++) {
                const sim_gi *gi = &S->gi[g][s];
                if (!gi->active || gi->id != gid)
                    continue;
                for (unsigned cid = 0; cid < 8; cid++)
                    for (int c = 0; c < SIM_MIG_SLOTS; c++) {
                        const sim_ci *ci = &gi->ci[c];
                        if (!ci->active || ci->id != cid)
                            continue;
                        if (n < max) {
                            out[n].gpu = g;
                            out[n].slot = s;
                            out[n].ci = c;
                            out[n].node = sim_gi_node(g, s);
                            snprintf(out[n].uuid, sizeof out[n].uuid, "%s", ci->uuid);
                        }
                        n++;
                    }
            }
    }
    sim_state_unlock();
    return n < max ? n : max;
}
