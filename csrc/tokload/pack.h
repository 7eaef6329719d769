/*
 * pack.h -- whole documents into rows of W tokens: best-fit decreasing, the
 * greedy packing it is compared with, and the attention metadata of such rows.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * Pure integer work on the caller's memory.  A group of n documents (lengths
 * capped at W: a longer document is truncated to fill a row of its own) is
 * packed best-fit decreasing: documents by decreasing length (ties: in
 * order; a stable radix sort, sort.h), each into the open row with the least
 * room that holds it, else a new row.  The open rows are kept in buckets by
 * their room (0..W), and a bitset of the non-empty buckets, in levels of 64-bit
 * words, finds the least room >= a length in a few word operations per level
 * (tl_pack_bits: nothing of size W is cleared, so a group's cost does not grow
 * with the window).  The rows are then numbered by their first document, and each row
 * lists its documents in order: the group's order survives everywhere but in
 * which documents share a row.
 */
#ifndef TOKLOAD_PACK_H
#define TOKLOAD_PACK_H

#include "bounds.h"
#include "common.h"
#include "sort.h"

#include <string.h>

#define TL_PACK_NONE UINT32_MAX
/* The largest W: a step's cu_seqlens are int32, and a length and an index share a key. */
#define TL_PACK_MAX_WINDOW ((uint64_t)1 << 30)
#define TL_PACK_MAX_DOCS ((size_t)1 << 31)

/*
 * The open rows' rooms (0..W) as a bitset of levels: bit c of level 0 says some
 * open row has room c, bit j of level k + 1 that word j of level k is not 0.  A
 * word of a level below the top is valid only while its bit one level up is
 * set: it is zeroed when that bit is set, so neither those levels nor the
 * buckets' heads are ever cleared as a whole, and a call touches memory for
 * the rooms it uses, not for W (a window of 2**30 tokens would otherwise clear
 * 4 GiB per group).  The top level (at most 64 words) is zeroed.
 */
#define TL_PACK_LEVELS 6

typedef struct {
    uint64_t *lv[TL_PACK_LEVELS];
    size_t nw[TL_PACK_LEVELS];
    int top;
} tl_pack_bits;

/* Words of each level for rooms 0..W; returns the top level. */
TL_INLINE int tl_pack_bits_shape(uint64_t W, size_t *nw)
{
    int k = 0;
    nw[0] = (size_t)(W >> 6) + 1;
    while (nw[k] > 64) {
        nw[k + 1] = (nw[k] >> 6) + 1;
        k++;
    }
    return k;
}

TL_INLINE size_t tl_pack_bits_words(uint64_t W)
{
    size_t nw[TL_PACK_LEVELS], total = 0;
    int top = tl_pack_bits_shape(W, nw);
    for (int k = 0; k <= top; k++) total += nw[k];
    return total;
}

TL_INLINE void tl_pack_bits_init(tl_pack_bits *b, uint64_t W, uint64_t *words)
{
    b->top = tl_pack_bits_shape(W, b->nw);
    for (int k = 0; k <= b->top; k++) {
        b->lv[k] = words;
        words += b->nw[k];
    }
    memset(b->lv[b->top], 0, b->nw[b->top] * sizeof(uint64_t));
}

/* Whether word w of level k holds meaningful bits (its bit one level up is set). */
TL_INLINE int tl_pack_bits_valid(const tl_pack_bits *b, int k, uint64_t w)
{
    for (int j = b->top; j > k; j--) {
        int up = 6 * (j - k); /* level j's word on w's path, and the bit below it */
        uint64_t word = w >> up, bit = (w >> (up - 6)) & 63;
        if (!((b->lv[j][word] >> bit) & 1)) return 0;
    }
    return 1;
}

TL_INLINE void tl_pack_bits_set(tl_pack_bits *b, uint64_t c)
{
    for (int k = b->top; k > 0; k--) { /* from the top: each word valid once reached */
        uint64_t below = c >> (6 * k), bit = (uint64_t)1 << (below & 63);
        uint64_t *word = &b->lv[k][below >> 6];
        if (!(*word & bit)) {
            *word |= bit;
            b->lv[k - 1][below] = 0;
        }
    }
    b->lv[0][c >> 6] |= (uint64_t)1 << (c & 63);
}

/* Clears bit c (set), and each level's bit whose word below became 0. */
TL_INLINE void tl_pack_bits_clear(tl_pack_bits *b, uint64_t c)
{
    for (int k = 0; k <= b->top; k++) {
        uint64_t *word = &b->lv[k][c >> 6];
        *word &= ~((uint64_t)1 << (c & 63));
        if (*word) return;
        c >>= 6;
    }
}

/* The least set bit >= from (a room), or UINT64_MAX: up the levels until a word
 * has a set bit at or after the place, then down through the words it names. */
