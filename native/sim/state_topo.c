/*
 * state_topo.c - GPUVISOR_SIM_TOPOLOGY: a JSON file that describes the
 * node (docs/simulator.md, "Topology and MIG"):
 *
 *   {"gpus": [{"model": "NVIDIA A100-SXM4-80GB", "memory": "80g",
 *              "numa": 0, "pcie_switch": 0, "pcie_upstream": 0,
 *              "host_bridge": 0, "mig": true, "uuid": "GPU-...",
 *              "sms": 108, "nvlinks": 12}, ...],
 *    "nvlink": [[0, 1, 12], ...],
 *    "nvswitch": false}
 *
 * Every field but "gpus" and a GPU's "model" is optional; a field the
 * simulator does not know is an error, as is any value of the wrong type
 * or range: one line names the file, the field and the value.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sim_json.h"

#define MAX_FILE (256 * 1024)
#define MAX_VALUES 8192

typedef struct ctx {
    const char *path;
    const sj_val *v;
} ctx;

static int bad(const ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(const ctx *c, const char *fmt, ...)
{
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sim_log("GPUVISOR_SIM_TOPOLOGY=%s: %s", c->path, msg);
    return -1;
}

/* an integer member from lo to hi into *out; absent leaves *out */
static int get_int(const ctx *c, int obj, const char *key, const char *where, long long lo,
                   long long hi, int32_t *out)
{
    int k = sj_get(c->v, obj, key);
    if (k < 0)
        return 0;
    if (c->v[k].type != SJ_INT)
        return bad(c, "%s.%s: is %s, not an integer", where, key, sj_type_name(c->v[k].type));
    if (c->v[k].i < lo || c->v[k].i > hi)
        return bad(c, "%s.%s: %lld is not from %lld to %lld", where, key, c->v[k].i, lo, hi);
    *out = (int32_t)c->v[k].i;
    return 0;
}

static int check_keys(const ctx *c, int obj, const char *where, const char *const *known)
{
    for (int k = c->v[obj].child; k >= 0; k = c->v[k].next) {
        int ok = 0;
        for (int i = 0; known[i] && !ok; i++)
            ok = !strcmp(known[i], c->v[k].key);
        if (ok)
            continue;
        char list[256] = "";
        for (int i = 0; known[i]; i++) {
            size_t l = strlen(list);
            snprintf(list + l, sizeof list - l, "%s%s", i ? ", " : "", known[i]);
        }
        return bad(c, "%s%s%s: unknown field (known: %s)", where, *where ? "." : "",
                   c->v[k].key, list);
    }
    return 0;
}

