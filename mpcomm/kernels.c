/* mpcomm's compiled reduction kernels (built on first use by mpcomm/kernels.py, loaded with ctypes).
 *
 * reduce16: float16 / bfloat16 chunks combined in float32 and rounded once, in one pass over the inputs.
 * float_keys / from_keys: float32 / float64 as integers that sort like the floats (MPI's integer MIN/MAX then
 * give numpy's NaN propagation and one answer on every rank), in one pass each way.
 * encode16 / decode16 / encode_int8 / decode_int8: the wire codecs of mpcomm/compression.py.
 * cast16: float16 / bfloat16 to and from float32 for a work array (mpcomm/work_array.py).
 * Built with -DMPCOMM_PYTHON where Python.h is found, the same file is also a Python extension (at the end).
 * Every conversion is bitwise the one numpy / ml_dtypes make (round to nearest even; NaN stays NaN; AVX512-BF16's
 * one-instruction rounding only where it does not flush a subnormal to zero); built with
 * -ffp-contract=off, so a multiply then add rounds twice, as numpy's two passes do.
 */
#ifdef MPCOMM_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* (first: it sets the feature macros the standard headers read) */
#endif
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { SUM = 0, PROD = 1, MIN = 2, MAX = 3 };
enum { FLOAT16 = 0, BFLOAT16 = 1 };
#define BLOCK 512 /* elements per pass of the float32 accumulator: it stays in L1 */

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN: quiet, sign kept */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                  /* round to nearest even */
}

static inline float from_f16(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}

static inline uint16_t to_f16(float f) {
    _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, 2);
    return h;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 elements at a time, the scalar forms' operations lane by lane (so the same bits). */
static inline __m512 widen16(int kind, const uint16_t *src) {
    __m256i h = _mm256_loadu_si256((const __m256i *)src);
    if (kind == FLOAT16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void narrow16(int kind, __m512 f, uint16_t *dst) {
    if (kind == FLOAT16) {
        _mm256_storeu_si256((__m256i *)dst, _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
        return;
    }
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (!_mm512_fpclass_ps_mask(f, 0x20)) { /* the instruction flushes denormals to zero: those take the long way */
        _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(f));
        return;
    }
#endif
    const __m512i u = _mm512_castps_si512(f), one = _mm512_set1_epi32(1);
    __m512i half = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, half), 16);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
}
#endif

static void widen(int kind, const uint16_t *src, float *acc, int64_t m) {
    int64_t i = 0;
#ifdef __F16C__
    if (kind == FLOAT16)
        for (; i + 8 <= m; i += 8) _mm256_storeu_ps(acc + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < m; i++) acc[i] = kind == BFLOAT16 ? from_bf16(src[i]) : from_f16(src[i]); /* (unswitched by -O3) */
}

/* acc += src widened (a sum's step without the widened copy: one pass, the same roundings). */
static void add_widened(int kind, float *acc, const uint16_t *src, int64_t m) {
    int64_t i = 0;
#ifdef __F16C__
    if (kind == FLOAT16)
        for (; i + 8 <= m; i += 8)
            _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i),
                                                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i)))));
#endif
    if (kind == BFLOAT16)
        for (; i < m; i++) acc[i] += from_bf16(src[i]);
    for (; i < m; i++) acc[i] += from_f16(src[i]);
}

static void narrow(int kind, const float *acc, uint16_t *dst, int64_t m) {
    int64_t i = 0;
    if (kind == BFLOAT16) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
        for (; i + 16 <= m; i += 16) narrow16(kind, _mm512_loadu_ps(acc + i), dst + i);
#endif
        for (; i < m; i++) dst[i] = to_bf16(acc[i]);
        return;
    }
#ifdef __F16C__
    for (; i + 8 <= m; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(acc + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < m; i++) dst[i] = to_f16(acc[i]);
}

