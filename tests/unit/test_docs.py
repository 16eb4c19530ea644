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


ARCHITECTURE_DOCS = ("design.md", "development.md")
SOURCE_DIRS = ("router", "policies", "cache_index", "loadgen", "tests", "benchmarks", "scripts", "deploy")
HTTP_HEADERS = {"Authorization"}
"""Backticked words that name no code."""


def repository_paths() -> set[str]:
    """Every file and folder of the repository's own code, as ``a/b/c.py`` and ``a/b/`` (no virtualenv, no caches)."""
    paths: set[str] = set()
    for top in SOURCE_DIRS:
        for path in (REPO / top).rglob("*"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(REPO).as_posix()
            paths.add(rel + "/" if path.is_dir() else rel)
    paths.update(p.name for p in REPO.iterdir() if p.is_file())
    paths.update(f"{top}/" for top in SOURCE_DIRS)
    paths.update(f"docs/{p.name}" for p in (REPO / "docs").iterdir())
    return paths


def names_a_path(token: str) -> bool:
    """``pipeline/route.py``, ``asgi.py``, ``router/``, ``pyproject.toml``: a file or folder, by a path's last parts."""
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", token)) and (
        token.endswith("/") or re.search(r"\.(py|toml|md|yaml|yml|json|sh)$", token) is not None)


def test_architecture_docs_name_only_paths_modules_and_classes_that_exist() -> None:
    """Every backticked path, ``kvgate.`` module, ``CONSTANT`` and ``Class``/``Class.member`` in design.md and development.md is
    there in the code: these pages are read to find one's way, and a stale name sends a newcomer nowhere."""
    paths = repository_paths()
    source = "\n".join(p.read_text() for top in ("router", "policies", "cache_index", "loadgen")
                       for p in (REPO / top).rglob("*.py"))
    classes = set(re.findall(r"^\s*class (\w+)", source, re.M))
    missing: list[str] = []
    for name in ARCHITECTURE_DOCS:
        for token in re.findall(r"`([^`\n]+)`", (REPO / "docs" / name).read_text()):
            token = token.strip()
            if names_a_path(token):
                if not any(p == token or p.endswith("/" + token) for p in paths):
                    missing.append(f"{name}: path {token}")
            elif token.startswith("kvgate."):
                module = token.split(" ")[0].rstrip(".…")
                try:
                    __import__(module)
                except ImportError:
                    missing.append(f"{name}: module {token}")
            elif re.fullmatch(r"[A-Z][A-Z0-9_]+", token):
                if not re.search(rf"^\s*{token}\b[^=\n]*=", source, re.M):
                    missing.append(f"{name}: constant {token}")
            elif (match := re.fullmatch(r"([A-Z]\w+)(?:\.(\w+))?", token)) and token not in HTTP_HEADERS:
                cls, member = match.groups()
                defines = rf"\b(def|async def) {member}\b|^\s+(self\.)?{member}\s*[:=]"
                if cls not in classes:
                    missing.append(f"{name}: class {token}")
                elif member and not re.search(defines, source, re.M):
                    missing.append(f"{name}: member {token}")
    assert missing == [], "\n".join(missing)
