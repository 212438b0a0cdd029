/*
 * link_must.h - MUST(call) for the t_link_* programs that run a scenario in
 * one function: a CUDA call that fails ends the scenario with exit status 3
 * (returned, so that the caller's clean-up still runs), naming the call and
 * its result on stderr.
 */
#ifndef GV_LINK_MUST_H
#define GV_LINK_MUST_H

#include <stdio.h>

#define MUST(call)                                                            \
    do {                                                                      \
        CUresult rc_ = (call);                                                \
        if (rc_ != CUDA_SUCCESS) {                                            \
            fprintf(stderr, "%s: %d\n", #call, (int)rc_);                     \
            return 3;                                                         \
        }                                                                     \
    } while (0)

#endif
