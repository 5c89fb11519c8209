"""The CPU suite under AddressSanitizer and UndefinedBehaviorSanitizer.

The extension is built with ATTNEXT_SANITIZE=1 (setup.py: -fsanitize=address,undefined) into a
temporary directory, never over the in-place build, next to a copy of the package's Python files;
a subset of the CPU suite then runs against it in a child pytest with the sanitizer runtime
preloaded into the (uninstrumented) interpreter. Any report, from the child or from a process it
starts, fails the test: reports go to files under the temporary directory and the test reads them.
LeakSanitizer is off: CPython keeps objects alive until exit by design.

    ATTNEXT_SANITIZE_TESTS="tests/cpu/test_cpu_attention.py ..."   # another subset ("tests": all)
    python -m pytest -q -m "not sanitize"                      # leave this test out
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from helpers import paths

ROOT = str(paths.ROOT)

# the RSS measurements are left out (ASan's shadow memory and quarantine grow RSS by design),
# and so is this file (the child would run it again). test_score_mod.py (its CPU cases) and
# test_block_mask.py run whole: the score_mod / mask_mod interpreter (csrc/interp/interp.c), captured
# array lookups, block skipping and array gradients; unsanitized they take about 5 s together
DEFAULT_TESTS = ["tests/cpu/test_cpu_attention.py", "tests/contract/test_errors.py",
                 "tests/contract/test_properties.py", "tests/cpu/test_concurrency.py",
                 "tests/cpu/test_score_mod.py", "tests/unit/test_block_mask.py"]
DESELECT = "not memory_is_linear and not rss and not sanitize"
CHILD = "ATTNEXT_SANITIZED_CHILD"

pytestmark = [pytest.mark.sanitize,
              pytest.mark.skipif(os.environ.get(CHILD) == "1", reason="inside the sanitized run")]


def _compiler():
    import sysconfig
    return (sysconfig.get_config_var("CC") or "cc").split()[0]


def _runtime(so_path):
    """The sanitizer runtimes the built extension links (from ldd), in preload order."""
    out = subprocess.run(["ldd", so_path], capture_output=True, text=True).stdout
    libs = {}
    for line in out.splitlines():
        parts = line.split("=>")
        if len(parts) == 2 and ("libasan" in parts[0] or "libubsan" in parts[0]):
            libs[parts[0].strip()] = parts[1].split("(")[0].strip()
    return [libs[n] for n in sorted(libs, key=lambda n: "libubsan" in n)]   # libasan first


def _unavailable(why):
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the sanitizer build: {why}")
    pytest.skip(why)


def _build(tmp):
    probe = tmp / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    cc = _compiler()
    r = subprocess.run([cc, "-fsanitize=address,undefined", str(probe), "-o", str(tmp / "probe")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        _unavailable(f"{cc} cannot link -fsanitize=address,undefined: {r.stderr[-500:]}")
    env = dict(os.environ, ATTNEXT_SANITIZE="1")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(tmp / "lib"),
                        "-t", str(tmp / "obj")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"the sanitizer build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    built = [p for p in (tmp / "lib" / "attnext").iterdir() if p.name.startswith("_C.")]
    assert len(built) == 1, built
    # the package's Python files and the sanitized extension, beside a view of the tests
    run = tmp / "run"
    shutil.copytree(os.path.join(ROOT, "attnext"), run / "attnext",
                    ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
    shutil.copy2(built[0], run / "attnext" / built[0].name)
    shutil.copytree(os.path.join(ROOT, "tests"), run / "tests",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("kernels", "csrc", "bench", "examples"):   # sources warmup --check compiles
        if os.path.isdir(os.path.join(ROOT, name)):
            shutil.copytree(os.path.join(ROOT, name), run / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.json", "*.png"))
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy2(os.path.join(ROOT, name), run / name)
    return run, run / "attnext" / built[0].name


def test_cpu_suite_under_asan_and_ubsan(tmp_path):
    run, so_path = _build(tmp_path)
    runtime = _runtime(str(so_path))
    if not any("libasan" in p for p in runtime):
        _unavailable(f"the sanitized extension links no libasan (ldd: {runtime})")
    reports = tmp_path / "reports"
    reports.mkdir()
    env = dict(os.environ)
    env.update({
        CHILD: "1",
        "LD_PRELOAD": " ".join(runtime + [p for p in env.get("LD_PRELOAD", "").split() if p]),
        "ASAN_OPTIONS": f"detect_leaks=0:log_path={reports}/asan:strict_string_checks=1",
        "UBSAN_OPTIONS": f"halt_on_error=1:print_stacktrace=1:log_path={reports}/ubsan",
        "PYTHONDONTWRITEBYTECODE": "1",
        "ATTNEXT_CACHE_DIR": str(tmp_path / "kernel-cache"),
        # the processes the tests start (from tests/, say) import the sanitized copy too, never
        # an installed attnext
        "PYTHONPATH": os.pathsep.join([str(run)] + [p for p in env.get("PYTHONPATH", "").split(
            os.pathsep) if p]),
    })
    # the child must import the sanitized copy, not the in-place build
    check = textwrap.dedent(f"""
        import attnext, attnext._C
        assert attnext._C.__file__ == {str(so_path)!r}, attnext._C.__file__
    """)
    r = subprocess.run([sys.executable, "-c", check], cwd=run, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    tests = os.environ.get("ATTNEXT_SANITIZE_TESTS", " ".join(DEFAULT_TESTS)).split()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", DESELECT,
           *tests]
    r = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=1800)
    found = sorted(reports.iterdir())
    text = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[:4000]}" for p in found)
    print(r.stdout.splitlines()[-1] if r.stdout else "", f"; {len(found)} sanitizer reports")
    assert not found, f"sanitizer reports:\n{text}"
    assert r.returncode == 0, f"the sanitized run failed:\n{r.stdout[-5000:]}\n{r.stderr[-3000:]}"
    assert " passed" in r.stdout and "runtime error:" not in r.stderr + r.stdout
