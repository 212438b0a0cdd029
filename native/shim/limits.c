/* limits.c - see limits.h. */
#include "limits.h"

#include "gpuvisor.h"
#include "log.h"

#include <ctype.h>
#include <stdarg.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

typedef unsigned __int128 u128;

#define MAX_FRAC_UNIT 18
#define MAX_FRAC_PCT 6
#define WHY_SYNTAX "not a memory size (use bytes, a number with k/m/g/t, or a percentage like 50%)"

static uint64_t pow10u(int e)
{
    uint64_t p = 1;
    while (e-- > 0)
        p *= 10;
    return p;
}

int limits_parse(const char *text, uint64_t physical_total, uint64_t *bytes,
                 const char **why)
{
    const char *dummy;
    if (why == NULL)
        why = &dummy;
    *why = WHY_SYNTAX;
    if (text == NULL || bytes == NULL) {
        *why = "missing value";
        return GV_EINVAL;
    }
    const char *p = text;
    while (isspace((unsigned char)*p))
        p++;
    const char *end = p + strlen(p);
    while (end > p && isspace((unsigned char)end[-1]))
        end--;
    if (p == end)
        return GV_EINVAL;

    /* Integer part: at least one digit. */
    u128 ip = 0;
    int ndig = 0;
    while (p < end && isdigit((unsigned char)*p)) {
        ip = ip * 10 + (unsigned)(*p - '0');
        if (ip > UINT64_MAX) {
            *why = "too large (more than 2^64-1 bytes)";
            return GV_EINVAL;
        }
        p++;
        ndig++;
    }
    if (ndig == 0)
        return GV_EINVAL;

    /* Optional fraction: at least one digit after the point. */
    uint64_t frac = 0;
    int nfrac = 0, has_point = 0;
    if (p < end && *p == '.') {
        has_point = 1;
        p++;
        while (p < end && isdigit((unsigned char)*p)) {
            if (nfrac == MAX_FRAC_UNIT)
                return GV_EINVAL;
            frac = frac * 10 + (unsigned)(*p - '0');
            nfrac++;
            p++;
        }
        if (nfrac == 0)
            return GV_EINVAL;
    }

    size_t rest = (size_t)(end - p);
    u128 result;
    if (rest == 1 && *p == '%') {
        if (nfrac > MAX_FRAC_PCT)
            return GV_EINVAL;
        uint64_t scale = pow10u(nfrac);
        u128 pct = ip * scale + frac;           /* percent * scale */
        if (pct < (u128)scale || pct > (u128)100 * scale) {
            *why = "percentage must be between 1% and 100%";
            return GV_EINVAL;
        }
        if (physical_total == 0) {
            *why = "a percentage needs the device's total memory, which is unknown";
            return GV_EINVAL;
        }
        result = (u128)physical_total * pct / ((u128)100 * scale);
    } else {
        int shift = 0;
        if (rest > 0) {
            switch (tolower((unsigned char)*p)) {
            case 'k': shift = 10; break;
            case 'm': shift = 20; break;
            case 'g': shift = 30; break;
            case 't': shift = 40; break;
            default: return GV_EINVAL;
            }
            const char *s = p + 1;
            size_t sl = rest - 1;
            if (!(sl == 0 || (sl == 1 && (tolower((unsigned char)s[0]) == 'i' ||
                                          tolower((unsigned char)s[0]) == 'b')) ||
                  (sl == 2 && tolower((unsigned char)s[0]) == 'i' &&
                   tolower((unsigned char)s[1]) == 'b')))
                return GV_EINVAL;
        } else if (has_point) {
            return GV_EINVAL;                   /* no fractional bytes */
        }
        result = (ip << shift) + (((u128)frac << shift) / pow10u(nfrac));
    }
    if (result > UINT64_MAX) {
        *why = "too large (more than 2^64-1 bytes)";
        return GV_EINVAL;
    }
    if (result == 0) {
        *why = "must be greater than zero";
        return GV_EINVAL;
    }
    *bytes = (uint64_t)result;
    return GV_OK;
}


