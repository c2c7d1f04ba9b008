/* Real memory barriers for the shared-memory rings (see transport/ring.py), and the
 * CPU block copier of the KV handoff (transport/kv_backends.py).
 *
 * CPython gives no atomic or ordered access to shared memory: a store through an mmap
 * slice is a plain memcpy, and on aarch64 plain stores may become visible to another core
 * in any order. These four functions are the only ordered accesses the rings make; every
 * other byte (the record payloads) is plain memory whose visibility is published by them.
 * All addresses must be 8-byte aligned and stay mapped for the duration of the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t *as_ptr(PyObject *addr) {
    return (uint64_t *)PyLong_AsVoidPtr(addr);
}

/* load_acquire(addr) -> int: no later load or store moves before it. */
static PyObject *load_acquire(PyObject *self, PyObject *addr) {
    uint64_t *p = as_ptr(addr);
    if (p == NULL && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(p, __ATOMIC_ACQUIRE));
}

/* store_release(addr, value): no earlier load or store moves after it. */
static PyObject *store_release(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "store_release(addr, value)");
        return NULL;
    }
    uint64_t *p = as_ptr(args[0]);
    if (p == NULL && PyErr_Occurred()) return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(args[1]);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    __atomic_store_n(p, (uint64_t)v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* exchange(addr, value) -> old: sequentially consistent read-modify-write. */
static PyObject *exchange(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "exchange(addr, value)");
        return NULL;
    }
    uint64_t *p = as_ptr(args[0]);
    if (p == NULL && PyErr_Occurred()) return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(args[1]);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_exchange_n(p, (uint64_t)v, __ATOMIC_SEQ_CST));
}

/* fence(): full (store-load) barrier, needed by the sleep/wake handshake. */
static PyObject *fence(PyObject *self, PyObject *unused) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

#if defined(__x86_64__)
#include <immintrin.h>
/* Large runs (a KV block of a real model is ~0.5-2 MiB) are copied the way glibc copies
 * one huge memcpy: non-temporal stores (the block is written once and read much later, so
 * read-for-ownership of the destination only halves bandwidth), four pages interleaved.
 * glibc only takes that path for a single call above a few MiB, which separate random
 * blocks never are. Below STREAM_MIN, or without AVX2, plain memcpy. */
#define PAGE 4096
#define STREAM_MIN (256 * 1024)

__attribute__((target("avx2"))) static void copy_4_pages(char *d, const char *s) {
    for (size_t i = 0; i < PAGE; i += 64) {
        for (int p = 0; p < 4; p++) {
            const char *sp = s + p * PAGE + i;
            char *dp = d + p * PAGE + i;
            __m256i a = _mm256_loadu_si256((const __m256i *)sp);
            __m256i b = _mm256_loadu_si256((const __m256i *)(sp + 32));
            _mm256_stream_si256((__m256i *)dp, a); /* dp is 64-byte aligned */
            _mm256_stream_si256((__m256i *)(dp + 32), b);
        }
    }
}

__attribute__((target("avx2"))) static void stream_copy(char *dst, const char *src, size_t n) {
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t body = n - n % (4 * PAGE);
    for (size_t k = 0; k < body; k += 4 * PAGE) copy_4_pages(dst + k, src + k);
    _mm_sfence(); /* streaming stores are weakly ordered: complete them before returning */
    memcpy(dst + body, src + body, n - body);
}

static void copy_bytes(char *dst, const char *src, size_t n) {
    if (n >= STREAM_MIN && __builtin_cpu_supports("avx2"))
        stream_copy(dst, src, n);
    else
        memcpy(dst, src, n);
}
#else
static void copy_bytes(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
#endif

/* copy_runs(dst_addr, src_addr, block_nbytes, runs): for each (src, dst, n) int64 triple
 * in the buffer ``runs``, memcpy n blocks. Block ids are range-checked by the caller
 * (transport/kv.py); one call per request keeps per-run Python overhead off small blocks.
 */
static PyObject *copy_runs(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_runs(dst_addr, src_addr, block_nbytes, runs)");
        return NULL;
    }
    char *dst = (char *)PyLong_AsVoidPtr(args[0]);
    char *src = (char *)PyLong_AsVoidPtr(args[1]);
    Py_ssize_t block = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[3], &view, PyBUF_SIMPLE) < 0) return NULL;
    const int64_t *r = (const int64_t *)view.buf;
    Py_ssize_t count = view.len / (Py_ssize_t)(3 * sizeof(int64_t));
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        copy_bytes(dst + r[3 * i + 1] * block, src + r[3 * i] * block, (size_t)(r[3 * i + 2] * block));
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* ---- ring fast path: the protocol of transport/ring.py (see its docstring for the layout
 * and the ordering argument), done in one call per record or per drain instead of a dozen
 * interpreter operations. Offsets mirror ring.py's constants. */
#define OFF_TAIL 128
#define OFF_HEAD 256
#define OFF_SLEEPING 384
#define OFF_WAITING 512
#define OFF_DATA 4096
#define U64(base, off) ((uint64_t *)((base) + (off)))

