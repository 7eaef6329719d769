# The one place that declares tokload's C core to Cython.
#
# One `cdef extern` block per header of csrc/tokload/.  Each declaration must
# match its header, and each header names this file as its Cython mirror.
# Signatures state their exception behaviour: pure arithmetic is
# `noexcept nogil`.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t


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
    int TL_FAULTS_BUILT
    unsigned TL_FAULT_SHORT
    unsigned TL_FAULT_EINTR
    unsigned TL_FAULT_EAGAIN
    unsigned TL_FAULT_EIO

    ctypedef struct tl_io_error:
        int code
        int32_t file
        uint64_t offset
        uint64_t length
        uint64_t done

    ctypedef struct tl_io_faults:
        uint64_t seed
        uint64_t counter
        uint32_t rate
        uint32_t kinds

    int tl_io_read(int fd, int32_t file, void *buf, uint64_t length, uint64_t offset,
                   tl_io_error *err) noexcept
    int tl_io_advise_random(int fd) noexcept


cdef extern from "tokload/fdcache.h" nogil:
    # Only the fields Cython reads are declared; the layout comes from C.
    ctypedef struct tl_fent:
        const char *path
        uint64_t base
        int32_t index
        int fd
        void *remote
        int known
        int64_t ino, size, mtime_ns

    ctypedef struct tl_fdcache:
        size_t open
        size_t max
        uint64_t opens

    void tl_fdcache_init(tl_fdcache *c, size_t max) noexcept
    void tl_fent_init(tl_fent *e, const char *path, uint64_t base, int32_t index) noexcept
    int tl_fdcache_acquire(tl_fdcache *c, tl_fent *e, int may_wait) noexcept
    void tl_fdcache_release(tl_fdcache *c, tl_fent *e) noexcept
    void tl_fdcache_retire(tl_fdcache *c, tl_fent *ents, size_t n) noexcept
    void tl_fdcache_set_max(tl_fdcache *c, size_t max) noexcept
    size_t tl_fdcache_open_count(tl_fdcache *c) noexcept
    void tl_fdcache_after_fork(tl_fdcache *c) noexcept
    void tl_fdcache_adopt(tl_fdcache *c, tl_fent *ents, size_t n) noexcept


cdef extern from "tokload/ioreq.h" nogil:
    ctypedef struct tl_ioreq:
        tl_fent *file
        uint64_t offset
        uint64_t length
        uint8_t *dst
        uint64_t item

    int tl_ioreq_run_sync(const tl_ioreq *reqs, size_t n, tl_fdcache *cache,
                          tl_io_faults *faults, tl_io_error *err, size_t *failed) noexcept
    size_t tl_ioreq_hint(const tl_ioreq *reqs, size_t n, tl_fdcache *cache) noexcept


cdef extern from "tokload/pool.h" nogil:
    enum: TL_POOL_MAX

    ctypedef struct tl_pool:
        unsigned nthreads

    void tl_pool_init(tl_pool *p) noexcept
    int tl_pool_grow(tl_pool *p, unsigned threads) noexcept
    unsigned tl_pool_threads(tl_pool *p) noexcept
    void tl_pool_after_fork(tl_pool *p) noexcept


cdef extern from "tokload/uring.h" nogil:
    enum: TL_URING_MAX

    ctypedef struct tl_uring:
        int fd
        unsigned entries
        int broken
        unsigned inflight
        int64_t fail_after
        int fail_code
        int fail_waits

    int tl_uring_setup(tl_uring *r, unsigned entries) noexcept
    void tl_uring_destroy(tl_uring *r) noexcept


