"""Block-scaled FP8 (e4m3) kernels: activation quantization, the w8a8 GEMM of a
quantized linear and the routed experts' grouped GEMMs; and the FP8 KV rows
(``kv_rows.py``) with the fused RoPE + quantize + store of new rows (``rope_store.py``).

The weight format is Hugging Face's ``quant_method: fp8``: an e4m3 weight
``[N, K]`` and a float32 ``weight_scale_inv [cdiv(N, block_n), cdiv(K, block_k)]``
(one multiplier per block). Activations are quantized per token in groups of
``block_k`` values, one float32 scale per group, so one k step of a GEMM tile
multiplies one activation scale by one weight scale.
"""
