"""The CUDA kernels' variants: source assembly, #defines, tile sizes, and loaded functions.

One source per kernel (kernels/attn_fwd.cu, ...), specialised by #defines at NVRTC time. The
headers it includes are handed to NVRTC from memory (csrc/attn_params.h, seqlen.h, block.h and
kernels/attn_common.cuh), so the kernels and the C host code read one attn_params definition.
Compiled cubins go through kernel_cache.CubinCache (memory LRU + disk); loaded functions are
kept per device in a bounded LRU here.

A score_mod / mask_mod variant adds two headers: kernels/attn_mods.cuh and the generated
attn_mod_gen.cuh (codegen.py), plus the switches of mod_defines; the cache keys on both. Such a
variant is compiled at a call, so for its first call's latency (module_of, prefetch): one entry
point per compile (ATTN_ENTRY_ONLY), the entry points of a call in parallel threads, the entry
points that read no mod taken from the plain variant (warmup's cache), and the backward's entry
points compiled in the background while the forward compiles its own (compile_ahead: a forward
with mods that returns lse). The plain variants are whole files, one compile for all their entry
points (warmup compiles them), except that an entry point whose whole file no cache holds yet is
compiled alone (module_for). A module is loaded once per device; prefetch loads a call's modules
in parallel. The cache key's NVRTC version comes from a record in the cache folder
(nvrtc_version), so a disk hit loads no NVRTC.
bench/lab_compile.py measures compile times, bench/lab_first.py a fresh process's first call.
"""
import concurrent.futures
import hashlib
import json
import os
import threading
from pathlib import Path

import numpy as np

from .. import _C
from ..lru import LRU
from ..mods import codegen
from .cache import CubinCache, default_cache_dir, write_small_file

_ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = Path(os.environ.get("ATTNEXT_KERNEL_DIR", _ROOT / "kernels"))
HEADER_FILES = (_ROOT / "csrc" / "attn_params.h", _ROOT / "csrc" / "seqlen.h",
                _ROOT / "csrc" / "block.h", KERNEL_DIR / "attn_common.cuh",
                KERNEL_DIR / "attn_fwd_tile.cuh", KERNEL_DIR / "attn_bwd_tile.cuh", KERNEL_DIR / "wgmma.cuh",
                KERNEL_DIR / "sm90_pipe.cuh")
# the widest tile edge of any kernel: a branch-free tile evaluates score_mod and mask_mod at
# every pair it covers, up to this far past a sequence's end (the results discarded there)
TILE_EDGE = 128
# every architecture CI compiles for (warmup --check) and the ones attnext targets
ARCHS = ("sm_80", "sm_90a")
SMEM_PAD = 8           # elements of padding per shared-memory row (attn_common.cuh)
MAX_SMEM_SM80 = 163 * 1024

DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
MODS_HEADER = KERNEL_DIR / "attn_mods.cuh"
MOD_INTS_HEADER = _ROOT / "csrc" / "mod_ints.h"        # attn_mods.cuh's, shared with interp.c

# The kernel lab's overrides of the choices below, read when a choice is made; cuda_backend's
# plans are keyed on their values (knobs()), so a change takes effect at the next call.
FWD_KNOBS = ("ATTNEXT_TILE_FWD", "ATTNEXT_TILE_DECODE", "ATTNEXT_DECODE_CTAS", "ATTNEXT_FWD_SM90",
             "ATTNEXT_TILE_SM90")
BWD_KNOBS = ("ATTNEXT_TILE_BWD", "ATTNEXT_BWD_SM90", "ATTNEXT_TILE_BWD_SM90", "ATTNEXT_BWD_DQ",
             "ATTNEXT_BWD_DQ_WRITE", "ATTNEXT_TILE_SUMS")
# os.environ.get costs ~0.5 us a name (key encoding, Mapping.get); the dict behind os.environ
# is what it reads (bytes keys where the OS environment is bytes, as on Linux)
_ENV = getattr(os.environ, "_data", None)
_ENV_BYTES = isinstance(_ENV, dict) and os.name == "posix"


def knobs(names):
    """The values of these environment variables (None where unset), cheaply: on every call."""
    if _ENV_BYTES:
        get = _ENV.get
        return tuple([get(n) for n in _encoded(names)])
    return tuple([os.environ.get(n) for n in names])


_ENCODED = {}


def _encoded(names):
    try:
        return _ENCODED[names]
    except KeyError:
        return _ENCODED.setdefault(names, tuple(os.fsencode(n) for n in names))


def _round_up(x, m):
    return (x + m - 1) // m * m


def tile_config(D, Dv):
    """(BLOCK_M, BLOCK_N, NUM_WARPS) of the forward for head dims D, Dv: the one place that
    chooses. Register budget (255 per thread, measured with -Xptxas -v): O holds
    BLOCK_M / NUM_WARPS * Dv floats per warp row group, S BLOCK_M / NUM_WARPS * BLOCK_N."""
    env = os.environ.get("ATTNEXT_TILE_FWD")       # the kernel lab's override: "128,64,8"
    if env:
        m, n, w = (int(x) for x in env.split(","))
        return m, n, w
    dvp = _round_up(Dv, 16)
    if dvp <= 64:
        return 128, 64, 4      # H100 bf16 S=2k: 259 TFLOP/s (128x32: 249, 64x64: 227)
    if dvp <= 128:
        return 128, 32, 4      # 276 (128x64x4: 268, spills 44 B; 64x64: 244)
    return 128, 64, 8          # 201 (128x128x8: 186, 64x64: 172)


DECODE_TILE = (64, 64, 4)    # packed-GQA / split-KV forward: few query rows, K and V streamed
DECODE_PACK_ROWS = 128       # a call packs its GQA heads into one block's rows up to Sq * group rows
DECODE_CTAS_PER_SM = 2       # the split-KV grid aims at this many CTAs per SM


def decode_tile():
    """attn_fwd.cu's tile for decode calls; the kernel lab's override: ATTNEXT_TILE_DECODE="16,64,1"."""
    env = os.environ.get("ATTNEXT_TILE_DECODE")
    return tuple(int(x) for x in env.split(",")) if env else DECODE_TILE


def decode_ctas_per_sm():
    return int(os.environ.get("ATTNEXT_DECODE_CTAS", DECODE_CTAS_PER_SM))
