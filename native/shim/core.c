/* core.c - deciding, once per process, how the library behaves. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

#include "core.h"
#include "limits.h"
#include "log.h"

static atomic_int mode;            /* 0 until initialised */
static gv_region *region;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void init(void)
{
    if (limits_control_disabled()) {
        gv_log(GV_LOG_INFO, "CUDA_DISABLE_CONTROL set: pass-through");
        atomic_store(&mode, GV_MODE_PASSTHROUGH);
        return;
    }
    char err[512];
    if (limits_check_env(err, sizeof err) != 0) {
        gv_log(GV_LOG_ERROR, "%s; CUDA calls fail with CUDA_ERROR_NOT_PERMITTED", err);
        atomic_store(&mode, GV_MODE_FAILED);
        return;
    }
    region = gv_shared_region();
    if (!region) {
        /* gv_shared_region has printed why; never run unlimited. */
        atomic_store(&mode, GV_MODE_FAILED);
        return;
    }
    atomic_store(&mode, GV_MODE_ENFORCE);
}

int gv_mode(void)
{
    int m = atomic_load_explicit(&mode, memory_order_acquire);
    if (__builtin_expect(m != 0, 1))
        return m;
    pthread_once(&init_once, init);
    return atomic_load_explicit(&mode, memory_order_acquire);
}

gv_region *gv_core_region(void) { return region; }

void gv_core_fail(void) { atomic_store(&mode, GV_MODE_FAILED); }
