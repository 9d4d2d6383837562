/* capture._copier: the snapshot's COPY text straight to raw-topic messages, in C.
 *
 * Promise: a Copier is the file object ``cursor.copy_expert`` writes to. Every
 * line of ``COPY ... TO STDOUT`` (text format) becomes one READ change of the raw
 * topic -- the envelope (head, position, tx size), the framed Avro key and the
 * framed Avro value -- exactly the bytes the general path writes
 * (``snapshot.copy_field`` + ``RowEncoder`` + ``ChangeWriter.read_encoder``).
 * Columns come as specs from ``capture.transcoder.copier_columns``: a kind this
 * file encodes itself (integers, text, exact-scale decimals, timestamps, dates,
 * enums, booleans, doubles) and the column's general encoder, called for any
 * value the kind does not cover (NaN, infinity, other types). A row it cannot
 * write (wrong field count, NULL in a non-null column, an encoder that raised)
 * goes whole to the ``fallback`` callable, which is the general path and raises
 * its errors naming table and column. Messages are handed to ``on_batch`` in
 * lists of ``{"value", "key"}`` dicts (``Producer.produce_batch``'s shape), with
 * the values long enough to be TOASTed as ``(key, column index, text)``. Given a
 * ``Sender``, the Copier sends each message itself, from its own buffer, and hands
 * ``on_batch`` the number of messages sent instead of the list. Every message ends
 * with ``tail``: the record's fields after ``after`` (by default one null byte, the
 * ``backfill`` field of a snapshot row). With ``rows`` set the Copier writes no
 * messages: ``on_batch`` gets lists of ``(key, value)`` tuples (a backfill holds its
 * chunk's rows until the chunk's high watermark, ``capture.backfiller``), and
 * ``envelopes`` writes those rows' raw-topic changes once the chunk is due
 * (``send_envelopes``: and sends each through a ``Sender``, from one buffer). With ``nested``
 * set (``raw_images = "nested"``), the key and value go into the change as nested records:
 * their union branch and their Avro body, without the frame and the length of a bytes field,
 * after ``tail`` (the nested change record ends with its images: ``tables.change``).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_sender.h"

enum {
    K_LONG = 0,
    K_STRING = 1,
    K_DECIMAL = 2,
    K_TIMESTAMP = 3,
    K_DATE = 4,
    K_ENUM = 5,
    K_BOOL = 6,
    K_DOUBLE = 7,
    K_OTHER = 8,
};

#define TOAST_MIN 256

typedef struct {
    int kind;
    int nullable;
    int key;
    int toastable;
    int scale;
    Py_ssize_t nlabels;
    PyObject *labels; /* tuple of bytes (enums) */
    PyObject *field;  /* callable(bytes) -> bytes: the general encoding, union tag included */
} Column;

typedef struct {
    char *p;
    Py_ssize_t n, cap;
} Buf;

typedef struct {
    PyObject_HEAD
    Column *cols;
    Py_ssize_t ncols;
    PyObject *value_prefix, *key_prefix, *head, *size, *kafka_key, *tail;
    int rows_only; /* hand (key, value) tuples to on_batch instead of messages */
    int nested;    /* images as nested records (branch 1, the body without its frame), not framed bytes */
    PyObject *fallback, *on_batch, *sender; /* sender: a Sender, or NULL for batches of dicts */
    PyObject *batch, *large, *pool; /* pool: message dicts to reuse once on_batch let go of them */
    long long position, stride;
    Py_ssize_t batch_rows, pending; /* pending: messages sent through the sender since the last on_batch */
    long long rows, fast;
    Buf rest, value, keybuf, text, msg;
    Py_ssize_t *key_start, *key_end;
} Copier;

static PyObject *s_value, *s_key;

/* ---- buffers -------------------------------------------------------------------------- */

static int buf_reserve(Buf *b, Py_ssize_t more) {
    if (b->n + more <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + more)
        cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int buf_add(Buf *b, const char *data, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0)
        return -1;
    memcpy(b->p + b->n, data, n);
    b->n += n;
    return 0;
}

static inline int buf_byte(Buf *b, char c) {
    if (b->n >= b->cap && buf_reserve(b, 1) < 0)
        return -1;
    b->p[b->n++] = c;
    return 0;
}

/* Avro's zig-zag varint of a long */
static inline int varint(char *out, int64_t v) {
    uint64_t z = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    int n = 0;
    while (z >= 0x80) {
        out[n++] = (char)((z & 0x7F) | 0x80);
        z >>= 7;
    }
    out[n++] = (char)z;
    return n;
}

static inline int buf_long(Buf *b, int64_t v) {
    if (buf_reserve(b, 10) < 0)
        return -1;
    b->n += varint(b->p + b->n, v);
    return 0;
}

/* ---- values: 1 written, 0 not this kind's (the column's general encoder takes it), -1 error */

