/*
 * cuda_launch.c - kernel launches on the simulated timeline.
 *
 * A launch is asynchronous: it computes the kernel's duration, queues it on
 * its device's node-wide timeline (state_timeline.c: one kernel at a time,
 * in launch order, across every process) after the work its stream depends
 * on, and returns.  The stream, its context and the context's queue of
 * pending launches remember the end time.  A context holds at most
 * SIM_QUEUE_DEPTH pending (not yet completed) launches: the next launch
 * sleeps until the oldest completes.  A kernel launched into a capturing
 * stream is appended to the capture graph instead (cuda_graph_capture.c).
 *
 * Durations: a function named "spin" runs for kernelParams[0] (a uint32)
 * microseconds; any other function 1 us per block of its grid.
 */
#include <string.h>

#include "sim.h"

#define NS_PER_US 1000ULL
#define MAX_DUR_US (1ULL << 40)         /* ~12 days: keeps ns in range */

static uint64_t spin_arg(void **params, void **extra, int *ok)
{
    uint32_t v = 0;
    *ok = 0;
    if (params && params[0]) {
        memcpy(&v, params[0], sizeof v);
        *ok = 1;
    } else if (extra) {
        const void *buf = NULL;
        size_t size = 0;
        for (int i = 0; i < 16 && extra[i] != GV_CU_LAUNCH_PARAM_END; i += 2) {
            if (extra[i] == GV_CU_LAUNCH_PARAM_BUFFER_POINTER)
                buf = extra[i + 1];
            else if (extra[i] == GV_CU_LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1])
                size = *(const size_t *)extra[i + 1];
            else
                break;
        }
        if (buf && size >= sizeof v) {
            memcpy(&v, buf, sizeof v);
            *ok = 1;
        }
    }
    return v;
}

CUresult sim_kern_make(sim_kern *k, CUfunction f, const unsigned grid[3],
                       const unsigned block[3], unsigned shmem,
                       void **params, void **extra)
{
    pthread_mutex_lock(&sim_mu);
    int ok = f && sim_reg_has(f) && f->magic == SIM_FUNC_MAGIC;
    int spin = ok ? f->spin : 0;
    pthread_mutex_unlock(&sim_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_HANDLE;
    if (params && extra)
        return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < 3; i++)
        if (!grid[i] || !block[i])
            return CUDA_ERROR_INVALID_VALUE;
    if (grid[0] > SIM_MAX_GRID_X || grid[1] > SIM_MAX_GRID_YZ || grid[2] > SIM_MAX_GRID_YZ ||
        block[0] > SIM_MAX_BLOCK_X || block[1] > SIM_MAX_BLOCK_Y || block[2] > SIM_MAX_BLOCK_Z ||
        (uint64_t)block[0] * block[1] * block[2] > SIM_MAX_BLOCK_THREADS ||
        shmem > SIM_MAX_SHMEM)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t us;
    if (spin) {
        int have;
        us = spin_arg(params, extra, &have);
        if (!have)
            return CUDA_ERROR_INVALID_VALUE;
    } else {
        us = (uint64_t)grid[0] * grid[1] * grid[2];
        if (us > MAX_DUR_US)
            us = MAX_DUR_US;
    }
    k->f = f;
    k->dur_ns = us * NS_PER_US;
    memcpy(k->grid, grid, sizeof k->grid);
    memcpy(k->block, block, sizeof k->block);
    k->shmem = shmem;
    return CUDA_SUCCESS;
}

