/*
 * gpuvisor.h - the C API that libgpuvisor.so exports for the supervisor
 * and for gpuvisor.shim (Python, through ctypes).
 *
 * The shared region's layout is private to the library; callers see it
 * only through these functions.  Every function is thread-safe.
 *
 * Return convention: 0 (or a non-negative count) on success, a negative
 * GV_E* code on failure.  gv_last_error() then describes the failure in
 * one line (thread-local).
 */
#ifndef GPUVISOR_H
#define GPUVISOR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GV_API_VERSION 8

enum {
    GV_OK = 0,
    GV_EINVAL = -1,     /* bad argument or malformed value */
    GV_ENOENT = -2,     /* no such device / process */
    GV_ENOMEM = -3,     /* quota exceeded */
    GV_EIO = -4,        /* could not open, create or map the region file */
    GV_ECORRUPT = -5,   /* region file has a bad magic, version or size */
    GV_EFULL = -6,      /* no free process or device slot left */
    GV_ENOTATTACHED = -7 /* no region attached yet */
};

/* Value meaning "no limit" for a device's memory quota. */
#define GV_UNLIMITED UINT64_MAX

/* Version of this API (GV_API_VERSION). */
int gv_api_version(void);

/* This library's release ("0.1.0", pyproject.toml's version). */
const char *gv_version(void);

/* This library's build id: the hex of its GNU build-id note (a hash of the
 * file's contents), or "unknown" when it has none. */
const char *gv_build_id(void);

/* One-line description of the last failure in this thread. */
const char *gv_last_error(void);

/* Attach to (creating it if missing) the container's shared region.
 * path == NULL: $CUDA_DEVICE_MEMORY_SHARED_CACHE, else the default
 * GV_DEFAULT_REGION_PATH.  Attaching again to the same path is a no-op;
 * attaching to another path while attached fails with GV_EINVAL. */
int gv_region_attach(const char *path);

/* The region path used when none is given and
 * $CUDA_DEVICE_MEMORY_SHARED_CACHE is unset or empty. */
const char *gv_region_default_path(void);

/* Path of the attached region; NULL when none. */
const char *gv_region_path(void);

/* Parse a memory-limit value as CUDA_DEVICE_MEMORY_LIMIT accepts it.
 * physical_total resolves percentages.  Returns GV_EINVAL for anything
 * malformed, zero, or overflowing. */
int gv_parse_memory_limit(const char *text, uint64_t physical_total, uint64_t *bytes);

/* Check the calling process's environment as the interposer will: every
 * CUDA_DEVICE_MEMORY_LIMIT*, CUDA_DEVICE_SM_LIMIT*, GPUVISOR_SM_POLICY,
 * GPU_CORE_UTILIZATION_POLICY and CUDA_TASK_PRIORITY.  GV_EINVAL with the
 * one-line reason (naming the variable and the value) in gv_last_error(). */
int gv_validate_env(void);

/* The limits an environment gives the device uuid ("GPU-..."), exactly as
 * a process of the container with that environment configures the device's
 * entry at its first CUDA use: CUDA_DEVICE_MEMORY_LIMIT_<i>, else
 * CUDA_DEVICE_MEMORY_LIMIT (a percentage of physical_total bytes), and
 * CUDA_DEVICE_SM_LIMIT_<i>, else CUDA_DEVICE_SM_LIMIT (0 under
 * GPU_CORE_UTILIZATION_POLICY=disable), for the device's CUDA ordinal <i>.
 * The ordinal is found as for a process that has only used NVML: NVML's
 * list, through env's CUDA_VISIBLE_DEVICES (NVML is initialised for the
 * call and given back: a caller's own nvmlShutdown still shuts it down).
 * env: NULL-terminated
 * "NAME=value" strings (NULL: this process's environment), read in the
 * calling thread only; the process's environment is not changed.
 * *mem_bytes: GV_UNLIMITED for none; *sm_pct: 0 for none.
 * Returns the ordinal (>= 0).  GV_ENOENT when the ordinal cannot be known
 * (NVML cannot list the devices, or env's CUDA_VISIBLE_DEVICES hides the
 * device): *mem_bytes and *sm_pct are then the strictest limits env gives
 * any ordinal (GV_UNLIMITED / 0 only where it gives none at all), so that
 * a caller can fail closed, and gv_last_error() says why.  GV_EINVAL for a
 * bad uuid, a malformed value (as gv_validate_env), or a percentage with
 * physical_total 0.  Since API version 3. */
