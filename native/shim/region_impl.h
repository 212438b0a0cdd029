/*
 * region_impl.h - layout of the shared region and the helpers its parts
 * share.  Private to region_*.c; everything else uses region.h.
 *
 *   region_proc.c     identities (pid/tid + start time), liveness, back-off
 *   region_file.c     creating, validating and mapping the file
 *   region_slots.c    process slots: claim, leave, reclaim the dead
 *   region_devices.c  device entries and their limits
 *   region_account.c  reserve / release / usage, the gate, recomputation
 */
#ifndef GV_REGION_IMPL_H
#define GV_REGION_IMPL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "gpuvisor.h"
#include "region.h"

/* ---- layout ------------------------------------------------------------ */

#define CACHELINE 64

struct gv_header {
    uint64_t magic;
    uint32_t version;
    uint32_t header_size;      /* sizeof(struct gv_header) */
    uint64_t total_size;       /* sizeof(struct gv_shm) == file size */
    uint32_t max_slots;
    uint32_t max_devices;
    _Atomic uint32_t slot_hwm; /* slots [0, hwm) have ever been claimed */
    _Atomic uint32_t sm_any;   /* 1 once any device entry has an SM limit or a yield flag */
    uint64_t created_unix;
    /* Changes to what gates launches (limits, priority, yield flags):
     * writers in progress, and a count bumped before and after each
     * change, so a process may cache "nothing is gated" (region_sm_gated)
     * until the next change; a writer killed mid-change leaves the count
     * of writers above 0, and every launch then looks again. */
    _Atomic uint32_t sm_writers;
    _Atomic uint32_t sm_gen;
    /* The boot the file was last opened in (region_file.c, a hash of the
     * kernel's boot id; 0: not known): CLOCK_MONOTONIC times kept in the
     * file mean nothing in another boot. */
    _Atomic uint64_t boot;
};

struct gv_dev {
    _Alignas(CACHELINE) _Atomic uint64_t state;   /* DEV_FREE/READY/INIT|owner */
    _Atomic uint64_t limit;                       /* GV_UNLIMITED: none */
    _Atomic uint64_t physical_total;
    _Atomic uint64_t oom_count;
    /* The smallest non-zero memory a context of the container was measured
     * to take on this device (hooks_context.c); 0 until one was.  Lowered
     * only, by compare-and-swap: a process killed anywhere leaves the old
     * or the new value. */
    _Atomic uint64_t ctx_cost;
    /* Who last set a limit of the entry live (region_set_limit,
     * region_sm_set_limit: set-limit through the supervisor): that
     * process's owner word; 0: none since an environment configured it
     * (region_device_take_limit).  A file of an earlier library holds 0
     * here (padding of the same cache line). */
    _Atomic uint64_t limit_by;
    unsigned char uuid[16];                       /* valid once READY */
    _Alignas(CACHELINE) _Atomic uint64_t total;   /* sum of used[]: see below */
    _Atomic uint64_t spilled_total;               /* sum of spilled[] */
    /* Oversubscription (docs/oversubscription.md): the device memory the
     * container is guaranteed on this device, limit / S, as the last of its
     * processes to allocate under CUDA_OVERSUBSCRIBE computed it; 0: not
     * oversubscribed. */
    _Atomic uint64_t guarantee;
    _Alignas(CACHELINE) _Atomic uint64_t gate;    /* 0 open, else closer|FLAG_BIT */
    /* CLOCK_MONOTONIC ns when a refused reservation last looked for dead
     * processes' memory on this entry (region_account.c); in what was
     * padding of the gate's line (refusals are when the gate matters), so
     * an earlier library's file holds 0 (look now). */
    _Atomic uint64_t reclaim_at;
    _Alignas(CACHELINE) _Atomic uint64_t used[GV_MAX_SLOTS];
    /* The part of used[] served from host memory (spilled): never more
     * than used[] of the same slot; changed inside the gate with it. */
    _Alignas(CACHELINE) _Atomic uint64_t spilled[GV_MAX_SLOTS];
    _Alignas(CACHELINE) _Atomic uint64_t inside[GV_MAX_SLOTS];  /* ops in progress */
    _Alignas(CACHELINE) struct gv_sm sm;          /* SM-time quota */
};

/* limit_by and reclaim_at sit in what was padding: the layout is unchanged. */
_Static_assert(offsetof(struct gv_dev, total) == CACHELINE, "gv_dev's first line is full");
_Static_assert(offsetof(struct gv_dev, used) == 3 * CACHELINE, "gv_dev's gate line is full");

