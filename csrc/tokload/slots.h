/*
 * slots.h -- the component and lane of a Blend's slots (tokload/views/blend.py).
 *
 * A blend's positions are cut into blocks of m slots.  In a block b of a segment
 * whose component c has counts[c] slots, component c's j-th slot sits at time
 *     t(c, j) = ((double)j + u_c) / (double)counts[c],   j = 0 .. counts[c] - 1,
 * with the phase u_c = epoch_seed(epoch_seed(seed ^ "slot", b), c) / 2^64, and
 * the block's slots are all components' times in increasing order, equal times
 * in the order of the components.  These are the same double operations, in the
 * same order, that NumPy does for blend.py's reference layout, so the order is
 * bit for bit the same.
 *
 * tl_slots_block finds the (component, lane) of the slots of one block that are
 * asked for without the block's whole layout: it counts each component's slots
 * before a time close to the slot (exactly, with the times' own double
 * operations), then merges the components' times from there.  For C components:
 *  - up to TL_SLOTS_LINEAR_MAX, a merge step scans the components' next times,
 *    and the jump lands within a slot or two of the slot, on either side (a
 *    step back gives back the last slot taken): O(C) per slot.  The jump
 *    estimates every component's count in SIMD lanes (tl_slots_jump_lanes) and
 *    counts one slot at a time only where a rounding put the estimate off.  For
 *    16 components and a slot in 30 asked, 95 ns a slot against 320 for the heap;
 *  - above, a binary heap keyed by each component's next time, and the jump
 *    lands at most C + 1 slots before the slot: O(C log C) per jump, O(log C)
 *    per slot merged, for blocks whose slots asked for are close together
 *    (TL_SLOTS_SPARSE_GAP); sparser ones take the linear merge whatever C.
 *
 * tl_slots_positions and tl_slots_by_permutation are a Blend's whole lookup of
 * a group of positions (Blend.locate): sorted by position with one radix sort,
 * each block's slots found at once, then grouped by (component, epoch) for
 * one permutation call; before, a dozen NumPy calls around tl_slots_block
 * cost as much as the slots themselves (some 110 ns a position for 1,024).
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 */
#ifndef TOKLOAD_SLOTS_H
#define TOKLOAD_SLOTS_H

#include <math.h>

#include "common.h"
#include "gfc.h"
#include "sort.h"

/* Up to this many components (of a segment), a merge step scans every
 * component's next time instead of keeping a heap (the scan is faster up to
 * about 200 components for sparse slots, fewer for dense ones). */
#ifndef TL_SLOTS_LINEAR_MAX
#define TL_SLOTS_LINEAR_MAX 128
#endif
/* Above TL_SLOTS_LINEAR_MAX components, a block whose slots asked for are
 * this many apart or more on average still takes the linear merge: each slot
 * is a jump of O(C) in lanes and a step or two, where the heap merges every
 * slot between them at O(log C) each (or jumps, landing up to C + 1 slots
 * short).  A shuffled read of a long blend asks one slot a block. */
#ifndef TL_SLOTS_SPARSE_GAP
#define TL_SLOTS_SPARSE_GAP 24
#endif
/* The linear merge jumps to a slot more than this many slots ahead. */
#ifndef TL_SLOTS_LINEAR_GAP
#define TL_SLOTS_LINEAR_GAP 2
#endif

/* The component whose next slot comes first (the lowest index among equal
 * times; an exhausted component's time is +inf). */
TL_INLINE uint32_t tl_slots_argmin(const double *cur, size_t ncomp)
{
    uint32_t best = 0;
    double t = cur[0];
    for (size_t c = 1; c < ncomp; c++) {
        if (cur[c] < t) {
            t = cur[c];
            best = (uint32_t)c;
        }
    }
    return best;
}

/* Whether component a's next slot comes before component b's. */
TL_INLINE int tl_slots_before(const double *cur, uint32_t a, uint32_t b)
{
    return cur[a] < cur[b] || (cur[a] == cur[b] && a < b);
}

