"""The decode side's same-host fast path: a prefill rank's pool mapped in place, its
pages copied by descriptor and checked by digest (gRPC stays the control plane)."""
