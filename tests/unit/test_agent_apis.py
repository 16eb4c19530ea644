"""The pure parts of the Messages and Responses front doors: their streams' first output, end and usage, response
ids and what is remembered of stored responses, multipart model fields, and the headers agentic clients send."""

from __future__ import annotations

import json

import pytest

from kvgate.router.apis import anthropic, responses
from kvgate.router.apis.responses import History
from kvgate.router.core.errors import ApiError
from kvgate.router.pipeline.admit import ClientHeaders
from kvgate.router.pipeline.bodies import form_field
from kvgate.router.routing.config import ResponsesConfig
from kvgate.router.routing.stored_responses import ResponseIds, StoredResponses


def sse(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


MESSAGE_START = sse("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 90}}})
TEXT_START = sse("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})


def test_a_messages_stream_holds_its_first_output_after_message_start() -> None:
    assert not anthropic.holds_output(MESSAGE_START)
    assert not anthropic.holds_output(MESSAGE_START + sse("ping", {"type": "ping"}))
    assert not anthropic.holds_output(MESSAGE_START + TEXT_START[:20])  # cut off: not yet complete
    assert anthropic.holds_output(MESSAGE_START + TEXT_START)
    assert anthropic.holds_output(b"x" * 70_000)  # an odd stream is never held


def test_messages_usage_counts_the_whole_prompt() -> None:
    delta = sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {
        "input_tokens": 4, "output_tokens": 7, "cache_read_input_tokens": 64, "cache_creation_input_tokens": 32}})
    tail = b'partial": 1}\n\n' + delta + sse("message_stop", {"type": "message_stop"})
    usage = anthropic.usage_of_stream_tail(tail)
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (100, 7, 64)
    assert anthropic.stream_complete(tail) and not anthropic.stream_complete(delta)
    body = json.dumps({"type": "message", "usage": {"input_tokens": 9, "output_tokens": 2}}).encode()
    plain = anthropic.usage_of_body(body)
    assert plain is not None and (plain.prompt_tokens, plain.cached_tokens) == (9, None)  # no prompt-token details
    assert anthropic.count_of_body(b'{"input_tokens": 42, "context_management": {"original_input_tokens": 42}}') \
        == anthropic.Usage(42, 0, None)


def test_a_responses_stream_holds_its_first_output_after_creation() -> None:
    created = sse("response.created", {"type": "response.created", "sequence_number": 0})
    progress = sse("response.in_progress", {"type": "response.in_progress", "sequence_number": 1})
    added = sse("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 2})
    assert not responses.holds_output(created + progress)
    assert responses.holds_output(created + progress + added)


def test_responses_usage_is_read_even_from_a_completed_event_longer_than_the_tail() -> None:
    usage = {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 96, "input_tokens_per_turn": [120]},
             "output_tokens": 5, "total_tokens": 125}
    # vLLM dumps the event's fields in the openai model's order: response, sequence_number, type.
    completed = sse("response.completed", {"response": {"output": [{"text": "x" * 40_000}], "usage": usage},
                                           "sequence_number": 9, "type": "response.completed"})
    whole = responses.usage_of_stream_tail(completed)
    assert whole is not None and (whole.prompt_tokens, whole.cached_tokens, whole.completion_tokens) == (120, 96, 5)
    cut = completed[-16_384:]
    assert responses.usage_of_stream_tail(cut) == whole
    assert responses.stream_complete(cut)


def test_response_ids_are_the_tenants_own() -> None:
    ids = ResponseIds(b"s" * 32)
    minted = ids.mint("alice")
    assert minted.startswith("resp_") and ids.valid(minted, "alice")
    assert not ids.valid(minted, "bob") and not ids.valid(minted, None)
    assert not ids.valid("resp_" + "0" * 56, "alice") and not ids.valid("resp_made_up", "alice")
    assert not ResponseIds(b"t" * 32).valid(minted, "alice")  # another fleet's secret
    assert ResponseIds(None).valid(ResponseIds(None).mint(None), None) is False  # each process its own key


def test_stored_responses_forget_the_least_recently_used_and_keep_history_within_budget() -> None:
    stored = StoredResponses(ResponsesConfig(max_stored=2, max_history_chars=10))
    stored.record("a", "r0")
    stored.record("b", "r1")
    stored.keep_history("a", History([{"role": "user", "content": "12345"}], ["678"]))
    assert stored.history_of("a") is not None
    stored.keep_history("b", History([{"role": "user", "content": "12345"}], []))  # 16 chars > 10: "a" goes first
    assert stored.history_of("a") is None and stored.history_of("b") is not None
    assert stored.replica_of("a") == "r0"  # its replica is still known
    stored.record("c", "r2")  # over max_stored: the least recently used ("b"; "a" was just looked up) is forgotten
    assert stored.replica_of("b") is None and stored.replica_of("a") == "r0" and len(stored) == 2


UPLOAD = (b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'
          b"RIFF\x00{[,\xff" * 100 + b'\r\n--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n--B--\r\n')


def test_a_multipart_uploads_model_field_is_read() -> None:
    assert form_field(UPLOAD, "multipart/form-data; boundary=B", "model") == "whisper-1"
    assert form_field(UPLOAD, "multipart/form-data; boundary=B", "language") is None
    with pytest.raises(ApiError):
        form_field(b"not a form", "multipart/form-data; boundary=B", "model")
    with pytest.raises(ApiError):
        form_field(UPLOAD, "multipart/form-data", "model")  # no boundary


def headers_of(*headers: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return list(headers)


def test_agentic_clients_session_headers_and_anthropic_keys_are_understood() -> None:
    claude = ClientHeaders.of(headers_of((b"x-claude-code-session-id", b"cc-1"), (b"x-api-key", b"sk-ant")))
    assert (claude.session_id, claude.session_header, claude.authorization) == (
        "cc-1", "x-claude-code-session-id", "Bearer sk-ant")
    both = ClientHeaders.of(headers_of((b"session_id", b"codex-1"), (b"x-session-id", b"mine"),
                                  (b"authorization", b"Bearer k"), (b"x-api-key", b"other")))
    assert (both.session_id, both.authorization) == ("mine", "Bearer k")  # X-Session-ID first; Authorization wins
    assert responses.RESPONSES.session_of({"prompt_cache_key": "conv-9"}) == "conv-9"
    assert anthropic.MESSAGES.session_of({"metadata": {"user_id": "u"}}) is None
