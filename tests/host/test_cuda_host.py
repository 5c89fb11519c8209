"""The CUDA host primitives of attnext._C and attnext.cuda.arrays.

Without a GPU (CI, this file's default run): libcuda's absence is reported, NVRTC compiles real
CUBINs from the nvidia-cuda-nvrtc wheel, and DLPack capsules round-trip through attnext and NumPy
(host memory, or fake device addresses nothing dereferences). With `-m gpu`: memory, copies,
launches and the exchange with PyTorch / CuPy on a real device.

NVRTC and libcuda load once per process, so what must start from nothing runs in a subprocess.
"""
import gc
import importlib.metadata
import importlib.util
import os
import struct
import subprocess
import weakref

import ml_dtypes
import numpy as np
import pytest

import attnext
from attnext import _C
from attnext.cuda import arrays as device
from helpers import fake_cuda
from helpers.driver import FILL_HEADER, TINY_KERNEL, run_fresh

BF16 = np.dtype(ml_dtypes.bfloat16)
KDL_CPU, KDL_CUDA = 1, 2
ELF_MAGIC = b"\x7fELF"
FAKE_PTR = 0x7F00_0000_1000      # a device-looking address; these tests never dereference it


def _nvrtc_wheel_dir():
    """The lib folder of the nvidia-cuda-nvrtc wheel (a test dependency)."""
    spec = importlib.util.find_spec("nvidia")
    assert spec is not None, "the nvidia-cuda-nvrtc wheel is missing: pip install -e '.[test]'"
    for base in spec.submodule_search_locations:
        for sub in sorted(os.listdir(base)):
            lib = os.path.join(base, sub, "lib")
            if os.path.isdir(lib) and any(f.startswith("libnvrtc.so") for f in os.listdir(lib)):
                return lib
    raise AssertionError(f"no libnvrtc.so* under {list(spec.submodule_search_locations)}")


@pytest.fixture(scope="module")
def nvrtc():
    """NVRTC loaded in this process (from the wheel unless something loaded it already)."""
    return _C.nvrtc_load([_nvrtc_wheel_dir()])


# --- libcuda ---

def test_without_a_driver_every_cuda_call_raises_the_reason():
    out = run_fresh("""
        import attnext
        from attnext import _C
        for call in (_C.cuda_load, lambda: _C.cuda_info(0), lambda: _C.mem_alloc(16, 0),
                     lambda: _C.host_alloc(16), lambda: _C.pointer_device(4096)):
            try:
                call()
            except RuntimeError as e:
                print(e)
        print(_C.mem_alloc(0, 0))
    """, ATTNEXT_LIBCUDA="/nonexistent/libcuda.so.1")
    lines = out.splitlines()
    assert len(lines) == 6 and lines[-1] == "0", out
    for line in lines[:5]:
        assert line.startswith("attnext: CUDA is unusable: /nonexistent/libcuda.so.1 not found"), line
        assert "ATTNEXT_LIBCUDA" in line


def test_cuda_load_here_loads_or_says_why():
    try:
        _C.cuda_load()
    except RuntimeError as e:
        assert "CUDA is unusable" in str(e) and ("not found" in str(e) or "failed" in str(e))
    else:
        assert _C.cuda_device_count() >= 1


# --- a fake libcuda: the driver-side code paths, run on host memory without a GPU ---

def test_fake_driver_failures_name_the_cause(fake_libcuda):
    code = """
        from attnext import _C
        try:
            _C.cuda_load()
        except RuntimeError as e:
            print(e)
    """
    no_device = run_fresh(code, ATTNEXT_LIBCUDA=fake_libcuda["full"], FAKE_CUINIT="100")
    assert no_device.strip() == ("attnext: CUDA is unusable: cuInit failed: CUDA_ERROR_NO_DEVICE "
                                 "(no CUDA-capable device is detected)")
    old = run_fresh(code, ATTNEXT_LIBCUDA=fake_libcuda["old"])
    assert "has no cuMemAllocAsync" in old


