/* nccltree._small: the small collectives of a process group within one node, in one call.
 *
 * A process group whose processes share one node (one rank each, host arrays) runs its
 * small calls here: this process's input is copied into its payload slot in the node's
 * control segment, the call's signature text into its call descriptor (the same
 * descriptor the schedule engine publishes, so a call here and a call of the engine meet
 * at the same arrival), then it arrives (its arrival counter, the wait primitive of the
 * host library); once every other process arrived, every signature is compared with its
 * own, and the result is computed here from the payload slots, with the host library's
 * own reduce kernel, sources in rank order: bitwise the result of the direct plan.
 *
 * Why no second phase: the payload slots and descriptors alternate by call parity. A
 * process may write slot (seq & 1) again only at call seq + 2, which it reaches only
 * after every process arrived at seq + 1, i.e. finished reading call seq.
 *
 * The waits: a short spin (only where the node's processes each have a core), then
 * sched_yield (the node is oversubscribed or the peer is slow), then the futex of the
 * counter in slices of a millisecond, the abort word checked between slices. A wait
 * longer than its budget goes back to Python (the group's bounded wait, which checks
 * the node's processes are alive), then resumes here.
 *
 * The library's kernels are called through the addresses Python hands over (the host
 * library loaded through ctypes), so this module does not link to it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAX_PROCS 8   /* NT_MAX_SOURCES: one reduce pass over every process's slot */
#define NENTRIES 64   /* the cache of call signatures (direct-mapped) */
#define SIG_MAX 512   /* SIG_BYTES of node_memory.py */
#define SHARED 1      /* NT_COUNTER_SHARED */
#define NT_TIMEOUT 10 /* nt_counter_wait's status */
#define NT_SUM 0

enum { C_ALL_REDUCE = 0, C_BROADCAST = 1, C_ALL_GATHER = 2, C_REDUCE = 3, C_AGREE = 4 };
enum { OP_SUM = 0, OP_PROD = 1, OP_MAX = 2, OP_MIN = 3, OP_MEAN = 4, NOPS = 5 };

typedef int (*reduce_n_fn)(int, int, void *, const void *const *, int, int64_t, int);
typedef int (*reduce_n_scaled_fn)(int, int, void *, const void *const *, int, int64_t, double,
                                  int);
typedef int (*wait_fn)(uint32_t *, uint32_t, int64_t, int64_t, int);
typedef int (*add_fn)(uint32_t *, uint32_t, int, uint32_t *);

typedef struct {
    int used;
    int coll, dtype, op, root;
    int64_t count, itemsize;
    int64_t siglen;
    char sig[SIG_MAX];
} entry;

typedef struct {
    PyObject_HEAD
    int n, me;
    uint32_t *arrive[MAX_PROCS];
    char *desc[MAX_PROCS][2];
    char *data[MAX_PROCS][2];
    int64_t cap;
    _Atomic int64_t *abort_word;
    reduce_n_fn reduce_n;
    reduce_n_scaled_fn reduce_n_scaled;
    wait_fn wait;
    add_fn add;
    PyObject *desc_written; /* the engine's cache of what its descriptors hold */
    PyObject *ndarray;      /* numpy.ndarray */
    PyObject *slow_wait;    /* slow_wait(rank, seq): the group's bounded wait */
    PyObject *mismatch;     /* mismatch(parity): raises the ValueError */
    int64_t spin_ns, yield_ns, budget_ns;
    int oversubscribed;
    /* the breakdown of the last call (ns): entry, exchange (copy in + publish), wait,
       result */
    int64_t t[4];
    int timing;
    entry entries[NENTRIES];
} Path;

static PyObject *op_names[NOPS];

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int reached(uint32_t value, uint32_t target) {
    return (int32_t)(value - target) >= 0;
}

