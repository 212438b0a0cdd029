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

#endif /* GV_SIM_TEST_H */