cdef extern from "tokload/engine.h" nogil:
    enum: TL_IO_SYNC
    enum: TL_IO_THREADS
    enum: TL_IO_URING
    enum: TL_IO_REMOTE
    int TL_ERR_REMOTE

    ctypedef int (*tl_remote_fn)(void *ctx, const tl_ioreq *reqs, size_t n, unsigned depth,
                                 tl_io_error *err, size_t *failed) noexcept nogil

    ctypedef struct tl_io_counters:
        uint64_t calls
        uint64_t requests
        uint64_t bytes
        uint64_t failed
        uint64_t ns

    ctypedef struct tl_engine:
        int backend
        unsigned depth
        tl_fdcache *cache
        tl_pool *pool
        tl_uring *ring
        tl_io_faults *faults
        tl_io_counters *counters
        tl_remote_fn remote
        void *remote_ctx

    int tl_engine_run(const tl_engine *e, const tl_ioreq *reqs, size_t n, tl_io_error *err,
                      size_t *failed) noexcept
    void tl_io_counters_read(const tl_io_counters *c, tl_io_counters *out) noexcept


cdef extern from "tokload/handoff.h" nogil:
    ctypedef struct tl_handoff_batch:
        const tl_ioreq *reqs
        size_t n
        unsigned depth
        uint64_t waiter
        tl_handoff_batch *next

    ctypedef struct tl_handoff:
        size_t queued
        int efd

    int tl_handoff_open(tl_handoff *h) noexcept
    void tl_handoff_wake(const tl_handoff *h) noexcept
    int tl_handoff_run(tl_handoff *h, const tl_ioreq *reqs, size_t n, unsigned depth,
                       tl_io_error *err, size_t *failed) noexcept
    tl_handoff_batch *tl_handoff_take(tl_handoff *h) noexcept
    void tl_handoff_finish(tl_handoff *h, tl_handoff_batch *b, int rc, const tl_io_error *err,
                           size_t failed) noexcept
    void tl_handoff_copy(const tl_ioreq *reqs, size_t n, const uint8_t *const *src) noexcept


cdef extern from "tokload/bounds.h" nogil:
    ctypedef struct tl_bsearch:
        uint64_t key
        uint64_t lo
        uint64_t hi
        uint64_t lo_first
        uint64_t end

    void tl_bsearch_init(tl_bsearch *s, uint64_t key, uint64_t ndocs, uint64_t rows) noexcept
    uint64_t tl_bsearch_probe(const tl_bsearch *s, unsigned round) noexcept
    int tl_bsearch_step(tl_bsearch *s, uint64_t probe, uint64_t first) noexcept
    size_t tl_bounds_fill(const uint64_t *rows, const uint64_t *cuts, const uint64_t *ncuts,
                          size_t nwin, uint64_t W, int64_t *pos, int32_t *seg, uint8_t *mask,
                          int64_t *cu, uint64_t *max_len, size_t *bad) noexcept
    int tl_bounds_split(const int64_t *cu, size_t ncu, const int64_t *first, size_t nsteps,
                        uint64_t W, int32_t *out, int64_t *offsets, int64_t *longest,
                        size_t *bad) noexcept
    unsigned tl_dir_shift(uint64_t rows, uint64_t ndocs) noexcept
    uint64_t tl_dir_entries(uint64_t rows, uint64_t ndocs) noexcept
    void tl_dir_build(const uint64_t *t, uint64_t ndocs, uint64_t rows, uint64_t *dir) noexcept
    uint64_t tl_bounds_cuts_tables(const uint64_t *row_cum, const uint64_t *doc_cum,
                                   size_t nfiles, const uint64_t *const *tables,
                                   const uint64_t *rows, size_t nwin, uint64_t W,
                                   uint64_t *ncuts, uint64_t *cuts) noexcept


