"""Every ATTNEXT_* environment variable, in one table, and the one way attnext reads them.

    from attnext import _env
    _env.get("ATTNEXT_DEVICE")          # the variable's text, or None where it is unset
    _env.values(select.FWD_KNOBS)       # several at once, as a tuple (a plan's key)
    _env.reload()                       # after a change to os.environ
    _env.setenv("ATTNEXT_BWD_DQ", "atomic")  # os.environ and attnext's copy at once (None: unset)

Read once. The runtime settings (kinds PUBLIC and LAB) are read from os.environ when attnext is
imported and kept in a dict; every read after that is a dict lookup (~0.1 us, against ~1 us for
an os.environ.get of each name: a GPU call reads eleven). A change to os.environ takes effect at
`reload()`, or at once through `setenv()`, which the kernel labs (bench/labs/) use between their
configurations; tests/conftest.py's `monkeypatch` reloads after each setenv / delenv. A few
values are read when their module loads and kept in a constant (SETTINGS[name].when == IMPORT:
the pinned-memory budgets, the kernel folder); reload() does not change those.

Kinds: PUBLIC settings are for users and stay; LAB knobs override one choice of the kernel
selection for the kernel lab and the tests (plans are keyed on their values), and may change or
go without notice; BUILD variables are read by setup.py when the extension is built; TEST
variables by the test suite. C reads two itself (ATTNEXT_SIMD, ATTNEXT_LIBCUDA: `getenv` in
csrc/), which `reload()` cannot change either. `_env.markdown()` is the table as Markdown.

No other module of attnext reads an ATTNEXT_* variable (tests/unit/test_env.py holds that, and that
every variable named anywhere in the repository is in the table).
"""
import dataclasses
import os

PUBLIC, LAB, BUILD, TEST = "public", "lab", "build", "test"
CALL, IMPORT, C = "call", "import", "C"        # when attnext uses the value: see Setting.when


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """One variable. type: what its text means; default: what unset means (as text); when: CALL
    (looked up at each use, from the copy reload() refreshes), IMPORT (kept in a module constant
    when that module loads), C (read by the extension with getenv)."""
    name: str
    type: str
    default: str
    kind: str
    when: str
    doc: str


