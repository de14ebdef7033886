"""What both sides of a KV transfer agree on, as data: the layout contract, the page
manifest, the wire codec and the fast-path descriptors. No gRPC and no daemon code."""
