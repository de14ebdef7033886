#!/usr/bin/env bash
# One H200, issue 33 (the gemv family and the fused SiLU down projection). Each part fits
# one device call of at most 10 minutes; logs go into one archive per part under $OUT,
# JSON files one by one, the short tables to stdout. Nothing here writes the committed
# table: the sweep's table goes to $OUT, the decode step reads it from there.
# Usage (repository root, the carried wheels installed): bash bench/gpu_gemv.sh PART
#   a: the GPU tests of the gemv family, the fused SiLU down projection and every family;
#      the decode-row sweep (1, 4 and 16 rows: gemv at 1 and 4) of Llama-3-8B's linears,
#      each timed as the step runs it (the down projection with its SiLU).
#   b: the FP8 decode step at batch 1 and 16 with part a's table (carried back into the
#      checkout; OUT_TABLE names it), and the batch-1 profile.
set -u
export PYTHONUNBUFFERED=1
part=${1:-a}
L=/tmp/lanekv_logs; mkdir -p "$L"
trap 'tar -C "$L" -czf "$OUT/logs_gemv_$part.tgz" .' EXIT
case "$part" in
a)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8_gemv.py \
        tests/kernels/test_fp8.py tests/kernels/test_fp8_w8a16.py > "$L/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests.log" | cut -c1-180; tail -1 "$L/gpu_tests.log"
    cp kernels/fp8/gemm_tables/nvidia_h200.json "$OUT/nvidia_h200.json"  # merged into, not replaced
    timeout 400 python3 bench/fp8.py --only gemm --sweep --rows 1 4 16 --models llama3_8b \
        --time-budget-s 380 --write-table "$OUT/nvidia_h200.json" \
        --json "$OUT/gemm_sweep_gemv_h200.json" > "$L/fp8_sweep_gemv.log" 2>&1
    echo "sweep rc=$?"; grep -E "^ *llama" "$L/fp8_sweep_gemv.log" | cut -c1-150 ;;
b)
    : "${OUT_TABLE:?set OUT_TABLE to the table part a wrote}"
    LANEKV_FP8_GEMM_CONFIGS="$OUT_TABLE" timeout 200 python3 bench/fp8.py --only decode \
        --models llama3_8b --batches 1 16 --json "$OUT/fp8_decode_gemv_h200.json" > "$L/fp8_decode.log" 2>&1
    echo "fp8 decode rc=$?"; tail -6 "$L/fp8_decode.log"
    LANEKV_FP8_GEMM_CONFIGS="$OUT_TABLE" timeout 90 python3 bench/deepseek_profile.py \
        --llama3-8b --fp8 --batch 1 --context 1024 > "$L/profile_llama_fp8_b1.log" 2>&1
    echo "profile rc=$?"; grep -A16 "device kernels, layer 1" "$L/profile_llama_fp8_b1.log" ;;
*)
    echo "unknown part $part (a or b)"; exit 2 ;;
esac
