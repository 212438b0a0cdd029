/*
 * nvml_util.c - GPU and per-process utilization from the node's kernel
 * timeline (state_timeline.c).
 *
 * nvmlDeviceGetUtilizationRates: percent of the last second during which a
 * kernel ran (memory utilization is 0).
 *
 * Per-process samples: the driver samples every SAMPLE_NS (100 ms, or
 * GPUVISOR_SIM_NVML_SAMPLE_MS: an H200 sampled every 200 ms) on a fixed grid
 * of CLOCK_MONOTONIC; a sample's timestamp is the CPU time (us since the
 * epoch) of its end, and only complete samples exist.  A query returns
 * one entry per process that ran kernels in the samples newer than
 * lastSeenTimeStamp (at most the last HISTORY_NS, and only as far back as
 * the timeline still holds): smUtil = percent of those samples' time that
 * the process's kernels ran, timeStamp = the newest sample's.
 *
 * GPUVISOR_SIM_NVML_PUBLISH_MS=N: a process's samples are published only
 * d ms after they end, d from 0 to N fixed per process (drawn from its
 * PID), so the processes' samples of one period appear at different times,
 * as a real driver's did (docs/simulator.md): a reader that asks from the
 * newest timestamp of anyone's then misses the samples published later.
 *
 * GPUVISOR_SIM_NVML_PER_SAMPLE=1: one entry per process and sample.
 *
 * GPUVISOR_SIM_NVML_UTIL_MS=N: each per-process query takes N ms (it
 * sleeps, then reads the samples), as the real query can take
 * milliseconds: whatever calls it waits that long.
 *
 * GPUVISOR_SIM_NVML_NOISE=N: each per-process sample's smUtil is off by a
 * whole number from -N to +N (fixed per process and sample, clamped to
 * 0-100; an answer over several samples takes its newest one's), as an
 * H200's per-process samples spread by 9-21 points (sd) while two
 * processes took turns on it.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sim.h"

#define NS_PER_US 1000ULL
#define NS_PER_S 1000000000ULL
#define SAMPLE_MS_DEFAULT 100ULL
#define SAMPLE_MS_MIN 10ULL
#define SAMPLE_MS_MAX 1000ULL

/* Longer than the history kept (HISTORY_NS) publishes nothing, and the
 * delay's arithmetic in ns would overflow far beyond it. */
#define PUBLISH_MS_MAX 10000ULL
#define QUERY_MS_MAX 10000ULL

/* The knobs above, read together at the first query that needs one. */
static struct {
    uint64_t sample_ns;                 /* GPUVISOR_SIM_NVML_SAMPLE_MS, in ns */
    unsigned long long publish_ms;      /* GPUVISOR_SIM_NVML_PUBLISH_MS */
    unsigned long long query_ms;        /* GPUVISOR_SIM_NVML_UTIL_MS */
    unsigned long long noise;           /* GPUVISOR_SIM_NVML_NOISE, points */
    /* GPUVISOR_SIM_NVML_PER_SAMPLE=1: one entry per process and sample
     * (each with that sample's utilisation and timestamp) instead of one
     * per process over all the samples asked for. */
    int per_sample;
} knobs;
static pthread_once_t knobs_once = PTHREAD_ONCE_INIT;

static void read_knobs(void)
{
    knobs.sample_ns = sim_knob_range("GPUVISOR_SIM_NVML_SAMPLE_MS", SAMPLE_MS_MIN,
                                     SAMPLE_MS_MAX, SAMPLE_MS_DEFAULT) * 1000000ULL;
    knobs.publish_ms = sim_knob_range("GPUVISOR_SIM_NVML_PUBLISH_MS", 1, PUBLISH_MS_MAX, 0);
    knobs.query_ms = sim_knob_range("GPUVISOR_SIM_NVML_UTIL_MS", 1, QUERY_MS_MAX, 0);
    knobs.noise = sim_knob_range("GPUVISOR_SIM_NVML_NOISE", 1, 100, 0);
    const char *v = getenv("GPUVISOR_SIM_NVML_PER_SAMPLE");
    if (!v || !*v || !strcmp(v, "0"))
        return;
    if (!strcmp(v, "1"))
        knobs.per_sample = 1;
    else
        sim_log("GPUVISOR_SIM_NVML_PER_SAMPLE=%s is not 0 or 1; ignored", v);
}

#define KNOBS (pthread_once(&knobs_once, read_knobs), &knobs)

