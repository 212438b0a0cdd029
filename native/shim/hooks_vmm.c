/*
 * hooks_vmm.c - virtual memory management: cuMemCreate / cuMemRelease.
 *
 * Physical memory of a handle is freed only once it is released AND no
 * longer mapped, so the charge stays until both are true.  GV_K_VMM
 * entries keep in aux the number of live mappings (low 32 bits), the
 * references cuMemRetainAllocationHandle added (bits 32-62: each takes a
 * cuMemRelease of its own), and RELEASED_BIT once the last reference was
 * released.
 *
 * The calls that may free a handle's memory (cuMemRelease, cuMemUnmap,
 * cuMemAddressFree) are in flight from before the driver call until the
 * charge is given back: NVML shows the memory gone before the quota does,
 * and a reading of untracked memory meanwhile (untracked.c) would take
 * the difference off it.
 */
#include <stdlib.h>

#include "hooks.h"

#define RELEASED_BIT (1ULL << 63)
#define MAPS_MASK 0xffffffffULL
#define REFS_SHIFT 32
#define REFS_MASK (0x7fffffffULL << REFS_SHIFT)

/* GV_K_MAP entries' dev: whether the mapped handle is one charged here. */
#define MAP_CHARGED (-1)
#define MAP_UNCHARGED (-2)

typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t,
                              const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                           unsigned long long);
typedef CUresult (*unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*addr_free_fn)(CUdeviceptr, size_t);

GV_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                               const CUmemAllocationProp *prop, unsigned long long flags)
{
    create_fn real = GV_REAL(cuMemCreate, create_fn);
    GV_ENFORCING_OR(real(handle, size, prop, flags));
    if (!handle || !prop || size == 0 || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real(handle, size, prop, flags);     /* host memory is not ours */
    gv_charge c;
    CUresult rc = gv_charge_begin(&c, prop->location.id, NULL, size);
    if (rc != CUDA_SUCCESS)
        return rc == CUDA_ERROR_INVALID_DEVICE ? real(handle, size, prop, flags) : rc;
    rc = real(handle, size, prop, flags);
    return gv_charge_settle(&c, rc, GV_K_VMM, rc == CUDA_SUCCESS ? *handle : 0);
}

/* What happens to a handle: a mapping more or fewer, a reference
 * released, or retained. */
struct edit { int64_t maps_delta; int release, retain; uint64_t result; };

static void edit_handle(gv_alloc *a, void *arg)
{
    struct edit *e = arg;
    uint64_t maps = a->aux & MAPS_MASK, refs = (a->aux & REFS_MASK) >> REFS_SHIFT;
    uint64_t released = a->aux & RELEASED_BIT;
    if (e->maps_delta < 0 && maps > 0)
        maps--;
    else if (e->maps_delta > 0 && maps < MAPS_MASK)
        maps++;
    if (e->release) {
        if (refs > 0)
            refs--;
        else
            released = RELEASED_BIT;
    }
    if (e->retain) {
        if (released)
            released = 0;           /* mapped, released, taken back */
        else if (refs < (REFS_MASK >> REFS_SHIFT))
            refs++;
    }
    a->aux = maps | (refs << REFS_SHIFT) | released;
    e->result = a->aux;
}

/* Drop the charge of handle h if it is released and unmapped. */
static void maybe_free(CUmemGenericAllocationHandle h, uint64_t state)
{
    gv_alloc a;
    if (state == RELEASED_BIT && gv_table_take(GV_K_VMM, h, &a))
        gv_uncharge(a.dev, a.bytes);
}

GV_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    typedef CUresult (*retain_fn)(CUmemGenericAllocationHandle *, void *);
    retain_fn real = GV_REAL(cuMemRetainAllocationHandle, retain_fn);
    GV_ENFORCING_ELSE_PASS(real(h, addr));
    CUresult rc = real(h, addr);
    if (rc == CUDA_SUCCESS && h) {
        struct edit e = { 0, 0, 1, 0 };
        gv_table_modify(GV_K_VMM, *h, edit_handle, &e);
    }
    return rc;
}

