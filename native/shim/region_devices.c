/* region_devices.c - device entries and their limits. */
#include "region_impl.h"

#include "gpuvisor.h"
#include "log.h"

#include <string.h>

/* ---- devices ---------------------------------------------------------------- */



static void init_device(struct gv_dev *d, const unsigned char uuid[16],
                        uint64_t physical_total, uint64_t limit)
{
    memcpy(d->uuid, uuid, 16);
    rg_test_delay();
    atomic_store(&d->limit, limit);
    atomic_store(&d->physical_total, physical_total);
    atomic_store(&d->oom_count, 0);
    atomic_store(&d->ctx_cost, 0);
    atomic_store(&d->limit_by, 0);
    atomic_store(&d->guarantee, 0);
    for (int i = 0; i < GV_MAX_SLOTS; i++) {
        atomic_store_explicit(&d->used[i], 0, memory_order_relaxed);
        atomic_store_explicit(&d->spilled[i], 0, memory_order_relaxed);
        atomic_store_explicit(&d->inside[i], 0, memory_order_relaxed);
    }
    atomic_store(&d->total, 0);
    atomic_store(&d->spilled_total, 0);
    atomic_store(&d->gate, 0);
    memset(&d->sm, 0, sizeof d->sm);
}

int region_device_lookup(gv_region *r, const unsigned char uuid[16],
                         uint64_t physical_total, uint64_t limit)
{
    if (r == NULL || uuid == NULL)
        return GV_EINVAL;
    for (int i = 0; i < GV_MAX_DEVICES; i++) {
        struct gv_dev *d = &r->m->dev[i];
        unsigned waits = 0;
        for (;;) {
            uint64_t s = atomic_load(&d->state);
            if (s == DEV_READY) {
                if (memcmp(d->uuid, uuid, 16) != 0)
                    break;
                uint64_t zero = 0;
                if (physical_total != 0)
                    atomic_compare_exchange_strong(&d->physical_total, &zero, physical_total);
                return i;
            }
            if (s != DEV_FREE && !(s & FLAG_BIT))
                break;                      /* garbage state: skip the entry */
            if (s != DEV_FREE && s != (rg_thread_owner() | FLAG_BIT)) {
                /* Someone is initialising it; wait unless they died.  The
                 * liveness check reads /proc, so do it only now and then. */
                if (++waits % 16 != 0 ||
                    (rg_owner_alive(s) && (waits % 4096 != 0 || !rg_owner_left(r, s)))) {
                    sched_yield();
                    continue;
                }
            }
            uint64_t mine = rg_thread_owner() | FLAG_BIT;
            if (!atomic_compare_exchange_strong(&d->state, &s, mine))
                continue;
            init_device(d, uuid, physical_total, limit);
            atomic_store(&d->state, DEV_READY);
            return i;
        }
    }
    return GV_EFULL;
}

int region_device_find(gv_region *r, const unsigned char uuid[16])
{
    if (r == NULL || uuid == NULL)
        return GV_EINVAL;
    for (int i = 0; i < GV_MAX_DEVICES; i++)
        if (dev_ready(r, i) && memcmp(r->m->dev[i].uuid, uuid, 16) == 0)
            return i;
    return GV_ENOENT;
}

int region_device_ready(gv_region *r, int dev)
{
    return dev_ready(r, dev);
}

int region_device_count(gv_region *r)
{
    if (r == NULL)
        return 0;
    int n = 0;
    for (int i = 0; i < GV_MAX_DEVICES; i++)
        if (atomic_load(&r->m->dev[i].state) != DEV_FREE)
            n = i + 1;
    return n;
}

void region_device_uuid(gv_region *r, int dev, unsigned char uuid[16])
{
    if (uuid == NULL)
        return;
    if (dev_ready(r, dev))
        memcpy(uuid, r->m->dev[dev].uuid, 16);
    else
        memset(uuid, 0, 16);
}

uint64_t region_device_physical_total(gv_region *r, int dev)
{
    return dev_ok(r, dev) ? atomic_load(&r->m->dev[dev].physical_total) : 0;
}

uint64_t region_limit(gv_region *r, int dev)
{
    return dev_ok(r, dev) ? atomic_load(&r->m->dev[dev].limit) : GV_UNLIMITED;
}

void region_set_limit(gv_region *r, int dev, uint64_t limit)
{
    if (!dev_ok(r, dev))
        return;
    /* The setter first: a newcomer that reads it 0 (or dead) between the
     * two stores may put its environment's limit back over this one; the
     * supervisor sets a pushed limit again whenever the region shows
     * another value. */
    atomic_store(&r->m->dev[dev].limit_by, rg_self_owner());
    atomic_fetch_or(&r->m->dev[dev].sm.configured, GV_MEM_LIMIT_SET);
    atomic_store(&r->m->dev[dev].limit, limit);
}

