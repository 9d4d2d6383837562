/* tables._avro: a flat Avro record read and written in C, exactly as fastavro reads and writes it.
 *
 * Promise: a Reader or a Writer is made from a plan (``tables.flatavro``: one tuple per field of a
 * record whose fields are all primitives, enums, or unions of those; a Reader's also records and
 * arrays, each read by a Reader of its own). ``Reader.read(data,
 * start)`` returns the record as the dict fastavro's ``schemaless_reader`` gives with the writer schema:
 * the same keys in the same order, the same values; logical types are converted by fastavro's own
 * functions, passed in the plan (``conv(value, schema, None)``), so their results cannot differ. Data that
 * ends early or holds a branch, enum index or length out of range raises ``ValueError`` (or
 * ``UnicodeDecodeError``); nothing past the record is looked at. ``Writer.write(record)`` returns the bytes
 * fastavro's ``schemaless_writer`` writes (a union's value in the first branch whose type it has), or None
 * whenever a value is not exactly of its field's Python type (a missing key, a float for a long, a
 * conversion that raised...): fastavro then writes it, with its own leniency and errors. Why C: fastavro's generic reader spent ~1 us a call plus ~0.3 us a field (a
 * 6-column row 5.8 us, a raw change's envelope 5.8 us), the fan-out's and the views' largest cost per
 * change (py-spy, ``bench/RESULTS.md`` "Avro in C").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { K_NULL, K_BOOLEAN, K_INT, K_LONG, K_FLOAT, K_DOUBLE, K_BYTES, K_STRING, K_ENUM, K_RECORD, K_ARRAY };

typedef struct {
    int kind;          /* K_* */
    PyObject *conv;    /* None, or fastavro's logical conversion */
    PyObject *schema;  /* the schema passed to conv */
    PyObject *symbols; /* a tuple for K_ENUM; the Reader of a K_RECORD's fields, of a K_ARRAY's item (one field) */
    PyObject *index;   /* a Writer's K_ENUM: symbol -> its index (a dict), else NULL */
} Branch;

typedef struct {
    PyObject *name;  /* str */
    int is_union;    /* branches are a union's (an index first), else one plain type */
    Py_ssize_t n;    /* branches */
    Branch *branches;
} Field;

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    Field *fields;
} Reader;

typedef struct {
    const unsigned char *p, *end;
} Cursor;

static PyTypeObject ReaderType;
static PyObject *read_record(Cursor *c, const Reader *r);
static PyObject *read_array(Cursor *c, const Reader *r);

static int too_short(void) {
    PyErr_SetString(PyExc_ValueError, "the Avro record ends before its last field");
    return -1;
}

static int read_long(Cursor *c, int64_t *out) {
    uint64_t value = 0;
    int shift = 0;
    for (;;) {
        if (c->p >= c->end)
            return too_short();
        unsigned char b = *c->p++;
        value |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            break;
        shift += 7;
        if (shift > 63) {
            PyErr_SetString(PyExc_ValueError, "an Avro long longer than 10 bytes");
            return -1;
        }
    }
    *out = (int64_t)(value >> 1) ^ -(int64_t)(value & 1);
    return 0;
}

static int read_length(Cursor *c, Py_ssize_t *out) {
    int64_t n;
    if (read_long(c, &n) < 0)
        return -1;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative Avro length");
        return -1;
    }
    if (n > c->end - c->p)
        return too_short();
    *out = (Py_ssize_t)n;
    return 0;
}

static PyObject *read_value(Cursor *c, const Branch *b) {
    int64_t n;
    Py_ssize_t len;
    switch (b->kind) {
    case K_NULL:
        Py_RETURN_NONE;
    case K_BOOLEAN:
        if (c->p >= c->end)
            return too_short(), NULL;
        return PyBool_FromLong(*c->p++ != 0);
    case K_INT:
    case K_LONG:
        return read_long(c, &n) < 0 ? NULL : PyLong_FromLongLong(n);
    case K_FLOAT: {
        float v;
        if (c->end - c->p < 4)
            return too_short(), NULL;
        memcpy(&v, c->p, 4); /* little-endian, as this machine (x86-64, arm64 Linux) */
        c->p += 4;
        return PyFloat_FromDouble(v);
    }
    case K_DOUBLE: {
        double v;
        if (c->end - c->p < 8)
            return too_short(), NULL;
        memcpy(&v, c->p, 8);
        c->p += 8;
        return PyFloat_FromDouble(v);
    }
    case K_BYTES:
    case K_STRING: {
        if (read_length(c, &len) < 0)
            return NULL;
        const char *at = (const char *)c->p;
        c->p += len;
        return b->kind == K_BYTES ? PyBytes_FromStringAndSize(at, len) : PyUnicode_DecodeUTF8(at, len, "strict");
    }
    case K_ENUM:
        if (read_long(c, &n) < 0)
            return NULL;
        if (n < 0 || n >= PyTuple_GET_SIZE(b->symbols)) {
            PyErr_Format(PyExc_ValueError, "enum index %lld out of range", (long long)n);
            return NULL;
        }
        return Py_NewRef(PyTuple_GET_ITEM(b->symbols, n));
    case K_RECORD:
        return read_record(c, (const Reader *)b->symbols);
    case K_ARRAY:
        return read_array(c, (const Reader *)b->symbols);
    }
    PyErr_SetString(PyExc_ValueError, "unknown field kind");
    return NULL;
}

