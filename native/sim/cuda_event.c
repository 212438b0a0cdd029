/*
 * cuda_event.c - events on the simulated timeline.  Recording an event
 * stores the time the work queued before it is done: its stream's work, and
 * the kernels other processes queued on the device before it (contexts
 * time-slice the device), or now when both are done; the event is complete
 * once the clock has passed that time.  cuStreamWaitEvent makes later work in a stream start
 * no earlier than the event.  Recording into a capturing stream records
 * nothing (the capture graph has kernel nodes only).  An event is recorded
 * only in a stream of its own context (CUDA_ERROR_INVALID_HANDLE otherwise);
 * any stream may wait for it.  Destroying an event's context (cuCtxDestroy,
 * a primary context's reset or its release to zero references) destroys
 * the event, as a real driver does: its handle is then unknown
 * (CUDA_ERROR_INVALID_HANDLE) and its memory freed, so a later event may
 * get the same address.
 */
#include <stdlib.h>

#include "sim.h"

#define EVENT_MAGIC 0x45564e54u

struct CUevent_st {
    uint32_t magic;
    struct CUctx_st *ctx;
    int ordinal;                        /* its context's device */
    unsigned flags;
    int recorded;
    int node;                           /* where it was recorded */
    uint64_t t;                         /* completion time, monotonic ns, or
                                         * a token in the time-slicing mode */
    struct CUevent_st *prev, *next;     /* every live event, under sim_mu */
};

static struct CUevent_st *g_events;

static void ev_link_locked(struct CUevent_st *e)
{
    e->prev = NULL;
    e->next = g_events;
    if (g_events)
        g_events->prev = e;
    g_events = e;
}

/* Forget e (sim_mu held): no call finds it from now on; free it after. */
static void ev_unlink_locked(struct CUevent_st *e)
{
    sim_reg_del(e);
    e->magic = 0;
    if (e->prev)
        e->prev->next = e->next;
    else
        g_events = e->next;
    if (e->next)
        e->next->prev = e->prev;
}

void sim_ctx_drop_events(struct CUctx_st *c)
{
    struct CUevent_st *gone = NULL;
    pthread_mutex_lock(&sim_mu);
    for (struct CUevent_st *e = g_events, *n; e; e = n) {
        n = e->next;
        if (e->ctx == c) {
            ev_unlink_locked(e);
            e->next = gone;
            gone = e;
        }
    }
    pthread_mutex_unlock(&sim_mu);
    for (struct CUevent_st *n; gone; gone = n) {
        n = gone->next;
        free(gone);
    }
}

/* validate under sim_mu */
static int ev_ok_locked(struct CUevent_st *e)
{
    return e && sim_reg_has(e) && e->magic == EVENT_MAGIC;
}

