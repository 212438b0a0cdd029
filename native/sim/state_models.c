/*
 * state_models.c - the GPU models GPUVISOR_SIM_TOPOLOGY knows by name:
 * memory, SMs, NVLinks and the MIG GPU-instance profile table (profile
 * index, id, name, memory, memory and compute slices, SMs, instances on an
 * empty GPU, legal placements, engines), as NVIDIA's MIG user guide and
 * `nvidia-smi mig -lgip` / `-lgipp` give them (docs/simulator.md says
 * which memory sizes are derived rather than read off a real GPU).
 */
#include <strings.h>

#include "sim.h"

#define P(idx, id, name, mib, ms, cs, sms, max, starts, ce, dec, enc, jpg, ofa) \
    { idx, id, name, mib, ms, cs, sms, max, starts, ce, dec, enc, jpg, ofa }

/* placements' start slices, as bit masks */
#define ALL7 0x7fu                      /* 0..6 */
#define EVEN4 0x55u                     /* 0, 2, 4, 6 */
#define EVEN3 0x15u                     /* 0, 2, 4 */
#define HALVES 0x11u                    /* 0, 4 */
#define FIRST 0x01u                     /* 0 */

/* The two sizes of a GPU (A100 40 and 80 GB; H100 and H200) share their
 * profiles but for memory: that of 1, 2, 4 and 8 memory slices, in the
 * names' GB (g1..g8) and in MiB (m1..m8). */
#define GA100_PROFILES(g1, g2, g4, g8, m1, m2, m4, m8)                      \
    P(0, 19, "1g." g1 "gb", m1, 1, 1, 14, 7, ALL7, 1, 0, 0, 0, 0),          \
    P(7, 20, "1g." g1 "gb+me", m1, 1, 1, 14, 1, ALL7, 1, 1, 0, 1, 1),       \
    P(9, 15, "1g." g2 "gb", m2, 2, 1, 14, 4, EVEN4, 1, 1, 0, 0, 0),         \
    P(1, 14, "2g." g2 "gb", m2, 2, 2, 28, 3, EVEN3, 2, 1, 0, 0, 0),         \
    P(2, 9, "3g." g4 "gb", m4, 4, 3, 42, 2, HALVES, 3, 2, 0, 0, 0),         \
    P(3, 5, "4g." g4 "gb", m4, 4, 4, 56, 1, FIRST, 4, 2, 0, 0, 0),          \
    P(4, 0, "7g." g8 "gb", m8, 8, 7, 98, 1, FIRST, 7, 5, 0, 1, 1)
#define GH100_PROFILES(g1, g2, g4, g8, m1, m2, m4, m8)                      \
    P(0, 19, "1g." g1 "gb", m1, 1, 1, 16, 7, ALL7, 1, 1, 0, 1, 0),          \
    P(7, 20, "1g." g1 "gb+me", m1, 1, 1, 16, 1, ALL7, 1, 1, 0, 1, 1),       \
    P(9, 15, "1g." g2 "gb", m2, 2, 1, 26, 4, EVEN4, 1, 1, 0, 1, 0),         \
    P(1, 14, "2g." g2 "gb", m2, 2, 2, 32, 3, EVEN3, 2, 2, 0, 2, 0),         \
    P(2, 9, "3g." g4 "gb", m4, 4, 3, 60, 2, HALVES, 3, 3, 0, 3, 0),         \
    P(3, 5, "4g." g4 "gb", m4, 4, 4, 64, 1, FIRST, 4, 4, 0, 4, 0),          \
    P(4, 0, "7g." g8 "gb", m8, 8, 7, 132, 1, FIRST, 8, 7, 0, 7, 1)

static const sim_model models[] = {
    { {"NVIDIA A30", NULL, NULL}, 24576, 56, 4, 4, 4, 5, {
        P(0, 14, "1g.6gb", 5952, 1, 1, 14, 4, 0x0fu, 1, 0, 0, 0, 0),
        P(7, 21, "1g.6gb+me", 5952, 1, 1, 14, 1, 0x0fu, 1, 1, 0, 1, 1),
        P(1, 5, "2g.12gb", 12160, 2, 2, 28, 2, 0x05u, 2, 2, 0, 0, 0),
        P(8, 6, "2g.12gb+me", 12160, 2, 2, 28, 1, 0x05u, 2, 2, 0, 1, 1),
        P(3, 0, "4g.24gb", 24320, 4, 4, 56, 1, FIRST, 4, 4, 0, 1, 1),
    } },
    { {"NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB", NULL}, 40960, 108, 12, 8, 7, 7, {
        GA100_PROFILES("5", "10", "20", "40", 4864, 9856, 20096, 40320),
    } },
    { {"NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", NULL}, 81920, 108, 12, 8, 7, 7, {
        GA100_PROFILES("10", "20", "40", "80", 9728, 19968, 40192, 80640),
    } },
    { {"NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100"}, 81559, 132, 18, 8, 7, 7, {
        GH100_PROFILES("10", "20", "40", "80", 9984, 20096, 40448, 81152),
    } },
    { {"NVIDIA H200", NULL, NULL}, 143771, 132, 18, 8, 7, 7, {
        GH100_PROFILES("18", "35", "71", "141", 16896, 35072, 70400, 141568),
    } },
};

#define NMODELS ((int)(sizeof models / sizeof models[0]))

int sim_model_find(const char *name)
{
    for (int i = 0; i < NMODELS; i++)
        for (int k = 0; k < 3 && models[i].names[k]; k++)
            if (!strcasecmp(models[i].names[k], name))
                return i;
    return -1;
}

const sim_model *sim_model_get(int index)
{
    return index >= 0 && index < NMODELS ? &models[index] : NULL;
}

const sim_model *sim_gpu_model(int gpu)
{
    sim_shared *S = sim_state();
    if (!S || !S->topology || gpu < 0 || gpu >= (int)S->ndev)
        return NULL;
    return sim_model_get(S->topo[gpu].model);
}
