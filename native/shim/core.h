/*
 * core.h - process-wide state shared by the hook families.
 *
 *  mode      whether the library enforces, passes through, or fails closed
 *  devices   per-process view of the CUDA ordinals the process sees
 *  charges   reserving quota around a real allocation
 */
#ifndef GV_CORE_H
#define GV_CORE_H

#include <stdatomic.h>
#include <stdint.h>
#include "gpuvisor.h"
#include "gv_cuda.h"
#include "region.h"
#include "real.h"

enum gv_mode {
    GV_MODE_ENFORCE = 1,      /* quotas enforced */
    GV_MODE_PASSTHROUGH = 2,  /* CUDA_DISABLE_CONTROL: pure pass-through */
    GV_MODE_FAILED = 3        /* misconfigured: fail closed */
};

/* Errors returned while failing closed (documented in docs/environment.md). */
#define GV_FAIL_CUDA CUDA_ERROR_NOT_PERMITTED
#define GV_FAIL_NVML NVML_ERROR_NO_PERMISSION

/* The mode, initialising the library on first use (thread-safe). */
int gv_mode(void);
extern atomic_int gv_mode_word;          /* 0 until initialised */
extern _Atomic uint32_t *gv_sm_any_flag; /* the region's "any SM limit" word */

/* gv_mode() without a call once initialised. */
static inline int gv_mode_fast(void)
{
    int m = atomic_load_explicit(&gv_mode_word, memory_order_acquire);
    return __builtin_expect(m != 0, 1) ? m : gv_mode();
}
/* The attached region; valid only in GV_MODE_ENFORCE. */
gv_region *gv_core_region(void);
/* The PID NVML shows for this process: getpid(), or the host's PID learned
 * when its first context was created inside another PID namespace
 * (nvml_pid.c; learned by hooks_context.c). */
uint32_t gv_nvml_self_pid(void);
/* This process (getpid()) is listed by NVML as pid: kept, and stored in
 * its region slot. */
void gv_nvml_self_learned(uint32_t pid);
/* At most once a second: reclaim the slots of processes that died, so
 * usage reports never keep a dead process's memory (called by the memory
 * info hooks; enforce mode only). */
void gv_core_tidy(void);
/* 1 for the first caller in each second (coarse monotonic clock) that
 * passes the same counter, else 0; no lock, no system call. */
int gv_once_a_second(atomic_long *last);
/* Switch to fail-closed after a fatal misconfiguration found later. */
void gv_core_fail(void);

/* ---- devices (devices.c) ---- */
typedef struct gv_devinfo {
    int region_dev;           /* entry in the shared region */
    uint64_t granularity;     /* allocation granularity, bytes */
    uint64_t physical_total;  /* physical memory of the device */
    unsigned char uuid[16];
    char uuid_str[48];        /* NVML form, "GPU-xxxxxxxx-..." */
} gv_devinfo;

/* UUID text form (NVML's) <-> raw bytes (CUDA's). */
void gv_uuid_format(const unsigned char uuid[16], char *buf, size_t len);
int gv_uuid_parse(const char *text, unsigned char uuid[16]);

#define GV_MAX_ORDINALS 64

/* Per-ordinal info, set up on first use. CUDA_SUCCESS or an error to return. */
CUresult gv_device(int ordinal, const gv_devinfo **out);
/* The same for a device this process already looked up, without looking
 * it up (nor registering it in the region): 1 and *out, or 0. */
int gv_device_known(int ordinal, const gv_devinfo **out);
/* This process, whose environment gives region entry dev (the device
 * uuid_str, its CUDA ordinal) the memory limit `limit`, is about to use
 * the entry (region_device_take_limit): 0, or -1 after one line saying
 * that the container runs at another limit, which names both. */
