"""Batch-invariant CPU references: each row's result is independent of the batch.

A CP rank runs its own rows (its query segments of every request of a batch, the
compute padding included) through the model; the single-process run, one prompt.
MKL's float32 GEMM rounds a row differently with the number of rows beside it (a
row of a 3-row GEMM differs from the same row of a 40-row one: measured for row
counts 1-3, 5-7 and 9-11), and attention summed over differently split query
segments or key ranges rounds differently too. Every such bit reaches the next
layer, and one bit of a head's amax moves its float32 FP8 scale: the KV bytes of
a CP prefill could not equal the single-process ones.

The references here reduce every output over the same operands, in the same order,
whatever the batch: ``linear.row_invariant_linear`` (each output a sum over K of
its own row's products), ``linear.RowInvariantLinear`` (a context in which
``F.linear`` on CPU tensors is that), ``attention.blocked_attention`` (online
softmax over key blocks of a fixed size from key 0, each block zero-padded to
full size, so a masked or padded key adds an exact zero). The model's CPU forward
(``AttentionKind.forward``) runs in ``RowInvariantLinear`` and both CPU attention
references (``causal_attention``, ``cp_prefill_attention_ref``) are
``blocked_attention``: on the CPU, a float32 model's CP prefill of any size stores
the single-process run's KV bytes exactly, FP8 or not. (Half precision on the CPU
keeps transformers' op order in ``causal_attention`` and torch's GEMM, which the
half-precision oracle tests track.)
"""