static int parse_long(const char *t, Py_ssize_t n, int64_t *out) {
    Py_ssize_t i = 0;
    int neg = 0;
    if (n && t[0] == '-') {
        neg = 1;
        i = 1;
    }
    if (i == n || n - i > 19)
        return 0;
    uint64_t v = 0;
    for (; i < n; i++) {
        unsigned d = (unsigned char)t[i] - '0';
        if (d > 9)
            return 0;
        v = v * 10 + d;
    }
    if (v > (uint64_t)INT64_MAX + neg)
        return 0;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return 1;
}

static int digits(const char *t, Py_ssize_t n, int64_t *out) {
    int64_t v = 0;
    if (n <= 0)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned d = (unsigned char)t[i] - '0';
        if (d > 9)
            return 0;
        v = v * 10 + d;
    }
    *out = v;
    return 1;
}

/* days from 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil) */
static int64_t days_from_civil(int64_t y, int64_t m, int64_t d) {
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

static const int MONTH_DAYS[13] = {0, 31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};

/* 'YYYY-MM-DD', years 1 to 9999 (what parse_date takes without raising) */
static int parse_day(const char *t, int64_t *out) {
    int64_t y, m, d;
    if (t[4] != '-' || t[7] != '-' || !digits(t, 4, &y) || !digits(t + 5, 2, &m) || !digits(t + 8, 2, &d))
        return 0;
    if (y < 1 || m < 1 || m > 12 || d < 1 || d > MONTH_DAYS[m])
        return 0;
    if (m == 2 && d == 29 && !((y % 4 == 0 && y % 100 != 0) || y % 400 == 0))
        return 0;
    *out = days_from_civil(y, m, d);
    return 1;
}

/* 'YYYY-MM-DD HH:MM:SS[.f{1,6}][+00]': parse_timestamp's common case */
static int parse_stamp(const char *t, Py_ssize_t n, int64_t *out) {
    if (n >= 22 && t[n - 3] == '+' && t[n - 2] == '0' && t[n - 1] == '0')
        n -= 3;
    if (n < 19 || t[10] != ' ' || t[13] != ':' || t[16] != ':')
        return 0;
    int64_t days, h, mi, s, frac = 0;
    if (!parse_day(t, &days) || !digits(t + 11, 2, &h) || !digits(t + 14, 2, &mi) || !digits(t + 17, 2, &s))
        return 0;
    if (n > 19) {
        Py_ssize_t f = n - 20;
        if (t[19] != '.' || f < 1 || f > 6 || !digits(t + 20, f, &frac))
            return 0;
        for (; f < 6; f++)
            frac *= 10;
    }
    *out = (days * 86400 + h * 3600 + mi * 60 + s) * 1000000 + frac;
    return 1;
}

/* numeric(p, s) printed with exactly s decimals, at most 38 digits: Avro decimal bytes */
static int put_decimal(Buf *b, const char *t, Py_ssize_t n, int scale) {
    Py_ssize_t i = 0, count = 0, after = -1;
    int neg = 0;
    __int128 u = 0;
    if (n && t[0] == '-') {
        neg = 1;
        i = 1;
    }
    for (; i < n; i++) {
        char c = t[i];
        if (c == '.') {
            if (after >= 0 || scale == 0)
                return 0;
            after = 0;
            continue;
        }
        unsigned d = (unsigned char)c - '0';
        if (d > 9 || ++count > 38)
            return 0;
        u = u * 10 + d;
        if (after >= 0)
            after++;
    }
    if (count == 0 || (scale ? after != scale : after >= 0))
        return 0;
    /* Python: u.to_bytes((u.bit_length() + 8) // 8, 'big', signed=True) */
    unsigned __int128 mag = (unsigned __int128)u;
    int bits = 0;
    while (mag) {
        bits++;
        mag >>= 1;
    }
    int len = (bits + 8) / 8;
    if (neg)
        u = -u;
    if (buf_reserve(b, 11 + len) < 0)
        return -1;
    b->n += varint(b->p + b->n, len);
    for (int k = len - 1; k >= 0; k--)
        b->p[b->n++] = (char)(unsigned char)(u >> (8 * k));
    return 1;
}

static int put_double(Buf *b, const char *t, Py_ssize_t n) {
    char tmp[64];
    if (n == 0 || n >= (Py_ssize_t)sizeof(tmp))
        return 0;
    unsigned char c = (unsigned char)t[0];
    if (!(c == '-' || (c >= '0' && c <= '9')) || (c == '-' && n > 1 && !(t[1] >= '0' && t[1] <= '9')))
        return 0; /* NaN, Infinity: the general encoder */
    memcpy(tmp, t, n);
    tmp[n] = 0;
    char *end;
    double v = strtod(tmp, &end);
    if (end != tmp + n)
        return 0;
    if (buf_reserve(b, 8) < 0)
        return -1;
    memcpy(b->p + b->n, &v, 8); /* x86-64 and arm64: little-endian, as Avro wants */
    b->n += 8;
    return 1;
}

static int put_enum(Buf *b, Column *c, const char *t, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < c->nlabels; k++) {
        PyObject *label = PyTuple_GET_ITEM(c->labels, k);
        if (PyBytes_GET_SIZE(label) == n && memcmp(PyBytes_AS_STRING(label), t, n) == 0)
            return buf_long(b, k) < 0 ? -1 : 1;
    }
    return 0;
}

