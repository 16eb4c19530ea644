"""Request checks vLLM applies the same way on every generation endpoint: the model, the cache salt, and the prompt
and output budget against ``max_model_len`` (``TokenizeParams``, ``get_max_tokens``)."""

from __future__ import annotations

from typing import Any

from .errors import EngineError

CACHE_SALT_MAX_LEN = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
DEFAULT_MAX_TOKENS = 16
"""What a request that names no output budget generates: vLLM's completions default. vLLM lets a chat or a response
run to the end of the context instead; the sim, which has no end of sequence, stops them here too."""


def check_cache_salt(salt: Any) -> str | None:
    """vLLM's ``validate_cache_salt``: None, or a non-empty string of at most 128 characters without ``@ / \\`` or
    NUL. The messages carry ``(parameter=cache_salt)`` as ``str(VLLMValidationError)`` does."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise EngineError("Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)",
                          "cache_salt")
    if len(salt) > CACHE_SALT_MAX_LEN or any(c in CACHE_SALT_FORBIDDEN for c in salt):
        raise EngineError(
            f"Parameter 'cache_salt' must be at most {CACHE_SALT_MAX_LEN} characters and must not contain '@', '/', "
            "'\\\\', or NUL. (parameter=cache_salt)", "cache_salt")
    return salt


def check_output_request(requested: int | None, max_model_len: int, param: str) -> None:
    """``TokenizeParams``: a request for more output tokens than the whole context is refused."""
    if requested is not None and requested > max_model_len:
        raise EngineError(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. Please request fewer output "
            f"tokens. (parameter={param}, value={requested})", param)


def check_prompt_len(prompt_len: int, max_model_len: int) -> None:
    """``TokenizeParams._token_len_check``: a prompt longer than the context is refused. vLLM tokenizes with
    ``max_length = max_model_len + 1``, so a longer prompt is reported as "at least" that many tokens."""
    if prompt_len <= max_model_len:
        return
    counted = min(prompt_len, max_model_len + 1)
    qualifier = "at least " if counted == max_model_len + 1 else ""
    raise EngineError(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains {qualifier}"
        f"{counted} input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
        f"of the input prompt. (parameter=input_tokens, value={counted})", "input_tokens")


def output_budget(prompt_len: int, requested: int | None, max_model_len: int) -> int:
    """The tokens a request generates, as vLLM 0.32's Messages and Responses endpoints decide it once the checks
    above passed: the request clamped to what the context leaves (``get_max_tokens``), at least one
    (``SamplingParams``); :data:`DEFAULT_MAX_TOKENS` when the request names none."""
    budget = min(DEFAULT_MAX_TOKENS if requested is None else requested, max_model_len - prompt_len)
    if budget < 1:
        raise EngineError(f"max_tokens must be at least 1, got {budget}. (parameter=max_tokens, value={budget})",
                          "max_tokens")
    return budget


def check_model(body: dict[str, Any], served: str, required: bool = True) -> None:
    """``_check_model``: a request naming another model than the served one is a 404 (one naming none is served,
    where the request model lets it name none)."""
    model = body.get("model")
    if model is None:
        if required:
            raise EngineError("model is required", "model")
        return
    if not isinstance(model, str):
        raise EngineError("model must be a string", "model")
    if model and model != served:
        raise EngineError(f"The model `{model}` does not exist. Valid aliases: {served}.", "model", 404,
                          "NotFoundError")
