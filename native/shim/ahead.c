/* READs answered by the front thread from chunks read ahead (read-through files). kvfs reads
   big NVMe-resident files through the daemon, a few chunks ahead of a sequential reader,
   into its own memory (kvfs.store.ChunkStore, "read-ahead"). Python offers each such chunk
   here once it is read and checked (kvfs_ahead_offer: the bytes stay Python's, kept alive
   until it withdraws them). A READ that lies wholly within the data of offered chunks is
   answered by the front thread from them, and a notice of it queued for Python, which does
   the read's bookkeeping (counters, more read-ahead) as if it had answered it. Only READs
   that change something there get a notice: the first from a chunk, one from its first
   byte, one that reaches its end (more read-ahead, a chunk read, the chunk consumed). The
   others (a 4 KiB reader's 250 READs in the middle of a 1 MiB chunk) are only counted
   here, with their latencies, until Python takes the counts (kvfs_ahead_take_quiet): a
   notice costs the trio thread more than the front thread's whole answer.
   Protocol, under kvfs_front_lock (which guards the table):
   - the front thread marks the chunks it copies from busy, copies without the lock, and
     then unmarks them; a READ that reaches a chunk's end consumes it (Python drops it on
     the notice, as it does when it answers that READ itself);
   - kvfs_ahead_withdraw marks chunks gone and waits until none of them is busy: once it
     returns, no READ is answered from them and Python may free the bytes. Python withdraws
     a chunk before its location changes in any way (a write, a truncation, a deletion, a
     move) and before it drops the bytes. */
#include "kvfs_shim.h"

#include <stdlib.h>
#include <time.h>

#define AHEAD_SLOTS 1024
#define READ_PIECES 257  /* a 1 MiB READ of 4 KiB chunks, unaligned */

struct ahead {
    uint64_t ino, chunk;     /* ino 0: a free slot */
    const char *data; uint32_t len;
    int busy, gone;
    int noted;               /* a READ from it had a notice */
};
static struct ahead table[AHEAD_SLOTS];
static int top = 0;                /* no slot in use at or above it */
static uint64_t chunk_size = 0;    /* 0: no READ is answered here */
static pthread_cond_t idle = PTHREAD_COND_INITIALIZER;
static PyObject *read_fn = NULL;
static uint32_t quiet = 0;  /* READs answered here without a notice, not yet taken */
static uint32_t quiet_hist[KVFS_LATENCY_BUCKETS];  /* ... by log2 of their microseconds */

static int find(uint64_t ino, uint64_t chunk) {  /* with the lock */
    for (int s = 0; s < top; s++)
        if (table[s].ino == ino && table[s].chunk == chunk && !table[s].gone)
            return s;
    return -1;
}

static void release(int s) {  /* with the lock; not busy */
    table[s].ino = 0;
    table[s].data = NULL;
    while (top > 0 && table[top - 1].ino == 0)
        top--;
}

int kvfs_ahead_offer(uint64_t ino, uint64_t chunk, const char *data, uint32_t len) {
    int added = 0;
    if (ino == 0 || len == 0 || !kvfs_front_on)
        return 0;
    pthread_mutex_lock(&kvfs_front_lock);
    if (chunk_size != 0 && find(ino, chunk) < 0) {
        int s = 0;
        while (s < top && table[s].ino != 0)
            s++;
        if (s < AHEAD_SLOTS) {
            struct ahead a = { ino, chunk, data, len, 0, 0, 0 };
            table[s] = a;
            if (s == top)
                top++;
            added = 1;
        }
    }
    pthread_mutex_unlock(&kvfs_front_lock);
    return added;
}

/* Chunk *chunk* of *ino* (every chunk of it if *chunk* < 0) is no longer answered from;
   returns once no READ copies from it. */
void kvfs_ahead_withdraw(uint64_t ino, long long chunk) {
    pthread_mutex_lock(&kvfs_front_lock);
    for (;;) {
        int waiting = 0;
        for (int s = 0; s < top; s++) {
            struct ahead *a = &table[s];
            if (a->ino != ino || (chunk >= 0 && a->chunk != (uint64_t)chunk))
                continue;
            a->gone = 1;
            if (a->busy)
                waiting = 1;
            else
                release(s);
        }
        if (!waiting)
            break;
        pthread_cond_wait(&idle, &kvfs_front_lock);
    }
    pthread_mutex_unlock(&kvfs_front_lock);
}

static uint32_t us_since(const struct timespec *t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    long long ns = (t1.tv_sec - t0->tv_sec) * 1000000000LL + (t1.tv_nsec - t0->tv_nsec);
    return ns < 0 ? 0 : (uint32_t)(ns / 1000);
}

