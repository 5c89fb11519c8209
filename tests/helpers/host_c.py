"""The generated device code (attnext/mods/codegen.py) and kernels/attn_mods.cuh built as host C
(DEV = static inline): a harness evaluates them over a grid of (score, b, h, q_idx, kv_idx, dout),
another over block-mask cells (b, h, r0, r1, c0, c1). unit/test_codegen.py, unit/test_cells.py,
unit/test_tile_sums.py, cpu/test_int_promotion.py and cpu/test_ufuncs.py build them."""
import subprocess

import numpy as np

from attnext.mods import bounds, codegen
from helpers import mods
from helpers.paths import CSRC, KERNELS

INCLUDES = [str(CSRC), str(KERNELS)]

# the host harnesses' start (test_cells' and test_tile_sums' too): the generated code compiled as
# C, and take()
PREAMBLE = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#define DEV static inline
#include "attn_params.h"
#include "attn_mods.cuh"
#include "attn_mod_gen.cuh"

static void *take(FILE *f, size_t n)
{
    void *p = calloc(n ? n : 8, 1);     /* an empty array: one readable word (codegen.pack) */
    if (n && fread(p, 1, n, f) != n)
        exit(3);
    return p;
}

/* codegen.pack's struct, then narr arrays (each its byte count, then its bytes); err: the
 * error record, zeroed */
static attn_mods_gpu *take_mods(FILE *f, int64_t narr, int64_t *err)
{
    attn_mods_gpu *m = (attn_mods_gpu *)take(f, sizeof(attn_mods_gpu));
    for (int64_t i = 0; i < narr; i++) {
        int64_t *nb = (int64_t *)take(f, 8);
        m->a[i].ptr = take(f, (size_t)*nb);
    }
    memset(err, 0, 5 * sizeof(int64_t));
    m->err = err;
    return m;
}
"""

HARNESS = PREAMBLE + r"""
int main(int argc, char **argv)
{
    if (argc < 3) {   /* the struct layout, for codegen.MODS_DTYPE */
        printf("%zu %zu %zu %zu %zu %zu\n", sizeof(attn_mods_gpu), offsetof(attn_mods_gpu, a),
               sizeof(attn_mod_array), offsetof(attn_mods_gpu, err), offsetof(attn_mods_gpu, dacc),
               offsetof(attn_mod_array, grad));
        return 0;
    }
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    int64_t *hdr = (int64_t *)take(in, 3 * 8);
    const int64_t n = hdr[0], narr = hdr[1], words = hdr[2];
    int64_t err[5];
    attn_mods_gpu *m = take_mods(in, narr, err);
    m->dacc = (uint64_t *)calloc((size_t)(words + 1), 8);
    float *score = (float *)take(in, n * 4), *dout = (float *)take(in, n * 4);
    int64_t *idx = (int64_t *)take(in, n * 32);
    float *res = (float *)calloc((size_t)(2 * n + 1), 4);
    int32_t *keep = (int32_t *)calloc((size_t)(n + 1), 4);
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = idx[i], h = idx[n + i], q = idx[2 * n + i], kv = idx[3 * n + i];
#if HAS_SCORE_MOD
        res[i] = mod_score(score[i], b, h, q, kv, m);
        res[n + i] = mod_dscore(score[i], b, h, q, kv, dout[i], m);
#if HAS_DTENSORS
        mod_dtensors(score[i], b, h, q, kv, dout[i], 0, m);
#endif
#endif
#if HAS_MASK_MOD
        keep[i] = mod_mask(b, h, q, kv, m);
#endif
    }
    fwrite(res, 4, (size_t)(2 * n), out);
    fwrite(keep, 4, (size_t)n, out);
    fwrite(err, 8, 5, out);
    fwrite(m->dacc, 8, (size_t)words, out);
    fclose(out);
    return 0;
}
"""


def build(cc, tmp_path, gen, harness=HARNESS, flags=(), folder="gen"):
    """The harness compiled with gen's code and defines (and flags) in tmp_path / folder."""
    d = tmp_path / folder
    d.mkdir(exist_ok=True)
    (d / codegen.HEADER).write_text(gen.source)
    (d / "main.c").write_text(harness)
    exe = d / "main"
    flags = [f"-D{k}={v}" for k, v in gen.defines.items()] + list(flags)
    subprocess.run([cc, "-std=c11", "-O1", "-Wall", "-Werror", "-Wno-unused-variable",
                    "-Wno-unused-function", "-Wno-unused-but-set-variable", *flags,
                    *(f"-I{p}" for p in INCLUDES + [str(d)]), str(d / "main.c"), "-o", str(exe),
                    "-lm"], check=True, capture_output=True, text=True)
    return exe