/* The per-process sampling period (GPUVISOR_SIM_NVML_SAMPLE_MS; 100 ms). */
static uint64_t sample_ns(void) { return KNOBS->sample_ns; }
#define SAMPLE_NS sample_ns()
#define HISTORY_NS (10ULL * NS_PER_S)
#define UTIL_WINDOW_NS NS_PER_S
#define MAX_PIDS 256

static uint64_t overlap(const sim_interval *e, uint64_t lo, uint64_t hi)
{
    uint64_t a = e->start > lo ? e->start : lo;
    uint64_t b = e->end < hi ? e->end : hi;
    return b > a ? b - a : 0;
}

static unsigned pct(uint64_t part, uint64_t whole)
{
    if (!whole)
        return 0;
    uint64_t p = (part * 100 + whole / 2) / whole;
    return p > 100 ? 100 : (unsigned)p;
}

/* A per-process sample's smUtil as the driver reports it: sm, or with
 * GPUVISOR_SIM_NVML_NOISE off by -N..+N, drawn from the process and the
 * sample's index k (the same answer every time that sample is read). */
static unsigned reported(unsigned pid, uint64_t k, unsigned sm)
{
    unsigned long long n = KNOBS->noise;
    if (!n)
        return sm;
    uint64_t h = (uint64_t)pid * 0x9E3779B97F4A7C15ULL ^ k * 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 31;
    h *= 0x94D049BB133111EBULL;
    h ^= h >> 29;
    long long v = (long long)sm + (long long)(h % (2 * n + 1)) - (long long)n;
    return v < 0 ? 0 : v > 100 ? 100 : (unsigned)v;
}

SIM_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev,
                                                   nvmlUtilization_t *u)
{
    NVML_ENTRY("nvmlDeviceGetUtilizationRates");
    int node = sim_nvml_node(dev);
    if (node < 0 || !u)
        return NVML_ERROR_INVALID_ARGUMENT;
    sim_interval *iv = malloc(SIM_TL_RING * sizeof *iv);
    if (!iv)
        return NVML_ERROR_MEMORY;
    uint64_t now = sim_now_ns();
    uint64_t lo = now > UTIL_WINDOW_NS ? now - UTIL_WINDOW_NS : 0, known;
    int n = sim_tl_history(node, lo, iv, SIM_TL_RING, &known);
    if (known > lo && known < now)
        lo = known;                     /* the ring wrapped: what is known */
    /* Time-slicing mode: the device's own busy time is kept under pid 0
     * (processes' intervals overlap there). */
    int ts = sim_ts_us() != 0;
    uint64_t busy = 0;
    for (int i = 0; i < n; i++)
        if (!ts || iv[i].pid == 0)
            busy += overlap(&iv[i], lo, now);
    free(iv);
    u->gpu = pct(busy, now - lo);
    u->memory = 0;
    return NVML_SUCCESS;
}

/* How long after its end a sample of pid is published. */
static uint64_t publish_delay_ns(unsigned pid)
{
    unsigned long long publish_ms = KNOBS->publish_ms;
    if (!publish_ms)
        return 0;
    uint64_t h = (uint64_t)pid * 0x9e3779b97f4a7c15ULL;
    h ^= h >> 29;
    return h % (publish_ms * 1000) * 1000;
}

/* The end of pid's newest published sample, at most hi. */
static uint64_t published_until(unsigned pid, uint64_t now, uint64_t hi)
{
    uint64_t d = publish_delay_ns(pid);
    uint64_t until = now > d ? (now - d) / SAMPLE_NS * SAMPLE_NS : 0;
    return until < hi ? until : hi;
}

typedef struct pid_util {
    unsigned pid;
    unsigned sm;
    unsigned long long ts;
} pid_util;

/* CLOCK_REALTIME - CLOCK_MONOTONIC, ns, as this process stamps samples
 * with.  Measured between two monotonic reads (the narrowest of a few
 * tries), and kept unless it moves by more than OFFSET_STEP_NS (the
 * realtime clock was stepped): a sample's timestamp must come out the same
 * in every call, so that handing it back as lastSeenTimeStamp leaves out
 * that sample and nothing newer, whatever the jitter of one measurement. */
