/* nccltree._records: assemble a batch from many small LMDB values in one call.
 *
 * The reader thread hands a list of memoryviews (LMDB values in the nccltree record
 * format, see nccltree/data/format.py) to gather(), which checks every
 * header against the database's, copies the payloads back to back into the batch and the
 * labels into the label array. Per record that is a buffer look-up and two memcpy calls
 * instead of the Python-level work of a join plus a vectorised check, which matters for
 * records of a few KB, where per-record overhead is most of the cost.
 *
 * The interpreter lock is held for small batches: handing it to another thread and
 * taking it back costs more than copying a few hundred KB. Large batches are copied with
 * the lock released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* Copies at least this large run with the interpreter lock released. */
#define RELEASE_GIL_BYTES ((Py_ssize_t)1 << 20)
#define LABEL_BYTES 8

static int64_t load_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int b = LABEL_BYTES - 1; b >= 0; b--)
        v = (v << 8) | p[b];
    return (int64_t)v;
}

/* Check and copy records [0, n); returns the index of the first bad record, or -1. */
static Py_ssize_t copy_records(const Py_buffer *views, Py_ssize_t n, const Py_buffer *header,
                               Py_ssize_t label_offset, Py_ssize_t record_size,
                               unsigned char *payload, unsigned char *labels)
{
    const unsigned char *hdr = header->buf;
    Py_ssize_t hsize = header->len;
    Py_ssize_t psize = record_size - hsize;
    Py_ssize_t after = label_offset + LABEL_BYTES;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *v = views[i].buf;
        if (views[i].len != record_size || memcmp(v, hdr, (size_t)label_offset) != 0 ||
            memcmp(v + after, hdr + after, (size_t)(hsize - after)) != 0)
            return i;
        int64_t label = load_le64(v + label_offset);
        memcpy(labels + i * LABEL_BYTES, &label, LABEL_BYTES); /* any alignment */
        memcpy(payload + i * psize, v + hsize, (size_t)psize);
    }
    return -1;
}

static void release_all(Py_buffer *views, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
}

PyDoc_STRVAR(gather_doc,
"gather(values, header, label_offset, payload, labels) -> int\n\n"
"Check and copy nccltree records. ``values``: a sequence of n buffers, each\n"
"len(header) + payload_size bytes. Every byte of a value's header must equal ``header``\n"
"except the 8-byte little-endian label at ``label_offset``. The payloads go back to back\n"
"into ``payload`` (a writable C-contiguous buffer of exactly n * payload_size bytes) and\n"
"the labels into ``labels`` (a writable C-contiguous int64 buffer of at least n items).\n"
"Returns -1, or the index of the first record whose size or header differs (the\n"
"buffers are then partly written).");

static PyObject *gather(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *values, *seq;
    Py_buffer header, payload, labels;
    Py_ssize_t label_offset;
    if (!PyArg_ParseTuple(args, "Oy*nw*w*", &values, &header, &label_offset, &payload, &labels))
        return NULL;
    PyObject *result = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t held = 0, n = 0;

    seq = PySequence_Fast(values, "values must be a sequence of buffers");
    if (seq == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(seq);
    if (label_offset < 0 || label_offset + LABEL_BYTES > header.len) {
        PyErr_Format(PyExc_ValueError, "label_offset %zd does not fit a %zd-byte header",
                     label_offset, header.len);
        goto done;
    }
    if (n == 0 || payload.len % n != 0) {
        if (n == 0 && payload.len == 0) {
            result = PyLong_FromSsize_t(-1);
        } else {
            PyErr_Format(PyExc_ValueError, "payload has %zd bytes, not a multiple of %zd records",
                         payload.len, n);
        }
        goto done;
    }
    if (labels.len < n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "labels must hold at least %zd int64 items", n);
        goto done;
    }
    if (!PyBuffer_IsContiguous(&payload, 'C') || !PyBuffer_IsContiguous(&labels, 'C')) {
        PyErr_SetString(PyExc_ValueError, "payload and labels must be C-contiguous");
        goto done;
    }
    views = PyMem_Malloc((size_t)n * sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (; held < n; held++) {
        if (PyObject_GetBuffer(items[held], &views[held], PyBUF_SIMPLE) != 0)
            goto done;
    }
    Py_ssize_t record_size = header.len + payload.len / n;
    Py_ssize_t bad;
    if (payload.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        bad = copy_records(views, n, &header, label_offset, record_size, payload.buf, labels.buf);
        Py_END_ALLOW_THREADS
    } else {
        bad = copy_records(views, n, &header, label_offset, record_size, payload.buf, labels.buf);
    }
    result = PyLong_FromSsize_t(bad);
done:
    if (views != NULL) {
        release_all(views, held);
        PyMem_Free(views);
    }
    Py_XDECREF(seq);
    PyBuffer_Release(&header);
    PyBuffer_Release(&payload);
    PyBuffer_Release(&labels);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, gather_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "nccltree._records",
    "Batch assembly of small nccltree records (see nccltree/data/decode.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__records(void)
{
    return PyModule_Create(&module);
}
