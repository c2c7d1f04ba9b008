/* The frontend's accept thread: takes every connection off the listening socket, answers
 * `GET /health` itself, and hands every other connection to the event loop.
 *
 * Why a C thread: the event loop runs ready work FIFO, and a burst of hundreds of requests
 * is hundreds of handlers queued ahead of a health probe that arrives after them. Here the
 * probe is answered without waiting for that queue and without the GIL. The thread asks
 * the loop for a fresh report (`want_fd`) and waits up to `wait_ms` for it (`fresh_fd`,
 * written by set_health); a loop too busy to answer that fast gets its probe answered from
 * the last report, which the loop also renews a few times a second
 * (frontend/http/acceptor.py).
 * A report older than `stale_ms` means the loop itself has stopped turning: the probe then
 * gets 503, so a wedged frontend is not hidden.
 *
 * Per connection: accept4 (non-blocking), then peek at its first bytes (never consuming
 * them) until they can be told apart. A request line `GET /health` or `GET /health?...`
 * with its headers complete within MAX_HEAD bytes is read, and (once a report is at hand)
 * answered with `Connection: close` and closed. Anything else, or a connection silent for `peek_ms`, is
 * handed over untouched: its fd number is written (4 bytes, atomic on a pipe) to
 * `handoff_fd`, which the event loop reads. Once handed over, the loop owns the fd.
 *
 * Threading: the thread owns the listening fd's accept side, its epoll set and the fds
 * it has not handed over. The health body is shared under `mu`. stop() wakes the thread
 * through an eventfd and joins it; fds still pending are closed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_PENDING 1024
#define MAX_HEAD 4096

typedef struct {
    int fd;
    int awaiting; /* 0: still peeking; 1: a probe read, waiting for a fresh report */
    int64_t deadline_ms;
} pending_t;

typedef struct {
    int listen_fd, handoff_fd, want_fd, fresh_fd, stop_fd, epfd;
    int peek_ms, wait_ms, stale_ms;
    pthread_t thread;
    int started;
    pending_t pending[MAX_PENDING];
    int n_pending;
    pthread_mutex_t mu; /* guards the fields below */
    char *body;
    size_t body_len;
    int status;
    int64_t body_at_ms;
    uint64_t accepted, answered, handed_over;
} acceptor_t;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void forget(acceptor_t *a, int i) {
    epoll_ctl(a->epfd, EPOLL_CTL_DEL, a->pending[i].fd, NULL);
    a->pending[i] = a->pending[--a->n_pending];
}

/* Give `fd` to the event loop (or close it if we are stopping). */
static void send_fd(acceptor_t *a, int fd) {
    /* Counted before the loop can see it: a client served by the loop must never find
     * it missing from stats(). */
    pthread_mutex_lock(&a->mu);
    a->handed_over++;
    pthread_mutex_unlock(&a->mu);
    for (;;) {
        ssize_t w = write(a->handoff_fd, &fd, sizeof fd); /* handoff_fd is non-blocking */
        if (w == (ssize_t)sizeof fd) return;
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EAGAIN) {
            /* The pipe is full: the loop lags far behind. Wait for room, but never past
             * stop(): the loop may be the thread joining us, and it reads no more. */
            struct pollfd p[2] = {{a->handoff_fd, POLLOUT, 0}, {a->stop_fd, POLLIN, 0}};
            int r = poll(p, 2, -1);
            if (r < 0 && errno == EINTR) continue;
            if (r > 0 && !(p[1].revents & POLLIN)) continue; /* room again */
        }
        close(fd); /* stopping (stop_fd stays readable for run()), or the loop side is gone */
        return;
    }
}

static void hand_over(acceptor_t *a, int i) {
    int fd = a->pending[i].fd;
    forget(a, i);
    send_fd(a, fd);
}

static void drop(acceptor_t *a, int i) {
    int fd = a->pending[i].fd;
    forget(a, i);
    close(fd);
}

static const char HEALTH[] = "GET /health";