#define OFFSET_STEP_NS (10ULL * 1000 * 1000)
static uint64_t rt_offset(void)
{
    static _Atomic uint64_t kept;
    uint64_t best = 0, width = UINT64_MAX;
    for (int i = 0; i < 3; i++) {
        struct timespec rt;
        uint64_t m0 = sim_now_ns();
        clock_gettime(CLOCK_REALTIME, &rt);
        uint64_t m1 = sim_now_ns();
        uint64_t rt_ns = (uint64_t)rt.tv_sec * NS_PER_S + (uint64_t)rt.tv_nsec;
        if (m1 - m0 < width) {
            width = m1 - m0;
            best = rt_ns - (m0 + (m1 - m0) / 2);
        }
    }
    uint64_t k = kept;
    uint64_t d = k > best ? k - best : best - k;
    if (!k || d > OFFSET_STEP_NS) {
        kept = best;
        return best;
    }
    return k;
}

/* The time a per-process query takes (GPUVISOR_SIM_NVML_UTIL_MS). */
static void query_takes_time(void)
{
    unsigned long long query_ms = KNOBS->query_ms;
    if (query_ms)
        sim_sleep_until(sim_now_ns() + query_ms * 1000000ULL);
}

#define MAX_ENTRIES 4096

/* Entries per process and sample: pid j's busy time in each whole sample
 * of [lo, until[j]) from the intervals iv, those with any (each interval
 * spread over the samples it overlaps: one pass). */
static int per_sample_entries(const sim_interval *iv, int n, const unsigned *pids,
                              const uint64_t *until, int np, uint64_t lo,
                              uint64_t mono_to_rt, pid_util *out)
{
    uint64_t S = SAMPLE_NS, k0 = (lo + S - 1) / S;     /* whole samples only */
    uint64_t k1 = k0;                                   /* past the last one */
    for (int j = 0; j < np; j++)
        if (until[j] / S > k1)
            k1 = until[j] / S;
    size_t ns = (size_t)(k1 - k0);
    if (!np || !ns)
        return 0;
    uint64_t *busy = calloc((size_t)np * ns, sizeof *busy);
    if (!busy)
        return 0;
    for (int i = 0; i < n; i++) {
        int j = 0;
        while (j < np && pids[j] != (unsigned)iv[i].pid)
            j++;
        if (j == np)
            continue;
        uint64_t a = iv[i].start > k0 * S ? iv[i].start : k0 * S;
        uint64_t z = iv[i].end < until[j] ? iv[i].end : until[j];
        for (uint64_t k = a / S; a < z && k < k1; k++) {
            uint64_t to = (k + 1) * S < z ? (k + 1) * S : z;
            busy[(size_t)j * ns + (k - k0)] += to - a;
            a = to;
        }
    }
    int nout = 0;
    for (int j = 0; j < np; j++)
        for (uint64_t k = k0; k < k1 && (k + 1) * S <= until[j] && nout < MAX_ENTRIES; k++) {
            uint64_t b = busy[(size_t)j * ns + (k - k0)];
            if (!b)
                continue;
            out[nout].pid = pids[j];
            out[nout].sm = reported(pids[j], k, pct(b, S));
            out[nout++].ts = ((k + 1) * S + mono_to_rt) / NS_PER_US;
        }
    free(busy);
    return nout;
}

/* one entry per pid that ran in the samples newer than last_seen (or one
 * per pid and sample: GPUVISOR_SIM_NVML_PER_SAMPLE); out holds MAX_ENTRIES */
