"""A prompt's token ids, as the engine will compute them, without blocking the loop.

Three sources, tried in order:

1. ``local``: the model's tokenizer and chat template (:class:`kvgate.router.prompts.model_tokenizer.ModelTokenizer`),
   exact. Prompt text is cut into pieces that encode independently (:class:`kvgate.router.prompts.splitter.
   PromptSplitter`: at special tokens, so per chat message, and inside long documents) and each piece's ids are kept in
   a bounded LRU (:mod:`kvgate.router.prompts.piece_cache`), so a growing chat or a re-sent document costs a template
   render and a few dictionary look-ups instead of a full encode.
2. ``engine``: an engine's ``POST /tokenize`` through an injected async callable (the gateway picks a healthy replica;
   no HTTP here), for models without a local tokenizer or with content the local path cannot render (media parts).
3. ``approximate``: stable pseudo ids, one per 4 bytes of rendered text, flagged ``approximate=True`` so decisions
   and metrics say so. Repeated prompts give the same ids, and prompts sharing a text prefix share an id prefix.

Prompts given as token ids are used as is (``ids``). The request's body is turned into a prompt
(:mod:`kvgate.router.prompts.prompt`) by its API's parser, which this runs: on a worker thread for a large body,
with the rest of the work. For a small body, rendering, cutting and cache look-ups run on the event loop, and
encoding uncached text runs on a small thread pool when it is long (the tokenizers library releases the GIL while
encoding a batch), on the loop when it is short: for short text the hop to a worker and back costs more CPU than the
encode itself. Client mistakes raise :class:`~kvgate.router.prompts.prompt.PromptError`, which the gateway answers
with a 400 in its API's error shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import threading
import time
import zlib
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal, Sequence, TypeVar

import jinja2
import xxhash

from kvgate.cache_index.keys import common_prefix
from kvgate.router.core.config import LimitsConfig, ModelConfig
from kvgate.router.core.errors import ConfigError
from kvgate.router.prompts.chat_template import render_chat
from kvgate.router.prompts.model_templates import ChatRender, TemplateSettings
from kvgate.router.prompts.model_tokenizer import ModelTokenizer
from kvgate.router.prompts.piece_cache import PieceCache
from kvgate.router.prompts.prompt import (
    ChatPrompt, CompletionPrompt, Prompt, PromptError, check_limits, is_token_id, plain_text, text_chars,
)
from kvgate.router.prompts.request_templates import RequestTemplateRenderer, TemplateJob, TemplateRejected
from kvgate.router.prompts.splitter import Piece, PromptSplitter

Source = Literal["local", "engine", "approximate", "ids"]
T = TypeVar("T")
EngineTokenize = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""Sends a vLLM ``/tokenize`` body (``{"model", "prompt"}`` or ``{"model", "messages", ...}``) to a replica serving
the model and returns the decoded JSON response (``{"count", "tokens", ...}``); raises on any failure."""

APPROXIMATE_BYTES_PER_TOKEN = 4
INLINE_PROMPT_CHARS = 4096
"""Uncached text of at most this many characters is encoded on the event loop: a short stall, cheaper than a
thread-pool hop (queue put, waking a worker, two GIL hand-offs, ``call_soon_threadsafe`` back), which shows up in the
CPU of short requests. Longer uncached text goes to the pool so a cold document never blocks the loop for long
(``benchmarks/bench_tokenize.py`` reports the loop's longest stall; docs/benchmarks.md, "Tokenization")."""
INLINE_BODY_BYTES = 32768
"""A body larger than this is parsed, rendered and tokenized on a worker thread, whole (or up to its beginning, for a
prompt routed on it: :meth:`PromptTokenizer.tokenize`). What a request costs the loop grows with its body
(validating its messages and parts, the chat template, cutting and looking up pieces: up to ~70 ns a byte here, the
most for many small messages or tools), so above this it would hold the loop for milliseconds, and 20,000 tools held
it for a third of a second; the worker gives the loop the GIL back every few milliseconds. Below it, the hop to a
worker and back costs more CPU than the work."""