def test_driver_older_than_nvrtc_is_named_with_the_fix(fake_libcuda, tmp_path):
    """Under a CUDA 12.8 driver, an NVRTC 13 (whose cubins it cannot load) makes the backend
    unavailable with both versions and the pip command; the CUDA 12 wheel's folder and soname are
    looked in first. The same NVRTC under a newer driver is usable. ATTNEXT_NVRTC points at a
    fake NVRTC of the version asked, so the test needs neither wheel."""
    if fake_cuda.compiler() is None:
        pytest.skip("no C compiler")
    src = tmp_path / "nvrtc.c"
    src.write_text("int nvrtcVersion(int *a, int *b) { *a = MAJOR; *b = 5; return 0; }\n"
                   + "".join(f"int {f}(void) {{ return 0; }}\n" for f in (
                       "nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetCUBINSize",
                       "nvrtcGetCUBIN", "nvrtcGetProgramLogSize", "nvrtcGetProgramLog",
                       "nvrtcDestroyProgram", "nvrtcGetErrorString", "nvrtcAddNameExpression",
                       "nvrtcGetLoweredName")))
    libs = {}
    for major in (12, 13):
        libs[major] = str(tmp_path / f"libnvrtc{major}.so")
        subprocess.run([fake_cuda.compiler(), "-shared", "-fPIC", f"-DMAJOR={major}", str(src),
                        "-o", libs[major]], check=True)
    code = """
        import numpy as np, attnext
        from attnext.cuda import backend, nvrtc
        print(repr(backend.unavailable_reason()))
        cands = nvrtc.nvrtc_candidates()
        print(cands.index("libnvrtc.so.12") < cands.index("libnvrtc.so.13"))
        q = np.zeros((1, 4, 1, 8), np.float16)
        try:
            attnext.attention(q, q, q, device="cuda")
        except RuntimeError as e:
            print(e)
    """
    env = dict(ATTNEXT_LIBCUDA=fake_libcuda["full"], ATTNEXT_CACHE_DIR=str(tmp_path / "cache"))
    old = run_fresh(code, FAKE_DRIVER_VERSION="12080", ATTNEXT_NVRTC=libs[13], **env).splitlines()
    why = ("NVRTC 13.5 compiles cubins that this driver (CUDA 12.8) cannot load: "
           "`pip install nvidia-cuda-nvrtc-cu12` brings an NVRTC for CUDA 12")
    assert why in old[0] and old[1] == "True", old
    assert old[2].startswith("device='cuda': the CUDA backend is unavailable: " + why), old
    ok = run_fresh(code, FAKE_DRIVER_VERSION="12080", ATTNEXT_NVRTC=libs[12], **env).splitlines()
    assert ok[:2] == ["''", "True"], ok
    new = run_fresh(code, FAKE_DRIVER_VERSION="13000", ATTNEXT_NVRTC=libs[13], **env).splitlines()
    assert new[:2] == ["''", "False"], new
    from attnext.cuda.nvrtc import driver_mismatch
    assert "'nvidia-cuda-nvrtc==14.*'" in driver_mismatch((15, 0), (14, 1))
    assert driver_mismatch((12, 9), (12, 2)) == driver_mismatch((12, 4), ()) == ""


def test_fake_driver_runs_the_host_side(fake_libcuda):
    """Every Python-facing path through the driver table, the fake's "device memory" being host
    memory: errors, memory, copies, DeviceArray, pinned buffers, modules, DLPack stream waits."""
    out = run_fresh(r"""
        import ctypes, os, re
        import numpy as np
        from attnext import _C
        from attnext.cuda import arrays as device
        fake = ctypes.CDLL(os.environ["ATTNEXT_LIBCUDA"])
        _C.cuda_load()
        info = _C.cuda_info(0)
        assert info == {"name": "Fake GPU", "compute_capability": (9, 0), "multiprocessor_count": 132,
                        "max_shared_memory_per_block_optin": 232448, "l2_cache_size": 52428800,
                        "total_memory": 80 << 30, "driver_version": (99, 0), "memory_pools": True,
                        "read_only_host_register": True}, info
        try:
            _C.cuda_info(1)
        except ValueError as e:
            assert str(e) == "attnext: CUDA device 1 does not exist (1 device)", e
        try:
            _C.mem_alloc(1 << 41, 0)
        except MemoryError as e:
            assert re.fullmatch(r"cuMemAllocAsync of 2199023255552 bytes on device 0 failed: "
                                r"CUDA_ERROR_OUT_OF_MEMORY \(out of memory\) at "
                                r"csrc/cuda/\w+\.c:\d+", str(e)), e

        host = np.arange(24, dtype=np.float32).reshape(4, 6)
        a = device.empty(host.shape, host.dtype, 0, 0)
        _C.memcpy_htod(a.ptr, host, 0)
        np.testing.assert_array_equal(a.numpy(), host)
        view = device.DeviceArray(a.ptr + 4 * 5, (4, 3), np.float32, strides=(6, -2), owner=a)
        np.testing.assert_array_equal(np.asarray(view), host[:, 5::-2])
        b = device.empty((24,), np.float32)
        _C.memcpy_dtod(b.ptr, a.ptr, a.nbytes, 0)
        _C.memset_d8(a.ptr, 0, a.nbytes, 0)
        assert not a.numpy().any() and (b.numpy() == host.ravel()).all()
        assert device.to_caller(b, host) is not None and (device.to_caller(b, host) == host.ravel()).all()

        dv = device.as_device_view(view)
        assert (dv.ptr, dv.shape, dv.strides, dv.dtype, dv.device) == (view.ptr, (4, 3), (6, -2), np.float32, 0)
        waits = ctypes.c_int.in_dll(fake, "waits")
        c = device.empty((8,), np.float16, 0, stream=0x5000)
        c.__dlpack__()                       # the legacy stream waits for 0x5000
        c.__dlpack__(stream=-1)              # no synchronisation asked
        assert waits.value == 1 and c.owner.streams == {1}, (waits.value, c.owner.streams)
        del c                                # the free waits for the consumer stream first
        assert waits.value == 2, waits.value

        pinned = _C.host_alloc(64)
        np.frombuffer(pinned, np.uint8)[:] = 7
        _C.memcpy_dtoh(memoryview(pinned)[:16], b.ptr, 0)
        assert len(pinned) == 64 and bytes(pinned)[:16] == host.ravel()[:4].tobytes()
        del pinned

        fn = _C.module_function(_C.module_load(b"\x7fELF", 0), "attn", 100000)
        assert _C.function_attributes(fn)["num_regs"] == 4
        _C.launch(fn, (1, 1, 1), (128, 1, 1), 100000, 0, b"params")
        try:
            _C.module_function(_C.module_load(b"\x7fELF", 0), "missing", 0)
        except RuntimeError as e:
            assert str(e).startswith('cuModuleGetFunction("missing") failed: CUDA_ERROR_NOT_FOUND '
                                     '(named symbol not found) at csrc/cuda/functions.c:'), e
        s = _C.stream_create()
        _C.stream_wait(s, 0)
        _C.stream_synchronize(s)
        _C.stream_destroy(s)
        assert _C.pointer_device(a.ptr) == 0
        fake.cuCtxSetCurrent(ctypes.c_void_p(0x999))
        del a, b, view, dv                   # finalizers free: the caller's context stays current
        current = ctypes.c_void_p()
        fake.cuCtxGetCurrent(ctypes.byref(current))
        assert current.value == 0x999, current
        print("ok")
    """, ATTNEXT_LIBCUDA=fake_libcuda["full"])
    assert out.strip() == "ok"


