"""The compiled-kernel cache (attnext.cuda.cache): keys, the memory LRU, the disk format and its
failure modes, logging, threads and processes. A fake compiler stands in for NVRTC; one test uses
the real one where attnext._C has it."""
import hashlib
import logging
import multiprocessing
import os
import threading
import time

import pytest

import attnext
from attnext.cuda import cache as kc, nvrtc
from attnext.lru import LRU

SOURCE = '__global__ void k(float *x) { x[threadIdx.x] = SCALE; }\n'
BASE = dict(source=SOURCE, filename="k.cu", options=["-DSCALE=2.0f", "-arch=sm_80"],
            headers=[("util.h", "#define ONE 1\n")], arch="sm_80", nvrtc_version=(12, 4))


def fake_cubin(source, filename, options, headers):
    """Deterministic bytes that depend on every compile input (as long as the source)."""
    h = hashlib.sha256(repr((source, filename, list(options), list(headers))).encode())
    return b"\x7fELF-fake-cubin" + h.digest() * 8 + source.encode()


class FakeCompiler:
    """Counts its calls; optionally sleeps or fails."""

    def __init__(self, delay=0.0, fail=False):
        self.calls = 0
        self.delay = delay
        self.fail = fail
        self._lock = threading.Lock()

    def __call__(self, source, filename, options, headers):
        with self._lock:
            self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            raise attnext.CompileError("error: expected a ';'", source=source, log="1 error")
        return fake_cubin(source, filename, options, headers), ""


def entry_files(cache):
    d = os.path.dirname(cache.entry_path("0" * 64))
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def assert_valid_entry(cache, key, expected):
    with open(cache.entry_path(key), "rb") as f:
        assert kc.decode_entry(key, f.read()) == expected


@pytest.fixture
def compiler():
    return FakeCompiler()


@pytest.fixture
def cache(tmp_path, compiler):
    return kc.CubinCache(compiler, cache_dir=tmp_path / "cache")


# --- keys and the memory LRU ---

def test_same_inputs_compile_once_then_memory_hits(cache, compiler):
    first = cache.get(**BASE)
    assert first == fake_cubin(BASE["source"], BASE["filename"], BASE["options"], BASE["headers"])
    for _ in range(5):
        assert cache.get(**BASE) == first
    assert compiler.calls == 1
    i = cache.info()
    assert (i["compiles"], i["misses"], i["memory_hits"], i["disk_hits"]) == (1, 1, 5, 0)
    assert i["entries"] == 1 and i["capacity"] == kc.DEFAULT_CAPACITY
    assert i["compile_seconds"] >= 0.0


@pytest.mark.parametrize("change", [
    dict(source=SOURCE + " "),
    dict(filename="k2.cu"),
    dict(options=["-DSCALE=3.0f", "-arch=sm_80"]),
    dict(options=["-arch=sm_80", "-DSCALE=2.0f"]),                  # order matters
    dict(options=["-DSCALE=2.0f", "-arch=sm_80", "-lineinfo"]),
    dict(headers=[("util.h", "#define ONE 2\n")]),
    dict(headers=[("util2.h", "#define ONE 1\n")]),
    dict(headers=[]),
    dict(arch="sm_90a"),
    dict(nvrtc_version=(12, 6)),
], ids=["source", "filename", "option", "option-order", "extra-option", "header-text",
        "header-name", "no-header", "arch", "nvrtc"])
def test_each_key_part_changes_the_key(cache, compiler, change):
    base_key = cache.key(**BASE)
    other = dict(BASE, **change)
    assert cache.key(**other) != base_key
    cache.get(**BASE)
    cache.get(**other)
    assert compiler.calls == 2


def test_attnext_version_is_part_of_the_key(tmp_path):
    a = kc.CubinCache(FakeCompiler(), cache_dir=tmp_path)
    b = kc.CubinCache(FakeCompiler(), cache_dir=tmp_path, version="999.0")
    assert a.version == attnext.__version__
    assert a.key(**BASE) != b.key(**BASE)


