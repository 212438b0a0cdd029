/* region_account.c - reserving and releasing quota. */
#include "region_impl.h"

#include <time.h>

#include "gpuvisor.h"
#include "log.h"


/* ---- accounting -------------------------------------------------------------- *
 *
 * Each device keeps a running total of what its slots hold, so checking a
 * reservation and reading usage cost the same whatever the number of
 * processes.  A reservation is one fetch_add on the total: the value it
 * returns is the exact sum including every earlier reservation, so two
 * racers for the last bytes cannot both fit, and a refused one is taken
 * back at once.  The slot's own counter is the truth for that process.
 *
 * The total and a slot's counter are two words, so a process killed between
 * updating one and the other would leave the total wrong.  Every update is
 * therefore made "inside a gate": the slot's inside[] counter is raised
 * first and lowered last.  Whoever reclaims a dead slot closes the gate (one
 * CAS on a word naming the closer), waits until no live slot is inside, and
 * recomputes the total from the slots' counters, leaving the dead one out.
 * Nobody can be half-way through an update then, whatever a dead process
 * was doing.  A closer that dies is taken over by the next process that
 * finds the gate shut.  The gate is only ever closed to rg_reclaim a dead
 * process, so the fast path never waits on it in normal operation.
 */


static void recompute(gv_region *r, int dev, int forget);

/* Wait for an open gate; take over a gate whose closer died. */
static void wait_gate(gv_region *r, int dev)
{
    struct gv_dev *d = &r->m->dev[dev];
    for (unsigned waits = 1;; waits++) {
        uint64_t g = atomic_load(&d->gate);
        if (g == 0)
            return;
        if ((waits % 64 == 0 && !rg_owner_alive(g)) ||
            (waits % 4096 == 0 && rg_owner_left(r, g))) {
            recompute(r, dev, -1);       /* finish the dead closer's work */
            continue;
        }
        sched_yield();
    }
}

static void enter(gv_region *r, int dev, int slot)
{
    struct gv_dev *d = &r->m->dev[dev];
    for (;;) {
        atomic_fetch_add(&d->inside[slot], 1);
        if (atomic_load(&d->gate) == 0)
            return;
        atomic_fetch_sub(&d->inside[slot], 1);
        wait_gate(r, dev);
    }
}

static void leave(gv_region *r, int dev, int slot)
{
    atomic_fetch_sub(&r->m->dev[dev].inside[slot], 1);
}

/* Close dev's gate for the calling thread (taking over a dead closer). */
void rg_close_gate(gv_region *r, int dev)
{
    struct gv_dev *d = &r->m->dev[dev];
    uint64_t mine = rg_thread_owner() | FLAG_BIT;
    for (unsigned waits = 1;; waits++) {
        uint64_t g = atomic_load(&d->gate);
        if (g == mine)
            return;
        if (g == 0 || (waits % 64 == 0 && !rg_owner_alive(g)) ||
            (waits % 4096 == 0 && rg_owner_left(r, g))) {
            if (atomic_compare_exchange_strong(&d->gate, &g, mine))
                return;
            continue;
        }
        sched_yield();
    }
}

/* Wait until no live slot other than `forget` is inside dev's gate. */
void rg_wait_outside(gv_region *r, int dev, int forget)
{
    struct gv_dev *d = &r->m->dev[dev];
    uint32_t hwm = hwm_of(r);
    for (uint32_t k = 0; k < hwm; k++) {
        for (unsigned waits = 1; (int)k != forget && atomic_load(&d->inside[k]) != 0; waits++) {
            /* A dead process stays inside for ever: its counter is left
             * out of the total below, so it does not matter where it died.
             * A slot being reclaimed (FLAG_BIT) is a dead process's too,
             * whoever reclaims it: its reclaimer may be waiting for this
             * very gate. */
            uint64_t o = atomic_load(&r->m->owner[k]);
            if (waits % 16 == 0 && (o == 0 || (o & FLAG_BIT) || !rg_owner_alive(o)))
                break;
            /* A live owner inside for long may have exec()ed while a thread
             * was in here: the count is its old image's if the process no
             * longer maps the region (a new image that maps it resets the
             * count when it claims the slot). */
            if (waits % 4096 == 0 &&
                gv_proc_maps_file((int32_t)(o & PID_MASK), r->path) == 0)
                break;
            sched_yield();
        }
    }
}

