"""bench/serving.py's figures from a fake server: TTFT, ITL (a reply of k
tokens counts k gaps), percentiles, tokens/s, errors and the daemon's split."""

from __future__ import annotations

import time

from bench.serving import Outcome, Request, run_level


def test_run_level_figures_from_known_arrivals():
    def send(req: Request) -> Outcome:
        sent = time.perf_counter() - 1.0  # as if sent a second ago
        if req.output_len == 0:
            return Outcome(sent, [], "UNAVAILABLE: down")
        # first token after 100 ms, then a reply of 1 token after 10 ms and one of 2 after 20 ms
        stages = {"prefill_ms": 80.0 + len(req.prompt), "compute_ms": 70.0}
        return Outcome(sent, [(sent + 0.1, 1), (sent + 0.11, 1), (sent + 0.13, 2)], None, stages)

    reqs = [Request([1, 2, 3], 4)] * 2 + [Request([1, 2], 4)] * 3 + [Request([1], 0)]
    row = run_level(send, reqs, concurrency=2, rate=float("inf"), seed=0)
    assert row["completed"] == 5 and row["errors"] == ["UNAVAILABLE: down"]
    assert row["output_tokens"] == 20
    assert abs(row["ttft_ms_p50"] - 100) < 1e-6
    assert abs(row["itl_ms_p50"] - 10) < 1e-6 and abs(row["itl_ms_p99"] - 10) < 1e-6
    assert abs(row["e2e_ms_p99"] - 130) < 1e-6
    assert (row["ttft_ms_n"], row["itl_ms_n"], row["e2e_ms_n"]) == (5, 15, 5)  # each percentile's samples
    assert row["output_tokens_per_s"] > 0 and row["concurrency"] == 2
    # The daemon's split of the completed requests, by median (the failed one has none).
    assert row["stages_ms_p50"] == {"prefill_ms": 82.0, "compute_ms": 70.0}


def test_new_shapes_ratio_of_the_first_request_per_length():
    import argparse

    from bench.serving import _new_shapes

    seen: set[int] = set()

    def send(req: Request) -> Outcome:  # the first of each length takes 150 ms, later ones 100
        sent = time.perf_counter() - 1.0
        ttft = 0.1 if len(req.prompt) in seen else 0.15
        seen.add(len(req.prompt))
        return Outcome(sent, [(sent + ttft, 1)], None, {"prefill_ms": ttft * 900})

    args = argparse.Namespace(prompt_len=64, output_len=2, range_ratio=0.0, new_shapes=3)
    got = _new_shapes(send, args, vocab=100)
    assert [s["prompt_len"] for s in got["new_shapes"]] == [49, 43, 61]
    assert all(abs(s["ratio"] - 1.5) < 1e-9 and abs(s["later_max_ratio"] - 1) < 1e-9
               for s in got["new_shapes"])
    assert abs(got["new_shape_ratio_p50"] - 1.5) < 1e-9 and len(got["new_shapes"][0]["ttft_ms"]) == 6


def test_a_wrong_output_length_is_counted_and_the_server_count_wins():
    """The server's count (gRPC: the replies' ids; HTTP: usage.completion_tokens) must
    equal the asked length: main() ends the run when a level has one that does not."""
    def send(req: Request) -> Outcome:
        sent = time.perf_counter() - 1.0
        arrivals = [(sent + 0.1, 1), (sent + 0.2, 1)]  # two chunks ...
        made = 3 if req.prompt == [7] else 4  # ... of 4 tokens as the server counts them
        return Outcome(sent, arrivals, None, None, made)

    row = run_level(send, [Request([1], 4), Request([7], 4), Request([2], 4)], concurrency=1,
                    rate=float("inf"), seed=0)
    assert row["outputs_wrong_length"] == 1 and row["wrong_lengths"] == [(3, 4)]
    # Without a server count, the replies' tokens are the count.
    row = run_level(lambda req: Outcome(time.perf_counter(), [(time.perf_counter(), 4)], None),
                    [Request([1], 4)], concurrency=1, rate=float("inf"), seed=0)
    assert row["outputs_wrong_length"] == 0


def test_the_http_sender_reads_usage_and_asks_for_it():
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from bench.serving import _openai_sender

    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            chunks = [{"choices": [{"text": "a", "finish_reason": None}]},
                      {"choices": [{"text": "b", "finish_reason": "length"}]}]
            if body["prompt"] != [9]:  # prompt [9]: a server that sends no usage
                chunks.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        send = _openai_sender(f"http://127.0.0.1:{server.server_address[1]}", "m")
        got = send(Request([1, 2], 5))
        assert got.error is None and got.completion_tokens == 5 and len(got.arrivals) == 2
        assert bodies[0]["ignore_eos"] is True and bodies[0]["stream_options"] == {"include_usage": True}
        assert "no usage" in send(Request([9], 5)).error
    finally:
        server.shutdown()
        server.server_close()
