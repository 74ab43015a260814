/* farloco.optim._kernels: one-pass blockwise absmax quantization for the int8 / int4 codecs, and DiLoCo's
   contribution and outer step in one pass each (see nesterov_all below).

   The eager-torch path in optim/dense.py takes about six memory passes per value (amin, amax, divide, round,
   clamp, cast) and two more to rebuild the decoded values; these loops do it in one pass per block, in L1.
   The arithmetic is the torch path's, operation for operation, so the bytes and the decoded values are the
   same with or without this module (tests/test_kernels.py checks that):
     scale = absmax / levels                          (float32 division)
     code  = clamp(round_half_even(x / (scale > 0 ? scale : 1)), -levels, levels)
     value = (float)code * scale                      (one float32 multiplication)
   Built by setup.py as an optional extension: without a C compiler farloco falls back to torch. No Python
   objects are touched while the GIL is released. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* An AVX2 clone beside the baseline one, picked at load time by the CPU (glibc ifunc). */
#define FARLOCO_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FARLOCO_CLONES
#endif

/* round-half-to-even of |v| < 2^22 under the default rounding mode, as torch.round does; (v + M) - M is not
   folded away without -ffast-math, and unlike rintf it vectorizes on every x86-64. */
static const float ROUND_MAGIC = 12582912.0f; /* 1.5 * 2^23 */

static inline uint32_t float_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static inline float bits_float(uint32_t u) {
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Quantize one block of n values. Returns 0, or 1 if a value is NaN/Inf. Inlined into the loops below, so
   that the CPU dispatch (target_clones) happens once per call, not once per block. */
static inline int quantize_block(const float *restrict x, Py_ssize_t n, float levels, float *restrict scale_out,
                                 int8_t *restrict codes, float *restrict decoded) {
    /* max |x| on the bit patterns: for non-negative floats they order like the values, and every NaN/Inf
       pattern is >= 0x7f800000, so one integer max-reduction gives the absmax and the finiteness check. */
    uint32_t top = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = float_bits(x[i]) & 0x7fffffffu;
        top = u > top ? u : top;
    }
    if (top >= 0x7f800000u) {
        return 1;
    }
    float scale = bits_float(top) / levels;
    float safe = scale > 0.0f ? scale : 1.0f;
    *scale_out = scale;
    for (Py_ssize_t i = 0; i < n; i++) {
        float q = (x[i] / safe + ROUND_MAGIC) - ROUND_MAGIC;
        q = q > levels ? levels : q;
        q = q < -levels ? -levels : q;
        int8_t c = (int8_t)q;
        codes[i] = c;
        if (decoded) {
            decoded[i] = (float)c * scale;
        }
    }
    return 0;
}

/* Every block; returns -1 or the first block holding NaN/Inf. */
FARLOCO_CLONES
static Py_ssize_t quantize_all(const float *restrict x, Py_ssize_t numel, Py_ssize_t block, float levels,
                               float *restrict scales, int8_t *restrict codes, float *restrict decoded) {
    Py_ssize_t blocks = (numel + block - 1) / block;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t start = b * block;
        Py_ssize_t n = numel - start < block ? numel - start : block;
        if (quantize_block(x + start, n, levels, scales + b, codes + start, decoded ? decoded + start : NULL)) {
            return b;
        }
    }
    return -1;
}

/* Every block; returns -1 or the first block holding the code -128. */
FARLOCO_CLONES
static Py_ssize_t dequantize_all(const float *restrict scales, const int8_t *restrict codes, Py_ssize_t numel,
                                 Py_ssize_t block, float *restrict out) {
    Py_ssize_t blocks = (numel + block - 1) / block;
    Py_ssize_t first_bad = -1;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t start = b * block;
        Py_ssize_t n = numel - start < block ? numel - start : block;
        float scale = scales[b];
        int bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            int8_t c = codes[start + i];
            bad |= c == -128;
            out[start + i] = (float)c * scale;
        }
        if (bad && first_bad < 0) {
            first_bad = b;
        }
    }
    return first_bad;
}

/* DiLoCo's outer step, torch.optim.SGD(nesterov=True), in one pass (optim/strategies.py `_nesterov_step` does
   the same operations as separate torch ops, chunk by chunk): b <- b*mu + g; theta <- theta - (b*mu + g)*lr,
   each multiply and add rounded to float32 on its own, in that order (no fused multiply-add: setup.py builds
   with -ffp-contract=off), so the bits are the torch path's. */
