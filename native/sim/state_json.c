/*
 * state_json.c - a small strict JSON reader for GPUVISOR_SIM_TOPOLOGY.
 *
 * RFC 8259 syntax, with two limits that a topology file never needs:
 * numbers must be integers (no fraction, no exponent) that fit in 64 bits,
 * and a \u escape must name an ASCII character.  Strings are unescaped in
 * place in the caller's buffer; values go into the caller's pool.  A
 * duplicate key in an object is an error, as it would be ambiguous.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_json.h"

#define QUOTE 0x22                      /* the double quote character */

typedef struct reader {
    char *p;
    const char *base;
    sj_val *pool;
    int n, max;
    char *err;
    size_t errlen;
    int depth;
} reader;

static int fail(reader *r, const char *what)
{
    int line = 1, col = 1;
    for (const char *q = r->base; q < r->p; q++) {
        if (*q == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    snprintf(r->err, r->errlen, "not valid JSON at line %d column %d: %s", line, col, what);
    return -1;
}

static void ws(reader *r)
{
    while (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r')
        r->p++;
}

static int new_val(reader *r, int type)
{
    if (r->n >= r->max)
        return fail(r, "too many values");
    sj_val *v = &r->pool[r->n];
    memset(v, 0, sizeof *v);
    v->type = type;
    v->child = v->next = -1;
    return r->n++;
}

static int hex4(const char *s)
{
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* a string at r->p (the opening quote); unescaped in place, *out its start */
static int string(reader *r, const char **out)
{
    char *w = ++r->p;
    *out = w;
    for (;;) {
        unsigned char c = (unsigned char)*r->p;
        if (c == QUOTE) {
            r->p++;
            *w = 0;
            return 0;
        }
        if (c == 0)
            return fail(r, "unterminated string");
        if (c < 0x20)
            return fail(r, "control character in a string");
        if (c != '\\') {
            *w++ = *r->p++;
            continue;
        }
        r->p++;
        switch (*r->p) {
        case QUOTE: *w++ = QUOTE; break;
        case '\\': *w++ = '\\'; break;
        case '/': *w++ = '/'; break;
        case 'b': *w++ = '\b'; break;
        case 'f': *w++ = '\f'; break;
        case 'n': *w++ = '\n'; break;
        case 'r': *w++ = '\r'; break;
        case 't': *w++ = '\t'; break;
        case 'u': {
            int v = hex4(r->p + 1);
            if (v < 0)
                return fail(r, "bad \\u escape");
            if (v == 0 || v > 0x7f)
                return fail(r, "\\u escape of a character that is not printable ASCII");
            *w++ = (char)v;
            r->p += 4;
            break;
        }
        default:
            return fail(r, "bad escape in a string");
        }
        r->p++;
    }
}

static int value(reader *r);

static int container(reader *r, int type, char close)
{
    int me = new_val(r, type);
    if (me < 0)
        return -1;
    if (++r->depth > 32)
        return fail(r, "nested too deeply");
    r->p++;
    ws(r);
    int last = -1;
    if (*r->p == close) {
        r->p++;
        r->depth--;
        return me;
    }
    for (;;) {
        const char *key = NULL;
        if (type == SJ_OBJ) {
            if (*r->p != QUOTE)
                return fail(r, "expected a key string");
            if (string(r, &key) < 0)
                return -1;
            for (int k = r->pool[me].child; k >= 0; k = r->pool[k].next)
                if (!strcmp(r->pool[k].key, key))
                    return fail(r, "duplicate key");
            ws(r);
            if (*r->p != ':')
                return fail(r, "expected ':'");
            r->p++;
            ws(r);
        }
        int v = value(r);
        if (v < 0)
            return -1;
        r->pool[v].key = key;
        if (last < 0)
            r->pool[me].child = v;
        else
            r->pool[last].next = v;
        last = v;
        r->pool[me].len++;
        ws(r);
        if (*r->p == ',') {
            r->p++;
            ws(r);
            continue;
        }
        if (*r->p == close) {
            r->p++;
            r->depth--;
            return me;
        }
        return fail(r, type == SJ_OBJ ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int number(reader *r)
{
    char *s = r->p;
    if (*s == '-')
        s++;
    if (*s < '0' || *s > '9')
        return fail(r, "unexpected character");
    if (*s == '0' && s[1] >= '0' && s[1] <= '9')
        return fail(r, "a number with a leading zero");
    char *end;
    errno = 0;
    long long v = strtoll(r->p, &end, 10);
    if (*end == '.' || *end == 'e' || *end == 'E')
        return fail(r, "numbers must be integers");
    if (errno)
        return fail(r, "number out of range");
    int me = new_val(r, SJ_INT);
    if (me < 0)
        return -1;
    r->pool[me].i = v;
    r->p = end;
    return me;
}

static int word(reader *r, const char *w, int type, long long v)
{
    size_t n = strlen(w);
    if (strncmp(r->p, w, n) != 0)
        return fail(r, "unexpected character");
    r->p += n;
    int me = new_val(r, type);
    if (me >= 0)
        r->pool[me].i = v;
    return me;
}

static int value(reader *r)
{
    ws(r);
    switch (*r->p) {
    case '{': return container(r, SJ_OBJ, '}');
    case '[': return container(r, SJ_ARR, ']');
    case QUOTE: {
        int me = new_val(r, SJ_STR);
        if (me < 0)
            return -1;
        const char *s;
        if (string(r, &s) < 0)
            return -1;
        r->pool[me].s = s;
        return me;
    }
    case 't': return word(r, "true", SJ_BOOL, 1);
    case 'f': return word(r, "false", SJ_BOOL, 0);
    case 'n': return word(r, "null", SJ_NULL, 0);
    case 0: return fail(r, "unexpected end of file");
    default: return number(r);
    }
}

int sj_parse(char *text, sj_val *pool, int max, char *err, size_t errlen)
{
    reader r = { text, text, pool, 0, max, err, errlen, 0 };
    int root = value(&r);
    if (root < 0)
        return -1;
    ws(&r);
    if (*r.p)
        return fail(&r, "text after the document");
    return root;
}

int sj_get(const sj_val *pool, int obj, const char *key)
{
    for (int k = pool[obj].child; k >= 0; k = pool[k].next)
        if (!strcmp(pool[k].key, key))
            return k;
    return -1;
}

const char *sj_type_name(int type)
{
    switch (type) {
    case SJ_NULL: return "null";
    case SJ_BOOL: return "a boolean";
    case SJ_INT: return "an integer";
    case SJ_STR: return "a string";
    case SJ_ARR: return "an array";
    default: return "an object";
    }
}
