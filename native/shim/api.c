/*
 * api.c - the exported C API (native/include/gpuvisor.h) and the
 * process-global attached region (gv_shared_region, region.h).
 */
#include "gpuvisor.h"

#include "limits.h"
#include "log.h"
#include "region.h"

#include <ctype.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define ERR_MAX 512

static _Thread_local char t_err[ERR_MAX];

static _Atomic(gv_region *) g_region;
static pthread_mutex_t g_attach_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_lazy_failed;               /* under g_attach_lock */
static pthread_once_t g_fork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void) { pthread_mutex_lock(&g_attach_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&g_attach_lock); }
static void fork_child(void) { pthread_mutex_unlock(&g_attach_lock); }
static void register_fork(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }

int gv_api_fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_err, sizeof t_err, fmt, ap);
    va_end(ap);
    return code;
}
#define fail gv_api_fail

/* The region path the environment names (the default when unset or
 * empty), or NULL with t_err set.  A relative path is refused: processes
 * of the container in other directories would each open a region of
 * their own, and each would get the whole quota. */
static const char *default_path(void)
{
    const char *p = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (p == NULL || p[0] == '\0')
        return GV_DEFAULT_REGION_PATH;
    if (p[0] != '/') {
        char q[161];
        limits_quote(q, sizeof q, p, 160);
        fail(GV_EINVAL, "gpuvisor: CUDA_DEVICE_MEMORY_SHARED_CACHE=\"%s\": not an absolute path "
             "(processes in other directories would not share the region)", q);
        return NULL;
    }
    return p;
}

