/*
 * alloc_table.h - the process's own record of what it has charged.
 *
 * Keyed by (kind, driver handle or address).  Sharded hash tables, each
 * shard with its own mutex: no lock is global.  After fork the child starts
 * empty (device allocations do not survive into a child).
 */
#ifndef GV_ALLOC_TABLE_H
#define GV_ALLOC_TABLE_H

#include <stdint.h>

enum gv_kind {
    GV_K_PTR = 1,     /* cuMemAlloc / Pitch / Managed */
    GV_K_POOLPTR,     /* stream-ordered allocation; aux = pool handle */
    GV_K_ARRAY,       /* CUarray */
    GV_K_MIPMAP,      /* CUmipmappedArray */
    GV_K_VMM,         /* CUmemGenericAllocationHandle; aux = live mappings */
    GV_K_MAP,         /* cuMemMap'd range; aux = handle, bytes = size */
    GV_K_CTX,         /* context memory; key = CUcontext */
    GV_K_GEXEC,       /* executable graph with memory nodes; nothing
                       * charged: aux = its record (hooks_graph.c) */
    GV_K_GALLOC,      /* live graph allocation (its address); nothing
                       * charged: aux = GV_GALLOC_AUX(size, ordinal) */
    GV_K_SPILL        /* cuMemAlloc / Pitch / Managed under CUDA_OVERSUBSCRIBE,
                       * partly or wholly in host memory: aux = the
                       * charged bytes spilled (oversub.c) */
};

typedef struct gv_alloc {
    uint64_t key;
    uint32_t kind;
    int32_t dev;        /* region device entry */
    uint64_t bytes;     /* charged */
    uint64_t aux;
    void *ctx;          /* owning context (freed with it), or NULL */
} gv_alloc;

/* GV_K_GALLOC's aux: the allocation's size (56 bits) and device ordinal. */
#define GV_GALLOC_AUX(size, ordinal)                                         \
    (((uint64_t)(ordinal) << 56) | ((size) & ((1ULL << 56) - 1)))
#define GV_GALLOC_SIZE(aux) ((aux) & ((1ULL << 56) - 1))
#define GV_GALLOC_ORDINAL(aux) ((int)((aux) >> 56))

/* Insert or replace. Returns 0, or -1 when out of memory. */
int gv_table_put(const gv_alloc *a);
/* Remove and return the entry; 1 if found, 0 if not. */
int gv_table_take(uint32_t kind, uint64_t key, gv_alloc *out);
/* Read without removing; 1 if found. */
int gv_table_get(uint32_t kind, uint64_t key, gv_alloc *out);
/* Change an entry in place under its shard lock; 1 if found. */
typedef void (*gv_table_edit)(gv_alloc *a, void *arg);
int gv_table_modify(uint32_t kind, uint64_t key, gv_table_edit edit, void *arg);
/* Apply fn to every entry for which match(entry) is true, removing it. */
typedef int (*gv_table_match)(const gv_alloc *a, void *arg);
typedef void (*gv_table_visit)(const gv_alloc *a, void *arg);
int gv_table_take_all(gv_table_match match, gv_table_visit visit, void *arg);
/* Number of entries for which match(entry) is true; none is removed. */
uint64_t gv_table_count_if(gv_table_match match, void *arg);
/* Number of entries (for tests and diagnostics). */
uint64_t gv_table_count(void);

#endif /* GV_ALLOC_TABLE_H */