void limits_quote(char *out, size_t outlen, const char *value, size_t max)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    if (out == NULL || outlen == 0)
        return;
    for (size_t i = 0; value != NULL && value[i] != '\0' && i < max; i++) {
        unsigned char c = (unsigned char)value[i];
        char esc[4];
        size_t l = 0;
        if (c == '\n' || c == '\t' || c == '\r') {
            esc[l++] = '\\';
            esc[l++] = c == '\n' ? 'n' : c == '\t' ? 't' : 'r';
        } else if (c < 0x20 || c == 0x7f) {
            esc[l++] = '\\';
            esc[l++] = 'x';
            esc[l++] = hex[c >> 4];
            esc[l++] = hex[c & 15];
        } else {
            esc[l++] = (char)c;
        }
        if (o + l >= outlen)
            break;
        memcpy(out + o, esc, l);
        o += l;
    }
    out[o] = '\0';
}

/* ---- the limits file (GPUVISOR_LIMITS_FILE) ---------------------------------
 *
 * When GPUVISOR_LIMITS_FILE names a file, the limit variables (file_name())
 * are read from it instead of the environment: lines NAME=value, blank lines
 * and lines starting with # ignored, each name at most once, the values in
 * the grammar of the variables.  A file that cannot be read, is larger than
 * LF_MAX, has a line that is not NAME=value of a limit variable, or sets
 * nothing, is an error that the checks report (fail closed).  Loaded per
 * thread: at every limits_check_env, and on first use after the path or the
 * environment changed. */
#define GV_ENV_LIMITS_FILE "GPUVISOR_LIMITS_FILE"
#define LF_MAX 4096
#define LF_ENTRIES 64

enum { LF_NONE, LF_OK, LF_BAD };

struct limits_file {
    int state;
    const char *const *env;             /* the environment it was loaded for */
    char path[256];
    char buf[LF_MAX + 1];
    const char *entry[LF_ENTRIES + 1];  /* "NAME=value", NULL-terminated */
    char why[192];                      /* LF_BAD: what is wrong */
};

static _Thread_local struct limits_file t_file;
static _Thread_local const char *const *t_env;
extern char **environ;

static const char *raw_getenv(const char *name)
{
    if (t_env == NULL)
        return getenv(name);
    size_t n = strlen(name);
    for (const char *const *e = t_env; *e != NULL; e++)
        if (strncmp(*e, name, n) == 0 && (*e)[n] == '=')
            return *e + n + 1;
    return NULL;
}

/* 1 if name (len bytes) is a variable the limits file gives. */
static int file_name(const char *name, size_t len)
{
    static const char *const families[] = {GV_ENV_LIMIT, GV_ENV_SM_LIMIT};
    /* Oversubscription too: the device plugin that grants a quota past the
     * device's memory is what says so, and a container must not turn it on
     * (or change its own guarantee) by its environment alone. */
    static const char *const words[] = {GV_ENV_SM_POLICY, GV_ENV_CORE_POLICY, GV_ENV_PRIORITY,
                                        GV_ENV_OVERSUBSCRIBE, GV_ENV_SCALING};
    for (size_t i = 0; i < 2; i++) {
        size_t l = strlen(families[i]);
        if (len >= l && strncmp(name, families[i], l) == 0)
            return 1;
    }
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++)
        if (len == strlen(words[i]) && strncmp(name, words[i], len) == 0)
            return 1;
    return 0;
}

static int file_bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int file_bad(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_file.why, sizeof t_file.why, fmt, ap);
    va_end(ap);
    t_file.state = LF_BAD;
    return LF_BAD;
}

static int file_parse(size_t n)
{
    char *buf = t_file.buf;
    size_t count = 0;
    unsigned line = 0;
    buf[n] = '\0';
    if (memchr(buf, '\0', n) != NULL)
        return file_bad("has a NUL byte");
    for (char *p = buf; *p != '\0';) {
        char *eol = strchr(p, '\n');
        char *next = eol != NULL ? eol + 1 : p + strlen(p);
        if (eol != NULL)
            *eol = '\0';
        line++;
        size_t len = strlen(p);
        if (len > 0 && p[len - 1] == '\r')
            p[--len] = '\0';
        if (len > 0 && p[0] != '#') {
            char *eq = strchr(p, '=');
            size_t nlen = eq != NULL ? (size_t)(eq - p) : len;
            char q[65];
            limits_quote(q, sizeof q, p, nlen < 64 ? nlen : 64);
            if (eq == NULL || nlen == 0)
                return file_bad("line %u: \"%s\" is not NAME=value", line, q);
            if (!file_name(p, nlen))
                return file_bad("line %u: %s is not a limit variable", line, q);
            for (size_t i = 0; i < count; i++)
                if (strncmp(t_file.entry[i], p, nlen + 1) == 0)
                    return file_bad("line %u: %s is set twice", line, q);
            if (count == LF_ENTRIES)
                return file_bad("more than %d variables", LF_ENTRIES);
            t_file.entry[count++] = p;
        }
        p = next;
    }
    t_file.entry[count] = NULL;
    if (count == 0)
        return file_bad("sets no limit (an empty file is refused)");
    t_file.state = LF_OK;
    return LF_OK;
}