/* 1: a health request, 0: not one, -1: cannot tell yet (a prefix of one). */
static int is_health(const char *buf, size_t n) {
    size_t k = sizeof HEALTH - 1;
    if (n < k) return memcmp(buf, HEALTH, n) == 0 ? -1 : 0;
    if (memcmp(buf, HEALTH, k) != 0) return 0;
    if (n == k) return -1;
    return (buf[k] == ' ' || buf[k] == '?') ? 1 : 0;
}

/* Whether a request head announces a body (Content-Length or Transfer-Encoding). */
static int has_body(const char *head, size_t n) {
    static const char *const names[] = {"\ncontent-length:", "\ntransfer-encoding:"};
    for (size_t j = 0; j < 2; j++) {
        size_t m = strlen(names[j]);
        for (size_t p = 0; p + m <= n; p++)
            if (strncasecmp(head + p, names[j], m) == 0) return 1;
    }
    return 0;
}

static void answer(acceptor_t *a, int fd) {
    pthread_mutex_lock(&a->mu);
    int fresh = a->body != NULL && now_ms() - a->body_at_ms <= a->stale_ms;
    int status = fresh ? a->status : 503;
    const char *body = fresh ? a->body
                             : "{\"status\":\"unresponsive\",\"message\":\"the frontend's event "
                               "loop has not refreshed its health report in time\"}";
    size_t body_len = fresh ? a->body_len : strlen(body);
    char head[256];
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                     "content-length: %zu\r\nconnection: close\r\n\r\n",
                     status, status == 200 ? "OK" : status == 503 ? "Service Unavailable"
                             : status == 500 ? "Internal Server Error" : "Unknown", body_len);
    struct iovec iov[2] = {{head, (size_t)n}, {(void *)body, body_len}};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 2};
    /* A probe's socket buffer takes a few KB at once; a short write loses only this reply. */
    (void)!sendmsg(fd, &msg, MSG_NOSIGNAL);
    a->answered++;
    pthread_mutex_unlock(&a->mu);
    shutdown(fd, SHUT_WR);
    char sink[512]; /* bytes that came after the request (sent late): unread, close() would RST */
    while (recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {}
    close(fd);
}

/* Look at a pending connection's first bytes; decide, or leave it pending. */
static void inspect(acceptor_t *a, int i) {
    char buf[MAX_HEAD];
    ssize_t n = recv(a->pending[i].fd, buf, sizeof buf, MSG_PEEK);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) {
        drop(a, i); /* closed or reset before it asked for anything */
        return;
    }
    int health = is_health(buf, (size_t)n);
    if (health == 0) {
        hand_over(a, i);
        return;
    }
    if (health == 1) {
        for (ssize_t k = 3; k < n; k++) {
            if (buf[k] == '\n' && buf[k - 1] == '\r' && buf[k - 2] == '\n' && buf[k - 3] == '\r') {
                if (k + 1 < n || has_body(buf, (size_t)k + 1)) {
                    hand_over(a, i); /* a body or pipelined requests follow: the loop's */
                    return;
                }
                (void)!recv(a->pending[i].fd, buf, (size_t)k + 1, 0); /* consume the request */
                a->pending[i].awaiting = 1;
                a->pending[i].deadline_ms = now_ms() + a->wait_ms;
                uint64_t one = 1;
                (void)!write(a->want_fd, &one, sizeof one); /* the loop: a report, please */
                return;
            }
        }
        if (n == (ssize_t)sizeof buf) hand_over(a, i); /* headers too long for us: the loop decides */
    }
    /* else: a prefix so far; edge-triggered epoll reports the next bytes */
}

/* A pending connection's time is up: a waiting probe gets the last report, anything
 * still undecided goes to the loop. */
static void expire(acceptor_t *a, int i) {
    if (!a->pending[i].awaiting) {
        hand_over(a, i);
        return;
    }
    int fd = a->pending[i].fd;
    forget(a, i);
    answer(a, fd);
}

/* A fresh report is in: every waiting probe gets it. */
static void answer_waiting(acceptor_t *a) {
    for (int i = a->n_pending - 1; i >= 0; i--) {
        if (a->pending[i].awaiting) expire(a, i);
    }
}

