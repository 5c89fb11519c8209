/* GPU launches of the attention kernels: fills the same attn_params the CPU backend reads, with
 * device pointers, and launches a compiled kernel (attnext/kernels.py chose and compiled it;
 * attnext/cuda_backend.py allocated and checked every array).
 *
 * Two steps, so that a call's launch parses no attribute: attnext/cuda_backend.py's plan cache
 * (keyed on shapes, strides, dtypes and options) builds a launch template once per plan, and each
 * call hands it the call's device addresses.
 *
 * attn_template(prob) -> bytes reads these attributes of prob:
 *   device            the CUDA ordinal the kernels run on
 *   dtype, B, causal, window_left, window_right, bias_dtype, alibi_dtype, bias_heads, mask_heads,
 *   num_splits        as for _C.forward (num_splits: the split-KV forward's key splits, else 1)
 *   dq_write_last     the backward's ordered dq mode: 1 where the last turns write dq (attn_params.h)
 *   k_rows_max        the backward's longest key sequence (attn_bwd_dead; attn_params.h)
 *   max_rows_q, max_rows_k   varlen: the most rows of a segment, what the grid covers
 *                     (attn_params.h; 0: the tensor's rows)
 *   page_size, bt_stride   a paged k / v cache (0, 0: none): k's rows a page and block_table's
 *                     row stride; Sk is then bt_stride * page_size (attn_params.h)
 *   q, k, v, out, dout, dq, dk, dv, lse, dbias, dlse, bias, mask, alibi, delta, dq_accum, dq_sem:
 *   each None or a tuple (ptr, shape, strides) with shape and strides (in elements) of the ranks in
 *   attn_params.h; only their shapes and strides are kept (None: the feature is off)
 *
 * cuda_launch_attention(fn, grid, block, smem, stream, template, ptrs, scale, softcap) launches
 *   fn (a module_function capsule) over grid and block (3-tuples) with smem bytes of dynamic
 *   shared memory on stream (0: the legacy default stream), the template's attn_params given
 *   this call's addresses: ptrs, a tuple of ints or None (NULL) in the order of PTR_FIELDS
 *   below (a shorter tuple leaves the rest NULL), and the scalars scale and softcap. An optional
 *   10th argument gmods, None or the bytes of this call's attn_mods_gpu (the generated
 *   score_mod / mask_mod's constants, arrays, error record and gradient accumulator;
 *   attnext/codegen.py: pack), fills p->gmods; without it gmods stays zero.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <string.h>

#include "attn_params.h"
#include "driver.h"

static int attr_long(PyObject *prob, const char *name, long long *out)
{
    PyObject *o = PyObject_GetAttrString(prob, name);
    if (!o)
        return -1;
    *out = PyLong_AsLongLong(o);
    Py_DECREF(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
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

/* What attn_template returns: the parameters less the call's addresses and scalars, and what the
 * launch checks those addresses against. */
typedef struct {
    attn_params p;
    long long device;
    int q_empty, kv_empty;       /* an empty q, or k and v without a row: a NULL address is fine */
    int tma_read_once;           /* K and V maps of a decode: L2 fills of 128 B (encode_map) */
    int tma_out;                 /* the persistent WS forward: out by its map where out's rows allow */
} attn_template;

/* The pointer fields a launch fills from its `ptrs`, in that tuple's order (the forward's first,
 * so its tuple stays short), each with the name _C.layout() gives Python (attnext/_layout.py
 * derives its slots from them). */
