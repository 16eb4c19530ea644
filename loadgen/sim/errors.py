"""The error every bad request ends in: an OpenAI-style body with vLLM's types (400 BadRequestError, 404 NotFoundError),
and the shape of a body that fails vLLM's request model before any handler runs."""

from __future__ import annotations

from typing import Any


class EngineError(Exception):
    """The error a simulated engine answers a request with: its HTTP status, vLLM's error type and the parameter
    at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class BodyError(EngineError):
    """A body that does not fit the endpoint's request model: FastAPI refuses it before vLLM's handler runs, with
    vLLM's ``RequestValidationError`` handler's shape (type ``Bad Request``, ``param`` the field's dotted location
    under ``body``) whatever the endpoint, ``/v1/messages`` included. The message names the field and the rule in
    the sim's words (vLLM prints pydantic's error records)."""

    def __init__(self, loc: str, msg: str):
        """``loc``: the field's dotted path in the body, empty for the body as a whole (a rule across fields)."""
        param = f"body.{loc}" if loc else "body"
        super().__init__(f"1 validation error:\n  {{'loc': '{param}', 'msg': {msg!r}}}", param, kind="Bad Request")
