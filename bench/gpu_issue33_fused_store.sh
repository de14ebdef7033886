#!/usr/bin/env bash
# One device call (one H200) for issue 33's fused FP8 store: the GPU tests of the fused
# RoPE + FP8 quantize + store kernels (bit for bit against their references, bf16 and
# float32), mla_rope without a key, the FP8 row kernels, the prefill attention kernels
# against the (now blocked) reference, the FP8-KV end to end of the three attention kinds;
# then the benchmark of the fused store against the unfused launches. Logs and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_fp8_rope_store.py tests/kernels/test_rope_store.py \
    tests/kernels/test_fp8_kv.py tests/kernels/test_prefill_attention.py tests/test_fp8_kv_e2e.py \
    2>&1 | tee "$OUT/pytest.log" | tail -15
timeout 150 python3 bench/fp8_rope_store.py --json "$OUT/fp8_rope_store_h200.json" \
    > "$OUT/fp8_rope_store.log" 2>&1
echo "fp8_rope_store rc=$?"
cat "$OUT/fp8_rope_store.log"