/* With the gate closed: drop slot `forget` (if >= 0) and set the total to
 * the sum of the slots' counters; then open the gate. */
static void recompute(gv_region *r, int dev, int forget)
{
    struct gv_dev *d = &r->m->dev[dev];
    rg_close_gate(r, dev);
    rg_wait_outside(r, dev, forget);
    if (forget >= 0) {
        atomic_store(&d->used[forget], 0);
        atomic_store(&d->spilled[forget], 0);
        rg_test_delay();
        atomic_store(&d->inside[forget], 0);
    }
    rg_recompute_locked(r, dev);
}

/* Gate closed by us, nobody live inside: set the total, open the gate. */
void rg_recompute_locked(gv_region *r, int dev)
{
    struct gv_dev *d = &r->m->dev[dev];
    uint64_t sum = 0, spilled = 0;
    uint32_t hwm = hwm_of(r);
    for (uint32_t k = 0; k < hwm; k++) {
        sum = sat_add(sum, atomic_load(&d->used[k]));
        spilled = sat_add(spilled, atomic_load(&d->spilled[k]));
    }
    atomic_store(&d->total, sum);
    atomic_store(&d->spilled_total, spilled);
    atomic_store(&d->gate, 0);
}

/* Remove a slot's holdings from every device (its process is gone). */
void rg_forget_slot(gv_region *r, int slot)
{
    atomic_store(&r->m->nvml_pid[slot], 0);
    for (int dev = 0; dev < GV_MAX_DEVICES; dev++) {
        struct gv_dev *d = &r->m->dev[dev];
        if (atomic_load(&d->state) != DEV_READY)
            continue;
        if (atomic_load(&d->used[slot]) != 0 || atomic_load(&d->inside[slot]) != 0 ||
            atomic_load(&d->gate) != 0)
            recompute(r, dev, slot);
    }
}

static _Atomic int g_release_underflow_logged;

static int refuse(struct gv_dev *d)
{
    atomic_fetch_add(&d->oom_count, 1);
    return GV_ENOMEM;
}

/* The device entry slot charges, or NULL with *err (GV_EINVAL, GV_ENOENT). */
static struct gv_dev *charge_target(gv_region *r, int dev, int slot, int *err)
{
    if (!dev_ok(r, dev) || slot < 0 || slot >= GV_MAX_SLOTS) {
        *err = GV_EINVAL;
        return NULL;
    }
    struct gv_dev *d = &r->m->dev[dev];
    if (atomic_load(&d->state) != DEV_READY) {
        *err = GV_ENOENT;
        return NULL;
    }
    return d;
}

/* Whether a refusal on d should look for dead processes' memory now: the
 * first refusal after RECLAIM_EVERY_NS since the last look, in any process
 * of the container, wins the compare-and-swap and does it; the others make
 * only the quick look (rg_reclaim quick: one kill() per slot holding
 * memory on d, for processes gone and reaped; at most every QUICK_EVERY_NS
 * per device in each process, the coarse clock's tick: 1-4 ms) and are
 * refused unless it found some.  A process that has not refused in the
 * last tick, such as one just started, sees a reaped process's memory at
 * once; one that keeps retrying, within a tick.  A look opens /proc files of every process holding
 * memory (milliseconds at 64 processes): made on every refusal, it made a
 * refusal cost O(processes), and programs that probe by allocating until
 * refused, or retry on out-of-memory, refuse often.  No lock: a winner
 * killed before or during its look leaves only the time, and the next
 * refusal after the interval looks again.  A time ahead of now (another
 * boot's, or a value the container wrote) counts as long past.  The looker
 * stores the time again when its look ends (region_reserve). */
static uint64_t coarse_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);   /* a few ms fine: cheaper */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int due(_Atomic uint64_t *at, uint64_t every)
{
    uint64_t now = coarse_ns();
    uint64_t last = atomic_load_explicit(at, memory_order_relaxed);
    if (last != 0 && now - last < every)
        return 0;
    return atomic_compare_exchange_strong(at, &last, now);
}

int region_reserve(gv_region *r, int dev, int slot, uint64_t n)
{
    return region_reserve_spill(r, dev, slot, n, 0);
}

