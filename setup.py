"""Builds attnext._C from csrc/**/*.c: C11, -O3, warnings on, OpenMP where the compiler has it
(Apple's clang: with Homebrew's libomp, found when installed).

No CUDA, no NumPy headers: the extension reads arrays through the buffer protocol and loads
libcuda and libnvrtc with dlopen at run time. Nothing is tuned to the build machine (never
-march=native); SIMD variants are chosen at run time.
"""
import glob
import itertools
import os
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _builds(compiler, cflags, lflags):
    """True when the C compiler builds and links a tiny OpenMP program with these flags."""
    src = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.c")
        with open(path, "w") as f:
            f.write(src)
        cmd = list(compiler) + list(cflags) + [path, "-o", os.path.join(tmp, "t")] + list(lflags)
        try:
            return subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def _libomp_prefixes():
    """Where Homebrew's libomp may be installed (Apple's clang ships no OpenMP runtime): `brew
    --prefix libomp`, then Homebrew's usual prefixes, those holding include/omp.h."""
    found = []
    try:
        res = subprocess.run(["brew", "--prefix", "libomp"], capture_output=True, text=True, timeout=60)
        if res.returncode == 0 and res.stdout.strip():
            found.append(res.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    found += ["/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"]
    return [p for p in dict.fromkeys(found) if os.path.isfile(os.path.join(p, "include", "omp.h"))]


def _openmp_flags(compiler):
    """(compile flags, link flags) that give the C compiler OpenMP, or None: -fopenmp where it has
    it (GCC, LLVM's clang), else Apple clang's -Xpreprocessor -fopenmp against Homebrew's libomp."""
    candidates = [(["-fopenmp"], ["-fopenmp"])]
    for prefix in _libomp_prefixes():
        candidates.append((["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"],
                           [f"-L{prefix}/lib", "-lomp", f"-Wl,-rpath,{prefix}/lib"]))
    for cflags, lflags in candidates:
        if _builds(compiler, cflags, lflags):
            return cflags, lflags
    return None


NO_OPENMP = ("attnext: the C compiler has no OpenMP, so the CPU backend runs on one thread "
             "(attnext.info() says so). For threads: with Apple's clang, `brew install libomp` and "
             "build again (setup.py finds it); elsewhere use GCC, or clang with its OpenMP runtime "
             "(Debian: libomp-dev).")


# The extension's C flags (OpenMP's and the sanitizers' are added by BuildExt); tests that build
# csrc/cpu on its own (tests/unit/test_simd_native.py) take them from here.
CFLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-strict-aliasing",
          "-ffp-contract=fast", "-fvisibility=hidden"]


class BuildExt(build_ext):
    def build_extensions(self):
        # the compiler command without its flags ("ccache gcc -pthread ..." -> ["ccache", "gcc"])
        cmd = getattr(self.compiler, "compiler_so", None) or ["cc"]
        cc = list(itertools.takewhile(lambda a: not a.startswith("-"), cmd))
        omp = None if os.environ.get("ATTNEXT_NO_OPENMP") == "1" else _openmp_flags(cc)
        sanitize = os.environ.get("ATTNEXT_SANITIZE") == "1"
        for ext in self.extensions:
            args = list(CFLAGS)
            link = []
            if omp:
                args += omp[0]
                link += omp[1]
            if sanitize:
                args += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]
                link += ["-fsanitize=address,undefined"]
            ext.extra_compile_args = args
            # libcuda and libnvrtc are dlopened at run time, never linked
            ext.extra_link_args = link + ["-lm", "-ldl"]
        if not omp and os.environ.get("ATTNEXT_NO_OPENMP") != "1":
            print(NO_OPENMP, file=sys.stderr)
        super().build_extensions()


setup(
    # csrc/: module.c and the headers the kernels share; cpu/, interp/ and cuda/ by role
    ext_modules=[Extension("attnext._C", sources=sorted(glob.glob("csrc/**/*.c", recursive=True)),
                           depends=sorted(glob.glob("csrc/**/*.h", recursive=True)),
                           include_dirs=["csrc", "csrc/cpu", "csrc/interp", "csrc/cuda"])],
    cmdclass={"build_ext": BuildExt},
)
