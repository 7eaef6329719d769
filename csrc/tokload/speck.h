/*
 * speck.h -- the Speck64/128 block cipher.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * Construction: Beaulieu, Shors, Smith, Treatman-Clark, Weeks, Wingers, "The
 * SIMON and SPECK Families of Lightweight Block Ciphers", ePrint 2013/404.
 * Speck64/128: 32-bit words, 4 key words, 27 rounds, rotations 8 (right, on x)
 * and 3 (left, on y).  It is the round function of the permutation in gfc.h.
 *
 * Word order: a 64-bit block is (x, y) = (high word, low word); the 128-bit key
 * is (l2, l1, l0, k0) from the most significant word down, as the paper prints
 * it.  Words are split and joined with shifts, never with pointer casts, so
 * the result does not depend on the host's endianness or on strict aliasing.
 */
#ifndef TOKLOAD_SPECK_H
#define TOKLOAD_SPECK_H

#include "common.h"

#define TL_SPECK_ROUNDS 27

TL_INLINE uint32_t tl_rotr32(uint32_t x, unsigned s) { return (x >> s) | (x << (32u - s)); }
TL_INLINE uint32_t tl_rotl32(uint32_t x, unsigned s) { return (x << s) | (x >> (32u - s)); }

/* Expand the key (l2, l1, l0, k0) into the 27 round keys rk[0..26]. */
TL_INLINE void tl_speck_expand(uint32_t k0, uint32_t l0, uint32_t l1, uint32_t l2,
                               uint32_t rk[TL_SPECK_ROUNDS])
{
    uint32_t l[3] = {l0, l1, l2}; /* rolling buffer: l_t lives in l[t % 3] */
    uint32_t k = k0;
    rk[0] = k;
    for (uint32_t t = 0; t < TL_SPECK_ROUNDS - 1; t++) {
        uint32_t nl = (tl_rotr32(l[t % 3], 8) + k) ^ t;
        l[t % 3] = nl; /* l_{t+3} replaces l_t */
        k = tl_rotl32(k, 3) ^ nl;
        rk[t + 1] = k;
    }
}

/* Encrypt one block: x is the high word, y the low word of the 64-bit block. */
TL_INLINE uint64_t tl_speck_encrypt(const uint32_t rk[TL_SPECK_ROUNDS], uint64_t block)
{
    uint32_t x = (uint32_t)(block >> 32), y = (uint32_t)block;
    for (int t = 0; t < TL_SPECK_ROUNDS; t++) {
        x = (tl_rotr32(x, 8) + y) ^ rk[t];
        y = tl_rotl32(y, 3) ^ x;
    }
    return ((uint64_t)x << 32) | y;
}

/*
 * Encrypt TL_SPECK_LANES independent blocks in lockstep.  The inner loop over
 * lanes has no dependencies, so the compiler turns it into SIMD code (4, 8 or
 * 16 lanes per instruction depending on the target).
 */
#define TL_SPECK_LANES 16

TL_INLINE void tl_speck_encrypt_lanes(const uint32_t rk[TL_SPECK_ROUNDS],
                                      uint32_t x[TL_SPECK_LANES], uint32_t y[TL_SPECK_LANES])
{
    for (int t = 0; t < TL_SPECK_ROUNDS; t++) {
        const uint32_t k = rk[t];
        for (int l = 0; l < TL_SPECK_LANES; l++) {
            uint32_t xl = (tl_rotr32(x[l], 8) + y[l]) ^ k;
            x[l] = xl;
            y[l] = tl_rotl32(y[l], 3) ^ xl;
        }
    }
}

/*
 * v[l] = the encryption of block v[l] for l < TL_SPECK_LANES.  The lanes pass
 * through arrays, so that GCC 12 vectorizes the rounds (with x and y set from
 * an expression such as R0 + l, or the result read straight from x and y, it
 * leaves all 16 lanes scalar).
 */
TL_INLINE void tl_speck_encrypt_blocks(const uint32_t rk[TL_SPECK_ROUNDS], uint64_t v[TL_SPECK_LANES])
{
    uint32_t x[TL_SPECK_LANES], y[TL_SPECK_LANES];
    for (int l = 0; l < TL_SPECK_LANES; l++) {
        x[l] = (uint32_t)(v[l] >> 32);
        y[l] = (uint32_t)v[l];
    }
    tl_speck_encrypt_lanes(rk, x, y);
    for (int l = 0; l < TL_SPECK_LANES; l++) v[l] = ((uint64_t)x[l] << 32) | y[l];
}

#endif /* TOKLOAD_SPECK_H */
