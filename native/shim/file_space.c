/*
 * file_space.c - blocks for a file that is used through a shared mapping.
 *
 * A store through a MAP_SHARED mapping into a page whose blocks the
 * filesystem cannot allocate (a sparse file on a full tmpfs or disk) is a
 * SIGBUS, with no error code and no message, in whichever process touches
 * the page first.  So the region file (region_file.c) and the node-wide
 * launch-order files (sm_arbiter.c) have all their blocks allocated before
 * anything maps them, and a full filesystem is an error there and then.
 */
#include <errno.h>
#include <fcntl.h>

#include "file_space.h"

int gv_file_reserve(int fd, uint64_t size, int fresh)
{
    if (size > (uint64_t)INT64_MAX)
        return EFBIG;
    for (;;) {
        /* The filesystem allocates the blocks; no byte changes. */
        if (fallocate(fd, 0, 0, (off_t)size) == 0)
            return 0;
        if (errno != EINTR)
            break;
    }
    if (errno != EOPNOTSUPP && errno != ENOSYS)
        return errno;
    /* A filesystem without fallocate (NFS before 4.2): glibc writes a zero
     * byte into every block that reads zero.  Racy against a store into
     * the same byte through another process's mapping, so only for a file
     * nobody else has mapped yet; a shared one is left as it is. */
    if (!fresh)
        return 0;
    int rc;
    do
        rc = posix_fallocate(fd, 0, (off_t)size);
    while (rc == EINTR);
    return rc;
}
