/*
 * gfc.h -- a keyed pseudorandom permutation of [0, n), computed per index.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * Construction: the generalized Feistel cipher, Method 3 ("fe[r,a,b]" with
 * cycle walking, Fe[r,a,b]) of Black & Rogaway, "Ciphers with Arbitrary Finite
 * Domains", CT-RSA 2002, with Speck64/128 as the round function, exactly as the
 * reference library gfc 1.1.0 (PyPI `pygfc`) computes it.  ../shared/GFC.md is
 * the specification; this header follows its section 11 checklist.
 *
 * [0, n) sits in the grid Z_a x Z_a with a = ceil(sqrt(n)).  m splits into
 * (L, R) = (m mod a, m div a); round j (1-based, key index i = j - 1) maps
 * (L, R) -> (R, (L + F_j(R)) mod a) where F_j(R) is Speck64/128 of R under the
 * 128-bit key i * 2^64 + seed.  The grid point is read back as a*L + R (odd
 * number of rounds) or a*R + L (even), and values >= n are fed through the
 * network again until they land in [0, n) (cycle walking).
 *
 * Two deliberate departures from gfc, both where gfc is not a bijection
 * (GFC.md section 7), so the output is bit-identical to gfc everywhere else:
 *   - a is the exact integer ceiling square root; gfc's double sqrt can give
 *     a*a < n for n > 2^52;
 *   - a round computes (L + (F mod a)) mod a; gfc adds L to the full 64-bit F
 *     first, and the wrap-around of that sum breaks bijectivity for huge n.
 * With these, tl_gfc_encrypt is a bijection of [0, n) for every n in
 * [1, 2^64 - 1], and tl_gfc_decrypt is its exact inverse.
 *
 * Speed: F_j only depends on (j, R) and R < a ~ sqrt(n), so for moderate n the
 * caller may precompute every F_j(R) mod a once (tl_gfc_table_fill, rounds * a
 * uint32 values) and every round becomes a table lookup.  Without a table the
 * batch functions run 16 Speck evaluations in lockstep (SIMD), and divisions
 * by a use a precomputed 128-bit reciprocal (Lemire, Kaser, Kurz, "Faster
 * Remainder by Direct Computation", 2019), exact for all 64-bit dividends.
 */
#ifndef TOKLOAD_GFC_H
#define TOKLOAD_GFC_H

#include "common.h"
#include "speck.h"

#include <math.h>

#ifndef __SIZEOF_INT128__
#error "tokload's permutation needs a compiler with unsigned __int128"
#endif

typedef unsigned __int128 tl_u128;

/* ---- exact division by a runtime constant -------------------------------- */

/* floor((2^128 - 1) / d) + 1; for d == 1 it wraps to 0 (see tl_fastdiv). */
TL_INLINE tl_u128 tl_fast_magic(uint64_t d) { return ~(tl_u128)0 / d + 1; }

/* floor(lo * d / 2^128) for a 128-bit lo, without a 256-bit product. */
TL_INLINE uint64_t tl_mul128_hi64(tl_u128 lo, uint64_t d)
{
    tl_u128 bottom = ((tl_u128)(uint64_t)lo * d) >> 64;
    tl_u128 top = (lo >> 64) * d;
    return (uint64_t)((bottom + top) >> 64);
}

/* x mod d, exact for every 64-bit x and d >= 1. */
TL_INLINE uint64_t tl_fastmod(uint64_t x, tl_u128 magic, uint64_t d)
{
    return tl_mul128_hi64(magic * x, d);
}

/* x div d, exact for every 64-bit x and d >= 2 (for d == 1 it returns 0). */
TL_INLINE uint64_t tl_fastdiv(uint64_t x, tl_u128 magic) { return tl_mul128_hi64(magic, x); }

/* ---- the permutation ---------------------------------------------------- */

typedef struct tl_gfc {
    uint64_t n;            /* domain size, 1 <= n <= 2^64 - 1 */
    uint64_t a;            /* exact ceil(sqrt(n)), 1 <= a <= 2^32 */
    uint64_t rounds;       /* Feistel rounds (0 is the identity) */
    uint64_t seed;         /* the key */
    tl_u128 magic;         /* tl_fast_magic(a) */
    const uint32_t *keys;  /* rounds * TL_SPECK_ROUNDS round keys (caller-owned) */
    const uint32_t *table; /* NULL, or rounds * a values F_j(R) mod a (caller-owned) */
} tl_gfc;

