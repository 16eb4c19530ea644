"""The ``cost`` policy on constructed fleet states: warm-but-busy vs idle, tiers, health, ties, sessions, explain."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from kvgate.cache_index.match import PrefixMatch
from kvgate.policies.base import ReplicaView, RouteRequest
from kvgate.policies.config import CostPolicyConfig, PrefillCost, TransferConfig
from kvgate.policies.cost import CostPolicy
from kvgate.policies.cost_model import CostModel
from kvgate.policies.explain import explain_replicas

EXACT = CostPolicyConfig(tie_margin=0, tie_margin_ms=0, session_bonus_ms=0)


def model(transfer: TransferConfig = TransferConfig(), prefill: PrefillCost = PrefillCost()) -> CostModel:
    return CostModel(prefill, {"cpu": 0.015, "storage": 0.03}, transfer, 320 * 1024)


def policy(config: CostPolicyConfig = CostPolicyConfig(), cost_model: CostModel | None = None, seed: int = 0) -> CostPolicy:
    return CostPolicy(config, cost_model or model(), random.Random(seed))


def request(tokens: int, **kw: object) -> RouteRequest:
    return RouteRequest(request_id="r", model="m", prompt_tokens=tokens, block_size=16, **kw)


def view(name: str, *, healthy: bool = True, queued: int = 0, queued_tokens: int = 0, **kw: object) -> ReplicaView:
    """A replica with ``queued`` of the router's requests still prefilling ``queued_tokens`` uncached tokens."""
    match = PrefixMatch(**{t: kw.pop(t) for t in ("gpu", "cpu", "storage", "predicted") if t in kw})
    return ReplicaView(
        name=name,
        healthy=healthy,
        can_source=healthy,
        match=match,
        in_flight=queued,
        in_flight_prefilling=queued,
        in_flight_prefill_tokens=queued_tokens,
        **kw,
    )


def test_warm_wins_until_its_queue_eats_the_saving() -> None:
    # 31,000-token prompt, 30,000 held by "warm". Each queued request there is a warm hit with 1,000 new tokens.
    prompt, held, per_queued = 31_000, 30_000, 1_000
    cost = PrefillCost()
    idle_ttft = cost.fixed_ms + cost.per_token_ms * prompt
    warm_prefill = cost.fixed_ms + cost.per_token_ms * (prompt - held)
    queued_cost = cost.fixed_ms + cost.per_token_ms * per_queued
    crossover = math.floor((idle_ttft - warm_prefill) / queued_cost)  # deepest queue where warm still wins
    assert crossover == 19
    p = policy(EXACT)
    for depth, expected, reason in ((0, "warm", "warm"), (crossover, "warm", "warm"), (crossover + 1, "idle", "idle-recompute")):
        fleet = [view("warm", gpu=held, queued=depth, queued_tokens=depth * per_queued), view("idle")]
        decision = p.decide(request(prompt), fleet)
        assert (decision.replica, decision.reason) == (expected, reason), depth
        assert decision.ranked == [expected, "idle" if expected == "warm" else "warm"]


def test_recomputing_elsewhere_is_charged_the_delay_it_imposes_on_that_replicas_arrivals() -> None:
    # 4,352-token prompt, 4,096 held by "warm", which is busy with one cold prefill (20 + 0.035 x 3,800 ms ahead).
    # Predicted TTFT: warm 153 + 29 = 182 ms, idle 172 ms: on its own, the request would rather recompute.
    # But "idle" takes 2.5 requests/s: its 172 ms recompute holds up 2.5 x 0.172 arrivals by 86 ms each (~37 ms),
    # while the 29 ms warm prefill holds up "warm"'s arrivals ~12 ms: the 2.5 x 0.153 that line up behind it while
    # it waits wait all of it, the 2.5 x 0.029 during it half.
    prompt, held = 4352, 4096
    fleet = [
        view("warm", gpu=held, queued=1, queued_tokens=3800, arrival_rate_per_s=2.5),
        view("idle", arrival_rate_per_s=2.5),
    ]
    alone = policy(CostPolicyConfig(tie_margin=0, tie_margin_ms=0, session_bonus_ms=0, interference_weight=0))
    assert alone.decide(request(prompt), fleet).replica == "idle"
    decision = policy(EXACT).decide(request(prompt), fleet, explain=True)
    assert (decision.replica, decision.reason) == ("warm", "warm")
    rows = decision.details["replicas"]
    assert rows["idle"]["interference_ms"] == pytest.approx(2.5 * rows["idle"]["prefill_ms"] ** 2 / 2000)
    assert rows["warm"]["interference_ms"] == pytest.approx(2.5 * rows["warm"]["prefill_ms"] * (
        rows["warm"]["queue_delay_ms"] + rows["warm"]["prefill_ms"] / 2) / 1000)
    assert rows["idle"]["interference_ms"] > 30 > rows["warm"]["interference_ms"] > 10
    # the chosen replica's terms, which the gateway logs for the prediction audit
    assert decision.interference_ms == pytest.approx(rows["warm"]["interference_ms"])
    assert decision.load_ms == 0
    # An idle replica nobody sends to imposes on no one: the recompute wins again.
    quiet = [fleet[0], view("idle")]
    assert policy(EXACT).decide(request(prompt), quiet).replica == "idle"