_TILE = "ints, comma-separated"
SETTINGS = {s.name: s for s in [
    # --- public
    Setting("ATTNEXT_DEVICE", "cpu | cuda | reference", "the GPU when usable, else the CPU", PUBLIC, CALL,
            "the backend of a call with device=None on host arrays"),
    Setting("ATTNEXT_NUM_THREADS", "int in [1, 1024]", "OpenMP's default", PUBLIC, CALL,
            "threads of the CPU backend"),
    Setting("ATTNEXT_CACHE_DIR", "path; '', 0 or off: no disk cache",
            "$XDG_CACHE_HOME/attnext, else ~/.cache/attnext", PUBLIC, CALL,
            "the compiled-kernel cache's folder (read when the cache is made; attnext trusts only "
            "a folder the user owns and no one else may write: attnext/cuda/cache.py)"),
    Setting("ATTNEXT_DEBUG", "flag: 1 on; '', 0, off: off", "off", PUBLIC, CALL,
            "print each kernel's generated source, options and NVRTC log to stderr when compiled"),
    Setting("ATTNEXT_NVRTC", "path to libnvrtc.so or its folder", "the pip wheels, CUDA_HOME, "
            "/usr/local/cuda, the sonames", PUBLIC, CALL, "the NVRTC library tried first"),
    Setting("ATTNEXT_LIBCUDA", "path or soname", "libcuda.so.1", PUBLIC, C,
            "the CUDA driver library (csrc/cuda_driver.c; the tests' fake driver)"),
    Setting("ATTNEXT_SIMD", "portable | avx2 | avx512 (x86); portable | neon (aarch64)",
            "the best the CPU runs", PUBLIC, C,
            "caps the CPU backend's SIMD variant (csrc/cpu/simd.c; checked at import)"),
    Setting("ATTNEXT_STAGING", "register | ring", "register", PUBLIC, CALL,
            "how a NumPy call's arrays reach the GPU: pinned in place, or copied through rings"),
    Setting("ATTNEXT_COMPILE_AHEAD", "1 always; 0, off, false, no: never", "where cores are free",
            PUBLIC, CALL, "a forward with mods that returns lse compiles its backward's kernels "
            "in the background, and a score_mod forward its 128-key tile"),
    Setting("ATTNEXT_PIN_KEEP_BYTES", "bytes", "min(8 GiB, memory / 8)", PUBLIC, IMPORT,
            "host memory whose page-locked registrations are kept between NumPy calls"),
    Setting("ATTNEXT_PINNED_RESULTS_BYTES", "bytes", "min(8 GiB, memory / 8)", PUBLIC, IMPORT,
            "pooled pinned NumPy results alive at once, at most"),
    Setting("ATTNEXT_POOL_KEEP_BYTES", "bytes", str(1 << 30), PUBLIC, IMPORT,
            "freed device memory the CUDA pool keeps reserved at a synchronisation"),
    # --- the kernel lab's knobs (attnext/cuda/select.py)
    Setting("ATTNEXT_TILE_FWD", _TILE, "select.tile_config", LAB, CALL,
            "attn_fwd.cu's tile: BLOCK_M,BLOCK_N,NUM_WARPS"),
    Setting("ATTNEXT_TILE_DECODE", _TILE, "select.DECODE_TILE", LAB, CALL,
            "attn_fwd.cu's tile for decode calls: BLOCK_M,BLOCK_N,NUM_WARPS"),
    Setting("ATTNEXT_DECODE_CTAS", "int", "select.DECODE_CTAS_PER_SM", LAB, CALL,
            "CTAs per SM the split-KV forward's grid aims at"),
    Setting("ATTNEXT_DECODE_TMA", "0 | 1", "1", LAB, CALL,
            "0 keeps Hopper's decode on attn_fwd.cu's cp.async loads (no TMA_KV producer warp)"),
    Setting("ATTNEXT_DECODE_COMBINE", "kernel | split", "split", LAB, CALL,
            "kernel: the split-KV forward's partials merged by attn_fwd_combine, not by its last CTAs"),
    Setting("ATTNEXT_REPEAT", "0 | 1", "1", LAB, CALL,
            "0: every attention() call takes the whole path (no replay of a repeated GPU call's "
            "launches: attnext/cuda/repeat.py)"),
    Setting("ATTNEXT_DEPENDENT_LAUNCH", "0 | 1", "1", LAB, CALL,
            "0: kernels that may start under the kernel before them (nvrtc.DEPENDENT_KERNELS: "
            "attn_fwd_combine) are launched as ordinary kernels"),
    Setting("ATTNEXT_TILE_DECODE_TMA", _TILE, "select.DECODE_TMA_TILE", LAB, CALL,
            "attn_fwd.cu's TMA_KV decode tile: BLOCK_M,BLOCK_N,NUM_WARPS[,STAGES]"),
    Setting("ATTNEXT_FWD_SM90", "0 | 1", "1", LAB, CALL,
            "0 keeps Hopper's forward on attn_fwd.cu (no wgmma kernel)"),
    Setting("ATTNEXT_FWD_F32_SM90", "0 | 1", "select.fwd_f32_sm90 (three passes, D = Dv in {64, 128})", LAB, CALL,
            "whether Hopper's float32 forward runs attn_fwd_sm90_f32.cu (TF32 wgmma) wherever it applies "
            "(1) or nowhere (0)"),
    Setting("ATTNEXT_TILE_F32_SM90", _TILE, "select.SM90_TILE_F32", LAB, CALL,
            "attn_fwd_sm90_f32.cu's tile: BLOCK_M,BLOCK_N,WARPS,STAGES[,K_STAGES] (8 warps: one "
            "splitter warpgroup, 12: two; K_STAGES: K's slots, STAGES when not given)"),
    Setting("ATTNEXT_FWD_PERSIST", "0 | 1", "select.fwd_persist (short rows)", LAB, CALL,
            "whether the WS forward of a dense batch runs as a persistent grid (1) or a CTA a "
            "query tile (0)"),
    Setting("ATTNEXT_FWD_CLUSTER", "0 | 1", "select.fwd_cluster (D = 128 plain calls)", LAB, CALL,
            "whether the WS forward runs its CTAs in pairs that share each K / V tile's copy (1) "
            "or alone (0), wherever a call allows it"),
    Setting("ATTNEXT_FWD_TMA_STORE", "0 | 1", "1", LAB, CALL,
            "0: the persistent WS forward's O leaves by the computing threads' stores, not by "
            "bulk tensor copies (the lab's comparison)"),
    Setting("ATTNEXT_TILE_SM90", _TILE, "select.fwd_kernel", LAB, CALL,
            "attn_fwd_sm90.cu's tile: BLOCK_M,BLOCK_N,WARPS"),
    Setting("ATTNEXT_FWD_WS", "0 | 1", "1", LAB, CALL,
            "0 keeps Hopper's forward on attn_fwd_sm90.cu's two-warpgroup kernel (no WS)"),
    Setting("ATTNEXT_TILE_FWD_WS", _TILE, "select.fwd_ws_tile", LAB, CALL,
            "attn_fwd_sm90.cu's WS tile: BLOCK_M,BLOCK_N,WARPS,STAGES"),
    Setting("ATTNEXT_TILE_BWD", _TILE, "select.bwd_tile_config", LAB, CALL,
            "attn_bwd.cu's tile (8 ints, select.py names them)"),
    Setting("ATTNEXT_BWD_SM90", "0 | 1", "1", LAB, CALL,
            "0 keeps Hopper's backward on attn_bwd.cu"),
    Setting("ATTNEXT_BWD_TMA", "0 | 1", "1", LAB, CALL,
            "0 keeps the Hopper backward's Q and dO on its producer's cp.async loads (no tensor maps)"),
    Setting("ATTNEXT_TILE_BWD_SM90", _TILE, "select.bwd_sm90_tile", LAB, CALL,
            "attn_bwd_sm90.cu's tile: KV,Q[,KV_MINB,Q_MINB] warps"),
    Setting("ATTNEXT_BWD_F32_PRESPLIT", "0 | 1", "three passes (select.bwd_f32_presplit)", LAB, CALL,
            "whether float32's backward on attn_bwd.cu splits each shared tile into its TF32 parts once (1) "
            "or in every warp at each use (0)"),
    Setting("ATTNEXT_BWD_F32_X3", "0 | 1", "1", LAB, CALL,
            "0 leaves float32's backward on Hopper as bfloat16 planes on wgmma (attn_bwd_sm90_x3.cu, the "
            "default where it applies: select.bwd_f32_x3) for attn_bwd.cu's split TF32"),
    Setting("ATTNEXT_BWD_TF32_F16", "0 | 1", "1", LAB, CALL,
            "0 leaves precision=\"tf32\"'s float32 backward on Hopper on bfloat16 planes (attn_bwd_sm90_x3.cu) "
            "instead of float16 products of copies scaled by powers of two (select.bwd_tf32_f16)"),
    Setting("ATTNEXT_FWD_TF32_F16", "0 | 1", "1", LAB, CALL,
            "0 leaves precision=\"tf32\"'s float32 forward on Hopper on attn_fwd.cu's single-pass TF32 "
            "instead of float16 products of copies scaled by powers of two (select.fwd_tf32_f16)"),
    Setting("ATTNEXT_BWD_X3_KV_WARPS", "4 | 8", "select.bwd_x3_kv_warps", LAB, CALL,
            "attn_bwd_dkdv_x3's warps: one warpgroup for every product, or two (dV's and dK's)"),
    Setting("ATTNEXT_BWD_X3_DQ", "recompute | adds", "adds (D = 128)", LAB, CALL,
            "attn_bwd_sm90_x3.cu's dQ: its dQ kernel, or (adds, at D = 128) added by its dK/dV kernel, in "
            "the key blocks' turns where deterministic"),
    Setting("ATTNEXT_BWD_DQ", "recompute | ordered | atomic", "select.bwd_dq_mode", LAB, CALL,
            "how the backward sums dQ"),
    Setting("ATTNEXT_BWD_DQ_WRITE", "0 | 1", "by the key count", LAB, CALL,
            "whether the last turn writes dq (1) or attn_bwd_dq_convert does (0)"),
    Setting("ATTNEXT_BWD_DQ_CHAINS", "1 | 2 | 4 | .. | 32", "select.bwd_dq_chains", LAB, CALL,
            "the ordered dQ turns' chains (each its own copy of dq_accum)"),
    Setting("ATTNEXT_TILE_SUMS", "0 | 1", "1", LAB, CALL,
            "0 sends every captured-array adjoint straight to the accumulator (no per-tile sums)"),
    Setting("ATTNEXT_KERNEL_DIR", "path", "attnext/_kernels", LAB, IMPORT,
            "another copy of kernels/ (an old version timed beside the new)"),
    # --- setup.py
    Setting("ATTNEXT_NO_OPENMP", "1", "OpenMP where the compiler has it", BUILD, IMPORT,
            "1 builds the CPU backend without OpenMP"),
    Setting("ATTNEXT_SANITIZE", "1", "off", BUILD, IMPORT,
            "1 builds with -fsanitize=address,undefined (tests/cpu/test_sanitizers.py)"),
    # --- tests/
    Setting("ATTNEXT_TEST_DEVICE", "cpu | cuda", "cpu", TEST, IMPORT,
            "the backend the CPU suite runs on (tests/conftest.py)"),
    Setting("ATTNEXT_TEST_PRECISION", "tf32", "unset", TEST, IMPORT,
            "tf32 runs the suite's float32 calls with precision='tf32', held to float16's rule "
            "(tests/conftest.py)"),
    Setting("ATTNEXT_TEST_EXPECT_SIMD", "portable | avx2 | avx512 | neon", "unset", TEST, CALL,
            "the SIMD variant a child run of the tests must report "
            "(tests/cpu/test_cpu_attention.py)"),
    Setting("ATTNEXT_REQUIRE_AARCH64", "1", "unset", TEST, CALL,
            "1 (.ci/run) fails tests/unit/test_simd_native.py's aarch64 leg where its cross "
            "compiler or qemu is missing, instead of skipping it"),
    Setting("ATTNEXT_NO_NVRTC", "1", "unset", TEST, CALL,
            "1 skips the tests that need NVRTC on a machine without it"),
    Setting("ATTNEXT_FUZZ_SECONDS", "float", "100", TEST, IMPORT,
            "the differential fuzzer's budget in tests/cpu/test_fuzz.py"),
    Setting("ATTNEXT_FUZZ_SEED", "int", "0", TEST, IMPORT, "the fuzzer's hypothesis seed"),
    Setting("ATTNEXT_TEST_SEED", "int", "0", TEST, IMPORT,
            "mixed into every test's seed (tests/conftest.py's seed_of) where not 0: the suite on "
            "other random data, to find tests that pass on their own data alone"),
    Setting("ATTNEXT_SANITIZE_TESTS", "test paths, space-separated", "a subset", TEST, CALL,
            "what tests/cpu/test_sanitizers.py runs under the sanitizers ('tests': all)"),
    Setting("ATTNEXT_SANITIZED_CHILD", "1", "unset", TEST, CALL,
            "marks tests/cpu/test_sanitizers.py's child run"),
]}
RUNTIME = tuple(n for n, s in SETTINGS.items() if s.kind in (PUBLIC, LAB))