def test_fake_driver_registers_host_memory(fake_libcuda):
    """host_register / host_unregister / host_pinned against the fake's record of registered
    ranges, which refuses overlaps as the driver does."""
    out = run_fresh(r"""
        import ctypes, os, re
        import numpy as np
        from attnext import _C
        fake = ctypes.CDLL(os.environ["ATTNEXT_LIBCUDA"])
        registered = ctypes.c_int.in_dll(fake, "registered")
        a = np.zeros(3 << 12, np.uint8)
        lo = a.ctypes.data
        assert not _C.host_pinned(lo)
        assert _C.host_register(lo, 2 << 12, 0, True) is True and registered.value == 1
        assert _C.host_pinned(lo + 100) and not _C.host_pinned(lo + (2 << 12))
        assert _C.host_register(lo + 4096, 4096) is False       # overlaps: refused, nothing done
        assert _C.host_register(lo, 2 << 12) is False and registered.value == 1

        def message(exc, fn, *args):
            try:
                fn(*args)
            except exc as e:
                return str(e)
            raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__}")
        e = message(RuntimeError, _C.host_unregister, lo + 1)
        assert re.fullmatch(r"cuMemHostUnregister\(0x[0-9a-f]+\) failed: "
                            r"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED \(.*\) at "
                            r"csrc/cuda/\w+\.c:\d+", e), e
        _C.host_unregister(lo)
        assert registered.value == 0 and not _C.host_pinned(lo)
        ctypes.c_int.in_dll(fake, "register_error").value = 2
        e = message(MemoryError, _C.host_register, lo, 4096)
        assert e.startswith("cuMemHostRegister_v2 of 4096 bytes at 0x") and "CUDA_ERROR_OUT_OF_MEMORY" in e, e
        assert "nbytes must be >= 0" in message(ValueError, _C.host_register, lo, -1)
        print("ok")
    """, ATTNEXT_LIBCUDA=fake_libcuda["full"])
    assert out.strip() == "ok"


# --- NVRTC ---

def test_nvrtc_loads_from_the_wheel_and_reports_what_it_tried():
    wheel = _nvrtc_wheel_dir()
    out = run_fresh(f"""
        from attnext import _C
        try:
            _C.nvrtc_load(["/nonexistent/libnvrtc.so.13", "/nonexistent-dir", "libnvrtc-nope.so"])
        except RuntimeError as e:
            print(repr(str(e)))
        try:
            _C.nvrtc_version()
        except RuntimeError as e:
            print(repr(str(e)))
        print(repr(_C.nvrtc_load(["/nonexistent/libnvrtc.so", {wheel!r}])))
        print(repr(_C.nvrtc_load(["/ignored/once/loaded"])))
        print(_C.nvrtc_version())
    """)
    tried, not_loaded, path, again, version = (eval(line) for line in out.splitlines())
    for name in ("/nonexistent/libnvrtc.so.13", "/nonexistent-dir", "libnvrtc-nope.so", "ATTNEXT_NVRTC"):
        assert name in tried
    assert "nvrtc_load first" in not_loaded
    assert os.path.dirname(path) == wheel and os.path.basename(path).startswith("libnvrtc.so")
    assert again == path
    wheel_major = int(importlib.metadata.version("nvidia-cuda-nvrtc").split(".")[0])
    assert version[0] == wheel_major and version[1] >= 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_nvrtc_compiles_a_cubin(nvrtc, arch):
    cubin, log = _C.nvrtc_compile(TINY_KERNEL, "fill.cu", [f"--gpu-architecture={arch}", "-std=c++17"],
                                  [FILL_HEADER])
    assert isinstance(cubin, bytes) and cubin[:4] == ELF_MAGIC and len(cubin) > 1000
    assert isinstance(log, str)


