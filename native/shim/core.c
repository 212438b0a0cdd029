/* core.c - deciding, once per process, how the library behaves. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core.h"
#include "limits.h"
#include "log.h"
#include "oversub.h"

atomic_int gv_mode_word;           /* 0 until initialised */
static gv_region *region;
static _Atomic uint32_t sm_never;
_Atomic uint32_t *gv_sm_any_flag = &sm_never;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void init(void)
{
    if (limits_control_disabled()) {
        gv_log(GV_LOG_INFO, "CUDA_DISABLE_CONTROL set: pass-through");
        atomic_store(&gv_mode_word, GV_MODE_PASSTHROUGH);
        return;
    }
    char err[512];
    if (limits_check_env(err, sizeof err) != 0 || limits_sm_check_env(err, sizeof err) != 0) {
        gv_log(GV_LOG_ERROR, "%s; CUDA calls fail with CUDA_ERROR_NOT_PERMITTED", err);
        atomic_store(&gv_mode_word, GV_MODE_FAILED);
        return;
    }
    gv_oversub_configure();
    if (gv_oversub_on())
        gv_log(GV_LOG_INFO, GV_ENV_OVERSUBSCRIBE " on, " GV_ENV_SCALING " %u.%03u: allocations "
               "past the device's share are served from host memory",
               limits_memory_scaling_milli() / 1000, limits_memory_scaling_milli() % 1000);
    region = gv_shared_region();
    if (region) {
        gv_sm_any_flag = region_sm_any_flag(region);
        /* Under pthread_once: no thread of this image has a slot yet. */
        if (region_drop_old_image(region))
            gv_log(GV_LOG_INFO, "region %s: dropped what this process held before its exec()",
                   region_path(region));
    }
    if (!region) {
        /* gv_shared_region has printed why; never run unlimited. */
        atomic_store(&gv_mode_word, GV_MODE_FAILED);
        return;
    }
    atomic_store(&gv_mode_word, GV_MODE_ENFORCE);
}

int gv_mode(void)
{
    int m = atomic_load_explicit(&gv_mode_word, memory_order_acquire);
    if (__builtin_expect(m != 0, 1))
        return m;
    pthread_once(&init_once, init);
    return atomic_load_explicit(&gv_mode_word, memory_order_acquire);
}

gv_region *gv_core_region(void) { return region; }

/* At exit, give the slot back so the rest of the container sees this
 * process's memory gone at once (destructors of a preloaded library run
 * after the program's atexit handlers, so the driver's own clean-up has
 * already gone through the hooks). */
__attribute__((destructor)) static void at_exit(void)
{
    if (atomic_load(&gv_mode_word) == GV_MODE_ENFORCE && region)
        region_leave(region);
}

int gv_once_a_second(atomic_long *last)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    long seen = atomic_load_explicit(last, memory_order_relaxed);
    return ts.tv_sec - seen >= 1 && atomic_compare_exchange_strong(last, &seen, ts.tv_sec);
}

void gv_core_tidy(void)
{
    static atomic_long last;
    if (gv_once_a_second(&last))
        region_reclaim_dead(region);
}

void gv_core_fail(void) { atomic_store(&gv_mode_word, GV_MODE_FAILED); }
