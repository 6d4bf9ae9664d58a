/* Compiled loops for the compressed path of one group (see docs/design/compression.md,
 * "Fast top-k"). numpy needs one pass per operation and a temporary per step; these do each step
 * of the path in one pass, without the GIL.
 *
 * Memory safety is checked here: every buffer's length is checked against the element counts
 * the loops use, and every index before anything is written. What the values mean (dtypes,
 * shapes, the tie rule) is checked by the Python wrappers in kernels.py and topk.py, the only
 * callers. Built with -ffp-contract=off: the element arithmetic rounds exactly as numpy's
 * (no fused multiply-add), so both paths give bit-identical residuals and results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_native_common.h"
#include "_native_avx512.h"

#define SUFFIX f32
#define F float
#define U uint32_t
#define V f32v
#define SIGN_OFF 0x7FFFFFFFu
#define INF_BITS 0x7F800000u
#define BITS 32
#include "_native_typed.h"
#undef SUFFIX
#undef F
#undef U
#undef V
#undef SIGN_OFF
#undef INF_BITS
#undef BITS

#define SUFFIX f64
#define F double
#define U uint64_t
#define V f64v
#define SIGN_OFF 0x7FFFFFFFFFFFFFFFull
#define INF_BITS 0x7FF0000000000000ull
#define BITS 64
#include "_native_typed.h"

/* Indices strictly ascending and in [0, n) (else BAD_ORDER: a ValueError, as numpy's check
 * raises), checked before a kernel writes anything. */
static status_t check_ascending(const int32_t *index, Py_ssize_t m, Py_ssize_t n) {
    int64_t previous = -1;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t at = index[i];
        if (at <= previous) return BAD_ORDER;
        previous = at;
    }
    return previous >= n ? BAD_ORDER : OK;
}

/* ---- Python entry points ------------------------------------------------------------- */

typedef struct {
    Py_buffer views[8];
    int held;
} buffers_t;

static void release(buffers_t *b) {
    for (int i = 0; i < b->held; i++) PyBuffer_Release(&b->views[i]);
    b->held = 0;
}

/* A C-contiguous buffer of ``object`` (writable if asked) with exactly ``count`` items of
 * ``itemsize`` bytes (count < 0: any multiple, returned through *found). */
static char *hold(buffers_t *b, PyObject *object, int writable, Py_ssize_t itemsize,
                  Py_ssize_t count, Py_ssize_t *found, const char *name) {
    Py_buffer *view = &b->views[b->held];
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) return NULL;
    b->held++;
    if (view->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, not a whole number of %zd-byte items",
                     name, view->len, itemsize);
        return NULL;
    }
    if (count >= 0 && view->len / itemsize != count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd items of %zd bytes, expected %zd", name,
                     view->len / itemsize, itemsize, count);
        return NULL;
    }
    if (found) *found = view->len / itemsize;
    return (char *)view->buf;
}

static PyObject *index_error(status_t status, Py_ssize_t n) {
    if (status == BAD_ORDER)
        return PyErr_Format(PyExc_ValueError,
                            "indices must be strictly ascending and in [0, %zd)", n);
    return PyErr_Format(PyExc_IndexError, "indices must be in [0, %zd)", n);
}

/* add_energy(residual, update, velocity, momentum, clear, wide, sums, threshold, k, limit,
 * index, bits) -> candidates found (-1: past limit), or None without ``index`` (no scan) */
