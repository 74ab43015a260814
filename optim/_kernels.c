/* farloco.optim._kernels: one-pass blockwise absmax quantization for the int8 / int4 codecs, and the outer
   strategies' elementwise passes (contributions, outer steps, merge, preview) in one pass each (`elementwise`).

   The eager-torch path in optim/dense.py takes about six memory passes per value (amin, amax, divide, round,
   clamp, cast) and two more to rebuild the decoded values; these loops do it in one pass per block, in L1.
   The arithmetic is the torch path's, operation for operation, so the bytes and the decoded values are the
   same with or without this module (tests/unit/test_kernels.py checks that):
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

/* The outer strategies' elementwise passes, one pass each (optim/strategies.py runs the same operations as
   separate torch ops, chunk by chunk, where these are not built). Each multiply and add is rounded to float32 on
   its own, in the torch path's order (no fused multiply-add: setup.py builds with -ffp-contract=off; an add is
   commutative, a product of two roundings is not reassociated), so the bits are the torch path's. */

/* DiLoCo's Nesterov step, torch.optim.SGD(nesterov=True): b <- b*mu + g; theta <- theta - (b*mu + g)*lr. */
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

/* out <- (a - b) + c: DiLoCo's contribution with its error-feedback residual. */
FARLOCO_CLONES
static void sub_add_all(float *out, const float *a, const float *b, const float *c, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float d = a[i] - b[i];
        out[i] = d + c[i];
    }
}

/* out <- state*decay + (a - b): SparseLoCo's and DeMo's contribution. */
FARLOCO_CLONES
static void decay_add_all(float *out, const float *state, const float *a, const float *b, Py_ssize_t n,
                          float decay) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float d = a[i] - b[i];
        float kept = state[i] * decay;
        out[i] = kept + d;
    }
}

/* x <- x*alpha + y*beta: Streaming DiLoCo's merge of theta_outer (y) into the ranks' weights (x). */
FARLOCO_CLONES
static void blend_all(float *x, const float *y, Py_ssize_t n, float alpha, float beta) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float other = y[i] * beta;
        float own = x[i] * alpha;
        x[i] = own + other;
    }
}

/* x <- x - (a - b)*scale: the eager update's preview (a: the fresh contribution, b: the stale one). */
FARLOCO_CLONES
static void sub_diff_all(float *x, const float *a, const float *b, Py_ssize_t n, float scale) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float d = a[i] - b[i];
        d = d * scale;
        x[i] = x[i] - d;
    }
}

/* x <- x - y*scale: SparseLoCo's outer step. */
FARLOCO_CLONES
static void sub_scaled_all(float *x, const float *y, Py_ssize_t n, float scale) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float step = y[i] * scale;
        x[i] = x[i] - step;
    }
}

/* x <- x*keep - sign(y)*lr: DeMo's sign step with decoupled weight decay (keep = 1 - lr*wd; 1 multiplies
   exactly, as the torch path's skipped multiply). sign is torch.sign's: +0 for either zero. */
FARLOCO_CLONES
static void sign_step_all(float *x, const float *y, Py_ssize_t n, float keep, float lr) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float kept = x[i] * keep;
        float sign = (float)((y[i] > 0.0f) - (y[i] < 0.0f));
        float step = sign * lr;
        x[i] = kept - step;
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

/* The elementwise kernels by number (optim/strategies.py `_Op`): buffers (the written ones first), scalars. */
enum { OP_NESTEROV, OP_SUB_ADD, OP_DECAY_ADD, OP_BLEND, OP_SUB_DIFF, OP_SUB_SCALED, OP_SIGN_STEP, OP_COUNT };
static const struct {
    const char *name;
    int buffers, written, scalars;
} OPS[OP_COUNT] = {
    {"nesterov", 3, 2, 2}, {"sub_add", 4, 1, 0}, {"decay_add", 4, 1, 1},
    {"blend", 2, 1, 2},    {"sub_diff", 3, 1, 1}, {"sub_scaled", 2, 1, 1},
    {"sign_step", 2, 1, 2},
};

/* Whether two buffers of `len` bytes share some bytes without being the same buffer. */
static int shifted(const char *a, const char *b, Py_ssize_t len) {
    return a != b && a < b + len && b < a + len;
}

