/*
 * bench_launch.c - what an interposer adds per kernel launch (make bench,
 * and the per-launch cost of make bench-sm).
 *
 * The launches, each measured by the harness in bench_common.h (a process
 * linked with -lcuda, the interposer preloaded or not, helpers of the same
 * container beside it; wall time and callgrind instructions): `spin`
 * kernels of 0 us on a non-blocking stream, so the device never falls
 * behind and the simulator's 1024-deep launch queue never fills; the
 * stream is synchronized every 500 launches (inside the timing).
 *   make bench:    no SM limit, and CUDA_DEVICE_SM_LIMIT=50, at 1, 8, 64
 *                  processes;
 *   make bench-sm (--sm-cost first): no SM limit, 100 % (every launch goes
 *                  through the gate, which never sleeps), and a limit set
 *                  to 100 and lifted live (libgpuvisor only), one process.
 */
#include <dlfcn.h>

#include "gv_cuda.h"

#include "bench_common.h"

#define SYNC_EVERY 500

static CUfunction spin;
static CUstream stream;

static void launch_setup(void)
{
    CUmodule m;
    check(cuModuleLoadData(&m, "bench module"), "cuModuleLoadData");
    check(cuModuleGetFunction(&spin, m, "spin"), "cuModuleGetFunction");
    check(cuStreamCreate(&stream, 0x1 /* non-blocking */), "cuStreamCreate");
}

static void launch(long i)
{
    static uint32_t us = 0;
    void *params[] = { &us };
    check(cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, stream, params, NULL), "cuLaunchKernel");
    if ((i + 1) % SYNC_EVERY == 0)
        check(cuStreamSynchronize(stream), "cuStreamSynchronize");
}

/* libgpuvisor's limit set live to 100 %, 10 launches through the gate, then
 * lifted (0): the path of a container whose limit was removed.  Direct: the
 * plain launch path. */
static void lifted_setup(void)
{
    launch_setup();
    int (*set_sm)(int, uint32_t) = (int (*)(int, uint32_t))ours_sym("gv_device_set_sm_limit");
    if (!set_sm)
        return;
    if (set_sm(0, 100) != 0)
        die("gv_device_set_sm_limit(0, 100) failed");
    for (long i = 0; i < 10; i++)
        launch(i);
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    if (set_sm(0, 0) != 0)
        die("gv_device_set_sm_limit(0, 0) failed");
}

static const struct bench_op ops[] = {
    { .name = "launch", .label = "cuLaunchKernel, no SM limit", .setup = launch_setup,
      .call = launch, .goal_ns = 20, .goal_instr = 100 },
    { .name = "launch-sm50", .label = "cuLaunchKernel, SM limit 50", .sm_limit = "50",
      .setup = launch_setup, .call = launch, .goal_instr = 1000 },
    { .name = "launch-sm100", .label = "cuLaunchKernel, SM limit 100 (fixed-share)",
      .sm_limit = "100", .setup = launch_setup, .call = launch, .goal_instr = 1000 },
    { .name = "launch-lifted", .label = "cuLaunchKernel, limit lifted (0) after 100",
      .alone = 1, .ours_only = 1, .setup = lifted_setup, .call = launch },
};

static void intro(FILE *f)
{
    fprintf(f,
            "What an interposer adds per `cuLaunchKernel`: `spin` kernels of 0 us on a "
            "non-blocking stream, synchronized every %d launches (inside the timing), so the "
            "device never falls behind. With an SM limit every launch goes through the gate "
            "(pacing clock, estimate; launches back to back on one stream measured together "
            "in a segment: one event at each of its ends and one record for the meter "
            "thread, whose work counts in the instructions: all threads are counted); "
            "at 50 %% with 0 us kernels the gate may also wait its turn (the quota working), "
            "which shows in the wall time, hardly in the instructions. The simulator's launch "
            "is cheap (a process-shared lock and a few stores); a real driver's costs a few "
            "microseconds: read what the library adds.\n\n",
            SYNC_EVERY);
}

static void intro_sm(FILE *f)
{
    fprintf(f,
            "What an interposer adds per `cuLaunchKernel` on the SM-quota paths: *no SM limit* "
            "(the hooks' fast path); *SM limit 100* (fixed-share, `CUDA_DEVICE_SM_LIMIT=100`): "
            "every launch goes through the gate - pacing clock, estimate, events recorded on "
            "the stream and a record handed to the meter thread (libgpuvisor: one event at "
            "each end of a segment of launches back to back, docs/interposer.md) - and at 100 %% "
            "with 0 us kernels the gate never sleeps, so this is the gate's bookkeeping without "
            "any pacing delay; *lifted* (libgpuvisor only: the limit set live to 100 with "
            "`gv_device_set_sm_limit`, then back to 0: the region's flag that some entry once "
            "had a limit stays set, and the hooks check the process's cached answer to whether "
            "anything is gated now; direct: plain launches). `spin` kernels of 0 us on a "
            "non-blocking stream, synchronized every %d launches (inside the timing). "
            "*Other threads' CPU*: the CPU time per launch of the measuring process's other "
            "threads (the meter thread: event queries, elapsed times, settling the clock) "
            "minus direct's; it runs off the launch path.\n\n",
            SYNC_EVERY);
}

int main(int argc, char **argv)
{
    struct bench_spec spec = {
        .name = "bench_launch", .section = "## Launch: per-call cost (make bench)",
        .command = "make bench", BENCH_OPS(ops), .default_ops = "launch,launch-sm50",
        .default_procs = "1,8,64", .other_cpu_column = 1, .intro = intro,
    };
    if (argc > 1 && strcmp(argv[1], "--sm-cost") == 0) {
        /* make bench-sm's per-launch cost: the SM paths, one process */
        spec.section = "## SM quota: per-launch cost (make bench-sm)";
        spec.command = "make bench-sm";
        spec.flags = "--sm-cost";
        spec.default_ops = "launch,launch-sm100,launch-lifted";
        spec.default_procs = "1";
        spec.intro = intro_sm;
        argv[1] = argv[0];
        return bench_main(argc - 1, argv + 1, &spec);
    }
    return bench_main(argc, argv, &spec);
}