static PyObject *py_add_energy(PyObject *self, PyObject *args) {
    PyObject *residual_o, *update_o, *velocity_o, *sums_o, *index_o, *bits_o;
    double momentum;
    int clear, wide;
    unsigned long long threshold;
    Py_ssize_t k, limit;
    if (!PyArg_ParseTuple(args, "OOOdppOKnnOO", &residual_o, &update_o, &velocity_o,
                          &momentum, &clear, &wide, &sums_o, &threshold, &k, &limit, &index_o,
                          &bits_o))
        return NULL;
    int scan = index_o != Py_None;
    if (scan && (k < 1 || limit < k))
        return PyErr_Format(PyExc_ValueError, "need 1 <= k <= limit, got %zd, %zd", k, limit);
    buffers_t b = {.held = 0};
    Py_ssize_t size = wide ? 8 : 4, n = 0, room = 0;
    char *residual = hold(&b, residual_o, 1, size, -1, &n, "residual");
    char *update = residual ? hold(&b, update_o, 1, size, n, NULL, "update") : NULL;
    char *velocity = NULL;
    if (update && velocity_o != Py_None)
        velocity = hold(&b, velocity_o, 1, size, n, NULL, "velocity");
    char *sums = (update && (velocity || velocity_o == Py_None))
        ? hold(&b, sums_o, 1, 8, (n + CHUNK - 1) / CHUNK, NULL, "sums") : NULL;
    char *index = sums && scan ? hold(&b, index_o, 1, 4, -1, &room, "index") : NULL;
    char *bits = index ? hold(&b, bits_o, 1, size, room, NULL, "bits") : NULL;
    if (bits && (room < limit + SLACK || n > INT32_MAX || k > n)) {
        PyErr_Format(PyExc_ValueError, "add_energy: candidate buffers of %zd for limit %zd, "
                     "k %zd of %zd", room, limit, k, n);
        bits = NULL;
    }
    if (!sums || (scan && !bits)) { release(&b); return NULL; }
    found_t_f32 f32 = {(uint32_t)threshold, k, limit, 0, 0, (int32_t *)index, (uint32_t *)bits};
    found_t_f64 f64 = {(uint64_t)threshold, k, limit, 0, 0, (int32_t *)index, (uint64_t *)bits};
    Py_BEGIN_ALLOW_THREADS
    if (wide)
        add_energy_f64((double *)residual, (double *)update, (double *)velocity, momentum,
                       clear, n, (double *)sums, scan ? &f64 : NULL);
    else
        add_energy_f32((float *)residual, (float *)update, (float *)velocity,
                       (float)momentum, clear, n, (double *)sums, scan ? &f32 : NULL);
    Py_END_ALLOW_THREADS
    release(&b);
    if (!scan) Py_RETURN_NONE;
    return PyLong_FromSsize_t(wide ? f64.count : f32.count);
}

/* The k largest of ``found`` candidates into out; -1 without memory for the histogram. */
static Py_ssize_t pick_any(int wide, char *index, char *bits, Py_ssize_t found, Py_ssize_t k,
                           char *work, char *out) {
    uint32_t *hist = malloc(DIGITS * sizeof *hist);
    if (!hist) return -1;
    Py_ssize_t written = wide
        ? pick_f64((int32_t *)index, (uint64_t *)bits, found, k, (uint64_t *)work, hist,
                   (int32_t *)out)
        : pick_f32((int32_t *)index, (uint32_t *)bits, found, k, (uint32_t *)work, hist,
                   (int32_t *)out);
    free(hist);
    return written;
}

static PyObject *picked(Py_ssize_t written, Py_ssize_t k, Py_ssize_t found) {
    if (written < 0) return PyErr_NoMemory();
    if (written != k)  /* cannot happen: the radix select counts exactly */
        return PyErr_Format(PyExc_RuntimeError, "pick wrote %zd of %zd", written, k);
    return PyLong_FromSsize_t(found);
}

/* The candidate buffers (index, bits, work) and out, checked against limit and k. */
static int hold_candidates(buffers_t *b, PyObject *const objects[4], Py_ssize_t size,
                           Py_ssize_t limit, Py_ssize_t k, char *held[4]) {
    Py_ssize_t room = 0, spare = 0;
    held[0] = hold(b, objects[0], 1, 4, -1, &room, "index");
    held[1] = held[0] ? hold(b, objects[1], 1, size, room, NULL, "bits") : NULL;
    held[2] = held[1] ? hold(b, objects[2], 1, size, -1, &spare, "work") : NULL;
    held[3] = held[2] ? hold(b, objects[3], 1, 4, k, NULL, "out") : NULL;
    if (held[3] && (room < limit + SLACK || spare < limit)) {
        PyErr_Format(PyExc_ValueError, "candidate buffers of %zd and %zd for limit %zd", room,
                     spare, limit);
        return 0;
    }
    return held[3] != NULL;
}

/* select(error, wide, threshold, k, limit, index, bits, work, out) -> candidates found
 * (-1: more than limit; fewer than k: ``out`` untouched) */
