"""Which packages the wheel holds; everything else about the project is in pyproject.toml.

The source folders ``router/``, ``policies/``, ``cache_index/`` and ``loadgen/`` install as ``kvgate.router``,
``kvgate.policies``, ``kvgate.cache_index`` and ``kvgate.loadgen``: the wheel owns one top-level name, ``kvgate`` (a
namespace package, so it needs no folder of its own). A build context without ``loadgen/`` (the Docker image's)
builds the gateway alone.
"""

from pathlib import Path

from setuptools import find_packages, setup

FOLDERS = ("router", "policies", "cache_index", "loadgen")
DATA = {"kvgate.loadgen.assets.tokenizer": ["*.json"]}
"""Folders of data files, installed as packages (setuptools' way) when their folder is in the wheel."""

HERE = Path(__file__).resolve().parent
present = [folder for folder in FOLDERS if (HERE / folder / "__init__.py").is_file()]
packages = [f"kvgate.{folder}{'.' + sub if sub else ''}"
            for folder in present for sub in ["", *find_packages(str(HERE / folder))]]
packages += [name for name in DATA if name.rsplit(".", 1)[0] in packages]
setup(
    package_dir={f"kvgate.{folder}": folder for folder in present},
    packages=packages,
    package_data={name: files for name, files in DATA.items() if name in packages},
)
