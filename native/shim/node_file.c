/*
 * node_file.c - what the per-GPU node-wide files share: the launch order
 * (sm_arbiter.c, gpuvisor-sm-<uuid>) and the guarantees of oversubscribed
 * containers (oversub.c, gpuvisor-mem-<uuid>), both in the node directory
 * (node_lock.c) and mapped by every container of the node.  Here: this
 * container's identity on the node, and the opening and mapping of such a
 * file with its magic checked.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "file_space.h"
#include "hooks.h"
#include "log.h"

uint64_t gv_node_mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdULL;
}

static _Atomic uint64_t container_id;

uint64_t gv_node_container(void)
{
    uint64_t id = atomic_load(&container_id);
    if (id)
        return id;
    struct stat st;
    const char *path = region_path(gv_core_region());
    if (!path || stat(path, &st) != 0)
        return 0;
    id = gv_node_mix(gv_node_mix(0x6776, (uint64_t)st.st_dev), (uint64_t)st.st_ino) | 1;
    atomic_store(&container_id, id);
    return id;
}

void *gv_node_file_map(gv_node_file *nf, const char *uuid, uint64_t magic, size_t size,
                       int *fdp)
{
    char dir[4096], path[4096 + 128];
    if (!gv_node_dir(dir, sizeof dir))
        return NULL;
    snprintf(path, sizeof path, "%s/gpuvisor-%s-%s", dir, nf->kind, uuid);
    /* Never through a symbolic link: the directory is shared by every
     * container of the node, and a link one of them made could point
     * another's library at a file of that container's own. */
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd < 0) {
        /* Once per process and kind of file, whatever the GPU: a read-only
         * mount of the directory, or one made unwritable for this uid,
         * costs every GPU alike. */
        int e = errno;
        if (!atomic_exchange(&nf->told, 1))
            gv_log(GV_LOG_WARN, "node-wide file %s: cannot open for writing (%s): %s; mount "
                   "%s read-write", path, strerror(e), nf->lost, dir);
        return NULL;
    }
    (void)fchmod(fd, 0666);             /* past the umask, for other users */
    /* Blocks allocated before the mapping is touched: a sparse file on a
     * full filesystem would fault (SIGBUS) at the first store.  Other
     * containers may have it mapped already: not fresh. */
    _Atomic uint64_t *f = NULL;
    if (gv_file_reserve(fd, size, 0) == 0) {
        void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m != MAP_FAILED)
            f = m;
    }
    uint64_t found = 0;
    if (f && !atomic_compare_exchange_strong(f, &found, magic) && found != magic) {
        gv_log(GV_LOG_WARN, "%s: not a %s file of this version (magic %#llx); %s", path,
               nf->what, (unsigned long long)found, nf->lost);
        munmap(f, size);
        f = NULL;
    }
    if (f && fdp)
        *fdp = fd;
    else
        close(fd);
    return f;
}
