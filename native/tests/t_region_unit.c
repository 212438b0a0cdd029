/*
 * t_region_unit - unit tests of the region, the limit parser and the
 * liveness helpers.
 *
 *   t_region_unit DIR          (DIR: an empty scratch directory)
 *   t_region_unit --exec-child PATH SLOT   (internal: the exec-reuse test)
 */
#include "region_test.h"
#include "region_impl.h"

#include "limits.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

#define MIB (UINT64_C(1) << 20)
#define GIB (UINT64_C(1) << 30)

static char g_dir[256];
static int g_checks;

static const char *path_in(const char *name)
{
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

/* ---- limit parser ---------------------------------------------------------- */

struct good { const char *text; uint64_t phys; uint64_t want; };
static const struct good goods[] = {
    {"1073741824", 0, GIB},
    {"1g", 0, GIB}, {"1G", 0, GIB}, {"1Gi", 0, GIB}, {"1GiB", 0, GIB},
    {"1gb", 0, GIB}, {"1gib", 0, GIB}, {"1GB", 0, GIB},
    {"  1g \t\n", 0, GIB},
    {"1k", 0, 1024}, {"1K", 0, 1024}, {"1kb", 0, 1024}, {"512m", 0, 512 * MIB},
    {"2t", 0, UINT64_C(2) << 40}, {"1TiB", 0, UINT64_C(1) << 40},
    {"1.5g", 0, GIB + GIB / 2}, {"0.5k", 0, 512}, {"1.0001k", 0, 1024},
    {"50%", 16 * GIB, 8 * GIB}, {"100%", 16 * GIB, 16 * GIB}, {"1%", 100, 1},
    {"12.5%", 8 * GIB, GIB}, {"33.3%", 1000, 333},
    {"1", 0, 1}, {"18446744073709551615", 0, UINT64_MAX},
    {"16777215t", 0, UINT64_C(16777215) << 40},
};

struct bad { const char *text; uint64_t phys; };
static const struct bad bads[] = {
    {"", 0}, {"   ", 0}, {"-1", 0}, {"-1g", 0}, {"+1g", 0}, {"0", 0}, {"0g", 0},
    {"0.0g", 0}, {"1.5.5g", 0}, {"10x", 0}, {"g", 0}, {"1e9", 0},
    {"18446744073709551616", 0}, {"16777216t", 0}, {"99999999999999999999999", 0},
    {"150%", 16 * GIB}, {"0%", 16 * GIB}, {"0.5%", 16 * GIB}, {"50%", 0},
    {"1 g", 0}, {"1gg", 0}, {"1gibb", 0}, {"1bi", 0}, {"1.5", 0}, {"1.g", 0},
    {".5g", 0}, {"1b", 0}, {"0x10", 0}, {"1%%", GIB}, {"%", GIB}, {"50 %", GIB},
    {"1.1234567%", GIB}, {"1\n2", 0}, {"1.0000000000000000001g", 0},
};

static void test_parser(void)
{
    for (size_t i = 0; i < sizeof goods / sizeof goods[0]; i++) {
        uint64_t v = 0;
        int rc = gv_parse_memory_limit(goods[i].text, goods[i].phys, &v);
        if (rc != 0 || v != goods[i].want)
            fprintf(stderr, "parse \"%s\": rc %d value %llu, want %llu\n", goods[i].text,
                    rc, (unsigned long long)v, (unsigned long long)goods[i].want);
        CHECK(rc == 0 && v == goods[i].want);
        g_checks++;
    }
    for (size_t i = 0; i < sizeof bads / sizeof bads[0]; i++) {
        uint64_t v = 12345;
        int rc = gv_parse_memory_limit(bads[i].text, bads[i].phys, &v);
        if (rc != GV_EINVAL)
            fprintf(stderr, "parse \"%s\" should fail, got rc %d value %llu\n",
                    bads[i].text, rc, (unsigned long long)v);
        CHECK_EQ(rc, GV_EINVAL);
        CHECK_EQ(v, 12345);
        g_checks++;
    }
    uint64_t v;
    CHECK_EQ(gv_parse_memory_limit(NULL, 0, &v), GV_EINVAL);
    CHECK_EQ(gv_parse_memory_limit("1g", 0, NULL), GV_EINVAL);
    printf("parser: %zu good, %zu bad values\n", sizeof goods / sizeof goods[0],
           sizeof bads / sizeof bads[0]);
}

static void clear_limit_env(void)
{
    extern char **environ;
    for (;;) {
        char name[128] = "";
        for (char **e = environ; *e != NULL; e++)
            if (strncmp(*e, GV_ENV_LIMIT, strlen(GV_ENV_LIMIT)) == 0) {
                snprintf(name, sizeof name, "%.*s", (int)strcspn(*e, "="), *e);
                break;
            }
        if (name[0] == '\0')
            return;
        unsetenv(name);
    }
}

static void test_env(void)
{
    char err[256];
    uint64_t v;
    clear_limit_env();
    CHECK_EQ(limits_memory_for_ordinal(0, GIB, &v, err, sizeof err), 0);
    CHECK(v == GV_UNLIMITED);
    CHECK_EQ(limits_check_env(err, sizeof err), 0);

    setenv("CUDA_DEVICE_MEMORY_LIMIT", "2g", 1);
    setenv("CUDA_DEVICE_MEMORY_LIMIT_1", "50%", 1);
    CHECK_EQ(limits_memory_for_ordinal(0, 8 * GIB, &v, err, sizeof err), 0);
    CHECK(v == 2 * GIB);
    CHECK_EQ(limits_memory_for_ordinal(1, 8 * GIB, &v, err, sizeof err), 0);
    CHECK(v == 4 * GIB);
    CHECK_EQ(limits_check_env(err, sizeof err), 0);
    /* A percentage without a known device size. */
    err[0] = '\0';
    CHECK_EQ(limits_memory_for_ordinal(1, 0, &v, err, sizeof err), GV_EINVAL);
    CHECK(strstr(err, "CUDA_DEVICE_MEMORY_LIMIT_1=\"50%\"") != NULL);

    setenv("CUDA_DEVICE_MEMORY_LIMIT_1", "12q", 1);
    CHECK_EQ(limits_memory_for_ordinal(1, 8 * GIB, &v, err, sizeof err), GV_EINVAL);
    CHECK(strcmp(err, "gpuvisor: CUDA_DEVICE_MEMORY_LIMIT_1=\"12q\": not a memory size "
                      "(use bytes, a number with k/m/g/t, or a percentage like 50%)") == 0);
    CHECK(strchr(err, '\n') == NULL);
    CHECK_EQ(limits_check_env(err, sizeof err), GV_EINVAL);
    CHECK(strstr(err, "CUDA_DEVICE_MEMORY_LIMIT_1=\"12q\"") != NULL);
    /* Empty per-device value falls back to the global one. */
    setenv("CUDA_DEVICE_MEMORY_LIMIT_1", "", 1);
    CHECK_EQ(limits_memory_for_ordinal(1, 8 * GIB, &v, err, sizeof err), 0);
    CHECK(v == 2 * GIB);
    CHECK_EQ(limits_check_env(err, sizeof err), 0);
    setenv("CUDA_DEVICE_MEMORY_LIMIT", "0", 1);
    CHECK_EQ(limits_memory_for_ordinal(3, 8 * GIB, &v, err, sizeof err), GV_EINVAL);
    CHECK(strstr(err, "CUDA_DEVICE_MEMORY_LIMIT=\"0\"") != NULL);
    clear_limit_env();

    static const char *badnames[] = {"CUDA_DEVICE_MEMORY_LIMIT_x", "CUDA_DEVICE_MEMORY_LIMIT_",
                                     "CUDA_DEVICE_MEMORY_LIMITS", "CUDA_DEVICE_MEMORY_LIMIT_01",
                                     "CUDA_DEVICE_MEMORY_LIMIT_1a"};
    for (size_t i = 0; i < sizeof badnames / sizeof badnames[0]; i++) {
        setenv(badnames[i], "1g", 1);
        err[0] = '\0';
        CHECK_EQ(limits_check_env(err, sizeof err), GV_EINVAL);
        CHECK(strstr(err, badnames[i]) != NULL);
        unsetenv(badnames[i]);
    }
    setenv("CUDA_DEVICE_MEMORY_LIMIT_12", "150%", 1);
    CHECK_EQ(limits_check_env(err, sizeof err), GV_EINVAL);
    setenv("CUDA_DEVICE_MEMORY_LIMIT_12", "99.5%", 1);
    CHECK_EQ(limits_check_env(err, sizeof err), 0);
    clear_limit_env();

    static const char *on[] = {"true", "1", "yes", "on", "TRUE", "Yes", " on "};
    static const char *off[] = {"false", "0", "no", "off", "", "OFF"};
    for (size_t i = 0; i < sizeof on / sizeof on[0]; i++) {
        setenv("CUDA_DISABLE_CONTROL", on[i], 1);
        CHECK_EQ(limits_control_disabled(), 1);
    }
    for (size_t i = 0; i < sizeof off / sizeof off[0]; i++) {
        setenv("CUDA_DISABLE_CONTROL", off[i], 1);
        CHECK_EQ(limits_control_disabled(), 0);
    }
    setenv("CUDA_DISABLE_CONTROL", "maybe", 1);   /* reported; fail closed */
    CHECK_EQ(limits_control_disabled(), 0);
    unsetenv("CUDA_DISABLE_CONTROL");
    CHECK_EQ(limits_control_disabled(), 0);
    printf("env: ok\n");
}

/* ---- open / corrupt files ---------------------------------------------------- */

static void write_file(const char *path, const void *data, size_t n, off_t size)
{
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    if (n > 0)
        CHECK(write(fd, data, n) == (ssize_t)n);
    if (size >= 0)
        CHECK(ftruncate(fd, size) == 0);
    close(fd);
}

static void expect_open(const char *path, int want, const char *msg)
{
    char err[512] = "";
    gv_region *r = NULL;
    int rc = region_open(path, &r, err, sizeof err);
    if (rc != want || strstr(err, msg) == NULL || strstr(err, path) == NULL)
        fprintf(stderr, "open %s: rc %d err \"%s\"; want %d and \"%s\"\n", path, rc, err,
                want, msg);
    CHECK_EQ(rc, want);
    CHECK(strstr(err, msg) != NULL && strstr(err, path) != NULL);
    CHECK(strchr(err, '\n') == NULL);
    CHECK(r == NULL);
    printf("  %s\n", err);
}

static void test_open(void)
{
    const char *p = path_in("fresh.shr");
    gv_region *r = t_fresh_region(p);
    struct stat st;
    CHECK(stat(p, &st) == 0);
    size_t size = (size_t)st.st_size;
    CHECK(size > 4096);
    CHECK(strcmp(region_path(r), p) == 0);
    gv_region *r2 = t_open_region(p);           /* reopen the existing file */
    region_close(r2);

    /* Copy the good header to forge bad ones. */
    unsigned char hdr[64];
    int fd = open(p, O_RDONLY);
    CHECK(fd >= 0 && read(fd, hdr, sizeof hdr) == (ssize_t)sizeof hdr);
    close(fd);
    region_close(r);

    printf("corrupt files:\n");
    const char *q = path_in("bad.shr");
    write_file(q, "", 0, 0);
    expect_open(q, GV_ECORRUPT, "truncated");
    write_file(q, "hello world, this is not a region file at all........", 54, -1);
    expect_open(q, GV_ECORRUPT, "bad magic 0x");
    write_file(q, hdr, sizeof hdr, -1);             /* good header, no body */
    expect_open(q, GV_ECORRUPT, "expected");
    char size_msg[96];
    write_file(q, hdr, sizeof hdr, (off_t)size - 8);
    snprintf(size_msg, sizeof size_msg, "file is %zu bytes, expected %zu (too small)",
             size - 8, size);
    expect_open(q, GV_ECORRUPT, size_msg);
    write_file(q, hdr, sizeof hdr, (off_t)size + 8);  /* grown past the region */
    snprintf(size_msg, sizeof size_msg, "file is %zu bytes, expected %zu (too large)",
             size + 8, size);
    expect_open(q, GV_ECORRUPT, size_msg);
    write_file(q, hdr, 12, -1);                      /* header cut short */
    expect_open(q, GV_ECORRUPT, "truncated header");
    unsigned char h2[64];
    memcpy(h2, hdr, sizeof h2);
    uint32_t vnext = GV_REGION_VERSION + 1;
    memcpy(h2 + 8, &vnext, 4);                       /* version */
    write_file(q, h2, sizeof h2, (off_t)size);
    char want[64];
    snprintf(want, sizeof want, "version %u, this library speaks %u", vnext, GV_REGION_VERSION);
    expect_open(q, GV_ECORRUPT, want);
    memcpy(h2, hdr, sizeof h2);
    uint32_t slots = 8;
    memcpy(h2 + 24, &slots, 4);                      /* max_slots */
    write_file(q, h2, sizeof h2, (off_t)size);
    expect_open(q, GV_ECORRUPT, "layout mismatch");
    unsigned char junk[4096];
    uint64_t seed = 42;
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (unsigned char)t_rand(&seed);
    write_file(q, junk, sizeof junk, (off_t)size);
    expect_open(q, GV_ECORRUPT, "not a gpuvisor region");
    expect_open(g_dir, GV_EIO, "Is a directory");
    expect_open(path_in("no/such/dir/r.shr"), GV_EIO, "No such file or directory");
    CHECK(chmod(q, 0) == 0);
    if (geteuid() != 0)
        expect_open(q, GV_EIO, "Permission denied");
    unlink(q);
}

/* ---- devices, reservations, limits --------------------------------------------- */

static void test_accounting(void)
{
    gv_region *r = t_fresh_region(path_in("acct.shr"));
    unsigned char u[16], u2[16], got[16];
    t_uuid(u, 1);
    t_uuid(u2, 2);
    CHECK_EQ(region_device_count(r), 0);
    CHECK_EQ(region_device_find(r, u), GV_ENOENT);
    int d = region_device_lookup(r, u, 0, 100 * MIB);
    CHECK_EQ(d, 0);
    CHECK_EQ(region_device_lookup(r, u, 16 * GIB, 5), 0);     /* existing: first wins */
    CHECK(region_limit(r, d) == 100 * MIB);
    CHECK(region_device_physical_total(r, d) == 16 * GIB);   /* unknown size filled in */
    CHECK_EQ(region_device_lookup(r, u2, GIB, GV_UNLIMITED), 1);
    CHECK_EQ(region_device_count(r), 2);
    CHECK_EQ(region_device_find(r, u2), 1);
    region_device_uuid(r, 1, got);
    CHECK(memcmp(got, u2, 16) == 0);
    CHECK(region_device_ready(r, 1) && !region_device_ready(r, 2) && !region_device_ready(r, -1));

    int s = region_self_slot(r);
    CHECK(s >= 0);
    CHECK_EQ(region_self_slot(r), s);
    CHECK_EQ(region_slot_of_pid(r, getpid()), s);
    CHECK_EQ(region_reserve(r, d, s, 0), 0);
    CHECK_EQ(region_reserve(r, d, s, 60 * MIB), 0);
    CHECK_EQ(region_reserve(r, d, s, 40 * MIB), 0);           /* exactly the limit */
    CHECK_EQ(region_reserve(r, d, s, 1), GV_ENOMEM);          /* one byte over */
    CHECK_EQ(region_oom_count(r, d), 1);
    CHECK(region_used(r, d) == 100 * MIB);
    CHECK(region_slot_used(r, d, s) == 100 * MIB);
    region_release(r, d, s, 40 * MIB);
    CHECK_EQ(region_reserve(r, d, s, UINT64_MAX), GV_ENOMEM); /* no wrap */
    CHECK_EQ(region_reserve(r, d, s, UINT64_MAX - 30 * MIB), GV_ENOMEM);
    CHECK_EQ(region_reserve(r, 1, s, UINT64_MAX), GV_ENOMEM); /* even unlimited */
    CHECK(region_used(r, d) == 60 * MIB);
    CHECK_EQ(region_reserve(r, 5, s, 1), GV_ENOENT);          /* entry not in use */
    CHECK_EQ(region_reserve(r, 99, s, 1), GV_EINVAL);
    CHECK_EQ(region_reserve(r, d, GV_MAX_SLOTS, 1), GV_EINVAL);

    /* Live limit changes apply to the next reservation. */
    region_set_limit(r, d, 50 * MIB);                         /* below current usage */
    CHECK_EQ(region_reserve(r, d, s, 1), GV_ENOMEM);
    region_release(r, d, s, 5 * MIB);                         /* releases always work */
    CHECK_EQ(region_reserve(r, d, s, 1), GV_ENOMEM);          /* still 55 > 50 */
    region_set_limit(r, d, 70 * MIB);
    CHECK_EQ(region_reserve(r, d, s, 15 * MIB), 0);
    CHECK_EQ(region_reserve(r, d, s, 1), GV_ENOMEM);
    region_set_limit(r, d, GV_UNLIMITED);
    CHECK_EQ(region_reserve(r, d, s, 10 * GIB), 0);
    region_release(r, d, s, 10 * GIB);
    CHECK(region_used(r, d) == 70 * MIB);
    /* Memory the driver took on its own is recorded even past the limit,
     * and refuses later reservations until it is given back. */
    region_set_limit(r, d, 80 * MIB);
    CHECK_EQ(region_charge_held(r, d, s, 20 * MIB), 0);
    CHECK(region_used(r, d) == 90 * MIB && region_slot_used(r, d, s) == 90 * MIB);
    CHECK_EQ(region_reserve(r, d, s, 1), GV_ENOMEM);
    region_release(r, d, s, 20 * MIB);
    CHECK_EQ(region_reserve(r, d, s, 10 * MIB), 0);
    region_release(r, d, s, 10 * MIB);
    region_set_limit(r, d, GV_UNLIMITED);
    CHECK(region_used(r, d) == 70 * MIB);
    CHECK_EQ(region_charge_held(r, 5, s, 1), GV_ENOENT);
    CHECK_EQ(region_charge_held(r, d, GV_MAX_SLOTS, 1), GV_EINVAL);
    /* Releasing more than held clamps at zero (and logs once). */
    region_release(r, d, s, 80 * MIB);
    CHECK_EQ(region_used(r, d), 0);
    CHECK_EQ(region_test_inside(r, d), 0);
    CHECK_EQ(region_test_slot_sum(r, d), 0);

    /* Device table exhaustion. */
    for (int k = 2; k < GV_MAX_DEVICES; k++) {
        unsigned char x[16];
        t_uuid(x, 100 + k);
        CHECK_EQ(region_device_lookup(r, x, GIB, GIB), k);
    }
    unsigned char x[16];
    t_uuid(x, 99);
    CHECK_EQ(region_device_lookup(r, x, GIB, GIB), GV_EFULL);
    CHECK_EQ(region_device_lookup(r, u2, GIB, GIB), 1);       /* existing still found */
    region_close(r);
    printf("accounting: ok\n");
}

/* ---- processes: fork, pid reuse, dead owners and reclaimers, exec ------------- */

static pid_t spawn_sleeper(void)
{
    pid_t p = fork();
    CHECK(p >= 0);
    if (p == 0) {
        prctl(PR_SET_NAME, "a) b (c) ", 0, 0, 0);  /* hostile comm for /proc parsing */
        for (;;)
            pause();
    }
    return p;
}

/* Wait (at most 10 s) until pid's comm reads name: the child has run its prctl.
 * A fixed sleep was not enough on a loaded two-core machine. */
static void wait_comm(pid_t pid, const char *name)
{
    char path[64], buf[32];
    snprintf(path, sizeof path, "/proc/%d/comm", (int)pid);
    for (uint64_t t0 = t_now_ms(); t_now_ms() - t0 < 10000; usleep(1000)) {
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        if (n > 0 && buf[n - 1] == '\n')
            buf[n - 1] = 0;
        if (strcmp(buf, name) == 0)
            return;
    }
    CHECK(!"the child never took its name");
}

/* Is /proc/<pid>/comm `name`? */
static int comm_is(pid_t pid, const char *name)
{
    char path[48], buf[64] = "";
    snprintf(path, sizeof path, "/proc/%d/comm", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    int ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    buf[strcspn(buf, "\n")] = '\0';
    return ok && strcmp(buf, name) == 0;
}

/* The state letter of /proc/<pid>/stat (0 if unreadable). */
static char proc_state(pid_t pid)
{
    char path[48], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    return p && p[1] == ' ' ? p[2] : 0;
}

/* In a child whose main thread exits: register, hold 11 MiB, tell the
 * parent the slot, and stay. */
static void *leader_exits_worker(void *arg)
{
    int fd = (int)(intptr_t)arg;   /* by value: the creator's frame dies with pthread_exit */
    gv_region *q = t_open_region(path_in("procs.shr"));
    unsigned char u[16];
    t_uuid(u, 3);
    int d = region_device_find(q, u);
    int s = region_self_slot(q);
    if (d < 0 || s < 0 || region_reserve(q, d, s, 11 * MIB) != 0)
        _exit(3);
    if (write(fd, &s, sizeof s) != (ssize_t)sizeof s)
        _exit(4);
    for (;;)
        pause();
    return NULL;
}

static void test_processes(const char *self_exe)
{
    const char *p = path_in("procs.shr");
    gv_region *r = t_fresh_region(p);
    unsigned char u[16];
    t_uuid(u, 3);
    int d = region_device_lookup(r, u, GIB, 100 * MIB);
    int me = region_self_slot(r);
    CHECK(me >= 0);
    uint64_t my_start = gv_proc_start_time(getpid());
    CHECK(my_start > 0);
    CHECK(gv_proc_alive(getpid(), my_start));
    CHECK(!gv_proc_alive(getpid(), my_start + 1));
    CHECK(!gv_proc_alive(-1, 0) && !gv_proc_alive(0, 0));

    /* /proc parsing survives a comm with spaces and parentheses; zombies are dead. */
    pid_t sl = spawn_sleeper();
    wait_comm(sl, "a) b (c) ");
    uint64_t sl_start = gv_proc_start_time(sl);
    CHECK(sl_start >= my_start);
    CHECK(gv_proc_alive(sl, sl_start));
    kill(sl, SIGKILL);
    siginfo_t si;                               /* until it is a zombie, not reaped */
    CHECK(waitid(P_PID, (id_t)sl, &si, WEXITED | WNOWAIT) == 0);
    CHECK(!gv_proc_alive(sl, sl_start));
    waitpid(sl, NULL, 0);
    CHECK(!gv_proc_alive(sl, sl_start));

    /* A forked child registers its own slot and holds memory; once it has
     * exited (zombie, then reaped), its slot is reclaimed. */
    int32_t pids[8];
    struct timespec ts;
    int fds[2], cs = -1, st;
    pid_t c;
    for (int round = 0; round < 2; round++) {
        CHECK(pipe(fds) == 0);
        c = fork();
        CHECK(c >= 0);
        if (c == 0) {
            int s = region_self_slot(r);
            if (s < 0 || s == me || region_reserve(r, d, s, 30 * MIB) != 0)
                _exit(3);
            CHECK(write(fds[1], &s, sizeof s) == (ssize_t)sizeof s);
            _exit(0);
        }
        CHECK(read(fds[0], &cs, sizeof cs) == (ssize_t)sizeof cs);
        close(fds[0]);
        close(fds[1]);
        siginfo_t ci;                           /* a zombie, not reaped yet */
        CHECK(waitid(P_PID, (id_t)c, &ci, WEXITED | WNOWAIT) == 0);
        CHECK(ci.si_code == CLD_EXITED && ci.si_status == 0);
        CHECK(cs >= 0 && cs != me);
        CHECK(region_used(r, d) == 30 * MIB);
        CHECK_EQ(region_process_list(r, pids, 8), 2);
        /* A refusal reads /proc for dead processes at most every
         * RECLAIM_EVERY_NS per entry, container-wide: just after a look, a
         * zombie's memory is refused at once... */
        clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);  /* the clock region_reserve reads */
        uint64_t now = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
        atomic_store(&r->m->dev[d].reclaim_at, now);
        CHECK_EQ(region_reserve(r, d, me, 80 * MIB), GV_ENOMEM);
        CHECK_EQ(region_process_list(r, pids, 8), 2);
        if (round == 0) {
            /* ...but once reaped, no process has its pid: the quick look a
             * refusal makes between full looks (one kill() per slot, at
             * most every QUICK_EVERY_NS in each process: that of the
             * refusal above is forgotten, as a tick later) takes its
             * memory within the interval (tests/test_exit.py). */
            CHECK(waitpid(c, NULL, 0) == c);
            CHECK(atomic_load(&r->quick_at[d]) != 0);
            atomic_store(&r->quick_at[d], 0);
            CHECK(atomic_load(&r->m->dev[d].reclaim_at) == now);
            clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
            atomic_store(&r->m->dev[d].reclaim_at,
                         (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec);
        } else {
            /* ...unless the time is ahead of now (another boot's, or one
             * the container wrote): that counts as long past, and the
             * refusal looks and reclaims the zombie. */
            atomic_store(&r->m->dev[d].reclaim_at, now + 3600 * UINT64_C(1000000000));
        }
        CHECK_EQ(region_reserve(r, d, me, 80 * MIB), 0);
        CHECK(region_used(r, d) == 80 * MIB);
        CHECK_EQ(region_process_list(r, pids, 8), 1);
        CHECK_EQ(pids[0], getpid());
        region_release(r, d, me, 80 * MIB);
        waitpid(c, NULL, 0);
    }

    /* PID reuse: a slot carrying our live pid with a wrong start time. */
    int fake = region_test_claim_slot(r, getpid(), my_start + 12345);
    CHECK(fake >= 0 && fake != me);
    CHECK_EQ(region_reserve(r, d, fake, 10 * MIB), 0);
    CHECK_EQ(region_slot_of_pid(r, getpid()), me);           /* exact match preferred */
    /* A live process that maps the region (a forked child, which keeps
     * the mapping), and one that does not (our parent, as if it had
     * exec()ed a program without the GPU: the driver freed its memory). */
    pid_t parent = getpid();
    pid_t mapper = fork();
    CHECK(mapper >= 0);
    if (mapper == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == parent)        /* (not if the parent died before) */
            pause();
        _exit(0);
    }
    uint64_t mapper_start = 0;
    for (int i = 0; i < 1000 && !mapper_start; i++)
        mapper_start = gv_proc_start_time(mapper);
    int live = region_test_claim_slot(r, mapper, mapper_start);
    CHECK(live >= 0);
    CHECK_EQ(region_reserve(r, d, live, 5 * MIB), 0);
    int unmapped = region_test_claim_slot(r, getppid(), gv_proc_start_time(getppid()));
    CHECK(unmapped >= 0);
    CHECK_EQ(region_reserve(r, d, unmapped, 3 * MIB), 0);
    CHECK_EQ(region_reclaim_dead(r), 2);      /* the fake one and the parent's */
    CHECK(region_slot_used(r, d, unmapped) == 0);
    CHECK(region_used(r, d) == 5 * MIB);
    CHECK(region_slot_used(r, d, live) == 5 * MIB);

    /* A reclaimer that died half-way is taken over; a live one is not. */
    int half = region_test_claim_slot(r, 1, 1);               /* a made-up owner */
    CHECK(half >= 0);
    CHECK_EQ(region_reserve(r, d, half, 7 * MIB), 0);
    CHECK_EQ(region_test_mark_reclaiming(r, half, sl, sl_start), 0);   /* dead */
    CHECK_EQ(region_test_mark_reclaiming(r, live, mapper, mapper_start), 0);
    CHECK_EQ(region_reclaim_dead(r), 1);
    CHECK(region_used(r, d) == 5 * MIB);                      /* the live one untouched */
    CHECK_EQ(region_test_mark_reclaiming(r, live, sl, sl_start), 0);
    CHECK_EQ(region_reclaim_dead(r), 1);
    CHECK_EQ(region_used(r, d), 0);
    kill(mapper, SIGKILL);
    waitpid(mapper, NULL, 0);

    /* A thread that had its slot before its process gave the slot up at
     * exit (region_leave), and charged it after: the free slot's charge is
     * reclaimed (before, it stayed until another process took that slot). */
    c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        int s = region_self_slot(r);
        if (s < 0 || region_leave(r) != GV_OK || region_reserve(r, d, s, 9 * MIB) != 0)
            _exit(3);
        _exit(0);
    }
    CHECK(waitpid(c, &st, 0) == c && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(region_used(r, d) == 9 * MIB);
    CHECK_EQ(region_reclaim_dead(r), 1);
    CHECK_EQ(region_used(r, d), 0);

    /* A process that cannot read its own start time (no fd left for /proc)
     * does not register with a start time of 0, which every other process
     * would take for dead: it is refused (GV_EIO), and registers once it can. */
    c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        struct rlimit lim;
        CHECK(getrlimit(RLIMIT_NOFILE, &lim) == 0);
        lim.rlim_cur = 64;                      /* a small table, quick to fill */
        CHECK(setrlimit(RLIMIT_NOFILE, &lim) == 0);
        int fd, last = -1;
        while ((fd = open("/dev/null", O_RDONLY)) >= 0)   /* fill the fd table */
            last = fd;
        int s = region_self_slot(r);
        if (s != GV_EIO)
            _exit(5);
        close(last);
        s = region_self_slot(r);
        _exit(s >= 0 && region_reserve(r, d, s, MIB) == 0 ? 0 : 6);
    }
    CHECK(waitpid(c, &st, 0) == c);
    CHECK(WIFEXITED(st));
    CHECK_EQ(WEXITSTATUS(st), 0);
    CHECK_EQ(region_reclaim_dead(r), 1);
    CHECK_EQ(region_used(r, d), 0);

    /* A process whose main thread called pthread_exit shows its leader as a
     * zombie while another thread works: alive, its slot kept. */
    CHECK(pipe(fds) == 0);
    c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);        /* not left behind if a CHECK fails */
        pthread_t t;
        if (pthread_create(&t, NULL, leader_exits_worker, (void *)(intptr_t)fds[1]) != 0)
            _exit(3);
        pthread_exit(NULL);
    }
    CHECK(read(fds[0], &cs, sizeof cs) == (ssize_t)sizeof cs);
    uint64_t c_start = gv_proc_start_time(c);
    for (int i = 0; i < 2000 && proc_state(c) != 'Z'; i++)
        usleep(1000);
    CHECK_EQ(proc_state(c), 'Z');
    CHECK(gv_proc_alive(c, c_start));
    CHECK_EQ(region_reclaim_dead(r), 0);
    CHECK(region_used(r, d) == 11 * MIB);
    kill(c, SIGKILL);
    CHECK(waitpid(c, &st, 0) == c);
    CHECK_EQ(region_reclaim_dead(r), 1);
    CHECK_EQ(region_used(r, d), 0);
    close(fds[0]);
    close(fds[1]);

    /* exec() while a thread was inside the gate, into a program that never
     * attaches the region: pid and start time stay, so the owner is alive,
     * but the inside count is its old image's.  A process leaving with
     * memory on the device (it closes the gate) must not wait for it. */
    c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        gv_region *cr = t_open_region(p);
        int s = region_self_slot(cr);
        if (s < 0 || region_reserve(cr, d, s, 2 * MIB) != 0)
            _exit(3);
        atomic_fetch_add(&cr->m->dev[d].inside[s], 1);      /* a thread mid-update */
        execl("/bin/sleep", "sleep", "30", (char *)NULL);
        _exit(4);
    }
    for (int i = 0; i < 2000 && !comm_is(c, "sleep"); i++)
        usleep(1000);
    CHECK(comm_is(c, "sleep"));
    pid_t leaver = fork();
    CHECK(leaver >= 0);
    if (leaver == 0) {
        alarm(10);                                  /* hung: killed, reported */
        gv_region *lr = t_open_region(p);
        int s = region_self_slot(lr);
        if (s < 0 || region_reserve(lr, d, s, MIB) != 0)
            _exit(3);
        _exit(region_leave(lr) == GV_OK ? 0 : 5);
    }
    CHECK(waitpid(leaver, &st, 0) == leaver);
    if (!WIFEXITED(st))
        fprintf(stderr, "leaver status 0x%x\n", st);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK_EQ(region_reserve(r, d, me, MIB), 0);
    region_release(r, d, me, MIB);
    kill(c, SIGKILL);
    CHECK(waitpid(c, &st, 0) == c);
    region_reclaim_dead(r);
    CHECK_EQ(region_used(r, d), 0);

    /* exec keeps pid and start time: the new image reuses and resets the slot. */
    CHECK_EQ(region_reserve(r, d, me, 3 * MIB), 0);
    c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        gv_region *cr = t_open_region(p);
        int s = region_self_slot(cr);
        if (s < 0 || region_reserve(cr, d, s, 9 * MIB) != 0)
            _exit(3);
        atomic_fetch_add(&cr->m->dev[d].inside[s], 1);      /* a thread mid-update */
        char sbuf[16];
        snprintf(sbuf, sizeof sbuf, "%d", s);
        execl(self_exe, self_exe, "--exec-child", p, sbuf, (char *)NULL);
        _exit(4);
    }
    CHECK(waitpid(c, &st, 0) == c);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fprintf(stderr, "exec child status 0x%x\n", st);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    region_reclaim_dead(r);
    CHECK(region_used(r, d) == 3 * MIB);
    region_release(r, d, me, 3 * MIB);
    region_close(r);
    printf("processes: ok\n");
}

