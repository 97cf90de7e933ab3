/* native's small all-reduce straight into the MPI library, and rhd's exchange of two ranks (built on first use by
 * mpcomm/native_calls.py against the MPI library mpi4py loaded, imported as mpcomm._native_calls).
 *
 * A small all-reduce costs little more than its Python calls: mpi4py's request, its Tests, the copies in and out of
 * a persistent request's buffer and the NaN pass are each a call. Here they are one. The deadline stays Python's: a
 * request not done after `tests` MPI_Test calls goes back to the transport's wait (deadline, yields, point-to-point
 * progress), as every collective's does; except under the watchdog (below), which keeps it for a blocking call.
 *
 * The buffer's format (the buffer protocol's) gives the MPI datatype; floats (and complex parts) that hold a NaN
 * after the reduction get numpy's NaN, so every rank holds the same bits (algorithms/native.py says why); an
 * average's sum is divided in the same call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <structmember.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h> /* (the array's fields only: no numpy C API is called) */

#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum { NOT_FLOAT = 0, FLOAT32 = 1, FLOAT64 = 2 };

/* The MPI datatype of one element of `view`, and whether (and how) its values are floats; MPI_DATATYPE_NULL for a
 * format this does not take (the caller takes the general path). */
static MPI_Datatype datatype_of(const Py_buffer *view, int *floats, Py_ssize_t *parts) {
    const char *format = view->format ? view->format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    *floats = NOT_FLOAT;
    *parts = 1;
    if (format[0] == 'Z' && (format[1] == 'f' || format[1] == 'd') && !format[2]) { /* complex: two floats each */
        *parts = 2;
        *floats = format[1] == 'f' ? FLOAT32 : FLOAT64;
        return format[1] == 'f' ? MPI_C_FLOAT_COMPLEX : MPI_C_DOUBLE_COMPLEX;
    }
    if (format[1]) return MPI_DATATYPE_NULL;
    switch (format[0]) {
        case 'f': *floats = FLOAT32; return MPI_FLOAT;
        case 'd': *floats = FLOAT64; return MPI_DOUBLE;
        case 'b': return MPI_INT8_T;
        case 'B': return MPI_UINT8_T;
        case 'h': return MPI_INT16_T;
        case 'H': return MPI_UINT16_T;
        case 'i': return MPI_INT32_T;
        case 'I': return MPI_UINT32_T;
        case 'l': case 'q': return view->itemsize == 8 ? MPI_INT64_T : MPI_DATATYPE_NULL;
        case 'L': case 'Q': return view->itemsize == 8 ? MPI_UINT64_T : MPI_DATATYPE_NULL;
        default: return MPI_DATATYPE_NULL;
    }
}

static void canonical_nans(void *data, Py_ssize_t count, int floats) {
    if (floats == FLOAT32) {
        float *values = data;
        for (Py_ssize_t i = 0; i < count; i++)
            if (isnan(values[i])) values[i] = NAN;
    } else if (floats == FLOAT64) {
        double *values = data;
        for (Py_ssize_t i = 0; i < count; i++)
            if (isnan(values[i])) values[i] = (double)NAN;
    }
}

/* values[i] / d, as numpy divides (one rounding), with numpy's NaN wherever that is a NaN, in one pass; by 1 / d
 * where d is a power of two: the same bits (both are that real number, correctly rounded; as ReduceOp.finish and
 * mpcomm.kernels' finish do), and a multiply costs a third of a division. */
#define DIVIDED(NAME, T, CANONICAL)                                                                              \
    static void NAME(T *values, Py_ssize_t count, long d) {                                                      \
        if ((d & (d - 1)) == 0) {                                                                                \
            const T factor = (T)(1.0 / (double)d);                                                               \
            for (Py_ssize_t i = 0; i < count; i++) {                                                             \
                T r = values[i] * factor;                                                                        \
                values[i] = r == r ? r : CANONICAL;                                                              \
            }                                                                                                    \
        } else {                                                                                                 \
            const T divisor = (T)d;                                                                              \
            for (Py_ssize_t i = 0; i < count; i++) {                                                             \
                T r = values[i] / divisor;                                                                       \
                values[i] = r == r ? r : CANONICAL;                                                              \
            }                                                                                                    \
        }                                                                                                        \
    }
DIVIDED(divided32, float, NAN)
DIVIDED(divided64, double, (double)NAN)

/* What a finished all-reduce of `count` elements still needs, by `finish`: 0 nothing; 1 numpy's NaN wherever a
 * float holds a NaN; d > 1 (real floats only) each value divided by d first (divided32/64). */
static void finished(void *data, Py_ssize_t count, int floats, long finish) {
    if (finish > 1 && floats == FLOAT32)
        divided32(data, count, finish);
    else if (finish > 1 && floats == FLOAT64)
        divided64(data, count, finish);
    else if (finish)
        canonical_nans(data, count, floats);
}

static PyObject *mpi_exception; /* mpi4py's MPI.Exception (configure()), raised with an MPI error code */

static PyObject *failed(int code) {
    PyObject *value = PyLong_FromLong(code);
    if (value) {
        PyErr_SetObject(mpi_exception ? mpi_exception : PyExc_RuntimeError, value);
        Py_DECREF(value);
    }
    return NULL;
}

/* ---- The reductions of floats that MPI's own ops do not do as mpcomm's contract asks, as MPI ops: the library
 * applies them inside its own algorithm, so no pass of mpcomm's own is left over the result (the NaN check after a
 * sum or product) or over the input and the result (min/max's keys). Each writes numpy's NaN wherever the result is
 * a NaN: the NaN's sign and payload would otherwise depend on the operand order, which differs between ranks.
 * min/max order the floats as mpcomm.kernels' keys do (-0.0 below +0.0, a NaN wins). The caller gives them
 * float32/float64 only (sum: complex64/complex128 too). (MPI's convention: inout[i] = in[i] op inout[i].) */
#define ARITHMETIC_OP(name, T, canonical, symbol)                                                               \
    static void name(const T *in, T *inout, Py_ssize_t n) {                                                      \
        for (Py_ssize_t i = 0; i < n; i++) {                                                                     \
            T r = in[i] symbol inout[i];                                                                         \
            inout[i] = r == r ? r : canonical;                                                                   \
        }                                                                                                        \
    }
ARITHMETIC_OP(sum32, float, NAN, +)
ARITHMETIC_OP(sum64, double, (double)NAN, +)
ARITHMETIC_OP(prod32, float, NAN, *)
ARITHMETIC_OP(prod64, double, (double)NAN, *)

#define PICK_OP(name, T, I, top, exponent, canonical, better)                                                   \
    static void name(const I *in, I *inout, Py_ssize_t n) {                                                      \
        for (Py_ssize_t i = 0; i < n; i++) {                                                                     \
            I a = in[i], b = inout[i];                                                                           \
            I ka = a ^ ((a >> (8 * sizeof(I) - 1)) & top), kb = b ^ ((b >> (8 * sizeof(I) - 1)) & top);        \
            I r = ka better kb ? a : b;                                                                          \
            inout[i] = ((a & top) > exponent) | ((b & top) > exponent) ? canonical : r;                          \
        }                                                                                                        \
    }
PICK_OP(max32, int32_t, int32_t, INT32_MAX, 0x7f800000, 0x7fc00000, >)
PICK_OP(min32, int32_t, int32_t, INT32_MAX, 0x7f800000, 0x7fc00000, <)
PICK_OP(max64, int64_t, int64_t, INT64_MAX, 0x7ff0000000000000LL, 0x7ff8000000000000LL, >)
PICK_OP(min64, int64_t, int64_t, INT64_MAX, 0x7ff0000000000000LL, 0x7ff8000000000000LL, <)

static int is_double(MPI_Datatype type) { return type == MPI_DOUBLE || type == MPI_C_DOUBLE_COMPLEX; }
static Py_ssize_t parts_of(MPI_Datatype type, int len) {
    return (type == MPI_C_FLOAT_COMPLEX || type == MPI_C_DOUBLE_COMPLEX ? 2 : 1) * (Py_ssize_t)len;
}

