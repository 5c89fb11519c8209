/* attnext._C: the extension module. Turns a checked problem description from attnext/api.py into
 * an attn_params (buffers read in place through their strides), releases the GIL, runs the
 * backend and maps its error codes to Python exceptions.
 *
 * forward(prob) and backward(prob) take one object whose attributes are the arrays and options
 * (attnext/_layout.py's CpuCall). Arrays arrive as buffer exporters in the shapes of attn_params.h:
 * q (Bm, Sq, Hq, D), k (Bm, Sk, Hk, D), v (Bm, Sk, Hk, Dv), out (Bm, Sq, Hq, Dv), lse (Bm, Hq, Sq),
 * bias / mask / dbias (B, Hb, *, *), alibi (B, Hq), sinks (Hq,) in lse's dtype, cu_seqlens (B + 1)
 * and seqused (B) int32;
 * Bm is B, or 1 for a packed batch. bfloat16 arrives as uint16 (NumPy cannot export ml_dtypes
 * through the buffer protocol) and its dtype code says what it is.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "attn_params.h"
#include "cpu.h"
#include "driver.h"
#include "interp.h"

int attnext_cuda_attn_exec(PyObject *module);   /* cuda_attn.c */
int attnext_xla_exec(PyObject *module);         /* xla/ffi.c: attnext.jax's handlers */
#include "seqlen.h"
#include "simd.h"

#define MAX_BUFFERS 24

typedef struct {
    Py_buffer views[MAX_BUFFERS];
    int n;
} buffer_set;

static void buffers_release(buffer_set *bs)
{
    for (int i = 0; i < bs->n; i++)
        PyBuffer_Release(&bs->views[i]);
    bs->n = 0;
}

