"""Admission's pure logic: the fair queue's order (band, tokens per weight, arrival), the tenants' limits and their
headers, and the gate's waiting (fast path, release order, deadlines, a client that leaves, bounds, reload, a
flooding tenant that cannot starve another), against a saturation signal the test controls."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from kvgate.router.admission.config import AdmissionConfig, TenantClass
from kvgate.router.admission.fair_queue import FairQueue, Waiter
from kvgate.router.admission.gate import AdmissionGate
from kvgate.router.admission.limits import TenantLimits, TokenBucket
from kvgate.router.admission.saturation import Capacity
from kvgate.router.core.errors import ApiError
from kvgate.router.core.metrics import GatewayMetrics


def waiter(tenant: str, tokens: int, band: int = 0, size: int = 100, deadline: float = math.inf) -> Waiter[str]:
    return Waiter(f"{tenant}:{tokens}", tenant, band, tokens, size, deadline, 0.0)


def drain(queue: FairQueue[str]) -> list[str]:
    order = []
    while (head := queue.peek()) is not None:
        queue.pop(head)
        order.append(head.item)
    return order


def test_lower_bands_go_first_then_arrival_within_a_tenant() -> None:
    q: FairQueue[str] = FairQueue()
    for w in (waiter("a", 10, band=5), waiter("a", 11, band=0), waiter("a", 12, band=5), waiter("a", 13, band=-1)):
        q.push(w, 1.0)
    assert drain(q) == ["a:13", "a:11", "a:10", "a:12"]
    assert len(q) == 0 and q.waiting_bytes == 0


def test_a_flood_of_long_prompts_does_not_hold_back_a_short_one_that_comes_later() -> None:
    q: FairQueue[str] = FairQueue()
    for _ in range(50):
        q.push(waiter("flood", 6000), 1.0)
    q.pop(q.peek())  # type: ignore[arg-type]
    q.push(waiter("chat", 200), 1.0)
    assert q.peek().item == "chat:200"  # type: ignore[union-attr]


def test_backlogged_tenants_share_tokens_by_weight() -> None:
    q: FairQueue[str] = FairQueue()
    for _ in range(300):
        q.push(waiter("heavy", 100), 2.0)
        q.push(waiter("light", 100), 1.0)
    released = drain(q)[:150]
    assert abs(released.count("heavy:100") / released.count("light:100") - 2.0) < 0.1


def test_removed_and_expired_waiters_leave_the_counts() -> None:
    q: FairQueue[str] = FairQueue()
    old, new = waiter("a", 10, deadline=5.0), waiter("b", 10, deadline=50.0)
    q.push(old, 1.0)
    q.push(new, 1.0)
    assert q.expired(10.0) == [old]
    q.remove(old)
    q.remove(old)  # twice is once
    assert len(q) == 1 and q.waiting_bytes == 100 and q.depth() == {(0, "b"): 1}
    assert drain(q) == ["b:10"]


def test_waiters_expire_at_their_own_deadlines_whatever_left_before() -> None:
    q: FairQueue[str] = FairQueue()
    first, late = waiter("a", 10, deadline=20.0), waiter("c", 10, deadline=40.0)
    urgent = waiter("b", 10, band=-1, deadline=8.0)
    for w in (first, urgent, late):
        q.push(w, 1.0)
    assert q.expired(7.9) == []
    assert q.expired(8.0) == [urgent]
    q.remove(urgent)
    assert q.expired(19.0) == []
    q.pop(first)  # released before its deadline: nothing expires at it
    assert q.expired(25.0) == []
    q.push(again := waiter("d", 10, deadline=30.0), 1.0)
    assert q.expired(30.0) == [again]
    q.remove(again)
    assert q.expired(39.0) == [] and q.expired(40.0) == [late]


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    bucket = TokenBucket(rate=10.0, burst_s=2.0)
    bucket.refill(100.0)
    assert bucket.level == 20.0 and bucket.wait_s(5) == 0.0
    bucket.level = 0.0
    bucket.refill(100.5)
    assert bucket.level == pytest.approx(5.0) and bucket.wait_s(7) == pytest.approx(0.2)
    assert bucket.wait_s(21) == math.inf


def test_limits_refuse_with_429_retry_after_and_openai_headers() -> None:
    limits = TenantLimits()
    klass = TenantClass(requests_per_s=2.0, prompt_tokens_per_s=1000.0, max_concurrent=3)
    limits.take("t", klass, 400, 0.0, 1.0)
    limits.take("t", klass, 400, 0.0, 1.0)
    with pytest.raises(ApiError) as over:
        limits.take("t", klass, 10, 0.0, 1.0)
    assert over.value.status == 429 and over.value.code == "rate_limit_requests"
    headers = over.value.headers or {}
    assert headers["retry-after"] == "1" and headers["x-ratelimit-limit-requests"] == "120"
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-reset-requests"].endswith("s")
    with pytest.raises(ApiError) as tokens:
        limits.take("t", klass, 800, 0.5, 1.0)  # a request is back, but only 200 + 500 tokens
    assert tokens.value.code == "rate_limit_tokens" and (tokens.value.headers or {})["retry-after"] == "1"
    assert (tokens.value.headers or {})["x-ratelimit-remaining-tokens"] == "0"
    limits.take("t", klass, 700, 0.5, 1.0)  # what was refused counted nothing
    with pytest.raises(ApiError) as alone:
        TenantLimits().take("u", TenantClass(prompt_tokens_per_s=100.0), 500, 0.0, 1.0)
    assert alone.value.code == "rate_limit_tokens" and "alone" in alone.value.message


def test_concurrency_is_given_back_and_a_shared_limit_is_split_between_gateways() -> None:
    limits = TenantLimits()
    klass = TenantClass(max_concurrent=1)
    limits.take("t", klass, 1, 0.0, 1.0)
    with pytest.raises(ApiError) as busy:
        limits.take("t", klass, 1, 0.0, 1.0)
    assert busy.value.code == "rate_limit_concurrency"
    limits.release("t")
    limits.take("t", klass, 1, 0.0, 1.0)
    halves = TenantLimits()
    rate = TenantClass(requests_per_s=10.0)
    for _ in range(5):
        halves.take("t", rate, 1, 0.0, 0.5)  # two gateways: 5 a second each
    with pytest.raises(ApiError):
        halves.take("t", rate, 1, 0.0, 0.5)


class Switch:
    """A saturation signal the test sets: how many of the four replicas could start a request now."""

    def __init__(self) -> None:
        self.free = 0

    def can_start(self, candidates: list[str], routing: Any, config: AdmissionConfig, need: int = 1) -> bool:
        return self.free >= need

    def capacity(self, candidates: list[str], routing: Any, config: AdmissionConfig) -> Capacity:
        return Capacity(0.0 if self.free else math.inf, "r0" if self.free else None)

    def startable(self, candidates: list[str], routing: Any, config: AdmissionConfig) -> list[str]:
        return candidates[: self.free]


REPLICAS = ["r0", "r1", "r2", "r3"]


def gate(switch: Switch, **config: Any) -> AdmissionGate:
    return AdmissionGate(AdmissionConfig(**config), switch, GatewayMetrics())  # type: ignore[arg-type]


async def admit(g: AdmissionGate, tenant: str, tokens: int = 100, band: int | None = None, size: int = 10) -> Any:
    return await g.admit("m", REPLICAS, None, tenant, band, tokens, size)  # type: ignore[arg-type]


async def until(condition: Any, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def test_with_room_a_request_goes_on_at_once_and_its_ticket_frees_its_slot() -> None:
    switch = Switch()
    switch.free = 4
    g = gate(switch, default_class=TenantClass(max_concurrent=1))
    ticket = await admit(g, "t")
    assert g.waiting == 0
    with pytest.raises(ApiError):
        await admit(g, "t")
    ticket.release()
    ticket.release()
    (await admit(g, "t")).release()


async def test_saturated_requests_wait_and_go_by_band_then_fair_share() -> None:
    switch = Switch()
    g = gate(switch)
    order: list[str] = []

    async def one(name: str, tenant: str, tokens: int, band: int) -> None:
        ticket = await admit(g, tenant, tokens, band)
        order.append(name)
        ticket.release()

    tasks = [asyncio.create_task(one(f"flood{i}", "flood", 6000, 0)) for i in range(5)]
    await until(lambda: g.waiting == 5)
    tasks.append(asyncio.create_task(one("batch", "batch", 10, 9)))
    tasks.append(asyncio.create_task(one("chat", "chat", 100, 0)))
    await until(lambda: g.waiting == 7)
    assert g.depth_by_model() == {"m": 7}  # what /admin/state counts
    assert dict(g.depth()) == {(0, "flood"): 5, (9, "batch"): 1, (0, "chat"): 1}
    switch.free = 4
    await asyncio.wait_for(asyncio.gather(*tasks), 2.0)
    assert order[0] in ("flood0", "chat") and order.index("chat") <= 1 and order[-1] == "batch"
    assert g.depth_by_model() == {}
    g.close()


async def test_a_request_past_its_deadline_gets_503_with_retry_after() -> None:
    g = gate(Switch(), deadline_s=0.05, band_deadlines_s={7: 0.2})
    with pytest.raises(ApiError) as late:
        await asyncio.wait_for(admit(g, "t"), 2.0)
    assert late.value.status == 503 and (late.value.headers or {})["retry-after"] == "1"
    assert g.waiting == 0
    g.close()


async def test_a_client_that_leaves_is_taken_out_at_once() -> None:
    g = gate(Switch(), default_class=TenantClass(max_concurrent=1))
    task = asyncio.create_task(admit(g, "t"))
    await until(lambda: g.waiting == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert g.waiting == 0
    assert g.limits.usage("t").concurrent == 0  # its slot is back
    g.close()


async def test_the_queue_is_bounded_in_requests_and_bytes() -> None:
    g = gate(Switch(), max_waiting=2, max_waiting_bytes=1000)
    waiting = [asyncio.create_task(admit(g, "t", size=400)) for _ in range(2)]
    await until(lambda: g.waiting == 2)
    with pytest.raises(ApiError) as full:
        await admit(g, "t", size=10)
    assert full.value.status == 503 and full.value.code == "queue_full" and "retry-after" in (full.value.headers or {})
    g.reconfigure(AdmissionConfig(max_waiting=10, max_waiting_bytes=1000))
    with pytest.raises(ApiError):
        await admit(g, "t", size=300)  # 800 + 300 bytes
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    g.close()


async def test_a_reload_keeps_every_waiter_and_applies_its_knobs() -> None:
    switch = Switch()
    g = gate(switch)
    tasks = [asyncio.create_task(admit(g, "t")) for _ in range(3)]
    await until(lambda: g.waiting == 3)
    g.reconfigure(AdmissionConfig(max_start_delay_ms=10.0))
    assert g.waiting == 3
    switch.free = 4
    for ticket in await asyncio.wait_for(asyncio.gather(*tasks), 2.0):
        ticket.release()
    g.reconfigure(AdmissionConfig(enabled=False))
    switch.free = 0
    (await admit(g, "t")).release()  # off: nothing waits
    g.close()


async def test_a_hostile_tenant_cannot_starve_another_by_flooding_or_by_asking_for_priority() -> None:
    switch = Switch()
    g = gate(switch, tenants={"hostile": TenantClass(priority=5)})
    released: list[str] = []

    async def one(tenant: str, tokens: int, band: int | None) -> None:
        ticket = await admit(g, tenant, tokens, band)
        released.append(tenant)
        ticket.release()

    floods = [asyncio.create_task(one("hostile", 8000, 5)) for _ in range(40)]
    await until(lambda: g.waiting == 40)
    victim = asyncio.create_task(one("victim", 200, None))
    await until(lambda: g.waiting == 41)
    switch.free = 4
    await asyncio.wait_for(asyncio.gather(victim, *floods), 2.0)
    assert released[0] == "victim"  # band 0 beats the hostile tenant's class band 5
    g.close()


async def test_a_tenant_holding_its_share_leaves_the_headroom_to_the_others() -> None:
    """Four replicas, headroom 0.25: one is kept for other active tenants once a tenant holds its share."""
    switch = Switch()
    switch.free = 4
    g = gate(switch, headroom=0.25)
    chat = await admit(g, "chat", 100)  # seen: chat is active
    chat.release()
    floods = [await admit(g, "flood", 5000) for _ in range(3)]
    switch.free = 1  # three replicas busy with the flood, one left
    blocked = asyncio.create_task(admit(g, "flood", 5000))
    await until(lambda: g.waiting == 1)  # the flood may not take the last replica
    served = await asyncio.wait_for(admit(g, "chat", 100), 2.0)  # queued behind it, but chat may use it
    assert g.waiting == 1 and not blocked.done()
    assert served.avoid == frozenset()
    served.release()
    switch.free = 2
    let_through = await asyncio.wait_for(blocked, 2.0)  # two free: one for the flood, the soonest free one kept
    assert let_through.avoid == frozenset({"r0"})
    let_through.release()
    for ticket in floods:
        ticket.release()
    alone = gate(Switch(), headroom=0.25)
    assert alone._need("flood", 4, 0.0) == 1  # no other tenant active: nothing kept
    g.close()


class CountingSwitch(Switch):
    """A :class:`Switch` that notes when each saturation check ran."""

    def __init__(self) -> None:
        super().__init__()
        self.checked_at: list[float] = []

    def can_start(self, candidates: list[str], routing: Any, config: AdmissionConfig, need: int = 1) -> bool:
        self.checked_at.append(asyncio.get_running_loop().time())
        return super().can_start(candidates, routing, config, need)

    def startable(self, candidates: list[str], routing: Any, config: AdmissionConfig) -> list[str]:
        self.checked_at.append(asyncio.get_running_loop().time())
        return super().startable(candidates, routing, config)


@pytest.mark.parametrize("owes_headroom", [False, True])
async def test_while_saturated_each_poll_checks_the_queue_head_once(owes_headroom: bool) -> None:
    """The release loop polls while requests wait; each poll computes the head's candidates' start delays once
    (a view and a queue delay per candidate), not once to place it and again to look for headroom another tenant
    may use; also when the head's tenant holds its share and owes the others headroom."""
    switch = CountingSwitch()
    switch.free = 4
    g = gate(switch, headroom=0.5)
    held = await admit(g, "t") if owes_headroom else None  # all that is in flight is t's
    (await admit(g, "u")).release()  # a second active tenant
    switch.free = 0
    waiting = asyncio.create_task(admit(g, "t"))
    await until(lambda: g.waiting == 1)
    entered = len(switch.checked_at)
    await until(lambda: len(switch.checked_at) >= entered + 10)
    polls = switch.checked_at[entered:]
    gaps = [later - earlier for earlier, later in zip(polls, polls[1:])]
    assert min(gaps) > 0.001, gaps  # polls are POLL_S apart; two checks in one poll are microseconds apart
    switch.free = 4
    g.reconfigure(g.config)  # wakes the loop now
    (await asyncio.wait_for(waiting, 2.0)).release()
    if held is not None:
        held.release()
