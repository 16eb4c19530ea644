"""The sections of the policy file that several floors of the gateway read: the server, the shape requests may have,
tenants, the prefix index the gateway builds, and the model catalog."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, SecretStr

from kvgate.policies.config import PrefillCost
from kvgate.policies.section import Section


class ServerConfig(Section):
    host: str = "127.0.0.1"
    """Address kvgate listens on (CLI --host overrides)."""
    port: int = Field(8000, ge=0, le=65535)
    """Port kvgate listens on (CLI --port overrides)."""
    admin_token: SecretStr | None = None
    """Bearer token for /admin/* (also read from env KVGATE_ADMIN_TOKEN); admin endpoints are off when unset. It
    also opens /kvgate/v1/explain on any tenant's namespace and /metrics."""
    events_token: SecretStr | None = None
    """Bearer token for POST /kvgate/v1/events (also read from env KVGATE_EVENTS_TOKEN); the HTTP KV-event ingest is
    off (404) when unset. Must differ from the admin token."""
    metrics_token: SecretStr | None = None
    """Bearer token for GET /metrics (also read from env KVGATE_METRICS_TOKEN; the admin token works too); /metrics
    is open when unset."""
    peer_token: SecretStr | None = None
    """Bearer token the gateway replicas present to each other (also read from env KVGATE_PEER_TOKEN): it opens
    /kvgate/v1/peer/snapshot (so does the admin token), and a starting gateway sends it to its peers (else the
    admin token). The snapshot endpoint is off (404) when neither is set. Must differ from the events token."""
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    """Request bodies above this get 413."""
    max_event_body_bytes: int = Field(1024 * 1024, gt=0)
    """Bodies posted to /kvgate/v1/events above this get 413."""
    max_event_blocks: int = Field(4096, ge=1)
    """Block hashes (stored or removed) one batch posted to /kvgate/v1/events may hold; more is a 413 (applying
    costs the event loop a few microseconds per block). A sender splits larger batches, one sequence number each."""
    shutdown_grace_s: float = Field(30.0, ge=0)
    """On SIGTERM/SIGINT: stop accepting, let in-flight streams finish up to this long, then cancel them."""
    log_requests: bool = True
    """One JSON line per request at info level."""
    keep_alive_timeout_s: float = Field(75.0, gt=0)
    """An idle client connection is closed this long after its last response. Longer than clients and load
    balancers keep idle connections (httpx, under the openai and anthropic SDKs: 5 s; aiohttp: 15 s; cloud load
    balancers: 60 s), so they close first: a server that closes first can do so just as a request is sent on the
    connection, and the client gets a reset for a request kvgate never read (nginx's default, 75 s)."""
    body_timeout_s: float = Field(30.0, gt=0)
    """A request body must arrive in full within this long, else 408: slow-body clients cannot hold a request."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A request's line and headers must arrive within this long of the connection opening (or, on a kept-alive
    connection, of the request's first byte), else the connection is closed: clients that send headers a byte at a
    time (slowloris) cannot hold connections. Read at startup."""
    max_header_bytes: int = Field(65536, ge=1024)
    """Bytes of a request's line and headers together; beyond, the answer is 431 and the connection is closed.
    Read at startup."""
    max_headers: int = Field(100, ge=8)
    """Header lines of a request; more is a 431 and the connection is closed. Read at startup."""


class LimitsConfig(Section):
    """The shape a request may have; anything beyond is answered with a 4xx before anything is forwarded."""

    max_messages: int = Field(4096, ge=1)
    """Chat messages per request."""
    max_prompt_chars: int = Field(4_000_000, ge=1)
    """Characters of prompt text (a completions prompt, the messages' contents, and the rendered chat template)."""
    max_json_items: int = Field(200_000, ge=1)
    """Upper bound on the JSON values of a body over 64 KiB (its ``{``, ``[`` and ``,`` bytes, counted as they
    arrive); more is a 413: decoding hundreds of thousands of tiny values would hold the event loop for seconds."""
    max_json_objects: int = Field(32_768, ge=1)
    """Upper bound on the JSON objects of a body over 64 KiB (its ``{`` bytes, counted as they arrive); more is a
    413. Objects cost the decoder most (a dict and its keys each): 32,768 decode in about 15 ms, well inside what a
    request may hold the event loop for, and far more than any real conversation, tools included, has."""
    max_id_chars: int = Field(256, ge=16)
    """Characters of a client's X-Request-Id or X-Session-ID; longer is a 400 (they are stored and forwarded)."""
    max_sessions_per_tenant: int = Field(20_000, ge=1)
    """Sessions (X-Session-ID → last replica) remembered per tenant, least recently used forgotten first."""
    trust_request_chat_template: bool = False
    """Accept a request's own ``chat_template`` (or ``chat_template_kwargs.chat_template``), as vLLM's
    ``--trust-request-chat-template``; otherwise such requests get 400. Trusted templates are rendered in a
    sandboxed child process with the time and size limits below."""
    request_template_timeout_s: float = Field(1.0, gt=0)
    """A request's own chat template must render within this long, else 400 (the render is killed)."""
    request_template_memory_mb: int = Field(1024, ge=64)
    """Address-space limit of the process rendering request templates."""


class TenantsConfig(Section):
    api_keys: dict[str, str] = Field(default_factory=dict)
    """API key → tenant name. When this or keys_file is set, every request needs a valid key (else 401)."""
    keys_file: str | None = None
    """File of ``sha256hex tenant`` lines (hashed keys), re-read on reload."""
    salt_secret: SecretStr | None = None
    """Server secret the tenants' cache_salts are derived with (HMAC-SHA256), at least 16 characters. Required with
    tenants: set this, salt_secret_file or env KVGATE_SALT_SECRET. Changing it rotates every salt (one cold cache)."""
    salt_secret_file: str | None = None
    """File holding the salt secret (e.g. a mounted Kubernetes Secret; surrounding whitespace ignored), re-read on
    reload; used when salt_secret is unset."""
    models: dict[str, list[str]] = Field(default_factory=dict)
    """Tenant → the models and LoRA adapters it may use (names or shell-style patterns such as ``llama-*``):
    ``/v1/models`` lists only those, and a request naming another gets the same 404 as a model that does not exist.
    A tenant not listed here may use every model."""

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys) or self.keys_file is not None


class IndexConfig(Section):
    """The prefix index the gateway keeps (:mod:`kvgate.cache_index`, which takes these as plain arguments)."""

    max_entries: int = Field(5_000_000, ge=1)
    """Cap on (block, replica) holdings; least recently matched chains are evicted first."""
    predicted_ttl_s: float = Field(2.0, ge=0)
    """Blocks of a just-routed prompt count as held ("predicted") on that replica for this long, or until confirmed."""
    replay_timeout_s: float = Field(2.0, gt=0)
    """How long a replay request may take before the replica is purged instead."""


class ModelConfig(Section):
    """One model the fleet serves: what tokenizing its prompts, keying its blocks and pricing its prefill need."""

    name: str
    """Model name as clients send it and engines serve it."""
    tokenizer: str | None = None
    """Local model directory (tokenizer.json + tokenizer_config.json) or a tokenizer.json path."""
    block_size: int = Field(16, ge=1)
    """Engine KV block size in tokens, a default: each replica's own (its events' block_size, else its scraped
    cache_config_info) is used once known; a stated value an engine contradicts is logged and metered."""
    weight_version: str = ""
    """Changing it starts a new namespace: every old cached prefix simply misses."""
    prefill: PrefillCost = PrefillCost()
    kv_bytes_per_token: int = Field(320 * 1024, gt=0)
    """KV-cache bytes per token (all layers); sizes transfers."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt the model takes, in tokens; longer prompts get 400 before they are forwarded. When unset, the
    largest ``max_model_len`` its replicas report in /v1/models (vLLM does)."""
    chat_template: str | None = None
    """The chat template its engines are started with (vLLM's ``--chat-template``), instead of the tokenizer's: a
    path to the template file, else the template text itself (a value holding ``{``, ``}`` or a newline). A path
    that cannot be read is refused when the policy file is loaded. Set it whenever the engines set theirs, or kvgate
    keys prompts the engines never compute."""
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    """How its engines hand message content to the template (vLLM's ``--chat-template-content-format``): ``auto``
    detects it from the template, ``string`` joins text parts into one string, ``openai`` passes the list of
    parts. Same value as the engines'."""
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Template variables its engines render every chat with (vLLM's ``--default-chat-template-kwargs``), e.g.
    ``{enable_thinking: false}``; a request's ``chat_template_kwargs`` and fields override them. Same value as the
    engines'."""

    def __hash__(self) -> int:
        # Model entries are compared across reloads in sets; the kwargs mapping is not hashable as it is.
        return hash(json.dumps(self.model_dump(mode="json"), sort_keys=True))
