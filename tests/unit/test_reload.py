"""Reload: a bad file keeps the old config and is counted; good files reach subscribers; the watcher and SIGHUP."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kvgate.router.core.errors import ConfigError
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.settings.schema import KvgateConfig
from tests.support import wait_until_async

GOOD = "replicas: [{name: a, url: 'http://127.0.0.1:9'}]\nhealth: {interval_s: 2}\n"
GOOD2 = "replicas: [{name: b, url: 'http://127.0.0.1:9'}]\nhealth: {interval_s: 3}\n"


def write(path: Path, text: str) -> None:
    path.write_text(text)
    # Make sure the watcher's (mtime, size) check sees a change even on coarse-grained filesystems.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_bad_file_at_startup_raises(tmp_path: Path) -> None:
    p = tmp_path / "kvgate.yaml"
    p.write_text("health: {interval_s: -1}\n")
    with pytest.raises(ConfigError, match=r"health.interval_s"):
        ConfigHolder(p)


@pytest.mark.parametrize(
    "bad",
    [
        "health: {interval_s: 0}\n",
        "replicas: [{name: a, url: 'ftp://x'}]\n",
        "nonsense_key: 1\n",
        "replicas: [\n",
        "tenants: {keys_file: /nonexistent/keys.txt}\n",
    ],
)
def test_bad_reload_keeps_old_config_and_counts(tmp_path: Path, bad: str) -> None:
    p = tmp_path / "kvgate.yaml"
    p.write_text(GOOD)
    holder = ConfigHolder(p)
    seen: list[KvgateConfig] = []
    holder.subscribe(seen.append)
    old = holder.current
    p.write_text(bad)
    assert holder.reload() is False
    assert holder.current is old
    assert (holder.reloads_ok, holder.reloads_rejected) == (0, 1)
    assert holder.last_error and str(p) in holder.last_error
    assert seen == []


def test_good_reload_notifies_subscribers_in_order_even_if_one_fails(tmp_path: Path) -> None:
    p = tmp_path / "kvgate.yaml"
    p.write_text(GOOD)
    holder = ConfigHolder(p)
    calls: list[str] = []

    def broken(cfg: KvgateConfig) -> None:
        calls.append("broken")
        raise RuntimeError("subscriber bug")

    holder.subscribe(broken)
    holder.subscribe(lambda cfg: calls.append(cfg.replicas[0].name))
    p.write_text(GOOD2)
    assert holder.reload() is True
    assert holder.current.health.interval_s == 3
    assert calls == ["broken", "b"]
    assert (holder.reloads_ok, holder.reloads_rejected) == (1, 0)


def test_transform_applies_to_every_load(tmp_path: Path) -> None:
    p = tmp_path / "kvgate.yaml"
    p.write_text(GOOD)

    def force_round_robin(cfg: KvgateConfig) -> KvgateConfig:
        return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"name": "round_robin"})})

    holder = ConfigHolder(p, transform=force_round_robin)
    assert holder.current.policy.name == "round_robin"
    p.write_text(GOOD2 + "policy: {name: cost}\n")
    assert holder.reload()
    assert holder.current.policy.name == "round_robin" and holder.current.replicas[0].name == "b"


def test_file_changed_ignores_touch_and_same_bytes(tmp_path: Path) -> None:
    p = tmp_path / "kvgate.yaml"
    p.write_text(GOOD)
    holder = ConfigHolder(p)
    assert not holder.file_changed()
    write(p, GOOD)
    assert not holder.file_changed()
    write(p, GOOD2)
    assert holder.file_changed()


async def test_watcher_reloads_on_change_and_does_not_retry_a_bad_file(tmp_path: Path) -> None:
    p = tmp_path / "kvgate.yaml"
    p.write_text(GOOD)
    holder = ConfigHolder(p, poll_interval_s=0.02)
    polls = 0
    looked = holder.file_changed

    def counted() -> bool:
        nonlocal polls
        polls += 1
        return looked()

    holder.file_changed = counted  # type: ignore[method-assign]
    await holder.start()
    try:
        write(p, GOOD2)
        await wait_until_async(lambda: holder.reloads_ok == 1)
        assert holder.current.replicas[0].name == "b"
        write(p, "health: {interval_s: -5}\n")
        await wait_until_async(lambda: holder.reloads_rejected == 1)
        seen = polls
        await wait_until_async(lambda: polls >= seen + 3)
        assert holder.reloads_rejected == 1  # the same bad bytes are not retried every poll
        assert holder.current.replicas[0].name == "b"
    finally:
        await holder.stop()


async def test_sighup_reloads(tmp_path: Path) -> None:
    p = tmp_path / "kvgate.yaml"
    p.write_text(GOOD)
    holder = ConfigHolder(p, poll_interval_s=60)
    await holder.start()
    try:
        p.write_text(GOOD2)
        os.kill(os.getpid(), signal.SIGHUP)
        await wait_until_async(lambda: holder.reloads_ok == 1)
        assert holder.current.replicas[0].name == "b"
    finally:
        await holder.stop()
