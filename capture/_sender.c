/* capture._copier.Sender: the snapshot's messages straight into librdkafka, no Python per message.
 *
 * Promise: a Sender is a librdkafka producer of its own, made from the settings
 * capture's ChangeProducer uses (idempotence, acks=all, compression, SASL/TLS:
 * whatever the dict says, passed through as text), on the librdkafka confluent-kafka
 * itself loaded (opened by path, so the process holds one copy). ``sender_send`` copies
 * one message into the local queue, waiting with the GIL released while the queue is
 * full; the topic is first looked up then (the Sender may be made before the topic is),
 * or at ``open``. ``sender_send_all`` copies many from one buffer with the GIL released. Kafka's acknowledgements are not reported one by one
 * (``delivery.report.only.error``): a failed delivery or a fatal producer error is kept
 * as ``failure`` (failed deliveries counted in ``errors``) and makes every later send raise
 * ``error``. So ``flush`` returning 0 with ``failure`` still None means Kafka acknowledged every
 * message sent. librdkafka's log lines and non-fatal errors go to the Python callable ``log(level,
 * text)`` (syslog levels), on the thread that sends, flushes or polls (``log.queue``: never from
 * librdkafka's own threads), so they take the process's log format and its gate on connection noise.
 *
 * librdkafka's API is declared here, not included: only the stable C ABI below is used
 * (rdkafka.h, unchanged since librdkafka 1.0), and no header package is needed to build.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "_sender.h"

typedef struct rd_kafka_s rd_kafka_t;
typedef struct rd_kafka_topic_s rd_kafka_topic_t;
typedef struct rd_kafka_conf_s rd_kafka_conf_t;
typedef struct {
    int err;
    rd_kafka_topic_t *rkt;
    int32_t partition;
    void *payload;
    size_t len;
    void *key;
    size_t key_len;
    int64_t offset;
    void *_private;
} rd_kafka_message_t;

#define RD_KAFKA_PRODUCER 0
#define RD_KAFKA_MSG_F_COPY 0x2
#define RD_KAFKA_CONF_OK 0
#define RD_KAFKA_RESP_ERR__FATAL (-150)
#define RD_KAFKA_RESP_ERR__QUEUE_FULL (-184)
#define POLL_EVERY 1024 /* sends between two serves of librdkafka's events (failed deliveries, errors) */
#define SEND_BATCH 1024 /* messages handed to librdkafka at once by sender_send_all (then its events served) */
#define SIZE_MARGIN 512 /* bytes librdkafka may add to a message's key and value before it checks message.max.bytes */

typedef void (*dr_cb)(rd_kafka_t *, const rd_kafka_message_t *, void *);
typedef void (*error_cb)(rd_kafka_t *, int, const char *, void *);
typedef void (*log_cb)(const rd_kafka_t *, int, const char *, const char *);

static struct {
    void *lib;
    rd_kafka_conf_t *(*conf_new)(void);
    int (*conf_set)(rd_kafka_conf_t *, const char *, const char *, char *, size_t);
    int (*conf_get)(const rd_kafka_conf_t *, const char *, char *, size_t *);
    void (*conf_set_dr_msg_cb)(rd_kafka_conf_t *, dr_cb);
    void (*conf_set_error_cb)(rd_kafka_conf_t *, error_cb);
    void (*conf_set_log_cb)(rd_kafka_conf_t *, log_cb);
    void (*conf_set_opaque)(rd_kafka_conf_t *, void *);
    int (*set_log_queue)(rd_kafka_t *, void *);
    void *(*opaque)(const rd_kafka_t *);
    void (*conf_destroy)(rd_kafka_conf_t *);
    rd_kafka_t *(*create)(int, rd_kafka_conf_t *, char *, size_t);
    rd_kafka_topic_t *(*topic_new)(rd_kafka_t *, const char *, void *);
    int (*produce)(rd_kafka_topic_t *, int32_t, int, void *, size_t, const void *, size_t, void *);
    int (*produce_batch)(rd_kafka_topic_t *, int32_t, int, rd_kafka_message_t *, int);
    int (*last_error)(void);
    int (*poll)(rd_kafka_t *, int);
    int (*flush)(rd_kafka_t *, int);
    int (*outq_len)(rd_kafka_t *);
    const char *(*err2str)(int);
    int (*fatal_error)(rd_kafka_t *, char *, size_t);
    void (*topic_destroy)(rd_kafka_topic_t *);
    void (*destroy)(rd_kafka_t *);
} rd;