static int file_load(const char *path)
{
    t_file.env = t_env;
    t_file.entry[0] = NULL;
    if (strlen(path) >= sizeof t_file.path) {
        t_file.path[0] = '\0';
        return file_bad("path longer than %zu bytes", sizeof t_file.path - 1);
    }
    strcpy(t_file.path, path);
    if (path[0] != '/')
        return file_bad("not an absolute path");
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        char e[96];
        int saved = errno;
        snprintf(e, sizeof e, "%s", saved == ENOENT ? "no such file" : strerror(saved));
        return file_bad("cannot open: %s", e);
    }
    size_t n = 0;
    for (;;) {
        ssize_t r = read(fd, t_file.buf + n, LF_MAX + 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int saved = errno;
            close(fd);
            return file_bad("cannot read: %s", strerror(saved));
        }
        if (r == 0)
            break;
        n += (size_t)r;
        if (n > LF_MAX) {
            close(fd);
            return file_bad("larger than %d bytes", LF_MAX);
        }
    }
    close(fd);
    return file_parse(n);
}

/* The state of the limits file of the current environment, (re)loaded
 * when force, or when the path or the environment changed. */
static int file_state(int force)
{
    const char *path = raw_getenv(GV_ENV_LIMITS_FILE);
    if (path == NULL || path[0] == '\0') {
        t_file.state = LF_NONE;
        return LF_NONE;
    }
    if (force || t_file.state == LF_NONE || t_file.env != t_env ||
        strncmp(t_file.path, path, sizeof t_file.path) != 0)
        return file_load(path);
    return t_file.state;
}

static void set_err(char *err, size_t errlen, const char *name,
                    const char *value, const char *why)
{
    char qname[91], qvalue[81];     /* as long as before: the reason still fits */
    if (err == NULL || errlen == 0)
        return;
    limits_quote(qname, sizeof qname, name, 90);
    limits_quote(qvalue, sizeof qvalue, value, 80);
    if (t_file.state != LF_NONE && file_name(name, strlen(name))) {
        char qpath[121];
        limits_quote(qpath, sizeof qpath, t_file.path, 120);
        snprintf(err, errlen, "gpuvisor: %s=\"%s\": %s=\"%s\": %s", GV_ENV_LIMITS_FILE, qpath,
                 qname, qvalue, why);
        return;
    }
    snprintf(err, errlen, "gpuvisor: %s=\"%s\": %s", qname, qvalue, why);
}

/* GV_EINVAL with the file's problem in err when the limits file is bad. */
static int file_check(int force, char *err, size_t errlen)
{
    if (file_state(force) != LF_BAD)
        return GV_OK;
    if (err != NULL && errlen > 0) {
        char qpath[121];
        limits_quote(qpath, sizeof qpath, t_file.path[0] ? t_file.path : "(too long)", 120);
        snprintf(err, errlen, "gpuvisor: %s=\"%s\": %s", GV_ENV_LIMITS_FILE, qpath, t_file.why);
    }
    return GV_EINVAL;
}

int limits_memory_for_ordinal(int ordinal, uint64_t physical_total,
                              uint64_t *bytes, char *err, size_t errlen)
{
    char name[64];
    const char *value = NULL;
    if (bytes == NULL)
        return GV_EINVAL;
    if (file_check(0, err, errlen) != GV_OK)
        return GV_EINVAL;
    if (ordinal >= 0) {
        snprintf(name, sizeof name, GV_ENV_LIMIT "_%d", ordinal);
        value = limits_getenv(name);
    }
    if (value == NULL || value[0] == '\0') {
        snprintf(name, sizeof name, GV_ENV_LIMIT);
        value = limits_getenv(name);
    }
    if (value == NULL || value[0] == '\0') {
        *bytes = GV_UNLIMITED;
        return GV_OK;
    }
    const char *why;
    if (limits_parse(value, physical_total, bytes, &why) != GV_OK) {
        set_err(err, errlen, name, value, why);
        return GV_EINVAL;
    }
    return GV_OK;
}

