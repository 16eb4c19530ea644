"""Structured logs: one JSON object per line on stderr, so log shippers need no parsing rules.

Every proxied request produces exactly one ``kvgate.requests`` line at info level with the fields operators ask
about first (where it went, why, how much was cached, how fast the first token came). Other kvgate loggers use the
same JSON formatter so a deployment has one log format.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
import time
from typing import Any, BinaryIO

import msgspec

REQUEST_LOGGER = "kvgate.requests"

_encoder = msgspec.json.Encoder()


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra fields}``; a record's ``fields`` dict is merged in as is."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return _encoder.encode(line).decode()


FLUSH_INTERVAL_S = 0.5
"""Info lines reach stderr in batches at most this old (Envoy flushes its access logs every second)."""


class BatchedStreamHandler(logging.Handler):
    """Writes records, one JSON line each, to a buffered binary stream and flushes it every ``FLUSH_INTERVAL_S``
    from a daemon thread, and at once for warnings and errors.

    A ``StreamHandler`` on stderr costs a ``write`` system call per record, i.e. per request at info level; batching
    makes it one per half second. The stream is flushed at exit (``logging.shutdown``), so only a process killed
    outright loses its last half second of info lines. The request log writes its lines here directly
    (:meth:`write_line`), past the logging machinery.
    """

    def __init__(self, stream: BinaryIO) -> None:
        super().__init__()
        self.stream = stream
        threading.Thread(target=self._flush_periodically, name="kvgate-log-flush", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write_line(self.format(record).encode("utf-8", "backslashreplace"))
            if record.levelno >= logging.WARNING:
                self.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: report, never raise into the caller
            self.handleError(record)

    def write_line(self, line: bytes) -> None:
        with self.lock:  # type: ignore[union-attr]  # created by Handler.__init__
            self.stream.write(line + b"\n")

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self.stream.flush()

    def _flush_periodically(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            try:
                self.flush()
            except (OSError, ValueError):  # stderr closed or gone (shutdown, a dead pipe): nothing left to flush to
                return


_handler: BatchedStreamHandler | None = None
"""The JSON handler :func:`configure_logging` installed, which the request log writes to directly."""


def configure_logging(level: str = "info") -> None:
    """Send every log record to stderr as JSON (idempotent: replaces the root handlers), in batches
    (:class:`BatchedStreamHandler`).

    The JSON line has no thread, process or caller fields, so records skip collecting them (the logging HOWTO's
    "Optimization" switches)."""
    global _handler
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None  # no findCaller stack walk per record
    stderr = io.BufferedWriter(io.FileIO(sys.stderr.fileno(), "w", closefd=False), buffer_size=1 << 16)
    _handler = BatchedStreamHandler(stderr)
    _handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [_handler]
    root.setLevel(level.upper())


class RequestLogger:
    """Writes the one line per request; disabled by ``server.log_requests: false``.

    The line is the ``kvgate.requests`` logger's, in the same JSON shape as every record (:class:`JsonFormatter`),
    but written straight to the JSON handler when :func:`configure_logging` installed one: a ``LogRecord`` and the
    logging machinery around it cost more than the line itself, on every request."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._log = logging.getLogger(REQUEST_LOGGER)

    def reconfigure(self, enabled: bool) -> None:
        """``server.log_requests`` of a reloaded policy file."""
        self.enabled = enabled

    def request(self, **fields: Any) -> None:
        if not self.enabled or not self._log.isEnabledFor(logging.INFO):
            return
        handler = _handler
        if handler is None or handler not in logging.getLogger().handlers or not self._log.propagate \
                or self._log.handlers:
            self._log.info("request", extra={"fields": fields})
            return
        line: dict[str, Any] = {"ts": round(time.time(), 3), "level": "info", "logger": REQUEST_LOGGER,
                                "msg": "request"}
        line.update(fields)
        handler.write_line(_encoder.encode(line))
