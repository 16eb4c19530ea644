"""From an OpenAI request body to the prompt's token ids, as the engine will compute them, without blocking the loop.

Three sources, tried in order:

1. ``local``: the model's tokenizer and chat template (:class:`router.prompts.model_tokenizer.ModelTokenizer`), exact.
   Prompt text is cut into pieces that encode independently (:class:`router.prompts.model_tokenizer.PromptSplitter`: at
   special tokens, so per chat message, and inside long documents) and each piece's ids are kept in a bounded LRU, so a
   growing chat or a re-sent document costs a template render and a few dictionary look-ups instead of a full encode.
2. ``engine``: an engine's ``POST /tokenize`` through an injected async callable (the gateway picks a healthy replica;
   no HTTP here), for models without a local tokenizer or with content the local path cannot render (media parts).
3. ``approximate``: stable pseudo ids, one per 4 bytes of rendered text, flagged ``approximate=True`` so decisions
   and metrics say so. Repeated prompts give the same ids, and prompts sharing a text prefix share an id prefix.

Prompts given as token ids are used as is (``ids``). A completions request with a batch of prompts is routed on its
first prompt; ``prompt_count`` says how many there were. Rendering, cutting and cache look-ups run on the event loop;
encoding uncached text runs on a small thread pool when it is long (the tokenizers library releases the GIL while
encoding a batch), on the loop when it is short: for short text the hop to a worker and back costs more CPU than the
encode itself. Client mistakes raise :class:`PromptError`, which the
gateway answers with a 400 in OpenAI's error format.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
import zlib
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from threading import Lock
from typing import Any, Awaitable, Callable, Literal, Sequence

import jinja2

from kvgate.policies.config import ModelConfig
from kvgate.router.config import ConfigError
from kvgate.router.http.config import LimitsConfig
from kvgate.router.prompts.model_tokenizer import TEXT_PART_FIELDS, ModelTokenizer, Piece, PromptSplitter
from kvgate.router.prompts.request_templates import RequestTemplateRenderer, TemplateJob, TemplateRejected

Endpoint = Literal["completions", "chat"]
Source = Literal["local", "engine", "approximate", "ids"]
EngineTokenize = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""Sends a vLLM ``/tokenize`` body (``{"model", "prompt"}`` or ``{"model", "messages", ...}``) to a replica serving
the model and returns the decoded JSON response (``{"count", "tokens", ...}``); raises on any failure."""

MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "image_embeds", "image_pil", "audio_url", "input_audio", "audio_embeds", "video_url"}
)
"""Content parts only the engine can turn into tokens (it inserts model-specific placeholder tokens)."""

APPROXIMATE_BYTES_PER_TOKEN = 4
INLINE_PROMPT_CHARS = 4096
"""Uncached text of at most this many characters is encoded on the event loop: a short stall, cheaper than a
thread-pool hop (queue put, waking a worker, two GIL hand-offs, ``call_soon_threadsafe`` back), which shows up in the
CPU of short requests. Longer uncached text goes to the pool so a cold document never blocks the loop for long
(``benchmarks/bench_tokenize.py`` reports the loop's longest stall; docs/benchmarks.md, "Tokenization")."""
INLINE_BODY_BYTES = 32768
"""A body larger than this is parsed, rendered and tokenized on a worker thread, whole. What a request costs the loop
grows with its body (validating its messages and parts, the chat template, cutting and looking up pieces: up to
~70 ns a byte here, the most for many small messages or tools), so above this it would hold the loop for
milliseconds, and 20,000 tools held it for a third of a second; the worker gives the loop the GIL back every few
milliseconds. Below it, the hop to a worker and back costs more CPU than the work."""

log = logging.getLogger("kvgate.prompts")


