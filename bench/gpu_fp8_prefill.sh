#!/usr/bin/env bash
# A device call for issue 33 part 5's FP8 prefill (one H200), under five minutes:
# `bash bench/gpu_fp8_prefill.sh v2_lite` (or llama3_8b) runs bench/fp8.py --only prefill
# for that model: prefill tokens/s at 8k and 32k with block-FP8 weights against the same
# seeded bf16 weights in the same process. Log and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
model="${1:-}"
if [ "$model" != v2_lite ] && [ "$model" != llama3_8b ]; then
    echo "usage: bench/gpu_fp8_prefill.sh v2_lite|llama3_8b" >&2
    exit 2
fi
timeout 290 python3 bench/fp8.py --only prefill --prefill-models "$model" \
    --json "$OUT/fp8_prefill_${model}_h200.json" > "$OUT/fp8_prefill_$model.log" 2>&1
echo "fp8 prefill $model rc=$?"
tail -8 "$OUT/fp8_prefill_$model.log"
