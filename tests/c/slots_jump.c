/*
 * tl_slots_jump_lanes (csrc/tokload/slots.h) against an exact count of each
 * component's slots before T0, with T0 at a slot's time and one ulp either side:
 * where the estimate ceil(T0 * k - u) is off by a rounding, the lanes must say
 * so (the caller then counts one slot at a time); where they do not, next[],
 * cur[], the sum and the live components must be exact.  Built and run by
 * tests/test_blend.py; prints "asked A missed M wrong W", exits 1 if W > 0.
 */
#include <stdio.h>
#include <stdlib.h>
#include "tokload/slots.h"
int main(void)
{
    double phase[256], cur[256];
    int64_t next[256], counts[256];
    long asked = 0, missed = 0, wrong = 0;
    srand(7);
    for (int trial = 0; trial < 3000; trial++) {
        size_t C = 1 + (size_t)(rand() % 128);
        for (size_t c = 0; c < C; c++) counts[c] = rand() % 4 == 0 ? 0 : 1 + rand() % 300;
        uint32_t rk[TL_SPECK_ROUNDS];
        uint64_t key = tl_gfc_epoch_seed(11, (uint64_t)trial);
        tl_speck_expand((uint32_t)key, (uint32_t)(key >> 32), TL_EPOCH_KEY_L1, TL_EPOCH_KEY_L2, rk);
        tl_slots_phases(rk, C, phase);
        for (int w = 0; w < 40; w++) {
            size_t c0 = (size_t)(rand() % (int)C);
            if (counts[c0] == 0) continue;
            int64_t j0 = rand() % counts[c0];
            double T0 = tl_slots_time(j0, phase[c0], counts[c0]);
            if (w % 3 == 1) T0 = nextafter(T0, 2.0);
            if (w % 3 == 2) T0 = nextafter(T0, -1.0);
            int64_t at;
            size_t h;
            asked++;
            if (tl_slots_jump_lanes(T0, counts, C, phase, cur, next, &at, &h)) {
                missed++;
                continue;
            }
            int64_t sum = 0;
            size_t live = 0;
            for (size_t c = 0; c < C; c++) {
                int64_t j = 0;
                while (j < counts[c] && tl_slots_time(j, phase[c], counts[c]) < T0) j++;
                double t = j < counts[c] ? tl_slots_time(j, phase[c], counts[c]) : INFINITY;
                if (next[c] != j || cur[c] != t) wrong++;
                sum += j;
                live += j < counts[c];
            }
            if (sum != at || live != h) wrong++;
        }
    }
    printf("asked %ld missed %ld wrong %ld\n", asked, missed, wrong);
    return wrong != 0;
}
