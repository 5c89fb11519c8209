#!/usr/bin/env bash
# One call on the lent GPU machine (the device tool): build the extension in place, compile the
# kernels for this GPU, then run what was asked; logs land in $OUT.
#   bash bench/run_gpu.sh [warmup|smoke|gpu|host|sanitizers|suite0..suite4|sanitize|bench|mods|quick|register|short] ...
# (in order). The whole GPU suite: gpu, host, sanitizers (test_cuda_sanitize.py, apart: each test
# runs a child under compute-sanitizer) and suite0..suite4; suiteN reruns a fifth of the CPU test
# file on the GPU (a few minutes each, one per call). Every GPU test but the sanitizers' at once
# ran past a 600 s call (session 50): gpu and host each stop at 580 s.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/attnext-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }

rc=0
for step in "$@"; do
  case "$step" in
    warmup) python3 -m attnext.warmup 2>&1 | tail -3 ;;
    smoke) python3 -m pytest -m gpu -q --maxfail=20 tests/gpu/test_cuda.py tests/host/test_cuda_host.py -k "not cpu_suite" 2>&1 | tee "$OUT/smoke.log" | tail -25 ;;
    gpu) # tests/gpu but the sanitizers' file and the CPU suite's shards
         timeout 580 python3 -m pytest -m gpu -q -n 8 tests/gpu -k "not cpu_suite" \
           --ignore=tests/gpu/test_cuda_sanitize.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    host) # every other folder's GPU tests
          timeout 580 python3 -m pytest -m gpu -q -n 8 tests --ignore=tests/gpu 2>&1 \
            | tee "$OUT/host_tests.log" | tail -40 ;;
    sanitizers) # test_cuda_sanitize.py: each test a child process under compute-sanitizer
           python3 -m pytest -m gpu -q -n 3 tests/gpu/test_cuda_sanitize.py 2>&1 | tee "$OUT/sanitizer_tests.log" | tail -20 ;;
    suite[0-4]) python3 -m pytest -m gpu -q tests/gpu/test_cuda.py -k "cpu_suite and shard${step#suite}" 2>&1 \
                | tee "$OUT/$step.log" | tail -30 ;;
    sanitize) # memcheck over the GPU tests of the kernels and the mods; racecheck (slow) over a
              # forward, the backward's kernels (the warp-specialised dK/dV + dQ in both dq modes,
              # the recomputing ones), varlen, decode, and score_mods with lookups and dtensors
              compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q \
                -p no:cacheprovider tests/gpu/test_cuda.py tests/gpu/test_cuda_backward.py \
                tests/cpu/test_score_mod.py tests/host/test_mod_arrays.py tests/unit/test_tile_sums.py \
                -k "not cpu_suite" 2>&1 \
                | tee "$OUT/memcheck.log" | tail -5 || rc=1
              compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -m gpu -q \
                -p no:cacheprovider tests/gpu/test_cuda.py tests/gpu/test_cuda_backward.py tests/cpu/test_score_mod.py \
                tests/unit/test_tile_sums.py -k "test_head_dims and bf16 and d128_dv128 or varlen_with_padding or test_decode_split_kv and B3 \
                    or test_head_dims and bf16-d64_dv64-causal or test_varlen and 128-causal \
                    or dq_added_by_the_dkdv_kernel and (d128-default or d64-default) or score_mod_zoo and bf16 \
                    and (rel or doc_penalty) or narrowed or test_relative_bias_table and d64-causal \
                    or mask_mod_zoo and bf16 and (document or allowed) or block_sparse_masks and d64" 2>&1 \
                | tee "$OUT/racecheck.log" | tail -5 || rc=1 ;;
    register) python3 -m pytest -m gpu -q tests/host/test_pinning.py tests/host/test_staging.py 2>&1 | tee "$OUT/register_tests.log" | tail -15
              python3 bench/labs/lab_numpy.py 2>&1 | tee "$OUT/lab_numpy.log" ;;
    quick) python3 -m attnext.bench --device cuda --quick --json "$OUT/bench_quick.json" 2>&1 | tee "$OUT/bench_quick.log" | tail -40 ;;
    bench) python3 -m attnext.bench --device cuda --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | tail -60 ;;
    mods) # the score_mod / mask_mod rows and their first calls (~6 minutes on a fresh machine)
          python3 -m attnext.bench --device cuda --rows "softcap|relbias|doc7 |window" --first-call \
            --json "$OUT/mods.json" 2>&1 | grep -v "Warning\|^  return" | tee "$OUT/mods.log" | tail -30 ;;
    short) # the S256 / S512 / S1k forward rows: the WS kernel (default) against the
           # two-warpgroup kernel they ran until session 76
           python3 bench/labs/lab_fwd_ab.py --rows 64:256 128:256 64:512 64:1024 128:512 128:1024 \
             64:512:causal 64:1024:causal 128:512:causal 128:1024:causal --rounds 2 \
             --config default= --config two_wg=ATTNEXT_FWD_WS=0 2>&1 | tee "$OUT/short.log" | tail -60 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $rc
