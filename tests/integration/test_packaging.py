"""The wheel owns one top-level name, ``kvgate``; the Docker image's wheel is the gateway alone.

Docker is not needed: the image's build context is rebuilt from the Dockerfile's own ``COPY`` lines and built into a
wheel the same way (``pip``, setuptools from this environment, no network).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build_wheel(source: Path, out: Path) -> zipfile.ZipFile:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--wheel-dir", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    (wheel,) = out.glob("kvgate-*.whl")
    return zipfile.ZipFile(wheel)


def top_level_names(wheel: zipfile.ZipFile) -> set[str]:
    return {name.split("/")[0] for name in wheel.namelist() if ".dist-info/" not in name}


def required(wheel: zipfile.ZipFile) -> list[str]:
    """The dependencies a plain ``pip install`` pulls (no extra)."""
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    requires = Parser().parsestr(wheel.read(metadata).decode()).get_all("Requires-Dist") or []
    return [r for r in requires if "extra ==" not in r]


def docker_context(target: Path) -> Path:
    """The files the Dockerfile's build stage copies, at the same places."""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not line.startswith("COPY ") or "--from" in line:
            continue
        *sources, dest = line.split()[1:]
        for source in sources:
            place = target / source if dest in ("./", ".") else target / dest
            if (REPO / source).is_dir():
                shutil.copytree(REPO / source, place, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                place.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / source, place)
    return target


def test_the_wheel_installs_one_top_level_name(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "tests"))
    wheel = build_wheel(source, tmp_path / "dist")
    assert top_level_names(wheel) == {"kvgate"}
    names = wheel.namelist()
    for package in ("router", "policies", "cache_index", "loadgen", "loadgen/sim"):
        assert f"kvgate/{package}/__init__.py" in names
    assert "kvgate/loadgen/assets/tokenizer/tokenizer.json" in names


def test_the_docker_image_wheel_is_the_gateway_alone(tmp_path: Path) -> None:
    context = docker_context(tmp_path / "context")
    wheel = build_wheel(context, tmp_path / "dist")
    assert top_level_names(wheel) == {"kvgate"}
    packages = {n.split("/")[1] for n in wheel.namelist() if n.startswith("kvgate/")}
    assert packages == {"router", "policies", "cache_index"}
    dependencies = {re.split(r"[<>=\[; ]", r)[0].lower() for r in required(wheel)}
    assert {"uvicorn", "httptools", "uvloop"} <= dependencies
    assert not dependencies & {"matplotlib", "rich", "sortedcontainers", "cbor2"}
