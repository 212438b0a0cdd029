/*
 * oversub.c - memory oversubscription (CUDA_OVERSUBSCRIBE=true): quotas
 * past the device's memory, the part that does not fit on the device
 * served from host memory the GPU can access, and the guarantees between
 * the containers of a GPU.  The rules are in docs/oversubscription.md.
 *
 * A container is guaranteed G = min(limit, limit / S, physical) of device
 * memory, S being GPUVISOR_MEMORY_SCALING.  At each allocation of n bytes
 * (charged to the quota first, as always) the device takes
 *   - what still fits in the container's guarantee: G - R, R being the
 *     container's device-resident bytes (the region's used less spilled);
 *   - beyond that, only what leaves every other container's unclaimed
 *     guarantee free on the device: the driver's physical free memory less
 *     the sum over the other live containers of G_j - R_j;
 * and the rest is spilled: managed memory with its preferred location on
 * the host, mapped for the device (SET_ACCESSED_BY), so that kernels read
 * and write it over the bus and nothing migrates.  An allocation that
 * straddles the two is one managed allocation whose device part is
 * advised to the device and prefetched there.  Decisions are taken at
 * allocation time only: nothing handed out is moved later.
 *
 * The other containers' guarantees and resident bytes are in a file per
 * GPU in the node directory (that of the node lock, node_lock.c),
 * gpuvisor-mem-<GPU UUID>: one row per container, claimed when a process
 * of the container first uses the device under CUDA_OVERSUBSCRIBE.  A row
 * is alive while some process holds a shared open-file-description lock
 * on its byte (fcntl F_OFD_SETLK, which the kernel drops when the
 * process dies, whatever PID namespace it is in).  Decisions that borrow
 * beyond the guarantee are made one at a time on the node, under the
 * node lock, so that two borrowers cannot both take the same unclaimed
 * bytes.  What a container writes there can only make the others borrow
 * less (they spill more): its guarantee counts at most up to the device's
 * memory, and the others' together at most up to the device's memory
 * less one's own guarantee, which no row is consulted for.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hooks.h"
#include "limits.h"
#include "log.h"
#include "oversub.h"

#ifndef F_OFD_GETLK
#define F_OFD_GETLK 36
#define F_OFD_SETLK 37
#endif

#define OV_MAGIC 0x67766d656d000001ULL    /* "gvmem", layout version 1 */
#define OV_ROWS 128
#define OV_LOCK_BASE 65536                /* row i is alive while byte BASE+i is locked */

struct ov_row {
    _Atomic uint64_t container;   /* its region file's identity; 0: never used */
    _Atomic uint64_t guarantee;   /* bytes it is guaranteed on the device */
    _Atomic uint64_t resident;    /* bytes it holds on the device */
    uint64_t pad;
};

struct ov_file {
    _Atomic uint64_t magic;
    uint64_t pad[7];
    struct ov_row row[OV_ROWS];
};

enum { UNTRIED, OPENING, MAPPED, NONE };

static struct ov_dev {
    _Atomic int state;
    int fd;
    struct ov_file *f;
    _Atomic int row;              /* this container's row, -1: none */
} ovs[GV_MAX_DEVICES];

static _Atomic uint32_t scaling;  /* S in thousandths; 0: oversubscription off */

void gv_oversub_configure(void)
{
    atomic_store(&scaling, limits_oversubscribe() ? limits_memory_scaling_milli() : 0);
    for (int i = 0; i < GV_MAX_DEVICES; i++)
        atomic_store(&ovs[i].row, -1);
}

int gv_oversub_on(void) { return atomic_load_explicit(&scaling, memory_order_relaxed) != 0; }

static gv_node_file ov_node_file = {
    .kind = "mem", .what = "guarantee",
    .lost = "this container holds no device memory beyond its guarantee (what passes it is "
            "served from host memory) and other containers do not see what it holds",
};

/* fcntl cmd (F_OFD_SETLK, F_OFD_GETLK) on row i's byte, as a lock of type. */
static int row_fcntl(int fd, int i, int cmd, short type, struct flock *fl)
{
    memset(fl, 0, sizeof *fl);
    fl->l_type = type;
    fl->l_whence = SEEK_SET;
    fl->l_start = OV_LOCK_BASE + i;
    fl->l_len = 1;
    return fcntl(fd, cmd, fl);
}

static int lock_row(int fd, int i, short type)
{
    struct flock fl;
    return row_fcntl(fd, i, F_OFD_SETLK, type, &fl);
}

/* Whether some other open file description holds row i's byte. */
static int row_alive(int fd, int i)
{
    struct flock fl;
    if (row_fcntl(fd, i, F_OFD_GETLK, F_WRLCK, &fl) != 0)
        return 1;                       /* cannot tell: count it */
    return fl.l_type != F_UNLCK;
}

/* Claim this container's row (the node lock held by the caller, when there
 * is one): its own if another process of it holds one, else a dead one. */
