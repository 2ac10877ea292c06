/* FP8 (e4m3fn) KV-cache write for vLLM's CPU cache layout ("vec"), in C.
 *
 * The same bytes as kvscale_plugin/kernels/cpu_cache_write.py's torch path, i.e.
 * kvscale's contract
 *
 *     (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
 *
 * (IEEE fp32 division, saturation to +-448, round to nearest even, NaN kept as NaN
 * with its sign, -0 kept), for every token whose slot is >= 0, in one call for K and V
 * and with no temporary tensors. It is a plain CPython extension (no torch headers):
 * the Python side passes data pointers, torch.Size / stride tuples and dtype objects,
 * which write() checks before it touches memory; a call costs less than one small
 * torch op. Built on first use by
 * cpu_native.py with the machine's C compiler.
 *
 * Build flags must keep IEEE semantics: no -ffast-math (the division and the
 * subnormal rounding below rely on fp32 round-to-nearest-even arithmetic).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float from_bf16(uint16_t h) { return float_of((uint32_t)h << 16); }

static inline float from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13)); /* inf / NaN */
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in fp32 */
        float v = (float)mant * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* fp32 -> e4m3fn byte, round to nearest even; |y| >= 480 and NaN give 0x7f (the input
 * is clamped to +-448 first, so only NaN gets there). The algorithm of c10's
 * fp8e4m3fn_from_fp32_value, which torch's .to(torch.float8_e4m3fn) uses, written
 * without branches (both paths computed, one selected) so that the compiler can
 * vectorize the loops over head_size. */
static inline uint8_t e4m3_of(float y) {
    const uint32_t fp8_max = UINT32_C(1087) << 20;
    const uint32_t denorm_mask = UINT32_C(141) << 23;
    uint32_t f = bits_of(y);
    const uint32_t sign = f & UINT32_C(0x80000000);
    f ^= sign;
    /* below 2^-6: the fp32 adder rounds the subnormal mantissa */
    uint32_t sub = bits_of(float_of(f) + float_of(denorm_mask)) - denorm_mask;
    uint32_t normal = (f + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((f >> 20) & 1u)) >> 20;
    uint32_t result = f < (UINT32_C(121) << 23) ? sub : normal;
    result = f >= fp8_max ? 0x7fu : result;
    return (uint8_t)(result | (sign >> 24));
}

static inline uint8_t quantize(float x, float s) {
    float y = x / s;
    /* clamp that keeps NaN (comparisons with NaN are false) */
    y = y > 448.0f ? 448.0f : y;
    y = y < -448.0f ? -448.0f : y;
    return e4m3_of(y);
}

/* One token-head: V contiguous; K transposed (k_dst[d * block_size]), so K's bytes
 * are computed into a small buffer first (a vectorizable loop) and then stored. */
#define MAX_HEAD_SIZE 1024
#define DEFINE_ROW(NAME, TYPE, LOAD)                                                   \
    static void NAME(const void *kp, const void *vp, uint8_t *k_dst, uint8_t *v_dst,    \
                     Py_ssize_t block_size, Py_ssize_t head_size, float ks, float vs) { \
        const TYPE *restrict k = (const TYPE *)kp;                                      \
        const TYPE *restrict v = (const TYPE *)vp;                                      \
        uint8_t buf[MAX_HEAD_SIZE];                                                     \
        for (Py_ssize_t d = 0; d < head_size; d++) buf[d] = quantize(LOAD(k[d]), ks);   \
        for (Py_ssize_t d = 0; d < head_size; d++) k_dst[d * block_size] = buf[d];      \
        for (Py_ssize_t d = 0; d < head_size; d++) v_dst[d] = quantize(LOAD(v[d]), vs); \
    }

#define LOAD_F32(x) (x)
DEFINE_ROW(row_f32, float, LOAD_F32)
DEFINE_ROW(row_bf16, uint16_t, from_bf16)
DEFINE_ROW(row_f16, uint16_t, from_f16)

