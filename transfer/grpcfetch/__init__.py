"""The decode side's KV fetch over gRPC: one stream per owner rank, checked, retried and
resumed, received in threads or receiver processes, placed by one thread per rank."""
