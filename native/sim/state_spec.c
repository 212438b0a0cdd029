/*
 * state_spec.c - GPUVISOR_SIM_DEVICES parsing, UUIDs, knob parsing and
 * the one-line stderr log shared by both simulated libraries.
 *
 * Spec grammar (see docs/simulator.md):
 *   spec   := item (',' item)*
 *   item   := [COUNT 'x'] SIZE (':' key '=' value)*
 *   key    := name | uuid | sms | ctx
 *   SIZE   := digits [k|m|g|t] [i] [b]      (binary units, any case)
 */
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "sim.h"

void sim_log(const char *fmt, ...)
{
    char buf[768];
    int n = snprintf(buf, sizeof buf, "gpuvisor-sim: ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(buf);
    buf[len++] = '\n';
    ssize_t w = write(2, buf, len);
    (void)w;
}

int sim_parse_size(const char *s, uint64_t *out)
{
    if (!s || !isdigit((unsigned char)*s))
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno)
        return -1;
    unsigned shift = 0;
    switch (tolower((unsigned char)*end)) {
    case 'k': shift = 10; end++; break;
    case 'm': shift = 20; end++; break;
    case 'g': shift = 30; end++; break;
    case 't': shift = 40; end++; break;
    default: break;
    }
    if (shift && tolower((unsigned char)*end) == 'i')
        end++;
    if (tolower((unsigned char)*end) == 'b')
        end++;
    if (*end)
        return -1;
    if (shift && v > (~0ULL >> shift))
        return -1;
    *out = v << shift;
    return 0;
}

static int hexn(const char *s, int n)
{
    for (int i = 0; i < n; i++)
        if (!isxdigit((unsigned char)s[i]))
            return 0;
    return 1;
}

/* "GPU-8-4-4-4-12" (or "MIG-...", a MIG device's) -> 16 bytes; 0 on success */
int sim_uuid_bytes(const char *u, unsigned char out[16])
{
    if ((strncmp(u, "GPU-", 4) != 0 && strncmp(u, "MIG-", 4) != 0) || strlen(u) != 40)
        return -1;
    const char *p = u + 4;
    static const int groups[5] = {8, 4, 4, 4, 12};
    int k = 0;
    for (int g = 0; g < 5; g++) {
        if (!hexn(p, groups[g]))
            return -1;
        for (int i = 0; i < groups[g]; i += 2) {
            char b[3] = {p[i], p[i + 1], 0};
            out[k++] = (unsigned char)strtoul(b, NULL, 16);
        }
        p += groups[g];
        if (g < 4 && *p++ != '-')
            return -1;
    }
    return 0;
}

void sim_default_uuid(int index, char *buf, size_t len)
{
    snprintf(buf, len, "GPU-%08x-%04x-%04x-%04x-%012llx", 0x6776a51du,
             0x5e11u, 0x4000u, 0x8000u, (unsigned long long)index);
}

static int parse_int(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

/* one item, already split off; appends to out */
static int parse_item(char *item, sim_spec *out)
{
    char *save = NULL;
    char *head = strtok_r(item, ":", &save);
    if (!head)
        return -1;
    long count = 1;
    char *x = strchr(head, 'x');
    if (!x)
        x = strchr(head, 'X');
    if (x) {
        *x = 0;
        if (parse_int(head, 1, SIM_MAX_DEV, &count) < 0)
            return -1;
        head = x + 1;
    }
    sim_devinfo d;
    memset(&d, 0, sizeof d);
    if (sim_parse_size(head, &d.total) < 0 || d.total == 0)
        return -1;
    d.ctx_size = 32 * SIM_MIB;
    d.sms = 108;
    snprintf(d.name, sizeof d.name, "gpuvisor simulated GPU");
    int have_uuid = 0;
    char *kv;
    while ((kv = strtok_r(NULL, ":", &save))) {
        char *eq = strchr(kv, '=');
        if (!eq)
            return -1;
        *eq = 0;
        const char *v = eq + 1;
        long n;
        if (!strcmp(kv, "name")) {
            if (!*v || strlen(v) >= sizeof d.name)
                return -1;
            snprintf(d.name, sizeof d.name, "%s", v);
        } else if (!strcmp(kv, "uuid")) {
            unsigned char b[16];
            if (strncmp(v, "GPU-", 4) != 0 || sim_uuid_bytes(v, b) < 0 || count != 1)
                return -1;
            snprintf(d.uuid, sizeof d.uuid, "%s", v);
            have_uuid = 1;
        } else if (!strcmp(kv, "sms")) {
            if (parse_int(v, 1, 100000, &n) < 0)
                return -1;
            d.sms = (int32_t)n;
        } else if (!strcmp(kv, "ctx")) {
            if (sim_parse_size(v, &d.ctx_size) < 0)
                return -1;
        } else {
            return -1;
        }
    }
    for (long i = 0; i < count; i++) {
        if (out->ndev >= SIM_MAX_DEV)
            return -1;
        sim_devinfo *t = &out->dev[out->ndev];
        *t = d;
        if (!have_uuid)
            sim_default_uuid(out->ndev, t->uuid, sizeof t->uuid);
        out->ndev++;
    }
    return 0;
}

int sim_parse_spec(const char *s, sim_spec *out)
{
    memset(out, 0, sizeof *out);
    if (!s || !*s || strlen(s) >= SIM_SPEC_LEN)
        return -1;
    char buf[SIM_SPEC_LEN];
    snprintf(buf, sizeof buf, "%s", s);
    char *save = NULL, *item;
    int items = 0;
    /* strtok_r would skip empty items; catch ",," and trailing ',' */
    if (buf[0] == ',' || buf[strlen(buf) - 1] == ',' || strstr(buf, ",,"))
        return -1;
    for (item = strtok_r(buf, ",", &save); item;
         item = strtok_r(NULL, ",", &save)) {
        if (parse_item(item, out) < 0)
            return -1;
        items++;
    }
    if (!items)
        return -1;
    for (int i = 0; i < out->ndev; i++)
        for (int j = 0; j < i; j++)
            if (!strcasecmp(out->dev[i].uuid, out->dev[j].uuid))
                return -1;
    return 0;
}

int sim_parse_ull(const char *v, unsigned long long *out)
{
    char *end;
    errno = 0;
    *out = strtoull(v, &end, 10);
    return errno || end == v || *end || !isdigit((unsigned char)*v) ? -1 : 0;
}

/* Positive integer knob.  1: set and valid, 0: unset, -1: malformed
 * (already reported). */
int sim_knob_uint(const char *var, unsigned long long *out)
{
    const char *v = getenv(var);
    if (!v || !*v)
        return 0;
    unsigned long long n;
    if (sim_parse_ull(v, &n) || n == 0) {
        sim_log("%s=%s is not a positive integer; ignored", var, v);
        return -1;
    }
    *out = n;
    return 1;
}

unsigned long long sim_knob_range(const char *var, unsigned long long lo, unsigned long long hi,
                                  unsigned long long fallback)
{
    unsigned long long v;
    int got = sim_knob_uint(var, &v);
    if (got <= 0)
        return fallback;
    if (v < lo || v > hi) {
        sim_log("%s=%s is not an integer from %llu to %llu; ignored", var, getenv(var), lo, hi);
        return fallback;
    }
    return v;
}