/* elementwise(op, buffers, scalars) -> None: the float32 vectors of one length in `buffers` (a tuple, the
   written ones first) updated by kernel `op`. A written buffer is either another buffer itself (each value is read
   before its own is written) or apart from it; Nesterov's three are apart. */
static PyObject *elementwise(PyObject *self, PyObject *args) {
    int op;
    PyObject *buffers, *scalars;
    if (!PyArg_ParseTuple(args, "iO!O!", &op, &PyTuple_Type, &buffers, &PyTuple_Type, &scalars)) {
        return NULL;
    }
    if (op < 0 || op >= OP_COUNT) {
        PyErr_Format(PyExc_ValueError, "elementwise: expected an op in [0, %d), got %d", OP_COUNT, op);
        return NULL;
    }
    const char *name = OPS[op].name;
    int count = OPS[op].buffers, written = OPS[op].written;
    if (PyTuple_GET_SIZE(buffers) != count || PyTuple_GET_SIZE(scalars) != OPS[op].scalars) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d buffers and %d scalars, got %zd and %zd", name, count,
                     OPS[op].scalars, PyTuple_GET_SIZE(buffers), PyTuple_GET_SIZE(scalars));
        return NULL;
    }
    float k[2] = {0.0f, 0.0f};
    for (int i = 0; i < OPS[op].scalars; i++) {
        double value = PyFloat_AsDouble(PyTuple_GET_ITEM(scalars, i));
        if (value == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
        k[i] = (float)value; /* as torch casts a Python scalar for a float32 tensor */
    }
    Py_buffer views[4];
    for (int i = 0; i < count; i++) {
        if (get_buffer(PyTuple_GET_ITEM(buffers, i), &views[i], i < written, name) < 0) {
            for (int j = 0; j < i; j++) {
                PyBuffer_Release(&views[j]);
            }
            return NULL;
        }
    }
    Py_ssize_t len = views[0].len;
    const char *problem = NULL;
    for (int i = 0; i < count && !problem; i++) {
        if (views[i].len % 4 || views[i].len != len) {
            PyErr_Format(PyExc_ValueError, "%s: expected %d float32 vectors of one length, got %zd and %zd bytes",
                         name, count, len, views[i].len);
            problem = name;
        }
    }
    for (int i = 0; i < written && !problem; i++) {
        for (int j = 0; j < count && !problem; j++) {
            const char *a = views[i].buf, *b = views[j].buf;
            if (i != j && len > 0 && (shifted(a, b, len) || (op == OP_NESTEROV && a == b))) {
                PyErr_Format(PyExc_ValueError, "%s: expected buffer %d %s buffer %d", name, i,
                             op == OP_NESTEROV ? "apart from" : "to be or be apart from", j);
                problem = name;
            }
        }
    }
    if (!problem) {
        float *v[4];
        for (int i = 0; i < count; i++) {
            v[i] = views[i].buf;
        }
        Py_ssize_t n = len / 4;
        Py_BEGIN_ALLOW_THREADS
        switch (op) {
        case OP_NESTEROV: nesterov_all(v[0], v[1], v[2], n, k[0], k[1]); break;
        case OP_SUB_ADD: sub_add_all(v[0], v[1], v[2], v[3], n); break;
        case OP_DECAY_ADD: decay_add_all(v[0], v[1], v[2], v[3], n, k[0]); break;
        case OP_BLEND: blend_all(v[0], v[1], n, k[0], k[1]); break;
        case OP_SUB_DIFF: sub_diff_all(v[0], v[1], v[2], n, k[0]); break;
        case OP_SUB_SCALED: sub_scaled_all(v[0], v[1], n, k[0]); break;
        case OP_SIGN_STEP: sign_step_all(v[0], v[1], n, k[0], k[1]); break;
        }
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < count; i++) {
        PyBuffer_Release(&views[i]);
    }
    if (problem) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS,
     "quantize(x, block, levels, scales, codes, decoded) -> -1 or the first block holding NaN/Inf"},
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(scales, codes, block, out) -> -1 or the first block holding the code -128"},
    {"elementwise", elementwise, METH_VARARGS,
     "elementwise(op, buffers, scalars) -> None: an outer strategy's elementwise pass (see OPS)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "farloco.optim._kernels",
    "One-pass blockwise absmax quantization for farloco's int8 / int4 codecs (see optim/dense.py), and the outer "
    "strategies' elementwise passes (optim/strategies.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
