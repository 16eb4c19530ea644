"""One replica's HTTP surface: vLLM's OpenAI-compatible API, its Anthropic Messages and OpenAI Responses APIs, plus
the sim-only /sim/* endpoints.

Built on aiohttp's low-level server (one handler, a table of routes) so a single process can serve a whole fleet at
thousands of requests per second. Bodies, SSE framing, error bodies and status codes follow vLLM 0.33 for the
OpenAI endpoints and 0.32 for Messages and Responses (``anthropic.py``, ``responses.py``). Every API's request
becomes one generation here, run the same way (queueing, prefix cache, KV events, faults, /sim/requests), and its
API's :class:`loadgen.sim.answers.Answer` writes the answer. A client that goes away aborts its request at once
(``handler_cancellation``); a replica fault cuts the connection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgspec
from aiohttp import web

from . import anthropic, responses
from .answers import SSE_HEADERS, Answer, ChatAnswer, CompletionAnswer
from .block_hash import block_chain
from .bootstrap import BootstrapFields, ReplicaBootstrap, parse_fields
from .checks import DEFAULT_MAX_TOKENS, check_cache_salt, check_model
from .conversation import Conversation, prompt_ids, tool_dicts
from .engine import RemoteSource, SimRequest, State
from .errors import EngineError
from .ids import random_id
from .metrics import CONTENT_TYPE, MetricsPage
from .replica import SimReplica, request_headers
from .routes import Route, match

AfterAnswer = Callable[[], Awaitable[None]]
ApplyFault = Callable[[dict[str, Any]], Awaitable[tuple[dict[str, Any], AfterAnswer | None]]]
"""``/sim/fault``'s work (``loadgen.sim.faults.apply`` for this replica): a fault's body in; the answer out and, when
the fault must wait until the answer is sent, what to run then."""

JSON = "application/json"
MAX_BODY_BYTES = 256 * 1024 * 1024
"""Long-context prompts sent as token-id lists run to megabytes; uvicorn (vLLM) sets no limit of its own."""

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


class ReplicaGone(Exception):
    """The replica faulted (restart/stop) under a request: the connection is cut, as a crashed engine's would be."""

    def __init__(self, response: web.StreamResponse | None = None) -> None:
        super().__init__("replica restarted")
        self.response = response


@dataclass(frozen=True, slots=True)
class Generation:
    """A validated generation request, common to every API (each hands its request's fields over in the chat
    completions request's names, as vLLM's Messages handler builds a chat request)."""

    endpoint: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    kv_transfer_params: dict[str, Any] | None
    request_id: str
    session_id: str | None
    bootstrap: BootstrapFields | None = None
    """SGLang's P/D fields (bootstrap host, port, room): this request is one leg of a handoff."""


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_json_encode(body), status=status, content_type=JSON, headers=headers)


