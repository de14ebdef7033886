#!/usr/bin/env bash
# One H200, eighth session (2026-12-03). Each part fits one device call of at most 10
# minutes; logs go into one archive per part under $OUT (the device returns at most 8
# files), JSON files one by one, the short tables to stdout.
# Usage (repository root, the carried wheels installed): bash bench/gpu_session8.sh PART
#   a: the GPU tests of this session's kernels and read streams; issue 33: the decode-row
#      GEMM sweep with the w8a16 family (table written under $OUT), the FP8 decode step
#      with that table, the batch-1 profile; issue 37: the DSA sparse kernel's configs.
#   c: issue 37 after the merges: GPU tests of the MLA chain kernels, the V2-Lite decode
#      step and batch-1 profile, the DSA layer against dense MLA; issue 33: the FP8 decode
#      step with the committed table (w8a16 and quant_first entries).
#   d: parts c and b in one call, trimmed to fit (the device was scarce): GPU tests,
#      V2-Lite step, FP8 step, DSA layer at 8k and 128k, TTFT through staged relays, then
#      the V2-Lite profile if time is left.
#   b: issue 36: TTFT over gRPC from the rank's own streams and through 4 staged sender
#      relays, beside colocated and the fast path.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-a}
L=/tmp/lanekv_logs; mkdir -p "$L"
trap 'tar -C "$L" -czf "$OUT/logs_$part.tgz" .' EXIT
case "$part" in
a)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8.py \
        tests/kernels/test_fp8_w8a16.py tests/transfer/grpcfetch/test_layerwise.py \
        tests/transfer/rank/test_relay_staged.py tests/kernels/test_sparse_mla.py tests/kernels/test_mla_decode.py \
        ${EXTRA_TESTS:-} > "$L/gpu_tests_a.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_a.log" | cut -c1-180; tail -1 "$L/gpu_tests_a.log"
    cp kernels/fp8/gemm_tables/nvidia_h200.json "$OUT/nvidia_h200.json"  # merged into, not replaced
    timeout 130 python3 bench/fp8.py --only gemm --sweep --rows 1 16 --write-table "$OUT/nvidia_h200.json" \
        --json "$OUT/gemm_sweep_decode_h200.json" > "$L/fp8_sweep_decode.log" 2>&1
    echo "sweep rc=$?"; grep -E "^(llama|v2_lite)" "$L/fp8_sweep_decode.log" | cut -c1-150
    LANEKV_FP8_GEMM_CONFIGS="$OUT/nvidia_h200.json" timeout 120 python3 bench/fp8.py --only decode \
        --batches 1 16 64 --json "$OUT/fp8_decode_h200.json" > "$L/fp8_decode.log" 2>&1
    echo "fp8 decode rc=$?"; tail -12 "$L/fp8_decode.log"
    LANEKV_FP8_GEMM_CONFIGS="$OUT/nvidia_h200.json" timeout 60 python3 bench/deepseek_profile.py \
        --llama3-8b --fp8 --batch 1 --context 1024 > "$L/profile_llama_fp8_b1.log" 2>&1
    echo "profile rc=$?"; grep -A16 "device kernels, layer 1" "$L/profile_llama_fp8_b1.log"
    timeout 150 python3 -m bench.sparse_mla_sweep --configs default 64,32,8,2,128,1 64,32,8,2,32,1 \
        32,32,8,2,32,1 32,32,4,2,64,1 --json "$OUT/sparse_mla_sweep_h200.json" > "$L/sparse_mla_sweep.log" 2>&1
    echo "sparse sweep rc=$?"; tail -30 "$L/sparse_mla_sweep.log" ;;
c)
    timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_mla_expand_merge.py \
        tests/kernels/test_mla_latent_store.py tests/kernels/test_mla_decode.py tests/kernels/test_sparse_mla.py \
        tests/decode/test_no_compile.py tests/kernels/test_fp8.py > "$L/gpu_tests_c.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_c.log" | cut -c1-180; tail -1 "$L/gpu_tests_c.log"
    timeout 110 python3 bench/deepseek.py --v2-lite --batches 1 16 64 --parts decode \
        --json "$OUT/deepseek_v2_lite_decode.json" > "$L/deepseek_v2_lite.log" 2>&1
    echo "v2-lite rc=$?"; tail -8 "$L/deepseek_v2_lite.log"
    timeout 50 python3 bench/deepseek_profile.py --v2-lite --batch 1 --context 1024 \
        --json "$OUT/profile_v2_lite_b1.json" > "$L/profile_v2_lite_b1.log" 2>&1
    echo "profile v2-lite b1 rc=$?"; grep -A18 "device kernels, layer 1 " "$L/profile_v2_lite_b1.log"
    timeout 110 python3 bench/fp8.py --only decode --batches 1 16 64 \
        --json "$OUT/fp8_decode_table_h200.json" > "$L/fp8_decode_table.log" 2>&1
    echo "fp8 decode rc=$?"; tail -12 "$L/fp8_decode_table.log"
    timeout 160 python3 bench/dsa_layer.py --json "$OUT/dsa_layer_h200.json" > "$L/dsa_layer.log" 2>&1
    echo "dsa layer rc=$?"; tail -16 "$L/dsa_layer.log" ;;
d)
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_mla_expand_merge.py \
        tests/kernels/test_mla_latent_store.py tests/kernels/test_mla_decode.py tests/kernels/test_sparse_mla.py \
        tests/decode/test_no_compile.py > "$L/gpu_tests_d.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_d.log" | cut -c1-180; tail -1 "$L/gpu_tests_d.log"
    timeout 90 python3 bench/deepseek.py --v2-lite --batches 1 16 64 --parts decode \
        --json "$OUT/deepseek_v2_lite_decode.json" > "$L/deepseek_v2_lite.log" 2>&1
    echo "v2-lite rc=$?"; tail -6 "$L/deepseek_v2_lite.log"
    timeout 100 python3 bench/fp8.py --only decode --batches 1 16 64 \
        --json "$OUT/fp8_decode_table_h200.json" > "$L/fp8_decode_table.log" 2>&1
    echo "fp8 decode rc=$?"; tail -12 "$L/fp8_decode_table.log"
    timeout 100 python3 bench/dsa_layer.py --contexts 8192 131072 --json "$OUT/dsa_layer_h200.json" \
        > "$L/dsa_layer.log" 2>&1
    echo "dsa layer rc=$?"; tail -12 "$L/dsa_layer.log"
    bash "$0" b
    timeout 40 python3 bench/deepseek_profile.py --v2-lite --batch 1 --context 1024 \
        --json "$OUT/profile_v2_lite_b1.json" > "$L/profile_v2_lite_b1.log" 2>&1
    echo "profile v2-lite b1 rc=$?"; grep -A18 "device kernels, layer 1 " "$L/profile_v2_lite_b1.log" ;;
b)
    timeout ${TTFT_S:-150} python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 2 --no-nixl \
        --paths grpc fast --fetch-streams 4 --fetch-relays 4 --json "$OUT/ttft_relays_staged_h200.json" \
        > "$L/ttft_relays_staged.log" 2>&1
    echo "ttft rc=$?"; tail -24 "$L/ttft_relays_staged.log" ;;
esac