static int format_matches(const char *fmt, attn_dtype dt)
{
    if (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@')
        fmt++;
    switch (dt) {
    case DT_F16: return !strcmp(fmt, "e");
    case DT_BF16: return !strcmp(fmt, "H");
    case DT_F32: return !strcmp(fmt, "f");
    case DT_F64: return !strcmp(fmt, "d");
    }
    return 0;
}

static int get_long(PyObject *prob, const char *name, long long *out)
{
    PyObject *o = PyObject_GetAttrString(prob, name);
    if (!o)
        return -1;
    *out = PyLong_AsLongLong(o);
    Py_DECREF(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int get_double(PyObject *prob, const char *name, double *out)
{
    PyObject *o = PyObject_GetAttrString(prob, name);
    if (!o)
        return -1;
    *out = PyFloat_AsDouble(o);
    Py_DECREF(o);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* Acquire attribute `name` as a buffer of `ndim` dims. kind: a dtype code, or -1 for bool/uint8
 * (mask), -2 for int32 (lengths). Fills t (element strides, dims padded at the front to 4) and
 * shape; a None attribute leaves t->ptr NULL. */
static int get_tensor(PyObject *prob, const char *name, int ndim, int kind, int writable,
                      buffer_set *bs, tensor4 *t, Py_ssize_t *shape)
{
    memset(t, 0, sizeof *t);
    PyObject *o = PyObject_GetAttrString(prob, name);
    if (!o)
        return -1;
    if (o == Py_None) {
        Py_DECREF(o);
        return 0;
    }
    if (bs->n >= MAX_BUFFERS) {
        Py_DECREF(o);
        PyErr_SetString(PyExc_RuntimeError, "attnext._C: too many buffers");
        return -1;
    }
    Py_buffer *v = &bs->views[bs->n];
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    int rc = PyObject_GetBuffer(o, v, flags);
    Py_DECREF(o);
    if (rc < 0)
        return -1;
    bs->n++;
    size_t item = kind >= 0 ? dtype_size((attn_dtype)kind) : kind == -1 ? 1 : 4;
    int fmt_ok = !v->format ? 0
                 : kind >= 0 ? format_matches(v->format, (attn_dtype)kind)
                 : kind == -1 ? (!strcmp(v->format, "?") || !strcmp(v->format, "B"))
                              : (v->format[strlen(v->format) - 1] == 'i');
    if (v->ndim != ndim || (size_t)v->itemsize != item || !fmt_ok) {
        PyErr_Format(PyExc_TypeError, "attnext._C: %s has format '%s', itemsize %zd and %d dims",
                     name, v->format ? v->format : "?", v->itemsize, v->ndim);
        return -1;
    }
    if (kind == -2 && v->strides[0] != 4) {
        PyErr_Format(PyExc_ValueError, "attnext._C: %s must be contiguous", name);
        return -1;
    }
    for (int i = 0; i < 4; i++) {
        int src = i - (4 - ndim);
        if (src < 0) {
            t->s[i] = 0;
            if (shape) shape[i] = 1;
            continue;
        }
        if (v->strides[src] % (Py_ssize_t)item) {
            PyErr_Format(PyExc_ValueError, "attnext._C: %s has a stride not a multiple of its itemsize", name);
            return -1;
        }
        t->s[i] = v->strides[src] / (Py_ssize_t)item;
        if (shape) shape[i] = v->shape[src];
    }
    t->ptr = v->buf;
    return 0;
}

static int shape_is(const char *name, const Py_ssize_t *shape, long long a, long long b,
                    long long c, long long d)
{
    if (shape[0] == a && shape[1] == b && shape[2] == c && shape[3] == d)
        return 0;
    PyErr_Format(PyExc_ValueError, "attnext._C: %s has shape (%zd, %zd, %zd, %zd), expected "
                 "(%lld, %lld, %lld, %lld)", name, shape[0], shape[1], shape[2], shape[3], a, b, c, d);
    return -1;
}

/* A bias or mask (B, heads, rows, cols) is read at [b, head, r, c] for r < Lq, c < Lk of sequence b. */
static int extent_ok(const attn_params *p, const Py_ssize_t *shape, long long heads, long long max_lq,
                     long long max_lk)
{
    return heads > 0 && p->Hq % heads == 0 && shape[0] == p->B && shape[1] == heads
           && shape[2] >= max_lq && shape[3] >= max_lk;
}

/* Everything the forward and backward share: dims, q/k/v/out/lse, lengths, masks, options.
 * out and lse are written by the forward (writable) and only read by the backward. bias_shape
 * receives the bias's 4-D shape, which a dbias must have. */
static int fill_common(PyObject *prob, attn_params *p, buffer_set *bs, int forward,
                       Py_ssize_t *bias_shape)
{
    long long dtype, B, causal, wl, wr, nthreads, bias_dtype, alibi_dtype, bias_heads, mask_heads;
    Py_ssize_t qs[4], ks[4], vs[4], os[4], ls[4], sh[4];
    tensor4 t;
    memset(p, 0, sizeof *p);
    if (get_long(prob, "dtype", &dtype) || get_long(prob, "B", &B) || get_long(prob, "causal", &causal)
        || get_long(prob, "window_left", &wl) || get_long(prob, "window_right", &wr)
        || get_long(prob, "num_threads", &nthreads) || get_long(prob, "bias_dtype", &bias_dtype)
        || get_long(prob, "alibi_dtype", &alibi_dtype) || get_long(prob, "bias_heads", &bias_heads)
        || get_long(prob, "mask_heads", &mask_heads) || get_double(prob, "scale", &p->scale)
        || get_double(prob, "softcap", &p->softcap))
        return -1;
    if (dtype < DT_F16 || dtype > DT_F64 || bias_dtype < DT_F16 || bias_dtype > DT_F64
        || alibi_dtype < DT_F16 || alibi_dtype > DT_F64) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: bad dtype code");
        return -1;
    }
    p->dtype = (attn_dtype)dtype;
    p->bias_dtype = (attn_dtype)bias_dtype;
    p->alibi_dtype = (attn_dtype)alibi_dtype;
    p->causal = (attn_causal)causal;
    p->window_left = wl;
    p->window_right = wr;
    p->num_threads = (int)nthreads;
    p->B = B;
    if (get_tensor(prob, "q", 4, p->dtype, 0, bs, &p->q, qs) || get_tensor(prob, "k", 4, p->dtype, 0, bs, &p->k, ks)
        || get_tensor(prob, "v", 4, p->dtype, 0, bs, &p->v, vs))
        return -1;
    if (!p->q.ptr || !p->k.ptr || !p->v.ptr) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: q, k and v are required");
        return -1;
    }
    p->Sq = qs[1]; p->Hq = qs[2]; p->D = qs[3];
    p->Sk = ks[1]; p->Hk = ks[2]; p->Dv = vs[3];
    long long Bm = qs[0];
    /* a paged cache: k, v (num_pages, page_size, Hk, D), block_table flat (B * bt_stride) */
    long long page_size, bt_stride;
    if (get_long(prob, "page_size", &page_size) || get_long(prob, "bt_stride", &bt_stride)
        || get_tensor(prob, "block_table", 1, -2, 0, bs, &t, sh))
        return -1;
    if (t.ptr) {
        if (page_size != ks[1] || bt_stride < 0 || sh[3] != B * bt_stride) {
            PyErr_SetString(PyExc_ValueError, "attnext._C: block_table disagrees with k's pages");
            return -1;
        }
        p->block_table = (const int32_t *)t.ptr;
        p->page_size = page_size;
        p->num_pages = ks[0];
        p->bt_stride = bt_stride;
        p->Sk = bt_stride * page_size;
        if (shape_is("v", vs, ks[0], page_size, p->Hk, p->Dv))
            return -1;
    } else if (shape_is("k", ks, Bm, p->Sk, p->Hk, p->D) || shape_is("v", vs, Bm, p->Sk, p->Hk, p->Dv)) {
        return -1;
    }
    p->max_rows_q = p->Sq;       /* the host checked the lengths: no segment is clamped */
    p->max_rows_k = p->Sk;
    if (p->Hk <= 0 || p->Hq % p->Hk) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: Hq must be a multiple of Hk");
        return -1;
    }
    if (get_tensor(prob, "out", 4, p->dtype, forward, bs, &p->out, os) || shape_is("out", os, Bm, p->Sq, p->Hq, p->Dv))
        return -1;
    attn_dtype lse_dt = acc_dtype(p->dtype);
    if (get_tensor(prob, "lse", 3, lse_dt, forward, bs, &p->lse, ls) || shape_is("lse", ls, 1, Bm, p->Hq, p->Sq))
        return -1;
    p->lse.s[0] = p->lse.s[1]; p->lse.s[1] = p->lse.s[2]; p->lse.s[2] = p->lse.s[3]; p->lse.s[3] = 0;
    if (!p->out.ptr || !p->lse.ptr) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: out and lse are required");
        return -1;
    }

    const char *len_names[4] = {"cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k"};
    const int32_t **len_ptrs[4] = {&p->cu_seqlens_q, &p->cu_seqlens_k, &p->seqused_q, &p->seqused_k};
    for (int i = 0; i < 4; i++) {
        if (get_tensor(prob, len_names[i], 1, -2, 0, bs, &t, sh))
            return -1;
        if (t.ptr && sh[3] != B + (i < 2)) {
            PyErr_Format(PyExc_ValueError, "attnext._C: %s has %zd entries for %lld sequences",
                         len_names[i], sh[3], B);
            return -1;
        }
        *len_ptrs[i] = (const int32_t *)t.ptr;
    }
    /* varlen has both cu_seqlens, or cu_seqlens_q alone over a paged cache */
    if ((p->cu_seqlens_q && !p->cu_seqlens_k && !p->block_table) || (!p->cu_seqlens_q && p->cu_seqlens_k)
        || (p->cu_seqlens_q && Bm != 1)
        || (!p->cu_seqlens_q && Bm != B)) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: inconsistent batch / cu_seqlens");
        return -1;
    }

    long long max_lq = 0, max_lk = 0;
    for (long long b = 0; b < B; b++) {
        seq_t sq = seq_q(p, b), sk = seq_k(p, b);
        if (sq.len > max_lq) max_lq = sq.len;
        if (sk.len > max_lk) max_lk = sk.len;
    }
    if (get_tensor(prob, "bias", 4, p->bias_dtype, 0, bs, &p->bias, bias_shape))
        return -1;
    p->bias_heads = bias_heads;
    if (p->bias.ptr && !extent_ok(p, bias_shape, bias_heads, max_lq, max_lk)) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: bias dims disagree");
        return -1;
    }
    if (get_tensor(prob, "mask", 4, -1, 0, bs, &p->mask, sh))
        return -1;
    p->mask_heads = mask_heads;
    if (p->mask.ptr && !extent_ok(p, sh, mask_heads, max_lq, max_lk)) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: mask dims disagree");
        return -1;
    }
    if (get_tensor(prob, "alibi", 2, p->alibi_dtype, 0, bs, &p->alibi, sh))
        return -1;
    if (p->alibi.ptr) {
        if (sh[2] != B || sh[3] != p->Hq) {
            PyErr_SetString(PyExc_ValueError, "attnext._C: alibi dims disagree");
            return -1;
        }
        p->alibi.s[0] = p->alibi.s[2]; p->alibi.s[1] = p->alibi.s[3]; p->alibi.s[2] = p->alibi.s[3] = 0;
    }
    if (get_tensor(prob, "sinks", 1, lse_dt, 0, bs, &t, sh))
        return -1;
    if (t.ptr && (sh[3] != p->Hq || (p->Hq > 1 && t.s[3] != 1))) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: sinks must be contiguous (Hq,)");
        return -1;
    }
    p->sinks = t.ptr;
    return 0;
}

