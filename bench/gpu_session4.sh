#!/usr/bin/env bash
# One H200, 2026-12-02 (fourth session): the GPU suite and the runs behind BENCHMARKS.md's
# tables of issues 33 (FP8), 36 (cross-host KV), 37 (DeepSeek decode) and the T=1 decode
# step, each part under one device call. Logs and JSON under $OUT.
# Usage (repository root, the carried wheels installed): bash bench/gpu_session4.sh PART
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-tests}
case "$part" in
tests)
    timeout 500 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests > "$OUT/gpu_suite.log" 2>&1
    echo "gpu suite rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_suite.log" | cut -c1-200; tail -2 "$OUT/gpu_suite.log" ;;
deepseek)
    timeout 150 python3 bench/deepseek.py --v2-lite --batches 1 16 64 --parts decode \
        --json "$OUT/deepseek_v2_lite_decode.json" > "$OUT/deepseek_v2_lite.log" 2>&1
    echo "v2-lite rc=$?"; tail -8 "$OUT/deepseek_v2_lite.log"
    timeout 150 python3 bench/deepseek.py --v32 --batches 1 16 64 --context 32768 \
        --json "$OUT/deepseek_v32_decode.json" > "$OUT/deepseek_v32.log" 2>&1
    echo "v32 rc=$?"; tail -8 "$OUT/deepseek_v32.log"
    timeout 100 python3 bench/deepseek_profile.py --v2-lite --batch 1 --context 1024 \
        --json "$OUT/deepseek_profile_v2_lite.json" > "$OUT/deepseek_profile.log" 2>&1
    echo "profile rc=$?"; tail -6 "$OUT/deepseek_profile.log"
    timeout 150 python3 bench/deepseek_kernels.py --json "$OUT/deepseek_kernels.json" \
        > "$OUT/deepseek_kernels.log" 2>&1
    echo "kernels rc=$?"; tail -30 "$OUT/deepseek_kernels.log" ;;
ttft)
    timeout 400 python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 2 \
        --paths grpc fast nixl nixl_tcp --fetch-streams 1 2 4 \
        --json "$OUT/ttft_crosshost_h200.json" > "$OUT/ttft_crosshost.log" 2>&1
    echo "ttft rc=$?"; grep -v "NIXL INFO" "$OUT/ttft_crosshost.log" | tail -30
    timeout 150 python3 bench/fp8_kv.py --llama3-8b --tokens 32768 --repeat 2 \
        --json "$OUT/fp8_kv_ttft_h200.json" > "$OUT/fp8_kv.log" 2>&1
    echo "fp8 kv rc=$?"; tail -12 "$OUT/fp8_kv.log" ;;
fp8)
    timeout 300 python3 bench/fp8.py --sweep --rows 1 16 64 2048 --write-table "$OUT/nvidia_h200.json" \
        --json "$OUT/gemm_sweep_h200.json" > "$OUT/fp8_sweep.log" 2>&1
    echo "sweep rc=$?"; tail -12 "$OUT/fp8_sweep.log"
    LANEKV_FP8_GEMM_CONFIGS="$OUT/nvidia_h200.json" timeout 100 python3 bench/fp8.py --only decode \
        --json "$OUT/fp8_decode_h200.json" > "$OUT/fp8_decode.log" 2>&1
    echo "fp8 decode rc=$?"; tail -10 "$OUT/fp8_decode.log" ;;
step)
    timeout 120 python3 bench/decode_step.py --llama3-8b --batches 1 16 64 --context 1024 --runs 5 \
        --json "$OUT/decode_step_h200.json" > "$OUT/decode_step.log" 2>&1
    echo "decode_step rc=$?"; tail -7 "$OUT/decode_step.log" ;;
esac