static inline uint32_t load32(uint32_t *p) {
    return atomic_load_explicit((_Atomic uint32_t *)p, memory_order_acquire);
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* dtype code (the host library's) of a buffer format; -1 when not taken here */
static int dtype_of(const char *fmt, Py_ssize_t itemsize) {
    if (fmt == NULL || fmt[0] == 0) return -1;
    if (fmt[0] == '=' || fmt[0] == '@') fmt++;
#if PY_LITTLE_ENDIAN
    if (fmt[0] == '<') fmt++;
#endif
    if (fmt[0] == 0 || fmt[1] != 0) return -1;
    switch (fmt[0]) {
    case 'e': return itemsize == 2 ? 0 : -1;
    case 'f': return itemsize == 4 ? 1 : -1;
    case 'd': return itemsize == 8 ? 2 : -1;
    case 'i':
    case 'l':
    case 'q':
        return itemsize == 4 ? 3 : itemsize == 8 ? 4 : -1;
    case 'b': return itemsize == 1 ? 6 : -1;
    case 'B': return itemsize == 1 ? 7 : -1;
    default: return -1;
    }
}

static int op_of(PyObject *op) {
    for (int i = 0; i < NOPS; i++)
        if (op == op_names[i]) return i;
    if (!PyUnicode_Check(op)) return -1;
    for (int i = 0; i < NOPS; i++) {
        int eq = PyUnicode_Compare(op, op_names[i]);
        if (eq == 0) return i;
        if (eq == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
    }
    return -1;
}

static inline unsigned slot_of(int coll, int dtype, int64_t count, int op, int root) {
    uint64_t h = (uint64_t)count * 0x9E3779B97F4A7C15ull;
    h ^= (uint64_t)(coll * 131 + dtype * 17 + op * 5 + root * 7919);
    h ^= h >> 29;
    return (unsigned)(h % NENTRIES);
}

static entry *find(Path *s, int coll, int dtype, int64_t count, int op, int root) {
    entry *e = &s->entries[slot_of(coll, dtype, count, op, root)];
    if (e->used && e->coll == coll && e->dtype == dtype && e->count == count && e->op == op &&
        e->root == root)
        return e;
    return NULL;
}

/* Wait until process r arrived at seq: 0, or -1 with a Python exception set. */
static int wait_arrival(Path *s, int r, uint32_t seq) {
    uint32_t *c = s->arrive[r];
    if (reached(load32(c), seq)) return 0;
    int64_t start = now_ns();
    if (!s->oversubscribed) {
        int64_t end = start + s->spin_ns;
        for (unsigned i = 1;; ++i) {
            if (reached(load32(c), seq)) return 0;
            relax();
            if ((i & 63u) == 0 && now_ns() >= end) break;
        }
    }
    int64_t yield_end = start + s->yield_ns;
    while (now_ns() < yield_end) {
        for (int i = 0; i < 16; i++) {
            if (reached(load32(c), seq)) return 0;
            sched_yield();
        }
    }
    int64_t budget_end = start + s->budget_ns;
    int done = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        if (s->wait(c, seq, 1000000, 0, SHARED) == 0) {
            done = 1;
            break;
        }
        if (atomic_load_explicit(s->abort_word, memory_order_acquire) != 0) break;
        if (now_ns() >= budget_end) break;
    }
    Py_END_ALLOW_THREADS
    if (done) return 0;
    /* the group's own wait: bounded, it names a dead or absent process */
    PyObject *got = PyObject_CallFunction(s->slow_wait, "iI", r, seq);
    if (got == NULL) return -1;
    Py_DECREF(got);
    return 0;
}

/* One call of entry e: in (this process's input), out (its output, may be in). 0, or -1
   with a Python exception set. */
static int perform(Path *s, const entry *e, const char *in, char *out) {
    int n = s->n, me = s->me;
    int64_t t0 = s->timing ? now_ns() : 0;
    uint32_t seq = load32(s->arrive[me]) + 1;
    int par = (int)(seq & 1u);
    int64_t nbytes = e->count * e->itemsize;
    int sends = e->coll != C_AGREE && (e->coll != C_BROADCAST || me == e->root);
    if (sends && nbytes) memcpy(s->data[me][par], in, (size_t)nbytes);
    char *d = s->desc[me][par];
    int64_t len = e->siglen, seq64 = (int64_t)seq;
    memcpy(d + 8, &len, 8);
    memcpy(d + 16, e->sig, (size_t)len);
    memcpy(d, &seq64, 8);
    /* the engine rewrites its signature at its next call */
    if (PyList_GET_ITEM(s->desc_written, 0) != Py_None) {
        Py_INCREF(Py_None);
        PyList_SetItem(s->desc_written, 0, Py_None);
    }
    if (PyList_GET_ITEM(s->desc_written, 1) != Py_None) {
        Py_INCREF(Py_None);
        PyList_SetItem(s->desc_written, 1, Py_None);
    }
    s->add(s->arrive[me], 1, SHARED, NULL);
    int64_t t1 = s->timing ? now_ns() : 0;
    for (int k = 1; k < n; k++) {
        int r = (me + k) % n;
        if (wait_arrival(s, r, seq) != 0) return -1;
    }
    int64_t t2 = s->timing ? now_ns() : 0;
    for (int r = 0; r < n; r++) {
        if (r == me) continue;
        const char *pd = s->desc[r][par];
        int64_t plen;
        memcpy(&plen, pd + 8, 8);
        if (plen != len || memcmp(pd + 16, e->sig, (size_t)len) != 0) {
            PyObject *got = PyObject_CallFunction(s->mismatch, "i", par);
            Py_XDECREF(got);
            if (got != NULL) PyErr_SetString(PyExc_RuntimeError, "signature mismatch not raised");
            return -1;
        }
    }
    int status = 0;
    if (e->coll == C_ALL_REDUCE || (e->coll == C_REDUCE && me == e->root)) {
        const void *srcs[MAX_PROCS];
        for (int r = 0; r < n; r++) srcs[r] = s->data[r][par];
        if (e->op == OP_MEAN)
            status = s->reduce_n_scaled(NT_SUM, e->dtype, out, srcs, n, e->count, 1.0 / n, 1);
        else
            status = s->reduce_n(e->op, e->dtype, out, srcs, n, e->count, 1);
    } else if (e->coll == C_BROADCAST) {
        if (me != e->root) memcpy(out, s->data[e->root][par], (size_t)nbytes);
        else if (out != in) memmove(out, in, (size_t)nbytes);
    } else if (e->coll == C_ALL_GATHER) {
        for (int r = 0; r < n; r++)
            if (r != me) memcpy(out + r * nbytes, s->data[r][par], (size_t)nbytes);
        if (out + me * nbytes != in) memmove(out + me * nbytes, in, (size_t)nbytes);
    }
    if (status != 0) {
        PyErr_Format(PyExc_RuntimeError, "small collective: native kernel status %d", status);
        return -1;
    }
    if (s->timing) {
        int64_t t3 = now_ns();
        s->t[1] = t1 - t0;
        s->t[2] = t2 - t1;
        s->t[3] = t3 - t2;
    }
    return 0;
}

/* ---- the type ---- */

static void path_dealloc(Path *s) {
    Py_XDECREF(s->desc_written);
    Py_XDECREF(s->ndarray);
    Py_XDECREF(s->slow_wait);
    Py_XDECREF(s->mismatch);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int read_addrs(PyObject *seq, int n, uintptr_t *out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d addresses", what, n);
        Py_DECREF(fast);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        out[i] = (uintptr_t)PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* Path(me, arrive, desc, data, cap, abort, kernels, desc_written, ndarray, slow_wait,
        mismatch, oversubscribed, spin_ns, yield_ns, budget_ns)
   arrive: n addresses (rank order); desc, data: 2n addresses (rank r's parity p at 2r+p);
   kernels: addresses of nt_reduce_n, nt_reduce_n_scaled, nt_counter_wait,
   nt_counter_add_wake. */
static PyObject *path_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    int me, over;
    long long cap, spin, yld, budget;
    unsigned long long abort_addr;
    PyObject *arrive, *desc, *data, *kernels, *written, *nd, *slow, *mis;
    if (kw != NULL && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "Path takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "iOOOLKOOOOOpLLL", &me, &arrive, &desc, &data, &cap,
                          &abort_addr, &kernels, &written, &nd, &slow, &mis, &over, &spin,
                          &yld, &budget))
        return NULL;
    Py_ssize_t n = PySequence_Size(arrive);
    if (n < 2 || n > MAX_PROCS || me < 0 || me >= n) {
        PyErr_Format(PyExc_ValueError, "Path: 2 to %d processes, got %zd (this one %d)",
                     MAX_PROCS, n, me);
        return NULL;
    }
    if (!PyList_Check(written) || PyList_GET_SIZE(written) != 2) {
        PyErr_SetString(PyExc_TypeError, "Path: desc_written must be a list of two");
        return NULL;
    }
    Path *s = (Path *)type->tp_alloc(type, 0);
    if (s == NULL) return NULL;
    s->n = (int)n;
    s->me = me;
    uintptr_t a[2 * MAX_PROCS], k[4];
    if (read_addrs(arrive, s->n, a, "arrive") < 0) goto fail;
    for (int r = 0; r < s->n; r++) s->arrive[r] = (uint32_t *)a[r];
    if (read_addrs(desc, 2 * s->n, a, "desc") < 0) goto fail;
    for (int r = 0; r < s->n; r++)
        for (int p = 0; p < 2; p++) s->desc[r][p] = (char *)a[2 * r + p];
    if (read_addrs(data, 2 * s->n, a, "data") < 0) goto fail;
    for (int r = 0; r < s->n; r++)
        for (int p = 0; p < 2; p++) s->data[r][p] = (char *)a[2 * r + p];
    if (read_addrs(kernels, 4, k, "kernels") < 0) goto fail;
    s->reduce_n = (reduce_n_fn)k[0];
    s->reduce_n_scaled = (reduce_n_scaled_fn)k[1];
    s->wait = (wait_fn)k[2];
    s->add = (add_fn)k[3];
    s->cap = cap;
    s->abort_word = (_Atomic int64_t *)(uintptr_t)abort_addr;
    Py_INCREF(written);
    s->desc_written = written;
    Py_INCREF(nd);
    s->ndarray = nd;
    Py_INCREF(slow);
    s->slow_wait = slow;
    Py_INCREF(mis);
    s->mismatch = mis;
    s->oversubscribed = over;
    s->spin_ns = spin;
    s->yield_ns = yld;
    s->budget_ns = budget;
    return (PyObject *)s;
fail:
    Py_DECREF(s);
    return NULL;
}

/* learn(coll, dtype, count, op, root, itemsize, sig) -> slot: a call signature the
   Python side checked (a prepared call); the fast entries find it by its key. */
static PyObject *path_learn(Path *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "learn takes 7 arguments");
        return NULL;
    }
    long v[6];
    for (int i = 0; i < 6; i++) {
        v[i] = PyLong_AsLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return NULL;
    }
    char *sig;
    Py_ssize_t len;
    if (PyBytes_AsStringAndSize(args[6], &sig, &len) < 0) return NULL;
    if (len > SIG_MAX || v[2] < 0 || v[5] < 0 || v[2] * v[5] > s->cap || v[1] < 0 ||
        v[3] < 0 || v[3] >= NOPS || v[0] < 0 || v[0] > C_AGREE) {
        PyErr_SetString(PyExc_ValueError, "learn: a call this path cannot take");
        return NULL;
    }
    unsigned i = slot_of((int)v[0], (int)v[1], v[2], (int)v[3], (int)v[4]);
    entry *e = &s->entries[i];
    e->used = 1;
    e->coll = (int)v[0];
    e->dtype = (int)v[1];
    e->count = v[2];
    e->op = (int)v[3];
    e->root = (int)v[4];
    e->itemsize = v[5];
    e->siglen = len;
    memcpy(e->sig, sig, (size_t)len);
    return PyLong_FromUnsignedLong(i);
}

static int get_buf(Path *s, PyObject *x, Py_buffer *b, int writable) {
    if ((PyObject *)Py_TYPE(x) != s->ndarray) return -1;
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(x, b, flags) < 0) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* run(slot, x, out) -> None: the call of a learnt signature on prepared arrays (x: this
   rank's input, out: its output; both contiguous of the signature's dtype, checked by
   the caller). */
static PyObject *path_run(Path *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "run takes 3 arguments");
        return NULL;
    }
    long i = PyLong_AsLong(args[0]);
    if (i < 0 || i >= NENTRIES || !s->entries[i].used) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "run: no such signature");
        return NULL;
    }
    entry *e = &s->entries[i];
    Py_buffer bi, bo;
    int same = args[1] == args[2];
    if (e->coll == C_AGREE) {
        if (perform(s, e, NULL, NULL) < 0) return NULL;
        Py_RETURN_NONE;
    }
    if (PyObject_GetBuffer(args[1], &bi, PyBUF_C_CONTIGUOUS | (same ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    if (!same && PyObject_GetBuffer(args[2], &bo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&bi);
        return NULL;
    }
    int64_t nbytes = e->count * e->itemsize;
    int64_t want_out = e->coll == C_ALL_GATHER ? nbytes * s->n : nbytes;
    Py_ssize_t olen = same ? bi.len : bo.len;
    int rc;
    if (bi.len != nbytes || (olen != want_out && (e->coll != C_REDUCE || s->me == e->root))) {
        PyErr_SetString(PyExc_ValueError, "run: buffers of the wrong size");
        rc = -1;
    } else {
        rc = perform(s, e, bi.buf, same ? bi.buf : bo.buf);
    }
    if (!same) PyBuffer_Release(&bo);
    PyBuffer_Release(&bi);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* One fast call of collective coll: the result (out, or x when out is None), None where
   this path does not take the call as it stands (an unknown signature, or arrays not
   plain, contiguous numpy arrays of a dtype taken here, an output of another size or
   overlapping the input): the caller then takes the general path, which checks
   everything and comes back through run() for the signatures this path takes. */
static PyObject *fast_call(Path *s, int coll, PyObject *x, PyObject *out, PyObject *opobj,
                           long root) {
    int64_t t0 = s->timing ? now_ns() : 0;
    int inplace = out == Py_None || out == x;
    if (coll == C_ALL_GATHER && inplace) Py_RETURN_NONE; /* its output is required */
    int op = op_of(opobj);
    if (op < 0 || root < 0 || root >= s->n) Py_RETURN_NONE;
    /* the input is written in place by all_reduce, a broadcast's non-roots, a reduce's root */
    int writes_x = inplace && (coll == C_ALL_REDUCE || (coll == C_BROADCAST && s->me != root) ||
                               (coll == C_REDUCE && s->me == root));
    Py_buffer bi, bo;
    if (get_buf(s, x, &bi, writes_x) < 0) Py_RETURN_NONE;
    int dt = dtype_of(bi.format, bi.itemsize);
    entry *e = dt < 0 ? NULL : find(s, coll, dt, bi.len / bi.itemsize, op, (int)root);
    if (e == NULL) {
        PyBuffer_Release(&bi);
        Py_RETURN_NONE;
    }
    char *dst = bi.buf;
    if (!inplace) {
        if (get_buf(s, out, &bo, 1) < 0) {
            PyBuffer_Release(&bi);
            Py_RETURN_NONE;
        }
        char *a = bi.buf, *b = bo.buf;
        Py_ssize_t want = coll == C_ALL_GATHER ? bi.len * s->n : bi.len;
        int overlap = a < b + bo.len && b < a + bi.len;
        /* all_gather in place: the input is this rank's block of the output */
        int own_block = coll == C_ALL_GATHER && a == b + s->me * bi.len;
        if (bo.len != want || dtype_of(bo.format, bo.itemsize) != dt || (overlap && !own_block)) {
            PyBuffer_Release(&bo);
            PyBuffer_Release(&bi);
            Py_RETURN_NONE;
        }
        dst = bo.buf;
    }
    if (s->timing) s->t[0] = now_ns() - t0;
    int rc = perform(s, e, bi.buf, dst);
    if (!inplace) PyBuffer_Release(&bo);
    PyBuffer_Release(&bi);
    if (rc < 0) return NULL;
    PyObject *res = inplace ? x : out;
    Py_INCREF(res);
    return res;
}

/* all_reduce(x, out, op): fast_call of an all_reduce */
static PyObject *path_all_reduce(Path *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "all_reduce takes 3 arguments");
        return NULL;
    }
    return fast_call(s, C_ALL_REDUCE, args[0], args[1], args[2], 0);
}

/* fast(coll, x, out, op, root): fast_call of any collective this path takes */
static PyObject *path_fast(Path *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "fast takes 5 arguments");
        return NULL;
    }
    long coll = PyLong_AsLong(args[0]);
    if (coll < 0 || coll >= C_AGREE) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "fast: no such collective");
        return NULL;
    }
    if (!PyLong_CheckExact(args[4])) Py_RETURN_NONE;
    long root = PyLong_AsLong(args[4]);
    if (root == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return fast_call(s, (int)coll, args[1], args[2], args[3], root);
}

