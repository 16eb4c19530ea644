"""Tenants: API key → tenant name, and the per-tenant ``cache_salt`` that keeps their KV apart.

Keys come from the policy file (``tenants.api_keys``, plaintext) or a keys file of ``sha256hex tenant`` lines, so
operators need not store plaintext keys. Both are kept only as SHA-256 digests and every presented key is compared
against every digest with :func:`hmac.compare_digest`, so neither the answer nor its timing says how close a guess was.

Engines share prefix-cache blocks only between requests with the same ``cache_salt`` (vLLM folds it into the first
block's hash), so giving each tenant its own salt means no tenant can ever hit, or time, another tenant's cached
prompt. The salt is derived, not random, so every kvgate replica computes the same one and a tenant's own requests
keep sharing their cache across router restarts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from policies.config import ConfigError, TenantsConfig

SALT_PREFIX = "kvg-"
SALT_PERSON = b"kvgate-salt"


class AuthError(Exception):
    """A request without a valid API key while auth is on (the gateway answers 401, OpenAI style)."""

    def __init__(self, message: str, code: str = "invalid_api_key") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class TenantResolver:
    def __init__(self, config: TenantsConfig) -> None:
        """Raises :class:`ConfigError` when the keys file cannot be read or has a malformed line."""
        digests: list[tuple[bytes, str]] = [
            (hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in config.api_keys.items()
        ]
        if config.keys_file is not None:
            digests.extend(read_keys_file(config.keys_file))
        self._digests = digests
        self.enabled = config.enabled

    def resolve(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer <key>`` header; None when auth is off."""
        if not self.enabled:
            return None
        key = _bearer_key(authorization)
        if key is None:
            raise AuthError(
                "Missing API key: send it as 'Authorization: Bearer <key>'.", code="missing_api_key"
            )
        presented = hashlib.sha256(key.encode()).digest()
        tenant: str | None = None
        for digest, name in self._digests:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(digest, presented):
                tenant = name
        if tenant is None:
            raise AuthError("Incorrect API key provided.")
        return tenant


def cache_salt_for(tenant: str | None, client_salt: str | None) -> str | None:
    """The ``cache_salt`` to send upstream.

    No tenant (auth off): the client's own salt, unchanged (None when it sent none), so requests that bypass kvgate
    keep sharing blocks with those that do not. With a tenant: ``kvg-`` + 32 hex digits of a BLAKE2b over
    (tenant, client salt), stable, different per tenant, and within vLLM's accepted characters.
    """
    if tenant is None:
        return client_salt
    material = json.dumps([tenant, client_salt]).encode()
    return SALT_PREFIX + hashlib.blake2b(material, digest_size=16, person=SALT_PERSON).hexdigest()


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


def _bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return key