def test_nvrtc_finds_in_memory_headers_only_when_given(nvrtc):
    with pytest.raises(attnext.CompileError) as info:
        _C.nvrtc_compile(TINY_KERNEL, "fill.cu", ["--gpu-architecture=sm_80"], [])
    assert "fill.h" in info.value.log
    cubin, _ = _C.nvrtc_compile(TINY_KERNEL, "fill.cu", ["--gpu-architecture=sm_80"],
                                [("other.h", "#error never included\n"), FILL_HEADER])
    assert cubin[:4] == ELF_MAGIC


def test_nvrtc_compile_error_carries_log_and_source(nvrtc):
    source = 'extern "C" __global__ void broken(float *x) { x[0] = 1.0f }\n'
    with pytest.raises(attnext.CompileError) as info:
        _C.nvrtc_compile(source, "broken.cu", ["--gpu-architecture=sm_80"], [])
    e = info.value
    assert isinstance(e, RuntimeError)
    assert e.source == source
    assert "broken.cu(1): error" in e.log and "broken.cu(1): error" in str(e)


def test_nvrtc_bad_options_and_virtual_architectures_raise_runtime_error(nvrtc):
    with pytest.raises(RuntimeError, match="NVRTC_ERROR_INVALID_OPTION.*--no-such-option"):
        _C.nvrtc_compile(TINY_KERNEL, "fill.cu", ["--no-such-option"], [FILL_HEADER])
    with pytest.raises(RuntimeError, match="no CUBIN.*real architecture") as info:
        _C.nvrtc_compile(TINY_KERNEL, "fill.cu", ["--gpu-architecture=compute_80"], [FILL_HEADER])
    assert not isinstance(info.value, attnext.CompileError)


def test_nvrtc_compile_argument_errors(nvrtc):
    with pytest.raises(TypeError, match=r"options\[1\] must be a str"):
        _C.nvrtc_compile(TINY_KERNEL, "fill.cu", ["--gpu-architecture=sm_80", 3], [])
    with pytest.raises(TypeError, match="header 0 must be a"):
        _C.nvrtc_compile(TINY_KERNEL, "fill.cu", [], ["fill.h"])
    with pytest.raises(ValueError, match="NUL"):
        _C.nvrtc_compile("int x;\0", "x.cu", [], [])


# --- DLPack, on the host ---

class _Owner:
    pass


class _Exporter:
    """What np.from_dlpack needs around a capsule."""

    def __init__(self, capsule, dl_device):
        self.capsule, self.dl_device = capsule, dl_device

    def __dlpack__(self, **kwargs):
        capsule, self.capsule = self.capsule, None
        return capsule

    def __dlpack_device__(self):
        return self.dl_device


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_export_import_round_trip(versioned):
    owner = _Owner()
    alive = weakref.ref(owner)
    cap = _C.dlpack_export(FAKE_PTR, (2, 3, 5), (1, 2, 6), (4, 16, 1), 3, owner, KDL_CUDA, versioned)
    del owner
    assert alive() is not None, "the capsule keeps its owner"
    imported = _C.dlpack_import(cap)
    keep, ptr, shape, strides, dtype, dev, readonly = imported
    assert (ptr, shape, strides, dtype, dev, readonly) == (FAKE_PTR, (2, 3, 5), (1, 2, 6), (4, 16, 1),
                                                          (KDL_CUDA, 3), False)
    with pytest.raises(TypeError, match="used_dltensor"):
        _C.dlpack_import(cap)
    del cap
    gc.collect()
    assert alive() is not None, "the consumer's owner keeps the tensor"
    del keep, imported
    gc.collect()
    assert alive() is None, "the deleter released the owner"


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_unconsumed_capsule_releases_its_owner(versioned):
    owner = _Owner()
    alive = weakref.ref(owner)
    cap = _C.dlpack_export(FAKE_PTR, (4,), None, (2, 32, 1), 0, owner, KDL_CUDA, versioned)
    del owner, cap
    gc.collect()
    assert alive() is None


def test_dlpack_export_contiguous_strides_and_scalars():
    cap = _C.dlpack_export(FAKE_PTR, (2, 3, 4), None, (2, 32, 1), 0, None)
    assert _C.dlpack_import(cap)[2:4] == ((2, 3, 4), (12, 4, 1))
    cap = _C.dlpack_export(FAKE_PTR, (), None, (2, 32, 1), 0, None)
    assert _C.dlpack_import(cap)[2:4] == ((), ())


def test_dlpack_export_bad_arguments():
    with pytest.raises(ValueError, match="2 strides for 3 dims"):
        _C.dlpack_export(FAKE_PTR, (2, 3, 4), (1, 2), (2, 32, 1), 0, None)
    with pytest.raises(ValueError, match=r"shape\[1\] is -3"):
        _C.dlpack_export(FAKE_PTR, (2, -3), None, (2, 32, 1), 0, None)
    with pytest.raises(ValueError, match="bad dtype"):
        _C.dlpack_export(FAKE_PTR, (2,), None, (2, 32, 0), 0, None)
    with pytest.raises(OverflowError):
        _C.dlpack_export(-1, (2,), None, (2, 32, 1), 0, None)
    with pytest.raises(TypeError, match="capsule"):
        _C.dlpack_import(np.zeros(3))