/* --- score_mod / mask_mod: prob.mods (attnext/interp.py's bind()) as an interp_mods --------- */

typedef struct {
    interp_mods mods;
    interp_error err;
    interp_array *arrays[2];     /* the score_mod's and the mask_mod's captured arrays */
    Py_buffer *views;
    int n_views, cap_views;
    PyObject *names[2];          /* their names (for IndexError), borrowed from prob.mods */
    PyObject *owner;             /* prob.mods */
} mods_store;

static void mods_release(mods_store *st)
{
    for (int i = 0; i < st->n_views; i++)
        PyBuffer_Release(&st->views[i]);
    PyMem_Free(st->views);
    PyMem_Free(st->arrays[0]);
    PyMem_Free(st->arrays[1]);
    Py_XDECREF(st->owner);
    memset(st, 0, sizeof *st);
}

/* A C-contiguous buffer of o with items of `itemsize` bytes (kept until mods_release). */
static Py_buffer *mods_buffer(mods_store *st, PyObject *o, const char *what, Py_ssize_t itemsize,
                              int writable)
{
    if (st->n_views == st->cap_views) {
        int cap = st->cap_views ? 2 * st->cap_views : 16;
        Py_buffer *v = PyMem_Realloc(st->views, sizeof(Py_buffer) * cap);
        if (!v) {
            PyErr_NoMemory();
            return NULL;
        }
        st->views = v;
        st->cap_views = cap;
    }
    Py_buffer *v = &st->views[st->n_views];
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    st->n_views++;
    if (v->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "attnext._C: mods.%s has items of %zd bytes, expected %zd",
                     what, v->itemsize, itemsize);
        return NULL;
    }
    return v;
}

