"""Each tenant's limits: concurrent requests, and requests and prompt tokens per second as token buckets. Over a
limit the request is refused with 429, ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers.

Several gateways in front of one fleet share a limit approximately: each enforces its even share of the rate
(``share``: one over the gateways whose work reports it receives, :mod:`kvgate.router.fleet.peer_work`), so
together they admit about the configured rate whatever gateway a client reaches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvgate.router.admission.config import TenantClass
from kvgate.router.core.errors import ApiError


@dataclass(slots=True)
class TokenBucket:
    """``rate`` per second, holding at most ``rate × burst_s``; starts full."""

    rate: float
    burst_s: float
    level: float = -1.0
    at: float = 0.0

    @property
    def capacity(self) -> float:
        return self.rate * self.burst_s

    def refill(self, now: float) -> None:
        if self.level < 0:
            self.level, self.at = self.capacity, now
            return
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` is in the bucket (0: now; inf: never, it holds less)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return (self.capacity - self.level) / self.rate


@dataclass(slots=True)
class TenantUsage:
    concurrent: int = 0
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    limits: tuple[float | None, float | None, float, float] = field(default=(None, None, 0.0, 0.0))
    """The (requests/s, tokens/s, burst_s, share) the buckets were made for: a reload or a new share remakes them."""


class TenantLimits:
    """Every tenant's usage against its class's limits (one per gateway; event loop only)."""

    def __init__(self) -> None:
        self._usage: dict[str | None, TenantUsage] = {}

    def usage(self, tenant: str | None) -> TenantUsage:
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = TenantUsage()
        return usage

    def take(self, tenant: str | None, klass: TenantClass, prompt_tokens: int, now: float, share: float) -> None:
        """Count one request of ``prompt_tokens`` against ``tenant``'s limits, or raise :class:`ApiError` 429 (the
        reason in its code) and count nothing."""
        usage = self.usage(tenant)
        self._fit(usage, klass, share)
        headers: dict[str, str] = {}
        requests, tokens = usage.requests, usage.tokens
        for bucket in (requests, tokens):
            if bucket is not None:
                bucket.refill(now)
        if klass.max_concurrent is not None and usage.concurrent >= klass.max_concurrent:
            raise _limited("concurrent requests", "rate_limit_concurrency", 1.0, headers)
        if requests is not None:
            headers.update(_headers("requests", requests, 1.0))
            if (wait := requests.wait_s(1.0)) > 0:
                raise _limited("requests per second", "rate_limit_requests", wait, headers)
        if tokens is not None:
            headers.update(_headers("tokens", tokens, prompt_tokens))
            if (wait := tokens.wait_s(prompt_tokens)) > 0:
                raise _limited("prompt tokens per second", "rate_limit_tokens", wait, headers)
        if requests is not None:
            requests.level -= 1.0
        if tokens is not None:
            tokens.level -= prompt_tokens
        usage.concurrent += 1

    def release(self, tenant: str | None) -> None:
        usage = self._usage.get(tenant)
        if usage is not None and usage.concurrent > 0:
            usage.concurrent -= 1

    @staticmethod
    def _fit(usage: TenantUsage, klass: TenantClass, share: float) -> None:
        wanted = (klass.requests_per_s, klass.prompt_tokens_per_s, klass.burst_s, share)
        if usage.limits == wanted:
            return
        usage.limits = wanted
        rps, tps, burst, _ = wanted
        usage.requests = TokenBucket(rps * share, burst) if rps is not None else None
        usage.tokens = TokenBucket(tps * share, burst) if tps is not None else None


def _headers(kind: str, bucket: TokenBucket, amount: float) -> dict[str, str]:
    """OpenAI's rate-limit headers for one bucket: the limit per minute, what remains, and when it is full again."""
    return {
        f"x-ratelimit-limit-{kind}": str(int(bucket.rate * 60)),
        f"x-ratelimit-remaining-{kind}": str(max(0, int(bucket.level - amount))),
        f"x-ratelimit-reset-{kind}": f"{max(0.0, bucket.reset_s()):.3f}s",
    }


def _limited(what: str, code: str, wait_s: float, headers: dict[str, str]) -> ApiError:
    never = math.isinf(wait_s)
    message = (f"this request alone exceeds the tenant's {what} limit" if never
               else f"rate limit reached: the tenant's {what}; retry after {wait_s:.2f}s")
    retry_after = str(max(1, math.ceil(wait_s if not never else 60)))
    return ApiError(429, message, code=code, headers={**headers, "retry-after": retry_after})