static void accept_all(acceptor_t *a) {
    for (;;) {
        int fd = accept4(a->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                /* EMFILE, ENFILE, ENOBUFS, ENOMEM: the listening socket stays readable, so
                 * retrying at once would spin. Pause; the backlog holds the clients. */
                struct timespec pause = {0, 10 * 1000 * 1000};
                nanosleep(&pause, NULL);
            }
            return;
        }
        pthread_mutex_lock(&a->mu);
        a->accepted++;
        pthread_mutex_unlock(&a->mu);
        if (a->n_pending == MAX_PENDING) expire(a, 0); /* make room: decide one now */
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.fd = fd};
        if (epoll_ctl(a->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
            send_fd(a, fd); /* cannot watch it: the loop has it undecided */
            continue;
        }
        int i = a->n_pending++;
        a->pending[i] = (pending_t){fd, 0, now_ms() + a->peek_ms};
        inspect(a, i); /* its bytes may have come with the handshake */
    }
}

static void *run(void *arg) {
    acceptor_t *a = arg;
    struct epoll_event events[64];
    for (;;) {
        int timeout = -1;
        int64_t now = now_ms();
        for (int i = 0; i < a->n_pending; i++) {
            int64_t left = a->pending[i].deadline_ms - now;
            int t = left < 0 ? 0 : (int)left;
            if (timeout < 0 || t < timeout) timeout = t;
        }
        int n = epoll_wait(a->epfd, events, 64, timeout);
        if (n < 0 && errno != EINTR) {
            /* Cannot happen with valid fds; if it does, say so: nothing accepts any more. */
            perror("pdserve frontend accept thread: epoll_wait");
            break;
        }
        for (int e = 0; e < n; e++) {
            int fd = events[e].data.fd;
            if (fd == a->stop_fd) goto out;
            if (fd == a->listen_fd) {
                accept_all(a);
                continue;
            }
            if (fd == a->fresh_fd) {
                uint64_t count;
                (void)!read(a->fresh_fd, &count, sizeof count);
                answer_waiting(a);
                continue;
            }
            for (int i = 0; i < a->n_pending; i++) {
                if (a->pending[i].fd == fd) {
                    if (!a->pending[i].awaiting) inspect(a, i); /* else: answered soon anyway */
                    break;
                }
            }
        }
        now = now_ms();
        for (int i = a->n_pending - 1; i >= 0; i--) {
            if (a->pending[i].deadline_ms <= now) expire(a, i);
        }
    }
out:
    answer_waiting(a); /* probes already read get their answer; the rest are closed */
    while (a->n_pending > 0) drop(a, a->n_pending - 1);
    return NULL;
}

/* Wake the thread through stop_fd and wait for it to end (no-op if it is not running). */
static void join_thread(acceptor_t *a) {
    if (!a->started) return;
    uint64_t one = 1;
    (void)!write(a->stop_fd, &one, sizeof one);
    pthread_join(a->thread, NULL);
    a->started = 0;
}

/* Everything start() made; the thread must not be running. */
static void release(acceptor_t *a) {
    close(a->epfd);
    close(a->stop_fd);
    close(a->fresh_fd);
    pthread_mutex_destroy(&a->mu);
    free(a->body);
    free(a);
}

static void destroy(PyObject *capsule) {
    acceptor_t *a = PyCapsule_GetPointer(capsule, "pdserve.acceptor");
    if (a == NULL) return;
    join_thread(a); /* the thread never takes the GIL: joining while holding it is safe */
    release(a);
}

static acceptor_t *get(PyObject *capsule) {
    return PyCapsule_GetPointer(capsule, "pdserve.acceptor");
}

