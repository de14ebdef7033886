#!/usr/bin/env bash
# One H200: the fifteenth session had 252 s of device time left, so one call: the GPU tests
# of the decode step's GEMVs as they landed (the dense GEMV's table looked up once per
# device, f1bb816, had not run on a GPU), its graph-replay test and PDL in the step.
#   w: not run this session (no device time was left): the step's GEMV configs tuned in the
#      step (bench/gemv_in_step.py), Llama-3-8B at batch 1, FP8 weights then bf16.
#   x: not run either: the same for DeepSeek-V2-Lite (its q/kv_a, o, lm_head and the dense
#      layer's MLP; the experts run their own kernels).
#   c: not run this session either: the cuDNN prefill path (kernels/prefill/sdpa.py): its GPU
#      tests, bench/mla_prefill_sweep.py with the default MLA tiles beside SDPA and the path,
#      then V2-Lite's and Llama-3-8B's prefill (bf16 and FP8 weights, 8k and 32k) with the
#      Triton kernel and with LANEKV_PREFILL_ATTENTION=cudnn.
# Usage (repository root, the carried wheels installed): bash bench/gpu_session15.sh PART
source bench/gpu_common.sh s15 v "$@"
case "$part" in
v)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/decode/test_dense_gemv_decode.py \
        tests/decode/test_pdl_decode.py tests/kernels/test_fp8_gemv.py -k "dense or unscaled or pdl" \
        > "$L/gpu_tests_v.log" 2>&1
    stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_v.log" | cut -c1-200; tail -1 "$L/gpu_tests_v.log" ;;
w)
    timeout 330 python3 bench/gemv_in_step.py --model llama3_8b --weights fp8 --batch 1 \
        --time-budget-s 300 --json "$OUT/gemv_in_step_llama_fp8_b1.json" \
        --write-table "$OUT/gemv_in_step_llama_fp8_b1_table.json" > "$L/in_step_fp8.log" 2>&1
    stamp "fp8 rc=$?"; tail -8 "$L/in_step_fp8.log"
    timeout 230 python3 bench/gemv_in_step.py --model llama3_8b --weights bf16 --batch 1 \
        --time-budget-s 200 --json "$OUT/gemv_in_step_llama_bf16_b1.json" > "$L/in_step_bf16.log" 2>&1
    stamp "bf16 rc=$?"; tail -8 "$L/in_step_bf16.log" ;;
x)
    for w in fp8 bf16; do
        timeout 280 python3 bench/gemv_in_step.py --model v2_lite --weights $w --batch 1 \
            --time-budget-s 250 --json "$OUT/gemv_in_step_v2_lite_${w}_b1.json" \
            > "$L/in_step_v2_$w.log" 2>&1
        stamp "v2-lite $w rc=$?"; tail -8 "$L/in_step_v2_$w.log"
    done ;;
c)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_prefill_sdpa.py \
        > "$L/gpu_tests_c.log" 2>&1
    stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_c.log" | cut -c1-200; tail -1 "$L/gpu_tests_c.log"
    timeout 300 python3 bench/mla_prefill_sweep.py --configs 128,128,8,2 \
        --json "$OUT/mla_prefill_cudnn_path.json" > "$L/mla_sweep.log" 2>&1
    stamp "mla sweep rc=$?"; tail -4 "$L/mla_sweep.log"
    for attn in triton cudnn; do
        LANEKV_PREFILL_ATTENTION=$attn timeout 280 python3 bench/fp8.py --only prefill \
            --prefill-models v2_lite llama3_8b --prefill-repeat 2 \
            --json "$OUT/prefill_attention_$attn.json" > "$L/prefill_$attn.log" 2>&1
        stamp "prefill $attn rc=$?"; grep -i "tok/s" "$L/prefill_$attn.log" | cut -c1-100
    done ;;
*)
    echo "unknown part: $part (v, w, x, c)" >&2; exit 2 ;;
esac