CUresult sim_launch(const sim_sref *r, const sim_kern *k, int n)
{
    struct CUctx_st *c = r->ctx;
    sim_launch_delay();                 /* the driver's own time, before it enqueues */
    for (int i = 0; i < n; i++) {
        for (;;) {
            pthread_mutex_lock(&sim_mu);
            if (r->s && r->s->capture == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
                CUresult rc = sim_graph_append_locked(r->s->cap_graph, &k[i]);
                pthread_mutex_unlock(&sim_mu);
                if (rc)
                    return rc;
                break;
            }
            if (r->s && r->s->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
                pthread_mutex_unlock(&sim_mu);
                return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
            }
            uint64_t *slot = &c->pend[c->pend_head % SIM_QUEUE_DEPTH];
            uint64_t oldest = *slot;
            if (!sim_tl_done(c->node, oldest)) {
                /* queue full: wait for the oldest pending launch */
                pthread_mutex_unlock(&sim_mu);
                sim_tl_wait(c->node, oldest);
                continue;
            }
            uint64_t end = sim_tl_launch(c->node, sim_sref_ready_locked(r),
                                         k[i].dur_ns);
            *slot = end;
            c->pend_head++;
            sim_sref_after_locked(r, end);
            pthread_mutex_unlock(&sim_mu);
            break;
        }
    }
    return CUDA_SUCCESS;
}

void sim_ctx_sync_wait(struct CUctx_st *c)
{
    pthread_mutex_lock(&sim_mu);
    uint64_t t = c->all_end;
    int node = c->node;
    pthread_mutex_unlock(&sim_mu);
    sim_tl_wait(node, t);
}

/* ---- entry points ---------------------------------------------------- */

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                       unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                       CUstream hs, void **params, void **extra, int ptsz,
                       int coop)
{
    sim_sref r;
    CUresult rc = sim_stream_call(1, hs, ptsz, &r);
    if (rc)
        return rc;
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    sim_kern k;
    rc = sim_kern_make(&k, f, grid, block, shmem, params, extra);
    if (rc)
        return rc;
    if (coop) {
        /* all blocks must be resident at once: sms x blocks per SM
         * (2048 threads, at most 32 blocks, per SM) */
        uint64_t threads = (uint64_t)bx * by * bz;
        uint64_t per_sm = SIM_SM_THREADS / threads;
        if (per_sm > SIM_SM_BLOCKS)
            per_sm = SIM_SM_BLOCKS;
        uint64_t max = per_sm * (uint64_t)sim_dev(r.ctx->node)->sms;
        if ((uint64_t)gx * gy * gz > max)
            return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
    }
    return sim_launch(&r, &k, 1);
}

/* cuLaunchKernel and cuLaunchCooperativeKernel, each with its per-thread
 * default stream form (ptsz): the cooperative one takes no extra. */
#define LAUNCH_KERNEL(name, ptsz)                                               \
    SIM_API CUresult name(CUfunction f, unsigned gx, unsigned gy, unsigned gz,  \
                          unsigned bx, unsigned by, unsigned bz, unsigned shmem, \
                          CUstream s, void **params, void **extra)              \
    {                                                                           \
        return launch(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra, ptsz, 0); \
    }
#define LAUNCH_COOPERATIVE(name, ptsz)                                          \
    SIM_API CUresult name(CUfunction f, unsigned gx, unsigned gy, unsigned gz,  \
                          unsigned bx, unsigned by, unsigned bz, unsigned shmem, \
                          CUstream s, void **params)                            \
    {                                                                           \
        return launch(f, gx, gy, gz, bx, by, bz, shmem, s, params, NULL, ptsz, 1); \
    }

LAUNCH_KERNEL(cuLaunchKernel, 0)
LAUNCH_KERNEL(cuLaunchKernel_ptsz, 1)
LAUNCH_COOPERATIVE(cuLaunchCooperativeKernel, 0)
LAUNCH_COOPERATIVE(cuLaunchCooperativeKernel_ptsz, 1)