int gv_device_take_limit(int dev, int ordinal, const char *uuid_str, uint64_t limit);
/* Ordinal and context current on this thread. */
CUresult gv_current(int *ordinal, CUcontext *ctx);
/* Ordinal that ctx belongs to (ctx must be a live context). */
CUresult gv_ordinal_of_ctx(CUcontext ctx, int *ordinal);
/* Ordinal of the device a stream runs on. */
CUresult gv_ordinal_of_stream(CUstream stream, int *ordinal, CUcontext *ctx);
/* CUDA ordinal the process sees for a device UUID; -1 when invisible. */
int gv_ordinal_of_uuid(const unsigned char uuid[16]);
/* The CUDA ordinal a process that has only used NVML gives a device UUID
 * (the map above, made afresh from NVML's list with CUDA_VISIBLE_DEVICES =
 * cvd, NULL: unset); -1 when NVML cannot list the devices or cvd hides
 * it.  For gv_env_device_limits, on behalf of another process. */
int gv_ordinal_of_uuid_nvml(const unsigned char uuid[16], const char *cvd);
/* The process called cuInit (hooks_info.c): from then on the UUID map is
 * CUDA's; before, NVML's, so that NVML calls do not initialise CUDA. */
void gv_cuda_inited(void);

/* ---- memory pools (pool_account.c) ---- */
/* Re-read the reserve of every pool the process holds (uncontended ones). */
void gv_pools_refresh(void);
/* Whether the process holds any tracked pool. */
int gv_pools_active(void);
/* 1 when no live pool is charged more than the reserve the driver reports
 * now; 0 when one is (the driver gave memory back, at a synchronisation
 * say, that is still charged) or another thread is changing one. */
int gv_pools_settled(void);
/* untracked.c: memory the driver gave this process that no hook charged,
 * from NVML's per-process figure.  reconcile: re-read one device (or all)
 * now; tick: all devices, at most once a second.  gv_untracked_reconcile
 * returns 1 when it used a reading, 0 when there is none to take (NVML
 * does not list this process), -1 when one was not used (a charge of this
 * process in flight or begun meanwhile, a context being created, a pool
 * being changed). */
int gv_untracked_reconcile(int ordinal);
void gv_untracked_reconcile_all(void);
void gv_untracked_tick(void);
/* Whether any such memory is charged now. */
int gv_untracked_held(void);
/* Stream-ordered frees were released (pending_free.c): a reading taken
 * while they were pending may have left the charge short of the truth by
 * up to their bytes (NVML showed them freed while they were still
 * charged), so read again now where one did; else nothing (one load). */
void gv_untracked_pending_released(void);

/* ---- charging (charge.c) ---- */
typedef struct gv_charge {
    int active;        /* 0: nothing reserved (pass-through) */
    int ordinal;
    int dev;           /* region device entry */
    uint64_t bytes;    /* reserved so far */
    CUcontext ctx;
} gv_charge;

static inline uint64_t gv_round_up(uint64_t n, uint64_t g)
{
    if (g <= 1)
        return n;
    uint64_t r = n % g;
    return (r == 0 || n > UINT64_MAX - (g - r)) ? n : n + (g - r);
}

/* Reserve bytes (rounded up to the device granularity) on ordinal.
 * Returns CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, or GV_FAIL_CUDA. */
CUresult gv_charge_begin(gv_charge *c, int ordinal, CUcontext ctx, uint64_t bytes);
/* Same, for the ordinal and context current on this thread.  When there is
 * no current context it returns CUDA_SUCCESS with c->active == 0 so the
 * real call can report its own error. */
CUresult gv_charge_begin_current(gv_charge *c, uint64_t bytes);
/* Move the reservation to exactly bytes (the driver's real footprint). */
CUresult gv_charge_resize(gv_charge *c, uint64_t bytes);
/* Give the reservation back (the real call failed). */
void gv_charge_cancel(gv_charge *c);
/* Keep the reservation, recorded by the caller (not in the table). */
void gv_charge_keep(gv_charge *c);
/* Charges begun and not yet committed, cancelled or kept, and frees between
 * taking their entry and giving their charge back (a cuMemFreeAsync of a
 * plain block: until it is pending, gv_pending_frees_bytes), in this
 * process: while any is in flight, this process's charges and the driver's
 * figures need not agree (untracked.c does not read NVML then). */