TL_INLINE void tl_slots_sift_down(uint32_t *heap, size_t h, size_t i, const double *cur)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, best = i;
        if (l < h && tl_slots_before(cur, heap[l], heap[best]))
            best = l;
        if (r < h && tl_slots_before(cur, heap[r], heap[best]))
            best = r;
        if (best == i)
            return;
        uint32_t t = heap[i];
        heap[i] = heap[best];
        heap[best] = t;
        i = best;
    }
}

/* out[l] = Speck(rk, c0 + l) / 2^64 for l < TL_SPECK_LANES: the phases of 16
 * components at once, in SIMD lanes (TL_LANES_FN, gfc.h).  The same values as
 * the scalar cipher's, converted the same way. */
TL_LANES_FN void tl_slots_phases_lanes(const uint32_t rk[TL_SPECK_ROUNDS], uint64_t c0,
                                       double out[TL_SPECK_LANES])
{
    uint64_t v[TL_SPECK_LANES];
    for (int l = 0; l < TL_SPECK_LANES; l++) v[l] = c0 + (uint64_t)l;
    tl_speck_encrypt_blocks(rk, v);
    for (int l = 0; l < TL_SPECK_LANES; l++) out[l] = (double)v[l] / 18446744073709551616.0;
}

/* phase[c] = Speck(rk, c) / 2^64 for c < ncomp, 16 components at a time (the
 * last group padded).  One component after another, the scalar cipher was
 * most of a block's cost (16 components: 310 of 520 ns for a block with one
 * slot asked). */
TL_INLINE void tl_slots_phases(const uint32_t rk[TL_SPECK_ROUNDS], size_t ncomp, double *phase)
{
    size_t c = 0;
    for (; c + TL_SPECK_LANES <= ncomp; c += TL_SPECK_LANES) tl_slots_phases_lanes(rk, c, phase + c);
    if (c < ncomp) {
        double last[TL_SPECK_LANES];
        tl_slots_phases_lanes(rk, c, last);
        for (size_t l = 0; c + l < ncomp; l++) phase[c + l] = last[l];
    }
}

/* t(c, j): the time of component c's j-th slot (phase u, count k). */
TL_INLINE double tl_slots_time(int64_t j, double u, int64_t k)
{
    return ((double)j + u) / (double)k;
}

/* The linear merge's start at T0 (tl_slots_jump with `linear`) for every
 * component at once, in SIMD lanes: the estimate of component c's slots
 * before T0, ceil(T0 * k - u), checked against its exact times (two divisions
 * each).  Sets next[], cur[], *at and *h as tl_slots_jump does and returns how
 * many components the estimate missed (a rounding: rare); when some did, the
 * caller counts again one slot at a time. */
TL_LANES_FN size_t tl_slots_jump_lanes(double T0, const int64_t *TL_RESTRICT counts, size_t ncomp,
                                       const double *TL_RESTRICT phase, double *TL_RESTRICT cur,
                                       int64_t *TL_RESTRICT next, int64_t *at, size_t *h)
{
    /* Written so that GCC 12 vectorizes it: no floor(), no nested selects, no
     * flag both summed and selected on (each made it branch). */
    int64_t sum = 0, missed = 0, live = 0;
    for (size_t c = 0; c < ncomp; c++) {
        /* j = k if x >= k, floor(x) + 1 if 0 < x < k, else 0 (x > -1); a
         * component without slots (k = 0) gets j = 0 and no next time */
        double k = (double)counts[c], u = phase[c], x = T0 * k - u;
        double up = (double)(int64_t)x + (double)(x > 0.0);
        double j = up < k ? up : k;
        double before = (j - 1.0 + u) / k, here = (j + u) / k;
        double lo = j > 0.0 ? before : -INFINITY, hi = j < k ? here : INFINITY;
        missed += (lo >= T0) + (hi < T0); /* the estimate is off by a slot or more */
        next[c] = (int64_t)j;
        cur[c] = hi;
        sum += (int64_t)j;
    }
    for (size_t c = 0; c < ncomp; c++) live += cur[c] < INFINITY;
    *at = sum;
    *h = (size_t)live;
    return (size_t)missed;
}

