"""``lanekv serve``: the OpenAI-compatible HTTP front over decode daemons.

The front speaks the OpenAI API (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``) plus ``/health`` and ``/metrics``, and turns each request into
one ``DecodeService.Generate`` call on the decode daemon with the fewest
running requests among the healthy ones. It holds no model weights: only the
checkpoint's tokenizer and chat template, to count and render prompts.
"""
