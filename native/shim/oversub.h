/*
 * oversub.h - memory oversubscription (oversub.c, docs/oversubscription.md).
 */
#ifndef GV_OVERSUB_H
#define GV_OVERSUB_H

#include "core.h"

/* Read CUDA_OVERSUBSCRIBE and GPUVISOR_MEMORY_SCALING (already checked)
 * once, when the library sets itself up. */
void gv_oversub_configure(void);
/* Whether CUDA_OVERSUBSCRIBE is on in this process (one load). */
int gv_oversub_on(void);
/* A device this process uses under CUDA_OVERSUBSCRIBE: record the
 * container's guarantee in the region and claim its row in the node's
 * guarantee file, so that the other containers leave the guarantee free
 * from now on.  Nothing when oversubscription is off. */
void gv_oversub_attach(const gv_devinfo *d);
/* The container's device-resident bytes on region device dev changed:
 * tell the node's guarantee file (one store; nothing when off). */
void gv_oversub_note(int dev);

/* Allocate bytes for charge c (reserved, c->bytes rounded): on the device
 * (device_alloc(dptr, arg), when given) where the rules allow it all, else
 * managed memory (managed_flags, 0: global) whose part beyond what the
 * device may take lives on the host.  *spilled: the charged bytes served
 * from host memory (counted so in the region).  On failure c->bytes is
 * what the caller's gv_charge_cancel still has to give back. */
typedef CUresult (*gv_oversub_device_fn)(CUdeviceptr *dptr, void *arg);
CUresult gv_oversub_alloc(gv_charge *c, CUdeviceptr *dptr, size_t bytes, uint64_t *spilled,
                          gv_oversub_device_fn device_alloc, void *arg, unsigned managed_flags);

/* A memory pool must grow by the charged c->bytes (reserved) for a
 * stream-ordered allocation: whether the rules let all of it go to the
 * device.  1: yes, and *lockfd is the node lock when that borrows beyond
 * the guarantee, held until gv_oversub_done after the pool's call; 0: no,
 * nothing held, the allocation is to be spilled (hooks_pool.c). */
int gv_oversub_device_ok(const gv_charge *c, int *lockfd);
/* After the call gv_oversub_device_ok allowed: the node file told, the
 * node lock given back. */
void gv_oversub_done(int dev, int lockfd);

#endif /* GV_OVERSUB_H */
