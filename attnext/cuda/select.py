"""Which kernel a call runs and how it is specialised: tiles, kernel choice, #defines, shared
memory, and the variants warmup compiles.

One source per kernel (kernels/attn_fwd.cu, ...), specialised by #defines at NVRTC time: each
choice is made in one function here (tile_config, fwd_kernel, bwd_dq_mode, ...) and turned into
the defines of one variant (fwd_defines, bwd_defines). A score_mod / mask_mod variant adds the
switches of mod_defines; nvrtc.py compiles and loads what this module names.
"""
import itertools

import numpy as np

from .. import _env
from .._layout import DTYPE_CODES
from ..mods import codegen

# the widest tile edge of any kernel: a branch-free tile evaluates score_mod and mask_mod at
# every pair it covers, up to this far past a sequence's end (the results discarded there)
TILE_EDGE = 128
# every architecture CI compiles for (warmup --check) and the ones attnext targets
ARCHS = ("sm_80", "sm_90a")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}     # q, k, v's bytes per element
MAX_SMEM_SM80 = 163 * 1024


# The kernel lab's overrides of the choices below (attnext._env's LAB settings), read when a
# choice is made; backend's plans are keyed on their values (knobs()), so a change through
# _env.setenv() or _env.reload() takes effect at the next call.
FWD_KNOBS = ("ATTNEXT_TILE_FWD", "ATTNEXT_TILE_DECODE", "ATTNEXT_DECODE_CTAS", "ATTNEXT_FWD_SM90",
             "ATTNEXT_TILE_SM90", "ATTNEXT_DECODE_TMA", "ATTNEXT_TILE_DECODE_TMA", "ATTNEXT_FWD_WS",
             "ATTNEXT_TILE_FWD_WS", "ATTNEXT_DECODE_COMBINE", "ATTNEXT_DEPENDENT_LAUNCH", "ATTNEXT_FWD_PERSIST",
             "ATTNEXT_FWD_F32_SM90", "ATTNEXT_FWD_TF32_F16", "ATTNEXT_FWD_TMA_STORE", "ATTNEXT_FWD_CLUSTER")
BWD_KNOBS = ("ATTNEXT_TILE_BWD", "ATTNEXT_BWD_SM90", "ATTNEXT_TILE_BWD_SM90", "ATTNEXT_BWD_TMA", "ATTNEXT_BWD_DQ",
             "ATTNEXT_BWD_DQ_WRITE", "ATTNEXT_BWD_DQ_CHAINS", "ATTNEXT_TILE_SUMS", "ATTNEXT_BWD_F32_PRESPLIT",
             "ATTNEXT_BWD_F32_X3", "ATTNEXT_BWD_X3_KV_WARPS",
             "ATTNEXT_BWD_X3_DQ", "ATTNEXT_BWD_TF32_F16")


def knobs(names):
    """The values of these environment variables (None where unset), cheaply: on every call
    (attnext._env's copy, a tuple remembered per names until _env.reload())."""
    return _env.values(names)


def _lab_tile(name):
    """The kernel lab's tile override in setting `name` ("128,64,8": comma-separated ints) as a
    tuple, or None when unset."""
    env = _env.get(name)
    return tuple(int(x) for x in env.split(",")) if env else None


def _round_up(x, m):
    return (x + m - 1) // m * m


def tile_config(D, Dv, dtype="bfloat16"):
    """(BLOCK_M, BLOCK_N, NUM_WARPS) of the forward for head dims D, Dv: the one place that
    chooses. Register budget (255 per thread, measured with -Xptxas -v): O holds
    BLOCK_M / NUM_WARPS * Dv floats per warp row group, S BLOCK_M / NUM_WARPS * BLOCK_N.
    float32 tiles take twice the shared memory: past D = 128, 64 x 32."""
    lab = _lab_tile("ATTNEXT_TILE_FWD")      # the kernel lab's override: "128,64,8"
    if lab:
        m, n, w = lab
        return m, n, w
    dvp = _round_up(Dv, 16)
    if dtype == "float32":     # H200, bench/labs/lab_f32.py (TFLOP/s at D64 / D128, S4k):
        if max(_round_up(D, 16), dvp) > 128:
            return 64, 32, 4
        return 128, 32, 4      # 58 / 56 (128x64x4: 58 / 40, 64x64x4: 52 / 48, 128x64x8: 50 / 49)
    if dvp <= 64:
        return 128, 64, 4      # H100 bf16 S=2k: 259 TFLOP/s (128x32: 249, 64x64: 227)
    if dvp <= 128:
        return 128, 32, 4      # 276 (128x64x4: 268, spills 44 B; 64x64: 244)
    return 128, 64, 8          # 201 (128x128x8: 186, 64x64: 172)


DECODE_TILE = (64, 64, 4)    # packed-GQA / split-KV forward: few query rows, K and V streamed
# the same on Hopper (TMA_KV): 16 packed rows, one consumer warp beside the producer warp, 64
# keys a stage, 3 stages in flight (two CTAs an SM share its shared memory)
DECODE_TMA_TILE = (16, 64, 1, 3)
DECODE_PACK_ROWS = 128       # a call packs its GQA heads into one block's rows up to Sq * group rows
DECODE_CTAS_PER_SM = 2       # the split-KV grid aims at this many CTAs per SM
SM90_SHARED_BYTES = 233472   # Hopper's shared memory an SM (each CTA's share: its own + 1 KiB)


def decode_tile(D=0, Dv=0, dtype="bfloat16"):
    """attn_fwd.cu's tile for decode calls (float32 past D = 128: 64 x 32, for shared memory);
    the kernel lab's override: ATTNEXT_TILE_DECODE="16,64,1"."""
    lab = _lab_tile("ATTNEXT_TILE_DECODE")
    if lab:
        return lab
    if dtype == "float32" and max(D, Dv) > 128:
        return 64, 32, 4
    return DECODE_TILE


def decode_tma(arch, D, Dv, vec, dtype, key_rows, page_size=0):
    """Whether a decode forward runs attn_fwd.cu's TMA_KV variant: Hopper with a driver that
    makes tensor maps, 16-bit elements, 16-byte-loadable rows of D, Dv in {64, 128}, and for a
    paged cache pages a whole number of tiles, or tiles a whole number of pages of 16 rows or
    more (a page a copy), else a k tensor of at least a tile's rows (key_rows: a copy's box is
    a whole tile, the bytes its stage's barrier waits for; a smaller box never completes it);
    ATTNEXT_DECODE_TMA=0 says no (the lab's comparison)."""
    bn = decode_tma_tile()[1]
    pages_fit = (page_size % bn == 0 or (page_size >= 16 and bn % page_size == 0)) if page_size else key_rows >= bn
    if not (arch == "sm_90a" and vec and D in (64, 128) and Dv in (64, 128) and dtype != "float32"
            and pages_fit and (_env.get("ATTNEXT_DECODE_TMA") or "1") != "0"):
        return False
    from .. import _C
    return _C.cuda_tensor_maps()


def decode_tma_tile():
    """(BLOCK_M, BLOCK_N, NUM_WARPS, STAGES) of TMA_KV; the lab's ATTNEXT_TILE_DECODE_TMA."""
    return _lab_tile("ATTNEXT_TILE_DECODE_TMA") or DECODE_TMA_TILE