struct gv_shm {
    struct gv_header hdr;
    _Alignas(CACHELINE) _Atomic uint64_t owner[GV_MAX_SLOTS];
    _Alignas(CACHELINE) _Atomic uint64_t image[GV_MAX_SLOTS];
    /* the PID NVML shows for the slot's process (the host's, when the
     * container has its own PID namespace); 0 until learned */
    _Alignas(CACHELINE) _Atomic uint32_t nvml_pid[GV_MAX_SLOTS];
    struct gv_dev dev[GV_MAX_DEVICES];
};

struct gv_region {
    struct gv_shm *m;
    _Atomic uint64_t slot_cache;   /* fork generation << 32 | slot state */
    _Atomic uint64_t quick_at[GV_MAX_DEVICES];  /* this process's last quick look */
    char path[];
};

/* Owner words: start time << 22 | pid.  Bit 63 marks "being reclaimed by"
 * for slots and "being initialised by" for device entries. */
#define PID_BITS 22
#define PID_MASK ((UINT64_C(1) << PID_BITS) - 1)
#define START_MASK ((UINT64_C(1) << 41) - 1)
#define FLAG_BIT (UINT64_C(1) << 63)
#define DEV_FREE UINT64_C(0)
#define DEV_READY UINT64_C(1)

#define SLOT_NONE 0u
#define SLOT_CLAIMING 0xffffffffu

#define MAX_RESERVE (UINT64_C(1) << 62)   /* bigger requests: GV_ENOMEM */
#define RESERVE_TRIES 200
/* A refused reservation looks for dead processes' memory at most this
 * often per device entry, container-wide (region_account.c). */
#define RECLAIM_EVERY_NS (UINT64_C(100) * 1000 * 1000)
/* Between those, a refusal makes the quick look (rg_reclaim quick) at most
 * this often per device entry in each process. */
#define QUICK_EVERY_NS (UINT64_C(1) * 1000 * 1000)

/* ---- shared between the parts ------------------------------------------- */

extern _Atomic uint32_t rg_fork_gen;      /* bumped in every fork child */
extern pthread_once_t rg_atfork_once;
void rg_register_atfork(void);

uint64_t rg_make_owner(int32_t pid, uint64_t start);
int rg_owner_alive(uint64_t w);
/* 1 when the process behind owner word w (a thread's or a process's)
 * is known to no longer map the region: it exec()ed while one of its
 * threads held what w marks.  exec() from any thread keeps the process's
 * pid and start time, so the main thread's identity looks alive for good
 * although that thread is gone.  Reads /proc/<pid>/maps: call it rarely. */
int rg_owner_left(gv_region *r, uint64_t w);
uint64_t rg_self_owner(void);
uint64_t rg_thread_owner(void);
uint64_t rg_image_id(void);
void rg_test_delay(void);
void rg_backoff(int slot, int tries);
void rg_set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* region_file.c: is fd (named path) a region of this layout (GV_OK), or
 * not (GV_ECORRUPT, GV_EIO, with the one-line reason in err)?  Is it
 * HAMi-core's region file (its first word HAMI_CORE_MAGIC)? */
#define HAMI_CORE_MAGIC 19920718
int rg_validate(int fd, const char *path, char *err, size_t errlen);
int rg_is_hami_core_file(int fd);

void rg_raise_hwm(gv_region *r, uint32_t to);
int rg_claim_free_slot(gv_region *r, uint64_t w);
int rg_reclaim(gv_region *r, int dev, int quick);

void rg_forget_slot(gv_region *r, int slot);
void rg_close_gate(gv_region *r, int dev);
void rg_wait_outside(gv_region *r, int dev, int forget);
void rg_recompute_locked(gv_region *r, int dev);

static inline uint32_t hwm_of(const gv_region *r)
{
    uint32_t h = atomic_load(&r->m->hdr.slot_hwm);
    return h > GV_MAX_SLOTS ? GV_MAX_SLOTS : h;
}

static inline int dev_ok(const gv_region *r, int dev)
{
    return r != NULL && dev >= 0 && dev < GV_MAX_DEVICES;
}

static inline int dev_ready(const gv_region *r, int dev)
{
    return dev_ok(r, dev) && atomic_load(&r->m->dev[dev].state) == DEV_READY;
}

static inline uint64_t sat_add(uint64_t a, uint64_t b)
{
    uint64_t s = a + b;
    return s < a ? UINT64_MAX : s;
}

#endif /* GV_REGION_IMPL_H */