#define PTR_FIELD_LIST(X)                                                                          \
    X(q, q.ptr) X(k, k.ptr) X(v, v.ptr) X(out, out.ptr) X(lse, lse.ptr) X(o_accum, o_accum)         \
    X(lse_accum, lse_accum) X(bias, bias.ptr) X(mask, mask.ptr) X(alibi, alibi.ptr)               \
    X(cu_seqlens_q, cu_seqlens_q) X(cu_seqlens_k, cu_seqlens_k) X(seqused_q, seqused_q)          \
    X(seqused_k, seqused_k) X(dout, dout.ptr) X(dq, dq.ptr) X(dk, dk.ptr) X(dv, dv.ptr)           \
    X(dbias, dbias.ptr) X(dlse, dlse.ptr) X(delta, delta.ptr) X(dq_accum, dq_accum.ptr)           \
    X(dq_sem, dq_sem.ptr) X(dead, dead) X(row_mz, row_mz) X(sinks, sinks) X(dsinks, dsinks) \
    X(block_table, block_table) X(counters, counters) X(grad_scales, grad_scales)
#define PTR_OFFSET(name, f) offsetof(attn_params, f),
#define PTR_NAME(name, f) #name,
static const size_t PTR_FIELDS[] = {PTR_FIELD_LIST(PTR_OFFSET)};
static const char *const PTR_FIELD_NAMES[] = {PTR_FIELD_LIST(PTR_NAME)};
#define N_PTR_FIELDS ((Py_ssize_t)(sizeof PTR_FIELDS / sizeof PTR_FIELDS[0]))

static PyObject *c_layout(PyObject *module, PyObject *unused)
{
    PyObject *fields = PyTuple_New(N_PTR_FIELDS);
    if (!fields)
        return NULL;
    for (Py_ssize_t i = 0; i < N_PTR_FIELDS; i++) {
        PyObject *name = PyUnicode_FromString(PTR_FIELD_NAMES[i]);
        if (!name) {
            Py_DECREF(fields);
            return NULL;
        }
        PyTuple_SET_ITEM(fields, i, name);
    }
    return Py_BuildValue("{s:N,s:{s:i,s:i,s:i,s:i}}", "ptr_fields", fields, "dtypes", "float16", DT_F16,
                         "bfloat16", DT_BF16, "float32", DT_F32, "float64", DT_F64);
}