/* 1 if s (up to '=') is a valid ordinal suffix: digits, no leading zero. */
static int ordinal_ok(const char *s, size_t len)
{
    if (len == 0 || len > 6 || (len > 1 && s[0] == '0'))
        return 0;
    for (size_t i = 0; i < len; i++)
        if (!isdigit((unsigned char)s[i]))
            return 0;
    return 1;
}

/* The environment the limits are read from: this thread's override
 * (limits_use_env, t_env), else the process's. */
void limits_use_env(const char *const *env)
{
    t_env = env;
    t_file.state = LF_NONE;             /* loaded again for this one */
}

const char *limits_getenv(const char *name)
{
    if (file_name(name, strlen(name)) && file_state(0) != LF_NONE) {
        size_t n = strlen(name);
        for (const char *const *e = t_file.entry; t_file.state == LF_OK && *e != NULL; e++)
            if (strncmp(*e, name, n) == 0 && (*e)[n] == '=')
                return *e + n + 1;
        return NULL;                    /* a bad file: the checks report it */
    }
    return raw_getenv(name);
}

/* Check every variable of the family BASE and BASE_<ordinal> in the
 * environment: unknown suffixes fail, empty values count as unset, others
 * must pass why_bad (NULL: good; else the reason). */
static int check_family(const char *base, const char *(*why_bad)(const char *),
                        char *err, size_t errlen)
{
    const size_t plen = strlen(base);
    const char *const *vars = t_env != NULL ? t_env : (const char *const *)environ;
    if (file_state(0) == LF_OK)
        vars = t_file.entry;
    for (const char *const *e = vars; e != NULL && *e != NULL; e++) {
        const char *kv = *e;
        const char *eq = strchr(kv, '=');
        if (strncmp(kv, base, plen) != 0 || eq == NULL)
            continue;
        size_t nlen = (size_t)(eq - kv);
        char name[96];
        snprintf(name, sizeof name, "%.*s", (int)(nlen < 90 ? nlen : 90), kv);
        if (nlen != plen && !(kv[plen] == '_' && ordinal_ok(kv + plen + 1, nlen - plen - 1))) {
            char why[160];
            snprintf(why, sizeof why, "unknown variable (use %s or %s_<device ordinal>)", base, base);
            set_err(err, errlen, name, eq + 1, why);
            return GV_EINVAL;
        }
        const char *why = eq[1] != '\0' ? why_bad(eq + 1) : NULL;
        if (why != NULL) {
            set_err(err, errlen, name, eq + 1, why);
            return GV_EINVAL;
        }
    }
    return GV_OK;
}

static const char *memory_why_bad(const char *value)
{
    uint64_t bytes;
    const char *why;
    /* Percentages: the device size is not known yet; check syntax. */
    return limits_parse(value, UINT64_C(1) << 40, &bytes, &why) != GV_OK ? why : NULL;
}

int limits_check_env(char *err, size_t errlen)
{
    if (file_check(1, err, errlen) != GV_OK)
        return GV_EINVAL;
    int rc = check_family(GV_ENV_LIMIT, memory_why_bad, err, errlen);
    return rc != GV_OK ? rc : limits_oversub_check_env(err, errlen);
}

/* A boolean variable: 1 for true/1/yes/on, 0 for false/0/no/off/empty or
 * unset, -1 for anything else. */
static int env_flag(const char *v)
{
    if (v == NULL)
        return 0;
    char buf[16];
    const char *p = v;
    while (isspace((unsigned char)*p))
        p++;
    size_t n = strlen(p);
    while (n > 0 && isspace((unsigned char)p[n - 1]))
        n--;
    if (n >= sizeof buf)
        return -1;
    memcpy(buf, p, n);
    buf[n] = '\0';
    static const char *const yes[] = {"true", "1", "yes", "on"};
    static const char *const no[] = {"false", "0", "no", "off", ""};
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
        if (strcasecmp(buf, yes[i]) == 0)
            return 1;
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        if (strcasecmp(buf, no[i]) == 0)
            return 0;
    return -1;
}