class ReplicaApi:
    """The request handler of one replica's HTTP listener, over its state, its bootstrap side (SGLang's P/D legs)
    and its metrics page; ``stats`` answers ``/sim/stats`` and ``apply_fault`` ``/sim/fault``."""

    def __init__(
        self, replica: SimReplica, bootstrap: ReplicaBootstrap, metrics_page: MetricsPage,
        stats: Callable[[], dict[str, Any]], apply_fault: ApplyFault,
    ) -> None:
        self.replica = replica
        self.bootstrap = bootstrap
        self.metrics_page = metrics_page
        self.stats = stats
        self.apply_fault = apply_fault
        p = replica.params
        self.messages_api = anthropic.MessagesApi(replica.model, p.max_model_len, p.block_size)
        self.responses_api = responses.ResponsesApi(replica.model, p.max_model_len, p.block_size, p.responses_store)
        self.routes = [
            Route("POST", "/v1/completions", self.completions),
            Route("POST", "/v1/chat/completions", self.chat_completions),
            Route("POST", "/v1/messages", self.messages),
            Route("POST", "/v1/messages/count_tokens", self.count_tokens),
            Route("POST", "/v1/responses", self.create_response),
            Route("GET", "/v1/responses/{response_id}", self.get_response),
            Route("POST", "/v1/responses/{response_id}/cancel", self.cancel_response),
            Route("GET", "/v1/models", self.models),
            Route("POST", "/tokenize", self.tokenize),
            Route("GET", "/health", self.health),
            Route("GET", "/metrics", self.metrics),
            Route("POST", "/reset_prefix_cache", self.reset_prefix_cache),
            Route("GET", "/sim/requests", self.sim_requests),
            Route("GET", "/sim/stats", self.sim_stats),
            Route("POST", "/sim/fault", self.sim_fault),
        ]

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        found = match(self.routes, request.method, request.path)
        if found.handler is None:
            assert found.refusal is not None
            body, status, headers = found.refusal
            return json_response(body, status, headers)
        try:
            return await found.handler(request, *found.params)
        except EngineError as err:
            self.replica.record_error(request, err)
            return json_response(err.body(), err.status, {"X-Request-Id": _request_id(request)})
        except ReplicaGone as gone:
            if request.transport is not None:
                request.transport.abort()
            return gone.response or web.Response(status=503)
        except ConnectionResetError:  # the client hung up mid-stream; its request was aborted on the way out
            return web.Response(status=499)

    # --- OpenAI endpoints ----------------------------------------------------------------------------------------
    async def _check_poison(self, request: web.BaseRequest) -> None:
        poison = self.replica.poison
        if poison is not None and poison in await request.read():
            raise EngineError("the engine failed on this request (poisoned by /sim/fault)", None, 500,
                           "InternalServerError")

    async def completions(self, request: web.BaseRequest) -> web.StreamResponse:
        await self._check_poison(request)
        body = await _json_body(request)
        check_model(body, self.replica.params.model)
        gen = self._generation(request, body, "/v1/completions", self._completion_prompt(body))
        return await self._serve(request, gen, CompletionAnswer(gen.request_id, self.replica.model, gen.include_usage))

    async def chat_completions(self, request: web.BaseRequest) -> web.StreamResponse:
        await self._check_poison(request)
        body = await _json_body(request)
        check_model(body, self.replica.params.model)
        gen = self._generation(request, body, "/v1/chat/completions", self._chat_prompt(body))
        return await self._serve(request, gen, ChatAnswer(gen.request_id, self.replica.model, gen.include_usage))

    # --- Anthropic Messages --------------------------------------------------------------------------------------
    async def messages(self, request: web.BaseRequest) -> web.StreamResponse:
        """A body the request model refuses is answered OpenAI-shaped; everything after it, Anthropic-shaped."""
        body = await _json_body(request)
        anthropic.check_request(body)
        try:
            await self._check_poison(request)
            ids = self.messages_api.prompt(body)
            options = self.messages_api.generation_options(body, len(ids))
            gen = self._generation(request, options, "/v1/messages", ids)
        except EngineError as err:
            raise anthropic.AnthropicError.of(err) from None
        return await self._serve(request, gen, self.messages_api.answer(gen.request_id))

    async def count_tokens(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await _json_body(request)
        anthropic.check_request(body, count_tokens=True)
        try:
            ids = self.messages_api.prompt(body, count_tokens=True)
        except EngineError as err:
            raise anthropic.AnthropicError.of(err) from None
        return json_response(anthropic.count_tokens_body(len(ids)))

    # --- OpenAI Responses ----------------------------------------------------------------------------------------
    async def create_response(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await _json_body(request)
        responses.check_request(body)
        await self._check_poison(request)
        turn = self.responses_api.turn(body)
        gen = self._generation(request, turn.options, "/v1/responses", turn.prompt_ids)
        return await self._serve(request, gen, self.responses_api.answer(body, turn))

    async def get_response(self, request: web.BaseRequest, response_id: str) -> web.StreamResponse:
        return json_response(self.responses_api.get(response_id))

    async def cancel_response(self, request: web.BaseRequest, response_id: str) -> web.StreamResponse:
        self.responses_api.cancel(response_id)  # a 404 or a 400: the sim runs no background response to cancel

    async def models(self, request: web.BaseRequest) -> web.StreamResponse:
        p = self.replica.params
        created = int(self.replica.started_at)
        card = {
            "id": p.model, "object": "model", "created": created, "owned_by": "vllm",
            "root": p.model, "parent": None, "max_model_len": p.max_model_len,
            "permission": [{
                "id": f"modelperm-{self.replica.name}", "object": "model_permission", "created": created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }
        return json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await _json_body(request)
        check_model(body, self.replica.params.model, required=False)
        if "messages" in body:
            ids = self._chat_prompt(body)
        elif "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise EngineError("prompt must be a string", "prompt")
            ids = self.replica.model.tokenizer.encode(prompt, _bool(body, "add_special_tokens", True))
        else:
            raise EngineError("either prompt or messages is required", "prompt")
        strs = None
        if _bool(body, "return_token_strs", False):
            strs = [self.replica.model.tokenizer.token_text(i) for i in ids]
        return json_response(
            {"count": len(ids), "max_model_len": self.replica.params.max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def health(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(status=200 if self.replica.healthy else 503)

    async def metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(body=self.metrics_page.render(), headers={"Content-Type": CONTENT_TYPE})

    async def reset_prefix_cache(self, request: web.BaseRequest) -> web.StreamResponse:
        """vLLM's dev endpoint: ``{"success": false}`` while blocks are in use, unless ``reset_running_requests``."""
        preempt = _query_bool(request, "reset_running_requests")
        return json_response({"success": self.replica.engine.reset_prefix_cache(reset_running_requests=preempt)})

    # --- sim-only endpoints --------------------------------------------------------------------------------------
    async def sim_requests(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            raise EngineError("limit must be an integer", "limit") from None
        records = list(self.replica.records)[-limit:] if limit > 0 else []
        return json_response({"requests": [r if isinstance(r, dict) else request_record(r) for r in records]})

    async def sim_stats(self, request: web.BaseRequest) -> web.StreamResponse:
        return json_response(self.stats())

    async def sim_fault(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await _json_body(request)
        result, after = await self.apply_fault(body)
        if after is None:
            return json_response(result)
        # The answer goes out before the fault closes this very listener.
        response = json_response(result)
        await response.prepare(request)
        await response.write_eof()
        await after()
        return response

    # --- generation ----------------------------------------------------------------------------------------------
    def _completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.replica.model.tokenizer.encode(prompt, _bool(body, "add_special_tokens", True))
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            vocab = self.replica.model.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise EngineError(f"Token id {bad} is out of vocabulary", "prompt")
            ids = list(prompt)
        elif prompt is None:
            raise EngineError("prompt is required", "prompt")
        else:
            raise EngineError("prompt must be a string, a list of token ids, or a batch of one of those", "prompt")
        return ids

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        """The chat prompt's ids as vLLM builds them: the template (the model's, or the request's own
        ``chat_template``) rendered with ``add_generation_prompt``, ``continue_final_message``, ``tools``,
        ``documents``, ``reasoning_effort`` and ``chat_template_kwargs``, then encoded with ``add_special_tokens``
        (default false)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EngineError("messages must be a non-empty list", "messages")
        for message in messages:
            _check_message(message)
        conversation = Conversation(
            messages,
            tools=tool_dicts(_optional(body, "tools", list)),
            chat_template_kwargs=_optional(body, "chat_template_kwargs", dict),
            reasoning_effort=_optional(body, "reasoning_effort", str),
            add_generation_prompt=_bool(body, "add_generation_prompt", True),
            continue_final_message=_bool(body, "continue_final_message", False),
            documents=_optional(body, "documents", list),
            chat_template=_optional(body, "chat_template", str),
            add_special_tokens=_bool(body, "add_special_tokens", False),
        )
        return prompt_ids(self.replica.model.tokenizer, conversation)

    def _generation(self, request: web.BaseRequest, body: dict[str, Any], endpoint: str, ids: list[int]) -> Generation:
        """``body`` holds the chat completions request's fields (another API's in those names)."""
        p = self.replica.params
        if not ids:
            raise EngineError("Prompt cannot be empty", "prompt")
        max_tokens = body.get("max_completion_tokens") if endpoint.endswith("chat/completions") else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if type(max_tokens) is not int or max_tokens < 1:
            raise EngineError("max_tokens must be a positive integer", "max_tokens")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise EngineError("stream must be a boolean", "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise EngineError("stream_options must be an object", "stream_options")
        if options is not None and not stream:
            raise EngineError("Stream options can only be defined when `stream=True`.", "stream_options")
        include_usage = bool(options and options.get("include_usage"))
        salt = check_cache_salt(body.get("cache_salt"))
        ktp = body.get("kv_transfer_params")
        if ktp is not None and not isinstance(ktp, dict):
            raise EngineError("kv_transfer_params must be an object", "kv_transfer_params")
        if ktp and ktp.get("do_remote_decode"):
            max_tokens = 1
        bootstrap = parse_fields(body)
        if bootstrap is not None and self.bootstrap.is_prefill_leg(bootstrap):
            max_tokens = 1
        if len(ids) + max_tokens > p.max_model_len:
            raise EngineError(
                f"This model's maximum context length is {p.max_model_len} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.", "input_tokens")
        return Generation(
            endpoint, ids, max_tokens, stream, include_usage, salt, ktp, _request_id(request), _session_id(request, body),
            bootstrap,
        )

    async def _serve(self, request: web.BaseRequest, gen: Generation, answer: Answer) -> web.StreamResponse:
        replica = self.replica
        ktp = gen.kv_transfer_params or {}
        remote = None
        if ktp.get("do_remote_prefill") and isinstance(ktp.get("remote_engine_id"), str) \
                and isinstance(ktp.get("remote_request_id"), str):
            remote = RemoteSource(ktp["remote_engine_id"], ktp["remote_request_id"])
        prefill_leg = gen.bootstrap is not None and self.bootstrap.is_prefill_leg(gen.bootstrap)
        if gen.bootstrap is not None and not prefill_leg:
            remote = await self.bootstrap.await_kv(gen.bootstrap)
        chain = block_chain(gen.prompt_ids, replica.params.block_size, gen.cache_salt)
        req = SimRequest(
            request_id=replica.next_request_id(),
            prompt_len=len(gen.prompt_ids),
            max_tokens=gen.max_tokens,
            chain=chain,
            text_seed=len(gen.prompt_ids) * 131 + sum(gen.prompt_ids[-4:]),
            cache_salt=gen.cache_salt,
            session_id=gen.session_id,
            tail_tokens=gen.prompt_ids[len(chain) * replica.params.block_size :],
            prefill_only=bool(ktp.get("do_remote_decode")) or prefill_leg,
            remote=remote,
            streaming=gen.stream,
            info={
                "endpoint": gen.endpoint, "model": replica.params.model, "stream": gen.stream,
                "cache_salt": gen.cache_salt, "kv_transfer_params_in": gen.kv_transfer_params,
                "bootstrap_room": None if gen.bootstrap is None else gen.bootstrap.room,
                "bootstrap_leg": None if gen.bootstrap is None else ("prefill" if prefill_leg else "decode"),
                "headers": request_headers(request),
            },
        )
        if (replica.role == "prefill" and not req.prefill_only) or (replica.role == "decode" and req.prefill_only):
            replica.engine.stats.off_role_requests += 1
        replica.records.append(req)
        replica.engine.submit(req)
        try:
            if gen.stream:
                return await self._stream(request, gen, req, answer)
            await _until_finished(req)
            return json_response(answer.body(req), headers={"X-Request-Id": gen.request_id})
        finally:
            if not req.finished:
                replica.engine.abort(req, "client")
            if prefill_leg:
                assert gen.bootstrap is not None
                self.bootstrap.settle(gen.bootstrap, req)

    async def _stream(self, request: web.BaseRequest, gen: Generation, req: SimRequest,
                      answer: Answer) -> web.StreamResponse:
        """The answer's events as the engine produces tokens: each step's new tokens go out in one write."""
        response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": gen.request_id})
        await response.prepare(request)
        opening = answer.opening()
        if opening:
            await response.write(opening)
        sent = 0
        while True:
            req.changed.clear()
            if req.state is State.ABORTED:
                raise ReplicaGone(response)
            out = req.output
            if len(out) > sent:
                chunks = [answer.first(req)] if sent == 0 else []
                done = req.state is State.COMPLETED
                chunks += [answer.token(req, out[i], done and i == len(out) - 1) for i in range(sent, len(out))]
                sent = len(out)
                await response.write(b"".join(chunks))
            if req.state is State.COMPLETED:
                break
            await req.changed.wait()
        await response.write(answer.closing(req))
        await response.write_eof()
        return response


def request_record(req: SimRequest) -> dict[str, Any]:
    """One /sim/requests entry; durations are on the engine's model clock (unscaled ms) unless named wall_."""
    queue = None if req.scheduled_clock_ms is None else req.scheduled_clock_ms - req.arrival_clock_ms
    ttft = None if req.first_token_clock_ms is None else req.first_token_clock_ms - req.arrival_clock_ms
    wall = None if req.first_token_wall is None else (req.first_token_wall - req.arrival_wall) * 1000.0
    clocks = req.token_clock_ms
    return {
        "request_id": req.request_id, **req.info,
        "prompt_tokens": req.prompt_len, "completion_tokens": len(req.output),
        "cached_tokens": req.cached_tokens, "transferred_tokens": req.transferred_tokens,
        "transfer_status": req.transfer_status, "kv_transfer_params_out": req.kv_transfer_params_out,
        "status": req.state.value if req.state is not State.WAITING else "running",
        "abort_reason": req.abort_reason, "queue_ms": queue, "ttft_ms": ttft, "wall_ttft_ms": wall,
        "load_ms": req.load_ms if req.scheduled_clock_ms is not None else None,
        "arrival_clock_ms": req.arrival_clock_ms, "scheduled_clock_ms": req.scheduled_clock_ms,
        "first_token_clock_ms": req.first_token_clock_ms,
        "itl_ms": [round(b - a, 3) for a, b in zip(clocks, clocks[1:])],
    }


async def _until_finished(req: SimRequest) -> None:
    while True:
        req.changed.clear()
        if req.state is State.COMPLETED:
            return
        if req.state is State.ABORTED:
            raise ReplicaGone()
        await req.changed.wait()


def _request_id(request: web.BaseRequest) -> str:
    """vLLM's ``_base_request_id``: the X-Request-Id header, else a random id."""
    header = request.headers.get("X-Request-Id")
    return random_id() if header is None else header


def _session_id(request: web.BaseRequest, body: dict[str, Any]) -> str | None:
    """vLLM 0.33's order: the body's ``session_id``, then the X-Session-ID header, then ``vllm_xargs.session_id``."""
    xargs = body.get("vllm_xargs")
    candidates = [body.get("session_id"), request.headers.get("X-Session-ID"),
                  xargs.get("session_id") if isinstance(xargs, dict) else None]
    return next((c for c in candidates if isinstance(c, str) and c), None)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise EngineError(f"{key} must be a boolean", key)
    return value


def make_request(
    message: Any, payload: Any, protocol: Any, writer: Any, task: "asyncio.Task[None]"
) -> web.BaseRequest:
    """aiohttp's low-level request with a body limit fit for long prompts (its default is 1 MiB)."""
    return web.BaseRequest(message, payload, protocol, writer, task, task.get_loop(), client_max_size=MAX_BODY_BYTES)


async def _json_body(request: web.BaseRequest) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise EngineError(f"request body larger than {MAX_BODY_BYTES} bytes", status=413) from None
    try:
        body = _json_decode(raw)
    except msgspec.DecodeError as e:
        raise EngineError(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise EngineError("request body must be a JSON object")
    return body


def _check_message(message: Any) -> None:
    """A chat message the sim can render: a string role and text content (a string or text parts); the template
    code (:meth:`loadgen.sim.tokenizer.SimTokenizer.render_chat`) puts the parts together as vLLM does."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise EngineError("each message must be an object with a string role", "messages")
    content = message.get("content")
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise EngineError("only text content parts are supported", "messages")
    elif content is not None and not isinstance(content, str):
        raise EngineError("message content must be a string or a list of text parts", "messages")


def _optional(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        raise EngineError(f"{key} must be a {kind.__name__}", key)
    return value


def _query_bool(request: web.BaseRequest, name: str) -> bool:
    """A boolean query parameter as FastAPI (vLLM's server) parses one; absent is false."""
    value = request.query.get(name, "false").lower()
    if value in ("1", "true", "on", "yes", "t", "y"):
        return True
    if value in ("0", "false", "off", "no", "f", "n"):
        return False
    raise EngineError(f"{name} must be a boolean", name)
