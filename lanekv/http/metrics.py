"""The front's Prometheus metrics (``runtime.metrics``' registry and text format).

Requests by route and HTTP status, prompt and completion tokens, the time to
each request's first token as the front sees it, and per decode daemon its
running requests, requests handed to it and whether it is in rotation.
"""

from __future__ import annotations

from lanekv.http.backends import Backends
from lanekv.runtime.metrics import CONTENT_TYPE, Registry

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class FrontMetrics:
    CONTENT_TYPE = CONTENT_TYPE

    def __init__(self, backends: Backends) -> None:
        self.registry = r = Registry()
        self._requests = r.counter("lanekv_http_requests_total", "HTTP requests by route and status",
                                   ("route", "status"))
        self._tokens = r.counter("lanekv_http_tokens_total", "tokens of answered requests", ("kind",))
        self._ttft = r.histogram("lanekv_http_time_to_first_token_seconds",
                                 "from a request's arrival to its first token", TTFT_BUCKETS)
        running = r.gauge("lanekv_http_decode_running", "requests running on each decode daemon",
                          ("decode",))
        served = r.gauge("lanekv_http_decode_served", "requests handed to each decode daemon",
                         ("decode",))
        healthy = r.gauge("lanekv_http_decode_healthy", "1 while a decode daemon is in rotation",
                          ("decode",))
        picks = r.gauge("lanekv_prefix_routed_picks", "decode daemon picks since start; hit: of one "
                        "remembered to have seen a prefix of the prompt; evicted: replies showing a "
                        "remembered prefix was gone there (forgotten since)", ("followed",))
        picks.labels(followed="any").set_function(lambda: backends.picks)
        picks.labels(followed="hit").set_function(lambda: backends.picks_on_hit)
        picks.labels(followed="evicted").set_function(lambda: backends.picks_on_stale)
        for m in backends.members:
            running.labels(decode=m.endpoint).set_function(lambda m=m: m.running)
            served.labels(decode=m.endpoint).set_function(lambda m=m: m.served)
            healthy.labels(decode=m.endpoint).set_function(lambda m=m: float(m.healthy))

    def request(self, route: str, status: str) -> None:
        self._requests.labels(route=route, status=status).inc()

    def tokens(self, prompt: int, completion: int) -> None:
        self._tokens.labels(kind="prompt").inc(prompt)
        self._tokens.labels(kind="completion").inc(completion)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def render(self) -> str:
        return self.registry.render()
