/* hooks_memory.c - linear device memory: cuMemAlloc, Pitch, Managed, Free. */
#include "hooks.h"
#include "log.h"
#include "oversub.h"

typedef CUresult (*alloc_v2_fn)(CUdeviceptr *, size_t);
typedef CUresult (*alloc_v1_fn)(CUdeviceptr_v1 *, unsigned int);
typedef CUresult (*pitch_v2_fn)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
typedef CUresult (*pitch_v1_fn)(CUdeviceptr_v1 *, unsigned int *, unsigned int, unsigned int, unsigned int);
typedef CUresult (*managed_fn)(CUdeviceptr *, size_t, unsigned int);
typedef CUresult (*free_v2_fn)(CUdeviceptr);
typedef CUresult (*free_v1_fn)(CUdeviceptr_v1);

/* How an allocation hook starts: outside enforce mode, or when nothing is
 * asked for (no out pointer, no bytes: the driver's own error), the
 * driver's answer (passcall); else c charges bytes against the current
 * context before the driver is called, rc saying how that went. */
#define ALLOC_BEGIN(c, rc, passcall, nothing_asked, bytes)                    \
    GV_ENFORCING_OR(passcall);                                                 \
    if (nothing_asked)                                                         \
        return passcall;                                                       \
    gv_charge c;                                                               \
    CUresult rc = gv_charge_begin_current(&c, bytes)

/* Under CUDA_OVERSUBSCRIBE (oversub.c): the charge is made, then the
 * allocation goes to the device, to host memory, or both. */
static CUresult settle_spillable(gv_charge *c, CUresult rc, CUdeviceptr *dptr, uint64_t spilled)
{
    if (rc != CUDA_SUCCESS) {
        gv_charge_cancel(c);
        return rc;
    }
    gv_charge_commit_spilled(c, *dptr, spilled);
    return rc;
}

struct plain_args {
    alloc_v2_fn real;
    size_t bytes;
};

static CUresult plain_alloc(CUdeviceptr *dptr, void *arg)
{
    struct plain_args *a = arg;
    return a->real(dptr, a->bytes);
}

GV_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    alloc_v2_fn real = GV_REAL(cuMemAlloc_v2, alloc_v2_fn);
    ALLOC_BEGIN(c, rc, real(dptr, bytesize), !dptr || bytesize == 0, bytesize);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (c.active && gv_oversub_on()) {
        struct plain_args a = { real, bytesize };
        uint64_t spilled;
        rc = gv_oversub_alloc(&c, dptr, bytesize, &spilled, plain_alloc, &a, 0);
        return settle_spillable(&c, rc, dptr, spilled);
    }
    rc = real(dptr, bytesize);
    return gv_charge_settle(&c, rc, GV_K_PTR, rc == CUDA_SUCCESS ? *dptr : 0);
}

GV_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    alloc_v1_fn real = GV_REAL(cuMemAlloc, alloc_v1_fn);
    ALLOC_BEGIN(c, rc, real(dptr, bytesize), !dptr || bytesize == 0, bytesize);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize);
    return gv_charge_settle(&c, rc, GV_K_PTR, rc == CUDA_SUCCESS ? *dptr : 0);
}

/* What a quota refusal returns: out of memory, unless the driver would have
 * refused the call's arguments anyway (an element size other than 4, 8 or
 * 16; attach flags other than global or host), as it does without a quota.
 * The driver is not asked: the allocation would be made before the check. */
static CUresult refused(CUresult rc, int args_valid)
{
    return rc == CUDA_ERROR_OUT_OF_MEMORY && !args_valid ? CUDA_ERROR_INVALID_VALUE : rc;
}

static int pitch_elem_valid(unsigned int elem)
{
    return elem == 4 || elem == 8 || elem == 16;
}

/* Pitched allocations: reserve an estimate (rows padded to 512 bytes), then
 * settle on what the driver chose: pitch x height. */
static CUresult settle_pitch(gv_charge *c, CUresult rc, uint64_t pitch, uint64_t height,
                             CUdeviceptr ptr, free_v2_fn real_free)
{
    if (rc != CUDA_SUCCESS) {
        gv_charge_cancel(c);
        return rc;
    }
    if (!c->active)
        return rc;
    rc = gv_charge_resize(c, pitch * height);
    if (rc != CUDA_SUCCESS) {
        real_free(ptr);
        gv_charge_cancel(c);
        return rc;
    }
    gv_charge_commit(c, GV_K_PTR, ptr, 0);
    return CUDA_SUCCESS;
}

struct pitch_args {
    pitch_v2_fn real;
    size_t *pitch;
    size_t width, height;
    unsigned int elem;
};

static CUresult pitch_alloc(CUdeviceptr *dptr, void *arg)
{
    struct pitch_args *a = arg;
    return a->real(dptr, a->pitch, a->width, a->height, a->elem);
}

