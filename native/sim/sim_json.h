/* sim_json.h - the small strict JSON reader of state_json.c. */
#ifndef GV_SIM_JSON_H
#define GV_SIM_JSON_H

#include <stddef.h>

#include "sim.h"

enum { SJ_NULL, SJ_BOOL, SJ_INT, SJ_STR, SJ_ARR, SJ_OBJ };

typedef struct sj_val {
    int type;
    int len;                            /* members of an array or object */
    long long i;                        /* SJ_INT, SJ_BOOL (0/1) */
    const char *s;                      /* SJ_STR */
    const char *key;                    /* its key, inside an object */
    int child, next;                    /* first member, next sibling */
} sj_val;

/* Parse text (modified in place) into pool (max values): the root's index,
 * or -1 with one line in err. */
SIM_HIDDEN int sj_parse(char *text, sj_val *pool, int max, char *err, size_t errlen);
/* the member key of object obj, or -1 */
SIM_HIDDEN int sj_get(const sj_val *pool, int obj, const char *key);
SIM_HIDDEN const char *sj_type_name(int type);

#endif /* GV_SIM_JSON_H */
