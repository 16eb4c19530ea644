"""How the stages' own errors are answered, as the OpenAI API does: a prompt the engine would refuse is a 400, a
model no replica can serve a 503."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvgate.policies.base import NoHealthyReplica
from kvgate.router.core.errors import ApiError
from kvgate.router.prompts.prompt import PromptError


@contextmanager
def routing_errors() -> Iterator[None]:
    """A malformed or too long prompt is a 400; no replica to serve the model a 503."""
    try:
        yield
    except PromptError as e:
        raise ApiError(400, e.message, param=e.param, code=e.code) from e
    except NoHealthyReplica as e:
        raise ApiError(503, "no replica can serve this model", code="no_replica") from e