/* Smallest a with a * a >= n: gfc's ceil(sqrt((double)n)), corrected upward
 * where the double rounding makes it too small (n > 2^52). */
TL_INLINE uint64_t tl_gfc_isqrt_ceil(uint64_t n)
{
    uint64_t a = (uint64_t)ceil(sqrt((double)n));
    if (a > (UINT64_C(1) << 32)) a = UINT64_C(1) << 32;
    while ((tl_u128)a * a < n) a++;
    while (a > 0 && (tl_u128)(a - 1) * (a - 1) >= n) a--;
    return a;
}

/* Number of uint32 round keys for `rounds` Feistel rounds. */
TL_INLINE uint64_t tl_gfc_keys_len(uint64_t rounds) { return rounds * TL_SPECK_ROUNDS; }

/* Feistel round i (0-based) uses the Speck64/128 key i * 2^64 + seed. */
TL_INLINE void tl_gfc_expand_keys(uint64_t seed, uint64_t rounds, uint32_t *keys)
{
    for (uint64_t i = 0; i < rounds; i++)
        tl_speck_expand((uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)i, (uint32_t)(i >> 32),
                        keys + i * TL_SPECK_ROUNDS);
}

/* keys must hold tl_gfc_keys_len(rounds) values from tl_gfc_expand_keys. */
TL_INLINE void tl_gfc_init(tl_gfc *g, uint64_t n, uint64_t rounds, uint64_t seed,
                           const uint32_t *keys)
{
    TL_ASSERT(n >= 1);
    g->n = n;
    g->a = tl_gfc_isqrt_ceil(n);
    g->rounds = rounds;
    g->seed = seed;
    g->magic = tl_fast_magic(g->a);
    g->keys = keys;
    g->table = NULL;
}

/* The 64-bit round function F_j(R), round j = i + 1. */
TL_INLINE uint64_t tl_gfc_round_f(const tl_gfc *g, uint64_t i, uint64_t R)
{
    return tl_speck_encrypt(g->keys + i * TL_SPECK_ROUNDS, R);
}

/* F_{i+1}(R) mod a, from the table when there is one.  R < a. */
TL_INLINE uint64_t tl_gfc_round_fmod(const tl_gfc *g, uint64_t i, uint64_t R)
{
    if (g->table) return g->table[i * g->a + R];
    return tl_fastmod(tl_gfc_round_f(g, i, R), g->magic, g->a);
}

/*
 * Lane kernels are kept out of line: inlined into a large caller, GCC stops
 * vectorizing them (3x slower).  TL_WIDE (common.h): on x86-64 they are
 * compiled for several ISAs and the best one for the CPU is picked at load
 * time, so a portable wheel still runs 8 or 16 Speck lanes per instruction.
 */
#define TL_LANES_FN TL_WIDE

/* Number of uint32 table entries: rounds * a. */
TL_INLINE uint64_t tl_gfc_table_len(const tl_gfc *g) { return g->rounds * g->a; }

/* row[l] = F(R0 + l) mod a for l < TL_SPECK_LANES, under round keys rk. */
TL_LANES_FN void tl_gfc_table_lanes(const tl_gfc *g, const uint32_t *rk, uint64_t R0, uint32_t *row)
{
    uint64_t v[TL_SPECK_LANES];
    for (int l = 0; l < TL_SPECK_LANES; l++) v[l] = R0 + (uint64_t)l;
    tl_speck_encrypt_blocks(rk, v);
    for (int l = 0; l < TL_SPECK_LANES; l++) row[l] = (uint32_t)tl_fastmod(v[l], g->magic, g->a);
}

/* Fill table[i * a + R] = F_{i+1}(R) mod a for every round and R < a. */
TL_INLINE void tl_gfc_table_fill(const tl_gfc *g, uint32_t *table)
{
    const uint64_t a = g->a;
    for (uint64_t i = 0; i < g->rounds; i++) {
        const uint32_t *rk = g->keys + i * TL_SPECK_ROUNDS;
        uint32_t *row = table + i * a;
        uint64_t R = 0;
        for (; R + TL_SPECK_LANES <= a; R += TL_SPECK_LANES) tl_gfc_table_lanes(g, rk, R, row + R);
        for (; R < a; R++) row[R] = (uint32_t)tl_fastmod(tl_speck_encrypt(rk, R), g->magic, a);
    }
}