/* timing(on) -> (entry, exchange, wait, result) of the last call, in ns (when on) */
static PyObject *path_timing(Path *s, PyObject *on) {
    int v = PyObject_IsTrue(on);
    if (v < 0) return NULL;
    s->timing = v;
    return Py_BuildValue("(LLLL)", (long long)s->t[0], (long long)s->t[1], (long long)s->t[2],
                         (long long)s->t[3]);
}

static PyMethodDef path_methods[] = {
    {"learn", (PyCFunction)(void (*)(void))path_learn, METH_FASTCALL,
     "learn(coll, dtype, count, op, root, itemsize, sig) -> slot"},
    {"run", (PyCFunction)(void (*)(void))path_run, METH_FASTCALL,
     "run(slot, x, out): one call of a learnt signature"},
    {"all_reduce", (PyCFunction)(void (*)(void))path_all_reduce, METH_FASTCALL,
     "all_reduce(x, out, op) -> result, or None where the general path takes it"},
    {"fast", (PyCFunction)(void (*)(void))path_fast, METH_FASTCALL,
     "fast(coll, x, out, op, root) -> result, or None where the general path takes it"},
    {"timing", (PyCFunction)path_timing, METH_O,
     "timing(on) -> the last call's (entry, exchange, wait, result) in ns"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject PathType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nccltree._small.Path",
    .tp_basicsize = sizeof(Path),
    .tp_dealloc = (destructor)path_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The small collectives of one process group within a node.",
    .tp_methods = path_methods,
    .tp_new = path_new,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_small",
                                    "Small collectives of a process group within a node.",
                                    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__small(void) {
    const char *names[NOPS] = {"sum", "prod", "max", "min", "mean"};
    for (int i = 0; i < NOPS; i++) {
        op_names[i] = PyUnicode_InternFromString(names[i]);
        if (op_names[i] == NULL) return NULL;
    }
    if (PyType_Ready(&PathType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PathType);
    if (PyModule_AddObject(m, "Path", (PyObject *)&PathType) < 0) {
        Py_DECREF(&PathType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "ALL_REDUCE", C_ALL_REDUCE);
    PyModule_AddIntConstant(m, "BROADCAST", C_BROADCAST);
    PyModule_AddIntConstant(m, "ALL_GATHER", C_ALL_GATHER);
    PyModule_AddIntConstant(m, "REDUCE", C_REDUCE);
    PyModule_AddIntConstant(m, "AGREE", C_AGREE);
    PyModule_AddIntConstant(m, "MAX_PROCS", MAX_PROCS);
    return m;
}