log = logging.getLogger(__name__)


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
    shared_tokens: int = 0
    """How many of ``token_ids`` are the prefix the client marked as one every session sends again
    (:attr:`~kvgate.router.prompts.prompt.ChatPrompt.shared_prefix_end`); 0 when it marked none."""
    rest: asyncio.Future[TokenizedPrompt] | None = None
    """None when ``token_ids`` are the whole prompt. Otherwise they are its exact beginning (``lead``,
    :meth:`PromptTokenizer.tokenize`), and this resolves to the whole prompt tokenized, encoded on a worker thread
    meanwhile (never an exception: a failure resolves to the beginning, flagged approximate)."""
    estimated_tokens: int = 0
    """While ``rest`` is pending: the whole prompt's tokens, its beginning's plus the rest's characters at the
    beginning's characters per token."""

    @property
    def token_count(self) -> int:
        """The prompt's tokens: exact, or estimated while the rest of it is being tokenized."""
        return len(self.token_ids) if self.rest is None else self.estimated_tokens


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


class _CpuTime:
    """The CPU time one prompt costs: this thread's from construction to :meth:`stop`, less what ran while the prompt
    awaited (other requests' work), plus what its worker-thread jobs took. The clock is read only at those points
    (each reading is a system call), so a prompt tokenized wholly on the loop costs two."""

    __slots__ = ("_spent", "_since")

    def __init__(self) -> None:
        self._spent = 0.0
        self._since = time.thread_time()

    def stop(self) -> float:
        """Seconds of CPU so far (call once, at the end)."""
        return self._spent + time.thread_time() - self._since

    async def awaiting(self, work: Awaitable[T]) -> T:
        """``work`` awaited off this prompt's clock: the loop runs other requests meanwhile."""
        self._spent += time.thread_time() - self._since
        try:
            return await work
        finally:
            self._since = time.thread_time()

    async def off_loop(self, pool: ThreadPoolExecutor, job: Callable[..., T], *args: Any) -> T:
        """``job(*args)`` on a worker thread of ``pool``, its CPU time there counted."""
        return await self.awaiting(asyncio.get_running_loop().run_in_executor(pool, self._timed, job, args))

    def _timed(self, job: Callable[..., T], args: tuple[Any, ...]) -> T:
        started = time.thread_time()
        try:
            return job(*args)
        finally:
            self._spent += time.thread_time() - started


@dataclass(frozen=True, slots=True)
class _Lead:
    """A prompt's pieces with the cached ids of its text pieces (None: not cached), the ids of the uncached ones
    encoded at once (the first ones), and the keys of the uncached ones left to a worker."""

    pieces: list[Piece]
    found: list[array[int] | None]
    encoded: list[array[int]]
    missing: list[tuple[str, str]]


