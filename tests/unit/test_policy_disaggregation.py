"""The ``cost`` policy's prefill/decode decision on constructed fleets: when splitting pays, which prefill replica
(cache-aware) and which decode replica (load, KV room), the static modes, and explain's alternatives."""

from __future__ import annotations

import random

from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import ReplicaView, RouteRequest
from kvgate.policies.config import CostPolicyConfig, DisaggregationConfig, PrefillCost, TransferConfig
from kvgate.policies.cost import CostPolicy
from kvgate.policies.cost_model import CostModel

EXACT = CostPolicyConfig(tie_margin=0, tie_margin_ms=0, session_bonus_ms=0)


def policy(mode: str = "cost", threshold_tokens: int = 256, **cost: float) -> CostPolicy:
    model = CostModel(PrefillCost(), {"cpu": 0.015, "storage": 0.03}, TransferConfig(), 320 * 1024)
    return CostPolicy(
        EXACT.model_copy(update=cost), model, random.Random(0),
        DisaggregationConfig(mode=mode, threshold_tokens=threshold_tokens),  # type: ignore[arg-type]
    )


def request(tokens: int) -> RouteRequest:
    return RouteRequest(request_id="r", model="m", prompt_tokens=tokens, block_size=16)


def decode(name: str, decoding: int = 0, gpu: int = 0, role: str = "decode", **kw: object) -> ReplicaView:
    """A replica taking requests, with ``decoding`` sequences past their first token."""
    return ReplicaView(
        name=name, healthy=True, can_source=True, match=PrefixMatch(gpu=gpu), in_flight=decoding, role=role,  # type: ignore[arg-type]
        **kw,
    )


def prefill(name: str, gpu: int = 0, healthy: bool = True, **kw: object) -> ReplicaView:
    return ReplicaView(
        name=name, healthy=healthy, can_source=healthy, match=PrefixMatch(gpu=gpu), role="prefill", **kw  # type: ignore[arg-type]
    )


def test_a_long_prompt_on_busy_decoders_is_split_onto_the_prefill_replica_holding_its_prefix() -> None:
    fleet = [prefill("p0"), prefill("p1", gpu=6000), decode("d0", decoding=8), decode("d1", decoding=9)]
    decision = policy().decide(request(8000), fleet)
    assert (decision.action, decision.reason, decision.source, decision.replica) == (
        "disaggregate", "disaggregated", "p1", "d0",
    )
    assert decision.ranked[0] == "d0" and "p0" not in decision.ranked and "p1" not in decision.ranked


def test_short_prompts_stay_local() -> None:
    fleet = [prefill("p0"), decode("d0", decoding=8), decode("d1", decoding=8)]
    decision = policy().decide(request(100), fleet)
    assert (decision.action, decision.reason, decision.source) == ("route", "local", None)


def test_a_prompt_cached_on_a_decode_replica_stays_there() -> None:
    fleet = [prefill("p0"), decode("d0", decoding=8, gpu=7900), decode("d1", decoding=2)]
    decision = policy().decide(request(8000), fleet)
    assert (decision.action, decision.replica, decision.reason) == ("route", "d0", "local")


def test_an_idle_decode_replica_prefills_itself() -> None:
    # nothing decodes there, so a local prefill stalls nobody and skips the handoff
    fleet = [prefill("p0"), decode("d0"), decode("d1", decoding=8)]
    decision = policy().decide(request(8000), fleet)
    assert (decision.action, decision.replica) == ("route", "d0")


def test_the_decode_replica_is_chosen_by_load_then_kv_room_not_by_prefix() -> None:
    fleet = [
        prefill("p0", gpu=7000),
        decode("d0", decoding=8, gpu=3000),  # holds part of the prompt, but busier
        decode("d1", decoding=6, kv_usage=0.9),
        decode("d2", decoding=6, kv_usage=0.2),
    ]
    decision = policy("always").decide(request(8000), fleet)
    assert (decision.action, decision.source, decision.replica) == ("disaggregate", "p0", "d2")
    # a failed decode leg is retried on the others, as local prefills
    assert decision.ranked[0] == "d2" and set(decision.ranked) == {"d0", "d1", "d2"}


