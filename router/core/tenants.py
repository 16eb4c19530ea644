"""Tenants: API key → tenant name, and the per-tenant ``cache_salt`` that keeps their KV apart.

Keys come from the policy file (``tenants.api_keys``, plaintext) or a keys file of ``sha256hex tenant`` lines, so
operators need not store plaintext keys. Both are kept only as SHA-256 digests and every presented key is compared
against every digest with :func:`hmac.compare_digest`, so neither the answer nor its timing says how close a guess was.

Engines share prefix-cache blocks only between requests with the same ``cache_salt`` (vLLM folds it into the first
block's hash), so giving each tenant its own salt means no tenant can ever hit, or time, another tenant's cached
prompt. The salt is an HMAC under a server secret (``tenants.salt_secret``, its file, or env ``KVGATE_SALT_SECRET``),
so nobody without the secret can compute a tenant's salt and send requests that share its cache by going to an engine
directly; it is derived rather than random, so every kvgate replica given the same secret computes the same salt and
a tenant's own requests keep sharing their cache across router restarts. A new secret changes every salt: each
tenant's cache starts cold once.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from pathlib import Path

from kvgate.router.core.auth import bearer_token
from kvgate.router.core.config import TenantsConfig
from kvgate.router.core.errors import ConfigError

SALT_PREFIX = "kvg-"
SALT_HEX_DIGITS = 32
"""The salt keeps 128 bits of the HMAC: ``kvg-`` + 32 hex digits fits vLLM's rule (at most 128 characters, none of
``@ / \\`` or NUL) with room to spare."""
SALT_SECRET_ENV = "KVGATE_SALT_SECRET"
MIN_SALT_SECRET_CHARS = 16


class AuthError(Exception):
    """A request without a valid API key while auth is on (the gateway answers 401, OpenAI style)."""

    def __init__(self, message: str, code: str = "invalid_api_key") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class TenantResolver:
    def __init__(self, config: TenantsConfig, environ: Mapping[str, str] = os.environ) -> None:
        """Raises :class:`ConfigError` when the keys file cannot be read or has a malformed line, or when tenants are
        configured without a usable salt secret."""
        self._environ = environ
        self.reconfigure(config)

    def reconfigure(self, config: TenantsConfig) -> None:
        """Take a reloaded ``tenants`` section (the keys file and the salt secret are read again); a section that
        cannot be used raises :class:`ConfigError` and changes nothing."""
        digests: list[tuple[bytes, str]] = [
            (hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in config.api_keys.items()
        ]
        if config.keys_file is not None:
            digests.extend(read_keys_file(config.keys_file))
        salt_key = salt_secret(config, self._environ) if config.enabled else b""
        self._digests = digests
        self.enabled = config.enabled
        self._salt_key = salt_key
        self._models = {tenant: tuple(patterns) for tenant, patterns in config.models.items()}

    def resolve(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer <key>`` header; None when auth is off."""
        if not self.enabled:
            return None
        key = bearer_token(authorization)
        if key is None:
            raise AuthError(
                "Missing API key: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
                code="missing_api_key",
            )
        presented = hashlib.sha256(key.encode()).digest()
        tenant: str | None = None
        for digest, name in self._digests:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(digest, presented):
                tenant = name
        if tenant is None:
            raise AuthError("Incorrect API key provided.")
        return tenant

    def may_use(self, tenant: str | None, model: str) -> bool:
        """Whether ``tenant`` may use ``model`` (a base model or a LoRA adapter): every model, unless
        ``tenants.models`` lists the tenant's."""
        patterns = self._models.get(tenant) if tenant is not None else None
        return patterns is None or any(fnmatch.fnmatchcase(model, pattern) for pattern in patterns)

    def cache_salt(self, tenant: str | None, client_salt: str | None) -> str | None:
        """The ``cache_salt`` to send upstream.

        No tenant (auth off): the client's own salt, unchanged (None when it sent none), so requests that bypass
        kvgate keep sharing blocks with those that do not. With a tenant: ``kvg-`` + the first 32 hex digits of
        HMAC-SHA256(secret, (tenant, client salt)): stable, different per tenant and client salt, not computable
        without the secret, and within vLLM's accepted characters.
        """
        if tenant is None:
            return client_salt
        material = json.dumps([tenant, client_salt]).encode()
        return SALT_PREFIX + hmac.new(self._salt_key, material, hashlib.sha256).hexdigest()[:SALT_HEX_DIGITS]


def salt_secret(config: TenantsConfig, environ: Mapping[str, str] = os.environ) -> bytes:
    """The salt secret: ``tenants.salt_secret``, else the contents of ``tenants.salt_secret_file``, else env
    ``KVGATE_SALT_SECRET``. Raises :class:`ConfigError` (never showing the secret) when none is set or it is short."""
    if config.salt_secret is not None:
        secret, source = config.salt_secret.get_secret_value(), "tenants.salt_secret"
    elif config.salt_secret_file is not None:
        source = "tenants.salt_secret_file"
        try:
            secret = Path(config.salt_secret_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{source}: cannot read {config.salt_secret_file}: {e}") from e
    else:
        secret, source = environ.get(SALT_SECRET_ENV, ""), SALT_SECRET_ENV
        if not secret:
            raise ConfigError(
                "tenants: a salt secret is required with tenants (tenants.salt_secret, tenants.salt_secret_file or "
                f"env {SALT_SECRET_ENV}), e.g. the output of `openssl rand -hex 32`"
            )
    if len(secret) < MIN_SALT_SECRET_CHARS:
        raise ConfigError(f"{source}: the salt secret must be at least {MIN_SALT_SECRET_CHARS} characters")
    return secret.encode()


def read_keys_file(path: str | Path) -> list[tuple[bytes, str]]:
    """Parse ``sha256hex tenant`` lines (blank lines and ``#`` comments allowed) into (digest, tenant) pairs."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"tenants.keys_file: cannot read {p}: {e}") from e
    pairs = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"tenants.keys_file: {p}:{lineno}: expected 'sha256hex tenant'")
        digest_hex, tenant = parts
        try:
            digest = bytes.fromhex(digest_hex)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ConfigError(f"tenants.keys_file: {p}:{lineno}: not a 64-digit SHA-256 hex digest")
        pairs.append((digest, tenant))
    return pairs
