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
final)  # after the merges: issue 37 (V2-Lite step, MLA prefill), 36 (relays), 33 (FP8 prefill GEMM), GPU tests
    timeout 95 python3 bench/deepseek.py --v2-lite --batches 1 16 64 --parts decode \
        --json "$OUT/deepseek_v2_lite_decode.json" > "$OUT/deepseek_v2_lite.log" 2>&1
    echo "v2-lite rc=$?"; tail -8 "$OUT/deepseek_v2_lite.log"
    timeout 120 python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 2 --no-nixl \
        --transfer-tokens 8192 --paths grpc fast --fetch-streams 4 --fetch-relays 4 \
        --json "$OUT/ttft_relays_h200.json" > "$OUT/ttft_relays.log" 2>&1
    echo "ttft relays rc=$?"; grep -E "^ +(8192|32768) +(colocated|grpc|fast)" "$OUT/ttft_relays.log"
    cp kernels/fp8/gemm_tables/nvidia_h200.json "$OUT/nvidia_h200.json"
    timeout 110 python3 bench/fp8.py --sweep --rows 2048 --time-budget-s 90 --write-table "$OUT/nvidia_h200.json" \
        --json "$OUT/gemm_sweep_prefill_h200.json" > "$OUT/fp8_sweep_prefill.log" 2>&1
    echo "fp8 prefill sweep rc=$?"; tail -6 "$OUT/fp8_sweep_prefill.log"
    PYTHONPATH=.:${PYTHONPATH:-} timeout 90 python3 bench/mla_prefill_sweep.py --job-timeout 60 \
        --configs 128,128,8,2 128,128,8,2+exp_bf16 128,64,8,4+exp_bf16 \
        --json "$OUT/mla_prefill_sweep_h200.json" > "$OUT/mla_prefill_sweep.log" 2>&1
    echo "mla prefill rc=$?"; tail -12 "$OUT/mla_prefill_sweep.log"
    timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe_decode.py \
        tests/kernels/test_fp8_moe_decode.py tests/kernels/test_moe_gate.py tests/kernels/test_mla_decode.py \
        tests/kernels/test_sparse_mla.py tests/kernels/test_fp8_rope_store.py tests/kernels/test_rmsnorm.py \
        tests/kernels/test_fp8_gemm_prefill.py tests/transfer/fastpath/test_head_ranges.py \
        tests/decode/test_no_compile.py tests/transfer/rank/test_relay.py > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | cut -c1-180; tail -1 "$OUT/gpu_tests.log" ;;
esac
