/*
 * log.h - gpuvisor's one-line logger, and the export macro.
 *
 * gv_log(level, fmt, ...) writes one line to stderr, prefixed
 * "gpuvisor[<pid>]: ", with a single write(2) (no stdio locks, so it is
 * safe around fork).  A message that already starts with "gpuvisor: " has
 * that prefix dropped, so pre-formatted error lines are not prefixed twice.
 *
 * The threshold comes from LIBCUDA_LOG_LEVEL (0 error .. 4 debug, default
 * 1 warning), read once per process.  A malformed value is reported in one
 * line and the default is used.
 */
#ifndef GV_LOG_H
#define GV_LOG_H

#ifndef GV_EXPORT
#define GV_EXPORT __attribute__((visibility("default")))
#endif

enum {
    GV_LOG_ERROR = 0,
    GV_LOG_WARN = 1,
    GV_LOG_INFO = 2,
    GV_LOG_VERBOSE = 3,
    GV_LOG_DEBUG = 4
};

#define GV_LOG_DEFAULT GV_LOG_WARN
#define GV_LOG_LINE_MAX 512

/* The current threshold (parses LIBCUDA_LOG_LEVEL on first use). */
int gv_log_level(void);
/* 1 if messages of this level are printed. */
int gv_log_enabled(int level);

void gv_log(int level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif /* GV_LOG_H */
