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
#include <emmintrin.h>
/* Large copies with streaming (non-temporal) stores, as glibc does for one big memcpy:
 * a KV run is written once and read much later, so pulling the destination into cache
 * (read-for-ownership) only halves bandwidth. Small or unaligned runs use memcpy. */
#define STREAM_MIN (256 * 1024)
static void copy_bytes(char *dst, const char *src, size_t n) {
    if (n < STREAM_MIN || ((uintptr_t)dst & 15)) {
        memcpy(dst, src, n);
        return;
    }
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
}
#define COPY_DONE() _mm_sfence() /* streaming stores are weakly ordered: fence them */
#else
static void copy_bytes(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
#define COPY_DONE() ((void)0)
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
    COPY_DONE();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
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