static PyObject *c_attn_template(PyObject *module, PyObject *prob)
{
    attn_template t;
    attn_params *p = &t.p;
    long long dtype, B, causal, wl, wr, bias_dtype, alibi_dtype, bias_heads, mask_heads, splits, write_last,
        k_rows_max, max_rows_q, max_rows_k, page_size, bt_stride, tma_rows, tma_rows_q, read_once, tma_out, qs[4],
        ks[4], vs[4];
    memset(&t, 0, sizeof t);
    if (attr_long(prob, "dtype", &dtype) || attr_long(prob, "B", &B) || attr_long(prob, "causal", &causal)
        || attr_long(prob, "window_left", &wl) || attr_long(prob, "window_right", &wr)
        || attr_long(prob, "bias_dtype", &bias_dtype) || attr_long(prob, "alibi_dtype", &alibi_dtype)
        || attr_long(prob, "bias_heads", &bias_heads) || attr_long(prob, "mask_heads", &mask_heads)
        || attr_long(prob, "device", &t.device) || attr_long(prob, "num_splits", &splits)
        || attr_long(prob, "dq_write_last", &write_last) || attr_long(prob, "k_rows_max", &k_rows_max)
        || attr_long(prob, "max_rows_q", &max_rows_q) || attr_long(prob, "max_rows_k", &max_rows_k)
        || attr_long(prob, "page_size", &page_size) || attr_long(prob, "bt_stride", &bt_stride)
        || attr_long(prob, "tma_rows", &tma_rows) || attr_long(prob, "tma_rows_q", &tma_rows_q)
        || attr_long(prob, "tma_read_once", &read_once) || attr_long(prob, "tma_out", &tma_out))
        return NULL;
    t.tma_read_once = read_once != 0;
    t.tma_out = tma_out != 0;
    p->tma_rows = tma_rows;
    p->tma_rows_q = tma_rows_q;
    p->dtype = (attn_dtype)dtype;
    p->B = B;
    p->causal = (attn_causal)causal;
    p->window_left = wl;
    p->window_right = wr;
    p->bias_dtype = (attn_dtype)bias_dtype;
    p->alibi_dtype = (attn_dtype)alibi_dtype;
    p->bias_heads = bias_heads;
    p->mask_heads = mask_heads;
    p->num_splits = (int)splits;
    p->dq_write_last = (int)write_last;
    p->k_rows_max = k_rows_max;
    if (attr_tensor(prob, "q", 4, &p->q, qs) || attr_tensor(prob, "k", 4, &p->k, ks)
        || attr_tensor(prob, "v", 4, &p->v, vs) || attr_tensor(prob, "out", 4, &p->out, NULL)
        || attr_tensor(prob, "lse", 3, &p->lse, NULL) || attr_tensor(prob, "bias", 4, &p->bias, NULL)
        || attr_tensor(prob, "mask", 4, &p->mask, NULL) || attr_tensor(prob, "alibi", 2, &p->alibi, NULL)
        || attr_tensor(prob, "dout", 4, &p->dout, NULL) || attr_tensor(prob, "dq", 4, &p->dq, NULL)
        || attr_tensor(prob, "dk", 4, &p->dk, NULL) || attr_tensor(prob, "dv", 4, &p->dv, NULL)
        || attr_tensor(prob, "dbias", 4, &p->dbias, NULL) || attr_tensor(prob, "dlse", 3, &p->dlse, NULL)
        || attr_tensor(prob, "delta", 3, &p->delta, NULL) || attr_tensor(prob, "dq_accum", 4, &p->dq_accum, NULL)
        || attr_tensor(prob, "dq_sem", 3, &p->dq_sem, NULL))
        return NULL;
    /* lse (Bm, Hq, Sq) and alibi (B, Hq) arrive padded at the front; move them to s[0].. */
    p->lse.s[0] = p->lse.s[1]; p->lse.s[1] = p->lse.s[2]; p->lse.s[2] = p->lse.s[3]; p->lse.s[3] = 0;
    p->dlse.s[0] = p->dlse.s[1]; p->dlse.s[1] = p->dlse.s[2]; p->dlse.s[2] = p->dlse.s[3]; p->dlse.s[3] = 0;
    p->delta.s[0] = p->delta.s[1]; p->delta.s[1] = p->delta.s[2]; p->delta.s[2] = p->delta.s[3]; p->delta.s[3] = 0;
    p->dq_sem.s[0] = p->dq_sem.s[1]; p->dq_sem.s[1] = p->dq_sem.s[2]; p->dq_sem.s[2] = p->dq_sem.s[3]; p->dq_sem.s[3] = 0;
    p->alibi.s[0] = p->alibi.s[2]; p->alibi.s[1] = p->alibi.s[3]; p->alibi.s[2] = p->alibi.s[3] = 0;
    p->Sq = qs[1]; p->Hq = qs[2]; p->D = qs[3];
    p->Sk = ks[1]; p->Hk = ks[2]; p->Dv = vs[3];
    if (page_size > 0) {        /* a paged cache: k, v (num_pages, page_size, Hk, D), keys through block_table */
        p->page_size = page_size;
        p->bt_stride = bt_stride;
        p->num_pages = ks[0];
        p->Sk = bt_stride * page_size;
    }
    p->max_rows_q = max_rows_q > 0 ? max_rows_q : p->Sq;
    p->max_rows_k = max_rows_k > 0 ? max_rows_k : p->Sk;
    if (p->Hk <= 0 || p->Hq % p->Hk) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: q, k, v missing or heads disagree");
        return NULL;
    }
    /* an empty q, k or v (S = 0, or no key rows at all) may come with a null address: the
     * kernels then read nothing from it (every row keeps no key, or there is no row) */
    t.q_empty = qs[0] * qs[1] == 0;
    t.kv_empty = ks[0] * ks[1] == 0;
    /* the addresses are the launch's */
    for (Py_ssize_t i = 0; i < N_PTR_FIELDS; i++)
        memset((char *)p + PTR_FIELDS[i], 0, sizeof(void *));
    return PyBytes_FromStringAndSize((const char *)&t, sizeof t);
}

