/*
 * cuda_stream.c - streams.  Work is not simulated yet, so streams are
 * always idle; a synchronize is the point where memory pools give memory
 * back (sim_pools_sync).  A stream belongs to the context current when it
 * was created; the struct is the place to hang a future work timeline.
 */
#include <stdlib.h>

#include "sim.h"

#define STREAM_MAGIC 0x5354524du

static int is_special(CUstream s)
{
    return s == NULL || s == GV_CU_STREAM_LEGACY || s == GV_CU_STREAM_PER_THREAD;
}

CUresult sim_stream_ctx(CUstream s, struct CUctx_st **out)
{
    if (is_special(s))
        return sim_current(out);
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    int ok = sim_reg_has(s) && s->magic == STREAM_MAGIC;
    struct CUctx_st *c = ok ? s->ctx : NULL;
    pthread_mutex_unlock(&sim_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!sim_ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamCreateWithPriority(CUstream *ps, unsigned int flags,
                                            int prio)
{
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc)
        return rc;
    if (!ps || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = STREAM_MAGIC;
    s->ctx = c;
    s->flags = flags;
    s->priority = prio;
    pthread_mutex_lock(&sim_mu);
    sim_reg_add(s);
    pthread_mutex_unlock(&sim_mu);
    *ps = s;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamCreate(CUstream *ps, unsigned int flags)
{
    return cuStreamCreateWithPriority(ps, flags, 0);
}

SIM_API CUresult cuStreamDestroy_v2(CUstream s)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (is_special(s))
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&sim_mu);
    int ok = sim_reg_has(s) && s->magic == STREAM_MAGIC;
    if (ok) {
        sim_reg_del(s);
        s->magic = 0;
    }
    pthread_mutex_unlock(&sim_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_HANDLE;
    free(s);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamDestroy(CUstream s)
{
    return cuStreamDestroy_v2(s);
}

SIM_API CUresult cuStreamSynchronize(CUstream s)
{
    struct CUctx_st *c;
    CUresult rc = sim_stream_ctx(s, &c);
    if (rc)
        return rc;
    sim_pools_sync(c->ordinal);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    return cuStreamSynchronize(s);
}

SIM_API CUresult cuStreamQuery(CUstream s)
{
    struct CUctx_st *c;
    return sim_stream_ctx(s, &c);
}

SIM_API CUresult cuStreamQuery_ptsz(CUstream s)
{
    return cuStreamQuery(s);
}

SIM_API CUresult cuStreamGetCtx(CUstream s, CUcontext *pctx)
{
    struct CUctx_st *c;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_stream_ctx(s, &c);
    if (rc)
        return rc;
    *pctx = c;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamGetCtx_ptsz(CUstream s, CUcontext *pctx)
{
    return cuStreamGetCtx(s, pctx);
}

/* CUDA 12.5+: also reports the green context (never one here) */
SIM_API CUresult cuStreamGetCtx_v2(CUstream s, CUcontext *pctx, void **green)
{
    if (!pctx && !green)
        return CUDA_ERROR_INVALID_VALUE;
    CUcontext c = NULL;
    CUresult rc = cuStreamGetCtx(s, &c);
    if (rc)
        return rc;
    if (pctx)
        *pctx = c;
    if (green)
        *green = NULL;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamGetCtx_v2_ptsz(CUstream s, CUcontext *pctx,
                                        void **green)
{
    return cuStreamGetCtx_v2(s, pctx, green);
}
