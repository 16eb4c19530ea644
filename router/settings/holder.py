"""The policy file in force, and hot reload of it (file change, SIGHUP, ``POST /admin/reload``).

A reload is all or nothing: the new file is parsed, validated for types and for meaning
(:func:`kvgate.router.settings.validate.check_meaning`) and only then made current and handed to the subscribers (the
gateway's :meth:`~kvgate.router.gateway.Gateway.reconfigure`, which hands each component its sections). A file that
fails leaves the old config in force; the rejection is logged and counted, and ``POST /admin/reload`` answers 400 with
the reason. Startup applies the same checks (exit code 2). Components swap what new requests pick up, so requests
already in flight keep what they started with.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
from pathlib import Path
from typing import Callable

from kvgate.router.core.errors import ConfigError
from kvgate.router.settings.schema import KvgateConfig, parse_config
from kvgate.router.settings.validate import check_meaning

log = logging.getLogger(__name__)

ConfigCallback = Callable[[KvgateConfig], None]


class ConfigHolder:
    def __init__(
        self,
        path: str | Path,
        *,
        transform: Callable[[KvgateConfig], KvgateConfig] | None = None,
        poll_interval_s: float = 1.0,
    ) -> None:
        """Load the file now; raises :class:`ConfigError` when it is bad (startup turns that into exit code 2).
        ``transform`` is applied to every loaded config, so CLI overrides (``--policy``) survive reloads."""
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.reloads_ok = 0
        self.reloads_rejected = 0
        self.last_error: str | None = None
        self._transform = transform
        self._subscribers: list[ConfigCallback] = []
        self._stat: tuple[int, int] | None = None
        self._digest = b""
        self._watch_task: asyncio.Task[None] | None = None
        self._sighup_loop: asyncio.AbstractEventLoop | None = None
        self.current: KvgateConfig = self._load(None)

    def subscribe(self, callback: ConfigCallback) -> None:
        """Call ``callback(new_config)`` after every accepted reload, in subscription order."""
        self._subscribers.append(callback)

    def reload(self) -> bool:
        """Re-read the file. True when the new config is in force; False when it was rejected (old one stays)."""
        try:
            config = self._load(self.current)
        except ConfigError as e:
            self.reloads_rejected += 1
            self.last_error = str(e)
            log.error("config reload rejected, keeping the previous config: %s", e)
            return False
        self.current = config
        self.reloads_ok += 1
        self.last_error = None
        log.info("config reloaded from %s", self.path)
        for callback in list(self._subscribers):
            try:
                callback(config)
            except Exception:  # one subscriber's bug must not stop the others from seeing the new config
                log.exception("config subscriber %r failed", callback)
        return True

    async def start(self) -> None:
        """Watch the file (poll) and reload on SIGHUP."""
        self._watch_task = asyncio.create_task(self._watch(), name="config-watch")
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self.reload)
            self._sighup_loop = loop
        except (NotImplementedError, RuntimeError, ValueError) as e:  # not the main thread, or no SIGHUP here
            log.warning("SIGHUP reload unavailable: %s", e)

    async def stop(self) -> None:
        if self._sighup_loop is not None:
            self._sighup_loop.remove_signal_handler(signal.SIGHUP)
            self._sighup_loop = None
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
            self._watch_task = None

    def file_changed(self) -> bool:
        """Cheap check first (mtime, size), then the content hash, so a ``touch`` or a rewrite with the same bytes
        does not reload, and a rejected file is not retried until it changes again."""
        stat = self._stat_file()
        if stat is None or stat == self._stat:
            return False
        self._stat = stat
        try:
            digest = hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return False
        return digest != self._digest

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            if self.file_changed():
                self.reload()

    def _load(self, previous: KvgateConfig | None) -> KvgateConfig:
        self._stat = self._stat_file()
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise ConfigError(f"{self.path}: cannot read: {e}") from e
        self._digest = hashlib.sha256(data).digest()
        try:
            text = data.decode()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{self.path}: not UTF-8 text: {e}") from e
        config = parse_config(text, str(self.path))
        if self._transform is not None:
            config = self._transform(config)
        try:
            check_meaning(config, previous)
        except ConfigError as e:
            raise ConfigError(f"{self.path}: {e}") from e
        return config

    def _stat_file(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size
