/* The allgather's compact wire format for float32 groups (wire.py): per node, int32 counts
 * per block of 2^16 elements, then a uint16 offset per index, then a bfloat16 value per index.
 * Included by _native.c after its buffer helpers. */
#ifndef COMMD_NATIVE_WIRE_H
#define COMMD_NATIVE_WIRE_H

#include <math.h>

#define WIRE_BLOCK_BITS 16

/* float32 -> bfloat16, to nearest with ties to even; every NaN -> 0x7FC0 (as wire.py). */
static inline uint16_t to_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static Py_ssize_t wire_blocks(Py_ssize_t n) {
    return n > 0 ? (n + (1 << WIRE_BLOCK_BITS) - 1) >> WIRE_BLOCK_BITS : 1;
}

/* The m selected values of error go out as bfloat16; error keeps what rounding left (0 where
 * the sent value is not finite). Indices checked ascending and in range by the caller.
 * Returns the taken values' sum of squares (as take_clear). */
static double pack_take(float *restrict error, const int32_t *restrict index, Py_ssize_t m,
                        char *restrict out, Py_ssize_t blocks) {
    int32_t *counts = (int32_t *)out;
    uint16_t *lows = (uint16_t *)(out + 4 * blocks);
    uint16_t *bits = lows + m;
    memset(counts, 0, (size_t)blocks * sizeof *counts);
    double energy = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t at = index[i];
        float v = error[at];
        uint16_t h = to_bf16(v);
        float sent = from_bf16(h);
        bits[i] = h;
        lows[i] = (uint16_t)at;
        counts[at >> WIRE_BLOCK_BITS]++;
        error[at] = isfinite(sent) ? v - sent : 0;
        energy += (double)v * v;
    }
    return energy;
}

typedef struct {
    int code;  /* 0 ok, 1 counts negative or not adding up to k, 2 an index past n */
    Py_ssize_t node;
    int64_t value;  /* the counts' sum, or the index */
} wire_status_t;

/* Checks every node's buffer: counts non-negative and adding up to k, the last block's
 * offsets inside the group (the only ones that can pass n). */
static wire_status_t check_packed(const char *gathered, Py_ssize_t nodes, Py_ssize_t per,
                                  Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t blocks = wire_blocks(n);
    int64_t room = n - ((int64_t)(blocks - 1) << WIRE_BLOCK_BITS);  /* elements in the last */
    for (Py_ssize_t node = 0; node < nodes; node++) {
        const char *base = gathered + node * per;
        const uint16_t *lows = (const uint16_t *)(base + 4 * blocks);
        int64_t sum = 0;
        int negative = 0;
        int32_t c = 0;
        for (Py_ssize_t b = 0; b < blocks; b++) {
            memcpy(&c, base + 4 * b, sizeof c);
            negative |= c < 0;
            sum += c;
        }
        if (negative || sum != k) return (wire_status_t){1, node, sum};
        for (Py_ssize_t i = k - c; i < k; i++)  /* c: the last block's count */
            if (lows[i] >= room)
                return (wire_status_t){2, node, ((int64_t)(blocks - 1) << WIRE_BLOCK_BITS)
                                                    + lows[i]};
    }
    return (wire_status_t){0, 0, 0};
}

/* Every node's pairs out of the gathered buffers (per bytes each), node after node; the
 * buffers are checked first. */
static wire_status_t unpack_pairs(const char *gathered, Py_ssize_t nodes, Py_ssize_t per,
                                  Py_ssize_t n, Py_ssize_t k, int32_t *restrict index,
                                  float *restrict values) {
    wire_status_t status = check_packed(gathered, nodes, per, n, k);
    if (status.code) return status;
    Py_ssize_t blocks = wire_blocks(n);
    for (Py_ssize_t node = 0; node < nodes; node++) {
        const char *base = gathered + node * per;
        const uint16_t *lows = (const uint16_t *)(base + 4 * blocks);
        const uint16_t *bits = lows + k;
        int32_t *mine = index + node * k;
        float *got = values + node * k;
        Py_ssize_t i = 0;
        for (Py_ssize_t b = 0; b < blocks; b++) {
            int32_t c;
            memcpy(&c, base + 4 * b, sizeof c);
            int32_t start = (int32_t)(b << WIRE_BLOCK_BITS);
            for (Py_ssize_t end = i + c; i < end; i++) {
                mine[i] = start | lows[i];
                got[i] = from_bf16(bits[i]);
            }
        }
    }
    return status;
}

/* target (zeroed first unless zeroed) += every node's pairs, decoded on the fly: chunk by
 * chunk, node after node, so each element is summed in node order, as accumulate sums the
 * decoded pairs, while the chunk is in cache. The buffers are checked first. */
