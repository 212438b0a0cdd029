/* gv_glibc.h: the C library's symbol versions that gpuvisor's native
 * libraries bind to.  Included first in every native translation unit
 * (the Makefile's -include).
 *
 * libgpuvisor.so is preloaded into images we did not build, so it must load
 * with any glibc from 2.17 on.  glibc 2.32-2.34 moved the dl* and pthread_*
 * functions into libc.so.6 under new versions (GLIBC_2.34), and 2.33 made
 * stat() a real symbol (GLIBC_2.33): a plain build on a newer glibc would
 * refuse to load on an older one.  Every such function is still exported
 * under its first version, with the same behaviour, so references are bound
 * to that version here; stat, fstat and lstat go to the system call, which
 * every glibc's headers' struct stat matches on 64-bit Linux.
 * tests/test_packaging.py checks the highest GLIBC_ version each library
 * needs.
 *
 * Sanitizer builds (tests only) keep the default versions: their runtimes
 * intercept these functions by name. */
#ifndef GV_GLIBC_H
#define GV_GLIBC_H

#if defined(__GLIBC__) || defined(__linux__)
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)

#if defined(__x86_64__)
#define GV_GLIBC_BASE "GLIBC_2.2.5"
#define GV_GLIBC_ROBUST "GLIBC_2.12"
#elif defined(__aarch64__)
#define GV_GLIBC_BASE "GLIBC_2.17"
#define GV_GLIBC_ROBUST "GLIBC_2.17"
#endif

#ifdef GV_GLIBC_BASE
#define GV_SYMVER(sym, ver) __asm__(".symver " #sym "," #sym "@" ver)
GV_SYMVER(dladdr, GV_GLIBC_BASE);
GV_SYMVER(dlclose, GV_GLIBC_BASE);
GV_SYMVER(dlerror, GV_GLIBC_BASE);
GV_SYMVER(dlopen, GV_GLIBC_BASE);
/* libgpuvisor.so defines dlsym itself (it interposes it) and reaches the
 * C library's through dlvsym: its build leaves dlsym alone. */
#ifndef GV_DEFINES_DLSYM
GV_SYMVER(dlsym, GV_GLIBC_BASE);
#endif
GV_SYMVER(dlvsym, GV_GLIBC_BASE);
GV_SYMVER(pthread_create, GV_GLIBC_BASE);
GV_SYMVER(pthread_once, GV_GLIBC_BASE);
GV_SYMVER(pthread_sigmask, GV_GLIBC_BASE);
GV_SYMVER(pthread_mutex_trylock, GV_GLIBC_BASE);
GV_SYMVER(pthread_mutex_timedlock, GV_GLIBC_BASE);
GV_SYMVER(pthread_mutexattr_init, GV_GLIBC_BASE);
GV_SYMVER(pthread_mutexattr_destroy, GV_GLIBC_BASE);
GV_SYMVER(pthread_mutexattr_setpshared, GV_GLIBC_BASE);
GV_SYMVER(pthread_mutexattr_setrobust, GV_GLIBC_ROBUST);
GV_SYMVER(pthread_mutex_consistent, GV_GLIBC_ROBUST);
#undef GV_SYMVER

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline int gv_sys_fstatat(int dirfd, const char *path, struct stat *st, int flags) {
    return (int)syscall(SYS_newfstatat, dirfd, path, st, flags);
}
static inline int gv_sys_stat(const char *path, struct stat *st) {
    return gv_sys_fstatat(AT_FDCWD, path, st, 0);
}
static inline int gv_sys_lstat(const char *path, struct stat *st) {
    return gv_sys_fstatat(AT_FDCWD, path, st, AT_SYMLINK_NOFOLLOW);
}
static inline int gv_sys_fstat(int fd, struct stat *st) {
    return (int)syscall(SYS_fstat, fd, st);
}
/* Function-like: `struct stat` is not followed by '(' and stays as it is. */
#define stat(path, st) gv_sys_stat(path, st)
#define lstat(path, st) gv_sys_lstat(path, st)
#define fstat(fd, st) gv_sys_fstat(fd, st)
#define fstatat(dirfd, path, st, flags) gv_sys_fstatat(dirfd, path, st, flags)
#endif /* GV_GLIBC_BASE */

#endif /* not a sanitizer build */
#endif /* glibc */
#endif /* GV_GLIBC_H */
