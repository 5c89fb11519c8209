"""The compiled-kernel cache: NVRTC cubins in a bounded LRU in memory and in files on disk.

    cache = CubinCache(attnext._C.nvrtc_compile)
    cubin = cache.get(source, "attn_fwd.cu", options, headers, arch="sm_80", nvrtc_version=(12, 4))

A kernel is looked up by a key, the sha256 of everything that decides the cubin: the generated
source, its file name, the NVRTC options in order, the headers (name, text) in order, the
architecture, the NVRTC version and attnext's version. The lookup goes memory, then disk, then
NVRTC; a compile failure (attnext.CompileError) propagates and is never cached.

Disk. `ATTNEXT_CACHE_DIR` names the directory; unset, it is `$XDG_CACHE_HOME/attnext`, else
`~/.cache/attnext`. Set to "", "0" or "off" (any case), it turns the disk cache off (memory only).
Each entry is one file `v<FORMAT_VERSION>/<hex key>.cubin`:

    magic (8 bytes) | format version (u32) | key (32 bytes) | payload length (u64) |
    sha256 of the payload (32 bytes) | payload (the cubin)

all integers big-endian. A file that does not match in every field (truncated, foreign, another
key's, a flipped byte, unreadable) is a miss: the kernel is compiled again and the file rewritten.
Files are written to a temporary file in the same folder, fsynced and renamed over the entry
(os.replace), so a reader, in this process or another, sees a whole old entry or a whole new one,
never a partial one. Writing is an optimisation: an OSError (read-only folder, full disk) is
logged once as a WARNING per cache and the compiled kernel is returned all the same. The folder is
kept under `disk_max_bytes`: after a write that takes it over, the least recently used entries
(by mtime, which a disk hit refreshes) are removed, as are temporary files a killed process left.

Trust. A cubin read from disk runs with the process's access to its GPU memory, so the disk cache
trusts only what the user owns: a cache folder (the root or its v<FORMAT_VERSION> folder) owned by
another user or writable by group or others (a shared /tmp folder, a umask of 002) is neither read
nor written, the cache keeping to memory; an entry owned by another user or writable by group or
others is not loaded (compiled again and replaced by a file of the user's). Either logs one WARNING
per process, which says what to change (`chmod 700`). The folders attnext makes are made 0700.

Logging on the "attnext" logger: one INFO line for a compile slower than SLOW_COMPILE_SECONDS;
DEBUG lines for rejected disk entries and the NVRTC log. `ATTNEXT_DEBUG=1` (looked up at each compile)
prints the source and the options to stderr before compiling.
"""
import hashlib
import logging
import os
import struct
import sys
import tempfile
import threading
import time

from .. import _env
from ..lru import LRU

log = logging.getLogger("attnext")

SLOW_COMPILE_SECONDS = 1.0          # a compile slower than this logs one INFO line
DEFAULT_CAPACITY = 128              # cubins kept in memory
KEY_MEMO = 256                      # CubinCache.key's remembered inputs
DISK_MAX_BYTES = 1 << 30            # the disk cache is pruned back under this
STALE_TEMP_SECONDS = 3600.0         # a temporary file this old belongs to a dead writer

FORMAT_VERSION = 1
MAGIC = b"ATNXCUBN"
_HEADER = struct.Struct(">8sI32sQ32s")    # magic, format version, key, payload length, digest
_KEY_DOMAIN = b"attnext-cubin-key-v1"
_ENTRY_SUFFIX = ".cubin"
_TEMP_PREFIX, _TEMP_SUFFIX = ".tmp-", ".part"
_DISABLED = ("", "0", "off")


