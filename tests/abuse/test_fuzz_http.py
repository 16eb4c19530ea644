"""Hostile bodies and ids for the agents' APIs, over real HTTP to `kvgate serve` on a real `kvgate sim`, checked by
Hypothesis. ``test_fuzz.py`` calls the parse functions directly; this checks what a client actually gets: a refusal in
its own API's error shape (Anthropic's on ``/v1/messages*``, OpenAI's on ``/v1/responses*``) and a 4xx, never a 5xx,
whatever layer refuses it (body reading, JSON decoding, validation, routing, the engine's own answer relayed), and a
gateway still serving afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, example, given, settings
from hypothesis import strategies as st

from tests.abuse.support import gateway_config
from tests.abuse.test_fuzz import json_values, messages_bodies, request_like, responses_bodies
from tests.support import Gateway, Sim, start_kvgate, start_sim

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
HTTP_FUZZ = settings(max_examples=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
"""Bounded so each test takes seconds. ``function_scoped_fixture``: the only function-scoped fixture is
:func:`still_serving`, which is meant to run once per test (after all its examples), not once per example."""
VALID_MESSAGES = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
VALID_RESPONSES = {"model": MODEL, "max_output_tokens": 2, "input": "hello"}

MESSAGES_FIELDS = ["model", "messages", "max_tokens", "system", "tools", "tool_choice", "stream", "stop_sequences",
                   "temperature", "top_p", "top_k", "metadata", "thinking", "output_config", "service_tier",
                   "container", "mcp_servers", "context_management", "priority", "cache_salt", "chat_template"]
RESPONSES_FIELDS = ["model", "input", "instructions", "max_output_tokens", "tools", "tool_choice", "reasoning",
                    "previous_response_id", "store", "stream", "text", "temperature", "top_p", "prompt_cache_key",
                    "include", "background", "metadata", "truncation", "parallel_tool_calls", "user", "priority",
                    "request_id", "max_tool_calls", "cache_salt", "top_logprobs", "service_tier"]
ANTHROPIC_PATHS = ["/v1/messages", "/v1/messages/count_tokens"]
POST_PATHS = [*ANTHROPIC_PATHS, "/v1/responses"]
CONTENT_TYPES = [None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=xyz", "application/json; charset=utf-16", "application/octet-stream"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("abuse-fuzz-http")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")  # stored responses, so a real id can be mangled
        s = start_sim(workdir, 1, "--time-scale", "0", "--max-model-len", "2048", "--kv-blocks", "4096")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    g = start_kvgate(workdir, gateway_config(sim, workdir, "fuzz-http.yaml"))
    yield g
    g.stop()


@pytest.fixture(scope="module")
def client(gw: Gateway) -> Iterator[httpx.Client]:
    """One keep-alive client for every example: a new connection each would cost more than the request."""
    with httpx.Client(base_url=gw.url, timeout=15) as c:
        yield c


@pytest.fixture
def still_serving(gw: Gateway, client: httpx.Client) -> Iterator[None]:
    """After a test's examples: the gateway answers health and a valid request of each API, and logged no bug (a
    500 is logged with its traceback; one raised after the answer, in a background task, reaches no client)."""
    logged_before = len(gw.process.output())
    yield
    assert gw.process.alive(), gw.process.tail()
    assert client.get("/health").status_code == 200
    for path, body in (("/v1/messages", VALID_MESSAGES), ("/v1/messages/count_tokens", VALID_MESSAGES),
                       ("/v1/responses", VALID_RESPONSES)):
        answer = client.post(path, json=body)
        assert answer.status_code == 200, (path, answer.text[:500])
    log = gw.process.output()[logged_before:]  # this test's lines only: another test's bug fails that test
    assert "unhandled error" not in log and "Traceback" not in log, log[-4000:]


def assert_in_shape(path: str, response: httpx.Response, sent: object) -> None:
    """Under 500; a 4xx in the error shape of the path's API, with a message (a 2xx is a body that was valid)."""
    status = response.status_code
    if currently_in_test_context():
        event(f"HTTP {status}")  # pytest --hypothesis-show-statistics shows how far the examples got
    context = f"{path} {status} for {sent!r:.300}: {response.text[:500]}"
    assert status < 500, context
    if status < 400:
        assert 200 <= status < 300, context
        return
    assert response.headers.get("content-type", "").startswith("application/json"), context
    body = response.json()
    if path.startswith("/v1/messages"):
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", context
        error = body["error"]
        assert isinstance(error, dict) and set(error) == {"type", "message"}, context
        assert isinstance(error["type"], str) and error["type"], context
    else:
        assert isinstance(body, dict) and set(body) == {"error"}, context
        error = body["error"]
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, context
        assert isinstance(error["type"], str) and error["type"], context
    assert isinstance(error["message"], str) and error["message"].strip(), context