/* Program `name` (int64 header and body, see interp.py's _pack) with its float values. */
static int read_program(mods_store *st, PyObject *m, const char *name, const char *floats_name,
                        int fn, interp_prog *pg)
{
    memset(pg, 0, sizeof *pg);
    pg->n_instr = -1;
    PyObject *code = PyObject_GetAttrString(m, name);
    if (!code)
        return -1;
    if (code == Py_None) {
        Py_DECREF(code);
        return 0;
    }
    Py_buffer *v = mods_buffer(st, code, name, 8, 0);
    Py_DECREF(code);
    if (!v)
        return -1;
    const int64_t *c = (const int64_t *)v->buf, len = v->len / 8;
    if (len < 7 || c[0] < 0 || c[5] < 0 || c[6] < 0 || 7 + 5 * c[0] + c[5] + c[6] != len) {
        PyErr_Format(PyExc_ValueError, "attnext._C: mods.%s is not a program", name);
        return -1;
    }
    pg->n_instr = c[0];
    pg->n_fregs = c[1];
    pg->n_iregs = c[2];
    pg->out = c[3];
    pg->out_is_int = c[4] != 0;
    pg->n_aux = c[5];
    pg->n_iconst = c[6];
    pg->instr = c + 7;
    pg->aux = pg->instr + 5 * pg->n_instr;
    pg->iconst = pg->aux + pg->n_aux;
    pg->fn = fn;
    PyObject *fl = PyObject_GetAttrString(m, floats_name);
    if (!fl)
        return -1;
    v = mods_buffer(st, fl, floats_name, 8, 0);
    Py_DECREF(fl);
    if (!v)
        return -1;
    pg->floats = (const double *)v->buf;
    pg->n_floats = v->len / 8;
    return 0;
}

