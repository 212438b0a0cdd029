/*
 * cuda_module.c - modules, libraries and function handles.  Any image is
 * accepted; a function is a name.  What a kernel does is decided by its
 * name at launch (cuda_launch.c): "spin" runs for its first parameter in
 * microseconds, anything else 1 us per block.  A library is a module
 * without a context (cuLibraryLoadData) and its kernels are function
 * handles, which may be launched directly as on a GPU.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim.h"

static CUresult mod_new(CUmodule *out, int library)
{
    struct CUctx_st *c = NULL;
    SIM_TRY(library ? sim_check_init() : sim_current(&c));
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = SIM_MOD_MAGIC;
    m->library = library;
    m->ctx = c;
    /* A module loaded into a context takes device memory (GPUVISOR_SIM_MODULE_MIB),
     * charged with the context's own: given back at unload, or with the
     * context. */
    uint64_t sz = c ? sim_module_bytes() : 0;
    pthread_mutex_lock(&sim_mu);
    if (sz && sim_charge(c->node, sz) < 0) {
        pthread_mutex_unlock(&sim_mu);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (sz) {
        m->charged = sz;
        m->epoch = c->epoch;
        c->charged += sz;
    }
    sim_reg_add(m);
    pthread_mutex_unlock(&sim_mu);
    *out = m;
    return CUDA_SUCCESS;
}

static int mod_ok_locked(struct CUmod_st *m, int library)
{
    return m && sim_reg_has(m) && m->magic == SIM_MOD_MAGIC &&
           (library < 0 || m->library == library);
}

SIM_API CUresult cuModuleLoadData(CUmodule *mod, const void *image)
{
    if (!mod || !image) {
        CUresult rc = sim_check_init();
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    }
    return mod_new(mod, 0);
}

SIM_API CUresult cuModuleLoadDataEx(CUmodule *mod, const void *image,
                                    unsigned int n, void *opts, void **vals)
{
    (void)opts;
    (void)vals;
    (void)n;
    return cuModuleLoadData(mod, image);
}

SIM_ALIAS(cuModuleLoadFatBinary, cuModuleLoadData);

SIM_API CUresult cuModuleLoad(CUmodule *mod, const char *fname)
{
    SIM_TRY(sim_check_args(!mod || !fname));
    if (access(fname, R_OK) < 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    return mod_new(mod, 0);
}

static CUresult mod_unload(struct CUmod_st *m, int library)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    if (!mod_ok_locked(m, library)) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    sim_reg_del(m);
    m->magic = 0;
    struct CUctx_st *c = m->ctx;
    if (m->charged && c && sim_reg_has(c) && c->magic == SIM_CTX_MAGIC && c->alive &&
        c->epoch == m->epoch && c->charged >= m->charged) {
        sim_uncharge(c->node, m->charged);
        c->charged -= m->charged;
    }
    struct CUfunc_st *f = m->funcs;
    while (f) {
        struct CUfunc_st *n = f->next;
        sim_reg_del(f);
        f->magic = 0;
        free(f);
        f = n;
    }
    pthread_mutex_unlock(&sim_mu);
    free(m);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuModuleUnload(CUmodule mod)
{
    return mod_unload(mod, 0);
}

static CUresult get_func(struct CUfunc_st **out, struct CUmod_st *m,
                         const char *name, int library)
{
    SIM_TRY(sim_check_args(!out || !name));
    if (strlen(name) >= SIM_FUNC_NAME)
        return CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&sim_mu);
    if (!mod_ok_locked(m, library)) {
        pthread_mutex_unlock(&sim_mu);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct CUfunc_st *f;
    for (f = m->funcs; f; f = f->next)
        if (!strcmp(f->name, name))
            break;
    if (!f) {
        f = calloc(1, sizeof *f);
        if (!f) {
            pthread_mutex_unlock(&sim_mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        f->magic = SIM_FUNC_MAGIC;
        f->mod = m;
        f->spin = !strcmp(name, "spin");
        strcpy(f->name, name);
        f->next = m->funcs;
        m->funcs = f;
        sim_reg_add(f);
    }
    pthread_mutex_unlock(&sim_mu);
    *out = f;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuModuleGetFunction(CUfunction *f, CUmodule mod,
                                     const char *name)
{
    return get_func(f, mod, name, -1);   /* a library's module too */
}

static CUresult func_ok(CUfunction f)
{
    SIM_TRY(sim_check_init());
    pthread_mutex_lock(&sim_mu);
    int ok = f && sim_reg_has(f) && f->magic == SIM_FUNC_MAGIC;
    pthread_mutex_unlock(&sim_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

SIM_API CUresult cuFuncGetName(const char **name, CUfunction f)
{
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_TRY(func_ok(f));
    *name = f->name;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuFuncGetModule(CUmodule *mod, CUfunction f)
{
    if (!mod)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_TRY(func_ok(f));
    *mod = f->mod;
    return CUDA_SUCCESS;
}

/* ---- libraries (context independent) -------------------------------- */

SIM_API CUresult cuLibraryLoadData(CUlibrary *lib, const void *code,
                                   void *jitOpts, void **jitVals,
                                   unsigned int nJit, void *libOpts,
                                   void **libVals, unsigned int nLib)
{
    (void)jitOpts;
    (void)jitVals;
    (void)nJit;
    (void)libOpts;
    (void)libVals;
    (void)nLib;
    CUresult rc = sim_check_args(!lib || !code);
    if (rc)
        return rc;
    CUmodule m;
    rc = mod_new(&m, 1);
    if (rc)
        return rc;
    *lib = (CUlibrary)m;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuLibraryUnload(CUlibrary lib)
{
    return mod_unload((struct CUmod_st *)lib, 1);
}

SIM_API CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary lib,
                                    const char *name)
{
    struct CUfunc_st *f = NULL;
    SIM_TRY(get_func(&f, (struct CUmod_st *)lib, name, 1));
    *k = (CUkernel)f;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuLibraryGetModule(CUmodule *mod, CUlibrary lib)
{
    SIM_TRY(sim_check_args(!mod));
    pthread_mutex_lock(&sim_mu);
    int ok = mod_ok_locked((struct CUmod_st *)lib, 1);
    pthread_mutex_unlock(&sim_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_HANDLE;
    *mod = (CUmodule)lib;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuKernelGetFunction(CUfunction *f, CUkernel k)
{
    if (!f)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_TRY(func_ok((CUfunction)k));
    *f = (CUfunction)k;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuKernelGetName(const char **name, CUkernel k)
{
    return cuFuncGetName(name, (CUfunction)k);
}
