/*
 * delayfs.c -- a read-only FUSE passthrough of one directory that makes reads
 * slow the way network storage is slow: every read waits a fixed base latency,
 * and a chosen fraction of reads waits a long extra delay (a latency spike).
 *
 *   cc -O2 -Wall $(pkg-config --cflags fuse3) bench/delayfs/delayfs.c \
 *      $(pkg-config --libs fuse3) -o delayfs
 *   ./delayfs SOURCE MOUNTPOINT -f -o delay_ms=200,fraction=0.001,base_us=500,seed=1
 *   fusermount3 -u MOUNTPOINT
 *
 * Options (with -o, besides libfuse's own, e.g. max_threads=N):
 *   delay_ms=N    the extra delay of a delayed read, milliseconds (default 0)
 *   fraction=F    the fraction of reads that are delayed, 0..1 (default 0)
 *   base_us=N     latency added to every read, microseconds (default 0)
 *   seed=N        which reads are delayed (default 0)
 *
 * Which reads are delayed is deterministic: a read is delayed when a hash of
 * (seed, file name, offset, size) falls below `fraction`, so the choice does
 * not depend on which daemon thread serves it or in what order reads arrive.
 * The daemon is multithreaded (libfuse's default loop; raise -o max_threads
 * to keep many requests in service), and a delayed read only blocks the
 * thread serving it, so concurrent reads overlap as on a network filesystem.
 *
 * Reads go through the kernel's page cache on the FUSE side (no direct_io):
 * FUSE refuses a shared mmap of a direct_io file on this libfuse, and readers
 * such as np.memmap need one.  So a measurement drops the page cache first
 * (`echo 1 > /proc/sys/vm/drop_caches`), and then every read of data not yet
 * read in that measurement reaches the daemon.  On unmount the daemon prints
 * "delayfs: reads R delayed D bytes B" on stderr.
 */
#define FUSE_USE_VERSION 312
#define _GNU_SOURCE

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct options {
    char *source;
    unsigned delay_ms, base_us;
    double fraction;
    unsigned long long seed;
} options;

static options opt;
static int src_fd = -1; /* the source directory; every path is opened relative to it */
static atomic_ullong n_reads, n_delayed, n_bytes;

/* An open file: its descriptor and the hash of its name, mixed into each read's key. */
typedef struct handle {
    int fd;
    uint64_t key;
} handle;

#define OPT(t, p) {t, offsetof(options, p), 1}
static const struct fuse_opt option_spec[] = {
    OPT("delay_ms=%u", delay_ms),
    OPT("base_us=%u", base_us),
    OPT("fraction=%lf", fraction),
    OPT("seed=%llu", seed),
    FUSE_OPT_END,
};

/* splitmix64's finalizer: a good 64-bit mix, enough to pick reads at random. */
static uint64_t mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static uint64_t hash_name(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ULL;
    return mix(h);
}

static void sleep_us(uint64_t us)
{
    struct timespec t = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
    while (nanosleep(&t, &t) && errno == EINTR) {
    }
}

/* "/a/b" -> "a/b" relative to src_fd; "/" -> "." */
static const char *rel(const char *path)
{
    while (*path == '/') path++;
    return *path ? path : ".";
}

static int fs_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
    if (fi) return fstat(((handle *)(uintptr_t)fi->fh)->fd, st) ? -errno : 0;
    return fstatat(src_fd, rel(path), st, AT_SYMLINK_NOFOLLOW) ? -errno : 0;
}

static int fs_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t off,
                      struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
    (void)off, (void)fi, (void)flags;
    int fd = openat(src_fd, rel(path), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -errno;
    DIR *d = fdopendir(fd);
    if (!d) {
        int e = errno;
        close(fd);
        return -e;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        struct stat st = {.st_ino = e->d_ino, .st_mode = (mode_t)DTTOIF(e->d_type)};
        if (fill(buf, e->d_name, &st, 0, 0)) break;
    }
    closedir(d);
    return 0;
}

