/* tables._partition: Kafka's Java default partitioner in C.
 *
 * Promise: ``murmur2(data)`` is ``org.apache.kafka.common.utils.Utils.murmur2`` (a signed 32-bit int) and
 * ``partition(data, partitions)`` is ``toPositive(murmur2(data)) % partitions``, bit for bit what
 * ``tables.partition``'s Python reference computes for any bytes-like ``data``. Why C: the fan-out names a
 * partition for every change and the views for every split row; in Python murmur2 took 1.4 us for a 7-byte
 * key and 12.8 us for a 45-byte one, 3.5% of a views worker's CPU (py-spy); in C the fan-out handles 17% more
 * changes per CPU-second (``bench/RESULTS.md``, "The partitioner in C"). No package on PyPI carries Kafka's
 * variant in C.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int32_t kafka_murmur2(const unsigned char *data, Py_ssize_t length) {
    const uint32_t m = 0x5bd1e995u;
    const int r = 24;
    uint32_t h = 0x9747b28cu ^ (uint32_t)length;
    Py_ssize_t end = length - (length & 3);
    for (Py_ssize_t i = 0; i < end; i += 4) {
        uint32_t k = (uint32_t)data[i] | ((uint32_t)data[i + 1] << 8) | ((uint32_t)data[i + 2] << 16) |
                     ((uint32_t)data[i + 3] << 24);
        k *= m;
        k ^= k >> r;
        k *= m;
        h *= m;
        h ^= k;
    }
    switch (length & 3) {
    case 3:
        h ^= (uint32_t)data[end + 2] << 16;
        /* fall through */
    case 2:
        h ^= (uint32_t)data[end + 1] << 8;
        /* fall through */
    case 1:
        h ^= (uint32_t)data[end];
        h *= m;
    }
    h ^= h >> 13;
    h *= m;
    h ^= h >> 15;
    return (int32_t)h;
}

static PyObject *murmur2(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int32_t h = kafka_murmur2(view.buf, view.len);
    PyBuffer_Release(&view);
    return PyLong_FromLong(h);
}

static PyObject *partition(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "partition(data, partitions) takes two arguments");
        return NULL;
    }
    long partitions = PyLong_AsLong(args[1]);
    if (partitions == -1 && PyErr_Occurred())
        return NULL;
    if (partitions < 1)
        return PyErr_Format(PyExc_ValueError, "a topic has at least one partition, got %ld", partitions);
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint32_t h = (uint32_t)kafka_murmur2(view.buf, view.len) & 0x7fffffffu;
    PyBuffer_Release(&view);
    return PyLong_FromLong((long)(h % (uint32_t)partitions));
}

static PyMethodDef methods[] = {
    {"murmur2", (PyCFunction)murmur2, METH_O, "murmur2(data): Kafka's murmur2 of data, a signed 32-bit int"},
    {"partition", (PyCFunction)(void (*)(void))partition, METH_FASTCALL,
     "partition(data, partitions): the partition Kafka's Java default partitioner gives the key data"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tables._partition",
                                    "Kafka's Java default partitioner in C.", -1, methods};

PyMODINIT_FUNC PyInit__partition(void) { return PyModule_Create(&module); }
