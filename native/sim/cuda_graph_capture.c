/*
 * cuda_graph_capture.c - stream capture.  cuStreamBeginCapture gives the
 * stream a new graph; kernels launched into a capturing stream are appended
 * to the capture graph instead of running (cuda_launch.c), and
 * cuMemAllocAsync / cuMemFreeAsync add memory nodes to it
 * (cuda_graph_mem.c); cuStreamEndCapture hands the graph over.
 */
#include "sim.h"

static __thread CUstreamCaptureMode t_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
static unsigned long long g_capture_ids;

static CUresult begin_capture(CUstream hs, int mode, int ptsz)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (mode < CU_STREAM_CAPTURE_MODE_GLOBAL ||
        mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    sim_sref r;
    rc = sim_stream_ref(hs, ptsz, &r);
    if (rc)
        return rc;
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
        r.s->capture = CU_STREAM_CAPTURE_STATUS_ACTIVE;
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
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!pg)
        return CUDA_ERROR_INVALID_VALUE;
    sim_sref r;
    rc = sim_stream_ref(hs, ptsz, &r);
    if (rc)
        return rc;
    if (!r.s)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&sim_mu);
    int st = r.s->capture;
    struct CUgraph_st *g = r.s->cap_graph;
    r.s->capture = CU_STREAM_CAPTURE_STATUS_NONE;
    r.s->cap_graph = NULL;
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
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!st)
        return CUDA_ERROR_INVALID_VALUE;
    sim_sref r;
    rc = sim_stream_ref(hs, ptsz, &r);
    if (rc)
        return rc;
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
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!mode || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL ||
        *mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = t_mode;
    t_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}