int gv_env_device_limits(const char *const *env, const char *uuid, uint64_t physical_total,
                         uint64_t *mem_bytes, uint32_t *sm_pct);

/* The SM policy and task priority an environment gives every device, as a
 * process of the container with that environment configures them (the
 * values gv_device_get_sm reports): *policy 0 fixed-share, 1 burst-share,
 * 2 best-effort (fixed-share under GPU_CORE_UTILIZATION_POLICY=force or
 * disable, which make the limit a hard cap or drop it); *priority 0 high,
 * 1 low (CUDA_TASK_PRIORITY unset or empty: 1).  env as for
 * gv_env_device_limits (NULL: this process's environment), which is
 * neither read otherwise nor changed.  GV_EINVAL, as gv_validate_env, for
 * a malformed SM variable.  Since API version 4. */
int gv_env_sm_settings(const char *const *env, uint32_t *policy, uint32_t *priority);

/* Device entries of the region, in the order processes first used them.
 * Indices run 0 .. gv_device_count()-1.  An entry still being initialised
 * (or left so by a process killed half-way, until another process that
 * uses the device takes it over) is not counted. */
int gv_device_count(void);
int gv_device_uuid(int dev, char *buf, size_t len);        /* "GPU-xxxxxxxx-..." */
/* Register a device entry ahead of any CUDA process (e.g. the supervisor).
 * uuid is the "GPU-..." string; returns the entry index. */
int gv_device_register(const char *uuid, uint64_t physical_total, uint64_t limit);
int gv_device_get_limit(int dev, uint64_t *bytes);          /* GV_UNLIMITED when none */
int gv_device_set_limit(int dev, uint64_t bytes);           /* applies to the next allocation */
int gv_device_get_used(int dev, uint64_t *bytes);           /* container-wide */
int gv_device_get_physical_total(int dev, uint64_t *bytes);
int gv_device_get_oom_count(int dev, uint64_t *count);      /* refused allocations */
/* What a new context of the container is reserved before it is created:
 * the smallest context cost any of its processes measured; 0 while none
 * was (API version 5). */
int gv_device_get_context_cost(int dev, uint64_t *bytes);
/* Oversubscription (API version 7; docs/oversubscription.md): of the
 * container's usage (gv_device_get_used), the bytes served from host
 * memory (spilled); the rest is resident on the device.  The guarantee is
 * the device memory the container is guaranteed (limit / S), 0 when none
 * of its processes allocated under CUDA_OVERSUBSCRIBE. */
int gv_device_get_spilled(int dev, uint64_t *bytes);
int gv_device_get_guarantee(int dev, uint64_t *bytes);

/* SM-time quota of a device entry.
 * limit_pct: CUDA_DEVICE_SM_LIMIT (1..100; 0 = none); share_bp: the share
 * the launch gate enforces right now, in 1/100 % (10000 = whole GPU, 0 =
 * paused); policy: 0 fixed-share, 1 burst-share, 2 best-effort; priority:
 * CUDA_TASK_PRIORITY (0 high, 1 low; unset or empty: 1, as in HAMi-core). */
int gv_device_get_sm(int dev, uint32_t *limit_pct, uint32_t *share_bp, uint32_t *policy,
                     uint32_t *priority);
/* Cumulative GPU time measured for the container's kernels, time its
 * launches waited at the gate, and launches through the gate. */