def post(client: httpx.Client, path: str, content: bytes, content_type: str | None = "application/json") -> None:
    headers = {"content-type": content_type} if content_type is not None else {}
    assert_in_shape(path, client.post(path, content=content, headers=headers), content)


def nested(depth: int, opener: str) -> str:
    closer = "]" if opener == "[" else "}"
    return opener * depth + "1" + closer * depth


def wrong_typed(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects naming the endpoint's own fields, each mapped to any JSON value (mostly the wrong type), usually with
    the fleet's model so the body gets past the model check to the API's validation."""
    values = st.one_of(json_values, request_like, st.integers(min_value=1, max_value=600).map(lambda d: nested(d, "["))
                       .map(json.loads))
    return st.builds(lambda model, rest: {**model, **rest},
                     st.sampled_from([{"model": MODEL}, {"model": MODEL}, {}, {"model": "no-such-model"}]),
                     st.dictionaries(st.sampled_from(fields), values, max_size=6))


paths = st.sampled_from(POST_PATHS)


@HTTP_FUZZ
@given(path=paths, body=st.one_of(json_values, request_like))
@example(path="/v1/messages", body=[])
@example(path="/v1/responses", body="a string")
@example(path="/v1/messages/count_tokens", body=None)
def test_any_json_value_is_served_or_refused_in_the_apis_shape(client: httpx.Client, still_serving: None, path: str,
                                                               body: Any) -> None:
    """Not an object, or an object of anything: refused by the API that was asked, in its shape."""
    post(client, path, json.dumps(body).encode())


@HTTP_FUZZ
@given(body=wrong_typed(MESSAGES_FIELDS) | messages_bodies.map(lambda b: {**b, "model": MODEL})
       | messages_bodies.map(lambda b: {**b, "model": MODEL, "max_tokens": 2}),
       path=st.sampled_from(ANTHROPIC_PATHS))
@example(body={"model": MODEL, "messages": [{"role": "user", "content": [{"type": []}]}]}, path="/v1/messages")
@example(body={"model": MODEL, "max_tokens": -1, "messages": []}, path="/v1/messages")
@example(body={"model": MODEL, "messages": "hi"}, path="/v1/messages/count_tokens")
def test_messages_fields_of_the_wrong_type_get_anthropics_shape(client: httpx.Client, still_serving: None,
                                                                 body: dict[str, Any], path: str) -> None:
    """Wrong types anywhere, and bodies shaped like the API's (some valid, whose refusals, if any, are the
    engine's: relayed in Anthropic's shape)."""
    post(client, path, json.dumps(body).encode())


@HTTP_FUZZ
@given(body=wrong_typed(RESPONSES_FIELDS) | responses_bodies.map(lambda b: {**b, "model": MODEL})
       | responses_bodies.map(lambda b: {**b, "model": MODEL, "max_output_tokens": 2}))
@example(body={"model": MODEL, "input": [{"role": "user", "content": [{"type": []}]}]})
@example(body={"model": MODEL, "input": "x", "previous_response_id": 7})
@example(body={"model": MODEL, "input": "x", "previous_response_id": "resp_" + "0" * 56})
@example(body={"model": MODEL, "input": "x", "previous_response_id": "resp_" + "0" * 55 + "\x80"})  # was a 500 (hmac)
def test_responses_fields_of_the_wrong_type_get_openais_shape(client: httpx.Client, still_serving: None,
                                                               body: dict[str, Any]) -> None:
    """As for Messages, in OpenAI's shape; ``previous_response_id`` reaches the id check and the replica lookup."""
    post(client, "/v1/responses", json.dumps(body).encode())


