"""kvgate's own credentials: the admin token, the KV-event ingest token, the metrics token and the peer token.

Each is a bearer token set in the policy file or, when the file leaves it unset, in an environment variable (so it can
live in a Kubernetes Secret rather than in the ConfigMap). Tokens are kept and compared as SHA-256 digests with
:func:`hmac.compare_digest`, so neither the answer nor its timing depends on how much of a guess was right, nor on the
token's length. Tenants' API keys are not here: :mod:`kvgate.router.core.tenants` resolves them.

The event-ingest token must differ from the admin token: it sits with engines or their sidecars, and a leaked copy
may let its holder write the prefix index, never reconfigure the fleet.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvgate.router.core.config import ServerConfig
from kvgate.router.core.errors import ApiError, ConfigError

ADMIN_TOKEN_ENV = "KVGATE_ADMIN_TOKEN"
EVENTS_TOKEN_ENV = "KVGATE_EVENTS_TOKEN"
METRICS_TOKEN_ENV = "KVGATE_METRICS_TOKEN"
PEER_TOKEN_ENV = "KVGATE_PEER_TOKEN"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive); None when absent."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _configured(value: object, environ: Mapping[str, str], env: str) -> bytes | None:
    """The digest of a token from the policy file (a ``SecretStr``), else from the environment; None when unset."""
    secret = value.get_secret_value() if value is not None else None  # type: ignore[attr-defined]
    token = secret or environ.get(env) or None
    return digest(token) if token else None


def peer_token(server: ServerConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token this gateway presents to its peers: the peer token, else the admin token (None: neither is set)."""
    for value, env in ((server.peer_token, PEER_TOKEN_ENV), (server.admin_token, ADMIN_TOKEN_ENV)):
        token = (value.get_secret_value() if value is not None else None) or environ.get(env)
        if token:
            return token
    return None


@dataclass(frozen=True, slots=True)
class Credentials:
    """The digests of the tokens in force (None: that token is not configured)."""

    admin: bytes | None
    events: bytes | None
    metrics: bytes | None
    peer: bytes | None = None

    @classmethod
    def of(cls, server: ServerConfig, environ: Mapping[str, str] = os.environ) -> Credentials:
        """Read from the policy file's ``server`` section and the environment. Raises :class:`ConfigError` when the
        event-ingest token equals the admin token."""
        credentials = cls(
            admin=_configured(server.admin_token, environ, ADMIN_TOKEN_ENV),
            events=_configured(server.events_token, environ, EVENTS_TOKEN_ENV),
            metrics=_configured(server.metrics_token, environ, METRICS_TOKEN_ENV),
            peer=_configured(server.peer_token, environ, PEER_TOKEN_ENV),
        )
        if credentials.events is not None and credentials.events == credentials.admin:
            raise ConfigError("server.events_token: must differ from the admin token")
        if credentials.events is not None and credentials.events == credentials.peer:
            raise ConfigError("server.peer_token: must differ from the events token")
        return credentials

    def is_admin(self, authorization: str | None) -> bool:
        """True when the header carries the admin token."""
        return self.admin is not None and _matches(authorization, self.admin)

    def require_admin(self, authorization: str | None) -> None:
        """404 when no admin token is configured (the admin surface does not exist), 401 without a token, 403 for a
        wrong one."""
        if self.admin is None:
            raise ApiError(404, "Admin endpoints are disabled: set server.admin_token or KVGATE_ADMIN_TOKEN.")
        _require(authorization, (self.admin,), "admin token")

    def require_events(self, authorization: str | None) -> None:
        """The HTTP KV-event ingest: 404 when off (no events token), else the events token and only it."""
        if self.events is None:
            raise ApiError(404, "The HTTP KV-event ingest is off: set server.events_token or KVGATE_EVENTS_TOKEN.")
        _require(authorization, (self.events,), "events token")

    def require_peer(self, authorization: str | None) -> None:
        """What a gateway replica asks another (its index snapshot): the peer token or the admin token, never a
        tenant's key; 404 when neither is configured."""
        if self.peer is None and self.admin is None:
            raise ApiError(404, "Peer endpoints are disabled: set server.peer_token or KVGATE_PEER_TOKEN.")
        _require(authorization, (self.peer, self.admin), "peer token")

    def require_metrics(self, authorization: str | None) -> None:
        """``/metrics``: open when no metrics token is configured, else the metrics token or the admin token."""
        if self.metrics is None:
            return
        _require(authorization, (self.metrics, self.admin), "metrics token")


def _matches(authorization: str | None, expected: bytes) -> bool:
    token = bearer_token(authorization)
    return token is not None and hmac.compare_digest(digest(token), expected)


def _require(authorization: str | None, accepted: tuple[bytes | None, ...], what: str) -> None:
    token = bearer_token(authorization)
    if token is None:
        raise ApiError(401, f"Missing {what}: send 'Authorization: Bearer <{what}>'.", code="missing_token")
    presented = digest(token)
    ok = False
    for expected in accepted:  # no early exit: the time taken does not say which token matched
        if expected is not None and hmac.compare_digest(presented, expected):
            ok = True
    if not ok:
        raise ApiError(403, f"Incorrect {what}.", code="invalid_token")
