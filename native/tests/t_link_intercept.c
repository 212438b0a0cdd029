/*
 * t_link_intercept.c - the three ways a program reaches the hooks.
 *
 * Linked with -lcuda -lnvidia-ml and run with LD_PRELOAD=libgpuvisor.so,
 * CUDA_DEVICE_MEMORY_LIMIT=1g on a simulated 16 GiB device.
 *   1. exported symbols (this program's own calls)
 *   2. dlsym on a dlopen'ed driver handle
 *   3. cuGetProcAddress(_v2), honouring ABI version and flags
 * Prints OK and exits 0, or lists failures and exits 1.
 */
#include <dlfcn.h>
#include <string.h>

#include "cuda_protos.h"

#define GIB (1ULL << 30)
#define MIB (1ULL << 20)

static void *gv;      /* the preloaded interposer */
static void *drv;     /* the driver, as a client would dlopen it */

static void *ours(const char *name) { return dlsym(gv, name); }
/* Whether fn is defined in the library whose file name contains lib. */
static int lives_in(void *fn, const char *lib)
{
    Dl_info info;
    return fn && dladdr(fn, &info) && info.dli_fname && strstr(info.dli_fname, lib);
}

static size_t used_now(void)
{
    size_t f = 0, t = 0;
    cuMemGetInfo_v2(&f, &t);
    return t - f;
}

static void exported_symbols(void)
{
    size_t f = 0, t = 0, total = 0;
    CHECK_CU(cuMemGetInfo_v2(&f, &t));
    CHECK(t == GIB, "cuMemGetInfo total %zu, want the 1 GiB quota", t);
    CHECK(f <= t, "free %zu > total %zu", f, t);
    CHECK_CU(cuDeviceTotalMem_v2(&total, 0));
    CHECK(total == GIB, "cuDeviceTotalMem %zu", total);
    CUdeviceptr p = 0, q = 0;
    CHECK(cuMemAlloc_v2(&p, 2 * GIB) == CUDA_ERROR_OUT_OF_MEMORY, "2 GiB must not fit a 1 GiB quota");
    size_t before = used_now();
    CHECK_CU(cuMemAlloc_v2(&p, 100 * MIB));
    CHECK(used_now() - before == 100 * MIB, "100 MiB counted as %zu", used_now() - before);
    CHECK(cuMemAlloc_v2(&q, GIB - 50 * MIB) == CUDA_ERROR_OUT_OF_MEMORY, "quota overrun allowed");
    CHECK_CU(cuMemFree_v2(p));
    CHECK(used_now() == before, "usage not returned after free");
}

static void dlsym_path(void)
{
    void *hook = ours("cuMemAlloc_v2");
    void *seen = dlsym(drv, "cuMemAlloc_v2");
    CHECK(hook && seen == hook, "dlsym(libcuda, cuMemAlloc_v2) = %p, hook %p", seen, hook);
    CHECK(dlsym(drv, "cuLaunchKernel") == ours("cuLaunchKernel"), "dlsym(cuLaunchKernel) not hooked");
    CHECK(dlsym(drv, "cuGraphLaunch_ptsz") == ours("cuGraphLaunch_ptsz"), "dlsym(cuGraphLaunch_ptsz) not hooked");
    CHECK(dlsym(drv, "cuStreamQuery_ptsz") == ours("cuStreamQuery_ptsz"), "dlsym(cuStreamQuery_ptsz) not hooked");
    CHECK(lives_in(dlsym(drv, "cuEventQuery"), "libgpuvisor"), "dlsym(cuEventQuery) not hooked");
    CHECK(lives_in(seen, "libgpuvisor"), "dlsym answer is not the interposer's");
    void *nv = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    CHECK(nv != NULL, "dlopen libnvidia-ml: %s", dlerror());
    if (nv) {
        CHECK(dlsym(nv, "nvmlDeviceGetMemoryInfo") == ours("nvmlDeviceGetMemoryInfo"), "NVML dlsym not hooked");
        CHECK(dlsym(nv, "nvmlDeviceGetMemoryInfo_v2") == ours("nvmlDeviceGetMemoryInfo_v2"), "NVML v2 dlsym not hooked");
        CHECK(dlsym(nv, "nvmlDeviceGetName") != NULL, "unhooked NVML names still resolve");
    }
    /* A name we do not hook comes back untouched. */
    void *plain = dlsym(drv, "cuDeviceGetName");
    CHECK(lives_in(plain, "libcuda"), "unhooked name altered");
    /* Calling through the dlsym'd pointer is enforced. */
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult (*)(CUdeviceptr *, size_t))seen;
    CUdeviceptr p;
    CHECK(alloc(&p, 2 * GIB) == CUDA_ERROR_OUT_OF_MEMORY, "dlsym'd alloc not enforced");
    /* RTLD_NEXT from this program means the objects after it, not after
     * the interposer.  The program defines no malloc, so the next one is the
     * first in the global scope (the C library's, or a sanitizer's). */
    CHECK(dlsym(RTLD_NEXT, "malloc") == dlsym(RTLD_DEFAULT, "malloc"), "RTLD_NEXT resolved wrongly");
    /* The preloaded interposer comes right after the program, as with the
     * C library's own RTLD_NEXT. */
    CHECK(lives_in(dlsym(RTLD_NEXT, "cuMemAlloc_v2"), "libgpuvisor"), "RTLD_NEXT order wrong");
}