/* one non-NULL value of column c; the union tag first where the column is nullable */
static int put_value(Buf *b, Column *c, const char *t, Py_ssize_t n) {
    int64_t v;
    switch (c->kind) {
    case K_LONG:
        return parse_long(t, n, &v) ? (buf_long(b, v) < 0 ? -1 : 1) : 0;
    case K_STRING:
        if (buf_long(b, n) < 0 || buf_add(b, t, n) < 0)
            return -1;
        return 1;
    case K_DECIMAL:
        return put_decimal(b, t, n, c->scale);
    case K_TIMESTAMP:
        return parse_stamp(t, n, &v) ? (buf_long(b, v) < 0 ? -1 : 1) : 0;
    case K_DATE:
        return n == 10 && parse_day(t, &v) ? (buf_long(b, v) < 0 ? -1 : 1) : 0;
    case K_ENUM:
        return put_enum(b, c, t, n);
    case K_BOOL:
        if (n != 1 || (t[0] != 't' && t[0] != 'f'))
            return 0;
        return buf_byte(b, t[0] == 't' ? 1 : 0) < 0 ? -1 : 1;
    case K_DOUBLE:
        return put_double(b, t, n);
    default:
        return 0;
    }
}

/* 1 written, 0 the general encoder raised (the row goes to the fallback), -1 error */
static int put_field(Buf *b, Column *c, const char *t, Py_ssize_t n) {
    Py_ssize_t mark = b->n;
    if (c->kind != K_OTHER) {
        /* decimals are a union of (decimal, string) even when not null: the decimal branch */
        if (c->kind == K_DECIMAL ? buf_byte(b, c->nullable ? 2 : 0) < 0 : (c->nullable && buf_byte(b, 2) < 0))
            return -1;
        int done = put_value(b, c, t, n);
        if (done)
            return done;
        b->n = mark;
    }
    PyObject *raw = PyBytes_FromStringAndSize(t, n);
    if (!raw)
        return -1;
    PyObject *out = PyObject_CallOneArg(c->field, raw);
    Py_DECREF(raw);
    if (!out) {
        PyErr_Clear(); /* the general path reports it, naming table and column */
        return 0;
    }
    int rc = PyBytes_Check(out) ? buf_add(b, PyBytes_AS_STRING(out), PyBytes_GET_SIZE(out)) : -1;
    if (rc < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "a column encoder returned something other than bytes");
    Py_DECREF(out);
    return rc < 0 ? -1 : 1;
}

/* COPY's text escapes (\b \f \n \r \t \v \\, anything else stands for itself) */
static int unescape(Buf *out, const char *t, Py_ssize_t n) {
    out->n = 0;
    if (buf_reserve(out, n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        char c = t[i];
        if (c == '\\' && i + 1 < n) {
            c = t[++i];
            switch (c) {
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            case 'v': c = '\v'; break;
            default: break;
            }
        }
        out->p[out->n++] = c;
    }
    return 0;
}

static Py_ssize_t utf8_chars(const char *t, Py_ssize_t n) {
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        count += ((unsigned char)t[i] & 0xC0) != 0x80;
    return count;
}

/* ---- rows ----------------------------------------------------------------------------- */

/* The framed value and key of one line, and its large values: 1, 0 (not ours), -1 error */
static int transcode(Copier *self, const char *line, Py_ssize_t len, PyObject **value, PyObject **key,
                     PyObject **large) {
    Buf *v = &self->value;
    v->n = 0;
    *value = *key = *large = NULL;
    if (buf_add(v, PyBytes_AS_STRING(self->value_prefix), PyBytes_GET_SIZE(self->value_prefix)) < 0)
        return -1;
    const char *p = line, *end = line + len;
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        Column *c = &self->cols[i];
        const char *tab = memchr(p, '\t', end - p);
        const char *stop = tab ? tab : end;
        if ((tab == NULL) != (i == self->ncols - 1))
            goto not_ours; /* a field too many or too few */
        const char *t = p;
        Py_ssize_t n = stop - p;
        p = stop + 1;
        if (n == 2 && t[0] == '\\' && t[1] == 'N') {
            if (!c->nullable || c->key)
                goto not_ours; /* the general path names the table and column */
            if (buf_byte(v, 0) < 0)
                goto error;
            continue;
        }
        if (memchr(t, '\\', n)) {
            if (unescape(&self->text, t, n) < 0)
                goto error;
            t = self->text.p;
            n = self->text.n;
        }
        if (c->key)
            self->key_start[i] = v->n;
        int done = put_field(v, c, t, n);
        if (done < 0)
            goto error;
        if (done == 0)
            goto not_ours;
        if (c->key)
            self->key_end[i] = v->n;
        if (c->toastable && n >= TOAST_MIN && utf8_chars(t, n) >= TOAST_MIN) {
            PyObject *text = PyUnicode_DecodeUTF8(t, n, "strict");
            if (!text)
                goto error;
            if (!*large && !(*large = PyList_New(0))) {
                Py_DECREF(text);
                goto error;
            }
            PyObject *item = Py_BuildValue("(nN)", i, text);
            if (!item || PyList_Append(*large, item) < 0) {
                Py_XDECREF(item);
                goto error;
            }
            Py_DECREF(item);
        }
    }
    if (self->key_prefix != Py_None) {
        Buf *k = &self->keybuf;
        k->n = 0;
        if (buf_add(k, PyBytes_AS_STRING(self->key_prefix), PyBytes_GET_SIZE(self->key_prefix)) < 0)
            goto error;
        for (Py_ssize_t i = 0; i < self->ncols; i++)
            if (self->cols[i].key && buf_add(k, v->p + self->key_start[i], self->key_end[i] - self->key_start[i]) < 0)
                goto error;
        if (!(*key = PyBytes_FromStringAndSize(k->p, k->n)))
            goto error;
    } else {
        *key = Py_NewRef(Py_None);
    }
    if (!(*value = PyBytes_FromStringAndSize(v->p, v->n)))
        goto error;
    return 1;
not_ours:
    Py_CLEAR(*large);
    return 0;
error:
    Py_CLEAR(*large);
    Py_CLEAR(*key);
    return -1;
}