def test_a_copy_onto_an_idle_replica_is_priced_at_the_fleets_mean_rate() -> None:
    # The holder of a 6,832-token document is still prefilling it (one request ahead): waiting there costs the
    # whole prefill again plus this request's own 128 new tokens, about 20 ms more than recomputing on a replica
    # nobody has sent anything yet. At that replica's own rate (zero) the copy looks free; but the copy makes it a
    # holder, and it will take its share of the fleet's traffic (mean 5.1 requests/s here, two other replicas are
    # busy): its 264 ms recompute then holds up ~180 ms of arrivals, so the request waits for the holder.
    doc, prompt = 6832, 6960
    holder = view("holder", gpu=doc, queued=1, queued_tokens=doc, arrival_rate_per_s=1.0)
    busy = [view(f"busy{i}", queued=3, queued_tokens=30_000, arrival_rate_per_s=20.0) for i in range(2)]
    idle = [view(f"idle{i}") for i in range(5)]
    decision = policy(EXACT).decide(request(prompt), [holder, *busy, *idle], explain=True)
    assert (decision.replica, decision.reason) == ("holder", "warm")
    rows = decision.details["replicas"]
    assert rows["holder"]["predicted_ttft_ms"] > rows["idle0"]["predicted_ttft_ms"]
    assert rows["idle0"]["arrival_rate_per_s"] == 0
    assert rows["idle0"]["expected_arrival_rate_per_s"] == pytest.approx(41 / 8)
    assert rows["holder"]["expected_arrival_rate_per_s"] == pytest.approx(1.0)


def test_cold_prompts_are_not_priced_at_the_fleets_mean_rate() -> None:
    # Nobody holds the prompt: no replica would make a copy, each is priced at its own rate.
    fleet = [view("busy", arrival_rate_per_s=12.0), view("quiet")]
    rows = policy(EXACT).decide(request(4000), fleet, explain=True).details["replicas"]
    assert rows["quiet"]["expected_arrival_rate_per_s"] == 0
    assert rows["quiet"]["interference_ms"] == 0


def test_cold_prompts_go_where_they_hold_up_the_fewest_arrivals() -> None:
    fleet = [view(f"r{i}", arrival_rate_per_s=rate) for i, rate in enumerate((3.0, 0.2, 2.0, 1.5))]
    for seed in range(20):
        decision = policy(CostPolicyConfig(), seed=seed).decide(request(4000), fleet)
        assert (decision.replica, decision.reason) == ("r1", "cold")


def test_session_reason_only_when_the_bonus_made_the_choice() -> None:
    # "hinted" is 37.5 ms slower to first token, but "busy" takes 5 requests/s: recomputing 4,000 tokens there would
    # hold them up by ~64 ms. "hinted" wins on that, not on its 10 ms session bonus, so its reason is its cache state.
    p = policy(CostPolicyConfig(tie_margin=0, tie_margin_ms=0, session_bonus_ms=10))
    fleet = [view("hinted", queued=1, queued_tokens=500, last_session_match=True), view("busy", arrival_rate_per_s=5.0)]
    assert (p.decide(request(4000), fleet).replica, p.decide(request(4000), fleet).reason) == ("hinted", "cold")