@pytest.mark.parametrize("versioned", [False, True])
def test_numpy_consumes_our_capsules(versioned):
    """NumPy reads a host array through attnext's DLPack structs: the layout matches dlpack.h."""
    base = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    view = base[::2, 1:, ::-2]             # non-contiguous, a negative stride
    alive = weakref.ref(base)
    strides = tuple(s // base.itemsize for s in view.strides)
    cap = _C.dlpack_export(view.ctypes.data, view.shape, strides, (2, 32, 1), 0, base, KDL_CPU,
                           versioned)
    got = np.from_dlpack(_Exporter(cap, (KDL_CPU, 0)))
    np.testing.assert_array_equal(got, view)
    assert got.ctypes.data == view.ctypes.data, "a view, not a copy"
    del base, view, cap
    gc.collect()
    assert alive() is not None, "NumPy's array keeps the owner"
    del got
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("versioned", [False, True])
def test_we_consume_numpys_capsules(versioned):
    a = np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2]
    a.flags.writeable = not versioned      # NumPy exports read-only arrays only in DLPack 1.x
    cap = a.__dlpack__(max_version=(1, 0)) if versioned else a.__dlpack__()
    owner, ptr, shape, strides, dtype, dev, readonly = _C.dlpack_import(cap)
    assert (ptr, shape, strides, dtype, dev) == (a.ctypes.data, (4, 3), (6, 2), (0, 16, 1), (KDL_CPU, 0))
    assert readonly == versioned


# --- DeviceArray without a GPU (nothing here touches device memory) ---

def test_device_array_describes_itself():
    a = device.DeviceArray(FAKE_PTR, (2, 3), np.float16, device=1)
    assert (a.ndim, a.size, a.nbytes, a.itemsize, a.strides) == (2, 6, 12, 2, (3, 1))
    assert a.__dlpack_device__() == (KDL_CUDA, 1)
    assert a.__cuda_array_interface__ == {"shape": (2, 3), "typestr": "<f2", "data": (FAKE_PTR, False),
                                          "strides": None, "version": 3, "stream": 1}
    assert repr(a) == "DeviceArray(shape=(2, 3), dtype=float16, device=cuda:1)"
    t = device.DeviceArray(FAKE_PTR, (3, 2), BF16, strides=(1, 3), stream=0xABC)
    cai = t.__cuda_array_interface__
    assert (cai["typestr"], cai["strides"], cai["stream"]) == ("<V2", (2, 6), 0xABC)
    assert "strides=(1, 3)" in repr(t) and "bfloat16" in repr(t)


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_device_array_dlpack_on_its_own_stream(max_version):
    """On the array's own stream (the legacy default, by default) no stream call is needed."""
    a = device.DeviceArray(FAKE_PTR, (4, 5), BF16, strides=(10, 2), device=2)
    cap = a.__dlpack__(max_version=max_version)
    owner, ptr, shape, strides, dtype, dev, _ = _C.dlpack_import(cap)
    assert (ptr, shape, strides, dtype, dev) == (FAKE_PTR, (4, 5), (10, 2), (4, 16, 1), (KDL_CUDA, 2))
    with pytest.raises(BufferError, match="copy=True"):
        a.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="not"):
        a.__dlpack__(dl_device=(KDL_CUDA, 0))
    a.__dlpack__(stream=-1, dl_device=(KDL_CUDA, 2))


def test_device_array_keeps_its_owner_through_a_capsule():
    owner = _Owner()
    alive = weakref.ref(owner)
    cap = device.DeviceArray(FAKE_PTR, (8,), np.float32, owner=owner).__dlpack__()
    del owner
    gc.collect()
    assert alive() is not None
    del cap
    gc.collect()
    assert alive() is None


def test_to_caller_returns_the_device_array_for_unknown_libraries():
    a = device.DeviceArray(FAKE_PTR, (2,), np.float32)
    assert device.to_caller(a, a) is a
    assert device.to_caller(a, _Owner()) is a


def test_host_data_is_not_a_device_view():
    assert device.as_device_view(np.zeros(3)) is None
    assert device.as_device_view([1.0, 2.0]) is None
    torch = pytest.importorskip("torch")
    assert device.as_device_view(torch.zeros(3)) is None


# --- on a GPU ---

@pytest.fixture
def torch_cuda(gpu):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _arch(dev):
    major, minor = _C.cuda_info(dev)["compute_capability"]
    return f"sm_{major}{minor}"


@pytest.mark.gpu
def test_cuda_info(gpu):
    info = _C.cuda_info(gpu)
    assert set(info) == {"name", "compute_capability", "multiprocessor_count",
                         "max_shared_memory_per_block_optin", "l2_cache_size", "total_memory",
                         "driver_version", "memory_pools", "read_only_host_register"}
    assert isinstance(info["read_only_host_register"], bool)
    assert info["compute_capability"] >= (8, 0) and info["multiprocessor_count"] > 0
    assert info["max_shared_memory_per_block_optin"] >= 48 * 1024 and info["total_memory"] > 2 ** 30
    with pytest.raises(ValueError, match="does not exist"):
        _C.cuda_info(_C.cuda_device_count())