static void sum_op(void *in, void *inout, int *len, MPI_Datatype *type) {
    if (is_double(*type)) sum64(in, inout, parts_of(*type, *len));
    else sum32(in, inout, parts_of(*type, *len));
}
static void prod_op(void *in, void *inout, int *len, MPI_Datatype *type) {
    if (is_double(*type)) prod64(in, inout, *len);
    else prod32(in, inout, *len);
}
static void max_op(void *in, void *inout, int *len, MPI_Datatype *type) {
    if (is_double(*type)) max64(in, inout, *len);
    else max32(in, inout, *len);
}
static void min_op(void *in, void *inout, int *len, MPI_Datatype *type) {
    if (is_double(*type)) min64(in, inout, *len);
    else min32(in, inout, *len);
}

/* create_ops(): the Fortran handles of the (sum, prod, max, min) above as commutative MPI ops, made now. */
static PyObject *create_ops(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    MPI_User_function *functions[4] = {sum_op, prod_op, max_op, min_op};
    MPI_Fint handles[4];
    for (int i = 0; i < 4; i++) {
        MPI_Op op;
        int code = MPI_Op_create(functions[i], 1, &op);
        if (code != MPI_SUCCESS) return failed(code);
        handles[i] = MPI_Op_c2f(op);
    }
    return Py_BuildValue("(llll)", (long)handles[0], (long)handles[1], (long)handles[2], (long)handles[3]);
}

/* The arguments the calls share: (handle, buffer, ..., finish, tests, ...) with `expected` in all, `usage` naming
 * them; 0, with an exception set, where they are not that. */
static int shared_arguments(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected, const char *usage,
                            long *handle, long *finish, long *tests) {
    if (nargs != expected) {
        PyErr_SetString(PyExc_TypeError, usage);
        return 0;
    }
    *handle = PyLong_AsLong(args[0]);
    *tests = PyLong_AsLong(args[4]);
    *finish = PyLong_AsLong(args[3]);
    if (!PyErr_Occurred() && *finish < 0) PyErr_Format(PyExc_ValueError, "finish %ld: it must be at least 0", *finish);
    return !PyErr_Occurred();
}

/* Whether `finished` can do `finish` for these values (a division only of real floats). */
static int can_finish(long finish, int floats, Py_ssize_t parts) { return finish <= 1 || (floats && parts == 1); }

/* What the all-reduces need of their buffer `view`: its MPI datatype (with datatype_of's floats and parts) and its
 * element count; MPI_DATATYPE_NULL where they do not take it with `finish` (a format without an MPI datatype here,
 * more elements than an int counts, a finish `finished` cannot do). */
static MPI_Datatype reducible(const Py_buffer *view, long finish, int *floats, Py_ssize_t *parts, Py_ssize_t *count) {
    MPI_Datatype type = datatype_of(view, floats, parts);
    *count = view->itemsize ? view->len / view->itemsize : 0;
    return *count > 0x7fffffff || !can_finish(finish, *floats, *parts) ? MPI_DATATYPE_NULL : type;
}

static int done_after(MPI_Request *request, long tests, int *code) {
    int done = 0;
    for (long i = 0; i < tests && !done; i++)
        if ((*code = MPI_Test(request, &done, MPI_STATUS_IGNORE)) != MPI_SUCCESS) return 0;
    return done;
}

/* The all-reduce of allreduce() and express() on `view` (writable, C-contiguous, with its format). */
static PyObject *allreduce_view(long comm, Py_buffer *view, long op, long finish, long tests) {
    int floats, code = MPI_SUCCESS;
    Py_ssize_t parts, count;
    MPI_Datatype type = reducible(view, finish, &floats, &parts, &count);
    MPI_Request request;
    if (type == MPI_DATATYPE_NULL) return Py_NewRef(Py_NotImplemented);
    if ((code = MPI_Iallreduce(MPI_IN_PLACE, view->buf, (int)count, type, MPI_Op_f2c((MPI_Fint)op),
                               MPI_Comm_f2c((MPI_Fint)comm), &request)) != MPI_SUCCESS)
        return failed(code);
    if (done_after(&request, tests, &code)) {
        finished(view->buf, count * parts, floats, finish);
        Py_RETURN_NONE;
    }
    return code != MPI_SUCCESS ? failed(code) : PyLong_FromLong((long)MPI_Request_c2f(request));
}

/* allreduce(comm, buf, op, finish, tests): MPI_Iallreduce in place on the writable contiguous `buf` over the
 * communicator and op of these Fortran handles. None once done (and `finished`); else the request's Fortran handle,
 * for the caller to wait on (then to finish itself); NotImplemented, with nothing sent, for a buffer whose format
 * has no MPI datatype here or a finish it cannot do. */
static PyObject *allreduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long comm, op, tests, finish;
    if (!shared_arguments(args, nargs, 5, "allreduce(comm, buf, op, finish, tests)", &comm, &finish, &tests))
        return NULL;
    if ((op = PyLong_AsLong(args[2])) == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) return NULL;
    PyObject *result = allreduce_view(comm, &view, op, finish, tests);
    PyBuffer_Release(&view);
    return result;
}

/* The library's blocking all-reduce in place of `view`'s `count` elements of `type`, the GIL released: its code. */
static int blocking_allreduce(Py_buffer *view, Py_ssize_t count, MPI_Datatype type, long op, MPI_Comm communicator) {
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = MPI_Allreduce(MPI_IN_PLACE, view->buf, (int)count, type, MPI_Op_f2c((MPI_Fint)op), communicator);
    Py_END_ALLOW_THREADS
    return code;
}

/* The meeting and the blocking all-reduce of meet_allreduce() and express() on `view` (writable, C-contiguous, with
 * its format), `meeting` the 8 int64 the caller keeps. */
static PyObject *meet_allreduce_view(long comm, Py_buffer *view, long op, long finish, long tests, long kind,
                                     int64_t *meeting) {
    int floats, code = MPI_SUCCESS;
    Py_ssize_t parts, count;
    MPI_Datatype type = reducible(view, finish, &floats, &parts, &count);
    int64_t *extremes = meeting + 4;
    MPI_Comm communicator = MPI_Comm_f2c((MPI_Fint)comm);
    MPI_Request request;
    if (type == MPI_DATATYPE_NULL) return Py_NewRef(Py_NotImplemented);
    meeting[0] = count, meeting[1] = kind, meeting[2] = -count, meeting[3] = -kind;
    if ((code = MPI_Iallreduce(meeting, extremes, 4, MPI_INT64_T, MPI_MAX, communicator, &request)) != MPI_SUCCESS)
        return failed(code);
    int met;
    Py_BEGIN_ALLOW_THREADS
    met = done_after(&request, tests, &code);
    Py_END_ALLOW_THREADS
    if (code != MPI_SUCCESS) return failed(code);
    if (!met) return PyLong_FromLong((long)MPI_Request_c2f(request));
    if (extremes[0] != -extremes[2] || extremes[1] != -extremes[3]) return Py_NewRef(Py_False);
    if ((code = blocking_allreduce(view, count, type, op, communicator)) != MPI_SUCCESS) return failed(code);
    finished(view->buf, count * parts, floats, finish);
    Py_RETURN_NONE;
}

