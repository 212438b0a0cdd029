/*
 * cuda_stream.c - streams.  A stream belongs to the context current when
 * it was created.  Its state on the kernel timeline is one number, the
 * completion time of the work queued in it so far (ready); queries compare
 * it with the clock and synchronize sleeps until it (cuda_launch.c queues
 * the work).  In the time-slicing mode the number is a token of the
 * process's queue instead, and sim_tl_done / sim_tl_wait answer.  A synchronize is also where memory pools give memory back
 * (sim_pools_sync).
 *
 * Default streams: the legacy stream (NULL, CU_STREAM_LEGACY) is per
 * context and waits for all blocking streams, which in turn wait for it
 * (ctx->legacy_end / blocking_end); the per-thread stream
 * (CU_STREAM_PER_THREAD, or NULL through a _ptsz entry point) is a
 * thread-local blocking stream per context.
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

#define STREAM_MAGIC 0x5354524du
#define PT_SLOTS 8

static __thread struct CUstream_st t_pt[PT_SLOTS];
static __thread unsigned t_pt_next;

static struct CUstream_st *per_thread(struct CUctx_st *c)
{
    for (int i = 0; i < PT_SLOTS; i++)
        if (t_pt[i].ctx == c && t_pt[i].magic == STREAM_MAGIC)
            return &t_pt[i];
    struct CUstream_st *s = &t_pt[t_pt_next++ % PT_SLOTS];
    memset(s, 0, sizeof *s);
    s->magic = STREAM_MAGIC;
    s->ctx = c;
    return s;
}

CUresult sim_stream_ref(CUstream h, int ptsz, sim_sref *out)
{
    if (h == NULL && ptsz)
        h = GV_CU_STREAM_PER_THREAD;
    struct CUctx_st *c;
    SIM_TRY(sim_stream_ctx(h, &c));
    out->ctx = c;
    if (h == NULL || h == GV_CU_STREAM_LEGACY)
        out->s = NULL;
    else if (h == GV_CU_STREAM_PER_THREAD)
        out->s = per_thread(c);
    else
        out->s = h;
    return CUDA_SUCCESS;
}

CUresult sim_stream_call(int args_ok, CUstream h, int ptsz, sim_sref *out)
{
    SIM_TRY(sim_check_args(!args_ok));
    return sim_stream_ref(h, ptsz, out);
}

static uint64_t max64(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
}

uint64_t sim_sref_ready_locked(const sim_sref *r)
{
    if (!r->s)
        return r->ctx->blocking_end;
    if (r->s->flags & CU_STREAM_NON_BLOCKING)
        return r->s->ready;
    return max64(r->s->ready, r->ctx->legacy_end);
}

void sim_sref_after_locked(const sim_sref *r, uint64_t t)
{
    struct CUctx_st *c = r->ctx;
    if (!r->s) {
        c->legacy_end = max64(c->legacy_end, t);
        c->blocking_end = max64(c->blocking_end, t);
    } else {
        r->s->ready = max64(r->s->ready, t);
        if (!(r->s->flags & CU_STREAM_NON_BLOCKING))
            c->blocking_end = max64(c->blocking_end, t);
    }
    c->all_end = max64(c->all_end, t);
}

/* capturing streams cannot be synchronized or queried: the capture is
 * invalidated, as on a GPU */
static int capture_violation(const sim_sref *r)
{
    int bad = 0;
    pthread_mutex_lock(&sim_mu);
    if (r->s && r->s->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
        r->s->capture = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
        bad = 1;
    }
    pthread_mutex_unlock(&sim_mu);
    return bad;
}

CUresult sim_sref_sync(const sim_sref *r)
{
    if (capture_violation(r))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    pthread_mutex_lock(&sim_mu);
    uint64_t t = sim_sref_ready_locked(r);
    int node = r->ctx->node;
    pthread_mutex_unlock(&sim_mu);
    sim_tl_wait(node, t);
    return CUDA_SUCCESS;
}