@pytest.mark.gpu
def test_alloc_copy_round_trip(gpu):
    stream = _C.stream_create(gpu)
    try:
        host = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
        a = device.empty((1000,), np.float32, gpu, stream)
        b = device.empty((1000,), np.float32, gpu, stream)
        assert a.ptr % 256 == 0 and _C.pointer_device(a.ptr) == gpu
        _C.memcpy_htod(a.ptr, host, stream, gpu)
        _C.memcpy_dtod(b.ptr, a.ptr, a.nbytes, stream, gpu)
        _C.memset_d8(a.ptr, 0, a.nbytes, stream, gpu)
        back = np.empty_like(host)
        _C.memcpy_dtoh(back, b.ptr, stream, gpu)
        np.testing.assert_array_equal(back, host)
        np.testing.assert_array_equal(np.asarray(a), np.zeros(1000, np.float32))
        np.testing.assert_array_equal(b.numpy(), host)
        del a, b
        _C.stream_synchronize(stream, gpu)
    finally:
        _C.stream_destroy(stream, gpu)


@pytest.mark.gpu
def test_strided_device_array_to_numpy(gpu):
    host = np.arange(24, dtype=np.float16).reshape(4, 6)
    a = device.empty(host.shape, host.dtype, gpu)
    _C.memcpy_htod(a.ptr, host, 0, gpu)
    view = device.DeviceArray(a.ptr + 2 * 5, (3, 2), np.float16, gpu, strides=(6, -2), owner=a)
    np.testing.assert_array_equal(view.numpy(), host[:3, 5:2:-2])


@pytest.mark.gpu
def test_pinned_memory(gpu):
    pinned = _C.host_alloc(4096, gpu)
    assert len(pinned) == pinned.nbytes == 4096 and "PinnedBuffer" in repr(pinned)
    src = np.frombuffer(pinned, np.uint8)
    src[:] = np.arange(4096) % 251
    dst = device.empty((4096,), np.uint8, gpu)
    _C.memcpy_htod(dst.ptr, memoryview(pinned), 0, gpu)
    out = _C.host_alloc(4096, gpu)
    _C.memcpy_dtoh(memoryview(out), dst.ptr, 0, gpu)
    _C.stream_synchronize(0, gpu)
    np.testing.assert_array_equal(np.frombuffer(out, np.uint8), src)
    with pytest.raises(ValueError, match="host memory"):
        _C.pointer_device(pinned.ptr)
    assert len(_C.host_alloc(0)) == 0


@pytest.mark.gpu
def test_pointer_device_refuses_unknown_memory(gpu):
    # pageable memory: unknown to CUDA, or host memory where the driver tracks it (HMM)
    with pytest.raises(ValueError, match="0x[0-9a-f]+ is (not memory CUDA knows of|host memory)"):
        _C.pointer_device(np.zeros(4).ctypes.data)


@pytest.mark.gpu
def test_out_of_memory_is_memory_error(gpu):
    with pytest.raises(MemoryError, match="bytes on device"):
        _C.mem_alloc(1 << 50, 0, gpu)


@pytest.mark.gpu
def test_compile_load_launch(gpu, nvrtc):
    cubin, _ = _C.nvrtc_compile(TINY_KERNEL, "fill.cu", [f"--gpu-architecture={_arch(gpu)}"],
                                [FILL_HEADER])
    module = _C.module_load(cubin, gpu)
    smem = 64 * 1024                     # above the 48 KiB default: the limit must be raised
    fn = _C.module_function(module, "fill", smem)
    del module                           # the function keeps its module
    attrs = _C.function_attributes(fn)
    assert attrs["max_dynamic_shared_size_bytes"] == smem and attrs["num_regs"] > 0
    assert attrs["max_threads_per_block"] >= 256 and attrs["local_size_bytes"] == 0
    n = 1000
    x = device.empty((n,), np.float32, gpu)
    _C.launch(fn, ((n + 255) // 256, 1, 1), (256, 1, 1), smem, 0, struct.pack("<Qfi", x.ptr, 1.5, n))
    np.testing.assert_array_equal(x.numpy(), np.full(n, 3.0, np.float32))
    with pytest.raises(ValueError, match="must be positive"):
        _C.launch(fn, (0, 1, 1), (256, 1, 1), 0, 0, b"")
    with pytest.raises(RuntimeError, match="cuModuleGetFunction"):
        _C.module_function(_C.module_load(cubin, gpu), "no_such_kernel", 0)
    with pytest.raises(TypeError, match="module_function"):
        _C.launch(cubin, (1, 1, 1), (1, 1, 1), 0, 0, b"")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_round_trip(torch_cuda, dtype):
    torch = torch_cuda
    t = torch.randn(4, 6, device="cuda", dtype=getattr(torch, dtype))[:, ::2]
    view = device.as_device_view(t)
    assert view.ptr == t.data_ptr() and view.shape == (4, 3) and view.strides == (6, 2)
    assert view.dtype == (BF16 if dtype == "bfloat16" else np.dtype(dtype))
    assert view.device == t.device.index
    a = device.DeviceArray(view.ptr, view.shape, view.dtype, view.device, view.strides, owner=view)
    back = device.to_caller(a, t)
    assert isinstance(back, torch.Tensor) and back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32), t.float().cpu().numpy())