/* acc <- acc op x for a product, min or max (a sum goes through add_widened). */
static void combine(int op, float *acc, const float *x, int64_t m) {
    int64_t i;
    switch (op) {
    case PROD: for (i = 0; i < m; i++) acc[i] *= x[i]; break;
    /* numpy's minimum / maximum: a NaN in either operand wins, the first operand on ties (-0.0 vs 0.0) */
    case MIN: for (i = 0; i < m; i++) acc[i] = (acc[i] <= x[i] || acc[i] != acc[i]) ? acc[i] : x[i]; break;
    case MAX: for (i = 0; i < m; i++) acc[i] = (acc[i] >= x[i] || acc[i] != acc[i]) ? acc[i] : x[i]; break;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* out <- round((x + y) / divisor) over the first multiple of 16 elements (two chunks' sum or avg, p = 2's case,
 * in one pass with nothing stored in between); returns how many it did. out may be x or y. */
static int64_t sum2_avx512(int kind, const uint16_t *x, const uint16_t *y, int64_t n, float divisor, uint16_t *out) {
    int64_t i = 0;
    if (divisor == 1.0f) {
        for (; i + 16 <= n; i += 16) narrow16(kind, _mm512_add_ps(widen16(kind, x + i), widen16(kind, y + i)), out + i);
    } else {
        const __m512 d = _mm512_set1_ps(divisor);
        for (; i + 16 <= n; i += 16)
            narrow16(kind, _mm512_div_ps(_mm512_add_ps(widen16(kind, x + i), widen16(kind, y + i)), d), out + i);
    }
    return i;
}
#endif

/* out[i] <- round((((chunks[0][i] op chunks[1][i]) op chunks[2][i]) ...) / divisor) with float32 in between.
 * out may be one of the chunks: each block is read whole before it is written. */
void reduce16(int kind, int op, const uint16_t *const *chunks, int count, int64_t n, float divisor, uint16_t *out) {
    float acc[BLOCK], x[BLOCK];
    int64_t done = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (op == SUM && count == 2) done = sum2_avx512(kind, chunks[0], chunks[1], n, divisor, out);
#endif
    for (int64_t start = done; start < n; start += BLOCK) {
        int64_t m = n - start < BLOCK ? n - start : BLOCK;
        widen(kind, chunks[0] + start, acc, m);
        for (int k = 1; k < count; k++) {
            if (op == SUM) {
                add_widened(kind, acc, chunks[k] + start, m);
                continue;
            }
            widen(kind, chunks[k] + start, x, m);
            combine(op, acc, x, m);
        }
        if (divisor != 1.0f)
            for (int64_t i = 0; i < m; i++) acc[i] /= divisor;
        narrow(kind, acc, out + start, m);
    }
}

/* In place: float bits become keys that sort as the floats do; NaN becomes the key that `op` (MIN/MAX) picks. */
void float_keys32(int32_t *bits, int64_t n, int op) {
    const int32_t nan_key = op == MAX ? INT32_MAX : INT32_MIN;
    for (int64_t i = 0; i < n; i++) {
        int32_t b = bits[i];
        int32_t key = b ^ ((b >> 31) & INT32_MAX); /* negative floats count down */
        bits[i] = (b & INT32_MAX) > 0x7f800000 ? nan_key : key;
    }
}

void float_keys64(int64_t *bits, int64_t n, int op) {
    const int64_t nan_key = op == MAX ? INT64_MAX : INT64_MIN;
    for (int64_t i = 0; i < n; i++) {
        int64_t b = bits[i];
        int64_t key = b ^ ((b >> 63) & INT64_MAX);
        bits[i] = (b & INT64_MAX) > 0x7ff0000000000000LL ? nan_key : key;
    }
}

/* In place: undo float_keys; every NaN becomes numpy's nan (the same bits on every rank). */
void from_keys32(int32_t *bits, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int32_t k = bits[i];
        int32_t b = k ^ ((k >> 31) & INT32_MAX);
        bits[i] = (b & INT32_MAX) > 0x7f800000 ? 0x7fc00000 : b;
    }
}

void from_keys64(int64_t *bits, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int64_t k = bits[i];
        int64_t b = k ^ ((k >> 63) & INT64_MAX);
        bits[i] = (b & INT64_MAX) > 0x7ff0000000000000LL ? 0x7ff8000000000000LL : b;
    }
}

/* In place: x / divisor (by 1 / divisor where that is a power of two: the same bits, as ReduceOp.finish does;
 * divisor 1: no change); returns whether x then holds a NaN. One pass for avg's finish and the NaN check after it.
 * out <- (a + b) / divisor likewise, rounded after the add and after the division as numpy's two passes are:
 * avg's last addition and its finish in one pass. (T: float for the 32-bit functions, double for the 64-bit.) */