TL_INLINE uint64_t tl_pack_bits_find(const tl_pack_bits *b, uint64_t from)
{
    uint64_t f = from, at = UINT64_MAX;
    int k = 0;
    for (;;) {
        uint64_t w = f >> 6;
        if (w >= b->nw[k]) return UINT64_MAX;
        if (tl_pack_bits_valid(b, k, w)) {
            uint64_t m = b->lv[k][w] & (~(uint64_t)0 << (f & 63));
            if (m) {
                at = (w << 6) + (uint64_t)__builtin_ctzll(m);
                break;
            }
        }
        if (k == b->top) {
            for (w++; w < b->nw[k] && !b->lv[k][w]; w++) {
            }
            if (w == b->nw[k]) return UINT64_MAX;
            at = (w << 6) + (uint64_t)__builtin_ctzll(b->lv[k][w]);
            break;
        }
        f = w + 1; /* the next word of this level that is not 0, one level up */
        k++;
    }
    for (; k > 0; k--) /* each set bit above names a valid word that is not 0 */
        at = (at << 6) + (uint64_t)__builtin_ctzll(b->lv[k - 1][at]);
    return at;
}

TL_INLINE int tl_pack_bits_has(const tl_pack_bits *b, uint64_t c)
{
    return tl_pack_bits_valid(b, 0, c >> 6) && ((b->lv[0][c >> 6] >> (c & 63)) & 1);
}

/* Bytes of scratch tl_pack_best_fit needs for n documents and rows of W: of them,
 * the buckets' heads (4 (W + 1) bytes) and the bitset's lower levels (about
 * W / 8 bytes) are reserved, not touched but where rooms are used. */
TL_INLINE size_t tl_pack_scratch_bytes(size_t n, uint64_t W)
{
    return 4 * n * sizeof(uint64_t)        /* sort keys and documents, and their scratch */
           + tl_pack_bits_words(W) * sizeof(uint64_t) /* the bitset's levels */
           + 3 * n * sizeof(uint32_t)      /* row of each document, room, bucket links */
           + (size_t)(W + 1) * sizeof(uint32_t); /* bucket heads */
}

/*
 * Best-fit decreasing of documents 0..n-1 (lengths len[], capped at W) into
 * rows of W tokens.  Writes order[0..n) (the documents row by row, each row's in
 * increasing order) and starts[0..rows] (row k is order[starts[k]..starts[k+1])),
 * rows numbered by their first document.  Returns the number of rows (0 for
 * n = 0).  Needs 1 <= W <= TL_PACK_MAX_WINDOW, n <= TL_PACK_MAX_DOCS, and
 * tl_pack_scratch_bytes(n, W) bytes of scratch (8-byte aligned).
 */
TL_INLINE size_t tl_pack_best_fit(const uint64_t *len, size_t n, uint64_t W, void *scratch,
                                  uint32_t *order, uint32_t *starts)
{
    uint64_t *keys = (uint64_t *)scratch, *docs = keys + n;
    uint64_t *words = docs + 3 * n; /* after the sort's scratch (2n) */
    tl_pack_bits open;
    tl_pack_bits_init(&open, W, words);
    uint32_t *row_of = (uint32_t *)(words + tl_pack_bits_words(W));
    uint32_t *room = row_of + n;
    uint32_t *link = room + n;
    uint32_t *head = link + n; /* head[c]: valid while room c's bit is set */
    for (size_t i = 0; i < n; i++) {
        keys[i] = W - (len[i] < W ? len[i] : W); /* by decreasing length, */
        docs[i] = i;                             /* then in order: the sort is stable */
    }
    tl_sort_pairs(keys, docs, n, docs + n, docs + 2 * n);
    uint32_t rows = 0;
    for (size_t j = 0; j < n; j++) {
        uint32_t i = (uint32_t)docs[j];
        uint64_t l = W - keys[j];
        uint64_t c = tl_pack_bits_find(&open, l);
        uint32_t r;
        uint64_t left;
        if (c == UINT64_MAX) { /* no open row holds it: a new one */
            r = rows++;
            left = W - l;
        } else { /* the row that last got room c */
            r = head[c];
            head[c] = link[r];
            if (head[c] == TL_PACK_NONE) tl_pack_bits_clear(&open, c);
            left = c - l;
        }
        room[r] = (uint32_t)left;
        if (tl_pack_bits_has(&open, left)) {
            link[r] = head[left];
        } else {
            link[r] = TL_PACK_NONE;
            tl_pack_bits_set(&open, left);
        }
        head[left] = r;
        row_of[i] = r;
    }
    /* Number the rows by their first document (room[] becomes the new number),
     * count their documents (link[]), then place the documents in order. */
    for (uint32_t r = 0; r < rows; r++) room[r] = TL_PACK_NONE;
    uint32_t next = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t r = row_of[i];
        if (room[r] == TL_PACK_NONE) {
            room[r] = next;
            link[next] = 0;
            next++;
        }
        link[room[r]]++;
    }
    starts[0] = 0;
    for (uint32_t k = 0; k < rows; k++) starts[k + 1] = starts[k] + link[k];
    for (uint32_t k = 0; k < rows; k++) link[k] = starts[k];
    for (size_t i = 0; i < n; i++) order[link[room[row_of[i]]]++] = (uint32_t)i;
    return rows;
}