cdef extern from "tokload/pack.h" nogil:
    uint64_t TL_PACK_MAX_WINDOW
    size_t TL_PACK_MAX_DOCS
    size_t tl_pack_scratch_bytes(size_t n, uint64_t W) noexcept
    size_t tl_pack_best_fit(const uint64_t *len, size_t n, uint64_t W, void *scratch,
                            uint32_t *order, uint32_t *starts) noexcept
    uint64_t tl_pack_greedy(const uint64_t *len, size_t n, uint64_t W) noexcept
    int tl_pack_offsets(const uint64_t *len, const int64_t *counts, size_t nrows, uint64_t W,
                        uint64_t itemsize, uint64_t *dst, size_t *bad) noexcept
    void tl_pack_pad(const uint64_t *len, const int64_t *counts, size_t nrows, uint64_t W,
                     size_t itemsize, const void *value, char *out) noexcept
    size_t tl_pack_bounds(const uint64_t *len, const int64_t *counts, size_t nrows, uint64_t W,
                          int64_t *pos, int32_t *seg, uint8_t *mask, int64_t *cu,
                          uint64_t *max_len, size_t *bad) noexcept


cdef extern from "tokload/shards.h" nogil:
    size_t tl_shards_locate(const uint64_t *cum, size_t nshards, uint64_t pos) noexcept
    size_t tl_shards_locate_many(const uint64_t *cum, size_t nshards, const uint64_t *pos,
                                 size_t count, uint64_t *shard) noexcept


cdef extern from "tokload/plan.h" nogil:
    int TL_ERR_CORRUPT
    int TL_ERR_BAD_ID
    uint32_t TL_META_NONE

    ctypedef struct tl_rowset:
        tl_fent *files
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
    size_t tl_rows_count_reqs(const tl_rowset *rs, const uint64_t *starts,
                              const uint64_t *lengths, uint64_t len1, size_t count) noexcept
    size_t tl_rows_plan_many(const tl_rowset *rs, const uint64_t *starts,
                             const uint64_t *lengths, uint64_t len1,
                             const uint64_t *dst_offsets, size_t count, uint8_t *dst,
                             tl_ioreq *reqs) noexcept
    size_t tl_rows_count_gather(const tl_rowset *const *sets, const int64_t *which,
                                const uint8_t *use, const uint64_t *starts,
                                const uint64_t *lengths, size_t count) noexcept
    size_t tl_rows_plan_gather(const tl_rowset *const *sets, const int64_t *which,
                               const uint8_t *use, const uint64_t *starts,
                               const uint64_t *lengths, const uint64_t *dst_offsets,
                               size_t count, uint8_t *dst, tl_ioreq *reqs) noexcept
    void tl_split_fields(const uint8_t *rows, uint64_t nrows, uint64_t row_bytes,
                         size_t nfields, const uint64_t *off, const uint64_t *size,
                         uint8_t *const *dst) noexcept
    void tl_fill_rows(uint8_t *dst, uint64_t nrows, const uint8_t *pattern,
                      uint64_t row_bytes) noexcept
    void tl_docs_plan(tl_fent *idx_files, const uint64_t *doc_cum, size_t nfiles,
                      const uint64_t *ids, size_t count, uint64_t *entries,
                      tl_ioreq *reqs) noexcept
    void tl_docs_shards(const uint64_t *doc_cum, size_t nfiles, const uint64_t *ids,
                        size_t count, uint32_t *shards) noexcept
    void tl_docs_copy(const uint64_t *doc_cum, const uint32_t *shards,
                      const uint64_t *const *tables, const uint64_t *ids, size_t count,
                      uint64_t *entries) noexcept
    int tl_docs_finish(const tl_fent *idx_files, const uint64_t *doc_cum,
                       const uint64_t *row_cum, size_t nfiles, const uint64_t *ids,
                       size_t count, const uint64_t *entries, uint64_t *out_start,
                       uint64_t *out_len, tl_io_error *err, size_t *failed_item) noexcept
    void tl_megatron_plan(tl_fent *idx, uint64_t len_off, uint64_t ptr_off,
                          const uint64_t *ids, size_t count, int32_t *lens,
                          int64_t *ptrs, tl_ioreq *reqs) noexcept
    int tl_megatron_finish(uint64_t len_off, uint64_t ptr_off, uint64_t itemsize,
                           uint64_t bin_rows, const uint64_t *ids, size_t count,
                           const int32_t *lens, const int64_t *ptrs, uint64_t *out_start,
                           uint64_t *out_len, tl_io_error *err, size_t *failed_item) noexcept

    ctypedef struct tl_meta_shard:
        tl_fent *index
        tl_fent *data
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

    ctypedef struct tl_meta_seg:
        uint32_t shard
        uint32_t dense
        uint64_t lo
        uint64_t hi
        size_t first_item
        size_t end_item
        uint64_t ent
        uint64_t window

    size_t tl_meta_count_runs(const uint32_t *ids, size_t nwin, uint64_t window) noexcept
    int tl_meta_plan(const tl_meta_shard *shards, const uint64_t *row_cum, size_t nfiles,
                     const uint64_t *starts, size_t nwin, uint64_t window,
                     const uint32_t *ids, int32_t *positions, uint64_t *hkeys,
                     int64_t *hvals, uint64_t hcap, tl_meta_item *items, size_t *nitems,
                     tl_meta_seg *segs, size_t *nsegs, uint64_t *entries, tl_ioreq *reqs,
                     size_t *nreqs, tl_io_error *err, size_t *failed_item) noexcept
    int tl_meta_finish(const tl_meta_shard *shards, const tl_meta_seg *segs, size_t nsegs,
                       const uint64_t *entries, tl_meta_item *items, tl_meta_span *spans,
                       size_t *nspans, uint64_t *blob_bytes, tl_io_error *err,
                       size_t *failed_item) noexcept
    void tl_meta_plan_read(const tl_meta_shard *shards, const tl_meta_span *spans,
                           size_t nspans, uint8_t *blob, tl_ioreq *reqs) noexcept


