/*
 * cuda_array.c - CUDA arrays and mipmapped arrays.  An array charges
 *   roundup2M( roundup512(width * channels * bpe) * max(h,1) * max(d,1) )
 * (block-compressed formats: per row of 4x4 blocks of 8 or 16 bytes; YUV
 * formats: each plane so, at its own width and height: layout_of below)
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

/* What arrays and mipmapped arrays share (each starts with it).  size: what
 * the array needs; charged: what it holds (0 for sparse and
 * deferred-mapping arrays, whose memory is mapped in later). */
struct held {
    uint32_t magic;
    int node;
    uint64_t size, charged;
    CUDA_ARRAY3D_DESCRIPTOR d;
};

struct CUarray_st {
    struct held h;
};

struct CUmipmappedArray_st {
    struct held h;
    unsigned levels;
};

/* How a format lays texels out: up to three planes, each `bytes` for every
 * group of `across` x `down` texels (a 4x4 block of the block-compressed
 * formats, whose Width and Height count texels; a texel pair of packed
 * 4:2:2 YUV; the 2x2, 2x1 or 1x1 texels a chroma sample covers in a 4:2:0,
 * 4:2:2 or 4:4:4 U/V plane), and the NumChannels the format takes (0: 1, 2
 * or 4, each channel `bytes` wide).  The channel counts are those CUDA
 * documents (those cudaCreateChannelDesc gives the runtime: BC6H and NV12
 * 3); where it gives none, 3 for the semi-planar video formats, as NV12,
 * and 4 for Y410 (A, Y, U, V).  Formats of more than one plane are 2D only
 * (Height set, no Depth).  0: a format the driver refuses. */
struct plane { unsigned char bytes, across, down; };
struct layout { unsigned channels; struct plane p[3]; };

#define TEXEL(b, ch) { ch, { { b, 1, 1 } } }
#define BLOCK(b, ch) { ch, { { b, 4, 4 } } }
#define PACKED422(s, ch) { ch, { { 4 * (s), 2, 1 } } }
#define SEMI(s, a, d) { 3, { { s, 1, 1 }, { 2 * (s), a, d } } }
#define PLANAR(s, a, d) { 3, { { s, 1, 1 }, { s, a, d }, { s, a, d } } }

