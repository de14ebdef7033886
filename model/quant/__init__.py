"""Quantized weights: the checkpoint's ``quantization_config`` (``config.py``) and
the layers that run its tensors as stored (``linear.py``)."""
