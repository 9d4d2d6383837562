/* capture._copier.Sender, as the Copier sees it (see _sender.c). */
#ifndef HEADWATER_SENDER_H
#define HEADWATER_SENDER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyTypeObject SenderType;

/* Copy one message into the sender's local queue, waiting while it is full; -1 with an exception set. */
int sender_send(PyObject *sender, const char *value, size_t value_len, const char *key, size_t key_len);

/* Messages p[offsets[i]:offsets[i + 1]] (i < n) with one key, the GIL released while librdkafka takes them. */
int sender_send_all(PyObject *sender, const char *p, const Py_ssize_t *offsets, Py_ssize_t n, const char *key,
                    size_t key_len);

#endif