static wire_status_t unpack_add(float *restrict target, const char *gathered,
                                Py_ssize_t nodes, Py_ssize_t per, Py_ssize_t n, Py_ssize_t k,
                                int zeroed) {
    wire_status_t status = check_packed(gathered, nodes, per, n, k);
    if (status.code) return status;
    if (!zeroed) memset(target, 0, (size_t)n * sizeof *target);
    Py_ssize_t blocks = wire_blocks(n);
    enum { PER_CHUNK = CHUNK >> WIRE_BLOCK_BITS };  /* blocks per chunk */
    Py_ssize_t *next = PyMem_RawCalloc((size_t)nodes, sizeof *next);  /* pairs read */
    if (!next) return (wire_status_t){3, 0, 0};
    for (Py_ssize_t first = 0; first < blocks; first += PER_CHUNK) {
        Py_ssize_t last = first + PER_CHUNK < blocks ? first + PER_CHUNK : blocks;
        for (Py_ssize_t node = 0; node < nodes; node++) {
            const char *base = gathered + node * per;
            const uint16_t *lows = (const uint16_t *)(base + 4 * blocks);
            const uint16_t *bits = lows + k;
            Py_ssize_t i = next[node];
            for (Py_ssize_t b = first; b < last; b++) {
                int32_t c;
                memcpy(&c, base + 4 * b, sizeof c);
                float *block = target + (b << WIRE_BLOCK_BITS);
                for (Py_ssize_t end = i + c; i < end; i++) block[lows[i]] += from_bf16(bits[i]);
            }
            next[node] = i;
        }
    }
    PyMem_RawFree(next);
    return status;
}

/* pack_take(error, index, out) -> sum of squares of the taken values */
static PyObject *py_pack_take(PyObject *self, PyObject *args) {
    PyObject *error_o, *index_o, *out_o;
    if (!PyArg_ParseTuple(args, "OOO", &error_o, &index_o, &out_o)) return NULL;
    buffers_t b = {.held = 0};
    Py_ssize_t n = 0, m = 0;
    char *error = hold(&b, error_o, 1, 4, -1, &n, "error");
    char *index = error ? hold(&b, index_o, 0, 4, -1, &m, "indices") : NULL;
    char *out = index ? hold(&b, out_o, 1, 1, 4 * wire_blocks(n) + 4 * m, NULL, "out") : NULL;
    if (!out) {
        release(&b);
        return NULL;
    }
    status_t status;
    double energy = 0;
    Py_BEGIN_ALLOW_THREADS
    status = check_ascending((const int32_t *)index, m, n);
    if (status == OK)
        energy = pack_take((float *)error, (const int32_t *)index, m, out, wire_blocks(n));
    Py_END_ALLOW_THREADS
    release(&b);
    return status == OK ? PyFloat_FromDouble(energy) : index_error(status, n);
}

/* The gathered buffer of ``nodes`` compact buffers for a group of n with k selected (after
 * checking those numbers); NULL with the error set. *per: one node's bytes. */
static char *hold_gathered(buffers_t *b, PyObject *gathered_o, Py_ssize_t nodes, Py_ssize_t n,
                           Py_ssize_t k, const char *who, Py_ssize_t *per) {
    if (nodes < 1 || n < 0 || k < 0 || k > n || n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: nodes %zd, n %zd, k %zd", who, nodes, n, k);
        return NULL;
    }
    *per = 4 * wire_blocks(n) + 4 * k;
    return hold(b, gathered_o, 0, 1, nodes * *per, NULL, "gathered");
}

static PyObject *wire_result(wire_status_t status) {
    if (status.code == 3) return PyErr_NoMemory();
    return Py_BuildValue("(inL)", status.code, status.node, (long long)status.value);
}

/* unpack(gathered, nodes, n, k, index, values) -> (code, node, value); code 0: all read */
static PyObject *py_unpack(PyObject *self, PyObject *args) {
    PyObject *gathered_o, *index_o, *values_o;
    Py_ssize_t nodes, n, k, per = 0;
    if (!PyArg_ParseTuple(args, "OnnnOO", &gathered_o, &nodes, &n, &k, &index_o, &values_o))
        return NULL;
    buffers_t b = {.held = 0};
    char *gathered = hold_gathered(&b, gathered_o, nodes, n, k, "unpack", &per);
    char *index = gathered ? hold(&b, index_o, 1, 4, nodes * k, NULL, "indices") : NULL;
    char *values = index ? hold(&b, values_o, 1, 4, nodes * k, NULL, "values") : NULL;
    if (!values) {
        release(&b);
        return NULL;
    }
    wire_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = unpack_pairs(gathered, nodes, per, n, k, (int32_t *)index, (float *)values);
    Py_END_ALLOW_THREADS
    release(&b);
    return wire_result(status);
}

/* unpack_add(target, gathered, nodes, k, zeroed) -> (code, node, value); code 0: added */
static PyObject *py_unpack_add(PyObject *self, PyObject *args) {
    PyObject *target_o, *gathered_o;
    Py_ssize_t nodes, k, n = 0, per = 0;
    int zeroed;
    if (!PyArg_ParseTuple(args, "OOnnp", &target_o, &gathered_o, &nodes, &k, &zeroed))
        return NULL;
    buffers_t b = {.held = 0};
    char *target = hold(&b, target_o, 1, 4, -1, &n, "target");
    char *gathered = target ? hold_gathered(&b, gathered_o, nodes, n, k, "unpack_add", &per)
                            : NULL;
    if (!gathered) {
        release(&b);
        return NULL;
    }
    wire_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = unpack_add((float *)target, gathered, nodes, per, n, k, zeroed);
    Py_END_ALLOW_THREADS
    release(&b);
    return wire_result(status);
}

#endif
