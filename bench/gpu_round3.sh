#!/usr/bin/env bash
# One device call (one H200): the GPU tests, then the TTFT and decode-step runs that
# compare the restructured tree with the one before it. Logs and JSON under $OUT.
# Usage (from the repository root, after the carried wheels are installed):
#   bash bench/gpu_round3.sh tests|ttft|rest
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-tests}
case "$part" in
tests)
    timeout 330 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests > "$OUT/gpu_suite.log" 2>&1
    echo "gpu suite rc=$?"; tail -4 "$OUT/gpu_suite.log"
    timeout 200 python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 3 \
        --json "$OUT/ttft_after.json" > "$OUT/ttft_after.log" 2>&1; echo "ttft rc=$?"
    grep -E "^ +(8192|32768) +(colocated|grpc|fast)" "$OUT/ttft_after.log" ;;
rest)
    timeout 100 python3 bench/decode_step.py --llama3-8b --batches 1 16 64 --context 1024 --runs 5 \
        --hf-batches 1 --json "$OUT/decode_step_after.json" > "$OUT/decode_step.log" 2>&1
    echo "decode_step rc=$?"; tail -7 "$OUT/decode_step.log"
    timeout 230 python3 bench/prefix_cache.py --llama3-8b --conversations 16 --turns 8 --concurrency 8 \
        --page-size 64 --json "$OUT/prefix_cache_h200.json" > "$OUT/prefix_cache.log" 2>&1
    echo "prefix rc=$?"; tail -8 "$OUT/prefix_cache.log"
    timeout 70 python3 bench/fp8.py --only gemm --json "$OUT/fp8_gemm_h200.json" > "$OUT/fp8.log" 2>&1
    echo "fp8 rc=$?"; tail -14 "$OUT/fp8.log"
    timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/transfer/grpcfetch/test_layerwise.py 2>&1 | tail -2 ;;
esac
