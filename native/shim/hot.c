/* Opens of resident files answered by the front thread, without the trio thread. An OPEN for
   reading (no O_TRUNC; O_DIRECT too: tmpfs serves it) of a file in the fast-open table
   (inodes whose every chunk is in DRAM and checked, with their backing id, kept by kvfs.fs)
   is answered there at once, in passthrough mode, with a handle from the first one kvfs.fs
   leaves to the front thread (set_rules), and a notice of it is queued for Python.

   Protocol (under kvfs_front_lock, which guards the table and the parked opens):
   - the front thread looks an inode up and queues the notice under the lock, and only then
     replies; so a notice always precedes the RELEASE of the handle it announces;
   - kvfs_hot_revoke removes an inode under the lock and then delivers every queued notice:
     once it returns, no open of that inode can be answered here, and Python knows every
     open that was. Python revokes before anything that would make a passthrough read of
     the file wrong (its DRAM copies dropped or repacked, a write, a truncation, its data
     freed);
   - an entry may be added pending (kvfs_hot_pending: a prefetch is staging the file's only
     chunk), with a ticket. An open of a pending file is parked here (a copy of its request)
     until the worker thread that staged and checked the bytes calls kvfs_hot_ready with
     that ticket, which answers the parked opens (notices queued under the lock, replies
     after) and lets later ones be answered at once: none of them waits for Python to hear
     that the prefetch is over (it may be busy with other work for milliseconds).
     kvfs_hot_revoke of a pending file queues its parked opens for Python as the requests
     they were. A ticket names one entry: a ready from a prefetch whose entry was revoked
     changes nothing.
   The table holds at most the limit kvfs.fs sets (hot_limit, before the mount), in at
   least twice as many slots; there is none before. */
#include "kvfs_shim.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>

#define PARKED_MAX 256  /* more opens of pending files go to Python */
#define READY_BATCH 32

static uint64_t *hot_ino = NULL;     /* 0: empty slot (linear probing) */
static int32_t *hot_id = NULL;
static uint64_t *hot_ticket = NULL;  /* 0: ready; else pending, this one */
static size_t hot_slots = 0;         /* a power of two; 0: no table (nor entries) yet */
static int hot_shift = 64;           /* 64 - log2(hot_slots): a hash's top bits index it */
static int hot_n = 0;
static int hot_limit = 0;
static uint64_t next_ticket = 1;
static uint64_t next_fh = 0;         /* 0 (until set_rules): no open is answered here */
static struct kvfs_msg *parked = NULL;  /* opens of pending files, oldest first */
static int nparked = 0;
static unsigned long long parked_total = 0;
static PyObject *opened_fn = NULL;

static size_t hot_home(uint64_t ino) {
    return (size_t)((ino * 0x9E3779B97F4A7C15ULL) >> hot_shift);
}

static size_t hot_find(uint64_t ino) {  /* with the lock and a table */
    size_t i = hot_home(ino);
    while (hot_ino[i] != 0 && hot_ino[i] != ino)
        i = (i + 1) & (hot_slots - 1);
    return i;
}

static void hot_delete(uint64_t ino) {  /* with the lock; backward-shift deletion */
    if (hot_n == 0)
        return;
    size_t i = hot_find(ino), j = i;
    if (hot_ino[i] == 0)
        return;
    for (;;) {
        j = (j + 1) & (hot_slots - 1);
        if (hot_ino[j] == 0)
            break;
        size_t k = hot_home(hot_ino[j]);
        /* the entry at j may move to the hole at i unless its home lies in (i, j] */
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            hot_ino[i] = hot_ino[j];
            hot_id[i] = hot_id[j];
            hot_ticket[i] = hot_ticket[j];
            i = j;
        }
    }
    hot_ino[i] = 0;
    hot_n--;
}

/* With the lock: the table in *slots* slots (a power of two), its entries moved over.
   -ENOMEM: it is as it was. */
static int hot_resize(size_t slots) {
    uint64_t *ino = (uint64_t *)calloc(slots, sizeof *ino);
    int32_t *id = (int32_t *)calloc(slots, sizeof *id);
    uint64_t *ticket = (uint64_t *)calloc(slots, sizeof *ticket);
    if (ino == NULL || id == NULL || ticket == NULL) {
        free(ino);
        free(id);
        free(ticket);
        return -ENOMEM;
    }
    uint64_t *old_ino = hot_ino, *old_ticket = hot_ticket;
    int32_t *old_id = hot_id;
    size_t old_slots = hot_slots;
    hot_ino = ino;
    hot_id = id;
    hot_ticket = ticket;
    hot_slots = slots;
    hot_shift = 64 - __builtin_ctzll(slots);
    for (size_t s = 0; s < old_slots; s++) {
        if (old_ino[s] == 0)
            continue;
        size_t i = hot_find(old_ino[s]);
        hot_ino[i] = old_ino[s];
        hot_id[i] = old_id[s];
        hot_ticket[i] = old_ticket[s];
    }
    free(old_ino);
    free(old_id);
    free(old_ticket);
    return 0;
}

