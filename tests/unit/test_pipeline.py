"""The request path's stages alone: admit, parse, the mapping of routing errors (tokenize, route), and when a
prompt's beginning settles its route."""

from __future__ import annotations

import msgspec
import pytest

from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import NoHealthyReplica
from kvgate.router.apis.openai import COMPLETIONS
from kvgate.router.core.config import TenantsConfig
from kvgate.router.core.errors import ApiError
from kvgate.router.core.tenants import TenantResolver
from kvgate.router.pipeline.admit import Admission, ClientHeaders, resolve_tenant, upstream_headers
from kvgate.router.pipeline.errors import routing_errors
from kvgate.router.pipeline.parse import parse, salt_for_tenant
from kvgate.router.pipeline.route import settled
from kvgate.router.prompts.tokenizer import PromptError
from kvgate.router.core.http import HttpRequest

TENANTS = TenantResolver(TenantsConfig(api_keys={"sk-alice": "alice"}, salt_secret="s" * 32), {})


def request(*headers: tuple[bytes, bytes]) -> HttpRequest:
    return HttpRequest("POST", "/v1/completions", "", list(headers))


class FakeFleet:
    def __init__(self, routable: bool) -> None:
        self._routable = routable

    def routable(self) -> list[str]:
        return ["r0"] if self._routable else []


class FakeCatalog:
    """What the parse stage asks of the model catalog: the models it knows, and whether any replica is routable."""

    def __init__(self, models: set[str], routable: bool = True) -> None:
        self.models = models
        self.fleet = FakeFleet(routable)

    def knows(self, model: str) -> bool:
        return model in self.models


def test_admission_takes_the_first_of_each_header_and_makes_an_id_when_none_came() -> None:
    given = Admission.of(request((b"x-request-id", b"abc"), (b"x-request-id", b"def"), (b"x-session-id", b"s1")))
    assert (given.request_id, given.client.session_id, given.client.authorization) == ("abc", "s1", None)
    made, other = Admission.of(request()), Admission.of(request())
    assert len(made.request_id) == 32 and made.request_id != other.request_id


def test_admit_resolves_the_tenant_or_answers_401() -> None:
    assert resolve_tenant(TENANTS, "Bearer sk-alice") == "alice"
    with pytest.raises(ApiError) as e:
        resolve_tenant(TENANTS, "Bearer sk-mallory")
    assert e.value.status == 401
    assert resolve_tenant(TenantResolver(TenantsConfig()), None) is None


def test_the_clients_key_reaches_the_engine_only_without_tenants() -> None:
    client = ClientHeaders(request_id=None, session_id="s1", authorization="Bearer engine-key")
    assert upstream_headers(client, "rid", tenants_enabled=False) == {
        "content-type": "application/json", "x-request-id": "rid", "x-session-id": "s1",
        "authorization": "Bearer engine-key"}
    assert "authorization" not in upstream_headers(client, "rid", tenants_enabled=True)


def test_parse_knows_the_model_or_answers_404_or_503() -> None:
    raw = b'{"model": "m", "prompt": "hi", "stream": true, "cache_salt": "mine"}'
    parsed = parse(raw, COMPLETIONS, FakeCatalog({"m"}))  # type: ignore[arg-type]
    assert (parsed.raw, parsed.model, parsed.stream, parsed.cache_salt) == (raw, "m", True, "mine")
    with pytest.raises(ApiError) as unknown:
        parse(raw, COMPLETIONS, FakeCatalog({"other"}))  # type: ignore[arg-type]
    assert unknown.value.status == 404
    with pytest.raises(ApiError) as empty:
        parse(raw, COMPLETIONS, FakeCatalog(set(), routable=False))  # type: ignore[arg-type]
    assert empty.value.status == 503


def test_a_tenants_salt_replaces_the_clients_in_the_forwarded_bytes() -> None:
    raw = b'{"model": "m", "prompt": "hi", "cache_salt": "mine"}'
    untouched = salt_for_tenant(parse(raw, COMPLETIONS, FakeCatalog({"m"})), TenantResolver(TenantsConfig()), None)  # type: ignore[arg-type]
    assert untouched.raw is raw
    salted = salt_for_tenant(parse(raw, COMPLETIONS, FakeCatalog({"m"})), TENANTS, "alice")  # type: ignore[arg-type]
    assert salted.cache_salt not in (None, "mine")
    assert msgspec.json.decode(salted.raw)["cache_salt"] == salted.cache_salt


def test_routing_errors_are_answered_as_the_openai_api_does() -> None:
    with pytest.raises(ApiError) as bad_prompt:
        with routing_errors():
            raise PromptError("too long", "messages", "context_length_exceeded")
    assert (bad_prompt.value.status, bad_prompt.value.code) == (400, "context_length_exceeded")
    with pytest.raises(ApiError) as no_replica:
        with routing_errors():
            raise NoHealthyReplica("m")
    assert (no_replica.value.status, no_replica.value.code) == (503, "no_replica")


def test_a_prompt_beginning_settles_the_match_only_when_every_replica_s_ends_inside_it() -> None:
    keys = [11, 12, 13, 14]  # a beginning of 4 full blocks of 16 tokens
    assert settled(keys, {}, 16, {})  # held nowhere
    assert settled(keys, {"r0": PrefixMatch(gpu=48), "r1": PrefixMatch(predicted=16)}, 16, {})
    assert not settled(keys, {"r0": PrefixMatch(gpu=64)}, 16, {})  # it may run on into the rest
    assert not settled(keys, {"r0": PrefixMatch(gpu=32, cpu=32)}, 16, {})
    assert not settled([], {}, 16, {})  # not one full block: nothing is known
    # r0's match ends where another prompt's beginning ended, routed on while its rest is tokenized
    assert not settled(keys, {"r0": PrefixMatch(predicted=32)}, 16, {(16, 12): 1})
    assert settled(keys, {"r0": PrefixMatch(predicted=32)}, 16, {(8, 12): 1, (16, 13): 1})
