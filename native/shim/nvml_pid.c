/*
 * nvml_pid.c - the PID NVML shows for this process.
 *
 * The driver reports the host's PIDs, not those of the caller's PID
 * namespace.  In a container with its own namespace, NVML therefore lists
 * this process under a PID it does not know as its own.  The context hooks
 * learn it (hooks_context.c: the one PID NVML lists after this process
 * created a context and did not list before) and hand it here.  Both paths
 * read it: the memory path to find this process in NVML's list, the SM
 * path to tell its own container's GPU time from others' (sm_policy.c).
 * It lives in a file of its own so that the SM path does not depend on the
 * context hooks.
 *
 * Kept with the getpid() it was learned for, so a forked child does not
 * inherit it; also stored in the process's region slot, so that the
 * container's other processes know it.
 */
#include <stdatomic.h>
#include <unistd.h>

#include "core.h"

static _Atomic uint64_t nvml_self;          /* getpid() << 32 | NVML's PID */

uint32_t gv_nvml_self_pid(void)
{
    uint32_t me = (uint32_t)getpid();
    uint64_t v = atomic_load_explicit(&nvml_self, memory_order_relaxed);
    return v && (uint32_t)(v >> 32) == me ? (uint32_t)v : me;
}

void gv_nvml_self_learned(uint32_t pid)
{
    atomic_store(&nvml_self, (uint64_t)(uint32_t)getpid() << 32 | pid);
    if (gv_core_region())
        region_set_nvml_pid(gv_core_region(), pid);
}
