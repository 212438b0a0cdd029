/* file_space.h - blocks for a file used through a shared mapping (file_space.c). */
#ifndef GV_FILE_SPACE_H
#define GV_FILE_SPACE_H

#include <stdint.h>

/* Allocate the blocks of bytes [0, size) of fd (growing it to size if
 * shorter), so that no store through a shared mapping of them can fault for
 * want of space.  fresh: nobody else maps the file yet (a filesystem
 * without fallocate is then filled in by writing; a shared file is left
 * as it is there).  0, or an errno value (ENOSPC: the filesystem is full). */
int gv_file_reserve(int fd, uint64_t size, int fresh);

#endif /* GV_FILE_SPACE_H */
