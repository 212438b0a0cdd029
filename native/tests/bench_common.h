/*
 * bench_common.h - what the benchmark programs (bench_memory.c,
 * bench_launch.c) share: finding and opening the interposer and the
 * simulated driver side by side, errors, the scratch directory, medians and
 * the CPU model for the tables.  Included once by each program, after its
 * system headers; bench_name is set first thing in main.
 */
#ifndef GV_BENCH_COMMON_H
#define GV_BENCH_COMMON_H

static const char *bench_name = "bench";

static struct {
    char lib[PATH_MAX];
    char sim[PATH_MAX];
    char nvml[PATH_MAX];
    void *hsim, *hlib;
} libs;

static char tmpdir[PATH_MAX];
static pid_t parent_pid;

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", bench_name);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static void *need_sym(void *h, const char *name, const char *what)
{
    void *p = dlsym(h, name);
    if (!p)
        die("%s: no symbol %s", what, name);
    return p;
}

static void *app_sym(const char *name)
{
    void *p = dlsym(libs.hlib, name);
    return p ? p : need_sym(libs.hsim, name, libs.sim);
}

static int resolve(char *out, const char *dir, const char *rel)
{
    char joined[2 * PATH_MAX];
    snprintf(joined, sizeof joined, "%s%s", dir, rel);
    char buf[PATH_MAX];
    if (!realpath(joined, buf))
        return -1;
    snprintf(out, PATH_MAX, "%s", buf);
    return 0;
}

static void default_paths(void)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        die("readlink /proc/self/exe: %s", strerror(errno));
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash)
        *slash = '\0';
    /* The binary lives in $(BUILD)/bench/: the libraries are one level up. */
    if (libs.lib[0] ? resolve(libs.lib, libs.lib, "") : resolve(libs.lib, exe, "/../libgpuvisor.so"))
        die("cannot find libgpuvisor.so next to %s (run make first, or pass --lib)", exe);
    if (libs.sim[0] ? resolve(libs.sim, libs.sim, "") : resolve(libs.sim, exe, "/../sim/libcuda.so.1"))
        die("cannot find sim/libcuda.so.1 next to %s (run make first, or pass --sim)", exe);
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", libs.sim);
    slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    if (resolve(libs.nvml, dir, "/libnvidia-ml.so.1"))
        libs.nvml[0] = '\0';
}

static void cleanup_tmp(void)
{
    if (!tmpdir[0] || getpid() != parent_pid)
        return;
    DIR *d = opendir(tmpdir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)))
            if (e->d_name[0] != '.')
                unlinkat(dirfd(d), e->d_name, 0);
        closedir(d);
    }
    rmdir(tmpdir);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void cpu_model(char *buf, size_t len)
{
    snprintf(buf, len, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char *c = strchr(line, ':');
            if (c) {
                c++;
                while (*c == ' ' || *c == '\t')
                    c++;
                c[strcspn(c, "\n")] = '\0';
                snprintf(buf, len, "%s", c);
            }
            break;
        }
    }
    fclose(f);
}

#endif /* GV_BENCH_COMMON_H */
