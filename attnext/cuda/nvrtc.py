"""NVRTC and the kernels' sources: finding and loading NVRTC, compiling, and loaded functions.

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

from .. import _C, _env
from ..lru import LRU
from . import process
from .cache import CubinCache, default_cache_dir, read_trusted, write_small_file
from .select import MOD_FREE_ENTRIES, entry_defines, plain_defines

# The kernel sources and the csrc headers they include are package data (attnext/_kernels and
# attnext/_csrc: links to the repository's kernels/ and csrc/ in a checkout, copies in a wheel),
# found through the package, never through the repository. ATTNEXT_KERNEL_DIR runs another copy
# of kernels/ (the kernel lab: an old version beside the new).
PACKAGE_DIR = Path(__file__).resolve().parent.parent
KERNEL_DIR = Path(_env.get("ATTNEXT_KERNEL_DIR") or PACKAGE_DIR / "_kernels")
CSRC_DIR = PACKAGE_DIR / "_csrc"
CSRC_HEADERS = ("attn_params.h", "seqlen.h", "block.h", "mod_ints.h")   # what kernels/ includes
HEADER_FILES = (CSRC_DIR / "attn_params.h", CSRC_DIR / "seqlen.h", CSRC_DIR / "block.h",
                KERNEL_DIR / "attn_common.cuh", KERNEL_DIR / "attn_fwd_tile.cuh",
                KERNEL_DIR / "attn_bwd_tile.cuh", KERNEL_DIR / "wgmma.cuh", KERNEL_DIR / "sm90_pipe.cuh")
MODS_HEADER = KERNEL_DIR / "attn_mods.cuh"
MOD_INTS_HEADER = CSRC_DIR / "mod_ints.h"        # attn_mods.cuh's, shared with interp.c


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


_driver = None          # the driver's CUDA version (major, minor), () without one: driver_version()


def driver_version():
    """The newest CUDA the driver supports, (major, minor), or () where no driver loads (a
    machine without a GPU compiles all the same: warmup --check)."""
    global _driver
    if _driver is None:
        try:
            _driver = tuple(_C.cuda_driver_version())
        except (RuntimeError, AttributeError):
            _driver = ()
    return _driver


def nvrtc_candidates():
    """Where NVRTC is looked for, in order: ATTNEXT_NVRTC, the nvidia-cuda-nvrtc wheels' lib
    folders (cu13's nvidia/cu13/lib, cu12's nvidia/cuda_nvrtc/lib), $CUDA_HOME/lib64,
    /usr/local/cuda/lib64, then the plain sonames. Under a CUDA 12 driver, the CUDA 12 wheel's
    folder and soname come before CUDA 13's (its cubins would not load: driver_mismatch)."""
    wheel_dirs, sonames = ["cu13/lib", "cuda_nvrtc/lib", "cu12/lib"], ["libnvrtc.so.13", "libnvrtc.so.12"]
    if driver_version() and driver_version()[0] < 13:
        wheel_dirs, sonames = wheel_dirs[::-1], sonames[::-1]
    out = []
    if _env.get("ATTNEXT_NVRTC"):
        out.append(_env.get("ATTNEXT_NVRTC"))
    try:
        import nvidia
        for base in nvidia.__path__:
            for sub in wheel_dirs:
                d = os.path.join(base, sub)
                if os.path.isdir(d):
                    out.append(d)
    except ImportError:
        pass
    if os.environ.get("CUDA_HOME"):
        out.append(os.path.join(os.environ["CUDA_HOME"], "lib64"))
    return out + ["/usr/local/cuda/lib64", *sonames, "libnvrtc.so"]


def driver_mismatch(nvrtc_version, driver):
    """'' when the driver (major, minor) loads the cubins of this NVRTC (major, minor), else why
    not and what fixes it. A cubin loads under a driver of its CUDA major version or newer
    (minor versions are compatible within a major: CUDA's minor version compatibility)."""
    if not driver or nvrtc_version[0] <= driver[0]:
        return ""
    wheel = (f"nvidia-cuda-nvrtc-cu{driver[0]}" if driver[0] <= 12
             else f"'nvidia-cuda-nvrtc=={driver[0]}.*'")
    return (f"NVRTC {nvrtc_version[0]}.{nvrtc_version[1]} compiles cubins that this driver "
            f"(CUDA {driver[0]}.{driver[1]}) cannot load: `pip install {wheel}` brings an NVRTC "
            f"for CUDA {driver[0]} (attnext looks in both the CUDA 12 and 13 wheels' folders; "
            f"ATTNEXT_NVRTC names one), or update the NVIDIA driver")


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
    """The version the record holds for this fingerprint, if the library it names is unchanged
    (and the record is one the cache trusts: cache.read_trusted)."""
    path = _record_path()
    data = None if path is None else read_trusted(path)
    if data is None:
        return None
    try:
        rec = json.loads(data)
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
_ahead_pending = set()  # ... and their futures


