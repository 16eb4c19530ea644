"""A tool stopped by SIGTERM (``kill``, ``timeout``) stops the processes it started, as on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from kvgate.loadgen.procs import ChildProcess
from tests.support import wait_until

DEADLINE_S = 20.0

TOOL = textwrap.dedent("""
    import signal, sys, time
    from kvgate.loadgen.procs import ChildProcess, interrupt_on_sigterm

    signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    child = ChildProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], None).start()
    try:
        print(child.pid, flush=True)
        time.sleep(600)
    finally:
        child.stop()
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_tool_stopped_by_sigterm_stops_what_it_started() -> None:
    tool = subprocess.Popen([sys.executable, "-c", TOOL], stdout=subprocess.PIPE, text=True)
    child_pid: int | None = None
    try:
        assert tool.stdout is not None
        pid = child_pid = int(tool.stdout.readline())
        assert alive(pid)
        tool.send_signal(signal.SIGTERM)
        assert tool.wait(timeout=DEADLINE_S) != 0
        wait_until(lambda: not alive(pid), "the child to stop", timeout=DEADLINE_S)
    finally:
        tool.kill()
        tool.wait(timeout=DEADLINE_S)
        if child_pid is not None and alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_a_child_runs_on_the_cpus_it_was_given() -> None:
    one = frozenset([min(os.sched_getaffinity(0))])
    child = ChildProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], None, cpus=one).start()
    try:
        assert os.sched_getaffinity(child.pid) == one
    finally:
        child.stop()
    unpinned = ChildProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], None).start()
    try:
        assert os.sched_getaffinity(unpinned.pid) == os.sched_getaffinity(0)
    finally:
        unpinned.stop()
