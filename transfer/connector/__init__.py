"""The decode side's one entry point to fetch a request's KV (``fetcher.KVFetcher``).

``base`` declares a transport and the one error a fetch raises; ``grpc`` and
``fastpath`` are the transports; ``registry`` names them and builds a
fetcher over a list of them (``make_fetcher``); ``placement`` puts a
received chunk into the pool. Callers above this package never see a transport.
"""
