#!/usr/bin/env bash
# Device calls for the DSA decode layer (issue 37 part 4; one H200), each under five
# minutes: `bash bench/gpu_dsa_layer.sh tests` runs the GPU tests of the paged index
# scoring (scores and keys on the DSA plane, long contexts, every launch config the bench
# sweeps), the selection and radix_topk against their references; `... bench` runs
# bench/dsa_layer.py: per V3.2 layer at 8k/32k/128k, batch 1 and 16, bf16 and FP8 latent
# rows, index scoring (with its byte floor), top-k, sparse decode, their sum and the
# captured chain against the dense MLA decode kernel. Logs and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
case "${1:-}" in
tests)
    timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/kernels/test_indexer.py tests/kernels/test_dsa_select.py \
        tests/kernels/test_dsa_topk.py tests/kernels/test_dsa_pool_layout.py \
        tests/kernels/test_sparse_mla.py 2>&1 | tee "$OUT/pytest.log" | tail -15 ;;
bench)
    timeout 290 python3 -m bench.dsa_layer --json "$OUT/dsa_layer_h200.json" \
        > "$OUT/dsa_layer.log" 2>&1
    echo "dsa_layer rc=$?"
    tail -60 "$OUT/dsa_layer.log" ;;
*)
    echo "usage: bench/gpu_dsa_layer.sh tests|bench" >&2
    exit 2 ;;
esac