/*
 * Start the merge at the first slot whose time is at least T0 (chosen close to
 * slot s): next[c] = the slots of component c before T0 (by the exact times,
 * not the estimate), *h = the components with slots left, and, unless
 * `linear`, heap = those components as a heap (linear: cur[c] = +inf for a
 * component without slots left).  Returns the slot the merge is at (the sum of
 * next[]): at most s for the heap, which only steps forward; about s for
 * `linear`, which steps back too (tl_slots_back).
 */
TL_INLINE int64_t tl_slots_jump(int64_t s, int64_t total, int64_t C, double U,
                                const int64_t *counts, size_t ncomp, const double *phase,
                                double *cur, int64_t *next, uint32_t *heap, size_t *h,
                                int linear)
{
    /* Component c has ceil(T * k_c - u_c) slots before T (clamped to [0, k_c]),
     * so between T * total - U and T * total - U + C of them for C components
     * and U the sum of their phases, T * total - U + C / 2 on average.  The
     * heap: T0 = (s - C + U - 1) / total puts the merge at most C + 1 slots
     * before s (about C / 2 on average), and a second attempt from T0 = 0 only
     * guards the estimate's rounding.  Linear: T0 = (s - C / 2 + U) / total
     * puts it within a slot or two of s, on either side. */
    double target = linear ? (double)s - 0.5 * (double)C + U : (double)(s - C - 1) + U;
    if (linear) {
        int64_t at;
        if (tl_slots_jump_lanes(target > 0.0 ? target / (double)total : 0.0, counts, ncomp,
                                phase, cur, next, &at, h) == 0)
            return at;
    }
    for (int attempt = 0; attempt < 2; attempt++) {
        double T0 = 0.0;
        if (attempt == 0 && target > 0.0)
            T0 = target / (double)total;
        int64_t at = 0;
        *h = 0;
        for (size_t c = 0; c < ncomp; c++) {
            int64_t k = counts[c];
            cur[c] = INFINITY;
            next[c] = 0;
            if (k <= 0)
                continue;
            double u = phase[c], x = T0 * (double)k - u;
            int64_t j = 0; /* about ceil(x), then made exact below */
            if (x >= (double)k)
                j = k;
            else if (x > 0.0)
                j = (int64_t)x + 1;
            while (j > 0 && tl_slots_time(j - 1, u, k) >= T0)
                j--;
            while (j < k && tl_slots_time(j, u, k) < T0)
                j++;
            next[c] = j;
            at += j;
            if (j < k) {
                cur[c] = tl_slots_time(j, u, k);
                if (linear)
                    (*h)++;
                else
                    heap[(*h)++] = (uint32_t)c;
            }
        }
        if (linear)
            return at;
        if (at <= s) {
            for (size_t i = *h / 2; i-- > 0;)
                tl_slots_sift_down(heap, *h, i, cur);
            return at;
        }
    }
    return -1; /* not reached: T0 = 0 puts every component at its first slot */
}

/* Linear merge: step back one slot, giving back the last slot taken (the
 * greatest time, the highest component among equal times).  At least one slot
 * must be taken (some next[c] > 0). */
TL_INLINE void tl_slots_back(const int64_t *counts, size_t ncomp, const double *phase,
                             double *cur, int64_t *next, size_t *h)
{
    size_t best = 0;
    double t = -INFINITY;
    for (size_t c = 0; c < ncomp; c++) {
        if (next[c] > 0) {
            double tc = tl_slots_time(next[c] - 1, phase[c], counts[c]);
            if (tc >= t) {
                t = tc;
                best = c;
            }
        }
    }
    if (next[best] == counts[best])
        (*h)++;
    next[best]--;
    cur[best] = t;
}