def test_always_splits_even_short_prompts_and_picks_the_prefill_replica_by_its_cache() -> None:
    fleet = [prefill("p0", in_flight=1, in_flight_prefilling=1, in_flight_prefill_tokens=4000),
             prefill("p1", gpu=96), prefill("p2"), decode("d0")]
    decision = policy("always").decide(request(100), fleet)
    assert (decision.action, decision.source, decision.replica) == ("disaggregate", "p1", "d0")


def test_threshold_splits_at_its_uncached_tokens() -> None:
    p = policy("threshold", threshold_tokens=256)
    cold = [prefill("p0"), decode("d0"), decode("d1")]
    assert p.decide(request(255), cold).action == "route"
    assert p.decide(request(256), cold).action == "disaggregate"
    # uncached on the best local replica: d1 holds 1,000 of 1,200 tokens
    fleet = [prefill("p0"), decode("d0"), decode("d1", gpu=1000)]
    assert p.decide(request(1200), fleet).action == "route"
    assert p.decide(request(1300), fleet).action == "disaggregate"


def test_no_routable_prefill_replica_or_another_engine_kind_means_local() -> None:
    down = [prefill("p0", gpu=8000, healthy=False), decode("d0", decoding=8)]
    assert policy("always").decide(request(8000), down).action == "route"
    sglang = [prefill("p0", engine="sglang"), decode("d0", decoding=8)]
    assert policy("always").decide(request(8000), sglang).action == "route"


def test_a_fleet_without_prefill_replicas_pays_nothing_for_disaggregation() -> None:
    fleet = [decode("a", decoding=8, role="both"), decode("b", decoding=0, role="both")]
    decision = policy().decide(request(8000), fleet, explain=True)
    assert decision.reason == "cold" and "disaggregation" not in decision.details
    # the decode stall is only priced where a split can avoid it
    busy_warm = [decode("a", decoding=40, gpu=7000, role="both"), decode("b", role="both")]
    assert policy().decide(request(8000), busy_warm).replica == "a"


def test_explain_lists_every_alternative_with_its_numbers() -> None:
    fleet = [prefill("p0"), prefill("p1", gpu=6000), decode("d0", decoding=8), decode("d1", decoding=9)]
    details = policy().decide(request(8000), fleet, explain=True).details
    split = details["disaggregation"]
    assert split["mode"] == "cost" and split["decode_replica"] == "d0"
    assert set(split["prefill_replicas"]) == {"p0", "p1"}
    kinds = [(a["kind"], a["replica"], a.get("prefill_replica")) for a in split["alternatives"]]
    assert kinds == [("local", "d0", None), ("local", "d1", None),
                     ("disaggregated", "d0", "p0"), ("disaggregated", "d0", "p1")]
    local_d0, _, cold, warm = split["alternatives"]
    assert local_d0["decode_stall_ms"] == 8 * (20 + 0.035 * 8000) and local_d0["decoding"] == 8
    assert warm["handoff"]["source_prefill_ms"] < cold["handoff"]["source_prefill_ms"]
    assert warm["score_ms"] < local_d0["score_ms"]
    assert details["transfer"]["source"] == "p1"


def test_decode_stall_counts_sequences_past_their_first_token() -> None:
    assert CostModel.decoding(decode("a", decoding=5)) == 5
    scraped = ReplicaView(name="a", healthy=True, match=PrefixMatch(), in_flight=3, in_flight_prefilling=2,
                          scraped_running=7)
    assert CostModel.decoding(scraped) == 5 and CostModel.decode_stall_ms(scraped, 10.0) == 50.0
