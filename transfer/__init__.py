"""KV transfer, one subpackage per concern: ``protocol`` (the layout contract, manifest,
wire codec and fast-path descriptors; no gRPC), ``rank`` (a prefill rank's KVTransfer
server and its page sources), ``grpcfetch`` (the decode side's gRPC fetch: retries,
receiver processes, placers), ``fastpath`` (same-host copies from a mapped pool), and
``errors`` (what a fetch raises). Import the submodules directly.
"""