/* One pass of the Feistel network over the split input (L, R), L, R < a. */
TL_INLINE uint64_t tl_gfc_fe_split(const tl_gfc *g, uint64_t L, uint64_t R)
{
    const uint64_t a = g->a;
    for (uint64_t i = 0; i < g->rounds; i++) {
        uint64_t T = L + tl_gfc_round_fmod(g, i, R); /* < 2a <= 2^33: never wraps */
        if (T >= a) T -= a;
        L = R;
        R = T;
    }
    return (g->rounds & 1) ? a * L + R : a * R + L;
}

/* One pass of the network over m < a * a. */
TL_INLINE uint64_t tl_gfc_fe(const tl_gfc *g, uint64_t m)
{
    if (TL_UNLIKELY(g->a == 1)) return 0; /* n == 1: the grid has one point */
    uint64_t R = tl_fastdiv(m, g->magic);
    return tl_gfc_fe_split(g, m - R * g->a, R);
}

/* The inverse pass: tl_gfc_fe_inv(g, tl_gfc_fe(g, m)) == m for m < a * a. */
TL_INLINE uint64_t tl_gfc_fe_inv(const tl_gfc *g, uint64_t c)
{
    const uint64_t a = g->a;
    if (TL_UNLIKELY(a == 1)) return 0;
    uint64_t q = tl_fastdiv(c, g->magic), rem = c - q * a, L, R;
    if (g->rounds & 1) {
        R = rem;
        L = q;
    } else {
        L = rem;
        R = q;
    }
    for (uint64_t i = g->rounds; i-- > 0;) {
        uint64_t P = R + a - tl_gfc_round_fmod(g, i, L); /* in (0, 2a) */
        if (P >= a) P -= a;
        R = L;
        L = P;
    }
    return a * R + L;
}

/* perm(m) for m < n: cycle-walk fe until the value is in range. */
TL_INLINE uint64_t tl_gfc_encrypt(const tl_gfc *g, uint64_t m)
{
    uint64_t c = tl_gfc_fe(g, m);
    while (c >= g->n) c = tl_gfc_fe(g, c);
    return c;
}

/* perm^-1(c) for c < n. */
TL_INLINE uint64_t tl_gfc_decrypt(const tl_gfc *g, uint64_t c)
{
    uint64_t m = tl_gfc_fe_inv(g, c);
    while (m >= g->n) m = tl_gfc_fe_inv(g, m);
    return m;
}

/*
 * One network pass over TL_SPECK_LANES values in place, computing the round
 * function: the Speck evaluations of the lanes run in SIMD lockstep.  Values
 * must be < a * a and a >= 2.
 */
TL_LANES_FN void tl_gfc_fe_lanes_speck(const tl_gfc *g, uint64_t m[TL_SPECK_LANES])
{
    const uint64_t a = g->a;
    uint64_t L[TL_SPECK_LANES], R[TL_SPECK_LANES];
    uint32_t x[TL_SPECK_LANES], y[TL_SPECK_LANES];
    for (int l = 0; l < TL_SPECK_LANES; l++) {
        R[l] = tl_fastdiv(m[l], g->magic);
        L[l] = m[l] - R[l] * a;
    }
    for (uint64_t i = 0; i < g->rounds; i++) {
        for (int l = 0; l < TL_SPECK_LANES; l++) {
            x[l] = (uint32_t)(R[l] >> 32);
            y[l] = (uint32_t)R[l];
        }
        tl_speck_encrypt_lanes(g->keys + i * TL_SPECK_ROUNDS, x, y);
        for (int l = 0; l < TL_SPECK_LANES; l++) {
            uint64_t T = L[l] + tl_fastmod(((uint64_t)x[l] << 32) | y[l], g->magic, a);
            if (T >= a) T -= a; /* T < 2a <= 2^33: never wraps */
            L[l] = R[l];
            R[l] = T;
        }
    }
    for (int l = 0; l < TL_SPECK_LANES; l++)
        m[l] = (g->rounds & 1) ? a * L[l] + R[l] : a * R[l] + L[l];
}

/*
 * The same pass with the table: the lanes' lookups are independent, so they
 * overlap in the memory system instead of waiting on each other.
 */
