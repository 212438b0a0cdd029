/* region_test.h - small helpers shared by the t_region_* tests. */
#ifndef GV_REGION_TEST_H
#define GV_REGION_TEST_H

#include "gpuvisor.h"
#include "region.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            fflush(stderr);                                                \
            _exit(1);                                                      \
        }                                                                  \
    } while (0)

#define CHECK_EQ(a, b)                                                     \
    do {                                                                   \
        long long a_ = (long long)(a), b_ = (long long)(b);                \
        if (a_ != b_) {                                                    \
            fprintf(stderr, "%s:%d: CHECK failed: %s == %s (%lld != %lld)\n", \
                    __FILE__, __LINE__, #a, #b, a_, b_);                   \
            fflush(stderr);                                                \
            _exit(1);                                                      \
        }                                                                  \
    } while (0)

static inline uint64_t t_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static inline uint64_t t_rand(uint64_t *s)
{
    uint64_t x = *s ? *s : 0x2545F4914F6CDD1DULL;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

/* Memory shared with forked children (zeroed). */
static inline void *t_shared(size_t n)
{
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED);
    return p;
}

/* Open a fresh region at path (removing any old file). */
static inline gv_region *t_fresh_region(const char *path)
{
    char err[256] = "";
    gv_region *r = NULL;
    unlink(path);
    int rc = region_open(path, &r, err, sizeof err);
    if (rc != 0)
        fprintf(stderr, "region_open(%s): %d %s\n", path, rc, err);
    CHECK(rc == 0 && r != NULL);
    return r;
}

static inline gv_region *t_open_region(const char *path)
{
    char err[256] = "";
    gv_region *r = NULL;
    int rc = region_open(path, &r, err, sizeof err);
    if (rc != 0)
        fprintf(stderr, "region_open(%s): %d %s\n", path, rc, err);
    CHECK(rc == 0 && r != NULL);
    return r;
}

static inline void t_uuid(unsigned char u[16], int k)
{
    for (int i = 0; i < 16; i++)
        u[i] = (unsigned char)(0xA0 + i * 7 + k * 31);
}

/* "--name value" integer option, or def. */
static inline long t_opt(int argc, char **argv, const char *name, long def)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return strtol(argv[i + 1], NULL, 10);
    return def;
}

static inline int t_flag(int argc, char **argv, const char *name)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return 1;
    return 0;
}

#endif /* GV_REGION_TEST_H */
