/* log.c - see log.h. */
#include "log.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int g_level = GV_LOG_DEFAULT;
static pthread_once_t g_level_once = PTHREAD_ONCE_INIT;

static void write_line(const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t w = write(STDERR_FILENO, buf, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return;
        buf += w;
        len -= (size_t)w;
    }
}

static void parse_level(void)
{
    const char *v = getenv("LIBCUDA_LOG_LEVEL");
    if (v == NULL || v[0] == '\0')
        return;
    if (v[0] >= '0' && v[0] <= '4' && v[1] == '\0') {
        g_level = v[0] - '0';
        return;
    }
    /* Report with the default level in force; print directly because
     * gv_log would recurse into pthread_once. */
    char buf[GV_LOG_LINE_MAX];
    int n = snprintf(buf, sizeof buf,
                     "gpuvisor[%d]: LIBCUDA_LOG_LEVEL=\"%.64s\": not a log level "
                     "(use 0 error, 1 warning, 2 info, 3 verbose, 4 debug); using %d\n",
                     (int)getpid(), v, GV_LOG_DEFAULT);
    if (n > 0)
        write_line(buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

int gv_log_level(void)
{
    pthread_once(&g_level_once, parse_level);
    return g_level;
}

int gv_log_enabled(int level)
{
    return level <= gv_log_level();
}

void gv_log(int level, const char *fmt, ...)
{
    if (!gv_log_enabled(level))
        return;
    char msg[GV_LOG_LINE_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    const char *body = msg;
    if (strncmp(body, "gpuvisor: ", 10) == 0)
        body += 10;
    char line[GV_LOG_LINE_MAX + 32];
    int len = snprintf(line, sizeof line, "gpuvisor[%d]: %s", (int)getpid(), body);
    if (len < 0)
        return;
    size_t l = (size_t)len < sizeof line - 1 ? (size_t)len : sizeof line - 2;
    /* One line: cut at the first newline and terminate with exactly one. */
    char *nl = memchr(line, '\n', l);
    if (nl != NULL)
        l = (size_t)(nl - line);
    line[l++] = '\n';
    write_line(line, l);
}
