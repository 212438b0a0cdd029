/* hooks_array.c - CUDA arrays and mipmapped arrays. */
#include "hooks.h"

typedef CUresult (*arr_v2_fn)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
typedef CUresult (*arr_v1_fn)(CUarray *, const CUDA_ARRAY_DESCRIPTOR_v1 *);
typedef CUresult (*arr3d_v2_fn)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
typedef CUresult (*arr3d_v1_fn)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR_v1 *);
typedef CUresult (*arr_destroy_fn)(CUarray);
typedef CUresult (*mip_fn)(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int);
typedef CUresult (*mip_destroy_fn)(CUmipmappedArray);
typedef CUresult (*arr_req_fn)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, CUarray, CUdevice);
typedef CUresult (*mip_req_fn)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, CUmipmappedArray, CUdevice);

/* How a format stores texels: blocks of `block` x `block` texels (4 for
 * the block-compressed formats, whose Width and Height count texels) of
 * `bytes` each, those of the classic formats once per channel; NV12 adds
 * a half-height plane of interleaved U/V bytes.  A format not known here
 * is taken at 4 bytes a channel: under what the driver takes it is
 * charged the rest by the NVML reconciliation, over it never given back. */
typedef struct { unsigned block, bytes, per_channel, nv12; } texel_layout;

static texel_layout layout_of(CUarray_format f)
{
    switch ((int)f) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8:
        return (texel_layout){ 1, 1, 1, 0 };
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        return (texel_layout){ 1, 2, 1, 0 };
    case CU_AD_FORMAT_UNORM_INT8X1: case CU_AD_FORMAT_SNORM_INT8X1:
        return (texel_layout){ 1, 1, 0, 0 };
    case CU_AD_FORMAT_UNORM_INT8X2: case CU_AD_FORMAT_SNORM_INT8X2:
    case CU_AD_FORMAT_UNORM_INT16X1: case CU_AD_FORMAT_SNORM_INT16X1:
        return (texel_layout){ 1, 2, 0, 0 };
    case CU_AD_FORMAT_UNORM_INT8X4: case CU_AD_FORMAT_SNORM_INT8X4:
    case CU_AD_FORMAT_UNORM_INT16X2: case CU_AD_FORMAT_SNORM_INT16X2:
        return (texel_layout){ 1, 4, 0, 0 };
    case CU_AD_FORMAT_UNORM_INT16X4: case CU_AD_FORMAT_SNORM_INT16X4:
        return (texel_layout){ 1, 8, 0, 0 };
    case CU_AD_FORMAT_BC1_UNORM: case CU_AD_FORMAT_BC1_UNORM_SRGB:
    case CU_AD_FORMAT_BC4_UNORM: case CU_AD_FORMAT_BC4_SNORM:
        return (texel_layout){ 4, 8, 0, 0 };
    case CU_AD_FORMAT_BC2_UNORM: case CU_AD_FORMAT_BC2_UNORM_SRGB:
    case CU_AD_FORMAT_BC3_UNORM: case CU_AD_FORMAT_BC3_UNORM_SRGB:
    case CU_AD_FORMAT_BC5_UNORM: case CU_AD_FORMAT_BC5_SNORM:
    case CU_AD_FORMAT_BC6H_UF16: case CU_AD_FORMAT_BC6H_SF16:
    case CU_AD_FORMAT_BC7_UNORM: case CU_AD_FORMAT_BC7_UNORM_SRGB:
        return (texel_layout){ 4, 16, 0, 0 };
    case CU_AD_FORMAT_NV12:
        return (texel_layout){ 1, 1, 0, 1 };
    default:
        return (texel_layout){ 1, 4, 1, 0 };
    }
}

/* Bytes of a w x h x d array, rows padded to 512 bytes; 0 on overflow. */
static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, unsigned ch)
{
    texel_layout l = layout_of(f);
    uint64_t per = l.per_channel ? (uint64_t)l.bytes * (ch ? ch : 1) : l.bytes;
    uint64_t cols = w / l.block + (w % l.block != 0);
    if (cols && cols * per / cols != per)
        return 0;
    uint64_t row = gv_round_up(cols * per, 512);
    h = h ? h : 1;
    uint64_t rows = h / l.block + (h % l.block != 0);
    if (l.nv12)
        rows += h / 2 + h % 2;
    d = d ? d : 1;
    if (row && rows > UINT64_MAX / row)
        return 0;
    if (row != 0 && d > UINT64_MAX / (row * rows))
        return 0;
    return row * rows * d;
}

/* Reserve the estimate, create, then settle on the driver's own figure. */
static CUresult settle_array(gv_charge *c, CUarray a)
{
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    CUresult rc = GV_REAL(cuArrayGetMemoryRequirements, arr_req_fn)(&req, a, c->ordinal);
    if (rc == CUDA_SUCCESS && req.size > 0 && gv_charge_resize(c, req.size) != CUDA_SUCCESS) {
        GV_REAL(cuArrayDestroy, arr_destroy_fn)(a);
        gv_charge_cancel(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gv_charge_commit(c, GV_K_ARRAY, (uint64_t)(uintptr_t)a, 0);
    return CUDA_SUCCESS;
}

/* Sparse and deferred-mapping arrays take no memory when made: what is
 * mapped into them later comes from cuMemCreate handles, charged there. */
#define ARRAY_HOOK_BODY(real, call, estimate, flags)             \
    GV_ENFORCING_OR(call);                                       \
    if (!p || !desc || ((flags) & GV_ARRAY3D_UNBACKED))          \
        return call;                                             \
    uint64_t est = (estimate);                                   \
    if (est == 0)                                                \
        return call;     /* the driver rejects it */             \
    gv_charge c;                                                 \
    CUresult rc = gv_charge_begin_current(&c, est);              \
    if (rc != CUDA_SUCCESS)                                      \
        return rc;                                               \
    rc = call;                                                   \
    if (rc != CUDA_SUCCESS) {                                    \
        gv_charge_cancel(&c);                                    \
        return rc;                                               \
    }                                                            \
    return c.active ? settle_array(&c, *p) : rc

GV_EXPORT CUresult cuArrayCreate_v2(CUarray *p, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    arr_v2_fn real = GV_REAL(cuArrayCreate_v2, arr_v2_fn);
    ARRAY_HOOK_BODY(real, real(p, desc),
                    array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels), 0);
}

GV_EXPORT CUresult cuArrayCreate(CUarray *p, const CUDA_ARRAY_DESCRIPTOR_v1 *desc)
{
    arr_v1_fn real = GV_REAL(cuArrayCreate, arr_v1_fn);
    ARRAY_HOOK_BODY(real, real(p, desc),
                    array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels), 0);
}