cdef extern from "tokload/spans.h" nogil:
    uint32_t TL_SPAN_NONE
    int TL_SPAN_ENTRY
    int TL_SPAN_BAD_BLOCK
    int TL_SPAN_BAD_START
    int TL_SPAN_BAD_RECORD
    int TL_SPAN_BAD_OFFSET
    int TL_SPAN_BAD_COVER
    int TL_SPAN_BAD_HOLD

    ctypedef struct tl_span_error:
        int code
        uint32_t shard
        uint64_t entry
        uint64_t value
        uint64_t limit

    ctypedef struct tl_span_set:
        const uint64_t *row_cum
        const uint64_t *msx_cum
        const uint64_t *mds_cum
        const uint64_t *mdx_cum
        const uint64_t *mdb_cum
        size_t nfiles
        uint64_t block

    ctypedef struct tl_span_piece:
        uint32_t shard
        uint64_t start
        uint64_t len
        uint64_t dst
        uint64_t run0
        uint64_t nruns
        uint64_t at
        uint64_t blk

    ctypedef struct tl_span_reqs:
        uint64_t *start
        uint64_t *len
        uint64_t *dst

    uint64_t tl_spans_pieces(const tl_span_set *s, const uint64_t *starts, size_t nwin,
                             uint64_t window, tl_span_piece *pieces, tl_span_reqs q,
                             size_t *npieces) noexcept
    int tl_spans_runs(const tl_span_set *s, tl_span_piece *pieces, size_t n,
                      const uint64_t *blocks, tl_span_reqs q, uint64_t *nruns,
                      tl_span_error *err) noexcept
    int tl_spans_resolve(const tl_span_set *s, const tl_span_piece *pieces, size_t n,
                         const uint8_t *runbuf, int32_t *positions, uint64_t *hkeys,
                         int64_t *hvals, uint64_t hcap, uint32_t *item_shard,
                         uint32_t *item_id, size_t *nitems, tl_span_error *err) noexcept
    size_t tl_spans_plan_index(const tl_span_set *s, const uint32_t *item_shard,
                               const uint32_t *item_id, size_t nitems, uint64_t *item_ent,
                               tl_span_reqs q) noexcept
    int tl_spans_plan_data(const tl_span_set *s, const uint32_t *item_shard,
                           const uint32_t *item_id, size_t nitems, const uint64_t *item_ent,
                           const uint64_t *entries, int64_t *offsets, tl_span_reqs q,
                           size_t *nreq, tl_span_error *err) noexcept


