"""The front's ASGI app: the OpenAI routes, ``/health`` and ``/metrics``.

Every ``/v1`` route and ``/metrics`` needs ``Authorization: Bearer <token>``
when the front has a token (compared in constant time, as the daemons do);
``/health`` stays open for probes. Prompts are tokenized here (text with the
tokenizer's special tokens, chat with the template's) and sent to a decode
daemon as token ids, so usage counts are the ids the model saw. A client that
disconnects, before or during its stream, cancels its Generate call.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from lanekv.http.backends import Backends
from lanekv.http.chat import ChatTemplate
from lanekv.http.config import FrontConfig
from lanekv.http.echo import Echo
from lanekv.http.errors import APIError, bad_field
from lanekv.http.generate import Delta, Generation, Plan, run_until_disconnect, wait_disconnect
from lanekv.http.metrics import FrontMetrics
from lanekv.http.protocol import ChatRequest, Common, parse_chat, parse_completion
from lanekv.http.replies import DONE, ReplyShape, sse
from lanekv.model.config import ModelConfig
from lanekv.model.tokenizer import load_tokenizer

log = logging.getLogger("lanekv.http")
OPEN_PATHS = ("/health",)


class Front:
    """What the routes share: the model's limits, tokenizer, template, daemons and metrics."""

    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        model = ModelConfig.from_dir(config.model_path)
        self.vocab_size, self.max_positions = model.vocab_size, model.max_position_embeddings
        self.tokenizer = load_tokenizer(config.model_path, model.eos_token_ids)
        self.template = (ChatTemplate.from_dir(config.model_path) if config.chat_template is None
                         else ChatTemplate.from_flag(config.chat_template, config.model_path))
        self.backends = Backends.of(config)
        self.metrics = FrontMetrics(self.backends)
        self.created = int(time.time())
        token = config.security.token
        self._auth = None if token is None else hashlib.sha256(f"Bearer {token}".encode()).digest()

    def check_auth(self, request: Request) -> None:
        if self._auth is None or request.url.path in OPEN_PATHS:
            return
        given = request.headers.get("authorization")
        if given is None:
            raise APIError(401, "missing 'Authorization: Bearer <token>' header", code="invalid_api_key")
        if not hmac.compare_digest(hashlib.sha256(given.encode("utf-8", "replace")).digest(), self._auth):
            raise APIError(401, "wrong token in the Authorization header", code="invalid_api_key")

    def check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise APIError(404, f"model: {model!r} is not served here (this server serves "
                           f"{self.config.model_name!r})", param="model", code="model_not_found")

    @property
    def max_text_chars(self) -> int:
        """The longest text tokenized at all (``FrontConfig.max_chars_per_position``)."""
        return self.max_positions * self.config.max_chars_per_position

    def check_text_length(self, chars: int, field: str) -> None:
        if chars > self.max_text_chars:
            raise bad_field(field, f"{chars} characters is more than this server tokenizes ("
                            f"{self.max_text_chars}: the model's {self.max_positions} positions x "
                            f"{self.config.max_chars_per_position})")

    def text_ids(self, text: str, field: str, add_special_tokens: bool) -> tuple[int, ...]:
        """Token ids of ``text``; blocking (the routes call it off the event loop)."""
        if self.tokenizer is None:
            raise bad_field(field, "this model has no tokenizer.json; send token ids")
        self.check_text_length(len(text), field)
        try:
            return tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, UnicodeError) as err:  # lone surrogates from a template's variables
            raise bad_field(field, f"is not valid Unicode text: {err}") from None

    def plan(self, common: Common, ids: tuple[int, ...], field: str, kind: str,
             prompt_logprobs: int | None = None) -> Plan:
        if not ids:
            raise bad_field(field, "the prompt has no tokens")
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise bad_field(field, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        room = self.max_positions - len(ids)
        if room < 1:
            raise bad_field(field, f"{len(ids)} prompt tokens leave no room in the model's "
                            f"{self.max_positions} positions")
        bad = [t for t in common.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise bad_field("stop_token_ids", f"{bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t, _ in common.sampling.logit_bias if t >= self.vocab_size]
        if bad:
            raise bad_field("logit_bias", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        max_tokens = common.max_tokens
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, room) if kind == "cmpl" else room
        elif max_tokens > room:
            raise bad_field(common.max_tokens_field, f"{len(ids)} prompt tokens + {max_tokens} is more than the model's "
                            f"{self.max_positions} positions")
        if max_tokens == 0 and prompt_logprobs is None:
            max_tokens = 1  # echo of the text alone: one token is made and dropped (lanekv.http.echo)
        return Plan(f"{kind}-{uuid.uuid4().hex}", ids, max_tokens, common.sampling, common.stop,
                    common.stop_token_ids, prompt_logprobs)

    def chat_ids(self, chat: ChatRequest) -> tuple[int, ...]:
        """Token ids of the rendered conversation; blocking (called off the event loop)."""
        if self.template is None:
            raise bad_field("messages", "this model has no chat template; use /v1/completions")
        self.check_text_length(chat.text_chars, "messages")
        text = self.template.render(list(chat.messages), chat.add_generation_prompt, **chat.template_kwargs)
        return self.text_ids(text, "messages", add_special_tokens=False)

    async def respond(self, request: Request, common: Common, plan: Plan, chat: bool,
                      echo: Echo | None = None) -> Response:
        endpoint = _endpoint(request.url.path)
        if self.config.log_requests:
            log.info("request %s on %s: %d prompt tokens, max_tokens %d, stream %s", plan.request_id,
                     request.url.path, len(plan.prompt_ids), plan.max_tokens, common.stream)
        shape = ReplyShape(chat, plan.request_id, common.model, int(time.time()), common.include_usage,
                           common.sampling.logprobs is not None, self.token_text)
        generation = Generation(self.backends, plan, self.config.request_timeout_s,
                                None if self.tokenizer is None else self.tokenizer.decode)
        started = time.monotonic()
        if await run_until_disconnect(asyncio.ensure_future(generation.start()), request.receive):
            self.metrics.request(endpoint, "client_gone")
            return Response(status_code=499)
        self.metrics.first_token(time.monotonic() - started)
        if common.stream:
            return StreamingResponse(self._stream(request, generation, shape, endpoint, echo),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": plan.request_id})
        work = asyncio.ensure_future(self._collect(generation))
        if await run_until_disconnect(work, request.receive):
            self.metrics.request(endpoint, "client_gone")
            return Response(status_code=499)
        text, reason, logprobs = work.result()
        if echo is not None:
            if echo.only:
                text, logprobs, reason, generation.completion_tokens = "", [], "length", 0
            text = echo.text + text
            logprobs = [*(echo.entries(generation.prompt_logprobs) if shape.logprobs else ()), *logprobs]
        self._count(endpoint, "200", plan, generation)
        return JSONResponse(shape.whole(text, reason, len(plan.prompt_ids), generation.completion_tokens,
                                        generation.cached_tokens, logprobs),
                            headers={"X-Request-Id": plan.request_id})

    def token_text(self, token: int) -> str:
        """One token's text (its id as vLLM writes it, without a tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    async def _collect(self, generation: Generation) -> tuple[str, str, list]:
        parts, reason, logprobs = [], "length", []
        async with aclosing(generation.deltas()) as deltas:
            async for delta in deltas:
                parts.append(delta.text)
                logprobs += delta.logprobs
                reason = delta.finish_reason or reason
        return "".join(parts), reason, logprobs

    async def _stream(self, request: Request, generation: Generation, shape: ReplyShape, endpoint: str,
                      echo: Echo | None = None):
        plan, status = generation.plan, "client_gone"
        watcher = asyncio.ensure_future(wait_disconnect(request.receive))
        watcher.add_done_callback(lambda _: generation.cancel())
        try:
            first = shape.first_chunk()
            if first:
                yield first
            if echo is not None:  # the prompt first, with its logprobs when asked
                yield shape.chunk(Delta(echo.text, None, echo.entries(generation.prompt_logprobs)
                                        if shape.logprobs else ()))
            async with aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    if echo is not None and echo.only:  # max_tokens 0: the made token is dropped
                        if delta.finish_reason:  # "length": nothing was asked for
                            generation.completion_tokens = 0
                            yield shape.chunk(Delta("", "length"))
                        continue
                    yield shape.chunk(delta)
            if shape.include_usage:
                yield shape.usage_chunk(len(plan.prompt_ids), generation.completion_tokens, generation.cached_tokens)
            status = "200"
            yield DONE
        except APIError as err:
            status = str(err.status)
            if not watcher.done():
                log.warning("stream %s ended: %s", plan.request_id, err.message)
                yield sse(err.body())
                yield DONE
        finally:
            watcher.cancel()
            generation.cancel()
            self._count(endpoint, status, plan, generation)

    def _count(self, endpoint: str, status: str, plan: Plan, generation: Generation) -> None:
        self.metrics.request(endpoint, status)
        self.metrics.tokens(len(plan.prompt_ids), generation.completion_tokens)


def build_app(config: FrontConfig) -> FastAPI:
    front = Front(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await front.backends.start()
        try:
            yield
        finally:
            await front.backends.close()

    app = FastAPI(title="lanekv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front

    guarded = [Depends(front.check_auth)]
    config = front.config

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        front.metrics.request(_endpoint(request.url.path), str(err.status))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        status = err.status_code if err.status_code in (400, 401, 404) else 400
        return JSONResponse(APIError(status, f"{request.method} {request.url.path}: {err.detail}").body(),
                            status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error ({type(err).__name__}); see the server log").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        members = {m.endpoint: {"healthy": m.healthy, "running": m.running, "problem": m.problem or None}
                   for m in front.backends.members}
        ok = any(m.healthy for m in front.backends.members)
        return JSONResponse({"status": "ok" if ok else "unavailable", "decode": members},
                            status_code=200 if ok else 503)

    @app.get("/metrics", dependencies=guarded)
    async def metrics():
        return PlainTextResponse(front.metrics.render(), media_type=FrontMetrics.CONTENT_TYPE)

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [_model_card(front)]}

    @app.get("/v1/models/{model:path}", dependencies=guarded)
    async def model(model: str):
        front.check_model(model)
        return _model_card(front)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request):
        parsed = parse_completion(await _json(request, config))
        front.check_model(parsed.common.model)
        prompt = parsed.prompt
        if isinstance(prompt, str):
            front.check_text_length(len(prompt), "prompt")
            ids = await asyncio.to_thread(front.text_ids, prompt, "prompt", True)
        else:
            ids = prompt
        plan = front.plan(parsed.common, ids, "prompt", "cmpl", parsed.prompt_logprobs)
        echo = None if not parsed.echo else Echo.of(
            prompt, ids, parsed.common.max_tokens, None if front.tokenizer is None else front.tokenizer.decode,
            front.token_text)
        return await front.respond(request, parsed.common, plan, chat=False, echo=echo)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request):
        parsed = parse_chat(await _json(request, config))
        front.check_model(parsed.common.model)
        front.check_text_length(parsed.text_chars, "messages")
        ids = await asyncio.to_thread(front.chat_ids, parsed)
        plan = front.plan(parsed.common, ids, "messages", "chatcmpl")
        return await front.respond(request, parsed.common, plan, chat=True)

    return app


def _endpoint(path: str) -> str:
    """The metrics label of a route (a fixed set, whatever path a client sends)."""
    known = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/metrics": "metrics",
             "/health": "health"}
    return known.get(path, "models" if path.startswith("/v1/models") else "other")


def _model_card(front: Front) -> dict[str, Any]:
    return {"id": front.config.model_name, "object": "model", "created": front.created,
            "owned_by": "lanekv", "max_model_len": front.max_positions}


async def _json(request: Request, config: FrontConfig) -> Any:
    """The request's JSON body, read within ``body_timeout_s`` and ``max_body_bytes`` and
    parsed off the event loop (so no body, however built, stalls the other clients)."""
    limit = config.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"body: {declared} bytes is more than this server reads ({limit})",
                       param="body")

    async def read() -> bytes:
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError(413, f"body: more than {limit} bytes (this server's bound)", param="body")
            parts.append(part)
        return b"".join(parts)

    try:
        raw = await asyncio.wait_for(read(), config.body_timeout_s)
    except TimeoutError:
        raise APIError(408, f"body: not received within {config.body_timeout_s:g}s", param="body") from None
    try:
        return await asyncio.to_thread(json.loads, raw)
    except RecursionError:
        raise bad_field("body", "nests too deeply to be a request") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise bad_field("body", f"is not valid JSON: {err}") from None