static int dims3(PyObject *o, const char *name, unsigned out[3])
{
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 3) {
        PyErr_Format(PyExc_TypeError, "cuda_launch_attention: %s must be a 3-tuple", name);
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(o, i));
        if (v == (unsigned long)-1 && PyErr_Occurred())
            return -1;
        out[i] = (unsigned)v;
    }
    return 0;
}

/* A 4-d tensor map of t (d columns): (d, heads, rows, outer), boxes of min(d, 64) columns x 1 x
 * box_rows (at most rows) x 1, 128-byte swizzled, zeros outside the tensor. A dimension of one
 * element is never stepped, so where its stride is 0 in the array (varlen's new batch axis, a
 * single broadcast head), which the driver refuses, the map takes the span inside it. L2 fills
 * of 256 bytes (a 128-byte box row's neighbour, the other half of a D = 128 row, is read next),
 * but 128 for data read once (read_once: a decode's K and V; H200, decode B64 4.0 -> 4.3 TB/s,
 * the compute-bound kernels' maps within noise either way). -1 with an exception. */
static int encode_map(attn_tmap *map, const attn_params *p, const tensor4 *t, int64_t d, int64_t heads,
                      unsigned long long rows, unsigned long long outer, int64_t box_rows, int read_once)
{
    const unsigned long long dims[4] = {(unsigned long long)d, (unsigned long long)heads, rows, outer};
    unsigned long long strides[3] = {2ull * t->s[2], 2ull * t->s[1], 2ull * t->s[0]};
    if (!strides[0] && heads == 1)
        strides[0] = 2ull * d;
    if (!strides[1] && rows == 1)
        strides[1] = strides[0] * (unsigned long long)heads;
    if (!strides[2] && outer == 1)
        strides[2] = strides[1] * rows;
    /* a box of fewer rows than the kernels' stage barriers wait for would never complete them:
     * the selection (select.decode_tma, select.fwd_ws, select.bwd_tma) keeps such calls off TMA */
    if (box_rows < 1 || (unsigned long long)box_rows > rows) {
        PyErr_Format(PyExc_RuntimeError, "attnext._C: a tensor map of %llu rows cannot take copies of "
                     "%lld rows (a kernel selection bug: TMA needs a tile's rows)", rows, (long long)box_rows);
        return -1;
    }
    const unsigned box[4] = {d < 64 ? (unsigned)d : 64u, 1u, (unsigned)box_rows, 1u};
    const unsigned ones[4] = {1u, 1u, 1u, 1u};
    if (!cu_encode_tiled) {
        PyErr_SetString(PyExc_RuntimeError, "attnext._C: this CUDA driver has no cuTensorMapEncodeTiled "
                        "(TMA needs CUDA 12)");
        return -1;
    }
    CUresult rc = cu_encode_tiled((CUtensorMap *)map, p->dtype == DT_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                         : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                  4, t->ptr, dims, strides, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                  CU_TENSOR_MAP_SWIZZLE_128B,
                                  read_once ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (rc != CUDA_SUCCESS) {
        cu_raise(rc, __FILE__, __LINE__, "cuTensorMapEncodeTiled (dims %llu %llu %llu %llu, box %u %u %u)",
                 dims[0], dims[1], dims[2], dims[3], box[0], box[1], box[2]);
        return -1;
    }
    return 0;
}

/* The map of k or v for TMA_KV and WS: rows and outer are a paged cache's page_size and
 * num_pages, else Sk and B (varlen: the packed rows and 1); tma_rows rows a box. */
static int encode_kv_map(attn_tmap *map, const attn_params *p, const tensor4 *t, int64_t d, int read_once)
{
    const int paged = p->page_size > 0;
    return encode_map(map, p, t, d, p->Hk, paged ? p->page_size : p->Sk,
                      paged ? p->num_pages : p->cu_seqlens_k ? 1 : p->B, p->tma_rows, read_once);
}

/* The map of q or dout for the backward's dK/dV kernel, and of q and out for the persistent WS
 * forward: (d, Hq, Sq, B; varlen: the packed rows and 1), tma_rows_q rows a box. */
static int encode_q_map(attn_tmap *map, const attn_params *p, const tensor4 *t, int64_t d)
{
    return encode_map(map, p, t, d, p->Hq, p->Sq, p->cu_seqlens_q ? 1 : p->B, p->tma_rows_q, 0);
}

/* Whether a map can describe out for bulk tensor stores (the persistent WS forward's O): rows of
 * unit element stride, the address and every row, head and batch stride 16-byte aligned. */
static int out_map_fits(const attn_params *p)
{
    const tensor4 *o = &p->out;
    return o->ptr && o->s[3] == 1 && (((uintptr_t)o->ptr | (uintptr_t)(2 * (o->s[0] | o->s[1] | o->s[2]))) & 15) == 0
           && o->s[0] > 0 && o->s[1] > 0 && o->s[2] > 0;
}

static PyObject *c_cuda_tensor_maps(PyObject *module, PyObject *unused)
{
    char why[512];
    return PyBool_FromLong(cuda_driver_load(why, sizeof why) == 0 && cu_encode_tiled != NULL);
}

static PyObject *c_cuda_launch_attention(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned grid[3], block[3];
    if (nargs != 9 && nargs != 10) {
        PyErr_Format(PyExc_TypeError, "cuda_launch_attention takes 9 or 10 arguments (fn, grid, "
                     "block, smem, stream, template, ptrs, scale, softcap[, gmods]), got %zd", nargs);
        return NULL;
    }
    PyObject *fn_obj = args[0], *tmpl = args[5], *ptrs = args[6];
    if (dims3(args[1], "grid", grid) || dims3(args[2], "block", block))
        return NULL;
    unsigned long smem = PyLong_AsUnsignedLong(args[3]);
    if (smem == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    void *stream = PyLong_AsVoidPtr(args[4]);
    if (!stream && PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(tmpl) || PyBytes_GET_SIZE(tmpl) != (Py_ssize_t)sizeof(attn_template)) {
        PyErr_SetString(PyExc_TypeError, "cuda_launch_attention: template must come from attn_template()");
        return NULL;
    }
    if (!PyTuple_Check(ptrs) || PyTuple_GET_SIZE(ptrs) > N_PTR_FIELDS) {
        PyErr_Format(PyExc_TypeError, "cuda_launch_attention: ptrs must be a tuple of at most %zd "
                     "addresses", N_PTR_FIELDS);
        return NULL;
    }
    attn_template t;
    memcpy(&t, PyBytes_AS_STRING(tmpl), sizeof t);
    attn_params *p = &t.p;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ptrs); i++) {
        PyObject *o = PyTuple_GET_ITEM(ptrs, i);
        void *ptr = o == Py_None ? NULL : PyLong_AsVoidPtr(o);
        if (!ptr && PyErr_Occurred())
            return NULL;
        memcpy((char *)p + PTR_FIELDS[i], &ptr, sizeof ptr);
    }
    p->scale = PyFloat_AsDouble(args[7]);
    if (p->scale == -1.0 && PyErr_Occurred())
        return NULL;
    p->softcap = PyFloat_AsDouble(args[8]);
    if (p->softcap == -1.0 && PyErr_Occurred())
        return NULL;
    if (nargs == 10 && args[9] != Py_None) {
        PyObject *g = args[9];
        if (!PyBytes_Check(g) || PyBytes_GET_SIZE(g) != (Py_ssize_t)sizeof p->gmods) {
            PyErr_Format(PyExc_ValueError, "cuda_launch_attention: gmods must be %zu bytes of "
                         "attn_mods_gpu", sizeof p->gmods);
            return NULL;
        }
        memcpy(&p->gmods, PyBytes_AS_STRING(g), sizeof p->gmods);
    }
    if ((!p->q.ptr && !t.q_empty) || ((!p->k.ptr || !p->v.ptr) && !t.kv_empty)) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: q, k, v missing or heads disagree");
        return NULL;
    }
    CUfunction fn = cuda_function_from_capsule(fn_obj);
    if (!fn)
        return NULL;
    int fn_device = cuda_function_device(fn_obj);
    if (fn_device != t.device) {
        PyErr_Format(PyExc_ValueError, "attnext._C: the kernel was loaded on cuda:%d, the arrays live on cuda:%lld",
                     fn_device, t.device);
        return NULL;
    }
    if (cuda_device_enter((int)t.device))
        return NULL;
    if (p->tma_rows > 0 || p->tma_rows_q > 0) {
        /* the kernel's second parameter: attn_tmaps (k, v, and q where tma_rows_q is set too, out
         * where the template asks and out_map_fits) or attn_bwd_tmaps (q, dout) */
        attn_tmap maps[4] = {{{0}}};
        p->tma_out = p->tma_rows > 0 && p->tma_rows_q > 0 && t.tma_out && out_map_fits(p);
        if (p->tma_out && encode_q_map(&maps[3], p, &p->out, p->Dv)) {
            PyErr_Clear();                                /* a map the driver refuses: the threads' stores */
            p->tma_out = 0;
        }
        if (p->tma_rows > 0 ? encode_kv_map(&maps[0], p, &p->k, p->D, t.tma_read_once)
                                  || encode_kv_map(&maps[1], p, &p->v, p->Dv, t.tma_read_once)
                                  || (p->tma_rows_q > 0 && encode_q_map(&maps[2], p, &p->q, p->D))
                            : encode_q_map(&maps[0], p, &p->q, p->D) || encode_q_map(&maps[1], p, &p->dout, p->Dv))
            return NULL;
        CU_CHECK_RC("cuLaunchKernel (attention, tensor maps)",
                    cuda_launch_structs(fn, grid, block, (unsigned)smem, (CUstream)stream, p, maps));
        Py_RETURN_NONE;
    }
    CU_CHECK_RC("cuLaunchKernel (attention)",
                cuda_function_dependent(fn_obj) ? cuda_launch_dependent(fn, grid, block, (unsigned)smem, (CUstream)stream, p)
                                                : cuda_launch_struct(fn, grid, block, (unsigned)smem, (CUstream)stream, p));
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyMethodDef attnext_cuda_attn_methods[] = {
    {"layout", c_layout, METH_NOARGS,
     "layout() -> dict: C's layouts by name: ptr_fields, the attn_params fields that "
     "cuda_launch_attention's ptrs fill, in order; dtypes, attn_dtype's codes by NumPy name."},
    {"attn_template", c_attn_template, METH_O,
     "attn_template(prob) -> bytes: the attn_params of prob's shapes, strides and options, for "
     "cuda_launch_attention."},
    {"cuda_tensor_maps", c_cuda_tensor_maps, METH_NOARGS,
     "cuda_tensor_maps() -> bool: whether the driver makes TMA tensor maps (cuTensorMapEncodeTiled)."},
    {"cuda_launch_attention", (PyCFunction)(void (*)(void))c_cuda_launch_attention, METH_FASTCALL,
     "cuda_launch_attention(fn, grid, block, smem, stream, template, ptrs, scale, softcap[, gmods]): "
     "launch fn over the template's attn_params with this call's device addresses (and score_mod / "
     "mask_mod inputs)."},
    {NULL, NULL, 0, NULL},
};

int attnext_cuda_attn_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, attnext_cuda_attn_methods);
}
