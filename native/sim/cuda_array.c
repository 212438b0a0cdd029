/*
 * cuda_array.c - CUDA arrays and mipmapped arrays.  An array charges
 *   roundup2M( roundup512(width * channels * bpe) * max(h,1) * max(d,1) )
 * (block-compressed formats: per row of 4x4 blocks of 8 or 16 bytes;
 * NV12: one byte a texel and a half-height U/V plane: layout_of below)
 * and a mipmapped array the sum of its levels (each level halves every
 * non-zero dimension, minimum 1, but for the layer count of a layered or
 * cubemap array) rounded up to 2 MiB once.  Sparse and
 * deferred-mapping arrays (CUDA_ARRAY3D_SPARSE / _DEFERRED_MAPPING) charge
 * nothing: their memory is mapped in later.  As on a real driver, the
 * memory-requirements queries answer only for deferred-mapping arrays
 * (CUDA_ERROR_INVALID_VALUE otherwise).
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

#define ARRAY_MAGIC 0x41525259u
#define MIPMAP_MAGIC 0x4d49504du

/* size: what the array needs; charged: what it holds (0 for sparse and
 * deferred-mapping arrays, whose memory is mapped in later). */
struct CUarray_st {
    uint32_t magic;
    int node;
    uint64_t size, charged;
    CUDA_ARRAY3D_DESCRIPTOR d;
};

struct CUmipmappedArray_st {
    uint32_t magic;
    int node;
    uint64_t size, charged;
    unsigned levels;
    CUDA_ARRAY3D_DESCRIPTOR d;
};

/* How a format lays texels out: blocks of `block` x `block` texels of
 * `bytes` each, and the NumChannels it takes (0: 1, 2 or 4, each channel
 * `bytes` wide).  The block-compressed formats count Width and Height in
 * texels; NV12 adds a half-height plane of interleaved U/V bytes.  The
 * channel counts of the newer formats are those cudaCreateChannelDesc
 * gives the runtime (BC6H and NV12: 3).  0: a format the driver refuses. */
struct layout { unsigned block, bytes, channels, nv12; };

static int layout_of(CUarray_format f, struct layout *l)
{
    static const struct { int f; struct layout l; } known[] = {
        { CU_AD_FORMAT_UNSIGNED_INT8, { 1, 1, 0, 0 } },
        { CU_AD_FORMAT_SIGNED_INT8, { 1, 1, 0, 0 } },
        { CU_AD_FORMAT_UNSIGNED_INT16, { 1, 2, 0, 0 } },
        { CU_AD_FORMAT_SIGNED_INT16, { 1, 2, 0, 0 } },
        { CU_AD_FORMAT_HALF, { 1, 2, 0, 0 } },
        { CU_AD_FORMAT_UNSIGNED_INT32, { 1, 4, 0, 0 } },
        { CU_AD_FORMAT_SIGNED_INT32, { 1, 4, 0, 0 } },
        { CU_AD_FORMAT_FLOAT, { 1, 4, 0, 0 } },
        { CU_AD_FORMAT_UNORM_INT8X1, { 1, 1, 1, 0 } },
        { CU_AD_FORMAT_SNORM_INT8X1, { 1, 1, 1, 0 } },
        { CU_AD_FORMAT_UNORM_INT8X2, { 1, 2, 2, 0 } },
        { CU_AD_FORMAT_SNORM_INT8X2, { 1, 2, 2, 0 } },
        { CU_AD_FORMAT_UNORM_INT8X4, { 1, 4, 4, 0 } },
        { CU_AD_FORMAT_SNORM_INT8X4, { 1, 4, 4, 0 } },
        { CU_AD_FORMAT_UNORM_INT16X1, { 1, 2, 1, 0 } },
        { CU_AD_FORMAT_SNORM_INT16X1, { 1, 2, 1, 0 } },
        { CU_AD_FORMAT_UNORM_INT16X2, { 1, 4, 2, 0 } },
        { CU_AD_FORMAT_SNORM_INT16X2, { 1, 4, 2, 0 } },
        { CU_AD_FORMAT_UNORM_INT16X4, { 1, 8, 4, 0 } },
        { CU_AD_FORMAT_SNORM_INT16X4, { 1, 8, 4, 0 } },
        { CU_AD_FORMAT_BC1_UNORM, { 4, 8, 4, 0 } },
        { CU_AD_FORMAT_BC1_UNORM_SRGB, { 4, 8, 4, 0 } },
        { CU_AD_FORMAT_BC4_UNORM, { 4, 8, 1, 0 } },
        { CU_AD_FORMAT_BC4_SNORM, { 4, 8, 1, 0 } },
        { CU_AD_FORMAT_BC2_UNORM, { 4, 16, 4, 0 } },
        { CU_AD_FORMAT_BC2_UNORM_SRGB, { 4, 16, 4, 0 } },
        { CU_AD_FORMAT_BC3_UNORM, { 4, 16, 4, 0 } },
        { CU_AD_FORMAT_BC3_UNORM_SRGB, { 4, 16, 4, 0 } },
        { CU_AD_FORMAT_BC5_UNORM, { 4, 16, 2, 0 } },
        { CU_AD_FORMAT_BC5_SNORM, { 4, 16, 2, 0 } },
        { CU_AD_FORMAT_BC6H_UF16, { 4, 16, 3, 0 } },
        { CU_AD_FORMAT_BC6H_SF16, { 4, 16, 3, 0 } },
        { CU_AD_FORMAT_BC7_UNORM, { 4, 16, 4, 0 } },
        { CU_AD_FORMAT_BC7_UNORM_SRGB, { 4, 16, 4, 0 } },
        { CU_AD_FORMAT_NV12, { 1, 1, 3, 1 } },
    };
    for (size_t i = 0; i < sizeof known / sizeof *known; i++)
        if (known[i].f == (int)f) {
            *l = known[i].l;
            return 1;
        }
    return 0;
}

