/* NVRTC: finding and loading it, compiling kernels to cubins (CompileError with the log). (Conventions: host.h.) */
#include "host.h"

static int nvrtc_required(void)
{
    if (nvrtc_loaded_path())
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "attnext: NVRTC is not loaded (nvrtc_load first)");
    return -1;
}

static PyObject *c_nvrtc_load(PyObject *module, PyObject *candidates)
{
    PyObject *seq = PySequence_Fast(candidates, "nvrtc_load: candidates must be a list of paths");
    PyObject **encoded = NULL;
    const char **paths = NULL;
    PyObject *result = NULL;
    Py_ssize_t n = 0;
    char why[8192];
    if (!seq)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    encoded = PyMem_Calloc(n + 1, sizeof *encoded);
    paths = PyMem_Calloc(n + 1, sizeof *paths);
    if (!encoded || !paths) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &encoded[i]))
            goto done;
        paths[i] = PyBytes_AS_STRING(encoded[i]);
    }
    if (nvrtc_load(paths, (int)n, why, sizeof why)) {
        PyErr_SetString(PyExc_RuntimeError, why);
        goto done;
    }
    result = PyUnicode_DecodeFSDefault(nvrtc_loaded_path());
done:
    for (Py_ssize_t i = 0; encoded && i < n; i++)
        Py_XDECREF(encoded[i]);
    PyMem_Free(encoded);
    PyMem_Free(paths);
    Py_DECREF(seq);
    return result;
}

static PyObject *c_nvrtc_version(PyObject *module, PyObject *unused)
{
    int major, minor;
    if (nvrtc_required())
        return NULL;
    NVRTC_CHECK(nvrtcVersion, &major, &minor);
    return Py_BuildValue("(ii)", major, minor);
fail:
    return NULL;
}

/* attnext.CompileError(message, source=source, log=log), raised. The message quotes the log's
 * first error line, which is what the reader needs first. */
static void raise_compile_error(const char *filename, PyObject *source, const char *log)
{
    char first[320] = "see the log";
    const char *line = strstr(log, "error");
    while (line && line > log && line[-1] != '\n')
        line--;
    if (line)
        snprintf(first, sizeof first, "%.*s", (int)strcspn(line, "\n"), line);
    PyObject *types = PyImport_ImportModule("attnext.types");
    PyObject *cls = types ? PyObject_GetAttrString(types, "CompileError") : NULL;
    PyObject *log_obj = PyUnicode_DecodeUTF8(log, strlen(log), "replace");
    PyObject *first_obj = PyUnicode_DecodeUTF8(first, strlen(first), "replace");
    PyObject *msg = first_obj ? PyUnicode_FromFormat("NVRTC could not compile %s: %U", filename,
                                                     first_obj) : NULL;
    PyObject *args = msg ? PyTuple_Pack(1, msg) : NULL;
    PyObject *kwargs = args && log_obj ? Py_BuildValue("{s:O,s:O}", "source", source, "log", log_obj) : NULL;
    PyObject *exc = cls && kwargs ? PyObject_Call(cls, args, kwargs) : NULL;
    if (exc)
        PyErr_SetObject(cls, exc);
    Py_XDECREF(exc);
    Py_XDECREF(kwargs);
    Py_XDECREF(args);
    Py_XDECREF(msg);
    Py_XDECREF(first_obj);
    Py_XDECREF(log_obj);
    Py_XDECREF(cls);
    Py_XDECREF(types);
}