static PyObject *py_select(PyObject *self, PyObject *args) {
    PyObject *error_o, *objects[4];
    int wide;
    unsigned long long threshold;
    Py_ssize_t k, limit;
    if (!PyArg_ParseTuple(args, "OpKnnOOOO", &error_o, &wide, &threshold, &k, &limit,
                          &objects[0], &objects[1], &objects[2], &objects[3]))
        return NULL;
    if (k < 1 || limit < k)
        return PyErr_Format(PyExc_ValueError, "need 1 <= k <= limit, got %zd, %zd", k, limit);
    buffers_t b = {.held = 0};
    Py_ssize_t size = wide ? 8 : 4, n = 0;
    char *held[4] = {NULL, NULL, NULL, NULL};
    char *error = hold(&b, error_o, 0, size, -1, &n, "error");
    int ok = error && hold_candidates(&b, objects, size, limit, k, held);
    if (ok && (n > INT32_MAX || k > n)) {
        PyErr_Format(PyExc_ValueError, "select: k %zd of %zd elements", k, n);
        ok = 0;
    }
    if (!ok) { release(&b); return NULL; }
    found_t_f32 f32 = {(uint32_t)threshold, k, limit, 0, 0, (int32_t *)held[0],
                       (uint32_t *)held[1]};
    found_t_f64 f64 = {(uint64_t)threshold, k, limit, 0, 0, (int32_t *)held[0],
                       (uint64_t *)held[1]};
    Py_ssize_t found, written = k;
    Py_BEGIN_ALLOW_THREADS
    if (wide) scan_f64((const double *)error, 0, n, &f64);
    else scan_f32((const float *)error, 0, n, &f32);
    found = wide ? f64.count : f32.count;
    if (found >= k) written = pick_any(wide, held[0], held[1], found, k, held[2], held[3]);
    Py_END_ALLOW_THREADS
    release(&b);
    return picked(written, k, found);
}

/* pick(index, bits, found, k, work, out, wide): the k largest of the first ``found``
 * candidates of a fused add_energy pass */
static PyObject *py_pick(PyObject *self, PyObject *args) {
    PyObject *objects[4];
    Py_ssize_t found, k;
    int wide;
    if (!PyArg_ParseTuple(args, "OOnnOOp", &objects[0], &objects[1], &found, &k, &objects[2],
                          &objects[3], &wide))
        return NULL;
    if (k < 1 || found < k)
        return PyErr_Format(PyExc_ValueError, "need 1 <= k <= found, got %zd, %zd", k, found);
    buffers_t b = {.held = 0};
    char *held[4] = {NULL, NULL, NULL, NULL};
    if (!hold_candidates(&b, objects, wide ? 8 : 4, found, k, held)) {
        release(&b);
        return NULL;
    }
    Py_ssize_t written;
    Py_BEGIN_ALLOW_THREADS
    written = pick_any(wide, held[0], held[1], found, k, held[2], held[3]);
    Py_END_ALLOW_THREADS
    release(&b);
    return picked(written, k, found);
}

/* A writable float buffer of n items (``dense``), m int32 indices and m floats beside them
 * (writable if asked); 0 with the error set. */
static int hold_pairs(buffers_t *b, PyObject *dense_o, PyObject *index_o, PyObject *values_o,
                      int values_writable, Py_ssize_t size, const char *names[2],
                      char *held[3], Py_ssize_t *n, Py_ssize_t *m) {
    held[0] = hold(b, dense_o, 1, size, -1, n, names[0]);
    held[1] = held[0] ? hold(b, index_o, 0, 4, -1, m, "indices") : NULL;
    held[2] = held[1] ? hold(b, values_o, values_writable, size, *m, NULL, names[1]) : NULL;
    if (held[2]) return 1;
    release(b);
    return 0;
}

/* take_clear(error, index, out, wide) -> sum of the taken values' squares */
static PyObject *py_take_clear(PyObject *self, PyObject *args) {
    PyObject *error_o, *index_o, *out_o;
    int wide;
    if (!PyArg_ParseTuple(args, "OOOp", &error_o, &index_o, &out_o, &wide)) return NULL;
    buffers_t b = {.held = 0};
    Py_ssize_t n = 0, m = 0;
    char *held[3];
    const char *names[2] = {"error", "out"};
    if (!hold_pairs(&b, error_o, index_o, out_o, 1, wide ? 8 : 4, names, held, &n, &m))
        return NULL;
    char *error = held[0], *index = held[1], *out = held[2];
    status_t status;
    double energy = 0;
    Py_BEGIN_ALLOW_THREADS
    status = check_ascending((const int32_t *)index, m, n);
    if (status == OK)
        energy = wide ? take_clear_f64((double *)error, (const int32_t *)index, m, (double *)out)
                      : take_clear_f32((float *)error, (const int32_t *)index, m, (float *)out);
    Py_END_ALLOW_THREADS
    release(&b);
    return status == OK ? PyFloat_FromDouble(energy) : index_error(status, n);
}

/* scatter(target, index, values, wide, mode): mode 0 puts (indices strictly ascending),
 * 1 adds pair by pair, 2 zeroes the target first and adds. */
