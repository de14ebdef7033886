#!/usr/bin/env bash
# One H200, seventh session (2026-12-02): what the sixth session built without a GPU and
# the figures the fifth left unmeasured (bench/gpu_session6.sh, its logs packed into one
# archive per part). Each part fits one device call of
# at most 10 minutes; logs and JSON go under $OUT, the short tables to stdout.
# Usage (repository root, the carried wheels installed): bash bench/gpu_session7.sh PART
#   check: the GPU tests of every kernel and path changed since its last GPU run, then
#          the V2-Lite decode step (issue 37).
#   fp8:   issue 33: where the FP8 Llama step's time goes at batch 1 and 64 (per kernel,
#          configs printed), the decode linears with and without in-GEMM quantization,
#          FP8-KV TTFT, the fused RoPE + FP8 store, FP8 prefill.
#   xfer:  issue 36 with the new UCX defaults end to end (NIXL beside gRPC and the fast
#          path), issue 37's DSA layer against dense MLA.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-check}
# The device returns at most 8 files: the JSON files come back one by one, the logs in one archive.
L=/tmp/lanekv_logs; mkdir -p "$L"
trap 'tar -C "$L" -czf "$OUT/logs_$part.tgz" .' EXIT
case "$part" in
check)
    timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/decode/test_no_compile.py \
        tests/prefill/test_no_compile.py tests/kernels/test_fp8.py tests/kernels/test_fp8_moe_decode.py \
        tests/kernels/test_moe_decode.py tests/kernels/test_fp8_rope_store.py tests/decode/test_tp.py \
        tests/model/test_ep_dispatch.py tests/decode/test_warm_up.py > "$L/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests.log" | cut -c1-180; tail -1 "$L/gpu_tests.log"
    timeout 120 python3 bench/deepseek.py --v2-lite --batches 1 16 64 --parts decode \
        --json "$OUT/deepseek_v2_lite_decode.json" > "$L/deepseek_v2_lite.log" 2>&1
    echo "v2-lite rc=$?"; tail -8 "$L/deepseek_v2_lite.log" ;;
final)  # the merged TP fixes on one GPU, then gRPC TTFT after the FetchKV CPU cuts
    timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model/test_expert_shards.py \
        tests/decode/test_tp.py -k "test_tp_on_one_gpu_equals_one_rank or expert" > "$L/gpu_tests_final.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_final.log" | cut -c1-180; tail -1 "$L/gpu_tests_final.log"
    timeout 200 python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 2 --paths grpc fast \
        --fetch-streams 4 --no-nixl --json "$OUT/ttft_grpc_final_h200.json" > "$L/ttft_grpc_final.log" 2>&1
    echo "ttft rc=$?"; tail -30 "$L/ttft_grpc_final.log" ;;
fp8b)  # the merged fixes' GPU tests (FP8 GEMM, DSA selection), then part fp8, then V2-Lite's profile
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8.py \
        tests/kernels/test_fp8_gemm_prefill.py tests/kernels/test_dsa_select.py tests/kernels/test_dsa_topk.py \
        tests/kernels/test_dsa_pool_layout.py tests/decode/test_decode_graphs.py \
        "tests/decode/test_tp.py::test_tp_on_one_gpu_equals_one_rank[llama_fp8-2-auto]" > "$L/gpu_tests_fp8b.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_fp8b.log" | cut -c1-180; tail -1 "$L/gpu_tests_fp8b.log"
    FP8_PROFILE_BATCHES=1 bash "$0" fp8
    timeout 50 python3 bench/deepseek_profile.py --v2-lite --batch 1 --context 1024 \
        --json "$OUT/profile_v2_lite_b1.json" > "$L/profile_v2_lite_b1.log" 2>&1
    echo "profile v2-lite b1 rc=$?"; tail -45 "$L/profile_v2_lite_b1.log" ;;
fp8)
    for b in ${FP8_PROFILE_BATCHES:-1 64}; do
        timeout 100 python3 bench/deepseek_profile.py --llama3-8b --fp8 --batch $b --context 1024 \
            --json "$OUT/profile_llama_fp8_b$b.json" > "$L/profile_llama_fp8_b$b.log" 2>&1
        echo "profile fp8 b$b rc=$?"; tail -40 "$L/profile_llama_fp8_b$b.log"
    done
    timeout 120 python3 bench/fp8.py --only decode --rows 1 16 64 \
        --json "$OUT/fp8_decode_h200.json" > "$L/fp8_decode.log" 2>&1
    echo "fp8 decode rc=$?"; tail -16 "$L/fp8_decode.log"
    timeout 100 python3 bench/fp8_kv.py --llama3-8b --tokens 32768 --repeat 2 \
        --json "$OUT/fp8_kv_ttft_h200.json" > "$L/fp8_kv.log" 2>&1
    echo "fp8 kv rc=$?"; tail -12 "$L/fp8_kv.log"
    timeout 60 python3 bench/fp8_rope_store.py --json "$OUT/fp8_rope_store_h200.json" > "$L/fp8_rope_store.log" 2>&1
    echo "rope store rc=$?"; tail -8 "$L/fp8_rope_store.log" ;;
xfer)
    timeout 300 python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 2 \
        --paths grpc fast nixl nixl_tcp --fetch-streams 4 \
        --json "$OUT/ttft_crosshost_h200.json" > "$L/ttft_crosshost.log" 2>&1
    echo "ttft rc=$?"; grep -v "NIXL INFO" "$L/ttft_crosshost.log" | tail -24
    timeout 200 python3 bench/dsa_layer.py --json "$OUT/dsa_layer_h200.json" > "$L/dsa_layer.log" 2>&1
    echo "dsa layer rc=$?"; tail -16 "$L/dsa_layer.log" ;;
esac