typedef void (*row_fn)(const void *, const void *, uint8_t *, uint8_t *, Py_ssize_t,
                       Py_ssize_t, float, float);

/* torch dtype objects, registered by setup(): write() tells dtypes by identity. */
enum { F32, BF16, F16, I32, I64, N_DTYPES };
static PyObject *dtypes[N_DTYPES];

static PyObject *setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != N_DTYPES) {
        PyErr_SetString(PyExc_TypeError,
                        "setup(float32, bfloat16, float16, int32, int64) expected");
        return NULL;
    }
    for (int i = 0; i < N_DTYPES; i++) {
        Py_XDECREF(dtypes[i]);
        Py_INCREF(args[i]);
        dtypes[i] = args[i];
    }
    Py_RETURN_NONE;
}

static int dtype_index(PyObject *dtype) {
    for (int i = 0; i < N_DTYPES; i++)
        if (dtypes[i] == dtype) return i;
    return -1;
}

/* n ints from a tuple (torch.Size is a tuple); -1 and an exception if it is not one
 * of that length. */
static int ints_of(PyObject *tuple, Py_ssize_t n, Py_ssize_t *out, const char *what) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != n) {
        PyErr_Format(PyExc_ValueError, "%s must be a tuple of %zd ints", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(tuple, i));
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static int pointer_of(PyObject *obj, char **out) {
    *out = (char *)PyLong_AsVoidPtr(obj);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

enum { N_ARGS = 15 };

/* write(key_ptr, key_shape, key_stride, key_dtype,
 *       value_ptr, value_shape, value_stride, value_dtype,
 *       target, slot_ptr, slot_shape, slot_stride, slot_dtype, k_scale, v_scale)
 *   -> number of tokens written
 *
 * target: (cache_ptr, block_stride, head_stride, num_blocks, block_size, num_heads,
 * head_size), cache strides in bytes. key / value: [>= tokens, num_heads, head_size],
 * strides in elements, last one 1, one dtype among float32 / bfloat16 / float16.
 * slot: 1-d contiguous int32 / int64; slots < 0 are skipped, a slot beyond the cache
 * raises IndexError before anything is written. Anything else: ValueError, before
 * any pointer is read.
 */
static PyObject *write_kv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != N_ARGS) {
        PyErr_Format(PyExc_TypeError, "write() takes %d arguments (%zd given)", N_ARGS,
                     nargs);
        return NULL;
    }
    if (dtypes[0] == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "setup() was not called");
        return NULL;
    }
    char *key, *value, *slots, *cache;
    Py_ssize_t kshape[3], kst[3], vshape[3], vst[3], tgt[7], sshape[1], sst[1];
    if (pointer_of(args[0], &key) || ints_of(args[1], 3, kshape, "key shape") ||
        ints_of(args[2], 3, kst, "key stride") || pointer_of(args[4], &value) ||
        ints_of(args[5], 3, vshape, "value shape") ||
        ints_of(args[6], 3, vst, "value stride") || ints_of(args[8], 7, tgt, "target") ||
        pointer_of(args[9], &slots) || ints_of(args[10], 1, sshape, "slot_mapping shape") ||
        ints_of(args[11], 1, sst, "slot_mapping stride"))
        return NULL;
    const double k_scale = PyFloat_AsDouble(args[13]);
    if (k_scale == -1.0 && PyErr_Occurred()) return NULL;
    const double v_scale = PyFloat_AsDouble(args[14]);
    if (v_scale == -1.0 && PyErr_Occurred()) return NULL;
    cache = (char *)tgt[0];
    const Py_ssize_t sb = tgt[1], sh = tgt[2], num_blocks = tgt[3], block_size = tgt[4];
    const Py_ssize_t num_heads = tgt[5], head_size = tgt[6];
    const Py_ssize_t num_tokens = sshape[0];
    const int kd = dtype_index(args[3]), vd = dtype_index(args[7]), sd = dtype_index(args[12]);
    if (kd < 0 || kd > F16 || vd != kd) {
        PyErr_SetString(PyExc_ValueError,
                        "key and value must have one dtype among float32/bfloat16/float16");
        return NULL;
    }
    if (sd != I32 && sd != I64) {
        PyErr_SetString(PyExc_ValueError, "slot_mapping must be int32 or int64");
        return NULL;
    }
    if (block_size <= 0 || num_blocks < 0 || head_size <= 0 || head_size > MAX_HEAD_SIZE) {
        PyErr_Format(PyExc_ValueError, "bad cache target (block_size %zd, head_size %zd)",
                     block_size, head_size);
        return NULL;
    }
    if (kshape[1] != num_heads || kshape[2] != head_size || vshape[1] != num_heads ||
        vshape[2] != head_size || kshape[0] < num_tokens || vshape[0] < num_tokens) {
        PyErr_Format(PyExc_ValueError,
                     "key %zdx%zdx%zd / value %zdx%zdx%zd do not fit %zd tokens x %zd KV "
                     "heads x head size %zd",
                     kshape[0], kshape[1], kshape[2], vshape[0], vshape[1], vshape[2],
                     num_tokens, num_heads, head_size);
        return NULL;
    }
    if (kst[2] != 1 || vst[2] != 1 || (num_tokens > 1 && sst[0] != 1)) {
        PyErr_SetString(PyExc_ValueError,
                        "key/value need a contiguous last dimension and slot_mapping a "
                        "contiguous one");
        return NULL;
    }
    row_fn row = kd == F32 ? row_f32 : kd == BF16 ? row_bf16 : row_f16;
    const Py_ssize_t elem = kd == F32 ? 4 : 2;
    const int slot64 = sd == I64;
    const float ks = (float)k_scale, vs = (float)v_scale;
    const long long limit = (long long)num_blocks * block_size;