def _torch_cases(torch):
    """Tensors that the accessor path reads (plain, strided, transposed, broadcast, size-1 and
    zero-size dims, every dtype of its table) and ones it leaves to the interface."""
    base = torch.randn(6, 8, 5, device="cuda")
    taken = [base, base[:, ::2], base.transpose(0, 2), base[:, :1], base.expand(3, 6, 8, 5),
             base[None], base[:0], torch.empty(2, 0, 3, device="cuda"), base[2, 3]]
    taken += [torch.zeros(3, 4, device="cuda", dtype=getattr(torch, name))[:, 1:]
              for name in ("float16", "bfloat16", "float64", "int8", "int16", "int32", "int64",
                           "uint8", "bool")]
    left = [torch.zeros(3, device="cuda", dtype=torch.complex64),
            torch.zeros(3, device="cuda").to_sparse(), torch.zeros(3)]
    return taken, left


@pytest.mark.gpu
def test_torch_accessors_give_the_interface_view(torch_cuda):
    """device._torch_view (torch's C accessors, the hot path) gives the very view that torch's
    __cuda_array_interface__ does, and leaves to the interface what it does not read."""
    torch = torch_cuda
    taken, left = _torch_cases(torch)
    for t in taken:
        fast = device._torch_view(t, None)
        assert fast is not None, (t.shape, t.dtype)
        slow = device._from_interface(t, t.__cuda_array_interface__, None)
        for attr in ("ptr", "shape", "strides", "dtype", "device", "stream", "readonly"):
            assert getattr(fast, attr) == getattr(slow, attr), (attr, t.shape, t.stride(), t.dtype)
        assert fast.keep is t
        assert device.as_device_view(t, 2).stream == 2
    for t in left:
        assert device._torch_view(t, None) is None
    subclass = torch.zeros(3, device="cuda").as_subclass(type("Sub", (torch.Tensor,), {}))
    assert device._torch_view(subclass, None) is None
    needs_grad = torch.zeros(3, device="cuda", requires_grad=True)
    assert device._torch_view(needs_grad, None) is None
    with pytest.raises(TypeError, match="requires grad"):
        device.as_device_view(needs_grad)


@pytest.mark.gpu
def test_torch_through_dlpack_only(torch_cuda):
    torch = torch_cuda

    class OnlyDLPack:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    t = torch.arange(12, device="cuda", dtype=torch.bfloat16).reshape(3, 4).t()
    view = device.as_device_view(OnlyDLPack(t))
    assert (view.ptr, view.shape, view.strides, view.dtype) == (t.data_ptr(), (4, 3), (1, 4), BF16)


@pytest.mark.gpu
def test_results_on_a_side_stream_reach_torch(torch_cuda):
    """A DeviceArray written on one stream, read by torch on its current stream."""
    torch = torch_cuda
    side = _C.stream_create(0)
    try:
        host = np.arange(1 << 20, dtype=np.float32)
        a = device.empty(host.shape, host.dtype, 0, side)
        _C.memcpy_htod(a.ptr, host, side, 0)
        t = device.to_caller(a, torch.empty(0, device="cuda"))
        assert torch.equal(t.cpu(), torch.from_numpy(host))
        del a, t
        torch.cuda.synchronize()
    finally:
        _C.stream_destroy(side, 0)


@pytest.mark.gpu
def test_cupy_round_trip(gpu):
    cp = pytest.importorskip("cupy")
    x = cp.arange(10, dtype=cp.float32)[::2]
    view = device.as_device_view(x)
    assert (view.ptr, view.shape, view.strides) == (x.data.ptr, (5,), (2,))
    a = device.empty((5,), np.float32, 0)
    packed = cp.ascontiguousarray(x)
    _C.memcpy_dtod(a.ptr, packed.data.ptr, packed.nbytes, 0, 0)
    back = device.to_caller(a, x)
    assert isinstance(back, cp.ndarray) and cp.array_equal(back, x)
    assert cp.array_equal(cp.asarray(a), x)      # through __cuda_array_interface__


