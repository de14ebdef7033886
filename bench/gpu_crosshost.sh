#!/usr/bin/env bash
# Cross-host KV on one H200 (issue 36), in device calls of under 10 minutes each.
# Logs and JSON under $OUT. Usage (from the repository root, lanekv[nixl] installed):
#   bash bench/gpu_crosshost.sh tests|ttft|transfer
#   tests:    the GPU test of layer-wise reads (the CPU tests cover the rest)
#   ttft:     Llama-3-8B shapes, cp=1, 8k and 32k: colocated, fast path, gRPC with 1/2/4
#             streams per rank, NIXL (GPU memory registered) and NIXL over UCX TCP, each
#             transfer beside the raw rate of its transport measured in the same run
#   transfer: FetchKV and raw gRPC on loopback with 1/2/4 streams per server (32k tokens)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-tests}
case "$part" in
tests)
    timeout 120 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/transfer/grpcfetch/test_layerwise.py \
        > "$OUT/gpu_layerwise.log" 2>&1
    echo "gpu layerwise rc=$?"; tail -8 "$OUT/gpu_layerwise.log" ;;
ttft)
    timeout 560 python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 3 \
        --paths grpc fast nixl nixl_tcp --fetch-streams 1 2 4 \
        --json "$OUT/ttft_crosshost_h200.json" > "$OUT/ttft_crosshost.log" 2>&1
    echo "ttft rc=$?"; grep -v "NIXL INFO" "$OUT/ttft_crosshost.log" | tail -45 ;;
transfer)
    MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 timeout 500 python3 bench/transfer.py \
        --tokens 32768 --servers 1,2 --streams 1,2,4 --json "$OUT/transfer_streams_h200.json" \
        > "$OUT/transfer_streams.log" 2>&1
    echo "transfer rc=$?"; tail -20 "$OUT/transfer_streams.log" ;;
esac