static PyObject *py_scatter(PyObject *self, PyObject *args) {
    PyObject *target_o, *index_o, *values_o;
    int wide, mode;
    if (!PyArg_ParseTuple(args, "OOOpi", &target_o, &index_o, &values_o, &wide, &mode))
        return NULL;
    if (mode < 0 || mode > 2) return PyErr_Format(PyExc_ValueError, "mode %d", mode);
    buffers_t b = {.held = 0};
    Py_ssize_t n = 0, m = 0;
    char *held[3];
    const char *names[2] = {"target", "values"};
    if (!hold_pairs(&b, target_o, index_o, values_o, 0, wide ? 8 : 4, names, held, &n, &m))
        return NULL;
    char *target = held[0], *index = held[1], *values = held[2];
    status_t status;
    Py_BEGIN_ALLOW_THREADS
    if (mode == 0) {
        status = check_ascending((const int32_t *)index, m, n);
        if (status == OK && wide)
            put_f64((double *)target, (const int32_t *)index, m, (const double *)values);
        else if (status == OK)
            put_f32((float *)target, (const int32_t *)index, m, (const float *)values);
    } else if (wide) {
        status = accumulate_f64((double *)target, n, (const int32_t *)index, m,
                                (const double *)values, mode == 2);
    } else {
        status = accumulate_f32((float *)target, n, (const int32_t *)index, m,
                                (const float *)values, mode == 2);
    }
    Py_END_ALLOW_THREADS
    release(&b);
    if (status != OK) return index_error(status, n);
    Py_RETURN_NONE;
}

/* momentum(total, residual, velocity, momentum, keep, release, release_all, wide) */
static PyObject *py_momentum(PyObject *self, PyObject *args) {
    PyObject *total_o, *residual_o, *velocity_o;
    double momentum, keep, released;
    int release_all, wide;
    if (!PyArg_ParseTuple(args, "OOOdddpp", &total_o, &residual_o, &velocity_o, &momentum,
                          &keep, &released, &release_all, &wide))
        return NULL;
    buffers_t b = {.held = 0};
    Py_ssize_t size = wide ? 8 : 4, n = 0;
    char *total = hold(&b, total_o, 1, size, -1, &n, "total");
    char *velocity = total ? hold(&b, velocity_o, 1, size, n, NULL, "velocity") : NULL;
    char *residual = NULL;
    if (velocity && residual_o != Py_None)
        residual = hold(&b, residual_o, 1, size, n, NULL, "residual");
    if (!velocity || (residual_o != Py_None && !residual)) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (wide)
        momentum_f64((double *)total, (double *)residual, (double *)velocity, momentum, keep,
                     released, release_all, n);
    else
        momentum_f32((float *)total, (float *)residual, (float *)velocity, (float)momentum,
                     (float)keep, (float)released, release_all, n);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

#include "_native_wire.h"

/* use_avx512(flag) -> whether it is used now: tests run the plain loops on an AVX-512 CPU */
static PyObject *py_use_avx512(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
    avx512_known = -1;
    if (!flag || !native_avx512()) avx512_known = 0;
    return PyBool_FromLong(native_avx512());
}

static PyMethodDef methods[] = {
    {"use_avx512", py_use_avx512, METH_VARARGS,
     "use_avx512(flag) -> bool: the AVX-512 loops where the CPU has them (flag), or never"},
    {"add_energy", py_add_energy, METH_VARARGS,
     "add_energy(residual, update, velocity, momentum, clear, wide, sums, threshold, k, limit, "
     "index, bits) -> candidates found, or None without index"},
    {"select", py_select, METH_VARARGS,
     "select(error, wide, threshold, k, limit, index, bits, work, out) -> candidates"},
    {"momentum", py_momentum, METH_VARARGS,
     "momentum(total, residual, velocity, momentum, keep, release, release_all, wide)"},
    {"pick", py_pick, METH_VARARGS, "pick(index, bits, found, k, work, out, wide) -> found"},
    {"take_clear", py_take_clear, METH_VARARGS, "take_clear(error, index, out, wide) -> float"},
    {"scatter", py_scatter, METH_VARARGS, "scatter(target, index, values, wide, mode)"},
    {"pack_take", py_pack_take, METH_VARARGS,
     "pack_take(error, index, out) -> float: the compact allgather buffer (wire.py)"},
    {"unpack_add", py_unpack_add, METH_VARARGS,
     "unpack_add(target, gathered, nodes, k, zeroed) -> (code, node, value)"},
    {"unpack", py_unpack, METH_VARARGS,
     "unpack(gathered, nodes, n, k, index, values) -> (code, node, value)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "Compiled loops of the compressed path.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "CHUNK", CHUNK) < 0 ||
              PyModule_AddIntConstant(m, "SLACK", SLACK) < 0 ||
              PyModule_AddIntConstant(m, "AVX512", native_avx512()) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
