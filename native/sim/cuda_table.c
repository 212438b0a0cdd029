/*
 * cuda_table.c - the process-local table of live device allocations
 * (sorted by address, so interior pointers can be resolved) and the
 * address-space bump allocators.  Callers hold sim_mu.
 *
 * Address ranges (never reused within a process, so a stale pointer can
 * never alias a live allocation):
 *   node d, _v2 APIs : 0x7f0000000000 + (d << 42) ... + 4 TiB
 *   v1 APIs (32-bit) : 0x10000000 ... 0xffffffff
 *   VMM reservations : see cuda_vmm.c
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

#define VA_BASE 0x7f0000000000ULL
#define VA_SPAN (1ULL << 42)
#define HOST_VA_BASE 0x500000000000ULL
#define LOW_BASE 0x10000000ULL
#define LOW_END 0x100000000ULL

static sim_alloc *g_tab;
static size_t g_n, g_cap;
static uint64_t g_bump[SIM_MAX_NODE];
static uint64_t g_host_bump;
static uint64_t g_low = LOW_BASE;

/* index of the last entry with addr <= a, or -1 */
static long floor_idx(CUdeviceptr a)
{
    long lo = 0, hi = (long)g_n - 1, r = -1;
    while (lo <= hi) {
        long mid = (lo + hi) / 2;
        if (g_tab[mid].addr <= a) {
            r = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return r;
}

int sim_tab_insert(const sim_alloc *a)
{
    if (g_n == g_cap) {
        size_t nc = g_cap ? g_cap * 2 : 64;
        sim_alloc *t = realloc(g_tab, nc * sizeof *t);
        if (!t)
            return -1;
        g_tab = t;
        g_cap = nc;
    }
    size_t i = (size_t)(floor_idx(a->addr) + 1);
    memmove(&g_tab[i + 1], &g_tab[i], (g_n - i) * sizeof *g_tab);
    g_tab[i] = *a;
    g_n++;
    return 0;
}

sim_alloc *sim_tab_find(CUdeviceptr addr)
{
    long i = floor_idx(addr);
    return i >= 0 && g_tab[i].addr == addr ? &g_tab[i] : NULL;
}

sim_alloc *sim_tab_range(CUdeviceptr addr)
{
    long i = floor_idx(addr);
    if (i < 0 || addr - g_tab[i].addr >= g_tab[i].size)
        return NULL;
    return &g_tab[i];
}

void sim_tab_remove(CUdeviceptr addr)
{
    long i = floor_idx(addr);
    if (i < 0 || g_tab[i].addr != addr)
        return;
    memmove(&g_tab[i], &g_tab[i + 1], (g_n - (size_t)i - 1) * sizeof *g_tab);
    g_n--;
}

/* first ALLOC/LOW entry owned by context c (used when c is destroyed) */
sim_alloc *sim_tab_next_ctx(struct CUctx_st *c)
{
    for (size_t i = 0; i < g_n; i++)
        if (g_tab[i].ctx == c && g_tab[i].kind != SIM_K_POOL)
            return &g_tab[i];
    return NULL;
}

/* next free address for size bytes; 0 when the range is exhausted */
CUdeviceptr sim_va_next(int node, uint64_t size, int low)
{
    uint64_t sz = sim_round_up(size ? size : 1, SIM_ALIGN);
    if (low) {
        if (sz > LOW_END - g_low)
            return 0;
        CUdeviceptr p = g_low;
        g_low += sz;
        return p;
    }
    if (node < 0) {                      /* host memory (a host-located pool) */
        if (sz > VA_SPAN - g_host_bump)
            return 0;
        CUdeviceptr p = HOST_VA_BASE + g_host_bump;
        g_host_bump += sz;
        return p;
    }
    if (sz > VA_SPAN - g_bump[node])
        return 0;
    CUdeviceptr p = VA_BASE + ((uint64_t)node << 42) + g_bump[node];
    g_bump[node] += sz;
    return p;
}
