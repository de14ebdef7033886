#!/usr/bin/env bash
# One H200, tenth session (2026-12-03): the ninth session's kernels that no GPU had run.
# Usage (repository root, the carried wheels installed): bash bench/gpu_session10.sh PART
#   a: PDL (kernels/pdl/): the GPU test of graph-replayed decode steps with PDL on against
#      off; the FP8 Llama-3-8B-shaped and V2-Lite steps at batch 1 off/on. Then the FP8 gemv
#      family: its GPU tests, the decode-row sweep (1 and 4 rows) of Llama-3-8B's linears
#      into a table under $OUT, and the FP8 decode step at batch 1 and 16 with that table.
#   b: the decode steps with the committed table at batch 1/16/64, PDL off and on (FP8
#      Llama-3-8B shapes; V2-Lite bf16), the V2-Lite decode-row sweep (1 and 4 rows) into a
#      table under $OUT and the V2-Lite FP8 step with it, PDL off and on; then the DSA
#      top-k: digit_topk's GPU tests and bench/dsa_layer.py at 8k and 128k, batch 1 and 16.
#   c: the defaults after a and b (PDL auto, digit_topk, the gemv table entries, the block-FP8
#      shared expert fused again): GPU tests (PDL graphs with auto, FP8 decode experts with the
#      shared expert, TP shares on CUDA, no compile while serving); the FP8 decode steps of
#      both models, the V2-Lite FP8 batch-1 profile, the V2-Lite and V3.2-shaped bf16 steps;
#      the MLA prefill attention sweep against SDPA; TTFT through the staged relays as time allows.
#   d: the no-compile GPU tests after the grouped FP8 experts' float16 dot for narrow scale
#      groups; the block-FP8 decode experts' tiles at V2-Lite shapes (bench/moe_decode_sweep.py --fp8).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-a}
L=/tmp/lanekv_logs; mkdir -p "$L"
trap 'tar -C "$L" -czf "$OUT/logs_s10_$part.tgz" .' EXIT
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name())"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
case "$part" in
a)
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/decode/test_pdl_decode.py \
        > "$L/gpu_pdl_decode.log" 2>&1
    stamp "pdl decode test rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_pdl_decode.log" | cut -c1-200; tail -1 "$L/gpu_pdl_decode.log"
    timeout 60 python3 bench/fp8.py --only decode --models llama3_8b --batches 1 --pdl both \
        --json "$OUT/fp8_decode_pdl_h200.json" > "$L/fp8_decode_pdl.log" 2>&1
    stamp "fp8 decode pdl rc=$?"; grep -E " batch +[0-9]+:" "$L/fp8_decode_pdl.log" | head -8
    timeout 60 python3 bench/deepseek.py --v2-lite --parts decode --batches 1 --pdl both \
        --json "$OUT/deepseek_pdl_h200.json" > "$L/deepseek_pdl.log" 2>&1
    stamp "v2-lite pdl rc=$?"; grep -E "^\| [0-9]" "$L/deepseek_pdl.log" | head -4
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8_gemv.py \
        tests/kernels/test_fp8_w8a16.py > "$L/gpu_gemv_tests.log" 2>&1
    stamp "gemv gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_gemv_tests.log" | cut -c1-180; tail -1 "$L/gpu_gemv_tests.log"
    cp kernels/fp8/gemm_tables/nvidia_h200.json "$OUT/nvidia_h200.json"  # merged into, not replaced
    left=$((560 - (SECONDS - t0) - 75)); [ $left -gt 240 ] && left=240
    timeout $((left + 20)) python3 bench/fp8.py --only gemm --sweep --rows 1 4 --models llama3_8b \
        --jobs 14 --time-budget-s $left --write-table "$OUT/nvidia_h200.json" \
        --json "$OUT/gemm_sweep_gemv_h200.json" > "$L/fp8_sweep_gemv.log" 2>&1
    stamp "gemv sweep rc=$? budget ${left}s"; grep -E "^ *llama" "$L/fp8_sweep_gemv.log" | cut -c1-150
    LANEKV_FP8_GEMM_CONFIGS="$OUT/nvidia_h200.json" timeout 70 python3 bench/fp8.py --only decode \
        --models llama3_8b --batches 1 16 --json "$OUT/fp8_decode_gemv_h200.json" > "$L/fp8_decode_gemv.log" 2>&1
    stamp "fp8 decode with the swept table rc=$?"; grep -E " batch +[0-9]+:" "$L/fp8_decode_gemv.log" | head -6 ;;
