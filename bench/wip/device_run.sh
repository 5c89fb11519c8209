#!/usr/bin/env bash
# Scratch: the NVRTC timings of bench/wip on the lent GPU machine (bash bench/wip/device_run.sh)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")/../.."
nproc; lscpu | grep -E "Model name|MHz"; uptime
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
python3 -c "
from attnext import kernels, _C
print('candidates', kernels.nvrtc_candidates()); print('NVRTC', kernels.nvrtc(), _C.nvrtc_load(kernels.nvrtc_candidates()))"
ls -la ~/.nv 2>/dev/null; env | grep -i cuda_cache
cd bench/wip
echo "== default env (NVRTC cache as it is there)"; python3 nvrtc_base.py 2>&1 | tee $OUT/base_default.txt
echo "== CUDA_CACHE_DISABLE=1"; CUDA_CACHE_DISABLE=1 python3 nvrtc_base.py 2>&1 | tee $OUT/base_nocache.txt
echo "== fresh cache path, first compile then repeats"; CUDA_CACHE_PATH=/tmp/nvcache python3 nvrtc_first.py; CUDA_CACHE_PATH=/tmp/nvcache python3 nvrtc_first.py; du -sh /tmp/nvcache
echo "== options (cache off)"; CUDA_CACHE_DISABLE=1 python3 nvrtc_options.py fwd "PTX only" "lineinfo" "-O1" "Ofast-compile=min" 2>&1 | cut -c1-200
echo "== parallel (cache off)"; CUDA_CACHE_DISABLE=1 python3 nvrtc_parallel.py
cd ../..
echo "== lab_compile real first calls, cache off"; CUDA_CACHE_DISABLE=1 timeout 150 python3 bench/lab_compile.py --mods softcap,rel_bias 2>&1 | tee $OUT/lab_nocache.txt
echo "== lab_compile real first calls, default"; timeout 150 python3 bench/lab_compile.py --mods softcap,rel_bias 2>&1 | tee $OUT/lab_default.txt
