"""The documentation that is generated from code, and the links in it, stay true."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import policy_reference  # noqa: E402


def test_configuration_reference_matches_schema() -> None:
    assert policy_reference.documented() == policy_reference.reference(), (
        "docs/configuration.md is out of date: run python scripts/policy_reference.py --write"
    )


def test_markdown_links_resolve_inside_repository() -> None:
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (doc.parent / target).resolve()
            assert resolved.is_relative_to(REPO), f"{doc.name} links outside the repository: {target}"
            assert resolved.exists(), f"{doc.name} links to a missing file: {target}"