static void *gpa(const char *name, int version, cuuint64_t flags, CUresult *rc_out,
                 CUdriverProcAddressQueryResult *st)
{
    void *fn = NULL;
    CUresult rc = cuGetProcAddress_v2(name, &fn, version, flags, st);
    if (rc_out)
        *rc_out = rc;
    return rc == CUDA_SUCCESS ? fn : NULL;
}

static void procaddr_path(void)
{
    CUdriverProcAddressQueryResult st;
    CUresult rc;
    struct { const char *base; int version; cuuint64_t flags; const char *want; } cases[] = {
        { "cuMemAlloc", 12000, 0, "cuMemAlloc_v2" },
        { "cuMemAlloc", 3020, 0, "cuMemAlloc_v2" },
        { "cuMemAlloc", 2000, 0, "cuMemAlloc" },
        { "cuMemFree", 3020, 0, "cuMemFree_v2" },
        { "cuMemFree", 3000, 0, "cuMemFree" },
        { "cuMemGetInfo", 12000, 0, "cuMemGetInfo_v2" },
        { "cuMemGetInfo", 2000, 0, "cuMemGetInfo" },
        { "cuDeviceTotalMem", 3020, 0, "cuDeviceTotalMem_v2" },
        { "cuCtxCreate", 3020, 0, "cuCtxCreate_v2" },
        { "cuCtxCreate", 11040, 0, "cuCtxCreate_v3" },
        { "cuCtxCreate", 12050, 0, "cuCtxCreate_v4" },
        { "cuCtxDestroy", 4000, 0, "cuCtxDestroy_v2" },
        { "cuDevicePrimaryCtxRelease", 11000, 0, "cuDevicePrimaryCtxRelease_v2" },
        { "cuDevicePrimaryCtxRelease", 10000, 0, "cuDevicePrimaryCtxRelease" },
        { "cuMemAllocAsync", 11020, 0, "cuMemAllocAsync" },
        { "cuMemAllocAsync", 11020, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuMemAllocAsync_ptsz" },
        { "cuMemFreeAsync", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuMemFreeAsync_ptsz" },
        { "cuMemCreate", 10020, 0, "cuMemCreate" },
        { "cuArrayCreate", 3020, 0, "cuArrayCreate_v2" },
        { "cuArrayCreate", 2000, 0, "cuArrayCreate" },
        { "cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2" },
        { "cuGetProcAddress", 11030, 0, "cuGetProcAddress" },
        { "cuInit", 2000, 0, "cuInit" },
        { "cuLaunchKernel", 4000, 0, "cuLaunchKernel" },
        { "cuLaunchKernel", 7000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuLaunchKernel_ptsz" },
        { "cuLaunchKernelEx", 11060, 0, "cuLaunchKernelEx" },
        { "cuLaunchKernelEx", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuLaunchKernelEx_ptsz" },
        { "cuLaunchCooperativeKernel", 9000, 0, "cuLaunchCooperativeKernel" },
        { "cuGraphLaunch", 10000, 0, "cuGraphLaunch" },
        { "cuGraphLaunch", 10000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuGraphLaunch_ptsz" },
        { "cuStreamQuery", 2000, 0, "cuStreamQuery" },
        { "cuStreamQuery", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuStreamQuery_ptsz" },
        { "cuEventQuery", 12000, 0, "cuEventQuery" },
        { "cuEventQuery", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuEventQuery" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        void *fn = gpa(cases[i].base, cases[i].version, cases[i].flags, &rc, &st);
        void *want = ours(cases[i].want);
        CHECK(rc == CUDA_SUCCESS && fn == want && want != NULL,
              "cuGetProcAddress_v2(%s, %d, %llu) = %p (rc %d), want hook %s = %p", cases[i].base,
              cases[i].version, (unsigned long long)cases[i].flags, fn, rc, cases[i].want, want);
    }
    /* An older ABI never receives a newer-ABI entry point. */
    CHECK(gpa("cuMemAlloc", 2000, 0, NULL, NULL) != gpa("cuMemAlloc", 3020, 0, NULL, NULL), "v1 == v2");
    /* Too old for the entry point: the driver's refusal stands. */
    void *fn = gpa("cuMemCreate", 10000, 0, &rc, &st);
    CHECK(fn == NULL && rc == CUDA_ERROR_NOT_FOUND && st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
          "cuMemCreate@10000: rc %d st %d", rc, st);
    fn = gpa("cuNoSuchThing", 12000, 0, &rc, &st);
    CHECK(fn == NULL && rc == CUDA_ERROR_NOT_FOUND && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
          "unknown symbol: rc %d st %d", rc, st);
    /* Unhooked entry points are the driver's. */
    fn = gpa("cuDeviceGetName", 2000, 0, &rc, &st);
    CHECK(lives_in(fn, "libcuda"), "unhooked entry point altered");
    /* The v1 query works too, and the v1 ABI allocates and is counted. */
    void *fn1 = NULL;
    CHECK_CU(cuGetProcAddress("cuMemAlloc", &fn1, 2000, 0));
    CHECK(fn1 == ours("cuMemAlloc"), "cuGetProcAddress v1 not hooked");
    CUresult (*alloc_v1)(CUdeviceptr_v1 *, unsigned int) = (CUresult (*)(CUdeviceptr_v1 *, unsigned int))fn1;
    CUresult (*free_v1)(CUdeviceptr_v1) = (CUresult (*)(CUdeviceptr_v1))gpa("cuMemFree", 2000, 0, NULL, NULL);
    size_t before = used_now();
    CUdeviceptr_v1 p1 = 0;
    CHECK_CU(alloc_v1(&p1, 3 * MIB));
    CHECK(used_now() - before == 4 * MIB, "v1 alloc of 3 MiB charged %zu (want 4 MiB granularity)", used_now() - before);
    CHECK(free_v1 && free_v1(p1) == CUDA_SUCCESS, "v1 free");
    CHECK(used_now() == before, "v1 free not uncharged");
    /* The hook returned for cuGetProcAddress is itself substituting. */
    CUresult (*gpa2)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
        (CUresult (*)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *))
            gpa("cuGetProcAddress", 12000, 0, NULL, NULL);
    void *fn2 = NULL;
    CHECK(gpa2 && gpa2("cuMemAlloc", &fn2, 12000, 0, NULL) == CUDA_SUCCESS && fn2 == ours("cuMemAlloc_v2"),
          "GPA obtained through GPA does not substitute");
}

int main(void)
{
    gv = dlopen("libgpuvisor.so", RTLD_NOW | RTLD_NOLOAD);
    drv = dlopen("libcuda.so.1", RTLD_NOW);
    if (!gv || !drv) {
        fprintf(stderr, "FAIL: needs LD_PRELOAD=libgpuvisor.so and the driver (%s)\n", dlerror());
        return 1;
    }
    CUdevice dev;
    CUcontext ctx;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDeviceGet(&dev, 0));
    CHECK_CU(cuCtxCreate_v2(&ctx, 0, dev));
    exported_symbols();
    dlsym_path();
    procaddr_path();
    CHECK_CU(cuCtxDestroy_v2(ctx));
    if (gv_test_failures) {
        fprintf(stderr, "%d failure(s)\n", gv_test_failures);
        return 1;
    }
    puts("OK");
    return 0;
}
