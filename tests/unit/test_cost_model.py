"""The cost model's arithmetic: prefill, queue delay, per-tier credit, transfer estimates (the simulated fleet's constants in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import ReplicaView, RouteRequest
from kvgate.policies.config import PrefillCost, TransferConfig
from kvgate.policies.cost_model import GIB, CostModel
from kvgate.router.core.config import ModelConfig
from kvgate.router.settings.schema import KvgateConfig, parse_config

DEFAULT = PrefillCost()  # 20 ms + 0.035 ms/token
NIXL = TransferConfig(connector="nixl")  # 12 ms setup, 22 GiB/s, min 1024 tokens
KV_BYTES = 320 * 1024


def model(prefill: PrefillCost = DEFAULT, transfer: TransferConfig = NIXL) -> CostModel:
    return CostModel(prefill, {"cpu": 0.015, "storage": 0.03}, transfer, KV_BYTES)


def request(tokens: int) -> RouteRequest:
    return RouteRequest(request_id="r", model="m", prompt_tokens=tokens, block_size=16)


def view(name: str = "a", *, healthy: bool = True, **kw: object) -> ReplicaView:
    match = PrefixMatch(**{t: kw.pop(t) for t in ("gpu", "cpu", "storage", "predicted") if t in kw})
    return ReplicaView(name=name, healthy=healthy, can_source=healthy, match=match, **kw)


def test_prefill_formula() -> None:
    m = model(PrefillCost(fixed_ms=20, per_token_ms=0.035, quadratic_ms=2.0))
    assert m.prefill_ms(0) == 20
    assert m.prefill_ms(1000) == pytest.approx(20 + 35 + 2.0 * 1000**2 / 1e6)
    # Suffix after a cached context pays attention over the whole context.
    assert m.prefill_ms(1000, context=3000) == pytest.approx(20 + 35 + 2.0 * (4000**2 - 3000**2) / 1e6)


def priced(model: ModelConfig) -> tuple[PrefillCost, int]:
    """A model entry's cost constants, as ``CostModel.from_config`` takes them."""
    return model.prefill, model.kv_bytes_per_token


def test_from_config_takes_the_models_entry() -> None:
    config = parse_config(
        "models: [{name: a}, {name: b, prefill: {fixed_ms: 5, per_token_ms: 0.1}, kv_bytes_per_token: 1000}]\n"
        "transfer: {connector: nixl}\n"
    )
    b = CostModel.from_config(*priced(config.model_or_first("b")), config.policy, config.transfer)
    assert (b.prefill.fixed_ms, b.kv_bytes_per_token, b.transfer_enabled) == (5, 1000, True)
    assert CostModel.from_config(*priced(config.model_or_first("unknown")), config.policy, config.transfer).prefill == PrefillCost()
    empty = KvgateConfig()
    assert CostModel.from_config(*priced(empty.model_or_first(None)), empty.policy, empty.transfer).transfer_enabled is False


def test_queue_delay_counts_own_prefills_foreign_waiting_and_decodes() -> None:
    m = model(PrefillCost(fixed_ms=20, per_token_ms=0.035, decode_ms_per_token=0.5))
    assert m.queue_delay_ms(view()) == 0
    # Three own requests with 6000 uncached tokens: 3 x 20 + 0.035 x 6000.
    own = view(in_flight=3, in_flight_prefilling=3, in_flight_prefill_tokens=6000)
    assert m.queue_delay_ms(own) == pytest.approx(60 + 210)
    # The engine reports 5 waiting: 2 more than the router's own, costed at the router's mean (2000 tokens).
    more = view(in_flight=3, in_flight_prefilling=3, in_flight_prefill_tokens=6000, scraped_waiting=5, scraped_running=4)
    assert m.queue_delay_ms(more) == pytest.approx(270 + 2 * (20 + 70) + 4 * 0.5)
    # Waiting requests the router knows nothing about are costed at default_prompt_tokens (1024).
    foreign = view(scraped_waiting=2, scraped_running=0)
    assert m.queue_delay_ms(foreign) == pytest.approx(2 * (20 + 0.035 * 1024))
    # Without scraped numbers, the router's decoding requests (in flight, past first token) are the running set.
    decoding = view(in_flight=10)
    assert m.queue_delay_ms(decoding) == pytest.approx(10 * 0.5)


def test_the_queue_delay_is_the_work_ahead_times_the_queue_scale() -> None:
    own = view(in_flight=3, in_flight_prefilling=3, in_flight_prefill_tokens=6000)
    scaled = model(PrefillCost(fixed_ms=20, per_token_ms=0.035, queue_scale=0.25))
    assert scaled.work_ahead_ms(own) == pytest.approx(270)
    assert scaled.queue_delay_ms(own) == pytest.approx(0.25 * 270)
    assert scaled.estimate(request(1000), own).ttft_ms == pytest.approx(0.25 * 270 + 20 + 35)