static int load(const char *path) {
    if (rd.lib)
        return 0;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        PyErr_Format(PyExc_OSError, "cannot open librdkafka (%s): %s", path, dlerror());
        return -1;
    }
    const struct {
        const char *name;
        void **slot;
    } symbols[] = {
        {"rd_kafka_conf_new", (void **)&rd.conf_new},
        {"rd_kafka_conf_set", (void **)&rd.conf_set},
        {"rd_kafka_conf_get", (void **)&rd.conf_get},
        {"rd_kafka_conf_set_dr_msg_cb", (void **)&rd.conf_set_dr_msg_cb},
        {"rd_kafka_conf_set_error_cb", (void **)&rd.conf_set_error_cb},
        {"rd_kafka_conf_set_log_cb", (void **)&rd.conf_set_log_cb},
        {"rd_kafka_conf_set_opaque", (void **)&rd.conf_set_opaque},
        {"rd_kafka_set_log_queue", (void **)&rd.set_log_queue},
        {"rd_kafka_opaque", (void **)&rd.opaque},
        {"rd_kafka_conf_destroy", (void **)&rd.conf_destroy},
        {"rd_kafka_new", (void **)&rd.create},
        {"rd_kafka_topic_new", (void **)&rd.topic_new},
        {"rd_kafka_produce", (void **)&rd.produce},
        {"rd_kafka_produce_batch", (void **)&rd.produce_batch},
        {"rd_kafka_last_error", (void **)&rd.last_error},
        {"rd_kafka_poll", (void **)&rd.poll},
        {"rd_kafka_flush", (void **)&rd.flush},
        {"rd_kafka_outq_len", (void **)&rd.outq_len},
        {"rd_kafka_err2str", (void **)&rd.err2str},
        {"rd_kafka_fatal_error", (void **)&rd.fatal_error},
        {"rd_kafka_topic_destroy", (void **)&rd.topic_destroy},
        {"rd_kafka_destroy", (void **)&rd.destroy},
    };
    for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
        if (!(*symbols[i].slot = dlsym(lib, symbols[i].name))) {
            PyErr_Format(PyExc_OSError, "%s has no %s: not a librdkafka this Sender can use", path, symbols[i].name);
            dlclose(lib);
            return -1;
        }
    }
    rd.lib = lib;
    return 0;
}

typedef struct {
    PyObject_HEAD
    rd_kafka_t *rk;
    rd_kafka_topic_t *rkt;
    PyObject *error; /* the exception type a failure is raised as */
    PyObject *log;   /* log(level, text): librdkafka's lines and non-fatal errors */
    char topic[256];
    char failure[512];
    long long sent;
    long long errors;    /* failed deliveries */
    long long max_bytes; /* message.max.bytes: a message near it goes to librdkafka alone (``produce_from``) */
} Sender;

static void fail(Sender *self, const char *fmt, ...) {
    if (self->failure[0])
        return; /* the first failure is the one to report */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(self->failure, sizeof(self->failure), fmt, ap);
    va_end(ap);
}

/* Served by rd_kafka_poll/flush on the calling thread: only failed deliveries come here. */
static void on_delivery(rd_kafka_t *rk, const rd_kafka_message_t *msg, void *opaque) {
    Sender *self = opaque;
    if (msg->err) {
        self->errors++;
        fail(self, "delivery to %s failed: %s", self->topic, rd.err2str(msg->err));
    }
}

/* A line to the Python callable, from the thread serving librdkafka's queue (the GIL may be released). */
static void say(Sender *self, int level, const char *text) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *type, *value, *trace; /* a send may be raising: keep its exception (3.11: no GetRaisedException) */
    PyErr_Fetch(&type, &value, &trace);
    PyObject *done = self->log ? PyObject_CallFunction(self->log, "is", level, text) : NULL;
    if (!done && self->log)
        PyErr_WriteUnraisable(self->log);
    Py_XDECREF(done);
    PyErr_Restore(type, value, trace);
    PyGILState_Release(gil);
}

static void on_error(rd_kafka_t *rk, int err, const char *reason, void *opaque) {
    Sender *self = opaque;
    if (err == RD_KAFKA_RESP_ERR__FATAL) {
        char text[256];
        int code = rd.fatal_error(rk, text, sizeof(text));
        fail(self, "fatal producer error: %s (%s)", text, rd.err2str(code));
    } else {
        char line[1024];
        snprintf(line, sizeof(line), "%s: %s", rd.err2str(err), reason);
        say(self, 4, line);
    }
}