def test_pinned_results_come_from_a_bounded_pool(fake_libcuda):
    """staging.host_result: a large result in a pooled PinnedBuffer, its block back in the pool
    once the array and every view of it are gone, and taken again by the next result of about
    its size (no cuMemHostAlloc); a small result, or one past RESULTS_MAX_BYTES alive, is a
    plain NumPy array; the pool keeps at most 16 blocks and host_pool(limit) bytes free."""
    out = run_fresh(r"""
        import ctypes, os
        import numpy as np
        from attnext import _C
        from attnext.cuda import pinning, staging
        fake = ctypes.CDLL(os.environ["ATTNEXT_LIBCUDA"])
        allocs, frees = (ctypes.c_int.in_dll(fake, n) for n in ("host_allocs", "host_frees"))
        _C.cuda_load()
        MiB = 1 << 20
        a = staging.host_result((4, MiB // 4), np.float32)            # 4 MiB
        buf = pinning.root(a)
        assert isinstance(buf, _C.PinnedBuffer) and buf.pooled and a.flags.writeable, buf
        assert a.shape == (4, MiB // 4) and a.dtype == np.float32
        ptr, del_buf = a.ctypes.data, None
        del buf
        view = a[1:]
        del a
        assert _C.host_pool()[1:3] == (0, 4 * MiB), _C.host_pool()     # the view keeps it
        del view
        free, blocks, live, limit = _C.host_pool()
        assert (free, blocks, live) == (4 * MiB, 1, 0) and limit == 1 << 30           # the pool's default
        n = allocs.value
        b = staging.host_result((MiB,), np.float32)                      # the same block again
        assert b.ctypes.data == ptr and allocs.value == n
        c = staging.host_result((MiB // 2,), np.float16)                 # 1 MiB: a block of its own
        assert allocs.value == n + 1
        small = staging.host_result((1000,), np.float32)
        assert not isinstance(pinning.root(small), _C.PinnedBuffer)
        staging.RESULTS_MAX_BYTES = 6 * MiB                             # 5 MiB alive: 4 more is past it
        big = staging.host_result((MiB,), np.float32)
        assert not isinstance(pinning.root(big), _C.PinnedBuffer) and allocs.value == n + 1
        staging.RESULTS_MAX_BYTES = 1 << 40
        del b, c
        assert _C.host_pool()[:3] == (5 * MiB, 2, 0)
        many = [staging.host_result((MiB + i * 4096,), np.uint8) for i in range(20)]
        assert allocs.value == n + 20                                    # the first one took c's
        del many                                                         # 21 blocks back: 16 kept
        assert _C.host_pool()[1] == 16 and frees.value == 5, (_C.host_pool(), frees.value)
        _C.host_pool(2 * MiB)                                            # the oldest go first
        free, blocks, _, limit = _C.host_pool()
        assert free <= 2 * MiB and blocks == 1 and limit == 2 * MiB
        x = staging.host_result((3 * MiB,), np.uint8)
        del x                                                            # larger than the limit
        assert _C.host_pool()[1] == 1 and frees.value == 21
        print("ok")
    """, ATTNEXT_LIBCUDA=fake_libcuda["full"])
    assert out.strip() == "ok"


def test_the_default_pool_keeps_freed_memory_at_a_sync(fake_libcuda):
    """A device's first use raises its memory pool's release threshold to POOL_KEEP_BYTES
    (ATTNEXT_POOL_KEEP_BYTES), so a synchronising call does not map its buffers again; a larger
    one (another library's) stays. mem_pool_trim gives the kept memory back now (the threshold
    stays)."""
    out = run_fresh(r"""
        import ctypes, os
        from attnext import _C
        from attnext.cuda import backend as cuda_backend
        fake = ctypes.CDLL(os.environ["ATTNEXT_LIBCUDA"])
        keep = ctypes.c_longlong.in_dll(fake, "pool_threshold")
        assert keep.value == 0
        cuda_backend.device_info(0)
        print(keep.value, cuda_backend.POOL_KEEP_BYTES)
        keep.value = 1 << 40                                  # another library's larger keep
        _C.mem_pool_keep(5, 0)
        print(keep.value)
        print(_C.mem_pool_trim(0), ctypes.c_int.in_dll(fake, "pool_trims").value, keep.value)
    """, ATTNEXT_LIBCUDA=fake_libcuda["full"], ATTNEXT_POOL_KEEP_BYTES="12345")
    assert out.split() == ["12345", "12345", str(1 << 40), "True", "1", str(1 << 40)]


def test_pinned_pool_frees_each_block_once_across_threads(fake_libcuda):
    """Two results dropped at once while the pool is full: each pushes the oldest block out and
    frees it (cuMemFreeHost, slow here, the GIL released meanwhile); no block is freed twice or
    handed out while it is being freed, and the pool ends with 16 blocks."""
    out = run_fresh(r"""
        import ctypes, os, threading
        from attnext import _C
        fake = ctypes.CDLL(os.environ["ATTNEXT_LIBCUDA"])
        frees = ctypes.c_int.in_dll(fake, "host_frees")
        freed = (ctypes.c_void_p * 1024).in_dll(fake, "freed_ptrs")
        _C.cuda_load()
        MiB = 1 << 20
        bufs = [_C.host_alloc(MiB, 0, True) for _ in range(16)]
        first = {b.ptr for b in bufs}
        del bufs                                                   # the pool is full
        live = {i: _C.host_alloc((5 + i) * MiB, 0, True) for i in range(4)}
        ctypes.c_int.in_dll(fake, "slow_free_us").value = 100000
        taken = []
        threads = [threading.Thread(target=live.pop, args=(i,)) for i in range(3)]
        threads.append(threading.Thread(target=lambda: taken.append(_C.host_alloc(MiB, 0, True))))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = [freed[i] for i in range(frees.value)]
        assert len(got) == len(set(got)), got                      # none freed twice
        assert taken[0].ptr not in got                             # nor handed out while freed
        reused = taken[0].ptr in first
        assert _C.host_pool()[1] + len(got) == 16 + 3 - reused, (_C.host_pool(), got, reused)
        assert _C.host_pool()[1] <= 16
        print("ok")
    """, ATTNEXT_LIBCUDA=fake_libcuda["full"])
    assert out.strip() == "ok"