static int claim(struct ov_dev *o)
{
    uint64_t me = gv_node_container();
    if (!me)
        return -1;
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < OV_ROWS; i++) {
            struct ov_row *w = &o->f->row[i];
            uint64_t c = atomic_load(&w->container);
            if (pass == 0 ? c != me : (c != 0 && row_alive(o->fd, i)))
                continue;
            if (lock_row(o->fd, i, F_RDLCK) != 0)
                continue;
            if (pass == 1) {
                if (!atomic_compare_exchange_strong(&w->container, &c, me)) {
                    lock_row(o->fd, i, F_UNLCK);
                    continue;
                }
                atomic_store(&w->resident, 0);
                atomic_store(&w->guarantee, 0);
            }
            if (atomic_load(&w->container) != me) {   /* taken over meanwhile */
                lock_row(o->fd, i, F_UNLCK);
                continue;
            }
            return i;
        }
    }
    return -1;
}

static void fork_child(void)
{
    /* The child shares the parent's descriptors, so its row locks too:
     * the rows stay the container's while either lives.  A mapping another
     * thread was making is made again. */
    for (int i = 0; i < GV_MAX_DEVICES; i++) {
        int opening = OPENING;
        atomic_compare_exchange_strong(&ovs[i].state, &opening, UNTRIED);
    }
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, fork_child); }

/* The device's guarantee file with this container's row, or NULL. */
static struct ov_dev *node_for(const gv_devinfo *d)
{
    int dev = d->region_dev;
    if (dev < 0 || dev >= GV_MAX_DEVICES)
        return NULL;
    struct ov_dev *o = &ovs[dev];
    int st = atomic_load_explicit(&o->state, memory_order_acquire);
    if (st == UNTRIED) {
        pthread_once(&atfork_once, register_atfork);
        if (!atomic_compare_exchange_strong(&o->state, &st, OPENING))
            return NULL;
        int fd = -1;
        o->f = gv_node_file_map(&ov_node_file, d->uuid_str, OV_MAGIC, sizeof(struct ov_file),
                                &fd);
        o->fd = fd;
        if (o->f) {
            int lk = gv_node_lock();
            atomic_store(&o->row, claim(o));
            gv_node_unlock(lk);
            if (atomic_load(&o->row) < 0)
                gv_log(GV_LOG_WARN, "%s: no row left in the node's guarantee file; this "
                       "container holds no device memory beyond its guarantee", d->uuid_str);
        }
        st = o->f && atomic_load(&o->row) >= 0 ? MAPPED : NONE;
        atomic_store_explicit(&o->state, st, memory_order_release);
    }
    return st == MAPPED ? o : NULL;
}

static uint64_t guarantee_of(const gv_devinfo *d)
{
    gv_region *r = gv_core_region();
    uint64_t g = limits_guarantee(region_limit(r, d->region_dev), d->physical_total,
                                  atomic_load(&scaling));
    if (d->granularity > 1)
        g -= g % d->granularity;
    return g;
}

void gv_oversub_note(int dev)
{
    if (!gv_oversub_on() || dev < 0 || dev >= GV_MAX_DEVICES ||
        atomic_load_explicit(&ovs[dev].state, memory_order_acquire) != MAPPED)
        return;
    struct ov_dev *o = &ovs[dev];
    int i = atomic_load(&o->row);
    if (i < 0)
        return;
    gv_region *r = gv_core_region();
    struct ov_row *w = &o->f->row[i];
    atomic_store(&w->guarantee, region_guarantee(r, dev));
    atomic_store(&w->resident, region_resident(r, dev));
}

void gv_oversub_attach(const gv_devinfo *d)
{
    if (!gv_oversub_on())
        return;
    region_set_guarantee(gv_core_region(), d->region_dev, guarantee_of(d));
    if (node_for(d))
        gv_oversub_note(d->region_dev);
}

/* The other live containers' unclaimed guarantees on the device, at most
 * physical less this container's guarantee. */
static uint64_t others_unclaimed(struct ov_dev *o, uint64_t physical, uint64_t mine)
{
    uint64_t me = gv_node_container(), sum = 0;
    for (int i = 0; i < OV_ROWS; i++) {
        struct ov_row *w = &o->f->row[i];
        uint64_t c = atomic_load(&w->container);
        if (c == 0 || c == me || !row_alive(o->fd, i))
            continue;
        uint64_t g = atomic_load(&w->guarantee), r = atomic_load(&w->resident);
        g = g < physical ? g : physical;
        sum += g > r ? g - r : 0;
        if (sum >= physical)
            break;
    }
    uint64_t cap = physical > mine ? physical - mine : 0;
    return sum < cap ? sum : cap;
}

static uint64_t round_down(uint64_t n, uint64_t g) { return g > 1 ? n - n % g : n; }

/* How much of the n bytes charged by c goes to the device (see the top).
 * *lockfd: the node lock, held when the answer borrows beyond the
 * guarantee, until the allocation is made and noted. */