/* The 8 int64 of a meeting, from `array` (writable, C-contiguous); 0, with an exception set, where it is not that. */
static int meeting_of(PyObject *array, Py_buffer *meeting) {
    if (PyObject_GetBuffer(array, meeting, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return 0;
    if (meeting->len == 8 * (Py_ssize_t)sizeof(int64_t)) return 1;
    PyErr_Format(PyExc_ValueError, "meet_allreduce: meeting has %zd bytes, not 8 int64", meeting->len);
    PyBuffer_Release(meeting);
    return 0;
}

/* The persistent all-reduce of start() and express(): the request of Fortran handle `handle`, made in place over
 * `own_object`, started on the values of `buf` (writable, C-contiguous): copied into own, started, tested. True once
 * done, the result copied back into `buf` (and `finished`); False while it runs; NotImplemented, with nothing
 * started, for a format or a finish this does not take. */
static PyObject *start_view(long handle, PyObject *own_object, Py_buffer *buf, long finish, long tests) {
    Py_buffer own;
    if (PyObject_GetBuffer(own_object, &own, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) return NULL;
    PyObject *result = NULL;
    int floats, code;
    Py_ssize_t parts;
    if (datatype_of(&own, &floats, &parts) == MPI_DATATYPE_NULL || !can_finish(finish, floats, parts)) {
        result = Py_NewRef(Py_NotImplemented);
    } else if (own.len != buf->len) {
        PyErr_Format(PyExc_ValueError, "start: the request's buffer has %zd bytes, the call's %zd", own.len, buf->len);
    } else {
        memcpy(own.buf, buf->buf, (size_t)buf->len);
        MPI_Request request = MPI_Request_f2c((MPI_Fint)handle);
        if ((code = MPI_Start(&request)) != MPI_SUCCESS) {
            failed(code);
        } else if (done_after(&request, tests, &code)) {
            memcpy(buf->buf, own.buf, (size_t)buf->len);
            finished(buf->buf, own.len / own.itemsize * parts, floats, finish);
            result = Py_NewRef(Py_True);
        } else {
            result = code == MPI_SUCCESS ? Py_NewRef(Py_False) : failed(code);
        }
    }
    PyBuffer_Release(&own);
    return result;
}

/* The end of an exchange (exchange_view): rank 0's vector op rank 1's on both ranks (so the same bits), from the
 * halves of `own` (this rank's, the other's) into `view`, `finished`. (MPI's inout = in op inout: in is rank 0's.) */
static PyObject *exchange_reduced(MPI_Comm communicator, Py_buffer *view, char *mine, long op, long finish) {
    int floats, rank, code;
    Py_ssize_t parts, count;
    MPI_Datatype type = reducible(view, finish, &floats, &parts, &count);
    char *theirs = mine + view->len;
    if ((code = MPI_Comm_rank(communicator, &rank)) != MPI_SUCCESS
        || (code = MPI_Reduce_local(rank == 0 ? mine : theirs, rank == 0 ? theirs : view->buf, (int)count, type,
                                    MPI_Op_f2c((MPI_Fint)op))) != MPI_SUCCESS)
        return failed(code);
    if (rank == 0) memcpy(view->buf, theirs, (size_t)view->len);
    finished(view->buf, count * parts, floats, finish);
    Py_RETURN_NONE;
}

/* The all-reduce of a communicator of two ranks as one exchange (rhd's small all-reduce at p = 2, algorithms/rhd.py,
 * whose Python form it pairs with): `view` (writable, C-contiguous, with its format) copied into the first half of
 * `own` (a writable buffer of twice its bytes), sent to the other rank as bytes with tag 0 while the second half
 * receives that rank's, both tested `tests` times, then exchange_reduced. None once done; the bytes received where
 * they are not `view`'s; else (receive, send, bound_arguments): the request handles, for the caller to wait on within
 * the deadline, then to call exchanged(bound_arguments, buf); NotImplemented, with nothing sent, for a format or a
 * finish this does not take. */
static PyObject *exchange_view(long comm, Py_buffer *view, long op, long finish, long tests, Py_buffer *own,
                               PyObject *bound_arguments) {
    int floats, code = MPI_SUCCESS, rank, done = 0, received;
    Py_ssize_t parts, count;
    if (reducible(view, finish, &floats, &parts, &count) == MPI_DATATYPE_NULL || view->len > 0x7fffffff)
        return Py_NewRef(Py_NotImplemented);
    if (own->len != 2 * view->len) {
        PyErr_Format(PyExc_ValueError, "exchange: own has %zd bytes, not twice the call's %zd", own->len, view->len);
        return NULL;
    }
    char *mine = own->buf;
    MPI_Comm communicator = MPI_Comm_f2c((MPI_Fint)comm);
    MPI_Request requests[2];
    MPI_Status statuses[2];
    memcpy(mine, view->buf, (size_t)view->len);
    if ((code = MPI_Comm_rank(communicator, &rank)) != MPI_SUCCESS
        || (code = MPI_Irecv(mine + view->len, (int)view->len, MPI_BYTE, 1 - rank, 0, communicator, &requests[0]))
               != MPI_SUCCESS
        || (code = MPI_Isend(mine, (int)view->len, MPI_BYTE, 1 - rank, 0, communicator, &requests[1])) != MPI_SUCCESS)
        return failed(code);
    for (long i = 0; i < tests && !done; i++)
        if ((code = MPI_Testall(2, requests, &done, statuses)) != MPI_SUCCESS)  /* (a request's own error, named) */
            return failed(code != MPI_ERR_IN_STATUS ? code
                          : statuses[0].MPI_ERROR != MPI_SUCCESS ? statuses[0].MPI_ERROR : statuses[1].MPI_ERROR);
    if (!done)
        return Py_BuildValue("(iiO)", (int)MPI_Request_c2f(requests[0]), (int)MPI_Request_c2f(requests[1]),
                             bound_arguments);
    if ((code = MPI_Get_count(&statuses[0], MPI_BYTE, &received)) != MPI_SUCCESS) return failed(code);
    if (received != view->len) return PyLong_FromLong(received);
    return exchange_reduced(communicator, view, mine, op, finish);
}

/* ---- The watchdog (Open MPI with its fault tolerance, ULFM, enabled: mpiexec --with-ft ulfm). There native's
 * all-reduce is the library's blocking call, whose wait no Test bounds: a thread of this module revokes the
 * communicator of a call still running past its deadline (MPIX_Comm_revoke: the call returns MPI_ERR_REVOKED, and
 * every later call on that communicator on every rank), as torch's watchdog aborts a NCCL communicator. A call
 * costs the watchdog two stores; it sleeps until the earliest deadline of a running call, or a second. */
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI && defined(__linux__)
#define CAN_REVOKE 1
#else
#define CAN_REVOKE 0
#endif
#define WATCHDOG_IDLE 1.0 /* seconds the watchdog sleeps while no call runs (a call made meanwhile waits at most this
                           * much past its deadline) */

static double now(void);

typedef struct Watch {
    PyObject_HEAD
    MPI_Comm communicator;
    _Atomic double since;   /* when the blocking call now running started (now()), 0 while none runs */
    _Atomic double timeout; /* its deadline, in seconds after `since` */
    _Atomic int revoked;    /* the watchdog revoked the communicator (once) */
    struct Watch *next;     /* the watched list (watchdog_lock) */
    int listed;
} Watch;

#if CAN_REVOKE
static pthread_mutex_t watchdog_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t watchdog_wake;
static Watch *watched;
static int watchdog_running;

static void *watchdog(void *unused) {
    (void)unused;
    pthread_mutex_lock(&watchdog_lock);
    for (;;) {
        double clock = now(), wake = clock + WATCHDOG_IDLE;
        for (Watch *watch = watched; watch != NULL; watch = watch->next) {
            double since = atomic_load(&watch->since);
            if (since <= 0 || atomic_load(&watch->revoked)) continue;
            double due = since + atomic_load(&watch->timeout);
            if (clock < due) {
                wake = due < wake ? due : wake;
            } else {
                atomic_store(&watch->revoked, 1);
                MPIX_Comm_revoke(watch->communicator);
            }
        }
        struct timespec until = {(time_t)wake, (long)((wake - (double)(time_t)wake) * 1e9)};
        pthread_cond_timedwait(&watchdog_wake, &watchdog_lock, &until);
    }
    return NULL;
}

/* The watchdog thread, started on the first Watch (0 with an exception set where it cannot be). */
static int start_watchdog(void) {
    if (watchdog_running) return 1;
    pthread_condattr_t attributes;
    pthread_t thread;
    int error = pthread_condattr_init(&attributes);
    if (!error) error = pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC);
    if (!error) error = pthread_cond_init(&watchdog_wake, &attributes);
    if (!error) error = pthread_create(&thread, NULL, watchdog, NULL);
    if (!error) error = pthread_detach(thread);
    if (error) {
        PyErr_Format(PyExc_OSError, "the watchdog thread could not be started (error %d)", error);
        return 0;
    }
    watchdog_running = 1;
    return 1;
}
#endif

static void watch_unlist(Watch *self) {
#if CAN_REVOKE
    if (!self->listed) return;
    pthread_mutex_lock(&watchdog_lock);
    for (Watch **link = &watched; *link != NULL; link = &(*link)->next)
        if (*link == self) {
            *link = self->next;
            break;
        }
    self->listed = 0;
    pthread_mutex_unlock(&watchdog_lock);
#else
    (void)self;
#endif
}

static PyObject *watch_new(PyTypeObject *type, PyObject *args, PyObject *names) {
    long comm;
    double timeout;
    if (names != NULL && PyDict_GET_SIZE(names)) {
        PyErr_SetString(PyExc_TypeError, "Watch(comm, timeout): positional arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "ld:Watch", &comm, &timeout)) return NULL;
#if CAN_REVOKE
    Watch *self = (Watch *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->communicator = MPI_Comm_f2c((MPI_Fint)comm);
    atomic_store(&self->timeout, timeout);
    pthread_mutex_lock(&watchdog_lock);
    int started = start_watchdog();
    if (started) {
        self->next = watched, watched = self, self->listed = 1;
        pthread_cond_signal(&watchdog_wake);
    }
    pthread_mutex_unlock(&watchdog_lock);
    if (!started) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
#else
    (void)type;
    PyErr_SetString(PyExc_NotImplementedError, "Watch: this MPI library cannot revoke a communicator (no ULFM)");
    return NULL;
#endif
}

static void watch_dealloc(Watch *self) {
    watch_unlist(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *watch_close(Watch *self, PyObject *unused) {
    (void)unused;
    watch_unlist(self);
    Py_RETURN_NONE;
}

static PyObject *watch_get_timeout(Watch *self, void *closure) {
    (void)closure;
    return PyFloat_FromDouble(atomic_load(&self->timeout));
}

static int watch_set_timeout(Watch *self, PyObject *value, void *closure) {
    (void)closure;
    double seconds = value == NULL ? -1.0 : PyFloat_AsDouble(value);
    if (seconds == -1.0 && PyErr_Occurred()) return -1;
    if (!(seconds >= 0)) {
        PyErr_SetString(PyExc_ValueError, "Watch.timeout: seconds, at least 0");
        return -1;
    }
    atomic_store(&self->timeout, seconds);
    return 0;
}

static PyMethodDef watch_methods[] = {
    {"close", (PyCFunction)watch_close, METH_NOARGS, "close(): stop watching (before the communicator is freed)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef watch_getset[] = {
    {"timeout", (getter)watch_get_timeout, (setter)watch_set_timeout, "a call's deadline, in seconds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpcomm._native_calls.Watch",
    .tp_basicsize = sizeof(Watch),
    .tp_dealloc = (destructor)watch_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Watch(comm, timeout): the watchdog's entry for one communicator, whose blocking all-reduces "
              "(watched_allreduce) it revokes past the deadline",
    .tp_methods = watch_methods,
    .tp_getset = watch_getset,
    .tp_new = watch_new,
};

/* The blocking all-reduce of watched_allreduce() and express() on `view` (writable, C-contiguous, with its format),
 * under `watch`'s deadline, the GIL released. None once done (and `finished`); the seconds it ran where the
 * communicator was revoked (by this rank's watchdog or another's: the caller raises the timeout); NotImplemented,
 * with nothing sent, for a format or a finish this does not take. */
static PyObject *watched_view(Watch *watch, Py_buffer *view, long op, long finish) {
    int floats, code;
    Py_ssize_t parts, count;
    MPI_Datatype type = reducible(view, finish, &floats, &parts, &count);
    if (type == MPI_DATATYPE_NULL) return Py_NewRef(Py_NotImplemented);
    double started = now();
    atomic_store(&watch->since, started);
    code = blocking_allreduce(view, count, type, op, watch->communicator);
    atomic_store(&watch->since, 0.0);
    if (code != MPI_SUCCESS) {
        int kind = code;
        MPI_Error_class(code, &kind);
#if CAN_REVOKE
        if (kind == MPIX_ERR_REVOKED) return PyFloat_FromDouble(now() - started);
#endif
        return failed(code);
    }
    finished(view->buf, count * parts, floats, finish);
    Py_RETURN_NONE;
}

/* watched_allreduce(watch, buf, op, finish): MPI_Allreduce in place on the writable contiguous `buf` over `watch`'s
 * communicator, as watched_view. */
static PyObject *watched_allreduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long op, finish;
    if (nargs != 4 || !Py_IS_TYPE(args[0], &WatchType)) {
        PyErr_SetString(PyExc_TypeError, "watched_allreduce(watch, buf, op, finish)");
        return NULL;
    }
    if (((op = PyLong_AsLong(args[2])) == -1 || (finish = PyLong_AsLong(args[3])) == -1) && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) return NULL;
    PyObject *result = watched_view((Watch *)args[0], &view, op, finish);
    PyBuffer_Release(&view);
    return result;
}

/* fault_tolerant(): whether this library can revoke a communicator and its fault tolerance is enabled (Open MPI's
 * mpi_ft_enable, read through MPI_T): where both hold, Watch and watched_allreduce keep native's deadline. */
static PyObject *fault_tolerant(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    long long value = 0; /* (room for any integer type of the variable) */
#if CAN_REVOKE
    int level, provided, index, count;
    /* (MPI's own level: Open MPI takes MPI_T's as the level MPI_Query_thread reports) */
    if (MPI_Query_thread(&level) != MPI_SUCCESS || MPI_T_init_thread(level, &provided) != MPI_SUCCESS) Py_RETURN_FALSE;
    MPI_T_cvar_handle handle;
    if (MPI_T_cvar_get_index("mpi_ft_enable", &index) == MPI_SUCCESS
        && MPI_T_cvar_handle_alloc(index, NULL, &handle, &count) == MPI_SUCCESS) {
        if (count == 1) MPI_T_cvar_read(handle, &value);
        MPI_T_cvar_handle_free(&handle);
    }
    MPI_T_finalize();
#endif
    return PyBool_FromLong(value != 0);
}

/* What an express call (ExpressCall) does with its `bound` arguments on `buf`: allreduce(comm, buf, op, finish,
 * tests) with bound = (comm, op, finish, tests), or meet_allreduce(comm, buf, op, finish, tests, kind, meeting) with
 * bound = (comm, op, finish, tests, kind, meeting), or start(request, own, buf, finish, tests) with bound =
 * (persistent, finish, tests), `persistent` the list [request, own, handle] of a persistent all-reduce (None once
 * done, not True), or exchange_view(comm, buf, op, finish, tests, own) with bound = (comm, op, finish, tests, own),
 * or watched_view(watch, buf, op, finish) with bound = (comm, op, finish, watch), `watch` the comm's Watch:
 * the arguments one plan's calls share, and NotImplemented, with nothing sent, for a buffer that is not writable and
 * C-contiguous too, or a persistent request not made (an empty list). */
static PyObject *express_bound(PyObject *bound_arguments, Py_buffer *view) {
    Py_ssize_t size = PyTuple_GET_SIZE(bound_arguments); /* (3 to 6: checked when the ExpressCall is made) */
    PyObject *persistent = size == 3 ? PyTuple_GET_ITEM(bound_arguments, 0) : NULL;
    if (persistent != NULL && !(PyList_CheckExact(persistent) && PyList_GET_SIZE(persistent) == 3))
        return Py_NewRef(Py_NotImplemented);
    PyObject *watch = size == 4 && Py_IS_TYPE(PyTuple_GET_ITEM(bound_arguments, 3), &WatchType)
                          ? PyTuple_GET_ITEM(bound_arguments, 3) : NULL;
    long bound[5];
    /* (the integers: all but the last of an exchange, a meeting, a watch) */
    for (int i = 0; i < (size >= 5 || watch != NULL ? size - 1 : size); i++)
        if ((bound[i] = PyLong_AsLong(persistent != NULL && i == 0 ? PyList_GET_ITEM(persistent, 2)
                                                                   : PyTuple_GET_ITEM(bound_arguments, i))) == -1
            && PyErr_Occurred())
            return NULL;
    Py_buffer meeting, own;
    if (size == 6 && !meeting_of(PyTuple_GET_ITEM(bound_arguments, 5), &meeting)) return NULL;
    if (size == 5
        && PyObject_GetBuffer(PyTuple_GET_ITEM(bound_arguments, 4), &own, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
        return NULL;
    PyObject *result;
    if (size == 3) {
        result = start_view(bound[0], PyList_GET_ITEM(persistent, 1), view, bound[1], bound[2]);
        if (result == Py_True) {
            Py_DECREF(result);
            result = Py_NewRef(Py_None);
        }
    } else {
        result = watch != NULL ? watched_view((Watch *)watch, view, bound[1], bound[2])
                 : size == 4   ? allreduce_view(bound[0], view, bound[1], bound[2], bound[3])
                 : size == 5   ? exchange_view(bound[0], view, bound[1], bound[2], bound[3], &own, bound_arguments)
                               : meet_allreduce_view(bound[0], view, bound[1], bound[2], bound[3], bound[4],
                                                     meeting.buf);
    }
    if (size == 6) PyBuffer_Release(&meeting);
    if (size == 5) PyBuffer_Release(&own);
    return result;
}

/* exchanged(bound, buf): the end of an exchange whose express call returned its requests, once the caller has waited
 * for them: exchange_reduced into `buf` with the call's bound = (comm, op, finish, tests, own). */
static PyObject *exchanged(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long bound[3];
    if (nargs != 2 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != 5) {
        PyErr_SetString(PyExc_TypeError, "exchanged(bound, buf): bound = (comm, op, finish, tests, own)");
        return NULL;
    }
    for (int i = 0; i < 3; i++)
        if ((bound[i] = PyLong_AsLong(PyTuple_GET_ITEM(args[0], i))) == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view, own;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) return NULL;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(args[0], 4), &own, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *result = own.len == 2 * view.len
                           ? exchange_reduced(MPI_Comm_f2c((MPI_Fint)bound[0]), &view, own.buf, bound[1], bound[2])
                           : PyErr_Format(PyExc_ValueError, "exchanged: own has %zd bytes, not twice the call's %zd",
                                          own.len, view.len);
    PyBuffer_Release(&own);
    PyBuffer_Release(&view);
    return result;
}

/* meet_allreduce(comm, buf, op, finish, tests, kind, meeting): the ranks meet, then make the blocking MPI_Allreduce
 * in place on `buf` (algorithms/native.py's _meet, in this one call). The meeting is a non-blocking MAX all-reduce
 * of (count, kind, -count, -kind) from meeting[0:4] into meeting[4:8] (a writable int64 array of 8 the caller
 * keeps), tested `tests` times with the GIL released: once every rank has come with the same count and kind (the
 * caller's hash of dtype and op), the blocking call cannot wait for a rank that is not coming. None once done (and
 * `finished`); False if the ranks disagree (nothing sent); else the meeting's request handle, for the caller to
 * wait on within the deadline, then to compare meeting[4:8] and make the call itself; NotImplemented, with nothing
 * sent, as allreduce's. */
static PyObject *meet_allreduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long comm, op, tests, finish, kind;
    if (!shared_arguments(args, nargs, 7, "meet_allreduce(comm, buf, op, finish, tests, kind, meeting)", &comm,
                          &finish, &tests))
        return NULL;
    if (((op = PyLong_AsLong(args[2])) == -1 || (kind = PyLong_AsLong(args[5])) == -1) && PyErr_Occurred())
        return NULL;
    Py_buffer view, meeting;
    if (!meeting_of(args[6], &meeting)) return NULL;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyBuffer_Release(&meeting);
        return NULL;
    }
    PyObject *result = meet_allreduce_view(comm, &view, op, finish, tests, kind, meeting.buf);
    PyBuffer_Release(&view);
    PyBuffer_Release(&meeting);
    return result;
}

/* start(request, own, buf, finish, tests): start_view of `buf`. */
static PyObject *start(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long handle, tests, finish;
    if (!shared_arguments(args, nargs, 5, "start(request, own, buf, finish, tests)", &handle, &finish, &tests))
        return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(args[2], &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return NULL;
    PyObject *result = start_view(handle, args[1], &buf, finish, tests);
    PyBuffer_Release(&buf);
    return result;
}

/* ---- A small all-reduce's whole blocking call, books included: Busy is a transport's lock (Transport.in_use)
 * that an ExpressCall takes and gives back without a Python call, and the ExpressCall reads the clock around its
 * call and counts a finished one into the plan's stats entry (three doubles: calls, bytes, seconds) itself. Those
 * Python calls (the lock's two methods, two clock readings, three new numbers) cost as much as the call of a small
 * all-reduce on Open MPI. Both rely on the GIL, held from the lock's test to its taking. */

typedef struct {
    PyObject_HEAD
    int held;
} Busy;

/* acquire(blocking): threading.Lock's acquire(False) (True where it took the lock); it never waits. */
static PyObject *busy_acquire(Busy *self, PyObject *blocking) {
    int wait = PyObject_IsTrue(blocking);
    if (wait != 0) {
        if (wait > 0)
            PyErr_SetString(PyExc_ValueError, "Busy.acquire(blocking): it never waits; blocking must be False");
        return NULL;
    }
    if (self->held) Py_RETURN_FALSE;
    self->held = 1;
    Py_RETURN_TRUE;
}

static PyObject *busy_release(Busy *self, PyObject *unused) {
    (void)unused;
    if (!self->held) {
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return NULL;
    }
    self->held = 0;
    Py_RETURN_NONE;
}

static PyObject *busy_locked(Busy *self, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(self->held);
}

static PyMethodDef busy_methods[] = {
    {"acquire", (PyCFunction)busy_acquire, METH_O, "acquire(False) -> whether it took the lock (it never waits)"},
    {"release", (PyCFunction)busy_release, METH_NOARGS, "release() the lock (RuntimeError where it is not held)"},
    {"locked", (PyCFunction)busy_locked, METH_NOARGS, "locked() -> whether it is held"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BusyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpcomm._native_calls.Busy",
    .tp_basicsize = sizeof(Busy),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Busy(): a transport's lock, threading.Lock's acquire(False), release() and locked(), that an "
              "ExpressCall takes without a Python call",
    .tp_methods = busy_methods,
    .tp_new = PyType_GenericNew,
};

#ifndef __linux__
static PyObject *perf_counter; /* time.perf_counter, called where its clock is not read here directly */
#endif

/* time.perf_counter(), as it computes it from the monotonic clock on Linux; -1.0, with an exception set, where
 * calling it failed. */
static double now(void) {
#ifdef __linux__
    struct timespec clock;
    clock_gettime(CLOCK_MONOTONIC, &clock);
    int64_t ns = (int64_t)clock.tv_sec * 1000000000 + clock.tv_nsec;
    return ns % 1000000000 == 0 ? (double)(ns / 1000000000) : (double)ns / 1e9;
#else
    PyObject *seconds = PyObject_CallNoArgs(perf_counter);
    double value = seconds ? PyFloat_AsDouble(seconds) : -1.0;
    Py_XDECREF(seconds);
    return value;
#endif
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *bound;   /* express_bound's arguments (a tuple of 3 to 6) */
    Busy *busy;        /* the transport's lock */
    Py_buffer totals;  /* the plan's stats entry: calls, bytes, seconds (3 doubles) */
    double nbytes;     /* what a call adds to the entry's bytes */
    double started, ended; /* the last call's clock readings, on time.perf_counter's clock */
} ExpressCall;

/* An ExpressCall's call on `view` (writable, C-contiguous, with its format): express_bound(bound, view) with `busy`
 * held (NotImplemented, nothing sent, where it is held already: the caller's general path refuses the second
 * thread) and the clock read around it (started, ended: kept from the last call that sent). A call done (None) is
 * counted into `totals` and gives `busy` back; one still running keeps it, for the caller to wait, finish, count
 * and give back; an error gives it back and raises. */
static PyObject *express_view(ExpressCall *self, Py_buffer *view) {
    Busy *busy = self->busy;
    if (busy->held) return Py_NewRef(Py_NotImplemented);
    busy->held = 1;
    double started = now();
    if (started == -1.0 && PyErr_Occurred()) {
        busy->held = 0;
        return NULL;
    }
    PyObject *result = express_bound(self->bound, view);
    if (result == NULL || result == Py_NotImplemented) {
        busy->held = 0;
        return result;
    }
    self->started = started;
    if ((self->ended = now()) == -1.0 && PyErr_Occurred()) {
        Py_DECREF(result);
        busy->held = 0;  /* (after a call that sent: as an error midway) */
        return NULL;
    }
    if (result == Py_None) {
        double *totals = self->totals.buf;
        totals[0] += 1, totals[1] += self->nbytes, totals[2] += self->ended - self->started;
        busy->held = 0;
    }
    return result;
}

/* ExpressCall(bound, busy, totals, nbytes)(buf): express_view of `buf`'s buffer (NotImplemented, nothing sent, for
 * a buffer not writable and C-contiguous). */
static PyObject *express_call(ExpressCall *self, PyObject *const *args, size_t nargsf, PyObject *names) {
    if (PyVectorcall_NARGS(nargsf) != 1 || names != NULL) {
        PyErr_SetString(PyExc_TypeError, "ExpressCall(buf): one positional argument");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        return Py_NewRef(Py_NotImplemented);
    }
    PyObject *result = express_view(self, &view);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *express_new(PyTypeObject *type, PyObject *args, PyObject *names) {
    PyObject *bound, *totals;
    Busy *busy;
    double nbytes;
    if (names != NULL && PyDict_GET_SIZE(names)) {
        PyErr_SetString(PyExc_TypeError, "ExpressCall(bound, busy, totals, nbytes): positional arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!O!Od:ExpressCall", &PyTuple_Type, &bound, &BusyType, &busy, &totals, &nbytes))
        return NULL;
    Py_ssize_t size = PyTuple_GET_SIZE(bound);
    if (size < 3 || size > 6) {
        PyErr_Format(PyExc_ValueError, "ExpressCall: bound has %zd items: (comm, op, finish, tests[, kind, meeting]) "
                                       "| (comm, op, finish, tests, own) | (comm, op, finish, watch) "
                                       "| (persistent, finish, tests)", size);
        return NULL;
    }
    ExpressCall *self = (ExpressCall *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    if (PyObject_GetBuffer(totals, &self->totals, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        Py_DECREF(self);
        return NULL;
    }
    const char *format = self->totals.format;
    if (self->totals.len != 3 * (Py_ssize_t)sizeof(double) || strcmp(format[0] == '@' ? format + 1 : format, "d")) {
        PyErr_Format(PyExc_ValueError, "ExpressCall: totals must be 3 doubles (array('d')), not %zd bytes of '%s'",
                     self->totals.len, format);
        PyBuffer_Release(&self->totals);
        Py_DECREF(self);
        return NULL;
    }
    self->vectorcall = (vectorcallfunc)express_call;
    self->bound = Py_NewRef(bound);
    self->busy = (Busy *)Py_NewRef(busy);
    self->nbytes = nbytes;
    self->started = self->ended = -1.0;
    return (PyObject *)self;
}

static void express_dealloc(ExpressCall *self) {
    if (self->totals.obj != NULL) PyBuffer_Release(&self->totals);
    Py_XDECREF(self->bound);
    Py_XDECREF(self->busy);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef express_members[] = {
    {"bound", T_OBJECT, offsetof(ExpressCall, bound), READONLY, "the arguments its calls share"},
    {"started", T_DOUBLE, offsetof(ExpressCall, started), READONLY, "the last call's start (time.perf_counter)"},
    {"ended", T_DOUBLE, offsetof(ExpressCall, ended), READONLY, "when the last call returned (time.perf_counter)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ExpressCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpcomm._native_calls.ExpressCall",
    .tp_basicsize = sizeof(ExpressCall),
    .tp_dealloc = (destructor)express_dealloc,
    .tp_vectorcall_offset = offsetof(ExpressCall, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "ExpressCall(bound, busy, totals, nbytes): a plan's small all-reduce in one C call, with its books "
              "(algorithms/native.py's express)",
    .tp_members = express_members,
    .tp_new = express_new,
};

/* ---- A Communicator's all-reduce like its last one, in one C call from the user's: Shortcut is the Communicator's
 * `allreduce` (an instance attribute over the method) where the extension is built. A call with the last call's op
 * and algorithm (positional or by keyword, no wire) on a writable C-contiguous numpy array of its dtype and shape,
 * while nothing else must run first (the gates of Dispatcher.run_express), is that plan's ExpressCall on the array's
 * memory, its flight recorder's entry written here; anything else is the method's (`general`). A Python call, a
 * frame, the last plan's lookup, the array's dtype, shape and buffer cost as much as Open MPI's whole all-reduce of
 * a few bytes (bench/results/openmpi.md, "Stop 62"). */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *general;          /* the Communicator's allreduce method, bound (the general path) */
    PyObject *dispatcher;       /* that Communicator: the rest of an express call's outcome */
    PyObject *attributes;       /* its __dict__: its gates */
    PyObject *ndarray, *default_op, *default_algorithm;
    PyObject *last; /* the call it takes (NULL: none): a tuple of LAST_ITEMS, held by a call while it runs */
} Shortcut;

/* The last call's op, algorithm, plan, its plan's ExpressCall, the flight recorder's lane of the transport (None:
 * recording off); its array's dtype, dimensions (bytes of npy_intp), buffer format (bytes), item size and bytes; and
 * (with a lane) the recorder's ring: groups, calls, starts and slot counter. */
enum { LAST_OP, LAST_ALGORITHM, LAST_PLAN, LAST_EXPRESS, LAST_LANE, LAST_DTYPE, LAST_DIMENSIONS, LAST_FORMAT,
       LAST_ITEMSIZE, LAST_NBYTES, LAST_GROUPS, LAST_CALLS, LAST_STARTS, LAST_SLOTS, LAST_ITEMS };

static PyObject *str_meet, *str_inline, *str_queue, *str_unusable, *str_collectives, *str_ends, *str_outcome,
    *str_op, *str_algorithm, *str_wire, *one;

/* Whether the Communicator (its attributes: `attributes`) lets the express call run now: no validation meeting, no
 * non-blocking work queued to run first, usable (Dispatcher.run_express's gates); -1 with an exception set. */
static int shortcut_open(PyObject *attributes) {
    PyObject *meet = PyDict_GetItemWithError(attributes, str_meet);
    PyObject *unusable = PyDict_GetItemWithError(attributes, str_unusable);
    PyObject *inline_progress = PyDict_GetItemWithError(attributes, str_inline);
    if (meet == NULL || unusable == NULL || inline_progress == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "Shortcut: the Communicator has no gates");
        return -1;
    }
    int closed = meet == Py_False ? 0 : PyObject_IsTrue(meet);
    if (closed || unusable != Py_None) return closed < 0 ? -1 : 0;
    if (inline_progress == Py_None) return 1;
    PyObject *queue = PyObject_GetAttr(inline_progress, str_queue);
    if (queue == NULL) return -1;
    closed = PyObject_IsTrue(queue);
    Py_DECREF(queue);
    return closed < 0 ? -1 : !closed;
}

/* Store `value` at `slot` of the recorder's `ring` (a list, or the timeline's stand-in for ends): 0, or -1. */
static int ring_store(PyObject *ring, Py_ssize_t slot, PyObject *value) {
    if (PyList_CheckExact(ring) && slot < PyList_GET_SIZE(ring)) {
        Py_SETREF(PyList_GET_ITEM(ring, slot), Py_NewRef(value));
        return 0;
    }
    PyObject *index = PyLong_FromSsize_t(slot);
    int status = index == NULL ? -1 : PyObject_SetItem(ring, index, value);
    Py_XDECREF(index);
    return status;
}

/* The flight recorder's entry of `last`'s call, done (Dispatcher.run_express's): 0, or -1 with an exception set. */
static int shortcut_record(PyObject *last) {
    PyObject *lane = PyTuple_GET_ITEM(last, LAST_LANE), *count, *slot_object, *ends, *start = NULL, *end = NULL;
    ExpressCall *express = (ExpressCall *)PyTuple_GET_ITEM(last, LAST_EXPRESS);
    if (lane == Py_None) return 0;
    if ((count = PyObject_GetAttr(lane, str_collectives)) == NULL) return -1;
    PyObject *next = PyNumber_Add(count, one);
    Py_DECREF(count);
    if (next == NULL) return -1;
    int failed_set = PyObject_SetAttr(lane, str_collectives, next);
    Py_DECREF(next);
    if (failed_set || (slot_object = PyIter_Next(PyTuple_GET_ITEM(last, LAST_SLOTS))) == NULL) return -1;
    Py_ssize_t slot = PyLong_AsSsize_t(slot_object);
    Py_DECREF(slot_object);
    if (slot == -1 && PyErr_Occurred()) return -1;
    if ((ends = PyObject_GetAttr(lane, str_ends)) == NULL) return -1;
    int status = (start = PyFloat_FromDouble(express->started)) != NULL
                 && (end = PyFloat_FromDouble(express->ended)) != NULL
                 && ring_store(PyTuple_GET_ITEM(last, LAST_GROUPS), slot, lane) == 0
                 && ring_store(PyTuple_GET_ITEM(last, LAST_CALLS), slot, PyTuple_GET_ITEM(last, LAST_PLAN)) == 0
                 && ring_store(PyTuple_GET_ITEM(last, LAST_STARTS), slot, start) == 0
                 && ring_store(ends, slot, end) == 0 ? 0 : -1;
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_DECREF(ends);
    return status;
}

/* What a call of `last` (taken: its array, op and algorithm are the last call's) returns: `buf` once done, NULL
 * with an exception set, or NotImplemented where the method must make the call (the gates closed, another dtype
 * or shape, the express call not taking it). */
static PyObject *shortcut_take(Shortcut *self, PyObject *last, PyObject *const *args) {
    PyObject *buf = args[0], *dimensions = PyTuple_GET_ITEM(last, LAST_DIMENSIONS);
    PyArrayObject *array = (PyArrayObject *)buf;
    int usable = NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_WRITEABLE;
    size_t size = (size_t)PyArray_NDIM(array) * sizeof(npy_intp);
    int same = (PyObject *)PyArray_DESCR(array) == PyTuple_GET_ITEM(last, LAST_DTYPE)
               && size == (size_t)PyBytes_GET_SIZE(dimensions)
               && memcmp(PyArray_DIMS(array), PyBytes_AS_STRING(dimensions), size) == 0
               && (PyArray_FLAGS(array) & usable) == usable;
    if (same) same = shortcut_open(self->attributes);
    if (same <= 0) return same < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    Py_buffer view = {.buf = PyArray_DATA(array), .obj = NULL, .readonly = 0, .ndim = 1,
                      .len = PyLong_AsSsize_t(PyTuple_GET_ITEM(last, LAST_NBYTES)),
                      .itemsize = PyLong_AsSsize_t(PyTuple_GET_ITEM(last, LAST_ITEMSIZE)),
                      .format = PyBytes_AS_STRING(PyTuple_GET_ITEM(last, LAST_FORMAT))};
    PyObject *outcome = express_view((ExpressCall *)PyTuple_GET_ITEM(last, LAST_EXPRESS), &view);
    if (outcome == Py_None) {
        Py_DECREF(outcome);
        return shortcut_record(last) == 0 ? Py_NewRef(buf) : NULL;
    }
    if (outcome == NULL) { /* (an Exception: raised as run_express's) */
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback != NULL) PyException_SetTraceback(value, traceback);
        outcome = value;
        Py_XDECREF(type);
        Py_XDECREF(traceback);
    }
    PyObject *taken = PyObject_CallMethodObjArgs(self->dispatcher, str_outcome, PyTuple_GET_ITEM(last, LAST_PLAN),
                                                 buf, outcome, NULL);
    Py_DECREF(outcome);
    if (taken == NULL) return NULL;
    int done = taken == Py_True;
    Py_DECREF(taken);
    return Py_NewRef(done ? buf : Py_NotImplemented);
}

static PyObject *shortcut_call(Shortcut *self, PyObject *const *args, size_t nargsf, PyObject *names) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), named = names == NULL ? 0 : PyTuple_GET_SIZE(names);
    PyObject *parameters[4] = {NULL, self->default_op, self->default_algorithm, Py_None}; /* buf, op, algorithm, wire */
    int plain = self->last != NULL && nargs >= 1 && nargs + named <= 4;
    unsigned seen = 0; /* (a parameter given twice is the general path's TypeError) */
    for (Py_ssize_t i = 0; plain && i < nargs + named; i++) {
        Py_ssize_t at = i;
        if (i >= nargs) {
            PyObject *name = PyTuple_GET_ITEM(names, i - nargs);
            at = name == str_op || PyUnicode_Compare(name, str_op) == 0 ? 1
                 : name == str_algorithm || PyUnicode_Compare(name, str_algorithm) == 0 ? 2
                 : name == str_wire || PyUnicode_Compare(name, str_wire) == 0 ? 3 : 0;
            if (at == 0 && PyErr_Occurred()) PyErr_Clear();
        }
        plain = (at > 0 || i == 0) && !(seen & (1u << at));
        seen |= 1u << at;
        parameters[at] = args[i];
    }
    PyObject *last = self->last;
    if (plain && parameters[3] == Py_None && Py_TYPE(args[0]) == (PyTypeObject *)self->ndarray
        && parameters[1] == PyTuple_GET_ITEM(last, LAST_OP) && parameters[2] == PyTuple_GET_ITEM(last, LAST_ALGORITHM)) {
        Py_INCREF(last); /* (another thread's call may remember another meanwhile) */
        PyObject *result = shortcut_take(self, last, args);
        Py_DECREF(last);
        if (result != Py_NotImplemented) return result;
        Py_DECREF(result);
    }
    return PyObject_Vectorcall(self->general, args, nargsf, names);
}

/* Shortcut(general, dispatcher, ndarray, default_op, default_algorithm) */
static PyObject *shortcut_new(PyTypeObject *type, PyObject *args, PyObject *names) {
    PyObject *general, *dispatcher, *ndarray, *op, *algorithm;
    if (names != NULL && PyDict_GET_SIZE(names)) {
        PyErr_SetString(PyExc_TypeError, "Shortcut(general, dispatcher, ndarray, op, algorithm): positional arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOO!OO:Shortcut", &general, &dispatcher, &PyType_Type, &ndarray, &op, &algorithm))
        return NULL;
    Shortcut *self = (Shortcut *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = (vectorcallfunc)shortcut_call;
    self->general = Py_NewRef(general), self->dispatcher = Py_NewRef(dispatcher), self->ndarray = Py_NewRef(ndarray);
    self->default_op = Py_NewRef(op), self->default_algorithm = Py_NewRef(algorithm);
    if ((self->attributes = PyObject_GenericGetDict(dispatcher, NULL)) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* Forget the last call (the next is the general path's, which remembers it again). */
static void shortcut_forget(Shortcut *self) { Py_CLEAR(self->last); }

static int shortcut_clear(Shortcut *self) {
    shortcut_forget(self);
    Py_CLEAR(self->general); Py_CLEAR(self->dispatcher); Py_CLEAR(self->attributes); Py_CLEAR(self->ndarray);
    Py_CLEAR(self->default_op); Py_CLEAR(self->default_algorithm);
    return 0;
}

static int shortcut_traverse(Shortcut *self, visitproc visit, void *arg) {
    Py_VISIT(self->general); Py_VISIT(self->dispatcher); Py_VISIT(self->attributes); Py_VISIT(self->ndarray);
    Py_VISIT(self->default_op); Py_VISIT(self->default_algorithm);
    Py_VISIT(self->last);
    return 0;
}

static void shortcut_dealloc(Shortcut *self) {
    PyObject_GC_UnTrack(self);
    shortcut_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* remember(array, op, algorithm, plan, express, lane): the call to take from now on, one like this one: `array` a
 * numpy array of its dtype and shape (any layout: each call's own array must be writable and C-contiguous),
 * `express` its plan's ExpressCall and `lane` the flight recorder's lane of the transport it runs on (or None). */
static PyObject *shortcut_remember(Shortcut *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || Py_TYPE(args[0]) != (PyTypeObject *)self->ndarray || !Py_IS_TYPE(args[4], &ExpressCallType)) {
        PyErr_SetString(PyExc_TypeError, "remember(array, op, algorithm, plan, express, lane): array a numpy array, "
                                         "express an ExpressCall");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_RECORDS_RO) != 0) return NULL; /* (format, item size, bytes) */
    PyArrayObject *array = (PyArrayObject *)args[0];
    PyObject *last = PyTuple_New(LAST_ITEMS);
    if (last != NULL) {
        for (int i = 0; i < LAST_ITEMS; i++)
            PyTuple_SET_ITEM(last, i, Py_NewRef(i <= LAST_LANE ? args[i + 1] : Py_None));
        Py_SETREF(PyTuple_GET_ITEM(last, LAST_DTYPE), Py_NewRef((PyObject *)PyArray_DESCR(array)));
        PyObject *made[] = {
            PyBytes_FromStringAndSize((const char *)PyArray_DIMS(array), PyArray_NDIM(array) * sizeof(npy_intp)),
            PyBytes_FromString(view.format), PyLong_FromSsize_t(view.itemsize), PyLong_FromSsize_t(view.len)};
        for (int i = 0; i < 4; i++)
            if (made[i] != NULL) Py_SETREF(PyTuple_GET_ITEM(last, LAST_DIMENSIONS + i), made[i]);
        static const char *ring[] = {"groups", "calls", "starts", "slots"};
        for (int i = LAST_GROUPS; i < LAST_ITEMS && !PyErr_Occurred() && args[5] != Py_None; i++) {
            PyObject *part = PyObject_GetAttrString(args[5], ring[i - LAST_GROUPS]);
            if (part != NULL) Py_SETREF(PyTuple_GET_ITEM(last, i), part);
        }
    }
    PyBuffer_Release(&view);
    if (last == NULL || PyErr_Occurred()) {
        Py_XDECREF(last);
        return NULL;
    }
    Py_XSETREF(self->last, last);
    Py_RETURN_NONE;
}

static PyObject *shortcut_forget_call(Shortcut *self, PyObject *unused) {
    (void)unused;
    shortcut_forget(self);
    Py_RETURN_NONE;
}

static PyMethodDef shortcut_methods[] = {
    {"remember", (PyCFunction)(void (*)(void))shortcut_remember, METH_FASTCALL,
     "remember(array, op, algorithm, plan, express, lane): the call to take from now on, one like this"},
    {"forget", (PyCFunction)shortcut_forget_call, METH_NOARGS, "forget(): take no call (until remember)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef shortcut_members[] = {
    {"last", T_OBJECT, offsetof(Shortcut, last), READONLY, "the call it takes: (op, algorithm, plan, express, "
     "lane, ...) (None: none)"},
    {"__wrapped__", T_OBJECT, offsetof(Shortcut, general), READONLY, "the method it stands in front of"},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *shortcut_doc(Shortcut *self, void *closure) {
    (void)closure;
    return PyObject_GetAttrString(self->general, "__doc__");
}

static PyGetSetDef shortcut_getset[] = {
    {"__doc__", (getter)shortcut_doc, NULL, "the method's", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ShortcutType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpcomm._native_calls.Shortcut",
    .tp_basicsize = sizeof(Shortcut),
    .tp_dealloc = (destructor)shortcut_dealloc,
    .tp_vectorcall_offset = offsetof(Shortcut, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Shortcut(general, dispatcher, ndarray, op, algorithm): a Communicator's allreduce, its call like the "
              "last one made in C (the plan's express call), any other by `general`",
    .tp_traverse = (traverseproc)shortcut_traverse,
    .tp_clear = (inquiry)shortcut_clear,
    .tp_methods = shortcut_methods,
    .tp_members = shortcut_members,
    .tp_getset = shortcut_getset,
    .tp_new = shortcut_new,
};

/* clock(): now(), for the test that it reads time.perf_counter's clock. */
static PyObject *clock_call(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    double seconds = now();
    return seconds == -1.0 && PyErr_Occurred() ? NULL : PyFloat_FromDouble(seconds);
}

/* canonical_nans(buf): numpy's NaN wherever `buf` (float32/float64, real or complex) holds a NaN. */
static PyObject *canonical_nans_call(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) return NULL;
    int floats;
    Py_ssize_t parts;
    datatype_of(&view, &floats, &parts);
    if (view.itemsize) canonical_nans(view.buf, view.len / view.itemsize * parts, floats);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *configure(PyObject *self, PyObject *exception) {
    (void)self;
    Py_XDECREF(mpi_exception);
    mpi_exception = Py_NewRef(exception);
    Py_RETURN_NONE;
}

static PyObject *library_version(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(version, &length);
    return PyUnicode_FromStringAndSize(version, length);
}

static PyMethodDef methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))allreduce, METH_FASTCALL,
     "allreduce(comm, buf, op, finish, tests) -> None (done) | request handle | NotImplemented"},
    {"meet_allreduce", (PyCFunction)(void (*)(void))meet_allreduce, METH_FASTCALL,
     "meet_allreduce(comm, buf, op, finish, tests, kind, meeting) -> None (done) | False (they differ) | request "
     "handle | NotImplemented"},
    {"start", (PyCFunction)(void (*)(void))start, METH_FASTCALL,
     "start(request, own, buf, finish, tests) -> True (done, copied back) | False | NotImplemented"},
    {"exchanged", (PyCFunction)(void (*)(void))exchanged, METH_FASTCALL,
     "exchanged(bound, buf): the end of an exchange whose express call returned its requests (waited for)"},
    {"watched_allreduce", (PyCFunction)(void (*)(void))watched_allreduce, METH_FASTCALL,
     "watched_allreduce(watch, buf, op, finish) -> None (done) | seconds (revoked) | NotImplemented"},
    {"fault_tolerant", fault_tolerant, METH_NOARGS,
     "fault_tolerant() -> whether the library can revoke a communicator, its fault tolerance enabled"},
    {"canonical_nans", canonical_nans_call, METH_O, "canonical_nans(buf): numpy's NaN wherever buf holds one"},
    {"create_ops", create_ops, METH_NOARGS, "create_ops() -> Fortran handles of the (sum, prod, max, min) MPI ops"},
    {"clock", clock_call, METH_NOARGS, "clock() -> the seconds of the clock ExpressCall reads (time.perf_counter's)"},
    {"configure", configure, METH_O, "configure(exception_type): what an MPI error code is raised as"},
    {"library_version", library_version, METH_NOARGS, "the MPI library this was built against"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_calls", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native_calls(void) {
    if (PyType_Ready(&BusyType) < 0 || PyType_Ready(&ExpressCallType) < 0 || PyType_Ready(&WatchType) < 0
        || PyType_Ready(&ShortcutType) < 0)
        return NULL;
    PyObject **interned[] = {&str_meet, &str_inline, &str_queue, &str_unusable, &str_collectives, &str_ends,
                             &str_outcome, &str_op, &str_algorithm, &str_wire};
    const char *names[] = {"_meet", "_inline", "queue", "_unusable", "collectives", "ends", "_express_outcome",
                           "op", "algorithm", "wire"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*interned[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
    if ((one = PyLong_FromLong(1)) == NULL) return NULL;
#ifndef __linux__
    PyObject *time = PyImport_ImportModule("time");
    if (time == NULL) return NULL;
    perf_counter = PyObject_GetAttrString(time, "perf_counter");
    Py_DECREF(time);
    if (perf_counter == NULL) return NULL;
#endif
    PyObject *created = PyModule_Create(&module);
    if (created == NULL) return NULL;
    if (PyModule_AddObjectRef(created, "Busy", (PyObject *)&BusyType) < 0
        || PyModule_AddObjectRef(created, "ExpressCall", (PyObject *)&ExpressCallType) < 0
        || PyModule_AddObjectRef(created, "Watch", (PyObject *)&WatchType) < 0
        || PyModule_AddObjectRef(created, "Shortcut", (PyObject *)&ShortcutType) < 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}
