"""A prefill rank's side of KV transfer: the KVTransfer gRPC service, its page sources,
and the layer-by-layer progress a FetchKV waits on."""