cdef extern from "tokload/blocks.h" nogil:
    unsigned TL_BLOCK_MAX
    int TL_BLOCK_BAD_INDEX
    int TL_BLOCK_BAD_SIZE
    int TL_BLOCK_BAD_START
    int TL_BLOCK_BAD_RECORD
    int TL_BLOCK_BAD_END
    int TL_BLOCK_BAD_INPUT

    ctypedef struct tl_block_set:
        const uint64_t *row_cum
        const uint64_t *msx_cum
        const uint64_t *msb_cum
        const uint64_t *nrec
        size_t nfiles
        uint64_t block

    ctypedef struct tl_block_seen:
        uint32_t *key
        uint32_t *val
        uint32_t *gen
        uint64_t cap
        uint32_t now

    uint32_t tl_load_u32(const uint8_t *p) noexcept
    uint16_t tl_load_u16(const uint8_t *p) noexcept
    uint32_t tl_block_seen_slot(tl_block_seen *t, uint32_t rec, uint32_t *count,
                                int *fresh) noexcept
    ctypedef struct tl_block_info:
        uint32_t nruns
        uint32_t nnew
        const uint8_t *ends
        int sorted
        uint32_t first
        uint32_t last

    ctypedef struct tl_block_range:
        uint64_t shard
        uint64_t lo
        uint64_t hi
        uint64_t piece

    ctypedef struct tl_block_walk:
        uint32_t slot
        uint32_t prev

    int tl_block_check(const tl_block_set *s, size_t k, uint64_t b, const uint8_t *p,
                       uint64_t len, tl_block_seen *t, tl_block_info *bi,
                       tl_span_error *err) noexcept
    void tl_block_walk_start(tl_block_walk *w) noexcept
    uint32_t tl_block_walk_slot(const tl_block_info *bi, tl_block_seen *t, tl_block_walk *w,
                                uint32_t rec) noexcept

    uint64_t tl_block_index_bad(const uint64_t *e, uint64_t n, uint64_t b0, uint64_t nblocks,
                                uint64_t size) noexcept
    int tl_blocks_slices(const tl_block_set *s, const tl_span_piece *pieces, size_t n,
                         const uint64_t *entries, tl_span_reqs q, uint64_t *at,
                         uint64_t *nbytes, tl_span_error *err) noexcept
    int tl_blocks_check_all(const tl_block_set *s, const tl_span_piece *pieces, size_t n,
                            const uint64_t *at, const uint64_t *entries,
                            const uint8_t *blockbuf, tl_block_seen *t, tl_block_info *infos,
                            uint64_t *prange, uint64_t *nruns, tl_span_error *err) noexcept
    int tl_blocks_resolve(const tl_block_set *s, const tl_span_piece *pieces, size_t n,
                          const uint64_t *at, const uint64_t *entries,
                          const uint8_t *blockbuf, const tl_block_info *infos,
                          int32_t *positions, uint64_t *hkeys, int64_t *hvals, uint64_t hcap,
                          tl_block_seen *t, uint64_t *prange,
                          tl_block_range *order, uint64_t *item_src, uint64_t *item_len,
                          size_t *nitems, tl_span_error *err) noexcept
    uint64_t tl_blocks_offsets(const uint64_t *item_len, size_t nitems,
                               int64_t *offsets) noexcept
    void tl_blocks_copy(const uint8_t *blockbuf, const uint64_t *item_src,
                        const uint64_t *item_len, size_t nitems, uint8_t *dst) noexcept
    int tl_blocks_encode(uint64_t block, uint64_t rows, const uint64_t *starts,
                         const uint32_t *records, uint64_t nruns, const uint64_t *mdx,
                         uint64_t nrec, const uint8_t *mdb, uint64_t mdb_bytes, uint64_t b0,
                         uint64_t b1, uint64_t *run, tl_block_seen *t, uint64_t *sizes,
                         uint8_t *out, uint64_t cap, tl_span_error *err) noexcept