/* Captured arrays: mods.<name> is a tuple of (kind, contiguous array); offsets (or NULL) the
 * gradient offset of each. */
static int read_arrays(mods_store *st, PyObject *m, const char *name, PyObject *offsets,
                       attn_dtype acc, int which)
{
    PyObject *tup = PyObject_GetAttrString(m, name);
    if (!tup)
        return -1;
    if (!PyTuple_Check(tup)) {
        Py_DECREF(tup);
        PyErr_Format(PyExc_TypeError, "attnext._C: mods.%s must be a tuple", name);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(tup);
    st->arrays[which] = PyMem_Calloc(n ? n : 1, sizeof(interp_array));
    if (!st->arrays[which]) {
        Py_DECREF(tup);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        interp_array *a = &st->arrays[which][i];
        PyObject *item = PyTuple_GET_ITEM(tup, i);
        long kind;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2
            || ((kind = PyLong_AsLong(PyTuple_GET_ITEM(item, 0))) == -1 && PyErr_Occurred())
            || kind < ARR_FLOAT || kind > ARR_UINT64) {
            Py_DECREF(tup);
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "attnext._C: mods.%s[%zd] must be (kind, array)", name, i);
            return -1;
        }
        Py_ssize_t item_size = kind == ARR_FLOAT ? (Py_ssize_t)dtype_size(acc) : kind == ARR_INT || kind == ARR_UINT64 ? 8 : 1;
        Py_buffer *v = mods_buffer(st, PyTuple_GET_ITEM(item, 1), name, item_size, 0);
        if (!v) {
            Py_DECREF(tup);
            return -1;
        }
        a->kind = (interp_array_kind)kind;
        a->ndim = v->ndim;
        a->shape = (const int64_t *)v->shape;   /* Py_ssize_t is int64_t here (checked below) */
        a->size = v->len / item_size;
        a->data = v->buf;
        a->grad_offset = -1;
        if (offsets) {
            PyObject *o = PyTuple_GetItem(offsets, i);
            if (!o || ((a->grad_offset = PyLong_AsLongLong(o)) == -1 && PyErr_Occurred())) {
                Py_DECREF(tup);
                return -1;
            }
        }
    }
    Py_DECREF(tup);
    return (int)n;
}

