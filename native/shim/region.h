/*
 * region.h - the container-wide shared accounting region (internal).
 *
 * One file per container, mmap'ed MAP_SHARED by every process of the
 * container.  The layout is private to region_*.c (region_impl.h).
 *
 * Accounting model (no lock on the fast path, crash-safe):
 *  - Each process owns one slot.  Its usage per device is a counter that
 *    only the owner changes (atomic add/sub); anyone may read it.
 *  - Each device also keeps a running total.  A reservation is a single
 *    fetch_add on the total, whose result is the exact sum with every
 *    earlier reservation: if it passes the limit it is taken back, so two
 *    racers for the last bytes cannot both succeed and the total never
 *    passes the limit by a single byte.  Cost does not grow with the
 *    number of processes.
 *  - Total and slot counter change "inside a gate" (a per-slot counter of
 *    operations in progress).  Reclaiming a dead process closes the gate,
 *    waits for the live processes to be outside, drops the dead slot and
 *    recomputes the total from the slot counters, so a process killed
 *    between two updates cannot leave the total wrong.
 *  - Slot owners are identified by (pid, process start time), which
 *    guards against PID reuse.
 */
#ifndef GV_REGION_H
#define GV_REGION_H

#include <stddef.h>
#include <stdatomic.h>
#include <stdint.h>

#define GV_REGION_MAGIC 0x31485356504756ULL   /* "GVPVSH1" little-endian-ish tag */
#define GV_REGION_VERSION 10u
#define GV_MAX_SLOTS 1024
#define GV_MAX_DEVICES 16
#define GV_DEFAULT_REGION_PATH "/tmp/gpuvisor-region.shr"

typedef struct gv_region gv_region;   /* process-local handle */

/* Open path, creating and initialising it atomically if it does not
 * exist.  On failure returns a GV_E* code and writes a one-line message
 * naming the file into err. */
int region_open(const char *path, gv_region **out, char *err, size_t errlen);
void region_close(gv_region *r);
const char *region_path(const gv_region *r);

/* --- process slots --------------------------------------------------- */

/* The calling process's slot, registering it on first use (also after
 * fork: the child gets its own slot).  A stale slot with the same pid and
 * start time (left by the image before an exec) is reset and reused.
 * Returns the slot index, or a negative GV_E* code. */
int region_self_slot(gv_region *r);

/* Drop the slot the image before an exec() of this process left (same pid
 * and start time, another image): the driver freed its memory, and a new
 * image that maps the region without charging anything (NVML only, or
 * CUDA before its first context) would otherwise keep it charged, since
 * the others cannot tell it from the old one.  Called once when the
 * library sets itself up, before any of its threads uses a slot.
 * Returns 1 if one was dropped. */
int region_drop_old_image(gv_region *r);

/* The calling process's slot as it stands, never registering: GV_ENOENT
 * when it has none (never registered in this fork generation, or given
 * back at exit: what it held went with it).  For releases, so that memory
 * freed after region_leave (a library destructor that runs after this
 * one's, a thread still running while the process exits) is not taken
 * from a slot registered anew for the purpose. */
int region_own_slot(gv_region *r);

/* Give up the calling process's slot (at exit), releasing what it holds.
 * GV_OK, GV_ENOENT (no slot), or GV_EINVAL when a thread of the process is
 * in the middle of an accounting operation (the slot is then left to be
 * reclaimed once the process is dead). */
int region_leave(gv_region *r);

/* Reclaim the slots of dead processes.  Returns the number reclaimed. */
int region_reclaim_dead(gv_region *r);

/* Registered processes: writes up to cap pids, returns the total. */
int region_process_list(gv_region *r, int32_t *pids, int cap);
/* The PID NVML shows for this process (its slot's; NVML reports the host's
 * PIDs, which differ inside a PID namespace), and those of all registered
 * processes that learned theirs (writes up to cap, returns the total). */
void region_set_nvml_pid(gv_region *r, uint32_t pid);
int region_nvml_pid_list(gv_region *r, uint32_t *pids, int cap);
/* Slot index of pid, or GV_ENOENT. */
int region_slot_of_pid(gv_region *r, int32_t pid);

/* --- devices ----------------------------------------------------------- */

/* Find the entry for uuid, or claim a new one initialised with
 * physical_total and limit.  Returns the entry index or GV_EFULL. */