static int exec_child(const char *path, int old_slot)
{
    gv_region *r = t_open_region(path);
    unsigned char u[16];
    t_uuid(u, 3);
    int d = region_device_find(r, u);
    int s = region_self_slot(r);
    if (d < 0 || s != old_slot) {
        fprintf(stderr, "exec child: slot %d, expected %d\n", s, old_slot);
        return 1;
    }
    if (region_slot_used(r, d, s) != 0) {       /* the old image's 9 MiB are gone */
        fprintf(stderr, "exec child: slot not reset\n");
        return 1;
    }
    /* A second handle in the same image shares the slot without reset. */
    if (region_reserve(r, d, s, MIB) != 0)
        return 1;
    gv_region *r2 = t_open_region(path);
    if (region_self_slot(r2) != s || region_slot_used(r2, d, s) != MIB)
        return 1;
    region_release(r, d, s, MIB);
    region_close(r2);
    region_close(r);
    return 0;
}

/* ---- concurrent device claims, slot exhaustion, dead initialiser --------------- */

static void test_device_race(void)
{
    const char *p = path_in("devrace.shr");
    gv_region *r = t_fresh_region(p);
    _Atomic int *go = t_shared(sizeof *go);
    enum { N = 16 };
    pid_t kids[N];
    for (int i = 0; i < N; i++) {
        kids[i] = fork();
        CHECK(kids[i] >= 0);
        if (kids[i] == 0) {
    alarm(20);
            gv_region *cr = t_open_region(p);
            while (!atomic_load(go))
                sched_yield();
            unsigned char u[16];
            t_uuid(u, 10 + (i & 1));             /* two uuids, eight claimers each */
            int d = region_device_lookup(cr, u, GIB, GIB);
            _exit(d < 0 ? 100 : d);
        }
    }
    atomic_store(go, 1);
    int seen[2] = {-1, -1};
    for (int i = 0; i < N; i++) {
        int st;
        CHECK(waitpid(kids[i], &st, 0) == kids[i] && WIFEXITED(st));
        int d = WEXITSTATUS(st);
        CHECK(d < 2);
        if (seen[i & 1] < 0)
            seen[i & 1] = d;
        CHECK_EQ(seen[i & 1], d);               /* one entry per uuid */
    }
    CHECK(seen[0] != seen[1]);
    CHECK_EQ(region_device_count(r), 2);

    /* An initialiser killed half-way is taken over. */
    unsigned char u[16];
    t_uuid(u, 20);
    pid_t c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        region_test_set_delay_us(5 * 1000 * 1000);
        region_device_lookup(r, u, GIB, 7 * MIB);
        _exit(0);
    }
    for (uint64_t t = t_now_ms(); region_device_count(r) < 3 && t_now_ms() - t < 10000;)
        usleep(1000);
    CHECK_EQ(region_device_count(r), 3);         /* entry 2 is being initialised */
    CHECK(!region_device_ready(r, 2));
    kill(c, SIGKILL);
    waitpid(c, NULL, 0);
    /* Until someone takes it over, the C API lists the ready entries only
     * (every index below gv_device_count() answers): the dead initialiser's
     * entry made every reader of all the devices (shim-info, the tuner)
     * fail with "device 2 is not initialised". */
    c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        if (gv_region_attach(p) != GV_OK)
            _exit(2);
        int n = gv_device_count();
        for (int i = 0; i < n; i++) {
            uint64_t v;
            if (gv_device_get_limit(i, &v) != GV_OK || gv_device_get_used(i, &v) != GV_OK) {
                fprintf(stderr, "gv_device_count() %d: entry %d: %s\n", n, i, gv_last_error());
                _exit(3);
            }
        }
        _exit(n == 2 ? 0 : 4);
    }
    int api_st;
    CHECK(waitpid(c, &api_st, 0) == c && WIFEXITED(api_st));
    CHECK_EQ(WEXITSTATUS(api_st), 0);
    uint64_t t0 = t_now_ms();
    CHECK_EQ(region_device_lookup(r, u, GIB, 9 * MIB), 2);
    CHECK(t_now_ms() - t0 < 2000);
    CHECK(region_limit(r, 2) == 9 * MIB);
    region_close(r);

    /* Slot table exhaustion. */
    p = path_in("full.shr");
    r = t_fresh_region(p);
    uint64_t start = gv_proc_start_time(getpid());
    for (int i = 0; i < GV_MAX_SLOTS; i++)
        CHECK_EQ(region_test_claim_slot(r, getpid(), start + 1 + (uint64_t)i * 0), i);
    c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        /* All owners carry our pid with a wrong start: all are stale. */
        _exit(region_self_slot(r) == 0 ? 0 : 1);
    }
    int st;
    CHECK(waitpid(c, &st, 0) == c && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    region_close(r);
    r = t_fresh_region(p);
    for (int i = 0; i < GV_MAX_SLOTS; i++)
        CHECK_EQ(region_test_claim_slot(r, getpid(), start), i);   /* live owners */
    CHECK_EQ(region_test_claim_slot(r, getpid(), start), GV_EFULL);
    c = fork();
    CHECK(c >= 0);
    if (c == 0)
        _exit(region_self_slot(r) == GV_EFULL ? 0 : 1);
    CHECK(waitpid(c, &st, 0) == c && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    region_close(r);
    unlink(p);
    printf("device race, dead initialiser, slot exhaustion: ok\n");
}

/* region_sm_gated: a process's cached "nothing gated" holds only until the
 * region's limits, priorities or yield flags change, and never while a
 * writer is (or died) in the middle of a change. */
static void test_sm_gated(void)
{
    gv_region *r = t_fresh_region(path_in("smgate.shr"));
    unsigned char u[16];
    t_uuid(u, 7);
    int d = region_device_lookup(r, u, GIB, GV_UNLIMITED);
    CHECK_EQ(d, 0);
    _Atomic uint64_t cache = 0;
    CHECK_EQ(region_sm_gated(r, &cache), 0);
    CHECK(atomic_load(&cache) != 0);                          /* filled */

    /* A low priority without a limit gates nothing (CUDA_TASK_PRIORITY
     * unset means low: the fast path stays) until a yield flag is set;
     * a lease that ended is cleared by region_sm_end_yield unless renewed. */
    unsigned char u2[16];
    t_uuid(u2, 8);
    int d2 = region_device_lookup(r, u2, GIB, GV_UNLIMITED);
    CHECK_EQ(d2, 1);
    region_sm_configure(r, d2, 0, 0, 1);
    CHECK_EQ(atomic_load(&region_sm(r, d2)->priority), 1);
    CHECK(!region_sm_any(r));
    CHECK_EQ(region_sm_gated(r, &cache), 0);
    region_sm_set_yield(r, d2, 5000);
    CHECK(region_sm_any(r));
    CHECK_EQ(region_sm_gated(r, &cache), 1);
    atomic_store(&region_sm(r, d2)->share, 0);                /* as a meter pauses it */
    region_sm_set_yield(r, d2, 7000);                         /* renewed */
    region_sm_end_yield(r, d2, 5000);                         /* stale: no effect */
    CHECK_EQ(atomic_load(&region_sm(r, d2)->yield_until), 7000);
    CHECK_EQ(region_sm_gated(r, &cache), 1);
    region_sm_end_yield(r, d2, 7000);
    CHECK_EQ(atomic_load(&region_sm(r, d2)->yield_until), 0);
    CHECK_EQ(atomic_load(&region_sm(r, d2)->share), 10000);   /* whole GPU again */
    CHECK_EQ(region_sm_gated(r, &cache), 0);                  /* fast path again */
    region_sm_set_yield(r, d2, 9000);
    CHECK_EQ(region_sm_gated(r, &cache), 1);
    atomic_store(&region_sm(r, d2)->share, 0);
    region_sm_set_yield(r, d2, 0);
    CHECK_EQ(atomic_load(&region_sm(r, d2)->share), 10000);
    CHECK_EQ(region_sm_gated(r, &cache), 0);

    region_sm_configure(r, d, 30, 0, 0);
    CHECK_EQ(region_sm_gated(r, &cache), 1);
    region_sm_set_limit(r, d, 0);
    CHECK_EQ(region_sm_gated(r, &cache), 0);
    CHECK_EQ(region_sm_gated(r, &cache), 0);                  /* from the cache */
    struct gv_sm *sm = region_sm(r, d);
    region_sm_set_yield(r, d, 5000);                          /* until 5 us */
    CHECK_EQ(region_sm_gated(r, &cache), 1);
    CHECK(region_sm_yielding(sm, 4999));
    CHECK(!region_sm_yielding(sm, 5000));                     /* the lease ended */
    CHECK_EQ(region_sm_gated(r, &cache), 1);                  /* gated until cleared */
    uint32_t gen = atomic_load(&r->m->hdr.sm_gen);
    region_sm_set_yield(r, d, 9000);                          /* renewed: no change made */
    CHECK_EQ(atomic_load(&r->m->hdr.sm_gen), gen);
    CHECK(region_sm_yielding(sm, 8999));
    region_sm_set_yield(r, d, 0);
    CHECK(atomic_load(&r->m->hdr.sm_gen) != gen);
    CHECK(!region_sm_yielding(sm, 1));
    CHECK_EQ(region_sm_gated(r, &cache), 0);

    /* A writer killed after its store, before it finished the change. */
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        region_test_set_delay_us(10 * 1000 * 1000);
        region_sm_set_limit(r, d, 40);
        _exit(0);
    }
    for (int i = 0; i < 5000 && atomic_load(&region_sm(r, d)->limit) != 40; i++)
        usleep(1000);
    CHECK_EQ(atomic_load(&region_sm(r, d)->limit), 40);
    kill(child, SIGKILL);
    CHECK_EQ(waitpid(child, NULL, 0), child);
    CHECK_EQ(region_sm_gated(r, &cache), 1);                  /* not the cached 0 */
    region_sm_set_limit(r, d, 0);
    CHECK_EQ(region_sm_gated(r, &cache), 0);                  /* looked again ... */
    uint64_t before = atomic_load(&cache);
    region_sm_set_limit(r, d, 20);
    CHECK_EQ(region_sm_gated(r, &cache), 1);                  /* ... every time */
    CHECK(atomic_load(&cache) == before);                     /* never cached again */
    region_close(r);
    printf("sm gating cache, writer killed mid-change: ok\n");
}