static int is_special(CUstream s)
{
    return s == NULL || s == GV_CU_STREAM_LEGACY || s == GV_CU_STREAM_PER_THREAD;
}

CUresult sim_stream_ctx(CUstream s, struct CUctx_st **out)
{
    if (is_special(s))
        return sim_current(out);
    SIM_TRY(sim_check_init());
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
    SIM_TRY(sim_current(&c));
    if (!ps || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    if (prio > 0)
        prio = 0;                       /* clamped to [-5, 0] like a GPU */
    if (prio < -5)
        prio = -5;
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
    SIM_TRY(sim_check_init());
    if (is_special(s))
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&sim_mu);
    int ok = sim_reg_has(s) && s->magic == STREAM_MAGIC;
    if (ok) {
        sim_reg_del(s);
        sim_capture_forget_locked(s);
        s->magic = 0;
        if (s->cap_graph)
            sim_graph_free(s->cap_graph);
    }
    pthread_mutex_unlock(&sim_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_HANDLE;
    /* queued work still completes (it holds its slot on the device) */
    free(s);
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuStreamDestroy, cuStreamDestroy_v2);

static CUresult stream_sync(CUstream s, int ptsz)
{
    sim_sref r;
    CUresult rc = sim_stream_ref(s, ptsz, &r);
    if (rc)
        return rc;
    rc = sim_sref_sync(&r);
    if (rc)
        return rc;
    sim_pools_sync(r.ctx->ordinal);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamSynchronize(CUstream s)
{
    return stream_sync(s, 0);
}

SIM_API CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    return stream_sync(s, 1);
}

static CUresult stream_query(CUstream s, int ptsz)
{
    sim_sref r;
    SIM_TRY(sim_stream_ref(s, ptsz, &r));
    if (capture_violation(&r))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    pthread_mutex_lock(&sim_mu);
    uint64_t t = sim_sref_ready_locked(&r);
    int node = r.ctx->node;
    pthread_mutex_unlock(&sim_mu);
    return sim_tl_done(node, t) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_API CUresult cuStreamQuery(CUstream s)
{
    return stream_query(s, 0);
}

SIM_API CUresult cuStreamQuery_ptsz(CUstream s)
{
    return stream_query(s, 1);
}

static CUresult stream_flags(CUstream s, int ptsz, unsigned *flags, int *prio)
{
    sim_sref r;
    SIM_TRY(sim_stream_ref(s, ptsz, &r));
    if (flags)
        *flags = r.s ? r.s->flags : 0;
    if (prio)
        *prio = r.s ? r.s->priority : 0;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamGetFlags(CUstream s, unsigned int *flags)
{
    return flags ? stream_flags(s, 0, flags, NULL) : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuStreamGetFlags_ptsz(CUstream s, unsigned int *flags)
{
    return flags ? stream_flags(s, 1, flags, NULL) : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuStreamGetPriority(CUstream s, int *prio)
{
    return prio ? stream_flags(s, 0, NULL, prio) : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuStreamGetPriority_ptsz(CUstream s, int *prio)
{
    return prio ? stream_flags(s, 1, NULL, prio) : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
    SIM_TRY(sim_check_init());
    if (least)
        *least = 0;
    if (greatest)
        *greatest = -5;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamGetCtx(CUstream s, CUcontext *pctx)
{
    struct CUctx_st *c;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_TRY(sim_stream_ctx(s, &c));
    *pctx = c;
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuStreamGetCtx_ptsz, cuStreamGetCtx);

/* CUDA 12.5+: also reports the green context (never one here) */
SIM_API CUresult cuStreamGetCtx_v2(CUstream s, CUcontext *pctx, void **green)
{
    if (!pctx && !green)
        return CUDA_ERROR_INVALID_VALUE;
    CUcontext c = NULL;
    SIM_TRY(cuStreamGetCtx(s, &c));
    if (pctx)
        *pctx = c;
    if (green)
        *green = NULL;
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuStreamGetCtx_v2_ptsz, cuStreamGetCtx_v2);