int gv_device_get_sm_usage(int dev, uint64_t *busy_ns, uint64_t *wait_ns, uint64_t *launches);
/* Change the SM limit live (0: none); applies to the next launches. */
int gv_device_set_sm_limit(int dev, uint32_t pct);
/* Pause the container's launches on dev for lease_ms milliseconds from now
 * (at most GV_SM_YIELD_MAX_MS), or resume them at once (0): set while a
 * higher-priority container is active (the supervisor decides).  A lease:
 * the caller sets it again before it ends to keep the pause, so a caller
 * that dies (or hangs) cannot leave the container paused for good.
 * GV_EINVAL for a longer lease. */
#define GV_SM_YIELD_MAX_MS 60000u
int gv_device_set_sm_yield(int dev, uint32_t lease_ms);

/* The other containers' use of the device (1/100 %), as the node agent
 * sees it; the launch gate's burst-share/best-effort lending takes the
 * larger of this (while fresher than 2 s) and its own NVML reading.
 * age_ms: how old the figure is (UINT64_MAX: never set). */
int gv_device_set_sm_others(int dev, uint32_t share_bp);
int gv_device_get_sm_others(int dev, uint32_t *share_bp, uint64_t *age_ms);

/* Processes registered in the region.  Writes up to cap PIDs and returns
 * how many are registered (may be more than cap). */
int gv_process_list(int32_t *pids, int cap);
int gv_process_get_used(int32_t pid, int dev, uint64_t *bytes);
/* Of that, spilled to host memory (API version 7). */
int gv_process_get_spilled(int32_t pid, int dev, uint64_t *bytes);

/* Reclaim the slots of processes that have died; returns how many. */
int gv_reclaim_dead(void);

/* Another container's region file, by its path, for a reader of many
 * containers' regions (the node agent, docs/hami.md).  The file is never
 * created, replaced or followed through a symbolic link, and never mapped
 * to be read: what an untrusted container writes there can only make up
 * what is reported of that container.  Since API version 8. */
struct gv_region_file_device {
    char uuid[48];            /* "GPU-xxxxxxxx-..." */
    uint64_t limit;           /* GV_UNLIMITED: none */
    uint64_t used;            /* container-wide, as gv_device_get_used */
    uint64_t spilled;         /* of used, served from host memory */
    uint64_t physical_total;
    uint64_t oom_count;
    uint32_t sm_limit;        /* as gv_device_get_sm: percent, 0 none */
    uint32_t sm_share;        /* 1/100 % */
    uint32_t sm_policy;
    uint32_t sm_priority;     /* 0 high, 1 low */
    uint64_t busy_ns;         /* as gv_device_get_sm_usage */
    uint64_t wait_ns;
    uint64_t launches;
    uint64_t yield_ms;        /* what is left of the yield lease, 0: none */
};
/* The region file's initialised device entries, as the container's own
 * functions read them; writes at most cap and returns how many.
 * GV_ECORRUPT (with the reason) for a file that is not a gpuvisor region
 * of this layout: HAMi-core's, another version, the wrong size, not a
 * regular file, a symbolic link; GV_EIO when it cannot be opened or read. */
int gv_region_file_devices(const char *path, struct gv_region_file_device *out, int cap);
/* Value of a gv_region_file_set_sm argument that leaves its field as it is. */
#define GV_KEEP UINT32_MAX
/* In the region file at path, on the entry of device uuid: set the yield
 * lease (as gv_device_set_sm_yield, 0 resumes) and the others' share (as
 * gv_device_set_sm_others); GV_KEEP leaves either as it is.  GV_ENOENT:
 * no entry for uuid; errors as gv_region_file_devices, and GV_ECORRUPT when
 * the file is cut short while it is written (the write is given up). */
int gv_region_file_set_sm(const char *path, const char *uuid, uint32_t yield_ms,
                          uint32_t others_bp);

#ifdef __cplusplus
}
#endif
#endif /* GPUVISOR_H */