/* Whether a process of the region other than this one is registered and
 * alive (reads /proc for each registered slot: call it rarely). */
static int others_alive(gv_region *r)
{
    uint64_t self = rg_self_owner();
    uint32_t hwm = hwm_of(r);
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t o = atomic_load(&r->m->owner[i]);
        if (o != 0 && !(o & FLAG_BIT) && o != self && rg_owner_alive(o))
            return 1;
    }
    return 0;
}

int region_device_take_limit(gv_region *r, int dev, uint64_t limit, uint64_t *current)
{
    if (!dev_ready(r, dev) || current == NULL)
        return GV_EINVAL;
    struct gv_dev *d = &r->m->dev[dev];
    uint64_t by = atomic_load(&d->limit_by);
    uint64_t cur = atomic_load(&d->limit);
    *current = cur;
    if ((by != 0 && rg_owner_alive(by)) || others_alive(r))
        return cur == limit || (atomic_load(&d->sm.configured) & GV_MEM_LIMIT_SET) ? GV_OK
                                                                                   : GV_EBUSY;
    /* Nobody left of whoever set the entry up: what it holds is the last
     * run's, and this environment's limits apply, SM included. */
    atomic_store(&d->limit, limit);
    atomic_compare_exchange_strong(&d->limit_by, &by, 0);
    atomic_fetch_and(&d->sm.configured,
                     ~(uint32_t)(GV_SM_CONFIGURED | GV_SM_LIMIT_SET | GV_MEM_LIMIT_SET));
    *current = limit;
    return GV_OK;
}

uint64_t region_ctx_cost(gv_region *r, int dev)
{
    return dev_ready(r, dev) ? atomic_load(&r->m->dev[dev].ctx_cost) : 0;
}

void region_learn_ctx_cost(gv_region *r, int dev, uint64_t cost)
{
    if (!dev_ready(r, dev) || cost == 0)
        return;
    _Atomic uint64_t *c = &r->m->dev[dev].ctx_cost;
    uint64_t old = atomic_load(c);
    while ((old == 0 || cost < old) && !atomic_compare_exchange_weak(c, &old, cost))
        ;
}

uint64_t region_oom_count(gv_region *r, int dev)
{
    return dev_ok(r, dev) ? atomic_load(&r->m->dev[dev].oom_count) : 0;
}

struct gv_sm *region_sm(gv_region *r, int dev)
{
    return dev_ok(r, dev) ? &r->m->dev[dev].sm : NULL;
}

/* Around every change to what gates launches: see sm_writers in region_impl.h. */
static void sm_change_begin(gv_region *r)
{
    atomic_fetch_add(&r->m->hdr.sm_writers, 1);
    atomic_fetch_add(&r->m->hdr.sm_gen, 1);
}

static void sm_change_end(gv_region *r)
{
    rg_test_delay();            /* tests: a writer killed in the middle */
    atomic_fetch_add(&r->m->hdr.sm_gen, 1);
    atomic_fetch_sub(&r->m->hdr.sm_writers, 1);
}

void region_sm_set_share(struct gv_sm *sm, uint32_t share)
{
    uint32_t old = atomic_exchange(&sm->share, share);
    /* A pause (0) has no scale: the debt keeps the one before it, and the
     * share that ends the pause rescales it from there.  Skipped instead,
     * a limit raised from 5 to 100 % during a pause left the debt run up
     * at 5 % to be paid at 100 %, and one lowered again after it
     * multiplied that by 20 (every such pause did it once more). */
    if (share == 0) {
        if (old != 0)
            atomic_store(&sm->paused_from, old);
        return;
    }
    if (old == 0)
        old = atomic_load(&sm->paused_from);
    if (old == share || old == 0)
        return;
    /* Debt run up at the old share is paid at the new one. */
    uint64_t now = rg_now_ns();
    uint64_t t = atomic_load(&sm->tat);
    while (t > now) {
        uint64_t nt = now + (t - now) * (old > 10000 ? 10000 : old) / (share > 10000 ? 10000 : share);
        if (atomic_compare_exchange_weak(&sm->tat, &t, nt))
            break;
    }
}

/* The yield flag was cleared: an entry without a limit runs at the whole
 * GPU at once, rather than at the 0 % its processes' meters last set
 * (none may run to set it again once its launches are no longer gated). */
static void sm_unpause(struct gv_sm *sm)
{
    if (atomic_load(&sm->limit) == 0)
        atomic_store(&sm->share, 10000);
}