/* An optional row image (None or framed bytes) as the change's field: null, or union branch 1 and then
 * the framed bytes as a bytes field (framed), or the record's Avro body alone (nested) */
static int image(Buf *m, PyObject *o, int nested) {
    if (o == Py_None)
        return buf_byte(m, 0);
    if (!PyBytes_Check(o) || (nested && PyBytes_GET_SIZE(o) < 5)) {
        PyErr_SetString(PyExc_TypeError, "row images must be framed bytes or None");
        return -1;
    }
    if (nested)
        return buf_byte(m, 2) < 0 || buf_add(m, PyBytes_AS_STRING(o) + 5, PyBytes_GET_SIZE(o) - 5) < 0 ? -1 : 0;
    return buf_byte(m, 2) < 0 || buf_long(m, PyBytes_GET_SIZE(o)) < 0 ||
                   buf_add(m, PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o)) < 0
               ? -1
               : 0;
}

/* One change with no old image into m: head, position, size, then the images and the tail (framed), or the tail
 * and the images (nested) */
static int changed(Buf *m, PyObject *head, long long position, PyObject *size, PyObject *key, PyObject *after,
                   PyObject *tail, int nested) {
    if (buf_add(m, PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head)) < 0 || buf_long(m, position) < 0 ||
        buf_add(m, PyBytes_AS_STRING(size), PyBytes_GET_SIZE(size)) < 0 ||
        (nested && buf_add(m, PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail)) < 0) || image(m, key, nested) < 0 ||
        buf_byte(m, 0) < 0 || image(m, after, nested) < 0 ||
        (!nested && buf_add(m, PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail)) < 0))
        return -1;
    return 0;
}

/* The raw-topic READ change around a row, into self->msg: what ChangeWriter.read_encoder writes */
static int envelope(Copier *self, PyObject *key, PyObject *after) {
    Buf *m = &self->msg;
    m->n = 0;
    return changed(m, self->head, self->position, self->size, key, after, self->tail, self->nested);
}

/* The row itself, (key, value), into the batch (rows mode). The pair holds bytes (or None) only, so it can be in
 * no reference cycle: it is untracked at once, and the cyclic GC need not walk a backfill's rows (it took ~11% of
 * the reader's CPU) */
static int keep_row(Copier *self, PyObject *key, PyObject *value) {
    PyObject *item = PyTuple_Pack(2, key, value);
    if (item)
        PyObject_GC_UnTrack(item);
    int rc = item && PyList_Append(self->batch, item) == 0 ? 0 : -1;
    Py_XDECREF(item);
    return rc;
}

static int flush_batch(Copier *self) {
    if (PyList_GET_SIZE(self->batch) == 0 && PyList_GET_SIZE(self->large) == 0 && self->pending == 0)
        return 0;
    PyObject *batch = self->sender ? PyLong_FromSsize_t(self->pending) : self->batch, *large = self->large;
    self->pending = 0;
    self->batch = self->sender ? self->batch : PyList_New(0);
    self->large = PyList_New(0);
    if (!batch || !self->batch || !self->large) {
        Py_XDECREF(batch);
        Py_DECREF(large);
        return -1;
    }
    PyObject *out = PyObject_CallFunctionObjArgs(self->on_batch, batch, large, NULL);
    Py_DECREF(batch);
    Py_DECREF(large);
    if (!out)
        return -1;
    Py_DECREF(out);
    return 0;
}

