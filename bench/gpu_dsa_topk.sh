#!/usr/bin/env bash
# One device call (one H200) for the DSA decode top-k (issue 37 item 4): the GPU tests
# of digit_topk, radix_topk and the selection against their references, then
# bench/dsa_layer.py at 8k and 128k, batch 1 and 16, bf16 latent rows, with the old and
# promoted scoring configs and digit_topk's launch configs (table topk_sweep) beside
# radix_topk and torch.topk. Logs and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1 LANEKV_DSA_TOPK=${LANEKV_DSA_TOPK:-auto}  # the DSA totals through the shape rule
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_dsa_digit_topk.py \
    tests/kernels/test_dsa_topk.py tests/kernels/test_dsa_select.py 2>&1 \
    | tee "$OUT/pytest.log" | tail -8
timeout 330 python3 -m bench.dsa_layer --kv bf16 --contexts 8192 131072 --batches 1 16 \
    --score-configs 64,4,4,3 32,4,4,3 64,4,4,2 --json "$OUT/dsa_layer_h200.json" > "$OUT/dsa_layer.log" 2>&1
echo "dsa_layer rc=$?"
tail -40 "$OUT/dsa_layer.log"
