/* alloc_table.c - sharded open-addressing table of charged objects. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_table.h"

#define SHARDS 64u

struct shard {
    pthread_mutex_t lock;
    gv_alloc *slots;      /* kind == 0 marks an empty slot */
    size_t cap;           /* power of two, or 0 */
    size_t n;
} __attribute__((aligned(64)));

static struct shard shards[SHARDS];
static atomic_uint_fast64_t total;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static uint64_t mix(uint32_t kind, uint64_t key)
{
    uint64_t h = key ^ ((uint64_t)kind << 59) ^ (key >> 29);
    h *= 0x9e3779b97f4a7c15ULL;
    return h ^ (h >> 31);
}

static struct shard *shard_of(uint64_t h) { return &shards[h & (SHARDS - 1)]; }

static void fork_prepare(void)
{
    for (unsigned i = 0; i < SHARDS; i++)
        pthread_mutex_lock(&shards[i].lock);
}

static void fork_parent(void)
{
    for (unsigned i = 0; i < SHARDS; i++)
        pthread_mutex_unlock(&shards[i].lock);
}

static void fork_child(void)
{
    /* Device memory does not survive into a forked child: start empty. */
    for (unsigned i = 0; i < SHARDS; i++) {
        free(shards[i].slots);
        shards[i].slots = NULL;
        shards[i].cap = shards[i].n = 0;
        pthread_mutex_unlock(&shards[i].lock);
    }
    atomic_store(&total, 0);
}

static void setup_once(void)
{
    for (unsigned i = 0; i < SHARDS; i++)
        pthread_mutex_init(&shards[i].lock, NULL);
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

static struct shard *lock_shard(uint64_t h)
{
    pthread_once(&atfork_once, setup_once);
    struct shard *s = shard_of(h);
    pthread_mutex_lock(&s->lock);
    return s;
}

/* Probe sequence index for entry (kind,key) in s; cap must be > 0. */
static size_t find(const struct shard *s, uint32_t kind, uint64_t key, uint64_t h)
{
    size_t mask = s->cap - 1, i = (size_t)(h >> 6) & mask;
    while (s->slots[i].kind != 0) {
        if (s->slots[i].kind == kind && s->slots[i].key == key)
            return i;
        i = (i + 1) & mask;
    }
    return i;   /* empty slot where it would go */
}

static int grow(struct shard *s)
{
    size_t ncap = s->cap ? s->cap * 2 : 16;
    gv_alloc *ns = calloc(ncap, sizeof *ns);
    if (!ns)
        return -1;
    gv_alloc *old = s->slots;
    size_t ocap = s->cap;
    s->slots = ns;
    s->cap = ncap;
    for (size_t i = 0; i < ocap; i++) {
        if (old[i].kind == 0)
            continue;
        size_t j = find(s, old[i].kind, old[i].key, mix(old[i].kind, old[i].key));
        s->slots[j] = old[i];
    }
    free(old);
    return 0;
}

int gv_table_put(const gv_alloc *a)
{
    uint64_t h = mix(a->kind, a->key);
    struct shard *s = lock_shard(h);
    int rc = 0;
    if ((s->n + 1) * 4 > s->cap * 3 && grow(s) != 0) {
        rc = -1;
    } else {
        size_t i = find(s, a->kind, a->key, h);
        if (s->slots[i].kind == 0) {
            s->n++;
            atomic_fetch_add(&total, 1);
        }
        s->slots[i] = *a;
    }
    pthread_mutex_unlock(&s->lock);
    return rc;
}

/* Remove slot i, shifting later members of its probe run back. */
static void erase(struct shard *s, size_t i)
{
    size_t mask = s->cap - 1, j = i;
    s->slots[i].kind = 0;
    for (;;) {
        j = (j + 1) & mask;
        if (s->slots[j].kind == 0)
            break;
        size_t home = (size_t)(mix(s->slots[j].kind, s->slots[j].key) >> 6) & mask;
        /* Move j back to i if its home is not in the cyclic range (i, j]. */
        int in_range = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (!in_range) {
            s->slots[i] = s->slots[j];
            s->slots[j].kind = 0;
            i = j;
        }
    }
    s->n--;
    atomic_fetch_sub(&total, 1);
}

/* The entry of (kind, key), under its shard's lock: edited in place (edit,
 * if given), copied out (out, if given), then removed (remove).  1 if
 * there is one. */
static int visit(uint32_t kind, uint64_t key, gv_alloc *out, int remove, gv_table_edit edit,
                 void *arg)
{
    uint64_t h = mix(kind, key);
    struct shard *s = lock_shard(h);
    int found = 0;
    if (s->cap) {
        size_t i = find(s, kind, key, h);
        if (s->slots[i].kind != 0) {
            found = 1;
            if (edit)
                edit(&s->slots[i], arg);
            if (out)
                *out = s->slots[i];
            if (remove)
                erase(s, i);
        }
    }
    pthread_mutex_unlock(&s->lock);
    return found;
}

int gv_table_take(uint32_t kind, uint64_t key, gv_alloc *out)
{
    return visit(kind, key, out, 1, NULL, NULL);
}

int gv_table_get(uint32_t kind, uint64_t key, gv_alloc *out)
{
    return visit(kind, key, out, 0, NULL, NULL);
}

int gv_table_modify(uint32_t kind, uint64_t key, gv_table_edit edit, void *arg)
{
    return visit(kind, key, NULL, 0, edit, arg);
}

int gv_table_take_all(gv_table_match match, gv_table_visit visit, void *arg)
{
    int taken = 0;
    pthread_once(&atfork_once, setup_once);
    for (unsigned k = 0; k < SHARDS; k++) {
        struct shard *s = &shards[k];
        pthread_mutex_lock(&s->lock);
        for (size_t i = 0; i < s->cap;) {
            if (s->slots[i].kind != 0 && match(&s->slots[i], arg)) {
                gv_alloc a = s->slots[i];
                erase(s, i);      /* may shift a later entry into i: re-check i */
                visit(&a, arg);
                taken++;
            } else {
                i++;
            }
        }
        pthread_mutex_unlock(&s->lock);
    }
    return taken;
}

uint64_t gv_table_count_if(gv_table_match match, void *arg)
{
    uint64_t n = 0;
    pthread_once(&atfork_once, setup_once);
    for (unsigned k = 0; k < SHARDS; k++) {
        struct shard *s = &shards[k];
        pthread_mutex_lock(&s->lock);
        for (size_t i = 0; i < s->cap; i++)
            if (s->slots[i].kind != 0 && match(&s->slots[i], arg))
                n++;
        pthread_mutex_unlock(&s->lock);
    }
    return n;
}

uint64_t gv_table_count(void) { return atomic_load(&total); }