static int general_row(Copier *self, const char *line, Py_ssize_t len, PyObject **value, PyObject **key,
                       PyObject **large) {
    PyObject *raw = PyBytes_FromStringAndSize(line, len);
    if (!raw)
        return -1;
    PyObject *found = PyObject_CallOneArg(self->fallback, raw);
    Py_DECREF(raw);
    if (!found)
        return -1;
    if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 3 || !PyBytes_Check(PyTuple_GET_ITEM(found, 0)) ||
        !(PyBytes_Check(PyTuple_GET_ITEM(found, 1)) || PyTuple_GET_ITEM(found, 1) == Py_None)) {
        Py_DECREF(found);
        PyErr_SetString(PyExc_TypeError, "the fallback must return (value, key or None, large or None)");
        return -1;
    }
    *value = Py_NewRef(PyTuple_GET_ITEM(found, 0));
    *key = Py_NewRef(PyTuple_GET_ITEM(found, 1));
    PyObject *l = PyTuple_GET_ITEM(found, 2);
    *large = (l == Py_None || (PyList_Check(l) && PyList_GET_SIZE(l) == 0)) ? NULL : Py_NewRef(l);
    Py_DECREF(found);
    return 0;
}

static int add_large(Copier *self, PyObject *key, PyObject *large) {
    if (!large || key == Py_None)
        return 0;
    PyObject *body = PySequence_GetSlice(key, 5, PY_SSIZE_T_MAX); /* the key without its frame */
    if (!body)
        return -1;
    PyObject *iter = PyObject_GetIter(large), *item;
    int rc = iter ? 0 : -1;
    while (rc == 0 && (item = PyIter_Next(iter))) {
        PyObject *index, *text;
        if (!PyArg_ParseTuple(item, "OO", &index, &text)) {
            rc = -1;
        } else {
            PyObject *entry = PyTuple_Pack(3, body, index, text);
            rc = entry && PyList_Append(self->large, entry) == 0 ? 0 : -1;
            Py_XDECREF(entry);
        }
        Py_DECREF(item);
    }
    if (rc == 0 && PyErr_Occurred())
        rc = -1;
    Py_XDECREF(iter);
    Py_DECREF(body);
    return rc;
}

/* A {"value": msg, "key": kafka_key} dict (new reference): the pool's next one when nobody else holds it */
static PyObject *message(Copier *self, PyObject *msg) {
    Py_ssize_t i = PyList_GET_SIZE(self->batch);
    PyObject *item = i < PyList_GET_SIZE(self->pool) ? PyList_GET_ITEM(self->pool, i) : NULL;
    if (item && Py_REFCNT(item) == 1 && PyDict_GET_SIZE(item) == 2) {
        if (PyDict_SetItem(item, s_value, msg) < 0)
            return NULL;
        return Py_NewRef(item);
    }
    item = PyDict_New();
    if (!item || PyDict_SetItem(item, s_value, msg) < 0 || PyDict_SetItem(item, s_key, self->kafka_key) < 0) {
        Py_XDECREF(item);
        return NULL;
    }
    int rc = i < PyList_GET_SIZE(self->pool) ? PyList_SetItem(self->pool, i, Py_NewRef(item))
                                             : PyList_Append(self->pool, item);
    if (rc < 0) {
        Py_DECREF(item);
        return NULL;
    }
    return item;
}

/* The message in self->msg: through the sender, or as a dict into the batch */
static int send(Copier *self) {
    Buf *m = &self->msg;
    if (self->sender) {
        if (sender_send(self->sender, m->p, m->n, PyBytes_AS_STRING(self->kafka_key), PyBytes_GET_SIZE(self->kafka_key)) < 0)
            return -1;
        self->pending++;
        return 0;
    }
    PyObject *msg = PyBytes_FromStringAndSize(m->p, m->n);
    PyObject *item = msg ? message(self, msg) : NULL;
    int rc = item && PyList_Append(self->batch, item) == 0 ? 0 : -1;
    Py_XDECREF(item);
    Py_XDECREF(msg);
    return rc;
}

static int row(Copier *self, const char *line, Py_ssize_t len) {
    PyObject *value, *key, *large;
    int found = transcode(self, line, len, &value, &key, &large);
    if (found < 0)
        return -1;
    if (found)
        self->fast++;
    else if (general_row(self, line, len, &value, &key, &large) < 0)
        return -1;
    int rc = self->rows_only ? keep_row(self, key, value) : envelope(self, key, value) == 0 ? send(self) : -1;
    if (rc == 0 && add_large(self, key, large) == 0) {
        self->position += self->stride;
        self->rows++;
    } else {
        rc = -1;
    }
    Py_DECREF(value);
    Py_DECREF(key);
    Py_XDECREF(large);
    if (rc == 0 && PyList_GET_SIZE(self->batch) + self->pending >= self->batch_rows)
        rc = flush_batch(self);
    return rc;
}

