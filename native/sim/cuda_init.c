/*
 * cuda_init.c - cuInit, versions, error strings, CUDA_VISIBLE_DEVICES,
 * the allocation fault-injection counter, the GPUVISOR_SIM_CUDA_FAIL knob
 * and the handle registry.
 */
#include <ctype.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "sim.h"

pthread_mutex_t sim_mu = PTHREAD_MUTEX_INITIALIZER;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static CUresult g_init_rc = CUDA_ERROR_NOT_INITIALIZED;
static volatile int g_inited;
static int g_nvis;
static int g_vis[SIM_MAX_DEV];          /* CUDA ordinal -> node index */
static char g_vis_uuid[SIM_MAX_DEV][SIM_UUID_LEN];

/* The devices CUDA can enumerate, in order: each GPU, or, for a GPU in MIG
 * mode, its MIG devices (compute instances) by instance id; a MIG device's
 * node is its GPU instance's. */
#define SIM_MAX_CAND (SIM_MAX_DEV * SIM_MIG_SLOTS)
static int g_ncand;
static int g_cand_node[SIM_MAX_CAND];
static char g_cand_uuid[SIM_MAX_CAND][SIM_UUID_LEN];

static void list_candidates(void)
{
    static sim_migdev m[SIM_MAX_CAND];
    int nm = sim_mig_devices(-1, m, SIM_MAX_CAND);
    g_ncand = 0;
    for (int g = 0; g < sim_ndev(); g++) {
        if (sim_mig_mode(g)) {
            for (int i = 0; i < nm && g_ncand < SIM_MAX_CAND; i++)
                if (m[i].gpu == g) {
                    g_cand_node[g_ncand] = m[i].node;
                    memcpy(g_cand_uuid[g_ncand++], m[i].uuid, SIM_UUID_LEN);
                }
            continue;
        }
        g_cand_node[g_ncand] = g;
        memcpy(g_cand_uuid[g_ncand++], sim_dev(g)->uuid, SIM_UUID_LEN);
    }
}
static unsigned long long g_fail_at, g_fail_every, g_ctx_ms, g_alloc_ms, g_free_ms, g_module_mib;
static unsigned long long g_launch_us;
static unsigned long long g_record_us;         /* GPUVISOR_SIM_RECORD_US */
static unsigned long long g_event_query_ms;      /* GPUVISOR_SIM_EVENT_QUERY_MS */
static unsigned long long g_launch_every = 1;   /* GPUVISOR_SIM_LAUNCH_EVERY */
static _Atomic unsigned long long g_launches;
static unsigned long long g_alloc_calls;
static char g_cuda_fail[1024];          /* ",name1,name2," or "" */

/* One CUDA_VISIBLE_DEVICES token -> candidate index, -1 if invalid;
 * *is_index says whether it was written as an index.  As a real driver
 * reads it (seen on an H100, driver 580.159): digits, a '+' before them
 * allowed, then anything ignored ("0a" is 0); a UUID (GPU- or MIG-) cut
 * short after its prefix but not to nothing, or running on past the whole
 * UUID. */
static int vis_token(const char *t, int ndev, int *is_index)
{
    while (isspace((unsigned char)*t))
        t++;
    size_t len = strlen(t);
    while (len && isspace((unsigned char)t[len - 1]))
        len--;
    if (!len)
        return -1;
    size_t first = t[0] == '+' ? 1 : 0;
    *is_index = isdigit((unsigned char)t[first]) != 0;
    if (*is_index) {
        long v = 0;
        for (size_t i = first; i < len && isdigit((unsigned char)t[i]); i++) {
            v = v * 10 + (t[i] - '0');
            if (v > 1000)
                return -1;
        }
        return v < ndev ? (int)v : -1;
    }
    if (len <= 4)
        return -1;
    int found = -1;
    for (int i = 0; i < ndev; i++) {
        size_t ulen = strlen(g_cand_uuid[i]);
        if (strncasecmp(g_cand_uuid[i], t, len < ulen ? len : ulen) == 0) {
            if (found >= 0)
                return -1;              /* ambiguous prefix */
            found = i;
        }
    }
    return found;
}