static int same_file(const char *a, const char *b)
{
    if (strcmp(a, b) == 0)
        return 1;
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

/* Attach under the lock.  Returns 0 or a GV_E* code with t_err set. */
static int attach_locked(const char *path)
{
    gv_region *cur = atomic_load(&g_region);
    if (cur != NULL) {
        if (same_file(region_path(cur), path))
            return GV_OK;
        return fail(GV_EINVAL, "gpuvisor: already attached to region %s, cannot attach to %s",
                    region_path(cur), path);
    }
    gv_region *r;
    int rc = region_open(path, &r, t_err, sizeof t_err);
    if (rc != GV_OK)
        return rc;
    atomic_store(&g_region, r);
    return GV_OK;
}

gv_region *gv_shared_region(void)
{
    gv_region *r = atomic_load(&g_region);
    if (r != NULL)
        return r;
    pthread_once(&g_fork_once, register_fork);
    pthread_mutex_lock(&g_attach_lock);
    if (atomic_load(&g_region) == NULL && !g_lazy_failed) {
        const char *path = default_path();
        if (path == NULL || attach_locked(path) != GV_OK) {
            g_lazy_failed = 1;          /* fail closed, and say so once */
            gv_log(GV_LOG_ERROR, "%s", t_err);
        }
    }
    r = atomic_load(&g_region);
    pthread_mutex_unlock(&g_attach_lock);
    return r;
}

GV_EXPORT int gv_api_version(void)
{
    return GV_API_VERSION;
}

GV_EXPORT int gv_parse_memory_limit(const char *text, uint64_t physical_total, uint64_t *bytes)
{
    uint64_t v;
    const char *why = NULL;
    if (bytes == NULL)
        return fail(GV_EINVAL, "gpuvisor: gv_parse_memory_limit: bytes is NULL");
    int rc = limits_parse(text, physical_total, &v, &why);
    if (rc != GV_OK) {
        char q[97];
        limits_quote(q, sizeof q, text ? text : "(null)", 96);
        return fail(rc, "gpuvisor: memory limit \"%s\": %s", q, why ? why : "invalid");
    }
    *bytes = v;
    return GV_OK;
}

GV_EXPORT int gv_validate_env(void)
{
    char err[512];
    if (limits_check_env(err, sizeof err) != GV_OK || limits_sm_check_env(err, sizeof err) != GV_OK)
        return fail(GV_EINVAL, "%s", err);
    return GV_OK;
}

GV_EXPORT const char *gv_last_error(void)
{
    return t_err;
}

GV_EXPORT int gv_region_attach(const char *path)
{
    pthread_once(&g_fork_once, register_fork);
    if (path == NULL && (path = default_path()) == NULL)
        return GV_EINVAL;
    if (path[0] == '\0')
        return fail(GV_EINVAL, "gpuvisor: gv_region_attach: empty path");
    pthread_mutex_lock(&g_attach_lock);
    int rc = attach_locked(path);
    pthread_mutex_unlock(&g_attach_lock);
    return rc;
}

GV_EXPORT const char *gv_region_default_path(void)
{
    return GV_DEFAULT_REGION_PATH;
}

GV_EXPORT const char *gv_region_path(void)
{
    gv_region *r = atomic_load(&g_region);
    return r != NULL ? region_path(r) : NULL;
}

/* The attached region, or NULL with t_err set. */
static gv_region *need_region(const char *fn)
{
    gv_region *r = atomic_load(&g_region);
    if (r == NULL)
        fail(GV_ENOTATTACHED, "gpuvisor: %s: no region attached (call gv_region_attach first)", fn);
    return r;
}

/* Validates dev against the region; returns 0 or GV_ENOENT with t_err set. */
static int check_dev(gv_region *r, int dev, const char *fn)
{
    int count = region_device_count(r);
    if (dev < 0 || dev >= count)
        return fail(GV_ENOENT, "gpuvisor: %s: no device %d (the region has %d)", fn, dev, count);
    if (!region_device_ready(r, dev))
        return fail(GV_ENOENT, "gpuvisor: %s: device %d is not initialised", fn, dev);
    return GV_OK;
}

#define NEED(fn)                                   \
    gv_region *r = need_region(fn);                \
    if (r == NULL)                                 \
        return GV_ENOTATTACHED

#define NEED_DEV(fn, dev)                          \
    NEED(fn);                                      \
    do {                                           \
        int rc_ = check_dev(r, dev, fn);           \
        if (rc_ != GV_OK)                          \
            return rc_;                            \
    } while (0)

#define NONNULL(fn, p)                             \
    do {                                           \
        if ((p) == NULL)                           \
            return fail(GV_EINVAL, "gpuvisor: %s: %s is NULL", fn, #p); \
    } while (0)

GV_EXPORT int gv_device_count(void)
{
    NEED("gv_device_count");
    /* Entries are claimed in order, and nobody passes one that is being
     * initialised: one being initialised, or left so by an initialiser
     * killed half-way until another process takes it over, is the last.
     * It is not counted, so that every index below the count answers. */
    int n = region_device_count(r);
    while (n > 0 && !region_device_ready(r, n - 1))
        n--;
    return n;
}

GV_EXPORT int gv_device_uuid(int dev, char *buf, size_t len)
{
    NONNULL("gv_device_uuid", buf);
    NEED_DEV("gv_device_uuid", dev);
    unsigned char u[16];
    region_device_uuid(r, dev, u);
    char tmp[48];
    snprintf(tmp, sizeof tmp,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11],
             u[12], u[13], u[14], u[15]);
    if (len < strlen(tmp) + 1)
        return fail(GV_EINVAL, "gpuvisor: gv_device_uuid: buffer of %zu bytes, need %zu",
                    len, strlen(tmp) + 1);
    memcpy(buf, tmp, strlen(tmp) + 1);
    return GV_OK;
}

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    c = tolower(c);
    return (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" -> 16 bytes. */
static int parse_uuid(const char *s, unsigned char out[16])
{
    if (strncmp(s, "GPU-", 4) != 0)
        return -1;
    s += 4;
    static const int groups[] = {4, 2, 2, 2, 6};
    int k = 0;
    for (int g = 0; g < 5; g++) {
        if (g > 0 && *s++ != '-')
            return -1;
        for (int i = 0; i < groups[g]; i++) {
            int hi = hexval((unsigned char)s[0]);
            int lo = hi < 0 ? -1 : hexval((unsigned char)s[1]);
            if (lo < 0)
                return -1;
            out[k++] = (unsigned char)(hi << 4 | lo);
            s += 2;
        }
    }
    return *s == '\0' ? 0 : -1;
}

GV_EXPORT int gv_device_register(const char *uuid, uint64_t physical_total, uint64_t limit)
{
    NONNULL("gv_device_register", uuid);
    NEED("gv_device_register");
    unsigned char u[16];
    if (parse_uuid(uuid, u) != 0) {
        char q[65];
        limits_quote(q, sizeof q, uuid, 64);
        return fail(GV_EINVAL, "gpuvisor: gv_device_register: \"%s\" is not a GPU UUID "
                    "(GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)", q);
    }
    if (limit == 0)
        return fail(GV_EINVAL, "gpuvisor: gv_device_register: a limit of 0 bytes "
                    "(use GV_UNLIMITED for none)");
    int rc = region_device_lookup(r, u, physical_total, limit);
    if (rc < 0)
        return fail(rc, "gpuvisor: gv_device_register: region %s has no free device entry "
                    "(%d in use)", region_path(r), GV_MAX_DEVICES);
    /* An entry an earlier run left: as a process of the container whose
     * environment gives that limit (region_device_take_limit). */
    uint64_t current = 0;
    if (region_device_take_limit(r, rc, limit, &current) == GV_EBUSY)
        return fail(GV_EINVAL, "gpuvisor: gv_device_register: %s: a limit of %llu bytes, but live "
                    "processes of region %s run at %llu (18446744073709551615: no limit)", uuid,
                    (unsigned long long)limit, region_path(r), (unsigned long long)current);
    return rc;
}

/* A device's figure: out (its name as the header gives it) from read(r, dev). */
#define DEVICE_GETTER(name, out, read)                                          \
    GV_EXPORT int name(int dev, uint64_t *out)                                  \
    {                                                                           \
        NONNULL(#name, out);                                                    \
        NEED_DEV(#name, dev);                                                   \
        *out = read(r, dev);                                                    \
        return GV_OK;                                                           \
    }

DEVICE_GETTER(gv_device_get_limit, bytes, region_limit)
DEVICE_GETTER(gv_device_get_used, bytes, region_used)
DEVICE_GETTER(gv_device_get_physical_total, bytes, region_device_physical_total)
DEVICE_GETTER(gv_device_get_oom_count, count, region_oom_count)
DEVICE_GETTER(gv_device_get_context_cost, bytes, region_ctx_cost)
DEVICE_GETTER(gv_device_get_spilled, bytes, region_spilled)
DEVICE_GETTER(gv_device_get_guarantee, bytes, region_guarantee)

GV_EXPORT int gv_device_set_limit(int dev, uint64_t bytes)
{
    NEED_DEV("gv_device_set_limit", dev);
    if (bytes == 0)
        return fail(GV_EINVAL, "gpuvisor: gv_device_set_limit: a limit of 0 bytes "
                    "(use GV_UNLIMITED for none)");
    region_set_limit(r, dev, bytes);
    return GV_OK;
}

/* ---- SM-time quota -------------------------------------------------------- */

GV_EXPORT int gv_device_get_sm(int dev, uint32_t *limit_pct, uint32_t *share_bp,
                               uint32_t *policy, uint32_t *priority)
{
    NONNULL("gv_device_get_sm", limit_pct);
    NONNULL("gv_device_get_sm", share_bp);
    NONNULL("gv_device_get_sm", policy);
    NONNULL("gv_device_get_sm", priority);
    NEED_DEV("gv_device_get_sm", dev);
    struct gv_sm *sm = region_sm(r, dev);
    *limit_pct = atomic_load(&sm->limit);
    *share_bp = atomic_load(&sm->share);
    *policy = atomic_load(&sm->policy);
    *priority = atomic_load(&sm->priority);
    return GV_OK;
}

GV_EXPORT int gv_device_get_sm_usage(int dev, uint64_t *busy_ns, uint64_t *wait_ns,
                                     uint64_t *launches)
{
    NONNULL("gv_device_get_sm_usage", busy_ns);
    NONNULL("gv_device_get_sm_usage", wait_ns);
    NONNULL("gv_device_get_sm_usage", launches);
    NEED_DEV("gv_device_get_sm_usage", dev);
    struct gv_sm *sm = region_sm(r, dev);
    *busy_ns = atomic_load(&sm->busy_ns);
    *wait_ns = atomic_load(&sm->wait_ns);
    *launches = atomic_load(&sm->launches);
    return GV_OK;
}

GV_EXPORT int gv_device_set_sm_limit(int dev, uint32_t pct)
{
    NEED_DEV("gv_device_set_sm_limit", dev);
    if (pct > 100)
        return fail(GV_EINVAL, "gpuvisor: gv_device_set_sm_limit: %u%% is not 0..100", pct);
    region_sm_set_limit(r, dev, pct);
    return GV_OK;
}

GV_EXPORT int gv_device_set_sm_others(int dev, uint32_t share_bp)
{
    NEED_DEV("gv_device_set_sm_others", dev);
    if (share_bp > 10000)
        return fail(GV_EINVAL, "gpuvisor: gv_device_set_sm_others: %u is not 0..10000", share_bp);
    struct gv_sm *sm = region_sm(r, dev);
    atomic_store(&sm->others, share_bp);
    atomic_store(&sm->others_at, rg_now_ns());
    return GV_OK;
}

GV_EXPORT int gv_device_get_sm_others(int dev, uint32_t *share_bp, uint64_t *age_ms)
{
    NONNULL("gv_device_get_sm_others", share_bp);
    NONNULL("gv_device_get_sm_others", age_ms);
    NEED_DEV("gv_device_get_sm_others", dev);
    struct gv_sm *sm = region_sm(r, dev);
    uint64_t now = rg_now_ns();
    uint64_t at = atomic_load(&sm->others_at);
    *share_bp = atomic_load(&sm->others);
    *age_ms = at && now > at ? (now - at) / 1000000 : (at ? 0 : UINT64_MAX);
    return GV_OK;
}

GV_EXPORT int gv_device_set_sm_yield(int dev, uint32_t lease_ms)
{
    NEED_DEV("gv_device_set_sm_yield", dev);
    if (lease_ms > GV_SM_YIELD_MAX_MS)
        return fail(GV_EINVAL, "gpuvisor: gv_device_set_sm_yield: lease_ms=%u: more than %u ms",
                    lease_ms, GV_SM_YIELD_MAX_MS);
    uint64_t until = lease_ms != 0 ? rg_now_ns() + (uint64_t)lease_ms * 1000000ULL : 0;
    region_sm_set_yield(r, dev, until);
    return GV_OK;
}

GV_EXPORT int gv_process_list(int32_t *pids, int cap)
{
    if (cap < 0 || (pids == NULL && cap > 0))
        return fail(GV_EINVAL, "gpuvisor: gv_process_list: bad buffer (pids %p, cap %d)",
                    (void *)pids, cap);
    NEED("gv_process_list");
    return region_process_list(r, pids, cap);
}

/* A process's figure on a device: *bytes from read(r, dev, its slot). */
#define PROCESS_GETTER(name, read)                                              \
    GV_EXPORT int name(int32_t pid, int dev, uint64_t *bytes)                   \
    {                                                                           \
        NONNULL(#name, bytes);                                                  \
        if (pid <= 0)                                                           \
            return fail(GV_EINVAL, "gpuvisor: " #name ": bad pid %d", (int)pid); \
        NEED_DEV(#name, dev);                                                   \
        int slot = region_slot_of_pid(r, pid);                                  \
        if (slot < 0)                                                           \
            return fail(GV_ENOENT, "gpuvisor: " #name ": pid %d is not registered " \
                        "in region %s", (int)pid, region_path(r));              \
        *bytes = read(r, dev, slot);                                            \
        return GV_OK;                                                           \
    }

PROCESS_GETTER(gv_process_get_used, region_slot_used)
PROCESS_GETTER(gv_process_get_spilled, region_slot_spilled)

GV_EXPORT int gv_reclaim_dead(void)
{
    NEED("gv_reclaim_dead");
    return region_reclaim_dead(r);
}