void region_sm_configure(gv_region *r, int dev, unsigned limit, unsigned policy, unsigned priority)
{
    struct gv_sm *sm = region_sm(r, dev);
    if (sm == NULL || (atomic_load(&sm->configured) & GV_SM_CONFIGURED))
        return;
    sm_change_begin(r);
    /* A limit set live before the first process configured the entry (the
     * entry made by an NVML query, or by the region API, before CUDA
     * started) stands: the environment's is the default, not an override. */
    if (atomic_load(&sm->configured) & GV_SM_LIMIT_SET)
        limit = atomic_load(&sm->limit);
    atomic_store(&sm->limit, limit > 100 ? 100 : limit);
    atomic_store(&sm->policy, policy);
    atomic_store(&sm->priority, priority);
    atomic_store(&sm->share, (limit == 0 || limit > 100 ? 100 : limit) * 100);
    atomic_fetch_or(&sm->configured, GV_SM_CONFIGURED);
    /* Not for a low priority alone: a low-priority container without a
     * limit keeps the fast path until its yield flag is set
     * (region_sm_set_yield sets sm_any then). */
    if (limit > 0)
        atomic_store(&r->m->hdr.sm_any, 1);
    sm_change_end(r);
}

void region_sm_set_yield(gv_region *r, int dev, uint64_t until_ns)
{
    struct gv_sm *sm = region_sm(r, dev);
    if (sm == NULL)
        return;
    /* Renewing a lease that is set changes nothing a process may have
     * cached (region_sm_gated: the entry gates either way), so it makes no
     * change: one compare-and-swap, as the supervisor renews it at every
     * tick.  If the flag was cleared meanwhile, the change below sets it. */
    uint64_t cur = atomic_load(&sm->yield_until);
    if (until_ns != 0 && cur != 0 &&
        atomic_compare_exchange_strong(&sm->yield_until, &cur, until_ns))
        return;
    sm_change_begin(r);
    if (until_ns != 0)
        atomic_store(&r->m->hdr.sm_any, 1);   /* before the flag: no launch misses it */
    atomic_store(&sm->yield_until, until_ns);
    if (until_ns == 0)
        sm_unpause(sm);
    sm_change_end(r);
}

void region_sm_end_yield(gv_region *r, int dev, uint64_t until_ns)
{
    struct gv_sm *sm = region_sm(r, dev);
    if (sm == NULL || until_ns == 0)
        return;
    sm_change_begin(r);
    /* Only the lease that was read: one renewed meanwhile stands (and a
     * renewal that meets 0 here sets the flag again as a change). */
    uint64_t cur = until_ns;
    if (atomic_compare_exchange_strong(&sm->yield_until, &cur, 0))
        sm_unpause(sm);
    sm_change_end(r);
}

void region_sm_set_limit(gv_region *r, int dev, unsigned limit)
{
    struct gv_sm *sm = region_sm(r, dev);
    if (sm == NULL)
        return;
    if (limit > 100)
        limit = 100;
    sm_change_begin(r);
    atomic_store(&r->m->dev[dev].limit_by, rg_self_owner());   /* see region_set_limit */
    atomic_store(&sm->limit, limit);
    atomic_fetch_or(&sm->configured, GV_SM_LIMIT_SET);
    /* The debt run up at the old share is rescaled, as when the meter
     * changes the share: a limit raised from 5 to 100 % applies to the next
     * launch, which otherwise waited out at 5 % what a long kernel ran up
     * (4 s after a 200 ms kernel). */
    if (atomic_load(&sm->policy) == GV_SM_FIXED)
        region_sm_set_share(sm, (limit == 0 ? 100 : limit) * 100);
    if (limit > 0)
        atomic_store(&r->m->hdr.sm_any, 1);
    sm_change_end(r);
}

static int sm_gated_now(gv_region *r)
{
    for (int dev = 0; dev < GV_MAX_DEVICES; dev++)
        if (region_sm_gates(&r->m->dev[dev].sm))
            return 1;
    return 0;
}

int region_sm_gated(gv_region *r, _Atomic uint64_t *cache)
{
    struct gv_header *h = &r->m->hdr;
    uint32_t writers = atomic_load_explicit(&h->sm_writers, memory_order_acquire);
    uint32_t gen = atomic_load_explicit(&h->sm_gen, memory_order_acquire);
    uint64_t c = atomic_load_explicit(cache, memory_order_relaxed);
    uint64_t tag = ((uint64_t)gen + 1) << 1;       /* never 0: a zero cache is empty */
    if (writers == 0 && (c & ~UINT64_C(1)) == tag)
        return (int)(c & 1);
    int gated = sm_gated_now(r);
    /* Cache only a look that no change overlapped. */
    if (writers == 0 && atomic_load(&h->sm_gen) == gen)
        atomic_store_explicit(cache, tag | (uint64_t)gated, memory_order_relaxed);
    return gated;
}

int region_sm_any(gv_region *r)
{
    return r != NULL && atomic_load_explicit(&r->m->hdr.sm_any, memory_order_relaxed) != 0;
}

_Atomic uint32_t *region_sm_any_flag(gv_region *r)
{
    return &r->m->hdr.sm_any;
}