/* A region file that outlived a reboot: CLOCK_MONOTONIC started again, so
 * the pacing clock, the pause lease, the node agent's report time and the
 * enqueue word of the last boot lie in the future; the first open in the
 * new boot forgets them, and later opens in the same boot keep them. */
static void test_reboot(void)
{
    const char *p = path_in("reboot.shr");
    region_test_set_boot(111);
    gv_region *r = t_fresh_region(p);
    CHECK_EQ(atomic_load(&r->m->hdr.boot), 111);
    unsigned char u[16];
    t_uuid(u, 9);
    int d = region_device_lookup(r, u, GIB, GV_UNLIMITED);
    CHECK_EQ(d, 0);
    struct gv_sm *sm = region_sm(r, d);
    uint64_t later = rg_now_ns() + UINT64_C(3600) * 1000000000;  /* an hour of old uptime */
    region_sm_configure(r, d, 0, 0, 1);
    atomic_store(&sm->tat, later);
    atomic_store(&sm->others_at, later);
    atomic_store(&sm->enqueue, later | 1);
    region_sm_set_yield(r, d, later);
    atomic_store(&sm->share, 0);                              /* as the meter pauses it */
    CHECK(region_sm_yielding(sm, rg_now_ns()));

    gv_region *same = NULL;                                   /* the same boot: kept */
    char err[256];
    CHECK_EQ(region_open(p, &same, err, sizeof err), GV_OK);
    CHECK_EQ(atomic_load(&sm->tat), later);
    CHECK(region_sm_yielding(sm, rg_now_ns()));
    region_close(same);

    region_test_set_boot(222);                                /* rebooted */
    _Atomic uint64_t cache = 0;
    CHECK_EQ(region_sm_gated(r, &cache), 1);
    gv_region *next = NULL;
    CHECK_EQ(region_open(p, &next, err, sizeof err), GV_OK);
    CHECK_EQ(atomic_load(&next->m->hdr.boot), 222);
    struct gv_sm *nsm = region_sm(next, d);
    CHECK_EQ(atomic_load(&nsm->tat), 0);
    CHECK_EQ(atomic_load(&nsm->others_at), 0);
    CHECK_EQ(atomic_load(&nsm->enqueue), 0);
    CHECK_EQ(atomic_load(&nsm->yield_until), 0);
    CHECK_EQ(atomic_load(&nsm->share), 10000);                /* no limit: whole GPU */
    CHECK_EQ(region_sm_gated(next, &cache), 0);               /* fast path again */
    CHECK_EQ(atomic_load(&nsm->priority), 1);                 /* settings kept */

    /* A file whose boot is not known (made where the boot id could not be
     * read) is left as it is. */
    atomic_store(&next->m->hdr.boot, 0);
    atomic_store(&nsm->tat, later);
    region_test_set_boot(333);
    gv_region *unknown = NULL;
    CHECK_EQ(region_open(p, &unknown, err, sizeof err), GV_OK);
    CHECK_EQ(atomic_load(&nsm->tat), later);
    CHECK_EQ(atomic_load(&next->m->hdr.boot), 333);
    region_close(unknown);
    region_close(next);
    region_close(r);
    region_test_set_boot(0);
    printf("region outliving a reboot: ok\n");
}

