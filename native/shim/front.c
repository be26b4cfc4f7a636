/* The front thread: a thread of the shim's own (no GIL) reads every request from the FUSE
   device (-o fast_open or front_reads, with passthrough). It answers some there at once:
   opens of files in the fast-open table (hot.c), READs from chunks read ahead (ahead.c),
   getxattr of file capabilities none has (caps.c); a notice of each answered open or READ
   is queued for Python. Every other request is queued as it came. pyfuse3 waits on an
   eventfd that is readable while the queue is not empty (fuse_session_fd) and takes
   requests from the queue (fuse_session_receive_buf, which hands Python the notices on the
   way): buffers change hands, nothing is copied. kvfs_front_lock guards the queue and the
   spare buffers (and the tables of hot.c and ahead.c: see kvfs_shim.h). */
#include "kvfs_shim.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define KVFS_BUFSIZE (256 * 4096 + 4096)  /* libfuse's: FUSE_MAX_MAX_PAGES + a header */
#define SPARES 16

pthread_mutex_t kvfs_front_lock = PTHREAD_MUTEX_INITIALIZER;
int kvfs_front_on = 0;

static int wanted = 0;
static struct kvfs_msg *q_head = NULL, *q_tail = NULL;
static int front_end = 0;       /* the device said: this errno, no more requests */
static int front_efd = -1;      /* readable while the queue is not empty */
static int front_fd = -1;       /* the thread's own dup of the device */
static struct fuse_session *front_se = NULL;
static char *spare[SPARES];
static int nspare = 0;

void kvfs_push(struct kvfs_msg *m) {  /* with the lock */
    m->next = NULL;
    if (q_tail != NULL) {
        q_tail->next = m;
    } else {
        uint64_t one = 1;
        q_head = m;
        if (write(front_efd, &one, sizeof one) < 0) { /* cannot fail: counter <= 1 */ }
    }
    q_tail = m;
}

static void drained(void) {  /* with the lock: the queue became empty */
    uint64_t n;
    q_tail = NULL;
    if (!front_end && read(front_efd, &n, sizeof n) < 0) { /* was not set */ }
}

static struct kvfs_msg *pop(void) {
    pthread_mutex_lock(&kvfs_front_lock);
    struct kvfs_msg *m = q_head;
    if (m != NULL && (q_head = m->next) == NULL)
        drained();
    pthread_mutex_unlock(&kvfs_front_lock);
    return m;
}

/* With the lock: every notice of an open (answered here, or not sent) off the queue, in
   order; the requests and READ notices stay. */
struct kvfs_msg *kvfs_take_open_notices(void) {
    struct kvfs_msg *notices = NULL, **tail = &notices;
    struct kvfs_msg **p = &q_head, *prev = NULL;
    while (*p != NULL) {
        struct kvfs_msg *m = *p;
        if (m->kind == KVFS_MSG_REQUEST || m->kind == KVFS_MSG_READ) {
            prev = m;
            p = &m->next;
            continue;
        }
        *p = m->next;
        m->next = NULL;
        *tail = m;
        tail = &m->next;
    }
    if (q_head == NULL) {
        if (notices != NULL)
            drained();
    } else {
        q_tail = prev;
    }
    return notices;
}

char *kvfs_buf_get(void) {
    char *mem = NULL;
    pthread_mutex_lock(&kvfs_front_lock);
    if (nspare > 0)
        mem = spare[--nspare];
    pthread_mutex_unlock(&kvfs_front_lock);
    return mem != NULL ? mem : (char *)malloc(KVFS_BUFSIZE);
}

static void buf_put(char *mem) {
    pthread_mutex_lock(&kvfs_front_lock);
    if (nspare < SPARES) {
        spare[nspare++] = mem;
        mem = NULL;
    }
    pthread_mutex_unlock(&kvfs_front_lock);
    free(mem);
}

int kvfs_front_send(const struct iovec *iov, int count) {
    return writev(front_fd, iov, count) < 0 ? -1 : 0;
}

void kvfs_front_reply_error(uint64_t unique, int err) {
    struct fuse_out_header out = { sizeof out, -err, unique };
    if (write(front_fd, &out, sizeof out) < 0) { /* the caller is gone */ }
}

