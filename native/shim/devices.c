/* devices.c - the CUDA ordinals this process sees, and their quota entries. */
#include <ctype.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core.h"
#include "limits.h"
#include "log.h"
#include "oversub.h"
#include "sm.h"

enum { DEV_UNSET = 0, DEV_READY = 1, DEV_FAILED = 2 };

static struct {
    atomic_int state;
    gv_devinfo info;
} devs[GV_MAX_ORDINALS];
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;

void gv_uuid_format(const unsigned char u[16], char *buf, size_t len)
{
    snprintf(buf, len,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11],
             u[12], u[13], u[14], u[15]);
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int gv_uuid_parse(const char *t, unsigned char u[16])
{
    if (!t || strncmp(t, "GPU-", 4) != 0)
        return -1;
    t += 4;
    int n = 0;
    while (*t && n < 32) {
        if (*t == '-') { t++; continue; }
        int hi = hexval(t[0]), lo = hi < 0 ? -1 : hexval(t[1]);
        if (hi < 0 || lo < 0)
            return -1;
        u[n / 2] = (unsigned char)(hi << 4 | lo);
        n += 2;
        t += 2;
    }
    return (n == 32 && *t == '\0') ? 0 : -1;
}

static CUresult device_uuid(int ordinal, unsigned char out[16])
{
    CUuuid u;
    CUresult rc = CUDA_ERROR_NOT_FOUND;
    if (gv_real_sym(GV_SYM_cuDeviceGetUuid_v2))
        rc = GV_REAL(cuDeviceGetUuid_v2, CUresult (*)(CUuuid *, CUdevice))(&u, ordinal);
    if (rc == CUDA_ERROR_NOT_FOUND)
        rc = GV_REAL(cuDeviceGetUuid, CUresult (*)(CUuuid *, CUdevice))(&u, ordinal);
    if (rc == CUDA_SUCCESS)
        memcpy(out, u.bytes, 16);
    return rc;
}

static uint64_t device_granularity(int ordinal)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    size_t g = 0;
    CUresult rc = GV_REAL(cuMemGetAllocationGranularity,
                          CUresult (*)(size_t *, const CUmemAllocationProp *, int))(
        &g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    /* Real GPUs map device memory in 2 MiB pages; assume that if unknown. */
    return (rc == CUDA_SUCCESS && g > 0) ? g : (2u << 20);
}

static void limit_text(char *buf, size_t len, uint64_t limit)
{
    if (limit == GV_UNLIMITED)
        snprintf(buf, len, "no limit");
    else
        snprintf(buf, len, "%llu bytes", (unsigned long long)limit);
}

int gv_device_take_limit(int dev, int ordinal, const char *uuid_str, uint64_t limit)
{
    gv_region *r = gv_core_region();
    uint64_t current = 0;
    if (region_device_take_limit(r, dev, limit, &current) != GV_EBUSY)
        return 0;
    char want[48], have[48];
    limit_text(want, sizeof want, limit);
    limit_text(have, sizeof have, current);
    gv_log(GV_LOG_ERROR, "device %d (%s): this process's CUDA_DEVICE_MEMORY_LIMIT gives %s, but "
           "live processes of region %s run at %s (another environment's, not set live); "
           "CUDA calls fail with CUDA_ERROR_NOT_PERMITTED", ordinal, uuid_str, want,
           region_path(r), have);
    return -1;
}