int region_device_lookup(gv_region *r, const unsigned char uuid[16],
                         uint64_t physical_total, uint64_t limit);
/* Find without creating: index or GV_ENOENT. */
int region_device_find(gv_region *r, const unsigned char uuid[16]);
int region_device_count(gv_region *r);
/* 1 if entry dev is initialised (READY), else 0. */
int region_device_ready(gv_region *r, int dev);
void region_device_uuid(gv_region *r, int dev, unsigned char uuid[16]);
uint64_t region_device_physical_total(gv_region *r, int dev);

uint64_t region_limit(gv_region *r, int dev);
/* A live change (set-limit, through the supervisor; region_sm_set_limit
 * too): it stands for every process of the container that comes later
 * while the setter or any registered process lives
 * (region_device_take_limit). */
void region_set_limit(gv_region *r, int dev, uint64_t limit);
/* A process whose environment gives entry dev the memory limit `limit`
 * is about to use it (an entry made earlier, by a run that may have had
 * another limit, keeps it until then).  When no registered process of the
 * region but this one is alive, nor the process that set the limit live,
 * the environment's limit applies, and the SM entry is configured from
 * the environment again (region_sm_configure); else the entry's limit
 * stands if it equals limit or was set live, and otherwise
 * GV_EBUSY is returned: the container runs at another limit.  *current:
 * the entry's limit after the call. */
#define GV_EBUSY (-100)
int region_device_take_limit(gv_region *r, int dev, uint64_t limit, uint64_t *current);

/* The memory a context takes on entry dev, as the container measured it:
 * the smallest non-zero cost any of its processes measured (so that a
 * context that would fit at the smallest size seen is never refused in
 * advance); 0 while none was.  region_learn_ctx_cost lowers it to cost
 * if cost is non-zero and smaller (one compare-and-swap loop). */
uint64_t region_ctx_cost(gv_region *r, int dev);
void region_learn_ctx_cost(gv_region *r, int dev, uint64_t cost);

/* --- SM-time quota ----------------------------------------------------- */

enum gv_sm_policy { GV_SM_FIXED = 0, GV_SM_BURST = 1, GV_SM_BEST_EFFORT = 2 };

/* The SM-time quota state of one device entry, shared by the container's
 * processes.  All fields are atomics, changed without locks. */
/* gv_sm.configured: limit, policy and priority were set from the
 * environment (once per entry); the limit was set live (it then stands
 * when the environment's is applied); the entry's memory limit was set
 * live (region_set_limit; kept here, beside the SM one, for want of room
 * in the entry's first cache line). */
enum { GV_SM_CONFIGURED = 1, GV_SM_LIMIT_SET = 2, GV_MEM_LIMIT_SET = 4 };

struct gv_sm {
    _Atomic uint64_t tat;        /* pacing: theoretical arrival time, CLOCK_MONOTONIC ns */
    _Atomic uint32_t limit;      /* percent 1..100; 0 = no limit */
    _Atomic uint32_t share;      /* share enforced now, 1/100 % (0 = paused) */
    _Atomic uint32_t policy;     /* enum gv_sm_policy */
    _Atomic uint32_t priority;   /* CUDA_TASK_PRIORITY: 0 high, 1 low */
    _Atomic uint32_t configured; /* GV_SM_CONFIGURED | GV_SM_LIMIT_SET | GV_MEM_LIMIT_SET */
    _Atomic uint64_t busy_ns;    /* measured GPU time of the container's kernels */
    _Atomic uint64_t wait_ns;    /* time launches waited at the gate */
    _Atomic uint64_t launches;   /* launches through the gate */
    _Atomic uint32_t others;     /* other containers' use of the device, 1/100 %,
                                    as the node agent last reported it */
    /* The share in force when the entry was last paused (share set to 0):
     * the scale of the debt its clock ran up, for the share that ends the
     * pause (region_sm_set_share); 0: none known.  (Padding before: a file
     * of an earlier library holds 0 here.) */
    _Atomic uint32_t paused_from;
    _Atomic uint64_t others_at;  /* CLOCK_MONOTONIC ns of that report; 0: none */
    /* Set from outside while a higher-priority container is active: launches
     * pause until this CLOCK_MONOTONIC ns (a lease, renewed by whoever set
     * it while the pause must hold, so a pauser that dies cannot leave the
     * container paused); 0: never set, or cleared. */
    _Atomic uint64_t yield_until;
    /* Held while a process makes a gated launch's begin event, kernel and
     * end event, where no node directory holds the word for every
     * container (sm_enqueue.c): the holder's CLOCK_MONOTONIC ns | 1, 0 =
     * free. */
    _Atomic uint64_t enqueue;
};