static inline uint64_t footprint(uint64_t n) { return 8 + ((n + 7) & ~(uint64_t)7); }

/* ring_put(base, capacity, record) -> 0 full (nothing written), 1 written,
 * 2 written and the consumer was asleep (caller rings its doorbell). */
static PyObject *ring_put(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 3) {
        PyErr_SetString(PyExc_TypeError, "ring_put(base, capacity, record)");
        return NULL;
    }
    char *base = (char *)PyLong_AsVoidPtr(args[0]);
    uint64_t cap = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer rec;
    if (PyObject_GetBuffer(args[2], &rec, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t len = (uint64_t)rec.len, need = footprint(len), mask = cap - 1;
    uint64_t tail = __atomic_load_n(U64(base, OFF_TAIL), __ATOMIC_RELAXED); /* ours */
    uint64_t head = __atomic_load_n(U64(base, OFF_HEAD), __ATOMIC_ACQUIRE);
    if (need > cap || tail + need - head > cap) {
        PyBuffer_Release(&rec);
        return PyLong_FromLong(0);
    }
    char *data = base + OFF_DATA;
    uint64_t pos = tail & mask, start = (pos + 8) & mask;
    uint32_t hdr[2] = {(uint32_t)len, 0};
    memcpy(data + pos, hdr, 8);
    uint64_t first = len < cap - start ? len : cap - start;
    memcpy(data + start, rec.buf, first);
    memcpy(data, (char *)rec.buf + first, len - first);
    PyBuffer_Release(&rec);
    __atomic_store_n(U64(base, OFF_TAIL), tail + need, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* publish before reading the sleep flag */
    int woke = __atomic_load_n(U64(base, OFF_SLEEPING), __ATOMIC_RELAXED) &&
               __atomic_exchange_n(U64(base, OFF_SLEEPING), 0, __ATOMIC_SEQ_CST);
    return PyLong_FromLong(woke ? 2 : 1);
}

/* ring_drain(base, capacity, max_records) -> (list[bytes], producer_was_waiting). */
static PyObject *ring_drain(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 3) {
        PyErr_SetString(PyExc_TypeError, "ring_drain(base, capacity, max_records)");
        return NULL;
    }
    char *base = (char *)PyLong_AsVoidPtr(args[0]);
    uint64_t cap = PyLong_AsUnsignedLongLong(args[1]);
    Py_ssize_t max = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    char *data = base + OFF_DATA;
    uint64_t mask = cap - 1;
    uint64_t head = __atomic_load_n(U64(base, OFF_HEAD), __ATOMIC_RELAXED); /* ours */
    uint64_t tail = __atomic_load_n(U64(base, OFF_TAIL), __ATOMIC_ACQUIRE);
    Py_ssize_t got = 0;
    while (got < max && head != tail) {
        uint64_t pos = head & mask, start = (pos + 8) & mask;
        uint32_t len;
        memcpy(&len, data + pos, 4);
        uint64_t first = len < cap - start ? len : cap - start;
        PyObject *rec = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
        if (rec == NULL) break;
        memcpy(PyBytes_AS_STRING(rec), data + start, first); /* copy out before release */
        memcpy(PyBytes_AS_STRING(rec) + first, data, len - first);
        int err = PyList_Append(out, rec);
        Py_DECREF(rec);
        if (err < 0) break;
        head += footprint(len);
        got++;
        if (head == tail) tail = __atomic_load_n(U64(base, OFF_TAIL), __ATOMIC_ACQUIRE);
    }
    if (PyErr_Occurred()) { /* release nothing: the records stay queued */
        Py_DECREF(out);
        return NULL;
    }
    int waiting = 0;
    if (got) {
        __atomic_store_n(U64(base, OFF_HEAD), head, __ATOMIC_RELEASE);
        __atomic_thread_fence(__ATOMIC_SEQ_CST); /* release space before reading the flag */
        waiting = __atomic_load_n(U64(base, OFF_WAITING), __ATOMIC_RELAXED) &&
                  __atomic_exchange_n(U64(base, OFF_WAITING), 0, __ATOMIC_SEQ_CST);
    }
    return Py_BuildValue("(NO)", out, waiting ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"ring_put", (PyCFunction)(void (*)(void))ring_put, METH_FASTCALL,
     "publish one record; 0 full, 1 written, 2 written + consumer asleep"},
    {"ring_drain", (PyCFunction)(void (*)(void))ring_drain, METH_FASTCALL,
     "copy out and release up to max records; (records, producer_was_waiting)"},
    {"copy_runs", (PyCFunction)(void (*)(void))copy_runs, METH_FASTCALL,
     "memcpy block runs between two block-major pools"},
    {"load_acquire", (PyCFunction)load_acquire, METH_O, "acquire-load a u64"},
    {"store_release", (PyCFunction)(void (*)(void))store_release, METH_FASTCALL,
     "release-store a u64"},
    {"exchange", (PyCFunction)(void (*)(void))exchange, METH_FASTCALL,
     "seq-cst exchange of a u64"},
    {"fence", (PyCFunction)fence, METH_NOARGS, "seq-cst thread fence"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "transport._atomics", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__atomics(void) { return PyModule_Create(&module); }
