/*
 * t_sm_calib - unit tests of the SM meter's calibration against NVML
 * (native/shim/sm_calib.c, linked alone).
 *
 * A synthetic process runs kernels of 20 us to 20 ms (log-uniform, so many
 * straddle NVML's 100 ms samples) at about 40 % of the device.  Its events
 * measure each kernel's length times an overcount factor (events that also
 * bracket other processes' kernels), and the meter reports each one 50 us
 * after it ended.  NVML's per-process samples are made the way the driver
 * makes them: the exact busy time of each 100 ms sample, rounded to a whole
 * percent; an answer covers the samples newer than the timestamp asked
 * with, either as one entry per process (the simulated driver) or one per
 * sample.  The calibration is asked once per sample, 1-99 ms into it.
 *
 *   t_sm_calib         prints "t_sm_calib: OK" and exits 0 when all pass
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_protos.h"   /* CHECK (counts failures in gv_test_failures) */
#include "sm.h"

#define MS 1000000ULL
#define SAMPLE (100 * MS)
#define MONO0 (1000ULL * 1000 * MS)                  /* the monotonic clock at the start */
#define REAL_OFF 1763700000000000000ULL              /* realtime - monotonic */
#define ME 4242u
#define OTHER 777u

static uint64_t rng = 88172645463325252ULL;
static double unit(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

/* The process's kernels: true intervals, back to back with idle gaps. */
#define MAXK 20000
static uint64_t ks[MAXK], ke[MAXK];
static int nk;

static void make_kernels(uint64_t until)
{
    nk = 0;
    uint64_t t = MONO0 + 3 * MS;
    while (t < until && nk < MAXK) {
        uint64_t len = (uint64_t)(20000.0 * exp(unit() * log(1000.0)));   /* 20 us .. 20 ms */
        ks[nk] = t;
        ke[nk] = t + len;
        nk++;
        t += len + len * 3 / 2;                      /* 40 % busy */
    }
}

static uint64_t busy_in(uint64_t lo, uint64_t hi)
{
    uint64_t sum = 0;
    for (int i = 0; i < nk; i++) {
        uint64_t a = ks[i] > lo ? ks[i] : lo, b = ke[i] < hi ? ke[i] : hi;
        if (b > a)
            sum += b - a;
    }
    return sum;
}

static unsigned long long us_real(uint64_t mono) { return (mono + REAL_OFF) / 1000; }

/* NVML's answer at monotonic time now for samples newer than `since`. */
static unsigned answer(nvmlProcessUtilizationSample_t *out, unsigned long long since, uint64_t now,
                       int per_sample, int me_visible, uint64_t me_lag)
{
    uint64_t since_mono = since * 1000 - REAL_OFF;
    uint64_t first = since_mono / SAMPLE * SAMPLE, last = now / SAMPLE * SAMPLE;
    if (first < MONO0)
        first = MONO0;
    unsigned n = 0;
    if (me_lag) {
        /* This process's samples are published me_lag after they end, the
         * other's at once: one entry each, over what each has published. */
        uint64_t mine = (now - me_lag) / SAMPLE * SAMPLE;
        if (last > first)
            out[n++] = (nvmlProcessUtilizationSample_t){ OTHER, us_real(last), 55, 0, 0, 0 };
        if (mine > first) {
            uint64_t b = busy_in(first, mine);
            unsigned pct = (unsigned)((b * 100 + (mine - first) / 2) / (mine - first));
            out[n++] = (nvmlProcessUtilizationSample_t){ ME, us_real(mine), pct, 0, 0, 0 };
        }
        return n;
    }
    if (last <= first)
        return 0;
    if (per_sample) {
        for (uint64_t k = first; k < last && n < 120; k += SAMPLE) {
            uint64_t b = busy_in(k, k + SAMPLE);
            unsigned pct = (unsigned)((b * 100 + SAMPLE / 2) / SAMPLE);
            if (me_visible)
                out[n++] = (nvmlProcessUtilizationSample_t){ ME, us_real(k + SAMPLE), pct, 0, 0, 0 };
            out[n++] = (nvmlProcessUtilizationSample_t){ OTHER, us_real(k + SAMPLE), 55, 0, 0, 0 };
        }
        return n;
    }
    uint64_t b = busy_in(first, last);
    unsigned pct = (unsigned)((b * 100 + (last - first) / 2) / (last - first));
    out[n++] = (nvmlProcessUtilizationSample_t){ OTHER, us_real(last), 55, 0, 0, 0 };
    if (me_visible)
        out[n++] = (nvmlProcessUtilizationSample_t){ ME, us_real(last), pct, 0, 0, 0 };
    return n;
}

struct run { double over; int per_sample, me_visible, skip_every; uint64_t me_lag; };

/* Feed the calibration of device dev for secs; returns the ratio's range
 * over the updates from 2.5 s on through min/max. */
static void feed(int dev, struct run r, double secs, double *min, double *max)
{
    uint64_t end = MONO0 + (uint64_t)(secs * 1e9);
    make_kernels(end);
    *min = 1e9;
    *max = -1e9;
    int next_k = 0, call = 0;
    for (uint64_t grid = MONO0; grid < end; grid += SAMPLE) {
        /* asked anywhere in the sample: right after one ends, a kernel
         * that straddles its end has not been reported yet */
        uint64_t now = grid + (uint64_t)(1 + unit() * 98) * MS;
        /* the meter reports every kernel 50 us after it ended */
        for (; next_k < nk && ke[next_k] + 50000 <= now; next_k++) {
            uint64_t len = ke[next_k] - ks[next_k];
            gv_cal_record(dev, ke[next_k] + 50000, (uint64_t)((double)len * r.over));
        }
        if (r.skip_every && ++call % r.skip_every == 0)
            continue;                                /* a late meter: two samples at once */
        uint64_t real_ns = now + REAL_OFF;
        unsigned long long since = gv_cal_since(dev, real_ns);
        nvmlProcessUtilizationSample_t s[256];
        unsigned n = answer(s, since, now, r.per_sample, r.me_visible, r.me_lag);
        gv_cal_update(dev, since, s, n, ME, real_ns, now);
        if (now >= MONO0 + 2500 * MS) {
            double v = gv_cal_ratio(dev);
            *min = v < *min ? v : *min;
            *max = v > *max ? v : *max;
        }
    }
}

int main(void)
{
    double lo, hi;

    /* Events exact: the ratio stays at 1 within 1 %, long kernels at the
     * samples' edges included, and nothing is scaled at 1 or above. */
    gv_cal_reset();
    feed(0, (struct run){ 1.0, 0, 1, 0, 0 }, 8, &lo, &hi);
    CHECK(lo >= 0.99 && hi <= 1.01, "exact events: ratio %.4f..%.4f", lo, hi);
    CHECK(gv_cal_scale(0, 1000000) >= 990000, "exact events: 1 ms scaled to %llu",
          (unsigned long long)gv_cal_scale(0, 1000000));

    /* Events that overcount by 25 %: scaled back to the process's own. */
    gv_cal_reset();
    feed(1, (struct run){ 1.25, 0, 1, 0, 0 }, 8, &lo, &hi);
    CHECK(lo >= 0.79 && hi <= 0.81, "25 %% overcount: ratio %.4f..%.4f", lo, hi);
    uint64_t scaled = gv_cal_scale(1, 1250000);
    CHECK(scaled >= 987500 && scaled <= 1012500, "25 %% overcount: 1.25 ms scaled to %llu",
          (unsigned long long)scaled);

    /* One entry per sample (and per process) instead of one per process. */
    gv_cal_reset();
    feed(2, (struct run){ 1.1, 1, 1, 0, 0 }, 8, &lo, &hi);
    CHECK(lo >= 1 / 1.1 - 0.01 && hi <= 1 / 1.1 + 0.01, "per-sample answers: ratio %.4f..%.4f",
          lo, hi);

    /* A meter late now and then: answers covering two samples. */
    gv_cal_reset();
    feed(3, (struct run){ 1.0, 0, 1, 3, 0 }, 8, &lo, &hi);
    CHECK(lo >= 0.99 && hi <= 1.01, "late answers: ratio %.4f..%.4f", lo, hi);

    /* This process's samples published 60 ms after another's (the driver
     * does not publish every process's sample of a period at once): none
     * of its own is lost, so the ratio is what it is with exact events.
     * Asking from the newest of anyone's timestamps lost the samples that
     * came late: the ratio fell to 0.44-0.64. */
    gv_cal_reset();
    feed(7, (struct run){ 1.0, 0, 1, 0, 60 * MS }, 8, &lo, &hi);
    CHECK(lo >= 0.98 && hi <= 1.02, "own samples published late: ratio %.4f..%.4f", lo, hi);

    /* Idle for a minute after 3 s of work: the next query starts no more
     * than the 2 s compared back (it used to start at the process's own
     * newest sample, however old, and an answer of one entry per sample
     * could then outgrow the meter's buffer and freeze the ratio). */
    gv_cal_reset();
    feed(8, (struct run){ 1.0, 0, 1, 0, 0 }, 3, &lo, &hi);
    uint64_t later = REAL_OFF + MONO0 + 63000 * MS;
    unsigned long long from = gv_cal_since(8, later);
    CHECK(from * 1000 >= later - 2000 * MS && from * 1000 <= later,
          "after a minute idle: asked from %.3f s back", (double)(later - from * 1000) / 1e9);

    /* NVML does not list this PID (another PID namespace): no change. */
    gv_cal_reset();
    feed(4, (struct run){ 1.25, 0, 0, 0, 0 }, 5, &lo, &hi);
    CHECK(lo == 1.0 && hi == 1.0, "PID not visible: ratio %.4f..%.4f", lo, hi);
    CHECK(gv_cal_scale(4, 1250000) == 1250000, "PID not visible: scaled");

    /* An answer to another timestamp than the one asked for is ignored;
     * devices are separate; reset forgets; bad indexes are harmless. */
    gv_cal_reset();
    feed(5, (struct run){ 1.25, 0, 1, 0, 0 }, 5, &lo, &hi);
    CHECK(fabs(gv_cal_ratio(5) - 0.8) < 0.01, "device 5: %.4f", gv_cal_ratio(5));
    CHECK(gv_cal_ratio(6) == 1.0, "device 6 untouched: %.4f", gv_cal_ratio(6));
    gv_cal_record(-1, MONO0, 1000);
    gv_cal_record(GV_MAX_DEVICES, MONO0, 1000);
    gv_cal_update(-1, 0, NULL, 0, ME, REAL_OFF + MONO0, MONO0);
    CHECK(gv_cal_ratio(-1) == 1.0 && gv_cal_scale(GV_MAX_DEVICES, 7) == 7, "bad device index");
    gv_cal_reset();
    CHECK(gv_cal_ratio(5) == 1.0, "after reset: %.4f", gv_cal_ratio(5));

    if (gv_test_failures) {
        fprintf(stderr, "t_sm_calib: %d checks failed\n", gv_test_failures);
        return 1;
    }
    printf("t_sm_calib: OK\n");
    return 0;
}