#define FINISH(FINISH_NAME, ADD_FINISH_NAME, T)                                                                  \
    int FINISH_NAME(T *x, int64_t n, int64_t divisor) {                                                          \
        int nan = 0;                                                                                             \
        if (divisor == 1) {                                                                                      \
            for (int64_t i = 0; i < n; i++) nan |= x[i] != x[i];                                                 \
        } else if ((divisor & (divisor - 1)) == 0) {                                                             \
            const T factor = (T)(1.0 / (double)divisor);                                                         \
            for (int64_t i = 0; i < n; i++) {                                                                    \
                x[i] *= factor;                                                                                  \
                nan |= x[i] != x[i];                                                                             \
            }                                                                                                    \
        } else {                                                                                                 \
            const T d = (T)divisor;                                                                              \
            for (int64_t i = 0; i < n; i++) {                                                                    \
                x[i] /= d;                                                                                       \
                nan |= x[i] != x[i];                                                                             \
            }                                                                                                    \
        }                                                                                                        \
        return nan;                                                                                              \
    }                                                                                                            \
    void ADD_FINISH_NAME(const T *a, const T *b, T *out, int64_t n, int64_t divisor) {                           \
        if ((divisor & (divisor - 1)) == 0) {                                                                    \
            const T factor = (T)(1.0 / (double)divisor);                                                         \
            for (int64_t i = 0; i < n; i++) out[i] = (a[i] + b[i]) * factor;                                     \
        } else {                                                                                                 \
            const T d = (T)divisor;                                                                              \
            for (int64_t i = 0; i < n; i++) out[i] = (a[i] + b[i]) / d;                                          \
        }                                                                                                        \
    }
FINISH(finish32, add_finish32, float)
FINISH(finish64, add_finish64, double)

/* ---- wire codecs (mpcomm/compression.py): bitwise the numpy forms there. ---- */

/* dst <- x as float16 / bfloat16 (round to nearest even). */
void encode16(int kind, const float *x, uint16_t *dst, int64_t n) { narrow(kind, x, dst, n); }

/* out <- src widened to float32; with accumulate, out += it (one rounding: the add). */
void decode16(int kind, const uint16_t *src, float *out, int64_t n, int accumulate) {
    if (!accumulate) {
        widen(kind, src, out, n);
        return;
    }
    float x[BLOCK];
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t m = n - start < BLOCK ? n - start : BLOCK;
        widen(kind, src + start, x, m);
        for (int64_t i = 0; i < m; i++) out[start + i] += x[i];
    }
}

/* ---- a work array's casts (mpcomm/work_array.py). ---- */

/* dst <- src between float32 and float16 / bfloat16 (narrowing: from float32), a block at a time; 1, with the rest
 * left undone, at the first block that holds a NaN: numpy and ml_dtypes set a NaN's bits their own ways (payload,
 * quieting), so the caller converts the whole array again with them. */
int cast16(int kind, int narrowing, const void *src, void *dst, int64_t n) {
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t m = n - start < BLOCK ? n - start : BLOCK;
        const float *wide = narrowing ? (const float *)src + start : (const float *)dst + start;
        if (narrowing) narrow(kind, wide, (uint16_t *)dst + start, m);
        else widen(kind, (const uint16_t *)src + start, (float *)dst + start, m);
        int nan = 0;
        for (int64_t i = 0; i < m; i++) nan |= wide[i] != wide[i];
        if (nan) return 1;
    }
    return 0;
}

/* Per block of `block` elements: scale = absmax / 127, q = rint(x * (127 / absmax)) in [-127, 127]; a block with
 * a NaN or an infinity gets a NaN scale and q = 0 (it decodes to NaN); an all-zero block scale 0 and q = 0. */
void encode_int8(const float *x, int64_t n, int64_t block, float *scales, int8_t *q) {
    for (int64_t b = 0, start = 0; start < n; b++, start += block) {
        int64_t m = n - start < block ? n - start : block;
        const float *xs = x + start;
        uint32_t top = 0; /* the largest |x| as bits: positive floats order as their bits, NaN and inf on top */
        for (int64_t i = 0; i < m; i++) {
            uint32_t u;
            memcpy(&u, xs + i, 4);
            u &= 0x7fffffffu;
            top = u > top ? u : top;
        }
        if (top >= 0x7f800000u) {
            scales[b] = NAN;
            memset(q + start, 0, (size_t)m);
            continue;
        }
        float absmax;
        memcpy(&absmax, &top, 4);
        scales[b] = absmax / 127.0f;
        float inverse = absmax > 0.0f ? 127.0f / absmax : 0.0f;
        for (int64_t i = 0; i < m; i++) {
            float s = xs[i] * inverse;
            s = s > 127.0f ? 127.0f : s; /* (clamped before rounding: the same integers as after) */
            s = s < -127.0f ? -127.0f : s;
            q[start + i] = (int8_t)(int32_t)rintf(s);
        }
    }
}