def test_key_fields_are_length_prefixed():
    def key(source, filename, options, headers=()):
        return kc.cache_key(source, filename, options, headers, "sm_80", "12.4", "0.1.0")
    # the same concatenated text, split differently between fields, never collides
    assert key("ab", "c", []) != key("a", "bc", [])
    assert key("a", "b", ["-Dx", "y"]) != key("a", "b", ["-Dxy"])
    assert key("a", "b", ["x"]) != key("a", "b", ["", "x"])
    assert key("a", "b", [], [("h", "xy")]) != key("a", "b", [], [("hx", "y")])
    assert key("a", "b", ["h", "t"]) != key("a", "b", [], [("h", "t")])
    assert key("a", "b", ["-DX"]) == key("a", "b", ("-DX",))


def test_lru_bound_evicts_the_oldest(tmp_path, compiler):
    cache = kc.CubinCache(compiler, capacity=3, cache_dir=False)
    keys = []
    for i in range(10):
        cache.get(**dict(BASE, source=f"{SOURCE}// {i}\n"))
        keys.append(cache.key(**dict(BASE, source=f"{SOURCE}// {i}\n")))
    assert cache.info()["entries"] == 3
    assert cache._memory.keys() == keys[-3:]
    cache.get(**dict(BASE, source=f"{SOURCE}// 9\n"))
    assert compiler.calls == 10                      # still in memory
    cache.get(**dict(BASE, source=f"{SOURCE}// 0\n"))
    assert compiler.calls == 11                      # evicted, no disk: compiled again


def test_lru_class():
    evicted = []
    lru = LRU(2, on_evict=lambda k, v: evicted.append((k, v)))
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1                         # "a" is now the most recent
    lru.put("c", 3)
    assert evicted == [("b", 2)]
    assert len(lru) == 2 and "a" in lru and "b" not in lru
    assert lru.get("b") is None and lru.get("b", 7) == 7
    assert lru.keys() == ["a", "c"]
    lru.clear()
    assert len(lru) == 0
    with pytest.raises(ValueError):
        LRU(0)


# --- the disk cache ---

def test_fresh_cache_on_the_same_dir_hits_the_disk(tmp_path, cache, compiler):
    cubin = cache.get(**BASE)
    key = cache.key(**BASE)
    assert entry_files(cache) == [key + ".cubin"]
    assert_valid_entry(cache, key, cubin)
    again = FakeCompiler()
    fresh = kc.CubinCache(again, cache_dir=tmp_path / "cache")
    assert fresh.get(**BASE) == cubin
    assert again.calls == 0
    i = fresh.info()
    assert (i["disk_hits"], i["compiles"], i["misses"]) == (1, 0, 0)
    assert fresh.get(**BASE) == cubin
    assert fresh.info()["memory_hits"] == 1


def test_clear_memory_falls_back_to_disk(cache, compiler):
    cache.get(**BASE)
    cache.clear_memory()
    assert cache.info()["entries"] == 0
    cache.get(**BASE)
    assert compiler.calls == 1 and cache.info()["disk_hits"] == 1