# attn_fwd_sm90 (H100 bf16, bench/lab_fwd.py, TFLOP/s against SDPA flash in the same run):
# 128 x 128 (two warpgroups, one CTA per SM) is best at D=128 from S=2k (1.08x at 2k, 1.31x at
# 16k); 64 x 64 (one warpgroup, two CTAs per SM overlapping each other) at D=64 (0.91x at S=512,
# 1.06x at 2k) and at D=128 for short sequences (0.84x at 512, against 0.79x).
SM90_TILE_LONG = (128, 128, 8)
SM90_TILE_SHORT = (64, 64, 4)
# with a score_mod: 64 keys a tile. With lookups into captured arrays their registers then fit
# beside S and O (the relative-bias table spills 308 bytes at 128 x 128, 4 at 128 x 64, NVRTC
# -Xptxas=-v; H100, bench/lab_mods.py: 3.91 against 3.81 ms). A score_mod of arithmetic alone
# runs 6-9% faster at 128 x 128 (softcap, the bench's row: 2.47 against 2.70 ms, 1.19x against
# 1.09x Flex; lab_mods: 2.48 against 2.64 ms), but its first call waits for the compile, whose
# unrolled score loop halves with the tile: softcap's forward 0.62 -> 0.47 s with NVRTC 13.5
# here, 1.8-2.4 s on the H100 hosts at 128 x 128 (the bound: 2 s). A mask_mod alone
# keeps the plain tiles: its code runs only on the tiles the block mask does not keep whole
# (causal window 0.60 -> 0.50 ms, document mask 1.50 -> 1.45 ms against 128 x 64)
SM90_TILE_MODS = (128, 64, 8)
SM90_SHORT_ROWS = 1024


def fwd_kernel(arch, D, Dv, vec, decode, rows, mods=None):
    """(kernel source, tile) of the forward: kernels/attn_fwd_sm90.cu (wgmma) on sm_90a for
    16-byte-loadable inputs with D, Dv in {64, 128}, else kernels/attn_fwd.cu (mma.sync, every
    shape, and the decode paths). rows: the longest query sequence; mods: the generated
    score_mod / mask_mod compiled in (codegen.Generated) or None: a score_mod takes
    SM90_TILE_MODS where its staged output fits (sm90_staged_o_fits), a mask_mod alone the
    plain tiles. ATTNEXT_FWD_SM90=0 keeps Hopper on attn_fwd.cu (the lab's and the tests'
    comparison)."""
    if (arch == "sm_90a" and not decode and vec and D in (64, 128) and Dv in (64, 128)
            and os.environ.get("ATTNEXT_FWD_SM90", "1") != "0"):
        env = os.environ.get("ATTNEXT_TILE_SM90")      # the kernel lab's override: "128,64,8"
        if env:
            return "attn_fwd_sm90", tuple(int(x) for x in env.split(","))
        short = max(D, Dv) <= 64 or rows <= SM90_SHORT_ROWS
        score_mod = mods is not None and bool(mods.defines.get("HAS_SCORE_MOD"))
        if short:
            return "attn_fwd_sm90", SM90_TILE_SHORT
        mods_tile = score_mod and sm90_staged_o_fits(D, Dv, SM90_TILE_MODS)
        return "attn_fwd_sm90", SM90_TILE_MODS if mods_tile else SM90_TILE_LONG
    return "attn_fwd", decode_tile() if decode else tile_config(D, Dv)


def sm90_staged_o_fits(D, Dv, tile):
    """attn_fwd_sm90.cu's static_assert: the output tile staged with padded rows (Dv + 8 wide)
    fits the Q and K buffers it reuses (128 x 64 at D = 64, Dv = 128 does not)."""
    bm, bn = tile[:2]
    return bm * (Dv + 8) * 2 <= bm * D * 2 + 2 * bn * D * 2


def fwd_smem_bytes(D, Dv, tile, kernel="attn_fwd"):
    bm, bn = tile[:2]
    if kernel == "attn_fwd_sm90":     # Q, K[2], V[2] in 128-byte swizzled rows, 1024-aligned
        return 2 * (bm * D + 2 * bn * D + 2 * bn * Dv) + 1024
    dp, dvp = _round_up(D, 16), _round_up(Dv, 16)
    return 2 * (bm * (dp + SMEM_PAD) + bn * (dp + SMEM_PAD) + bn * (dvp + SMEM_PAD))


def mod_defines(defines, mods):
    """defines with a generated score_mod / mask_mod's switches (mods: a codegen.Generated or
    None): HAS_MASK then says that some pair needs the per-element test, MASK_ARRAY whether a
    mask array is one of the reasons."""
    if mods is None:
        return defines
    d = dict(defines, **mods.defines)
    d["ATTN_GMODS"] = 1          # attn_params.h: the kernels' parameter carries gmods
    d["MASK_ARRAY"] = defines["HAS_MASK"]
    d["HAS_MASK"] = int(defines["HAS_MASK"] or mods.defines["HAS_MASK_MOD"])
    return d


# Entry points that read nothing of the score_mod / mask_mod (attn_params.gmods is the struct's
# last field, so a plain kernel reads the prefix of a call's parameter that carries them): a call
# with mods takes them from the plain variant (warmup's cache), never compiles them again
MOD_FREE_ENTRIES = frozenset({"attn_fwd_combine", "attn_bwd_pre", "attn_bwd_dq_convert"})
_MOD_KEYS = ("HAS_SCORE_MOD", "HAS_MASK_MOD", "HAS_DTENSORS", "ATTN_GMODS", "MASK_ARRAY")


def plain_defines(defines):
    """mod_defines undone: the defines of the same variant without a score_mod / mask_mod."""
    if not defines.get("ATTN_GMODS"):
        return defines
    d = {k: v for k, v in defines.items() if k not in _MOD_KEYS}
    d["HAS_MASK"] = defines["MASK_ARRAY"]
    return d


def entry_defines(defines, name):
    """defines that make a compile emit entry point `name` only (attn_common.cuh: ENTRY)."""
    return dict(defines, ATTN_ENTRY_ONLY=1, **{f"ATTN_ENTRY_{name}": 1})


def fwd_defines(*, dtype, D, Dv, vec, softcap, bias_dtype, alibi_dtype, mask, tile,
                pack_gqa=False, split_kv=False, mods=None):
    """The #defines of one forward variant. bias_dtype / alibi_dtype: a dtype name or None.
    tile: (BLOCK_M, BLOCK_N, NUM_WARPS[, MIN_BLOCKS: CTAs per SM the registers must allow]).
    mods: the generated score_mod / mask_mod (codegen.Generated) or None."""
    bm, bn, w = tile[:3]
    return mod_defines({
        "MIN_BLOCKS": tile[3] if len(tile) > 3 else 1,
        "PACK_GQA": int(pack_gqa), "SPLIT_KV": int(split_kv),
        "ELEM_BF16": int(dtype == "bfloat16"), "HEAD_DIM": D, "HEAD_DIM_V": Dv, "VEC_LOAD": int(vec),
        "HAS_SOFTCAP": int(softcap), "HAS_BIAS": int(bias_dtype is not None),
        "BIAS_DT": DTYPE_CODES[bias_dtype or "float32"], "HAS_ALIBI": int(alibi_dtype is not None),
        "ALIBI_DT": DTYPE_CODES[alibi_dtype or "float32"], "HAS_MASK": int(mask),
        "BLOCK_M": bm, "BLOCK_N": bn, "NUM_WARPS": w,
    }, mods)