static CUresult launch_ex(const CUlaunchConfig *cfg, CUfunction f,
                          void **params, void **extra, int ptsz)
{
    SIM_TRY(sim_check_args(!cfg || (cfg->numAttrs && !cfg->attrs)));
    int coop = 0;
    for (unsigned i = 0; i < cfg->numAttrs; i++) {
        const CUlaunchAttribute *a = &cfg->attrs[i];
        if (a->id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE)
            coop = a->value.cooperative != 0;
        else if (a->id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) {
            unsigned cx = a->value.clusterDim.x, cy = a->value.clusterDim.y,
                     cz = a->value.clusterDim.z;
            if (!cx || !cy || !cz || cfg->gridDimX % cx ||
                cfg->gridDimY % cy || cfg->gridDimZ % cz)
                return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return launch(f, cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ,
                  cfg->blockDimX, cfg->blockDimY, cfg->blockDimZ,
                  cfg->sharedMemBytes, cfg->hStream, params, extra, ptsz,
                  coop);
}

SIM_API CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f,
                                  void **params, void **extra)
{
    return launch_ex(cfg, f, params, extra, 0);
}

SIM_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg,
                                       CUfunction f, void **params,
                                       void **extra)
{
    return launch_ex(cfg, f, params, extra, 1);
}

/* ---- the legacy launch API (deprecated, still exported by CUDA 12) ---- */

static struct CUfunc_st *legacy_func_locked(CUfunction f)
{
    return f && sim_reg_has(f) && f->magic == SIM_FUNC_MAGIC ? f : NULL;
}

SIM_API CUresult cuFuncSetBlockShape(CUfunction f, int x, int y, int z)
{
    SIM_TRY(sim_check_args(x <= 0 || y <= 0 || z <= 0));
    pthread_mutex_lock(&sim_mu);
    struct CUfunc_st *fn = legacy_func_locked(f);
    if (fn) {
        fn->block[0] = (unsigned)x;
        fn->block[1] = (unsigned)y;
        fn->block[2] = (unsigned)z;
    }
    pthread_mutex_unlock(&sim_mu);
    return fn ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

SIM_API CUresult cuParamSetSize(CUfunction f, unsigned int n)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    struct CUfunc_st *fn = legacy_func_locked(f);
    if (fn && n < 4)
        fn->have_param0 = 0;
    pthread_mutex_unlock(&sim_mu);
    return fn ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Only the first 32-bit parameter matters here (spin's microseconds). */
SIM_API CUresult cuParamSeti(CUfunction f, int offset, unsigned int value)
{
    SIM_TRY(sim_check_args(offset < 0));
    pthread_mutex_lock(&sim_mu);
    struct CUfunc_st *fn = legacy_func_locked(f);
    if (fn && offset == 0) {
        fn->param0 = value;
        fn->have_param0 = 1;
    }
    pthread_mutex_unlock(&sim_mu);
    return fn ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

SIM_API CUresult cuParamSetv(CUfunction f, int offset, void *ptr, unsigned int n)
{
    SIM_TRY(sim_check_args(offset < 0 || (n && !ptr)));
    pthread_mutex_lock(&sim_mu);
    struct CUfunc_st *fn = legacy_func_locked(f);
    if (fn && offset == 0 && n >= 4) {
        memcpy(&fn->param0, ptr, 4);
        fn->have_param0 = 1;
    }
    pthread_mutex_unlock(&sim_mu);
    return fn ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult legacy_launch(CUfunction f, int w, int h, CUstream s)
{
    SIM_TRY(sim_check_args(w <= 0 || h <= 0));
    unsigned block[3] = { 1, 1, 1 };
    uint32_t param0 = 0;
    int have = 0;
    pthread_mutex_lock(&sim_mu);
    struct CUfunc_st *fn = legacy_func_locked(f);
    if (fn) {
        for (int i = 0; i < 3; i++)
            block[i] = fn->block[i] ? fn->block[i] : 1;
        param0 = fn->param0;
        have = fn->have_param0;
    }
    pthread_mutex_unlock(&sim_mu);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    void *params[1] = { &param0 };
    return launch(f, (unsigned)w, (unsigned)h, 1, block[0], block[1], block[2], 0, s,
                  have ? params : NULL, NULL, 0, 0);
}

SIM_API CUresult cuLaunch(CUfunction f) { return legacy_launch(f, 1, 1, NULL); }

SIM_API CUresult cuLaunchGrid(CUfunction f, int w, int h) { return legacy_launch(f, w, h, NULL); }

SIM_API CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s)
{
    return legacy_launch(f, w, h, s);
}
