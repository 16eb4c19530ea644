"""A replica's route table, matched as vLLM's FastAPI router matches: exact paths and ``{param}`` segments, in the
order the routes were declared; a path some route serves under another method is a 405 naming that route's method
(``Allow``), any other path a 404, both with FastAPI's ``{"detail": ...}`` body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web

Handler = Callable[..., Awaitable[web.StreamResponse]]
"""Called with the request, then the path's ``{param}`` segments in order."""


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    """``/v1/responses/{response_id}``: a ``{...}`` segment matches any one non-empty segment."""
    handler: Handler

    def params(self, path: str) -> list[str] | None:
        """The path's ``{param}`` segments, or None when the path is not this route's."""
        want, got = self.path.split("/"), path.split("/")
        if len(want) != len(got):
            return None
        params = []
        for w, g in zip(want, got):
            if w.startswith("{") and w.endswith("}"):
                if not g:
                    return None
                params.append(g)
            elif w != g:
                return None
        return params


@dataclass(frozen=True, slots=True)
class Match:
    """What a request's method and path come to: its route's handler and parameters, or the refusal to send."""

    handler: Handler | None
    params: list[str]
    refusal: tuple[dict[str, Any], int, dict[str, str]] | None = None
    """``(body, status, headers)`` when no route serves the request."""


def match(routes: list[Route], method: str, path: str) -> Match:
    partial: Route | None = None
    for route in routes:
        params = route.params(path)
        if params is None:
            continue
        if route.method == method:
            return Match(route.handler, params)
        partial = partial or route
    if partial is None:
        return Match(None, [], ({"detail": "Not Found"}, 404, {}))
    return Match(None, [], ({"detail": "Method Not Allowed"}, 405, {"Allow": partial.method}))
