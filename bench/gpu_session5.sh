#!/usr/bin/env bash
# One H200, 2026-12-02 (fifth session): the runs behind BENCHMARKS.md's tables of issues
# 33 (FP8), 35 (the T=1 decode step), 36 (cross-host KV) and 37 (DeepSeek), each part under
# one device call of at most 10 minutes. Logs and JSON under $OUT.
# Usage (repository root, the carried wheels installed): bash bench/gpu_session5.sh PART
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-ttft}
case "$part" in
ttft)  # issue 36 (and 35: the T=1 step beside transformers)
    timeout 390 python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 2 \
        --paths grpc fast nixl nixl_tcp --fetch-streams 1 4 \
        --json "$OUT/ttft_crosshost_h200.json" > "$OUT/ttft_crosshost.log" 2>&1
    echo "ttft rc=$?"; grep -v "NIXL INFO" "$OUT/ttft_crosshost.log" | tail -30
    timeout 150 python3 bench/decode_step.py --llama3-8b --batches 1 16 64 --context 1024 --runs 5 \
        --json "$OUT/decode_step_h200.json" > "$OUT/decode_step.log" 2>&1
    echo "decode_step rc=$?"; tail -8 "$OUT/decode_step.log" ;;
fp8)  # issue 33: the GEMM sweep, the tuned GEMM vs torch, the FP8 decode steps, FP8-KV TTFT; issue 36: UCX
    timeout 90 python3 bench/ucx_sweep.py --mib 256 --json "$OUT/ucx_sweep_h200.json" > "$OUT/ucx_sweep.log" 2>&1
    echo "ucx rc=$?"; grep -v "NIXL INFO" "$OUT/ucx_sweep.log" | tail -12
    timeout 150 python3 bench/fp8.py --sweep --rows 1 16 64 --write-table "$OUT/nvidia_h200.json" \
        --json "$OUT/gemm_sweep_decode_h200.json" > "$OUT/fp8_sweep_decode.log" 2>&1
    echo "sweep decode rc=$?"; tail -8 "$OUT/fp8_sweep_decode.log"
    timeout 110 python3 bench/fp8.py --sweep --rows 2048 --write-table "$OUT/nvidia_h200.json" \
        --json "$OUT/gemm_sweep_prefill_h200.json" > "$OUT/fp8_sweep_prefill.log" 2>&1
    echo "sweep prefill rc=$?"; tail -8 "$OUT/fp8_sweep_prefill.log"
    LANEKV_FP8_GEMM_CONFIGS="$OUT/nvidia_h200.json" timeout 110 python3 bench/fp8.py --only decode \
        --json "$OUT/fp8_decode_h200.json" > "$OUT/fp8_decode.log" 2>&1
    echo "fp8 decode rc=$?"; tail -10 "$OUT/fp8_decode.log"
    timeout 100 python3 bench/fp8_kv.py --llama3-8b --tokens 32768 --repeat 2 \
        --json "$OUT/fp8_kv_ttft_h200.json" > "$OUT/fp8_kv.log" 2>&1
    echo "fp8 kv rc=$?"; tail -12 "$OUT/fp8_kv.log" ;;
probe)  # issue 33: where the FP8 Llama step's time goes; issue 36: the rank's GIL switch interval
    for b in 1 64; do
        timeout 100 python3 bench/deepseek_profile.py --llama3-8b --fp8 --batch $b --context 1024 \
            --json "$OUT/profile_llama_fp8_b$b.json" > "$OUT/profile_llama_fp8_b$b.log" 2>&1
        echo "profile fp8 b$b rc=$?"; sed -n '/layer 1 (/,/^$/p' "$OUT/profile_llama_fp8_b$b.log" | head -30
    done
    # every process of the run (the rank processes too) starts with a 0.1 ms switch interval
    mkdir -p /tmp/swi && printf 'import os, sys\nif os.environ.get("LANEKV_PROBE_SWITCH_S"):\n    sys.setswitchinterval(float(os.environ["LANEKV_PROBE_SWITCH_S"]))\n' > /tmp/swi/sitecustomize.py
    PYTHONPATH=/tmp/swi:${PYTHONPATH:-} LANEKV_PROBE_SWITCH_S=0.0001 timeout 150 python3 bench/ttft.py --llama3-8b --cp 1 \
        --tokens 8192 --repeat 2 --no-nixl --paths grpc fast --fetch-streams 1 4 \
        --json "$OUT/ttft_switch_0p1ms_h200.json" > "$OUT/ttft_switch.log" 2>&1
    echo "ttft switch rc=$?"; grep -E "^ +8192 +(colocated|grpc|fast)" "$OUT/ttft_switch.log" ;;
esac