def decode_ctas_per_sm(tma_smem=0):
    """The CTAs an SM the split-KV grid aims at: under TMA_KV (tma_smem: its shared memory) as
    many as its ring lets share an SM, up to 4; else DECODE_CTAS_PER_SM. The lab's
    ATTNEXT_DECODE_CTAS."""
    env = _env.get("ATTNEXT_DECODE_CTAS")
    if env:
        return int(env)
    if tma_smem:
        return max(1, min(4, SM90_SHARED_BYTES // (tma_smem + 1024)))
    return DECODE_CTAS_PER_SM


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
# attn_fwd_sm90.cu's WS kernel: 128 x 128, two computing warpgroups (8 warps) beside the producer,
# STAGES key tiles of K and of V in flight
SM90_TILE_WS = (128, 128, 8, 2)
# ... and at D = 64 for plain calls (no causal mask, window, bias, mask, ALiBi, softcap or
# score_mod / mask_mod; what was measured, and what keeps 160 registers to ~150 B of spills): 192 x 128,
# three computing warpgroups (160 registers each), so that a warpgroup's softmax, which at D = 64
# outlasts one warpgroup's products, runs under two others' (H200, session 37, against
# SM90_TILE_WS: full rows +3-6%, S16k 417 -> 443 TFLOP/s; causal rows 1-9% slower, their
# diagonal tiles half again as wide: kept on SM90_TILE_WS). Since forward v18 (causal tiles longest
# first) a causal mask alone takes it too past CAUSAL_WS3_ROWS query rows (H200, session 43,
# alternated twice, against SM90_TILE_WS: B2 S8k 417 -> 440, B1 S16k 439 -> 467 TFLOP/s, +5-6.5%;
# S4k 377 -> 380; S2k 326 -> 311, where the persistent grid of SM90_TILE_WS leads)
# At WS3_ROWS query rows and under it is no better than the persistent grid of SM90_TILE_WS (H200,
# session 76, lab_fwd_ab alternated twice, cuDNN beside; TFLOP/s, 192-row tile / SM90_TILE_WS:
# B64 S256 178 / 298, B32 S512 304 / 353, B16 S1k 406-410 / 415-417), whose 512-row call is 4 tiles
SM90_TILE_WS3 = (192, 128, 12, 2)
WS3_ROWS = 1024
CAUSAL_WS3_ROWS = 2048
# ... and at D = 128 for plain calls (no causal mask, window, score options or score_mod /
# mask_mod) over keys of at least WIDE_KEYS rows (the longest key sequence's) that the persistent
# grid does not take: 176 keys a tile (wgmma m64n176; FlashAttention-3's hdim-128 tile), so a key
# tile's barriers, row maxima and turns serve 176 keys where they served 128. H200 (session 57,
# separate processes alternated twice, cuDNN beside; TFLOP/s): S8k 601.6 / 602.9 -> 606.7 / 606.6,
# S16k 609.5 / 614.5 -> 615.5 / 615.0 (+0.5-0.8%); S4k 0.7% and S2k 2.5% slower, S8k causal 0.5%
# slower (those keep 128); 192 keys a tile within 0.5% of 176.
SM90_TILE_WS_WIDE = (128, 176, 8, 2)
WIDE_KEYS = 8192
# ... and with a score_mod: 64 keys a tile, as SM90_TILE_MODS and for its
# reason, the first call's compile (NVRTC 13.x on the dev machine, softcap, D128: 1.44 s at 128 x
# 128 against 1.13 s here and 0.91 s for SM90_TILE_MODS' kernel)
SM90_TILE_WS_MODS = (128, 64, 8, 2)
# A score_mod that loads from no array per score (arithmetic, or lookups by b and h alone) runs
# faster on SM90_TILE_WS (H200, session 34, B2 S8k H16 D128 causal, one run against Flex: ALiBi
# 1.09x -> 1.18x, ALiBi[h] 1.08x -> 1.23x, softcap 1.49x -> 1.56x) but compiles longer (cold first
# forward 2.14-2.37 s against 1.23-1.34 s, over the 2 s bound): its first calls run
# SM90_TILE_WS_MODS while the wide tile compiles in the background, and the calls after that
# compile, or in a process whose disk cache holds it, run the wide one (cuda/backend.py:
# _Plan.upgrade). A score_mod with per-score loads keeps 64 keys (their registers).


def fwd_ws_tile(score_mod=False, wide=False, ws3=False, wide_keys=False):
    """(BLOCK_M, BLOCK_N, computing warps, STAGES) of the WS forward (score_mod: a call with one;
    wide: the wide tile of a score_mod without per-score loads, SM90_TILE_WS; ws3: fwd_ws3's call,
    SM90_TILE_WS3; wide_keys: fwd_wide_keys' call, SM90_TILE_WS_WIDE); the lab's
    ATTNEXT_TILE_FWD_WS fixes it."""
    lab = _lab_tile("ATTNEXT_TILE_FWD_WS")
    if lab:
        return lab
    if score_mod:
        return SM90_TILE_WS if wide else SM90_TILE_WS_MODS
    return SM90_TILE_WS3 if ws3 else SM90_TILE_WS_WIDE if wide_keys else SM90_TILE_WS


def fwd_ws3(D, rows, causal, window, options, mods):
    """Whether a WS forward takes SM90_TILE_WS3: D = 64 without generated mods (mods: a
    codegen.Generated or None), window or score options (score_options'), past WS3_ROWS query rows
    (rows: the longest sequence's) with no causal mask, or past CAUSAL_WS3_ROWS with one."""
    return (D == 64 and mods is None and not window and not options
            and rows > (CAUSAL_WS3_ROWS if causal else WS3_ROWS))


def fwd_wide_keys(D, q_tiles, key_rows, causal, window, options, mods):
    """Whether a WS forward takes SM90_TILE_WS_WIDE: D = 128 without a causal mask, window, score
    options (score_options') or generated mods (codegen.Generated or None), over at least
    WIDE_KEYS key rows (key_rows: the longest key sequence's), with more than PERSIST_TILES query
    tiles (q_tiles: the longest sequence's at 128 rows), which the persistent grid leaves to a CTA
    a tile."""
    return (D == 128 and not causal and not window and not options and mods is None
            and key_rows >= WIDE_KEYS and q_tiles > PERSIST_TILES)


def has_score_mod(mods):
    """Whether generated mods (codegen.Generated or None) hold a score_mod."""
    return mods is not None and bool(mods.defines.get("HAS_SCORE_MOD"))


def fwd_ws_widens(mods):
    """Whether a WS forward with these generated mods (codegen.Generated or None) has a wider
    tile to move to once compiled: a score_mod without per-score loads (SM90_TILE_WS_MODS ->
    SM90_TILE_WS), unless ATTNEXT_TILE_FWD_WS fixes the tile."""
    return has_score_mod(mods) and not mods.pair_loads and fwd_ws_tile(True) != fwd_ws_tile(True, True)


# The WS kernel at every length since session 76: the short rows (SM90_SHORT_ROWS and under) had
# kept the two-warpgroup kernel since session 30, before the persistent grid and the lazy maxima.
# H200, lab_fwd_ab alternated twice, cuDNN beside, TFLOP/s two-warpgroup / WS (16k tokens a row):
# D128 S256 258 / 412-413, S512 324-332 / 510-512, S1k 370-371 / 587-589, S512 causal 236-237 /
# 318-319, S1k causal 305-306 / 444; D64 S256 227-228 / 300-301, S512 287 / 366, S1k 315-319 /
# 410-415, S512 causal 203-204 / 229, S1k causal 259-260 / 310-311 (0.62-0.79x cuDNN -> 0.89-1.07x).
# But at D = 64 a softcap or a score_mod over SM90_SHORT_ROWS rows and under runs faster on the
# two-warpgroup kernel's one-warpgroup tile, two CTAs an SM (H200, one run a side, us: B16 S1k H32
# softcap 526 / 576, causal softcap score_mod 339 / 423; D128 S512's 229 / 208 and 341 / 222, and
# D64's bias 1152 / 973 and window 171 / 165 gain from WS): those keep it
def fwd_ws(arch, D, Dv, vec, rows, key_rows, dtype="bfloat16", copyable=False, tensor_maps=None,
           softcap=False, mods=None):
    """Whether a (non-decode) forward runs attn_fwd_sm90.cu's warp-specialised kernel (WS): D = Dv
    in {64, 128}, with or without a score_mod / mask_mod, over keys a bulk copy can read
    (copyable: no page table or zero stride; varlen and seqused_k keys have rows past Lk inside
    the tensor, whose V rows the kernel zeroes), in a tensor of at least a tile's rows (key_rows:
    a copy's box is a whole tile), and a driver that makes tensor maps (tensor_maps: None asks
    this process's driver; the compile lab, with none, says True); not at D = 64 where a call of
    SM90_SHORT_ROWS query rows or under (rows: the longest sequence's) has a softcap or a
    score_mod (mods: codegen.Generated or None). ATTNEXT_FWD_WS=0 says no (the lab's comparisons)."""
    if not (arch == "sm_90a" and vec and D == Dv and D in (64, 128) and dtype != "float32"
            and copyable and key_rows >= fwd_ws_tile()[1]
            and not (D == 64 and rows <= SM90_SHORT_ROWS and (softcap or has_score_mod(mods)))
            and (_env.get("ATTNEXT_FWD_WS") or "1") != "0" and (_env.get("ATTNEXT_FWD_SM90") or "1") != "0"):
        return False
    if tensor_maps is not None:
        return tensor_maps
    from .. import _C
    return _C.cuda_tensor_maps()


# The persistent WS forward by default: calls of at most this many query tiles a (sequence, head)
# on the two-warpgroup tile, where a CTA a tile leaves each tile's start and end exposed. H200
# (session 41, alternated twice in one process, the same bits): S2k causal D64 +4%, D128 +3.5%,
# S2k full D128 +1.5%; S4k within 1% either way, S8k-16k 0-2% slower; the three-warpgroup D64
# tile (plain calls) 1.5% slower at S2k (bench/NOTES.md, forward).
PERSIST_TILES = 16
# ... and with a causal mask, calls of at most this many: H200 (session 56, separate processes
# alternated twice, cuDNN beside): D128 S4k causal 518.8 / 518.1 -> 532.2 / 532.2 TFLOP/s (+2.7%;
# the triangle's long and short tiles even out over a CTA's turns), S8k 561 / 562 -> 566 / 559 and
# S16k 594 / 588 -> 589 / 589 (even). Unmasked S4k D128 stays within 1% either way.
PERSIST_TILES_CAUSAL = 32


def score_options(features):
    """Whether a call's features (backend._common's) carry a score option: softcap, a bias, a mask
    array or ALiBi."""
    return bool(features["softcap"] or features["bias_dtype"] or features["alibi_dtype"] or features["mask"])


def fwd_persist(dense, q_tiles, options, tile, mods=None, causal=False):
    """Whether the WS forward runs as a persistent grid (PERSIST: a CTA an SM taking query tiles in
    turn, each tile's Q by the producer's bulk tensor copies): for dense batches (no cu_seqlens or
    seqused: every query row such a copy brings is the call's, or past the tensor and zero) without
    generated mods (a mask_mod narrows each tile's key range by whole warps, which the producer's
    one thread cannot); by default for calls of at most PERSIST_TILES query tiles (q_tiles, the
    longest sequence's; PERSIST_TILES_CAUSAL with a causal mask) of the two-warpgroup tile (tile:
    the WS tile chosen) without score options (options: score_options', whose variants warmup
    compiles for a CTA a tile alone).
    ATTNEXT_FWD_PERSIST=0 / 1 decides for the lab and the tests wherever a dense batch without
    mods allows it."""
    if not dense or mods is not None:
        return False
    env = _env.get("ATTNEXT_FWD_PERSIST")
    if env in ("0", "1"):
        return env == "1"
    most = PERSIST_TILES_CAUSAL if causal else PERSIST_TILES
    return q_tiles <= most and not options and tuple(tile) == tuple(SM90_TILE_WS)


# ... and its tile at D = 64: SM90_TILE_WS with three stages of K and V. A D = 64 key tile's K and V
# (32 KB) land ~1.0-1.5 us after their copies are issued, about a key tile's time there (1.34 us,
# B8 S2k causal), so two stages leave a tile's last V and the next tile's Q late (H200, session 55,
# lab stamps: 0.7 us waiting for Q, 1.5 us from the key loop's end to O stored). Alternated twice,
# D64 S2k causal 325 -> 337-339 TFLOP/s (+4%; four stages 328); the CTA-a-tile grid gains nothing
# from the third stage (305-307 either way), so only the persistent grid takes it.
SM90_TILE_WS_PERSIST64 = (128, 128, 8, 3)


def fwd_persist_tile(D, tile):
    """The tile a persistent WS forward runs, given the WS tile chosen: SM90_TILE_WS_PERSIST64 at
    D = 64 where that is SM90_TILE_WS (the lab's ATTNEXT_TILE_FWD_WS keeps its own)."""
    if D == 64 and tuple(tile) == tuple(SM90_TILE_WS) and not _lab_tile("ATTNEXT_TILE_FWD_WS"):
        return SM90_TILE_WS_PERSIST64
    return tile


# The persistent WS forward's rows a bulk copy of Q brings: a computing warpgroup's
PERSIST_Q_ROWS = 64


# The WS forward a CTA a tile in pairs of CTAs (CLUSTER = 2, each K / V tile by multicast copies
# into both: half the L2 reads) for plain D = 128 calls. H200 (session 59, separate processes
# alternated twice, cuDNN beside; TFLOP/s, alone / paired): S4k 571.5, 576.5 / 583.9, 581.0; S8k
# (176 keys) 605.2, 601.3 / 609.7, 615.4; S16k 622.9, 607.9 / 630.5, 630.5 (+1-2.5%); S2k paired a
# CTA a tile 549 against the persistent grid's 564-570 (that grid stays). Half a tile's rows a
# CTA (so D = 64 could pair) measured the same at D = 128 and 0-3% slower at D = 64 (192-row tile).
def fwd_cluster(D, q_tiles, dense, causal, window, options, mods, persist):
    """Whether a WS forward a CTA a tile runs its CTAs in pairs (CLUSTER = 2: each K / V tile read
    from L2 once a pair, a 64-column panel by each CTA's copies into both): D = 128, a dense batch
    (no cu_seqlens or seqused: both CTAs of a pair see the same keys and both have rows) with an even
    number of query tiles (q_tiles: a sequence's), no causal mask, window or mask_mod (mods: a
    codegen.Generated or None), where every query tile of a head reads the same key tiles; by
    default for plain calls (no score options or generated mods). ATTNEXT_FWD_CLUSTER=0 / 1 decides
    for the lab and the tests wherever such a call allows it."""
    if (D != 128 or persist or not dense or q_tiles % 2 or causal or window
            or (mods is not None and mods.defines.get("HAS_MASK_MOD"))):
        return False
    env = _env.get("ATTNEXT_FWD_CLUSTER")
    if env in ("0", "1"):
        return env == "1"
    return not options and mods is None


def fwd_tma_store():
    """Whether the persistent WS forward's O leaves by bulk tensor copies (out's map, made at launch
    where out's rows are 16-byte aligned), unless the lab's ATTNEXT_FWD_TMA_STORE=0 says no."""
    return (_env.get("ATTNEXT_FWD_TMA_STORE") or "1") != "0"


def fwd_kernel(arch, D, Dv, vec, decode, rows, mods=None, dtype="bfloat16", paged=False, tma=False, ws=False,
               ws3=False, tf32=False, wide_keys=False):
    """(kernel source, tile) of the forward: kernels/attn_fwd_sm90.cu (wgmma) on sm_90a for
    16-byte-loadable inputs with D, Dv in {64, 128}, else kernels/attn_fwd.cu (mma.sync, every
    shape, and the decode paths). rows: the longest query sequence; mods: the generated
    score_mod / mask_mod compiled in (codegen.Generated) or None: a score_mod takes
    SM90_TILE_MODS where its staged output fits (sm90_staged_o_fits), a mask_mod alone the
    plain tiles. ATTNEXT_FWD_SM90=0 keeps Hopper on attn_fwd.cu (the lab's and the tests'
    comparison). float32 runs attn_fwd.cu (TF32 mma.sync), or on Hopper attn_fwd_sm90_f32.cu where
    fwd_f32_sm90 says (tf32: precision="tf32"); a paged cache runs
    attn_fwd.cu (paged: its key rows are gathered through the page table, PAGED). tma
    (decode_tma): a decode takes TMA_KV's tile (4 ints: the stages last); ws (fwd_ws): the WS
    kernel's first tile (a score_mod's wide one, once compiled: fwd_ws_widens); ws3 (fwd_ws3):
    its 192-row tile; wide_keys (fwd_wide_keys): its 176-key tile."""
    if decode and tma:
        return "attn_fwd", decode_tma_tile()
    if ws and not decode:
        return "attn_fwd_sm90", fwd_ws_tile(has_score_mod(mods),
                                            ws3=ws3, wide_keys=wide_keys)
    if fwd_f32_sm90(arch, D, Dv, vec, decode, paged, dtype, tf32):
        return "attn_fwd_sm90_f32", _lab_tile("ATTNEXT_TILE_F32_SM90") or SM90_TILE_F32   # lab: "64,64,12,1"
    if (arch == "sm_90a" and not decode and not paged and vec and D in (64, 128) and Dv in (64, 128) and dtype != "float32"
            and (_env.get("ATTNEXT_FWD_SM90") or "1") != "0"):
        lab = _lab_tile("ATTNEXT_TILE_SM90")     # the kernel lab's override: "128,64,8"
        if lab:
            return "attn_fwd_sm90", lab
        short = max(D, Dv) <= 64 or rows <= SM90_SHORT_ROWS
        score_mod = has_score_mod(mods)
        if short:
            return "attn_fwd_sm90", SM90_TILE_SHORT
        mods_tile = score_mod and sm90_staged_o_fits(D, Dv, SM90_TILE_MODS)
        return "attn_fwd_sm90", SM90_TILE_MODS if mods_tile else SM90_TILE_LONG
    return "attn_fwd", decode_tile(D, Dv, dtype) if decode else tile_config(D, Dv, dtype)


# attn_fwd_sm90_f32.cu's tile: 64 query rows, 64 keys, 12 warps (two splitter warpgroups and the
# computing one; 8: one splitter), one slot each of K's and V's parts (197,672 B of shared memory
# at D128 with Q's: bench/NOTES.md, float32 forward w5)
SM90_TILE_F32 = (64, 64, 12, 1)


def fwd_f32_sm90(arch, D, Dv, vec, decode, paged, dtype, tf32=False):
    """Whether a float32 forward runs attn_fwd_sm90_f32.cu (TF32 wgmma, operands split once per
    CTA in shared memory) where it applies: sm_90a, 16-byte-loadable rows, D and Dv in {64, 128},
    no decode path or paged cache. By default three passes at D = Dv in {64, 128}, with every
    score option and the generated score_mod / mask_mod (H200, s52, w5: D128 75.1 / 69.8 TFLOP/s
    full / causal against attn_fwd.cu's 54.9 / 46.6 in s44; D64 71.5 / 68.1; softcap, ALiBi, a
    bias: 67-75 against 49-53 at D128, 55-66 against 50-55 at D64; a softcap or table score_mod
    70-73 against 47-48 at D128, a window mask_mod 286 against 185); precision="tf32" runs
    attn_fwd.cu, faster but at D128 causal (s52: 128.6 against 118.0 at D128, 128.3 against
    108.7 at D64; D128 causal 99.7 against 109.3; bench/NOTES.md, float32 forward w2-w5).
    ATTNEXT_FWD_F32_SM90=1 takes it wherever it applies, 0 nowhere (the lab's and the tests')."""
    if not (arch == "sm_90a" and dtype == "float32" and vec and not decode and not paged
            and D in (64, 128) and Dv in (64, 128) and (_env.get("ATTNEXT_FWD_SM90") or "1") != "0"):
        return False
    env = _env.get("ATTNEXT_FWD_F32_SM90")
    if env in ("0", "1"):
        return env == "1"
    return D == Dv and not tf32


def sm90_staged_o_fits(D, Dv, tile):
    """attn_fwd_sm90.cu's static_assert: the output tile staged with padded rows (Dv + 8 wide)
    fits the Q and K buffers it reuses (128 x 64 at D = 64, Dv = 128 does not)."""
    bm, bn = tile[:2]
    return bm * (Dv + 8) * 2 <= bm * D * 2 + 2 * bn * D * 2


def fwd_smem_bytes(D, Dv, tile, kernel="attn_fwd", dtype="bfloat16", tma=False, ws=False, persist=False,
                   tf32=False):
    bm, bn = tile[:2]
    if kernel == "attn_fwd_sm90_f32":  # Q's parts, then K_STAGES slots of K's parts (tile[4], else
        parts = 1 if tf32 else 2       # STAGES) and STAGES of V^T's, 1024-aligned; q_full, and full
        k_slots = tile[4] if len(tile) > 4 else tile[3]                     # and empty a slot
        return 4 * parts * (bm * D + k_slots * bn * D + tile[3] * bn * Dv) + 1024 + 8 * (1 + 2 * k_slots + 2 * tile[3])
    if ws:            # Q, K_STAGES x K (tile[4], else STAGES), STAGES x V swizzled, 1024-aligned, then
        # 2 x (K_STAGES + STAGES) + 1 mbarriers; persist: a second Q, 8 more mbarriers, then two
        k_stages = tile[4] if len(tile) > 4 else tile[3]    # 16-byte slots, 16-byte aligned
        return (2 * ((1 + persist) * bm * D + k_stages * bn * D + tile[3] * bn * Dv) + 1024
                + 16 * (k_stages + tile[3]) + 8 + persist * 104)
    if kernel == "attn_fwd_sm90":     # Q, K[2], V[2] in 128-byte swizzled rows, 1024-aligned
        return 2 * (bm * D + 2 * bn * D + 2 * bn * Dv) + 1024
    size = ITEMSIZE[dtype]
    dp, dvp, pad = _round_up(D, 16), _round_up(Dv, 16), 16 // size
    if tma:          # TMA_KV: a ring of swizzled K and V tiles, 1024-aligned, then Q padded
        return size * (tile[3] * bn * (D + Dv) + bm * (dp + pad)) + 1024
    return size * (bm * (dp + pad) + bn * (dp + pad) + bn * (dvp + pad))


def dtype_defines(dtype, tf32=False, scaled16=False):
    """The element type's switches (attn_common.cuh): ELEM_BF16, and for float32 ELEM_F32 and
    TF32_PASSES (3: split TF32 products, float32 accuracy; 1: precision="tf32"); scaled16: float16
    copies of float32 arrays, F16_SCALED (bwd_tf32_f16, fwd_tf32_f16)."""
    d = {"ELEM_BF16": int(dtype == "bfloat16")}
    if dtype == "float32":
        d.update(ELEM_F32=1, TF32_PASSES=1 if tf32 else 3)
    if scaled16:
        d["F16_SCALED"] = 1
    return d


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
# with mods takes them from the plain variant (warmup's cache), never compiles them again.
# attn_bwd_pre is not one: it recomputes the scores of rows whose lse is lost (attn_params.h: row_mz)
MOD_FREE_ENTRIES = frozenset({"attn_fwd_combine", "attn_bwd_dq_convert"})
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
                pack_gqa=False, split_kv=False, mods=None, tf32=False, paged=False, tma=False, ws=False,
                persist=False, sm90_f32=False, scaled16=False, cluster=False):
    """The #defines of one forward variant. bias_dtype / alibi_dtype: a dtype name or None;
    tf32: float32 in single-pass TF32 (precision="tf32"); paged: k and v are a paged cache.
    tile: (BLOCK_M, BLOCK_N, NUM_WARPS[, MIN_BLOCKS: CTAs per SM the registers must allow]), or
    with tma (TMA_KV: a producer warp's bulk tensor copies) or ws (attn_fwd_sm90.cu's WS kernel)
    (BLOCK_M, BLOCK_N, NUM_WARPS, STAGES), as is sm90_f32's (attn_fwd_sm90_f32.cu; with it or ws a
    fifth, the kernel lab's, K_STAGES: K's slots, STAGES when not given); persist: the WS
    kernel as a persistent grid (fwd_persist); cluster: the WS kernel's CTAs in pairs
    (fwd_cluster); scaled16: float16 copies of float32 arrays (fwd_tf32_f16: F16_SCALED). mods:
    the generated score_mod / mask_mod (codegen.Generated) or None."""
    bm, bn, w = tile[:3]
    staged = tma or ws or sm90_f32
    return mod_defines({
        "MIN_BLOCKS": 1 if staged or len(tile) < 4 else tile[3],
        **({"STAGES": tile[3]} if staged else {}),
        **({"K_STAGES": tile[4]} if (sm90_f32 or ws) and len(tile) > 4 else {}),
        **({"TMA_KV": 1} if tma else {}),
        **({"WS": 1} if ws else {}),
        **({"PERSIST": 1} if persist else {}),
        **({"CLUSTER": 2} if cluster else {}),
        "PACK_GQA": int(pack_gqa), "SPLIT_KV": int(split_kv), **dtype_defines(dtype, tf32, scaled16),
        **({"PAGED": 1} if paged else {}),
        "HEAD_DIM": D, "HEAD_DIM_V": Dv, "VEC_LOAD": int(vec),
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


def fwd_variants():
    """The forward variants warmup compiles: float16 and bfloat16 at the common head dims, each
    feature on its own, vector and element loads; float32 at D 64 and 128 (split and single-pass
    TF32) and with element loads."""
    out = []
    for dtype in ("bfloat16", "float16", "float32"):
        for D, Dv in ((64, 64), (128, 128), (256, 256), (96, 96), (192, 128), (59, 40)):
            if dtype == "float32" and (D, Dv) not in ((64, 64), (128, 128), (59, 40)):
                continue     # float32's other head dims compile at first use (its backward: ~10 s)
            chunk = 16 // ITEMSIZE[dtype]
            vec = D % chunk == 0 and Dv % chunk == 0
            base = dict(dtype=dtype, D=D, Dv=Dv, vec=vec, softcap=False, bias_dtype=None,
                        alibi_dtype=None, mask=False, tile=tile_config(D, Dv, dtype))
            if dtype == "float32":
                out.append(base)
                if (D, Dv) != (59, 40):
                    out.append({**base, "tf32": True})
                continue
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


def bwd_f32_presplit(arch, dtype, D, Dv, passes):
    """Whether float32's backward on attn_bwd.cu splits each shared tile into its TF32 parts once
    (F32_PRESPLIT: attn_bwd.cu's PRE_STREAM / PRE_FIXED) rather than in every warp at every use:
    on sm_90a (its tiles with lo planes take up to 191 KB a CTA: past sm_80's 163), up to D + Dv
    = 256 (padded; not the two-pass KV_SPLIT tiles). A split is 2-5 ALU operations an element,
    and each of the dK/dV kernel's warps split the whole Q and dO tile twice an item, each of the
    dQ kernel's the whole K and V tile. In the SASS (sm_90a, bench/labs/lab_sass.py: the products'
    loop, instructions a product): dK/dV D128 7.8 -> 5.9 (three passes; the 8-warp tile), 11.2 ->
    9.6 (one), D64 6.1 -> 5.1 / 8.6 -> 6.9; dQ D128 7.4 -> 5.5 / 10.3 -> 8.4, D64 6.1 -> 4.8 / 8.8
    -> 7.2. Measured (H200, session 46; bench/NOTES.md, backward b5): with three passes
    (precision=None: float32 accuracy) 7-20% faster deterministic, -2% to +4% with atomic dQ, so
    it is the default there; with one pass (precision="tf32") 15-21% slower (the split's pass
    and its barrier cost more than the products save), so not. passes: TF32_PASSES.
    ATTNEXT_BWD_F32_PRESPLIT=1 / 0 takes it / leaves it wherever it applies (the lab's and the
    tests')."""
    if arch != "sm_90a" or dtype != "float32" or _round_up(D, 16) + _round_up(Dv, 16) > 256:
        return False
    knob = _env.get("ATTNEXT_BWD_F32_PRESPLIT")
    return knob == "1" if knob in ("0", "1") else passes == 3


def bwd_f32_x3(arch, dtype, D, Dv, vec, passes, mods=None):
    """Whether float32's backward runs attn_bwd_sm90_x3.cu (bfloat16 planes: three and six wgmma
    products a product at float32 accuracy, passes 3; two and three with precision="tf32", passes
    1) instead of attn_bwd.cu's split TF32: the default where it applies (sm_90a, 16-byte loads,
    D = Dv in {64, 128}, no generated mods); at float32 accuracy 1.3-1.6x attn_bwd.cu's rate and
    more accurate (bench/NOTES.md, float32 backward x2). ATTNEXT_BWD_F32_X3=0 leaves it."""
    return (_env.get("ATTNEXT_BWD_F32_X3") != "0" and arch == "sm_90a" and dtype == "float32" and passes in (1, 3)
            and vec and D == Dv and D in (64, 128) and mods is None)


def bwd_tf32_f16(arch, dtype, tf32, D, Dv, *, varlen, seqused, bias, mods, sinks, dlse):
    """Whether precision="tf32"'s float32 backward runs on float16 products of copies scaled by
    powers of two (cuda/scale16.py; attn_bwd_sm90.cu's float16 kernels with F16_SCALED): sm_90a
    where those take float16 (D, Dv in {64, 128}), in dense calls without seqused or varlen
    lengths (whose padding rows, which the copies' maxima would read, may hold anything), a bias,
    sinks or lse's gradient (gradients the factors do not undo), or a score_mod / mask_mod (not
    measured there). 3.5-9x the bfloat16 planes' rate (bench/NOTES.md, float32 backward h1).
    ATTNEXT_BWD_TF32_F16=0 leaves such calls on the planes (bwd_f32_x3)."""
    return (dtype == "float32" and tf32 and bwd_sm90_applies(arch, D, Dv, True, "float16")
            and not (varlen or seqused or bias or mods or sinks or dlse)
            and _env.get("ATTNEXT_BWD_TF32_F16") != "0")


# precision="tf32"'s forward on scaled float16 copies from this many query rows: the copies read
# and write ~10 bytes an element of q, k and v (and ~6 of out), a cost that more query rows
# amortise; with fewer, attn_fwd.cu reads k and v once (about even at 128 rows over long keys, by
# the H200's 4.8 TB/s and attn_fwd.cu's ~120 TFLOP/s of TF32)
SCALED16_FWD_ROWS = 256


def fwd_tf32_f16(arch, dtype, tf32, D, Dv, rows, *, varlen, seqused, paged, mods, broadcast):
    """Whether precision="tf32"'s float32 forward runs the float16 kernels (attn_fwd_sm90.cu's,
    the WS one where fwd_ws takes it) over float16 copies scaled by powers of two (cuda/scale16.py:
    q, k and v; the kernels with F16_SCALED write a float16 out, which scale16.unscale takes into
    the float32 out): sm_90a, D = Dv in {64, 128}, at least SCALED16_FWD_ROWS query rows, in dense
    calls (varlen or seqused lengths leave rows the copies' maxima would read; a paged cache is
    not copied) without a score_mod / mask_mod (kept on attn_fwd.cu, as the backward keeps them
    on the planes) and without a broadcast q, k or v (a zero stride: the copies would repeat it).
    2.3-3.5x attn_fwd.cu's single-pass TF32 at the same error (bench/NOTES.md, float32 table h2).
    ATTNEXT_FWD_TF32_F16=0 leaves such calls on attn_fwd.cu."""
    return (dtype == "float32" and tf32 and arch == "sm_90a" and D == Dv and D in (64, 128)
            and rows >= SCALED16_FWD_ROWS and not (varlen or seqused or paged or mods or broadcast)
            and _env.get("ATTNEXT_FWD_TF32_F16") != "0")


# kernels/attn_scale16.cu's entries (cuda/scale16.py launches them: prefetch's specs)
SCALE16_SPECS = [("attn_scale16", name, {}, "")
                 for name in ("attn_scale16_max", "attn_scale16_convert", "attn_scale16_unscale")]


def bwd_x3_kv_warps(D):
    """attn_bwd_dkdv_x3's warps: 4 (one warpgroup takes every product of an item) or 8 (two, one
    for dV's products and one for dK's); the lab's ATTNEXT_BWD_X3_KV_WARPS. 8 at D = 128, where the
    kernel holds one CTA an SM (192 KB of planes) and one warpgroup left the tensor cores idle
    through its loads, splits and softmax (H200, B2 S4k H16: 7.67 -> 6.16 ms, the backward 51.5 ->
    57.4 TFLOP/s, causal 48.5 -> 53.4); 4 at D = 64, whose two CTAs an SM overlap already (6.5 ->
    7.8 ms with 8). The dQ kernel stays one warpgroup: split the same way (S's and dP's, tiles
    passed through shared memory) it ran 8% slower (bench/NOTES.md, float32 backward x3)."""
    return int(_env.get("ATTNEXT_BWD_X3_KV_WARPS") or (8 if D == 128 else 4))


def bwd_x3_dq_mode(D, deterministic):
    """How attn_bwd_sm90_x3.cu gets dQ: at D = 128 with two dK/dV warpgroups (bwd_x3_kv_warps) its
    dK/dV kernel adds each item's dS K into dq_accum by a bulk reduction (5 products a pair):
    "ordered" (the key blocks' turns, attn_bwd_tile.cuh: the same bits every run) or with
    deterministic=False "atomic"; elsewhere, or with ATTNEXT_BWD_X3_DQ=recompute, "recompute" (its
    dQ kernel: S and dP again, 7 products a pair). H200, B2 S4k H16 D128: 12.0 ms recomputing, 9.3
    ordered, 8.6 atomic (bench/NOTES.md, float32 backward x4, x5)."""
    adds = (_env.get("ATTNEXT_BWD_X3_DQ") or "adds") == "adds" and D == 128 and bwd_x3_kv_warps(D) == 8
    return "recompute" if not adds else "ordered" if deterministic else "atomic"


def bwd_x3_defines(defines, D):
    """attn_bwd_sm90_x3.cu's switches from attn_bwd.cu's float32 ones: bfloat16 planes on the tensor
    cores, its fixed tiles (64 x 64; the dQ kernel one warpgroup, the dK/dV kernel bwd_x3_kv_warps);
    dQ's switches (DQ_ATOMIC, DQ_ORDERED, its chains) as defines has them, for 64-key blocks."""
    d = {k: v for k, v in defines.items() if k != "F32_PRESPLIT"}
    d.update(ELEM_BF16=1, KV_BLOCK_M=64, KV_WARPS=bwd_x3_kv_warps(D), KV_SPLIT=0, KV_MINB=1,
             Q_BLOCK_M=64, Q_BLOCK_N=64, Q_WARPS=4, Q_MINB=1)
    return d


def bwd_x3_smem_bytes(D, defines):
    """attn_bwd_sm90_x3.cu's shared memory: four 64-row tiles (K, V, Q, dO) of three bf16 planes
    (two with one TF32 pass: precision="tf32"), the dK/dV kernel's lse and delta rows and with two
    warpgroups its passing region (the 64 x 64 float32 tile one passes the other; with DQ_ATOMIC
    twice that, for dS^T's planes and the item's dQ partial), the 1024-byte alignment's slack."""
    planes = 4 * (3 if defines["TF32_PASSES"] == 3 else 2) * 64 * D * 2 + 1024
    region = (2 if defines["DQ_ATOMIC"] else 1) * 64 * 64 * 4 if defines["KV_WARPS"] == 8 else 0
    return {"attn_bwd_dkdv_x3": planes + region + 2 * 4 * 64, "attn_bwd_dq_x3": planes}


def bwd_tile_config(D, Dv, dtype="bfloat16", atomic=False, planes=False):
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
    steps in the same order whatever the tile. float32 (twice the bytes): 32-key dQ tiles past
    D = 64, so that the dQ kernel fits sm_80 too, 16-row / 16-key tiles up to D + Dv = 256, and
    32-row dK/dV tiles up to D + Dv = 128 where that kernel adds dQ (atomic: its dS^T staged beside
    K and V takes it to 123 KB at 64 rows, one CTA an SM; H200, lab_f32 s43, B4 S4k H16 D64
    deterministic=False: 23.1 -> 16.4 ms, causal 12.5 -> 9.1; tf32 12.0 -> 9.0). planes: float32's
    split tiles with their lo planes (bwd_f32_presplit, three passes), which take the room of a
    second copy of each streamed tile: at D + Dv = 128 32-row dK/dV and 32-key dQ tiles (86 / 95
    KB dK/dV, 77 KB dQ: two CTAs an SM), at 256 the dK/dV kernel as 8 warps over 128 keys, one
    CTA an SM (182 / 192 KB: each split Q and dO element serves 8 warps; the same 8 warps an SM
    as two 4-warp CTAs), the dQ kernel's tiles as before (107 KB)."""
    lab = _lab_tile("ATTNEXT_TILE_BWD")  # the kernel lab's override: "32,4,0,2,64,64,4,2"
    if lab:
        keys = ("kv_block_m", "kv_warps", "kv_split", "kv_minb", "q_block_m", "q_block_n", "q_warps",
                "q_minb")
        return dict(zip(keys, lab))
    dp, dvp = _round_up(D, 16), _round_up(Dv, 16)
    if dtype == "float32" and dp + dvp > 256:
        return dict(kv_block_m=16, kv_warps=2, kv_split=1, kv_minb=2, q_block_m=32, q_block_n=16, q_warps=2,
                    q_minb=2)
    wide = 64 if dtype == "float32" else 128
    q = dict(q_block_m=64, q_block_n=64 if dp <= wide else 32, q_warps=4, q_minb=2)
    if planes and dp + dvp <= 128:
        return dict(kv_block_m=32, kv_warps=4, kv_split=0, kv_minb=2, **dict(q, q_block_n=32))
    if planes and dp + dvp <= 256:
        return dict(kv_block_m=16, kv_warps=8, kv_split=0, kv_minb=1, **dict(q, q_block_n=16))
    if dp + dvp <= 128:
        return dict(kv_block_m=32 if dtype == "float32" and atomic else 64, kv_warps=4, kv_split=0, kv_minb=2, **q)
    if dtype == "float32" and dp + dvp <= 256:
        # 16-row query tiles in dK/dV and 16-key tiles in dQ: 101 and 93 KB, two CTAs an SM on
        # Hopper (at 32 rows / keys, 135 and 118 KB: one). H200, D = 128 S = 4k (lab_f32
        # --bwd-tiles): 1.27x float32's backward, 1.47x tf32's
        return dict(kv_block_m=16, kv_warps=4, kv_split=0, kv_minb=2, **dict(q, q_block_n=16))
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
    if _env.get("ATTNEXT_TILE_SUMS") == "0":
        terms = ()
    for k, t in enumerate(terms):
        span = abs(t.a) * (bm - 1) + abs(t.c) * (bn - 1) + 1
        if used + span <= bm + bn:
            used += span
            admit |= 1 << k
            always &= t.proven
    return used, admit, bool(admit) and always


def bwd_smem_bytes(D, Dv, tile, atomic, slots=0, dtype="bfloat16", planes=False):
    """Dynamic shared memory of each backward kernel (attn_bwd.cu's layouts), by kernel name;
    slots: the dQ kernel's tile sums (tile_sums); planes: float32's lo planes (bwd_f32_presplit
    with three passes: LO_PLANES)."""
    size = ITEMSIZE[dtype]
    pad = 16 // size          # a shared-memory row's padding: 16 bytes (attn_common.cuh's SMEM_PAD)
    dp, dvp = _round_up(D, 16) + pad, _round_up(Dv, 16) + pad
    bm, bn = tile["kv_block_m"], 16 * tile["kv_warps"]
    dkdv_common = bn * dp + 2 * bm * dp + 2 * bm * dvp
    ds = bn * (bm + pad) if atomic else 0                            # dS^T (DQ_ATOMIC)
    extra = 4 * 4 * bm + size * ds
    qm, qn, qw = tile["q_block_m"], tile["q_block_n"], tile["q_warps"]
    if planes:                                                       # Q, dO: one plane each
        extra += size * (bm * dp + bm * dvp)
    q_planes = size * qn * (dp + dvp) if planes else 0               # the key tile's K, V
    return {
        "attn_bwd_dkdv": size * (dkdv_common + bn * dvp) + extra,
        "attn_bwd_dk": size * (dkdv_common + bn * dvp) + extra,
        "attn_bwd_dead": size * (dkdv_common + bn * dvp) + extra,   # dkdv's (or dk's: KV_SPLIT)
        "attn_bwd_dv": size * dkdv_common + extra,
        "attn_bwd_dq": (size * (qm * dp + qm * dvp + 2 * qn * dp + qn * dvp) + q_planes
                        + slots * codegen.TILE_SLOT_BYTES),
        "attn_bwd_dbias": size * (qm * dp + qm * dvp + qn * dp + qn * dvp) + 4 * qw * qn,
        "attn_bwd_pre": 0,
        "attn_bwd_sinks": 0,
        "attn_bwd_dq_convert": 0,
    }


def bwd_sm90_applies(arch, D, Dv, vec, dtype="bfloat16"):
    """Whether attn_bwd_sm90.cu (wgmma dK, dV, dQ) runs: sm_90a, 16-byte loads, D, Dv in {64,
    128}; else attn_bwd.cu. ATTNEXT_BWD_SM90=0 keeps Hopper on attn_bwd.cu (the lab's and the
    tests' comparison)."""
    return (arch == "sm_90a" and vec and D in (64, 128) and Dv in (64, 128) and dtype != "float32"
            and (_env.get("ATTNEXT_BWD_SM90") or "1") != "0")


DQ_MODES = ("recompute", "atomic", "ordered")


# Short keys (at most this many, the longest sequence's): the ordered mode's last turn at a query
# tile writes dq itself (bwd_dq_write_last), and deterministic=False takes the ordered mode too, which
# is then the faster (H100 D64 S512: 0.92x against the atomic mode's 0.87x flash). With more keys
# that last turn's extra work (the tile's sum read back and converted) holds up its key block's
# consumers: the main kernel measured 2.23 against 2.06 ms at D128 S2k (bench/NOTES.md, session 14)
SHORT_KEYS = 1024
# ... and at D = Dv = 64 without a causal mask over more than this many keys, where the atomic
# additions ran no faster than the turns (H200, B1 S16k H32, per call in one process: medians
# 452-456 against the turns' 461-467 TFLOP/s); both move with the GPU's clock, the turns' do_bench
# medians 423-475 in one process (bench/NOTES.md, backward s60, open item 0 s63):
# deterministic=False takes ordered there.
# At 8192 keys and with a causal mask the atomic mode measured steady (473-476, 481-488) and the faster.
LONG_KEYS_64 = 8192


def bwd_dq_mode(sm90, D, deterministic, Dv=None, k_rows=None, f32_passes=0, causal=False):
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
    deterministic=False with at most SHORT_KEYS of them takes ordered too, as it does at D = Dv =
    64 with more than LONG_KEYS_64 and no causal mask (causal: the call's). f32_passes: a float32
    call's TF32 passes on sm_90a (3; 1 for precision="tf32"), else 0: deterministic=False past
    SHORT_KEYS keys then takes attn_bwd.cu's atomic float32 path where it measured faster, at D =
    Dv = 128 and, with three passes, D = Dv = 64 (H200, lab_f32 s43, B4 / B2 S4k H16, against the
    recomputed dQ: 19.4 -> 16.4 ms at D64 (bwd_tile_config's 32-row tile), causal 11.6 -> 9.1;
    D128 21.5 -> 18.2, causal 11.9 -> 10.2; tf32 D128 10.7 -> 10.1, causal 5.9 -> 5.5; tf32 D64
    8.2 -> 9.0, kept recomputing)."""
    adds = sm90 and (D == 128 or (D == 64 and (Dv or D) == 64))   # the warp-specialised kernel takes it
    f32_adds = (Dv or D) == D and (D == 128 and f32_passes or D == 64 and f32_passes == 3)
    mode = _env.get("ATTNEXT_BWD_DQ") or ""
    if mode not in DQ_MODES:
        short = k_rows is not None and k_rows <= SHORT_KEYS
        if f32_adds:
            mode = "recompute" if deterministic or short else "atomic"
        else:
            long64 = D == (Dv or D) == 64 and not causal and k_rows is not None and k_rows > LONG_KEYS_64
            mode = "recompute" if not adds else "ordered" if deterministic or short or long64 else "atomic"
    if mode == "atomic" and deterministic:
        mode = "ordered"
    if mode == "ordered" and not adds:
        mode = "recompute"
    if mode == "atomic" and sm90 and not adds:
        mode = "recompute"
    return mode


def bwd_dq_write_last(mode, mask_mod, k_rows, planes=False):
    """Whether the ordered mode's last turn at each query tile writes dq (attn_bwd_sm90.cu:
    dq_write_last) instead of attn_bwd_dq_convert: with at most SHORT_KEYS keys a query row may
    see (k_rows, as for bwd_dq_mode) and no mask_mod (whose key blocks may pass their turns); never
    on the planes (planes: attn_bwd_sm90_x3.cu, whose turns leave dq to the convert).
    ATTNEXT_BWD_DQ_WRITE=0|1 decides for the lab and the tests where the mode allows it."""
    if mode != "ordered" or mask_mod or planes:
        return False
    env = _env.get("ATTNEXT_BWD_DQ_WRITE")
    return env == "1" if env in ("0", "1") else k_rows <= SHORT_KEYS


# The ordered mode's chains of turns where the first turns store and dq is converted apart
# (attn_bwd_tile.cuh: DQ_CHAINS). Without a causal mask or window every key block meets the query
# tiles in the same order from the kernel's start, so a tile's blocks climb a staircase of turns,
# one L2 round trip a step, that a CTA of few items cannot hide; two chains halve it for a second
# copy of dq_accum and its read in the convert (H200: full rows S2k-4k +4-9%, D64 S8k +2%, S16k
# nothing; four chains no better). Banded calls' blocks start at different tiles and climb no
# staircase: there two chains lost the convert's extra read (1.5-4%; bench/NOTES.md, backward).
DQ_CHAINS = 2
CHAIN_KEYS = 8192        # past this many keys a row may see, one chain (and one copy of dq_accum)


def bwd_dq_chains(mode, mask_mod, write_last, banded, k_rows, planes=False):
    """How many chains the ordered mode's turns run in (each into its own copy of dq_accum,
    attn_bwd_dq_convert adding them): DQ_CHAINS where the first turns store (no mask_mod), the
    convert writes dq (not write_last), no causal mask or window bands the keys (banded) and a
    row sees at most CHAIN_KEYS keys (k_rows), else 1. On the planes (planes:
    attn_bwd_sm90_x3.cu) banded calls take DQ_CHAINS too: their turns stall the CTA (no producer
    warp takes them), and two chains measured faster there (H200, B2 S4k causal D128: 5.03 ->
    4.86 ms; bench/NOTES.md, float32 backward x5). ATTNEXT_BWD_DQ_CHAINS (a divisor of 32)
    decides for the lab and the tests wherever the mode allows more than one (banded or long
    calls too)."""
    if mode != "ordered" or mask_mod or write_last:
        return 1
    env = _env.get("ATTNEXT_BWD_DQ_CHAINS")
    if env in ("1", "2", "4", "8", "16", "32"):
        return int(env)
    return 1 if banded and not planes or k_rows > CHAIN_KEYS else DQ_CHAINS


# attn_bwd_sm90.cu's tiles: one warpgroup (64 keys) per recomputing dK/dV CTA, two CTAs per SM at
# D = 128, three at D = 64 (168 registers: 1.15x faster than two on an H100); two consumer
# warpgroups (128 keys) in the warp-specialised kernel that adds dQ: 64 query rows per item at
# D = 128 (dQ's columns split between the warpgroups), 128 at D = 64 (its rows split)
SM90_BWD_TILE = dict(kv_block_m=64, kv_warps=4, kv_split=0, kv_minb=1, q_block_m=64, q_block_n=64,
                     q_warps=4, q_minb=1)
SM90_BWD_TILE_D64 = {**SM90_BWD_TILE, "kv_minb": 3, "q_minb": 3}
SM90_BWD_TILE_DQ = {**SM90_BWD_TILE, "kv_warps": 8}
SM90_BWD_TILE_DQ_D64 = {**SM90_BWD_TILE_DQ, "kv_block_m": 128}


def bwd_sm90_tile(D, mode, Dv=None):
    """The tile of attn_bwd_sm90.cu for head dims D, Dv (D's when not given) and dq mode: D64's
    (three CTAs an SM) only where Dv is 64 too, since Dv = 128's dV accumulator does not fit its
    168 registers (ptxas spilled 384 B and serialised the wgmma: tests/host's
    test_hopper_kernels_keep_their_wgmma_asynchronous). ATTNEXT_TILE_BWD_SM90="KV,Q[,KV_MINB,
    Q_MINB]" (warps of the recomputing dK/dV and the dQ kernels, CTAs per SM their registers
    allow) is the kernel lab's override; the kernel that adds dQ always has two consumer
    warpgroups."""
    small = D == 64 and (Dv or D) == 64
    if mode != "recompute":
        tile = SM90_BWD_TILE_DQ_D64 if small else SM90_BWD_TILE_DQ
    else:
        tile = SM90_BWD_TILE_D64 if small else SM90_BWD_TILE
    lab = _lab_tile("ATTNEXT_TILE_BWD_SM90")
    if lab and mode == "recompute":
        kv, q, kv_minb, q_minb = (lab + (1, 1))[:4]
        tile = {**tile, "kv_warps": kv, "q_warps": q, "q_block_m": 16 * q, "kv_minb": kv_minb,
                "q_minb": q_minb}
    return tile


def bwd_tma(mode, tile, q_rows, strides_fit, tensor_maps=None):
    """Whether attn_bwd_sm90.cu's warp-specialised dK/dV kernel (a dq mode that adds dQ) takes Q
    and dO by bulk tensor copies (BWD_TMA; its producer's 64 threads issuing cp.asyncs had held
    the consumers up at the stage barrier, bench/NOTES.md backward v14): q_rows, the rows of
    q's tensor and of its longest sequence, at least a query tile's (a copy's box is a whole
    tile), strides a map takes (strides_fit: none 0 along a dimension of more than one element;
    the 16-byte base and rows a map needs are the sm90 kernels' own condition, vec) and a
    driver that makes tensor maps (tensor_maps: None asks this process's driver).
    ATTNEXT_BWD_TMA=0 says no (the lab's comparison)."""
    if mode == "recompute" or q_rows < tile["kv_block_m"] or not strides_fit:
        return False
    if (_env.get("ATTNEXT_BWD_TMA") or "1") == "0":
        return False
    if tensor_maps is not None:
        return tensor_maps
    from .. import _C
    return _C.cuda_tensor_maps()


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
        # + dS^T (2 stages, bf16), dQ (2 stages, float32), lse and delta, 10 mbarriers
        "attn_bwd_dkdv_ws_sm90": kv_tiles + 2 * 2 * bn * bm + 2 * 4 * bm * D + 4 * 4 * bm + 80,
        "attn_bwd_dq_sm90": 2 * (qm * D + qm * Dv + 2 * qn * D + 2 * qn * Dv) + 1024 + slots * codegen.TILE_SLOT_BYTES,
    }


def bwd_defines(*, dtype, D, Dv, vec, softcap, bias_dtype, alibi_dtype, mask, tile, dq="recompute",
                mods=None, tf32=False, tma=False, chains=1, presplit=False, key_block=None, scaled16=False):
    """The #defines of one backward variant (kernels/attn_bwd.cu: every backward kernel of it;
    attn_bwd_sm90.cu the same); dq: bwd_dq_mode's answer ("recompute" whenever the mods have
    array gradients: the dQ kernels' ds_tile scatters them, MOD_TILE_SLOTS: through shared
    memory where it has tile terms); mods: as for fwd_defines; tma: bwd_tma's answer (the
    warp-specialised dK/dV kernel's Q and dO by bulk tensor copies, BWD_TMA); chains:
    bwd_dq_chains' answer (DQ_CHAINS and the key block it counts, DQ_KEY_BLOCK, where above 1:
    key_block, else attn_bwd_sm90.cu's); presplit: bwd_f32_presplit's (F32_PRESPLIT); scaled16:
    bwd_tf32_f16's (F16_SCALED)."""
    d = {
        **dtype_defines(dtype, tf32, scaled16), "HEAD_DIM": D, "HEAD_DIM_V": Dv, "VEC_LOAD": int(vec),
        "HAS_SOFTCAP": int(softcap), "HAS_BIAS": int(bias_dtype is not None),
        "BIAS_DT": DTYPE_CODES[bias_dtype or "float32"], "HAS_ALIBI": int(alibi_dtype is not None),
        "ALIBI_DT": DTYPE_CODES[alibi_dtype or "float32"], "HAS_MASK": int(mask),
    }
    d.update(KV_BLOCK_M=tile["kv_block_m"], KV_WARPS=tile["kv_warps"], KV_SPLIT=tile["kv_split"],
             KV_MINB=tile["kv_minb"], DQ_ATOMIC=int(dq != "recompute"), DQ_ORDERED=int(dq == "ordered"),
             DQ_TILE_M=bwd_sm90_tile(D, dq, Dv)["kv_block_m"] if dq == "ordered" else 0,
             Q_BLOCK_M=tile["q_block_m"],
             Q_BLOCK_N=tile["q_block_n"], Q_WARPS=tile["q_warps"], Q_MINB=tile["q_minb"])
    if tma:
        d["BWD_TMA"] = 1
    if presplit:
        d["F32_PRESPLIT"] = 1
    if chains > 1:
        d.update(DQ_CHAINS=chains, DQ_KEY_BLOCK=key_block or 16 * bwd_sm90_tile(D, dq, Dv)["kv_warps"])
    slots, admit, always = tile_sums(mods, tile["q_block_m"], tile["q_block_n"])
    if slots:
        d.update(MOD_TILE_SLOTS=slots, MOD_TILE_ADMIT=admit, MOD_TILE_ALWAYS=int(always))
    return mod_defines(d, mods)


def bwd_variants(arch=None):
    """The backward variants warmup compiles for arch (None: every architecture's): those of the
    forward's list (the backward has no pack-GQA or split-KV variants), plus the atomic dq path of
    the common head dims (the lab's; float32's deterministic=False where bwd_dq_mode takes it).
    float32's three-pass variants on sm_90a with their tiles split once (bwd_f32_presplit), as
    calls there run them; arch None keeps both."""
    out = []
    for _, fd in fwd_variants():
        dtype = "float32" if fd.get("ELEM_F32") else "bfloat16" if fd["ELEM_BF16"] else "float16"
        D, Dv, passes = fd["HEAD_DIM"], fd["HEAD_DIM_V"], fd.get("TF32_PASSES", 0)
        names = {v: k for k, v in DTYPE_CODES.items()}
        features = dict(dtype=dtype, D=D, Dv=Dv, vec=bool(fd["VEC_LOAD"]), softcap=bool(fd["HAS_SOFTCAP"]),
                        bias_dtype=names[fd["BIAS_DT"]] if fd["HAS_BIAS"] else None,
                        alibi_dtype=names[fd["ALIBI_DT"]] if fd["HAS_ALIBI"] else None,
                        mask=bool(fd["HAS_MASK"]), tf32=passes == 1)
        split = arch in (None, "sm_90a") and bwd_f32_presplit("sm_90a", dtype, D, Dv, passes)
        splits = (False,) if not split else (True,) if arch == "sm_90a" else (False, True)
        atomic = (not (fd["HAS_SOFTCAP"] or fd["HAS_BIAS"] or fd["HAS_MASK"]) and (D, Dv) in ((64, 64), (128, 128))
                  and (dtype != "float32" or bwd_dq_mode(False, D, False, Dv, None, passes) == "atomic"))
        for presplit in splits:
            planes = presplit and passes == 3
            out.append(bwd_defines(**features, tile=bwd_tile_config(D, Dv, dtype, False, planes), presplit=presplit))
            if atomic:
                out.append(bwd_defines(**features, tile=bwd_tile_config(D, Dv, dtype, True, planes), dq="atomic",
                                       presplit=presplit))
    unique = {tuple(sorted(d.items())): d for d in out}
    return [("attn_bwd", d) for d in unique.values()]


def sm90_fwd_variants():
    """attn_fwd_sm90's variants (sm_90a only): both dtypes, the head dims it takes (the WS kernel's
    too where D = Dv), and each feature on its own at D = 128 on the WS kernel, its plain tiles
    also as a persistent grid, and at D = 128 on the 176-key tile; attn_fwd.cu's TMA_KV decode
    (packed GQA, split or not, contiguous or paged); and attn_fwd_sm90_f32.cu's float32 at D = Dv
    in {64, 128}, each score option on its own at D = 128 as on the WS kernel."""
    out = []
    for dtype in ("bfloat16", "float16"):
        for D, Dv in ((64, 64), (128, 128), (128, 64), (64, 128)):
            base = dict(dtype=dtype, D=D, Dv=Dv, vec=True, softcap=False, bias_dtype=None,
                        alibi_dtype=None, mask=False, tile=SM90_TILE_LONG)
            out.append(base)
            out.append({**base, "tile": SM90_TILE_SHORT})
            if D == Dv:
                out.append({**base, "tile": SM90_TILE_WS, "ws": True})
            if D == Dv == 64:
                out.append({**base, "tile": SM90_TILE_WS3, "ws": True})
            if (D, Dv) == (128, 128):       # on the tile dense long rows take
                ws = {**base, "tile": SM90_TILE_WS, "ws": True}
                out.append({**ws, "softcap": True})
                out.append({**ws, "bias_dtype": dtype})
                out.append({**ws, "bias_dtype": "float32", "mask": True, "alibi_dtype": "float32"})
    # precision="tf32"'s forward on scaled float16 copies (fwd_tf32_f16), on the plain float16 tiles
    # (a call of few query tiles over long keys, split over the keys, compiles its own at first use)
    out += [{**v, "scaled16": True} for v in out
            if v["dtype"] == "float16" and v["D"] == v["Dv"] and not score_options(v)]
    # the persistent grid (fwd_persist: short rows without score options), on the plain tiles
    out += [{**v, "persist": True, "tile": fwd_persist_tile(v["D"], v["tile"])}
            for v in out if v.get("ws") and not score_options(v)]
    # plain D = 128 calls over long keys (fwd_wide_keys: tf32's scaled copies too), a CTA a tile
    out += [{**v, "tile": SM90_TILE_WS_WIDE} for v in out
            if v.get("ws") and not v.get("persist") and v["D"] == v["Dv"] == 128 and not score_options(v)]
    # ... and both D = 128 tiles in pairs of CTAs (fwd_cluster: plain calls, an even number of query tiles)
    out += [{**v, "cluster": True} for v in out
            if v.get("ws") and not v.get("persist") and v["D"] == v["Dv"] == 128 and not score_options(v)]
    decode = [dict(dtype=dtype, D=D, Dv=D, vec=True, softcap=False, bias_dtype=None, alibi_dtype=None,
                   mask=False, tile=DECODE_TMA_TILE, pack_gqa=True, split_kv=split, tma=True)
              for dtype in ("bfloat16", "float16") for D in (64, 128) for split in (True, False)]
    decode += [{**decode[0], "paged": True}]
    f32 = [dict(dtype="float32", D=D, Dv=D, vec=True, softcap=False, bias_dtype=None, alibi_dtype=None,
                mask=False, tile=SM90_TILE_F32, sm90_f32=True) for D in (64, 128)]   # fwd_f32_sm90's
    f32 += [{**f32[1], "softcap": True}, {**f32[1], "bias_dtype": "float32"},         # and D = 128's options
            {**f32[1], "bias_dtype": "float32", "mask": True, "alibi_dtype": "float32"}]
    return ([("attn_fwd_sm90", fwd_defines(**v)) for v in out] + [("attn_fwd", fwd_defines(**v)) for v in decode]
            + [("attn_fwd_sm90_f32", fwd_defines(**v)) for v in f32])


def sm90_bwd_variants():
    """attn_bwd_sm90's variants (sm_90a only): those of sm90_fwd_variants' features, each in the
    dq modes a deterministic and a non-deterministic call choose, and attn_bwd.cu's (its row
    kernels) in the ordered mode, which only Hopper takes; attn_bwd_sm90_x3.cu's plain ones; the
    float16 ones without a bias again as precision="tf32"'s float32 backward takes them (bwd_tf32_f16:
    F16_SCALED, attn_bwd.cu's row kernels in both modes, and attn_scale16.cu)."""
    out = [("attn_scale16", {})]          # SCALE16_SPECS' entries: one module
    names = {v: k for k, v in DTYPE_CODES.items()}
    for _, fd in sm90_fwd_variants():
        if (fd["BLOCK_M"], fd["BLOCK_N"]) != SM90_TILE_LONG[:2]:
            continue
        D = fd["HEAD_DIM"]
        features = dict(
            dtype="bfloat16" if fd["ELEM_BF16"] else "float16", D=D, Dv=fd["HEAD_DIM_V"], vec=True,
            softcap=bool(fd["HAS_SOFTCAP"]), bias_dtype=names[fd["BIAS_DT"]] if fd["HAS_BIAS"] else None,
            alibi_dtype=names[fd["ALIBI_DT"]] if fd["HAS_ALIBI"] else None, mask=bool(fd["HAS_MASK"]))
        scaled = (False, True) if features["dtype"] == "float16" and not fd["HAS_BIAS"] else (False,)
        for deterministic, scaled16 in itertools.product((True, False), scaled):
            mode = bwd_dq_mode(True, D, deterministic, fd["HEAD_DIM_V"])
            tile = bwd_sm90_tile(D, mode, fd["HEAD_DIM_V"])
            tma = bwd_tma(mode, tile, tile["kv_block_m"], True, tensor_maps=True)
            # the ordered mode in one chain and in DQ_CHAINS (an unbanded call's), with attn_bwd.cu's
            # row kernels (delta, dq_convert) of each
            for chains in ((1, DQ_CHAINS) if mode == "ordered" else (1,)):
                out.append(("attn_bwd_sm90", bwd_defines(**features, tile=tile, dq=mode, tma=tma, chains=chains,
                                                         scaled16=scaled16)))
                if mode == "ordered" or scaled16:
                    out.append(("attn_bwd", bwd_defines(**features, tile=bwd_tile_config(D, fd["HEAD_DIM_V"]),
                                                        dq=mode, chains=chains, scaled16=scaled16)))
    # float32 on bfloat16 planes (bwd_f32_x3), plain, at both head dims and precisions in the dq modes a
    # deterministic and a non-deterministic call choose (ordered: in one chain and in DQ_CHAINS), with
    # attn_bwd.cu's row kernels (delta, dq_convert, dead) where dQ is added
    for D, tf32 in itertools.product((64, 128), (False, True)):
        f32 = dict(dtype="float32", D=D, Dv=D, vec=True, softcap=False, bias_dtype=None, alibi_dtype=None,
                   mask=False, tf32=tf32)
        for deterministic in (True, False):
            mode = bwd_x3_dq_mode(D, deterministic)
            presplit = bwd_f32_presplit("sm_90a", "float32", D, D, 1 if tf32 else 3)
            tile = bwd_tile_config(D, D, "float32", mode != "recompute", presplit and not tf32)
            for chains in ((1, DQ_CHAINS) if mode == "ordered" else (1,)):
                d = bwd_defines(**f32, tile=tile, dq=mode, chains=chains, presplit=presplit, key_block=64)
                out.append(("attn_bwd_sm90_x3", bwd_x3_defines(d, D)))
                if mode != "recompute":
                    out.append(("attn_bwd", d))
    return out                            # with repeats: variants() keeps each once


def merge_variants():
    """attnext.merge's kernel (attn_merge.cu), one variant per dtype of the parts."""
    return [("attn_merge", {"MERGE_DT": code}) for code in sorted(DTYPE_CODES.values())]


def variants(arch=None):
    """Every (kernel, defines) warmup compiles for arch (None: those of every architecture), each
    once (the lists overlap: attn_bwd.cu's row kernels of Hopper's float32 atomic dQ are both
    bwd_variants' and sm90_bwd_variants')."""
    hopper = sm90_fwd_variants() + sm90_bwd_variants() if arch in (None, "sm_90a") else []
    every = fwd_variants() + bwd_variants(arch) + hopper + merge_variants()
    return list({(k, tuple(sorted(d.items()))): (k, d) for k, d in every}.values())


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
    kernel families on sm_90a, and there float32's forward too), and the forward with element
    loads at an odd head dim. A few:
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
                ("attn_fwd_sm90", fwd_defines(**every, tile=SM90_TILE_WS_MODS, mods=gen, ws=True)),
                ("attn_fwd_sm90_f32", fwd_defines(**dict(every, dtype="float32"), tile=SM90_TILE_F32, mods=gen,
                                                  sm90_f32=True)),
                ("attn_bwd_sm90", bwd_defines(**every, tile=bwd_sm90_tile(128, "recompute"), mods=gen))]
    return [(k, d, gen.source) for k, d in out]