static void *front_main(void *arg) {
    (void)arg;
    char *mem = NULL;
    int end = 0;
    while (!end) {
        if (mem == NULL && (mem = kvfs_buf_get()) == NULL) {
            end = ENOMEM;
            break;
        }
        ssize_t n = read(front_fd, mem, KVFS_BUFSIZE);
        if (n < 0) {
            int err = errno;
            if (err == EAGAIN) {  /* a non-blocking descriptor after all: wait, not spin */
                struct pollfd p = { front_fd, POLLIN, 0 };
                if (poll(&p, 1, -1) < 0 && errno != EINTR) {
                    end = errno;
                    break;
                }
                continue;
            }
            if (err == EINTR || err == ENOENT)
                continue;  /* ENOENT: that request was interrupted */
            end = err;
            break;
        }
        if (n < (ssize_t)sizeof(struct fuse_in_header)) {
            end = n == 0 ? ENODEV : EIO;
            break;
        }
        if (kvfs_fast_read(mem, (size_t)n) || kvfs_fast_open(mem, (size_t)n)
                || kvfs_fast_no_caps(mem, (size_t)n))
            continue;
        struct kvfs_msg *m = (struct kvfs_msg *)calloc(1, sizeof *m);
        if (m == NULL) {
            end = ENOMEM;
            break;
        }
        m->kind = KVFS_MSG_REQUEST;
        m->mem = mem;
        m->size = (size_t)n;
        mem = NULL;
        pthread_mutex_lock(&kvfs_front_lock);
        kvfs_push(m);
        pthread_mutex_unlock(&kvfs_front_lock);
    }
    free(mem);
    pthread_mutex_lock(&kvfs_front_lock);
    front_end = end;
    if (q_head == NULL) {  /* stays readable from now on: every reader wakes */
        uint64_t one = 1;
        if (write(front_efd, &one, sizeof one) < 0) { /* nothing to do */ }
    }
    pthread_mutex_unlock(&kvfs_front_lock);
    close(front_fd);
    return NULL;
}

/* -errno if the thread cannot run (then all is as before: pyfuse3 reads the device). */
static int front_start(struct fuse_session *se, int dev_fd) {
    pthread_t t;
    pthread_attr_t attr;
    sigset_t all, old;
    int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd < 0)
        return -errno;
    int fd = fcntl(dev_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
        int err = errno;
        close(efd);
        return -err;
    }
    front_efd = efd;
    front_fd = fd;
    front_se = se;
    front_end = 0;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);  /* signals stay with Python's thread */
    int r = pthread_create(&t, &attr, front_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (r != 0) {
        close(fd);
        close(efd);
        front_efd = front_fd = -1;
        front_se = NULL;
        return -r;
    }
    kvfs_front_on = 1;
    return 0;
}

void kvfs_front_mounted(struct fuse_session *se, int dev_fd) {
    if (wanted && front_start(se, dev_fd) != 0)
        wanted = 0;
}

int kvfs_front_event_fd(struct fuse_session *se) {
    return kvfs_front_on && se == front_se ? front_efd : -1;
}

static void deliver(struct kvfs_msg *m) {  /* without the lock, on Python's thread */
    if (m->kind == KVFS_MSG_READ)
        kvfs_ahead_deliver(m);
    else
        kvfs_hot_deliver(m);
    free(m);
}

/* fuse_session_receive_buf of the session the front thread reads: the next request from
   the queue, after delivering the notices ahead of it. */
int kvfs_front_receive(struct fuse_session *se, struct fuse_buf *buf) {
    for (;;) {
        struct kvfs_msg *m = pop();
        if (m == NULL) {
            if (!front_end)
                return -EINTR;  /* pyfuse3 waits for the eventfd again */
            fuse_session_exit(se);
            return front_end == ENODEV ? 0 : -front_end;
        }
        if (m->kind != KVFS_MSG_REQUEST) {
            deliver(m);
            continue;
        }
        /* The request's buffer becomes the caller's; the one it held is ours again
           (every buffer handed out is one of ours: libfuse's receive is not called). */
        if (buf->mem != NULL && !(buf->flags & FUSE_BUF_IS_FD))
            buf_put((char *)buf->mem);
        buf->mem = m->mem;
        buf->size = m->size;
        buf->flags = 0;
        buf->pos = 0;
        buf->fd = -1;
        int n = (int)m->size;
        free(m);
        return n;
    }
}

/* Delivers notices taken off the queue (kvfs_take_open_notices), in order. */
void kvfs_deliver_all(struct kvfs_msg *notices) {
    while (notices != NULL) {
        struct kvfs_msg *m = notices;
        notices = m->next;
        deliver(m);
    }
}

void kvfs_want_front_thread(int on) {
    wanted = on;
}

int kvfs_front_running(void) {
    return kvfs_front_on;
}