b)
    timeout 60 python3 bench/fp8.py --only decode --models llama3_8b --batches 1 16 64 --pdl both \
        --json "$OUT/fp8_decode_llama_pdl_h200.json" > "$L/fp8_decode_llama_pdl.log" 2>&1
    stamp "fp8 llama decode rc=$?"; grep -E " batch +[0-9]+:" "$L/fp8_decode_llama_pdl.log"
    timeout 60 python3 bench/deepseek.py --v2-lite --parts decode --batches 1 16 64 --pdl both \
        --json "$OUT/deepseek_v2_lite_pdl_h200.json" > "$L/deepseek_v2_lite_pdl.log" 2>&1
    stamp "v2-lite bf16 rc=$?"; grep -E "^\| [0-9]" "$L/deepseek_v2_lite_pdl.log" | head -6
    cp kernels/fp8/gemm_tables/nvidia_h200.json "$OUT/nvidia_h200.json"
    timeout 120 python3 bench/fp8.py --only gemm --sweep --rows 1 4 --models v2_lite \
        --jobs 14 --time-budget-s 100 --write-table "$OUT/nvidia_h200.json" \
        --json "$OUT/gemm_sweep_gemv_v2_lite_h200.json" > "$L/fp8_sweep_gemv_v2_lite.log" 2>&1
    stamp "v2-lite gemv sweep rc=$?"; grep -E "^ *v2_lite" "$L/fp8_sweep_gemv_v2_lite.log" | cut -c1-150
    LANEKV_FP8_GEMM_CONFIGS="$OUT/nvidia_h200.json" timeout 70 python3 bench/fp8.py --only decode \
        --models v2_lite --batches 1 16 64 --pdl both --json "$OUT/fp8_decode_v2_lite_pdl_h200.json" \
        > "$L/fp8_decode_v2_lite_pdl.log" 2>&1
    stamp "fp8 v2-lite decode rc=$?"; grep -E " batch +[0-9]+:" "$L/fp8_decode_v2_lite_pdl.log"
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_dsa_digit_topk.py \
        tests/kernels/test_dsa_topk.py tests/kernels/test_dsa_select.py > "$L/gpu_dsa_topk.log" 2>&1
    stamp "dsa top-k gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_dsa_topk.log" | cut -c1-180; tail -1 "$L/gpu_dsa_topk.log"
    left=$((570 - (SECONDS - t0))); [ $left -gt 200 ] && left=200
    LANEKV_DSA_TOPK=auto timeout $left python3 -m bench.dsa_layer --kv bf16 fp8 --contexts 8192 131072 \
        --batches 1 16 --json "$OUT/dsa_layer_digit_h200.json" > "$L/dsa_layer_digit.log" 2>&1
    stamp "dsa_layer rc=$? limit ${left}s"; grep -E "^\|" "$L/dsa_layer_digit.log" | tail -24 ;;
c)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/decode/test_pdl_decode.py \
        tests/kernels/test_fp8_moe_decode.py tests/model/test_expert_shards.py tests/decode/test_no_compile.py \
        > "$L/gpu_tests_c.log" 2>&1
    stamp "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_c.log" | cut -c1-200; tail -1 "$L/gpu_tests_c.log"
    timeout 80 python3 bench/fp8.py --only decode --models llama3_8b v2_lite --batches 1 16 64 \
        --json "$OUT/fp8_decode_defaults_h200.json" > "$L/fp8_decode_defaults.log" 2>&1
    stamp "fp8 decode rc=$?"; grep -E " batch +[0-9]+:" "$L/fp8_decode_defaults.log" | cut -c1-90
    timeout 60 python3 bench/deepseek_profile.py --v2-lite --fp8 --batch 1 --context 1024 \
        --json "$OUT/profile_v2_lite_fp8_b1.json" > "$L/profile_v2_lite_fp8_b1.log" 2>&1
    stamp "profile rc=$?"; grep -E ": [0-9]+ launches|per layer:" "$L/profile_v2_lite_fp8_b1.log" | head -6
    timeout 50 python3 bench/deepseek.py --v2-lite --parts decode --batches 1 16 64 \
        --json "$OUT/deepseek_v2_lite_defaults.json" > "$L/deepseek_v2_lite_defaults.log" 2>&1
    stamp "v2-lite rc=$?"; grep -E "^\| [0-9]" "$L/deepseek_v2_lite_defaults.log" | head -3
    timeout 60 python3 bench/deepseek.py --v32 --parts decode --batches 1 16 \
        --json "$OUT/deepseek_v32_defaults.json" > "$L/deepseek_v32_defaults.log" 2>&1
    stamp "v3.2 rc=$?"; grep -E "^\| [0-9]" "$L/deepseek_v32_defaults.log" | head -2
    timeout 170 python3 bench/mla_prefill_sweep.py --job-timeout 60 --precompile-timeout 90 --precompile 14 \
        --json "$OUT/mla_prefill_sweep_h200.json" > "$L/mla_prefill_sweep.log" 2>&1
    stamp "mla prefill sweep rc=$?"; grep -E "tokens: best|wall time" "$L/mla_prefill_sweep.log" | tail -6
    left=$((585 - (SECONDS - t0))); echo "ttft limit ${left}s"
    [ $left -gt 60 ] && timeout $left python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 2 \
        --no-nixl --paths grpc fast --fetch-streams 4 --fetch-relays 4 \
        --json "$OUT/ttft_relays_chunk_seals_h200.json" > "$L/ttft_relays.log" 2>&1
    stamp "ttft rc=$?"; grep -E "^\||GB/s" "$L/ttft_relays.log" | tail -10 ;;
d)
    timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/decode/test_no_compile.py \
        > "$L/gpu_no_compile_d.log" 2>&1
    stamp "no-compile tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_no_compile_d.log" | cut -c1-200; tail -1 "$L/gpu_no_compile_d.log"
    left=$((245 - (SECONDS - t0))); echo "sweep limit ${left}s"
    timeout $left python3 bench/moe_decode_sweep.py --parts gate_up down --fp8 --tokens 1 16 \
        --json "$OUT/moe_decode_sweep_fp8_h200.json" > "$L/moe_decode_sweep_fp8.log" 2>&1
    stamp "fp8 experts sweep rc=$?"; grep -iE "best|^\| (gate_up|down) " "$L/moe_decode_sweep_fp8.log" | tail -30 | cut -c1-160 ;;
*)
    echo "unknown part $part"; exit 2 ;;
esac