class PromptError(Exception):
    """A request body the engine would reject, or beyond ``limits``: the gateway answers 400 with this message,
    ``param`` and ``code``."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_prompt") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    token_ids: array[int]
    """Typecode ``"I"`` (uint32), the layout block hashing packs anyway: no per-token Python ints to build."""
    approximate: bool
    source: Source
    cpu_ms: float
    """CPU time kvgate spent on this prompt, on the event loop and on a worker thread (an engine's
    ``/tokenize`` time is not included)."""
    prompt_count: int = 1
    """Prompts in a batched completions request; ``token_ids`` are the first one's."""


@dataclass(frozen=True, slots=True)
class TokenizerStats:
    """A snapshot of the tokenizer's counters for the metrics exporter: every field a number or a {label: number}."""

    by_source: dict[str, int]
    """Prompts tokenized, by source (local, engine, approximate, ids)."""
    engine_errors: int
    """``/tokenize`` fallbacks that failed (transport error, timeout, bad answer); each fell back to approximate."""
    local_errors: int
    """Unexpected failures of the local tokenizer (never a client mistake); each fell back to engine/approximate."""
    cpu_seconds: float
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    cache_entries: int
    cache_bytes: int


@dataclass(frozen=True, slots=True)
class _CompletionPrompt:
    text: str | None
    ids: array[int] | None
    add_special_tokens: bool
    prompt_count: int


@dataclass(frozen=True, slots=True)
class _ChatPrompt:
    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None
    tools: list[Any] | None
    documents: list[Any] | None
    has_media: bool


@dataclass(slots=True)
class _Prepared:
    """What :meth:`PromptTokenizer._prepare` did: the parsed prompt, and its ids or text when it got that far."""

    prompt: _CompletionPrompt | _ChatPrompt
    cpu_s: float
    ids: array[int] | None = None
    source: Source = "local"
    text: str | None = None
    """The prompt text from the model's own template (or a completions prompt), for a small body's ids."""
    failed: Exception | None = None
    """The local tokenizer failed unexpectedly (never a client mistake): the request falls back."""


