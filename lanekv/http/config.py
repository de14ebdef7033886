"""The front's configuration: one frozen dataclass, checked when made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from lanekv.runtime.security import SecurityConfig


@dataclass(frozen=True)
class FrontConfig:
    model_path: str  # checkpoint folder: config.json, tokenizer.json, the chat template
    decode_endpoints: tuple[str, ...]  # "host:port" of each decode daemon
    served_model_name: str | None = None  # the model id clients name; the folder's name when None
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    security: SecurityConfig = field(default_factory=SecurityConfig)
    max_running_per_decode: int = 256  # requests at once per daemon; 429 when every one is full
    health_interval_s: float = 1.0  # how often each decode daemon's health is asked
    health_timeout_s: float = 2.0
    request_timeout_s: float = 600.0  # deadline of one Generate call
    default_max_tokens: int = 16  # completions without max_tokens (OpenAI's default)
    # Bounds that keep one client from stalling the others (413/408/400 before any tokenizing).
    max_body_bytes: int = 16 * 2**20  # a request body; 128k token ids as JSON are about 1 MB
    # A text prompt (or rendered conversation) longer than the model's positions times this is
    # refused untokenized: text runs 3-5 characters per token, so only whitespace padding is lost.
    max_chars_per_position: int = 32
    header_timeout_s: float = 10.0  # a connection's request line and headers must arrive in this
    body_timeout_s: float = 30.0  # a request body must arrive in this
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    chat_template: str | None = None  # a template file or the template itself; None: the checkpoint's
    log_requests: bool = True  # one INFO line per request (id, route, prompt tokens, max tokens)

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not Path(self.model_path).is_dir():
            raise ValueError(f"model_path={self.model_path!r} is not a checkpoint folder")
        if not isinstance(self.decode_endpoints, tuple) or not self.decode_endpoints:
            raise ValueError(f"decode_endpoints={self.decode_endpoints!r} must name at least one daemon")
        for endpoint in self.decode_endpoints:
            host, _, port = endpoint.rpartition(":") if isinstance(endpoint, str) else ("", "", "")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"decode endpoint {endpoint!r} is not HOST:PORT")
        if len(set(self.decode_endpoints)) != len(self.decode_endpoints):
            raise ValueError(f"decode_endpoints={self.decode_endpoints!r} names a daemon twice")
        if self.served_model_name is not None and (
                not isinstance(self.served_model_name, str) or not self.served_model_name.strip()):
            raise ValueError(f"served_model_name={self.served_model_name!r} must be a non-empty string")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} must be in [0, 65535]")
        for name in ("max_running_per_decode", "default_max_tokens", "max_body_bytes",
                     "max_chars_per_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("health_interval_s", "health_timeout_s", "request_timeout_s", "header_timeout_s",
                     "body_timeout_s", "keep_alive_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a number > 0")
        if self.chat_template is not None and (not isinstance(self.chat_template, str)
                                               or not self.chat_template.strip()):
            raise ValueError(f"chat_template={self.chat_template!r} must be a file or a template")
        if not isinstance(self.security, SecurityConfig):
            raise TypeError(f"security must be a SecurityConfig, got {type(self.security).__name__}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).resolve().name