/* Borrowed UTF-8 pointers to the str items of seq (alive as long as seq is). */
static const char **utf8_items(PyObject *seq, const char *what)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    const char **out = PyMem_Calloc(n + 1, sizeof *out);
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyUnicode_Check(item)) {
            PyErr_Format(PyExc_TypeError, "nvrtc_compile: %s[%zd] must be a str, got %.100s",
                         what, i, Py_TYPE(item)->tp_name);
            PyMem_Free(out);
            return NULL;
        }
        if (!(out[i] = PyUnicode_AsUTF8(item))) {
            PyMem_Free(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *c_nvrtc_compile(PyObject *module, PyObject *args)
{
    PyObject *source, *options, *headers, *opt_seq = NULL, *hdr_seq = NULL, *names = NULL;
    PyObject *texts = NULL, *cubin = NULL, *result = NULL;
    const char *filename, *src, **opts = NULL, **hdr_names = NULL, **hdr_texts = NULL;
    Py_ssize_t src_len, n_hdr = 0;
    nvrtcProgram prog = NULL;
    nvrtcResult rc;
    size_t log_size = 0, cubin_size = 0;
    char *log = NULL;
    if (!PyArg_ParseTuple(args, "UsOO:nvrtc_compile", &source, &filename, &options, &headers)
        || nvrtc_required())
        return NULL;
    if (!(src = PyUnicode_AsUTF8AndSize(source, &src_len)))
        return NULL;
    if ((Py_ssize_t)strlen(src) != src_len) {
        PyErr_SetString(PyExc_ValueError, "nvrtc_compile: the source contains a NUL character");
        return NULL;
    }
    if (!(opt_seq = PySequence_Fast(options, "nvrtc_compile: options must be a list of str"))
        || !(hdr_seq = PySequence_Fast(headers, "nvrtc_compile: headers must be a list of (name, text)"))
        || !(opts = utf8_items(opt_seq, "options")))
        goto fail;
    n_hdr = PySequence_Fast_GET_SIZE(hdr_seq);
    if (!(names = PyList_New(n_hdr)) || !(texts = PyList_New(n_hdr)))
        goto fail;
    for (Py_ssize_t i = 0; i < n_hdr; i++) {
        PyObject *name, *text, *item = PySequence_Fast_GET_ITEM(hdr_seq, i);
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "UU", &name, &text)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "nvrtc_compile: header %zd must be a (name, text) tuple "
                         "of str, got a %.100s", i, Py_TYPE(item)->tp_name);
            goto fail;
        }
        PyList_SET_ITEM(names, i, Py_NewRef(name));
        PyList_SET_ITEM(texts, i, Py_NewRef(text));
    }
    if (!(hdr_names = utf8_items(names, "header names")) || !(hdr_texts = utf8_items(texts, "header texts")))
        goto fail;
    NVRTC_CHECK(nvrtcCreateProgram, &prog, src, filename, (int)n_hdr, hdr_texts, hdr_names);
    Py_BEGIN_ALLOW_THREADS
    rc = NVRTC.nvrtcCompileProgram(prog, (int)PySequence_Fast_GET_SIZE(opt_seq), opts);
    Py_END_ALLOW_THREADS
    NVRTC_CHECK(nvrtcGetProgramLogSize, prog, &log_size);
    if (!(log = PyMem_Malloc(log_size + 1))) {
        PyErr_NoMemory();
        goto fail;
    }
    log[0] = '\0';
    NVRTC_CHECK(nvrtcGetProgramLog, prog, log);
    log[log_size] = '\0';
    if (rc == NVRTC_ERROR_COMPILATION) {
        raise_compile_error(filename, source, log);
        goto fail;
    }
    if (rc != NVRTC_SUCCESS) {
        PyErr_Format(PyExc_RuntimeError, "nvrtcCompileProgram of %s failed: %s: %s", filename,
                     NVRTC.nvrtcGetErrorString(rc), log);
        goto fail;
    }
    if (NVRTC.nvrtcGetCUBINSize(prog, &cubin_size) != NVRTC_SUCCESS || cubin_size == 0) {
        PyErr_Format(PyExc_RuntimeError, "nvrtc_compile: no CUBIN for %s: compile for a real "
                     "architecture (--gpu-architecture=sm_XX, not compute_XX)", filename);
        goto fail;
    }
    if (!(cubin = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cubin_size)))
        goto fail;
    NVRTC_CHECK(nvrtcGetCUBIN, prog, PyBytes_AS_STRING(cubin));
    result = Py_BuildValue("(ON)", cubin, PyUnicode_DecodeUTF8(log, strlen(log), "replace"));
fail:
    if (prog)
        NVRTC.nvrtcDestroyProgram(&prog);
    PyMem_Free(log);
    PyMem_Free(opts);
    PyMem_Free(hdr_names);
    PyMem_Free(hdr_texts);
    Py_XDECREF(cubin);
    Py_XDECREF(names);
    Py_XDECREF(texts);
    Py_XDECREF(opt_seq);
    Py_XDECREF(hdr_seq);
    return result;
}

static PyMethodDef nvrtc_methods[] = {
    {"nvrtc_load", c_nvrtc_load, METH_O,
     "nvrtc_load(candidates: list[str], /) -> str: load the first candidate (a libnvrtc file, "
     "a directory holding libnvrtc.so*, or a soname) that works and return its path; once "
     "loaded, returns that path whatever the candidates. RuntimeError listing each candidate "
     "and why it failed."},
    {"nvrtc_version", c_nvrtc_version, METH_NOARGS,
     "nvrtc_version() -> (major, minor) of the loaded NVRTC."},
    {"nvrtc_compile", c_nvrtc_compile, METH_VARARGS,
     "nvrtc_compile(source: str, filename: str, options: list[str], headers: list[tuple[str, "
     "str]], /) -> (cubin: bytes, log: str). headers are (include name, text) pairs found by "
     "#include. The GIL is released while NVRTC compiles. A compile error raises "
     "attnext.CompileError(message, source=source, log=log); options must name a real "
     "architecture (--gpu-architecture=sm_90a), else RuntimeError; a failing NVRTC call raises "
     "RuntimeError naming it."},
    {NULL, NULL, 0, NULL},
};

int cuda_nvrtc_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, nvrtc_methods);
}