static nvmlReturn_t proc_samples(int node, unsigned long long last_seen,
                                 pid_util *out, int *nout)
{
    *nout = 0;
    uint64_t now = sim_now_ns();
    uint64_t mono_to_rt = rt_offset();
    /* complete samples: [k*S, (k+1)*S) with (k+1)*S <= now */
    uint64_t hi = now / SAMPLE_NS * SAMPLE_NS;
    uint64_t lo = hi > HISTORY_NS ? hi - HISTORY_NS : 0;
    /* Only samples whose timestamp, (end + mono_to_rt) / 1000, is greater
     * than last_seen: end >= (last_seen + 1) * 1000 - mono_to_rt. */
    if (last_seen >= UINT64_MAX / NS_PER_US - 1)
        return NVML_SUCCESS;            /* none, ever */
    uint64_t need = (last_seen + 1) * NS_PER_US;
    if (need > mono_to_rt) {
        uint64_t end = sim_round_up(need - mono_to_rt, SAMPLE_NS);
        if (end - SAMPLE_NS > lo)
            lo = end - SAMPLE_NS;       /* the start of the first such sample */
    }
    sim_interval *iv = malloc(SIM_TL_RING * sizeof *iv);
    if (!iv)
        return NVML_ERROR_MEMORY;
    uint64_t known;
    int n = sim_tl_history(node, lo, iv, SIM_TL_RING, &known);
    if (known > lo)
        lo = (known + SAMPLE_NS - 1) / SAMPLE_NS * SAMPLE_NS;
    if (lo >= hi) {
        free(iv);
        return NVML_SUCCESS;
    }
    uint64_t busy[MAX_PIDS], until[MAX_PIDS];
    unsigned pids[MAX_PIDS];
    int np = 0;
    for (int i = 0; i < n; i++) {
        unsigned pid = (unsigned)iv[i].pid;
        if (!pid)
            continue;                   /* the device's own busy time */
        int j;
        for (j = 0; j < np && pids[j] != pid; j++)
            ;
        uint64_t top = j < np ? until[j] : published_until(pid, now, hi);
        uint64_t b = overlap(&iv[i], lo, top);
        if (!b)
            continue;
        if (j == np) {
            if (np == MAX_PIDS)
                continue;
            pids[np] = pid;
            until[np] = top;
            busy[np++] = 0;
        }
        busy[j] += b;
    }
    if (KNOBS->per_sample) {
        *nout = per_sample_entries(iv, n, pids, until, np, lo, mono_to_rt, out);
        free(iv);
        return NVML_SUCCESS;
    }
    free(iv);
    for (int j = 0; j < np; j++) {
        out[j].pid = pids[j];
        out[j].sm = reported(pids[j], until[j] / SAMPLE_NS, pct(busy[j], until[j] - lo));
        out[j].ts = (until[j] + mono_to_rt) / NS_PER_US;
    }
    *nout = np;
    return NVML_SUCCESS;
}

SIM_API nvmlReturn_t nvmlDeviceGetProcessUtilization(
    nvmlDevice_t dev, nvmlProcessUtilizationSample_t *util,
    unsigned int *count, unsigned long long last_seen)
{
    NVML_ENTRY("nvmlDeviceGetProcessUtilization");
    int node = sim_nvml_node(dev);
    if (node < 0 || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    query_takes_time();
    pid_util *s = malloc(MAX_ENTRIES * sizeof *s);
    if (!s)
        return NVML_ERROR_MEMORY;
    int n;
    nvmlReturn_t rc = proc_samples(node, last_seen, s, &n);
    if (rc) {
        free(s);
        return rc;
    }
    if (!n) {
        *count = 0;
        rc = NVML_ERROR_NOT_FOUND;
    } else if (!util || *count < (unsigned)n) {
        *count = (unsigned)n;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (int i = 0; i < n; i++) {
            util[i].pid = sim_nvml_pid(s[i].pid);
            util[i].timeStamp = s[i].ts;
            util[i].smUtil = s[i].sm;
            util[i].memUtil = 0;
            util[i].encUtil = 0;
            util[i].decUtil = 0;
        }
        *count = (unsigned)n;
    }
    free(s);
    return rc;
}

SIM_API nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(
    nvmlDevice_t dev, nvmlProcessesUtilizationInfo_t *info)
{
    NVML_ENTRY("nvmlDeviceGetProcessesUtilizationInfo");
    int node = sim_nvml_node(dev);
    if (node < 0 || !info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlProcessesUtilizationInfo_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    query_takes_time();
    pid_util *s = malloc(MAX_ENTRIES * sizeof *s);
    if (!s)
        return NVML_ERROR_MEMORY;
    int n;
    nvmlReturn_t rc = proc_samples(node, info->lastSeenTimeStamp, s, &n);
    if (rc) {
        free(s);
        return rc;
    }
    if (!n) {
        info->processSamplesCount = 0;
        rc = NVML_ERROR_NOT_FOUND;
    } else if (!info->procUtilArray || info->processSamplesCount < (unsigned)n) {
        info->processSamplesCount = (unsigned)n;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (int i = 0; i < n; i++) {
            nvmlProcessUtilizationInfo_v1_t *p = &info->procUtilArray[i];
            p->timeStamp = s[i].ts;
            p->pid = sim_nvml_pid(s[i].pid);
            p->smUtil = s[i].sm;
            p->memUtil = p->encUtil = p->decUtil = p->jpgUtil = p->ofaUtil = 0;
        }
        info->processSamplesCount = (unsigned)n;
    }
    free(s);
    return rc;
}
