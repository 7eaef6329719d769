/*
 * tables.h -- per-shard tables held in memory and shared by reader threads.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * A table (a whole per-shard index file, tokload/_tables.pyx ShardTables) is read
 * by whichever thread first needs it, without the GIL, and published with
 * one atomic compare-and-swap: a thread that loses the race frees its copy
 * and uses the winner's.  A published table never changes until the object
 * that holds it is freed.
 */
#ifndef TOKLOAD_TABLES_H
#define TOKLOAD_TABLES_H

#include "common.h"

/* The table in slot, or NULL while none is published. */
TL_INLINE void *tl_table_get(void *const *slot)
{
    return __atomic_load_n(slot, __ATOMIC_ACQUIRE);
}

/* Publish p in slot unless a table is there already: 1 if p was published. */
TL_INLINE int tl_table_publish(void **slot, void *p)
{
    void *none = NULL;
    return __atomic_compare_exchange_n(slot, &none, p, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

#endif /* TOKLOAD_TABLES_H */