/* prob.mods into st (p->mods pointing at it), or p->mods = NULL when it is None. */
static int fill_mods(PyObject *prob, attn_params *p, mods_store *st, int backward)
{
    Py_BUILD_ASSERT(sizeof(Py_ssize_t) == sizeof(int64_t));
    memset(st, 0, sizeof *st);
    PyObject *m = PyObject_GetAttrString(prob, "mods");
    if (!m)
        return -1;
    if (m == Py_None) {
        Py_DECREF(m);
        return 0;
    }
    st->owner = m;
    interp_mods *mods = &st->mods;
    attn_dtype acc = acc_dtype(p->dtype);
    long long uses_h, n_fstash, n_istash;
    int n_score, n_mask;
    PyObject *offsets = NULL;
    if (read_program(st, m, "score", "score_floats", 0, &mods->score)
        || read_program(st, m, "mask", "mask_floats", 1, &mods->mask)
        || (backward && read_program(st, m, "score_bwd", "score_floats", 0, &mods->score_bwd))
        || (backward && read_program(st, m, "grad", "grad_floats", 0, &mods->grad))
        || get_long(m, "mask_uses_h", &uses_h) || get_long(m, "n_fstash", &n_fstash)
        || get_long(m, "n_istash", &n_istash))
        return -1;
    if (!backward) {
        memset(&mods->grad, 0, sizeof mods->grad);
        mods->grad.n_instr = mods->score_bwd.n_instr = -1;
    }
    mods->n_fstash = n_fstash;
    mods->n_istash = n_istash;
    if (backward && interp_has(&mods->score) && !(offsets = PyObject_GetAttrString(m, "grad_offsets")))
        return -1;
    n_score = read_arrays(st, m, "score_arrays", offsets, acc, 0);
    Py_XDECREF(offsets);
    if (n_score < 0 || (n_mask = read_arrays(st, m, "mask_arrays", NULL, acc, 1)) < 0)
        return -1;
    if (backward && interp_has(&mods->score) && !(interp_has(&mods->grad) && interp_has(&mods->score_bwd))) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: a backward with a score_mod needs mods.grad and mods.score_bwd");
        return -1;
    }
    mods->score.arrays = mods->score_bwd.arrays = mods->grad.arrays = st->arrays[0];
    mods->score.n_arrays = mods->score_bwd.n_arrays = mods->grad.n_arrays = n_score;
    mods->mask.arrays = st->arrays[1];
    mods->mask.n_arrays = n_mask;
    mods->mask_uses_h = uses_h != 0;
    if (backward && interp_has(&mods->score)) {
        PyObject *d = PyObject_GetAttrString(m, "dtensors");
        if (!d)
            return -1;
        Py_buffer *v = mods_buffer(st, d, "dtensors", 8, 1);
        Py_DECREF(d);
        if (!v)
            return -1;
        mods->dtensors = (double *)v->buf;
        mods->n_grad = v->len / 8;
        memset(mods->dtensors, 0, v->len);
    }
    const interp_prog *progs[4] = {&mods->score, &mods->mask, &mods->score_bwd, &mods->grad};
    const char *what[4] = {"score_mod", "mask_mod", "score_mod (backward)", "score_mod derivative"};
    if (n_fstash < 0 || n_istash < 0) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: negative stash counts");
        return -1;
    }
    for (int i = 0; i < 4; i++) {
        const char *why = interp_check(mods, progs[i]);
        if (why) {
            PyErr_Format(PyExc_ValueError, "attnext._C: bad %s program: %s", what[i], why);
            return -1;
        }
    }
    mods->err = &st->err;
    p->mods = mods;
    return 0;
}