GV_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    release_fn real = GV_REAL(cuMemRelease, release_fn);
    GV_ENFORCING_ELSE_PASS(real(h));
    gv_charge_flying();
    CUresult rc = real(h);
    struct edit e = { 0, 1, 0, 0 };
    if (rc == CUDA_SUCCESS && gv_table_modify(GV_K_VMM, h, edit_handle, &e))
        maybe_free(h, e.result);
    gv_charge_landed();
    return rc;
}

GV_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                            CUmemGenericAllocationHandle h, unsigned long long flags)
{
    map_fn real = GV_REAL(cuMemMap, map_fn);
    GV_ENFORCING_ELSE_PASS(real(ptr, size, offset, h, flags));
    CUresult rc = real(ptr, size, offset, h, flags);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* Every mapping is recorded, also of handles not charged here (host
     * memory), so that an unmap over several mappings can step across it. */
    struct edit e = { 1, 0, 0, 0 };
    int charged = gv_table_modify(GV_K_VMM, h, edit_handle, &e);
    gv_alloc m = { .key = ptr, .kind = GV_K_MAP, .dev = charged ? MAP_CHARGED : MAP_UNCHARGED,
                   .bytes = size, .aux = h };
    gv_table_put(&m);
    return rc;
}

/* Mapping m is gone: one mapping fewer of its handle. */
static void unmapped(const gv_alloc *m)
{
    struct edit e = { -1, 0, 0, 0 };
    if (m->dev == MAP_CHARGED && gv_table_modify(GV_K_VMM, m->aux, edit_handle, &e))
        maybe_free(m->aux, e.result);
}

struct span {
    uint64_t lo, hi;
    gv_alloc *got;
    size_t n, cap;
};

static int in_span(const gv_alloc *a, void *arg)
{
    const struct span *r = arg;
    return a->kind == GV_K_MAP && a->key >= r->lo && a->key < r->hi;
}

static void collect(const gv_alloc *a, void *arg)
{
    struct span *r = arg;
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 16;
        gv_alloc *g = realloc(r->got, cap * sizeof *g);
        if (!g)
            return;     /* its handle stays counted as mapped: over, never under */
        r->got = g;
        r->cap = cap;
    }
    r->got[r->n++] = *a;
}

/* Every mapping in [ptr, ptr + size) is gone.  Consecutive mappings from
 * ptr are found one by one; past a gap (the driver unmaps every mapping in
 * the range) or for an address range freed whole, the table is searched. */
static void unmapped_range(CUdeviceptr ptr, size_t size)
{
    CUdeviceptr p = ptr, end = ptr + size;
    while (p < end) {
        gv_alloc m;
        if (!gv_table_take(GV_K_MAP, p, &m) || m.bytes == 0)
            break;
        unmapped(&m);
        p += m.bytes;
    }
    if (p >= end)
        return;
    struct span r = { p, end, NULL, 0, 0 };
    gv_table_take_all(in_span, collect, &r);    /* (collect runs under its lock) */
    for (size_t i = 0; i < r.n; i++)
        unmapped(&r.got[i]);
    free(r.got);
}

/* Unmap through real (cuMemUnmap or cuMemAddressFree), in flight. */
static CUresult unmap(unmap_fn real, CUdeviceptr ptr, size_t size)
{
    gv_charge_flying();
    CUresult rc = real(ptr, size);
    if (rc == CUDA_SUCCESS)
        unmapped_range(ptr, size);
    gv_charge_landed();
    return rc;
}

GV_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    unmap_fn real = GV_REAL(cuMemUnmap, unmap_fn);
    GV_ENFORCING_ELSE_PASS(real(ptr, size));
    return unmap(real, ptr, size);
}

/* Freeing an address range unmaps what is still mapped in it. */
GV_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    addr_free_fn real = GV_REAL(cuMemAddressFree, addr_free_fn);
    GV_ENFORCING_ELSE_PASS(real(ptr, size));
    return unmap(real, ptr, size);
}

const gv_hook gv_hooks_vmm[] = {
    { "cuMemCreate", (void *)cuMemCreate },
    { "cuMemRelease", (void *)cuMemRelease },
    { "cuMemMap", (void *)cuMemMap },
    { "cuMemUnmap", (void *)cuMemUnmap },
    { "cuMemAddressFree", (void *)cuMemAddressFree },
    { "cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle },
    { NULL, NULL }
};