/* ---- a backfill's chunk ---------------------------------------------------------------- */

/* The raw-topic change around row i of a chunk, (key, value), into m: what ChangeWriter.records writes for it
 * (head: op, table, topic, transaction; size: the chunk's; tail: the fields after after; nested: the images) */
static int chunk_change(Buf *m, PyObject *head, Py_ssize_t i, PyObject *size, PyObject *row, PyObject *tail,
                        int nested) {
    m->n = 0;
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 2) {
        PyErr_SetString(PyExc_TypeError, "rows must be (key, value) tuples");
        return -1;
    }
    return changed(m, head, i, size, PyTuple_GET_ITEM(row, 0), PyTuple_GET_ITEM(row, 1), tail, nested);
}

/* envelopes(head, size, rows, tail, nested=False): the raw-topic change around each (key, value) of rows, positions
 * 0, 1, ..., before null: what ChangeWriter.records writes for a backfill's chunk (head: op, table, topic,
 * transaction) */
static PyObject *envelopes(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *head, *size, *rows, *tail;
    int nested = 0;
    if (!PyArg_ParseTuple(args, "SSO!S|p", &head, &size, &PyList_Type, &rows, &tail, &nested))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rows);
    PyObject *out = PyList_New(n);
    Buf m = {0};
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *msg = NULL;
        if (chunk_change(&m, head, i, size, PyList_GET_ITEM(rows, i), tail, nested) < 0 ||
            !(msg = PyBytes_FromStringAndSize(m.p, m.n)))
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, msg);
    }
    PyMem_Free(m.p);
    return out;
}

/* send_envelopes(sender, kafka_key, head, size, rows, tail, first): what envelopes writes for rows, positions first,
 * first + 1, ..., written into one buffer (no Python object per message), then sent through the sender with the GIL
 * released */
static PyObject *send_envelopes(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *sender, *kafka_key, *head, *size, *rows, *tail;
    Py_ssize_t first;
    int nested = 0;
    if (!PyArg_ParseTuple(args, "O!SSSO!Sn|p", &SenderType, &sender, &kafka_key, &head, &size, &PyList_Type, &rows,
                          &tail, &first, &nested))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rows);
    Py_ssize_t *offsets = PyMem_Malloc((n + 1) * sizeof(Py_ssize_t));
    Buf all = {0}, m = {0};
    int rc = offsets ? 0 : -1;
    if (!offsets)
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        offsets[i] = all.n;
        rc = chunk_change(&m, head, first + i, size, PyList_GET_ITEM(rows, i), tail, nested);
        if (rc == 0)
            rc = buf_add(&all, m.p, m.n);
    }
    if (rc == 0) {
        offsets[n] = all.n;
        rc = sender_send_all(sender, all.p, offsets, n, PyBytes_AS_STRING(kafka_key), PyBytes_GET_SIZE(kafka_key));
    }
    PyMem_Free(offsets);
    PyMem_Free(all.p);
    PyMem_Free(m.p);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ---- reading a framed change's head (retractions) ------------------------------------------ */

/* Avro's zig-zag varint at *p (before end) into *out; -1 if it runs past end or over 10 bytes */
static int read_long(const unsigned char **p, const unsigned char *end, int64_t *out) {
    uint64_t z = 0;
    for (int shift = 0; shift < 70 && *p < end; shift += 7) {
        unsigned char c = *(*p)++;
        z |= (uint64_t)(c & 0x7F) << shift;
        if (!(c & 0x80)) {
            *out = (int64_t)(z >> 1) ^ -(int64_t)(z & 1);
            return 0;
        }
    }
    return -1;
}

/* A string or bytes field at *p: its start and length; -1 if it runs past end */
static int read_span(const unsigned char **p, const unsigned char *end, const unsigned char **at, int64_t *n) {
    if (read_long(p, end, n) < 0 || *n < 0 || *n > end - *p)
        return -1;
    *at = *p;
    *p += *n;
    return 0;
}

/* An optional bytes field (union null, bytes) at *p: None, or a new bytes object; NULL with *bad set on bad data */
static PyObject *read_optional(const unsigned char **p, const unsigned char *end, int *bad) {
    int64_t branch, n;
    const unsigned char *at;
    if (read_long(p, end, &branch) < 0 || (branch != 0 && branch != 1) ||
        (branch == 1 && read_span(p, end, &at, &n) < 0)) {
        *bad = 1;
        return NULL;
    }
    return branch == 0 ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize((const char *)at, n);
}

/* change_head(value): (op index, schema, table, key, before) of a Confluent-framed change record whose writer schema
 * begins as tables.change.CHANGE_VALUE_SCHEMA does (op, schema, table, topic, commit_lsn, xid, commit_time, position,
 * tx_size, key, before: the caller checks the writer's fields); the rest of the record is not read. ValueError if the
 * bytes do not hold those fields. */
