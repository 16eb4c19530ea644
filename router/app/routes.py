"""The route table: a request's method and path to the endpoint that answers it.

A route is a path, exact or a template with ``{name}`` segments (``/v1/responses/{response_id}``), and a method; a
``GET`` route answers ``HEAD`` too. A path no route has is a 404, a path whose routes take other methods a 405 naming
them (``Allow``), both in OpenAI's error shape like every kvgate error. Exact paths are one dictionary look-up;
templates are matched segment by segment, in the order they were added.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kvgate.router.core.errors import ApiError
from kvgate.router.core.http import HttpRequest

Endpoint = Callable[[HttpRequest], Awaitable[Any]]
"""Answers a request with a Starlette ``Response`` or a :class:`~kvgate.router.core.http.StreamedAnswer`."""


class Routes:
    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Endpoint]] = {}
        self._templates: list[tuple[str, tuple[str, ...], dict[str, Endpoint]]] = []

    def add(self, method: str, path: str, endpoint: Endpoint) -> None:
        if "{" not in path:
            self._exact.setdefault(path, {})[method] = endpoint
            return
        segments = tuple(path.strip("/").split("/"))
        for template, _, methods in self._templates:
            if template == path:
                methods[method] = endpoint
                return
        self._templates.append((path, segments, {method: endpoint}))

    def resolve(self, method: str, path: str) -> tuple[Endpoint, str, dict[str, str]]:
        """The endpoint for ``method`` on ``path``, the route's template and its path parameters."""
        methods = self._exact.get(path)
        if methods is not None:
            return _pick(methods, method), path, {}
        if self._templates:
            parts = path.strip("/").split("/")
            for template, segments, methods in self._templates:
                params = _match(segments, parts)
                if params is not None:
                    return _pick(methods, method), template, params
        return _not_found, path, {}


def _match(segments: tuple[str, ...], parts: list[str]) -> dict[str, str] | None:
    if len(segments) != len(parts):
        return None
    params: dict[str, str] = {}
    for segment, part in zip(segments, parts):
        if segment.startswith("{"):
            if not part:
                return None
            params[segment[1:-1]] = part
        elif segment != part:
            return None
    return params


def _pick(methods: dict[str, Endpoint], method: str) -> Endpoint:
    endpoint = methods.get(method) or (methods.get("GET") if method == "HEAD" else None)
    if endpoint is not None:
        return endpoint
    allowed = ", ".join(sorted({*methods, *(("HEAD",) if "GET" in methods else ())}))

    async def not_allowed(request: HttpRequest) -> Any:
        raise ApiError(405, "Method Not Allowed", code="405", headers={"allow": allowed})

    return not_allowed


async def _not_found(request: HttpRequest) -> Any:
    raise ApiError(404, "Not Found", code="404")