TL_LANES_FN void tl_gfc_fe_lanes_table(const tl_gfc *g, uint64_t m[TL_SPECK_LANES])
{
    const uint64_t a = g->a;
    uint64_t L[TL_SPECK_LANES], R[TL_SPECK_LANES];
    for (int l = 0; l < TL_SPECK_LANES; l++) {
        R[l] = tl_fastdiv(m[l], g->magic);
        L[l] = m[l] - R[l] * a;
    }
    for (uint64_t i = 0; i < g->rounds; i++) {
        const uint32_t *row = g->table + i * a;
        for (int l = 0; l < TL_SPECK_LANES; l++) {
            uint64_t T = L[l] + row[R[l]];
            if (T >= a) T -= a;
            L[l] = R[l];
            R[l] = T;
        }
    }
    for (int l = 0; l < TL_SPECK_LANES; l++)
        m[l] = (g->rounds & 1) ? a * L[l] + R[l] : a * R[l] + L[l];
}

/* Encrypt `count` values in place, all < n. */
TL_INLINE void tl_gfc_encrypt_inplace(const tl_gfc *g, uint64_t *TL_RESTRICT v, size_t count)
{
    size_t k = 0;
    if (g->a >= 2) {
        for (; k + TL_SPECK_LANES <= count; k += TL_SPECK_LANES) {
            uint64_t *m = v + k;
            if (g->table)
                tl_gfc_fe_lanes_table(g, m);
            else
                tl_gfc_fe_lanes_speck(g, m);
            for (int l = 0; l < TL_SPECK_LANES; l++) /* rare: cycle walking */
                while (TL_UNLIKELY(m[l] >= g->n)) m[l] = tl_gfc_fe(g, m[l]);
        }
    }
    for (; k < count; k++) v[k] = tl_gfc_encrypt(g, v[k]);
}

/* out[k] = perm(start + k) for k < count.  Requires start + count <= n. */
TL_INLINE void tl_gfc_encrypt_range(const tl_gfc *g, uint64_t start, uint64_t *TL_RESTRICT out,
                                    size_t count)
{
    TL_ASSERT(count == 0 || (start < g->n && count - 1 <= g->n - 1 - start));
    for (size_t k = 0; k < count; k++) out[k] = start + k;
    tl_gfc_encrypt_inplace(g, out, count);
}

/*
 * out[k] = perm(in[k]), or perm^-1(in[k]) when `inverse`.  Returns count on
 * success; otherwise the position of the first value >= n (what was written
 * to out is then unspecified).  in and out may be the same array.
 */
TL_INLINE size_t tl_gfc_apply_many(const tl_gfc *g, int inverse, const uint64_t *in, uint64_t *out,
                                   size_t count)
{
    const size_t chunk = 4096; /* validate, then permute, a cache-sized chunk at a time */
    for (size_t base = 0; base < count; base += chunk) {
        const size_t len = count - base < chunk ? count - base : chunk;
        for (size_t k = 0; k < len; k++)
            if (TL_UNLIKELY(in[base + k] >= g->n)) return base + k;
        if (inverse) {
            for (size_t k = 0; k < len; k++) out[base + k] = tl_gfc_decrypt(g, in[base + k]);
        } else {
            for (size_t k = 0; k < len; k++) out[base + k] = in[base + k];
            tl_gfc_encrypt_inplace(g, out + base, len);
        }
    }
    return count;
}

/* ---- per-epoch keys ------------------------------------------------------- */

/*
 * The key of epoch `epoch` of a run seeded with `seed`: Speck64/128 of the
 * block `epoch` under the 128-bit key ("tokl", "epoc", seed).  For a fixed
 * seed this is a bijection of the epoch number, so two epochs never share a
 * key.  The constant high key words keep it apart from the Feistel round keys,
 * whose high words are the round index.
 */
#define TL_EPOCH_KEY_L2 UINT32_C(0x746f6b6c) /* "tokl" */
#define TL_EPOCH_KEY_L1 UINT32_C(0x65706f63) /* "epoc" */

TL_INLINE uint64_t tl_gfc_epoch_seed(uint64_t seed, uint64_t epoch)
{
    uint32_t rk[TL_SPECK_ROUNDS];
    tl_speck_expand((uint32_t)seed, (uint32_t)(seed >> 32), TL_EPOCH_KEY_L1, TL_EPOCH_KEY_L2, rk);
    return tl_speck_encrypt(rk, epoch);
}

#endif /* TOKLOAD_GFC_H */
