#!/usr/bin/env bash
# One device call for issue 20's captured DSA decode: the GPU tests of the captured
# step (GQA, MLA, DSA) and the DSA selection, then the whole-model V3.2-shaped
# decode step (4 layers, 32k context, batch 1/16/64, CUDA graphs). Logs and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/decode/test_decode_graphs.py tests/kernels/test_dsa_select.py \
    tests/kernels/test_dsa_pool_layout.py 2>&1 | tee "$OUT/pytest.log" | tail -15
timeout 200 python3 bench/deepseek.py --v32 --batches 1 16 64 --context 32768 --steps 10 \
    --json "$OUT/deepseek_v32_decode_h200.json" > "$OUT/deepseek_v32.log" 2>&1
echo "deepseek --v32 rc=$?"
tail -8 "$OUT/deepseek_v32.log"