/* With the lock: *m* (ino, flags, pid set) becomes the notice of an open answered here with
   a new handle, which is returned; reply with reply_open after unlocking. */
static uint64_t open_here(struct kvfs_msg *m) {
    m->kind = KVFS_MSG_OPENED;
    m->fh = next_fh++;
    kvfs_push(m);
    return m->fh;
}

static void reply_open(uint64_t ino, uint64_t unique, uint64_t fh, int32_t id) {
    struct fuse_out_header out = { sizeof out + sizeof(struct fuse_open_out), 0, unique };
    struct fuse_open_out o = { .fh = fh, .open_flags = FOPEN_PASSTHROUGH };
    KVFS_OPEN_OUT_BACKING_ID(&o) = id;
    struct iovec iov[2] = { { &out, sizeof out }, { &o, sizeof o } };
    if (kvfs_front_send(iov, 2) < 0) {
        /* The opener is gone (interrupted): no RELEASE will come for fh. */
        struct kvfs_msg *u = (struct kvfs_msg *)calloc(1, sizeof *u);
        if (u != NULL) {
            u->kind = KVFS_MSG_UNSENT;
            u->ino = ino;
            u->fh = fh;
            pthread_mutex_lock(&kvfs_front_lock);
            kvfs_push(u);
            pthread_mutex_unlock(&kvfs_front_lock);
        }
    }
}

/* With the lock: the parked opens of *ino* (at most *max*), taken off the list in order. */
static struct kvfs_msg *unpark(uint64_t ino, int max) {
    struct kvfs_msg *out = NULL, **tail = &out, **p = &parked;
    while (*p != NULL && max > 0) {
        struct kvfs_msg *m = *p;
        if (m->ino != ino) {
            p = &m->next;
            continue;
        }
        *p = m->next;
        m->next = NULL;
        *tail = m;
        tail = &m->next;
        nparked--;
        max--;
    }
    return out;
}

/* An OPEN for reading of an inode in the table: answered here, or parked while the inode is
   pending. Returns 1 if it was either. */
int kvfs_fast_open(const char *mem, size_t n) {
    const struct fuse_in_header *h = (const struct fuse_in_header *)mem;
    if (h->opcode != FUSE_OPEN || n < sizeof *h + sizeof(struct fuse_open_in))
        return 0;
    const struct fuse_open_in *in = (const struct fuse_open_in *)(mem + sizeof *h);
    if ((in->flags & O_ACCMODE) != O_RDONLY || (in->flags & O_TRUNC))
        return 0;
    struct kvfs_msg *m = (struct kvfs_msg *)calloc(1, sizeof *m);
    if (m == NULL)
        return 0;
    pthread_mutex_lock(&kvfs_front_lock);
    size_t i = hot_n != 0 ? hot_find(h->nodeid) : 0;
    if (hot_n == 0 || hot_ino[i] == 0
            || (hot_ticket[i] != 0 && (nparked >= PARKED_MAX || n > KVFS_RAW_MAX))) {
        pthread_mutex_unlock(&kvfs_front_lock);
        free(m);
        return 0;
    }
    m->ino = h->nodeid;
    m->flags = in->flags;
    m->pid = h->pid;
    m->unique = h->unique;
    if (hot_ticket[i] != 0) {  /* pending: wait here for kvfs_hot_ready */
        m->kind = KVFS_MSG_PARKED;
        m->rawlen = (uint32_t)n;
        memcpy(m->raw, mem, n);
        struct kvfs_msg **p = &parked;
        while (*p != NULL)
            p = &(*p)->next;
        m->next = NULL;
        *p = m;
        nparked++;
        parked_total++;
        pthread_mutex_unlock(&kvfs_front_lock);
        return 1;
    }
    int32_t id = hot_id[i];
    uint64_t fh = open_here(m);
    pthread_mutex_unlock(&kvfs_front_lock);
    reply_open(h->nodeid, h->unique, fh, id);
    return 1;
}

/* Python's view after this: no open of *ino* is answered here any more, and every one that
   was has been delivered (with every other queued notice). */