static int parse_gpu(const ctx *c, int g, int i, sim_spec *out)
{
    static const char *const keys[] = {"model", "memory", "numa", "pcie_switch",
                                       "pcie_upstream", "host_bridge", "mig", "uuid",
                                       "sms", "nvlinks", NULL};
    char where[32];
    snprintf(where, sizeof where, "gpus[%d]", i);
    if (c->v[g].type != SJ_OBJ)
        return bad(c, "%s: is %s, not an object", where, sj_type_name(c->v[g].type));
    if (check_keys(c, g, where, keys) < 0)
        return -1;
    sim_devinfo *d = &out->dev[i];
    sim_topo_gpu *t = &out->topo[i];
    memset(d, 0, sizeof *d);
    memset(t, 0, sizeof *t);
    t->pcie_switch = t->pcie_upstream = t->host_bridge = -1;
    memset(t->link_peer, SIM_LINK_NONE, sizeof t->link_peer);
    int k = sj_get(c->v, g, "model");
    if (k < 0)
        return bad(c, "%s.model: missing (e.g. \"NVIDIA A100-SXM4-80GB\")", where);
    if (c->v[k].type != SJ_STR || !c->v[k].s[0] || strlen(c->v[k].s) >= sizeof d->name)
        return bad(c, "%s.model: must be a name of 1 to %zu characters", where,
                   sizeof d->name - 1);
    snprintf(d->name, sizeof d->name, "%s", c->v[k].s);
    t->model = sim_model_find(d->name);
    const sim_model *m = sim_model_get(t->model);
    d->ctx_size = 32 * SIM_MIB;
    d->sms = m ? (int32_t)m->sms : 108;
    d->total = m ? (uint64_t)m->mem_mib * SIM_MIB : 0;
    t->nlinks = m ? (int32_t)m->nvlinks : -1;   /* -1: as many as used */
    k = sj_get(c->v, g, "memory");
    if (k >= 0) {
        if (c->v[k].type != SJ_STR)
            return bad(c, "%s.memory: is %s, not a size string such as \"80g\"", where,
                       sj_type_name(c->v[k].type));
        if (sim_parse_size(c->v[k].s, &d->total) < 0 || d->total == 0)
            return bad(c, "%s.memory: \"%s\" is not a size such as \"80g\" or \"40960m\"",
                       where, c->v[k].s);
    } else if (!m) {
        return bad(c, "%s.memory: missing, and model \"%s\" is not one the simulator "
                      "knows (NVIDIA A30, A100-SXM4-40GB, A100-SXM4-80GB, H100 80GB HBM3, "
                      "H200)", where, d->name);
    }
    if (get_int(c, g, "numa", where, 0, 63, &t->numa) < 0 ||
        get_int(c, g, "pcie_switch", where, 0, 1000000, &t->pcie_switch) < 0 ||
        get_int(c, g, "pcie_upstream", where, 0, 1000000, &t->pcie_upstream) < 0 ||
        get_int(c, g, "host_bridge", where, 0, 1000000, &t->host_bridge) < 0 ||
        get_int(c, g, "sms", where, 1, 100000, &d->sms) < 0 ||
        get_int(c, g, "nvlinks", where, 0, SIM_NVLINKS, &t->nlinks) < 0)
        return -1;
    if (t->pcie_upstream >= 0 && t->pcie_switch < 0)
        return bad(c, "%s.pcie_upstream: needs a pcie_switch below it", where);
    k = sj_get(c->v, g, "uuid");
    if (k >= 0) {
        unsigned char b[16];
        if (c->v[k].type != SJ_STR || strncmp(c->v[k].s, "GPU-", 4) != 0 ||
            sim_uuid_bytes(c->v[k].s, b) < 0)
            return bad(c, "%s.uuid: must be \"GPU-\" and 8-4-4-4-12 hex digits", where);
        snprintf(d->uuid, sizeof d->uuid, "%s", c->v[k].s);
    } else {
        sim_default_uuid(i, d->uuid, sizeof d->uuid);
    }
    t->mig_capable = m && m->mem_slices ? 1 : 0;
    k = sj_get(c->v, g, "mig");
    if (k >= 0) {
        if (c->v[k].type != SJ_BOOL)
            return bad(c, "%s.mig: is %s, not true or false", where, sj_type_name(c->v[k].type));
        if (c->v[k].i && !t->mig_capable)
            return bad(c, "%s.mig: model \"%s\" is not MIG-capable in the simulator", where,
                       d->name);
        out->mig[i] = (int)c->v[k].i;
    }
    return 0;
}

/* "nvlink": [[a, b, links], ...] */
static int parse_nvlink(const ctx *c, int arr, sim_spec *out)
{
    if (c->v[arr].type != SJ_ARR)
        return bad(c, "nvlink: is %s, not an array of [gpu, gpu, links]",
                   sj_type_name(c->v[arr].type));
    int used[SIM_MAX_DEV] = {0};
    int i = 0;
    for (int e = c->v[arr].child; e >= 0; e = c->v[e].next, i++) {
        const sj_val *p = &c->v[e];
        if (p->type != SJ_ARR || p->len != 3)
            return bad(c, "nvlink[%d]: must be [gpu, gpu, links]", i);
        long long x[3];
        int n = 0;
        for (int q = p->child; q >= 0; q = c->v[q].next) {
            if (c->v[q].type != SJ_INT)
                return bad(c, "nvlink[%d]: must be three integers [gpu, gpu, links]", i);
            x[n++] = c->v[q].i;
        }
        if (x[0] < 0 || x[0] >= out->ndev || x[1] < 0 || x[1] >= out->ndev)
            return bad(c, "nvlink[%d]: GPU %lld or %lld is not from 0 to %d", i, x[0], x[1],
                       out->ndev - 1);
        if (x[0] == x[1])
            return bad(c, "nvlink[%d]: links GPU %lld to itself", i, x[0]);
        if (x[2] < 1 || x[2] > SIM_NVLINKS)
            return bad(c, "nvlink[%d]: %lld links is not from 1 to %d", i, x[2], SIM_NVLINKS);
        for (int s = 0; s < 2; s++) {
            int a = (int)x[s], b = (int)x[1 - s];
            sim_topo_gpu *t = &out->topo[a];
            int cap = t->nlinks >= 0 ? t->nlinks : SIM_NVLINKS;
            if (used[a] + x[2] > cap)
                return bad(c, "nvlink[%d]: GPU %d would have %lld NVLinks, more than its %d "
                              "(set gpus[%d].nvlinks)", i, a, used[a] + x[2], cap, a);
            for (int l = 0; l < x[2]; l++)
                t->link_peer[used[a]++] = (int8_t)b;
        }
    }
    for (int g = 0; g < out->ndev; g++)
        if (out->topo[g].nlinks < 0)
            out->topo[g].nlinks = used[g];
    return 0;
}

