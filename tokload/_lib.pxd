# The one place that declares tokload's C core to Cython.
#
# One `cdef extern` block per header of csrc/tokload/.  Each declaration must
# match its header, and each header names this file as its Cython mirror.
# Signatures state their exception behaviour: pure arithmetic is
# `noexcept nogil`.

from libc.stdint cimport uint32_t, uint64_t


cdef extern from "tokload/speck.h" nogil:
    enum: TL_SPECK_ROUNDS
    void tl_speck_expand(uint32_t k0, uint32_t l0, uint32_t l1, uint32_t l2,
                         uint32_t *rk) noexcept
    uint64_t tl_speck_encrypt(const uint32_t *rk, uint64_t block) noexcept


cdef extern from "tokload/gfc.h" nogil:
    # Only the fields Cython reads are declared; the layout comes from C.
    ctypedef struct tl_gfc:
        uint64_t n
        uint64_t a
        uint64_t rounds
        uint64_t seed
        const uint32_t *table

    uint64_t tl_gfc_isqrt_ceil(uint64_t n) noexcept
    uint64_t tl_gfc_keys_len(uint64_t rounds) noexcept
    void tl_gfc_expand_keys(uint64_t seed, uint64_t rounds, uint32_t *keys) noexcept
    void tl_gfc_init(tl_gfc *g, uint64_t n, uint64_t rounds, uint64_t seed,
                     const uint32_t *keys) noexcept
    uint64_t tl_gfc_round_f(const tl_gfc *g, uint64_t i, uint64_t R) noexcept
    uint64_t tl_gfc_table_len(const tl_gfc *g) noexcept
    void tl_gfc_table_fill(const tl_gfc *g, uint32_t *table) noexcept
    uint64_t tl_gfc_encrypt(const tl_gfc *g, uint64_t m) noexcept
    uint64_t tl_gfc_decrypt(const tl_gfc *g, uint64_t c) noexcept
    void tl_gfc_encrypt_range(const tl_gfc *g, uint64_t start, uint64_t *out,
                              size_t count) noexcept
    size_t tl_gfc_apply_many(const tl_gfc *g, int inverse, const uint64_t *inp,
                             uint64_t *out, size_t count) noexcept
    uint64_t tl_gfc_epoch_seed(uint64_t seed, uint64_t epoch) noexcept