_values = {}      # name -> text or None: os.environ's, at import or the last reload()
_tuples = {}      # names -> values(names), until the next reload()
_generation = 0   # reload()s so far


def reload():
    """Reads every runtime setting from os.environ again (a test or lab that changed it)."""
    global _values, _tuples, _generation
    _values = {n: os.environ.get(n) for n in RUNTIME}
    _tuples = {}
    _generation += 1


def generation():
    """How many times the settings were read: what was decided under one generation's settings
    (cuda/repeat.py's recipes) holds until the next."""
    return _generation


def get(name):
    """The text of runtime setting `name` (None where unset), as of import or reload().
    KeyError for a name the table does not hold as PUBLIC or LAB."""
    return _values[name]


def values(names):
    """(get(n) for n in names) as a tuple; names: a tuple, its answer remembered until reload()."""
    try:
        return _tuples[names]
    except KeyError:
        got = _tuples[names] = tuple([_values[n] for n in names])
        return got


def setenv(name, value):
    """os.environ[name] = value (None: removed), and attnext's copy with it."""
    if name not in _values:
        raise KeyError(f"{name} is not a runtime setting of attnext._env.SETTINGS")
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    reload()


def nbytes(name, default):
    """The byte count setting `name` holds (default when unset or empty); ValueError naming it
    for anything but a non-negative integer."""
    text = (get(name) or "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a number of bytes (a non-negative integer), got {text!r}")
    return value


def markdown(kinds=(PUBLIC, LAB, BUILD, TEST)):
    """The table as Markdown: name, kind, type, default, when read, what it does."""
    rows = ["| variable | kind | type | default | read | what it does |",
            "| --- | --- | --- | --- | --- | --- |"]
    for s in SETTINGS.values():
        if s.kind in kinds:
            cells = [f"`{s.name}`", s.kind, s.type, s.default, s.when, s.doc]
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


reload()