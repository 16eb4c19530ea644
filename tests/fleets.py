"""A :class:`Fleet` from a parsed policy file, built and reconfigured the way the gateway does it."""

from __future__ import annotations

import time
from typing import Callable

import aiohttp

from kvgate.router.fleet.state import Fleet
from kvgate.router.settings.schema import KvgateConfig


def fleet_of(
    config: KvgateConfig, session: aiohttp.ClientSession, clock: Callable[[], float] = time.monotonic
) -> Fleet:
    return Fleet(config.replicas, session, health=config.health, scrape=config.scrape, breaker=config.breaker,
                 clock=clock)


def reconfigure(fleet: Fleet, config: KvgateConfig) -> None:
    fleet.reconfigure(config.replicas, health=config.health, scrape=config.scrape, breaker=config.breaker)