/* A READ wholly within the data of offered chunks: answered here. Returns 1 if so. */
int kvfs_fast_read(const char *mem, size_t n) {
    const struct fuse_in_header *h = (const struct fuse_in_header *)mem;
    if (h->opcode != FUSE_READ || __atomic_load_n(&top, __ATOMIC_RELAXED) == 0
            || n < sizeof *h + sizeof(struct fuse_read_in))
        return 0;
    const struct fuse_read_in *in = (const struct fuse_read_in *)(mem + sizeof *h);
    uint64_t cs = chunk_size, off = in->offset, end = in->offset + in->size;
    if (cs == 0 || in->size == 0 || end < off
            || kvfs_direct_misaligned(in->flags, off, in->size))  /* EINVAL: Python's */
        return 0;
    uint64_t first = off / cs, last = (end - 1) / cs;
    if (last - first >= READ_PIECES)
        return 0;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int slot[READ_PIECES], k = 0, notice = 0;
    uint32_t stop[READ_PIECES];
    struct iovec iov[READ_PIECES + 1];
    pthread_mutex_lock(&kvfs_front_lock);
    for (uint64_t c = first; c <= last; c++, k++) {
        uint64_t a = off > c * cs ? off - c * cs : 0;
        uint64_t b = end < (c + 1) * cs ? end - c * cs : cs;
        int s = find(h->nodeid, c);
        if (s < 0 || b > table[s].len) {  /* not here, or past its data: Python */
            pthread_mutex_unlock(&kvfs_front_lock);
            return 0;
        }
        slot[k] = s;
        stop[k] = (uint32_t)b;
        notice |= !table[s].noted || a == 0 || b == table[s].len;
        iov[k + 1].iov_base = (void *)(table[s].data + a);
        iov[k + 1].iov_len = (size_t)(b - a);
    }
    for (int i = 0; i < k; i++) {
        table[slot[i]].busy++;
        table[slot[i]].noted = 1;
    }
    pthread_mutex_unlock(&kvfs_front_lock);
    struct fuse_out_header out = { (uint32_t)(sizeof out + in->size), 0, h->unique };
    iov[0].iov_base = &out;
    iov[0].iov_len = sizeof out;
    int sent = kvfs_front_send(iov, k + 1) == 0;
    uint32_t us = us_since(&t0);
    struct kvfs_msg *m = sent && notice ? (struct kvfs_msg *)calloc(1, sizeof *m) : NULL;
    if (m != NULL) {
        m->kind = KVFS_MSG_READ;
        m->ino = h->nodeid;
        m->fh = in->fh;
        m->pid = h->pid;
        m->off = off;
        m->len = in->size;
        m->us = us;
    }
    pthread_mutex_lock(&kvfs_front_lock);
    for (int i = 0; i < k; i++) {
        struct ahead *a = &table[slot[i]];
        a->busy--;
        if (sent && stop[i] == a->len)
            a->gone = 1;  /* read to its end: consumed */
        if (a->gone && a->busy == 0)
            release(slot[i]);
    }
    pthread_cond_broadcast(&idle);
    if (m != NULL) {
        kvfs_push(m);
    } else if (sent) {  /* (or no memory for the notice: counted all the same) */
        int bucket = us ? 32 - __builtin_clz(us) : 0;
        quiet++;
        quiet_hist[bucket < KVFS_LATENCY_BUCKETS ? bucket : KVFS_LATENCY_BUCKETS - 1]++;
    }
    pthread_mutex_unlock(&kvfs_front_lock);
    return 1;  /* (not sent: the reader was interrupted and wants no reply) */
}

/* The READs answered here without a notice since the last call: their number, and into
   *hist* their latencies by log2 of microseconds (as Python's histograms count them). */
uint32_t kvfs_ahead_take_quiet(uint32_t hist[KVFS_LATENCY_BUCKETS]) {
    pthread_mutex_lock(&kvfs_front_lock);
    uint32_t n = quiet;
    for (int i = 0; i < KVFS_LATENCY_BUCKETS; i++) {
        hist[i] = quiet_hist[i];
        quiet_hist[i] = 0;
    }
    quiet = 0;
    pthread_mutex_unlock(&kvfs_front_lock);
    return n;
}

void kvfs_set_read_handler(PyObject *fn, uint64_t size) {
    kvfs_set_callback(&read_fn, fn);
    pthread_mutex_lock(&kvfs_front_lock);
    chunk_size = fn != NULL && fn != Py_None ? size : 0;
    pthread_mutex_unlock(&kvfs_front_lock);
}

void kvfs_ahead_deliver(struct kvfs_msg *m) {
    kvfs_call(read_fn, "(KKKIII)", (unsigned long long)m->ino, (unsigned long long)m->fh,
              (unsigned long long)m->off, (unsigned int)m->len, (unsigned int)m->pid,
              (unsigned int)m->us);
}
