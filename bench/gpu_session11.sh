#!/usr/bin/env bash
# One H200: what the tenth session built after its device time was spent.
# Usage (repository root, the carried wheels installed): bash bench/gpu_session11.sh PART
#   a: GPU tests (no compile while serving with PDL auto and the float16 grouped FP8 dots;
#      the one-token FP8 expert GEMVs); the one-token FP8 experts, tensor cores against the
#      GEMVs at each launch config; the V2-Lite FP8 step at batch 1 and 16 with the FP8
#      expert tile table, GEMVs off and on; the DSA layer with digit_topk's width-chosen knobs.
#   b [N...]: TTFT over gRPC with more streams and relays a rank (the tenth session's relays
#      ran at about 60% of their rate alone while the prefill ran: BENCHMARKS.md), 4 and 8
#      each unless named.
#   c: the GPU tests of digit_topk with lens; the DSA layer again (the captured width now
#      reads each row's own keys); the V2-Lite FP8 step at batch 1/16/64 with its defaults;
#      where the warp-specialized prefill attention goes wrong (bench/probe_ws_prefill.py).
#   t1: the Llama-3-8B decode step of the tree before decode TP (969a749^) and of this
#      tree, alternating, in one call (issue 35: T=1 as fast as before).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-a}
L=/tmp/lanekv_logs; mkdir -p "$L"
trap 'tar -C "$L" -czf "$OUT/logs_s11_$part.tgz" .' EXIT
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
case "$part" in
a)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/decode/test_no_compile.py \
        tests/kernels/test_fp8_moe_gemv.py tests/kernels/test_fp8_moe_decode.py > "$L/gpu_tests_a.log" 2>&1
    stamp "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_a.log" | cut -c1-200; tail -1 "$L/gpu_tests_a.log"
    timeout 90 python3 bench/moe_decode_sweep.py --fp8 --parts gemv --tokens 1 \
        --json "$OUT/moe_gemv_sweep_h200.json" > "$L/moe_gemv_sweep.log" 2>&1
    stamp "gemv sweep rc=$?"; grep -E "^\| (tensor|gemv)" "$L/moe_gemv_sweep.log" | cut -c1-150
    for on in 0 1; do
        LANEKV_FP8_MOE_GEMV=$on timeout 60 python3 bench/fp8.py --only decode --models v2_lite \
            --batches 1 16 --json "$OUT/fp8_decode_v2_lite_gemv$on.json" > "$L/fp8_decode_gemv$on.log" 2>&1
        stamp "v2-lite fp8 decode, gemv=$on rc=$?"; grep -E " batch +[0-9]+:" "$L/fp8_decode_gemv$on.log" | cut -c1-90
    done
    timeout 150 python3 -m bench.dsa_layer --kv bf16 --contexts 8192 131072 --batches 1 16 \
        --score-configs --topk-configs --json "$OUT/dsa_layer_h200.json" > "$L/dsa_layer.log" 2>&1
    stamp "dsa layer rc=$?"; grep -E "dense" "$L/dsa_layer.log" | head -4 ;;
b)
    for n in ${2:-4 8}; do
        timeout 270 python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 2 --no-nixl \
            --paths grpc fast --fetch-streams $n --fetch-relays $n \
            --json "$OUT/ttft_streams$n.json" > "$L/ttft_streams$n.log" 2>&1
        stamp "ttft with $n streams and relays rc=$?"; grep -E "^ +[0-9]+ +(colocated|grpc|fast)" "$L/ttft_streams$n.log"
    done ;;