static int layout_of(CUarray_format f, struct layout *l)
{
    static const struct { int f; struct layout l; } known[] = {
        { CU_AD_FORMAT_UNSIGNED_INT8, TEXEL(1, 0) },
        { CU_AD_FORMAT_SIGNED_INT8, TEXEL(1, 0) },
        { CU_AD_FORMAT_UNSIGNED_INT16, TEXEL(2, 0) },
        { CU_AD_FORMAT_SIGNED_INT16, TEXEL(2, 0) },
        { CU_AD_FORMAT_HALF, TEXEL(2, 0) },
        { CU_AD_FORMAT_UNSIGNED_INT32, TEXEL(4, 0) },
        { CU_AD_FORMAT_SIGNED_INT32, TEXEL(4, 0) },
        { CU_AD_FORMAT_FLOAT, TEXEL(4, 0) },
        { CU_AD_FORMAT_UNORM_INT8X1, TEXEL(1, 1) },
        { CU_AD_FORMAT_SNORM_INT8X1, TEXEL(1, 1) },
        { CU_AD_FORMAT_UNORM_INT8X2, TEXEL(2, 2) },
        { CU_AD_FORMAT_SNORM_INT8X2, TEXEL(2, 2) },
        { CU_AD_FORMAT_UNORM_INT8X4, TEXEL(4, 4) },
        { CU_AD_FORMAT_SNORM_INT8X4, TEXEL(4, 4) },
        { CU_AD_FORMAT_UNORM_INT16X1, TEXEL(2, 1) },
        { CU_AD_FORMAT_SNORM_INT16X1, TEXEL(2, 1) },
        { CU_AD_FORMAT_UNORM_INT16X2, TEXEL(4, 2) },
        { CU_AD_FORMAT_SNORM_INT16X2, TEXEL(4, 2) },
        { CU_AD_FORMAT_UNORM_INT16X4, TEXEL(8, 4) },
        { CU_AD_FORMAT_SNORM_INT16X4, TEXEL(8, 4) },
        { CU_AD_FORMAT_BC1_UNORM, BLOCK(8, 4) },
        { CU_AD_FORMAT_BC1_UNORM_SRGB, BLOCK(8, 4) },
        { CU_AD_FORMAT_BC4_UNORM, BLOCK(8, 1) },
        { CU_AD_FORMAT_BC4_SNORM, BLOCK(8, 1) },
        { CU_AD_FORMAT_BC2_UNORM, BLOCK(16, 4) },
        { CU_AD_FORMAT_BC2_UNORM_SRGB, BLOCK(16, 4) },
        { CU_AD_FORMAT_BC3_UNORM, BLOCK(16, 4) },
        { CU_AD_FORMAT_BC3_UNORM_SRGB, BLOCK(16, 4) },
        { CU_AD_FORMAT_BC5_UNORM, BLOCK(16, 2) },
        { CU_AD_FORMAT_BC5_SNORM, BLOCK(16, 2) },
        { CU_AD_FORMAT_BC6H_UF16, BLOCK(16, 3) },
        { CU_AD_FORMAT_BC6H_SF16, BLOCK(16, 3) },
        { CU_AD_FORMAT_BC7_UNORM, BLOCK(16, 4) },
        { CU_AD_FORMAT_BC7_UNORM_SRGB, BLOCK(16, 4) },
        { CU_AD_FORMAT_UNORM_INT_101010_2, TEXEL(4, 4) },
        { CU_AD_FORMAT_UINT8_PACKED_422, PACKED422(1, 4) },
        { CU_AD_FORMAT_UINT8_PACKED_444, TEXEL(4, 4) },
        { CU_AD_FORMAT_UINT8_SEMIPLANAR_420, SEMI(1, 2, 2) },
        { CU_AD_FORMAT_UINT16_SEMIPLANAR_420, SEMI(2, 2, 2) },
        { CU_AD_FORMAT_UINT8_SEMIPLANAR_422, SEMI(1, 2, 1) },
        { CU_AD_FORMAT_UINT16_SEMIPLANAR_422, SEMI(2, 2, 1) },
        { CU_AD_FORMAT_UINT8_SEMIPLANAR_444, SEMI(1, 1, 1) },
        { CU_AD_FORMAT_UINT16_SEMIPLANAR_444, SEMI(2, 1, 1) },
        { CU_AD_FORMAT_UINT8_PLANAR_420, PLANAR(1, 2, 2) },
        { CU_AD_FORMAT_UINT16_PLANAR_420, PLANAR(2, 2, 2) },
        { CU_AD_FORMAT_UINT8_PLANAR_422, PLANAR(1, 2, 1) },
        { CU_AD_FORMAT_UINT16_PLANAR_422, PLANAR(2, 2, 1) },
        { CU_AD_FORMAT_UINT8_PLANAR_444, PLANAR(1, 1, 1) },
        { CU_AD_FORMAT_UINT16_PLANAR_444, PLANAR(2, 1, 1) },
        { CU_AD_FORMAT_NV12, SEMI(1, 2, 2) },
        { CU_AD_FORMAT_P010, SEMI(2, 2, 2) },
        { CU_AD_FORMAT_P016, SEMI(2, 2, 2) },
        { CU_AD_FORMAT_NV16, SEMI(1, 2, 1) },
        { CU_AD_FORMAT_P210, SEMI(2, 2, 1) },
        { CU_AD_FORMAT_P216, SEMI(2, 2, 1) },
        { CU_AD_FORMAT_YUY2, PACKED422(1, 2) },
        { CU_AD_FORMAT_Y210, PACKED422(2, 2) },
        { CU_AD_FORMAT_Y216, PACKED422(2, 2) },
        { CU_AD_FORMAT_AYUV, TEXEL(4, 4) },
        { CU_AD_FORMAT_Y410, TEXEL(4, 4) },
        { CU_AD_FORMAT_Y416, TEXEL(8, 4) },
        { CU_AD_FORMAT_Y444_PLANAR8, PLANAR(1, 1, 1) },
        { CU_AD_FORMAT_Y444_PLANAR10, PLANAR(2, 1, 1) },
        { CU_AD_FORMAT_YUV444_8bit_SemiPlanar, SEMI(1, 1, 1) },
        { CU_AD_FORMAT_YUV444_16bit_SemiPlanar, SEMI(2, 1, 1) },
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
    if (!layout_of(f, &l) || !w || (d && !h) || (l.p[1].bytes && (!h || d)))
        return 0;
    if (l.channels ? ch != l.channels : (ch != 1 && ch != 2 && ch != 4))
        return 0;
    if (w > (1ULL << 30) || h > (1ULL << 30) || d > (1ULL << 30))
        return 0;
    uint64_t sum = 0;
    for (int i = 0; i < 3 && l.p[i].bytes; i++) {
        const struct plane *p = &l.p[i];
        uint64_t per = l.channels ? p->bytes : (uint64_t)p->bytes * ch;
        uint64_t cols = (w + p->across - 1) / p->across;
        uint64_t rows = ((h ? h : 1) + p->down - 1) / p->down;
        sum += sim_round_up(cols * per, SIM_ALIGN) * rows;
    }
    return sum * (d ? d : 1);
}

/* A new array of raw bytes, of `bytes` (its struct, which starts with a
 * struct held): charged to the current context's device, registered. */
static CUresult held_new(void **out, size_t bytes, uint32_t magic, uint64_t raw,
                         const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    struct CUctx_st *c;
    SIM_TRY(sim_current(&c));
    if (!raw)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t size = sim_round_up(raw, SIM_GRAN);
    uint64_t charged = d->Flags & GV_ARRAY3D_UNBACKED ? 0 : size;
    if (charged && (sim_fault_alloc() || sim_charge(c->node, charged) < 0))
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct held *h = calloc(1, bytes);
    if (!h) {
        sim_uncharge(c->node, charged);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->magic = magic;
    h->node = c->node;
    h->size = size;
    h->charged = charged;
    h->d = *d;
    pthread_mutex_lock(&sim_mu);
    sim_reg_add(h);
    pthread_mutex_unlock(&sim_mu);
    *out = h;
    return CUDA_SUCCESS;
}

/* p if it is a live array of this kind (under sim_mu). */
static struct held *held_of(const void *p, uint32_t magic)
{
    struct held *h = (struct held *)p;
    return h && sim_reg_has(h) && h->magic == magic ? h : NULL;
}

static CUresult held_destroy(const void *p, uint32_t magic)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    struct held *h = held_of(p, magic);
    if (h) {
        sim_reg_del(h);
        h->magic = 0;
    }
    pthread_mutex_unlock(&sim_mu);
    if (!h)
        return CUDA_ERROR_INVALID_HANDLE;
    sim_uncharge(h->node, h->charged);
    free(h);
    return CUDA_SUCCESS;
}

/* As documented: only for arrays made with CUDA_ARRAY3D_DEFERRED_MAPPING. */
static CUresult held_requirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *r, const void *p,
                                  uint32_t magic, CUdevice dev)
{
    SIM_TRY(sim_check_dev(r != NULL, dev, NULL));
    pthread_mutex_lock(&sim_mu);
    struct held *h = held_of(p, magic);
    int deferred = h && (h->d.Flags & CUDA_ARRAY3D_DEFERRED_MAPPING);
    if (deferred) {
        memset(r, 0, sizeof *r);
        r->size = h->size;
        r->alignment = SIM_ALIGN;
    }
    pthread_mutex_unlock(&sim_mu);
    return !h ? CUDA_ERROR_INVALID_HANDLE : deferred ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuArray3DCreate_v2(CUarray *pa, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (!pa || !d)
        return sim_check_init() ? sim_check_init() : CUDA_ERROR_INVALID_VALUE;
    uint64_t raw = level_bytes(d->Width, d->Height, d->Depth, d->Format,
                               d->NumChannels);
    void *a;
    CUresult rc = held_new(&a, sizeof(struct CUarray_st), ARRAY_MAGIC, raw, d);
    if (rc == CUDA_SUCCESS)
        *pa = a;
    return rc;
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

SIM_API CUresult cuArrayDestroy(CUarray arr) { return held_destroy(arr, ARRAY_MAGIC); }

SIM_API CUresult cuArrayGetDescriptor_v2(CUDA_ARRAY_DESCRIPTOR *out, CUarray arr)
{
    SIM_TRY(sim_check_args(!out));
    pthread_mutex_lock(&sim_mu);
    struct held *a = held_of(arr, ARRAY_MAGIC);
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

SIM_API CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *r,
                                              CUarray arr, CUdevice dev)
{
    return held_requirements(r, arr, ARRAY_MAGIC, dev);
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
    void *m;
    CUresult rc = held_new(&m, sizeof(struct CUmipmappedArray_st), MIPMAP_MAGIC, raw, d);
    if (rc == CUDA_SUCCESS) {
        ((struct CUmipmappedArray_st *)m)->levels = levels;
        *pm = m;
    }
    return rc;
}

SIM_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray mm)
{
    return held_destroy(mm, MIPMAP_MAGIC);
}

SIM_API CUresult cuMipmappedArrayGetMemoryRequirements(
    CUDA_ARRAY_MEMORY_REQUIREMENTS *r, CUmipmappedArray mm, CUdevice dev)
{
    return held_requirements(r, mm, MIPMAP_MAGIC, dev);
}
