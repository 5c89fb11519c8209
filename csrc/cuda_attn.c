/* GPU launches of the attention kernels: fills the same attn_params the CPU backend reads, with
 * device pointers, and launches a compiled kernel (attnext/kernels.py chose and compiled it;
 * attnext/cuda_backend.py allocated and checked every array).
 *
 * cuda_launch_attention(prob) reads these attributes of prob:
 *   fn                a function capsule (module_function); grid, block: 3-tuples; smem: bytes
 *   device, stream    ints (stream 0: the legacy default stream)
 *   dtype, B, causal, window_left, window_right, bias_dtype, alibi_dtype, bias_heads, mask_heads,
 *   scale, softcap    as for _C.forward
 *   q, k, v, out, dout, dq, dk, dv, lse, dbias, bias, mask, alibi, cu_seqlens_q, cu_seqlens_k,
 *   seqused_q, seqused_k, and the scratch buffers the backward names: each None or a tuple
 *   (ptr, shape, strides) with shape and strides (in elements) of the ranks in attn_params.h.
 *   gmods (optional)  None, or the bytes of the generated score_mod / mask_mod's attn_mods_gpu
 *                     (attnext/codegen.py: pack)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "attn_params.h"
#include "cuda_driver.h"

static int attr_long(PyObject *prob, const char *name, long long *out)
{
    PyObject *o = PyObject_GetAttrString(prob, name);
    if (!o)
        return -1;
    *out = PyLong_AsLongLong(o);
    Py_DECREF(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int attr_double(PyObject *prob, const char *name, double *out)
{
    PyObject *o = PyObject_GetAttrString(prob, name);
    if (!o)
        return -1;
    *out = PyFloat_AsDouble(o);
    Py_DECREF(o);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* A (ptr, shape, strides) tuple of `ndim` dims into t, dims padded at the front to 4; shape4
 * (optional) receives the padded shape. None leaves t zeroed. */
static int attr_tensor(PyObject *prob, const char *name, int ndim, tensor4 *t, long long *shape4)
{
    memset(t, 0, sizeof *t);
    if (shape4)
        for (int i = 0; i < 4; i++)
            shape4[i] = 1;
    PyObject *o = PyObject_GetAttrString(prob, name);
    if (!o)
        return -1;
    int rc = -1;
    if (o == Py_None) {
        rc = 0;
        goto done;
    }
    PyObject *ptr, *shape, *strides;
    if (!PyArg_ParseTuple(o, "OO!O!", &ptr, &PyTuple_Type, &shape, &PyTuple_Type, &strides))
        goto done;
    if (PyTuple_GET_SIZE(shape) != ndim || PyTuple_GET_SIZE(strides) != ndim) {
        PyErr_Format(PyExc_ValueError, "attnext._C: %s must have %d dims", name, ndim);
        goto done;
    }
    t->ptr = PyLong_AsVoidPtr(ptr);
    if (PyErr_Occurred())
        goto done;
    for (int i = 0; i < ndim; i++) {
        int j = 4 - ndim + i;
        t->s[j] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, i));
        long long n = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (shape4)
            shape4[j] = n;
        if (PyErr_Occurred())
            goto done;
    }
    rc = 0;
done:
    Py_DECREF(o);
    return rc;
}

static int attr_dims(PyObject *prob, const char *name, unsigned out[3])
{
    PyObject *o = PyObject_GetAttrString(prob, name);
    if (!o)
        return -1;
    int rc = PyArg_ParseTuple(o, "III", &out[0], &out[1], &out[2]) ? 0 : -1;
    Py_DECREF(o);
    return rc;
}

/* prob.gmods (absent or None: zeros) into g; its size must be the struct's */
static int read_gmods(PyObject *prob, attn_mods_gpu *g)
{
    PyObject *o = PyObject_GetAttrString(prob, "gmods");
    if (!o) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int rc = 0;
    if (o != Py_None) {
        Py_buffer buf;
        rc = PyObject_GetBuffer(o, &buf, PyBUF_SIMPLE);
        if (!rc) {
            if (buf.len != (Py_ssize_t)sizeof *g) {
                PyErr_Format(PyExc_ValueError, "attnext._C: gmods has %zd bytes, attn_mods_gpu %zu",
                             buf.len, sizeof *g);
                rc = -1;
            } else {
                memcpy(g, buf.buf, sizeof *g);
            }
            PyBuffer_Release(&buf);
        }
    }
    Py_DECREF(o);
    return rc;
}

