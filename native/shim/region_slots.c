/* region_slots.c - process slots: claim, leave, reclaim the dead. */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include "region_impl.h"

#include "gpuvisor.h"
#include "log.h"


/* ---- slots ---------------------------------------------------------------- */


void rg_raise_hwm(gv_region *r, uint32_t to)
{
    uint32_t h = atomic_load(&r->m->hdr.slot_hwm);
    while (h < to && !atomic_compare_exchange_weak(&r->m->hdr.slot_hwm, &h, to))
        ;
}


/* Claim the lowest free slot for owner word w (hwm is raised first, so a
 * claimer killed right after its CAS still leaves a reclaimable slot). */
int rg_claim_free_slot(gv_region *r, uint64_t w)
{
    for (int i = 0; i < GV_MAX_SLOTS; i++) {
        if (atomic_load(&r->m->owner[i]) != 0)
            continue;
        rg_raise_hwm(r, (uint32_t)i + 1);
        uint64_t zero = 0;
        if (atomic_compare_exchange_strong(&r->m->owner[i], &zero, w))
            return i;
    }
    return GV_EFULL;
}

/* Slot i is ours (same pid and start) but was claimed by the image before
 * an exec(): drop what it held.  That image may have left threads' inside
 * counts behind (they vanished mid-update).  None of this image's threads
 * can be inside with the slot yet (they wait for the caller), so they are
 * all stale: cleared first, or a gate closer waiting on them would keep
 * the gate, and this forget would wait for it. */
static void drop_old_image(gv_region *r, uint32_t i)
{
    for (int dev = 0; dev < GV_MAX_DEVICES; dev++)
        atomic_store(&r->m->dev[dev].inside[i], 0);
    rg_forget_slot(r, (int)i);
}

/* What the old image's main thread held when another of its threads
 * exec()ed: its identity is the process's (pid, start), which this image's
 * main thread has too, so to the others it stays alive, and a thread of
 * this image other than the main one would wait for it for good.  None of
 * this image's threads holds anything yet (the caller runs before they
 * use the region), so whatever carries that identity is the old image's:
 * a device entry it was initialising (the last entry: free again), a gate
 * it had closed (the recomputation finished), a slot it was reclaiming. */
static void take_over_old_main(gv_region *r, uint64_t me)
{
    uint64_t old = me | FLAG_BIT, mine = rg_thread_owner() | FLAG_BIT;
    for (int dev = 0; dev < GV_MAX_DEVICES; dev++) {
        struct gv_dev *d = &r->m->dev[dev];
        uint64_t s = old;
        if (atomic_compare_exchange_strong(&d->state, &s, DEV_FREE))
            continue;
        uint64_t g = old;
        if (atomic_compare_exchange_strong(&d->gate, &g, mine)) {
            rg_wait_outside(r, dev, -1);
            rg_recompute_locked(r, dev);
        }
    }
    uint32_t hwm = hwm_of(r);
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t o = old;
        if (!atomic_compare_exchange_strong(&r->m->owner[i], &o, mine))
            continue;
        rg_forget_slot(r, (int)i);
        atomic_store(&r->m->image[i], 0);
        uint64_t m = mine;
        atomic_compare_exchange_strong(&r->m->owner[i], &m, 0);
    }
}

int region_drop_old_image(gv_region *r)
{
    uint64_t me = rg_self_owner(), img = rg_image_id();
    if (r == NULL || (me >> PID_BITS) == 0)
        return 0;
    uint32_t hwm = hwm_of(r);
    for (uint32_t i = 0; i < hwm; i++) {
        if (atomic_load(&r->m->owner[i]) != me || atomic_load(&r->m->image[i]) == img)
            continue;
        /* The old threads' inside counts first (the gates' recomputations
         * would wait for them), then the old main thread's holdings (the
         * drop's own recomputation needs the gates). */
        for (int dev = 0; dev < GV_MAX_DEVICES; dev++)
            atomic_store(&r->m->dev[dev].inside[i], 0);
        take_over_old_main(r, me);
        drop_old_image(r, i);
        atomic_store(&r->m->image[i], 0);
        atomic_compare_exchange_strong(&r->m->owner[i], &me, 0);
        return 1;
    }
    return 0;
}