class PieceCache:
    """LRU of (scope, prompt piece) → token ids, bounded by an estimate of the memory it holds. The scope is the model
    and the request's namespace (:func:`cache_scope`): a piece another tenant sent is never a hit, so the time a
    request takes to tokenize says nothing about what other tenants sent.

    Ids are stored as ``array('I')`` (4 bytes per token instead of ~36 for a list of ints). Thread-safe: the worker
    threads look up and fill it under one lock, a few dictionary operations per piece.
    """

    ENTRY_OVERHEAD = 200
    """Bytes per entry beyond the key text and the ids: tuple, array header, OrderedDict node."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[tuple[str, str], array[int]] = OrderedDict()
        self._lock = Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_many(self, keys: Sequence[tuple[str, str]]) -> list[array[int] | None]:
        found: list[array[int] | None] = []
        with self._lock:
            for key in keys:
                ids = self._entries.get(key)
                if ids is not None:
                    self._entries.move_to_end(key)
                found.append(ids)
            hits = sum(ids is not None for ids in found)
            self.hits += hits
            self.misses += len(keys) - hits
        return found

    def put_many(self, items: Sequence[tuple[tuple[str, str], array[int]]]) -> None:
        with self._lock:
            for key, ids in items:
                size = self._size(key, ids)
                if size > self.max_bytes or key in self._entries:
                    continue
                self._entries[key] = ids
                self.bytes += size
            while self.bytes > self.max_bytes:
                old_key, old_ids = self._entries.popitem(last=False)
                self.bytes -= self._size(old_key, old_ids)
                self.evictions += 1

    def _size(self, key: tuple[str, str], ids: array[int]) -> int:
        return sys.getsizeof(key[1]) + ids.itemsize * len(ids) + self.ENTRY_OVERHEAD


@dataclass(frozen=True, slots=True)
class _LocalModel:
    name: str
    tokenizer: ModelTokenizer
    splitter: PromptSplitter


class PromptTokenizer:
    """Tokenizes request prompts for routing: exact and cached where a local tokenizer exists, else via the engine,
    else approximately. One per gateway process; :meth:`close` stops its worker threads."""

    def __init__(
        self,
        models: Sequence[ModelConfig],
        engine_tokenize: EngineTokenize | None = None,
        *,
        cache_bytes: int = 256 * 1024 * 1024,
        workers: int = 2,
        engine_timeout_s: float = 2.0,
        chunk_chars: int = 256,
        limits: LimitsConfig = LimitsConfig(),
    ) -> None:
        """Loads every configured model's tokenizer now, so a bad path fails at startup (``ConfigError``).

        ``chunk_chars`` is the piece size the end of long text is cut to (:class:`PromptSplitter`): a prompt that
        shares a document with earlier ones re-encodes only its last piece or two (encoding is the costly step),
        while a warm piece costs only a look-up. 256 keeps a 2k-character prompt's new tail short, and a warm
        100k-character prompt is ~50 look-ups (``benchmarks/bench_tokenize.py``; docs/benchmarks.md, "Tokenization")."""
        self._models: dict[str, _LocalModel] = {}
        for model in models:
            if model.tokenizer is None:
                continue
            try:
                tokenizer = ModelTokenizer.from_path(model.tokenizer)
            except Exception as err:  # tokenizers, json and jinja2 each raise their own types
                raise ConfigError(f"models.{model.name}.tokenizer: cannot load {model.tokenizer!r}: {err}") from err
            self._models[model.name] = _LocalModel(model.name, tokenizer, PromptSplitter(tokenizer.tokenizer, chunk_chars))
        self._engine_tokenize = engine_tokenize
        self._engine_timeout_s = engine_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvgate-tokenize")
        self.limits = limits
        """Replaced on reload; read per request."""
        self._request_templates = RequestTemplateRenderer(
            limits.request_template_timeout_s, limits.request_template_memory_mb
        )
        self.cache = PieceCache(cache_bytes)
        # Counters, updated on the event loop only (workers touch only the cache, which has its own lock).
        self._by_source: dict[str, int] = {"local": 0, "engine": 0, "approximate": 0, "ids": 0}
        self._engine_errors = 0
        self._local_errors = 0
        self._cpu_seconds = 0.0

    @property
    def stats(self) -> TokenizerStats:
        cache = self.cache
        return TokenizerStats(
            by_source=dict(self._by_source),
            engine_errors=self._engine_errors,
            local_errors=self._local_errors,
            cpu_seconds=self._cpu_seconds,
            cache_hits=cache.hits,
            cache_misses=cache.misses,
            cache_evictions=cache.evictions,
            cache_entries=len(cache),
            cache_bytes=cache.bytes,
        )

    def set_limits(self, limits: LimitsConfig) -> None:
        self.limits = limits
        self._request_templates.timeout_s = limits.request_template_timeout_s
        self._request_templates.memory_mb = limits.request_template_memory_mb

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._request_templates.close()

    async def tokenize(
        self, model: str, endpoint: Endpoint, body: dict[str, Any], *, namespace: str | None = None,
        body_bytes: int = 0, max_model_len: int | None = None,
    ) -> TokenizedPrompt:
        """The prompt's token ids as the engine serving ``model`` will compute them. Cached pieces and request
        templates are shared only between requests of the same ``namespace`` (the cache salt sent upstream, per
        tenant). A body of more than :data:`INLINE_BODY_BYTES` (``body_bytes``) is parsed, rendered and tokenized
        on a worker thread. A prompt whose characters alone prove it longer than ``max_model_len`` tokens is refused
        before it is tokenized. Raises :class:`PromptError`."""
        local = self._models.get(model)
        scope = cache_scope(model, namespace)
        whole = body_bytes > INLINE_BODY_BYTES
        prepare = functools.partial(self._prepare, local, endpoint, body, scope, max_model_len, whole)
        if whole:
            prepared = await asyncio.get_running_loop().run_in_executor(self._pool, prepare)
        else:
            prepared = prepare()
        prompt, cpu = prepared.prompt, prepared.cpu_s
        count = prompt.prompt_count if isinstance(prompt, _CompletionPrompt) else 1
        if prepared.ids is not None:
            return self._done(prepared.ids, prepared.source, cpu, count)
        if local is not None and prepared.failed is None and self._renders_locally(local, prompt):
            try:
                if isinstance(prompt, _ChatPrompt) and prompt.chat_template is not None:
                    text = await self._render_request_template(local, prompt, scope)
                else:
                    assert prepared.text is not None
                    text = prepared.text
                ids, text_cpu = await self._text_ids(local, prompt, text, scope)
                return self._done(ids, "local", cpu + text_cpu, count)
            except PromptError:
                raise
            except Exception as err:  # a bug or a tokenizer failure must not fail the request: route on a fallback
                prepared.failed = err
        if prepared.failed is not None:
            log.error("local tokenization failed for model %s", model, exc_info=prepared.failed)
            self._local_errors += 1
        if self._engine_tokenize is not None:
            engine_ids = await self._ask_engine(model, prompt)
            if engine_ids is not None:
                return self._done(engine_ids, "engine", cpu, count)
        if _text_chars(prompt) <= INLINE_PROMPT_CHARS:
            ids, approximate_cpu = _approximate(prompt)
        else:
            ids, approximate_cpu = await asyncio.get_running_loop().run_in_executor(self._pool, _approximate, prompt)
        return self._done(ids, "approximate", cpu + approximate_cpu, count)

    def _prepare(
        self, local: _LocalModel | None, endpoint: Endpoint, body: dict[str, Any], scope: str,
        max_model_len: int | None, whole: bool,
    ) -> _Prepared:
        """What runs before any await (on the loop for a small body, else on a worker thread): the body parsed and
        checked against the limits and the model's length; a prompt of token ids as they are; and with the model's
        own template (or a completions prompt), the prompt text, and with ``whole`` its ids too. CPU time is this
        thread's."""
        started = time.thread_time()
        prompt = parse_completion(body) if endpoint == "completions" else parse_chat(body)
        check_limits(prompt, self.limits)
        if isinstance(prompt, _CompletionPrompt) and prompt.ids is not None:
            return _Prepared(prompt, time.thread_time() - started, ids=prompt.ids, source="ids")
        if local is None or not self._renders_locally(local, prompt):
            return _Prepared(prompt, time.thread_time() - started)
        _check_token_bound(local, prompt, max_model_len)
        if isinstance(prompt, _ChatPrompt) and prompt.chat_template is not None:
            return _Prepared(prompt, time.thread_time() - started)  # the sandboxed renderer is awaited
        try:
            text = prompt.text if isinstance(prompt, _CompletionPrompt) else self._render_model_template(local, prompt)
            assert text is not None
            if not whole:
                return _Prepared(prompt, time.thread_time() - started, text=text)
            pieces, found, missing = self._look_up(local, text, scope)
            ids = self._join(local, prompt, pieces, found, self._encode_pieces(local, missing))
        except PromptError:
            raise
        except Exception as err:  # counted and logged on the loop
            return _Prepared(prompt, time.thread_time() - started, failed=err)
        return _Prepared(prompt, time.thread_time() - started, ids=ids, source="local")

    def _done(self, ids: array[int], source: Source, cpu_s: float, count: int) -> TokenizedPrompt:
        self._by_source[source] += 1
        self._cpu_seconds += cpu_s
        return TokenizedPrompt(ids, source == "approximate", source, cpu_s * 1000.0, count)

    @staticmethod
    def _renders_locally(local: _LocalModel, prompt: _CompletionPrompt | _ChatPrompt) -> bool:
        if isinstance(prompt, _CompletionPrompt):
            return True
        has_template = prompt.chat_template is not None or local.tokenizer.chat_template is not None
        return has_template and not prompt.has_media

    def _look_up(
        self, local: _LocalModel, text: str, scope: str
    ) -> tuple[list[Piece], list[array[int] | None], list[tuple[str, str]]]:
        """The text cut into pieces, each piece's cached ids (None when not cached), and the keys of those missing."""
        pieces = local.splitter.pieces(text)
        keys = [(scope, piece) for piece in pieces if isinstance(piece, str)]
        found = self.cache.get_many(keys)
        return pieces, found, [key for key, ids in zip(keys, found) if ids is None]

    async def _text_ids(
        self, local: _LocalModel, prompt: _CompletionPrompt | _ChatPrompt, text: str, scope: str
    ) -> tuple[array[int], float]:
        """A small body's prompt text to ids: cut into pieces and cached pieces taken on the loop (a look-up each),
        then the pieces the cache lacks encoded on the loop when they are short, else on a worker thread
        (``INLINE_PROMPT_CHARS``). Encoding is the only costly step, so a warm prompt never pays the hop. Text
        rendered by a request's template can be long whatever the body: then all of it goes to the worker."""
        loop = asyncio.get_running_loop()
        if len(text) > INLINE_BODY_BYTES:
            return await loop.run_in_executor(self._pool, self._text_ids_timed, local, prompt, text, scope)
        started = time.thread_time()
        pieces, found, missing = self._look_up(local, text, scope)
        if sum(len(key[1]) for key in missing) <= INLINE_PROMPT_CHARS:
            # All on the loop, with no await: one CPU reading covers it (each costs a system call).
            encoded = self._encode_pieces(local, missing)
            return self._join(local, prompt, pieces, found, encoded), time.thread_time() - started
        loop_cpu = time.thread_time() - started
        encoded, encode_cpu = await loop.run_in_executor(self._pool, self._encode_pieces_timed, local, missing)
        started = time.thread_time()
        joined = self._join(local, prompt, pieces, found, encoded)
        return joined, loop_cpu + encode_cpu + time.thread_time() - started

    def _text_ids_timed(
        self, local: _LocalModel, prompt: _CompletionPrompt | _ChatPrompt, text: str, scope: str
    ) -> tuple[array[int], float]:
        """Pieces, look-ups, encoding and joining of ``text``, all on a worker thread, with the CPU it took there."""
        started = time.thread_time()
        pieces, found, missing = self._look_up(local, text, scope)
        ids = self._join(local, prompt, pieces, found, self._encode_pieces(local, missing))
        return ids, time.thread_time() - started

    @staticmethod
    def _join(
        local: _LocalModel,
        prompt: _CompletionPrompt | _ChatPrompt,
        pieces: list[Piece],
        found: list[array[int] | None],
        encoded: list[array[int]],
    ) -> array[int]:
        """The prompt's ids: cached and freshly encoded text pieces and added tokens in order, plus the tokenizer's
        own prefix and suffix when the request asks for special tokens."""
        fresh = iter(encoded)
        joined = array("I")
        text_ids = iter([ids if ids is not None else next(fresh) for ids in found])
        for piece in pieces:
            if isinstance(piece, int):
                joined.append(piece)
            else:
                joined.extend(next(text_ids))
        if prompt.add_special_tokens and (local.tokenizer.prefix_ids or local.tokenizer.suffix_ids):
            joined = array("I", local.tokenizer.prefix_ids) + joined + array("I", local.tokenizer.suffix_ids)
        return joined

    def _encode_pieces(self, local: _LocalModel, keys: list[tuple[str, str]]) -> list[array[int]]:
        """Encode pieces the cache lacks and cache them (on the loop or a worker thread); their ids."""
        encoded = [(key, array("I", local.tokenizer.encode(key[1], add_special_tokens=False))) for key in keys]
        if encoded:
            self.cache.put_many(encoded)
        return [ids for _, ids in encoded]

    def _encode_pieces_timed(
        self, local: _LocalModel, keys: list[tuple[str, str]]
    ) -> tuple[list[array[int]], float]:
        """:meth:`_encode_pieces` on a worker thread, with the CPU it took there."""
        started = time.thread_time()
        return self._encode_pieces(local, keys), time.thread_time() - started

    async def _render_request_template(self, local: _LocalModel, prompt: _ChatPrompt, scope: str) -> str:
        """The chat's prompt text from the request's own template, in the sandboxed renderer
        (:mod:`kvgate.router.prompts.request_templates`), within ``limits.max_prompt_chars``."""
        assert prompt.chat_template is not None
        job = TemplateJob(
            prompt.chat_template, local.tokenizer.special_tokens, prompt.messages, prompt.add_generation_prompt,
            prompt.continue_final_message, prompt.tools, prompt.documents, prompt.chat_template_kwargs,
            self.limits.max_prompt_chars, scope,
        )
        try:
            return await self._request_templates.render(job)
        except TemplateRejected as err:
            raise PromptError(err.message, err.param) from err

    def _render_model_template(self, local: _LocalModel, prompt: _ChatPrompt) -> str:
        """The chat's prompt text from the model's own template; longer than ``limits.max_prompt_chars`` is a
        :class:`PromptError`, and so is what the template itself rejects."""
        try:
            text = local.tokenizer.render_chat(
                prompt.messages,
                prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                tools=prompt.tools,
                documents=prompt.documents,
                chat_template_kwargs=prompt.chat_template_kwargs,
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, AttributeError) as err:
            # What the template itself rejects (roles must alternate, missing fields...): vLLM answers 400 too.
            raise PromptError(f"cannot render the chat template for these messages: {err}", "messages") from err
        max_chars = self.limits.max_prompt_chars
        if len(text) > max_chars:
            raise PromptError(
                f"the rendered prompt has {len(text)} characters; the limit is {max_chars}", "messages",
                "prompt_too_long",
            )
        return text

    async def _ask_engine(self, model: str, prompt: _CompletionPrompt | _ChatPrompt) -> array[int] | None:
        body = _engine_body(model, prompt)
        try:
            assert self._engine_tokenize is not None
            answer = await asyncio.wait_for(self._engine_tokenize(body), self._engine_timeout_s)
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(tokens, list) or not all(_is_token_id(t) for t in tokens):
                raise ValueError("/tokenize answer has no list of token ids")
            return array("I", tokens)
        except Exception:  # any failure of the injected transport or a bad answer: fall back to the approximation
            self._engine_errors += 1
            return None


