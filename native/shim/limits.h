/*
 * limits.h - the one parser for memory limits and control switches.
 *
 * Accepted memory sizes (gv_parse_memory_limit, exported in gpuvisor.h):
 *   1073741824          plain bytes (an integer)
 *   1g 1G 1Gi 1GiB 1gb  k, m, g or t (binary: 1k = 1024), case-insensitive,
 *                       optionally followed by i, b or ib
 *   1.5g                decimals are accepted with a unit (rounded down
 *                       to whole bytes, at most 18 fraction digits)
 *   50%  12.5%          a percentage (1..100, at most 6 fraction digits)
 *                       of the device's physical memory
 * Surrounding whitespace is ignored.  Everything else is GV_EINVAL: empty,
 * signs, zero, exponents, spaces inside, unknown units, more than 2^64-1.
 *
 * These run at process initialisation, not on the allocation path; they
 * read the environment every time (nothing is cached).
 *
 * GPUVISOR_LIMITS_FILE: when set, the limit variables below (the memory and
 * SM limit families, GPUVISOR_SM_POLICY, GPU_CORE_UTILIZATION_POLICY,
 * CUDA_TASK_PRIORITY) are read from that file (NAME=value lines, # comments)
 * instead of the environment, with the same grammar; a file that is missing,
 * malformed or empty is reported by limits_check_env, and by
 * limits_memory_for_ordinal / limits_sm_for_ordinal, so it fails closed.
 * gpuvisor device-plugin writes it for each container.
 */
#ifndef GV_LIMITS_H
#define GV_LIMITS_H

#include <stddef.h>
#include <stdint.h>

#define GV_ENV_LIMIT "CUDA_DEVICE_MEMORY_LIMIT"
#define GV_ENV_DISABLE "CUDA_DISABLE_CONTROL"
#define GV_ENV_OVERSUBSCRIBE "CUDA_OVERSUBSCRIBE"

/* Where every function here reads the environment: env (a NULL-terminated
 * array of "NAME=value" strings) in the calling thread from now on, or the
 * process's own again (NULL).  gv_env_device_limits reads a workload's
 * environment this way, without changing the process's. */
void limits_use_env(const char *const *env);
/* getenv(name) in that environment. */
const char *limits_getenv(const char *name);

/* Like gv_parse_memory_limit, and on failure *why gets a short reason
 * ("not a memory size ...", "must be greater than zero", ...). */
int limits_parse(const char *text, uint64_t physical_total, uint64_t *bytes,
                 const char **why);

/* value (at most max bytes of it) as a message quotes it, on one line:
 * newline, tab and carriage return as \n \t \r, other control characters
 * as \xNN.  Cut to fit outlen; always terminated. */
void limits_quote(char *out, size_t outlen, const char *value, size_t max);

/* Limit for device ordinal: CUDA_DEVICE_MEMORY_LIMIT_<ordinal>, else
 * CUDA_DEVICE_MEMORY_LIMIT.  Unset or empty -> GV_UNLIMITED and 0.
 * Malformed -> GV_EINVAL and one line in err naming variable and value. */
int limits_memory_for_ordinal(int ordinal, uint64_t physical_total,
                              uint64_t *bytes, char *err, size_t errlen);

/* Validate every CUDA_DEVICE_MEMORY_LIMIT* variable in the environment
 * (names and values; percentages are syntax-checked only).  0 when all are
 * fine, else GV_EINVAL with the first problem in err (one line). */
int limits_check_env(char *err, size_t errlen);

/* CUDA_DISABLE_CONTROL: 1 for true/1/yes/on, 0 for false/0/no/off/unset.
 * Anything else is reported (one line) and gives 0: keep enforcing. */
int limits_control_disabled(void);

/* ---- oversubscription (docs/oversubscription.md) -------------------------
 *
 * CUDA_OVERSUBSCRIBE: true/1/yes/on turns it on; false/0/no/off, empty or
 * unset leaves it off; anything else is an error (fail closed).
 * GPUVISOR_MEMORY_SCALING: the node-wide scaling factor S (HAMi's
 * deviceMemoryScaling), a decimal from 0.1 to 100 with at most 3 fraction
 * digits; unset or empty: 1.  Checked whether or not oversubscription is on.
 */
#define GV_ENV_SCALING "GPUVISOR_MEMORY_SCALING"
/* Both variables: GV_OK, or GV_EINVAL with one line naming the variable and
 * its value in err. */
int limits_oversub_check_env(char *err, size_t errlen);
/* CUDA_OVERSUBSCRIBE is on (call after limits_oversub_check_env). */
int limits_oversubscribe(void);
/* S in thousandths (1000 when unset), after limits_oversub_check_env. */
uint32_t limits_memory_scaling_milli(void);
/* The guarantee a quota of limit bytes gives on a device of physical bytes
 * under S (thousandths): min(limit, limit / S, physical); physical for an
 * unlimited quota. */
uint64_t limits_guarantee(uint64_t limit, uint64_t physical, uint32_t scaling_milli);

/* ---- SM-time quota ------------------------------------------------------
 *
 * CUDA_DEVICE_SM_LIMIT, CUDA_DEVICE_SM_LIMIT_<ordinal>: a whole number of
 * percent, 1..100; 0 or unset means no limit.  GPUVISOR_SM_POLICY:
 * fixed-share (default), burst-share, best-effort.  GPU_CORE_UTILIZATION_POLICY
 * (HAMi's): default (GPUVISOR_SM_POLICY decides), force (fixed-share whatever
 * GPUVISOR_SM_POLICY says), disable (SM limits are ignored).
 * CUDA_TASK_PRIORITY: 0 high, 1 low; unset or empty means 1 (low), as in
 * HAMi-core.  Anything else is reported and fails closed, like a bad
 * memory limit.
 */
#define GV_ENV_SM_LIMIT "CUDA_DEVICE_SM_LIMIT"
#define GV_ENV_SM_POLICY "GPUVISOR_SM_POLICY"
#define GV_ENV_CORE_POLICY "GPU_CORE_UTILIZATION_POLICY"
#define GV_ENV_PRIORITY "CUDA_TASK_PRIORITY"

/* Percent for ordinal (0: no limit).  GV_EINVAL with one line in err. */
int limits_sm_for_ordinal(int ordinal, unsigned *pct, char *err, size_t errlen);
/* Validate every SM-related variable; 0 or GV_EINVAL with one line in err. */
int limits_sm_check_env(char *err, size_t errlen);
/* The policy (enum gv_sm_policy), or -1 when SM limits are disabled.
 * Call after limits_sm_check_env succeeded. */
int limits_sm_policy(void);
/* CUDA_TASK_PRIORITY: 0 or 1 (unset or empty: 1). */
unsigned limits_task_priority(void);

#endif /* GV_LIMITS_H */