FARLOCO_CLONES
static void nesterov_all(float *theta, float *buf, const float *grad, Py_ssize_t n, float lr, float mu) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float g = grad[i];
        float b = buf[i] * mu;
        b = b + g;
        buf[i] = b;
        float step = b * mu;
        step = step + g;
        step = step * lr;
        theta[i] = theta[i] - step;
    }
}

/* out <- (a - b) + c, two float32 roundings (DiLoCo's contribution with its error-feedback residual: (theta_outer
   - theta_local) + residual). out may be any of the inputs. */
FARLOCO_CLONES
static void sub_add_all(const float *a, const float *b, const float *c, float *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float d = a[i] - b[i];
        out[i] = d + c[i];
    }
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* quantize(x, block, levels, scales, codes, decoded_or_None) -> -1, or the index of the first block with a
   NaN/Inf (nothing after it is written). */
static PyObject *quantize(PyObject *self, PyObject *args) {
    PyObject *x_obj, *scales_obj, *codes_obj, *decoded_obj;
    Py_ssize_t block;
    float levels;
    if (!PyArg_ParseTuple(args, "OnfOOO", &x_obj, &block, &levels, &scales_obj, &codes_obj, &decoded_obj)) {
        return NULL;
    }
    if (block < 1 || !(levels >= 1.0f && levels <= 127.0f)) {
        PyErr_Format(PyExc_ValueError, "quantize: expected block >= 1 and 1 <= levels <= 127, got %zd, %f",
                     block, (double)levels);
        return NULL;
    }
    Py_buffer x, scales, codes, decoded = {0};
    int have_decoded = decoded_obj != Py_None;
    if (get_buffer(x_obj, &x, 0, "x") < 0) {
        return NULL;
    }
    if (get_buffer(scales_obj, &scales, 1, "scales") < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (get_buffer(codes_obj, &codes, 1, "codes") < 0) {
        PyBuffer_Release(&x);
        PyBuffer_Release(&scales);
        return NULL;
    }
    if (have_decoded && get_buffer(decoded_obj, &decoded, 1, "decoded") < 0) {
        PyBuffer_Release(&x);
        PyBuffer_Release(&scales);
        PyBuffer_Release(&codes);
        return NULL;
    }
    Py_ssize_t numel = x.len / 4;
    Py_ssize_t blocks = (numel + block - 1) / block;
    Py_ssize_t bad = -1;
    if (x.len % 4 || scales.len != 4 * blocks || codes.len != numel || (have_decoded && decoded.len != x.len)) {
        PyErr_Format(PyExc_ValueError,
                     "quantize: expected %zd float32 values, %zd scales, %zd codes and %zd decoded bytes; got "
                     "%zd, %zd, %zd and %zd bytes",
                     numel, blocks, numel, have_decoded ? x.len : 0, x.len, scales.len, codes.len,
                     have_decoded ? decoded.len : 0);
        bad = -2;
    } else {
        const float *xs = (const float *)x.buf;
        float *sc = (float *)scales.buf;
        int8_t *cd = (int8_t *)codes.buf;
        float *dq = have_decoded ? (float *)decoded.buf : NULL;
        Py_BEGIN_ALLOW_THREADS
        bad = quantize_all(xs, numel, block, levels, sc, cd, dq);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&codes);
    if (have_decoded) {
        PyBuffer_Release(&decoded);
    }
    if (bad == -2) {
        return NULL;
    }
    return PyLong_FromSsize_t(bad);
}

/* dequantize(scales, codes, block, out) -> -1, or the index of the first block holding the code -128 (int8's
   invalid code). The scales must have been checked finite and >= 0 by the caller. */
static PyObject *dequantize(PyObject *self, PyObject *args) {
    PyObject *scales_obj, *codes_obj, *out_obj;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "OOnO", &scales_obj, &codes_obj, &block, &out_obj)) {
        return NULL;
    }
    if (block < 1) {
        PyErr_Format(PyExc_ValueError, "dequantize: expected block >= 1, got %zd", block);
        return NULL;
    }
    Py_buffer scales, codes, out;
    if (get_buffer(scales_obj, &scales, 0, "scales") < 0) {
        return NULL;
    }
    if (get_buffer(codes_obj, &codes, 0, "codes") < 0) {
        PyBuffer_Release(&scales);
        return NULL;
    }
    if (get_buffer(out_obj, &out, 1, "out") < 0) {
        PyBuffer_Release(&scales);
        PyBuffer_Release(&codes);
        return NULL;
    }
    Py_ssize_t numel = codes.len;
    Py_ssize_t blocks = (numel + block - 1) / block;
    Py_ssize_t bad = -1;
    if (scales.len != 4 * blocks || out.len != 4 * numel) {
        PyErr_Format(PyExc_ValueError,
                     "dequantize: expected %zd scale bytes and %zd output bytes for %zd codes; got %zd and %zd",
                     4 * blocks, 4 * numel, numel, scales.len, out.len);
        bad = -2;
    } else {
        const float *sc = (const float *)scales.buf;
        const int8_t *cd = (const int8_t *)codes.buf;
        float *o = (float *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        bad = dequantize_all(sc, cd, numel, block, o);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&scales);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&out);
    if (bad == -2) {
        return NULL;
    }
    return PyLong_FromSsize_t(bad);
}