int gv_charges_in_flight(void);
/* How many charges (and untracked frees) this process has begun so far. */
uint64_t gv_charges_begun(void);
/* A charge recorded elsewhere is in flight until gv_charge_landed: the
 * driver call it pays for (a graph's launch) has not answered yet. */
void gv_charge_flying(void);
void gv_charge_landed(void);
void gv_charges_fork_child(void);
/* Record the reservation against an object the driver returned. */
void gv_charge_commit(const gv_charge *c, int kind, uint64_t key, uint64_t aux);
/* Finish a charged driver call: record the object on success, give the
 * reservation back on failure.  Returns rc. */
CUresult gv_charge_settle(gv_charge *c, CUresult rc, int kind, uint64_t key);
/* Release a charge taken earlier on region device dev. */
void gv_uncharge(int dev, uint64_t bytes);
/* The same, of which spilled bytes were served from host memory. */
void gv_uncharge_spilled(int dev, uint64_t bytes, uint64_t spilled);
/* Release what a table entry charged (a spilled allocation's spilled part
 * included). */
struct gv_alloc;
void gv_uncharge_alloc(const struct gv_alloc *a);
/* gv_charge_commit of a linear allocation (cuMemAlloc, Pitch, Managed) of
 * which spilled bytes live in host memory (oversub.c): recorded as
 * GV_K_SPILL with those bytes when there are any, else GV_K_PTR. */
void gv_charge_commit_spilled(const gv_charge *c, uint64_t key, uint64_t spilled);

/* Free a charged object through the driver.  If (kind, key) is tracked, its
 * entry is taken out first (so a concurrent allocation reusing the address
 * cannot collide), destroy(key, arg) frees it, and the charge is released
 * (or the entry put back when the driver refuses); *rc gets the driver's
 * answer and 1 is returned.  Untracked: 0, nothing done. */
typedef CUresult (*gv_destroy_fn)(uint64_t key, void *arg);
int gv_untrack(uint32_t kind, uint64_t key, gv_destroy_fn destroy, void *arg, CUresult *rc);

/* ---- stream-ordered frees of plain allocations (pending_free.c) ---- */
/* A cuMemFreeAsync of bytes charged on region device dev was queued into
 * stream (ptsz: its per-thread-default-stream variant); the caller is in
 * flight (gv_charge_flying), and lands here once the bytes count as
 * pending (or, with no room to keep the free pending, once the stream has
 * reached it and the charge is released).  The charge is released once the
 * stream has reached the free. */
void gv_pending_free(int dev, uint64_t bytes, CUstream stream, int ptsz);
/* Bytes of the frees pending on region device dev: NVML may or may not
 * show them freed yet, while they are still charged.  Read after NVML and
 * before the charge it is compared with: they leave this count only after
 * their charge has gone back. */
uint64_t gv_pending_frees_bytes(int dev);
/* How many frees are pending (on any device). */
int gv_pending_frees_waiting(void);
/* Release the charges of pending frees the streams have reached (cheap
 * when none is pending), then, if any was, gv_untracked_pending_released;
 * _quietly: not that (a reading of untracked memory, which reads next),
 * but answer the region device entries whose frees it released, as a mask
 * (bit dev), so that the reading can read the others again. */
void gv_pending_frees_reap(void);
unsigned gv_pending_frees_reap_quietly(void);
/* Around the destruction of a context: hold takes its pending frees out of
 * the reapers' reach (before the driver call); unhold releases them (gone:
 * the context is destroyed, their blocks and events with it) or lets them
 * wait again. */
#define GV_PENDING_MAX 256
typedef struct gv_pending_set {
    uint64_t bits[GV_PENDING_MAX / 64];
} gv_pending_set;
void gv_pending_frees_hold(CUcontext ctx, gv_pending_set *held);
void gv_pending_frees_unhold(gv_pending_set *held, int gone);

#endif /* GV_CORE_H */