int limits_control_disabled(void)
{
    const char *v = limits_getenv(GV_ENV_DISABLE);
    int f = env_flag(v);
    if (f >= 0)
        return f;
    char q[65];
    limits_quote(q, sizeof q, v, 64);
    gv_log(GV_LOG_ERROR,
           GV_ENV_DISABLE "=\"%s\": not a boolean (use true/false, 1/0, yes/no, "
           "on/off); memory limits stay enforced", q);
    return 0;
}

/* "0.1" .. "100" with at most 3 fraction digits, in thousandths; 0: bad. */
static uint32_t parse_scaling(const char *v)
{
    while (isspace((unsigned char)*v))
        v++;
    uint64_t whole = 0, frac = 0;
    int digits = 0, fdigits = 0;
    for (; isdigit((unsigned char)*v); v++, digits++) {
        whole = whole * 10 + (uint64_t)(*v - '0');
        if (whole > 100)
            return 0;
    }
    if (*v == '.') {
        v++;
        for (; isdigit((unsigned char)*v); v++, fdigits++) {
            if (fdigits >= 3)
                return 0;
            frac = frac * 10 + (uint64_t)(*v - '0');
        }
        if (fdigits == 0)
            return 0;
    }
    while (isspace((unsigned char)*v))
        v++;
    if (*v != '\0' || digits == 0)
        return 0;
    for (int i = fdigits; i < 3; i++)
        frac *= 10;
    uint64_t milli = whole * 1000 + frac;
    return milli >= 100 && milli <= 100000 ? (uint32_t)milli : 0;
}

int limits_oversub_check_env(char *err, size_t errlen)
{
    const char *v = limits_getenv(GV_ENV_OVERSUBSCRIBE);
    if (env_flag(v) < 0) {
        set_err(err, errlen, GV_ENV_OVERSUBSCRIBE, v,
                "not a boolean (use true/false, 1/0, yes/no, on/off)");
        return GV_EINVAL;
    }
    v = limits_getenv(GV_ENV_SCALING);
    if (v != NULL && v[0] != '\0' && parse_scaling(v) == 0) {
        set_err(err, errlen, GV_ENV_SCALING, v,
                "not a scaling factor (a decimal from 0.1 to 100, at most 3 fraction digits)");
        return GV_EINVAL;
    }
    return GV_OK;
}

int limits_oversubscribe(void)
{
    return env_flag(limits_getenv(GV_ENV_OVERSUBSCRIBE)) == 1;
}

uint32_t limits_memory_scaling_milli(void)
{
    const char *v = limits_getenv(GV_ENV_SCALING);
    uint32_t m = v != NULL && v[0] != '\0' ? parse_scaling(v) : 0;
    return m ? m : 1000;
}

uint64_t limits_guarantee(uint64_t limit, uint64_t physical, uint32_t scaling_milli)
{
    if (limit == GV_UNLIMITED)
        return physical;
    uint64_t g = limit;
    if (scaling_milli > 1000) {
        /* limit * 1000 / S without overflow (S > 1000 here, so the first
         * product stays below 2^64, and the remainder's below 2^27). */
        g = limit / scaling_milli * 1000 + limit % scaling_milli * 1000 / scaling_milli;
    }
    return g < physical ? g : physical;
}

/* ---- SM-time quota ---------------------------------------------------------- */

/* A whole number 0..100 (surrounding spaces allowed); -1 otherwise. */
static int parse_pct(const char *v)
{
    while (isspace((unsigned char)*v))
        v++;
    if (!isdigit((unsigned char)*v))
        return -1;
    long n = 0;
    while (isdigit((unsigned char)*v) && n <= 100)
        n = n * 10 + (*v++ - '0');
    while (isspace((unsigned char)*v))
        v++;
    return (*v != '\0' || n > 100) ? -1 : (int)n;
}

