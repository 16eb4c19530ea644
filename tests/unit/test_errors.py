"""Every error kvgate answers has OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

import httpx

from kvgate.router.apis.anthropic import ANTHROPIC_ERRORS
from kvgate.router.apis.responses import RESPONSES_ERRORS
from kvgate.router.app.routes import Routes
from kvgate.router.core.errors import OPENAI_ERRORS, ApiError
from kvgate.router.core.http import HttpRequest
from tests.served import served


def routes() -> Routes:
    table = Routes()

    async def client_mistake(request: HttpRequest) -> None:
        raise ApiError(404, "The model `x` does not exist.", param="model", code="model_not_found")

    async def bug(request: HttpRequest) -> None:
        raise RuntimeError("a bug")

    table.add("GET", "/client-mistake", client_mistake)
    table.add("GET", "/bug", bug)
    return table


def assert_openai_error(body: dict, status_type: str) -> dict:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == status_type
    return error


def test_api_error_body_and_response() -> None:
    err = ApiError(413, "too big", code="request_too_large")
    assert err.body() == {"error": {"message": "too big", "type": "invalid_request_error", "param": None,
                                    "code": "request_too_large"}}
    response = err.response({"x-request-id": "r1"})
    assert response.status_code == 413 and response.headers["x-request-id"] == "r1"
    assert json.loads(bytes(response.body)) == err.body()
    assert ApiError(401, "no key").error_type == "authentication_error"


def test_sse_error_event_ends_the_stream() -> None:
    event = OPENAI_ERRORS.stream_events(ApiError(502, "replica died", code="upstream_stream_error"))
    first, second, rest = event.split(b"\n\n")
    assert json.loads(first.removeprefix(b"data: "))["error"]["code"] == "upstream_stream_error"
    assert second == b"data: [DONE]" and rest == b""


def test_anthropic_errors_are_in_anthropics_shape_with_its_types() -> None:
    response = ApiError(429, "slow down", code="rate_limited").response(shape=ANTHROPIC_ERRORS)
    assert json.loads(bytes(response.body)) == {"type": "error", "error": {"type": "rate_limit_error",
                                                                           "message": "slow down"}}
    event = ANTHROPIC_ERRORS.stream_events(ApiError(502, "replica died"))
    name, data = event.rstrip(b"\n").split(b"\n")
    assert name == b"event: error" and json.loads(data.removeprefix(b"data: "))["error"]["type"] == "api_error"
    # vLLM answers some /v1/messages errors in OpenAI's shape (its framework's validation), some in none.
    openai_shaped = json.dumps({"error": {"message": "bad block", "type": "Bad Request", "code": 400}}).encode()
    body, media = ANTHROPIC_ERRORS.from_engine(400, openai_shaped, "application/json")
    assert json.loads(body) == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad block"}}
    body, _ = ANTHROPIC_ERRORS.from_engine(405, b'{"detail": "Method Not Allowed"}', "application/json")
    assert json.loads(body)["error"]["message"] == "Method Not Allowed"
    body, media = ANTHROPIC_ERRORS.from_engine(500, b"Internal Server Error", "text/plain")
    assert json.loads(body)["error"] == {"type": "api_error", "message": "the upstream replica answered 500"}
    assert media == "application/json"


def test_responses_stream_errors_are_error_events() -> None:
    event = RESPONSES_ERRORS.stream_events(ApiError(502, "replica died", code="upstream_stream_error"))
    name, data = event.rstrip(b"\n").split(b"\n")
    assert name == b"event: error"
    assert json.loads(data.removeprefix(b"data: ")) == {"type": "error", "code": "upstream_stream_error",
                                                          "message": "replica died", "param": None}


async def test_the_server_turns_every_failure_into_an_openai_error() -> None:
    async with served(routes()) as url, httpx.AsyncClient(base_url=url) as client:
        r = await client.get("/client-mistake")
        assert r.status_code == 404
        assert assert_openai_error(r.json(), "not_found_error")["param"] == "model"
        r = await client.get("/no-such-route")
        assert r.status_code == 404 and assert_openai_error(r.json(), "not_found_error")
        r = await client.put("/client-mistake")
        assert r.status_code == 405 and assert_openai_error(r.json(), "invalid_request_error")
        assert r.headers["allow"] == "GET, HEAD"
        r = await client.head("/client-mistake")
        assert r.status_code == 404 and r.content == b"" and int(r.headers["content-length"]) > 0
        r = await client.get("/bug")
        assert r.status_code == 500 and assert_openai_error(r.json(), "internal_error")["code"] == "internal_error"
