"""A :class:`Fleet` from a parsed policy file, built and reconfigured the way the gateway does it."""

from __future__ import annotations

import time
from typing import Callable

from kvgate.router.fleet.state import Fleet
from kvgate.router.settings.schema import KvgateConfig
from kvgate.router.upstream.client import EngineClient


def fleet_of(
    config: KvgateConfig, client: EngineClient, clock: Callable[[], float] = time.monotonic
) -> Fleet:
    return Fleet(config.replicas, client, health=config.health, scrape=config.scrape, breaker=config.breaker,
                 clock=clock)


def reconfigure(fleet: Fleet, config: KvgateConfig) -> None:
    fleet.reconfigure(config.replicas, health=config.health, scrape=config.scrape, breaker=config.breaker)
