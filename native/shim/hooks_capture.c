/*
 * hooks_capture.c - stream capture: which captures this process has begun.
 *
 * A kernel launched into a capturing stream is recorded into a graph, not
 * run: the SM gate leaves it alone (sm_meter.c, gv_sm_begin).  Asking the
 * driver (cuStreamIsCapturing) at every gated launch cost about 390
 * instructions per launch on the simulated driver (make bench), for a
 * question whose answer is "no" in every process that never captures.  So
 * every way to begin a capture (cuStreamBeginCapture and its _v2, _ptsz
 * and ToGraph variants) counts it here, before the driver's call, and the
 * gate asks the driver only while the count is not 0.
 *
 * The count is of captures begun and not seen to end: cuStreamEndCapture
 * takes one off when its stream was capturing before the call and is not
 * after it (whatever it answered: an invalidated capture ends too).  A
 * capture that ends any other way (its stream destroyed while capturing)
 * stays counted, and the gate goes on asking: the safe side.  A forked
 * child keeps its parent's count (the safe side too).
 *
 * A capture cannot begin unseen: the library is preloaded before the
 * program's first instruction, and each path to the driver's entry points
 * (the exported symbol, dlsym, cuGetProcAddress; dispatch.c) gives these
 * hooks.
 */
#include <stdatomic.h>

#include "hooks.h"
#include "sm.h"

atomic_uint gv_sm_captures;

typedef CUresult (*begin_v1_fn)(CUstream);
typedef CUresult (*begin_v2_fn)(CUstream, CUstreamCaptureMode);
typedef CUresult (*begin_graph_fn)(CUstream, CUgraph, const CUgraphNode *,
                                   const CUgraphEdgeData *, size_t, CUstreamCaptureMode);
typedef CUresult (*end_fn)(CUstream, CUgraph *);
typedef CUresult (*capturing_fn)(CUstream, CUstreamCaptureStatus *);

static void counted(void)
{
    atomic_fetch_add(&gv_sm_captures, 1);
    gv_sm_segments_end();
}

static void uncounted(void)
{
    unsigned n = atomic_load(&gv_sm_captures);
    while (n && !atomic_compare_exchange_weak(&gv_sm_captures, &n, n - 1))
        ;
}

/* Counted before the driver's call, so that no launch finds a capture in
 * progress uncounted; taken off again if it did not begin. */
static CUresult begun(CUresult rc)
{
    if (rc != CUDA_SUCCESS)
        uncounted();
    return rc;
}

GV_EXPORT CUresult cuStreamBeginCapture(CUstream s)
{
    counted();
    return begun(GV_REAL(cuStreamBeginCapture, begin_v1_fn)(s));
}

GV_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream s)
{
    counted();
    return begun(GV_REAL(cuStreamBeginCapture_ptsz, begin_v1_fn)(s));
}

GV_EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode)
{
    counted();
    return begun(GV_REAL(cuStreamBeginCapture_v2, begin_v2_fn)(s, mode));
}

GV_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode)
{
    counted();
    return begun(GV_REAL(cuStreamBeginCapture_v2_ptsz, begin_v2_fn)(s, mode));
}

GV_EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode *deps,
                                               const CUgraphEdgeData *data, size_t n,
                                               CUstreamCaptureMode mode)
{
    counted();
    return begun(GV_REAL(cuStreamBeginCaptureToGraph, begin_graph_fn)(s, g, deps, data, n, mode));
}

GV_EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph g,
                                                    const CUgraphNode *deps,
                                                    const CUgraphEdgeData *data, size_t n,
                                                    CUstreamCaptureMode mode)
{
    counted();
    return begun(
        GV_REAL(cuStreamBeginCaptureToGraph_ptsz, begin_graph_fn)(s, g, deps, data, n, mode));
}

static CUresult end_capture(end_fn real, capturing_fn query, CUstream s, CUgraph *g)
{
    CUstreamCaptureStatus before = CU_STREAM_CAPTURE_STATUS_NONE, after;
    int was = query(s, &before) == CUDA_SUCCESS && before != CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult rc = real(s, g);
    if (was && query(s, &after) == CUDA_SUCCESS && after == CU_STREAM_CAPTURE_STATUS_NONE)
        uncounted();
    return rc;
}

GV_EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *g)
{
    return end_capture(GV_REAL(cuStreamEndCapture, end_fn),
                       GV_REAL(cuStreamIsCapturing, capturing_fn), s, g);
}

GV_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *g)
{
    return end_capture(GV_REAL(cuStreamEndCapture_ptsz, end_fn),
                       GV_REAL(cuStreamIsCapturing_ptsz, capturing_fn), s, g);
}

const gv_hook gv_hooks_capture[] = {
    { "cuStreamBeginCapture", (void *)cuStreamBeginCapture },
    { "cuStreamBeginCapture_ptsz", (void *)cuStreamBeginCapture_ptsz },
    { "cuStreamBeginCapture_v2", (void *)cuStreamBeginCapture_v2 },
    { "cuStreamBeginCapture_v2_ptsz", (void *)cuStreamBeginCapture_v2_ptsz },
    { "cuStreamBeginCaptureToGraph", (void *)cuStreamBeginCaptureToGraph },
    { "cuStreamBeginCaptureToGraph_ptsz", (void *)cuStreamBeginCaptureToGraph_ptsz },
    { "cuStreamEndCapture", (void *)cuStreamEndCapture },
    { "cuStreamEndCapture_ptsz", (void *)cuStreamEndCapture_ptsz },
    { NULL, NULL }
};
