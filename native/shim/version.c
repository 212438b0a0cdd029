/*
 * version.c - what this library is: its release (GV_VERSION, from
 * pyproject.toml, the one place the version is written) and its build id
 * (the GNU build-id note the linker puts in the file: a hash of its
 * contents, so two builds of different code never share one).
 */
#include "gpuvisor.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifndef GV_VERSION
#error "GV_VERSION must be defined (the Makefile takes it from pyproject.toml)"
#endif

#define GV_EXPORT __attribute__((visibility("default")))

static pthread_once_t g_build_once = PTHREAD_ONCE_INIT;
static char g_build_id[2 * 64 + 1] = "unknown";

struct find_ctx {
    uintptr_t base; /* this library's load address */
};

static int note_hex(const ElfW(Nhdr) *n, const char *desc)
{
    size_t len = n->n_descsz;
    if (len == 0 || 2 * len >= sizeof g_build_id)
        return 0;
    for (size_t i = 0; i < len; i++)
        snprintf(g_build_id + 2 * i, 3, "%02x", (unsigned char)desc[i]);
    return 1;
}

static int scan_object(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    const struct find_ctx *ctx = arg;
    if ((uintptr_t)info->dlpi_addr != ctx->base)
        return 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_NOTE)
            continue;
        const char *p = (const char *)(info->dlpi_addr + ph->p_vaddr);
        const char *end = p + ph->p_memsz;
        while (p + sizeof(ElfW(Nhdr)) <= end) {
            const ElfW(Nhdr) *n = (const ElfW(Nhdr) *)p;
            const char *name = p + sizeof *n;
            const char *desc = name + ((n->n_namesz + 3u) & ~3u);
            const char *next = desc + ((n->n_descsz + 3u) & ~3u);
            if (next > end)
                break;
            if (n->n_type == NT_GNU_BUILD_ID && n->n_namesz == 4 && memcmp(name, "GNU", 4) == 0)
                return note_hex(n, desc);
            p = next;
        }
    }
    return 1; /* our object, without a build id */
}

static void find_build_id(void)
{
    Dl_info self;
    if (!dladdr((void *)&find_build_id, &self) || self.dli_fbase == NULL)
        return;
    struct find_ctx ctx = {.base = 0};
    /* dlpi_addr is the load bias; for a shared object linked at 0 it is the
     * base dladdr reports. */
    ctx.base = (uintptr_t)self.dli_fbase;
    dl_iterate_phdr(scan_object, &ctx);
}

GV_EXPORT const char *gv_version(void)
{
    return GV_VERSION;
}

GV_EXPORT const char *gv_build_id(void)
{
    pthread_once(&g_build_once, find_build_id);
    return g_build_id;
}
