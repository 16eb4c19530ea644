"""Everything the repository refers to is inside it: a clone with nothing beside it works and reads the same."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

OUTSIDE = re.compile(
    r"\.\./shared\b"  # the folder beside the clone that background material came from
    r"|(?<![\w.~-])/(?:work|root)/"  # a workplace's or root's absolute paths
    r"|(?<![\w.~-])/(?:home|Users)/[A-Za-z]"  # someone's home directory
)
"""A path that only resolves on the machine it was written on. ``~/...`` (the reader's own home) is fine."""


def tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30).stdout
    return [REPO / name for name in listed.decode().split("\0") if name]


def outside_references(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except (UnicodeDecodeError, FileNotFoundError):  # binary files; a tracked file deleted in the work tree
        return []
    return [f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}"
            for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]


def test_no_tracked_file_refers_outside_the_repository() -> None:
    files = tracked_files()
    assert len(files) > 100
    assert [ref for f in files for ref in outside_references(f)] == []


def sample(*parts: str) -> str:
    """A sample line joined at run time, so this file's own text never matches what it tests."""
    return "/".join(parts)


OUTSIDE_SAMPLES = [sample("see ..", "shared", "docs", "DESIGN.md"), sample("cd ", "work", "main"),
                   sample("open ", "home", "alice", "x"), sample("", "root", ".cache"), sample("", "Users", "bob", "src")]
INSIDE_SAMPLES = [sample("~", ".cache", "kvgate", "engines-venv"), sample("", "usr", "local", "bin"),
                  sample("https:", "", "example.org", "work", "x"), sample("a", "home", "b")]


def test_the_pattern_finds_what_it_is_for() -> None:
    assert [line for line in OUTSIDE_SAMPLES + INSIDE_SAMPLES if OUTSIDE.search(line)] == OUTSIDE_SAMPLES