def run(exe, tmp_path, gen, bound, points, floats=()):
    """Runs the harness over points = (score, b, h, q, kv, dout) arrays; bound: the captured
    arrays by global number, floats: the float constants. Returns (fwd, dscore, keep, err,
    {array number: gradient})."""
    score, b, h, q, kv, dout = (np.asarray(x) for x in points)
    n = score.size
    offsets, total = {}, 0
    for i in gen.grad_arrays:
        offsets[i] = total
        total += bound[i].size
    arrays = [(0, a.shape, [s // a.itemsize for s in a.strides]) for a in bound]
    blob = [np.array([n, len(bound), total * codegen.WORDS], np.int64).tobytes(),
            codegen.pack(gen, floats, arrays, 0, 0, offsets)]
    for a in bound:
        blob += [np.array([a.nbytes], np.int64).tobytes(), a.tobytes()]
    blob += [score.astype(np.float32).tobytes(), dout.astype(np.float32).tobytes(),
             np.stack([b, h, q, kv]).astype(np.int64).tobytes()]
    (tmp_path / "in.bin").write_bytes(b"".join(blob))
    subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    raw = (tmp_path / "out.bin").read_bytes()
    res = np.frombuffer(raw, np.float32, 2 * n)
    keep = np.frombuffer(raw, np.int32, n, 8 * n)
    err = np.frombuffer(raw, np.int64, 5, 12 * n)
    words = np.frombuffer(raw, np.uint64, total * codegen.WORDS, 12 * n + 40)
    grads = {}
    for i in gen.grad_arrays:
        w = words[offsets[i] * codegen.WORDS:(offsets[i] + bound[i].size) * codegen.WORDS]
        grads[i] = codegen.limbs_to_float(w.reshape(-1, codegen.WORDS)).reshape(bound[i].shape)
    return res[:n], res[n:], keep, err, grads


def grid(rng, scores=(-2.3, -0.4, 0.0, 0.7, 1.9)):
    b, h, q, kv, s = np.meshgrid(np.arange(2), np.arange(mods.H_MAX), np.arange(mods.S_MAX),
                                 np.arange(mods.S_MAX), np.array(scores, np.float32),
                                 indexing="ij")
    s = s.ravel() + rng.uniform(-0.05, 0.05, s.size).astype(np.float32)
    return s.astype(np.float32), b.ravel(), h.ravel(), q.ravel(), kv.ravel(), \
        rng.standard_normal(s.size).astype(np.float32)


def bind(t, gen, kind, narrow=False):
    """Captured arrays of t in the kernels' storage, by global number (of this kind); narrow:
    integers as int32 where their values fit (what a call stores, codegen.Facts.narrow)."""
    return [codegen.storage(t.arrays[name], vt, narrow) for k, name, vt in gen.arrays if k == kind]


def with_facts(ts, tm):
    """The Generated of a call over grid()'s extents (codegen.Facts from attnext.bounds, integer
    arrays narrowed where their values fit) and the arrays it reads, by global number."""
    ext = bounds.Extents(2, mods.H_MAX, mods.S_MAX, mods.S_MAX)
    plain = codegen.generate(ts, tm)
    bound = (bind(ts, plain, "score_mod", True) if ts else []) + (bind(tm, plain, "mask_mod", True) if tm else [])
    modes = [bounds.lookup_modes(t, ext, bounds.array_values(t, t.arrays)) if t else () for t in (ts, tm)]
    facts = codegen.Facts(modes[0], modes[1], tuple(a.dtype == codegen.NARROW for a in bound))
    gen = codegen.generate(ts, tm, facts)
    checked = bounds.CHECKED in modes[0] + modes[1]
    assert ("mod_offset(" in gen.source) == checked and ("mod_offset_in(" in gen.source) == any(
        m != bounds.CHECKED for m in modes[0] + modes[1])
    assert ("mod_load_i32" in gen.source) == any(facts.narrow)
    return gen, bound


def close(got, want, what, rtol=3e-5, atol=3e-5):
    want = np.asarray(want, np.float64)
    got = np.asarray(got, np.float64)
    scale = np.maximum(1.0, np.abs(want))
    bad = ~((np.isnan(got) & np.isnan(want)) | (got == want)
            | (np.abs(got - want) <= atol * scale + rtol * np.abs(want)))
    assert not bad.any(), (what, np.flatnonzero(bad)[:5], got[bad][:5], want[bad][:5])


# --- block-mask cells (unit/test_cells.py, cpu/test_int_promotion.py) ---

# mod_mask_cell's answers: every pair kept, every pair masked, or some of each
KEPT, MASKED, BOTH = 1, 2, 3

CELL_HARNESS = PREAMBLE + r"""
int main(int argc, char **argv)
{
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    int64_t *hdr = (int64_t *)take(in, 2 * 8);
    const int64_t n = hdr[0], narr = hdr[1];
    int64_t err[5];
    attn_mods_gpu *m = take_mods(in, narr, err);
    int64_t *cell = (int64_t *)take(in, (size_t)n * 6 * 8);
    int32_t *res = (int32_t *)calloc((size_t)(3 * n + 1), 4);
    for (int64_t i = 0; i < n; i++) {
        const int64_t *c = cell + 6 * i;     /* b, h, r0, r1, c0, c1 */
        res[3 * i] = mod_mask_cell(c[0], c[1], c[2], c[3], c[4], c[5], m);
        for (int64_t q = c[2]; q <= c[3]; q++)
            for (int64_t k = c[4]; k <= c[5]; k++) {
                int bad = 0;
                res[3 * i + 1] |= mod_mask_q(c[0], c[1], q, k, m, &bad) ? 1 : 2;
                res[3 * i + 2] |= bad;
            }
    }
    fwrite(res, 4, (size_t)(3 * n), out);
    fclose(out);
    return 0;
}
"""


def run_cells(exe, tmp_path, gen, bound, cells, floats=()):
    """(mod_mask_cell's bits, the pairs' bits, whether a pair's lookup left its array) per cell
    (b, h, r0, r1, c0, c1)."""
    cells = np.asarray(cells, np.int64).reshape(-1, 6)
    arrays = [(0, a.shape, [s // a.itemsize for s in a.strides]) for a in bound]
    blob = [np.array([len(cells), len(bound)], np.int64).tobytes(), codegen.pack(gen, floats, arrays, 0, 0, {})]
    for a in bound:
        blob += [np.array([a.nbytes], np.int64).tobytes(), a.tobytes()]
    blob.append(cells.tobytes())
    (tmp_path / "cells.bin").write_bytes(b"".join(blob))
    subprocess.run([str(exe), str(tmp_path / "cells.bin"), str(tmp_path / "res.bin")], check=True)
    res = np.frombuffer((tmp_path / "res.bin").read_bytes(), np.int32).reshape(-1, 3)
    return res[:, 0], res[:, 1], res[:, 2].astype(bool)


def random_cells(rng, n, S=mods.S_MAX, H=mods.H_MAX, widths=(1, 2, 3, 5, 8, 16)):
    out = []
    for _ in range(n):
        wr, wc = rng.choice(widths, 2)
        r0, c0 = rng.integers(0, S - wr + 1), rng.integers(0, S - wc + 1)
        out.append((rng.integers(0, 2), rng.integers(0, H), r0, r0 + wr - 1, c0, c0 + wc - 1))
    return out