static void parse_visible(void)
{
    list_candidates();
    int ndev = g_ncand;
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    g_nvis = 0;
    if (!v) {
        for (int i = 0; i < ndev && g_nvis < SIM_MAX_DEV; i++) {
            memcpy(g_vis_uuid[g_nvis], g_cand_uuid[i], SIM_UUID_LEN);
            g_vis[g_nvis++] = g_cand_node[i];
        }
        return;
    }
    char buf[1024];
    int index_form[SIM_MAX_DEV];
    snprintf(buf, sizeof buf, "%s", v);
    char *p = buf;
    while (p && g_nvis < SIM_MAX_DEV) {
        char *comma = strchr(p, ',');
        if (comma)
            *comma = 0;
        int cand = vis_token(p, ndev, &index_form[g_nvis]);
        if (cand < 0)
            break;                      /* list stops at an invalid token */
        int node = g_cand_node[cand];
        memcpy(g_vis_uuid[g_nvis], g_cand_uuid[cand], SIM_UUID_LEN);
        for (int i = 0; i < g_nvis && node >= 0; i++) {
            if (strcmp(g_vis_uuid[i], g_vis_uuid[g_nvis]) != 0)
                continue;
            if (index_form[i] && index_form[g_nvis])
                g_nvis = 0;             /* an index twice: no device at all */
            node = -1;                  /* otherwise the list stops there */
        }
        if (node < 0)
            break;
        g_vis[g_nvis++] = node;
        p = comma ? comma + 1 : NULL;
    }
}

/* A real driver cannot be carried across fork(): in a child forked after
 * cuInit, cuInit and every call that needs it give
 * CUDA_ERROR_NOT_INITIALIZED.  (A child forked before cuInit initialises on
 * its own.) */
static void child_after_fork(void)
{
    if (__atomic_load_n(&g_inited, __ATOMIC_ACQUIRE)) {
        __atomic_store_n(&g_inited, 0, __ATOMIC_RELEASE);
        g_init_rc = CUDA_ERROR_NOT_INITIALIZED;
    }
}

static void do_init(void)
{
    int rc = sim_state_open();
    if (rc != SIM_OK) {
        g_init_rc = rc == SIM_ERR_SPEC ? CUDA_ERROR_INVALID_VALUE
                                       : CUDA_ERROR_OPERATING_SYSTEM;
        return;
    }
    if (sim_knob_uint("GPUVISOR_SIM_FAIL_ALLOC_AT", &g_fail_at) <= 0)
        g_fail_at = 0;
    if (sim_knob_uint("GPUVISOR_SIM_FAIL_ALLOC_EVERY", &g_fail_every) <= 0)
        g_fail_every = 0;
    if (sim_knob_uint("GPUVISOR_SIM_CTX_CREATE_MS", &g_ctx_ms) <= 0)
        g_ctx_ms = 0;
    if (sim_knob_uint("GPUVISOR_SIM_ALLOC_MS", &g_alloc_ms) <= 0)
        g_alloc_ms = 0;
    if (sim_knob_uint("GPUVISOR_SIM_FREE_MS", &g_free_ms) <= 0)
        g_free_ms = 0;
    g_launch_us = sim_knob_range("GPUVISOR_SIM_LAUNCH_US", 1, 1000000, 0);
    g_launch_every = sim_knob_range("GPUVISOR_SIM_LAUNCH_EVERY", 1, 1000000, 1);
    g_record_us = sim_knob_range("GPUVISOR_SIM_RECORD_US", 1, 1000000, 0);
    g_module_mib = sim_knob_range("GPUVISOR_SIM_MODULE_MIB", 1, 1ULL << 20, 0);
    g_event_query_ms = sim_knob_range("GPUVISOR_SIM_EVENT_QUERY_MS", 1, 10000, 0);
    const char *f = getenv("GPUVISOR_SIM_CUDA_FAIL");
    if (f && *f) {
        if (strlen(f) + 3 > sizeof g_cuda_fail)
            sim_log("GPUVISOR_SIM_CUDA_FAIL=%s is too long; ignored", f);
        else
            snprintf(g_cuda_fail, sizeof g_cuda_fail, ",%s,", f);
    }
    parse_visible();
    if (g_nvis == 0) {
        g_init_rc = CUDA_ERROR_NO_DEVICE;
        return;
    }
    pthread_atfork(NULL, NULL, child_after_fork);
    g_init_rc = CUDA_SUCCESS;
    __atomic_store_n(&g_inited, 1, __ATOMIC_RELEASE);
}

