#!/usr/bin/env bash
# One H200, ninth session (2026-12-03): what the last ~150 s of device time measures.
# Usage (repository root, the carried wheels installed): bash bench/gpu_session9.sh PART
#   a: PDL (kernels/pdl/, LANEKV_PDL): the GPU test of graph-replayed decode steps with PDL on
#      against off, then the Llama-3-8B-shaped FP8 and bf16 steps and the V2-Lite step at
#      batch 1 with PDL off and on (the batch-1 steps are where launch gaps weigh most).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-a}
L=/tmp/lanekv_logs; mkdir -p "$L"
trap 'tar -C "$L" -czf "$OUT/logs_s9_$part.tgz" .' EXIT
case "$part" in
a)
    timeout 55 python3 bench/fp8.py --only decode --models llama3_8b --batches 1 --pdl both \
        --json "$OUT/fp8_decode_pdl_h200.json" > "$L/fp8_decode_pdl.log" 2>&1
    echo "fp8 decode rc=$?"; grep -E "batch" "$L/fp8_decode_pdl.log"
    timeout 40 python3 bench/deepseek.py --v2-lite --parts decode --batches 1 --pdl both \
        --json "$OUT/deepseek_pdl_h200.json" > "$L/deepseek_pdl.log" 2>&1
    echo "v2-lite rc=$?"; grep -E "^\| [0-9]|PDL|pdl" "$L/deepseek_pdl.log" | head -8
    timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/decode/test_pdl_decode.py \
        > "$L/gpu_pdl_decode.log" 2>&1
    echo "pdl decode test rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_pdl_decode.log" | cut -c1-200; tail -1 "$L/gpu_pdl_decode.log" ;;
esac