/* The float32 buffers of an elementwise kernel: `count` of them (the first `writable` writable), all of one
   length; 0, or -1 with an exception set and nothing held. */
static int get_vectors(PyObject **objs, Py_buffer *views, int count, int writable, const char *what) {
    for (int i = 0; i < count; i++) {
        if (get_buffer(objs[i], &views[i], i < writable, what) < 0) {
            for (int j = 0; j < i; j++) {
                PyBuffer_Release(&views[j]);
            }
            return -1;
        }
    }
    for (int i = 0; i < count; i++) {
        if (views[i].len % 4 || views[i].len != views[0].len) {
            PyErr_Format(PyExc_ValueError, "%s: expected %d float32 vectors of one length, got %zd and %zd bytes",
                         what, count, views[0].len, views[i].len);
            for (int j = 0; j < count; j++) {
                PyBuffer_Release(&views[j]);
            }
            return -1;
        }
    }
    return 0;
}

/* nesterov(theta, buf, grad, lr, mu) -> None: theta and buf updated in place. theta and buf must not overlap
   each other or grad (the step would read what it wrote). */
static PyObject *nesterov(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    float lr, mu;
    if (!PyArg_ParseTuple(args, "OOOff", &objs[0], &objs[1], &objs[2], &lr, &mu)) {
        return NULL;
    }
    Py_buffer views[3];
    if (get_vectors(objs, views, 3, 2, "nesterov") < 0) {
        return NULL;
    }
    char *t = views[0].buf, *b = views[1].buf, *g = views[2].buf;
    Py_ssize_t len = views[0].len;
    int overlap = (t < b + len && b < t + len) || (t < g + len && g < t + len) || (b < g + len && g < b + len);
    if (overlap && len > 0) {
        PyErr_SetString(PyExc_ValueError, "nesterov: expected theta, buf and grad in three separate buffers");
    } else {
        Py_BEGIN_ALLOW_THREADS
        nesterov_all((float *)t, (float *)b, (const float *)g, len / 4, lr, mu);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < 3; i++) {
        PyBuffer_Release(&views[i]);
    }
    if (overlap && len > 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* sub_add(a, b, c, out) -> None: out <- (a - b) + c; out may be a, b or c itself (each value is read before
   its own is written), not part of one shifted. */
static PyObject *sub_add(PyObject *self, PyObject *args) {
    PyObject *objs[4]; /* out first: get_vectors takes the writable ones first */
    if (!PyArg_ParseTuple(args, "OOOO", &objs[1], &objs[2], &objs[3], &objs[0])) {
        return NULL;
    }
    Py_buffer views[4];
    if (get_vectors(objs, views, 4, 1, "sub_add") < 0) {
        return NULL;
    }
    char *out = views[0].buf;
    Py_ssize_t len = views[0].len;
    int shifted = 0;
    for (int i = 1; i < 4; i++) {
        char *in = views[i].buf;
        shifted |= in != out && in < out + len && out < in + len;
    }
    if (shifted) {
        PyErr_SetString(PyExc_ValueError, "sub_add: expected out to be an input or apart from every input");
    } else {
        Py_BEGIN_ALLOW_THREADS
        sub_add_all((const float *)views[1].buf, (const float *)views[2].buf, (const float *)views[3].buf,
                    (float *)out, len / 4);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < 4; i++) {
        PyBuffer_Release(&views[i]);
    }
    if (shifted) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS,
     "quantize(x, block, levels, scales, codes, decoded) -> -1 or the first block holding NaN/Inf"},
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(scales, codes, block, out) -> -1 or the first block holding the code -128"},
    {"nesterov", nesterov, METH_VARARGS,
     "nesterov(theta, buf, grad, lr, mu) -> None: b <- b*mu + g; theta <- theta - (b*mu + g)*lr, in place"},
    {"sub_add", sub_add, METH_VARARGS, "sub_add(a, b, c, out) -> None: out <- (a - b) + c"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "farloco.optim._kernels",
    "One-pass blockwise absmax quantization for farloco's int8 / int4 codecs (see optim/dense.py), and DiLoCo's "
    "contribution and outer step (optim/strategies.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