def block_mask_defines(mods):
    """The #defines of kernels/attn_block_mask.cu for a generated mask_mod: one variant per
    mask_mod whatever the attention call's dtype, head dims and options (it reads none of them),
    so the forward and the backward share it."""
    return dict(fwd_defines(dtype="bfloat16", D=64, Dv=64, vec=False, softcap=False, bias_dtype=None,
                            alibi_dtype=None, mask=False, tile=(64, 64, 4), mods=mods),
                ATTN_BLOCK_CELLS=codegen.BLOCK_CELLS)


def block_mask_specs(mods):
    """[(kernel, entry point, defines, generated)] of the block-mask kernel a call with these
    generated mods launches before its attention kernels (none without a mask_mod): for prefetch,
    so that it compiles beside them."""
    if mods is None or not mods.defines["HAS_MASK_MOD"]:
        return []
    return [("attn_block_mask", "attn_block_mask", block_mask_defines(mods), mods.source)]


_texts = {}        # path -> (stamp, text): kernel sources and headers read once


def _text(path):
    """The text of a kernel source or header, read again only when its file changed (a first
    call reads every header for each module's cache key: ~6 ms on an H100 host); the same str
    object each time, so the keys' memo (CubinCache.key) hashes it once. Changed: another inode,
    size, mtime or ctime (which every write or replace moves, even one that keeps the mtime)."""
    st = os.stat(path)
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    got = _texts.get(path)
    if got is None or got[0] != stamp:
        got = (stamp, Path(path).read_text())
        _texts[path] = got
    return got[1]


def _headers(generated=None):
    """The in-memory headers NVRTC gets; generated: the source of attn_mod_gen.cuh, or None."""
    out = [(p.name, _text(p)) for p in HEADER_FILES]
    if generated is not None:
        from ..mods.codegen import HEADER
        out += [(MODS_HEADER.name, _text(MODS_HEADER)), (MOD_INTS_HEADER.name, _text(MOD_INTS_HEADER)),
                (HEADER, generated)]
    return out


def options(defines, arch):
    return ([f"--gpu-architecture={arch}", "--std=c++17", "-lineinfo"]
            + [f"-D{k}={v}" for k, v in sorted(defines.items())])


_nvrtc_lock = threading.Lock()
_nvrtc_version = None      # NVRTC's (major, minor): loaded, or read from the record
_nvrtc_loaded = False
_cubins = None
NVRTC_RECORD = "nvrtc.json"    # in the disk cache's folder: the version of the library that loads


