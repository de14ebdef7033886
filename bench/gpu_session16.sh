#!/usr/bin/env bash
# One H200, sixteenth session (1,800 s of device time): what the fifteenth built and could
# not run.
#   c: the cuDNN prefill path (kernels/prefill/sdpa.py): its GPU tests, bench/mla_prefill_sweep.py
#      with the default MLA tiles beside SDPA and the path, then bench/prefill_attention.py:
#      V2-Lite's and Llama-3-8B's prefill at 8k and 32k, cp 1, the Triton kernel
#      against LANEKV_PREFILL_ATTENTION=cudnn on one engine, in A/B pairs.
#   w: the step's GEMV configs tuned in the step (bench/gemv_in_step.py), Llama-3-8B at
#      batch 1, FP8 weights then bf16.
#   h: bench/cudnn_sdpa_host.py without and with TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1, then w.
#   d: the decode step with this session's GEMV tables, every model and batch, with its floor
#      and the bf16 step (bench/fp8.py --only decode), the GEMV GPU tests first.
#   x: the same for DeepSeek-V2-Lite (its q/kv_a, o, lm_head and the dense layer's MLP).
# Usage (repository root, the carried wheels installed): bash bench/gpu_session16.sh PART
source bench/gpu_common.sh s16 c "$@"
case "$part" in
c)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_prefill_sdpa.py \
        > "$L/gpu_tests_c.log" 2>&1
    stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_c.log" | cut -c1-200; tail -1 "$L/gpu_tests_c.log"
    timeout 150 python3 bench/mla_prefill_sweep.py --configs 128,128,8,2 \
        --json "$OUT/mla_prefill_cudnn_path.json" > "$L/mla_sweep.log" 2>&1
    stamp "mla sweep rc=$?"; tail -12 "$L/mla_sweep.log" | cut -c1-150
    timeout 270 python3 bench/prefill_attention.py --json "$OUT/prefill_attention.json" \
        > "$L/prefill_attention.log" 2>&1
    stamp "prefill attention rc=$?"; tail -10 "$L/prefill_attention.log" ;;
h|w)
    if [ "$part" = h ]; then
        timeout 60 python3 bench/cudnn_sdpa_host.py --json "$OUT/cudnn_sdpa_host_dense.json" \
            > "$L/cudnn_host_dense.log" 2>&1
        stamp "cudnn host rc=$?"; tail -4 "$L/cudnn_host_dense.log" | cut -c1-250
        TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 timeout 60 python3 bench/cudnn_sdpa_host.py \
            --json "$OUT/cudnn_sdpa_host_avoid_recompile.json" > "$L/cudnn_host_ragged.log" 2>&1
        stamp "cudnn host, avoid recompile rc=$?"; tail -4 "$L/cudnn_host_ragged.log" | cut -c1-250
    fi
    timeout 260 python3 bench/gemv_in_step.py --model llama3_8b --weights fp8 --batch 1 \
        --time-budget-s 230 --json "$OUT/gemv_in_step_llama_fp8_b1.json" \
        --write-table "$OUT/gemv_in_step_llama_fp8_b1_table.json" > "$L/in_step_fp8.log" 2>&1
    stamp "fp8 rc=$?"; tail -8 "$L/in_step_fp8.log"
    timeout 180 python3 bench/gemv_in_step.py --model llama3_8b --weights bf16 --batch 1 \
        --time-budget-s 150 --json "$OUT/gemv_in_step_llama_bf16_b1.json" > "$L/in_step_bf16.log" 2>&1
    stamp "bf16 rc=$?"; tail -8 "$L/in_step_bf16.log" ;;
x)
    for w in fp8 bf16; do
        timeout 250 python3 bench/gemv_in_step.py --model v2_lite --weights $w --batch 1 \
            --time-budget-s 220 --json "$OUT/gemv_in_step_v2_lite_${w}_b1.json" \
            > "$L/in_step_v2_$w.log" 2>&1
        stamp "v2-lite $w rc=$?"; tail -8 "$L/in_step_v2_$w.log"
    done ;;
d)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8_gemv.py \
        tests/decode/test_dense_gemv_decode.py > "$L/gpu_tests_d.log" 2>&1
    stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_d.log" | cut -c1-200; tail -1 "$L/gpu_tests_d.log"
    timeout 330 python3 bench/fp8.py --only decode --models llama3_8b v2_lite --batches 1 16 64 \
        --json "$OUT/fp8_decode_s16_tables.json" > "$L/fp8_decode.log" 2>&1
    stamp "fp8 decode rc=$?"; grep -E "batch +[0-9]+: step" "$L/fp8_decode.log" | cut -c1-62
    tail -12 "$L/fp8_decode.log" ;;
*)
    echo "unknown part: $part (c, d, h, w, x)" >&2; exit 2 ;;
esac
