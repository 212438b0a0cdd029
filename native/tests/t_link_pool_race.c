/*
 * t_link_pool_race.c - a stream-ordered free of a pool's block racing the
 * destruction of that pool (test_race_kill.py).
 *
 *   t_link_pool_race ROUNDS [async|sync]
 *
 * Each round makes a pool with two 64 MiB blocks A and B; then one thread
 * frees A (cuMemFreeAsync, or cuMemFree_v2 with "sync") while another
 * destroys the pool, both released
 * by one barrier, the free after a varying spin so that the two meet at
 * every point of each other's path.  B is still allocated after both, so
 * the driver still holds the pool's memory for it: so must the quota, and
 * the used memory cuMemGetInfo shows may not drop below what it was
 * before the round plus B.  Freeing B then gives everything back.
 *
 * Prints "rounds=N low=L leaked=K" and exits 0 when no round went low or
 * leaked, 1 otherwise, 2 on a driver error.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "cuda_protos.h"

CUresult cuMemPoolDestroy(CUmemoryPool);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);

#define BLOCK ((size_t)64 << 20)

static pthread_barrier_t go;
static CUcontext ctx;
static CUstream stream;
static CUmemoryPool pool;
static CUdeviceptr block_a;
static unsigned spin;
static int sync_free;
static CUresult free_rc, destroy_rc;

static size_t used(void)
{
    size_t free_b = 0, total = 0;
    if (cuMemGetInfo_v2(&free_b, &total) != CUDA_SUCCESS) {
        fprintf(stderr, "cuMemGetInfo_v2 failed\n");
        exit(2);
    }
    return total - free_b;
}

static void *freer(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(ctx);
    pthread_barrier_wait(&go);
    for (volatile unsigned i = 0; i < spin; i++)
        ;
    free_rc = sync_free ? cuMemFree_v2(block_a) : cuMemFreeAsync(block_a, stream);
    return NULL;
}

static void *destroyer(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(ctx);
    pthread_barrier_wait(&go);
    destroy_rc = cuMemPoolDestroy(pool);
    return NULL;
}

#define MUST(call)                                                           \
    do {                                                                     \
        CUresult rc_ = (call);                                               \
        if (rc_ != CUDA_SUCCESS) {                                           \
            fprintf(stderr, "%s returned %d\n", #call, (int)rc_);            \
            exit(2);                                                         \
        }                                                                    \
    } while (0)

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 500;
    sync_free = argc > 2 && strcmp(argv[2], "sync") == 0;
    MUST(gv_test_primary_ctx(0, &ctx));
    MUST(cuStreamCreate(&stream, 0));
    CUmemPoolProps props = gv_test_device_pool_props(0);
    pthread_barrier_init(&go, NULL, 2);

    int low = 0, leaked = 0;
    size_t base = used();
    for (int r = 0; r < rounds; r++) {
        CUdeviceptr block_b;
        MUST(cuMemPoolCreate(&pool, &props));
        MUST(cuMemAllocFromPoolAsync(&block_a, BLOCK, pool, stream));
        MUST(cuMemAllocFromPoolAsync(&block_b, BLOCK, pool, stream));
        MUST(cuStreamSynchronize(stream));
        spin = (unsigned)(r % 64) * 8;
        pthread_t t1, t2;
        pthread_create(&t1, NULL, freer, NULL);
        pthread_create(&t2, NULL, destroyer, NULL);
        pthread_join(t1, NULL);
        pthread_join(t2, NULL);
        MUST(free_rc);
        MUST(destroy_rc);
        MUST(cuStreamSynchronize(stream));
        size_t during = used();
        if (during < base + BLOCK) {
            if (low < 5)
                fprintf(stderr, "round %d: %zu bytes used with block B held, under %zu\n",
                        r, during, base + BLOCK);
            low++;
        }
        MUST(cuMemFreeAsync(block_b, stream));
        MUST(cuStreamSynchronize(stream));
        size_t after = used();
        if (after != base) {
            if (leaked < 5)
                fprintf(stderr, "round %d: %zu bytes used after the last free, not %zu\n",
                        r, after, base);
            leaked++;
            base = after;
        }
    }
    printf("rounds=%d low=%d leaked=%d\n", rounds, low, leaked);
    return low || leaked ? 1 : 0;
}
