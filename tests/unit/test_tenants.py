"""Tenant resolution from plaintext and hashed keys, and the per-tenant cache_salt derived under a server secret."""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

import pytest

from kvgate.router.core.config import TenantsConfig
from kvgate.router.core.errors import ConfigError
from kvgate.router.core.tenants import SALT_SECRET_ENV, AuthError, TenantResolver

# vLLM 0.33's validator: non-empty, at most 128 characters, none of @ / \ NUL (we promise the stricter set below).
VLLM_SAFE_SALT = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


SECRET = "a-server-secret-of-some-length"
NO_ENV: dict[str, str] = {}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def resolver(secret: str = SECRET, **tenants: object) -> TenantResolver:
    return TenantResolver(TenantsConfig(api_keys={"sk-alice": "alice"}, salt_secret=secret, **tenants), NO_ENV)


def test_no_tenants_means_no_auth_and_no_salt() -> None:
    r = TenantResolver(TenantsConfig())
    assert not r.enabled
    assert r.resolve(None) is None
    assert r.resolve("Bearer whatever") is None
    assert r.cache_salt(None, None) is None
    assert r.cache_salt(None, "client-own") == "client-own"


def test_plain_and_hashed_keys_resolve(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# hashed keys\n\n{sha('sk-bob')} bob\n  {sha('sk-carol').upper()}   carol  \n")
    r = resolver(keys_file=str(keys))
    assert r.enabled
    assert r.resolve("Bearer sk-alice") == "alice"
    assert r.resolve("bearer sk-bob") == "bob"
    assert r.resolve("Bearer   sk-carol ") == "carol"


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic c2stYWxpY2U=", "sk-alice"])
def test_missing_key_is_an_auth_error(header: str | None) -> None:
    r = resolver()
    with pytest.raises(AuthError) as e:
        r.resolve(header)
    assert e.value.code == "missing_api_key"


def test_unknown_key_is_an_auth_error() -> None:
    r = resolver()
    with pytest.raises(AuthError) as e:
        r.resolve("Bearer sk-alicf")
    assert e.value.code == "invalid_api_key"
    assert "sk-alic" not in e.value.message


def test_keys_file_problems_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        TenantResolver(TenantsConfig(keys_file=str(tmp_path / "absent"), salt_secret=SECRET))
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{sha('a')} a\nnothex bob\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: not a 64-digit"):
        TenantResolver(TenantsConfig(keys_file=str(bad), salt_secret=SECRET))
    bad.write_text(f"{sha('a')}\n")
    with pytest.raises(ConfigError, match=r"bad.txt:1: expected"):
        TenantResolver(TenantsConfig(keys_file=str(bad), salt_secret=SECRET))


def test_empty_keys_file_still_turns_auth_on(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = TenantResolver(TenantsConfig(keys_file=str(empty), salt_secret=SECRET))
    with pytest.raises(AuthError):
        r.resolve("Bearer anything")


def test_salt_is_stable_distinct_and_vllm_valid() -> None:
    r = resolver()
    salts = {
        r.cache_salt("alice", None),
        r.cache_salt("bob", None),
        r.cache_salt("alice", "s1"),
        r.cache_salt("alice", ""),
        r.cache_salt("bob", "s1"),
        r.cache_salt("alice\x00", None),
    }
    assert len(salts) == 6
    for s in salts:
        assert s is not None and VLLM_SAFE_SALT.match(s) and s.startswith("kvg-")
    assert r.cache_salt("alice", "s1") == r.cache_salt("alice", "s1")
    # Pinned value: N router replicas and restarts given the same secret must agree on it.
    assert r.cache_salt("alice", None) == "kvg-" + hmac.new(
        SECRET.encode(), b'["alice", null]', hashlib.sha256).hexdigest()[:32]
    assert len(r.cache_salt("alice", "x" * 10_000) or "") <= 128


def test_salt_depends_on_the_secret_so_it_cannot_be_computed_without_it() -> None:
    """The salt used to be a keyless hash of the tenant's name: anyone could compute it and share that tenant's
    engine cache by calling an engine directly with it."""
    assert resolver().cache_salt("alice", None) != resolver("another-secret-entirely").cache_salt("alice", None)
    keyless = "kvg-" + hashlib.blake2b(b'["alice", null]', digest_size=16, person=b"kvgate-salt").hexdigest()
    assert resolver().cache_salt("alice", None) != keyless


def test_salt_secret_comes_from_the_file_then_the_environment(tmp_path: Path) -> None:
    secret_file = tmp_path / "salt"
    secret_file.write_text(SECRET + "\n")
    from_file = TenantResolver(TenantsConfig(api_keys={"k": "alice"}, salt_secret_file=str(secret_file)), NO_ENV)
    from_env = TenantResolver(TenantsConfig(api_keys={"k": "alice"}), {SALT_SECRET_ENV: SECRET})
    assert from_file.cache_salt("alice", None) == from_env.cache_salt("alice", None) == resolver().cache_salt(
        "alice", None)


@pytest.mark.parametrize("tenants, env, message", [
    ({}, {}, "a salt secret is required"),
    ({"salt_secret": "short"}, {}, "tenants.salt_secret: the salt secret must be at least 16"),
    ({}, {SALT_SECRET_ENV: "short"}, "KVGATE_SALT_SECRET: the salt secret must be at least 16"),
    ({"salt_secret_file": "/nonexistent/salt"}, {}, "tenants.salt_secret_file: cannot read"),
])
def test_tenants_without_a_usable_salt_secret_are_a_config_error(
    tenants: dict[str, str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        TenantResolver(TenantsConfig(api_keys={"sk-alice": "alice"}, **tenants), env)
    assert "short" not in str(e.value).replace("shorter", "")


def test_the_secret_never_appears_in_the_config_repr() -> None:
    config = TenantsConfig(api_keys={"k": "alice"}, salt_secret=SECRET)
    assert SECRET not in repr(config) and SECRET not in str(config.model_dump())
