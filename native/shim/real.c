/* real.c - opening the real driver libraries and resolving entry points. */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "real.h"
#include "log.h"

#define GV_NAME_ITEM(name) #name,
static const char *const sym_names[GV_SYM_COUNT] = {
    GV_CUDA_SYMS(GV_NAME_ITEM)
    "",
    GV_NVML_SYMS(GV_NAME_ITEM)
};
#undef GV_NAME_ITEM

_Atomic(void *) gv_sym_cache[GV_SYM_COUNT];
static atomic_uint sym_missing[GV_SYM_COUNT];   /* 1 once a lookup failed */
static _Atomic(void *) cuda_handle;
static _Atomic(void *) nvml_handle;
static atomic_int cuda_tried, nvml_tried;

static _Atomic(gv_dlsym_fn) libc_dlsym;

GV_NO_SANITIZE gv_dlsym_fn gv_libc_dlsym(void)
{
    gv_dlsym_fn fn = atomic_load_explicit(&libc_dlsym, memory_order_acquire);
    if (!fn) {
        /* dlvsym is not overridden, so it reaches the C library's own
         * dlsym: libdl merged into libc at 2.34, older glibc has 2.2.5. */
        fn = (gv_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!fn)
            fn = (gv_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
        atomic_store_explicit(&libc_dlsym, fn, memory_order_release);
    }
    return fn;
}

GV_NO_SANITIZE void *gv_real_dlsym(void *handle, const char *name)
{
    gv_dlsym_fn fn = gv_libc_dlsym();
    return fn ? fn(handle, name) : NULL;
}

static void *open_lib(_Atomic(void *) *slot, atomic_int *tried,
                      const char *env, const char *soname)
{
    void *h = atomic_load_explicit(slot, memory_order_acquire);
    if (h || atomic_load_explicit(tried, memory_order_acquire))
        return h;
    const char *path = getenv(env);
    if (!path || !*path)
        path = soname;
    h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!h)
        gv_log(GV_LOG_INFO, "cannot open %s: %s", path, dlerror());
    void *expected = NULL;
    if (h && !atomic_compare_exchange_strong(slot, &expected, h))
        dlclose(h);     /* another thread won; keep its handle */
    atomic_store_explicit(tried, 1, memory_order_release);
    return atomic_load_explicit(slot, memory_order_acquire);
}

void *gv_real_cuda_handle(void)
{
    return open_lib(&cuda_handle, &cuda_tried, "GPUVISOR_REAL_LIBCUDA", "libcuda.so.1");
}

void *gv_real_nvml_handle(void)
{
    return open_lib(&nvml_handle, &nvml_tried, "GPUVISOR_REAL_LIBNVML", "libnvidia-ml.so.1");
}

void *gv_real_sym(enum gv_sym id)
{
    if ((int)id < 0 || id >= GV_SYM_COUNT || id == GV_SYM_CUDA_END)
        return NULL;
    void *fn = atomic_load_explicit(&gv_sym_cache[id], memory_order_acquire);
    if (fn || atomic_load_explicit(&sym_missing[id], memory_order_relaxed))
        return fn;
    void *h = id < GV_SYM_CUDA_END ? gv_real_cuda_handle() : gv_real_nvml_handle();
    fn = h ? gv_real_dlsym(h, sym_names[id]) : NULL;
    if (fn)
        atomic_store_explicit(&gv_sym_cache[id], fn, memory_order_release);
    else if (h)
        atomic_store_explicit(&sym_missing[id], 1, memory_order_relaxed);
    return fn;
}

void gv_real_learn(enum gv_sym id, void *fn)
{
    if ((int)id < 0 || id >= GV_SYM_COUNT || !fn)
        return;
    void *expected = NULL;
    atomic_compare_exchange_strong(&gv_sym_cache[id], &expected, fn);
}

const char *gv_real_name(enum gv_sym id)
{
    return ((int)id >= 0 && id < GV_SYM_COUNT) ? sym_names[id] : "";
}

int gv_real_find(const char *name)
{
    for (int i = 0; i < GV_SYM_COUNT; i++)
        if (i != GV_SYM_CUDA_END && strcmp(sym_names[i], name) == 0)
            return i;
    return -1;
}

/* Stand-ins for entry points the real library lacks.  Called through a
 * pointer of the caller's type; they ignore the arguments (the x86-64 and
 * AArch64 calling conventions make that safe) and report "not found". */
static int missing_cuda(void) { return CUDA_ERROR_NOT_FOUND; }
static int missing_nvml(void) { return NVML_ERROR_FUNCTION_NOT_FOUND; }

void *gv_real_or_missing(enum gv_sym id)
{
    void *fn = gv_real_sym(id);
    if (fn)
        return fn;
    return id < GV_SYM_CUDA_END ? (void *)missing_cuda : (void *)missing_nvml;
}