def default_cache_dir():
    """The disk cache's root folder from the environment, or None where it is turned off.

    ATTNEXT_CACHE_DIR wins when set ("", "0" or "off" turn the disk cache off); else
    $XDG_CACHE_HOME/attnext when XDG_CACHE_HOME is an absolute path; else ~/.cache/attnext.
    """
    env = _env.get("ATTNEXT_CACHE_DIR")
    if env is not None:
        if env.strip().lower() in _DISABLED:
            return None
        return os.path.abspath(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attnext")


FOLDER_MODE = 0o700                 # the folders attnext makes
_SHARED_BITS = 0o022                # group or others may write
_warned_untrusted = False           # one WARNING per process for what the disk cache refuses
_warn_lock = threading.Lock()


def untrusted(st, what):
    """Why a file or folder with this os.stat result is not to be trusted (another user's, or
    writable by group or others), or None."""
    if not hasattr(os, "getuid"):
        return None
    if st.st_uid != os.getuid():
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    shared = st.st_mode & _SHARED_BITS
    if shared:
        who = "group and others" if shared == _SHARED_BITS else "group" if shared & 0o020 else "others"
        return f"{what} is writable by {who} (mode {st.st_mode & 0o777:o})"
    return None


def untrusted_folder(folder):
    """Why `folder` (when it exists) is not to be trusted, or None: one that does not exist yet
    is made FOLDER_MODE when written."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return untrusted(st, f"the folder {folder}")


def warn_untrusted(why):
    """Logs why the disk cache refused something: a WARNING the first time in this process, DEBUG
    after."""
    global _warned_untrusted
    with _warn_lock:
        first, _warned_untrusted = not _warned_untrusted, True
    if first:
        log.warning("attnext: the kernel cache does not read what it cannot trust: %s; kernels are "
                    "compiled again (chmod 700 the folder, or set ATTNEXT_CACHE_DIR to a folder of "
                    "your own)", why)
    else:
        log.debug("attnext cache: not trusted: %s", why)


def read_trusted(path):
    """The bytes of the file at path, or None: absent, unreadable (logged at DEBUG), or in a
    folder or a file that untrusted() refuses (warn_untrusted)."""
    why = untrusted_folder(os.path.dirname(path))
    if why:
        warn_untrusted(why)
        return None
    try:
        with open(path, "rb") as f:
            why = untrusted(os.fstat(f.fileno()), f"the file {path}")
            data = None if why else f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.debug("attnext cache: cannot read %s (%s); recompiling", path, e)
        return None
    if why:
        warn_untrusted(why)
    return data


def make_folders(folder):
    """folder and the folders above it that are missing; those attnext makes, FOLDER_MODE (the
    mode applies to the last one alone in os.makedirs, so each is made in turn)."""
    parent = os.path.dirname(folder)
    if parent != folder and not os.path.isdir(parent):
        make_folders(parent)
    try:
        os.mkdir(folder, FOLDER_MODE)
    except FileExistsError:
        if not os.path.isdir(folder):
            raise


def write_file_atomically(path, data):
    """data into the file at path (its folder made, FOLDER_MODE): a temporary file beside it
    (mode 0600), fsync'ed, then renamed over it, so a reader sees the whole old file or the whole
    new one. OSError on failure, the temporary file removed."""
    folder = os.path.dirname(path)
    make_folders(folder)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def write_small_file(path, data):
    """write_file_atomically, an OSError logged at DEBUG and dropped (a record worth keeping,
    not worth failing a call for); nothing written in a folder untrusted_folder() refuses."""
    if untrusted_folder(os.path.dirname(path)):
        return
    try:
        write_file_atomically(path, data)
    except OSError as e:
        log.debug("attnext cache: cannot write %s (%s)", path, e)


def _field(data):
    """One length-prefixed field: no two different sequences of fields encode alike."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    elif not isinstance(data, (bytes, bytearray)):
        data = repr(data).encode("utf-8") if isinstance(data, tuple) else str(data).encode("utf-8")
    return struct.pack(">Q", len(data)) + bytes(data)


def _count(n):
    return struct.pack(">Q", n)


def cache_key(source, filename, options, headers, arch, nvrtc_version, version):
    """The hex sha256 naming a kernel: source, file name, options (in order), headers ((name,
    text) pairs, in order), architecture, NVRTC version and attnext version.

    Every field is length-prefixed and each list count-prefixed, so no two different inputs
    encode to the same bytes. arch and nvrtc_version may be str, int or a tuple of ints
    ("sm_80", 80, (12, 4)); each is encoded by its text.
    """
    options = list(options)
    headers = list(headers)
    h = hashlib.sha256(_KEY_DOMAIN)
    h.update(_field(source))
    h.update(_field(filename))
    h.update(_count(len(options)))
    for opt in options:
        h.update(_field(opt))
    h.update(_count(len(headers)))
    for name, text in headers:
        h.update(_field(name))
        h.update(_field(text))
    h.update(_field(arch))
    h.update(_field(nvrtc_version))
    h.update(_field(version))
    return h.hexdigest()


def encode_entry(key, payload):
    """A disk entry's bytes: the header, then the payload. key is the hex key."""
    payload = bytes(payload)
    return _HEADER.pack(MAGIC, FORMAT_VERSION, bytes.fromhex(key), len(payload),
                        hashlib.sha256(payload).digest()) + payload


def decode_entry(key, data):
    """The payload of a disk entry's bytes, checked against `key`; raises ValueError saying why
    the entry is rejected."""
    if len(data) < _HEADER.size:
        raise ValueError(f"truncated header ({len(data)} bytes)")
    magic, fmt, raw_key, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("wrong magic")
    if fmt != FORMAT_VERSION:
        raise ValueError(f"format version {fmt}, expected {FORMAT_VERSION}")
    if raw_key != bytes.fromhex(key):
        raise ValueError(f"holds key {raw_key.hex()[:12]}")
    payload = data[_HEADER.size:]
    if len(payload) != length:
        raise ValueError(f"payload of {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("payload digest mismatch")
    return bytes(payload)


def _debug_enabled():
    return (_env.get("ATTNEXT_DEBUG") or "").strip().lower() not in _DISABLED



class CubinCache:
    """Compiled kernels by key: a bounded LRU in memory, one file per kernel on disk, NVRTC last.

    compile_fn(source, filename, options, headers) -> (cubin, log) is attnext._C.nvrtc_compile
    (or a fake in tests); it raises attnext.CompileError on failure, which propagates.
    cache_dir=None reads the environment at construction (default_cache_dir()); cache_dir=False
    turns the disk cache off; a path uses that folder. version defaults to attnext.__version__.

    Thread-safe. Concurrent get()s of one key compile it once: the later callers wait for the
    first and take its result from memory. get()s of different keys compile in parallel.
    """

    def __init__(self, compile_fn, capacity=DEFAULT_CAPACITY, cache_dir=None, *,
                 version=None, disk_max_bytes=DISK_MAX_BYTES):
        self._compile_fn = compile_fn
        self._memory = LRU(capacity)
        if cache_dir is None:
            cache_dir = default_cache_dir()
        elif cache_dir is False:
            cache_dir = None
        else:
            cache_dir = os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))
        self.cache_dir = cache_dir
        self._entry_dir = (None if cache_dir is None
                           else os.path.join(cache_dir, f"v{FORMAT_VERSION}"))
        if version is None:
            from .._version import __version__ as version
        self.version = str(version)
        self.disk_max_bytes = int(disk_max_bytes)
        self._lock = threading.Lock()       # the counters and the per-key locks
        self._key_locks = {}                # key -> [lock, number of callers holding or waiting]
        self._warned_write = False
        self._keys = LRU(KEY_MEMO)          # key()'s inputs -> key
        self._stats = dict(memory_hits=0, disk_hits=0, misses=0, compiles=0,
                           compile_seconds=0.0, disk_write_errors=0)

    # --- public ---

    def key(self, source, filename, options, headers, arch, nvrtc_version):
        """The hex key get() uses for these inputs (also the key for a per-device module LRU);
        remembered for the last KEY_MEMO inputs (a first call asks for each module's key twice:
        module_for's has() and cubin()'s get(); the texts are the same str objects, whose hashes
        Python keeps)."""
        try:
            args = (source, filename, tuple(options), tuple(tuple(h) for h in headers), arch, nvrtc_version)
            key = self._keys.get(args)
        except TypeError:                   # an unhashable input (a bytearray text): no memo
            return cache_key(source, filename, options, headers, arch, nvrtc_version, self.version)
        if key is None:
            key = cache_key(source, filename, options, headers, arch, nvrtc_version, self.version)
            self._keys.put(args, key)
        return key

    def get(self, source, filename, options, headers, arch, nvrtc_version):
        """The cubin for these inputs, from memory, from disk or freshly compiled."""
        options, headers = list(options), [tuple(h) for h in headers]
        key = self.key(source, filename, options, headers, arch, nvrtc_version)
        cubin = self._memory.get(key)
        if cubin is not None:
            self._count("memory_hits")
            return cubin
        with self._key_lock(key):
            cubin = self._memory.get(key)       # another thread may have filled it meanwhile
            if cubin is not None:
                self._count("memory_hits")
                return cubin
            cubin = self._read(key)
            if cubin is not None:
                self._count("disk_hits")
            else:
                self._count("misses")
                cubin = self._compile(key, source, filename, options, headers)
                self._write(key, cubin)
            self._memory.put(key, cubin)
            return cubin

    def has(self, source, filename, options, headers, arch, nvrtc_version):
        """Whether get() of these inputs would need no compile: in memory, or a file on disk
        (not read: a corrupt one is still recompiled by get())."""
        key = self.key(source, filename, options, [tuple(h) for h in headers], arch, nvrtc_version)
        if key in self._memory:
            return True
        path = self.entry_path(key)
        return path is not None and self._disk_trusted() and os.path.isfile(path)

    def info(self):
        """Counters and settings: memory_hits, disk_hits, misses (lookups that went to the
        compiler), compiles (successful compiles), compile_seconds (their total time: each
        compile's own, summed; compiles in parallel threads add up beyond the time waited),
        disk_write_errors, entries (in memory), capacity, cache_dir (None when off)."""
        with self._lock:
            out = dict(self._stats)
        out.update(entries=len(self._memory), capacity=self._memory.capacity,
                   cache_dir=self.cache_dir)
        return out

    def clear_memory(self):
        """Forgets the in-memory entries (the disk stays); counters are kept."""
        self._memory.clear()

    def entry_path(self, key):
        """The file that holds `key` on disk, or None when the disk cache is off."""
        if self._entry_dir is None:
            return None
        return os.path.join(self._entry_dir, key + _ENTRY_SUFFIX)

    def __repr__(self):
        i = self.info()
        return (f"CubinCache({i['entries']}/{i['capacity']} in memory, disk {i['cache_dir']!r}, "
                f"{i['compiles']} compiles)")

    # --- inside ---

    def _count(self, name, amount=1):
        with self._lock:
            self._stats[name] += amount

    class _KeyLock:
        """Holds the per-key lock; drops the lock's record once no caller needs it."""

        def __init__(self, cache, key):
            self.cache, self.key = cache, key

        def __enter__(self):
            c = self.cache
            with c._lock:
                rec = c._key_locks.get(self.key)
                if rec is None:
                    rec = c._key_locks[self.key] = [threading.Lock(), 0]
                rec[1] += 1
            self.rec = rec
            rec[0].acquire()

        def __exit__(self, *exc):
            c = self.cache
            self.rec[0].release()
            with c._lock:
                self.rec[1] -= 1
                if self.rec[1] == 0:
                    del c._key_locks[self.key]

    def _key_lock(self, key):
        return CubinCache._KeyLock(self, key)

    def after_fork(self):
        """In a forked child: the locks anew (a thread of the parent's, gone in the child, may
        have held one at the fork)."""
        self._lock = threading.Lock()
        self._key_locks = {}

    def _compile(self, key, source, filename, options, headers):
        if _debug_enabled():
            sys.stderr.write(f"attnext: compiling {filename} (key {key[:12]})\n"
                             f"attnext: options: {' '.join(options)}\n"
                             f"attnext: headers: {', '.join(n for n, _ in headers) or '-'}\n"
                             f"{source}\n")
            sys.stderr.flush()
        start = time.perf_counter()
        cubin, compile_log = self._compile_fn(source, filename, options, headers)
        seconds = time.perf_counter() - start
        cubin = bytes(cubin)
        with self._lock:
            self._stats["compiles"] += 1
            self._stats["compile_seconds"] += seconds
        if compile_log:
            log.debug("NVRTC log for %s (key %s):\n%s", filename, key[:12], compile_log)
            if _debug_enabled():
                sys.stderr.write(f"attnext: NVRTC log:\n{compile_log}\n")
        if seconds > SLOW_COMPILE_SECONDS:
            log.info("attnext: compiled %s in %.2f s (key %s)", filename, seconds, key[:12])
        return cubin

    def _disk_trusted(self):
        """Whether the cache's folders may be used: each one that exists is the user's and no one
        else may write it (else warn_untrusted, and the cache keeps to memory)."""
        why = untrusted_folder(self.cache_dir) or untrusted_folder(self._entry_dir)
        if why:
            warn_untrusted(why)
        return why is None

    def _read(self, key):
        """The cubin stored for `key`, or None (absent, or rejected: logged at DEBUG; not
        trusted: warn_untrusted)."""
        path = self.entry_path(key)
        if path is None or not self._disk_trusted():
            return None
        data = read_trusted(path)
        if data is None:
            return None
        try:
            cubin = decode_entry(key, data)
        except ValueError as e:
            log.debug("attnext cache: rejected %s (%s); recompiling", path, e)
            return None
        try:
            os.utime(path)      # a hit makes the entry the most recently used for pruning
        except OSError:
            pass
        return cubin

    def _write(self, key, cubin):
        """Stores `cubin` atomically (temporary file, fsync, rename); an OSError is logged, the
        temporary file removed, and nothing raised."""
        path = self.entry_path(key)
        if path is None or not self._disk_trusted():
            return
        try:
            write_file_atomically(path, encode_entry(key, cubin))
        except OSError as e:
            self._count("disk_write_errors")
            with self._lock:
                first, self._warned_write = not self._warned_write, True
            if first:
                log.warning("attnext: cannot write the kernel cache in %s (%s); kernels are "
                            "compiled again in each process", self._entry_dir, e)
            else:
                log.debug("attnext cache: cannot write %s (%s)", path, e)
            return
        self._prune(keep=path)

    def _prune(self, keep):
        """Removes the least recently used entries (never `keep`, the one just written) while
        the folder holds over disk_max_bytes, and temporary files older than
        STALE_TEMP_SECONDS. Races with other processes only cost a later miss."""
        entries, total, now = [], 0, time.time()
        try:
            with os.scandir(self._entry_dir) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if e.name.startswith(_TEMP_PREFIX) and e.name.endswith(_TEMP_SUFFIX):
                        if now - st.st_mtime > STALE_TEMP_SECONDS:
                            _remove(e.path)
                    elif e.name.endswith(_ENTRY_SUFFIX) and e.is_file(follow_symlinks=False):
                        entries.append((st.st_mtime, st.st_size, e.path))
                        total += st.st_size
        except OSError:
            return
        if total <= self.disk_max_bytes:
            return
        entries.sort()
        for _, size, path in entries:
            if total <= self.disk_max_bytes:
                break
            if path != keep and _remove(path):
                total -= size
                log.debug("attnext cache: pruned %s", path)


def _remove(path):
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