static CUresult device_init(int ordinal)
{
    gv_devinfo info;
    memset(&info, 0, sizeof info);
    CUresult rc = device_uuid(ordinal, info.uuid);
    if (rc != CUDA_SUCCESS)
        return rc;
    size_t total = 0;
    rc = GV_REAL(cuDeviceTotalMem_v2, CUresult (*)(size_t *, CUdevice))(&total, ordinal);
    if (rc != CUDA_SUCCESS)
        return rc;
    gv_uuid_format(info.uuid, info.uuid_str, sizeof info.uuid_str);
    info.physical_total = total;
    info.granularity = device_granularity(ordinal);

    uint64_t limit = GV_UNLIMITED;
    char err[512];
    if (limits_memory_for_ordinal(ordinal, total, &limit, err, sizeof err) != 0) {
        gv_log(GV_LOG_ERROR, "%s; CUDA calls fail with CUDA_ERROR_NOT_PERMITTED", err);
        atomic_store(&devs[ordinal].state, DEV_FAILED);
        gv_core_fail();
        return GV_FAIL_CUDA;
    }
    int dev = region_device_lookup(gv_core_region(), info.uuid, total, limit);
    if (dev < 0) {
        gv_log(GV_LOG_ERROR, "region %s: no free device entry for %s (%d)",
               region_path(gv_core_region()), info.uuid_str, dev);
        atomic_store(&devs[ordinal].state, DEV_FAILED);
        return GV_FAIL_CUDA;
    }
    if (gv_device_take_limit(dev, ordinal, info.uuid_str, limit) != 0) {
        atomic_store(&devs[ordinal].state, DEV_FAILED);
        gv_core_fail();
        return GV_FAIL_CUDA;
    }
    unsigned sm = 0;
    if (limits_sm_for_ordinal(ordinal, &sm, err, sizeof err) != 0) {
        gv_log(GV_LOG_ERROR, "%s; CUDA calls fail with CUDA_ERROR_NOT_PERMITTED", err);
        atomic_store(&devs[ordinal].state, DEV_FAILED);
        gv_core_fail();
        return GV_FAIL_CUDA;
    }
    int policy = limits_sm_policy();
    region_sm_configure(gv_core_region(), dev, policy < 0 ? 0 : sm, policy < 0 ? 0 : (unsigned)policy,
                        limits_task_priority());
    /* Whether the turn between containers is needed there (sm_arbiter.c);
     * a device that cannot say is taken to preempt, as every GPU since
     * Pascal does. */
    int preempts = 1;
    if (GV_REAL(cuDeviceGetAttribute, CUresult (*)(int *, CUdevice_attribute, CUdevice))(
            &preempts, CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED, ordinal) != CUDA_SUCCESS)
        preempts = 1;
    gv_arb_set_preemption(dev, preempts);
    info.region_dev = dev;
    devs[ordinal].info = info;
    atomic_store_explicit(&devs[ordinal].state, DEV_READY, memory_order_release);
    gv_oversub_attach(&devs[ordinal].info);
    gv_log(GV_LOG_INFO, "device %d is %s: %llu bytes physical, limit %llu, entry %d",
           ordinal, info.uuid_str, (unsigned long long)total, (unsigned long long)region_limit(gv_core_region(), dev), dev);
    return CUDA_SUCCESS;
}

/* A fork while another thread sets a device up must not leave the child
 * with the lock held: the child gets a fresh lock, and a device whose
 * setup was cut short is still DEV_UNSET, so it is set up again. */
static void init_lock_child(void) { pthread_mutex_init(&init_lock, NULL); }
static void register_atfork(void) { pthread_atfork(NULL, NULL, init_lock_child); }
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

CUresult gv_device(int ordinal, const gv_devinfo **out)
{
    if (ordinal < 0 || ordinal >= GV_MAX_ORDINALS)
        return CUDA_ERROR_INVALID_DEVICE;
    int st = atomic_load_explicit(&devs[ordinal].state, memory_order_acquire);
    if (__builtin_expect(st == DEV_UNSET, 0)) {
        pthread_once(&atfork_once, register_atfork);
        pthread_mutex_lock(&init_lock);
        st = atomic_load(&devs[ordinal].state);
        CUresult rc = st == DEV_UNSET ? device_init(ordinal) : CUDA_SUCCESS;
        pthread_mutex_unlock(&init_lock);
        if (rc != CUDA_SUCCESS)
            return rc;
        st = atomic_load_explicit(&devs[ordinal].state, memory_order_acquire);
    }
    if (st != DEV_READY)
        return GV_FAIL_CUDA;
    *out = &devs[ordinal].info;
    return CUDA_SUCCESS;
}

int gv_device_known(int ordinal, const gv_devinfo **out)
{
    if (ordinal < 0 || ordinal >= GV_MAX_ORDINALS ||
        atomic_load_explicit(&devs[ordinal].state, memory_order_acquire) != DEV_READY)
        return 0;
    *out = &devs[ordinal].info;
    return 1;
}

