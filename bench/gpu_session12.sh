#!/usr/bin/env bash
# One H200: what the twelfth session built without device time (it had none).
# Usage (repository root, the carried wheels installed): bash bench/gpu_session12.sh PART
#   b [N...]: TTFT over gRPC with N streams and N relays a rank, now with one receiver
#      process per stream (the eleventh session's 8-stream rows received 4 of them in
#      threads of the decode daemon); 4 and 8 unless named.
#   t: the GPU tests of the receiver processes and the layer-wise gRPC fetch.
source bench/gpu_common.sh s12 b "$@"
case "$part" in
b)
    shift || true
    for n in ${@:-4 8}; do
        timeout 270 python3 bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --repeat 2 --no-nixl \
            --paths grpc fast --fetch-streams $n --fetch-relays $n \
            --json "$OUT/ttft_streams${n}_receivers.json" > "$L/ttft_streams$n.log" 2>&1
        stamp "ttft with $n streams and relays rc=$?"; grep -E "^ +[0-9]+ +(colocated|grpc|fast)" "$L/ttft_streams$n.log"
    done ;;
t)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/transfer/grpcfetch/test_receivers.py \
        tests/transfer/grpcfetch/test_layerwise.py > "$L/gpu_tests_t.log" 2>&1
    stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_tests_t.log" | cut -c1-200; tail -1 "$L/gpu_tests_t.log" ;;
*)
    echo "unknown part: $part (b, t)" >&2; exit 2 ;;
esac