def _check_token_bound(local: _LocalModel, prompt: _CompletionPrompt | _ChatPrompt, max_model_len: int | None) -> None:
    """A prompt whose characters alone prove it has more tokens than the model takes is refused before it is
    tokenized (a 3.5 MB prompt cost seconds of tokenizer CPU before the engine would refuse it): no token of this
    tokenizer covers more than :attr:`ModelTokenizer.max_chars_per_token` characters, so a prompt of ``c``
    characters has at least ``c / max_chars_per_token`` tokens (a chat's rendered text has its messages' and more)."""
    if max_model_len is None:
        return
    at_least = -(-_text_chars(prompt) // local.tokenizer.max_chars_per_token)
    if at_least > max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has at least "
            f"{at_least} input tokens. Please reduce the length of the input.",
            "prompt" if isinstance(prompt, _CompletionPrompt) else "messages", "context_length_exceeded",
        )


def cache_scope(model: str, namespace: str | None) -> str:
    """What the piece and template caches are keyed by: the model, and the namespace when there is one (a model name
    comes from the policy file, so a client cannot forge another scope with a NUL)."""
    return model if namespace is None else f"{model}\x00{namespace}"


def parse_completion(body: dict[str, Any]) -> _CompletionPrompt:
    """The prompt of a ``/v1/completions`` body: a string, token ids, or a batch of either (first one routed)."""
    if not isinstance(body, dict):
        raise PromptError("the request body must be a JSON object")
    add_special_tokens = _optional_bool(body, "add_special_tokens", True)
    prompt = body.get("prompt")
    if prompt is None:
        raise PromptError("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return _CompletionPrompt(prompt, None, add_special_tokens, 1)
    if not isinstance(prompt, list) or not prompt:
        raise PromptError("'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if all(_is_token_id(t) for t in prompt):
        return _CompletionPrompt(None, array("I", prompt), add_special_tokens, 1)
    if all(isinstance(p, str) for p in prompt):
        return _CompletionPrompt(prompt[0], None, add_special_tokens, len(prompt))
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return _CompletionPrompt(None, array("I", prompt[0]), add_special_tokens, len(prompt))
    raise PromptError(
        "'prompt' must be a string, a list of strings, a list of token ids (integers in [0, 2**32)), "
        "or a list of such lists",
        "prompt",
    )


def parse_chat(body: dict[str, Any]) -> _ChatPrompt:
    """The messages and template options of a ``/v1/chat/completions`` body, validated as vLLM validates them."""
    if not isinstance(body, dict):
        raise PromptError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list of messages", "messages")
    has_media = False
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string 'role'", f"messages.{i}")
        has_media |= _check_content(message.get("content"), f"messages.{i}.content")
    add_generation_prompt = _optional_bool(body, "add_generation_prompt", True)
    continue_final_message = _optional_bool(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise PromptError(
            "cannot set both 'continue_final_message' and 'add_generation_prompt' to true", "continue_final_message"
        )
    kwargs = _optional(body, "chat_template_kwargs", dict)
    chat_template = _optional(body, "chat_template", str)
    if chat_template is None and kwargs is not None and kwargs.get("chat_template") is not None:
        chat_template = kwargs["chat_template"]  # vLLM takes a template from either place
        if not isinstance(chat_template, str):
            raise PromptError("'chat_template_kwargs.chat_template' must be a string", "chat_template_kwargs")
    return _ChatPrompt(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        add_special_tokens=_optional_bool(body, "add_special_tokens", False),
        chat_template=chat_template,
        chat_template_kwargs=kwargs,
        tools=_engine_tools(_optional(body, "tools", list)),
        documents=_optional(body, "documents", list),
        has_media=has_media,
    )


def check_limits(prompt: _CompletionPrompt | _ChatPrompt, limits: LimitsConfig) -> None:
    """The request's shape against ``limits``: message count, prompt characters, and a request's own chat template
    only when the operator trusts them (vLLM's rule and message). Raises :class:`PromptError`."""
    if isinstance(prompt, _ChatPrompt):
        if len(prompt.messages) > limits.max_messages:
            raise PromptError(
                f"the request has {len(prompt.messages)} messages; the limit is {limits.max_messages}", "messages",
                "too_many_messages",
            )
        if prompt.chat_template is not None and not limits.trust_request_chat_template:
            raise PromptError(
                "Chat template is passed with request, but --trust-request-chat-template is not set "
                "(limits.trust_request_chat_template). Refused request with untrusted chat template.",
                "chat_template", "untrusted_chat_template",
            )
    chars = _text_chars(prompt)
    if chars > limits.max_prompt_chars:
        raise PromptError(
            f"the prompt has {chars} characters; the limit is {limits.max_prompt_chars}",
            "prompt" if isinstance(prompt, _CompletionPrompt) else "messages", "prompt_too_long",
        )


def _check_content(content: Any, param: str) -> bool:
    """Validates one message's content; True when it holds media parts."""
    if content is None or isinstance(content, str):
        return False
    if not isinstance(content, list):
        raise PromptError("content must be a string, null, or a list of content parts", param)
    has_media = False
    for j, part in enumerate(content):
        if isinstance(part, str):
            continue
        part_type = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part_type, str):
            raise PromptError("a content part must be a string or an object with a string 'type'", f"{param}.{j}")
        if part_type in MEDIA_PART_TYPES:
            has_media = True
        elif part_type in TEXT_PART_FIELDS:
            text = part.get(TEXT_PART_FIELDS[part_type])  # type: ignore[index]
            if text is not None and not isinstance(text, str):
                raise PromptError(f"'{TEXT_PART_FIELDS[part_type]}' must be a string", f"{param}.{j}")  # type: ignore[index]
        else:
            raise PromptError(f"unsupported content part type {part_type!r}", f"{param}.{j}.type")
    return has_media


def _optional_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PromptError(f"'{name}' must be a boolean", name)
    return value


def _optional(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise PromptError(f"'{name}' must be {'an object' if kind is dict else f'a {kind.__name__}'}", name)
    return value


def _engine_tools(tools: list[Any] | None) -> list[Any] | None:
    """The tools as vLLM hands them to the chat template, so ``tool | tojson`` renders the same text: each one
    validated into its request model and dumped back, so fields in the model's order, ``description`` and
    ``parameters`` always present (null when absent), ``strict`` and ``defer_loading`` only when set (a tool's
    ``defer_loading`` also becomes its function's), unknown fields dropped. A tool vLLM would refuse (the engine
    answers 400) is left as sent."""
    if tools is None:
        return None
    dumped: list[Any] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or tool.get("type", "function") != "function":
            return tools
        defer = tool.get("defer_loading")
        fields = {"name": function["name"], "description": function.get("description"),
                  "parameters": function.get("parameters")}
        if function.get("strict") is not None:
            fields["strict"] = function["strict"]
        function_defer = function.get("defer_loading")
        if function_defer is None:
            function_defer = defer
        if function_defer is not None:
            fields["defer_loading"] = function_defer
        entry: dict[str, Any] = {"type": "function", "function": fields}
        if defer is not None:
            entry["defer_loading"] = defer
        dumped.append(entry)
    return dumped


def _is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= 0xFFFFFFFF


def _engine_body(model: str, prompt: _CompletionPrompt | _ChatPrompt) -> dict[str, Any]:
    if isinstance(prompt, _CompletionPrompt):
        return {"model": model, "prompt": prompt.text, "add_special_tokens": prompt.add_special_tokens}
    body: dict[str, Any] = {
        "model": model,
        "messages": prompt.messages,
        "add_generation_prompt": prompt.add_generation_prompt,
        "continue_final_message": prompt.continue_final_message,
        "add_special_tokens": prompt.add_special_tokens,
    }
    optional = {
        "chat_template": prompt.chat_template,
        "chat_template_kwargs": prompt.chat_template_kwargs,
        "tools": prompt.tools,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def _approximate(prompt: _CompletionPrompt | _ChatPrompt) -> tuple[array[int], float]:
    """Pseudo token ids, one per 4 bytes of UTF-8 text (a CRC of those bytes): stable across processes and
    restarts, and prompts sharing a text prefix share an id prefix, so prefix affinity still works roughly."""
    started = time.thread_time()
    if isinstance(prompt, _ChatPrompt):
        text = "".join(f"<|{m['role']}|>\n{_plain_text(m.get('content'))}\n" for m in prompt.messages)
        if prompt.add_generation_prompt:
            text += "<|assistant|>\n"
    else:
        text = prompt.text or ""
    data = memoryview(text.encode("utf-8"))
    step = APPROXIMATE_BYTES_PER_TOKEN
    ids = array("I", [zlib.crc32(data[i : i + step]) & 0x7FFFFFFF for i in range(0, len(data), step)])
    return ids, time.thread_time() - started


def _text_chars(prompt: _CompletionPrompt | _ChatPrompt) -> int:
    """Characters of prompt text (message contents for a chat): what tokenizing costs in proportion to."""
    if isinstance(prompt, _CompletionPrompt):
        return len(prompt.text or "")
    total = 0
    for message in prompt.messages:
        content = message.get("content")
        total += len(content) if isinstance(content, str) else len(_plain_text(content))
    return total


def _plain_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and isinstance(text := part.get(TEXT_PART_FIELDS.get(str(part.get("type")), "")), str):
            texts.append(text)
    return "\n".join(texts)