/* CLOCK_MONOTONIC, ns (region_proc.c). */
uint64_t rg_now_ns(void);

/* Whether any device entry has ever had an SM limit or its yield flag set
 * (one load: the launch hooks' fast path).  A priority alone does not set
 * it: a low-priority container without a limit keeps the fast path until
 * it is asked to yield. */
int region_sm_any(gv_region *r);
/* The word region_sm_any reads, for a load without a call. */
_Atomic uint32_t *region_sm_any_flag(gv_region *r);
/* Change the share the entry's gate enforces (1/100 %), rescaling the
 * debt its pacing clock ran up at the old share (sm_gate.c). */
void region_sm_set_share(struct gv_sm *sm, uint32_t share);
/* Change an entry's SM limit live (0: none). */
void region_sm_set_limit(gv_region *r, int dev, unsigned limit);
/* Pause an entry's launches until CLOCK_MONOTONIC until_ns, with or
 * without a limit (a lease: set it again before it ends to keep the
 * pause); 0 clears the flag, and launches go on at once (an entry without
 * a limit then gets its whole share back, and the fast path). */
void region_sm_set_yield(gv_region *r, int dev, uint64_t until_ns);
/* A lease that ended (until_ns, as read) and was not cleared: clear it,
 * unless it was renewed meanwhile, so that an entry without a limit is no
 * longer gated (region_sm_gates) and its processes go back to the fast
 * path. */
void region_sm_end_yield(gv_region *r, int dev, uint64_t until_ns);
/* Is the entry's yield lease running at CLOCK_MONOTONIC now_ns? */
static inline int region_sm_yielding(struct gv_sm *sm, uint64_t now_ns)
{
    uint64_t until = atomic_load_explicit(&sm->yield_until, memory_order_relaxed);
    return until != 0 && now_ns < until;
}
/* Does this entry gate launches: an SM limit, or its yield flag set (a
 * lease that ended but was not cleared included: the gate then runs it at
 * its share, and clears the lease when it has no limit,
 * region_sm_end_yield)?  Not the priority: a low-priority entry without a
 * limit is gated only while it is asked to yield, so that it keeps the
 * launch fast path otherwise (CUDA_TASK_PRIORITY unset means low). */
static inline int region_sm_gates(struct gv_sm *sm)
{
    return atomic_load_explicit(&sm->limit, memory_order_relaxed) != 0 ||
           atomic_load_explicit(&sm->yield_until, memory_order_relaxed) != 0;
}
/* Does any device entry gate launches now (a limit or a yield flag)?  Answered from *cache (the caller's, process-local) while
 * no change to those was made or is in progress since it was filled: a
 * few loads.  region_sm_any's flag stays set once set; this is what tells
 * a container whose limit was lifted that it is free again. */
int region_sm_gated(gv_region *r, _Atomic uint64_t *cache);
/* SM state of device entry dev (NULL if dev is not a valid entry). */
struct gv_sm *region_sm(gv_region *r, int dev);
/* Set limit, policy and priority if no process has yet (first one wins,
 * like the memory limit); share starts at the limit. */
void region_sm_configure(gv_region *r, int dev, unsigned limit, unsigned policy, unsigned priority);

/* --- accounting ------------------------------------------------------ */

/* Reserve n bytes on dev for slot.  Returns 0, or GV_ENOMEM when the
 * container would pass its limit (the device's OOM counter is incremented
 * on refusal).  Before refusing, dead slots are reclaimed and the
 * reservation retried, at most once every 100 ms per device entry in the
 * whole container (other refusals cost a few atomics). */
int region_reserve(gv_region *r, int dev, int slot, uint64_t n);
/* Record n bytes the device already gave slot without asking the quota
 * (memory the driver took on its own): never refused, so the total may
 * pass the limit, and later reservations are refused until it is back
 * under.  GV_EINVAL / GV_ENOENT as for region_reserve, else 0. */
