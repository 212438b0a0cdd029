/*
 * nvml_init.c - NVML init/shutdown (refcounted), error strings, system
 * queries and the GPUVISOR_SIM_NVML_FAIL / _FAIL_CODE knobs.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_refs;

/* ---- fault knob ------------------------------------------------------ */

static pthread_once_t g_fail_once = PTHREAD_ONCE_INIT;
static char g_fail[1024];               /* ",name1,name2," or "all" */
static nvmlReturn_t g_fail_code = NVML_ERROR_UNKNOWN;

static void fail_init(void)
{
    const char *v = getenv("GPUVISOR_SIM_NVML_FAIL");
    if (v && *v) {
        if (strlen(v) + 3 > sizeof g_fail)
            sim_log("GPUVISOR_SIM_NVML_FAIL=%s is too long; ignored", v);
        else if (!strcmp(v, "all"))
            snprintf(g_fail, sizeof g_fail, "all");
        else
            snprintf(g_fail, sizeof g_fail, ",%s,", v);
    }
    const char *c = getenv("GPUVISOR_SIM_NVML_FAIL_CODE");
    if (c && *c) {
        char *end;
        errno = 0;
        long n = strtol(c, &end, 10);
        if (errno || end == c || *end || n <= 0 || n > 0x7fffffff)
            sim_log("GPUVISOR_SIM_NVML_FAIL_CODE=%s is not a positive "
                    "integer; ignored", c);
        else
            g_fail_code = (nvmlReturn_t)n;
    }
}

static int listed(const char *name, size_t len)
{
    char key[128];
    if (len + 3 > sizeof key)
        return 0;
    snprintf(key, sizeof key, ",%.*s,", (int)len, name);
    return strstr(g_fail, key) != NULL;
}

nvmlReturn_t sim_nvml_fail(const char *fn)
{
    pthread_once(&g_fail_once, fail_init);
    if (!g_fail[0])
        return NVML_SUCCESS;
    if (!strcmp(g_fail, "all") || listed(fn, strlen(fn)))
        return g_fail_code;
    /* "nvmlDeviceGetMemoryInfo" also covers nvmlDeviceGetMemoryInfo_v2 */
    const char *u = strrchr(fn, '_');
    if (u && u[1] == 'v' && u[2] >= '0' && u[2] <= '9' &&
        listed(fn, (size_t)(u - fn)))
        return g_fail_code;
    return NVML_SUCCESS;
}

static pthread_once_t g_offset_once = PTHREAD_ONCE_INIT;
static unsigned g_pid_offset;

static void offset_init(void)
{
    const char *v = getenv("GPUVISOR_SIM_NVML_PID_OFFSET");
    if (!v || !*v)
        return;
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (errno || end == v || *end || n < 0 || n > 0x3fffffff)
        sim_log("GPUVISOR_SIM_NVML_PID_OFFSET=%s is not an integer from 0 to %d; ignored", v,
                0x3fffffff);
    else
        g_pid_offset = (unsigned)n;
}

unsigned sim_nvml_pid(unsigned pid)
{
    pthread_once(&g_offset_once, offset_init);
    return pid + g_pid_offset;
}

int sim_nvml_ready(void)
{
    return __atomic_load_n(&g_refs, __ATOMIC_ACQUIRE) > 0;
}

/* ---- init ------------------------------------------------------------ */

SIM_API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    nvmlReturn_t fr = sim_nvml_fail("nvmlInitWithFlags");
    if (!fr)
        fr = sim_nvml_fail("nvmlInit");
    if (fr)
        return fr;
    if (sim_state_open() != SIM_OK)
        return NVML_ERROR_UNKNOWN;
    pthread_mutex_lock(&g_mu);
    __atomic_add_fetch(&g_refs, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_mu);
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

SIM_API nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

SIM_API nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t fr = sim_nvml_fail("nvmlShutdown");
    if (fr)
        return fr;
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t rc = NVML_ERROR_UNINITIALIZED;
    if (g_refs > 0) {
        __atomic_sub_fetch(&g_refs, 1, __ATOMIC_RELEASE);
        rc = NVML_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

SIM_API const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "GPU access blocked by the operating system";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "Driver/library version mismatch";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Ran out of critical resources, other than memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_NOT_READY: return "Not Ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    default: return "Unknown Error";
    }
}

nvmlReturn_t sim_nvml_put_str(char *buf, unsigned int len, const char *s)
{
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t sim_nvml_put_uint(unsigned int *out, unsigned int v)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = v;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlSystemGetDriverVersion(char *buf, unsigned int len)
{
    NVML_ENTRY("nvmlSystemGetDriverVersion");
    return sim_nvml_put_str(buf, len, SIM_DRIVER_STRING);
}

SIM_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *buf, unsigned int len)
{
    NVML_ENTRY("nvmlSystemGetNVMLVersion");
    return sim_nvml_put_str(buf, len, "13." SIM_DRIVER_STRING);
}

SIM_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    NVML_ENTRY("nvmlSystemGetCudaDriverVersion");
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = SIM_DRIVER_VERSION;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    NVML_ENTRY("nvmlSystemGetCudaDriverVersion_v2");
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = SIM_DRIVER_VERSION;
    return NVML_SUCCESS;
}
