"""setup.py's OpenMP detection ([4/7] point 3) without a build: its functions are taken from the
file (running it would build the extension), and a fake compiler plays Apple's clang, which
refuses a bare -fopenmp and takes -Xpreprocessor -fopenmp against Homebrew's libomp."""
import os
import stat
import sys

import pytest

from attnext import _C
from helpers.paths import setup_py


def _fake_clang(tmp_path, accepts):
    """An executable standing in for a C compiler: it writes the output file and exits 0 when
    accepts(argv) holds, else exits 1."""
    path = tmp_path / "fake-cc"
    path.write_text(f"#!{sys.executable}\n"
                    "import sys\n"
                    f"accepts = {accepts!r}\n"
                    "args = sys.argv[1:]\n"
                    "ok = eval(accepts)\n"
                    "if ok:\n"
                    "    open(args[args.index('-o') + 1], 'w').close()\n"
                    "sys.exit(0 if ok else 1)\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return [str(path)]


def test_this_compiler_takes_fopenmp():
    """The build here has OpenMP (attnext.info() says which it got): -fopenmp, as detected."""
    if not _C.openmp_threads():
        pytest.skip("this build has no OpenMP")
    ns = setup_py()
    flags = ns["_openmp_flags"](["cc"])
    assert flags == (["-fopenmp"], ["-fopenmp"])


def test_apple_clang_gets_homebrews_libomp(tmp_path, monkeypatch):
    ns = setup_py()
    prefix = tmp_path / "libomp"
    (prefix / "include").mkdir(parents=True)
    (prefix / "include" / "omp.h").write_text("")
    (prefix / "lib").mkdir()
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "brew").write_text(f"#!/bin/sh\necho {prefix}\n")
    (tmp_path / "brew").chmod(0o755)
    apple = _fake_clang(tmp_path, "'-fopenmp' not in args or '-Xpreprocessor' in args and '-lomp' in args")
    assert ns["_libomp_prefixes"]()[0] == str(prefix)
    cflags, lflags = ns["_openmp_flags"](apple)
    assert cflags == ["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"]
    assert lflags[:2] == [f"-L{prefix}/lib", "-lomp"]
    # no libomp anywhere: no OpenMP, and the build says how to get threads
    (prefix / "include" / "omp.h").unlink()
    assert ns["_openmp_flags"](apple) is None
    assert "brew install libomp" in ns["NO_OPENMP"] and "one thread" in ns["NO_OPENMP"]