def _cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _uncached(specs, arch):
    """{module key: (kernel, defines, generated)} of the modules of these entry points (prefetch's
    specs) whose cubins neither the memory nor the disk cache holds."""
    todo, version = {}, _version_text()
    for kernel, name, defines, generated in specs:
        k, d, g = module_for(kernel, name, defines, generated, arch)
        if not _cache().has(*compile_args(k, d, arch, g), arch, version):
            todo.setdefault((k, tuple(sorted(d.items())), g), (k, d, g))
    return todo


def cached(specs, arch):
    """Whether every entry point of these specs is compiled already (in memory or on disk)."""
    return not _uncached(specs, arch)


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
    env = (_env.get(COMPILE_AHEAD_KNOB) or "").strip().lower()
    if env in ("0", "off", "false", "no") or not specs:
        return []
    todo = _uncached(specs, arch)
    with _ahead_lock:
        if not todo or (env != "1" and _cpus() < len(todo) + busy + _ahead_running):
            return []
        if _ahead is None:
            _ahead = concurrent.futures.ThreadPoolExecutor(max(2, _cpus() - 1), "attnext-ahead")
        _ahead_running += len(todo)
        futures = [_ahead.submit(cubin, k, d, arch, g) for k, d, g in todo.values()]
        _ahead_pending.update(futures)
    for f in futures:
        f.add_done_callback(_ahead_done)
    return futures


def _ahead_done(future):
    global _ahead_running
    with _ahead_lock:
        _ahead_running -= 1
        _ahead_pending.discard(future)


def finish_ahead():
    """Waits for compile_ahead's compiles submitted so far (the bench, before it times: a plan
    that takes a faster kernel once its compile is done, backend's upgrade, then times that)."""
    with _ahead_lock:
        futures = list(_ahead_pending)
    concurrent.futures.wait(futures)


def _drop_queued():
    """At exit: compile_ahead's compiles not yet begun are cancelled, so exit waits only for those
    under way."""
    if _ahead is not None:
        _ahead.shutdown(wait=False, cancel_futures=True)


def _forget_ahead_after_fork():
    """In a forked child: no compile_ahead threads, and the compile locks anew (a background
    compile of the parent's may have held them at the fork)."""
    global _ahead, _ahead_lock, _ahead_running, _ahead_pending, _nvrtc_lock
    _ahead, _ahead_lock, _ahead_running, _nvrtc_lock = None, threading.Lock(), 0, threading.Lock()
    _ahead_pending = set()
    if _cubins is not None:
        _cubins.after_fork()


process.before_thread_join(_drop_queued)     # before the pool's own join
process.at_fork(after_in_child=_forget_ahead_after_fork)


def _load_module(mkey, kernel, defines, generated, device, arch):
    """The module of this cubin on device, loaded once (kept in _modules under mkey)."""
    with _functions_lock:
        module = _modules.get(mkey)
    if module is None:
        module = _C.module_load(cubin(kernel, defines, arch, generated), device)
        with _functions_lock:
            _modules.put(mkey, module)
    return module


_functions = LRU(64)       # (kernel, name, defines, device, arch, smem, generated, dependent) -> function
_modules = LRU(64)         # (kernel, defines, generated, device, arch) -> loaded module
_loaded = LRU(256)         # (kernel, name, defines, generated, device) -> True: loaded there
_functions_lock = threading.Lock()


def _function_key(kernel, name, defines, generated, device):
    return kernel, name, tuple(sorted(defines.items())), generated, device


# Entry points that begin with griddepcontrol.wait (attn_common.cuh's grid_dependency_wait), so
# that on Hopper they are launched as programmatic dependents of the kernel before them on the
# stream: their CTAs are scheduled while it finishes (the kernel before lets them: its
# allow_dependents) and wait there, not after its last CTA for a launch of their own.
# ATTNEXT_DEPENDENT_LAUNCH=0 launches them as ordinary kernels (the lab's comparison).
DEPENDENT_KERNELS = frozenset({"attn_fwd_combine"})


def _dependent(name, arch):
    return (name in DEPENDENT_KERNELS and int("".join(c for c in arch[3:] if c.isdigit()) or 0) >= 90
            and _env.get("ATTNEXT_DEPENDENT_LAUNCH") != "0")


def function(kernel, name, defines, device, arch, smem, generated=None):
    """The loaded function `name` of kernels/<kernel>.cu in this variant on `device` (a capsule),
    its dynamic shared memory limit raised to smem bytes; generated: as for cubin(). A module
    is loaded once per device for all the entry points it serves."""
    dependent = _dependent(name, arch)
    key = (kernel, name, tuple(sorted(defines.items())), device, arch, smem, generated, dependent)
    with _functions_lock:
        fn = _functions.get(key)
    if fn is None:
        k, d, g = module_for(kernel, name, defines, generated, arch)
        module = _load_module((k, tuple(sorted(d.items())), g, device, arch), k, d, g, device, arch)
        fn = _C.module_function(module, name, smem, dependent)
        with _functions_lock:
            _functions.put(key, fn)
            _loaded.put(_function_key(kernel, name, defines, generated, device), True)
    return fn
