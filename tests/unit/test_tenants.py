"""Tenant resolution from plaintext and hashed keys, and the per-tenant cache_salt."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from policies.config import ConfigError, TenantsConfig
from router.tenants import AuthError, TenantResolver, cache_salt_for

# vLLM 0.33's validator: non-empty, at most 128 characters, none of @ / \ NUL (we promise the stricter set below).
VLLM_SAFE_SALT = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_no_tenants_means_no_auth_and_no_salt() -> None:
    r = TenantResolver(TenantsConfig())
    assert not r.enabled
    assert r.resolve(None) is None
    assert r.resolve("Bearer whatever") is None
    assert cache_salt_for(None, None) is None
    assert cache_salt_for(None, "client-own") == "client-own"


def test_plain_and_hashed_keys_resolve(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# hashed keys\n\n{sha('sk-bob')} bob\n  {sha('sk-carol').upper()}   carol  \n")
    r = TenantResolver(TenantsConfig(api_keys={"sk-alice": "alice"}, keys_file=str(keys)))
    assert r.enabled
    assert r.resolve("Bearer sk-alice") == "alice"
    assert r.resolve("bearer sk-bob") == "bob"
    assert r.resolve("Bearer   sk-carol ") == "carol"


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic c2stYWxpY2U=", "sk-alice"])
def test_missing_key_is_an_auth_error(header: str | None) -> None:
    r = TenantResolver(TenantsConfig(api_keys={"sk-alice": "alice"}))
    with pytest.raises(AuthError) as e:
        r.resolve(header)
    assert e.value.code == "missing_api_key"


def test_unknown_key_is_an_auth_error() -> None:
    r = TenantResolver(TenantsConfig(api_keys={"sk-alice": "alice"}))
    with pytest.raises(AuthError) as e:
        r.resolve("Bearer sk-alicf")
    assert e.value.code == "invalid_api_key"
    assert "sk-alic" not in e.value.message


def test_keys_file_problems_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        TenantResolver(TenantsConfig(keys_file=str(tmp_path / "absent")))
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{sha('a')} a\nnothex bob\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: not a 64-digit"):
        TenantResolver(TenantsConfig(keys_file=str(bad)))
    bad.write_text(f"{sha('a')}\n")
    with pytest.raises(ConfigError, match=r"bad.txt:1: expected"):
        TenantResolver(TenantsConfig(keys_file=str(bad)))


def test_empty_keys_file_still_turns_auth_on(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = TenantResolver(TenantsConfig(keys_file=str(empty)))
    with pytest.raises(AuthError):
        r.resolve("Bearer anything")


def test_salt_is_stable_distinct_and_vllm_valid() -> None:
    salts = {
        cache_salt_for("alice", None),
        cache_salt_for("bob", None),
        cache_salt_for("alice", "s1"),
        cache_salt_for("alice", ""),
        cache_salt_for("bob", "s1"),
        cache_salt_for("alice\x00", None),
    }
    assert len(salts) == 6
    for s in salts:
        assert s is not None and VLLM_SAFE_SALT.match(s) and s.startswith("kvg-")
    assert cache_salt_for("alice", "s1") == cache_salt_for("alice", "s1")
    # Pinned value: N router replicas and restarts must agree on it.
    assert cache_salt_for("alice", None) == "kvg-30521acfab82e65b04be78107c60fed9"
    assert len(cache_salt_for("alice", "x" * 10_000) or "") <= 128