def _truncate(data):
    return data[:len(data) // 2]


def _short_header(data):
    return data[:10]


def _garbage(data):
    return os.urandom(len(data))


def _empty(data):
    return b""


def _flip_payload_byte(data):
    b = bytearray(data)
    b[-7] ^= 0x01
    return bytes(b)


def _wrong_magic(data):
    return b"XXXXXXXX" + data[8:]


def _wrong_version(data):
    return data[:8] + (kc.FORMAT_VERSION + 1).to_bytes(4, "big") + data[12:]


def _trailing(data):
    return data + b"\0"


@pytest.mark.parametrize("damage", [_truncate, _short_header, _garbage, _empty,
                                    _flip_payload_byte, _wrong_magic, _wrong_version, _trailing])
def test_damaged_entry_is_recompiled_and_rewritten(tmp_path, cache, compiler, damage, caplog):
    cubin = cache.get(**BASE)
    key = cache.key(**BASE)
    path = cache.entry_path(key)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    fresh = kc.CubinCache(compiler, cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.DEBUG, logger="attnext"):
        assert fresh.get(**BASE) == cubin
    assert compiler.calls == 2
    assert fresh.info()["disk_hits"] == 0
    assert any("rejected" in r.getMessage() for r in caplog.records)
    assert_valid_entry(fresh, key, cubin)
    assert entry_files(fresh) == [key + ".cubin"]


def test_entry_of_another_key_is_rejected(tmp_path, cache, compiler):
    a, b = BASE, dict(BASE, source=SOURCE + "// b\n")
    cubin_a = cache.get(**a)
    cubin_b = cache.get(**b)
    key_a, key_b = cache.key(**a), cache.key(**b)
    os.replace(cache.entry_path(key_a), cache.entry_path(key_b))   # b's file now holds a's entry
    fresh = kc.CubinCache(compiler, cache_dir=tmp_path / "cache")
    assert fresh.get(**b) == cubin_b
    assert compiler.calls == 3
    assert_valid_entry(fresh, key_b, cubin_b)
    assert cubin_a != cubin_b


def test_unreadable_entry_is_a_miss(tmp_path, cache, compiler, monkeypatch, caplog):
    cubin = cache.get(**BASE)
    path = cache.entry_path(cache.key(**BASE))

    def no_permission(file, *args, **kwargs):
        raise PermissionError(13, "Permission denied", file)

    fresh = kc.CubinCache(compiler, cache_dir=tmp_path / "cache")
    monkeypatch.setattr(kc, "open", no_permission, raising=False)
    with caplog.at_level(logging.DEBUG, logger="attnext"):
        assert fresh.get(**BASE) == cubin
    monkeypatch.delattr(kc, "open")
    assert compiler.calls == 2
    assert any("cannot read" in r.getMessage() for r in caplog.records)
    assert_valid_entry(fresh, cache.key(**BASE), cubin)
    assert os.path.isfile(path)


def test_entry_path_taken_by_a_directory(tmp_path, cache, compiler, caplog):
    key = cache.key(**BASE)
    os.makedirs(cache.entry_path(key))               # neither readable nor replaceable
    with caplog.at_level(logging.WARNING, logger="attnext"):
        cubin = cache.get(**BASE)
    assert cubin == fake_cubin(BASE["source"], BASE["filename"], BASE["options"], BASE["headers"])
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert entry_files(cache) == [key + ".cubin"]   # the directory, and no temporary file


def test_unwritable_dir_still_compiles(tmp_path, compiler, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    cache = kc.CubinCache(compiler, cache_dir=blocker / "cache")
    with caplog.at_level(logging.WARNING, logger="attnext"):
        first = cache.get(**BASE)
        cache.get(**dict(BASE, arch="sm_90a"))      # a second failure does not warn again
    assert first and compiler.calls == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot write" in warnings[0].getMessage()
    assert cache.info()["disk_write_errors"] == 2
    assert cache.get(**BASE) == first                # memory still works
    assert compiler.calls == 2


def test_failed_write_leaves_no_temp_file(tmp_path, cache, compiler, monkeypatch, caplog):
    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kc.os, "fsync", disk_full)
    with caplog.at_level(logging.WARNING, logger="attnext"):
        assert cache.get(**BASE)
    monkeypatch.undo()
    assert len(caplog.records) == 1 and "No space left" in caplog.records[0].getMessage()
    assert entry_files(cache) == []


def test_no_temp_files_after_writes(cache):
    for i in range(5):
        cache.get(**dict(BASE, source=f"{SOURCE}// {i}\n"))
    files = entry_files(cache)
    assert len(files) == 5 and all(f.endswith(".cubin") and not f.startswith(".") for f in files)


def test_disk_is_pruned_to_its_bound(tmp_path, compiler):
    first = dict(BASE, source=f"{SOURCE}// 0\n")
    size = len(kc.encode_entry("0" * 64, fake_cubin(first["source"], first["filename"],
                                                    first["options"], first["headers"])))
    cache = kc.CubinCache(compiler, cache_dir=tmp_path, disk_max_bytes=3 * size)
    stale = os.path.join(tmp_path, f"v{kc.FORMAT_VERSION}", ".tmp-dead.part")
    os.makedirs(os.path.dirname(stale))
    open(stale, "wb").close()
    old = time.time() - 2 * kc.STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    keys = []
    for i in range(6):
        inputs = dict(BASE, source=f"{SOURCE}// {i}\n")
        cache.get(**inputs)
        keys.append(cache.key(**inputs))
        path = cache.entry_path(keys[-1])
        os.utime(path, (old + i, old + 10 * i))     # distinct mtimes, in write order
    assert entry_files(cache) == sorted(k + ".cubin" for k in keys[-3:])


# --- trust: only what the user owns, and no one else may write ---

@pytest.fixture
def warned(monkeypatch):
    """The cache's once-per-process WARNING made due again for this test."""
    monkeypatch.setattr(kc, "_warned_untrusted", False)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_folders_attnext_makes_are_0700(tmp_path, compiler):
    cache = kc.CubinCache(compiler, cache_dir=tmp_path / "new" / "cache")
    cache.get(**BASE)
    for folder in (tmp_path / "new", tmp_path / "new" / "cache", tmp_path / "new" / "cache" / "v1"):
        assert os.stat(folder).st_mode & 0o777 == 0o700, folder
    assert os.stat(cache.entry_path(cache.key(**BASE))).st_mode & 0o777 == 0o600


def test_world_writable_folder_is_refused(tmp_path, cache, compiler, warned, caplog):
    cache.get(**BASE)                                # an entry a fresh cache would read
    os.chmod(tmp_path / "cache", 0o777)
    fresh = kc.CubinCache(compiler, cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="attnext"):
        assert not fresh.has(**BASE)
        fresh.get(**BASE)
        fresh.get(**dict(BASE, arch="sm_90a"))
        kc.CubinCache(compiler, cache_dir=tmp_path / "cache").get(**BASE)
    assert compiler.calls == 4 and fresh.info()["disk_hits"] == 0      # nothing read from it
    assert entry_files(fresh) == [cache.key(**BASE) + ".cubin"]         # nor written
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings                                 # once per process
    assert str(tmp_path / "cache") in warnings[0] and "writable by group and others" in warnings[0]
    assert "chmod 700" in warnings[0]


def test_group_writable_entry_folder_is_refused(tmp_path, cache, compiler, warned, caplog):
    cache.get(**BASE)
    os.chmod(tmp_path / "cache" / "v1", 0o770)
    fresh = kc.CubinCache(compiler, cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="attnext"):
        fresh.get(**BASE)
    assert compiler.calls == 2 and fresh.info()["disk_hits"] == 0
    assert len(_warnings(caplog)) == 1 and "writable by group" in _warnings(caplog)[0]


def test_group_writable_entry_is_not_loaded(tmp_path, cache, compiler, warned, caplog):
    cache.get(**BASE)
    path = cache.entry_path(cache.key(**BASE))
    os.chmod(path, 0o664)
    fresh = kc.CubinCache(compiler, cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="attnext"):
        assert fresh.get(**BASE) == cache.get(**BASE)
    assert compiler.calls == 2 and fresh.info()["disk_hits"] == 0
    assert len(_warnings(caplog)) == 1 and path in _warnings(caplog)[0]
    assert os.stat(path).st_mode & 0o777 == 0o600                       # replaced by one of the user's
    again = kc.CubinCache(compiler, cache_dir=tmp_path / "cache")
    again.get(**BASE)
    assert compiler.calls == 2 and again.info()["disk_hits"] == 1


def test_another_users_folder_is_refused(tmp_path, cache, compiler, warned, caplog, monkeypatch):
    cache.get(**BASE)
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    fresh = kc.CubinCache(compiler, cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="attnext"):
        fresh.get(**BASE)
    assert compiler.calls == 2 and fresh.info()["disk_hits"] == 0
    assert len(_warnings(caplog)) == 1 and f"owned by uid {uid}" in _warnings(caplog)[0]


def test_another_users_entry_is_not_loaded(tmp_path, cache, compiler, warned, caplog, monkeypatch):
    cache.get(**BASE)
    real_fstat = os.fstat

    def fstat(fd):          # the entry (the one file the cache opens) as another user's
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid + 1,
                               st.st_gid, st.st_size, int(st.st_atime), int(st.st_mtime), int(st.st_ctime)))

    monkeypatch.setattr(os, "fstat", fstat)
    fresh = kc.CubinCache(compiler, cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="attnext"):
        fresh.get(**BASE)
    assert compiler.calls == 2 and fresh.info()["disk_hits"] == 0
    assert len(_warnings(caplog)) == 1 and "owned by uid" in _warnings(caplog)[0]