int region_charge_held(gv_region *r, int dev, int slot, uint64_t n);
/* Give back n bytes previously reserved by slot. */
void region_release(gv_region *r, int dev, int slot, uint64_t n);

/* Oversubscription (docs/oversubscription.md).  region_reserve_spill: as
 * region_reserve, and spill of the n bytes (spill <= n) count as served
 * from host memory, in the same step.  region_spill_move: n bytes the slot
 * holds move from the device to host memory (an allocation the driver
 * refused on the device and that was then spilled).  region_release_spill:
 * give back n bytes of which spill were spilled. */
int region_reserve_spill(gv_region *r, int dev, int slot, uint64_t n, uint64_t spill);
void region_spill_move(gv_region *r, int dev, int slot, uint64_t n);
void region_release_spill(gv_region *r, int dev, int slot, uint64_t n, uint64_t spill);
/* Spilled bytes of the container (all slots) and of one slot. */
uint64_t region_spilled(gv_region *r, int dev);
uint64_t region_slot_spilled(gv_region *r, int dev, int slot);
/* What slot holds on the device (used less spilled): what NVML shows. */
uint64_t region_slot_resident(gv_region *r, int dev, int slot);
/* Device-resident bytes of the container: used less spilled. */
uint64_t region_resident(gv_region *r, int dev);
/* The container's guarantee on dev (0: not oversubscribed). */
uint64_t region_guarantee(gv_region *r, int dev);
void region_set_guarantee(gv_region *r, int dev, uint64_t bytes);
/* Test hook: sum of dev's spilled[] counters. */
uint64_t region_test_spill_sum(gv_region *r, int dev);

uint64_t region_used(gv_region *r, int dev);                 /* all slots */
uint64_t region_slot_used(gv_region *r, int dev, int slot);
uint64_t region_oom_count(gv_region *r, int dev);

/* --- helpers shared with the rest of the library ----------------------- */

/* Start time of pid in clock ticks since boot (field 22 of /proc/pid/stat),
 * or 0 when it cannot be read. */
uint64_t gv_proc_start_time(int32_t pid);
/* 1 if pid is a live (non-zombie) process whose start time is start. */
int gv_proc_alive(int32_t pid, uint64_t start);
/* Does process pid map the file at path (by device and inode)?  1 yes,
 * 0 no, -1 unknown (its maps cannot be read). */
int gv_proc_maps_file(int32_t pid, const char *path);

/* The process's attached region (api.c): attaches lazily, once and
 * thread-safely, to $CUDA_DEVICE_MEMORY_SHARED_CACHE or the default path
 * unless gv_region_attach() already did.  NULL on failure, after logging
 * the one-line reason (callers then fail closed). */
gv_region *gv_shared_region(void);

/* Set this thread's gv_last_error() (api.c) and return code: for the
 * exported functions outside api.c. */
int gv_api_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* --- test-only hooks (used by native/tests/t_region_*.c) ---------------- */

/* Claim a free slot for an arbitrary (pid, start) owner, e.g. a live pid
 * with a bogus start time to fake PID reuse.  Returns the slot or GV_EFULL. */
int region_test_claim_slot(gv_region *r, int32_t pid, uint64_t start);
/* Put slot into the "being reclaimed by (pid, start)" state, as if that
 * reclaimer had died half-way.  Returns 0 or GV_EINVAL. */
int region_test_mark_reclaiming(gv_region *r, int slot, int32_t pid, uint64_t start);
/* Sleep this many microseconds in the middle of each slot reclaim and of
 * each device-entry initialisation (widens the windows a SIGKILL can hit).
 * Process-wide; 0 (the default) disables it. */
void region_test_set_delay_us(unsigned us);
/* Take boot for this boot's identity when opening a region (0, the
 * default: the kernel's boot id), to fake a reboot.  Process-wide. */
void region_test_set_boot(uint64_t boot);
/* Sum of dev's inside[] counters (operations in progress, 0 when idle). */
uint64_t region_test_inside(gv_region *r, int dev);
/* Sum of dev's per-slot counters (equals region_used when idle). */
uint64_t region_test_slot_sum(gv_region *r, int dev);

#endif /* GV_REGION_H */