def test_estimate_credits_tiers_at_their_load_cost() -> None:
    m = model()
    r = request(10_000)
    gpu = m.estimate(r, view(gpu=8000))
    cpu = m.estimate(r, view(cpu=8000))
    cold = m.estimate(r, view())
    assert gpu.ttft_ms == pytest.approx(20 + 0.035 * 2000)
    assert cpu.ttft_ms == pytest.approx(20 + 0.035 * 2000 + 0.015 * 8000)
    assert cold.ttft_ms == pytest.approx(20 + 0.035 * 10_000)
    assert gpu.ttft_ms < cpu.ttft_ms < cold.ttft_ms
    assert cpu.cached_tokens_by_tier == {"gpu": 0, "cpu": 8000, "storage": 0}
    # Predicted tokens count like GPU ones; a whole-prompt hit still computes the last token.
    full = m.estimate(r, view(gpu=6000, predicted=4000))
    assert full.cached_tokens == 9999 and full.prefill_ms == pytest.approx(20 + 0.035)


def test_approximate_matches_are_discounted() -> None:
    m = model()
    est = m.estimate(request(10_000), view(gpu=8000), match_weight=0.5)
    assert est.cached_tokens == 4000


def test_long_prefix_transfer_beats_recompute_about_4x() -> None:
    # whole-GPU recompute 0.06 ms/token, 320 KiB/token, 22 GiB/s + 12 ms setup.
    m = model(PrefillCost(fixed_ms=20, per_token_ms=0.06))
    r = request(40_016)
    source, dest = view("warm", gpu=40_000), view("idle")
    transfer = m.transfer_estimate(r, source, dest)
    assert transfer is not None
    assert transfer.bytes == 40_016 * KV_BYTES
    assert transfer.wire_ms == pytest.approx(12 + 40_016 * KV_BYTES / (22 * GIB) * 1000)
    assert transfer.wire_ms == pytest.approx(568, abs=2)  # "moving 12.2 GiB takes ~565 ms"
    recompute = m.estimate(r, dest).ttft_ms
    assert 3.5 < recompute / transfer.ms < 4.5


def test_short_prefix_transfer_loses_to_recompute() -> None:
    m = model(transfer=TransferConfig(connector="nixl", min_tokens=0))
    r = request(516)
    transfer = m.transfer_estimate(r, view("warm", gpu=500), view("idle"))
    assert transfer is not None
    assert transfer.wire_ms == pytest.approx(19, abs=0.5)  # "156 MiB spends 12 of its 19 ms on setup"
    assert transfer.ms > m.estimate(r, view("idle")).ttft_ms


def test_transfer_estimate_pays_the_source_queue_and_dest_queue() -> None:
    m = model()
    r = request(40_016)
    idle = m.transfer_estimate(r, view("warm", gpu=40_000), view("idle"))
    busy_source = view("warm", gpu=40_000, in_flight_prefilling=2, in_flight_prefill_tokens=2000)
    busy_dest = view("idle", in_flight_prefilling=1, in_flight_prefill_tokens=1000)
    slower = m.transfer_estimate(r, busy_source, busy_dest)
    assert idle is not None and slower is not None
    assert slower.ms - idle.ms == pytest.approx((40 + 70) + (20 + 35))


def test_transfer_only_when_configured_healthy_and_long_enough() -> None:
    r = request(40_016)
    warm, idle = view("warm", gpu=40_000), view("idle")
    assert model(transfer=TransferConfig()).transfer_estimate(r, warm, idle) is None
    assert model().transfer_estimate(r, view("warm", healthy=False, gpu=40_000), idle) is None
    assert model().transfer_estimate(r, warm, warm) is None
    assert model().transfer_estimate(request(1000), view("warm", gpu=900), idle) is None  # < min_tokens 1024
    # Only what the destination lacks crosses the link.
    partial = model().transfer_estimate(r, warm, view("idle", gpu=30_000))
    assert partial is not None and partial.tokens == 10_016 and partial.saved_tokens == 10_000


def test_a_request_that_fits_the_free_kv_does_not_wait_for_it() -> None:
    full = view(kv_usage=0.5, kv_capacity_tokens=24_000, scraped_running=4, scraped_waiting=0, arrival_rate_per_s=2.0)
    assert model().kv_wait_ms(full, 10_000) == 0.0
    unknown = view(kv_usage=None, kv_capacity_tokens=24_000, scraped_running=4, arrival_rate_per_s=2.0)
    assert model().kv_wait_ms(unknown, 100_000) == 0.0  # nothing to go on


