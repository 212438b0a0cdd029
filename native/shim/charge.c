/* charge.c - reserving quota around a real allocation. */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "alloc_table.h"
#include "core.h"
#include "log.h"
#include "oversub.h"

static int self_slot(void)
{
    int slot = region_self_slot(gv_core_region());
    if (slot < 0)
        gv_log(GV_LOG_ERROR, "region %s: cannot register this process (%d)",
               region_path(gv_core_region()), slot);
    return slot;
}

static int reserve(int dev, uint64_t n)
{
    int slot = self_slot();
    if (slot < 0)
        return -1;
    gv_region *r = gv_core_region();
    /* Pools, and memory the driver took on its own, may have given memory
     * back since we last looked; when the request looks tight, re-read them
     * first (one refusal counts once). */
    if (gv_pools_active() || gv_untracked_held()) {
        uint64_t used = region_used(r, dev), limit = region_limit(r, dev);
        if (limit != GV_UNLIMITED && (used > limit || n > limit - used)) {
            gv_pools_refresh();
            if (gv_untracked_held())
                gv_untracked_reconcile_all();
        }
    }
    if (region_reserve(r, dev, slot, n) == 0)
        return 0;
    gv_log(GV_LOG_INFO, "refused %llu bytes on entry %d: used %llu of %llu",
           (unsigned long long)n, dev, (unsigned long long)region_used(r, dev),
           (unsigned long long)region_limit(r, dev));
    return 1;
}

static atomic_int in_flight;
static _Atomic uint64_t begun;

int gv_charges_in_flight(void) { return atomic_load_explicit(&in_flight, memory_order_acquire); }

uint64_t gv_charges_begun(void) { return atomic_load_explicit(&begun, memory_order_acquire); }

void gv_charges_fork_child(void) { atomic_store(&in_flight, 0); }

/* A child forked while another thread's charge was in flight has no such
 * thread: its count starts at 0.  Registered with the first flight, so a
 * fork during it is covered (untracked.c's child handler also resets it). */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void register_fork(void) { pthread_atfork(NULL, NULL, gv_charges_fork_child); }

static void flight_begins(void)
{
    pthread_once(&fork_once, register_fork);
    atomic_fetch_add(&begun, 1);
    atomic_fetch_add(&in_flight, 1);
}

void gv_charge_flying(void) { flight_begins(); }

void gv_charge_landed(void) { atomic_fetch_sub(&in_flight, 1); }

CUresult gv_charge_begin(gv_charge *c, int ordinal, CUcontext ctx, uint64_t bytes)
{
    memset(c, 0, sizeof *c);
    gv_pending_frees_reap();
    /* Here, before the driver call, this process's charges and the
     * driver's figures agree; not in gv_charge_resize, which runs after the
     * driver has answered and before its answer is charged. */
    gv_untracked_tick();
    const gv_devinfo *d;
    CUresult rc = gv_device(ordinal, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t n = gv_round_up(bytes, d->granularity);
    int r = reserve(d->region_dev, n);
    if (r < 0)
        return GV_FAIL_CUDA;
    if (r > 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    flight_begins();
    c->active = 1;
    c->ordinal = ordinal;
    c->dev = d->region_dev;
    c->bytes = n;
    c->ctx = ctx;
    return CUDA_SUCCESS;
}

CUresult gv_charge_begin_current(gv_charge *c, uint64_t bytes)
{
    int ordinal;
    CUcontext ctx;
    memset(c, 0, sizeof *c);
    if (gv_current(&ordinal, &ctx) != CUDA_SUCCESS)
        return CUDA_SUCCESS;   /* let the driver report the missing context */
    return gv_charge_begin(c, ordinal, ctx, bytes);
}

CUresult gv_charge_resize(gv_charge *c, uint64_t bytes)
{
    if (!c->active)
        return CUDA_SUCCESS;
    const gv_devinfo *d;
    if (gv_device(c->ordinal, &d) != CUDA_SUCCESS)
        return GV_FAIL_CUDA;
    uint64_t n = gv_round_up(bytes, d->granularity);
    if (n > c->bytes) {
        int r = reserve(c->dev, n - c->bytes);
        if (r != 0)
            return r < 0 ? GV_FAIL_CUDA : CUDA_ERROR_OUT_OF_MEMORY;
    } else if (n < c->bytes) {
        gv_uncharge(c->dev, c->bytes - n);
    }
    c->bytes = n;
    return CUDA_SUCCESS;
}

void gv_charge_cancel(gv_charge *c)
{
    if (c->active && c->bytes)
        gv_uncharge(c->dev, c->bytes);
    if (c->active)
        atomic_fetch_sub(&in_flight, 1);
    c->active = 0;
    c->bytes = 0;
}

void gv_charge_keep(gv_charge *c)
{
    if (c->active) {
        atomic_fetch_sub(&in_flight, 1);
        gv_oversub_note(c->dev);
    }
    c->active = 0;
}

void gv_charge_commit(const gv_charge *c, int kind, uint64_t key, uint64_t aux)
{
    if (!c->active)
        return;
    gv_alloc a = { .key = key, .kind = (uint32_t)kind, .dev = c->dev,
                   .bytes = c->bytes, .aux = aux, .ctx = c->ctx };
    if (gv_table_put(&a) != 0)
        gv_log(GV_LOG_ERROR, "out of host memory tracking an allocation; "
               "its %llu bytes stay charged until the process exits",
               (unsigned long long)c->bytes);
    atomic_fetch_sub(&in_flight, 1);
    gv_oversub_note(c->dev);
}

void gv_charge_commit_spilled(const gv_charge *c, uint64_t key, uint64_t spilled)
{
    gv_charge_commit(c, spilled ? GV_K_SPILL : GV_K_PTR, key, spilled);
}

CUresult gv_charge_settle(gv_charge *c, CUresult rc, int kind, uint64_t key)
{
    if (rc == CUDA_SUCCESS)
        gv_charge_commit(c, kind, key, 0);
    else
        gv_charge_cancel(c);
    return rc;
}

int gv_untrack(uint32_t kind, uint64_t key, gv_destroy_fn destroy, void *arg, CUresult *rc)
{
    gv_alloc a;
    flight_begins();
    if (!gv_table_take(kind, key, &a)) {
        atomic_fetch_sub(&in_flight, 1);
        return 0;
    }
    *rc = destroy(key, arg);
    if (*rc == CUDA_SUCCESS)
        gv_uncharge_alloc(&a);
    else
        gv_table_put(&a);
    atomic_fetch_sub(&in_flight, 1);
    return 1;
}

void gv_uncharge(int dev, uint64_t bytes)
{
    gv_uncharge_spilled(dev, bytes, 0);
}

void gv_uncharge_spilled(int dev, uint64_t bytes, uint64_t spilled)
{
    if (bytes == 0)
        return;
    /* No slot: nothing charged here, or the slot was given back at exit
     * with all it held (region_own_slot). */
    int slot = region_own_slot(gv_core_region());
    if (slot >= 0)
        region_release_spill(gv_core_region(), dev, slot, bytes, spilled);
    gv_oversub_note(dev);
}

void gv_uncharge_alloc(const gv_alloc *a)
{
    gv_uncharge_spilled(a->dev, a->bytes, a->kind == GV_K_SPILL ? a->aux : 0);
}
