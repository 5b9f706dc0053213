"""Settings of an assistant: the model endpoint, the tool services, the limits of a turn."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from toolmesh.client.config import address
from toolmesh.core.bearer import TokenSource, token_from_env
from toolmesh.core.tls import ENV_TLS, TlsFiles

ENV_MODEL_URL = "TOOLMESH_MODEL_URL"
ENV_MODEL = "TOOLMESH_MODEL"
ENV_MODEL_API_KEY = "TOOLMESH_MODEL_API_KEY"
ENV_REQUIRE_TLS = "TOOLMESH_REQUIRE_TLS"
CHAT_COMPLETIONS = "/chat/completions"


@dataclass(frozen=True, slots=True)
class ModelEndpoint:
    """An OpenAI-compatible chat-completions endpoint with tool calling.

    `url` is the API base (`https://host/v1`) or the full `.../chat/completions` URL.
    """

    url: str
    model: str
    api_key: str = field(default="", repr=False)
    timeout_s: float = 60.0

    @property
    def chat_url(self) -> str:
        """The full chat-completions URL."""
        return self.url if self.url.endswith(CHAT_COMPLETIONS) else self.url.rstrip("/") + CHAT_COMPLETIONS

    @classmethod
    def from_env(
        cls,
        url: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 60.0,
    ) -> ModelEndpoint:
        """Arguments first, then TOOLMESH_MODEL_URL / TOOLMESH_MODEL / TOOLMESH_MODEL_API_KEY.

        Raises ValueError when the URL or the model name is missing.
        """
        url = url or os.environ.get(ENV_MODEL_URL, "")
        model = model or os.environ.get(ENV_MODEL, "")
        if not url or not model:
            raise ValueError(f"a model endpoint needs a URL and a model name ({ENV_MODEL_URL}, {ENV_MODEL})")
        if timeout_s <= 0:
            raise ValueError("the model timeout must be positive")
        return cls(url, model, api_key or os.environ.get(ENV_MODEL_API_KEY, ""), timeout_s)


@dataclass(frozen=True, slots=True)
class ToolServices:
    """Where the registry and invocation services are, how the channel must be secured, and the token.

    With `require_tls`, a plaintext channel is refused (UNSUPPORTED_WEBMCP).
    `certificate_chain` and `private_key` (PEM) make it mutual TLS. `token`
    (text, or a callback asked before each call) names the session with the role call.
    """

    registry: str
    invocation: str
    tls: bool = False
    require_tls: bool = False
    root_certificates: bytes | None = field(default=None, repr=False)
    certificate_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    token: TokenSource | None = field(default=None, repr=False)

    @classmethod
    def from_env(
        cls,
        registry: str | None = None,
        invocation: str | None = None,
        *,
        tls: bool = False,
        require_tls: bool | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> ToolServices:
        """Arguments first, then the environment, then local defaults.

        Addresses from TOOLMESH_REGISTRY_ADDR / TOOLMESH_INVOCATION_ADDR; `require_tls`
        from TOOLMESH_REQUIRE_TLS (1, true or yes); TLS from TOOLMESH_TLS and
        TOOLMESH_TLS_CA / _CERT / _KEY (a CA or a client certificate implies TLS); the
        token from TOOLMESH_TOKEN.
        """
        if require_tls is None:
            require_tls = _flag(ENV_REQUIRE_TLS)
        files = TlsFiles.from_env(tls_cert, tls_key, tls_ca)
        return cls(
            address("registry", registry),
            address("invocation", invocation),
            tls or _flag(ENV_TLS) or files.configured,
            require_tls,
            files.ca.read_bytes() if files.ca else None,
            files.cert.read_bytes() if files.cert else None,
            files.key.read_bytes() if files.key else None,
            token_from_env(token),
        )


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in {"1", "true", "yes"}


@dataclass(frozen=True, slots=True)
class TurnLimits:
    """The bounds of one turn, and the system prompt. Raises ValueError for negative `max_rounds`."""

    # Rounds of tool calls one turn may take; the model asking for one more is TURN_LIMIT.
    max_rounds: int = 8
    # The assistant's own cap on one tool call, in seconds. None: the tool's
    # deadline plus TOOL_GRACE_S, so that the runtime's TOOL_TIMEOUT arrives first.
    tool_timeout_s: float | None = None
    system_prompt: str = ""

    def __post_init__(self) -> None:
        if self.max_rounds < 0:
            raise ValueError("max_rounds cannot be negative")


TOOL_GRACE_S = 2.0