GV_EXPORT CUresult cuArray3DCreate_v2(CUarray *p, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    arr3d_v2_fn real = GV_REAL(cuArray3DCreate_v2, arr3d_v2_fn);
    ARRAY_HOOK_BODY(real, real(p, desc),
                    array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format,
                                desc->NumChannels),
                    desc->Flags);
}

GV_EXPORT CUresult cuArray3DCreate(CUarray *p, const CUDA_ARRAY3D_DESCRIPTOR_v1 *desc)
{
    arr3d_v1_fn real = GV_REAL(cuArray3DCreate, arr3d_v1_fn);
    ARRAY_HOOK_BODY(real, real(p, desc),
                    array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format,
                                desc->NumChannels),
                    desc->Flags);
}

static CUresult destroy_array(uint64_t a, void *real)
{
    return ((arr_destroy_fn)real)((CUarray)(uintptr_t)a);
}

static CUresult destroy_mipmap(uint64_t a, void *real)
{
    return ((mip_destroy_fn)real)((CUmipmappedArray)(uintptr_t)a);
}

GV_EXPORT CUresult cuArrayDestroy(CUarray a)
{
    arr_destroy_fn real = GV_REAL(cuArrayDestroy, arr_destroy_fn);
    GV_ENFORCING_ELSE_PASS(real(a));
    CUresult rc;
    return gv_untrack(GV_K_ARRAY, (uint64_t)(uintptr_t)a, destroy_array, (void *)real, &rc) ? rc : real(a);
}

/* Every level halves each extent (never below 1), but for the depth of a
 * layered or cubemap array: it counts layers (faces), and every level has
 * all of them. */
static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels)
{
    uint64_t w = d->Width, h = d->Height, z = d->Depth, sum = 0;
    int layers = (d->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    /* The driver clamps the level count to 1 + floor(log2(max(width,
     * height, depth))), as CUDA documents: no more levels are made. */
    uint64_t big = w > h ? w : h;
    if (z > big)
        big = z;
    unsigned int full = 1;
    for (; big > 1; big >>= 1)
        full++;
    if (levels > full)
        levels = full;
    for (unsigned int i = 0; i < (levels ? levels : 1); i++) {
        uint64_t b = array_bytes(w, h, z, d->Format, d->NumChannels);
        if (b == 0 || sum > UINT64_MAX - b)
            return 0;
        sum += b;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        z = z > 1 && !layers ? z / 2 : z;
    }
    return sum;
}

GV_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *p, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                          unsigned int levels)
{
    mip_fn real = GV_REAL(cuMipmappedArrayCreate, mip_fn);
    GV_ENFORCING_OR(real(p, desc, levels));
    if (!p || !desc || (desc->Flags & GV_ARRAY3D_UNBACKED))
        return real(p, desc, levels);
    uint64_t est = mipmap_bytes(desc, levels);
    if (est == 0)
        return real(p, desc, levels);
    gv_charge c;
    CUresult rc = gv_charge_begin_current(&c, est);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(p, desc, levels);
    if (rc != CUDA_SUCCESS) {
        gv_charge_cancel(&c);
        return rc;
    }
    if (!c.active)
        return rc;
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    if (GV_REAL(cuMipmappedArrayGetMemoryRequirements, mip_req_fn)(&req, *p, c.ordinal) == CUDA_SUCCESS &&
        req.size > 0 && gv_charge_resize(&c, req.size) != CUDA_SUCCESS) {
        GV_REAL(cuMipmappedArrayDestroy, mip_destroy_fn)(*p);
        gv_charge_cancel(&c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gv_charge_commit(&c, GV_K_MIPMAP, (uint64_t)(uintptr_t)*p, 0);
    return CUDA_SUCCESS;
}

GV_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a)
{
    mip_destroy_fn real = GV_REAL(cuMipmappedArrayDestroy, mip_destroy_fn);
    GV_ENFORCING_ELSE_PASS(real(a));
    CUresult rc;
    return gv_untrack(GV_K_MIPMAP, (uint64_t)(uintptr_t)a, destroy_mipmap, (void *)real, &rc) ? rc : real(a);
}

const gv_hook gv_hooks_array[] = {
    { "cuArrayCreate", (void *)cuArrayCreate },
    { "cuArrayCreate_v2", (void *)cuArrayCreate_v2 },
    { "cuArray3DCreate", (void *)cuArray3DCreate },
    { "cuArray3DCreate_v2", (void *)cuArray3DCreate_v2 },
    { "cuArrayDestroy", (void *)cuArrayDestroy },
    { "cuMipmappedArrayCreate", (void *)cuMipmappedArrayCreate },
    { "cuMipmappedArrayDestroy", (void *)cuMipmappedArrayDestroy },
    { NULL, NULL }
};