static int fs_open(const char *path, struct fuse_file_info *fi)
{
    if ((fi->flags & O_ACCMODE) != O_RDONLY) return -EROFS;
    int fd = openat(src_fd, rel(path), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    handle *h = malloc(sizeof *h);
    if (!h) {
        close(fd);
        return -ENOMEM;
    }
    h->fd = fd;
    h->key = hash_name(path) ^ mix(opt.seed);
    fi->fh = (uint64_t)(uintptr_t)h;
    return 0;
}

static int fs_read(const char *path, char *buf, size_t size, off_t off,
                   struct fuse_file_info *fi)
{
    (void)path;
    handle *h = (handle *)(uintptr_t)fi->fh;
    uint64_t key = mix(h->key ^ mix((uint64_t)off) ^ mix((uint64_t)size * 0x9E3779B97F4A7C15ULL));
    int delayed = opt.fraction > 0 && (double)(key >> 11) * 0x1p-53 < opt.fraction;
    uint64_t wait = opt.base_us + (delayed ? (uint64_t)opt.delay_ms * 1000 : 0);
    if (wait) sleep_us(wait);
    size_t done = 0;
    while (done < size) { /* pread may return short; EOF ends the read */
        ssize_t r = pread(h->fd, buf + done, size - done, off + (off_t)done);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) break;
        done += (size_t)r;
    }
    atomic_fetch_add(&n_reads, 1);
    atomic_fetch_add(&n_delayed, (unsigned long long)delayed);
    atomic_fetch_add(&n_bytes, done);
    return (int)done;
}

static int fs_release(const char *path, struct fuse_file_info *fi)
{
    (void)path;
    handle *h = (handle *)(uintptr_t)fi->fh;
    close(h->fd);
    free(h);
    return 0;
}

static int fs_statfs(const char *path, struct statvfs *st)
{
    (void)path;
    return fstatvfs(src_fd, st) ? -errno : 0;
}

static void *fs_init(struct fuse_conn_info *conn, struct fuse_config *cfg)
{
    /* Readahead and mmap faults are "background" requests, of which the kernel keeps
     * only max_background (default 12) in flight: allow as many as the threads. */
    conn->max_background = 128;
    conn->congestion_threshold = 96;
    cfg->use_ino = 1;
    /* Every open starts cold, like a fresh network mount. The kernel drops the file's
     * pages at each open and waits there for any page a read still has in flight,
     * so an open of a file being read waits up to a delay (NFS drops the pages only
     * of a file that changed): open files before reading them concurrently. */
    cfg->kernel_cache = 0;
    return NULL;
}

static void fs_destroy(void *data)
{
    (void)data;
    fprintf(stderr, "delayfs: reads %llu delayed %llu bytes %llu\n",
            (unsigned long long)n_reads, (unsigned long long)n_delayed,
            (unsigned long long)n_bytes);
}

static const struct fuse_operations ops = {
    .getattr = fs_getattr,
    .readdir = fs_readdir,
    .open = fs_open,
    .read = fs_read,
    .release = fs_release,
    .statfs = fs_statfs,
    .init = fs_init,
    .destroy = fs_destroy,
};

/* The first non-option argument is the source directory; the rest go to libfuse. */
static int take_source(void *data, const char *arg, int key, struct fuse_args *out)
{
    (void)data, (void)out;
    if (key == FUSE_OPT_KEY_NONOPT && !opt.source) {
        opt.source = realpath(arg, NULL);
        if (!opt.source) {
            perror(arg);
            exit(1);
        }
        return 0;
    }
    return 1;
}

int main(int argc, char **argv)
{
    struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
    if (fuse_opt_parse(&args, &opt, option_spec, take_source) || !opt.source) {
        fprintf(stderr,
                "usage: %s SOURCE MOUNTPOINT [-f] "
                "[-o delay_ms=N,fraction=F,base_us=N,seed=N,max_threads=N]\n",
                argv[0]);
        return 2;
    }
    if (opt.fraction < 0 || opt.fraction > 1) {
        fprintf(stderr, "fraction must be in [0, 1], got %g\n", opt.fraction);
        return 2;
    }
    src_fd = open(opt.source, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (src_fd < 0) {
        perror(opt.source);
        return 1;
    }
    fuse_opt_add_arg(&args, "-oro,fsname=delayfs,subtype=delayfs");
    int rc = fuse_main(args.argc, args.argv, &ops, NULL);
    fuse_opt_free_args(&args);
    return rc;
}
