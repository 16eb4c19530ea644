"""kvgate's own tokens: where they come from, what each opens, and that the event token is never the admin one."""

from __future__ import annotations

import pytest

from kvgate.router.core.auth import ADMIN_TOKEN_ENV, EVENTS_TOKEN_ENV, METRICS_TOKEN_ENV, Credentials, bearer_token
from kvgate.router.core.config import ServerConfig
from kvgate.router.core.errors import ApiError, ConfigError


def status(check: object, header: str | None) -> int:
    try:
        check(header)  # type: ignore[operator]
    except ApiError as e:
        return e.status
    return 200


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("  bearer   abc  ") == "abc"
    for header in (None, "", "Bearer", "Bearer  ", "Basic abc", "abc"):
        assert bearer_token(header) is None


def test_nothing_configured_means_no_admin_no_event_ingest_and_open_metrics() -> None:
    creds = Credentials.of(ServerConfig(), {})
    assert status(creds.require_admin, "Bearer x") == 404
    assert status(creds.require_events, "Bearer x") == 404
    assert status(creds.require_metrics, None) == 200
    assert not creds.is_admin("Bearer x")


def test_each_token_opens_only_its_own_door() -> None:
    creds = Credentials.of(ServerConfig(admin_token="adm", events_token="evt", metrics_token="met"), {})
    for check, opens in ((creds.require_admin, {"adm"}), (creds.require_events, {"evt"}),
                         (creds.require_metrics, {"met", "adm"})):
        assert status(check, None) == 401
        assert status(check, "Basic adm") == 401
        for token in ("adm", "evt", "met", "ad", "admx"):
            assert status(check, f"Bearer {token}") == (200 if token in opens else 403), (check, token)
    assert creds.is_admin("Bearer adm") and not creds.is_admin("Bearer evt")


def test_tokens_come_from_the_environment_when_the_file_has_none() -> None:
    env = {ADMIN_TOKEN_ENV: "a-env", EVENTS_TOKEN_ENV: "e-env", METRICS_TOKEN_ENV: "m-env"}
    creds = Credentials.of(ServerConfig(admin_token="a-file"), env)
    assert creds.is_admin("Bearer a-file") and not creds.is_admin("Bearer a-env")
    assert status(creds.require_events, "Bearer e-env") == 200
    assert status(creds.require_metrics, "Bearer m-env") == 200


@pytest.mark.parametrize("server, env", [
    ({"admin_token": "same", "events_token": "same"}, {}),
    ({"events_token": "same"}, {ADMIN_TOKEN_ENV: "same"}),
])
def test_the_event_token_must_differ_from_the_admin_token(server: dict[str, str], env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="events_token: must differ from the admin token") as e:
        Credentials.of(ServerConfig(**server), env)
    assert "same" not in str(e.value)


def test_tokens_never_show_in_the_config_repr() -> None:
    config = ServerConfig(admin_token="adm-secret", events_token="evt-secret", metrics_token="met-secret")
    assert "secret" not in repr(config) and "secret" not in str(config.model_dump())