/*
 * Block `key` (= epoch_seed(seed ^ "slot", b)) of a segment with counts[0..ncomp):
 * for i < nwant (want[] ascending), comp[i] and lane[i] of slot want[i].
 * Scratch of ncomp entries each: phase and cur (doubles), next (int64), heap
 * (uint32).  Returns the number of wants served: nwant, or fewer when a slot
 * asked for is past the block's slots (the sum of counts).
 */
TL_INLINE size_t tl_slots_block(uint64_t key, const int64_t *counts, size_t ncomp,
                                const int64_t *want, size_t nwant, int64_t *comp, int64_t *lane,
                                double *phase, double *cur, int64_t *next, uint32_t *heap)
{
    size_t h = 0, w = 0;
    int64_t total = 0, active = 0, slot = -1;
    const int linear = ncomp <= TL_SLOTS_LINEAR_MAX || nwant < 2 ||
                       want[nwant - 1] - want[0] >= TL_SLOTS_SPARSE_GAP * (int64_t)(nwant - 1);
    double U = 0.0; /* the sum of the phases */
    /* tl_gfc_epoch_seed(key, c) for every c: one key schedule for the block */
    uint32_t rk[TL_SPECK_ROUNDS];
    tl_speck_expand((uint32_t)key, (uint32_t)(key >> 32), TL_EPOCH_KEY_L1, TL_EPOCH_KEY_L2, rk);
    tl_slots_phases(rk, ncomp, phase);
    for (size_t c = 0; c < ncomp; c++) {
        if (counts[c] <= 0)
            continue;
        U += phase[c];
        total += counts[c];
        active++;
    }
    for (; w < nwant; w++) {
        int64_t s = want[w];
        if (s < 0 || s >= total)
            break;
        /* far ahead (or the first): jump close to it instead of merging there
         * (a jump costs about as much as merging past C slots of a heap, or a
         * few slots of the linear merge, which jumps within a slot or two) */
        if (slot < 0 || s - slot > (linear ? TL_SLOTS_LINEAR_GAP : active + 8)) {
            slot = tl_slots_jump(s, total, active, U, counts, ncomp, phase, cur, next, heap, &h,
                                 linear);
            for (; slot > s; slot--)
                tl_slots_back(counts, ncomp, phase, cur, next, &h);
        }
        while (slot < s && h > 0) {
            uint32_t c = linear ? tl_slots_argmin(cur, ncomp) : heap[0];
            slot++;
            if (++next[c] < counts[c]) {
                cur[c] = tl_slots_time(next[c], phase[c], counts[c]);
            } else {
                cur[c] = INFINITY;
                h--;
                if (!linear)
                    heap[0] = heap[h];
            }
            if (!linear)
                tl_slots_sift_down(heap, h, 0, cur);
        }
        if (h == 0)
            break;
        uint32_t top = linear ? tl_slots_argmin(cur, ncomp) : heap[0];
        comp[w] = top;
        lane[w] = next[top];
    }
    return w;
}

/*
 * The component and own position of n blend positions at once: a Blend's
 * component_positions.  Segment g's blocks start at block seg_first[g]
 * (ascending; seg_first[0] is 0), and each of its blocks holds
 * seg_counts[g * ncomp + c] slots of component c, which had seg_before[g *
 * ncomp + c] positions before the segment.
 *
 * On entry q[i] are the positions and at[i] their places in the caller's
 * order (any values, carried along); on return both are sorted by position,
 * and comp[i], cpos[i] are position q[i]'s component and its own position
 * there.  Scratch: s1 and s2 of n entries, phase of 2 * ncomp, next and heap
 * of ncomp.  Returns n, or the sorted rank of the first position whose slot is
 * past its block's slots (the sum of its segment's counts).
 */