/* The context cost a container learned: the smallest non-zero one, also
 * when many threads learn at once. */
struct cost_arg { gv_region *r; int dev; uint64_t base; };

static void *learn_costs(void *p)
{
    struct cost_arg *a = p;
    for (uint64_t i = 0; i < 2000; i++)
        region_learn_ctx_cost(a->r, a->dev, a->base + (i * 7919) % 2000);
    return NULL;
}

static void test_ctx_cost(void)
{
    gv_region *r = t_fresh_region(path_in("ctxcost.shr"));
    unsigned char u[16];
    t_uuid(u, 5);
    CHECK_EQ(region_ctx_cost(r, 0), 0);                      /* no entry yet */
    region_learn_ctx_cost(r, 0, MIB);                         /* ignored */
    int d = region_device_lookup(r, u, GIB, GIB);
    CHECK_EQ(d, 0);
    CHECK_EQ(region_ctx_cost(r, d), 0);                       /* none measured */
    region_learn_ctx_cost(r, d, 0);                           /* 0 teaches nothing */
    CHECK_EQ(region_ctx_cost(r, d), 0);
    region_learn_ctx_cost(r, d, 500 * MIB);
    CHECK(region_ctx_cost(r, d) == 500 * MIB);
    region_learn_ctx_cost(r, d, 600 * MIB);                   /* larger: kept smaller */
    CHECK(region_ctx_cost(r, d) == 500 * MIB);
    region_learn_ctx_cost(r, d, 0);
    CHECK(region_ctx_cost(r, d) == 500 * MIB);
    region_learn_ctx_cost(r, d, 300 * MIB);
    CHECK(region_ctx_cost(r, d) == 300 * MIB);
    CHECK_EQ(region_ctx_cost(r, -1), 0);
    CHECK_EQ(region_ctx_cost(r, GV_MAX_DEVICES), 0);

    pthread_t t[4];
    struct cost_arg a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (struct cost_arg){ r, d, (uint64_t)(4 - i) * 1000 + 1 };
        CHECK_EQ(pthread_create(&t[i], NULL, learn_costs, &a[i]), 0);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    CHECK_EQ(region_ctx_cost(r, d), 1001);
    region_close(r);
    printf("context cost: ok\n");
}

