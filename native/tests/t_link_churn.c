/*
 * t_link_churn.c - a CUDA workload that allocates and frees as fast as it
 * can, for the race and SIGKILL tests.
 *
 *   t_link_churn SECONDS THREADS MAX_MIB [SEED [wait]]
 *
 * Each thread makes the primary context current and loops: allocate a
 * random size (1 MiB .. MAX_MIB MiB) with cuMemAlloc_v2, keep up to four
 * blocks, free a random one.  Out-of-memory refusals are expected; any
 * other error is a failure.  Prints "ok=N oom=M" and exits 0, or exits 2.
 * Writes "ready\n" to stdout once the context exists; with "wait" it then
 * waits for a line on stdin before starting, so a test can line up many
 * processes and start them together.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_protos.h"

static double seconds;
static unsigned max_mib;
static unsigned seed0;
static CUcontext ctx;
static pthread_barrier_t ready;

struct result { unsigned long ok, oom, bad; };

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *worker(void *arg)
{
    struct result *r = arg;
    unsigned s = seed0 ^ (unsigned)(uintptr_t)arg;
    CUdeviceptr held[4] = { 0 };
    if (cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        r->bad++;
        pthread_barrier_wait(&ready);
        return NULL;
    }
    pthread_barrier_wait(&ready);
    double end = now() + seconds;
    while (now() < end) {
        int slot = (int)(rand_r(&s) % 4);
        if (held[slot]) {
            if (cuMemFree_v2(held[slot]) != CUDA_SUCCESS)
                r->bad++;
            held[slot] = 0;
        }
        size_t n = ((size_t)(rand_r(&s) % max_mib) + 1) << 20;
        CUresult rc = cuMemAlloc_v2(&held[slot], n);
        if (rc == CUDA_SUCCESS)
            r->ok++;
        else if (rc == CUDA_ERROR_OUT_OF_MEMORY)
            r->oom++, held[slot] = 0;
        else
            r->bad++, held[slot] = 0;
    }
    for (int i = 0; i < 4; i++)
        if (held[i] && cuMemFree_v2(held[i]) != CUDA_SUCCESS)
            r->bad++;
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s SECONDS THREADS MAX_MIB [SEED]\n", argv[0]);
        return 2;
    }
    seconds = atof(argv[1]);
    int threads = atoi(argv[2]);
    max_mib = (unsigned)atoi(argv[3]);
    seed0 = argc > 4 ? (unsigned)atoi(argv[4]) : (unsigned)getpid();
    if (threads < 1 || threads > 64 || max_mib < 1)
        return 2;
    CUdevice dev;
    CUresult rc = cuInit(0);
    if (rc == CUDA_SUCCESS)
        rc = cuDeviceGet(&dev, 0);
    if (rc == CUDA_SUCCESS)
        rc = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "setup failed: %d\n", rc);
        return 2;
    }
    printf("ready\n");
    fflush(stdout);
    if (argc > 5 && strcmp(argv[5], "wait") == 0) {
        char line[16];
        if (!fgets(line, sizeof line, stdin))
            return 2;
    }
    pthread_t t[64];
    struct result res[64];
    memset(res, 0, sizeof res);
    pthread_barrier_init(&ready, NULL, (unsigned)threads + 1);
    for (int i = 0; i < threads; i++)
        pthread_create(&t[i], NULL, worker, &res[i]);
    pthread_barrier_wait(&ready);
    struct result sum = { 0, 0, 0 };
    for (int i = 0; i < threads; i++) {
        pthread_join(t[i], NULL);
        sum.ok += res[i].ok;
        sum.oom += res[i].oom;
        sum.bad += res[i].bad;
    }
    cuDevicePrimaryCtxRelease_v2(dev);
    printf("ok=%lu oom=%lu bad=%lu\n", sum.ok, sum.oom, sum.bad);
    return sum.bad ? 2 : 0;
}