int region_reserve_spill(gv_region *r, int dev, int slot, uint64_t n, uint64_t spill)
{
    int err = GV_OK;
    struct gv_dev *d = charge_target(r, dev, slot, &err);
    if (!d || n == 0)
        return err;
    if (spill > n)
        return GV_EINVAL;
    if (n > MAX_RESERVE)
        return refuse(d);
    int tries = 0, reclaimed = 0;
    for (;;) {
        uint64_t limit = atomic_load(&d->limit);
        if (limit != GV_UNLIMITED && n > limit)
            return refuse(d);
        enter(r, dev, slot);
        uint64_t total = atomic_fetch_add(&d->total, n) + n;
        if (limit == GV_UNLIMITED || total <= limit) {
            atomic_fetch_add(&d->used[slot], n);
            if (spill) {
                atomic_fetch_add(&d->spilled[slot], spill);
                atomic_fetch_add(&d->spilled_total, spill);
            }
            leave(r, dev, slot);
            return GV_OK;
        }
        atomic_fetch_sub(&d->total, n);
        leave(r, dev, slot);
        /* Room now?  Then we only collided with racers that took theirs
         * back: retry after a short random wait. */
        if (atomic_load(&d->total) <= limit - n && ++tries < RESERVE_TRIES) {
            rg_backoff(slot, tries);
            continue;
        }
        if (!reclaimed) {
            reclaimed = 1;
            int n;
            if (due(&d->reclaim_at, RECLAIM_EVERY_NS)) {
                n = rg_reclaim(r, dev, 0);
                /* The interval runs from the end of the look: one that took
                 * long (many processes, a slow /proc) is not followed by
                 * another at once. */
                atomic_store(&d->reclaim_at, coarse_ns());
            } else if (due(&r->quick_at[dev], QUICK_EVERY_NS)) {
                /* A process killed and reaped since the last look: its
                 * memory is free at once, as a driver's would be. */
                n = rg_reclaim(r, dev, 1);
            } else {
                n = 0;
            }
            if (n > 0)
                continue;
        }
        return refuse(d);
    }
}

int region_charge_held(gv_region *r, int dev, int slot, uint64_t n)
{
    int err = GV_OK;
    struct gv_dev *d = charge_target(r, dev, slot, &err);
    if (!d || n == 0)
        return err;
    enter(r, dev, slot);
    atomic_fetch_add(&d->total, n);
    atomic_fetch_add(&d->used[slot], n);
    leave(r, dev, slot);
    return GV_OK;
}

void region_release(gv_region *r, int dev, int slot, uint64_t n)
{
    region_release_spill(r, dev, slot, n, 0);
}

/* Take up to n off *c; returns what was taken. */
static uint64_t take_off(_Atomic uint64_t *c, uint64_t n)
{
    uint64_t old = atomic_load(c);
    while (!atomic_compare_exchange_weak(c, &old, old >= n ? old - n : 0))
        ;
    return old >= n ? n : old;
}

void region_spill_move(gv_region *r, int dev, int slot, uint64_t n)
{
    if (!dev_ready(r, dev) || slot < 0 || slot >= GV_MAX_SLOTS || n == 0)
        return;
    struct gv_dev *d = &r->m->dev[dev];
    enter(r, dev, slot);
    uint64_t used = atomic_load(&d->used[slot]), sp = atomic_load(&d->spilled[slot]);
    uint64_t room = used > sp ? used - sp : 0;
    n = n < room ? n : room;
    atomic_fetch_add(&d->spilled[slot], n);
    atomic_fetch_add(&d->spilled_total, n);
    leave(r, dev, slot);
}

void region_release_spill(gv_region *r, int dev, int slot, uint64_t n, uint64_t spill)
{
    if (!dev_ok(r, dev) || slot < 0 || slot >= GV_MAX_SLOTS || n == 0)
        return;
    struct gv_dev *d = &r->m->dev[dev];
    enter(r, dev, slot);
    if (spill) {
        uint64_t took = take_off(&d->spilled[slot], spill < n ? spill : n);
        atomic_fetch_sub(&d->spilled_total, took);
    }
    _Atomic uint64_t *c = &d->used[slot];
    uint64_t old = atomic_load(c);
    while (!atomic_compare_exchange_weak(c, &old, old >= n ? old - n : 0))
        ;
    atomic_fetch_sub(&d->total, old >= n ? n : old);
    leave(r, dev, slot);
    if (old < n && !atomic_exchange(&g_release_underflow_logged, 1))
        gv_log(GV_LOG_ERROR,
               "region %s: device %d slot %d released %llu bytes but held only %llu "
               "(clamped to 0; accounting bug)", r->path, dev, slot,
               (unsigned long long)n, (unsigned long long)old);
}

