"""The lanekv gRPC API: ``lanekv.proto`` (package ``lanekv.v1``) and its generated modules.

Regenerate with ``make proto`` (``python proto/generate.py``). Only ``transfer/``
and the daemons' service classes import the generated modules.
"""
