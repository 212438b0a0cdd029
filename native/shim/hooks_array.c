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

/* How a format stores texels: up to three planes, each holding `bytes`
 * for every group of `across` x `down` texels, its rows padded to 512
 * bytes.  The classic formats take `bytes` once per channel (per_channel);
 * the others name their element size: the normalized ones their channel
 * count, the block-compressed ones 4x4-texel blocks of 8 or 16 bytes (their
 * Width and Height count texels).  The YUV formats are laid out as their
 * FOURCC names define them, 10-bit samples held in 16 bits: semi-planar, a
 * Y plane and a plane of interleaved U/V pairs (one pair for every 2x2
 * texels in 4:2:0, 2x1 in 4:2:2, 1x1 in 4:4:4); planar, separate U and V
 * planes; packed 4:2:2, Y0 U Y1 V for every two texels.  A format not known
 * here is taken at 4 bytes a channel: under what the driver takes it is
 * charged the rest by the NVML reconciliation, over it never given back. */
typedef struct { unsigned char bytes, across, down; } plane;
typedef struct { unsigned char per_channel; plane p[3]; } texel_layout;

#define L_CHANNEL(b) ((texel_layout){ 1, { { b, 1, 1 } } })
#define L_TEXEL(b) ((texel_layout){ 0, { { b, 1, 1 } } })
#define L_BLOCK(b) ((texel_layout){ 0, { { b, 4, 4 } } })
#define L_PACKED422(s) ((texel_layout){ 0, { { 4 * (s), 2, 1 } } })
#define L_SEMI(s, a, d) ((texel_layout){ 0, { { s, 1, 1 }, { 2 * (s), a, d } } })
#define L_PLANAR(s, a, d) ((texel_layout){ 0, { { s, 1, 1 }, { s, a, d }, { s, a, d } } })

static texel_layout layout_of(CUarray_format f)
{
    switch ((int)f) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8:
        return L_CHANNEL(1);
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        return L_CHANNEL(2);
    case CU_AD_FORMAT_UNORM_INT8X1: case CU_AD_FORMAT_SNORM_INT8X1:
        return L_TEXEL(1);
    case CU_AD_FORMAT_UNORM_INT8X2: case CU_AD_FORMAT_SNORM_INT8X2:
    case CU_AD_FORMAT_UNORM_INT16X1: case CU_AD_FORMAT_SNORM_INT16X1:
        return L_TEXEL(2);
    case CU_AD_FORMAT_UNORM_INT8X4: case CU_AD_FORMAT_SNORM_INT8X4:
    case CU_AD_FORMAT_UNORM_INT16X2: case CU_AD_FORMAT_SNORM_INT16X2:
    case CU_AD_FORMAT_UNORM_INT_101010_2: case CU_AD_FORMAT_UINT8_PACKED_444:
    case CU_AD_FORMAT_AYUV: case CU_AD_FORMAT_Y410:
        return L_TEXEL(4);
    case CU_AD_FORMAT_UNORM_INT16X4: case CU_AD_FORMAT_SNORM_INT16X4:
    case CU_AD_FORMAT_Y416:
        return L_TEXEL(8);
    case CU_AD_FORMAT_BC1_UNORM: case CU_AD_FORMAT_BC1_UNORM_SRGB:
    case CU_AD_FORMAT_BC4_UNORM: case CU_AD_FORMAT_BC4_SNORM:
        return L_BLOCK(8);
    case CU_AD_FORMAT_BC2_UNORM: case CU_AD_FORMAT_BC2_UNORM_SRGB:
    case CU_AD_FORMAT_BC3_UNORM: case CU_AD_FORMAT_BC3_UNORM_SRGB:
    case CU_AD_FORMAT_BC5_UNORM: case CU_AD_FORMAT_BC5_SNORM:
    case CU_AD_FORMAT_BC6H_UF16: case CU_AD_FORMAT_BC6H_SF16:
    case CU_AD_FORMAT_BC7_UNORM: case CU_AD_FORMAT_BC7_UNORM_SRGB:
        return L_BLOCK(16);
    case CU_AD_FORMAT_UINT8_PACKED_422: case CU_AD_FORMAT_YUY2:
        return L_PACKED422(1);
    case CU_AD_FORMAT_Y210: case CU_AD_FORMAT_Y216:
        return L_PACKED422(2);
    case CU_AD_FORMAT_NV12: case CU_AD_FORMAT_UINT8_SEMIPLANAR_420:
        return L_SEMI(1, 2, 2);
    case CU_AD_FORMAT_P010: case CU_AD_FORMAT_P016: case CU_AD_FORMAT_UINT16_SEMIPLANAR_420:
        return L_SEMI(2, 2, 2);
    case CU_AD_FORMAT_NV16: case CU_AD_FORMAT_UINT8_SEMIPLANAR_422:
        return L_SEMI(1, 2, 1);
    case CU_AD_FORMAT_P210: case CU_AD_FORMAT_P216: case CU_AD_FORMAT_UINT16_SEMIPLANAR_422:
        return L_SEMI(2, 2, 1);
    case CU_AD_FORMAT_YUV444_8bit_SemiPlanar: case CU_AD_FORMAT_UINT8_SEMIPLANAR_444:
        return L_SEMI(1, 1, 1);
    case CU_AD_FORMAT_YUV444_16bit_SemiPlanar: case CU_AD_FORMAT_UINT16_SEMIPLANAR_444:
        return L_SEMI(2, 1, 1);
    case CU_AD_FORMAT_UINT8_PLANAR_420:
        return L_PLANAR(1, 2, 2);
    case CU_AD_FORMAT_UINT16_PLANAR_420:
        return L_PLANAR(2, 2, 2);
    case CU_AD_FORMAT_UINT8_PLANAR_422:
        return L_PLANAR(1, 2, 1);
    case CU_AD_FORMAT_UINT16_PLANAR_422:
        return L_PLANAR(2, 2, 1);
    case CU_AD_FORMAT_Y444_PLANAR8: case CU_AD_FORMAT_UINT8_PLANAR_444:
        return L_PLANAR(1, 1, 1);
    case CU_AD_FORMAT_Y444_PLANAR10: case CU_AD_FORMAT_UINT16_PLANAR_444:
        return L_PLANAR(2, 1, 1);
    default:    /* UNSIGNED_INT32, SIGNED_INT32, FLOAT, and any not known */
        return L_CHANNEL(4);
    }
}

static uint64_t ceil_div(uint64_t n, uint64_t d) { return n / d + (n % d != 0); }

/* Bytes of a w x h x d array; 0 on overflow (no driver makes one). */
static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, unsigned ch)
{
    texel_layout l = layout_of(f);
    uint64_t sum = 0;
    for (int i = 0; i < 3 && l.p[i].bytes; i++) {
        const plane *p = &l.p[i];
        uint64_t per = l.per_channel ? (uint64_t)p->bytes * (ch ? ch : 1) : p->bytes, row, bytes;
        if (__builtin_mul_overflow(ceil_div(w, p->across), per, &row) || row > UINT64_MAX - 511 ||
            __builtin_mul_overflow(gv_round_up(row, 512), ceil_div(h ? h : 1, p->down), &bytes) ||
            __builtin_add_overflow(sum, bytes, &sum))
            return 0;
    }
    return __builtin_mul_overflow(sum, d ? d : 1, &sum) ? 0 : sum;
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
