/*
 * hooks_launch.c - every way to launch work goes through the SM gate:
 * cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel and
 * cuGraphLaunch, each with its per-thread-default-stream (_ptsz) variant,
 * and the legacy cuLaunch, cuLaunchGrid and cuLaunchGridAsync (deprecated,
 * still exported).  cuLaunchCooperativeKernelMultiDevice (deprecated since
 * CUDA 11.3), one launch over several devices' streams, is refused while
 * any launch may be gated, rather than let through unpaced.
 *
 * Fast path: without any SM limit in the container the hook costs two
 * loads and a call, whatever the container's priority; a low-priority
 * container without a limit leaves it only while it is asked to yield.
 * With a limit, the launch is paced and measured (sm.h).
 */
#include <stdatomic.h>

#include "hooks.h"
#include "log.h"
#include "sm.h"

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void **, void **);
typedef CUresult (*coop_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, unsigned, CUstream, void **);
typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*graph_fn)(CUgraphExec, CUstream);

/* Graph executions and functions share the estimate table: tag graphs. */
#define GRAPH_KEY(g) ((uintptr_t)(g) | 1u)

#define GATED(stream, ptsz, key, call)                                       \
    do {                                                                     \
        gv_sm_launch l_;                                                     \
        if (__builtin_expect(!gv_sm_maybe(), 1) ||                           \
            !gv_sm_begin(&l_, (stream), (ptsz), (key)))                      \
            return call;                                                     \
        CUresult rc_ = call;                                                 \
        gv_sm_end(&l_, rc_);                                                 \
        return rc_;                                                          \
    } while (0)

GV_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                  unsigned by, unsigned bz, unsigned shmem, CUstream s,
                                  void **params, void **extra)
{
    launch_fn real = GV_REAL(cuLaunchKernel, launch_fn);
    GATED(s, 0, (uintptr_t)f, real(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra));
}

GV_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                       unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                       CUstream s, void **params, void **extra)
{
    launch_fn real = GV_REAL(cuLaunchKernel_ptsz, launch_fn);
    GATED(s, 1, (uintptr_t)f, real(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra));
}

GV_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                             unsigned bx, unsigned by, unsigned bz,
                                             unsigned shmem, CUstream s, void **params)
{
    coop_fn real = GV_REAL(cuLaunchCooperativeKernel, coop_fn);
    GATED(s, 0, (uintptr_t)f, real(f, gx, gy, gz, bx, by, bz, shmem, s, params));
}

GV_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy,
                                                  unsigned gz, unsigned bx, unsigned by,
                                                  unsigned bz, unsigned shmem, CUstream s,
                                                  void **params)
{
    coop_fn real = GV_REAL(cuLaunchCooperativeKernel_ptsz, coop_fn);
    GATED(s, 1, (uintptr_t)f, real(f, gx, gy, gz, bx, by, bz, shmem, s, params));
}

GV_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **params,
                                    void **extra)
{
    launch_ex_fn real = GV_REAL(cuLaunchKernelEx, launch_ex_fn);
    GATED(cfg ? cfg->hStream : NULL, 0, (uintptr_t)f, real(cfg, f, params, extra));
}

GV_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **params,
                                         void **extra)
{
    launch_ex_fn real = GV_REAL(cuLaunchKernelEx_ptsz, launch_ex_fn);
    GATED(cfg ? cfg->hStream : NULL, 1, (uintptr_t)f, real(cfg, f, params, extra));
}

static CUresult graph_gated(graph_fn real, CUgraphExec g, CUstream s, int ptsz)
{
    GATED(s, ptsz, GRAPH_KEY(g), real(g, s));
}

/* A graph with allocation nodes also takes memory (hooks_graph.c). */
static CUresult graph_launch(graph_fn real, CUgraphExec g, CUstream s, int ptsz)
{
    if (__builtin_expect(!gv_graph_mem_seen(), 1))
        return graph_gated(real, g, s, ptsz);
    /* Paced first: a launch waiting for its turn (for as long as a
     * higher-priority container works, when yielding) holds no pool lock,
     * so the process's other threads can still trim, destroy and launch. */
    gv_sm_launch l;
    int gated = gv_sm_maybe() && gv_sm_begin(&l, s, ptsz, GRAPH_KEY(g));
    gv_graph_mem m;
    CUresult rc = gv_graph_mem_begin(&m, g);
    if (rc == CUDA_SUCCESS) {
        rc = real(g, s);
        gv_graph_mem_launched(&m, rc, s, ptsz);
        gv_graph_mem_end(&m);
    }
    if (gated)
        gv_sm_end(&l, rc);   /* refused for memory: the SM charge goes back */
    return rc;
}

GV_EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    return graph_launch(GV_REAL(cuGraphLaunch, graph_fn), g, s, 0);
}

GV_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s)
{
    return graph_launch(GV_REAL(cuGraphLaunch_ptsz, graph_fn), g, s, 1);
}

/* ---- the legacy API ---------------------------------------------------- */

typedef CUresult (*legacy_fn)(CUfunction);
typedef CUresult (*grid_fn)(CUfunction, int, int);
typedef CUresult (*grid_async_fn)(CUfunction, int, int, CUstream);
typedef CUresult (*multi_fn)(void *, unsigned, unsigned);

GV_EXPORT CUresult cuLaunch(CUfunction f)
{
    legacy_fn real = GV_REAL(cuLaunch, legacy_fn);
    GATED(NULL, 0, (uintptr_t)f, real(f));
}

GV_EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h)
{
    grid_fn real = GV_REAL(cuLaunchGrid, grid_fn);
    GATED(NULL, 0, (uintptr_t)f, real(f, w, h));
}

GV_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s)
{
    grid_async_fn real = GV_REAL(cuLaunchGridAsync, grid_async_fn);
    GATED(s, 0, (uintptr_t)f, real(f, w, h, s));
}

GV_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(void *list, unsigned n, unsigned flags)
{
    multi_fn real = GV_REAL(cuLaunchCooperativeKernelMultiDevice, multi_fn);
    if (__builtin_expect(!gv_sm_maybe(), 1))
        return real(list, n, flags);
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gv_log(GV_LOG_ERROR, "cuLaunchCooperativeKernelMultiDevice is refused "
                             "(CUDA_ERROR_NOT_SUPPORTED) while an SM limit or a yield is set: it "
                             "cannot be paced; launch on each device with "
                             "cuLaunchCooperativeKernel");
    return CUDA_ERROR_NOT_SUPPORTED;
}

const gv_hook gv_hooks_launch[] = {
    { "cuLaunchKernel", (void *)cuLaunchKernel },
    { "cuLaunchKernel_ptsz", (void *)cuLaunchKernel_ptsz },
    { "cuLaunchCooperativeKernel", (void *)cuLaunchCooperativeKernel },
    { "cuLaunchCooperativeKernel_ptsz", (void *)cuLaunchCooperativeKernel_ptsz },
    { "cuLaunchKernelEx", (void *)cuLaunchKernelEx },
    { "cuLaunchKernelEx_ptsz", (void *)cuLaunchKernelEx_ptsz },
    { "cuGraphLaunch", (void *)cuGraphLaunch },
    { "cuGraphLaunch_ptsz", (void *)cuGraphLaunch_ptsz },
    { "cuLaunch", (void *)cuLaunch },
    { "cuLaunchGrid", (void *)cuLaunchGrid },
    { "cuLaunchGridAsync", (void *)cuLaunchGridAsync },
    { "cuLaunchCooperativeKernelMultiDevice", (void *)cuLaunchCooperativeKernelMultiDevice },
    { NULL, NULL }
};