static PyObject *read_field(Cursor *c, const Field *f) {
    const Branch *b = &f->branches[0];
    if (f->is_union) {
        int64_t i;
        if (read_long(c, &i) < 0)
            return NULL;
        if (i < 0 || i >= f->n) {
            PyErr_Format(PyExc_ValueError, "union branch %lld out of range", (long long)i);
            return NULL;
        }
        b = &f->branches[i];
    }
    PyObject *value = read_value(c, b);
    if (value == NULL || b->conv == Py_None)
        return value;
    PyObject *converted = PyObject_CallFunctionObjArgs(b->conv, value, b->schema, Py_None, NULL);
    Py_DECREF(value);
    return converted;
}

static PyObject *read_record(Cursor *c, const Reader *r) {
    PyObject *record = PyDict_New();
    for (Py_ssize_t i = 0; record != NULL && i < r->n; i++) {
        PyObject *value = read_field(c, &r->fields[i]);
        if (value == NULL || PyDict_SetItem(record, r->fields[i].name, value) < 0)
            Py_CLEAR(record);
        Py_XDECREF(value);
    }
    return record;
}

/* Blocks of items until an empty one; a block with a negative count gives its size in bytes first. */
static PyObject *read_array(Cursor *c, const Reader *r) {
    PyObject *items = PyList_New(0);
    int64_t count, size;
    while (items != NULL) {
        if (read_long(c, &count) < 0 || (count < 0 && read_long(c, &size) < 0))
            goto failed;
        if (count == 0)
            break;
        count = count < 0 ? -count : count;
        if (count > c->end - c->p) { /* every item takes a byte at least (the plan holds no empty item) */
            too_short();
            goto failed;
        }
        for (int64_t i = 0; i < count; i++) {
            PyObject *item = read_field(c, &r->fields[0]);
            if (item == NULL || PyList_Append(items, item) < 0) {
                Py_XDECREF(item);
                goto failed;
            }
            Py_DECREF(item);
        }
    }
    return items;
failed:
    Py_XDECREF(items);
    return NULL;
}

static PyObject *Reader_read(Reader *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    Py_ssize_t start = 0;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "read(data, start=0)");
        return NULL;
    }
    if (nargs == 2 && (start = PyLong_AsSsize_t(args[1])) == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *record = NULL;
    if (start < 0 || start > view.len) {
        PyErr_SetString(PyExc_ValueError, "start is outside the data");
        goto done;
    }
    Cursor c = {(const unsigned char *)view.buf + start, (const unsigned char *)view.buf + view.len};
    record = read_record(&c, self);
done:
    PyBuffer_Release(&view);
    return record;
}

static void clear_fields(Reader *self) {
    for (Py_ssize_t i = 0; i < self->n; i++) {
        Field *f = &self->fields[i];
        for (Py_ssize_t j = 0; f->branches && j < f->n; j++) {
            Py_CLEAR(f->branches[j].conv);
            Py_CLEAR(f->branches[j].schema);
            Py_CLEAR(f->branches[j].symbols);
            Py_CLEAR(f->branches[j].index);
        }
        PyMem_Free(f->branches);
        Py_CLEAR(f->name);
    }
    PyMem_Free(self->fields);
    self->fields = NULL;
    self->n = 0;
}

static int take_branch(Branch *b, PyObject *spec) {
    PyObject *conv, *schema, *symbols;
    if (!PyArg_ParseTuple(spec, "iOOO", &b->kind, &conv, &schema, &symbols))
        return -1;
    int nested = b->kind == K_RECORD || b->kind == K_ARRAY;
    if (b->kind < K_NULL || b->kind > K_ARRAY || (b->kind == K_ENUM && !PyTuple_Check(symbols)) ||
        (nested && !PyObject_TypeCheck(symbols, &ReaderType)) ||
        (b->kind == K_ARRAY && ((Reader *)symbols)->n != 1)) {
        PyErr_SetString(PyExc_ValueError, "a branch spec is (kind, conv, schema, symbols or the nested Reader)");
        return -1;
    }
    b->conv = Py_NewRef(conv);
    b->schema = Py_NewRef(schema);
    b->symbols = Py_NewRef(symbols);
    return 0;
}