CUresult gv_current(int *ordinal, CUcontext *ctx)
{
    CUcontext c = NULL;
    CUresult rc = GV_REAL(cuCtxGetCurrent, CUresult (*)(CUcontext *))(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUdevice d = 0;
    rc = GV_REAL(cuCtxGetDevice, CUresult (*)(CUdevice *))(&d);
    if (rc != CUDA_SUCCESS)
        return rc;
    *ordinal = d;
    if (ctx)
        *ctx = c;
    return CUDA_SUCCESS;
}

CUresult gv_ordinal_of_ctx(CUcontext ctx, int *ordinal)
{
    CUcontext cur = NULL;
    GV_REAL(cuCtxGetCurrent, CUresult (*)(CUcontext *))(&cur);
    if (ctx == cur)
        return gv_current(ordinal, NULL);
    CUresult rc = GV_REAL(cuCtxPushCurrent_v2, CUresult (*)(CUcontext))(ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    CUdevice d = 0;
    rc = GV_REAL(cuCtxGetDevice, CUresult (*)(CUdevice *))(&d);
    CUcontext popped;
    GV_REAL(cuCtxPopCurrent_v2, CUresult (*)(CUcontext *))(&popped);
    if (rc == CUDA_SUCCESS)
        *ordinal = d;
    return rc;
}

CUresult gv_ordinal_of_stream(CUstream stream, int *ordinal, CUcontext *ctx)
{
    if (stream == NULL || stream == GV_CU_STREAM_LEGACY || stream == GV_CU_STREAM_PER_THREAD)
        return gv_current(ordinal, ctx);
    CUcontext c = NULL;
    CUresult rc = GV_REAL(cuStreamGetCtx, CUresult (*)(CUstream, CUcontext *))(stream, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (ctx)
        *ctx = c;
    return gv_ordinal_of_ctx(c, ordinal);
}

/* ---- UUID -> ordinal, for NVML callers ---------------------------------- */

/* Two maps: CUDA's (once the process has called cuInit itself) and one
 * made from NVML and CUDA_VISIBLE_DEVICES, for a process that has only
 * used NVML so far: initialising CUDA for it would change it (CUDA cannot
 * be used in a child forked after cuInit, and a parent that picks a GPU
 * with NVML before forking its CUDA workers is common). */
struct visible {
    pthread_once_t once;
    int count;
    unsigned char uuid[GV_MAX_ORDINALS][16];
};
static struct visible by_cuda = { PTHREAD_ONCE_INIT, 0, { { 0 } } };
static struct visible by_nvml = { PTHREAD_ONCE_INIT, 0, { { 0 } } };
static atomic_int cuda_inited;

void gv_cuda_inited(void) { atomic_store(&cuda_inited, 1); }

/* One CUDA_VISIBLE_DEVICES entry: the NVML index it names (its UUID parsed
 * into *uuid; *is_index set when it was written as an index), or -1 when
 * the driver would take it as invalid. */
static int visible_entry(char *tok, char uuids[][NVML_DEVICE_UUID_V2_BUFFER_SIZE],
                         unsigned int n, unsigned char uuid[16], int *is_index)
{
    while (isspace((unsigned char)*tok))
        tok++;
    size_t len = strlen(tok);
    while (len > 0 && isspace((unsigned char)tok[len - 1]))
        len--;
    tok[len] = '\0';
    if (len == 0)
        return -1;
    int found = -1;
    /* A real driver reads an index like strtoul: a '+' may come first, and
     * whatever follows the digits is ignored ("0a", "0x0" and "0 1" name
     * device 0; seen on an H100, driver 580.159). */
    size_t first = tok[0] == '+' ? 1 : 0;
    *is_index = isdigit((unsigned char)tok[first]) != 0;
    if (*is_index) {
        unsigned long v = 0;
        for (size_t i = first; i < len && isdigit((unsigned char)tok[i]); i++) {
            if (v > 100000)
                return -1;
            v = v * 10 + (unsigned long)(tok[i] - '0');
        }
        found = v < n ? (int)v : -1;
    } else if (len > 4) {
        /* A UUID may be cut short after "GPU-" (not to nothing), and what
         * runs past the whole UUID is ignored (same driver). */
        for (unsigned int i = 0; i < n; i++) {
            size_t ulen = strlen(uuids[i]);
            if (ulen == 0 || strncasecmp(uuids[i], tok, len < ulen ? len : ulen) != 0)
                continue;
            if (found >= 0)
                return -1;              /* ambiguous prefix */
            found = (int)i;
        }
    }
    return found >= 0 && gv_uuid_parse(uuids[found], uuid) == 0 ? found : -1;
}

/* NVML's list of devices, through CUDA_VISIBLE_DEVICES (cvd; NULL: unset),
 * NVML already initialised. */
static void nvml_list(struct visible *out, const char *cvd)
{
    unsigned char (*visible)[16] = out->uuid;
    out->count = 0;
    typedef nvmlReturn_t (*count_fn)(unsigned int *);
    typedef nvmlReturn_t (*handle_fn)(unsigned int, nvmlDevice_t *);
    typedef nvmlReturn_t (*uuid_fn)(nvmlDevice_t, char *, unsigned int);
    unsigned int n = 0;
    if (GV_REAL(nvmlDeviceGetCount_v2, count_fn)(&n) != NVML_SUCCESS)
        return;
    char uuids[GV_MAX_ORDINALS][NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    if (n > GV_MAX_ORDINALS)
        n = GV_MAX_ORDINALS;
    for (unsigned int i = 0; i < n; i++) {
        nvmlDevice_t h;
        uuids[i][0] = '\0';
        if (GV_REAL(nvmlDeviceGetHandleByIndex_v2, handle_fn)(i, &h) == NVML_SUCCESS)
            GV_REAL(nvmlDeviceGetUUID, uuid_fn)(h, uuids[i], sizeof uuids[i]);
    }
    int count = 0;
    if (!cvd) {
        for (unsigned int i = 0; i < n; i++)
            if (gv_uuid_parse(uuids[i], visible[count]) == 0)
                count++;
        out->count = count;
        return;
    }
    /* Read as the driver reads it (the simulator does the same): entries
     * between commas, blanks before them ignored; an index is decimal
     * digits, what follows them ignored; a UUID may be a prefix in any
     * case, if only one device has it.  The list ends at the first
     * invalid, ambiguous or repeated entry (an empty one too), except that
     * an index given twice leaves no device at all ("0,0"; but
     * "GPU-<0's UUID>,0" is device 0). */
    char buf[1024];
    int index_form[GV_MAX_ORDINALS];
    snprintf(buf, sizeof buf, "%s", cvd);
    for (char *tok = buf; tok != NULL && count < GV_MAX_ORDINALS;) {
        char *comma = strchr(tok, ',');
        if (comma != NULL)
            *comma = '\0';
        int found = visible_entry(tok, uuids, n, visible[count], &index_form[count]);
        for (int i = 0; found >= 0 && i < count; i++) {
            if (memcmp(visible[i], visible[count], 16) != 0)
                continue;
            if (index_form[i] && index_form[count])
                count = 0;
            found = -1;
            break;
        }
        if (found < 0)
            break;
        count++;
        tok = comma != NULL ? comma + 1 : NULL;
    }
    out->count = count;
}

/* Without a usable CUDA driver, follow CUDA_VISIBLE_DEVICES (cvd; NULL:
 * unset) over NVML's list (NVML order is PCI order, which CUDA also uses
 * unless told otherwise).  out->count stays 0 when NVML cannot list them. */
static void nvml_visible(struct visible *out, const char *cvd, int release)
{
    out->count = 0;
    if (GV_REAL(nvmlInit_v2, nvmlReturn_t (*)(void))() != NVML_SUCCESS)
        return;
    nvml_list(out, cvd);
    /* NVML counts its initialisations: a one-off reading gives its own
     * back, so that the caller's nvmlShutdown still shuts NVML down. */
    if (release)
        GV_REAL(nvmlShutdown, nvmlReturn_t (*)(void))();
}

static void visible_from_nvml(void)
{
    nvml_visible(&by_nvml, getenv("CUDA_VISIBLE_DEVICES"), 0);
}

/* CUDA's map: the process has initialised CUDA (or CUDA is how the
 * container's devices are known); NVML's when the driver cannot be used. */
static void visible_from_cuda(void)
{
    int n = 0;
    if (GV_REAL(cuInit, CUresult (*)(unsigned int))(0) == CUDA_SUCCESS &&
        GV_REAL(cuDeviceGetCount, CUresult (*)(int *))(&n) == CUDA_SUCCESS) {
        if (n > GV_MAX_ORDINALS)
            n = GV_MAX_ORDINALS;
        for (int i = 0; i < n; i++)
            if (device_uuid(i, by_cuda.uuid[i]) != CUDA_SUCCESS)
                n = i;
        by_cuda.count = n;
        return;
    }
    pthread_once(&by_nvml.once, visible_from_nvml);
    by_cuda.count = by_nvml.count;
    memcpy(by_cuda.uuid, by_nvml.uuid, sizeof by_cuda.uuid);
}

int gv_ordinal_of_uuid(const unsigned char uuid[16])
{
    struct visible *v = &by_nvml;
    if (atomic_load(&cuda_inited)) {
        pthread_once(&by_cuda.once, visible_from_cuda);
        v = &by_cuda;
    } else {
        pthread_once(&by_nvml.once, visible_from_nvml);
    }
    for (int i = 0; i < v->count; i++)
        if (memcmp(v->uuid[i], uuid, 16) == 0)
            return i;
    return -1;
}

int gv_ordinal_of_uuid_nvml(const unsigned char uuid[16], const char *cvd)
{
    struct visible v;
    nvml_visible(&v, cvd, 1);
    for (int i = 0; i < v.count; i++)
        if (memcmp(v.uuid[i], uuid, 16) == 0)
            return i;
    return -1;
}