static int claim_self_slot(gv_region *r)
{
    uint64_t me = rg_self_owner(), img = rg_image_id();
    if ((me >> PID_BITS) == 0) {
        /* Without its start time every other process would take this one
         * for dead and reclaim its slot: refuse (fail closed). */
        gv_log(GV_LOG_ERROR, "region %s: cannot read this process's start time from /proc "
                             "(%s); not registering", r->path, strerror(errno));
        return GV_EIO;
    }
    uint32_t hwm = hwm_of(r);
    for (uint32_t i = 0; i < hwm; i++) {
        if (atomic_load(&r->m->owner[i]) != me)
            continue;
        /* Ours already: another handle of this image shares it; a slot of
         * the image before exec() (same pid and start) is reset. */
        if (atomic_load(&r->m->image[i]) != img) {
            drop_old_image(r, i);
            atomic_store(&r->m->image[i], img);
        }
        return (int)i;
    }
    for (int attempt = 0; attempt < 2; attempt++) {
        int s = rg_claim_free_slot(r, me);
        if (s >= 0) {
            /* A free slot holds nothing; if a straggler of its last owner
             * wrote to it after it was given up, drop that. */
            rg_forget_slot(r, s);
            atomic_store(&r->m->image[s], img);
            return s;
        }
        if (region_reclaim_dead(r) == 0)
            break;
    }
    gv_log(GV_LOG_ERROR, "region %s: all %d process slots are in use", r->path,
           GV_MAX_SLOTS);
    return GV_EFULL;
}

/* This process's fork generation (*gen) and r's slot cache word: the
 * generation it was written in << 32 | the slot + 1, SLOT_NONE or
 * SLOT_CLAIMING.  Inline: the memory path's fast path reads it. */
static inline __attribute__((always_inline)) uint64_t slot_cache(gv_region *r, uint64_t *gen)
{
    *gen = atomic_load_explicit(&rg_fork_gen, memory_order_relaxed);
    return atomic_load_explicit(&r->slot_cache, memory_order_acquire);
}

int region_self_slot(gv_region *r)
{
    if (r == NULL)
        return GV_EINVAL;
    uint64_t gen, c = slot_cache(r, &gen);
    for (;;) {
        if ((c >> 32) == gen) {
            uint32_t s = (uint32_t)c;
            if (s != SLOT_NONE && s != SLOT_CLAIMING)
                return (int)s - 1;
            if (s == SLOT_CLAIMING) {       /* another thread is registering */
                sched_yield();
                c = atomic_load(&r->slot_cache);
                continue;
            }
        }
        if (atomic_compare_exchange_weak(&r->slot_cache, &c, gen << 32 | SLOT_CLAIMING))
            break;
    }
    int s = claim_self_slot(r);
    atomic_store(&r->slot_cache, gen << 32 | (s >= 0 ? (uint32_t)s + 1 : SLOT_NONE));
    return s;
}

int region_own_slot(gv_region *r)
{
    if (r == NULL)
        return GV_EINVAL;
    uint64_t gen, c = slot_cache(r, &gen);
    if ((c >> 32) != gen || (uint32_t)c == SLOT_NONE)
        return GV_ENOENT;
    return region_self_slot(r);     /* registered, or another thread is at it */
}

/* Give up this process's slot when it exits, so that others see its memory
 * gone at once rather than at the next rg_reclaim.  Only when no thread of ours
 * is inside an accounting operation; otherwise the slot is left for the
 * rg_reclaim of dead processes. */
int region_leave(gv_region *r)
{
    if (r == NULL)
        return GV_EINVAL;
    uint64_t gen = atomic_load(&rg_fork_gen);
    uint64_t c = atomic_load(&r->slot_cache);
    uint32_t cs = (uint32_t)c;
    if ((c >> 32) != gen || cs == SLOT_NONE || cs == SLOT_CLAIMING)
        return GV_ENOENT;
    int slot = (int)cs - 1;
    for (int dev = 0; dev < GV_MAX_DEVICES; dev++) {
        struct gv_dev *d = &r->m->dev[dev];
        if (atomic_load(&d->state) != DEV_READY || atomic_load(&d->used[slot]) == 0)
            continue;
        rg_close_gate(r, dev);
        if (atomic_load(&d->inside[slot]) != 0) {     /* a thread of ours is busy */
            atomic_store(&d->gate, 0);
            return GV_EINVAL;
        }
        rg_wait_outside(r, dev, slot);
        atomic_store(&d->used[slot], 0);
        atomic_store(&d->spilled[slot], 0);
        rg_recompute_locked(r, dev);
    }
    atomic_store(&r->slot_cache, gen << 32 | SLOT_NONE);
    atomic_store(&r->m->image[slot], 0);
    uint64_t me = rg_self_owner();
    atomic_compare_exchange_strong(&r->m->owner[slot], &me, 0);
    return GV_OK;
}

/* Whether slot i holds memory (or a thread inside) on dev, or on any
 * device when dev < 0. */
static int holds(gv_region *r, uint32_t i, int dev)
{
    for (int d = dev < 0 ? 0 : dev; d < (dev < 0 ? GV_MAX_DEVICES : dev + 1); d++)
        if (atomic_load(&r->m->dev[d].used[i]) != 0 || atomic_load(&r->m->dev[d].inside[i]) != 0)
            return 1;
    return 0;
}