def test_a_request_bigger_than_the_free_kv_waits_for_running_sequences_to_finish() -> None:
    """Four sequences hold 20,000 of 24,000 tokens (5,000 each) and finish 2 a second (2 s each on average): 6,000
    tokens need one of them to finish (0.5 s: the first of four), 16,000 three (0.5 + 0.67 + 1 s), and anything
    beyond what they hold, all four."""
    cost = model()
    full = view(kv_usage=20_000 / 24_000, kv_capacity_tokens=24_000, scraped_running=4, scraped_waiting=0,
                arrival_rate_per_s=2.0)
    assert cost.kv_wait_ms(full, 6_000) == pytest.approx(500.0)
    assert cost.kv_wait_ms(full, 16_000) == pytest.approx(2000.0 * (1 / 4 + 1 / 3 + 1 / 2))
    assert cost.kv_wait_ms(full, 60_000) == pytest.approx(2000.0 * (1 / 4 + 1 / 3 + 1 / 2 + 1))
    queued = view(kv_usage=20_000 / 24_000, kv_capacity_tokens=24_000, scraped_running=4, scraped_waiting=1,
                  arrival_rate_per_s=2.0, in_flight_prefilling=1, in_flight_prefill_tokens=6_000)
    assert cost.kv_wait_ms(queued, 10_000) == pytest.approx(cost.kv_wait_ms(full, 16_000))  # the waiting one first


def test_the_estimate_prices_the_wait_for_kv_in_its_queue_delay() -> None:
    cost = model()
    full = view(kv_usage=20_000 / 24_000, kv_capacity_tokens=24_000, scraped_running=4, scraped_waiting=0,
                arrival_rate_per_s=2.0)
    roomy = view("b", kv_usage=0.1, kv_capacity_tokens=24_000, scraped_running=4, scraped_waiting=0,
                 arrival_rate_per_s=2.0)
    big = RouteRequest("r", "m", 8_000, 16, max_tokens=200)
    assert cost.estimate(big, full).queue_delay_ms == pytest.approx(
        cost.queue_delay_ms(full) + cost.kv_wait_ms(full, 8_200))
    assert cost.estimate(big, full).ttft_ms > cost.estimate(big, roomy).ttft_ms + 400.0
    assert cost.estimate(request(1_000), full).queue_delay_ms == cost.queue_delay_ms(full)  # it fits


def test_harmonic_numbers() -> None:
    from kvgate.policies.cost_model import harmonic
    exact = 0.0
    for n in range(1, 400):
        exact += 1.0 / n
        assert harmonic(n) == pytest.approx(exact, abs=1e-7)
    assert harmonic(0) == 0.0


@pytest.mark.parametrize("queue_scale", [1.0, 0.4, 0.0])
def test_interference_is_a_queue_delay_scaled_as_the_queue_term_is(queue_scale: float) -> None:
    """The delay a prefill imposes on a replica's next arrivals is theirs to wait in its queue: where calibration
    found that requests wait only a share of the work ahead (an engine batching its prefills), they wait only that
    share of this one too, and where the queue predicts nothing, neither does the interference."""
    m = model(PrefillCost(fixed_ms=20, per_token_ms=0.035, queue_scale=queue_scale))
    busy = view(in_flight_prefilling=1, in_flight_prefill_tokens=4000)
    assert m.queue_delay_ms(busy) == pytest.approx(queue_scale * m.work_ahead_ms(busy))
    assert m.interference_ms(2.5, 160.0) == pytest.approx(queue_scale * 2.5 * 160.0**2 / 2000)


def test_a_sessions_later_turns_cost_the_marginal_wait_of_an_mg1_queue() -> None:
    """Each later turn is priced at d(λ·W)/dλ = W·(2 − ρ)/(1 − ρ): the wait it finds plus the wait it adds. Nothing on
    an idle replica, or when no turn is ahead; finite however busy the replica (ρ is capped)."""
    m = model()
    rate, turn = 3.0, 90.0
    rho = rate * turn / 1000
    wait = rate * turn**2 / 2000 / (1 - rho)
    assert m.session_load_ms(rate, turn, 4) == pytest.approx(4 * wait * (2 - rho) / (1 - rho))
    assert m.session_load_ms(0.0, turn, 4) == 0.0
    assert m.session_load_ms(rate, turn, 0) == 0.0
    loads = [m.session_load_ms(r, turn, 4) for r in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert loads == sorted(loads) and len(set(loads)) == len(loads)
    assert m.session_load_ms(1000.0, turn, 4) < float("inf")
    batched = model(PrefillCost(queue_scale=0.5))
    assert batched.session_load_ms(rate, turn, 4) == pytest.approx(0.5 * m.session_load_ms(rate, turn, 4))
