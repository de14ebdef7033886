"""KV transfer: the layout contract and its fingerprint (``contract``), the wire codec
(``wire``), and the gRPC KVTransfer server (``server``) and client (``client``).

Import the submodules directly; ``contract`` and ``wire`` do not import gRPC.
"""