/* unrounded byte size of one level; 0 if the descriptor is invalid */
static uint64_t level_bytes(size_t w, size_t h, size_t d, CUarray_format f,
                            unsigned ch)
{
    struct layout l;
    if (!layout_of(f, &l) || !w || (d && !h) || (l.nv12 && (!h || d)))
        return 0;
    if (l.channels ? ch != l.channels : (ch != 1 && ch != 2 && ch != 4))
        return 0;
    if (w > (1ULL << 30) || h > (1ULL << 30) || d > (1ULL << 30))
        return 0;
    uint64_t per = l.channels ? l.bytes : (uint64_t)l.bytes * ch;
    uint64_t cols = (w + l.block - 1) / l.block;
    uint64_t rows = ((h ? h : 1) + l.block - 1) / l.block;
    if (l.nv12)
        rows += (h + 1) / 2;
    uint64_t row = sim_round_up(cols * per, SIM_ALIGN);
    return row * rows * (d ? d : 1);
}

static CUresult charge_new(uint64_t raw, unsigned flags, int *node, uint64_t *size,
                           uint64_t *charged)
{
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc)
        return rc;
    if (!raw)
        return CUDA_ERROR_INVALID_VALUE;
    *size = sim_round_up(raw, SIM_GRAN);
    *charged = flags & GV_ARRAY3D_UNBACKED ? 0 : *size;
    if (*charged && (sim_fault_alloc() || sim_charge(c->node, *charged) < 0))
        return CUDA_ERROR_OUT_OF_MEMORY;
    *node = c->node;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuArray3DCreate_v2(CUarray *pa, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (!pa || !d)
        return sim_check_init() ? sim_check_init() : CUDA_ERROR_INVALID_VALUE;
    uint64_t raw = level_bytes(d->Width, d->Height, d->Depth, d->Format,
                               d->NumChannels);
    int node;
    uint64_t size, charged;
    CUresult rc = charge_new(raw, d->Flags, &node, &size, &charged);
    if (rc)
        return rc;
    struct CUarray_st *a = calloc(1, sizeof *a);
    if (!a) {
        sim_uncharge(node, charged);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->magic = ARRAY_MAGIC;
    a->node = node;
    a->size = size;
    a->charged = charged;
    a->d = *d;
    pthread_mutex_lock(&sim_mu);
    sim_reg_add(a);
    pthread_mutex_unlock(&sim_mu);
    *pa = a;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuArray3DCreate(CUarray *pa, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    if (!d)
        return cuArray3DCreate_v2(pa, NULL);
    CUDA_ARRAY3D_DESCRIPTOR v2 = {d->Width, d->Height, d->Depth, d->Format,
                                  d->NumChannels, d->Flags};
    return cuArray3DCreate_v2(pa, &v2);
}

SIM_API CUresult cuArrayCreate_v2(CUarray *pa, const CUDA_ARRAY_DESCRIPTOR *d)
{
    if (!d)
        return cuArray3DCreate_v2(pa, NULL);
    CUDA_ARRAY3D_DESCRIPTOR v3 = {d->Width, d->Height, 0, d->Format,
                                  d->NumChannels, 0};
    return cuArray3DCreate_v2(pa, &v3);
}

SIM_API CUresult cuArrayCreate(CUarray *pa, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    if (!d)
        return cuArray3DCreate_v2(pa, NULL);
    CUDA_ARRAY3D_DESCRIPTOR v3 = {d->Width, d->Height, 0, d->Format,
                                  d->NumChannels, 0};
    return cuArray3DCreate_v2(pa, &v3);
}

static struct CUarray_st *array_of(CUarray a)
{
    return a && sim_reg_has(a) && a->magic == ARRAY_MAGIC ? a : NULL;
}

SIM_API CUresult cuArrayDestroy(CUarray arr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    struct CUarray_st *a = array_of(arr);
    if (a) {
        sim_reg_del(a);
        a->magic = 0;
    }
    pthread_mutex_unlock(&sim_mu);
    if (!a)
        return CUDA_ERROR_INVALID_HANDLE;
    sim_uncharge(a->node, a->charged);
    free(a);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuArrayGetDescriptor_v2(CUDA_ARRAY_DESCRIPTOR *out, CUarray arr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_mu);
    struct CUarray_st *a = array_of(arr);
    if (a) {
        out->Width = a->d.Width;
        out->Height = a->d.Height;
        out->Format = a->d.Format;
        out->NumChannels = a->d.NumChannels;
    }
    pthread_mutex_unlock(&sim_mu);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

SIM_API CUresult cuArrayGetDescriptor(CUDA_ARRAY_DESCRIPTOR_v1 *out, CUarray arr)
{
    CUDA_ARRAY_DESCRIPTOR d;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuArrayGetDescriptor_v2(&d, arr);
    if (rc == CUDA_SUCCESS) {
        out->Width = (unsigned)d.Width;
        out->Height = (unsigned)d.Height;
        out->Format = d.Format;
        out->NumChannels = d.NumChannels;
    }
    return rc;
}

static void fill_req(CUDA_ARRAY_MEMORY_REQUIREMENTS *r, uint64_t size)
{
    memset(r, 0, sizeof *r);
    r->size = size;
    r->alignment = SIM_ALIGN;
}

SIM_API CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *r,
                                              CUarray arr, CUdevice dev)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!r)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_ord_node(dev) < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    /* As documented: only for arrays made with CUDA_ARRAY3D_DEFERRED_MAPPING. */
    pthread_mutex_lock(&sim_mu);
    struct CUarray_st *a = array_of(arr);
    int deferred = a && (a->d.Flags & CUDA_ARRAY3D_DEFERRED_MAPPING);
    if (deferred)
        fill_req(r, a->size);
    pthread_mutex_unlock(&sim_mu);
    return !a ? CUDA_ERROR_INVALID_HANDLE : deferred ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- mipmapped arrays ------------------------------------------------ */

SIM_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pm,
                                        const CUDA_ARRAY3D_DESCRIPTOR *d,
                                        unsigned int levels)
{
    if (!pm || !d || !levels)
        return sim_check_init() ? sim_check_init() : CUDA_ERROR_INVALID_VALUE;
    uint64_t raw = 0;
    size_t w = d->Width, h = d->Height, z = d->Depth;
    /* Depth of a layered or cubemap array counts layers (faces): every
     * level has all of them. */
    int layers = (d->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    /* As CUDA documents: the level count is clamped to
     * 1 + floor(log2(max(width, height, depth))). */
    size_t big = w > h ? w : h;
    if (z > big)
        big = z;
    unsigned full = 1;
    while (big > 1) {
        big >>= 1;
        full++;
    }
    if (levels > full)
        levels = full;
    for (unsigned l = 0; l < levels; l++) {
        uint64_t b = level_bytes(w, h, z, d->Format, d->NumChannels);
        if (!b) {
            raw = 0;
            break;
        }
        raw += b;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        z = z > 1 && !layers ? z / 2 : z;
    }
    int node;
    uint64_t size, charged;
    CUresult rc = charge_new(raw, d->Flags, &node, &size, &charged);
    if (rc)
        return rc;
    struct CUmipmappedArray_st *m = calloc(1, sizeof *m);
    if (!m) {
        sim_uncharge(node, charged);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->magic = MIPMAP_MAGIC;
    m->node = node;
    m->size = size;
    m->charged = charged;
    m->levels = levels;
    m->d = *d;
    pthread_mutex_lock(&sim_mu);
    sim_reg_add(m);
    pthread_mutex_unlock(&sim_mu);
    *pm = m;
    return CUDA_SUCCESS;
}

static struct CUmipmappedArray_st *mip_of(CUmipmappedArray m)
{
    return m && sim_reg_has(m) && m->magic == MIPMAP_MAGIC ? m : NULL;
}

SIM_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray mm)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_mu);
    struct CUmipmappedArray_st *m = mip_of(mm);
    if (m) {
        sim_reg_del(m);
        m->magic = 0;
    }
    pthread_mutex_unlock(&sim_mu);
    if (!m)
        return CUDA_ERROR_INVALID_HANDLE;
    sim_uncharge(m->node, m->charged);
    free(m);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMipmappedArrayGetMemoryRequirements(
    CUDA_ARRAY_MEMORY_REQUIREMENTS *r, CUmipmappedArray mm, CUdevice dev)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!r)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_ord_node(dev) < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&sim_mu);
    struct CUmipmappedArray_st *m = mip_of(mm);
    int deferred = m && (m->d.Flags & CUDA_ARRAY3D_DEFERRED_MAPPING);
    if (deferred)
        fill_req(r, m->size);
    pthread_mutex_unlock(&sim_mu);
    return !m ? CUDA_ERROR_INVALID_HANDLE : deferred ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