static int take_field(Field *f, PyObject *spec) {
    PyObject *name, *branches;
    if (!PyArg_ParseTuple(spec, "UpO!", &name, &f->is_union, &PyTuple_Type, &branches))
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(branches);
    if (n < 1 || (!f->is_union && n != 1)) {
        PyErr_SetString(PyExc_ValueError, "a field spec is (name, is union, branches): one branch unless a union");
        return -1;
    }
    f->name = Py_NewRef(name);
    if ((f->branches = PyMem_Calloc(n, sizeof(Branch))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    f->n = n; /* zeroed: what is taken before an error is released with the Reader */
    for (Py_ssize_t j = 0; j < n; j++)
        if (take_branch(&f->branches[j], PyTuple_GET_ITEM(branches, j)) < 0)
            return -1;
    return 0;
}

static int Reader_init(Reader *self, PyObject *args, PyObject *kwds) {
    PyObject *specs;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &specs))
        return -1;
    clear_fields(self);
    Py_ssize_t n = PyTuple_GET_SIZE(specs);
    if ((self->fields = PyMem_Calloc(n ? n : 1, sizeof(Field))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->n = n; /* zeroed: what is taken before an error is released with the Reader */
    for (Py_ssize_t i = 0; i < n; i++)
        if (take_field(&self->fields[i], PyTuple_GET_ITEM(specs, i)) < 0)
            return -1;
    return 0;
}

static void Reader_dealloc(Reader *self) {
    clear_fields(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Reader_methods[] = {
    {"read", (PyCFunction)(void (*)(void))Reader_read, METH_FASTCALL,
     "read(data, start=0): the record at data[start:] as a dict"},
    {NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tables._avro.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reader(fields): reads one flat Avro record shape",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
};

/* ---- writing ------------------------------------------------------------------------------ */

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} Out;

static int grow(Out *o, Py_ssize_t more) {
    if (o->len + more <= o->cap)
        return 0;
    Py_ssize_t cap = o->cap * 2 > o->len + more ? o->cap * 2 : o->len + more + 64;
    char *p = PyMem_Realloc(o->p, cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->p = p;
    o->cap = cap;
    return 0;
}

static int put_long(Out *o, int64_t n) {
    uint64_t z = ((uint64_t)n << 1) ^ (uint64_t)(n >> 63);
    if (grow(o, 10) < 0)
        return -1;
    while (z > 0x7f) {
        o->p[o->len++] = (char)((z & 0x7f) | 0x80);
        z >>= 7;
    }
    o->p[o->len++] = (char)z;
    return 0;
}

static int put_raw(Out *o, const void *data, Py_ssize_t n) {
    if (grow(o, n) < 0)
        return -1;
    memcpy(o->p + o->len, data, n);
    o->len += n;
    return 0;
}

enum { WROTE = 0, FAILED = -1, NOT_MINE = 1 }; /* NOT_MINE: fastavro writes this record */

static int put_value(Out *o, const Branch *b, PyObject *v) {
    switch (b->kind) {
    case K_NULL:
        return v == Py_None ? WROTE : NOT_MINE;
    case K_BOOLEAN:
        if (!PyBool_Check(v))
            return NOT_MINE;
        return put_raw(o, v == Py_True ? "\x01" : "\x00", 1);
    case K_INT:
    case K_LONG: {
        if (!PyLong_Check(v) || PyBool_Check(v)) /* fastavro: a bool in a union is a boolean */
            return NOT_MINE;
        int overflow;
        long long n = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (b->kind == K_INT && (n < INT32_MIN || n > INT32_MAX)))
            return NOT_MINE;
        return put_long(o, n);
    }
    case K_FLOAT:
    case K_DOUBLE: {
        if (!PyFloat_CheckExact(v))
            return NOT_MINE;
        double d = PyFloat_AS_DOUBLE(v);
        if (b->kind == K_DOUBLE)
            return put_raw(o, &d, 8);
        if (isfinite(d) && fabs(d) > FLT_MAX)
            return NOT_MINE; /* fastavro's own way with a float too large */
        float x = (float)d;
        return put_raw(o, &x, 4);
    }
    case K_BYTES:
        if (!PyBytes_CheckExact(v))
            return NOT_MINE;
        if (put_long(o, PyBytes_GET_SIZE(v)) < 0)
            return FAILED;
        return put_raw(o, PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v));
    case K_STRING: {
        Py_ssize_t n;
        const char *text;
        if (!PyUnicode_CheckExact(v))
            return NOT_MINE;
        if ((text = PyUnicode_AsUTF8AndSize(v, &n)) == NULL) {
            PyErr_Clear(); /* surrogates: fastavro says what is wrong */
            return NOT_MINE;
        }
        if (put_long(o, n) < 0)
            return FAILED;
        return put_raw(o, text, n);
    }
    case K_ENUM: {
        PyObject *at = PyUnicode_CheckExact(v) ? PyDict_GetItemWithError(b->index, v) : NULL;
        if (at == NULL)
            return PyErr_Occurred() ? FAILED : NOT_MINE;
        return put_long(o, PyLong_AsLongLong(at));
    }
    }
    return NOT_MINE;
}

static int put_branch(Out *o, const Branch *b, PyObject *v) {
    if (b->conv == Py_None || v == Py_None)
        return put_value(o, b, v);
    PyObject *prepared = PyObject_CallFunctionObjArgs(b->conv, v, b->schema, NULL);
    if (prepared == NULL) {
        PyErr_Clear(); /* fastavro raises it again, its way */
        return NOT_MINE;
    }
    int done = put_value(o, b, prepared);
    Py_DECREF(prepared);
    return done;
}

/* A union's value goes to the first branch whose type it has (fastavro's choice for these types). */
static int put_field(Out *o, const Field *f, PyObject *v) {
    if (!f->is_union)
        return put_branch(o, &f->branches[0], v);
    for (Py_ssize_t i = 0; i < f->n; i++) {
        int kind = f->branches[i].kind;
        if ((kind == K_FLOAT || kind == K_DOUBLE) && PyLong_Check(v) && !PyBool_Check(v))
            return NOT_MINE; /* fastavro would take an int as a float here: it writes this record */
        Py_ssize_t mark = o->len;
        if (put_long(o, i) < 0)
            return FAILED;
        int done = put_branch(o, &f->branches[i], v);
        if (done != NOT_MINE)
            return done;
        o->len = mark;
    }
    return NOT_MINE;
}

static PyObject *Writer_write(Reader *self, PyObject *record) {
    if (!PyDict_CheckExact(record))
        Py_RETURN_NONE;
    Out o = {PyMem_Malloc(256), 0, 256};
    if (o.p == NULL)
        return PyErr_NoMemory();
    int done = WROTE;
    for (Py_ssize_t i = 0; i < self->n && done == WROTE; i++) {
        PyObject *v = PyDict_GetItemWithError(record, self->fields[i].name);
        done = v == NULL ? (PyErr_Occurred() ? FAILED : NOT_MINE) : put_field(&o, &self->fields[i], v);
    }
    PyObject *out = done == WROTE      ? PyBytes_FromStringAndSize(o.p, o.len)
                    : done == NOT_MINE ? Py_NewRef(Py_None)
                                       : NULL;
    PyMem_Free(o.p);
    return out;
}

static int index_symbols(Branch *b) {
    if ((b->index = PyDict_New()) == NULL)
        return -1;
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(b->symbols); s++) {
        PyObject *n = PyLong_FromSsize_t(s);
        if (n == NULL || PyDict_SetItem(b->index, PyTuple_GET_ITEM(b->symbols, s), n) < 0) {
            Py_XDECREF(n);
            return -1;
        }
        Py_DECREF(n);
    }
    return 0;
}

static int Writer_init(Reader *self, PyObject *args, PyObject *kwds) {
    if (Reader_init(self, args, kwds) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < self->n; i++)
        for (Py_ssize_t j = 0; j < self->fields[i].n; j++)
            if (self->fields[i].branches[j].kind == K_ENUM && index_symbols(&self->fields[i].branches[j]) < 0)
                return -1;
    return 0;
}

static PyMethodDef Writer_methods[] = {
    {"write", (PyCFunction)Writer_write, METH_O, "write(record): its Avro bytes, or None (fastavro writes it)"},
    {NULL},
};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tables._avro.Writer",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writer(fields): writes one flat Avro record shape",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Writer_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Writer_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tables._avro", "Flat Avro records read and written in C.", -1};

PyMODINIT_FUNC PyInit__avro(void) {
    if (PyType_Ready(&ReaderType) < 0 || PyType_Ready(&WriterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Reader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddObjectRef(m, "Writer", (PyObject *)&WriterType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