/* out <- q * scale of its block (float32); with accumulate, out += it. */
void decode_int8(const float *scales, const int8_t *q, int64_t n, int64_t block, float *out, int accumulate) {
    for (int64_t b = 0, start = 0; start < n; b++, start += block) {
        int64_t m = n - start < block ? n - start : block;
        float scale = scales[b];
        if (accumulate)
            for (int64_t i = 0; i < m; i++) out[start + i] += (float)q[start + i] * scale;
        else
            for (int64_t i = 0; i < m; i++) out[start + i] = (float)q[start + i] * scale;
    }
}

#ifdef MPCOMM_PYTHON
/* ---- the key passes and avg's finish (alone, or with its last addition) as a Python extension too (importable as mpcomm._kernels): a call through ctypes costs
 * more than the pass itself on a small message, a METH_FASTCALL call a fraction of that. ---- */
/* Other threads run during a long pass, as they did while ctypes called the same functions (numpy's ufuncs too);
 * a short one keeps the GIL (letting it go would cost more than the pass). */
static PyThreadState *let_go_for(Py_ssize_t bytes) { return bytes > 8192 ? PyEval_SaveThread() : NULL; }

static void take_back(PyThreadState *state) {
    if (state != NULL) PyEval_RestoreThread(state);
}

/* The writable, C-contiguous buffer of args[0] with 4- or 8-byte items (float32/float64 or their integer
 * views); 0, or -1 with an exception set. */
static int key_buffer(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_buffer *view) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    if (PyObject_GetBuffer(args[0], view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->itemsize != 4 && view->itemsize != 8) {
        PyErr_Format(PyExc_TypeError, "expected 4- or 8-byte floats, got %zd-byte items", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *py_float_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_buffer view;
    if (key_buffer(args, nargs, 2, &view) < 0) return NULL;
    long op = PyLong_AsLong(args[1]);
    if (op == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int64_t n = view.len / view.itemsize;
    PyThreadState *state = let_go_for(view.len);
    if (view.itemsize == 4) float_keys32((int32_t *)view.buf, n, (int)op);
    else float_keys64((int64_t *)view.buf, n, (int)op);
    take_back(state);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *py_from_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_buffer view;
    if (key_buffer(args, nargs, 1, &view) < 0) return NULL;
    int64_t n = view.len / view.itemsize;
    PyThreadState *state = let_go_for(view.len);
    if (view.itemsize == 4) from_keys32((int32_t *)view.buf, n);
    else from_keys64((int64_t *)view.buf, n);
    take_back(state);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *py_finish(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_buffer view;
    if (key_buffer(args, nargs, 2, &view) < 0) return NULL;
    long long divisor = PyLong_AsLongLong(args[1]);
    if (divisor < 1) {
        PyBuffer_Release(&view);
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "divisor %lld: it must be at least 1", divisor);
        return NULL;
    }
    int64_t n = view.len / view.itemsize;
    PyThreadState *state = let_go_for(view.len);
    int nan = view.itemsize == 4 ? finish32((float *)view.buf, n, divisor) : finish64((double *)view.buf, n, divisor);
    take_back(state);
    PyBuffer_Release(&view);
    return PyBool_FromLong(nan);
}

static PyObject *py_add_finish(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_buffer a, b, out;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "expected 4 arguments, got %zd", nargs);
        return NULL;
    }
    long long divisor = PyLong_AsLongLong(args[3]);
    if (divisor < 1) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "divisor %lld: it must be at least 1", divisor);
        return NULL;
    }
    if (key_buffer(args + 2, 1, 1, &out) < 0) return NULL;
    if (PyObject_GetBuffer(args[0], &a, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &b, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&a);
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = Py_None;
    if (a.len != out.len || b.len != out.len || a.itemsize != out.itemsize || b.itemsize != out.itemsize) {
        PyErr_Format(PyExc_ValueError, "operands of %zd, %zd and %zd bytes: they must be alike", a.len, b.len, out.len);
        result = NULL;
    } else {
        PyThreadState *state = let_go_for(out.len);
        if (out.itemsize == 4)
            add_finish32((const float *)a.buf, (const float *)b.buf, (float *)out.buf, out.len / 4, divisor);
        else
            add_finish64((const double *)a.buf, (const double *)b.buf, (double *)out.buf, out.len / 8, divisor);
        take_back(state);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&out);
    Py_XINCREF(result);
    return result;
}