def test_nvrtc_record_in_a_shared_folder_is_not_read(tmp_path, monkeypatch, warned):
    from attnext.cuda import nvrtc
    folder = tmp_path / "shared"
    monkeypatch.setenv("ATTNEXT_CACHE_DIR", str(folder))
    lib = tmp_path / "libnvrtc.so.12"
    lib.write_bytes(b"fake")
    nvrtc._write_record("fp", (12, 4), str(lib))
    assert nvrtc._recorded_version("fp") == (12, 4)
    os.chmod(folder, 0o757)
    assert nvrtc._recorded_version("fp") is None


def test_disabled_disk_cache(tmp_path, monkeypatch, compiler):
    for value in ("", "0", "off", "OFF"):
        monkeypatch.setenv("ATTNEXT_CACHE_DIR", value)
        cache = kc.CubinCache(compiler)
        assert cache.info()["cache_dir"] is None and cache.entry_path("ab") is None
        cache.get(**BASE)
    assert compiler.calls == 4                      # each cache compiles: nothing on disk
    assert os.listdir(tmp_path) == []
    assert kc.CubinCache(compiler, cache_dir=False).cache_dir is None


def test_default_dir_from_the_environment(tmp_path, monkeypatch, compiler):
    monkeypatch.setenv("ATTNEXT_CACHE_DIR", str(tmp_path / "mine"))
    cache = kc.CubinCache(compiler)
    assert cache.cache_dir == str(tmp_path / "mine")
    cache.get(**BASE)
    assert os.path.isfile(cache.entry_path(cache.key(**BASE)))
    monkeypatch.delenv("ATTNEXT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kc.default_cache_dir() == str(tmp_path / "xdg" / "attnext")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kc.default_cache_dir() == str(tmp_path / "home" / ".cache" / "attnext")
    assert os.listdir(tmp_path) == ["mine"]          # nothing created before a write


# --- logging, debug output, failures ---

def test_slow_compile_logs_one_info_line(cache, monkeypatch, caplog):
    monkeypatch.setattr(kc, "SLOW_COMPILE_SECONDS", 0.01)
    slow = kc.CubinCache(FakeCompiler(delay=0.05), cache_dir=False)
    with caplog.at_level(logging.DEBUG, logger="attnext"):
        slow.get(**BASE)
        slow.get(**BASE)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and infos[0].name == "attnext"
    msg = infos[0].getMessage()
    assert "k.cu" in msg and " s " in msg and slow.key(**BASE)[:12] in msg


def test_fast_compile_logs_nothing(cache, caplog):
    with caplog.at_level(logging.INFO, logger="attnext"):
        cache.get(**BASE)
    assert caplog.records == []


def test_debug_prints_the_source(cache, monkeypatch, capsys):
    monkeypatch.delenv("ATTNEXT_DEBUG", raising=False)
    cache.get(**dict(BASE, arch="sm_90a"))
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("ATTNEXT_DEBUG", "1")
    cache.get(**BASE)
    err = capsys.readouterr().err
    assert SOURCE in err and "-DSCALE=2.0f" in err and "k.cu" in err
    cache.get(**BASE)                                # a hit compiles nothing, prints nothing
    assert capsys.readouterr().err == ""


def test_compile_error_propagates_and_is_not_cached(tmp_path):
    failing = FakeCompiler(fail=True)
    cache = kc.CubinCache(failing, cache_dir=tmp_path)
    for _ in range(2):
        with pytest.raises(attnext.CompileError) as e:
            cache.get(**BASE)
        assert e.value.source == SOURCE
    assert failing.calls == 2
    i = cache.info()
    assert (i["entries"], i["compiles"], i["misses"]) == (0, 0, 2)
    assert not os.path.exists(os.path.join(tmp_path, f"v{kc.FORMAT_VERSION}")) or \
        entry_files(cache) == []


# --- threads and processes ---

def test_threads_asking_for_one_key_compile_once(tmp_path):
    compiler = FakeCompiler(delay=0.2)
    cache = kc.CubinCache(compiler, cache_dir=tmp_path)
    barrier = threading.Barrier(8)
    results, errors = [None] * 8, []

    def worker(i):
        try:
            barrier.wait()
            results[i] = cache.get(**BASE)
        except Exception as e:                       # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert compiler.calls == 1 and len(set(results)) == 1 and results[0]
    assert cache.info()["memory_hits"] == 7
    assert cache._key_locks == {}


def test_threads_on_different_keys_compile_in_parallel(tmp_path):
    compiler = FakeCompiler(delay=0.3)
    cache = kc.CubinCache(compiler, cache_dir=tmp_path)
    threads = [threading.Thread(target=cache.get, kwargs=dict(BASE, arch=f"sm_{80 + i}"))
               for i in range(4)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiler.calls == 4
    assert time.perf_counter() - start < 4 * 0.3


def _fill(cache_dir, who, rounds, start):
    """One process's share of test_two_processes_fill_one_dir: the same keys as the other
    process (written at about the same moment) and keys of its own, each round with a fresh
    cache so that every round reads and writes the disk."""
    start.wait()
    for r in range(rounds):
        cache = kc.CubinCache(FakeCompiler(), cache_dir=cache_dir)
        for i in range(4):
            big = dict(BASE, source=SOURCE + f"// round {r} shared {i}\n" + "x" * 200_000)
            assert cache.get(**big) == fake_cubin(big["source"], big["filename"],
                                                  big["options"], big["headers"])
            own = dict(BASE, source=SOURCE + f"// round {r} {who} {i}\n")
            cache.get(**own)
            cache.get(**dict(BASE, source=SOURCE + f"// shared {i}\n"))


def test_two_processes_fill_one_dir(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    rounds = 20
    procs = [ctx.Process(target=_fill, args=(str(tmp_path), who, rounds, start))
             for who in ("a", "b")]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    checker = FakeCompiler()
    cache = kc.CubinCache(checker, cache_dir=tmp_path)
    files = entry_files(cache)
    assert not [f for f in files if not f.endswith(".cubin")], files
    inputs = []
    for r in range(rounds):
        for i in range(4):
            inputs.append(dict(BASE, source=SOURCE + f"// round {r} shared {i}\n" + "x" * 200_000))
            inputs += [dict(BASE, source=SOURCE + f"// round {r} {who} {i}\n") for who in "ab"]
    inputs += [dict(BASE, source=SOURCE + f"// shared {i}\n") for i in range(4)]
    assert len(files) == len(inputs)
    for x in inputs:
        key = cache.key(**x)
        with open(cache.entry_path(key), "rb") as f:
            assert kc.decode_entry(key, f.read()) == fake_cubin(
                x["source"], x["filename"], x["options"], x["headers"])
        cache.get(**x)
    assert checker.calls == 0 and cache.info()["disk_hits"] == len(inputs)


# --- the real compiler ---

def test_real_nvrtc_compile(tmp_path):
    """NVRTC loaded here (nvrtc.nvrtc), not by whatever test ran before in this process."""
    compile_fn = getattr(attnext._C, "nvrtc_compile", None)
    if compile_fn is None:
        pytest.skip("attnext._C has no nvrtc_compile yet")
    source = 'extern "C" __global__ void add_one(float *x) { x[threadIdx.x] += 1.0f; }\n'
    cache = kc.CubinCache(compile_fn, cache_dir=tmp_path)
    inputs = dict(source=source, filename="add_one.cu", options=["-arch=sm_80"], headers=[],
                  arch="sm_80", nvrtc_version="unknown")
    try:
        nvrtc.nvrtc()
        cubin = cache.get(**inputs)
    except (OSError, RuntimeError) as e:
        if isinstance(e, attnext.CompileError):
            raise
        pytest.skip(f"NVRTC is not usable here: {e}")
    assert cubin[:4] == b"\x7fELF"
    fresh = kc.CubinCache(compile_fn, cache_dir=tmp_path)
    assert fresh.get(**inputs) == cubin and fresh.info()["compiles"] == 0
