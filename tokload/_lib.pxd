# The one place that declares tokload's C core to Cython.
#
# One `cdef extern` block per header of csrc/tokload/.  Each declaration must
# match its header, and each header names this file as its Cython mirror.
# Signatures state their exception behaviour: pure arithmetic is
# `noexcept nogil`.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t


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


cdef extern from "tokload/io.h" nogil:
    int TL_IO_EOF

    ctypedef struct tl_io_error:
        int code
        int32_t file
        uint64_t offset
        uint64_t length
        uint64_t done

    int tl_io_read(int fd, int32_t file, void *buf, uint64_t length, uint64_t offset,
                   tl_io_error *err) noexcept
    int tl_io_advise_random(int fd) noexcept


cdef extern from "tokload/shards.h" nogil:
    size_t tl_shards_locate(const uint64_t *cum, size_t nshards, uint64_t pos) noexcept
    size_t tl_shards_locate_many(const uint64_t *cum, size_t nshards, const uint64_t *pos,
                                 size_t count, uint64_t *shard) noexcept


cdef extern from "tokload/plan.h" nogil:
    int TL_ERR_CORRUPT
    int TL_ERR_BAD_ID
    uint32_t TL_META_NONE

    ctypedef struct tl_file:
        int fd
        uint64_t base

    ctypedef struct tl_rowset:
        const tl_file *files
        const uint64_t *cum
        size_t nfiles
        uint64_t row_bytes

    ctypedef struct tl_read_req:
        int32_t file
        uint64_t offset
        uint64_t length
        uint64_t dst

    size_t tl_plan_rows(const tl_rowset *rs, uint64_t start, uint64_t count, uint64_t dst,
                        tl_read_req *reqs, size_t max_reqs) noexcept
    int tl_plan_execute(const tl_file *files, const tl_read_req *reqs, size_t n,
                        uint8_t *dst, tl_io_error *err) noexcept
    int tl_rows_read_many(const tl_rowset *rs, const uint64_t *starts, const uint64_t *lengths,
                          const uint64_t *dst_offsets, size_t count, uint8_t *dst,
                          tl_io_error *err, size_t *failed_item) noexcept
    int tl_rows_read_windows(const tl_rowset *rs, const uint64_t *starts, size_t count,
                             uint64_t window, uint8_t *dst, tl_io_error *err,
                             size_t *failed_item) noexcept
    void tl_split_fields(const uint8_t *rows, uint64_t nrows, uint64_t row_bytes,
                         size_t nfields, const uint64_t *off, const uint64_t *size,
                         uint8_t *const *dst) noexcept
    int tl_docs_extents(const tl_file *idx_files, const uint64_t *doc_cum,
                        const uint64_t *row_cum, size_t nfiles, const uint64_t *ids,
                        size_t count, uint64_t *out_start, uint64_t *out_len,
                        tl_io_error *err, size_t *failed_item) noexcept
    int tl_megatron_extents(int idx_fd, uint64_t len_off, uint64_t ptr_off, uint64_t itemsize,
                            uint64_t bin_rows, const uint64_t *ids, size_t count,
                            uint64_t *out_start, uint64_t *out_len, tl_io_error *err,
                            size_t *failed_item) noexcept

    ctypedef struct tl_meta_shard:
        tl_file index
        tl_file data
        uint64_t nrec
        uint64_t data_bytes

    ctypedef struct tl_meta_item:
        uint32_t shard
        uint32_t id
        uint64_t offset
        uint64_t length
        uint64_t blob

    ctypedef struct tl_meta_span:
        uint32_t shard
        uint64_t offset
        uint64_t length
        uint64_t blob

    int tl_meta_gather(const tl_meta_shard *shards, const uint64_t *row_cum, size_t nfiles,
                       const uint64_t *starts, size_t nwin, uint64_t window,
                       const uint32_t *ids, int32_t *positions, uint64_t *hkeys,
                       int64_t *hvals, uint64_t hcap, uint64_t *entries, uint64_t ecap,
                       tl_meta_item *items, size_t *nitems, tl_meta_span *spans,
                       size_t *nspans, uint64_t *blob_bytes, tl_io_error *err,
                       size_t *failed_item) noexcept
    int tl_meta_read(const tl_meta_shard *shards, const tl_meta_span *spans, size_t nspans,
                     uint8_t *blob, tl_io_error *err) noexcept