/* gv_region_file_set_sm on a region its container cuts short in the middle
 * of the write (region_peer.c): the store past the file's end is a SIGBUS,
 * which the guard turns into GV_ECORRUPT; the caller lives on, and its
 * own SIGBUS disposition (a sanitizer's, under one) is back afterwards. */
static void test_peer_truncated(void)
{
    const char *p = path_in("peer.shr");
    gv_region *r = t_fresh_region(p);
    unsigned char u[16];
    t_uuid(u, 6);
    int d = region_device_lookup(r, u, GIB, GIB);
    CHECK_EQ(d, 0);
    char uuid[48];
    snprintf(uuid, sizeof uuid,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11],
             u[12], u[13], u[14], u[15]);
    struct gv_region_file_device info[GV_MAX_DEVICES];
    CHECK_EQ(gv_region_file_devices(p, info, GV_MAX_DEVICES), 1);
    CHECK(strcmp(info[0].uuid, uuid) == 0);
    CHECK_EQ(info[0].limit, GIB);
    CHECK_EQ(info[0].yield_ms, 0);
    CHECK_EQ(gv_region_file_set_sm(p, uuid, 1500, 2500), GV_OK);
    CHECK_EQ(gv_region_file_devices(p, info, GV_MAX_DEVICES), 1);
    CHECK(info[0].yield_ms > 1000 && info[0].yield_ms <= 1500);
    CHECK_EQ(gv_region_file_set_sm(p, uuid, 0, GV_KEEP), GV_OK);
    CHECK_EQ(gv_region_file_set_sm(p, "GPU-nope", 0, GV_KEEP), GV_ENOENT);

    /* The write sleeps in the middle of the change (region_test_set_delay_us);
     * a child cuts the file short meanwhile. */
    struct sigaction before;
    CHECK_EQ(sigaction(SIGBUS, NULL, &before), 0);   /* SIG_DFL, or a sanitizer's */
    region_test_set_delay_us(200000);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        /* Once the write is in the middle of its change (a writer counted
         * in the header, the parent asleep in the delay). */
        for (int i = 0; i < 20000 && atomic_load(&r->m->hdr.sm_writers) == 0; i++)
            usleep(500);
        _exit(truncate(p, 0) == 0 ? 0 : 1);
    }
    int rc = gv_region_file_set_sm(p, uuid, 0, GV_KEEP);
    region_test_set_delay_us(0);
    int status = 0;
    CHECK_EQ(waitpid(child, &status, 0), child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK_EQ(rc, GV_ECORRUPT);
    CHECK(strstr(gv_last_error(), "SIGBUS") != NULL);
    struct sigaction now;
    CHECK_EQ(sigaction(SIGBUS, NULL, &now), 0);
    CHECK(now.sa_handler == before.sa_handler);
    /* Now cut short for good: refused before anything is mapped. */
    CHECK_EQ(gv_region_file_devices(p, info, GV_MAX_DEVICES), GV_ECORRUPT);
    CHECK_EQ(gv_region_file_set_sm(p, uuid, 0, GV_KEEP), GV_ECORRUPT);
    region_close(r);
    printf("peer region cut short: ok\n");
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "--exec-child") == 0)
        return exec_child(argv[2], atoi(argv[3]));
    if (argc < 2) {
        fprintf(stderr, "usage: %s SCRATCH_DIR\n", argv[0]);
        return 2;
    }
    snprintf(g_dir, sizeof g_dir, "%s", argv[1]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    mkdir(g_dir, 0755);
    alarm(60);
    char exe[512];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    CHECK(n > 0);
    exe[n] = '\0';

    test_parser();
    test_env();
    test_open();
    test_accounting();
    test_processes(exe);
    test_device_race();
    test_sm_gated();
    test_reboot();
    test_ctx_cost();
    test_peer_truncated();
    printf("t_region_unit: OK (%d table checks)\n", g_checks);
    return 0;
}