c)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_dsa_digit_topk.py \
        > "$L/gpu_tests_c.log" 2>&1
    stamp "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_c.log" | cut -c1-200; tail -1 "$L/gpu_tests_c.log"
    timeout 120 python3 -m bench.dsa_layer --kv bf16 --contexts 8192 131072 --batches 1 16 \
        --json "$OUT/dsa_layer_lens_h200.json" > "$L/dsa_layer_lens.log" 2>&1
    stamp "dsa layer rc=$?"; grep -E "dense" "$L/dsa_layer_lens.log" | head -4
    timeout 90 python3 bench/fp8.py --only decode --models v2_lite --batches 1 16 64 \
        --json "$OUT/fp8_decode_v2_lite_defaults.json" > "$L/fp8_decode_defaults.log" 2>&1
    stamp "v2-lite fp8 decode rc=$?"; grep -E " batch +[0-9]+:" "$L/fp8_decode_defaults.log" | cut -c1-90
    timeout 120 python3 bench/probe_ws_prefill.py > "$L/probe_ws.log" 2>&1
    stamp "ws probe rc=$?"; cut -c1-170 "$L/probe_ws.log" | grep -v Warning | tail -40 ;;
ws)
    timeout 200 python3 bench/probe_ws_prefill.py --json "$OUT/probe_ws.json" > "$L/probe_ws.log" 2>&1
    stamp "ws probe rc=$?"; cut -c1-170 "$L/probe_ws.log" | grep -v Warning | tail -40 ;;
topk)
    # digit_topk's launch knobs over a captured step's wide table with the rows' lengths
    timeout 240 python3 -m bench.dsa_layer --kv bf16 --contexts 8192 32768 131072 --batches 1 16 \
        --score-configs --topk-configs 1024,1024,1,32,4 2048,2048,2,32,8 512,512,1,32,4 \
        512,512,1,64,4 1024,1024,2,32,4 1024,1024,1,16,4 2048,2048,1,32,8 \
        --json "$OUT/dsa_topk_lens_sweep.json" > "$L/dsa_topk_lens.log" 2>&1
    stamp "dsa topk sweep rc=$?"; grep -E "dense" "$L/dsa_topk_lens.log" | head -6
    grep -A60 "digit_topk launch configs" "$L/dsa_topk_lens.log" | cut -d'|' -f2-12 | grep -v "^---" ;;
dsa)
    timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_dsa_digit_topk.py \
        > "$L/gpu_tests_dsa.log" 2>&1
    stamp "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_dsa.log" | cut -c1-200; tail -1 "$L/gpu_tests_dsa.log"
    timeout 150 python3 -m bench.dsa_layer --kv bf16 --contexts 8192 32768 131072 --batches 1 16 \
        --score-configs --topk-configs --json "$OUT/dsa_layer_lens_knobs.json" > "$L/dsa_layer_knobs.log" 2>&1
    stamp "dsa layer rc=$?"; grep -E "dense" "$L/dsa_layer_knobs.log" | head -6 ;;
t1)
    # Issue 35's T=1 check in one run: the tree before decode TP landed (969a749^, put in
    # .extra/baseline by `git archive`) against this one, same bench, same process setup.
    old=/tmp/old_tree; mkdir -p $old/src && cp -r .extra/baseline/bench $old/src/
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $old/site \
        ./.extra/baseline > "$L/old_install.log" 2>&1; stamp "old tree installed rc=$?"
    for tree in old new old new; do
        if [ $tree = old ]; then
            (cd $old/src && PYTHONPATH=$old/site:$PYTHONPATH timeout 150 python3 bench/decode_step.py \
                --llama3-8b --batches 1 16 64 --context 1024 --runs 5 --hf-batches \
                --json "$OUT/decode_step_$tree$((SECONDS % 1000)).json" > "$L/decode_step_$tree.$SECONDS.log" 2>&1)
        else
            timeout 150 python3 bench/decode_step.py --llama3-8b --batches 1 16 64 --context 1024 \
                --runs 5 --hf-batches --json "$OUT/decode_step_$tree$((SECONDS % 1000)).json" \
                > "$L/decode_step_$tree.$SECONDS.log" 2>&1
        fi
        stamp "decode step, $tree tree rc=$?"
    done
    grep -H -E "^ +(1|16|64) +(on|off|auto|-)? " "$L"/decode_step_*.log | sed "s|.*decode_step_||" ;;
*)
    echo "unknown part $part"; exit 2 ;;
esac
