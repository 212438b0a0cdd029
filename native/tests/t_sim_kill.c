/*
 * t_sim_kill.c - crash safety of the simulator's shared state.
 *
 * Worker processes spin in tight alloc/free/meminfo loops (so most of
 * their time is inside the driver, often holding the state lock) and are
 * SIGKILLed at random moments, then replaced.  Afterwards a fresh process
 * must get the lock (no deadlock: alarm) and see exactly zero usage left
 * by the dead.
 *
 * usage: t_sim_kill [path/to/libcuda.so.1] [rounds]
 * Prints "OK" and exits 0, or the failing check and exits 1.
 */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gv_cuda.h"

#define MIB (1024ULL * 1024ULL)
#define WORKERS 4

typedef CUresult (*init_t)(unsigned);
typedef CUresult (*ctx_t)(CUcontext *, unsigned, CUdevice);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*free_t)(CUdeviceptr);
typedef CUresult (*info_t)(size_t *, size_t *);

static const char *g_lib = "build/sim/libcuda.so.1";
static char g_state[256];
static init_t p_init;
static ctx_t p_ctx;
static alloc_t p_alloc;
static free_t p_free;
static info_t p_info;

static void load(void)
{
    void *h = dlopen(g_lib, RTLD_NOW);
    if (!h) {
        printf("FAIL dlopen %s: %s\n", g_lib, dlerror());
        exit(1);
    }
    *(void **)&p_init = dlsym(h, "cuInit");
    *(void **)&p_ctx = dlsym(h, "cuCtxCreate_v2");
    *(void **)&p_alloc = dlsym(h, "cuMemAlloc_v2");
    *(void **)&p_free = dlsym(h, "cuMemFree_v2");
    *(void **)&p_info = dlsym(h, "cuMemGetInfo_v2");
    if (!p_init || !p_ctx || !p_alloc || !p_free || !p_info) {
        printf("FAIL missing symbols\n");
        exit(1);
    }
}

static void worker(void)
{
    load();
    CUcontext c;
    if (p_init(0))
        _exit(2);
    while (p_ctx(&c, 0, 0) != CUDA_SUCCESS)   /* full device: others hold it */
        usleep(500);
    CUdeviceptr live[16];
    size_t f, t;
    for (unsigned i = 0;; i++) {
        int n = 0;
        while (n < 16 && p_alloc(&live[n], (1 + i % 5) * MIB) == CUDA_SUCCESS)
            n++;
        p_info(&f, &t);
        while (n--)
            p_free(live[n]);
    }
}

static pid_t spawn(void)
{
    pid_t p = fork();
    if (p == 0)
        worker();
    return p;
}

static void sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

int main(int argc, char **argv)
{
    int rounds = 60;
    if (argc > 1)
        g_lib = argv[1];
    else if (getenv("GV_SIM_LIBCUDA"))
        g_lib = getenv("GV_SIM_LIBCUDA");
    if (argc > 2)
        rounds = atoi(argv[2]);
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(g_state, sizeof g_state, "%s/gv-t-sim-kill-%d.state", tmp,
             (int)getpid());
    setenv("GPUVISOR_SIM_STATE", g_state, 1);
    setenv("GPUVISOR_SIM_DEVICES", "256m", 1);
    unsetenv("CUDA_VISIBLE_DEVICES");
    unsetenv("GPUVISOR_SIM_FAIL_ALLOC_AT");
    unsetenv("GPUVISOR_SIM_FAIL_ALLOC_EVERY");
    srand((unsigned)getpid());

    pid_t w[WORKERS];
    for (int i = 0; i < WORKERS; i++)
        w[i] = spawn();
    sleep_us(20000);
    for (int r = 0; r < rounds; r++) {
        int i = rand() % WORKERS;
        sleep_us(rand() % 5000);
        kill(w[i], SIGKILL);
        int st;
        waitpid(w[i], &st, 0);
        if (!WIFSIGNALED(st)) {
            printf("FAIL worker exited with status %d before the kill\n",
                   WEXITSTATUS(st));
            unlink(g_state);
            return 1;
        }
        w[i] = spawn();
    }
    for (int i = 0; i < WORKERS; i++) {
        kill(w[i], SIGKILL);
        waitpid(w[i], NULL, 0);
    }

    alarm(20);                          /* a lost lock would hang here */
    load();
    CUcontext c;
    size_t f = 0, t = 0;
    int ok = p_init(0) == CUDA_SUCCESS && p_ctx(&c, 0, 0) == CUDA_SUCCESS &&
             p_info(&f, &t) == CUDA_SUCCESS;
    unlink(g_state);
    if (!ok || t != 256 * MIB || f != t - 32 * MIB) {
        printf("FAIL after %d kills: free %zu total %zu (want %llu)\n", rounds,
               f, t, (unsigned long long)(t - 32 * MIB));
        return 1;
    }
    printf("OK\n");
    return 0;
}