static int parse_doc(const ctx *c, int root, sim_spec *out)
{
    static const char *const keys[] = {"gpus", "nvlink", "nvswitch", NULL};
    if (c->v[root].type != SJ_OBJ)
        return bad(c, "the document is %s, not an object with \"gpus\"",
                   sj_type_name(c->v[root].type));
    if (check_keys(c, root, "", keys) < 0)
        return -1;
    int g = sj_get(c->v, root, "gpus");
    if (g < 0)
        return bad(c, "gpus: missing (a list of GPUs)");
    if (c->v[g].type != SJ_ARR || c->v[g].len < 1 || c->v[g].len > SIM_MAX_DEV)
        return bad(c, "gpus: must be a list of 1 to %d GPUs", SIM_MAX_DEV);
    out->ndev = c->v[g].len;
    int i = 0;
    for (int e = c->v[g].child; e >= 0; e = c->v[e].next, i++)
        if (parse_gpu(c, e, i, out) < 0)
            return -1;
    for (int a = 0; a < out->ndev; a++)
        for (int b = 0; b < a; b++)
            if (!strcasecmp(out->dev[a].uuid, out->dev[b].uuid))
                return bad(c, "gpus[%d].uuid: %s is also GPU %d's", a, out->dev[a].uuid, b);
    int k = sj_get(c->v, root, "nvswitch");
    if (k >= 0) {
        if (c->v[k].type != SJ_BOOL)
            return bad(c, "nvswitch: is %s, not true or false", sj_type_name(c->v[k].type));
        out->nvswitch = (int)c->v[k].i;
    }
    k = sj_get(c->v, root, "nvlink");
    if (k >= 0 && out->nvswitch && c->v[k].len)
        return bad(c, "nvlink: every NVLink goes to the NVSwitches when nvswitch is true");
    if (k >= 0 && parse_nvlink(c, k, out) < 0)
        return -1;
    for (int a = 0; a < out->ndev; a++) {
        sim_topo_gpu *t = &out->topo[a];
        if (t->nlinks < 0)
            t->nlinks = 0;
        if (!out->nvswitch)
            continue;
        if (t->nlinks == 0)
            return bad(c, "nvswitch: GPU %d (%s) has no NVLinks (set gpus[%d].nvlinks)", a,
                       out->dev[a].name, a);
        for (int l = 0; l < t->nlinks; l++)
            t->link_peer[l] = SIM_LINK_SWITCH;
    }
    out->topology = 1;
    return 0;
}

int sim_parse_topology(const char *path, sim_spec *out)
{
    memset(out, 0, sizeof *out);
    ctx c = { path, NULL };
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return bad(&c, "cannot open: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size > MAX_FILE) {
        close(fd);
        return bad(&c, "not a regular file of at most %d bytes", MAX_FILE);
    }
    char *text = malloc((size_t)st.st_size + 1);
    sj_val *pool = malloc(MAX_VALUES * sizeof *pool);
    int rc = -1;
    if (!text || !pool) {
        bad(&c, "out of memory");
        goto out;
    }
    ssize_t n = 0, r;
    while (n < st.st_size && (r = read(fd, text + n, (size_t)(st.st_size - n))) > 0)
        n += r;
    if (n != st.st_size) {
        bad(&c, "cannot read: %s", strerror(errno));
        goto out;
    }
    text[n] = 0;
    if (strlen(text) != (size_t)n) {
        bad(&c, "not valid JSON: a NUL byte in the file");
        goto out;
    }
    char err[200];
    int root = sj_parse(text, pool, MAX_VALUES, err, sizeof err);
    if (root < 0) {
        bad(&c, "%s", err);
        goto out;
    }
    c.v = pool;
    rc = parse_doc(&c, root, out);
out:
    close(fd);
    free(text);
    free(pool);
    return rc;
}