GV_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                      size_t height, unsigned int elem)
{
    pitch_v2_fn real = GV_REAL(cuMemAllocPitch_v2, pitch_v2_fn);
    GV_ENFORCING_OR(real(dptr, pitch, width, height, elem));
    if (!dptr || !pitch || width == 0 || height == 0)
        return real(dptr, pitch, width, height, elem);
    if (width > UINT64_MAX / height)
        return refused(CUDA_ERROR_OUT_OF_MEMORY, pitch_elem_valid(elem));
    gv_charge c;
    CUresult rc = gv_charge_begin_current(&c, gv_round_up(width, 512) * height);
    if (rc != CUDA_SUCCESS)
        return refused(rc, pitch_elem_valid(elem));
    if (c.active && gv_oversub_on()) {
        if (!pitch_elem_valid(elem)) {
            gv_charge_cancel(&c);
            return real(dptr, pitch, width, height, elem);
        }
        /* On the device, the driver's pitch; in host memory, rows padded
         * to 512 bytes, a multiple of every GPU's pitch alignment. */
        struct pitch_args a = { real, pitch, width, height, elem };
        uint64_t spilled;
        rc = gv_oversub_alloc(&c, dptr, gv_round_up(width, 512) * height, &spilled,
                              pitch_alloc, &a, 0);
        if (rc == CUDA_SUCCESS && spilled)
            *pitch = gv_round_up(width, 512);
        if (rc != CUDA_SUCCESS || spilled)
            return settle_spillable(&c, rc, dptr, spilled);
        return settle_pitch(&c, rc, *pitch, height, *dptr, GV_REAL(cuMemFree_v2, free_v2_fn));
    }
    rc = real(dptr, pitch, width, height, elem);
    return settle_pitch(&c, rc, rc == CUDA_SUCCESS ? *pitch : 0, height,
                        rc == CUDA_SUCCESS ? *dptr : 0, GV_REAL(cuMemFree_v2, free_v2_fn));
}

static CUresult free_v1_as_v2(CUdeviceptr p)
{
    return GV_REAL(cuMemFree, free_v1_fn)((CUdeviceptr_v1)p);
}

GV_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width,
                                   unsigned int height, unsigned int elem)
{
    pitch_v1_fn real = GV_REAL(cuMemAllocPitch, pitch_v1_fn);
    ALLOC_BEGIN(c, rc, real(dptr, pitch, width, height, elem),
                !dptr || !pitch || width == 0 || height == 0, gv_round_up(width, 512) * height);
    if (rc != CUDA_SUCCESS)
        return refused(rc, pitch_elem_valid(elem));
    rc = real(dptr, pitch, width, height, elem);
    return settle_pitch(&c, rc, rc == CUDA_SUCCESS ? *pitch : 0, height,
                        rc == CUDA_SUCCESS ? *dptr : 0, free_v1_as_v2);
}

GV_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    managed_fn real = GV_REAL(cuMemAllocManaged, managed_fn);
    /* Managed memory may live on the device: it counts against the quota. */
    ALLOC_BEGIN(c, rc, real(dptr, bytesize, flags), !dptr || bytesize == 0, bytesize);
    if (rc != CUDA_SUCCESS)
        return refused(rc, flags == CU_MEM_ATTACH_GLOBAL || flags == CU_MEM_ATTACH_HOST);
    if (c.active && gv_oversub_on() && (flags == CU_MEM_ATTACH_GLOBAL || flags == CU_MEM_ATTACH_HOST)) {
        uint64_t spilled;
        rc = gv_oversub_alloc(&c, dptr, bytesize, &spilled, NULL, NULL, flags);
        return settle_spillable(&c, rc, dptr, spilled);
    }
    rc = real(dptr, bytesize, flags);
    return gv_charge_settle(&c, rc, GV_K_PTR, rc == CUDA_SUCCESS ? *dptr : 0);
}

/* Frees: the entry leaves the table before the driver frees the address, so
 * a concurrent allocation that gets the same address back cannot collide. */
static CUresult call_free(uint64_t p, void *real)
{
    return ((CUresult (*)(CUdeviceptr))real)(p);
}

struct pool_free {
    CUdeviceptr p;
    CUresult (*real)(CUdeviceptr);
};

static CUresult call_pool_free(void *v)
{
    struct pool_free *f = v;
    return f->real(f->p);
}

static CUresult tracked_free(CUdeviceptr p, CUresult (*real)(CUdeviceptr))
{
    CUresult rc;
    if (gv_untrack(GV_K_PTR, p, call_free, (void *)real, &rc))
        return rc;
    if (gv_untrack(GV_K_SPILL, p, call_free, (void *)real, &rc))
        return rc;
    struct pool_free f = { p, real };
    if (gv_pool_free_block(p, call_pool_free, &f, &rc))
        return rc;
    if (gv_graph_free_alloc(p, call_pool_free, &f, &rc))
        return rc;
    return real(p);     /* not ours: untouched */
}

GV_EXPORT CUresult cuMemFree_v2(CUdeviceptr p)
{
    free_v2_fn real = GV_REAL(cuMemFree_v2, free_v2_fn);
    GV_ENFORCING_ELSE_PASS(real(p));
    return tracked_free(p, real);
}

GV_EXPORT CUresult cuMemFree(CUdeviceptr_v1 p)
{
    GV_ENFORCING_ELSE_PASS(GV_REAL(cuMemFree, free_v1_fn)(p));
    return tracked_free(p, free_v1_as_v2);
}

const gv_hook gv_hooks_memory[] = {
    { "cuMemAlloc", (void *)cuMemAlloc },
    { "cuMemAlloc_v2", (void *)cuMemAlloc_v2 },
    { "cuMemAllocPitch", (void *)cuMemAllocPitch },
    { "cuMemAllocPitch_v2", (void *)cuMemAllocPitch_v2 },
    { "cuMemAllocManaged", (void *)cuMemAllocManaged },
    { "cuMemFree", (void *)cuMemFree },
    { "cuMemFree_v2", (void *)cuMemFree_v2 },
    { NULL, NULL }
};
