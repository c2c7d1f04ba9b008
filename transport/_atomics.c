/* Real memory barriers for the shared-memory rings (see transport/ring.py).
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

static PyMethodDef methods[] = {
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
