#!/usr/bin/env bash
# One device call for issue 18: the GPU tests of the captured step, the warm-up
# and the kernels, then the serving benchmark and the decode step (no
# transformers run: pass --hf-batches 1 16 for it). Logs and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_rmsnorm.py tests/kernels/test_rope_store.py tests/kernels/test_decode_attention.py \
    tests/kernels/test_store_kv.py tests/decode/test_decode_graphs.py tests/decode/test_no_compile.py \
    tests/prefill/test_no_compile.py 2>&1 | tee "$OUT/pytest.log" | tail -15
timeout 200 python3 bench/serving.py --llama3-8b --concurrency 1 16 64 --prompt-len 1024 --output-len 128 \
    --json "$OUT/serving_h200.json" > "$OUT/serving.log" 2>&1; echo "serving rc=$?"
timeout 80 python3 bench/decode_step.py --llama3-8b --batches 1 16 64 --context 1024 --steps 30 \
    --hf-batches --json "$OUT/decode_step_h200.json" > "$OUT/decode_step.log" 2>&1; echo "decode_step rc=$?"
tail -9 "$OUT/serving.log"; tail -6 "$OUT/decode_step.log"
