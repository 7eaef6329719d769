/*
 * probe.c -- what the storage delivers to random reads, with no loader in the
 * way: `nreads` reads of `size` bytes at random offsets (aligned to `size`) of
 * the given files, `depth` in flight, by threads (each a blocking pread loop)
 * or by io_uring (tokload's raw-syscall ring, csrc/tokload/uring.h).
 *
 *   cc -O2 -pthread -I csrc bench/probe.c -o probe
 *   ./probe threads|uring SIZE NREADS DEPTH SEED FILE...
 *
 * Prints "<seconds> <bytes>".  Built and run by bench/bench_cold.py.
 */
#include "tokload/engine.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>

static int nfiles;
static int *fds;
static uint64_t *sizes;
static uint64_t size;

typedef struct job {
    uint64_t n, seed;
    char *buf;
} job;

static uint64_t next_rand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void pick(uint64_t *s, int *file, uint64_t *off)
{
    *file = (int)(next_rand(s) % (uint64_t)nfiles);
    uint64_t blocks = sizes[*file] / size;
    *off = (next_rand(s) % blocks) * size;
}

static void *reader(void *arg)
{
    job *j = (job *)arg;
    for (uint64_t i = 0; i < j->n; i++) {
        int f;
        uint64_t off;
        pick(&j->seed, &f, &off);
        uint64_t done;
        if (tl_io_pread_full(fds[f], j->buf, size, off, &done)) {
            perror("pread");
            exit(1);
        }
    }
    return NULL;
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 7) {
        fprintf(stderr, "usage: %s threads|uring SIZE NREADS DEPTH SEED FILE...\n", argv[0]);
        return 2;
    }
    int uring = argv[1][0] == 'u';
    size = strtoull(argv[2], NULL, 10);
    uint64_t nreads = strtoull(argv[3], NULL, 10);
    unsigned depth = (unsigned)strtoul(argv[4], NULL, 10);
    uint64_t seed = strtoull(argv[5], NULL, 10) | 1;
    nfiles = argc - 6;
    fds = calloc((size_t)nfiles, sizeof *fds);
    sizes = calloc((size_t)nfiles, sizeof *sizes);
    for (int i = 0; i < nfiles; i++) {
        struct stat st;
        fds[i] = open(argv[6 + i], O_RDONLY | O_CLOEXEC);
        if (fds[i] < 0 || fstat(fds[i], &st)) {
            perror(argv[6 + i]);
            return 1;
        }
        sizes[i] = (uint64_t)st.st_size;
        tl_io_advise_random(fds[i]);
    }
    char *buf = malloc((size_t)size * depth);
    double t0 = now();
    if (!uring) {
        pthread_t *th = calloc(depth, sizeof *th);
        job *jobs = calloc(depth, sizeof *jobs);
        for (unsigned t = 0; t < depth; t++) {
            jobs[t].n = nreads / depth + (t < nreads % depth);
            jobs[t].seed = seed * (t + 1) * 0x9E3779B97F4A7C15ULL | 1;
            jobs[t].buf = buf + (size_t)t * size;
            pthread_create(&th[t], NULL, reader, &jobs[t]);
        }
        for (unsigned t = 0; t < depth; t++) pthread_join(th[t], NULL);
    } else {
        static tl_uring ring;
        static tl_fdcache cache;
        int rc = tl_uring_setup(&ring, TL_URING_MAX);
        if (rc) {
            fprintf(stderr, "io_uring_setup: %d\n", rc);
            return 1;
        }
        tl_fdcache_init(&cache, (size_t)nfiles + 1);
        tl_fent *ents = calloc((size_t)nfiles, sizeof *ents);
        for (int i = 0; i < nfiles; i++) tl_fent_init(&ents[i], argv[6 + i], 0, i);
        /* batches of 4 * depth requests, each batch kept `depth` deep */
        size_t batch = 4 * (size_t)depth;
        tl_ioreq *reqs = calloc(batch, sizeof *reqs);
        char *bbuf = malloc(batch * size);
        tl_io_error err;
        size_t failed;
        for (uint64_t done = 0; done < nreads; done += batch) {
            size_t n = nreads - done < batch ? (size_t)(nreads - done) : batch;
            for (size_t i = 0; i < n; i++) {
                int f;
                uint64_t off;
                pick(&seed, &f, &off);
                reqs[i] = (tl_ioreq){&ents[f], off, size, (uint8_t *)bbuf + i * size, i};
            }
            if (tl_uring_run(&ring, reqs, n, depth, &cache, NULL, &err, &failed)) {
                fprintf(stderr, "read failed: %d\n", err.code);
                return 1;
            }
        }
    }
    printf("%.6f %llu\n", now() - t0, (unsigned long long)(nreads * size));
    return 0;
}