/* Whether owner word o's process is certainly gone: no process has its
 * pid (kill() answers ESRCH), so it has exited and been reaped.  One
 * system call and no /proc: cheap enough for every refusal (rg_reclaim's
 * quick look).  A zombie, a reused pid or a process that exec()ed away
 * from the region is left to the full look. */
static int owner_gone(uint64_t o)
{
    int32_t pid = (int32_t)(o & PID_MASK);
    return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH;
}

/* Reclaim dead slots; dev >= 0 looks only at slots holding memory there.
 * Also reclaimed: a free slot that a thread of its last owner charged
 * after the owner gave it up at exit (region_leave), and the slot of a
 * live process that no longer maps the region (it exec()ed a program that
 * does not use the GPU: the driver freed the old image's memory).
 * quick: only slots whose process is gone (owner_gone) or that were given
 * up with a straggler's charge, without reading /proc. */
int rg_reclaim(gv_region *r, int dev, int quick)
{
    int n = 0;
    uint32_t hwm = hwm_of(r);
    uint64_t self = rg_self_owner();
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t o = atomic_load(&r->m->owner[i]);
        if (o == self || ((o == 0 || dev >= 0) && !holds(r, i, dev)))
            continue;
        if (quick && o != 0 && ((o & FLAG_BIT) || !owner_gone(o)))
            continue;   /* (a slot being reclaimed: left to the full look) */
        if (o == 0 || quick) {
            /* given up, with a straggler's charge, or its process gone:
             * reclaimed like a dead one */
        } else if (o & FLAG_BIT) {
            /* Being reclaimed: by a live thread (not this one) -> leave it;
             * unless its process exec()ed a program without the region. */
            if (o != (rg_thread_owner() | FLAG_BIT) && rg_owner_alive(o) &&
                !rg_owner_left(r, o))
                continue;
        } else if (rg_owner_alive(o) &&
                   (!holds(r, i, dev) ||
                    gv_proc_maps_file((int32_t)(o & PID_MASK), r->path) != 0)) {
            continue;
        }
        uint64_t mine = rg_thread_owner() | FLAG_BIT;
        if (!atomic_compare_exchange_strong(&r->m->owner[i], &o, mine))
            continue;
        /* Exclusive now; forgetting is idempotent if we die and are taken over. */
        rg_forget_slot(r, (int)i);
        atomic_store(&r->m->image[i], 0);
        atomic_compare_exchange_strong(&r->m->owner[i], &mine, 0);
        n++;
    }
    if (n > 0)
        gv_log(GV_LOG_INFO, "region %s: reclaimed %d slot(s) of dead processes", r->path, n);
    return n;
}

int region_reclaim_dead(gv_region *r)
{
    return r != NULL ? rg_reclaim(r, -1, 0) : 0;
}

/* The live slots' PIDs (nvml 0), or the PIDs NVML shows for them (nvml 1;
 * slots that have not learned one are left out): up to cap written to
 * out, the total returned. */
static int live_pids(gv_region *r, int nvml, uint32_t *out, int cap)
{
    if (r == NULL)
        return GV_EINVAL;
    int n = 0;
    uint32_t hwm = hwm_of(r);
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t o = atomic_load(&r->m->owner[i]);
        if (o == 0 || (o & FLAG_BIT))
            continue;
        uint32_t pid = nvml ? atomic_load(&r->m->nvml_pid[i]) : (uint32_t)(o & PID_MASK);
        if (pid == 0)
            continue;
        if (out != NULL && n < cap)
            out[n] = pid;
        n++;
    }
    return n;
}

int region_process_list(gv_region *r, int32_t *pids, int cap)
{
    return live_pids(r, 0, (uint32_t *)pids, cap);   /* PIDs are below 2^22 */
}

void region_set_nvml_pid(gv_region *r, uint32_t pid)
{
    int slot = region_self_slot(r);
    if (slot >= 0)
        atomic_store(&r->m->nvml_pid[slot], pid);
}

int region_nvml_pid_list(gv_region *r, uint32_t *pids, int cap)
{
    return live_pids(r, 1, pids, cap);
}

int region_slot_of_pid(gv_region *r, int32_t pid)
{
    if (r == NULL || pid <= 0)
        return GV_EINVAL;
    uint64_t exact = rg_make_owner(pid, gv_proc_start_time(pid));
    int any = GV_ENOENT;
    uint32_t hwm = hwm_of(r);
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t o = atomic_load(&r->m->owner[i]);
        if (o == 0 || (o & FLAG_BIT) || (int32_t)(o & PID_MASK) != pid)
            continue;
        if (o == exact)
            return (int)i;
        if (any < 0)
            any = (int)i;     /* a stale entry of an older process */
    }
    return any;
}