def nvrtc_candidates():
    """Where NVRTC is looked for, in order: ATTNEXT_NVRTC, the nvidia-cuda-nvrtc wheel's lib
    folders, $CUDA_HOME/lib64, /usr/local/cuda/lib64, then the plain sonames."""
    out = []
    if os.environ.get("ATTNEXT_NVRTC"):
        out.append(os.environ["ATTNEXT_NVRTC"])
    try:
        import nvidia
        for base in nvidia.__path__:
            for sub in ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib"):
                d = os.path.join(base, sub)
                if os.path.isdir(d):
                    out.append(d)
    except ImportError:
        pass
    if os.environ.get("CUDA_HOME"):
        out.append(os.path.join(os.environ["CUDA_HOME"], "lib64"))
    out += ["/usr/local/cuda/lib64", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    return out


def _file_id(path):
    """(device, inode, size, mtime) of the file at path (links followed), or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def nvrtc_fingerprint(candidates):
    """What decides which NVRTC nvrtc_load(candidates) loads, from stats alone (no dlopen): each
    candidate path's file identity (a folder's libnvrtc.so* files'), and for the bare sonames
    the dynamic loader's search (LD_LIBRARY_PATH, /etc/ld.so.cache)."""
    parts = [os.environ.get("LD_LIBRARY_PATH", ""), _file_id("/etc/ld.so.cache")]
    for c in candidates:
        if "/" not in c:
            parts.append(c)
        elif os.path.isdir(c):
            try:
                names = sorted(n for n in os.listdir(c) if n.startswith("libnvrtc.so"))
            except OSError:
                names = None
            parts.append((c, names and [(n, _file_id(os.path.join(c, n))) for n in names]))
        else:
            parts.append((c, _file_id(c)))
    return hashlib.sha256(repr(parts).encode("utf-8", "surrogatepass")).hexdigest()


def _loaded_nvrtc_file(loaded):
    """The real path of the library nvrtc_load loaded (`loaded`: the candidate it took, a path,
    or a soname the dynamic loader resolved: found in /proc/self/maps), or None."""
    if "/" in loaded:
        return os.path.realpath(loaded)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if os.path.basename(path).startswith(loaded):
                    return os.path.realpath(path)
    except OSError:
        pass
    return None


def _record_path():
    folder = default_cache_dir()
    return None if folder is None else os.path.join(folder, NVRTC_RECORD)


def _recorded_version(fingerprint):
    """The version the record holds for this fingerprint, if the library it names is unchanged."""
    path = _record_path()
    if path is None:
        return None
    try:
        with open(path) as f:
            rec = json.load(f)
        if (rec["fingerprint"] == fingerprint
                and list(_file_id(rec["library"]) or ()) == rec["library_id"]):
            return tuple(int(x) for x in rec["version"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_record(fingerprint, version, loaded):
    path, library = _record_path(), _loaded_nvrtc_file(loaded)
    library_id = None if library is None else _file_id(library)
    if path is None or library_id is None:
        return                      # nothing to check the record against: none written
    rec = dict(fingerprint=fingerprint, version=list(version), library=library,
               library_id=list(library_id))
    write_small_file(path, json.dumps(rec).encode())


def nvrtc():
    """Loads NVRTC once; returns its version (major, minor). RuntimeError says what was tried.
    The version is recorded in the disk cache's folder for nvrtc_version()."""
    global _nvrtc_version, _nvrtc_loaded
    with _nvrtc_lock:
        if not _nvrtc_loaded:
            candidates = nvrtc_candidates()
            loaded = _C.nvrtc_load(candidates)
            _nvrtc_loaded = True
            version = tuple(_C.nvrtc_version())
            if version != _nvrtc_version:
                _write_record(nvrtc_fingerprint(candidates), version, loaded)
            _nvrtc_version = version
        return _nvrtc_version


def nvrtc_version():
    """NVRTC's version (major, minor), the kernel cache's key: from the record when the files
    that decide which library loads are unchanged since it was written (a stat each, no
    dlopen: a fresh process that finds its kernels on disk never loads NVRTC, ~10-25 ms), else
    loaded (nvrtc()). RuntimeError when it cannot be loaded."""
    global _nvrtc_version
    with _nvrtc_lock:
        if _nvrtc_version is not None:
            return _nvrtc_version
        _nvrtc_version = _recorded_version(nvrtc_fingerprint(nvrtc_candidates()))
        if _nvrtc_version is not None:
            return _nvrtc_version
    return nvrtc()


class _StaleVersion(Exception):
    """The record named another NVRTC than the one that loaded to compile: the cache key was
    computed with the wrong version (cubin() computes it again)."""


_keyed = threading.local()      # .version: the NVRTC version of the key cubin() asks for


def _compile(source, filename, options, headers):
    """CubinCache's compiler (in the thread of the cubin() that missed): loads NVRTC first."""
    keyed = getattr(_keyed, "version", None)
    if nvrtc() != keyed and keyed is not None:
        raise _StaleVersion
    return _C.nvrtc_compile(source, filename, options, headers)


def _cache():
    global _cubins
    with _nvrtc_lock:
        if _cubins is None:
            _cubins = CubinCache(_compile)
        return _cubins


def compile_args(kernel, defines, arch, generated=None):
    """(source, file name, options, headers): what NVRTC gets for kernels/<kernel>.cu."""
    src = _text(KERNEL_DIR / f"{kernel}.cu")
    return src, f"{kernel}.cu", options(defines, arch), _headers(generated)


def cubin(kernel, defines, arch, generated=None):
    """The compiled cubin of kernels/<kernel>.cu with these defines for arch (cached);
    generated: the generated score_mod / mask_mod header's source, or None."""
    args = compile_args(kernel, defines, arch, generated)
    while True:
        _keyed.version = nvrtc_version()
        try:
            return _cache().get(*args, arch, ".".join(map(str, _keyed.version)))
        except _StaleVersion:       # the record was stale: nvrtc() loaded another version
            continue                # and rewrote it; the key again, with the loaded one
        finally:
            _keyed.version = None


def cache_info():
    return _cubins.info() if _cubins is not None else None


def module_of(kernel, name, defines, generated):
    """(kernel, defines, generated) of the cubin that holds entry point `name`. Without mods, the
    whole file's (warmup compiles it once for all its entry points); with mods, the plain
    variant's for an entry point that reads none of them, else one compiled for that entry point
    alone: only the code the call runs (the generated code is inlined at every score, so each
    entry point costs seconds of NVRTC), and the entry points of a call compile in parallel
    (prefetch)."""
    if generated is None:
        return kernel, defines, None
    if name in MOD_FREE_ENTRIES:
        return kernel, plain_defines(defines), None
    return kernel, entry_defines(defines, name), generated


def _version_text():
    return ".".join(map(str, nvrtc_version()))


def module_for(kernel, name, defines, generated, arch):
    """module_of(...), except that a whole file's variant no cache holds yet (a plain one, before
    warmup has compiled it) gives way to entry point `name` compiled alone: a call's first use
    waits for the code it runs (attn_bwd.cu's whole file compiles in ~1.4 s, one of its row
    kernels in a fraction), and the whole file stays warmup's to compile."""
    k, d, g = module_of(kernel, name, defines, generated)
    if d.get("ATTN_ENTRY_ONLY"):
        return k, d, g
    args = compile_args(k, d, arch, g)
    if "ENTRY(" in args[0] and not _cache().has(*args, arch, _version_text()):
        d = entry_defines(d, name)      # a file of several entry points (attn_common.cuh ENTRY)
    return k, d, g


def prefetch(specs, arch, device):
    """Compiles (or reads from disk) the cubins of these entry points ((kernel, name, defines,
    generated) each) that are not in memory, and loads their modules on `device`, in parallel
    threads (NVRTC and the module loads run without the GIL; a compile takes one core): a
    call's first use of new kernels waits for the slowest compile, not for their sum, and a
    first call from the disk cache for the slowest load (~7 ms a module on an H100 host). A plan
    whose modules are all loaded (new shapes of known kernels) starts no thread."""
    modules = {}
    for kernel, name, defines, generated in specs:
        if _loaded.get(_function_key(kernel, name, defines, generated, device)):
            continue
        k, d, g = module_for(kernel, name, defines, generated, arch)
        mkey = (k, tuple(sorted(d.items())), g, device, arch)
        if mkey not in _modules:
            modules.setdefault(mkey, (k, d, g))
    if len(modules) < 2:
        return
    with concurrent.futures.ThreadPoolExecutor(min(len(modules), os.cpu_count() or 1)) as pool:
        for f in [pool.submit(_load_module, mkey, *kdg, device, arch) for mkey, kdg in modules.items()]:
            f.result()


# A forward with a score_mod / mask_mod that returns lse (a backward may follow) starts the
# compiles of the backward it expects beside its own (cuda_backend._compile_backward_ahead), so
# that backward's first call waits only for what is left of them. ATTNEXT_COMPILE_AHEAD=0 (or
# off / false / no) never, =1 always, unset: where the machine has a core for each compile of the
# two calls and of those still running from earlier calls (beside each other compiles slow down:
# on a 2-core machine the forward would wait for the backward's).
COMPILE_AHEAD_KNOB = "ATTNEXT_COMPILE_AHEAD"
_ahead = None          # compile_ahead's threads, made at its first use
_ahead_lock = threading.Lock()
_ahead_running = 0     # its compiles submitted and not yet done


def _cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compile_ahead(specs, arch, busy=1):
    """Starts compiling (or reading from disk) the cubins of these entry points (prefetch's specs)
    that no cache holds yet, in background threads, and returns at once; the modules are loaded
    by the call that needs them (a module load waits for the kernels in flight). busy: the
    compiles the caller runs meanwhile. Returns the futures ([] when ATTNEXT_COMPILE_AHEAD or
    the cores say no). A cubin asked for while it compiles waits for this compile (CubinCache's
    per-key lock); one that fails here is compiled again, and raises, in the call that needs it.
    At the interpreter's exit the compiles not yet begun are dropped and those under way
    finished (their cubins reach the disk cache); a forked child starts with none."""
    global _ahead, _ahead_running
    env = os.environ.get(COMPILE_AHEAD_KNOB, "").strip().lower()
    if env in ("0", "off", "false", "no") or not specs:
        return []
    todo, version = {}, _version_text()
    for kernel, name, defines, generated in specs:
        k, d, g = module_for(kernel, name, defines, generated, arch)
        if not _cache().has(*compile_args(k, d, arch, g), arch, version):
            todo.setdefault((k, tuple(sorted(d.items())), g), (k, d, g))
    with _ahead_lock:
        if not todo or (env != "1" and _cpus() < len(todo) + busy + _ahead_running):
            return []
        if _ahead is None:
            _ahead = concurrent.futures.ThreadPoolExecutor(max(2, _cpus() - 1), "attnext-ahead")
            threading._register_atexit(_drop_queued)     # runs before the pool's own join
        _ahead_running += len(todo)
        futures = [_ahead.submit(cubin, k, d, arch, g) for k, d, g in todo.values()]
    for f in futures:
        f.add_done_callback(_ahead_done)
    return futures


def _ahead_done(_future):
    global _ahead_running
    with _ahead_lock:
        _ahead_running -= 1


def _drop_queued():
    """At exit: compile_ahead's compiles not yet begun are cancelled, so exit waits only for those
    under way."""
    if _ahead is not None:
        _ahead.shutdown(wait=False, cancel_futures=True)


def _forget_ahead_after_fork():
    """In a forked child: no compile_ahead threads, and the compile locks anew (a background
    compile of the parent's may have held them at the fork)."""
    global _ahead, _ahead_lock, _ahead_running, _nvrtc_lock
    _ahead, _ahead_lock, _ahead_running, _nvrtc_lock = None, threading.Lock(), 0, threading.Lock()
    if _cubins is not None:
        _cubins.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_ahead_after_fork)


def _load_module(mkey, kernel, defines, generated, device, arch):
    """The module of this cubin on device, loaded once (kept in _modules under mkey)."""
    with _functions_lock:
        module = _modules.get(mkey)
    if module is None:
        module = _C.module_load(cubin(kernel, defines, arch, generated), device)
        with _functions_lock:
            _modules.put(mkey, module)
    return module


_functions = LRU(64)       # (kernel, name, defines, device, arch, smem, generated) -> function
_modules = LRU(64)         # (kernel, defines, generated, device, arch) -> loaded module
_loaded = LRU(256)         # (kernel, name, defines, generated, device) -> True: loaded there
_functions_lock = threading.Lock()


def _function_key(kernel, name, defines, generated, device):
    return kernel, name, tuple(sorted(defines.items())), generated, device


def function(kernel, name, defines, device, arch, smem, generated=None):
    """The loaded function `name` of kernels/<kernel>.cu in this variant on `device` (a capsule),
    its dynamic shared memory limit raised to smem bytes; generated: as for cubin(). A module
    is loaded once per device for all the entry points it serves."""
    key = (kernel, name, tuple(sorted(defines.items())), device, arch, smem, generated)
    with _functions_lock:
        fn = _functions.get(key)
    if fn is None:
        k, d, g = module_for(kernel, name, defines, generated, arch)
        module = _load_module((k, tuple(sorted(d.items())), g, device, arch), k, d, g, device, arch)
        fn = _C.module_function(module, name, smem)
        with _functions_lock:
            _functions.put(key, fn)
            _loaded.put(_function_key(kernel, name, defines, generated, device), True)
    return fn


def fwd_variants():
    """The forward variants warmup compiles: both dtypes, the common head dims, each feature on
    its own, vector and element loads."""
    out = []
    for dtype in ("bfloat16", "float16"):
        for D, Dv in ((64, 64), (128, 128), (256, 256), (96, 96), (192, 128), (59, 40)):
            vec = D % 8 == 0 and Dv % 8 == 0
            base = dict(dtype=dtype, D=D, Dv=Dv, vec=vec, softcap=False, bias_dtype=None,
                        alibi_dtype=None, mask=False, tile=tile_config(D, Dv))
            out.append(base)
            if (D, Dv) == (128, 128):
                out.append({**base, "tile": DECODE_TILE, "pack_gqa": True, "split_kv": True})
                out.append({**base, "tile": DECODE_TILE, "pack_gqa": True})
                out.append({**base, "tile": DECODE_TILE, "split_kv": True})
                out.append({**base, "vec": False})
                out.append({**base, "softcap": True})
                out.append({**base, "bias_dtype": dtype})
                out.append({**base, "bias_dtype": "float32", "mask": True, "alibi_dtype": "float32"})
    return [("attn_fwd", fwd_defines(**v)) for v in out]


def bwd_tile_config(D, Dv):
    """The backward's tiles for head dims D, Dv: the one place that chooses. Returns a dict:
    kv_block_m, kv_warps, kv_split, kv_minb (dkdv: query rows per streamed tile; warps, 16 key
    rows each; dV and dK in two passes; CTAs per SM the registers must allow) and q_block_m,
    q_block_n, q_warps, q_minb (dq and dbias).

    Register budget (255 per thread, measured with -Xptxas -v, no spills): a dkdv thread holds
    (DP + DVP) / 2 floats of dK and dV plus kv_block_m of S^T and dP^T; a dq thread DP / 2 * (rows
    per warp / 16) of dQ plus q_block_n of S and dP. The kernels are latency-bound at 2 warps per
    scheduler, so CTAs are 4 warps (two or more per SM, barriers independent): on an H100 this
    measured 1.05x (D=128) to 1.3x (D=64) faster than 8-warp CTAs. Shared memory stays under
    sm_80's 163 KB per CTA. Every choice gives the same bits: the products accumulate over 16-wide
    steps in the same order whatever the tile."""
    env = os.environ.get("ATTNEXT_TILE_BWD")   # the kernel lab's override: "32,4,0,2,64,64,4,2"
    if env:
        keys = ("kv_block_m", "kv_warps", "kv_split", "kv_minb", "q_block_m", "q_block_n", "q_warps",
                "q_minb")
        return dict(zip(keys, (int(x) for x in env.split(","))))
    dp, dvp = _round_up(D, 16), _round_up(Dv, 16)
    q = dict(q_block_m=64, q_block_n=64 if dp <= 128 else 32, q_warps=4, q_minb=2)
    if dp + dvp <= 128:
        return dict(kv_block_m=64, kv_warps=4, kv_split=0, kv_minb=2, **q)
    if dp + dvp <= 256:
        return dict(kv_block_m=32, kv_warps=4, kv_split=0, kv_minb=2, **q)
    return dict(kv_block_m=32, kv_warps=4, kv_split=1, kv_minb=2, **q)


def tile_sums(mods, bm, bn):
    """(slots, admit, always): the shared memory the dQ kernels' tiles of bm x bn pairs sum the
    score_mod's array gradients in (MOD_TILE_SLOTS, codegen.TILE_SLOT_BYTES a slot; attn_mods.cuh:
    mod_tile), which tile terms it holds (MOD_TILE_ADMIT, a bit each), and whether every tile of
    the call takes them (MOD_TILE_ALWAYS: each admitted term proven in range with indices in
    [0, n), codegen.TileTerm; the kernels then have no loop without them, half the code to
    compile). Each term's span over a whole tile, in order, those that fit in bm + bn: a diagonal
    table's bm + bn - 1 elements (table[h, q_idx - kv_idx + S]), 12 KB at 64 x 64, which keeps
    two of the H100's D = 128 dQ CTAs an SM. (0, 0, False) without a tile term: every adjoint
    goes to the accumulator, as with ATTNEXT_TILE_SUMS=0 (the lab's and the tests' comparison:
    the same bits either way)."""
    used, admit, always = 0, 0, True
    terms = mods.tile_terms if mods is not None and mods.defines.get("HAS_DTENSORS") else ()
    if os.environ.get("ATTNEXT_TILE_SUMS") == "0":
        terms = ()
    for k, t in enumerate(terms):
        span = abs(t.a) * (bm - 1) + abs(t.c) * (bn - 1) + 1
        if used + span <= bm + bn:
            used += span
            admit |= 1 << k
            always &= t.proven
    return used, admit, bool(admit) and always


def bwd_smem_bytes(D, Dv, tile, atomic, slots=0):
    """Dynamic shared memory of each backward kernel (attn_bwd.cu's layouts), by kernel name;
    slots: the dQ kernel's tile sums (tile_sums)."""
    dp, dvp = _round_up(D, 16) + SMEM_PAD, _round_up(Dv, 16) + SMEM_PAD
    bm, bn = tile["kv_block_m"], 16 * tile["kv_warps"]
    dkdv_common = bn * dp + 2 * bm * dp + 2 * bm * dvp
    extra = 4 * 4 * bm + (2 * bn * (bm + SMEM_PAD) if atomic else 0)
    qm, qn, qw = tile["q_block_m"], tile["q_block_n"], tile["q_warps"]
    return {
        "attn_bwd_dkdv": 2 * (dkdv_common + bn * dvp) + extra,
        "attn_bwd_dk": 2 * (dkdv_common + bn * dvp) + extra,
        "attn_bwd_dead": 2 * (dkdv_common + bn * dvp) + extra,   # dkdv's (or dk's: KV_SPLIT)
        "attn_bwd_dv": 2 * dkdv_common + extra,
        "attn_bwd_dq": 2 * (qm * dp + qm * dvp + 2 * qn * dp + qn * dvp) + slots * codegen.TILE_SLOT_BYTES,
        "attn_bwd_dbias": 2 * (qm * dp + qm * dvp + qn * dp + qn * dvp) + 4 * qw * qn,
        "attn_bwd_pre": 0,
        "attn_bwd_dq_convert": 0,
    }


def bwd_sm90_applies(arch, D, Dv, vec):
    """Whether attn_bwd_sm90.cu (wgmma dK, dV, dQ) runs: sm_90a, 16-byte loads, D, Dv in {64,
    128}; else attn_bwd.cu. ATTNEXT_BWD_SM90=0 keeps Hopper on attn_bwd.cu (the lab's and the
    tests' comparison)."""
    return (arch == "sm_90a" and vec and D in (64, 128) and Dv in (64, 128)
            and os.environ.get("ATTNEXT_BWD_SM90", "1") != "0")


DQ_MODES = ("recompute", "atomic", "ordered")


# Short keys (at most this many, the longest sequence's): the ordered mode's last turn at a query
# tile writes dq itself (bwd_dq_write_last), and deterministic=False takes the ordered mode too, which
# is then the faster (H100 D64 S512: 0.92x against the atomic mode's 0.87x flash). With more keys
# that last turn's extra work (the tile's sum read back and converted) holds up its key block's
# consumers: the main kernel measured 2.23 against 2.06 ms at D128 S2k (bench/NOTES.md, session 14)
SHORT_KEYS = 1024


def bwd_dq_mode(sm90, D, deterministic, Dv=None, k_rows=None):
    """How the backward gets dQ:
      "recompute"  the dQ kernel recomputes S and dP per query tile and owns its rows (7 products;
                   the same bits every run);
      "ordered"    the dK/dV kernel adds dS K into a float32 dq_accum, the key blocks taking turns
                   at each query tile in a fixed order (5 products; the same bits every run;
                   attn_bwd_sm90.cu's warp-specialised kernel, D = 128 or D = Dv = 64);
      "atomic"     the same additions in whatever order they land (5 products; bits vary from run
                   to run: deterministic=False only).
    On Hopper at D = 128 (and D = Dv = 64) a deterministic call takes ordered and
    deterministic=False atomic (the turns are the producer warpgroup's, off the math:
    bench/NOTES.md, backward v4 and v5); elsewhere dQ is recomputed (attn_bwd.cu's atomic path
    measured no faster). Dv: D's when not given. ATTNEXT_BWD_DQ names a mode for the lab and the
    tests; a mode a call does not allow falls back to the nearest it does. k_rows: the most keys
    a query row may see (the longest key sequence, or a narrower window's width: cuda_backend);
    deterministic=False with at most SHORT_KEYS of them takes ordered too."""
    adds = sm90 and (D == 128 or (D == 64 and (Dv or D) == 64))   # the warp-specialised kernel takes it
    mode = os.environ.get("ATTNEXT_BWD_DQ", "")
    if mode not in DQ_MODES:
        short = k_rows is not None and k_rows <= SHORT_KEYS
        mode = "recompute" if not adds else "ordered" if deterministic or short else "atomic"
    if mode == "atomic" and deterministic:
        mode = "ordered"
    if mode == "ordered" and not adds:
        mode = "recompute"
    if mode == "atomic" and sm90 and not adds:
        mode = "recompute"
    return mode


def bwd_dq_write_last(mode, mask_mod, k_rows):
    """Whether the ordered mode's last turn at each query tile writes dq (attn_bwd_sm90.cu:
    dq_write_last) instead of attn_bwd_dq_convert: with at most SHORT_KEYS keys a query row may
    see (k_rows, as for bwd_dq_mode) and no mask_mod (whose key blocks may pass their turns).
    ATTNEXT_BWD_DQ_WRITE=0|1 decides for the lab and the tests where the mode allows it."""
    if mode != "ordered" or mask_mod:
        return False
    env = os.environ.get("ATTNEXT_BWD_DQ_WRITE")
    return env == "1" if env in ("0", "1") else k_rows <= SHORT_KEYS


# attn_bwd_sm90.cu's tiles: one warpgroup (64 keys) per recomputing dK/dV CTA, two CTAs per SM at
# D = 128, three at D = 64 (168 registers: 1.15x faster than two on an H100); two consumer
# warpgroups (128 keys) in the warp-specialised kernel that adds dQ: 64 query rows per item at
# D = 128 (dQ's columns split between the warpgroups), 128 at D = 64 (its rows split)
SM90_BWD_TILE = dict(kv_block_m=64, kv_warps=4, kv_split=0, kv_minb=1, q_block_m=64, q_block_n=64,
                     q_warps=4, q_minb=1)
SM90_BWD_TILE_D64 = {**SM90_BWD_TILE, "kv_minb": 3, "q_minb": 3}
SM90_BWD_TILE_DQ = {**SM90_BWD_TILE, "kv_warps": 8}
SM90_BWD_TILE_DQ_D64 = {**SM90_BWD_TILE_DQ, "kv_block_m": 128}


def bwd_sm90_tile(D, mode):
    """The tile of attn_bwd_sm90.cu for head dim D and dq mode. ATTNEXT_TILE_BWD_SM90="KV,Q[,KV_MINB,
    Q_MINB]" (warps of the recomputing dK/dV and the dQ kernels, CTAs per SM their registers
    allow) is the kernel lab's override; the kernel that adds dQ always has two consumer
    warpgroups."""
    if mode != "recompute":
        tile = SM90_BWD_TILE_DQ_D64 if D == 64 else SM90_BWD_TILE_DQ
    else:
        tile = SM90_BWD_TILE_D64 if D == 64 else SM90_BWD_TILE
    env = os.environ.get("ATTNEXT_TILE_BWD_SM90")
    if env and mode == "recompute":
        kv, q, kv_minb, q_minb = ([int(x) for x in env.split(",")] + [1, 1])[:4]
        tile = {**tile, "kv_warps": kv, "q_warps": q, "q_block_m": 16 * q, "kv_minb": kv_minb,
                "q_minb": q_minb}
    return tile


def bwd_sm90_kv_kernel(mode, tile):
    """attn_bwd_sm90.cu's dK/dV kernel for a dq mode and its warps: the warp-specialised one (a
    producer warpgroup beside the tile's) when it adds dQ."""
    if mode == "recompute":
        return "attn_bwd_dkdv_sm90", tile["kv_warps"]
    return "attn_bwd_dkdv_ws_sm90", tile["kv_warps"] + 4


def bwd_sm90_smem_bytes(D, Dv, tile, slots=0):
    """Dynamic shared memory of attn_bwd_sm90.cu's kernels (SW128 tiles, 1024-aligned: 1024 bytes
    of slack to round the base up with, except in the warp-specialised kernel, whose D = 64 tile
    fills the 227 KB exactly and takes the declared alignment as given); slots: the dQ kernel's
    tile sums (tile_sums)."""
    bn, bm = 16 * tile["kv_warps"], tile["kv_block_m"]
    qm, qn = tile["q_block_m"], tile["q_block_n"]
    kv_tiles = 2 * (bn * D + bn * Dv + 2 * bm * D + 2 * bm * Dv)
    return {
        # + lse and delta (2 stages each)
        "attn_bwd_dkdv_sm90": kv_tiles + 1024 + 4 * 4 * bm,
        # + dS^T (2 stages, bf16), dQ (2 stages, float32), lse and delta, 9 mbarriers
        "attn_bwd_dkdv_ws_sm90": kv_tiles + 2 * 2 * bn * bm + 2 * 4 * bm * D + 4 * 4 * bm + 72,
        "attn_bwd_dq_sm90": 2 * (qm * D + qm * Dv + 2 * qn * D + 2 * qn * Dv) + 1024 + slots * codegen.TILE_SLOT_BYTES,
    }


def bwd_defines(*, dtype, D, Dv, vec, softcap, bias_dtype, alibi_dtype, mask, tile, dq="recompute",
                mods=None):
    """The #defines of one backward variant (kernels/attn_bwd.cu: every backward kernel of it;
    attn_bwd_sm90.cu the same); dq: bwd_dq_mode's answer ("recompute" whenever the mods have
    array gradients: the dQ kernels' ds_tile scatters them, MOD_TILE_SLOTS: through shared
    memory where it has tile terms); mods: as for fwd_defines."""
    d = {
        "ELEM_BF16": int(dtype == "bfloat16"), "HEAD_DIM": D, "HEAD_DIM_V": Dv, "VEC_LOAD": int(vec),
        "HAS_SOFTCAP": int(softcap), "HAS_BIAS": int(bias_dtype is not None),
        "BIAS_DT": DTYPE_CODES[bias_dtype or "float32"], "HAS_ALIBI": int(alibi_dtype is not None),
        "ALIBI_DT": DTYPE_CODES[alibi_dtype or "float32"], "HAS_MASK": int(mask),
    }
    d.update(KV_BLOCK_M=tile["kv_block_m"], KV_WARPS=tile["kv_warps"], KV_SPLIT=tile["kv_split"],
             KV_MINB=tile["kv_minb"], DQ_ATOMIC=int(dq != "recompute"), DQ_ORDERED=int(dq == "ordered"),
             DQ_TILE_M=bwd_sm90_tile(D, dq)["kv_block_m"] if dq == "ordered" else 0,
             Q_BLOCK_M=tile["q_block_m"],
             Q_BLOCK_N=tile["q_block_n"], Q_WARPS=tile["q_warps"], Q_MINB=tile["q_minb"])
    slots, admit, always = tile_sums(mods, tile["q_block_m"], tile["q_block_n"])
    if slots:
        d.update(MOD_TILE_SLOTS=slots, MOD_TILE_ADMIT=admit, MOD_TILE_ALWAYS=int(always))
    return mod_defines(d, mods)


def bwd_variants():
    """The backward variants warmup compiles: those of the forward's list (the backward has no
    pack-GQA or split-KV variants), plus the lab's atomic dq path of the common head dims."""
    out = []
    for _, fd in fwd_variants():
        dtype = "bfloat16" if fd["ELEM_BF16"] else "float16"
        D, Dv = fd["HEAD_DIM"], fd["HEAD_DIM_V"]
        names = {v: k for k, v in DTYPE_CODES.items()}
        features = dict(dtype=dtype, D=D, Dv=Dv, vec=bool(fd["VEC_LOAD"]), softcap=bool(fd["HAS_SOFTCAP"]),
                        bias_dtype=names[fd["BIAS_DT"]] if fd["HAS_BIAS"] else None,
                        alibi_dtype=names[fd["ALIBI_DT"]] if fd["HAS_ALIBI"] else None,
                        mask=bool(fd["HAS_MASK"]), tile=bwd_tile_config(D, Dv))
        out.append(bwd_defines(**features))
        if not (fd["HAS_SOFTCAP"] or fd["HAS_BIAS"] or fd["HAS_MASK"]) and (D, Dv) in ((64, 64), (128, 128)):
            out.append(bwd_defines(**features, dq="atomic"))
    unique = {tuple(sorted(d.items())): d for d in out}
    return [("attn_bwd", d) for d in unique.values()]


def sm90_fwd_variants():
    """attn_fwd_sm90's variants (sm_90a only): both dtypes, the head dims it takes, and each
    feature on its own at D = 128."""
    out = []
    for dtype in ("bfloat16", "float16"):
        for D, Dv in ((64, 64), (128, 128), (128, 64), (64, 128)):
            base = dict(dtype=dtype, D=D, Dv=Dv, vec=True, softcap=False, bias_dtype=None,
                        alibi_dtype=None, mask=False, tile=SM90_TILE_LONG)
            out.append(base)
            out.append({**base, "tile": SM90_TILE_SHORT})
            if (D, Dv) == (128, 128):
                out.append({**base, "softcap": True})
                out.append({**base, "bias_dtype": dtype})
                out.append({**base, "bias_dtype": "float32", "mask": True, "alibi_dtype": "float32"})
    return [("attn_fwd_sm90", fwd_defines(**v)) for v in out]


def sm90_bwd_variants():
    """attn_bwd_sm90's variants (sm_90a only): those of sm90_fwd_variants' features, each in the
    dq modes a deterministic and a non-deterministic call choose, and attn_bwd.cu's (its row
    kernels) in the ordered mode, which only Hopper takes."""
    out = []
    names = {v: k for k, v in DTYPE_CODES.items()}
    for _, fd in sm90_fwd_variants():
        if (fd["BLOCK_M"], fd["BLOCK_N"]) != SM90_TILE_LONG[:2]:
            continue
        D = fd["HEAD_DIM"]
        features = dict(
            dtype="bfloat16" if fd["ELEM_BF16"] else "float16", D=D, Dv=fd["HEAD_DIM_V"], vec=True,
            softcap=bool(fd["HAS_SOFTCAP"]), bias_dtype=names[fd["BIAS_DT"]] if fd["HAS_BIAS"] else None,
            alibi_dtype=names[fd["ALIBI_DT"]] if fd["HAS_ALIBI"] else None, mask=bool(fd["HAS_MASK"]))
        for deterministic in (True, False):
            mode = bwd_dq_mode(True, D, deterministic, fd["HEAD_DIM_V"])
            out.append(("attn_bwd_sm90", bwd_defines(**features, tile=bwd_sm90_tile(D, mode), dq=mode)))
            if mode == "ordered":         # attn_bwd.cu's row kernels (delta, dq_convert) of that mode
                out.append(("attn_bwd", bwd_defines(**features, tile=bwd_tile_config(D, fd["HEAD_DIM_V"]), dq=mode)))
    unique = {(k, tuple(sorted(d.items()))): (k, d) for k, d in out}
    return list(unique.values())


def variants(arch=None):
    """Every (kernel, defines) warmup compiles for arch (None: those of every architecture)."""
    hopper = sm90_fwd_variants() + sm90_bwd_variants() if arch in (None, "sm_90a") else []
    return fwd_variants() + bwd_variants() + hopper


def mod_sample():
    """The generated code of a representative score_mod and mask_mod (softcap, a relative
    position table with a gradient, a scalar array, int rules; a document mask from an int
    array and a bool table) that warmup --check compiles into every kernel, as a call with
    64 rows and columns reads it (codegen.Facts): the lookups read directly, the document ids
    as int32, but the bool table's lookup checked."""
    from ..mods import bounds, codegen, trace
    table = np.zeros((4, 129), np.float32)
    w = np.zeros((), np.float32)
    doc = np.zeros(64, np.int64)
    allowed = np.ones((64, 64), bool)

    def score_mod(score, b, h, q_idx, kv_idx):
        s = 30.0 * np.tanh(score / 30.0) + table[h, q_idx - kv_idx + 64] * w
        return np.where((q_idx - kv_idx) % 4 == 0, s, np.maximum(s, -1.0) - (kv_idx // 3) * 0.01)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & allowed[q_idx, kv_idx] | (kv_idx == 0)

    ts, tm = trace.trace_score_mod(score_mod), trace.trace_mask_mod(mask_mod)
    ext = bounds.Extents(1, 4, 64, 64)
    mask_modes = tuple(bounds.CHECKED if n.args[0].args[0] == "allowed" else m
                       for n, m in zip(bounds.loads(tm), bounds.lookup_modes(tm, ext)))
    narrow = tuple(name == "doc" for _, name, _ in codegen.generate(ts, tm).arrays)
    return codegen.generate(ts, tm, codegen.Facts(bounds.lookup_modes(ts, ext), mask_modes, narrow))


def mod_variants(arch=None):
    """(kernel, defines, generated source) of the score_mod / mask_mod variants warmup --check
    compiles: mod_sample with every built-in option in the forward and backward kernels (both
    kernel families on sm_90a), and the forward with element loads at an odd head dim. A few:
    each takes NVRTC 3-10 s (whole files; a call compiles only its entry points: module_of)."""
    gen = mod_sample()
    every = dict(dtype="bfloat16", D=128, Dv=128, vec=True, softcap=True, bias_dtype="float32",
                 mask=True, alibi_dtype="float32")
    odd = dict(every, D=59, Dv=59, vec=False, softcap=False, bias_dtype=None, mask=False,
               alibi_dtype=None)
    out = [("attn_fwd", fwd_defines(**every, tile=tile_config(128, 128), mods=gen)),
           ("attn_bwd", bwd_defines(**every, tile=bwd_tile_config(128, 128), mods=gen)),
           ("attn_fwd", fwd_defines(**odd, tile=tile_config(59, 59), mods=gen)),
           ("attn_block_mask", block_mask_defines(gen))]
    if arch in (None, "sm_90a"):
        out += [("attn_fwd_sm90", fwd_defines(**every, tile=SM90_TILE_MODS, mods=gen)),
                ("attn_bwd_sm90", bwd_defines(**every, tile=bwd_sm90_tile(128, "recompute"), mods=gen))]
    return [(k, d, gen.source) for k, d in out]


def dtype_name(dt):
    dt = np.dtype(dt)
    return "bfloat16" if dt.name == "bfloat16" else dt.name