@dataclass(slots=True)
class _Prepared:
    """What :meth:`PromptTokenizer._prepare` did: the parsed prompt, and its ids or text when it got that far."""

    prompt: CompletionPrompt | ChatPrompt
    ids: array[int] | None = None
    source: Source = "local"
    text: str | None = None
    """The prompt text from the model's own template (or a completions prompt), for a small body's ids or a large
    body's rest."""
    planned: ChatRender | None = None
    """A chat whose template is the request's own, for the sandboxed renderer."""
    lead: _Lead | None = None
    """A large body's beginning (with ``text``), its rest not encoded yet."""
    failed: Exception | None = None
    """The local tokenizer failed unexpectedly (never a client mistake): the request falls back."""
    shared_tokens: int = 0


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
        self._chunk_chars = chunk_chars
        self.model_configs = list(models)
        """The policy file's ``models`` these tokenizers were loaded from."""
        self._models = _load_models(models, chunk_chars)
        self._engine_tokenize = engine_tokenize
        self._engine_timeout_s = engine_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvgate-tokenize")
        self.limits = limits
        """Replaced on reload; read per request."""
        self._request_templates = RequestTemplateRenderer(
            limits.request_template_timeout_s, limits.request_template_memory_mb
        )
        self.cache = PieceCache(cache_bytes)
        self._shared = SharedPrefixLengths()
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

    def reconfigure(self, models: Sequence[ModelConfig], limits: LimitsConfig) -> None:
        """A reloaded policy file: its limits at once, and the models' tokenizers when ``models`` changed. New
        tokenizers take effect for new requests, with an empty piece cache (cached ids are the old tokenizers'); a
        path that does not load keeps the old ones."""
        self.limits = limits
        self._request_templates.timeout_s = limits.request_template_timeout_s
        self._request_templates.memory_mb = limits.request_template_memory_mb
        if list(models) == self.model_configs:
            return
        try:
            loaded = _load_models(models, self._chunk_chars)
        except ConfigError as e:
            log.error("reload: keeping the previous tokenizers: %s", e)
            return
        self._models, self.model_configs = loaded, list(models)
        self.cache = PieceCache(self.cache.max_bytes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._request_templates.close()

    async def tokenize(
        self, model: str, prompt_of: Callable[[], Prompt], *, namespace: str | None = None, body_bytes: int = 0,
        max_model_len: int | None = None, lead: bool = False,
    ) -> TokenizedPrompt:
        """The token ids of the prompt ``prompt_of()`` makes of a request's body (its API's parser, which raises
        :class:`PromptError` for a bad one), as the engine serving ``model`` will compute them. Cached pieces and
        request templates are shared only between requests of the same ``namespace`` (the cache salt sent upstream,
        per tenant). A body of more than :data:`INLINE_BODY_BYTES` (``body_bytes``) is parsed, rendered and
        tokenized on a worker thread. A prompt whose characters alone prove it longer than ``max_model_len`` tokens
        is refused before it is tokenized.

        With ``lead``, a single prompt whose uncached text is too long to encode on the loop comes back as soon as
        its beginning is known: the ids of its pieces up to the first one still uncached once
        :data:`INLINE_PROMPT_CHARS` of them were encoded (here, or on the worker thread that parsed a large body),
        with the rest encoded on a worker thread meanwhile (:attr:`TokenizedPrompt.rest`). A prompt whose cached
        prefix ends inside that beginning can be routed at once: the rest cannot change where any replica's match
        ends. Not a prompt that may be longer than ``max_model_len``: its exact count is known before it is routed,
        so it is refused as it would be without ``lead``."""
        local = self._models.get(model)
        scope = cache_scope(model, namespace)
        whole = body_bytes > INLINE_BODY_BYTES
        prepare = functools.partial(self._prepare, local, prompt_of, scope, max_model_len, whole, lead)
        cpu = _CpuTime()
        if whole:
            prepared = await cpu.off_loop(self._pool, prepare)
        else:
            prepared = prepare()
        prompt = prepared.prompt
        count = prompt.prompt_count if isinstance(prompt, CompletionPrompt) else 1
        if prepared.ids is not None:
            return self._done(prepared.ids, prepared.source, cpu, count, prepared.shared_tokens)
        if local is not None and prepared.failed is None and self._renders_locally(local, prompt):
            try:
                if prepared.lead is not None:
                    assert prepared.text is not None
                    return self._lead(local, prompt, prepared.text, scope, prepared.lead, cpu)
                if prepared.planned is not None:
                    text = await cpu.awaiting(self._render_request_template(local, prepared.planned, scope))
                else:
                    assert prepared.text is not None
                    text = prepared.text
                found = await self._text_ids(local, prompt, text, scope, cpu, lead=lead and count == 1)
                if isinstance(found, _Lead):
                    if max_model_len is None or _at_most(local, prompt, found) <= max_model_len:
                        return self._lead(local, prompt, text, scope, found, cpu)
                    # it may be too long: the exact count decides, before anything is routed
                    later = await cpu.off_loop(self._pool, self._encode_pieces, local, found.missing)
                    found = self._join(local, prompt, found.pieces, found.found, [*found.encoded, *later])
                shared = self._shared_tokens(local, prompt, text, found, scope)
                return self._done(found, "local", cpu, count, shared)
            except PromptError:
                raise
            except Exception as err:  # a bug or a tokenizer failure must not fail the request: route on a fallback
                prepared.failed = err
        if prepared.failed is not None:
            log.error("local tokenization failed for model %s", model, exc_info=prepared.failed)
            self._local_errors += 1
        if self._engine_tokenize is not None:
            engine_ids = await cpu.awaiting(self._ask_engine(model, prompt))
            if engine_ids is not None:
                return self._done(engine_ids, "engine", cpu, count)
        if text_chars(prompt) <= INLINE_PROMPT_CHARS:
            ids = _approximate(prompt)
        else:
            ids = await cpu.off_loop(self._pool, _approximate, prompt)
        return self._done(ids, "approximate", cpu, count)

    def _prepare(
        self, local: _LocalModel | None, prompt_of: Callable[[], Prompt], scope: str, max_model_len: int | None,
        whole: bool, lead: bool,
    ) -> _Prepared:
        """What runs before any await (on the loop for a small body, else on a worker thread): the body parsed and
        checked against the limits and the model's length; a prompt of token ids as they are; and with the model's
        own template (or a completions prompt), the prompt text, and with ``whole`` its ids too, or with ``lead``,
        when it has too much uncached text to encode at once and cannot be longer than ``max_model_len``, its
        beginning (:meth:`_beginning`)."""
        prompt = prompt_of()
        check_limits(prompt, self.limits)
        if isinstance(prompt, CompletionPrompt) and prompt.ids is not None:
            return _Prepared(prompt, ids=prompt.ids, source="ids")
        if local is None or not self._renders_locally(local, prompt):
            return _Prepared(prompt)
        _check_token_bound(local, prompt, max_model_len)
        try:
            if isinstance(prompt, CompletionPrompt):
                text = prompt.text
            else:
                planned = self._plan(local, prompt)
                if planned.template is None:  # the sandboxed renderer is awaited
                    return _Prepared(prompt, planned=planned)
                text = self._render_model_template(planned)
            assert text is not None
            if not whole:
                return _Prepared(prompt, text=text)
            pieces, found, missing = self._look_up(local, text, scope)
            single = not isinstance(prompt, CompletionPrompt) or prompt.prompt_count == 1
            if lead and single and sum(len(key[1]) for key in missing) > INLINE_PROMPT_CHARS:
                beginning = self._beginning(local, pieces, found, missing)
                if max_model_len is None or _at_most(local, prompt, beginning) <= max_model_len:
                    return _Prepared(prompt, text=text, lead=beginning)
                missing, encoded = beginning.missing, beginning.encoded
            else:
                encoded = []
            ids = self._join(local, prompt, pieces, found, [*encoded, *self._encode_pieces(local, missing)])
            shared = self._shared_tokens(local, prompt, text, ids, scope)
        except PromptError:
            raise
        except Exception as err:  # counted and logged on the loop
            return _Prepared(prompt, failed=err)
        return _Prepared(prompt, ids=ids, source="local", shared_tokens=shared)

    def _done(self, ids: array[int], source: Source, cpu: _CpuTime, count: int, shared: int = 0) -> TokenizedPrompt:
        cpu_s = cpu.stop()
        self._by_source[source] += 1
        self._cpu_seconds += cpu_s
        return TokenizedPrompt(ids, source == "approximate", source, cpu_s * 1000.0, count, shared)

    def _shared_tokens(
        self, local: _LocalModel, prompt: CompletionPrompt | ChatPrompt, text: str, ids: array[int], scope: str
    ) -> int:
        """Tokens of the prompt's marked shared prefix: the rendered text ahead of
        :attr:`~ChatPrompt.shared_prefix_end`, encoded on its own (its pieces are cached: the whole prompt was just
        encoded) and cut to what it has in common with the whole prompt's ids, since the tokens at a cut may merge
        differently. Remembered per scope and prefix text, which every session of one system prompt repeats."""
        end = prompt.shared_prefix_end if isinstance(prompt, ChatPrompt) else None
        at = text.find(end) if end else -1
        if at <= 0:
            return 0
        prefix = text[:at]
        key = (scope, at, xxhash.xxh3_64_intdigest(prefix.encode("utf-8", "surrogatepass")))
        known = self._shared.get(key)
        if known is not None:
            return min(known, len(ids))
        own = self._ids_of_text(local, prompt, prefix, scope)
        shared = common_prefix(own, ids)
        self._shared.put(key, shared)
        return shared

    @staticmethod
    def _renders_locally(local: _LocalModel, prompt: CompletionPrompt | ChatPrompt) -> bool:
        if isinstance(prompt, CompletionPrompt):
            return True
        has_template = prompt.chat_template is not None or local.tokenizer.templates.has_own
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
        self, local: _LocalModel, prompt: CompletionPrompt | ChatPrompt, text: str, scope: str, cpu: _CpuTime,
        lead: bool = False,
    ) -> array[int] | _Lead:
        """A small body's prompt text to ids: cut into pieces and cached pieces taken on the loop (a look-up each),
        then the pieces the cache lacks encoded on the loop when they are short, else on a worker thread
        (``INLINE_PROMPT_CHARS``), or with ``lead`` the first of them here and the others left to :meth:`_lead`.
        Encoding is the only costly step, so a warm prompt never pays the hop. Text rendered by a request's template
        can be long whatever the body: then all of it goes to the worker."""
        if len(text) > INLINE_BODY_BYTES:
            return await cpu.off_loop(self._pool, self._ids_of_text, local, prompt, text, scope)
        pieces, found, missing = self._look_up(local, text, scope)
        if sum(len(key[1]) for key in missing) <= INLINE_PROMPT_CHARS:
            encoded = self._encode_pieces(local, missing)
        elif lead:
            return self._beginning(local, pieces, found, missing)
        else:
            encoded = await cpu.off_loop(self._pool, self._encode_pieces, local, missing)
        return self._join(local, prompt, pieces, found, encoded)

    def _beginning(
        self, local: _LocalModel, pieces: list[Piece], found: list[array[int] | None], missing: list[tuple[str, str]],
    ) -> _Lead:
        """The uncached pieces of a prompt's beginning encoded, the others left to a worker: pieces in order until
        :data:`INLINE_PROMPT_CHARS` of them are, taking one more while the total stays within twice that. Pieces away
        from the end of long text are about that long, so the beginning reaches into the first of them even behind a
        few short uncached pieces (a new chat's system prompt and template text): a beginning needs full blocks past
        the cached prefix to settle where it ends."""
        spent, now = 0, 0
        while now < len(missing) and spent < INLINE_PROMPT_CHARS \
                and spent + len(missing[now][1]) <= 2 * INLINE_PROMPT_CHARS:
            spent += len(missing[now][1])
            now += 1
        return _Lead(pieces, found, self._encode_pieces(local, missing[:now]), missing[now:])

    def _lead(
        self, local: _LocalModel, prompt: CompletionPrompt | ChatPrompt, text: str, scope: str, lead: _Lead,
        cpu: _CpuTime,
    ) -> TokenizedPrompt:
        """The prompt's beginning (its pieces up to the first one not encoded yet), with the rest of it encoded on a
        worker thread (:attr:`TokenizedPrompt.rest`)."""
        prefix = local.tokenizer.prefix_ids if prompt.add_special_tokens else ()
        ids = array("I", prefix)
        fresh = iter(lead.encoded)
        texts = iter(lead.found)
        lead_chars = rest_chars = rest_tokens = 0
        cut = False
        for piece in lead.pieces:
            if isinstance(piece, int):
                if cut:
                    rest_tokens += 1
                else:
                    ids.append(piece)
                continue
            piece_ids = next(texts)
            if piece_ids is None and not cut:
                piece_ids = next(fresh, None)
                cut = piece_ids is None
            if cut:
                rest_chars += len(piece)
            else:
                assert piece_ids is not None
                ids.extend(piece_ids)
                lead_chars += len(piece)
        text_tokens = len(ids) - len(prefix)
        chars_per_token = lead_chars / text_tokens if text_tokens >= 32 else APPROXIMATE_BYTES_PER_TOKEN
        suffix = len(local.tokenizer.suffix_ids) if prompt.add_special_tokens else 0
        estimated = len(ids) + rest_tokens + math.ceil(rest_chars / chars_per_token) + suffix
        cpu_s = cpu.stop()
        self._by_source["local"] += 1
        self._cpu_seconds += cpu_s
        rest = asyncio.ensure_future(self._rest(local, prompt, text, scope, lead, ids, cpu_s))
        return TokenizedPrompt(ids, False, "local", cpu_s * 1000.0, rest=rest, estimated_tokens=estimated)

    async def _rest(
        self, local: _LocalModel, prompt: CompletionPrompt | ChatPrompt, text: str, scope: str, lead: _Lead,
        lead_ids: array[int], lead_cpu_s: float,
    ) -> TokenizedPrompt:
        """The whole prompt whose beginning :meth:`_lead` gave: the rest of its pieces encoded on a worker thread,
        then all of them joined. A failure (never a client's mistake: the prompt was checked already) is logged and
        resolves to the beginning, flagged approximate."""
        cpu = _CpuTime()
        try:
            later = await cpu.off_loop(self._pool, self._encode_pieces, local, lead.missing)
            ids = self._join(local, prompt, lead.pieces, lead.found, [*lead.encoded, *later])
            shared = self._shared_tokens(local, prompt, text, ids, scope)
            whole = TokenizedPrompt(ids, False, "local", 0.0, shared_tokens=shared)
        except Exception:  # noqa: BLE001 - a tokenizer failure must not fail the request, which may be on its way
            log.exception("local tokenization of a prompt's rest failed")
            self._local_errors += 1
            whole = TokenizedPrompt(lead_ids, True, "approximate", 0.0)
        cpu_s = cpu.stop()
        self._cpu_seconds += cpu_s
        return dataclasses.replace(whole, cpu_ms=(lead_cpu_s + cpu_s) * 1000.0)

    def _ids_of_text(
        self, local: _LocalModel, prompt: CompletionPrompt | ChatPrompt, text: str, scope: str
    ) -> array[int]:
        """Pieces, look-ups, encoding and joining of ``text`` in one go, with no hop (on a worker thread, or on the
        loop for text already mostly cached)."""
        pieces, found, missing = self._look_up(local, text, scope)
        return self._join(local, prompt, pieces, found, self._encode_pieces(local, missing))

    @staticmethod
    def _join(
        local: _LocalModel,
        prompt: CompletionPrompt | ChatPrompt,
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

    async def _render_request_template(self, local: _LocalModel, planned: ChatRender, scope: str) -> str:
        """The chat's prompt text from the request's own template, in the sandboxed renderer
        (:mod:`kvgate.router.prompts.request_templates`), within ``limits.max_prompt_chars``."""
        job = TemplateJob(
            planned.source, local.tokenizer.templates.special_tokens, planned.messages, planned.kwargs,
            planned.content_format, self.limits.max_prompt_chars, scope,
        )
        try:
            return await self._request_templates.render(job)
        except TemplateRejected as err:
            raise PromptError(err.message, err.param) from err

    @staticmethod
    def _plan(local: _LocalModel, prompt: ChatPrompt) -> ChatRender:
        """Which template, messages and kwargs the chat renders with; no template for it is a :class:`PromptError`,
        and so is a model template that does not parse."""
        try:
            return local.tokenizer.templates.plan(prompt)
        except (jinja2.TemplateError, ValueError) as err:
            raise PromptError(f"cannot render the chat template for these messages: {err}", "messages") from err

    def _render_model_template(self, planned: ChatRender) -> str:
        """The chat's prompt text from the model's own template; longer than ``limits.max_prompt_chars`` is a
        :class:`PromptError`, and so is what the template itself rejects."""
        assert planned.template is not None
        try:
            text = render_chat(planned.template, planned.messages, planned.kwargs, planned.content_format)
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

    async def _ask_engine(self, model: str, prompt: CompletionPrompt | ChatPrompt) -> array[int] | None:
        body = _engine_body(model, prompt)
        try:
            assert self._engine_tokenize is not None
            answer = await asyncio.wait_for(self._engine_tokenize(body), self._engine_timeout_s)
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(tokens, list) or not all(is_token_id(t) for t in tokens):
                raise ValueError("/tokenize answer has no list of token ids")
            return array("I", tokens)
        except Exception:  # any failure of the injected transport or a bad answer: fall back to the approximation
            self._engine_errors += 1
            return None


def _load_models(models: Sequence[ModelConfig], chunk_chars: int) -> dict[str, _LocalModel]:
    """Every model's local tokenizer (those with a ``tokenizer`` path), with its template settings; ``ConfigError``
    when one does not load."""
    loaded: dict[str, _LocalModel] = {}
    for model in models:
        if model.tokenizer is None:
            continue
        try:
            settings = TemplateSettings.of(model)
        except ValueError as err:
            raise ConfigError(f"models.{model.name}.{err}") from err
        try:
            tokenizer = ModelTokenizer.from_path(model.tokenizer, settings)
        except Exception as err:  # tokenizers, json and jinja2 each raise their own types
            raise ConfigError(f"models.{model.name}.tokenizer: cannot load {model.tokenizer!r}: {err}") from err
        loaded[model.name] = _LocalModel(model.name, tokenizer, PromptSplitter(tokenizer.tokenizer, chunk_chars))
    return loaded


def _at_most(local: _LocalModel, prompt: CompletionPrompt | ChatPrompt, lead: _Lead) -> int:
    """The most tokens the prompt of ``lead`` can have: its known ids, and for each piece not encoded yet one per
    UTF-8 byte (a token covers at least one; byte-level BPE's and byte fallback's cover exactly one) plus one (a
    tokenizer's prefix marker)."""
    special = len(local.tokenizer.prefix_ids) + len(local.tokenizer.suffix_ids) if prompt.add_special_tokens else 0
    known = sum(len(ids) for ids in lead.found if ids is not None) + sum(len(ids) for ids in lead.encoded)
    added = sum(1 for piece in lead.pieces if isinstance(piece, int))
    unknown = sum(len(key[1].encode("utf-8", "surrogatepass")) + 1 for key in lead.missing)
    return special + known + added + unknown


def _check_token_bound(local: _LocalModel, prompt: CompletionPrompt | ChatPrompt, max_model_len: int | None) -> None:
    """A prompt whose characters alone prove it has more tokens than the model takes is refused before it is
    tokenized (a 3.5 MB prompt cost seconds of tokenizer CPU before the engine would refuse it): no token of this
    tokenizer covers more than :attr:`ModelTokenizer.max_chars_per_token` characters, so a prompt of ``c``
    characters has at least ``c / max_chars_per_token`` tokens (a chat's rendered text has its messages' and more)."""
    if max_model_len is None:
        return
    at_least = -(-text_chars(prompt) // local.tokenizer.max_chars_per_token)
    if at_least > max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has at least "
            f"{at_least} input tokens. Please reduce the length of the input.",
            "prompt" if isinstance(prompt, CompletionPrompt) else "messages", "context_length_exceeded",
        )


class SharedPrefixLengths:
    """Token lengths of marked shared prefixes, by scope and text (a bounded map, oldest entry dropped first; the
    loop and the worker threads both use it)."""

    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._lengths: dict[tuple[str, int, int], int] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int, int]) -> int | None:
        return self._lengths.get(key)

    def put(self, key: tuple[str, int, int], tokens: int) -> None:
        with self._lock:
            if len(self._lengths) >= self.MAX_ENTRIES:
                self._lengths.pop(next(iter(self._lengths)))
            self._lengths[key] = tokens


def cache_scope(model: str, namespace: str | None) -> str:
    """What the piece and template caches are keyed by: the model, and the namespace when there is one (a model name
    comes from the policy file, so a client cannot forge another scope with a NUL)."""
    return model if namespace is None else f"{model}\x00{namespace}"


def _engine_body(model: str, prompt: CompletionPrompt | ChatPrompt) -> dict[str, Any]:
    if isinstance(prompt, CompletionPrompt):
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


def _approximate(prompt: CompletionPrompt | ChatPrompt) -> array[int]:
    """Pseudo token ids, one per 4 bytes of UTF-8 text (a CRC of those bytes): stable across processes and
    restarts, and prompts sharing a text prefix share an id prefix, so prefix affinity still works roughly."""
    if isinstance(prompt, ChatPrompt):
        text = "".join(f"<|{m['role']}|>\n{plain_text(m.get('content'))}\n" for m in prompt.messages)
        if prompt.add_generation_prompt:
            text += "<|assistant|>\n"
    else:
        text = prompt.text or ""
    data = memoryview(text.encode("utf-8"))
    step = APPROXIMATE_BYTES_PER_TOKEN
    return array("I", [zlib.crc32(data[i : i + step]) & 0x7FFFFFFF for i in range(0, len(data), step)])


