"""Every error kvgate answers has OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from kvgate.router.core.errors import ApiError, install_error_handlers


class Item(BaseModel):
    name: str


def app() -> FastAPI:
    a = FastAPI()
    install_error_handlers(a)

    @a.get("/client-mistake")
    async def client_mistake() -> None:
        raise ApiError(404, "The model `x` does not exist.", param="model", code="model_not_found")

    @a.post("/validated")
    async def validated(item: Item) -> dict[str, str]:
        return {"name": item.name}

    @a.get("/bug")
    async def bug() -> None:
        raise RuntimeError("a bug")

    return a


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
    event = ApiError(502, "replica died", code="upstream_stream_error").sse_event()
    first, second, rest = event.split(b"\n\n")
    assert json.loads(first.removeprefix(b"data: "))["error"]["code"] == "upstream_stream_error"
    assert second == b"data: [DONE]" and rest == b""


def test_handlers_turn_every_failure_into_an_openai_error() -> None:
    client = TestClient(app(), raise_server_exceptions=False)
    r = client.get("/client-mistake")
    assert r.status_code == 404
    assert assert_openai_error(r.json(), "not_found_error")["param"] == "model"
    r = client.get("/no-such-route")
    assert r.status_code == 404 and assert_openai_error(r.json(), "not_found_error")
    r = client.put("/client-mistake")
    assert r.status_code == 405 and assert_openai_error(r.json(), "invalid_request_error")
    r = client.post("/validated", json={"name": 3})
    assert r.status_code == 422
    assert assert_openai_error(r.json(), "invalid_request_error")["param"] == "name"
    r = client.get("/bug")
    assert r.status_code == 500 and assert_openai_error(r.json(), "internal_error")["code"] == "internal_error"