void kvfs_hot_revoke(uint64_t ino) {
    pthread_mutex_lock(&kvfs_front_lock);
    hot_delete(ino);
    struct kvfs_msg *waiting = unpark(ino, PARKED_MAX);
    struct kvfs_msg *notices = kvfs_take_open_notices();
    pthread_mutex_unlock(&kvfs_front_lock);
    kvfs_deliver_all(notices);
    while (waiting != NULL) {  /* Python answers them now, as if they had not waited */
        struct kvfs_msg *m = waiting;
        waiting = m->next;
        char *mem = kvfs_buf_get();  /* a request's buffer must be a whole one */
        if (mem == NULL) {  /* cannot happen in practice; the opener gets EIO */
            kvfs_front_reply_error(m->unique, EIO);
            free(m);
            continue;
        }
        memcpy(mem, m->raw, m->rawlen);
        m->kind = KVFS_MSG_REQUEST;
        m->mem = mem;
        m->size = m->rawlen;
        pthread_mutex_lock(&kvfs_front_lock);
        kvfs_push(m);
        pthread_mutex_unlock(&kvfs_front_lock);
    }
}

/* Adds *ino* (absent) ready, or pending if *pending*. Returns 0 if it was not added
   (present, the table full, no front thread), else 1 or the pending entry's ticket. */
static uint64_t hot_insert(uint64_t ino, int32_t id, int pending) {
    uint64_t added = 0;
    if (ino == 0 || !kvfs_front_on)
        return 0;
    pthread_mutex_lock(&kvfs_front_lock);
    if (next_fh != 0 && hot_n < hot_limit) {
        size_t i = hot_find(ino);
        if (hot_ino[i] == 0) {
            hot_ino[i] = ino;
            hot_id[i] = id;
            hot_ticket[i] = pending ? next_ticket++ : 0;
            hot_n++;
            added = pending ? hot_ticket[i] : 1;
        }
    }
    pthread_mutex_unlock(&kvfs_front_lock);
    return added;
}

int kvfs_hot_add(uint64_t ino, int32_t id) {
    return hot_insert(ino, id, 0) != 0;
}

uint64_t kvfs_hot_pending(uint64_t ino, int32_t id) {
    return hot_insert(ino, id, 1);
}

/* The pending entry of *ino* with *ticket*, if it is still there, is ready now: its parked
   opens are answered, a batch at a time (notices queued under the lock, the replies after
   it). */
int kvfs_hot_ready(uint64_t ino, uint64_t ticket) {
    int ready = 0;
    int32_t id = 0;
    pthread_mutex_lock(&kvfs_front_lock);
    if (ticket != 0 && hot_n != 0) {
        size_t i = hot_find(ino);
        if (hot_ino[i] == ino && hot_ticket[i] == ticket) {
            hot_ticket[i] = 0;
            id = hot_id[i];
            ready = 1;
        }
    }
    pthread_mutex_unlock(&kvfs_front_lock);
    while (ready) {
        uint64_t unique[READY_BATCH], fh[READY_BATCH];
        int n = 0;
        pthread_mutex_lock(&kvfs_front_lock);
        size_t i = hot_find(ino);
        if (hot_ino[i] != ino || hot_ticket[i] != 0 || hot_id[i] != id) {
            pthread_mutex_unlock(&kvfs_front_lock);  /* revoked: it took the rest */
            break;
        }
        struct kvfs_msg *batch = unpark(ino, READY_BATCH);
        while (batch != NULL) {
            struct kvfs_msg *m = batch;
            batch = m->next;
            unique[n] = m->unique;
            fh[n++] = open_here(m);
        }
        pthread_mutex_unlock(&kvfs_front_lock);
        for (int k = 0; k < n; k++)
            reply_open(ino, unique[k], fh[k], id);
        if (n < READY_BATCH)
            break;
    }
    return ready;
}

/* At most *n* files (at least 1) in the table, which grows to hold them; returns the limit
   set, or -ENOMEM (then it is unchanged). */
int kvfs_set_hot_limit(int n) {
    if (n < 1)
        n = 1;
    size_t slots = 2;
    while (slots < 2 * (size_t)n)
        slots <<= 1;
    pthread_mutex_lock(&kvfs_front_lock);
    int r = slots > hot_slots ? hot_resize(slots) : 0;
    if (r == 0)
        hot_limit = n;
    pthread_mutex_unlock(&kvfs_front_lock);
    return r == 0 ? n : r;
}

void kvfs_set_first_fast_fh(uint64_t fh) {
    pthread_mutex_lock(&kvfs_front_lock);
    next_fh = fh;
    pthread_mutex_unlock(&kvfs_front_lock);
}

/* Opens of pending files parked since the module was loaded. */
unsigned long long kvfs_parked_count(void) {
    pthread_mutex_lock(&kvfs_front_lock);
    unsigned long long n = parked_total;
    pthread_mutex_unlock(&kvfs_front_lock);
    return n;
}

void kvfs_set_opened_handler(PyObject *fn) {
    kvfs_set_callback(&opened_fn, fn);
}

void kvfs_hot_deliver(struct kvfs_msg *m) {
    kvfs_call(opened_fn, "(KKIIi)", (unsigned long long)m->ino, (unsigned long long)m->fh,
              (unsigned int)m->flags, (unsigned int)m->pid, m->kind == KVFS_MSG_OPENED ? 1 : 0);
}
