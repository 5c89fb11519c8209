"""Builds attnext._C from csrc/**/*.c: C11, -O3, warnings on, OpenMP where the compiler has it.

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


def _has_openmp(compiler):
    """True when the C compiler builds and links a tiny OpenMP program with -fopenmp."""
    src = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.c")
        with open(path, "w") as f:
            f.write(src)
        cmd = list(compiler) + ["-fopenmp", path, "-o", os.path.join(tmp, "t")]
        try:
            return subprocess.run(cmd, capture_output=True).returncode == 0
        except OSError:
            return False


class BuildExt(build_ext):
    def build_extensions(self):
        # the compiler command without its flags ("ccache gcc -pthread ..." -> ["ccache", "gcc"])
        cmd = getattr(self.compiler, "compiler_so", None) or ["cc"]
        cc = list(itertools.takewhile(lambda a: not a.startswith("-"), cmd))
        use_omp = os.environ.get("ATTNEXT_NO_OPENMP") != "1" and _has_openmp(cc)
        sanitize = os.environ.get("ATTNEXT_SANITIZE") == "1"
        for ext in self.extensions:
            args = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
                    "-fno-strict-aliasing", "-ffp-contract=fast", "-fvisibility=hidden"]
            link = []
            if use_omp:
                args.append("-fopenmp")
                link.append("-fopenmp")
            if sanitize:
                args += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]
                link += ["-fsanitize=address,undefined"]
            ext.extra_compile_args = args
            # libcuda and libnvrtc are dlopened at run time, never linked
            ext.extra_link_args = link + ["-lm", "-ldl"]
        if not use_omp:
            print("attnext: the C compiler has no OpenMP; the CPU backend runs serially", file=sys.stderr)
        super().build_extensions()


setup(
    # csrc/: module.c and the headers the kernels share; cpu/, interp/ and cuda/ by role
    ext_modules=[Extension("attnext._C", sources=sorted(glob.glob("csrc/**/*.c", recursive=True)),
                           depends=sorted(glob.glob("csrc/**/*.h", recursive=True)),
                           include_dirs=["csrc", "csrc/cpu", "csrc/interp", "csrc/cuda"])],
    cmdclass={"build_ext": BuildExt},
)