static PyObject *change_head(PyObject *Py_UNUSED(module), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = (const unsigned char *)view.buf + 5, *end = (const unsigned char *)view.buf + view.len;
    const unsigned char *names[3];
    int64_t op = -1, lengths[3], skipped;
    int bad = view.len < 5 || read_long(&p, end, &op) < 0;
    for (int i = 0; !bad && i < 3; i++)
        bad = read_span(&p, end, &names[i], &lengths[i]) < 0; /* schema, table, topic */
    for (int i = 0; !bad && i < 5; i++)
        bad = read_long(&p, end, &skipped) < 0; /* commit_lsn, xid, commit_time, position, tx_size */
    PyObject *key = bad ? NULL : read_optional(&p, end, &bad);
    PyObject *before = bad ? NULL : read_optional(&p, end, &bad);
    PyObject *out = NULL;
    if (bad && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "not a change record's head");
    else if (key && before)
        out = Py_BuildValue("(Ls#s#OO)", (long long)op, names[0], (Py_ssize_t)lengths[0], names[1],
                            (Py_ssize_t)lengths[1], key, before);
    Py_XDECREF(key);
    Py_XDECREF(before);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef module_methods[] = {
    {"envelopes", envelopes, METH_VARARGS,
     "envelopes(head, size, rows, tail, nested=False): a backfill chunk's raw-topic changes"},
    {"change_head", change_head, METH_O,
     "change_head(value): (op index, schema, table, key, before) of a framed change record"},
    {"send_envelopes", send_envelopes, METH_VARARGS,
     "send_envelopes(sender, kafka_key, head, size, rows, tail, first, nested=False): a chunk's changes through a "
     "Sender"},
    {NULL, NULL, 0, NULL},
};

/* ---- the Python type ------------------------------------------------------------------ */

static PyObject *Copier_write(Copier *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const char *p = view.buf, *end = p + view.len;
    Py_ssize_t written = view.len;
    int rc = 0;
    while (rc == 0 && p < end) {
        const char *nl = memchr(p, '\n', end - p);
        if (!nl) {
            rc = buf_add(&self->rest, p, end - p);
            break;
        }
        if (self->rest.n) {
            rc = buf_add(&self->rest, p, nl - p);
            if (rc == 0)
                rc = row(self, self->rest.p, self->rest.n);
            self->rest.n = 0;
        } else {
            rc = row(self, p, nl - p);
        }
        p = nl + 1;
    }
    PyBuffer_Release(&view);
    return rc < 0 ? NULL : PyLong_FromSsize_t(written);
}

static PyObject *Copier_finish(Copier *self, PyObject *Py_UNUSED(ignored)) {
    if (self->rest.n) {
        int rc = row(self, self->rest.p, self->rest.n);
        self->rest.n = 0;
        if (rc < 0)
            return NULL;
    }
    if (flush_batch(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static void Copier_dealloc(Copier *self) {
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        Py_XDECREF(self->cols[i].labels);
        Py_XDECREF(self->cols[i].field);
    }
    PyMem_Free(self->cols);
    PyMem_Free(self->key_start);
    PyMem_Free(self->key_end);
    Py_XDECREF(self->value_prefix);
    Py_XDECREF(self->key_prefix);
    Py_XDECREF(self->head);
    Py_XDECREF(self->size);
    Py_XDECREF(self->kafka_key);
    Py_XDECREF(self->tail);
    Py_XDECREF(self->fallback);
    Py_XDECREF(self->on_batch);
    Py_XDECREF(self->sender);
    Py_XDECREF(self->batch);
    Py_XDECREF(self->large);
    Py_XDECREF(self->pool);
    PyMem_Free(self->rest.p);
    PyMem_Free(self->value.p);
    PyMem_Free(self->keybuf.p);
    PyMem_Free(self->text.p);
    PyMem_Free(self->msg.p);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int parse_column(Column *c, PyObject *spec) {
    PyObject *labels, *field;
    if (!PyArg_ParseTuple(spec, "iiiiiOO;a column spec is (kind, nullable, key, toastable, scale, labels, field)",
                          &c->kind, &c->nullable, &c->key, &c->toastable, &c->scale, &labels, &field))
        return -1;
    if (c->kind < K_LONG || c->kind > K_OTHER || !PyTuple_Check(labels) || !PyCallable_Check(field)) {
        PyErr_SetString(PyExc_ValueError, "bad column spec: unknown kind, labels not a tuple or field not callable");
        return -1;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(labels); k++)
        if (!PyBytes_Check(PyTuple_GET_ITEM(labels, k))) {
            PyErr_SetString(PyExc_TypeError, "enum labels must be bytes");
            return -1;
        }
    if (c->kind == K_DECIMAL && (c->scale < 0 || c->scale > 38)) {
        PyErr_SetString(PyExc_ValueError, "decimal scale out of range");
        return -1;
    }
    c->nlabels = PyTuple_GET_SIZE(labels);
    c->labels = Py_NewRef(labels);
    c->field = Py_NewRef(field);
    return 0;
}

static int Copier_init(Copier *self, PyObject *args, PyObject *kwargs) {
    static char *kws[] = {"columns", "value_prefix", "key_prefix", "head", "size", "kafka_key", "position",
                          "stride", "fallback", "on_batch", "batch_rows", "sender", "tail", "rows", "nested", NULL};
    PyObject *columns, *vp, *kp, *head, *size, *kk, *fallback, *on_batch, *sender = Py_None, *tail = NULL;
    int rows_only = 0, nested = 0;
    long long position, stride;
    Py_ssize_t batch_rows;
    if (self->cols) {
        PyErr_SetString(PyExc_RuntimeError, "a Copier is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OSOSSSLLOOn|OSpp", kws, &columns, &vp, &kp, &head, &size, &kk,
                                     &position, &stride, &fallback, &on_batch, &batch_rows, &sender, &tail, &rows_only,
                                     &nested))
        return -1;
    if (!PyList_Check(columns) || PyList_GET_SIZE(columns) == 0 || !(kp == Py_None || PyBytes_Check(kp)) ||
        !PyCallable_Check(fallback) || !PyCallable_Check(on_batch) || batch_rows < 1 || stride < 1 ||
        !(sender == Py_None || Py_IS_TYPE(sender, &SenderType)) || (rows_only && sender != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "bad Copier arguments");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(columns);
    self->cols = PyMem_Calloc(n, sizeof(Column));
    self->key_start = PyMem_Calloc(n, sizeof(Py_ssize_t));
    self->key_end = PyMem_Calloc(n, sizeof(Py_ssize_t));
    if (!self->cols || !self->key_start || !self->key_end) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_column(&self->cols[i], PyList_GET_ITEM(columns, i)) < 0)
            return -1;
        self->ncols = i + 1;
    }
    self->value_prefix = Py_NewRef(vp);
    self->key_prefix = Py_NewRef(kp);
    self->head = Py_NewRef(head);
    self->size = Py_NewRef(size);
    self->kafka_key = Py_NewRef(kk);
    self->tail = tail ? Py_NewRef(tail) : PyBytes_FromStringAndSize("\x00", 1);
    self->rows_only = rows_only;
    self->nested = nested;
    if (!self->tail)
        return -1;
    self->fallback = Py_NewRef(fallback);
    self->on_batch = Py_NewRef(on_batch);
    self->sender = sender == Py_None ? NULL : Py_NewRef(sender);
    self->position = position;
    self->stride = stride;
    self->batch_rows = batch_rows;
    self->batch = PyList_New(0);
    self->large = PyList_New(0);
    self->pool = PyList_New(0);
    return self->batch && self->large && self->pool ? 0 : -1;
}

static PyMethodDef Copier_methods[] = {
    {"write", (PyCFunction)Copier_write, METH_O, "write(data): COPY output; every complete line becomes a message"},
    {"finish", (PyCFunction)Copier_finish, METH_NOARGS, "finish(): the last line and the last batch to on_batch"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Copier_members[] = {
    {"position", T_LONGLONG, offsetof(Copier, position), READONLY, "the next row's position"},
    {"rows", T_LONGLONG, offsetof(Copier, rows), READONLY, "rows written"},
    {"fast", T_LONGLONG, offsetof(Copier, fast), READONLY, "rows written without the fallback"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CopierType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "capture._copier.Copier",
    .tp_basicsize = sizeof(Copier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "COPY text lines to raw-topic READ messages (see the module's promise)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Copier_init,
    .tp_dealloc = (destructor)Copier_dealloc,
    .tp_methods = Copier_methods,
    .tp_members = Copier_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copier", "The snapshot's COPY text to raw-topic messages, in C.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__copier(void) {
    if (PyType_Ready(&CopierType) < 0 || PyType_Ready(&SenderType) < 0)
        return NULL;
    s_value = PyUnicode_InternFromString("value");
    s_key = PyUnicode_InternFromString("key");
    PyObject *m = PyModule_Create(&module);
    if (!m || !s_value || !s_key)
        return NULL;
    static const struct {
        const char *name;
        int value;
    } constants[] = {
        {"LONG", K_LONG}, {"STRING", K_STRING}, {"DECIMAL", K_DECIMAL}, {"TIMESTAMP", K_TIMESTAMP},
        {"DATE", K_DATE}, {"ENUM", K_ENUM}, {"BOOL", K_BOOL}, {"DOUBLE", K_DOUBLE}, {"OTHER", K_OTHER},
        {"TOAST_MIN", TOAST_MIN},
    };
    int rc = PyModule_AddObjectRef(m, "Copier", (PyObject *)&CopierType);
    if (rc == 0)
        rc = PyModule_AddObjectRef(m, "Sender", (PyObject *)&SenderType);
    for (size_t i = 0; rc == 0 && i < sizeof(constants) / sizeof(constants[0]); i++)
        rc = PyModule_AddIntConstant(m, constants[i].name, constants[i].value);
    if (rc < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
