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

/* TL_WIDE: a function kept out of line whose loops fill or compute over batch
 * memory, compiled for the x86-64 baseline and also for AVX2 and x86-64-v4
 * (AVX-512); the dynamic loader picks the best the CPU runs (an ifunc), so a
 * portable wheel still uses wide vectors.  x86-64 Linux with GCC only;
 * -DTL_NO_TARGET_CLONES (or another compiler or CPU) gives one plain version. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(TL_NO_TARGET_CLONES)
#define TL_WIDE static __attribute__((noinline, target_clones("default", "avx2", "arch=x86-64-v4")))
#elif defined(__GNUC__) || defined(__clang__)
#define TL_WIDE static __attribute__((noinline))
#else
#define TL_WIDE static
#endif

/* Debug builds (TOKLOAD_DEBUG=1) keep asserts; release builds define NDEBUG. */
#include <assert.h>
#define TL_ASSERT(x) assert(x)

#endif /* TOKLOAD_COMMON_H */
