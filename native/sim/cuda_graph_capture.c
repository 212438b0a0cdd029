/*
 * cuda_graph_capture.c - stream capture.  cuStreamBeginCapture gives the
 * stream a new graph; kernels launched into a capturing stream are appended
 * to the capture graph instead of running (cuda_launch.c), and
 * cuMemAllocAsync / cuMemFreeAsync add memory nodes to it
 * (cuda_graph_mem.c); cuStreamEndCapture hands the graph over.
 *
 * Capture modes are enforced for the "potentially unsafe" calls
 * cuEventQuery and cuEventSynchronize, as CUDA documents them: a thread
 * whose interaction mode (cuThreadExchangeStreamCaptureMode) is GLOBAL may
 * not make them while another thread captures in GLOBAL mode, and a thread
 * in GLOBAL or THREAD_LOCAL mode may not while it captures itself in a
 * mode other than RELAXED; a thread in RELAXED mode always may.  Such a
 * call answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the
 * captures that forbade it (a watchdog thread's cudaEventQuery broke
 * PyTorch's graph captures so on a real driver: pytorch/pytorch#104555).
 * Captures of the per-thread default stream are left out of the rule.
 */
#include <stdatomic.h>

#include "sim.h"

static __thread CUstreamCaptureMode t_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
static __thread char t_me;                  /* its address names the thread */
static unsigned long long g_capture_ids;

/* The streams capturing now (sim_mu). */
#define MAX_CAPTURES 64
static struct CUstream_st *g_captures[MAX_CAPTURES];
/* How many of g_captures are set: with none, a query need not take sim_mu
 * (the SM meter polls events every 100 us; the lock slowed launches). */
static _Atomic int g_ncaptures;

static void captures_add_locked(struct CUstream_st *s)
{
    if (!sim_reg_has(s))
        return;                             /* a per-thread stream */
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (!g_captures[i]) {
            g_captures[i] = s;
            atomic_fetch_add(&g_ncaptures, 1);
            return;
        }
}

void sim_capture_forget_locked(struct CUstream_st *s)
{
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (g_captures[i] == s) {
            g_captures[i] = NULL;
            atomic_fetch_sub(&g_ncaptures, 1);
        }
}

int sim_capture_forbids(void)
{
    if (t_mode == CU_STREAM_CAPTURE_MODE_RELAXED || atomic_load(&g_ncaptures) == 0)
        return 0;
    int forbidden = 0;
    pthread_mutex_lock(&sim_mu);
    for (int i = 0; i < MAX_CAPTURES; i++) {
        struct CUstream_st *s = g_captures[i];
        if (!s || s->capture != CU_STREAM_CAPTURE_STATUS_ACTIVE)
            continue;
        int mine = s->cap_thread == &t_me;
        if ((mine && s->cap_mode != CU_STREAM_CAPTURE_MODE_RELAXED) ||
            (!mine && t_mode == CU_STREAM_CAPTURE_MODE_GLOBAL &&
             s->cap_mode == CU_STREAM_CAPTURE_MODE_GLOBAL)) {
            s->capture = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
            forbidden = 1;
        }
    }
    pthread_mutex_unlock(&sim_mu);
    return forbidden;
}

static CUresult begin_capture(CUstream hs, int mode, int ptsz)
{
    sim_sref r;
    int known = mode >= CU_STREAM_CAPTURE_MODE_GLOBAL && mode <= CU_STREAM_CAPTURE_MODE_RELAXED;
    SIM_TRY(sim_stream_call(known, hs, ptsz, &r));
    if (!r.s)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;   /* legacy stream */
    pthread_mutex_lock(&sim_mu);
    if (r.s->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    struct CUgraph_st *g = sim_graph_new();
    if (g) {
        r.s->cap_graph = g;
        r.s->cap_mode = mode;
        r.s->cap_id = ++g_capture_ids;
        r.s->cap_thread = &t_me;
        r.s->capture = CU_STREAM_CAPTURE_STATUS_ACTIVE;
        captures_add_locked(r.s);
    }
    pthread_mutex_unlock(&sim_mu);
    return g ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

SIM_API CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode)
{
    return begin_capture(s, (int)mode, 0);
}

SIM_API CUresult cuStreamBeginCapture_v2_ptsz(CUstream s,
                                              CUstreamCaptureMode mode)
{
    return begin_capture(s, (int)mode, 1);
}

SIM_API CUresult cuStreamBeginCapture(CUstream s)
{
    return begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL, 0);
}

SIM_API CUresult cuStreamBeginCapture_ptsz(CUstream s)
{
    return begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL, 1);
}

static CUresult end_capture(CUstream hs, CUgraph *pg, int ptsz)
{
    sim_sref r;
    SIM_TRY(sim_stream_call(pg != NULL, hs, ptsz, &r));
    if (!r.s)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&sim_mu);
    int st = r.s->capture;
    struct CUgraph_st *g = r.s->cap_graph;
    r.s->capture = CU_STREAM_CAPTURE_STATUS_NONE;
    r.s->cap_graph = NULL;
    sim_capture_forget_locked(r.s);
    if (st == CU_STREAM_CAPTURE_STATUS_INVALIDATED && g) {
        sim_graph_free(g);
        g = NULL;
    }
    pthread_mutex_unlock(&sim_mu);
    *pg = g;
    if (st == CU_STREAM_CAPTURE_STATUS_NONE)
        return CUDA_ERROR_ILLEGAL_STATE;
    if (st == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamEndCapture(CUstream s, CUgraph *pg)
{
    return end_capture(s, pg, 0);
}

SIM_API CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *pg)
{
    return end_capture(s, pg, 1);
}

static CUresult is_capturing(CUstream hs, CUstreamCaptureStatus *st, int ptsz)
{
    sim_sref r;
    SIM_TRY(sim_stream_call(st != NULL, hs, ptsz, &r));
    pthread_mutex_lock(&sim_mu);
    *st = r.s ? (CUstreamCaptureStatus)r.s->capture
              : CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st)
{
    return is_capturing(s, st, 0);
}

SIM_API CUresult cuStreamIsCapturing_ptsz(CUstream s,
                                          CUstreamCaptureStatus *st)
{
    return is_capturing(s, st, 1);
}

SIM_API CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    SIM_TRY(sim_check_init());
    if (!mode || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL ||
        *mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = t_mode;
    t_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}