#define SLOT(t) (slot64 ? ((const int64_t *)slots)[t] : (int64_t)((const int32_t *)slots)[t])
    for (Py_ssize_t t = 0; t < num_tokens; t++) {
        int64_t s = SLOT(t);
        if (s >= limit) {
            PyErr_Format(PyExc_IndexError,
                         "slot %lld of token %zd is beyond the cache (%lld slots)",
                         (long long)s, t, limit);
            return NULL;
        }
    }
    const Py_ssize_t plane = block_size * head_size;
    Py_ssize_t written = 0;
    for (Py_ssize_t t = 0; t < num_tokens; t++) {
        int64_t s = SLOT(t);
        /* checked above; checked again in case another thread changed the slots since */
        if (s < 0 || s >= limit) continue;
        written++;
        Py_ssize_t block = (Py_ssize_t)(s / block_size), off = (Py_ssize_t)(s % block_size);
        char *base = cache + block * sb;
        for (Py_ssize_t h = 0; h < num_heads; h++) {
            uint8_t *head_base = (uint8_t *)(base + h * sh);
            row(key + (t * kst[0] + h * kst[1]) * elem, value + (t * vst[0] + h * vst[1]) * elem,
                head_base + off, head_base + plane + off * head_size, block_size, head_size,
                ks, vs);
        }
    }
#undef SLOT
    return PyLong_FromSsize_t(written);
}

static PyMethodDef methods[] = {
    {"setup", (PyCFunction)(void (*)(void))setup, METH_FASTCALL,
     "Register torch's dtype objects (float32, bfloat16, float16, int32, int64)."},
    {"write", (PyCFunction)(void (*)(void))write_kv, METH_FASTCALL,
     "Quantize K and V to e4m3fn (round to nearest even) into vLLM's CPU cache."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvscale_cpu_fp8", NULL, -1,
                                    methods};

PyMODINIT_FUNC PyInit__kvscale_cpu_fp8(void) { return PyModule_Create(&module); }