TL_INLINE size_t tl_slots_positions(uint64_t slot_seed, uint64_t m, const int64_t *seg_first,
                                    size_t nseg, const int64_t *seg_counts,
                                    const int64_t *seg_before, size_t ncomp, uint64_t *q,
                                    uint64_t *at, size_t n, uint64_t *s1, uint64_t *s2,
                                    int64_t *comp, int64_t *cpos, double *phase, int64_t *next,
                                    uint32_t *heap)
{
    tl_sort_pairs(q, at, n, s1, s2);
    int64_t *want = (int64_t *)s1, *lane = (int64_t *)s2;
    size_t g = 0;
    for (size_t i = 0; i < n;) {
        uint64_t b = q[i] / m, first = b * m, end = first + m;
        size_t e = i;
        for (; e < n && q[e] < end; e++) want[e] = (int64_t)(q[e] - first);
        while (g + 1 < nseg && (uint64_t)seg_first[g + 1] <= b) g++;
        const int64_t *counts = seg_counts + g * ncomp, *before = seg_before + g * ncomp;
        size_t served = tl_slots_block(tl_gfc_epoch_seed(slot_seed, b), counts, ncomp, want + i,
                                       e - i, comp + i, lane + i, phase, phase + ncomp, next, heap);
        if (served < e - i)
            return i + served;
        int64_t blocks = (int64_t)b - seg_first[g]; /* of the segment, before b */
        for (size_t k = i; k < e; k++)
            cpos[k] = before[comp[k]] + blocks * counts[comp[k]] + lane[k];
        i = e;
    }
    return n;
}

/*
 * Positions located by tl_slots_positions, grouped by the permutation that
 * shuffles each: component c's own position p is index p % sizes[c] of its
 * epoch p / sizes[c], shuffled by the permutation of sizes[c] elements keyed
 * epoch_seed(comp_seeds[c], epoch).  Writes, for the r-th position of the
 * grouped order, ns[r], seeds[r] and js[r] (that permutation and the index
 * into it; runs of one permutation are adjacent) and order[r], its rank in the
 * input.  Scratch: s1, s2 and s3 of n entries, count of ncomp + 1.  Every
 * comp[i] < ncomp, cpos[i] >= 0 and sizes[c] >= 1.
 */
TL_INLINE void tl_slots_by_permutation(const int64_t *comp, const int64_t *cpos, size_t n,
                                       const int64_t *sizes, const uint64_t *comp_seeds,
                                       size_t ncomp, uint64_t *order, uint64_t *s1, uint64_t *s2,
                                       uint64_t *s3, size_t *count, uint64_t *ns, uint64_t *seeds,
                                       uint64_t *js)
{
    /* by epoch (no pass when every position is in one), then stably by component */
    uint64_t *epoch = s1, *rank = s2;
    for (size_t i = 0; i < n; i++) {
        uint64_t p = (uint64_t)cpos[i], k = (uint64_t)sizes[comp[i]];
        epoch[i] = p < k ? 0 : p / k;
        rank[i] = i;
    }
    tl_sort_pairs(epoch, rank, n, order, s3);
    memset(count, 0, (ncomp + 1) * sizeof *count);
    for (size_t i = 0; i < n; i++) count[comp[i] + 1]++;
    for (size_t c = 0; c < ncomp; c++) count[c + 1] += count[c];
    for (size_t i = 0; i < n; i++) {
        size_t r = count[comp[rank[i]]]++;
        order[r] = rank[i];
        s3[r] = epoch[i];
    }
    uint64_t seed = 0;
    for (size_t r = 0; r < n; r++) {
        size_t i = order[r];
        int64_t c = comp[i];
        uint64_t k = (uint64_t)sizes[c], e = s3[r];
        if (r == 0 || c != comp[order[r - 1]] || e != s3[r - 1])
            seed = tl_gfc_epoch_seed(comp_seeds[c], e);
        ns[r] = k;
        seeds[r] = seed;
        js[r] = (uint64_t)cpos[i] - e * k;
    }
}

#endif
