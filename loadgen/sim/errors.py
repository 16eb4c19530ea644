"""The error every bad request ends in: an OpenAI-style body with vLLM's types (400 BadRequestError, 404 NotFoundError)."""

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
