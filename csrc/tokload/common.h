/*
 * common.h -- macros shared by every tokload C header.
 *
 * The C core is a set of pure `static inline` functions over plain structs and
 * file descriptors.  Headers include nothing from Python, allocate nothing,
 * keep no globals and print nothing; each compiles alone with
 * `cc -fsyntax-only`.
 */
#ifndef TOKLOAD_COMMON_H
#define TOKLOAD_COMMON_H

/* preadv and posix_fadvise are GNU/POSIX extensions; every tokload header
 * includes this one first, before any system header. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define TL_INLINE static inline __attribute__((always_inline))
#define TL_LIKELY(x) __builtin_expect(!!(x), 1)
#define TL_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define TL_RESTRICT __restrict__
#else
#define TL_INLINE static inline
#define TL_LIKELY(x) (x)
#define TL_UNLIKELY(x) (x)
#define TL_RESTRICT
#endif

/* TL_WIDE: a function whose loops fill or copy batch memory, compiled for the
 * x86-64 baseline (16-byte stores) and also for AVX2 and AVX-512 (32- and 64-byte
 * stores); the dynamic loader picks the one the CPU runs (an ifunc, glibc).  Not
 * inlined.  Elsewhere (other CPUs, compilers, C libraries): one plain version. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__) && \
    ((defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && __GNUC__ >= 8))
#define TL_WIDE static __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TL_WIDE static
#endif

/* Debug builds (TOKLOAD_DEBUG=1) keep asserts; release builds define NDEBUG. */
#include <assert.h>
#define TL_ASSERT(x) assert(x)

#endif /* TOKLOAD_COMMON_H */