SIM_API CUresult cuEventCreate(CUevent *pe, unsigned int flags)
{
    struct CUctx_st *c;
    SIM_TRY(sim_current(&c));
    if (!pe || (flags & ~0xfu))
        return CUDA_ERROR_INVALID_VALUE;
    if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = EVENT_MAGIC;
    e->ctx = c;
    e->ordinal = c->ordinal;
    e->flags = flags;
    pthread_mutex_lock(&sim_mu);
    /* The context may have been destroyed since sim_current: the event
     * would outlive it. */
    int live = c->alive;
    if (live) {
        sim_reg_add(e);
        ev_link_locked(e);
    }
    pthread_mutex_unlock(&sim_mu);
    if (!live) {
        free(e);
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    }
    *pe = e;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventDestroy_v2(CUevent e)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    int ok = ev_ok_locked(e);
    if (ok)
        ev_unlink_locked(e);
    pthread_mutex_unlock(&sim_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_HANDLE;
    free(e);
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuEventDestroy, cuEventDestroy_v2);

static CUresult record(CUevent e, CUstream hs, unsigned flags, int ptsz)
{
    sim_sref r;
    SIM_TRY(sim_stream_call(!(flags & ~(unsigned)CU_EVENT_RECORD_EXTERNAL), hs, ptsz,
                                  &r));
    sim_record_delay();
    pthread_mutex_lock(&sim_mu);
    /* As CUDA documents: the event and the stream must be from the same
     * context, else CUDA_ERROR_INVALID_HANDLE. */
    if (!ev_ok_locked(e) || e->ctx != r.ctx) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (r.s && r.s->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_SUCCESS;
    }
    /* Streams of one context are independent queues, but contexts of
     * different processes time-slice the device: an event is reached once
     * its stream's earlier work is done and the device has finished what
     * other processes queued before it.  Time-slicing mode: a marker in
     * this process's queue, reached when the queue is resident. */
    e->node = r.ctx->node;
    if (sim_ts_us()) {
        uint64_t tok = sim_tl_marker(r.ctx->node);
        e->t = tok;
        e->recorded = 1;
        sim_sref_after_locked(&r, tok);
        pthread_mutex_unlock(&sim_mu);
        return CUDA_SUCCESS;
    }
    uint64_t t = sim_sref_ready_locked(&r), now = sim_now_ns();
    uint64_t others = sim_tl_others_until(r.ctx->node);
    if (t < now)
        t = now;
    if (t < others)
        t = others;
    e->t = t;
    e->recorded = 1;
    sim_sref_after_locked(&r, t);
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventRecord(CUevent e, CUstream s)
{
    return record(e, s, 0, 0);
}

SIM_API CUresult cuEventRecord_ptsz(CUevent e, CUstream s)
{
    return record(e, s, 0, 1);
}

SIM_API CUresult cuEventRecordWithFlags(CUevent e, CUstream s,
                                        unsigned int flags)
{
    return record(e, s, flags, 0);
}

SIM_API CUresult cuEventRecordWithFlags_ptsz(CUevent e, CUstream s,
                                             unsigned int flags)
{
    return record(e, s, flags, 1);
}

/* completion time or token of e (0: never recorded, complete), its device
 * ordinal and where it was recorded */
static CUresult ev_time(CUevent e, uint64_t *t, int *ordinal, int *node)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    int ok = ev_ok_locked(e);
    *t = ok && e->recorded ? e->t : 0;
    *ordinal = ok ? e->ordinal : -1;
    *node = ok ? e->node : -1;
    pthread_mutex_unlock(&sim_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

SIM_API CUresult cuEventQuery(CUevent e)
{
    uint64_t t;
    int ordinal, node;
    sim_event_query_delay();
    SIM_TRY(ev_time(e, &t, &ordinal, &node));
    if (sim_capture_forbids())
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return sim_tl_done(node, t) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_API CUresult cuEventSynchronize(CUevent e)
{
    uint64_t t;
    int ordinal, node;
    SIM_TRY(ev_time(e, &t, &ordinal, &node));
    if (sim_capture_forbids())
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    sim_tl_wait(node, t);
    sim_pools_sync(ordinal);         /* a synchronisation: pools give memory back */
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b)
{
    SIM_TRY(sim_check_args(!ms));
    pthread_mutex_lock(&sim_mu);
    int ok = ev_ok_locked(a) && ev_ok_locked(b);
    int timed = ok && !((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) &&
                a->recorded && b->recorded;
    uint64_t ta = timed ? a->t : 0, tb = timed ? b->t : 0;
    int na = timed ? a->node : -1, nb = timed ? b->node : -1;
    pthread_mutex_unlock(&sim_mu);
    if (!timed)
        return CUDA_ERROR_INVALID_HANDLE;
    if (sim_tl_stamp(na, ta, &ta) < 0 || sim_tl_stamp(nb, tb, &tb) < 0)
        return CUDA_ERROR_NOT_READY;
    *ms = (float)((double)((int64_t)(tb - ta)) / 1e6);
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuEventElapsedTime, cuEventElapsedTime_v2);

static CUresult wait_event(CUstream hs, CUevent e, unsigned flags, int ptsz)
{
    sim_sref r;
    /* flags: CU_EVENT_WAIT_EXTERNAL or none */
    SIM_TRY(sim_stream_call(!(flags & ~1u), hs, ptsz, &r));
    pthread_mutex_lock(&sim_mu);
    if (!ev_ok_locked(e)) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    int capturing = r.s && r.s->capture != CU_STREAM_CAPTURE_STATUS_NONE;
    /* Time-slicing mode: a token only orders work of its own queue, so a
     * wait on an event of another device waits here, on the host. */
    int host = sim_ts_us() && e->recorded && e->node != r.ctx->node;
    uint64_t t = e->t;
    int node = e->node;
    if (e->recorded && !capturing && !host)
        sim_sref_after_locked(&r, e->t);
    pthread_mutex_unlock(&sim_mu);
    if (host && !capturing)
        sim_tl_wait(node, t);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags)
{
    return wait_event(s, e, flags, 0);
}

SIM_API CUresult cuStreamWaitEvent_ptsz(CUstream s, CUevent e,
                                        unsigned int flags)
{
    return wait_event(s, e, flags, 1);
}