/* Rows greedy packing fills: documents in order, a new row whenever the next
 * one does not fit in the current row (lengths capped at W).  Returns the
 * number of rows (0 for n = 0). */
TL_INLINE uint64_t tl_pack_greedy(const uint64_t *len, size_t n, uint64_t W)
{
    uint64_t rows = 0, used = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t l = len[i] < W ? len[i] : W;
        if (rows == 0 || used + l > W) {
            rows++;
            used = l;
        } else {
            used += l;
        }
    }
    return rows;
}

/*
 * Where each document of nrows rows of W tokens goes: row k holds counts[k]
 * documents of lengths len[] (all rows' back to back), one after the other from
 * the row's start.  dst[d] gets document d's first token's byte offset in the
 * [nrows, W] array of `itemsize`-byte tokens.  Returns 1, or 0 (and *bad = the
 * row) when a row's documents exceed W.
 */
TL_INLINE int tl_pack_offsets(const uint64_t *len, const int64_t *counts, size_t nrows, uint64_t W,
                              uint64_t itemsize, uint64_t *dst, size_t *bad)
{
    size_t d = 0;
    for (size_t b = 0; b < nrows; b++) {
        uint64_t t = 0;
        for (int64_t j = 0; j < counts[b]; j++, d++) {
            if (len[d] > W - t) {
                *bad = b;
                return 0;
            }
            dst[d] = (b * W + t) * itemsize;
            t += len[d];
        }
    }
    return 1;
}

/*
 * Set the padding of nrows rows of W `itemsize`-byte elements at out: row k
 * holds counts[k] documents of lengths len[] (all rows' back to back) from its
 * start (tl_pack_offsets checked that they fit), and each element after them
 * is set to the `itemsize` bytes at value.
 */
TL_INLINE void tl_pack_pad(const uint64_t *len, const int64_t *counts, size_t nrows, uint64_t W,
                           size_t itemsize, const void *value, char *out)
{
    size_t d = 0;
    for (size_t b = 0; b < nrows; b++) {
        uint64_t t = 0;
        for (int64_t j = 0; j < counts[b]; j++, d++)
            t += len[d];
        char *p = out + (b * W + t) * itemsize, *end = out + (b + 1) * W * itemsize;
        if (p >= end)
            continue;
        memcpy(p, value, itemsize);  /* then double what is set until the row is */
        for (size_t have = itemsize; p + have < end; have *= 2)
            memcpy(p + have, p, (size_t)(end - p - have) < have ? (size_t)(end - p - have) : have);
    }
}

/*
 * The attention metadata of nrows rows of W tokens.  Row k holds counts[k]
 * documents, of lengths len[] (all rows' back to back), then padding up to W.
 * Its segments are its documents (empty ones have none) and the padding.
 * Fills, at k * W + t for t < W (each of pos, seg, mask may be NULL):
 *   pos[]  the position of token t in its segment (0 at each segment's start);
 *   seg[]  its segment's number in the row (0 for the first; the padding's is
 *          the row's last);
 *   mask[] 1 where token t is a document's token but not its first, else 0
 *          (a document's first token and the padding are not next-token
 *          targets);
 * and cu[0..k]: the segments' starts over the flattened rows, then nrows * W
 * (the return value is k + 1: at most the documents + nrows + 1).  *max_len
 * gets the longest segment.  A row whose documents exceed W: returns 0, *bad
 * gets the row.
 */
TL_WIDE size_t tl_pack_bounds(const uint64_t *len, const int64_t *counts, size_t nrows,
                                uint64_t W, int64_t *pos, int32_t *seg, uint8_t *mask,
                                int64_t *cu, uint64_t *max_len, size_t *bad)
{
    size_t k = 0, d = 0;
    uint64_t longest = 0;
    for (size_t b = 0; b < nrows; b++) {
        int64_t *p = pos ? pos + b * W : NULL;
        int32_t *sg = seg ? seg + b * W : NULL;
        uint8_t *m = mask ? mask + b * W : NULL;
        uint64_t t = 0;
        int32_t number = 0;
        for (int64_t j = 0; j < counts[b]; j++, d++) {
            uint64_t l = len[d];
            if (l == 0) continue;
            if (l > W - t) {
                *bad = b;
                return 0;
            }
            cu[k++] = (int64_t)(b * W + t);
            tl_segment_fill(p, sg, m, t, t + l, number, 1);
            if (l > longest) longest = l;
            number++;
            t += l;
        }
        if (t < W) { /* the padding: one segment, no targets */
            cu[k++] = (int64_t)(b * W + t);
            tl_segment_fill(p, sg, m, t, W, number, 0);
            if (W - t > longest) longest = W - t;
        }
    }
    cu[k++] = (int64_t)(nrows * W);
    *max_len = longest;
    return k;
}

#endif /* TOKLOAD_PACK_H */
