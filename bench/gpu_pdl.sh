#!/usr/bin/env bash
# One H200: programmatic dependent launch (kernels/pdl/, LANEKV_PDL) checked and measured.
# Usage (repository root): bash bench/gpu_pdl.sh PART
#   a: the GPU test of graph-replayed decode steps with PDL on against off, the converted
#      kernels' GPU tests with LANEKV_PDL=1, the Llama-3-8B-shaped decode step off/on.
#   b: the FP8 decode step (Llama-3-8B shapes) and the DeepSeek-V2-Lite decode step off/on.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:-a}
L=/tmp/lanekv_logs; mkdir -p "$L"
trap 'tar -C "$L" -czf "$OUT/logs_pdl_$part.tgz" .' EXIT
python3 -c "import lanekv.kernels.pdl" 2>/dev/null || python3 -m pip install -q --no-deps \
    --no-build-isolation --no-index -e . > "$L/install.log" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
case "$part" in
a)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/decode/test_pdl_decode.py \
        > "$L/gpu_pdl_decode.log" 2>&1
    echo "pdl decode test rc=$?"; grep -E "^(FAILED|ERROR)|Error" "$L/gpu_pdl_decode.log" | cut -c1-200 | head
    tail -1 "$L/gpu_pdl_decode.log"
    LANEKV_PDL=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_rmsnorm.py \
        tests/kernels/test_decode_attention.py tests/kernels/test_mla_expand_merge.py \
        tests/kernels/test_mla_latent_store.py tests/kernels/test_moe_decode.py \
        tests/kernels/test_fp8_moe_decode.py tests/kernels/test_fp8_rope_store.py \
        > "$L/gpu_kernels_pdl_on.log" 2>&1
    echo "kernel gpu tests with LANEKV_PDL=1 rc=$?"; grep -E "^(FAILED|ERROR)" "$L/gpu_kernels_pdl_on.log" | cut -c1-200
    tail -1 "$L/gpu_kernels_pdl_on.log"
    timeout 150 python3 bench/decode_step.py --llama3-8b --batches 1 16 --pdl both --hf-batches \
        --json "$OUT/decode_step_pdl_h200.json" > "$L/decode_step.log" 2>&1
    echo "decode_step rc=$?"; grep -A8 "^decode step" "$L/decode_step.log"
    ;;
b)
    timeout 200 python3 bench/fp8.py --only decode --models llama3_8b --batches 1 16 --pdl both \
        --json "$OUT/fp8_decode_pdl_h200.json" > "$L/fp8_decode.log" 2>&1
    echo "fp8 decode rc=$?"; grep -E "batch|wrote" "$L/fp8_decode.log"
    timeout 150 python3 bench/deepseek.py --v2-lite --parts decode --batches 1 16 --pdl both \
        --json "$OUT/deepseek_pdl_h200.json" > "$L/deepseek.log" 2>&1
    echo "deepseek rc=$?"; grep -E "^\| [0-9]|^PDL" "$L/deepseek.log"
    ;;
esac
