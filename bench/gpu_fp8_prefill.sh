#!/usr/bin/env bash
# One device call for issue 33 part 5's FP8 prefill (one H200): bench/fp8.py --only prefill,
# DeepSeek-V2-Lite then Llama-3-8B shapes, prefill tokens/s at 8k and 32k with block-FP8
# weights against the same seeded bf16 weights, in one process per model so that each
# stays under five minutes. Logs and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
for model in v2_lite llama3_8b; do
    timeout 290 python3 bench/fp8.py --only prefill --prefill-models "$model" \
        --json "$OUT/fp8_prefill_${model}_h200.json" > "$OUT/fp8_prefill_$model.log" 2>&1
    echo "fp8 prefill $model rc=$?"
    tail -8 "$OUT/fp8_prefill_$model.log"
done