int limits_sm_for_ordinal(int ordinal, unsigned *pct, char *err, size_t errlen)
{
    char name[64];
    const char *value = NULL;
    if (pct == NULL)
        return GV_EINVAL;
    if (file_check(0, err, errlen) != GV_OK)
        return GV_EINVAL;
    if (ordinal >= 0) {
        snprintf(name, sizeof name, GV_ENV_SM_LIMIT "_%d", ordinal);
        value = limits_getenv(name);
    }
    if (value == NULL || value[0] == '\0') {
        snprintf(name, sizeof name, GV_ENV_SM_LIMIT);
        value = limits_getenv(name);
    }
    *pct = 0;
    if (value == NULL || value[0] == '\0')
        return GV_OK;
    int n = parse_pct(value);
    if (n < 0) {
        set_err(err, errlen, name, value, "not a whole percentage from 0 to 100 (0: no limit)");
        return GV_EINVAL;
    }
    *pct = (unsigned)n;
    return GV_OK;
}

static int word_index(const char *v, const char *const *words, int n)
{
    for (int i = 0; i < n; i++)
        if (strcasecmp(v, words[i]) == 0)
            return i;
    return -1;
}

static const char *const sm_policies[] = { "fixed-share", "burst-share", "best-effort" };
static const char *const core_policies[] = { "default", "force", "disable" };

static const char *sm_why_bad(const char *value)
{
    return parse_pct(value) < 0 ? "not a whole percentage from 0 to 100 (0: no limit)" : NULL;
}

int limits_sm_check_env(char *err, size_t errlen)
{
    if (file_check(0, err, errlen) != GV_OK ||
        check_family(GV_ENV_SM_LIMIT, sm_why_bad, err, errlen) != GV_OK)
        return GV_EINVAL;
    const char *v = limits_getenv(GV_ENV_SM_POLICY);
    if (v != NULL && v[0] != '\0' && word_index(v, sm_policies, 3) < 0) {
        set_err(err, errlen, GV_ENV_SM_POLICY, v, "use fixed-share, burst-share or best-effort");
        return GV_EINVAL;
    }
    v = limits_getenv(GV_ENV_CORE_POLICY);
    if (v != NULL && v[0] != '\0' && word_index(v, core_policies, 3) < 0) {
        set_err(err, errlen, GV_ENV_CORE_POLICY, v, "use default, force or disable");
        return GV_EINVAL;
    }
    v = limits_getenv(GV_ENV_PRIORITY);
    if (v != NULL && v[0] != '\0' && strcmp(v, "0") != 0 && strcmp(v, "1") != 0) {
        set_err(err, errlen, GV_ENV_PRIORITY, v, "use 0 (high) or 1 (low)");
        return GV_EINVAL;
    }
    return GV_OK;
}

/* HAMi's device plugin puts every container's region file in its
 * per-container directory, mounted at this path (HAMi-core's default
 * CONTAINER_VGPU_MOUNT). */
#define HAMI_VGPU_DIR "/usr/local/vgpu/"

/* Whether the environment is one HAMi set up: GPU_CORE_UTILIZATION_POLICY
 * given (HAMi's own switch), or the region file in HAMi's per-container
 * directory (HAMi's webhook leaves the switch out when it is default). */
static int hami_environment(const char *core)
{
    const char *cache = raw_getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    return (core != NULL && core[0] != '\0') ||
           (cache != NULL && strncmp(cache, HAMI_VGPU_DIR, strlen(HAMI_VGPU_DIR)) == 0);
}

int limits_sm_policy(void)
{
    const char *core = limits_getenv(GV_ENV_CORE_POLICY);
    int c = (core != NULL && core[0] != '\0') ? word_index(core, core_policies, 3) : 0;
    if (c == 2)
        return -1;                       /* disable */
    if (c == 1)
        return 0;                        /* force: the limit is a hard cap */
    const char *p = limits_getenv(GV_ENV_SM_POLICY);
    if ((p == NULL || p[0] == '\0') && hami_environment(core))
        return 1;   /* HAMi's default: held to the limit only while another competes */
    int i = (p != NULL && p[0] != '\0') ? word_index(p, sm_policies, 3) : 0;
    return i < 0 ? 0 : i;
}

unsigned limits_task_priority(void)
{
    /* Unset or empty: low, as in HAMi-core (its region starts with
     * priority 1 and only the variable set to 0 makes a container high). */
    const char *v = limits_getenv(GV_ENV_PRIORITY);
    return (v != NULL && strcmp(v, "0") == 0) ? 0u : 1u;
}