/* cast16(src, dst, kind): the C form of the same name from `src` into the writable `dst` (one of 4-byte, the other
 * of 2-byte items, as many of each; kind FLOAT16 or BFLOAT16) -> False at the first block with a NaN, else True. */
static PyObject *py_cast16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_buffer src, dst;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "expected 3 arguments, got %zd", nargs);
        return NULL;
    }
    long kind = PyLong_AsLong(args[2]);
    if (kind == -1 && PyErr_Occurred()) return NULL;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    int narrowing = src.itemsize == 4;
    if ((kind != FLOAT16 && kind != BFLOAT16) || src.itemsize != (narrowing ? 4 : 2) ||
        dst.itemsize != (narrowing ? 2 : 4) || src.len / src.itemsize != dst.len / dst.itemsize) {
        PyErr_Format(PyExc_ValueError, "cast16: %zd items of %zd bytes into %zd of %zd (kind %ld): expected as many "
                     "float32 and 16-bit ones", src.len / (src.itemsize ? src.itemsize : 1), src.itemsize,
                     dst.len / (dst.itemsize ? dst.itemsize : 1), dst.itemsize, kind);
    } else {
        PyThreadState *state = let_go_for(dst.len);
        int nan = cast16((int)kind, narrowing, src.buf, dst.buf, src.len / src.itemsize);
        take_back(state);
        result = nan ? Py_False : Py_True;
        Py_INCREF(result);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* reduce16(chunks, out, kind, op, divisor): the C form of the same name over the sequence `chunks` (2-byte items,
 * as many as the writable `out`'s; `out` may be chunks[0]), into `out`. */
static PyObject *py_reduce16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    enum { MOST = 64 };
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "expected 5 arguments, got %zd", nargs);
        return NULL;
    }
    long kind = PyLong_AsLong(args[2]), op = PyLong_AsLong(args[3]);
    double divisor = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return NULL;
    PyObject *sequence = PySequence_Fast(args[0], "reduce16: chunks must be a sequence");
    if (sequence == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence), taken = 0;
    Py_buffer views[MOST], out;
    const uint16_t *chunks[MOST];
    PyObject *result = NULL;
    if (count < 1 || count > MOST || (kind != FLOAT16 && kind != BFLOAT16)) {
        PyErr_Format(PyExc_ValueError, "reduce16: %zd chunks (1 to %d) of kind %ld", count, MOST, kind);
        Py_DECREF(sequence);
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(sequence);
        return NULL;
    }
    for (; taken < count; taken++) {
        Py_buffer *view = &views[taken];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sequence, taken), view, PyBUF_C_CONTIGUOUS) < 0) break;
        chunks[taken] = view->buf;
        if (view->len != out.len || view->itemsize != 2 || out.itemsize != 2) {
            PyErr_Format(PyExc_ValueError, "reduce16: chunk %zd has %zd bytes of %zd-byte items, out %zd of %zd: "
                         "expected alike, 2-byte", taken, view->len, view->itemsize, out.len, out.itemsize);
            taken++;
            break;
        }
    }
    if (!PyErr_Occurred()) {
        PyThreadState *state = let_go_for(out.len * count);
        reduce16((int)kind, (int)op, chunks, (int)count, out.len / 2, (float)divisor, out.buf);
        take_back(state);
        result = Py_NewRef(Py_None);
    }
    for (Py_ssize_t i = 0; i < taken; i++) PyBuffer_Release(&views[i]);
    PyBuffer_Release(&out);
    Py_DECREF(sequence);
    return result;
}

static PyMethodDef methods[] = {
    {"float_keys", (PyCFunction)(void (*)(void))py_float_keys, METH_FASTCALL, "float_keys(floats, op): in place"},
    {"from_keys", (PyCFunction)(void (*)(void))py_from_keys, METH_FASTCALL, "from_keys(keys): in place"},
    {"finish", (PyCFunction)(void (*)(void))py_finish, METH_FASTCALL, "finish(floats, divisor) -> has NaN"},
    {"add_finish", (PyCFunction)(void (*)(void))py_add_finish, METH_FASTCALL, "add_finish(a, b, out, divisor)"},
    {"cast16", (PyCFunction)(void (*)(void))py_cast16, METH_FASTCALL, "cast16(src, dst, kind) -> no NaN met"},
    {"reduce16", (PyCFunction)(void (*)(void))py_reduce16, METH_FASTCALL, "reduce16(chunks, out, kind, op, divisor)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
#endif