static PyObject *c_cuda_launch_attention(PyObject *module, PyObject *prob)
{
    attn_params p;
    long long dtype, B, causal, wl, wr, bias_dtype, alibi_dtype, bias_heads, mask_heads, device,
        stream, smem, qs[4], ks[4], vs[4];
    unsigned grid[3], block[3];
    memset(&p, 0, sizeof p);
    if (attr_long(prob, "dtype", &dtype) || attr_long(prob, "B", &B) || attr_long(prob, "causal", &causal)
        || attr_long(prob, "window_left", &wl) || attr_long(prob, "window_right", &wr)
        || attr_long(prob, "bias_dtype", &bias_dtype) || attr_long(prob, "alibi_dtype", &alibi_dtype)
        || attr_long(prob, "bias_heads", &bias_heads) || attr_long(prob, "mask_heads", &mask_heads)
        || attr_long(prob, "device", &device) || attr_long(prob, "stream", &stream)
        || attr_long(prob, "smem", &smem) || attr_double(prob, "scale", &p.scale)
        || attr_double(prob, "softcap", &p.softcap) || attr_dims(prob, "grid", grid)
        || attr_dims(prob, "block", block))
        return NULL;
    p.dtype = (attn_dtype)dtype;
    p.B = B;
    p.causal = (attn_causal)causal;
    p.window_left = wl;
    p.window_right = wr;
    p.bias_dtype = (attn_dtype)bias_dtype;
    p.alibi_dtype = (attn_dtype)alibi_dtype;
    p.bias_heads = bias_heads;
    p.mask_heads = mask_heads;
    tensor4 t;
    if (attr_tensor(prob, "q", 4, &p.q, qs) || attr_tensor(prob, "k", 4, &p.k, ks)
        || attr_tensor(prob, "v", 4, &p.v, vs) || attr_tensor(prob, "out", 4, &p.out, NULL)
        || attr_tensor(prob, "lse", 3, &p.lse, NULL) || attr_tensor(prob, "bias", 4, &p.bias, NULL)
        || attr_tensor(prob, "mask", 4, &p.mask, NULL) || attr_tensor(prob, "alibi", 2, &p.alibi, NULL)
        || attr_tensor(prob, "dout", 4, &p.dout, NULL) || attr_tensor(prob, "dq", 4, &p.dq, NULL)
        || attr_tensor(prob, "dk", 4, &p.dk, NULL) || attr_tensor(prob, "dv", 4, &p.dv, NULL)
        || attr_tensor(prob, "dbias", 4, &p.dbias, NULL)
        || attr_tensor(prob, "delta", 3, &p.delta, NULL) || attr_tensor(prob, "dq_accum", 4, &p.dq_accum, NULL))
        return NULL;
    /* lse (Bm, Hq, Sq) and alibi (B, Hq) arrive padded at the front; move them to s[0].. */
    p.lse.s[0] = p.lse.s[1]; p.lse.s[1] = p.lse.s[2]; p.lse.s[2] = p.lse.s[3]; p.lse.s[3] = 0;
    p.delta.s[0] = p.delta.s[1]; p.delta.s[1] = p.delta.s[2]; p.delta.s[2] = p.delta.s[3]; p.delta.s[3] = 0;
    p.alibi.s[0] = p.alibi.s[2]; p.alibi.s[1] = p.alibi.s[3]; p.alibi.s[2] = p.alibi.s[3] = 0;
    const char *len_names[4] = {"cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k"};
    const int32_t **len_ptrs[4] = {&p.cu_seqlens_q, &p.cu_seqlens_k, &p.seqused_q, &p.seqused_k};
    for (int i = 0; i < 4; i++) {
        if (attr_tensor(prob, len_names[i], 1, &t, NULL))
            return NULL;
        *len_ptrs[i] = (const int32_t *)t.ptr;
    }
    long long splits;
    if (attr_tensor(prob, "o_accum", 1, &t, NULL))
        return NULL;
    p.o_accum = (float *)t.ptr;
    if (attr_tensor(prob, "lse_accum", 1, &t, NULL) || attr_long(prob, "num_splits", &splits))
        return NULL;
    p.lse_accum = (float *)t.ptr;
    p.num_splits = (int)splits;
    if (read_gmods(prob, &p.gmods))
        return NULL;
    p.Sq = qs[1]; p.Hq = qs[2]; p.D = qs[3];
    p.Sk = ks[1]; p.Hk = ks[2]; p.Dv = vs[3];
    /* an empty q, k or v (S = 0, or no key rows at all) may come with a null address: the
     * kernels then read nothing from it (every row keeps no key, or there is no row) */
    const int q_empty = qs[0] * qs[1] == 0, kv_empty = ks[0] * ks[1] == 0;
    if ((!p.q.ptr && !q_empty) || ((!p.k.ptr || !p.v.ptr) && !kv_empty) || p.Hk <= 0 || p.Hq % p.Hk) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: q, k, v missing or heads disagree");
        return NULL;
    }

    PyObject *fn_obj = PyObject_GetAttrString(prob, "fn");
    if (!fn_obj)
        return NULL;
    CUfunction fn = cuda_function_from_capsule(fn_obj);
    int fn_device = cuda_function_device(fn_obj);
    Py_DECREF(fn_obj);
    if (!fn)
        return NULL;
    if (fn_device != device) {
        PyErr_Format(PyExc_ValueError, "attnext._C: the kernel was loaded on cuda:%d, the arrays live on cuda:%lld",
                     fn_device, device);
        return NULL;
    }
    if (cuda_device_enter((int)device))
        return NULL;
    CU_CHECK_RC("cuLaunchKernel (attention)",
                cuda_launch_struct(fn, grid, block, (unsigned)smem, (CUstream)(intptr_t)stream, &p));
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyMethodDef attnext_cuda_attn_methods[] = {
    {"cuda_launch_attention", c_cuda_launch_attention, METH_O,
     "cuda_launch_attention(prob): launch prob.fn over the attn_params built from prob's device arrays."},
    {NULL, NULL, 0, NULL},
};

int attnext_cuda_attn_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, attnext_cuda_attn_methods);
}
