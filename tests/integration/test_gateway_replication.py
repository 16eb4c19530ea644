"""Hot-prefix replication executed by the gateway against a real sim fleet: a warm-up request makes a second replica
hold a hot prefix whose holder is busy; a cold prefix is never warmed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.test_gateway import MODEL, gateway_config, metric_value, sim_requests
from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sim, Gateway]]:
    workdir = tmp_path_factory.mktemp("replication")
    sim = start_sim(workdir, 2, "--time-scale", "1")
    try:
        config = gateway_config(
            sim, workdir, "kvgate.yaml",
            replication={"min_saving_ms_per_s": 20.0, "min_prefix_tokens": 64, "half_life_s": 10.0},
        )
        # prefix_affinity keeps every request of a matched prefix on its holder, so the holder gets busy
        gw = start_kvgate(workdir, config, "--policy", "prefix_affinity")
    except Exception:
        sim.stop()
        raise
    yield sim, gw
    gw.stop()
    sim.stop()


def warmups(sim: Sim) -> list[dict]:
    return [
        r for i in range(sim.replicas) for r in sim_requests(sim, i)
        if (r["headers"]["x-request-id"] or "").startswith("kvgate-warmup-")
    ]


def holders(gw: Gateway, prompt: str) -> set[str]:
    body = httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompt}, timeout=5).json()
    return {r["name"] for r in body["replicas"] if r["cached_tokens"]["gpu"] >= 256}


def test_cold_prefix_is_not_replicated_and_hot_prefix_is(fleet: tuple[Sim, Gateway]) -> None:
    sim, gw = fleet
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    cold = "a cold document nobody asks about twice " * 40
    for i in range(3):
        client.completions.create(model=MODEL, prompt=f"{cold} question {i}", max_tokens=2)
    hot = "the hot shared system prompt everyone uses " * 60

    async def bursts_until_warmed() -> None:
        # A warm-up is planned only while the holder's queue outweighs recomputing the prefix elsewhere. On a loaded
        # machine the client may not queue that much in one burst, so the prefix stays hot (bursts go on, each
        # request new) until a warm-up is seen or the deadline passes.
        aclient = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        sem = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            async with sem:
                await aclient.completions.create(model=MODEL, prompt=f"{hot} question {i}", max_tokens=20)

        deadline = time.monotonic() + 45
        sent = 0
        while time.monotonic() < deadline:
            await asyncio.gather(*(one(sent + i) for i in range(64)))
            sent += 64
            if await asyncio.to_thread(warmups, sim):
                break
        await aclient.close()

    asyncio.run(bursts_until_warmed())
    warmed = wait_until(lambda: warmups(sim), timeout=10)
    assert all(r["status"] == "completed" and r["completion_tokens"] == 1 for r in warmed)
    assert metric_value(gw, "kvgate_replication_started_total", reason="hot-prefix") >= 1
    assert metric_value(gw, "kvgate_warmup_tokens_total") >= 256
    wait_until(lambda: holders(gw, hot) == {"sim-0", "sim-1"}, timeout=10)
    # the cold document was never warmed anywhere: only one replica holds it
    assert len(holders(gw, cold)) == 1
    assert all(r["prompt_tokens"] >= 256 and r["prompt_tokens"] % 16 == 0 for r in warmed)
    # the prefix (> transfer.min_tokens, cheaper to move than to prefill) went by the NixlConnector handshake:
    # a prefill-only first leg on the holder, then the warm-up pulled the KV instead of recomputing it
    assert metric_value(gw, "kvgate_transfers_total", result="completed") >= 1
    first_legs = [r for r in warmed if (r["kv_transfer_params_in"] or {}).get("do_remote_decode")]
    pulls = [r for r in warmed if (r["kv_transfer_params_in"] or {}).get("do_remote_prefill")]
    assert first_legs and pulls and pulls[0]["transferred_tokens"] > 0

    # with two holders, the prefix's traffic spreads over both by itself
    async def second_burst() -> set[str]:
        aclient = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        sem = asyncio.Semaphore(16)

        async def one(i: int) -> str:
            async with sem:
                raw = await aclient.completions.with_raw_response.create(
                    model=MODEL, prompt=f"{hot} follow-up {i}", max_tokens=20
                )
                return raw.headers["x-kvgate-replica"]

        served = set(await asyncio.gather(*(one(i) for i in range(32))))
        await aclient.close()
        return served

    assert asyncio.run(second_burst()) == {"sim-0", "sim-1"}
