#!/usr/bin/env bash
# One H200: the fourteenth session's PDL overlap (kernels.pdl): the FP8 GEMV asks L2 for its
# weight slice before its wait (LANEKV_PDL_PREFETCH), and the trigger-first order
# (LANEKV_PDL_EARLY) lets a chain of short kernels be resident at once.
# Usage (repository root, the carried wheels installed): bash bench/gpu_session14.sh PART
#   t: the GPU tests of the GEMV (graph replays in every PDL mode, a weight written by the
#      kernel ahead), the GQA decode attention and the decode daemon's no-compile test.
#   o: the decode step at batch 1, Llama-3-8B and V2-Lite shapes (bf16 and FP8), once per
#      mode: prefetch off/on x early off/on (bench/fp8.py, one JSON each, same run). It ran
#      on d071cb1 (LANEKV_PDL_PREFETCH and LANEKV_PDL_EARLY, since reverted: both slower);
#      so did a run of 0, 1, 2 and 4 prefetched scale groups a program.
#   s: bench/dense_gemv.py (the GEMV on bf16 weights against cuBLAS, one row), then the
#      bf16 V2-Lite step's kernels at batch 16 and 64 (bench/deepseek_profile.py).
#   d: the GPU tests of the GEMV (the 16-bit weight's too) and the no-compile test, then the
#      decode step (bench/fp8.py: Llama-3-8B and V2-Lite, bf16 and FP8, batch 1/16/64), V2-Lite
#      at 16 and 64 with the sort-free experts up to 64 tokens, the V2-Lite bf16 b1 profile.
#   e: the GPU tests of decode steps through the 16-bit GEMV (graphs against eager) and of
#      PDL in the decode step, and the GEMV's 16-bit GPU test.
source bench/gpu_common.sh s14 t "$@"
case "$part" in
t)
    timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8_gemv.py \
        tests/kernels/test_decode_attention.py tests/decode/test_no_compile.py > "$L/gpu_tests_t.log" 2>&1
    stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_t.log" | cut -c1-200; tail -1 "$L/gpu_tests_t.log" ;;
o)
    for mode in 00 10 11 01; do
        LANEKV_PDL_PREFETCH=${mode:0:1} LANEKV_PDL_EARLY=${mode:1:1} timeout 200 python3 bench/fp8.py \
            --only decode --models llama3_8b v2_lite --batches 1 \
            --json "$OUT/decode_b1_prefetch${mode:0:1}_early${mode:1:1}.json" > "$L/decode_$mode.log" 2>&1
        stamp "prefetch=${mode:0:1} early=${mode:1:1} rc=$?"
        grep -E "batch +[0-9]+: step" "$L/decode_$mode.log" | cut -c1-60
    done ;;
s)  # the 16-bit GEMV against cuBLAS at one row, then V2-Lite's bf16 step profiled at 16 and 64
    timeout 420 python3 bench/dense_gemv.py --rows 1 --json "$OUT/dense_gemv_rows1.json" \
        > "$L/dense_gemv.log" 2>&1
    stamp "dense gemv rc=$?"; grep -v -i warn "$L/dense_gemv.log" | tail -11
    for b in 16 64; do
        timeout 100 python3 bench/deepseek_profile.py --v2-lite --batch $b --context 1024 \
            --table-pages 2560 --json "$OUT/prof_v2_lite_b${b}_bf16.json" > "$L/prof_v2_b$b.log" 2>&1
        stamp "profile v2-lite b$b rc=$?"
    done ;;
d)  # the decode step with the 16-bit GEMV in the bf16 linears, the GPU tests first
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8_gemv.py \
        tests/decode/test_no_compile.py > "$L/gpu_tests_d.log" 2>&1
    stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_d.log" | cut -c1-200; tail -1 "$L/gpu_tests_d.log"
    timeout 300 python3 bench/fp8.py --only decode --models llama3_8b v2_lite --batches 1 16 64 \
        --json "$OUT/fp8_decode_dense_gemv.json" > "$L/fp8_decode.log" 2>&1
    stamp "fp8 decode rc=$?"; grep -E "batch +[0-9]+: step" "$L/fp8_decode.log" | cut -c1-62
    # V2-Lite at 64 with the sort-free experts (MOE_DECODE_MAX_TOKENS 64, not 16), same run
    timeout 200 python3 -c "import runpy, sys; import lanekv.model.deepseek as d; \
d.MOE_DECODE_MAX_TOKENS = 64; sys.argv = ['bench/fp8.py', '--only', 'decode', '--models', 'v2_lite', \
'--batches', '16', '64', '--json', '$OUT/v2_lite_decode_sortfree64.json']; \
runpy.run_path('bench/fp8.py', run_name='__main__')" > "$L/sortfree64.log" 2>&1
    stamp "sort-free at 64 rc=$?"; grep -E "batch +[0-9]+: step" "$L/sortfree64.log" | cut -c1-62
    timeout 100 python3 bench/deepseek_profile.py --v2-lite --batch 1 --context 1024 \
        --table-pages 2560 --json "$OUT/prof_v2_lite_b1_bf16.json" > "$L/prof_v2_b1.log" 2>&1
    stamp "profile v2-lite b1 rc=$?" ;;
e)  # the GPU tests of the dense GEMV in the decode step, and the PDL decode tests
    timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/decode/test_dense_gemv_decode.py \
        tests/decode/test_pdl_decode.py tests/kernels/test_fp8_gemv.py -k "dense or unscaled or pdl" \
        > "$L/gpu_tests_e.log" 2>&1
    stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_e.log" | cut -c1-200; tail -1 "$L/gpu_tests_e.log" ;;
*)
    echo "unknown part: $part (t, o, s, d, e)" >&2; exit 2 ;;
esac
