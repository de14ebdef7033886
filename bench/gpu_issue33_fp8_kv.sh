#!/usr/bin/env bash
# One device call for issue 33's FP8 KV pages (one H200): the GPU tests of the FP8
# quantization and packing kernels (bit for bit against their references), the decode
# kernels reading FP8 rows, the FP8-KV end to end of the three attention kinds, then the
# benchmark: KV bytes per token and TTFT over gRPC and the fast path at 8k and 32k,
# FP8 KV against bf16 KV (Llama-3-8B shapes, dummy weights). Logs and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_fp8.py tests/kernels/test_fp8_kv.py tests/test_fp8_kv_e2e.py \
    2>&1 | tee "$OUT/pytest.log" | tail -15
timeout 280 python3 bench/fp8_kv.py --llama3-8b --tokens 8192 32768 --repeat 3 \
    --json "$OUT/fp8_kv_ttft_h200.json" > "$OUT/fp8_kv.log" 2>&1
echo "fp8_kv rc=$?"
tail -12 "$OUT/fp8_kv.log"
