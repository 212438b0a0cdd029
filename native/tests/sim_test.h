/*
 * sim_test.h - what the simulator's C tests (t_sim_basic.c,
 * t_sim_timeline.c) share: the dlopen'ed driver, the scratch state file
 * removed at exit, and the CHECK / CU / OK assertions.  Included after the
 * test's system headers and gv_cuda.h.
 */
#ifndef GV_SIM_TEST_H
#define GV_SIM_TEST_H

static const char *g_lib = "build/sim/libcuda.so.1";
static char g_state[256];
static void *g_h;
static pid_t g_main_pid;

static void cleanup(void)
{
    if (getpid() == g_main_pid)
        unlink(g_state);
}

#define CHECK(c)                                                        \
    do {                                                                \
        if (!(c)) {                                                     \
            printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #c);         \
            fflush(stdout);                                             \
            exit(1);                                                    \
        }                                                               \
    } while (0)

#define CU(call, want)                                                  \
    do {                                                                \
        CUresult r_ = (call);                                           \
        if (r_ != (want)) {                                             \
            printf("FAIL %s:%d: %s = %d, want %d\n", __FILE__, __LINE__, \
                   #call, r_, (int)(want));                             \
            fflush(stdout);                                             \
            exit(1);                                                    \
        }                                                               \
    } while (0)
#define OK(call) CU(call, CUDA_SUCCESS)

static void *sym(const char *n)
{
    void *p = dlsym(g_h, n);
    if (!p) {
        printf("FAIL missing symbol %s\n", n);
        exit(1);
    }
    return p;
}

/* The driver under test: argv[1], else $GV_SIM_LIBCUDA, else the build's. */
static void sim_test_lib(int argc, char **argv)
{
    if (argc > 1)
        g_lib = argv[1];
    else if (getenv("GV_SIM_LIBCUDA"))
        g_lib = getenv("GV_SIM_LIBCUDA");
}

/* dlopens the driver into g_h, or fails the test. */
static void sim_test_open(void)
{
    g_h = dlopen(g_lib, RTLD_NOW | RTLD_LOCAL);
    if (!g_h) {
        printf("FAIL dlopen %s: %s\n", g_lib, dlerror());
        exit(1);
    }
}

/* Points GPUVISOR_SIM_STATE at a scratch file gv-t-<name>-<pid>.state in
 * $TMPDIR, which this (main) process removes at exit. */
static void sim_test_state(const char *name)
{
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(g_state, sizeof g_state, "%s/gv-t-%s-%d.state", tmp, name, (int)getpid());
    setenv("GPUVISOR_SIM_STATE", g_state, 1);
    g_main_pid = getpid();
    atexit(cleanup);
}

#endif /* GV_SIM_TEST_H */
