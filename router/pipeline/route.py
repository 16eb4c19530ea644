"""The tokenize and route stages as the request path runs them (generation and explain alike): the router's
:meth:`~kvgate.router.routing.router.Router.tokenize` and :meth:`~kvgate.router.routing.router.Router.route`, with
their errors answered as the OpenAI API does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvgate.policies.base import NoHealthyReplica
from kvgate.router.http.errors import ApiError
from kvgate.router.pipeline.admit import Admission
from kvgate.router.pipeline.parse import Parsed
from kvgate.router.prompts.tokenizer import PromptError
from kvgate.router.routing.router import Endpoint, Prompt, Routed, Router


@contextmanager
def routing_errors() -> Iterator[None]:
    """A malformed or too long prompt is a 400; no replica to serve the model a 503."""
    try:
        yield
    except PromptError as e:
        raise ApiError(400, e.message, param=e.param, code=e.code) from e
    except NoHealthyReplica as e:
        raise ApiError(503, "no replica can serve this model", code="no_replica") from e


async def tokenize(router: Router, endpoint: Endpoint, parsed: Parsed) -> Prompt:
    with routing_errors():
        return await router.tokenize(endpoint, parsed.body, model=parsed.model, cache_salt=parsed.cache_salt,
                                     body_bytes=len(parsed.raw))


def route(router: Router, prompt: Prompt, admission: Admission, *, explain: bool = False) -> Routed:
    with routing_errors():
        return router.route(prompt, request_id=admission.request_id, session_id=admission.client.session_id,
                            tenant=admission.tenant, explain=explain)