uint64_t region_used(gv_region *r, int dev)
{
    if (!dev_ok(r, dev))
        return 0;
    /* May briefly include a reservation that is about to be refused. */
    return atomic_load(&r->m->dev[dev].total);
}

uint64_t region_spilled(gv_region *r, int dev)
{
    return dev_ok(r, dev) ? atomic_load(&r->m->dev[dev].spilled_total) : 0;
}

uint64_t region_slot_spilled(gv_region *r, int dev, int slot)
{
    if (!dev_ok(r, dev) || slot < 0 || slot >= GV_MAX_SLOTS)
        return 0;
    return atomic_load(&r->m->dev[dev].spilled[slot]);
}

uint64_t region_slot_resident(gv_region *r, int dev, int slot)
{
    uint64_t sp = region_slot_spilled(r, dev, slot), u = region_slot_used(r, dev, slot);
    return u > sp ? u - sp : 0;
}

uint64_t region_resident(gv_region *r, int dev)
{
    if (!dev_ok(r, dev))
        return 0;
    /* Spilled first: a release lowers it before the total, a reservation
     * raises the total first, so the difference never wraps for long;
     * clamp the instant it would. */
    uint64_t sp = atomic_load(&r->m->dev[dev].spilled_total);
    uint64_t t = atomic_load(&r->m->dev[dev].total);
    return t > sp ? t - sp : 0;
}

uint64_t region_guarantee(gv_region *r, int dev)
{
    return dev_ok(r, dev) ? atomic_load(&r->m->dev[dev].guarantee) : 0;
}

void region_set_guarantee(gv_region *r, int dev, uint64_t bytes)
{
    if (dev_ok(r, dev) && atomic_load(&r->m->dev[dev].guarantee) != bytes)
        atomic_store(&r->m->dev[dev].guarantee, bytes);
}

/* The sum of one of dev's per-slot counter arrays (col: used, spilled or
 * inside) over the slots ever claimed; 0 for a device out of range. */
#define SLOT_SUM(r, dev, col)                                                   \
    (dev_ok(r, dev) ? slot_sum(r, (r)->m->dev[dev].col) : 0)

static uint64_t slot_sum(gv_region *r, const _Atomic uint64_t *col)
{
    uint64_t sum = 0;
    uint32_t hwm = hwm_of(r);
    for (uint32_t k = 0; k < hwm; k++)
        sum = sat_add(sum, atomic_load(&col[k]));
    return sum;
}

uint64_t region_test_spill_sum(gv_region *r, int dev) { return SLOT_SUM(r, dev, spilled); }

uint64_t region_slot_used(gv_region *r, int dev, int slot)
{
    if (!dev_ok(r, dev) || slot < 0 || slot >= GV_MAX_SLOTS)
        return 0;
    return atomic_load(&r->m->dev[dev].used[slot]);
}

/* ---- test hooks ------------------------------------------------------------ */

int region_test_claim_slot(gv_region *r, int32_t pid, uint64_t start)
{
    if (r == NULL || pid <= 0)
        return GV_EINVAL;
    return rg_claim_free_slot(r, rg_make_owner(pid, start));
}

int region_test_mark_reclaiming(gv_region *r, int slot, int32_t pid, uint64_t start)
{
    if (r == NULL || slot < 0 || slot >= GV_MAX_SLOTS || pid <= 0)
        return GV_EINVAL;
    rg_raise_hwm(r, (uint32_t)slot + 1);
    atomic_store(&r->m->owner[slot], rg_make_owner(pid, start) | FLAG_BIT);
    return GV_OK;
}

uint64_t region_test_inside(gv_region *r, int dev) { return SLOT_SUM(r, dev, inside); }

uint64_t region_test_slot_sum(gv_region *r, int dev) { return SLOT_SUM(r, dev, used); }
