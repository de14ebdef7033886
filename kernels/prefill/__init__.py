"""The context-parallel prefill attention: causal varlen attention for one rank's
query rows (``cp_prefill_attention`` in ``attention.py``, beside its torch reference
and the contract it checks in ``reference.py``). The Triton kernel is ``kernel.py``,
built from the per-key-block steps of ``steps.py``; its tiles and variant switches are
the launch configs of ``config.py``.
"""