/* Served from the log queue by rd_kafka_poll/flush (``log.queue``), like the error callback. */
static void on_log(const rd_kafka_t *rk, int level, const char *facility, const char *text) {
    char line[1024];
    snprintf(line, sizeof(line), "%s: %s", facility, text);
    say(rd.opaque(rk), level, line);
}

static int raise_failure(Sender *self) {
    PyErr_SetString(self->error, self->failure);
    return -1;
}

/* The topic's handle (librdkafka looks the topic up then): 0, or -1 with an exception set */
static int open_topic(Sender *self) {
    if (!self->rk) {
        PyErr_SetString(PyExc_RuntimeError, "the Sender is closed");
        return -1;
    }
    if (!self->rkt && !(self->rkt = rd.topic_new(self->rk, self->topic, NULL))) {
        PyErr_Format(self->error, "topic %s: %s", self->topic, rd.err2str(rd.last_error()));
        return -1;
    }
    return 0;
}

int sender_send(PyObject *sender, const char *value, size_t value_len, const char *key, size_t key_len) {
    Sender *self = (Sender *)sender;
    /* the topic handle only now (or at ``open``): asking for its metadata earlier could create it with the
     * broker's default partitions, before capture created it with one */
    if (open_topic(self) < 0)
        return -1;
    for (;;) {
        if (self->failure[0])
            return raise_failure(self);
        if (rd.produce(self->rkt, 0, RD_KAFKA_MSG_F_COPY, (void *)value, value_len, key, key_len, NULL) == 0)
            break;
        int err = rd.last_error();
        if (err != RD_KAFKA_RESP_ERR__QUEUE_FULL) {
            PyErr_Format(self->error, "cannot send to %s: %s", self->topic, rd.err2str(err));
            return -1;
        }
        Py_BEGIN_ALLOW_THREADS
        rd.poll(self->rk, 50);
        Py_END_ALLOW_THREADS
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
    if (++self->sent % POLL_EVERY == 0)
        rd.poll(self->rk, 0);
    return 0;
}

/* How many of the messages from ``at`` on (at most SEND_BATCH) go in one batch: up to the first whose size
 * librdkafka may refuse (0 if it is the first: it goes alone). */
static int batch_count(Sender *self, const Py_ssize_t *offsets, Py_ssize_t n, size_t key_len, Py_ssize_t at) {
    int count = 0;
    while (count < SEND_BATCH && at + count < n &&
           (long long)(offsets[at + count + 1] - offsets[at + count] + key_len) + SIZE_MARGIN <= self->max_bytes)
        count++;
    return count;
}

/* Messages p[offsets[at]:offsets[at + 1]], at < n, each with the one key, from ``at`` on into librdkafka's queue in
 * batches (``rd_kafka_produce_batch``: one clock reading and one partition lookup a batch, not two clock readings,
 * the partitioner and a lookup a message: 0.74 against 0.88 CPU-s for a million pgbench-sized messages into the
 * local broker, bench/RESULTS.md, 2026-11-28). A full queue fails the batch's message there and every one after it
 * (librdkafka keeps the order so), and the rest is sent after a poll. A message near message.max.bytes goes alone
 * (``rd_kafka_produce``): refused, it is the first not taken, and nothing after it is (in a batch librdkafka would
 * take the messages after it). Returns 0 (all sent) or the first refused message's error (``*at`` is that
 * message): QUEUE_FULL, or another, which the caller raises. */
static int produce_from(Sender *self, const char *p, const Py_ssize_t *offsets, Py_ssize_t n, const char *key,
                        size_t key_len, Py_ssize_t *at) {
    rd_kafka_message_t batch[SEND_BATCH];
    while (*at < n && !self->failure[0]) {
        int count = batch_count(self, offsets, n, key_len, *at);
        if (count == 0) {
            if (rd.produce(self->rkt, 0, RD_KAFKA_MSG_F_COPY, (void *)(p + offsets[*at]),
                           offsets[*at + 1] - offsets[*at], key, key_len, NULL) != 0)
                return rd.last_error();
            (*at)++;
            self->sent++;
            rd.poll(self->rk, 0);
            continue;
        }
        for (int j = 0; j < count; j++) {
            Py_ssize_t i = *at + j;
            batch[j] = (rd_kafka_message_t){.payload = (void *)(p + offsets[i]), .len = offsets[i + 1] - offsets[i],
                                            .key = (void *)key, .key_len = key_len};
        }
        int good = rd.produce_batch(self->rkt, 0, RD_KAFKA_MSG_F_COPY, batch, count), taken = 0;
        while (taken < count && !batch[taken].err)
            taken++; /* before the first failure: every message taken */
        *at += taken;
        self->sent += good;
        rd.poll(self->rk, 0);
        if (taken < count)
            return batch[taken].err;
    }
    return 0;
}

/* Messages p[offsets[i]:offsets[i + 1]], i < n, each with the one key, with the GIL released while librdkafka takes
 * them (waiting while its queue is full): the thread a backfill reads in goes on meanwhile. */
int sender_send_all(PyObject *sender, const char *p, const Py_ssize_t *offsets, Py_ssize_t n, const char *key,
                    size_t key_len) {
    Sender *self = (Sender *)sender;
    if (n == 0)
        return 0;
    if (sender_send(sender, p + offsets[0], offsets[1] - offsets[0], key, key_len) < 0)
        return -1; /* the first one as any: the topic handle, a failure so far, a closed sender */
    Py_ssize_t at = 1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while ((err = produce_from(self, p, offsets, n, key, key_len, &at)) == RD_KAFKA_RESP_ERR__QUEUE_FULL)
        rd.poll(self->rk, 50);
    Py_END_ALLOW_THREADS
    if (self->failure[0])
        return raise_failure(self);
    if (err) {
        PyErr_Format(self->error, "cannot send to %s: %s", self->topic, rd.err2str(err));
        return -1;
    }
    return PyErr_CheckSignals();
}

/* ---- the Python type ------------------------------------------------------------------ */

static int configure(rd_kafka_conf_t *conf, PyObject *settings) {
    PyObject *name, *value;
    Py_ssize_t pos = 0;
    char errstr[512];
    while (PyDict_Next(settings, &pos, &name, &value)) {
        if (!PyUnicode_Check(name) || !PyUnicode_Check(value)) {
            PyErr_SetString(PyExc_TypeError, "Sender settings are text: {name: value}");
            return -1;
        }
        const char *n = PyUnicode_AsUTF8(name), *v = PyUnicode_AsUTF8(value);
        if (!n || !v)
            return -1;
        if (rd.conf_set(conf, n, v, errstr, sizeof(errstr)) != RD_KAFKA_CONF_OK) {
            PyErr_Format(PyExc_ValueError, "producer setting %s: %s", n, errstr);
            return -1;
        }
    }
    return 0;
}

static int Sender_init(Sender *self, PyObject *args, PyObject *kwargs) {
    static char *kws[] = {"library", "settings", "topic", "error", "log", NULL};
    const char *library, *topic;
    PyObject *settings, *error, *log;
    char errstr[512];
    if (self->rk) {
        PyErr_SetString(PyExc_RuntimeError, "a Sender is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sO!sOO", kws, &library, &PyDict_Type, &settings, &topic, &error,
                                     &log))
        return -1;
    if (!PyExceptionClass_Check(error) || !PyCallable_Check(log) || strlen(topic) >= sizeof(self->topic)) {
        PyErr_SetString(PyExc_ValueError, "bad Sender arguments: error must be an exception type, log a callable, "
                                          "topic < 256 bytes");
        return -1;
    }
    if (load(library) < 0)
        return -1;
    rd_kafka_conf_t *conf = rd.conf_new();
    if (configure(conf, settings) < 0 ||
        rd.conf_set(conf, "delivery.report.only.error", "true", errstr, sizeof(errstr)) != RD_KAFKA_CONF_OK ||
        rd.conf_set(conf, "log.queue", "true", errstr, sizeof(errstr)) != RD_KAFKA_CONF_OK) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "librdkafka: %s", errstr);
        rd.conf_destroy(conf);
        return -1;
    }
    char max_bytes[32];
    size_t size = sizeof(max_bytes);
    self->max_bytes = rd.conf_get(conf, "message.max.bytes", max_bytes, &size) == RD_KAFKA_CONF_OK
                          ? strtoll(max_bytes, NULL, 10)
                          : 1000000; /* librdkafka's default */
    rd.conf_set_dr_msg_cb(conf, on_delivery);
    rd.conf_set_error_cb(conf, on_error);
    rd.conf_set_log_cb(conf, on_log);
    rd.conf_set_opaque(conf, self);
    if (!(self->rk = rd.create(RD_KAFKA_PRODUCER, conf, errstr, sizeof(errstr)))) {
        rd.conf_destroy(conf);
        PyErr_Format(PyExc_ValueError, "cannot create a producer: %s", errstr);
        return -1;
    }
    rd.set_log_queue(self->rk, NULL); /* lines wait for the next poll, on the sending thread */
    strcpy(self->topic, topic);
    self->error = Py_NewRef(error);
    self->log = Py_NewRef(log);
    return 0;
}