def test_a_new_session_is_priced_for_its_later_turns_where_it_starts() -> None:
    # A 4,000-token first turn whose 2,000-token system prompt "warm" holds; "warm" takes 3 requests/s, "idle" none.
    # The first turn alone: warm 90 ms (+12 ms it holds up warm's arrivals) against idle 160 ms (+19 ms): warm.
    # But the session's later turns follow it: 4 turns of ~90 ms each on a replica 27% busy cost the fleet ~158 ms
    # there (CostModel.session_load_ms), nothing on the idle replica. A session starting now goes to "idle".
    fleet = [view("warm", gpu=2000, arrival_rate_per_s=3.0), view("idle")]
    p = policy(EXACT)
    assert p.decide(request(4000, session_id="s"), fleet).replica == "warm"  # a session already placed
    decision = p.decide(request(4000, session_id="s", new_session=True), fleet, explain=True)
    assert (decision.replica, decision.reason) == ("idle", "new-session")
    rows = decision.details["replicas"]
    assert rows["idle"]["session_load_ms"] == 0.0
    assert rows["warm"]["session_load_ms"] == pytest.approx(model().session_load_ms(3.0, 90.0, 4))
    first_turn_alone = policy(CostPolicyConfig(tie_margin=0, tie_margin_ms=0, session_bonus_ms=0, session_turns_ahead=0))
    assert first_turn_alone.decide(request(4000, session_id="s", new_session=True), fleet).replica == "warm"
    # A tenant whose session ids never come back (a fresh one per request) has no later turns to price.
    never_back = request(4000, session_id="s", new_session=True, session_return_share=0.0)
    assert p.decide(never_back, fleet).replica == "warm"
    half = p.decide(request(4000, session_id="s", new_session=True, session_return_share=0.5), fleet, explain=True)
    assert half.details["replicas"]["warm"]["session_load_ms"] == pytest.approx(model().session_load_ms(3.0, 90.0, 2))


def test_a_new_session_goes_warm_when_every_replica_is_as_busy() -> None:
    # Equal load everywhere: the later turns cost the same wherever the session starts, so the warm system prompt
    # decides, and the reason is the cache, not the placement.
    fleet = [view("warm", gpu=2000, arrival_rate_per_s=3.0), view("cold", arrival_rate_per_s=3.0)]
    decision = policy(EXACT).decide(request(4000, session_id="s", new_session=True), fleet)
    assert (decision.replica, decision.reason) == ("warm", "warm")


def test_short_prefix_goes_warm_only_while_queue_is_tiny() -> None:
    # 500 cached tokens save 17.5 ms: one queued request (20 ms fixed) already costs more.
    p = policy(EXACT)
    assert p.decide(request(600), [view("warm", gpu=500), view("idle")]).replica == "warm"
    assert p.decide(request(600), [view("warm", gpu=500, queued=1, queued_tokens=10), view("idle")]).replica == "idle"


def test_lower_tiers_are_credited_at_load_cost() -> None:
    p = policy(EXACT)
    r = request(10_000)
    assert p.decide(r, [view("cpu", cpu=8000), view("cold")]).replica == "cpu"
    assert p.decide(r, [view("cpu", cpu=8000), view("gpu", gpu=8000)]).replica == "gpu"
    # Storage at 0.03 ms/token still beats recomputing at 0.035, CPU at 0.015 beats storage.
    assert p.decide(r, [view("storage", storage=8000), view("cpu", cpu=8000)]).replica == "cpu"
    assert p.decide(r, [view("storage", storage=8000), view("cold")]).replica == "storage"


def test_unhealthy_never_picked_while_a_healthy_one_exists() -> None:
    p = policy()
    fleet = [view("warm", healthy=False, gpu=9000), view("busy", queued=50, queued_tokens=100_000)]
    decision = p.decide(request(10_000), fleet, explain=True)
    assert decision.replica == "busy" and decision.ranked == ["busy"]
    assert "warm" not in decision.details["replicas"]
    everyone_down = [view("a", healthy=False), view("b", healthy=False, gpu=9000)]
    assert p.decide(request(10_000), everyone_down).replica == "b"


def test_near_ties_spread_randomly_then_by_load() -> None:
    p = policy(seed=7)
    cold = [view(name) for name in "abcd"]
    counts = Counter(p.decide(request(2000), cold).replica for _ in range(400))
    assert set(counts) == set("abcd") and min(counts.values()) > 60
    # Within the margin, the replica with less prefill to do wins, then the less loaded one.
    near = [view("a", gpu=100), view("b", queued=0), view("c", gpu=100, scraped_waiting=0, scraped_running=3)]
    counts = Counter(p.decide(request(2000), near).replica for _ in range(50))
    assert set(counts) == {"a"}
    # Two routers with different seeds do not all pick the same replica.
    firsts = {policy(seed=s).decide(request(2000), cold).replica for s in range(20)}
    assert len(firsts) > 1