cdef extern from "tokload/ctab.h" nogil:
    enum: TL_CTAB_GROUP
    ctypedef struct tl_ctab:
        uint64_t n
        uint64_t nfull
    uint64_t tl_ctab_bytes(const uint64_t *e, uint64_t n, uint64_t *nfull) noexcept
    uint64_t tl_ctab_bytes_least(uint64_t n) noexcept
    uint64_t tl_ctab_size(const tl_ctab *t) noexcept
    tl_ctab *tl_ctab_build(const uint64_t *e, uint64_t n, uint64_t nfull, void *mem) noexcept
    int tl_ctab_decode(const tl_ctab *t, uint64_t j, uint64_t len, uint64_t *out) noexcept


cdef extern from "tokload/tables.h" nogil:
    void *tl_table_get(void *const *slot) noexcept
    int tl_table_publish(void **slot, void *p) noexcept


cdef extern from "tokload/hostmem.h" nogil:
    enum: TL_HOSTMEM_SLOTS
    ctypedef struct tl_hostmem_block:
        void *ptr
        size_t size
        uint64_t age
    ctypedef struct tl_hostmem:
        size_t n
        size_t bytes
        size_t cap
        uint64_t clock
        uint64_t reused
    void tl_hostmem_init(tl_hostmem *h, size_t cap) noexcept
    void *tl_hostmem_take(tl_hostmem *h, size_t size, size_t *got) noexcept
    size_t tl_hostmem_fit(tl_hostmem *h, size_t extra, tl_hostmem_block *evicted) noexcept
    size_t tl_hostmem_put(tl_hostmem *h, void *ptr, size_t size,
                          tl_hostmem_block *evicted) noexcept
    size_t tl_hostmem_clear(tl_hostmem *h, tl_hostmem_block *evicted) noexcept


cdef extern from "tokload/slots.h" nogil:
    size_t tl_slots_block(uint64_t key, const int64_t *counts, size_t ncomp,
                          const int64_t *want, size_t nwant, int64_t *comp, int64_t *lane,
                          double *phase, double *cur, int64_t *next, uint32_t *heap) noexcept
    size_t tl_slots_positions(uint64_t slot_seed, uint64_t m, const int64_t *seg_first,
                              size_t nseg, const int64_t *seg_counts,
                              const int64_t *seg_before, size_t ncomp, uint64_t *q,
                              uint64_t *at, size_t n, uint64_t *s1, uint64_t *s2,
                              int64_t *comp, int64_t *cpos, double *phase, int64_t *next,
                              uint32_t *heap) noexcept
    void tl_slots_by_permutation(const int64_t *comp, const int64_t *cpos, size_t n,
                                 const int64_t *sizes, const uint64_t *comp_seeds,
                                 size_t ncomp, uint64_t *order, uint64_t *s1, uint64_t *s2,
                                 uint64_t *s3, size_t *count, uint64_t *ns, uint64_t *seeds,
                                 uint64_t *js) noexcept


cdef extern from "tokload/sort.h" nogil:
    void tl_sort_pairs(uint64_t *key, uint64_t *val, size_t n, uint64_t *key2,
                       uint64_t *val2) noexcept


cdef extern from "tokload/offsets.h" nogil:
    size_t tl_offsets_bad(const uint64_t *t, size_t n, uint64_t limit, int first,
                          int last) noexcept