static int closed(Sender *self) {
    if (self->rk)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "the Sender is closed");
    return 1;
}

static PyObject *Sender_send(Sender *self, PyObject *args) {
    Py_buffer value, key;
    if (!PyArg_ParseTuple(args, "y*y*", &value, &key))
        return NULL;
    int rc = sender_send((PyObject *)self, value.buf, value.len, key.buf, key.len);
    PyBuffer_Release(&value);
    PyBuffer_Release(&key);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A timeout argument in seconds, as librdkafka's milliseconds; -1 with an exception set (or closed). */
static int timeout_ms(Sender *self, PyObject *arg) {
    double timeout = PyFloat_AsDouble(arg);
    if ((timeout == -1.0 && PyErr_Occurred()) || closed(self))
        return -1;
    if (timeout < 0 || timeout > 86400) {
        PyErr_SetString(PyExc_ValueError, "timeout: 0 to 86400 seconds");
        return -1;
    }
    return (int)(timeout * 1000);
}

static PyObject *Sender_flush(Sender *self, PyObject *arg) {
    int ms = timeout_ms(self, arg);
    if (ms < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rd.flush(self->rk, ms);
    rd.poll(self->rk, 0);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rd.outq_len(self->rk));
}

static PyObject *Sender_poll(Sender *self, PyObject *arg) {
    int ms = timeout_ms(self, arg);
    if (ms < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rd.poll(self->rk, ms);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void destroy(Sender *self) {
    if (!self->rk)
        return;
    rd_kafka_t *rk = self->rk;
    rd_kafka_topic_t *rkt = self->rkt;
    self->rk = NULL;
    self->rkt = NULL;
    Py_BEGIN_ALLOW_THREADS
    if (rkt)
        rd.topic_destroy(rkt);
    rd.destroy(rk);
    Py_END_ALLOW_THREADS
}

static PyObject *Sender_open(Sender *self, PyObject *Py_UNUSED(ignored)) {
    if (open_topic(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Sender_close(Sender *self, PyObject *Py_UNUSED(ignored)) {
    destroy(self);
    Py_RETURN_NONE;
}

static PyObject *Sender_failure(Sender *self, void *Py_UNUSED(closure)) {
    if (!self->failure[0])
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(self->failure, strlen(self->failure), "replace");
}

static Py_ssize_t Sender_len(Sender *self) {
    return self->rk ? rd.outq_len(self->rk) : 0;
}

static void Sender_dealloc(Sender *self) {
    destroy(self);
    Py_XDECREF(self->error);
    Py_XDECREF(self->log);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Sender_methods[] = {
    {"send", (PyCFunction)Sender_send, METH_VARARGS, "send(value, key): one message into the local queue"},
    {"flush", (PyCFunction)Sender_flush, METH_O, "flush(timeout) -> messages not yet acknowledged (or failed)"},
    {"poll", (PyCFunction)Sender_poll, METH_O, "poll(timeout): serve librdkafka's events (failures)"},
    {"open", (PyCFunction)Sender_open, METH_NOARGS,
     "open(): look the topic up now, not at the first send (only once capture made sure it exists)"},
    {"close", (PyCFunction)Sender_close, METH_NOARGS, "close(): destroy the producer (unsent messages are lost)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Sender_getset[] = {
    {"failure", (getter)Sender_failure, NULL, "the first failed delivery or fatal error, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef Sender_members[] = {
    {"sent", T_LONGLONG, offsetof(Sender, sent), READONLY, "messages queued so far"},
    {"errors", T_LONGLONG, offsetof(Sender, errors), READONLY, "failed deliveries so far"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods Sender_sequence = {.sq_length = (lenfunc)Sender_len};

PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "capture._copier.Sender",
    .tp_basicsize = sizeof(Sender),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sender(library, settings, topic, error, log): a librdkafka producer driven from C (see _sender.c)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sender_init,
    .tp_dealloc = (destructor)Sender_dealloc,
    .tp_methods = Sender_methods,
    .tp_members = Sender_members,
    .tp_getset = Sender_getset,
    .tp_as_sequence = &Sender_sequence,
};