static PyObject *run(int (*fn)(const attn_params *), attn_params *p, buffer_set *bs, mods_store *st)
{
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fn(p);
    Py_END_ALLOW_THREADS
    buffers_release(bs);
    if (rc == -2) {
        /* a score_mod / mask_mod lookup out of range, named as NumPy would */
        const interp_error *e = &st->err;
        PyObject *names = PyObject_GetAttrString(st->owner, e->fn ? "mask_names" : "score_names");
        PyObject *name = names && PyTuple_Check(names) ? PyTuple_GetItem(names, e->array) : NULL;
        if (name)
            PyErr_Format(PyExc_IndexError, "%s: index %lld is out of bounds for axis %lld of array "
                         "%R with size %lld", e->fn ? "mask_mod" : "score_mod", (long long)e->index,
                         (long long)e->axis, name, (long long)e->size);
        Py_XDECREF(names);
        mods_release(st);
        return NULL;
    }
    mods_release(st);
    if (rc) {
        PyErr_SetString(PyExc_MemoryError, "attnext: the CPU backend ran out of memory for its tiles");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *c_forward(PyObject *module, PyObject *prob)
{
    buffer_set bs = {.n = 0};
    mods_store st;
    attn_params p;
    Py_ssize_t bias_shape[4];
    memset(&st, 0, sizeof st);
    if (fill_common(prob, &p, &bs, 1, bias_shape) || fill_mods(prob, &p, &st, 0)) {
        buffers_release(&bs);
        mods_release(&st);
        return NULL;
    }
    return run(cpu_forward, &p, &bs, &st);
}

static PyObject *c_backward(PyObject *module, PyObject *prob)
{
    buffer_set bs = {.n = 0};
    attn_params p;
    Py_ssize_t sh[4], bias_shape[4];
    long long Bm;
    mods_store st;
    memset(&st, 0, sizeof st);
    if (fill_common(prob, &p, &bs, 0, bias_shape) || fill_mods(prob, &p, &st, 1))
        goto fail;
    Bm = p.cu_seqlens_q ? 1 : p.B;
    attn_dtype acc = acc_dtype(p.dtype);
    if (get_tensor(prob, "dout", 4, p.dtype, 0, &bs, &p.dout, sh) || shape_is("dout", sh, Bm, p.Sq, p.Hq, p.Dv)
        || get_tensor(prob, "dq", 4, p.dtype, 1, &bs, &p.dq, sh) || shape_is("dq", sh, Bm, p.Sq, p.Hq, p.D)
        || get_tensor(prob, "dk", 4, p.dtype, 1, &bs, &p.dk, sh) || shape_is("dk", sh, Bm, p.Sk, p.Hk, p.D)
        || get_tensor(prob, "dv", 4, p.dtype, 1, &bs, &p.dv, sh) || shape_is("dv", sh, Bm, p.Sk, p.Hk, p.Dv)
        || get_tensor(prob, "dbias", 4, acc, 1, &bs, &p.dbias, sh)
        || (p.dbias.ptr && shape_is("dbias", sh, bias_shape[0], bias_shape[1], bias_shape[2], bias_shape[3]))
        || get_tensor(prob, "dlse", 3, acc, 0, &bs, &p.dlse, sh)
        || (p.dlse.ptr && shape_is("dlse", sh, 1, Bm, p.Hq, p.Sq)))
        goto fail;
    p.dlse.s[0] = p.dlse.s[1]; p.dlse.s[1] = p.dlse.s[2]; p.dlse.s[2] = p.dlse.s[3]; p.dlse.s[3] = 0;
    if (!p.dout.ptr || !p.dq.ptr || !p.dk.ptr || !p.dv.ptr || (p.dbias.ptr != NULL) != (p.bias.ptr != NULL)) {
        PyErr_SetString(PyExc_ValueError, "attnext._C: dout, dq, dk, dv (and dbias with a bias) are required");
        goto fail;
    }
    return run(cpu_backward, &p, &bs, &st);
fail:
    buffers_release(&bs);
    mods_release(&st);
    return NULL;
}

static PyObject *c_simd(PyObject *module, PyObject *unused)
{
    return PyUnicode_FromString(simd_name());
}

static PyObject *c_openmp_threads(PyObject *module, PyObject *unused)
{
#ifdef _OPENMP
    return PyLong_FromLong(omp_get_max_threads());
#else
    return PyLong_FromLong(0);
#endif
}

static PyObject *c_interp_ops(PyObject *module, PyObject *unused)
{
    PyObject *t = PyTuple_New(OP_COUNT);
    if (!t)
        return NULL;
    for (int i = 0; i < OP_COUNT; i++) {
        PyObject *s = PyUnicode_FromString(interp_op_names[i]);
        if (!s) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

static PyMethodDef methods[] = {
    {"forward", c_forward, METH_O, "forward(prob): out and lse written in place."},
    {"backward", c_backward, METH_O, "backward(prob): dq, dk, dv written, dbias accumulated."},
    {"interp_ops", c_interp_ops, METH_NOARGS, "The score_mod interpreter's op names, in opcode order."},
    {"simd", c_simd, METH_NOARGS, "The SIMD variant the CPU backend runs: avx512, avx2 or portable."},
    {"openmp_threads", c_openmp_threads, METH_NOARGS, "OpenMP's default thread count; 0 without OpenMP."},
    {NULL, NULL, 0, NULL},
};

static int cpu_exec(PyObject *module)
{
    cpu_init();
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, (void *)cpu_exec},            /* the CPU backend survives fork() */
    {Py_mod_exec, (void *)attnext_cuda_exec},   /* the CUDA functions and PinnedBuffer */
    {Py_mod_exec, (void *)attnext_cuda_attn_exec},   /* the attention launches */
    {Py_mod_exec, (void *)attnext_xla_exec},    /* XLA FFI handlers (attnext.jax) */
#if PY_VERSION_HEX >= 0x030C0000
    /* subinterpreters, but under the main GIL: libcuda's handles and the pinned pool are the
     * process's, statics the GIL guards (csrc/cuda/driver.c, pinned.c) */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "attnext._C",
    .m_doc = "attnext's C extension: the CPU backend and the CUDA host side.",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