static uint64_t plan(const gv_devinfo *d, uint64_t n, int *lockfd)
{
    gv_region *r = gv_core_region();
    int dev = d->region_dev;
    uint64_t g = guarantee_of(d);
    region_set_guarantee(r, dev, g);
    /* The region counts this charge (reserved) as resident already. */
    uint64_t res = region_resident(r, dev);
    res = res > n ? res - n : 0;
    uint64_t own = res < g ? g - res : 0;
    if (own >= n)
        return n;
    own = round_down(own, d->granularity);
    struct ov_dev *o = node_for(d);
    if (!o)
        return own;                     /* nobody to ask: the guarantee only */
    *lockfd = gv_node_lock();
    size_t f = 0, t = 0;
    if (GV_REAL(cuMemGetInfo_v2, CUresult (*)(size_t *, size_t *))(&f, &t) != CUDA_SUCCESS)
        return own;
    uint64_t others = others_unclaimed(o, d->physical_total, g);
    uint64_t avail = f > others ? f - others : 0;
    uint64_t take = avail >= n ? n : round_down(avail, d->granularity);
    return take > own ? take : own;
}

typedef CUresult (*managed_fn)(CUdeviceptr *, size_t, unsigned int);
typedef CUresult (*advise_fn)(CUdeviceptr, size_t, CUmem_advise, CUdevice);
typedef CUresult (*prefetch_fn)(CUdeviceptr, size_t, CUdevice, CUstream);

static _Atomic int advise_warned;

static void advise(CUdeviceptr p, size_t len, CUmem_advise what, CUdevice where)
{
    CUresult rc = GV_REAL(cuMemAdvise, advise_fn)(p, len, what, where);
    if (rc != CUDA_SUCCESS && !atomic_exchange(&advise_warned, 1))
        gv_log(GV_LOG_WARN, "cuMemAdvise(%d) on spilled memory failed (%d): the driver "
               "places it as it sees fit", (int)what, (int)rc);
}

/* Managed memory of bytes whose first dev_bytes live on the device and the
 * rest on the host, mapped for the device. */
static CUresult managed(CUdeviceptr *dptr, size_t bytes, unsigned flags, uint64_t dev_bytes)
{
    CUdevice cudev;
    if (GV_REAL(cuCtxGetDevice, CUresult (*)(CUdevice *))(&cudev) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUresult rc = GV_REAL(cuMemAllocManaged, managed_fn)(dptr, bytes, flags);
    if (rc != CUDA_SUCCESS)
        return rc;
    CUdeviceptr p = *dptr;
    size_t on_dev = dev_bytes < bytes ? (size_t)dev_bytes : bytes;
    if (on_dev < bytes) {
        advise(p + on_dev, bytes - on_dev, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_DEVICE_CPU);
        advise(p + on_dev, bytes - on_dev, CU_MEM_ADVISE_SET_ACCESSED_BY, cudev);
    }
    if (on_dev > 0) {
        advise(p, on_dev, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, cudev);
        GV_REAL(cuMemPrefetchAsync, prefetch_fn)(p, on_dev, cudev, NULL);
    }
    return CUDA_SUCCESS;
}

CUresult gv_oversub_alloc(gv_charge *c, CUdeviceptr *dptr, size_t bytes, uint64_t *spilled,
                          gv_oversub_device_fn device_alloc, void *arg, unsigned managed_flags)
{
    *spilled = 0;
    const gv_devinfo *d;
    CUresult rc = gv_device(c->ordinal, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    gv_region *r = gv_core_region();
    int slot = region_own_slot(r);
    int lockfd = -1;
    uint64_t n = c->bytes;
    uint64_t on_dev = plan(d, n, &lockfd);
    if (on_dev < n)
        region_spill_move(r, c->dev, slot, n - on_dev);
    if (on_dev == n && device_alloc) {
        rc = device_alloc(dptr, arg);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            /* Someone holds what the rules say is free (a process without
             * the library, memory the driver took on its own): the host. */
            gv_log(GV_LOG_INFO, "the device refused %llu bytes within the rules; spilled",
                   (unsigned long long)n);
            region_spill_move(r, c->dev, slot, n);
            on_dev = 0;
            rc = managed(dptr, bytes, CU_MEM_ATTACH_GLOBAL, 0);
        }
    } else {
        rc = managed(dptr, bytes, managed_flags ? managed_flags : CU_MEM_ATTACH_GLOBAL, on_dev);
    }
    if (rc != CUDA_SUCCESS) {
        /* The caller cancels the charge: the spilled part goes back here. */
        if (on_dev < n)
            region_release_spill(r, c->dev, slot, 0 + (n - on_dev), n - on_dev);
        c->bytes = on_dev;
    } else {
        *spilled = n - on_dev;
    }
    gv_oversub_note(c->dev);
    gv_node_unlock(lockfd);
    return rc;
}

int gv_oversub_device_ok(const gv_charge *c, int *lockfd)
{
    *lockfd = -1;
    const gv_devinfo *d;
    if (!gv_oversub_on() || !c->active || gv_device(c->ordinal, &d) != CUDA_SUCCESS)
        return 1;
    if (plan(d, c->bytes, lockfd) >= c->bytes)
        return 1;
    gv_node_unlock(*lockfd);
    *lockfd = -1;
    return 0;
}

void gv_oversub_done(int dev, int lockfd)
{
    gv_oversub_note(dev);
    gv_node_unlock(lockfd);
}
