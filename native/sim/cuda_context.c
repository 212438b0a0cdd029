/*
 * cuda_context.c - contexts: created contexts, primary contexts and the
 * per-thread current-context stack.  Every live context charges its
 * device's ctx size to this process's physical usage.  Context objects are
 * never freed (a destroyed one stays "dead"), so stale handles held by
 * other threads fail cleanly instead of touching freed memory.
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

#define STACK_MAX 64
static __thread struct CUctx_st *t_stack[STACK_MAX];
static __thread int t_depth;
static struct CUctx_st g_primary[SIM_MAX_DEV];   /* by CUDA ordinal */
static pthread_mutex_t g_prim_mu = PTHREAD_MUTEX_INITIALIZER;

/* 0: not a context; 1: a context destroyed (or a primary context released
 * to zero); 2: a live context. */
static int ctx_state(struct CUctx_st *c)
{
    pthread_mutex_lock(&sim_mu);
    int known = c && sim_reg_has(c) && c->magic == SIM_CTX_MAGIC;
    int state = known ? 1 + (c->alive != 0) : 0;
    pthread_mutex_unlock(&sim_mu);
    return state;
}

int sim_ctx_valid(struct CUctx_st *c) { return ctx_state(c) == 2; }

CUresult sim_current(struct CUctx_st **out)
{
    SIM_TRY(sim_check_init());
    struct CUctx_st *c = t_depth ? t_stack[t_depth - 1] : NULL;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    /* A context destroyed by another thread stays current here, and a
     * primary context released to zero stays current until retained
     * again: using either is CUDA_ERROR_CONTEXT_IS_DESTROYED, as CUDA
     * documents for cuCtxDestroy. */
    int state = ctx_state(c);
    if (state != 2)
        return state ? CUDA_ERROR_CONTEXT_IS_DESTROYED : CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

static void drop_from_stack(struct CUctx_st *c)
{
    for (int i = 0; i < t_depth; i++)
        if (t_stack[i] == c) {
            memmove(&t_stack[i], &t_stack[i + 1],
                    (size_t)(t_depth - i - 1) * sizeof t_stack[0]);
            t_depth--;
            i--;
        }
}

/* cuCtxSetLimit's defaults (the context's own memory covers them) */
static const uint64_t g_limit_default[7] = {1024, SIM_MIB, 8 * SIM_MIB, 2, 2048, 32, 0};

/* charge and mark alive; caller fills ordinal/node */
static CUresult ctx_activate(struct CUctx_st *c)
{
    uint64_t sz = sim_dev(c->node)->ctx_size;
    if (sz && sim_charge(c->node, sz) < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&sim_mu);
    c->charged = sz;
    c->epoch++;
    memcpy(c->limit, g_limit_default, sizeof c->limit);
    c->magic = SIM_CTX_MAGIC;
    c->alive = 1;
    if (!sim_reg_has(c))
        sim_reg_add(c);
    pthread_mutex_unlock(&sim_mu);
    sim_ctx_create_delay();
    return CUDA_SUCCESS;
}

static void ctx_deactivate(struct CUctx_st *c)
{
    pthread_mutex_lock(&sim_mu);
    int was = c->alive;
    c->alive = 0;
    uint64_t ch = c->charged;
    c->charged = 0;
    pthread_mutex_unlock(&sim_mu);
    if (!was)
        return;
    sim_ctx_drop_events(c);
    sim_ctx_release_allocs(c);
    sim_uncharge(c->node, ch);
}

/* Device memory a limit takes beyond its default: the stack for every
 * thread the device can hold (2048 per SM), the printf FIFO, the heap, and
 * the device runtime's buffer of pending launches (SIM_PENDING_LAUNCH_BYTES
 * a launch, a model: CUDA documents that the buffer is device memory set
 * aside, not its size per launch). */
#define SIM_PENDING_LAUNCH_BYTES 1024ULL
static uint64_t limit_bytes(const struct CUctx_st *c, int which, uint64_t v)
{
    uint64_t d = g_limit_default[which];
    int takes = which <= CU_LIMIT_MALLOC_HEAP_SIZE ||
                which == CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT;
    if (!takes || v <= d)
        return 0;
    uint64_t per = which == CU_LIMIT_STACK_SIZE ? 2048ULL * (uint64_t)sim_dev(c->node)->sms
                 : which == CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT ? SIM_PENDING_LAUNCH_BYTES
                 : 1;
    if (v - d > UINT64_MAX / 2 / per)
        return UINT64_MAX / 2;
    return sim_round_up((v - d) * per, SIM_GRAN);
}

SIM_API CUresult cuCtxSetLimit(CUlimit which, size_t value)
{
    struct CUctx_st *c;
    SIM_TRY(sim_current(&c));
    if ((int)which < 0 || which > CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    pthread_mutex_lock(&sim_mu);
    uint64_t old = limit_bytes(c, which, c->limit[which]);
    uint64_t now = limit_bytes(c, which, value);
    if (now > old && sim_charge(c->node, now - old) < 0) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (now < old)
        sim_uncharge(c->node, old - now);
    c->charged = c->charged - old + now;
    c->limit[which] = value;
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetLimit(size_t *value, CUlimit which)
{
    struct CUctx_st *c;
    SIM_TRY(sim_current(&c));
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    if ((int)which < 0 || which > CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    pthread_mutex_lock(&sim_mu);
    *value = c->limit[which];
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

CUresult sim_ctx_or_current(CUcontext ctx, int out_ok, struct CUctx_st **c)
{
    *c = ctx;
    SIM_TRY(ctx ? sim_check_init() : sim_current(c));
    if (!out_ok)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_ctx_valid(*c) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

SIM_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags,
                                CUdevice dev)
{
    int node;
    CUresult rc = sim_check_dev(pctx != NULL, dev, &node);
    if (rc)
        return rc;
    struct CUctx_st *c = calloc(1, sizeof *c);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->ordinal = dev;
    c->node = node;
    c->flags = flags;
    rc = ctx_activate(c);
    if (rc) {
        free(c);
        return rc;
    }
    if (t_depth < STACK_MAX)
        t_stack[t_depth++] = c;
    *pctx = c;
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuCtxCreate, cuCtxCreate_v2);

SIM_API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *p,
                                int n, unsigned int flags, CUdevice dev)
{
    if (n < 0 || (n > 0 && !p))
        return CUDA_ERROR_INVALID_VALUE;
    return cuCtxCreate_v2(pctx, flags, dev);
}

SIM_API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *p,
                                unsigned int flags, CUdevice dev)
{
    if (p && p->numExecAffinityParams < 0)
        return CUDA_ERROR_INVALID_VALUE;
    return cuCtxCreate_v2(pctx, flags, dev);
}

SIM_API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    SIM_TRY(sim_check_init());
    if (!sim_ctx_valid(ctx) || ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    drop_from_stack(ctx);
    ctx_deactivate(ctx);
    sim_free_delay();
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuCtxDestroy, cuCtxDestroy_v2);

SIM_API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    SIM_TRY(sim_check_args(!pctx));
    *pctx = t_depth ? t_stack[t_depth - 1] : NULL;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    SIM_TRY(sim_check_init());
    if (!ctx) {
        if (t_depth)
            t_depth--;
        return CUDA_SUCCESS;
    }
    if (!sim_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth)
        t_stack[t_depth - 1] = ctx;
    else
        t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    SIM_TRY(sim_check_init());
    if (!sim_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth >= STACK_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuCtxPushCurrent, cuCtxPushCurrent_v2);

SIM_API CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    SIM_TRY(sim_check_init());
    if (!t_depth)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *c = t_stack[--t_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuCtxPopCurrent, cuCtxPopCurrent_v2);

/* CUDA 13 form: explicit context, NULL = current */
SIM_API CUresult cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx)
{
    struct CUctx_st *c;
    SIM_TRY(sim_ctx_or_current(ctx, dev != NULL, &c));
    *dev = c->ordinal;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetDevice(CUdevice *dev)
{
    return cuCtxGetDevice_v2(dev, NULL);
}

SIM_API CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    struct CUctx_st *c;
    SIM_TRY(sim_ctx_or_current(ctx, 1, &c));
    sim_ctx_sync_wait(c);               /* every stream's queued work */
    sim_pools_sync(c->ordinal);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxSynchronize(void)
{
    return cuCtxSynchronize_v2(NULL);
}

SIM_API CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *v)
{
    struct CUctx_st *c;
    SIM_TRY(sim_ctx_or_current(ctx, v != NULL, &c));
    *v = 3020;
    return CUDA_SUCCESS;
}

/* ---- primary contexts ------------------------------------------------ */

SIM_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    int node;
    CUresult rc = sim_check_dev(pctx != NULL, dev, &node);
    if (rc)
        return rc;
    struct CUctx_st *c = &g_primary[dev];
    pthread_mutex_lock(&g_prim_mu);
    if (!c->alive) {        /* first retain, or the first after a reset */
        c->ordinal = dev;
        c->node = node;
        c->primary = 1;
        rc = ctx_activate(c);
    }
    if (rc == CUDA_SUCCESS)
        c->refcount++;
    pthread_mutex_unlock(&g_prim_mu);
    if (rc)
        return rc;
    *pctx = c;
    return CUDA_SUCCESS;
}

/* Ends primary context c's life when end (release and reset); releases
 * g_prim_mu, which the caller holds. */
static CUresult prim_end_unlock(struct CUctx_st *c, int end)
{
    if (end)
        ctx_deactivate(c);
    pthread_mutex_unlock(&g_prim_mu);
    if (end)
        sim_free_delay();
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    SIM_TRY(sim_check_dev(1, dev, NULL));
    struct CUctx_st *c = &g_primary[dev];
    pthread_mutex_lock(&g_prim_mu);
    if (c->refcount <= 0) {
        pthread_mutex_unlock(&g_prim_mu);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    return prim_end_unlock(c, --c->refcount == 0 && c->alive);
}

SIM_ALIAS(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2);

SIM_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    SIM_TRY(sim_check_dev(1, dev, NULL));
    /* As CUDA: resetting does not release; each retain still takes its
     * release (also after the reset), and the next retain makes it anew. */
    struct CUctx_st *c = &g_primary[dev];
    pthread_mutex_lock(&g_prim_mu);
    return prim_end_unlock(c, c->alive);
}

SIM_ALIAS(cuDevicePrimaryCtxReset, cuDevicePrimaryCtxReset_v2);

SIM_API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags,
                                            int *active)
{
    SIM_TRY(sim_check_dev(1, dev, NULL));
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    *flags = g_primary[dev].flags;
    *active = g_primary[dev].alive;
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int fl)
{
    SIM_TRY(sim_check_dev(1, dev, NULL));
    pthread_mutex_lock(&sim_mu);
    g_primary[dev].flags = fl;
    pthread_mutex_unlock(&sim_mu);
    return CUDA_SUCCESS;
}

SIM_ALIAS(cuDevicePrimaryCtxSetFlags, cuDevicePrimaryCtxSetFlags_v2);