/* start(listen_fd, handoff_fd, want_fd, peek_ms, wait_ms, stale_ms) -> handle */
static PyObject *start(PyObject *self, PyObject *args) {
    int listen_fd, handoff_fd, want_fd, peek_ms, wait_ms, stale_ms;
    if (!PyArg_ParseTuple(args, "iiiiii", &listen_fd, &handoff_fd, &want_fd, &peek_ms, &wait_ms,
                          &stale_ms))
        return NULL;
    acceptor_t *a = calloc(1, sizeof *a);
    if (a == NULL) return PyErr_NoMemory();
    a->listen_fd = listen_fd, a->handoff_fd = handoff_fd, a->want_fd = want_fd;
    a->peek_ms = peek_ms, a->wait_ms = wait_ms, a->stale_ms = stale_ms;
    pthread_mutex_init(&a->mu, NULL);
    a->stop_fd = eventfd(0, EFD_CLOEXEC);
    a->fresh_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    a->epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event on_listen = {.events = EPOLLIN, .data.fd = listen_fd};
    struct epoll_event on_stop = {.events = EPOLLIN, .data.fd = a->stop_fd};
    struct epoll_event on_fresh = {.events = EPOLLIN, .data.fd = a->fresh_fd};
    if (a->stop_fd < 0 || a->fresh_fd < 0 || a->epfd < 0 ||
        epoll_ctl(a->epfd, EPOLL_CTL_ADD, listen_fd, &on_listen) != 0 ||
        epoll_ctl(a->epfd, EPOLL_CTL_ADD, a->stop_fd, &on_stop) != 0 ||
        epoll_ctl(a->epfd, EPOLL_CTL_ADD, a->fresh_fd, &on_fresh) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (a->stop_fd >= 0) close(a->stop_fd);
        if (a->fresh_fd >= 0) close(a->fresh_fd);
        if (a->epfd >= 0) close(a->epfd);
        free(a);
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(a, "pdserve.acceptor", destroy);
    if (capsule == NULL) {
        release(a);
        return NULL;
    }
    /* Signals stay with the main thread (Python handles them there). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = pthread_create(&a->thread, NULL, run, a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        Py_DECREF(capsule);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    a->started = 1;
    return capsule;
}

/* set_health(handle, status, body): the reply to the next probes, fresh as of now. */
static PyObject *set_health(PyObject *self, PyObject *args) {
    PyObject *capsule;
    int status;
    const char *body;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Oiy#", &capsule, &status, &body, &len)) return NULL;
    acceptor_t *a = get(capsule);
    if (a == NULL) return NULL;
    char *copy = malloc(len > 0 ? (size_t)len : 1);
    if (copy == NULL) return PyErr_NoMemory();
    memcpy(copy, body, (size_t)len);
    pthread_mutex_lock(&a->mu);
    char *old = a->body;
    a->body = copy, a->body_len = (size_t)len, a->status = status, a->body_at_ms = now_ms();
    pthread_mutex_unlock(&a->mu);
    free(old);
    uint64_t one = 1;
    (void)!write(a->fresh_fd, &one, sizeof one); /* waiting probes: here it is */
    Py_RETURN_NONE;
}

/* stats(handle) -> (accepted, health probes answered, handed over to the loop) */
static PyObject *stats(PyObject *self, PyObject *capsule) {
    acceptor_t *a = get(capsule);
    if (a == NULL) return NULL;
    pthread_mutex_lock(&a->mu);
    uint64_t acc = a->accepted, ans = a->answered, over = a->handed_over;
    pthread_mutex_unlock(&a->mu);
    return Py_BuildValue("(KKK)", (unsigned long long)acc, (unsigned long long)ans,
                         (unsigned long long)over);
}

/* stop(handle): stop accepting and join the thread (idempotent). */
static PyObject *stop(PyObject *self, PyObject *capsule) {
    acceptor_t *a = get(capsule);
    if (a == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    join_thread(a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"start", start, METH_VARARGS,
     "start(listen_fd, handoff_fd, want_fd, peek_ms, wait_ms, stale_ms) -> handle"},
    {"set_health", set_health, METH_VARARGS, "set_health(handle, status, body)"},
    {"stats", stats, METH_O, "stats(handle) -> (accepted, answered, handed_over)"},
    {"stop", stop, METH_O, "stop(handle): stop accepting, join the thread"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "frontend.http._acceptor", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__acceptor(void) { return PyModule_Create(&module); }