SIM_API CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&g_once, do_init);
    return g_init_rc;
}

CUresult sim_check_init(void)
{
    if (__atomic_load_n(&g_inited, __ATOMIC_ACQUIRE))
        return CUDA_SUCCESS;
    return CUDA_ERROR_NOT_INITIALIZED;
}

CUresult sim_check_args(int bad)
{
    SIM_TRY(sim_check_init());
    return bad ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult sim_check_dev(int out_ok, CUdevice dev, int *node)
{
    SIM_TRY(sim_check_args(!out_ok));
    int n = sim_ord_node(dev);
    if (n < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (node)
        *node = n;
    return CUDA_SUCCESS;
}

int sim_nvisible(void)
{
    return g_nvis;
}

int sim_ord_node(int ordinal)
{
    if (ordinal < 0 || ordinal >= g_nvis)
        return -1;
    return g_vis[ordinal];
}

const char *sim_ord_uuid(int ordinal)
{
    return g_vis_uuid[ordinal];
}

int sim_fault_alloc(void)
{
    unsigned long long n = __atomic_add_fetch(&g_alloc_calls, 1,
                                              __ATOMIC_RELAXED);
    if (g_fail_at && n == g_fail_at)
        return 1;
    if (g_fail_every && n % g_fail_every == 0)
        return 1;
    return 0;
}

CUresult sim_cuda_fail(const char *fn)
{
    char key[128];
    if (!g_cuda_fail[0] || strlen(fn) + 3 > sizeof key)
        return CUDA_SUCCESS;
    snprintf(key, sizeof key, ",%s,", fn);
    return strstr(g_cuda_fail, key) ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
}

static void sleep_ms(unsigned long long ms)
{
    struct timespec ts = { (time_t)(ms / 1000), (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

void sim_ctx_create_delay(void)
{
    if (g_ctx_ms)
        sleep_ms(g_ctx_ms);
}

void sim_alloc_delay(void)
{
    if (g_alloc_ms)
        sleep_ms(g_alloc_ms);
}

/* A driver call that hangs for a while: the interposer's SM meter polls
 * its launches' events with cuEventQuery (tests of what waits on it). */
void sim_event_query_delay(void)
{
    if (g_event_query_ms)
        sleep_ms(g_event_query_ms);
}

/* Spent on the CPU, as a driver's own work is: a sleep would add the
 * scheduler's wake-up latency on a loaded machine (milliseconds).  With
 * GPUVISOR_SIM_LAUNCH_EVERY=K only the process's K-th, 2K-th, ... launch
 * call takes it: a launching thread that the machine does not run for a
 * while, now and then. */
void sim_launch_delay(void)
{
    if (g_launch_us && (atomic_fetch_add(&g_launches, 1) + 1) % g_launch_every == 0) {
        uint64_t until = sim_now_ns() + g_launch_us * 1000;
        while (sim_now_ns() < until)
            ;
    }
}

/* GPUVISOR_SIM_RECORD_US: an event record's own CPU time, spent likewise
 * (a real driver's costs microseconds, more than the simulator's). */
void sim_record_delay(void)
{
    if (g_record_us) {
        uint64_t until = sim_now_ns() + g_record_us * 1000;
        while (sim_now_ns() < until)
            ;
    }
}

void sim_free_delay(void)
{
    if (g_free_ms)
        sleep_ms(g_free_ms);
}

uint64_t sim_module_bytes(void)
{
    return g_module_mib * SIM_MIB;
}

SIM_API CUresult cuDriverGetVersion(int *v)
{
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    *v = SIM_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

/* ---- error strings --------------------------------------------------- */

struct sim_err { CUresult rc; const char *name, *text; };
static const struct sim_err g_err[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED",
     "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED",
     "driver shutting down"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY",
     "CUDA driver is a stub library"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE",
     "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE",
     "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE",
     "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT",
     "invalid device context"},
    {CUDA_ERROR_UNSUPPORTED_LIMIT, "CUDA_ERROR_UNSUPPORTED_LIMIT",
     "limit is not supported on this architecture"},
    {CUDA_ERROR_CONTEXT_ALREADY_IN_USE, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
     "context already in use"},
    {CUDA_ERROR_INVALID_SOURCE, "CUDA_ERROR_INVALID_SOURCE",
     "device kernel image is invalid"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND",
     "file not found"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
     "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE",
     "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
     "too many resources requested for launch"},
    {CUDA_ERROR_LAUNCH_TIMEOUT, "CUDA_ERROR_LAUNCH_TIMEOUT",
     "the launch timed out and was terminated"},
    {CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
     "primary context active"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED",
     "context is destroyed"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED",
     "unspecified launch failure"},
    {CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
     "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
     "too many blocks in cooperative launch"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED",
     "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED",
     "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
     "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
     "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
     "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "capture was not ended"},
    {CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
     "capturing stream has unjoined work"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing stream"},
    {CUDA_ERROR_CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT",
     "operation not permitted on an event last recorded in a capturing "
     "stream"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

/* The entry of g_err for rc, NULL for one the driver does not know. */
static const struct sim_err *err_of(CUresult rc)
{
    for (size_t i = 0; i < sizeof g_err / sizeof g_err[0]; i++)
        if (g_err[i].rc == rc)
            return &g_err[i];
    return NULL;
}

SIM_API CUresult cuGetErrorName(CUresult rc, const char **out)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    const struct sim_err *e = err_of(rc);
    *out = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuGetErrorString(CUresult rc, const char **out)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    const struct sim_err *e = err_of(rc);
    *out = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- handle registry: open-addressing pointer set (sim_mu held) ------ */

static const void **g_reg;
static size_t g_reg_cap, g_reg_n;
#define REG_TOMB ((const void *)1)

static size_t reg_hash(const void *p, size_t cap)
{
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x & (cap - 1);
}

static void reg_grow(void)
{
    size_t live = 0;
    for (size_t i = 0; i < g_reg_cap; i++)
        live += g_reg[i] && g_reg[i] != REG_TOMB;
    size_t ncap = g_reg_cap < 256 ? 256 : g_reg_cap;
    while ((live + 1) * 4 > ncap)
        ncap *= 2;
    g_reg_n = live;
    const void **n = calloc(ncap, sizeof *n);
    if (!n)
        return;
    for (size_t i = 0; i < g_reg_cap; i++) {
        const void *p = g_reg[i];
        if (!p || p == REG_TOMB)
            continue;
        size_t h = reg_hash(p, ncap);
        while (n[h])
            h = (h + 1) & (ncap - 1);
        n[h] = p;
    }
    free(g_reg);
    g_reg = n;
    g_reg_cap = ncap;
}

void sim_reg_add(const void *p)
{
    if ((g_reg_n + 1) * 2 > g_reg_cap)
        reg_grow();
    size_t h = reg_hash(p, g_reg_cap);
    while (g_reg[h] && g_reg[h] != REG_TOMB)
        h = (h + 1) & (g_reg_cap - 1);
    g_reg[h] = p;
    g_reg_n++;                          /* tombstones count until regrow */
}

static size_t reg_slot(const void *p)
{
    if (!g_reg_cap || !p)
        return (size_t)-1;
    size_t h = reg_hash(p, g_reg_cap);
    for (size_t i = 0; i < g_reg_cap && g_reg[h]; i++) {
        if (g_reg[h] == p)
            return h;
        h = (h + 1) & (g_reg_cap - 1);
    }
    return (size_t)-1;
}

void sim_reg_del(const void *p)
{
    size_t s = reg_slot(p);
    if (s != (size_t)-1)
        g_reg[s] = REG_TOMB;
}

int sim_reg_has(const void *p)
{
    return reg_slot(p) != (size_t)-1;
}
