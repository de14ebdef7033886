#!/usr/bin/env bash
# One H200: the thirteenth session's split reductions finished by their last split
# (kernels/arrivals.py: the FP8 GEMV's split-K reduce, no launch of its own).
# Usage (repository root, the carried wheels installed): bash bench/gpu_session13.sh PART
#   t: the GPU tests of the GEMV and the GQA decode attention (graph replays with and without PDL) and the
#      no-compile test of the decode daemon.
#   m: bench/split_reductions.py: the GEMV with the reduce launch and with the last split's
#      reduction, Llama-3-8B's linears at one row. (Its runs on ab1bc75 and ad2a12b also
#      timed the GQA decode attention's variants of those commits, since reverted.)
#   d: the FP8 decode step (Llama-3-8B and V2-Lite shapes, batch 1/16/64, our bf16 step and
#      the FP8 floor in the same run), then the batch-1 kernel profile of both Llama steps
#      at a captured graph's table width.
source bench/gpu_common.sh s13 t "$@"
case "$part" in
t)
    timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8_gemv.py \
        tests/kernels/test_decode_attention.py tests/decode/test_no_compile.py > "$L/gpu_tests_t.log" 2>&1
    stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_t.log" | cut -c1-200; tail -1 "$L/gpu_tests_t.log" ;;
m)
    timeout 300 python3 bench/split_reductions.py --json "$OUT/split_reductions.json" > "$L/split_reductions.log" 2>&1
    stamp "split reductions rc=$?"; grep -v -i warn "$L/split_reductions.log" | tail -16 ;;
d)
    timeout 300 python3 bench/fp8.py --only decode --models llama3_8b v2_lite --batches 1 16 64 \
        --json "$OUT/fp8_decode_last_split.json" > "$L/fp8_decode.log" 2>&1
    stamp "fp8 decode rc=$?"; grep -E "batch +[0-9]+: step" "$L/fp8_decode.log" | head -20
    for a in "--fp8" ""; do
        n=llama_b1${a:+_fp8}
        timeout 120 python3 bench/deepseek_profile.py --llama3-8b $a --batch 1 --context 1024 \
            --table-pages 128 --json "$OUT/prof_$n.json" > "$L/prof_$n.log" 2>&1
        stamp "profile $n rc=$?"
    done ;;
*)
    echo "unknown part: $part (t, m, d)" >&2; exit 2 ;;
esac