def test_a_document_is_not_recomputed_while_its_holder_finishes_the_first_copy() -> None:
    # A 26,793-token document was just routed to "holder" (its blocks predicted there, its prefill still counted as
    # queued): waiting for that prefill costs this request about what recomputing on an idle replica would (within
    # the near-tie margin), so the request goes where nothing is recomputed, not to the less loaded idle replicas.
    doc = 26_793
    p = policy()
    fleet = [view("holder", predicted=doc - 137, queued=1, queued_tokens=doc), *(view(f"idle{i}") for i in range(4))]
    decisions = [p.decide(request(doc), fleet) for _ in range(50)]
    assert {(d.replica, d.reason) for d in decisions} == {("holder", "warm")}
    # Beyond the margin (a second document queued ahead as well), recomputing elsewhere is faster and wins.
    busier = [view("holder", predicted=doc - 137, queued=2, queued_tokens=2 * doc), view("idle")]
    assert p.decide(request(doc), busier).replica == "idle"


def test_session_bonus_is_soft() -> None:
    cm = model(prefill=PrefillCost(decode_ms_per_token=0.5))
    p = policy(CostPolicyConfig(tie_margin=0, tie_margin_ms=0, session_bonus_ms=10), cm)
    # 16 running sequences x 0.5 ms: 8 ms worse than "other", within the 10 ms bonus.
    close = view("session", last_session_match=True, scraped_waiting=0, scraped_running=16)
    decision = p.decide(request(1000), [close, view("other")])
    assert (decision.replica, decision.reason) == ("session", "session")
    # 10 queued requests (200+ ms) worse: the bonus does not pin the request.
    far = view("session", last_session_match=True, queued=10, queued_tokens=2000)
    assert p.decide(request(1000), [far, view("other")]).replica == "other"


def test_approximate_matches_count_less() -> None:
    exact = policy(EXACT)
    approximate = policy(CostPolicyConfig(tie_margin=0, tie_margin_ms=0, session_bonus_ms=0, approximate_match_weight=0.25))
    # warm saves 140 ms at full weight, 35 at a quarter; its queue costs 60.
    fleet = [view("warm", gpu=4000, queued=3), view("idle")]
    assert exact.decide(request(5000), fleet).replica == "warm"
    decision = approximate.decide(request(5000, approximate=True), fleet, explain=True)
    assert decision.replica == "idle"
    assert decision.details["replicas"]["warm"]["cached_tokens"] == 1000


def test_details_carry_per_replica_numbers_like_explain_helper() -> None:
    cm = model()
    p = policy(EXACT, cm)
    fleet = [view("warm", gpu=3000, queued=1, queued_tokens=500), view("idle")]
    r = request(4000)
    decision = p.decide(r, fleet, explain=True)
    rows = decision.details["replicas"]
    assert set(rows) == {"warm", "idle"}
    assert rows["warm"]["queue_delay_ms"] == pytest.approx(20 + 0.035 * 500)
    assert rows["warm"]["cached_tokens"] == 3000
    assert rows["idle"]["predicted_ttft_ms"] == pytest.approx(20 + 0.035 * 4000)
    assert rows == explain_replicas(r, fleet, cm)
    unexplained = p.decide(r, fleet)  # the request path: same choice, no numbers built
    assert (unexplained.replica, unexplained.reason, unexplained.details) == (decision.replica, decision.reason, {})


def test_transfer_candidates_are_explained_and_never_beat_routing_to_their_source() -> None:
    # The handshake waits in the source's queue, so pulling from a healthy source costs at least routing there.
    cm = model(TransferConfig(connector="nixl"), PrefillCost(per_token_ms=0.06))
    p = policy(EXACT, cm)
    r = request(40_016)
    for depth in (0, 10, 40, 200):
        fleet = [view("warm", gpu=40_000, queued=depth, queued_tokens=depth * 1000), view("idle")]
        decision = p.decide(r, fleet, explain=True)
        assert decision.action == "route"
        transfers = decision.details.get("transfers", [])
        for t in transfers:
            assert t["predicted_ttft_ms"] > decision.details["replicas"]["warm"]["predicted_ttft_ms"]
    # Idle source: the transfer to "idle" (~600 ms) is listed, 4x better than recomputing there.
    decision = p.decide(r, [view("warm", gpu=40_000), view("idle")], explain=True)
    (transfer,) = decision.details["transfers"]
    assert transfer["dest"] == "idle" and transfer["source"] == "warm"
    assert decision.details["replicas"]["idle"]["predicted_ttft_ms"] / transfer["predicted_ttft_ms"] > 3.5