@HTTP_FUZZ
@given(path=paths, depth=st.integers(min_value=1, max_value=100_000), opener=st.sampled_from(["[", "{\"a\":"]),
       field=st.sampled_from(["messages", "input", "system", "tools", "metadata", "max_tokens"]))
@example(path="/v1/messages", depth=1_000, opener="[", field="messages")
@example(path="/v1/responses", depth=100_000, opener="{\"a\":", field="input")
@example(path="/v1/messages", depth=100_000, opener="{\"a\":", field="messages")  # answered before the body is read
def test_deeply_nested_bodies_are_refused_in_the_apis_shape(client: httpx.Client, still_serving: None, path: str,
                                                            depth: int, opener: str, field: str) -> None:
    """Past the decoder's depth limit a 400, past the body's JSON bounds a 413 (before it is all read): both in
    the API's shape, and neither a RecursionError's 500."""
    post(client, path, f'{{"model":"{MODEL}","{field}":{nested(depth, opener)}}}'.encode())


def test_an_answer_before_the_body_is_read_says_the_connection_closes(client: httpx.Client) -> None:
    """A body with too many JSON objects is refused as it arrives, before all of it is read, and the connection is
    closed after the answer (lingering). The answer said nothing of it, so a client sent its next request on the
    connection and the close cut it off (httpx: "Server disconnected without sending a response")."""
    objects = nested(100_000, '{"a":')
    body = f'{{"model":"{MODEL}","messages":{objects}}}'.encode()
    for path in POST_PATHS:
        answer = client.post(path, content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 413 and answer.headers.get("connection") == "close", answer.headers
        assert_in_shape(path, answer, "100,000 nested objects")
        assert client.get("/health").status_code == 200  # on the next connection


@HTTP_FUZZ
@given(path=paths, raw=st.binary(max_size=400) | st.text(max_size=200).map(str.encode),
       content_type=st.sampled_from(CONTENT_TYPES))
@example(path="/v1/messages", raw=b"", content_type="application/json")
@example(path="/v1/messages/count_tokens", raw=b'{"model": "kvgate-sim", "messages": [', content_type=None)
@example(path="/v1/responses", raw=b'{"model": "\xff\xfe"}', content_type="application/json")
@example(path="/v1/responses", raw=json.dumps(VALID_RESPONSES).encode("utf-16"), content_type="application/json")
def test_bytes_that_are_not_json_are_refused_in_the_apis_shape(client: httpx.Client, still_serving: None, path: str,
                                                               raw: bytes, content_type: str | None) -> None:
    """Garbage, truncated JSON, invalid UTF-8, UTF-16, under any content type: the JSON decoder's 400, in shape."""
    post(client, path, raw, content_type)


@HTTP_FUZZ
@given(path=paths, content_type=st.sampled_from(CONTENT_TYPES[2:]))
def test_a_valid_body_under_another_content_type_is_not_a_5xx(client: httpx.Client, still_serving: None, path: str,
                                                              content_type: str) -> None:
    """The gateway reads every body as JSON whatever it is labelled (as vLLM does): served, or refused in shape."""
    body = VALID_RESPONSES if path == "/v1/responses" else VALID_MESSAGES
    post(client, path, json.dumps(body).encode(), content_type)


def path_segment(response_id: str) -> str:
    """``response_id`` as one path segment: every reserved character quoted, dots too (a client normalising
    ``..`` away would send another path)."""
    return quote(response_id, safe="").replace(".", "%2E")


def by_id(client: httpx.Client, action: str, response_id: str, query: str = "", body: bytes = b"") -> httpx.Response:
    """``GET``, ``DELETE`` or ``POST …/cancel`` of ``response_id``, following the router's trailing-slash redirect
    (a path ending in '/': no id, or one ending in '/'), which must stay on the gateway."""
    url = f"/v1/responses/{path_segment(response_id)}" + ("/cancel" if action == "cancel" else "")
    method = {"get": "GET", "delete": "DELETE", "cancel": "POST"}[action]
    response = client.request(method, url + query, content=body or None, follow_redirects=True)
    for hop in response.history:
        assert hop.status_code == 307 and hop.headers["location"].startswith(str(client.base_url)), hop.headers
    return response


@pytest.fixture(scope="module")
def stored_id(client: httpx.Client) -> str:
    """A response id kvgate made, to mangle into ids that look almost right."""
    answer = client.post("/v1/responses", json={**VALID_RESPONSES, "store": True})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


LONGEST_ID = 65_000
"""Near the gateway's ``server.max_header_bytes`` (64 KiB) for the request line, and within httpx's longest URL
(64 KiB too): a longer one cannot be sent with httpx (``test_connection_limits.py`` sends oversized heads raw)."""
response_ids = st.one_of(
    st.text(max_size=60),
    st.text(alphabet="/?#%.&=+ \\\t\"'<>", max_size=20),
    st.integers(min_value=100, max_value=LONGEST_ID).map(lambda n: "resp_" + "0" * (n - 5)),
    st.text(alphabet="0123456789abcdef\x80é", min_size=56, max_size=56).map(lambda h: "resp_" + h),
)
"""Any text, the characters a path treats specially, very long ids, and ids of the length kvgate's have (a nonce and
a MAC in hex, :class:`~kvgate.router.routing.stored_responses.ResponseIds`), some with a character that is not."""


@HTTP_FUZZ
@given(response_id=response_ids, action=st.sampled_from(["get", "delete", "cancel"]),
       body=st.sampled_from([b"", b"{}", b"not json"]), query=st.sampled_from(["", "?stream=true", "?stream=%00"]))
@example(response_id="", action="get", body=b"", query="")
@example(response_id="..", action="delete", body=b"", query="")
@example(response_id="a/cancel", action="get", body=b"", query="")
@example(response_id="x" * LONGEST_ID, action="cancel", body=b"", query="?stream=true")
@example(response_id="resp_" + "0" * 55 + "\x80", action="get", body=b"", query="")  # was a 500 (hmac)
def test_hostile_response_ids_are_refused_in_openais_shape(client: httpx.Client, still_serving: None, response_id: str,
                                                            action: str, body: bytes, query: str) -> None:
    """Ids are the client's text in the path: whatever they hold, and however long, the answer is OpenAI's shape
    (a 404 for an id kvgate did not make, a 400 for a body these take none of), never a 5xx."""
    response = by_id(client, action, response_id, query, body)
    assert_in_shape("/v1/responses", response, (action, response_id[:200], query, body))


@HTTP_FUZZ
@given(position=st.integers(min_value=0, max_value=60), replacement=st.text(min_size=0, max_size=3),
       action=st.sampled_from(["get", "cancel"]))
def test_a_mangled_stored_id_is_refused_in_openais_shape(client: httpx.Client, still_serving: None, stored_id: str,
                                                          position: int, replacement: str, action: str) -> None:
    """An id one edit away from a real one: its MAC no longer matches (a 404; a 405 for a path a '/' in it made
    another route's), unless the edit (or the trailing-slash redirect) gives back the real one."""
    mangled = stored_id[:position] + replacement + stored_id[position + 1:]
    response = by_id(client, action, mangled)
    assert_in_shape("/v1/responses", response, mangled)
    if not response.url.path.startswith(f"/v1/responses/{stored_id}"):
        assert response.status_code in (404, 405), response.text
